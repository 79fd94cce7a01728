"""Keras 3 optimizers whose rule on an embedding table touches only a step's rows."""

import keras
import tensorflow as tf

from tf_asyncps.core import rowwise

__all__ = ["LazyAdam"]


@keras.saving.register_keras_serializable(package="tf_asyncps")
class LazyAdam(keras.optimizers.Adam):
    """Adam that updates only the rows of an embedding table a step touched.

    On a dense gradient it is Keras 3's ``Adam``. On a sparse
    (``tf.IndexedSlices``) gradient, for each distinct id ``r`` with
    ``S1 = sum of its rows`` and ``S2 = sum of their squares`` (Keras 3's
    ``Adam`` squares repeated rows one by one, as here), at step ``t``::

        m[r] = m[r] + (S1 - m[r]) * (1 - beta_1)
        v[r] = v[r] + (S2 - v[r]) * (1 - beta_2)
        w[r] -= lr * sqrt(1 - beta_2**t) / (1 - beta_1**t) * m[r] / (sqrt(v[r]) + epsilon)

    and the other rows of ``w``, ``m`` and ``v`` do not change.

    Difference from Keras 3's ``Adam``: there every row's moments decay at
    every step (``S1 = S2 = 0`` off the ids) and every row whose moment is
    not zero moves; on the touched rows both give the same values when the
    untouched rows' moments are zero. A step's cost then grows with the
    batch's distinct ids, not with the table. This is the "lazy" Adam of
    TensorFlow Addons' ``LazyAdam`` and TensorFlow 1's
    ``tf.contrib.opt.LazyAdamOptimizer`` (Kingma & Ba, 2015, restricted to
    the rows seen), with one difference: those sum a repeated id's rows
    before squaring (``v`` takes ``S1**2``), this one takes ``S2`` as Keras
    3's ``Adam`` does.

    Under :class:`~tf_asyncps.AsyncParameterServerStrategy` each distinct id
    crosses once, with ``S2`` for repeated ids only (tf_asyncps/core/rowwise.py).

    Args: as ``keras.optimizers.Adam``, except ``amsgrad``.

    Raises:
      ValueError: ``amsgrad=True`` (no lazy form here).
    """

    rowwise_rule = "lazy_adam"

    def __init__(self, *args, amsgrad=False, **kwargs):
        if amsgrad:
            raise ValueError("LazyAdam(amsgrad=True) is not supported: use "
                             "keras.optimizers.Adam(amsgrad=True) (dense).")
        super().__init__(*args, amsgrad=False, **kwargs)

    def update_step(self, gradient, variable, learning_rate):
        """Keras 3 ``Adam``'s update, on the touched rows only for a sparse gradient."""
        if not isinstance(gradient, tf.IndexedSlices):
            return super().update_step(gradient, variable, learning_rate)
        tf_var = getattr(variable, "value", variable) if not isinstance(
            variable, tf.Variable) else variable
        ids, s1, s2 = rowwise.distinct_sums(gradient)
        return rowwise.apply_rows(self, "lazy_adam", tf_var, ids, s1, s2, learning_rate)
