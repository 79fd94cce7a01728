"""``local_sgd``: each worker trains a local copy and pushes its delta.

Rule: every worker keeps its own copy x_w of the model (and of the
optimizer's and metrics' variables) on its own device and trains it with no
parameter-server traffic per step. Once it has taken ``sync_every`` or more
steps since its last exchange, it exchanges with the PS:

    Δ_w = x_w − a_w          (a_w: the copy it last received from the PS)
    x_ps ← x_ps + Δ_w        (one assign_add per variable, on the PS)
    x_w, a_w ← x_ps          (read back the merged model)

This is Downpour SGD's n_push/n_fetch windows (Dean et al., NIPS 2012) and
local SGD / periodic averaging (Stich, "Local SGD Converges Fast and
Communicates Little", ICLR 2019), in its asynchronous form: workers exchange
whenever they reach their window, never waiting for each other. With one
worker it is exactly sequential training (Δ is the sum of its own updates).

Staleness is counted in exchanges: the global step g advances once per
exchange, τ = g just before the exchange − g at the worker's previous
exchange. ``StalenessStats.applied`` counts exchanges and
``StalenessStats.local_steps`` the worker steps trained on local copies.

Data flow. For every numeric variable created in the strategy's scope the
strategy makes two TF per-worker variables (``per_worker_variable``: each
worker holds its own): the local copy and the anchor a_w. While it traces a
worker step it points the variable at the local copy, so the step reads and
updates only worker memory. The exchange check runs at the start of each
scheduled closure (once, outside fit's ``steps_per_execution`` loop: a PS op
inside the loop would cost a PS round trip per iteration). Outside worker
steps (the chief: ``get_weights``, ``model.save``, checkpoints) the variable
is the PS copy, made current when the coordinator drains (``join``, e.g. at
the end of every ``fit`` epoch): the chief pushes what each worker trained
since its last exchange, and every worker pulls the PS copy at its next
closure, so chief-side changes (``set_weights``, metric resets) reach them.

Use ``steps_per_execution`` = ``sync_every`` (or a divisor of it): the check
runs once per closure, so an exchange happens at the first closure start
after ``sync_every`` steps. Sharded variables are not supported. Metrics that
``fit``/``evaluate`` print come from one worker's copy (partial between
drains); the PS values are exact after each drain.
"""

import functools
import threading
import weakref
from typing import List

import tensorflow as tf
from tensorflow.python.distribute import ps_values
from tensorflow.python.ops import gen_resource_variable_ops, resource_variable_ops

from tf_asyncps.core import step as step_lib
from tf_asyncps.policies import registry
from tf_asyncps.policies.base import UpdatePolicy

__all__ = ["LocalSteps"]


class _Copies:
    """The per-worker local copy and anchor of one PS variable."""

    def __init__(self, master, strategy):
        self.master = master
        # ParameterServerStrategy wraps its variables (CachingVariable); the
        # handle to swap is the wrapped ResourceVariable's.
        self.inner = master.get() if isinstance(master, ps_values.CachingVariable) else master
        self.handle = self.inner.handle  # the PS handle, kept while swapped
        self.dtype = master.dtype
        # A restarted worker re-creates its copies from this value and then
        # pulls the PS copy (its ``fresh`` flag is re-created False).
        try:
            init = tf.identity(master.read_value())
        except (tf.errors.OpError, ValueError):  # lifted initializer not run yet
            init = tf.zeros(master.shape, master.dtype)
        self.local = _per_worker_variable(strategy, init, "asyncps_local")
        self.anchor = _per_worker_variable(strategy, init, "asyncps_anchor")


def _per_worker_variable(strategy, init, name):
    """A PerWorkerVariable made with TF's default creator: a tf.function's
    creator (active while a step is traced) cannot build per-worker copies."""
    creator = functools.partial(resource_variable_ops.default_variable_creator_v2, None)
    return ps_values.PerWorkerVariable(strategy, creator, initial_value=init,
                                       trainable=False, name=name)


