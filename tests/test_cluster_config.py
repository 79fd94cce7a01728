"""TF_CONFIG validation (case 001 and its variants) and the cluster rules that
follow TensorFlow (LocalCluster's lifecycle: tests/test_local_cluster.py)."""

import json
import time

import pytest

from tf_asyncps import cluster
from tf_asyncps.cluster import validate_tf_config

pytestmark = pytest.mark.timeout(120)

GOOD = {"cluster": {"chief": ["127.0.0.1:2000"], "ps": ["127.0.0.1:2001"],
                    "worker": ["127.0.0.1:2002", "127.0.0.1:2003"]},
        "task": {"type": "worker", "index": 1}}


def _with(**changes):
    cfg = json.loads(json.dumps(GOOD))
    for path, value in changes.items():
        node = cfg
        keys = path.split("__")
        for k in keys[:-1]:
            node = node[k]
        if value is _DELETE:
            del node[keys[-1]]
        else:
            node[keys[-1]] = value
    return cfg


_DELETE = object()

# (TF_CONFIG, words naming the field at fault, words giving the fix)
BAD = [
    # case 001 as reported: no chief
    ({"cluster": {"ps": ["127.0.0.1:2001"], "worker": ["127.0.0.1:2002", "127.0.0.1:2003"]},
      "task": {"type": "worker", "index": 0}}, ['no "chief" task', '"worker"'],
     ['add "chief": ["host:port"]']),
    (_with(cluster__ps=[]), ['cluster["ps"] is an empty list'], ['at least one "host:port"']),
    (_with(cluster__worker=[]), ['cluster["worker"] is an empty list'], ["at least one"]),
    (_with(cluster__chief=[]), ['cluster["chief"] is an empty list'], ["at least one"]),
    (_with(cluster__ps=_DELETE), ['no "ps" task'], ['add "ps": ["host:port"]']),
    (_with(cluster__worker=_DELETE), ['no "worker" task'], ['add "worker": ["host:port"]']),
    (_with(cluster__chief=_DELETE), ['no "chief" task'], ['add "chief": ["host:port"]']),
    (_with(task__index=2), ["index 2 is out of range"], ["0..1"]),
    (_with(task__index=-1), ["index -1 is out of range"], ["0..1"]),
    (_with(task__index="0"), ['"index" is \'0\''], ["an integer such as 0"]),
    (_with(task__index=True), ['"index" is True'], ["an integer such as 0"]),
    (_with(task__index=1.0), ['"index" is 1.0'], ["an integer such as 0"]),
    (_with(task__index=None), ['"index" is None'], ["an integer such as 0"]),
    (_with(task__type="master"), ['"type" is \'master\''], ['name it "chief"']),
    (_with(task__type=None), ['"type" is None'], ["must be one of ['chief', 'ps', 'worker']"]),
    (_with(task__type="gpu_worker"), ["'gpu_worker'"], ["must be one of"]),
    (_with(task__type="evaluator", cluster__evaluator=["127.0.0.1:2011"]),
     ['task is an "evaluator"'], ["separate evaluation job"]),
    (_with(cluster__master=["127.0.0.1:2009"]), ['unknown job "master"'], ['name it "chief"']),
    (_with(cluster__workers=["127.0.0.1:2009"]), ['unknown job "workers"'],
     ['called "worker" (singular)']),
    (_with(cluster__parameter_server=["127.0.0.1:2009"]),
     ['unknown job "parameter_server"'], ['called "ps"']),
    (_with(cluster__worker=["127.0.0.1:2002", "127.0.0.1"]),
     ['cluster["worker"][1] = "127.0.0.1"'], ['write it like "10.0.0.2:2222"']),
    (_with(cluster__worker=["127.0.0.1:2002", "127.0.0.1:99999"]),
     ['cluster["worker"][1]'], ["port in 1..65535"]),
    (_with(cluster__worker=["127.0.0.1:2002", "127.0.0.1:70000"]),
     ['cluster["worker"][1] = "127.0.0.1:70000"'], ["port in 1..65535"]),
    (_with(cluster__ps=["127.0.0.1:0"]), ['cluster["ps"][0] = "127.0.0.1:0"'],
     ["port in 1..65535"]),
    (_with(cluster__ps=["127.0.0.1:-1"]), ['cluster["ps"][0]'], ["port in 1..65535"]),
    (_with(cluster__ps=["127.0.0.1:22a"]), ['cluster["ps"][0]'], ["host:port"]),
    (_with(cluster__ps=[":2001"]), ['cluster["ps"][0] = ":2001"'], ["host:port"]),
    (_with(cluster__ps=["[::1]"]), ['cluster["ps"][0] = "[::1]"'], ['"[::1]:2222"']),
    (_with(cluster__worker=["127.0.0.1:2002", "host name:1"]), ['"host name:1"'],
     ["host:port"]),
    (_with(cluster__worker=["127.0.0.1:2002", 2003]), ['cluster["worker"][1] = 2003'],
     ['write it as "host:port"']),
    (_with(cluster__chief=[None]), ['cluster["chief"][0] = None'],
     ['write it as "host:port"']),
    (_with(cluster__worker=["127.0.0.1:2002", "127.0.0.1:2002"]),
     ['"127.0.0.1:2002" is used twice', "worker:0 and worker:1"], ["its own port"]),
    (_with(cluster__worker=["127.0.0.1:2002", "localhost:2001"]), ["used twice", "ps:0"],
     ["its own port"]),
    (_with(cluster__chief=["127.0.0.1:2000", "127.0.0.1:2010"]),
     ['cluster["chief"] has 2 addresses'], ["keep one address"]),
    (_with(cluster__ps="127.0.0.1:2001"), ['cluster["ps"] must be a list'], ['"host:port"']),
    (_with(cluster__evaluator=["127.0.0.1"]), ['cluster["evaluator"][0]'], ["host:port"]),
    (_with(cluster=_DELETE), ['"cluster" is missing'], ['maps "chief", "ps" and "worker"']),
    (_with(cluster={}), ['"cluster" is missing or empty'], ['maps "chief"']),
    (_with(task=_DELETE), ['"task" is missing'], ['add "task": {"type": "worker"']),
    (_with(task=["worker", 0]), ['"task" must be an object'], ['{"type": "worker"']),
    (_with(rpc_layer="grpc+verbs"), ["\"rpc_layer\" is 'grpc+verbs'"],
     ['set "rpc_layer": "grpc" or leave it out']),
    ('{"cluster": {"chief": ["a:1"]', ["not valid JSON"], ["Check the quoting"]),
    ("{'cluster': {}}", ["not valid JSON"], ["Check the quoting"]),
    ("[1, 2]", ["must be a JSON object"], ['with "cluster" and "task"']),
]


