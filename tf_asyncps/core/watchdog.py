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
    starts, and :meth:`abort`, which ends the waits it watches). Once
    :meth:`fail` was called the watchdog stays stopped. A :meth:`poll` that
    raises fails the watchdog too (through :meth:`fail` and :meth:`abort`):
    the waits it watched would otherwise have no timeout left.

    One polling thread at most: a :meth:`start` while a stopped thread is
    still inside a :meth:`poll` (a read blocked on the PS outlived
    :meth:`stop`'s wait) lets that thread carry on instead of adding one.

    Args:
      name: the thread's name and the prefix of messages.
    """

    def __init__(self, name: str):
        self.name = name
        self.timeout_error: Optional[str] = None
        self._thread: Optional[threading.Thread] = None
        self._wanted = False  # a watch is on (start) or off (stop)
        self._watch = 0  # start() count: the thread resets at each new watch
        self._wake = threading.Event()
        self._guard = threading.Lock()

    @property
    def running(self) -> bool:
        """Whether a watch is on and its polling thread is alive."""
        t = self._thread
        return self._wanted and t is not None and t.is_alive()

    def start(self) -> None:
        """Starts polling, unless already running or failed. Idempotent."""
        with self._guard:
            if self.timeout_error is not None:
                return
            if not self._wanted:
                self._watch += 1
            self._wanted = True
            self._wake.clear()
            if self._thread is not None:
                return  # alive: it exits only under the guard, clearing _thread
            self._thread = threading.Thread(target=self._run, daemon=True,
                                            name=f"{self.name}-watchdog")
            self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stops polling and waits (``timeout_s`` seconds at most) for the thread.

        A thread still inside :meth:`poll` after ``timeout_s`` ends when that
        poll returns, or carries on if :meth:`start` comes first.
        """
        with self._guard:
            self._wanted = False
            self._wake.set()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout_s)

    def _run(self) -> None:
        watch = None
        while True:
            with self._guard:
                if not self._wanted or self.timeout_error is not None:
                    self._thread = None
                    return
                fresh, watch = watch != self._watch, self._watch
            if fresh:
                self.reset()
                interval = self.interval()
            if self._wake.wait(interval):
                continue  # stop() (then perhaps start() again): decide above
            try:
                done = self.poll()
            except Exception as e:  # noqa: BLE001 - reported as the watchdog's error
                self._failed_poll(e)
                done = True
            if done:
                with self._guard:
                    self._wanted = False
                    self._thread = None
                return
            interval = self.interval()

    def _failed_poll(self, e: Exception) -> None:
        self.fail(
            f"{self.name}: the watchdog stopped: its poll of the parameter server raised "
            f"{type(e).__name__}: {e}. The waits it watched have no timeout without it, "
            "so they were ended; check that the ps tasks are alive (their logs).")
        try:
            self.abort()
        except Exception as e2:  # noqa: BLE001 - the ps may be gone: the error stands
            logging.error("%s: could not end the waits: %s: %s", self.name,
                          type(e2).__name__, e2)

    def fail(self, message: str) -> None:
        """Records ``message`` as the timeout error and logs it."""
        self.timeout_error = message
        logging.error(message)

    # -- for subclasses -------------------------------------------------------------
    def reset(self) -> None:
        """Called on the watchdog's thread when a watch starts. Default: nothing."""

    def abort(self) -> None:
        """Ends the waits this watchdog watches (closes their queues), after
        :meth:`fail`. Default: nothing."""

    def interval(self) -> float:
        """Seconds until the next poll. Default 0.5."""
        return 0.5

    def poll(self) -> bool:
        """One check; returns True to stop watching (after :meth:`fail`)."""
        raise NotImplementedError
