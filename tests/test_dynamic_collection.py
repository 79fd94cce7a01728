"""DynamicEmbeddingCollection (issue 39 item 2): many features' raw ids in one
dynamic table, in one process.

Two features' equal raw ids get different rows; training equals F separate
DynamicEmbedding layers trained the same way (SGD, Adagrad; tf_keras and
Keras 3); a step makes one de-duplicated lookup of the one table whatever F
is; raw ids outside [0, 2**56) and bad arguments are refused naming the
feature or the argument; config, checkpoint and Keras file round trips;
export per feature. Under the strategy (2 ps, the table split in two):
tests/test_embedding_collection.py's shared cluster scenario.
"""

import re

import numpy as np
import pytest
import tensorflow as tf
import tf_keras

import tf_asyncps
from tf_asyncps.layers import dynamic_collection as dc_lib
from tf_asyncps.layers import dynamic_embedding as de_lib

keras = pytest.importorskip("keras")

F, DIM = 3, 4
# Raw ids of every size the keys take, shared by the features.
RAW = np.array([0, 7, 2**40, 10**12 + 7, 2**56 - 1], np.int64)
KERASES = {"tf_keras": (tf_keras, dc_lib.DynamicEmbeddingCollection, de_lib.DynamicEmbedding),
           "keras3": (keras, dc_lib.keras3_layer(), de_lib.keras3_layer())}


def _data(n=48, seed=0):
    rng = np.random.default_rng(seed)
    return rng.choice(RAW, size=(n, F)), rng.normal(size=(n, 1)).astype("float32")


@pytest.mark.parametrize("keras_name", list(KERASES))
def test_two_features_equal_raw_ids_are_different_rows(keras_name):
    layer = KERASES[keras_name][1](F, DIM, capacity=10)
    ids = np.array([[7, 7, 7], [7, 7, 2**56 - 1]], np.int64)
    out = np.asarray(layer(ids, training=True))
    assert out.shape == (2, F, DIM) and out.dtype == np.float32
    assert layer.stats()["live_rows"] == 4
    # Each column's 7 is its own row (the uniform initializer draws each row).
    assert len({tuple(out[0, f]) for f in range(F)}) == F
    np.testing.assert_array_equal(out[1, :2], out[0, :2])
    keys, _ = layer.dynamic_table.export()
    assert sorted(keys.numpy().tolist()) == [7, 2**56 + 7, 2 * 2**56 + 7, 3 * 2**56 - 1]
    got = layer.export()
    assert sorted(got) == [0, 1, 2]
    assert [sorted(got[f][0].tolist()) for f in range(F)] == [[7], [7], [7, 2**56 - 1]]
    for f in range(F):
        assert got[f][1].shape == (len(got[f][0]), DIM)
        np.testing.assert_array_equal(got[f][1][got[f][0] == 7][0], out[0, f])


def _models(keras_name):
    """(collection model, model of F DynamicEmbedding layers), zero rows."""
    K, cls, single = KERASES[keras_name]

    def head(rows):
        return K.layers.Dense(1, kernel_initializer="ones")(rows)

    i = K.Input((F,), dtype="int64")
    one = K.Model(i, head(K.layers.Flatten()(
        cls(F, DIM, capacity=3 * len(RAW), initializer="zeros", name="tables")(i))))
    i = K.Input((F,), dtype="int64")
    cols = [single(DIM, capacity=len(RAW), initializer="zeros", name=f"table_{f}")(
        K.layers.Lambda(lambda x, f=f: x[:, f], output_shape=lambda s: s[:1])(i))
        for f in range(F)]
    many = K.Model(i, head(K.layers.Concatenate()(cols)))  # feature by feature, as Flatten
    return one, many


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad"])
@pytest.mark.parametrize("keras_name", list(KERASES))
def test_training_equals_separate_dynamic_embedding_layers(keras_name, optimizer):
    K = KERASES[keras_name][0]
    x, y = _data()
    make = {"sgd": lambda: K.optimizers.SGD(0.1), "adagrad": lambda: K.optimizers.Adagrad(0.1)}
    one, many = _models(keras_name)
    preds = []
    for m in (one, many):
        # Eager steps: the same updates without tracing 8 models' steps
        # (a traced step: the checkpoint test below, and the cluster test).
        m.compile(make[optimizer](), "mse", run_eagerly=True)
        m.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False)  # 6 steps
        preds.append(np.asarray(m(x)))
    np.testing.assert_allclose(preds[0], preds[1], rtol=0, atol=1e-6)
    assert np.abs(preds[1]).max() > 0.01  # it trained
    got = one.get_layer("tables").export()
    for f in range(F):
        ids, rows = many.get_layer(f"table_{f}").export()
        want = dict(zip(ids.numpy().tolist(), rows.numpy()))
        assert sorted(got[f][0].tolist()) == sorted(want) == sorted(set(x[:, f].tolist()))
        for raw, row in zip(got[f][0].tolist(), got[f][1]):
            np.testing.assert_allclose(row, want[raw], rtol=0, atol=1e-6, err_msg=f"{f}, {raw}")
    np.testing.assert_allclose(np.asarray(one.layers[-1].kernel),
                               np.asarray(many.layers[-1].kernel), rtol=0, atol=1e-6)


