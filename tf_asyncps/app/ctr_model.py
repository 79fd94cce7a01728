"""The CTR job's model: DLRM (Naumov et al., "Deep Learning Recommendation
Model for Personalization and Recommendation Systems", 2019), tf_keras or Keras 3.

::

    dense  [batch, 13] -> bottom MLP (ReLU, sizes bottom + [dim]) -> b [batch, dim]
    sparse [batch, 26] -> one row of width dim per feature      -> E [batch, 26, dim]
    X = [b, E] [batch, 27, dim];  Z = X X^T;  the 351 entries above Z's diagonal
    top MLP (ReLU, sizes top) on [b, those entries] -> Dense(1) -> logit [batch, 1]

The rows come from one of five ``embedding`` kinds:

* ``tables``: one ``Embedding(rows[f], dim)`` per feature (as users write it);
* ``offset``: one ``Embedding(sum(rows), dim)`` read at ``id + offset[f]``,
  ``offset[f] = rows[0] + ... + rows[f-1]`` (the one-table model a user
  writes in a few lines, without this project's layers);
* ``collection``: one ``tf_asyncps.layers.EmbeddingCollection(rows, dim)``
  (the 26 tables as row ranges of one variable);
* ``dynamic``: one ``tf_asyncps.layers.DynamicEmbedding(dim, capacity[f])``
  per feature on raw int64 ids (admission, LFU eviction);
* ``dynamic_collection``: one ``tf_asyncps.layers.DynamicEmbeddingCollection(26,
  dim, sum(capacity))`` on the raw ids reduced to 56 bits (the layer's key
  holds the feature above them): one dynamic table for all features.
"""

from typing import Optional, Sequence

import numpy as np
import tensorflow as tf
import tf_keras

from tf_asyncps.app.ctr_data import NUM_DENSE

__all__ = ["EMBEDDINGS", "RAW_ID_EMBEDDINGS", "build", "interaction_width"]

EMBEDDINGS = ("tables", "offset", "collection", "dynamic", "dynamic_collection")
#: The kinds fed raw int64 ids.
RAW_ID_EMBEDDINGS = ("dynamic", "dynamic_collection")


def interaction_width(num_features: int, dim: int) -> int:
    """Width of the top MLP's input: dim + (F+1) F / 2."""
    return dim + (num_features + 1) * num_features // 2


class _DotInteraction:
    """DLRM's dot interaction: inputs ``[b [batch, dim], E [batch, F, dim]]``
    -> ``[batch, dim + (F+1)F/2]``: b, then the entries above the diagonal of
    X X^T for X = [b, E] [batch, F+1, dim]."""

    def call(self, inputs):
        bottom, rows = inputs
        x = tf.concat([bottom[:, None, :], tf.cast(rows, bottom.dtype)], axis=1)
        z = tf.matmul(x, x, transpose_b=True)  # [batch, F+1, F+1]
        n = x.shape[1]
        i, j = np.triu_indices(n, 1)
        pairs = tf.gather(tf.reshape(z, [-1, n * n]), i * n + j, axis=1)
        return tf.concat([bottom, pairs], axis=1)

    def compute_output_shape(self, input_shapes):
        bottom, rows = input_shapes
        return (bottom[0], interaction_width(rows[1], bottom[1]))


class DotInteraction(_DotInteraction, tf_keras.layers.Layer):
    """The tf_keras layer (``_DotInteraction``)."""


_KERAS3 = []


def _dot_interaction(k):
    """The DotInteraction layer class of Keras ``k`` (Keras 3's made once)."""
    if not _is_keras3(k):
        return DotInteraction
    if not _KERAS3:
        import keras

        class Keras3DotInteraction(_DotInteraction, keras.layers.Layer):
            """The Keras 3 layer (``_DotInteraction``)."""

        _KERAS3.append(Keras3DotInteraction)
    return _KERAS3[0]


def _is_keras3(k) -> bool:
    return k is not tf_keras


