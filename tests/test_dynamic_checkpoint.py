"""A DynamicEmbedding's tf.train.Checkpoint holds its live rows only (table
and optimizer slots), in one process; on a cluster and onto other shard
counts: tests/test_dynamic_cluster.py::test_checkpoint_restores_map_rows_and_predictions."""

import os

import numpy as np
import pytest
import tensorflow as tf
import tf_keras

from tf_asyncps.callbacks import DynamicEviction
from tf_asyncps.layers import DynamicEmbedding
from tf_asyncps.dynamic.table import optimizer_slots

LIVE, DIM = 50, 8
IDS = (np.arange(LIVE, dtype=np.int64) * 7919 + 10**12).reshape(25, 2)
Y = np.linspace(-1.0, 1.0, 25, dtype=np.float32).reshape(25, 1)
KINDS = ["tf_keras", "tf_keras_legacy", "keras3"]


def _model(kind, capacity):
    """(model, layer): ids [2] -> DynamicEmbedding -> Dense(1), Adam (two
    slots per row), compiled."""
    if kind == "keras3":
        keras = pytest.importorskip("keras")
        import tf_asyncps
        i = keras.Input((2,), dtype="int64")
        layer = tf_asyncps.keras3.DynamicEmbedding(DIM, capacity=capacity, name="emb")
        model = keras.Model(i, keras.layers.Dense(1)(keras.layers.Flatten()(layer(i))))
        model.compile(keras.optimizers.Adam(0.01), "mse")
        return model, layer
    i = tf_keras.Input([2], dtype=tf.int64)
    layer = DynamicEmbedding(DIM, capacity=capacity, name="emb")
    model = tf_keras.Model(i, tf_keras.layers.Dense(1)(tf_keras.layers.Flatten()(layer(i))))
    optimizers = tf_keras.optimizers.legacy if kind == "tf_keras_legacy" else tf_keras.optimizers
    model.compile(optimizers.Adam(0.01), "mse")
    return model, layer


def _trained(kind, capacity, path):
    model, layer = _model(kind, capacity)
    # DynamicEviction gives the table its optimizer (layer.use_optimizer).
    model.fit(IDS, Y, batch_size=5, epochs=2, verbose=0, shuffle=False,
              callbacks=[DynamicEviction()])
    assert layer.stats()["live_rows"] == LIVE
    return model, layer, tf.train.Checkpoint(model=model, optimizer=model.optimizer).write(
        str(path))


@pytest.fixture(scope="module")
def trained_10k(tmp_path_factory):
    """``trained_10k(kind)``: ``_trained(kind, 10_000, path)``, made once per
    kind in this module: the size and round-trip tests share it (the size
    test reads only the checkpoint written then, the round trip trains the
    model on)."""
    made = {}

    def get(kind):
        if kind not in made:
            made[kind] = _trained(kind, 10_000, tmp_path_factory.mktemp(kind) / "ckpt")
        return made[kind]
    return get


def _sizes(path):
    """{checkpoint key: bytes} of every saved tensor."""
    reader = tf.train.load_checkpoint(path)
    out = {}
    for name, _ in tf.train.list_variables(path):
        if name != "_CHECKPOINTABLE_OBJECT_GRAPH":
            value = reader.get_tensor(name)
            out[name] = sum(len(v) for v in value.ravel()) if value.dtype == object \
                else value.nbytes
    return out


def _slots(model, layer):
    """The optimizer's slots of the table, whole tables in order."""
    return [s.numpy() for s, _ in optimizer_slots(model.optimizer,
                                                  layer.dynamic_table.shards[0].var)]


