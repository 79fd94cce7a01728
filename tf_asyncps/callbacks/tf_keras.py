"""tf_keras callbacks that report staleness while ``model.fit`` runs.

Both read the PS counters directly (``strategy.staleness_stats()``), which
does not wait for scheduled steps: reporting never forces a training sync.
"""

import os
import sys
import threading
import time
from typing import Callable, Optional, TextIO

import tensorflow as tf
import tf_keras
from absl import logging

from tf_asyncps.callbacks.common import format_value, plain_value, strategy_of
from tf_asyncps.validate import check_number

__all__ = ["StalenessLogger", "ProgressLine"]


class StalenessLogger(tf_keras.callbacks.Callback):
    """Prints one line per epoch and writes TensorBoard summaries.

    Per epoch: ``epoch 3/10: loss=0.41 accuracy=0.89 steps/s=212.4
    examples/s=6797 tau_mean=0.61 tau_max=4 dropped=0``, where steps are
    worker steps (applied + dropped gradients) in that epoch and τ is counted
    over the epoch's applied gradients. With ``log_dir``, scalars
    ``staleness/mean``, ``staleness/max``, ``staleness/applied``,
    ``staleness/dropped``, ``throughput/steps_per_sec`` and the epoch's logs,
    plus a ``staleness/histogram`` per epoch; with ``every_n_seconds``, a
    background thread also writes ``staleness/global_step`` and
    ``staleness/mean`` at that period (units: seconds).

    Args:
      log_dir: TensorBoard directory or None.
      every_n_seconds: period of the background summaries (float > 0) or None.
      batch_size: examples per worker step, for examples/s (int) or None.
      print_fn: where epoch lines go. Default: stdout (flushed), unless the
        fit runs with ``verbose=0`` (then no line); a ``print_fn`` you pass
        gets every epoch's line whatever ``verbose`` says.

    Attributes:
      epochs: list of per-epoch dicts (epoch, steps, seconds, steps_per_sec,
        tau_mean and tau_max of the epoch, tau_max_so_far, applied, dropped,
        closures_per_worker (closures each worker completed so far, by
        worker index: a worker that stalls or rejoins shows here) and the
        epoch's logs).
      polls: (unix time, global step, running τ mean) per background poll.
    """

    def __init__(self, log_dir: Optional[str] = None,
                 every_n_seconds: Optional[float] = None,
                 batch_size: Optional[int] = None,
                 print_fn: Optional[Callable[[str], None]] = None):
        super().__init__()
        if log_dir is not None and not isinstance(log_dir, (str, os.PathLike)):
            raise ValueError(f"log_dir must be a directory path or None, got {log_dir!r}.")
        if every_n_seconds is not None:
            check_number(every_n_seconds, "every_n_seconds", above=0, hint="seconds, or None")
        self.log_dir = log_dir
        self.every_n_seconds = every_n_seconds
        self.batch_size = batch_size
        self._print_always = print_fn is not None
        self.print_fn = print_fn or (lambda s: print(s, flush=True))
        self.epochs = []
        self.polls = []  # (unix time, global step, running τ mean)
        self._writer = None
        self._stop = threading.Event()
        self._thread = None

    def on_train_begin(self, logs=None):
        self._strategy = strategy_of(self.model)
        if self.log_dir:
            self._writer = tf.summary.create_file_writer(self.log_dir)
        if self.every_n_seconds:
            self._stop.clear()
            self._thread = threading.Thread(target=self._poll, daemon=True,
                                            name="StalenessLogger")
            self._thread.start()

    def _poll(self):
        while not self._stop.wait(self.every_n_seconds):
            s = self._strategy.staleness_stats()
            self.polls.append((time.time(), s.global_step, s.mean))
            if self._writer:
                with self._writer.as_default(step=s.global_step):
                    tf.summary.scalar("staleness/global_step", s.global_step)
                    tf.summary.scalar("staleness/mean_running", s.mean)

    def on_epoch_begin(self, epoch, logs=None):
        self._t0 = time.perf_counter()
        self._s0 = self._strategy.staleness_stats()

    def on_epoch_end(self, epoch, logs=None):
        logs = logs or {}
        s = self._strategy.staleness_stats()
        dt = time.perf_counter() - self._t0
        s0 = self._s0
        applied = s.applied - s0.applied
        dropped = s.dropped - s0.dropped
        steps = s.worker_steps - s0.worker_steps  # local steps under local_sgd
        tau_sum = s.mean * s.applied - s0.mean * s0.applied
        hist = s.histogram - s0.histogram
        nz = [i for i, c in enumerate(hist) if c]
        rec = {
            "epoch": epoch + 1, "steps": steps, "seconds": dt,
            "steps_per_sec": steps / dt if dt > 0 else 0.0,
            "tau_mean": max(0.0, tau_sum / applied) if applied else 0.0,
            # This epoch's largest tau (histogram bin; the last bin is ">=").
            "tau_max": nz[-1] if nz else 0,
            "tau_max_so_far": s.max, "applied": applied, "dropped": dropped,
            "closures_per_worker": list(self._strategy.closures_done_per_worker()),
        }
        rec.update({k: plain_value(v) for k, v in logs.items()})
        self.epochs.append(rec)
        total = self.params.get("epochs", "?") if self.params else "?"
        metrics = " ".join(f"{k}={format_value(v)}" for k, v in logs.items())
        eps = (f" examples/s={rec['steps_per_sec'] * self.batch_size:.0f}"
               if self.batch_size else "")
        if self._print_always or (self.params or {}).get("verbose", 1) != 0:
            self.print_fn(
                f"epoch {epoch + 1}/{total}: {metrics} steps/s={rec['steps_per_sec']:.1f}"
                f"{eps} tau_mean={rec['tau_mean']:.2f} tau_max={rec['tau_max']}"
                f" dropped={dropped}")
        if self._writer:
            with self._writer.as_default(step=epoch + 1):
                for k, v in logs.items():
                    v = plain_value(v)
                    if isinstance(v, list):  # a vector metric: one scalar per entry
                        for i, x in enumerate(v):
                            tf.summary.scalar(f"epoch/{k}/{i}", x)
                    else:
                        tf.summary.scalar(f"epoch/{k}", v)
                tf.summary.scalar("staleness/mean", rec["tau_mean"])
                tf.summary.scalar("staleness/max", rec["tau_max"])
                tf.summary.scalar("staleness/applied", applied)
                tf.summary.scalar("staleness/dropped", dropped)
                tf.summary.scalar("throughput/steps_per_sec", rec["steps_per_sec"])
                # One sample per applied gradient, binned by τ.
                tf.summary.histogram(
                    "staleness/histogram",
                    tf.repeat(tf.range(len(hist), dtype=tf.float32),
                              tf.constant(hist, tf.int32)),
                    buckets=len(hist))
            self._writer.flush()

    def on_train_end(self, logs=None):
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self._writer:
            self._writer.close()  # its file and thread; a next fit opens another
            self._writer = None


