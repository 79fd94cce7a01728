"""One worker step's update, by stage: gradients to the ps, the decision applied, hooks.

:meth:`PolicyEngine.apply_step <tf_asyncps.core.engine.PolicyEngine.apply_step>`
is :func:`apply_step`: the optimizer hook (core/step.py) hands it a step's
gradients, and it runs three stages::

    to the ps:   per-step pairs only (local-copy pairs stay on the worker);
                 dtype, distinct rows, the finite check, copies to each
                 variable's ps  -> a StepPlan
    decision:    [PS lock]  g_now = g.read();  τ = g_now − r
                 Decision(grads, keep, accepted) = policy.update(grads, state, info)
                 applied as one of: gated (a cond per variable on its ps),
                 cond (one per distinct keep), locked (either, under the lock)
                 keep:      optimizer update; g += 1; histogram[τ] += 1
                 accepted:  counted applied, g unchanged (aggregator's round)
                 else:      dropped_histogram[τ] += 1 (loss scale adjusted)
    hooks:       after-update hooks (inside the lock when locked), after_step(w)

A step's local-copy pairs (a route with a part on local steps) join every
optimizer call of the step, so the optimizer runs once per step; when every
per-step part is dropped they are applied alone (skipped only when the step's
gradients are not finite).
"""

import contextlib
import dataclasses
from typing import Any, Callable, List, Optional

import tensorflow as tf
from absl import logging

from tf_asyncps.compat import optimizers as optimizers_compat
from tf_asyncps.compat import variables as variables_compat
from tf_asyncps.core import grads as grads_lib
from tf_asyncps.core import gpu_replicas, mixed_precision, nonfinite_guard, placement
from tf_asyncps.core import rowwise
from tf_asyncps.core.locking import PSLock, run_collecting_ops
from tf_asyncps.core.protocol import StepInfo, as_decision

__all__ = ["StepPlan", "apply_step", "LARGE_TABLE_ROWS"]

#: A sparse gradient on a variable with at least this many rows is a table.
LARGE_TABLE_ROWS = 100_000


@dataclasses.dataclass
class StepPlan:
    """What the decision stage needs of one worker step, once its gradients
    are on the ps.

    Attributes:
      step: the WorkerStep (read step r, worker index).
      optimizer: the optimizer whose hooked method was called.
      variables: the per-step variables, aligned with ``grads``.
      grads: their gradients (tf.Tensor or tf.IndexedSlices), each on its
        variable's ps, in the variable's dtype.
      state: the policy's state for ``variables`` (its ``init``).
      worker: int64 scalar, the worker index, copied to the tracker's ps.
      finite: scalar tf.bool on the tracker's ps, all gradients finite; None
        when nothing checks.
      gate: scalar tf.bool on the worker: the finite check, when each
        variable's update is gated on its own ps; else None.
      read_values: per variable, its value at the step's read (policies with
        ``needs_read_values``), else None.
      lso: the LossScaleOptimizer behind ``optimizer``, or None.
      apply_fn: the optimizer's own update on a (gradient, variable) list,
        with the before-update hooks and gradient filters.
      inputs: tensors the τ read and the lock wait for (gradients, worker,
        finite), all on the ps.
      locking: whether the step runs under the update lock.
      local_pairs: (gradient, variable) pairs on local copies: applied with
        every optimizer call of the step, on the worker.
      after_update: ``g_after -> [ops]``, the after-update hooks.
    """

    step: Any
    optimizer: Any
    variables: List[tf.Variable]
    grads: List[Any]
    state: Any
    worker: tf.Tensor
    finite: Optional[tf.Tensor]
    gate: Optional[tf.Tensor]
    read_values: Optional[list]
    lso: Any
    apply_fn: Callable
    inputs: List[tf.Tensor]
    locking: bool
    local_pairs: list
    after_update: Callable


