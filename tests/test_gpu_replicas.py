"""K > 1 replicas per worker (the multi-GPU worker path), run on CPU devices.

A worker with K GPUs runs K replicas per step. The K gradients must meet
once, in one update through the policy, counted once: so one worker with K
replicas equals one-process training on batches K times as large, and the
counters count worker steps, not replicas. On CPU the test stand-in in
scenarios.common.fake_multi_replica_workers gives each worker K CPU devices.

Each cluster scenario sits above the tests that read it and returns the
dataclass declared with it (docs/tests.md#scenarios-beside-their-tests); the
one-worker cases share one in-process cluster (a strategy each), the
two-worker case has its own.
"""

import dataclasses

import numpy as np
import pytest
import tensorflow as tf
import tf_keras

import tf_asyncps
from conftest import run_scenario
from scenarios import scenario
from scenarios.common import (
    fake_multi_replica_workers, full_value, in_process_cluster, make_optimizer,
    make_partitioner, mlp, small_problem)
from tf_asyncps import StalenessStats
from tf_asyncps.compat import variables as variables_compat

# The first test reading the shared one-worker run also waits for it.
pytestmark = pytest.mark.timeout(300)


@dataclasses.dataclass(frozen=True)
class ReplicasFit:
    """model.fit of the small MLP with K replicas per worker, and (in the
    scenario's process) the same MLP trained on batches K times as large.

    Attributes:
      replicas: the strategy's num_replicas_in_sync.
      max_abs_diff: max |weight - one-process weight| over all weights.
      moved: max |one-process weight - initial weight| (training moved them).
      iterations: the optimizer's step counter at the end (int).
      finite: every weight is finite at the end.
      rounds: the policy's completed rounds (``sync_replicas``; None for others).
      loss_scale: the LossScaleOptimizer's scale at the end (mixed_float16
        only; None otherwise).
      stats: the strategy's staleness counters.
    """
    replicas: int
    max_abs_diff: float
    moved: float
    iterations: int
    finite: bool
    rounds: int | None
    loss_scale: float | None
    stats: StalenessStats


def _replicas_fit(resolver, replicas=2, num_workers=1, policy="async", policy_args=None,
                  optimizer="momentum", lr=0.1, locking=False, epochs=2, steps_per_epoch=10,
                  batch=8, precision=None) -> ReplicasFit:
    """model.fit with ``replicas`` replicas per worker (the K-GPU worker path,
    on CPU devices) on the cluster of ``resolver`` (``num_workers`` workers).
    With one worker, compared with one-process training on batches of
    replicas * batch examples in the same order."""
    x, y = small_problem(n=steps_per_epoch * batch * replicas * num_workers)
    rng = np.random.RandomState(1)
    w0 = [rng.uniform(-0.5, 0.5, shape).astype(np.float32)
          for shape in [(8, 16), (16,), (16, 3), (3,)]]
    loss = tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def dataset_fn(ctx):  # each replica takes its own batch, in turn
        ds = tf.data.Dataset.from_tensor_slices((x, y))
        ds = ds.shard(ctx.num_input_pipelines, ctx.input_pipeline_id)
        return ds.batch(batch).repeat()

    strategy = tf_asyncps.AsyncParameterServerStrategy(
        resolver, update_policy=tf_asyncps.policies.get(policy, **(policy_args or {})))
    ref = mlp()
    ref.set_weights(w0)
    ref.compile(make_optimizer(optimizer, lr), loss)
    ref.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(batch * replicas).repeat(),
            epochs=epochs, steps_per_epoch=steps_per_epoch, verbose=0)
    if precision:
        tf_keras.mixed_precision.set_global_policy(precision)
    with strategy.scope():
        model = mlp()
        model.set_weights(w0)
        opt = make_optimizer(optimizer, lr)
        if precision == "mixed_float16":
            opt = tf_keras.mixed_precision.LossScaleOptimizer(opt)
        if locking:
            opt = tf_asyncps.optimizers.LockingOptimizer(opt)
        model.compile(opt, loss)
    model.fit(tf_keras.utils.experimental.DatasetCreator(dataset_fn), epochs=epochs,
              steps_per_epoch=steps_per_epoch, verbose=0)
    diffs = [float(np.max(np.abs(a - b))) for a, b in zip(model.get_weights(), ref.get_weights())]
    moved = [float(np.max(np.abs(a - b))) for a, b in zip(ref.get_weights(), w0)]
    p = strategy.update_policy
    return ReplicasFit(
        replicas=strategy.num_replicas_in_sync, max_abs_diff=max(diffs), moved=max(moved),
        iterations=int(model.optimizer.iterations.numpy()),
        finite=all(bool(np.all(np.isfinite(v))) for v in model.get_weights()),
        rounds=p.rounds() if hasattr(p, "rounds") else None,
        loss_scale=(float(model.optimizer.loss_scale.numpy())
                    if precision == "mixed_float16" else None),
        stats=strategy.staleness_stats())


