"""The policy engine: τ, the policy's decision, apply or drop, the counters.

One :class:`PolicyEngine` per strategy. The strategy's ``extended`` object
(tf_asyncps/strategy.py) hands it each worker step; the optimizer hook
(core/step.py) hands it each step's gradients. For one worker step::

    worker_step:  before_read(w); r = g.read()                     (on the PS)
                  forward, backward on the worker
    apply_step:   gradients copied to the PS (variable's device)
                  [PS lock]  g_now = g.read();  τ = g_now − r
                  Decision(grads, keep, accepted) = policy.update(grads, state, info)
                  keep:      optimizer update; g += 1; histogram[τ] += 1
                  accepted:  counted applied, g unchanged (aggregator's round)
                  else:      dropped_histogram[τ] += 1 (loss scale adjusted)
                  [release]  after_step(w)

A kept step under the non-finite check is gated per variable instead, each
``tf.cond`` on the variable's own ps task (core/nonfinite_guard.py), and counted
without a cond (``StalenessTracker.record_gated``).

Everything after the copy runs on the PS in the step's PS partition: no extra
worker<->PS round trip. ``local_copies`` policies take another path
(core/local_copies.py) and K-replica workers join their replicas first
(core/gpu_replicas.py). The engine calls the policy's hooks
(core/protocol.py) and nothing else of it.
"""

import contextlib
from typing import Optional

import tensorflow as tf
from absl import logging

from tf_asyncps.compat import keras as keras_compat
from tf_asyncps.compat import tensorflow as tf_compat
from tf_asyncps.compat import tf_keras as tf_keras_compat
from tf_asyncps.core import grads as grads_lib
from tf_asyncps.compat import tensorflow_variables as variables_compat
from tf_asyncps.core import gpu_replicas, mixed_precision, nonfinite_guard, placement
from tf_asyncps.core.local_copies import LocalCopies
from tf_asyncps.core.locking import PSLock, run_collecting_ops
from tf_asyncps.core.protocol import ClusterStates, PolicyRuntime, StepInfo, as_decision
from tf_asyncps.core.step import WorkerStep

__all__ = ["PolicyEngine", "worker_index"]


def worker_index() -> tf.Tensor:
    """The current worker's index (int64 scalar) inside a scheduled closure, else 0."""
    if tf_compat.inside_function():
        # Read in the scheduled function's own graph: TF does not feed a
        # call-time capture made inside a cond in a while body, which is
        # where tf_keras runs the step when steps_per_execution > 1.
        with tf_compat.outermost_graph().as_default():
            try:
                return tf.cast(
                    tf.distribute.coordinator.experimental_get_current_worker_index(), tf.int64)
            except RuntimeError:
                pass
    return tf.constant(0, tf.int64)


