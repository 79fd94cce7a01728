"""Each policy's rule on hand-made tensors (closed form), the registry and chain."""

import numpy as np
import pytest
import tensorflow as tf

from tf_asyncps import policies
from tf_asyncps.policies import registry
from tf_asyncps.policies import StepInfo
from tf_asyncps.core.grads import all_finite
from tf_asyncps.policies.dc_asgd import delay_compensate
from tf_asyncps.policies.drop_stale import keep_if_fresh
from tf_asyncps.policies.staleness_aware import staleness_scale


def _info(tau, variables=(), read_values=None):
    t = tf.constant(tau, tf.int64)
    return StepInfo(tau=t, read_step=tf.constant(0, tf.int64), global_step=t,
                    variables=list(variables), read_values=read_values)


def _np(g):
    return tf.convert_to_tensor(g).numpy()


def test_registry_names_and_errors():
    assert {"async", "drop_stale", "staleness_aware", "ssp", "dc_asgd"} <= set(policies.names())
    assert isinstance(policies.get("drop_stale", max_staleness=2), policies.DropStale)
    with pytest.raises(ValueError, match=r"'nope' is not a registered policy.*async"):
        policies.get("nope")
    with pytest.raises(ValueError, match="bad arguments for policy 'drop_stale'"):
        policies.get("drop_stale", max_stale=2)
    with pytest.raises(ValueError, match="max_staleness must be an int >= 0"):
        policies.get("drop_stale", max_staleness=-1)
    with pytest.raises(ValueError, match="mode must be one of"):
        policies.get("staleness_aware", mode="sqrt")
    with pytest.raises(ValueError, match=r"dc_asgd: lambda_ must be >= 0 \(.*\), got -0\.1\."):
        policies.get("dc_asgd", lambda_=-0.1)
    p = policies.Async()
    assert policies.get(p) is p
    with pytest.raises(ValueError, match="pass them to its constructor"):
        policies.get(p, x=1)


#: (policy, count argument, its least value) for every policy that takes a count.
COUNTS = [("local_sgd", "sync_every", 1), ("drop_stale", "max_staleness", 0),
          ("ssp", "max_staleness", 0), ("sync_replicas", "replicas_to_aggregate", 1),
          ("sync_replicas", "max_staleness", 0)]


@pytest.mark.parametrize("name,arg,least", COUNTS)
def test_counts_take_numpy_ints_and_refuse_what_int64_cannot_hold(name, arg, least):
    """A fresh user's sync_every=10**20 was accepted and failed inside fit
    with TF's OverflowError, naming no argument; np.int64(4) was refused."""
    p = policies.get(name, **{arg: np.int64(least + 3)})
    assert getattr(p, arg) == least + 3 and type(getattr(p, arg)) is int
    for bad in (2 ** 63, 10 ** 20, least - 1, True, 2.0, "4", None):
        with pytest.raises(ValueError, match=rf"{name}: {arg} must be an int >= {least} "
                                             r"and < 2\*\*63 \(.+\), got "):
            policies.get(name, **{arg: bad})
    assert getattr(policies.get(name, **{arg: 2 ** 63 - 1}), arg) == 2 ** 63 - 1


def test_async_applies_as_is():
    g = [tf.constant([1.0, -2.0])]
    out, keep = policies.get("async").update(g, (), _info(7))
    assert keep is True and out[0] is g[0]


@pytest.mark.parametrize("tau,inverse,plus_one", [(0, 1.0, 1.0), (1, 1.0, 0.5),
                                                  (3, 1 / 3, 1 / 4), (9, 1 / 9, 1 / 10)])
