"""Partitioned variables (``variable_partitioner``) over several ps tasks.

An embedding model (40 x 4 table, ids with duplicates inside every batch,
drawn from the first 20 rows only) and its Dense head are split over the ps
tasks. With one worker every policy, LockingOptimizer, Adam and mixed
precision equal one-process tf_keras training on the same batches; with two
workers every policy's counters are exact. Each group runs as one strategy
per case on one cluster (``sharded_embedding`` below).

Each cluster scenario sits above the tests that read it and returns the
dataclass declared with it (docs/tests.md#scenarios-beside-their-tests);
``embedding_traffic`` is also read by test_wire_dtype.py.
"""

import dataclasses
import json
import os
import sys

import numpy as np
import pytest
import tensorflow as tf
import tf_keras

import tf_asyncps
from conftest import SCENARIOS_DIR, run_command, run_scenario, wait_dead
from scenarios import cluster, scenario
from scenarios.common import cluster_tcp_bytes, full_value, make_optimizer, make_partitioner
from tf_asyncps import StalenessStats
from tf_asyncps.compat import variables as variables_compat

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(400)]

POLICIES = {
    "async": {}, "drop_stale": {"max_staleness": 1}, "staleness_aware": {},
    "ssp": {"max_staleness": 1}, "dc_asgd": {},
    "sync_replicas": {"replicas_to_aggregate": 1}, "local_sgd": {"sync_every": 3}}
# State beside the shard it serves: sync_replicas' buffers, dc_asgd's second
# moments (adaptive; its read values are reads, not copies), the update lock
# beside the global step.
HOLDS_STATE = {"drop_stale", "sync_replicas", "route"}  # per-variable state

ONE_WORKER = {name: dict(policy=name, policy_args=args) for name, args in POLICIES.items()}
ONE_WORKER.update({
    "locking": dict(policy="async", locking=True),
    "adam": dict(policy="async", optimizer="adam", lr=0.05),
    # Full-batch data: sync_replicas' mean of one gradient is the gradient.
    "sync_replicas_min_full_batch": dict(policy="sync_replicas", partitioner="min",
                                         full_batch=True),
    "async_max": dict(policy="async", partitioner="max"),
    # Steps 2 and 5 have NaN gradients: dropped on each ps task, neither the
    # shards, Adam's slots nor its iterations move (one process trains on
    # the other 10 batches); staleness_aware takes its tau before the update.
    "nan_adam": dict(policy="async", optimizer="adam", lr=0.05, nan_batches=[2, 5]),
    "nan_staleness_aware": dict(policy="staleness_aware", nan_batches=[2, 5]),
    "nan_legacy_adam": dict(policy="async", optimizer="legacy_adam", lr=0.05,
                            nan_batches=[2, 5]),
    # Adagrad: a NaN step updates the table's shards and the kernel with zeros
    # (no cond; core/nonfinite_guard.py), which changes nothing.
    "nan_adagrad": dict(policy="async", optimizer="adagrad", lr=0.1, nan_batches=[2, 5]),
    # local_sgd reads the worker's local copies: a bfloat16 wire rounds nothing.
    "local_sgd_bfloat16_wire": dict(policy="local_sgd", policy_args={"sync_every": 3},
                                    wire_dtype="bfloat16"),
    # mixed_float16: tf_keras cannot autocast a partitioned Dense kernel
    # (AutoCastVariable wraps ResourceVariables only), so only the table splits.
    "mixed_async": dict(policy="async", partitioner="min", mixed=True),
    "mixed_sync_replicas": dict(policy="sync_replicas", partitioner="min", mixed=True),
    # Tables async, dense layers sync_replicas (N = 1: the mean of one gradient).
    "route": dict(policy="route", policy_args={
        "sparse": "async", "dense": ["sync_replicas", {"replicas_to_aggregate": 1}]}),
})
STEPS = 20
TWO_WORKERS = {name: dict(policy=name, policy_args=dict(args), reference=False, steps=STEPS)
               for name, args in POLICIES.items()}
TWO_WORKERS["sync_replicas"]["policy_args"] = {"replicas_to_aggregate": 2}
TWO_WORKERS["locking"] = dict(policy="async", locking=True, reference=False, steps=STEPS)
TWO_WORKERS["route"] = dict(policy="route", reference=False, steps=STEPS, policy_args={
    "sparse": "async", "dense": ["sync_replicas", {"replicas_to_aggregate": 2}]})


# -- sharded embeddings (variable_partitioner over several ps tasks) ---------------
EMB_ROWS, EMB_DIM, EMB_BATCH = 40, 4, 8