@pytest.mark.parametrize("kind", KINDS)
def test_checkpoint_size_follows_live_rows_not_capacity(tmp_path, kind, trained_10k):
    """50 live rows of 8 floats, Adam: before, capacity 10,000 wrote the table
    and both slots whole (3 x 320,000 bytes) plus 4 whole-table int64 arrays;
    now every tensor has the live rows' length, and the same rows in a table
    twice as large write exactly as many bytes."""
    sizes = {}
    for capacity in (10_000, 20_000):
        _, _, path = trained_10k(kind) if capacity == 10_000 else _trained(
            kind, capacity, tmp_path / f"c{capacity}" / "ckpt")
        shapes = dict(tf.train.list_variables(path))
        assert not [k for k, s in shapes.items() if capacity in s or 65_536 in s], shapes
        sizes[capacity] = _sizes(path)
    assert sizes[10_000] == sizes[20_000]
    table = {k: v for k, v in sizes[10_000].items() if "dynamic_table" in k}
    # Per live row: global row, key, count, last step, index key and value
    # (6 x 8 bytes), its values and two Adam slots (3 x 8 x 4 bytes); plus at
    # most two nonzero counting-filter slots per id (position, count) and one
    # row of 6 int64 counters per shard.
    per_row = 6 * 8 + 3 * DIM * 4
    assert LIVE * per_row + 48 <= sum(table.values()) <= LIVE * (per_row + 2 * 16) + 48
    slots = [v for k, v in table.items() if k.endswith("/state/.ATTRIBUTES/slots")]
    assert slots == [2 * LIVE * DIM * 4]  # [2, 50, 8] float32: Adam's m and v rows
    # Nothing else of the table, of its slots, or anywhere, holds many bytes.
    assert sum(sizes[10_000].values()) - sum(table.values()) < 1_000


@pytest.mark.parametrize("kind", KINDS)
def test_round_trip_is_exact_and_training_goes_on_the_same(kind, trained_10k):
    """Ids, rows, both Adam slots (live rows: as saved; free rows: their
    initial 0) and predictions come back exact into a new model and
    optimizer with no slots yet; two more epochs then give both models the
    same predictions."""
    a, la, path = trained_10k(kind)
    b, lb = _model(kind, 10_000)
    tf.train.Checkpoint(model=b, optimizer=b.optimizer).read(path).expect_partial()
    ids_a, rows_a = la.export()
    ids_b, rows_b = lb.export()
    order_a, order_b = np.argsort(ids_a.numpy()), np.argsort(ids_b.numpy())
    np.testing.assert_array_equal(ids_b.numpy()[order_b], ids_a.numpy()[order_a])
    np.testing.assert_array_equal(rows_b.numpy()[order_b], rows_a.numpy()[order_a])
    np.testing.assert_array_equal(b.predict(IDS, verbose=0), a.predict(IDS, verbose=0))
    # The slot rows wait on the chief until the table meets the optimizer;
    # DynamicEviction's on_train_begin does that (use_optimizer), before the
    # first update.
    for model in (a, b):
        model.fit(IDS, Y, batch_size=5, epochs=2, verbose=0, shuffle=False,
                  callbacks=[DynamicEviction()])
    np.testing.assert_array_equal(b.predict(IDS, verbose=0), a.predict(IDS, verbose=0))
    for got, want in zip(_slots(b, lb), _slots(a, la)):
        np.testing.assert_array_equal(got, want)
    assert len(_slots(b, lb)) == 2


def test_restored_slots_go_in_at_use_optimizer_and_free_rows_are_fresh(tmp_path):
    """Into a model trained on other ids (its optimizer built): every row not
    in the checkpoint is a fresh row again (the table's initializer, zeros
    here; slots 0), the saved rows are as saved."""
    a, la, path = _trained("tf_keras", 1_000, tmp_path / "ckpt")
    i = tf_keras.Input([2], dtype=tf.int64)
    lb = DynamicEmbedding(DIM, capacity=1_000, name="emb", initializer="zeros")
    b = tf_keras.Model(i, tf_keras.layers.Dense(1)(tf_keras.layers.Flatten()(lb(i))))
    b.compile(tf_keras.optimizers.Adam(0.01), "mse")
    b.fit(IDS + 1, Y, batch_size=5, verbose=0, callbacks=[DynamicEviction()])
    tf.train.Checkpoint(model=b, optimizer=b.optimizer).read(path).assert_consumed()
    table = lb.dynamic_table
    rows, found = table.rows_of(tf.constant(np.sort(IDS.ravel())))
    assert found.numpy().all() and table.live_rows() == LIVE
    live = np.zeros(1_000, bool)
    live[rows.numpy()] = True
    slots_a = _slots(a, la)
    rows_a, _ = la.dynamic_table.rows_of(tf.constant(np.sort(IDS.ravel())))
    for got, want in zip(_slots(b, lb), slots_a):  # restored at once: b's optimizer is known
        np.testing.assert_array_equal(got[rows.numpy()], want[rows_a.numpy()])
        assert (got[~live] == 0).all()
    assert (table.table.numpy()[~live] == 0).all()


