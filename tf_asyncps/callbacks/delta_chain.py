"""Incremental (delta) backups of embedding tables: per-row dirty marks on
the ps and a chain of deltas on disk.

Idea: DeepRec's incremental checkpoint (Alibaba, 2022): a full checkpoint
is a base; between two bases each save writes only the table rows written
since the previous save (with their optimizer slot rows) and the small
dense variables whole; a restore is the base plus the contiguous chain.

Dirty marks (:class:`DirtyRows`): an int8 variable of shape ``[rows]``
beside each table variable (each shard of a partitioned one), created on
that variable's device, set to 1 at the rows of every sparse gradient the
engine applies (a dense gradient marks every row). The mark is written on
the ps inside the update from indices already there: no byte more on the
wire. :meth:`DirtyRows.clear` zeroes the marks after a save.

Several readers (the backups, a serving stream; as TorchRec's
ModelDeltaTracker has consumers) share one mark per row: the update sets
all 8 bits (one scatter, whatever the number of readers) and each reader
(:class:`DirtyReader`, :func:`shared_reader`) owns one bit, reads the rows
with its bit set and clears only its bit.

On disk, one delta is a folder (``delta-<N>/``):

* ``<i>.npz`` per table ``i``: ``ids`` (int64 ``[k]``, global rows: a
  split table's shards after one another), ``values`` (``[k, dim]``, the
  variable's dtype) and ``slot:<name>`` per optimizer slot (``[k, ...]``).
* ``dense.npz``: every dense variable whole, keyed ``<i>``.
* ``meta.json`` (written last): ``format``, ``kind`` "delta", ``base_id``
  (the full backup the chain starts from), ``seq`` (1, 2, ...),
  ``prev_seq`` (``seq - 1``), ``shards`` ``[{"name", "file", "rows",
  "sha256"}]`` and ``dense`` ``{"file", "sha256"}``.

Everything is written into a temp folder, ``meta.json`` last, then the
folder is renamed, so a reader never sees a half-written delta under its
final name; :func:`read_chain` refuses any that is wrong anyway.
"""

import hashlib
import os
import shutil
import weakref
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

from tf_asyncps.files import atomic_write_json, read_json

__all__ = ["DirtyRows", "DirtyReader", "shared_reader", "ModelDeltas", "write_delta",
           "read_chain", "apply_delta", "gather_rows", "load_file", "shards_of", "ChainError",
           "DELTA_FORMAT"]

DELTA_FORMAT = 2  # 2: a table's rows by global row, dense variables whole
_META = "meta.json"
_ALL = -1  # int8 with its 8 bits set: every reader's
_READER_BITS = 8


class ChainError(ValueError):
    """A delta chain that cannot be restored; the message names the file
    and what is wrong or missing."""


def _backing(var):
    """The tf.Variable behind a Keras 3 variable (its ``value``), else ``var``."""
    return var if isinstance(var, tf.Variable) else getattr(var, "value", var)


