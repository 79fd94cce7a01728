"""Private TensorFlow APIs used by tf_asyncps, in one place.

Tested with TensorFlow 2.18.1, 2.19.1, 2.20.0 and 2.21.0 (``pyproject.toml``
asks for ``tensorflow>=2.18,<2.22``; docs/guides/compatibility.md): nothing below
differs between them.
Each function imports TensorFlow when called, so importing this module is
free (the CLI validates flags before TensorFlow loads). What each group is
for:

* ParameterServerStrategy: the ``extended`` base class that
  ``tf_asyncps/strategy.py`` subclasses (its ``_``-named methods are the
  StrategyExtended hooks it overrides), and autograph conversion as PSS does
  it in ``_call_for_each_replica``.
* ClusterCoordinator: its closure queue and worker threads (closure retry
  accounting, the "anything queued?" probe).
* Variables: per-worker variables and raw resource-variable ops for the
  local copies of ``local_sgd`` (``tf_asyncps/core/local_copies.py``).
* Graphs and eager context; tf.data's test-only sleep (straggler injection).
* Start-up: what a ps/worker task process needs of TensorFlow (its server),
  imported without TensorFlow's public API package (:func:`serving_runtime`);
  TensorFlow without its eager Keras import (:func:`import_without_keras`).
"""

import functools
import sys
import weakref
from typing import Optional

__all__ = [
    "TESTED_VERSIONS", "context_connected", "pss_extended_base", "autograph_convert",
    "inside_function", "outermost_graph", "num_workers", "num_gpus_per_worker",
    "coordinator_initialized", "closure_queue_nonempty", "instrument_closures", "shards",
    "run_before_closures",
    "PSS_EXTENDED_HOOKS", "replace_extended", "route_remote_value_get",
    "hook_method", "set_untracked_attribute", "untracked_attribute",
    "colocating_creator", "hide_closure_error_logs",
    "unwrap_caching_variable",
    "swap_handle", "per_worker_variable", "per_worker_values", "read_handle",
    "resources_written",
    "assign_handle", "assign_add_handle", "dataset_sleep", "per_worker_datasets",
    "import_without_keras", "serving_runtime", "replace_sparse_read", "colocate_only_with",
]

TESTED_VERSIONS = ("2.18.1", "2.19.1", "2.20.0", "2.21.0")


def import_without_keras():
    """Imports TensorFlow without the Keras import of its ``__init__``.

    TensorFlow 2.21's ``__init__`` imports Keras eagerly (``keras.src.optimizers``,
    or ``tf_keras.src.optimizers`` under ``TF_USE_LEGACY_KERAS``, for SavedModel
    registrations, b/196254385): 1.2-1.9 s of CPU, Keras 3 pulling in pandas
    and scipy. For a process that checks flags with TensorFlow (``launch``)
    and may never run Keras: Keras is hidden while TensorFlow imports
    (TensorFlow catches the ImportError, as where Keras is not installed) and
    imports normally afterwards. A TensorFlow already imported is returned as
    it is.

    Returns:
      The ``tensorflow`` module.
    """
    if "tensorflow" not in sys.modules:
        hidden = [m for m in ("keras", "tf_keras") if m not in sys.modules]
        for m in hidden:
            sys.modules[m] = None  # makes `import m` raise ImportError
        try:
            import tensorflow  # noqa: F401
        finally:
            for m in hidden:
                sys.modules.pop(m, None)
    return sys.modules["tensorflow"]


