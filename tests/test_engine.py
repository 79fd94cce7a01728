"""The policy engine in one process, no TensorFlow servers (fast tier).

The engine (tf_asyncps/core/engine.py) needs no cluster: given a tracker on
the local CPU and worker steps with chosen read steps r, its counters,
decisions, non-finite drops and loss-scale updates have closed forms. The
cluster tests keep what needs real concurrency (races, waits, faults).
"""

import numpy as np
import pytest
import tensorflow as tf
import tf_keras

from scenarios.common import make_optimizer
from local_engine import CPU, local_engine
from tf_asyncps import policies
from tf_asyncps.core.engine import PolicyEngine
from tf_asyncps.core.step import WorkerStep
from tf_asyncps.optimizers import LockingOptimizer


def _stepper(engine, opt, w, grad_fn):
    """A traced worker step whose read step r is an argument."""

    @tf.function
    def step(r, x, worker=tf.constant(0, tf.int64)):
        ws = WorkerStep(engine, r, worker)
        with ws.active():
            opt.apply_gradients([(grad_fn(x), w)])
        return ws.applied

    return step


def test_drop_stale_counts_and_applies_exactly_by_tau():
    engine = local_engine("drop_stale", max_staleness=1)
    w = tf.Variable([10.0, 10.0])
    opt = tf_keras.optimizers.SGD(0.5)
    step = _stepper(engine, opt, w, lambda x: x)
    g = tf.constant([1.0, 2.0])
    # (r, g before the step): τ = g - r.  0-0=0 apply; 1-0=1 apply; 2-0=2 drop; 2-2=0 apply.
    for r in (0, 0, 0, 2):
        step(tf.constant(r, tf.int64), g)
    s = engine.tracker.stats()
    assert (s.global_step, s.applied, s.dropped) == (3, 3, 1)
    assert s.histogram.tolist() == [2, 1, 0, 0, 0]
    assert s.dropped_histogram.tolist() == [0, 0, 1, 0, 0]
    assert w.numpy().tolist() == [10.0 - 0.5 * 3 * 1.0, 10.0 - 0.5 * 3 * 2.0]
    assert int(opt.iterations.numpy()) == 3


@pytest.mark.parametrize("locking", [False, True], ids=["unlocked", "locked"])
def test_nonfinite_steps_are_dropped_counted_and_never_applied(locking):
    engine = local_engine("async")
    w = tf.Variable([1.0])
    opt = tf_keras.optimizers.SGD(0.25)
    if locking:
        opt = LockingOptimizer(opt)
    step = _stepper(engine, opt, w, lambda x: x)
    for v in (1.0, np.nan, 1.0, np.inf, 1.0):
        step(tf.constant(0, tf.int64), tf.constant([v], tf.float32))
    s = engine.tracker.stats()
    assert (s.applied, s.dropped, s.nonfinite, s.global_step) == (3, 2, 2, 3)
    assert w.numpy().tolist() == [1.0 - 0.25 * 3]
    assert int(opt.iterations.numpy()) == 3
    assert (engine.lock is not None) == locking
    if locking:
        assert engine.lock.acquisitions() == 5


def test_a_dropped_nonfinite_step_halves_the_loss_scale():
    engine = local_engine("async")
    w = tf.Variable([1.0])
    opt = tf_keras.mixed_precision.LossScaleOptimizer(tf_keras.optimizers.SGD(0.5),
                                                      initial_scale=1024.0)
    step = _stepper(engine, opt, w, lambda x: x)
    step(tf.constant(0, tf.int64), tf.constant([np.nan]))
    step(tf.constant(0, tf.int64), tf.constant([1.0]))
    s = engine.tracker.stats()
    assert (s.applied, s.nonfinite) == (1, 1)
    assert float(opt.loss_scale.numpy()) == 512.0
    assert w.numpy().tolist() == [0.5]


