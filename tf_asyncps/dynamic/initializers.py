"""Fresh values for a dynamic table's rows reset at run time.

An eviction pass (and a restore) gives the rows it frees new initializer
values, in plain TensorFlow ops on the ps, for a number of rows known only
when the pass runs: ``fn(shape)`` with ``shape = [k, output_dim]`` a tensor.
Keras's initializers want a static shape (their fans: ``len(shape)``), so
the elementwise ones are drawn here from their own parameters, with the fans
of the **whole table**, ``[capacity, output_dim]`` (``fan_in = capacity``,
``fan_out = output_dim``: what Keras used for the table's first values,
also when the table is split over ps tasks). Each element of a reset row is
then drawn from the distribution Keras drew the table's first values from:

================================  ==================================================
initializer (tf_keras, Keras 3)    each element of a reset row
================================  ==================================================
``zeros``, ``ones``, ``Constant``  that value
``RandomUniform``                  uniform on ``[minval, maxval)``
``RandomNormal``                   normal, ``mean``, ``stddev``
``TruncatedNormal``                normal, ``mean``, ``stddev``, redrawn beyond 2 stddev
``VarianceScaling`` and its        ``n``: ``fan_in``, ``fan_out`` or their mean (``mode``);
names (``glorot_*``, ``he_*``,     ``"uniform"``: on ``±sqrt(3 scale / n)``;
``lecun_*``)                       ``"truncated_normal"``: std ``sqrt(scale / n)``
                                   (drawn at ``sqrt(scale / n) / 0.8796`` and cut at 2 of
                                   those); ``"untruncated_normal"``: std ``sqrt(scale / n)``
================================  ==================================================

(``he_normal`` on a ``capacity x 32`` table: std ``sqrt(2 / capacity)``;
``glorot_uniform``: on ``±sqrt(6 / (capacity + 32))``.) Each pass draws new
values (TensorFlow's stateful random ops; Keras 3's initializers made with a
fixed seed would give the same values at every pass).

Any other initializer (a callable ``f(shape, dtype)``, a custom Keras
initializer) is called with the run-time shape, and is checked for that when
the layer is made: ``Orthogonal`` and ``Identity`` (a row's value depends on
the other rows) are refused there, naming the ones that work.
"""

import math

import numpy as np
import tensorflow as tf

__all__ = ["row_sampler", "SUPPORTED"]

#: What the layer's ``initializer`` may be without a probe (documented above).
SUPPORTED = ("zeros", "ones", "Constant", "uniform", "normal", "truncated_normal",
             "glorot_uniform", "glorot_normal", "he_uniform", "he_normal", "lecun_uniform",
             "lecun_normal", "VarianceScaling")

# tf_keras's and Keras 3's VarianceScaling draw a truncated normal at this
# stddev times the target one (the std of N(0, 1) cut at +-2).
_TRUNCATED_STD = .87962566103423978


def _base(initializer, name):
    """The class named ``name`` in ``initializer``'s MRO if the object draws
    with that class's own ``__call__`` (a subclass overriding it: None)."""
    for cls in type(initializer).__mro__:
        if cls.__name__ == name:
            return cls if type(initializer).__call__ is cls.__call__ else None
    return None


def _fan(mode, capacity, output_dim):
    if mode == "fan_in":
        return max(1.0, float(capacity))
    if mode == "fan_out":
        return max(1.0, float(output_dim))
    return max(1.0, (capacity + output_dim) / 2.0)  # "fan_avg"


def _known(initializer, capacity, output_dim):
    """``fn(shape)`` for Keras's elementwise initializers (both Kerases), else None."""
    if _base(initializer, "Zeros"):
        return lambda shape: tf.zeros(shape, tf.float32)
    if _base(initializer, "Ones"):
        return lambda shape: tf.ones(shape, tf.float32)
    if _base(initializer, "Constant") and np.size(getattr(initializer, "value", None)) == 1:
        value = float(np.reshape(initializer.value, []))
        return lambda shape: tf.fill(shape, value)
    if _base(initializer, "VarianceScaling"):
        scale = float(initializer.scale) / _fan(initializer.mode, capacity, output_dim)
        if initializer.distribution == "uniform":
            limit = math.sqrt(3.0 * scale)
            return lambda shape: tf.random.uniform(shape, -limit, limit)
        if initializer.distribution == "untruncated_normal":
            return lambda shape: tf.random.normal(shape, stddev=math.sqrt(scale))
        stddev = math.sqrt(scale) / _TRUNCATED_STD  # "truncated_normal" ("normal")
        return lambda shape: tf.random.truncated_normal(shape, stddev=stddev)
    if _base(initializer, "TruncatedNormal"):
        mean, stddev = float(initializer.mean), float(initializer.stddev)
        return lambda shape: tf.random.truncated_normal(shape, mean, stddev)
    if _base(initializer, "RandomNormal"):
        mean, stddev = float(initializer.mean), float(initializer.stddev)
        return lambda shape: tf.random.normal(shape, mean, stddev)
    if _base(initializer, "RandomUniform"):
        low, high = float(initializer.minval), float(initializer.maxval)
        return lambda shape: tf.random.uniform(shape, low, high)
    return None


def row_sampler(initializer, capacity: int, output_dim: int, name=None):
    """``fn(shape) -> float32 tensor``: fresh values for ``shape[0]`` reset
    rows of a ``[capacity, output_dim]`` table (the module docstring's table).

    Args:
      initializer: the layer's initializer object (``keras.initializers.get``
        of the argument), or a callable ``f(shape, dtype)``.
      capacity: the table's rows (the fans' ``fan_in``).
      output_dim: the table's width (``fan_out``).
      name: the argument as the user gave it, for the error.

    Returns:
      The function (plain TensorFlow ops; ``shape`` may be a tensor).

    Raises:
      ValueError: the initializer cannot draw rows for a shape known only at
        run time (``Orthogonal``, ``Identity``, or a custom one that needs a
        static shape), naming the ones that work.
    """
    known = _known(initializer, capacity, output_dim)
    if known is not None:
        return known

    def draw(shape):
        return tf.cast(initializer(shape, "float32"), tf.float32)

    # Evicted rows are drawn for a row count known when the pass runs: the
    # initializer must take a run-time shape. Tried now, in a traced function.
    probe = tf.function(lambda k: draw(tf.stack([k, output_dim])), autograph=False)
    try:
        probe.get_concrete_function(tf.TensorSpec([], tf.int32))
    except Exception as e:  # what an initializer raises on a tensor shape varies
        given = name if isinstance(name, str) else type(initializer).__name__
        raise ValueError(
            f"DynamicEmbedding(initializer={given!r}): evicted rows get fresh values "
            f"from the initializer for a number of rows known only when a pass runs, "
            f"and {given} cannot draw rows alone ({type(e).__name__}: "
            f"{str(e).splitlines()[0][:120]}). Use one of {', '.join(SUPPORTED)} "
            f"(any of their Keras objects, e.g. keras.initializers.HeNormal()), or a "
            f"callable f(shape, dtype) that takes a shape tensor.") from None
    return draw
