"""Every policy on real clusters: exact single-worker equivalence, drop_stale's
sequential equivalence, ssp's bound, sparse gradients, the non-finite guard and
the digits job with 4 workers.

Each cluster scenario sits above the tests that read it and returns the
dataclass declared with it (docs/tests.md#scenarios-beside-their-tests);
``full_batch_policy`` is also read by test_sync_replicas.py, and the one-worker
fits are test_fit_exactness.py's ``single_worker_fits``."""

import dataclasses
import json
import sys
import threading

import numpy as np
import pytest
import tensorflow as tf
import tf_keras

import tf_asyncps
from conftest import run_command, run_scenario
from scenarios import cluster, scenario
from scenarios.common import least_squares, run_steps, step_fn, train_with_straggler
from test_fit_exactness import single_worker_fits
from tf_asyncps import StalenessStats

pytestmark = pytest.mark.timeout(300)

# async: tests/test_fit_exactness.py (the same scenario, two epochs).
# Every policy x optimizer with one worker, in one process: tests/test_engine.py.
# On the cluster: the locked path and the read-snapshot path.
POLICIES = [
    ("drop_stale", {"max_staleness": 0}),
    ("dc_asgd", {"lambda_": 0.5}),
]


CASES = {f"{p}-sgd": dict(policy=p, policy_args=a, epochs=1, steps_per_epoch=30)
         for p, a in POLICIES}
CASES.update({f"{p}-adam": dict(policy=p, policy_args=a, optimizer="adam", lr=0.01, epochs=1,
                                steps_per_epoch=20) for p, a in POLICIES})


@pytest.fixture(scope="module")
def one_worker_fits():
    """Every case of CASES, one strategy each, on one 1-worker cluster."""
    runs = run_scenario(single_worker_fits, shared=(1, 1), cases=list(CASES.values()),
                        timeout=280).runs
    return dict(zip(CASES, runs))


@pytest.mark.parametrize("policy", [p for p, _ in POLICIES])
@pytest.mark.cluster
def test_one_worker_policy_equals_plain_sgd(one_worker_fits, policy):
    r = one_worker_fits[f"{policy}-sgd"]
    assert r.moved > 1e-2
    assert r.max_abs_diff < 1e-5
    s = r.stats
    assert s.applied == s.global_step == 30 and s.dropped == 0
    assert s.histogram[0] == 30  # one worker: tau is always 0


# -- full-batch least squares: drop_stale(0) against async ------------------------
@dataclasses.dataclass(frozen=True)
class FullBatchPolicy:
    """Every worker's step: the full-batch least-squares gradient; and, in the
    scenario's process, sequential full-batch gradient descent for as many
    updates as were applied, from the same start.

    Attributes:
      w: the trained parameters, flattened (w, then the per-example bias
        table e, zeros when not ``sparse``).
      ref: the sequential descent's parameters, flattened the same way.
      iterations: the optimizer's step counter at the end (int).
      sent: the policy's gradients_sent() per worker (sync_replicas; None for
        a policy without it).
      stats: the strategy's staleness counters.
    """
    w: list[float]
    ref: list[float]
    iterations: int
    sent: list[int] | None
    stats: StalenessStats


@scenario(shares_cluster=True)
def full_batch_policy(policy="drop_stale", policy_args=None, num_workers=4, steps=60,
                      lr=0.05, sparse=False) -> FullBatchPolicy:
    """Every worker computes the full-batch least-squares gradient (custom loop).

    Returns the final weights and sequential full-batch gradient descent run
    for ``global_step`` updates from the same start (in this process, no
    strategy). With ``sparse``, the model adds a per-example bias looked up
    with tf.gather, whose gradient is tf.IndexedSlices.
    """
    x, y = least_squares()
    ids = (np.arange(len(x)) % 10).astype(np.int64)

    def loss_fn(w, e):
        pred = tf.matmul(x, w)
        if sparse:
            pred = pred + tf.gather(e, ids)
        return tf.reduce_mean(tf.square(pred - y))

    with cluster(num_workers=num_workers, num_ps=1) as c:
        strategy = tf_asyncps.AsyncParameterServerStrategy(
            c.resolver(), update_policy=tf_asyncps.policies.get(policy, **(policy_args or {})))
        coord = tf.distribute.coordinator.ClusterCoordinator(strategy)
        with strategy.scope():
            w = tf.Variable(tf.zeros([x.shape[1], 1]), name="w")
            e = tf.Variable(tf.zeros([10, 1]), name="e")
            opt = tf_keras.optimizers.SGD(lr)
        params = [w, e] if sparse else [w]
        run_steps(coord, step_fn(strategy, params, opt, lambda: loss_fn(w, e)), steps)
        s = strategy.staleness_stats()
        rw, re = tf.Variable(tf.zeros_like(w)), tf.Variable(tf.zeros_like(e))
        for _ in range(s.global_step):
            with tf.GradientTape() as tape:
                loss = loss_fn(rw, re)
            gw, ge = tape.gradient(loss, [rw, re])
            rw.assign_sub(lr * gw)
            if sparse:
                re.assign_sub(lr * tf.convert_to_tensor(ge))
        got = np.concatenate([w.numpy().ravel(), e.numpy().ravel()])
        ref = np.concatenate([rw.numpy().ravel(), re.numpy().ravel()])
        p = strategy.update_policy
        return FullBatchPolicy(
            w=got.tolist(), ref=ref.tolist(), iterations=int(opt.iterations.numpy()),
            sent=p.gradients_sent().tolist() if hasattr(p, "gradients_sent") else None,
            stats=s)


