"""An optimizer built lazily, by its first ``apply_gradients`` inside a
scheduled ``tf.function`` (issue 37 item 2).

Keras 3 Adam failed to trace there with ``UnliftableError`` (its slot's
initializer depended on the worker step's read of the global step, so
tf.function could not lift it out of the step). Each run is compared with
the same loop in one process.

The cluster scenario sits above the tests that read it and returns the
dataclass declared with it (docs/tests.md#scenarios-beside-their-tests).
"""

import dataclasses

import numpy as np
import pytest
import tensorflow as tf

import tf_asyncps
from conftest import run_scenario
from scenarios import cluster, scenario
from tf_asyncps import StalenessStats

pytestmark = pytest.mark.cluster

LR, STEPS = 0.01, 150
SIZE = 50


def _optimizer(name, lr):
    if name == "keras3_adam":
        import keras
        return keras.optimizers.Adam(lr)
    if name == "keras3_rmsprop":
        import keras
        return keras.optimizers.RMSprop(lr)
    if name == "tf_keras_adagrad":
        import tf_keras
        return tf_keras.optimizers.Adagrad(lr)
    raise ValueError(f"unknown optimizer {name!r}")


def _train(strategy, optimizer, lr, steps, coord=None):
    """The issue's loop: w = zeros(50) and the optimizer made in ``strategy``'s
    scope, a tf.function whose strategy.run body applies the gradient of
    sum(w * linspace(0.5, 1.5, 50)), run ``steps`` times (scheduled when
    ``coord`` is given). Returns (w, optimizer)."""
    with strategy.scope():
        w = tf.Variable(tf.zeros([SIZE]))
        opt = _optimizer(optimizer, lr)
    a = tf.linspace(0.5, 1.5, SIZE)

    @tf.function
    def step():
        def body():
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(w * a)
            opt.apply_gradients(zip(tape.gradient(loss, [w]), [w]))
        strategy.run(body)

    for _ in range(steps):
        if coord is None:
            step()
        else:
            coord.schedule(step)
    if coord is not None:
        coord.join()
    return w, opt


@dataclasses.dataclass(frozen=True)
class LazilyBuiltOptimizer:
    """The issue's loop (_train) scheduled on the workers, and the same loop
    in one process (the default strategy).

    Attributes:
      weights: w (50 floats) after the scheduled loop.
      ref_weights: w after the one-process loop.
      iterations, ref_iterations: the two optimizers' step counters (int).
      finite: every element of ``weights`` is finite.
      stats: the strategy's staleness counters.
      closures_per_worker: closures completed per worker index.
    """
    weights: list[float]
    ref_weights: list[float]
    iterations: int
    ref_iterations: int
    finite: bool
    stats: StalenessStats
    closures_per_worker: list[int]


@scenario(shares_cluster=True)
def lazily_built_optimizer(optimizer="keras3_adam", num_workers=3, steps=150,
                           lr=0.01) -> LazilyBuiltOptimizer:
    """The scheduled loop on ``num_workers`` workers and the same loop in one
    process (the default strategy): the weights of both and the counters."""
    with cluster(num_workers=num_workers, num_ps=1) as c:
        strategy = tf_asyncps.AsyncParameterServerStrategy(c.resolver())
        coord = tf.distribute.coordinator.ClusterCoordinator(strategy)
        w, opt = _train(strategy, optimizer, lr, steps, coord)
        ref_w, ref_opt = _train(tf.distribute.get_strategy(), optimizer, lr, steps)
        return LazilyBuiltOptimizer(
            weights=w.numpy().tolist(), ref_weights=ref_w.numpy().tolist(),
            iterations=int(opt.iterations.numpy()),
            ref_iterations=int(ref_opt.iterations.numpy()),
            finite=bool(np.all(np.isfinite(w.numpy()))), stats=strategy.staleness_stats(),
            closures_per_worker=strategy.closures_done_per_worker())


def test_keras3_adam_built_lazily_runs_the_issues_150_steps_on_three_workers():
    r = run_scenario(lazily_built_optimizer, shared=(3, 1), optimizer="keras3_adam",
                     num_workers=3, steps=STEPS, lr=LR)
    assert r.iterations == STEPS == r.stats.applied == sum(r.closures_per_worker)
    assert r.ref_iterations == STEPS
    assert r.finite
    # A constant gradient: each Adam step moves every weight by about lr
    # (m_hat / sqrt(v_hat) = 1, _adam_closed_form), whatever the order; 150
    # steps of 0.01. Concurrent steps' slot updates shift the first steps'
    # bias correction a little (measured -1.5079 for all 50 weights).
    assert np.allclose(r.weights, -LR * STEPS, atol=0.1)


@pytest.mark.parametrize("optimizer", ["keras3_adam", "keras3_rmsprop", "tf_keras_adagrad"])
def test_lazily_built_optimizer_on_one_worker_equals_one_process(optimizer):
    r = run_scenario(lazily_built_optimizer, shared=(1, 1), optimizer=optimizer,
                     num_workers=1, steps=STEPS, lr=LR)
    assert r.iterations == STEPS == r.ref_iterations == r.stats.applied
    np.testing.assert_allclose(r.weights, r.ref_weights, rtol=0, atol=1e-6)
    if optimizer == "keras3_adam":
        np.testing.assert_allclose(r.weights, _adam_closed_form(), rtol=0, atol=1e-5)


def _adam_closed_form(b1=0.9, b2=0.999, eps=1e-7):
    """Keras 3 Adam on a constant gradient g = linspace(0.5, 1.5, 50):
    m_t = g (1 - b1^t), v_t = g^2 (1 - b2^t), so step t moves w by
    lr sqrt(1 - b2^t) / (1 - b1^t) * m_t / (sqrt(v_t) + eps)."""
    g = np.linspace(0.5, 1.5, 50)
    w = np.zeros(50)
    for t in range(1, STEPS + 1):
        alpha = LR * np.sqrt(1 - b2 ** t) / (1 - b1 ** t)
        w -= alpha * g * (1 - b1 ** t) / (np.abs(g) * np.sqrt(1 - b2 ** t) + eps)
    return w
