"""Scenarios of tests/test_dynamic_cluster.py: DynamicEmbedding on a cluster."""

import os

import numpy as np
import tensorflow as tf
import tf_keras

import tf_asyncps
from scenarios import cluster, scenario
from scenarios.common import make_optimizer
from tf_asyncps.layers import DynamicEmbedding

RAW = np.array([10**12 + 7, -5, 3, 99, 2**40, 17, 123456789, 8, 9, 10], np.int64)
PARTITIONER = tf.distribute.experimental.partitioners.FixedShardsPartitioner


#: "route" in the policy lists here: the table (its ``embeddings`` shards)
#: asynchronous, the dense head in rounds of 2 (PERSIA's split).
ROUTE = tf_asyncps.policies.route(
    sparse="async", dense=tf_asyncps.policies.get("sync_replicas", replicas_to_aggregate=2))


#: Learning rates of the tests' optimizers here (scenarios.common's table).
LR = {"sgd": 0.1, "adagrad": 0.1, "adam": 0.01}


def _optimizer(name, keras_name="tf_keras"):
    return make_optimizer(name, LR[name], keras_name)


def _data(seed=0, n=64):
    rng = np.random.default_rng(seed)
    return rng.choice(RAW, size=(n, 3)), rng.normal(size=(n, 1)).astype("float32")


def _shifted_data(seed=0):
    """64 rows: 32 of 6 of the ids, then 32 of the other 4 and 2 of those."""
    rng = np.random.default_rng(seed)
    x = np.concatenate([rng.choice(RAW[:6], size=(32, 3)), rng.choice(RAW[4:], size=(32, 3))])
    return x, rng.normal(size=(64, 1)).astype("float32")


def _model(embedding):
    i = tf_keras.Input([3], dtype=tf.int64)
    flat = tf_keras.layers.Flatten()(embedding(i))
    return tf_keras.Model(i, tf_keras.layers.Dense(1, kernel_initializer="ones")(flat))


def _fit(strategy, model, x, y, epochs=2, steps=8, weight=None):
    """``model.fit`` on (x, y) for ``epochs`` x ``steps``; ``weight``: every
    sample's weight (0.0: a step of zero gradients)."""
    data = (x, y) if weight is None else (x, y, np.full([len(x)], weight, "float32"))

    def dataset_fn(ctx):
        return tf.data.Dataset.from_tensor_slices(data).batch(8).repeat()
    model.fit(tf_keras.utils.experimental.DatasetCreator(dataset_fn), epochs=epochs,
              steps_per_epoch=steps, verbose=0)


def _strategy(c, num_ps=2, **kwargs):
    """The strategy on cluster ``c``, tables split over ``num_ps`` shards."""
    return tf_asyncps.AsyncParameterServerStrategy(
        c.resolver(), variable_partitioner=PARTITIONER(num_ps), **kwargs)


def _adagrad_model(strategy, capacity):
    """A compiled model: DynamicEmbedding(4, capacity), a pass every 5 steps, Adagrad."""
    with strategy.scope():
        model = _model(DynamicEmbedding(4, capacity=capacity, evict_every=5))
        model.compile(_optimizer("adagrad"), "mse")
    return model


@scenario
def dynamic_exact(optimizer="sgd", num_ps=2):
    """1 worker, tables on ``num_ps`` shards, capacity > distinct ids: the
    predictions of IntegerLookup + Embedding trained the same way."""
    x, y = _data()
    with cluster(num_workers=1, num_ps=num_ps) as c:
        strategy = _strategy(c, num_ps)
        vocab = np.unique(x)
        looked = tf_keras.Sequential([tf_keras.layers.IntegerLookup(vocabulary=vocab),
                                      tf_keras.layers.Embedding(len(vocab) + 1, 4,
                                                                embeddings_initializer="zeros")])
        ref = _model(looked)
        ref.compile(_optimizer(optimizer), "mse")
        ref.fit(x, y, batch_size=8, epochs=2, verbose=0, shuffle=False)
        with strategy.scope():
            model = _model(DynamicEmbedding(4, capacity=16, initializer="zeros"))
            model.compile(_optimizer(optimizer), "mse")
        _fit(strategy, model, x, y)
        layer = model.layers[1]
        ids = sorted(layer.export()[0].numpy().tolist())
        return {"max_diff": float(np.abs(model.predict(x, verbose=0)
                                         - ref.predict(x, verbose=0)).max()),
                "ref_max": float(np.abs(ref.predict(x, verbose=0)).max()),
                "stats": layer.stats(), "ids": ids, "distinct": sorted(vocab.tolist()),
                "shards": len(layer.dynamic_table.shards)}