def test_unknown_optimizer_slots_are_saved_whole_and_come_back(tmp_path):
    """A table that never met its optimizer (a custom loop without
    use_optimizer) saves the optimizer's slots as any variable's, whole, and
    they come back exact."""
    model, layer = _model("tf_keras", 300)
    opt = model.optimizer
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(model(IDS, training=True))
    opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                            model.trainable_variables))
    path = tf.train.Checkpoint(model=model, optimizer=opt).write(str(tmp_path / "ckpt"))
    shapes = dict(tf.train.list_variables(path))
    assert sum(1 for s in shapes.values() if s == [300, DIM]) == 2  # Adam's m and v
    assert [0, LIVE, DIM] in shapes.values()  # the table's entry: no slot rows
    b, lb = _model("tf_keras", 300)
    b.optimizer.build(b.trainable_variables)
    tf.train.Checkpoint(model=b, optimizer=b.optimizer).read(path).assert_consumed()
    for got, want in zip(_slots(b, lb), _slots(model, layer)):
        np.testing.assert_array_equal(got, want)


def test_a_saved_model_still_holds_the_whole_table(tmp_path):
    """SavedModel exports save the table variable whole (a process with no
    cluster serves from it); tf.train.Checkpoint writes in the same process
    stay live rows only."""
    model, layer, _ = _trained("tf_keras", 400, tmp_path / "ckpt")
    tf.saved_model.save(model, str(tmp_path / "sm"))
    shapes = dict(tf.train.list_variables(str(tmp_path / "sm" / "variables" / "variables")))
    assert [400, DIM] in shapes.values()
    path = tf.train.Checkpoint(model=model).write(str(tmp_path / "again"))
    assert [400, DIM] not in dict(tf.train.list_variables(path)).values()
    served = tf.saved_model.load(str(tmp_path / "sm"))
    np.testing.assert_allclose(served(tf.constant(IDS)).numpy(),
                               model.predict(IDS, verbose=0), rtol=0, atol=1e-6)


def test_other_variables_are_saved_as_before(tmp_path):
    """Only the table and its slots are marked: in a process where a table
    exists (the save hooks installed), a plain variable, a ShardedVariable and
    an optimizer's slots of them write the same entries, shapes and values as
    TensorFlow does on its own."""
    _model("tf_keras", 100)  # a table: compat's save hooks are in place
    parts = [tf.Variable(tf.fill([2, 3], float(i + 1)), name=f"s/part_{i}") for i in range(2)]
    m = tf.Module()
    m.plain = tf.Variable(tf.range(6.0), name="plain")
    m.sharded = tf.__internal__.distribute.ShardedVariable(parts, name="s")
    opt = tf_keras.optimizers.Adagrad(0.1)
    opt.apply_gradients(zip([tf.ones([6]), tf.ones([2, 3]), tf.ones([2, 3])],
                            [m.plain] + parts))
    path = tf.train.Checkpoint(m=m, opt=opt).write(str(tmp_path / "ckpt"))
    reader = tf.train.load_checkpoint(path)
    got = {k: reader.get_tensor(k) for k, _ in tf.train.list_variables(path)
           if k != "_CHECKPOINTABLE_OBJECT_GRAPH"}
    step = 0.1 / np.sqrt(0.1 + 1.0)  # Adagrad's first step: accumulator 0.1 + 1^2
    want = {"m/plain/.ATTRIBUTES/VARIABLE_VALUE": np.arange(6.0) - step,
            "m/sharded/.ATTRIBUTES/VARIABLE_VALUE": np.repeat([[1.0], [1.0], [2.0], [2.0]],
                                                              3, 1) - step,
            "opt/_variables/1/.ATTRIBUTES/VARIABLE_VALUE": np.full([6], 1.1),
            "opt/_variables/2/.ATTRIBUTES/VARIABLE_VALUE": np.full([4, 3], 1.1)}
    for key, value in want.items():
        np.testing.assert_allclose(got[key], value, rtol=1e-6)
    assert sorted(k for k in got if k.startswith("m/")) == sorted(
        k for k in want if k.startswith("m/"))


