"""The worker step: where a gradient meets the update policy on its way to the PS.

Data flow of one worker step (``model.fit`` or ``coordinator.schedule``)::

    strategy.run(step_fn)                       # tf_keras train_function
      -> _AsyncExtended._call_for_each_replica  # tf_asyncps/strategy.py
      -> PolicyEngine.worker_step               # tf_asyncps/core/engine.py
         r = g.read()            (on the PS, before any variable is read)
         with WorkerStep(r):  step_fn(...)
            forward + backward on the worker
            optimizer.apply_gradients(gv)       # hooked, see install_optimizer_hooks
              -> WorkerStep.apply(...) -> PolicyEngine.apply_step
                 τ = g - r ; grads, keep = policy.update(grads, state, info)
                 keep ? optimizer update + g += 1 + histogram  :  count the drop

The optimizer hook is a thin wrapper around ``apply_gradients`` (tf_keras,
tf_keras legacy) and ``apply`` (Keras 3). Outside a worker step of an
AsyncParameterServerStrategy it calls the original method unchanged.

Wrapper optimizers: the hook acts once per step, on the outermost optimizer
called; when that one calls its inner optimizer, the inner call passes
through (``WorkerStep.apply``). tf_keras's ``LossScaleOptimizer`` overrides
``apply_gradients``, so it is hooked itself: the policy sees the unscaled
gradients it receives, and the step is counted even when its gradients are
non-finite and the inner optimizer is never called (see core/mixed_precision.py).
"""

import functools
import threading
from typing import Callable, Optional

import tensorflow as tf

from tf_asyncps.compat import mixed_precision as precision_compat
from tf_asyncps.compat import optimizers as optimizers_compat
from tf_asyncps.compat import sharded_slots
from tf_asyncps.core import grads as grads_lib
from tf_asyncps.core import table_seam
from tf_asyncps.core import trace_context

__all__ = ["WorkerStep", "current_step", "install_optimizer_hooks", "check_optimizer_scope"]

def current_step() -> Optional["WorkerStep"]:
    """The WorkerStep being traced on this thread, or None."""
    return trace_context.STEP.get()


class WorkerStep:
    """Trace-time context of one worker step (one replica's ``strategy.run``).

    Args:
      engine: the strategy's extended object (policy, tracker, lock).
      read_step: int64 scalar tensor, the global step read before the step
        reads the model variables.
      worker_index: int64 scalar tensor, the worker running the step.
    """

    def __init__(self, engine, read_step: tf.Tensor, worker_index=0):
        self.engine = engine
        self.read_step = read_step
        self.worker_index = worker_index
        self.applied = False  # whether an update was traced in this step
        self.group = None  # K > 1 replicas: the ReplicaGroup (core/gpu_replicas.py)
        self.local_state = None  # local_sgd: the TracedStep (core/local_copies.py)
        self._applying = False
        self._updated_by = None  # the optimizer of the step's update, once made

    @property
    def applying(self) -> bool:
        """Whether the step's update (policy, optimizer) is being traced."""
        return self._applying

    def active(self):
        """Context in which this is :func:`current_step`; the step around it
        is current again on exit."""
        return trace_context.entered(trace_context.STEP, self)

    def apply(self, optimizer, grads_and_vars, apply_fn: Callable):
        """Applies one step's gradients through the policy.

        Args:
          optimizer: the optimizer whose hooked method was called.
          grads_and_vars: iterable of (gradient, variable); None gradients are
            passed through to ``apply_fn`` untouched by the policy.
          apply_fn: ``apply_fn(grads_and_vars)`` runs the optimizer's own update.

        Returns:
          int64 scalar tensor: the global step after this step.

        Raises:
          ValueError: a second update in this worker step.
        """
        if self._applying:  # a wrapper optimizer calling its inner optimizer
            return apply_fn(grads_and_vars)
        if self._updated_by is not None:
            raise ValueError(two_updates_message(self._updated_by, optimizer))
        self._updated_by = optimizer
        self._applying = True
        try:
            return self.engine.apply_step(self, optimizer, list(grads_and_vars),
                                          apply_fn)
        finally:
            self._applying = False


def two_updates_message(first, second) -> str:
    """The error for a second optimizer update in one worker step."""
    return (
        f"A worker step called an optimizer update twice ({type(first).__name__}, then "
        f"{type(second).__name__}: apply_gradients, or apply in Keras 3). Under "
        "AsyncParameterServerStrategy a worker step makes one update: τ, the global step "
        "and the update policy's counts (sync_replicas' rounds, ssp's clocks) take one "
        "update per step. Apply every gradient in one call (one optimizer over all the "
        "variables), or make each update its own step: one strategy.run per update in the "
        "scheduled function (e.g. a GAN's discriminator and generator steps).")


