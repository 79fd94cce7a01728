"""One update per worker step (issue #26, item 2), in one process (fast tier).

τ, the global step and every policy's counts (sync_replicas' rounds, ssp's
clocks) take one update per worker step: a second optimizer update in one
step is refused with a message naming the fix, and a step that writes
trainable variables without passing through a hooked optimizer method (an
optimizer overriding ``apply_gradients``) is named in a warning.
"""

import pytest
import tensorflow as tf
import tf_keras

from local_engine import local_engine
from tf_asyncps import policies


def _index():
    return tf.constant(0, tf.int64)


@pytest.mark.parametrize("policy,args", [("async", {}),
                                         ("sync_replicas", {"timeout_s": 30})])
def test_a_second_update_in_one_worker_step_is_refused(policy, args):
    """Before: a GAN's two apply_gradients in one step counted two updates
    (sync_replicas: two gradients into its one round counter, shared by the
    two variable lists) for one worker step."""
    engine = local_engine(policy, **args)
    disc, gen = tf.Variable([1.0]), tf.Variable([2.0])
    d_opt, g_opt = tf_keras.optimizers.SGD(0.1), tf_keras.optimizers.Adam(0.1)

    def gan_step():
        d_opt.apply_gradients([(tf.constant([1.0]), disc)])
        g_opt.apply_gradients([(tf.constant([1.0]), gen)])
        return tf.constant(0.0)

    with pytest.raises(ValueError) as e:
        tf.function(engine.worker_step(gan_step, index=_index))()
    assert str(e.value) == (
        "A worker step called an optimizer update twice (SGD, then Adam: apply_gradients, "
        "or apply in Keras 3). Under AsyncParameterServerStrategy a worker step makes one "
        "update: τ, the global step and the update policy's counts (sync_replicas' rounds, "
        "ssp's clocks) take one update per step. Apply every gradient in one call (one "
        "optimizer over all the variables), or make each update its own step: one "
        "strategy.run per update in the scheduled function (e.g. a GAN's discriminator "
        "and generator steps).")
    engine.stop_watchdogs()


def test_two_updates_as_two_worker_steps_count_two_updates():
    """The way the message points to: each update its own worker step."""
    engine = local_engine("async")
    disc, gen = tf.Variable([1.0]), tf.Variable([2.0])
    d_opt, g_opt = tf_keras.optimizers.SGD(0.5), tf_keras.optimizers.SGD(0.25)
    d_step = engine.worker_step(
        lambda: d_opt.apply_gradients([(tf.constant([1.0]), disc)]), index=_index)
    g_step = engine.worker_step(
        lambda: g_opt.apply_gradients([(tf.constant([1.0]), gen)]), index=_index)

    @tf.function
    def scheduled():
        d_step()
        g_step()

    scheduled()
    s = engine.tracker.stats()
    assert (s.global_step, s.applied, s.dropped) == (2, 2, 0)
    assert disc.numpy().tolist() == [0.5] and gen.numpy().tolist() == [1.75]


class _OverridingSGD(tf_keras.optimizers.SGD):
    """An optimizer that applies its update itself, never calling the base
    class's (hooked) apply_gradients."""

    def apply_gradients(self, grads_and_vars, **kwargs):
        for g, v in grads_and_vars:
            v.assign_sub(self.learning_rate * g)
        return tf.constant(0, tf.int64)


def test_a_step_that_updates_weights_around_the_hooks_is_named(caplog):
    """Before: the update bypassed the policy and the counters silently."""
    engine = local_engine("async")
    kernel = tf.Variable([1.0], name="kernel")
    counter = tf.Variable(0.0, trainable=False, name="metric_total")
    engine.track_variable(kernel, trainable=True)
    engine.track_variable(counter, trainable=False)
    opt = _OverridingSGD(0.5)

    def train():
        counter.assign_add(1.0)  # a metric's update: not a weight
        return opt.apply_gradients([(tf.constant([1.0]), kernel)])

    def evaluate():
        counter.assign_add(1.0)
        return kernel.read_value()

    with caplog.at_level("WARNING"):
        tf.function(engine.worker_step(evaluate, index=_index))()
        assert [r.getMessage() for r in caplog.records if "hooked" in r.getMessage()] == []
        tf.function(engine.worker_step(train, index=_index))()
    said = [r.getMessage() for r in caplog.records if "hooked" in r.getMessage()]
    assert said == [
        "A worker step updated trainable variable(s) kernel:0 without a hooked optimizer "
        "method, so the update policy 'async', τ and the global step never saw it. An "
        "optimizer that overrides apply_gradients (Keras 3: apply) must call the base "
        "class's method for AsyncParameterServerStrategy to apply its update."]
    assert kernel.numpy().tolist() == [0.5]
    assert engine.tracker.stats().applied == 0


class _GradientIsTheReadValue(policies.UpdatePolicy):
    """A rule that needs read values and returns them as the gradients, so
    that the update shows exactly what w_read was."""

    name = "read_value_probe"
    needs_read_values = True

    def update(self, grads, state, info):
        self.seen = [r is not None for r in info.read_values]
        return [g * 0 + r for g, r in zip(grads, info.read_values)], True


def test_read_values_are_the_steps_own_variables_read_not_every_variable_copied():
    """Before: each step copied every trainable variable created under the
    scope (a second model's too) into a per-worker backup on the PS."""
    policy = _GradientIsTheReadValue()
    engine = local_engine(policy, num_workers=2)
    used, other = tf.Variable([3.0, -1.0]), tf.Variable(tf.ones([50, 4]))
    engine.track_variable(used, trainable=True)
    engine.track_variable(other, trainable=True)  # another model's weights
    opt = tf_keras.optimizers.SGD(0.5)
    step = tf.function(engine.worker_step(
        lambda: opt.apply_gradients([(tf.constant([10.0, 10.0]), used)]), index=_index))
    graph = step.get_concrete_function().graph
    captured = {id(external) for external, _ in graph.captures}
    assert id(other.handle) not in captured  # not read, not copied
    step()
    assert policy.seen == [True]
    # SGD on the read value: w - 0.5 * w_read, with w_read = w at the step's start.
    assert used.numpy().tolist() == [1.5, -0.5]
    assert other.numpy().tolist() == [[1.0] * 4] * 50
