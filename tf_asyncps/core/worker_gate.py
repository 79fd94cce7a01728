"""Per-worker token gates on the PS: how a worker waits without spinning.

A worker step that must wait (``ssp``: too far ahead of the slowest worker;
``sync_replicas``: its gradient is in and the round is not complete) blocks in
a ``FIFOQueue.dequeue`` of its own token queue on the PS. Policies grant tokens
from inside their (PS-side) updates. A watchdog thread on the chief:

* releases waiting workers when the program is draining (inside
  ``coordinator.join``/``done``/``fetch``, which ``model.fit`` calls at each
  epoch's end) and no closure is queued: the worker they wait for may have
  nothing left to run; such reads are counted in ``released_reads``. A
  grant's token is 0, a release's token the number of the wait it releases:
  when a grant ends that wait first, the next wait drops the release token,
  so a release never adds a token to the ones the policy granted;
* fails the wait after ``timeout_s`` seconds without progress, closing the
  queues so the waiting steps end with an error that
  ``coordinator.join``/``model.fit`` turn into a TimeoutError with
  ``timeout_error`` as its message.
"""

import time
from typing import Callable, List, Optional

import numpy as np
import tensorflow as tf

from tf_asyncps.core import placement
from tf_asyncps.core.watchdog import Watchdog

__all__ = ["WorkerGate", "GatedPolicy"]


