"""The drain release: the gates' watchdogs release waiting workers only while
a caller waits in the coordinator (join/done/fetch) and no closure is queued
(the drain probe, compat/coordinator.py), and a release never outlives the
grant it raced with (core/worker_gate.py). Issue #26, item 1.

Each test drives one interleaving on purpose, with fakes for threads and the
coordinator's queue, so that it fails the same way every time before its fix
(fast tier: no TensorFlow servers).
"""

import threading


def test_two_callers_waiting_at_once_are_both_counted():
    """The coordinator counts threads inside join/done/fetch; the gates'
    watchdogs release waiting workers only while that count is > 0. Before:
    an unlocked ``+= 1`` let a second caller's increment be lost, so the count
    read 0 while a caller still waited (no drain release: a hang until
    timeout_s) and ended at -1. The int subclass opens the read-modify-write
    window on purpose; with the lock, the second caller waits its turn
    (the 2 s is how long the window stays open, not a synchronisation)."""
    import types
    from tf_asyncps.strategy import _AsyncCoordinator

    class Coordinator(_AsyncCoordinator):
        def __del__(self):  # no cluster behind this one
            pass

    coord = object.__new__(Coordinator)
    coord._waiting_callers, coord._waiting_lock = 0, threading.Lock()
    coord.engine = types.SimpleNamespace(timeout_error=lambda: None)
    b_inside, b_may_leave = threading.Event(), threading.Event()

    def b_call():
        b_inside.set()
        b_may_leave.wait(60)

    b = threading.Thread(target=coord._translate, args=(b_call,))
    opened = []

    class Racing(int):
        def __add__(self, other):
            if not opened:  # the first caller's += 1, between its read and its write
                opened.append(1)
                b.start()
                b_inside.wait(2.0)
            return int(self) + other

    seen = []

    def a_call():
        b_may_leave.set()
        b.join(60)  # the other caller has come and gone
        seen.append(coord._waiting_callers)  # this caller still waits

    coord._waiting_callers = Racing(0)
    coord._translate(a_call)
    assert seen == [1] and coord._waiting_callers == 0


def test_the_drain_probe_reads_the_closure_queue_under_its_lock():
    """A worker thread's ``get`` adds a key to ``_tagged_queue`` (a
    defaultdict) under the queue's lock whenever it can take that lock.
    Before: the probe iterated the dict unlocked and met "dictionary changed
    size during iteration", which ended the gate's watchdog silently."""
    import collections
    import queue
    import types
    from tf_asyncps.compat import coordinator as coordinator_compat
    lock = threading.Lock()
    tagged = collections.defaultdict(queue.Queue)

    class WorkerThreadNext(queue.Queue):
        def empty(self):
            if not lock.locked():  # the worker thread's get() can run right now
                with lock:
                    tagged[7].empty()
            return super().empty()

    tagged[0] = WorkerThreadNext()
    tagged[1] = queue.Queue()
    q = types.SimpleNamespace(_queue=queue.Queue(), _tagged_queue=tagged, _queue_lock=lock)
    coordinator = types.SimpleNamespace(_cluster=types.SimpleNamespace(closure_queue=q))
    assert not coordinator_compat.closure_queue_nonempty(coordinator)
    tagged[1].put("create worker 1's dataset")
    assert coordinator_compat.closure_queue_nonempty(coordinator)
    assert not lock.locked()


def test_a_drain_release_that_crosses_a_grant_lets_no_later_step_through():
    """The gate's watchdog reads who waits, then releases them. Before: a
    grant landing in between let the worker go on the grant, and the release
    token stayed in its queue: its next wait passed without any grant (past
    ssp's bound), counted as a released read. The drain probe, which the
    watchdog calls between its read and its release, is where the grant
    lands here."""
    import time
    import tensorflow as tf
    from tf_asyncps.core.worker_gate import WorkerGate
    cpu = "/job:localhost/replica:0/task:0/device:CPU:0"
    gate = WorkerGate(2, cpu, initial_tokens=0, timeout_s=30, name="test",
                      progress=lambda: 0, describe=str)
    first = []
    worker = threading.Thread(target=lambda: first.append(bool(gate.wait(0))))
    worker.start()
    deadline = time.monotonic() + 60
    while gate._state.numpy()[0] != 1:  # the worker waits in its dequeue
        assert time.monotonic() < deadline, "the worker never started waiting"

    def nothing_queued(waiting):
        assert waiting == [0]
        gate.grant(0)  # an update grants worker 0 a token: it goes on
        worker.join(60)
        return False

    gate.set_pending_probe(nothing_queued)
    gate.reset()
    assert gate.poll() is False  # first sight of the progress value
    assert gate.poll() is False  # waiting, nothing queued: the (late) release
    assert first == [False]  # the first wait ended on the grant
    gate.grant(0)  # the next update
    assert bool(gate.wait(0)) is False  # on that grant, not on the stale release
    assert gate.released_reads() == 0
    assert [int(q.size()) for q in gate.queues] == [0, 0]
