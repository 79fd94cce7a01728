"""bfloat16 on the wire (#24 item 4): what is cast, where, and what stays float32.

In one process, no TensorFlow servers: grads.copy_to (the engine's copy of a
gradient to its variable's ps) and core/lookup.py's row reads with
``wire_dtype=tf.bfloat16``, their traced graphs (which op is placed where) and
their values; the strategy's refusal of a bad ``wire_dtype``. The ps keeping
float32 variables and slots in a running cluster: the cluster tests below
(``dense_traffic`` sits above the test that reads it, docs/tests.md#scenarios-beside-their-tests;
the others are test_fit_exactness.py's and test_sharded.py's).
"""

import contextlib
import dataclasses

import numpy as np
import pytest
import tensorflow as tf

from scenarios import cluster, scenario
from scenarios.common import cluster_tcp_bytes

from tf_asyncps.core import grads as grads_lib
from tf_asyncps.core import lookup

PS, WORKER = "/job:ps/task:1", "/job:worker/task:0"
REL = 2.0 ** -8  # bfloat16: 8 significant bits, round to nearest


def _casts(graph):
    return [(op.get_attr("SrcT").name, op.get_attr("DstT").name, op.device)
            for op in graph.get_operations() if op.type == "Cast"]


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "indexed_slices"])
def test_a_float32_gradient_crosses_as_bfloat16_and_is_float32_on_the_ps(sparse):
    @tf.function
    def send(values):
        with tf.device(WORKER):
            g = tf.identity(values)
            if sparse:
                g = tf.IndexedSlices(g, tf.constant([4, 0]), tf.constant([9, 3]))
            out = grads_lib.copy_to(g, PS, wire_dtype=tf.bfloat16)
        return out.values if sparse else out

    graph = send.get_concrete_function(tf.TensorSpec([2, 3])).graph
    assert _casts(graph) == [("float32", "bfloat16", WORKER), ("bfloat16", "float32", PS)]
    # What crosses (the copy placed on the ps) is the bfloat16 tensor.
    copies = [op for op in graph.get_operations()
              if op.type in ("Identity", "Snapshot") and op.device == PS
              and op.inputs[0].dtype.is_floating]
    assert [op.inputs[0].dtype for op in copies] == [tf.bfloat16]
    assert send.get_concrete_function(tf.TensorSpec([2, 3])).structured_outputs.dtype == tf.float32


def test_values_round_trip_within_bfloat16_precision():
    x = np.random.RandomState(0).randn(1000).astype("float32") * 1e3
    x[:3] = [1.0, 1.0 + 2.0 ** -7, 1.0 + 2.0 ** -9]  # exact, exact, rounds to 1
    out = grads_lib.copy_to(tf.constant(x), "/cpu:0", wire_dtype=tf.bfloat16)
    assert out.dtype == tf.float32
    got = out.numpy()
    assert got[:3].tolist() == [1.0, 1.0 + 2.0 ** -7, 1.0]
    assert np.max(np.abs(got - x) / np.abs(x)) <= REL
    assert np.mean(got != x) > 0.9  # it was rounded: not a no-op


@pytest.mark.parametrize("dtype", [tf.int64, tf.float64, tf.float16])
def test_other_dtypes_cross_as_they_are(dtype):
    @tf.function
    def send(values):
        return grads_lib.copy_to(values, PS, wire_dtype=tf.bfloat16)

    graph = send.get_concrete_function(tf.TensorSpec([3], dtype)).graph
    assert _casts(graph) == []
    # And float32 with no wire dtype, or float32 named: no cast either.
    for wire in (None, tf.float32):
        graph = tf.function(lambda v, w=wire: grads_lib.copy_to(v, PS, wire_dtype=w)) \
            .get_concrete_function(tf.TensorSpec([3])).graph
        assert _casts(graph) == []


