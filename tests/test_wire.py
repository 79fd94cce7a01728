"""What a step sends: distinct rows only, and each gradient op on its own ps.

In one process, no TensorFlow servers: the rules of core/lookup.py,
core/grads.unique_rows and core/placement.beside_inputs on hand-made
tensors, in closed form, and the graphs they trace (which op reads which
ids, where each op is placed). Bytes per step are bench figures
(docs/benchmarks.md#bytes-per-step-on-an-embedding-nameemb).
"""

import numpy as np
import pytest
import tensorflow as tf
import tf_keras

from tf_asyncps.core import grads as grads_lib
from tf_asyncps.core import lookup, placement, table_seam

IDS = np.array([[3, 1, 3], [7, 3, 1], [1, 1, 1], [0, 7, 3]], np.int64)  # 4 distinct of 12


def _ancestors(tensor):
    """The op types ``tensor`` is computed from."""
    seen, todo = set(), [tensor.op]
    while todo:
        op = todo.pop()
        if op.type not in seen:
            seen.add(op.type)
            todo.extend(t.op for t in op.inputs)
    return seen


def _table(seed=0, rows=9, dim=2):
    return tf.Variable(np.random.RandomState(seed).randn(rows, dim).astype("float32"))


def test_unique_rows_sums_the_rows_of_repeated_ids():
    g = tf.IndexedSlices(tf.constant([[1.0, 2.0], [10.0, 20.0], [100.0, 200.0]]),
                         tf.constant([5, 2, 5]), tf.constant([9, 2]))
    out = grads_lib.unique_rows(g)
    assert out.indices.numpy().tolist() == [5, 2]
    assert out.values.numpy().tolist() == [[101.0, 202.0], [10.0, 20.0]]
    assert out.dense_shape.numpy().tolist() == [9, 2]
    dense = tf.constant([1.0, 2.0])
    assert grads_lib.unique_rows(dense) is dense


def test_a_lookup_reads_each_distinct_id_once_with_the_same_rows_and_gradient():
    plain, deduped = _table(), _table()
    assert lookup.read_distinct_rows(deduped) and lookup.read_distinct_rows(deduped)

    def rows_and_grad(var):
        # One function per variable (closed over): a variable passed as an
        # argument would share the first variable's trace.
        @tf.function
        def run(ids):
            with tf.GradientTape() as tape:
                out = tf.nn.embedding_lookup(var, ids)
                loss = tf.reduce_sum(out * tf.range(1.0, 3.0))
            return out, tf.convert_to_tensor(tape.gradient(loss, var))
        return run

    run_p, run_d = rows_and_grad(plain), rows_and_grad(deduped)
    out_p, grad_p = run_p(IDS)
    out_d, grad_d = run_d(IDS)
    assert out_d.shape == (4, 3, 2)
    np.testing.assert_array_equal(out_d.numpy(), out_p.numpy())
    # id 1 is looked up 5 times: its gradient row is 5 x [1, 2].
    np.testing.assert_allclose(grad_d.numpy(), grad_p.numpy())
    assert grad_d.numpy()[1].tolist() == [5.0, 10.0]

    def ops(run, kind):
        graph = run.get_concrete_function(IDS).graph
        return [op for op in graph.get_operations() if op.type == kind]
    # The distinct int64 ids cross as int32 (a table under 2**31 rows).
    [gather] = ops(run_d, "ResourceGather")
    assert gather.inputs[1].dtype == tf.int32
    assert gather.inputs[1].op.type == "Cast"
    assert "Unique" in _ancestors(gather.inputs[1])
    assert [op.inputs[1].op.type for op in ops(run_p, "ResourceGather")] != ["Cast"]
    # The rows are expanded beside the ids; the gradient is one segment sum
    # there at the read's own positions, which reads no shape of the ps's
    # rows (that would be one more transfer a step).
    [expand] = ops(run_d, "GatherV2")
    assert expand.colocation_groups() != gather.colocation_groups()
    # (The other one is the test's own conversion of the gradient to dense.)
    sums = ops(run_d, "UnsortedSegmentSum")
    assert len(sums) == 2 and sum(s.inputs[1] is expand.inputs[1] for s in sums) == 1
    assert [c.type for c in gather.outputs[0].consumers()] == ["GatherV2"]


def test_ids_out_of_a_tables_range_are_still_refused():
    table = _table()
    lookup.read_distinct_rows(table)
    run = tf.function(lambda ids: tf.nn.embedding_lookup(table, ids))
    # 2**32 + 1 would wrap to row 1 as int32: it is clipped, so still refused.
    for bad in (9, 2 ** 32 + 1, -1, -(2 ** 32) + 1):
        with pytest.raises(tf.errors.InvalidArgumentError, match="not in"):
            run(tf.constant([1, bad], tf.int64))
    np.testing.assert_array_equal(run(tf.constant([1, 8], tf.int64)).numpy(),
                                  table.numpy()[[1, 8]])