@pytest.mark.parametrize("tf_config,field,fix", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_tf_config_fails_fast_with_a_clear_message(tf_config, field, fix):
    t0 = time.perf_counter()
    with pytest.raises(ValueError) as e:
        validate_tf_config(tf_config if isinstance(tf_config, str) else json.dumps(tf_config))
    assert time.perf_counter() - t0 < 2.0
    msg = str(e.value)
    assert msg.startswith("Invalid TF_CONFIG: "), msg
    for w in field + fix:
        assert w in msg, msg
    if isinstance(tf_config, dict) and tf_config.get("cluster"):
        assert "cluster read from TF_CONFIG" in msg  # shows what it read


def test_bad_tf_config_variants_are_distinct():
    keys = [t if isinstance(t, str) else json.dumps(t, sort_keys=True) for t, _, _ in BAD]
    assert len(set(keys)) == len(BAD) >= 20


def test_case_001_no_chief_shows_the_cluster_it_read():
    cfg = BAD[0][0]
    with pytest.raises(ValueError) as e:
        validate_tf_config(json.dumps(cfg))
    assert json.dumps(cfg["cluster"]) in str(e.value)


def test_good_config_and_evaluator_is_ignored():
    c = validate_tf_config(_with(cluster__evaluator=["127.0.0.1:2011"]))
    assert (c.task_type, c.task_id) == ("worker", 1)
    assert c.num_workers == 2 and c.num_ps == 1
    assert c.jobs == ["chief", "ps", "worker"]  # evaluator not in training cluster
    assert c.evaluators == ["127.0.0.1:2011"]
    assert c.cluster_spec().num_tasks("worker") == 2
    assert validate_tf_config(_with(cluster__worker=["[::1]:2002"], task__index=0)).num_workers == 1


def test_tf_config_unset(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    with pytest.raises(ValueError, match="TF_CONFIG is not set"):
        cluster.tf_config_from_env()


def test_inter_op_threads_cover_num_workers_plus_one():
    for n in (1, 2, 4, 16):
        assert cluster.inter_op_threads(n) >= n + 1
    assert cluster.server_config(4).inter_op_parallelism_threads >= 5


def test_wait_for_tasks_names_the_unreachable_task():
    import portpicker
    port = portpicker.pick_unused_port()
    cfg = validate_tf_config(_with(cluster__ps=[f"127.0.0.1:{port}"]))
    t0 = time.perf_counter()
    with pytest.raises(TimeoutError, match=rf"ps:0 at 127.0.0.1:{port}"):
        cluster.wait_for_tasks(cfg, timeout_s=1.0, jobs=("ps",))
    assert time.perf_counter() - t0 < 5


# -- the "chief" rule (issue 14): follows TensorFlow -------------------------------
CHIEFLESS = {"ps": ["127.0.0.1:2001"], "worker": ["127.0.0.1:2002", "127.0.0.1:2003"]}


def test_a_coordinator_with_no_task_may_leave_out_the_chief():
    # TensorFlow's in-process clusters: the calling process is the coordinator
    # and ParameterServerStrategy adds a local "chief" job itself.
    c = validate_tf_config({"cluster": CHIEFLESS}, require_task=False, require_chief=False)
    assert c.task_type is None and c.jobs == ["ps", "worker"]
    assert c.num_workers == 2 and c.num_ps == 1


@pytest.mark.parametrize("task", [{"type": "worker", "index": 0}, {"type": "ps", "index": 0},
                                  {"type": "chief", "index": 0}])
def test_a_task_named_in_a_chiefless_tf_config_is_still_refused(task):
    # case 001 and its variants: a ps/worker (or a chief) started from a
    # TF_CONFIG with no "chief" job stalls training, so it stays an error.
    with pytest.raises(ValueError) as e:
        validate_tf_config({"cluster": CHIEFLESS, "task": task})
    assert 'no "chief" task' in str(e.value) and 'add "chief": ["host:port"]' in str(e.value)


def test_a_chief_task_without_a_chief_job_is_named():
    with pytest.raises(ValueError) as e:
        validate_tf_config({"cluster": CHIEFLESS, "task": {"type": "chief", "index": 0}},
                           require_chief=False, source="SimpleClusterResolver.cluster_spec()")
    msg = str(e.value)
    assert msg.startswith("Invalid SimpleClusterResolver.cluster_spec(): this task is \"chief\"")
    assert "give the coordinator no task" in msg
    assert "cluster read from SimpleClusterResolver.cluster_spec(): " + json.dumps(CHIEFLESS) in msg
    assert "TF_CONFIG" not in msg


# Clusters both strategies refuse, with vanilla's words; ours says more, and
# raises the same type (ValueError), before any connection is tried.
REFUSED = [
    ("two_chiefs", {"chief": ["localhost:1", "localhost:2"], **CHIEFLESS}, None,
     "at most one 'chief'", 'cluster["chief"] has 2 addresses'),
    ("unknown_job", {"chief": ["localhost:1"], "trainer": ["localhost:5"], **CHIEFLESS}, None,
     "Disallowed task type", 'unknown job "trainer"'),
    ("no_ps", {"chief": ["localhost:1"], "worker": ["localhost:4"]}, None,
     "at least one ps", 'no "ps" task'),
    ("no_worker", {"chief": ["localhost:1"], "ps": ["localhost:3"]}, None,
     "at least one worker", 'no "worker" task'),
    ("chief_task_without_chief_job", CHIEFLESS, "chief",
     "'chief' not found in cluster_spec", 'this task is "chief" but the cluster has no "chief"'),
]


@pytest.mark.parametrize("name,spec,task_type,vanilla_words,our_words", REFUSED,
                         ids=[r[0] for r in REFUSED])
def test_refused_clusters_raise_what_vanilla_raises(name, spec, task_type, vanilla_words,
                                                    our_words):
    import tensorflow as tf
    import tf_asyncps

    def resolver():
        return tf.distribute.cluster_resolver.SimpleClusterResolver(
            tf.train.ClusterSpec(spec), task_type=task_type,
            task_id=0 if task_type else None, rpc_layer="grpc")

    with pytest.raises(ValueError, match=vanilla_words.replace("(", r"\(").replace(")", r"\)")):
        tf.distribute.ParameterServerStrategy(resolver())
    with pytest.raises(ValueError) as e:
        tf_asyncps.AsyncParameterServerStrategy(resolver())
    msg = str(e.value)
    assert our_words in msg, msg
    assert msg.startswith("Invalid SimpleClusterResolver.cluster_spec(): "), msg