@functools.lru_cache(maxsize=None)
def serving_runtime():
    """The part of TensorFlow a ps/worker task process uses, imported lean.

    A ps/worker task only starts a ``tf.distribute.Server`` and joins it; the
    functions it runs come from the chief as graphs, executed by the C++
    runtime. Importing ``tensorflow`` costs ~3.5 s of CPU (4.5 s wall here)
    per process, most of it the generated public API (``tensorflow._api.v2``)
    and Keras; the modules below cost ~0.6 s. Unless TensorFlow is already
    imported, ``tensorflow``'s ``__init__`` is skipped while they import (a
    bare package object stands in for it, then is removed, so a later
    ``import tensorflow`` runs the real one). The C++ runtime, its kernels and
    the gRPC server are the same shared library either way.

    Tested with TensorFlow 2.21.0 (``tensorflow.python.training.server_lib``,
    ``tensorflow.python.framework.config``/``errors``,
    ``tensorflow.core.protobuf.config_pb2``).

    Returns:
      A namespace with ``Server`` (``tf.distribute.Server``), ``ConfigProto``
      (``tf.compat.v1.ConfigProto``), ``OpError`` (``tf.errors.OpError``),
      ``set_visible_devices`` and ``list_physical_devices`` (``tf.config``);
      the same one on every call.
    """
    import types
    stub = None
    if "tensorflow" not in sys.modules:
        import importlib.util
        spec = importlib.util.find_spec("tensorflow")
        stub = types.ModuleType("tensorflow")
        stub.__spec__, stub.__path__ = spec, list(spec.submodule_search_locations)
        sys.modules["tensorflow"] = stub
    try:
        from tensorflow.core.protobuf import config_pb2
        from tensorflow.python.framework import config, errors
        from tensorflow.python.training import server_lib
    finally:
        if stub is not None and sys.modules.get("tensorflow") is stub:
            del sys.modules["tensorflow"]
    return types.SimpleNamespace(
        Server=server_lib.Server, ConfigProto=config_pb2.ConfigProto, OpError=errors.OpError,
        set_visible_devices=config.set_visible_devices,
        list_physical_devices=config.list_physical_devices)


def context_connected() -> bool:
    """Whether this process's TensorFlow context is connected to a cluster.

    Reads ``context.context_safe()._server_def``. False when TensorFlow was
    never imported, or when the private API moved (assume not connected).
    """
    if "tensorflow" not in sys.modules:
        return False
    try:
        from tensorflow.python.eager import context
        ctx = context.context_safe()
        return ctx is not None and getattr(ctx, "_server_def", None) is not None
    except Exception:  # pragma: no cover - private API moved: assume not
        return False


# -- ParameterServerStrategy ---------------------------------------------------
def pss_extended_base():
    """``ParameterServerStrategyV2Extended``: the class the strategy's
    ``extended`` object subclasses."""
    from tensorflow.python.distribute import parameter_server_strategy_v2 as pss_v2
    return pss_v2.ParameterServerStrategyV2Extended


def autograph_convert(fn):
    """``fn`` converted by autograph with the caller's control status, as
    ``ParameterServerStrategyV2Extended._call_for_each_replica`` does; ``fn``
    itself when executing eagerly."""
    import tensorflow as tf
    if tf.executing_eagerly():
        return fn
    from tensorflow.python.autograph.core import ag_ctx
    from tensorflow.python.autograph.impl import api as autograph
    return autograph.tf_convert(fn, ag_ctx.control_status_ctx())


#: The private names of ``ParameterServerStrategyV2Extended`` (and its
#: ``StrategyExtended`` bases) that a subclass of :func:`pss_extended_base`
#: overrides or reads: ``tf_asyncps/strategy.py``'s ``_AsyncExtended``
#: (tested with TensorFlow 2.21.0; ``tests/test_architecture.py`` allows
#: these names, and only these, on ``self``/``super()`` in such a subclass).
PSS_EXTENDED_HOOKS = frozenset({
    # overridden hooks
    "_use_merge_call", "_replica_ctx_update", "_replica_ctx_all_reduce", "_reduce_to",
    "_batch_reduce_to", "_distribute_datasets_from_function", "_create_variable",
    "_call_for_each_replica", "_update",
    # read
    "_num_replicas_in_sync", "_num_workers", "_container_strategy",
})


def replace_extended(strategy, extended) -> None:
    """Makes ``extended`` the ``extended`` object of ``strategy`` (a
    ParameterServerStrategy whose ``__init__`` built its own), carrying the
    per-device retrace setting over from the one it replaces.

    ``tf.distribute.Strategy.extended`` returns ``strategy._extended``; the
    strategy's constructor takes no ``extended`` argument in TF 2.21.
    """
    old = strategy._extended
    strategy._extended = extended
    extended._retrace_functions_for_each_device = old._retrace_functions_for_each_device


