"""Scenario of tests/test_embedding_collection.py: EmbeddingCollection split
over 2 ps tasks, trained by the strategy's fit (1 worker)."""

import collections

import numpy as np
import tensorflow as tf
import tf_keras

import tf_asyncps
from tf_asyncps.compat import variables as variables_compat
from tf_asyncps.layers import embedding_collection as ec_lib

from scenarios import cluster, scenario
from scenarios.common import full_value, make_optimizer

DIMS = [40, 8, 24, 16]  # 88 rows x 4 float32: split in two by MinSizePartitioner
DIM, BATCH = 4, 8


def _problem(steps, seed=0):
    rng = np.random.RandomState(seed)
    # Ids from the first half of each feature's range: repeats in every batch,
    # rows of both shards touched.
    ids = np.stack([rng.randint(0, d // 2, steps * BATCH) for d in DIMS], 1).astype(np.int64)
    ys = rng.uniform(-1, 1, (steps * BATCH, 1)).astype(np.float32)
    table = rng.uniform(-0.5, 0.5, (sum(DIMS), DIM)).astype(np.float32)
    kernel = rng.uniform(-0.5, 0.5, (len(DIMS) * DIM, 1)).astype(np.float32)
    return ids, ys, table, kernel


def _model(table, kernel):
    const = tf_keras.initializers.Constant
    inp = tf_keras.Input((len(DIMS),), dtype="int64")
    rows = ec_lib.EmbeddingCollection(DIMS, DIM, embeddings_initializer=const(table),
                                      name="tables")(inp)
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
    return {"reads": reads, "grad_uniques": grad_uniques,
            "scatter_adds_by_task": {str(k): v for k, v in sorted(scatters.items(), key=str)}}


def _run(c, ids, ys, table0, kernel0, steps, optimizer, lr, policy, wire_dtype, trace):
    if policy == "route":
        policy = tf_asyncps.policies.route(sparse="async", dense="async")
    strategy = tf_asyncps.AsyncParameterServerStrategy(
        c.resolver(), update_policy=policy, wire_dtype=wire_dtype,
        variable_partitioner=tf.distribute.experimental.partitioners.MinSizePartitioner(
            min_shard_bytes=64, max_shards=2))
    with strategy.scope():
        model = _model(table0, kernel0)
        model.compile(make_optimizer(optimizer, lr), "mse")
    data = tf_keras.utils.experimental.DatasetCreator(
        lambda ctx: tf.data.Dataset.from_tensor_slices((ids, ys)).batch(BATCH).repeat())
    model.fit(data, epochs=1, steps_per_epoch=steps, verbose=0)
    var = model.get_layer("tables").embeddings
    shards = variables_compat.shards(var) or [var]
    out = {"shards": len(shards), "shard_rows": [int(s.shape[0]) for s in shards],
           "shard_tasks": sorted(_task(s.device) for s in shards),
           "table": full_value(var), "kernel": full_value(model.layers[-1].kernel),
           "applied": strategy.staleness_stats().applied}
    if hasattr(strategy.update_policy, "part_updates"):
        out["part_updates"] = strategy.update_policy.part_updates()
    if trace:
        # fit's step (the model's train_step under strategy.run), traced
        # again here to read its graph.
        @tf.function
        def step(x, y):
            return strategy.run(model.train_step, args=((x, y),))

        out["step_ops"] = _step_ops(step.get_concrete_function(
            tf.TensorSpec([BATCH, len(DIMS)], tf.int64),
            tf.TensorSpec([BATCH, 1], tf.float32)).graph.as_graph_def())
    return out


def _run_keras3(c, ids, ys, table0, kernel0, steps, optimizer, lr):
    """The Keras 3 layer under the strategy's Keras 3 fit, against Keras 3
    in one process: (max abs difference, shards, moved)."""
    import keras

    def make():
        const = keras.initializers.Constant
        inp = keras.Input((len(DIMS),), dtype="int64")
        rows = ec_lib.keras3_layer()(DIMS, DIM, embeddings_initializer=const(table0),
                                     name="tables")(inp)
        model = keras.Model(inp, keras.layers.Dense(
            1, use_bias=False, kernel_initializer=const(kernel0))(keras.layers.Flatten()(rows)))
        model.compile(make_optimizer(optimizer, lr, "keras3"), "mse")
        return model

    strategy = tf_asyncps.AsyncParameterServerStrategy(
        c.resolver(), variable_partitioner=tf.distribute.experimental.partitioners
        .MinSizePartitioner(min_shard_bytes=64, max_shards=2))
    with strategy.scope():
        model = make()
    data = tf.data.Dataset.from_tensor_slices((ids, ys)).batch(BATCH).repeat()
    model.fit(data, epochs=1, steps_per_epoch=steps, verbose=0)
    ref = make()
    ref.fit(data, epochs=1, steps_per_epoch=steps, verbose=0)
    got, want = model.get_weights(), ref.get_weights()
    return {"max_abs_diff": float(max(np.max(np.abs(a - b)) for a, b in zip(got, want))),
            "shards": len(tf_asyncps.keras3.trainable_shards(model)) - 1,
            "moved": float(np.max(np.abs(got[0] - table0)))}


def _dynamic_model(kernel):
    """DynamicEmbeddingCollection of the 4 features (capacity 88, zero rows)."""
    from tf_asyncps.layers import dynamic_collection
    inp = tf_keras.Input((len(DIMS),), dtype="int64")
    rows = dynamic_collection.DynamicEmbeddingCollection(
        len(DIMS), DIM, capacity=sum(DIMS), initializer="zeros", name="tables")(inp)
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
    values), its table split over the 2 ps, against one process: the max
    abs difference of each feature's rows (by raw id) and the kernel, the
    live rows per feature, and the finds of a traced step."""
    raw = ids.astype(np.int64) * 1_000_000_007 + 2**40  # equal raw ids across features
    strategy = tf_asyncps.AsyncParameterServerStrategy(
        c.resolver(), variable_partitioner=tf.distribute.experimental.partitioners
        .MinSizePartitioner(min_shard_bytes=64, max_shards=2))
    with strategy.scope():
        model = _dynamic_model(kernel0)
        model.compile(make_optimizer(optimizer, lr), "mse")
    data = tf_keras.utils.experimental.DatasetCreator(
        lambda ctx: tf.data.Dataset.from_tensor_slices((raw, ys)).batch(BATCH).repeat())
    model.fit(data, epochs=1, steps_per_epoch=steps, verbose=0)
    ref = _dynamic_model(kernel0)
    ref.compile(make_optimizer(optimizer, lr), "mse")
    ref.fit(raw, ys, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    got, want = model.get_layer("tables").export(), ref.get_layer("tables").export()
    diff = float(np.max(np.abs(full_value(model.layers[-1].kernel) -
                               np.asarray(ref.layers[-1].kernel.numpy()))))
    live = []
    for f in range(len(DIMS)):
        rows = dict(zip(want[f][0].tolist(), want[f][1]))
        assert sorted(rows) == sorted(got[f][0].tolist()), f
        live.append(len(rows))
        for r, row in zip(got[f][0].tolist(), got[f][1]):
            diff = max(diff, float(np.max(np.abs(row - rows[r]))))

    @tf.function
    def step(x, y):
        return strategy.run(model.train_step, args=((x, y),))

    graph = step.get_concrete_function(tf.TensorSpec([BATCH, len(DIMS)], tf.int64),
                                       tf.TensorSpec([BATCH, 1], tf.float32)).graph
    table = model.get_layer("tables").dynamic_table
    return {"max_abs_diff": diff, "live": live, "want_live": [len(set(raw[:, f].tolist()))
                                                               for f in range(len(DIMS))],
            "shards": len(table.shards), "finds": _find_ops(graph.as_graph_def()),
            "applied": strategy.staleness_stats().applied,
            "moved": float(max(np.max(np.abs(got[f][1])) for f in range(len(DIMS))))}


@scenario(shares_cluster=True)
def embedding_collection_fit(steps=8, optimizer="adagrad", lr=0.3):
    """fit with the table split over 2 ps tasks (MinSizePartitioner) against
    one-process tf_keras training on the same batches: ``async`` (and the
    ops of its traced step), then ``route`` (tables async, the rest async)
    with rows crossing as bfloat16; then the Keras 3 layer against Keras 3;
    then DynamicEmbeddingCollection (raw ids) against one process."""
    ids, ys, table0, kernel0 = _problem(steps)
    with cluster(num_workers=1, num_ps=2) as c:
        runs = [_run(c, ids, ys, table0, kernel0, steps, optimizer, lr, "async", None, True),
                _run(c, ids, ys, table0, kernel0, steps, optimizer, lr, "route", "bfloat16",
                     False)]
        keras3 = _run_keras3(c, ids, ys, table0, kernel0, steps, optimizer, lr)
        dynamic = _run_dynamic(c, ids, ys, kernel0, steps, optimizer, lr)
    ref = _model(table0, kernel0)
    ref.compile(make_optimizer(optimizer, lr), "mse")
    ref.fit(ids, ys, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    ref_table, ref_kernel = ref.get_weights()
    for run in runs:
        table, kernel = run.pop("table"), run.pop("kernel")
        run["max_abs_diff"] = float(max(np.max(np.abs(table - ref_table)),
                                        np.max(np.abs(kernel - ref_kernel))))
        run["moved"] = float(np.max(np.abs(table - table0)))
    return {"runs": runs, "keras3": keras3, "dynamic": dynamic}
