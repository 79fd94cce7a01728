"""A DynamicTable in delta backups and serving streams: what changed since a
reader's last read, tracked beside each shard on its ps.

Idea: DeepRec's incremental checkpoint (Alibaba, 2022) for its
EmbeddingVariable; Monolith (ByteDance, 2022) for (id, row) syncs with
expired ids removed; the deletions a replay must keep (NVIDIA
recsys-examples issue 454).

Beside each shard, once a reader asks (:func:`attach`, before the step is
traced), all on the shard's ps and set by ops that run there anyway (no
byte more per step on the wire):

* ``rows``: the shard's int8 row mark (the one
  ``callbacks.delta_chain.DirtyRows`` keeps for the shard variable, one bit
  per reader), set by the update (its gradient filter) and, here, by each
  training lookup at the rows it found or admitted (their count, last step
  or key changed) and by an eviction pass at the rows it freed;
* ``filter``: an int8 mark per counting-filter slot, set where a lookup
  counted an id without a row;
* ``tombs``: a ``MutableHashTable`` key -> int64 reader bits, the ids an
  eviction pass removed, kept until each reader has read them;
* ``readers``: int64, the bits of the readers attached (a tombstone takes
  theirs only: with one marked for all 8 bits, a table read by fewer
  readers never dropped it, and the tombstones grew with every id
  evicted);
* ``ran``: int64 ``[8]``, per reader bit the eviction passes run since the
  reader's last read. Not the change in ``passes``: a pass sets that to
  its period, and a period whose pass no worker ran (another worker ran a
  later period's first) is skipped, so the change counts passes the ps
  never ran.

What a reader takes (:func:`read`), per table: the marked rows (global row,
id, count, last step, values, optimizer slot rows), the marked filter slots
with their counts, the slots of ids refused a row since the last pass,
each shard's counters and the tombstones. Counts and filter slots not
marked changed only by LFU aging (``max(c // 2, 1)``, ``c // 2`` per pass),
so a restore ages them by the passes run since (:func:`apply`) and the marked
ones overwrite them: the chain restores every row, slot, id and count
exactly.

Onto another number of shards (ps tasks): the base restored there keeps
each live row at its global row until the first lookup re-homes the table
(reshard.py); the chain is applied to that state laid out as the shards
that wrote it (:func:`relayout`), and the result restored as a checkpoint
written over them would be, so the re-homing that follows gives what the
full checkpoint at the chain's end gives on the new shards.
"""

import types
from typing import Dict, List

import numpy as np
import tensorflow as tf

from tf_asyncps.compat import hooks as hooks_compat
from tf_asyncps.core import placement
from tf_asyncps.dynamic import checkpoint as checkpoint_lib

__all__ = ["attach", "mark_lookup", "mark_eviction", "read", "clear", "apply", "state_of",
           "relayout", "restore", "encode_keys", "decode_keys"]

_ALL = -1  # int8, every reader's bit
_BITS = 8  # reader bits (int8 marks)
_COUNTERS = checkpoint_lib.COUNTERS


def attach(table, row_marks, mask: int = 0xFF) -> None:
    """Gives each shard of ``table`` its delta marks (see the module
    docstring), once, and adds the reader's bit ``mask`` (``1 << bit``) to
    the shards' readers; ``row_marks(shard variable)`` is the shard's int8
    row mark. Call before the lookups and updates are traced."""
    for s in table.shards:
        m = getattr(s, "delta_marks", None)
        if m is None:
            with tf.init_scope(), tf.device(s.device):
                filt = tf.Variable(tf.zeros([s.filter_slots], tf.int8), trainable=False,
                                   name=f"{s.name}_filter_dirty")
                # Its own name: a re-run chief must not get the last one's.
                tombs = placement.mutable_hash_table(s.index.key_dtype, tf.int64, 0,
                                                     name=f"{s.name}_tombstones")
                readers = tf.Variable(tf.constant(0, tf.int64), trainable=False,
                                      name=f"{s.name}_delta_readers")
                ran = tf.Variable(tf.zeros([_BITS], tf.int64), trainable=False,
                                  name=f"{s.name}_delta_passes")
            m = types.SimpleNamespace(rows=row_marks(s.var), filter=filt, tombs=tombs,
                                      readers=readers, ran=ran)
            # Not model state: no checkpoint, no Keras weight.
            hooks_compat.set_untracked_attribute(s, "delta_marks", m)
        with tf.init_scope(), tf.device(s.device):
            m.readers.assign(tf.bitwise.bitwise_or(m.readers, tf.constant(mask, tf.int64)))


