"""Plain Keras 3 model.fit, evaluate and predict under AsyncParameterServerStrategy.

Run it as is to train on a local cluster of real processes (1 ps, 2 workers):

    python examples/keras3_fit.py

The only parameter-server lines are the strategy and its scope; the model,
compile, fit, evaluate, predict and save are Keras 3's own API. With
TF_CONFIG set (chief role) it joins that cluster instead; start the ps and
worker tasks with `tf-asyncps server` (see docs/guides/several_hosts.md).
"""

import contextlib
import os
import tempfile

import keras  # Keras 3
import numpy as np
import tensorflow as tf
from sklearn.datasets import load_digits

import tf_asyncps

DIGITS = load_digits()
X = (DIGITS.data / 16.0).astype("float32")
Y = DIGITS.target.astype("int64")


def train_fn(input_context):
    """Called once per worker; each worker reads its own shard, forever."""
    ds = tf.data.Dataset.from_tensor_slices((X[:1400], Y[:1400]))
    ds = ds.shard(input_context.num_input_pipelines, input_context.input_pipeline_id)
    return ds.shuffle(1400, seed=0).repeat().batch(32)


def main():
    if os.environ.get("TF_CONFIG"):
        cluster = contextlib.nullcontext(None)
    else:
        cluster = tf_asyncps.cluster.LocalCluster(num_workers=2, num_ps=1)
    with cluster as local:
        resolver = local.resolver() if local else tf_asyncps.cluster.cluster_resolver()
        strategy = tf_asyncps.AsyncParameterServerStrategy(resolver, update_policy="async")

        with strategy.scope():  # variables go to the ps; fit/evaluate/predict to the workers
            model = keras.Sequential([
                keras.Input(shape=(64,)),
                keras.layers.Dense(128, activation="relu"),
                keras.layers.Dense(10),
            ])
            model.compile(
                optimizer=keras.optimizers.SGD(0.1),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                metrics=["accuracy"])

        test = tf.data.Dataset.from_tensor_slices((X[1400:], Y[1400:])).batch(64)
        model.fit(tf_asyncps.keras3.DatasetFn(train_fn),
                  epochs=5, steps_per_epoch=100,  # steps are worker steps
                  validation_data=test,           # exact: each batch once, on the workers
                  callbacks=[tf_asyncps.callbacks.StalenessLogger(print_fn=print)],
                  verbose=0)  # the logger's epoch lines only (print_fn: also under verbose=0)
        loss, acc = model.evaluate(test, verbose=0)
        probs = model.predict(X[1400:], verbose=0)  # on the chief, rows in order
        with tempfile.TemporaryDirectory() as tmp:
            model.save(os.path.join(tmp, "digits.keras"))
            reloaded = keras.saving.load_model(os.path.join(tmp, "digits.keras"))
            same = bool(np.allclose(reloaded.predict(X[1400:], verbose=0), probs, atol=1e-6))
        stats = strategy.staleness_stats()
        print(f"test accuracy {acc:.3f}; reloaded model predicts the same: {same}; "
              f"applied {stats.applied} updates, tau mean {stats.mean:.2f}, max {stats.max}",
              flush=True)


if __name__ == "__main__":
    main()