def test_staleness_aware_scales(tau, inverse, plus_one):
    assert staleness_scale(tau, "inverse").numpy() == pytest.approx(inverse)
    assert staleness_scale(tau, "inverse_plus_one").numpy() == pytest.approx(plus_one)
    g = tf.constant([3.0, -6.0])
    out, keep = policies.StalenessAware("inverse").update([g], (), _info(tau))
    assert keep is True
    np.testing.assert_allclose(_np(out[0]), np.array([3.0, -6.0]) * inverse, rtol=1e-6)
    out, _ = policies.StalenessAware("inverse_plus_one").update([g], (), _info(tau))
    np.testing.assert_allclose(_np(out[0]), np.array([3.0, -6.0]) * plus_one, rtol=1e-6)


def test_staleness_aware_keeps_indexed_slices_sparse():
    g = tf.IndexedSlices(tf.constant([[3.0, 3.0]]), tf.constant([4], tf.int64),
                         tf.constant([10, 2], tf.int64))
    out, _ = policies.StalenessAware().update([g], (), _info(3))
    assert isinstance(out[0], tf.IndexedSlices)
    np.testing.assert_allclose(out[0].values.numpy(), [[1.0, 1.0]])
    assert out[0].indices.numpy().tolist() == [4]


def test_drop_stale_boundary():
    p = policies.DropStale(max_staleness=2)
    assert bool(p.update([tf.ones(1)], (), _info(2))[1]) is True
    assert bool(p.update([tf.ones(1)], (), _info(3))[1]) is False
    assert bool(keep_if_fresh(0, 0)) and not bool(keep_if_fresh(1, 0))
    assert p.atomic  # decided on exact tau under the PS lock


def test_dc_asgd_rule_closed_form():
    g = tf.constant([2.0])
    # g + lambda * g * g * gap = 2 + 0.5 * 4 * 0.1 = 2.2
    np.testing.assert_allclose(delay_compensate(g, tf.constant([1.1]), tf.constant([1.0]),
                                                0.5).numpy(), [2.2], rtol=1e-6)
    np.testing.assert_allclose(delay_compensate(g, tf.constant([1.1]), tf.constant([1.0]),
                                                0.0).numpy(), [2.0])
    np.testing.assert_allclose(delay_compensate(g, tf.constant([1.0]), tf.constant([1.0]),
                                                0.5).numpy(), [2.0])


def test_dc_asgd_policy_dense_and_sparse():
    w = tf.Variable([1.1, 5.0])
    read = tf.constant([1.0, 5.0])
    p = policies.DCASGD(lambda_=0.5)
    out, keep = p.update([tf.constant([2.0, 3.0])], p.init([w]), _info(1, [w], [read]))
    assert keep is True
    np.testing.assert_allclose(out[0].numpy(), [2.2, 3.0], rtol=1e-6)
    # Sparse: only the touched rows are compensated, and the result stays sparse.
    e = tf.Variable([[1.1, 1.1], [7.0, 7.0], [2.0, 2.0]])
    e_read = tf.constant([[1.0, 1.0], [0.0, 0.0], [2.0, 2.0]])
    g = tf.IndexedSlices(tf.constant([[2.0, 2.0]]), tf.constant([0]), tf.constant([3, 2]))
    out, _ = p.update([g], p.init([e]), _info(1, [e], [e_read]))
    assert isinstance(out[0], tf.IndexedSlices)
    np.testing.assert_allclose(out[0].values.numpy(), [[2.2, 2.2]], rtol=1e-6)
    # No read value known (variable created later): gradient unchanged.
    out, _ = p.update([tf.constant([2.0, 3.0])], (), _info(1, [w], [None]))
    np.testing.assert_allclose(out[0].numpy(), [2.0, 3.0])


def test_dc_asgd_adaptive_rule():
    w = tf.Variable([1.1])
    p = policies.DCASGD(lambda_=0.5, adaptive=True, momentum=0.0, epsilon=1e-12)
    state = p.init([w])
    out, _ = p.update([tf.constant([2.0])], state, _info(1, [w], [tf.constant([1.0])]))
    # meansquare = g^2 = 4 -> lambda_t = 0.5 / 2 = 0.25 -> 2 + 0.25 * 4 * 0.1 = 2.1
    np.testing.assert_allclose(out[0].numpy(), [2.1], rtol=1e-5)
    np.testing.assert_allclose(state[0].numpy(), [4.0])


