"""callbacks/delta_chain.py: dirty rows, deltas and their chain, in one
process (no cluster): a full save + 2 deltas restore rows and Adagrad slots
exactly; each corrupt chain is refused with its message."""

import os
import shutil

import numpy as np
import pytest
import tensorflow as tf
import tf_keras

from local_engine import local_engine
from tf_asyncps.callbacks import delta_chain
from tf_asyncps.compat.optimizers import slot
from tf_asyncps.core.step import WorkerStep

ROWS, DIM = 200, 4


def _model():
    table = tf.Variable(tf.reshape(tf.range(ROWS * DIM, dtype=tf.float32), [ROWS, DIM]) / 100.,
                        name="table")
    dense = tf.Variable(tf.ones([DIM, 2]), name="dense")
    opt = tf_keras.optimizers.Adagrad(learning_rate=0.5)
    opt.build([table, dense])
    return table, dense, opt


def _step(table, dense, opt, dirty, ids):
    with tf.GradientTape() as tape:
        rows = tf.gather(table, tf.constant(ids))
        loss = tf.reduce_sum(tf.matmul(rows, dense) ** 2)
    g_table, g_dense = tape.gradient(loss, [table, dense])
    assert isinstance(g_table, tf.IndexedSlices)
    opt.apply_gradients([(dirty.mark(g_table, table), table), (g_dense, dense)])


def _delta(folder, table, dense, opt, dirty, seq):
    ids = dirty.dirty_ids(table)
    shard = delta_chain.gather_rows(table, ids, {"accumulator": slot(opt, "accumulator", table)})
    out = delta_chain.write_delta(
        folder, base_id="base-0", seq=seq, shards={"table": shard},
        dense={"dense": dense.numpy(), "dense/accumulator":
               slot(opt, "accumulator", dense).numpy()})
    dirty.clear()
    return out


def _targets(table, dense, opt):
    return ({"table": (table, {"accumulator": slot(opt, "accumulator", table)})},
            {"dense": dense, "dense/accumulator": slot(opt, "accumulator", dense)})


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    """A base full checkpoint, then 2 deltas (rows {3, 7} then {7, 50}
    touched), and the trained model's values."""
    root = str(tmp_path_factory.mktemp("chain"))
    table, dense, opt = _model()
    dirty = delta_chain.DirtyRows([table])
    base = tf.train.Checkpoint(table=table, dense=dense, opt=opt).write(
        os.path.join(root, "base", "ckpt"))
    _step(table, dense, opt, dirty, [3, 7, 3])
    np.testing.assert_array_equal(dirty.dirty_ids(table), [3, 7])
    d1 = _delta(os.path.join(root, "delta-1"), table, dense, opt, dirty, 1)
    assert dirty.dirty_ids(table).size == 0  # cleared by the save
    _step(table, dense, opt, dirty, [7, 50])
    d2 = _delta(os.path.join(root, "delta-2"), table, dense, opt, dirty, 2)
    want = {"table": table.numpy(), "dense": dense.numpy(),
            "acc": slot(opt, "accumulator", table).numpy(),
            "dense_acc": slot(opt, "accumulator", dense).numpy()}
    return root, base, [d1, d2], want


def _restore(base, folders):
    table, dense, opt = _model()
    table.assign(tf.zeros_like(table))  # the base must bring every row back
    tf.train.Checkpoint(table=table, dense=dense, opt=opt).read(base).assert_consumed()
    tables, dense_vars = _targets(table, dense, opt)
    for folder, meta in delta_chain.read_chain(folders, "base-0"):
        delta_chain.apply_delta(folder, meta, tables, dense_vars)
    return table, dense, opt


def test_full_and_two_deltas_restore_rows_and_adagrad_slots_exactly(chain):
    _, base, folders, want = chain
    table, dense, opt = _restore(base, list(reversed(folders)))
    np.testing.assert_array_equal(table.numpy(), want["table"])
    np.testing.assert_array_equal(slot(opt, "accumulator", table).numpy(), want["acc"])
    np.testing.assert_array_equal(dense.numpy(), want["dense"])
    np.testing.assert_array_equal(slot(opt, "accumulator", dense).numpy(), want["dense_acc"])
    # Only the touched rows travel: 2 rows, then 2 rows.
    assert [m["shards"][0]["rows"] for _, m in delta_chain.read_chain(folders, "base-0")] == [2, 2]
    # And the base alone is not the trained model (the deltas did the work).
    t0, _, _ = _restore(base, [])
    assert not np.array_equal(t0.numpy()[[3, 7, 50]], want["table"][[3, 7, 50]])
    np.testing.assert_array_equal(np.delete(t0.numpy(), [3, 7, 50], 0),
                                  np.delete(want["table"], [3, 7, 50], 0))


def test_a_dense_gradient_marks_every_row():
    table, _, _ = _model()
    dirty = delta_chain.DirtyRows([table])
    dirty.mark(tf.zeros_like(table), table)
    np.testing.assert_array_equal(dirty.dirty_ids(table), np.arange(ROWS))


