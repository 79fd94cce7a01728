"""Chief-side watchdogs: every wait on the PS has a timeout.

TensorFlow's blocking ops (a ``FIFOQueue.dequeue`` on the PS) wait forever,
so each wait this package makes (the update lock, the worker gates of
``ssp`` and ``sync_replicas``) has a watchdog on the chief: a thread that
polls two small PS variables and, when nothing progresses for ``timeout_s``,
records a message in ``timeout_error`` and closes the queues, so the waiting
steps fail and ``coordinator.join``/``model.fit`` raise a TimeoutError with
that message.

Lifecycle: the strategy's coordinator starts every watchdog when closures are
scheduled and stops them (joining the threads) when it drains (``join``,
``done``), so no thread polls the PS once training ends; the next
``schedule`` starts them again.
"""

import threading
from typing import Optional

from absl import logging

__all__ = ["Watchdog"]


class Watchdog:
    """A restartable polling thread on the chief.

    Subclasses define :meth:`poll` (and :meth:`reset`, called when a watch
    starts). Once :meth:`fail` was called the watchdog stays stopped.

    Args:
      name: the thread's name and the prefix of messages.
    """

    def __init__(self, name: str):
        self.name = name
        self.timeout_error: Optional[str] = None
        self._thread: Optional[threading.Thread] = None
        self._stop = threading.Event()
        self._guard = threading.Lock()

    @property
    def running(self) -> bool:
        """Whether the polling thread is alive."""
        t = self._thread
        return t is not None and t.is_alive()

    def start(self) -> None:
        """Starts polling, unless already running or failed. Idempotent."""
        with self._guard:
            if self.running or self.timeout_error is not None:
                return
            self._stop = threading.Event()
            self._thread = threading.Thread(target=self._run, args=(self._stop,),
                                            daemon=True, name=f"{self.name}-watchdog")
            self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stops polling and waits (``timeout_s`` seconds at most) for the thread."""
        with self._guard:
            thread, self._thread = self._thread, None
            self._stop.set()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout_s)

    def _run(self, stop: threading.Event) -> None:
        self.reset()
        interval = self.interval()
        while not stop.wait(interval):
            try:
                done = self.poll()
            except Exception:  # noqa: BLE001 - the cluster is gone: nothing to watch
                return
            if done:
                return
            interval = self.interval()

    def fail(self, message: str) -> None:
        """Records ``message`` as the timeout error and logs it."""
        self.timeout_error = message
        logging.error(message)

    # -- for subclasses -------------------------------------------------------------
    def reset(self) -> None:
        """Called on the watchdog's thread when a watch starts. Default: nothing."""

    def interval(self) -> float:
        """Seconds until the next poll. Default 0.5."""
        return 0.5

    def poll(self) -> bool:
        """One check; returns True to stop watching (after :meth:`fail`)."""
        raise NotImplementedError
