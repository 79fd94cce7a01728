"""Worker failures mid-fit (#6): SIGKILL with a supervised restart, SIGSTOP.

ClusterCoordinator runs each closure at least once: a closure in flight on a
killed worker runs again elsewhere, possibly after part of it ran. The stats
report those retries (``retried_closures``), so the accounting identity is
checked with them allowed for, not hidden.
"""

import pytest

from conftest import run_scenario


@pytest.mark.timeout(240)
@pytest.mark.cluster
def test_worker_sigkill_rejoin_and_sigstop_on_digits():
    # worker:1 SIGKILLed (restarted by the supervisor) while worker:0 is
    # SIGSTOPped for 5 s. No progress is required during the stop: fit joins
    # at every epoch end, which waits for the stopped worker's closure.
    r = run_scenario("worker_faults_digits", policy="async", epochs=16,
                     steps_per_epoch=100, spe=10, kill_after=150, stop_s=5.0)
    ev, s = r["events"], r["stats"]
    assert ev.get("faults"), ev
    # Restarted once by the supervisor, and rejoined: it completed closures
    # after its restart.
    assert r["restarts"] == {"worker:1": 1} and r["gave_up"] == {}
    assert "rejoined_at_step" in ev and r["done"][1] > ev["done_at_kill"][1], r
    assert s["worker_failures"] >= 1 and s["retried_closures"] >= 1
    # Every scheduled closure completed once; re-executed steps are reported,
    # at most one closure's worth per retry (async drops nothing).
    assert sum(r["done"]) == r["scheduled"] // r["spe"]
    assert s["dropped"] == 0 and s["global_step"] == s["applied"]
    assert r["scheduled"] <= s["applied"] <= r["scheduled"] + r["spe"] * s["retried_closures"]
    assert r["test_accuracy"] >= 0.85
