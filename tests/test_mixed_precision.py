"""Mixed precision: the optimizer hook with LossScaleOptimizer (one process),
float32 accumulation, and real clusters under mixed_bfloat16 / mixed_float16.

The cluster scenario sits above the tests that read it and returns the
dataclass declared with it (docs/tests.md#scenarios-beside-their-tests)."""

import dataclasses

import numpy as np
import pytest
import tensorflow as tf
import tf_keras

import tf_asyncps
from conftest import run_scenario
from scenarios import cluster, scenario
from scenarios.common import mlp, small_problem
from tf_asyncps import StalenessStats
from tf_asyncps.app import job
from tf_asyncps.core import mixed_precision
from tf_asyncps.app import models
from tf_asyncps.core.step import WorkerStep, install_optimizer_hooks
from tf_asyncps.core.grads import cast
from tf_asyncps.policies.sync_replicas import _accumulator_dtype

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def policy(request):
    """Sets a tf_keras global dtype policy for one test."""
    previous = tf_keras.mixed_precision.global_policy()
    tf_keras.mixed_precision.set_global_policy(request.param)
    yield request.param
    tf_keras.mixed_precision.set_global_policy(previous)


class _RecordingEngine:
    """Stands in for the strategy's engine: records each hooked call."""

    def __init__(self):
        self.calls = []

    def apply_step(self, step, optimizer, grads_and_vars, apply_fn):
        self.calls.append((optimizer, [g for g, _ in grads_and_vars]))
        return apply_fn(grads_and_vars)


@pytest.mark.parametrize("policy", ["mixed_float16"], indirect=True)
def test_hook_acts_once_on_the_loss_scale_optimizer_with_unscaled_float32_grads(policy):
    install_optimizer_hooks()
    layer = tf_keras.layers.Dense(1, use_bias=False, kernel_initializer="ones")
    layer.build((None, 2))
    kernel = layer.kernel
    assert type(kernel).__name__ == "AutoCastVariable" and kernel.dtype == tf.float32
    opt = tf_keras.mixed_precision.LossScaleOptimizer(tf_keras.optimizers.SGD(0.5),
                                                      initial_scale=1024.0)
    opt.build([kernel])
    engine = _RecordingEngine()
    x = tf.constant([[1.0, 3.0]])
    seen = {}

    @tf.function
    def step():
        with WorkerStep(engine, tf.constant(0, tf.int64)).active():
            with tf.GradientTape() as tape:
                out = layer(x)  # float16 compute
                loss = tf.reduce_sum(tf.cast(out, tf.float32))
                scaled = opt.get_scaled_loss(loss)
            grads = opt.get_unscaled_gradients(tape.gradient(scaled, [kernel]))
            seen["dtype"] = grads[0].dtype
            opt.apply_gradients(zip(grads, [kernel]))
            return grads[0]

    grad = step().numpy()
    # d loss / d kernel = x^T, unscaled (the loss scale 1024 divided back out).
    np.testing.assert_allclose(grad, [[1.0], [3.0]])
    assert seen["dtype"] == tf.float32
    assert len(engine.calls) == 1  # once per step, not again for the inner SGD
    optimizer, grads = engine.calls[0]
    assert optimizer is opt and [g.dtype for g in grads] == [tf.float32]
    np.testing.assert_allclose(kernel.numpy(), [[1.0 - 0.5], [1.0 - 1.5]])
    assert int(opt.iterations.numpy()) == 1


def test_nonfinite_step_lowers_the_loss_scale_finite_counts_a_good_step():
    opt = tf_keras.mixed_precision.LossScaleOptimizer(
        tf_keras.optimizers.SGD(0.1), initial_scale=256.0, dynamic_growth_steps=2)
    w = tf.Variable([1.0, 2.0])
    opt.build([w])

    @tf.function
    def skip(g):
        with tf.control_dependencies(mixed_precision.update_loss_scale(opt, [g])):
            return tf.constant(0)

    skip(tf.constant([np.inf, 1.0]))
    assert float(opt.loss_scale.numpy()) == 128.0
    skip(tf.constant([1.0, 1.0]))
    skip(tf.constant([1.0, 1.0]))  # two good steps: growth
    assert float(opt.loss_scale.numpy()) == 256.0
    np.testing.assert_array_equal(w.numpy(), [1.0, 2.0])  # never applied
    fixed = tf_keras.mixed_precision.LossScaleOptimizer(
        tf_keras.optimizers.SGD(0.1), dynamic=False, initial_scale=8.0)
    assert mixed_precision.update_loss_scale(fixed, [tf.constant([np.nan])]) == []