def _copy(chain, tmp_path):
    root, _, folders, _ = chain
    out = []
    for f in folders:
        dst = str(tmp_path / os.path.basename(f))
        shutil.copytree(f, dst)
        out.append(dst)
    return out


def test_a_gap_is_refused(chain):
    _, _, folders, _ = chain
    with pytest.raises(delta_chain.ChainError, match=r"delta 1 of base 'base-0' is missing.*"
                       r"delta-2.meta\.json, sequence 2"):
        delta_chain.read_chain([folders[1]], "base-0")


def test_a_duplicate_is_refused(chain, tmp_path):
    _, _, folders, _ = chain
    dup = str(tmp_path / "delta-1-again")
    shutil.copytree(folders[0], dup)
    with pytest.raises(delta_chain.ChainError, match=r"both hold sequence number 1 .*duplicate"):
        delta_chain.read_chain(folders + [dup], "base-0")


def test_a_delta_of_another_base_is_refused(chain):
    _, _, folders, _ = chain
    with pytest.raises(delta_chain.ChainError,
                       match=r"delta-1.meta\.json is a delta of base 'base-0', not of 'base-9'"):
        delta_chain.read_chain(folders, "base-9")


def test_a_truncated_file_is_refused(chain, tmp_path):
    _, base, _, _ = chain
    folders = _copy(chain, tmp_path)
    path = os.path.join(folders[1], "0.npz")
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    with pytest.raises(delta_chain.ChainError,
                       match=r"delta-2.0\.npz does not match its sha256 .*\(table table\).*"
                             r"truncated or half-written"):
        _restore(base, folders)
    os.remove(path)
    with pytest.raises(delta_chain.ChainError, match=r"delta-2.0\.npz is missing \(table table"):
        _restore(base, folders)


def test_a_half_written_delta_is_refused(chain, tmp_path):
    folders = _copy(chain, tmp_path)
    os.remove(os.path.join(folders[1], "meta.json"))
    with pytest.raises(delta_chain.ChainError,
                       match=r"delta-2.meta\.json is missing or unreadable.*half-written"):
        delta_chain.read_chain(folders, "base-0")


def test_delta_bytes_against_a_full_save_with_few_rows_changed(tmp_path):
    """< 5% of rows changed: the delta is a small fraction of a full save
    (rows + Adagrad slot rows, against every row and slot row)."""
    rows, dim = 20000, 16
    table = tf.Variable(tf.random.stateless_normal([rows, dim], seed=[1, 2]))
    opt = tf_keras.optimizers.Adagrad()
    opt.build([table])
    dirty = delta_chain.DirtyRows([table])
    ids = np.arange(0, rows, 25)  # 4% of the rows
    dirty.mark(tf.IndexedSlices(tf.ones([len(ids), dim]), tf.constant(ids)), table)
    full = tf.train.Checkpoint(t=table, o=opt).write(str(tmp_path / "full" / "ckpt"))
    full_bytes = sum(os.path.getsize(os.path.join(tmp_path / "full", f))
                     for f in os.listdir(tmp_path / "full"))
    shard = delta_chain.gather_rows(table, dirty.dirty_ids(table),
                                    {"accumulator": slot(opt, "accumulator", table)})
    folder = delta_chain.write_delta(str(tmp_path / "delta-1"), base_id="b", seq=1,
                                     shards={"t": shard}, dense={})
    delta_bytes = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder))
    assert full is not None and delta_bytes <= 0.1 * full_bytes, (delta_bytes, full_bytes)


def test_the_engine_marks_the_rows_its_update_writes():
    """Registered with the engine (the table seam), the marks are set inside
    the update from the gradient's own indices, the rows it writes."""
    engine = local_engine("async")
    table, _, opt = _model()
    dirty = delta_chain.DirtyRows([table])
    engine.register_table(dirty.hooks())

    @tf.function
    def step(ids):
        ws = WorkerStep(engine, tf.constant(0, tf.int64), tf.constant(0, tf.int64))
        with ws.active():
            grad = tf.IndexedSlices(tf.ones([tf.size(ids), DIM]), ids, tf.shape(table, tf.int64))
            opt.apply_gradients([(grad, table)])
        return ws.applied

    before = table.numpy()
    step(tf.constant([5, 9, 5], tf.int64))
    np.testing.assert_array_equal(dirty.dirty_ids(table), [5, 9])
    changed = np.flatnonzero(np.any(table.numpy() != before, axis=1))
    np.testing.assert_array_equal(changed, [5, 9])
    dirty.clear()
    step(tf.constant([120], tf.int64))
    np.testing.assert_array_equal(dirty.dirty_ids(table), [120])


