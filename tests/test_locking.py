"""Locking optimizers and exact update accounting (case 002 and friends)."""

import pytest

from conftest import run_scenario
from tf_asyncps import optimizers

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize("keras_name", ["tf_keras", "keras3"])
@pytest.mark.parametrize("locking", [False, True], ids=["unlocked", "locked"])
@pytest.mark.cluster
def test_case_002_sgd_counter_and_weights_are_exact(keras_name, locking):
    r = run_scenario("case002", shared=(4, 1), keras_name=keras_name, optimizer="sgd",
                     locking=locking)
    assert r["iterations"] == 200 == r["stats"]["applied"] == r["stats"]["global_step"]
    assert r["w_min"] == r["w_max"] == -200.0  # one assign_sub per step, lr 1


@pytest.mark.parametrize("keras_name", ["tf_keras", "keras3"])
@pytest.mark.cluster
def test_case_002_adam_with_locking_equals_sequential_adam(keras_name):
    r = run_scenario("case002", shared=(4, 1), keras_name=keras_name, optimizer="adam",
                     locking=True)
    assert r["iterations"] == 200 == r["stats"]["applied"]
    assert r["max_abs_diff"] < 1e-5
    assert r["ref"] < -0.1  # Adam really moved w


@pytest.mark.parametrize("keras_name", ["tf_keras", "keras3"])
@pytest.mark.cluster
def test_case_002_adam_unlocked_counter_is_exact(keras_name):
    r = run_scenario("case002", shared=(4, 1), keras_name=keras_name, optimizer="adam",
                     locking=False)
    assert r["iterations"] == 200 == r["stats"]["applied"] == r["stats"]["global_step"]


@pytest.mark.cluster
def test_legacy_tf_keras_optimizer_with_locking():
    r = run_scenario("case002", shared=(4, 1), keras_name="tf_keras", optimizer="legacy_adam",
                     locking=True)
    assert r["iterations"] == 200 and r["max_abs_diff"] < 1e-5


@pytest.mark.cluster
def test_read_modify_write_with_locking_is_the_sequential_recurrence():
    r = run_scenario("read_modify_write", shared=(4, 1), locking=True, num_workers=4, steps=20)
    # w_n = 0.5 w_{n-1} + 1, w_0 = 0  ->  w_20 = 2 (1 - 2^-20), exact in float32
    assert r["w"] == 2 * (1 - 0.5 ** 20)
    assert r["iterations"] == 20 == r["stats"]["applied"]


@pytest.mark.cluster
def test_read_modify_write_without_locking_keeps_only_the_guarantees():
    """Unlocked read-modify-write updates may be lost (w = 2(1 - 2^-k), k <= 20);
    what is guaranteed: the counters are exact and w never passes the locked value."""
    r = run_scenario("read_modify_write", shared=(4, 1), locking=False, num_workers=4, steps=20)
    assert r["iterations"] == 20 == r["stats"]["applied"] == r["stats"]["global_step"]
    assert 1.0 <= r["w"] <= 2 * (1 - 0.5 ** 20)


@pytest.mark.cluster
def test_a_killed_worker_does_not_block_the_lock():
    r = run_scenario("locking_worker_killed", num_workers=3, epochs=4, steps_per_epoch=50,
                     kill_after=60)
    assert r["killed"]
    s = r["stats"]
    # TensorFlow may run the killed worker's in-flight closure again (at-least-once).
    assert 200 <= s["applied"] <= 201
    assert r["iterations"] == s["applied"] == s["global_step"]
    assert r["weights_finite"]


@pytest.mark.cluster
def test_lock_wait_times_out_with_a_clear_error():
    r = run_scenario("lock_timeout", timeout_s=2.0)
    assert r["error"] == "TimeoutError"
    assert "update lock" in r["message"] and "timeout_s" in r["message"]
    assert r["seconds"] < 30
    assert r["w"] == pytest.approx(0.8)  # only the first step was applied


def test_locking_optimizer_arguments():
    import tf_keras
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
    import tf_keras
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
