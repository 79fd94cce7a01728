"""EmbeddingCollection (issue 39): many features' tables in one table.

Fast tier, in one process: training equals F separate Embedding layers
trained the same way (SGD, Adagrad, Adam; tf_keras and Keras 3); an id out of
its feature's range is refused naming the feature, its range and the id
(eager and traced); bad constructor arguments name the argument; config,
checkpoint, Keras file and SavedModel round trips; ``export`` per feature; the
strategy's row read (core/lookup) reads the one table once per step.
Cluster tier (one small test, 1 worker, 2 ps, the table split over both):
the strategy's fit equals one-process training (tf_keras and Keras 3), with
one gather and one gradient push per shard per step; and
DynamicEmbeddingCollection split the same way equals one process, with one
lookup of each shard's map per step (its scenario is above the test).
"""

import collections
import dataclasses

import numpy as np
import pytest
import tensorflow as tf
import tf_keras

import tf_asyncps
from tf_asyncps.compat import variables as variables_compat
from tf_asyncps.core import lookup
from tf_asyncps.layers import embedding_collection as ec_lib

from conftest import run_scenario
from scenarios import cluster, scenario
from scenarios.common import full_value, make_optimizer

keras = pytest.importorskip("keras")

DIMS = [5, 3, 7]  # three features; the table has 15 rows
DIM = 4
STEPS, BATCH = 5, 6


def _problem(seed=0):
    rng = np.random.RandomState(seed)
    # Few distinct ids per column: every batch repeats ids within a feature,
    # and features share id values (different rows all the same).
    ids = np.stack([rng.randint(0, min(d, 3), STEPS * BATCH) for d in DIMS], 1)
    ys = rng.uniform(-1, 1, (STEPS * BATCH, 1)).astype(np.float32)
    table = rng.uniform(-0.5, 0.5, (sum(DIMS), DIM)).astype(np.float32)
    kernel = rng.uniform(-0.5, 0.5, (len(DIMS) * DIM, 1)).astype(np.float32)
    return ids.astype(np.int64), ys, table, kernel


def _offsets():
    return np.cumsum([0] + DIMS[:-1])


def _models(K, collection_cls, table, kernel):
    """(the collection model, the model of F Embedding layers), same weights."""
    const = K.initializers.Constant
    inp = K.Input((len(DIMS),), dtype="int64")
    rows = collection_cls(DIMS, DIM, embeddings_initializer=const(table), name="tables")(inp)
    one = K.Model(inp, K.layers.Dense(1, use_bias=False, kernel_initializer=const(kernel))(
        K.layers.Flatten()(rows)))
    inp = K.Input((len(DIMS),), dtype="int64")
    cols = [K.layers.Embedding(d, DIM, embeddings_initializer=const(table[o:o + d]))(
        K.layers.Lambda(lambda x, f=f: x[:, f])(inp)) for f, (d, o) in enumerate(
            zip(DIMS, _offsets()))]
    flat = K.layers.Concatenate()(cols)  # [batch, F * DIM], feature by feature
    many = K.Model(inp, K.layers.Dense(1, use_bias=False, kernel_initializer=const(kernel))(flat))
    return one, many


KERASES = {"tf_keras": (tf_keras, ec_lib.EmbeddingCollection),
           "keras3": (keras, ec_lib.keras3_layer())}