def apply_step(engine, step, optimizer, grads_and_vars, apply_fn):
    """Applies one worker step's gradients under the update policy.

    Args:
      engine: the PolicyEngine.
      step: the WorkerStep (holds the read step r and the worker index).
      optimizer: the optimizer being called; a LockingOptimizer makes the
        whole step one locked unit.
      grads_and_vars: list of (gradient or None, variable).
      apply_fn: runs the optimizer's own update on a grads_and_vars list.

    Returns:
      int64 scalar tensor: the global step after this step (``local_sgd``:
      the worker's local steps since its last exchange).

    Raises:
      ValueError: a LockingOptimizer on a step with local-copy variables.
    """
    optimizers_compat.make_iterations_atomic(optimizer)
    if step.group is not None and not tf.distribute.in_cross_replica_context():
        return gpu_replicas.apply_replicated(engine, step, optimizer, grads_and_vars, apply_fn)
    marked = engine._is_locking(optimizer)
    local_pairs = []
    if step.local_state is not None:
        mixed_precision.check_local_copies(engine.policy, optimizer)
        if not engine.policy.updates_on_ps:  # local_sgd: the whole step on copies
            return engine.local.apply(step, grads_and_vars, apply_fn, marked, optimizer)
        grads_and_vars, local_pairs = step.local_state.split(grads_and_vars)
        if marked:
            raise ValueError(
                f"{type(optimizer).__name__} is a LockingOptimizer, and the update policy "
                f"{engine.policy!r} trains part of the model on per-worker copies: a lock "
                "on the PS cannot hold the workers' local updates. Drop LockingOptimizer.")
    plan = to_ps(engine, step, optimizer, grads_and_vars, apply_fn, marked, local_pairs)
    if plan is None:  # no per-step gradient
        if not local_pairs:
            return apply_fn(grads_and_vars)
        return engine.local.apply(step, grads_and_vars + local_pairs, apply_fn, marked,
                                  optimizer)
    g_after = decide(engine, plan)
    if local_pairs:  # one local step trained
        g_after = _after(g_after, [engine.local.count_step(step, [g_after])])
    return g_after


