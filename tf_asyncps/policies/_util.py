"""Gradient helpers shared by policies: dense tensors and tf.IndexedSlices alike."""

import tensorflow as tf

__all__ = ["scale", "map_values", "all_finite"]


def map_values(fn, grad):
    """Applies ``fn`` to a dense gradient or to the values of IndexedSlices
    (indices and dense_shape kept: sparse stays sparse)."""
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(fn(grad.values), grad.indices, grad.dense_shape)
    return fn(grad)


def scale(grad, factor):
    """``grad * factor`` with ``factor`` cast to the gradient's dtype."""
    return map_values(lambda v: v * tf.cast(factor, v.dtype), grad)


def all_finite(grads) -> tf.Tensor:
    """Scalar tf.bool: every element of every gradient is finite."""
    checks = []
    for g in grads:
        v = g.values if isinstance(g, tf.IndexedSlices) else g
        if v.dtype.is_floating or v.dtype.is_complex:
            checks.append(tf.reduce_all(tf.math.is_finite(v)))
    return tf.reduce_all(tf.stack(checks)) if checks else tf.constant(True)
