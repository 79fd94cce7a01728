"""DynamicEmbedding in one process: exactness, admission, eviction, bad input.

Cluster behaviour (several workers and ps, every policy, checkpoints) is in
tests/test_dynamic_cluster.py.
"""


import numpy as np
import pytest
import tensorflow as tf
import tf_keras

from tf_asyncps.callbacks import DynamicEviction
from tf_asyncps.layers import DynamicEmbedding

RAW = np.array([10**12 + 7, -5, 3, 99, 2**40, 17, 123456789], np.int64)


def _data(ids, seed=0, n=64, width=3):
    rng = np.random.default_rng(seed)
    x = rng.choice(ids, size=(n, width))
    y = rng.normal(size=(n, 1)).astype("float32")
    return x, y


def _head(e):
    flat = tf_keras.layers.Flatten()(e)
    return tf_keras.layers.Dense(1, kernel_initializer="ones")(flat)


def _fit_predict(model, x, y, optimizer):
    model.compile(optimizer, "mse")
    model.fit(x, y, batch_size=8, epochs=2, verbose=0, shuffle=False)
    return model.predict(x, verbose=0)


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "adam"])
def test_equals_integer_lookup_and_embedding(optimizer):
    """Capacity >= distinct ids, zeros initializer: the same predictions as
    IntegerLookup + Embedding trained the same way (issue #25's target)."""
    x, y = _data(RAW)
    make = {"sgd": lambda: tf_keras.optimizers.SGD(0.1),
            "adagrad": lambda: tf_keras.optimizers.Adagrad(0.1),
            "adam": lambda: tf_keras.optimizers.Adam(0.01)}[optimizer]
    i = tf_keras.Input([3], dtype=tf.int64)
    dyn = tf_keras.Model(i, _head(DynamicEmbedding(4, capacity=16, initializer="zeros")(i)))
    i = tf_keras.Input([3], dtype=tf.int64)
    looked = tf_keras.layers.IntegerLookup(vocabulary=np.unique(x))(i)
    emb = tf_keras.layers.Embedding(len(np.unique(x)) + 1, 4, embeddings_initializer="zeros")
    ref = tf_keras.Model(i, _head(emb(looked)))
    got, want = _fit_predict(dyn, x, y, make()), _fit_predict(ref, x, y, make())
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    assert np.abs(want).max() > 0.01  # it trained


def test_string_ids_equal_string_lookup():
    words = np.array(["user:a", "user:b", "item/7", "\u00e9t\u00e9", "a b"], object)
    x, y = _data(words)
    i = tf_keras.Input([3], dtype=tf.string)
    dyn = tf_keras.Model(i, _head(DynamicEmbedding(2, capacity=8, key_dtype=tf.string,
                                                   initializer="zeros")(i)))
    i = tf_keras.Input([3], dtype=tf.string)
    looked = tf_keras.layers.StringLookup(vocabulary=sorted(set(x.ravel())))(i)
    ref = tf_keras.Model(i, _head(tf_keras.layers.Embedding(
        len(np.unique(x)) + 1, 2, embeddings_initializer="zeros")(looked)))
    got = _fit_predict(dyn, x, y, tf_keras.optimizers.SGD(0.1))
    want = _fit_predict(ref, x, y, tf_keras.optimizers.SGD(0.1))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)


def test_lookup_shapes_default_row_and_export():
    layer = DynamicEmbedding(3, capacity=4, initializer="ones")
    ids = tf.constant([[5, 6], [5, 7]], tf.int64)
    out = layer(ids, training=False)  # inference: nothing admitted, the default row
    assert out.shape == (2, 2, 3) and float(tf.reduce_max(tf.abs(out))) == 0.0
    out = layer(ids, training=True)
    assert out.shape == (2, 2, 3) and float(tf.reduce_min(out)) == 1.0
    got_ids, rows = layer.export()
    assert sorted(got_ids.numpy().tolist()) == [5, 6, 7] and rows.shape == (3, 3)
    assert layer.stats() == {"live_rows": 3, "capacity": 4, "evicted": 0, "refused": 0}


