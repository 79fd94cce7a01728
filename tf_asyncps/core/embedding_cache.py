"""A bounded-staleness cache of embedding rows on each worker (HET's rule).

Source: X. Miao, H. Zhang, Y. Shi, X. Nie, Z. Yang, Y. Tao, B. Cui, "HET:
Scaling out Huge Embedding Model Training via Cache-enabled Distributed
Framework", PVLDB 15(2), 2022 (VLDB 2022). Each worker keeps hot rows with a
clock per row; the parameter server keeps a clock per row counting the
updates applied to it.

``AsyncParameterServerStrategy(embedding_cache=EmbeddingCache(rows, pull_bound,
push_bound, policy))`` gives every fixed table created in its scope (an
``Embedding``'s or ``EmbeddingCollection``'s, tf_keras or Keras 3, sharded or
not; each shard its share of ``rows``) a
:class:`CachedTable`::

    worker (per-worker variables)          ps (beside the shard)
      slot_of[id] -> slot or -1              clock[id]: updates applied (int64)
      per slot: id, row, seen clock,          stats, staleness histogram
      unpushed count, summed gradient,
      local delta, LFU count / LRU tick

Read (a row read traced in a worker step)::

    unique ids (worker) -> (id, seen clock or -1)                 -> ps
    ps: need = not cached or clock[id] - seen > pull_bound; the rows of
        the needed ids only                                        -> worker
    worker: a pulled row of a cached id gets the worker's own unpushed
        local delta added back; a pulled id not cached takes a slot
        (free, else the least frequently / least recently used slot
        whose updates are all pushed); served rows are the cache's.

Write (the table's gradient in the step's update, on the worker, before
it crosses; the table seam's ``before_push``)::

    cached row: count += 1, summed gradient += g, row += -lr * g (the
        local copy, plain SGD at the optimizer's learning rate)
    push: every row with count > push_bound (its summed gradient, then
        reset) and every row not cached (this step's g) as one sparse
        gradient; the ps applies the optimizer to it and adds each row's
        count to its clock.
    Keras 3 (a row per id occurrence, which its rules square one by one):
        the pushed ids' occurrence rows of this step as they are, then per
        pushed id with earlier unpushed updates their sum as one more row.

What a worker sees: a row at most ``pull_bound`` updates behind the ps
(each update a pushed gradient counted by the clock; the worker's own pushed
updates are among them, applied locally as SGD steps), plus its own unpushed
updates. An optimizer whose step moves rows outside its gradient (Adam's
moments, a momentum: every optimizer but SGD without momentum and Adagrad)
advances every row's clock by one per applied step, so a cached row is then
at most ``pull_bound`` steps of the whole table behind. What the ps applies: the optimizer (SGD, Adagrad, Adam: its slots
live on the ps, beside the table) on summed gradients, at most
``push_bound + 1`` steps of one worker per push. With ``pull_bound=0`` and
``push_bound=0`` every step pushes its gradient and every row a step's own
push touched is pulled again: the uncached step, exactly. A row leaves the
cache only once its updates are pushed, so no update waits on an eviction.
"""

import dataclasses
import weakref
from typing import Callable, Optional

import tensorflow as tf
from absl import logging

from tf_asyncps.compat import graph as graph_compat
from tf_asyncps.compat import optimizers as optimizers_compat
from tf_asyncps.compat import variables as variables_compat
from tf_asyncps.core import grads as grads_lib
from tf_asyncps.core import lookup as lookup_lib
from tf_asyncps.core import placement, table_seam, trace_context
from tf_asyncps.validate import check_int

__all__ = ["EmbeddingCache", "CachedTable", "POLICIES", "STATS", "check_policy"]

#: Eviction policies: least frequently used, least recently used.
POLICIES = ("lfu", "lru")

#: ``cache_stats()`` counters, in the order of the ps's stats vector.
STATS = ("lookups", "distinct", "hits", "rows_pulled", "rows_pushed", "updates_pushed",
         "evictions", "rows_flushed", "updates", "updates_lost")

_BIG = 2.0 ** 62  # a slot that cannot take a new id sorts last


