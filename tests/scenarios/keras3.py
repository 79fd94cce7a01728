"""Scenarios of tests/test_keras3.py."""

import os

import numpy as np
import tensorflow as tf

import tf_asyncps

from scenarios import cluster, scenario
from scenarios.common import (fake_multi_replica_workers, in_process_cluster, make_optimizer,
                              stats_of)


@scenario(shares_cluster=True)
def keras3_fit_fails():
    """A Keras 3 model created in the scope but compiled outside it never got
    this strategy's fit: each input form (arrays, Dataset, DatasetFn,
    DatasetCreator) and evaluate/predict fail at once with our message."""
    import time
    import keras  # Keras 3
    import tf_keras
    from tf_asyncps.keras3 import DatasetFn
    with cluster(num_workers=1, num_ps=1) as c:
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
    model.compile(make_optimizer(optimizer, lr, "keras3"), "mse", metrics=["mae"],
                  steps_per_execution=steps_per_execution)
    return model


@scenario(shares_cluster=True)
def keras3_fit_equals_one_process(steps_per_execution=1, epochs=2, steps=8, tmpdir=None):
    """One worker, SGD, the same data order: Keras 3 fit under the strategy
    against plain Keras 3 fit in this process; then evaluate, predict, save."""
    import keras
    x, y = _k3_regression()
    with cluster(num_workers=1, num_ps=1) as c:
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
                "stats": stats_of(strategy)}


@scenario(shares_cluster=True)
def keras3_fit_counters(num_workers=4, optimizer="sgd", steps=200, batch=8, locking=False,
                        policy="async", num_ps=1, nan_batch=None):
    """Several workers at once: iterations, the loss tracker's and the
    metric's counts, and a Dropout's SeedGenerator state are exact.
    ``nan_batch``: that batch of each pass over the data has NaN targets."""
    x, y = _k3_regression(n=256)
    if nan_batch is not None:
        y[nan_batch * batch:(nan_batch + 1) * batch] = np.nan
    with cluster(num_workers=num_workers, num_ps=num_ps) as c:
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
                "weights_finite": bool(all(np.isfinite(w).all() for w in model.get_weights())),
                "slots_finite": bool(all(np.isfinite(v.numpy()).all()
                                         for v in model.optimizer.variables)),
                "weight_tasks": sorted({tf.DeviceSpec.from_string(v.value.device).task
                                        for v in model.trainable_variables}),
                "counts": counts, "seed_before": seed0,
                "seed_after": seed_gen.state.numpy().tolist(),
                "loss": hist.history["loss"],
                "closures_per_worker": strategy.closures_done_per_worker(),
                "stats": stats_of(strategy)}


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

    with cluster(num_workers=1, num_ps=1) as c:
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
                "iterations": int(opt.iterations.numpy()), "stats": stats_of(strategy)}


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

    with cluster(num_workers=1, num_ps=1) as c:
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
def keras3_fit_callbacks(tmpdir, num_workers=2, epochs=3, steps=10):
    """Keras' epoch-level callbacks and StalenessLogger in one Keras 3 fit,
    then BackupAndRestore resuming an interrupted fit."""
    import glob
    import keras
    x, y = _k3_regression(n=128)
    with cluster(num_workers=num_workers, num_ps=1) as c:
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
    with cluster(num_workers=2, num_ps=1) as c:
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
    with cluster(num_workers=num_workers, num_ps=1) as c:
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
                "loss": hist.history["loss"], "stats": stats_of(strategy)}


@scenario
def keras3_replicas_fit(replicas=2, optimizer="sgd", epochs=2, steps_per_epoch=10, batch=8):
    """Keras 3 fit with ``replicas`` replicas on one worker (the K-GPU worker
    path on CPU devices) against one-process Keras 3 training on batches of
    replicas * batch examples in the same order."""
    import keras
    fake_multi_replica_workers(replicas)
    servers, resolver = in_process_cluster(1, cpus_per_worker=replicas)
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
            "iterations": int(model.optimizer.iterations.numpy()), "stats": stats_of(strategy)}


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
        lr = {"sgd": 0.5, "adam": 0.05, "adagrad": 0.5}[optimizer]
        model.compile(make_optimizer(optimizer, lr, "keras3"), "mse", metrics=["mae"])
        return model

    with cluster(num_workers=1, num_ps=num_ps) as c:
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
                "stats": stats_of(strategy)}


@scenario(shares_cluster=True)
def keras3_recompile_and_vector_metric(steps=10):
    """compile again between fits (inside the scope) takes effect; a metric
    with a vector result (Precision at 2 thresholds) is logged per epoch."""
    import contextlib
    import io
    import keras
    x, y = _k3_regression()
    with cluster(num_workers=1, num_ps=1) as c:
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


@scenario(shares_cluster=True)
def keras3_evaluate_with_regularizer(num_workers=2, l2=0.01):
    """A model with an L2 kernel regularizer: fit with validation_data and
    evaluate under the strategy, against one-process Keras 3 evaluate of the
    same weights, and the regularization term by its closed form."""
    import keras
    x, y = _k3_regression()

    def make():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([
            keras.Input((4,)),
            keras.layers.Dense(3, activation="tanh",
                               kernel_regularizer=keras.regularizers.L2(l2)),
            keras.layers.Dense(2, kernel_regularizer=keras.regularizers.L2(l2),
                               bias_regularizer=keras.regularizers.L2(l2))], name="reg")
        model.compile(keras.optimizers.SGD(0.05), "mse", metrics=["mae"])
        return model

    with cluster(num_workers=num_workers, num_ps=1) as c:
        strategy = tf_asyncps.AsyncParameterServerStrategy(c.resolver())
        train = tf.data.Dataset.from_tensor_slices((x, y)).batch(8).repeat()
        val = tf.data.Dataset.from_tensor_slices((x, y)).batch(8)
        with strategy.scope():
            model = make()
        hist = model.fit(train, epochs=1, steps_per_epoch=6, verbose=0, validation_data=val)
        ev = model.evaluate(val, return_dict=True, verbose=0)
        weights = model.get_weights()
        ref = make()
        ref.set_weights(weights)
        ref_ev = ref.evaluate(val, return_dict=True, verbose=0)
        k1, _, k2, b2 = weights
        pred = ref.predict(x, verbose=0)
        return {"val_loss": hist.history["val_loss"], "val_mae": hist.history["val_mae"],
                "evaluate": ev, "ref_evaluate": ref_ev,
                "mse": float(np.mean((pred - y) ** 2)),
                "l2_term": float(l2 * (np.sum(k1 ** 2) + np.sum(k2 ** 2) + np.sum(b2 ** 2)))}
