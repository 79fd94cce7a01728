"""Scenarios of tests/test_route_local_steps.py: route(sparse="async",
dense=LocalSteps(k)), a table updated every step and a dense weight on local
steps."""

import tensorflow as tf
import tf_keras

import tf_asyncps

from scenarios import cluster, scenario
from scenarios.common import stats_of


def _strategy(c, sync_every):
    policy = tf_asyncps.policies.route(
        sparse="async", dense=tf_asyncps.policies.LocalSteps(sync_every=sync_every))
    strategy = tf_asyncps.AsyncParameterServerStrategy(c.resolver(), update_policy=policy)
    return strategy, tf.distribute.coordinator.ClusterCoordinator(strategy)


def _step(strategy, table, w, opt, loss_fn):
    @tf.function
    def step(*batch):
        def replica_fn(*batch):
            with tf.GradientTape() as tape:
                loss = loss_fn(*batch)
            opt.apply_gradients(zip(tape.gradient(loss, [table, w]), [table, w]))
            return loss
        return strategy.run(replica_fn, args=batch)
    return step


@scenario(shares_cluster=True)
def route_local_steps_one_worker(ids, x, y, table0, w0, lr=0.1, sync_every=3):
    """One worker; step j trains on ``ids[j]`` (int, [batch]), ``x[j]``
    ([batch, d]), ``y[j]`` ([batch]): pred = sum(table[id]) + x @ w, loss =
    mean((pred - y)^2) / 2, SGD(lr). Each step is scheduled and fetched on
    its own; after each, the PS copies of the table and of w are read. A
    join then pushes the rest."""
    with cluster(num_workers=1, num_ps=1) as c:
        strategy, coord = _strategy(c, sync_every)
        with strategy.scope():
            table = tf.Variable(table0, dtype=tf.float32, name="embeddings")
            w = tf.Variable(w0, dtype=tf.float32, name="dense/kernel")
            opt = tf_keras.optimizers.SGD(lr)

        def loss_fn(ids_j, x_j, y_j):
            pred = tf.reduce_sum(tf.gather(table, ids_j), axis=1) + tf.linalg.matvec(x_j, w)
            return 0.5 * tf.reduce_mean(tf.square(pred - y_j))

        step = _step(strategy, table, w, opt, loss_fn)
        tables, ws = [], []
        for j in range(len(ids)):
            coord.fetch(coord.schedule(step, args=(
                tf.constant(ids[j], tf.int32), tf.constant(x[j], tf.float32),
                tf.constant(y[j], tf.float32))))
            tables.append(table.numpy().tolist())
            ws.append(w.numpy().tolist())
        coord.join()
        return {"tables": tables, "ws": ws, "table": table.numpy().tolist(),
                "w": w.numpy().tolist(), "iterations": int(opt.iterations.numpy()),
                "part_updates": strategy.update_policy.part_updates(),
                "local_copies": sorted(
                    cp.master.name for cp in strategy.extended.engine.local._copies.values()),
                "stats": stats_of(strategy)}


@scenario(shares_cluster=True)
def route_local_steps_two_workers(steps=20, lr=0.5, sync_every=4, ids=(0, 1, 1)):
    """Two workers, loss = sum(table[ids]) + sum(w) (constant gradients: a
    row's gradient is its count in ``ids``, w's is 1): after the join the
    table row r is -lr * steps * count(r) and w is 2 - lr * steps exactly,
    whichever worker ran each step."""
    with cluster(num_workers=2, num_ps=1) as c:
        strategy, coord = _strategy(c, sync_every)
        with strategy.scope():
            table = tf.Variable(tf.zeros([3, 2]), name="embeddings")
            w = tf.Variable(tf.fill([4], 2.0), name="dense/kernel")
            opt = tf_keras.optimizers.SGD(lr)
        id_tensor = tf.constant(list(ids), tf.int32)

        def loss_fn():
            return tf.reduce_sum(tf.gather(table, id_tensor)) + tf.reduce_sum(w)

        step = _step(strategy, table, w, opt, loss_fn)
        for _ in range(steps):
            coord.schedule(step)
        coord.join()
        return {"table": table.numpy().tolist(), "w": w.numpy().tolist(),
                "iterations": int(opt.iterations.numpy()),
                "closures": strategy.closures_done_per_worker(),
                "part_updates": strategy.update_policy.part_updates(),
                "stats": stats_of(strategy)}