def test_min_count_admits_on_the_nth_sighting():
    layer = DynamicEmbedding(2, capacity=4, min_count=3, initializer="ones")
    ids = tf.constant([42, 42, 8], tf.int64)  # one sighting per call, repeats or not
    for call in range(1, 4):
        out = layer(ids, training=True)
        admitted = float(tf.reduce_min(out)) == 1.0
        assert admitted == (call == 3), call
    assert sorted(layer.export()[0].numpy().tolist()) == [8, 42]


def test_capacity_is_never_exceeded_refusals_are_counted():
    layer = DynamicEmbedding(2, capacity=3, initializer="ones")
    out = layer(tf.constant([1, 2, 3, 4, 5], tf.int64), training=True)
    assert int(tf.reduce_sum(tf.cast(tf.reduce_all(out == 1.0, axis=1), tf.int32))) == 3
    assert layer.stats()["live_rows"] == 3 and layer.stats()["refused"] == 2


def _sightings(layer, ids_per_step, step0=1):
    for step, ids in enumerate(ids_per_step, start=step0):
        layer.dynamic_table.lookup(tf.constant(ids, tf.int64), tf.constant(step, tf.int64),
                                   training=True)


@pytest.mark.parametrize("eviction,gone", [("lfu", 2), ("lru", 1)])
def test_eviction_pass_frees_the_coldest_row_for_a_waiting_id(eviction, gone):
    """Capacity 2. Id 1 is seen at steps 1-3, id 2 once at step 4, id 3 waits
    (refused) at steps 4 and 5. The pass at step 6: LFU frees id 2 (count 1
    below 3's 2 sightings); LRU frees id 1 (last seen at step 3, before the
    pass's period, steps 5-6)."""
    layer = DynamicEmbedding(1, capacity=2, eviction=eviction, evict_every=2,
                             initializer="zeros")
    layer.build([None])
    _sightings(layer, [[1], [1], [1], [2, 3], [3]])
    assert sorted(layer.export()[0].numpy().tolist()) == [1, 2]
    assert layer.stats()["refused"] == 2
    layer.dynamic_table.maybe_evict(tf.constant(6, tf.int64))
    assert layer.stats()["evicted"] == 1
    assert sorted(layer.export()[0].numpy().tolist()) == sorted({1, 2} - {gone})
    _sightings(layer, [[3]], step0=7)
    assert sorted(layer.export()[0].numpy().tolist()) == sorted({1, 2, 3} - {gone})
    # A pass runs once per period: a second call at step 7 does nothing.
    layer.dynamic_table.maybe_evict(tf.constant(7, tf.int64))
    assert layer.stats()["evicted"] == 1


def test_ttl_evicts_rows_unseen_for_ttl_steps_and_resets_them():
    layer = DynamicEmbedding(2, capacity=4, evict_every=10, ttl_steps=5, initializer="zeros")
    layer.build([None])
    _sightings(layer, [[1, 2], [2], [2]])  # id 1 last seen at step 1, id 2 at step 3
    table = layer.dynamic_table.table
    table.assign(tf.ones_like(table))  # as if trained
    layer.dynamic_table.maybe_evict(tf.constant(10, tf.int64))
    assert layer.export()[0].numpy().tolist() == []
    # Both were unseen for >= 5 steps at step 10: both go, their rows (0, 1)
    # get the initializer's zeros; the free rows are left alone.
    assert layer.stats()["evicted"] == 2
    np.testing.assert_array_equal(table.numpy(), [[0, 0], [0, 0], [1, 1], [1, 1]])


@pytest.mark.parametrize("kwargs,field", [
    (dict(capacity=0), r"capacity must be an int >= 1 \(the most rows .*\), got 0\."),
    (dict(capacity=10.5), r"capacity must be an int >= 1 .*, got 10\.5\."),
    (dict(min_count=0), r"min_count must be an int >= 1 \(sightings .*\), got 0\."),
    (dict(output_dim=-1), r"output_dim must be an int >= 1 \(the width of each row\), got -1\."),
    (dict(evict_every=0), r"evict_every must be an int >= 1 .*, got 0\."),
    (dict(eviction="fifo"), "eviction='fifo'"),
    (dict(ttl_steps=0), r"ttl_steps must be an int >= 1 .*, got 0\."),
])
def test_bad_arguments_name_the_field(kwargs, field):
    args = dict(output_dim=4, capacity=10)
    args.update(kwargs)
    with pytest.raises(ValueError, match=field):
        DynamicEmbedding(**args)


