"""Cluster scenarios, each run in its own process (one cluster per process).

TensorFlow allows one cluster per Python process (DESIGN section 1), so every
test that needs a real cluster runs one of these functions through
``conftest.run_scenario``: ``python tests/scenarios.py NAME JSON_KWARGS``.
The scenario starts a LocalCluster (ps/worker processes, stopped by pid on
exit), creates the strategy in this process and prints ``RESULT: {json}``.

Starting a cluster costs most of a short scenario (about 9 s of the 2 cores
for 4 workers). Scenarios marked ``@scenario(shares_cluster=True)`` neither
kill, stop, restart nor reconfigure a task, so they may also run on a cluster
kept up for the whole test session: ``python tests/scenarios.py serve
'{"num_workers": W, "num_ps": P}'`` reads one request per line on stdin and
answers each (``conftest.run_scenario(..., shared=(W, P))``). Each request
gets new variables, a new strategy and a new ClusterCoordinator, exactly as
in a fresh process; only the ps/worker processes are reused.
"""

import contextlib
import json
import os
import sys
import traceback

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import tf_keras  # noqa: E402

import tf_asyncps  # noqa: E402
from tf_asyncps.cluster import LocalCluster  # noqa: E402
from tf_asyncps.compat import tensorflow as tf_compat  # noqa: E402

SCENARIOS = {}
SHARES_CLUSTER = set()
_CLUSTERS = []
_SHARED = {}  # under `serve`: "shape" (LocalCluster kwargs) and "cluster"


def _cluster(**kwargs):
    if _SHARED:
        if kwargs != _SHARED["shape"]:
            raise ValueError(f"this scenario needs a cluster {kwargs}, but the shared "
                             f"cluster is {_SHARED['shape']}: pass shared=(num_workers, "
                             f"num_ps) that match it.")
        return contextlib.nullcontext(_SHARED["cluster"])  # stays up after the scenario
    c = LocalCluster(**kwargs)
    _CLUSTERS.append(c)
    return c


def scenario(fn=None, *, shares_cluster=False):
    """Registers a scenario; ``shares_cluster``: it may run under ``serve``."""
    def register(fn):
        SCENARIOS[fn.__name__] = fn
        if shares_cluster:
            SHARES_CLUSTER.add(fn.__name__)
        return fn
    return register(fn) if fn is not None else register


def _stats(strategy):
    return strategy.staleness_stats().to_dict()


def _step_fn(strategy, params, opt, loss_fn, with_batch=False):
    """A scheduled worker step: one gradient step of ``opt`` on ``loss_fn``.

    ``loss_fn()`` (or ``loss_fn(batch)`` with ``with_batch``, the batch coming
    from the per-worker iterator passed to the step) runs inside the replica.
    """
    @tf.function
    def step(iterator=None):
        batch = next(iterator) if with_batch else ()

        def replica_fn(*batch):
            with tf.GradientTape() as tape:
                loss = loss_fn(*batch)
            opt.apply_gradients(zip(tape.gradient(loss, params), params))
            return loss
        return strategy.run(replica_fn, args=tuple(batch))

    return step


def _run_steps(coord, step, steps, iterator=None):
    for _ in range(steps):
        coord.schedule(step, args=(iterator,) if iterator is not None else ())
    coord.join()


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
            "legacy_sgd": lambda: tf_keras.optimizers.legacy.SGD(lr),
            # A learning-rate schedule reads optimizer.iterations every step.
            "momentum_schedule": lambda: tf_keras.optimizers.SGD(
                tf_keras.optimizers.schedules.ExponentialDecay(lr, 5, 0.9), momentum=0.9),
            }[name]()


@scenario(shares_cluster=True)
def single_worker_fit(**kwargs):
    """One worker: fit under the strategy vs fit in one process, same order."""
    with _cluster(num_workers=1, num_ps=1) as c:
        return _single_worker_fit(c, **kwargs)


@scenario(shares_cluster=True)
def single_worker_fits(cases):
    """single_worker_fit for each kwargs dict of ``cases``, one strategy each
    on one cluster (one cluster per process: DESIGN)."""
    with _cluster(num_workers=1, num_ps=1) as c:
        return {"runs": [_single_worker_fit(c, **case) for case in cases]}


def _single_worker_fit(c, policy="async", policy_args=None, optimizer="sgd", lr=0.1,
                       epochs=2, steps_per_epoch=20, batch=16, steps_per_execution=1,
                       wire_dtype=None):
    x, y = _small_problem(n=steps_per_epoch * batch)
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
    ref = _mlp()
    ref.set_weights(w0)
    ref.compile(_optimizer(optimizer, lr), loss, steps_per_execution=steps_per_execution)
    ref.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(batch).repeat(),
            epochs=epochs, steps_per_epoch=steps_per_epoch, verbose=0)
    with strategy.scope():
        model = _mlp()
        model.set_weights(w0)
        model.compile(_optimizer(optimizer, lr), loss,
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
            "stats": _stats(strategy)}


