"""Optimizer internals across tf_keras and Keras 3: the update hooks, an
optimizer's slots and ``update_step``, its counter, its strategy, and the
optimizers whose sparse updates touch every row.

* tf_keras 2.18.0-2.21.0: its LossScaleOptimizer classes; ``apply_gradients``
  of the optimizer base classes and LossScaleOptimizers hooked;
  ``Optimizer._distribution_strategy``; ``SGD``'s dense momentum on sparse
  gradients; ``Adagrad``'s update rule (a sparse update writes only its
  rows, a dense zero gradient changes nothing).
* tf_keras 2.21.0: ``SGD.update_step`` hooked (one op per variable at
  momentum 0: :func:`hook_sgd_update_step`).
* Keras 3.10.0-3.15.1: its ``Optimizer`` and ``LossScaleOptimizer`` classes;
  ``Optimizer.apply`` and ``LossScaleOptimizer.apply`` hooked; the iteration
  counter's ``assign_add`` made atomic; which update rules are dense tensor
  math.
* Keras 3.15.1 optimizer internals (TensorFlow backend; the same in
  3.10-3.15): an optimizer's slot of one variable, and its ``update_step``
  replaced while an update is traced (tf_asyncps/core/rowwise.py, which
  applies an embedding table's update on the rows a step touched).

* Keras 3.15.1 and tf_keras 2.21.0: whether an optimizer is creating a
  slot variable on this thread (hooked: :mod:`tf_asyncps.compat.call_scopes`).

Importing this module imports nothing; functions import tf_keras or Keras
when called.
"""

import contextlib

__all__ = ["slot", "replacing_update_step", "hook_apply_gradients", "hook_apply",
           "hook_sgd_update_step", "sgd_updates_in_one_op",
           "make_iterations_atomic", "deduplicating_only", "optimizer_strategy", "dense_on_sparse_gradients",
           "sparse_update_is_rowwise", "update_is_noop_at_zero",
           "optimizer_class", "loss_scale_optimizer_class", "loss_scale_optimizer_classes",
           "creating_optimizer_slot"]

#: The optimizer attribute holding each slot list, by slot name.
_SLOT_LISTS = {"accumulator": "_accumulators", "momentum": "_momentums",
               "velocity": "_velocities"}


def slot(optimizer, name, variable):
    """The ``tf.Variable`` behind ``optimizer``'s slot ``name`` of ``variable``.

    Args:
      optimizer: a built Keras 3 or tf_keras (2.18-2.21, not legacy) Adagrad
        ("accumulator") or Adam ("momentum", "velocity").
      variable: the tf.Variable (or Keras variable) being updated.

    Raises:
      KeyError: an unknown slot name.
    """
    if not hasattr(optimizer, "_get_variable_index"):  # tf_keras: a tf.Variable
        return getattr(optimizer, _SLOT_LISTS[name])[
            optimizer._index_dict[optimizer._var_key(variable)]]
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


def hook_apply_gradients(make_hook) -> bool:
    """Replaces ``apply_gradients`` of tf_keras's optimizer base classes
    (``tf_keras.optimizers.Optimizer``, ``tf_keras.optimizers.legacy.Optimizer``)
    and of both LossScaleOptimizer classes (they override it) by
    ``make_hook(original)``, once per class (see
    :func:`tf_asyncps.compat.hooks.hook_method`).

    Returns:
      False if tf_keras is not installed.
    """
    from tf_asyncps.compat import hooks as hooks_compat
    try:
        import tf_keras
    except ImportError:  # pragma: no cover - tf_keras is a dependency
        return False
    for cls in (tf_keras.optimizers.Optimizer, tf_keras.optimizers.legacy.Optimizer,
                *loss_scale_optimizer_classes()):
        hooks_compat.hook_method(cls, "apply_gradients", make_hook)
    return True


def hook_apply(make_hook, make_loss_scale_hook) -> bool:
    """Replaces Keras 3's ``keras.optimizers.Optimizer.apply`` by
    ``make_hook(original)`` and ``LossScaleOptimizer.apply`` (it overrides
    ``apply`` and receives scaled gradients) by
    ``make_loss_scale_hook(original)``, once per class (see
    :func:`tf_asyncps.compat.hooks.hook_method`).

    Returns:
      False if Keras 3 is not installed.
    """
    from tf_asyncps.compat import hooks as hooks_compat
    base = optimizer_class()
    if base is None:
        return False
    hooks_compat.hook_method(base, "apply", make_hook)
    hooks_compat.hook_method(loss_scale_optimizer_class(), "apply", make_loss_scale_hook)
    return True


