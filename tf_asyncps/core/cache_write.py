"""The worker embedding cache's write (HET's push rule; see
:mod:`tf_asyncps.core.embedding_cache`): a step's table gradient, on the
worker before it crosses, is summed into the cached rows (and applied to
their local copy as plain SGD); rows with more than ``push_bound`` updates
and uncached rows are pushed; on the ps each pushed row's clock advances by
the updates it carries.

Source: X. Miao et al., "HET: Scaling out Huge Embedding Model Training via
Cache-enabled Distributed Framework", PVLDB 15(2), 2022.
"""

import weakref

import tensorflow as tf

from tf_asyncps.compat import graph as graph_compat
from tf_asyncps.compat import optimizers as optimizers_compat
from tf_asyncps.compat import variables as variables_compat
from tf_asyncps.core import grads as grads_lib

__all__ = ["CacheWrite", "is_keras3", "writes_every_row"]


#: graph -> {(id(optimizer), dtype): learning rate tensor}: read once per
#: traced step, not once per cached table (each read is a message from the
#: optimizer's ps).
_LR_READS = weakref.WeakKeyDictionary()


def _learning_rate(optimizer, dtype):
    """The optimizer's current learning rate (a schedule called at its
    step), read once per graph."""
    if tf.executing_eagerly():
        return _read_learning_rate(optimizer, dtype)
    graph = tf.compat.v1.get_default_graph()
    reads = _LR_READS.setdefault(graph, {})
    key = (id(optimizer), tf.as_dtype(dtype))
    if key not in reads:
        with tf.control_dependencies(None):
            reads[key] = _read_learning_rate(optimizer, dtype)
    return reads[key]


def _read_learning_rate(optimizer, dtype):
    lr = getattr(optimizer, "learning_rate", None)
    if lr is None:
        lr = getattr(optimizer, "lr", None)
    if lr is None:
        raise ValueError(f"embedding_cache: {type(optimizer).__name__} has no learning_rate "
                         "for the cached rows' local copy.")
    if callable(lr) and not isinstance(lr, (tf.Variable, tf.Tensor)) and \
            not hasattr(lr, "value"):
        lr = lr(optimizer.iterations)
    return tf.cast(tf.convert_to_tensor(lr), dtype)


#: Optimizers whose sparse update writes only the gradient's rows (tf_keras
#: 2.21): SGD without momentum and Adagrad, new and legacy. Any other (Adam's
#: moments, a momentum, RMSprop's decay) moves every row with a non-zero
#: slot at each step.
_ROW_WISE = ("SGD", "Adagrad")


def is_keras3(optimizer) -> bool:
    """Whether ``optimizer`` is a Keras 3 optimizer."""
    keras3 = optimizers_compat.optimizer_class()
    return keras3 is not None and isinstance(optimizer, keras3)


def writes_every_row(optimizer) -> bool:
    """Whether an update of ``optimizer`` may change rows its gradient does
    not hold (then each applied step advances every row's clock)."""
    inner = getattr(optimizer, "inner_optimizer", optimizer)  # LossScaleOptimizer
    name = type(inner).__name__
    if name not in _ROW_WISE:
        return True
    momentum = getattr(inner, "momentum", 0.0)
    if name == "SGD" and not isinstance(momentum, (int, float)):
        try:
            momentum = float(tf.get_static_value(tf.convert_to_tensor(momentum)))
        except (TypeError, ValueError):
            return True
    return bool(momentum)


