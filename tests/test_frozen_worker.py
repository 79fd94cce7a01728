"""A frozen worker (issue 6, item 3): a worker frozen with SIGSTOP for 5 s
and then continued must not deadlock any policy; every worker step is still
counted once.

The cluster scenario sits above the test that reads it and returns the
dataclass declared with it (docs/tests.md#scenarios-beside-their-tests)."""

import dataclasses
import json
import os
import signal
import socket
import threading
import time

import pytest
import tensorflow as tf
import tf_keras

import tf_asyncps
from conftest import proc_state, run_scenario
from scenarios import cluster, scenario
from scenarios.common import mlp, small_problem
from tf_asyncps import StalenessStats

pytestmark = pytest.mark.timeout(180)


@dataclasses.dataclass(frozen=True)
class SigstopWorker:
    """model.fit with worker:1 SIGSTOPped mid-fit, then SIGCONTed.

    Attributes:
      stopped_s: seconds from the SIGSTOP to the SIGCONT (None: fit ended
        before the stop).
      g_stop, g_cont: the global step when worker:1 was stopped and when it
        was continued (None: no stop).
      state_stopped: worker:1's /proc state letter after the SIGSTOP ("T":
        stopped).
      fit_ended_after_continue_s: seconds from the SIGCONT to fit's end (0.0:
        no stop).
      fit_s: fit's wall-clock seconds.
      jobs: the jobs of the cluster TensorFlow connected to, sorted.
      max_spread: the policy's largest clock spread seen (``ssp``'s
        ``max_clock_spread()``; None for a policy without one).
      stats: the strategy's staleness counters.
    """
    stopped_s: float | None
    g_stop: int | None
    g_cont: int | None
    state_stopped: str | None
    fit_ended_after_continue_s: float
    fit_s: float
    jobs: list[str]
    max_spread: int | None
    stats: StalenessStats


@scenario
def sigstop_worker(policy="async", policy_args=None, num_workers=2, steps=80,
                   stop_after=10, stop_s=5.0) -> SigstopWorker:
    """model.fit while worker:1 is SIGSTOPped for ``stop_s`` s, then SIGCONTed.

    The chief's resolver is TensorFlow's TFConfigClusterResolver over a
    TF_CONFIG that also names an evaluator at a port that accepts and never
    answers: the strategy must leave it out (connecting to it would hang).
    """
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
        return SigstopWorker(
            stopped_s=ev.get("stopped_s"), g_stop=ev.get("g_stop"), g_cont=ev.get("g_cont"),
            state_stopped=ev.get("state_stopped"),
            fit_ended_after_continue_s=t_end - ev.get("t_cont", t_end), fit_s=t_end - t0,
            jobs=jobs,
            max_spread=p.max_clock_spread() if hasattr(p, "max_clock_spread") else None,
            stats=strategy.staleness_stats())


STEPS = 80
# async is covered on digits, with a SIGKILL at the same time, in test_faults.py.
POLICIES = [
    ("ssp", {"max_staleness": 1, "timeout_s": 60}),
    ("sync_replicas", {"replicas_to_aggregate": 2, "timeout_s": 60}),
]


@pytest.mark.parametrize("policy,args", POLICIES, ids=[p for p, _ in POLICIES])
@pytest.mark.cluster
def test_sigstop_worker_for_5_s_then_continue(policy, args):
    r = run_scenario(sigstop_worker, timeout=170, policy=policy, policy_args=args,
                     num_workers=2, steps=STEPS, stop_after=10, stop_s=5.0)
    # The fault happened as meant: worker:1 was stopped ("T") for the full 5 s,
    # mid-fit, and fit could only end after it was continued.
    assert r.state_stopped == "T"
    assert 5.0 <= r.stopped_s < 8.0, r
    assert 10 <= r.g_stop < STEPS
    assert r.fit_ended_after_continue_s > 0, r
    # The evaluator in the chief's TF_CONFIG was left out of the cluster.
    assert r.jobs == ["chief", "ps", "worker"]
    # Accounting identity: each of the STEPS worker steps reached the PS once.
    s = r.stats
    assert s.applied + s.dropped == STEPS, s
    assert s.nonfinite == 0
    if policy == "sync_replicas":
        # Every completed round holds 2 accepted gradients; one more may wait
        # in the last round, unfinished when the schedule ends (a stale drop
        # under load leaves it unpaired).
        assert 0 <= s.applied - 2 * s.global_step <= 1, s
        # Each update needs both workers' gradients: at most the round that
        # was already complete lands while worker:1 is frozen.
        assert r.g_cont - r.g_stop <= 1, r
    else:
        assert s.global_step == s.applied and s.dropped == 0, s
    if policy == "ssp":
        assert r.max_spread <= 1  # the bound held through the stop