def test_eager_reads_and_vectors_are_left_as_they_are():
    table = _table()
    lookup.read_distinct_rows(table)
    np.testing.assert_array_equal(tf.gather(table, [2, 2]).numpy(),
                                  table.numpy()[[2, 2]])
    assert lookup.read_distinct_rows(tf.Variable([1.0, 2.0])) is False


@pytest.mark.parametrize("make", [
    lambda: tf_keras.optimizers.SGD(0.1), lambda: tf_keras.optimizers.Adagrad(0.5),
    lambda: tf_keras.optimizers.Adam(0.05), lambda: tf_keras.optimizers.legacy.Adagrad(0.5)],
    ids=["sgd", "adagrad", "adam", "legacy_adagrad"])
def test_tf_keras_updates_through_distinct_rows_equal_the_plain_lookup(make):
    rng = np.random.RandomState(1)
    batches = [rng.zipf(1.5, size=(16, 2)) % 9 for _ in range(6)]  # many repeats
    results = []
    for dedup in (False, True):
        table, opt = _table(seed=2), make()
        if dedup:
            lookup.read_distinct_rows(table)

        @tf.function
        def step(ids):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(tf.square(tf.nn.embedding_lookup(table, ids) - 1.0))
            grad = tape.gradient(loss, table)
            if dedup:
                grad = grads_lib.unique_rows(grad)
            opt.apply_gradients([(grad, table)])

        for ids in batches:
            step(tf.constant(ids, tf.int64))
        results.append(table.numpy())
    assert np.max(np.abs(results[0] - _table(seed=2).numpy())) > 0.05  # it trained
    np.testing.assert_allclose(results[1], results[0], rtol=1e-5, atol=1e-6)


def test_gradient_ops_run_on_their_variables_ps_and_scalars_move():
    @tf.function
    def step(x, tau):
        with tf.device("/job:ps/task:1"):
            g = tf.identity(x)  # a gradient copied to its variable's ps
        with placement.beside_inputs("/job:ps/task:0"):
            s = tf.cast(tau, tf.float32) + 1.0  # τ arithmetic: scalars
            scaled = tf.cond(tau > 0, lambda: g / s, lambda: g)
            with tf.device("/job:ps/task:0"):
                count = tf.identity(tau)  # an explicit device still wins
        return scaled, count

    graph = step.get_concrete_function(tf.TensorSpec([None, 4]),
                                       tf.TensorSpec([], tf.int64)).graph
    device = {op.name: op.device for op in graph.get_operations()}
    assert device["add"] == "/job:ps/task:0"
    assert device["cond"] == "/job:ps/task:1"
    assert device["Identity_1"] == "/job:ps/task:0"
    branch_ops = [n for f in graph.as_graph_def().library.function for n in f.node_def
                  if n.op in ("RealDiv", "Identity")]
    assert branch_ops and {n.device for n in branch_ops} == {"/job:ps/task:1"}


PS = "/job:ps/replica:0/task:1/device:CPU:0"


def _copies_on_ps(graph):
    """The tensors copied onto PS (the Identity or Snapshot ops placed there): what crosses."""
    return [op.inputs[0] for op in graph.get_operations()
            if op.type in ("Identity", "Snapshot") and op.device == PS]


