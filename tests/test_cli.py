"""The command line rejects bad input quickly, with the field and the fix."""

import json
import re
import subprocess
import sys
import time

import pytest

from conftest import ROOT, run_command, subprocess_env
from tf_asyncps.app import datasets, job, job_config

pytestmark = pytest.mark.timeout(120)


def _cli(*args, env=None):
    return run_command([sys.executable, "-m", "tf_asyncps", *args], timeout=60,
                       env=env, check=False)


# Runs `tf-asyncps ARGS` (cli.run, the console script's entry) for each ARGS
# in one process, one after another: per run its exit status, output and
# whether TensorFlow was imported. One process for all: each would pay
# Python's and absl's start-up.
_RUN_ALL = r"""
import contextlib, io, json, sys
from absl import app, flags
from tf_asyncps.app import cli
results = []
for args in json.loads(sys.stdin.read()):
    flags.FLAGS.unparse_flags()
    app._register_and_parse_flags_with_usage.done = False  # absl parses once per process
    sys.argv = ["tf-asyncps", *args]
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            cli.run()
            code = 0
        except SystemExit as e:
            code = e.code
    text = out.getvalue()
    if isinstance(code, str):  # the interpreter prints it to stderr
        text, code = text + code + "\n", 1
    results.append({"rc": code or 0, "out": text, "tensorflow": "tensorflow" in sys.modules})
print("RESULTS " + json.dumps(results))
"""

COMMANDS = ("launch", "train", "server", "bench", "reference")