@scenario
def fit_on_running_cluster(tf_config, policy, policy_args=None, epochs=2, steps_per_epoch=20):
    """A chief on ps/worker tasks it did not start (and that outlive it), as
    a re-run chief: model.fit of the small MLP; exact counters."""
    x, y = _small_problem()
    config = tf_asyncps.cluster.validate_tf_config(tf_config)
    strategy = tf_asyncps.AsyncParameterServerStrategy(
        tf_asyncps.cluster.cluster_resolver(config),
        update_policy=tf_asyncps.policies.get(policy, **(policy_args or {})))

    def dataset_fn(ctx):
        return tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(16)

    with strategy.scope():
        model = _mlp()
        model.compile(_optimizer("sgd", 0.1),
                      tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(tf_keras.utils.experimental.DatasetCreator(dataset_fn), epochs=epochs,
              steps_per_epoch=steps_per_epoch, verbose=0)
    return {"stats": _stats(strategy), "iterations": int(model.optimizer.iterations.numpy())}


@scenario(shares_cluster=True)
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


@scenario(shares_cluster=True)
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

        _run_steps(coord, _step_fn(strategy, [w], opt, lambda: tf.reduce_sum(w)), steps)
        s = strategy.staleness_stats()
        return {"w": w.numpy().tolist(), "iterations": int(opt.iterations.numpy()),
                "stats": s.to_dict(), "steps": steps, "lr": lr}


@scenario(shares_cluster=True)
def local_sgd_linear(num_workers=3, steps=60, lr=0.5, dim=4, sync_every=4, chained=False):
    """local_sgd with loss = sum(w) (gradient 1): every local step moves a
    worker's copy by -lr, so after the drain w == w0 - lr * steps exactly.
    ``chained``: the policy inside ``chain(...)``."""
    policy = tf_asyncps.policies.get("local_sgd", sync_every=sync_every)
    with _cluster(num_workers=num_workers, num_ps=1) as c:
        strategy = tf_asyncps.AsyncParameterServerStrategy(
            c.resolver(), update_policy=tf_asyncps.policies.chain(policy) if chained else policy)
        coord = tf.distribute.coordinator.ClusterCoordinator(strategy)
        with strategy.scope():
            w = tf.Variable(tf.fill([dim], 2.0), name="w")
            opt = tf_keras.optimizers.SGD(lr)
        _run_steps(coord, _step_fn(strategy, [w], opt, lambda: tf.reduce_sum(w)), steps)
        first = {"w": w.numpy().tolist(), "iterations": int(opt.iterations.numpy()),
                 "stats": _stats(strategy)}
        # The chief changes the model between runs: workers must pull it.
        w.assign(tf.fill([dim], 100.0))
        _run_steps(coord, _step_fn(strategy, [w], opt, lambda: tf.reduce_sum(w)), steps)
        return {"first": first, "w": w.numpy().tolist(),
                "iterations": int(opt.iterations.numpy()), "stats": _stats(strategy)}


@scenario(shares_cluster=True)
def local_sgd_momentum_slots(num_workers=2, steps=40, lr=0.1, momentum=0.5, sync_every=4):
    """local_sgd with SGD momentum on loss = sum(w): the momentum slot is each
    worker's own state. Returns the PS copy of the slot after the drain and
    the names of the variables an exchange moves."""
    policy = tf_asyncps.policies.get("local_sgd", sync_every=sync_every)
    with _cluster(num_workers=num_workers, num_ps=1) as c:
        strategy = tf_asyncps.AsyncParameterServerStrategy(c.resolver(), update_policy=policy)
        coord = tf.distribute.coordinator.ClusterCoordinator(strategy)
        with strategy.scope():
            w = tf.Variable(tf.fill([4], 2.0), name="w")
            opt = tf_keras.optimizers.SGD(lr, momentum=momentum)
        _run_steps(coord, _step_fn(strategy, [w], opt, lambda: tf.reduce_sum(w)), steps)
        local = strategy.extended.engine.local
        slots = [v for v in opt.variables if v.shape.rank]
        return {"w": w.numpy().tolist(), "iterations": int(opt.iterations.numpy()),
                "slots_on_ps": [v.numpy().tolist() for v in slots],
                "exchanged": sorted(c.master.name for c in local.exchanged(local._copies.values())),
                "stats": _stats(strategy)}


@scenario(shares_cluster=True)
def straggler_counts(num_workers=2, slow_worker=0, delay_ms=30, steps=40):
    """tf_asyncps.straggler.slow_dataset_fn: closures taken by each worker,
    counted on the PS (ClusterCoordinator gives closures to free workers)."""
    from tf_asyncps.app.straggler import slow_dataset_fn
    with _cluster(num_workers=num_workers, num_ps=1) as c:
        strategy = tf_asyncps.AsyncParameterServerStrategy(c.resolver())
        coord = tf.distribute.coordinator.ClusterCoordinator(strategy)
        with strategy.scope():
            counts = tf.Variable(tf.zeros([num_workers], tf.int64), trainable=False)

        def dataset_fn(ctx):
            return tf.data.Dataset.from_tensors(tf.constant(1, tf.int64)).repeat()

        slow = slow_dataset_fn(dataset_fn, slow_worker, delay_ms)
        it = iter(coord.create_per_worker_dataset(
            lambda: slow(tf.distribute.InputContext())))

        @tf.function
        def step(iterator):
            one = next(iterator)
            w = tf.cast(tf.distribute.coordinator.experimental_get_current_worker_index(),
                        tf.int64)
            counts.scatter_add(tf.IndexedSlices(tf.reshape(one, [1]), tf.reshape(w, [1])))

        for _ in range(steps):
            coord.schedule(step, args=(it,))
        coord.join()
        return {"counts": counts.numpy().tolist()}


@scenario(shares_cluster=True)
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


@scenario(shares_cluster=True)
def keras3_fit_fails():
    """A Keras 3 model created in the scope but compiled outside it never got
    this strategy's fit: each input form (arrays, Dataset, DatasetFn,
    DatasetCreator) and evaluate/predict fail at once with our message."""
    import time
    import keras  # Keras 3
    import tf_keras
    from tf_asyncps.keras3 import DatasetFn
    with _cluster(num_workers=1, num_ps=1) as c:
        strategy = tf_asyncps.AsyncParameterServerStrategy(c.resolver())
        with strategy.scope():
            model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
            uncompiled = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        model.compile(keras.optimizers.SGD(0.1), "mse")
        x, y = np.zeros((8, 4), np.float32), np.zeros((8, 2), np.float32)

        def rep_fn(ctx):
            return tf.data.Dataset.from_tensor_slices((x, y)).batch(4).repeat()

        ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(4)
        attempts = {
            "fit_arrays": lambda: model.fit(x, y, epochs=1, verbose=0),
            "fit_dataset": lambda: model.fit(ds.repeat(), epochs=1, steps_per_epoch=2,
                                             verbose=0),
            "fit_dataset_fn": lambda: model.fit(DatasetFn(rep_fn), epochs=1,
                                                steps_per_epoch=2, verbose=0),
            "fit_dataset_creator": lambda: model.fit(
                tf_keras.utils.experimental.DatasetCreator(rep_fn), epochs=1,
                steps_per_epoch=2, verbose=0),
            "evaluate_dataset_fn": lambda: model.evaluate(DatasetFn(rep_fn), steps=2,
                                                          verbose=0),
            "predict_dataset": lambda: model.predict(ds, verbose=0),
            "uncompiled_fit": lambda: uncompiled.fit(ds.repeat(), steps_per_epoch=2,
                                                     verbose=0),
        }
        out = {}
        for name, call in attempts.items():
            t0 = time.perf_counter()
            try:
                call()
                out[name] = {"error": None}
            except Exception as e:  # noqa: BLE001 - reported to the test
                out[name] = {"error": type(e).__name__, "message": str(e),
                             "seconds": time.perf_counter() - t0}
        return {"attempts": out, "global_step": strategy.staleness_stats().global_step}


def _least_squares(n=64, features=5, seed=0):
    rng = np.random.RandomState(seed)
    x = rng.randn(n, features).astype(np.float32)
    y = (x @ rng.randn(features, 1) + 0.1 * rng.randn(n, 1)).astype(np.float32)
    return x, y


@scenario(shares_cluster=True)
def full_batch_policy(policy="drop_stale", policy_args=None, num_workers=4, steps=60,
                      lr=0.05, sparse=False):
    """Every worker computes the full-batch least-squares gradient (custom loop).

    Returns the final weights and sequential full-batch gradient descent run
    for ``global_step`` updates from the same start (in this process, no
    strategy). With ``sparse``, the model adds a per-example bias looked up
    with tf.gather, whose gradient is tf.IndexedSlices.
    """
    x, y = _least_squares()
    ids = (np.arange(len(x)) % 10).astype(np.int64)

    def loss_fn(w, e):
        pred = tf.matmul(x, w)
        if sparse:
            pred = pred + tf.gather(e, ids)
        return tf.reduce_mean(tf.square(pred - y))

    with _cluster(num_workers=num_workers, num_ps=1) as c:
        strategy = tf_asyncps.AsyncParameterServerStrategy(
            c.resolver(), update_policy=tf_asyncps.policies.get(policy, **(policy_args or {})))
        coord = tf.distribute.coordinator.ClusterCoordinator(strategy)
        with strategy.scope():
            w = tf.Variable(tf.zeros([x.shape[1], 1]), name="w")
            e = tf.Variable(tf.zeros([10, 1]), name="e")
            opt = tf_keras.optimizers.SGD(lr)
        params = [w, e] if sparse else [w]
        _run_steps(coord, _step_fn(strategy, params, opt, lambda: loss_fn(w, e)), steps)
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


def _train_with_straggler(strategy, coord, x, y, slow_worker, delay_ms, steps, lr=0.01):
    """Full-batch least squares; ``slow_worker``'s input pipeline sleeps
    ``delay_ms`` before each batch (tf.data, chosen by worker index)."""
    from tensorflow.python.data.experimental.ops import testing as data_testing
    with strategy.scope():
        w = tf.Variable(tf.zeros([x.shape[1], 1]), name="w")
        opt = tf_keras.optimizers.SGD(lr)

    def dataset_fn():
        me = tf.distribute.coordinator.experimental_get_current_worker_index()
        delay_us = tf.where(tf.equal(me, slow_worker), delay_ms * 1000, 0)
        ds = tf.data.Dataset.from_tensors((x, y)).repeat()
        return ds.apply(data_testing.sleep(tf.cast(delay_us, tf.int64)))

    step = _step_fn(strategy, [w], opt, with_batch=True,
                    loss_fn=lambda xb, yb: tf.reduce_mean(tf.square(tf.matmul(xb, w) - yb)))
    _run_steps(coord, step, steps, iter(coord.create_per_worker_dataset(dataset_fn)))


@scenario(shares_cluster=True)
def ssp_straggler(max_staleness=1, num_workers=3, slow_worker=0, delay_ms=40, steps=45,
                  chained=False):
    """ssp with one worker slowed by a tf.data sleep: the clock spread stays <= s.
    ``chained``: ssp inside ``chain(ssp, "async")``."""
    x, y = _least_squares()
    p = tf_asyncps.policies.get("ssp", max_staleness=max_staleness, timeout_s=60)
    with _cluster(num_workers=num_workers, num_ps=1) as c:
        strategy = tf_asyncps.AsyncParameterServerStrategy(
            c.resolver(), update_policy=tf_asyncps.policies.chain(p, "async") if chained else p)
        coord = tf.distribute.coordinator.ClusterCoordinator(strategy)
        _train_with_straggler(strategy, coord, x, y, slow_worker, delay_ms, steps)
        return {"clocks": p.clock_values().tolist(), "max_spread": p.max_clock_spread(),
                "released_reads": p.released_reads(),
                "stats": _stats(strategy)}


def _make_opt(keras_name, name, lr):
    if keras_name == "keras3":
        import keras
        return {"sgd": lambda: keras.optimizers.SGD(lr),
                "adam": lambda: keras.optimizers.Adam(lr)}[name]()
    return {"sgd": lambda: tf_keras.optimizers.SGD(lr),
            "adam": lambda: tf_keras.optimizers.Adam(lr),
            "legacy_sgd": lambda: tf_keras.optimizers.legacy.SGD(lr),
            "legacy_adam": lambda: tf_keras.optimizers.legacy.Adam(lr)}[name]()


@scenario(shares_cluster=True)
def case002(keras_name="tf_keras", optimizer="sgd", locking=False, num_workers=4,
            steps=200, dim=1000):
    """Case 002: loss = sum(w) (gradient 1), w zeros [1000], 200 steps."""
    lr = 1.0 if optimizer.endswith("sgd") else 1e-3
    with _cluster(num_workers=num_workers, num_ps=1) as c:
        strategy = tf_asyncps.AsyncParameterServerStrategy(c.resolver())
        coord = tf.distribute.coordinator.ClusterCoordinator(strategy)
        with strategy.scope():
            w = tf.Variable(tf.zeros([dim]), name="w")
            opt = _make_opt(keras_name, optimizer, lr)
            if locking:
                opt = tf_asyncps.optimizers.LockingOptimizer(opt, timeout_s=60)
            if keras_name == "keras3":
                opt.build([w])

        _run_steps(coord, _step_fn(strategy, [w], opt, lambda: tf.reduce_sum(w)), steps)
        got = w.numpy()
        # Reference: the same optimizer, `steps` sequential steps, in this process.
        ref_w = tf.Variable(tf.zeros([dim]))
        ref_opt = _make_opt(keras_name, optimizer, lr)
        for _ in range(steps):
            ref_opt.apply_gradients([(tf.ones([dim]), ref_w)])
        it = opt.iterations
        return {"iterations": int(it.numpy()), "w_min": float(got.min()),
                "w_max": float(got.max()), "ref": float(ref_w.numpy()[0]),
                "max_abs_diff": float(np.max(np.abs(got - ref_w.numpy()))),
                "stats": _stats(strategy)}


class _HalfPlusGrad(tf_keras.optimizers.Optimizer):
    """A read-modify-write update: var <- 0.5 * var + g (not commutative)."""

    def __init__(self, name="half_plus_grad", **kwargs):
        super().__init__(name=name, **kwargs)
        self._learning_rate = self._build_learning_rate(1.0)

    def update_step(self, gradient, variable):
        variable.assign(0.5 * variable + gradient)


@scenario(shares_cluster=True)
def read_modify_write(locking=True, num_workers=4, steps=20):
    with _cluster(num_workers=num_workers, num_ps=1) as c:
        strategy = tf_asyncps.AsyncParameterServerStrategy(c.resolver())
        coord = tf.distribute.coordinator.ClusterCoordinator(strategy)
        with strategy.scope():
            w = tf.Variable(0.0, name="w")
            opt = _HalfPlusGrad()
            if locking:
                opt = tf_asyncps.optimizers.LockingOptimizer(opt)

        _run_steps(coord, _step_fn(strategy, [w], opt, lambda: w * 1.0), steps)
        return {"w": float(w.numpy()), "iterations": int(opt.iterations.numpy()),
                "stats": _stats(strategy)}


@scenario
def locking_worker_killed(num_workers=3, epochs=4, steps_per_epoch=50, kill_after=60):
    """LockingOptimizer under model.fit; worker 1 is SIGKILLed mid-fit."""
    import threading
    x, y = _small_problem()

    def dataset_fn(ctx):
        ds = tf.data.Dataset.from_tensor_slices((x, y))
        ds = ds.shard(ctx.num_input_pipelines, ctx.input_pipeline_id)
        return ds.repeat().batch(16)

    with _cluster(num_workers=num_workers, num_ps=1) as c:
        strategy = tf_asyncps.AsyncParameterServerStrategy(c.resolver())
        with strategy.scope():
            model = _mlp()
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
                "stats": _stats(strategy)}


@scenario
def lock_timeout(timeout_s=2.0):
    """The update lock's token is held (taken by hand): the step must fail
    with TimeoutError after timeout_s, not hang."""
    import time
    with _cluster(num_workers=1, num_ps=1) as c:
        strategy = tf_asyncps.AsyncParameterServerStrategy(c.resolver())
        coord = tf.distribute.coordinator.ClusterCoordinator(strategy)
        with strategy.scope():
            w = tf.Variable(1.0)
            opt = tf_asyncps.optimizers.LockingOptimizer(tf_keras.optimizers.SGD(0.1),
                                                         timeout_s=timeout_s)

        step = _step_fn(strategy, [w], opt, lambda: w * 2.0)
        _run_steps(coord, step, 1)  # traces the step and creates the lock
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


@scenario(shares_cluster=True)
def sync_straggler(replicas_to_aggregate=2, num_workers=3, slow_worker=0, delay_ms=80,
                   steps=60):
    """sync_replicas with one worker slowed by a sleep in its input pipeline."""
    x, y = _least_squares()
    with _cluster(num_workers=num_workers, num_ps=1) as c:
        strategy = tf_asyncps.AsyncParameterServerStrategy(
            c.resolver(), update_policy=tf_asyncps.policies.get(
                "sync_replicas", replicas_to_aggregate=replicas_to_aggregate,
                total_num_replicas=num_workers, timeout_s=60))
        coord = tf.distribute.coordinator.ClusterCoordinator(strategy)
        _train_with_straggler(strategy, coord, x, y, slow_worker, delay_ms, steps)
        p = strategy.update_policy
        return {"sent": p.gradients_sent().tolist(), "rounds": p.rounds(),
                "released_reads": p.released_reads(), "stats": _stats(strategy)}


