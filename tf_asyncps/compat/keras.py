"""Keras 3 internals used by tf_asyncps, in one place.

Tested with Keras 3.15.1 (what TensorFlow 2.21 installs). Importing this
module imports nothing; functions import Keras when called.
"""

import sys

__all__ = ["TESTED_VERSIONS", "called_from_keras3", "backing_variable",
           "make_iterations_atomic", "optimizer_class"]

TESTED_VERSIONS = ("3.15.1",)


def called_from_keras3(depth: int = 2, frames: int = 6) -> bool:
    """Whether one of the ``frames`` callers above ``depth`` is Keras 3's own
    code (a module under ``keras.src``), e.g. its ``fit`` distributing a dataset."""
    f = sys._getframe(depth)
    for _ in range(frames):
        if f is None:
            return False
        if f.f_globals.get("__name__", "").startswith("keras.src."):
            return True
        f = f.f_back
    return False


def backing_variable(var):
    """The tf.Variable behind a Keras 3 ``Variable`` (its ``value``), else ``var``."""
    inner = getattr(var, "value", None)
    return inner if getattr(inner, "device", None) else var


def make_iterations_atomic(optimizer) -> None:
    """Makes a Keras 3 optimizer's iteration counter increment atomically.

    Keras 3's ``Variable.assign_add`` is ``assign(self + value)``: a read then
    a write, which loses increments when workers update at once (measured
    133/200 with 2 workers). This swaps in the backing tf.Variable's atomic
    ``assign_add`` for this one counter (``optimizer._iterations._value``).
    tf_keras counters are already atomic; other objects are left alone.
    """
    counter = getattr(optimizer, "_iterations", None)
    backing = getattr(counter, "_value", None)
    if counter is None or backing is None or getattr(counter, "_asyncps_atomic", False):
        return
    if not callable(getattr(backing, "assign_add", None)):
        return
    import tensorflow as tf

    def assign_add(value):
        return backing.assign_add(tf.cast(value, backing.dtype))

    counter.assign_add = assign_add
    counter._asyncps_atomic = True


def optimizer_class():
    """``keras.optimizers.Optimizer`` when Keras 3 is installed, else None."""
    try:
        import keras
    except ImportError:  # pragma: no cover
        return None
    return keras.optimizers.Optimizer if keras.__version__.startswith("3") else None