@pytest.mark.parametrize("keras_name", list(KERASES))
def test_training_equals_separate_embedding_layers(keras_name):
    K, cls = KERASES[keras_name]
    ids, ys, table, kernel = _problem()
    makers = {"sgd": lambda: K.optimizers.SGD(0.3), "adagrad": lambda: K.optimizers.Adagrad(0.3),
              "adam": lambda: K.optimizers.Adam(0.05)}
    for opt_name, make in makers.items():
        one, many = _models(K, cls, table, kernel)
        for m in (one, many):
            # Eager steps: the same updates without tracing 12 models (the
            # traced read is tested below).
            m.compile(make(), "mse", run_eagerly=True)
            m.fit(ids, ys, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
        layer = one.get_layer("tables")
        got = layer.export()
        tables = [l for l in many.layers if isinstance(l, K.layers.Embedding)]
        for f, t in enumerate(tables):
            want = np.asarray(t.embeddings.numpy())
            np.testing.assert_allclose(got[f], want, atol=1e-6, err_msg=f"{opt_name}, feature {f}")
            assert np.max(np.abs(want - table[_offsets()[f]:][:DIMS[f]])) > 1e-3  # it trained
        np.testing.assert_allclose(np.asarray(one(ids)), np.asarray(many(ids)), atol=1e-6,
                                   err_msg=opt_name)
        np.testing.assert_allclose(one.layers[-1].kernel.numpy(), many.layers[-1].kernel.numpy(),
                                   atol=1e-6, err_msg=opt_name)


def _ids_of(shape_rows=4, seed=1):
    rng = np.random.RandomState(seed)
    return np.stack([rng.randint(0, d, shape_rows) for d in DIMS], 1).astype(np.int64)


def _layer(keras_name, **kwargs):
    layer = KERASES[keras_name][1](DIMS, DIM, **kwargs)
    layer(_ids_of())
    return layer


def _table_of(layer):
    return np.concatenate([layer.export()[f] for f in range(len(DIMS))], 0)


@pytest.mark.parametrize("keras_name", list(KERASES))
def test_rows_are_the_features_rows_of_one_table_and_export_splits_it(keras_name):
    layer = _layer(keras_name)
    table = np.asarray(layer.embeddings.numpy())
    assert table.shape == (sum(DIMS), DIM) and table.dtype == np.float32
    assert "embeddings" in layer.embeddings.name  # route's default sparse_names
    ids = _ids_of(seed=3).astype(np.int32)  # int32 ids too
    out = np.asarray(layer(ids))
    assert out.shape == (4, len(DIMS), DIM) and out.dtype == np.float32
    np.testing.assert_array_equal(out, table[ids + _offsets()])
    tables = layer.export()
    assert sorted(tables) == [0, 1, 2]
    for f, o in enumerate(_offsets()):
        np.testing.assert_array_equal(tables[f], table[o:o + DIMS[f]])
        np.testing.assert_array_equal(layer.feature_table(f), tables[f])
    with pytest.raises(ValueError, match=r": feature must be an int >= 0 and < 3 \(a feature index\), got 3\."):
        layer.feature_table(3)
    # Mixed precision: the table stays float32, rows come in the compute dtype.
    mixed = _layer(keras_name, dtype="mixed_float16")
    assert np.asarray(mixed.embeddings.numpy()).dtype == np.float32
    assert mixed(_ids_of()).dtype == tf.float16


@pytest.mark.parametrize("keras_name", list(KERASES))
def test_an_id_out_of_its_features_range_is_refused_naming_the_feature(keras_name):
    layer = _layer(keras_name)
    traced = tf.function(lambda ids: layer(ids))
    # Column 1 takes [0, 3): 3 is refused there though rows 5..7 exist (feature 1's rows).
    bad = np.array([[0, 1, 2], [4, 3, 6]], np.int64)
    want = r"feature 1 \(column 1 of the ids\) takes ids in \[0, 3\) \(input_dims\[1\]\), got id 3"
    for call in (layer, traced):
        with pytest.raises(tf.errors.InvalidArgumentError, match=want):
            call(bad)
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"feature 2 .* takes ids in \[0, 7\) .*got id -1"):
        traced(tf.constant([[0, 0, -1]], tf.int32))
    np.testing.assert_array_equal(np.asarray(traced(bad[:1])), np.asarray(layer(bad[:1])))
    with pytest.raises(TypeError, match="ids must be int32 or int64, got float32"):
        layer(np.zeros((2, 3), np.float32))
    with pytest.raises(ValueError, match=r"shape \[batch, 3\]"):
        layer(np.zeros((2, 4), np.int64))