def test_sync_replicas_means_exactly_n_gradients_per_update():
    engine = local_engine("sync_replicas", num_workers=2, replicas_to_aggregate=2, timeout_s=30)
    w = tf.Variable([0.0])
    opt = tf_keras.optimizers.SGD(1.0)
    step = _stepper(engine, opt, w, lambda x: x)
    # Four fresh gradients (r == g each time a round starts): two updates of their mean.
    for i, (r, v) in enumerate(((0, 1.0), (0, 3.0), (1, 5.0), (1, 7.0))):
        step(tf.constant(r, tf.int64), tf.constant([v]), tf.constant(i % 2, tf.int64))
    s = engine.tracker.stats()
    assert (s.global_step, s.applied, s.dropped) == (2, 4, 0)
    assert w.numpy().tolist() == [-(1.0 + 3.0) / 2 - (5.0 + 7.0) / 2]
    assert engine.policy.rounds() == 2
    assert engine.policy.gradients_sent().tolist() == [2, 2]
    # A late gradient (τ = 1 > max_staleness 0) is dropped and counted.
    step(tf.constant(1, tf.int64), tf.constant([100.0]))
    s = engine.tracker.stats()
    assert (s.applied, s.dropped, s.dropped_histogram[1]) == (4, 1, 1)
    engine.stop_watchdogs()


@pytest.mark.parametrize("optimizer", ["sgd", "momentum", "adam", "adagrad"])
@pytest.mark.parametrize("policy,args", [
    ("async", {}), ("drop_stale", {"max_staleness": 0}), ("staleness_aware", {}),
    ("ssp", {"max_staleness": 0, "timeout_s": 30}), ("dc_asgd", {"lambda_": 0.5})])
def test_one_worker_under_every_policy_equals_the_plain_optimizer(policy, args, optimizer):
    """Whole worker steps (before_read, read step, snapshot, decision, update,
    after_step) with one worker: τ = 0 always, so every policy's update is the
    plain optimizer's (dc_asgd's correction is 0 when w_now == w_read)."""
    engine = local_engine(policy, **args)
    rng = np.random.RandomState(0)
    x = tf.constant(rng.randn(32, 4).astype(np.float32))
    y = tf.constant(rng.randn(32, 1).astype(np.float32))
    w0 = rng.randn(4, 1).astype(np.float32)
    w, w_ref = tf.Variable(w0), tf.Variable(w0)
    engine.track_variable(w, trainable=True)
    opt, opt_ref = make_optimizer(optimizer, 0.05), make_optimizer(optimizer, 0.05)

    def grads_of(var):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(tf.matmul(x, var) - y))
        return tape.gradient(loss, [var])

    @tf.function
    def step():
        def fn():
            opt.apply_gradients(zip(grads_of(w), [w]))
        engine.worker_step(fn, index=lambda: tf.constant(0, tf.int64))()

    @tf.function
    def ref_step():
        opt_ref.apply_gradients(zip(grads_of(w_ref), [w_ref]))

    for _ in range(15):
        step()
        ref_step()
    np.testing.assert_allclose(w.numpy(), w_ref.numpy(), atol=1e-6)
    assert float(np.max(np.abs(w.numpy() - w0))) > 1e-2  # it trained
    s = engine.tracker.stats()
    assert (s.applied, s.dropped, s.global_step, s.max) == (15, 0, 15, 0)
    assert int(opt.iterations.numpy()) == 15
    engine.stop_watchdogs()


class _Types(policies.UpdatePolicy):
    """Records the gradient types a policy chain hands on."""

    def __init__(self):
        self.seen = set()

    def update(self, grads, state, info):
        self.seen.update(type(g).__name__ for g in grads)
        return grads, True


@pytest.mark.parametrize("policy,args,workers", [
    ("async", {}, 1), ("staleness_aware", {}, 1), ("dc_asgd", {"lambda_": 0.5}, 1),
    ("sync_replicas", {"replicas_to_aggregate": 2}, 2)])
