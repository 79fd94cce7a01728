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

The backward pass mirrors it: the rows of repeated ids are summed on the
worker, so the ps receives one gradient row per distinct id, which is what
tf_keras's optimizers apply anyway (they de-duplicate in ``apply_gradients``)
and what Keras 3's sparse updates sum to. Values and updates are the same as
without it, up to float summation order. That backward is recorded as one
operation on the variable (``unsorted_segment_sum(dy, position)`` at
``unique``) rather than differentiated through the three ops above, whose
registered gradients rebuild shapes at run time for each table shard
(docs/benchmarks.md#ctr-step-cost-third-round).

Every path that reads rows of such a variable goes through its
``sparse_read`` (``tf.gather``, ``tf.nn.embedding_lookup``, tf_keras's
``Embedding``; Keras 3's ``Embedding`` through ``tf.nn.embedding_lookup``,
see keras3/trainer.py), so that is the one method replaced, on these
variables only (``compat.variables.replace_sparse_read``). In eager code
(the chief reading a table) nothing changes.

With ``AsyncParameterServerStrategy(wire_dtype="bfloat16")`` the rows read
cross as bfloat16: cast on the ps (colocated with the read), float32 again on
the worker, so the table stays float32 and only the bytes on the wire halve
(also with ``deduplicate_lookups=False``: then every id's row). Dense reads
(a Dense kernel, a bias) take the same two casts in core/wire_reads.py.
"""

import functools

import tensorflow as tf

from tf_asyncps.compat import graph as graph_compat
from tf_asyncps.compat import variables as variables_compat
from tf_asyncps.core import grads as grads_lib
from tf_asyncps.core import trace_context

__all__ = ["read_distinct_rows", "distinct_rows_gather", "every_id", "per_id_gradients"]


def every_id():
    """Row reads traced in this context read every id, as TensorFlow's gather
    (ids already distinct: a dynamic table's rows)."""
    return trace_context.entered(trace_context.EVERY_ID, True)


def per_id_gradients():
    """Row reads traced in this context read each distinct id once and give
    the variable a gradient row per id occurrence, as TensorFlow's gather.

    For Keras 3 models: Keras 3.15's Adam and Adagrad square each gradient row
    of a repeated id on its own (``ops.square`` of an IndexedSlices), where
    tf_keras and TensorFlow 1 sum the rows first; the gradient of a plain
    distinct-id read sums them, which would change those updates. Here the
    forward pass is the distinct-id read and the backward pass is recorded
    as one operation on the variable (compat/variables.py), so the
    optimizer gets what an every-id read gives; core/rowwise.py then sends
    each distinct id once with what the rule needs of its repeated rows.
    """
    return trace_context.entered(trace_context.PER_ID_GRADIENTS, True)


def distinct_rows_gather(sparse_read, indices, name=None, *, distinct=True,
                         wire_dtype=None, num_rows=None, variable=None):
    """``sparse_read(indices)`` with each distinct index read once.

    Args:
      sparse_read: the variable's own ``sparse_read(indices, name=None)``.
      indices: int32/int64 tensor of any shape, row ids.
      name: passed on to ``sparse_read``.
      distinct: False: every id read, as TensorFlow's gather (only the wire
        cast below applies).
      wire_dtype: None, or the dtype ("bfloat16") float32 rows cross in: cast
        on the ps, float32 again on the worker (inside functions only).
      num_rows: the variable's number of rows, or None; under 2**31 the distinct
        int64 ids cross as int32.
      variable: the variable read, for :func:`per_id_gradients` (None: the
        gradient is that of the distinct-id read).

    Returns:
      The rows, shape ``indices.shape + var.shape[1:]``, dtype of the variable,
      as ``sparse_read(indices)`` returns them.
    """
    indices = tf.convert_to_tensor(indices)
    op = getattr(indices, "op", None) if graph_compat.inside_function() else None
    if op is None:  # eager: a read on the chief, nothing to save
        return sparse_read(indices, name=name)
    if trace_context.EVERY_ID.get() or not distinct:
        return grads_lib.read_over_wire(sparse_read(indices, name=name), wire_dtype,
                                        back_with=op)
    if variable is None:
        return _distinct_read(sparse_read, indices, name, wire_dtype, num_rows, op)
    if trace_context.PER_ID_GRADIENTS.get():
        return _per_id_gradient_read(variable, sparse_read, indices, name, wire_dtype,
                                     num_rows, op)
    return _summed_gradient_read(variable, sparse_read, indices, name, wire_dtype, num_rows, op)


def _per_id_gradient_read(variable, sparse_read, indices, name, wire_dtype, num_rows, op):
    """The distinct-id read, whose gradient to ``variable`` is one row per id."""
    shape = variable.shape

    def backward(dy):
        with graph_compat.colocate_only_with(op):  # on the worker, beside the ids
            if shape[1:].is_fully_defined():
                rows = tf.reshape(dy, [-1] + shape[1:].as_list())
            else:
                rows = tf.reshape(dy, tf.concat([[-1], tf.shape(dy)[tf.rank(indices):]], 0))
            dense_shape = (tf.constant(shape.as_list(), tf.int64) if shape.is_fully_defined()
                           else tf.shape(variable, out_type=tf.int64))
            return tf.IndexedSlices(tf.cast(rows, variable.dtype), tf.reshape(indices, [-1]),
                                    dense_shape)

    return variables_compat.recorded_on_variable(
        variable, lambda: _distinct_read(sparse_read, indices, name, wire_dtype, num_rows, op,
                                         recorded=True)[0],
        backward)


def _summed_gradient_read(variable, sparse_read, indices, name, wire_dtype, num_rows, op):
    """The distinct-id read, whose gradient to ``variable`` is one summed row
    per distinct id at the read's own ``unique`` (known distinct)."""
    shape, held = variable.shape, {}

    def forward():
        out, held["unique"], held["position"] = _distinct_read(
            sparse_read, indices, name, wire_dtype, num_rows, op, recorded=True)
        return out

    def backward(dy):
        with graph_compat.colocate_only_with(op):  # on the worker, beside the ids
            rows = dy
            if indices.shape.rank != 1:
                rows = tf.reshape(dy, [-1] + shape[1:].as_list() if shape[1:].is_fully_defined()
                                  else tf.concat([[-1], tf.shape(dy)[tf.rank(indices):]], 0))
            wire = grads_lib.wire_dtype_of(rows.dtype, wire_dtype)
            if wire is not None:
                # The gradient of the read's two wire casts, as TensorFlow's
                # gradient of them gives it: each id's row in the wire dtype.
                rows = tf.cast(tf.cast(rows, wire), rows.dtype)
            unique = held["unique"]
            summed = tf.math.unsorted_segment_sum(rows, held["position"], tf.size(unique))
            return tf.IndexedSlices(tf.cast(summed, variable.dtype), unique,
                                    _dense_shape(variable, summed))

    return variables_compat.recorded_on_variable(variable, forward, backward)


def _dense_shape(variable, beside):
    """The gradient's dense_shape: ``variable``'s static shape as TensorFlow's
    gather gradient gives it (int32 where it fits), else read at run time."""
    shape = variable.shape
    if shape.is_fully_defined():
        dims = shape.as_list()
        return grads_lib.shared_constant(
            dims, tf.int32 if max(dims) <= tf.int32.max else tf.int64, beside)
    return tf.shape(variable, out_type=tf.int64)


def _distinct_read(sparse_read, indices, name, wire_dtype, num_rows, op, recorded=False):
    """The read itself. ``recorded``: its backward is recorded by the caller
    (returns ``(out, unique, position)``), else TensorFlow differentiates it."""
    # The ids' own device (the worker), not the variable's: only the distinct
    # ids and their rows cross.
    with graph_compat.colocate_only_with(op):
        flat = indices.shape.rank == 1  # a shard's ids: no reshape either way
        unique, position = tf.unique(indices if flat else tf.reshape(indices, [-1]))
        unique = grads_lib.narrow_indices(unique, num_rows)  # int32 on the wire
        grads_lib.mark_distinct(unique)  # its gradient's rows are distinct already
    rows = grads_lib.read_over_wire(sparse_read(unique, name=name), wire_dtype, back_with=op)
    with graph_compat.colocate_only_with(op):
        if not recorded:
            # The rows on the worker first: the gather's gradient takes the
            # shape of its params beside them, which would be one more
            # transfer from the ps every step if they were the ps's tensor.
            rows = tf.identity(rows)
        out = tf.gather(rows, position, axis=grads_lib.shared_constant(0, tf.int32, position))
        if not flat:
            row = rows.shape[1:]  # static: no shape read of the ps's tensor
            row = (tf.constant(row.as_list(), tf.int32) if row.is_fully_defined()
                   else tf.shape(rows, out_type=tf.int32)[1:])
            out = tf.reshape(out, tf.concat([tf.shape(indices, out_type=tf.int32), row], 0))
            out.set_shape(indices.shape.concatenate(rows.shape[1:]))
        return (out, unique, position) if recorded else out


def read_distinct_rows(var, *, distinct=True, wire_dtype=None) -> bool:
    """Makes ``var``'s row reads in functions read each distinct id once.

    Args:
      var: a ``tf.Variable`` of rank >= 2 (a table, or one shard of one).
      distinct: False: every id read (only ``wire_dtype`` applies).
      wire_dtype: None, or the dtype float32 rows cross in ("bfloat16").

    Returns:
      True if its reads were replaced (rank >= 2), else False.
    """
    if var.shape.rank is None or var.shape.rank < 2:
        return False
    return variables_compat.replace_sparse_read(var, functools.partial(
        distinct_rows_gather, distinct=distinct, wire_dtype=wire_dtype,
        num_rows=var.shape[0], variable=var))