def test_loss_scale_optimizer_detection_and_locking_through_the_wrapper():
    sgd = tf_keras.optimizers.SGD(0.1)
    assert mixed_precision.loss_scale_optimizer(sgd) is None
    lso = tf_keras.mixed_precision.LossScaleOptimizer(
        tf_asyncps.optimizers.LockingOptimizer(sgd, timeout_s=7.0))
    assert mixed_precision.loss_scale_optimizer(lso) is lso
    assert tf_asyncps.optimizers.is_locking(lso)
    assert tf_asyncps.optimizers.lock_timeout(lso) == 7.0
    legacy = tf_keras.mixed_precision.LossScaleOptimizer(tf_keras.optimizers.legacy.SGD(0.1))
    assert mixed_precision.loss_scale_optimizer(legacy) is legacy
    assert not tf_asyncps.optimizers.is_locking(legacy)
    outer = tf_asyncps.optimizers.LockingOptimizer(
        tf_keras.mixed_precision.LossScaleOptimizer(tf_keras.optimizers.SGD(0.1)), timeout_s=3)
    assert tf_asyncps.optimizers.lock_timeout(outer) == 3.0


def test_resolve_precision_names():
    assert mixed_precision.resolve("none", 1) == "float32"
    assert mixed_precision.resolve("auto", 1) == "mixed_float16"
    assert mixed_precision.resolve("auto", 0) == "mixed_bfloat16"
    assert mixed_precision.resolve("auto", 2) == "mixed_float16"
    assert mixed_precision.resolve("mixed_bfloat16", 1) == "mixed_bfloat16"
    with pytest.raises(ValueError, match="--mixed_precision='fp8'.*mixed_float16"):
        mixed_precision.resolve("fp8", 0)
    with pytest.raises(ValueError, match="--mixed_precision"):
        job.JobConfig(mixed_precision="half").validate()


def test_gradients_reach_policies_in_the_variable_dtype_and_sums_are_float32():
    g16 = tf.constant([1.0, 2.0], tf.float16)
    assert cast(g16, tf.float32).dtype == tf.float32
    sparse = tf.IndexedSlices(tf.constant([[0.5]], tf.bfloat16), tf.constant([3]), [5, 1])
    sparse32 = cast(sparse, tf.float32)
    assert isinstance(sparse32, tf.IndexedSlices) and sparse32.values.dtype == tf.float32
    g32 = tf.constant([1.0])
    assert cast(g32, tf.float32) is g32
    assert _accumulator_dtype(tf.float16) == tf.float32
    assert _accumulator_dtype(tf.bfloat16) == tf.float32
    assert _accumulator_dtype(tf.float64) == tf.float64
    # 2048 + 1 is not representable in float16; the float32 buffer keeps it.
    buf = tf.Variable(tf.zeros([1], _accumulator_dtype(tf.float16)))
    for v in (2048.0, 1.0):
        buf.assign_add(cast(tf.constant([v], tf.float16), buf.dtype))
    assert float(buf.numpy()[0]) == 2049.0


@pytest.mark.parametrize("policy", ["mixed_bfloat16"], indirect=True)
def test_job_model_keeps_float32_weights_and_logits(policy):
    m = models.build_model("mlp", 64, 10, (32,), seed=0)
    assert m.layers[0].compute_dtype == "bfloat16"
    assert {w.dtype for w in m.weights} == {tf.float32}
    assert m(tf.zeros([2, 64])).dtype == tf.float32
    tf_keras.mixed_precision.set_global_policy("float32")
    plain = models.build_model("mlp", 64, 10, (32,), seed=0)
    assert [w.shape for w in plain.weights] == [w.shape for w in m.weights]


