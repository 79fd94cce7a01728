"""TensorFlow graph internals (TF 2.21.0; ``Operation._set_device`` is the
same in 2.16-2.20): an op's device changed after it was created, and the
parts of a ``ResourceGather`` gradient (``resource_variable_ops._GatherGrad``,
the same in 2.16-2.21).
"""

__all__ = ["constants_beside_consumers", "gather_gradient_parts"]


def constants_beside_consumers(ops) -> int:
    """Moves each ``Const`` of ``ops`` whose consumers all run on one other
    device to that device.

    :func:`tf_asyncps.core.placement.beside_inputs` places an op by its
    inputs; a constant has none, so it got the default device (ps 0) and
    crossed to its consumer on ps 1 at every step (measured: tf_keras's
    sparse de-duplication, 3 constants per step per table shard). The
    placer does not move an op whose device was set.

    Args:
      ops: ``tf.Operation``s of one graph.

    Returns:
      how many constants moved (int).
    """
    moved = 0
    for op in ops:
        if op.type != "Const" or not op.device:
            continue
        consumers = [c for t in op.outputs for c in t.consumers()]
        devices = {c.device for c in consumers}
        if len(devices) == 1 and "" not in devices and devices != {op.device}:
            op._set_device(devices.pop())
            moved += 1
    return moved


def gather_gradient_parts(grad):
    """``(upstream, indices)`` of an IndexedSlices that a ``ResourceGather``'s
    registered gradient built: the gradient of the gather's output and the
    gather's own indices tensor; None for any other gradient.

    ``_GatherGrad`` reshapes both on the device the gradient is computed on
    (the worker): ``values = reshape(upstream, [size(indices), ...])`` and
    ``indices = reshape(indices, [size(indices)])``. Indices computed on a ps
    (a dynamic table's rows) then cross to the worker, with their size,
    and back with the gradient (measured: 2 transfers per table shard and
    step, 8 bytes a row).
    """
    import tensorflow as tf
    if not isinstance(grad, tf.IndexedSlices) or tf.executing_eagerly():
        return None
    values, indices = grad.values.op, grad.indices.op
    if values.type != "Reshape" or indices.type != "Reshape":
        return None
    # (The size is a Size op of the indices, or a constant where their shape
    # is static.)
    return values.inputs[0], indices.inputs[0]
