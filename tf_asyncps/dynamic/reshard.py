"""A DynamicTable restored onto another number of shards.

A checkpoint holds the table's live rows by global row, with their keys,
counts and last steps and their optimizer slots (checkpoint.py). A
restore onto the same shards brings everything back as it was; onto another
number of shards it brings back the rows, keys, counts and last steps by
global row, and marks every shard: the first lookup after it (or eviction
pass), as it is traced or run eagerly, re-homes the table once, eagerly from
the chief, under shard 0's critical section (:func:`prepare`, :func:`rehome`):

* every live id goes to its home shard ``hash(id) % num_shards``: an id
  already there keeps its row; the others take the lowest free rows of their
  home shard, their row values copied there, their old rows reset
  (initializer values);
* a home shard with more ids than rows keeps the hottest ones by the table's
  eviction rule (LFU: highest count; LRU: latest last step; then ids already
  there; then lowest row); the others are evicted (counted in ``evicted``
  and in :meth:`DynamicTable.reshard_stats`), as an eviction pass would;
* the index, free stack, live count and counting filter of each shard are
  rebuilt (the filter starts empty: its slots hash over the shard's length).

The optimizer's slots of the moved rows move when the first update after it
is traced (:func:`prepare_slots`, from the engine's before-update hook):
before that the slots may not exist yet.

Cost on the default path: nothing in the traced step but one assert on a
local scalar in each shard's lookup (:func:`check`: a restore after the step
was traced fails there, naming the fix); one scalar read per shard from the
chief each time a lookup is traced. Measured on ``dynamic@emb`` (netns, one
repeat of 160 steps, the shared 2-core machine): 87.9 KB per worker step and
39.0 steps/s, against 87.5 KB and 34.6 steps/s before this module; a first
version with a ``tf.cond`` per shard and step whose branch spans every ps
ran 19.6 and 20.2 steps/s (88.8 and 89.3 KB).
"""

import types

import tensorflow as tf

from tf_asyncps.core import placement

__all__ = ["plan_rows", "prepare", "check", "prepare_slots", "rehome", "move_slots",
           "metadata_from_index"]


def metadata_from_index(shard) -> tf.Operation:
    """A shard's keys, counts (1), last steps (0), free stack and live count
    rebuilt from its index: a restore brought the map back without them (a
    SavedModel, a checkpoint written before they were saved by the table)."""
    ids, rows = shard.index.export()
    local = rows - shard.offset
    size = [shard.rows]
    empty = tf.constant("" if ids.dtype == tf.string else 0, ids.dtype)
    count = tf.tensor_scatter_nd_update(tf.zeros(size, tf.int64), local[:, None],
                                        tf.ones_like(local))
    free = tf.where(count == 0)[:, 0]
    k = tf.size(free, out_type=tf.int64)
    return tf.group(
        shard.key.assign(tf.tensor_scatter_nd_update(tf.fill(size, empty), local[:, None], ids)),
        shard.count.assign(count), shard.last.assign(tf.zeros(size, tf.int64)),
        shard.free.assign(tf.concat([tf.reverse(free, [0]), tf.zeros([shard.rows - k],
                                                                     tf.int64)], 0)),
        shard.free_rows.assign(k), shard.live.assign(tf.size(local, out_type=tf.int64)))


def _sort_keep(rows, score, stay):
    """Positions of ``rows`` best first: highest ``score``, then the rows
    that ``stay``, then the lowest row (a total order: rows are distinct)."""
    order = tf.argsort(rows, stable=True)
    order = tf.gather(order, tf.argsort(tf.cast(~tf.gather(stay, order), tf.int32),
                                        stable=True))
    return tf.gather(order, tf.argsort(-tf.gather(score, order), stable=True))


