"""Locking optimizers and exact update accounting (case 002 and friends).

Each cluster scenario sits above the tests that read it and returns the
dataclass declared with it (docs/tests.md#scenarios-beside-their-tests)."""

import dataclasses
import threading
import time

import numpy as np
import pytest
import tensorflow as tf
import tf_keras

import tf_asyncps
from conftest import run_scenario
from scenarios import cluster, scenario
from scenarios.common import make_optimizer, mlp, run_steps, small_problem, step_fn
from tf_asyncps import StalenessStats, optimizers

pytestmark = pytest.mark.timeout(300)


# -- case 002: loss = sum(w) ------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Case002:
    """Case 002 after its steps: loss = sum(w) over w = zeros([dim]), so every
    step's gradient is 1 in every element; 4 workers share the steps.

    Attributes:
      iterations: the optimizer's step counter at the end (int).
      w_min, w_max: the smallest and largest element of w at the end. Under
        SGD (learning rate 1) each applied step subtracts exactly 1, so both
        are -steps (-200.0) when no update is lost.
      ref: w[0] after the same optimizer's ``steps`` sequential steps on the
        same gradient, in the scenario's own process (learning rate 1 for SGD,
        1e-3 otherwise).
      max_abs_diff: max |w - the sequential reference| over the elements.
      stats: the strategy's staleness counters.
    """
    iterations: int
    w_min: float
    w_max: float
    ref: float
    max_abs_diff: float
    stats: StalenessStats


@scenario(shares_cluster=True)
def case002(keras_name="tf_keras", optimizer="sgd", locking=False, num_workers=4,
            steps=200, dim=1000) -> Case002:
    """``steps`` steps of ``optimizer`` (make_optimizer's names; through
    LockingOptimizer if ``locking``) on loss = sum(w), on ``num_workers``."""
    lr = 1.0 if optimizer.endswith("sgd") else 1e-3
    with cluster(num_workers=num_workers, num_ps=1) as c:
        strategy = tf_asyncps.AsyncParameterServerStrategy(c.resolver())
        coord = tf.distribute.coordinator.ClusterCoordinator(strategy)
        with strategy.scope():
            w = tf.Variable(tf.zeros([dim]), name="w")
            opt = make_optimizer(optimizer, lr, keras_name)
            if locking:
                opt = tf_asyncps.optimizers.LockingOptimizer(opt, timeout_s=60)
            if keras_name == "keras3":
                opt.build([w])

        run_steps(coord, step_fn(strategy, [w], opt, lambda: tf.reduce_sum(w)), steps)
        got = w.numpy()
        # Reference: the same optimizer, `steps` sequential steps, in this process.
        ref_w = tf.Variable(tf.zeros([dim]))
        ref_opt = make_optimizer(optimizer, lr, keras_name)
        for _ in range(steps):
            ref_opt.apply_gradients([(tf.ones([dim]), ref_w)])
        return Case002(iterations=int(opt.iterations.numpy()), w_min=float(got.min()),
                       w_max=float(got.max()), ref=float(ref_w.numpy()[0]),
                       max_abs_diff=float(np.max(np.abs(got - ref_w.numpy()))),
                       stats=strategy.staleness_stats())


@pytest.mark.parametrize("keras_name", ["tf_keras", "keras3"])
@pytest.mark.parametrize("locking", [False, True], ids=["unlocked", "locked"])
@pytest.mark.cluster
def test_case_002_sgd_counter_and_weights_are_exact(keras_name, locking):
    r = run_scenario(case002, shared=(4, 1), keras_name=keras_name, optimizer="sgd",
                     locking=locking)
    assert r.iterations == 200 == r.stats.applied == r.stats.global_step
    assert r.w_min == r.w_max == -200.0  # one assign_sub per step, lr 1


@pytest.mark.parametrize("keras_name", ["tf_keras", "keras3"])
@pytest.mark.cluster
def test_case_002_adam_with_locking_equals_sequential_adam(keras_name):
    r = run_scenario(case002, shared=(4, 1), keras_name=keras_name, optimizer="adam",
                     locking=True)
    assert r.iterations == 200 == r.stats.applied
    assert r.max_abs_diff < 1e-5
    assert r.ref < -0.1  # Adam really moved w


@pytest.mark.parametrize("keras_name", ["tf_keras", "keras3"])
@pytest.mark.cluster
def test_case_002_adam_unlocked_counter_is_exact(keras_name):
    r = run_scenario(case002, shared=(4, 1), keras_name=keras_name, optimizer="adam",
                     locking=False)
    assert r.iterations == 200 == r.stats.applied == r.stats.global_step