@pytest.mark.parametrize("policy", ["mixed_bfloat16"], indirect=True)
def test_base_variable_finds_the_variable_under_an_autocast_variable(policy):
    """dc_asgd's read values are looked up by the variable the strategy
    created, which tf_keras hides under an AutoCastVariable (it got no read
    value once)."""
    created = []

    def creator(next_creator, **kwargs):
        created.append(next_creator(**kwargs))
        return created[-1]

    layer = tf_keras.layers.Dense(2)
    with tf.variable_creator_scope(creator):
        layer.build((None, 3))
    assert type(layer.kernel).__name__ == "AutoCastVariable"
    assert mixed_precision.base_variable(layer.kernel) is created[0]
    plain = tf.Variable(1.0)
    assert mixed_precision.base_variable(plain) is plain


# -- real clusters (one process each) ------------------------------------------
@dataclasses.dataclass(frozen=True)
class MixedPrecisionFit:
    """model.fit of the small MLP (SparseCategoricalCrossentropy, SGD) under a
    tf_keras mixed-precision policy.

    Attributes:
      scheduled: the steps fit scheduled (epochs * steps_per_epoch).
      compute_dtypes: the two Dense layers' compute dtypes (sorted, distinct).
      variable_dtypes: the model weights' dtypes (sorted, distinct).
      policy_grad_dtypes: the dtypes of the gradients the update policy
        received, recorded at trace time (sorted, distinct).
      traces: how many gradient dtypes were recorded over all traces.
      loss0, loss: the float32 loss on the whole problem before and after fit.
      iterations: the optimizer's step counter at the end (int).
      loss_scale: the LossScaleOptimizer's scale at the end (mixed_float16
        only; None otherwise).
      lock_acquisitions: the update lock's acquisitions (0 without a lock).
      stats: the strategy's staleness counters.
    """
    scheduled: int
    compute_dtypes: list[str]
    variable_dtypes: list[str]
    policy_grad_dtypes: list[str]
    traces: int
    loss0: float
    loss: float
    iterations: int
    loss_scale: float | None
    lock_acquisitions: int
    stats: StalenessStats


@scenario(shares_cluster=True)
def mixed_precision_fit(precision="mixed_bfloat16", policy="async", policy_args=None,
                        num_workers=2, epochs=2, steps_per_epoch=40, batch=16, lr=0.1,
                        initial_scale=None, locking=False) -> MixedPrecisionFit:
    """model.fit of a small MLP under a tf_keras mixed-precision policy.

    Records, at trace time on this chief, the dtypes of the gradients the
    update policy receives. ``initial_scale`` (mixed_float16 only) starts the
    loss scale high enough to overflow float16, so the first steps have
    non-finite gradients. ``locking`` wraps the inner optimizer in
    LockingOptimizer (the LossScaleOptimizer goes around it).
    """
    x, y = small_problem()
    loss = tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def dataset_fn(ctx):
        ds = tf.data.Dataset.from_tensor_slices((x, y))
        ds = ds.shard(ctx.num_input_pipelines, ctx.input_pipeline_id)
        return ds.shuffle(len(x), seed=0).repeat().batch(batch)

    def full_loss(weights):  # float32, in this process
        ref = mlp()
        ref.set_weights(weights)
        return float(loss(y, ref(x)))

    with cluster(num_workers=num_workers, num_ps=1) as c:
        strategy = tf_asyncps.AsyncParameterServerStrategy(
            c.resolver(), update_policy=tf_asyncps.policies.get(policy, **(policy_args or {})))
        seen = []
        original_update = strategy.update_policy.update

        def recording_update(grads, state, info):
            seen.extend(sorted({g.dtype.name for g in grads}))
            return original_update(grads, state, info)

        strategy.update_policy.update = recording_update
        tf_keras.utils.set_random_seed(0)
        tf_keras.mixed_precision.set_global_policy(precision)
        with strategy.scope():
            model = tf_keras.Sequential([
                tf_keras.Input(shape=(8,)),
                tf_keras.layers.Dense(16, activation="tanh"),
                tf_keras.layers.Dense(3),
                tf_keras.layers.Activation("linear", dtype="float32")])
            opt = tf_keras.optimizers.SGD(lr)
            if locking:
                opt = tf_asyncps.optimizers.LockingOptimizer(opt)
            if precision == "mixed_float16":
                opt = tf_keras.mixed_precision.LossScaleOptimizer(
                    opt, **({"initial_scale": initial_scale} if initial_scale else {}))
            model.compile(opt, loss)
        w0 = model.get_weights()
        model.fit(tf_keras.utils.experimental.DatasetCreator(dataset_fn), epochs=epochs,
                  steps_per_epoch=steps_per_epoch, verbose=0)
        tf_keras.mixed_precision.set_global_policy("float32")
        lock = strategy.extended.engine.lock
        return MixedPrecisionFit(
            scheduled=epochs * steps_per_epoch,
            compute_dtypes=sorted({l.compute_dtype for l in model.layers[:2]}),
            variable_dtypes=sorted({v.dtype.name for v in model.weights}),
            policy_grad_dtypes=sorted(set(seen)), traces=len(seen),
            loss0=full_loss(w0), loss=full_loss(model.get_weights()),
            iterations=int(model.optimizer.iterations.numpy()),
            loss_scale=(float(model.optimizer.loss_scale.numpy())
                        if precision == "mixed_float16" else None),
            lock_acquisitions=lock.acquisitions() if lock is not None else 0,
            stats=strategy.staleness_stats())


