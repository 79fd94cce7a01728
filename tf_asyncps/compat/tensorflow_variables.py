"""TensorFlow resource-variable internals (TF 2.21.0; the same read path in
2.18-2.20): a variable's dense read, replaced on one instance.

Kept apart from :mod:`tf_asyncps.compat.tensorflow` (the 600-line limit);
importable without TensorFlow being imported first.
"""

__all__ = ["replace_dense_read"]


def replace_dense_read(var, after_read) -> bool:
    """Routes this variable's dense reads through ``after_read(value)``: an
    instance attribute, this variable only. Idempotent.

    TensorFlow's ``BaseResourceVariable._read_variable_op`` is the one op
    behind ``value()`` (what ``tf.convert_to_tensor(var)``, ``var * x`` and
    ``tf.matmul(x, var)`` use), ``read_value()`` and ``read_value_no_copy()``;
    ``sparse_read``, ``gather_nd`` and the assign ops do not go through it.
    Its ``ReadVariableOp`` and the tape's record of it stay as they are:
    ``after_read`` gets the read's float tensor and returns what the reader
    sees (the gradient flows back through what it adds).

    Args:
      var: a ``tf.Variable`` (a resource variable, or the strategy's wrapper
        of one: the wrapped variable's reads are replaced).
      after_read: ``fn(value: tf.Tensor) -> tf.Tensor`` of the same dtype
        and shape.

    Returns:
      False if ``var`` has no ``_read_variable_op`` (not a resource variable).
    """
    import tensorflow as tf
    # ParameterServerStrategy wraps its variables (ps_values.CachingVariable,
    # AggregatingVariable: ``_v``), whose reads call the wrapped variable's.
    while isinstance(getattr(var, "_v", None), tf.Variable):
        var = var._v
    original = getattr(var, "_read_variable_op", None)
    if original is None:
        return False
    if getattr(original, "_asyncps_replaced", False):
        return True

    def _read_variable_op(*args, **kwargs):
        return after_read(original(*args, **kwargs))

    _read_variable_op._asyncps_replaced = True
    var._read_variable_op = _read_variable_op
    return True
