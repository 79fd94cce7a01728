"""Local copies: workers train per-worker copies and exchange deltas with the PS.

The engine's "local copies" mode (core/engine.py): the variables whose mode
the policy's ``variable_mode`` says is local copies (``local_sgd``: every
numeric variable; a ``route`` with a part on local steps: that part's
trainable variables and their optimizer slots; the rest stays per step on
the PS). The rule, when to exchange, is the policy's ``exchange_due`` (see
tf_asyncps/policies/local_sgd.py). Each worker keeps its own copy x_w of
those variables on its own device and trains it with no parameter-server
traffic for them per step. When the policy says an exchange is due, the worker exchanges:

    Δ_w = x_w − a_w          (a_w: the copy it last received from the PS)
    s_w = Δ_w                (the policy's ``exchange="sum"``, the default)
        = Δ_w / N            (``exchange="mean"``, N workers: trainable variables)
    y ← x_ps; x_ps ← y + s_w (per variable on the PS: a read, then assign_add)
    x_w, a_w ← y + s_w       (on the worker)

The read comes just before the worker's own add, not after it, so the model
comes down while Δ_w goes up and both directions of a link carry a model at
once (read after the add, each direction idled while the other carried one:
on the bench's 1.1M MLP over 100 Mbit/s links, 21.1 -> 25.1 worker steps/s).
With one worker y + s_w is the PS copy after the add; with several, another
worker's add that lands between the read and this add reaches this worker at
its next exchange instead of this one (the PS copy always holds every s).

``exchange="mean"`` (tf_asyncps/policies/local_sgd.py: asynchronous model
averaging) divides the deltas of trainable variables only: non-trainable
ones (the optimizer's step counter, metrics' accumulators) are summed under
either rule, so they stay exact. The drain's push (:meth:`LocalCopies.flush`)
and a guarded variable's push (below) take the same share s_w.

An exchange moves every copy except the optimizer's slots (the variables an
optimizer makes per model variable: momentum, Adam's moments). They
are each worker's own state: summed slot deltas of several workers mean
nothing, and a model-sized slot (tf_keras SGD makes one even at momentum 0)
would double the bytes of each window. Their PS copies keep their initial
values.

Under ``local_sgd`` staleness is counted in exchanges: the global step g
advances once per exchange, τ = g just before the exchange − g at the
worker's previous exchange (or pull). ``StalenessStats.applied`` counts exchanges and
``StalenessStats.local_steps`` the worker steps trained on local copies.
Under a route the global step belongs to its per-step parts; an exchange
counts as its local part's update (``exchange_done``) and pushes its local
steps, its τ counted the same way in the part's own counter: the part's
exchanges just before this one − their number at the worker's previous
exchange or pull (each worker keeps that mark, ``exchange_mark``).

Data flow. For every numeric variable created in the strategy's scope the
engine makes two TF per-worker variables (``per_worker_variable``: each
worker holds its own): the local copy and the anchor a_w. While it traces a
worker step it points the variable at the local copy, so the step reads and
updates only worker memory: a scheduled function holding local steps has no
op on a PS (not one message to a PS for a closure without an exchange). The
exchange is a function of its own (:meth:`LocalCopies.before_closure`): the
chief's thread that runs a closure on a worker first asks that worker (one
small worker-only function, no PS) whether an exchange is due and, only then,
runs the exchange there, before the closure's steps. Outside worker steps (the
chief: ``get_weights``, ``model.save``, checkpoints) the variable
is the PS copy, made current when the coordinator drains (``join``, e.g. at
the end of every ``fit`` epoch): :meth:`LocalCopies.flush` pushes what each
worker trained since its last exchange, and every worker pulls the PS copy at
its next closure, so chief-side changes (``set_weights``, metric resets)
reach them.

A partitioned variable (``variable_partitioner``) gets one local copy per
shard: each worker holds the whole table, and an exchange moves every row of
it. Metrics that ``fit``/``evaluate`` print
come from one worker's copy (partial between drains); the PS values are exact
after each drain.

Guarded rows (:meth:`LocalCopies.guard_rows`): a dynamic embedding table's
shard, whose rows the ps resets and hands to new ids, has its exchange done
by its guard, atomically on the ps: the eviction pass due at the exchange's
global step, then Δ_w added only to the rows whose generation (bumped at
each reset) is still the one the worker pulled, then the rows and their
generations read back together. A row reset since the worker's last pull
thus gets none of the worker's stale delta, and the worker's copy of it,
and its optimizer slots' rows, start again from the ps's fresh values.
"""