def plan_rows(rows, home, score, sizes):
    """Where each live row goes when shard ``t`` owns rows
    ``sum(sizes[:t]) .. sum(sizes[:t+1]) - 1`` (plain TF ops, any device).

    Args:
      rows: int64 [m] distinct global rows holding an id now.
      home: int64 [m] home shard of each row's id (in ``range(len(sizes))``).
      score: int64 [m], higher is kept first when a home shard is full.
      sizes: Python ints, rows of each shard.

    Returns:
      int64 [m]: the global row each id holds after (its own row when it is
      home already; the lowest free rows of its home shard, best first,
      otherwise), -1 for an id its full home shard could not keep.
    """
    dst = tf.fill(tf.shape(rows), tf.constant(-1, tf.int64))
    offset = 0
    for t, size in enumerate(sizes):
        mine = tf.where(tf.equal(home, t))[:, 0]
        r = tf.gather(rows, mine)
        stay = (r >= offset) & (r < offset + size)
        keep = _sort_keep(r, tf.gather(score, mine), stay)[:size]
        kept_stay = tf.boolean_mask(keep, tf.gather(stay, keep))
        kept_move = tf.boolean_mask(keep, ~tf.gather(stay, keep))
        occupied = tf.scatter_nd(tf.gather(r, kept_stay)[:, None] - offset,
                                 tf.ones_like(kept_stay, tf.bool), [size])
        free = tf.where(~occupied)[:, 0][:tf.size(kept_move)] + offset
        dst = tf.tensor_scatter_nd_update(dst, tf.gather(mine, kept_stay)[:, None],
                                          tf.gather(r, kept_stay))
        dst = tf.tensor_scatter_nd_update(dst, tf.gather(mine, kept_move)[:, None], free)
        offset += size
    return dst


def _owner(shards, rows):
    """Index of the shard holding each global row."""
    bounds = tf.constant([s.offset for s in shards[1:]], tf.int64)
    return tf.cast(tf.searchsorted(bounds, rows, side="right"), tf.int32)


def _gather(shards, parts, rows):
    """Values of global ``rows`` of a table split as ``shards`` (``parts``:
    one variable per shard), in the order of ``rows``."""
    n = len(shards)
    if n == 1:
        return tf.gather(parts[0], rows)
    owner = _owner(shards, rows)
    where = tf.dynamic_partition(tf.range(tf.size(rows)), owner, n)
    pieces = tf.dynamic_partition(rows, owner, n)
    values = [tf.gather(p, piece - s.offset) for s, p, piece in zip(shards, parts, pieces)]
    return tf.dynamic_stitch(where, values)


def _scatter(shards, parts, rows, values):
    """Writes ``values`` (one per row, or a function of the row count) to
    global ``rows``; returns the ops."""
    owner = _owner(shards, rows)
    n = len(shards)
    pieces = tf.dynamic_partition(rows, owner, n)
    if callable(values):
        chunks = [None] * n
    else:
        chunks = tf.dynamic_partition(values, owner, n)
    ops = []
    for s, p, piece, chunk in zip(shards, parts, pieces, chunks):
        if chunk is None:
            shape = tf.concat([tf.shape(piece), tf.shape(p)[1:]], 0)
            chunk = tf.cast(values(shape), p.dtype)
        ops.append(p.scatter_update(tf.IndexedSlices(chunk, piece - s.offset)))
    return ops