#: The key of :func:`hook_sgd_update_step`'s hook (compat.hooks.hook_method).
_ONE_OP_SGD = "tf_asyncps.compat.optimizers.one_op_sgd"


def _momentum_is_zero(optimizer) -> bool:
    """A tf_keras SGD's ``momentum`` is the Python number 0 and ``nesterov``
    is off (a tensor or variable momentum can change: tf_keras's update then)."""
    momentum = getattr(optimizer, "momentum", None)
    return (isinstance(momentum, (int, float)) and momentum == 0
            and not getattr(optimizer, "nesterov", False))


def hook_sgd_update_step(applies) -> bool:
    """Makes tf_keras's ``SGD`` at momentum 0 update each variable in one op
    where ``applies(optimizer)`` (under AsyncParameterServerStrategy).

    tf_keras 2.21.0's ``SGD.update_step`` keeps a momentum slot ``m`` even at
    ``momentum=0`` and updates through it in separate ops: on a sparse
    gradient ``m.assign(m * momentum)``, ``m.scatter_add(-lr * g)``,
    ``variable.assign_add(m)`` (the whole variable), on a dense one
    ``m.assign(-lr * g + m * momentum)``, ``variable.assign_add(m)``. When two
    workers update a variable at once, their ops interleave through the one
    shared ``m``: a row gets another step's update too, a dense variable one
    worker's gradient twice and the other's not at all. The hooked
    ``update_step`` (``SGD``'s and its subclasses' that do not override it),
    for an optimizer with ``momentum`` the Python number 0, ``nesterov``
    off and ``applies(optimizer)`` True, runs plain SGD (Robbins and Monro,
    1951) in one op per variable: ``variable.scatter_add(IndexedSlices(-lr *
    g.values, g.indices))`` on a sparse gradient (only its rows),
    ``variable.assign_add(-lr * g)`` on a dense one. That is SGD at momentum 0 value for value
    (``m`` is ``-lr * g`` after each update there; here it stays 0), with no
    shared buffer and no whole-variable work per sparse step. Any other
    optimizer runs tf_keras's own ``update_step``. Once per process
    (:func:`tf_asyncps.compat.hooks.hook_method`; the first ``applies``
    stays).

    Args:
      applies: ``optimizer -> bool``: whether the optimizer updates under
        this package's strategy.

    Returns:
      False if tf_keras is not installed.
    """
    from tf_asyncps.compat import hooks as hooks_compat
    try:
        import tf_keras
    except ImportError:  # pragma: no cover - tf_keras is a dependency
        return False
    import functools

    import tensorflow as tf

    def make(original):
        @functools.wraps(original)
        def update_step(self, gradient, variable):
            if not (_momentum_is_zero(self) and applies(self)):
                return original(self, gradient, variable)
            lr = tf.cast(self.learning_rate, variable.dtype)
            if isinstance(gradient, tf.IndexedSlices):
                variable.scatter_add(tf.IndexedSlices(-gradient.values * lr, gradient.indices,
                                                      gradient.dense_shape))
            else:
                variable.assign_add(-gradient * lr)
            return None
        return update_step

    hooks_compat.hook_method(tf_keras.optimizers.SGD, "update_step", make, key=_ONE_OP_SGD)
    return True


def sgd_updates_in_one_op(optimizer) -> bool:
    """Whether ``optimizer`` (or a LossScaleOptimizer's inner one) is a
    tf_keras ``SGD`` whose ``update_step`` is :func:`hook_sgd_update_step`'s
    and whose momentum is the Python number 0 without nesterov: under this
    package's strategy it updates each variable in one op."""
    try:
        import tf_keras
    except ImportError:  # pragma: no cover - tf_keras is a dependency
        return False
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    if not isinstance(inner, tf_keras.optimizers.SGD) or not _momentum_is_zero(inner):
        return False
    from tf_asyncps.compat import hooks as hooks_compat
    return hooks_compat.runs_hook(type(inner).update_step, _ONE_OP_SGD)