@pytest.mark.parametrize("distinct", [True, False], ids=["distinct_ids", "every_id"])
def test_a_row_read_crosses_as_bfloat16_cast_beside_the_table(distinct):
    table = tf.Variable(np.random.RandomState(3).randn(9, 4).astype("float32"))
    plain = tf.Variable(table.numpy())
    assert lookup.read_distinct_rows(table, distinct=distinct, wire_dtype=tf.bfloat16)
    ids = np.array([[3, 1, 3], [7, 3, 1]], np.int64)

    def rows_and_grad(var):
        @tf.function
        def run(ids):
            with tf.GradientTape() as tape:
                out = tf.nn.embedding_lookup(var, ids)
                loss = tf.reduce_sum(out * tf.range(1.0, 5.0))
            return out, tf.convert_to_tensor(tape.gradient(loss, var))
        return run

    run = rows_and_grad(table)
    out, grad = run(ids)
    want, want_grad = rows_and_grad(plain)(ids)
    assert out.dtype == tf.float32 and out.shape == (2, 3, 4)
    np.testing.assert_array_equal(
        out.numpy(), tf.cast(tf.cast(want, tf.bfloat16), tf.float32).numpy())
    assert np.max(np.abs(out.numpy() - want.numpy()) / np.abs(want.numpy())) <= REL
    # Small integers are exact in bfloat16: the gradient is the plain one.
    np.testing.assert_array_equal(grad.numpy(), want_grad.numpy())
    assert table.dtype == tf.float32

    graph = run.get_concrete_function(ids).graph
    gather = [op for op in graph.get_operations() if op.type == "ResourceGather"]
    assert len(gather) == 1
    [to_wire] = gather[0].outputs[0].consumers()
    assert (to_wire.type, to_wire.get_attr("DstT")) == ("Cast", tf.bfloat16)
    # Placed with the read (on the table's ps), the float32 cast with the ids.
    assert to_wire.colocation_groups() == gather[0].colocation_groups()
    [back] = to_wire.outputs[0].consumers()
    assert (back.type, back.get_attr("DstT")) == ("Cast", tf.float32)
    assert back.colocation_groups() != gather[0].colocation_groups()


def test_eager_row_reads_are_not_cast():
    table = tf.Variable(np.random.RandomState(4).randn(5, 2).astype("float32") * 1e3)
    lookup.read_distinct_rows(table, wire_dtype=tf.bfloat16)
    np.testing.assert_array_equal(tf.gather(table, [2, 2]).numpy(), table.numpy()[[2, 2]])


@pytest.mark.parametrize("bad", ["float16", "bf16", 16, True, tf.float16])
def test_a_bad_wire_dtype_is_refused_with_the_field_name(bad):
    from tf_asyncps import AsyncParameterServerStrategy
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec({"chief": ["localhost:1"], "ps": ["localhost:2"],
                              "worker": ["localhost:3"]}), task_type="chief", task_id=0)
    with pytest.raises(ValueError) as err:
        AsyncParameterServerStrategy(resolver, wire_dtype=bad)
    assert str(err.value) == (
        "wire_dtype must be one of None, 'float32', 'bfloat16' (the dtype float32 "
        f"gradients and weights read cross the network in), got {bad!r}.")


@pytest.mark.cluster
@pytest.mark.timeout(300)
def test_one_worker_fit_over_a_bfloat16_wire_trains_and_keeps_float32_on_the_ps():
    from conftest import run_scenario
    from test_fit_exactness import single_worker_fits
    bf16, f32 = run_scenario(single_worker_fits, shared=(1, 1), cases=[
        {"optimizer": "adam", "lr": 0.01, "wire_dtype": "bfloat16"},
        {"optimizer": "adam", "lr": 0.01}]).runs
    for r in (bf16, f32):
        assert r.stats.applied == r.stats.global_step == 40
        assert r.moved > 1e-2  # training really changed the weights
        # Variables and Adam's m and v (and its counter) are float32 on the ps.
        assert r.dtypes == ["float32"] and r.slots == 9
    assert f32.max_abs_diff < 1e-5  # the float32 wire: the single-process run
    # bfloat16 gradients: Adam's updates move, but by much less than training does.
    assert 1e-5 < bf16.max_abs_diff < 0.1 * bf16.moved