def _op_counts(fn, *specs):
    ops = [op.type for op in tf.function(fn).get_concrete_function(*specs).graph.get_operations()]
    return ops.count("LookupTableFindV2"), ops.count("Unique")


def test_a_training_lookup_reads_the_one_table_once_whatever_the_number_of_features():
    """One Unique of all F columns' keys and the one table's finds (two per
    shard: before and after admission), as one DynamicEmbedding on one
    column; F separate layers make F times that."""
    spec = tf.TensorSpec([None, F], tf.int64)
    collection = dc_lib.DynamicEmbeddingCollection(F, DIM, capacity=16)
    collection(np.zeros((1, F), np.int64))
    singles = [de_lib.DynamicEmbedding(DIM, capacity=16) for _ in range(F)]
    for s in singles:
        s(np.zeros((1,), np.int64))
    got = _op_counts(lambda ids: collection(ids, training=True), spec)
    one = _op_counts(lambda ids: singles[0](ids[:, 0], training=True), spec)
    many = _op_counts(lambda ids: [s(ids[:, f], training=True) for f, s in enumerate(singles)],
                      spec)
    assert got == one == (2, 1) and many == (2 * F, F)


@pytest.mark.parametrize("keras_name", list(KERASES))
def test_raw_ids_outside_56_bits_and_bad_input_are_refused_naming_the_feature(keras_name):
    layer = KERASES[keras_name][1](F, DIM, capacity=8, name="dc")
    traced = tf.function(lambda ids: layer(ids, training=True))
    want = (r"DynamicEmbeddingCollection dc: feature 1 \(column 1 of the ids\) got raw id {}; "
            r"raw ids must be in \[0, 2\*\*56\): reduce wider ids with "
            r"tf.bitwise.bitwise_and\(ids, 2\*\*56 - 1\)")
    for bad, shown in ((-1, "-1"), (2**56, str(2**56))):
        ids = np.array([[1, 2, 3], [4, bad, 6]], np.int64)
        for call in (layer, traced):
            with pytest.raises(tf.errors.InvalidArgumentError, match=want.format(shown)):
                call(ids)
    assert layer.stats()["live_rows"] == 0  # nothing admitted from a refused batch
    with pytest.raises(ValueError, match=r"shape \[batch, 3\]"):
        layer(np.zeros((2, 4), np.int64))
    with pytest.raises(TypeError, match="raw ids must be int32 or int64, got float32"):
        layer(np.zeros((2, 3), np.float32))
    with pytest.raises(TypeError, match="got string.*key_dtype=tf.string"):
        layer(tf.constant([["a", "b", "c"]]))


@pytest.mark.parametrize("keras_name", list(KERASES))
@pytest.mark.parametrize("ids", [np.zeros((F,), np.int64), np.zeros((2, 1, F), np.int64)],
                         ids=["rank1", "rank3"])
def test_both_collections_refuse_ids_of_another_rank_naming_the_shape(keras_name, ids):
    # A [F] or [batch, 1, F] input was taken (its last axis is F) and read as
    # rows of other examples or features.
    fixed = {"tf_keras": tf_asyncps.layers.EmbeddingCollection,
             "keras3": tf_asyncps.keras3.EmbeddingCollection}[keras_name]([5, 3, 7], DIM,
                                                                          name="ec")
    dynamic = KERASES[keras_name][1](F, DIM, capacity=8, name="dc")
    shape = re.escape(str(tf.TensorShape(ids.shape)))
    with pytest.raises(ValueError, match=r"EmbeddingCollection 'ec': ids must have shape "
                                         rf"\[batch, 3\] \(rank 2: .*got {shape}\."):
        fixed(ids)
    with pytest.raises(ValueError, match=r"DynamicEmbeddingCollection 'dc': ids must have "
                                         rf"shape \[batch, 3\] \(rank 2: .*got {shape}\."):
        dynamic(ids, training=True)
    with pytest.raises(ValueError, match=r"ids must have shape \[batch, 3\]"):
        fixed.build(ids.shape)  # a functional model's symbolic input


