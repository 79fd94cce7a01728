"""The progress records that count steps redone: callbacks/recovery.py's
ResumeTracker, read by its writer thread while an epoch ends, is never an
epoch ahead (issue #26, item 1); callbacks/step_backup.py's StepBackup writes
its record while a backup drains the schedule. The
resume itself, on a cluster, is tested in test_recovery.py.
"""


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


def test_step_backup_progress_moves_while_a_backup_drains_the_schedule(tmp_path):
    """StepBackup's progress.json is written by its own thread every period_s,
    so it follows the finished closures while the chief waits in a backup's
    drain. Before: it was written only from the closure hooks, which run when
    a closure is scheduled; the chief scheduled a whole interval at once and
    then waited, so a chief killed in the drain undercounted steps redone by
    up to every_steps."""
    import json
    import os
    import threading
    import types
    from tf_asyncps.callbacks.step_backup import StepBackup
    backup = StepBackup(str(tmp_path), every_steps=200, period_s=3600)
    done = [0]
    backup._strategy = types.SimpleNamespace(closures_done_per_worker=lambda: [done[0], 0])
    backup.set_model(types.SimpleNamespace(steps_per_execution=10))
    backup._scheduled = 200  # the interval is scheduled; the drain waits

    class Waits(threading.Event):  # each period, 7 more closures have ended
        def wait(self, timeout=None):
            done[0] += 7
            return done[0] > 14  # set after two periods

    backup._write_every_period(Waits())
    with open(os.path.join(str(tmp_path), "progress.json")) as f:
        assert json.load(f)["steps_done"] == 140  # 14 closures x 10 steps
    done[0] = 25  # at most the steps scheduled
    backup._write_progress()
    with open(os.path.join(str(tmp_path), "progress.json")) as f:
        assert json.load(f)["steps_done"] == 200
