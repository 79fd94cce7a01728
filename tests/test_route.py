"""``route(sparse=..., dense=...)`` in one process (fast tier): each part's
own τ and decision, one optimizer call per step, and the accounting.

Two "workers" read the model (the policy's before_read, then r = the global
step) and later apply fixed gradients: a table named ``embeddings`` (rows,
IndexedSlices) and a dense ``kernel``. Results are closed forms.
"""

import numpy as np
import pytest
import tensorflow as tf
import tf_keras

from local_engine import local_engine
from tf_asyncps import policies
from tf_asyncps.core.protocol import PolicyRuntime
from tf_asyncps.core.staleness import StalenessStats
from tf_asyncps.core.step import WorkerStep

LR = 0.5


class _Model:
    """A 4 x 2 table (row gradients) and a 2-vector kernel, SGD(LR)."""

    def __init__(self, engine):
        self.engine = engine
        self.table = tf.Variable(tf.zeros([4, 2]), name="embeddings")
        self.kernel = tf.Variable(tf.zeros([2]), name="kernel")
        self.opt = tf_keras.optimizers.SGD(LR)
        self._read = tf.function(self._read_fn)
        self._apply = tf.function(self._apply_fn)

    def _read_fn(self, w):
        with tf.control_dependencies(self.engine.policy.before_read(w)):
            return self.engine.tracker.read_step()

    def read(self, w):
        """Worker ``w`` reads the model: returns its read step r."""
        return self._read(tf.constant(w, tf.int64))

    def _apply_fn(self, r, w, row, row_grad, kernel_grad):
        step = WorkerStep(self.engine, r, w)
        with step.active():
            rows = tf.IndexedSlices(row_grad[None], tf.reshape(row, [1]),
                                    tf.constant([4, 2], tf.int64))
            self.opt.apply_gradients([(rows, self.table), (kernel_grad, self.kernel)])

    def apply(self, r, w, row, row_grad, kernel_grad):
        self._apply(r, tf.constant(w, tf.int64), tf.constant(row, tf.int64),
                    tf.constant(row_grad, tf.float32), tf.constant(kernel_grad, tf.float32))


def test_each_part_has_its_own_tau_and_decision():
    # Tables: drop_stale(0); kernel: async. Both workers read, then apply:
    # worker 1's table part is one table update late (τ_sparse = 1): only it
    # is dropped; its kernel part is applied in the same step.
    route = policies.route(sparse=policies.get("drop_stale", max_staleness=0), dense="async")
    m = _Model(local_engine(route, num_workers=2))
    r0, r1 = m.read(0), m.read(1)
    m.apply(r0, 0, 1, [1.0, 2.0], [1.0, 1.0])
    m.apply(r1, 1, 2, [4.0, 4.0], [3.0, 5.0])
    assert m.table.numpy().tolist() == [[0, 0], [-0.5, -1.0], [0, 0], [0, 0]]
    assert m.kernel.numpy().tolist() == [-LR * 4.0, -LR * 6.0]
    assert route.part_updates() == {"sparse": 1, "dense": 2}
    s = m.engine.tracker.stats()
    # Each step updated a part: both applied, the global step and iterations move once each.
    assert (s.applied, s.dropped, s.global_step) == (2, 0, 2)
    assert int(m.opt.iterations.numpy()) == 2
    assert s.histogram.tolist()[:2] == [1, 1]  # the steps' global τ: 0 and 1


def test_a_step_is_dropped_only_when_every_part_refuses_it():
    route = policies.route(sparse=policies.get("drop_stale", max_staleness=0),
                           dense=policies.get("drop_stale", max_staleness=0))
    m = _Model(local_engine(route, num_workers=2))
    r0, r1 = m.read(0), m.read(1)
    m.apply(r0, 0, 0, [1.0, 1.0], [1.0, 1.0])
    m.apply(r1, 1, 0, [8.0, 8.0], [8.0, 8.0])  # both parts one update late
    s = m.engine.tracker.stats()
    assert (s.applied, s.dropped, s.global_step) == (1, 1, 1)
    assert s.dropped_histogram.tolist()[1] == 1
    assert m.kernel.numpy().tolist() == [-LR, -LR]
    assert route.part_updates() == {"sparse": 1, "dense": 1}
    assert int(m.opt.iterations.numpy()) == 1


