"""GPU workers on a machine with NVIDIA GPUs; every test skips without one.

Run with ``tests/gpu/run_gpu_checks.sh RESULTS_DIR`` (bounded, writes logs and
metrics there) or ``python -m pytest -q -s tests/gpu``. Throughput lines are
printed (``-s``) and, with ``ASYNCPS_GPU_RESULTS=DIR``, written to DIR.

The cluster scenario sits above the test that reads it and returns the
dataclass declared with it (docs/tests.md#scenarios-beside-their-tests).
"""

import dataclasses
import functools
import json
import os
import shutil
import subprocess
import sys
import time

import pytest
import tensorflow as tf
import tf_keras

import tf_asyncps
from conftest import run_command, run_scenario, subprocess_env
from scenarios import cluster, scenario
from scenarios.common import run_steps
from tf_asyncps import StalenessStats
from tf_asyncps.cluster import devices

GPU_IDS = devices.available_gpus()  # nvidia-smi -L; CUDA is not touched here


@functools.lru_cache(maxsize=None)
def _tensorflow_gpus() -> int:
    """GPUs TensorFlow sees, asked in a subprocess (never initialise CUDA here)."""
    env = dict(subprocess_env(), CUDA_VISIBLE_DEVICES=",".join(GPU_IDS))
    rc, out = run_command(
        [sys.executable, "-c", "import tensorflow as tf; "
         "print('NGPU', len(tf.config.list_physical_devices('GPU')))"],
        timeout=180, env=env, check=False)
    lines = [line for line in out.splitlines() if line.startswith("NGPU ")]
    return int(lines[-1].split()[1]) if rc == 0 and lines else 0


pytestmark = [
    pytest.mark.skipif(not GPU_IDS, reason="no GPU: `nvidia-smi -L` lists none"),
    pytest.mark.timeout(300),
]


@pytest.fixture(scope="module", autouse=True)
def tensorflow_sees_a_gpu():
    if not _tensorflow_gpus():
        pytest.skip("nvidia-smi lists GPUs but TensorFlow sees none: "
                    "pip install -e '.[gpu]' (tensorflow[and-cuda])")


def _record(name, data):
    """Prints a result line and saves it under $ASYNCPS_GPU_RESULTS."""
    print(f"\n[gpu] {name}: {json.dumps(data, default=str)}", flush=True)
    out = os.environ.get("ASYNCPS_GPU_RESULTS")
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, f"{name}.json"), "w") as f:
            json.dump(data, f, indent=2, default=str)


def _launch_env(**extra):
    env = subprocess_env()
    env.pop("CUDA_VISIBLE_DEVICES")  # the launcher hands out the GPUs
    env.update(extra)
    return env


@dataclasses.dataclass(frozen=True)
class GpuPlacement:
    """Where a matmul step's ops and variables go on workers with one GPU each.

    Attributes:
      worker_devices: the strategy's devices per worker.
      gpus_per_worker: the strategy's GPUs per worker.
      remote_gpus: the logical GPU devices the chief sees (the workers'), sorted.
      var_device: the weight's device. matmul_device: the traced matmul's device.
      steps_per_sec: worker steps per second after 10 warm-up steps.
      flops_per_step: floating-point operations of one step (6 dim^3).
      gpu_pids: the pids nvidia-smi lists as using a GPU, sorted.
      nvidia_smi_apps: nvidia-smi's compute-apps output (or why it failed).
      worker_pids, ps_pid, chief_pid: the tasks' pids.
      stats: the strategy's staleness counters. steps: worker steps scheduled.
    """
    worker_devices: list[str]
    gpus_per_worker: int
    remote_gpus: list[str]
    var_device: str
    matmul_device: str
    steps_per_sec: float
    flops_per_step: int
    gpu_pids: list[int]
    nvidia_smi_apps: str
    worker_pids: list[int]
    ps_pid: int
    chief_pid: int
    stats: StalenessStats
    steps: int


@scenario
def gpu_placement(gpu_ids, steps=200, dim=1024) -> GpuPlacement:
    """Workers with one GPU each (ids from the caller): where ops and variables
    go, which processes hold GPU memory, and steps/s of a matmul step."""
    plan = devices.plan_gpus(len(gpu_ids), 1, gpu_ids)
    with cluster(num_workers=len(gpu_ids), num_ps=1, worker_env=plan.worker_env) as c:
        strategy = tf_asyncps.AsyncParameterServerStrategy(c.resolver())
        coord = tf.distribute.coordinator.ClusterCoordinator(strategy)
        with strategy.scope():
            w = tf.Variable(tf.random.normal([dim, dim], stddev=0.01, seed=0), name="w")
            opt = tf_keras.optimizers.SGD(0.01)
        traced = {}

        @tf.function
        def step():
            def replica_fn():
                x = tf.random.normal([dim, dim])
                with tf.GradientTape() as tape:
                    y = tf.matmul(x, w)
                    loss = tf.reduce_mean(tf.square(y))
                traced["matmul"] = y.device
                opt.apply_gradients([(tape.gradient(loss, w), w)])
                return loss
            return strategy.run(replica_fn)

        run_steps(coord, step, 10)  # warm-up and tracing
        t0 = time.perf_counter()
        run_steps(coord, step, steps)
        rate = steps / (time.perf_counter() - t0)
        try:
            apps = subprocess.run(
                ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=30).stdout
        except (OSError, subprocess.SubprocessError) as e:
            apps = f"nvidia-smi failed: {e}"
        gpu_pids = sorted(int(line.split(",")[0]) for line in apps.splitlines()
                          if line.split(",")[0].strip().isdigit())
        return GpuPlacement(
            worker_devices=list(strategy.extended.worker_devices),
            gpus_per_worker=strategy.gpus_per_worker,
            remote_gpus=sorted(d.name for d in tf.config.list_logical_devices("GPU")),
            var_device=w.device, matmul_device=traced["matmul"], steps_per_sec=rate,
            flops_per_step=6 * dim ** 3, gpu_pids=gpu_pids, nvidia_smi_apps=apps,
            worker_pids=[c.pids[f"worker:{i}"] for i in range(len(gpu_ids))],
            ps_pid=c.pids["ps:0"], chief_pid=os.getpid(),
            stats=strategy.staleness_stats(), steps=steps + 10)