def rehome(table, home_of) -> tf.Operation:
    """Re-homes every live id onto this table's shards (module docstring);
    run once, in shard 0's critical section, after checkpoint.restore_state
    marked the shards. ``home_of(ids)``: int64 home shard of each id."""
    shards, n = table.shards, len(table.shards)
    live = [tf.where(s.count > 0)[:, 0] for s in shards]
    keys = tf.concat([tf.gather(s.key, i) for s, i in zip(shards, live)], 0)
    count = tf.concat([tf.gather(s.count, i) for s, i in zip(shards, live)], 0)
    last = tf.concat([tf.gather(s.last, i) for s, i in zip(shards, live)], 0)
    rows = tf.concat([i + s.offset for s, i in zip(shards, live)], 0)
    home = home_of(keys) if n > 1 else tf.zeros_like(rows)
    dst = plan_rows(rows, home, count if table.eviction == "lfu" else last,
                    [s.rows for s in shards])
    kept = dst >= 0
    moved = kept & tf.not_equal(dst, rows)
    src_m, dst_m = tf.boolean_mask(rows, moved), tf.boolean_mask(dst, moved)
    after = tf.scatter_nd(tf.boolean_mask(dst, kept)[:, None],
                          tf.ones_like(tf.boolean_mask(dst, kept), tf.bool), [table.capacity])
    before = tf.scatter_nd(rows[:, None], tf.ones_like(rows, tf.bool), [table.capacity])
    freed = tf.where(before & ~after)[:, 0]
    parts = [s.var for s in shards]
    values = _gather(shards, parts, src_m)  # every read before any write
    with tf.control_dependencies([values]):
        ops = _scatter(shards, parts, dst_m, values)
        ops += _scatter(shards, parts, freed, table.initializer)
    dropped_home = tf.boolean_mask(home, ~kept)
    for t, s in enumerate(shards):
        here = kept & (dst >= s.offset) & (dst < s.offset + s.rows)
        local = tf.boolean_mask(dst, here) - s.offset
        size = [s.rows]

        def placed(values, empty, local=local, here=here, size=size):
            return tf.tensor_scatter_nd_update(tf.fill(size, empty), local[:, None],
                                               tf.boolean_mask(values, here))

        new_count = placed(count, tf.constant(0, tf.int64))
        free_after = tf.where(new_count == 0)[:, 0]
        k = tf.size(free_after, out_type=tf.int64)
        empty_key = tf.constant("" if keys.dtype == tf.string else 0, keys.dtype)
        old_ids = s.index.export()[0]
        with tf.control_dependencies([s.index.remove(old_ids)]):
            index = s.index.insert(tf.boolean_mask(keys, here), local + s.offset)
        ops += [s.key.assign(placed(keys, empty_key)), s.count.assign(new_count),
                s.last.assign(placed(last, tf.constant(0, tf.int64))),
                s.filter.assign(tf.zeros_like(s.filter)),
                s.waiting.assign(tf.zeros_like(s.waiting)),
                # The stack: lowest free row on top, as a new shard's.
                s.free.assign(tf.concat([tf.reverse(free_after, [0]),
                                         tf.zeros([s.rows - k], tf.int64)], 0)),
                s.free_rows.assign(k), s.live.assign(tf.size(local, out_type=tf.int64)),
                s.evicted.assign_add(tf.reduce_sum(tf.cast(tf.equal(dropped_home, t),
                                                           tf.int64))),
                index]
    from_shards = shards[0].marks.pending.read_value()
    with tf.control_dependencies(ops):
        marks = [table.reshard.plan.assign(tf.stack([tf.io.serialize_tensor(t)
                                                     for t in (src_m, dst_m, freed)])),
                 table.reshard.counts.assign(tf.stack([
                     from_shards, tf.size(src_m, out_type=tf.int64),
                     tf.reduce_sum(tf.cast(~kept, tf.int64))]))]
    with tf.control_dependencies(marks):  # the marks go last: readers see it done
        pending_slots = tf.size(src_m) + tf.size(freed) > 0
        return tf.group([s.marks.slots_pending.assign(pending_slots) for s in shards] +
                        [s.marks.pending.assign(tf.constant(0, tf.int64)) for s in shards])


