"""An optimizer built lazily, by its first ``apply_gradients`` inside a
scheduled ``tf.function`` (issue 37 item 2).

Keras 3 Adam failed to trace there with ``UnliftableError`` (its slot's
initializer depended on the worker step's read of the global step, so
tf.function could not lift it out of the step). Each run is compared with
the same loop in one process.
"""

import numpy as np
import pytest

from conftest import run_scenario

pytestmark = pytest.mark.cluster

LR, STEPS = 0.01, 150


def test_keras3_adam_built_lazily_runs_the_issues_150_steps_on_three_workers():
    r = run_scenario("lazily_built_optimizer", shared=(3, 1), optimizer="keras3_adam",
                     num_workers=3, steps=STEPS, lr=LR)
    assert r["iterations"] == STEPS == r["stats"]["applied"] == sum(r["closures_per_worker"])
    assert r["ref_iterations"] == STEPS
    assert r["finite"]
    # A constant gradient: each Adam step moves every weight by about lr
    # (m_hat / sqrt(v_hat) = 1, _adam_closed_form), whatever the order; 150
    # steps of 0.01. Concurrent steps' slot updates shift the first steps'
    # bias correction a little (measured -1.5079 for all 50 weights).
    assert np.allclose(r["weights"], -LR * STEPS, atol=0.1)


@pytest.mark.parametrize("optimizer", ["keras3_adam", "keras3_rmsprop", "tf_keras_adagrad"])
def test_lazily_built_optimizer_on_one_worker_equals_one_process(optimizer):
    r = run_scenario("lazily_built_optimizer", shared=(1, 1), optimizer=optimizer,
                     num_workers=1, steps=STEPS, lr=LR)
    assert r["iterations"] == STEPS == r["ref_iterations"] == r["stats"]["applied"]
    np.testing.assert_allclose(r["weights"], r["ref_weights"], rtol=0, atol=1e-6)
    if optimizer == "keras3_adam":
        np.testing.assert_allclose(r["weights"], _adam_closed_form(), rtol=0, atol=1e-5)


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
