"""Keras layers for parameter-server training.

* :class:`DynamicEmbedding`: raw ids (int64 of any value, strings) in a
  table of fixed capacity on the parameter servers, with admission
  (``min_count``) and eviction (LFU/LRU, time-to-live). One name for both
  Kerases: it makes the tf_keras layer or the Keras 3 one
  (``tf_asyncps.keras3.DynamicEmbedding``) by the rule of
  :mod:`tf_asyncps.layers.keras_choice` (``keras=`` to say which).
* :class:`EmbeddingCollection`: many categorical features' tables in one
  table (rows offset per feature): one lookup and one gradient push per
  shard per step whatever the number of features; both Kerases, the same
  rule (``tf_asyncps.keras3.EmbeddingCollection`` for Keras 3).
* :class:`DynamicEmbeddingCollection`: many features' raw ids in one
  dynamic table (keys of feature and raw id): one lookup per shard per step
  whatever the number of features; both Kerases, the same rule.
"""

from tf_asyncps.layers import dynamic_embedding as _dynamic_embedding
from tf_asyncps.layers import embedding_collection as _embedding_collection
from tf_asyncps.layers import dynamic_collection as _dynamic_collection
from tf_asyncps.dynamic.table import DynamicTable

DynamicEmbedding = _dynamic_embedding.PICKED
"""``DynamicEmbedding(output_dim, capacity, key_dtype=tf.int64, min_count=1,
eviction="lfu", evict_every=1000, initializer="uniform", name=None,
ttl_steps=None, keras=None)``: the tf_keras layer
(``tf_asyncps.layers.dynamic_embedding.DynamicEmbedding``) or the Keras 3 one
(``tf_asyncps.keras3.DynamicEmbedding``), picked by ``keras=`` or by the rule
of :mod:`tf_asyncps.layers.keras_choice`; ``isinstance`` holds for both. The
arguments, the call and the errors: the classes' docstrings."""

EmbeddingCollection = _embedding_collection.PICKED
"""``EmbeddingCollection(input_dims, output_dim, *, embeddings_initializer="uniform",
name=None, keras=None)``: the tf_keras layer
(``tf_asyncps.layers.embedding_collection.EmbeddingCollection``) or the Keras 3
one (``tf_asyncps.keras3.EmbeddingCollection``), picked as ``DynamicEmbedding``
is; ``isinstance`` holds for both. The arguments, the call and the errors: the
classes' docstrings."""

DynamicEmbeddingCollection = _dynamic_collection.PICKED
"""``DynamicEmbeddingCollection(num_features, output_dim, capacity, min_count=1,
eviction="lfu", evict_every=1000, initializer="uniform", name=None,
ttl_steps=None, keras=None)``: the tf_keras layer
(``tf_asyncps.layers.dynamic_collection.DynamicEmbeddingCollection``) or the
Keras 3 one (``tf_asyncps.keras3.DynamicEmbeddingCollection``), picked as
``DynamicEmbedding`` is. The arguments, the call and the errors: the classes'
docstrings."""

__all__ = ["DynamicEmbedding", "DynamicEmbeddingCollection", "DynamicTable",
           "EmbeddingCollection"]