def _keras_model():
    model = tf_keras.Sequential([tf_keras.layers.Embedding(ROWS, DIM),
                                 tf_keras.layers.GlobalAveragePooling1D(),
                                 tf_keras.layers.Dense(1)])
    model.build((None, 3))
    opt = tf_keras.optimizers.Adagrad(0.5)
    opt.build(model.trainable_variables)
    return model, opt


def test_a_keras_model_round_trips_through_a_full_save_and_two_deltas(tmp_path):
    """Embedding + Dense, Adagrad: base + 2 deltas give every model and
    optimizer variable of the trained model exactly; the deltas hold the
    touched rows only."""
    model, opt = _keras_model()
    deltas = delta_chain.ModelDeltas(model, opt)
    assert [v.shape.as_list() for v, _ in deltas.tables.values()] == [[ROWS, DIM]]
    assert list(deltas.tables.values())[0][1].keys() == {"accumulator"}
    dirty = deltas.track()
    base = tf.train.Checkpoint(model=model, opt=opt).write(str(tmp_path / "base" / "ckpt"))
    folders = []
    for seq, batch in enumerate([[[1, 2, 2]], [[2, 40, 41], [41, 41, 1]]], start=1):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(tf.constant(batch)) ** 2)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients([(dirty.mark(g, v), v)
                             for g, v in zip(grads, model.trainable_variables)])
        folders.append(deltas.write(str(tmp_path / f"delta-{seq}"), base_id="b", seq=seq))
    rows = [m["shards"][0]["rows"] for _, m in delta_chain.read_chain(folders, "b")]
    assert rows == [2, 4]
    fresh, fresh_opt = _keras_model()
    tf.train.Checkpoint(model=fresh, opt=fresh_opt).read(base).assert_consumed()
    assert delta_chain.ModelDeltas(fresh, fresh_opt).restore(folders, "b") == 2
    for a, b in zip(model.variables + opt.variables, fresh.variables + fresh_opt.variables):
        np.testing.assert_array_equal(a.numpy(), b.numpy(), err_msg=a.name)
    assert int(fresh_opt.iterations.numpy()) == 2


def _keras3_model():
    import keras
    keras.utils.set_random_seed(5)
    model = keras.Sequential([keras.Input((3,), dtype="int64"), keras.layers.Embedding(ROWS, DIM),
                              keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(1)])
    opt = keras.optimizers.Adagrad(0.5)
    opt.build(model.trainable_variables)
    return model, opt


def test_a_keras3_model_round_trips_through_a_full_save_and_two_deltas(tmp_path):
    """Keras 3 (issue 41 item 2 for Keras 3 fit): the marks are keyed by the
    tf.Variable behind each Keras variable, the slots are its tf.Variables;
    base + 2 deltas give every model and optimizer variable exactly."""
    model, opt = _keras3_model()
    deltas = delta_chain.ModelDeltas(model, opt)
    (table, slots), = deltas.tables.values()
    assert isinstance(table, tf.Variable) and slots.keys() == {"accumulator"}
    dirty = deltas.track()
    emb = model.layers[0].embeddings
    assert dirty.owns(emb) and dirty.owns(table)
    base = tf.train.Checkpoint(model=model, opt=opt).write(str(tmp_path / "base" / "ckpt"))
    folders = []
    for seq, batch in enumerate([[[1, 2, 2]], [[2, 40, 41], [41, 41, 1]]], start=1):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(tf.constant(batch)) ** 2)
        grads = tape.gradient(loss, [v.value for v in model.trainable_variables])
        opt.apply_gradients([(dirty.mark(g, v), v)
                             for g, v in zip(grads, model.trainable_variables)])
        folders.append(deltas.write(str(tmp_path / f"delta-{seq}"), base_id="b", seq=seq))
    assert [m["shards"][0]["rows"] for _, m in delta_chain.read_chain(folders, "b")] == [2, 4]
    fresh, fresh_opt = _keras3_model()
    for v in fresh.variables:
        v.assign(tf.zeros_like(v))
    tf.train.Checkpoint(model=fresh, opt=fresh_opt).read(base).assert_consumed()
    assert delta_chain.ModelDeltas(fresh, fresh_opt).restore(folders, "b") == 2
    for a, b in zip(model.variables + opt.variables, fresh.variables + fresh_opt.variables):
        np.testing.assert_array_equal(np.asarray(a.numpy()), np.asarray(b.numpy()), err_msg=a.path)
    assert int(fresh_opt.iterations.numpy()) == 2


class _Split:
    """A table split on axis 0 into ``variables`` (as a ShardedVariable is:
    the strategy's partitioner makes them on a cluster)."""

    def __init__(self, variables):
        self.variables = variables


class _Model:
    """One table layer (split) and a dense variable: what ModelDeltas reads."""

    def __init__(self, split, dense):
        self.layer = type("Layer", (), {})()
        self.layer.embeddings = split
        self.variables = [split, dense]

    def _flatten_layers(self, include_self=False, recursive=True):
        return [self.layer]


