"""How a variable is read and added to, changed on one instance.

TensorFlow resource-variable internals (TF 2.21.0; the same read path in
2.18-2.20): a variable's dense read, replaced on one instance or redirected
while one update is traced; an optimizer's counter increment, made
conditional while one update is traced. TensorFlow 2.21.0's gradient tape
(``tensorflow.python.eager`` ``record.stop_recording``,
``record.record_operation`` and ``tape.variable_accessed``, the same in
2.16-2.21; what ``tf.custom_gradient`` uses inside): a row read recorded as
one operation on the variable.

ParameterServerStrategy's variables (TF 2.18.1, 2.19.1, 2.20.0 and 2.21.0,
:data:`tf_asyncps.compat.versions.TENSORFLOW_TESTED`): a ``ShardedVariable``'s
shards, the variable under a ``CachingVariable``, a variable's sparse read
replaced on one instance, and the per-worker variables and resource-variable
ops by handle of ``local_sgd``'s local copies
(``tf_asyncps/core/local_copies.py``) and of the embedding cache's
per-worker rows (``tf_asyncps/core/embedding_cache.py``: row gathers and
scatters by handle).

Keras 3's variables (Keras 3.10.0, 3.12.4 and 3.15.1,
:data:`tf_asyncps.compat.versions.KERAS3_TESTED`): the tf.Variable or
ShardedVariable behind one (its ``_value``), whether a ``StatelessScope`` is
active, and a variable's ``assign_add``/``assign_sub`` and a
``SeedGenerator``'s advance made one atomic op.

Importable without TensorFlow being imported first.
"""

import contextlib

__all__ = ["replace_dense_read", "adding_only_if", "reads_redirected",
           "recorded_on_variable", "shards", "unwrap_caching_variable", "replace_sparse_read",
           "per_worker_variable", "per_worker_values", "swap_handle", "read_handle",
           "assign_handle", "assign_add_handle", "gather_handle", "scatter_update_handle",
           "scatter_add_handle", "backing_variable", "tf_value",
           "sharded_value", "tf_variables", "in_stateless_scope", "make_assign_add_atomic",
           "make_seed_generator_atomic"]


def replace_dense_read(var, after_read) -> bool:
    """Routes this variable's dense reads through ``after_read(value)``: an
    instance attribute, this variable only. Idempotent.

    TensorFlow's ``BaseResourceVariable._read_variable_op`` is the one op
    behind ``value()`` (what ``tf.convert_to_tensor(var)``, ``var * x`` and
    ``tf.matmul(x, var)`` use), ``read_value()`` and ``read_value_no_copy()``;
    ``sparse_read``, ``gather_nd`` and the assign ops do not go through it.
    Its ``ReadVariableOp`` and the tape's record of it stay as they are:
    ``after_read`` gets the read's float tensor and returns what the reader
    sees (the gradient flows back through what it adds).

    Args:
      var: a ``tf.Variable`` (a resource variable, or the strategy's wrapper
        of one: the wrapped variable's reads are replaced).
      after_read: ``fn(value: tf.Tensor) -> tf.Tensor`` of the same dtype
        and shape.

    Returns:
      False if ``var`` has no ``_read_variable_op`` (not a resource variable).
    """
    import tensorflow as tf
    # ParameterServerStrategy wraps its variables (ps_values.CachingVariable,
    # AggregatingVariable: ``_v``), whose reads call the wrapped variable's.
    while isinstance(getattr(var, "_v", None), tf.Variable):
        var = var._v
    original = getattr(var, "_read_variable_op", None)
    if original is None:
        return False
    if getattr(original, "_asyncps_replaced", False):
        return True

    def _read_variable_op(*args, **kwargs):
        return after_read(original(*args, **kwargs))

    _read_variable_op._asyncps_replaced = True
    var._read_variable_op = _read_variable_op
    return True


@contextlib.contextmanager
def adding_only_if(var, pred):
    """While this context is active, ``var.assign_add(delta, ...)`` adds
    ``delta * cast(pred)``: an instance attribute on this object only,
    removed (or the previous one put back) on exit.

    For an optimizer's iteration counter (``optimizer.iterations``), which
    tf_keras 2.21.0 (``Optimizer`` and ``legacy.OptimizerV2``) and Keras
    3.15.1 increment with ``iterations.assign_add(1)`` once per
    ``apply_gradients`` call, outside ``extended.update``: a step gated
    per variable (core/nonfinite_guard.py) must not count a dropped step.

    Args:
      var: a ``tf.Variable`` or a Keras 3 ``Variable`` (integer dtype).
      pred: scalar tf.bool.
    """
    import tensorflow as tf
    original = var.assign_add

    def assign_add(delta, *args, **kwargs):
        dtype = tf.as_dtype(getattr(var, "dtype", tf.int64))
        return original(tf.cast(delta, dtype) * tf.cast(pred, dtype), *args, **kwargs)

    with _instance_attribute(var, "assign_add", assign_add):
        yield


