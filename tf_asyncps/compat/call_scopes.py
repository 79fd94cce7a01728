"""Which Keras call is running on this thread, known by hooking the call.

The strategy's variable creator and its coordinator need to know whether
they run inside a given Keras method (a compile creating its loss tracker, a
tf_keras evaluate creating its coordinator). Each such method is wrapped
once, at the class (:func:`tf_asyncps.compat.hooks.hook_method`), so
that while it runs a ``contextvars.ContextVar`` holds its model; the previous
value comes back on return (the ContextVar's token), so calls nest. Nothing
reads the stack.

Hooked (tested with Keras 3.10.0, 3.12.4 and 3.15.1, tf_keras 2.18-2.21):

* Keras 3 ``Trainer.compile`` (``keras.src.trainers.trainer``): :data:`KERAS3_COMPILE`;
* tf_keras ``Model._configure_steps_per_execution`` (``compile`` creating the
  ``_steps_per_execution`` variable): :data:`TF_KERAS_STEPS_PER_EXECUTION`;
* tf_keras ``Model.evaluate`` (also ``fit``'s validation): :data:`TF_KERAS_EVALUATE`;
* an optimizer creating a slot variable: ``add_variable_from_reference`` of
  Keras 3's ``BaseOptimizer`` and TensorFlow backend ``TFOptimizer``, of
  tf_keras's ``optimizers.Optimizer`` (and its base), ``add_slot`` of
  tf_keras's legacy ``OptimizerV2``: :data:`CREATING_SLOT`;
* Keras 3 ``keras.Model.fit``/``evaluate``/``predict``, Keras 3's own loops
  (:func:`tf_asyncps.compat.keras_models.hook_loops`): :data:`KERAS3_LOOP`;
* tf_keras ``Model.fit``: :data:`TF_KERAS_FIT` (a :class:`FitCall` whose
  ``at_exit`` callables run when fit returns or raises);
* tf_keras ``data_adapter._ClusterCoordinatorDataHandler.sync`` (the join
  ``fit``/``evaluate`` make at each epoch's end): :data:`TF_KERAS_EPOCH_JOIN`;
* before a save, the callables registered with :func:`before_save`:
  ``tf.train.Checkpoint.write``/``save`` (also ``CheckpointManager``'s,
  tf_keras ``BackupAndRestore``'s and TF-format ``save_weights``' writes)
  and tf_keras ``Model.save``/``save_weights`` (every format).

A thread started inside such a call sees the defaults (Python 3.11 gives
a new thread a fresh context); the calls above create their variables and
coordinators on their own thread.
"""

import contextvars
import functools
import inspect
import threading
import weakref

__all__ = ["install", "KERAS3_COMPILE", "TF_KERAS_STEPS_PER_EXECUTION", "TF_KERAS_EVALUATE",
           "CREATING_SLOT", "KERAS3_LOOP", "TF_KERAS_FIT", "TF_KERAS_EPOCH_JOIN", "FitCall",
           "before_save"]

#: The Keras 3 model whose ``compile`` runs on this thread, or None.
KERAS3_COMPILE = contextvars.ContextVar("tf_asyncps.keras3_compile", default=None)
#: The tf_keras model whose compile creates its ``_steps_per_execution``, or None.
TF_KERAS_STEPS_PER_EXECUTION = contextvars.ContextVar("tf_asyncps.tf_keras_spe", default=None)
#: ``(model, x, steps)`` of the tf_keras ``evaluate`` running on this thread, or None.
TF_KERAS_EVALUATE = contextvars.ContextVar("tf_asyncps.tf_keras_evaluate", default=None)
#: The optimizer creating a slot variable on this thread, or None.
CREATING_SLOT = contextvars.ContextVar("tf_asyncps.creating_slot", default=None)
#: The Keras 3 model whose own fit/evaluate/predict runs on this thread, or None.
KERAS3_LOOP = contextvars.ContextVar("tf_asyncps.keras3_loop", default=None)

#: The :class:`FitCall` of the tf_keras ``fit`` running on this thread, or None.
TF_KERAS_FIT = contextvars.ContextVar("tf_asyncps.tf_keras_fit", default=None)
#: True while tf_keras's data handler joins at an epoch's end on this thread.
TF_KERAS_EPOCH_JOIN = contextvars.ContextVar("tf_asyncps.tf_keras_epoch_join", default=False)

_lock = threading.Lock()
_before_save = []  # weakref.WeakMethod of the callables before_save registered


def before_save(method) -> None:
    """Runs ``method`` (a bound method, held weakly; no arguments) before
    each save listed in the module's docstring, on the saving thread."""
    with _lock:
        _before_save.append(weakref.WeakMethod(method))


def _run_before_save() -> None:
    with _lock:
        _before_save[:] = [m for m in _before_save if m() is not None]
        methods = [m() for m in _before_save]
    for m in methods:
        if m is not None:
            m()