def _split_model(full, acc, dense, sizes):
    parts, first = [], 0
    for n in sizes:
        parts.append(tf.Variable(full[first:first + n]))
        first += n
    dense = tf.Variable(dense)
    opt = tf_keras.optimizers.Adagrad(learning_rate=0.5)
    opt.build(parts + [dense])
    first = 0
    for p in parts:
        slot(opt, "accumulator", p).assign(acc[first:first + int(p.shape[0])])
        first += int(p.shape[0])
    return _Model(_Split(parts), dense), opt, parts, dense


def test_a_chain_written_over_2_shards_restores_onto_3(tmp_path):
    """(issue 41 item 2: restore onto another number of ps tasks) a table's
    rows are written by global row: a chain written over shards of 120 + 80
    rows restores onto 70 + 70 + 60, rows and Adagrad slots exactly."""
    full = (np.arange(ROWS * DIM, dtype=np.float32).reshape(ROWS, DIM) / 100.)
    acc0, dense0 = np.full([ROWS, DIM], 0.1, np.float32), np.ones([DIM, 2], np.float32)
    model, opt, parts, dense = _split_model(full, acc0, dense0, [120, 80])
    deltas = delta_chain.ModelDeltas(model, opt)
    assert list(deltas.layout) == ["t0"] and [f for _, _, f in deltas.layout["t0"]] == [0, 120]
    dirty = deltas.track()
    folders = []
    for seq, ids in enumerate([[3, 119, 120], [150, 3, 199, 60]], start=1):
        with tf.GradientTape() as tape:
            rows = tf.concat([tf.gather(parts[0], [i for i in ids if i < 120]),
                              tf.gather(parts[1], [i - 120 for i in ids if i >= 120])], 0)
            loss = tf.reduce_sum(tf.matmul(rows, dense) ** 2)
        grads = tape.gradient(loss, parts + [dense])
        opt.apply_gradients([(dirty.mark(g, v), v) for g, v in zip(grads, parts + [dense])])
        folders.append(deltas.write(str(tmp_path / f"delta-{seq}"), base_id="b", seq=seq))
    rows = [np.load(os.path.join(f, "0.npz"))["ids"].tolist() for f in folders]
    assert rows == [[3, 119, 120], [3, 60, 150, 199]]  # global rows
    three, opt3, parts3, dense3 = _split_model(full, acc0, dense0, [70, 70, 60])
    assert delta_chain.ModelDeltas(three, opt3).restore(folders, "b") == 2
    np.testing.assert_array_equal(np.concatenate([p.numpy() for p in parts3]),
                                  np.concatenate([p.numpy() for p in parts]))
    np.testing.assert_array_equal(
        np.concatenate([slot(opt3, "accumulator", p).numpy() for p in parts3]),
        np.concatenate([slot(opt, "accumulator", p).numpy() for p in parts]))
    np.testing.assert_array_equal(dense3.numpy(), dense.numpy())
    assert not np.array_equal(dense3.numpy(), dense0)


def test_readers_share_one_mark_each_with_its_own_bit():
    """Eight readers at most read one table's marks; each clears only its
    own bit; a dropped reader frees its bit."""
    import gc
    table, _, _ = _model()
    readers = [delta_chain.shared_reader([table], f"r{i}") for i in range(8)]
    assert sorted(r.bit for r in readers) == list(range(8))
    with pytest.raises(ValueError, match="8 readers read these tables' dirty marks already"):
        delta_chain.shared_reader([table], "ninth")
    readers[0].mark(tf.IndexedSlices(tf.ones([2, DIM]), tf.constant([4, 9])), table)
    readers[3].clear()
    assert readers[3].dirty_ids(table).size == 0
    for r in readers[:3] + readers[4:]:
        np.testing.assert_array_equal(r.dirty_ids(table), [4, 9])
    bit = readers.pop(5).bit
    gc.collect()
    assert delta_chain.shared_reader([table], "again").bit == bit


def test_a_mark_hands_the_gradient_itself_back_and_marks_its_rows():
    """Keras 3's row-wise update knows a gradient by identity (it applies it
    with the squares the worker sent): the filter returns the very object."""
    table = tf.Variable(tf.zeros([6, 2]))
    reader = delta_chain.shared_reader([table], "identity")
    grad = tf.IndexedSlices(tf.ones([3, 2]), tf.constant([4, 1, 4], tf.int64))
    assert reader.mark(grad, table) is grad
    np.testing.assert_array_equal(reader.dirty_ids(table), [1, 4])


# -- DynamicEmbedding (tf_asyncps/dynamic/deltas.py) ---------------------------
DYN_CAPACITY = 6
# Full after step 2; 17 and 18 refused twice, so the pass after step 4
# evicts the two coldest rows (13, 14) for them; step 5 admits them.
DYN_BATCHES = [[[11, 12], [13, 11]], [[14, 15], [11, 16]], [[17, 18], [17, 11]],
               [[17, 18], [11, 12]], [[17, 18], [11, 19]]]