def test_sparse_gradients_stay_sparse_and_equal_the_dense_reference(policy, args, workers):
    """Embedding rows (tf.gather: IndexedSlices gradients, duplicate ids
    included) through the engine equal the dense one-hot reference."""
    rng = np.random.RandomState(0)
    vocab, dim = 12, 3
    ids = tf.constant(rng.randint(0, vocab, size=(8, 2)))  # duplicates within a batch
    target = tf.constant(rng.randn(8, 2, dim).astype(np.float32))
    e0 = rng.randn(vocab, dim).astype(np.float32)
    e, e_ref = tf.Variable(e0), tf.Variable(e0)
    types = _Types()
    engine = local_engine("async", num_workers=workers)
    engine.policy = policies.chain(policies.get(policy, **args), types) if policy != \
        "sync_replicas" else policies.get(policy, **args)
    engine.build(CPU)
    engine.track_variable(e, trainable=True)
    opt, opt_ref = tf_keras.optimizers.SGD(0.5), tf_keras.optimizers.SGD(0.5)

    @tf.function
    def step(w):
        def fn():
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(tf.square(tf.gather(e, ids) - target))
            g = tape.gradient(loss, [e])
            assert isinstance(g[0], tf.IndexedSlices)
            opt.apply_gradients(zip(g, [e]))
        engine.worker_step(fn, index=lambda: w)()

    @tf.function
    def ref_step():
        with tf.GradientTape() as tape:
            rows = tf.einsum("bkv,vd->bkd", tf.one_hot(ids, vocab), e_ref)
            loss = tf.reduce_sum(tf.square(rows - target))
        opt_ref.apply_gradients(zip(tape.gradient(loss, [e_ref]), [e_ref]))

    for i in range(6):
        step(tf.constant(i % workers, tf.int64))
        if (i + 1) % workers == 0:  # sync_replicas: one update per N equal gradients
            ref_step()
    np.testing.assert_allclose(e.numpy(), e_ref.numpy(), atol=1e-5)
    assert float(np.max(np.abs(e.numpy() - e0))) > 1e-2
    if policy != "sync_replicas":
        assert types.seen == {"IndexedSlices"}
    s = engine.tracker.stats()
    assert s.applied == 6 and s.global_step == 6 // workers


@pytest.mark.parametrize("make,warns,fix", [
    # At momentum 0 one scatter per table (compat.optimizers.hook_sgd_update_step).
    (lambda: tf_keras.optimizers.SGD(0.1), False, None),
    (lambda: tf_keras.optimizers.SGD(0.1, momentum=0.9), True, "legacy.SGD"),
    (lambda: tf_keras.optimizers.legacy.SGD(0.1), False, None),
    (lambda: tf_keras.optimizers.Adagrad(0.1), False, None),
    # Keras 3 Adagrad: row-wise under the strategy (core/rowwise.py), so no warning.
    (lambda: make_optimizer("adagrad", 0.1, "keras3"), False, None),
    (lambda: make_optimizer("adam", 0.1, "keras3"), True, "tf_asyncps.keras3.LazyAdam"),
    (lambda: make_optimizer("sgd", 0.1, "keras3"), False, None)],
    ids=["tf_keras-sgd", "tf_keras-sgd-momentum", "tf_keras-legacy-sgd", "tf_keras-adagrad",
         "keras3-adagrad", "keras3-adam", "keras3-sgd"])
def test_an_optimizer_that_updates_every_row_of_a_table_is_named_once(make, warns, fix,
                                                                      caplog):
    """tf_keras 2.21's SGD with momentum applies a sparse gradient densely
    (its momentum slot decays and is added to the whole table), and so do
    Keras 3's optimizers other than plain SGD: O(table) per step, said once
    with the fix. At momentum 0 the strategy scatters the rows."""
    engine = local_engine("async")
    table = tf.Variable(tf.zeros([PolicyEngine.LARGE_TABLE_ROWS, 2]), name="embeddings")
    opt = make()
    if type(opt).__module__.startswith("keras.src"):
        opt.build([table])  # Keras 3 builds its slots before the first apply

    @tf.function
    def step(row):
        ws = WorkerStep(engine, tf.constant(0, tf.int64), tf.constant(0, tf.int64))
        with ws.active():
            opt.apply_gradients([(tf.IndexedSlices(tf.ones([1, 2]), tf.reshape(row, [1]),
                                                   tf.shape(table, out_type=tf.int64)),
                                  table)])

    with caplog.at_level("WARNING"):
        step(tf.constant(3, tf.int64))
        step(tf.constant(4, tf.int64))
    said = [r.getMessage() for r in caplog.records if "every row" in r.getMessage()]
    assert len(said) == (1 if warns else 0), said
    if warns:
        assert "embeddings" in said[0] and fix in said[0]
    t = table.numpy()
    assert t[3, 0] < 0 and t[4, 0] < 0 and not np.any(t[5:])  # the steps were applied