class ProgressLine(tf_keras.callbacks.Callback):
    """A live one-line progress display fed by polling the PS global step.

    Shows ``steps done/total, steps/s, τ mean`` every ``period_s`` seconds,
    rewriting one terminal line. Only draws when ``stream`` is a terminal
    (or ``force=True``), so logs and CI output stay clean.

    Args:
      total_steps: worker steps the fit will run (epochs * steps_per_epoch).
      period_s: refresh period in seconds (float > 0).
      stream: where to draw (default sys.stderr).
      force: draw even when ``stream`` is not a terminal.
    """

    def __init__(self, total_steps: int, period_s: float = 0.5,
                 stream: Optional[TextIO] = None, force: bool = False):
        super().__init__()
        self.total_steps = int(total_steps)
        self.period_s = period_s
        self.stream = stream or sys.stderr
        self.enabled = force or (hasattr(self.stream, "isatty") and self.stream.isatty())
        self._stop = threading.Event()
        self._thread = None
        self.draws = 0
        self.error: Optional[Exception] = None  # what stopped the drawing, if anything

    def on_train_begin(self, logs=None):
        if not self.enabled:
            return
        self._strategy = strategy_of(self.model)
        self._base = self._strategy.staleness_stats().worker_steps
        self._t0 = time.perf_counter()
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name="ProgressLine")
        self._thread.start()

    def _draw(self):
        s = self._strategy.staleness_stats()
        done = s.worker_steps - self._base
        dt = max(time.perf_counter() - self._t0, 1e-9)
        self.stream.write(
            f"\r  steps {done}/{self.total_steps}  {done / dt:7.1f} steps/s  "
            f"tau_mean {s.mean:5.2f}   ")
        self.stream.flush()
        self.draws += 1

    def _run(self):
        while not self._stop.wait(self.period_s):
            try:
                self._draw()
            except Exception as e:  # noqa: BLE001 - a display must not end the fit
                # Often the cluster going away at the end; said, not swallowed.
                self.error = e
                logging.warning("ProgressLine stopped drawing: %s: %s", type(e).__name__, e)
                return

    def on_epoch_end(self, epoch, logs=None):
        if self.enabled:
            self.stream.write("\r" + " " * 70 + "\r")
            self.stream.flush()

    def on_train_end(self, logs=None):
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self.stream.write("\r" + " " * 70 + "\r")
            self.stream.flush()