@scenario
def dynamic_policies(policies=("async",), capacity=6, optimizer="adagrad", num_workers=2):
    """Each policy on 2 workers, 2 ps, 10 ids for ``capacity`` rows, an
    eviction pass every 2 global steps: the table's invariants afterwards.
    Each worker's 8 batches go from 6 of the ids to the other 4 and 2 of
    those, so the passes evict (3-10 rows a policy in 2 runs; uniform draws
    of all 10 ids with a pass every 4 steps evicted 1-4, as the counts
    ranked them)."""
    x, y = _shifted_data()
    out = {}
    with cluster(num_workers=num_workers, num_ps=2) as c:
        for policy in policies:
            strategy = _strategy(c, update_policy=ROUTE if policy == "route" else policy)
            with strategy.scope():
                model = _model(DynamicEmbedding(4, capacity=capacity, evict_every=2,
                                                initializer="zeros"))
                opt = _optimizer(optimizer)
                model.compile(opt, "mse")
            _fit(strategy, model, x, y, epochs=1, steps=16)
            layer = model.layers[1]
            ids, rows = layer.export()
            table = layer.dynamic_table
            # Free rows: fresh initializer values (zeros) and fresh slots.
            free_rows, free_slots = [], []
            slots = [s for v in model.trainable_variables[:len(table.shards)]
                     for s in tf_asyncps.dynamic.table.optimizer_slots(opt, v)]
            for i, shard in enumerate(table.shards):
                free = np.flatnonzero(shard.count.numpy() == 0)
                free_rows.append(float(np.abs(shard.var.numpy()[free]).max(initial=0)))
                for slot, value in slots:
                    if slot.device == shard.var.device and slot.shape == shard.var.shape:
                        free_slots.append(float(np.abs(slot.numpy()[free] - value).max(initial=0)))
            out[policy] = {"stats": layer.stats(), "ids": ids.numpy().tolist(),
                           "free_rows_max": max(free_rows), "num_slots": len(slots),
                           "free_slots_max_diff": max(free_slots, default=0.0),
                           "global_step": strategy.staleness_stats().global_step,
                           "loss_finite": bool(np.isfinite(model.predict(x, verbose=0)).all())}
    return out


@scenario
def dynamic_checkpoint(num_workers=2, reshard_capacity=None):
    """Train, save a tf.train.Checkpoint, restore into a new model (same
    cluster shape): same live ids, rows and predictions; training goes on.
    With ``reshard_capacity``, also :func:`dynamic_reshard` on the same
    cluster (3 ps; the tables above on 2 shards), as ``"reshard"``."""
    x, y = _data()
    import tempfile
    path = os.path.join(tempfile.mkdtemp(), "ckpt")
    with cluster(num_workers=num_workers, num_ps=2 if reshard_capacity is None else 3) as c:
        strategy = _strategy(c)
        model = _adagrad_model(strategy, 8)
        _fit(strategy, model, x, y)
        saved = tf.train.Checkpoint(model=model, optimizer=model.optimizer).write(path)
        before = model.layers[1].export()
        again = _adagrad_model(strategy, 8)
        tf.train.Checkpoint(model=again, optimizer=again.optimizer).read(saved)
        after = again.layers[1].export()
        order_b, order_a = np.argsort(before[0].numpy()), np.argsort(after[0].numpy())
        result = {
            "ids_equal": before[0].numpy()[order_b].tolist() == after[0].numpy()[order_a].tolist(),
            "rows_max_diff": float(np.abs(before[1].numpy()[order_b]
                                          - after[1].numpy()[order_a]).max()),
            "pred_max_diff": float(np.abs(model.predict(x, verbose=0)
                                          - again.predict(x, verbose=0)).max()),
            "live": again.layers[1].stats()["live_rows"], "live_saved": len(before[0])}
        # Training goes on with ids the table never saw: its passes evict the
        # restored rows, which no lookup sees any more, for them.
        _fit(strategy, again, x + 1000, y, epochs=2)
        result["stats_after_more_training"] = again.layers[1].stats()
        if reshard_capacity is not None:
            result["reshard"] = _reshard(c, reshard_capacity, path, back=False, unbuilt=True)
        return result


