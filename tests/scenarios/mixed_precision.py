"""Scenarios of tests/test_mixed_precision.py."""

import tensorflow as tf
import tf_keras

import tf_asyncps

from scenarios import cluster, scenario
from scenarios.common import mlp, small_problem, stats_of


@scenario(shares_cluster=True)
def mixed_precision_fit(precision="mixed_bfloat16", policy="async", policy_args=None,
                        num_workers=2, epochs=2, steps_per_epoch=40, batch=16, lr=0.1,
                        initial_scale=None, locking=False):
    """model.fit of a small MLP under a tf_keras mixed-precision policy.

    Records, at trace time on this chief, the dtypes of the gradients the
    update policy receives. ``initial_scale`` (mixed_float16 only) starts the
    loss scale high enough to overflow float16, so the first steps have
    non-finite gradients. ``locking`` wraps the inner optimizer in
    LockingOptimizer (the LossScaleOptimizer goes around it).
    """
    x, y = small_problem()
    loss = tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def dataset_fn(ctx):
        ds = tf.data.Dataset.from_tensor_slices((x, y))
        ds = ds.shard(ctx.num_input_pipelines, ctx.input_pipeline_id)
        return ds.shuffle(len(x), seed=0).repeat().batch(batch)

    def full_loss(weights):  # float32, in this process
        ref = mlp()
        ref.set_weights(weights)
        return float(loss(y, ref(x)))

    with cluster(num_workers=num_workers, num_ps=1) as c:
        strategy = tf_asyncps.AsyncParameterServerStrategy(
            c.resolver(), update_policy=tf_asyncps.policies.get(policy, **(policy_args or {})))
        seen = []
        original_update = strategy.update_policy.update

        def recording_update(grads, state, info):
            seen.extend(sorted({g.dtype.name for g in grads}))
            return original_update(grads, state, info)

        strategy.update_policy.update = recording_update
        tf_keras.utils.set_random_seed(0)
        tf_keras.mixed_precision.set_global_policy(precision)
        with strategy.scope():
            model = tf_keras.Sequential([
                tf_keras.Input(shape=(8,)),
                tf_keras.layers.Dense(16, activation="tanh"),
                tf_keras.layers.Dense(3),
                tf_keras.layers.Activation("linear", dtype="float32")])
            opt = tf_keras.optimizers.SGD(lr)
            if locking:
                opt = tf_asyncps.optimizers.LockingOptimizer(opt)
            if precision == "mixed_float16":
                opt = tf_keras.mixed_precision.LossScaleOptimizer(
                    opt, **({"initial_scale": initial_scale} if initial_scale else {}))
            model.compile(opt, loss)
        w0 = model.get_weights()
        model.fit(tf_keras.utils.experimental.DatasetCreator(dataset_fn), epochs=epochs,
                  steps_per_epoch=steps_per_epoch, verbose=0)
        tf_keras.mixed_precision.set_global_policy("float32")
        lock = strategy.extended.engine.lock
        return {
            "scheduled": epochs * steps_per_epoch,
            "compute_dtypes": sorted({l.compute_dtype for l in model.layers[:2]}),
            "variable_dtypes": sorted({v.dtype.name for v in model.weights}),
            "policy_grad_dtypes": sorted(set(seen)), "traces": len(seen),
            "loss0": full_loss(w0), "loss": full_loss(model.get_weights()),
            "iterations": int(model.optimizer.iterations.numpy()),
            "loss_scale": (float(model.optimizer.loss_scale.numpy())
                           if precision == "mixed_float16" else None),
            "lock_acquisitions": lock.acquisitions() if lock is not None else 0,
            "stats": stats_of(strategy)}
