"""Scenarios of tests/test_sync_replicas.py."""

import tensorflow as tf
import tf_keras

import tf_asyncps

from scenarios import cluster, scenario
from scenarios.common import (
    least_squares, mlp, run_steps, small_problem, stats_of, step_fn, train_with_straggler)


@scenario(shares_cluster=True)
def sync_straggler(replicas_to_aggregate=2, num_workers=3, slow_worker=0, delay_ms=80,
                   steps=60):
    """sync_replicas with one worker slowed by a sleep in its input pipeline."""
    x, y = least_squares()
    with cluster(num_workers=num_workers, num_ps=1) as c:
        strategy = tf_asyncps.AsyncParameterServerStrategy(
            c.resolver(), update_policy=tf_asyncps.policies.get(
                "sync_replicas", replicas_to_aggregate=replicas_to_aggregate,
                total_num_replicas=num_workers, timeout_s=60))
        coord = tf.distribute.coordinator.ClusterCoordinator(strategy)
        train_with_straggler(strategy, coord, x, y, slow_worker, delay_ms, steps)
        p = strategy.update_policy
        return {"sent": p.gradients_sent().tolist(), "rounds": p.rounds(),
                "released_reads": p.released_reads(), "stats": stats_of(strategy)}


@scenario
def sync_dead_worker(replicas_to_aggregate=2, num_workers=3, steps=120, kill_after=10,
                     timeout_s=5.0):
    """sync_replicas with worker 1 SIGKILLed mid-run."""
    import threading
    import time
    x, y = least_squares()
    with cluster(num_workers=num_workers, num_ps=1) as c:
        strategy = tf_asyncps.AsyncParameterServerStrategy(
            c.resolver(), update_policy=tf_asyncps.policies.get(
                "sync_replicas", replicas_to_aggregate=replicas_to_aggregate,
                timeout_s=timeout_s))
        coord = tf.distribute.coordinator.ClusterCoordinator(strategy)
        with strategy.scope():
            w = tf.Variable(tf.zeros([x.shape[1], 1]), name="w")
            opt = tf_keras.optimizers.SGD(0.01)

        step = step_fn(strategy, [w], opt,
                       lambda: tf.reduce_mean(tf.square(tf.matmul(x, w) - y)))
        done = threading.Event()
        killed = threading.Event()

        def killer():
            while not done.wait(0.02):
                if strategy.update_policy.rounds() >= kill_after:
                    c.kill("worker:1")
                    killed.set()
                    return

        t = threading.Thread(target=killer, daemon=True)
        t.start()
        t0 = time.perf_counter()
        err = None
        try:
            run_steps(coord, step, steps)
        except Exception as e:  # noqa: BLE001 - reported to the test
            err = e
        finally:
            done.set()
            t.join(timeout=10)
        return {"killed": killed.is_set(), "error": type(err).__name__ if err else None,
                "message": str(err) if err else "", "seconds": time.perf_counter() - t0,
                "rounds": strategy.update_policy.rounds(), "stats": stats_of(strategy)}


@scenario(shares_cluster=True)
def fit_evaluate_fit(policy="sync_replicas", policy_args=None, num_workers=2, steps=20):
    """model.fit, model.evaluate (steps without updates), model.fit again."""
    x, y = small_problem()

    def dataset_fn(ctx):
        ds = tf.data.Dataset.from_tensor_slices((x, y))
        return ds.shard(ctx.num_input_pipelines, ctx.input_pipeline_id).repeat().batch(16)

    with cluster(num_workers=num_workers, num_ps=1) as c:
        strategy = tf_asyncps.AsyncParameterServerStrategy(
            c.resolver(), update_policy=tf_asyncps.policies.get(
                policy, **(policy_args or {"replicas_to_aggregate": num_workers,
                                           "timeout_s": 30})))
        with strategy.scope():
            model = mlp()
            model.compile(tf_keras.optimizers.SGD(0.1),
                          tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        data = tf_keras.utils.experimental.DatasetCreator(dataset_fn)
        model.fit(data, epochs=1, steps_per_epoch=steps, verbose=0)
        loss = model.evaluate(data, steps=steps, verbose=0)
        model.fit(data, epochs=1, steps_per_epoch=steps, verbose=0)
        return {"eval_loss": float(loss), "stats": stats_of(strategy)}