def test_dense_part_under_sync_replicas_equals_the_aggregator_alone():
    # PERSIA's split: tables async, dense layers synchronous (N = 2).
    route = policies.route(sparse="async", dense=policies.get(
        "sync_replicas", replicas_to_aggregate=2, timeout_s=30))
    m = _Model(local_engine(route, num_workers=2))
    alone = _Model(local_engine("sync_replicas", num_workers=2, replicas_to_aggregate=2,
                                timeout_s=30))
    kernel_grads = [[1.0, 2.0], [3.0, 6.0], [5.0, 0.0], [7.0, 4.0]]
    for rnd in range(2):
        reads = [m.read(w) for w in (0, 1)]
        reads_alone = [alone.read(w) for w in (0, 1)]
        for w in (0, 1):
            g = kernel_grads[2 * rnd + w]
            m.apply(reads[w], w, 2 * rnd + w, [1.0, 1.0], g)
            alone.apply(reads_alone[w], w, 2 * rnd + w, [0.0, 0.0], g)
    assert m.kernel.numpy().tolist() == alone.kernel.numpy().tolist() == [
        -LR * (2.0 + 6.0), -LR * (4.0 + 2.0)]  # the mean of each round's two gradients
    assert np.array_equal(m.table.numpy(), np.full([4, 2], -LR))  # every row update, at once
    assert route.part_updates() == {"sparse": 4, "dense": 2}
    assert route.parts[1].rounds() == alone.engine.policy.rounds() == 2
    s = m.engine.tracker.stats()
    # Every step updated the table: the global step counts worker steps here.
    assert (s.applied, s.dropped, s.global_step) == (4, 0, 4)
    assert int(m.opt.iterations.numpy()) == 4
    m.engine.stop_watchdogs()
    alone.engine.stop_watchdogs()


def test_an_aggregator_round_still_counts_a_step_whose_table_part_was_dropped():
    # Tables drop_stale(0), dense sync_replicas(2): worker 1's table part is
    # late and dropped, but its kernel gradient completes the round.
    route = policies.route(sparse=policies.get("drop_stale", max_staleness=0),
                           dense=policies.get("sync_replicas", replicas_to_aggregate=2,
                                              timeout_s=30))
    m = _Model(local_engine(route, num_workers=2))
    r0, r1 = m.read(0), m.read(1)
    m.apply(r0, 0, 0, [1.0, 1.0], [2.0, 2.0])  # table applied, kernel accepted (1 of 2)
    m.apply(r1, 1, 0, [9.0, 9.0], [4.0, 4.0])  # table dropped, round complete
    assert m.table.numpy()[0].tolist() == [-LR, -LR]
    assert m.kernel.numpy().tolist() == [-LR * 3.0, -LR * 3.0]
    s = m.engine.tracker.stats()
    assert (s.applied, s.dropped, s.global_step) == (2, 0, 2)
    assert route.part_updates() == {"sparse": 1, "dense": 1}
    m.engine.stop_watchdogs()


def test_a_nonfinite_step_updates_no_part():
    route = policies.route(sparse="async", dense="async")
    m = _Model(local_engine(route, num_workers=2))
    m.apply(m.read(0), 0, 0, [1.0, 1.0], [np.nan, 1.0])
    s = m.engine.tracker.stats()
    assert (s.applied, s.dropped, s.nonfinite, s.global_step) == (0, 1, 1, 0)
    assert not np.any(m.table.numpy()) and not np.any(m.kernel.numpy())
    assert route.part_updates() == {"sparse": 0, "dense": 0}


def test_variables_are_split_by_name():
    route = policies.route(sparse_names=r"user_ids|movie_ids")
    vs = [tf.Variable(0.0, name="user_ids/embeddings"), tf.Variable(0.0, name="dense/kernel"),
          tf.Variable(0.0, name="movie_ids/embeddings/part_1")]
    assert route.split(vs) == ([0, 2], [1])
    assert policies.route().split(vs) == ([0, 2], [1])  # default: "embeddings"


@pytest.mark.parametrize("make,words", [
    (lambda: policies.route(sparse="local_sgd"), "per-worker copies"),
    (lambda: policies.route(dense=policies.route()), "itself a route"),
    (lambda: policies.route(sparse_names="("), "not a regular expression"),
    (lambda: policies.route(sparse_names=""), "non-empty"),
    (lambda: policies.route(sparse="no_such_policy"),
     r"route\(\): sparse='no_such_policy': .*not a registered policy"),
])
def test_bad_routes_are_refused_with_the_reason(make, words):
    with pytest.raises(ValueError, match=words):
        make()