import threading
import weakref
from typing import List

import tensorflow as tf
from absl import logging

from tf_asyncps.compat import coordinator as coordinator_compat
from tf_asyncps.compat import graph as graph_compat
from tf_asyncps.compat import optimizers as optimizers_compat
from tf_asyncps.compat import strategy as strategy_compat
from tf_asyncps.compat import variables as variables_compat
from tf_asyncps.compat import versions
from tf_asyncps.core import grads as grads_lib
from tf_asyncps.core.locking import run_collecting_ops
from tf_asyncps.core.step import WorkerStep, current_step

__all__ = ["LocalCopies", "exchange_rule"]


def exchange_rule(policy) -> str:
    """The exchange rule (``"sum"`` or ``"mean"``) of ``policy``'s part on
    local steps: its own ``exchange`` or, for a composite (``route``,
    ``chain``), that of its member on local copies; ``"sum"`` for a policy
    that names none."""
    members = getattr(policy, "members", None)
    if callable(members):
        local = [p for p in members() if p.local_copies]
        return exchange_rule(local[0]) if local else "sum"
    return getattr(policy, "exchange", "sum")


class _Copies:
    """The per-worker local copy and anchor of one PS variable."""

    def __init__(self, master, strategy, exchanged: bool, trainable: bool = True):
        self.master = master
        self.trainable = trainable
        # ParameterServerStrategy wraps its variables (CachingVariable); the
        # handle to swap is the wrapped ResourceVariable's.
        self.inner = variables_compat.unwrap_caching_variable(master)
        self.handle = self.inner.handle  # the PS handle, kept while swapped
        self.dtype = master.dtype
        # A worker (also a restarted one) pulls an exchanged copy at its first
        # closure (its ``fresh`` flag is created False): zeros made on the
        # worker, no initial value crosses. A slot starts from its value.
        shape, dtype = master.shape, master.dtype
        try:
            init = (lambda: tf.zeros(shape, dtype)) if exchanged else tf.identity(
                master.read_value())
        except (tf.errors.OpError, ValueError):  # lifted initializer not run yet
            init = tf.zeros(shape, dtype)
        self.local = variables_compat.per_worker_variable(strategy, init, "asyncps_local")
        self.anchor = variables_compat.per_worker_variable(strategy, init, "asyncps_anchor")


_HANDLES = weakref.WeakKeyDictionary()  # function graph -> {id(variable): handle}
_LOCAL_STEP_GRAPHS = weakref.WeakSet()  # scheduled functions' graphs holding local steps


class TracedStep:
    """Trace-time state of one local worker step: which model variables are
    pointed at their local copies, and the per-worker handles.

    Per-worker handles are call-time captures that only the step function's
    outermost graph is fed, so they are taken there; nested graphs (fit's
    ``steps_per_execution`` loop) capture them from it like any tensor.
    """

    def __init__(self, copies: "LocalCopies"):
        self.top = graph_compat.outermost_graph()
        self.since = self._handle(copies._since)
        self.copies, self.local, self.anchor = [], [], []

    def _handle(self, per_worker_var):
        """One placeholder per variable and function: the step may be traced
        more than once into the same function (autograph traces a loop body
        to infer its outputs)."""
        cache = _HANDLES.setdefault(self.top, {})
        key = id(per_worker_var)
        if key not in cache:
            with self.top.as_default():
                cache[key] = per_worker_var.handle
        return cache[key]

    def split(self, grads_and_vars):
        """``(per-step pairs, local pairs)`` of a step's (gradient, variable)
        list: a pair is local when its variable (each part of it) is pointed
        at its local copy in this step."""
        local = {id(c.master) for c in self.copies}
        per_step, pairs = [], []
        for g, v in grads_and_vars:
            parts = variables_compat.tf_variables(v)
            mine = bool(parts) and all(id(p) in local for p in parts)
            (pairs if mine else per_step).append((g, v))
        return per_step, pairs

    def add(self, copies: List[_Copies]) -> None:
        """Points the copies' model variables at the local copies."""
        handles = [(self._handle(c.local), self._handle(c.anchor)) for c in copies]
        for c, (lh, ah) in zip(copies, handles):
            variables_compat.swap_handle(c.inner, lh)
            self.copies.append(c)
            self.local.append(lh)
            self.anchor.append(ah)

    def undo(self) -> None:
        for c in self.copies:
            variables_compat.swap_handle(c.inner, c.handle)