_HANDLES = weakref.WeakKeyDictionary()  # function graph -> {id(variable): handle}


class _TracedStep:
    """Trace-time state of one local worker step: which model variables are
    pointed at their local copies, and the per-worker handles.

    Per-worker handles are call-time captures that only the step function's
    outermost graph is fed, so they are taken there; nested graphs (fit's
    ``steps_per_execution`` loop) capture them from it like any tensor.
    """

    def __init__(self, policy):
        self.top = _outermost_graph()
        self.since = self._handle(policy._since)
        self.last_g = self._handle(policy._last_g)
        self.fresh = self._handle(policy._fresh)
        self.copies, self.local, self.anchor = [], [], []

    def _handle(self, per_worker_var):
        """One placeholder per variable and function: the step may be traced
        more than once into the same function (autograph traces a loop body
        to infer its outputs), and auto control dependencies order the
        exchange before the steps only if they use the same handle tensor."""
        cache = _HANDLES.setdefault(self.top, {})
        key = id(per_worker_var)
        if key not in cache:
            with self.top.as_default():
                cache[key] = per_worker_var.handle
        return cache[key]

    def add(self, copies: List[_Copies]) -> None:
        """Points the copies' model variables at the local copies."""
        handles = [(self._handle(c.local), self._handle(c.anchor)) for c in copies]
        for c, (lh, ah) in zip(copies, handles):
            c.inner._handle = lh
            self.copies.append(c)
            self.local.append(lh)
            self.anchor.append(ah)

    def undo(self) -> None:
        for c in self.copies:
            c.inner._handle = c.handle


