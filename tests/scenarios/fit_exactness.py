"""Scenarios of tests/test_fit_exactness.py (single_worker_fits: also test_local_sgd.py,
test_policies_cluster.py and test_wire_dtype.py)."""

import numpy as np
import tensorflow as tf
import tf_keras

import tf_asyncps

from scenarios import cluster, scenario
from scenarios.common import make_optimizer, mlp, run_steps, small_problem, stats_of, step_fn


@scenario(shares_cluster=True)
def single_worker_fit(**kwargs):
    """One worker: fit under the strategy vs fit in one process, same order."""
    with cluster(num_workers=1, num_ps=1) as c:
        return _single_worker_fit(c, **kwargs)


@scenario(shares_cluster=True)
def single_worker_fits(cases):
    """single_worker_fit for each kwargs dict of ``cases``, one strategy each
    on one cluster (one cluster per process:
    docs/design.md#1-facts-measured-on-the-development-machine)."""
    with cluster(num_workers=1, num_ps=1) as c:
        return {"runs": [_single_worker_fit(c, **case) for case in cases]}


def _single_worker_fit(c, policy="async", policy_args=None, optimizer="sgd", lr=0.1,
                       epochs=2, steps_per_epoch=20, batch=16, steps_per_execution=1,
                       wire_dtype=None):
    x, y = small_problem(n=steps_per_epoch * batch)
    rng = np.random.RandomState(1)
    w0 = [rng.uniform(-0.5, 0.5, shape).astype(np.float32)
          for shape in [(8, 16), (16,), (16, 3), (3,)]]
    loss = tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def dataset_fn(ctx):
        ds = tf.data.Dataset.from_tensor_slices((x, y))
        ds = ds.shard(ctx.num_input_pipelines, ctx.input_pipeline_id)
        return ds.batch(batch).repeat()

    strategy = tf_asyncps.AsyncParameterServerStrategy(
        c.resolver(), update_policy=tf_asyncps.policies.get(policy, **(policy_args or {})),
        wire_dtype=wire_dtype)
    # Reference: plain single-process tf_keras training on the same batches
    # (runs on the chief's own CPU, outside the strategy's scope).
    ref = mlp()
    ref.set_weights(w0)
    ref.compile(make_optimizer(optimizer, lr), loss, steps_per_execution=steps_per_execution)
    ref.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(batch).repeat(),
            epochs=epochs, steps_per_epoch=steps_per_epoch, verbose=0)
    with strategy.scope():
        model = mlp()
        model.set_weights(w0)
        model.compile(make_optimizer(optimizer, lr), loss,
                      steps_per_execution=steps_per_execution)
    model.fit(tf_keras.utils.experimental.DatasetCreator(dataset_fn), epochs=epochs,
              steps_per_epoch=steps_per_epoch, verbose=0)
    diffs = [float(np.max(np.abs(a - b)))
             for a, b in zip(model.get_weights(), ref.get_weights())]
    moved = [float(np.max(np.abs(a - b))) for a, b in zip(ref.get_weights(), w0)]
    return {"max_abs_diff": max(diffs), "moved": max(moved),
            "iterations": int(model.optimizer.iterations.numpy()),
            "steps_per_execution_device": model._steps_per_execution.device,
            "dtypes": sorted({v.dtype.name for v in model.weights + model.optimizer.variables()
                              if v.dtype.is_floating}),
            "slots": len(model.optimizer.variables()),
            "stats": stats_of(strategy)}


