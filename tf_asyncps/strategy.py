"""AsyncParameterServerStrategy: ParameterServerStrategy plus update policies.

The strategy is a ``tf.distribute.ParameterServerStrategy``; everything that
differs lives in its ``extended`` object, which overrides the narrowest hooks:

* ``_call_for_each_replica``: wraps each worker step in a
  :class:`tf_asyncps.step.WorkerStep` that first reads the global step ``r``
  on the PS (before any model variable is read).
* ``apply_step``: called by the optimizer hook with the step's gradients;
  computes τ, runs the update policy and records the result on the PS.
* ``_use_merge_call``/``_replica_ctx_update``/``_replica_ctx_all_reduce``:
  with one replica per worker there is nothing to merge, so updates run
  directly in the replica context (this is what lets a policy put an
  optimizer update under ``tf.cond``).
* Workers with K > 1 GPUs run K replicas per step: ``_replicated_step`` reads
  ``r`` once for them, and ``_apply_replicated`` joins their gradients in one
  ``merge_call`` and runs ``apply_step`` once on the sum
  (``_reduce_to``/``_batch_reduce_to`` let the optimizer's all-reduce pass
  that sum through).
* ``_create_variable``: remembers trainable variables (read snapshots,
  ``local_sgd`` copies).
"""

import dataclasses
import sys
import threading
from typing import List, Union

import tensorflow as tf
from absl import logging
from tensorflow.python.distribute import parameter_server_strategy_v2 as pss_v2

from tf_asyncps import cluster as cluster_lib
from tf_asyncps.cluster import devices
from tf_asyncps.core import faults
from tf_asyncps.core import mixed_precision
from tf_asyncps import policies as policies_lib
from tf_asyncps.core.staleness import PS_DEVICE, StalenessStats, StalenessTracker
from tf_asyncps.core.locking import PSLock, run_collecting_ops
from tf_asyncps.optimizers import is_locking, lock_timeout, make_counter_exact
from tf_asyncps.policies._util import all_finite
from tf_asyncps.core.step import WorkerStep, install_optimizer_hooks

__all__ = ["AsyncParameterServerStrategy", "KERAS3_FIT_MESSAGE"]

KERAS3_FIT_MESSAGE = (
    "Keras 3 `model.fit`/`evaluate`/`predict` cannot run under "
    "AsyncParameterServerStrategy: Keras 3 has no ClusterCoordinator path and "
    "its maintainers state parameter-server training is not supported. Use "
    "tf_keras for model.fit (`import tf_keras as keras`, or set "
    "TF_USE_LEGACY_KERAS=1 before importing TensorFlow so tf.keras is Keras 2). "
    "Keras 3 models and optimizers do work in custom training loops with "
    "tf.distribute.coordinator.ClusterCoordinator.schedule. Keras 3 fit support "
    "is planned for when Keras gains a coordinator path.")


def _called_from_keras3() -> bool:
    f = sys._getframe(2)
    for _ in range(6):
        if f is None:
            return False
        if f.f_globals.get("__name__", "").startswith("keras.src."):
            return True
        f = f.f_back
    return False


class _WorkerInputContext(tf.distribute.InputContext):
    """InputContext with one input pipeline per worker.

    Vanilla ParameterServerStrategy passes every worker the same context
    (1 pipeline, id 0), so ``dataset.shard(ctx.num_input_pipelines,
    ctx.input_pipeline_id)`` does not shard. Here ``num_input_pipelines`` is
    the number of workers and ``input_pipeline_id`` is the worker's index: an
    int64 scalar tensor fed when the dataset is created on that worker.
    """

    def __init__(self, base, num_workers):
        super().__init__(num_input_pipelines=num_workers, input_pipeline_id=0,
                         num_replicas_in_sync=base.num_replicas_in_sync)

    @property
    def input_pipeline_id(self):
        return tf.distribute.coordinator.experimental_get_current_worker_index()


