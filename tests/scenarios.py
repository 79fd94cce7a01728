"""Cluster scenarios, each run in its own process (one cluster per process).

TensorFlow allows one cluster per Python process (DESIGN section 1), so every
test that needs a real cluster runs one of these functions through
``conftest.run_scenario``: ``python tests/scenarios.py NAME JSON_KWARGS``.
The scenario starts a LocalCluster (ps/worker processes, stopped by pid on
exit), creates the strategy in this process and prints ``RESULT: {json}``.
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import tf_keras  # noqa: E402

import tf_asyncps  # noqa: E402
from tf_asyncps.cluster import LocalCluster  # noqa: E402

SCENARIOS = {}
_CLUSTERS = []


def _cluster(**kwargs):
    c = LocalCluster(**kwargs)
    _CLUSTERS.append(c)
    return c


def scenario(fn):
    SCENARIOS[fn.__name__] = fn
    return fn


def _stats(strategy):
    return strategy.staleness_stats().to_dict()


def _small_problem(n=320, features=8, classes=3, seed=0):
    rng = np.random.RandomState(seed)
    x = rng.randn(n, features).astype(np.float32)
    w = rng.randn(features, classes).astype(np.float32)
    y = np.argmax(x @ w, axis=1).astype(np.int64)
    return x, y


def _mlp(features=8, classes=3):
    return tf_keras.Sequential([
        tf_keras.Input(shape=(features,)),
        tf_keras.layers.Dense(16, activation="tanh"),
        tf_keras.layers.Dense(classes)])


def _optimizer(name, lr):
    return {"sgd": lambda: tf_keras.optimizers.SGD(lr),
            "momentum": lambda: tf_keras.optimizers.SGD(lr, momentum=0.9),
            "adam": lambda: tf_keras.optimizers.Adam(lr),
            "adagrad": lambda: tf_keras.optimizers.Adagrad(lr),
            "legacy_sgd": lambda: tf_keras.optimizers.legacy.SGD(lr)}[name]()


@scenario
def single_worker_fit(policy="async", policy_args=None, optimizer="sgd", lr=0.1,
                      epochs=2, steps_per_epoch=20, batch=16):
    """One worker: fit under the strategy vs fit in one process, same order."""
    x, y = _small_problem(n=steps_per_epoch * batch)
    rng = np.random.RandomState(1)
    w0 = [rng.uniform(-0.5, 0.5, shape).astype(np.float32)
          for shape in [(8, 16), (16,), (16, 3), (3,)]]
    loss = tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def dataset_fn(ctx):
        ds = tf.data.Dataset.from_tensor_slices((x, y))
        ds = ds.shard(ctx.num_input_pipelines, ctx.input_pipeline_id)
        return ds.batch(batch).repeat()

    with _cluster(num_workers=1, num_ps=1) as c:
        strategy = tf_asyncps.AsyncParameterServerStrategy(
            c.resolver(), update_policy=tf_asyncps.policies.get(policy, **(policy_args or {})))
        # Reference: plain single-process tf_keras training on the same batches
        # (runs on the chief's own CPU, outside the strategy's scope).
        ref = _mlp()
        ref.set_weights(w0)
        ref.compile(_optimizer(optimizer, lr), loss)
        ref.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(batch).repeat(),
                epochs=epochs, steps_per_epoch=steps_per_epoch, verbose=0)
        with strategy.scope():
            model = _mlp()
            model.set_weights(w0)
            model.compile(_optimizer(optimizer, lr), loss)
        model.fit(tf_keras.utils.experimental.DatasetCreator(dataset_fn), epochs=epochs,
                  steps_per_epoch=steps_per_epoch, verbose=0)
        diffs = [float(np.max(np.abs(a - b)))
                 for a, b in zip(model.get_weights(), ref.get_weights())]
        moved = [float(np.max(np.abs(a - b))) for a, b in zip(ref.get_weights(), w0)]
        return {"max_abs_diff": max(diffs), "moved": max(moved),
                "iterations": int(model.optimizer.iterations.numpy()),
                "stats": _stats(strategy)}


@scenario
def accounting_fit(num_workers=3, epochs=3, steps_per_epoch=40, batch=16):
    """Several workers under model.fit: exact counters."""
    x, y = _small_problem()

    def dataset_fn(ctx):
        ds = tf.data.Dataset.from_tensor_slices((x, y))
        ds = ds.shard(ctx.num_input_pipelines, ctx.input_pipeline_id)
        return ds.shuffle(len(x), seed=0).repeat().batch(batch)

    with _cluster(num_workers=num_workers, num_ps=1) as c:
        strategy = tf_asyncps.AsyncParameterServerStrategy(c.resolver())
        with strategy.scope():
            model = _mlp()
            model.compile(tf_keras.optimizers.SGD(0.05),
                          tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.fit(tf_keras.utils.experimental.DatasetCreator(dataset_fn), epochs=epochs,
                  steps_per_epoch=steps_per_epoch, verbose=0)
        return {"scheduled": epochs * steps_per_epoch,
                "iterations": int(model.optimizer.iterations.numpy()),
                "stats": _stats(strategy)}


@scenario
def custom_loop_linear(num_workers=3, steps=60, lr=0.5, dim=4):
    """coordinator.schedule with loss = sum(w): constant gradient 1.

    SGD's update is one assign_sub, so w == w0 - lr * applied exactly.
    """
    with _cluster(num_workers=num_workers, num_ps=1) as c:
        strategy = tf_asyncps.AsyncParameterServerStrategy(c.resolver())
        coord = tf.distribute.coordinator.ClusterCoordinator(strategy)
        with strategy.scope():
            w = tf.Variable(tf.fill([dim], 2.0), name="w")
            opt = tf_keras.optimizers.SGD(lr)

        @tf.function
        def step():
            def replica_fn():
                with tf.GradientTape() as tape:
                    loss = tf.reduce_sum(w)
                grads = tape.gradient(loss, [w])
                opt.apply_gradients(zip(grads, [w]))
                return loss
            return strategy.run(replica_fn)

        for _ in range(steps):
            coord.schedule(step)
        coord.join()
        s = strategy.staleness_stats()
        return {"w": w.numpy().tolist(), "iterations": int(opt.iterations.numpy()),
                "stats": s.to_dict(), "steps": steps, "lr": lr}


@scenario
def shard_per_worker(num_workers=2, n=1000, batch=10, steps=100):
    """Case 003: each worker must read its own shard; ids counted on the PS."""
    ids = np.arange(n, dtype=np.int64)

    def dataset_fn(ctx):
        ds = tf.data.Dataset.from_tensor_slices(ids)
        ds = ds.shard(ctx.num_input_pipelines, ctx.input_pipeline_id)
        return ds.repeat().batch(batch).map(lambda b: (tf.cast(b, tf.float32)[:, None], b))

    with _cluster(num_workers=num_workers, num_ps=1) as c:
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
        return {"counts": counts.tolist(), "stats": _stats(strategy)}


@scenario
def keras3_fit_fails():
    """A Keras 3 model.fit under the strategy fails at once with our message."""
    import time
    import keras  # Keras 3
    with _cluster(num_workers=1, num_ps=1) as c:
        strategy = tf_asyncps.AsyncParameterServerStrategy(c.resolver())
        with strategy.scope():
            model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
            model.compile(keras.optimizers.SGD(0.1), "mse")
        x = np.zeros((8, 4), np.float32)
        t0 = time.perf_counter()
        try:
            model.fit(x, np.zeros((8, 2), np.float32), epochs=1, verbose=0)
        except Exception as e:  # noqa: BLE001 - reported to the test
            return {"error": type(e).__name__, "message": str(e),
                    "seconds": time.perf_counter() - t0,
                    "global_step": strategy.staleness_stats().global_step}
        return {"error": None}


def main():
    name = sys.argv[1]
    kwargs = json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
    result = SCENARIOS[name](**kwargs)
    result["_child_pids"] = [p for c in _CLUSTERS for p in c.pids.values()]
    print("RESULT: " + json.dumps(result), flush=True)
    sys.stderr.flush()
    # The cluster is already stopped: skip TensorFlow's teardown, which would
    # try (and loudly fail) to reach the stopped servers.
    os._exit(0)


if __name__ == "__main__":
    main()