@pytest.mark.parametrize("args, match", [
    (([], 4), r"input_dims must be a non-empty list"),
    ((5, 4), r"input_dims must be a non-empty list"),
    (([5, 0, 3], 4), r"input_dims\[1\] must be an int >= 1 \(feature 1's number of ids\), got 0\."),
    (([5, -2], 4), r"input_dims\[1\] must be an int >= 1 .*, got -2\."),
    (([5, True], 4), r"input_dims\[1\] must be an int >= 1 .*, got True\."),
    (([5, 2.0], 4), r"input_dims\[1\] must be an int >= 1 .*, got 2\.0\."),
    (([5, 3], 0), r"output_dim must be an int >= 1 \(the width of each row\), got 0\."),
    (([5, 3], False), r"output_dim must be an int >= 1 .*, got False\."),
    # The int64 offsets overflowed (negative rows) before.
    (([2 ** 62, 2 ** 62, 3], 1), r"^EmbeddingCollection: input_dims sum to "
                                 r"9223372036854775811 rows of output_dim=1: .* \(2\*\*63 - 1\)"),
    (([2 ** 40, 2 ** 20], 2 ** 23), r"input_dims sum to 1099512676352 rows of output_dim="
                                    r"8388608"),
])
@pytest.mark.parametrize("keras_name", list(KERASES))
def test_bad_arguments_are_refused_naming_the_argument(keras_name, args, match):
    with pytest.raises(ValueError, match=match):
        KERASES[keras_name][1](*args)


@pytest.mark.parametrize("keras_name", list(KERASES))
def test_config_round_trip_and_the_name_for_both_kerases(keras_name):
    cls = KERASES[keras_name][1]
    layer = cls(np.array(DIMS), DIM, embeddings_initializer="zeros", name="ec")
    config = layer.get_config()
    assert config["input_dims"] == DIMS and config["output_dim"] == DIM
    again = cls.from_config(config)
    assert type(again) is cls and again.get_config() == config
    picked = tf_asyncps.layers.EmbeddingCollection.from_config(config, keras=keras_name)
    assert type(picked) is cls
    made = tf_asyncps.layers.EmbeddingCollection(DIMS, DIM, keras=keras_name)
    assert type(made) is cls and isinstance(made, tf_asyncps.layers.EmbeddingCollection)
    assert np.all(np.asarray(again(_ids_of())) == 0)
    if keras_name == "keras3":
        assert tf_asyncps.keras3.EmbeddingCollection is cls
        assert keras.saving.get_registered_object("tf_asyncps>EmbeddingCollection") is cls
    else:
        assert tf_keras.saving.get_registered_object("tf_asyncps>EmbeddingCollection") is cls
    other = tf_keras if keras_name == "keras3" else keras
    with pytest.raises(TypeError, match=r"keras=\\?\"" + ("tf_keras" if keras_name == "keras3"
                                                         else "keras3")):
        layer(other.Input((3,), dtype="int64"))


@pytest.mark.parametrize("keras_name", list(KERASES))
def test_checkpoint_keras_file_and_saved_model_round_trips(keras_name, tmp_path):
    K, cls = KERASES[keras_name]
    ids = _ids_of(seed=5)
    inp = K.Input((len(DIMS),), dtype="int64")
    model = K.Model(inp, cls(DIMS, DIM, name="ec")(inp))
    want = np.asarray(model(ids))
    table = _table_of(model.get_layer("ec"))

    # tf.train.Checkpoint onto a layer with other values.
    path = tf.train.Checkpoint(model=model).save(str(tmp_path / "ckpt"))
    inp = K.Input((len(DIMS),), dtype="int64")
    other = K.Model(inp, cls(DIMS, DIM, name="ec", embeddings_initializer="ones")(inp))
    tf.train.Checkpoint(model=other).restore(path).assert_existing_objects_matched()
    np.testing.assert_array_equal(_table_of(other.get_layer("ec")), table)

    # Keras's own file: the class is found by its registered name.
    model.save(str(tmp_path / "m.keras"))
    loaded = K.models.load_model(str(tmp_path / "m.keras"))
    assert type(loaded.get_layer("ec")) is cls
    np.testing.assert_array_equal(np.asarray(loaded(ids)), want)

    # A SavedModel served with no Keras layer in the loop.
    export = str(tmp_path / "saved")
    if keras_name == "keras3":
        model.export(export, verbose=False)
        restored = tf.saved_model.load(export)  # held: its functions use its variables
        served = restored.serve(tf.constant(ids))
    else:
        tf.saved_model.save(model, export)
        restored = tf.saved_model.load(export)
        served = restored(tf.constant(ids))
    np.testing.assert_array_equal(np.asarray(served), want)