class _AsyncExtended(pss_v2.ParameterServerStrategyV2Extended):
    """The strategy's ``extended``: worker-step hook and policy engine."""

    def __init__(self, container_strategy, cluster_resolver, variable_partitioner,
                 policy, tracker):
        super().__init__(container_strategy, cluster_resolver, variable_partitioner)
        self.policy = policy
        self.tracker = tracker
        self.skip_nonfinite = True
        self._policy_state = {}
        self._lock = None
        self._trainable = []  # trainable variables created under the scope
        self._backups = {}  # id(var) -> [num_workers, *shape] read snapshots

    # -- one replica per worker: no merge_call needed -------------------------
    def _use_merge_call(self):
        return self._num_replicas_in_sync > 1

    def _replica_ctx_update(self, var, fn, args=(), kwargs=None, group=True):
        if self._use_merge_call():
            return super()._replica_ctx_update(var, fn, args, kwargs, group)
        return self._update(var, fn, args, kwargs or {}, group)

    def _replica_ctx_all_reduce(self, reduce_op, value, options=None):
        if self._use_merge_call():
            return super()._replica_ctx_all_reduce(reduce_op, value, options)
        return value  # one replica: the sum and the mean are the value itself

    # -- K replicas per worker: the summed gradients are reduced already ------
    def _reduce_to(self, reduce_op, value, destinations, options):
        if getattr(_single_update, "on", False) and \
                not isinstance(value, tf.distribute.DistributedValues):
            return value  # the optimizer's all-reduce of a K-replica sum
        return super()._reduce_to(reduce_op, value, destinations, options)

    def _batch_reduce_to(self, reduce_op, value_destination_pairs, options):
        if getattr(_single_update, "on", False) and not any(
                isinstance(v, tf.distribute.DistributedValues)
                for v, _ in value_destination_pairs):
            return [v for v, _ in value_destination_pairs]
        return super()._batch_reduce_to(reduce_op, value_destination_pairs, options)

    # -- per-worker datasets: each worker reads its own shard ---------------------
    def _distribute_datasets_from_function(self, dataset_fn, options):
        num_workers = self._num_workers

        def per_worker_fn(ctx):
            return dataset_fn(_WorkerInputContext(ctx, num_workers))

        return super()._distribute_datasets_from_function(per_worker_fn, options)

    # -- variables: remember the trainable ones (for read snapshots) -----------
    def _create_variable(self, next_creator, **kwargs):
        per_worker = kwargs.get("per_worker_variable", False)
        none = tf.VariableAggregation.NONE
        if self._num_replicas_in_sync > 1 and not kwargs.get("trainable", True) and \
                kwargs.get("aggregation", none) in (none, None):
            # K replicas per worker: a step's update runs once (see
            # _apply_replicated), so a non-trainable variable assigned in
            # replica context, such as tf_keras's current learning rate under
            # a schedule, takes that one update's value instead of raising.
            kwargs["aggregation"] = tf.VariableAggregation.ONLY_FIRST_REPLICA
        var = super()._create_variable(next_creator, **kwargs)
        if per_worker or not isinstance(var, tf.Variable):
            return var
        if kwargs.get("trainable", True) is not False:
            self._trainable.append(var)
        if self.policy.local_copies:
            self.policy.add_variable(var)
        return var

    # -- the worker step ------------------------------------------------------
    def _call_for_each_replica(self, fn, args, kwargs):
        from tensorflow.python.autograph.core import ag_ctx
        from tensorflow.python.autograph.impl import api as autograph

        if not tf.executing_eagerly():
            fn = autograph.tf_convert(fn, ag_ctx.control_status_ctx())

        if getattr(_single_update, "on", False):
            # Inside a K-replica step's single update (LossScaleOptimizer calls
            # call_for_each_replica there): one replica holds the summed
            # gradients, so fn runs once.
            with tf.distribute.ReplicaContext(self._container_strategy(),
                                              replica_id_in_sync_group=0):
                return fn(*args, **(kwargs or {}))

        if self.policy.local_copies:
            return super()._call_for_each_replica(self._local_step(fn), args, kwargs)

        if self._num_replicas_in_sync > 1:
            return self._replicated_step(fn, args, kwargs)

        @tf.autograph.experimental.do_not_convert
        def worker_step(*a, **kw):
            w = _worker_index()
            r, snap = self._read_point(w)
            # Every op of the step, variable reads included, runs after r is read.
            step = WorkerStep(self, r, w)
            with tf.control_dependencies([r] + snap), step.active():
                out = fn(*a, **kw)
            if not step.applied:
                self._no_update(w, out)
            return out

        return super()._call_for_each_replica(worker_step, args, kwargs)

    def _replicated_step(self, fn, args, kwargs):
        """A worker step of K > 1 replicas (one per GPU of the worker).

        The read step, the policy's ``before_read`` and the read snapshot are
        taken once for the worker, before the K replicas run. Their gradients
        meet in one ``merge_call`` (see :meth:`_apply_replicated`), where the
        policy engine runs once on their sum: one worker step is one update
        (or one drop), counted once.
        """
        w = _worker_index()
        r, snap = self._read_point(w)
        group = _ReplicaGroup(self._num_replicas_in_sync)

        @tf.autograph.experimental.do_not_convert
        def replica_step(*a, **kw):
            step = WorkerStep(self, r, w)
            step.group = group
            with tf.control_dependencies([r] + snap), step.active():
                return fn(*a, **kw)

        out = super()._call_for_each_replica(replica_step, args, kwargs)
        if not group.applied:
            self._no_update(w, out)
        return out

    def _read_point(self, w):
        """The policy's ``before_read``, then the read step r and (if the
        policy needs them) the read snapshot: once per worker step."""
        with tf.control_dependencies(self.policy.before_read(w)):
            r = self.tracker.read_step()
            snap = self._snapshot(w) if self.policy.needs_read_values else []
        return r, snap

    def _no_update(self, w, out):
        """Tells the policy a worker step made no update (e.g. an evaluation
        step), after the step's outputs exist."""
        with tf.control_dependencies(
                [t for t in tf.nest.flatten(out) if isinstance(t, tf.Tensor)]):
            self.policy.step_without_update(w)

    def _apply_replicated(self, step, optimizer, grads_and_vars, apply_fn):
        """Joins the K replicas' gradients of one worker step and applies them once.

        Called in each replica's context. One ``merge_call`` (outside any
        ``tf.cond``) receives the K gradient lists; in cross-replica context it
        sums them (tf_keras scales each replica's loss by 1/K, so the sum is
        the gradient of the worker's whole batch) and runs the policy engine
        once. The optimizer's own update runs there under a plain replica
        context, whose merge calls run at once, so the engine's ``tf.cond``
        may contain it.
        """
        group = step.group
        ctx = tf.distribute.get_replica_context()
        replica = tf.get_static_value(ctx.replica_id_in_sync_group)
        group.apply_fns[int(replica or 0)] = apply_fn
        present = [i for i, (g, _) in enumerate(grads_and_vars) if g is not None]
        variables = [v for _, v in grads_and_vars]

        def merge_fn(strategy, grads):
            summed = [_sum_replicas(g) for g in grads]
            full = [(None, v) for v in variables]
            for i, g in zip(present, summed):
                full[i] = (g, variables[i])
            apply0 = group.apply_fns[0]

            def apply_once(gv):
                # The optimizer sees one replica holding the summed gradients:
                # a plain ReplicaContext, whose merge calls run at once (so the
                # variable updates run in cross-replica mode, as
                # AggregatingVariables require), and its gradient all-reduce
                # passes the sum through (_batch_reduce_to).
                _single_update.on = True
                try:
                    with tf.distribute.ReplicaContext(strategy, replica_id_in_sync_group=0):
                        return apply0(gv)
                finally:
                    _single_update.on = False

            group.applied = True
            first = WorkerStep(self, step.read_step, step.worker_index)
            return self.apply_step(first, optimizer, full, apply_once)

        return ctx.merge_call(merge_fn, args=([grads_and_vars[i][0] for i in present],))

    def _local_step(self, fn):
        """A worker step on the worker's local copies (``local_sgd``): no PS
        traffic except every ``sync_every``-th step's exchange."""

        @tf.autograph.experimental.do_not_convert
        def worker_step(*a, **kw):
            step = WorkerStep(self, tf.constant(0, tf.int64), _worker_index())
            step.local_state = traced = self.policy.begin_step()
            try:
                self.policy.start_closure(traced)
                with step.active():
                    return fn(*a, **kw)
            finally:
                traced.undo()

        return worker_step

    def _apply_local(self, step, grads_and_vars, apply_fn):
        """Applies a step's gradients to the local copies, then counts it
        (and exchanges with the PS every ``sync_every`` steps)."""
        grads = [g for g, _ in grads_and_vars if g is not None]
        step.applied = True

        def applied():
            _, update_ops = run_collecting_ops(apply_fn, grads_and_vars)
            with tf.control_dependencies(update_ops):
                return tf.constant(True)

        if self.skip_nonfinite:
            # A non-finite local step is skipped (and never pushed).
            ok = tf.cond(all_finite(grads), applied, lambda: tf.constant(False))
        else:
            ok = applied()
        return self.policy.after_local_update(step.local_state, [ok])

    def _snapshot(self, w):
        """PS-side copy of every trainable variable into worker w's backup."""
        ops = []
        for var in self._trainable:
            backup = self._backup_for(var)
            with tf.device(var.device):
                ops.append(backup.scatter_update(tf.IndexedSlices(
                    var.read_value()[None], tf.reshape(tf.cast(w, tf.int64), [1]))))
        return ops

    def _backup_for(self, var):
        key = id(var)
        if key not in self._backups:
            with tf.init_scope(), tf.device(var.device):
                self._backups[key] = tf.Variable(
                    tf.zeros([self._num_workers] + var.shape.as_list(), var.dtype),
                    trainable=False, name="asyncps_read_backup")
        return self._backups[key]

    def _state_for(self, variables):
        key = tuple(id(v) for v in variables)
        if key not in self._policy_state:
            with tf.init_scope():
                if tf.distribute.has_strategy():  # fit() called inside scope()
                    self._policy_state[key] = self.policy.init(list(variables))
                else:
                    with self._container_strategy().scope():
                        self._policy_state[key] = self.policy.init(list(variables))
        return self._policy_state[key]

    def _get_lock(self, timeout_s):
        if self._lock is None:
            self._lock = PSLock(self.tracker.device, timeout_s, name="update_lock")
        return self._lock

    def timeout_error(self):
        """The message of a lock or policy wait that timed out, else None."""
        for source in (self._lock, self.policy):
            msg = getattr(source, "timeout_error", None)
            if msg:
                return msg
        return None

    def apply_step(self, step: WorkerStep, optimizer, grads_and_vars, apply_fn):
        """Applies one worker step's gradients under the update policy.

        Args:
          step: the WorkerStep (holds the read step r and the worker index).
          optimizer: the optimizer being called; a LockingOptimizer makes the
            whole step one locked unit.
          grads_and_vars: list of (gradient or None, variable).
          apply_fn: runs the optimizer's own update on a grads_and_vars list.

        Returns:
          int64 scalar tensor: the global step after this step.
        """
        make_counter_exact(optimizer)
        if getattr(step, "group", None) is not None and \
                not tf.distribute.in_cross_replica_context():
            return self._apply_replicated(step, optimizer, grads_and_vars, apply_fn)
        if getattr(step, "local_state", None) is not None:
            mixed_precision.check_local_copies(self.policy, optimizer)
            if is_locking(optimizer) and not getattr(self, "_warned_local_lock", False):
                self._warned_local_lock = True
                logging.warning(
                    "LockingOptimizer has no effect under local_sgd: each worker updates "
                    "its own copy, and exchanges with the PS are per-variable atomic adds.")
            return self._apply_local(step, grads_and_vars, apply_fn)
        locking = self.policy.atomic
        if is_locking(optimizer):
            locking = True
        pairs = [(g, v) for g, v in grads_and_vars if g is not None]
        if not pairs:
            return apply_fn(grads_and_vars)
        step.applied = True
        # Policies and aggregators work in the variables' dtype (float32 under
        # mixed precision, where tf_keras keeps float32 variables).
        grads = [_cast_to(g, v.dtype.base_dtype) for g, v in pairs]
        variables = [v for _, v in pairs]
        state = self._state_for(variables)
        tracker, policy = self.tracker, self.policy
        # A LossScaleOptimizer skips non-finite steps itself: always check, so
        # such a step is counted as dropped and lowers the loss scale.
        lso = mixed_precision.loss_scale_optimizer(optimizer)
        finite = all_finite(grads) if (self.skip_nonfinite or lso is not None) else None
        worker_index = step.worker_index
        # Bring every worker-side input onto the PS first: the locked
        # region then never waits for a worker that may die, and the
        # decision's tf.cond runs entirely on the PS (measured faster).
        grads = [_copy_to(g, _device_of(v)) for g, v in zip(grads, variables)]
        worker_index = _copy_to(worker_index, tracker.device)
        finite = None if finite is None else _copy_to(finite, tracker.device)
        grad_tensors = [t for g in grads for t in (
            (g.values, g.indices) if isinstance(g, tf.IndexedSlices) else (g,))]
        grad_tensors += [worker_index] + ([finite] if finite is not None else [])
        read_values = None
        if policy.needs_read_values:
            known = {id(v) for v in self._trainable}
            bases = [mixed_precision.base_variable(v) for v in variables]
            read_values = [tf.gather(self._backup_for(b), worker_index)
                           if id(b) in known else None for b in bases]

        def decide_and_apply():
            # g is read once the gradients exist: τ covers the whole step.
            with tf.control_dependencies(grad_tensors):
                g_now = tracker.read_step()
            tau = g_now - step.read_step
            info = policies_lib.StepInfo(
                tau=tau, read_step=step.read_step, global_step=g_now,
                variables=variables, worker_index=worker_index,
                read_values=read_values, finite=finite)
            decision = policy.update(list(grads), state, info)
            new_grads, keep = decision[0], decision[1]
            accepted = decision[2] if len(decision) > 2 else None
            if finite is not None:
                keep = finite if keep is True else tf.logical_and(keep, finite)
            # Without the lock and with a rule that ignores τ, τ comes from the
            # atomic increment itself: every update gets its own g.
            tau_from_increment = not locking and not policy.uses_tau

            def applied():
                # The counters move only after every op of the optimizer's
                # update: optimizers leave their variable updates unordered
                # with respect to each other and to their return value.
                _, update_ops = run_collecting_ops(
                    apply_fn, list(zip(new_grads, variables)))
                with tf.control_dependencies(update_ops):
                    if tau_from_increment:
                        return tracker.record_increment(step.read_step)
                    return tracker.record(tau, applied=True)

            def dropped():
                # The LossScaleOptimizer is not called: adjust its scale here,
                # from the step's own gradients (lowered if they are not finite).
                scale_ops = [] if lso is None else mixed_precision.update_loss_scale(
                    lso, grads)
                with tf.control_dependencies(scale_ops):
                    return tracker.record(
                        tau, applied=False,
                        nonfinite=None if finite is None else tf.logical_not(finite))

            if keep is True:
                return applied()
            otherwise = dropped
            if accepted is not None:  # an aggregator: accepted, update pending
                def otherwise():
                    return tf.cond(accepted,
                                   lambda: tracker.record(tau, applied=True, increment=0),
                                   dropped)
            # On the PS, where the update runs: no extra worker<->PS round trip.
            with tf.device(tracker.device):
                return tf.cond(keep, applied, otherwise)

        if locking:
            # Placed on the PS: a worker that dies cannot hold the lock.
            def locked():
                with tf.device(tracker.device):
                    return decide_and_apply()
            g_after = self._get_lock(lock_timeout(optimizer)).execute(
                locked, inputs=grad_tensors + [step.read_step])
        else:
            # On the PS: a rule that needs τ (read on the PS) and transforms the
            # gradients would otherwise cost an extra worker<->PS round trip.
            with tf.device(tracker.device):
                g_after = decide_and_apply()
        after = policy.after_step(step.worker_index)
        if after:
            with tf.control_dependencies(after):
                g_after = tf.identity(g_after)
        return g_after


