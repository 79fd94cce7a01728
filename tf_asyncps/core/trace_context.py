"""What is current while a worker step is traced, in one place.

Each kind of state is one ``contextvars.ContextVar`` below, and there is one
way to change it: ``with entered(VAR, value):`` makes ``value`` current and
puts the previous value back on exit (the ContextVar's token), so scopes nest
and a scope left by an exception restores what was there. The modules that
own a kind of state keep their own names for it (``WorkerStep.active``,
``lookup.every_id``, ``nonfinite_guard.guarded_by``, ...); this module is
where they keep it.

Threads: a new thread starts with every variable at its default, as with the
``threading.local`` stores these replace (Python 3.11 gives a thread a fresh
context). TensorFlow runs each replica's function of ``strategy.run`` on a
thread of its own (``mirrored_run``) and the ClusterCoordinator runs closures
on its worker threads: what is set on the caller's thread is not seen there,
so each value is set on the thread that traces the code reading it (the
engine enters the step inside the replica's function, ``engine.worker_step``).
"""

import contextlib
import contextvars

__all__ = ["entered", "STEP", "CLUSTER_STATES", "RECORDING_STATES", "SINGLE_UPDATE",
           "EVERY_ID", "PER_ID_GRADIENTS", "NONFINITE_GATE", "BESIDE_DEPTH"]

#: The ``core.step.WorkerStep`` being traced, or None.
STEP = contextvars.ContextVar("tf_asyncps.step", default=None)
#: The ``core.protocol.ClusterStates`` whose states the policies' ``cluster``
#: returns (a tuple, innermost last: a policy not built into the innermost
#: one is looked up in the ones around it).
CLUSTER_STATES = contextvars.ContextVar("tf_asyncps.cluster_states", default=())
#: The ``core.protocol.ClusterStates`` recording the ``build`` calls, or None.
RECORDING_STATES = contextvars.ContextVar("tf_asyncps.recording_states", default=None)
#: Whether a K-replica step's one update is being traced (core/gpu_replicas.py).
SINGLE_UPDATE = contextvars.ContextVar("tf_asyncps.single_update", default=False)
#: Whether row reads gather every id, not each distinct id once (core/lookup.py).
EVERY_ID = contextvars.ContextVar("tf_asyncps.every_id", default=False)
#: Whether distinct-id row reads give a gradient row per id occurrence (core/lookup.py).
PER_ID_GRADIENTS = contextvars.ContextVar("tf_asyncps.per_id_gradients", default=False)
#: The non-finite check gating variable updates (core/nonfinite_guard.py), or None.
NONFINITE_GATE = contextvars.ContextVar("tf_asyncps.nonfinite_gate", default=None)
#: How many ``placement.beside`` scopes are open: variables created inside are
#: the engine's or a policy's own state, not model variables.
BESIDE_DEPTH = contextvars.ContextVar("tf_asyncps.beside_depth", default=0)


@contextlib.contextmanager
def entered(var: contextvars.ContextVar, value):
    """Makes ``value`` current for ``var`` inside the ``with`` block and
    restores the previous value on exit, also on an exception.

    Args:
      var: one of this module's ContextVars.
      value: the value to make current.

    Yields:
      ``value``.
    """
    token = var.set(value)
    try:
        yield value
    finally:
        var.reset(token)
