"""Mixed precision internals of both Kerases: a LossScaleOptimizer's dynamic
loss scale (its value and variable, and its update for a step the engine
skipped, as the optimizer's own ``apply`` would make it), tf_keras's
loss-scaling allowlist of strategies, and the variable under tf_keras's
``AutoCastVariable``. The LossScaleOptimizer classes themselves:
:mod:`tf_asyncps.compat.optimizers`.

* tf_keras 2.18.0, 2.19.0, 2.20.1 and 2.21.0
  (:data:`tf_asyncps.compat.tf_keras.TESTED_VERSIONS`): ``lso._loss_scale``,
  ``loss_scale_optimizer.strategy_supports_loss_scaling``,
  ``AutoCastVariable._variable``.
* Keras 3.10.0, 3.12.4 and 3.15.1
  (:data:`tf_asyncps.compat.versions.KERAS3_TESTED`): the ``_value`` of
  ``LossScaleOptimizer.dynamic_scale`` and ``step_counter``.

Importing this module imports nothing; functions import tf_keras, Keras and
TensorFlow when called.
"""

import functools
from typing import Callable, List

__all__ = ["update_tf_keras_loss_scale", "extend_loss_scaling_allowlist",
           "autocast_inner_variable", "loss_scale", "loss_scale_variable",
           "update_keras3_loss_scale"]


def update_tf_keras_loss_scale(lso, values) -> List:
    """Ops updating ``lso``'s dynamic loss scale (``lso._loss_scale.update``)
    from a skipped step's gradient tensors; empty for a fixed scale."""
    state = getattr(lso, "_loss_scale", None)
    if not callable(getattr(state, "update", None)):
        return []  # a fixed loss scale has nothing to update
    update_op, _ = state.update(values)
    return [update_op] if update_op is not None else []


def extend_loss_scaling_allowlist(allows: Callable[[], bool]) -> bool:
    """Makes tf_keras's ``strategy_supports_loss_scaling`` also answer True
    when ``allows()`` is True; other strategies get tf_keras's answer.

    tf_keras looks the function up on its module at each call (layers'
    policy check and LossScaleOptimizer's), so replacing it there suffices.

    Returns:
      False if tf_keras's module was not found.
    """
    try:
        from tf_keras.src.mixed_precision import loss_scale_optimizer as lso_lib
    except ImportError:  # pragma: no cover
        return False
    original = getattr(lso_lib.strategy_supports_loss_scaling, "_asyncps_original",
                       lso_lib.strategy_supports_loss_scaling)

    @functools.wraps(original)
    def strategy_supports_loss_scaling():
        return allows() or original()

    strategy_supports_loss_scaling._asyncps_original = original
    lso_lib.strategy_supports_loss_scaling = strategy_supports_loss_scaling
    return True


def autocast_inner_variable(var):
    """The float32 variable under a tf_keras ``AutoCastVariable`` (else ``var``)."""
    inner = getattr(var, "_variable", None)
    return inner if type(var).__name__ == "AutoCastVariable" and inner is not None else var


def loss_scale(lso):
    """A Keras 3 LossScaleOptimizer's current scale (float32 scalar tensor)."""
    import tensorflow as tf
    return tf.convert_to_tensor(lso.dynamic_scale)


def loss_scale_variable(lso):
    """The tf.Variable under a Keras 3 LossScaleOptimizer's ``dynamic_scale``."""
    return lso.dynamic_scale._value


def update_keras3_loss_scale(lso, values):
    """Ops that update a Keras 3 LossScaleOptimizer's scale for a step the
    engine skipped, as its own ``apply`` would: non-finite ``values`` halve
    the scale and reset the counter; finite ones count a good step (doubling
    the scale every ``dynamic_growth_steps``)."""
    import tensorflow as tf
    counter, scale = lso.step_counter._value, lso.dynamic_scale._value
    finite = tf.reduce_all([tf.reduce_all(tf.math.is_finite(v)) for v in values])

    def lower():
        return tf.group(counter.assign(tf.zeros_like(counter)), scale.assign(scale * 0.5))

    def good():
        grow = tf.equal(counter, lso.dynamic_growth_steps - 1)
        return tf.cond(grow, lambda: tf.group(counter.assign(tf.zeros_like(counter)),
                                              scale.assign(scale * 2.0)),
                       lambda: tf.group(counter.assign_add(tf.ones_like(counter))))

    return [tf.cond(finite, good, lower)]
