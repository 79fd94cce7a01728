"""Scenarios of tests/test_pss_compat.py (its tutorial scenario is in that file)."""

import numpy as np
import tensorflow as tf
import tf_keras

import tf_asyncps

from scenarios import cluster, scenario


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
        with cluster(num_workers=1, num_ps=1) as c:
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
    with cluster(num_workers=1, num_ps=1) as c:
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
def eager_run():
    """``strategy.run`` outside a ``tf.function``, as TensorFlow's own
    strategy tests call it: in its test-only mode (the coordinator's process
    runs the step eagerly) and without it (the usage warning); variables with
    an aggregation, plain and sharded, updated from an eager ``run``."""
    import logging as py_logging
    out = {}
    with cluster(num_workers=1, num_ps=2) as c:
        # The partitioner second and positional, as vanilla's signature has it.
        strategy = tf_asyncps.AsyncParameterServerStrategy(
            c.resolver(), tf.distribute.experimental.partitioners.FixedShardsPartitioner(2))
        out["policy"] = strategy.update_policy.name
        strategy.extended._allow_run_without_coordinator = True  # TF's test-only mode
        with strategy.scope():
            v = tf.Variable(1, dtype=tf.int64)
            agg = tf.Variable(tf.zeros([4]), aggregation=tf.VariableAggregation.SUM)
        it = iter(tf.data.Dataset.range(15))
        out["test_only"] = int(strategy.run(lambda i: next(i) + v, args=(it,)))
        strategy.run(lambda: agg.assign_add(tf.ones([4])))
        out["sharded_after_add"] = [float(x) for x in tf.concat(
            [s.read_value() for s in agg.variables], 0).numpy()]
        out["num_shards"] = len(agg.variables)

        strategy2 = tf_asyncps.AsyncParameterServerStrategy(c.resolver())
        with strategy2.scope():
            w = tf.Variable(1, dtype=tf.int64)
        records = []

        class Keep(py_logging.Handler):
            def emit(self, record):
                records.append(record.getMessage())

        handler = Keep()
        tf.get_logger().addHandler(handler)
        try:
            strategy2.run(lambda i: next(i) + w, args=(iter(tf.data.Dataset.range(8)),))
        finally:
            tf.get_logger().removeHandler(handler)
        out["warned"] = any("ClusterCoordinator.schedule" in r for r in records)
    return out


@scenario(shares_cluster=True)
def tf_keras_optimizer_outside_scope():
    """A tf_keras optimizer created outside the scope: passed to compile
    (the model made inside the scope), and used by a custom loop. Each
    error (type and message) and the closures that ran."""
    out = {}
    x, y = np.zeros((32, 4), np.float32), np.zeros((32, 1), np.float32)
    with cluster(num_workers=1, num_ps=1) as c:
        strategy = tf_asyncps.AsyncParameterServerStrategy(c.resolver())
        with strategy.scope():
            model = tf_keras.Sequential([tf_keras.Input((4,)), tf_keras.layers.Dense(1)])
        try:
            model.compile(tf_keras.optimizers.SGD(0.1), "mse")
            model.fit(tf_keras.utils.experimental.DatasetCreator(
                lambda ctx: tf.data.Dataset.from_tensor_slices((x, y)).batch(8).repeat()),
                epochs=1, steps_per_epoch=2, verbose=0)
            out["compile"] = None
        except Exception as e:  # noqa: BLE001 - reported to the test
            out["compile"] = {"type": type(e).__name__, "message": str(e)}
        opt = tf_keras.optimizers.Adam(0.01)
        with strategy.scope():
            w = tf.Variable(tf.zeros([4]))
        coord = tf.distribute.coordinator.ClusterCoordinator(strategy)

        @tf.function
        def step():
            def body():
                with tf.GradientTape() as tape:
                    loss = tf.reduce_sum(w * w)
                opt.apply_gradients(zip(tape.gradient(loss, [w]), [w]))
            strategy.run(body)

        try:
            coord.schedule(step)
            coord.join()
            out["loop"] = None
        except Exception as e:  # noqa: BLE001 - reported to the test
            out["loop"] = {"type": type(e).__name__, "message": str(e)}
        out["closures"] = sum(strategy.closures_done_per_worker())
    return out


