"""TensorFlow graph internals: the graph being traced, where its ops are
placed, what they write.

* TF 2.21.0 (``Operation._set_device`` is the same in 2.16-2.20): an op's
  device changed after it was created; the parts of a ``ResourceGather``
  gradient (``resource_variable_ops._GatherGrad``, the same in 2.16-2.21).
* TF 2.18.1, 2.19.1, 2.20.0 and 2.21.0
  (:data:`tf_asyncps.compat.versions.TENSORFLOW_TESTED`): whether ops are
  traced into a function and its outermost ``FuncGraph``, the resources a
  function's ops write (followed out through ``FuncGraph.captures``), and
  ``ops.colocate_with`` without ``tf.compat.v1.colocate_with``'s deprecation
  warning.

Importing this module imports nothing; each function imports TensorFlow
when called.
"""

import contextlib

__all__ = ["constants_beside_consumers", "gather_gradient_parts", "inside_function",
           "outermost_graph", "resources_written", "colocated_with", "colocate_only_with",
           "on_device_only"]


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


def inside_function() -> bool:
    """Whether ops are being traced into a tf.function graph."""
    from tensorflow.python.framework import ops
    return ops.inside_function()


def outermost_graph():
    """The outermost FuncGraph of the graph being built (the scheduled
    function's, when tracing inside a ``tf.while_loop`` or ``tf.cond``)."""
    import tensorflow as tf
    from tensorflow.python.framework import func_graph
    g = tf.compat.v1.get_default_graph()
    while isinstance(getattr(g, "outer_graph", None), func_graph.FuncGraph):
        g = g.outer_graph
    return g


#: Ops that write the resource variable of their first input.
_WRITE_OPS = ("AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp")


_WRITE_PREFIXES = ("ResourceApply", "ResourceSparseApply", "ResourceScatter")


def resources_written(ops) -> list:
    """The resource handles that ``ops`` write (assign, optimizer apply,
    scatter), each followed out of the function graphs it was captured
    into (``FuncGraph.captures``, TF 2.21) to the tensor it captures, so that
    it compares by ``id`` with a variable's ``handle``. Ops inside nested
    function bodies (``tf.cond``, ``tf.while_loop``) are not looked into."""
    out = []
    for op in ops:
        if not (op.type in _WRITE_OPS or op.type.startswith(_WRITE_PREFIXES)) or \
                not op.inputs:
            continue
        t = op.inputs[0]
        while True:
            captures = getattr(t.graph, "captures", None) if hasattr(t, "graph") else None
            outer = next((ext for ext, internal in captures or () if internal is t), None)
            if outer is None:
                break
            t = outer
        out.append(t)
    return out


def colocated_with(op):
    """Context: ops created in it are placed with ``op`` (a tensor, an op or
    a variable), inside any colocation around it: ``tf.compat.v1.colocate_with(op)``
    without its deprecation warning, which every job printed (TF 2.16-2.21)."""
    from tensorflow.python.framework import ops
    return ops.colocate_with(op)


def colocate_only_with(op):
    """Context: ops created in it are placed with ``op``, whatever colocation
    or device scope surrounds them (``tf.compat.v1.colocate_with(op,
    ignore_existing=True)`` without its deprecation warning; TF 2.16-2.21)."""
    from tensorflow.python.framework import ops
    return ops.colocate_with(op, ignore_existing=True)


@contextlib.contextmanager
def on_device_only(device):
    """Context: ops created in it are placed on ``device`` (a device string),
    with no colocation from the scopes around them and no control inputs
    (``ops.colocate_with(None, ignore_existing=True)``, TF 2.16-2.21: the
    colocation stack cleared, the device scope kept)."""
    import tensorflow as tf
    from tensorflow.python.framework import ops
    with ops.colocate_with(None, ignore_existing=True), tf.device(device), \
            tf.control_dependencies(None):
        yield
