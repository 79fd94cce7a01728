"""A serving stream of table deltas: the rows changed every N steps, written
on the chief and applied to a SavedModel in a process with no cluster.

Idea: Monolith (ByteDance, 2022) syncs the (id, embedding) pairs changed on
its training parameter servers to serving every minute instead of shipping
whole tables; TorchRec's ModelDeltaTracker (2025) lets several readers
each take the rows changed since their own last read.

:class:`DeltaPublisher` exports a base SavedModel when it starts, then
every ``every_steps`` steps (at a quiet point: the schedule drained, no
update in flight) writes one delta: per table the rows written since its
previous delta (global row ids, values; no optimizer state) and every other
model variable whole (they are small). The rows come from the per-row dirty
marks beside each table shard on the ps (callbacks/delta_chain.py), which
every update sets inside its own ps-side op: the publisher reads its own bit
of those marks and clears only that bit, so a :class:`StepBackup` in the
same fit keeps its rows (no second mark and no byte more on the wire per
step, however many readers). :func:`apply_deltas` (or :class:`DeltaLoader`,
which can poll) loads the base with ``tf.saved_model.load`` and writes the
chain into its variables, refusing a gap, a duplicate, a delta of another
base or a truncated file, naming the file.

Layout of ``publish_dir``::

    latest.json                     {"base_id", "saved_model", "delta_dir"}
    <base_id>/saved_model/          the base (its own tf_asyncps_delta_base.json)
    <base_id>/delta-000001/ ...     delta_chain's format, kind "serving"

A DynamicEmbedding (tf_keras or Keras 3) is streamed by id: per table the
live rows written since the previous delta (global row, id, values) and the
ids evicted since (tombstones, dynamic/deltas.py); the loader removes the
evicted ids from each shard's id -> row map in the SavedModel (found by its
object path, recorded in the base stamp: :func:`index_paths`), maps each
written id to its row and writes the row. tf_keras's
``tf.saved_model.save(model)`` keeps the maps at their paths in the model;
Keras 3's ``model.export`` keeps them unnamed (``_misc_assets/<k>``, its
root is not the model), so :func:`default_export` writes the same archive
with the maps also named ``tf_asyncps_dynamic_maps/v<i>/<shard>``
(compat/saved_model.py). Either way the served function reads the map and
the table only (the layer's export trace), so a map the stream changed is
served as it stands.

Each ``meta.json`` holds ``base_id``, ``seq``, ``prev_seq``, rows and sha256
per file (as a backup delta's), and the steps and global step it reaches.
Variables are matched by position in ``model.variables``, which the
SavedModel keeps as its ``variables`` list (tf_keras ``tf.saved_model.save``,
Keras 3 ``model.export``); a table's ids are global rows, so a base with
another sharding (or none) takes them.
"""

import contextlib
import os
import re
import shutil
import uuid
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np
import tensorflow as tf
import tf_keras

from tf_asyncps.callbacks import delta_chain
from tf_asyncps.compat import checkpoint as checkpoint_compat
from tf_asyncps.compat import keras_models as models_compat
from tf_asyncps.compat import saved_model as saved_model_compat
from tf_asyncps.compat import tf_keras as tf_keras_compat
from tf_asyncps.dynamic import deltas as dynamic_deltas
from tf_asyncps.files import atomic_write_json, read_json
from tf_asyncps.validate import check_int

__all__ = ["DeltaPublisher", "DeltaLoader", "apply_deltas", "latest_base", "default_export",
           "index_paths", "BASE_FILE", "MAPS"]

BASE_FILE = "tf_asyncps_delta_base.json"
#: The attribute of a Keras 3 base SavedModel that holds its DynamicEmbedding
#: maps by name (``tf.saved_model.load(dir).tf_asyncps_dynamic_maps["v0"][0]``).
MAPS = "tf_asyncps_dynamic_maps"
LATEST_FILE = "latest.json"
_DELTA = re.compile(r"^delta-(\d+)$")
_KIND = "serving"


def _value(v):
    """The TensorFlow variable behind a Keras 3 variable (itself otherwise)."""
    return v if isinstance(v, tf.Variable) else getattr(v, "value", v)


def _offsets(shards) -> np.ndarray:
    return np.cumsum([0] + [int(s.shape[0]) if s.shape.rank else 1
                            for s in shards])[:-1].astype(np.int64)


