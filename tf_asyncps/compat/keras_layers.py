"""What this package's layers need of Keras 3's internals and of the stack.

Tested with Keras 3.15.1 and tf_keras 2.21.0 (TensorFlow 2.21.0). Importing
this module imports no Keras.

* :func:`outside_stateless_scope`: a weight made at once under Keras 3's
  symbolic build (``global_state``'s "stateless_scope");
* :func:`in_train_step`: whether a Keras 3 ``train_step`` runs on this thread
  (frames);
* :func:`caller`, :func:`model_being_made`, :func:`bound_values`: the frames
  ``tf_asyncps.layers.keras_choice`` reads to pick a layer's Keras.
"""

import contextlib
import sys

__all__ = ["outside_stateless_scope", "in_train_step", "caller", "model_being_made",
           "bound_values"]


@contextlib.contextmanager
def outside_stateless_scope():
    """Variables made inside are made at once, with their values, even under
    a ``StatelessScope`` (Keras 3's symbolic build: ``model(keras.Input(...))``,
    ``compute_output_spec``), which would defer them (their value None until
    the scope ends). For layers whose build hands its weight's
    ``tf.Variable`` to TensorFlow objects (a ``DynamicEmbedding``'s table)."""
    from keras.src.backend.common import global_state
    scope = global_state.get_global_attribute("stateless_scope")
    global_state.set_global_attribute("stateless_scope", None)
    try:
        yield
    finally:
        global_state.set_global_attribute("stateless_scope", scope)


def in_train_step(frames: int = 200) -> bool:
    """Whether this thread runs (traces) a Keras 3 model's ``train_step``:
    Keras 3's own (``fit``), a model's override, or this package's
    (``compat.keras_models.train_step_on``). Keras 3's ``train_step`` calls
    ``model(x)`` without ``training`` when the model's ``call`` takes no
    ``training`` argument, and then no layer call gets ``training=True`` (its
    call context holds None)."""
    if "keras.src.models.model" not in sys.modules:
        return False
    from tf_asyncps.compat.keras_models import is_keras3_model
    f = sys._getframe(1)
    for _ in range(frames):
        if f is None:
            return False
        # (tf__train_step: as autograph converts it, e.g. under ClusterCoordinator.)
        if f.f_code.co_name in ("train_step", "tf__train_step"):
            module = f.f_globals.get("__name__", "")
            if (module.startswith(("keras.src.", "tf_asyncps."))
                    or is_keras3_model(f.f_locals.get("self"))
                    or is_keras3_model(f.f_locals.get("model"))):
                return True
        f = f.f_back
    return False


def caller(depth: int = 1):
    """The frame ``depth`` levels above the function that calls this (1: its caller)."""
    return sys._getframe(depth + 1)


def model_being_made(frame, which, frames: int = 60):
    """``which(obj)`` of the first ``self`` of an ``__init__`` on the stack
    from ``frame`` up for which it is not None (a subclassed model or layer
    being made), else None."""
    f = frame
    for _ in range(frames):
        if f is None:
            return None
        if f.f_code.co_name == "__init__":
            found = which(f.f_locals.get("self"))
            if found is not None:
                return found
        f = f.f_back
    return None


def bound_values(frame) -> list:
    """The values bound in ``frame``'s locals and its module's globals."""
    return list(frame.f_locals.values()) + list(frame.f_globals.values())
