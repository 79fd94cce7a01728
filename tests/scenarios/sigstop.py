"""Scenarios of tests/test_sigstop.py."""

import json
import os

import tensorflow as tf
import tf_keras

import tf_asyncps

from conftest import proc_state
from scenarios import cluster, scenario
from scenarios.common import mlp, small_problem, stats_of


@scenario
def sigstop_worker(policy="async", policy_args=None, num_workers=2, steps=80,
                   stop_after=10, stop_s=5.0):
    """model.fit while worker:1 is SIGSTOPped for ``stop_s`` s, then SIGCONTed.

    The chief's resolver is TensorFlow's TFConfigClusterResolver over a
    TF_CONFIG that also names an evaluator at a port that accepts and never
    answers: the strategy must leave it out (connecting to it would hang).
    """
    import signal
    import socket
    import threading
    import time
    x, y = small_problem()

    def dataset_fn(ctx):
        ds = tf.data.Dataset.from_tensor_slices((x, y))
        return ds.shard(ctx.num_input_pipelines, ctx.input_pipeline_id).repeat().batch(16)

    with cluster(num_workers=num_workers, num_ps=1) as c, \
            socket.create_server(("127.0.0.1", 0), backlog=4) as evaluator:
        cfg = json.loads(c.tf_config("chief", 0))
        cfg["cluster"]["evaluator"] = ["127.0.0.1:%d" % evaluator.getsockname()[1]]
        os.environ["TF_CONFIG"] = json.dumps(cfg)
        strategy = tf_asyncps.AsyncParameterServerStrategy(
            tf.distribute.cluster_resolver.TFConfigClusterResolver(),
            update_policy=tf_asyncps.policies.get(policy, **(policy_args or {})),
            connect_timeout_s=30)
        with strategy.scope():
            model = mlp()
            model.compile(tf_keras.optimizers.SGD(0.05),
                          tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        pid = c.pids["worker:1"]
        ev = {}
        done = threading.Event()

        def stop_then_continue():  # polls the PS global step (no batch hooks under PS)
            while not done.wait(0.02):
                if strategy.staleness_stats().global_step >= stop_after:
                    break
            else:
                return
            c.kill("worker:1", signal.SIGSTOP)
            t_stop = time.monotonic()
            while proc_state(pid) != "T" and not done.wait(0.01):  # delivery is async
                if time.monotonic() - t_stop > 2:
                    break
            ev["state_stopped"] = proc_state(pid)
            ev["g_stop"] = strategy.staleness_stats().global_step
            done.wait(stop_s)  # the fault lasts stop_s (fit ending early cuts it short)
            ev["g_cont"] = strategy.staleness_stats().global_step
            c.kill("worker:1", signal.SIGCONT)
            ev["t_cont"] = time.monotonic()
            ev["stopped_s"] = ev["t_cont"] - t_stop

        timer = threading.Thread(target=stop_then_continue, daemon=True)
        timer.start()
        t0 = time.monotonic()
        try:
            model.fit(tf_keras.utils.experimental.DatasetCreator(dataset_fn), epochs=1,
                      steps_per_epoch=steps, verbose=0)
        finally:
            t_end = time.monotonic()
            done.set()
            timer.join(timeout=10)
            c.kill("worker:1", signal.SIGCONT)  # never leave it stopped
        p = strategy.update_policy
        # The cluster TensorFlow connected to (ParameterServerStrategyV2 keeps it here).
        jobs = sorted(strategy._cluster_resolver.cluster_spec().jobs)
        return {"stopped_s": ev.get("stopped_s"), "g_stop": ev.get("g_stop"),
                "g_cont": ev.get("g_cont"), "state_stopped": ev.get("state_stopped"),
                "fit_ended_after_continue_s": t_end - ev.get("t_cont", t_end),
                "fit_s": t_end - t0, "jobs": jobs,
                "max_spread": p.max_clock_spread() if hasattr(p, "max_clock_spread") else None,
                "stats": stats_of(strategy)}