@pytest.mark.cluster
def test_drop_stale_zero_is_sequential_gradient_descent():
    r = run_scenario(full_batch_policy, shared=(4, 1), policy="drop_stale",
                     policy_args={"max_staleness": 0}, num_workers=4, steps=60)
    s = r.stats
    assert s.applied + s.dropped == 60
    assert s.global_step == s.applied == r.iterations
    assert s.histogram[0] == s.applied and s.max == 0  # only tau = 0 applied
    assert s.dropped > 0 and s.dropped_histogram[0] == 0  # drops all had tau >= 1
    np.testing.assert_allclose(r.w, r.ref, atol=1e-5)


@pytest.mark.cluster
def test_async_full_batch_is_really_stale():
    """The contrast to the test above: async with 4 workers applies stale
    gradients, and τ says how stale, within the bound 4 workers allow."""
    r = run_scenario(full_batch_policy, shared=(4, 1), policy="async", num_workers=4,
                     steps=60)
    s, h = r.stats, r.stats.histogram
    assert s.applied == s.global_step == 60 and s.dropped == 0
    assert sum(h) == 60
    # Some gradients were computed on a model that other workers had updated since;
    # the first update cannot be stale (none landed before it).
    assert sum(h[1:]) >= 1 and s.max >= 1 and h[0] >= 1
    # The exact mean and max agree with the histogram (below its last, ">=" bin).
    assert s.max == max(t for t, n in enumerate(h) if n) < len(h) - 1
    assert s.mean == pytest.approx(sum(t * n for t, n in enumerate(h)) / 60)
    # τ of a step counts the updates landing between its read and its apply. A
    # worker runs one step at a time, so an update lands inside at most one step
    # of each other worker: Σ τ <= 3 * 60, mean τ <= 3 (an overcount breaks it).
    assert 0 < s.mean <= 3
    # The staleness is real: the weights are not sequential gradient descent's
    # (they are, to 1e-5, when every τ is 0: the test above).
    assert np.max(np.abs(np.subtract(r.w, r.ref))) > 1e-5


# -- ssp's bound with a straggler ---------------------------------------------------
@dataclasses.dataclass(frozen=True)
class SspStraggler:
    """ssp (alone or chained) with one worker's input slowed.

    Attributes:
      clocks: each worker's clock (steps it completed) at the end.
      max_spread: the largest clock spread ssp saw.
      released_reads: the steps ssp let through by an end-of-schedule
        release (not by the bound).
      stats: the strategy's staleness counters.
    """
    clocks: list[int]
    max_spread: int
    released_reads: int
    stats: StalenessStats


@scenario(shares_cluster=True)
def ssp_straggler(max_staleness=1, num_workers=3, slow_worker=0, delay_ms=40, steps=45,
                  chained=False) -> SspStraggler:
    """ssp with one worker slowed by a tf.data sleep: the clock spread stays <= s.
    ``chained``: ssp inside ``chain(ssp, "async")``."""
    x, y = least_squares()
    p = tf_asyncps.policies.get("ssp", max_staleness=max_staleness, timeout_s=60)
    with cluster(num_workers=num_workers, num_ps=1) as c:
        strategy = tf_asyncps.AsyncParameterServerStrategy(
            c.resolver(), update_policy=tf_asyncps.policies.chain(p, "async") if chained else p)
        coord = tf.distribute.coordinator.ClusterCoordinator(strategy)
        train_with_straggler(strategy, coord, x, y, slow_worker, delay_ms, steps)
        return SspStraggler(clocks=p.clock_values().tolist(), max_spread=p.max_clock_spread(),
                            released_reads=p.released_reads(),
                            stats=strategy.staleness_stats())


