"""Scenarios of tests/test_gpu_replicas.py."""

import numpy as np
import tensorflow as tf
import tf_keras

import tf_asyncps
from tf_asyncps.compat import variables as variables_compat

from scenarios import scenario
from scenarios.common import (
    fake_multi_replica_workers, full_value, in_process_cluster, make_optimizer,
    make_partitioner, mlp, small_problem, stats_of)


@scenario
def replicas_fit(replicas=2, num_workers=1, policy="async", policy_args=None,
                 optimizer="momentum", lr=0.1, locking=False, epochs=2, steps_per_epoch=10,
                 batch=8, precision=None):
    """model.fit with ``replicas`` replicas per worker (the K-GPU worker path,
    on CPU devices). With one worker, compared with one-process training on
    batches of replicas * batch examples in the same order."""
    fake_multi_replica_workers(replicas)
    servers, resolver = in_process_cluster(num_workers, cpus_per_worker=replicas)
    x, y = small_problem(n=steps_per_epoch * batch * replicas * num_workers)
    rng = np.random.RandomState(1)
    w0 = [rng.uniform(-0.5, 0.5, shape).astype(np.float32)
          for shape in [(8, 16), (16,), (16, 3), (3,)]]
    loss = tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def dataset_fn(ctx):  # each replica takes its own batch, in turn
        ds = tf.data.Dataset.from_tensor_slices((x, y))
        ds = ds.shard(ctx.num_input_pipelines, ctx.input_pipeline_id)
        return ds.batch(batch).repeat()

    strategy = tf_asyncps.AsyncParameterServerStrategy(
        resolver, update_policy=tf_asyncps.policies.get(policy, **(policy_args or {})))
    ref = mlp()
    ref.set_weights(w0)
    ref.compile(make_optimizer(optimizer, lr), loss)
    ref.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(batch * replicas).repeat(),
            epochs=epochs, steps_per_epoch=steps_per_epoch, verbose=0)
    if precision:
        tf_keras.mixed_precision.set_global_policy(precision)
    with strategy.scope():
        model = mlp()
        model.set_weights(w0)
        opt = make_optimizer(optimizer, lr)
        if precision == "mixed_float16":
            opt = tf_keras.mixed_precision.LossScaleOptimizer(opt)
        if locking:
            opt = tf_asyncps.optimizers.LockingOptimizer(opt)
        model.compile(opt, loss)
    model.fit(tf_keras.utils.experimental.DatasetCreator(dataset_fn), epochs=epochs,
              steps_per_epoch=steps_per_epoch, verbose=0)
    diffs = [float(np.max(np.abs(a - b))) for a, b in zip(model.get_weights(), ref.get_weights())]
    moved = [float(np.max(np.abs(a - b))) for a, b in zip(ref.get_weights(), w0)]
    p = strategy.update_policy
    return {"replicas": strategy.num_replicas_in_sync, "max_abs_diff": max(diffs),
            "moved": max(moved), "iterations": int(model.optimizer.iterations.numpy()),
            "finite": all(bool(np.all(np.isfinite(v))) for v in model.get_weights()),
            "rounds": p.rounds() if hasattr(p, "rounds") else None,
            "loss_scale": (float(model.optimizer.loss_scale.numpy())
                           if precision == "mixed_float16" else None),
            "stats": stats_of(strategy)}


@scenario
def replicas_embedding_fit(replicas=2, policy="async", epochs=2, steps_per_epoch=10, batch=8,
                           num_ps=1):
    """An Embedding model (sparse IndexedSlices gradients) with ``replicas``
    replicas on one worker, against one-process training on batches of
    replicas * batch examples in the same order. ``num_ps`` > 1: the table
    and the Dense layer are split over the ps tasks (FixedShardsPartitioner)."""
    fake_multi_replica_workers(replicas)
    servers, resolver = in_process_cluster(1, cpus_per_worker=replicas, num_ps=num_ps)
    rng = np.random.RandomState(0)
    ids = rng.randint(0, 50, size=(steps_per_epoch * batch * replicas, 3)).astype("int32")
    y = (ids[:, 0] % 2).astype("int64")
    loss = tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    w0 = [np.random.RandomState(1).uniform(-0.5, 0.5, shape).astype(np.float32)
          for shape in [(50, 4), (12, 2), (2,)]]

    def build():  # constant initializers: every shard starts from its rows of w0
        c = tf_keras.initializers.Constant
        return tf_keras.Sequential([tf_keras.layers.Input((3,), dtype="int32"),
                                    tf_keras.layers.Embedding(50, 4,
                                                              embeddings_initializer=c(w0[0])),
                                    tf_keras.layers.Flatten(),
                                    tf_keras.layers.Dense(2, kernel_initializer=c(w0[1]),
                                                          bias_initializer=c(w0[2]))])

    strategy = tf_asyncps.AsyncParameterServerStrategy(
        resolver, update_policy=policy,
        variable_partitioner=make_partitioner("fixed", num_ps) if num_ps > 1 else None)
    ref = build()
    ref.compile(tf_keras.optimizers.SGD(0.1), loss)
    ref.fit(tf.data.Dataset.from_tensor_slices((ids, y)).batch(batch * replicas).repeat(),
            epochs=epochs, steps_per_epoch=steps_per_epoch, verbose=0)
    with strategy.scope():
        model = build()
        model.compile(tf_keras.optimizers.SGD(0.1), loss)

    def dataset_fn(ctx):
        ds = tf.data.Dataset.from_tensor_slices((ids, y))
        return ds.shard(ctx.num_input_pipelines, ctx.input_pipeline_id).batch(batch).repeat()

    model.fit(tf_keras.utils.experimental.DatasetCreator(dataset_fn), epochs=epochs,
              steps_per_epoch=steps_per_epoch, verbose=0)
    full = [full_value(v) for v in (model.layers[0].embeddings, model.layers[2].kernel,
                                    model.layers[2].bias)]
    diffs = [float(np.max(np.abs(a - b))) for a, b in zip(full, ref.get_weights())]
    moved = [float(np.max(np.abs(a - b))) for a, b in zip(ref.get_weights(), w0)]
    return {"max_abs_diff": max(diffs), "moved": max(moved),
            "shards": len(variables_compat.shards(model.layers[0].embeddings) or [None]),
            "iterations": int(model.optimizer.iterations.numpy()), "stats": stats_of(strategy)}