def test_the_same_object_for_both_parts_is_refused():
    p = policies.get("async")
    with pytest.raises(ValueError, match="same policy object"):
        policies.route(sparse=p, dense=p)


def test_a_route_holding_an_aggregator_cannot_be_chained():
    r = policies.route(dense="sync_replicas")
    assert r.aggregates and r.atomic
    with pytest.raises(ValueError, match="aggregates gradients"):
        policies.chain(r, "staleness_aware")


# -- per-part τ histograms (Route.part_staleness) ------------------------------------
def _attached_engine(route, num_workers):
    """``local_engine`` with the route attached as the strategy attaches it
    (its per-part τ histograms made, with the tracker's 5 bins)."""
    engine = local_engine(route, num_workers=num_workers)
    with engine.policy_scope():
        route.attach(PolicyRuntime(engine.strategy, engine.tracker,
                                   lambda *_: True, num_workers))
    return engine


def _hists(route):
    """``(applied, dropped)``: each part's histograms as lists."""
    applied, dropped = route.part_staleness()
    return ({k: v.tolist() for k, v in applied.items()},
            {k: v.tolist() for k, v in dropped.items()})


class _KernelOnly(_Model):
    """_Model whose ``apply_kernel`` makes a step holding the kernel only."""

    def __init__(self, engine):
        super().__init__(engine)
        self._apply_kernel = tf.function(self._apply_kernel_fn)

    def _apply_kernel_fn(self, r, w, kernel_grad):
        with WorkerStep(self.engine, r, w).active():
            self.opt.apply_gradients([(kernel_grad, self.kernel)])

    def apply_kernel(self, r, w, kernel_grad):
        self._apply_kernel(r, tf.constant(w, tf.int64), tf.constant(kernel_grad, tf.float32))


def test_each_part_has_its_own_tau_histogram_and_drops():
    # Tables drop_stale(0), kernel async; 5 bins (max_tracked=4).
    route = policies.route(sparse=policies.get("drop_stale", max_staleness=0), dense="async")
    m = _KernelOnly(_attached_engine(route, num_workers=2))
    r0, r1 = m.read(0), m.read(1)
    m.apply(r0, 0, 1, [1.0, 2.0], [1.0, 1.0])  # both parts τ 0, applied
    m.apply(r1, 1, 2, [4.0, 4.0], [3.0, 5.0])  # table τ 1: dropped; kernel τ 1: applied
    m.apply(m.read(0), 0, 3, [1.0, 1.0], [1.0, 1.0])  # both τ 0
    r1 = m.read(1)
    m.apply(m.read(0), 0, 0, [1.0, 1.0], [1.0, 1.0])  # both τ 0
    m.apply_kernel(r1, 1, [1.0, 1.0])  # kernel τ 1; no table part: not counted there
    applied, dropped = _hists(route)
    assert applied == {"sparse": [3, 0, 0, 0, 0], "dense": [3, 2, 0, 0, 0]}
    assert dropped == {"sparse": [0, 1, 0, 0, 0], "dense": [0, 0, 0, 0, 0]}
    assert route.part_updates() == {"sparse": 3, "dense": 5}
    assert {k: sum(v) for k, v in applied.items()} == route.part_updates()
    # The kernel was in every step: its τ are the steps' global τ.
    assert m.engine.tracker.stats().histogram.tolist() == applied["dense"]
    route.reset_part_staleness()
    assert _hists(route) == ({"sparse": [0] * 5, "dense": [0] * 5},) * 2
    assert route.part_updates() == {"sparse": 3, "dense": 5}  # kept