def _reset_precision(fit):
    """``fit(**case)``, then the global policy back to float32 for the next case."""
    def run(**case):
        try:
            return fit(**case)
        finally:
            tf_keras.mixed_precision.set_global_policy("float32")
    return run


@dataclasses.dataclass(frozen=True)
class ReplicasEmbeddingFit:
    """The Embedding model's fit with K replicas on one worker, and (in the
    scenario's process) the same model trained on batches K times as large.

    Attributes:
      max_abs_diff: max |weight - one-process weight| over all weights.
      moved: max |one-process weight - initial weight|.
      shards: the embedding table's shards (1: not split).
      iterations: the optimizer's step counter at the end (int).
      stats: the strategy's staleness counters.
    """
    max_abs_diff: float
    moved: float
    shards: int
    iterations: int
    stats: StalenessStats


def _replicas_embedding_fit(resolver, replicas=2, policy="async", epochs=2, steps_per_epoch=10,
                            batch=8, num_ps=1) -> ReplicasEmbeddingFit:
    """An Embedding model (sparse IndexedSlices gradients) with ``replicas``
    replicas on one worker, against one-process training on batches of
    replicas * batch examples in the same order. ``num_ps`` > 1: the table
    and the Dense layer are split over that many ps tasks
    (FixedShardsPartitioner); 1: each variable whole on one ps task."""
    rng = np.random.RandomState(0)
    ids = rng.randint(0, 50, size=(steps_per_epoch * batch * replicas, 3)).astype("int32")
    y = (ids[:, 0] % 2).astype("int64")
    loss = tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    w0 = [np.random.RandomState(1).uniform(-0.5, 0.5, shape).astype(np.float32)
          for shape in [(50, 4), (12, 2), (2,)]]

    def build():  # constant initializers: every shard starts from its rows of w0
        c = tf_keras.initializers.Constant
        return tf_keras.Sequential([tf_keras.layers.Input((3,), dtype="int32"),
                                    tf_keras.layers.Embedding(50, 4,
                                                              embeddings_initializer=c(w0[0])),
                                    tf_keras.layers.Flatten(),
                                    tf_keras.layers.Dense(2, kernel_initializer=c(w0[1]),
                                                          bias_initializer=c(w0[2]))])

    strategy = tf_asyncps.AsyncParameterServerStrategy(
        resolver, update_policy=policy,
        variable_partitioner=make_partitioner("fixed", num_ps) if num_ps > 1 else None)
    ref = build()
    ref.compile(tf_keras.optimizers.SGD(0.1), loss)
    ref.fit(tf.data.Dataset.from_tensor_slices((ids, y)).batch(batch * replicas).repeat(),
            epochs=epochs, steps_per_epoch=steps_per_epoch, verbose=0)
    with strategy.scope():
        model = build()
        model.compile(tf_keras.optimizers.SGD(0.1), loss)

    def dataset_fn(ctx):
        ds = tf.data.Dataset.from_tensor_slices((ids, y))
        return ds.shard(ctx.num_input_pipelines, ctx.input_pipeline_id).batch(batch).repeat()

    model.fit(tf_keras.utils.experimental.DatasetCreator(dataset_fn), epochs=epochs,
              steps_per_epoch=steps_per_epoch, verbose=0)
    full = [full_value(v) for v in (model.layers[0].embeddings, model.layers[2].kernel,
                                    model.layers[2].bias)]
    diffs = [float(np.max(np.abs(a - b))) for a, b in zip(full, ref.get_weights())]
    moved = [float(np.max(np.abs(a - b))) for a, b in zip(ref.get_weights(), w0)]
    return ReplicasEmbeddingFit(
        max_abs_diff=max(diffs), moved=max(moved),
        shards=len(variables_compat.shards(model.layers[0].embeddings) or [None]),
        iterations=int(model.optimizer.iterations.numpy()), stats=strategy.staleness_stats())


