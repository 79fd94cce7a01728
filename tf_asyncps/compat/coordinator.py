"""ClusterCoordinator internals: whether its ``__init__`` ran, its closure
queue and worker threads (the "anything queued?" probe, each closure event
counted, a call at the start of each closure's run on a worker), its ERROR
log records of an error raised with its own explanation, and one
RemoteValue's ``get`` routed through a wrapper.

Tested with TensorFlow 2.18.1, 2.19.1, 2.20.0 and 2.21.0
(:data:`tf_asyncps.compat.versions.TENSORFLOW_TESTED`; ``pyproject.toml``
asks for ``tensorflow>=2.18,<2.22``): nothing below differs between them,
unless a function names its own versions.
Importing this module imports nothing; each function imports TensorFlow
when called.
"""

import weakref

__all__ = ["coordinator_initialized", "closure_queue_nonempty", "instrument_closures",
           "run_before_closures", "hide_closure_error_logs", "route_remote_value_get"]


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
