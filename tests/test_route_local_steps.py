"""``route`` with a mapping of labels, and ``route(sparse="async",
dense=LocalSteps(k))``: the tables updated every step on the PS, the dense
weights on per-worker copies exchanged every k steps (PERSIA's hybrid).

Fast tier: the labels and the refusals. Cluster tier: closed forms on one
worker (the table is plain SGD, the PS copy of the dense weight is the SGD
trajectory sampled at the exchanges; under either exchange rule), exact
counters on two, and on two workers running one closure at a time the exact
PS and worker copies of the dense weight after every exchange, under the
``sum`` and the ``mean`` exchange (a simulation of the rule in float64). Each cluster
scenario sits above the test that reads it and returns the dataclass declared
with it (docs/tests.md#scenarios-beside-their-tests).
"""

import dataclasses
import math

import numpy as np
import pytest
import tensorflow as tf
import tf_keras

import tf_asyncps
from tf_asyncps import StalenessStats, policies
from conftest import run_scenario
from scenarios import cluster, scenario


def _vars(*names):
    return [tf.Variable(0.0, name=n) for n in names]


def test_a_mapping_of_labels_splits_in_the_order_of_its_parts():
    r = policies.route({"user": "async", "item": policies.get("drop_stale", max_staleness=1),
                        "dense": "async"},
                       labels={"user": "user_ids", "item": "item_ids|embeddings"})
    vs = _vars("user_ids/embeddings", "dense/kernel", "item_ids/embeddings/part_1", "bias")
    # "user_ids/embeddings" matches both patterns: the first label in order wins.
    assert r.split(vs) == ([0], [2], [1, 3])
    assert r.labels == ("user", "item", "dense")
    assert r.build(2, "/job:localhost/replica:0/task:0/device:CPU:0").counts.shape == [3]
    assert r.part_updates() == {"user": 0, "item": 0, "dense": 0}


def test_the_two_label_form_is_the_mapping_with_sparse_names():
    vs = _vars("movie/embeddings", "dense/kernel")
    two = policies.route(sparse="async", dense="ssp", sparse_names="embeddings")
    mapped = policies.route({"sparse": "async", "dense": "ssp"},
                            labels={"sparse": "embeddings"})
    assert two.split(vs) == mapped.split(vs) == ([0], [1])
    assert repr(two).endswith("sparse_names='embeddings')")
    assert repr(mapped) == repr(two)  # one route, two spellings


def test_labels_may_be_a_callable():
    r = policies.route({"a": "async", "b": "async"},
                       labels=lambda name: "a" if name.startswith("a") else "b")
    assert r.split(_vars("a1", "b1", "a2")) == ([0, 2], [1])
    with pytest.raises(ValueError, match=r"labels\('zz:0'\) returned 'c'"):
        policies.route({"a": "async", "b": "async"}, labels=lambda name: "c").split(_vars("zz"))


def test_variable_modes_of_a_route_with_local_steps():
    r = policies.route(sparse="async", dense=policies.LocalSteps(sync_every=4))
    assert r.local_copies and r.updates_on_ps
    # The dense part's trainable variables and their slots: local copies;
    # the tables, their slots and every non-trainable non-slot variable: per step.
    assert r.variable_mode("dense/kernel:0", trainable=True, slot=False) == "local_copies"
    assert r.variable_mode("dense/kernel/momentum:0", trainable=False, slot=True) == \
        "local_copies"
    assert r.variable_mode("emb/embeddings:0", trainable=True, slot=False) == "per_step"
    assert r.variable_mode("emb/embeddings/momentum:0", trainable=False, slot=True) == \
        "per_step"
    assert r.variable_mode("SGD/iter:0", trainable=False, slot=False) == "per_step"
    assert int(r.exchange_due(tf.constant(3, tf.int64))) == 0
    assert int(r.exchange_due(tf.constant(4, tf.int64))) == 1
    local_sgd = policies.get("local_sgd")
    assert local_sgd.variable_mode("x", trainable=False, slot=False) == "local_copies"
    assert not local_sgd.updates_on_ps
    assert policies.get("async").variable_mode("x", True, False) == "per_step"