@dataclasses.dataclass(frozen=True)
class EmbeddingCache:
    """A worker-side cache of embedding rows with bounded staleness (HET,
    Miao et al., VLDB 2022): ``AsyncParameterServerStrategy(embedding_cache=...)``.

    Attributes:
      rows: at most this many rows cached per table on each worker (int >= 1;
        a sharded table's shards share it by their rows).
      pull_bound: a cached row is served while at most this many updates
        (pushed gradients, counted per row on the ps) landed on it since the
        worker pulled it; else it is pulled again (int >= 0).
      push_bound: a cached row's gradients are summed on the worker and pushed
        once more than this many accumulated (int >= 0).
      policy: which clean slot a new row takes when the cache is full: "lfu"
        (fewest reads) or "lru" (least recently read).

    Raises:
      ValueError: a field out of range, naming it.
    """

    rows: int
    pull_bound: int = 5
    push_bound: int = 5
    policy: str = "lfu"

    def __post_init__(self):
        check_int(self.rows, "EmbeddingCache: rows", min=1, hint="rows cached per table "
                  "on each worker")
        check_int(self.pull_bound, "EmbeddingCache: pull_bound", min=0,
                  hint="updates of a row a cached read may miss; 0: always fresh")
        check_int(self.push_bound, "EmbeddingCache: push_bound", min=0,
                  hint="a row's updates held on the worker before its push; 0: every step")
        if self.policy not in POLICIES:
            raise ValueError(f"EmbeddingCache: policy must be one of {POLICIES} (which row "
                             f"leaves a full cache), got {self.policy!r}.")


def check_policy(policy) -> None:
    """Refuses an update policy the cache cannot apply to.

    Raises:
      ValueError: ``local_sgd`` (no step pushes to the ps) or an aggregating
        policy (``sync_replicas``: a round's mean of gradients, where a
        deferred push would carry several steps of one worker), naming the
        reason and the fix.
    """
    parts = list(getattr(policy, "parts", ()) or ()) + [policy]
    if any(getattr(p, "aggregates", False) for p in parts):
        raise ValueError(
            f"embedding_cache cannot apply under {policy.name}: it averages one gradient per "
            "worker per round, and a cached table pushes several steps' summed gradients at "
            "once. Use a per-step policy (async, drop_stale, staleness_aware, ssp, dc_asgd, "
            "route) or drop embedding_cache.")
    if not policy.updates_on_ps:
        raise ValueError(
            f"embedding_cache cannot apply under {policy.name}: every variable trains on "
            "per-worker copies and no step reads or pushes rows on the ps. Use a per-step "
            "policy, or route(sparse=..., dense=LocalSteps(k)) to keep the tables per step.")


def _learning_rate(optimizer, dtype):
    """The optimizer's current learning rate (a schedule called at its step)."""
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


def _is_keras3(optimizer) -> bool:
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