def _dynamic_model(eviction="lfu"):
    from tf_asyncps.layers import DynamicEmbedding
    tf_keras.utils.set_random_seed(7)
    i = tf_keras.Input([2], dtype=tf.int64)
    layer = DynamicEmbedding(DIM, capacity=DYN_CAPACITY, eviction=eviction, evict_every=2,
                             name="emb")
    model = tf_keras.Model(i, tf_keras.layers.Dense(1)(tf_keras.layers.Flatten()(layer(i))))
    opt = tf_keras.optimizers.Adagrad(0.5)
    opt.build(model.trainable_variables)
    layer.use_step(opt.iterations)
    layer.use_optimizer(opt, model.trainable_variables)
    return model, layer, opt


def _dynamic_step(model, layer, opt, reader, batch):
    """One training step in one process: the lookup admits and counts, the
    update's rows are marked (the ps's gradient filter does it under the
    strategy), then the eviction pass due at the new step."""
    from tf_asyncps.dynamic.table import optimizer_slots
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(model(tf.constant(batch, tf.int64), training=True) ** 2)
    grads = tape.gradient(loss, model.trainable_variables)
    opt.apply_gradients([(reader.mark(g, v), v) for g, v in zip(grads, model.trainable_variables)])
    layer.dynamic_table.maybe_evict(int(opt.iterations.numpy()),
                                    lambda var: optimizer_slots(opt, var))


def _dynamic_state(layer, model, opt):
    from tf_asyncps.dynamic import deltas as dynamic_deltas
    table = layer.dynamic_table
    out = dynamic_deltas.state_of(table)
    keys, rows = table.shards[0].index.export()
    order = np.argsort(rows.numpy())
    out["index"] = (keys.numpy()[order], rows.numpy()[order])
    out["dense"] = [v.numpy() for v in model.trainable_variables[1:]]
    out["iterations"] = int(opt.iterations.numpy())
    return out


@pytest.fixture(scope="module")
def dynamic_chain(tmp_path_factory):
    """A DynamicEmbedding of 6 rows, Adagrad, LFU eviction every 2 steps:
    a base after step 1, deltas after steps 3 and 5 (rows admitted, updated,
    evicted and re-admitted between them); the trained state."""
    root = str(tmp_path_factory.mktemp("dynamic"))
    model, layer, opt = _dynamic_model()
    deltas = delta_chain.ModelDeltas(model, opt)
    assert list(deltas.dynamic) == ["t0"] and not deltas.tables
    reader = deltas.track()
    _dynamic_step(model, layer, opt, reader, DYN_BATCHES[0])
    base = tf.train.Checkpoint(model=model, opt=opt).write(os.path.join(root, "base", "ckpt"))
    reader.clear()
    from tf_asyncps.dynamic import deltas as dynamic_deltas
    dynamic_deltas.clear(layer.dynamic_table, reader.mask)
    folders = []
    for seq, batches in enumerate([DYN_BATCHES[1:3], DYN_BATCHES[3:]], start=1):
        for batch in batches:
            _dynamic_step(model, layer, opt, reader, batch)
        folders.append(deltas.write(os.path.join(root, f"delta-{seq}"), base_id="b", seq=seq))
    return base, folders, _dynamic_state(layer, model, opt), layer.stats()


def test_a_dynamic_chain_round_trips_rows_slots_ids_and_counts(dynamic_chain):
    """Base + 2 deltas give the trained table exactly: live rows, their ids,
    counts (LFU-aged), last steps, values, Adagrad slot rows, the counting
    filter, each shard's counters and the id -> row map; the dense layer too."""
    base, folders, want, stats = dynamic_chain
    assert stats["evicted"] > 0  # the chain crossed eviction passes
    model, layer, opt = _dynamic_model()
    tf.train.Checkpoint(model=model, opt=opt).read(base).assert_existing_objects_matched()
    assert delta_chain.ModelDeltas(model, opt).restore(folders, "b") == 2
    got = _dynamic_state(layer, model, opt)
    assert got["iterations"] == want["iterations"] == len(DYN_BATCHES)
    for name in ("rows", "key", "count", "last", "values", "slots", "filter_at", "filter",
                 "waiting_at", "shards"):
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    assert want["slots"].shape[0] == 1  # Adagrad's accumulator rows, by row
    for g, w in zip(got["index"] + tuple(got["dense"]), want["index"] + tuple(want["dense"])):
        np.testing.assert_array_equal(g, w)


