"""The update-policy protocol: every hook the engine may call, each with a default.

A policy sees the gradients of one worker step together with their staleness
τ and returns what to apply, or a decision to drop the step. In the style of
optax (``optax/_src/base.py``), its rule is two functions with explicit state:

* ``init(variables) -> state``: creates the policy's per-variable state
  (tf.Variables placed beside the model's, with :func:`tf_asyncps.policies.beside`)
  once, before the first update;
* ``update(grads, state, info) -> Decision``: a function of the step's
  gradients, its :class:`StepInfo` and the state. A plain ``(grads, keep)``
  tuple is accepted too (see :func:`as_decision`).

Per-cluster state follows the same model: ``build(num_workers, device) ->
cluster state`` creates what the policy needs once per strategy (clocks,
gates, counters on the PS) and returns it; nothing is kept on the policy
object. The strategy's engine holds what ``build`` returned and makes it
current while it traces a worker step, attaches the policy or starts its
watchdogs; a hook reads it as :attr:`UpdatePolicy.cluster`. So one policy
object can serve two strategies, each with its own clocks and gates. Outside
an engine (a policy built by hand, host-side readers such as ``ssp``'s
``clock_values()``), ``cluster`` is what the policy's latest ``build``
returned.

Everything else a policy may need is a hook declared on :class:`UpdatePolicy`
with a default that does nothing, and the engine (``tf_asyncps/core/engine.py``)
calls these hooks and nothing else: it never probes a policy with
``hasattr``. So :func:`tf_asyncps.policies.chain` can forward every hook, or
refuse a policy it cannot compose. When each hook runs:

==========================  ===============================================
hook                        called
==========================  ===============================================
``validate_cluster(n)``     before any process starts (CLI) and at build
``build(n, device)``        once, eagerly, when the strategy is created
``attach(runtime)``         once, after the strategy's coordinator exists
``init(variables)``         once per variable list, before its first update
``before_read(w)``          tracing a worker step, before it reads the model
``update(grads, s, info)``  tracing the step's update (inside the PS lock if
                            ``atomic``)
``after_step(w)``           after the step's update was applied or dropped
``step_without_update(w)``  after a step that applied no gradient (evaluate)
``variable_mode(name, ..)`` each variable created in the strategy's scope
``exchange_due(n)``         ``local_copies`` policies: at each closure start
``exchange_mark()``         ``local_copies`` policies: traced into each pull
``exchange_done(mark)``     ``local_copies`` policies: traced into each exchange
``watchdogs()``             the strategy starts them while closures run and
                            stops them when the coordinator drains
==========================  ===============================================
"""

import dataclasses
import functools
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Union

import tensorflow as tf

from tf_asyncps.core import trace_context

__all__ = ["UpdatePolicy", "StepInfo", "Decision", "Keep", "PolicyRuntime", "as_decision",
           "after_apply_of", "ClusterStates"]

#: ``True`` (always apply) or a scalar tf.bool tensor.
Keep = Union[bool, tf.Tensor]


@dataclasses.dataclass
class StepInfo:
    """What a policy knows about the worker step being applied.

    Attributes:
      tau: int64 scalar tensor, the step's staleness τ in global steps.
      read_step: int64 scalar tensor, ``r``, the global step observed before
        the worker read the variables.
      global_step: int64 scalar tensor, ``g`` just before the update.
      variables: the variables being updated, aligned with the gradients.
      worker_index: int64 scalar tensor (or 0 outside a coordinator closure).
      read_values: for policies with ``needs_read_values``: per variable, the
        value the worker step read (a PS-side copy taken when the step
        started), or None for a variable created after training began.
      finite: scalar tf.bool, all gradients finite (None when the strategy's
        non-finite guard is off). The engine already drops non-finite steps;
        policies that keep state across steps must not let them in.
    """

    tau: tf.Tensor
    read_step: tf.Tensor
    global_step: tf.Tensor
    variables: Sequence[tf.Variable]
    worker_index: Any = 0
    read_values: Optional[List[Optional[tf.Tensor]]] = None
    finite: Optional[tf.Tensor] = None