class PolicyEngine:
    """Runs one policy over every worker step of a strategy.

    Args:
      policy: the UpdatePolicy.
      tracker: the StalenessTracker (global step, τ counters on the PS).
      num_workers: worker tasks.
      skip_nonfinite: drop steps whose gradients hold NaN/Inf.
      is_locking: ``optimizer -> bool``, whether an optimizer asks for the lock;
        ``lock_timeout``: ``optimizer -> seconds``.
    """

    def __init__(self, policy, tracker, num_workers: int, skip_nonfinite: bool,
                 is_locking, lock_timeout):
        self.policy = policy
        self.tracker = tracker
        self.num_workers = num_workers
        self.skip_nonfinite = bool(skip_nonfinite)
        # None or tf.bfloat16: the dtype float32 gradients cross to the ps in
        # (AsyncParameterServerStrategy(wire_dtype=...)).
        self.wire_dtype = None
        self._is_locking, self._lock_timeout = is_locking, lock_timeout
        self.local = LocalCopies(policy, skip_nonfinite) if policy.local_copies else None
        self.lock: Optional[PSLock] = None
        self.strategy = None
        self.cluster_states: Optional[ClusterStates] = None  # see build()
        self._policy_state = {}
        self._trainable = []  # trainable variables created under the scope
        self._warned = set()  # optimizers already warned about dense table updates
        self._after_update = []  # see add_after_update
        self._gradient_filters = []  # see add_gradient_filter
        self._before_update = []  # see add_before_update

    worker_index = staticmethod(worker_index)

    def build(self, device: str) -> None:
        """Builds the policy for this strategy's cluster (once, eagerly) and
        keeps what its ``build`` returned (and its members' builds) as this
        strategy's per-cluster state: the policy object keeps none, so it
        may serve another strategy too."""
        states = ClusterStates()
        with states.record():
            self.policy.build(self.num_workers, device)
        self.cluster_states = states

    def policy_scope(self):
        """Context in which the policy's hooks see this strategy's cluster
        state (``UpdatePolicy.cluster``): the strategy traces worker steps in
        it. Without :meth:`build` (a policy built by hand) the policies' own
        latest build is used."""
        if self.cluster_states is None:
            return contextlib.nullcontext()
        return self.cluster_states.current()

    def attach(self, strategy, has_queued_closures) -> None:
        """Called once the strategy's coordinator exists."""
        self.strategy = strategy
        if self.local is not None:
            self.local.attach(strategy, self.tracker)
        with self.policy_scope():
            self.policy.attach(PolicyRuntime(strategy, self.tracker, has_queued_closures,
                                             self.num_workers))

    # -- variables ------------------------------------------------------------
    def track_variable(self, var, trainable: bool) -> None:
        """Remembers a variable created in the strategy's scope."""
        if trainable:
            self._trainable.append(var)
        if self.local is not None:
            self.local.add_variable(var)

    def add_after_update(self, fn) -> None:
        """Registers ``fn(optimizer, variables, global_step) -> op or None``,
        traced after each step's update (applied or dropped), with the step's
        variables and the int64 global step after it: upkeep of state beside
        the variables, such as a dynamic table's eviction pass
        (tf_asyncps/layers/dynamic_table.py). Under the update lock
        (LockingOptimizer, atomic policies) it runs holding the lock."""
        self._after_update.append(fn)

    def add_gradient_filter(self, fn) -> None:
        """Registers ``fn(gradient, variable) -> gradient``, traced right
        before the optimizer's own update, on the variable's ps, after the
        policy's decision (an aggregator's: on the round's mean). A dynamic
        table drops there the rows evicted since the gradient was computed
        (tf_asyncps/layers/dynamic_table.py)."""
        self._gradient_filters.append(fn)

    def add_before_update(self, fn) -> None:
        """Registers ``fn(optimizer, variables) -> op or None``, traced right
        before the optimizer's own update (with the gradient filters): the
        update waits for its op. A dynamic table restored onto another number
        of shards moves its rows' optimizer slots there, once, when the
        optimizer's slots exist (tf_asyncps/layers/dynamic_reshard.py)."""
        self._before_update.append(fn)

    def _filtered(self, apply_fn, optimizer):
        """``apply_fn`` with the before-update hooks and the gradient filters
        run on its gradients."""
        if not self._gradient_filters and not self._before_update:
            return apply_fn

        def apply_filtered(grads_and_vars):
            variables = [v for g, v in grads_and_vars if g is not None]
            before = [fn(optimizer, variables) for fn in self._before_update]
            with tf.control_dependencies([op for op in before if op is not None]):
                pairs = []
                for g, v in grads_and_vars:
                    for fn in self._gradient_filters:
                        g = g if g is None else fn(g, v)
                    pairs.append((g, v))
                return apply_fn(pairs)
        return apply_filtered

    # -- the worker step ------------------------------------------------------
    def worker_step(self, fn, index=worker_index):
        """``fn`` (one replica's step) wrapped as a worker step.

        ``index()`` gives the worker's index (int64 scalar tensor); inside a
        scheduled closure the default reads it from the coordinator.
        """
        if self.local is not None:
            return self.local.worker_step(self, fn, index)

        @tf.autograph.experimental.do_not_convert
        def step_fn(*a, **kw):
            w = index()
            r = self.read_point(w)
            # Every op of the step, variable reads included, runs after r is read.
            step = WorkerStep(self, r, w)
            with tf.control_dependencies([r]), step.active():
                out, ops = run_collecting_ops(lambda: fn(*a, **kw))
            if not step.applied:
                self._warn_unhooked_update(ops)
                self.no_update(w, out)
            return out

        return step_fn

    def _warn_unhooked_update(self, ops) -> None:
        """Warns when a worker step that made no update through a hooked
        optimizer method wrote trainable variables anyway: an optimizer
        overriding ``apply_gradients`` (``apply`` in Keras 3) without calling
        the base method bypasses the policy, τ and the global step."""
        trainable = {id(v.handle): v for v in self._trainable}
        written = {id(h) for h in tf_compat.resources_written(ops)}
        names = sorted({v.name for k, v in trainable.items() if k in written})
        if names:
            logging.warning(
                "A worker step updated trainable variable(s) %s without a hooked optimizer "
                "method, so the update policy %r, τ and the global step never saw it. An "
                "optimizer that overrides apply_gradients (Keras 3: apply) must call the "
                "base class's method for AsyncParameterServerStrategy to apply its update.",
                ", ".join(names), self.policy.name)

    def _policy_hook(self):
        """Context of the policy's ``after_step``: its ops run beside their
        inputs on the ps, the others beside the tracker, where ``build`` puts
        the policy's cluster state. Unplaced, the ops that carry no device
        (ssp's clock minimum, its refill condition, constants) ran on the
        worker and the ps state they use crossed back and forth each step.
        ``before_read`` (the gate's wait) runs in it too (``read_point``); a
        woken ``sync_replicas`` worker reads at once there, so the round's
        tokens are granted only after the update and the global step's
        increment (``Decision.after_apply``): granted before them, 22-24 of
        60 gradients came in late (τ = 1) in test_aggregator's straggler test."""
        return placement.beside_inputs(self.tracker.device)

    def read_point(self, w):
        """The policy's ``before_read``, then the read step r (int64 scalar
        tensor): once per worker step."""
        # On the ps, beside the policy's state (the gate's queues): a wait
        # placed on the worker sent the policy's state to the worker and back
        # every step (docs/benchmarks.md#placement-of-a-steps-ops).
        with self._policy_hook():
            before = self.policy.before_read(w)
        with tf.control_dependencies(before):
            return self.tracker.read_step()

    def no_update(self, w, out) -> None:
        """Tells the policy a worker step made no update (e.g. an evaluation
        step), after the step's outputs exist."""
        with tf.control_dependencies(
                [t for t in tf.nest.flatten(out) if isinstance(t, tf.Tensor)]):
            self.policy.step_without_update(w)

    def _state_for(self, variables):
        key = tuple(id(v) for v in variables)
        if key not in self._policy_state:
            with tf.init_scope():
                if tf.distribute.has_strategy():  # fit() called inside scope()
                    self._policy_state[key] = self.policy.init(list(variables))
                else:
                    with self.strategy.scope():
                        self._policy_state[key] = self.policy.init(list(variables))
        return self._policy_state[key]

    # -- watchdogs and errors ---------------------------------------------------
    def watchdogs(self) -> list:
        """Every chief-side watchdog: the update lock's and the policy's."""
        with self.policy_scope():
            policy_dogs = list(self.policy.watchdogs())
        return ([self.lock] if self.lock is not None else []) + policy_dogs

    def start_watchdogs(self) -> None:
        for w in self.watchdogs():
            w.start()

    def stop_watchdogs(self) -> None:
        for w in self.watchdogs():
            w.stop()

    def timeout_error(self) -> Optional[str]:
        """The message of a lock or policy wait that timed out, else None."""
        return next((w.timeout_error for w in self.watchdogs() if w.timeout_error), None)

    def drained(self) -> int:
        """The coordinator drained: push local copies (``local_sgd``), stop
        the watchdogs. Returns the local steps pushed."""
        try:
            return self.local.flush() if self.local is not None else 0
        finally:
            self.stop_watchdogs()  # also when the push fails

    # -- the update -------------------------------------------------------------
    def apply_step(self, step: WorkerStep, optimizer, grads_and_vars, apply_fn):
        """Applies one worker step's gradients under the update policy.

        Args:
          step: the WorkerStep (holds the read step r and the worker index).
          optimizer: the optimizer being called; a LockingOptimizer makes the
            whole step one locked unit.
          grads_and_vars: list of (gradient or None, variable).
          apply_fn: runs the optimizer's own update on a grads_and_vars list.

        Returns:
          int64 scalar tensor: the global step after this step (local copies:
          the worker's local steps since its last exchange).
        """
        keras_compat.make_iterations_atomic(optimizer)
        if step.group is not None and not tf.distribute.in_cross_replica_context():
            return gpu_replicas.apply_replicated(self, step, optimizer, grads_and_vars, apply_fn)
        marked = self._is_locking(optimizer)
        if step.local_state is not None:
            mixed_precision.check_local_copies(self.policy, optimizer)
            return self.local.apply(step, grads_and_vars, apply_fn, marked, optimizer)
        locking = self.policy.atomic or marked
        apply_fn = self._filtered(apply_fn, optimizer)
        pairs = [(grads_lib.rows_on_ps(g), v) for g, v in grads_and_vars if g is not None]
        if not pairs:
            return apply_fn(grads_and_vars)
        self._warn_dense_table_updates(optimizer, pairs)
        step.applied = True
        # Policies and aggregators work in the variables' dtype (float32 under
        # mixed precision, where tf_keras keeps float32 variables).
        grads = [grads_lib.cast(g, v.dtype) for g, v in pairs]
        keras3 = keras_compat.optimizer_class()
        if keras3 is None or not isinstance(optimizer, keras3):
            # Distinct rows only: tf_keras's optimizers sum the rows of repeated
            # ids in apply_gradients anyway, so each row crosses to the ps once
            # (docs/benchmarks.md#bytes-per-step-on-an-embedding-nameemb). Keras 3's
            # Adam and Adagrad square each repeated row on its own: its gradients
            # keep their rows.
            grads = [grads_lib.unique_rows(g) for g in grads]
        variables = [v for _, v in pairs]
        # A LossScaleOptimizer skips non-finite steps itself: always check, so
        # such a step is counted as dropped and lowers the loss scale.
        lso = mixed_precision.loss_scale_optimizer(optimizer)
        finite = grads_lib.all_finite(grads) if (self.skip_nonfinite or lso is not None) else None
        # The worker's predicate, for one cond per variable on its ps (see
        # _gated_apply) where the optimizer and the step allow it.
        gate = finite if (finite is not None and lso is None and not locking
                          and self._can_gate(optimizer, variables)) else None
        # Bring every worker-side input onto the PS first: the locked region
        # then never waits for a worker that may die, and the decision's
        # tf.cond runs entirely on the PS (measured faster).
        device = self.tracker.device
        # wire_dtype: float32 values cross as bfloat16, float32 again on the
        # ps (after the finite check above, which sees the worker's values).
        grads = [grads_lib.copy_to(g, keras_compat.backing_variable(v).device,
                                   wire_dtype=self.wire_dtype,
                                   rows=_static_rows(keras_compat.backing_variable(v)))
                 for g, v in zip(grads, variables)]
        w = grads_lib.copy_to(step.worker_index, device)
        finite = None if finite is None else grads_lib.copy_to(finite, device)
        inputs = grads_lib.flat_tensors(grads) + [w] + ([finite] if finite is not None else [])
        read_values = (self._read_values(step, variables) if self.policy.needs_read_values
                       else None)
        state = self._state_for(variables)

        def decide_and_apply():
            # Each gradient's ops on its variable's ps, τ's on the tracker's.
            with placement.beside_inputs(device):
                return self._decide_and_apply(step, grads, variables, state, w, finite,
                                              read_values, lso, apply_fn, inputs, locking,
                                              gate, optimizer)

        def after_update(g_after):
            with tf.control_dependencies([g_after]):
                ops = [fn(optimizer, variables, g_after) for fn in self._after_update]
            return [op for op in ops if op is not None]

        hooked = []
        if locking:
            # Placed on the PS: a worker that dies cannot hold the lock.
            if self.lock is None:
                self.lock = PSLock(device, self._lock_timeout(optimizer), name="update_lock",
                                   anchor=self.tracker.global_step)

            def locked():
                # The after-update hooks hold the lock too: no locked update
                # overlaps a dynamic table's eviction pass (Adam's update
                # rewrites every row's moments, which would undo its resets).
                g_after = decide_and_apply()
                with tf.control_dependencies(after_update(g_after)):
                    return tf.identity(g_after)

            g_after = self.lock.execute(locked, inputs=inputs + [step.read_step])
        else:
            # On the PS: a rule that needs τ (read on the PS) and transforms the
            # gradients would otherwise cost an extra worker<->PS round trip.
            g_after = decide_and_apply()
            hooked = after_update(g_after)
        with self._policy_hook():
            after = list(self.policy.after_step(w) or [])  # w: the worker index, copied to the ps
        after += hooked
        if after:
            with tf.control_dependencies(after):
                g_after = tf.identity(g_after)
        return g_after

    #: A sparse gradient on a variable with at least this many rows is a table.
    LARGE_TABLE_ROWS = 100_000

    def _warn_dense_table_updates(self, optimizer, pairs) -> None:
        """Warns once per optimizer whose update of a large embedding table
        touches every row each step (tf_keras SGD; Keras 3 optimizers other
        than SGD without momentum), naming the fix."""
        if id(optimizer) in self._warned:
            return
        tables = [v.name for g, v in pairs if isinstance(g, tf.IndexedSlices)
                  and v.shape.rank and (v.shape[0] or 0) >= self.LARGE_TABLE_ROWS]
        why = (tf_keras_compat.dense_on_sparse_gradients(optimizer) or
               keras_compat.dense_on_sparse_gradients(optimizer)) if tables else None
        if why:
            self._warned.add(id(optimizer))
            logging.warning("%s: %s; each step's cost grows with the table, not the "
                            "batch.", ", ".join(tables), why)

    def _read_values(self, step, variables):
        """Per variable of this step, its value when the step read r (None
        for one not created under the scope). Read on the variable's PS task
        in r's graph with only r before it, so it runs as soon as r is read,
        beside the step's own reads, not at apply time; only the step's own
        variables are read, and nothing is copied."""
        known = {id(v) for v in self._trainable}
        r = step.read_step
        graph = None if tf.executing_eagerly() else getattr(r, "graph", None)
        out = []
        with (graph.as_default() if graph is not None else contextlib.nullcontext()), \
                tf.control_dependencies([r]):
            for v in variables:
                b = mixed_precision.base_variable(v)
                if id(b) not in known:
                    out.append(None)
                    continue
                with tf.device(b.device):
                    out.append(b.read_value())
        return out

    def _can_gate(self, optimizer, variables) -> bool:
        """Whether each variable's update of this optimizer can be gated on
        its own ps (core/nonfinite_guard.py): the strategy's ``extended.update``
        gates, and the optimizer is a tf_keras, legacy tf_keras or Keras 3
        one whose every write of a step goes through it (no EMA, no Keras 3
        gradient accumulation or overwrite-with-gradient variables)."""
        if not getattr(tf.distribute.get_strategy().extended, "gates_updates", False):
            return False
        keras3 = keras_compat.optimizer_class()
        families = tf_keras_compat.optimizer_classes() + ((keras3,) if keras3 else ())
        if not isinstance(optimizer, families) or getattr(optimizer, "use_ema", False):
            return False
        if getattr(optimizer, "gradient_accumulation_steps", None):
            return False
        return not any(getattr(v, "overwrite_with_gradient", False) for v in variables)

    def _gated_apply(self, step, decision, variables, gate, finite, tau, tau_from_increment,
                     apply_fn, optimizer):
        """Applies a kept step with each variable's update gated by ``gate``
        (the worker's finite check) on its own ps, the optimizer's counter
        advanced by it, and the counters recorded without a cond."""
        pairs = [(decision.grads[i], v) for i, v in enumerate(variables)]
        with tf.init_scope():  # legacy optimizers create them on first use
            counter = optimizer.iterations
            lr = getattr(optimizer, "learning_rate", None)
        hoisted = [keras_compat.backing_variable(h) for h in (lr, counter)]
        hoisted = [h for h in hoisted if isinstance(h, tf.Variable)]
        with nonfinite_guard.guarded_by(gate, hoisted) as gated, \
                variables_compat.adding_only_if(counter, finite):
            _, update_ops = run_collecting_ops(apply_fn, pairs)
        missed = [v.name for v in variables
                  if id(v) not in gated and id(keras_compat.backing_variable(v)) not in gated]
        if missed:
            raise RuntimeError(
                f"{type(optimizer).__name__} updated {missed} without the strategy's "
                "extended.update, so a step with NaN/Inf gradients could not be dropped "
                "there; pass skip_nonfinite=False to AsyncParameterServerStrategy or "
                "update through extended.update.")
        with tf.control_dependencies(placement.one_per_device(update_ops)):
            return self.tracker.record_gated(step.read_step, finite,
                                             None if tau_from_increment else tau)

    def _decide_and_apply(self, step, grads, variables, state, w, finite, read_values,
                          lso, apply_fn, inputs, locking, gate=None, optimizer=None):
        tracker, policy = self.tracker, self.policy
        # g is read once the gradients exist: τ covers the whole step.
        # Without the lock and with a rule that ignores τ, τ comes from the
        # atomic increment itself (every update gets its own g), and this
        # read waits for nothing (each wait on a gradient was a message from
        # its ps task).
        tau_from_increment = not locking and not policy.uses_tau
        with tf.control_dependencies([] if tau_from_increment else inputs):
            g_now = tracker.read_step()
        tau = g_now - step.read_step
        info = StepInfo(tau=tau, read_step=step.read_step, global_step=g_now,
                        variables=variables, worker_index=w, read_values=read_values,
                        finite=finite)
        decision = as_decision(policy.update(list(grads), state, info))
        groups = _keep_groups(decision.keep, len(variables), finite)

        def applied(indices):
            # The counters move only after every op of the optimizer's update:
            # optimizers leave their variable updates unordered with respect
            # to each other and to their return value.
            pairs = [(decision.grads[i], variables[i]) for i in indices]
            _, update_ops = run_collecting_ops(apply_fn, pairs)
            with tf.control_dependencies(placement.one_per_device(update_ops)):
                if tau_from_increment:
                    g_after = tracker.record_increment(step.read_step)
                else:
                    g_after = tracker.record(tau, applied=True)
            if decision.after_apply is None:
                return g_after
            with tf.control_dependencies([g_after]):  # e.g. wake a round's workers
                woken = decision.after_apply()
            with tf.control_dependencies(woken):
                return tf.identity(g_after)

        def dropped():
            # The LossScaleOptimizer is not called: adjust its scale here, from
            # the step's own gradients (lowered if they are not finite).
            scale_ops = [] if lso is None else mixed_precision.update_loss_scale(lso, grads)
            with tf.control_dependencies(scale_ops):
                return tracker.record(
                    tau, applied=False,
                    nonfinite=None if finite is None else tf.logical_not(finite))

        nothing_applied = dropped
        if decision.accepted is not None:  # an aggregator: accepted, update pending
            def nothing_applied():
                return tf.cond(decision.accepted,
                               lambda: tracker.record(tau, applied=True, increment=0),
                               dropped)

        if gate is not None and decision.accepted is None and decision.after_apply is None \
                and all(k is True for k in (decision.keep if isinstance(decision.keep, (list, tuple))
                                            else [decision.keep])):
            return self._gated_apply(step, decision, variables, gate, finite, tau,
                                     tau_from_increment, apply_fn, optimizer)

        def choose(j, chosen):
            # One optimizer call for the kept parts together (route: one keep
            # per part), so the step advances optimizer.iterations once. The
            # branch keeping every part is traced first: the optimizer builds
            # its slots for all the variables.
            if j == len(groups):
                return applied(chosen) if chosen else nothing_applied()
            keep, indices = groups[j]
            if keep is True:
                return choose(j + 1, chosen + indices)
            return tf.cond(keep, lambda: choose(j + 1, chosen + indices),
                           lambda: choose(j + 1, chosen))

        return choose(0, [])


def _static_rows(var):
    """A variable's static number of rows, or None (a scalar, an unknown shape)."""
    shape = var.shape
    return shape[0] if shape.rank and shape[0] is not None else None


def _keep_groups(keep, n, finite):
    """``[(keep, variable indices)]``: one group for a step-wide keep, one per
    distinct keep for a per-variable list (route). Each keep is ANDed with
    ``finite``: a non-finite step is never applied."""
    if not isinstance(keep, (list, tuple)):
        keep = [keep] * n
    elif len(keep) != n:
        raise ValueError(f"Decision.keep has {len(keep)} entries for {n} variables; give "
                         "one keep for the step or one per variable.")
    groups = {}
    for i, k in enumerate(keep):
        groups.setdefault(id(k) if k is not True else True, (k, []))[1].append(i)
    out = []
    for k, indices in groups.values():
        if finite is not None:
            k = finite if k is True else tf.logical_and(k, finite)
        out.append((k, indices))
    return out