@pytest.mark.cluster
@pytest.mark.timeout(300)
def test_a_bfloat16_wire_halves_the_bytes_of_the_rows_read_and_their_gradients():
    """TCP bytes per step of a 10,000 x 64 table, 64 ids per step (~64
    distinct): its rows read and their gradient rows are 2 x 64 x 64 x 4 =
    32,768 float32 bytes a step; bfloat16 saves half of that (measured:
    52,014 -> 34,555 bytes a step, 17,459 saved: the rows plus the Dense
    kernel's gradient, 64 x 2 bytes)."""
    from conftest import run_scenario
    from test_sharded import embedding_traffic
    f32, bf16 = run_scenario(embedding_traffic, timeout=240, rows_list=[10_000], dim=64,
                             wire_dtypes=[None, "bfloat16"]).runs
    assert (f32.wire_dtype, bf16.wire_dtype) == (None, "bfloat16")
    saved, expected = f32.bytes_per_step - bf16.bytes_per_step, 2 * 64 * 64 * 2
    assert 0.9 * expected < saved < 1.2 * expected


def _dense_read_graph(var, in_step=True, applying=False):
    """(output, gradient, graph) of x @ var traced in a worker step (or not)."""
    from tf_asyncps.core.step import WorkerStep
    x = tf.constant(np.random.RandomState(6).randn(2, 3).astype("float32"))

    @tf.function
    def run():
        step = WorkerStep(None, tf.constant(0, tf.int64))
        step._applying = applying
        with (step.active() if in_step else contextlib.nullcontext()):
            with tf.GradientTape() as tape:
                out = tf.matmul(x, var) + var.read_value()[0]
                loss = tf.reduce_sum(out)
            return out, tape.gradient(loss, var)

    out, grad = run()
    return out, grad, run.get_concrete_function().graph


def test_a_dense_read_in_a_worker_step_crosses_as_bfloat16_cast_beside_the_variable():
    from tf_asyncps.core import wire_reads
    w = np.random.RandomState(5).randn(3, 4).astype("float32")
    var, plain = tf.Variable(w), tf.Variable(w)
    assert wire_reads.cast_dense_reads(var, tf.bfloat16)
    out, grad, graph = _dense_read_graph(var)
    want, want_grad, _ = _dense_read_graph(plain)
    w16 = tf.cast(tf.cast(w, tf.bfloat16), tf.float32).numpy()
    x = np.random.RandomState(6).randn(2, 3).astype("float32")
    np.testing.assert_allclose(out.numpy(), x @ w16 + w16[0], rtol=1e-6)
    assert np.abs(out.numpy() - want.numpy()).max() > 0  # rounded: not the float32 read
    # The gradient is 2 (x's column sums + 1): rounded to bfloat16 on the way back.
    np.testing.assert_array_equal(
        grad.numpy(), tf.cast(tf.cast(want_grad, tf.bfloat16), tf.float32).numpy())
    reads = [op for op in graph.get_operations() if op.type == "ReadVariableOp"]
    assert len(reads) == 2  # matmul's and read_value's
    for read in reads:
        [to_wire] = read.outputs[0].consumers()
        assert (to_wire.type, to_wire.get_attr("DstT")) == ("Cast", tf.bfloat16)
        assert to_wire.colocation_groups() == read.colocation_groups()  # on the ps
        [back] = to_wire.outputs[0].consumers()
        assert (back.type, back.get_attr("DstT")) == ("Cast", tf.float32)
        assert back.colocation_groups() != read.colocation_groups()
    assert var.dtype == tf.float32
    np.testing.assert_array_equal(var.numpy(), w)  # eager reads: exact


@pytest.mark.parametrize("where", ["no_step", "update"])
def test_dense_reads_outside_a_step_or_in_its_update_are_not_cast(where):
    from tf_asyncps.core import wire_reads
    var = tf.Variable(np.random.RandomState(5).randn(3, 4).astype("float32"))
    wire_reads.cast_dense_reads(var, tf.bfloat16)
    _, _, graph = _dense_read_graph(var, in_step=where == "update",
                                    applying=where == "update")
    assert [op for op in graph.get_operations() if op.type == "Cast"] == []