class DirtyRows:
    """Per-row dirty marks of embedding table variables, set on the ps by
    each update (see the module docstring).

    Args:
      variables: the table variables (each shard of a partitioned table;
        a 2-D ``tf.Variable`` each), in a strategy's scope or not: each mark
        is created on its variable's device (in a strategy's scope,
        ``colocate_vars_with`` it).

    Attributes:
      marks: ``{variable name: int8 tf.Variable [rows]}``.

    Raises:
      ValueError: a variable is not 2-D with a known row count.
    """

    def __init__(self, variables: Sequence[tf.Variable]):
        self.marks: Dict[str, tf.Variable] = {}
        self._by_id: Dict[int, tf.Variable] = {}
        self.bits_taken = 0  # readers' bits (DirtyReader)
        for v in variables:
            if v.shape.rank != 2 or v.shape[0] is None:
                raise ValueError(f"DirtyRows: {v.name} has shape {v.shape}; give 2-D table "
                                 "variables (rows, dim) with a known row count.")
            # Under a strategy: on the shard's ps, never partitioned.
            place = (tf.distribute.get_strategy().extended.colocate_vars_with(v)
                     if tf.distribute.has_strategy() else tf.device(v.device))
            with tf.init_scope(), place:
                mark = tf.Variable(tf.zeros([v.shape[0]], tf.int8), trainable=False,
                                   name=v.name.split(":")[0].replace("/", "_") + "_dirty",
                                   synchronization=tf.VariableSynchronization.ON_WRITE,
                                   aggregation=tf.VariableAggregation.NONE)
            self.marks[v.name] = mark
            self._by_id[id(v)] = mark

    def _key(self, var) -> int:
        # Keras 3 updates its Variable; the mark is keyed by the tf.Variable behind it.
        return id(var) if id(var) in self._by_id else id(_backing(var))

    def owns(self, var) -> bool:
        """Whether ``var`` (or the tf.Variable behind a Keras 3 one) is tracked."""
        return self._key(var) in self._by_id

    def mark(self, grad, var):
        """Marks the rows of ``grad`` dirty on ``var``'s device and returns
        ``grad`` itself: a gradient filter
        (core/table_seam.TableHooks.filter_gradient).

        The very object comes back, not a copy behind a control dependency:
        Keras 3's row-wise update (core/rowwise.py) knows a gradient by
        identity and applies it with the per-occurrence squares the worker
        sent; a copy made it fall back to the squares of the summed rows
        (Adagrad's accumulator off). The mark runs anyway: a traced step
        runs every stateful op it holds (tf.function's automatic control
        dependencies), eagerly it runs here, and a reader reads the marks
        only at a quiet point, after the step has ended."""
        mark = self._by_id.get(self._key(var))
        if mark is None or grad is None:
            return grad
        with tf.device(mark.device):
            if isinstance(grad, tf.IndexedSlices):
                ids = tf.cast(grad.indices, tf.int64)
                mark.scatter_update(tf.IndexedSlices(
                    tf.fill(tf.shape(ids), tf.constant(_ALL, tf.int8)), ids))
            else:
                mark.assign(tf.fill(tf.shape(mark), tf.constant(_ALL, tf.int8)))
        return grad

    def hooks(self, name: str = "dirty_rows"):
        """A ``TableHooks`` to register with ``strategy.extended.register_table``."""
        from tf_asyncps.core.table_seam import TableHooks
        return TableHooks(name=name, owns=self.owns, filter_gradient=self.mark)

    def mark_of(self, var) -> tf.Variable:
        """The mark variable of ``var`` (KeyError if not tracked)."""
        return self._by_id[self._key(var)]

    def dirty_ids(self, var) -> np.ndarray:
        """Rows of ``var`` marked since the last :meth:`clear` (int64 ``[k]``, sorted)."""
        return np.flatnonzero(self.mark_of(var).numpy()).astype(np.int64)

    def clear(self) -> None:
        """Zeroes every mark, every reader's bit (after a save, at a quiet point)."""
        for mark in self.marks.values():
            mark.assign(tf.zeros_like(mark))


class DirtyReader:
    """One reader's view of shared dirty marks: the rows written since this
    reader's last :meth:`clear`, whatever the other readers cleared.

    Args:
      marks: ``[(variable, DirtyRows tracking it)]``.
      bit: int in [0, 8), this reader's bit in each mark.
      name: the reader's name, for messages.
    """

    def __init__(self, marks, bit: int, name: str):
        self.name = name
        self.bit = int(bit)
        self._mask = np.int8(np.uint8(1 << self.bit).view(np.int8))
        self._rows = {id(v): (v, rows) for v, rows in marks}

    def _get(self, var):
        return self._rows.get(id(var)) or self._rows.get(
            id(_backing(var)))

    def owns(self, var) -> bool:
        """Whether ``var`` (or the tf.Variable behind a Keras 3 one) is read."""
        return self._get(var) is not None

    def mark(self, grad, var):
        """``grad`` after its rows are marked (every reader's bit): for a
        one-process loop without the strategy's table seam; ``grad`` as it
        is for a variable not read."""
        owner = self._get(var)
        return grad if owner is None else owner[1].mark(grad, var)

    def mark_of(self, var) -> tf.Variable:
        """The shared int8 mark variable of ``var`` (KeyError if not read)."""
        owner = self._get(var)
        if owner is None:
            raise KeyError(f"{self.name}: {getattr(var, 'name', var)} is not read")
        return owner[1].mark_of(var)

    @property
    def mask(self) -> int:
        """This reader's bit as an int (``1 << bit``)."""
        return 1 << self.bit

    def dirty_ids(self, var) -> np.ndarray:
        """Rows of ``var`` written since this reader's last :meth:`clear`
        (int64 ``[k]``, sorted)."""
        _, rows = self._get(var)
        return np.flatnonzero(rows.mark_of(var).numpy() & self._mask).astype(np.int64)

    def clear(self) -> None:
        """Clears this reader's bit in every mark (on each mark's device);
        the other readers' bits stay. Call it at a quiet point (no update
        in flight), right after reading."""
        keep = tf.constant(~self._mask, tf.int8)
        for var, rows in self._rows.values():
            mark = rows.mark_of(var)
            with tf.device(mark.device):
                mark.assign(tf.bitwise.bitwise_and(mark, keep))


