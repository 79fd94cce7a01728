"""The policy engine: one per strategy; each variable in one mode, each step by stage.

The strategy's ``extended`` object (tf_asyncps/strategy.py) hands it each
worker step; the optimizer hook (core/step.py) hands it each step's
gradients. As optax's ``multi_transform`` gives each parameter a label and
each label a transformation, the engine gives each variable created in the
strategy's scope a mode, which the policy picks (``variable_mode``):

* per step: on the PS; each step's gradient goes through the policy's
  ``update`` (τ, keep or drop) and the optimizer, on the ps (core/update.py);
* local copies: each worker trains its own copy and exchanges its delta with
  the PS when the policy's ``exchange_due`` says so (core/local_copies.py).

``local_sgd`` puts every variable on local copies (a step holds no PS op);
``route(sparse="async", dense=LocalSteps(k))`` the dense part. For one
worker step::

    worker_step:  before_read(w); r = g.read()           (on the PS; not under local_sgd)
                  local-copy variables pointed at the worker's copies
                  forward, backward on the worker
    apply_step:   core/update.py: gradients to the ps -> StepPlan; the
                  decision applied (gated / cond / locked); update hooks

K-replica workers join their replicas first (core/gpu_replicas.py). The
engine calls the policy's hooks (core/protocol.py) and nothing else of it.
"""

import contextlib
from typing import Optional

import tensorflow as tf
from absl import logging

from tf_asyncps.compat import graph as graph_compat
from tf_asyncps.compat import optimizers as optimizers_compat
from tf_asyncps.compat import tf_keras as tf_keras_compat
from tf_asyncps.core import placement, table_seam
from tf_asyncps.core import update as update_lib
from tf_asyncps.core.local_copies import LocalCopies
from tf_asyncps.core.locking import PSLock, run_collecting_ops
from tf_asyncps.core.protocol import ClusterStates, PolicyRuntime
from tf_asyncps.core.step import WorkerStep

__all__ = ["PolicyEngine", "worker_index"]