_single_update = threading.local()


class _ReplicaGroup:
    """Trace-time state shared by the K replicas of one worker step."""

    def __init__(self, num_replicas):
        self.applied = False
        self.apply_fns = [None] * num_replicas


def _sum_replicas(grad):
    """The sum over replicas of a PerReplica gradient (tensor or IndexedSlices)."""
    parts = list(grad.values) if isinstance(grad, tf.distribute.DistributedValues) else [grad]
    if len(parts) == 1:
        return parts[0]
    if isinstance(parts[0], tf.IndexedSlices):  # stays sparse: rows concatenated
        return tf.IndexedSlices(tf.concat([p.values for p in parts], 0),
                                tf.concat([p.indices for p in parts], 0),
                                parts[0].dense_shape)
    return tf.add_n(parts)


def _device_of(var):
    """The device of a tf.Variable or of a Keras 3 Variable's backing variable."""
    return getattr(getattr(var, "value", None), "device", None) or var.device


def _cast_to(grad, dtype):
    """``grad`` (tensor or IndexedSlices) cast to ``dtype`` if it differs."""
    if grad.dtype.base_dtype == dtype or not dtype.is_floating:
        return grad
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(tf.cast(grad.values, dtype), grad.indices, grad.dense_shape)
    return tf.cast(grad, dtype)