@scenario
def dynamic_saved_model(path, num_workers=2):
    """Train on the cluster, ``tf.saved_model.save`` the model to ``path``;
    returns the chief's predictions for RAW's ids and two unknown ids (as
    lists) for a process with no cluster to compare."""
    x, y = _data()
    with cluster(num_workers=num_workers, num_ps=2) as c:
        strategy = _strategy(c)
        model = _adagrad_model(strategy, 16)
        _fit(strategy, model, x, y)
        query = np.array([[RAW[0], RAW[3], 77777], [RAW[5], -1, RAW[9]]], np.int64)
        serve = tf.function(lambda ids: model(ids, training=False),
                            input_signature=[tf.TensorSpec([None, 3], tf.int64, name="ids")])
        tf.saved_model.save(model, path, signatures={"serving_default": serve})
        return {"query": query.tolist(),
                "predictions": model.predict(query, verbose=0).tolist(),
                "embedding": model.layers[1](tf.constant(query), training=False).numpy().tolist()}


@scenario
def dynamic_custom_loop(num_workers=2, capacity=6, steps=24):
    """A custom loop (coordinator.schedule, tf.GradientTape) with a
    LockingOptimizer over Adam: 10 ids for ``capacity`` rows, a pass every 4
    steps. Returns the table's counters and the global step."""
    x, y = _data()
    with cluster(num_workers=num_workers, num_ps=2) as c:
        strategy = _strategy(c)
        coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)
        with strategy.scope():
            layer = DynamicEmbedding(4, capacity=capacity, evict_every=4)
            model = _model(layer)
            opt = tf_asyncps.optimizers.LockingOptimizer(_optimizer("adam"))

        def dataset_fn():
            return tf.data.Dataset.from_tensor_slices((x, y)).batch(8).repeat()

        iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))

        @tf.function
        def step(it):
            def replica(xb, yb):
                with tf.GradientTape() as tape:
                    loss = tf.reduce_mean((model(xb, training=True) - yb) ** 2)
                grads = tape.gradient(loss, model.trainable_variables)
                opt.apply_gradients(zip(grads, model.trainable_variables))
                return loss
            return strategy.run(replica, args=next(it))

        losses = [coordinator.schedule(step, args=(iterator,)) for _ in range(steps)]
        coordinator.join()
        ids = layer.export()[0].numpy().tolist()
        return {"stats": layer.stats(), "ids": ids,
                "global_step": strategy.staleness_stats().global_step,
                "losses_finite": bool(np.isfinite([v.fetch() for v in losses]).all()),
                **_evicted_between_lookup_and_update(strategy, coordinator, x, y)}


def _evicted_between_lookup_and_update(strategy, coordinator, x, y):
    """One step whose rows are all evicted (a TTL pass) after its lookup and
    before its SGD update: the update must leave the freed rows at their
    initial values (zeros), as under sync_replicas, whose round's mean is
    applied steps after its lookups."""
    with strategy.scope():
        layer = DynamicEmbedding(4, capacity=6, ttl_steps=1, initializer="zeros")
        model = _model(layer)
        opt = _optimizer("sgd")

    @tf.function
    def step(xb, yb):
        def replica(xb, yb):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean((model(xb, training=True) - yb) ** 2)
            grads = tape.gradient(loss, model.trainable_variables)
            # A pass at a far global step: every row is older than the TTL.
            with tf.control_dependencies([layer.dynamic_table.maybe_evict(10**9)]):
                grads = [tf.identity(g) if not isinstance(g, tf.IndexedSlices) else
                         tf.IndexedSlices(tf.identity(g.values), g.indices, g.dense_shape)
                         for g in grads]
            opt.apply_gradients(zip(grads, model.trainable_variables))
            return loss
        return strategy.run(replica, args=(xb, yb))

    coordinator.schedule(step, args=(tf.constant(x[:8]), tf.constant(y[:8])))
    coordinator.join()
    return {"midstep_evicted": layer.stats()["evicted"],
            "midstep_live": layer.stats()["live_rows"],
            "midstep_rows_max": float(np.abs(np.concatenate(
                [s.var.numpy() for s in layer.dynamic_table.shards])).max())}