def _keras3_replicas_fit(resolver, replicas=2, epochs=2, steps_per_epoch=10,
                         batch=8) -> ReplicasFit:
    """Keras 3 fit (SGD) with ``replicas`` replicas on one worker against
    one-process Keras 3 training on batches of replicas * batch examples in
    the same order."""
    import keras
    rng = np.random.RandomState(0)
    n = steps_per_epoch * batch * replicas
    x, y = rng.randn(n, 4).astype(np.float32), rng.randn(n, 2).astype(np.float32)

    def make():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"),
                                  keras.layers.Dense(2)])
        model.compile(keras.optimizers.SGD(0.05), "mse")
        return model

    strategy = tf_asyncps.AsyncParameterServerStrategy(resolver)

    def dataset_fn(ctx):  # each replica takes its own batch, in turn
        return tf.data.Dataset.from_tensor_slices((x, y)).batch(batch).repeat()

    with strategy.scope():
        model = make()
    w0 = model.get_weights()
    model.fit(tf_asyncps.keras3.DatasetFn(dataset_fn), epochs=epochs,
              steps_per_epoch=steps_per_epoch, verbose=0)
    ref = make()
    ref.set_weights(w0)
    ref.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(batch * replicas).repeat(),
            epochs=epochs, steps_per_epoch=steps_per_epoch, verbose=0)
    diffs = [float(np.max(np.abs(a - b))) for a, b in zip(model.get_weights(), ref.get_weights())]
    moved = [float(np.max(np.abs(a - b))) for a, b in zip(ref.get_weights(), w0)]
    return ReplicasFit(
        replicas=strategy.num_replicas_in_sync, max_abs_diff=max(diffs), moved=max(moved),
        iterations=int(model.optimizer.iterations.numpy()),
        finite=all(bool(np.all(np.isfinite(v))) for v in model.get_weights()),
        rounds=None, loss_scale=None, stats=strategy.staleness_stats())


@dataclasses.dataclass(frozen=True)
class ReplicasRuns:
    """Several cases on one in-process cluster (each a new strategy).

    Attributes:
      fits: {case: its ReplicasFit} for the MLP cases.
      embedding_fits: {case: its ReplicasEmbeddingFit} for the Embedding cases.
      keras3_fits: {case: its ReplicasFit} for the Keras 3 cases.
    """
    fits: dict[str, ReplicasFit]
    embedding_fits: dict[str, ReplicasEmbeddingFit]
    keras3_fits: dict[str, ReplicasFit] = dataclasses.field(default_factory=dict)


@scenario
def replicas_runs(fits=None, embedding_fits=None, keras3_fits=None, replicas=2,
                  num_workers=1, num_ps=2) -> ReplicasRuns:
    """Each case of ``fits`` ({name: _replicas_fit kwargs}),
    ``embedding_fits`` ({name: _replicas_embedding_fit kwargs}) and
    ``keras3_fits`` ({name: _keras3_replicas_fit kwargs}) with a strategy
    of its own on one in-process cluster of ``num_workers`` workers with
    ``replicas`` CPU devices each and ``num_ps`` ps tasks (one cluster per
    process: docs/design.md#1-facts-measured-on-the-development-machine)."""
    fake_multi_replica_workers(replicas)
    servers, resolver = in_process_cluster(num_workers, cpus_per_worker=replicas,
                                           num_ps=num_ps)
    fit = _reset_precision(lambda **kw: _replicas_fit(resolver, replicas=replicas,
                                                      num_workers=num_workers, **kw))
    return ReplicasRuns(
        fits={name: fit(**kw) for name, kw in (fits or {}).items()},
        embedding_fits={name: _replicas_embedding_fit(resolver, replicas=replicas, **kw)
                        for name, kw in (embedding_fits or {}).items()},
        keras3_fits={name: _keras3_replicas_fit(resolver, replicas=replicas, **kw)
                     for name, kw in (keras3_fits or {}).items()})


#: The one-worker cases, on one cluster of 1 worker (2 CPU devices) and 2 ps tasks.
ONE_WORKER_FITS = {
    "async_momentum_schedule": dict(policy="async", optimizer="momentum_schedule"),
    "dc_asgd_adam_locking": dict(policy="dc_asgd", optimizer="adam", locking=True),
    "mixed_float16": dict(policy="async", optimizer="sgd", precision="mixed_float16")}