def _marks(shard):
    return getattr(shard, "delta_marks", None)


def mark_lookup(shard, local_rows, filter_slots) -> List[tf.Operation]:
    """In a training lookup (the shard's ps, its critical section): the ops
    marking ``local_rows`` (found or admitted) and ``filter_slots``
    (counted); none if no reader attached."""
    m = _marks(shard)
    if m is None:
        return []
    ones = lambda idx: tf.fill(tf.shape(idx), tf.constant(_ALL, tf.int8))  # noqa: E731
    return [m.rows.scatter_update(tf.IndexedSlices(ones(local_rows), local_rows)),
            m.filter.scatter_update(tf.IndexedSlices(ones(filter_slots), filter_slots))]


def mark_eviction(shard, gone) -> List[tf.Operation]:
    """In an eviction pass: the ops marking the freed local rows ``gone``,
    recording their ids as tombstones (before the keys change) and
    counting the pass for each reader attached."""
    m = _marks(shard)
    if m is None:
        return []
    keys = tf.gather(shard.key, gone)
    readers = m.readers.read_value()
    ran = tf.bitwise.bitwise_and(
        tf.bitwise.right_shift(readers, tf.range(_BITS, dtype=tf.int64)), 1)
    return [m.rows.scatter_update(tf.IndexedSlices(
                tf.fill(tf.shape(gone), tf.constant(_ALL, tf.int8)), gone)),
            m.tombs.insert(keys, tf.fill(tf.shape(keys), readers)),
            m.ran.assign_add(ran)]


def encode_keys(keys: np.ndarray) -> Dict[str, np.ndarray]:
    """Ids for an ``.npz``: int64 as they are (``{"k": ...}``), strings as
    their bytes and lengths (np.load reads no object arrays)."""
    if keys.dtype != object:
        return {"k": keys.astype(np.int64)}
    keys = [k if isinstance(k, bytes) else str(k).encode() for k in keys.tolist()]
    return {"k_bytes": np.frombuffer(b"".join(keys), np.uint8).copy(),
            "k_lengths": np.array([len(k) for k in keys], np.int64)}


def decode_keys(arrays, prefix: str) -> np.ndarray:
    """:func:`encode_keys`' ids back (``prefix`` before ``k``)."""
    if prefix + "k" in arrays:
        return np.asarray(arrays[prefix + "k"], np.int64)
    flat, lengths = arrays[prefix + "k_bytes"].tobytes(), arrays[prefix + "k_lengths"]
    return np.array([flat[e - n:e] for e, n in zip(np.cumsum(lengths), lengths)], object)


def _keyed(prefix, keys):
    return {prefix + k: v for k, v in encode_keys(keys).items()}


