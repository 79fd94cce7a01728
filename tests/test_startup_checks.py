"""Start-up checks (issue 6): a bad TF_CONFIG fails before TensorFlow is
imported, a port that is not a TF gRPC server is named instead of hanging,
evaluator jobs are left out, and a task refuses an address that is not its
host's (security: the servers are unauthenticated)."""

import http.server
import json
import logging
import os
import pathlib
import socket
import subprocess
import sys
import threading
import time

import portpicker
import pytest

from conftest import ROOT, run_command, stop_process, subprocess_env, wait_dead
from tf_asyncps import cluster
from tf_asyncps.cluster import validate_tf_config

pytestmark = pytest.mark.timeout(120)

FOREIGN = "203.0.113.77"  # TEST-NET-3 (RFC 5737): never a real host's address


def _config(ps="127.0.0.1:2001", worker="127.0.0.1:2002", chief="127.0.0.1:2000",
            task=("worker", 0), **extra):
    cfg = {"cluster": {"chief": [chief], "ps": [ps], "worker": [worker], **extra},
           "task": {"type": task[0], "index": task[1]}}
    return cfg


def _cli(*args, tf_config, timeout=60, block_tensorflow=None):
    """Runs ``python -m tf_asyncps ARGS``; ``block_tensorflow`` (a directory)
    puts a ``tensorflow`` package there first on the path whose import fails
    loudly, so a command that imports TensorFlow before its checks says so."""
    env = subprocess_env()
    env["TF_CONFIG"] = tf_config if isinstance(tf_config, str) else json.dumps(tf_config)
    if block_tensorflow is not None:
        stub = os.path.join(block_tensorflow, "tensorflow")
        os.makedirs(stub, exist_ok=True)
        with open(os.path.join(stub, "__init__.py"), "w") as f:
            f.write("raise ImportError('TENSORFLOW IMPORTED BEFORE THE CHECK')\n")
        env["PYTHONPATH"] = block_tensorflow + os.pathsep + env["PYTHONPATH"]
    t0 = time.perf_counter()
    rc, out = run_command([sys.executable, "-m", "tf_asyncps", *args], timeout=timeout,
                          env=env, check=False)
    return rc, out, time.perf_counter() - t0


@pytest.fixture(autouse=True)
def _fresh_warnings(monkeypatch):
    monkeypatch.setattr(cluster.config, "_WARNED", set())  # warn-once state


# -- a malformed TF_CONFIG fails before TensorFlow is imported --------------

CLI_BAD = [
    ({"cluster": {"ps": ["127.0.0.1:2001"], "worker": ["127.0.0.1:2002"]},
      "task": {"type": "worker", "index": 0}}, 'no "chief" task'),
    ('{"cluster": {"chief": ["127.0.0.1:2000"]', "not valid JSON"),
    (_config(ps="127.0.0.1:70000"), 'cluster["ps"][0] = "127.0.0.1:70000"'),
    (_config(workers=["127.0.0.1:2003"]), 'unknown job "workers"'),
    (_config(task=("worker", 3)), "task index 3 is out of range"),
]


@pytest.mark.parametrize("command", ["train", "server"])
@pytest.mark.parametrize("tf_config,words", CLI_BAD, ids=[str(i) for i in range(len(CLI_BAD))])
def test_cli_fails_on_bad_tf_config_before_importing_tensorflow(command, tf_config, words,
                                                                 tmp_path):
    # Fast because TensorFlow (seconds to import) is never imported: checked
    # with a tensorflow package that fails to import, not with a clock.
    rc, out, _ = _cli(command, tf_config=tf_config, block_tensorflow=str(tmp_path))
    assert rc == 1 and f"tf-asyncps {command}: error: Invalid TF_CONFIG" in out, out
    assert words in out, out
    assert "Traceback" not in out and "TENSORFLOW IMPORTED" not in out, out


def test_cli_validates_before_importing_tensorflow():
    code = ("import sys\n"
            "sys.argv = ['tf-asyncps', 'train']\n"
            "from tf_asyncps.app import cli\n"
            "try:\n    cli.run()\nexcept SystemExit as e:\n    print('EXIT', e.code)\n"
            "print('TF_IMPORTED', 'tensorflow' in sys.modules)\n")
    env = subprocess_env()
    env["TF_CONFIG"] = json.dumps(_config(ps="127.0.0.1:0"))
    _, out = run_command([sys.executable, "-c", code], timeout=60, env=env)
    assert 'cluster["ps"][0] = "127.0.0.1:0"' in out
    assert "TF_IMPORTED False" in out, out