ONE_WORKER_EMBEDDING_FITS = {
    "drop_stale": dict(policy="drop_stale"),
    "split_drop_stale": dict(policy="drop_stale", num_ps=2),
    "split_sync_replicas": dict(policy="sync_replicas", num_ps=2)}
ONE_WORKER_KERAS3_FITS = {"sgd": {}}


@pytest.fixture(scope="module")
def one_worker():
    return run_scenario(replicas_runs, timeout=280, fits=ONE_WORKER_FITS,
                        embedding_fits=ONE_WORKER_EMBEDDING_FITS,
                        keras3_fits=ONE_WORKER_KERAS3_FITS)


@pytest.mark.parametrize("case", [
    "async_momentum_schedule",  # lr schedule reads the step counter
    "dc_asgd_adam_locking",     # read snapshot + lock; tau = 0 alone
])
@pytest.mark.cluster
def test_two_replicas_one_worker_equal_one_process_training(one_worker, case):
    r = one_worker.fits[case]
    assert r.replicas == 2
    assert r.moved > 0.05  # training did move the weights
    assert r.max_abs_diff < 1e-5, r
    s = r.stats
    assert r.iterations == 20 and s.global_step == 20 and s.applied == 20
    assert s.dropped == 0 and s.histogram[0] == 20  # one worker: tau = 0


@pytest.mark.cluster
def test_two_replicas_two_workers_sync_replicas_counts_worker_steps():
    r = run_scenario(replicas_runs, num_workers=2, num_ps=1, fits={"sync_replicas": dict(
        policy="sync_replicas", policy_args={"replicas_to_aggregate": 2, "timeout_s": 60},
        optimizer="sgd")}).fits["sync_replicas"]
    s = r.stats
    assert r.replicas == 2 and r.finite
    # Every worker step (not every replica) reaches the aggregator once.
    assert s.applied + s.dropped == 20
    # The identity of docs/concepts/staleness.md: a gradient computed before a drain's release
    # may arrive stale and be dropped (seen: 19 applied, 1 dropped, 9 rounds).
    assert s.global_step == s.applied // 2 == r.rounds
    assert r.iterations == s.global_step


@pytest.mark.cluster
def test_two_replicas_mixed_float16_loss_scaling_once_per_worker_step(one_worker):
    r = one_worker.fits["mixed_float16"]
    # float16 compute: close to float32 one-process training, not equal.
    assert r.finite and r.max_abs_diff < 1e-3 and r.moved > 0.05
    s = r.stats
    assert r.iterations == 20 == s.global_step == s.applied and s.dropped == 0
    # One loss-scale update per worker step, not per replica: 20 finite steps
    # at the default growth interval (2000) leave the initial scale.
    assert r.loss_scale == 2.0 ** 15


@pytest.mark.cluster
def test_two_replicas_sparse_embedding_gradients_stay_exact(one_worker):
    # Each replica's IndexedSlices are joined by concatenating rows (no
    # densifying); drop_stale takes the locked path.
    r = one_worker.embedding_fits["drop_stale"]
    assert r.shards == 1
    assert r.moved > 0.01 and r.max_abs_diff < 1e-5, r
    assert r.iterations == 20 == r.stats.global_step == r.stats.applied


@pytest.mark.cluster
@pytest.mark.parametrize("policy", ["drop_stale", "sync_replicas"])
def test_two_replicas_on_a_table_split_over_two_ps_tasks_stay_exact(one_worker, policy):
    # variable_partitioner with K = 2 replicas: each shard's rows from both
    # replicas are joined and applied once per worker step.
    r = one_worker.embedding_fits["split_" + policy]
    assert r.shards == 2
    assert r.moved > 0.01 and r.max_abs_diff < 1e-5, r
    assert r.iterations == 20 == r.stats.global_step == r.stats.applied


@pytest.mark.cluster
def test_two_replicas_one_worker_equal_one_process_keras3(one_worker):
    r = one_worker.keras3_fits["sgd"]
    assert r.replicas == 2 and r.moved > 0.01
    assert r.max_abs_diff < 1e-5, r
    assert r.iterations == 20 == r.stats.applied
