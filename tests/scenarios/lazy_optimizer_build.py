"""Scenarios of tests/test_lazy_optimizer_build.py: an optimizer created in
the scope and built by its first ``apply_gradients`` inside a scheduled
``tf.function`` (no ``opt.build`` first), as a custom loop usually does."""

import numpy as np
import tensorflow as tf

import tf_asyncps

from scenarios import cluster, scenario
from scenarios.common import stats_of

SIZE = 50


def _optimizer(name, lr):
    if name == "keras3_adam":
        import keras
        return keras.optimizers.Adam(lr)
    if name == "keras3_rmsprop":
        import keras
        return keras.optimizers.RMSprop(lr)
    if name == "tf_keras_adagrad":
        import tf_keras
        return tf_keras.optimizers.Adagrad(lr)
    raise ValueError(f"unknown optimizer {name!r}")


def _train(strategy, optimizer, lr, steps, coord=None):
    """The issue's loop: w = zeros(50) and the optimizer made in ``strategy``'s
    scope, a tf.function whose strategy.run body applies the gradient of
    sum(w * linspace(0.5, 1.5, 50)), run ``steps`` times (scheduled when
    ``coord`` is given). Returns (w, optimizer)."""
    with strategy.scope():
        w = tf.Variable(tf.zeros([SIZE]))
        opt = _optimizer(optimizer, lr)
    a = tf.linspace(0.5, 1.5, SIZE)

    @tf.function
    def step():
        def body():
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(w * a)
            opt.apply_gradients(zip(tape.gradient(loss, [w]), [w]))
        strategy.run(body)

    for _ in range(steps):
        if coord is None:
            step()
        else:
            coord.schedule(step)
    if coord is not None:
        coord.join()
    return w, opt


@scenario(shares_cluster=True)
def lazily_built_optimizer(optimizer="keras3_adam", num_workers=3, steps=150, lr=0.01):
    """The scheduled loop on ``num_workers`` workers and the same loop in one
    process (the default strategy): the weights of both and the counters."""
    with cluster(num_workers=num_workers, num_ps=1) as c:
        strategy = tf_asyncps.AsyncParameterServerStrategy(c.resolver())
        coord = tf.distribute.coordinator.ClusterCoordinator(strategy)
        w, opt = _train(strategy, optimizer, lr, steps, coord)
        ref_w, ref_opt = _train(tf.distribute.get_strategy(), optimizer, lr, steps)
        return {"weights": w.numpy().tolist(), "ref_weights": ref_w.numpy().tolist(),
                "iterations": int(opt.iterations.numpy()),
                "ref_iterations": int(ref_opt.iterations.numpy()),
                "finite": bool(np.all(np.isfinite(w.numpy()))),
                "stats": stats_of(strategy),
                "closures_per_worker": strategy.closures_done_per_worker()}
