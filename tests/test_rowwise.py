"""Row-wise table updates for Keras 3 (core/rowwise.py, keras3/optimizers.py,
core/lookup.per_id_gradients): equal to Keras 3's own SGD and Adagrad in one
process, repeated ids included; LazyAdam against its closed form. Fast tier:
no cluster."""

import numpy as np
import pytest
import tensorflow as tf

keras = pytest.importorskip("keras")

import tf_asyncps.keras3  # noqa: F401  (the Keras 3 layers)
from tf_asyncps.core import lookup, rowwise
from tf_asyncps.keras3.optimizers import LazyAdam

V, D, F = 30, 4, 3
# Each batch repeats ids within and across rows; ids >= 12 are never used.
X = np.array([[0, 1, 1], [1, 2, 0], [3, 3, 3], [4, 5, 1], [0, 0, 2], [6, 1, 7]], np.int32)
X2 = np.array([[8, 9, 9], [10, 9, 8], [11, 11, 0], [1, 1, 1], [9, 10, 11], [8, 8, 8]], np.int32)
Y = np.linspace(-1.0, 1.0, 6, dtype=np.float32)[:, None]


def _model(layer):
    keras.utils.set_random_seed(3)
    inp = keras.Input((F,), dtype="int32")
    table = keras.layers.Embedding(V, D) if layer == "embedding" else \
        tf_asyncps.keras3.EmbeddingCollection([V // F] * F, D)
    x = keras.layers.Flatten()(table(inp))
    return keras.Model(inp, keras.layers.Dense(1)(x))


def _train(layer, make_opt, rowwise_path, batches):
    """Keras 3 training steps: its own ``apply`` or the row-wise path (distinct
    rows with their squares, then the row-wise update inside ``apply``)."""
    model, opt = _model(layer), make_opt()
    tv = model.trainable_variables
    opt.build(tv)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x) - y))
        grads = tape.gradient(loss, tv)
        if not rowwise_path:
            opt.apply(grads, tv)
            return
        grads, squares = rowwise.distinct_rows(opt, grads, tv)
        apply = rowwise.applying(opt, lambda p: opt.apply([g for g, _ in p], [v for _, v in p]),
                                 tv, grads, squares)
        apply(list(zip(grads, tv)))

    for x in batches:
        step(x % (V // F) if layer == "collection" else x, Y)
    return [v.numpy() for v in tv]


OPTIMIZERS = {"sgd": lambda: keras.optimizers.SGD(0.2),
              "adagrad": lambda: keras.optimizers.Adagrad(0.5),
              "adagrad_zero_init": lambda: keras.optimizers.Adagrad(
                  0.5, initial_accumulator_value=0.0)}


@pytest.mark.parametrize("layer", ["embedding", "collection"])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_rowwise_update_equals_keras3s_own(layer, name):
    batches = [X, X2, X, X2]
    own = _train(layer, OPTIMIZERS[name], False, batches)
    rows = _train(layer, OPTIMIZERS[name], True, batches)
    for a, b in zip(own, rows):
        np.testing.assert_allclose(b, a, atol=1e-6, rtol=0)
    assert np.abs(own[0] - _model(layer).trainable_variables[0].numpy()).max() > 1e-2


def test_the_rule_of_each_optimizer():
    assert rowwise.rule_for(keras.optimizers.SGD(0.1)) == "sgd"
    assert rowwise.rule_for(keras.optimizers.SGD(0.1, momentum=0.9)) is None
    assert rowwise.rule_for(keras.optimizers.Adagrad()) == "adagrad"
    assert rowwise.rule_for(keras.optimizers.Adagrad(clipnorm=1.0)) is None
    assert rowwise.rule_for(keras.optimizers.Adam()) is None  # dense by default
    assert rowwise.rule_for(LazyAdam()) == "lazy_adam"
    with pytest.raises(ValueError, match="amsgrad"):
        LazyAdam(amsgrad=True)


def test_distinct_rows_send_squares_of_repeated_ids_only():
    opt = keras.optimizers.Adagrad()
    var = tf.Variable(tf.zeros([10, 2]))
    g = tf.IndexedSlices(tf.constant([[1., 2.], [3., 4.], [5., 6.], [7., 8.]]),
                         tf.constant([4, 7, 4, 2]), tf.constant([10, 2]))
    (out,), (sq,) = rowwise.distinct_rows(opt, [g], [var])
    np.testing.assert_array_equal(out.indices.numpy(), [4, 7, 2])  # repeated first
    np.testing.assert_array_equal(out.values.numpy(), [[6, 8], [3, 4], [7, 8]])
    np.testing.assert_array_equal(sq.numpy(), [[26, 40]])  # 1+25, 4+36: id 4 only


def _numpy_lazy_adam(w, batches_grads, lr, b1=0.9, b2=0.999, eps=1e-7):
    m, v = np.zeros_like(w), np.zeros_like(w)
    for t, (ids, rows) in enumerate(batches_grads, start=1):
        s1, s2 = np.zeros_like(w), np.zeros_like(w)
        for i, g in zip(ids, rows):
            s1[i] += g
            s2[i] += g * g
        touched = sorted(set(ids))
        alpha = lr * np.sqrt(1 - b2 ** t) / (1 - b1 ** t)
        for r in touched:
            m[r] += (s1[r] - m[r]) * (1 - b1)
            v[r] += (s2[r] - v[r]) * (1 - b2)
            w[r] -= alpha * m[r] / (np.sqrt(v[r]) + eps)
    return w


def test_lazy_adam_equals_its_closed_form_and_differs_from_adam_off_the_ids():
    rs = np.random.RandomState(0)
    w0 = rs.randn(8, 3).astype(np.float32)
    steps = [([1, 3, 1], rs.randn(3, 3)), ([3, 5], rs.randn(2, 3)), ([1, 1, 6], rs.randn(3, 3))]
    results = {}
    for name, opt in (("lazy", LazyAdam(0.1)), ("dense", keras.optimizers.Adam(0.1))):
        var = keras.Variable(w0)
        opt.build([var])
        for ids, rows in steps:
            opt.apply([tf.IndexedSlices(tf.constant(rows, tf.float32), tf.constant(ids),
                                        tf.constant([8, 3]))], [var])
        results[name] = var.numpy()
    want = _numpy_lazy_adam(w0.astype(np.float64), steps, 0.1)
    np.testing.assert_allclose(results["lazy"], want, atol=1e-6, rtol=0)
    # Dense Adam moves a row with a moment at each step; lazy only at its ids.
    diff = np.abs(results["lazy"] - results["dense"]).max(axis=1)
    assert diff[[0, 2, 4, 7]].max() == 0.0  # never touched: equal (zero moments)
    assert diff[[1, 3, 5]].min() > 1e-3  # touched, then left out of a later step
    np.testing.assert_array_equal(results["lazy"][[0, 2, 4, 7]], w0[[0, 2, 4, 7]])


def test_a_per_id_gradient_read_reads_distinct_ids_and_gives_a_row_per_id():
    var = tf.Variable(np.arange(20, dtype=np.float32).reshape(10, 2))
    assert lookup.read_distinct_rows(var)
    ids = tf.constant([[4, 7], [4, 4]])

    @tf.function
    def grad():
        with tf.GradientTape() as tape, lookup.per_id_gradients():
            out = tf.nn.embedding_lookup(var, ids)
            loss = tf.reduce_sum(out * tf.reshape(tf.range(8, dtype=tf.float32), [2, 2, 2]))
        g = tape.gradient(loss, var)
        gathers = [op for op in tf.compat.v1.get_default_graph().get_operations()
                   if op.type == "ResourceGather"]
        return out, g.indices, g.values, len(gathers)

    out, indices, values, gathers = grad()
    np.testing.assert_array_equal(out.numpy(), var.numpy()[[[4, 7], [4, 4]]])
    np.testing.assert_array_equal(indices.numpy(), [4, 7, 4, 4])  # every id's row
    np.testing.assert_array_equal(values.numpy(), np.arange(8).reshape(4, 2))
    assert gathers == 1