@scenario
def dynamic_keras3_exact(num_ps=2, num_workers=1, capacity=16, optimizer="sgd",
                         evict_every=4, shifted=False):
    """Keras 3 fit, 1 worker, tables on ``num_ps`` shards, SGD, zeros: the
    predictions of Keras 3 IntegerLookup + Embedding trained the same way.
    ``shifted``: the batches move from 6 of the ids to the other 4 and 2 of
    those (as in :func:`dynamic_policies`), so that passes evict."""
    import keras
    x, y = _shifted_data() if shifted else _data()
    vocab = np.unique(x)

    def head(e):
        return keras.layers.Dense(1, kernel_initializer="ones")(keras.layers.Flatten()(e))

    with cluster(num_workers=num_workers, num_ps=num_ps) as c:
        strategy = _strategy(c, num_ps)
        i = keras.Input((3,), dtype="int64")
        looked = keras.layers.IntegerLookup(vocabulary=vocab)(i)
        ref = keras.Model(i, head(keras.layers.Embedding(
            len(vocab) + 1, 4, embeddings_initializer="zeros")(looked)))
        def make():
            return _optimizer(optimizer, "keras3")
        ref.compile(make(), "mse")
        ref.fit(x, y, batch_size=8, epochs=2, verbose=0, shuffle=False)
        with strategy.scope():
            i = keras.Input((3,), dtype="int64")
            layer = tf_asyncps.keras3.DynamicEmbedding(4, capacity=capacity,
                                                       evict_every=evict_every,
                                                       initializer="zeros")
            model = keras.Model(i, head(layer(i)))
            model.compile(make(), "mse")
        data = tf.data.Dataset.from_tensor_slices((x, y)).batch(8).repeat()
        model.fit(data, epochs=2, steps_per_epoch=8, verbose=0)
        ids = sorted(layer.export()[0].numpy().tolist())
        free_slots, free_rows = [], []
        for shard in layer.dynamic_table.shards:
            free = np.flatnonzero(shard.count.numpy() == 0)
            free_rows.append(float(np.abs(shard.var.numpy()[free]).max(initial=0)))
            for slot, value in tf_asyncps.dynamic.table.optimizer_slots(
                    model.optimizer, shard.var):
                free_slots.append(float(np.abs(slot.numpy()[free] - value).max(initial=0)))
        return {"max_diff": float(np.abs(model.predict(x, verbose=0)
                                         - ref.predict(x, verbose=0)).max()),
                "ref_max": float(np.abs(ref.predict(x, verbose=0)).max()),
                "stats": layer.stats(), "ids": ids, "distinct": sorted(vocab.tolist()),
                "shards": len(layer.dynamic_table.shards), "free_slots": free_slots,
                "free_rows": free_rows}