@pytest.mark.cluster
def test_legacy_tf_keras_optimizer_with_locking():
    r = run_scenario(case002, shared=(4, 1), keras_name="tf_keras", optimizer="legacy_adam",
                     locking=True)
    assert r.iterations == 200 and r.max_abs_diff < 1e-5


# -- a read-modify-write update ---------------------------------------------------
class _HalfPlusGrad(tf_keras.optimizers.Optimizer):
    """A read-modify-write update: var <- 0.5 * var + g (not commutative)."""

    def __init__(self, name="half_plus_grad", **kwargs):
        super().__init__(name=name, **kwargs)
        self._learning_rate = self._build_learning_rate(1.0)

    def update_step(self, gradient, variable):
        variable.assign(0.5 * variable + gradient)


@dataclasses.dataclass(frozen=True)
class ReadModifyWrite:
    """A scalar w (0 at first) after ``steps`` steps of _HalfPlusGrad on
    loss = w (gradient 1): w <- 0.5 w + 1 per applied update.

    Attributes:
      w: w at the end.
      iterations: the optimizer's step counter at the end (int).
      stats: the strategy's staleness counters.
    """
    w: float
    iterations: int
    stats: StalenessStats


@scenario(shares_cluster=True)
def read_modify_write(locking=True, num_workers=4, steps=20) -> ReadModifyWrite:
    with cluster(num_workers=num_workers, num_ps=1) as c:
        strategy = tf_asyncps.AsyncParameterServerStrategy(c.resolver())
        coord = tf.distribute.coordinator.ClusterCoordinator(strategy)
        with strategy.scope():
            w = tf.Variable(0.0, name="w")
            opt = _HalfPlusGrad()
            if locking:
                opt = tf_asyncps.optimizers.LockingOptimizer(opt)

        run_steps(coord, step_fn(strategy, [w], opt, lambda: w * 1.0), steps)
        return ReadModifyWrite(w=float(w.numpy()), iterations=int(opt.iterations.numpy()),
                               stats=strategy.staleness_stats())


@pytest.mark.cluster
def test_read_modify_write_with_locking_is_the_sequential_recurrence():
    r = run_scenario(read_modify_write, shared=(4, 1), locking=True, num_workers=4, steps=20)
    # w_n = 0.5 w_{n-1} + 1, w_0 = 0  ->  w_20 = 2 (1 - 2^-20), exact in float32
    assert r.w == 2 * (1 - 0.5 ** 20)
    assert r.iterations == 20 == r.stats.applied


@pytest.mark.cluster
def test_read_modify_write_without_locking_keeps_only_the_guarantees():
    """Unlocked read-modify-write updates may be lost (w = 2(1 - 2^-k), k <= 20);
    what is guaranteed: the counters are exact and w never passes the locked value."""
    r = run_scenario(read_modify_write, shared=(4, 1), locking=False, num_workers=4, steps=20)
    assert r.iterations == 20 == r.stats.applied == r.stats.global_step
    assert 1.0 <= r.w <= 2 * (1 - 0.5 ** 20)


# -- a worker killed while it may hold the lock -----------------------------------
@dataclasses.dataclass(frozen=True)
class LockingWorkerKilled:
    """model.fit under LockingOptimizer(Adam) with worker 1 SIGKILLed once the
    global step reaches ``kill_after``.

    Attributes:
      killed: whether the kill happened during fit.
      scheduled: the steps fit scheduled (epochs * steps_per_epoch).
      iterations: the optimizer's step counter at the end (int).
      weights_finite: every model weight is finite at the end.
      stats: the strategy's staleness counters.
    """
    killed: bool
    scheduled: int
    iterations: int
    weights_finite: bool
    stats: StalenessStats