@pytest.mark.parametrize("dtype", [tf.float64, tf.int64])
def test_dense_reads_of_other_dtypes_are_left_alone(dtype):
    from tf_asyncps.core import wire_reads
    assert not wire_reads.cast_dense_reads(tf.Variable(tf.zeros([2], dtype)), tf.bfloat16)
    assert not wire_reads.cast_dense_reads(tf.Variable(tf.zeros([2])), None)


@dataclasses.dataclass(frozen=True)
class DenseTrafficRun:
    """One wire dtype's measured fit of the MLP.

    Attributes:
      wire_dtype: the strategy's wire_dtype (None: float32).
      bytes_per_step: TCP bytes the cluster's tasks sent per worker step.
      params: the model's parameters.
      dtypes: the model weights' dtypes (sorted, distinct).
    """
    wire_dtype: str | None
    bytes_per_step: float
    params: int
    dtypes: list[str]


@dataclasses.dataclass(frozen=True)
class DenseTraffic:
    """Attributes: runs: one DenseTrafficRun per wire dtype, in order."""
    runs: list[DenseTrafficRun]


@scenario
def dense_traffic(hidden=256, steps=60, wire_dtypes=(None, "bfloat16")) -> DenseTraffic:
    """TCP bytes per worker step (all the cluster's tasks, 1 worker, 1 ps) of
    an MLP 64-``hidden``-10 (tf_keras fit, SGD), once per ``wire_dtypes``
    entry: each step reads every weight and pushes every gradient."""
    import tf_keras
    import tf_asyncps
    rng = np.random.RandomState(0)
    x = rng.randn(32 * steps, 64).astype(np.float32)
    y = rng.randint(0, 10, size=(32 * steps,)).astype(np.int64)
    out = []
    with cluster(num_workers=1, num_ps=1) as c:
        for wire in wire_dtypes:
            strategy = tf_asyncps.AsyncParameterServerStrategy(c.resolver(), wire_dtype=wire)
            with strategy.scope():
                model = tf_keras.Sequential([
                    tf_keras.Input(shape=(64,)),
                    tf_keras.layers.Dense(hidden, activation="relu"),
                    tf_keras.layers.Dense(10)])
                model.compile(tf_keras.optimizers.SGD(0.05), tf_keras.losses.SparseCategoricalCrossentropy(
                    from_logits=True), steps_per_execution=10)
            data = tf_keras.utils.experimental.DatasetCreator(
                lambda ctx: tf.data.Dataset.from_tensor_slices((x, y)).batch(32).repeat())
            model.fit(data, epochs=1, steps_per_epoch=20, verbose=0)  # traced, warm
            before = cluster_tcp_bytes(c)
            model.fit(data, epochs=1, steps_per_epoch=steps, verbose=0)
            out.append(DenseTrafficRun(
                wire_dtype=wire, bytes_per_step=(cluster_tcp_bytes(c) - before) / steps,
                params=int(model.count_params()),
                dtypes=sorted({v.dtype.name for v in model.weights})))
    return DenseTraffic(runs=out)


@pytest.mark.cluster
@pytest.mark.timeout(300)
def test_a_bfloat16_wire_halves_the_bytes_of_a_dense_model():
    """An MLP 64-256-10 (19,210 float32 parameters, 76,840 bytes): a step
    reads every weight and pushes every gradient, 2 x 76,840 bytes of float32;
    over a bfloat16 wire both cross in half of that (the reads cast on the
    ps, core/wire_reads.py; the gradients on the worker, grads.copy_to)."""
    from conftest import run_scenario
    f32, bf16 = run_scenario(dense_traffic, timeout=240).runs
    assert f32.params == bf16.params == 64 * 256 + 256 + 256 * 10 + 10
    assert f32.dtypes == bf16.dtypes == ["float32"]  # the variables stay float32
    saved, expected = f32.bytes_per_step - bf16.bytes_per_step, 2 * f32.params * 2
    assert 0.95 * expected < saved < 1.1 * expected