def _copy_to(value, device):
    """``tf.identity`` of a tensor or IndexedSlices, placed on ``device``."""
    with tf.device(device):
        if isinstance(value, tf.IndexedSlices):
            return tf.IndexedSlices(tf.identity(value.values), tf.identity(value.indices),
                                    value.dense_shape)
        return tf.identity(value)


def _worker_index():
    """The current worker's index (int64 scalar) inside a scheduled closure."""
    from tensorflow.python.framework import ops
    if ops.inside_function():
        try:
            return tf.cast(
                tf.distribute.coordinator.experimental_get_current_worker_index(), tf.int64)
        except RuntimeError:
            pass
    return tf.constant(0, tf.int64)


class _AsyncCoordinator(tf.distribute.coordinator.ClusterCoordinator):
    """ClusterCoordinator that turns a policy's timeout into a clear error."""

    _waiting_callers = 0

    def __init__(self, strategy):
        # ClusterCoordinator is one per strategy: tf_keras's later
        # ClusterCoordinator(strategy) returns this object and re-runs __init__.
        first = not getattr(self, "_has_initialized", False)
        super().__init__(strategy)
        if first:
            self.accounting = faults.attach(
                self, faults.ClosureAccounting(strategy.extended._num_workers))

    def has_queued_closures(self) -> bool:
        """True unless the caller is draining: inside ``join``/``done``/``fetch``
        with no closure left in the queue. Only then may waiting workers be
        released: while the program is still scheduling, the queue can be
        empty for a moment between two ``schedule`` calls."""
        if self._waiting_callers <= 0:
            return True
        try:
            q = self._cluster.closure_queue
            return (not q._queue.empty()) or any(
                not t.empty() for t in q._tagged_queue.values())
        except AttributeError:  # internals moved: never release early
            return True

    def _translate(self, call, *args, **kwargs):
        self._waiting_callers += 1
        try:
            return call(*args, **kwargs)
        except (tf.errors.OpError, RuntimeError) as e:
            msg = self.strategy.extended.timeout_error()
            if msg:
                raise TimeoutError(msg) from e
            raise
        finally:
            self._waiting_callers -= 1

    def join(self):
        out = self._translate(super().join)
        flush = getattr(self.strategy.extended.policy, "flush", None)
        if flush is not None:  # local_sgd: push what workers trained since
            flush()            # their last exchange
        return out

    def done(self):
        return self._translate(super().done)

    def fetch(self, val):
        return self._translate(super().fetch, val)