def test_bad_key_dtype_and_ids_name_the_fix():
    with pytest.raises(TypeError, match="key_dtype=tf.float32"):
        DynamicEmbedding(4, 10, key_dtype=tf.float32)
    layer = DynamicEmbedding(4, 10)
    with pytest.raises(TypeError, match="float32.*tf.cast"):
        layer(tf.constant([1.0, 2.0]), training=True)
    with pytest.raises(TypeError, match="string ids.*key_dtype=tf.string"):
        layer(tf.constant(["a"]), training=True)
    strings = DynamicEmbedding(4, 10, key_dtype=tf.string)
    with pytest.raises(TypeError, match="key_dtype=tf.string.*int64"):
        strings(tf.constant([1], tf.int64), training=True)


def test_get_config_round_trips():
    layer = DynamicEmbedding(4, 100, key_dtype=tf.string, min_count=2, eviction="lru",
                             evict_every=50, ttl_steps=500, name="users")
    again = DynamicEmbedding.from_config(layer.get_config())
    for field in ("output_dim", "capacity", "key_dtype", "min_count", "eviction",
                  "evict_every", "ttl_steps", "name"):
        assert getattr(again, field) == getattr(layer, field), field


def test_keras3_layer_one_process_equals_integer_lookup_and_embedding():
    keras = pytest.importorskip("keras")
    import tf_asyncps
    x, y = _data(RAW)

    def head(e):
        return keras.layers.Dense(1, kernel_initializer="ones")(keras.layers.Flatten()(e))

    i = keras.Input((3,), dtype="int64")
    layer = tf_asyncps.keras3.DynamicEmbedding(4, capacity=16, initializer="zeros")
    dyn = keras.Model(i, head(layer(i)))
    i = keras.Input((3,), dtype="int64")
    looked = keras.layers.IntegerLookup(vocabulary=np.unique(x))(i)
    ref = keras.Model(i, head(keras.layers.Embedding(len(np.unique(x)) + 1, 4,
                                                     embeddings_initializer="zeros")(looked)))
    out = []
    for m in (dyn, ref):
        m.compile(keras.optimizers.SGD(0.1), "mse")
        m.fit(x, y, batch_size=8, epochs=2, verbose=0, shuffle=False)
        out.append(m.predict(x, verbose=0))
    np.testing.assert_allclose(out[0], out[1], rtol=0, atol=1e-6)
    assert layer.stats()["live_rows"] == len(np.unique(x))


def _trained_tf_keras_model():
    i = tf_keras.Input([3], dtype=tf.int64)
    m = tf_keras.Model(i, _head(DynamicEmbedding(4, capacity=10)(i)))
    m.compile(tf_keras.optimizers.SGD(0.1), "mse")
    m.fit(np.array([[5, 6, 7]], np.int64), np.ones((1, 1), np.float32), verbose=0)
    return m


def test_tf_keras_keras_file_round_trip_keeps_ids_rows_and_predictions(tmp_path):
    """A tf_keras .keras file holds the live rows with their ids (the layer's
    save_own_variables); load_model rebuilds the map from them."""
    m = _trained_tf_keras_model()
    x = np.array([[5, 6, 7], [5, 9, 9]], np.int64)
    m.save(str(tmp_path / "m.keras"))
    loaded = tf_keras.models.load_model(str(tmp_path / "m.keras"))
    np.testing.assert_array_equal(loaded.predict(x, verbose=0), m.predict(x, verbose=0))
    assert sorted(loaded.layers[1].export()[0].numpy().tolist()) == [5, 6, 7]


KERAS3_IDS = {"int64": [[10**12, 5], [7, -3], [10**12, 7]],
              "string": [[b"a", b"bb"], [b"", b"ccc"], [b"a", b"ccc"]]}


