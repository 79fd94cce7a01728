"""Real clusters: single-worker equivalence and exact accounting (docs/design.md#3-staleness-exactly,
docs/design.md#6-tests).

Each cluster scenario sits above the tests that read it and returns the
dataclass declared with it (docs/tests.md#scenarios-beside-their-tests).
``single_worker_fits`` is also read by test_local_sgd.py,
test_policy_training.py and test_wire_dtype.py."""

import dataclasses

import numpy as np
import pytest
import tensorflow as tf
import tf_keras

import tf_asyncps
from conftest import run_scenario
from scenarios import cluster, scenario
from scenarios.common import make_optimizer, mlp, run_steps, small_problem, step_fn
from tf_asyncps import StalenessStats

pytestmark = pytest.mark.timeout(300)


# -- one worker equals one process -------------------------------------------------
@dataclasses.dataclass(frozen=True)
class SingleWorkerFit:
    """model.fit of the small MLP (same initial weights w0, same batches) on
    one worker under the strategy, and in the scenario's own process.

    Attributes:
      max_abs_diff: max |weight - one-process weight| over all weights.
      moved: max |one-process weight - w0| (training moved the weights).
      iterations: the optimizer's step counter at the end (int).
      steps_per_execution_device: the device of fit's steps_per_execution
        variable.
      dtypes: the floating dtypes of the model's and optimizer's variables
        (sorted, distinct).
      slots: the optimizer's variables (its counter and slots).
      stats: the strategy's staleness counters.
    """
    max_abs_diff: float
    moved: float
    iterations: int
    steps_per_execution_device: str
    dtypes: list[str]
    slots: int
    stats: StalenessStats


@dataclasses.dataclass(frozen=True)
class SingleWorkerFits:
    """Attributes: runs: one SingleWorkerFit per case, in the cases' order."""
    runs: list[SingleWorkerFit]


@scenario(shares_cluster=True)
def single_worker_fit(**kwargs) -> SingleWorkerFit:
    """One worker: fit under the strategy vs fit in one process, same order."""
    with cluster(num_workers=1, num_ps=1) as c:
        return _single_worker_fit(c, **kwargs)


@scenario(shares_cluster=True)
def single_worker_fits(cases) -> SingleWorkerFits:
    """single_worker_fit for each kwargs dict of ``cases``, one strategy each
    on one cluster (one cluster per process:
    docs/design.md#1-facts-measured-on-the-development-machine)."""
    with cluster(num_workers=1, num_ps=1) as c:
        return SingleWorkerFits(runs=[_single_worker_fit(c, **case) for case in cases])


def _single_worker_fit(c, policy="async", policy_args=None, optimizer="sgd", lr=0.1,
                       epochs=2, steps_per_epoch=20, batch=16, steps_per_execution=1,
                       wire_dtype=None):
    x, y = small_problem(n=steps_per_epoch * batch)
    rng = np.random.RandomState(1)
    w0 = [rng.uniform(-0.5, 0.5, shape).astype(np.float32)
          for shape in [(8, 16), (16,), (16, 3), (3,)]]
    loss = tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def dataset_fn(ctx):
        ds = tf.data.Dataset.from_tensor_slices((x, y))
        ds = ds.shard(ctx.num_input_pipelines, ctx.input_pipeline_id)
        return ds.batch(batch).repeat()

    strategy = tf_asyncps.AsyncParameterServerStrategy(
        c.resolver(), update_policy=tf_asyncps.policies.get(policy, **(policy_args or {})),
        wire_dtype=wire_dtype)
    # Reference: plain single-process tf_keras training on the same batches
    # (runs on the chief's own CPU, outside the strategy's scope).
    ref = mlp()
    ref.set_weights(w0)
    ref.compile(make_optimizer(optimizer, lr), loss, steps_per_execution=steps_per_execution)
    ref.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(batch).repeat(),
            epochs=epochs, steps_per_epoch=steps_per_epoch, verbose=0)
    with strategy.scope():
        model = mlp()
        model.set_weights(w0)
        model.compile(make_optimizer(optimizer, lr), loss,
                      steps_per_execution=steps_per_execution)
    model.fit(tf_keras.utils.experimental.DatasetCreator(dataset_fn), epochs=epochs,
              steps_per_epoch=steps_per_epoch, verbose=0)
    diffs = [float(np.max(np.abs(a - b)))
             for a, b in zip(model.get_weights(), ref.get_weights())]
    moved = [float(np.max(np.abs(a - b))) for a, b in zip(ref.get_weights(), w0)]
    return SingleWorkerFit(
        max_abs_diff=max(diffs), moved=max(moved),
        iterations=int(model.optimizer.iterations.numpy()),
        steps_per_execution_device=model._steps_per_execution.device,
        dtypes=sorted({v.dtype.name for v in model.weights + model.optimizer.variables()
                       if v.dtype.is_floating}),
        slots=len(model.optimizer.variables()), stats=strategy.staleness_stats())