@registry.register("local_sgd")
class LocalSteps(UpdatePolicy):
    """Local SGD: train local copies, push deltas every ``sync_every`` steps.

    Every numeric variable created in the strategy's scope gets a local copy:
    the model's weights and, so that a step needs no PS round trip at all,
    the optimizer's slots and step counter and the metrics' accumulators.
    Deltas of all of them are pushed (sums and counters stay exact: the PS
    counter ends at the total number of steps). Metrics that ``fit`` and
    ``evaluate`` print come from one worker's copy (partial between drains);
    the PS values are exact after each drain.

    Args:
      sync_every: local worker steps between two exchanges with the PS
        (int >= 1); 1 pushes every step.

    Raises:
      ValueError: ``sync_every`` is not an int >= 1.
    """

    name = "local_sgd"
    uses_tau = False
    local_copies = True

    def __init__(self, sync_every: int = 16):
        if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1:
            raise ValueError(f"local_sgd: sync_every must be an int >= 1 (worker steps), "
                             f"got {sync_every!r}.")
        self.sync_every = sync_every
        self._copies = {}  # id(variable) -> _Copies, in creation order
        self._flush_lock = threading.Lock()
        self.strategy = None
        self.tracker = None

    def get_config(self):
        return {"sync_every": self.sync_every}

    def update(self, grads, state, info):
        del state, info
        return grads, True

    # -- set-up -----------------------------------------------------------------
    def attach(self, strategy, tracker) -> None:
        """Called by the strategy once: where per-worker state is created."""
        self.strategy = strategy
        self.tracker = tracker
        with tf.init_scope(), strategy.scope():
            self._since = tf.Variable(tf.constant(0, tf.int64), trainable=False,
                                      per_worker_variable=True, name="asyncps_since")
            self._last_g = tf.Variable(tf.constant(0, tf.int64), trainable=False,
                                       per_worker_variable=True, name="asyncps_last_g")
            # False until the worker pulls the PS copy: at its first step,
            # after a restart (variables re-created) and after each drain.
            self._fresh = tf.Variable(False, trainable=False,
                                      per_worker_variable=True, name="asyncps_fresh")

    def add_variable(self, var) -> None:
        """Creates the local copy and anchor of a PS variable.

        Called by the strategy's ``_create_variable`` for every numeric
        variable created in its scope (eagerly: Keras lifts the optimizer's
        and metrics' lazy variables out of the traced step). A variable
        created while a step is traced is used locally from that step on.

        Raises:
          ValueError: a partitioned variable.
        """
        if not (var.dtype.is_floating or var.dtype.is_integer):
            return  # e.g. bool flags: stay shared on the PS
        if not isinstance(var, tf.Variable) or "Sharded" in type(var).__name__:
            raise ValueError(
                f"local_sgd: variable {getattr(var, 'name', var)!r} of type "
                f"{type(var).__name__} cannot have a local copy; local_sgd needs "
                "unpartitioned variables (variable_partitioner=None).")
        with tf.init_scope():
            copies = _Copies(var, self.strategy)
        self._copies[id(var)] = copies
        step = step_lib.current_step()
        traced = getattr(step, "local_state", None)
        if traced is not None:
            traced.add([copies])

    # -- graph side --------------------------------------------------------------
    def begin_step(self) -> _TracedStep:
        """Points every model variable at the worker's local copy while a
        worker step is traced; call ``undo()`` on the result afterwards."""
        traced = _TracedStep(self)
        traced.add(list(self._copies.values()))
        return traced

    def start_closure(self, traced: _TracedStep) -> None:
        """Adds the exchange to the start of the closure being traced.

        The ops go into the outermost graph of the scheduled function, once
        per trace, so they run once per closure before its first step (auto
        control dependencies order them before the steps that use the local
        copies). Inside fit's ``steps_per_execution`` loop a PS op would cost
        a PS round trip on every iteration, even in an untaken branch.

        Rule, per worker: a worker that has not pulled since it started or
        since the last drain pulls the PS copy; otherwise, once it has taken
        ``sync_every`` or more steps since its last exchange, it pushes its
        delta and pulls the merged copy.
        """
        top = traced.top
        if getattr(top, "_asyncps_closure_start", False):
            return
        top._asyncps_closure_start = True
        copies, tracker, k = list(traced.copies), self.tracker, self.sync_every
        local, anchor = list(traced.local), list(traced.anchor)

        def pull(g_now):
            ops = []
            for c, lh, ah in zip(copies, local, anchor):
                with tf.device(c.handle.device):
                    new = _read(c.handle, c.dtype)
                ops += [_assign(lh, new), _assign(ah, new)]
            ops += [_assign(traced.last_g, g_now), _assign(traced.since, tf.constant(0, tf.int64)),
                    _assign(traced.fresh, tf.constant(True))]
            with tf.control_dependencies(ops):
                return tf.constant(0, tf.int64)

        def exchange():
            pushes = []
            for c, lh, ah in zip(copies, local, anchor):
                delta = _read(lh, c.dtype) - _read(ah, c.dtype)
                with tf.device(c.handle.device):
                    pushes.append(gen_resource_variable_ops.assign_add_variable_op(
                        c.handle, delta))
            with tf.control_dependencies(pushes):
                g_after = tracker.record_increment(_read(traced.last_g, tf.int64))
                counted = tracker.add_local_steps(_read(traced.since, tf.int64))
            with tf.control_dependencies([counted]):
                return pull(g_after)

        def maybe_exchange():
            return tf.cond(_read(traced.since, tf.int64) >= k, exchange,
                           lambda: tf.constant(0, tf.int64))

        with top.as_default():
            tf.cond(_read(traced.fresh, tf.bool), maybe_exchange,
                    lambda: pull(tracker.read_step()))

    def after_local_update(self, traced: _TracedStep, update_ops) -> tf.Tensor:
        """Counts one local step (a worker-local op).

        Returns:
          int64 scalar: local steps since the last exchange.
        """
        with tf.control_dependencies(update_ops):
            add = gen_resource_variable_ops.assign_add_variable_op(
                traced.since, tf.constant(1, tf.int64))
        with tf.control_dependencies([add]):
            return _read(traced.since, tf.int64)

    # -- host side ---------------------------------------------------------------
    def flush(self) -> int:
        """Pushes every worker's steps since its last exchange (on the chief).

        Called by the strategy's coordinator when it drains (``join``), so the
        PS copy holds every trained step; each worker then pulls the PS copy
        at its next closure. One compiled function for all workers (eager
        remote ops would cost one round trip each).

        Returns:
          The number of local steps pushed (int).
        """
        if self.strategy is None or not self._copies:
            return 0
        with self._flush_lock:
            since_all = _per_worker(self._since)
            if since_all is None:  # no worker step has run yet
                return 0
            copies = [c for c in self._copies.values()
                      if getattr(c.local, "_per_worker_vars", None) is not None]
            locals_ = [_per_worker(c.local) for c in copies]
            anchors = [_per_worker(c.anchor) for c in copies]
            per_worker = [(since, last, fresh,
                           [(lv[w], av[w]) for lv, av in zip(locals_, anchors)])
                          for w, (since, last, fresh) in enumerate(zip(
                              since_all, _per_worker(self._last_g), _per_worker(self._fresh)))]
            # Rebuilt when workers re-created their variables or copies were added.
            key = tuple(id(v) for _, _, _, pairs in per_worker for pair in pairs for v in pair)
            key += tuple(id(s) for s, _, _, _ in per_worker)
            if getattr(self, "_flush_key", None) != key:
                self._flush_key = key
                self._flush_fn = self._make_flush(copies, per_worker)
            return int(self._flush_fn().numpy())

    def _make_flush(self, copies, per_worker):
        tracker = self.tracker

        @tf.function(autograph=False)
        def flush_all():
            total = tf.constant(0, tf.int64)
            for since_v, last_v, fresh_v, pairs in per_worker:
                with tf.device(since_v.device):
                    n = since_v.read_value()
                pushes = []
                # Every copy, also after evaluation-only closures (metrics).
                for c, (local, anchor) in zip(copies, pairs):
                    with tf.device(local.device):
                        value = local.read_value()
                        delta = value - anchor.read_value()
                    with tf.device(c.handle.device):
                        pushes.append(gen_resource_variable_ops.assign_add_variable_op(
                            c.handle, delta))
                    with tf.device(local.device), tf.control_dependencies(pushes[-1:]):
                        pushes.append(anchor.assign(value, read_value=False))

                def record(n=n, last_v=last_v):
                    g_after = tracker.record_increment(last_v.read_value())
                    counted = tracker.add_local_steps(n)
                    with tf.control_dependencies([counted]):
                        return last_v.assign(g_after, read_value=True)

                with tf.control_dependencies(pushes):
                    done = tf.cond(n > 0, record, last_v.read_value)
                with tf.control_dependencies([done]):
                    # The worker pulls the merged model at its next closure.
                    reset = [since_v.assign(tf.constant(0, tf.int64), read_value=False),
                             fresh_v.assign(False, read_value=False)]
                with tf.control_dependencies(reset):
                    total = total + n
            return total

        return flush_all


def _read(handle, dtype):
    return gen_resource_variable_ops.read_variable_op(handle, dtype)


def _assign(handle, value):
    return gen_resource_variable_ops.assign_variable_op(handle, value)


def _outermost_graph():
    from tensorflow.python.framework import func_graph
    g = tf.compat.v1.get_default_graph()
    while isinstance(getattr(g, "outer_graph", None), func_graph.FuncGraph):
        g = g.outer_graph
    return g


def _per_worker(var):
    """The worker-side tf.Variables of a PerWorkerVariable (None if unbuilt)."""
    pw = getattr(var, "_per_worker_vars", None)
    if pw is None:
        return None
    out = []
    for rv in pw._values:  # pylint: disable=protected-access
        rv._wait_and_maybe_error()  # built before the first step: no wait
        out.append(rv._get_values())  # the worker's tf.Variable, not a copy
    return out
