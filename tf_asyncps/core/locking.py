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

import time
from typing import Callable, Sequence

import tensorflow as tf

from tf_asyncps.core import placement
from tf_asyncps.core.watchdog import Watchdog
from tf_asyncps.validate import check_number

__all__ = ["PSLock", "run_collecting_ops"]


def run_collecting_ops(fn: Callable, *args):
    """Runs ``fn(*args)``; returns (result, ops it created in this graph)."""
    if tf.executing_eagerly():
        return fn(*args), []
    graph = tf.compat.v1.get_default_graph()
    before = len(graph.get_operations())
    result = fn(*args)
    return result, graph.get_operations()[before:]


class PSLock(Watchdog):
    """A mutual-exclusion lock living on ``device`` (a PS CPU), and its watchdog.

    Args:
      device: where the token queue and its counters live.
      timeout_s: seconds the lock may go unacquired while steps wait for it
        before training fails with TimeoutError (float > 0).
      name: used in variable names and error messages.
      anchor: a variable on ``device``; the counters are colocated with it
        (inside a ParameterServerStrategy scope ``tf.device`` alone is
        overridden by its round-robin placement).

    Raises:
      ValueError: timeout_s <= 0.
    """

    def __init__(self, device: str, timeout_s: float = 60.0, name: str = "update_lock",
                 anchor=None):
        check_number(timeout_s, f"{name}: timeout_s", above=0, hint="seconds")
        super().__init__(f"asyncps-{name}")
        self.device = device
        self.timeout_s = float(timeout_s)
        self.lock_name = name
        with tf.init_scope(), tf.device(device):
            self._queue = placement.fifo_queue(1, f"asyncps_{name}")
            self._queue.enqueue(tf.constant(0, tf.int64))
        with tf.init_scope(), (placement.beside(anchor) if anchor is not None
                               else tf.device(device)):
            # [steps waiting to acquire, acquisitions so far]
            self._stats = tf.Variable(tf.zeros([2], tf.int64), trainable=False,
                                      name=f"asyncps_{name}_stats")

    def acquisitions(self) -> int:
        """How many times the lock was taken (read from the PS)."""
        return int(self._stats.numpy()[1])

    def execute(self, fn: Callable, inputs: Sequence = ()):
        """Runs ``fn()`` holding the lock; ``inputs`` are computed first.

        Returns what ``fn`` returns (a tensor or nest of tensors), available
        after the lock is released.
        """
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
    def reset(self):
        self._last, self._since = None, time.monotonic()

    def poll(self) -> bool:
        waiting, taken = (int(v) for v in self._stats.numpy())
        if taken != self._last or waiting <= 0:
            self._last, self._since = taken, time.monotonic()
            return False
        if time.monotonic() - self._since <= self.timeout_s:
            return False
        self.fail(
            f"{self.lock_name}: {waiting} step(s) waited more than {self.timeout_s:.0f} s "
            "(timeout_s) for the update lock on the parameter server, which no "
            "step released. Is the parameter server overloaded or stuck? Raise "
            "timeout_s (LockingOptimizer(..., timeout_s=...)) or check the ps log.")
        self.abort()
        return True

    def abort(self):
        self._queue.close(cancel_pending_enqueues=True)