def route_remote_value_get(value, wrap) -> bool:
    """Routes ``value.get()`` through ``wrap(get, value)``, for this one
    RemoteValue (an instance attribute; its class is untouched).

    ``value`` is what ``ClusterCoordinator.schedule`` returned. TensorFlow's
    closure holds it weakly, so the replacement does too: it keeps nothing
    alive.

    Returns:
      False if ``value`` has no ``get`` or takes no instance attributes.
    """
    get = getattr(type(value), "get", None)
    if get is None or not hasattr(value, "__dict__"):
        return False
    ref = weakref.ref(value)
    value.get = lambda: wrap(get, ref())
    return True


def num_workers(extended) -> int:
    """Worker tasks of a ParameterServerStrategy's ``extended``."""
    return int(extended._num_workers)


def num_gpus_per_worker(extended) -> int:
    """GPUs per worker task of a ParameterServerStrategy's ``extended``."""
    return int(extended._num_gpus_per_worker)


# -- graphs --------------------------------------------------------------------
def inside_function() -> bool:
    """Whether ops are being traced into a tf.function graph."""
    from tensorflow.python.framework import ops
    return ops.inside_function()


def outermost_graph():
    """The outermost FuncGraph of the graph being built (the scheduled
    function's, when tracing inside a ``tf.while_loop`` or ``tf.cond``)."""
    import tensorflow as tf
    from tensorflow.python.framework import func_graph
    g = tf.compat.v1.get_default_graph()
    while isinstance(getattr(g, "outer_graph", None), func_graph.FuncGraph):
        g = g.outer_graph
    return g


# -- ClusterCoordinator ----------------------------------------------------------
def coordinator_initialized(coordinator) -> bool:
    """Whether ``ClusterCoordinator.__init__`` already ran on this object
    (``ClusterCoordinator(strategy)`` returns the strategy's one coordinator
    and runs ``__init__`` again)."""
    return bool(getattr(coordinator, "_has_initialized", False))


def closure_queue_nonempty(coordinator, ignore_workers=()) -> bool:
    """Whether ``coordinator``'s closure queue holds a closure not yet taken
    by a worker, leaving out the closures tagged for a worker in
    ``ignore_workers`` (its per-worker resource closures, which only it can
    run: ``_tagged_queue`` is keyed by worker index). True when the internals
    moved (never release early). Reads under the queue's ``_queue_lock``, as
    its own methods do: a worker thread's ``get`` adds keys to
    ``_tagged_queue`` (a defaultdict), which an unlocked iteration meets as
    "dictionary changed size during iteration"."""
    ignore = set(ignore_workers)
    try:
        q = coordinator._cluster.closure_queue
        with q._queue_lock:
            return (not q._queue.empty()) or any(
                not t.empty() for tag, t in q._tagged_queue.items() if tag not in ignore)
    except AttributeError:  # pragma: no cover - internals moved
        return True


def instrument_closures(coordinator, on_put_back, on_finished, on_process, on_failure) -> bool:
    """Calls back on each closure event of ``coordinator``.

    Wraps the closure queue's ``put_back`` and ``mark_finished`` and each
    worker's ``_process_closure`` and ``_on_closure_failure``.

    Args:
      coordinator: a ``tf.distribute.coordinator.ClusterCoordinator``.
      on_put_back: ``()``, a closure was put back after a failure.
      on_finished: ``()``, a closure finished (on the worker's thread).
      on_process: ``(worker_index)``, the calling thread starts a closure on
        that worker.
      on_failure: ``(worker_index)``, a closure failed on that worker.

    Returns:
      False if the internals were not found (nothing was wrapped).
    """
    try:
        queue = coordinator._cluster.closure_queue
        workers = coordinator._cluster.workers
        put_back, mark_finished = queue.put_back, queue.mark_finished
        for w in workers:
            w._process_closure, w._on_closure_failure  # noqa: B018 - presence check
    except AttributeError:  # pragma: no cover - TF internals moved
        return False

    def counted_put_back(closure):
        on_put_back()
        return put_back(closure)

    def counted_mark_finished():
        on_finished()
        return mark_finished()

    queue.put_back = counted_put_back
    queue.mark_finished = counted_mark_finished
    for w in workers:
        process, failure = w._process_closure, w._on_closure_failure

        def tagged_process(closure, _process=process, _i=w.worker_index):
            on_process(_i)
            return _process(closure)

        def counted_failure(closure, e, _failure=failure, _i=w.worker_index):
            on_failure(_i)
            return _failure(closure, e)

        w._process_closure = tagged_process
        w._on_closure_failure = counted_failure
    return True