@scenario
def dynamic_keras3_backup(num_ps=2, backup_dir=None, export_path=None, keras_path=None):
    """Keras 3 fit under the strategy, 1 worker, Adagrad, zeros: 4 epochs of 4
    steps uninterrupted (a); the same fit with CheckpointBackup crashing as
    epoch 3 begins (b); a new model resuming b's backup (c). Returns a's and
    c's predictions, ids and rows, and the epochs each ran; with
    ``export_path``, c's Keras 3 ``model.export`` there and its predictions
    for RAW's ids and two unknown ones (``query``); with ``keras_path``, c
    saved there as a ``.keras`` file too."""
    import keras

    from tf_asyncps.callbacks import CheckpointBackup
    x, y = _data()

    class Epochs(keras.callbacks.Callback):
        def __init__(self, stop_at=None):
            super().__init__()
            self.seen, self.stop_at = [], stop_at

        def on_epoch_begin(self, epoch, logs=None):
            if epoch == self.stop_at:
                raise RuntimeError("crash")
            self.seen.append(epoch)

    with cluster(num_workers=1, num_ps=num_ps) as c:
        strategy = _strategy(c, num_ps)

        def make():
            keras.utils.set_random_seed(0)
            with strategy.scope():
                i = keras.Input((3,), dtype="int64")
                layer = tf_asyncps.keras3.DynamicEmbedding(4, capacity=16, initializer="zeros")
                flat = keras.layers.Flatten()(layer(i))
                model = keras.Model(i, keras.layers.Dense(1)(flat))
                model.compile(_optimizer("adagrad", "keras3"), "mse")
            return model, layer

        def fit(model, *callbacks):
            data = tf.data.Dataset.from_tensor_slices((x, y)).batch(8).repeat()
            model.fit(data, epochs=4, steps_per_epoch=4, verbose=0, callbacks=list(callbacks))

        def state(model, layer):
            ids, rows = (t.numpy() for t in layer.export())
            order = np.argsort(ids)
            return {"pred": model.predict(x, verbose=0), "ids": ids[order],
                    "rows": rows[order], "iterations": int(model.optimizer.iterations.numpy())}

        a, la = make()
        fit(a)
        b, _ = make()
        crashed = Epochs(stop_at=2)
        try:
            fit(b, CheckpointBackup(backup_dir), crashed)
        except RuntimeError as e:
            crash = str(e)
        latest = os.path.basename(tf.train.latest_checkpoint(backup_dir))
        c_, lc = make()
        resumed = Epochs()
        fit(c_, CheckpointBackup(backup_dir), resumed)
        sa, sc = state(a, la), state(c_, lc)
        served = {}
        if export_path:
            query = np.array([[RAW[0], RAW[3], 77777], [RAW[5], -1, RAW[9]]], np.int64)
            c_.export(export_path)  # Keras 3's SavedModel export, on the chief
            if keras_path:
                c_.save(keras_path)
            served = {"query": query.tolist(),
                      "predictions": c_.predict(query, verbose=0).tolist()}
        return {**served, "crash": crash, "latest": latest, "epochs_b": crashed.seen,
                "epochs_c": resumed.seen, "backup_left": os.path.exists(backup_dir),
                "ids_equal": bool(np.array_equal(sa["ids"], sc["ids"])), "live": len(sc["ids"]),
                "rows_max_diff": float(np.abs(sa["rows"] - sc["rows"]).max()),
                "rows_max": float(np.abs(sa["rows"]).max()),
                "pred_max_diff": float(np.abs(sa["pred"] - sc["pred"]).max()),
                "iterations": [sa["iterations"], sc["iterations"]]}


def _table_state(model):
    """{id: (row values, Adagrad accumulator row)} of the live ids, and the
    table's invariants: each id once, on its home shard; the accumulators of
    free rows at their initial value."""
    from tf_asyncps.dynamic import table as dt
    layer, opt = model.layers[1], model.optimizer
    table = layer.dynamic_table
    n = len(table.shards)
    out, homes_ok, free_slots = {}, True, 0.0
    for i, s in enumerate(table.shards):
        count, keys = s.count.numpy(), s.key.numpy()
        values = s.var.numpy()
        slots = dt.optimizer_slots(opt, s.var)
        acc = slots[0][0].numpy() if slots else np.zeros_like(values)
        live = np.flatnonzero(count > 0)
        if len(live):
            homes_ok &= bool((dt._bucket(tf.constant(keys[live]), n).numpy() == i).all()) \
                if n > 1 else True
        for r in live:
            assert int(keys[r]) not in out, f"id {keys[r]} on two rows"
            out[int(keys[r])] = (values[r], acc[r])
        free = np.flatnonzero(count == 0)
        if slots:
            free_slots = max(free_slots, float(np.abs(acc[free] - slots[0][1]).max(initial=0)))
    return out, {"homes_ok": homes_ok, "free_slots_max_diff": free_slots,
                 "live": layer.stats()["live_rows"], "shards": n,
                 "index": [int(s.index.size()) for s in table.shards]}


