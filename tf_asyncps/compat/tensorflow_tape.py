"""TensorFlow 2.21.0's gradient tape, recorded by hand (``tensorflow.python.eager``
``record.stop_recording``, ``record.record_operation`` and
``tape.variable_accessed``, the same in 2.16-2.21; what ``tf.custom_gradient``
uses inside).

``tf.custom_gradient`` cannot serve a variable's row read: for a function
that reads a variable it passes the whole variable through an ``IdentityN``
(a read of every row of the table). Recording the read as one operation on
the variable's handle gives the gradient without reading more.
"""

__all__ = ["recorded_on_variable"]


def recorded_on_variable(variable, forward, backward):
    """``forward()`` with its gradient to ``variable`` given by ``backward``.

    The ops of ``forward`` are not recorded on the active gradient tapes;
    ``variable`` is marked accessed (a tape watching accessed variables
    watches it) and one operation from its handle to the output is recorded.

    Args:
      variable: a resource ``tf.Variable``.
      forward: ``() -> tf.Tensor``, the read.
      backward: ``dy -> gradient`` (a ``tf.Tensor`` or ``tf.IndexedSlices``
        shaped like ``variable``).

    Returns:
      ``forward()``'s tensor.
    """
    from tensorflow.python.eager import record, tape

    with record.stop_recording():
        out = forward()
    tape.variable_accessed(variable)
    record.record_operation("AsyncpsRowRead", [out], [variable.handle],
                            lambda dy: [backward(dy)])
    return out