@pytest.mark.parametrize("make,words", [
    (lambda: policies.route({"a": "local_sgd", "b": policies.LocalSteps(2), "c": "async"},
                            labels={"a": "x", "b": "y"}), "at most one part"),
    (lambda: policies.route(sparse="async", dense=policies.chain("local_sgd", "async")),
     "per-worker copies|mixes local steps"),
    (lambda: policies.route(sparse="sync_replicas", dense=policies.LocalSteps(2)),
     "atomic"),
    (lambda: policies.route({"a": "async", "b": "async"}, labels={}),
     "every label but one"),
    (lambda: policies.route({"a": "async", "b": "async"}, labels={"c": "x"}),
     "no policy"),
    (lambda: policies.route({"a": "async", "b": "async"}),
     "needs labels"),
    (lambda: policies.route({"a": "async", "b": "async"}, labels={"a": "x"}, sparse="async"),
     "not both"),
    (lambda: policies.route({"a": "async", "b": "async"}, labels={"a": 3}),
     "non-empty regular expression"),
])
def test_bad_mappings_are_refused_with_the_fix(make, words):
    with pytest.raises(ValueError, match=words):
        make()


# -- cluster tier ------------------------------------------------------------
LR, K = 0.1, 3


def _one_worker_data(n=7, batch=2, d=3, rows=4, seed=0):
    rng = np.random.RandomState(seed)
    return dict(ids=rng.randint(0, rows, size=(n, batch)).tolist(),
                x=rng.randn(n, batch, d).round(2).tolist(),
                y=rng.randn(n, batch).round(2).tolist(),
                table0=rng.randn(rows, 2).round(2).tolist(),
                w0=rng.randn(d).round(2).tolist())


def _sgd_trajectory(ids, x, y, table0, w0, lr):
    """Plain SGD on pred = sum(table[id]) + x @ w, loss = mean((pred-y)^2)/2:
    the table and w after each step (float64)."""
    table, w = np.array(table0, np.float64), np.array(w0, np.float64)
    tables, ws = [table.copy()], [w.copy()]
    for ids_j, x_j, y_j in zip(np.array(ids), np.array(x), np.array(y)):
        err = table[ids_j].sum(axis=1) + x_j @ w - y_j  # [batch]
        g_rows = err / len(ids_j)
        grad_w = x_j.T @ g_rows
        np.add.at(table, ids_j, -lr * g_rows[:, None] * np.ones((1, table.shape[1])))
        w = w - lr * grad_w
        tables.append(table.copy())
        ws.append(w.copy())
    return tables, ws


# -- on a cluster: route(sparse="async", dense=LocalSteps(k)) ---------------------
def _strategy(c, sync_every, exchange="sum"):
    policy = tf_asyncps.policies.route(
        sparse="async",
        dense=tf_asyncps.policies.LocalSteps(sync_every=sync_every, exchange=exchange))
    strategy = tf_asyncps.AsyncParameterServerStrategy(c.resolver(), update_policy=policy)
    return strategy, tf.distribute.coordinator.ClusterCoordinator(strategy)


def _step(strategy, table, w, opt, loss_fn):
    @tf.function
    def step(*batch):
        def replica_fn(*batch):
            with tf.GradientTape() as tape:
                loss = loss_fn(*batch)
            opt.apply_gradients(zip(tape.gradient(loss, [table, w]), [table, w]))
            return loss
        return strategy.run(replica_fn, args=batch)
    return step


@dataclasses.dataclass(frozen=True)
class RouteLocalStepsOneWorker:
    """One worker's steps, each fetched on its own, then a join.

    Attributes:
      tables, ws: the PS copies of the table ([rows][dim]) and of w ([d])
        after each step (one entry per step).
      table, w: the PS copies after the join.
      iterations: the optimizer's step counter at the end (int).
      part_updates: ``{label: n}``, Route.part_updates() at the end.
      local_copies: the names of the variables with per-worker copies, sorted.
      stats: the strategy's staleness counters.
    """
    tables: list
    ws: list
    table: list
    w: list[float]
    iterations: int
    part_updates: dict[str, int]
    local_copies: list[str]
    stats: StalenessStats