def read(table, mask: int, slot_sets, slots: bool = True) -> Dict[str, np.ndarray]:
    """The table's changes since the reader of bit ``mask`` last cleared
    (eager, on the chief; only marked rows leave the ps).

    Args:
      table: a DynamicTable with :func:`attach`'s marks.
      mask: int, the reader's bit (1 << bit).
      slot_sets: ``checkpoint.slot_sets(table, optimizer)``.
      slots: whether to read the optimizer slot rows (a backup) or not (serving).

    Returns:
      ``{"ids": int64 [k] global rows, "key:*" their ids, "count", "last"
      (int64 [k]), "values" [k, dim], "slot:<j>" [k, dim] per slot set,
      "filter_at", "filter" (int64, marked filter slots by position in the
      shards' filters one after another, and their counts), "waiting_at",
      "shards" (int64 [num_shards, len(COUNTERS)]), "passes_run" (int64
      [num_shards], eviction passes run since the reader's last clear),
      "tomb:*" the evicted ids}``.
    """
    bit = tf.constant(np.uint8(mask).view(np.int8))
    out = {n: [] for n in ("ids", "count", "last", "values", "filter_at", "filter",
                           "waiting_at")}
    keys, tombs = [], []
    slot_rows = [[] for _ in slot_sets] if slots else []
    at = 0
    for i, s in enumerate(table.shards):
        m = s.delta_marks
        with tf.device(s.device):
            local = tf.where(tf.bitwise.bitwise_and(m.rows, bit) != 0)[:, 0]
            out["ids"].append((local + s.offset).numpy())
            keys.append(tf.gather(s.key, local).numpy())
            out["count"].append(tf.gather(s.count, local).numpy())
            out["last"].append(tf.gather(s.last, local).numpy())
            out["values"].append(tf.gather(s.var, local).numpy())
            for j, (parts, _) in enumerate(slot_sets if slots else []):
                slot_rows[j].append(tf.gather(parts[i], local).numpy())
            spots = tf.where(tf.bitwise.bitwise_and(m.filter, bit) != 0)[:, 0]
            out["filter_at"].append((spots + at).numpy())
            out["filter"].append(tf.gather(s.filter, spots).numpy())
            out["waiting_at"].append((tf.where(s.waiting)[:, 0] + at).numpy())
            tk, tv = m.tombs.export()
            tombs.append(tf.boolean_mask(tk, tf.bitwise.bitwise_and(tv, mask) != 0).numpy())
        at += int(s.filter.shape[0])
    res = {n: np.concatenate(v) for n, v in out.items()}
    for j, rows in enumerate(slot_rows):
        res[f"slot:{j}"] = np.concatenate(rows)
    res["shards"] = np.array([[s.rows] + [int(getattr(s, c).numpy()) for c in _COUNTERS[1:]]
                              for s in table.shards], np.int64)
    b = _bit(mask)
    res["passes_run"] = np.array([int(s.delta_marks.ran[b].numpy()) for s in table.shards],
                                 np.int64)
    res.update(_keyed("key:", np.concatenate(keys)))
    res.update(_keyed("tomb:", np.concatenate(tombs)))
    return res


def _bit(mask: int) -> int:
    """The reader's bit number of ``mask`` (``1 << bit``)."""
    mask = int(mask)
    if mask <= 0 or mask & (mask - 1) or mask >= 1 << _BITS:
        raise ValueError(f"dynamic deltas: mask={mask} is not one reader's bit (1 << bit, "
                         f"bit in [0, {_BITS})): pass the reader's DirtyReader.mask.")
    return mask.bit_length() - 1


def clear(table, mask: int) -> None:
    """Clears the reader's bit in each shard's filter marks and tombstones
    and its count of passes run (the row marks are cleared by its
    ``DirtyReader``); a tombstone every reader has read goes. Eager, at a
    quiet point."""
    keep8 = tf.constant(~np.uint8(mask).view(np.int8))
    bit = _bit(mask)
    for s in table.shards:
        m = s.delta_marks
        with tf.device(s.device):
            m.filter.assign(tf.bitwise.bitwise_and(m.filter, keep8))
            m.ran.scatter_update(tf.IndexedSlices(tf.zeros([1], tf.int64), [bit]))
            k, v = m.tombs.export()
            left = tf.bitwise.bitwise_and(v, tf.constant(~mask & 0xFF, tf.int64))
            m.tombs.remove(tf.boolean_mask(k, left == 0))
            m.tombs.insert(tf.boolean_mask(k, left != 0), tf.boolean_mask(left, left != 0))


