"""The worker embedding cache's read (HET's pull rule; see
:mod:`tf_asyncps.core.embedding_cache`): a traced row read sends each
distinct id with the clock its cached row saw; the ps answers which rows
are behind by more than ``pull_bound`` and sends only those; the worker
places them (LFU/LRU over clean slots) and serves the rest from its copy.

Source: X. Miao et al., "HET: Scaling out Huge Embedding Model Training via
Cache-enabled Distributed Framework", PVLDB 15(2), 2022.
"""

import tensorflow as tf
from absl import logging

from tf_asyncps.compat import graph as graph_compat
from tf_asyncps.compat import variables as variables_compat
from tf_asyncps.core import grads as grads_lib
from tf_asyncps.core import lookup as lookup_lib
from tf_asyncps.core import trace_context

__all__ = ["CacheRead"]

_BIG = 2.0 ** 62  # a slot that cannot take a new id sorts last

#: A row's clock crosses as its low 31 bits (an int32 >= 0; -1 marks an id
#: not cached) and the ps compares clocks modulo 2**31: exact while a cached
#: copy is fewer than 2**31 updates of its row behind the ps.
_CLOCK_BITS = 31
_CLOCK_MASK = 2 ** _CLOCK_BITS - 1


def _int32_as(bits, dtype):
    """int32 ``[n, 2]`` as columns of ``dtype`` (4 bytes: ``[n, 2]``; 2
    bytes: ``[n, 4]``; 8 bytes: ``[n, 1]``), to cross beside rows of it."""
    size = tf.as_dtype(dtype).size
    if size == 8:
        return tf.reshape(tf.bitcast(bits, dtype), [-1, 1])
    out = tf.bitcast(bits, dtype)
    return out if size == 4 else tf.reshape(out, [-1, 2 * 4 // size])


def _int32_from(columns):
    """The int32 ``[n, 2]`` of :func:`_int32_as`'s ``width`` columns."""
    size = columns.dtype.size
    if size == 8:
        return tf.reshape(tf.bitcast(columns[:, 0], tf.int32), [-1, 2])
    if size == 4:
        return tf.bitcast(columns, tf.int32)
    return tf.bitcast(tf.reshape(columns, [-1, 2, 4 // size]), tf.int32)


class CacheRead:
    """The read half of :class:`~tf_asyncps.core.embedding_cache.CachedTable`
    (a mixin: it uses the table's state, ``_h``, ``build`` and ``_count``)."""

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
            # One tensor to the ps: the ids, then the clocks their copies
            # saw (31 bits, see _CLOCK_BITS; -1: not cached).
            request = tf.concat([wire_ids, tf.cast(seen, wire_ids.dtype)], 0)
        with tf.device(self.clock.device):  # the ps: which rows cross
            half = tf.size(request) // 2
            asked, seen_on_ps = request[:half], tf.cast(request[half:], tf.int64)
            server = tf.gather(self.clock, asked)
            behind = tf.bitwise.bitwise_and(server - seen_on_ps, _CLOCK_MASK)
            need = tf.logical_or(seen_on_ps < 0, behind > cfg.pull_bound)
            need_at = tf.reshape(tf.where(need), [-1])
            # What the worker stores: the clock's low 31 bits, and where each
            # pulled row goes among the read's ids.
            fresh_bits = tf.stack([tf.cast(tf.bitwise.bitwise_and(tf.gather(server, need_at),
                                                                  _CLOCK_MASK), tf.int32),
                                   tf.cast(need_at, tf.int32)], 1)
            need_ids = tf.gather(asked, need_at)
            served = tf.boolean_mask(behind, tf.logical_not(need))
            distinct = tf.size(asked, out_type=tf.int64)
            pulled = tf.size(need_at, out_type=tf.int64)
            # No control edge to the worker's rows: a traced step runs every
            # stateful op it holds, and an edge between tasks is a message
            # (one op: each stateful op on the ps is one more).
            self._count(distinct=distinct, hits=distinct - pulled, rows_pulled=pulled,
                        histogram=tf.math.bincount(
                            tf.cast(served, tf.int32), minlength=cfg.pull_bound + 1,
                            maxlength=cfg.pull_bound + 1, dtype=tf.int64))
        fresh = sparse_read(need_ids, name=name)
        # One tensor back: the pulled rows (in the wire dtype) with their
        # clock and position as bits beside them.
        with graph_compat.colocate_only_with(fresh.op):
            wire = grads_lib.wire_dtype_of(fresh.dtype, self.wire_dtype)
            rows = tf.reshape(fresh if wire is None else tf.cast(fresh, wire), [-1, d])
            packed = tf.concat([rows, _int32_as(fresh_bits, rows.dtype)], 1)
        with graph_compat.colocate_only_with(op):
            packed = tf.identity(packed)
            fresh = tf.cast(packed[:, :d], dtype)
            bits = _int32_from(packed[:, d:])
            fresh_clock, need_at = tf.cast(bits[:, 0], tf.int64), bits[:, 1]
            shape = tf.stack([tf.cast(n, tf.int64), d])
            at = tf.cast(need_at, tf.int64)[:, None]
            need = tf.scatter_nd(at, tf.ones_like(need_at), shape[:1]) > 0
            fresh_full = tf.scatter_nd(at, fresh, shape)
            clock_full = tf.scatter_nd(at, fresh_clock, shape[:1])
            kept = variables_compat.gather_handle(h["rows"], safe, dtype)
            own = tf.where(cached[:, None], variables_compat.gather_handle(h["delta"], safe, dtype),
                           tf.zeros_like(kept))
            # A pulled row of a cached id keeps the worker's unpushed updates.
            values = tf.where(need[:, None], fresh_full + own, kept)
            writes, evictions = self._place(h, ids, slot, cached, need, values, clock_full, r)
            # Counted where each arises: no counter crosses.
            variables_compat.scatter_add_handle(
                h["local"], tf.constant([0, 1], tf.int32),
                tf.stack([tf.size(flat, out_type=tf.int64), evictions]))
            with tf.control_dependencies(writes):
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