@scenario(shares_cluster=True)
def accounting_fit(num_workers=3, epochs=3, steps_per_epoch=40, batch=16):
    """Several workers under model.fit: exact counters."""
    x, y = small_problem()

    def dataset_fn(ctx):
        ds = tf.data.Dataset.from_tensor_slices((x, y))
        ds = ds.shard(ctx.num_input_pipelines, ctx.input_pipeline_id)
        return ds.shuffle(len(x), seed=0).repeat().batch(batch)

    with cluster(num_workers=num_workers, num_ps=1) as c:
        strategy = tf_asyncps.AsyncParameterServerStrategy(c.resolver())
        with strategy.scope():
            model = mlp()
            model.compile(tf_keras.optimizers.SGD(0.05),
                          tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.fit(tf_keras.utils.experimental.DatasetCreator(dataset_fn), epochs=epochs,
                  steps_per_epoch=steps_per_epoch, verbose=0)
        return {"scheduled": epochs * steps_per_epoch,
                "iterations": int(model.optimizer.iterations.numpy()),
                "stats": stats_of(strategy)}


@scenario(shares_cluster=True)
def custom_loop_linear(num_workers=3, steps=60, lr=0.5, dim=4):
    """coordinator.schedule with loss = sum(w): constant gradient 1.

    SGD's update is one assign_sub, so w == w0 - lr * applied exactly.
    """
    with cluster(num_workers=num_workers, num_ps=1) as c:
        strategy = tf_asyncps.AsyncParameterServerStrategy(c.resolver())
        coord = tf.distribute.coordinator.ClusterCoordinator(strategy)
        with strategy.scope():
            w = tf.Variable(tf.fill([dim], 2.0), name="w")
            opt = tf_keras.optimizers.SGD(lr)

        run_steps(coord, step_fn(strategy, [w], opt, lambda: tf.reduce_sum(w)), steps)
        s = strategy.staleness_stats()
        return {"w": w.numpy().tolist(), "iterations": int(opt.iterations.numpy()),
                "stats": s.to_dict(), "steps": steps, "lr": lr}


@scenario(shares_cluster=True)
def shard_per_worker(num_workers=2, n=1000, batch=10, steps=100):
    """Case 003: each worker must read its own shard; ids counted on the PS."""
    ids = np.arange(n, dtype=np.int64)

    def dataset_fn(ctx):
        ds = tf.data.Dataset.from_tensor_slices(ids)
        ds = ds.shard(ctx.num_input_pipelines, ctx.input_pipeline_id)
        return ds.repeat().batch(batch).map(lambda b: (tf.cast(b, tf.float32)[:, None], b))

    with cluster(num_workers=num_workers, num_ps=1) as c:
        strategy = tf_asyncps.AsyncParameterServerStrategy(c.resolver())
        with tf.device("/job:ps/task:0/device:CPU:0"):
            seen = tf.Variable(tf.zeros([num_workers, n], tf.int64), name="seen_by_worker")

        class Counting(tf_keras.Model):
            def __init__(self):
                super().__init__()
                self.dense = tf_keras.layers.Dense(1)

            def call(self, x):
                return self.dense(x)

            def train_step(self, data):
                xb, idb = data
                w = tf.distribute.coordinator.experimental_get_current_worker_index()
                idx = tf.stack([tf.fill(tf.shape(idb), tf.cast(w, tf.int64)), idb], axis=1)
                seen.scatter_nd_add(idx, tf.ones_like(idb))
                with tf.GradientTape() as tape:
                    loss = tf.reduce_mean(tf.square(self(xb) * 0.0))
                self.optimizer.minimize(loss, self.trainable_variables, tape=tape)
                return {"loss": loss}

        with strategy.scope():
            model = Counting()
            model.compile(tf_keras.optimizers.SGD(0.0))
        model.fit(tf_keras.utils.experimental.DatasetCreator(dataset_fn), epochs=1,
                  steps_per_epoch=steps, verbose=0)
        counts = seen.numpy()
        return {"counts": counts.tolist(), "stats": stats_of(strategy)}


@scenario(shares_cluster=True)
def tau_visible(policy="async", num_workers=2, steps=30, max_polls=20000, attempts=3):
    """Worker 0 waits, between reading the model and applying, until another
    worker's update has landed (it polls the global step, at most
    ``max_polls`` reads), and reports whether it saw one land. A step that saw
    one must count tau >= 1: g at its apply > g after its wait > g at its read.

    That needs both workers to run closures at once; on a loaded machine the
    coordinator may hand every closure to one worker, or worker 0's closures
    may all start after worker 1 ran out of work. Such a round (no step saw an
    update land) is repeated, at most ``attempts`` rounds with the counters
    reset in between; the result is the last round's: its stats, the closures
    each worker ran and ``saw_update``, the steps that saw an update land.
    """
    with cluster(num_workers=num_workers, num_ps=1) as c:
        strategy = tf_asyncps.AsyncParameterServerStrategy(c.resolver(), update_policy=policy)
        coord = tf.distribute.coordinator.ClusterCoordinator(strategy)
        with strategy.scope():
            w = tf.Variable(tf.zeros([4]), name="w")
            opt = tf_keras.optimizers.SGD(0.1)
        g = strategy.extended.engine.tracker.global_step

        @tf.function
        def step():
            def replica_fn():
                me = tf.distribute.coordinator.experimental_get_current_worker_index()
                start = g.read_value()
                polls = tf.where(tf.equal(me, 0), max_polls, 0)
                with tf.GradientTape() as tape:
                    n = tf.while_loop(
                        lambda i: tf.logical_and(i < polls, g.read_value() <= start),
                        lambda i: i + 1, [tf.constant(0, polls.dtype)])[0]
                    loss = tf.reduce_sum(w) + 0.0 * tf.cast(n, tf.float32)
                with tf.control_dependencies([n]):
                    saw = tf.logical_and(tf.equal(me, 0), g.read_value() > start)
                with tf.control_dependencies([saw]):
                    opt.apply_gradients([(tape.gradient(loss, w), w)])
                return tf.cast(saw, tf.int32)
            return strategy.run(replica_fn)

        for attempt in range(1, attempts + 1):
            strategy.reset_staleness_stats()
            g0 = int(g.numpy())
            saw = [coord.schedule(step) for _ in range(steps)]
            coord.join()
            saw_update = sum(int(v.fetch()) for v in saw)
            closures = list(strategy.closures_done_per_worker())
            if saw_update > 0:
                break
        stats = stats_of(strategy)
        stats["global_step"] -= g0  # this round's updates
        return {"stats": stats, "closures": closures, "saw_update": saw_update,
                "attempts": attempt}