def run_before_closures(strategy, before) -> bool:
    """Calls ``before(concrete_function)`` at the start of each closure's run
    on a worker, inside the closure's own run: on the worker's thread of the
    chief, in the worker's device, executor and dispatch context (per-worker
    variables are that worker's), and under its failure handling (an error
    raised there is the closure's: put back, run again). Closures of Python
    functions (no concrete function) and per-worker resource closures are
    left alone.

    Args:
      strategy: a ParameterServerStrategy whose coordinator exists.
      before: ``(ConcreteFunction) -> None``.

    Returns:
      False if the internals were not found (nothing was wrapped).
    """
    try:
        workers = strategy._cluster_coordinator._cluster.workers
        for w in workers:
            w._process_closure  # noqa: B018 - presence check
    except AttributeError:  # pragma: no cover - TF internals moved
        return False

    def wrap(closure):
        fn = getattr(closure, "_function", None)
        cf = getattr(closure, "_concrete_function", None)
        if cf is None or fn is None or getattr(fn, "_asyncps_before", False):
            return  # a Python function, or wrapped already (a put-back closure)

        def run(*args, **kwargs):
            before(cf)
            return fn(*args, **kwargs)

        run._asyncps_before = True
        closure._function = run

    for w in workers:
        def process(closure, _process=w._process_closure):
            wrap(closure)
            return _process(closure)

        w._process_closure = process
    return True


def hide_closure_error_logs(error_class) -> None:
    """Drops the coordinator's ERROR log records about ``error_class`` (one
    per failed closure plus "Start cancelling closures due to error", each
    with the whole error text: ~130 lines for one input that ran out), for
    an error that is raised with its own explanation. TensorFlow's record
    formats and their arguments as of 2.21.0 (cluster_coordinator.py);
    installed once per error class. Once one is hidden, the records of the
    CancelledErrors it causes ("This derived error is ignored") are too."""
    import logging as py_logging
    import tensorflow as tf
    logger = tf.get_logger()
    if any(getattr(f, "error_class", None) is error_class for f in logger.filters):
        return

    class _Hide(py_logging.Filter):
        seen = False  # once one was hidden: also the CancelledErrors it causes

        def filter(self, record):
            if record.levelno != py_logging.ERROR or not isinstance(record.args, tuple):
                return True
            msg = str(record.msg)
            if self.seen and "This derived error is ignored" in msg:
                return not any(isinstance(a, tf.errors.CancelledError) for a in record.args)
            if "encountered the following error when processing" not in msg and \
                    not msg.startswith("Start cancelling closures due to error"):
                return True
            if any(isinstance(a, error_class) for a in record.args):
                _Hide.seen = True
                return False
            return True

    f = _Hide()
    f.error_class = error_class
    logger.addFilter(f)


# -- variables -------------------------------------------------------------------
def in_save_context() -> bool:
    """Whether a SavedModel export is tracing functions now
    (``tf.saved_model.save`` and Keras saves; TF 2.16-2.21's
    ``save_context.in_save_context``)."""
    from tensorflow.python.saved_model import save_context
    return save_context.in_save_context()