def test_tf_keras_sgd_at_momentum_zero_updates_without_its_momentum_slot():
    """tf_keras 2.21's SGD keeps a momentum slot m even at momentum 0 and
    updates through it (m = -lr g, variable += m): separate ops that two
    workers' updates interleave through on a ps. In a worker step each
    variable's update is one op (compat.optimizers.hook_sgd_update_step):
    m stays 0 and the table (sparse gradients, duplicate ids) and the dense
    weight are plain SGD's closed form. Outside the strategy, and with
    momentum, tf_keras's own rule runs (m moves)."""
    engine = local_engine("async")
    lr, steps = 0.5, 4
    ids = tf.constant([0, 2, 2])
    c = tf.constant([1.0, 2.0, 3.0])

    def run(opt, in_step):
        table, w = tf.Variable(tf.zeros([5, 2])), tf.Variable(tf.fill([3], 2.0))

        def update():
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(tf.gather(table, ids)) + tf.reduce_sum(w * c)
            g = tape.gradient(loss, [table, w])
            assert isinstance(g[0], tf.IndexedSlices)
            opt.apply_gradients(zip(g, [table, w]))

        @tf.function
        def step():
            if not in_step:
                return update()
            ws = WorkerStep(engine, tf.constant(0, tf.int64), tf.constant(0, tf.int64))
            with ws.active():
                update()

        for _ in range(steps):
            step()
        return table.numpy(), w.numpy(), [m.numpy() for m in opt.momentums]

    count = np.array([[1.0, 1.0], [0, 0], [2.0, 2.0], [0, 0], [0, 0]], np.float32)
    for momentum in (0, 0.0):
        table, w, slots = run(tf_keras.optimizers.SGD(lr, momentum=momentum), in_step=True)
        np.testing.assert_array_equal(table, -lr * steps * count)
        np.testing.assert_array_equal(w, 2.0 - lr * steps * c.numpy())
        assert [float(np.abs(m).max()) for m in slots] == [0.0, 0.0]

    # The slots are built in apply_gradients' order: the table's, then w's.
    table, w, (m_table, m_w) = run(tf_keras.optimizers.SGD(lr), in_step=False)  # vanilla
    np.testing.assert_array_equal(table, -lr * steps * count)
    np.testing.assert_array_equal(m_table, -lr * count)
    np.testing.assert_array_equal(m_w, -lr * c.numpy())

    # Momentum 0.5: m_k = 0.5 m_(k-1) - lr g, w_k = w_(k-1) + m_k.
    table, w, (m_table, m_w) = run(tf_keras.optimizers.SGD(lr, momentum=0.5), in_step=True)
    m_sums = [sum(0.5 ** j for j in range(k + 1)) for k in range(steps)]
    np.testing.assert_allclose(m_w, -lr * m_sums[-1] * c.numpy())
    np.testing.assert_allclose(w, 2.0 - lr * sum(m_sums) * c.numpy())