# -- stage 1: gradients to the ps ------------------------------------------------
def to_ps(engine, step, optimizer, grads_and_vars, apply_fn, marked,
          local_pairs=()) -> Optional[StepPlan]:
    """The step's per-step gradients, checked and copied to their variables'
    ps tasks, as a :class:`StepPlan`; None when the step has none."""
    policy, tracker = engine.policy, engine.tracker
    locking = policy.atomic or marked
    on_ps = engine.tables.rows_on_ps  # a table's rows gathered on its ps
    pairs = [(grads_lib.rows_on_ps(g, on_ps), v) for g, v in grads_and_vars if g is not None]
    if not pairs:
        return None
    if rowwise.rule_for(optimizer) is None:
        _warn_dense_table_updates(engine, optimizer, pairs)
    step.applied = True
    # Policies and aggregators work in the variables' dtype (float32 under
    # mixed precision, where tf_keras keeps float32 variables).
    grads = [grads_lib.cast(g, v.dtype) for g, v in pairs]
    variables = [v for _, v in pairs]
    keras3 = optimizers_compat.optimizer_class()
    squares = [None] * len(grads)
    if keras3 is None or not isinstance(optimizer, keras3):
        # Distinct rows only: tf_keras's optimizers sum the rows of repeated
        # ids in apply_gradients anyway, so each row crosses to the ps once
        # (docs/benchmarks.md#bytes-per-step-on-an-embedding-nameemb).
        grads = [grads_lib.unique_rows(g, on_ps) for g in grads]
        # A table's own step on the worker (an embedding cache defers rows).
        grads = [engine.tables.before_push(g, v, optimizer) for g, v in zip(grads, variables)]
    else:
        # An embedding cache defers rows here too, on one row per id
        # occurrence (Keras 3's rules see occurrences).
        grads = [engine.tables.before_push(g, v, optimizer) for g, v in zip(grads, variables)]
        # Keras 3 squares each repeated row on its own: a row-wise rule's
        # tables cross as distinct rows with the squares it needs
        # (core/rowwise.py); other Keras 3 rules keep every row.
        grads, squares = rowwise.distinct_rows(optimizer, grads, variables)
    # A LossScaleOptimizer skips non-finite steps itself: always check, so
    # such a step is counted as dropped and lowers the loss scale.
    lso = mixed_precision.loss_scale_optimizer(optimizer)
    local_grads = [g for g, _ in local_pairs if g is not None]
    finite = (grads_lib.all_finite(grads + local_grads)
              if (engine.skip_nonfinite or lso is not None) else None)
    # The worker's predicate, for one cond per variable on its ps (see
    # gated_apply) where the optimizer and the step allow it.
    gate = finite if (finite is not None and lso is None and not locking
                      and engine._can_gate(optimizer, variables)) else None
    # Bring every worker-side input onto the PS first: the locked region
    # then never waits for a worker that may die, and the decision's
    # tf.cond runs entirely on the PS (measured faster).
    device = tracker.device
    # wire_dtype: float32 values cross as bfloat16, float32 again on the
    # ps (after the finite check above, which sees the worker's values).
    # A table's squares (Keras 3's row-wise Adagrad and lazy Adam) cross in
    # the same tensor as its rows and ids: one transfer a table shard
    # (without squares: copy_to).
    copies = [grads_lib.copy_with_rows_to(
        g, s, variables_compat.backing_variable(v).device, wire_dtype=engine.wire_dtype,
        rows=_static_rows(variables_compat.backing_variable(v)), on_ps=on_ps)
        for g, s, v in zip(grads, squares, variables)]
    grads, squares = [c[0] for c in copies], [c[1] for c in copies]
    # The row-wise update inside the gradient filters: a filtered gradient
    # is applied with its own rows as the occurrences.
    apply_fn = filtered(engine, rowwise.applying(
        optimizer, distinct_known(optimizer, apply_fn), variables, grads, squares), optimizer)
    w = grads_lib.copy_to(step.worker_index, device)
    finite = None if finite is None else grads_lib.copy_to(finite, device)
    inputs = (grads_lib.flat_tensors(grads) + [s for s in squares if s is not None] + [w]
              + ([finite] if finite is not None else []))
    read_values = (_read_values(engine, step, variables) if policy.needs_read_values
                   else None)

    def after_update(g_after):
        with tf.control_dependencies([g_after]):
            return engine.tables.after_update(optimizer, variables, g_after)

    return StepPlan(step=step, optimizer=optimizer, variables=variables, grads=grads,
                    state=engine._state_for(variables), worker=w, finite=finite, gate=gate,
                    read_values=read_values, lso=lso, apply_fn=apply_fn, inputs=inputs,
                    locking=locking, local_pairs=list(local_pairs), after_update=after_update)


def distinct_known(optimizer, apply_fn):
    """``apply_fn`` with the optimizer's own de-duplication skipped for the
    gradients whose indices are known distinct (made so on the worker:
    ``grads.unique_rows``, core/lookup.py's reads), which it would leave as
    they are (one ``tf.unique`` and segment sum per table shard less on the ps)."""
    def apply_distinct(grads_and_vars):
        with optimizers_compat.deduplicating_only(
                optimizer, lambda g: not grads_lib.known_distinct(g.indices)):
            return apply_fn(grads_and_vars)
    return apply_distinct


def filtered(engine, apply_fn, optimizer):
    """``apply_fn`` with the tables' before-update hooks and gradient
    filters (core/table_seam.py) run on its gradients."""
    tables = engine.tables
    if not tables.filter_updates:
        return apply_fn

    def apply_filtered(grads_and_vars):
        variables = [v for g, v in grads_and_vars if g is not None]
        with tf.control_dependencies(tables.before_update(optimizer, variables)):
            pairs = [(g if g is None else tables.filter_gradient(g, v), v)
                     for g, v in grads_and_vars]
            return apply_fn(pairs)
    return apply_filtered


