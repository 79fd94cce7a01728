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
  (:func:`tf_asyncps.compat.keras_models.hook_loops`): :data:`KERAS3_LOOP`.

A thread started inside such a call sees the defaults (Python 3.11 gives
a new thread a fresh context); the calls above create their variables and
coordinators on their own thread.
"""

import contextvars
import functools
import inspect
import threading

__all__ = ["install", "KERAS3_COMPILE", "TF_KERAS_STEPS_PER_EXECUTION", "TF_KERAS_EVALUATE",
           "CREATING_SLOT", "KERAS3_LOOP"]

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

_lock = threading.Lock()


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
        try:
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
