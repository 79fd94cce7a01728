"""tf_asyncps: asynchronous parameter-server training for TensorFlow 2.

Public API (see README.md):

* :class:`AsyncParameterServerStrategy`: a ``tf.distribute.ParameterServerStrategy``
  with pluggable update policies and staleness tracking.
* :class:`StalenessStats`: what ``strategy.staleness_stats()`` returns.
* :class:`EmbeddingCache`: ``AsyncParameterServerStrategy(embedding_cache=...)``,
  a bounded-staleness cache of hot embedding rows on each worker (HET).
* :mod:`tf_asyncps.policies`, :mod:`tf_asyncps.optimizers` (LockingOptimizer),
  :mod:`tf_asyncps.cluster` (LocalCluster, its ``supervise``), :mod:`tf_asyncps.callbacks`.
* :mod:`tf_asyncps.layers`: ``DynamicEmbedding`` (raw ids, fixed capacity,
  admission and eviction on the ps), ``EmbeddingCollection`` (many features'
  tables in one); ``tf_asyncps.keras3.DynamicEmbedding`` and
  ``tf_asyncps.keras3.EmbeddingCollection`` for Keras 3.
* :mod:`tf_asyncps.keras3`: Keras 3 ``model.fit``/``evaluate``/``predict`` on
  parameter servers (a model compiled in the strategy's scope gets them);
  :class:`DatasetFn`, its per-worker input.
* :class:`ResumeTracker`: counts chief runs and redone steps across crashes
  (with tf_keras ``BackupAndRestore``; :mod:`tf_asyncps.callbacks.recovery`).
* :mod:`tf_asyncps.export`: ``DeltaPublisher`` (table deltas every N steps for
  serving) and ``apply_deltas``/``DeltaLoader`` (a SavedModel brought up to date).

Submodules load on first use, so the command line can reject bad input
before TensorFlow is imported.
"""

import importlib
import sys

from tf_asyncps.compat import versions as _versions

__version__ = "0.1.0"  # the one place (pyproject.toml reads it)

# An unsupported TensorFlow fails here, naming the supported range and the
# pip command (read from package metadata: TensorFlow is not imported).
_versions.check()

_LAZY = {
    "AsyncParameterServerStrategy": ("tf_asyncps.strategy", "AsyncParameterServerStrategy"),
    "StalenessStats": ("tf_asyncps.core.staleness", "StalenessStats"),
    "EmbeddingCache": ("tf_asyncps.core.embedding_cache", "EmbeddingCache"),
    "SyncReplicasAggregator": ("tf_asyncps.policies.sync_replicas", "SyncReplicasAggregator"),
    "straggler": ("tf_asyncps.app.straggler", None),
    "policies": ("tf_asyncps.policies", None),
    "cluster": ("tf_asyncps.cluster", None),
    "callbacks": ("tf_asyncps.callbacks", None),
    "optimizers": ("tf_asyncps.optimizers", None),
    "recovery": ("tf_asyncps.callbacks.recovery", None),
    "keras3": ("tf_asyncps.keras3", None),
    "layers": ("tf_asyncps.layers", None),
    "DatasetFn": ("tf_asyncps.keras3.data", "DatasetFn"),
    "ResumeTracker": ("tf_asyncps.callbacks.recovery", "ResumeTracker"),
    "export": ("tf_asyncps.export", None),
}

__all__ = sorted(_LAZY) + ["__version__"]


def __getattr__(name):
    if name not in _LAZY:
        raise AttributeError(f"module 'tf_asyncps' has no attribute {name!r}")
    module, attr = _LAZY[name]
    value = importlib.import_module(module)
    if attr:
        value = getattr(value, attr)
    globals()[name] = value
    return value


def __dir__():
    return __all__


def _register_layers():
    """Makes DynamicEmbedding's and EmbeddingCollection's classes for each Keras
    this process has already imported, which registers them
    ("tf_asyncps>DynamicEmbedding", ...), so that a
    model file loaded after ``import tf_asyncps`` finds it. A Keras not yet
    imported is not imported here (import time): a process that imports
    tf_asyncps first imports ``tf_asyncps.layers`` (tf_keras) or
    ``tf_asyncps.keras3`` (Keras 3) before loading."""
    layers = ("tf_asyncps.layers.dynamic_embedding", "tf_asyncps.layers.embedding_collection")
    if "tf_keras" in sys.modules:
        for name in layers:
            importlib.import_module(name)
    keras = sys.modules.get("keras")
    if keras is not None and str(getattr(keras, "__version__", "")).startswith("3."):
        for name in layers:
            importlib.import_module(name).keras3_layer()


_register_layers()
