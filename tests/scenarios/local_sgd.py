"""Scenarios of tests/test_local_sgd.py."""

import tensorflow as tf
import tf_keras

import tf_asyncps

from scenarios import cluster, scenario
from scenarios.common import run_steps, stats_of, step_fn


@scenario(shares_cluster=True)
def local_sgd_linear(num_workers=3, steps=60, lr=0.5, dim=4, sync_every=4, chained=False):
    """local_sgd with loss = sum(w) (gradient 1): every local step moves a
    worker's copy by -lr, so after the drain w == w0 - lr * steps exactly.
    ``chained``: the policy inside ``chain(...)``."""
    policy = tf_asyncps.policies.get("local_sgd", sync_every=sync_every)
    with cluster(num_workers=num_workers, num_ps=1) as c:
        strategy = tf_asyncps.AsyncParameterServerStrategy(
            c.resolver(), update_policy=tf_asyncps.policies.chain(policy) if chained else policy)
        coord = tf.distribute.coordinator.ClusterCoordinator(strategy)
        with strategy.scope():
            w = tf.Variable(tf.fill([dim], 2.0), name="w")
            opt = tf_keras.optimizers.SGD(lr)
        run_steps(coord, step_fn(strategy, [w], opt, lambda: tf.reduce_sum(w)), steps)
        first = {"w": w.numpy().tolist(), "iterations": int(opt.iterations.numpy()),
                 "stats": stats_of(strategy)}
        # The chief changes the model between runs: workers must pull it.
        w.assign(tf.fill([dim], 100.0))
        run_steps(coord, step_fn(strategy, [w], opt, lambda: tf.reduce_sum(w)), steps)
        return {"first": first, "w": w.numpy().tolist(),
                "iterations": int(opt.iterations.numpy()), "stats": stats_of(strategy)}


@scenario(shares_cluster=True)
def local_sgd_momentum_slots(num_workers=2, steps=40, lr=0.1, momentum=0.5, sync_every=4):
    """local_sgd with SGD momentum on loss = sum(w): the momentum slot is each
    worker's own state. Returns the PS copy of the slot after the drain and
    the names of the variables an exchange moves."""
    policy = tf_asyncps.policies.get("local_sgd", sync_every=sync_every)
    with cluster(num_workers=num_workers, num_ps=1) as c:
        strategy = tf_asyncps.AsyncParameterServerStrategy(c.resolver(), update_policy=policy)
        coord = tf.distribute.coordinator.ClusterCoordinator(strategy)
        with strategy.scope():
            w = tf.Variable(tf.fill([4], 2.0), name="w")
            opt = tf_keras.optimizers.SGD(lr, momentum=momentum)
        run_steps(coord, step_fn(strategy, [w], opt, lambda: tf.reduce_sum(w)), steps)
        local = strategy.extended.engine.local
        slots = [v for v in opt.variables if v.shape.rank]
        return {"w": w.numpy().tolist(), "iterations": int(opt.iterations.numpy()),
                "slots_on_ps": [v.numpy().tolist() for v in slots],
                "exchanged": sorted(c.master.name for c in local.exchanged(local._copies.values())),
                "stats": stats_of(strategy)}
