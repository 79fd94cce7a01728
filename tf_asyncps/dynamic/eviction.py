"""Eviction: which rows of a DynamicTable go, and when.

Eviction (:meth:`DynamicTable.maybe_evict`) runs after an update, once every
``evict_every`` global steps per shard, in the shard's critical section (so
one worker does it per shard and period): rows unseen for ``ttl_steps``
(if set) go, then as many rows as ids were refused a row since the last
pass (no free row on their shard), coldest first: lowest count (``"lfu"``;
counts then halve, so ids that went cold lose their rank) or oldest last
step (``"lru"``). An evicted row gets fresh initializer values and its
optimizer slots their initial values (Adagrad's accumulator, Adam's zero
moments), so the next id starts as a new row would.

Sources: TorchRec managed-collision modules (LFU/LRU eviction against the
ids waiting for a row, with optimizer state reset); TensorFlow
Recommenders-Addons ``dynamic_embedding`` (restrict policies by frequency
and timestamp); DeepRec EmbeddingVariable (global-step eviction).
"""

import tensorflow as tf

from tf_asyncps.dynamic import deltas as deltas_lib

__all__ = ["EVICTIONS", "evict_shard", "maybe_evict"]

EVICTIONS = ("lfu", "lru")
_INT64_MAX = tf.int64.max


def maybe_evict(table, step, slots_of) -> tf.Operation:
    """Each shard's eviction pass if one is due at global ``step``
    (:meth:`tf_asyncps.dynamic.table.DynamicTable.maybe_evict`, whose
    arguments these are); returns the op."""
    step = tf.cast(step, tf.int64)  # a Python int too
    table.prepare()
    ops = []
    for shard in table.shards:
        resets = [(shard.var, table.initializer)]
        resets += [(slot, lambda shape, v=value: tf.fill(shape, float(v)))
                   for slot, value in slots_of(shard.var)]
        # All on the shard's ps (on the worker: ~6 KB per step, measured);
        # not after the caller's control inputs (a control message each):
        # g orders `period`, and `passes` is read again under the lock.
        with tf.device(shard.device):
            g = tf.identity(step)
            with tf.control_dependencies(None):
                period = g // tf.constant(table.evict_every, tf.int64)
                passes = shard.passes.read_value()

            def run_pass(s=shard, r=resets, g=g, period=period):
                return evict_shard(s, g, period, table.eviction, table.evict_every,
                                   table.ttl_steps, r)

            def locked(s=shard, run_pass=run_pass, period=period):
                # Checked again under the lock: one worker per period.
                return s.lock.execute(
                    lambda: tf.cond(period > s.passes.read_value(), run_pass, tf.no_op),
                    exclusive_resource_access=False)

            ops.append(tf.cond(period > passes, locked, tf.no_op))
    return tf.group(ops)


def evict_shard(shard, step, period, eviction: str, evict_every: int, ttl_steps,
                reset_values) -> tf.Operation:
    """One eviction pass of ``shard`` (a table shard; see the module
    docstring); the caller runs it in the shard's critical section, on its
    ps. Returns its op."""
    live = shard.count > 0
    victims = tf.zeros([shard.rows], tf.bool)
    if ttl_steps is not None:
        # Lookups record the step they read (s); the pass runs at the step
        # after an update (s + 1): unseen in the last ttl_steps steps.
        victims = live & (shard.last < step - ttl_steps)
    remaining = live & ~victims
    # Ids refused a row since the last pass (their filter slots), hottest
    # first, against the coldest rows: the j-th coldest row goes if the
    # j-th hottest waiting id beats it (TorchRec's LFU/LRU merge).
    waiting = tf.boolean_mask(shard.filter, shard.waiting)
    need = tf.minimum(tf.size(waiting, out_type=tf.int64),
                      tf.reduce_sum(tf.cast(remaining, tf.int64)))
    score = shard.count if eviction == "lfu" else shard.last
    order = tf.argsort(tf.where(remaining, score, _INT64_MAX), stable=True)[:need]
    if eviction == "lfu":
        rivals = tf.sort(waiting, direction="DESCENDING")[:need]
    else:  # waiting ids were seen in this period (lookups at steps
        # step - evict_every .. step - 1); rows last seen before it lose
        rivals = tf.fill([need], step - evict_every)
    beaten = tf.gather(score, order) < rivals
    cold = tf.scatter_nd(tf.boolean_mask(order, beaten)[:, None],
                         tf.ones_like(tf.boolean_mask(order, beaten), tf.bool),
                         [shard.rows])
    gone = tf.where(victims | cold)[:, 0]
    k = tf.size(gone)
    # A reader's tombstones and marks (dynamic/deltas.py), before the keys change.
    updates = [shard.index.remove(tf.gather(shard.key, gone))] + deltas_lib.mark_eviction(
        shard, gone)
    if shard.gen is not None:  # local_sgd: the workers' copies are stale now
        updates.append(shard.gen.scatter_add(tf.IndexedSlices(tf.ones_like(gone), gone)))
    with tf.control_dependencies(updates):
        updates += [shard.count.scatter_update(tf.IndexedSlices(tf.zeros([k], tf.int64), gone)),
                    shard.last.scatter_update(tf.IndexedSlices(tf.zeros([k], tf.int64), gone))]
    with tf.control_dependencies(updates):
        if eviction == "lfu":  # aging: what went cold loses its rank
            updates.append(shard.count.assign(tf.where(
                shard.count > 0, tf.maximum(shard.count // 2, 1), 0)))
            updates.append(shard.filter.assign(shard.filter // 2))
        for var, value in reset_values:
            shape = tf.concat([[k], tf.shape(var)[1:]], 0)
            updates.append(var.scatter_update(tf.IndexedSlices(
                tf.cast(value(shape), var.dtype), gone)))
        top = shard.free_rows.read_value()
        updates += [shard.free.scatter_update(tf.IndexedSlices(
                        gone, top + tf.range(tf.cast(k, tf.int64)))),
                    shard.free_rows.assign(top + tf.cast(k, tf.int64)),
                    shard.live.assign_sub(tf.cast(k, tf.int64)),
                    shard.waiting.assign(tf.zeros([shard.filter_slots], tf.bool)),
                    shard.passes.assign(period),
                    shard.evicted.assign_add(tf.cast(k, tf.int64))]
    return tf.group(updates)
