"""Keras 3.15.1 optimizer internals (TensorFlow backend; the same in
3.10-3.15): an optimizer's slot of one variable, and its ``update_step``
replaced while an update is traced.

Used by tf_asyncps/core/rowwise.py, which applies an embedding table's
update on the rows a step touched.
"""

import contextlib

__all__ = ["slot", "replacing_update_step"]

#: The optimizer attribute holding each slot list, by slot name.
_SLOT_LISTS = {"accumulator": "_accumulators", "momentum": "_momentums",
               "velocity": "_velocities"}


def slot(optimizer, name, variable):
    """The ``tf.Variable`` behind ``optimizer``'s slot ``name`` of ``variable``.

    Args:
      optimizer: a built Keras 3 Adagrad ("accumulator") or Adam ("momentum",
        "velocity").
      variable: the tf.Variable (or Keras variable) being updated.

    Raises:
      KeyError: an unknown slot name.
    """
    held = getattr(optimizer, _SLOT_LISTS[name])[optimizer._get_variable_index(variable)]
    return getattr(held, "value", held)


@contextlib.contextmanager
def replacing_update_step(optimizer, make):
    """While inside, ``optimizer.update_step`` is ``make(original)`` (on this
    instance; its class and other instances are untouched).

    Keras 3's TensorFlow backend calls ``self.update_step(gradient, variable,
    learning_rate)`` once per variable from ``apply`` (inside the
    strategy's ``extended.update``), the gradient as given after clipping
    and unscaling.
    """
    original = optimizer.update_step
    had_own = "update_step" in vars(optimizer)
    object.__setattr__(optimizer, "update_step", make(original))
    try:
        yield
    finally:
        if had_own:
            object.__setattr__(optimizer, "update_step", original)
        else:
            object.__delattr__(optimizer, "update_step")
