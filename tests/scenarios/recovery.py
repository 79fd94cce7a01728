"""Scenarios of tests/test_recovery.py."""

import os
import sys

import numpy as np
import tensorflow as tf
import tf_keras

import tf_asyncps

from scenarios import scenario
from scenarios.common import make_optimizer, mlp, small_problem, stats_of


@scenario
def fit_on_running_cluster(tf_config, policy, policy_args=None, epochs=2, steps_per_epoch=20):
    """A chief on ps/worker tasks it did not start (and that outlive it), as
    a re-run chief: model.fit of the small MLP; exact counters."""
    x, y = small_problem()
    config = tf_asyncps.cluster.validate_tf_config(tf_config)
    strategy = tf_asyncps.AsyncParameterServerStrategy(
        tf_asyncps.cluster.cluster_resolver(config),
        update_policy=tf_asyncps.policies.get(policy, **(policy_args or {})))

    def dataset_fn(ctx):
        return tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(16)

    with strategy.scope():
        model = mlp()
        model.compile(make_optimizer("sgd", 0.1),
                      tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(tf_keras.utils.experimental.DatasetCreator(dataset_fn), epochs=epochs,
              steps_per_epoch=steps_per_epoch, verbose=0)
    return {"stats": stats_of(strategy), "iterations": int(model.optimizer.iterations.numpy())}


@scenario
def checkpoint_crash(backup_dir, crash_at="state"):
    """A process that crashes (os._exit) inside its second epoch-end
    BackupAndRestore save: after the new checkpoint's data is written but
    before the ``checkpoint`` state file names it (``crash_at="state"``), or
    before the shards are merged into it (``"merge"``). Returns (if it does
    not crash) nothing useful; the first checkpoint's weights are saved to
    ``backup_dir/../epoch1_weights.npz`` for the test to compare."""
    from tensorflow.python.checkpoint import checkpoint_management, functional_saver
    x, y = small_problem()
    model = mlp()
    model.compile(tf_keras.optimizers.SGD(0.1),
                  tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    backup = lambda: tf_keras.callbacks.BackupAndRestore(backup_dir, delete_checkpoint=False)
    model.fit(x, y, epochs=1, batch_size=32, verbose=0, callbacks=[backup()])
    np.savez(os.path.join(os.path.dirname(backup_dir), "epoch1_weights.npz"),
             *model.get_weights())

    def crash(*args, **kwargs):
        sys.stdout.flush()
        os._exit(17)

    if crash_at == "state":
        checkpoint_management.update_checkpoint_state_internal = crash
    else:
        functional_saver.gen_io_ops.merge_v2_checkpoints = crash
    model.fit(x, y, epochs=2, batch_size=32, verbose=0, callbacks=[backup()])
    return {"crashed": False}
