"""local_sgd (LocalSGD): exactness with one worker, exact sums with several.

Each cluster scenario sits above the test that reads it and returns the
dataclass declared with it (docs/tests.md#scenarios-beside-their-tests); the
one-worker fits are test_fit_exactness.py's ``single_worker_fits``."""

import dataclasses
import re

import pytest
import tensorflow as tf
import tf_keras

import tf_asyncps
from conftest import run_scenario
from scenarios import cluster, scenario
from scenarios.common import run_steps, step_fn
from test_fit_exactness import single_worker_fits
from tf_asyncps import StalenessStats
from tf_asyncps.core.local_copies import exchange_rule

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, "4"])
def test_sync_every_must_be_a_positive_int(bad):
    with pytest.raises(ValueError, match="sync_every"):
        tf_asyncps.policies.get("local_sgd", sync_every=bad)


def test_registered_with_its_default():
    p = tf_asyncps.policies.get("local_sgd")
    assert isinstance(p, tf_asyncps.policies.LocalSGD)
    assert p.get_config() == {"sync_every": 16, "exchange": "sum"}


@pytest.mark.parametrize("bad", ["avg", "Mean", "", None, 2, ("mean",)])
def test_exchange_must_be_sum_or_mean(bad):
    with pytest.raises(ValueError, match=r"local_sgd: exchange must be one of \['sum', "
                       r"'mean'\].*got " + re.escape(repr(bad))):
        tf_asyncps.policies.LocalSteps(sync_every=4, exchange=bad)


@pytest.mark.parametrize("exchange", ["sum", "mean"])
def test_get_config_round_trips_the_exchange(exchange):
    p = tf_asyncps.policies.LocalSteps(sync_every=4, exchange=exchange)
    assert p.get_config() == {"sync_every": 4, "exchange": exchange}
    again = type(p)(**p.get_config())
    assert again.get_config() == p.get_config() and again.exchange == exchange
    assert repr(p) == f"LocalSGD(sync_every=4, exchange={exchange!r})"
    # The rule the engine's exchange takes: the policy's own, a route's or a
    # chain's part on local steps; "sum" for a policy that names none.
    route = tf_asyncps.policies.route(sparse="async", dense=p)
    assert exchange_rule(p) == exchange_rule(route) == exchange
    assert exchange_rule(tf_asyncps.policies.chain(type(p)(**p.get_config()))) == exchange
    assert exchange_rule(tf_asyncps.policies.get("async")) == "sum"


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
    runs = run_scenario(single_worker_fits, shared=(1, 1), cases=list(ONE_WORKER.values()),
                        timeout=240).runs
    return dict(zip(ONE_WORKER, runs))


@pytest.mark.cluster
def test_one_worker_equals_plain_sgd(one_worker_fits):
    """sync_every=3 with 20 steps per epoch: windows end mid-epoch and the
    drain at each epoch end pushes the rest; the result is plain SGD."""
    r = one_worker_fits["sgd"]
    assert r.moved > 1e-2
    assert r.max_abs_diff < 1e-5
    s = r.stats
    assert s.local_steps == 40  # every step counted
    # Per epoch: exchanges at the starts of closures 4, 7, ..., 19 (6), plus
    # the drain's push of the last 2 steps.
    assert s.applied == s.global_step == 14 and s.dropped == 0
    assert s.max == 0  # one worker: tau is always 0
    assert r.iterations == 40  # the optimizer's counter is pushed exactly


@pytest.mark.cluster
def test_one_worker_with_steps_per_execution_equals_plain_sgd(one_worker_fits):
    """Regression (fresh-user check): with steps_per_execution > 1 the
    exchange raced with the closure's steps and lost about one step each."""
    r = one_worker_fits["momentum_spe4"]
    assert r.moved > 1e-2
    assert r.max_abs_diff < 1e-5
    s = r.stats
    assert s.local_steps == 40 and r.iterations == 40
    # Per epoch: exchanges at the starts of closures 2..5, then the drain.
    assert s.applied == s.global_step == 10