def _compare(before, after):
    """Largest differences of the rows and accumulators of the same ids."""
    same = sorted(before) == sorted(after)
    rows = max(float(np.abs(before[k][0] - after[k][0]).max()) for k in before) if same else -1
    acc = max(float(np.abs(before[k][1] - after[k][1]).max()) for k in before) if same else -1
    return {"ids_equal": same, "rows_max_diff": rows, "acc_max_diff": acc}


@scenario
def dynamic_reshard(capacity=30, num_workers=2, back=False):
    """:func:`_reshard` on a new cluster of 3 ps."""
    import tempfile
    with cluster(num_workers=num_workers, num_ps=3) as c:
        return _reshard(c, capacity, os.path.join(tempfile.mkdtemp(), "reshard"), back)


def _reshard(c, capacity, base, back, unbuilt=False):
    """Train with the table on 2 shards, checkpoint, restore it onto 3
    shards (a strategy with another variable_partitioner on cluster ``c``,
    3 ps; with ``back``, then onto 2 again): the same ids, rows, Adagrad
    accumulators and predictions; each id on its home shard; training goes
    on. Returns one result per restore ("2to3", "3to2"); with ``unbuilt``,
    also "2to3_unbuilt": the same checkpoint restored into an optimizer
    that has no slots yet (the first step builds them)."""
    x, y = _data()
    query, batch = tf.constant(RAW[:, None]), tf.constant(x)
    out = {}
    model = _adagrad_model(_strategy(c, 2), capacity)
    _fit(None, model, x, y, epochs=1, weight=1.0)
    for name, shards in (("2to3", 3), ("3to2", 2))[:2 if back else 1]:
        before, _ = _table_state(model)
        # Eager calls on the chief: no predict function to trace (seconds).
        pred = model(batch, training=False).numpy()
        emb = model.layers[1](query, training=False).numpy()
        saved = tf.train.Checkpoint(model=model, optimizer=model.optimizer).write(
            f"{base}_{name}")
        # What it holds: {key: shape} and {key: bytes} of every saved tensor.
        reader = tf.train.load_checkpoint(saved)
        out[f"{name}_saved"] = {k: [shape, int(reader.get_tensor(k).nbytes)]
                                for k, shape in tf.train.list_variables(saved)
                                if k != "_CHECKPOINTABLE_OBJECT_GRAPH"}
        if unbuilt and name == "2to3":
            out["2to3_unbuilt"], _ = _restored(c, shards, capacity, saved, before, pred, emb,
                                               build=False)
        out[name], model = _restored(c, shards, capacity, saved, before, pred, emb)
    return out


def _restored(c, shards, capacity, saved, before, pred, emb, build=True):
    """(result, model): checkpoint ``saved`` restored onto ``shards`` shards
    (``build``: into an optimizer built first, as BackupAndRestore does),
    compared with the saved model's table state, predictions and embeddings;
    then trained for 2 steps."""
    x, y = _data()
    query, batch = tf.constant(RAW[:, None]), tf.constant(x)
    strategy = _strategy(c, shards)
    again = _adagrad_model(strategy, capacity)
    if build:
        with strategy.scope():  # slots restored now
            again.optimizer.build(again.trainable_variables)
    tf.train.Checkpoint(model=again, optimizer=again.optimizer).read(saved)
    r = {"pred_max_diff": float(np.abs(again(batch, training=False).numpy() - pred).max()),
         "emb_max_diff": float(np.abs(
             again.layers[1](query, training=False).numpy() - emb).max()),
         "reshard": again.layers[1].dynamic_table.reshard_stats()}
    # One step of zero gradients: the accumulators move (at the
    # first update after the restore) and nothing else changes.
    _fit(None, again, x, y, epochs=1, steps=1, weight=0.0)
    after, r["after_restore"] = _table_state(again)
    r.update(_compare(before, after))
    r["slots_pending"] = [bool(s.marks.slots_pending.numpy())
                          for s in again.layers[1].dynamic_table.shards]
    _fit(None, again, x, y, epochs=1, steps=2, weight=1.0)
    trained, r["after_training"] = _table_state(again)
    r["after_training"]["rows_changed"] = _compare(after, trained)["rows_max_diff"]
    return r, again


