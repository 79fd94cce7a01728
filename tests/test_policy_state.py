"""The policy protocol's state model, in one process (fast tier).

``build(num_workers, device)`` returns a policy's per-cluster state as
``init(variables)`` returns its per-variable state; the engine holds both, so
one policy object can serve two strategies. A policy's own variables are
created untracked beside the model (``tf_asyncps.policies.beside``),
``get_config`` keeps every constructor argument, and an unregistered policy is
named after its class.
"""

import inspect
import os

import numpy as np
import pytest
import tensorflow as tf
import tf_keras

from local_engine import CPU, local_engine
from tf_asyncps import policies
from tf_asyncps.core import placement
from tf_asyncps.core.worker_gate import WorkerGate
from tf_asyncps.policies.route import PartCounts
from tf_asyncps.policies.ssp import Clocks
from tf_asyncps.policies.sync_replicas import Rounds


def _steps(engine, n):
    """``n`` whole worker steps of worker 0 (before_read ... after_step),
    traced in the engine's policy scope as the strategy traces them."""
    w = tf.Variable([1.0, 2.0])
    engine.track_variable(w, trainable=True)
    opt = tf_keras.optimizers.SGD(0.5)

    @tf.function
    def step():
        def fn():
            opt.apply_gradients([(tf.constant([1.0, 1.0]), w)])
        with engine.policy_scope():
            engine.worker_step(fn, index=lambda: tf.constant(0, tf.int64))()

    for _ in range(n):
        step()
    return w


@pytest.mark.parametrize("name,args,read", [
    ("ssp", {"max_staleness": 0, "timeout_s": 30}, lambda p: p.clock_values().tolist()),
    ("sync_replicas", {"replicas_to_aggregate": 1, "timeout_s": 30},
     lambda p: [p.rounds()])])
def test_one_policy_object_serves_two_engines_each_with_its_own_cluster_state(name, args, read):
    policy = policies.get(name, **args)
    first, second = local_engine(policy), local_engine(policy)
    w1, w2 = _steps(first, 3), _steps(second, 1)
    assert w1.numpy().tolist() == [1.0 - 3 * 0.5, 2.0 - 3 * 0.5]
    assert w2.numpy().tolist() == [1.0 - 0.5, 2.0 - 0.5]
    with first.policy_scope():
        assert read(policy) == [3]
        dog = first.watchdogs()[-1]  # the gate (after the update lock, if any)
    with second.policy_scope():
        assert read(policy) == [1]
        dog2 = second.watchdogs()[-1]
    assert isinstance(dog, WorkerGate) and dog is not dog2  # each strategy's gate
    assert read(policy) == [1]  # outside any engine: the latest build
    assert first.tracker.stats().applied == 3 and second.tracker.stats().applied == 1
    for e in (first, second):
        e.stop_watchdogs()


def _state_on(obj):
    """Attributes of ``obj`` holding cluster resources (there must be none)."""
    return sorted(k for k, v in vars(obj).items()
                  if isinstance(v, (tf.Variable, WorkerGate, tf.CriticalSection)))


def test_build_returns_the_cluster_state_and_the_policy_keeps_none():
    ssp = policies.get("ssp", max_staleness=1)
    clocks = ssp.build(2, CPU)
    assert isinstance(clocks, Clocks) and clocks.clocks.numpy().tolist() == [0, 0]
    assert ssp.cluster is clocks and ssp.gate is clocks.gate and _state_on(ssp) == []
    agg = policies.get("sync_replicas", replicas_to_aggregate=2)
    rounds = agg.build(2, CPU)
    assert isinstance(rounds, Rounds) and rounds.num_workers == 2 and _state_on(agg) == []
    route = policies.route(sparse="ssp", dense="sync_replicas")
    counts = route.build(2, CPU)
    assert isinstance(counts, PartCounts) and counts.counts.numpy().tolist() == [0, 0]
    assert [type(s) for s in counts.parts] == [Clocks, Rounds]
    assert route.parts[0].cluster is counts.parts[0]
    assert _state_on(route) == [] and all(_state_on(p) == [] for p in route.parts)
    assert policies.get("async").build(2, CPU) == ()


