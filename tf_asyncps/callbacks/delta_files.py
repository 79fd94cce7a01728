"""A delta chain on disk: one delta's files, the chain's checks, and a
delta applied to variables (tf_asyncps/callbacks/delta_chain.py reads a
model's tables into them and restores them).

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
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

from tf_asyncps.files import atomic_write_json, read_json

__all__ = ["ChainError", "DELTA_FORMAT", "write_delta", "read_chain", "apply_delta",
           "gather_rows", "load_file", "shards_of", "assign_whole", "read_whole"]

DELTA_FORMAT = 2  # 2: a table's rows by global row, dense variables whole
_META = "meta.json"


class ChainError(ValueError):
    """A delta chain that cannot be restored; the message names the file
    and what is wrong or missing."""


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
