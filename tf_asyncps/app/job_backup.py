"""The jobs' backups: ``--backup_dir`` and ``--backup_every_steps`` as fit
callbacks, and what a failed or resumed run reports. Both jobs (``job.py``,
``ctr_job.py``) call :class:`JobBackup`; the callbacks themselves are
``tf_asyncps.callbacks`` (``StepBackup``, ``ResumeTracker``).
"""

import os
from typing import Any, Dict, List, Optional

import tensorflow as tf

from tf_asyncps import callbacks as callbacks_lib
from tf_asyncps.callbacks import recovery

__all__ = ["JobBackup"]


class JobBackup:
    """The backup callbacks of one job run, or none without ``backup_dir``.

    ``every_steps`` > 0: ``tf_asyncps.callbacks.StepBackup(backup_dir,
    every_steps)`` (a backup every that many worker steps at a drained point,
    full saves and deltas between them; resumes mid-epoch). ``every_steps``
    0: ``ResumeTracker`` then Keras's ``BackupAndRestore`` (epoch-end
    checkpoints; the tracker records an epoch's steps before that epoch's
    checkpoint is written, so a crash during the save counts the epoch as
    redone).

    Args:
      backup_dir: str or None (None: no backups, :attr:`callbacks` empty).
      every_steps: int >= 0, worker steps between backups (0: epoch ends).
      steps_per_epoch, steps_per_execution: fit's (ints >= 1).
      keras: the Keras module of the model (tf_keras or keras).

    Attributes:
      callbacks: the fit callbacks to add (list, in order).
      tracker: the StepBackup or ResumeTracker (None without backup_dir).
      resume_step: worker steps of the backup the run resumes from, known
        before fit builds its input (StepBackup's ``resume_step``); 0 for a
        fresh run and for epoch checkpoints (restored inside fit).
    """

    def __init__(self, backup_dir: Optional[str], every_steps: int, steps_per_epoch: int,
                 steps_per_execution: int, keras):
        self.backup_dir = backup_dir
        self.callbacks: List[Any] = []
        self.tracker = None
        self.resume_step = 0
        if backup_dir and every_steps:
            self.tracker = callbacks_lib.StepBackup(backup_dir, every_steps)
            self.resume_step = self.tracker.resume_step
            self.callbacks = [self.tracker]
        elif backup_dir:
            self.tracker = recovery.ResumeTracker(backup_dir, steps_per_epoch,
                                                  steps_per_execution)
            self.callbacks = [self.tracker, keras.callbacks.BackupAndRestore(backup_dir)]

    def failed(self, error: BaseException, total: int, say) -> None:
        """Called with the error that stopped fit (the caller re-raises it).
        After a step ran: records the progress (steps redone on the re-run)
        and says where a re-run resumes. Before any step, when restoring an
        epoch checkpoint failed: raises a ValueError naming --backup_dir
        and the fix (a re-run would fail the same way).

        Raises:
          ValueError: the checkpoint in --backup_dir is another model's.
        """
        t = self.tracker
        if t is None:
            return
        if t.started:
            t.record_failure()
            say(f"training failed after {t.steps_done()} of {total} worker steps; "
                f"a re-run resumes from the latest checkpoint in {self.backup_dir}")
        elif isinstance(t, recovery.ResumeTracker) and \
                isinstance(error, (tf.errors.OpError, ValueError)) and \
                any(w in str(error).lower() for w in ("restore", "checkpoint")) and \
                tf.train.latest_checkpoint(os.path.join(self.backup_dir, "chief")):
            first = (getattr(error, "message", None) or str(error)).strip().splitlines()[0]
            raise ValueError(
                f"--backup_dir={self.backup_dir} holds a checkpoint this job cannot "
                f"restore ({first[:300]}); it is probably from another model or "
                "optimizer. Use a new --backup_dir or delete that one.") from None

    def resumed(self, total: int, epochs: int, say) -> int:
        """After fit: says that nothing was trained (the backup was at the
        end already) or where the run resumed; returns the worker step it
        resumed from (0 without backups)."""
        t = self.tracker
        if t is None:
            return 0
        if not t.started:
            say(f"warning: the checkpoint in --backup_dir={self.backup_dir} is already at "
                f"worker step {t.resumed_from_step} of {total} (--epochs={epochs}): nothing "
                "was trained; the model is the checkpoint's. Raise --epochs or use a new "
                "--backup_dir.")
        if t.chief_runs > 1:
            say(f"resumed at worker step {t.resumed_from_step} (chief run {t.chief_runs}); "
                f"{t.steps_redone} worker steps redone in all")
        return t.resumed_from_step

    def summary(self) -> Optional[Dict[str, int]]:
        """metrics.json's ``recovery``: the tracker's summary, None without backups."""
        return self.tracker.summary() if self.tracker is not None else None
