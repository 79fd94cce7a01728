"""The worker embedding cache's flush (see
:mod:`tf_asyncps.core.embedding_cache`): once the schedule drained
(``join``), every live worker's unpushed row updates reach the ps, one
optimizer update per worker and optimizer, each row's clock advanced by its
updates; updates a dead worker held are counted lost.
"""

import tensorflow as tf
from absl import logging

from tf_asyncps.compat import variables as variables_compat
from tf_asyncps.core import cache_write

__all__ = ["WORKER_GONE", "flush"]

#: A worker's state cannot be read: it died or restarted (a new context).
WORKER_GONE = (tf.errors.AbortedError, tf.errors.UnavailableError, tf.errors.CancelledError)


def flush(tables, strategy) -> int:
    """Pushes every worker's unpushed updates of ``tables`` (CachedTable
    list; on the chief, once the schedule drained) under ``strategy``: per
    worker one optimizer update of its rows' summed gradients, each row's
    clock advanced by its updates; then counts the updates lost with a dead
    worker. Returns the rows pushed."""
    total = 0
    tables = [t for t in tables if t.built and t.optimizer is not None]
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
            except (*WORKER_GONE, tf.errors.InvalidArgumentError) as e:
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
            if cache_write.is_keras3(optimizer):  # its own update, in cross-replica context
                with strategy.scope():
                    optimizer.apply_gradients(pairs)
            else:
                with strategy.scope(), tf.distribute.ReplicaContext(
                        strategy, replica_id_in_sync_group=0):
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
    for t in tables:
        if t.built:
            t.count_lost()
    return total
