"""Scenarios of tests/test_locking.py."""

import numpy as np
import tensorflow as tf
import tf_keras

import tf_asyncps

from scenarios import cluster, scenario
from scenarios.common import make_optimizer, mlp, run_steps, small_problem, stats_of, step_fn


@scenario(shares_cluster=True)
def case002(keras_name="tf_keras", optimizer="sgd", locking=False, num_workers=4,
            steps=200, dim=1000):
    """Case 002: loss = sum(w) (gradient 1), w zeros [1000], 200 steps."""
    lr = 1.0 if optimizer.endswith("sgd") else 1e-3
    with cluster(num_workers=num_workers, num_ps=1) as c:
        strategy = tf_asyncps.AsyncParameterServerStrategy(c.resolver())
        coord = tf.distribute.coordinator.ClusterCoordinator(strategy)
        with strategy.scope():
            w = tf.Variable(tf.zeros([dim]), name="w")
            opt = make_optimizer(optimizer, lr, keras_name)
            if locking:
                opt = tf_asyncps.optimizers.LockingOptimizer(opt, timeout_s=60)
            if keras_name == "keras3":
                opt.build([w])

        run_steps(coord, step_fn(strategy, [w], opt, lambda: tf.reduce_sum(w)), steps)
        got = w.numpy()
        # Reference: the same optimizer, `steps` sequential steps, in this process.
        ref_w = tf.Variable(tf.zeros([dim]))
        ref_opt = make_optimizer(optimizer, lr, keras_name)
        for _ in range(steps):
            ref_opt.apply_gradients([(tf.ones([dim]), ref_w)])
        it = opt.iterations
        return {"iterations": int(it.numpy()), "w_min": float(got.min()),
                "w_max": float(got.max()), "ref": float(ref_w.numpy()[0]),
                "max_abs_diff": float(np.max(np.abs(got - ref_w.numpy()))),
                "stats": stats_of(strategy)}


class _HalfPlusGrad(tf_keras.optimizers.Optimizer):
    """A read-modify-write update: var <- 0.5 * var + g (not commutative)."""

    def __init__(self, name="half_plus_grad", **kwargs):
        super().__init__(name=name, **kwargs)
        self._learning_rate = self._build_learning_rate(1.0)

    def update_step(self, gradient, variable):
        variable.assign(0.5 * variable + gradient)


@scenario(shares_cluster=True)
def read_modify_write(locking=True, num_workers=4, steps=20):
    with cluster(num_workers=num_workers, num_ps=1) as c:
        strategy = tf_asyncps.AsyncParameterServerStrategy(c.resolver())
        coord = tf.distribute.coordinator.ClusterCoordinator(strategy)
        with strategy.scope():
            w = tf.Variable(0.0, name="w")
            opt = _HalfPlusGrad()
            if locking:
                opt = tf_asyncps.optimizers.LockingOptimizer(opt)

        run_steps(coord, step_fn(strategy, [w], opt, lambda: w * 1.0), steps)
        return {"w": float(w.numpy()), "iterations": int(opt.iterations.numpy()),
                "stats": stats_of(strategy)}


@scenario
def locking_worker_killed(num_workers=3, epochs=4, steps_per_epoch=50, kill_after=60):
    """LockingOptimizer under model.fit; worker 1 is SIGKILLed mid-fit."""
    import threading
    x, y = small_problem()

    def dataset_fn(ctx):
        ds = tf.data.Dataset.from_tensor_slices((x, y))
        ds = ds.shard(ctx.num_input_pipelines, ctx.input_pipeline_id)
        return ds.repeat().batch(16)

    with cluster(num_workers=num_workers, num_ps=1) as c:
        strategy = tf_asyncps.AsyncParameterServerStrategy(c.resolver())
        with strategy.scope():
            model = mlp()
            model.compile(tf_asyncps.optimizers.LockingOptimizer(
                tf_keras.optimizers.Adam(0.01), timeout_s=30),
                tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        killed = threading.Event()
        done = threading.Event()

        def kill_mid_fit():  # polls the PS global step (tf_keras allows no batch hooks)
            while not done.wait(0.02):
                if strategy.staleness_stats().global_step >= kill_after:
                    c.kill("worker:1")
                    killed.set()
                    return

        killer = threading.Thread(target=kill_mid_fit, daemon=True)
        killer.start()
        try:
            model.fit(tf_keras.utils.experimental.DatasetCreator(dataset_fn), epochs=epochs,
                      steps_per_epoch=steps_per_epoch, verbose=0)
        finally:
            done.set()
            killer.join(timeout=10)
        return {"killed": killed.is_set(), "scheduled": epochs * steps_per_epoch,
                "iterations": int(model.optimizer.iterations.numpy()),
                "weights_finite": all(np.all(np.isfinite(v)) for v in model.get_weights()),
                "stats": stats_of(strategy)}


@scenario
def lock_timeout(timeout_s=2.0):
    """The update lock's token is held (taken by hand): the step must fail
    with TimeoutError after timeout_s, not hang."""
    import time
    with cluster(num_workers=1, num_ps=1) as c:
        strategy = tf_asyncps.AsyncParameterServerStrategy(c.resolver())
        coord = tf.distribute.coordinator.ClusterCoordinator(strategy)
        with strategy.scope():
            w = tf.Variable(1.0)
            opt = tf_asyncps.optimizers.LockingOptimizer(tf_keras.optimizers.SGD(0.1),
                                                         timeout_s=timeout_s)

        step = step_fn(strategy, [w], opt, lambda: w * 2.0)
        run_steps(coord, step, 1)  # traces the step and creates the lock
        lock = strategy.extended.engine.lock
        lock._queue.dequeue()  # steal the token: nobody can acquire now
        t0 = time.perf_counter()
        coord.schedule(step)
        try:
            coord.join()
            err = None
        except Exception as e:  # noqa: BLE001 - reported to the test
            err = e
        return {"error": type(err).__name__ if err else None, "message": str(err),
                "seconds": time.perf_counter() - t0, "w": float(w.numpy())}
