"""Scenarios of tests/test_policies_cluster.py (full_batch_policy: also test_sync_replicas.py)."""

import numpy as np
import tensorflow as tf
import tf_keras

import tf_asyncps

from scenarios import cluster, scenario
from scenarios.common import least_squares, run_steps, stats_of, step_fn, train_with_straggler


@scenario(shares_cluster=True)
def full_batch_policy(policy="drop_stale", policy_args=None, num_workers=4, steps=60,
                      lr=0.05, sparse=False):
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
        return {"w": got.tolist(), "ref": ref.tolist(), "iterations": int(opt.iterations.numpy()),
                "sent": p.gradients_sent().tolist() if hasattr(p, "gradients_sent") else None,
                "stats": s.to_dict()}


@scenario(shares_cluster=True)
def ssp_straggler(max_staleness=1, num_workers=3, slow_worker=0, delay_ms=40, steps=45,
                  chained=False):
    """ssp with one worker slowed by a tf.data sleep: the clock spread stays <= s.
    ``chained``: ssp inside ``chain(ssp, "async")``."""
    x, y = least_squares()
    p = tf_asyncps.policies.get("ssp", max_staleness=max_staleness, timeout_s=60)
    with cluster(num_workers=num_workers, num_ps=1) as c:
        strategy = tf_asyncps.AsyncParameterServerStrategy(
            c.resolver(), update_policy=tf_asyncps.policies.chain(p, "async") if chained else p)
        coord = tf.distribute.coordinator.ClusterCoordinator(strategy)
        train_with_straggler(strategy, coord, x, y, slow_worker, delay_ms, steps)
        return {"clocks": p.clock_values().tolist(), "max_spread": p.max_clock_spread(),
                "released_reads": p.released_reads(),
                "stats": stats_of(strategy)}


@scenario(shares_cluster=True)
def fetch_drains(num_workers=2, loop_iterations=300_000):
    """While the chief waits on a scheduled step's RemoteValue.fetch with
    nothing else queued, the coordinator reports no queued closures (the
    probe a gated policy's watchdog uses to release waiting workers, as at
    join); before the fetch, while the program could still schedule, it does."""
    import threading
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
        return {"value": out, "before": before, "probes_while_fetching": len(probes),
                "released_while_fetching": probes.count(False)}


@scenario
def watchdogs_lifecycle(num_workers=2, steps=20):
    """ssp + LockingOptimizer: the gate's and the lock's watchdogs run while
    closures run and are stopped (threads ended) once the coordinator drains."""
    import threading

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
        return {"rounds": rounds, "w": w.numpy().tolist(), "stats": stats_of(strategy)}
