"""Backups every N worker steps under parameter-server training, and resuming from them.

tf_keras's ``BackupAndRestore`` skips its batch-level saves under
ParameterServerStrategy: a batch hook runs on the chief when a closure is
*scheduled*, not when it has run, so a save there would catch some updates
half-way and miss others. :class:`StepBackup` saves at a quiet point instead:
it drains the schedule first (``ClusterCoordinator.join()``), so every update
scheduled so far has been applied on the ps tasks and none is in flight.

Layout of ``backup_dir``:

* ``step-<N>/``: one complete backup, N = worker steps of the fit it holds
  (zero-padded): ``ckpt`` (a ``tf.train.Checkpoint`` of the model, its
  optimizer and the strategy's global step) and ``meta.json``. It is written
  as ``.tmp-step-<N>-<pid>/``, ``meta.json`` last, then renamed: a backup
  dir without ``meta.json``, or a temp dir, is never read.
  A delta backup (``kind`` "delta" in its ``meta.json``) holds no
  ``ckpt``: the table rows written since the previous backup, their slot
  rows and every other variable whole (tf_asyncps/callbacks/delta_chain.py);
  it restores on top of its base (``base_id``, a full backup's folder name)
  and the deltas before it.
* ``progress.json``: worker steps done so far, chief runs and steps redone
  (the same record as :class:`tf_asyncps.callbacks.ResumeTracker`'s).
"""

import os
import re
import shutil
import threading
import time
from typing import Dict, List, Optional, Tuple

import tensorflow as tf
import tf_keras
from absl import logging

from tf_asyncps.callbacks import delta_chain, dynamic
from tf_asyncps.callbacks.common import strategy_of
from tf_asyncps.compat import checkpoint as checkpoint_compat
from tf_asyncps.compat import keras_models as models_compat
from tf_asyncps.compat import tf_keras as tf_keras_compat
from tf_asyncps.files import atomic_write_json, read_json
from tf_asyncps.validate import check_int, check_number

__all__ = ["StepBackup", "newest_backup", "META_FILE", "PROGRESS_FILE"]

META_FILE = "meta.json"
PROGRESS_FILE = "progress.json"
_FORMAT = 1
_DIR = re.compile(r"^step-(\d+)$")


def _backups(backup_dir: str) -> List[Tuple[int, str]]:
    """(worker steps, path) of every complete backup in ``backup_dir``, oldest first."""
    out = []
    try:
        names = os.listdir(backup_dir)
    except OSError:
        return out
    for name in names:
        m = _DIR.match(name)
        path = os.path.join(backup_dir, name)
        if m and os.path.isfile(os.path.join(path, META_FILE)):
            out.append((int(m.group(1)), path))
    return sorted(out)


def _kind(path: str) -> str:
    return (read_json(os.path.join(path, META_FILE)) or {}).get("kind", "full")


def _first_line(error: BaseException) -> str:
    """The first line of ``error`` that says what is wrong: not a graph
    error's header, its traceback ("Detected at node", "File ...") or its
    node line."""
    for line in str(error).splitlines():
        line = line.strip()
        if line and not line.startswith(("Graph execution error", "Detected at node", "File ",
                                         "[[")):
            return line
    return ""


def newest_backup(backup_dir: str) -> Optional[Tuple[str, Dict]]:
    """(path, meta) of the newest complete backup in ``backup_dir``, or None.

    Raises:
      ValueError: its ``meta.json`` is unreadable or of another format
        (names the file).
    """
    found = _backups(backup_dir)
    if not found:
        return None
    path = found[-1][1]
    meta = read_json(os.path.join(path, META_FILE))
    # A delta's meta.json carries the delta format (delta_chain.DELTA_FORMAT).
    want = delta_chain.DELTA_FORMAT if (meta or {}).get("kind") == "delta" else _FORMAT
    if meta is None or meta.get("format") != want:
        raise ValueError(f"StepBackup: {os.path.join(path, META_FILE)} is unreadable or not "
                         f"format {_FORMAT}; delete that backup or use a new backup_dir.")
    return path, meta


