"""K replicas per worker (K GPUs): one worker step, one update.

``ParameterServerStrategy`` runs K replicas per worker step when a worker has
K > 1 GPUs. Here the read step r, the policy's ``before_read`` and the read
snapshot are taken once for the worker, before the K replicas run
(:func:`replicated_step`). Their ``apply_gradients`` calls meet in one
``merge_call`` (:func:`apply_replicated`), outside any ``tf.cond``, which sums
the K gradient lists (tf_keras scales each replica's loss by 1/K, so the sum is
the gradient of the worker's whole batch; IndexedSlices stay sparse) and runs
the policy engine once: one worker step is one update or one drop, counted once.

The optimizer's own update then runs under a plain ``ReplicaContext``, whose
merge calls run at once, so the engine's ``tf.cond`` may contain it; while it
runs, :func:`in_single_update` is True and the strategy's
``_reduce_to``/``_batch_reduce_to`` let the optimizer's all-reduce pass the
sum through.
"""

import tensorflow as tf

from tf_asyncps.core import grads as grads_lib
from tf_asyncps.core import trace_context
from tf_asyncps.core.step import WorkerStep

__all__ = ["ReplicaGroup", "replicated_step", "apply_replicated", "in_single_update"]


def in_single_update() -> bool:
    """True while a K-replica step's one update runs on this thread."""
    return trace_context.SINGLE_UPDATE.get()


class ReplicaGroup:
    """Trace-time state shared by the K replicas of one worker step."""

    def __init__(self, num_replicas: int):
        self.applied = False
        self.apply_fns = [None] * num_replicas


def replicated_step(engine, fn, args, kwargs, call_for_each_replica, num_replicas):
    """Runs a worker step of ``num_replicas`` replicas of ``fn``.

    Args:
      engine: the PolicyEngine.
      fn, args, kwargs: the replica function and its arguments.
      call_for_each_replica: PSS's own ``_call_for_each_replica``.
      num_replicas: K.

    Returns:
      The per-replica outputs.
    """
    w = engine.worker_index()
    r = engine.read_point(w)
    group = ReplicaGroup(num_replicas)

    @tf.autograph.experimental.do_not_convert
    def replica_step(*a, **kw):
        step = WorkerStep(engine, r, w)
        step.group = group
        with tf.control_dependencies([r]), step.active():
            return fn(*a, **kw)

    out = call_for_each_replica(replica_step, args, kwargs)
    if not group.applied:
        engine.no_update(w, out)
    return out


def apply_replicated(engine, step, optimizer, grads_and_vars, apply_fn):
    """Joins the K replicas' gradients of one worker step and applies them once.

    Called in each replica's context; returns what the engine's
    ``apply_step`` returns (int64 scalar, the global step after the step).
    """
    group = step.group
    ctx = tf.distribute.get_replica_context()
    replica = tf.get_static_value(ctx.replica_id_in_sync_group)
    group.apply_fns[int(replica or 0)] = apply_fn
    present = [i for i, (g, _) in enumerate(grads_and_vars) if g is not None]
    variables = [v for _, v in grads_and_vars]

    def merge_fn(strategy, grads):
        summed = [grads_lib.sum_parts(g.values if isinstance(
            g, tf.distribute.DistributedValues) else [g]) for g in grads]
        full = [(None, v) for v in variables]
        for i, g in zip(present, summed):
            full[i] = (g, variables[i])
        apply0 = group.apply_fns[0]

        def apply_once(gv):
            # The optimizer sees one replica holding the summed gradients: a
            # plain ReplicaContext, whose merge calls run at once (so the
            # variable updates run in cross-replica mode, as
            # AggregatingVariables require), and its gradient all-reduce
            # passes the sum through (the strategy's _batch_reduce_to).
            with trace_context.entered(trace_context.SINGLE_UPDATE, True), \
                    tf.distribute.ReplicaContext(strategy, replica_id_in_sync_group=0):
                return apply0(gv)

        group.applied = True
        first = WorkerStep(engine, step.read_step, step.worker_index)
        return engine.apply_step(first, optimizer, full, apply_once)

    return ctx.merge_call(merge_fn, args=([grads_and_vars[i][0] for i in present],))