@contextlib.contextmanager
def reads_redirected(var, redirect):
    """While this context is active, a dense read of ``var`` (the path of
    :func:`replace_dense_read`) returns ``redirect(read)``, where ``read()``
    makes the original read op in the current graph. On exit the previous
    read (a :func:`replace_dense_read` one included) is put back.

    Args:
      var: a ``tf.Variable`` (the strategy's wrapper of one: the wrapped
        variable's reads are redirected).
      redirect: ``fn(read: Callable[[], tf.Tensor]) -> tf.Tensor``.
    """
    while hasattr(var, "_v") and hasattr(var._v, "_read_variable_op"):
        var = var._v
    if getattr(var, "_read_variable_op", None) is None:
        yield
        return
    current = var._read_variable_op

    def _read_variable_op(*args, **kwargs):
        return redirect(lambda: current(*args, **kwargs))

    with _instance_attribute(var, "_read_variable_op", _read_variable_op):
        yield


# ``tf.custom_gradient`` cannot serve a variable's row read: for a function
# that reads a variable it passes the whole variable through an ``IdentityN``
# (a read of every row of the table). Recording the read as one operation on
# the variable's handle gives the gradient without reading more.
def recorded_on_variable(variable, forward, backward):
    """``forward()`` with its gradient to ``variable`` given by ``backward``.

    The ops of ``forward`` are not recorded on the active gradient tapes;
    ``variable`` is marked accessed (a tape watching accessed variables
    watches it) and one operation from its handle to the output is recorded.

    Args:
      variable: a resource ``tf.Variable``.
      forward: ``() -> tf.Tensor``, the read.
      backward: ``dy -> gradient`` (a ``tf.Tensor`` or ``tf.IndexedSlices``
        shaped like ``variable``).

    Returns:
      ``forward()``'s tensor.
    """
    from tensorflow.python.eager import record, tape

    with record.stop_recording():
        out = forward()
    tape.variable_accessed(variable)
    record.record_operation("AsyncpsRowRead", [out], [variable.handle],
                            lambda dy: [backward(dy)])
    return out