def move_slots(table, slot_sets) -> tf.Operation:
    """Moves the optimizer's slots as :func:`rehome` moved the rows: a moved
    row's slots to its new row, a freed row's to their initial value; then
    clears the shards' marks. Run once, in shard 0's critical section.

    Args:
      slot_sets: ``[([slot of shard 0, slot of shard 1, ...], initial value)]``.
    """
    shards = table.shards
    plan = table.reshard.plan.read_value()
    src, dst, freed = [tf.ensure_shape(tf.io.parse_tensor(plan[i], tf.int64), [None])
                       for i in range(3)]
    ops = []
    for parts, initial in slot_sets:
        values = _gather(shards, parts, src)
        with tf.control_dependencies([values]):
            ops += _scatter(shards, parts, dst, values)
            ops += _scatter(shards, parts, freed,
                            lambda shape, v=initial: tf.fill(shape, float(v)))
    with tf.control_dependencies(ops):
        return tf.group([s.marks.slots_pending.assign(tf.constant(False)) for s in shards])


def plan_variables(var, name):
    """What :func:`rehome` moved, for :func:`move_slots`, and its counts:
    variables on ``var``'s ps (a namespace). The moved rows (int64 global
    rows: from, to, freed) are kept serialized in a string [3]: a variable of
    unknown shape crashes a worker that captures it (TF 2.21: the remote
    handle's shape check)."""
    with placement.beside(var):
        empty = tf.io.serialize_tensor(tf.zeros([0], tf.int64))
        return types.SimpleNamespace(
            plan=tf.Variable(tf.fill([3], empty), trainable=False, name=f"{name}_moved"),
            counts=tf.Variable(tf.zeros([3], tf.int64), trainable=False,
                               name=f"{name}_reshard_counts"))


def prepare_export(table) -> None:
    """Eagerly: a pending :func:`rehome` done, and each shard's index
    rebuilt from its keys if it came back smaller than its live rows (a
    tf_keras .h5 file), so that a SavedModel's served function reads the
    index only (no lock, none of the shards' other variables)."""
    with tf.init_scope():
        table.prepare()
        for shard in table.shards:
            with tf.device(shard.device):
                shard.lock.execute(shard.index_complete, exclusive_resource_access=False)


def _once(table, marks, work):
    """``work()`` in shard 0's critical section if one of ``marks()`` (one
    bool per shard) is set, checked again there: one caller does it."""
    return table.shards[0].lock.execute(
        lambda: tf.cond(tf.reduce_any(marks()), work, tf.no_op),
        exclusive_resource_access=False)


def prepare(table, home_of) -> None:
    """Eagerly (also while a function is traced: ``tf.init_scope``): runs
    :func:`rehome` if a restore marked the shards. Called by every lookup
    and eviction pass as it is traced, so a traced step holds no check but
    the one assert in each shard's lookup (:func:`check`); reads one scalar
    per shard (from the chief) each time."""
    with tf.init_scope():
        if any(int(s.marks.pending.numpy()) for s in table.shards):
            _once(table, lambda: [s.marks.pending.read_value() > 0 for s in table.shards],
                  lambda: rehome(table, home_of))


def check(shard) -> tf.Operation:
    """In a shard's lookup (its ps, its critical section): fails if a restore
    onto other shards came after this step was traced (nothing re-homed)."""
    pending = shard.marks.pending

    def fail():
        # The variable is read in here so that the cond takes it as an input:
        # a stateful op without one is ordered after every other such op of
        # the step (TensorFlow's automatic control dependencies), which put
        # the other shards' critical sections (on other ps tasks) before it.
        return tf.debugging.Assert(tf.equal(pending.read_value(), 0), [
            "DynamicEmbedding: restored from a checkpoint written on another number of "
            "table shards after this step function was traced: call "
            "layer.dynamic_table.prepare() after the restore (or restore before the "
            "first step)."])

    return tf.cond(tf.equal(pending.read_value(), 0), tf.no_op, fail)


def prepare_slots(table, slot_sets) -> None:
    """Eagerly (while the update is traced, when the optimizer's slots
    exist): :func:`move_slots` if :func:`rehome` left slots to move."""
    with tf.init_scope():
        if any(bool(s.marks.slots_pending.numpy()) for s in table.shards):
            _once(table, lambda: [s.marks.slots_pending.read_value() for s in table.shards],
                  lambda: move_slots(table, slot_sets))