def _rows(k, sparse, rows, dim, embedding, seed, dynamic):
    """E [batch, F, dim] of the ``sparse`` input by ``embedding``."""
    init = k.initializers.RandomUniform(-0.05, 0.05, seed=seed + 7)
    f = len(rows)
    keras_name = "keras3" if _is_keras3(k) else "tf_keras"
    if embedding == "collection":
        try:
            from tf_asyncps.layers import EmbeddingCollection
        except ImportError as e:
            raise ValueError(f"--ctr_embedding=collection needs tf_asyncps.layers."
                             f"EmbeddingCollection, which this install lacks ({e}); use "
                             f"--ctr_embedding=tables.") from None
        return EmbeddingCollection(list(rows), dim, embeddings_initializer=init,
                                   name="embedding_collection", keras=keras_name)(sparse)
    if embedding == "dynamic_collection":
        from tf_asyncps.layers import DynamicEmbeddingCollection
        from tf_asyncps.layers.dynamic_collection import ID_BITS
        mask = (1 << ID_BITS) - 1
        short = k.layers.Lambda(lambda x: tf.bitwise.bitwise_and(x, mask),
                                output_shape=lambda shape: shape, name="raw_ids_56")(sparse)
        return DynamicEmbeddingCollection(
            f, dim, capacity=int(sum(dynamic["capacity"])), evict_every=dynamic["evict_every"],
            initializer=init, name="embedding_collection", keras=keras_name)(short)
    if embedding == "offset":
        offsets = np.cumsum([0] + list(rows[:-1])).astype(np.int32)
        shifted = k.layers.Lambda(lambda x: x + offsets, name="offset_ids")(sparse)
        return k.layers.Embedding(int(sum(rows)), dim, embeddings_initializer=init,
                                  name="embedding")(shifted)
    stack = k.layers.Reshape((f, dim))
    parts = []
    if embedding == "dynamic":
        from tf_asyncps.layers import DynamicEmbedding
        for i in range(f):
            parts.append(DynamicEmbedding(
                dim, capacity=dynamic["capacity"][i], evict_every=dynamic["evict_every"],
                initializer=init, name=f"embedding_{i}", keras=keras_name)(sparse[:, i]))
    elif embedding == "tables":
        for i in range(f):
            parts.append(k.layers.Embedding(rows[i], dim, embeddings_initializer=init,
                                            name=f"embedding_{i}")(sparse[:, i]))
    else:
        raise ValueError(f"--ctr_embedding={embedding!r} is unknown; choose one of "
                         f"{list(EMBEDDINGS)}.")
    return stack(k.layers.Concatenate(axis=1)(parts))


def build(rows: Sequence[int], dim: int = 16, bottom=(64,), top=(256, 128), seed: int = 0,
          embedding: str = "tables", keras=None, dynamic: Optional[dict] = None):
    """Builds the uncompiled DLRM (outputs logits).

    Args:
      rows: ids per categorical feature (ints >= 1; the tables' rows).
      dim: embedding width and the bottom MLP's last width (int >= 1).
      bottom: the bottom MLP's hidden sizes before its last layer (of ``dim``).
      top: the top MLP's hidden sizes; a Dense(1) follows.
      seed: initialiser seed.
      embedding: "tables", "offset", "collection", "dynamic" or "dynamic_collection"
        (module docstring).
      keras: tf_keras (default) or Keras 3 (``keras``).
      dynamic: for the dynamic kinds: ``{"capacity": [rows per feature], "evict_every":
        int}`` (``dynamic_collection``: one table of their sum).

    Inputs: ``{"dense": float32 [batch, 13], "sparse": int32 [batch, F]}``
    (int64 raw ids for the dynamic kinds); output float32 logits ``[batch, 1]``.

    Raises:
      ValueError: an unknown ``embedding``, or "collection" where
        ``tf_asyncps.layers.EmbeddingCollection`` does not exist, naming the fix.
    """
    k = keras or tf_keras
    if embedding not in EMBEDDINGS:
        raise ValueError(f"--ctr_embedding={embedding!r} is unknown; choose one of "
                         f"{list(EMBEDDINGS)}.")
    dense = k.Input(shape=(NUM_DENSE,), name="dense", dtype="float32")
    sparse = k.Input(shape=(len(rows),), name="sparse",
                     dtype="int64" if embedding in RAW_ID_EMBEDDINGS else "int32")
    glorot = lambda i: k.initializers.GlorotUniform(seed=seed + i)
    h = dense
    for i, size in enumerate(tuple(bottom) + (dim,)):
        h = k.layers.Dense(size, activation="relu", kernel_initializer=glorot(i),
                           name=f"bottom_{i}")(h)
    e = _rows(k, sparse, rows, dim, embedding, seed, dynamic)
    h = _dot_interaction(k)(name="interaction")([h, e])
    for i, size in enumerate(top):
        h = k.layers.Dense(size, activation="relu", kernel_initializer=glorot(50 + i),
                           name=f"top_{i}")(h)
    logits = k.layers.Dense(1, kernel_initializer=glorot(99), name="logit")(h)
    policy = k.mixed_precision.global_policy() if not _is_keras3(k) else k.config.dtype_policy()
    if policy.compute_dtype != "float32":
        logits = k.layers.Activation("linear", dtype="float32")(logits)
    return k.Model({"dense": dense, "sparse": sparse}, logits, name="dlrm")