@contextlib.contextmanager
def deduplicating_only(optimizer, needs):
    """While inside, a tf_keras (2.18.0-2.21.0, not legacy) optimizer's
    ``apply_gradients`` de-duplicates only the sparse gradients ``needs(grad)``
    names (``_deduplicate_sparse_grad``: a ``tf.unique`` and a segment sum
    per ``tf.IndexedSlices``, where the update runs); the others it applies
    as they are. On this instance only; other optimizers (legacy tf_keras,
    Keras 3) have no such method and are untouched.

    Args:
      optimizer: the optimizer being called.
      needs: ``fn(grad: tf.IndexedSlices) -> bool``: False for a gradient
        whose indices are distinct already (then de-duplicating it is the
        identity).
    """
    original = getattr(optimizer, "_deduplicate_sparse_grad", None)
    if original is None:
        yield
        return

    def deduplicate(grads):
        grads = list(grads)
        todo = [i for i, g in enumerate(grads) if not hasattr(g, "indices") or needs(g)]
        for i, g in zip(todo, original([grads[i] for i in todo])):
            grads[i] = g
        return grads

    had_own = "_deduplicate_sparse_grad" in vars(optimizer)
    object.__setattr__(optimizer, "_deduplicate_sparse_grad", deduplicate)
    try:
        yield
    finally:
        if had_own:
            object.__setattr__(optimizer, "_deduplicate_sparse_grad", original)
        else:
            object.__delattr__(optimizer, "_deduplicate_sparse_grad")


def make_iterations_atomic(optimizer) -> None:
    """Makes a Keras 3 optimizer's iteration counter increment atomically.

    Keras 3's ``Variable.assign_add`` is ``assign(self + value)``: a read then
    a write, which loses increments when workers update at once (measured
    133/200 with 2 workers). :func:`tf_asyncps.compat.variables.make_assign_add_atomic` on this one
    counter (``optimizer._iterations``), and on a wrapper's inner optimizer's
    (a LossScaleOptimizer counts its steps in ``inner_optimizer``). tf_keras
    counters are already atomic; other objects are left alone.
    """
    from tf_asyncps.compat.variables import make_assign_add_atomic
    while optimizer is not None:
        counter = getattr(optimizer, "_iterations", None)
        if counter is not None:
            make_assign_add_atomic(counter)
        optimizer = getattr(optimizer, "inner_optimizer", None)


def optimizer_strategy(optimizer):
    """The ``tf.distribute.Strategy`` a tf_keras optimizer runs its update
    under, else None: ``Optimizer._distribution_strategy`` (tf_keras
    2.18-2.21), which the optimizer takes from ``tf.distribute.get_strategy()``
    when it is created (TensorFlow's default strategy outside any scope) and
    whose scope its ``apply_gradients`` enters; a legacy optimizer created
    outside any scope has None and takes the strategy of its first update.
    A LossScaleOptimizer's is its inner optimizer's."""
    inner = getattr(optimizer, "inner_optimizer", None)
    if inner is not None and inner is not optimizer:
        return optimizer_strategy(inner)
    return getattr(optimizer, "_distribution_strategy", None)


def sparse_update_is_rowwise(optimizer) -> bool:
    """Whether ``optimizer``'s update of a variable on a sparse
    (``tf.IndexedSlices``) gradient writes only the gradient's rows, so that
    the gradient without rows changes nothing: tf_keras 2.18.0-2.21.0
    ``Adagrad`` (``update_step``: scatter-adds to the accumulator and the
    variable at the indices), its own ``update_step``, no EMA. Others False."""
    try:
        import tf_keras
    except ImportError:  # pragma: no cover - tf_keras is a dependency
        return False
    adagrad = tf_keras.optimizers.Adagrad
    return (isinstance(optimizer, adagrad) and type(optimizer).update_step is adagrad.update_step
            and not getattr(optimizer, "use_ema", False))


def update_is_noop_at_zero(optimizer) -> bool:
    """Whether ``optimizer``'s update of a variable on a zero gradient (dense,
    or sparse rows of zeros) leaves the variable and its slots as they are,
    bit for bit: tf_keras 2.18.0-2.21.0 ``Adagrad`` (``update_step``:
    ``accumulator += g * g``, ``variable -= lr * g / sqrt(accumulator +
    epsilon)``, densely or at the rows, which adds 0 and subtracts 0 for
    g = 0) with its own ``update_step``, ``epsilon > 0`` (the divisor is never
    0), no EMA. Others False."""
    if not sparse_update_is_rowwise(optimizer):
        return False
    epsilon = getattr(optimizer, "epsilon", None)
    return isinstance(epsilon, (int, float)) and epsilon > 0


def dense_on_sparse_gradients(optimizer):
    """Why ``optimizer`` (tf_keras or Keras 3) touches every row of a
    variable on each sparse (IndexedSlices) gradient, or None: a message
    naming the optimizer and the ones to use instead."""
    return _tf_keras_dense_on_sparse_gradients(optimizer) or \
        _keras3_dense_on_sparse_gradients(optimizer)


