"""Scenarios of tests/test_sharded.py (embedding_traffic: also test_wire_dtype.py)."""

import json
import os

import numpy as np
import tensorflow as tf
import tf_keras

import tf_asyncps
from tf_asyncps.compat import variables as variables_compat

from scenarios import cluster, scenario
from scenarios.common import full_value, make_optimizer, make_partitioner, stats_of


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
           "stats": stats_of(strategy), "placement": _state_placement(strategy),
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
    return out


@scenario(shares_cluster=True)
def sharded_embedding(runs, num_workers=1, num_ps=2):
    """An embedding model partitioned over ``num_ps`` ps tasks; for each run
    (kwargs of _sharded_run) a new strategy on the one cluster."""
    with cluster(num_workers=num_workers, num_ps=num_ps) as c:
        return {"runs": [_sharded_run(c, num_ps, **run) for run in runs]}


@scenario(shares_cluster=True)
def sharded_checkpoint(num_ps, save_to, restore_from=None, steps=6, build_first=True):
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
        saved = {"table": full_value(table).tolist(), "kernel": full_value(kernel).tolist(),
                 "iterations": int(opt.iterations.numpy())}
        path = ckpt.write(save_to)
        model.fit(data(steps * EMB_BATCH, (steps + 1) * EMB_BATCH), epochs=1,
                  steps_per_epoch=1, verbose=0)
        return {"path": path, "shards": len(variables_compat.shards(table) or [table]),
                "saved": saved, "next": {"table": full_value(table).tolist(),
                                         "kernel": full_value(kernel).tolist()}}


@scenario(shares_cluster=True)
def sharded_backup(backup_dir, num_ps=2, epochs=3, steps=4, crash_after_epoch=None):
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

    def values(model):
        table = model.layers[0].embeddings
        return {"shards": len(variables_compat.shards(table) or [table]),
                "iterations": int(model.optimizer.iterations.numpy()),
                "table": full_value(table).tolist(),
                "kernel": full_value(model.layers[2].kernel).tolist(),
                # Adam's m and v of every part (variables()[0] is the step count).
                "slots": [full_value(v).tolist() for v in model.optimizer.variables()[1:]]}

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
            return model, dict(values(model), epochs_run=began)

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
        return {"resumed": resumed, "uninterrupted": uninterrupted, "backup_left": left,
                "files": len(os.listdir(os.path.dirname(path))), "reread": values(third)}


def _cluster_tcp_bytes(c):
    """Bytes sent so far on every TCP connection to or from a task of
    cluster ``c`` (``ss -tin``, per socket: other jobs sharing the loopback
    interface do not count). Both ends of a loopback connection are listed,
    so this is what the tasks sent, all together."""
    import re
    import subprocess
    ports = {a.rsplit(":", 1)[1] for addrs in c.config.values() for a in addrs}
    out = subprocess.run(["ss", "-tinH", "state", "established"], capture_output=True,
                         text=True, check=True).stdout
    total, ours = 0, False
    for line in out.splitlines():
        if line and not line[0].isspace():  # "Recv-Q Send-Q local peer": a socket
            local, peer = line.split()[2:4]
            ours = bool({local.rsplit(":", 1)[1], peer.rsplit(":", 1)[1]} & ports)
        elif ours:
            m = re.search(r"\bbytes_sent:(\d+)", line)
            total += int(m.group(1)) if m else 0
    return total


@scenario
def embedding_traffic(rows_list, dim=32, ids_per_step=64, steps=100, num_ps=2,
                      wire_dtypes=(None,)):
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
            before = _cluster_tcp_bytes(c)
            model.fit(data, epochs=1, steps_per_epoch=steps, verbose=0)
            out.append({"rows": rows, "bytes_per_step": (_cluster_tcp_bytes(c) - before) / steps,
                        "table_bytes": rows * dim * 4, "wire_dtype": wire})
    return {"runs": out}


@scenario
def dense_traffic(hidden=256, steps=60, wire_dtypes=(None, "bfloat16")):
    """TCP bytes per worker step (all the cluster's tasks, 1 worker, 1 ps) of
    an MLP 64-``hidden``-10 (tf_keras fit, SGD), once per ``wire_dtypes``
    entry: each step reads every weight and pushes every gradient."""
    rng = np.random.RandomState(0)
    x = rng.randn(32 * steps, 64).astype(np.float32)
    y = rng.randint(0, 10, size=(32 * steps,)).astype(np.int64)
    out = []
    with cluster(num_workers=1, num_ps=1) as c:
        for wire in wire_dtypes:
            strategy = tf_asyncps.AsyncParameterServerStrategy(c.resolver(), wire_dtype=wire)
            with strategy.scope():
                model = tf_keras.Sequential([
                    tf_keras.Input(shape=(64,)),
                    tf_keras.layers.Dense(hidden, activation="relu"),
                    tf_keras.layers.Dense(10)])
                model.compile(tf_keras.optimizers.SGD(0.05), tf_keras.losses.SparseCategoricalCrossentropy(
                    from_logits=True), steps_per_execution=10)
            data = tf_keras.utils.experimental.DatasetCreator(
                lambda ctx: tf.data.Dataset.from_tensor_slices((x, y)).batch(32).repeat())
            model.fit(data, epochs=1, steps_per_epoch=20, verbose=0)  # traced, warm
            before = _cluster_tcp_bytes(c)
            model.fit(data, epochs=1, steps_per_epoch=steps, verbose=0)
            out.append({"wire_dtype": wire, "bytes_per_step": (_cluster_tcp_bytes(c) - before) / steps,
                        "params": int(model.count_params()),
                        "dtypes": sorted({v.dtype.name for v in model.weights})})
    return {"runs": out}