class _Waker(policies.UpdatePolicy):
    """A rule whose decision carries an after_apply (as sync_replicas' wake)."""

    def __init__(self, tag):
        super().__init__()
        self.tag = tag

    def update(self, grads, state, info):
        return policies.Decision(grads, True, after_apply=lambda: [self.tag])


def test_chain_and_route_keep_their_members_after_apply():
    d = policies.chain(_Waker("a"), policies.DropStale(max_staleness=3), _Waker("b")).update(
        [tf.constant([1.0])], [None, None, None], _info(0))
    assert d.after_apply() == ["a", "b"]
    r = policies.route(sparse=_Waker("s"), dense=_Waker("d"))
    emb, dense = tf.Variable([[1.0]], name="embeddings"), tf.Variable([1.0], name="kernel")
    r.build(1, "/cpu:0")
    info = _info(0, variables=[emb, dense])
    d = r.update([tf.constant([[1.0]]), tf.constant([1.0])], r.init([emb, dense]), info)
    assert sorted(d.after_apply()) == ["d", "s"]
    assert policies.chain(policies.DropStale(max_staleness=3)).update(
        [tf.constant([1.0])], [None], _info(0)).after_apply is None


def test_chain_composes_in_order_and_ands_keep():
    c = policies.chain(policies.StalenessAware("inverse_plus_one"),
                       policies.DropStale(max_staleness=3))
    assert c.atomic
    d = c.update([tf.constant([4.0])], c.init([]), _info(3))
    np.testing.assert_allclose(d.grads[0].numpy(), [1.0])
    assert bool(d.keep) is True and d.accepted is None and d.after_apply is None
    assert bool(c.update([tf.constant([4.0])], c.init([]), _info(4)).keep) is False
    with pytest.raises(ValueError, match="at least one policy"):
        policies.chain()


def test_all_finite_guard():
    assert bool(all_finite([tf.constant([1.0, 2.0])]))
    assert not bool(all_finite([tf.constant([1.0]), tf.constant([np.nan])]))
    assert not bool(all_finite([tf.IndexedSlices(tf.constant([[np.inf]]), tf.constant([0]),
                                                 tf.constant([3, 1]))]))


def test_all_finite_checks_small_gradients_together_and_large_ones_alone():
    big = np.zeros([1 << 16], np.float32)
    small = [np.zeros([3, 2], np.float32), np.zeros([4], np.float32),
             np.zeros([2, 2], np.float64), np.zeros([5], np.float64)]

    @tf.function
    def check(big, s0, s1, d0, d1):
        return all_finite([big, tf.IndexedSlices(s0, tf.constant([0, 2, 4]),
                                                 tf.constant([9, 2])), s1, d0, d1])

    args = [big] + small
    assert bool(check(*args))
    for i, value in ((0, np.nan), (1, np.inf), (2, -np.inf), (3, np.nan), (4, np.inf)):
        bad = [a.copy() for a in args]
        bad[i].flat[-1] = value
        assert not bool(check(*bad)), (i, value)
    # One check per dtype's small gradients, one for the large one.
    ops = [op.type for op in check.get_concrete_function(*args).graph.get_operations()]
    assert ops.count("IsFinite") == 3 and ops.count("ConcatV2") == 2


def test_ssp_arguments():
    with pytest.raises(ValueError, match="max_staleness must be an int >= 0"):
        policies.get("ssp", max_staleness=-2)
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        policies.get("ssp", max_staleness=1, timeout_s=0)