@pytest.mark.cluster
@pytest.mark.solo  # "the straggler ran fewer steps" needs its delay to dominate a step
# (40 ms did not under -n 2, nor alone on a loaded machine: clocks [16, 15, 14])
def test_ssp_bounds_the_clock_spread_with_a_straggler_also_inside_a_chain():
    # Run inside chain(ssp, "async"): the wait, the clock tick and the
    # end-of-schedule release (attach) must all still happen, so this is
    # ssp's own test and the chain's (ssp alone: test_frozen_worker.py, digits).
    r = run_scenario(ssp_straggler, shared=(3, 1), max_staleness=1, num_workers=3, slow_worker=0,
                     delay_ms=120, steps=45, chained=True)
    assert r.max_spread <= 1
    assert sum(r.clocks) == 45 == r.stats.applied
    # The straggler ran fewer steps than the fast workers, yet kept up within the bound.
    assert r.clocks[0] < max(r.clocks)


# Sparse (IndexedSlices) gradients against a dense reference: tests/test_engine.py.
# Non-finite drops and their counters: tests/test_engine.py (one process).


# async on digits: the main job (test_main_job.py) and test_faults.py; staleness_aware
# (a pure per-step rule): tests/test_engine.py and `tf-asyncps bench`; ssp: its bound
# with a straggler (below), and every policy on the tutorial's cluster
# (test_pss_compat.py) and on sharded tables (test_sharded.py).
@pytest.mark.parametrize("policy,args", [
    ("drop_stale", "max_staleness=2"),
    # dc_asgd's rule on one worker: test_policy_rules / test_gpu_replicas.
    pytest.param("dc_asgd", "lambda_=0.04", marks=pytest.mark.long)])
@pytest.mark.cluster
def test_digits_with_four_workers(policy, args, tmp_path):
    run_command([sys.executable, "-m", "tf_asyncps", "launch",
                 "--flagfile=configs/digits_async.flags", "--num_workers=4", "--epochs=6",
                 "--steps_per_execution=10",  # 10 steps per closure: same steps, faster
                 f"--policy={policy}", f"--policy_args={args}", f"--output_dir={tmp_path}"],
                timeout=280)
    m = json.loads((tmp_path / "metrics.json").read_text())
    assert m["policy"] == policy and m["num_workers"] == 4
    assert m["test_accuracy"] >= 0.85
    s = m["staleness"]
    assert s["applied"] + s["dropped"] == m["worker_steps"] == 600


# Other optimizers under one worker: tests/test_engine.py (one process, every
# policy x optimizer); the cluster keeps Adam, whose slots live on the ps.
@pytest.mark.parametrize("policy", [p for p, _ in POLICIES])
@pytest.mark.cluster
def test_one_worker_policy_with_adam(one_worker_fits, policy):
    r = one_worker_fits[f"{policy}-adam"]
    assert r.max_abs_diff < 1e-5
    assert r.iterations == r.stats.applied == 20


# -- watchdogs and drains -----------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class WatchdogsLifecycle:
    """Two rounds of ``steps`` scheduled steps under ssp + LockingOptimizer.

    Attributes:
      rounds: per round, ``{"during": ..., "after": ...}`` (right after
        scheduling, and after the join), each ``{"running": [bool per
        watchdog], "threads": [names of the live "*-watchdog" threads]}``.
      w: w ([3], zeros at first, SGD 0.5 on loss = sum(w)) at the end.
      stats: the strategy's staleness counters.
    """
    rounds: list[dict]
    w: list[float]
    stats: StalenessStats


