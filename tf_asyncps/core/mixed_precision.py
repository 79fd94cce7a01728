"""Mixed precision (tf_keras) under AsyncParameterServerStrategy.

With a ``mixed_float16``/``mixed_bfloat16`` policy, tf_keras layers compute in
16 bits but keep float32 variables (``AutoCastVariable``), so the gradients
that reach the update policy are float32 and every policy and the
``sync_replicas`` aggregator accumulate in float32 (the engine casts a
gradient to its variable's dtype if a caller hands it another one).

``mixed_float16`` needs loss scaling (tf_keras ``LossScaleOptimizer``):

* tf_keras refuses loss scaling, and ``mixed_float16`` layers, under any
  strategy missing from its allowlist (Mirrored, MultiWorkerMirrored,
  OneDevice), because gradients must be unscaled once per variable copy and
  strategies with several compute replicas per variable would unscale them
  once per replica. Here each replica unscales its own gradients once, and a
  worker step makes one update on the PS (with K > 1 GPUs per worker, the K
  replicas' unscaled gradients are summed into that one update, which checks
  and adjusts the loss scale once), so :func:`allow_loss_scaling` adds this
  strategy to the allowlist.
* The optimizer hook (``tf_asyncps/core/step.py``) acts on the
  ``LossScaleOptimizer``'s ``apply_gradients``: once per step, on unscaled
  float32 gradients. Its call to the inner optimizer passes straight through.
* A step with NaN/Inf gradients (the loss scale overflowed float16) is dropped
  and counted in ``StalenessStats.nonfinite``, and lowers the loss scale as
  ``LossScaleOptimizer`` would (:func:`update_loss_scale`); finite steps go
  through the ``LossScaleOptimizer`` itself, which counts them towards
  raising the scale. ``optimizer.iterations`` counts applied updates only.
"""

from typing import List, Optional

import tensorflow as tf

from tf_asyncps.compat import hooks as hooks_compat
from tf_asyncps.compat import mixed_precision as precision_compat
from tf_asyncps.compat import optimizers as optimizers_compat
from tf_asyncps.core import placement

__all__ = ["PRECISIONS", "resolve", "loss_scale_optimizer", "update_loss_scale",
           "allow_loss_scaling", "base_variable"]

#: Values of ``--mixed_precision``.
PRECISIONS = ("none", "mixed_float16", "mixed_bfloat16", "auto")


def resolve(name: str, worker_gpus: int) -> str:
    """The tf_keras policy name for ``--mixed_precision=name``.

    Args:
      name: one of :data:`PRECISIONS`.
      worker_gpus: GPUs per worker (0: CPU workers); "auto" picks
        ``mixed_float16`` on GPUs, else ``mixed_bfloat16``.

    Returns:
      "float32", "mixed_float16" or "mixed_bfloat16".

    Raises:
      ValueError: an unknown name (lists the choices).
    """
    if name not in PRECISIONS:
        raise ValueError(f"--mixed_precision={name!r} is unknown; choose one of "
                         f"{list(PRECISIONS)}.")
    if name == "none":
        return "float32"
    if name == "auto":
        return "mixed_float16" if worker_gpus > 0 else "mixed_bfloat16"
    return name


def loss_scale_optimizer(optimizer):
    """``optimizer`` if it is a LossScaleOptimizer (tf_keras's, either kind, or
    Keras 3's), else None."""
    classes = tuple(optimizers_compat.loss_scale_optimizer_classes() or ()) + tuple(
        c for c in [optimizers_compat.loss_scale_optimizer_class()] if c is not None)
    return optimizer if classes and isinstance(optimizer, classes) else None