def colocated_with(op):
    """Context: ops created in it are placed with ``op`` (a tensor, an op or
    a variable), inside any colocation around it: ``tf.compat.v1.colocate_with(op)``
    without its deprecation warning, which every job printed (TF 2.16-2.21)."""
    from tensorflow.python.framework import ops
    return ops.colocate_with(op)


def colocate_only_with(op):
    """Context: ops created in it are placed with ``op``, whatever colocation
    or device scope surrounds them (``tf.compat.v1.colocate_with(op,
    ignore_existing=True)`` without its deprecation warning; TF 2.16-2.21)."""
    from tensorflow.python.framework import ops
    return ops.colocate_with(op, ignore_existing=True)


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


def colocating_creator(var):
    """A variable creator that places new variables with ``var``, unpartitioned.

    What ``strategy.extended.colocate_vars_with(var)`` does, without its check
    that ``var`` was made in the strategy's scope (the global step is made
    before it). The ``colocate_with`` creator argument is what
    ParameterServerStrategy's ``_create_variable`` honours (never partitioned,
    ``ops.colocate_with(var)``).
    """
    def creator(next_creator, **kwargs):
        kwargs["colocate_with"] = var
        return next_creator(**kwargs)
    return creator


def shards(var):
    """The ps shards of a ``ShardedVariable`` (``variable_partitioner``), else None."""
    from tensorflow.python.distribute import sharded_variable
    if isinstance(var, sharded_variable.ShardedVariable):
        return list(var.variables)
    return None


#: Ops that write the resource variable of their first input.
_WRITE_OPS = ("AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp")
_WRITE_PREFIXES = ("ResourceApply", "ResourceSparseApply", "ResourceScatter")


def resources_written(ops) -> list:
    """The resource handles that ``ops`` write (assign, optimizer apply,
    scatter), each followed out of the function graphs it was captured
    into (``FuncGraph.captures``, TF 2.21) to the tensor it captures, so that
    it compares by ``id`` with a variable's ``handle``. Ops inside nested
    function bodies (``tf.cond``, ``tf.while_loop``) are not looked into."""
    out = []
    for op in ops:
        if not (op.type in _WRITE_OPS or op.type.startswith(_WRITE_PREFIXES)) or \
                not op.inputs:
            continue
        t = op.inputs[0]
        while True:
            captures = getattr(t.graph, "captures", None) if hasattr(t, "graph") else None
            outer = next((ext for ext, internal in captures or () if internal is t), None)
            if outer is None:
                break
            t = outer
        out.append(t)
    return out


def unwrap_caching_variable(var):
    """The ResourceVariable under PSS's ``CachingVariable`` wrapper (else ``var``)."""
    from tensorflow.python.distribute import ps_values
    return var.get() if isinstance(var, ps_values.CachingVariable) else var


def swap_handle(var, handle) -> None:
    """Points ResourceVariable ``var`` at another resource ``handle`` (while a
    local step is traced, ``local_sgd``'s per-worker copy)."""
    var._handle = handle


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


# -- tf.data ---------------------------------------------------------------------
def dataset_sleep(delay_us):
    """tf.data's test transformation that sleeps ``delay_us`` (int64
    microseconds, may be a tensor) before each element."""
    from tensorflow.python.data.experimental.ops import testing as data_testing
    return data_testing.sleep(delay_us)


def per_worker_datasets(coordinator, dataset_fn):
    """Each worker's own ``tf.data.Dataset`` (not an iterator), as one value to
    pass to ``coordinator.schedule``: ``PerWorkerDatasetFromDatasetFunction.build()``,
    as tf_keras's exact evaluation uses it (TF 2.21)."""
    return coordinator.create_per_worker_dataset(dataset_fn).build()


# -- What tf_asyncps adds to TensorFlow/Keras objects -----------------------------
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
    f = original
    while f is not None:
        if getattr(f, "_asyncps_hook", None) == key:
            return False
        f = getattr(f, "_asyncps_original", None)
    hooked = make_hook(original)
    hooked._asyncps_original = original
    hooked._asyncps_hook = key
    setattr(cls, name, hooked)
    return True


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
