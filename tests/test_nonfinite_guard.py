"""The non-finite check as one cond per variable on its ps task
(tf_asyncps/core/nonfinite_guard.py), in one process: the counters recorded
without a cond, the optimizer counter that adds only for an applied step,
the redirected reads, the gated update, the constants moved beside their
consumers. On the cluster: tests/test_sharded.py's ``nan_*`` cases (NaN
steps dropped on each ps task, equal to one process without them)."""

import numpy as np
import pytest
import tensorflow as tf

from tf_asyncps.compat import graph as graph_compat
from tf_asyncps.compat import variables as variables_compat
from tf_asyncps.core import placement, nonfinite_guard
from tf_asyncps.core.staleness import StalenessTracker


def test_record_gated_counts_as_record_and_record_increment_do():
    gated, plain = StalenessTracker(4, device="/cpu:0"), StalenessTracker(4, device="/cpu:0")
    for t in (gated, plain):
        t.global_step.assign(3)
    # applied, τ from the increment; applied with τ given; dropped (non-finite).
    g1 = gated.record_gated(tf.constant(1, tf.int64), tf.constant(True))
    p1 = plain.record_increment(tf.constant(1, tf.int64))
    g2 = gated.record_gated(tf.constant(2, tf.int64), tf.constant(True), tau=tf.constant(6, tf.int64))
    p2 = plain.record(tf.constant(6, tf.int64), applied=True)
    g3 = gated.record_gated(tf.constant(0, tf.int64), tf.constant(False))
    p3 = plain.record(tf.constant(5, tf.int64), applied=False, nonfinite=tf.constant(True))
    assert [int(x) for x in (g1, g2, g3)] == [int(x) for x in (p1, p2, p3)] == [4, 5, 5]
    a, b = gated.stats(), plain.stats()
    assert a.to_dict() == b.to_dict()
    assert (a.applied, a.dropped, a.nonfinite, a.max) == (2, 1, 1, 6)  # max: unclipped
    assert a.histogram.tolist() == [0, 0, 1, 0, 1]  # τ 2 and τ 6 (last bin)
    assert a.dropped_histogram.tolist() == [0, 0, 0, 0, 1]  # τ 5


@pytest.mark.parametrize("pred", [True, False])
def test_adding_only_if_adds_only_for_a_true_predicate_then_goes_away(pred):
    counter = tf.Variable(tf.constant(7, tf.int64))

    @tf.function
    def step(p):
        with variables_compat.adding_only_if(counter, p):
            return counter.assign_add(1)

    step(tf.constant(pred))
    assert int(counter.numpy()) == 7 + int(pred)
    assert "assign_add" not in vars(counter)
    counter.assign_add(1)
    assert int(counter.numpy()) == 8 + int(pred)


def test_reads_redirected_replaces_dense_reads_then_puts_them_back():
    var = tf.Variable([1.0, 2.0])
    with variables_compat.reads_redirected(var, lambda read: read() * 10.0):
        assert tf.convert_to_tensor(var).numpy().tolist() == [10.0, 20.0]
        assert (var * 1.0).numpy().tolist() == [10.0, 20.0]
    assert tf.convert_to_tensor(var).numpy().tolist() == [1.0, 2.0]
    assert "_read_variable_op" not in vars(var)


@pytest.mark.parametrize("finite", [True, False])
def test_a_gated_update_runs_only_for_a_finite_step(finite):
    var, lr = tf.Variable([1.0, 2.0]), tf.Variable(0.5)

    def sgd(v, g):
        return v.assign_sub(lr * g)

    @tf.function
    def step(ok, g):
        with nonfinite_guard.guarded_by(ok, hoisted=[lr]) as gated:
            assert nonfinite_guard.active() is ok
            out = nonfinite_guard.guard(var, sgd)(var, g)
        assert gated == {id(var)}
        return out

    applied = step(tf.constant(finite), tf.constant([2.0, 4.0]))
    assert bool(applied) is finite
    assert var.numpy().tolist() == ([0.0, 0.0] if finite else [1.0, 2.0])
    assert nonfinite_guard.active() is None
    assert nonfinite_guard.guard(var, sgd) is sgd  # no gate outside the context


@pytest.mark.parametrize("finite", [True, False])
def test_a_rowwise_sparse_update_is_gated_by_its_rows_without_a_cond(finite):
    # rowwise_sparse (tf_keras Adagrad's sparse rule writes only its rows): a
    # table's update gets its gradient's rows, or none; no If op is traced.
    var, lr = tf.Variable([[1.0], [2.0], [3.0]]), tf.Variable(0.5)

    def scatter(v, g):
        return v.scatter_sub(tf.IndexedSlices(lr * g.values, g.indices))

    @tf.function
    def step(ok, values):
        g = tf.IndexedSlices(values, tf.constant([2, 0]), tf.constant([3, 1]))
        with nonfinite_guard.guarded_by(ok, hoisted=[lr], rowwise_sparse=True) as gated:
            out = nonfinite_guard.guard(var, scatter)(var, g)
        assert gated == {id(var)}
        return out

    values = tf.constant([[2.0], [4.0]] if finite else [[np.nan], [4.0]])
    applied = step(tf.constant(finite), values)
    assert bool(applied) is finite
    assert var.numpy().tolist() == ([[-1.0], [2.0], [2.0]] if finite else [[1.0], [2.0], [3.0]])
    ops = {op.type for op in step.get_concrete_function(
        tf.TensorSpec([], tf.bool), tf.TensorSpec([2, 1])).graph.get_operations()}
    assert not ops & {"If", "StatelessIf"}