def _embedding_problem(steps, batch=EMB_BATCH, seed=0):
    """ids (int64 [n, 2]) drawn from the first half of the table, with
    duplicates inside every batch; targets float32 [n, 1]."""
    rng = np.random.RandomState(seed)
    ids = rng.randint(0, EMB_ROWS // 2, size=(steps * batch, 2)).astype(np.int64)
    ys = rng.uniform(size=(steps * batch, 1)).astype(np.float32)
    emb0 = rng.uniform(-0.5, 0.5, (EMB_ROWS, EMB_DIM)).astype(np.float32)
    k0 = rng.uniform(-0.5, 0.5, (2 * EMB_DIM, 1)).astype(np.float32)
    return ids, ys, emb0, k0


def _embedding_model(emb0, k0):
    # Constant initializers: each shard starts from its rows of emb0/k0.
    return tf_keras.Sequential([
        tf_keras.Input(shape=(2,), dtype=tf.int64),
        tf_keras.layers.Embedding(EMB_ROWS, EMB_DIM,
                                  embeddings_initializer=tf_keras.initializers.Constant(emb0)),
        tf_keras.layers.Flatten(),
        tf_keras.layers.Dense(1, use_bias=False,
                              kernel_initializer=tf_keras.initializers.Constant(k0))])


def _same_task(a, b):
    a, b = tf.DeviceSpec.from_string(a), tf.DeviceSpec.from_string(b)
    return (a.job, a.task) == (b.job, b.task)


def _policy(policy, policy_args=None):
    """A policy from JSON-able arguments; "route" takes its parts as names or
    ``[name, kwargs]`` pairs."""
    if policy == "route":
        part = lambda p: tf_asyncps.policies.get(p[0], **p[1]) if isinstance(p, list) else p
        return tf_asyncps.policies.route(**{k: part(v) for k, v in policy_args.items()})
    return tf_asyncps.policies.get(policy, **(policy_args or {}))


def _state_placement(strategy):
    """Counts of engine/policy state variables that sit on the ps task of the
    variable they serve (``beside``) and of those that do not."""
    engine = strategy.extended.engine
    by_id = {id(v): v for v in engine._trainable}
    pairs = []
    for key, state in engine._policy_state.items():
        groups = [(key, state)]
        if isinstance(engine.policy, tf_asyncps.policies.Route):  # a state per part
            known = [by_id.get(k) for k in key]
            if all(v is not None for v in known):
                groups = [([key[i] for i in idx], part_state) for idx, part_state
                          in zip(engine.policy.split(known), state)]
        for ids, st in groups:
            for vid, per_var in zip(ids, st if isinstance(st, (list, tuple)) else []):
                for s in tf.nest.flatten(per_var):
                    if isinstance(s, tf.Variable) and vid in by_id:
                        pairs.append((by_id[vid].device, s.device))
    if engine.lock is not None:
        pairs.append((engine.tracker.global_step.device, engine.lock._stats.device))
    beside = sum(_same_task(a, b) for a, b in pairs)
    return {"beside": beside, "elsewhere": len(pairs) - beside}


def _sharded_run(c, num_ps, policy="async", policy_args=None, optimizer="sgd", lr=0.5,
                 partitioner="fixed", locking=False, steps=12, full_batch=False,
                 reference=True, mixed=False, wire_dtype=None, nan_batches=()):
    if mixed:  # mixed_float16: float32 shards, float16 compute, loss scaling
        tf_keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        return _sharded_fit(c, num_ps, policy, policy_args, optimizer, lr, partitioner,
                            locking, steps, full_batch, reference, wire_dtype, nan_batches)
    finally:
        tf_keras.mixed_precision.set_global_policy("float32")


def _sharded_fit(c, num_ps, policy, policy_args, optimizer, lr, partitioner, locking, steps,
                 full_batch, reference, wire_dtype=None, nan_batches=()):
    ids, ys, emb0, k0 = _embedding_problem(steps)
    batch = len(ids) if full_batch else EMB_BATCH
    clean = np.ones(len(ids), bool)
    for b in nan_batches:  # NaN targets: the step's gradients are NaN, the step is dropped
        ys = ys.copy()
        ys[b * batch:(b + 1) * batch] = np.nan
        clean[b * batch:(b + 1) * batch] = False
    loss = "mse"

    def dataset_fn(ctx):
        ds = tf.data.Dataset.from_tensor_slices((ids, ys))
        if not full_batch:
            ds = ds.shard(ctx.num_input_pipelines, ctx.input_pipeline_id)
        return ds.batch(batch).repeat()

    strategy = tf_asyncps.AsyncParameterServerStrategy(
        c.resolver(), variable_partitioner=make_partitioner(partitioner, num_ps),
        update_policy=_policy(policy, policy_args), wire_dtype=wire_dtype)
    with strategy.scope():
        model = _embedding_model(emb0, k0)
        opt = make_optimizer(optimizer, lr)
        if locking:
            opt = tf_asyncps.optimizers.LockingOptimizer(opt)
        model.compile(opt, loss)
    model.fit(tf_keras.utils.experimental.DatasetCreator(dataset_fn), epochs=1,
              steps_per_epoch=steps, verbose=0)
    emb_var = model.layers[0].embeddings
    table, kernel = full_value(emb_var), full_value(model.layers[2].kernel)
    out = {"shards": len(variables_compat.shards(emb_var) or [emb_var]),
           "shard_tasks": sorted({tf.DeviceSpec.from_string(v.device).task
                                  for v in (variables_compat.shards(emb_var)
                                            or [emb_var])}),
           "untouched_rows_moved": float(np.max(np.abs(
               table[EMB_ROWS // 2:] - emb0[EMB_ROWS // 2:]))),
           "touched_rows_moved": float(np.max(np.abs(
               table[:EMB_ROWS // 2] - emb0[:EMB_ROWS // 2]))),
           "iterations": int(model.optimizer.iterations.numpy()),
           "stats": strategy.staleness_stats(), "placement": _state_placement(strategy),
           "local_copies": len(strategy.extended.engine.local._copies)
           if strategy.extended.engine.local is not None else 0,
           "trainable_parts": len(model.trainable_variables)}
    if policy == "route":
        out["part_updates"] = strategy.update_policy.part_updates()
        out["dense_rounds"] = strategy.update_policy.parts[1].rounds()
    if reference:
        # Plain single-process tf_keras training on the same batches.
        ref = _embedding_model(emb0, k0)
        ref.compile(make_optimizer(optimizer, lr), loss)
        ref.fit(tf.data.Dataset.from_tensor_slices((ids[clean], ys[clean])).batch(batch).repeat(),
                epochs=1, steps_per_epoch=steps - len(nan_batches), verbose=0)
        ref_table, ref_kernel = ref.get_weights()
        out["max_abs_diff"] = float(max(np.max(np.abs(table - ref_table)),
                                        np.max(np.abs(kernel - ref_kernel))))
    return ShardedRun(**out)


@dataclasses.dataclass(frozen=True)
class ShardedRun:
    """One fit of the embedding model (_embedding_problem, 40 x 4 table and a
    Dense head) partitioned over the ps tasks.

    Attributes:
      shards: the table's shards.
      shard_tasks: the ps task index of each shard, sorted, distinct.
      untouched_rows_moved: max |row - initial row| over the rows no id
        touches (the second half of the table).
      touched_rows_moved: the same over the first half.
      iterations: the optimizer's step counter at the end (int).
      stats: the strategy's staleness counters.
      placement: ``{"beside": n, "elsewhere": n}``: the engine's and policy's
        state variables on the ps task of the variable they serve, or not.
      local_copies: the variables with per-worker copies (local_sgd; else 0).
      trainable_parts: the model's trainable variables (shards counted once
        per variable).
      part_updates: ``{label: n}`` under route (None otherwise).
      dense_rounds: the dense part's sync_replicas rounds under route (None
        otherwise).
      max_abs_diff: max |weight - one-process weight| over the table and
        kernel (None without ``reference``).
    """
    shards: int
    shard_tasks: list[int]
    untouched_rows_moved: float
    touched_rows_moved: float
    iterations: int
    stats: StalenessStats
    placement: dict[str, int]
    local_copies: int
    trainable_parts: int
    part_updates: dict[str, int] | None = None
    dense_rounds: int | None = None
    max_abs_diff: float | None = None


@dataclasses.dataclass(frozen=True)
class ShardedEmbedding:
    """Attributes: runs: one ShardedRun per run, in the runs' order."""
    runs: list[ShardedRun]


@scenario(shares_cluster=True)
def sharded_embedding(runs, num_workers=1, num_ps=2) -> ShardedEmbedding:
    """An embedding model partitioned over ``num_ps`` ps tasks; for each run
    (kwargs of _sharded_run) a new strategy on the one cluster."""
    with cluster(num_workers=num_workers, num_ps=num_ps) as c:
        return ShardedEmbedding(runs=[_sharded_run(c, num_ps, **run) for run in runs])


def _runs(cases, num_workers, num_ps):
    r = run_scenario(sharded_embedding, timeout=360, shared=(num_workers, num_ps),
                     runs=list(cases.values()),
                     num_workers=num_workers, num_ps=num_ps)
    return dict(zip(cases, r.runs))


#: Cases whose path another case here takes already (left to ``-m long``):
#: staleness_aware on one worker (nan_staleness_aware trains it), ssp on one
#: worker (its gate never waits there; two workers keep it), both policies of
#: mixed_sync_replicas (mixed_async, sync_replicas), async_max (another
#: partitioner's shards, as sync_replicas_min_full_batch's), adam (nan_adam
#: trains Adam's slots on the shards and equals one process too); on two
#: workers drop_stale (the one-worker case checks its state beside the
#: shards), staleness_aware and dc_asgd (async's accounting; one worker keeps
#: their equalities), locking (one worker checks its lock beside the shards,
#: test_locking.py its exact counts under 4 workers).
LONG_ONE_WORKER = {"staleness_aware", "ssp", "mixed_sync_replicas", "async_max", "adam"}
LONG_TWO_WORKERS = {"drop_stale", "staleness_aware", "dc_asgd", "locking"}


def _cases(cases, long):
    return [pytest.param(c, marks=pytest.mark.long) if c in long else c for c in cases]


def _selected(request, cases, test):
    """The cases of ``cases`` whose test (``test``) this session runs: the
    shared run trains no deselected case."""
    chosen = {item.callspec.params["case"] for item in request.session.items
              if item.module is request.module and item.originalname == test.__name__}
    return {name: spec for name, spec in cases.items() if name in chosen}


@pytest.fixture(scope="module")
def one_worker(request):
    return _runs(_selected(request, ONE_WORKER,
                           test_one_worker_on_three_ps_tasks_equals_one_process),
                 num_workers=1, num_ps=3)


@pytest.fixture(scope="module")
def two_workers(request):
    return _runs(_selected(request, TWO_WORKERS, test_two_workers_on_two_ps_tasks_count_every_step),
                 num_workers=2, num_ps=2)


def _check_sparse(r, num_ps):
    assert r.shards == num_ps and r.shard_tasks == list(range(num_ps))
    # Rows no id touches keep their initial values exactly; the others moved.
    assert r.untouched_rows_moved == 0.0
    assert r.touched_rows_moved > 1e-2


@pytest.mark.parametrize("case", _cases(ONE_WORKER, LONG_ONE_WORKER))
def test_one_worker_on_three_ps_tasks_equals_one_process(one_worker, case):
    r, spec = one_worker[case], ONE_WORKER[case]
    _check_sparse(r, 3)
    assert r.max_abs_diff < 1e-5, r.max_abs_diff
    s = r.stats
    nan = len(spec.get("nan_batches", ()))
    assert s.dropped == s.nonfinite == nan and s.max == 0  # one worker: tau is 0
    assert r.iterations == 12 - nan
    if spec["policy"] == "local_sgd":
        # Every shard has its own local copy on the worker (none trained on the ps).
        assert r.local_copies >= r.trainable_parts
        assert s.local_steps == 12 and s.applied == s.global_step == 4
    else:
        assert s.applied == s.global_step == 12 - nan
    assert r.placement["elsewhere"] == 0
    if spec["policy"] in HOLDS_STATE or spec.get("locking"):
        assert r.placement["beside"] >= 1


@pytest.mark.parametrize("case", _cases(TWO_WORKERS, LONG_TWO_WORKERS))
def test_two_workers_on_two_ps_tasks_count_every_step(two_workers, case):
    r, spec = two_workers[case], TWO_WORKERS[case]
    _check_sparse(r, 2)
    s = r.stats
    assert r.placement["elsewhere"] == 0
    if spec["policy"] == "local_sgd":
        assert s.local_steps == STEPS and r.iterations == STEPS
        assert r.local_copies >= r.trainable_parts
        return
    assert s.applied + s.dropped == STEPS  # every worker step, accounted
    if spec["policy"] == "route":
        # Every step updates its table rows (async): the global step and
        # iterations count worker steps; the dense part made one update per
        # round of 2 (a gradient released at the final drain may be late).
        assert s.global_step == s.applied == r.iterations == STEPS
        assert r.part_updates == {"sparse": STEPS, "dense": r.dense_rounds}
        assert STEPS // 2 - 1 <= r.dense_rounds <= STEPS // 2
    elif spec["policy"] == "sync_replicas":
        assert s.global_step == s.applied // 2 == r.iterations
    else:
        assert s.global_step == s.applied == r.iterations


# -- checkpoints onto another number of ps tasks ----------------------------------
@dataclasses.dataclass(frozen=True)
class Weights:
    """The embedding model's weights, whole (shards concatenated).

    Attributes:
      table: the table ([40][4]).
      kernel: the Dense kernel ([8][1]).
      iterations: the optimizer's step counter (None where not recorded).
    """
    table: list[list[float]]
    kernel: list[list[float]]
    iterations: int | None = None


@dataclasses.dataclass(frozen=True)
class ShardedCheckpoint:
    """A checkpoint written (after training or a restore) and one more step.

    Attributes:
      path: the checkpoint written to ``save_to``.
      shards: the table's shards in this run.
      saved: the weights (and step count) that checkpoint holds.
      next: the weights after one more step on the next batch.
    """
    path: str
    shards: int
    saved: Weights
    next: Weights


@scenario(shares_cluster=True)
def sharded_checkpoint(num_ps, save_to, restore_from=None, steps=6,
                       build_first=True) -> ShardedCheckpoint:
    """Embedding model with Adam, FixedShardsPartitioner(num_ps).

    Without ``restore_from``: trains ``steps`` steps. With it: restores that
    tf.train.Checkpoint (written with another number of ps tasks), into an
    optimizer built first or (``build_first=False``) one whose slots the
    next step creates. Then writes
    a checkpoint to ``save_to``, and takes one more step on the next batch: a
    restore that lost Adam's slots or step count would make that step differ.
    """
    ids, ys, emb0, k0 = _embedding_problem(steps + 1)
    data = lambda lo, hi: tf_keras.utils.experimental.DatasetCreator(
        lambda ctx: tf.data.Dataset.from_tensor_slices((ids[lo:hi], ys[lo:hi])).batch(
            EMB_BATCH).repeat())
    with cluster(num_workers=1, num_ps=num_ps) as c:
        strategy = tf_asyncps.AsyncParameterServerStrategy(
            c.resolver(), variable_partitioner=make_partitioner("fixed", num_ps))
        with strategy.scope():
            model = _embedding_model(emb0, k0)
            opt = tf_keras.optimizers.Adam(0.05)
            model.compile(opt, "mse")
            if build_first:
                opt.build(model.trainable_variables)  # slots exist before a restore
        ckpt = tf.train.Checkpoint(model=model, optimizer=opt)
        if restore_from:
            ckpt.read(restore_from).assert_existing_objects_matched()
        else:
            model.fit(data(0, steps * EMB_BATCH), epochs=1, steps_per_epoch=steps, verbose=0)
        table, kernel = model.layers[0].embeddings, model.layers[2].kernel
        saved = Weights(table=full_value(table).tolist(), kernel=full_value(kernel).tolist(),
                        iterations=int(opt.iterations.numpy()))
        path = ckpt.write(save_to)
        model.fit(data(steps * EMB_BATCH, (steps + 1) * EMB_BATCH), epochs=1,
                  steps_per_epoch=1, verbose=0)
        return ShardedCheckpoint(
            path=path, shards=len(variables_compat.shards(table) or [table]), saved=saved,
            next=Weights(table=full_value(table).tolist(), kernel=full_value(kernel).tolist()))


@pytest.mark.timeout(420)
def test_a_checkpoint_restores_onto_another_number_of_ps_tasks(tmp_path):
    """tf#62215, tf-keras#838: partitioned variables and their optimizer slots
    restored onto 2 -> 3 -> 2 ps tasks (and 2 -> 3 before the optimizer is
    built) give the same values, and the next Adam step (which reads the
    slots and the step count) is the same."""
    run = lambda num_ps, **kw: run_scenario(sharded_checkpoint, timeout=240,
                                            shared=(1, num_ps), num_ps=num_ps, **kw)
    a = run(num_ps=2, save_to=str(tmp_path / "a" / "ckpt"))
    b = run(num_ps=3, restore_from=a.path, save_to=str(tmp_path / "b" / "ckpt"))
    c = run(num_ps=2, restore_from=b.path, save_to=str(tmp_path / "c" / "ckpt"))
    # Into an optimizer with no slots yet (tf_keras alone restored its slots
    # wrong: compat.sharded_slots.build_for_pending_restore).
    d = run(num_ps=3, restore_from=a.path, save_to=str(tmp_path / "d" / "ckpt"),
            build_first=False)
    assert (a.shards, b.shards, c.shards, d.shards) == (2, 3, 2, 3)
    assert a.saved.iterations == 6
    for r in (b, c, d):
        assert r.saved == a.saved  # exact: table, kernel, step count
        for key in ("table", "kernel"):
            np.testing.assert_allclose(getattr(r.next, key), getattr(a.next, key), rtol=0,
                                       atol=1e-6)
    assert a.next.table != a.saved.table  # the next step did move the table


# -- a step's bytes do not grow with the table ------------------------------------
@dataclasses.dataclass(frozen=True)
class TrafficRun:
    """One table size's (and wire dtype's) measured fit.

    Attributes:
      rows: the table's rows.
      bytes_per_step: TCP bytes the cluster's tasks sent per worker step
        (all of them together, measured steps only).
      table_bytes: the table's float32 bytes (rows * dim * 4).
      wire_dtype: the strategy's wire_dtype (None: float32).
    """
    rows: int
    bytes_per_step: float
    table_bytes: int
    wire_dtype: str | None


@dataclasses.dataclass(frozen=True)
class EmbeddingTraffic:
    """Attributes: runs: one TrafficRun per (rows, wire dtype), rows first."""
    runs: list[TrafficRun]


@scenario(shares_cluster=True)
def embedding_traffic(rows_list, dim=32, ids_per_step=64, steps=100, num_ps=2,
                      wire_dtypes=(None,)) -> EmbeddingTraffic:
    """TCP bytes per worker step (all the cluster's tasks) of an embedding model whose table has
    each of ``rows_list`` rows (split over ``num_ps`` ps tasks), every step
    touching ``ids_per_step`` ids: sparse reads and updates keep it flat.
    Each rows value is run once per ``wire_dtypes`` entry (the strategy's
    ``wire_dtype``), on the same ids."""
    rng = np.random.RandomState(0)
    out = []
    runs = [(rows, wire) for rows in rows_list for wire in wire_dtypes]
    data_of = {rows: (rng.randint(0, rows, size=(steps * ids_per_step, 1)).astype(np.int64),
                      rng.uniform(size=(steps * ids_per_step, 1)).astype(np.float32))
               for rows in rows_list}
    with cluster(num_workers=1, num_ps=num_ps) as c:
        for rows, wire in runs:
            ids, ys = data_of[rows]
            strategy = tf_asyncps.AsyncParameterServerStrategy(
                c.resolver(), variable_partitioner=make_partitioner("fixed", num_ps),
                wire_dtype=wire)
            with strategy.scope():
                model = tf_keras.Sequential([
                    tf_keras.Input(shape=(1,), dtype=tf.int64),
                    # Initialised on the ps tasks: no table crosses the network.
                    tf_keras.layers.Embedding(rows, dim),
                    tf_keras.layers.Flatten(), tf_keras.layers.Dense(1)])
                model.compile(tf_keras.optimizers.SGD(0.1), "mse", steps_per_execution=10)
            data = tf_keras.utils.experimental.DatasetCreator(
                lambda ctx: tf.data.Dataset.from_tensor_slices((ids, ys)).batch(
                    ids_per_step).repeat())
            model.fit(data, epochs=1, steps_per_epoch=20, verbose=0)  # traced, warm
            before = cluster_tcp_bytes(c)
            model.fit(data, epochs=1, steps_per_epoch=steps, verbose=0)
            out.append(TrafficRun(rows=rows,
                                  bytes_per_step=(cluster_tcp_bytes(c) - before) / steps,
                                  table_bytes=rows * dim * 4, wire_dtype=wire))
    return EmbeddingTraffic(runs=out)


def test_a_step_moves_the_rows_it_touches_not_the_table():
    """Loopback bytes per worker step (64 ids of 32 floats) with a 10K-row and
    a 1M-row table (128 MB) on 2 ps tasks: reads are gathers of the touched rows
    and updates IndexedSlices, so the bytes do not grow with the table."""
    # On the shared cluster (the bytes are counted on its sockets between the
    # measured steps' start and end); 40 measured steps: a step sends its
    # reads and updates whatever the number of steps.
    small, large = run_scenario(embedding_traffic, timeout=240, shared=(1, 2),
                                rows_list=[10_000, 1_000_000], steps=40).runs
    assert large.bytes_per_step < large.table_bytes / 100  # a dense read: 128 MB
    assert large.bytes_per_step < 3 * small.bytes_per_step


# -- BackupAndRestore of a partitioned model ---------------------------------------
@dataclasses.dataclass(frozen=True)
class BackupValues:
    """One model's state after a fit (or a read).

    Attributes:
      shards: the table's shards.
      iterations: the optimizer's step counter (int).
      table: the table, whole ([40][4]).
      kernel: the Dense kernel, whole ([8][1]).
      slots: Adam's m and v of every part, whole, in the optimizer's order.
      epochs_run: the epochs fit began, in order (None for a model only read).
    """
    shards: int
    iterations: int
    table: list[list[float]]
    kernel: list[list[float]]
    slots: list[list]
    epochs_run: list[int] | None = None


@dataclasses.dataclass(frozen=True)
class ShardedBackup:
    """A fit resumed from ``backup_dir``, the same fit uninterrupted, and that
    model written with a sharding callback and read into a third.

    Attributes:
      resumed: the resumed fit's model.
      uninterrupted: the uninterrupted fit's model.
      backup_left: the entries left in ``backup_dir`` after the resumed fit.
      files: the files of the sharded checkpoint's directory.
      reread: the third model after the read.
    """
    resumed: BackupValues
    uninterrupted: BackupValues
    backup_left: list[str]
    files: int
    reread: BackupValues


@scenario(shares_cluster=True)
def sharded_backup(backup_dir, num_ps=2, epochs=3, steps=4,
                   crash_after_epoch=None) -> ShardedBackup:
    """model.fit with BackupAndRestore of an embedding model and its Adam
    slots, partitioned over ``num_ps`` ps tasks (one worker).

    Each epoch sees the same ``steps`` batches, so a fit resumed at an epoch
    boundary can equal an uninterrupted one exactly. With
    ``crash_after_epoch=k`` this process dies (exit 17) right after epoch k's
    checkpoint is written, and the cluster's tasks with it. Without it, the fit
    resumes from ``backup_dir``; then the same fit runs uninterrupted on fresh
    variables (a new strategy on the same cluster) for comparison, and that
    model is written with a checkpoint sharding callback (tf#73836:
    MaxShardSizePolicy on partitioned variables) and read into a third one.
    """
    ids, ys, emb0, k0 = _embedding_problem(steps)
    data = tf_keras.utils.experimental.DatasetCreator(
        lambda ctx: tf.data.Dataset.from_tensor_slices((ids, ys)).batch(EMB_BATCH).repeat())

    def values(model, epochs_run=None):
        table = model.layers[0].embeddings
        return BackupValues(
            shards=len(variables_compat.shards(table) or [table]),
            iterations=int(model.optimizer.iterations.numpy()),
            table=full_value(table).tolist(), kernel=full_value(model.layers[2].kernel).tolist(),
            # Adam's m and v of every part (variables()[0] is the step count).
            slots=[full_value(v).tolist() for v in model.optimizer.variables()[1:]],
            epochs_run=epochs_run)

    with cluster(num_workers=1, num_ps=num_ps) as c:
        def build():
            strategy = tf_asyncps.AsyncParameterServerStrategy(
                c.resolver(), variable_partitioner=make_partitioner("fixed", num_ps))
            with strategy.scope():
                model = _embedding_model(emb0, k0)
                model.compile(tf_keras.optimizers.Adam(0.05), "mse")
            return model

        def fit(callbacks):
            model, began = build(), []
            callbacks = callbacks + [tf_keras.callbacks.LambdaCallback(
                on_epoch_begin=lambda epoch, logs: began.append(epoch))]
            model.fit(data, epochs=epochs, steps_per_epoch=steps, verbose=0,
                      callbacks=callbacks)
            return model, values(model, epochs_run=began)

        backup = tf_keras.callbacks.BackupAndRestore(backup_dir)
        if crash_after_epoch is not None:
            print("PIDS: " + json.dumps(list(c.pids.values())), flush=True)

            def crash(epoch, logs):
                if epoch + 1 == crash_after_epoch:
                    print(f"crashing after epoch {epoch + 1}", flush=True)
                    os._exit(17)  # no cleanup, as a SIGKILL right after the save
            fit([backup, tf_keras.callbacks.LambdaCallback(on_epoch_end=crash)])
            raise AssertionError("fit ended without the crash")
        _, resumed = fit([backup])
        left = os.listdir(backup_dir) if os.path.isdir(backup_dir) else []
        model, uninterrupted = fit([])
        path = tf.train.Checkpoint(model=model, optimizer=model.optimizer).write(
            os.path.join(backup_dir + "_sharded", "ckpt"),
            options=tf.train.CheckpointOptions(
                experimental_sharding_callback=tf.train.experimental.MaxShardSizePolicy(
                    max_shard_size=64)))
        third = build()
        third.optimizer.build(third.trainable_variables)
        tf.train.Checkpoint(model=third, optimizer=third.optimizer).read(
            path).assert_existing_objects_matched()
        return ShardedBackup(resumed=resumed, uninterrupted=uninterrupted, backup_left=left,
                             files=len(os.listdir(os.path.dirname(path))),
                             reread=values(third))


def test_backup_and_restore_resumes_a_crashed_fit_exactly(tmp_path):
    """BackupAndRestore of a model partitioned over 2 ps tasks, with Adam's
    slots: the process (and its cluster) dies right after epoch 1's
    checkpoint; a new fit on a new cluster runs epochs 2 and 3 only and ends
    exactly where an uninterrupted fit ends. The same model written with a
    checkpoint sharding callback (tf#73836) reads back into a third one."""
    backup = str(tmp_path / "backup")
    rc, out = run_command([sys.executable, SCENARIOS_DIR, sharded_backup.scenario_key,
                           json.dumps({"backup_dir": backup, "crash_after_epoch": 1})],
                          timeout=180, check=False)
    assert rc == 17 and "crashing after epoch 1" in out, out[-3000:]
    pids = json.loads(out.split("PIDS: ", 1)[1].splitlines()[0])
    wait_dead(pids)  # the crashed chief's ps and worker went with it
    assert "checkpoint" in os.listdir(os.path.join(backup, "chief"))
    r = run_scenario(sharded_backup, timeout=240, shared=(1, 2), backup_dir=backup)
    resumed, full, reread = r.resumed, r.uninterrupted, r.reread
    assert full.epochs_run == [0, 1, 2] and resumed.epochs_run == [1, 2]
    assert resumed.shards == full.shards == reread.shards == 2
    assert resumed.iterations == full.iterations == reread.iterations == 12
    for key in ("table", "kernel"):
        np.testing.assert_allclose(getattr(resumed, key), getattr(full, key), rtol=0,
                                   atol=1e-6, err_msg=key)
    assert len(resumed.slots) == len(full.slots) > 0
    for a, b in zip(resumed.slots, full.slots):  # Adam's m and v, each part
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
    for key in ("table", "kernel", "slots"):
        assert getattr(reread, key) == getattr(full, key), key  # a round trip is exact
    assert sum(np.count_nonzero(v) for v in full.slots) > 0  # Adam's m and v moved
    assert r.backup_left == []  # BackupAndRestore removes its checkpoint after fit
    assert r.files > 3  # the sharding callback did split the save


def test_zipf_example_reports_rows_memory_and_traffic(tmp_path):
    """examples/zipf_embedding.py, small: one table size, 2 ps tasks."""
    out = tmp_path / "zipf.json"
    _, log = run_command([sys.executable, "examples/zipf_embedding.py", "--rows=20000,30000",
                          "--steps=20", "--num_ps=2", "--num_workers=1", "--batch_size=64",
                          f"--output={out}"], timeout=300)
    runs = json.loads(out.read_text())
    assert [r["rows"] for r in runs] == [20000, 30000]
    for r in runs:
        assert r["shards"] == 2 and sorted(r["ps_rss_mb"]) == ["ps:0", "ps:1"]
        assert r["global_step"] == 40 + 20  # warm-up and measured steps, all applied
        assert 1 <= r["rows_per_step"] <= 64 and r["bytes_per_step"] > 0
        assert r["steps_per_sec"] > 0
    assert "RSS per ps task (MiB)" in log


def test_zipf_drift_stream_keeps_the_dynamic_table_within_capacity(tmp_path):
    """examples/zipf_embedding.py --drift_every, small: 5,000 possible ids whose
    popularity rotates every 5 steps, a DynamicEmbedding of 300 rows."""
    out = tmp_path / "drift.json"
    _, log = run_command([sys.executable, "examples/zipf_embedding.py", "--drift_every=5",
                          "--drift_ids=5000", "--drift_capacity=300", "--drift_shift=100",
                          "--drift_steps=40", "--drift_segment=20", "--drift_evict_every=5",
                          "--drift_tables=dynamic", "--num_ps=2", "--num_workers=1",
                          "--batch_size=64", f"--output={out}"], timeout=300)
    (r,) = json.loads(out.read_text())
    assert (r["table"], r["rows"], r["ids"], r["min_count"]) == ("dynamic", 300, 5000, 1)
    segs = r["segments"]
    assert [s["worker_steps"] for s in segs] == [20, 40]
    assert [s["phase"] for s in segs] == [3, 7]  # one worker: (step - 5 // 2) // 5
    for s in segs:
        assert 0 < s["live_rows"] <= s["capacity"] == 300
        assert sorted(s["ps_rss_mb"]) == ["ps:0", "ps:1"] and 0 <= s["eval_auc"] <= 1
    # The stream holds far more than 300 ids: ids were refused rows and the
    # passes (every 5 global steps) evicted, at most one row per refusal.
    last = segs[-1]
    assert 0 < last["evicted"] <= last["refused"]
    assert "live rows" in log