class StepBackup(tf_keras.callbacks.Callback):
    """Backs ``fit`` up every ``every_steps`` worker steps under
    AsyncParameterServerStrategy, and resumes a re-run from the newest backup,
    mid-epoch.

    For tf_keras ``fit`` and this package's Keras 3 ``fit`` (one object, either
    framework). Where ``BackupAndRestore`` saves per epoch under
    ParameterServerStrategy, this saves every ``every_steps`` worker steps and
    at the end of ``fit``.

    Quiet point: a backup falls due at the end of the first closure whose
    steps reach the next multiple of ``every_steps`` (with
    ``steps_per_execution`` k, backups land on closure boundaries, so the
    interval rounds up to a multiple of k). The chief then calls
    ``ClusterCoordinator.join()``: every scheduled closure has run and its
    update is applied (under a policy with local steps, the copies are
    pushed, as at an epoch end), and nothing new is scheduled until the save
    returns. Cost: the workers idle from their last closure until the save
    ends, i.e. the schedule's tail plus one save.

    Deltas (tf_keras or Keras 3 fit, a model with embedding tables,
    ``full_every`` > 1):
    a full save every ``full_every`` backups, and between them deltas: the
    table rows written since the previous backup with their optimizer slot
    rows (an int8 dirty mark per row beside each table shard, set on the ps
    inside each update from its own row indices, cleared by each save: no
    byte more per step on the wire) and every other variable whole; for a
    DynamicEmbedding also the marked rows' ids, counts and last steps, its
    filter slots and counters, and the ids evicted since (tombstones, kept
    beside each shard until the save reads them; tf_asyncps/dynamic/deltas.py).
    The idea is DeepRec's incremental checkpoint (Alibaba, 2022). A resume
    reads the base and applies the chain, refusing a gap, a duplicate, a
    delta of another base or a half-written file (delta_chain.ChainError,
    naming the file). A model without a table, or a step traced before this
    callback registered its marks (no row marked after steps ran) get full
    saves. A chain restores onto another number of ps tasks (rows by global
    row; a DynamicEmbedding's ids re-homed at the first lookup, as a
    checkpoint's).

    Saved: the model, its optimizer (slots, ``iterations``) and the
    strategy's global step (``strategy.staleness_tracker.global_step``,
    restored so it continues); the fit's position is the backup's worker
    steps N (epoch N // steps_per_epoch, step N % steps_per_epoch). Backups
    are counted in worker steps of the fit, which equal global steps under
    the async policies when no gradient is dropped; ``meta.json`` records
    both.

    Resume: at train begin the newest complete backup is restored and the
    fit starts at its epoch and step; batches are not skipped in the input:
    each worker's iterator starts again, so a re-run reads the data from the
    start unless the dataset skips :attr:`resume_step` batches itself
    (exact with one worker: ``dataset.skip(backup.resume_step)``, known at
    construction, before ``fit`` builds its input). A re-run of a fit that
    ended trains nothing (its last backup is at ``epochs * steps_per_epoch``).
    Steps redone: ``progress.json`` holds the worker steps done before a
    crash (written every ``period_s`` by a writer thread, so also while a
    backup drains the schedule, at each backup and by
    :meth:`record_failure`); a re-run adds (steps done) - (steps of the
    backup it resumes from).

    Args:
      backup_dir: str, the folder (made if missing); one per job.
      every_steps: int >= 1, worker steps between backups.
      full_every: int >= 1, a full save every that many backups, deltas
        between them (1: every backup is full).
      keep: int >= 1, full backups kept with their deltas (older ones are
        removed).
      period_s: float > 0, seconds between ``progress.json`` writes.

    Attributes:
      resume_step: worker steps of the backup a fit resumes from (int, 0 if
        none), read at construction.
      save_function: the tf.function writing full backups (traced once per
        fit), None before the first.
      chief_runs, resumed_from_step, steps_redone: as ResumeTracker's.
      backups: worker steps of each backup this object wrote (list of ints).

    Raises:
      ValueError: a bad argument (names it); at train begin, the model is not
        under AsyncParameterServerStrategy, or is unbuilt, or the backup was
        written with another ``steps_per_epoch``; tf_keras
        ``BackupAndRestore`` in the same fit.
      tf.errors.OpError / AssertionError: the backup does not match the model.
    """

    #: Keras 3 fit (keras3/trainer.py) calls after_closures and fit_resume_point.
    runs_between_closures = True

    def __init__(self, backup_dir, every_steps, full_every=10, keep=2, period_s=1.0):
        super().__init__()
        if not isinstance(backup_dir, (str, os.PathLike)) or not os.fspath(backup_dir):
            raise ValueError(f"StepBackup(backup_dir={backup_dir!r}): give a folder path "
                             "(one per job).")
        if os.path.exists(backup_dir) and not os.path.isdir(backup_dir):
            raise ValueError(f"StepBackup(backup_dir={os.fspath(backup_dir)!r}) is a file, not "
                             "a folder: give a folder path (made if missing), or move the file.")
        # Its batch hook never reads the logs: no wait for each closure.
        tf_keras_compat.keep_batch_logs_remote(self)
        self.backup_dir = os.fspath(backup_dir)
        self.every_steps = check_int(every_steps, "StepBackup(every_steps)", min=1,
                                     below=2**63, hint="worker steps between backups; the "
                                     "global step is an int64")
        self.full_every = check_int(full_every, "StepBackup(full_every)", min=1)
        self.keep = check_int(keep, "StepBackup(keep)", min=1, hint="backups kept")
        self.period_s = check_number(period_s, "StepBackup(period_s)", above=0)
        try:
            os.makedirs(self.backup_dir, exist_ok=True)
        except OSError as e:
            raise ValueError(f"StepBackup(backup_dir={self.backup_dir!r}): cannot make the "
                             f"folder ({e.strerror}); give a folder path you can write.") from e
        self._progress_path = os.path.join(self.backup_dir, PROGRESS_FILE)
        prev = read_json(self._progress_path) or {}
        self._prev_done = int(prev.get("steps_done", 0))
        self._prev_redone = int(prev.get("steps_redone", 0))
        self.chief_runs = int(prev.get("chief_runs", 0)) + 1
        found = newest_backup(self.backup_dir)
        self._resume = found
        self.resume_step = int(found[1]["worker_steps"]) if found else 0
        self.resumed_from_step = 0
        self.steps_redone = self._prev_redone
        self.backups: List[int] = []
        self._started = False
        self._steps_per_epoch = None
        self._epoch = 0
        self._scheduled = 0  # worker steps scheduled so far (fit position)
        self._quiet = (0, 0)  # (worker steps, closures done) at the last quiet point
        self._last_backup = -1
        self._next_backup = self.every_steps
        self._coordinator = None
        # The progress writer: a thread, since the chief schedules a backup
        # interval's closures at once and then waits in the drain.
        self._stop = threading.Event()
        self._writer = None
        self._write_lock = threading.Lock()
        self._strategy = None
        self._deltas = None  # delta_chain.ModelDeltas while deltas are written
        self._base = None  # folder name of the chain's full backup
        self._seq = 0  # deltas written on it
        self._ckpt = None
        self.save_function = None  # the traced checkpoint write (one trace per fit)

    # -- fit position ---------------------------------------------------------
    @property
    def started(self) -> bool:
        """Whether the backup (if any) is restored and fit reached an epoch."""
        return self._started

    def _closures(self) -> int:
        return sum(self._strategy.closures_done_per_worker())

    def steps_done(self) -> int:
        """Worker steps completed up to now (resume point + this run's):
        exact at a quiet point; in between, finished closures times
        ``steps_per_execution``, at most the steps scheduled."""
        if self._strategy is None:
            return self.resumed_from_step
        steps0, closures0 = self._quiet
        per = max(1, self._steps_per_execution())
        return min(self._scheduled, steps0 + (self._closures() - closures0) * per)

    def _steps_per_execution(self) -> int:
        spe = getattr(self.model, "steps_per_execution", None)  # Keras 3
        if spe is None:
            spe = getattr(self.model, "_steps_per_execution", None)  # tf_keras (a variable)
        try:
            return int(spe.numpy()) if hasattr(spe, "numpy") else int(spe or 1)
        except (TypeError, ValueError):
            return 1

    def _write_progress(self) -> None:
        # One writer at a time: a later count must not be replaced by an
        # earlier one read by the other thread.
        with self._write_lock:
            atomic_write_json(self._progress_path, {
                "steps_done": self.steps_done(), "chief_runs": self.chief_runs,
                "resumed_from_step": self.resumed_from_step,
                "steps_redone": self.steps_redone})

    def _write_every_period(self, stop) -> None:
        """The writer thread's loop: ``progress.json`` every ``period_s``
        until ``stop`` (a threading.Event) is set."""
        while not stop.wait(self.period_s):
            self._write_progress()

    def _start_writer(self) -> None:
        self._stop_writer()
        self._stop = threading.Event()
        self._writer = threading.Thread(target=self._write_every_period, args=(self._stop,),
                                        daemon=True, name="StepBackup-progress")
        self._writer.start()

    def _stop_writer(self) -> None:
        self._stop.set()
        if self._writer is not None:
            self._writer.join(timeout=10)
            self._writer = None

    def record_failure(self) -> None:
        """Writes the progress of a run about to fail (steps done so far) and
        stops the progress writer."""
        self._stop_writer()
        if self._started:
            self._write_progress()

    def summary(self) -> Dict[str, int]:
        """{"chief_runs", "resumed_from_step", "steps_redone", "backups"} (ints;
        backups: those this run wrote), for ``metrics.json``'s ``recovery``."""
        return {"chief_runs": self.chief_runs, "resumed_from_step": self.resumed_from_step,
                "steps_redone": self.steps_redone, "backups": len(self.backups)}

    # -- save and restore -----------------------------------------------------
    def _checkpoint(self):
        """The fit's one tf.train.Checkpoint (model, optimizer, global step)."""
        if self._ckpt is None:
            objects = {"model": self.model,
                       "global_step": self._strategy.staleness_tracker.global_step}
            if getattr(self.model, "optimizer", None) is not None:
                objects["optimizer"] = self.model.optimizer
            self._ckpt = tf.train.Checkpoint(**objects)
        return self._ckpt

    def _write_checkpoint(self, prefix: str) -> None:
        """Writes the checkpoint through one traced function per fit. An
        eager ``Checkpoint.write`` over variables of several tasks traces a
        new function per call (TensorFlow's MultiDeviceSaver.save: seconds
        per backup, and its retracing warning); traced once, each backup
        runs the same graph with another prefix."""
        if self.save_function is None:
            ckpt = self._checkpoint()
            self.save_function = tf.function(
                lambda path: ckpt.write(path),
                input_signature=[tf.TensorSpec([], tf.string)], autograph=False)
        self.save_function(tf.constant(prefix))

    def fit_resume_point(self, steps_per_epoch: int) -> Optional[Tuple[int, int]]:
        """(epoch, step in epoch) the fit resumes at, or None for a fresh fit
        (Keras 3 fit reads it after ``on_train_begin``)."""
        if not self.resumed_from_step:
            return None
        return divmod(self.resumed_from_step, int(steps_per_epoch))

    def on_train_begin(self, logs=None):
        self._ckpt, self.save_function = None, None
        self._strategy = strategy_of(self.model)
        self._coordinator = tf.distribute.coordinator.ClusterCoordinator(self._strategy)
        self._steps_per_epoch = int((self.params or {}).get("steps") or 0)
        if self._steps_per_epoch < 1:
            raise ValueError("StepBackup needs fit(steps_per_epoch=N) (worker steps per epoch).")
        if not self.model.built:
            raise ValueError("StepBackup: build the model before fit (call it on a batch, or "
                             "give it an Input), as Keras's BackupAndRestore needs.")
        keras3 = models_compat.is_keras3_model(self.model)
        if self._resume is not None:
            path, meta = self._resume
            if int(meta["steps_per_epoch"]) != self._steps_per_epoch:
                raise ValueError(
                    f"StepBackup: the backup {path} was written with steps_per_epoch="
                    f"{meta['steps_per_epoch']}, this fit has {self._steps_per_epoch}; use the "
                    f"same steps_per_epoch or a new backup_dir.")
            optimizer = getattr(self.model, "optimizer", None)
            # tf_keras builds it first, as BackupAndRestore does; Keras 3's
            # fit has built it per shard already (compat.keras_slots).
            if not keras3 and optimizer is not None and \
                    callable(getattr(optimizer, "build", None)) and \
                    tf_keras_compat.not_built(optimizer):
                optimizer.build(self.model.trainable_variables)
            self._restore(path, meta)
            self.resumed_from_step = int(meta["worker_steps"])
            self.steps_redone = self._prev_redone + max(0, self._prev_done - self.resumed_from_step)
        if self.full_every > 1:
            self._deltas = self._model_deltas()
            if self._deltas is not None:
                with self._strategy.scope():
                    self._deltas.track()
        self._scheduled = self.resumed_from_step
        self._last_backup = self.resumed_from_step
        self._next_backup = (self.resumed_from_step // self.every_steps + 1) * self.every_steps
        self._quiet = (self.resumed_from_step, self._closures())
        if not keras3:
            epoch, step = divmod(self.resumed_from_step, self._steps_per_epoch)
            tf_keras_compat.set_fit_resume_point(self.model, epoch, step)
        self._write_progress()
        self._start_writer()

    def _model_deltas(self):
        """The model's ModelDeltas, or None without a table. Builds the
        optimizer first (in the strategy's scope; tf_keras's build is
        idempotent): its slots must exist to be written and restored."""
        optimizer = getattr(self.model, "optimizer", None)
        keras3 = models_compat.is_keras3_model(self.model)
        # Keras 3's fit builds it (per shard) before train begin.
        if optimizer is not None and callable(getattr(optimizer, "build", None)) and \
                not (keras3 and getattr(optimizer, "built", False)):
            with self._strategy.scope():
                optimizer.build(self.model.trainable_variables)
        try:
            return delta_chain.ModelDeltas(self.model, optimizer,
                                           [self._strategy.staleness_tracker.global_step])
        except ValueError:
            return None

    def _read(self, prefix: str) -> None:
        """Reads the checkpoint at ``prefix``; every object of the fit must
        match one of it, but the id -> row maps of a DynamicEmbedding's
        shards beyond those it was written over (restored onto more ps
        tasks: the table re-homes its ids at the first lookup).

        Raises:
          ValueError: the checkpoint is another model's or optimizer's (a
            variable of another shape, or objects unmatched); names
            backup_dir and the fix.
        """
        try:
            status = self._checkpoint().read(prefix)
            checkpoint_compat.assert_matched_except(status, dynamic.maps_to_rehome(self.model))
        # TensorFlow's words alone name no fix. One process: ValueError (shape)
        # or AssertionError (unmatched); variables on ps tasks: RestoreV2's
        # InvalidArgumentError (shape), its first line "Graph execution error:".
        except (ValueError, AssertionError, tf.errors.InvalidArgumentError) as e:
            first = _first_line(e)
            raise ValueError(
                f"StepBackup: backup_dir={self.backup_dir} holds a backup this model cannot "
                f"restore ({os.path.dirname(prefix)}: {first[:300]}); it is probably from "
                "another model or optimizer. Use a new backup_dir or delete that one.") from None

    def _restore(self, path: str, meta: Dict) -> None:
        """Reads the backup at ``path``: a full one, or a delta's base and chain.

        Raises:
          delta_chain.ChainError: a delta's chain is broken (names the file).
          ValueError: the backup is another model's (names backup_dir and the fix).
        """
        if meta.get("kind", "full") == "full":
            self._read(os.path.join(path, "ckpt"))
            self._base, self._seq = os.path.basename(path), 0
            return
        base = str(meta["base_id"])
        base_path = os.path.join(self.backup_dir, base)
        if _kind(base_path) != "full" or not os.path.isfile(os.path.join(base_path, META_FILE)):
            raise delta_chain.ChainError(
                f"StepBackup: {path} is a delta of {base_path}, which is missing or not a full "
                "backup; delete the deltas of that base or use a new backup_dir.")
        deltas = self._deltas or self._model_deltas()  # slots made before the read
        self._read(os.path.join(base_path, "ckpt"))
        chain = [p for n, p in _backups(self.backup_dir)
                 if n <= int(meta["worker_steps"]) and _kind(p) == "delta"
                 and (read_json(os.path.join(p, META_FILE)) or {}).get("base_id") == base]
        if deltas is None:
            raise delta_chain.ChainError(f"StepBackup: {path} is a delta but the model has no "
                                         "embedding table; use the model that wrote it.")
        self._seq = deltas.restore(chain, base)
        self._base = base

    def on_epoch_begin(self, epoch, logs=None):
        if not self._started:
            self._started = True
            if not models_compat.is_keras3_model(self.model) and \
                    not tf_keras_compat.fit_resume_point_taken(self.model):
                raise ValueError("StepBackup and tf_keras BackupAndRestore both resume the "
                                 "fit: pass one of them.")
        self._epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        # tf_keras: ``batch`` is the index of the closure's last step.
        self.after_closures(self._epoch, batch + 1)

    def after_closures(self, epoch: int, steps_in_epoch: int) -> None:
        """Called on the chief after each closure is scheduled: ``steps_in_epoch``
        worker steps of epoch ``epoch`` are scheduled. Backs up when due."""
        self._scheduled = epoch * self._steps_per_epoch + int(steps_in_epoch)
        if self._scheduled >= self._next_backup:
            self.backup_now()

    def backup_now(self) -> str:
        """Drains the schedule and writes a backup of the fit's position;
        returns its folder (the newest one already, if no step ran since)."""
        self._coordinator.join()
        steps = self._scheduled
        self._quiet = (steps, self._closures())
        self._next_backup = (steps // self.every_steps + 1) * self.every_steps
        final = os.path.join(self.backup_dir, f"step-{steps:012d}")
        if steps == self._last_backup and os.path.isdir(final):
            return final
        global_step = int(self._strategy.staleness_tracker.global_step.numpy())
        meta = {"format": _FORMAT, "worker_steps": steps,
                "steps_per_epoch": self._steps_per_epoch, "global_step": global_step,
                "time": time.time()}
        if self._delta_due(steps):
            self._seq += 1
            self._deltas.write(final, base_id=self._base, seq=self._seq, extra=meta)
        else:
            self._write_full(final, steps, meta)
        self._last_backup = steps
        self.backups.append(steps)
        self._prune()
        self._write_progress()
        return final

    def _delta_due(self, steps: int) -> bool:
        if self._deltas is None or self._base is None or self._seq + 1 >= self.full_every:
            return False
        if steps > self._last_backup and not self._deltas.any_dirty():
            logging.warning("StepBackup: no table row was marked in %d steps (the step was "
                            "traced before the marks existed); full saves from now on.",
                            steps - self._last_backup)
            self._deltas = None
            return False
        return True

    def _write_full(self, final: str, steps: int, meta: Dict) -> None:
        tmp = os.path.join(self.backup_dir, f".tmp-step-{steps:012d}-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        self._write_checkpoint(os.path.join(tmp, "ckpt"))
        atomic_write_json(os.path.join(tmp, META_FILE), dict(meta, kind="full"))
        if os.path.isdir(final):  # a backup of these steps from an earlier run
            shutil.rmtree(final)
        os.rename(tmp, final)
        if self._deltas is not None:  # rows, filter marks, tombstones
            self._deltas.clear()
        self._base, self._seq = os.path.basename(final), 0

    def _prune(self) -> None:
        """Removes every backup older than the ``keep``-th newest full one."""
        found = _backups(self.backup_dir)
        fulls = [i for i, (_, path) in enumerate(found) if _kind(path) == "full"]
        if len(fulls) > self.keep:
            for _, old in found[:fulls[-self.keep]]:
                shutil.rmtree(old, ignore_errors=True)

    def on_train_end(self, logs=None):
        if self._strategy is None:
            return
        if self._scheduled > self._last_backup:
            self.backup_now()
        else:
            self._write_progress()
        self._stop_writer()
        if not models_compat.is_keras3_model(self.model):
            tf_keras_compat.set_fit_resume_point(self.model, None)