# (args, words its output holds), each refused before TensorFlow is imported.
REFUSED = [
    (["launch", "--policy=nope"],  # names the flag and every choice
     ["--policy=nope", "<async|drop_stale|staleness_aware|ssp|dc_asgd|sync_replicas|"
      "local_sgd|route>"]),
    (["launch", "--bench_steps=3"],
     ["tf-asyncps: --bench_steps is a flag of `tf-asyncps bench`"]),
    (["launch", "--num_workers=100000"],
     ["--num_workers=100000 with --num_ps=1 needs at least 46876.2 GiB", "MemAvailable"]),
    (["launch", "--policy_args=max_staleness"], ["not key=value"]),
    (["launch", "--optimizer=lamb"], ["--optimizer", "sgd"]),
    (["launch", "--dataset=cifar"], ["--dataset", "digits"]),
    (["launch", "--epochs=0"], ["epochs"]),
    (["launch", "--hidden=12,x"], ["tf-asyncps launch: error: --hidden must be integers, got "
                                   "['12', 'x']; write e.g. --hidden=128,64."]),
    (["launch", "--flagfile=configs/movielens_async.flags", "--model=mlp"],
     ["--model=recommender goes with --dataset=movielens"]),
    (["reference", "--dataset=digits", "--model=recommender"],
     ["--model=recommender goes with --dataset=movielens"]),
    (["launch", "--model=cnn"], ["--model", "recommender"]),
    (["launch", "--output_dir=pyproject.toml"], ["--output_dir=pyproject.toml is a file"]),
    (["launch", "--output_dir=/proc/no-such-dir"],
     ["--output_dir=/proc/no-such-dir is not a writable directory"]),
    # A flag of another job was ignored silently (the digits job trained).
    (["launch", "--ctr_zipf=nan"],
     ["tf-asyncps launch: error: --ctr_zipf is a flag of the CTR job (--model=dlrm "
      "--dataset=criteo_synthetic, configs/ctr.flags); the mlp job on --dataset=digits does "
      "not read it"]),
    (["reference", "--flagfile=configs/movielens_async.flags", "--ctr_embedding=offset"],
     ["--ctr_embedding is a flag of the CTR job", "the recommender job on "
      "--dataset=movielens"]),
    (["launch", "--flagfile=configs/ctr.flags", "--hidden=64"],
     ["--hidden is a flag of the mlp and recommender jobs; the CTR job's MLPs are "
      "--ctr_bottom_mlp and --ctr_top_mlp."]),
    (["launch", "--flagfile=configs/ctr.flags", "--dynamic_ids"],
     ["--dynamic_ids is a flag of the recommender job"]),
    (["launch", "--flagfile=configs/digits_async.flags", "--embedding_dim=8"],
     ["--embedding_dim is a flag of the recommender and CTR jobs"]),
    (["launch", "--flagfile=configs/movielens_async.flags", "--dynamic_capacity=0.5"],
     ["--dynamic_capacity sizes the dynamic tables of --dynamic_ids"]),
    (["launch", "--flagfile=configs/ctr.flags", "--ctr_zipf=nan"],
     ["error: --ctr_zipf=nan is not a number"]),
    (["launch", "--flagfile=configs/ctr.flags", "--ctr_scale=1.5"],
     ["error: --ctr_scale must be in (0, 1]"]),
    # The CTR job takes backups (issue 41); bad values refused as the main job's.
    (["launch", "--flagfile=configs/ctr.flags", "--backup_every_steps=-5"],
     ["flag --backup_every_steps=-5: -5 is not a non-negative integer"]),
    (["launch", "--flagfile=configs/ctr.flags", "--backup_every_steps=9223372036854775808"],
     ["--backup_every_steps must be an int >= 0 and < 2**63"]),
    (["launch", "--flagfile=configs/ctr.flags", "--backup_dir=pyproject.toml"],
     ["--backup_dir=pyproject.toml is a file"]),
    (["launch", "--timeout_s=nan"], ["error: --timeout_s=nan is not a number"]),
    # inf passed lower_bound=0 and dropped 999 of 1000 updates (non-finite).
    (["launch", "--learning_rate=inf"],
     ["tf-asyncps launch: error: --learning_rate=inf is not a finite number; give a finite "
      "one (default: 0.1)."]),
    # Refused by scikit-learn's split, in its words, once the cluster was up.
    (["launch", "--seed=-1"],
     ["tf-asyncps launch: error: --seed must be an int >= 0 and < 2**32 (the seed of the "
      "data split, initialisation and shuffling), got -1."]),
    (["reference", "--seed=4294967296"],
     ["--seed must be an int >= 0 and < 2**32", "got 4294967296."]),
    # The workers' repeated dataset filled the batch until std::bad_alloc.
    (["launch", "--batch_size=99999999999999"],
     ["tf-asyncps launch: error: --batch_size=99999999999999 is more than the 1437 training "
      "examples of --dataset=digits (a batch would repeat them); use --batch_size=1437 or "
      "less."]),
    (["launch", "--policy=route", "--policy_args=sparse=nope"],
     ["--policy=route: sparse='nope' is not a policy", "--policy_args=sparse=async,"
      "dense=local_sgd,dense.sync_every=16"]),
    # Checked after TensorFlow's import (3.4-5.8 s) before.
    (["launch", "--policy=ssp", "--policy_args=max_stalenes=3"],
     ["tf-asyncps launch: error: bad arguments for policy 'ssp': 'max_stalenes' is not one "
      "of its arguments; it takes max_staleness, timeout_s (docs/concepts/policies.md)."]),
    (["launch", "--policy=route", "--policy_args=dense=local_sgd,dense.every=4"],
     ["--policy=route: dense=local_sgd: bad arguments for policy 'local_sgd': 'every'"]),
    (["launch", "--policy=route", "--policy_args=sync_every=4"],
     ["--policy=route takes no argument 'sync_every'", "PART.NAME=VALUE"]),
]
# A mistyped command: one line (not the help page) and exit status 2.
MISTYPED = [
    (["lanch"], "tf-asyncps: unknown command 'lanch'; did you mean launch? usage: tf-asyncps "
                "{launch|train|server|bench|reference} [--flags] (tf-asyncps --help)."),
    ([], "tf-asyncps: no command given; usage: tf-asyncps {launch|train|server|bench|"
         "reference} [--flags] (tf-asyncps --help)."),
    (["frobnicate"], "tf-asyncps: unknown command 'frobnicate'; usage: tf-asyncps "
                     "{launch|train|server|bench|reference} [--flags] (tf-asyncps --help)."),
    (["launch", "now"], "tf-asyncps: unexpected arguments ['now'] after 'launch'; flags look "
                        "like --name=value; usage: tf-asyncps {launch|train|server|bench|"
                        "reference} [--flags] (tf-asyncps --help)."),
]
# Help last, bench's after the others (running bench defines its flags).
HELP = ([["--help"], ["--helpfull"]] + [[c, "--help"] for c in COMMANDS if c != "bench"] +
        [["bench", "--help"], ["bench", "--helpfull"]])


