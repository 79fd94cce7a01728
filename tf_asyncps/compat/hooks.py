"""What tf_asyncps adds to TensorFlow and Keras objects: a library class's
method replaced once per hook (:func:`hook_method`, how the ``compat``
modules hook a class) and instance attributes that the object's own
tracking does not see.

Tested with TensorFlow 2.21.0, tf_keras 2.21.0 and Keras 3.15.1 (the tracking
that :func:`set_untracked_attribute` steps around); :func:`hook_method` uses
no private API. Importing this module imports nothing.
"""

from typing import Optional

__all__ = ["hook_method", "runs_hook", "set_untracked_attribute", "untracked_attribute"]


def hook_method(cls, name: str, make_hook, key: Optional[str] = None) -> bool:
    """Replaces method ``name`` of class ``cls`` by ``make_hook(original)``,
    once per hook: a method that already runs this hook (on ``cls`` or on
    the base class it inherits it from) is left as it is (idempotent); a
    method replaced by another hook is wrapped again, so both run (the last
    one outermost).

    Used on tf_keras's and Keras 3's optimizer classes
    (:func:`tf_asyncps.compat.optimizers.hook_apply_gradients`,
    :func:`tf_asyncps.compat.optimizers.hook_apply`) and on Keras' calls
    (:mod:`tf_asyncps.compat.call_scopes`). The replacement keeps the
    original as ``_asyncps_original`` and its key as ``_asyncps_hook``.

    Args:
      cls: the class.
      name: the method's name.
      make_hook: ``original -> replacement``.
      key: what makes two hooks the same; defaults to ``make_hook``'s module
        and qualified name. A factory that makes several hooks (one
        ``make_hook`` code for different values) passes its own.

    Returns:
      True if the method was replaced by this call.
    """
    if key is None:
        key = f"{make_hook.__module__}.{make_hook.__qualname__}"
    original = getattr(cls, name)
    if runs_hook(original, key):
        return False
    hooked = make_hook(original)
    hooked._asyncps_original = original
    hooked._asyncps_hook = key
    setattr(cls, name, hooked)
    return True


def runs_hook(method, key: str) -> bool:
    """Whether ``method`` (a class's attribute) is, or wraps, the
    :func:`hook_method` replacement whose key is ``key``."""
    f = method
    while f is not None:
        if getattr(f, "_asyncps_hook", None) == key:
            return True
        f = getattr(f, "_asyncps_original", None)
    return False


def set_untracked_attribute(obj, name: str, value) -> None:
    """Sets an instance attribute that the object's own ``__setattr__`` does
    not see: tf_keras layers and optimizers (``tf.Module``'s AutoTrackable)
    and Keras 3 layers, models and optimizers track what is assigned to them
    (as checkpoint dependencies, sub-layers, variables); a value tf_asyncps
    keeps on such an object (a lock, a bound method, a mark) must not become
    model state. Tested with TensorFlow 2.21.0, tf_keras 2.21.0, Keras 3.15.1.
    """
    object.__setattr__(obj, name, value)


def untracked_attribute(obj, name: str, default=None):
    """The instance attribute ``name`` set by :func:`set_untracked_attribute`
    on ``obj`` itself (never one of its class), else ``default``."""
    return getattr(obj, "__dict__", {}).get(name, default)