def test_a_waiting_workers_own_closures_do_not_hold_its_release_back():
    """The gates release waiting workers when the coordinator drains with
    nothing queued. Closures TensorFlow tags for one worker (per-worker
    resources, e.g. an exact evaluation's datasets) can only run on it: while
    it waits they must not count, or it waits for itself (seen once: a
    sync_replicas fit with pss_evaluation_shards stalled for timeout_s)."""
    import queue
    import types
    from tf_asyncps.compat import coordinator as coordinator_compat
    import threading
    q = types.SimpleNamespace(_queue=queue.Queue(), _tagged_queue={0: queue.Queue(),
                                                                   1: queue.Queue()},
                              _queue_lock=threading.Lock())
    coordinator = types.SimpleNamespace(_cluster=types.SimpleNamespace(closure_queue=q))
    assert not coordinator_compat.closure_queue_nonempty(coordinator)
    q._tagged_queue[1].put("create worker 1's dataset")
    # worker 1 is not waiting: it will run it
    assert coordinator_compat.closure_queue_nonempty(coordinator)
    assert coordinator_compat.closure_queue_nonempty(coordinator, ignore_workers=[0])
    assert not coordinator_compat.closure_queue_nonempty(coordinator, ignore_workers=[1])
    q._queue.put("a step any worker can take")
    assert coordinator_compat.closure_queue_nonempty(coordinator, ignore_workers=[0, 1])


def test_after_step_runs_beside_the_policy_state():
    """#24: after_step ran outside any device scope, so the ops in it that
    name no device (ssp's clock minimum and refill condition, constants) ran
    on the worker and the ps state they read crossed to it and back every
    step (ssp on the issue's embedding workload: 104.9 KB per step before,
    99.9 after; async 87.9). Every op of the update and of after_step, in the
    traced step and in the functions of its conds, now names the tracker's
    device. (before_read stays unplaced: placing the gate's wait there let
    sync_replicas workers read the model before their round completed,
    test_sync_replicas.)"""
    engine = local_engine("ssp", num_workers=2, max_staleness=1, timeout_s=30)
    w = tf.Variable([1.0, 2.0])
    opt = tf_keras.optimizers.SGD(0.5)

    @tf.function
    def hooks(worker, r):
        ws = WorkerStep(engine, r, worker)
        with ws.active():
            opt.apply_gradients([(tf.ones([2]), w)])  # the update, then after_step
        return r

    spec = tf.TensorSpec([], tf.int64)
    graph_def = hooks.get_concrete_function(spec, spec).graph.as_graph_def()
    # Leaving out a body's own outputs and anchors, and the optimizer's update
    # (SGD/: its reads and writes are colocated with their variables).
    bodies = [n for f in graph_def.library.function for n in f.node_def
              if n.op not in ("NoOp", "Identity") and "SGD/" not in n.name]
    assert len(bodies) > 10
    assert sorted((n.op, n.name) for n in bodies if n.device != CPU) == []
    flow = {"Case", "StatelessCase", "If", "StatelessIf", "While", "StatelessWhile"}
    assert {n.device for n in graph_def.node if n.op in flow} == {CPU}


def test_the_counters_are_added_under_the_variables_exclusive_lock():
    # A resource scatter of int64 runs under a shared lock in TensorFlow (only
    # use_locking, which ResourceScatterAdd lacks, takes the exclusive one), so
    # two workers' increments of one bin could lose one: applied 499 with
    # global_step 500 (examples/keras_fit.py, 3 runs at once). The counts are
    # one dense AssignAddVariableOp, which holds the exclusive lock.
    import tensorflow as tf
    from tf_asyncps.core.staleness import StalenessTracker
    tracker = StalenessTracker(4, device="/cpu:0")

    @tf.function
    def step(r, ok):
        tracker.record_increment(r)
        tracker.record_gated(r, ok)
        tracker.record(tf.constant(2, tf.int64), applied=False)
        return tracker.add_local_steps(tf.constant(3, tf.int64))

    graph = step.get_concrete_function(tf.constant(0, tf.int64), tf.constant(True)).graph
    types = [op.type for op in graph.get_operations()]
    assert "ResourceScatterAdd" not in types
    assert types.count("AssignAddVariableOp") == 4 + 2  # counts x4, g x2
    step(tf.constant(0, tf.int64), tf.constant(True))
    s = tracker.stats()
    assert (s.global_step, s.applied, s.dropped, s.local_steps) == (2, 2, 1, 3)
    assert s.histogram.tolist() == [1, 1, 0, 0, 0] and s.dropped_histogram.tolist()[2] == 1