@pytest.fixture(scope="module")
def runs():
    """``{tuple(args): {"rc", "out", "tensorflow"}}`` for every case above."""
    cases = [a for a, _ in REFUSED] + [a for a, _ in MISTYPED] + HELP
    proc = subprocess.run([sys.executable, "-c", _RUN_ALL], input=json.dumps(cases),
                          capture_output=True, text=True, timeout=90, env=subprocess_env(),
                          cwd=ROOT)
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS ")]
    assert line, proc.stderr[-3000:]
    results = json.loads(line[-1][len("RESULTS "):])
    assert len(results) == len(cases)
    return {tuple(a): r for a, r in zip(cases, results)}


@pytest.mark.parametrize("args,words", REFUSED, ids=[" ".join(a) for a, _ in REFUSED])
def test_bad_flags_are_refused_before_tensorflow_is_imported(runs, args, words):
    run = runs[tuple(args)]
    assert run["rc"] != 0
    for w in words:
        assert w in run["out"], run["out"][-2000:]
    assert "Traceback" not in run["out"]
    assert not run["tensorflow"]
    if "--hidden=12,x" in args or "--ctr_zipf=nan" in args:
        assert len(run["out"].strip().splitlines()) == 1, run["out"]  # not absl's usage page


@pytest.mark.parametrize("args,line", MISTYPED, ids=[" ".join(a) or "none" for a, _ in MISTYPED])
def test_a_mistyped_command_gets_one_line_with_the_nearest_commands(runs, args, line):
    run = runs[tuple(args)]
    assert (run["rc"], run["out"], run["tensorflow"]) == (2, line + "\n", False)


def test_the_console_script_refuses_a_mistyped_command_in_one_line():
    rc, out = _cli("lanch")
    assert (rc, out) == (2, MISTYPED[0][1] + "\n")


def test_a_bad_policy_argument_names_the_policy_and_what_it_takes():
    with pytest.raises(ValueError, match=r"^bad arguments for policy 'async': 'foo' is not "
                                         r"one of its arguments; it takes none "):
        job.JobConfig(policy="async", policy_args={"foo": 1}).check()
    # A value the policy refuses: its constructor, once TensorFlow is imported.
    with pytest.raises(ValueError, match=r"ssp: max_staleness"):
        job.JobConfig(policy="ssp", policy_args={"max_staleness": -1}).validate()


def test_the_policy_arguments_checked_without_tensorflow_are_the_policies():
    import inspect
    from tf_asyncps import policies
    assert set(job_config.POLICY_ARGS) == set(policies.names()) == set(
        job_config.REGISTERED_POLICIES)
    for name, args in job_config.POLICY_ARGS.items():
        assert args == tuple(inspect.signature(type(policies.get(name))).parameters), name