class _ServingVariables:
    """A model's variables as the stream writes them: the tables (every
    layer's ``embeddings``) by global row, the others whole, keyed
    ``v<position in model.variables>``."""

    def __init__(self, model):
        tables, metadata, dynamic = set(), set(), {}
        for layer in models_compat.layers_of(model):
            table = getattr(layer, "dynamic_table", None)
            if table is not None:
                dynamic[id(delta_chain.shards_of(table.table)[0])] = table
                for shard in table.shards:  # served from the map: not streamed
                    metadata.update(id(v) for v in vars(shard).values()
                                    if isinstance(v, tf.Variable))
                continue
            emb = getattr(layer, "embeddings", None)
            if emb is not None:
                tables.add(id(emb))
                tables.update(id(s) for s in delta_chain.shards_of(emb))
        self.tables: Dict[str, Tuple[list, np.ndarray]] = {}
        self.dense: Dict[str, object] = {}
        self.dynamic: Dict[str, object] = {}
        self.count = len(model.variables)
        for i, v in enumerate(model.variables):
            shards = delta_chain.shards_of(v)
            if id(shards[0]) in dynamic:
                self.dynamic[f"v{i}"] = dynamic[id(shards[0])]
            elif id(v) in metadata:
                continue
            elif id(v) in tables:
                shards = delta_chain.shards_of(v)
                self.tables[f"v{i}"] = (shards, _offsets(shards))
            else:
                self.dense[f"v{i}"] = v
        if not self.tables and not self.dynamic:
            raise ValueError("DeltaPublisher: the model has no embedding table (a layer with "
                             "`embeddings`); export whole SavedModels instead.")
        self.reader: Optional[delta_chain.DirtyReader] = None
        self.index_paths = index_paths(model, self.dynamic)

    def track(self) -> delta_chain.DirtyReader:
        if self.reader is None:
            self.reader = delta_chain.shared_reader(
                [s for shards, _ in self.tables.values() for s in shards]
                + [s.var for t in self.dynamic.values() for s in t.shards], "delta_publisher")
            for table in self.dynamic.values():
                dynamic_deltas.attach(table, self.reader.mark_of, self.reader.mask)
        return self.reader

    def clear(self) -> None:
        """Clears this publisher's marks (rows, filter slots, tombstones)."""
        self.reader.clear()
        for table in self.dynamic.values():
            dynamic_deltas.clear(table, self.reader.mask)

    def rows(self) -> Dict[str, Dict[str, np.ndarray]]:
        """``{key: {"ids": int64 [k] global rows, "values": [k, dim]}}``: the
        rows written since the last :meth:`clear`."""
        reader = self.track()
        out = {}
        for key, (shards, offsets) in self.tables.items():
            rows = [delta_chain.gather_rows(shard, reader.dirty_ids(shard), {})
                    for shard in shards]
            out[key] = {"ids": np.concatenate([r["ids"] + off for r, off in zip(rows, offsets)]),
                        "values": np.concatenate([r["values"] for r in rows])}
        for key, table in self.dynamic.items():
            # The live rows written and their ids; the ids evicted since.
            d = dynamic_deltas.read(table, reader.mask, [], slots=False)
            live = d["count"] > 0
            keys = dynamic_deltas.decode_keys(d, "key:")[live]
            out[key] = {"ids": d["ids"][live], "values": d["values"][live],
                        "shards": d["shards"][:, :1],
                        **{"key:" + n: v for n, v in dynamic_deltas.encode_keys(keys).items()},
                        **{n: v for n, v in d.items() if n.startswith("tomb:")}}
        return out

    def whole(self) -> Dict[str, np.ndarray]:
        return {k: delta_chain.read_whole(v) for k, v in self.dense.items()}


def _dynamic_tables(model) -> Dict[str, object]:
    """``{"v<i>": DynamicTable}``: the model's DynamicEmbedding tables, keyed
    by the position of their table variable in ``model.variables``."""
    tables = {}
    for layer in models_compat.layers_of(model):
        table = getattr(layer, "dynamic_table", None)
        if table is not None:
            tables[id(delta_chain.shards_of(table.table)[0])] = table
    return {f"v{i}": tables[id(delta_chain.shards_of(v)[0])]
            for i, v in enumerate(model.variables) if id(delta_chain.shards_of(v)[0]) in tables}