#: id(variable) -> (weak reference to it, the DirtyRows tracking it).
_SHARED: Dict[int, Tuple[weakref.ref, DirtyRows]] = {}


def shared_reader(variables: Sequence[tf.Variable], name: str) -> DirtyReader:
    """A new reader of the dirty marks of ``variables``, shared by every
    reader of the same variables: the marks are made (and registered with
    the strategy's table seam in scope, when it is this package's) for the
    variables without any yet, and the reader takes a bit free in all of
    them. Call it before the step that updates the variables is traced
    (a traced step marks only with the filters registered before).

    Args:
      variables: the table variables (2-D, each shard of a partitioned one).
      name: the reader's name (messages).

    Raises:
      ValueError: 8 readers read these marks already; or a variable is not 2-D.
    """
    from tf_asyncps.core.table_seam import seam_in_scope
    for key in [k for k, (ref, _) in _SHARED.items() if ref() is None]:
        del _SHARED[key]
    new = [v for v in variables
           if id(v) not in _SHARED or _SHARED[id(v)][0]() is not v]
    if new:
        rows = DirtyRows(new)
        seam = seam_in_scope()
        if seam is not None:
            seam.register_table(rows.hooks("dirty_rows"))
        for v in new:
            _SHARED[id(v)] = (weakref.ref(v), rows)
    pairs = [(v, _SHARED[id(v)][1]) for v in variables]
    owners = list({id(r): r for _, r in pairs}.values())
    taken = 0
    for r in owners:
        taken |= r.bits_taken
    free = [b for b in range(_READER_BITS) if not taken >> b & 1]
    if not free:
        raise ValueError(f"shared_reader({name!r}): {_READER_BITS} readers read these tables' "
                         "dirty marks already; use fewer DeltaPublisher/StepBackup objects.")
    for r in owners:
        r.bits_taken |= 1 << free[0]
    reader = DirtyReader(pairs, free[0], name)
    weakref.finalize(reader, _release, owners, free[0])  # a dropped reader frees its bit
    return reader


def _release(owners, bit: int) -> None:
    for r in owners:
        r.bits_taken &= ~(1 << bit)


def gather_rows(var, ids: np.ndarray, slots: Mapping[str, tf.Variable]) -> Dict[str, np.ndarray]:
    """``{"ids", "values", "slot:<name>"...}`` of rows ``ids`` of ``var`` and
    its slot variables (each slot indexed as the variable)."""
    out = {"ids": np.asarray(ids, np.int64)}
    idx = tf.constant(out["ids"])
    out["values"] = tf.gather(var, idx).numpy()
    for name, slot in slots.items():
        out["slot:" + name] = tf.gather(slot, idx).numpy()
    return out


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _save_npz(path: str, arrays: Mapping[str, np.ndarray]) -> str:
    with open(path, "wb") as f:
        np.savez(f, **arrays)
        f.flush()
        os.fsync(f.fileno())
    return _sha256(path)


