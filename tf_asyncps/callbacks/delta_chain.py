"""Incremental (delta) backups of embedding tables: per-row dirty marks on
the ps and a chain of deltas on disk.

Idea: DeepRec's incremental checkpoint (Alibaba, 2022): a full checkpoint
is a base; between two bases each save writes only the table rows written
since the previous save (with their optimizer slot rows) and the small
dense variables whole; a restore is the base plus the contiguous chain.

* dirty_rows.py: the marks beside each table shard and their readers
  (:class:`DirtyRows`, :class:`DirtyReader`, :func:`shared_reader`);
* delta_files.py: a delta's files, the chain's checks, a delta applied
  (:func:`write_delta`, :func:`read_chain`, :func:`apply_delta`,
  :class:`ChainError`);
* tf_asyncps/dynamic/deltas.py: a DynamicEmbedding's marks, deltas and
  restore;
* here: :class:`ModelDeltas`, a model's tables and dense variables as one
  chain writes and restores them. The names above are importable from
  here as well.
"""

from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

from tf_asyncps.callbacks.delta_files import (  # noqa: F401 (assign_whole, load_file: API)
    DELTA_FORMAT, ChainError, apply_delta, assign_whole, gather_rows, load_file, read_chain,
    read_whole, shards_of, write_delta)
from tf_asyncps.callbacks.dirty_rows import DirtyReader, DirtyRows, shared_reader

__all__ = ["DirtyRows", "DirtyReader", "shared_reader", "ModelDeltas", "write_delta",
           "read_chain", "apply_delta", "gather_rows", "load_file", "shards_of", "ChainError",
           "DELTA_FORMAT"]


class ModelDeltas:
    """A model's tables and dense variables as one delta chain writes and
    restores them.

    Dynamic tables (``DynamicEmbedding``, ``dynamic``): per table the rows
    marked since the last write with their ids, counts, last steps, slot
    rows, the marked counting-filter slots, each shard's counters and the
    ids evicted since (tombstones), tf_asyncps/dynamic/deltas.py; onto
    another number of shards the chain is applied to the base as the
    shards that wrote it held it, then re-homed as a checkpoint is
    (deltas.relayout, dynamic/reshard.py).

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
                dynamic_deltas.attach(table, self.dirty.mark_of, self.dirty.mask)
        return self.dirty

    def variables(self) -> List[tf.Variable]:
        """The table variables marked: each fixed table shard, each dynamic one's."""
        return ([v for v, _ in self.tables.values()]
                + [s.var for t in self.dynamic.values() for s in t.shards])

    def clear(self) -> None:
        """Clears this object's marks: rows, and each dynamic table's filter
        marks and tombstones (after a full save: the next delta holds what
        changed since it)."""
        from tf_asyncps.dynamic import deltas as dynamic_deltas
        dirty = self.track()
        dirty.clear()
        for table in self.dynamic.values():
            dynamic_deltas.clear(table, dirty.mask)

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
        self.clear()
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
