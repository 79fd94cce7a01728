"""A DynamicTable's checkpoint: its live rows only.

A ``tf.train.Checkpoint`` (``BackupAndRestore``, ``ModelCheckpoint`` with
a TensorFlow checkpoint path) holds of a dynamic table one entry of the
table's own (``DynamicTable.state``), indexed by global row:

* ``rows``: int64 ``[n]``, the global rows holding an id, and their
  ``key``, ``count`` and ``last`` step (``[n]`` each);
* ``values``: float32 ``[n, output_dim]``, those rows of the table;
* ``slots``: float32 ``[k, n, output_dim]``, those rows of the optimizer's
  ``k`` slots of the table (:func:`slot_sets` order; ``k = 0`` while the
  table has not met its optimizer, whose slots are then saved whole, as
  any variable's);
* ``filter_at`` / ``filter``: int64, the counting filters' nonzero slots
  (position in the shards' filters one after the other) and their counts;
  ``waiting_at``: int64, the slots of ids refused a row since the last pass;
* ``shards``: int64 ``[num_shards, len(COUNTERS)]``, each shard's counters.

The table variable and those slots write nothing of their own
(:func:`tf_asyncps.compat.checkpoint.save_elsewhere`), so the
checkpoint grows with the live rows, not with the capacity (measured: see
docs/guides/dynamic_embeddings.md, "State"). The id -> row map (each
shard's ``MutableHashTable``) is saved by itself, live ids only, as before.

A restore gives every row of the table fresh initializer values (every
slot row its initial value) and then the saved rows at their global rows;
each shard's free stack is rebuilt from the counts, its lowest free row on
top. Onto another number of shards the rows keep their global row here,
and reshard.py re-homes them at the first lookup, as before.

The table meets its optimizer (:func:`track_optimizer`) when an update is
traced under AsyncParameterServerStrategy (the engine's before- and
after-update hooks), and in one process through
``DynamicEmbedding.use_optimizer`` (the ``DynamicEviction`` callback calls
it). A restore before that keeps the slot rows beside shard 0 until then:
the optimizer is built if it has no slots yet, and the rows go in before
its first update.
"""

import types

import numpy as np
import tensorflow as tf

from tf_asyncps.compat import checkpoint as checkpoint_compat
from tf_asyncps.compat import sharded_slots
from tf_asyncps.compat import tf_keras as tf_keras_compat
from tf_asyncps.core import placement
from tf_asyncps.dynamic import slots as slots_lib

__all__ = ["save_state", "restore_state", "check_entry", "file_entries", "load_file_entries",
           "track_optimizer", "slot_sets", "COUNTERS", "process_state"]

#: Per-shard counters saved (one row per shard), in this order.
COUNTERS = ("rows", "free_rows", "live", "refused", "passes", "evicted")


def process_state(var, name):
    """What a table keeps in this process about its checkpoint (not model
    state): the optimizer it met, whether its slots are marked, and slot rows
    a restore brought before it met one: ``stash``, (global rows, slot rows)
    serialized in a string [2] variable beside ``var`` (a restore may run in a
    function, and a variable of unknown shape crashes a worker that captures
    it), ``waiting`` whether it holds rows, ``restored`` a hint set at each
    restore (so that only then the chief reads ``waiting``)."""
    with placement.beside(var):
        empty = tf.io.serialize_tensor(tf.zeros([0], tf.int64))
        stash = tf.Variable(tf.fill([2], empty), trainable=False, name=f"{name}_slot_rows")
        waiting = tf.Variable(False, trainable=False, name=f"{name}_slot_rows_waiting")
    return types.SimpleNamespace(optimizer=None, marked=False, restored=False, stash=stash,
                                 waiting=waiting)


def slot_sets(table, optimizer=None) -> list:
    """``[([slot of shard 0, slot of shard 1, ...], initial value)]``: the
    optimizer's slots of the table (``optimizer``, else the one it met);
    ``[]`` if it has none (yet)."""
    optimizer = optimizer if optimizer is not None else table.saving.optimizer
    if optimizer is None:
        return []
    per_shard = [slots_lib.optimizer_slots(optimizer, s.var) for s in table.shards]
    return [([slots[j][0] for slots in per_shard], per_shard[0][j][1])
            for j in range(min(len(slots) for slots in per_shard))]


