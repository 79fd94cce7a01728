"""The update-policy API: a small gradient transformation with explicit state.

A policy sees the gradients of one worker step together with their staleness τ
and returns what to apply, or a decision to drop the step. In the style of
optax, a policy is two functions and its state is explicit:

* ``init(variables) -> state``: creates the policy's state (tf.Variables are
  placed on the PS next to the model) once, before the first update.
* ``update(grads, state, info) -> (grads, keep)``: a pure function of the
  step's gradients, its :class:`StepInfo` and the state; ``keep`` is a Python
  ``True`` or a scalar ``tf.bool`` tensor (False: drop the whole step).

Policies compose with :func:`tf_asyncps.policies.chain`.
"""

import dataclasses
from typing import Any, List, Optional, Sequence, Tuple, Union

import tensorflow as tf

__all__ = ["UpdatePolicy", "StepInfo", "Keep"]

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


class UpdatePolicy:
    """Base class of asynchronous update policies.

    Subclass it, set ``name`` and override :meth:`update` (and :meth:`init` if
    the policy keeps state); register it with
    ``@tf_asyncps.policies.register("my_name")``.

    Attributes:
      name: registered name (str).
      atomic: if True, the decision, the optimizer's update and the counters
        of one step run as one unit under a lock on the PS, so τ is exact at
        apply time. Policies whose rule is only correct on exact τ (dropping,
        aggregation) set it; it costs one lock acquisition per step.
      needs_read_values: if True, the strategy keeps a PS-side copy of the
        trainable variables per worker, taken when each step starts, and
        passes it as ``info.read_values`` (costs one PS-local copy per step).
      uses_tau: False for rules that ignore τ (``async``): the engine then
        takes τ from the global step's atomic increment, exact without a lock.
      local_copies: if True, workers train per-worker copies of the variables
        and the policy exchanges them with the PS (``local_sgd``; see
        tf_asyncps/policies/local_sgd.py for the hooks it must provide).
    """

    name: str = "base"
    atomic: bool = False
    needs_read_values: bool = False
    uses_tau: bool = True
    local_copies: bool = False

    def validate_cluster(self, num_workers: int) -> None:
        """Raises ValueError if the policy cannot work with ``num_workers``
        workers (checked before any process starts). Default: any count."""

    def build(self, num_workers: int, device: str) -> None:
        """Creates per-cluster resources on the PS (called once, eagerly, by
        the strategy). Default: nothing."""

    def before_read(self, worker_index) -> List[Any]:
        """Ops a worker step runs before reading the model (e.g. a wait).
        Called while tracing the step. Default: none."""
        del worker_index
        return []

    def after_step(self, worker_index) -> List[Any]:
        """Ops run once a worker step's update is applied or dropped.
        Default: none."""
        del worker_index
        return []

    def step_without_update(self, worker_index) -> List[Any]:
        """Ops run when a worker step ends without applying gradients (e.g.
        an evaluation step). Default: :meth:`after_step`."""
        return self.after_step(worker_index)

    def init(self, variables: Sequence[tf.Variable]) -> Any:
        """Creates the policy state for ``variables``; default: no state."""
        del variables
        return ()

    def update(self, grads: List[Any], state: Any,
               info: StepInfo) -> Tuple[List[Any], Keep]:
        """Transforms one step's gradients.

        Args:
          grads: list of tf.Tensor or tf.IndexedSlices, aligned with
            ``info.variables``; never None.
          state: what :meth:`init` returned.
          info: the step's :class:`StepInfo`.

        Returns:
          ``(grads, keep)``: the gradients to hand to the optimizer (same
          structure and types) and whether to apply them. An aggregator may
          return ``(grads, keep, accepted)``: a gradient not applied now but
          ``accepted`` into a pending update is counted as applied without
          advancing the global step.
        """
        raise NotImplementedError

    def get_config(self) -> dict:
        """The constructor arguments, for logs and metrics.json."""
        return {}

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.get_config().items())
        return f"{type(self).__name__}({args})"
