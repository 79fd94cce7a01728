"""GPU assignment (tf_asyncps/cluster/devices.py), server GPU options and the launch flags.

No GPU needed: a fake ``nvidia-smi`` on PATH stands in for the GPU count.
"""

import json
import os
import stat
import sys
import time

import pytest

from conftest import run_command, subprocess_env
from tf_asyncps.cluster import devices

pytestmark = pytest.mark.timeout(240)


def _fake_nvidia_smi(tmp_path, gpus=2, rc=0):
    """A directory holding an ``nvidia-smi`` that lists ``gpus`` GPUs."""
    d = tmp_path / "fakebin"
    d.mkdir(parents=True, exist_ok=True)
    lines = "".join(f'echo "GPU {i}: Fake H200 (UUID: GPU-{i:08d}-aaaa)"\n' for i in range(gpus))
    script = d / "nvidia-smi"
    script.write_text(f"#!/bin/sh\n{lines}exit {rc}\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return str(d)


def test_each_worker_gets_its_own_gpus_ps_and_chief_none():
    plan = devices.plan_gpus(2, 1, ("0", "1", "2"))
    assert plan.worker_env == {
        0: {"CUDA_VISIBLE_DEVICES": "0", "TF_FORCE_GPU_ALLOW_GROWTH": "true"},
        1: {"CUDA_VISIBLE_DEVICES": "1", "TF_FORCE_GPU_ALLOW_GROWTH": "true"}}
    assert plan.task_env("ps", 0) == {"CUDA_VISIBLE_DEVICES": ""}
    assert plan.task_env("chief") == {"CUDA_VISIBLE_DEVICES": ""}
    assert plan.describe() == "worker 0: GPU 0; worker 1: GPU 1; ps and chief: no GPU"


def test_k_gpus_per_worker_are_consecutive_blocks():
    plan = devices.plan_gpus(2, 2, 4)
    assert plan.worker_gpus == (("0", "1"), ("2", "3"))
    assert plan.task_env("worker", 1)["CUDA_VISIBLE_DEVICES"] == "2,3"
    restricted = devices.plan_gpus(2, 1, ("5", "7"), memory_growth=False)
    assert restricted.worker_env == {0: {"CUDA_VISIBLE_DEVICES": "5"},
                                     1: {"CUDA_VISIBLE_DEVICES": "7"}}


def test_zero_gpus_per_worker_hides_every_gpu():
    plan = devices.plan_gpus(3, 0, 8)
    assert plan.worker_env == {i: {"CUDA_VISIBLE_DEVICES": ""} for i in range(3)}
    assert plan.describe() == "CPU only: no task sees a GPU"


def test_too_few_gpus_fails_naming_flags_and_fix():
    with pytest.raises(ValueError) as e:
        devices.plan_gpus(3, 1, ("0", "1"))
    msg = str(e.value)
    for words in ("--gpus_per_worker=1 with --num_workers=3 needs 3 GPU(s)",
                  "but 2 are available (0,1)", "--gpus_per_worker=0", "nvidia-smi -L"):
        assert words in msg
    with pytest.raises(ValueError, match="0 are available"):
        devices.plan_gpus(1, 1, 0)
    with pytest.raises(ValueError, match="--gpus_per_worker must be an int >= 0, got -1"):
        devices.plan_gpus(1, -1, 4)


def test_available_gpus_respects_the_launchers_cuda_visible_devices():
    assert devices.available_gpus({}, gpu_count=3) == ("0", "1", "2")
    assert devices.available_gpus({"CUDA_VISIBLE_DEVICES": "3, 5"}, gpu_count=8) == ("3", "5")
    assert devices.available_gpus({"CUDA_VISIBLE_DEVICES": ""}, gpu_count=8) == ()
    assert devices.available_gpus({"CUDA_VISIBLE_DEVICES": "0"}, gpu_count=0) == ()


def test_count_gpus_reads_nvidia_smi_and_never_fails(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", _fake_nvidia_smi(tmp_path, gpus=2))
    assert devices.count_gpus() == 2
    monkeypatch.setenv("PATH", _fake_nvidia_smi(tmp_path / "failing", 2, rc=9))
    assert devices.count_gpus() == 0  # nvidia-smi failed: no usable GPU
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
    assert devices.count_gpus() == 0


def test_parse_gpus_flag():
    assert devices.parse_gpus_flag("0, 1") == "0,1"
    assert devices.parse_gpus_flag("none") == ""
    assert devices.parse_gpus_flag("") == ""
    assert devices.parse_gpus_flag("GPU-5e3c1a2b-aaaa") == "GPU-5e3c1a2b-aaaa"
    with pytest.raises(ValueError, match="--gpus='0,x'.*'x' is not a GPU index"):
        devices.parse_gpus_flag("0,x")


def test_server_config_memory_growth_and_logical_gpus():
    from tf_asyncps.cluster import server_config
    cfg = server_config(2, "worker", 1, environ={"TF_ASYNCPS_LOGICAL_GPUS": "2"})
    assert cfg.inter_op_parallelism_threads >= 3
    assert cfg.gpu_options.allow_growth
    vd = cfg.gpu_options.experimental.virtual_devices
    assert len(vd) == 1 and list(vd[0].memory_limit_mb) == [2048.0, 2048.0]
    two = server_config(2, "worker", 2, environ={"TF_ASYNCPS_LOGICAL_GPUS": "3",
                                                  "TF_ASYNCPS_LOGICAL_GPU_MEMORY_MB": "512"})
    assert [list(v.memory_limit_mb) for v in two.gpu_options.experimental.virtual_devices] == [
        [512.0] * 3, [512.0] * 3]  # every visible GPU must be split alike
    ps = server_config(2, "ps", 0, environ={"TF_ASYNCPS_LOGICAL_GPUS": "2",
                                            "TF_FORCE_GPU_ALLOW_GROWTH": "false"})
    assert not ps.gpu_options.experimental.virtual_devices and not ps.gpu_options.allow_growth
    with pytest.raises(ValueError, match="sees no GPU.*--gpus_per_worker=1"):
        server_config(2, "worker", 0, environ={"TF_ASYNCPS_LOGICAL_GPUS": "2"})
    with pytest.raises(ValueError, match="TF_ASYNCPS_LOGICAL_GPUS='two'"):
        server_config(2, "worker", 1, environ={"TF_ASYNCPS_LOGICAL_GPUS": "two"})


# -- the command line ----------------------------------------------------------

def _cli(*args, env=None):
    return run_command([sys.executable, "-m", "tf_asyncps", *args], timeout=90,
                       env=env, check=False)


def _env_with_gpus(tmp_path, gpus):
    env = subprocess_env()
    env.pop("CUDA_VISIBLE_DEVICES")  # let the launcher count the (fake) GPUs
    env["PATH"] = _fake_nvidia_smi(tmp_path, gpus) + os.pathsep + env["PATH"]
    return env


@pytest.mark.parametrize("gpus,args,words", [
    (0, ["--gpus_per_worker=1"], ["needs 2 GPU(s), but 0 are available", "--gpus_per_worker=0"]),
    (2, ["--gpus_per_worker=1", "--num_workers=3"], ["needs 3 GPU(s), but 2 are available"]),
    (3, ["--gpus_per_worker=2"], ["needs 4 GPU(s), but 3 are available"]),
    (2, ["--gpus=0"], ["--gpus is for `train`/`server`", "--gpus_per_worker"]),
    (0, ["--gpus_per_worker=2", "--policy=local_sgd"],
     ["'local_sgd' trains per-worker copies", "--gpus_per_worker=1 and --num_workers=4"]),
], ids=["no_gpu", "too_few", "k2", "gpus_flag", "local_sgd_k2"])
@pytest.mark.cluster
def test_launch_gpu_errors_come_before_any_process_starts(tmp_path, gpus, args, words):
    t0 = time.perf_counter()
    rc, out = _cli("launch", *args, env=_env_with_gpus(tmp_path, gpus))
    assert rc != 0 and "Traceback" not in out
    for w in words:
        assert w in out, out[-2000:]
    assert "cluster up" not in out
    assert time.perf_counter() - t0 < 10  # checked before TensorFlow is imported


@pytest.mark.cluster
def test_server_rejects_a_bad_gpus_flag_before_tensorflow_loads():
    env = subprocess_env()
    env["TF_CONFIG"] = json.dumps({"cluster": {"chief": ["127.0.0.1:2000"],
                                               "ps": ["127.0.0.1:2001"],
                                               "worker": ["127.0.0.1:2002"]},
                                   "task": {"type": "worker", "index": 0}})
    t0 = time.perf_counter()
    rc, out = _cli("server", "--gpus=first", env=env)
    assert rc != 0 and "--gpus='first'" in out and "Traceback" not in out
    assert time.perf_counter() - t0 < 30


@pytest.mark.cluster
def test_launch_gives_each_worker_its_gpu_and_trains_mixed_bfloat16(tmp_path):
    """Two (fake) GPUs, one per worker: each task's CUDA_VISIBLE_DEVICES is in
    its log; on this CPU machine TensorFlow finds no GPU and trains on CPU."""
    out_dir = tmp_path / "run"
    _, log = run_command(
        [sys.executable, "-m", "tf_asyncps", "launch", "--flagfile=configs/digits_async.flags",
         "--gpus_per_worker=1", "--mixed_precision=mixed_bfloat16", "--epochs=2",
         "--steps_per_epoch=50", f"--output_dir={out_dir}"],
        timeout=200, env=_env_with_gpus(tmp_path, 2))
    assert "worker 0: GPU 0; worker 1: GPU 1; ps and chief: no GPU" in log
    logs = {n: (out_dir / "logs" / f"{n}.log").read_text() for n in
            ("ps-0", "worker-0", "worker-1")}
    assert "(CUDA_VISIBLE_DEVICES='')" in logs["ps-0"]
    assert "(CUDA_VISIBLE_DEVICES='0')" in logs["worker-0"]
    assert "(CUDA_VISIBLE_DEVICES='1')" in logs["worker-1"]
    m = json.loads((out_dir / "metrics.json").read_text())
    s = m["staleness"]
    assert m["mixed_precision"] == "mixed_bfloat16" and m["loss_scale"] is None
    assert m["worker_steps"] == 100 == s["applied"] + s["dropped"] == m["optimizer_iterations"]
    assert s["global_step"] == s["applied"] == 100
    assert m["test_accuracy"] >= 0.8 and m["test_loss"] < 1.0, m
