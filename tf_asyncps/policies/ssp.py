"""``ssp``: Stale Synchronous Parallel (bounded staleness between workers).

Rule: every worker has a clock c_w, the number of its steps whose update was
applied or dropped. A worker may start a step (read the model) only while
c_w − min_j c_j <= s; otherwise it waits for the slowest worker. s = 0 makes
bulk-synchronous rounds. Ho et al., "More Effective Distributed ML via a Stale
Synchronous Parallel Parameter Server" (NIPS 2013).

How the wait works (no spinning, see tf_asyncps/core/worker_gate.py): each worker owns a
token queue on the PS, filled with s + 1 tokens. Starting a step takes one
token (a blocking dequeue); whenever the slowest clock advances, every queue
gets one more. So a worker holds s + 1 + min_j c_j − c_w tokens, which is >= 1
exactly when the rule lets it start. A wait with no progress of the slowest
worker for ``timeout_s`` fails training with a TimeoutError naming the clocks.

End of a schedule: ClusterCoordinator hands closures to whichever worker is
free, so when the last closures are taken by fast workers the slowest worker
may have nothing left to run. Waiting workers are then released once the
coordinator has no queued closures; such reads are counted in
``released_reads()`` and are not part of ``max_clock_spread()``.

When to use: workers of uneven speed where unbounded staleness hurts
convergence, but full synchrony costs too much.
"""

import dataclasses
from typing import Any

import numpy as np
import tensorflow as tf

from tf_asyncps.core import placement
from tf_asyncps.core.worker_gate import GatedPolicy, WorkerGate
from tf_asyncps.policies import registry
from tf_asyncps.policies.base import UpdatePolicy, check_count
from tf_asyncps.validate import check_number

__all__ = ["SSP", "Clocks"]


@dataclasses.dataclass
class Clocks:
    """ssp's per-cluster state (what ``build`` returns), on the PS.

    Attributes:
      clocks: int64 variable, shape (num_workers,): each worker's clock.
      max_spread: int64 variable, shape (1,): largest spread seen at a read.
      lock: tf.CriticalSection serialising clock ticks.
      gate: the WorkerGate of the workers' tokens.
    """

    clocks: Any
    max_spread: Any
    lock: Any
    gate: Any


@registry.register("ssp")
class SSP(GatedPolicy, UpdatePolicy):
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
        max_staleness = check_count("ssp", "max_staleness", max_staleness, 0, "clocks")
        timeout_s = check_number(timeout_s, "ssp: timeout_s", above=0, hint="seconds")
        self.max_staleness = max_staleness
        self.timeout_s = float(timeout_s)

    def get_config(self):
        return {"max_staleness": self.max_staleness, "timeout_s": self.timeout_s}

    def build(self, num_workers, device):
        with tf.init_scope(), tf.device(device):
            clocks = tf.Variable(tf.zeros([num_workers], tf.int64), trainable=False,
                                 name="ssp_clocks")
            max_spread = tf.Variable(tf.zeros([1], tf.int64), trainable=False,
                                     name="ssp_max_spread")
            lock = placement.critical_section("ssp_clock_lock")
        gate = WorkerGate(
            num_workers, device, initial_tokens=self.max_staleness + 1,
            timeout_s=self.timeout_s, name="ssp",
            progress=lambda: int(clocks.numpy().min()),
            describe=lambda waiting: self._describe(waiting, clocks))
        return Clocks(clocks, max_spread, lock, gate)

    def _describe(self, waiting, clocks):
        clocks = clocks.numpy()
        slow = np.flatnonzero(clocks == clocks.min()).tolist()
        return (f"ssp: worker(s) {waiting} waited more than {self.timeout_s:.0f} s "
                f"(timeout_s) for the slowest worker(s) {slow}; clocks {clocks.tolist()}, "
                f"max_staleness {self.max_staleness}. Is a worker dead or paused? Raise "
                "timeout_s, or use a policy that does not wait (async, drop_stale).")

    # -- graph side -------------------------------------------------------------
    def before_read(self, worker_index):
        c = self.cluster
        w = tf.cast(worker_index, tf.int64)
        released = c.gate.wait(w)

        def record_spread():
            clocks = c.clocks.read_value()
            spread = tf.gather(clocks, w) - tf.reduce_min(clocks)
            with tf.control_dependencies([c.max_spread.scatter_max(tf.IndexedSlices(
                    tf.reshape(spread, [1]), tf.constant([0], tf.int64)))]):
                return tf.constant(True)

        return [tf.cond(released, lambda: tf.constant(False), record_spread)]

    def after_step(self, worker_index):
        c = self.cluster
        w = tf.reshape(tf.cast(worker_index, tf.int64), [1])

        def tick():
            old_min = tf.reduce_min(c.clocks)
            with tf.control_dependencies([old_min]):
                new = c.clocks.scatter_add(tf.IndexedSlices(tf.ones([1], tf.int64), w))
            gained = tf.reduce_min(new) - old_min  # 0 or 1

            def refill():
                with tf.control_dependencies(c.gate.grant_all()):
                    return tf.constant(True)

            return tf.cond(gained > 0, refill, lambda: tf.constant(False))

        return [c.lock.execute(tick, exclusive_resource_access=False)]

    def update(self, grads, state, info):
        return grads, True

    # -- host side --------------------------------------------------------------
    def clock_values(self) -> np.ndarray:
        """Per-worker clocks (int64, shape (num_workers,)), read from the PS."""
        return self.cluster.clocks.numpy()

    def max_clock_spread(self) -> int:
        """Largest c_w − min_j c_j seen by a worker when it started a step
        (released reads excluded)."""
        return int(self.cluster.max_spread.numpy()[0])


#: Its former name, kept as an alias (the class is now named after its registry name).
BoundedStaleness = SSP