def _warn_dense_table_updates(engine, optimizer, pairs) -> None:
    """Warns once per optimizer whose update of a large embedding table
    touches every row each step (tf_keras SGD; Keras 3 optimizers other
    than SGD without momentum), naming the fix."""
    if id(optimizer) in engine._warned:
        return
    tables = [v.name for g, v in pairs if isinstance(g, tf.IndexedSlices)
              and v.shape.rank and (v.shape[0] or 0) >= LARGE_TABLE_ROWS]
    why = optimizers_compat.dense_on_sparse_gradients(optimizer) if tables else None
    if why:
        engine._warned.add(id(optimizer))
        logging.warning("%s: %s; each step's cost grows with the table, not the "
                        "batch.", ", ".join(tables), why)


def _read_values(engine, step, variables):
    """Per variable of this step, its value when the step read r (None
    for one not created under the scope). Read on the variable's PS task
    in r's graph with only r before it, so it runs as soon as r is read,
    beside the step's own reads, not at apply time; only the step's own
    variables are read, and nothing is copied."""
    known = {id(v) for v in engine._trainable}
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


def _static_rows(var):
    """A variable's static number of rows, or None (a scalar, an unknown shape)."""
    shape = var.shape
    return shape[0] if shape.rank and shape[0] is not None else None


# -- stage 2: the decision, applied (gated / cond / locked) ----------------------
def decide(engine, plan: StepPlan) -> tf.Tensor:
    """Runs the policy's decision on ``plan`` and applies it, under the
    update lock when ``plan.locking``, then the hooks. Returns the int64
    global step after the step."""
    tracker, device = engine.tracker, engine.tracker.device

    def decide_and_apply():
        # Each gradient's ops on its variable's ps, τ's on the tracker's.
        with placement.beside_inputs(device):
            return _decide_and_apply(tracker, engine.policy, plan)

    hooked = []
    if plan.locking:
        # Placed on the PS: a worker that dies cannot hold the lock.
        if engine.lock is None:
            engine.lock = PSLock(device, engine._lock_timeout(plan.optimizer),
                                 name="update_lock", anchor=tracker.global_step)

        def locked():
            # The after-update hooks hold the lock too: no locked update
            # overlaps a dynamic table's eviction pass (Adam's update
            # rewrites every row's moments, which would undo its resets).
            g_after = decide_and_apply()
            with tf.control_dependencies(plan.after_update(g_after)):
                return tf.identity(g_after)

        g_after = engine.lock.execute(locked, inputs=plan.inputs + [plan.step.read_step])
    else:
        # On the PS: a rule that needs τ (read on the PS) and transforms the
        # gradients would otherwise cost an extra worker<->PS round trip.
        g_after = decide_and_apply()
        hooked = plan.after_update(g_after)
    # stage 3: the policy's after_step, beside its state on the ps
    with engine._policy_hook():
        after = list(engine.policy.after_step(plan.worker) or [])
    return _after(g_after, after + hooked)


def _after(value, ops):
    """``value`` once ``ops`` ran (itself when there are none)."""
    if not ops:
        return value
    with tf.control_dependencies(ops):
        return tf.identity(value)


