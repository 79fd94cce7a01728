"""Scenarios of tests/test_bench.py."""

import tensorflow as tf

import tf_asyncps

from scenarios import cluster, scenario


@scenario(shares_cluster=True)
def straggler_counts(num_workers=2, slow_worker=0, delay_ms=30, steps=40):
    """tf_asyncps.straggler.slow_dataset_fn: closures taken by each worker,
    counted on the PS (ClusterCoordinator gives closures to free workers)."""
    from tf_asyncps.app.straggler import slow_dataset_fn
    with cluster(num_workers=num_workers, num_ps=1) as c:
        strategy = tf_asyncps.AsyncParameterServerStrategy(c.resolver())
        coord = tf.distribute.coordinator.ClusterCoordinator(strategy)
        with strategy.scope():
            counts = tf.Variable(tf.zeros([num_workers], tf.int64), trainable=False)

        def dataset_fn(ctx):
            return tf.data.Dataset.from_tensors(tf.constant(1, tf.int64)).repeat()

        slow = slow_dataset_fn(dataset_fn, slow_worker, delay_ms)
        it = iter(coord.create_per_worker_dataset(
            lambda: slow(tf.distribute.InputContext())))

        @tf.function
        def step(iterator):
            one = next(iterator)
            w = tf.cast(tf.distribute.coordinator.experimental_get_current_worker_index(),
                        tf.int64)
            counts.scatter_add(tf.IndexedSlices(tf.reshape(one, [1]), tf.reshape(w, [1])))

        for _ in range(steps):
            coord.schedule(step, args=(it,))
        coord.join()
        return {"counts": counts.numpy().tolist()}
