"""callbacks/recovery.py: ResumeTracker's progress, read by its writer thread
while an epoch ends, is never an epoch ahead (issue #26, item 1). The
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