def test_a_dynamic_delta_without_passes_run_restores_by_the_passes_counter(dynamic_chain):
    """A delta written before ``passes_run`` was recorded is still read: its
    aging is the change in each shard's ``passes`` (exact here, where no
    period was skipped)."""
    from tf_asyncps.dynamic import deltas as dynamic_deltas
    base, folders, want, _ = dynamic_chain
    model, layer, opt = _dynamic_model()
    tf.train.Checkpoint(model=model, opt=opt).read(base).assert_existing_objects_matched()
    state = dynamic_deltas.state_of(layer.dynamic_table)
    ran = []
    for folder in folders:
        old = dict(np.load(os.path.join(folder, "0.npz")))
        ran.append(old.pop("passes_run").tolist())
        state = dynamic_deltas.apply(layer.dynamic_table, state, old, folder)
    assert ran == [[1], [1]]  # the passes after steps 2 and 4
    for name in ("rows", "key", "count", "filter_at", "filter", "shards"):
        np.testing.assert_array_equal(state[name], want[name], err_msg=name)


def test_tombstones_remove_the_evicted_ids_at_restore(dynamic_chain, tmp_path):
    """Each delta holds the ids evicted since the previous one; applied,
    they leave the map (a lookup finds no row) and the base's rows they held
    are freed unless another id took them."""
    base, folders, want, _ = dynamic_chain
    from tf_asyncps.dynamic import deltas as dynamic_deltas
    tombs = [dynamic_deltas.decode_keys(np.load(os.path.join(f, "0.npz")), "tomb:")
             for f in folders]
    assert sum(len(t) for t in tombs) > 0
    assert [sorted(t.tolist()) for t in tombs] == [[], [13, 14]]
    gone = set(np.concatenate(tombs).tolist()) - set(want["key"].tolist())
    assert gone == {13, 14}  # evicted and not admitted again
    model, layer, opt = _dynamic_model()
    tf.train.Checkpoint(model=model, opt=opt).read(base).assert_existing_objects_matched()
    before = set(dynamic_deltas.state_of(layer.dynamic_table)["key"].tolist())
    assert gone & before  # the base held some of them
    delta_chain.ModelDeltas(model, opt).restore(folders, "b")
    rows, found = layer.dynamic_table.rows_of(tf.constant(sorted(gone), tf.int64))
    assert not found.numpy().any(), rows.numpy()
    assert not gone & set(dynamic_deltas.state_of(layer.dynamic_table)["key"].tolist())


def test_clear_takes_the_rows_filter_marks_and_tombstones():
    """ModelDeltas.clear (a full save's, and each delta's) clears all three:
    a tombstone left after a full save went into the next delta and freed
    an id evicted and admitted again before the base, untouched after it."""
    from tf_asyncps.dynamic import deltas as dynamic_deltas
    model, layer, opt = _dynamic_model()
    deltas = delta_chain.ModelDeltas(model, opt)
    reader = deltas.track()
    for batch in DYN_BATCHES:
        _dynamic_step(model, layer, opt, reader, batch)
    table = layer.dynamic_table
    before = dynamic_deltas.read(table, reader.mask, [], slots=False)
    assert sorted(dynamic_deltas.decode_keys(before, "tomb:").tolist()) == [13, 14]
    assert len(before["ids"]) and len(before["filter_at"])
    deltas.clear()
    after = dynamic_deltas.read(table, reader.mask, [], slots=False)
    assert [len(after[n]) for n in ("ids", "filter_at")] == [0, 0]
    assert len(dynamic_deltas.decode_keys(after, "tomb:")) == 0
    # Its only reader read them: the tombstones are gone from the ps.
    assert [int(s.delta_marks.tombs.size()) for s in table.shards] == [0]


def test_a_dynamic_chain_refuses_other_shards_naming_the_file(dynamic_chain, tmp_path):
    """A delta over shards of another capacity, or over other shards than
    those the base was restored from (no restore from them pending): refused
    naming the file and the fix."""
    from tf_asyncps.dynamic import deltas as dynamic_deltas
    base, folders, want, _ = dynamic_chain
    model, layer, opt = _dynamic_model()
    state = dynamic_deltas.state_of(layer.dynamic_table)
    other = dict(np.load(os.path.join(folders[0], "0.npz")))
    other["shards"] = np.concatenate([other["shards"], other["shards"]])
    with pytest.raises(ValueError, match=r"x/0\.npz holds table 'emb' over shards "
                       r"of \[6, 6\] rows, this table has \[6\] and its capacity is 6"):
        dynamic_deltas.apply(layer.dynamic_table, state, other, "x/0.npz")
    other["shards"] = np.concatenate([other["shards"][:1]] * 2)
    other["shards"][:, 0] = [2, 4]
    with pytest.raises(ValueError, match=r"over shards of \[2, 4\] rows, this table has \[6\] "
                       r"and no restore from them is pending here .* apply the chain before "
                       r"the first lookup"):
        dynamic_deltas.apply(layer.dynamic_table, state, other, "x/0.npz")