def update_loss_scale(lso, grads) -> List[tf.Operation]:
    """Ops that update ``lso``'s dynamic loss scale for a skipped step.

    Non-finite ``grads`` lower the scale (and reset the growth counter); finite
    ones count one good step, as ``LossScaleOptimizer.apply_gradients`` does.
    Halving is a read then a write of the scale (``scale.assign(scale *
    0.5)``). For Keras 3 it runs in a ``tf.CriticalSection`` beside the scale,
    so that two workers' overflows halve it twice, not once (seen as 15
    overflows and 14 halvings with 2 workers). tf_keras's update is its own,
    distribution-aware code (a ``merge_call`` under K replicas, which a lock
    around it would deadlock): there a ``LockingOptimizer`` serialises it.

    Args:
      lso: a tf_keras or Keras 3 LossScaleOptimizer.
      grads: the step's unscaled gradients.

    Returns:
      A list of ops (empty for a fixed loss scale).
    """
    values = [g.values if isinstance(g, tf.IndexedSlices) else g for g in grads]
    k3 = optimizers_compat.loss_scale_optimizer_class()
    if k3 is None or not isinstance(lso, k3):
        return precision_compat.update_tf_keras_loss_scale(lso, values)

    def update():
        with tf.control_dependencies(precision_compat.update_keras3_loss_scale(lso, values)):
            return tf.constant(True)

    lock = _scale_lock(lso, precision_compat.loss_scale_variable(lso))
    return [lock.execute(update, exclusive_resource_access=False)]


def _scale_lock(lso, scale) -> tf.CriticalSection:
    """The CriticalSection serialising ``lso``'s scale updates, beside ``scale``."""
    lock = hooks_compat.untracked_attribute(lso, "_asyncps_scale_lock")
    if lock is None:
        with tf.init_scope(), tf.device(scale.device):
            lock = placement.critical_section("asyncps_loss_scale_lock")
        hooks_compat.set_untracked_attribute(lso, "_asyncps_scale_lock", lock)
    return lock


def base_variable(var):
    """The variable under a tf_keras ``AutoCastVariable`` (else ``var``)."""
    return precision_compat.autocast_inner_variable(var)


_allowed = False


def allow_loss_scaling(strategy_class: type) -> None:
    """Lets tf_keras loss scaling and ``mixed_float16`` run under ``strategy_class``.

    Idempotent. Extends tf_keras's ``strategy_supports_loss_scaling`` with
    AsyncParameterServerStrategy (passed in: this layer does not import the
    strategy), see the module docstring; other strategies get tf_keras's
    answer unchanged.
    """
    global _allowed
    if _allowed:
        return

    def under_this_strategy() -> bool:
        # Gradients are unscaled per replica and a worker step's K replicas
        # make one update (core/gpu_replicas.py): the loss scale is checked and
        # adjusted once per worker step.
        return tf.distribute.has_strategy() and isinstance(
            tf.distribute.get_strategy(), strategy_class)

    _allowed = precision_compat.extend_loss_scaling_allowlist(under_this_strategy)


LOCAL_COPIES_MESSAGE = (
    "local_sgd cannot use a dynamic LossScaleOptimizer (mixed_float16): each worker "
    "would train its own copy of the loss scale and the exchanges would add their "
    "changes up on the PS. Use --mixed_precision=mixed_bfloat16 (no loss scaling), a "
    "fixed loss scale (LossScaleOptimizer(opt, dynamic=False)), or another policy.")


def check_local_copies(policy, optimizer=None, precision: Optional[str] = None) -> None:
    """Raises ValueError if a policy that trains per-worker copies
    (``local_sgd``) meets dynamic loss scaling.

    Args:
      policy: the UpdatePolicy in use.
      optimizer: the optimizer being applied (checked for a dynamic
        LossScaleOptimizer), or None.
      precision: a resolved precision name ("mixed_float16" implies loss
        scaling in the CLI job), or None.
    """
    if not policy.local_copies:
        return
    lso = loss_scale_optimizer(optimizer) if optimizer is not None else None
    if precision == "mixed_float16" or (lso is not None and lso.dynamic):
        raise ValueError(LOCAL_COPIES_MESSAGE)