@pytest.mark.parametrize("key_dtype", ["int64", "string"])
def test_keras3_files_keep_ids_rows_predictions_and_adam_state(tmp_path, key_dtype):
    """Keras 3 .keras (load_model) and .weights.h5 (load_weights into a model
    whose optimizer is built, as BackupAndRestore does): the same live ids,
    predictions equal, and one more epoch of Adam on both ends equal (the
    optimizer wrote its slots of the table whole; the rows went by global row)."""
    keras = pytest.importorskip("keras")
    import tf_asyncps

    def make():
        i = keras.Input((2,), dtype=key_dtype)
        layer = tf_asyncps.keras3.DynamicEmbedding(4, capacity=8, key_dtype=key_dtype,
                                                   name="emb")
        m = keras.Model(i, keras.layers.Dense(1)(keras.layers.Flatten()(layer(i))))
        m.compile(keras.optimizers.Adam(0.1), "mse")
        return m

    ids = tf.constant(KERAS3_IDS[key_dtype])
    data = tf.data.Dataset.from_tensor_slices(
        (ids, tf.constant([[1.0], [0.0], [0.5]]))).batch(3)
    a = make()
    a.fit(data, epochs=3, verbose=0, callbacks=[DynamicEviction()])
    a.save(str(tmp_path / "a.keras"))
    a.save_weights(str(tmp_path / "a.weights.h5"))
    b = keras.models.load_model(str(tmp_path / "a.keras"))
    c = make()
    c.optimizer.build(c.trainable_variables)
    c.load_weights(str(tmp_path / "a.weights.h5"))
    want = sorted(a.layers[1].export()[0].numpy().tolist())
    assert len(want) == 4
    for other in (b, c):
        assert sorted(other.layers[1].export()[0].numpy().tolist()) == want
        np.testing.assert_array_equal(other.predict(ids, verbose=0), a.predict(ids, verbose=0))
    c.fit(data, epochs=1, verbose=0, callbacks=[DynamicEviction()])
    a.fit(data, epochs=1, verbose=0, callbacks=[DynamicEviction()])
    np.testing.assert_allclose(c.predict(ids, verbose=0), a.predict(ids, verbose=0),
                               rtol=0, atol=1e-6)
    assert int(c.optimizer.iterations.numpy()) == int(a.optimizer.iterations.numpy()) == 4


def test_a_file_entry_of_another_layer_or_capacity_is_refused_naming_the_fix(tmp_path):
    """load_own_variables with the entries of a plain layer (its variables
    by position), or of a table of another capacity: a ValueError naming
    what the file holds and the fix."""
    layer = DynamicEmbedding(4, capacity=10)
    layer.build([None, 3])
    with pytest.raises(ValueError, match=r"holds \['0'\], not a DynamicEmbedding's "
                                         r"\['rows'.*variables by position"):
        layer.load_own_variables({"0": np.zeros([10, 4], np.float32)})
    m = _trained_tf_keras_model()  # capacity 10
    store = {}
    m.layers[1].save_own_variables(store)
    other = DynamicEmbedding(4, capacity=16)
    other.build([None, 3])
    with pytest.raises(ValueError, match="capacity 10, this layer 16: make the layer with "
                                         "capacity=10"):
        other.load_own_variables(store)


def test_a_keras_file_loads_in_a_new_process_after_import_tf_asyncps(fresh_process_facts):
    """A process that imports tf_keras, then tf_asyncps, loads a .keras file
    of a DynamicEmbedding model (the class is registered at that import;
    without it tf_keras failed "'str' object is not callable"): the model of
    _trained_tf_keras_model, saved here, predicts there as here (the
    session's fresh process, tests/fresh_process.py, step 2)."""
    facts, _ = fresh_process_facts
    assert isinstance(facts["keras_file_here"], list), facts["keras_file_here"]
    assert isinstance(facts["keras_file"], list), facts["keras_file"]
    np.testing.assert_array_equal(facts["keras_file"], facts["keras_file_here"])


