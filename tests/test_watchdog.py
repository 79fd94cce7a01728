"""core/watchdog.py: a watchdog's poll that raises ends the waits it watched
and says why; a stop that outlives a blocked poll leaves one thread; the
engine's drain stops the watchdogs even when its push fails (issue #26,
item 1: no hang without a timeout, no lost error).

Each test drives one interleaving on purpose, with a watchdog whose polls
the test controls, so that it fails the same way every time before its fix
(fast tier: no TensorFlow servers).
"""

import threading

import pytest

from tf_asyncps.core.watchdog import Watchdog


class _Dog(Watchdog):
    """A watchdog whose polls the test controls."""

    def __init__(self, poll_fn):
        super().__init__("test-dog")
        self.poll_fn = poll_fn
        self.aborted = 0
        self.resets = 0

    def interval(self):
        return 0.0

    def reset(self):
        self.resets += 1

    def poll(self):
        return self.poll_fn()

    def abort(self):
        self.aborted += 1


def _dog_threads():
    return [t for t in threading.enumerate() if t.name == "test-dog-watchdog"]


def test_a_poll_that_raises_fails_the_watchdog_and_ends_the_waits():
    """Before: the thread returned silently; waits had no timeout left and
    join never learnt why."""
    ran = threading.Event()

    def poll():
        ran.set()
        raise RuntimeError("ps:0 unreachable")

    dog = _Dog(poll)
    dog.start()
    assert ran.wait(60)
    for t in _dog_threads():
        t.join(60)
    assert dog.timeout_error == (
        "test-dog: the watchdog stopped: its poll of the parameter server raised "
        "RuntimeError: ps:0 unreachable. The waits it watched have no timeout without it, "
        "so they were ended; check that the ps tasks are alive (their logs).")
    assert dog.aborted == 1 and not dog.running
    dog.start()  # failed: stays stopped
    assert not dog.running and _dog_threads() == []


def test_start_after_a_stop_that_outlived_a_blocked_poll_keeps_one_thread():
    """Before: stop() gave up after its wait, forgot the thread, and start()
    added a second poller next to the one still blocked on a ps read."""
    entered, release, again = threading.Event(), threading.Event(), threading.Event()
    polls = []

    def poll():
        polls.append(1)
        if len(polls) == 1:
            entered.set()
            release.wait()  # a read blocked on the PS
        else:
            again.set()
        return False

    dog = _Dog(poll)
    dog.start()
    assert entered.wait(60)
    dog.stop(timeout_s=0.01)  # the blocked poll outlives the wait
    assert len(_dog_threads()) == 1 and not dog.running
    dog.start()
    assert len(_dog_threads()) == 1 and dog.running
    release.set()
    assert again.wait(60)  # the same thread polls for the new watch
    dog.stop(timeout_s=60)
    assert _dog_threads() == [] and not dog.running
    assert dog.resets == 2  # the second watch started afresh on the same thread


def test_drained_stops_the_watchdogs_when_the_push_fails():
    """Before: a local_sgd push that raised left the watchdogs polling."""
    import types
    from tf_asyncps.core.engine import PolicyEngine
    engine = object.__new__(PolicyEngine)
    dog = _Dog(lambda: False)
    engine.lock = None
    engine.cluster_states = None  # a policy built by hand (PolicyEngine.build not run)
    engine.policy = types.SimpleNamespace(watchdogs=lambda: (dog,))

    def flush():
        raise RuntimeError("ps:0 went away during the push")

    engine.local = types.SimpleNamespace(flush=flush)
    dog.start()
    assert dog.running
    with pytest.raises(RuntimeError, match="went away"):
        engine.drained()
    assert not dog.running and _dog_threads() == []