@pytest.mark.parametrize("finite", [True, False])
def test_a_dense_update_whose_zero_changes_nothing_is_gated_without_a_cond(finite):
    # zero_is_noop (tf_keras Adagrad): a dense update gets the gradient or
    # zeros; a dropped step leaves the variable and its accumulator as they were.
    var, acc, lr = tf.Variable([1.0, -2.0]), tf.Variable([0.1, 0.1]), tf.Variable(0.5)

    def adagrad(v, g):
        acc.assign_add(g * g)
        return v.assign_sub(lr * g / tf.sqrt(acc + 1e-7))

    @tf.function
    def step(ok, g):
        with nonfinite_guard.guarded_by(ok, hoisted=[lr], zero_is_noop=True) as gated:
            out = nonfinite_guard.guard(var, adagrad)(var, g)
        assert gated == {id(var)}
        return out

    g = [3.0, 4.0] if finite else [np.nan, np.inf]
    applied = step(tf.constant(finite), tf.constant(g))
    assert bool(applied) is finite
    if finite:
        np.testing.assert_allclose(acc.numpy(), [9.1, 16.1], rtol=1e-6)
        np.testing.assert_allclose(var.numpy(), [1.0 - 1.5 / np.sqrt(9.1 + 1e-7),
                                                 -2.0 - 2.0 / np.sqrt(16.1 + 1e-7)], rtol=1e-6)
    else:
        assert var.numpy().tolist() == [1.0, -2.0]
        assert acc.numpy().tolist() == np.float32([0.1, 0.1]).tolist()
    ops = {op.type for op in step.get_concrete_function(
        tf.TensorSpec([], tf.bool), tf.TensorSpec([2])).graph.get_operations()}
    assert not ops & {"If", "StatelessIf"}


@pytest.mark.parametrize("finite", [True, False])
def test_a_sparse_update_whose_zero_changes_nothing_gets_zero_rows(finite):
    # zero_is_noop with a sparse gradient: the same rows, zeros where not finite.
    var, acc, lr = tf.Variable([[1.0], [2.0], [3.0]]), tf.Variable([[0.1]] * 3), tf.Variable(0.5)

    def adagrad(v, g):
        acc.scatter_add(tf.IndexedSlices(g.values * g.values, g.indices))
        denominator = tf.sqrt(tf.gather(acc, g.indices) + 1e-7)
        return v.scatter_add(tf.IndexedSlices(-lr * g.values / denominator, g.indices))

    @tf.function
    def step(ok, values):
        g = tf.IndexedSlices(values, tf.constant([2, 0]), tf.constant([3, 1]))
        with nonfinite_guard.guarded_by(ok, hoisted=[lr], rowwise_sparse=True,
                                        zero_is_noop=True):
            return nonfinite_guard.guard(var, adagrad)(var, g)

    values = tf.constant([[2.0], [4.0]] if finite else [[np.nan], [np.inf]])
    assert bool(step(tf.constant(finite), values)) is finite
    if finite:
        np.testing.assert_allclose(var.numpy()[:, 0], [1.0 - 2.0 / np.sqrt(16.1 + 1e-7), 2.0,
                                                       3.0 - 1.0 / np.sqrt(4.1 + 1e-7)],
                                   rtol=1e-6)
    else:
        assert var.numpy().tolist() == [[1.0], [2.0], [3.0]]
        assert acc.numpy().tolist() == np.float32([[0.1]] * 3).tolist()
    ops = [op.type for op in step.get_concrete_function(
        tf.TensorSpec([], tf.bool), tf.TensorSpec([2, 1])).graph.get_operations()]
    assert "If" not in ops and "StridedSlice" not in ops and ops.count("SelectV2") == 1


def test_only_tf_keras_adagrad_with_a_positive_epsilon_updates_nothing_on_zeros():
    import tf_keras
    from tf_asyncps.compat import optimizers as optimizers_compat
    assert optimizers_compat.update_is_noop_at_zero(tf_keras.optimizers.Adagrad(0.1))
    for opt in (tf_keras.optimizers.Adagrad(0.1, epsilon=0.0), tf_keras.optimizers.SGD(0.1),
                tf_keras.optimizers.Adam(0.1), tf_keras.optimizers.legacy.Adagrad(0.1)):
        assert not optimizers_compat.update_is_noop_at_zero(opt), opt


def test_constants_move_beside_their_only_consumers():
    graph = tf.Graph()
    with graph.as_default():
        with tf.device("/job:ps/task:1"):
            x = tf.compat.v1.placeholder(tf.float32, [3])
        with tf.device("/job:ps/task:0"):
            c_one = tf.constant([1.0, 2.0, 3.0])  # read on task 1 only
            c_both = tf.constant(2.0)  # read on both tasks
            y0 = c_both * 1.0
        with tf.device("/job:ps/task:1"):
            y1 = x + c_one + c_both
        moved = graph_compat.constants_beside_consumers(graph.get_operations())
    assert moved == 1
    assert c_one.op.device == y1.op.device == "/job:ps/task:1"
    assert c_both.op.device == y0.op.device == "/job:ps/task:0"


def test_one_per_device_groups_ops_and_skips_constants():
    graph = tf.Graph()
    with graph.as_default():
        ops = []
        for task in (0, 1, 1):
            with tf.device(f"/job:ps/task:{task}"):
                ops.append(tf.Variable(1.0).assign_add(1.0).op)
                ops.append(tf.constant(1.0).op)
        grouped = placement.one_per_device(ops)
    assert sorted(op.device for op in grouped) == ["/job:ps/task:0", "/job:ps/task:1"]
    assert sorted(len(op.control_inputs) for op in grouped) == [1, 2]
    assert all(c.type != "Const" for op in grouped for c in op.control_inputs)
    assert np.all([op.type == "NoOp" for op in grouped])