def _tf_keras_dense_on_sparse_gradients(optimizer):
    """Why ``optimizer`` touches every row of a variable on each sparse
    (IndexedSlices) gradient under this package's strategy, or None.

    tf_keras 2.21's ``SGD`` with momentum, for a sparse gradient, runs
    ``m.assign(m * momentum)`` and ``variable.assign_add(m)`` over the whole
    variable, a cost that grows with the table
    (docs/benchmarks.md#optimizers-on-sparse-gradients). At momentum 0 (a
    Python number, no nesterov) the strategy updates only the gradient's rows
    (:func:`hook_sgd_update_step`).
    """
    try:
        import tf_keras
    except ImportError:  # pragma: no cover - tf_keras is a dependency
        return None
    inner = getattr(optimizer, "inner_optimizer", optimizer)  # LossScaleOptimizer
    if isinstance(inner, tf_keras.optimizers.SGD) and not sgd_updates_in_one_op(inner):
        return ("tf_keras.optimizers.SGD with momentum updates every row of the variable "
                "on each sparse gradient (it decays its momentum slot and adds it to the "
                "whole variable); for embedding tables use momentum=0 (then only the "
                "batch's rows are updated), tf_keras.optimizers.legacy.SGD or "
                "tf_keras.optimizers.Adagrad, whose sparse updates touch only the rows "
                "of the batch")
    return None


def _keras3_dense_on_sparse_gradients(optimizer):
    """Why a Keras 3 ``optimizer`` touches every row of a table on each sparse
    (IndexedSlices) gradient, or None (also None for non-Keras 3 optimizers).

    Keras 3.15's update rules are written as dense tensor math: Adagrad's
    ``variable -= lr * g / sqrt(accumulator + eps)`` reads the whole
    accumulator, Adam/RMSprop decay whole moments, SGD with momentum a whole
    momentum. Only SGD without momentum stays sparse (measured on a 1M x 32
    table over 2 ps, one worker: SGD 135 steps/s, 125 at 10K rows; Adagrad
    12.9, 84.9 at 10K rows).
    """
    cls = optimizer_class()
    if cls is None or not isinstance(optimizer, cls):
        return None
    import keras
    inner = getattr(optimizer, "inner_optimizer", optimizer)  # LossScaleOptimizer
    if isinstance(inner, keras.optimizers.SGD) and not inner.momentum:
        return None
    return (f"Keras 3's {type(inner).__name__} updates every row of the variable on each "
            f"sparse gradient (its update rule is dense tensor math); for embedding tables "
            f"use keras.optimizers.SGD without momentum or keras.optimizers.Adagrad (this "
            f"strategy updates only the rows of the batch for those), or "
            f"tf_asyncps.keras3.LazyAdam for Adam")


def optimizer_class():
    """``keras.optimizers.Optimizer`` when Keras 3 is installed, else None."""
    try:
        import keras
    except ImportError:  # pragma: no cover
        return None
    return keras.optimizers.Optimizer if keras.__version__.startswith("3") else None


def loss_scale_optimizer_class():
    """``keras.optimizers.LossScaleOptimizer`` when Keras 3 is installed, else None."""
    return optimizer_class() and __import__("keras").optimizers.LossScaleOptimizer


def loss_scale_optimizer_classes() -> tuple:
    """tf_keras's LossScaleOptimizer classes (``LossScaleOptimizerV3`` and the
    legacy ``LossScaleOptimizer``); empty if tf_keras is missing."""
    try:
        from tf_keras.src.mixed_precision import loss_scale_optimizer as lso_lib
    except ImportError:  # pragma: no cover - tf_keras is a dependency
        return ()
    return tuple(getattr(lso_lib, n) for n in ("LossScaleOptimizerV3", "LossScaleOptimizer")
                 if hasattr(lso_lib, n))


def creating_optimizer_slot() -> bool:
    """Whether an optimizer is creating a slot variable on this thread: its
    ``add_variable_from_reference`` (Keras 3.15.1's BaseOptimizer and TF
    backend optimizer, tf_keras 2.21's Optimizer) or ``add_slot`` (tf_keras's
    legacy OptimizerV2) is running (hooked:
    :mod:`tf_asyncps.compat.call_scopes`), lazily inside a step or eagerly in
    a build before the first one."""
    from tf_asyncps.compat import call_scopes
    return call_scopes.CREATING_SLOT.get() is not None