def test_route_is_made_from_policy_args_a_policy_per_part():
    from tf_asyncps import policies
    args = job_config.parse_policy_args(
        "sparse=ssp,sparse.max_staleness=3,dense=local_sgd,dense.sync_every=4")
    assert job_config.route_parts(args) == (
        {"sparse": ("ssp", {"max_staleness": 3}),
         "dense": ("local_sgd", {"sync_every": 4})}, None)
    made = job_config.make_policy("route", args)
    want = policies.route(sparse=policies.get("ssp", max_staleness=3),
                          dense=policies.get("local_sgd", sync_every=4))
    assert isinstance(made, policies.Route) and repr(made) == repr(want)
    assert repr(job_config.make_policy("route", {"sparse_names": "table"})) == repr(
        policies.route(sparse="async", dense="async", sparse_names="table"))
    job.JobConfig(model="recommender", dataset="movielens", policy="route",
                  policy_args=args).validate()
    # route's own refusals reach the flag's user, e.g. the tables on local steps:
    with pytest.raises(ValueError, match=r"route\(\): dense is on local steps and \['sparse'\] "
                                         r"is atomic"):
        job_config.make_policy("route", {"sparse": "drop_stale", "dense": "local_sgd"})
    with pytest.raises(ValueError, match=r"route\(\): sparse=.* trains per-worker copies"):
        job.JobConfig(policy="route", policy_args={"sparse": "local_sgd"}).validate()
    with pytest.raises(ValueError, match=r"--policy=route: dense=ssp: bad arguments for "
                                         r"policy 'ssp'"):
        job.JobConfig(policy="route", policy_args={"dense": "ssp", "dense.x": 1}).validate()


def test_flags_of_another_job_are_named_with_their_job():
    ctr = job_config.CtrConfig()
    job_config.check_flags_apply(ctr, ["ctr_zipf", "embedding_dim", "epochs"])
    job_config.check_flags_apply(job_config.JobConfig(), ["hidden", "epochs"])
    job_config.check_flags_apply(job_config.JobConfig(
        model="recommender", dataset="movielens", dynamic_ids=True), ["dynamic_capacity"])
    job_config.check_flags_apply(job_config.CtrConfig(ctr_embedding="dynamic"),
                                 ["dynamic_evict_every"])
    with pytest.raises(ValueError, match=r"^--dynamic_evict_every sizes the dynamic tables"):
        job_config.check_flags_apply(ctr, ["dynamic_evict_every"])
    with pytest.raises(ValueError, match=r"^--ctr_max_rows is a flag of the CTR job"):
        job_config.check_flags_apply(job_config.JobConfig(), ["epochs", "ctr_max_rows"])


@pytest.mark.cluster
def test_train_with_bad_tf_config_fails_with_the_cluster_it_read():
    env = subprocess_env()
    env["TF_CONFIG"] = json.dumps({"cluster": {"ps": ["127.0.0.1:2001"],
                                               "worker": ["127.0.0.1:2002"]},
                                   "task": {"type": "worker", "index": 0}})
    t0 = time.perf_counter()
    rc, out = _cli("train", env=env)
    assert rc != 0 and 'no "chief" task' in out and "127.0.0.1:2002" in out
    assert "Traceback" not in out
    assert time.perf_counter() - t0 < 2.0  # validated before TensorFlow is imported


def test_parse_policy_args_types():
    assert job.parse_policy_args("a=1,b=0.5,c=true,d=inverse, e = 2") == {
        "a": 1, "b": 0.5, "c": True, "d": "inverse", "e": 2}
    assert job.parse_policy_args("") == {}
    # A key given twice took the last value silently (a new user's report).
    with pytest.raises(ValueError, match="gives 'sync_every' twice"):
        job.parse_policy_args("sync_every=4, sync_every =8")


def test_mnist_offline_points_to_digits(monkeypatch):
    import tf_keras

    def offline():
        raise OSError("network is unreachable")

    monkeypatch.setattr(tf_keras.datasets.mnist, "load_data", offline)
    with pytest.raises(RuntimeError, match="--dataset=digits"):
        datasets.load("mnist")


def test_digits_split_is_fixed():
    a, b = datasets.load("digits", seed=0), datasets.load("digits", seed=0)
    assert a.x_train.shape == (1437, 64) and a.x_test.shape == (360, 64)
    assert job_config.TRAIN_EXAMPLES["digits"] == len(a.x_train)
    assert (a.y_test == b.y_test).all() and a.x_train.max() <= 1.0


