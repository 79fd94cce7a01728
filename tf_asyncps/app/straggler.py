"""Straggler injection for benchmarks and tests.

Two ways to slow one chosen worker:

* :func:`slow_dataset_fn`: a fixed delay per worker step, added to the input
  pipeline of the worker with a given index (a tf.data sleep that runs on
  that worker only: deterministic, no signals, works on remote hosts).
* :class:`StopContCycler`: SIGSTOP/SIGCONT cycles of a worker process (local
  processes only), a whole-process pause as on an overloaded host.
"""

import numbers
import os
import signal
import threading
from typing import Callable

from tf_asyncps.validate import check_int, check_number

__all__ = ["slow_dataset_fn", "StopContCycler"]

_MAX_DELAY_MS = 3600e3


def slow_dataset_fn(dataset_fn: Callable, slow_worker: int, delay_ms: float) -> Callable:
    """Wraps a per-worker ``dataset_fn(input_context)`` so that the worker with
    index ``slow_worker`` waits ``delay_ms`` before each element (one element =
    one worker step's batch).

    Args:
      dataset_fn: the per-worker dataset function (as for ``DatasetCreator``).
      slow_worker: index of the worker to slow (int >= 0); other workers get
        no delay. The index is read on the worker when its dataset is built.
      delay_ms: delay per element in milliseconds (0 <= delay_ms <= one hour).
        An index with no worker slows nothing.

    Returns:
      A dataset function of the same signature.

    Raises:
      ValueError: a negative ``slow_worker`` or ``delay_ms``.
    """
    if not callable(dataset_fn):
        raise ValueError(f"dataset_fn must be a function of the input context, got "
                         f"{dataset_fn!r}.")
    slow_worker = check_int(slow_worker, "slow_worker", min=0, hint="a worker index")
    delay_ms = check_number(delay_ms, "delay_ms", min=0, max=_MAX_DELAY_MS,
                            hint="milliseconds; one hour at most")

    def wrapped(input_context):
        import tensorflow as tf
        from tf_asyncps.compat import data as data_compat
        ds = dataset_fn(input_context)
        me = tf.cast(tf.distribute.coordinator.experimental_get_current_worker_index(),
                     tf.int64)
        delay_us = tf.where(tf.equal(me, slow_worker),
                            tf.constant(int(delay_ms * 1000), tf.int64),
                            tf.constant(0, tf.int64))
        return ds.apply(data_compat.dataset_sleep(delay_us))

    return wrapped


class StopContCycler:
    """Pauses a process with SIGSTOP for ``stop_s`` every ``period_s`` seconds.

    Use as a context manager; on exit (also on error) the process is always
    continued with SIGCONT.

    Args:
      pid: the worker process id (int).
      stop_s: seconds stopped per cycle (float > 0).
      period_s: cycle length in seconds (float > stop_s).

    Raises:
      ValueError: a pid that is not a running process other than this one
        (0 or negative would signal process groups), or bad timings.
    """

    def __init__(self, pid: int, stop_s: float, period_s: float):
        check_int(pid, "pid", min=1, hint="a process id; 0 and negative values would "
                  "signal whole process groups")
        if pid == os.getpid():
            raise ValueError("pid is this process: it would stop itself and never resume.")
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            raise ValueError(f"pid {pid} is not a running process.") from None
        if not all(isinstance(v, numbers.Real) and not isinstance(v, bool)
                   for v in (stop_s, period_s)) or not 0 < stop_s < period_s:
            raise ValueError(f"need numbers 0 < stop_s < period_s (seconds), got "
                             f"stop_s={stop_s!r}, period_s={period_s!r}.")
        pid = int(pid)
        self.pid, self.stop_s, self.period_s = pid, stop_s, period_s
        self.cycles = 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._done.is_set():
            try:
                os.kill(self.pid, signal.SIGSTOP)
            except ProcessLookupError:
                return
            self.cycles += 1
            self._done.wait(self.stop_s)
            try:
                os.kill(self.pid, signal.SIGCONT)
            except ProcessLookupError:
                return
            self._done.wait(self.period_s - self.stop_s)

    def __enter__(self) -> "StopContCycler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join(timeout=self.period_s + 5)
        try:
            os.kill(self.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