def index_paths(model, tables: Optional[Dict[str, object]] = None) -> Dict[str, List[str]]:
    """Where :func:`default_export` puts each DynamicEmbedding shard's id ->
    row map in ``model``'s SavedModel: ``{"v<i>": [object path per shard]}``
    (``i``: the table variable's position in ``model.variables``). tf_keras:
    the map's path in the model's own object graph
    (``layer_with_weights-0/dynamic_table/shards/0/index``), which
    ``tf.saved_model.save(model)`` keeps; Keras 3: ``MAPS/v<i>/<shard>``."""
    tables = _dynamic_tables(model) if tables is None else tables
    if models_compat.is_keras3_model(model):
        return {k: [f"{MAPS}/{k}/{j}" for j in range(len(t.shards))] for k, t in tables.items()}
    wanted = {id(s.index): (k, j) for k, t in tables.items() for j, s in enumerate(t.shards)}
    paths = {k: [""] * len(t.shards) for k, t in tables.items()}
    for path, obj in checkpoint_compat.trackable_paths(model, lambda o: id(o) in wanted).items():
        key, j = wanted[id(obj)]
        paths[key][j] = path
    return paths


def default_export(model, path: str) -> None:
    """Writes ``model``'s SavedModel to ``path``: tf_keras,
    ``tf.saved_model.save(model, path)``; Keras 3, what
    ``model.export(path, format="tf_saved_model")`` writes (its ``serve``
    endpoint), plus, for a model with a DynamicEmbedding, each shard's id ->
    row map as ``MAPS/v<i>/<shard>`` (``model.export`` keeps those maps as
    ``_misc_assets/<k>`` only, numbered by a walk of the model).

    Raises:
      ValueError: Keras's, for a Keras 3 model not built.
    """
    if not models_compat.is_keras3_model(model):
        tf.saved_model.save(model, path)
        return
    tables = _dynamic_tables(model)
    if not tables:
        model.export(path, format="tf_saved_model", verbose=False)
        return
    saved_model_compat.export_saved_model(
        model, path, {MAPS: {k: [s.index for s in t.shards] for k, t in tables.items()}})


