"""A lock on a parameter server with a bounded wait: the update lock.

TensorFlow has no lock with a timeout (``tf.CriticalSection`` waits forever),
so this one is a one-token ``FIFOQueue`` on the PS: acquiring dequeues the
token (blocking, no spinning), releasing enqueues it. A watchdog thread on the
chief fails the wait with a clear error when nobody has acquired the lock for
``timeout_s`` seconds while steps wait for it.

Deadlock freedom: like ``CriticalSection``, the token is taken only after all
inputs of the locked region (the gradients, the read step) are computed, and
the region is placed on the PS, so a worker that dies cannot hold the lock.
"""

import threading
import time
from typing import Callable, Optional, Sequence

import tensorflow as tf
from absl import logging

__all__ = ["PSLock"]


def run_collecting_ops(fn: Callable, *args):
    """Runs ``fn(*args)``; returns (result, ops it created in this graph)."""
    if tf.executing_eagerly():
        return fn(*args), []
    graph = tf.compat.v1.get_default_graph()
    before = len(graph.get_operations())
    result = fn(*args)
    return result, graph.get_operations()[before:]


class PSLock:
    """A mutual-exclusion lock living on ``device`` (a PS CPU).

    Args:
      device: where the token queue and its counters live.
      timeout_s: seconds the lock may go unacquired while steps wait for it
        before training fails with TimeoutError (float > 0).
      name: used in variable names and error messages.

    Raises:
      ValueError: timeout_s <= 0.
    """

    def __init__(self, device: str, timeout_s: float = 60.0, name: str = "update_lock"):
        if not (isinstance(timeout_s, (int, float)) and timeout_s > 0):
            raise ValueError(f"{name}: timeout_s must be > 0 seconds, got {timeout_s!r}.")
        self.device = device
        self.timeout_s = float(timeout_s)
        self.name = name
        self.timeout_error: Optional[str] = None
        with tf.init_scope(), tf.device(device):
            self._queue = tf.queue.FIFOQueue(1, [tf.int64], shapes=[[]],
                                             name=f"asyncps_{name}")
            self._queue.enqueue(tf.constant(0, tf.int64))
            # [steps waiting to acquire, acquisitions so far]
            self._stats = tf.Variable(tf.zeros([2], tf.int64), trainable=False,
                                      name=f"asyncps_{name}_stats")
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def acquisitions(self) -> int:
        """How many times the lock was taken (read from the PS)."""
        return int(self._stats.numpy()[1])

    def execute(self, fn: Callable, inputs: Sequence = ()):
        """Runs ``fn()`` holding the lock; ``inputs`` are computed first.

        Returns what ``fn`` returns (a tensor or nest of tensors), available
        after the lock is released.
        """
        self._start_watchdog()
        deps = [t for t in tf.nest.flatten(inputs)
                if isinstance(t, (tf.Tensor, tf.Operation))]
        with tf.device(self.device):
            with tf.control_dependencies(deps):
                wait = self._stats.scatter_add(tf.IndexedSlices(
                    tf.constant([1], tf.int64), tf.constant([0], tf.int64)))
            with tf.control_dependencies([wait]):
                token = self._queue.dequeue()
            with tf.control_dependencies([token]):
                took = self._stats.scatter_add(tf.IndexedSlices(
                    tf.constant([-1, 1], tf.int64), tf.constant([0, 1], tf.int64)))
        with tf.control_dependencies([took]):
            result, created = run_collecting_ops(fn)
        outs = [t for t in tf.nest.flatten(result) if isinstance(t, tf.Tensor)]
        with tf.device(self.device), tf.control_dependencies(created + outs):
            release = self._queue.enqueue(token)
        with tf.control_dependencies([release]):
            return tf.nest.map_structure(
                lambda t: tf.identity(t) if isinstance(t, tf.Tensor) else t, result)

    # -- watchdog (chief side) ------------------------------------------------
    def _start_watchdog(self):
        if self._thread is None:
            self._thread = threading.Thread(target=self._watch, daemon=True,
                                            name=f"asyncps-{self.name}-watchdog")
            self._thread.start()

    def _watch(self):
        last, since = None, time.monotonic()
        while not self._stop.wait(0.5):
            try:
                waiting, taken = (int(v) for v in self._stats.numpy())
            except Exception:  # cluster gone
                return
            if taken != last or waiting <= 0:
                last, since = taken, time.monotonic()
                continue
            if time.monotonic() - since > self.timeout_s:
                self.timeout_error = (
                    f"{self.name}: {waiting} step(s) waited more than {self.timeout_s:.0f} s "
                    "(timeout_s) for the update lock on the parameter server, which no "
                    "step released. Is the parameter server overloaded or stuck? Raise "
                    "timeout_s (LockingOptimizer(..., timeout_s=...)) or check the ps log.")
                logging.error(self.timeout_error)
                self._queue.close(cancel_pending_enqueues=True)
                return

    def stop(self):
        self._stop.set()