class CachedTable:
    """One table (or shard)'s cache: per-worker state, its ps clock, the
    read and the write.

    Args:
      var: the table variable (rank 2, static shape, on its ps).
      config: the :class:`EmbeddingCache`.
      capacity: slots of this table on each worker (int >= 1).
      worker_variable: ``(initial_value_fn, name) -> variable`` on each
        worker (the strategy's per-worker variables; plain variables in one
        process).
      scope: ``() -> context`` to create variables in (the strategy's scope).
      wire_dtype: None or tf.bfloat16: pulled rows cross in it.
    """

    def __init__(self, var, config: EmbeddingCache, capacity: int,
                 worker_variable: Callable, scope: Callable, wire_dtype=None,
                 name: Optional[str] = None):
        if var.shape.rank != 2 or not var.shape.is_fully_defined():
            raise ValueError(f"embedding_cache caches tables of a static [rows, dim] shape; "
                             f"{var.name} has shape {var.shape}.")
        self.var = var
        self.config = config
        self.capacity = int(capacity)
        self.num_rows, self.dim = var.shape.as_list()
        self.name = name or var.name
        self.wire_dtype = wire_dtype
        self._worker_variable = worker_variable
        self._scope = scope
        self.built = False
        self._handles = weakref.WeakKeyDictionary()  # outermost graph -> {name: handle}
        self._counts = weakref.WeakKeyDictionary()  # outermost graph -> pushed counts
        self.optimizer = None  # the optimizer of the last push traced (the flush's)
        self._said_uncached = False

    # -- state --------------------------------------------------------------------
    def build(self) -> None:
        """Creates the ps clock, counters and the per-worker state (once)."""
        if self.built:
            return
        n, r, d, dtype = self.num_rows, self.capacity, self.dim, self.var.dtype
        with tf.init_scope(), self._scope():
            with placement.beside(self.var):
                self.clock = tf.Variable(tf.zeros([n], tf.int64), trainable=False,
                                         name="cache_clock")
                self.counters = tf.Variable(tf.zeros([len(STATS)], tf.int64),
                                            trainable=False, name="cache_stats")
                self.histogram = tf.Variable(
                    tf.zeros([self.config.pull_bound + 1], tf.int64), trainable=False,
                    name="cache_staleness")
            wv = self._worker_variable
            self.slot_of = wv(lambda: tf.fill([n], tf.constant(-1, tf.int32)), "cache_slot_of")
            self.ids = wv(lambda: tf.fill([r], tf.constant(-1, tf.int64)), "cache_ids")
            self.rows = wv(lambda: tf.zeros([r, d], dtype), "cache_rows")
            self.seen = wv(lambda: tf.zeros([r], tf.int64), "cache_seen")
            self.count = wv(lambda: tf.zeros([r], tf.int64), "cache_count")
            self.gsum = wv(lambda: tf.zeros([r, d], dtype), "cache_gsum")
            self.delta = wv(lambda: tf.zeros([r, d], dtype), "cache_delta")
            self.score = wv(lambda: tf.zeros([r], tf.int64), "cache_score")
            self.tick = wv(lambda: tf.zeros([], tf.int64), "cache_tick")
        self.built = True

    _WORKER_STATE = ("slot_of", "ids", "rows", "seen", "count", "gsum", "delta", "score",
                     "tick")

    def worker_state(self):
        """``{name: variable}`` of the per-worker state (built)."""
        return {k: getattr(self, k) for k in self._WORKER_STATE}

    def _h(self):
        """The per-worker variables' handles, taken once per scheduled
        function in its outermost graph (a call-time capture is fed there
        only; nested graphs capture the tensor)."""
        top = graph_compat.outermost_graph()
        hs = self._handles.get(top)
        if hs is None:
            with top.as_default():
                hs = {k: v.handle for k, v in self.worker_state().items()}
            self._handles[top] = hs
        return hs

    # -- the seam -----------------------------------------------------------------
    def owns(self, var) -> bool:
        """Whether ``var`` (a tf.Variable, or a Keras 3 variable over one) is
        this table."""
        return variables_compat.backing_variable(var) is self.var

    def hooks(self) -> table_seam.TableHooks:
        """What this cache asks of the engine: its write before the push
        (``before_push``) and the clock's advance on the ps
        (``filter_gradient``)."""
        return table_seam.TableHooks(name=f"cache:{self.name}", owns=self.owns,
                                     before_push=self.push, filter_gradient=self.count_updates,
                                     before_update=self.count_pushed)

    # -- read ---------------------------------------------------------------------
    def read(self, sparse_read, indices, name=None):
        """``sparse_read(indices)`` served by the cache (traced reads; an
        eager read is the table's own). Shape ``indices.shape + [dim]``."""
        indices = tf.convert_to_tensor(indices)
        if not graph_compat.inside_function():
            return sparse_read(indices, name=name)
        if trace_context.EVERY_ID.get():
            # A dynamic table's rows (an id's row changes on eviction): the
            # strategy's uncached read.
            if not self._said_uncached:
                self._said_uncached = True
                logging.warning(
                    "embedding_cache: %s is a DynamicEmbedding table, read uncached (its row "
                    "of an id changes on an eviction, which a clock per row cannot tell); "
                    "use a fixed Embedding or EmbeddingCollection to cache its rows.",
                    self.name)
            return lookup_lib.distinct_rows_gather(
                sparse_read, indices, name, wire_dtype=self.wire_dtype,
                num_rows=self.num_rows, variable=self.var)
        self.build()
        op = indices.op
        held = {}
        # Keras 3's reads (lookup.per_id_gradients): a gradient row per id
        # occurrence, as its own rules square each occurrence.
        per_id = trace_context.PER_ID_GRADIENTS.get()

        def forward():
            out, unique, position = self._read(sparse_read, indices, name, op)
            held.update(unique=unique, position=position)
            return out

        def backward(dy):
            with graph_compat.colocate_only_with(op):
                rows = tf.reshape(dy, [-1, self.dim])
                if per_id:
                    return tf.IndexedSlices(tf.cast(rows, self.var.dtype),
                                            tf.reshape(indices, [-1]),
                                            tf.constant([self.num_rows, self.dim], tf.int64))
                unique = held["unique"]
                summed = tf.math.unsorted_segment_sum(rows, held["position"],
                                                      tf.size(unique))
                return tf.IndexedSlices(tf.cast(summed, self.var.dtype), unique,
                                        tf.constant([self.num_rows, self.dim], tf.int64))

        return variables_compat.recorded_on_variable(self.var, forward, backward)

    def _read(self, sparse_read, indices, name, op):
        cfg, h, dtype = self.config, self._h(), self.var.dtype
        r, d = self.capacity, self.dim
        with graph_compat.colocate_only_with(op):  # the worker
            flat = tf.reshape(indices, [-1])
            unique, position = tf.unique(flat)
            ids = tf.cast(unique, tf.int64)
            n = tf.size(unique)
            slot = variables_compat.gather_handle(h["slot_of"], ids, tf.int32)
            cached = slot >= 0
            safe = tf.maximum(slot, 0)
            seen = tf.where(cached, variables_compat.gather_handle(h["seen"], safe, tf.int64),
                            tf.constant(-1, tf.int64))
            wire_ids = grads_lib.narrow_indices(ids, self.num_rows)
        with tf.device(self.clock.device):  # the ps: which rows cross
            server = tf.gather(self.clock, wire_ids)
            behind = server - seen
            need = tf.logical_or(seen < 0, behind > cfg.pull_bound)
            need_at = tf.reshape(tf.where(need), [-1])
            fresh_clock = tf.gather(server, need_at)
            need_ids = tf.gather(wire_ids, need_at)
            served = tf.boolean_mask(behind, tf.logical_not(need))
            counted = self.histogram.assign_add(tf.math.bincount(
                tf.cast(served, tf.int32), minlength=cfg.pull_bound + 1,
                maxlength=cfg.pull_bound + 1, dtype=tf.int64))
        fresh = sparse_read(need_ids, name=name)
        fresh = grads_lib.read_over_wire(fresh, self.wire_dtype, back_with=op)
        with graph_compat.colocate_only_with(op):
            need, need_at = tf.identity(need), tf.identity(need_at)
            fresh, fresh_clock = tf.identity(fresh), tf.identity(fresh_clock)
            shape = tf.stack([tf.cast(n, tf.int64), d])
            at = need_at[:, None]
            fresh_full = tf.scatter_nd(at, tf.cast(fresh, dtype), shape)
            clock_full = tf.scatter_nd(at, fresh_clock, shape[:1])
            kept = variables_compat.gather_handle(h["rows"], safe, dtype)
            own = tf.where(cached[:, None], variables_compat.gather_handle(h["delta"], safe, dtype),
                           tf.zeros_like(kept))
            # A pulled row of a cached id keeps the worker's unpushed updates.
            values = tf.where(need[:, None], fresh_full + own, kept)
            writes, evictions = self._place(h, ids, slot, cached, need, values, clock_full, r)
            n64, pulled = tf.cast(n, tf.int64), tf.size(need_at, out_type=tf.int64)
            writes.append(self._count(lookups=tf.size(flat, out_type=tf.int64), distinct=n64,
                                      hits=n64 - pulled, rows_pulled=pulled,
                                      evictions=evictions))
            with tf.control_dependencies(writes + [counted]):
                out = tf.gather(values, position)
            out = tf.reshape(out, tf.concat([tf.shape(indices), [d]], 0))
            out.set_shape(indices.shape.concatenate([d]))
        return out, wire_ids, position

    def _place(self, h, ids, slot, cached, need, values, clock_full, r):
        """Writes a read's pulled rows into the cache; returns the write ops
        and the number of rows evicted."""
        cfg = self.config
        refresh_at = tf.reshape(tf.where(tf.logical_and(need, cached)), [-1])
        refresh_slot = tf.gather(slot, refresh_at)
        writes = [variables_compat.scatter_update_handle(h["rows"], refresh_slot, tf.gather(values, refresh_at)),
                  variables_compat.scatter_update_handle(h["seen"], refresh_slot,
                                           tf.gather(clock_full, refresh_at))]
        # New ids take clean slots: free ones first, then by LFU/LRU score.
        new_at = tf.reshape(tf.where(tf.logical_and(need, tf.logical_not(cached))), [-1])
        hit_slot = tf.boolean_mask(slot, cached)
        in_use = tf.scatter_nd(hit_slot[:, None], tf.ones_like(hit_slot), [r]) > 0
        slot_ids = variables_compat.read_handle(h["ids"], tf.int64)
        dirty = variables_compat.read_handle(h["count"], tf.int64) > 0
        score = variables_compat.read_handle(h["score"], tf.int64)
        blocked = tf.logical_or(in_use, dirty)
        key = tf.where(blocked, tf.constant(_BIG, tf.float64),
                       tf.where(slot_ids < 0, tf.constant(-1.0, tf.float64),
                                tf.cast(score, tf.float64)))
        free = r - tf.reduce_sum(tf.cast(blocked, tf.int32))
        k = tf.minimum(tf.size(new_at), free)
        _, victims = tf.math.top_k(-key, k=k, sorted=True)
        take_at = new_at[:k]
        take_ids = tf.gather(ids, take_at)
        old = tf.gather(slot_ids, victims)
        evicted = old >= 0
        with tf.control_dependencies([slot_ids, dirty, score]):
            gone = variables_compat.scatter_update_handle(h["slot_of"], tf.boolean_mask(old, evicted),
                                            tf.fill([tf.reduce_sum(tf.cast(evicted, tf.int32))],
                                                    tf.constant(-1, tf.int32)))
            with tf.control_dependencies([gone]):
                writes.append(variables_compat.scatter_update_handle(h["slot_of"], take_ids, victims))
            zeros_rd = tf.zeros([k, self.dim], self.var.dtype)
            zeros_r = tf.zeros([k], tf.int64)
            writes += [
                variables_compat.scatter_update_handle(h["ids"], victims, take_ids),
                variables_compat.scatter_update_handle(h["rows"], victims, tf.gather(values, take_at)),
                variables_compat.scatter_update_handle(h["seen"], victims, tf.gather(clock_full, take_at)),
                variables_compat.scatter_update_handle(h["count"], victims, zeros_r),
                variables_compat.scatter_update_handle(h["gsum"], victims, zeros_rd),
                variables_compat.scatter_update_handle(h["delta"], victims, zeros_rd)]
            reset = variables_compat.scatter_update_handle(h["score"], victims, zeros_r)
        used = tf.concat([hit_slot, victims], 0)
        with tf.control_dependencies([reset]):
            if cfg.policy == "lfu":
                writes.append(variables_compat.scatter_add_handle(h["score"], used, tf.ones_like(used,
                                                                                   tf.int64)))
            else:
                tick = variables_compat.read_handle(h["tick"], tf.int64) + 1
                with tf.control_dependencies([variables_compat.assign_handle(h["tick"], tick)]):
                    writes.append(variables_compat.scatter_update_handle(
                        h["score"], used, tf.fill(tf.shape(used), tick)))
        return writes, tf.reduce_sum(tf.cast(evicted, tf.int64))

    def _count(self, **values):
        """Adds ``values`` (int64 scalars by :data:`STATS` name) to the counters."""
        zero = tf.constant(0, tf.int64)
        vector = tf.stack([tf.cast(values.get(k, zero), tf.int64) for k in STATS])
        with tf.device(self.counters.device):
            return self.counters.assign_add(vector)

    # -- write --------------------------------------------------------------------
    def push(self, grad, var, optimizer):
        """The step's gradient of this table, on the worker, as the push: the
        cached rows' gradients accumulated (and applied to the local copy),
        the rows due and the uncached rows' gradients returned as one
        IndexedSlices (a ``TableHooks.before_push``)."""
        if not isinstance(grad, tf.IndexedSlices) or not self.built:
            return grad
        self.optimizer = optimizer
        if _is_keras3(optimizer):
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
        counted = self._count(rows_pushed=tf.size(push_ids, out_type=tf.int64),
                              updates_pushed=tf.reduce_sum(push_n),
                              updates=tf.size(ids, out_type=tf.int64))
        with tf.control_dependencies([counted]):
            push_g = tf.identity(push_g)
        self._counts[graph_compat.outermost_graph()] = (push_n, None)
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
        counted = self._count(rows_pushed=tf.size(push_ids, out_type=tf.int64),
                              updates_pushed=tf.reduce_sum(push_n),
                              updates=tf.size(ids, out_type=tf.int64))
        with tf.control_dependencies(written + [counted]):
            values = tf.identity(values)
        self._counts[graph_compat.outermost_graph()] = (
            push_n, grads_lib.narrow_indices(push_ids, self.num_rows))
        return tf.IndexedSlices(tf.cast(values, grad.values.dtype), indices, grad.dense_shape)

    def count_updates(self, grad, var):
        """On the ps, right before the optimizer applies a push: each pushed
        row's clock advances by the updates it carries (a
        ``TableHooks.filter_gradient``)."""
        counts, ids = self._counts.get(graph_compat.outermost_graph(), (None, None))
        if counts is None or ids is not None or not isinstance(grad, tf.IndexedSlices):
            return grad
        with tf.device(self.clock.device):
            ticked = self._tick(counts, grad.indices)
        with tf.control_dependencies([ticked]):
            values = tf.identity(grad.values)
        return tf.IndexedSlices(values, grad.indices, grad.dense_shape)

    def count_pushed(self, optimizer, variables):
        """On the ps, right before the optimizer applies a Keras 3 push: the
        pushed ids' clocks advance by the updates each carries (a
        ``TableHooks.before_update``; the gradient itself stays the object
        core/rowwise.py carries its squares for)."""
        counts, ids = self._counts.get(graph_compat.outermost_graph(), (None, None))
        if counts is None or ids is None:
            return None
        with tf.device(self.clock.device):
            return self._tick(counts, ids)

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

    def count_lost(self) -> int:
        """Once every live worker's updates are pushed (the flush): the
        updates made but never pushed (a worker that died holding them, its
        cache rebuilt empty) are counted in ``updates_lost``. Returns them."""
        c = dict(zip(STATS, self.counters.numpy().tolist()))
        lost = c["updates"] - c["updates_pushed"] - c["updates_lost"]
        if lost > 0:
            self._count(updates_lost=lost)
        return max(lost, 0)

    # -- reports ------------------------------------------------------------------
    def stats(self) -> dict:
        """``{counter: int}`` (see :data:`STATS`) and ``"staleness"``: the
        histogram of cached reads by the updates they missed (list of
        ints, index = updates, 0..pull_bound). Eager reads on the ps."""
        if not self.built:
            return dict({k: 0 for k in STATS}, staleness=[0] * (self.config.pull_bound + 1))
        values = self.counters.numpy().tolist()
        return dict(zip(STATS, values), staleness=self.histogram.numpy().tolist())