def test_the_checks_choices_are_the_packages():
    # job_config repeats them so that checking a flag imports no TensorFlow.
    from tf_asyncps import policies
    from tf_asyncps.app import ctr_model, datasets, models, shared_flags
    from tf_asyncps.core import mixed_precision
    assert shared_flags.MODELS == job_config.MODELS == models.NAMES
    assert shared_flags.DATASETS == job_config.DATASETS == datasets.NAMES
    assert job_config.KERAS == models.KERAS_CHOICES
    assert job_config.PRECISIONS == mixed_precision.PRECISIONS
    assert job_config.CTR_EMBEDDINGS == ctr_model.EMBEDDINGS
    assert job_config.CTR_RAW_ID_EMBEDDINGS == ctr_model.RAW_ID_EMBEDDINGS
    assert job_config.OPTIMIZERS == job.OPTIMIZERS
    from tf_asyncps.app import ctr_data
    assert (job_config.CTR_DENSE, job_config.CTR_SPARSE) == (ctr_data.NUM_DENSE,
                                                             len(ctr_data.CRITEO_KAGGLE))


def test_a_job_that_dropped_most_steps_warns():
    assert job.dropped_warning({"applied": 500, "dropped": 500, "nonfinite": 0}) is None
    assert job.dropped_warning({"applied": 1, "dropped": 999, "nonfinite": 998}) == (
        "warning: 999 of 1000 worker steps were dropped (998 of them held NaN/Inf), only 1 "
        "updated the model: lower --learning_rate if the gradients or updates overflow, or "
        "let the policy drop less (--policy_args, e.g. a larger max_staleness).")


def test_a_batch_size_is_bounded_by_the_training_set_or_by_memory():
    job_config.check_batch_size(job_config.JobConfig(batch_size=1437))
    with pytest.raises(ValueError, match=r"^--batch_size=80004 is more than the 80003 "
                                         r"training examples of --dataset=movielens"):
        job_config.JobConfig(model="recommender", dataset="movielens",
                             batch_size=80004).check()
    # CTR: 13 * 4 + 26 * (8 + 4 * 16) = 1924 bytes an example, 4 batches held.
    ctr = job_config.CtrConfig(batch_size=139_519)
    job_config.check_batch_size(ctr, available_mb=1024)  # 1024 MiB // (4 * 1924) examples
    job_config.check_batch_size(ctr, available_mb=None)  # unknown: no check
    ctr.batch_size += 1
    with pytest.raises(ValueError, match=r"^--batch_size=139520: a CTR example holds 1924 "
                                         r"bytes .* 1\.0 GiB available \(MemAvailable\); use "
                                         r"--batch_size=139519 or less\.$"):
        job_config.check_batch_size(ctr, available_mb=1024)


def test_keras3_job_refuses_an_untested_keras_version(monkeypatch):
    import keras
    from tf_asyncps.app import job
    monkeypatch.setattr(keras, "__version__", "3.99.0")
    from tf_asyncps.compat.versions import KERAS3
    (lo_a, lo_b), (hi_a, hi_b) = KERAS3
    with pytest.raises(ValueError, match=rf"--keras=3: Keras 3\.99\.0 is outside "
                                         rf".*>= {lo_a}\.{lo_b}, < {hi_a}\.{hi_b}"):
        job.JobConfig(keras="3").validate()
    with pytest.raises(ValueError, match=r"--keras='4' is unknown"):
        job.JobConfig(keras="4").validate()


def test_an_interrupted_command_says_so_without_a_traceback(monkeypatch, capsys):
    # Ctrl-C or SIGTERM (sigterm_as_ctrl_c) reaches main as KeyboardInterrupt once
    # the command's context managers have stopped what it started.
    from tf_asyncps.app import cli

    def interrupted(argv):
        raise KeyboardInterrupt()

    monkeypatch.setattr(cli, "cmd_bench", interrupted)
    with pytest.raises(SystemExit) as e:
        cli.main(["tf-asyncps", "bench"])
    assert str(e.value.code) == "tf-asyncps bench: interrupted; every process it started is stopped."