def state_of(table) -> Dict[str, np.ndarray]:
    """The table's checkpoint entry (``checkpoint.save_state``) as numpy arrays."""
    return {n: t.numpy() for n, t in checkpoint_lib.save_state(table).items()}


def _age(values: np.ndarray, passes: np.ndarray, floor_one: bool) -> np.ndarray:
    """LFU aging ``passes`` times (per element): ``c // 2`` each pass, at
    least 1 for a live row's count (``max(c // 2, 1)``)."""
    aged = np.right_shift(values, np.minimum(passes, 63))
    return np.where(values > 0, np.maximum(aged, 1), 0) if floor_one else aged


def _sizes(shards) -> list:
    return np.asarray(shards)[:, 0].tolist()


def relayout(table, state: Dict[str, np.ndarray], sizes, where: str) -> Dict[str, np.ndarray]:
    """``state`` (:func:`state_of` of a table whose base checkpoint, written
    over shards of ``sizes`` rows, was restored onto other shards and not
    re-homed yet) laid out as those shards: the live rows as they are (by
    global row), each shard's ``passes`` the restore's (the saved shards'
    largest: every eviction call covers every shard, so at a quiet point
    they are equal), the other counters zero (each delta replaces them),
    no filter slots (a restore onto other shards starts the filters empty).

    Raises:
      ValueError: another capacity, or no restore onto other shards pending
        on the table (a lookup re-homed it already, or its base was written
        over other shards than the chain): ``where`` names the delta file.
    """
    sizes = [int(n) for n in sizes]
    here = [s.rows for s in table.shards]
    pending = {int(s.marks.pending.numpy()) for s in table.shards}
    if sum(sizes) != table.capacity or pending != {len(sizes)}:
        why = (f"its capacity is {table.capacity}" if sum(sizes) != table.capacity else
               "no restore from them is pending here (a lookup re-homed the table after the "
               "base was restored, or the base was written over other shards than the chain)")
        raise ValueError(
            f"delta chain: {where} holds table {table.name!r} over shards of {sizes} rows, "
            f"this table has {here} and {why}: restore the chain's own base (the full "
            "backup it names) and apply the chain before the first lookup.")
    p = _COUNTERS.index("passes")
    shards = np.zeros([len(sizes), len(_COUNTERS)], np.int64)
    shards[:, 0] = sizes
    shards[:, p] = int(np.max(state["shards"][:, p])) if len(state["shards"]) else 0
    empty = np.zeros([0], np.int64)
    return dict(state, filter_at=empty, filter=empty, waiting_at=empty, shards=shards)


