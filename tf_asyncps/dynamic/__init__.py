"""Dynamic embedding tables: rows handed to raw ids at run time, on the ps.

The machinery under the Keras layers (:mod:`tf_asyncps.layers`, which
makes the table variable and hands it here), framework-neutral: it imports
only :mod:`tf_asyncps.compat` and :mod:`tf_asyncps.core`.

* :mod:`~tf_asyncps.dynamic.table`: ``DynamicTable``, the id -> row map
  beside each shard and admission (counting filter, ``min_count``).
* :mod:`~tf_asyncps.dynamic.eviction`: which rows go, and when (LFU/LRU,
  time-to-live).
* :mod:`~tf_asyncps.dynamic.initializers`: fresh values for rows reset at
  run time.
* :mod:`~tf_asyncps.dynamic.slots`: the optimizer's slots of a table shard.
* :mod:`~tf_asyncps.dynamic.checkpoint`: the table's checkpoint, live rows
  only.
* :mod:`~tf_asyncps.dynamic.reshard`: a restore onto another number of
  shards.
* :mod:`~tf_asyncps.dynamic.generations`: row generations under
  ``local_sgd`` (no stale delta on a row that was reset).

The public name is ``tf_asyncps.layers.DynamicTable``; this package holds
the modules only.
"""