class AsyncParameterServerStrategy(tf.distribute.ParameterServerStrategy):
    """Parameter-server training with pluggable asynchronous update policies.

    Use it as ``tf.distribute.ParameterServerStrategy``: build and compile a
    tf_keras model inside ``strategy.scope()`` and call ``model.fit`` with a
    ``DatasetCreator`` and ``steps_per_epoch`` (worker steps), or drive steps
    yourself with ``tf.distribute.coordinator.ClusterCoordinator.schedule``.
    Every worker step reads the global step before reading the variables, and
    its gradients reach the optimizer through ``update_policy``, which may
    scale, transform or drop them according to the step's staleness τ.

    Cost per worker step: a few scalar ops on ``/job:ps/task:0`` (read of the
    global step, an ``assign_add``, a two-element ``scatter_add`` and
    ``scatter_max``) placed in the PS partition of the step: no extra round
    trip; atomic policies add one lock acquisition on the PS.

    Args:
      cluster_resolver: any ``tf.distribute.cluster_resolver.ClusterResolver``
        with "chief", "ps" and "worker" jobs; an "evaluator" job is left out
        of the cluster TensorFlow connects to, with a warning.
      update_policy: a registered policy name (``tf_asyncps.policies.names()``)
        or a ``tf_asyncps.policies.UpdatePolicy``.
      variable_partitioner: as in ``ParameterServerStrategy``.
      max_tracked_staleness: last bin of the τ histograms (int >= 1).
      connect_timeout_s: seconds to wait for every ps and worker to accept
        connections before failing (float > 0).
      skip_nonfinite: drop (and count in ``StalenessStats.nonfinite``) any
        step whose gradients hold NaN or Inf, so the shared model never
        receives a non-finite update.

    Raises:
      TypeError: cluster_resolver is not a ClusterResolver.
      ValueError: an invalid cluster (naming the field and the fix) or policy.
      TimeoutError: a ps or worker unreachable within ``connect_timeout_s``.
    """

    def __init__(self, cluster_resolver, update_policy: Union[str, "policies_lib.UpdatePolicy"] = "async",
                 variable_partitioner=None, *, max_tracked_staleness: int = 32,
                 connect_timeout_s: float = 30.0, skip_nonfinite: bool = True):
        if not callable(getattr(cluster_resolver, "cluster_spec", None)):
            raise TypeError(
                "cluster_resolver must be a tf.distribute.cluster_resolver.ClusterResolver "
                "(e.g. tf_asyncps.cluster.cluster_resolver() for TF_CONFIG, or "
                f"LocalCluster(...).resolver()), got {cluster_resolver!r}.")
        policy = policies_lib.get(update_policy)
        if not (isinstance(connect_timeout_s, (int, float)) and connect_timeout_s > 0):
            raise ValueError(
                f"connect_timeout_s must be a number of seconds > 0, got {connect_timeout_s!r}.")
        spec = cluster_resolver.cluster_spec().as_dict()
        config = cluster_lib.validate_tf_config(
            {"cluster": spec, "task": {"type": cluster_resolver.task_type or "chief",
                                       "index": cluster_resolver.task_id or 0}})
        if config.task_type != "chief":
            raise ValueError(
                f"AsyncParameterServerStrategy runs on the chief; this task is "
                f"{config.task_type}:{config.task_id}. Start ps and worker tasks "
                "with `tf-asyncps server` (or `train`, which serves them).")
        if set(spec) - set(cluster_lib.ROLES):
            # An evaluator is no server of this cluster: connecting to it would hang.
            cluster_resolver = cluster_lib.cluster_resolver(config)
        cluster_lib.wait_for_tasks(config, connect_timeout_s)
        cluster_lib.configure_local_context(config.num_workers)
        super().__init__(cluster_resolver, variable_partitioner)
        self._tracker = StalenessTracker(max_tracked_staleness)
        old = self._extended
        self._extended = _AsyncExtended(self, cluster_resolver, variable_partitioner,
                                        policy, self._tracker)
        self._extended._retrace_functions_for_each_device = (
            old._retrace_functions_for_each_device)
        self._extended.skip_nonfinite = bool(skip_nonfinite)
        if policy.local_copies and self._extended._num_replicas_in_sync > 1:
            raise ValueError(devices.local_copies_replicas_message(
                policy.name, self._extended._num_replicas_in_sync))
        policy.build(config.num_workers, PS_DEVICE)
        install_optimizer_hooks()
        mixed_precision.allow_loss_scaling()
        # Model.fit and user code get this coordinator (one per strategy).
        coordinator = _AsyncCoordinator(self)
        if policy.local_copies:
            policy.attach(self, self._tracker)  # needs the coordinator
        if hasattr(policy, "set_pending_probe"):
            policy.set_pending_probe(coordinator.has_queued_closures)
        logging.info("AsyncParameterServerStrategy: %d worker(s), %d ps, policy %r",
                     config.num_workers, config.num_ps, policy)

    @property
    def update_policy(self) -> "policies_lib.UpdatePolicy":
        """The UpdatePolicy object in use."""
        return self._extended.policy

    @property
    def gpus_per_worker(self) -> int:
        """GPUs each worker task has (0: CPU workers); with K > 1 every worker
        step runs K replicas (``num_replicas_in_sync``) and makes one update."""
        return int(self._extended._num_gpus_per_worker)

    @property
    def staleness_tracker(self) -> StalenessTracker:
        return self._tracker

    def staleness_stats(self) -> StalenessStats:
        """Reads the staleness counters from the PS.

        A direct read of three small PS variables: it does not wait for
        scheduled steps (no ``coordinator.join``), so it can be polled while
        training runs.
        """
        stats = self._tracker.stats()
        acct = self._cluster_coordinator.accounting
        return dataclasses.replace(stats, retried_closures=acct.retried_closures,
                                   worker_failures=sum(acct.worker_failures))

    def closures_done_per_worker(self) -> List[int]:
        """Closures each worker completed (chief-side count, list of ints by
        worker index). A worker that failed and rejoined resumes counting."""
        return self._cluster_coordinator.accounting.closures_done

    def reset_staleness_stats(self) -> None:
        """Zeroes the histograms and counters; the global step is kept."""
        self._tracker.reset()
        self._cluster_coordinator.accounting.reset()

    def experimental_distribute_dataset(self, dataset, options=None):
        if _called_from_keras3():
            raise NotImplementedError(KERAS3_FIT_MESSAGE)
        return super().experimental_distribute_dataset(dataset, options)
