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

import functools
from typing import List, Optional

import tensorflow as tf

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


def _lso_classes():
    try:
        from tf_keras.src.mixed_precision import loss_scale_optimizer as lso_lib
    except ImportError:  # pragma: no cover - tf_keras is a dependency
        return ()
    return tuple(getattr(lso_lib, n) for n in ("LossScaleOptimizerV3", "LossScaleOptimizer")
                 if hasattr(lso_lib, n))


def loss_scale_optimizer(optimizer):
    """``optimizer`` if it is a tf_keras LossScaleOptimizer (either kind), else None."""
    classes = _lso_classes()
    return optimizer if classes and isinstance(optimizer, classes) else None


def update_loss_scale(lso, grads) -> List[tf.Operation]:
    """Ops that update ``lso``'s dynamic loss scale for a skipped step.

    Non-finite ``grads`` lower the scale (and reset the growth counter); finite
    ones count one good step, as ``LossScaleOptimizer.apply_gradients`` does.

    Args:
      lso: a tf_keras LossScaleOptimizer.
      grads: the step's unscaled gradients.

    Returns:
      A list of ops (empty for a fixed loss scale).
    """
    state = getattr(lso, "_loss_scale", None)
    if not callable(getattr(state, "update", None)):
        return []  # a fixed loss scale has nothing to update
    values = [g.values if isinstance(g, tf.IndexedSlices) else g for g in grads]
    update_op, _ = state.update(values)
    return [update_op] if update_op is not None else []


def base_variable(var):
    """The variable under a tf_keras ``AutoCastVariable`` (else ``var``)."""
    inner = getattr(var, "_variable", None)
    return inner if type(var).__name__ == "AutoCastVariable" and inner is not None else var


_allowed = False


def allow_loss_scaling() -> None:
    """Lets tf_keras loss scaling and ``mixed_float16`` run under this strategy.

    Idempotent. Extends tf_keras's ``strategy_supports_loss_scaling`` with
    AsyncParameterServerStrategy (see the module docstring); other strategies
    get tf_keras's answer unchanged.
    """
    global _allowed
    if _allowed:
        return
    try:
        from tf_keras.src.mixed_precision import loss_scale_optimizer as lso_lib
    except ImportError:  # pragma: no cover
        return
    original = lso_lib.strategy_supports_loss_scaling

    @functools.wraps(original)
    def strategy_supports_loss_scaling():
        from tf_asyncps.strategy import AsyncParameterServerStrategy
        if tf.distribute.has_strategy():
            strategy = tf.distribute.get_strategy()
            if isinstance(strategy, AsyncParameterServerStrategy):
                # Gradients are unscaled per replica and a worker step's K
                # replicas make one update (strategy._apply_replicated): the
                # loss scale is checked and adjusted once per worker step.
                return True
        return original()

    # tf_keras looks the function up on its module at each call (layers'
    # policy check and LossScaleOptimizer's), so replacing it there suffices.
    lso_lib.strategy_supports_loss_scaling = strategy_supports_loss_scaling
    _allowed = True


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
    if not getattr(policy, "local_copies", False):
        return
    lso = loss_scale_optimizer(optimizer) if optimizer is not None else None
    if precision == "mixed_float16" or (lso is not None and lso.dynamic):
        raise ValueError(LOCAL_COPIES_MESSAGE)