# -- several workers: loss = sum(w) ------------------------------------------------
@dataclasses.dataclass(frozen=True)
class LocalSgdRun:
    """One run of ``steps`` scheduled steps and its drain.

    Attributes:
      w: w at the end (2.0 * ones([dim]) at first).
      iterations: the optimizer's step counter at the end (int).
      stats: the strategy's staleness counters.
    """
    w: list[float]
    iterations: int
    stats: StalenessStats


@dataclasses.dataclass(frozen=True)
class LocalSgdLinear:
    """Two runs: the first from w = 2.0, then the chief assigns w = 100.0
    and the second runs; ``w``, ``iterations`` and ``stats`` after both.

    Attributes:
      first: the state after the first run.
      w: w at the end.
      iterations: the optimizer's step counter at the end (int).
      stats: the strategy's staleness counters at the end.
    """
    first: LocalSgdRun
    w: list[float]
    iterations: int
    stats: StalenessStats


@scenario(shares_cluster=True)
def local_sgd_linear(num_workers=3, steps=60, lr=0.5, dim=4, sync_every=4,
                     chained=False, exchange="sum") -> LocalSgdLinear:
    """local_sgd with loss = sum(w) (gradient 1): every local step moves a
    worker's copy by -lr, so after the drain w == w0 - lr * steps exactly
    (``exchange="sum"``) or w0 - lr * steps / num_workers (``"mean"``: each
    step lands in exactly one pushed delta, divided by num_workers).
    ``chained``: the policy inside ``chain(...)``."""
    policy = tf_asyncps.policies.get("local_sgd", sync_every=sync_every, exchange=exchange)
    with cluster(num_workers=num_workers, num_ps=1) as c:
        strategy = tf_asyncps.AsyncParameterServerStrategy(
            c.resolver(), update_policy=tf_asyncps.policies.chain(policy) if chained else policy)
        coord = tf.distribute.coordinator.ClusterCoordinator(strategy)
        with strategy.scope():
            w = tf.Variable(tf.fill([dim], 2.0), name="w")
            opt = tf_keras.optimizers.SGD(lr)
        run_steps(coord, step_fn(strategy, [w], opt, lambda: tf.reduce_sum(w)), steps)
        first = LocalSgdRun(w=w.numpy().tolist(), iterations=int(opt.iterations.numpy()),
                            stats=strategy.staleness_stats())
        # The chief changes the model between runs: workers must pull it.
        w.assign(tf.fill([dim], 100.0))
        run_steps(coord, step_fn(strategy, [w], opt, lambda: tf.reduce_sum(w)), steps)
        return LocalSgdLinear(first=first, w=w.numpy().tolist(),
                              iterations=int(opt.iterations.numpy()),
                              stats=strategy.staleness_stats())


@pytest.mark.cluster
def test_several_workers_sum_exactly_and_pull_chief_changes_also_inside_a_chain():
    # Run as chain("local_sgd"), which must train local copies exactly as
    # local_sgd alone (a chain that dropped its hooks trained as plain async:
    # local_steps 0); local_sgd alone: the other tests of this file.
    r = run_scenario(local_sgd_linear, shared=(3, 1), num_workers=3, steps=60, lr=0.5, sync_every=4,
                     chained=True)
    first, s = r.first, r.stats
    # Gradient 1 everywhere: each local step moves w by -0.5, whoever runs it.
    assert first.w == [2.0 - 0.5 * 60] * 4
    assert first.iterations == 60
    assert first.stats.local_steps == 60
    fs = first.stats
    assert fs.applied == fs.global_step
    # At most one exchange per sync_every steps per worker, plus one drain push each.
    assert 60 // 4 // 3 <= fs.applied <= 60 // 4 + 3
    # After the chief's assign, workers continued from 100, not from their copies.
    assert r.w == [100.0 - 0.5 * 60] * 4
    assert r.iterations == 120 and s.local_steps == 120


