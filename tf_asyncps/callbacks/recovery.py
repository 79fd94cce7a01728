"""Resuming a job after a ps or chief failure, and counting what was redone.

A ps task that dies loses the variables it held; ``ClusterCoordinator`` then
raises on the chief (TensorFlow recovers only worker failures). The job
survives by checkpoints: tf_keras ``BackupAndRestore`` saves the model and
optimizer at every epoch end under ``backup_dir``, and a chief re-run (by
``tf-asyncps launch --restart_failed_tasks``, or by a scheduler re-running
``tf-asyncps train``) restores them and continues from the next epoch.

Checkpoints are never half-written as the latest one: TensorFlow writes the
data shards under a temporary prefix, merges them, and only then rewrites the
``checkpoint`` state file, with an atomic rename. This module writes its own
files the same way (:func:`tf_asyncps.files.atomic_write_json`, re-exported
here).

:class:`ResumeTracker` records, in ``backup_dir/progress.json``, how many
worker steps the current run has completed. A re-run compares that with the
step it resumes from: the difference is the number of steps *redone*.
"""

import os
import threading
from typing import Dict

import tf_keras

from tf_asyncps.compat import keras_models as models_compat
from tf_asyncps.compat import tf_keras as tf_keras_compat
from tf_asyncps.files import atomic_write_json, read_json

__all__ = ["ResumeTracker", "atomic_write_json", "read_json", "PROGRESS_FILE"]

#: The progress record inside ``backup_dir``.
PROGRESS_FILE = "progress.json"


class ResumeTracker(tf_keras.callbacks.Callback):
    """Counts chief runs and redone worker steps across crashes and re-runs.

    Put it before ``tf_keras.callbacks.BackupAndRestore(backup_dir)`` in
    ``model.fit``'s callbacks, so an epoch's steps are recorded before that
    epoch's checkpoint is written. While training it keeps
    ``backup_dir/progress.json`` up to date (every ``period_s`` seconds, at
    every epoch end, and from :meth:`record_failure`) with the worker steps
    completed so far; completed steps are counted on the chief from finished
    closures, so a dead ps cannot stall the record. On a re-run,
    ``steps_redone`` grows by (steps completed before the crash) - (the step
    the restored checkpoint resumes from). When fit ends normally the record
    is removed, as ``BackupAndRestore`` removes its checkpoint.

    Args:
      backup_dir: the ``BackupAndRestore`` directory (str).
      steps_per_epoch: worker steps per epoch (int >= 1).
      steps_per_execution: worker steps per closure (fit's
        ``steps_per_execution``, int >= 1).
      period_s: seconds between progress writes (float > 0).

    Attributes:
      chief_runs: runs of this job so far, this one included (int >= 1).
      resumed_from_step: worker step this run started from (int; 0 if fresh).
      steps_redone: worker steps completed before crashes and redone after
        (int, summed over every restart).
    """

    def __init__(self, backup_dir: str, steps_per_epoch: int, steps_per_execution: int = 1,
                 period_s: float = 1.0):
        super().__init__()
        self.path = os.path.join(backup_dir, PROGRESS_FILE)
        self.steps_per_epoch = int(steps_per_epoch)
        self.steps_per_execution = int(steps_per_execution)
        self.period_s = period_s
        prev = read_json(self.path) or {}
        self._prev_done = int(prev.get("steps_done", 0))
        self._prev_redone = int(prev.get("steps_redone", 0))
        self.chief_runs = int(prev.get("chief_runs", 0)) + 1
        self.resumed_from_step = 0
        self.steps_redone = self._prev_redone
        # (worker steps before the current epoch, closures done at its start),
        # one tuple: the writer thread reads both, the main thread moves both.
        self._epoch_mark = None
        self._started = False
        self._stop = threading.Event()
        self._thread = None
        self._lock = threading.Lock()
        os.makedirs(backup_dir, exist_ok=True)

    @property
    def started(self) -> bool:
        """Whether fit reached its first epoch (the backup, if any, is restored)."""
        return self._started

    def _closures(self) -> int:
        return sum(self.model.distribute_strategy.closures_done_per_worker())

    def steps_done(self) -> int:
        """Worker steps completed up to now (resume point + this run's)."""
        mark = self._epoch_mark
        if mark is None:
            return self.resumed_from_step
        base, closures0 = mark
        in_epoch = (self._closures() - closures0) * self.steps_per_execution
        return base + min(in_epoch, self.steps_per_epoch)

    def _write(self) -> None:
        with self._lock:
            atomic_write_json(self.path, {
                "steps_done": self.steps_done(), "chief_runs": self.chief_runs,
                "resumed_from_step": self.resumed_from_step,
                "steps_redone": self.steps_redone})

    def on_epoch_begin(self, epoch, logs=None):
        if not self._started:  # fit's first epoch is the restored one
            self._started = True
            self.resumed_from_step = epoch * self.steps_per_epoch
            if self.chief_runs > 1:
                self.steps_redone = self._prev_redone + max(
                    0, self._prev_done - self.resumed_from_step)
            self._thread = threading.Thread(target=self._run, daemon=True,
                                            name="ResumeTracker")
            self._thread.start()
        self._epoch_mark = (epoch * self.steps_per_epoch, self._closures())
        self._write()

    def _run(self):
        while not self._stop.wait(self.period_s):
            self._write()

    def on_epoch_end(self, epoch, logs=None):
        self._epoch_mark = ((epoch + 1) * self.steps_per_epoch, self._closures())
        self._write()

    def _halt(self):
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None

    def record_failure(self) -> None:
        """Writes the final progress of a run that is about to fail."""
        self._halt()
        self._write()

    def on_train_end(self, logs=None):
        self._halt()
        if not self._started:
            # No epoch ran: the restored checkpoint is already at or past the
            # last epoch (BackupAndRestore keeps its state on the model).
            saved = tf_keras_compat.checkpoint_saved_epoch(self.model)
            if saved is None and models_compat.is_keras3_model(self.model):
                # Keras 3's BackupAndRestore keeps the next epoch instead.
                nxt = models_compat.initial_epoch(self.model)
                saved = nxt - 1 if nxt else None
            if saved is not None and saved >= 0:
                self.resumed_from_step = (saved + 1) * self.steps_per_epoch
        if os.path.exists(self.path):
            os.remove(self.path)

    def summary(self) -> Dict[str, int]:
        """{"chief_runs", "resumed_from_step", "steps_redone"} (ints)."""
        return {"chief_runs": self.chief_runs, "resumed_from_step": self.resumed_from_step,
                "steps_redone": self.steps_redone}