def _hook_before_save(cls, name) -> None:
    from tf_asyncps.compat import hooks as hooks_compat

    def make_hook(original):
        @functools.wraps(original)
        def hooked(self, *args, **kwargs):
            _run_before_save()
            return original(self, *args, **kwargs)
        return hooked
    hooks_compat.hook_method(cls, name, make_hook, key=f"{__name__}.before_save")


class FitCall:
    """One running tf_keras ``fit``: ``model`` and ``at_exit``, callables
    (no arguments) run once each, in order, when the fit returns or raises."""

    def __init__(self, model):
        self.model = model
        self.at_exit = []

    def run_at_exit(self, raising: bool) -> None:
        while self.at_exit:
            fn = self.at_exit.pop(0)
            try:
                fn()
            except Exception:  # pylint: disable=broad-except
                if not raising:
                    raise
                # fit's own error is the one to see.


def _hook_fit(cls) -> None:
    """Hooks ``cls.fit``: :data:`TF_KERAS_FIT` holds its :class:`FitCall`."""
    from tf_asyncps.compat import hooks as hooks_compat

    def make_hook(original):
        @functools.wraps(original)
        def hooked(self, *args, **kwargs):
            call = FitCall(self)
            token = TF_KERAS_FIT.set(call)
            raising = True
            try:
                out = original(self, *args, **kwargs)
                raising = False
                return out
            finally:
                try:
                    call.run_at_exit(raising)
                finally:
                    TF_KERAS_FIT.reset(token)
        return hooked
    hooks_compat.hook_method(cls, "fit", make_hook, key=f"{__name__}.{TF_KERAS_FIT.name}")


def _self(original):
    del original
    return lambda self, args, kwargs: self


def _evaluate_call(original):
    signature = inspect.signature(original)

    def value(self, args, kwargs):
        try:
            bound = signature.bind(self, *args, **kwargs)
        except TypeError:  # evaluate itself raises it, with its own message
            return None
        bound.apply_defaults()
        return self, bound.arguments.get("x"), bound.arguments.get("steps")
    return value


def _scope(cls, name, var, value_of) -> None:
    """Hooks ``cls.name`` (``hook_method``) so that the call runs with ``var``
    set to ``value_of(original)(self, args, kwargs)``, restored on return.
    The hook's key names ``var``: another hook on the same method (the slot
    tagging of :mod:`tf_asyncps.compat.sharded_slots`) wraps it, not
    replaces it."""
    from tf_asyncps.compat import hooks as hooks_compat

    def make_hook(original):
        value = value_of(original)

        @functools.wraps(original)
        def hooked(self, *args, **kwargs):
            token = var.set(value(self, args, kwargs))
            try:
                return original(self, *args, **kwargs)
            finally:
                var.reset(token)
        return hooked
    hooks_compat.hook_method(cls, name, make_hook, key=f"{__name__}.{var.name}")


def install() -> None:
    """Wraps the methods listed in the module's docstring (those of the
    installed libraries), once; idempotent."""
    with _lock:
        try:
            from keras.src.trainers import trainer as keras3_trainer
        except ImportError:  # pragma: no cover - no Keras 3
            keras3_trainer = None
        if keras3_trainer is not None:
            _scope(keras3_trainer.Trainer, "compile", KERAS3_COMPILE, _self)
            from keras.src.backend.tensorflow import optimizer as keras3_tf_optimizer
            from keras.src.optimizers import base_optimizer
            for cls in (base_optimizer.BaseOptimizer, keras3_tf_optimizer.TFOptimizer):
                _scope(cls, "add_variable_from_reference", CREATING_SLOT, _self)
        import tensorflow as tf
        for name in ("write", "save"):
            _hook_before_save(tf.train.Checkpoint, name)
        try:
            from tf_keras.src.engine import data_adapter as tf_keras_data_adapter
            from tf_keras.src.engine import training as tf_keras_training
            from tf_keras.src.optimizers import optimizer as tf_keras_optimizer
            from tf_keras.src.optimizers.legacy import optimizer_v2
        except ImportError:  # pragma: no cover - tf_keras is a dependency
            return
        for cls in (tf_keras_optimizer._BaseOptimizer, tf_keras_optimizer.Optimizer):
            _scope(cls, "add_variable_from_reference", CREATING_SLOT, _self)
        _scope(optimizer_v2.OptimizerV2, "add_slot", CREATING_SLOT, _self)
        _scope(tf_keras_training.Model, "_configure_steps_per_execution",
               TF_KERAS_STEPS_PER_EXECUTION, _self)
        _scope(tf_keras_training.Model, "evaluate", TF_KERAS_EVALUATE, _evaluate_call)
        _hook_fit(tf_keras_training.Model)
        _scope(tf_keras_data_adapter._ClusterCoordinatorDataHandler, "sync",
               TF_KERAS_EPOCH_JOIN, lambda original: lambda self, args, kwargs: True)
        for name in ("save", "save_weights"):
            _hook_before_save(tf_keras_training.Model, name)