def check_optimizer_scope(optimizer, strategy) -> None:
    """Refuses a tf_keras optimizer created outside ``strategy``'s scope.

    Its update enters the strategy it was created under (TensorFlow's
    default one outside any scope) inside this strategy's worker step, and
    TensorFlow stops that with "Must not nest tf.distribute.Strategy scopes"
    (vanilla ParameterServerStrategy hangs).

    Raises:
      ValueError: naming the optimizer and the fix.
    """
    if optimizer is None or isinstance(optimizer, str):
        return
    own = optimizers_compat.optimizer_strategy(optimizer)
    if own is None or own is strategy:
        return
    raise ValueError(
        f"The optimizer {type(optimizer).__name__} was created outside "
        f"{type(strategy).__name__}.scope() (it belongs to {type(own).__name__}), so its "
        "update cannot run in a worker step (TensorFlow: 'Must not nest "
        "tf.distribute.Strategy scopes'). Create the optimizer inside the scope: create "
        "and compile the model inside `with strategy.scope():`, e.g. `with "
        "strategy.scope(): model = make_model(); model.compile(optimizer="
        f"{type(optimizer).__name__}(...), ...)` (or pass the optimizer by name, "
        "compile(optimizer=\"sgd\"), which compile creates in the model's scope).")


def _hook(original, adapt_args):
    @functools.wraps(original)
    def hooked(self, *args, **kwargs):
        step = current_step()
        if step is None:
            return original(self, *args, **kwargs)
        check_optimizer_scope(self, tf.distribute.get_strategy())
        grads_and_vars, rebuild = adapt_args(self, args, kwargs)
        # Before the engine's before-update hooks, which need the slots.
        variables = [v for _, v in grads_and_vars]
        sharded_slots.build_for_pending_restore(self, variables)

        def run_original(gv):
            new_args, new_kwargs = rebuild(gv)
            return original(self, *new_args, **new_kwargs)

        return step.apply(self, grads_and_vars, run_original)

    return hooked


def _gv_args(_, args, kwargs):
    """apply_gradients(grads_and_vars, *rest, **kwargs)."""
    if args:
        gv, rest = args[0], args[1:]
    else:
        gv, rest = kwargs.pop("grads_and_vars"), ()
    gv = list(gv)
    return gv, lambda new: ((list(new),) + tuple(rest), dict(kwargs))


def _keras3_apply_args(_, args, kwargs):
    """Keras 3 apply(grads, trainable_variables=None)."""
    args = list(args)
    grads = args.pop(0) if args else kwargs.pop("grads")
    tvars = args.pop(0) if args else kwargs.pop("trainable_variables", None)
    if tvars is None:
        raise ValueError(
            "Under AsyncParameterServerStrategy pass trainable_variables to "
            "optimizer.apply(grads, trainable_variables).")
    gv = list(zip(grads, tvars))

    def rebuild(new):
        new = list(new)
        return ([g for g, _ in new], [v for _, v in new]), {}

    return gv, rebuild


def _keras3_lso_apply_args(lso, args, kwargs):
    """Keras 3 LossScaleOptimizer.apply(grads, trainable_variables): it gets
    *scaled* gradients and unscales them itself. The policy sees them
    unscaled (as under tf_keras, whose LossScaleOptimizer gets unscaled
    ones); what it returns is scaled again for the LossScaleOptimizer."""
    gv, rebuild = _keras3_apply_args(None, args, kwargs)
    scale = precision_compat.loss_scale(lso)
    times = lambda g, f: None if g is None else grads_lib.scale(g, f)
    unscaled = [(times(g, 1.0 / scale), v) for g, v in gv]

    def rebuild_scaled(new):
        return rebuild([(times(g, scale), v) for g, v in new])

    return unscaled, rebuild_scaled


_installed = False
_install_lock = threading.Lock()


def install_optimizer_hooks() -> None:
    """Routes optimizer updates made inside a worker step through the policy.

    Idempotent. Hooks ``tf_keras.optimizers.Optimizer.apply_gradients``,
    ``tf_keras.optimizers.legacy.Optimizer.apply_gradients``, both tf_keras
    ``LossScaleOptimizer`` classes and Keras 3's
    ``keras.optimizers.Optimizer.apply`` (when those packages are installed),
    and tf_keras's ``SGD.update_step``, which at momentum 0 updates each
    variable in one op under this strategy (no momentum slot that two
    workers' updates interleave through:
    :func:`tf_asyncps.compat.optimizers.hook_sgd_update_step`); the class
    patches themselves live in ``tf_asyncps/compat/``.
    """
    global _installed
    with _install_lock:
        if _installed:
            return
        optimizers_compat.hook_apply_gradients(lambda original: _hook(original, _gv_args))
        optimizers_compat.hook_apply(lambda original: _hook(original, _keras3_apply_args),
                                lambda original: _hook(original, _keras3_lso_apply_args))
        optimizers_compat.hook_sgd_update_step(_under_this_strategy)
        _installed = True


def _under_this_strategy(optimizer) -> bool:
    """Whether ``optimizer`` updates under AsyncParameterServerStrategy: inside
    one of its worker steps, or created in its scope (the embedding cache's
    flush applies outside a step)."""
    if current_step() is not None:
        return True
    own = optimizers_compat.optimizer_strategy(optimizer)
    return isinstance(getattr(own, "extended", None), table_seam.StrategySeam)