@pytest.mark.cluster
def test_one_worker_async_equals_single_process_training():
    # 3 steps per closure, 20 per epoch: each epoch ends with a 2-step closure.
    r = run_scenario(single_worker_fit, shared=(1, 1), epochs=2, steps_per_epoch=20,
                     steps_per_execution=3)
    assert r.moved > 1e-2  # training really changed the weights
    assert r.max_abs_diff < 1e-5
    # fit reads it before every closure: it lives on the chief, not on a ps.
    assert r.steps_per_execution_device == "/job:chief/replica:0/task:0/device:CPU:0"
    s = r.stats
    assert s.applied == 40 and s.global_step == 40 and s.dropped == 0
    # One worker alone always sees tau = 0.
    assert s.histogram[0] == 40 and s.max == 0 and s.mean == 0.0
    assert r.iterations == 40


# -- several workers: exact counters -----------------------------------------------
@dataclasses.dataclass(frozen=True)
class AccountingFit:
    """model.fit of the small MLP (SGD 0.05) on several workers.

    Attributes:
      scheduled: the steps fit scheduled (epochs * steps_per_epoch).
      iterations: the optimizer's step counter at the end (int).
      stats: the strategy's staleness counters.
    """
    scheduled: int
    iterations: int
    stats: StalenessStats