class Decision(NamedTuple):
    """What :meth:`UpdatePolicy.update` decides for one worker step.

    Attributes:
      grads: the gradients to hand to the optimizer (same structure and types
        as the ones received: tensors or IndexedSlices).
      keep: ``True`` or a scalar tf.bool: apply ``grads`` now (False: drop).
        Or a list with one such keep per variable (``route``): the variables
        whose keep holds are updated together, in one optimizer call.
      accepted: for aggregators, a scalar tf.bool: the gradient went into a
        pending update, so the step counts as applied without advancing the
        global step (when nothing else of it was applied). None for every
        other policy.
      after_apply: None, or ``after_apply() -> [ops]``, traced where the
        engine applies the update, after the optimizer's update and the
        global step's increment (inside the update lock for ``atomic``
        policies); not run when nothing is applied. An aggregator wakes the
        workers waiting for its round there, so that a woken worker reads
        the new parameters and global step.
    """

    grads: List[Any]
    keep: Union[Keep, List[Keep]]
    accepted: Optional[tf.Tensor] = None
    after_apply: Optional[Callable[[], List[Any]]] = None


def after_apply_of(decisions) -> Optional[Callable[[], List[Any]]]:
    """One ``after_apply`` running those of ``decisions`` (composites)."""
    fns = [d.after_apply for d in decisions if d.after_apply is not None]
    if not fns:
        return None
    return lambda: [op for fn in fns for op in fn()]


def as_decision(result) -> Decision:
    """A :class:`Decision` from what ``update`` returned.

    Raises:
      TypeError: neither a Decision nor a ``(grads, keep)`` pair.
    """
    if isinstance(result, Decision):
        return result
    if isinstance(result, tuple) and len(result) == 2:
        return Decision(list(result[0]), result[1])
    raise TypeError(
        f"UpdatePolicy.update must return tf_asyncps.policies.Decision(grads, keep) or "
        f"a (grads, keep) pair, got {type(result).__name__} {result!r:.200}.")


class ClusterStates:
    """What ``build`` returned, per policy object, for one strategy.

    :meth:`record` collects the states of a policy and of every policy it
    builds in turn (a chain's or a route's members); :meth:`current` makes
    them what :attr:`UpdatePolicy.cluster` returns on this thread.
    """

    def __init__(self):
        self._states: Dict[int, Any] = {}
        self._policies = []  # keeps the ids above valid

    def record(self):
        """Collects the states of the ``build`` calls made in this context."""
        return trace_context.entered(trace_context.RECORDING_STATES, self)

    def current(self):
        """Makes these states the policies' ``cluster`` on this thread."""
        around = trace_context.CLUSTER_STATES.get()
        return trace_context.entered(trace_context.CLUSTER_STATES, around + (self,))

    def _put(self, policy, state) -> None:
        self._states[id(policy)] = state
        self._policies.append(policy)

    def get(self, policy, default=None):
        return self._states.get(id(policy), default)

    def __contains__(self, policy) -> bool:
        return id(policy) in self._states


_NOT_BUILT = object()


def _recording_build(build):
    """``build`` that also records what it returned (see ClusterStates)."""

    @functools.wraps(build)
    def wrapper(self, num_workers, device):
        state = build(self, num_workers, device)
        self.__dict__["_latest_cluster"] = state
        states = trace_context.RECORDING_STATES.get()
        if states is not None:
            states._put(self, state)
        return state

    wrapper.records_cluster_state = True
    return wrapper


@dataclasses.dataclass
class PolicyRuntime:
    """What :meth:`UpdatePolicy.attach` receives, once per strategy.

    Attributes:
      strategy: the AsyncParameterServerStrategy.
      tracker: its StalenessTracker (the global step and τ counters on the PS).
      has_queued_closures: ``(waiting_workers=()) -> bool``, False only while
        the coordinator drains (``join``) with nothing queued that a worker
        outside ``waiting_workers`` (worker indices) could run: a policy that
        makes workers wait may then release them.
      num_workers: worker tasks in the cluster.
    """

    strategy: Any
    tracker: Any
    has_queued_closures: Callable[..., bool]
    num_workers: int


