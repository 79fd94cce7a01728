"""The main job end to end: `tf-asyncps launch` with the README's flagfile,
the same job as 4 hand-started `tf-asyncps train` processes, and the example."""

import json
import os
import subprocess
import sys

import numpy as np
import portpicker
import pytest

from conftest import ROOT, run_command, stop_process, subprocess_env, wait_dead
from tf_asyncps.app.console import is_runtime_noise

pytestmark = pytest.mark.timeout(400)

KEYS = {"policy", "num_workers", "num_ps", "epochs", "worker_steps", "steps_per_sec",
        "examples_per_sec", "wall_time_s", "test_accuracy", "test_loss", "staleness"}
STALENESS_KEYS = {"global_step", "applied", "dropped", "histogram", "dropped_histogram",
                  "mean", "max"}


@pytest.fixture(scope="module")
def main_job(tmp_path_factory):
    out = tmp_path_factory.mktemp("main_job")
    _, log = run_command([sys.executable, "-m", "tf_asyncps", "launch",
                          "--flagfile=configs/digits_async.flags", f"--output_dir={out}"],
                         timeout=300)
    return out, log


@pytest.mark.cluster
def test_main_job_trains_to_090_and_writes_metrics(main_job):
    out, log = main_job
    m = json.loads((out / "metrics.json").read_text())
    assert KEYS <= set(m) and STALENESS_KEYS <= set(m["staleness"])
    assert m["policy"] == "async" and m["num_workers"] == 2 and m["num_ps"] == 1
    assert round(m["test_accuracy"] * 360) >= 324  # 90% of the 360 digits, counted (float32)
    assert m["worker_steps"] == 10 * 100 == m["staleness"]["applied"]
    assert m["staleness"]["global_step"] == m["staleness"]["applied"]
    assert m["optimizer_iterations"] == 1000
    assert m["steps_per_sec"] > 0 and m["examples_per_sec"] == pytest.approx(
        32 * m["steps_per_sec"])
    # One line per epoch with loss, accuracy, steps/s and staleness.
    lines = [l for l in log.splitlines() if l.startswith("epoch ")]
    assert len(lines) == 10
    for word in ("loss=", "accuracy=", "steps/s=", "tau_mean=", "tau_max="):
        assert word in lines[-1]
    assert os.listdir(out / "tensorboard")
    assert sorted(os.listdir(out / "logs")) == [
        "chief-0.log", "cluster.json", "ps-0.log", "worker-0.log", "worker-1.log"]
    # The chief's whole output (TensorFlow's C++ notices included) is on disk;
    # the console got the job's lines without them.
    chief_log = (out / "logs" / "chief-0.log").read_text()
    assert "epoch 10/10" in chief_log and "test accuracy" in chief_log
    state = json.loads((out / "logs" / "cluster.json").read_text())
    assert sorted(state["tasks"]) == ["chief:0", "ps:0", "worker:0", "worker:1"]
    assert m["recovery"] is None and m["retried_closures"] == 0  # no faults, no backup
    # launch adds the CPU seconds each ps/worker process used while the job
    # ran (and prints them): at most both cores for that time (the job, plus
    # the chief process starting and connecting).
    cpu = m["task_cpu_s"]
    assert sorted(cpu) == ["ps:0", "worker:0", "worker:1"]
    assert all(0 < s <= 2 * (m["wall_time_s"] + 20) for s in cpu.values()), cpu
    assert "CPU seconds per task while the job ran: ps:0 " in log


@pytest.mark.cluster
def test_saved_model_reloads_in_a_fresh_process_with_plain_tensorflow(main_job):
    out, _ = main_job
    code = (
        "import sys, numpy as np, tensorflow as tf\n"
        "from sklearn.datasets import load_digits\n"
        "from sklearn.model_selection import train_test_split\n"
        "d = load_digits()\n"
        "x = (d.data / 16.0).astype(np.float32)\n"
        "_, xte, _, _ = train_test_split(x, d.target, test_size=0.2, random_state=0,"
        " stratify=d.target)\n"
        f"m = tf.saved_model.load({str(out / 'saved_model')!r})\n"
        "p = m.signatures['serving_default'](x=tf.constant(xte))['probabilities'].numpy()\n"
        f"np.save({str(out / 'reloaded.npy')!r}, p)\n")
    run_command([sys.executable, "-c", code], timeout=120)
    chief = np.load(out / "test_predictions.npy")
    reloaded = np.load(out / "reloaded.npy")
    assert chief.shape == reloaded.shape == (360, 10)
    np.testing.assert_allclose(reloaded, chief, atol=1e-6)


@pytest.mark.cluster
def test_job_by_hand_four_train_processes(tmp_path):
    """ps, 2 workers and chief started as separate `tf-asyncps train` processes."""
    ports = [portpicker.pick_unused_port() for _ in range(4)]
    cluster = {"chief": [f"127.0.0.1:{ports[0]}"], "ps": [f"127.0.0.1:{ports[1]}"],
               "worker": [f"127.0.0.1:{ports[2]}", f"127.0.0.1:{ports[3]}"]}
    common = ["--flagfile=configs/digits_async.flags", "--epochs=3",
              f"--output_dir={tmp_path}"]
    procs = []
    try:
        for job, i in (("ps", 0), ("worker", 0), ("worker", 1)):
            env = subprocess_env()
            env["TF_CONFIG"] = json.dumps({"cluster": cluster,
                                           "task": {"type": job, "index": i}})
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "tf_asyncps", "train"] + common, env=env, cwd=ROOT,
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True))
        env = subprocess_env()
        env["TF_CONFIG"] = json.dumps({"cluster": cluster, "task": {"type": "chief",
                                                                    "index": 0}})
        env["TF_CPP_MIN_LOG_LEVEL"] = "0"  # TensorFlow's C++ notices, for the filter
        _, console = run_command([sys.executable, "-m", "tf_asyncps", "train",
                                  "--console=quiet"] + common, timeout=240, env=env)
        for p in procs:
            assert p.poll() is None, "a server task exited during training"
    finally:
        for p in procs:
            stop_process(p)
    wait_dead([p.pid for p in procs])
    m = json.loads((tmp_path / "metrics.json").read_text())
    assert m["worker_steps"] == 300 and m["num_workers"] == 2
    assert m["test_accuracy"] >= 0.85
    # --console=quiet: TensorFlow's C++ lines only in the task's log, which
    # has every line the console showed.
    log = (tmp_path / "logs" / "chief-0.log").read_text().splitlines()
    shown = [line for line in console.splitlines() if not line.startswith("tf-asyncps train:")]
    assert not [line for line in shown if is_runtime_noise(line)], console
    assert [line for line in log if is_runtime_noise(line)], log[:20]
    assert [line for line in shown if line.startswith("epoch ")] == \
        [line for line in log if line.startswith("epoch ")] and len(log) > len(shown)


@pytest.mark.cluster
def test_example_keras_fit_runs():
    _, log = run_command([sys.executable, "examples/keras_fit.py"], timeout=240)
    line = [l for l in log.splitlines() if l.startswith("test accuracy")][-1]
    assert float(line.split()[2].rstrip(";")) >= 0.85
    assert "applied 500 updates" in line
    # StalenessLogger(print_fn=print) under verbose=0: its line per epoch, and
    # model.predict after fit gave the accuracy (no single-process copy).
    assert [l.split(":")[0] for l in log.splitlines() if l.startswith("epoch ")] == [
        f"epoch {i}/5" for i in range(1, 6)]