class WorkerGate(Watchdog):
    """Token queues, one per worker, on ``device``, and their watchdog.

    Args:
      num_workers: number of worker tasks (int >= 1).
      device: the PS device holding the queues.
      initial_tokens: tokens each worker starts with (int >= 0).
      timeout_s: seconds without progress while a worker waits (float > 0).
      name: prefix for resource names and messages.
      progress: ``progress() -> int`` read on the chief; any change counts as
        progress (e.g. the slowest clock or the global step).
      describe: ``describe(waiting_workers) -> str``, the timeout message.
    """

    def __init__(self, num_workers: int, device: str, initial_tokens: int,
                 timeout_s: float, name: str, progress: Callable[[], int],
                 describe: Callable[[List[int]], str]):
        super().__init__(f"{name}-gate")
        self.num_workers = num_workers
        self.timeout_s = float(timeout_s)
        self._progress = progress
        self._describe = describe
        self._pending: Optional[Callable[[], bool]] = None
        with tf.init_scope(), tf.device(device):
            self.queues = [placement.fifo_queue(1 << 30, f"{name}_tokens_worker_{w}")
                           for w in range(num_workers)]
            # [waiting per worker..., waits started per worker..., grant tokens
            # queued per worker..., released reads]
            n = num_workers
            self._state = tf.Variable(
                tf.constant([0] * 2 * n + [initial_tokens] * n + [0], tf.int64),
                trainable=False, name=f"{name}_gate_state")
            if initial_tokens:
                for q in self.queues:
                    q.enqueue_many([tf.zeros([initial_tokens], tf.int64)])
        self._interval = 0.25

    # -- graph side ---------------------------------------------------------------
    def _add(self, index, delta):
        return self._state.scatter_add(tf.IndexedSlices(
            tf.reshape(tf.cast(delta, tf.int64), [1]),
            tf.reshape(tf.cast(index, tf.int64), [1])))

    def wait(self, worker_index) -> tf.Tensor:
        """Blocks worker ``worker_index`` until it holds a token.

        A grant's token is 0; a drain release's token is the number of the
        wait it releases (waits are counted per worker, from 1). A release
        token for an earlier wait (a grant ended that wait while the release
        was on its way) is dropped here, so it lets no later step through.

        Returns:
          scalar tf.bool: the token came from a drain release, not a grant.
        """
        w = tf.cast(worker_index, tf.int64)
        n = self.num_workers
        started = self._state.scatter_add(tf.IndexedSlices(
            tf.ones([2], tf.int64), tf.stack([w, n + w])))
        with tf.control_dependencies([started]):
            this_wait = tf.gather(self._state.read_value(), n + w)

        def take(q):
            def stale(t):
                return tf.logical_and(tf.not_equal(t, 0), tf.not_equal(t, this_wait))
            return tf.while_loop(stale, lambda t: (q.dequeue(),), (q.dequeue(),))[0]

        with tf.control_dependencies([this_wait]):  # counted as waiting first
            token = tf.switch_case(tf.cast(w, tf.int32),
                                   [(lambda q=q: take(q)) for q in self.queues])
        released = tf.not_equal(token, 0)
        # waiting -1; a grant's token: grant tokens queued -1; a release: +1 read.
        done = self._state.scatter_add(tf.IndexedSlices(
            tf.stack([tf.constant(-1, tf.int64),
                      tf.cast(released, tf.int64) - 1,
                      tf.cast(released, tf.int64)]),
            tf.stack([w, 2 * n + w, tf.constant(3 * n, tf.int64)])))
        with tf.control_dependencies([done]):
            return tf.identity(released)

    def grant(self, worker_index) -> tf.Tensor:
        """Op giving worker ``worker_index`` one token if it holds none."""
        return tf.switch_case(tf.cast(worker_index, tf.int32),
                              [(lambda w=w: self._give(w, only_if_empty=True))
                               for w in range(self.num_workers)])

    def grant_all(self, only_if_empty: bool = False) -> List[tf.Tensor]:
        """Ops giving every worker one token (or only workers holding none)."""
        return [self._give(w, only_if_empty) for w in range(self.num_workers)]

    def _give(self, w: int, only_if_empty: bool) -> tf.Tensor:
        """Enqueues one grant token for worker ``w`` (unless ``only_if_empty``
        and it holds one: release tokens do not count); returns whether it did."""
        def give():
            count = self._add(2 * self.num_workers + w, 1)
            with tf.control_dependencies([count, self.queues[w].enqueue(
                    tf.constant(0, tf.int64))]):
                return tf.constant(True)

        if not only_if_empty:
            return give()
        held = tf.gather(self._state.read_value(), 2 * self.num_workers + w)
        return tf.cond(held > 0, lambda: tf.constant(False), give)

    # -- chief side ---------------------------------------------------------------
    def set_pending_probe(self, probe: Callable[..., bool]) -> None:
        """``probe(waiting_workers)`` -> True while the coordinator still has
        queued closures that a worker not in ``waiting_workers`` could run."""
        self._pending = probe

    def released_reads(self) -> int:
        """Steps let through by an end-of-schedule release."""
        return int(self._state.numpy()[3 * self.num_workers])

    def _release(self, state):
        # Each token names the wait it releases (see wait): if a grant ends
        # that wait first, the token is dropped by the worker's next wait.
        n = self.num_workers
        for w in np.flatnonzero(state[:n]):
            self.queues[int(w)].enqueue(tf.constant(int(state[n + w]), tf.int64))

    def reset(self):
        self._last, self._since = None, time.monotonic()

    def interval(self) -> float:
        # Every 0.25 s when nobody waits, every 20 ms while someone does (to
        # release the end of a schedule quickly): two small reads per poll.
        return self._interval

    def poll(self) -> bool:
        state = self._state.numpy()
        waiting = state[:self.num_workers]
        progress = self._progress()
        self._interval = 0.02 if waiting.any() else 0.25
        if progress != self._last or not waiting.any():
            self._last, self._since = progress, time.monotonic()
            return False
        # A waiting worker's own queued closures (TensorFlow tags per-worker
        # resource closures, e.g. the datasets of an exact evaluation) cannot
        # run until it is released: they must not hold the release back.
        if self._pending is not None and not self._pending(np.flatnonzero(waiting).tolist()):
            self._release(state)  # nothing queued for the awaited workers to run
            self._since = time.monotonic()
            return False
        if time.monotonic() - self._since <= self.timeout_s:
            return False
        self.fail(self._describe(np.flatnonzero(waiting).tolist()))
        self.abort()
        return True

    def abort(self):
        for q in self.queues:
            q.close(cancel_pending_enqueues=True)


class GatedPolicy:
    """Mixin for policies that make workers wait on a :class:`WorkerGate`
    (the ``gate`` of the cluster state their ``build`` returns): implements
    the protocol's ``attach`` (the drain probe) and ``watchdogs`` hooks for it."""

    @property
    def gate(self) -> Optional[WorkerGate]:
        """The gate of this policy's cluster state (None before ``build``)."""
        return getattr(self.cluster, "gate", None) if self.built else None

    def attach(self, runtime) -> None:
        if self.gate:
            self.gate.set_pending_probe(runtime.has_queued_closures)

    def watchdogs(self):
        return (self.gate,) if self.gate else ()

    def released_reads(self) -> int:
        """Steps let through by an end-of-schedule release."""
        return self.gate.released_reads() if self.gate else 0
