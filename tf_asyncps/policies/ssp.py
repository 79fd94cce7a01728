"""``ssp``: Stale Synchronous Parallel (bounded staleness between workers).

Rule: every worker has a clock c_w, the number of its steps whose update was
applied or dropped. A worker may start a step (read the model) only while
c_w − min_j c_j <= s; otherwise it waits for the slowest worker. s = 0 makes
bulk-synchronous rounds. Ho et al., "More Effective Distributed ML via a Stale
Synchronous Parallel Parameter Server" (NIPS 2013).

How the wait works (no spinning): each worker owns a token queue on the PS,
filled with s + 1 tokens. Starting a step dequeues one token (blocking when
empty); whenever the slowest clock advances, every queue gets one more token.
So a worker holds s + 1 + min_j c_j − c_w tokens, which is >= 1 exactly when
the rule lets it start. A watchdog thread on the chief fails the wait after
``timeout_s`` seconds without progress of the slowest worker, with an error
naming the clocks (a dead or paused worker otherwise stalls everyone).

End of a schedule: ClusterCoordinator hands closures to whichever worker is
free, so when the last closures are taken by fast workers the slowest worker
may have nothing left to run. The watchdog then releases the waiting workers
(one token each) once the coordinator has no queued closures; such reads are
counted in ``released_reads`` and are not part of ``max_clock_spread``.

When to use: workers of uneven speed where unbounded staleness hurts
convergence, but full synchrony costs too much.
"""

import threading
import time
from typing import List, Optional

import numpy as np
import tensorflow as tf
from absl import logging

from tf_asyncps.policies import registry
from tf_asyncps.policies.base import UpdatePolicy

__all__ = ["BoundedStaleness"]


