"""Scenarios of tests/gpu/test_gpu_workers.py."""

import os

import tensorflow as tf
import tf_keras

import tf_asyncps

from scenarios import cluster, scenario
from scenarios.common import run_steps, stats_of


@scenario
def gpu_placement(gpu_ids, steps=200, dim=1024):
    """Workers with one GPU each (ids from the caller): where ops and variables
    go, which processes hold GPU memory, and steps/s of a matmul step."""
    import subprocess
    import time
    from tf_asyncps.cluster import devices
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
        return {"worker_devices": list(strategy.extended.worker_devices),
                "gpus_per_worker": strategy.gpus_per_worker,
                "remote_gpus": sorted(d.name for d in tf.config.list_logical_devices("GPU")),
                "var_device": w.device, "matmul_device": traced["matmul"],
                "steps_per_sec": rate, "flops_per_step": 6 * dim ** 3,
                "gpu_pids": gpu_pids, "nvidia_smi_apps": apps,
                "worker_pids": [c.pids[f"worker:{i}"] for i in range(len(gpu_ids))],
                "ps_pid": c.pids["ps:0"], "chief_pid": os.getpid(),
                "stats": stats_of(strategy), "steps": steps + 10}
