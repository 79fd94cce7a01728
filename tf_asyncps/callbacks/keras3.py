"""Which callbacks Keras 3 ``fit`` runs on parameter servers, and its console.

Steps run as closures on the workers, so there is no batch on the chief to
call a batch-level hook for: as tf_keras does under ParameterServerStrategy,
a callback that needs batch hooks is refused before training starts. Keras'
own callbacks are accepted in their epoch-level configuration
(``ModelCheckpoint``/``BackupAndRestore`` with ``save_freq="epoch"``,
``TensorBoard`` with ``update_freq="epoch"`` and ``profile_batch=0``).
"""

import sys
import time

import keras

from tf_asyncps.callbacks.common import format_value
from tf_asyncps.compat import keras_models as models_compat

__all__ = ["BATCH_HOOKS", "check_callbacks", "EpochLine"]

BATCH_HOOKS = ("on_batch_begin", "on_batch_end", "on_train_batch_begin", "on_train_batch_end",
               "on_test_batch_begin", "on_test_batch_end", "on_predict_batch_begin",
               "on_predict_batch_end")


def _epoch_level_builtin(cb):
    """None if ``cb`` is a Keras built-in configured for epoch-level work,
    else the reason it is not; NotImplemented if it is no such built-in."""
    c = keras.callbacks
    if isinstance(cb, (c.ModelCheckpoint, c.BackupAndRestore)):
        if cb.save_freq not in ("epoch", False):
            return f"save_freq={cb.save_freq!r} saves every N batches; use save_freq='epoch'"
        return None
    if isinstance(cb, c.TensorBoard):
        if cb.update_freq != "epoch":
            return (f"update_freq={cb.update_freq!r} ('batch' is 1) writes every N batches; "
                    f"use update_freq='epoch'")
        if models_compat.tensorboard_profiles(cb):
            return "profile_batch profiles batches; use profile_batch=0"
        return None
    if isinstance(cb, (c.ProgbarLogger,)):
        return "it draws a per-batch bar; pass verbose=1 for this strategy's progress line"
    if isinstance(cb, (c.History, c.EarlyStopping, c.CSVLogger, c.ReduceLROnPlateau,
                       c.TerminateOnNaN, c.LearningRateScheduler, c.RemoteMonitor)):
        # TerminateOnNaN and RemoteMonitor are batch-level in Keras 3.
        if isinstance(cb, (c.TerminateOnNaN, c.RemoteMonitor)):
            return "it acts on each batch's logs"
        return None
    return NotImplemented


def _user_batch_hooks(cb):
    """Batch hooks that ``cb`` defines itself: on the instance (e.g.
    ``LambdaCallback(on_train_batch_end=...)``) or in a class of its own,
    not inherited from Keras' (or tf_keras's) callbacks."""
    out = []
    for name in BATCH_HOOKS:
        if callable(vars(cb).get(name)):
            out.append(name)
            continue
        for klass in type(cb).__mro__:
            if name in vars(klass):
                if not klass.__module__.startswith(("keras.", "tf_keras.")):
                    out.append(name)
                break
    return out


def check_callbacks(callbacks):
    """Returns ``callbacks`` as a list; refuses batch-level ones at once.

    Raises:
      ValueError: a callback needs batch hooks (names it, the hooks and the fix).
      TypeError: ``callbacks`` is not a list of callbacks.
    """
    if callbacks is None:
        return []
    if not isinstance(callbacks, (list, tuple)):
        raise TypeError(f"callbacks must be a list of keras.callbacks.Callback, got "
                        f"{type(callbacks).__name__}.")
    for cb in callbacks:
        if not callable(getattr(cb, "set_model", None)):
            raise TypeError(f"callbacks[...] must be keras.callbacks.Callback objects, "
                            f"got {cb!r}.")
        if type(cb).__name__ == "DynamicEviction":  # tf_asyncps.callbacks.dynamic
            raise ValueError(
                "DynamicEviction runs DynamicEmbedding eviction passes in a fit without the "
                "strategy; under AsyncParameterServerStrategy its ps tasks run them after "
                "the updates: remove the callback.")
        if getattr(cb, "runs_between_closures", False):  # StepBackup: fit calls it itself
            continue
        hooks = _user_batch_hooks(cb)
        why = f"it defines {', '.join(hooks)}" if hooks else _epoch_level_builtin(cb)
        if why is NotImplemented:
            why = None
        if why is not None:
            raise ValueError(
                f"Batch-level callbacks are not supported with parameter-server training "
                f"(AsyncParameterServerStrategy, as in tf_keras's ParameterServerStrategy): "
                f"{type(cb).__name__}: {why}. Worker steps run as closures on the workers, "
                f"so the chief has no batch to report; move the work to on_epoch_end "
                f"(or poll strategy.staleness_stats() from a thread).")
    return list(callbacks)


class EpochLine(keras.callbacks.Callback):
    """One console line per epoch (``verbose`` 1 or 2):
    ``Epoch 2/5: loss=0.4121 accuracy=0.8900 val_loss=... (1.9 s, 212.4 steps/s)``.

    Args:
      epochs: epochs of the fit (int).
      steps_per_epoch: worker steps per epoch (int), for steps/s.
      stream: where lines go (default sys.stdout).
    """

    def __init__(self, epochs, steps_per_epoch, stream=None):
        super().__init__()
        self.epochs, self.steps_per_epoch, self.stream = epochs, steps_per_epoch, stream
        self._t0 = time.perf_counter()

    def on_epoch_begin(self, epoch, logs=None):
        self._t0 = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        dt = max(time.perf_counter() - self._t0, 1e-9)
        metrics = " ".join(f"{k}={format_value(v)}" for k, v in (logs or {}).items())
        out = self.stream or sys.stdout
        out.write(f"Epoch {epoch + 1}/{self.epochs}: {metrics} ({dt:.1f} s, "
                  f"{self.steps_per_epoch / dt:.1f} steps/s)\n")
        out.flush()