class DeltaPublisher(tf_keras.callbacks.Callback):
    """Writes a serving stream: a base SavedModel at start, then every
    ``every_steps`` worker steps the table rows changed since the previous
    delta and the other model variables whole (see the module docstring).

    In ``fit`` (tf_keras, or this package's Keras 3 fit) pass it as a
    callback: it starts at train begin (after a :class:`StepBackup` listed
    before it has restored its backup) and writes a last delta at train end.
    In a custom loop: :meth:`start` once the model and its optimizer are
    built and before the step function is traced (its marks must exist when
    the update is traced), then :meth:`step_done` after scheduling each step
    (or :meth:`publish` when you like). Without the strategy (one process),
    pass each table gradient through ``publisher.reader.mark(grad, var)``.

    Args:
      publish_dir: str, the stream's folder (made if missing).
      every_steps: int >= 1, worker steps between deltas.
      export: ``fn(model, path)`` writing the base SavedModel (default:
        :func:`default_export`: Keras 3 ``model.export``'s archive, else
        ``tf.saved_model.save``); the SavedModel must keep
        ``model.variables`` as its ``variables`` list and each
        DynamicEmbedding map at its :func:`index_paths` path (the default
        does both).

    Attributes:
      base_id: str, the current base's id (None before :meth:`start`).
      saved_model_dir, delta_dir: str, where its base and deltas are.
      published: int, deltas written on the current base.
      reader: delta_chain.DirtyReader, this publisher's marks.

    Raises:
      ValueError: a bad argument (names it); at start, a model with no
        embedding table, or an ``export`` whose SavedModel lacks a
        DynamicEmbedding's id -> row map at its :func:`index_paths` path
        (Keras 3's plain ``model.export``, say).
    """

    #: Keras 3 fit (keras3/trainer.py) calls after_closures and fit_resume_point.
    runs_between_closures = True

    def __init__(self, publish_dir, every_steps, export: Optional[Callable] = None):
        super().__init__()
        if not isinstance(publish_dir, (str, os.PathLike)) or not str(publish_dir):
            raise ValueError(f"DeltaPublisher(publish_dir={publish_dir!r}): give a folder path.")
        tf_keras_compat.keep_batch_logs_remote(self)  # its batch hook never reads the logs
        self.publish_dir = os.fspath(publish_dir)
        self.every_steps = check_int(every_steps, "DeltaPublisher(every_steps)", min=1,
                                     hint="worker steps between deltas")
        self.export = export or default_export
        self.base_id: Optional[str] = None
        self.saved_model_dir: Optional[str] = None
        self.delta_dir: Optional[str] = None
        self.published = 0
        self.reader: Optional[delta_chain.DirtyReader] = None
        self._model = None
        self._vars: Optional[_ServingVariables] = None
        self._steps = 0  # steps scheduled since start
        self._last = 0  # steps at the last delta
        self._epoch = 0
        self._seen = None  # Keras 3: (epoch, steps in epoch) at the last call

    # -- custom loop ----------------------------------------------------------
    def start(self, model) -> str:
        """Makes this publisher's dirty marks, exports the base SavedModel of
        ``model`` (at a quiet point) and points ``latest.json`` at it;
        returns the SavedModel's folder."""
        self._model = model
        self._vars = _ServingVariables(model)
        strategy = self._strategy()
        # In the strategy's scope: the marks register with its table seam.
        with strategy.scope() if strategy is not None else contextlib.nullcontext():
            self.reader = self._vars.track()
        self._drain()
        self._vars.clear()  # rows before the base are in it
        self.base_id = f"s{self._global_step():012d}-{uuid.uuid4().hex[:8]}"
        self.delta_dir = os.path.join(self.publish_dir, self.base_id)
        self.saved_model_dir = os.path.join(self.delta_dir, "saved_model")
        os.makedirs(self.delta_dir, exist_ok=True)
        tmp = os.path.join(self.delta_dir, f".tmp-saved_model-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        self.export(model, tmp)
        missing = saved_model_compat.missing_paths(
            tmp, [p for paths in self._vars.index_paths.values() for p in paths])
        if missing:
            shutil.rmtree(tmp, ignore_errors=True)
            raise ValueError(
                f"DeltaPublisher: the SavedModel its export wrote holds no {missing[0]} (a "
                "DynamicEmbedding's id -> row map, which apply_deltas updates); export with "
                "tf_asyncps.export.default_export, or keep the maps at "
                "tf_asyncps.export.index_paths(model).")
        atomic_write_json(os.path.join(tmp, BASE_FILE),
                          {"base_id": self.base_id, "variables": self._vars.count,
                           "global_step": self._global_step(),
                           "dynamic_index_paths": self._vars.index_paths})
        os.rename(tmp, self.saved_model_dir)
        atomic_write_json(os.path.join(self.publish_dir, LATEST_FILE),
                          {"base_id": self.base_id, "saved_model": self.saved_model_dir,
                           "delta_dir": self.delta_dir})
        self.published, self._steps, self._last = 0, 0, 0
        return self.saved_model_dir

    def step_done(self, steps: int = 1) -> Optional[str]:
        """Counts ``steps`` more scheduled worker steps; publishes when
        ``every_steps`` have passed since the last delta (returns its folder)."""
        self._steps += int(steps)
        if self._steps - self._last >= self.every_steps:
            return self.publish()
        return None

    def publish(self) -> str:
        """Drains the schedule and writes one delta (the rows changed since
        the previous one, the other variables whole); returns its folder."""
        if self._vars is None:
            raise ValueError("DeltaPublisher.publish before start(model).")
        self._drain()
        rows = self._vars.rows()
        seq = self.published + 1
        folder = delta_chain.write_delta(
            os.path.join(self.delta_dir, f"delta-{seq:06d}"), base_id=self.base_id, seq=seq,
            shards=rows, dense=self._vars.whole(), kind=_KIND,
            extra={"steps": self._steps, "global_step": self._global_step()})
        self._vars.clear()
        self.published, self._last = seq, self._steps
        return folder

    def _strategy(self):
        s = getattr(self._model, "distribute_strategy", None)
        return s if s is not None and hasattr(s, "staleness_stats") else None

    def _drain(self) -> None:
        strategy = self._strategy()
        if strategy is not None:
            tf.distribute.coordinator.ClusterCoordinator(strategy).join()

    def _global_step(self) -> int:
        strategy = self._strategy()
        if strategy is not None:
            return int(strategy.staleness_tracker.global_step.numpy())
        return self._steps

    # -- fit ------------------------------------------------------------------
    def fit_resume_point(self, steps_per_epoch: int):
        """None: the publisher never moves the fit's start (Keras 3 fit asks)."""
        return None

    def on_train_begin(self, logs=None):
        self.start(self.model)
        self._seen = None

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        spe = getattr(self.model, "_steps_per_execution", None)  # tf_keras: a variable
        self.step_done(int(spe.numpy()) if hasattr(spe, "numpy") else 1)

    def after_closures(self, epoch: int, steps_in_epoch: int) -> None:
        """Keras 3 fit: ``steps_in_epoch`` worker steps of ``epoch`` are scheduled."""
        prev_epoch, prev = self._seen or (epoch, 0)
        steps = int(steps_in_epoch) - (prev if prev_epoch == epoch else 0)
        if self._seen is None:
            # A fit resumed mid-epoch (StepBackup) starts past step 0: its
            # first closure ran steps_per_execution steps, not all before it.
            spe = getattr(self.model, "steps_per_execution", 1)
            steps = min(steps, int(spe.numpy()) if hasattr(spe, "numpy") else int(spe or 1))
        self._seen = (epoch, int(steps_in_epoch))
        self.step_done(steps)

    def on_train_end(self, logs=None):
        if self._vars is not None and self._steps > self._last:
            self.publish()


def latest_base(publish_dir: str) -> Tuple[str, str]:
    """(saved_model_dir, delta_dir) of the newest base in ``publish_dir``.

    Raises:
      FileNotFoundError: no ``latest.json`` there (no publisher started).
    """
    latest = read_json(os.path.join(publish_dir, LATEST_FILE))
    if latest is None:
        raise FileNotFoundError(f"{os.path.join(publish_dir, LATEST_FILE)} is missing: no "
                                "DeltaPublisher has started in this folder.")
    return latest["saved_model"], latest["delta_dir"]


def _folder(path, name: str, what: str) -> str:
    """``path`` as a str if it names an existing folder.

    Raises:
      TypeError: not a str or os.PathLike (names ``name`` and what to give).
      ValueError: empty, or no folder there.
    """
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"apply_deltas({name}={path!r}): give a folder path (str), {what}.")
    path = os.fspath(path)
    if not path:
        raise ValueError(f"apply_deltas({name}=''): the path is empty; give {what}.")
    if not os.path.isdir(path):
        raise ValueError(f"apply_deltas({name}={path!r}): no folder there; give {what}.")
    return path


