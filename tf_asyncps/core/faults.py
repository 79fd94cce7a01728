"""Worker-failure accounting on the chief: retried closures, failures, rejoins.

``ClusterCoordinator`` runs every scheduled closure *at least once*: when a
worker dies (SIGKILL, preemption) its in-flight closure is put back in the
queue and later runs on any worker, possibly after part of it already ran and
applied updates on the PS. TensorFlow keeps no count of this. The counters
here make those re-executions visible instead of hidden:

* ``retried_closures``: closures put back after a failure (each may have run
  partly before; it runs again in full);
* ``worker_failures[i]``: failures of worker ``i`` seen by the coordinator;
* ``closures_done[i]``: closures worker ``i`` completed; a worker that
  rejoins after a restart starts adding to its count again.

So at a quiet point, with ``S`` steps per closure and no policy drop,
``scheduled steps <= applied + dropped <= scheduled + S * retried_closures``.

The counters live on the chief (Python ints under a lock): they cost no PS
round trip. They read ``ClusterCoordinator`` internals (TF 2.21); if those
move, :func:`attach` logs a warning and the counters stay at zero.
"""

import threading
from typing import List

from absl import logging

from tf_asyncps.compat import coordinator as coordinator_compat
from tf_asyncps.compat import versions

__all__ = ["ClosureAccounting", "attach"]


class ClosureAccounting:
    """Chief-side counters of closure retries, worker failures and completions.

    Args:
      num_workers: worker tasks in the cluster (int >= 1).
    """

    def __init__(self, num_workers: int):
        self._lock = threading.Lock()
        # Per thread, not per trace: each of the coordinator's worker threads
        # serves one worker for its life and says which (on_process, below).
        self._local = threading.local()
        self._retried = 0
        self._failures = [0] * num_workers
        self._done = [0] * num_workers
        self.attached = False

    @property
    def retried_closures(self) -> int:
        """Closures put back in the queue after a worker or transient failure."""
        with self._lock:
            return self._retried

    @property
    def worker_failures(self) -> List[int]:
        """Failures seen per worker index (list of ints, length num_workers)."""
        with self._lock:
            return list(self._failures)

    @property
    def closures_done(self) -> List[int]:
        """Closures completed per worker index (list of ints)."""
        with self._lock:
            return list(self._done)

    def reset(self) -> None:
        """Zeroes every counter."""
        with self._lock:
            self._retried = 0
            self._failures = [0] * len(self._failures)
            self._done = [0] * len(self._done)

    # -- hooks, called from the coordinator's worker threads -------------------
    def _put_back(self):
        with self._lock:
            self._retried += 1

    def _failed(self, index: int):
        with self._lock:
            self._failures[index] += 1

    def _finished(self):
        index = getattr(self._local, "worker", None)
        if index is not None:
            with self._lock:
                self._done[index] += 1


def attach(coordinator, accounting: ClosureAccounting) -> ClosureAccounting:
    """Counts retries, failures and completions of ``coordinator``'s closures.

    Args:
      coordinator: a ``tf.distribute.coordinator.ClusterCoordinator``.
      accounting: the counters to update.

    Returns:
      ``accounting`` (``accounting.attached`` is False if TensorFlow's
      coordinator internals were not found).
    """

    def on_process(index):
        accounting._local.worker = index  # this thread serves worker ``index``

    accounting.attached = coordinator_compat.instrument_closures(
        coordinator, accounting._put_back, accounting._finished, on_process,
        accounting._failed)
    if not accounting.attached:  # pragma: no cover - TF internals moved
        logging.warning("tf_asyncps: closure retry accounting is off (TensorFlow's "
                        "ClusterCoordinator internals moved; tested with %s).",
                        ", ".join(versions.TENSORFLOW_TESTED))
    return accounting
