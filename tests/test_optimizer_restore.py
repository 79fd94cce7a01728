"""Optimizer slots of sharded variables restored before the optimizer is
built (tf_asyncps.compat.sharded_slots.build_for_pending_restore), in one process:
the table a ``ShardedVariable`` made by hand. On the cluster, through the
strategy's apply_gradients hook: tests/test_sharded.py (a fixed Embedding,
Adam) and tests/test_dynamic_cluster.py (a DynamicEmbedding, Adagrad)."""

import numpy as np
import pytest
import tensorflow as tf
import tf_keras

from tf_asyncps.compat import sharded_slots


def _model(sizes):
    parts = [tf.Variable(tf.zeros([s, 2]), name=f"t/part_{i}") for i, s in enumerate(sizes)]
    m = tf.Module()
    m.table = tf.__internal__.distribute.ShardedVariable(parts, name="t")
    m.bias = tf.Variable(tf.ones([2]), name="bias")
    return m


def _variables(m):
    return list(m.table.variables) + [m.bias]


def _slots(opt):
    """Every slot of the optimizer as one flat array (whole tables, not shards)."""
    out = []
    for v in opt.variables[1:]:  # [0]: iterations
        parts = v.variables if isinstance(v, tf.__internal__.distribute.ShardedVariable) else [v]
        out.append(np.concatenate([p.numpy() for p in parts]).ravel())
    return np.concatenate(out)


def _trained_checkpoint(tmp_path, name):
    m, opt = _model([3, 3]), getattr(tf_keras.optimizers, name)(0.1)
    grads = [tf.reshape(tf.range(6, 12, dtype=tf.float32), [3, 2]),
             tf.reshape(tf.range(0, 6, dtype=tf.float32), [3, 2]), tf.ones([2])]
    opt.apply_gradients(zip(grads, _variables(m)))
    return tf.train.Checkpoint(m=m, opt=opt).write(str(tmp_path / "ckpt")), _slots(opt)


@pytest.mark.parametrize("name", ["Adagrad", "Adam"])
@pytest.mark.parametrize("sizes", [[3, 3], [2, 2, 2], [6]], ids=["same", "2to3", "2to1"])
def test_slots_restored_before_build_come_back_by_global_row(tmp_path, name, sizes):
    path, want = _trained_checkpoint(tmp_path, name)
    m, opt = _model(sizes), getattr(tf_keras.optimizers, name)(0.1)
    tf.train.Checkpoint(m=m, opt=opt).read(path)
    assert sharded_slots.build_for_pending_restore(opt, _variables(m))
    np.testing.assert_array_equal(_slots(opt), want)
    assert int(opt.iterations.numpy()) == 1
    # Built now: a second call (the next step's hook) does nothing.
    assert not sharded_slots.build_for_pending_restore(opt, _variables(m))


def test_tf_keras_alone_gets_them_wrong(tmp_path):
    """What the function is for: without it, the same restore onto the same
    shards brings Adagrad's accumulators back wrong, with no error. If a
    tf_keras release fixes this, this test fails: drop the function then."""
    path, want = _trained_checkpoint(tmp_path, "Adagrad")
    m, opt = _model([3, 3]), tf_keras.optimizers.Adagrad(0.1)
    tf.train.Checkpoint(m=m, opt=opt).read(path)
    opt.build(_variables(m))
    assert np.abs(_slots(opt) - want).max() > 1.0


def test_nothing_pending_nothing_built():
    m, opt = _model([3, 3]), tf_keras.optimizers.Adagrad(0.1)
    assert not sharded_slots.build_for_pending_restore(opt, _variables(m))
    assert not opt.variables[1:]  # still no slots: tf_keras builds them at its first step
    legacy = tf_keras.optimizers.legacy.Adagrad(0.1)
    assert not sharded_slots.build_for_pending_restore(legacy, _variables(m))


