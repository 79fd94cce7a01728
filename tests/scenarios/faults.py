"""Scenarios of tests/test_faults.py."""

import tf_keras

import tf_asyncps

from scenarios import cluster, scenario
from scenarios.common import stats_of


@scenario
def worker_faults_digits(policy="async", num_workers=2, epochs=16, steps_per_epoch=100,
                         spe=10, kill_after=150, stop_s=5.0):
    """Digits MLP under model.fit on a supervised LocalCluster: worker:1 is
    SIGKILLed mid-fit (the supervisor restarts it; it must rejoin) and, at
    the same moment, worker:0 is SIGSTOPped for ``stop_s`` s, then continued."""
    import signal
    import threading
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
        return {"events": ev, "restarts": dict(c.restarts), "gave_up": dict(c.gave_up),
                "done": strategy.closures_done_per_worker(),
                "scheduled": epochs * steps_per_epoch, "spe": spe,
                "test_accuracy": float(acc), "stats": stats_of(strategy)}
