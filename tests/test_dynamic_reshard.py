"""A DynamicTable restored onto another number of shards, in one process
(the table a ``ShardedVariable`` made by hand; on a cluster:
tests/test_dynamic_cluster.py::test_checkpoint_restores_map_rows_and_predictions)."""

import numpy as np
import pytest
import tensorflow as tf

from tf_asyncps.dynamic import reshard
from tf_asyncps.dynamic.table import DynamicTable, _bucket

IDS = np.array([3, 17, -5, 99, 10**12 + 7, 8, 9, 42], np.int64)


def test_plan_keeps_home_rows_moves_the_others_to_the_lowest_free_rows():
    # Shards of 3 and 2 rows: rows 0-2 and 3-4.
    rows = tf.constant([0, 1, 3, 4], tf.int64)
    home = tf.constant([0, 1, 0, 1], tf.int64)
    score = tf.constant([5, 5, 5, 5], tf.int64)
    # Row 0 stays; row 3's id goes to shard 0's lowest free row (1); row 4
    # stays; row 1's id goes to shard 1's free row (3).
    assert reshard.plan_rows(rows, home, score, [3, 2]).numpy().tolist() == [0, 3, 1, 4]


def test_plan_full_home_shard_keeps_the_highest_scores():
    # Four ids for shard 0's 2 rows: scores 1, 7, 7, 3 -> the two 7s stay,
    # the one already home (row 1) first, then the other takes row 0.
    rows = tf.constant([0, 1, 2, 3], tf.int64)
    home = tf.constant([0, 0, 0, 0], tf.int64)
    score = tf.constant([1, 7, 7, 3], tf.int64)
    assert reshard.plan_rows(rows, home, score, [2, 2]).numpy().tolist() == [-1, 1, 0, -1]


def _table(sizes, key_dtype=tf.int64, eviction="lfu", dim=3):
    parts = [tf.Variable(tf.zeros([s, dim]), name=f"t/part_{i}") for i, s in enumerate(sizes)]
    table = tf.__internal__.distribute.ShardedVariable(parts, name="t")
    m = tf.Module()
    m.table = table
    m.dt = DynamicTable(table, key_dtype=key_dtype, min_count=1, eviction=eviction,
                        evict_every=100, ttl_steps=None, name="emb",
                        initializer=lambda shape: tf.zeros(shape))
    return m


def _trained(sizes, ids, key_dtype=tf.int64):
    m = _table(sizes, key_dtype)
    for k in range(3):  # the first ids seen most often (LFU rank)
        m.dt.lookup(ids[:len(ids) - k], step=tf.constant(k, tf.int64), training=True)
    for s in m.dt.shards:
        s.var.assign(tf.random.stateless_normal(s.var.shape, [1, s.offset]))
    return m


def _invariants(m):
    """(ids of the live rows, each once, each on its home shard)."""
    n, out = len(m.dt.shards), []
    for i, s in enumerate(m.dt.shards):
        live = np.flatnonzero(s.count.numpy() > 0)
        keys = s.key.numpy()[live]
        assert (_bucket(tf.constant(keys), n).numpy() == i).all() or n == 1
        assert int(s.index.size()) == int(s.live.numpy()) == len(live)
        assert int(s.free_rows.numpy()) == s.rows - len(live)
        free = s.free.numpy()[:s.rows - len(live)]
        assert sorted(free.tolist()) == np.flatnonzero(s.count.numpy() == 0).tolist()
        out += keys.tolist()
    assert len(out) == len(set(out))
    return out


@pytest.mark.parametrize("sizes", [[10, 10, 10], [30], [15, 15]],
                         ids=["2to3", "2to1", "same"])
def test_restore_onto_other_shards_keeps_every_id_and_row(tmp_path, sizes):
    a = _trained([15, 15], IDS)
    want = a.dt.lookup(IDS).numpy()
    path = tf.train.Checkpoint(m=a).write(str(tmp_path / "ckpt"))
    b = _table(sizes)
    tf.train.Checkpoint(m=b).read(path)
    # Before any lookup: the rows' keys and values by global row already.
    assert sorted(b.dt.export()[0].numpy().tolist()) == sorted(IDS.tolist())
    np.testing.assert_array_equal(b.dt.lookup(IDS).numpy(), want)  # re-homes first
    assert sorted(_invariants(b)) == sorted(IDS.tolist())
    stats = b.dt.reshard_stats()
    if sizes == [15, 15]:
        assert stats == {"from_shards": 0, "moved": 0, "dropped": 0}
    else:
        assert stats["from_shards"] == 2 and stats["dropped"] == 0
        assert (stats["moved"] > 0) == (len(sizes) == 3)  # one shard: every id home
    assert b.dt.stats()["evicted"] == 0
    # Training goes on: a new id is admitted, the others keep their rows.
    b.dt.lookup(tf.constant([1234, 3], tf.int64), step=tf.constant(5, tf.int64), training=True)
    np.testing.assert_array_equal(b.dt.lookup(IDS).numpy(), want)
    assert sorted(_invariants(b)) == sorted(IDS.tolist() + [1234])


