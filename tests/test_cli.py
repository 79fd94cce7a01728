"""The command line rejects bad input quickly, with the field and the fix."""

import json
import re
import sys
import time

import pytest

from conftest import run_command, subprocess_env
from tf_asyncps.app import datasets
from tf_asyncps.app import job

pytestmark = pytest.mark.timeout(120)


def _cli(*args, env=None):
    return run_command([sys.executable, "-m", "tf_asyncps", *args], timeout=60,
                       env=env, check=False)


@pytest.mark.parametrize("args,words", [
    (["launch", "--policy=nope"],  # names the flag and every choice, before TensorFlow
     ["--policy=nope", "<async|drop_stale|staleness_aware|ssp|dc_asgd|sync_replicas|"
      "local_sgd>"]),
    (["launch", "--bench_steps=3"],
     ["tf-asyncps: --bench_steps is a flag of `tf-asyncps bench`"]),
    (["launch", "--num_workers=100000"],
     ["--num_workers=100000 with --num_ps=1 needs at least 46876.2 GiB", "MemAvailable"]),
    (["launch", "--policy_args=max_staleness"], ["not key=value"]),
    (["launch", "--policy=async", "--policy_args=foo=1"], ["bad arguments", "async"]),
    (["launch", "--optimizer=lamb"], ["--optimizer", "sgd"]),
    (["launch", "--dataset=cifar"], ["--dataset", "digits"]),
    (["launch", "--epochs=0"], ["epochs"]),
    (["frobnicate"], ["usage: tf-asyncps", "launch"]),
    # One line, not absl's usage page before it.
    (["launch", "--hidden=12,x"], ["tf-asyncps launch: error: --hidden must be integers, got "
                                   "['12', 'x']; write e.g. --hidden=128,64."]),
    ([], ["usage: tf-asyncps"]),
    # At flag parsing, before TensorFlow is imported:
    (["launch", "--flagfile=configs/movielens_async.flags", "--model=mlp"],
     ["--model=recommender goes with --dataset=movielens"]),
    (["reference", "--dataset=digits", "--model=recommender"],
     ["--model=recommender goes with --dataset=movielens"]),
    (["launch", "--model=cnn"], ["--model", "recommender"]),
    (["launch", "--output_dir=pyproject.toml"], ["--output_dir=pyproject.toml is a file"]),
    (["launch", "--output_dir=/proc/no-such-dir"],
     ["--output_dir=/proc/no-such-dir is not a writable directory"]),
])
def test_bad_flags_fail_before_any_process_starts(args, words):
    t0 = time.perf_counter()
    rc, out = _cli(*args)
    assert rc != 0
    for w in words:
        assert w in out, out[-2000:]
    assert "Traceback" not in out
    if args[1:2] == ["--hidden=12,x"]:
        assert len(out.strip().splitlines()) == 1, out
    assert time.perf_counter() - t0 < 60


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
    assert (a.y_test == b.y_test).all() and a.x_train.max() <= 1.0


def test_model_and_dataset_names_match_the_cli_choices():
    from tf_asyncps.app import cli, datasets, models
    assert cli.MODELS == models.NAMES and cli.DATASETS == datasets.NAMES


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


def test_help_exits_0_and_lists_each_command_once_with_its_flags():
    from tf_asyncps.app import cli  # noqa: F401 - defines the flags
    from absl import flags
    rc, out = _cli("--help")
    assert rc == 0, out
    lines = out.splitlines()
    for command in ("launch", "train", "server", "bench", "reference"):
        assert sum(l.startswith(command + " ") for l in lines) == 1, command
    assert out.count("--helpfull") == 2  # one hint line: all flags, and bench's
    assert "Try --helpfull" not in out
    named = set(re.findall(r"--(\w+)", out))
    ours = {f.name for f in flags.FLAGS.flags_by_module_dict()["tf_asyncps.app.cli"]}
    assert ours <= named, sorted(ours - named)


@pytest.mark.parametrize("command", ["launch", "train", "server", "bench", "reference"])
def test_command_help_lists_that_commands_flags_with_their_help(command):
    # `bench --help` printed the general help, without a word of bench's flags.
    from tf_asyncps.app.cli_help import COMMAND_HELP, JOB_FLAGS
    rc, out = _cli(command, "--help")
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


def test_bench_flags_are_listed_by_bench_helpfull_only():
    rc, out = _cli("--helpfull")
    assert rc == 0 and "--bench_steps" not in out and "--num_workers" in out
    rc, out = _cli("bench", "--helpfull")
    assert rc == 0 and "--bench_steps" in out


def test_policy_flag_names_every_registered_policy():
    from tf_asyncps import policies
    from tf_asyncps.app import cli
    assert sorted(cli.POLICIES) == policies.names()
    help_text = cli.FLAGS["policy"].help
    for name in cli.POLICIES:
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