def _mark(optimizer, sets) -> None:
    """Makes the slots in ``sets`` write nothing of their own (the table's
    entry holds their live rows): each shard's slot, the ShardedVariable
    holding them (tf_keras), and the Keras 3 variable whose value they are."""
    parts = [p for group, _ in sets for p in group]
    for obj in slots_lib.tracked_slots(optimizer, parts):
        checkpoint_compat.save_elsewhere(obj)


def track_optimizer(table, optimizer, variables=None) -> None:
    """Eagerly: records ``optimizer`` as the table's, marks its slots of the
    table (see :func:`_mark`) and puts in slot rows a restore kept waiting.

    Args:
      table: a DynamicTable.
      optimizer: tf_keras (new or legacy) or Keras 3 optimizer.
      variables: the model variables it updates: with slot rows waiting and
        no slots yet, the optimizer is built for them here (tf_keras; Keras 3
        given its own variables, as ``model.trainable_variables`` gives).

    Raises:
      ValueError: slot rows wait and the optimizer has no slots of the table
        yet and cannot be built here.
      tf.errors.InvalidArgumentError: it has another number of slots of the
        table than the checkpoint.
    """
    state = table.saving
    if state.optimizer is optimizer and state.marked and not state.restored:
        return
    with tf.init_scope():
        state.optimizer = optimizer
        sharded_slots.legacy_sharded_slots_saved_elsewhere()
        sets = slot_sets(table)
        waiting = state.restored and bool(state.waiting.numpy())
        if not sets and waiting and variables is not None:
            if _build(optimizer, list(variables)):
                sets = slot_sets(table)
        if sets:
            _mark(optimizer, sets)
            state.marked = True
        if not waiting:
            state.restored = False
            return
        if not sets and tf_keras_compat.not_built(optimizer):
            raise ValueError(
                f"DynamicEmbedding {table.name!r}: a checkpoint holds optimizer slots of "
                "its rows and the optimizer has no slots yet: build it before its first "
                "step (optimizer.build(model.trainable_variables)).")
        if sets:  # (an optimizer without slots, SGD, takes none: as TF's restore)
            _put_slots(table, sets, tf.io.parse_tensor(state.stash[0], tf.int64),
                       tf.io.parse_tensor(state.stash[1], tf.float32))
        state.waiting.assign(False)
        state.stash.assign(tf.fill([2], tf.io.serialize_tensor(tf.zeros([0], tf.int64))))
        state.restored = False


def _build(optimizer, variables) -> bool:
    """Makes the optimizer's slots for ``variables`` now, as its first update
    would: tf_keras (compat), or Keras 3's own ``build`` given Keras 3
    variables. Returns whether it built."""
    if tf_keras_compat.build_now(optimizer, variables):
        return True
    if tf_keras_compat.not_built(optimizer) and variables and \
            not any(isinstance(v, tf.Variable) for v in variables):
        optimizer.build(variables)
        return True
    return False


#: The names of a table's checkpoint entry (the module docstring).
ENTRY = ("rows", "key", "count", "last", "values", "slots", "filter_at", "filter", "waiting_at",
         "shards")


def check_entry(table, names) -> None:
    """Refuses a checkpoint whose entry for ``table`` does not hold
    :data:`ENTRY`'s names (``names``: those it holds), before TF reads it.

    Raises:
      ValueError: naming the table, the names found and the fix; for the
        whole-table entries that tf_asyncps wrote before commit a33e78b
        (2026-12-03: ``count``, ``free``, ``key`` ... of every row).
    """
    missing = sorted(set(ENTRY) - set(names))
    if not missing:
        return
    old = "free" in names and "rows" not in names
    raise ValueError(
        f"DynamicEmbedding {table.name!r}: the checkpoint's entry for this table holds "
        f"{list(names)}, without {missing}. "
        + ("It is the whole-table format that tf_asyncps wrote before 2026-12-03 (commit "
           "a33e78b); this version reads checkpoints of live rows only and cannot convert "
           "it: restore it with the tf_asyncps that wrote it (a commit before a33e78b), or "
           "train from the start with this one." if old else
           "Restore a checkpoint written by this version's DynamicEmbedding at this path "
           "(a checkpoint's objects are matched by their attribute path)."))