@scenario(shares_cluster=True)
def accounting_fit(num_workers=3, epochs=3, steps_per_epoch=40, batch=16) -> AccountingFit:
    """Several workers under model.fit: exact counters."""
    x, y = small_problem()

    def dataset_fn(ctx):
        ds = tf.data.Dataset.from_tensor_slices((x, y))
        ds = ds.shard(ctx.num_input_pipelines, ctx.input_pipeline_id)
        return ds.shuffle(len(x), seed=0).repeat().batch(batch)

    with cluster(num_workers=num_workers, num_ps=1) as c:
        strategy = tf_asyncps.AsyncParameterServerStrategy(c.resolver())
        with strategy.scope():
            model = mlp()
            model.compile(tf_keras.optimizers.SGD(0.05),
                          tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.fit(tf_keras.utils.experimental.DatasetCreator(dataset_fn), epochs=epochs,
                  steps_per_epoch=steps_per_epoch, verbose=0)
        return AccountingFit(scheduled=epochs * steps_per_epoch,
                             iterations=int(model.optimizer.iterations.numpy()),
                             stats=strategy.staleness_stats())


@pytest.mark.cluster
def test_accounting_identity_with_three_workers():
    r = run_scenario(accounting_fit, shared=(3, 1), num_workers=3, epochs=3, steps_per_epoch=40)
    s = r.stats
    assert s.applied + s.dropped == r.scheduled == 120
    assert s.global_step == s.applied == 120
    assert sum(s.histogram) == s.applied
    assert sum(s.dropped_histogram) == s.dropped == 0
    assert r.iterations == 120  # tf_keras counts every applied update
    assert 0 <= s.mean <= s.max <= 120


@dataclasses.dataclass(frozen=True)
class CustomLoopLinear:
    """``steps`` scheduled SGD steps on loss = sum(w), w = 2.0 * ones([dim]).

    Attributes:
      w: w at the end; SGD subtracts exactly lr per applied step.
      iterations: the optimizer's step counter at the end (int).
      stats: the strategy's staleness counters.
      steps, lr: the scenario's arguments, echoed.
    """
    w: list[float]
    iterations: int
    stats: StalenessStats
    steps: int
    lr: float


@scenario(shares_cluster=True)
def custom_loop_linear(num_workers=3, steps=60, lr=0.5, dim=4) -> CustomLoopLinear:
    """coordinator.schedule with loss = sum(w): constant gradient 1.

    SGD's update is one assign_sub, so w == w0 - lr * applied exactly.
    """
    with cluster(num_workers=num_workers, num_ps=1) as c:
        strategy = tf_asyncps.AsyncParameterServerStrategy(c.resolver())
        coord = tf.distribute.coordinator.ClusterCoordinator(strategy)
        with strategy.scope():
            w = tf.Variable(tf.fill([dim], 2.0), name="w")
            opt = tf_keras.optimizers.SGD(lr)

        run_steps(coord, step_fn(strategy, [w], opt, lambda: tf.reduce_sum(w)), steps)
        return CustomLoopLinear(w=w.numpy().tolist(), iterations=int(opt.iterations.numpy()),
                                stats=strategy.staleness_stats(), steps=steps, lr=lr)


@pytest.mark.cluster
def test_custom_loop_constant_gradient_is_exact():
    r = run_scenario(custom_loop_linear, shared=(3, 1), num_workers=3, steps=60, lr=0.5)
    s = r.stats
    assert s.applied == s.global_step == 60
    assert r.iterations == 60
    np.testing.assert_array_equal(r.w, [2.0 - 0.5 * 60] * 4)


# -- case 003: each worker reads its own shard -------------------------------------
@dataclasses.dataclass(frozen=True)
class ShardPerWorker:
    """Ids 0..n-1, sharded per worker; each read counted on the PS.

    Attributes:
      counts: ``counts[w][i]``: how many times worker w read id i
        ([num_workers][n] ints).
      stats: the strategy's staleness counters.
    """
    counts: list[list[int]]
    stats: StalenessStats


@scenario(shares_cluster=True)
def shard_per_worker(num_workers=2, n=1000, batch=10, steps=100) -> ShardPerWorker:
    """Case 003: each worker must read its own shard; ids counted on the PS."""
    ids = np.arange(n, dtype=np.int64)

    def dataset_fn(ctx):
        ds = tf.data.Dataset.from_tensor_slices(ids)
        ds = ds.shard(ctx.num_input_pipelines, ctx.input_pipeline_id)
        return ds.repeat().batch(batch).map(lambda b: (tf.cast(b, tf.float32)[:, None], b))

    with cluster(num_workers=num_workers, num_ps=1) as c:
        strategy = tf_asyncps.AsyncParameterServerStrategy(c.resolver())
        with tf.device("/job:ps/task:0/device:CPU:0"):
            seen = tf.Variable(tf.zeros([num_workers, n], tf.int64), name="seen_by_worker")

        class Counting(tf_keras.Model):
            def __init__(self):
                super().__init__()
                self.dense = tf_keras.layers.Dense(1)

            def call(self, x):
                return self.dense(x)

            def train_step(self, data):
                xb, idb = data
                w = tf.distribute.coordinator.experimental_get_current_worker_index()
                idx = tf.stack([tf.fill(tf.shape(idb), tf.cast(w, tf.int64)), idb], axis=1)
                seen.scatter_nd_add(idx, tf.ones_like(idb))
                with tf.GradientTape() as tape:
                    loss = tf.reduce_mean(tf.square(self(xb) * 0.0))
                self.optimizer.minimize(loss, self.trainable_variables, tape=tape)
                return {"loss": loss}

        with strategy.scope():
            model = Counting()
            model.compile(tf_keras.optimizers.SGD(0.0))
        model.fit(tf_keras.utils.experimental.DatasetCreator(dataset_fn), epochs=1,
                  steps_per_epoch=steps, verbose=0)
        return ShardPerWorker(counts=seen.numpy().tolist(), stats=strategy.staleness_stats())


@pytest.mark.cluster
def test_each_worker_reads_its_own_shard():
    """Case 003: dataset.shard(ctx.num_input_pipelines, ctx.input_pipeline_id)."""
    r = run_scenario(shard_per_worker, shared=(2, 1), num_workers=2, n=1000, batch=10, steps=100)
    counts = np.array(r.counts)
    assert counts.sum() == 100 * 10  # every example read is counted once
    by0, by1 = counts[0] > 0, counts[1] > 0
    assert not np.any(by0 & by1)  # disjoint
    ids = np.arange(1000)
    # shard(2, i) keeps ids with id % 2 == i
    assert np.all(ids[by0] % 2 == 0) and np.all(ids[by1] % 2 == 1)
    assert by0.any() and by1.any()


# -- tau counts the updates that land during a step --------------------------------
@dataclasses.dataclass(frozen=True)
class TauVisible:
    """The last round of tau_visible's scheduled steps.

    Attributes:
      stats: that round's staleness counters (``global_step``: that round's
        updates).
      closures: closures completed per worker index (over all rounds).
      saw_update: that round's steps that saw another worker's update land
        between their read and their apply.
      attempts: the rounds run (at most ``attempts``).
    """
    stats: StalenessStats
    closures: list[int]
    saw_update: int
    attempts: int


@scenario(shares_cluster=True)
def tau_visible(policy="async", num_workers=2, steps=30, max_polls=20000,
                attempts=3) -> TauVisible:
    """Worker 0 waits, between reading the model and applying, until another
    worker's update has landed (it polls the global step, at most
    ``max_polls`` reads), and reports whether it saw one land. A step that saw
    one must count tau >= 1: g at its apply > g after its wait > g at its read.

    That needs both workers to run closures at once; on a loaded machine the
    coordinator may hand every closure to one worker, or worker 0's closures
    may all start after worker 1 ran out of work. Such a round (no step saw an
    update land) is repeated, at most ``attempts`` rounds with the counters
    reset in between; the result is the last round's: its stats, the closures
    each worker ran and ``saw_update``, the steps that saw an update land.
    """
    with cluster(num_workers=num_workers, num_ps=1) as c:
        strategy = tf_asyncps.AsyncParameterServerStrategy(c.resolver(), update_policy=policy)
        coord = tf.distribute.coordinator.ClusterCoordinator(strategy)
        with strategy.scope():
            w = tf.Variable(tf.zeros([4]), name="w")
            opt = tf_keras.optimizers.SGD(0.1)
        g = strategy.extended.engine.tracker.global_step

        @tf.function
        def step():
            def replica_fn():
                me = tf.distribute.coordinator.experimental_get_current_worker_index()
                start = g.read_value()
                polls = tf.where(tf.equal(me, 0), max_polls, 0)
                with tf.GradientTape() as tape:
                    n = tf.while_loop(
                        lambda i: tf.logical_and(i < polls, g.read_value() <= start),
                        lambda i: i + 1, [tf.constant(0, polls.dtype)])[0]
                    loss = tf.reduce_sum(w) + 0.0 * tf.cast(n, tf.float32)
                with tf.control_dependencies([n]):
                    saw = tf.logical_and(tf.equal(me, 0), g.read_value() > start)
                with tf.control_dependencies([saw]):
                    opt.apply_gradients([(tape.gradient(loss, w), w)])
                return tf.cast(saw, tf.int32)
            return strategy.run(replica_fn)

        for attempt in range(1, attempts + 1):
            strategy.reset_staleness_stats()
            g0 = int(g.numpy())
            saw = [coord.schedule(step) for _ in range(steps)]
            coord.join()
            saw_update = sum(int(v.fetch()) for v in saw)
            closures = list(strategy.closures_done_per_worker())
            if saw_update > 0:
                break
        stats = strategy.staleness_stats()
        stats = dataclasses.replace(stats, global_step=int(stats.global_step) - g0)
        return TauVisible(stats=stats, closures=closures, saw_update=saw_update,
                          attempts=attempt)


@pytest.mark.parametrize("policy", ["async", "staleness_aware"])
@pytest.mark.cluster
@pytest.mark.solo  # under -n 2 it twice saw no overlap of the two workers' steps at all
def test_tau_counts_updates_that_land_during_a_slow_step(policy):
    """Regression: tau was read at step start on both ends and always came out 0.

    Every step that saw another worker's update land between its read and its
    apply has tau >= 1, so at least that many updates count tau >= 1.
    """
    r = run_scenario(tau_visible, shared=(2, 1), policy=policy, num_workers=2, steps=30)
    s = r.stats
    assert s.applied == s.global_step == 30
    assert sum(r.closures) == 30
    # Some step saw an update land (the round is repeated otherwise).
    assert r.saw_update >= 1, r
    assert sum(s.histogram[1:]) >= r.saw_update, r
    assert s.max >= 1 and s.mean > 0