@scenario
def watchdogs_lifecycle(num_workers=2, steps=20) -> WatchdogsLifecycle:
    """ssp + LockingOptimizer: the gate's and the lock's watchdogs run while
    closures run and are stopped (threads ended) once the coordinator drains."""
    def watchdog_threads():
        return sorted(t.name for t in threading.enumerate() if t.name.endswith("-watchdog"))

    with cluster(num_workers=num_workers, num_ps=1) as c:
        strategy = tf_asyncps.AsyncParameterServerStrategy(
            c.resolver(), update_policy=tf_asyncps.policies.get("ssp", max_staleness=1))
        coord = tf.distribute.coordinator.ClusterCoordinator(strategy)
        with strategy.scope():
            w = tf.Variable(tf.zeros([3]), name="w")
            opt = tf_asyncps.optimizers.LockingOptimizer(tf_keras.optimizers.SGD(0.5))
        step = step_fn(strategy, [w], opt, lambda: tf.reduce_sum(w))
        engine = strategy.extended.engine
        rounds = []
        for _ in range(2):
            for _ in range(steps):
                coord.schedule(step)
            during = {"running": [d.running for d in engine.watchdogs()],
                      "threads": watchdog_threads()}
            coord.join()
            rounds.append({"during": during,
                           "after": {"running": [d.running for d in engine.watchdogs()],
                                     "threads": watchdog_threads()}})
        return WatchdogsLifecycle(rounds=rounds, w=w.numpy().tolist(),
                                  stats=strategy.staleness_stats())


@pytest.mark.cluster
def test_watchdogs_run_while_closures_run_and_stop_when_the_coordinator_drains():
    r = run_scenario(watchdogs_lifecycle, num_workers=2, steps=20)
    for rnd in r.rounds:
        # Two watchdogs: the update lock's (LockingOptimizer) and ssp's gate.
        assert rnd["during"]["running"] == [True, True]
        assert rnd["during"]["threads"] == ["asyncps-update_lock-watchdog", "ssp-gate-watchdog"]
        assert rnd["after"]["running"] == [False, False]
        assert rnd["after"]["threads"] == []
    assert r.stats.applied == 40 and r.w == [-20.0] * 3


@dataclasses.dataclass(frozen=True)
class FetchDrains:
    """A long scheduled step waited on with RemoteValue.fetch under ssp(0).

    Attributes:
      value: the fetched value, in a list (empty if the fetch failed).
      before: has_queued_closures() right after scheduling, before the fetch.
      probes_while_fetching: how many times has_queued_closures() was probed
        while the fetch waited.
      released_while_fetching: how many of those probes said False (nothing
        queued: gated workers may be released).
    """
    value: list[float]
    before: bool
    probes_while_fetching: int
    released_while_fetching: int


@scenario(shares_cluster=True)
def fetch_drains(num_workers=2, loop_iterations=300_000) -> FetchDrains:
    """While the chief waits on a scheduled step's RemoteValue.fetch with
    nothing else queued, the coordinator reports no queued closures (the
    probe a gated policy's watchdog uses to release waiting workers, as at
    join); before the fetch, while the program could still schedule, it does."""
    with cluster(num_workers=num_workers, num_ps=1) as c:
        strategy = tf_asyncps.AsyncParameterServerStrategy(
            c.resolver(), update_policy=tf_asyncps.policies.get("ssp", max_staleness=0))
        coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)

        @tf.function
        def slow():  # a step that runs long enough to be waited on
            return tf.while_loop(lambda i, x: i < loop_iterations,
                                 lambda i, x: (i + 1, x + 1.0),
                                 [tf.constant(0), tf.constant(0.0)])[1]

        rv = coordinator.schedule(slow)
        before = coordinator.has_queued_closures()
        out = []
        fetching = threading.Thread(target=lambda: out.append(float(rv.fetch())))
        fetching.start()
        probes = []
        while fetching.is_alive():
            probes.append(coordinator.has_queued_closures())
            fetching.join(0.01)
        coordinator.join()
        return FetchDrains(value=out, before=before, probes_while_fetching=len(probes),
                           released_while_fetching=probes.count(False))


@pytest.mark.cluster
def test_waiting_on_a_fetch_lets_gated_workers_be_released():
    # TensorFlow's tutorial fetches a scheduled step's RemoteValue after its
    # loop. A gated worker (ssp, sync_replicas) waiting for a worker with
    # nothing to run is released only while the chief drains; RemoteValue.fetch
    # did not count, so such a step waited until ssp's timeout_s (CI: the
    # tutorial under ssp, 7 errors after a 120 s stall).
    r = run_scenario(fetch_drains, shared=(2, 1))
    assert r.value == [300000.0]
    assert r.before is True  # still scheduling: never release
    assert r.probes_while_fetching >= 1
    assert r.released_while_fetching >= 1, r