@scenario
def dynamic_keras3_checkpoint(capacity=30, optimizer="adagrad"):
    """Keras 3 fit (2 workers, ``optimizer``, the table on 2 shards), a
    tf.train.Checkpoint of the model and its optimizer, then one step of zero
    gradients on the saved model (the reference: Adam's moments decay and
    move the rows). The checkpoint restored into new models on 2 and on 3
    shards whose optimizer the first step builds (as the Keras 3 trainer
    does on partitioned weights), each taking the same step; then the
    3-shard one saved, stepped, and restored onto 2 the same way. Per
    restore: the predictions right after it, then the same ids, rows, slots
    (every one: Adagrad's accumulator, Adam's momentum and velocity),
    iterations and predictions as its reference."""
    import keras
    import tempfile
    x, y = _data()
    batch = tf.constant(x)

    def make(strategy):
        with strategy.scope():
            i = keras.Input((3,), dtype="int64")
            layer = tf_asyncps.keras3.DynamicEmbedding(4, capacity=capacity, evict_every=5)
            model = keras.Model(i, keras.layers.Dense(1, kernel_initializer="ones")(
                keras.layers.Flatten()(layer(i))))
            model.compile(_optimizer(optimizer, "keras3"), "mse")
        return model, layer

    def state(model, layer):
        """{id: (row, slot rows...)} of the live ids."""
        out = {}
        for s in layer.dynamic_table.shards:
            slots = tf_asyncps.dynamic.table.optimizer_slots(model.optimizer, s.var)
            count, keys, rows = s.count.numpy(), s.key.numpy(), s.var.numpy()
            values = [slot.numpy() for slot, _ in sorted(slots, key=lambda p: p[0].name)]
            for r in np.flatnonzero(count > 0):
                out[int(keys[r])] = (rows[r],) + tuple(v[r] for v in values)
        return out

    def data(weight):
        w = np.full([len(x)], weight, "float32")
        return tf.data.Dataset.from_tensor_slices((x, y, w)).batch(8).repeat()

    def save_then_step(model, layer):
        """(path, predictions at the save, {id: ...} and predictions after one
        zero-gradient step taken after the save: the reference)."""
        saved_pred = model(batch, training=False).numpy()
        path = tf.train.Checkpoint(model=model, optimizer=model.optimizer).write(
            os.path.join(tempfile.mkdtemp(), "ckpt"))
        reader = tf.train.load_checkpoint(path)
        sizes = {k: [shape, int(reader.get_tensor(k).nbytes)]
                 for k, shape in tf.train.list_variables(path)
                 if k != "_CHECKPOINTABLE_OBJECT_GRAPH"}
        model.fit(data(0.0), epochs=1, steps_per_epoch=1, verbose=0)
        return path, saved_pred, state(model, layer), model(batch, training=False).numpy(), sizes

    def restored(c, shards, saved):
        """A new model on ``shards`` shards: the checkpoint, then the same step."""
        path, saved_pred, before, pred, _ = saved
        again, layer2 = make(_strategy(c, shards))
        tf.train.Checkpoint(model=again, optimizer=again.optimizer).read(path)
        restored_diff = float(np.abs(again(batch, training=False).numpy() - saved_pred).max())
        again.fit(data(0.0), epochs=1, steps_per_epoch=1, verbose=0)
        after = state(again, layer2)
        same = sorted(before) == sorted(after)
        diff = lambda i: max(float(np.abs(before[k][i] - after[k][i]).max()) for k in before)
        n_slots = len(next(iter(before.values()))) - 1
        return again, layer2, {
            "ids": sorted(after), "ids_equal": same, "restored_pred_max_diff": restored_diff,
            "pred_max_diff": float(np.abs(again(batch, training=False).numpy() - pred).max()),
            "rows_max_diff": diff(0) if same else -1.0,
            "slots_max_diff": max(diff(i) for i in range(1, n_slots + 1)) if same else -1.0,
            "iterations": int(again.optimizer.iterations.numpy()),
            "shards": len(layer2.dynamic_table.shards),
            "moved": layer2.dynamic_table.reshard_stats()["moved"]}

    with cluster(num_workers=2, num_ps=3) as c:
        model, layer = make(_strategy(c, 2))
        model.fit(data(1.0), epochs=1, steps_per_epoch=8, verbose=0)
        saved = state(model, layer)
        on_two = save_then_step(model, layer)
        before = on_two[2]
        out = {"slots": len(next(iter(before.values()))) - 1,
               "slot_max": max(float(np.abs(v[1:]).max()) for v in saved.values()),
               "moved_by_step": max(float(np.abs(np.stack(before[k]) - np.stack(saved[k])).max())
                                    for k in before),
               "iterations": int(model.optimizer.iterations.numpy())}
        _, _, out["2to2"] = restored(c, 2, on_two)
        on_three, layer3, out["2to3"] = restored(c, 3, on_two)
        # 3 -> 2: the restored 3-shard model saved, then stepped (the reference).
        _, _, out["3to2"] = restored(c, 2, save_then_step(on_three, layer3))
        out["saved"] = on_two[4]  # the tensors of the 2-shard checkpoint
        return out