@scenario
def sync_dead_worker(replicas_to_aggregate=2, num_workers=3, steps=120, kill_after=10,
                     timeout_s=5.0):
    """sync_replicas with worker 1 SIGKILLed mid-run."""
    import threading
    import time
    x, y = _least_squares()
    with _cluster(num_workers=num_workers, num_ps=1) as c:
        strategy = tf_asyncps.AsyncParameterServerStrategy(
            c.resolver(), update_policy=tf_asyncps.policies.get(
                "sync_replicas", replicas_to_aggregate=replicas_to_aggregate,
                timeout_s=timeout_s))
        coord = tf.distribute.coordinator.ClusterCoordinator(strategy)
        with strategy.scope():
            w = tf.Variable(tf.zeros([x.shape[1], 1]), name="w")
            opt = tf_keras.optimizers.SGD(0.01)

        step = _step_fn(strategy, [w], opt,
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
            _run_steps(coord, step, steps)
        except Exception as e:  # noqa: BLE001 - reported to the test
            err = e
        finally:
            done.set()
            t.join(timeout=10)
        return {"killed": killed.is_set(), "error": type(err).__name__ if err else None,
                "message": str(err) if err else "", "seconds": time.perf_counter() - t0,
                "rounds": strategy.update_policy.rounds(), "stats": _stats(strategy)}


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
    with _cluster(num_workers=num_workers, num_ps=1) as c:
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
        stats = _stats(strategy)
        stats["global_step"] -= g0  # this round's updates
        return {"stats": stats, "closures": closures, "saw_update": saw_update,
                "attempts": attempt}


@scenario(shares_cluster=True)
def fit_evaluate_fit(policy="sync_replicas", policy_args=None, num_workers=2, steps=20):
    """model.fit, model.evaluate (steps without updates), model.fit again."""
    x, y = _small_problem()

    def dataset_fn(ctx):
        ds = tf.data.Dataset.from_tensor_slices((x, y))
        return ds.shard(ctx.num_input_pipelines, ctx.input_pipeline_id).repeat().batch(16)

    with _cluster(num_workers=num_workers, num_ps=1) as c:
        strategy = tf_asyncps.AsyncParameterServerStrategy(
            c.resolver(), update_policy=tf_asyncps.policies.get(
                policy, **(policy_args or {"replicas_to_aggregate": num_workers,
                                           "timeout_s": 30})))
        with strategy.scope():
            model = _mlp()
            model.compile(tf_keras.optimizers.SGD(0.1),
                          tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        data = tf_keras.utils.experimental.DatasetCreator(dataset_fn)
        model.fit(data, epochs=1, steps_per_epoch=steps, verbose=0)
        loss = model.evaluate(data, steps=steps, verbose=0)
        model.fit(data, epochs=1, steps_per_epoch=steps, verbose=0)
        return {"eval_loss": float(loss), "stats": _stats(strategy)}


@scenario(shares_cluster=True)
def fetch_drains(num_workers=2, loop_iterations=300_000):
    """While the chief waits on a scheduled step's RemoteValue.fetch with
    nothing else queued, the coordinator reports no queued closures (the
    probe a gated policy's watchdog uses to release waiting workers, as at
    join); before the fetch, while the program could still schedule, it does."""
    import threading
    with _cluster(num_workers=num_workers, num_ps=1) as c:
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


def _proc_state(pid):
    """The one-letter state in /proc/PID/stat ("T": stopped)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


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
    x, y = _small_problem()

    def dataset_fn(ctx):
        ds = tf.data.Dataset.from_tensor_slices((x, y))
        return ds.shard(ctx.num_input_pipelines, ctx.input_pipeline_id).repeat().batch(16)

    with _cluster(num_workers=num_workers, num_ps=1) as c, \
            socket.create_server(("127.0.0.1", 0), backlog=4) as evaluator:
        cfg = json.loads(c.tf_config("chief", 0))
        cfg["cluster"]["evaluator"] = ["127.0.0.1:%d" % evaluator.getsockname()[1]]
        os.environ["TF_CONFIG"] = json.dumps(cfg)
        strategy = tf_asyncps.AsyncParameterServerStrategy(
            tf.distribute.cluster_resolver.TFConfigClusterResolver(),
            update_policy=tf_asyncps.policies.get(policy, **(policy_args or {})),
            connect_timeout_s=30)
        with strategy.scope():
            model = _mlp()
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
            while _proc_state(pid) != "T" and not done.wait(0.01):  # delivery is async
                if time.monotonic() - t_stop > 2:
                    break
            ev["state_stopped"] = _proc_state(pid)
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
                "stats": _stats(strategy)}


@scenario
def worker_faults_digits(policy="async", num_workers=2, epochs=16, steps_per_epoch=100,
                         spe=10, kill_after=150, stop_s=5.0):
    """Digits MLP under model.fit on a supervised LocalCluster: worker:1 is
    SIGKILLed mid-fit (the supervisor restarts it; it must rejoin) and, at
    the same moment, worker:0 is SIGSTOPped for ``stop_s`` s, then continued."""
    import signal
    import threading
    from tf_asyncps.app import datasets
    from tf_asyncps.app import models
    data = datasets.load("digits", seed=0)
    with _cluster(num_workers=num_workers, num_ps=1) as c:
        c.supervise(max_restarts=2, poll_s=0.2)
        strategy = tf_asyncps.AsyncParameterServerStrategy(
            c.resolver(), update_policy=policy)
        with strategy.scope():
            model = models.build_model("mlp", data.num_features, data.num_classes, (64,), 0)
            model.compile(tf_keras.optimizers.SGD(0.1),
                          tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                          steps_per_execution=spe)
        ev = {}
        done = threading.Event()

        def faults():  # polls the counters (tf_keras has no batch hooks under PS)
            while not done.wait(0.02):
                if strategy.staleness_stats().worker_steps >= kill_after:
                    break
            else:
                return
            ev["done_at_kill"] = strategy.closures_done_per_worker()
            c.kill("worker:1")
            c.kill("worker:0", signal.SIGSTOP)
            ev["faults"] = True
            done.wait(stop_s)
            c.kill("worker:0", signal.SIGCONT)
            ev["steps_at_cont"] = strategy.staleness_stats().worker_steps
            while not done.wait(0.05):  # rejoined: worker 1 completes closures again
                if strategy.closures_done_per_worker()[1] > ev["done_at_kill"][1]:
                    ev["rejoined_at_step"] = strategy.staleness_stats().worker_steps
                    return

        t = threading.Thread(target=faults, daemon=True)
        t.start()
        try:
            model.fit(tf_keras.utils.experimental.DatasetCreator(
                datasets.make_dataset_fn(data.x_train, data.y_train, 32, 0)),
                epochs=epochs, steps_per_epoch=steps_per_epoch, verbose=0)
        finally:
            done.set()
            t.join(timeout=10)
            c.kill("worker:0", signal.SIGCONT)  # never leave it stopped
        local = models.build_model("mlp", data.num_features, data.num_classes, (64,), 0)
        local.set_weights(model.get_weights())
        local.compile(loss=tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
        acc = local.evaluate(data.x_test, data.y_test, verbose=0)[1]
        return {"events": ev, "restarts": dict(c.restarts), "gave_up": dict(c.gave_up),
                "done": strategy.closures_done_per_worker(),
                "scheduled": epochs * steps_per_epoch, "spe": spe,
                "test_accuracy": float(acc), "stats": _stats(strategy)}


@scenario
def checkpoint_crash(backup_dir, crash_at="state"):
    """A process that crashes (os._exit) inside its second epoch-end
    BackupAndRestore save: after the new checkpoint's data is written but
    before the ``checkpoint`` state file names it (``crash_at="state"``), or
    before the shards are merged into it (``"merge"``). Returns (if it does
    not crash) nothing useful; the first checkpoint's weights are saved to
    ``backup_dir/../epoch1_weights.npz`` for the test to compare."""
    from tensorflow.python.checkpoint import checkpoint_management, functional_saver
    x, y = _small_problem()
    model = _mlp()
    model.compile(tf_keras.optimizers.SGD(0.1),
                  tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    backup = lambda: tf_keras.callbacks.BackupAndRestore(backup_dir, delete_checkpoint=False)
    model.fit(x, y, epochs=1, batch_size=32, verbose=0, callbacks=[backup()])
    np.savez(os.path.join(os.path.dirname(backup_dir), "epoch1_weights.npz"),
             *model.get_weights())

    def crash(*args, **kwargs):
        sys.stdout.flush()
        os._exit(17)

    if crash_at == "state":
        checkpoint_management.update_checkpoint_state_internal = crash
    else:
        functional_saver.gen_io_ops.merge_v2_checkpoints = crash
    model.fit(x, y, epochs=2, batch_size=32, verbose=0, callbacks=[backup()])
    return {"crashed": False}


def _fake_multi_replica_workers(replicas):
    """Makes ParameterServerStrategy see ``replicas`` devices per worker on CPU.

    The strategy counts GPUs to decide its replicas per worker; on a machine
    without GPUs this test stand-in reports ``replicas`` and names the worker
    servers' logical CPUs instead (the servers are made with that many CPU
    devices, see :func:`_in_process_cluster`). The multi-replica code path
    (one replica thread per device, merge_call, AggregatingVariable) is then
    the one a K-GPU worker takes.
    """
    from tensorflow.python.distribute import parameter_server_strategy_v2 as pss_v2
    ext = pss_v2.ParameterServerStrategyV2Extended

    def _set_num_gpus(self):
        self._num_gpus_per_worker = replicas

    ext._set_num_gpus = _set_num_gpus
    ext.worker_devices = property(
        lambda self: tuple(f"/device:CPU:{i}" for i in range(replicas)))


def _in_process_cluster(num_workers, cpus_per_worker=1, num_ps=1):
    """ps and worker servers in this process (TensorFlow's own PS tests do
    this); each worker server has ``cpus_per_worker`` CPU devices."""
    import portpicker
    from tf_asyncps import cluster as cluster_lib
    ports = [portpicker.pick_unused_port() for _ in range(num_workers + num_ps + 1)]
    spec = tf.train.ClusterSpec({
        "chief": [f"127.0.0.1:{ports[0]}"],
        "ps": [f"127.0.0.1:{p}" for p in ports[1:1 + num_ps]],
        "worker": [f"127.0.0.1:{p}" for p in ports[1 + num_ps:]]})
    servers = []
    for job, n in (("ps", num_ps), ("worker", num_workers)):
        for i in range(n):
            cfg = cluster_lib.server_config(num_workers)
            if job == "worker":
                cfg.device_count["CPU"] = cpus_per_worker
            servers.append(tf.distribute.Server(spec, job_name=job, task_index=i, config=cfg,
                                                protocol="grpc", start=True))
    return servers, tf.distribute.cluster_resolver.SimpleClusterResolver(
        spec, task_type="chief", task_id=0, rpc_layer="grpc")


@scenario
def replicas_fit(replicas=2, num_workers=1, policy="async", policy_args=None,
                 optimizer="momentum", lr=0.1, locking=False, epochs=2, steps_per_epoch=10,
                 batch=8, precision=None):
    """model.fit with ``replicas`` replicas per worker (the K-GPU worker path,
    on CPU devices). With one worker, compared with one-process training on
    batches of replicas * batch examples in the same order."""
    _fake_multi_replica_workers(replicas)
    servers, resolver = _in_process_cluster(num_workers, cpus_per_worker=replicas)
    x, y = _small_problem(n=steps_per_epoch * batch * replicas * num_workers)
    rng = np.random.RandomState(1)
    w0 = [rng.uniform(-0.5, 0.5, shape).astype(np.float32)
          for shape in [(8, 16), (16,), (16, 3), (3,)]]
    loss = tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def dataset_fn(ctx):  # each replica takes its own batch, in turn
        ds = tf.data.Dataset.from_tensor_slices((x, y))
        ds = ds.shard(ctx.num_input_pipelines, ctx.input_pipeline_id)
        return ds.batch(batch).repeat()

    strategy = tf_asyncps.AsyncParameterServerStrategy(
        resolver, update_policy=tf_asyncps.policies.get(policy, **(policy_args or {})))
    ref = _mlp()
    ref.set_weights(w0)
    ref.compile(_optimizer(optimizer, lr), loss)
    ref.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(batch * replicas).repeat(),
            epochs=epochs, steps_per_epoch=steps_per_epoch, verbose=0)
    if precision:
        tf_keras.mixed_precision.set_global_policy(precision)
    with strategy.scope():
        model = _mlp()
        model.set_weights(w0)
        opt = _optimizer(optimizer, lr)
        if precision == "mixed_float16":
            opt = tf_keras.mixed_precision.LossScaleOptimizer(opt)
        if locking:
            opt = tf_asyncps.optimizers.LockingOptimizer(opt)
        model.compile(opt, loss)
    model.fit(tf_keras.utils.experimental.DatasetCreator(dataset_fn), epochs=epochs,
              steps_per_epoch=steps_per_epoch, verbose=0)
    diffs = [float(np.max(np.abs(a - b))) for a, b in zip(model.get_weights(), ref.get_weights())]
    moved = [float(np.max(np.abs(a - b))) for a, b in zip(ref.get_weights(), w0)]
    p = strategy.update_policy
    return {"replicas": strategy.num_replicas_in_sync, "max_abs_diff": max(diffs),
            "moved": max(moved), "iterations": int(model.optimizer.iterations.numpy()),
            "finite": all(bool(np.all(np.isfinite(v))) for v in model.get_weights()),
            "rounds": p.rounds() if hasattr(p, "rounds") else None,
            "loss_scale": (float(model.optimizer.loss_scale.numpy())
                           if precision == "mixed_float16" else None),
            "stats": _stats(strategy)}


@scenario
def replicas_embedding_fit(replicas=2, policy="async", epochs=2, steps_per_epoch=10, batch=8,
                           num_ps=1):
    """An Embedding model (sparse IndexedSlices gradients) with ``replicas``
    replicas on one worker, against one-process training on batches of
    replicas * batch examples in the same order. ``num_ps`` > 1: the table
    and the Dense layer are split over the ps tasks (FixedShardsPartitioner)."""
    _fake_multi_replica_workers(replicas)
    servers, resolver = _in_process_cluster(1, cpus_per_worker=replicas, num_ps=num_ps)
    rng = np.random.RandomState(0)
    ids = rng.randint(0, 50, size=(steps_per_epoch * batch * replicas, 3)).astype("int32")
    y = (ids[:, 0] % 2).astype("int64")
    loss = tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    w0 = [np.random.RandomState(1).uniform(-0.5, 0.5, shape).astype(np.float32)
          for shape in [(50, 4), (12, 2), (2,)]]

    def build():  # constant initializers: every shard starts from its rows of w0
        c = tf_keras.initializers.Constant
        return tf_keras.Sequential([tf_keras.layers.Input((3,), dtype="int32"),
                                    tf_keras.layers.Embedding(50, 4,
                                                              embeddings_initializer=c(w0[0])),
                                    tf_keras.layers.Flatten(),
                                    tf_keras.layers.Dense(2, kernel_initializer=c(w0[1]),
                                                          bias_initializer=c(w0[2]))])

    strategy = tf_asyncps.AsyncParameterServerStrategy(
        resolver, update_policy=policy,
        variable_partitioner=_partitioner("fixed", num_ps) if num_ps > 1 else None)
    ref = build()
    ref.compile(tf_keras.optimizers.SGD(0.1), loss)
    ref.fit(tf.data.Dataset.from_tensor_slices((ids, y)).batch(batch * replicas).repeat(),
            epochs=epochs, steps_per_epoch=steps_per_epoch, verbose=0)
    with strategy.scope():
        model = build()
        model.compile(tf_keras.optimizers.SGD(0.1), loss)

    def dataset_fn(ctx):
        ds = tf.data.Dataset.from_tensor_slices((ids, y))
        return ds.shard(ctx.num_input_pipelines, ctx.input_pipeline_id).batch(batch).repeat()

    model.fit(tf_keras.utils.experimental.DatasetCreator(dataset_fn), epochs=epochs,
              steps_per_epoch=steps_per_epoch, verbose=0)
    full = [_full(v) for v in (model.layers[0].embeddings, model.layers[2].kernel,
                               model.layers[2].bias)]
    diffs = [float(np.max(np.abs(a - b))) for a, b in zip(full, ref.get_weights())]
    moved = [float(np.max(np.abs(a - b))) for a, b in zip(ref.get_weights(), w0)]
    return {"max_abs_diff": max(diffs), "moved": max(moved),
            "shards": len(tf_compat.shards(model.layers[0].embeddings) or [None]),
            "iterations": int(model.optimizer.iterations.numpy()), "stats": _stats(strategy)}


@scenario(shares_cluster=True)
def mixed_precision_fit(precision="mixed_bfloat16", policy="async", policy_args=None,
                        num_workers=2, epochs=2, steps_per_epoch=40, batch=16, lr=0.1,
                        initial_scale=None, locking=False):
    """model.fit of a small MLP under a tf_keras mixed-precision policy.

    Records, at trace time on this chief, the dtypes of the gradients the
    update policy receives. ``initial_scale`` (mixed_float16 only) starts the
    loss scale high enough to overflow float16, so the first steps have
    non-finite gradients. ``locking`` wraps the inner optimizer in
    LockingOptimizer (the LossScaleOptimizer goes around it).
    """
    x, y = _small_problem()
    loss = tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def dataset_fn(ctx):
        ds = tf.data.Dataset.from_tensor_slices((x, y))
        ds = ds.shard(ctx.num_input_pipelines, ctx.input_pipeline_id)
        return ds.shuffle(len(x), seed=0).repeat().batch(batch)

    def full_loss(weights):  # float32, in this process
        ref = _mlp()
        ref.set_weights(weights)
        return float(loss(y, ref(x)))

    with _cluster(num_workers=num_workers, num_ps=1) as c:
        strategy = tf_asyncps.AsyncParameterServerStrategy(
            c.resolver(), update_policy=tf_asyncps.policies.get(policy, **(policy_args or {})))
        seen = []
        original_update = strategy.update_policy.update

        def recording_update(grads, state, info):
            seen.extend(sorted({g.dtype.name for g in grads}))
            return original_update(grads, state, info)

        strategy.update_policy.update = recording_update
        tf_keras.utils.set_random_seed(0)
        tf_keras.mixed_precision.set_global_policy(precision)
        with strategy.scope():
            model = tf_keras.Sequential([
                tf_keras.Input(shape=(8,)),
                tf_keras.layers.Dense(16, activation="tanh"),
                tf_keras.layers.Dense(3),
                tf_keras.layers.Activation("linear", dtype="float32")])
            opt = tf_keras.optimizers.SGD(lr)
            if locking:
                opt = tf_asyncps.optimizers.LockingOptimizer(opt)
            if precision == "mixed_float16":
                opt = tf_keras.mixed_precision.LossScaleOptimizer(
                    opt, **({"initial_scale": initial_scale} if initial_scale else {}))
            model.compile(opt, loss)
        w0 = model.get_weights()
        model.fit(tf_keras.utils.experimental.DatasetCreator(dataset_fn), epochs=epochs,
                  steps_per_epoch=steps_per_epoch, verbose=0)
        tf_keras.mixed_precision.set_global_policy("float32")
        lock = strategy.extended.engine.lock
        return {
            "scheduled": epochs * steps_per_epoch,
            "compute_dtypes": sorted({l.compute_dtype for l in model.layers[:2]}),
            "variable_dtypes": sorted({v.dtype.name for v in model.weights}),
            "policy_grad_dtypes": sorted(set(seen)), "traces": len(seen),
            "loss0": full_loss(w0), "loss": full_loss(model.get_weights()),
            "iterations": int(model.optimizer.iterations.numpy()),
            "loss_scale": (float(model.optimizer.loss_scale.numpy())
                           if precision == "mixed_float16" else None),
            "lock_acquisitions": lock.acquisitions() if lock is not None else 0,
            "stats": _stats(strategy)}


@scenario
def gpu_placement(gpu_ids, steps=200, dim=1024):
    """Workers with one GPU each (ids from the caller): where ops and variables
    go, which processes hold GPU memory, and steps/s of a matmul step."""
    import subprocess
    import time
    from tf_asyncps.cluster import devices
    plan = devices.plan_gpus(len(gpu_ids), 1, gpu_ids)
    with _cluster(num_workers=len(gpu_ids), num_ps=1, worker_env=plan.worker_env) as c:
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

        _run_steps(coord, step, 10)  # warm-up and tracing
        t0 = time.perf_counter()
        _run_steps(coord, step, steps)
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
                "stats": _stats(strategy), "steps": steps + 10}


@scenario
def watchdogs_lifecycle(num_workers=2, steps=20):
    """ssp + LockingOptimizer: the gate's and the lock's watchdogs run while
    closures run and are stopped (threads ended) once the coordinator drains."""
    import threading

    def watchdog_threads():
        return sorted(t.name for t in threading.enumerate() if t.name.endswith("-watchdog"))

    with _cluster(num_workers=num_workers, num_ps=1) as c:
        strategy = tf_asyncps.AsyncParameterServerStrategy(
            c.resolver(), update_policy=tf_asyncps.policies.get("ssp", max_staleness=1))
        coord = tf.distribute.coordinator.ClusterCoordinator(strategy)
        with strategy.scope():
            w = tf.Variable(tf.zeros([3]), name="w")
            opt = tf_asyncps.optimizers.LockingOptimizer(tf_keras.optimizers.SGD(0.5))
        step = _step_fn(strategy, [w], opt, lambda: tf.reduce_sum(w))
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
        return {"rounds": rounds, "w": w.numpy().tolist(), "stats": _stats(strategy)}


# -- sharded embeddings (variable_partitioner over several ps tasks) ---------------
EMB_ROWS, EMB_DIM, EMB_BATCH = 40, 4, 8


def _embedding_problem(steps, batch=EMB_BATCH, seed=0):
    """ids (int64 [n, 2]) drawn from the first half of the table, with
    duplicates inside every batch; targets float32 [n, 1]."""
    rng = np.random.RandomState(seed)
    ids = rng.randint(0, EMB_ROWS // 2, size=(steps * batch, 2)).astype(np.int64)
    ys = rng.uniform(size=(steps * batch, 1)).astype(np.float32)
    emb0 = rng.uniform(-0.5, 0.5, (EMB_ROWS, EMB_DIM)).astype(np.float32)
    k0 = rng.uniform(-0.5, 0.5, (2 * EMB_DIM, 1)).astype(np.float32)
    return ids, ys, emb0, k0


def _embedding_model(emb0, k0):
    # Constant initializers: each shard starts from its rows of emb0/k0.
    return tf_keras.Sequential([
        tf_keras.Input(shape=(2,), dtype=tf.int64),
        tf_keras.layers.Embedding(EMB_ROWS, EMB_DIM,
                                  embeddings_initializer=tf_keras.initializers.Constant(emb0)),
        tf_keras.layers.Flatten(),
        tf_keras.layers.Dense(1, use_bias=False,
                              kernel_initializer=tf_keras.initializers.Constant(k0))])


def _partitioner(name, num_ps):
    p = tf.distribute.experimental.partitioners
    return {"fixed": lambda: p.FixedShardsPartitioner(num_ps),
            "min": lambda: p.MinSizePartitioner(min_shard_bytes=64, max_shards=num_ps),
            "max": lambda: p.MaxSizePartitioner(max_shard_bytes=256)}[name]()


def _same_task(a, b):
    a, b = tf.DeviceSpec.from_string(a), tf.DeviceSpec.from_string(b)
    return (a.job, a.task) == (b.job, b.task)


def _policy(policy, policy_args=None):
    """A policy from JSON-able arguments; "route" takes its parts as names or
    ``[name, kwargs]`` pairs."""
    if policy == "route":
        part = lambda p: tf_asyncps.policies.get(p[0], **p[1]) if isinstance(p, list) else p
        return tf_asyncps.policies.route(**{k: part(v) for k, v in policy_args.items()})
    return tf_asyncps.policies.get(policy, **(policy_args or {}))


def _state_placement(strategy):
    """Counts of engine/policy state variables that sit on the ps task of the
    variable they serve (``beside``) and of those that do not."""
    engine = strategy.extended.engine
    by_id = {id(v): v for v in engine._trainable}
    pairs = []
    for key, state in engine._policy_state.items():
        groups = [(key, state)]
        if isinstance(engine.policy, tf_asyncps.policies.Route):  # a state per part
            known = [by_id.get(k) for k in key]
            if all(v is not None for v in known):
                groups = [([key[i] for i in idx], part_state) for idx, part_state
                          in zip(engine.policy.split(known), state)]
        for ids, st in groups:
            for vid, per_var in zip(ids, st if isinstance(st, (list, tuple)) else []):
                for s in tf.nest.flatten(per_var):
                    if isinstance(s, tf.Variable) and vid in by_id:
                        pairs.append((by_id[vid].device, s.device))
    if engine.lock is not None:
        pairs.append((engine.tracker.global_step.device, engine.lock._stats.device))
    beside = sum(_same_task(a, b) for a, b in pairs)
    return {"beside": beside, "elsewhere": len(pairs) - beside}


def _sharded_run(c, num_ps, policy="async", policy_args=None, optimizer="sgd", lr=0.5,
                 partitioner="fixed", locking=False, steps=12, full_batch=False,
                 reference=True, mixed=False, wire_dtype=None):
    if mixed:  # mixed_float16: float32 shards, float16 compute, loss scaling
        tf_keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        return _sharded_fit(c, num_ps, policy, policy_args, optimizer, lr, partitioner,
                            locking, steps, full_batch, reference, wire_dtype)
    finally:
        tf_keras.mixed_precision.set_global_policy("float32")


def _sharded_fit(c, num_ps, policy, policy_args, optimizer, lr, partitioner, locking, steps,
                 full_batch, reference, wire_dtype=None):
    ids, ys, emb0, k0 = _embedding_problem(steps)
    batch = len(ids) if full_batch else EMB_BATCH
    loss = "mse"

    def dataset_fn(ctx):
        ds = tf.data.Dataset.from_tensor_slices((ids, ys))
        if not full_batch:
            ds = ds.shard(ctx.num_input_pipelines, ctx.input_pipeline_id)
        return ds.batch(batch).repeat()

    strategy = tf_asyncps.AsyncParameterServerStrategy(
        c.resolver(), variable_partitioner=_partitioner(partitioner, num_ps),
        update_policy=_policy(policy, policy_args), wire_dtype=wire_dtype)
    with strategy.scope():
        model = _embedding_model(emb0, k0)
        opt = _optimizer(optimizer, lr)
        if locking:
            opt = tf_asyncps.optimizers.LockingOptimizer(opt)
        model.compile(opt, loss)
    model.fit(tf_keras.utils.experimental.DatasetCreator(dataset_fn), epochs=1,
              steps_per_epoch=steps, verbose=0)
    emb_var = model.layers[0].embeddings
    table, kernel = _full(emb_var), _full(model.layers[2].kernel)
    out = {"shards": len(tf_compat.shards(emb_var) or [emb_var]),
           "shard_tasks": sorted({tf.DeviceSpec.from_string(v.device).task
                                  for v in (tf_compat.shards(emb_var)
                                            or [emb_var])}),
           "untouched_rows_moved": float(np.max(np.abs(
               table[EMB_ROWS // 2:] - emb0[EMB_ROWS // 2:]))),
           "touched_rows_moved": float(np.max(np.abs(
               table[:EMB_ROWS // 2] - emb0[:EMB_ROWS // 2]))),
           "iterations": int(model.optimizer.iterations.numpy()),
           "stats": _stats(strategy), "placement": _state_placement(strategy),
           "local_copies": len(strategy.extended.engine.local._copies)
           if strategy.extended.engine.local is not None else 0,
           "trainable_parts": len(model.trainable_variables)}
    if policy == "route":
        out["part_updates"] = strategy.update_policy.part_updates()
        out["dense_rounds"] = strategy.update_policy.parts[1].rounds()
    if reference:
        # Plain single-process tf_keras training on the same batches.
        ref = _embedding_model(emb0, k0)
        ref.compile(_optimizer(optimizer, lr), loss)
        ref.fit(tf.data.Dataset.from_tensor_slices((ids, ys)).batch(batch).repeat(),
                epochs=1, steps_per_epoch=steps, verbose=0)
        ref_table, ref_kernel = ref.get_weights()
        out["max_abs_diff"] = float(max(np.max(np.abs(table - ref_table)),
                                        np.max(np.abs(kernel - ref_kernel))))
    return out


@scenario(shares_cluster=True)
def sharded_embedding(runs, num_workers=1, num_ps=2):
    """An embedding model partitioned over ``num_ps`` ps tasks; for each run
    (kwargs of _sharded_run) a new strategy on the one cluster."""
    with _cluster(num_workers=num_workers, num_ps=num_ps) as c:
        return {"runs": [_sharded_run(c, num_ps, **run) for run in runs]}


def _full(var):
    """The full value of a ShardedVariable (its shards concatenated) or variable."""
    return np.concatenate([np.asarray(p.numpy()) for p in tf_compat.shards(var) or [var]],
                          axis=0)


@scenario(shares_cluster=True)
def sharded_checkpoint(num_ps, save_to, restore_from=None, steps=6):
    """Embedding model with Adam, FixedShardsPartitioner(num_ps).

    Without ``restore_from``: trains ``steps`` steps. With it: restores that
    tf.train.Checkpoint (written with another number of ps tasks). Then writes
    a checkpoint to ``save_to``, and takes one more step on the next batch: a
    restore that lost Adam's slots or step count would make that step differ.
    """
    ids, ys, emb0, k0 = _embedding_problem(steps + 1)
    data = lambda lo, hi: tf_keras.utils.experimental.DatasetCreator(
        lambda ctx: tf.data.Dataset.from_tensor_slices((ids[lo:hi], ys[lo:hi])).batch(
            EMB_BATCH).repeat())
    with _cluster(num_workers=1, num_ps=num_ps) as c:
        strategy = tf_asyncps.AsyncParameterServerStrategy(
            c.resolver(), variable_partitioner=_partitioner("fixed", num_ps))
        with strategy.scope():
            model = _embedding_model(emb0, k0)
            opt = tf_keras.optimizers.Adam(0.05)
            model.compile(opt, "mse")
            opt.build(model.trainable_variables)  # slots exist before a restore
        ckpt = tf.train.Checkpoint(model=model, optimizer=opt)
        if restore_from:
            ckpt.read(restore_from).assert_existing_objects_matched()
        else:
            model.fit(data(0, steps * EMB_BATCH), epochs=1, steps_per_epoch=steps, verbose=0)
        table, kernel = model.layers[0].embeddings, model.layers[2].kernel
        saved = {"table": _full(table).tolist(), "kernel": _full(kernel).tolist(),
                 "iterations": int(opt.iterations.numpy())}
        path = ckpt.write(save_to)
        model.fit(data(steps * EMB_BATCH, (steps + 1) * EMB_BATCH), epochs=1,
                  steps_per_epoch=1, verbose=0)
        return {"path": path, "shards": len(tf_compat.shards(table) or [table]),
                "saved": saved, "next": {"table": _full(table).tolist(),
                                         "kernel": _full(kernel).tolist()}}


@scenario(shares_cluster=True)
def sharded_backup(backup_dir, num_ps=2, epochs=3, steps=4, crash_after_epoch=None):
    """model.fit with BackupAndRestore of an embedding model and its Adam
    slots, partitioned over ``num_ps`` ps tasks (one worker).

    Each epoch sees the same ``steps`` batches, so a fit resumed at an epoch
    boundary can equal an uninterrupted one exactly. With
    ``crash_after_epoch=k`` this process dies (exit 17) right after epoch k's
    checkpoint is written, and the cluster's tasks with it. Without it, the fit
    resumes from ``backup_dir``; then the same fit runs uninterrupted on fresh
    variables (a new strategy on the same cluster) for comparison, and that
    model is written with a checkpoint sharding callback (tf#73836:
    MaxShardSizePolicy on partitioned variables) and read into a third one.
    """
    ids, ys, emb0, k0 = _embedding_problem(steps)
    data = tf_keras.utils.experimental.DatasetCreator(
        lambda ctx: tf.data.Dataset.from_tensor_slices((ids, ys)).batch(EMB_BATCH).repeat())

    def values(model):
        table = model.layers[0].embeddings
        return {"shards": len(tf_compat.shards(table) or [table]),
                "iterations": int(model.optimizer.iterations.numpy()),
                "table": _full(table).tolist(), "kernel": _full(model.layers[2].kernel).tolist(),
                # Adam's m and v of every part (variables()[0] is the step count).
                "slots": [_full(v).tolist() for v in model.optimizer.variables()[1:]]}

    with _cluster(num_workers=1, num_ps=num_ps) as c:
        def build():
            strategy = tf_asyncps.AsyncParameterServerStrategy(
                c.resolver(), variable_partitioner=_partitioner("fixed", num_ps))
            with strategy.scope():
                model = _embedding_model(emb0, k0)
                model.compile(tf_keras.optimizers.Adam(0.05), "mse")
            return model

        def fit(callbacks):
            model, began = build(), []
            callbacks = callbacks + [tf_keras.callbacks.LambdaCallback(
                on_epoch_begin=lambda epoch, logs: began.append(epoch))]
            model.fit(data, epochs=epochs, steps_per_epoch=steps, verbose=0,
                      callbacks=callbacks)
            return model, dict(values(model), epochs_run=began)

        backup = tf_keras.callbacks.BackupAndRestore(backup_dir)
        if crash_after_epoch is not None:
            print("PIDS: " + json.dumps(list(c.pids.values())), flush=True)

            def crash(epoch, logs):
                if epoch + 1 == crash_after_epoch:
                    print(f"crashing after epoch {epoch + 1}", flush=True)
                    os._exit(17)  # no cleanup, as a SIGKILL right after the save
            fit([backup, tf_keras.callbacks.LambdaCallback(on_epoch_end=crash)])
            raise AssertionError("fit ended without the crash")
        _, resumed = fit([backup])
        left = os.listdir(backup_dir) if os.path.isdir(backup_dir) else []
        model, uninterrupted = fit([])
        path = tf.train.Checkpoint(model=model, optimizer=model.optimizer).write(
            os.path.join(backup_dir + "_sharded", "ckpt"),
            options=tf.train.CheckpointOptions(
                experimental_sharding_callback=tf.train.experimental.MaxShardSizePolicy(
                    max_shard_size=64)))
        third = build()
        third.optimizer.build(third.trainable_variables)
        tf.train.Checkpoint(model=third, optimizer=third.optimizer).read(
            path).assert_existing_objects_matched()
        return {"resumed": resumed, "uninterrupted": uninterrupted, "backup_left": left,
                "files": len(os.listdir(os.path.dirname(path))), "reread": values(third)}


def _cluster_tcp_bytes(c):
    """Bytes sent so far on every TCP connection to or from a task of
    cluster ``c`` (``ss -tin``, per socket: other jobs sharing the loopback
    interface do not count). Both ends of a loopback connection are listed,
    so this is what the tasks sent, all together."""
    import re
    import subprocess
    ports = {a.rsplit(":", 1)[1] for addrs in c.config.values() for a in addrs}
    out = subprocess.run(["ss", "-tinH", "state", "established"], capture_output=True,
                         text=True, check=True).stdout
    total, ours = 0, False
    for line in out.splitlines():
        if line and not line[0].isspace():  # "Recv-Q Send-Q local peer": a socket
            local, peer = line.split()[2:4]
            ours = bool({local.rsplit(":", 1)[1], peer.rsplit(":", 1)[1]} & ports)
        elif ours:
            m = re.search(r"\bbytes_sent:(\d+)", line)
            total += int(m.group(1)) if m else 0
    return total


@scenario
def embedding_traffic(rows_list, dim=32, ids_per_step=64, steps=100, num_ps=2,
                      wire_dtypes=(None,)):
    """TCP bytes per worker step (all the cluster's tasks) of an embedding model whose table has
    each of ``rows_list`` rows (split over ``num_ps`` ps tasks), every step
    touching ``ids_per_step`` ids: sparse reads and updates keep it flat.
    Each rows value is run once per ``wire_dtypes`` entry (the strategy's
    ``wire_dtype``), on the same ids."""
    rng = np.random.RandomState(0)
    out = []
    runs = [(rows, wire) for rows in rows_list for wire in wire_dtypes]
    data_of = {rows: (rng.randint(0, rows, size=(steps * ids_per_step, 1)).astype(np.int64),
                      rng.uniform(size=(steps * ids_per_step, 1)).astype(np.float32))
               for rows in rows_list}
    with _cluster(num_workers=1, num_ps=num_ps) as c:
        for rows, wire in runs:
            ids, ys = data_of[rows]
            strategy = tf_asyncps.AsyncParameterServerStrategy(
                c.resolver(), variable_partitioner=_partitioner("fixed", num_ps),
                wire_dtype=wire)
            with strategy.scope():
                model = tf_keras.Sequential([
                    tf_keras.Input(shape=(1,), dtype=tf.int64),
                    # Initialised on the ps tasks: no table crosses the network.
                    tf_keras.layers.Embedding(rows, dim),
                    tf_keras.layers.Flatten(), tf_keras.layers.Dense(1)])
                model.compile(tf_keras.optimizers.SGD(0.1), "mse", steps_per_execution=10)
            data = tf_keras.utils.experimental.DatasetCreator(
                lambda ctx: tf.data.Dataset.from_tensor_slices((ids, ys)).batch(
                    ids_per_step).repeat())
            model.fit(data, epochs=1, steps_per_epoch=20, verbose=0)  # traced, warm
            before = _cluster_tcp_bytes(c)
            model.fit(data, epochs=1, steps_per_epoch=steps, verbose=0)
            out.append({"rows": rows, "bytes_per_step": (_cluster_tcp_bytes(c) - before) / steps,
                        "table_bytes": rows * dim * 4, "wire_dtype": wire})
    return {"runs": out}


# -- Keras 3 model.fit / evaluate / predict (tf_asyncps/keras3) -------------------

def _k3_regression(n=64, features=4, outputs=2, seed=0):
    rng = np.random.RandomState(seed)
    return (rng.randn(n, features).astype(np.float32),
            rng.randn(n, outputs).astype(np.float32))


def _k3_model(optimizer="sgd", lr=0.1, steps_per_execution=1, dropout=0.0, seed=0):
    import keras
    keras.utils.set_random_seed(seed)
    layers = [keras.Input((4,)), keras.layers.Dense(8, activation="relu")]
    if dropout:
        layers.append(keras.layers.Dropout(dropout, seed=seed))
    layers.append(keras.layers.Dense(2))
    model = keras.Sequential(layers, name="k3")
    opt = {"sgd": keras.optimizers.SGD, "adam": keras.optimizers.Adam}[optimizer](lr)
    model.compile(opt, "mse", metrics=["mae"], steps_per_execution=steps_per_execution)
    return model


@scenario(shares_cluster=True)
def keras3_fit_equals_one_process(steps_per_execution=1, epochs=2, steps=8, tmpdir=None):
    """One worker, SGD, the same data order: Keras 3 fit under the strategy
    against plain Keras 3 fit in this process; then evaluate, predict, save."""
    import keras
    x, y = _k3_regression()
    with _cluster(num_workers=1, num_ps=1) as c:
        strategy = tf_asyncps.AsyncParameterServerStrategy(c.resolver())
        # Datasets made after connecting: before, they would live on /job:localhost.
        train = tf.data.Dataset.from_tensor_slices((x, y)).batch(8).repeat()
        val = tf.data.Dataset.from_tensor_slices((x, y)).batch(8)
        with strategy.scope():
            model = _k3_model(steps_per_execution=steps_per_execution)
        w0 = model.get_weights()
        hist = model.fit(train, epochs=epochs, steps_per_epoch=steps, verbose=0,
                         validation_data=val)
        ev = model.evaluate(val, return_dict=True, verbose=0)
        pred = model.predict(x, batch_size=16, verbose=0)
        path = os.path.join(tmpdir, "model.keras")
        model.save(path)
        loaded = keras.saving.load_model(path)
        got_w = model.get_weights()
        # The reference: plain Keras 3 in this process, no strategy.
        ref = _k3_model()
        ref.set_weights(w0)
        ref_hist = ref.fit(train, epochs=epochs, steps_per_epoch=steps, verbose=0,
                           validation_data=val)
        ref_ev = ref.evaluate(val, return_dict=True, verbose=0)
        diff = lambda a, b: float(max(np.max(np.abs(np.asarray(p) - np.asarray(q)))
                                      for p, q in zip(a, b)))
        return {"history": hist.history, "ref_history": ref_hist.history,
                "weights_diff": diff(got_w, ref.get_weights()),
                "evaluate": ev, "ref_evaluate": ref_ev,
                "predict_diff": float(np.max(np.abs(pred - ref.predict(x, verbose=0)))),
                "predict_rows": int(pred.shape[0]),
                "loaded_predict_diff": float(np.max(np.abs(loaded.predict(x, verbose=0) - pred))),
                "iterations": int(model.optimizer.iterations.numpy()),
                "stats": _stats(strategy)}


@scenario(shares_cluster=True)
def keras3_fit_counters(num_workers=4, optimizer="sgd", steps=200, batch=8, locking=False,
                        policy="async"):
    """Several workers at once: iterations, the loss tracker's and the
    metric's counts, and a Dropout's SeedGenerator state are exact."""
    x, y = _k3_regression(n=256)
    with _cluster(num_workers=num_workers, num_ps=1) as c:
        strategy = tf_asyncps.AsyncParameterServerStrategy(c.resolver(), update_policy=policy)
        train = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch).repeat()
        with strategy.scope():
            model = _k3_model(optimizer=optimizer, lr=0.01, dropout=0.1)
            if locking:
                model.compile(tf_asyncps.optimizers.LockingOptimizer(model.optimizer, timeout_s=60),
                              "mse", metrics=["mae"])
        seed_gen = model.layers[1].seed_generator
        seed0 = seed_gen.state.numpy().tolist()
        hist = model.fit(train, epochs=1, steps_per_epoch=steps, verbose=0)
        counts = {v.path: float(v.numpy()) for v in model.metrics_variables
                  if v.path.endswith("count")}
        return {"iterations": int(model.optimizer.iterations.numpy()),
                "counts": counts, "seed_before": seed0,
                "seed_after": seed_gen.state.numpy().tolist(),
                "loss": hist.history["loss"],
                "closures_per_worker": strategy.closures_done_per_worker(),
                "stats": _stats(strategy)}


@scenario(shares_cluster=True)
def keras3_custom_loop(steps=12):
    """A custom loop (coordinator.schedule) over a Keras 3 model's own layers
    and optimizer, against the same loop in one process."""
    import keras
    x, y = _k3_regression()

    def make():
        model = _k3_model(optimizer="adam", lr=0.01)
        return model, model.optimizer

    def loss_of(model, xb, yb):
        return tf.reduce_mean(tf.square(model(xb, training=True) - yb))

    with _cluster(num_workers=1, num_ps=1) as c:
        strategy = tf_asyncps.AsyncParameterServerStrategy(c.resolver())
        coord = tf.distribute.coordinator.ClusterCoordinator(strategy)
        data = tf.data.Dataset.from_tensor_slices((x, y)).batch(8).repeat()
        with strategy.scope():
            model, opt = make()
            opt.build(model.trainable_variables)
        w0 = model.get_weights()
        per_worker = iter(coord.create_per_worker_dataset(data))

        @tf.function
        def step(it):
            xb, yb = next(it)

            def replica(xb, yb):
                with tf.GradientTape() as tape:
                    loss = loss_of(model, xb, yb)
                grads = tape.gradient(loss, model.trainable_variables)
                opt.apply_gradients(zip(grads, model.trainable_variables))
            strategy.run(replica, args=(xb, yb))

        for _ in range(steps):
            coord.schedule(step, args=(per_worker,))
        coord.join()
        ref, ref_opt = make()
        ref.set_weights(w0)
        for xb, yb in data.take(steps):
            with tf.GradientTape() as tape:
                loss = loss_of(ref, xb, yb)
            ref_opt.apply_gradients(zip(tape.gradient(loss, ref.trainable_variables),
                                        ref.trainable_variables))
        return {"weights_diff": float(max(np.max(np.abs(a - b)) for a, b in
                                          zip(model.get_weights(), ref.get_weights()))),
                "iterations": int(opt.iterations.numpy()), "stats": _stats(strategy)}


@scenario(shares_cluster=True)
def keras3_fit_errors():
    """Each misuse fails at once with its message, before any worker step."""
    import time
    import keras
    x, y = _k3_regression()
    out = {}

    def attempt(name, fn):
        t0 = time.perf_counter()
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - reported to the test
            out[name] = {"error": type(e).__name__, "message": str(e),
                         "seconds": time.perf_counter() - t0}
        else:
            out[name] = {"error": None}

    class PerBatch(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            pass

    with _cluster(num_workers=1, num_ps=1) as c:
        strategy = tf_asyncps.AsyncParameterServerStrategy(c.resolver())
        train = tf.data.Dataset.from_tensor_slices((x, y)).batch(8).repeat()
        outside = _k3_model()

        def compile_outside_model_in_scope():
            with strategy.scope():
                outside.compile(keras.optimizers.SGD(0.1), "mse")
        attempt("created_outside_scope", compile_outside_model_in_scope)
        with strategy.scope():
            model = _k3_model()
        attempt("batch_callback", lambda: model.fit(
            train, epochs=1, steps_per_epoch=4, callbacks=[PerBatch()], verbose=0))
        attempt("batch_checkpoint", lambda: model.fit(
            train, epochs=1, steps_per_epoch=4, verbose=0,
            callbacks=[keras.callbacks.ModelCheckpoint("/nonexistent/m.keras", save_freq=2)]))
        attempt("y_beside_dataset", lambda: model.fit(train, y, steps_per_epoch=4, verbose=0))
        attempt("no_steps_per_epoch", lambda: model.fit(train, epochs=1, verbose=0))
        attempt("arrays", lambda: model.fit(x, epochs=1, steps_per_epoch=4, verbose=0))
        attempt("infinite_validation", lambda: model.fit(
            train, epochs=1, steps_per_epoch=4, verbose=0, validation_data=train))
        attempt("float_validation_freq", lambda: model.fit(
            train, epochs=2, steps_per_epoch=4, verbose=0, validation_freq=2.5,
            validation_data=tf.data.Dataset.from_tensor_slices((x, y)).batch(8)))
        attempt("lambda_batch_callback", lambda: model.fit(
            train, epochs=1, steps_per_epoch=4, verbose=0,
            callbacks=[keras.callbacks.LambdaCallback(on_train_batch_end=lambda b, l: None)]))

        class MyCheckpoint(keras.callbacks.ModelCheckpoint):
            def on_train_batch_end(self, batch, logs=None):
                pass

        attempt("builtin_subclass_batch_hook", lambda: model.fit(
            train, epochs=1, steps_per_epoch=4, verbose=0,
            callbacks=[MyCheckpoint("/nonexistent/m.keras")]))
        attempt("inputs_only_dataset", lambda: model.fit(
            tf.data.Dataset.from_tensor_slices(x).batch(8).repeat(), epochs=1,
            steps_per_epoch=4, verbose=0))
        attempt("predict_infinite", lambda: model.predict(train, verbose=0))
        before = strategy.staleness_stats().global_step
        real = keras.__version__
        keras.__version__ = "3.99.0"
        try:
            attempt("unsupported_version", lambda: model.fit(train, epochs=1, steps_per_epoch=4,
                                                            verbose=0))
        finally:
            keras.__version__ = real
        global_step_before_runout = strategy.staleness_stats().global_step
        finite = tf.data.Dataset.from_tensor_slices((x, y)).batch(8)  # 8 batches, no repeat
        attempt("input_runs_out", lambda: model.fit(finite, epochs=1, steps_per_epoch=12,
                                                    verbose=0))
        return {"attempts": out, "global_step_before_runout": global_step_before_runout,
                "global_step_after_misuse": before}


@scenario(shares_cluster=True)
def input_runs_out(keras_lib="tf_keras"):
    """A fit whose DatasetCreator / Dataset does not repeat (4 batches for
    2 epochs x 3 steps): the error raised, and the ERROR records TensorFlow's
    logger let through meanwhile."""
    import logging as py_logging
    records = []

    class Count(py_logging.Handler):
        def emit(self, record):
            if record.levelno >= py_logging.ERROR:
                records.append(record.getMessage()[:200])

    handler = Count()
    tf.get_logger().addHandler(handler)
    x, y = np.zeros((32, 4), np.float32), np.zeros((32, 1), np.float32)

    def finite_fn(ctx):
        return tf.data.Dataset.from_tensor_slices((x, y)).batch(8)

    try:
        with _cluster(num_workers=1, num_ps=1) as c:
            strategy = tf_asyncps.AsyncParameterServerStrategy(c.resolver())
            if keras_lib == "3":
                import keras
                with strategy.scope():
                    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
                    model.compile(keras.optimizers.SGD(0.1), "mse")
                from tf_asyncps.keras3 import DatasetFn
                data = DatasetFn(finite_fn)
            else:
                with strategy.scope():
                    model = tf_keras.Sequential([tf_keras.Input((4,)),
                                                 tf_keras.layers.Dense(1)])
                    model.compile(tf_keras.optimizers.SGD(0.1), "mse")
                data = tf_keras.utils.experimental.DatasetCreator(finite_fn)
            try:
                model.fit(data, epochs=2, steps_per_epoch=3, verbose=0)
                error = None
            except Exception as e:  # noqa: BLE001 - reported to the test
                error = {"type": type(e).__name__, "message": str(e)}
            return {"error": error, "error_records": records}
    finally:
        tf.get_logger().removeHandler(handler)


@scenario(shares_cluster=True)
def tf_keras_evaluate_finite():
    """tf_keras evaluate of a finite Dataset without steps or
    pss_evaluation_shards: refused before any closure runs; with steps= on
    the repeated dataset it runs."""
    x, y = np.ones((32, 4), np.float32), np.zeros((32, 1), np.float32)
    finite = tf.data.Dataset.from_tensor_slices((x, y)).batch(8)
    out = {}
    with _cluster(num_workers=1, num_ps=1) as c:
        strategy = tf_asyncps.AsyncParameterServerStrategy(c.resolver())
        with strategy.scope():
            model = tf_keras.Sequential([tf_keras.Input((4,)), tf_keras.layers.Dense(
                1, kernel_initializer="ones")])
            model.compile(tf_keras.optimizers.SGD(0.1), "mse")
        for name, call in (("finite", lambda: model.evaluate(finite, verbose=0)),
                           ("steps", lambda: model.evaluate(finite.repeat(), steps=2,
                                                            verbose=0))):
            try:
                out[name] = {"loss": call()}
            except Exception as e:  # noqa: BLE001 - reported to the test
                out[name] = {"error": type(e).__name__, "message": str(e)}
            out[name]["closures"] = sum(strategy.closures_done_per_worker())
    return out


@scenario(shares_cluster=True)
def keras3_fit_callbacks(tmpdir, num_workers=2, epochs=3, steps=10):
    """Keras' epoch-level callbacks and StalenessLogger in one Keras 3 fit,
    then BackupAndRestore resuming an interrupted fit."""
    import glob
    import keras
    x, y = _k3_regression(n=128)
    with _cluster(num_workers=num_workers, num_ps=1) as c:
        strategy = tf_asyncps.AsyncParameterServerStrategy(c.resolver())
        train = tf.data.Dataset.from_tensor_slices((x, y)).batch(8).repeat()
        val = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
        with strategy.scope():
            model = _k3_model(lr=0.05)
        logger = tf_asyncps.callbacks.StalenessLogger(print_fn=print)
        csv = os.path.join(tmpdir, "log.csv")
        cbs = [keras.callbacks.ModelCheckpoint(os.path.join(tmpdir, "ckpt-{epoch}.keras")),
               keras.callbacks.TensorBoard(os.path.join(tmpdir, "tb")),
               keras.callbacks.EarlyStopping(monitor="val_loss", patience=100),
               keras.callbacks.CSVLogger(csv), logger]
        import contextlib
        import io
        console = io.StringIO()
        with contextlib.redirect_stdout(console):  # verbose=1: one line per epoch
            hist = model.fit(train, epochs=epochs, steps_per_epoch=steps, validation_data=val,
                             callbacks=cbs, verbose=1)
        ckpt = keras.saving.load_model(os.path.join(tmpdir, f"ckpt-{epochs}.keras"))
        with open(csv) as f:
            csv_rows = f.read().strip().splitlines()

        # An interrupted fit: BackupAndRestore saves epoch 0 and 1, then the
        # fit dies; a new fit with the same backup resumes at epoch 2.
        class Crash(keras.callbacks.Callback):
            def on_epoch_end(self, epoch, logs=None):
                if epoch == 1:
                    raise RuntimeError("crash after epoch 1")

        with strategy.scope():
            resumed = _k3_model(lr=0.05)
        backup = os.path.join(tmpdir, "backup")
        crashed = None
        try:
            resumed.fit(train, epochs=4, steps_per_epoch=steps, verbose=0,
                        callbacks=[keras.callbacks.BackupAndRestore(backup), Crash()])
        except RuntimeError as e:
            crashed = str(e)
        iterations_at_crash = int(resumed.optimizer.iterations.numpy())
        with strategy.scope():
            again = _k3_model(lr=0.05)
        h2 = again.fit(train, epochs=4, steps_per_epoch=steps, verbose=0,
                       callbacks=[keras.callbacks.BackupAndRestore(backup)])
        return {"history": hist.history, "console": console.getvalue(),
                "checkpoint_predict_diff": float(np.max(np.abs(
                    ckpt.predict(x, verbose=0) - model.predict(x, verbose=0)))),
                "checkpoints": sorted(os.path.basename(p) for p in
                                      glob.glob(os.path.join(tmpdir, "ckpt-*.keras"))),
                "tensorboard_files": len(glob.glob(os.path.join(tmpdir, "tb", "**", "events.*"),
                                                   recursive=True)),
                "csv_rows": csv_rows,
                "logger_epochs": [{"steps": e["steps"], "applied": e["applied"]}
                                  for e in logger.epochs],
                "crashed": crashed, "iterations_at_crash": iterations_at_crash,
                "resumed_epochs": h2.epoch, "resumed_iterations":
                    int(again.optimizer.iterations.numpy())}


@scenario(shares_cluster=True)
def keras3_digits_job(policy="async", policy_args=None, locking=False, epochs=4,
                      steps_per_epoch=100, optimizer="sgd", learning_rate=0.1):
    """The digits main job (tf_asyncps.app.job.run) on Keras 3, 2 workers."""
    from tf_asyncps.app import job
    with _cluster(num_workers=2, num_ps=1) as c:
        cfg = job.JobConfig(keras="3", policy=policy, policy_args=policy_args or {},
                            locking=locking, epochs=epochs, steps_per_epoch=steps_per_epoch,
                            steps_per_execution=10, optimizer=optimizer,
                            learning_rate=learning_rate)
        m = job.run(cfg, resolver=c.resolver(), print_fn=lambda s: None)
        return {k: m[k] for k in ("test_accuracy", "worker_steps", "staleness",
                                  "optimizer_iterations", "keras", "policy")}


@scenario(shares_cluster=True)
def keras3_mixed_float16(num_workers=2, steps=60, initial_scale=None, policy="async"):
    """Keras 3 fit under mixed_float16: compile wraps the optimizer in Keras 3's
    LossScaleOptimizer, whose counters live on the ps. ``initial_scale``
    high enough overflows float16 in the first steps."""
    import keras
    x, y = _k3_regression(n=256)
    with _cluster(num_workers=num_workers, num_ps=1) as c:
        strategy = tf_asyncps.AsyncParameterServerStrategy(c.resolver(), update_policy=policy)
        train = tf.data.Dataset.from_tensor_slices((x, y)).batch(16).repeat()
        keras.mixed_precision.set_global_policy("mixed_float16")
        seen = []
        original_update = strategy.update_policy.update

        def recording_update(grads, state, info):  # at trace time, on this chief
            seen.extend(str(g.dtype.name) for g in grads if g is not None)
            return original_update(grads, state, info)

        strategy.update_policy.update = recording_update
        with strategy.scope():
            model = _k3_model(lr=0.05)
            if initial_scale:
                model.compile(keras.optimizers.LossScaleOptimizer(
                    keras.optimizers.SGD(0.05), initial_scale=initial_scale), "mse",
                    metrics=["mae"])
        opt = model.optimizer
        hist = model.fit(train, epochs=2, steps_per_epoch=steps // 2, verbose=0)
        return {"optimizer": type(opt).__name__,
                "iterations": int(opt.iterations.numpy()),
                "step_counter": int(opt.step_counter.numpy()),
                "dynamic_scale": float(opt.dynamic_scale.numpy()),
                "weight_dtypes": sorted({str(v.dtype) for v in model.trainable_variables}),
                "policy_grad_dtypes": sorted(set(seen)),
                "finite_weights": all(bool(np.all(np.isfinite(w))) for w in model.get_weights()),
                "loss": hist.history["loss"], "stats": _stats(strategy)}


@scenario
def keras3_replicas_fit(replicas=2, optimizer="sgd", epochs=2, steps_per_epoch=10, batch=8):
    """Keras 3 fit with ``replicas`` replicas on one worker (the K-GPU worker
    path on CPU devices) against one-process Keras 3 training on batches of
    replicas * batch examples in the same order."""
    import keras
    _fake_multi_replica_workers(replicas)
    servers, resolver = _in_process_cluster(1, cpus_per_worker=replicas)
    x, y = _k3_regression(n=steps_per_epoch * batch * replicas)
    strategy = tf_asyncps.AsyncParameterServerStrategy(resolver)

    def dataset_fn(ctx):  # each replica takes its own batch, in turn
        return tf.data.Dataset.from_tensor_slices((x, y)).batch(batch).repeat()

    with strategy.scope():
        model = _k3_model(optimizer=optimizer, lr=0.05)
    w0 = model.get_weights()
    model.fit(tf_asyncps.keras3.DatasetFn(dataset_fn), epochs=epochs,
              steps_per_epoch=steps_per_epoch, verbose=0)
    ref = _k3_model(optimizer=optimizer, lr=0.05)
    ref.set_weights(w0)
    ref.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(batch * replicas).repeat(),
            epochs=epochs, steps_per_epoch=steps_per_epoch, verbose=0)
    return {"replicas": strategy.num_replicas_in_sync,
            "max_abs_diff": float(max(np.max(np.abs(a - b)) for a, b in
                                      zip(model.get_weights(), ref.get_weights()))),
            "moved": float(max(np.max(np.abs(a - b)) for a, b in zip(ref.get_weights(), w0))),
            "iterations": int(model.optimizer.iterations.numpy()), "stats": _stats(strategy)}


@scenario(shares_cluster=True)
def keras3_partitioned_fit(num_ps=3, optimizer="adam", epochs=2, steps=10, tmpdir=None,
                           partition=True):
    """A Keras 3 Embedding + Dense model whose table and kernel are split over
    ``num_ps`` ps tasks (FixedShardsPartitioner; ``partition=False``: whole,
    placed round-robin), one worker, against the same model unpartitioned in
    one process. Every batch of 24 ids from 60 repeats some."""
    import keras
    rng = np.random.RandomState(0)
    ids = rng.randint(0, 60, size=(steps * 8, 3)).astype("int32")
    y = (ids[:, :1] % 3 == 0).astype("float32") * np.ones((1, 2), np.float32)

    def make():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((3,), dtype="int32"),
                                  keras.layers.Embedding(60, 4, name="table"),
                                  keras.layers.Flatten(), keras.layers.Dense(2, name="out")])
        opt = {"sgd": keras.optimizers.SGD(0.5), "adam": keras.optimizers.Adam(0.05),
               "adagrad": keras.optimizers.Adagrad(0.5)}[optimizer]
        model.compile(opt, "mse", metrics=["mae"])
        return model

    with _cluster(num_workers=1, num_ps=num_ps) as c:
        strategy = tf_asyncps.AsyncParameterServerStrategy(
            c.resolver(), variable_partitioner=tf.distribute.experimental.partitioners
            .FixedShardsPartitioner(num_ps) if partition else None)
        train = tf.data.Dataset.from_tensor_slices((ids, y)).batch(8).repeat()
        val = tf.data.Dataset.from_tensor_slices((ids, y)).batch(8)
        with strategy.scope():
            model = make()
        w0 = model.get_weights()
        table = model.get_layer("table").embeddings
        shard_tasks = [tf.DeviceSpec.from_string(getattr(s, "device", None) or s.value.device)
                       .task for s in tf_asyncps.keras3.trainable_shards(model)[:num_ps]]
        hist = model.fit(train, epochs=epochs, steps_per_epoch=steps, verbose=0)
        ev = model.evaluate(val, return_dict=True, verbose=0)
        pred = model.predict(ids, verbose=0)
        path = os.path.join(tmpdir, "model.keras")
        model.save(path)
        loaded = keras.saving.load_model(path, compile=False)
        ref = make()
        ref.set_weights(w0)
        ref_hist = ref.fit(train, epochs=epochs, steps_per_epoch=steps, verbose=0)
        ref_ev = ref.evaluate(val, return_dict=True, verbose=0)
        return {"shard_tasks": shard_tasks, "table_shape": list(table.shape),
                "num_shards": len(tf_asyncps.keras3.trainable_shards(model)),
                "weights_diff": float(max(np.max(np.abs(a - b)) for a, b in
                                          zip(model.get_weights(), ref.get_weights()))),
                "moved": float(max(np.max(np.abs(a - b)) for a, b in
                                   zip(ref.get_weights(), w0))),
                "history": hist.history, "ref_history": ref_hist.history,
                "evaluate": ev, "ref_evaluate": ref_ev,
                "loaded_predict_diff": float(np.max(np.abs(loaded.predict(ids, verbose=0)
                                                           - pred))),
                "iterations": int(model.optimizer.iterations.numpy()),
                "stats": _stats(strategy)}


@scenario(shares_cluster=True)
def keras3_recompile_and_vector_metric(steps=10):
    """compile again between fits (inside the scope) takes effect; a metric
    with a vector result (Precision at 2 thresholds) is logged per epoch."""
    import contextlib
    import io
    import keras
    x, y = _k3_regression()
    with _cluster(num_workers=1, num_ps=1) as c:
        strategy = tf_asyncps.AsyncParameterServerStrategy(c.resolver())
        train = tf.data.Dataset.from_tensor_slices((x, y)).batch(8).repeat()
        with strategy.scope():
            model = _k3_model(lr=0.1)
        model.fit(train, epochs=1, steps_per_epoch=steps, verbose=0)
        first_opt = model.optimizer
        with strategy.scope():
            model.compile(keras.optimizers.SGD(0.0), "mse", metrics=["mae", "mse"])
        w0 = model.get_weights()
        console2 = io.StringIO()
        with contextlib.redirect_stdout(console2):  # verbose=2: the epoch line
            hist = model.fit(train, epochs=1, steps_per_epoch=steps, verbose=2)
        moved = float(max(np.max(np.abs(a - b)) for a, b in zip(model.get_weights(), w0)))
        second_iterations = int(model.optimizer.iterations.numpy())
        binary = tf.data.Dataset.from_tensor_slices(
            (x, (y > 0).astype("float32"))).batch(8).repeat()
        with strategy.scope():
            model.compile(keras.optimizers.SGD(0.01), "binary_crossentropy",
                          metrics=[keras.metrics.Precision(thresholds=[0.3, 0.7])])
        console = io.StringIO()
        with contextlib.redirect_stdout(console):
            vec = model.fit(binary, epochs=2, steps_per_epoch=steps, verbose=2,
                            callbacks=[tf_asyncps.callbacks.StalenessLogger(
                                print_fn=lambda s: print(s))])
        return {"moved_with_lr0": moved, "first_iterations": int(first_opt.iterations.numpy()),
                "second_iterations": second_iterations,
                "second_logs": hist.history, "second_console": console2.getvalue(),
                "vector_history": {k: np.asarray(v).tolist() for k, v in vec.history.items()},
                "console": console.getvalue()}


def _reset_process_state(environ):
    """What one scenario may leave behind for the next one under ``serve``."""
    os.environ.clear()
    os.environ.update(environ)
    tf_keras.mixed_precision.set_global_policy("float32")
    if "keras" in sys.modules:
        sys.modules["keras"].mixed_precision.set_global_policy("float32")


def serve(num_workers, num_ps=1):
    """Keeps one LocalCluster up; runs each request line ``{"name", "kwargs"}``
    read on stdin on it and prints ``RESULT: {json}`` or ``ERROR: {json}``.

    Prints ``READY: {"_child_pids": [...]}`` once the cluster serves and exits
    at end of input (its tasks stop with it: their death signal).
    """
    shape = {"num_workers": num_workers, "num_ps": num_ps}
    cluster = LocalCluster(**shape).start()
    _SHARED.update(shape=shape, cluster=cluster)
    print("READY: " + json.dumps({"_child_pids": list(cluster.pids.values())}), flush=True)
    environ = dict(os.environ)
    for line in sys.stdin:
        request = json.loads(line)
        name = request["name"]
        try:
            if name not in SHARES_CLUSTER:
                raise ValueError(f"scenario {name!r} is not marked shares_cluster=True")
            print("RESULT: " + json.dumps(SCENARIOS[name](**request["kwargs"])), flush=True)
        except Exception:  # the test fails with this; the next one gets a new cluster
            print("ERROR: " + json.dumps(traceback.format_exc()), flush=True)
        finally:
            _reset_process_state(environ)
    sys.stderr.flush()
    os._exit(0)


def main():
    name = sys.argv[1]
    kwargs = json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
    if name == "serve":
        serve(**kwargs)
    result = SCENARIOS[name](**kwargs)
    result["_child_pids"] = [p for c in _CLUSTERS for p in c.pids.values()]
    print("RESULT: " + json.dumps(result), flush=True)
    sys.stderr.flush()
    # The cluster is already stopped: skip TensorFlow's teardown, which would
    # try (and loudly fail) to reach the stopped servers.
    os._exit(0)


if __name__ == "__main__":
    main()
