"""Worker failures mid-fit (#6): SIGKILL with a supervised restart, SIGSTOP.

ClusterCoordinator runs each closure at least once: a closure in flight on a
killed worker runs again elsewhere, possibly after part of it ran. The stats
report those retries (``retried_closures``), so the accounting identity is
checked with them allowed for, not hidden.

The cluster scenario sits above the test that reads it and returns the
dataclass declared with it (docs/tests.md#scenarios-beside-their-tests).
"""

import dataclasses
import signal
import threading

import pytest
import tf_keras

import tf_asyncps
from conftest import run_scenario
from scenarios import cluster, scenario
from tf_asyncps import StalenessStats


@dataclasses.dataclass(frozen=True)
class WorkerFaultsDigits:
    """The digits MLP after model.fit with worker:1 SIGKILLed (and restarted
    by the supervisor) while worker:0 was SIGSTOPped.

    Attributes:
      events: what the fault thread saw: ``faults`` (True once both signals
        were sent), ``done_at_kill`` (closures completed per worker at the
        kill), ``steps_at_cont`` (worker steps at the SIGCONT),
        ``rejoined_at_step`` (worker steps when worker 1 completed a closure
        after its restart; absent if it never did).
      restarts: ``{task: restarts}`` the supervisor made.
      gave_up: ``{task: ...}`` the supervisor stopped restarting.
      done: closures completed per worker index at the end.
      scheduled: the steps fit scheduled (epochs * steps_per_epoch).
      spe: steps per execution (steps in one closure).
      test_accuracy: the trained weights' accuracy on the digits test split.
      stats: the strategy's staleness counters.
    """
    events: dict
    restarts: dict[str, int]
    gave_up: dict
    done: list[int]
    scheduled: int
    spe: int
    test_accuracy: float
    stats: StalenessStats


@scenario
def worker_faults_digits(policy="async", num_workers=2, epochs=16, steps_per_epoch=100,
                         spe=10, kill_after=150, stop_s=5.0) -> WorkerFaultsDigits:
    """Digits MLP under model.fit on a supervised LocalCluster: worker:1 is
    SIGKILLed mid-fit (the supervisor restarts it; it must rejoin) and, at
    the same moment, worker:0 is SIGSTOPped for ``stop_s`` s, then continued."""
    from tf_asyncps.app import datasets
    from tf_asyncps.app import models
    data = datasets.load("digits", seed=0)
    with cluster(num_workers=num_workers, num_ps=1) as c:
        c.supervise(max_restarts=2, poll_s=0.2)
        strategy = tf_asyncps.AsyncParameterServerStrategy(
            c.resolver(), update_policy=policy)
        with strategy.scope():
            model = models.build_model("mlp", data.num_features, data.num_classes, (64,), 0)
            model.compile(tf_keras.optimizers.SGD(0.1),
                          tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                          steps_per_execution=spe)
        ev = {}
        done = threading.Event()

        def faults():  # polls the counters (tf_keras has no batch hooks under PS)
            while not done.wait(0.02):
                if strategy.staleness_stats().worker_steps >= kill_after:
                    break
            else:
                return
            ev["done_at_kill"] = strategy.closures_done_per_worker()
            c.kill("worker:1")
            c.kill("worker:0", signal.SIGSTOP)
            ev["faults"] = True
            done.wait(stop_s)
            c.kill("worker:0", signal.SIGCONT)
            ev["steps_at_cont"] = strategy.staleness_stats().worker_steps
            while not done.wait(0.05):  # rejoined: worker 1 completes closures again
                if strategy.closures_done_per_worker()[1] > ev["done_at_kill"][1]:
                    ev["rejoined_at_step"] = strategy.staleness_stats().worker_steps
                    return

        t = threading.Thread(target=faults, daemon=True)
        t.start()
        try:
            model.fit(tf_keras.utils.experimental.DatasetCreator(
                datasets.make_dataset_fn(data.x_train, data.y_train, 32, 0)),
                epochs=epochs, steps_per_epoch=steps_per_epoch, verbose=0)
        finally:
            done.set()
            t.join(timeout=10)
            c.kill("worker:0", signal.SIGCONT)  # never leave it stopped
        local = models.build_model("mlp", data.num_features, data.num_classes, (64,), 0)
        local.set_weights(model.get_weights())
        local.compile(loss=tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
        acc = local.evaluate(data.x_test, data.y_test, verbose=0)[1]
        return WorkerFaultsDigits(
            events=ev, restarts=dict(c.restarts), gave_up=dict(c.gave_up),
            done=strategy.closures_done_per_worker(), scheduled=epochs * steps_per_epoch,
            spe=spe, test_accuracy=float(acc), stats=strategy.staleness_stats())


@pytest.mark.timeout(240)
@pytest.mark.cluster
def test_worker_sigkill_rejoin_and_sigstop_on_digits():
    # worker:1 SIGKILLed (restarted by the supervisor) while worker:0 is
    # SIGSTOPped for 5 s. No progress is required during the stop: fit joins
    # at every epoch end, which waits for the stopped worker's closure.
    r = run_scenario(worker_faults_digits, policy="async", epochs=16,
                     steps_per_epoch=100, spe=10, kill_after=150, stop_s=5.0)
    ev, s = r.events, r.stats
    assert ev.get("faults"), ev
    # Restarted once by the supervisor, and rejoined: it completed closures
    # after its restart.
    assert r.restarts == {"worker:1": 1} and r.gave_up == {}
    assert "rejoined_at_step" in ev and r.done[1] > ev["done_at_kill"][1], r
    assert s.worker_failures >= 1 and s.retried_closures >= 1
    # Every scheduled closure completed once; re-executed steps are reported,
    # at most one closure's worth per retry (async drops nothing).
    assert sum(r.done) == r.scheduled // r.spe
    assert s.dropped == 0 and s.global_step == s.applied
    assert r.scheduled <= s.applied <= r.scheduled + r.spe * s.retried_closures
    assert r.test_accuracy >= 0.85