class _StopAt(tf_keras.callbacks.Callback):
    """Fails the fit as epoch ``epoch`` (0-based) begins: a crash after the
    backup of the epoch before."""

    def __init__(self, epoch):
        super().__init__()
        self.epoch = epoch

    def on_epoch_begin(self, epoch, logs=None):
        if epoch == self.epoch:
            raise RuntimeError("crash")


def _crash_resume_and_compare(model, seed, backup, stop_at, after_crash=None):
    """Fits ``model()`` (-> (model, layer)) 4 epochs uninterrupted (a); again
    with ``backup()`` and ``stop_at``, which crashes it as epoch 3 begins
    (b); then a new model with another seed resuming b's backup (c). Checks
    that c ends with a's ids, rows, predictions, Adam slots and iterations
    (with min_count=3 each id gets its row in epoch 3, after the resume: the
    counting filter came back too)."""
    def fit(m, *callbacks):
        m.fit(IDS, Y, batch_size=5, epochs=4, verbose=0, shuffle=False,
              callbacks=[DynamicEviction(), *callbacks])

    seed(0)
    a, la = model()
    fit(a)
    seed(0)
    b, lb = model()
    with pytest.raises(RuntimeError, match="crash"):
        fit(b, backup(), stop_at)
    assert lb.stats()["live_rows"] == 0  # two sightings each: no id has a row yet
    if after_crash is not None:
        after_crash()
    seed(1)  # another Dense kernel: it must come back
    c, lc = model()
    fit(c, backup())
    assert lc.stats()["live_rows"] == la.stats()["live_rows"] == LIVE
    ids_a, rows_a = la.export()
    ids_c, rows_c = lc.export()
    order_a, order_c = np.argsort(ids_a.numpy()), np.argsort(ids_c.numpy())
    np.testing.assert_array_equal(ids_c.numpy()[order_c], ids_a.numpy()[order_a])
    np.testing.assert_allclose(rows_c.numpy()[order_c], rows_a.numpy()[order_a], rtol=1e-6)
    np.testing.assert_allclose(c.predict(IDS, verbose=0), a.predict(IDS, verbose=0), rtol=1e-6)
    for got, want in zip(_slots(c, lc), _slots(a, la)):
        np.testing.assert_allclose(got, want, rtol=1e-6)
    assert int(c.optimizer.iterations.numpy()) == int(a.optimizer.iterations.numpy()) == 20


def test_backup_and_restore_resumes_map_filter_rows_and_slots(tmp_path):
    """tf_keras BackupAndRestore: a fit that crashes after epoch 2 of 4 and
    a new model that resumes it end like an uninterrupted fit
    (_crash_resume_and_compare)."""
    def model():
        i = tf_keras.Input([2], dtype=tf.int64)
        # zeros: a row admitted after the resume starts the same in both runs (free
        # rows are not saved; they hold the initializer's values of the process).
        layer = DynamicEmbedding(DIM, capacity=10_000, min_count=3, initializer="zeros",
                                 name="emb")
        m = tf_keras.Model(i, tf_keras.layers.Dense(1)(tf_keras.layers.Flatten()(layer(i))))
        m.compile(tf_keras.optimizers.Adam(0.01), "mse")
        return m, layer

    backup = str(tmp_path / "backup")
    _crash_resume_and_compare(model, tf_keras.utils.set_random_seed,
                              lambda: tf_keras.callbacks.BackupAndRestore(backup), _StopAt(2))


