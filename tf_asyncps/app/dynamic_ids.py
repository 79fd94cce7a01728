"""The recommender job on raw ids (``--dynamic_ids``): table sizes, the
tables' counters for metrics.json, and the test-set evaluation.

With ``--dynamic_ids`` the MovieLens id columns hold the raw userId and
movieId, and each goes through a ``tf_asyncps.layers.DynamicEmbedding`` of
``--dynamic_capacity`` x (the column's distinct ids) rows instead of an
``Embedding`` over index-mapped ids. The trained model is evaluated where it
was trained (its id -> row maps live on the ps tasks), not through a
single-process copy.
"""

from typing import Any, Dict, Optional

import numpy as np
import tensorflow as tf

from tf_asyncps.callbacks.dynamic import dynamic_layers

__all__ = ["capacities", "spec", "dynamic_layers", "table_stats", "evaluate"]


def capacities(vocab: Dict[int, int], fraction: float) -> Dict[int, int]:
    """Rows of each id column's table: ``round(fraction * distinct ids)``, at
    least 1 (``vocab``: column -> distinct ids)."""
    return {col: max(1, int(round(fraction * n))) for col, n in sorted(vocab.items())}


def spec(cfg, data) -> Optional[Dict[str, Any]]:
    """``models.build_model``'s ``dynamic`` argument for ``cfg``, or None."""
    if not cfg.dynamic_ids:
        return None
    return {"capacity": capacities(data.vocab, cfg.dynamic_capacity),
            "evict_every": cfg.dynamic_evict_every}


def table_stats(model, data) -> Dict[str, Dict[str, Any]]:
    """Per DynamicEmbedding layer (by name, ``embedding_{column}``): its
    ``stats()`` (live_rows, capacity, evicted, refused), the column's
    distinct ids in all the data and in the training set, and the ps task of
    each table shard."""
    out = {}
    for layer in dynamic_layers(model):
        col = int(layer.name.rsplit("_", 1)[1])
        out[layer.name] = {
            **layer.stats(),
            "distinct_ids": int(data.vocab[col]),
            "train_distinct_ids": int(len(np.unique(data.x_train[:, col]))),
            "shards": [tf.DeviceSpec.from_string(s.device).task for s in layer.dynamic_table.shards]}
    return out


def evaluate(model, data, batch_size: int = 4096):
    """Test log loss, accuracy and class probabilities of the trained model,
    computed on the chief through the ps tasks' maps (no training lookups:
    ids without a row read the default row).

    Returns:
      (loss float, accuracy float, probabilities float32 [n, classes]).
    """
    logits = model.predict(data.x_test, batch_size=batch_size, verbose=0)
    probs = tf.nn.softmax(tf.cast(logits, tf.float32)).numpy()
    picked = probs[np.arange(len(data.y_test)), data.y_test]
    loss = float(np.mean(-np.log(np.maximum(picked, 1e-12))))
    accuracy = float(np.mean(np.argmax(probs, axis=1) == data.y_test))
    return loss, accuracy, probs