def worker_index() -> tf.Tensor:
    """The current worker's index (int64 scalar) inside a scheduled closure, else 0."""
    if graph_compat.inside_function():
        # Read in the scheduled function's own graph: TF does not feed a
        # call-time capture made inside a cond in a while body, which is
        # where tf_keras runs the step when steps_per_execution > 1.
        with graph_compat.outermost_graph().as_default():
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
      wire_dtype: None or tf.bfloat16, the dtype float32 gradients cross to
        the ps in (``AsyncParameterServerStrategy(wire_dtype=...)``).
    """

    def __init__(self, policy, tracker, num_workers: int, skip_nonfinite: bool,
                 is_locking, lock_timeout, wire_dtype=None):
        self.policy = policy
        self.tracker = tracker
        self.num_workers = num_workers
        self.skip_nonfinite = bool(skip_nonfinite)
        self.wire_dtype = wire_dtype
        self._is_locking = is_locking
        self._lock_timeout = lock_timeout
        self.local = LocalCopies(policy, skip_nonfinite) if policy.local_copies else None
        self.lock: Optional[PSLock] = None
        self.strategy = None
        self.cluster_states: Optional[ClusterStates] = None  # see build()
        self._policy_state = {}
        self._trainable = []  # trainable variables created under the scope
        self._warned = set()  # optimizers already warned about dense table updates
        self.tables = table_seam.Tables()  # see register_table

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
        if self.uses_local_copies:
            self.local.attach(strategy, self.tracker)
        with self.policy_scope():
            self.policy.attach(PolicyRuntime(strategy, self.tracker, has_queued_closures,
                                             self.num_workers))

    # -- variables ------------------------------------------------------------
    def track_variable(self, var, trainable: bool) -> None:
        """Remembers a variable created in the strategy's scope."""
        if trainable:
            self._trainable.append(var)
        if self.uses_local_copies:  # local copies, if its mode says so
            self.local.add_variable(var, trainable)

    # -- modes: what the policy picked ---------------------------------------------
    @property
    def uses_local_copies(self) -> bool:
        """Whether the policy puts any variable in the local-copies mode
        (``local_sgd``; a route with a part on local steps)."""
        return self.local is not None

    @property
    def all_local(self) -> bool:
        """Whether every variable is on local copies (``local_sgd``): a worker
        step then holds no PS op."""
        return self.uses_local_copies and not self.policy.updates_on_ps

    def trains_locally(self, var) -> bool:
        """Whether ``var`` (a variable created in the scope, or a shard of
        one) is in the local-copies mode: each worker trains its own copy."""
        return self.uses_local_copies and self.local.holds(var)

    def register_table(self, hooks) -> None:
        """Registers a table's hooks (a ``core.table_seam.TableHooks``): run
        around each update of a step holding one of its variables
        (core/update.py), asked which gradient rows stay on the ps, and its
        guards handed to the local copies where they exist.

        Raises:
          TypeError: ``hooks`` is not a TableHooks.
        """
        self.tables.register(hooks)
        if self.uses_local_copies:  # a dynamic table's passes at the exchanges
            for var, guard in hooks.local_guards:
                self.local.guard_rows(var, guard)

    # -- the worker step ------------------------------------------------------
    def worker_step(self, fn, index=worker_index):
        """``fn`` (one replica's step) wrapped as a worker step.

        ``index()`` gives the worker's index (int64 scalar tensor); inside a
        scheduled closure the default reads it from the coordinator.
        """
        if self.all_local:
            return self.local.worker_step(self, fn, index)  # local_sgd: no PS op

        @tf.autograph.experimental.do_not_convert
        def step_fn(*a, **kw):
            w = index()
            r = self.read_point(w)
            step = WorkerStep(self, r, w)
            # A route with a part on local steps: its variables on their copies.
            traced = self.local.trace(step) if self.uses_local_copies else None
            try:
                # Every op of the step, variable reads included, runs after r is read.
                with tf.control_dependencies([r]), step.active():
                    out, ops = run_collecting_ops(lambda: fn(*a, **kw))
            finally:
                if traced is not None:
                    traced.undo()
            if traced is not None:
                self.local.traced()
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
        written = {id(h) for h in graph_compat.resources_written(ops)}
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
        60 gradients came in late (τ = 1) in test_sync_replicas's straggler test."""
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
            if not self.uses_local_copies:
                return 0
            with self.policy_scope():  # a route counts its local part's pushes
                return self.local.flush()
        finally:
            self.stop_watchdogs()  # also when the push fails

    # -- the update -------------------------------------------------------------
    #: The update's stages (tf_asyncps/core/update.py): gradients to the ps,
    #: the decision applied, the hooks. Called by the optimizer hook.
    apply_step = update_lib.apply_step

    #: A sparse gradient on a variable with at least this many rows is a table.
    LARGE_TABLE_ROWS = update_lib.LARGE_TABLE_ROWS

    def _can_gate(self, optimizer, variables) -> bool:
        """Whether each variable's update of this optimizer can be gated on
        its own ps (core/nonfinite_guard.py): the strategy's ``extended.update``
        gates, and the optimizer is a tf_keras, legacy tf_keras or Keras 3
        one whose every write of a step goes through it (no EMA, no Keras 3
        gradient accumulation or overwrite-with-gradient variables)."""
        extended = tf.distribute.get_strategy().extended
        if not (isinstance(extended, table_seam.StrategySeam) and extended.gates_updates):
            return False
        keras3 = optimizers_compat.optimizer_class()
        families = tf_keras_compat.optimizer_classes() + ((keras3,) if keras3 else ())
        if not isinstance(optimizer, families) or getattr(optimizer, "use_ema", False):
            return False
        if getattr(optimizer, "gradient_accumulation_steps", None):
            return False
        return not any(getattr(v, "overwrite_with_gradient", False) for v in variables)