@scenario(shares_cluster=True)
def dynamic_fan_initializers(keras_name="tf_keras", initializer="he_normal", capacity=400,
                             dim=16, steps=24, width=20,
                             symbolic=True):
    """2 workers, 2 ps, ``initializer`` (he_normal, glorot_uniform), a pass
    every step evicting rows unseen in the last one (ttl_steps=1): ``width``
    ids a row drawn from 5,000, so most rows are reset on the ps. tf_keras: a functional model;
    Keras 3: a subclassed one whose call takes no ``training``, built by
    ``model(keras.Input(...))`` in the strategy's scope (``symbolic``; else
    by the strategy's fit: no first values then). Returns the values of
    the rows reset by passes (free rows that differ from the first values),
    Keras's first values, the stats and the loss per epoch."""
    rng = np.random.default_rng(0)
    x = rng.integers(0, 5000, size=(8 * steps, width)).astype(np.int64)
    y = np.ones((len(x), 1), np.float32)
    with cluster(num_workers=2, num_ps=2) as c:
        strategy = _strategy(c)
        if keras_name == "keras3":
            import keras

            class SubclassedModel(keras.Model):
                def __init__(self):
                    super().__init__()
                    self.emb = tf_asyncps.layers.DynamicEmbedding(
                        dim, capacity=capacity, initializer=initializer, ttl_steps=1,
                        evict_every=1)
                    self.head = keras.layers.Dense(1)

                def call(self, ids):  # no training: Keras 3's fit passes none
                    return self.head(keras.ops.sum(self.emb(ids), axis=1))

            with strategy.scope():
                model = SubclassedModel()
                if symbolic:
                    model(keras.Input((width,), dtype="int64"))
                model.compile(_optimizer("adagrad", "keras3"), "mse")
            layer = model.emb
            data = tf.data.Dataset.from_tensor_slices((x, y)).batch(8).repeat()
        else:
            with strategy.scope():
                layer = tf_asyncps.layers.DynamicEmbedding(
                    dim, capacity=capacity, initializer=initializer, ttl_steps=1,
                    evict_every=1, keras="tf_keras")
                i = tf_keras.Input([width], dtype=tf.int64)
                model = tf_keras.Model(i, tf_keras.layers.Dense(1)(
                    tf_keras.layers.Flatten()(layer(i))))
                model.compile(_optimizer("adagrad"), "mse")
            data = tf_keras.utils.experimental.DatasetCreator(
                lambda ctx: tf.data.Dataset.from_tensor_slices((x, y)).batch(8).repeat())
        built = getattr(layer, "dynamic_table", None) is not None
        first = np.concatenate([s.var.numpy() for s in layer.dynamic_table.shards]) if built \
            else np.full([capacity, dim], np.nan)
        history = model.fit(data, epochs=2, steps_per_epoch=steps // 2, verbose=0)
        rows = np.concatenate([s.var.numpy() for s in layer.dynamic_table.shards])
        free = np.concatenate([s.count.numpy() == 0 for s in layer.dynamic_table.shards])
        reset = free & np.any(rows != first, axis=1)
        return {"class": type(layer).__module__, "shards": len(layer.dynamic_table.shards),
                "reset": rows[reset].ravel().tolist(), "first": first.ravel().tolist(),
                "stats": layer.stats(), "loss": [float(v) for v in history.history["loss"]]}