def apply(table, state: Dict[str, np.ndarray], delta, where: str) -> Dict[str, np.ndarray]:
    """``state`` (:func:`state_of`'s arrays, the table as restored so far)
    with one delta (:func:`read`'s arrays) applied, in numpy.

    Order, as on the ps: LFU aging of the unmarked live rows' counts and
    the unmarked filter slots by the passes run since (the delta's
    ``passes_run``; in a delta written without it, the change in
    ``passes``: one too many per period whose pass was skipped), the tombstoned ids'
    rows freed, then the marked rows and filter slots written over, the
    refused ids' slots and the counters replaced. A delta written over
    other shards than this table's is applied to the base laid out as
    those (:func:`relayout`, on the first delta); its filter slots are
    dropped (the restore onto other shards empties the filters).

    Raises:
      ValueError: see :func:`relayout`; or the chain's deltas were written
        over different shards (``where`` names the file).
    """
    shards = np.asarray(delta["shards"])
    here = [s.rows for s in table.shards]
    if shards.shape[1:] != state["shards"].shape[1:] or \
            _sizes(shards) != _sizes(state["shards"]):
        if _sizes(state["shards"]) != here:
            raise ValueError(
                f"delta chain: {where} holds table {table.name!r} over shards of "
                f"{_sizes(shards)} rows, the deltas before it over {_sizes(state['shards'])}: "
                "one chain is written over one set of shards; restore its base and the "
                "deltas of that base only.")
        state = relayout(table, state, _sizes(shards), where)
    # Filter slots are by position in the shards' filters: kept on the
    # shards that wrote them only.
    flen = (np.array([int(s.filter.shape[0]) for s in table.shards], np.int64)
            if _sizes(shards) == here else None)
    if "passes_run" in delta:
        passes = np.asarray(delta["passes_run"], np.int64)
    else:  # written before passes_run
        p = _COUNTERS.index("passes")
        passes = np.maximum(shards[:, p] - state["shards"][:, p], 0)
    rows = np.asarray(state["rows"])
    offsets = np.cumsum(np.concatenate([[0], shards[:, 0]]))[:-1]
    shard_of = np.searchsorted(offsets, rows, side="right") - 1
    count, last = state["count"].copy(), state["last"].copy()
    if table.eviction == "lfu":
        count = _age(count, passes[shard_of], True)
    if flen is not None:
        filt = np.zeros(int(flen.sum()), np.int64)
        filt[state["filter_at"]] = state["filter"]
        if table.eviction == "lfu":
            filt = _age(filt, np.repeat(passes, flen), False)
        filt[delta["filter_at"]] = delta["filter"]
    else:
        filt = np.zeros([0], np.int64)
    keys = np.asarray(state["key"], object if state["key"].dtype == object else np.int64)
    tombs = decode_keys(delta, "tomb:")
    keep = ~np.isin(keys, tombs) & ~np.isin(rows, delta["ids"])
    slots = np.asarray(state["slots"])
    k = sum(1 for name in delta if name.startswith("slot:"))
    new_slots = [delta[f"slot:{j}"] for j in range(k)]
    live = delta["count"] > 0
    out = dict(state)
    order = np.argsort(np.concatenate([rows[keep], delta["ids"][live]]), kind="stable")

    def merged(old, new):
        return np.concatenate([old[keep], new[live]])[order]

    out["rows"] = merged(rows, delta["ids"])
    out["key"] = merged(keys, decode_keys(delta, "key:"))
    out["count"] = merged(count, delta["count"])
    out["last"] = merged(last, delta["last"])
    out["values"] = merged(state["values"], delta["values"].astype(np.float32))
    if slots.shape[0] and k:
        out["slots"] = np.stack([np.concatenate([slots[j][keep], new_slots[j][live]])[order]
                                 for j in range(k)]).astype(np.float32)
    else:
        out["slots"] = np.zeros([0, len(out["rows"]), table.output_dim], np.float32)
    nonzero = np.flatnonzero(filt)
    out["filter_at"], out["filter"] = nonzero.astype(np.int64), filt[nonzero]
    out["waiting_at"] = np.asarray(delta["waiting_at"] if flen is not None else [], np.int64)
    out["shards"] = shards
    return out


def restore(table, state: Dict[str, np.ndarray]) -> None:
    """Puts ``state`` (:func:`apply`'s result) into the table (eager): its
    rows, slots, metadata, filters and counters, and each shard's id -> row
    map rebuilt from the live rows; a state laid out over other shards
    (:func:`relayout`) as a checkpoint written over them, re-homed at the
    first lookup (reshard.py)."""
    dtype = tf.string if state["key"].dtype == object else tf.int64
    tensors = {n: tf.constant(v, dtype if n == "key" else None) for n, v in state.items()}
    checkpoint_lib.restore_state(table, tensors)
    for s in table.shards:
        here = (state["rows"] >= s.offset) & (state["rows"] < s.offset + s.rows)
        with tf.device(s.device):
            s.index.remove(s.index.export()[0])
            s.index.insert(tf.constant(state["key"][here], dtype),
                           tf.constant(state["rows"][here], tf.int64))