class CacheWrite:
    """The write half of :class:`~tf_asyncps.core.embedding_cache.CachedTable`
    (a mixin: it uses the table's state, ``config``, ``_h`` and ``_count``)."""

    # -- write --------------------------------------------------------------------
    def push(self, grad, var, optimizer):
        """The step's gradient of this table, on the worker, as the push: the
        cached rows' gradients accumulated (and applied to the local copy),
        the rows due and the uncached rows' gradients returned as one
        IndexedSlices (a ``TableHooks.before_push``)."""
        if not isinstance(grad, tf.IndexedSlices) or not self.built:
            return grad
        self.optimizer = optimizer
        if is_keras3(optimizer):
            return self._push_occurrences(grad)
        cfg, h, dtype = self.config, self._h(), self.var.dtype
        ids = tf.cast(grad.indices, tf.int64)
        g = tf.reshape(tf.cast(grad.values, dtype), [-1, self.dim])
        slot = variables_compat.gather_handle(h["slot_of"], ids, tf.int32)
        cached = slot >= 0
        c_at = tf.reshape(tf.where(cached), [-1])
        cs = tf.gather(slot, c_at)
        cg = tf.gather(g, c_at)
        step = -_learning_rate(optimizer, dtype) * cg
        added = [variables_compat.scatter_add_handle(h["count"], cs, tf.ones_like(cs, tf.int64)),
                 variables_compat.scatter_add_handle(h["gsum"], cs, cg),
                 variables_compat.scatter_add_handle(h["delta"], cs, step),
                 variables_compat.scatter_add_handle(h["rows"], cs, step)]
        # The push keeps the gradient's row order (an optimizer's kernels
        # may round a row differently at another position).
        safe = tf.maximum(slot, 0)
        with tf.control_dependencies(added):
            counts = tf.where(cached, variables_compat.gather_handle(h["count"], safe, tf.int64),
                              tf.ones_like(ids))
            sums = tf.where(cached[:, None], variables_compat.gather_handle(h["gsum"], safe, dtype), g)
        pushed = tf.logical_or(tf.logical_not(cached), counts > cfg.push_bound)
        p_at = tf.reshape(tf.where(pushed), [-1])
        push_ids, push_n = tf.gather(ids, p_at), tf.gather(counts, p_at)
        due_slot = tf.boolean_mask(slot, tf.logical_and(cached, pushed))
        with tf.control_dependencies([counts, sums]):
            zeros = tf.zeros([tf.size(due_slot), self.dim], dtype)
            cleared = [variables_compat.scatter_update_handle(h["count"], due_slot,
                                                tf.zeros_like(due_slot, tf.int64)),
                       variables_compat.scatter_update_handle(h["gsum"], due_slot, zeros),
                       variables_compat.scatter_update_handle(h["delta"], due_slot, zeros)]
        with tf.control_dependencies(cleared):
            push_g = tf.gather(sums, p_at)
        self._counts[graph_compat.outermost_graph()] = (
            self._wire_counts(push_n, tf.size(ids)), None)
        return tf.IndexedSlices(tf.cast(push_g, grad.values.dtype),
                                tf.cast(push_ids, grad.indices.dtype), grad.dense_shape)

    def _push_occurrences(self, grad):
        """:meth:`push` of a Keras 3 gradient, one row per id occurrence
        (Keras 3's rules square each occurrence): the pushed ids' occurrence
        rows of this step as they are, in their order, then, per pushed id
        with earlier unpushed updates, their summed gradient as one more
        occurrence. Its clock advances in :meth:`count_pushed` (Keras 3's
        row-wise rules reorder the rows on the worker)."""
        cfg, h, dtype, d = self.config, self._h(), self.var.dtype, self.dim
        occ = tf.reshape(grad.indices, [-1])
        g = tf.reshape(tf.cast(grad.values, dtype), [-1, d])
        unique, position = tf.unique(occ)
        ids = tf.cast(unique, tf.int64)
        summed = tf.math.unsorted_segment_sum(g, position, tf.size(unique))
        slot = variables_compat.gather_handle(h["slot_of"], ids, tf.int32)
        cached = slot >= 0
        safe = tf.maximum(slot, 0)
        zero_rows = tf.zeros_like(summed)
        count = tf.where(cached, variables_compat.gather_handle(h["count"], safe, tf.int64),
                         tf.zeros_like(ids))
        gsum = tf.where(cached[:, None], variables_compat.gather_handle(h["gsum"], safe, dtype),
                        zero_rows)
        delta = tf.where(cached[:, None], variables_compat.gather_handle(h["delta"], safe, dtype),
                         zero_rows)
        step = -_learning_rate(self.optimizer, dtype) * summed
        after = count + 1
        pushed = tf.logical_or(tf.logical_not(cached), after > cfg.push_bound)
        earlier = tf.logical_and(tf.logical_and(pushed, cached), count > 0)
        # The cached slots' new state: cleared when pushed, else one more update.
        c_at = tf.reshape(tf.where(cached), [-1])
        cs = tf.gather(slot, c_at)
        kept = tf.logical_not(tf.gather(pushed, c_at))
        keep = lambda new: tf.where(kept[:, None] if new.shape.rank == 2 else kept, new,
                                    tf.zeros_like(new))
        with tf.control_dependencies([count, gsum, delta]):
            written = [
                variables_compat.scatter_update_handle(h["count"], cs, keep(tf.gather(after, c_at))),
                variables_compat.scatter_update_handle(h["gsum"], cs,
                                                       keep(tf.gather(gsum + summed, c_at))),
                variables_compat.scatter_update_handle(h["delta"], cs,
                                                       keep(tf.gather(delta + step, c_at))),
                variables_compat.scatter_add_handle(h["rows"], cs, tf.gather(step, c_at))]
        o_at = tf.reshape(tf.where(tf.gather(pushed, position)), [-1])
        indices = tf.concat([tf.gather(occ, o_at),
                             tf.cast(tf.boolean_mask(unique, earlier), occ.dtype)], 0)
        values = tf.concat([tf.gather(g, o_at), tf.boolean_mask(gsum, earlier)], 0)
        push_ids = tf.boolean_mask(ids, pushed)
        push_n = tf.where(cached, after, tf.ones_like(after))
        push_n = tf.boolean_mask(push_n, pushed)
        with tf.control_dependencies(written):
            values = tf.identity(values)
        self._counts[graph_compat.outermost_graph()] = (
            self._wire_counts(push_n, tf.size(ids)),
            grads_lib.narrow_indices(push_ids, self.num_rows))
        return tf.IndexedSlices(tf.cast(values, grad.values.dtype), indices, grad.dense_shape)

    def _wire_counts(self, push_n, updates):
        """What crosses to the ps for the pushed rows' update counts and the
        step's updates (``updates``: the gradient's distinct ids, int32
        scalar): None with ``push_bound=0`` (every row is pushed with one
        update: the ps counts them itself), else int32 ``[pushed rows + 1]``,
        the counts (each at most ``push_bound + 1``) then ``updates``. The
        ps's counters are fed from it: no message of their own."""
        if self.config.push_bound == 0:
            return None
        return tf.concat([tf.cast(push_n, tf.int32), tf.reshape(updates, [1])], 0)

    def _counts_on_ps(self, wire, indices):
        """On the ps: the pushed rows' update counts (int64 ``[rows]``), with
        the push's counters (``rows_pushed``, ``updates_pushed``, ``updates``)
        added as a control dependency of the counts."""
        if wire is None:
            counts = tf.ones_like(indices, tf.int64)
            rows = tf.size(indices, out_type=tf.int64)
            added = self._count(rows_pushed=rows, updates_pushed=rows, updates=rows)
        else:
            wire = tf.cast(wire, tf.int64)
            counts, updates = wire[:-1], wire[-1]
            added = self._count(rows_pushed=tf.size(counts, out_type=tf.int64),
                                updates_pushed=tf.reduce_sum(counts), updates=updates)
        with tf.control_dependencies([added]):
            return tf.identity(counts)

    def count_updates(self, grad, var):
        """On the ps, right before the optimizer applies a push: each pushed
        row's clock advances by the updates it carries (a
        ``TableHooks.filter_gradient``)."""
        top = graph_compat.outermost_graph()
        if top not in self._counts or not isinstance(grad, tf.IndexedSlices):
            return grad
        counts, ids = self._counts[top]
        if ids is not None:
            return grad
        with tf.device(self.clock.device):
            ticked = self._tick(self._counts_on_ps(counts, grad.indices), grad.indices)
        with tf.control_dependencies([ticked]):
            values = tf.identity(grad.values)
        return tf.IndexedSlices(values, grad.indices, grad.dense_shape)

    def count_pushed(self, optimizer, variables):
        """On the ps, right before the optimizer applies a Keras 3 push: the
        pushed ids' clocks advance by the updates each carries (a
        ``TableHooks.before_update``; the gradient itself stays the object
        core/rowwise.py carries its squares for)."""
        counts, ids = self._counts.get(graph_compat.outermost_graph(), (None, None))
        if ids is None:
            return None
        with tf.device(self.clock.device):
            return self._tick(self._counts_on_ps(counts, ids), ids)

    def _tick(self, counts, indices):
        """Advances the clock of the rows ``indices`` by ``counts`` (the
        updates each carries); with an optimizer that writes every row,
        every row's clock by one and the pushed rows' by the rest."""
        indices = tf.cast(indices, tf.int64)
        shape = tf.shape(self.clock, tf.int64)
        if not writes_every_row(self.optimizer):
            return self.clock.scatter_add(tf.IndexedSlices(counts, indices, shape))
        every = self.clock.assign_add(tf.ones_like(self.clock), read_value=False)
        with tf.control_dependencies([every]):
            return self.clock.scatter_add(tf.IndexedSlices(counts - 1, indices, shape))