# -- the gRPC handshake probe -----------------------------------------------

@pytest.mark.cluster
def test_probe_passes_for_a_real_tensorflow_server_and_evaluator_is_left_out(tmp_path):
    """A real `tf-asyncps server` (tf.distribute.Server) in a subprocess. Its
    TF_CONFIG names an evaluator at a silent port: the server must ignore it."""
    ports = [portpicker.pick_unused_port() for _ in range(4)]
    silent = socket.create_server(("127.0.0.1", ports[3]), backlog=4)  # never accepts
    cfg = _config(ps=f"127.0.0.1:{ports[0]}", worker=f"127.0.0.1:{ports[1]}",
                  chief=f"127.0.0.1:{ports[2]}", task=("ps", 0),
                  evaluator=[f"127.0.0.1:{ports[3]}"])
    env = subprocess_env()
    env["TF_CONFIG"] = json.dumps(cfg)
    log = tmp_path / "ps.log"
    with open(log, "wb") as f:
        p = subprocess.Popen([sys.executable, "-m", "tf_asyncps", "server"], env=env,
                             cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                             start_new_session=True)
    try:
        config = validate_tf_config(cfg)
        cluster.wait_for_tasks(config, timeout_s=60, jobs=("ps",), procs={"ps:0": p})
        assert cluster.probe_grpc(f"127.0.0.1:{ports[0]}") == (cluster.PROBE_OK, "")
        assert p.poll() is None
    finally:
        stop_process(p)
        silent.close()
    wait_dead([p.pid])
    text = log.read_text()
    assert f"serving ps:0 at 127.0.0.1:{ports[0]}" in text, text
    assert text.count("TF_CONFIG lists evaluator task(s)") == 1, text
    assert "SECURITY" not in text  # every address is loopback


def test_silent_open_port_is_named_within_the_timeout():
    port = portpicker.pick_unused_port()
    with socket.create_server(("127.0.0.1", port), backlog=4):  # accepts, says nothing
        assert cluster.probe_grpc(f"127.0.0.1:{port}", timeout=0.5)[0] == cluster.PROBE_SILENT
        config = validate_tf_config(_config(ps=f"127.0.0.1:{port}"))
        t0 = time.perf_counter()
        with pytest.raises(TimeoutError) as e:
            cluster.wait_for_tasks(config, timeout_s=1.5, jobs=("ps",))
        seconds = time.perf_counter() - t0
    assert (f"ps:0 at 127.0.0.1:{port} answers but is not a TensorFlow gRPC server"
            in str(e.value))
    assert "no HTTP/2 SETTINGS frame" in str(e.value)
    assert 1.5 <= seconds < 3.5, seconds


def test_http_server_is_named_at_once():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        addr = f"127.0.0.1:{server.server_address[1]}"
        config = validate_tf_config(_config(ps=addr))
        t0 = time.perf_counter()
        with pytest.raises(RuntimeError) as e:
            cluster.wait_for_tasks(config, timeout_s=30, jobs=("ps",))
        seconds = time.perf_counter() - t0
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
    msg = str(e.value)
    assert f"ps:0 at {addr} answers but is not a TensorFlow gRPC server" in msg
    assert "it answered b'" in msg and "not an HTTP/2 SETTINGS frame" in msg
    assert "Another program holds that port" in msg
    assert seconds < 1.0, seconds


def test_unreachable_and_silent_tasks_are_each_named_within_the_timeout():
    dead, quiet = portpicker.pick_unused_port(), portpicker.pick_unused_port()
    with socket.create_server(("127.0.0.1", quiet), backlog=4):
        config = validate_tf_config(_config(ps=f"127.0.0.1:{dead}",
                                            worker=f"127.0.0.1:{quiet}"))
        t0 = time.perf_counter()
        with pytest.raises(TimeoutError) as e:
            cluster.wait_for_tasks(config, timeout_s=1.0)
        seconds = time.perf_counter() - t0
    msg = str(e.value)
    assert f"cannot reach ps:0 at 127.0.0.1:{dead}" in msg
    assert f"worker:0 at 127.0.0.1:{quiet} answers but is not" in msg
    assert "after 1 s" in msg and "--connect_timeout_s" in msg
    assert 1.0 <= seconds < 3.0, seconds


# -- evaluator jobs ----------------------------------------------------------

