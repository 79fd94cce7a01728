"""No hang without a timeout, no lost error, no lost update (issue #26, item 1).

Each test drives one interleaving on purpose, with fakes for threads, the
coordinator's queue or the PS, so that it fails the same way every time
before its fix (fast tier: no TensorFlow servers).
"""

import threading

import numpy as np
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


@pytest.mark.parametrize("sparse", [False, True])
def test_dc_asgd_adaptive_meansquare_loses_no_concurrent_update(sparse):
    """DC-ASGD-a's meansquare <- m * meansquare + (1 - m) * g * g is a read
    then a write on the PS; concurrent worker steps must not lose one
    (before: 2 to 9 of 2000 lost here, each lowering the result by >= 1.3e-4).
    With g = 1 everywhere, n updates in any order give exactly 1 - m^n."""
    import tensorflow as tf
    from tf_asyncps.core.protocol import StepInfo
    from tf_asyncps.policies.dc_asgd import DCASGD
    policy = DCASGD(lambda_=0.0, adaptive=True, momentum=0.999)
    var = tf.Variable(tf.zeros([64]))
    state = policy.init([var])
    grad = (tf.IndexedSlices(tf.ones([64]), tf.range(64), tf.constant([64]))
            if sparse else tf.ones([64]))

    @tf.function
    def step():
        info = StepInfo(tau=0, read_step=0, global_step=0, variables=[var],
                        worker_index=0, read_values=[var.read_value()])
        return policy.update([grad], state, info)[0][0]

    step()
    state[0].assign(tf.zeros([64]))
    threads = [threading.Thread(target=lambda: [step() for _ in range(500)])
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    np.testing.assert_allclose(state[0].numpy(), 1 - 0.999 ** 2000, atol=2e-5)


def test_resume_progress_read_at_an_epoch_end_is_never_an_epoch_ahead(tmp_path):
    """ResumeTracker's writer thread reads the epoch's base step and its
    closure count at the start while the main thread moves both at the
    epoch's end. Before: a read between the two moves saw the new base with
    the old count and recorded steps_done one epoch too high (20 for 10)."""
    import types
    from tf_asyncps.callbacks.recovery import ResumeTracker
    tracker = ResumeTracker(str(tmp_path), steps_per_epoch=10, period_s=3600)
    done, seen = [0], []

    def closures_done_per_worker():
        if seen == [None]:  # the writer thread reads here, mid-update
            seen[0] = "reading"
            seen[0] = tracker.steps_done()
        return [done[0]]

    tracker.set_model(types.SimpleNamespace(distribute_strategy=types.SimpleNamespace(
        closures_done_per_worker=closures_done_per_worker)))
    tracker.on_epoch_begin(0)
    done[0] = 10  # the epoch's 10 steps ran
    seen.append(None)
    tracker.on_epoch_end(0)
    tracker.record_failure()  # stops the writer thread
    assert seen == [10] and tracker.steps_done() == 10


def test_leaving_a_connected_cluster_closes_this_process_log_files(tmp_path, monkeypatch):
    """Before: the deferred stop returned before closing the parent's log
    handles (the tasks keep writing through their own descriptors)."""
    from tf_asyncps.cluster import launcher
    cluster = launcher.LocalCluster(1, 1, log_dir=str(tmp_path))

    class Alive:
        pid = 1

        def poll(self):
            return None

    cluster.procs["ps:0"] = Alive()
    log = open(cluster.log_path("ps:0"), "ab")
    cluster._logs["ps:0"] = log
    monkeypatch.setattr(launcher.startup_compat, "context_connected", lambda: True)
    cluster.stop(defer_if_connected=True)
    assert log.closed and cluster._logs == {}


def test_the_summary_writer_is_closed_when_fit_ends(tmp_path):
    import types
    from tf_asyncps.callbacks import StalenessLogger
    logger = StalenessLogger(log_dir=str(tmp_path))
    logger.set_model(types.SimpleNamespace(distribute_strategy=types.SimpleNamespace(
        staleness_stats=lambda: None)))
    logger.on_train_begin()
    writer = logger._writer
    closed = []
    real_close = writer.close
    writer.close = lambda: (closed.append(1), real_close())
    logger.on_train_end()
    assert closed == [1] and logger._writer is None


def test_progress_line_says_why_it_stopped_drawing(caplog):
    """Before: every exception was swallowed, a bug in drawing included."""
    import io
    import types
    from tf_asyncps.callbacks import ProgressLine

    def stats():
        raise KeyError("worker_steps")

    line = ProgressLine(total_steps=10, period_s=0.0, stream=io.StringIO(), force=True)
    line._strategy = types.SimpleNamespace(staleness_stats=stats)
    line._base, line._t0 = 0, 0.0
    with caplog.at_level("WARNING"):
        line._run()  # returns after the failed draw
    assert isinstance(line.error, KeyError) and line.draws == 0
    assert [r.getMessage() for r in caplog.records if "ProgressLine" in r.getMessage()] == [
        "ProgressLine stopped drawing: KeyError: 'worker_steps'"]


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