@scenario(shares_cluster=True)
def route_local_steps_one_worker(ids, x, y, table0, w0, lr=0.1, sync_every=3,
                                 exchange="sum") -> RouteLocalStepsOneWorker:
    """One worker; step j trains on ``ids[j]`` (int, [batch]), ``x[j]``
    ([batch, d]), ``y[j]`` ([batch]): pred = sum(table[id]) + x @ w, loss =
    mean((pred - y)^2) / 2, SGD(lr). Each step is scheduled and fetched on
    its own; after each, the PS copies of the table and of w are read. A
    join then pushes the rest. ``exchange``: the dense part's rule."""
    with cluster(num_workers=1, num_ps=1) as c:
        strategy, coord = _strategy(c, sync_every, exchange)
        with strategy.scope():
            table = tf.Variable(table0, dtype=tf.float32, name="embeddings")
            w = tf.Variable(w0, dtype=tf.float32, name="dense/kernel")
            opt = tf_keras.optimizers.SGD(lr)

        def loss_fn(ids_j, x_j, y_j):
            pred = tf.reduce_sum(tf.gather(table, ids_j), axis=1) + tf.linalg.matvec(x_j, w)
            return 0.5 * tf.reduce_mean(tf.square(pred - y_j))

        step = _step(strategy, table, w, opt, loss_fn)
        tables, ws = [], []
        for j in range(len(ids)):
            coord.fetch(coord.schedule(step, args=(
                tf.constant(ids[j], tf.int32), tf.constant(x[j], tf.float32),
                tf.constant(y[j], tf.float32))))
            tables.append(table.numpy().tolist())
            ws.append(w.numpy().tolist())
        coord.join()
        return RouteLocalStepsOneWorker(
            tables=tables, ws=ws, table=table.numpy().tolist(), w=w.numpy().tolist(),
            iterations=int(opt.iterations.numpy()),
            part_updates=strategy.update_policy.part_updates(),
            local_copies=sorted(
                cp.master.name for cp in strategy.extended.engine.local._copies.values()),
            stats=strategy.staleness_stats())