def test_a_policy_never_built_says_so():
    ssp = policies.get("ssp")
    assert ssp.gate is None and not ssp.built
    with pytest.raises(RuntimeError, match=r"SSP\(.*\) has no cluster state: "
                                           r"build\(num_workers, device\) was not called"):
        ssp.clock_values()


_ARGS = {"async": {}, "drop_stale": {"max_staleness": 5},
         "staleness_aware": {"mode": "inverse_plus_one"},
         "ssp": {"max_staleness": 3, "timeout_s": 7.0},
         "dc_asgd": {"lambda_": 0.5, "adaptive": True, "momentum": 0.5, "epsilon": 1e-3},
         "sync_replicas": {"replicas_to_aggregate": 2, "total_num_replicas": 3,
                           "max_staleness": 1, "timeout_s": 9.0},
         "local_sgd": {"sync_every": 4, "exchange": "mean"}}


@pytest.mark.parametrize("name", sorted(_ARGS))
def test_get_config_keeps_every_constructor_argument(name):
    exported = [getattr(policies, n) for n in policies.__all__]
    builtin = {c.name for c in exported if isinstance(c, type)
               and issubclass(c, policies.UpdatePolicy) and c.name in policies.names()}
    assert builtin == set(_ARGS)  # every registered policy of the package
    p = policies.get(name, **_ARGS[name])
    config = p.get_config()
    assert config == _ARGS[name] or set(config) == set(_ARGS[name])
    assert set(config) == set(inspect.signature(type(p)).parameters)
    assert {k: config[k] for k in _ARGS[name]} == _ARGS[name]
    assert type(p)(**config).get_config() == config


def test_an_unregistered_policy_reports_its_class_name():
    class Mine(policies.UpdatePolicy):
        def update(self, grads, state, info):
            return grads, True

    class Slower(policies.SSP):
        pass

    assert Mine().name == "Mine" and repr(Mine()) == "Mine()"
    assert Slower().name == "Slower"
    assert policies.get("ssp").name == "ssp" and policies.UpdatePolicy.name == "UpdatePolicy"

    @policies.register("mine_registered_test")
    class Registered(Mine):
        pass

    assert Registered().name == "mine_registered_test" and Mine().name == "Mine"


def test_beside_places_and_marks_policy_state_untracked():
    v = tf.Variable(np.zeros([3, 2], np.float32))
    assert not placement.creating_beside()
    with policies.beside(v):
        assert placement.creating_beside()
        with policies.beside(v):
            m = tf.Variable(tf.zeros([3, 2]), trainable=False)
        assert placement.creating_beside()
    assert not placement.creating_beside()
    assert m.device == v.device
    assert policies.beside is placement.beside and "beside" in policies.__all__


def test_the_readme_custom_policy_scales_sparse_gradients_without_densifying():
    """docs "Update policies" (docs/concepts/policies.md): the example policy,
    as printed there, keeps an IndexedSlices gradient sparse and round-trips
    its config."""
    import tf_asyncps
    page = open(os.path.join(os.path.dirname(os.path.dirname(__file__)), "docs", "concepts",
                               "policies.md")).read()
    head = 'import tensorflow as tf\nimport tf_asyncps\n\n@tf_asyncps.policies.register("halve_when_stale")'
    assert page.count(head) == 1
    code = page.split(head, 1)[1].split("\nstrategy = ", 1)[0]
    namespace = {"tf": tf, "tf_asyncps": tf_asyncps}
    exec('@tf_asyncps.policies.register("halve_when_stale_readme")' + code, namespace)  # noqa: S102
    policy = namespace["HalveWhenStale"](limit=2)
    assert policy.name == "halve_when_stale_readme" and policy.get_config() == {"limit": 2}
    rows = tf.IndexedSlices(tf.constant([[4.0, 2.0]]), tf.constant([3]), tf.constant([10, 2]))
    for tau, factor in ((3, 0.5), (2, 1.0)):
        t = tf.constant(tau, tf.int64)
        info = policies.StepInfo(tau=t, read_step=tf.constant(0, tf.int64), global_step=t,
                                 variables=[])
        (out,), keep = policy.update([rows], (), info)
        assert isinstance(out, tf.IndexedSlices) and keep is True
        assert out.values.numpy().tolist() == [[4.0 * factor, 2.0 * factor]]
        assert out.indices.numpy().tolist() == [3]