def test_the_strategys_row_read_reads_the_one_table_once():
    """The strategy makes each table's (or shard's) row reads read distinct
    ids once (core/lookup.read_distinct_rows): with the collection, one
    Unique and one gather per step for all F features, the same rows and
    gradient as the plain read."""
    ids = np.array([[1, 2, 6], [1, 2, 6], [4, 0, 0]], np.int64)
    plain, deduped = _layer("tf_keras"), _layer("tf_keras")
    deduped.set_weights(plain.get_weights())
    assert lookup.read_distinct_rows(deduped.embeddings)

    def step(layer):
        @tf.function
        def run(ids):
            with tf.GradientTape() as tape:
                out = layer(ids)
                loss = tf.reduce_sum(out * tf.range(1.0, DIM + 1))
            return out, tf.convert_to_tensor(tape.gradient(loss, layer.embeddings))
        return run

    run_p, run_d = step(plain), step(deduped)
    for a, b in zip(run_p(ids), run_d(ids)):
        np.testing.assert_allclose(a.numpy(), b.numpy(), atol=1e-6)
    ops = [op.type for op in run_d.get_concrete_function(ids).graph.get_operations()]
    assert ops.count("ResourceGather") == 1 and ops.count("Unique") == 1


# The cluster scenario (docs/tests.md#scenarios-beside-their-tests): 1 worker,
# 2 ps, the 88-row table of 4 features split in two by MinSizePartitioner.


@dataclasses.dataclass(frozen=True)
class StepOps:
    """What one traced worker step does with the split table.

    Attributes:
      reads: per ResourceGather of the layer's lookup, ``{"ids_dtype": the
        dtype name of its ids, "uniques_upstream": the Unique ops its ids
        are computed from}``.
      grad_uniques: Unique ops on the table's gradient rows (a second
        de-duplication; 0 when the distinct read's rows go as they are).
      scatter_adds_by_task: ResourceScatterAdd ops (Adagrad's accumulator and
        rows) per ps task (its index as a string), function bodies included.
    """
    reads: list[dict]
    grad_uniques: int
    scatter_adds_by_task: dict[str, int]


@dataclasses.dataclass(frozen=True)
class SplitRun:
    """One tf_keras fit of the EmbeddingCollection model on the split table.

    Attributes:
      shards: the table's shards. shard_rows: rows per shard.
      shard_tasks: the ps task of each shard, sorted.
      applied: updates applied (the staleness counters).
      part_updates: under ``route``, updates per part (``{"sparse": n,
        "dense": n}``); None under ``async``.
      step_ops: the traced step's ops (the ``async`` run only, else None).
      max_abs_diff: max |weight - one-process tf_keras weight| over the table
        and the kernel.
      moved: max |table - initial table| (training moved it).
    """
    shards: int
    shard_rows: list[int]
    shard_tasks: list[int]
    applied: int
    part_updates: dict[str, int] | None
    step_ops: StepOps | None
    max_abs_diff: float
    moved: float


@dataclasses.dataclass(frozen=True)
class SplitKeras3Run:
    """The Keras 3 layer under the strategy's Keras 3 fit.

    Attributes:
      max_abs_diff: max |weight - one-process Keras 3 weight|.
      shards: the table's shards. moved: max |table - initial table|.
    """
    max_abs_diff: float
    shards: int
    moved: float