def test_configs_load_without_custom_objects():
    """Both layer classes are registered (package "tf_asyncps")."""
    keras = pytest.importorskip("keras")
    import tf_asyncps
    i = keras.Input((3,), dtype="int64")
    k = keras.Model(i, keras.layers.Dense(1)(keras.layers.Flatten()(
        tf_asyncps.keras3.DynamicEmbedding(4, 10)(i))))
    again = keras.Model.from_config(k.get_config())
    assert type(again.layers[1]).__name__ == "DynamicEmbedding"
    m = _trained_tf_keras_model()
    assert type(tf_keras.Model.from_config(m.get_config()).layers[1]).__name__ == \
        "DynamicEmbedding"


def test_tf_keras_h5_round_trip_rebuilds_the_map_from_the_rows_keys(tmp_path):
    m = _trained_tf_keras_model()
    x = np.array([[5, 6, 7], [5, 9, 9]], np.int64)
    m.save(str(tmp_path / "m.h5"))  # weights only: keys and counts, not the index
    loaded = tf_keras.models.load_model(str(tmp_path / "m.h5"))
    np.testing.assert_array_equal(loaded.predict(x, verbose=0), m.predict(x, verbose=0))
    assert sorted(loaded.layers[1].export()[0].numpy().tolist()) == [5, 6, 7]


def test_ragged_sparse_and_bool_ids_are_refused_and_a_pass_takes_an_int_step():
    layer = DynamicEmbedding(2, capacity=4)
    with pytest.raises(TypeError, match="RaggedTensor.*to_tensor"):
        layer(tf.ragged.constant([[1, 2], [3]], dtype=tf.int64), training=True)
    with pytest.raises(TypeError, match="SparseTensor.*to_dense"):
        layer(tf.sparse.from_dense(tf.constant([[1, 0]], tf.int64)), training=True)
    with pytest.raises(TypeError, match="bool ids"):
        layer(tf.constant([True]), training=True)
    layer.dynamic_table.maybe_evict(10)  # a Python int
    assert layer.stats()["evicted"] == 0


def test_one_off_ids_do_not_evict_hot_ids_when_refused_ids_outnumber_the_rows():
    """Capacity 10 (5 rows a shard), 5 hot ids seen every step and 20 new
    one-off ids a step, a pass every 2 steps (a newcomer's report): the hot
    ids keep their rows. The counting filter is wider than a small shard,
    so 40 one-off ids a period do not pile onto a few slots and outrank them."""
    layer = DynamicEmbedding(1, capacity=10, evict_every=2, initializer="zeros")
    layer.build([None])
    hot = [1, 2, 3, 4, 5]
    fresh = iter(range(1000, 10**6))
    for step in range(1, 41):
        _sightings(layer, [hot + [next(fresh) for _ in range(20)]], step0=step)
        layer.dynamic_table.maybe_evict(tf.constant(step, tf.int64))
    kept = set(layer.export()[0].numpy().tolist())
    assert set(hot) <= kept, kept
    assert layer.stats()["live_rows"] <= 10


def test_min_count_rarely_admits_ids_seen_fewer_times_in_a_large_table():
    """min_count=3, capacity 1,000: at most 2 of 500 ids seen twice are
    admitted (1 measured). An early admission needs both of an id's two
    filter slots shared (a newcomer saw 221 of 500 with one hash and a filter
    as long as a 500-row shard; one hash and 65,536 slots let 12 in)."""
    layer = DynamicEmbedding(1, capacity=1000, min_count=3, initializer="zeros")
    layer.build([None])
    ids = list(range(10**9, 10**9 + 500))
    _sightings(layer, [ids, ids])
    assert layer.stats()["live_rows"] <= 2  # measured: 1


def _one_process_fit(keras_name, callbacks):
    """One-process fits, capacity 4, Adagrad, a pass every 2 steps: ids 0-3
    for 4 steps, then ids 4-7 for 12 steps. Returns (layer, optimizer)."""
    if keras_name == "keras3":
        import keras as k
        from tf_asyncps.keras3 import DynamicEmbedding as Layer
    else:
        k, Layer = tf_keras, DynamicEmbedding
    layer = Layer(2, capacity=4, evict_every=2, initializer="zeros")
    i = k.Input([3], dtype="int64")
    out = k.layers.Dense(1, kernel_initializer="ones")(k.layers.Flatten()(layer(i)))
    model = k.Model(i, out)
    opt = k.optimizers.Adagrad(0.1)
    model.compile(opt, "mse")
    y = np.ones([16, 1], "float32")
    for first, epochs in ((0, 2), (4, 6)):  # 2 batches of 8 a epoch
        x = (first + np.arange(48).reshape(16, 3) % 4).astype("int64")
        model.fit(x, y, batch_size=8, epochs=epochs, verbose=0, shuffle=False,
                  callbacks=callbacks)
    return layer, opt