class UpdatePolicy:
    """Base class of asynchronous update policies: the whole protocol.

    Subclass it, override :meth:`update` (and :meth:`init` if the policy keeps
    per-variable state, :meth:`build` if it keeps per-cluster state), and
    register it with ``@tf_asyncps.policies.register("my_name")``. Every other
    hook below has a default that does nothing.

    Example::

        @tf_asyncps.policies.register("halve_when_stale")
        class HalveWhenStale(tf_asyncps.policies.UpdatePolicy):
            def update(self, grads, state, info):
                s = tf.where(info.tau > 2, 0.5, 1.0)
                return tf_asyncps.policies.Decision(
                    [tf_asyncps.policies.scale(g, s) for g in grads], True)

    Attributes:
      name: registered name (str); the class name for an unregistered policy.
      atomic: if True, the decision, the optimizer's update and the counters
        of one step run as one unit under a lock on the PS, so τ is exact at
        apply time. Policies whose rule is only correct on exact τ (dropping,
        aggregation) set it; it costs one lock acquisition per step.
      needs_read_values: if True, the engine reads each variable the step
        updates on its PS task right after the step's read step r and passes
        those reads as ``info.read_values``.
      uses_tau: False for rules that ignore τ (``async``): the engine then
        takes τ from the global step's atomic increment, exact without a lock.
      aggregates: True for rules that sum several workers' gradients into one
        update (``sync_replicas``); they cannot be chained.
      local_copies: True for rules whose workers train per-worker copies of
        some variables (``local_sgd``: all of them; a ``route`` with a part on
        local steps: that part's), see ``tf_asyncps/core/local_copies.py``:
        :meth:`variable_mode` says which, :meth:`exchange_due` decides when a
        worker exchanges with the PS, and :meth:`update` never sees them.
      updates_on_ps: False for rules under which no variable is updated on
        the PS per step (``local_sgd``): a worker step then reads nothing on
        the PS, not even the global step.
    """

    name: str = "UpdatePolicy"
    atomic: bool = False
    needs_read_values: bool = False
    uses_tau: bool = True
    aggregates: bool = False
    local_copies: bool = False
    updates_on_ps: bool = True

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "name" not in vars(cls):  # register() sets the registered name
            cls.name = cls.__name__
        build = vars(cls).get("build")
        if build is not None and not getattr(build, "records_cluster_state", False):
            cls.build = _recording_build(build)

    @property
    def cluster(self) -> Any:
        """This policy's per-cluster state: what :meth:`build` returned for
        the strategy whose engine is tracing, attaching or starting
        watchdogs on this thread; elsewhere, what its latest ``build``
        returned.

        Raises:
          RuntimeError: the policy was never built.
        """
        for states in reversed(trace_context.CLUSTER_STATES.get()):
            if self in states:
                return states.get(self)
        state = self.__dict__.get("_latest_cluster", _NOT_BUILT)
        if state is _NOT_BUILT:
            raise RuntimeError(
                f"{self!r} has no cluster state: build(num_workers, device) was not called "
                "(AsyncParameterServerStrategy calls it when it is created).")
        return state

    @property
    def built(self) -> bool:
        """Whether :meth:`build` ran (for this strategy, inside its engine)."""
        try:
            self.cluster
        except RuntimeError:
            return False
        return True

    # -- set-up (chief, eager) -------------------------------------------------
    def validate_cluster(self, num_workers: int) -> None:
        """Raises ValueError if the policy cannot work with ``num_workers``
        workers (checked before any process starts). Default: any count."""

    def build(self, num_workers: int, device: str) -> Any:
        """Creates the per-cluster state on the PS ``device`` (called once
        per strategy, eagerly, when it is created) and returns it; hooks read
        it back as :attr:`cluster`. Default: no state.

        Args:
          num_workers: worker tasks in the cluster (int >= 1).
          device: the PS device of the global step (str).

        Returns:
          Any value (tf.Variables, queues, gates); ``()`` for none.
        """
        del num_workers, device
        return ()

    def attach(self, runtime: PolicyRuntime) -> None:
        """Called once the strategy and its coordinator exist. Default: nothing."""

    def init(self, variables: Sequence[tf.Variable]) -> Any:
        """Creates the policy state for ``variables``; default: no state."""
        del variables
        return ()

    # -- graph side (traced into each worker step) -----------------------------
    def before_read(self, worker_index) -> List[Any]:
        """Ops a worker step runs before reading the model (e.g. a wait).
        Default: none."""
        del worker_index
        return []

    def update(self, grads: List[Any], state: Any, info: StepInfo):
        """Transforms one step's gradients.

        Args:
          grads: list of tf.Tensor or tf.IndexedSlices, aligned with
            ``info.variables``; never None.
          state: what :meth:`init` returned.
          info: the step's :class:`StepInfo`.

        Returns:
          A :class:`Decision` (or a ``(grads, keep)`` pair).
        """
        raise NotImplementedError(f"{type(self).__name__} must define update().")

    def after_step(self, worker_index) -> List[Any]:
        """Ops run once a worker step's update is applied or dropped.
        Default: none."""
        del worker_index
        return []

    def step_without_update(self, worker_index) -> List[Any]:
        """Ops run when a worker step ends without applying gradients (e.g.
        an evaluation step). Default: :meth:`after_step`."""
        return self.after_step(worker_index)

    def exchange_due(self, local_steps: tf.Tensor) -> tf.Tensor:
        """``local_copies`` policies: scalar tf.bool, whether a worker that
        has trained ``local_steps`` (int64 scalar) steps on its copy since its
        last exchange exchanges now. Default: every step."""
        return local_steps >= 1

    def variable_mode(self, name: str, trainable: bool, slot: bool) -> str:
        """The engine's mode for a variable created in the strategy's scope:
        ``"per_step"`` (on the PS, each step's gradient through :meth:`update`)
        or ``"local_copies"`` (per-worker copies, exchanged with the PS when
        :meth:`exchange_due`). As optax's ``multi_transform`` labels each
        parameter and gives each label a transformation.

        Args:
          name: the variable's name (str; a shard's, for a partitioned one).
          trainable: whether it is trainable.
          slot: whether an optimizer is creating it as a slot of a model
            variable (momentum, Adam's moments; their names contain the model
            variable's).

        Default: ``"local_copies"`` for every variable of a ``local_copies``
        policy, else ``"per_step"``.
        """
        del name, trainable, slot
        return "local_copies" if self.local_copies else "per_step"

    def exchange_mark(self) -> Optional[tf.Tensor]:
        """``local_copies`` policies that count their exchanges themselves
        (route: its local part's updates): the int64 scalar, read on the PS,
        a worker keeps when it pulls the PS copies; its next exchange's τ is
        counted from it (:meth:`exchange_done`). Default None: the global
        step (``local_sgd`` counts exchanges in it)."""
        return None

    def exchange_done(self, last_mark: tf.Tensor) -> Optional[tf.Tensor]:
        """``local_copies`` policies: traced into each exchange (and each
        push when the coordinator drains), after its deltas are added on the
        PS. ``last_mark``: int64 scalar, the mark the worker kept at its
        previous exchange or pull. A policy that counts its exchanges
        (route: its local part's count and τ histogram) returns the worker's
        new mark (int64 scalar, once its counting ops ran). Default None:
        the exchange advances the global step, τ = g before it − ``last_mark``
        (``local_sgd``)."""
        del last_mark
        return None

    # -- chief side --------------------------------------------------------------
    def watchdogs(self) -> Sequence[Any]:
        """The :class:`tf_asyncps.core.watchdog.Watchdog` threads this policy
        needs on the chief while closures run (waits with timeouts). The
        strategy starts them when closures are scheduled, stops them when
        the coordinator drains, and raises their ``timeout_error`` from
        ``join``. Default: none."""
        return ()

    def get_config(self) -> dict:
        """Every constructor argument (``type(p)(**p.get_config())`` makes an
        equal policy), for logs and metrics.json."""
        return {}

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.get_config().items())
        return f"{type(self).__name__}({args})"


UpdatePolicy.build = _recording_build(UpdatePolicy.build)