@pytest.mark.cluster
def test_worker_ops_on_gpu_variables_on_ps():
    ids = list(GPU_IDS[:2])
    r = run_scenario(gpu_placement, timeout=280, gpu_ids=ids)
    _record("placement", {k: getattr(r, k) for k in (
        "worker_devices", "gpus_per_worker", "remote_gpus", "var_device", "matmul_device",
        "steps_per_sec", "gpu_pids", "worker_pids", "ps_pid", "chief_pid")})
    print(f"[gpu] throughput: {len(ids)} worker(s) x 1 GPU, 1024x1024 matmul step: "
          f"{r.steps_per_sec:.1f} steps/s "
          f"({r.steps_per_sec * r.flops_per_step / 1e12:.2f} TFLOP/s)", flush=True)
    assert r.gpus_per_worker == 1 and r.worker_devices == ["/device:GPU:0"]
    assert len(r.remote_gpus) == len(ids)
    assert all("/job:worker/" in d for d in r.remote_gpus)
    assert "/job:ps/" in r.var_device
    assert "GPU:0" in r.matmul_device.upper()
    s = r.stats
    assert s.applied == s.global_step == r.steps
    if r.gpu_pids:  # nvidia-smi shows processes (not always inside containers)
        assert set(r.worker_pids) <= set(r.gpu_pids), r.nvidia_smi_apps
        assert r.ps_pid not in r.gpu_pids and r.chief_pid not in r.gpu_pids


@pytest.mark.parametrize("precision", ["none", "auto"])
@pytest.mark.cluster
def test_digits_launch_one_gpu_per_worker(tmp_path, precision):
    n = min(2, len(GPU_IDS))
    out = tmp_path / "run"
    t0 = time.perf_counter()
    _, log = run_command(
        [sys.executable, "-m", "tf_asyncps", "launch", "--flagfile=configs/digits_async.flags",
         f"--num_workers={n}", "--gpus_per_worker=1", f"--mixed_precision={precision}",
         "--epochs=3", "--steps_per_epoch=100", f"--output_dir={out}"],
        timeout=280, env=_launch_env())
    m = json.loads((out / "metrics.json").read_text())
    results = os.environ.get("ASYNCPS_GPU_RESULTS")
    if results:
        shutil.copytree(out / "logs", os.path.join(results, f"launch_{precision}_logs"),
                        dirs_exist_ok=True)
    _record(f"launch_{precision}", {k: m[k] for k in (
        "num_workers", "gpus_per_worker", "mixed_precision", "loss_scale", "test_accuracy",
        "steps_per_sec", "steady_steps_per_sec", "examples_per_sec", "worker_steps")} | {
        "launch_wall_s": time.perf_counter() - t0})
    print(f"[gpu] throughput: digits mlp, {n} worker(s) x 1 GPU, {m['mixed_precision']}: "
          f"{m['steady_steps_per_sec']:.1f} steps/s after epoch 1", flush=True)
    assert f"worker 0: GPU {GPU_IDS[0]}" in log
    assert m["gpus_per_worker"] == 1
    assert m["mixed_precision"] == ("float32" if precision == "none" else "mixed_float16")
    assert (m["loss_scale"] is None) == (precision == "none")
    s = m["staleness"]
    assert m["worker_steps"] == 300 == s["applied"] + s["dropped"]
    assert m["optimizer_iterations"] == s["applied"] == s["global_step"]
    assert m["test_accuracy"] >= 0.85


@pytest.mark.cluster
def test_two_logical_gpus_per_worker_train_as_one_update_per_step(tmp_path):
    """One physical GPU split into 2 logical GPUs in the worker's server
    (TF_ASYNCPS_LOGICAL_GPUS): 2 replicas per worker step, whose gradients
    are summed into one update, counted once."""
    t0 = time.perf_counter()
    rc, out = run_command(
        [sys.executable, "-m", "tf_asyncps", "launch", "--flagfile=configs/digits_async.flags",
         "--num_workers=1", "--gpus_per_worker=1", "--epochs=3", "--steps_per_epoch=100",
         "--steps_per_execution=10", f"--output_dir={tmp_path}"],
        timeout=240, env=_launch_env(TF_ASYNCPS_LOGICAL_GPUS="2",
                                     TF_ASYNCPS_LOGICAL_GPU_MEMORY_MB="1024"), check=False)
    m = json.loads((tmp_path / "metrics.json").read_text()) if rc == 0 else {}
    _record("logical_gpus_k2", {"rc": rc, "seconds": time.perf_counter() - t0,
                                "tail": out[-1500:]} | {k: m.get(k) for k in (
                                    "gpus_per_worker", "test_accuracy", "worker_steps",
                                    "steady_steps_per_sec", "optimizer_iterations")})
    assert rc == 0, out[-3000:]
    print(f"[gpu] throughput: digits mlp, 1 worker x 2 logical GPUs: "
          f"{m['steady_steps_per_sec']:.1f} steps/s after epoch 1", flush=True)
    assert m["gpus_per_worker"] == 2
    s = m["staleness"]
    assert m["worker_steps"] == 300 == s["applied"] + s["dropped"]
    assert m["optimizer_iterations"] == s["applied"] == s["global_step"]
    assert m["test_accuracy"] >= 0.85