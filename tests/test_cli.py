"""The command line rejects bad input quickly, with the field and the fix."""

import json
import sys
import time

import pytest

from conftest import _env, run_command
from tf_asyncps.app import datasets
from tf_asyncps.app import job

pytestmark = pytest.mark.timeout(120)


def _cli(*args, env=None):
    return run_command([sys.executable, "-m", "tf_asyncps", *args], timeout=60,
                       env=env, check=False)


@pytest.mark.parametrize("args,words", [
    (["launch", "--policy=nope"], ["'nope'", "async"]),
    (["launch", "--policy_args=max_staleness"], ["not key=value"]),
    (["launch", "--policy=async", "--policy_args=foo=1"], ["bad arguments", "async"]),
    (["launch", "--optimizer=lamb"], ["--optimizer", "sgd"]),
    (["launch", "--dataset=cifar"], ["--dataset", "digits"]),
    (["launch", "--epochs=0"], ["epochs"]),
    (["frobnicate"], ["usage: tf-asyncps", "launch"]),
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
    assert time.perf_counter() - t0 < 60


@pytest.mark.cluster
def test_train_with_bad_tf_config_fails_with_the_cluster_it_read():
    env = _env()
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
    from tf_asyncps.compat.keras import SUPPORTED_RANGE
    (lo_a, lo_b), (hi_a, hi_b) = SUPPORTED_RANGE
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