class _StopAt3:
    """_StopAt for Keras 3 (made on first use: Keras 3 may be missing)."""

    def __new__(cls, epoch):
        import keras

        class StopAt(keras.callbacks.Callback):
            def on_epoch_begin(self, e, logs=None):
                if e == epoch:
                    raise RuntimeError("crash")
        return StopAt()


@pytest.mark.parametrize("backup", ["CheckpointBackup", "BackupAndRestore"])
def test_keras3_backup_resumes_map_filter_rows_and_slots(tmp_path, backup):
    """Keras 3: tf_asyncps.callbacks.CheckpointBackup (a tf.train.Checkpoint)
    and Keras's own BackupAndRestore (.weights.h5: the layer writes its live
    rows with their ids): a crashed fit resumed by a new model ends like an
    uninterrupted one (_crash_resume_and_compare)."""
    keras = pytest.importorskip("keras")
    import tf_asyncps
    from tf_asyncps.callbacks import CheckpointBackup
    Backup = CheckpointBackup if backup == "CheckpointBackup" else \
        keras.callbacks.BackupAndRestore
    path = str(tmp_path / "backup")

    def model():
        i = keras.Input((2,), dtype="int64")
        layer = tf_asyncps.keras3.DynamicEmbedding(DIM, capacity=10_000, min_count=3,
                                                   initializer="zeros", name="emb")
        m = keras.Model(i, keras.layers.Dense(1)(keras.layers.Flatten()(layer(i))))
        m.compile(keras.optimizers.Adam(0.01), "mse")
        return m, layer

    def after_crash():
        if Backup is CheckpointBackup:
            assert tf.train.latest_checkpoint(path).endswith("ckpt-2")

    _crash_resume_and_compare(model, keras.utils.set_random_seed, lambda: Backup(path),
                              _StopAt3(2), after_crash)
    assert not os.path.exists(path)  # delete_checkpoint (both callbacks' default)


def test_checkpoint_backup_refuses_bad_input_naming_the_fix(tmp_path):
    """An empty backup_dir fails when the callback is made; a tf_keras model
    at train begin, naming tf_keras's BackupAndRestore."""
    pytest.importorskip("keras")
    from tf_asyncps.callbacks import CheckpointBackup
    with pytest.raises(ValueError, match="backup_dir=''"):
        CheckpointBackup("")
    model, _ = _model("tf_keras", 100)
    with pytest.raises(ValueError, match="tf_keras.callbacks.BackupAndRestore"):
        model.fit(IDS, Y, batch_size=5, epochs=1, verbose=0,
                  callbacks=[CheckpointBackup(str(tmp_path / "b"))])


def test_a_whole_table_checkpoint_is_refused_naming_the_fix(tmp_path):
    """A checkpoint in the whole-table format that tf_asyncps wrote before
    commit a33e78b (the table's entry: count, filter, free, key, last,
    shards, waiting of every row) is refused at the restore, naming the
    commit, before TF reads a tensor; the layer keeps its rows."""
    model, layer = _model("tf_keras", 10)
    state = layer.dynamic_table.state
    old = {name: tf.zeros([10], tf.int64) for name in
           ("count", "filter", "free", "key", "last", "waiting")}
    old["shards"] = tf.zeros([1, 4], tf.int64)
    saved, state._asyncps_save = state._asyncps_save, lambda: old
    path = tf.train.Checkpoint(model=model).write(str(tmp_path / "old"))
    state._asyncps_save = saved
    names = {name.split("/")[-1] for name, _ in tf.train.list_variables(path)
             if "dynamic_table/state" in name}
    assert names == set(old)  # the old layout, at the same path

    b, lb = _model("tf_keras", 10)
    before = lb.dynamic_table.table.numpy()
    with pytest.raises(ValueError, match=r"whole-table format .* a33e78b") as err:
        tf.train.Checkpoint(model=b).read(path)
    assert "'emb'" in str(err.value) and "'free'" in str(err.value)
    np.testing.assert_array_equal(lb.dynamic_table.table.numpy(), before)
