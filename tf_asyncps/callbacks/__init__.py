"""Callbacks for ``model.fit`` under AsyncParameterServerStrategy.

Steps run as closures on the workers, so every callback here for a fit under
the strategy works at epoch level and reads the parameter servers' counters
(``strategy.staleness_stats()``) or the chief's closure counts, never a batch
(``DynamicEviction`` is for a fit in one process).

* ``common.py``: what they share (console values, the strategy check);
* ``tf_keras.py``: :class:`StalenessLogger` (epoch lines, TensorBoard) and
  :class:`ProgressLine` (a live line): tf_keras callbacks that Keras 3's
  ``fit`` runs as well;
* ``keras3.py``: which callbacks Keras 3's ``fit`` accepts, and its epoch line;
* ``recovery.py``: :class:`ResumeTracker`, redone steps across crashes;
* ``dynamic.py``: :class:`DynamicEviction`, DynamicEmbedding eviction passes
  in a ``fit`` without the strategy (one process);
* ``checkpoint_backup.py``: :class:`CheckpointBackup`, Keras 3's
  ``BackupAndRestore`` in a ``tf.train.Checkpoint`` (DynamicEmbedding's map
  cannot go in Keras's ``.weights.h5``);
* ``step_backup.py``: :class:`StepBackup`, a backup every N worker steps
  (each at a drained schedule) and a mid-epoch resume, for both Kerases;
* ``delta_chain.py`` (with ``dirty_rows.py``, ``delta_files.py``): the delta
  backups StepBackup and ``tf_asyncps.export``'s stream write.

Names load on first use (as in the package root): importing one module here
does not import the other frameworks'.
"""

import importlib

_LAZY = {
    "StalenessLogger": "tf_asyncps.callbacks.tf_keras",
    "ProgressLine": "tf_asyncps.callbacks.tf_keras",
    "format_value": "tf_asyncps.callbacks.common",
    "ResumeTracker": "tf_asyncps.callbacks.recovery",
    "DynamicEviction": "tf_asyncps.callbacks.dynamic",
    "CheckpointBackup": "tf_asyncps.callbacks.checkpoint_backup",
    "StepBackup": "tf_asyncps.callbacks.step_backup",
}

# Literal (the docs' API check reads it from the source); the same names as _LAZY.
__all__ = ["CheckpointBackup", "DynamicEviction", "ProgressLine", "ResumeTracker",
           "StalenessLogger", "StepBackup", "format_value"]
assert sorted(__all__) == sorted(_LAZY)


def __getattr__(name):
    if name not in _LAZY:
        raise AttributeError(f"module 'tf_asyncps.callbacks' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


def __dir__():
    return __all__
