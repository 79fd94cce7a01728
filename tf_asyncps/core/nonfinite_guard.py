"""One ``tf.cond`` per variable update, on the variable's own ps task.

A step whose gradients hold NaN/Inf is never applied (``skip_nonfinite``).
One ``tf.cond`` around the whole optimizer call spans every ps task: lowered
to Switch/Merge on each, it sends the predicate and the branches' dead
signals between the ps tasks every step (ps CPU and bytes per step:
docs/benchmarks.md#the-non-finite-check).

While :func:`guarded_by` is active, the strategy's ``extended.update`` (which
every tf_keras, legacy tf_keras and Keras 3 optimizer calls once per
variable) wraps that variable's update in ``tf.cond(finite, update, no-op)``
built beside the variable: each ps task receives the worker's predicate once
and decides alone. Where the optimizer's sparse update writes only the
gradient's rows (``rowwise_sparse``: tf_keras's Adagrad), a table's update
takes no cond: it gets its gradient's rows where the predicate holds and
none where it does not, so a dropped step writes nothing and a kept one is
the optimizer's own update (a cond's Switch and Merge ops per input and
output, on every table shard each step, replaced by a slice). Where its update
on a dense zero gradient changes nothing (``zero_is_noop``: tf_keras's
Adagrad with ``epsilon > 0``), no update takes a cond: the optimizer's
update runs on the gradient where the predicate holds and on its zeros (the
same rows) where it does not, one select per variable. The optimizer's
iteration counter advances by
``cast(finite)`` (:func:`tf_asyncps.compat.variables.adding_only_if`)
and the engine records the step as applied or dropped without a cond
(:meth:`StalenessTracker.record_gated`).

A read inside a cond branch of a variable on another ps task (tf_keras reads
the learning rate in each variable's update, Adam the iteration counter) is
a control message to that task and a value back, per variable. The
``hoisted`` variables' reads are made once per ps task outside the conds,
where the cond is built, and copied there: one value crosses per task.
"""

import contextlib
import functools
from typing import Callable, Optional

import tensorflow as tf

from tf_asyncps.compat import graph as graph_compat
from tf_asyncps.compat import variables as variables_compat
from tf_asyncps.core import grads as grads_lib
from tf_asyncps.core import trace_context

__all__ = ["guarded_by", "guard", "active"]

class _Gate:
    def __init__(self, finite, rowwise_sparse=False, zero_is_noop=False):
        self.finite = finite
        self.rowwise_sparse = rowwise_sparse
        self.zero_is_noop = zero_is_noop
        self.gated = set()  # ids of the variables whose update was gated
        self.updating = None  # (variable, graph the cond is built in)
        self.copies = {}  # (id(hoisted variable), device) -> tensor
        self.preds = {}  # (variable's device, graph) -> the predicate there

    def pred(self, var):
        """The predicate beside ``var`` (called under its colocation): one
        copy per ps task and graph, shared by the variables there."""
        graph = tf.compat.v1.get_default_graph()
        key = (var.device, graph)
        if key not in self.preds:
            with tf.control_dependencies(None):  # none of the first caller's
                self.preds[key] = tf.identity(self.finite)
        return self.preds[key]

    def read(self, hoisted, read):
        """A read of ``hoisted`` made in a gated update: the copy beside the
        updated variable, made once in the cond's graph."""
        if self.updating is None:
            return read()
        var, graph = self.updating
        if var.device == hoisted.device:
            return read()
        key = (id(hoisted), var.device)
        if key not in self.copies or self.copies[key].graph is not graph:
            with graph.as_default(), graph_compat.colocate_only_with(None):
                value = read()
                with graph_compat.colocated_with(var):
                    self.copies[key] = tf.identity(value)
        return self.copies[key]