def save_state(table) -> dict:
    """The table's entry in a checkpoint (the module docstring); ``{}`` in a
    SavedModel export (its graph cannot read these variables, which are not
    its objects: the served function reads the index only, and a model
    loaded from it rebuilds the metadata from the index)."""
    if checkpoint_compat.in_saved_model_export():
        return {}
    sets = slot_sets(table)
    if sets and not table.saving.marked:
        _mark(table.saving.optimizer, sets)
        table.saving.marked = True
    out = {name: [] for name in ENTRY[:-1]}
    at = 0  # the filters' own offsets (a filter need not be as long as its shard)
    for i, s in enumerate(table.shards):
        with tf.device(s.device):  # only the live rows leave the ps
            live = tf.where(s.count > 0)[:, 0]
            out["rows"].append(live + s.offset)
            for name in ("key", "count", "last"):
                out[name].append(tf.gather(getattr(s, name), live))
            out["values"].append(tf.cast(tf.gather(s.var, live), tf.float32))
            out["slots"].append(
                tf.stack([tf.cast(tf.gather(parts[i], live), tf.float32) for parts, _ in sets])
                if sets else tf.zeros([0, tf.size(live), table.output_dim]))
            counts = s.filter.read_value()
            nonzero = tf.where(counts != 0)[:, 0]
            out["filter_at"].append(nonzero + at)
            out["filter"].append(tf.gather(counts, nonzero))
            out["waiting_at"].append(tf.where(s.waiting)[:, 0] + at)
        at += int(s.filter.shape[0])
    out = {name: tf.concat(parts, 1 if name == "slots" else 0) for name, parts in out.items()}
    out["shards"] = tf.stack([tf.stack([tf.constant(s.rows, tf.int64)] +
                                       [getattr(s, c).read_value() for c in COUNTERS[1:]])
                              for s in table.shards])
    return out


def file_entries(table) -> dict:
    """:func:`save_state`'s entry as numpy arrays, for Keras's own files
    (``.keras``, ``.weights.h5``: the layer's ``save_own_variables``), with
    no slot rows (``slots`` ``[0, n, output_dim]``): there the optimizer
    writes its slots itself, whole, by position. String keys go as their
    bytes (``key_bytes``, uint8) and lengths (``key_lengths``, int64): HDF5
    has no variable-length string a Keras store takes."""
    out = {name: t.numpy() for name, t in save_state(table).items()}
    out["slots"] = np.zeros([0, len(out["rows"]), table.output_dim], np.float32)
    if table.key_dtype == tf.string:
        keys = out.pop("key").tolist()
        out["key_bytes"] = np.frombuffer(b"".join(keys), np.uint8).copy()
        out["key_lengths"] = np.array([len(k) for k in keys], np.int64)
    return out