@contextlib.contextmanager
def _instance_attribute(obj, name, value):
    """``obj.name = value`` on this instance while the context is active; on
    exit the instance's own previous attribute is put back, or removed if it
    had none (the class's is then seen again)."""
    had = name in vars(obj)
    previous = vars(obj).get(name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        if had:
            setattr(obj, name, previous)
        else:
            delattr(obj, name)


def shards(var):
    """The ps shards of a ``ShardedVariable`` (``variable_partitioner``), else None."""
    from tensorflow.python.distribute import sharded_variable
    if isinstance(var, sharded_variable.ShardedVariable):
        return list(var.variables)
    return None


def unwrap_caching_variable(var):
    """The ResourceVariable under PSS's ``CachingVariable`` wrapper (else ``var``)."""
    from tensorflow.python.distribute import ps_values
    return var.get() if isinstance(var, ps_values.CachingVariable) else var


def replace_sparse_read(var, gather) -> bool:
    """Routes this variable's ``sparse_read`` (what ``tf.gather`` and
    ``tf.nn.embedding_lookup`` call on a resource variable, TF 2.16-2.21's
    ``array_ops.gather``) through ``gather(original_sparse_read, indices,
    name)``: an instance attribute, this variable only. Idempotent; False
    if ``var`` has no ``sparse_read``."""
    original = getattr(var, "sparse_read", None)
    if original is None:
        return False
    if getattr(original, "_asyncps_replaced", False):
        return True

    def sparse_read(indices, name=None):
        return gather(original, indices, name=name)

    sparse_read._asyncps_replaced = True
    var.sparse_read = sparse_read
    return True


def per_worker_variable(strategy, initial_value, name):
    """A ``PerWorkerVariable`` made with TensorFlow's default creator (a
    tf.function's creator, active while a step is traced, cannot build
    per-worker copies)."""
    import functools
    from tensorflow.python.distribute import ps_values
    from tensorflow.python.ops import resource_variable_ops
    creator = functools.partial(resource_variable_ops.default_variable_creator_v2, None)
    return ps_values.PerWorkerVariable(strategy, creator, initial_value=initial_value,
                                       trainable=False, name=name)


def per_worker_values(var):
    """The worker-side tf.Variables of a PerWorkerVariable, by worker index
    (None if not built on the workers yet)."""
    pw = getattr(var, "_per_worker_vars", None)
    if pw is None:
        return None
    out = []
    for rv in pw._values:
        rv._wait_and_maybe_error()  # built before the first step: no wait
        out.append(rv._get_values())  # the worker's tf.Variable, not a copy
    return out


def swap_handle(var, handle) -> None:
    """Points ResourceVariable ``var`` at another resource ``handle`` (while a
    local step is traced, ``local_sgd``'s per-worker copy)."""
    var._handle = handle


def read_handle(handle, dtype):
    """Reads a resource variable by handle."""
    from tensorflow.python.ops import gen_resource_variable_ops
    return gen_resource_variable_ops.read_variable_op(handle, dtype)


def assign_handle(handle, value):
    """Assigns ``value`` to a resource variable by handle."""
    from tensorflow.python.ops import gen_resource_variable_ops
    return gen_resource_variable_ops.assign_variable_op(handle, value)


def assign_add_handle(handle, value):
    """Atomically adds ``value`` to a resource variable by handle."""
    from tensorflow.python.ops import gen_resource_variable_ops
    return gen_resource_variable_ops.assign_add_variable_op(handle, value)


def gather_handle(handle, indices, dtype):
    """Rows ``indices`` of a resource variable, by handle."""
    from tensorflow.python.ops import gen_resource_variable_ops
    return gen_resource_variable_ops.resource_gather(handle, indices, dtype=dtype)


def scatter_update_handle(handle, indices, updates):
    """Writes rows ``indices`` of a resource variable, by handle."""
    from tensorflow.python.ops import gen_resource_variable_ops
    return gen_resource_variable_ops.resource_scatter_update(handle, indices, updates)


def scatter_add_handle(handle, indices, updates):
    """Adds ``updates`` to rows ``indices`` of a resource variable, by handle."""
    from tensorflow.python.ops import gen_resource_variable_ops
    return gen_resource_variable_ops.resource_scatter_add(handle, indices, updates)


def backing_variable(var):
    """The tf.Variable behind a Keras 3 ``Variable`` (its ``value``), else ``var``."""
    inner = getattr(var, "value", None)
    return inner if getattr(inner, "device", None) else var


def tf_value(var):
    """The TensorFlow variable behind a Keras 3 variable: a tf.Variable, or
    a ShardedVariable under ``variable_partitioner`` (its ``_value``; Keras
    3.10-3.15)."""
    return var._value


def sharded_value(var):
    """The shards (tf.Variables) of a Keras 3 variable whose value is a
    ShardedVariable (variable_partitioner), else None."""
    inner = getattr(var, "_value", None)
    return shards(inner) if inner is not None else None


def tf_variables(var) -> list:
    """The tf.Variables behind ``var``: a Keras 3 variable's value, or its
    shards under ``variable_partitioner`` (its ``_value``; Keras 3.10-3.15);
    ``[var]`` for any other variable."""
    inner = getattr(var, "_value", None)
    if inner is None or not hasattr(inner, "dtype"):
        return [var]
    return shards(inner) or [inner]


def in_stateless_scope() -> bool:
    from keras.src.backend.common.stateless_scope import in_stateless_scope as inside
    return inside()


def make_assign_add_atomic(var) -> None:
    """Makes a Keras 3 variable's ``assign_add``/``assign_sub`` one atomic op.

    Keras 3's ``Variable.assign_add`` is ``assign(self + value)``: a read then
    a write, so concurrent workers lose increments of metric totals and counts
    (docs/design.md#9-keras-3-on-parameter-servers). This instance (only) gets the backing tf.Variable's
    atomic ``assign_add``; inside a ``keras.StatelessScope`` (exact
    evaluation's worker-local state) the original, recorded update is kept.
    """
    backing = getattr(var, "_value", None)
    if backing is None or getattr(var, "_asyncps_atomic", False) or \
            not callable(getattr(backing, "assign_add", None)):
        return
    import tensorflow as tf
    plain_add, plain_sub = var.assign_add, var.assign_sub

    def assign_add(value):
        if in_stateless_scope():
            return plain_add(value)
        return backing.assign_add(tf.cast(value, backing.dtype))

    def assign_sub(value):
        if in_stateless_scope():
            return plain_sub(value)
        return backing.assign_sub(tf.cast(value, backing.dtype))

    var.assign_add, var.assign_sub = assign_add, assign_sub
    var._asyncps_atomic = True


def make_seed_generator_atomic(generator) -> None:
    """Makes a Keras 3 ``SeedGenerator.next()`` advance its state atomically.

    Keras 3 reads the state, then assigns ``state + [0, 1]``; two workers can
    read the same state and both write it (a lost advance). Here the state
    advances by one atomic ``assign_add`` and the seed is the state read back
    minus the increment: with one worker exactly the state before this
    advance, as in one process; with several, the counter never loses an
    advance, but a read back that includes another worker's advance can
    repeat a seed. Only ``ordered=True`` (Keras' default) is changed.
    """
    state = getattr(generator, "state", None)
    backing = getattr(state, "_value", None)
    if backing is None or getattr(generator, "_asyncps_atomic", False):
        return
    import tensorflow as tf
    plain_next = generator.next

    def next_seed(ordered=True):
        if not ordered or in_stateless_scope():
            return plain_next(ordered)
        inc = tf.constant([0, 1], dtype=backing.dtype)
        return backing.assign_add(inc, read_value=True) - inc

    generator.next = next_seed
    generator._asyncps_atomic = True
