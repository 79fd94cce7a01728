"""StalenessLogger's console lines follow fit's verbose (no cluster: a stand-in
strategy gives the counters); its summary writer is closed when fit ends, and
ProgressLine says why it stopped drawing (issue #26, item 1)."""

import dataclasses
import json

import numpy as np
import pytest

from tf_asyncps.callbacks import StalenessLogger
from tf_asyncps.core.staleness import StalenessStats


class _Strategy:
    """Counters before and after one epoch of 10 applied steps, τ 1 each."""

    def __init__(self):
        self.calls = 0

    def staleness_stats(self):
        self.calls += 1
        hist = np.zeros(4, np.int64)
        if self.calls > 1:
            hist[1] = 10
        n = int(hist.sum())
        return StalenessStats(global_step=n, applied=n, dropped=0, histogram=hist,
                              dropped_histogram=np.zeros(4, np.int64),
                              mean=1.0 if n else 0.0, max=1 if n else 0)

    def closures_done_per_worker(self):
        return [10]


def _one_epoch(logger, verbose):
    logger._strategy = _Strategy()
    logger.set_params({"verbose": verbose, "epochs": 1, "steps": 10})
    logger.on_epoch_begin(0)
    logger.on_epoch_end(0, {"loss": 0.5})
    return logger.epochs[-1]


@pytest.mark.parametrize("verbose,lines", [(0, 0), (1, 1), (2, 1)])
def test_default_logger_is_silent_under_verbose_0(verbose, lines, capsys):
    rec = _one_epoch(StalenessLogger(), verbose)
    out = capsys.readouterr().out.splitlines()
    assert len(out) == lines
    assert all(l.startswith("epoch 1/1: loss=0.5") and "tau_mean=1.00 tau_max=1" in l
               for l in out)
    assert rec["applied"] == 10 and rec["tau_max"] == 1  # recorded either way


def test_a_print_fn_gets_every_line_whatever_verbose_says():
    got = []
    _one_epoch(StalenessLogger(print_fn=got.append), 0)
    assert len(got) == 1 and got[0].startswith("epoch 1/1: loss=0.5")


def test_staleness_stats_print_as_one_readable_line():
    hist = np.zeros(33, np.int64)
    hist[[0, 1, 32]] = [90, 50, 3]
    dropped = np.zeros(33, np.int64)
    dropped[5] = 2
    stats = StalenessStats(global_step=143, applied=143, dropped=2, histogram=hist,
                           dropped_histogram=dropped, mean=0.7832, max=40, nonfinite=0,
                           retried_closures=1)
    assert repr(stats) == str(stats) == (
        "StalenessStats(global_step=143, applied=143, dropped=2, mean=0.783, max=40, "
        "histogram={0: 90, 1: 50, '>=32': 3}, dropped_histogram={5: 2}, retried_closures=1)")
    empty = StalenessStats(global_step=0, applied=0, dropped=0, histogram=np.zeros(33, np.int64),
                           dropped_histogram=np.zeros(33, np.int64), mean=0.0, max=0)
    assert repr(empty) == ("StalenessStats(global_step=0, applied=0, dropped=0, mean=0, max=0, "
                           "histogram={})")
    assert "parts" not in empty.to_dict()
    routed = dataclasses.replace(empty, parts={"sparse": 7, "dense": 2})
    assert repr(routed).endswith("histogram={}, parts={'sparse': 7, 'dense': 2})")
    assert json.loads(json.dumps(routed.to_dict()))["parts"] == {"sparse": 7, "dense": 2}


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