class _DynamicSplit(tf.Module):
    """A DynamicTable over a table split by hand into shards of ``sizes``
    rows (the strategy's partitioner splits it so on a cluster), LFU
    eviction every 4 steps, and a dense variable: the model ModelDeltas and
    a tf.train.Checkpoint read."""

    def __init__(self, sizes):
        super().__init__()
        from tf_asyncps.dynamic.table import DynamicTable
        parts = [tf.Variable(tf.zeros([n, DIM]), name=f"t/part_{i}") for i, n in enumerate(sizes)]
        self.table = tf.__internal__.distribute.ShardedVariable(parts, name="t")
        self.dt = DynamicTable(self.table, key_dtype=tf.int64, min_count=1, eviction="lfu",
                               evict_every=4, ttl_steps=None, name="emb",
                               initializer=lambda shape: tf.fill(shape, 0.1))
        self.dense = tf.Variable(tf.fill([2 * DIM, 1], 0.1), name="dense")
        self.parts = parts
        self.layer = type("Layer", (), {})()
        self.layer.dynamic_table = self.dt

    @property
    def variables(self):
        return [self.table, self.dense]

    @property
    def trainable_variables(self):
        return self.parts + [self.dense]

    def _flatten_layers(self, include_self=False, recursive=True):
        return [self.layer]


def _split_dynamic(sizes):
    from tf_asyncps.dynamic import checkpoint as dynamic_checkpoint
    m = _DynamicSplit(sizes)
    opt = tf_keras.optimizers.Adagrad(0.5)
    opt.build(m.trainable_variables)
    dynamic_checkpoint.track_optimizer(m.dt, opt, m.trainable_variables)
    return m, opt


def _split_step(m, opt, reader, batch, step):
    """One step in one process: the lookup admits and counts on each shard,
    the update goes through the table's gradient filter and marks its rows,
    then the eviction pass due at the next step."""
    from tf_asyncps.dynamic.table import optimizer_slots
    with tf.GradientTape() as tape:
        rows = m.dt.lookup(tf.constant(batch, tf.int64), step=tf.constant(step, tf.int64),
                           training=True)
        loss = tf.reduce_sum((tf.matmul(tf.reshape(rows, [len(batch), -1]), m.dense) - 1) ** 2)
    pairs = [(g, v) for g, v in zip(tape.gradient(loss, m.trainable_variables),
                                     m.trainable_variables) if g is not None]
    opt.apply_gradients([(reader.mark(m.dt.drop_free_rows(g, v), v), v) for g, v in pairs])
    m.dt.maybe_evict(step + 1, lambda var: optimizer_slots(opt, var))


def _split_state(m, opt):
    """The table's entry, each shard's map, the counters and the dense
    variable with its Adagrad slot, after the re-homing a lookup runs
    first and the slot move the next update runs first."""
    from tf_asyncps.dynamic import checkpoint as dynamic_checkpoint
    from tf_asyncps.dynamic import deltas as dynamic_deltas
    from tf_asyncps.dynamic import reshard
    m.dt.prepare()
    reshard.prepare_slots(m.dt, dynamic_checkpoint.slot_sets(m.dt, opt))
    out = dynamic_deltas.state_of(m.dt)
    for j, shard in enumerate(m.dt.shards):
        keys, rows = (t.numpy() for t in shard.index.export())
        out[f"index{j}"] = np.stack([keys, rows])[:, np.argsort(rows)]
    out.update({f"stats:{k}": np.asarray(v) for k, v in m.dt.stats().items()})
    out["dense"], out["dense_slot"] = m.dense.numpy(), slot(opt, "accumulator", m.dense).numpy()
    out["iterations"] = opt.iterations.numpy()
    return out


def test_a_dynamic_chain_written_over_2_shards_restores_onto_3(tmp_path):
    """(issue 41 item 2) A table over shards of 6 + 6 rows, 17 ids, LFU
    eviction every 4 steps: base after step 6 (one pass run), deltas after
    steps 10 and 11 (rows admitted and evicted; id 100, seen in each of the
    first 6 steps only, keeps its row untouched while its count ages from 4
    to 2). Restored onto 4 + 4 + 4 rows, base + chain give exactly what the
    full checkpoint at step 11 gives there: rows, ids, counts, last steps,
    values, Adagrad slot rows, each shard's map and counters, the dense
    variable."""
    rng = np.random.RandomState(3)
    batches = [(rng.zipf(1.5, 6) % 16).reshape(3, 2).tolist() for _ in range(11)]
    for batch in batches[:6]:
        batch[0][0] = 100
    root = str(tmp_path)
    a, opt = _split_dynamic([6, 6])
    deltas = delta_chain.ModelDeltas(a, opt)
    assert list(deltas.dynamic) == ["t0"]
    reader = deltas.track()
    for step in range(6):
        _split_step(a, opt, reader, batches[step], step)
    base = tf.train.Checkpoint(m=a, opt=opt).write(os.path.join(root, "base", "ckpt"))
    deltas.clear()
    folders = []
    for seq, steps in ((1, range(6, 10)), (2, range(10, 11))):
        for step in steps:
            _split_step(a, opt, reader, batches[step], step)
        folders.append(deltas.write(os.path.join(root, f"delta-{seq}"), base_id="b", seq=seq))
    assert a.dt.stats()["evicted"] > 0  # the chain crossed eviction passes
    full = tf.train.Checkpoint(m=a, opt=opt).write(os.path.join(root, "full", "ckpt"))
    from tf_asyncps.dynamic import deltas as dynamic_deltas
    assert any(len(dynamic_deltas.decode_keys(np.load(os.path.join(f, "0.npz")), "tomb:"))
               for f in folders)
    got = {}
    for how in ("chain", "full"):
        b, opt_b = _split_dynamic([4, 4, 4])
        tf.train.Checkpoint(m=b, opt=opt_b).read(base if how == "chain" else full)
        if how == "chain":
            assert delta_chain.ModelDeltas(b, opt_b).restore(folders, "b") == 2
        got[how] = _split_state(b, opt_b)
        assert b.dt.reshard_stats()["from_shards"] == 2 and b.dt.reshard_stats()["moved"] > 0
    assert got["full"]["iterations"] == 11 and len(got["full"]["rows"]) > 0
    assert got["full"]["count"][got["full"]["key"].tolist().index(100)] == 2
    assert sorted(got["chain"]) == sorted(got["full"])
    for name, want in got["full"].items():
        np.testing.assert_array_equal(got["chain"][name], want, err_msg=name)


