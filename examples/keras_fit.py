"""Wrap your own tf_keras model.fit in AsyncParameterServerStrategy.

Run it as is to train on a local cluster of real processes (1 ps, 2 workers):

    python examples/keras_fit.py

With TF_CONFIG set (chief role) it joins that cluster instead; start the ps
and worker tasks with `tf-asyncps server` (see docs/guides/several_hosts.md).
"""

import contextlib
import os

import numpy as np
import tensorflow as tf
import tf_keras  # Keras 2: model.fit supports parameter-server training
from sklearn.datasets import load_digits

import tf_asyncps


def dataset_fn(input_context):
    """Called once per worker; each worker reads its own shard."""
    digits = load_digits()
    x = (digits.data[:1400] / 16.0).astype("float32")
    y = digits.target[:1400].astype("int64")
    ds = tf.data.Dataset.from_tensor_slices((x, y))
    ds = ds.shard(input_context.num_input_pipelines, input_context.input_pipeline_id)
    return ds.shuffle(1400, seed=0).repeat().batch(32)


def main():
    if os.environ.get("TF_CONFIG"):
        cluster = contextlib.nullcontext(None)
    else:
        cluster = tf_asyncps.cluster.LocalCluster(num_workers=2, num_ps=1)
    with cluster as local:
        resolver = local.resolver() if local else tf_asyncps.cluster.cluster_resolver()
        strategy = tf_asyncps.AsyncParameterServerStrategy(
            resolver, update_policy="async")

        with strategy.scope():  # variables are created on the ps
            model = tf_keras.Sequential([
                tf_keras.Input(shape=(64,)),
                tf_keras.layers.Dense(128, activation="relu"),
                tf_keras.layers.Dense(10),
            ])
            model.compile(
                optimizer=tf_keras.optimizers.SGD(0.1),
                loss=tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                metrics=["accuracy"])

        model.fit(
            tf_keras.utils.experimental.DatasetCreator(dataset_fn),
            epochs=5, steps_per_epoch=100,  # steps are worker steps
            callbacks=[tf_asyncps.callbacks.StalenessLogger(print_fn=print)],
            verbose=0)  # the logger's epoch lines only (print_fn: also under verbose=0)

        stats = strategy.staleness_stats()
        digits = load_digits()
        x_test = (digits.data[1400:] / 16.0).astype("float32")
        # predict runs on the chief, reading the variables from the ps.
        pred = np.argmax(model.predict(x_test, verbose=0), axis=1)
        acc = float(np.mean(pred == digits.target[1400:]))
        print(f"test accuracy {acc:.3f}; applied {stats.applied} updates, "
              f"tau mean {stats.mean:.2f}, max {stats.max}", flush=True)


if __name__ == "__main__":
    main()