@scenario
def locking_worker_killed(num_workers=3, epochs=4, steps_per_epoch=50,
                          kill_after=60) -> LockingWorkerKilled:
    """LockingOptimizer under model.fit; worker 1 is SIGKILLed mid-fit."""
    x, y = small_problem()

    def dataset_fn(ctx):
        ds = tf.data.Dataset.from_tensor_slices((x, y))
        ds = ds.shard(ctx.num_input_pipelines, ctx.input_pipeline_id)
        return ds.repeat().batch(16)

    with cluster(num_workers=num_workers, num_ps=1) as c:
        strategy = tf_asyncps.AsyncParameterServerStrategy(c.resolver())
        with strategy.scope():
            model = mlp()
            model.compile(tf_asyncps.optimizers.LockingOptimizer(
                tf_keras.optimizers.Adam(0.01), timeout_s=30),
                tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        killed = threading.Event()
        done = threading.Event()

        def kill_mid_fit():  # polls the PS global step (tf_keras allows no batch hooks)
            while not done.wait(0.02):
                if strategy.staleness_stats().global_step >= kill_after:
                    c.kill("worker:1")
                    killed.set()
                    return

        killer = threading.Thread(target=kill_mid_fit, daemon=True)
        killer.start()
        try:
            model.fit(tf_keras.utils.experimental.DatasetCreator(dataset_fn), epochs=epochs,
                      steps_per_epoch=steps_per_epoch, verbose=0)
        finally:
            done.set()
            killer.join(timeout=10)
        return LockingWorkerKilled(
            killed=killed.is_set(), scheduled=epochs * steps_per_epoch,
            iterations=int(model.optimizer.iterations.numpy()),
            weights_finite=all(np.all(np.isfinite(v)) for v in model.get_weights()),
            stats=strategy.staleness_stats())


@pytest.mark.cluster
def test_a_killed_worker_does_not_block_the_lock():
    r = run_scenario(locking_worker_killed, num_workers=3, epochs=4, steps_per_epoch=50,
                     kill_after=60)
    assert r.killed
    s = r.stats
    # TensorFlow may run the killed worker's in-flight closure again (at-least-once).
    assert 200 <= s.applied <= 201
    assert r.iterations == s.applied == s.global_step
    assert r.weights_finite


# -- a lock nobody can take -------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class LockTimeout:
    """A step scheduled while the update lock's token is held (taken by hand).

    Attributes:
      error: the exception's class name the join raised (None: none).
      message: its message ("" if none).
      seconds: from scheduling the step to the join's end (wall clock, s).
      w: w (1.0 at first, loss 2 w, SGD 0.1) at the end.
    """
    error: str | None
    message: str
    seconds: float
    w: float


@scenario
def lock_timeout(timeout_s=2.0) -> LockTimeout:
    """The update lock's token is held (taken by hand): the step must fail
    with TimeoutError after timeout_s, not hang."""
    with cluster(num_workers=1, num_ps=1) as c:
        strategy = tf_asyncps.AsyncParameterServerStrategy(c.resolver())
        coord = tf.distribute.coordinator.ClusterCoordinator(strategy)
        with strategy.scope():
            w = tf.Variable(1.0)
            opt = tf_asyncps.optimizers.LockingOptimizer(tf_keras.optimizers.SGD(0.1),
                                                         timeout_s=timeout_s)

        step = step_fn(strategy, [w], opt, lambda: w * 2.0)
        run_steps(coord, step, 1)  # traces the step and creates the lock
        lock = strategy.extended.engine.lock
        lock._queue.dequeue()  # steal the token: nobody can acquire now
        t0 = time.perf_counter()
        coord.schedule(step)
        try:
            coord.join()
            err = None
        except Exception as e:  # noqa: BLE001 - reported to the test
            err = e
        return LockTimeout(error=type(err).__name__ if err else None, message=str(err),
                           seconds=time.perf_counter() - t0, w=float(w.numpy()))


@pytest.mark.cluster
def test_lock_wait_times_out_with_a_clear_error():
    r = run_scenario(lock_timeout, timeout_s=2.0)
    assert r.error == "TimeoutError"
    assert "update lock" in r.message and "timeout_s" in r.message
    assert r.seconds < 30
    assert r.w == pytest.approx(0.8)  # only the first step was applied


# -- the optimizer wrapper in one process -----------------------------------------
def test_locking_optimizer_arguments():
    opt = tf_keras.optimizers.SGD(0.1)
    assert optimizers.LockingOptimizer(opt) is opt and optimizers.is_locking(opt)
    assert not optimizers.is_locking(tf_keras.optimizers.SGD(0.1))
    with pytest.raises(TypeError, match="optimizer instance"):
        optimizers.LockingOptimizer("sgd")
    with pytest.raises(TypeError, match="optimizer instance"):
        optimizers.LockingOptimizer(tf_keras.optimizers.SGD)
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        optimizers.LockingOptimizer(tf_keras.optimizers.SGD(0.1), timeout_s=0)


def test_make_locking_is_the_verb_and_isinstance_of_locking_optimizer_holds():
    # LockingOptimizer was a function that marked its argument, so
    # isinstance(x, LockingOptimizer) raised TypeError.
    from tf_keras.mixed_precision import LossScaleOptimizer
    opt = tf_keras.optimizers.Adam(0.1)
    assert not isinstance(opt, optimizers.LockingOptimizer)
    assert optimizers.make_locking(opt, timeout_s=5) is opt
    assert isinstance(opt, optimizers.LockingOptimizer)
    assert isinstance(opt, tf_keras.optimizers.Adam)  # still Keras's own class
    assert optimizers.lock_timeout(opt) == 5.0
    assert isinstance(LossScaleOptimizer(opt), optimizers.LockingOptimizer)  # a wrapper of one
    assert not isinstance(LossScaleOptimizer(tf_keras.optimizers.SGD(0.1)),
                          optimizers.LockingOptimizer)