def test_help_exits_0_and_lists_each_command_once_with_its_flags(runs):
    from tf_asyncps.app import cli  # noqa: F401 - defines every command's flags
    from tf_asyncps.app.shared_flags import our_flags
    rc, out = runs[("--help",)]["rc"], runs[("--help",)]["out"]
    assert rc == 0, out
    lines = out.splitlines()
    for command in ("launch", "train", "server", "bench", "reference"):
        assert sum(l.startswith(command + " ") for l in lines) == 1, command
    assert out.count("--helpfull") == 2  # one hint line: all flags, and bench's
    assert "Try --helpfull" not in out
    named = set(re.findall(r"--(\w+)", out))
    ours = set(our_flags())
    assert {"model", "num_ps", "allow_foreign_address", "version"} <= ours  # each module's
    assert ours <= named, sorted(ours - named)


@pytest.mark.parametrize("command", ["launch", "train", "server", "bench", "reference"])
def test_command_help_lists_that_commands_flags_with_their_help(runs, command):
    # `bench --help` printed the general help, without a word of bench's flags.
    from tf_asyncps.app.cli_help import COMMAND_HELP, JOB_FLAGS
    rc, out = runs[(command, "--help")]["rc"], runs[(command, "--help")]["out"]
    assert rc == 0, out
    assert out.startswith(f"tf-asyncps {command}: ")
    names = next(c[3] for c in COMMAND_HELP if c[0] == command)
    listed = re.findall(r"^  --(\w+):", out, re.M)
    expected = [f for n in names if not n.endswith("*") for f in
                (JOB_FLAGS if n.startswith("the job's") else [n])]
    assert [f for f in listed if not f.startswith("bench_")] == expected
    assert len(re.findall(r"^    \(default: ", out, re.M)) == len(listed)
    if command == "bench":
        assert {"bench_steps", "bench_hosts", "bench_only"} <= set(listed)
    else:
        assert not any(f.startswith("bench_") for f in listed)


def test_bench_flags_are_listed_by_bench_helpfull_only(runs):
    run = runs[("--helpfull",)]
    assert run["rc"] == 0 and "--bench_steps" not in run["out"] and "--num_workers" in run["out"]
    run = runs[("bench", "--helpfull")]
    assert run["rc"] == 0 and "--bench_steps" in run["out"]
    assert not any(r["tensorflow"] for r in runs.values())  # help imports no TensorFlow


def test_policy_flag_names_every_registered_policy():
    from tf_asyncps import policies
    from tf_asyncps.app import shared_flags
    assert sorted(job_config.REGISTERED_POLICIES) == policies.names()
    assert shared_flags.POLICIES == job_config.REGISTERED_POLICIES + ("route",)
    help_text = shared_flags.FLAGS["policy"].help
    for name in shared_flags.POLICIES:
        assert f"{name} (" in help_text, name


def test_launch_refuses_more_workers_than_memory_holds_with_what_they_need():
    from tf_asyncps.cluster import devices
    devices.check_memory(4, 1, available_mb=4096.0)  # 3.2 GB: fits
    devices.check_memory(64, 1, available_mb=None)  # unknown: no check
    with pytest.raises(ValueError) as e:
        devices.check_memory(8, 2, available_mb=4096.0)
    assert str(e.value) == (
        "--num_workers=8 with --num_ps=2 needs at least 5.4 GiB (790 MB for the chief, "
        "470 MB per ps and 480 MB per worker: each task is a TensorFlow process, measured "
        "on the digits job), but this machine has 4.0 GiB available (MemAvailable). Use "
        "--num_workers=4 or fewer, or hosts of their own (docs/guides/several_hosts.md).")
    with pytest.raises(ValueError, match="Even one worker does not fit beside 4 ps: use "
                                         "fewer --num_ps, or hosts of their own"):
        devices.check_memory(1, 4, available_mb=2048.0)