def _decide_and_apply(tracker, policy, plan: StepPlan) -> tf.Tensor:
    step, variables, finite = plan.step, plan.variables, plan.finite
    # g is read once the gradients exist: τ covers the whole step.
    # Without the lock and with a rule that ignores τ, τ comes from the
    # atomic increment itself (every update gets its own g), and this
    # read waits for nothing (each wait on a gradient was a message from
    # its ps task).
    tau_from_increment = not plan.locking and not policy.uses_tau
    with tf.control_dependencies([] if tau_from_increment else plan.inputs):
        g_now = tracker.read_step()
    tau = g_now - step.read_step
    info = StepInfo(tau=tau, read_step=step.read_step, global_step=g_now,
                    variables=variables, worker_index=plan.worker,
                    read_values=plan.read_values, finite=finite)
    decision = as_decision(policy.update(list(plan.grads), plan.state, info))
    groups = keep_groups(decision.keep, len(variables), finite)

    def applied(indices):
        # The counters move only after every op of the optimizer's update:
        # optimizers leave their variable updates unordered with respect
        # to each other and to their return value.
        pairs = [(decision.grads[i], variables[i]) for i in indices] + plan.local_pairs
        _, update_ops = run_collecting_ops(plan.apply_fn, pairs)
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
        ops = [] if plan.lso is None else mixed_precision.update_loss_scale(
            plan.lso, plan.grads)
        with tf.control_dependencies(ops + _local_only(plan)):
            return tracker.record(
                tau, applied=False,
                nonfinite=None if finite is None else tf.logical_not(finite))

    nothing_applied = dropped
    if decision.accepted is not None:  # an aggregator: accepted, update pending
        def nothing_applied():
            return tf.cond(decision.accepted,
                           lambda: tracker.record(tau, applied=True, increment=0),
                           dropped)

    if plan.gate is not None and decision.accepted is None and decision.after_apply is None \
            and all(k is True for k in (decision.keep if isinstance(decision.keep, (list, tuple))
                                        else [decision.keep])):
        return gated_apply(tracker, plan, decision, tau, tau_from_increment)

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


def _local_only(plan: StepPlan) -> list:
    """A step whose per-step parts were all dropped still trains its local
    copies (one optimizer call, on the worker), unless it is not finite."""
    if not plan.local_pairs:
        return []

    def update():
        _, ops = run_collecting_ops(plan.apply_fn, plan.local_pairs)
        with tf.control_dependencies(ops):
            return tf.constant(True)

    if plan.finite is None:
        return [update()]
    return [tf.cond(plan.finite, update, lambda: tf.constant(False))]


def gated_apply(tracker, plan: StepPlan, decision, tau, tau_from_increment) -> tf.Tensor:
    """Applies a kept step with each variable's update gated by
    ``plan.gate`` (the worker's finite check) on its own ps, the optimizer's
    counter advanced by it, and the counters recorded without a cond."""
    variables, optimizer, finite = plan.variables, plan.optimizer, plan.finite
    pairs = [(decision.grads[i], v) for i, v in enumerate(variables)] + plan.local_pairs
    with tf.init_scope():  # legacy optimizers create them on first use
        counter = optimizer.iterations
        lr = getattr(optimizer, "learning_rate", None)
    hoisted = [variables_compat.backing_variable(h) for h in (lr, counter)]
    hoisted = [h for h in hoisted if isinstance(h, tf.Variable)]
    rowwise_sparse = optimizers_compat.sparse_update_is_rowwise(optimizer)
    zero_is_noop = optimizers_compat.update_is_noop_at_zero(optimizer)
    with nonfinite_guard.guarded_by(plan.gate, hoisted, rowwise_sparse,
                                    zero_is_noop) as gated, \
            variables_compat.adding_only_if(counter, finite):
        _, update_ops = run_collecting_ops(plan.apply_fn, pairs)
    missed = [v.name for v in variables + [v for _, v in plan.local_pairs]
              if id(v) not in gated and id(variables_compat.backing_variable(v)) not in gated]
    if missed:
        raise RuntimeError(
            f"{type(optimizer).__name__} updated {missed} without the strategy's "
            "extended.update, so a step with NaN/Inf gradients could not be dropped "
            "there; pass skip_nonfinite=False to AsyncParameterServerStrategy or "
            "update through extended.update.")
    with tf.control_dependencies(placement.one_per_device(update_ops)):
        return tracker.record_gated(plan.step.read_step, finite,
                                    None if tau_from_increment else tau)


def keep_groups(keep, n, finite):
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