def test_a_dynamic_chain_ages_by_the_passes_that_ran_not_the_periods(tmp_path):
    """An eviction pass sets ``passes`` to its period, and a period whose
    pass no worker ran (another ran a later one first) is skipped: passes
    for periods 1, 2 and 4 after the base age the untouched counts and
    filter slots three times, not four. Base (20 lookups of 14 ids
    over 6 + 6 rows, no pass) + one delta give the table's own counts,
    filter and counters, restored onto the same shards and onto 4 + 4 + 4
    as the full checkpoint at the delta gives there."""
    from tf_asyncps.dynamic import deltas as dynamic_deltas
    from tf_asyncps.dynamic.table import optimizer_slots
    ids = tf.constant(list(range(100, 114)), tf.int64)
    root = str(tmp_path)
    a, opt = _split_dynamic([6, 6])
    deltas = delta_chain.ModelDeltas(a, opt)
    deltas.track()
    for step in range(20):
        a.dt.lookup(ids, step=tf.constant(step, tf.int64), training=True)
    base = tf.train.Checkpoint(m=a, opt=opt).write(os.path.join(root, "base", "ckpt"))
    deltas.clear()
    for step in (4, 8, 16):  # periods 1, 2, 4 (evict_every 4): 3 passes
        a.dt.maybe_evict(step, lambda var: optimizer_slots(opt, var))
    folder = deltas.write(os.path.join(root, "delta-1"), base_id="b", seq=1)
    full = tf.train.Checkpoint(m=a, opt=opt).write(os.path.join(root, "full", "ckpt"))
    want = dynamic_deltas.state_of(a.dt)
    assert [int(s.passes.numpy()) for s in a.dt.shards] == [4, 4]
    assert sorted(set(want["count"].tolist())) == [2]  # 20 halved 3 times (4 times: 1)
    assert len(want["filter"]) and set(want["filter"].tolist()) <= {2, 5}
    b, opt_b = _split_dynamic([6, 6])
    tf.train.Checkpoint(m=b, opt=opt_b).read(base)
    assert delta_chain.ModelDeltas(b, opt_b).restore([folder], "b") == 1
    got = dynamic_deltas.state_of(b.dt)
    for name in ("rows", "key", "count", "last", "filter_at", "filter", "waiting_at",
                 "shards"):
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    got = {}
    for how in ("chain", "full"):
        c, opt_c = _split_dynamic([4, 4, 4])
        tf.train.Checkpoint(m=c, opt=opt_c).read(base if how == "chain" else full)
        if how == "chain":
            delta_chain.ModelDeltas(c, opt_c).restore([folder], "b")
        got[how] = _split_state(c, opt_c)
    assert sorted(set(got["full"]["count"].tolist())) == [2]
    for name, want_c in got["full"].items():
        np.testing.assert_array_equal(got["chain"][name], want_c, err_msg=name)


def test_the_dynamic_table_s_gradient_filter_copies_the_gradient():
    """drop_free_rows returns a new IndexedSlices (the free rows' slices
    dropped); Keras 3's row-wise update then takes S2 = S1**2 of its rows,
    the same values for a dynamic table, whose gradient has one row per
    distinct id (the lookup gathers each found row once)."""
    model, layer, opt = _dynamic_model()
    model(tf.constant([[11, 12]], tf.int64), training=True)
    table = layer.dynamic_table
    grad = tf.IndexedSlices(tf.ones([2, DIM]), tf.constant([0, 1], tf.int64))
    out = table.drop_free_rows(grad, table.shards[0].var)
    assert out is not grad
    np.testing.assert_array_equal(out.indices.numpy(), [0, 1])
