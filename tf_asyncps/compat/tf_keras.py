"""Private tf_keras APIs used by tf_asyncps, in one place.

Tested with tf_keras 2.18.0, 2.19.0, 2.20.1 and 2.21.0 (``pyproject.toml`` asks
for ``tf_keras>=2.18,<2.22``, the one of TensorFlow's minor).
Importing this module imports nothing; each function imports tf_keras when
called.
"""

from typing import Optional

__all__ = ["TESTED_VERSIONS", "optimizer_classes", "checkpoint_saved_epoch",
           "evaluate_call",
           "pss_evaluation_shards", "build_now", "not_built"]

TESTED_VERSIONS = ("2.18.0", "2.19.0", "2.20.1", "2.21.0")


def checkpoint_saved_epoch(model) -> Optional[int]:
    """The epoch ``BackupAndRestore`` restored ``model`` to
    (``model._training_state._ckpt_saved_epoch``), or None."""
    state = getattr(model, "_training_state", None)
    saved = getattr(state, "_ckpt_saved_epoch", None)
    if saved is None:
        return None
    return int(saved.numpy())


class _FitResumePoint:
    """What tf_keras's ``Model.fit`` asks ``model._training_state`` after
    ``on_train_begin``: the (epoch, step in epoch) to start at."""

    def __init__(self, epoch: int, step: int):
        self.epoch, self.step = int(epoch), int(step)

    def maybe_load_initial_counters_from_ckpt(self, steps_per_epoch, initial_epoch, mode=None):
        del steps_per_epoch, initial_epoch, mode
        return self.epoch, self.step


def set_fit_resume_point(model, epoch: Optional[int], step: int = 0) -> None:
    """Makes tf_keras's ``Model.fit`` start at ``epoch``, ``step`` steps into
    it (None: clears it). tf_keras 2.18-2.21's ``fit`` reads
    ``model._training_state.maybe_load_initial_counters_from_ckpt`` right
    after ``on_train_begin`` (BackupAndRestore's mid-epoch resume hook, which
    that callback leaves unused under ParameterServerStrategy).

    Raises:
      ValueError: another callback (tf_keras ``BackupAndRestore``) holds it.
    """
    state = getattr(model, "_training_state", None)
    if state is not None and not isinstance(state, _FitResumePoint):
        raise ValueError("StepBackup and tf_keras BackupAndRestore both resume the fit: pass "
                         "one of them.")
    model._training_state = None if epoch is None else _FitResumePoint(epoch, step)


def keep_batch_logs_remote(callback) -> None:
    """Lets tf_keras's ``CallbackList`` pass a batch hook's logs as they are
    (RemoteValues under ParameterServerStrategy): it converts them to numpy,
    which waits for the closure, unless every callback with batch hooks sets
    ``_supports_tf_logs`` (tf_keras 2.18-2.21; ``Callback.__init__`` sets it False)."""
    callback._supports_tf_logs = True


def fit_resume_point_taken(model) -> bool:
    """False when another callback replaced the resume point set by
    :func:`set_fit_resume_point` (tf_keras ``BackupAndRestore`` after it)."""
    state = getattr(model, "_training_state", None)
    return state is None or isinstance(state, _FitResumePoint)


def compiling_model():
    """The tf_keras model whose ``compile`` is creating its
    ``_steps_per_execution`` variable on this thread (the ``self`` of
    ``Model._configure_steps_per_execution``, tf_keras 2.18-2.21, hooked:
    :mod:`tf_asyncps.compat.call_scopes`; compile has set ``model.optimizer``
    by then), else None. ``fit``/``evaluate`` read that variable on the
    coordinator before every closure (``DataHandler.steps`` and the scheduled
    call's argument) and never inside a step."""
    from tf_asyncps.compat import call_scopes
    return call_scopes.TF_KERAS_STEPS_PER_EXECUTION.get()


def evaluate_call():
    """``(model, x, steps)`` of the tf_keras ``Model.evaluate`` running on
    this thread (it creates its ClusterCoordinator before it builds any
    input), else None: ``self`` and the arguments ``x`` and ``steps`` of
    ``training.Model.evaluate`` (tf_keras 2.18-2.21, hooked:
    :mod:`tf_asyncps.compat.call_scopes`); ``fit``'s validation calls it too."""
    from tf_asyncps.compat import call_scopes
    return call_scopes.TF_KERAS_EVALUATE.get()


def pss_evaluation_shards(model):
    """tf_keras's ``compile(pss_evaluation_shards=...)`` value (0: none)."""
    return getattr(model, "_pss_evaluation_shards", 0)


def optimizer_classes() -> tuple:
    """tf_keras's optimizer base classes (``tf_keras.optimizers.Optimizer``,
    ``tf_keras.optimizers.legacy.Optimizer``); empty if tf_keras is missing."""
    try:
        import tf_keras
    except ImportError:  # pragma: no cover - tf_keras is a dependency
        return ()
    return (tf_keras.optimizers.Optimizer, tf_keras.optimizers.legacy.Optimizer)


def _with_inner(optimizer):
    """``(tf_keras or None if missing, the optimizer a LossScaleOptimizer
    wraps, else ``optimizer``)``."""
    try:
        import tf_keras
    except ImportError:  # pragma: no cover - tf_keras is a dependency
        return None, optimizer
    return tf_keras, getattr(optimizer, "inner_optimizer", optimizer)


def build_now(optimizer, variables) -> bool:
    """Creates a tf_keras optimizer's slots for ``variables`` now (eagerly),
    as its first ``apply_gradients`` with them would: ``build`` (new
    optimizers) or ``_create_all_weights`` (legacy, tf_keras 2.21.0). Used
    when restored slot values wait for their slots to exist.

    Args:
      optimizer: any optimizer (of a LossScaleOptimizer, its inner one).
      variables: the model variables (shards, as ``model.trainable_variables``
        gives) that the optimizer updates.

    Returns:
      True if a tf_keras optimizer was built here; False otherwise (already
      built, or not a tf_keras optimizer).
    """
    import tensorflow as tf
    tf_keras, optimizer = _with_inner(optimizer)
    if tf_keras is None:  # pragma: no cover - tf_keras is a dependency
        return False
    variables = list(variables)
    if isinstance(optimizer, tf_keras.optimizers.Optimizer):
        if getattr(optimizer, "_built", False):
            return False
        with tf.name_scope(optimizer.name or "optimizer"), tf.init_scope():
            optimizer.build(variables)
        return True
    if isinstance(optimizer, tf_keras.optimizers.legacy.Optimizer):
        with tf.name_scope(optimizer._name), tf.init_scope():
            optimizer._create_all_weights(variables)
        return True
    return False


def not_built(optimizer) -> bool:
    """Whether ``optimizer`` (of a LossScaleOptimizer, its inner one) has not
    made its slots yet: Keras 3's ``built``, tf_keras 2.21.0's ``_built``
    (new optimizers: absent until ``build`` sets it, so read as False);
    False for legacy ones, which make slots as needed."""
    optimizer = getattr(optimizer, "inner_optimizer", optimizer)
    if getattr(optimizer, "built", True) is False:
        return True
    import tf_keras
    if isinstance(optimizer, tf_keras.optimizers.legacy.Optimizer):
        return False
    return isinstance(optimizer, tf_keras.optimizers.Optimizer) and \
        not getattr(optimizer, "_built", False)