def load_file_entries(table, store) -> None:
    """Puts :func:`file_entries` from ``store`` (a Keras store: name ->
    array) into the table, eagerly: the map is emptied first and rebuilt
    from the rows' keys at the first lookup (``_Shard.index_complete``).

    Raises:
      ValueError: ``store`` lacks an entry (another layer's), or its table
        has another capacity: naming what it holds and the fix.
    """
    names = [n for n in ENTRY if n != "key"]
    names += ["key_bytes", "key_lengths"] if table.key_dtype == tf.string else ["key"]
    missing = [n for n in names if n not in store]
    if missing:
        found = sorted(store.keys())
        raise ValueError(
            f"DynamicEmbedding {table.name!r}: the file's entry for this layer holds "
            f"{found[:6]}{' ...' if len(found) > 6 else ''}, not a DynamicEmbedding's "
            f"{missing}: "
            + ("a layer's variables by position (an Embedding's table, say), whose rows "
               "have no ids to put them under" if all(k.isdigit() for k in found) else
               "another layer's entry") +
            ". Load the file into the model it was saved from (the same layer at this "
            "place), or train this table from the start.")
    restored = {n: np.asarray(store[n]) for n in names}
    saved = int(restored["shards"][:, 0].sum()) if restored["shards"].size else 0
    if saved != table.capacity:
        raise ValueError(
            f"DynamicEmbedding {table.name!r}: the file's table has capacity {saved}, this "
            f"layer {table.capacity}: make the layer with capacity={saved} to load it.")
    if table.key_dtype == tf.string:
        flat, lengths = restored.pop("key_bytes").tobytes(), restored.pop("key_lengths")
        restored["key"] = np.array([flat[e - n:e] for e, n in zip(np.cumsum(lengths), lengths)],
                                   object)
    for s in table.shards:
        with tf.device(s.device):
            s.index.remove(s.index.export()[0])
    restore_state(table, {n: tf.constant(v, tf.string if n == "key" and v.dtype == object
                                         else None) for n, v in restored.items()})


def _local(shard, rows):
    """(bool mask of the global ``rows`` on ``shard``, their local rows)."""
    here = (rows >= shard.offset) & (rows < shard.offset + shard.rows)
    return here, tf.boolean_mask(rows, here) - shard.offset


def _put_slots(table, sets, rows, slots) -> tf.Operation:
    """Each slot: its initial value in every row, then ``slots`` ``[k, n,
    dim]`` at the global ``rows``; nothing if ``k`` is 0 (the slots were
    saved whole, by their own entries)."""
    rows = tf.ensure_shape(rows, [None])
    slots = tf.ensure_shape(slots, [None, None, table.output_dim])
    k = tf.shape(slots)[0]

    def put():
        check = tf.debugging.assert_equal(k, len(sets), message=(
            f"DynamicEmbedding {table.name!r}: the checkpoint holds another number of "
            f"optimizer slots of the table's rows than this optimizer's {len(sets)}: "
            "restore with the optimizer class the checkpoint was written with."))
        ops = []
        with tf.control_dependencies([check]):
            for j, (parts, initial) in enumerate(sets):
                for s, p in zip(table.shards, parts):
                    here, local = _local(s, rows)
                    with tf.device(s.device):
                        fresh = p.assign(tf.fill(tf.shape(p), tf.cast(initial, p.dtype)))
                    with tf.control_dependencies([fresh]):
                        ops.append(p.scatter_update(tf.IndexedSlices(
                            tf.cast(tf.boolean_mask(slots[j], here), p.dtype), local)))
        return tf.group(ops)

    return tf.cond(k > 0, put, tf.no_op)


