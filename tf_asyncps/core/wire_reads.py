"""Dense reads of the strategy's variables over a bfloat16 wire.

With ``AsyncParameterServerStrategy(wire_dtype="bfloat16")`` a worker step's
dense read of a float32 model variable (a Dense kernel, a bias, a whole
table: what ``tf.convert_to_tensor(var)``, ``var.value()`` and
``var.read_value()`` give) crosses as bfloat16::

    value = ReadVariableOp(var)            # on the variable's ps, float32
    wire  = tf.cast(value, tf.bfloat16)    # colocated with the read: the ps
    out   = tf.cast(wire, tf.float32)      # where the reader is: the worker

so the variable stays float32 and only the bytes on the wire halve, as row
reads do (core/lookup.py). The gradient flows back through both casts
(rounded to bfloat16 on the worker, as the gradient push rounds it anyway:
``grads.copy_to``).

Cast: reads traced in a worker step (``core.step.current_step()``: every
``strategy.run`` on a worker, so also tf_keras's ``evaluate``/``predict`` and
a ``fit``'s validation scheduled there, as row reads are), outside its
update. Not cast: eager reads (the chief's ``get_weights``, ``model(x)``,
checkpoints, exports), functions traced outside a worker step (a SavedModel's,
the chief's own), reads in the update (the optimizer, the policies,
``dc_asgd``'s read values: they run on the ps), non-trainable and
non-float32 variables, ``local_sgd`` (its steps read the worker's local
copies: nothing crosses).
"""

import tensorflow as tf

from tf_asyncps.compat import variables as variables_compat
from tf_asyncps.core import grads as grads_lib
from tf_asyncps.core import step as step_lib

__all__ = ["cast_dense_reads"]


def cast_dense_reads(var, wire_dtype) -> bool:
    """Makes ``var``'s dense reads in worker steps cross in ``wire_dtype``.

    Args:
      var: a float32 ``tf.Variable`` (a model variable, or one shard of one).
      wire_dtype: None (nothing changes) or ``tf.bfloat16``.

    Returns:
      True if its reads were replaced.
    """
    if grads_lib.wire_dtype_of(var.dtype, wire_dtype) is None:
        return False

    def after_read(value):
        if tf.executing_eagerly():
            return value
        step = step_lib.current_step()
        if step is None or step.applying:
            return value
        return grads_lib.read_over_wire(value, wire_dtype)

    return variables_compat.replace_dense_read(var, after_read)