#: A worker's state cannot be read: it died or restarted (a new context).
_WORKER_GONE = (tf.errors.AbortedError, tf.errors.UnavailableError, tf.errors.CancelledError)


class Caches:
    """The strategy's cached tables: one :class:`CachedTable` per table
    variable (or shard) created in its scope, the flush, the reports.

    Args:
      config: the :class:`EmbeddingCache`.
      strategy: the ``AsyncParameterServerStrategy``.
      register: ``hooks -> None`` (the engine's ``register_table``).
      wire_dtype: None or tf.bfloat16 (pulled rows cross in it).
    """

    def __init__(self, config: EmbeddingCache, strategy, register, wire_dtype=None):
        self.config = config
        self.tables = []
        self._strategy = strategy
        self._register = register
        self._wire_dtype = wire_dtype

    def add(self, part, table_shape=None) -> bool:
        """Caches ``part`` (a trainable rank-2 variable of static shape, a
        table or one of its shards; ``table_shape``: the whole table's):
        its row reads in functions go through the cache. Its state is built
        at its first traced row read (a Dense kernel, never read by rows,
        gets none). Returns False for any other variable."""
        shape = part.shape
        if shape.rank != 2 or not shape.is_fully_defined():
            return False
        table_rows = shape[0]
        if table_shape is not None and table_shape.rank == 2 and table_shape[0]:
            table_rows = table_shape[0]
        capacity = max(1, -(-self.config.rows * shape[0] // table_rows))
        strategy = self._strategy
        table = CachedTable(
            part, self.config, min(capacity, shape[0]),
            worker_variable=lambda init, name: variables_compat.per_worker_variable(
                strategy, init, name),
            scope=strategy.scope, wire_dtype=self._wire_dtype)
        self.tables.append(table)
        self._register(table.hooks())
        return variables_compat.replace_sparse_read(part, table.read)

    def stats(self) -> dict:
        """``{table name: CachedTable.stats()}`` of the tables read so far."""
        return {t.name: t.stats() for t in self.tables if t.built}

    def flush(self) -> int:
        """Pushes every worker's unpushed updates (on the chief, once the
        schedule drained: ``join``): per worker one optimizer update of its
        rows' summed gradients, each row's clock advanced by its updates.
        Returns the rows pushed."""
        total = 0
        tables = [t for t in self.tables if t.built and t.optimizer is not None]
        per_worker = {}
        for t in tables:
            states = {k: variables_compat.per_worker_values(v)
                      for k, v in t.worker_state().items()}
            if any(v is None for v in states.values()):
                continue
            for w in range(len(states["count"])):
                count = states["count"][w]
                try:
                    with tf.device(count.device):
                        slots = tf.reshape(tf.where(count.read_value() > 0), [-1])
                        ids = tf.gather(states["ids"][w].read_value(), slots)
                        n = tf.gather(count.read_value(), slots)
                        g = tf.gather(states["gsum"][w].read_value(), slots)
                except (*_WORKER_GONE, tf.errors.InvalidArgumentError) as e:
                    if isinstance(e, tf.errors.InvalidArgumentError) and \
                            "restarted" not in str(e):
                        raise
                    # Its updates are lost: count_lost counts them below.
                    logging.warning("embedding_cache: worker %d is unreachable at the flush "
                                    "(%s); its unpushed updates of %s are lost.", w,
                                    type(e).__name__, t.name)
                    continue
                if int(tf.size(slots)) == 0:
                    continue
                per_worker.setdefault(w, []).append((t, ids, n, g, states, slots))
        for w, items in sorted(per_worker.items()):
            by_opt = {}
            for item in items:
                by_opt.setdefault(id(item[0].optimizer), []).append(item)
            for group in by_opt.values():
                pairs = [(tf.IndexedSlices(g, ids, tf.constant([t.num_rows, t.dim], tf.int64)),
                          t.var) for t, ids, n, g, _, _ in group]
                optimizer = group[0][0].optimizer
                if _is_keras3(optimizer):  # its own update, in cross-replica context
                    with self._strategy.scope():
                        optimizer.apply_gradients(pairs)
                else:
                    with self._strategy.scope(), tf.distribute.ReplicaContext(
                            self._strategy, replica_id_in_sync_group=0):
                        optimizer.apply_gradients(pairs)
                for t, ids, n, g, states, slots in group:
                    with tf.device(t.clock.device):
                        t._tick(n, ids)
                    t._count(updates_pushed=tf.reduce_sum(n), rows_flushed=tf.size(ids))
                    for k in ("count", "gsum", "delta"):
                        v = states[k][w]
                        with tf.device(v.device):
                            v.scatter_update(tf.IndexedSlices(
                                tf.zeros(tf.concat([tf.shape(slots), v.shape[1:]], 0),
                                         v.dtype), slots))
                    total += int(tf.size(ids))
        for t in self.tables:
            if t.built:
                t.count_lost()
        return total