@dataclasses.dataclass(frozen=True)
class SplitDynamicRun:
    """DynamicEmbeddingCollection on raw ids, split over the 2 ps.

    Attributes:
      max_abs_diff: max |row - one-process row| over every feature's rows
        (by raw id) and the kernel.
      live: live rows per feature. want_live: distinct raw ids per feature.
      shards: the dynamic table's shards.
      finds: hash-map finds (LookupTableFindV2) in a traced step.
      applied: updates applied. moved: max |row| (rows start at zero).
    """
    max_abs_diff: float
    live: list[int]
    want_live: list[int]
    shards: int
    finds: int
    applied: int
    moved: float


@dataclasses.dataclass(frozen=True)
class EmbeddingCollectionFit:
    """Attributes: plain: the ``async`` run; routed: the ``route`` run with
    bfloat16 rows on the wire; keras3: the Keras 3 layer; dynamic: the
    DynamicEmbeddingCollection run."""
    plain: SplitRun
    routed: SplitRun
    keras3: SplitKeras3Run
    dynamic: SplitDynamicRun


SPLIT_DIMS = [40, 8, 24, 16]  # 88 rows x 4 float32: split in two by MinSizePartitioner
SPLIT_DIM, SPLIT_BATCH = 4, 8


def _split_problem(steps, seed=0):
    rng = np.random.RandomState(seed)
    # Ids from the first half of each feature's range: repeats in every batch,
    # rows of both shards touched.
    ids = np.stack([rng.randint(0, d // 2, steps * SPLIT_BATCH) for d in SPLIT_DIMS], 1)
    ids = ids.astype(np.int64)
    ys = rng.uniform(-1, 1, (steps * SPLIT_BATCH, 1)).astype(np.float32)
    table = rng.uniform(-0.5, 0.5, (sum(SPLIT_DIMS), SPLIT_DIM)).astype(np.float32)
    kernel = rng.uniform(-0.5, 0.5, (len(SPLIT_DIMS) * SPLIT_DIM, 1)).astype(np.float32)
    return ids, ys, table, kernel


def _split_model(table, kernel):
    const = tf_keras.initializers.Constant
    inp = tf_keras.Input((len(SPLIT_DIMS),), dtype="int64")
    rows = ec_lib.EmbeddingCollection(SPLIT_DIMS, SPLIT_DIM,
                                      embeddings_initializer=const(table), name="tables")(inp)
    return tf_keras.Model(inp, tf_keras.layers.Dense(
        1, use_bias=False, kernel_initializer=const(kernel))(tf_keras.layers.Flatten()(rows)))


def _task(device):
    return tf.DeviceSpec.from_string(device).task if device else None


def _step_ops(graph_def):
    """What one traced worker step does with the table: its row reads (the
    ResourceGathers of the layer's lookup, with the op making their ids),
    the worker's de-duplication of the table's gradient rows, and the
    sparse updates (ResourceScatterAdd: Adagrad's accumulator and rows) by
    ps task, the function bodies included."""
    nodes = {n.name: n for n in graph_def.node}

    def upstream(name):  # the op types a node's value is computed from
        seen, todo = collections.Counter(), [name]
        names = set()
        while todo:
            node = nodes.get(todo.pop().lstrip("^").split(":")[0])
            if node is not None and node.name not in names:
                names.add(node.name)
                seen[node.op] += 1
                todo.extend(node.input)
        return seen

    reads = [{"ids_dtype": tf.as_dtype(nodes[n.input[1].split(":")[0]].attr["DstT"].type).name,
              "uniques_upstream": upstream(n.input[1])["Unique"]}
             for n in graph_def.node
             if n.op == "ResourceGather" and n.name.startswith("model/tables/")]
    grad_uniques = sum(1 for n in graph_def.node if n.op == "Unique" and any(
        i.startswith("gradient_tape/model/tables/") for i in n.input))
    scatters = collections.Counter(
        _task(n.device) for fn in graph_def.library.function for n in fn.node_def
        if n.op == "ResourceScatterAdd")
    scatters.update(_task(n.device) for n in graph_def.node if n.op == "ResourceScatterAdd")
    return StepOps(reads=reads, grad_uniques=grad_uniques, scatter_adds_by_task={
        str(k): v for k, v in sorted(scatters.items(), key=str)})


def _run(c, ids, ys, table0, kernel0, steps, optimizer, lr, policy, wire_dtype, trace):
    """One fit on the split table: (SplitRun's fields but the two differences,
    the table, the kernel)."""
    if policy == "route":
        policy = tf_asyncps.policies.route(sparse="async", dense="async")
    strategy = tf_asyncps.AsyncParameterServerStrategy(
        c.resolver(), update_policy=policy, wire_dtype=wire_dtype,
        variable_partitioner=tf.distribute.experimental.partitioners.MinSizePartitioner(
            min_shard_bytes=64, max_shards=2))
    with strategy.scope():
        model = _split_model(table0, kernel0)
        model.compile(make_optimizer(optimizer, lr), "mse")
    data = tf_keras.utils.experimental.DatasetCreator(
        lambda ctx: tf.data.Dataset.from_tensor_slices((ids, ys)).batch(SPLIT_BATCH).repeat())
    model.fit(data, epochs=1, steps_per_epoch=steps, verbose=0)
    var = model.get_layer("tables").embeddings
    shards = variables_compat.shards(var) or [var]
    table, kernel = full_value(var), full_value(model.layers[-1].kernel)
    step_ops = None
    if trace:
        # fit's step (the model's train_step under strategy.run), traced
        # again here to read its graph.
        @tf.function
        def step(x, y):
            return strategy.run(model.train_step, args=((x, y),))

        step_ops = _step_ops(step.get_concrete_function(
            tf.TensorSpec([SPLIT_BATCH, len(SPLIT_DIMS)], tf.int64),
            tf.TensorSpec([SPLIT_BATCH, 1], tf.float32)).graph.as_graph_def())
    return dict(
        shards=len(shards), shard_rows=[int(s.shape[0]) for s in shards],
        shard_tasks=sorted(_task(s.device) for s in shards),
        applied=strategy.staleness_stats().applied,
        part_updates=(strategy.update_policy.part_updates()
                      if hasattr(strategy.update_policy, "part_updates") else None),
        step_ops=step_ops), table, kernel


def _run_keras3(c, ids, ys, table0, kernel0, steps, optimizer, lr):
    """The Keras 3 layer under the strategy's Keras 3 fit, against Keras 3
    in one process."""
    import keras

    def make():
        const = keras.initializers.Constant
        inp = keras.Input((len(SPLIT_DIMS),), dtype="int64")
        rows = ec_lib.keras3_layer()(SPLIT_DIMS, SPLIT_DIM,
                                     embeddings_initializer=const(table0), name="tables")(inp)
        model = keras.Model(inp, keras.layers.Dense(
            1, use_bias=False, kernel_initializer=const(kernel0))(keras.layers.Flatten()(rows)))
        model.compile(make_optimizer(optimizer, lr, "keras3"), "mse")
        return model

    strategy = tf_asyncps.AsyncParameterServerStrategy(
        c.resolver(), variable_partitioner=tf.distribute.experimental.partitioners
        .MinSizePartitioner(min_shard_bytes=64, max_shards=2))
    with strategy.scope():
        model = make()
    data = tf.data.Dataset.from_tensor_slices((ids, ys)).batch(SPLIT_BATCH).repeat()
    model.fit(data, epochs=1, steps_per_epoch=steps, verbose=0)
    ref = make()
    ref.fit(data, epochs=1, steps_per_epoch=steps, verbose=0)
    got, want = model.get_weights(), ref.get_weights()
    return SplitKeras3Run(
        max_abs_diff=float(max(np.max(np.abs(a - b)) for a, b in zip(got, want))),
        shards=len(tf_asyncps.keras3.trainable_shards(model)) - 1,
        moved=float(np.max(np.abs(got[0] - table0))))


def _split_dynamic_model(kernel):
    """DynamicEmbeddingCollection of the 4 features (capacity 88, zero rows)."""
    from tf_asyncps.layers import dynamic_collection
    inp = tf_keras.Input((len(SPLIT_DIMS),), dtype="int64")
    rows = dynamic_collection.DynamicEmbeddingCollection(
        len(SPLIT_DIMS), SPLIT_DIM, capacity=sum(SPLIT_DIMS), initializer="zeros",
        name="tables")(inp)
    return tf_keras.Model(inp, tf_keras.layers.Dense(1, use_bias=False, kernel_initializer=(
        tf_keras.initializers.Constant(kernel)))(tf_keras.layers.Flatten()(rows)))


def _find_ops(graph_def):
    """The hash-map finds (LookupTableFindV2) of a traced step, its
    functions' bodies (the shards' critical sections) included."""
    return sum(1 for fn in graph_def.library.function for n in fn.node_def
               if n.op == "LookupTableFindV2") + sum(
        1 for n in graph_def.node if n.op == "LookupTableFindV2")


def _run_dynamic(c, ids, ys, kernel0, steps, optimizer, lr):
    """DynamicEmbeddingCollection on raw ids (every feature the same raw
    values), its table split over the 2 ps, against one process."""
    raw = ids.astype(np.int64) * 1_000_000_007 + 2**40  # equal raw ids across features
    strategy = tf_asyncps.AsyncParameterServerStrategy(
        c.resolver(), variable_partitioner=tf.distribute.experimental.partitioners
        .MinSizePartitioner(min_shard_bytes=64, max_shards=2))
    with strategy.scope():
        model = _split_dynamic_model(kernel0)
        model.compile(make_optimizer(optimizer, lr), "mse")
    data = tf_keras.utils.experimental.DatasetCreator(
        lambda ctx: tf.data.Dataset.from_tensor_slices((raw, ys)).batch(SPLIT_BATCH).repeat())
    model.fit(data, epochs=1, steps_per_epoch=steps, verbose=0)
    ref = _split_dynamic_model(kernel0)
    ref.compile(make_optimizer(optimizer, lr), "mse")
    ref.fit(raw, ys, batch_size=SPLIT_BATCH, epochs=1, shuffle=False, verbose=0)
    got, want = model.get_layer("tables").export(), ref.get_layer("tables").export()
    diff = float(np.max(np.abs(full_value(model.layers[-1].kernel) -
                               np.asarray(ref.layers[-1].kernel.numpy()))))
    live = []
    for f in range(len(SPLIT_DIMS)):
        rows = dict(zip(want[f][0].tolist(), want[f][1]))
        assert sorted(rows) == sorted(got[f][0].tolist()), f
        live.append(len(rows))
        for r, row in zip(got[f][0].tolist(), got[f][1]):
            diff = max(diff, float(np.max(np.abs(row - rows[r]))))

    @tf.function
    def step(x, y):
        return strategy.run(model.train_step, args=((x, y),))

    graph = step.get_concrete_function(tf.TensorSpec([SPLIT_BATCH, len(SPLIT_DIMS)], tf.int64),
                                       tf.TensorSpec([SPLIT_BATCH, 1], tf.float32)).graph
    table = model.get_layer("tables").dynamic_table
    return SplitDynamicRun(
        max_abs_diff=diff, live=live,
        want_live=[len(set(raw[:, f].tolist())) for f in range(len(SPLIT_DIMS))],
        shards=len(table.shards), finds=_find_ops(graph.as_graph_def()),
        applied=strategy.staleness_stats().applied,
        moved=float(max(np.max(np.abs(got[f][1])) for f in range(len(SPLIT_DIMS)))))


@scenario(shares_cluster=True)
def embedding_collection_fit(steps=8, optimizer="adagrad", lr=0.3) -> EmbeddingCollectionFit:
    """fit with the table split over 2 ps tasks (MinSizePartitioner) against
    one-process tf_keras training on the same batches: ``async`` (and the
    ops of its traced step), then ``route`` (tables async, the rest async)
    with rows crossing as bfloat16; then the Keras 3 layer against Keras 3;
    then DynamicEmbeddingCollection (raw ids) against one process."""
    ids, ys, table0, kernel0 = _split_problem(steps)
    with cluster(num_workers=1, num_ps=2) as c:
        runs = [_run(c, ids, ys, table0, kernel0, steps, optimizer, lr, "async", None, True),
                _run(c, ids, ys, table0, kernel0, steps, optimizer, lr, "route", "bfloat16",
                     False)]
        keras3 = _run_keras3(c, ids, ys, table0, kernel0, steps, optimizer, lr)
        dynamic = _run_dynamic(c, ids, ys, kernel0, steps, optimizer, lr)
    ref = _split_model(table0, kernel0)
    ref.compile(make_optimizer(optimizer, lr), "mse")
    ref.fit(ids, ys, batch_size=SPLIT_BATCH, epochs=1, shuffle=False, verbose=0)
    ref_table, ref_kernel = ref.get_weights()
    plain, routed = (SplitRun(**fields, moved=float(np.max(np.abs(table - table0))),
                              max_abs_diff=float(max(np.max(np.abs(table - ref_table)),
                                                     np.max(np.abs(kernel - ref_kernel)))))
                     for fields, table, kernel in runs)
    return EmbeddingCollectionFit(plain=plain, routed=routed, keras3=keras3, dynamic=dynamic)


@pytest.mark.cluster
@pytest.mark.timeout(300)
def test_the_strategys_fit_on_a_split_table_equals_one_process_with_one_read_per_shard():
    """1 worker, 2 ps, the 88-row table of 4 features split in two: fit
    equals one-process tf_keras training (Adagrad, 8 steps); the traced step
    reads the table once per shard (2 gathers of distinct int32 ids for 4
    features), leaves each shard's gradient rows as the distinct read made
    them (no second de-duplication on the worker or the ps) and updates
    each shard once on its ps (Adagrad's sparse update: the
    accumulator's and the rows' scatter_add). Under route (tables matched by
    the default sparse_names) with rows crossing as bfloat16 every step
    updates the sparse part. The Keras 3 layer, split the same way, trains
    under the strategy's Keras 3 fit as Keras 3 does in one process."""
    r = run_scenario(embedding_collection_fit, timeout=240, shared=(1, 2))
    plain, routed = r.plain, r.routed
    for run in (plain, routed):
        assert run.shards == 2 and run.shard_rows == [44, 44]
        assert run.shard_tasks == [0, 1] and run.applied == 8
        assert run.moved > 0.1
    assert plain.max_abs_diff <= 1e-5
    ops = plain.step_ops
    assert ops.reads == [{"ids_dtype": "int32", "uniques_upstream": 1}] * 2
    assert ops.grad_uniques == 0
    assert ops.scatter_adds_by_task == {"0": 2, "1": 2}
    assert routed.part_updates == {"sparse": 8, "dense": 8}
    # bfloat16 rows (8 bits of mantissa): near the float32 run, not equal to it.
    assert 1e-6 < routed.max_abs_diff < 1e-2
    # The Keras 3 layer under the strategy's Keras 3 fit, split in two as well.
    k3 = r.keras3
    assert k3.shards == 2 and k3.moved > 0.1 and k3.max_abs_diff <= 1e-5
    # DynamicEmbeddingCollection (tests/test_dynamic_collection.py) on raw
    # ids, 4 features with equal raw ids, its 88-row table split in two:
    # each feature's rows equal one-process training; a step finds in each
    # shard's map twice (before and after admission) for all 4 features.
    dyn = r.dynamic
    assert dyn.shards == 2 and dyn.applied == 8 and dyn.moved > 0.01
    assert dyn.live == dyn.want_live and dyn.max_abs_diff <= 1e-5
    assert dyn.finds == 2 * 2