def test_evaluator_is_left_out_of_the_resolver_with_one_warning(caplog):
    caplog.set_level(logging.WARNING)
    cfg = validate_tf_config(_config(task=("chief", 0), evaluator=["127.0.0.1:2011"]))
    resolver = cluster.cluster_resolver(cfg)
    cluster.cluster_resolver(cfg)
    assert resolver.cluster_spec().as_dict() == {
        "chief": ["127.0.0.1:2000"], "ps": ["127.0.0.1:2001"], "worker": ["127.0.0.1:2002"]}
    assert (resolver.task_type, resolver.task_id, resolver.rpc_layer) == ("chief", 0, "grpc")
    warnings = [r.getMessage() for r in caplog.records if "evaluator" in r.getMessage()]
    assert len(warnings) == 1 and "['127.0.0.1:2011']" in warnings[0], warnings


# -- security: exposure warning, own address ---------------------------------

@pytest.mark.parametrize("host,loopback", [
    ("127.0.0.1", True), ("127.3.2.1", True), ("localhost", True), ("[::1]", True),
    ("::1", True), ("LOCALHOST", True), ("10.0.0.2", False), ("host-a", False),
    ("[fd00::2]", False), ("0.0.0.0", False)])
def test_is_loopback(host, loopback):
    assert cluster.is_loopback(host) is loopback


def test_non_loopback_cluster_warns_once_with_the_addresses(caplog):
    caplog.set_level(logging.WARNING)
    cfg = validate_tf_config(_config(worker="10.0.0.7:2222", evaluator=["host-e:1"]))
    assert cluster.exposed_addresses(cfg) == ["worker:0 at 10.0.0.7:2222",
                                              "evaluator:0 at host-e:1"]
    assert cluster.warn_if_exposed(cfg) is True
    assert cluster.warn_if_exposed(cfg) is False  # once per process
    msgs = [r.getMessage() for r in caplog.records if "SECURITY" in r.getMessage()]
    assert len(msgs) == 1
    assert "worker:0 at 10.0.0.7:2222" in msgs[0] and "evaluator:0 at host-e:1" in msgs[0]
    assert ".github/SECURITY.md" in msgs[0] and msgs[0].count("\n") >= 5


def test_loopback_cluster_does_not_warn(caplog):
    caplog.set_level(logging.WARNING)
    cfg = validate_tf_config(_config(worker="localhost:2222", ps="[::1]:2001"))
    assert cluster.exposed_addresses(cfg) == []
    assert cluster.warn_if_exposed(cfg) is False
    assert not [r for r in caplog.records if "SECURITY" in r.getMessage()]