@pytest.mark.parametrize("wire", [None, tf.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("row", [[2, 3], [6]], ids=["rank3", "matrix"])
def test_a_sparse_gradient_crosses_as_one_tensor_with_int32_indices(wire, row):
    values = np.arange(24, dtype=np.float32).reshape([4] + row) / 8  # exact in bfloat16
    indices = np.array([7, 0, 2 ** 31 - 3, 3], np.int64)
    g = tf.IndexedSlices(tf.constant(values), tf.constant(indices),
                         tf.constant([2 ** 31 - 2] + row))
    out = grads_lib.copy_to(g, "/cpu:0", wire_dtype=wire, rows=2 ** 31 - 2)
    assert out.indices.dtype == tf.int64 and out.values.dtype == tf.float32
    assert out.indices.numpy().tolist() == indices.tolist()
    np.testing.assert_array_equal(out.values.numpy(), values)

    @tf.function
    def send(v, i):
        return grads_lib.copy_to(tf.IndexedSlices(v, i, tf.constant([9] + row)), PS,
                                 wire_dtype=wire, rows=9)
    graph = send.get_concrete_function(tf.TensorSpec([None] + row),
                                       tf.TensorSpec([None], tf.int64)).graph
    [crossing] = _copies_on_ps(graph)  # values and indices in one tensor
    # 6 values a row, then the int32 index's bits: 1 float32 or 2 bfloat16.
    assert crossing.dtype == (wire or tf.float32)
    assert crossing.shape.as_list() == [None, 6 + (2 if wire else 1)]


@pytest.mark.parametrize("wire", [None, tf.bfloat16], ids=["float32", "bfloat16"])
def test_a_vectors_sparse_gradient_crosses_as_one_tensor(wire):
    """A per-id bias (a rank-1 variable read by tf.gather): gradient rows of
    one value each; 9 entries, ids 7, 0, 7 (repeated rows stay as they are)."""
    bias = tf.Variable(np.zeros(9, np.float32))

    @tf.function
    def send(ids, device):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.gather(bias, ids) * [0.5, 2.0, 4.0])
        g = tape.gradient(loss, bias)
        out = grads_lib.copy_to(g, device, wire_dtype=wire, rows=9)
        return g.indices, out.values, out.indices

    ids = tf.constant([7, 0, 7], tf.int64)
    sent_indices, values, indices = send(ids, "/cpu:0")
    assert values.dtype == tf.float32 and values.numpy().tolist() == [0.5, 2.0, 4.0]
    assert indices.dtype == sent_indices.dtype and indices.numpy().tolist() == [7, 0, 7]
    [crossing] = _copies_on_ps(send.get_concrete_function(ids, PS).graph)
    assert crossing.shape.as_list() == [3, 1 + (2 if wire else 1)]


@pytest.mark.parametrize("wire", [None, tf.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("repeated", [2, 0])
@pytest.mark.parametrize("rows", [9, 2 ** 31 - 2], ids=["uint16_ids", "int32_ids"])
def test_a_tables_squares_cross_in_the_tensor_of_its_rows(wire, repeated, rows):
    """Keras 3's row-wise Adagrad: a shard's distinct rows, their ids and the
    squares of its ``repeated`` first ids cross as one vector: the two row
    counts (int32 bits), 4 rows of 3 values, the 4 ids (uint16 bits under
    65,535 rows, else int32), then the squares; copies equal copy_to's (0
    squares too), and an id out of range stays out of range."""
    values = np.arange(12, dtype=np.float32).reshape(4, 3) / 8  # exact in bfloat16
    indices = np.array([5, 0, rows + 3, 3], np.int64)
    squares = values[:repeated] ** 2 + 0.25
    g = tf.IndexedSlices(tf.constant(values), tf.constant(indices), tf.constant([rows, 3]))
    out, sq = grads_lib.copy_with_rows_to(g, tf.constant(squares), "/cpu:0", wire_dtype=wire,
                                          rows=rows)
    alone = grads_lib.copy_to(g, "/cpu:0", wire_dtype=wire, rows=rows)
    ids_eager = out.indices.numpy()
    assert out.indices.dtype == tf.int64 and ids_eager[[0, 1, 3]].tolist() == [5, 0, 3]
    assert not 0 <= ids_eager[2] < rows  # refused on the ps as before
    np.testing.assert_array_equal(out.values.numpy(), alone.values.numpy())
    np.testing.assert_array_equal(out.values.numpy(), values)
    assert sq.dtype == tf.float32 and sq.shape.as_list() == [repeated, 3]
    sq_eager = sq.numpy()
    np.testing.assert_array_equal(sq_eager, grads_lib.copy_to(
        tf.constant(squares), "/cpu:0", wire_dtype=wire).numpy())

    cpu = "/job:localhost/replica:0/task:0/device:CPU:0"
    with tf.Graph().as_default() as graph:
        out, sq = grads_lib.copy_with_rows_to(
            tf.IndexedSlices(tf.constant(values), tf.constant(indices), tf.constant([rows, 3])),
            tf.constant(squares), cpu, wire_dtype=wire, rows=rows)
        [crossing] = [op.inputs[0] for op in graph.get_operations()
                      if op.type in ("Identity", "Snapshot") and op.device == cpu]
        with tf.compat.v1.Session() as sess:
            sent, got_ids, got = sess.run([crossing, out.indices, sq])
    # elements of the wire dtype: 2 int32 counts, 4 x 3 values, 4 ids, the squares
    element, id_bytes = (2 if wire else 4), (2 if rows < 2 ** 16 - 1 else 4)
    assert crossing.dtype == (wire or tf.float32)
    assert sent.shape == (2 * 4 // element + 4 * 3 + 4 * id_bytes // element + repeated * 3,)
    assert got_ids.tolist() == ids_eager.tolist()
    np.testing.assert_array_equal(got, sq_eager)


def test_a_sparse_gradient_of_an_unknown_or_huge_table_crosses_as_two_tensors():
    @tf.function
    def send(v, i):
        g = tf.IndexedSlices(v, i, tf.constant([9, 2]))
        return [grads_lib.copy_to(g, PS, rows=rows) for rows in (None, 2 ** 31)]
    graph = send.get_concrete_function(tf.TensorSpec([None, 2]),
                                       tf.TensorSpec([None], tf.int64)).graph
    assert sorted(t.dtype.name for t in _copies_on_ps(graph)) == [
        "float32", "float32", "int64", "int64"]


def test_marked_gather_rows_stay_on_the_ps_in_the_gradient():
    """A dynamic table's gather (indices built on its ps, recorded in the
    table's GatheredRows, asked through on_ps as the engine asks its
    tables): the gradient's IndexedSlices takes the gather's own indices
    tensor, with values reshaped without its size, so nothing of the indices
    is computed on the worker; unique_rows and copy_to leave it as it is (no
    tf.unique, no packing of the indices into the values). The same values
    and indices as the tape's own; an unrecorded gather's gradient is left
    alone."""
    var = _table(dim=4)
    upstream = tf.constant(np.arange(12, dtype=np.float32).reshape(3, 4) / 2)

    @tf.function
    def run(marked):
        found = tf.constant([5, -1, 0, 2], tf.int64)
        rows = tf.boolean_mask(found, found >= 0) - tf.constant(0, tf.int64)  # dynamic size
        gathered = table_seam.GatheredRows()
        if marked:
            gathered.add(rows)
        on_ps = gathered.holds
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.gather(var, rows) * upstream)
        g = tape.gradient(loss, var)
        out = grads_lib.unique_rows(grads_lib.rows_on_ps(g, on_ps), on_ps)
        kept = out.indices.name == rows.name
        copied = grads_lib.copy_to(out, "/cpu:0", rows=int(var.shape[0]), on_ps=on_ps)
        ops = {op.type for op in tf.compat.v1.get_default_graph().get_operations()}
        return out.values, out.indices, copied.values, kept, "Unique" in ops, "Bitcast" in ops

    values, indices, copied, kept, unique, packed = run(True)
    np.testing.assert_array_equal(values.numpy(), upstream.numpy())
    np.testing.assert_array_equal(copied.numpy(), upstream.numpy())
    assert indices.numpy().tolist() == [5, 0, 2]
    assert (bool(kept), bool(unique), bool(packed)) == (True, False, False)
    values, indices, _, kept, unique, packed = run(False)
    np.testing.assert_array_equal(values.numpy(), upstream.numpy())
    assert indices.numpy().tolist() == [5, 0, 2]
    assert (bool(kept), bool(unique), bool(packed)) == (False, True, True)


def _op_types(graph):
    """Op types of ``graph`` and of every function it calls (cond branches)."""
    gd = graph.as_graph_def()
    return [n.op for n in gd.node] + [n.op for f in gd.library.function for n in f.node_def]


def test_a_distinct_id_reads_gradient_is_not_deduplicated_again():
    # Through the engine the read's tf.unique is the step's only one, as the
    # plain step's is tf_keras's own (apply_gradients de-duplicates; the
    # engine on the worker did too), and the update equals the plain one's.
    from local_engine import local_engine
    from tf_asyncps.core.step import WorkerStep
    engine = local_engine("async")
    rng = np.random.RandomState(3)
    batches = [rng.zipf(1.5, size=(16, 2)) % 9 for _ in range(5)]
    results, uniques = [], []
    for through_engine in (False, True):
        table, opt = _table(seed=4), tf_keras.optimizers.Adagrad(0.5)
        if through_engine:
            lookup.read_distinct_rows(table)

        @tf.function
        def step(ids):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(tf.square(tf.nn.embedding_lookup(table, ids) - 1.0))
            grads = [(tape.gradient(loss, table), table)]
            if not through_engine:
                opt.apply_gradients(grads)
                return
            ws = WorkerStep(engine, tf.constant(0, tf.int64), tf.constant(0, tf.int64))
            with ws.active():
                opt.apply_gradients(grads)

        for ids in batches:
            step(tf.constant(ids, tf.int64))
        results.append(table.numpy())
        uniques.append(_op_types(step.get_concrete_function(
            tf.TensorSpec([16, 2], tf.int64)).graph).count("Unique"))
    assert uniques == [1, 1]
    assert np.max(np.abs(results[0] - _table(seed=4).numpy())) > 0.05  # it trained
    np.testing.assert_allclose(results[1], results[0], rtol=1e-5, atol=1e-6)