class LocalCopies:
    """Per-worker copies of every numeric variable of the strategy's scope.

    The model's weights and, so that a step needs no PS round trip at all,
    the optimizer's slots and step counter and the metrics' accumulators.
    Deltas of all of them but the slots are pushed (sums and counters stay
    exact: the PS counter ends at the total number of steps); the slots stay
    on their worker.

    Args:
      policy: the UpdatePolicy (``local_copies`` True); its ``exchange_due``
        decides when a worker exchanges.
      skip_nonfinite: skip (never push) a local step with NaN/Inf gradients.
    """

    def __init__(self, policy, skip_nonfinite: bool = True):
        self.policy = policy
        self.skip_nonfinite = skip_nonfinite
        self._copies = {}  # id(variable) -> _Copies, in creation order
        # Optimizer slots: each worker's own state, never exchanged (ids of
        # the PS variables; see add_variable).
        self._worker_only = set()
        self._flush_lock = threading.Lock()
        self._flush_key = None
        self._flush_fn = None
        self.strategy = None
        self.tracker = None
        self._warned_lock = False
        # (copies key, check, pull, exchange ConcreteFunctions): _build_exchange.
        self._exchange = None
        # id(PS variable) -> its guard (guard_rows), and the optimizer that
        # updates it (for its slots' local copies).
        self._guards = {}
        self._optimizer_of = {}
        # The exchange rule's divisor of trainable deltas: 1 (sum) or the
        # number of workers (mean); set in attach.
        self._divisor = 1

    def attach(self, strategy, tracker) -> None:
        """Creates the per-worker counters; once, after the coordinator exists."""
        self.strategy = strategy
        self.tracker = tracker
        if exchange_rule(self.policy) == "mean":
            self._divisor = strategy_compat.num_workers(strategy.extended)
        with tf.init_scope(), strategy.scope():
            self._since = tf.Variable(tf.constant(0, tf.int64), trainable=False,
                                      per_worker_variable=True, name="asyncps_since")
            # The mark of the worker's last exchange or pull: g (local_sgd),
            # or the policy's exchange_mark (route: its local part's exchanges).
            self._last_g = tf.Variable(tf.constant(0, tf.int64), trainable=False,
                                       per_worker_variable=True, name="asyncps_last_g")
            # False until the worker pulls the PS copy: at its first step,
            # after a restart (variables re-created) and after each drain.
            self._fresh = tf.Variable(False, trainable=False,
                                      per_worker_variable=True, name="asyncps_fresh")
        if not coordinator_compat.run_before_closures(strategy, self.before_closure):
            raise RuntimeError(  # pragma: no cover - TF internals moved
                f"{self.policy.name}: the exchange runs before each closure through "
                "ClusterCoordinator internals that moved; tested with "
                f"TensorFlow {', '.join(versions.TENSORFLOW_TESTED)}.")

    def add_variable(self, var, trainable: bool = True) -> None:
        """Creates the local copy and anchor of a PS variable whose mode is
        local copies (the policy's ``variable_mode``: ``local_sgd``, every
        variable; a route, its local part's).

        Called for every variable created in the strategy's scope (eagerly:
        Keras lifts the optimizer's and metrics' lazy variables out of the
        traced step). A variable created while a step is traced is used
        locally from that step on. The strategy passes a partitioned
        variable's shards one by one.
        """
        if not (var.dtype.is_floating or var.dtype.is_integer):
            return  # e.g. bool flags: stay shared on the PS
        slot = optimizers_compat.creating_optimizer_slot()
        if self.policy.variable_mode(var.name, trainable, slot) != "local_copies":
            return
        if slot:
            # A slot (momentum, Adam's moments), model-sized. Summing its
            # deltas across workers has no meaning and would move it at every
            # exchange; it stays each worker's own.
            self._worker_only.add(id(var))
        with tf.init_scope():
            copies = _Copies(var, self.strategy, exchanged=not slot, trainable=trainable)
        self._copies[id(var)] = copies
        step = current_step()
        if step is not None and step.local_state is not None:
            step.local_state.add([copies])

    def holds(self, var) -> bool:
        """Whether ``var`` has local copies (its mode is local copies)."""
        return id(var) in self._copies

    def exchanged(self, copies):
        """The copies an exchange moves: all but the optimizer slots."""
        return [c for c in copies if id(c.master) not in self._worker_only]

    def share(self, copies, delta):
        """What an exchange adds to the PS copy of ``copies`` for a worker's
        ``delta`` (a tensor of the variable's shape and dtype): ``delta``
        under ``exchange="sum"``; under ``"mean"`` ``delta / N`` (N workers)
        for a trainable floating variable, ``delta`` for the rest (counters
        and metrics stay exact)."""
        if self._divisor == 1 or not copies.trainable or not copies.dtype.is_floating:
            return delta
        return delta / tf.constant(self._divisor, delta.dtype)

    def guard_rows(self, var, guard) -> None:
        """Hands the exchange of ``var`` (a PS variable with local copies,
        rows first) to ``guard``, a dynamic table shard's (see the module
        docstring). ``guard`` has:

        * ``view``: an int64 ``[rows]`` variable made in the strategy's
          scope (so it has local copies): on a worker, the generation of each
          row when it last pulled; its PS copy is not read.
        * ``push(delta, view, g)``: on the PS, atomically: the eviction pass
          due at global step ``g`` (None: none), then ``delta`` (``var``'s
          shape) added to the rows whose generation equals ``view``. Returns
          an op.
        * ``read()``: ``(values, generations)`` of ``var``, read together.
        * ``slots(optimizer)``: ``[(slot variable, initial value)]``, the
          optimizer's slots of ``var``; a worker's copies of their rows whose
          generation changed start again from the initial value.
        """
        self._guards[id(var)] = guard

    def _guarded(self):
        """``[(var copies, view copies, guard, [(slot copies, initial)])]``
        for the guarded variables whose copies exist."""
        out = []
        for key, guard in self._guards.items():
            if key not in self._copies or id(guard.view) not in self._copies:
                continue
            optimizer = self._optimizer_of.get(key)
            slots = [] if optimizer is None else [
                (self._copies[id(v)], value) for v, value in guard.slots(optimizer)
                if id(v) in self._copies]
            out.append((self._copies[key], self._copies[id(guard.view)], guard, slots))
        return out

    # -- graph side --------------------------------------------------------------
    def worker_step(self, engine, fn, worker_index):
        """``fn`` as a worker step on the worker's local copies: no PS op in
        the scheduled function (the exchange runs before it, when due:
        :meth:`before_closure`)."""

        @tf.autograph.experimental.do_not_convert
        def step_fn(*a, **kw):
            step = WorkerStep(engine, tf.constant(0, tf.int64), worker_index())
            traced = self.trace(step)
            try:
                with step.active():
                    out = fn(*a, **kw)
            finally:
                traced.undo()
            self.traced()
            return out

        return step_fn

    def trace(self, step) -> TracedStep:
        """Points every local-copy variable at its copy for the worker step
        ``step`` being traced (``step.local_state``); the caller undoes it
        (``TracedStep.undo``) and then calls :meth:`traced`."""
        traced = step.local_state = TracedStep(self)
        traced.add(list(self._copies.values()))
        _LOCAL_STEP_GRAPHS.add(traced.top)
        return traced

    def traced(self) -> None:
        """After a worker step was traced: on the chief's main thread, while
        the closure is traced (``schedule``), the exchange functions for
        every copy the step created."""
        self._build_exchange()

    def count_step(self, step, after) -> tf.Tensor:
        """A step of a route with a part on local steps: one local step
        counted (a worker-local op) after ``after`` (ops). Returns the int64
        scalar local steps since the last exchange."""
        with tf.control_dependencies(after):
            add = variables_compat.assign_add_handle(step.local_state.since,
                                              tf.constant(1, tf.int64))
        with tf.control_dependencies([add]):
            return variables_compat.read_handle(step.local_state.since, tf.int64)

    def _mark(self):
        """The mark a worker keeps at a pull (int64 scalar, on the PS): the
        policy's ``exchange_mark`` (route: its local part's exchanges), else
        the global step."""
        mark = self.policy.exchange_mark()
        return self.tracker.read_step() if mark is None else mark

    def _record_exchange(self, last_mark):
        """The counters of one exchange (after its adds), on the PS: local_sgd
        advances the global step (τ = g before − ``last_mark``, counted in
        exchanges); a route with a part on local steps leaves the global
        step to its per-step parts and counts the exchange, with its τ, as
        its local part's update (``exchange_done``). Returns ``(g after,
        the worker's new mark)``."""
        mark = self.policy.exchange_done(last_mark)
        done = [] if mark is None else [mark]
        if not self.policy.updates_on_ps:
            with tf.control_dependencies(done):
                g_after = self.tracker.record_increment(last_mark)
            return g_after, g_after
        with tf.control_dependencies(done):
            g_after = self.tracker.read_step()
        return g_after, g_after if mark is None else mark

    def _build_exchange(self) -> None:
        """Traces the three functions :meth:`before_closure` runs on a worker,
        for the copies that exist now (again when copies were added).

        * ``check``: worker-only, returns int32 0 (nothing due), 1 (pull: the
          worker has not pulled since it started or since the last drain) or
          2 (exchange: the policy's ``exchange_due`` says so);
        * ``pull``: the PS copies into the local copies and anchors;
        * ``exchange``: read each PS copy y, push s = :meth:`share` of
          Δ = local − anchor after it, count the exchange; local and anchor
          become y + s.
        """
        guarded = self._guarded()
        apart = {id(c) for gc, vc, _, _ in guarded for c in (gc, vc)}
        copies = [c for c in self.exchanged(self._copies.values()) if id(c) not in apart]
        key = tuple(id(c) for c in copies) + tuple(
            id(c) for gc, vc, _, slots in guarded for c in [gc, vc] + [s for s, _ in slots])
        if self._exchange is not None and self._exchange[0] == key:
            return
        tracker = self.tracker
        since_v, last_v, fresh_v = self._since, self._last_g, self._fresh

        def pull(local, anchor, mark, pushed=(), values=None):
            with tf.control_dependencies(list(pushed)):
                ops = pull_guarded()
            if values is None:
                values = []
                for c in copies:
                    with tf.device(c.handle.device):
                        values.append(variables_compat.read_handle(c.handle, c.dtype))
            for lh, ah, new in zip(local, anchor, values):
                ops += [variables_compat.assign_handle(lh, new),
                        variables_compat.assign_handle(ah, new)]
            ops += [variables_compat.assign_handle(last_v.handle, mark),
                    variables_compat.assign_handle(since_v.handle, tf.constant(0, tf.int64)),
                    variables_compat.assign_handle(fresh_v.handle, tf.constant(True))]
            with tf.control_dependencies(ops):
                return tf.constant(0, tf.int64)

        def handles():
            return [c.local.handle for c in copies], [c.anchor.handle for c in copies]

        def pull_guarded():
            # Rows and generations read together; the worker's slot rows whose
            # generation moved since its last pull start again.
            ops = []
            for gc, vc, guard, slots in guarded:
                values, generations = guard.read()
                old = variables_compat.read_handle(vc.anchor.handle, tf.int64)
                with tf.control_dependencies([old]):
                    for c, new in ((gc, values), (vc, generations)):
                        ops += [variables_compat.assign_handle(c.local.handle, new),
                                variables_compat.assign_handle(c.anchor.handle, new)]
                changed = tf.not_equal(generations, old)
                for sc, initial in slots:
                    value = variables_compat.read_handle(sc.local.handle, sc.dtype)
                    rows = tf.reshape(changed, [-1] + [1] * (value.shape.rank - 1))
                    ops.append(variables_compat.assign_handle(sc.local.handle, tf.where(
                        rows, tf.cast(initial, sc.dtype), value)))
            return ops

        def push_guarded(g_after):
            pushes = []
            for gc, vc, guard, _ in guarded:
                delta = self.share(gc, variables_compat.read_handle(gc.local.handle, gc.dtype)
                                   - variables_compat.read_handle(gc.anchor.handle, gc.dtype))
                pushes.append(guard.push(
                    delta, variables_compat.read_handle(vc.anchor.handle, tf.int64), g_after))
            return pushes

        def pull_fn():
            local, anchor = handles()
            return pull(local, anchor, self._mark())

        def exchange_fn():
            local, anchor = handles()
            pushes, merged = [], []
            for c, lh, ah in zip(copies, local, anchor):
                delta = self.share(c, variables_compat.read_handle(lh, c.dtype)
                                   - variables_compat.read_handle(ah, c.dtype))
                with tf.device(c.handle.device):
                    # Read just before this worker's add, so the model comes
                    # down while Δ goes up (both directions of the link busy);
                    # the copy is that value + Δ (Δ / N under "mean"), what
                    # the add makes of it.
                    before = variables_compat.read_handle(c.handle, c.dtype)
                    with tf.control_dependencies([before]):
                        pushes.append(variables_compat.assign_add_handle(c.handle, delta))
                with graph_compat.colocated_with(delta.op):  # on the worker
                    merged.append(before + delta)
            with tf.control_dependencies(pushes):
                g_after, mark = self._record_exchange(
                    variables_compat.read_handle(last_v.handle, tf.int64))
                counted = tracker.add_local_steps(
                    variables_compat.read_handle(since_v.handle, tf.int64))
            with tf.control_dependencies([counted]):
                # After the global step moved: an eviction pass due at it runs
                # in the guard's push, before the masked add.
                pushed = push_guarded(g_after)
                return pull(local, anchor, mark, pushed, merged)

        def check_fn():
            fresh = variables_compat.read_handle(fresh_v.handle, tf.bool)
            due = self.policy.exchange_due(variables_compat.read_handle(since_v.handle, tf.int64))
            return tf.where(fresh, tf.where(due, 2, 0), 1)

        with tf.init_scope():
            fns = [tf.function(f, autograph=False).get_concrete_function()
                   for f in (check_fn, pull_fn, exchange_fn)]
        self._exchange = (key, *fns)

    # -- the exchange, on the chief's thread of a worker ------------------------
    def before_closure(self, function) -> None:
        """Runs the exchange a closure is due, before it, on its worker.

        Called at the start of every closure's run (on the chief's thread that
        runs closures on that worker, in its dispatch context); a closure
        whose function holds no local step is left alone. One worker-only
        function says what is due (one worker round trip, no PS); the pull or
        the exchange (PS ops) runs only when due, and is waited for, so the
        closure's steps start from its result. An error (the worker died) is
        the closure's: the coordinator puts it back.

        Args:
          function: the closure's ConcreteFunction.
        """
        if function.graph not in _LOCAL_STEP_GRAPHS or self._exchange is None:
            return
        _, check, pull, exchange = self._exchange
        due = int(check().numpy())
        if due == 1:
            pull().numpy()
        elif due == 2:
            exchange().numpy()

    def apply(self, step, grads_and_vars, apply_fn, locking: bool,
              optimizer=None) -> tf.Tensor:
        """Applies a step's gradients to the local copies and counts one
        local step (a worker-local op). ``optimizer``: the one applying them
        (its slots of guarded variables are reset with their rows).

        Returns:
          int64 scalar: local steps since the last exchange.
        """
        if locking and not self._warned_lock:
            self._warned_lock = True
            logging.warning(
                "LockingOptimizer has no effect under %s: each worker updates its own "
                "copy, and exchanges with the PS are per-variable atomic adds.",
                self.policy.name)
        grads = [g for g, _ in grads_and_vars if g is not None]
        step.applied = True
        if optimizer is not None:
            for _, v in grads_and_vars:
                for part in variables_compat.tf_variables(v):
                    if id(part) in self._guards:
                        self._optimizer_of[id(part)] = optimizer

        def applied():
            _, update_ops = run_collecting_ops(apply_fn, grads_and_vars)
            with tf.control_dependencies(update_ops):
                return tf.constant(True)

        if self.skip_nonfinite:
            # A non-finite local step is skipped (and never pushed).
            ok = tf.cond(grads_lib.all_finite(grads), applied, lambda: tf.constant(False))
        else:
            ok = applied()
        traced = step.local_state
        with tf.control_dependencies([ok]):
            add = variables_compat.assign_add_handle(traced.since, tf.constant(1, tf.int64))
        with tf.control_dependencies([add]):
            return variables_compat.read_handle(traced.since, tf.int64)

    # -- host side ---------------------------------------------------------------
    def flush(self) -> int:
        """Pushes every worker's steps since its last exchange (on the chief).

        Called when the coordinator drains (``join``), so the PS copy holds
        every trained step; each worker then pulls the PS copy at its next
        closure. One compiled function for all workers (eager remote ops
        would cost one round trip each).

        Returns:
          The number of local steps pushed (int).
        """
        if self.strategy is None or not self._copies:
            return 0
        with self._flush_lock:
            since_all = variables_compat.per_worker_values(self._since)
            if since_all is None:  # no worker step has run yet
                return 0
            views = {id(c) for _, c, _, _ in self._guarded()}
            copies = [c for c in self.exchanged(self._copies.values())
                      if variables_compat.per_worker_values(c.local) is not None
                      and id(c) not in views]
            locals_ = [variables_compat.per_worker_values(c.local) for c in copies]
            anchors = [variables_compat.per_worker_values(c.anchor) for c in copies]
            per_worker = [(since, last, fresh,
                           [(lv[w], av[w]) for lv, av in zip(locals_, anchors)])
                          for w, (since, last, fresh) in enumerate(zip(
                              since_all, variables_compat.per_worker_values(self._last_g),
                              variables_compat.per_worker_values(self._fresh)))]
            # Rebuilt when workers re-created their variables or copies were added.
            key = tuple(id(v) for _, _, _, pairs in per_worker for pair in pairs for v in pair)
            key += tuple(id(s) for s, _, _, _ in per_worker)
            if self._flush_key != key:
                self._flush_key = key
                self._flush_fn = self._make_flush(copies, per_worker)
            return int(self._flush_fn().numpy())

    def _make_flush(self, copies, per_worker):
        tracker = self.tracker
        # A guarded variable's delta is pushed by its guard, against the
        # generations the worker last pulled (no eviction pass here).
        guards = {id(gc): (guard, variables_compat.per_worker_values(vc.anchor))
                  for gc, vc, guard, _ in self._guarded()}

        @tf.function(autograph=False)
        def flush_all():
            total = tf.constant(0, tf.int64)
            for w, (since_v, last_v, fresh_v, pairs) in enumerate(per_worker):
                with tf.device(since_v.device):
                    n = since_v.read_value()
                pushes = []
                # Every copy, also after evaluation-only closures (metrics).
                for c, (local, anchor) in zip(copies, pairs):
                    with tf.device(local.device):
                        value = local.read_value()
                        delta = self.share(c, value - anchor.read_value())
                    if id(c) in guards:
                        guard, views = guards[id(c)]
                        with tf.device(views[w].device):
                            view = views[w].read_value()
                        pushes.append(guard.push(delta, view, None))
                    else:
                        with tf.device(c.handle.device):
                            pushes.append(variables_compat.assign_add_handle(c.handle, delta))
                    with tf.device(local.device), tf.control_dependencies(pushes[-1:]):
                        pushes.append(anchor.assign(value, read_value=False))

                def record(n=n, last_v=last_v):
                    _, mark = self._record_exchange(last_v.read_value())
                    counted = tracker.add_local_steps(n)
                    with tf.control_dependencies([counted]):
                        return last_v.assign(mark, read_value=True)

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