@scenario(shares_cluster=True)
def initial_weights_by_seed(seed=7):
    """The same models' initial weights under vanilla ParameterServerStrategy
    and this strategy on one cluster (one worker, two ps, an Embedding
    partitioned over both), each seeded by Keras's set_random_seed, and in
    one process; and vanilla twice after tf.random.set_seed alone."""
    import keras
    partitioner = tf.distribute.experimental.partitioners.MinSizePartitioner(
        min_shard_bytes=4 << 10, max_shards=2)

    def tf_keras_model():
        model = tf_keras.Sequential([tf_keras.Input((3,), dtype="int64"),
                                     tf_keras.layers.Embedding(500, 16),
                                     tf_keras.layers.Flatten(), tf_keras.layers.Dense(8),
                                     tf_keras.layers.Dense(1)])
        model.compile(tf_keras.optimizers.Adam(0.01), "mse")
        return model

    def keras3_model():
        model = keras.Sequential([keras.Input((3,), dtype="int64"),
                                  keras.layers.Embedding(500, 16), keras.layers.Flatten(),
                                  keras.layers.Dense(8), keras.layers.Dense(1)])
        model.compile(keras.optimizers.Adam(0.01), "mse")
        return model

    def weights(strategy, make, seed_fn):
        seed_fn(seed)
        if strategy is None:
            return [np.asarray(w) for w in make().get_weights()]
        with strategy.scope():
            model = make()
        return [np.asarray(w) for w in model.get_weights()]

    def max_diff(a, b):
        # A partitioned table's shards split its rows: in order, their
        # values are the whole table's (one process has it whole).
        a, b = (np.concatenate([w.ravel() for w in ws]) for ws in (a, b))
        return float(np.max(np.abs(a - b)))

    out = {}
    with cluster(num_workers=1, num_ps=2) as c:
        made = {}
        for name, make_strategy in (
                ("vanilla", lambda: tf.distribute.ParameterServerStrategy(
                    c.resolver(), variable_partitioner=partitioner)),
                ("ours", lambda: tf_asyncps.AsyncParameterServerStrategy(
                    c.resolver(), variable_partitioner=partitioner)),
                ("one_process", lambda: None)):
            strategy = make_strategy()
            made[name] = {
                "tf_keras": weights(strategy, tf_keras_model, tf_keras.utils.set_random_seed),
                "keras3": weights(strategy, keras3_model, keras.utils.set_random_seed),
                "tf_keras_tf_seed": weights(strategy, tf_keras_model, tf.random.set_seed)}
            if name == "vanilla":
                made["vanilla_again"] = {"tf_keras_tf_seed": weights(
                    strategy, tf_keras_model, tf.random.set_seed)}
        for lib in ("tf_keras", "keras3"):
            ours, vanilla, one = (made[n][lib] for n in ("ours", "vanilla", "one_process"))
            out[lib] = {"ours": max_diff(ours, vanilla),
                        # the Dense layers (the last 4 arrays): never partitioned
                        "one_process_dense": max_diff(one[-4:], vanilla[-4:]),
                        "one_process": max_diff(one, vanilla),
                        "nonzero": float(max(np.max(np.abs(w)) for w in ours))}
        out["shapes"] = {name: [list(w.shape) for w in made[name]["tf_keras"]]
                         for name in ("vanilla", "ours")}
        out["tf_seed_only_vanilla_twice"] = max_diff(
            made["vanilla"]["tf_keras_tf_seed"], made["vanilla_again"]["tf_keras_tf_seed"])
    return out