def test_two_async_parts_each_hold_the_step_histogram():
    # route(async, async), two workers, updates one at a time: reads
    # r0 r1 | apply 0 (τ 0) 1 (τ 1) | r1 r0 | apply 0 (τ 0) 1 (τ 1) | r0 apply 0 (τ 0).
    route = policies.route(sparse="async", dense="async")
    m = _Model(_attached_engine(route, num_workers=2))
    r0, r1 = m.read(0), m.read(1)
    m.apply(r0, 0, 0, [1.0, 1.0], [1.0, 1.0])
    m.apply(r1, 1, 1, [1.0, 1.0], [1.0, 1.0])
    r1, r0 = m.read(1), m.read(0)
    m.apply(r0, 0, 2, [1.0, 1.0], [1.0, 1.0])
    m.apply(r1, 1, 3, [1.0, 1.0], [1.0, 1.0])
    m.apply(m.read(0), 0, 0, [1.0, 1.0], [1.0, 1.0])
    applied, dropped = _hists(route)
    step = m.engine.tracker.stats().histogram.tolist()
    assert step == [3, 2, 0, 0, 0]
    assert applied == {"sparse": step, "dense": step}
    assert dropped == {"sparse": [0] * 5, "dense": [0] * 5}


def test_an_aggregator_part_counts_its_rounds_and_a_nonfinite_step_its_drops():
    # Tables drop_stale(0), kernel sync_replicas(2): worker 0's kernel
    # gradient is accepted (in neither histogram), worker 1's completes the
    # round at the kernel's τ 0 (no round had completed since its read);
    # worker 1's table part is one table update late: dropped at τ 1.
    route = policies.route(sparse=policies.get("drop_stale", max_staleness=0),
                           dense=policies.get("sync_replicas", replicas_to_aggregate=2,
                                              timeout_s=30))
    m = _Model(_attached_engine(route, num_workers=2))
    r0, r1 = m.read(0), m.read(1)
    m.apply(r0, 0, 0, [1.0, 1.0], [2.0, 2.0])
    m.apply(r1, 1, 0, [9.0, 9.0], [4.0, 4.0])
    applied, dropped = _hists(route)
    assert applied == {"sparse": [1, 0, 0, 0, 0], "dense": [1, 0, 0, 0, 0]}
    assert dropped == {"sparse": [0, 1, 0, 0, 0], "dense": [0, 0, 0, 0, 0]}
    assert {k: sum(v) for k, v in applied.items()} == route.part_updates()
    m.engine.stop_watchdogs()
    # A non-finite step is refused by every part it holds, at each part's τ.
    route = policies.route(sparse="async", dense="async")
    m = _Model(_attached_engine(route, num_workers=2))
    m.apply(m.read(0), 0, 0, [1.0, 1.0], [1.0, 1.0])
    r1 = m.read(1)
    m.apply(m.read(0), 0, 0, [1.0, 1.0], [1.0, 1.0])
    m.apply(r1, 1, 0, [1.0, 1.0], [np.nan, 1.0])
    applied, dropped = _hists(route)
    assert applied == {"sparse": [2, 0, 0, 0, 0], "dense": [2, 0, 0, 0, 0]}
    assert dropped == {"sparse": [0, 1, 0, 0, 0], "dense": [0, 1, 0, 0, 0]}
    assert m.engine.tracker.stats().dropped_histogram.tolist() == dropped["sparse"]


def test_a_route_never_attached_has_no_part_histograms():
    route = policies.route(sparse="async", dense="async")
    m = _Model(local_engine(route, num_workers=1))
    m.apply(m.read(0), 0, 0, [1.0, 1.0], [1.0, 1.0])
    assert route.part_staleness() == ({}, {})
    assert route.part_updates() == {"sparse": 1, "dense": 1}


def test_stats_print_and_serialise_the_part_histograms():
    h = np.array([2, 1, 0], np.int64)
    s = StalenessStats(global_step=3, applied=3, dropped=0, histogram=h,
                       dropped_histogram=np.zeros(3, np.int64), mean=1 / 3, max=1,
                       parts={"sparse": 3, "dense": 1},
                       part_histograms={"sparse": h, "dense": np.array([0, 0, 1])},
                       part_dropped_histograms={"sparse": np.zeros(3, np.int64),
                                                "dense": np.zeros(3, np.int64)})
    assert "part_histograms={'sparse': {0: 2, 1: 1}, 'dense': {'>=2': 1}}" in repr(s)
    assert "part_dropped_histograms" not in repr(s)  # all zero
    d = s.to_dict()
    assert d["part_histograms"] == {"sparse": [2, 1, 0], "dense": [0, 0, 1]}
    assert d["part_dropped_histograms"] == {"sparse": [0, 0, 0], "dense": [0, 0, 0]}