@pytest.mark.cluster
def test_the_mean_exchange_averages_the_weights_and_sums_the_counters():
    """exchange="mean", 3 workers: a pushed delta of the trainable w counts
    1/3, whatever the split of the steps (gradient 1: each local step is -lr
    in exactly one delta), while the optimizer's step counter (not
    trainable) is still summed: it ends at the number of steps."""
    r = run_scenario(local_sgd_linear, shared=(3, 1), num_workers=3, steps=60, lr=0.5,
                     sync_every=4, exchange="mean")
    first = r.first
    # Up to the float32 rounding of each pushed third (ulp of 100: 7.6e-6;
    # about 20 pushes per run).
    assert first.w == pytest.approx([2.0 - 0.5 * 60 / 3] * 4, abs=2e-4)
    assert first.iterations == 60 and first.stats.local_steps == 60
    # After the chief's assign, the workers continued from 100.
    assert r.w == pytest.approx([100.0 - 0.5 * 60 / 3] * 4, abs=2e-4)
    assert r.iterations == 120 and r.stats.local_steps == 120


# -- the optimizer's slots -----------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class LocalSgdMomentumSlots:
    """local_sgd with SGD momentum on loss = sum(w), w = 2.0 * ones([4]).

    Attributes:
      w: w at the end.
      iterations: the optimizer's step counter at the end (int).
      slots_on_ps: the PS copies of the optimizer's non-scalar variables
        (its momentum slot), after the drain.
      exchanged: the names of the variables an exchange moves, sorted.
      stats: the strategy's staleness counters.
    """
    w: list[float]
    iterations: int
    slots_on_ps: list[list[float]]
    exchanged: list[str]
    stats: StalenessStats


@scenario(shares_cluster=True)
def local_sgd_momentum_slots(num_workers=2, steps=40, lr=0.1, momentum=0.5,
                             sync_every=4) -> LocalSgdMomentumSlots:
    """local_sgd with SGD momentum on loss = sum(w): the momentum slot is each
    worker's own state. Returns the PS copy of the slot after the drain and
    the names of the variables an exchange moves."""
    policy = tf_asyncps.policies.get("local_sgd", sync_every=sync_every)
    with cluster(num_workers=num_workers, num_ps=1) as c:
        strategy = tf_asyncps.AsyncParameterServerStrategy(c.resolver(), update_policy=policy)
        coord = tf.distribute.coordinator.ClusterCoordinator(strategy)
        with strategy.scope():
            w = tf.Variable(tf.fill([4], 2.0), name="w")
            opt = tf_keras.optimizers.SGD(lr, momentum=momentum)
        run_steps(coord, step_fn(strategy, [w], opt, lambda: tf.reduce_sum(w)), steps)
        local = strategy.extended.engine.local
        slots = [v for v in opt.variables if v.shape.rank]
        return LocalSgdMomentumSlots(
            w=w.numpy().tolist(), iterations=int(opt.iterations.numpy()),
            slots_on_ps=[v.numpy().tolist() for v in slots],
            exchanged=sorted(c.master.name for c in local.exchanged(local._copies.values())),
            stats=strategy.staleness_stats())


@pytest.mark.cluster
def test_optimizer_slots_stay_on_the_worker():
    """#24: an exchange moves the model, not the optimizer's slots (tf_keras
    SGD makes a model-sized momentum slot even at momentum 0; exchanging it
    moved two models each way per window). Summed slot deltas of several
    workers meant nothing anyway: the PS copy of the slot keeps its initial
    value, and each worker's momentum carries across its exchanges."""
    r = run_scenario(local_sgd_momentum_slots, shared=(2, 1), num_workers=2, steps=40,
                     lr=0.1, momentum=0.5, sync_every=4)
    assert r.slots_on_ps == [[0.0] * 4]
    assert r.exchanged == ["iteration:0", "learning_rate:0", "w:0"]
    assert r.iterations == 40 and r.stats.local_steps == 40
    # Each step moves w by m_k = -lr (1 - 0.5^k) / 0.5 for the worker's k-th
    # step: between -0.1 and -0.2; 40 steps in all.
    assert all(2.0 - 0.2 * 40 <= x <= 2.0 - 0.1 * 40 for x in r.w)