def write_delta(folder: str, *, base_id: str, seq: int,
                shards: Mapping[str, Mapping[str, np.ndarray]],
                dense: Mapping[str, np.ndarray], extra: Optional[dict] = None,
                kind: str = "delta") -> str:
    """Writes one delta as ``folder`` (temp folder, ``meta.json`` last, rename).

    Args:
      folder: the delta's final folder path (its parent must exist).
      base_id: str, the full backup the chain starts from.
      seq: int >= 1, this delta's place in the chain.
      shards: ``{shard name: gather_rows(...)}``.
      dense: ``{variable name: array}``, dense variables whole.
      extra: more keys for ``meta.json``.
      kind: ``meta.json``'s ``kind``: "delta" (a backup's), "serving"
        (tf_asyncps.export's stream: no slots).

    Returns: ``folder``.
    """
    tmp = os.path.join(os.path.dirname(folder) or ".",
                       f".tmp-{os.path.basename(folder)}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    meta_shards = []
    for i, (name, arrays) in enumerate(shards.items()):
        file = f"{i}.npz"
        digest = _save_npz(os.path.join(tmp, file), arrays)
        meta_shards.append({"name": name, "file": file, "rows": int(len(arrays["ids"])),
                            "sha256": digest})
    dense_names = list(dense)
    digest = _save_npz(os.path.join(tmp, "dense.npz"),
                       {str(i): np.asarray(dense[n]) for i, n in enumerate(dense_names)})
    meta = dict(extra or {})
    meta.update({"format": DELTA_FORMAT, "kind": kind, "base_id": str(base_id),
                 "seq": int(seq), "prev_seq": int(seq) - 1, "shards": meta_shards,
                 "dense": {"file": "dense.npz", "names": dense_names, "sha256": digest}})
    atomic_write_json(os.path.join(tmp, _META), meta)
    if os.path.isdir(folder):
        shutil.rmtree(folder)
    os.rename(tmp, folder)
    return folder


def load_file(folder: str, file: str, digest: str, what: str) -> Dict[str, np.ndarray]:
    """The arrays of ``folder/file`` after checking its sha256 against ``digest``.

    Raises:
      ChainError: the file is missing or its sha256 differs (names it and ``what``).
    """
    path = os.path.join(folder, file)
    if not os.path.isfile(path):
        raise ChainError(f"delta chain: {path} is missing ({what}); the delta is incomplete.")
    if _sha256(path) != digest:
        raise ChainError(f"delta chain: {path} does not match its sha256 in "
                         f"{os.path.join(folder, _META)} ({what}): truncated or half-written.")
    with np.load(path) as z:
        return {k: z[k] for k in z.files}


def read_chain(folders: Sequence[str], base_id: str,
               kind: str = "delta") -> List[Tuple[str, dict]]:
    """Checks the deltas in ``folders`` (any order) form the contiguous chain
    1..n of ``base_id``, each of ``kind``; returns ``[(folder, meta)]`` in
    chain order.

    Raises:
      ChainError: a folder without a readable ``meta.json`` (half-written),
        another format, a delta of another base, two deltas with one
        sequence number, or a gap (names the files and the missing number).
    """
    metas = []
    for folder in folders:
        path = os.path.join(folder, _META)
        meta = read_json(path)
        if meta is None:
            raise ChainError(f"delta chain: {path} is missing or unreadable: the delta "
                             f"{folder} is half-written; delete it to restore up to the one "
                             "before.")
        if meta.get("format") != DELTA_FORMAT or meta.get("kind") != kind:
            raise ChainError(f"delta chain: {path} is not a format {DELTA_FORMAT} "
                             f"{kind!r} delta.")
        if meta.get("base_id") != str(base_id):
            raise ChainError(f"delta chain: {path} is a delta of base {meta.get('base_id')!r}, "
                             f"not of {base_id!r}.")
        metas.append((int(meta["seq"]), folder, meta))
    metas.sort(key=lambda t: t[0])
    out = []
    for i, (seq, folder, meta) in enumerate(metas):
        if i and seq == metas[i - 1][0]:
            raise ChainError(f"delta chain: {metas[i - 1][1]} and {folder} both hold sequence "
                             f"number {seq} of base {base_id!r} (duplicate).")
        if seq != i + 1 or int(meta.get("prev_seq", -1)) != i:
            raise ChainError(f"delta chain: delta {i + 1} of base {base_id!r} is missing "
                             f"(gap before {os.path.join(folder, _META)}, sequence {seq}).")
        out.append((folder, meta))
    return out


def _parts(entry):
    """``[(variable, slots, first global row)]`` of a table entry: one
    ``(variable, slots)`` (rows from 0), or a list of shards with offsets."""
    if isinstance(entry, tuple):
        return [(entry[0], entry[1], 0)]
    return list(entry)


def apply_delta(folder: str, meta: dict, tables: Mapping[str, object],
                dense: Mapping[str, object], dynamic: Optional[Mapping] = None) -> None:
    """Writes one delta's rows, slot rows and dense variables into the model.

    Args:
      folder, meta: one of :func:`read_chain`'s results.
      tables: ``{table name: (variable, {slot name: slot variable})}``, or
        ``{table name: [(shard, {slot name: slot shard}, first row), ...]}``
        for a table split on axis 0: the delta's ids are global rows, so a
        chain written over 2 shards restores onto 3 (or 1).
      dense: ``{name: variable}`` (a sharded one is written shard by shard).
      dynamic: ``{table name: fn(arrays, path)}`` for the DynamicEmbedding
        tables (tf_asyncps/dynamic/deltas.py): ``fn`` takes the checked
        file's arrays.

    Raises:
      ChainError: a file is missing or fails its checksum, its row count
        differs from ``meta.json``'s, or a table, slot or dense variable of
        the delta is not in the model (names it).
    """
    for shard in meta["shards"]:
        name = shard["name"]
        arrays = load_file(folder, shard["file"], shard["sha256"], f"table {name}")
        if len(arrays["ids"]) != int(shard["rows"]):
            raise ChainError(f"delta chain: {os.path.join(folder, shard['file'])} holds "
                             f"{len(arrays['ids'])} rows, meta.json says {shard['rows']}.")
        if dynamic and name in dynamic:
            try:
                dynamic[name](arrays, os.path.join(folder, shard["file"]))
            except ValueError as e:  # dynamic/deltas.py names the file
                raise ChainError(str(e)) from e
            continue
        if name not in tables:
            raise ChainError(f"delta chain: {folder} holds table {name}, which the "
                             "model has not.")
        ids = arrays["ids"]
        for var, slots, first in _parts(tables[name]):
            here = (ids >= first) & (ids < first + int(var.shape[0]))
            if not here.any():
                continue
            local = tf.constant(ids[here] - first)
            var.scatter_update(tf.IndexedSlices(tf.constant(arrays["values"][here]), local))
            for key, rows in arrays.items():
                if key.startswith("slot:"):
                    slot = slots.get(key[5:])
                    if slot is None:
                        raise ChainError(f"delta chain: {folder} holds slot {key[5:]} of "
                                         f"{name}, which the optimizer has not.")
                    slot.scatter_update(tf.IndexedSlices(tf.constant(rows[here]), local))
    d = meta["dense"]
    arrays = load_file(folder, d["file"], d["sha256"], "dense variables")
    for i, name in enumerate(d["names"]):
        if name not in dense:
            raise ChainError(f"delta chain: {folder} holds dense variable {name}, which the "
                             "model has not.")
        assign_whole(dense[name], arrays[str(i)])


def assign_whole(var, value: np.ndarray) -> None:
    """``var`` (a variable, a Keras 3 one, or one split on axis 0) = ``value``."""
    parts = shards_of(var)
    if len(parts) == 1:
        parts[0].assign(value)
        return
    first = 0
    for part in parts:
        rows = int(part.shape[0])
        part.assign(value[first:first + rows])
        first += rows


def read_whole(var) -> np.ndarray:
    """The value of ``var`` (a variable, a Keras 3 one, or one split on axis 0)."""
    parts = shards_of(var)
    if len(parts) == 1:
        return np.asarray(parts[0].numpy())
    return np.concatenate([np.asarray(p.numpy()) for p in parts])


def shards_of(var):
    """The tf.Variables behind a variable: each shard of a sharded one (in
    order, rows split on axis 0), the variable itself otherwise; a Keras 3
    variable's TensorFlow variable."""
    var = getattr(var, "value", var) if not isinstance(var, tf.Variable) else var
    return list(getattr(var, "variables", None) or [var])


class ModelDeltas:
    """A model's tables and dense variables as one delta chain writes and
    restores them.

    Dynamic tables (``DynamicEmbedding``, ``dynamic``): per table the rows
    marked since the last write with their ids, counts, last steps, slot
    rows, the marked counting-filter slots, each shard's counters and the
    ids evicted since (tombstones), tf_asyncps/dynamic/deltas.py; restored
    onto the shards that wrote them.

    Tables: the ``embeddings`` of every layer holding one (Keras
    ``Embedding`` of either Keras, ``EmbeddingCollection``), each shard of a
    sharded one, with the optimizer's slots of it (Adagrad ``accumulator``,
    Adam ``momentum``, ``velocity``), written per table by global row: a
    chain restores onto another number of shards (ps tasks). Dense: every
    other model and optimizer variable whole (a slot of a table under
    another name, e.g. tf_keras SGD's momentum, is saved whole there:
    larger, never lost), and ``extra`` (e.g. the strategy's global step).
    Tables and dense variables are keyed by position, as a
    tf.train.Checkpoint matches by structure (the same model code gives
    the same keys; layer names may differ); a non-table variable split
    over the ps tasks restores onto the same split (its optimizer slots are
    one variable per shard).

    Attributes:
      tables: ``{"t<k>.<j>": (shard j of table k, {slot name: its slot})}``.
      layout: ``{"t<k>": [(shard, slots, first global row)]}``.
      dense: ``{"d<n>": variable}``.
      dynamic: ``{"t<k>": DynamicTable}``.

    Args:
      model: a built tf_keras or Keras 3 model.
      optimizer: its built optimizer, or None.
      extra: more variables saved whole.

    Raises:
      ValueError: the model holds no table (a delta would be a full save).
    """

    def __init__(self, model, optimizer=None, extra: Sequence[tf.Variable] = ()):
        from tf_asyncps.compat import keras_models as models_compat
        from tf_asyncps.compat import optimizers as opt_compat
        from tf_asyncps.dynamic import checkpoint as dynamic_checkpoint
        self.tables: Dict[str, Tuple[tf.Variable, Dict[str, tf.Variable]]] = {}
        self.layout: Dict[str, List[Tuple[tf.Variable, Dict[str, tf.Variable], int]]] = {}
        self.dynamic: Dict[str, object] = {}
        self.optimizer = optimizer
        self.model = model
        taken = set()
        for layer in models_compat.layers_of(model):
            table = getattr(layer, "dynamic_table", None)
            if table is not None:
                # Written by id (dynamic/deltas.py): its shards, their metadata
                # and its slots are none of the dense variables.
                self.dynamic[f"t{len(self.layout) + len(self.dynamic)}"] = table
                for shard in table.shards:
                    taken.update(id(v) for v in vars(shard).values()
                                 if isinstance(v, tf.Variable))
                    taken.add(id(shard.var))
                sets = dynamic_checkpoint.slot_sets(table, optimizer) if optimizer else []
                taken.update(id(shards_of(p)[0]) for parts, _ in sets for p in parts)
                continue
            emb = getattr(layer, "embeddings", None)
            if emb is None:
                continue
            shards = shards_of(emb)
            parts, first = [], 0
            for shard in shards:
                slots = {}
                of = emb if len(shards) == 1 else shard  # Keras 3 looks up its own variable
                for name in ("accumulator", "momentum", "velocity"):
                    try:
                        s = opt_compat.slot(optimizer, name, of) if optimizer else None
                    except (AttributeError, KeyError, ValueError):
                        s = None
                    if s is not None:
                        s = shards_of(s)[0]  # a Keras 3 slot: its tf.Variable
                        slots[name] = s
                        taken.add(id(s))
                taken.add(id(shard))
                key = len(self.layout) + len(self.dynamic)
                self.tables[f"t{key}.{len(parts)}"] = (shard, slots)
                parts.append((shard, slots, first))
                first += int(shard.shape[0])
            self.layout[f"t{len(self.layout) + len(self.dynamic)}"] = parts
        if not self.tables and not self.dynamic:
            raise ValueError("StepBackup(full_every > 1): the model has no embedding table "
                             "(a layer with `embeddings`); use full_every=1.")
        self.dense: Dict[str, object] = {}
        others = list(model.variables) + list(getattr(optimizer, "variables", None) or [])
        for v in others + list(extra):
            parts = shards_of(v)
            if not all(id(p) in taken for p in parts):
                taken.update(id(p) for p in parts)
                self.dense[f"d{len(self.dense)}"] = v
        self.dirty: Optional[DirtyReader] = None

    def track(self) -> DirtyReader:
        """This object's reader of the dirty marks beside each table shard
        (made, and registered with the strategy in scope when it is this
        package's, if no other reader made them: :func:`shared_reader`)."""
        if self.dirty is None:
            from tf_asyncps.dynamic import deltas as dynamic_deltas
            self.dirty = shared_reader(self.variables(), "step_backup")
            for table in self.dynamic.values():
                dynamic_deltas.attach(table, self.dirty.mark_of)
        return self.dirty

    def variables(self) -> List[tf.Variable]:
        """The table variables marked: each fixed table shard, each dynamic one's."""
        return ([v for v, _ in self.tables.values()]
                + [s.var for t in self.dynamic.values() for s in t.shards])

    def any_dirty(self) -> bool:
        """Whether a row of any table is marked for this object's reader."""
        return any(self.track().dirty_ids(v).size for v in self.variables())

    def write(self, folder: str, *, base_id: str, seq: int, extra: Optional[dict] = None) -> str:
        """Writes the rows marked since the last write (then clears the
        marks) and the dense variables as delta ``seq`` of ``base_id``."""
        dirty = self.track()
        tables = {}
        for name, parts in self.layout.items():
            rows = [gather_rows(var, dirty.dirty_ids(var), slots) for var, slots, _ in parts]
            for (_, _, first), r in zip(parts, rows):
                r["ids"] = r["ids"] + first  # global rows: any sharding restores them
            tables[name] = {k: np.concatenate([r[k] for r in rows]) for k in rows[0]}
        from tf_asyncps.dynamic import checkpoint as dynamic_checkpoint
        from tf_asyncps.dynamic import deltas as dynamic_deltas
        for name, table in self.dynamic.items():
            tables[name] = dynamic_deltas.read(
                table, dirty.mask, dynamic_checkpoint.slot_sets(table, self.optimizer))
        tables = {k: tables[k] for k in sorted(tables, key=lambda n: int(n[1:]))}
        out = write_delta(folder, base_id=base_id, seq=seq, shards=tables,
                          dense={k: read_whole(v) for k, v in self.dense.items()}, extra=extra)
        dirty.clear()
        for table in self.dynamic.values():
            dynamic_deltas.clear(table, dirty.mask)
        return out

    def restore(self, folders: Sequence[str], base_id: str) -> int:
        """Applies the chain in ``folders`` (checked by :func:`read_chain`)
        after the base is restored; returns its length."""
        from tf_asyncps.dynamic import checkpoint as dynamic_checkpoint
        from tf_asyncps.dynamic import deltas as dynamic_deltas
        chain = read_chain(folders, base_id)
        states = {}
        for name, table in self.dynamic.items():
            if self.optimizer is not None:  # slot rows the base restore keeps waiting
                dynamic_checkpoint.track_optimizer(table, self.optimizer,
                                                   self.model.trainable_variables)
            states[name] = dynamic_deltas.state_of(table)

        def applier(name):
            def apply(arrays, where):
                states[name] = dynamic_deltas.apply(self.dynamic[name], states[name], arrays,
                                                    where)
            return apply

        appliers = {name: applier(name) for name in self.dynamic}
        for folder, meta in chain:
            apply_delta(folder, meta, self.layout, self.dense, appliers)
        for name, table in self.dynamic.items():
            dynamic_deltas.restore(table, states[name])
        return len(chain)