class DeltaLoader:
    """A SavedModel written by :class:`DeltaPublisher`, brought up to date
    with its deltas, in any process (no cluster needed).

    Args:
      saved_model_dir: str, the base (``<publish_dir>/<base_id>/saved_model``).
      delta_dir: str, its deltas' folder (default: the base's parent).

    Attributes:
      model: the ``tf.saved_model.load`` object; call its endpoints as usual.
      applied: int, deltas applied so far.

    Raises:
      TypeError: ``saved_model_dir`` or ``delta_dir`` is not a path (None, say).
      ValueError: either is empty or names no folder.
      delta_chain.ChainError: the SavedModel has no base stamp, or its
        ``variables`` list differs from the publisher's model, or lacks a
        DynamicEmbedding's id -> row map.
    """

    def __init__(self, saved_model_dir: str, delta_dir: Optional[str] = None):
        saved_model_dir = _folder(saved_model_dir, "saved_model_dir",
                                  "the base SavedModel, <publish_dir>/<base_id>/saved_model "
                                  "(tf_asyncps.export.latest_base(publish_dir)[0])")
        if delta_dir is not None:
            delta_dir = _folder(delta_dir, "delta_dir", "the folder of its delta-N folders, or "
                                "None for the base's parent")
        stamp_path = os.path.join(saved_model_dir, BASE_FILE)
        stamp = read_json(stamp_path)
        if stamp is None:
            raise delta_chain.ChainError(
                f"apply_deltas: {stamp_path} is missing: {saved_model_dir} was not exported by "
                "tf_asyncps.export.DeltaPublisher (its deltas name the base they apply to).")
        self.base_id = str(stamp["base_id"])
        self.delta_dir = delta_dir or os.path.dirname(os.path.abspath(saved_model_dir))
        self.model = tf.saved_model.load(saved_model_dir)
        self._vars: List = list(getattr(self.model, "variables", None) or [])
        if len(self._vars) != int(stamp["variables"]):
            raise delta_chain.ChainError(
                f"apply_deltas: {saved_model_dir} keeps {len(self._vars)} variables in its "
                f"`variables` list, the publisher's model had {stamp['variables']}; export with "
                "tf.saved_model.save (tf_keras) or model.export (Keras 3).")
        self.applied = 0
        self._index = {}  # table key -> [the loaded id -> row map of each shard]
        for key, paths in (stamp.get("dynamic_index_paths") or {}).items():
            found = [saved_model_compat.object_at(self.model, p) for p in paths]
            missing = [p for p, obj in zip(paths, found) if obj is None]
            if missing:
                raise delta_chain.ChainError(
                    f"apply_deltas: {saved_model_dir} holds no {missing[0]} (a "
                    "DynamicEmbedding's id -> row map the publisher's model had); load the "
                    "SavedModel its DeltaPublisher exported.")
            self._index[key] = found

    def refresh(self, upto: Optional[int] = None) -> int:
        """Applies the deltas after the last one applied (up to sequence
        ``upto``, default all); returns the sequence number reached.

        Raises:
          delta_chain.ChainError: a gap, a duplicate, a delta of another base,
            a missing or truncated file (names it).
        """
        folders = [os.path.join(self.delta_dir, n) for n in sorted(os.listdir(self.delta_dir))
                   if _DELTA.match(n)]
        chain = delta_chain.read_chain(folders, self.base_id, kind=_KIND)
        for folder, meta in chain[self.applied:upto]:
            self._apply(folder, meta)
            self.applied = int(meta["seq"])
        return self.applied

    def _apply(self, folder: str, meta: dict) -> None:
        # Any variable may hold a table's rows (by global row) or a whole value.
        tables = {f"v{i}": [(shard, {}, first) for shard, first in
                            zip(delta_chain.shards_of(_value(v)),
                                _offsets(delta_chain.shards_of(_value(v))))]
                  for i, v in enumerate(self._vars)}
        dense = {f"v{i}": _value(v) for i, v in enumerate(self._vars)}
        dynamic = {key: (lambda arrays, where, key=key: self._apply_dynamic(
                             key, tables[key], arrays))
                   for key in self._index}
        delta_chain.apply_delta(folder, meta, tables, dense, dynamic)

    def _apply_dynamic(self, key, parts, arrays) -> None:
        """A dynamic table's serving delta: its evicted ids leave every
        shard's map, then each written id maps to its row (on the shard that
        holds the row) and the row takes its values."""
        indexes = self._index[key]
        tombs = dynamic_deltas.decode_keys(arrays, "tomb:")
        keys = dynamic_deltas.decode_keys(arrays, "key:")
        dtype = tf.string if keys.dtype == object or tombs.dtype == object else tf.int64
        rows = arrays["ids"]
        sizes = arrays["shards"][:, 0]
        if len(sizes) != len(indexes):
            raise delta_chain.ChainError(
                f"apply_deltas: a delta of {key} holds {len(sizes)} shards, the SavedModel "
                f"{len(indexes)} id -> row maps; apply the stream to its own base.")
        first = np.cumsum(np.concatenate([[0], sizes]))[:-1]
        for j, index in enumerate(indexes):
            handle = index.resource_handle
            if len(tombs):
                tf.raw_ops.LookupTableRemoveV2(table_handle=handle,
                                               keys=tf.constant(tombs, dtype))
            here = (rows >= first[j]) & (rows < first[j] + sizes[j])
            if here.any():
                tf.raw_ops.LookupTableInsertV2(table_handle=handle,
                                               keys=tf.constant(keys[here], dtype),
                                               values=tf.constant(rows[here], tf.int64))
        for var, _, start in parts:
            here = (rows >= start) & (rows < start + int(var.shape[0]))
            if here.any():
                var.scatter_update(tf.IndexedSlices(tf.constant(arrays["values"][here]),
                                                    tf.constant(rows[here] - start)))


def apply_deltas(saved_model_dir: str, delta_dir: Optional[str] = None, upto: Optional[int] = None):
    """The SavedModel at ``saved_model_dir`` (a :class:`DeltaPublisher`'s
    base) loaded with ``tf.saved_model.load`` and brought up to its newest
    delta in ``delta_dir`` (default: the base's parent), or to ``upto``.

    Returns: the loaded object (its endpoints give the chief's predictions
    at the delta's step).

    Raises:
      TypeError, ValueError, delta_chain.ChainError: see :class:`DeltaLoader`.
    """
    loader = DeltaLoader(saved_model_dir, delta_dir)
    loader.refresh(upto)
    return loader.model
