"""Keras layers for parameter-server training.

* :class:`DynamicEmbedding`: raw ids (int64 of any value, strings) in a
  table of fixed capacity on the parameter servers, with admission
  (``min_count``) and eviction (LFU/LRU, time-to-live). One name for both
  Kerases: it makes the tf_keras layer or the Keras 3 one
  (``tf_asyncps.keras3.DynamicEmbedding``) by the rule of
  :mod:`tf_asyncps.layers.keras_choice` (``keras=`` to say which).
"""

from tf_asyncps.layers.dynamic_embedding import PICKED as DynamicEmbedding
from tf_asyncps.layers.dynamic_table import DynamicTable

__all__ = ["DynamicEmbedding", "DynamicTable"]