def test_readme_custom_policy_registers_in_under_30_lines(monkeypatch):
    # The registry is process-wide: the name leaves it with this test (it
    # made test_cli's "every registered policy" fail when run after it).
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))

    @policies.register("halve_when_stale_test")
    class HalveWhenStale(policies.UpdatePolicy):
        def __init__(self, limit=2):
            self.limit = limit

        def update(self, grads, state, info):
            factor = tf.where(info.tau > self.limit, 0.5, 1.0)
            return [g * tf.cast(factor, g.dtype) for g in grads], True

    p = policies.get("halve_when_stale_test", limit=1)
    out, _ = p.update([tf.constant([4.0])], (), _info(2))
    np.testing.assert_allclose(out[0].numpy(), [2.0])
    with pytest.raises(ValueError, match="already registered"):
        policies.register("async")(HalveWhenStale)


def test_chain_forwards_every_hook_of_the_protocol():
    """Every method UpdatePolicy declares is overridden by Chain (itself or
    its Composite base), so a hook added to the protocol without a forward
    in chain() fails here."""
    hooks = {n for n, v in vars(policies.UpdatePolicy).items()
             if callable(v) and not n.startswith("_")}
    assert {"before_read", "after_step", "step_without_update", "attach", "watchdogs",
            "exchange_due", "build", "init", "update", "validate_cluster"} <= hooks
    missing = sorted(h for h in hooks
                     if getattr(policies.Chain, h) is getattr(policies.UpdatePolicy, h))
    assert missing == []


def test_chain_forwards_to_each_member_and_a_chain_of_one_is_that_policy():
    calls = []

    class Probe(policies.UpdatePolicy):
        def __init__(self, tag):
            self.tag = tag

        def before_read(self, w):
            calls.append(("before_read", self.tag))
            return [self.tag]

        def attach(self, runtime):
            calls.append(("attach", self.tag, runtime))

        def watchdogs(self):
            return [f"dog-{self.tag}"]

        def update(self, grads, state, info):
            return grads, True

    c = policies.chain(Probe("a"), Probe("b"))
    assert c.before_read(0) == ["a", "b"]
    c.attach("rt")
    assert calls[-2:] == [("attach", "a", "rt"), ("attach", "b", "rt")]
    assert list(c.watchdogs()) == ["dog-a", "dog-b"]
    ssp = policies.chain("ssp")
    assert isinstance(ssp, policies.Chain) and ssp.clock_values == ssp.policies[0].clock_values
    local = policies.chain("local_sgd")
    assert local.local_copies and not local.atomic
    assert bool(local.exchange_due(tf.constant(16, tf.int64)))
    assert not bool(local.exchange_due(tf.constant(15, tf.int64)))


@pytest.mark.parametrize("member", ["local_sgd", "sync_replicas"])
def test_chain_refuses_a_policy_it_cannot_compose(member):
    with pytest.raises(ValueError, match=r"chain\(\).*cannot be chained"):
        policies.chain(member, "drop_stale")


def test_update_results_become_decisions_or_fail_clearly():
    d = policies.base.as_decision(([1], True))
    assert d == policies.Decision([1], True, None)
    with pytest.raises(TypeError, match=r"must return tf_asyncps.policies.Decision"):
        policies.base.as_decision([1, 2, 3])


def test_each_registered_policy_class_is_named_after_its_registry_name():
    from tf_asyncps.policies.registry import _REGISTRY
    # ssp/BoundedStaleness, local_sgd/LocalSteps and staleness_aware/StalenessAwareLR
    # drifted apart; the former class names stay as aliases.
    acronyms = {"ssp": "SSP", "sgd": "SGD", "dc": "DC", "asgd": "ASGD"}
    for name in policies.names():
        camel = "".join(acronyms.get(w, w.capitalize()) for w in name.split("_"))
        assert getattr(policies, camel) is _REGISTRY[name], name
        assert getattr(policies, camel).__name__ == camel
    assert policies.BoundedStaleness is policies.SSP
    assert policies.LocalSteps is policies.LocalSGD
    assert policies.StalenessAwareLR is policies.StalenessAware
