"""TensorFlow checkpoint internals (TF 2.21.0; the ``Trackable`` save and
restore protocol exists since TF 2.11): an object that writes tensors of
its own making into a ``tf.train.Checkpoint`` and gets them back at restore.

Kept apart from :mod:`tf_asyncps.compat.tensorflow` (the 600-line limit);
importable without TensorFlow being imported first.
"""

__all__ = ["checkpointed_tensors"]

_CLASS = []


def checkpointed_tensors(save, restore):
    """A trackable object: assigned to a tracked attribute (``tf.Module``,
    Keras layer), its checkpoint entries are ``save()`` and a restore calls
    ``restore(tensors)``.

    TensorFlow 2.21's ``Trackable._serialize_to_tensors`` /
    ``_restore_from_tensors``: each entry must be one whole tensor (TF's
    restore of a ``Trackable`` maps several slices of one name by position,
    wrongly). A restore reads an entry by name and dtype only: its shape may
    differ from what ``save()`` gives now (another number of shards).

    Args:
      save: ``save() -> {name: tensor}``; called at each save, and at a
        restore for the names and dtypes to read.
      restore: ``restore({name: tensor}) -> op or None``; called once the
        entries are read (eagerly in TF2's eager restore; also for a
        restore deferred until this object is attached).

    Returns:
      The object (a ``tf.__internal__.tracking.Trackable``).
    """
    if not _CLASS:
        from tensorflow.python.trackable import base

        class CheckpointedTensors(base.Trackable):
            def __init__(self, save, restore):
                super().__init__()
                self._asyncps_save, self._asyncps_restore = save, restore

            def _serialize_to_tensors(self):
                return self._asyncps_save()

            def _restore_from_tensors(self, restored_tensors):
                return self._asyncps_restore(restored_tensors)

        _CLASS.append(CheckpointedTensors)
    return _CLASS[0](save, restore)
