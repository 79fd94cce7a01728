"""local_sgd (LocalSGD): exactness with one worker, exact sums with several."""

import pytest

import tf_asyncps
from conftest import run_scenario

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, "4"])
def test_sync_every_must_be_a_positive_int(bad):
    with pytest.raises(ValueError, match="sync_every"):
        tf_asyncps.policies.get("local_sgd", sync_every=bad)


def test_registered_with_its_default():
    p = tf_asyncps.policies.get("local_sgd")
    assert isinstance(p, tf_asyncps.policies.LocalSGD)
    assert p.get_config() == {"sync_every": 16}


ONE_WORKER = {
    "sgd": dict(policy="local_sgd", policy_args={"sync_every": 3}, epochs=2,
                steps_per_epoch=20),
    "momentum_spe4": dict(policy="local_sgd", optimizer="momentum",
                          policy_args={"sync_every": 4}, epochs=2, steps_per_epoch=20,
                          steps_per_execution=4),
}


@pytest.fixture(scope="module")
def one_worker_fits():
    """Both one-worker cases, one strategy each, on one cluster."""
    runs = run_scenario("single_worker_fits", shared=(1, 1), cases=list(ONE_WORKER.values()),
                        timeout=240)["runs"]
    return dict(zip(ONE_WORKER, runs))


@pytest.mark.cluster
def test_one_worker_equals_plain_sgd(one_worker_fits):
    """sync_every=3 with 20 steps per epoch: windows end mid-epoch and the
    drain at each epoch end pushes the rest; the result is plain SGD."""
    r = one_worker_fits["sgd"]
    assert r["moved"] > 1e-2
    assert r["max_abs_diff"] < 1e-5
    s = r["stats"]
    assert s["local_steps"] == 40  # every step counted
    # Per epoch: exchanges at the starts of closures 4, 7, ..., 19 (6), plus
    # the drain's push of the last 2 steps.
    assert s["applied"] == s["global_step"] == 14 and s["dropped"] == 0
    assert s["max"] == 0  # one worker: tau is always 0
    assert r["iterations"] == 40  # the optimizer's counter is pushed exactly


@pytest.mark.cluster
def test_one_worker_with_steps_per_execution_equals_plain_sgd(one_worker_fits):
    """Regression (fresh-user check): with steps_per_execution > 1 the
    exchange raced with the closure's steps and lost about one step each."""
    r = one_worker_fits["momentum_spe4"]
    assert r["moved"] > 1e-2
    assert r["max_abs_diff"] < 1e-5
    s = r["stats"]
    assert s["local_steps"] == 40 and r["iterations"] == 40
    # Per epoch: exchanges at the starts of closures 2..5, then the drain.
    assert s["applied"] == s["global_step"] == 10


@pytest.mark.cluster
def test_several_workers_sum_exactly_and_pull_chief_changes_also_inside_a_chain():
    # Run as chain("local_sgd"), which must train local copies exactly as
    # local_sgd alone (a chain that dropped its hooks trained as plain async:
    # local_steps 0); local_sgd alone: the other tests of this file.
    r = run_scenario("local_sgd_linear", shared=(3, 1), num_workers=3, steps=60, lr=0.5, sync_every=4,
                     chained=True)
    first, s = r["first"], r["stats"]
    # Gradient 1 everywhere: each local step moves w by -0.5, whoever runs it.
    assert first["w"] == [2.0 - 0.5 * 60] * 4
    assert first["iterations"] == 60
    assert first["stats"]["local_steps"] == 60
    fs = first["stats"]
    assert fs["applied"] == fs["global_step"]
    # At most one exchange per sync_every steps per worker, plus one drain push each.
    assert 60 // 4 // 3 <= fs["applied"] <= 60 // 4 + 3
    # After the chief's assign, workers continued from 100, not from their copies.
    assert r["w"] == [100.0 - 0.5 * 60] * 4
    assert r["iterations"] == 120 and s["local_steps"] == 120


@pytest.mark.cluster
def test_optimizer_slots_stay_on_the_worker():
    """#24: an exchange moves the model, not the optimizer's slots (tf_keras
    SGD makes a model-sized momentum slot even at momentum 0; exchanging it
    moved two models each way per window). Summed slot deltas of several
    workers meant nothing anyway: the PS copy of the slot keeps its initial
    value, and each worker's momentum carries across its exchanges."""
    r = run_scenario("local_sgd_momentum_slots", shared=(2, 1), num_workers=2, steps=40,
                     lr=0.1, momentum=0.5, sync_every=4)
    assert r["slots_on_ps"] == [[0.0] * 4]
    assert r["exchanged"] == ["iteration:0", "learning_rate:0", "w:0"]
    assert r["iterations"] == 40 and r["stats"]["local_steps"] == 40
    # Each step moves w by m_k = -lr (1 - 0.5^k) / 0.5 for the worker's k-th
    # step: between -0.1 and -0.2; 40 steps in all.
    assert all(2.0 - 0.2 * 40 <= x <= 2.0 - 0.1 * 40 for x in r["w"])