@pytest.mark.parametrize("keras_name", ["tf_keras", "keras3"])
def test_dynamic_eviction_callback_runs_passes_in_one_process(keras_name):
    from tf_asyncps.callbacks import DynamicEviction
    from tf_asyncps.dynamic.table import optimizer_slots
    layer, opt = _one_process_fit(keras_name, [DynamicEviction()])
    stats = layer.stats()
    assert stats["evicted"] == 4 and stats["live_rows"] == 4, stats
    # The later ids took the rows of the earlier ones.
    assert sorted(layer.export()[0].numpy().tolist()) == [4, 5, 6, 7]
    table = layer.dynamic_table
    shard = table.shards[0]
    # Lookups read the optimizer's iterations as their step (16 steps in all).
    assert int(shard.last.numpy().max()) == 15
    # The passes reset the slots the callback finds: Adagrad's accumulator.
    assert len(optimizer_slots(opt, shard.var)) == 1


def test_without_the_callback_a_full_table_keeps_its_first_ids():
    layer, _ = _one_process_fit("tf_keras", [])
    assert layer.stats()["evicted"] == 0
    assert sorted(layer.export()[0].numpy().tolist()) == [0, 1, 2, 3]


def test_dynamic_eviction_refuses_a_model_without_a_dynamic_table():
    from tf_asyncps.callbacks import DynamicEviction
    model = tf_keras.Sequential([tf_keras.Input([2]), tf_keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    with pytest.raises(ValueError, match="no DynamicEmbedding layer; remove the callback"):
        model.fit(np.ones([4, 2]), np.ones([4, 1]), verbose=0, callbacks=[DynamicEviction()])


def test_eviction_resets_only_its_own_layers_slots_not_a_layer_whose_name_contains_it():
    """Layers 'user' and 'power_user' (equal shapes, one device): the slots
    of 'user' are not those of 'power_user' (a newcomer saw an eviction in
    'user' reset 'power_user''s Adagrad accumulators)."""
    from tf_asyncps.dynamic.table import optimizer_slots
    i = tf_keras.Input([2], dtype=tf.int64)
    u = DynamicEmbedding(4, capacity=6, name="user")
    pu = DynamicEmbedding(4, capacity=6, name="power_user")
    h = tf_keras.layers.Concatenate()([u(i[:, :1]), pu(i[:, 1:])])
    m = tf_keras.Model(i, tf_keras.layers.Dense(1)(tf_keras.layers.Flatten()(h)))
    m.compile(tf_keras.optimizers.Adagrad(0.1), "mse")
    m.fit(np.array([[1, 2]] * 4, "int64"), np.ones([4, 1], "float32"), verbose=0)
    for layer in (u, pu):
        var = layer.dynamic_table.shards[0].var
        names = [s.name for s, _ in optimizer_slots(m.optimizer, var)]
        assert len(names) == 1 and f"/{layer.name}/embeddings" in names[0], names


def test_ttl_and_lru_count_the_step_just_run_as_seen():
    """Lookups record the step they read (s), the pass runs at the step after
    the update (s + 1). ttl_steps=1 keeps rows seen in the last step; LRU
    with evict_every=1 keeps a hot id against a one-off (both evicted the
    hot rows at every pass before)."""
    ttl = DynamicEmbedding(4, capacity=4, evict_every=1, ttl_steps=1)
    lru = DynamicEmbedding(4, capacity=2, evict_every=1, eviction="lru")
    for layer, extra in ((ttl, lambda s: []), (lru, lambda s: [100 + s])):
        layer.build([None])
        step = tf.Variable(0, dtype=tf.int64)
        layer.use_step(step)
        for s in range(6):
            layer(tf.constant([1, 2] + extra(s), tf.int64), training=True)
            step.assign_add(1)
            layer.dynamic_table.maybe_evict(step)
        assert sorted(layer.export()[0].numpy().tolist()) == [1, 2], layer.name
    assert ttl.stats()["evicted"] == 0
    # ttl_steps=1: a row unseen in the last step goes at the next pass.
    ttl(tf.constant([1], tf.int64), training=True)
    step = ttl.dynamic_step
    step.assign_add(1)
    ttl.dynamic_table.maybe_evict(step)
    assert ttl.export()[0].numpy().tolist() == [1]


def test_dynamic_eviction_added_on_a_later_fit_still_gives_the_lookups_their_step():
    from tf_asyncps.callbacks import DynamicEviction
    layer = DynamicEmbedding(2, capacity=5, evict_every=2, ttl_steps=2)
    i = tf_keras.Input([1], dtype="int64")
    m = tf_keras.Model(i, tf_keras.layers.Dense(1)(tf_keras.layers.Flatten()(layer(i))))
    m.compile(tf_keras.optimizers.Adagrad(0.1), "mse")
    x, y = np.arange(32).reshape(32, 1) % 4, np.ones([32, 1], "float32")
    # Unshuffled: every batch of 8 holds each of the 4 ids twice (shuffled, a
    # batch could miss one for 2 steps and a TTL pass evict it: 2 runs in 3).
    m.fit(x, y, batch_size=8, verbose=0, shuffle=False)  # traced without the callback
    m.fit(x, y, batch_size=8, verbose=0, shuffle=False, callbacks=[DynamicEviction()])
    # 4 hot ids, seen every step: they stay, and their last step is the 8th.
    assert layer.stats()["live_rows"] == 4 and layer.stats()["evicted"] == 0
    assert int(layer.dynamic_table.shards[0].last.numpy().max()) == 7


def test_use_step_before_build_and_numpy_ints_are_fine():
    layer = DynamicEmbedding(np.int64(2), capacity=np.int32(10))
    assert layer.dynamic_step is None and layer.get_config()["capacity"] == 10
    layer.use_step(tf.Variable(0, dtype=tf.int64))
    assert layer.dynamic_step is not None


def test_keras3_fit_under_the_strategy_refuses_dynamic_eviction_with_the_fix():
    from tf_asyncps.callbacks import DynamicEviction
    from tf_asyncps.callbacks.keras3 import check_callbacks
    with pytest.raises(ValueError, match="ps tasks run them after the updates: remove the"):
        check_callbacks([DynamicEviction()])


@pytest.mark.parametrize("legacy", [False, True], ids=["tf_keras", "tf_keras_legacy"])
def test_each_shard_gets_its_own_slots_even_two_shards_on_one_ps(legacy):
    """Shards part_0 and part_1 of equal shape on one device (4 shards on 2
    ps tasks): an eviction in part_1 resets part_1's slots, not part_0's
    (before: both shards' slots for each, the first one used; legacy
    optimizers: none found, so nothing reset)."""
    from tf_asyncps.dynamic.table import optimizer_slots
    parts = [tf.Variable(tf.zeros([3, 2]), name=f"emb/table/part_{i}") for i in range(2)]
    table = tf.__internal__.distribute.ShardedVariable(parts)  # noqa: F841 (kept: slots find it)
    optimizers = tf_keras.optimizers.legacy if legacy else tf_keras.optimizers
    for opt, kinds in ((optimizers.Adagrad(0.1, initial_accumulator_value=0.25), [0.25]),
                       (optimizers.Adam(0.1), [0.0, 0.0])):
        opt.apply_gradients(zip([tf.ones([3, 2])] * 2, parts))
        for i, part in enumerate(parts):
            slots = optimizer_slots(opt, part)
            assert [init for _, init in slots] == kinds
            assert all(f"part_{i}" in s.name and f"part_{1 - i}" not in s.name
                       for s, _ in slots), [s.name for s, _ in slots]


def test_uint64_ids_are_refused_naming_the_bitcast():
    """uint64 ids were cast silently (ids >= 2**63 came back from export() as
    negative int64): refused, naming tf.bitcast, which keeps them distinct."""
    layer = DynamicEmbedding(2, capacity=4, initializer="zeros")
    with pytest.raises(TypeError, match=r"uint64 ids.*tf.bitcast\(ids, tf.int64\)"):
        layer(tf.constant([2**63 + 5, 1], tf.uint64), training=True)
    assert layer.stats()["live_rows"] == 0
    layer(tf.bitcast(tf.constant([2**63 + 5, 1], tf.uint64), tf.int64), training=True)
    ids = tf.bitcast(layer.export()[0], tf.uint64).numpy().tolist()
    assert sorted(ids) == [1, 2**63 + 5]


def _reset_every_row(layer, capacity):
    """Admits ``capacity`` ids at step 0, then a pass at step 5 (traced, as
    on a cluster) evicts them all (ttl_steps=1); returns (rows before, after)."""
    layer(tf.range(capacity, dtype=tf.int64), training=True)
    before = layer.dynamic_table.table.numpy().copy()

    @tf.function
    def evict():
        layer.dynamic_table.maybe_evict(tf.constant(5, tf.int64))

    evict()
    assert layer.stats()["evicted"] == capacity and layer.stats()["live_rows"] == 0
    return before, layer.dynamic_table.table.numpy()


@pytest.mark.parametrize("keras_name", ["tf_keras", "keras3"])
@pytest.mark.parametrize("initializer", ["he_normal", "glorot_uniform"])
def test_fan_initializers_reset_rows_with_the_tables_fans(keras_name, initializer):
    """he_normal / glorot_uniform (the keras-io example's) failed at the first
    traced pass (tf_keras: len is not well defined for a symbolic Tensor;
    Keras 3: OperatorNotAllowedInGraphError). A reset row's elements now come
    from the initializer's distribution with the fans of the whole table
    [capacity, dim], as the first values: he_normal std sqrt(2 / capacity)
    (cut at 2 / 0.8796 of it), glorot_uniform on +-sqrt(6 / (capacity + dim))."""
    capacity, dim = 2000, 32
    if keras_name == "keras3":
        keras = pytest.importorskip("keras")
        import tf_asyncps
        layer = tf_asyncps.keras3.DynamicEmbedding(dim, capacity, initializer=initializer,
                                                   ttl_steps=1, evict_every=1)
        del keras
    else:
        layer = DynamicEmbedding(dim, capacity, initializer=initializer, ttl_steps=1,
                                 evict_every=1)
    before, after = _reset_every_row(layer, capacity)
    if initializer == "he_normal":
        std, bound = np.sqrt(2 / capacity), 2 * np.sqrt(2 / capacity) / .87962566103423978
    else:
        bound = np.sqrt(6 / (capacity + dim))
        std = bound / np.sqrt(3)
    for values in (before, after):  # Keras's first draw, then the pass's
        assert abs(values.std() / std - 1) < 0.03, (values.std(), std)
        assert abs(values.mean()) < 0.03 * std
        assert np.abs(values).max() <= bound * (1 + 1e-6)
        assert np.abs(values).max() > 0.9 * bound
    assert (after != before).mean() > 0.99  # new values, drawn by the pass


@pytest.mark.parametrize("keras_name", ["tf_keras", "keras3"])
def test_initializers_that_cannot_draw_rows_alone_are_refused_when_made(keras_name):
    """Orthogonal and Identity (a row depends on the others) are refused when
    the layer is made, naming those that work; a callable taking a shape
    tensor is used as it is."""
    if keras_name == "keras3":
        pytest.importorskip("keras")
        import tf_asyncps
        make = tf_asyncps.keras3.DynamicEmbedding
    else:
        make = DynamicEmbedding
    for name in ("orthogonal", "identity"):
        with pytest.raises(ValueError, match=rf"initializer='{name}'.*cannot draw rows alone.*"
                                             r"Use one of zeros, ones, Constant.*he_normal"):
            make(4, 8, initializer=name)
    layer = make(4, 3, initializer=lambda shape, dtype=None: tf.fill(shape, 0.25), ttl_steps=1,
                 evict_every=1)
    before, after = _reset_every_row(layer, 3)
    assert np.all(before == 0.25) and np.all(after == 0.25)