@registry.register("ssp")
class BoundedStaleness(UpdatePolicy):
    """Stale Synchronous Parallel with bound ``max_staleness`` (clocks).

    Args:
      max_staleness: s, int >= 0 (worker clocks).
      timeout_s: seconds a worker may wait for the slowest one without any
        progress before training fails (float > 0).

    Raises:
      ValueError: bad arguments.
      TimeoutError: (from ``coordinator.join``/``model.fit``) a wait outlived
        ``timeout_s``.
    """

    def __init__(self, max_staleness: int = 2, timeout_s: float = 120.0):
        if isinstance(max_staleness, bool) or not isinstance(max_staleness, int) \
                or max_staleness < 0:
            raise ValueError(f"ssp: max_staleness must be an int >= 0 (clocks), got "
                             f"{max_staleness!r}.")
        if not (isinstance(timeout_s, (int, float)) and timeout_s > 0):
            raise ValueError(f"ssp: timeout_s must be > 0 seconds, got {timeout_s!r}.")
        self.max_staleness = max_staleness
        self.timeout_s = float(timeout_s)
        self.timeout_error: Optional[str] = None
        self._queues: List[tf.queue.FIFOQueue] = []

    def get_config(self):
        return {"max_staleness": self.max_staleness, "timeout_s": self.timeout_s}

    # -- resources on the PS --------------------------------------------------
    def build(self, num_workers, device):
        self.num_workers = num_workers
        with tf.init_scope(), tf.device(device):
            self.clocks = tf.Variable(tf.zeros([num_workers], tf.int64), trainable=False,
                                      name="ssp_clocks")
            self.max_spread = tf.Variable(tf.zeros([1], tf.int64), trainable=False,
                                          name="ssp_max_spread")
            self.waiting = tf.Variable(tf.zeros([num_workers], tf.int64), trainable=False,
                                       name="ssp_waiting")
            # released[w] = 1: w's next token was granted by a drain release.
            self.released = tf.Variable(tf.zeros([num_workers], tf.int64), trainable=False,
                                        name="ssp_released")
            self.released_count = tf.Variable(tf.zeros([1], tf.int64), trainable=False,
                                              name="ssp_released_reads")
            self._lock = tf.CriticalSection(name="ssp_clock_lock")
            self._queues = [
                tf.queue.FIFOQueue(1 << 30, [tf.int64], shapes=[[]],
                                   name=f"ssp_tokens_worker_{w}")
                for w in range(num_workers)]
            for q in self._queues:
                q.enqueue_many([tf.zeros([self.max_staleness + 1], tf.int64)])
        self._stop = threading.Event()
        self._watchdog = threading.Thread(target=self._watch, daemon=True,
                                          name="ssp-watchdog")
        self._watchdog.start()

    # -- graph side -------------------------------------------------------------
    def before_read(self, worker_index):
        w = tf.cast(worker_index, tf.int64)
        one = tf.ones([1], tf.int64)
        mark = self.waiting.scatter_add(tf.IndexedSlices(one, tf.reshape(w, [1])))
        with tf.control_dependencies([mark]):
            token = tf.switch_case(
                tf.cast(w, tf.int32),
                [(lambda q=q: q.dequeue()) for q in self._queues])
        with tf.control_dependencies([token]):
            unmark = self.waiting.scatter_sub(tf.IndexedSlices(one, tf.reshape(w, [1])))
            was_released = tf.gather(self.released.read_value(), w) > 0

            def count_release():
                with tf.control_dependencies([
                        self.released.scatter_update(tf.IndexedSlices(
                            tf.zeros([1], tf.int64), tf.reshape(w, [1]))),
                        self.released_count.scatter_add(tf.IndexedSlices(
                            one, tf.constant([0], tf.int64)))]):
                    return tf.constant(True)

            def record_spread():
                clocks = self.clocks.read_value()
                spread = tf.gather(clocks, w) - tf.reduce_min(clocks)
                with tf.control_dependencies([self.max_spread.scatter_max(tf.IndexedSlices(
                        tf.reshape(spread, [1]), tf.constant([0], tf.int64)))]):
                    return tf.constant(False)

            rec = tf.cond(was_released, count_release, record_spread)
        return [unmark, rec]

    def after_step(self, worker_index):
        w = tf.reshape(tf.cast(worker_index, tf.int64), [1])

        def tick():
            old_min = tf.reduce_min(self.clocks)
            with tf.control_dependencies([old_min]):
                new = self.clocks.scatter_add(tf.IndexedSlices(tf.ones([1], tf.int64), w))
            gained = tf.reduce_min(new) - old_min  # 0 or 1

            def refill():
                ops = [q.enqueue(tf.constant(0, tf.int64)) for q in self._queues]
                with tf.control_dependencies(ops):
                    return tf.constant(True)

            return tf.cond(gained > 0, refill, lambda: tf.constant(False))

        return [self._lock.execute(tick, exclusive_resource_access=False)]

    def update(self, grads, state, info):
        return grads, True

    # -- host side --------------------------------------------------------------
    def clock_values(self) -> np.ndarray:
        """Per-worker clocks (int64, shape (num_workers,)), read from the PS."""
        return self.clocks.numpy()

    def max_clock_spread(self) -> int:
        """Largest c_w − min_j c_j seen by a worker when it started a step."""
        return int(self.max_spread.numpy()[0])

    def set_pending_probe(self, probe) -> None:
        """``probe()`` -> True while the coordinator still has queued closures."""
        self._pending = probe

    def released_reads(self) -> int:
        """Reads let through by an end-of-schedule release (see module doc)."""
        return int(self.released_count.numpy()[0])

    def _release(self, waiting):
        for w in np.flatnonzero(waiting):
            self.released.scatter_update(tf.IndexedSlices(
                tf.ones([1], tf.int64), tf.constant([int(w)], tf.int64)))
            self._queues[int(w)].enqueue(tf.constant(0, tf.int64))

    def _watch(self):
        last_min, last_change = None, time.monotonic()
        while not self._stop.wait(0.02):
            try:
                clocks = self.clocks.numpy()
                waiting = self.waiting.numpy()
            except Exception:  # cluster gone: nothing left to watch
                return
            m = int(clocks.min())
            if m != last_min or not waiting.any():
                last_min, last_change = m, time.monotonic()
                continue
            probe = getattr(self, "_pending", None)
            if probe is not None and not probe():
                # Nothing queued for the slowest worker to run: let waiters go.
                try:
                    self._release(waiting)
                except Exception:
                    return
                last_change = time.monotonic()
                continue
            if time.monotonic() - last_change > self.timeout_s:
                slow = [int(i) for i in np.flatnonzero(clocks == m)]
                self.timeout_error = (
                    f"ssp: worker(s) {np.flatnonzero(waiting).tolist()} waited more than "
                    f"{self.timeout_s:.0f} s (timeout_s) for the slowest worker(s) {slow}; "
                    f"clocks {clocks.tolist()}, max_staleness {self.max_staleness}. Is a "
                    "worker dead or paused? Raise timeout_s, or use a policy that does "
                    "not wait (async, drop_stale).")
                logging.error(self.timeout_error)
                for q in self._queues:  # wake the waiting workers with an error
                    q.close(cancel_pending_enqueues=True)
                return

    def stop(self):
        if getattr(self, "_stop", None) is not None:
            self._stop.set()