def test_a_read_onto_more_shards_leaves_only_the_new_maps_unmatched(tmp_path):
    """StepBackup's check of a read (compat.checkpoint.assert_matched_except):
    2 shards read onto 3 leave shard 2's id -> row map unmatched, which
    TensorFlow's assert_existing_objects_matched refuses; allowed, nothing
    else is unmatched; not allowed, TensorFlow's error stands."""
    from tf_asyncps.compat import checkpoint as checkpoint_compat
    path = tf.train.Checkpoint(m=_trained([15, 15], IDS)).write(str(tmp_path / "ckpt"))
    b = _table([10, 10, 10])
    status = tf.train.Checkpoint(m=b).read(path)
    with pytest.raises(AssertionError, match="Found 1 Python objects"):
        status.assert_existing_objects_matched()
    checkpoint_compat.assert_matched_except(status, [b.dt.shards[2].index])
    with pytest.raises(AssertionError, match="Found 1 Python objects"):
        checkpoint_compat.assert_matched_except(status, [b.dt.shards[1].index])
    assert int(b.dt.shards[0].marks.pending.numpy()) == 2


def _keras3_holding(m):
    """A built Keras 3 model holding ``m``'s sharded table and its
    DynamicTable on a layer (as a DynamicEmbedding's)."""
    keras = pytest.importorskip("keras")

    class Held(keras.Model):
        def __init__(self):
            super().__init__()
            self.table = m.table
            self.emb = keras.layers.Layer()
            self.emb.dynamic_table = m.dt

        def call(self, ids):
            return m.dt.lookup(ids)

    model = Held()
    model.build((None,))
    return model


@pytest.mark.parametrize("sizes", [[10, 10, 10], [15, 15]], ids=["2to3", "same"])
def test_checkpoint_backup_restores_onto_more_shards(tmp_path, sizes):
    """Keras 3 CheckpointBackup (its restore check as StepBackup's): a
    backup written over 2 shards resumes onto 3 (shard 2's map in no
    checkpoint) and onto 2; every id keeps its row after the re-homing."""
    from tf_asyncps.callbacks import CheckpointBackup
    a = _trained([15, 15], IDS)
    want = a.dt.lookup(IDS).numpy()
    backup = CheckpointBackup(str(tmp_path / "b"), delete_checkpoint=False)
    backup.set_model(_keras3_holding(a))
    backup.on_train_begin()
    backup.on_epoch_end(0)
    b = _table(sizes)
    resume = CheckpointBackup(str(tmp_path / "b"), delete_checkpoint=False)
    resume.set_model(_keras3_holding(b))
    resume.on_train_begin()
    assert int(b.dt.shards[0].marks.pending.numpy()) == (2 if len(sizes) == 3 else 0)
    np.testing.assert_array_equal(b.dt.lookup(IDS).numpy(), want)
    assert sorted(_invariants(b)) == sorted(IDS.tolist())


def test_three_to_two_with_string_ids(tmp_path):
    ids = np.array([str(i) for i in IDS])
    a = _trained([10, 10, 10], tf.constant(ids), key_dtype=tf.string)
    want = a.dt.lookup(tf.constant(ids)).numpy()
    path = tf.train.Checkpoint(m=a).write(str(tmp_path / "ckpt"))
    b = _table([15, 15], key_dtype=tf.string)
    tf.train.Checkpoint(m=b).read(path)
    np.testing.assert_array_equal(b.dt.lookup(tf.constant(ids)).numpy(), want)
    assert sorted(k.decode() for k in _invariants(b)) == sorted(ids.tolist())
    assert b.dt.reshard_stats()["from_shards"] == 3


def test_a_full_home_shard_evicts_its_coldest_ids(tmp_path):
    """8 ids in 2 x 5 rows onto 4 + 3 + 3 rows: whatever shard gets more ids
    than rows keeps the most seen (LFU), evicts the others (counted)."""
    a = _trained([5, 5], IDS)
    want = dict(zip(IDS.tolist(), a.dt.lookup(IDS).numpy()))
    path = tf.train.Checkpoint(m=a).write(str(tmp_path / "ckpt"))
    b = _table([4, 3, 3])
    tf.train.Checkpoint(m=b).read(path)
    b.dt.lookup(IDS[:1])
    home = _bucket(tf.constant(IDS), 3).numpy()
    over = sum(max(0, int((home == t).sum()) - size) for t, size in enumerate([4, 3, 3]))
    assert over > 0  # the ids above do overflow a shard
    kept = _invariants(b)
    assert b.dt.reshard_stats()["dropped"] == over == b.dt.stats()["evicted"]
    assert len(kept) == len(IDS) - over
    # The evicted ids are the least seen of their home shard.
    counts = dict(zip(IDS.tolist(), [3, 3, 3, 3, 3, 3, 2, 1]))
    for t in range(3):
        mine = [i for i, h in zip(IDS.tolist(), home) if h == t]
        gone = [i for i in mine if i not in kept]
        if gone:
            assert max(counts[i] for i in gone) <= min(counts[i] for i in mine if i in kept)
    got = b.dt.lookup(tf.constant(kept, tf.int64)).numpy()
    np.testing.assert_array_equal(got, np.stack([want[i] for i in kept]))