class _Counting(tf_keras.optimizers.Adagrad):
    """Adagrad with state of its own made in build and outside ``_variables``:
    a variable attribute and a list with one variable per model variable."""

    def build(self, var_list):
        if getattr(self, "_built", False):
            return
        super().build(var_list)
        self.steps_seen = tf.Variable(0.0, trainable=False)
        self.seen = [tf.Variable(tf.zeros(v.shape), trainable=False) for v in var_list]

    def update_step(self, gradient, variable):
        super().update_step(gradient, variable)
        i = self._index_dict[self._var_key(variable)]
        self.seen[i].assign_add(tf.ones(variable.shape) * (i + 1))
        self.steps_seen.assign_add(1.0)


def test_state_outside_variables_is_still_restored(tmp_path):
    """What build_for_pending_restore does not take over (lists not in
    ``_variables``, plain attributes) is restored as tf_keras would, and a
    LossScaleOptimizer's inner optimizer is the one built."""
    m, opt = _model([3, 3]), tf_keras.mixed_precision.LossScaleOptimizer(_Counting(0.1))
    opt.apply_gradients(zip([tf.ones([3, 2]), tf.ones([3, 2]) * 2, tf.ones([2])], _variables(m)))
    path = tf.train.Checkpoint(m=m, opt=opt).write(str(tmp_path / "ckpt"))
    m2, opt2 = _model([3, 3]), tf_keras.mixed_precision.LossScaleOptimizer(_Counting(0.1))
    tf.train.Checkpoint(m=m2, opt=opt2).read(path)
    assert sharded_slots.build_for_pending_restore(opt2, _variables(m2))
    inner = opt2.inner_optimizer
    np.testing.assert_array_equal(_slots(inner), _slots(opt.inner_optimizer))
    assert float(inner.steps_seen.numpy()) == 3.0
    for i, v in enumerate(inner.seen):
        np.testing.assert_array_equal(v.numpy(), np.full(v.shape, i + 1.0))


def _legacy_slots(opt, m):
    """Every slot of a legacy optimizer, the table's whole (its shards' slots
    by global row), then the bias's."""
    out = []
    for name in opt.get_slot_names():
        out.append(np.concatenate([opt.get_slot(p, name).numpy() for p in m.table.variables]).ravel())
        out.append(opt.get_slot(m.bias, name).numpy().ravel())
    return np.concatenate(out)


@pytest.mark.parametrize("name", ["Adagrad", "Adam"])
@pytest.mark.parametrize("sizes", [[3, 3], [2, 2, 2]], ids=["same", "2to3"])
def test_legacy_slots_restored_before_build_come_back_by_global_row(tmp_path, name, sizes):
    """tf_keras's legacy optimizers restore a sharded table's slot before
    they have slots as one whole variable (eagerly, under the table's key),
    which their first step then replaces by the shards' fresh slots: Adagrad's
    accumulators came back at 0.1 instead of 1.1 and 4.1, with no error."""
    m, opt = _model([3, 3]), getattr(tf_keras.optimizers.legacy, name)(0.1)
    grads = [tf.reshape(tf.range(6, 12, dtype=tf.float32), [3, 2]),
             tf.reshape(tf.range(0, 6, dtype=tf.float32), [3, 2]), tf.ones([2])]
    opt.apply_gradients(zip(grads, _variables(m)))
    path, want = tf.train.Checkpoint(m=m, opt=opt).write(str(tmp_path / "ckpt")), \
        _legacy_slots(opt, m)
    m2, opt2 = _model(sizes), getattr(tf_keras.optimizers.legacy, name)(0.1)
    tf.train.Checkpoint(m=m2, opt=opt2).read(path)
    assert sharded_slots.build_for_pending_restore(opt2, _variables(m2))
    np.testing.assert_array_equal(_legacy_slots(opt2, m2), want)
    # Only the shards' slots remain (no whole-table copy), as in an optimizer
    # built before the restore: iterations, then one slot per shard and name.
    assert len(opt2.weights) == 1 + len(opt2.get_slot_names()) * (len(sizes) + 1)
    assert not sharded_slots.build_for_pending_restore(opt2, _variables(m2))


def test_legacy_without_a_sharded_slot_pending_is_left_alone(tmp_path):
    m, opt = _model([3, 3]), tf_keras.optimizers.legacy.Adagrad(0.1)
    assert not sharded_slots.build_for_pending_restore(opt, _variables(m))
    assert not opt.weights  # tf_keras builds it at its first step
