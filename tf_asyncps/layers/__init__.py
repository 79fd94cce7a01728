"""Keras layers for parameter-server training.

* :class:`DynamicEmbedding`: raw ids (int64 of any value, strings) in a
  table of fixed capacity on the parameter servers, with admission
  (``min_count``) and eviction (LFU/LRU, time-to-live); tf_keras.
  ``tf_asyncps.keras3.DynamicEmbedding`` is the Keras 3 layer.
"""

from tf_asyncps.layers.dynamic_embedding import DynamicEmbedding
from tf_asyncps.layers.dynamic_table import DynamicTable

__all__ = ["DynamicEmbedding", "DynamicTable"]