def test_slots_move_with_their_rows(tmp_path):
    """move_slots (the engine's before-update hook on a cluster) gives each
    id its slot row back, and freed rows their initial value."""
    a = _trained([15, 15], IDS)
    slots_a = [tf.Variable(s.var * 10.0) for s in a.dt.shards]  # a slot per shard
    rows_a, _ = a.dt.rows_of(tf.constant(IDS))
    want = tf.gather(tf.concat(slots_a, 0), rows_a).numpy()
    path = tf.train.Checkpoint(m=a, slots=tf.__internal__.distribute.ShardedVariable(
        slots_a, name="s")).write(str(tmp_path / "ckpt"))
    b = _table([10, 10, 10])
    slots_b = [tf.Variable(tf.fill(s.var.shape, 7.0)) for s in b.dt.shards]
    tf.train.Checkpoint(m=b, slots=tf.__internal__.distribute.ShardedVariable(
        slots_b, name="s")).read(path)
    b.dt.lookup(IDS[:1])  # re-homes the rows; the slots wait
    assert [bool(s.marks.slots_pending.numpy()) for s in b.dt.shards] == [True] * 3
    reshard.prepare_slots(b.dt, [(slots_b, 0.5)])
    assert [bool(s.marks.slots_pending.numpy()) for s in b.dt.shards] == [False] * 3
    rows_b, _ = b.dt.rows_of(tf.constant(IDS))
    full = tf.concat(slots_b, 0).numpy()
    np.testing.assert_array_equal(full[rows_b.numpy()], want)
    freed = tf.io.parse_tensor(b.dt.reshard.plan[2], tf.int64).numpy()
    assert (full[freed] == 0.5).all() and b.dt.reshard_stats()["moved"] > 0


def test_tf_keras_saved_model_reload_rebuilds_the_metadata_from_the_map(tmp_path):
    """A SavedModel holds the map, not the rows' metadata (saved by the
    table as its own tensors): a model loaded from one rebuilds keys, counts
    and free rows from the map at its first lookup, and goes on training
    without giving a row to two ids."""
    import tf_keras

    from tf_asyncps.layers import DynamicEmbedding
    i = tf_keras.Input([3], dtype=tf.int64)
    m = tf_keras.Model(i, tf_keras.layers.Dense(1)(tf_keras.layers.Flatten()(
        DynamicEmbedding(4, capacity=10)(i))))
    m.compile(tf_keras.optimizers.SGD(0.1), "mse")
    m.fit(np.array([[5, 6, 7]], np.int64), np.ones((1, 1), np.float32), verbose=0)
    m.save(str(tmp_path / "sm"))
    loaded = tf_keras.models.load_model(str(tmp_path / "sm"))
    x = np.array([[5, 6, 7], [5, 9, 9]], np.int64)
    np.testing.assert_array_equal(loaded.predict(x, verbose=0), m.predict(x, verbose=0))
    table = loaded.layers[1].dynamic_table
    assert sorted(table.export()[0].numpy().tolist()) == [5, 6, 7]
    table.lookup(tf.constant([8, 5], tf.int64), step=tf.constant(1, tf.int64), training=True)
    assert sorted(_invariants(type("M", (), {"dt": table})())) == [5, 6, 7, 8]


def test_a_restore_after_the_step_was_traced_fails_with_the_fix(tmp_path):
    a = _trained([15, 15], IDS)
    path = tf.train.Checkpoint(m=a).write(str(tmp_path / "ckpt"))
    b = _table([10, 10, 10])
    step = tf.function(lambda: b.dt.lookup(tf.constant(IDS), step=tf.constant(1, tf.int64),
                                           training=True))
    step()  # traced before the restore: it holds no re-homing
    tf.train.Checkpoint(m=b).read(path)
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"after this step function was traced: call "
                             r"layer.dynamic_table.prepare\(\) after the restore"):
        step()
    b.dt.prepare()
    step()
    assert sorted(_invariants(b)) == sorted(IDS.tolist())