def _accounting(r):
    s = r.stats
    assert s.applied + s.dropped == r.scheduled
    return s


@pytest.mark.cluster
def test_sync_replicas_under_mixed_bfloat16_trains_in_float32_sums():
    r = run_scenario(mixed_precision_fit, shared=(2, 1), precision="mixed_bfloat16",
                     policy="sync_replicas",
                     policy_args={"replicas_to_aggregate": 2, "timeout_s": 30})
    s = _accounting(r)
    assert r.compute_dtypes == ["bfloat16"] and r.variable_dtypes == ["float32"]
    assert r.policy_grad_dtypes == ["float32"] and r.traces >= 1
    assert s.global_step == s.applied // 2 == r.iterations > 0
    assert r.loss < 0.6 * r.loss0, r


@pytest.mark.cluster
def test_mixed_float16_loss_scaling_drops_overflowing_steps_and_lowers_the_scale():
    """LossScaleOptimizer around a LockingOptimizer, loss scale starting at 2**20:
    the first steps overflow float16, are dropped as non-finite and halve it."""
    r = run_scenario(mixed_precision_fit, shared=(2, 1), precision="mixed_float16",
                     initial_scale=2.0 ** 20, locking=True)
    s = _accounting(r)
    assert r.compute_dtypes == ["float16"] and r.policy_grad_dtypes == ["float32"]
    assert s.nonfinite == s.dropped >= 1
    # Each overflow halves the scale once (drops run under the lock: no race).
    assert r.loss_scale == 2.0 ** 20 / 2 ** s.nonfinite
    assert s.global_step == s.applied == r.iterations
    assert r.lock_acquisitions == r.scheduled  # the lock is seen through the wrapper
    assert r.loss < 0.6 * r.loss0, r


def test_local_sgd_refuses_dynamic_loss_scaling():
    local = tf_asyncps.policies.get("local_sgd")
    dynamic = tf_keras.mixed_precision.LossScaleOptimizer(tf_keras.optimizers.SGD(0.1))
    fixed = tf_keras.mixed_precision.LossScaleOptimizer(tf_keras.optimizers.SGD(0.1),
                                                        dynamic=False, initial_scale=8.0)
    with pytest.raises(ValueError, match="local_sgd cannot use a dynamic LossScaleOptimizer"):
        mixed_precision.check_local_copies(local, dynamic)
    with pytest.raises(ValueError, match="mixed_bfloat16"):
        mixed_precision.check_local_copies(local, precision="mixed_float16")
    mixed_precision.check_local_copies(local, fixed)  # a fixed scale is fine
    mixed_precision.check_local_copies(local, precision="mixed_bfloat16")
    mixed_precision.check_local_copies(tf_asyncps.policies.get("async"), dynamic)
    with pytest.raises(ValueError, match="local_sgd cannot use"):
        job.JobConfig(policy="local_sgd", mixed_precision="mixed_float16").validate()