def restore_state(table, restored) -> tf.Operation:
    """Puts a checkpoint's entry (:func:`save_state`'s) into the table, its
    shards and, once the table has met its optimizer, its slots; marks the
    shards for reshard.rehome if it was saved on other shards.

    Raises:
      tf.errors.InvalidArgumentError: the checkpoint's table has another
        capacity.
      tf.errors.InvalidArgumentError: the optimizer has another number of
        slots of the table than the checkpoint (see :func:`_put_slots`).
    """
    if "shards" not in restored:  # a SavedModel's (save_state's {})
        return None
    shards = table.shards
    saved = restored["shards"]
    sizes = tf.constant([s.rows for s in shards], tf.int64)
    # The same shards: as many, of the same lengths.
    same = tf.cond(tf.equal(tf.shape(saved)[0], len(shards)),
                   lambda: tf.reduce_all(tf.equal(saved[:, 0], sizes)),
                   lambda: tf.constant(False))
    check = tf.debugging.assert_equal(
        tf.reduce_sum(saved[:, 0]), tf.constant(table.capacity, tf.int64),
        message=f"DynamicEmbedding {table.name!r}: the checkpoint's table has another "
                f"capacity than this one ({table.capacity}); restore it into a layer of "
                "the capacity it was saved with (x below: the saved capacity).")
    shapes = {"rows": [None], "key": [None], "count": [None], "last": [None],
              "values": [None, table.output_dim], "slots": [None, None, table.output_dim],
              "filter_at": [None], "filter": [None], "waiting_at": [None],
              "shards": [None, len(COUNTERS)]}
    # Read in a function on a cluster (shapes unknown there).
    restored = {name: tf.ensure_shape(restored[name], shape) for name, shape in shapes.items()}
    rows = restored["rows"]
    ops = []
    with tf.control_dependencies([check]):
        totals = tf.reduce_sum(saved, 0)
        passes = tf.reduce_max(saved[:, COUNTERS.index("passes")])
        at = 0
        for i, s in enumerate(shards):
            here, local = _local(s, rows)

            def placed(name, empty, here=here, local=local, size=s.rows):
                return tf.tensor_scatter_nd_update(tf.fill([size], empty), local[:, None],
                                                   tf.boolean_mask(restored[name], here))

            zero = tf.constant(0, tf.int64)
            count = placed("count", zero)
            free = tf.where(count == 0)[:, 0]
            k = tf.size(free, out_type=tf.int64)
            length = int(s.filter.shape[0])

            def filter_slots(name, values, a=at, n=length):
                spots = restored[name]
                mine = (spots >= a) & (spots < a + n)
                return tf.cond(  # on other shards their slots mean nothing
                    same, lambda: tf.scatter_nd(tf.boolean_mask(spots, mine)[:, None] - a,
                                                tf.boolean_mask(values, mine), [n]),
                    lambda: tf.zeros([n], tf.int64))

            at += length
            mine = saved[tf.minimum(i, tf.shape(saved)[0] - 1)]

            def counter(name, moved, mine=mine):
                return tf.where(same, mine[COUNTERS.index(name)], moved)

            first = tf.constant(i == 0)
            with tf.device(s.device):  # fresh rows made on the ps
                fresh = s.var.assign(tf.cast(table.initializer(tf.shape(s.var)), s.var.dtype))
            with tf.control_dependencies([fresh]):
                ops.append(s.var.scatter_update(tf.IndexedSlices(
                    tf.cast(tf.boolean_mask(restored["values"], here), s.var.dtype), local)))
            ops += [s.key.assign(placed("key", tf.constant(
                        "" if s.key.dtype == tf.string else 0, s.key.dtype))),
                    s.count.assign(count), s.last.assign(placed("last", zero)),
                    s.filter.assign(filter_slots("filter_at", restored["filter"])),
                    s.waiting.assign(filter_slots(
                        "waiting_at", tf.ones_like(restored["waiting_at"])) > 0),
                    # The stack: lowest free row on top, as a new shard's.
                    s.free.assign(tf.concat([tf.reverse(free, [0]),
                                             tf.zeros([s.rows - k], tf.int64)], 0)),
                    # Other shards: as they were until rehome rebuilds them (a
                    # lookup before it must not rebuild metadata from a stale index).
                    s.free_rows.assign(tf.where(same, k, s.free_rows.read_value())),
                    s.live.assign(tf.where(same, tf.size(local, out_type=tf.int64),
                                           s.live.read_value())),
                    # Other shards: their totals on shard 0 (stats() sums them).
                    s.refused.assign(counter("refused", tf.where(
                        first, totals[COUNTERS.index("refused")], zero))),
                    s.evicted.assign(counter("evicted", tf.where(
                        first, totals[COUNTERS.index("evicted")], zero))),
                    s.passes.assign(counter("passes", passes)),
                    s.marks.pending.assign(tf.where(same, zero,
                                                    tf.cast(tf.shape(saved)[0], tf.int64))),
                    s.marks.slots_pending.assign(tf.constant(False))]
        slots, sets, state = restored["slots"], slot_sets(table), table.saving
        if sets:
            ops.append(_put_slots(table, sets, rows, slots))
        else:  # until the table meets its optimizer (track_optimizer)
            state.restored = True
            ops += [state.stash.assign(tf.stack([tf.io.serialize_tensor(rows),
                                                 tf.io.serialize_tensor(slots)])),
                    state.waiting.assign(tf.shape(slots)[0] > 0)]
    return tf.group(ops)
