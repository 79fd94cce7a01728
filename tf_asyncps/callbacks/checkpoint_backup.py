"""Keras 3 ``BackupAndRestore`` written as a TensorFlow checkpoint.

Keras 3's own ``BackupAndRestore`` writes ``latest.weights.h5``, which holds
variables by position: a ``DynamicEmbedding``'s id -> row map cannot be one
of them, so that layer refuses such files. :class:`CheckpointBackup` does the
same job with ``tf.train.Checkpoint`` (model and optimizer), which holds the
map, the live rows and their optimizer slots (dynamic/checkpoint.py), as
tf_keras's ``BackupAndRestore`` does.
"""

import os
import shutil

import keras
import tensorflow as tf

from tf_asyncps.callbacks.dynamic import dynamic_layers, maps_to_rehome
from tf_asyncps.compat import checkpoint as checkpoint_compat
from tf_asyncps.compat import keras_models as models_compat

__all__ = ["CheckpointBackup"]


class CheckpointBackup(keras.callbacks.Callback):
    """Backs a Keras 3 ``fit`` up at each epoch end and resumes it: Keras 3's
    ``BackupAndRestore(backup_dir)`` with ``save_freq="epoch"``, in a
    ``tf.train.Checkpoint`` of the model and its optimizer.

    At train begin it restores the newest checkpoint in ``backup_dir`` (if
    any; the optimizer is built first, as Keras does) and the fit goes on
    from the epoch after the one it was written at; at each epoch end it
    writes ``backup_dir/ckpt-E`` (E: epochs done; the older one is removed);
    at train end it deletes ``backup_dir`` if ``delete_checkpoint``. Under
    AsyncParameterServerStrategy the chief writes and reads it (the ps tasks
    send their variables). A fit that crashes mid-epoch resumes from the
    start of that epoch, as with Keras's callback. A DynamicEmbedding
    restored onto more ps tasks than it was written over re-homes its ids
    at the first lookup; the new shards' id -> row maps, in no checkpoint,
    are the only objects allowed to be unmatched.

    Args:
      backup_dir: str, the folder of the checkpoints (made if missing); one
        per job.
      delete_checkpoint: bool, remove ``backup_dir`` once the fit ends.

    Raises:
      ValueError: ``backup_dir`` is empty; the model is a tf_keras model (use
        ``tf_keras.callbacks.BackupAndRestore``, which writes a TensorFlow
        checkpoint already); at train begin, the model is not built.
      tf.errors.OpError / AssertionError: the checkpoint does not match the
        model (TensorFlow's restore check, but for those maps).
    """

    def __init__(self, backup_dir, delete_checkpoint=True):
        super().__init__()
        if not isinstance(backup_dir, (str, os.PathLike)) or not str(backup_dir):
            raise ValueError(f"CheckpointBackup(backup_dir={backup_dir!r}): give a folder path "
                             "(one per job).")
        self.backup_dir = os.fspath(backup_dir)
        self.delete_checkpoint = bool(delete_checkpoint)
        self._manager = None

    def _checkpoint(self):
        objects = {"model": self.model}
        if getattr(self.model, "optimizer", None) is not None:
            objects["optimizer"] = self.model.optimizer
        return tf.train.Checkpoint(**objects)

    def set_model(self, model):
        # Here, not at train begin: tf_keras's CallbackList calls set_model first.
        if not models_compat.is_keras3_model(model):
            raise ValueError("CheckpointBackup is for Keras 3 models; a tf_keras model's "
                             "tf_keras.callbacks.BackupAndRestore(backup_dir) writes a "
                             "TensorFlow checkpoint already.")
        super().set_model(model)

    def on_train_begin(self, logs=None):
        if not self.model.built:
            raise ValueError("CheckpointBackup: build the model before fit (call it on a "
                             "batch, or give it an Input), as Keras's BackupAndRestore needs.")
        checkpoint = self._checkpoint()
        self._manager = tf.train.CheckpointManager(checkpoint, self.backup_dir, max_to_keep=1)
        path = self._manager.latest_checkpoint
        if path is None:
            return
        optimizer = getattr(self.model, "optimizer", None)
        # Under the strategy fit builds it per shard, and the slots read here
        # go in then (compat.sharded_slots); in one process as Keras does.
        if optimizer is not None and not optimizer.built and \
                models_compat.model_strategy(self.model) is None:
            optimizer.build(self.model.trainable_variables)
        status = checkpoint.read(path)
        checkpoint_compat.assert_matched_except(status, maps_to_rehome(self.model))
        for layer in dynamic_layers(self.model):
            if optimizer is not None and not layer.under_strategy:  # (the strategy's
                layer.use_optimizer(optimizer, self.model.trainable_variables)  # updates do)
        models_compat.set_initial_epoch(self.model, int(path.rsplit("-", 1)[1]))

    def on_epoch_end(self, epoch, logs=None):
        self._manager.save(checkpoint_number=epoch + 1)

    def on_train_end(self, logs=None):
        if self.delete_checkpoint:
            shutil.rmtree(self.backup_dir, ignore_errors=True)