@contextlib.contextmanager
def guarded_by(finite: tf.Tensor, hoisted=(), rowwise_sparse: bool = False,
               zero_is_noop: bool = False):
    """Within this context, variable updates made through the strategy's
    ``extended.update`` run only where ``finite`` (scalar tf.bool) is True.

    Args:
      finite: scalar tf.bool (the worker's check of the step's gradients).
      hoisted: variables (``tf.Variable``) that updates read, such as the
        optimizer's learning rate: read once per ps task outside the conds.
      rowwise_sparse: the optimizer's update on a sparse gradient writes only
        its rows (``compat.optimizers.sparse_update_is_rowwise``): such
        updates are gated by their rows, without a cond.
      zero_is_noop: the optimizer's update on a zero gradient changes
        nothing (``compat.optimizers.update_is_noop_at_zero``; its
        sparse update writes only the rows, which then do not change): every
        update gets the gradient or its zeros, without a cond.

    Yields:
      a set that collects the ``id`` of every variable whose update was gated
      (the engine checks that each variable of the step is in it).
    """
    gate_ = _Gate(finite, rowwise_sparse, zero_is_noop)
    with contextlib.ExitStack() as stack:
        for var in hoisted:
            stack.enter_context(variables_compat.reads_redirected(
                var, functools.partial(gate_.read, var)))
        with trace_context.entered(trace_context.NONFINITE_GATE, gate_):
            yield gate_.gated


def active() -> Optional[tf.Tensor]:
    """The predicate of the innermost :func:`guarded_by`, or None."""
    gate_ = trace_context.NONFINITE_GATE.get()
    return None if gate_ is None else gate_.finite


def guard(var, fn: Callable) -> Callable:
    """``fn(var, *args, **kwargs)`` (one variable's update, called by the
    strategy's ``extended._update`` under ``colocate_with(var)``) gated by
    the active predicate; ``fn`` itself when none is active.

    The gated update returns a scalar tf.bool (True: applied) that runs
    after every op of ``fn`` (optimizers ignore the value or use it as a
    control dependency)."""
    gate_ = trace_context.NONFINITE_GATE.get()
    if gate_ is None:
        return fn

    def gated_update(v, *args, **kwargs):
        gate_.gated.add(id(var))
        pred = gate_.pred(v)
        graph = tf.compat.v1.get_default_graph()
        zeros = gate_.zero_is_noop and args and isinstance(args[0], (tf.Tensor, tf.IndexedSlices))
        rows = not zeros and gate_.rowwise_sparse and args and isinstance(
            args[0], tf.IndexedSlices)

        def update(*given):
            gate_.updating = (v, graph)
            try:
                result = fn(v, *given, **kwargs)
            finally:
                gate_.updating = None
            deps = [t for t in tf.nest.flatten(result)
                    if isinstance(t, (tf.Tensor, tf.Operation))]
            with tf.control_dependencies(deps):
                return tf.identity(pred) if rows or zeros else tf.constant(True)

        if rows:
            return update(_rows_if(pred, args[0]), *args[1:])
        if zeros:
            return update(_zeros_unless(pred, args[0]), *args[1:])
        return tf.cond(pred, lambda: update(*args), lambda: tf.constant(False))

    return gated_update


def _zeros_unless(pred, grad):
    """``grad`` (tensor or IndexedSlices: its values) where ``pred`` (scalar
    tf.bool) holds, else zeros of its shape (the indices kept)."""
    def values(v):  # the zero shared by the variables beside the predicate
        return tf.where(pred, v, grads_lib.shared_constant(0, v.dtype, pred))
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(values(grad.values), grad.indices, grad.dense_shape)
    return values(grad)


def _rows_if(pred, grad: tf.IndexedSlices) -> tf.IndexedSlices:
    """``grad`` where ``pred`` (scalar tf.bool) holds, else its first 0 rows."""
    n = tf.shape(grad.indices, out_type=tf.int32)[0]
    k = tf.where(pred, n, 0)
    return tf.IndexedSlices(grad.values[:k], grad.indices[:k], grad.dense_shape)