@pytest.mark.cluster
@pytest.mark.timeout(120)
@pytest.mark.parametrize("exchange", ["sum", "mean"])
def test_one_worker_table_is_sgd_and_the_ps_dense_copy_is_sgd_sampled_at_the_exchanges(
        exchange):
    # One worker: the mean of one delta is the delta, so both rules are
    # sequential SGD.
    data = _one_worker_data()
    r = run_scenario(route_local_steps_one_worker, shared=(1, 1), lr=LR, sync_every=K,
                     exchange=exchange, **data)
    n = len(data["ids"])
    tables, ws = _sgd_trajectory(**data, lr=LR)
    for j in range(1, n + 1):
        # After step j the table is SGD's (updated on the PS every step) ...
        np.testing.assert_allclose(r.tables[j - 1], tables[j], rtol=1e-5, atol=1e-6)
        # ... and the PS copy of w is the trajectory at the last exchange:
        # made at the start of steps K+1, 2K+1, ... (the first step pulls).
        np.testing.assert_allclose(r.ws[j - 1], ws[K * ((j - 1) // K)], rtol=1e-5,
                                   atol=1e-6)
    assert not np.allclose(ws[K * ((n - 1) // K)], ws[n])  # the last window is still local
    # The join pushes the rest: the PS copy is SGD's end point.
    np.testing.assert_allclose(r.w, ws[n], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(r.table, tables[n], rtol=1e-5, atol=1e-6)
    # Local copies: the dense kernel and its slot (tf_keras SGD makes one even
    # at momentum 0); the table, its slot and the step counter stay on the PS.
    assert r.local_copies == ["SGD/m/dense/kernel:0", "dense/kernel:0"]
    assert r.part_updates == {"sparse": n, "dense": math.ceil(n / K)}
    s = r.stats
    assert s.parts == r.part_updates  # staleness_stats().parts
    assert (s.applied, s.dropped, s.global_step, s.local_steps) == (n, 0, n, n)
    assert r.iterations == n
    # One worker: every table update and every exchange at τ 0 (33 bins;
    # histograms come back from the scenario as lists).
    assert s.part_histograms == {
        "sparse": [n] + [0] * 32, "dense": [math.ceil(n / K)] + [0] * 32}
    assert s.part_dropped_histograms == {"sparse": [0] * 33, "dense": [0] * 33}


@dataclasses.dataclass(frozen=True)
class RouteLocalStepsTwoWorkers:
    """Two workers' scheduled steps after the join.

    Attributes:
      table: the table ([3][2]) at the end.
      w: w ([4]) at the end.
      iterations: the optimizer's step counter at the end (int).
      closures: closures completed per worker index.
      part_updates: ``{label: n}``, Route.part_updates() at the end.
      stats: the strategy's staleness counters.
    """
    table: list
    w: list[float]
    iterations: int
    closures: list[int]
    part_updates: dict[str, int]
    stats: StalenessStats


@scenario(shares_cluster=True)
def route_local_steps_two_workers(steps=20, lr=0.5, sync_every=4,
                                  ids=(0, 1, 1)) -> RouteLocalStepsTwoWorkers:
    """Two workers, loss = sum(table[ids]) + sum(w) (constant gradients: a
    row's gradient is its count in ``ids``, w's is 1): after the join the
    table row r is -lr * steps * count(r) and w is 2 - lr * steps exactly,
    whichever worker ran each step. tf_keras's SGD at momentum 0 updates
    each variable in one op under the strategy
    (compat.optimizers.hook_sgd_update_step); its own rule goes through its
    momentum slot (m = 0, m += -lr g, table += m), ops that two workers'
    steps interleave on the PS, so a table row got another step's update too."""
    with cluster(num_workers=2, num_ps=1) as c:
        strategy, coord = _strategy(c, sync_every)
        with strategy.scope():
            table = tf.Variable(tf.zeros([3, 2]), name="embeddings")
            w = tf.Variable(tf.fill([4], 2.0), name="dense/kernel")
            opt = tf_keras.optimizers.SGD(lr)
        id_tensor = tf.constant(list(ids), tf.int32)

        def loss_fn():
            return tf.reduce_sum(tf.gather(table, id_tensor)) + tf.reduce_sum(w)

        step = _step(strategy, table, w, opt, loss_fn)
        for _ in range(steps):
            coord.schedule(step)
        coord.join()
        return RouteLocalStepsTwoWorkers(
            table=table.numpy().tolist(), w=w.numpy().tolist(),
            iterations=int(opt.iterations.numpy()),
            closures=strategy.closures_done_per_worker(),
            part_updates=strategy.update_policy.part_updates(),
            stats=strategy.staleness_stats())


@pytest.mark.cluster
@pytest.mark.timeout(120)
def test_two_workers_sum_exactly_and_count_each_exchange():
    steps, lr, k = 20, 0.5, 4
    r = run_scenario(route_local_steps_two_workers, shared=(2, 1), steps=steps, lr=lr,
                     sync_every=k, ids=[0, 1, 1])
    assert r.table == [[-lr * steps] * 2, [-2 * lr * steps] * 2, [0.0, 0.0]]
    assert r.w == [2.0 - lr * steps] * 4
    closures = r.closures
    assert sum(closures) == steps
    # Per worker: an exchange at the start of each closure after k local
    # steps since its last, then the join's push of the rest: ceil(c / k).
    syncs = sum(math.ceil(c / k) for c in closures)
    assert r.part_updates == {"sparse": steps, "dense": syncs}
    s = r.stats
    assert s.parts == r.part_updates  # staleness_stats().parts
    assert (s.applied, s.dropped, s.global_step, s.local_steps) == (
        steps, 0, steps, steps)
    assert r.iterations == steps
    # Each part's τ histogram counts each of its updates (exchanges) once.
    assert {k: sum(h) for k, h in s.part_histograms.items()} == r.part_updates
    assert not any(any(h) for h in s.part_dropped_histograms.values())


# -- two workers, one closure at a time: the exchange rule's exact values ------------
def _simulate_exchanges(workers, w0, target, lr, sync_every, divisor, num_workers=2):
    """The dense part of ``route_local_steps_in_turn`` in float64: closure j
    runs one step on worker ``workers[j]`` of loss 0.5 * sum((w - target)^2)
    (gradient w - target), after the exchange it is due
    (tf_asyncps/core/local_copies.py): a pull at the worker's first closure,
    else an exchange once it has taken ``sync_every`` steps since its last
    (s = Δ / divisor pushed, the worker continuing from y + s). Then the
    join's push of each worker's rest. Returns ``(ps after each closure,
    worker copy before each step, after each step, ps at the end, exchanges)``."""
    w0, target = np.array(w0, np.float64), np.array(target, np.float64)
    ps = w0.copy()
    local, anchor = [None] * num_workers, [None] * num_workers
    since = [0] * num_workers
    ps_after, before, after, exchanges = [], [], [], 0
    for a in workers:
        if local[a] is None:  # the first closure pulls
            local[a], anchor[a], since[a] = ps.copy(), ps.copy(), 0
        elif since[a] >= sync_every:
            share = (local[a] - anchor[a]) / divisor
            y = ps.copy()
            ps = y + share
            local[a], anchor[a], since[a] = y + share, y + share, 0
            exchanges += 1
        before.append(local[a].copy())
        local[a] = local[a] - lr * (local[a] - target)
        since[a] += 1
        after.append(local[a].copy())
        ps_after.append(ps.copy())
    for a in range(num_workers):  # the join pushes what is left
        if local[a] is not None and since[a]:
            ps = ps + (local[a] - anchor[a]) / divisor
            exchanges += 1
    return ps_after, before, after, ps, exchanges


def _exchange_taus(workers, sync_every, num_workers=2):
    """τ of each exchange of the local part when closure j runs on
    ``workers[j]`` (the schedule of :func:`_simulate_exchanges`, then the
    join's pushes, worker 0 first): the part's exchanges made since this
    worker's previous exchange or its pull (route.py, "Per-part τ")."""
    exchanges, mark, since, taus = 0, [None] * num_workers, [0] * num_workers, []
    for a in workers:
        if mark[a] is None:  # the first closure pulls
            mark[a] = exchanges
        elif since[a] >= sync_every:
            taus.append(exchanges - mark[a])
            exchanges += 1
            mark[a], since[a] = exchanges, 0
        since[a] += 1
    for a in range(num_workers):
        if mark[a] is not None and since[a]:
            taus.append(exchanges - mark[a])
            exchanges += 1
    return taus


@dataclasses.dataclass(frozen=True)
class RouteLocalStepsInTurn:
    """Two workers, closures scheduled and fetched one at a time, then a join.

    Attributes:
      workers: the worker index that ran each closure.
      before, after: that worker's copy of w ([d]) at the start of its step
        (after the closure's exchange or pull) and after its update.
      ps: the PS copy of w ([d]) after each closure.
      w: the PS copy of w after the join.
      table: the table ([3][2]) after the join.
      iterations: the optimizer's step counter at the end (int).
      part_updates: ``{label: n}``, Route.part_updates() at the end.
      stats: the strategy's staleness counters at the end.
    """
    workers: list[int]
    before: list
    after: list
    ps: list
    w: list[float]
    table: list
    iterations: int
    part_updates: dict[str, int]
    stats: StalenessStats


@scenario(shares_cluster=True)
def route_local_steps_in_turn(w0, target, steps=10, lr=0.25, sync_every=2,
                              exchange="sum", ids=(0, 1, 1)) -> RouteLocalStepsInTurn:
    """Two workers; loss = sum(table[ids]) + 0.5 * sum((w - target)^2), SGD(lr),
    route(sparse="async", dense=LocalSteps(sync_every, exchange)). Each
    closure holds one step that returns the worker's index and its copy of
    w before and after its update; it is fetched before the next is
    scheduled, and the PS copy of w read after it."""
    with cluster(num_workers=2, num_ps=1) as c:
        strategy, coord = _strategy(c, sync_every, exchange)
        with strategy.scope():
            table = tf.Variable(tf.zeros([3, 2]), name="embeddings")
            w = tf.Variable(w0, dtype=tf.float32, name="dense/kernel")
            opt = tf_keras.optimizers.SGD(lr)
        id_tensor = tf.constant(list(ids), tf.int32)
        t = tf.constant(target, tf.float32)

        @tf.function
        def step():
            def replica_fn():
                w_before = tf.identity(w.read_value())
                with tf.control_dependencies([w_before]):
                    with tf.GradientTape() as tape:
                        loss = tf.reduce_sum(tf.gather(table, id_tensor)) + \
                            0.5 * tf.reduce_sum(tf.square(w - t))
                    update = opt.apply_gradients(
                        zip(tape.gradient(loss, [table, w]), [table, w]))
                with tf.control_dependencies([update]):
                    w_after = tf.identity(w.read_value())
                index = tf.distribute.coordinator.experimental_get_current_worker_index()
                return tf.cast(index, tf.int64), w_before, w_after
            return strategy.run(replica_fn)

        workers, before, after, ps = [], [], [], []
        for _ in range(steps):
            index, b, a = coord.fetch(coord.schedule(step))
            workers.append(int(index))
            before.append(np.asarray(b).tolist())
            after.append(np.asarray(a).tolist())
            ps.append(w.numpy().tolist())
        coord.join()
        return RouteLocalStepsInTurn(
            workers=workers, before=before, after=after, ps=ps, w=w.numpy().tolist(),
            table=table.numpy().tolist(), iterations=int(opt.iterations.numpy()),
            part_updates=strategy.update_policy.part_updates(),
            stats=strategy.staleness_stats())


@pytest.mark.cluster
@pytest.mark.timeout(120)
@pytest.mark.parametrize("exchange,divisor", [("sum", 1), ("mean", 2)])
def test_two_workers_in_turn_ps_and_worker_copies_follow_the_exchange_rule(
        exchange, divisor):
    """Whichever worker runs each closure, the PS copy after each closure,
    each worker's copy at the start and end of its step and the PS copy after
    the join are the rule's: ``sum`` adds a worker's delta Δ, ``mean`` Δ / 2,
    the worker continuing from y + Δ (y + Δ / 2), y the PS copy it read."""
    steps, lr, k = 10, 0.25, 2
    w0, target = [2.0, -1.0, 0.5], [0.0, 1.0, 4.0]
    r = run_scenario(route_local_steps_in_turn, shared=(2, 1), w0=w0, target=target,
                     steps=steps, lr=lr, sync_every=k, exchange=exchange)
    ps, before, after, end, exchanges = _simulate_exchanges(
        r.workers, w0, target, lr, k, divisor)
    np.testing.assert_allclose(r.before, before, rtol=0, atol=1e-5)
    np.testing.assert_allclose(r.after, after, rtol=0, atol=1e-5)
    np.testing.assert_allclose(r.ps, ps, rtol=0, atol=1e-5)
    np.testing.assert_allclose(r.w, end, rtol=0, atol=1e-5)
    # The table is updated on the PS every step: -lr x steps x count(row).
    assert r.table == [[-lr * steps] * 2, [-2 * lr * steps] * 2, [0.0, 0.0]]
    assert r.iterations == steps
    assert r.part_updates == {"sparse": steps, "dense": exchanges}
    # 10 closures on 2 workers: one ran >= 5, so exchanged at least twice
    # (then the join's push).
    assert exchanges >= 3
    # Per-part τ: the table's updates one at a time (τ 0); each exchange by
    # the other worker's exchanges since this worker's last exchange or pull.
    taus = _exchange_taus(r.workers, k)
    assert len(taus) == exchanges
    if len(set(r.workers)) == 2:  # worker 1's join push follows worker 0's
        assert taus[-1] >= 1
    s = r.stats
    assert s.part_histograms["sparse"] == [steps] + [0] * 32
    assert s.part_histograms["dense"] == np.bincount(taus, minlength=33).tolist()
    assert not any(any(h) for h in s.part_dropped_histograms.values())