@pytest.mark.parametrize("value", [0, 129, True, 2.0])
def test_bad_num_features_is_refused_naming_it(value):
    for cls in (dc_lib.DynamicEmbeddingCollection, dc_lib.keras3_layer()):
        with pytest.raises(ValueError, match=r"DynamicEmbeddingCollection: num_features must "
                                             r"be an int >= 1 and < 129 \(the number of id "
                                             r"columns"):
            cls(value, DIM, capacity=8)
    with pytest.raises(ValueError, match="capacity must be an int >= 1"):
        dc_lib.DynamicEmbeddingCollection(2, DIM, capacity=0)


@pytest.mark.parametrize("keras_name", list(KERASES))
def test_config_round_trip_and_the_name_for_both_kerases(keras_name):
    K, cls, _ = KERASES[keras_name]
    layer = cls(F, DIM, capacity=12, min_count=2, eviction="lru", initializer="zeros", name="dc")
    config = layer.get_config()
    assert config["num_features"] == F and config["capacity"] == 12
    assert "key_dtype" not in config
    again = cls.from_config(config)
    assert type(again) is cls and again.get_config() == config
    assert type(tf_asyncps.layers.DynamicEmbeddingCollection.from_config(
        config, keras=keras_name)) is cls
    made = tf_asyncps.layers.DynamicEmbeddingCollection(F, DIM, 4, keras=keras_name)
    assert type(made) is cls and isinstance(made, tf_asyncps.layers.DynamicEmbeddingCollection)
    assert isinstance(made, tf_asyncps.layers.DynamicEmbedding)
    registered = K.saving.get_registered_object("tf_asyncps>DynamicEmbeddingCollection")
    assert registered is cls
    if keras_name == "keras3":
        assert tf_asyncps.keras3.DynamicEmbeddingCollection is cls
    other = tf_keras if keras_name == "keras3" else keras
    with pytest.raises(TypeError, match=r"DynamicEmbeddingCollection\(\.\.\., keras=\\?\"" +
                       ("tf_keras" if keras_name == "keras3" else "keras3")):
        layer(other.Input((F,), dtype="int64"))


@pytest.mark.parametrize("keras_name", list(KERASES))
def test_checkpoint_and_keras_file_keep_each_features_ids_and_rows(keras_name, tmp_path):
    K, cls, _ = KERASES[keras_name]
    x, y = _data(16, seed=2)

    def make(init="uniform"):
        i = K.Input((F,), dtype="int64")
        m = K.Model(i, K.layers.Flatten()(cls(F, DIM, capacity=20, initializer=init,
                                                name="dc")(i)))
        m.compile(K.optimizers.SGD(0.1), "mse")
        return m

    model = make()
    model.fit(x, np.zeros((16, F * DIM), np.float32), batch_size=8, verbose=0)
    want = model.get_layer("dc").export()
    preds = model.predict(x, verbose=0)

    def same(layer):
        got = layer.export()
        for f in range(F):
            order_a, order_b = np.argsort(got[f][0]), np.argsort(want[f][0])
            np.testing.assert_array_equal(got[f][0][order_a], want[f][0][order_b])
            np.testing.assert_array_equal(got[f][1][order_a], want[f][1][order_b])

    path = tf.train.Checkpoint(model=model).save(str(tmp_path / "ckpt"))
    other = make("ones")
    other(x[:1])  # built
    tf.train.Checkpoint(model=other).restore(path)
    same(other.get_layer("dc"))
    model.save(str(tmp_path / "m.keras"))
    loaded = K.models.load_model(str(tmp_path / "m.keras"))
    assert type(loaded.get_layer("dc")) is cls
    same(loaded.get_layer("dc"))
    np.testing.assert_array_equal(loaded.predict(x, verbose=0), preds)
