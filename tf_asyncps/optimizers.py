"""Locking optimizers and exact step counting under concurrent workers.

What ``use_locking`` does in TF2: for dense updates of resource variables
(``ResourceApplyGradientDescent``, ``ResourceApplyAdam``, ...) nothing —
resource variables are already locked exclusively for each op. It does not
make a step's several ops (the variable, each slot, the iteration counter) one
unit: between two of them another worker's step can run, so slot updates that
read then write (Adam's m and v) can interleave, and Keras 3's
``optimizer.iterations.assign_add`` (a read then a write) loses increments
(measured: docs/design.md#1-facts-measured-on-the-development-machine).

What :class:`LockingOptimizer` guarantees: every write of one worker step —
each variable, each slot, the iteration counter and the staleness counters —
happens as one unit with respect to other workers' steps, under a lock on the
first PS with a bounded wait. It does not make reads snapshots: the forward
pass still reads variables while other steps update them (``drop_stale`` with
``max_staleness=0`` is the policy that only applies gradients computed on the
current parameters). Cost: one lock acquisition per step and updates of
different steps run one at a time; measurements: docs/concepts/policies.md#locking.

Without locking, ``optimizer.iterations`` is still exact: tf_keras increments
it with one atomic ``assign_add``, and for Keras 3 optimizers the engine
replaces the read-then-write increment with an atomic one
(``tf_asyncps.compat.optimizers.make_iterations_atomic``).
"""

from tf_asyncps.compat import hooks as hooks_compat
from tf_asyncps.validate import check_number

__all__ = ["LockingOptimizer", "make_locking", "is_locking", "lock_timeout"]

_ATTR = "_asyncps_lock_timeout_s"


def _is_optimizer(obj) -> bool:
    return callable(getattr(obj, "apply_gradients", None))


def make_locking(optimizer, timeout_s: float = 60.0):
    """Marks ``optimizer`` so that each worker step's update is one locked unit.

    Works with tf_keras optimizers (``tf_keras.optimizers.*`` and
    ``tf_keras.optimizers.legacy.*``) and Keras 3 optimizers. Returns the same
    optimizer object, marked, so it goes anywhere an optimizer goes
    (``model.compile(optimizer=make_locking(SGD(0.1)))``); the lock is taken
    by AsyncParameterServerStrategy when a worker step applies gradients.
    Outside the strategy the optimizer behaves as before.
    ``LockingOptimizer(optimizer)`` is the same call, and
    ``isinstance(optimizer, LockingOptimizer)`` tells whether it was made.

    Args:
      optimizer: a tf_keras or Keras 3 optimizer instance.
      timeout_s: seconds steps may wait for the lock without anyone taking it
        before training fails with TimeoutError (float > 0).

    Returns:
      ``optimizer``, marked for locking (:func:`is_locking` is True).

    Raises:
      TypeError: not an optimizer instance. ValueError: timeout_s <= 0.
    """
    if not _is_optimizer(optimizer) or isinstance(optimizer, type):
        raise TypeError(
            f"LockingOptimizer needs an optimizer instance (e.g. tf_keras.optimizers.SGD(0.1)), "
            f"got {optimizer!r}.")
    check_number(timeout_s, "LockingOptimizer: timeout_s", above=0, hint="seconds")
    hooks_compat.set_untracked_attribute(optimizer, _ATTR, float(timeout_s))
    return optimizer


class _Marking(type):
    """``LockingOptimizer(opt)`` marks and returns ``opt`` (:func:`make_locking`);
    ``isinstance(opt, LockingOptimizer)`` is :func:`is_locking`."""

    def __call__(cls, optimizer, timeout_s: float = 60.0):
        return make_locking(optimizer, timeout_s)

    def __instancecheck__(cls, obj):
        return is_locking(obj)


class LockingOptimizer(metaclass=_Marking):
    """A tf_keras or Keras 3 optimizer whose worker-step update is one locked
    unit: ``LockingOptimizer(optimizer, timeout_s=60.0)`` is
    :func:`make_locking` (the same optimizer object, marked, so Keras sees its
    own class), and ``isinstance(optimizer, LockingOptimizer)`` holds for
    every optimizer so marked (or wrapping one, e.g. a ``LossScaleOptimizer``).

    Example::

        model.compile(optimizer=tf_asyncps.optimizers.LockingOptimizer(
            tf_keras.optimizers.Adam(1e-3)), loss="mse")
    """


def _marks(optimizer):
    """The lock marks of ``optimizer`` and of the optimizers it wraps.

    A wrapper such as tf_keras's ``LossScaleOptimizer`` is what the strategy
    sees; the mark may sit on it or on its ``inner_optimizer``.
    """
    for _ in range(8):  # wrappers nest a few levels at most
        if optimizer is None:
            return
        mark = hooks_compat.untracked_attribute(optimizer, _ATTR)
        if mark is not None:
            yield mark
        optimizer = getattr(optimizer, "inner_optimizer", None)


def is_locking(optimizer) -> bool:
    """Whether ``optimizer``, or an optimizer it wraps (``inner_optimizer``),
    was passed through :func:`make_locking` (``LockingOptimizer``)."""
    return next(_marks(optimizer), None) is not None


def lock_timeout(optimizer, default: float = 60.0) -> float:
    """The lock timeout of :func:`make_locking` (the outermost mark), else ``default``."""
    return next(_marks(optimizer), None) or default