def _local_non_loopback_ip():
    """An IPv4 address of a local interface, found with a UDP connect (sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("198.51.100.1", 9))
        except OSError:
            return None
        ip = s.getsockname()[0]
    return None if cluster.is_loopback(ip) or ip == "0.0.0.0" else ip


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "[::1]", "0.0.0.0",
                                  socket.gethostname(), "local-interface-ip"])
def test_own_address_of_this_host_passes(host):
    if host == "local-interface-ip":
        host = _local_non_loopback_ip()
        if host is None:
            pytest.skip("this machine has no non-loopback IPv4 address")
    cfg = validate_tf_config(_config(worker=f"{host}:2222"))
    t0 = time.perf_counter()
    cluster.check_own_address(cfg)  # no error
    assert cluster.host_is_local(host.strip("[]"))
    assert time.perf_counter() - t0 < 2.0


def test_foreign_own_address_fails_unless_allowed():
    with socket.socket() as s, pytest.raises(OSError):  # premise: FOREIGN is not ours
        s.bind((FOREIGN, 0))
    cfg = validate_tf_config(_config(worker=f"{FOREIGN}:2222", ps=f"{FOREIGN}:2223"))
    t0 = time.perf_counter()
    with pytest.raises(ValueError) as e:
        cluster.check_own_address(cfg)
    assert time.perf_counter() - t0 < 2.0
    msg = str(e.value)
    assert f'this task is worker:0, but its address cluster["worker"][0] = "{FOREIGN}:2222"' \
        in msg and "is not an address of this host" in msg
    assert "--allow_foreign_address" in msg
    cluster.check_own_address(cfg, allow_foreign=True)  # the override
    # Only this task's own address matters: a foreign ps is fine for the chief.
    cluster.check_own_address(validate_tf_config(_config(ps=f"{FOREIGN}:2223",
                                                         task=("chief", 0))))


def test_unresolvable_own_address_fails_with_the_name():
    cfg = validate_tf_config(_config(ps="no-such-host.invalid:2001", task=("ps", 0)))
    t0 = time.perf_counter()
    with pytest.raises(ValueError) as e:
        cluster.check_own_address(cfg, timeout_s=1.0)
    assert time.perf_counter() - t0 < 2.0
    msg = str(e.value)
    assert 'host "no-such-host.invalid" does not resolve' in msg
    assert 'cluster["ps"][0] = "no-such-host.invalid:2001"' in msg
    assert "--allow_foreign_address" in msg


@pytest.mark.cluster
def test_cli_server_refuses_a_foreign_own_address_fast():
    rc, out, seconds = _cli("server", tf_config=_config(worker=f"{FOREIGN}:2222"))
    assert rc == 1 and f'cluster["worker"][0] = "{FOREIGN}:2222"' in out, out
    assert "is not an address of this host" in out and "--allow_foreign_address" in out
    assert "Traceback" not in out and seconds < 2.0


@pytest.mark.cluster
def test_cli_allow_foreign_address_passes_the_check_and_warns_once():
    # The chief's own address is foreign; with the flag it passes the check
    # and stops at the next bad input (--hidden), before training starts.
    rc, out, _ = _cli("train", "--allow_foreign_address", "--hidden=x",
                      tf_config=_config(chief=f"{FOREIGN}:2220", task=("chief", 0)))
    assert rc != 0 and "--hidden must be integers" in out, out
    assert "is not an address of this host" not in out
    assert out.count("*** SECURITY: this cluster has non-loopback addresses: "
                     f"chief:0 at {FOREIGN}:2220") == 1, out
    assert out.count(".github/SECURITY.md") == 1


def test_security_docs_and_network_policy():
    root = pathlib.Path(ROOT)
    readme = (root / "README.md").read_text()
    assert "(.github/SECURITY.md)" in readme and "(configs/k8s_networkpolicy.yaml)" in readme
    security = (root / ".github" / "SECURITY.md").read_text()
    for words in ("unauthenticated", "*:port", "NetworkPolicy", "--allow_foreign_address",
                  "unshare --net"):
        assert words in security, words
    yaml = pytest.importorskip("yaml")
    policy = yaml.safe_load((root / "configs" / "k8s_networkpolicy.yaml").read_text())
    assert policy["kind"] == "NetworkPolicy"
    spec = policy["spec"]
    job = spec["podSelector"]["matchLabels"]
    assert list(job) == ["tf-asyncps/job"] and spec["policyTypes"] == ["Ingress"]
    # The only ingress rule: from pods of the same job.
    assert spec["ingress"] == [{"from": [{"podSelector": {"matchLabels": job}}]}]


def test_the_strategy_timeout_names_the_argument_the_caller_used():
    # The Python API's TimeoutError told a caller of connect_timeout_s= to
    # change --connect_timeout_s (the CLI's flag).
    import tensorflow as tf
    import tf_asyncps
    ps, worker, chief = (portpicker.pick_unused_port() for _ in range(3))
    spec = tf.train.ClusterSpec({"ps": [f"127.0.0.1:{ps}"],
                                 "worker": [f"127.0.0.1:{worker}"],
                                 "chief": [f"127.0.0.1:{chief}"]})
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        spec, task_type="chief", task_id=0, rpc_layer="grpc")
    with pytest.raises(TimeoutError) as e:
        tf_asyncps.AsyncParameterServerStrategy(resolver, connect_timeout_s=0.5)
    msg = str(e.value)
    assert msg.endswith("(to wait longer: AsyncParameterServerStrategy(connect_timeout_s=...))")
    assert "--connect_timeout_s" not in msg
    assert f"cannot reach ps:0 at 127.0.0.1:{ps}, worker:0 at 127.0.0.1:{worker}" in msg


@pytest.mark.parametrize("value", [0, "no", None])
def test_deduplicate_lookups_must_be_a_bool_and_is_checked_before_connecting(value):
    import tensorflow as tf
    import tf_asyncps
    spec = tf.train.ClusterSpec({"ps": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"],
                                 "chief": ["127.0.0.1:3"]})
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        spec, task_type="chief", task_id=0, rpc_layer="grpc")
    want = f"deduplicate_lookups must be True or False, got {value!r}."
    with pytest.raises(TypeError) as e:
        tf_asyncps.AsyncParameterServerStrategy(resolver, deduplicate_lookups=value)
    assert str(e.value) == want
