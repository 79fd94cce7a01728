"""Row reads of the strategy's tables: each distinct id crosses to the ps once.

An embedding lookup of a batch reads one row per id, and a batch of
recommender ids repeats itself (512 Zipf(1.2) ids hold ~240 distinct ones).
TensorFlow's gather sends every id to the ps that owns the row and returns
every row, duplicates included; its gradient is one row per id too. Here a
row read of a variable created under :class:`AsyncParameterServerStrategy`
(an unpartitioned table, or each shard of a partitioned one: TensorFlow's
``embedding_lookup`` on a ``ShardedVariable`` splits the ids per shard and
gathers from each shard) runs as::

    unique, position = tf.unique(ids)        # where the ids are (the worker)
    rows = var.sparse_read(unique)           # on the ps: distinct ids, rows
    out  = tf.gather(rows, position)         # on the worker: back to a row per id

The backward pass mirrors it: the gradient of ``tf.gather`` sums the rows of
repeated ids on the worker, so the ps receives one gradient row per distinct
id, which is what tf_keras's optimizers apply anyway (they de-duplicate in
``apply_gradients``) and what Keras 3's sparse updates sum to. Values and
updates are the same as without it, up to float summation order.

Every path that reads rows of such a variable goes through its
``sparse_read`` (``tf.gather``, ``tf.nn.embedding_lookup``, tf_keras's
``Embedding``; Keras 3's ``Embedding`` through ``tf.nn.embedding_lookup``,
see keras3/trainer.py), so that is the one method replaced, on these
variables only (``compat.tensorflow.replace_sparse_read``). In eager code
(the chief reading a table) nothing changes.
"""

import contextlib
import threading

import tensorflow as tf

from tf_asyncps.compat import tensorflow as tf_compat

__all__ = ["read_distinct_rows", "distinct_rows_gather", "every_id"]

_local = threading.local()


@contextlib.contextmanager
def every_id():
    """Row reads traced in this context read every id, as TensorFlow's gather.

    For Keras 3 models: Keras 3.15's Adam and Adagrad square each gradient row
    of a repeated id on its own (``ops.square`` of an IndexedSlices), where
    tf_keras and TensorFlow 1 sum the rows first; the gradient of a distinct-id
    read sums them, which would change those updates.
    """
    before = getattr(_local, "every_id", False)
    _local.every_id = True
    try:
        yield
    finally:
        _local.every_id = before


def distinct_rows_gather(sparse_read, indices, name=None):
    """``sparse_read(indices)`` with each distinct index read once.

    Args:
      sparse_read: the variable's own ``sparse_read(indices, name=None)``.
      indices: int32/int64 tensor of any shape, row ids.
      name: passed on to ``sparse_read``.

    Returns:
      The rows, shape ``indices.shape + var.shape[1:]``, dtype of the variable,
      as ``sparse_read(indices)`` returns them.
    """
    indices = tf.convert_to_tensor(indices)
    if getattr(_local, "every_id", False):
        return sparse_read(indices, name=name)
    op = getattr(indices, "op", None) if tf_compat.inside_function() else None
    if op is None:  # eager: a read on the chief, nothing to save
        return sparse_read(indices, name=name)
    # The ids' own device (the worker), not the variable's: only the distinct
    # ids and their rows cross.
    with tf_compat.colocate_only_with(op):
        unique, position = tf.unique(tf.reshape(indices, [-1]))
    rows = sparse_read(unique, name=name)
    with tf_compat.colocate_only_with(op):
        out = tf.gather(rows, position)
        shape = tf.concat([tf.shape(indices, out_type=tf.int32),
                           tf.shape(rows, out_type=tf.int32)[1:]], 0)
        out = tf.reshape(out, shape)
        out.set_shape(indices.shape.concatenate(rows.shape[1:]))
        return out


def read_distinct_rows(var) -> bool:
    """Makes ``var``'s row reads in functions read each distinct id once.

    Args:
      var: a ``tf.Variable`` of rank >= 2 (a table, or one shard of one).

    Returns:
      True if its reads were replaced (rank >= 2), else False.
    """
    if var.shape.rank is None or var.shape.rank < 2:
        return False
    return tf_compat.replace_sparse_read(var, distinct_rows_gather)
