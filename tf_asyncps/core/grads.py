"""Gradient helpers: dense tensors and ``tf.IndexedSlices`` alike.

Every helper keeps a sparse gradient sparse (indices and dense_shape kept),
so embedding gradients never densify on their way to the PS. Policies use
:func:`map_values`, :func:`scale` and :func:`all_finite`; the engine uses
:func:`cast`, :func:`copy_to` and :func:`sum_parts`; row reads
(core/lookup.py) use :func:`narrow_indices`, as :func:`copy_to` does. The
wire dtype's rule (what crosses narrower, and where it is cast) is here
once: :func:`wire_dtype_of` for gradients (:func:`copy_to`) and reads
(:func:`read_over_wire`: core/lookup.py's rows, core/wire_reads.py's dense
reads).
"""

import functools
import weakref

import tensorflow as tf

from tf_asyncps.compat import graph as graph_compat

__all__ = ["map_values", "scale", "all_finite", "cast", "copy_to", "sum_parts",
           "flat_tensors", "unique_rows", "mark_distinct", "known_distinct", "narrow_indices",
           "wire_dtype_of", "read_over_wire", "shared_constant"]


def map_values(fn, grad):
    """Applies ``fn`` to a dense gradient or to the values of IndexedSlices
    (indices and dense_shape kept: sparse stays sparse)."""
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(fn(grad.values), grad.indices, grad.dense_shape)
    return fn(grad)


def scale(grad, factor):
    """``grad * factor`` with ``factor`` cast to the gradient's dtype."""
    return map_values(lambda v: v * tf.cast(factor, v.dtype), grad)


def cast(grad, dtype):
    """``grad`` (tensor or IndexedSlices) cast to ``dtype``; unchanged when it
    already has that dtype or ``dtype`` is not floating (int counters)."""
    dtype = tf.as_dtype(dtype).base_dtype
    if grad.dtype.base_dtype == dtype or not dtype.is_floating:
        return grad
    return map_values(lambda v: tf.cast(v, dtype), grad)


#: Gradients under this many elements are checked together (one copy of
#: them, flattened): a check per gradient is two ops per variable, which a
#: step of many small gradients pays in dispatch (docs/benchmarks.md#after-the-cuts).
_CHECK_TOGETHER_BELOW = 1 << 16


def all_finite(grads) -> tf.Tensor:
    """Scalar tf.bool: every element of every gradient is finite.

    Gradients (tensors, or the values of IndexedSlices) of one dtype with
    fewer than 65,536 elements each (or of a shape unknown when traced) are
    flattened and checked as one tensor; larger ones each alone, without
    a copy."""
    checks, small = [], {}
    for g in grads:
        v = g.values if isinstance(g, tf.IndexedSlices) else g
        if not (v.dtype.is_floating or v.dtype.is_complex):
            continue
        n = v.shape.num_elements()
        if n is not None and n >= _CHECK_TOGETHER_BELOW:
            checks.append(tf.reduce_all(tf.math.is_finite(v)))
        else:
            small.setdefault(v.dtype, []).append(v)
    for group in small.values():
        if len(group) == 1:
            checks.append(tf.reduce_all(tf.math.is_finite(group[0])))
            continue
        flat = tf.constant([-1], tf.int32)
        together = tf.concat([tf.reshape(v, flat) for v in group], 0)
        checks.append(tf.reduce_all(tf.math.is_finite(together)))
    if not checks:
        return tf.constant(True)
    return checks[0] if len(checks) == 1 else tf.reduce_all(tf.stack(checks))


def rows_on_ps(grad, on_ps):
    """``grad`` with the indices of a gather of rows on a ps taken from the
    ps, as they are, and the values reshaped on the worker without their
    size: the indices then never cross to the worker and back. Any other
    gradient as it is.

    Args:
      grad: a gradient (tensor or IndexedSlices).
      on_ps: ``on_ps(indices) -> bool``: whether a gather's 1-D int
        indices are distinct rows built on the variable's ps (a dynamic
        table's lookup; the tables answer through the engine, see
        core/table_seam.py). :func:`unique_rows` and :func:`copy_to` given
        the same ``on_ps`` leave such a gradient alone.
    """
    parts = graph_compat.gather_gradient_parts(grad)
    if parts is None or not on_ps(parts[1]) or parts[1].shape.rank != 1 or \
            not grad.values.shape[1:].is_fully_defined():
        return grad
    upstream, indices = parts
    values = tf.reshape(upstream, [-1] + grad.values.shape[1:].as_list())
    return tf.IndexedSlices(values, indices, grad.dense_shape)


def unique_rows(grad, on_ps=None):
    """``grad`` with one row per distinct index: the rows of repeated indices
    of an IndexedSlices summed (``tf.unique`` order); a dense gradient as is.

    What tf_keras's optimizers do in ``apply_gradients`` (and what Keras 3's
    do implicitly: their sparse updates scatter-add or densify, both sums), so
    the update is the same; done on the worker, only distinct rows cross to
    the ps (a batch of 512 Zipf ids holds ~240 distinct). ``on_ps``: as in
    :func:`rows_on_ps`; rows it names, and indices :func:`known_distinct`
    knows, are distinct already and left alone. The result's indices are
    recorded distinct (:func:`mark_distinct`), and so are their copies made by
    :func:`copy_to`.
    """
    if not isinstance(grad, tf.IndexedSlices):
        return grad
    if (on_ps is not None and on_ps(grad.indices)) or known_distinct(grad.indices):
        mark_distinct(grad.indices)  # e.g. the gradient of a distinct-id read
        return grad
    unique, position = tf.unique(grad.indices)
    values = tf.math.unsorted_segment_sum(grad.values, position, tf.shape(unique)[0])
    mark_distinct(unique)
    return tf.IndexedSlices(values, unique, grad.dense_shape)


# graph -> names of its index tensors that hold no index twice.
_DISTINCT = weakref.WeakKeyDictionary()


def mark_distinct(indices) -> None:
    """Records that ``indices`` (an int tensor of a traced graph: a
    ``tf.unique`` output, or a copy of distinct rows' indices) holds no
    index twice: :func:`unique_rows` then leaves a gradient at them as it is,
    and the optimizer's own de-duplication on the ps is skipped
    (core/update.py). Eager tensors are not recorded."""
    if not tf.executing_eagerly() and hasattr(indices, "graph"):
        _DISTINCT.setdefault(indices.graph, set()).add(indices.name)


def known_distinct(indices) -> bool:
    """Whether :func:`mark_distinct` recorded ``indices``, or the tensor a
    ``Reshape`` made them from (a ``ResourceGather``'s gradient reshapes its
    indices: core/lookup.py's distinct-id reads)."""
    t = indices
    for _ in range(2):
        try:
            if t.name in _DISTINCT.get(t.graph, ()):
                return True
            if t.op.type != "Reshape":
                return False
        except AttributeError:  # an eager tensor
            return False
        t = t.op.inputs[0]
    return False


# graph -> {(placement, dtype, value): the constant made there}
_CONSTANTS = weakref.WeakKeyDictionary()


def shared_constant(value, dtype, beside):
    """``tf.constant(value, dtype)`` made once per graph and placement.

    A step repeats the same small constants (an axis, a slice's bounds, a
    zero) for every table shard and variable, and each constant is one more
    op of every step: ops that share a placement share them. The constant
    has no control inputs (it has no effect to order).

    Args:
      value: a Python number or (nested) list of numbers.
      dtype: its dtype.
      beside: an op or tensor just made in the caller's scope, of the graph
        being built: the constant is placed as it is (on its device where it
        names one, else with its colocation).

    Returns:
      A constant tensor of ``dtype``; a new one in eager mode.
    """
    op = getattr(beside, "op", beside)
    graph = tf.compat.v1.get_default_graph()
    if tf.executing_eagerly() or getattr(op, "graph", None) is not graph:
        return tf.constant(value, dtype)
    dtype = tf.as_dtype(dtype)
    if op.device:
        where, place = op.device, functools.partial(graph_compat.on_device_only, op.device)
    else:  # with the caller's colocation (its own group aside), no control inputs
        own = b"loc:@" + op.name.encode()
        where = tuple(g for g in op.colocation_groups() if g != own)
        place = functools.partial(tf.control_dependencies, None)
    made = _CONSTANTS.setdefault(graph, {})
    key = (where, dtype.name, repr(value))
    if key not in made:
        with place():
            made[key] = tf.constant(value, dtype)
    return made[key]


_INT32_MAX = 2 ** 31 - 1


def _packable(values, indices, rows) -> bool:
    """True if an IndexedSlices can cross as one tensor with int32 indices:
    int64 (or int32) indices of a table under 2**31 rows, rows of a static
    shape, in a dtype whose bits the indices can be laid into."""
    return (rows is not None and rows < _INT32_MAX
            and indices.dtype in (tf.int32, tf.int64)
            and values.dtype in (tf.float32, tf.bfloat16, tf.float16)
            and values.shape.rank is not None and values.shape.rank >= 1
            and values.shape[1:].is_fully_defined()
            and values.shape[1:].num_elements() > 0)


def wire_dtype_of(dtype, wire_dtype):
    """The dtype a value of ``dtype`` crosses the network in under the
    strategy's ``wire_dtype``: the wire dtype for a float32 value, None where
    the value crosses as it is (other dtypes; no wire dtype, or float32)."""
    if wire_dtype is None or dtype != tf.float32:
        return None
    wire = tf.as_dtype(wire_dtype)
    return None if wire == tf.float32 else wire


def read_over_wire(value, wire_dtype, back_with=None):
    """``value``, just read on its ps, as its reader sees it: cast to the wire
    dtype beside the read (on the ps) and to float32 again beside
    ``back_with`` (an op; None: in the caller's device scope, the worker's),
    so only the bytes that cross change. Returned as it is where
    :func:`wire_dtype_of` says it crosses as it is."""
    wire = wire_dtype_of(value.dtype, wire_dtype)
    if wire is None:
        return value
    with graph_compat.colocate_only_with(value.op):
        value = tf.cast(value, wire)
    if back_with is None:
        return tf.cast(value, tf.float32)
    with graph_compat.colocate_only_with(back_with):
        return tf.cast(value, tf.float32)


def narrow_indices(indices, rows):
    """int64 row indices of a table of ``rows`` rows (static; None: unknown)
    as int32 when ``rows`` is under 2**31 (4 bytes an index on the wire);
    other indices as they are. Out-of-range indices stay out of range
    (clipped to -1 or int32's max), so the ps's op still refuses them."""
    if indices.dtype != tf.int64 or rows is None or rows >= _INT32_MAX:
        return indices
    return tf.cast(tf.clip_by_value(indices, -1, _INT32_MAX), tf.int32)


def _pack(values, indices, rows):
    """[n, k + c] of ``values``' dtype: each row's values, flattened, then
    the bits of its int32 index (c = 4 bytes / the dtype's size; see
    :func:`narrow_indices`)."""
    indices = narrow_indices(indices, rows)
    # A 16-bit dtype's bitcast is [n, 2] already; a 32-bit one's [n].
    bits = tf.bitcast(indices, values.dtype)
    one = shared_constant(1, tf.int32, bits)
    if values.dtype.size == 4:
        bits = tf.expand_dims(bits, one)
    if values.shape.rank != 2:  # a matrix's rows are [n, k] as they are
        k = values.shape[1:].num_elements()
        values = tf.reshape(values, shared_constant([-1, k], tf.int32, bits))
    return tf.concat([values, bits], one)


def _unpack(packed, values, indices):
    """The (values, indices) of :func:`_pack`'s tensor, in their own shapes and
    dtypes (indices back to int64 where they were)."""
    k = values.shape[1:].num_elements()

    def const(v):
        return shared_constant(v, tf.int32, packed)

    # packed[:, :k], and packed[:, k] (a 32-bit dtype's index: one column,
    # [n] once sliced out) or packed[:, k:] (a 16-bit dtype's two, which the
    # bitcast joins into one int32), with the bounds shared by the shards.
    vals = tf.strided_slice(packed, const([0, 0]), const([0, k]), const([1, 1]),
                            begin_mask=3, end_mask=1)
    if values.shape.rank != 2:  # a matrix's rows: the columns are the values
        # int32 dims: a vector's values have none ([] alone would be float32).
        dims = tf.constant(values.shape[1:].as_list(), tf.int32)
        vals = tf.reshape(vals, tf.concat([[tf.shape(packed)[0]], dims], 0))
    vals.set_shape(values.shape)
    if packed.dtype.size == 4:
        bits = tf.strided_slice(packed, const([0, k]), const([0, k + 1]), const([1, 1]),
                                begin_mask=1, end_mask=1, shrink_axis_mask=2)
    else:
        bits = tf.strided_slice(packed, const([0, k]), const([0, 0]), const([1, 1]),
                                begin_mask=1, end_mask=3)
    idx = tf.bitcast(bits, tf.int32)
    return vals, tf.cast(idx, indices.dtype)


def copy_to(value, device, wire_dtype=None, rows=None, on_ps=None):
    """A copy of a tensor or IndexedSlices placed on ``device``.

    Args:
      value: a tensor or IndexedSlices (its values are what cross).
      device: where the copy is placed (a ps task).
      wire_dtype: None, or a dtype ("bfloat16") the float32 values cross in:
        cast where ``value`` is (the worker), copied, cast back to float32 on
        ``device``, so what runs there sees float32 (rounded to the wire's
        precision). Other dtypes (int counters, float64, float16) cross as
        they are.
      rows: the variable's number of rows (its static first dimension), or
        None. Under 2**31, an IndexedSlices crosses as one tensor: its values
        with each row's index as int32 bits beside them (one transfer instead
        of two, 4 bytes an index instead of 8); the copy has the indices'
        own dtype again.
      on_ps: as in :func:`rows_on_ps`; the indices it names are on the ps
        already and cross as they are (not packed).

    Returns:
      The copy on ``device``, of ``value``'s dtype.
    """
    values = value.values if isinstance(value, tf.IndexedSlices) else value
    wire = wire_dtype_of(values.dtype, wire_dtype)
    cast = wire is not None
    if cast:
        values = tf.cast(values, wire)  # on the worker: half the bytes cross
    packed = (isinstance(value, tf.IndexedSlices)
              and not (on_ps is not None and on_ps(value.indices))
              and _packable(values, value.indices, rows))
    if packed:
        one = _pack(values, value.indices, rows)
    with tf.device(device):
        if packed:
            values, indices = _unpack(tf.identity(one), values, value.indices)
        else:
            # Not tf.identity: TensorFlow's graph optimizer removes an Identity
            # that feeds a cond, and the cond's Switch then ran on the worker:
            # the predicate crossed ps -> worker and the value crossed after
            # the Switch (measured: 3 transfers per step for a Dense layer's
            # kernel shards and bias). Snapshot forwards its input's buffer.
            values = tf.raw_ops.Snapshot(input=values)
        if cast:
            values = tf.cast(values, tf.float32)
        if isinstance(value, tf.IndexedSlices):
            if not packed:
                indices = tf.identity(value.indices)
            if known_distinct(value.indices):
                mark_distinct(indices)
            return tf.IndexedSlices(values, indices, value.dense_shape)
        return values


#: A table shard under this many rows sends its gradient's ids as uint16
#: (:func:`copy_with_rows_to`); 65535 itself stands for an id out of range.
_UINT16_ROWS = 2 ** 16 - 1


def copy_with_rows_to(value, extra, device, wire_dtype=None, rows=None, on_ps=None):
    """:func:`copy_to` of an IndexedSlices ``value`` and of ``extra``, rows
    of its values' shape carried beside it (core/rowwise.py's squares of
    repeated ids), as one tensor.

    What crosses is one vector in the wire dtype: the numbers of ``value``'s
    and of ``extra``'s rows (int32 bits), ``value``'s rows, its ids (uint16
    bits for a table of under 65,535 rows, else int32), then ``extra``'s
    rows; on ``device`` it is split again. One transfer a table shard
    instead of two (each costs a request and response headers besides its
    data, ~330 B measured on loopback gRPC), and 2 bytes an id instead of 4
    on the shards of this size (docs/benchmarks.md, "Keras 3 bytes").

    Args:
      value: a tf.IndexedSlices (any other gradient: :func:`copy_to`).
      extra: a tensor ``[n] + value.values.shape[1:]`` of the values' dtype,
        or None.
      device, wire_dtype, rows, on_ps: as in :func:`copy_to`; the ids take
        uint16 only where ``rows`` (the variable's static rows) is under
        65,535.

    Returns:
      ``(copy of value, copy of extra)`` on ``device`` (None for no extra),
      equal to :func:`copy_to` of each: the same values, ids of the
      indices' own dtype (an id out of ``[0, rows)`` stays out of range, so
      the ps's update still refuses it).
    """
    values = value.values if isinstance(value, tf.IndexedSlices) else value
    joined = (extra is not None and isinstance(value, tf.IndexedSlices)
              and not (on_ps is not None and on_ps(value.indices))
              and _packable(values, value.indices, rows)
              and extra.dtype == values.dtype
              and extra.shape[1:].is_compatible_with(values.shape[1:]))
    if not joined:
        return (copy_to(value, device, wire_dtype=wire_dtype, rows=rows, on_ps=on_ps),
                None if extra is None else copy_to(extra, device, wire_dtype=wire_dtype))
    wire = wire_dtype_of(values.dtype, wire_dtype)
    if wire is not None:  # on the worker: half the bytes cross
        values, extra = tf.cast(values, wire), tf.cast(extra, wire)
    dtype, k = values.dtype, values.shape[1:].num_elements()
    small = rows < _UINT16_ROWS
    id_dtype = tf.uint16 if small else tf.int32
    # ids in the values' dtype: ids_per elements an id (16-bit ids in a
    # 32-bit dtype: 2 an element, the last padded).
    ids_per = id_dtype.size / dtype.size
    ids = value.indices
    if small:
        bad = tf.logical_or(ids < 0, ids >= rows)
        ids = tf.cast(tf.where(bad, tf.constant(_UINT16_ROWS, ids.dtype), ids), tf.uint16)
    else:
        ids = narrow_indices(ids, rows)
    ids = tf.cast(ids, id_dtype)
    if ids_per < 1:
        ids = tf.pad(ids, [[0, tf.size(ids) % 2]])
        ids = tf.reshape(ids, [-1, 2])
    flat = functools.partial(tf.reshape, shape=[-1])
    counts = tf.stack([tf.shape(values, out_type=tf.int32)[0],
                       tf.shape(extra, out_type=tf.int32)[0]])
    one = tf.concat([flat(tf.bitcast(counts, dtype)), flat(values),
                     flat(tf.bitcast(ids, dtype)), flat(extra)], 0)
    head = 2 * 4 // dtype.size
    with tf.device(device):
        one = tf.identity(one)
        counts = tf.bitcast(tf.reshape(one[:head], [2, 4 // dtype.size] if dtype.size < 4
                                       else [2]), tf.int32)
        n, m = counts[0], counts[1]
        id_elems = (n + 1) // 2 if ids_per < 1 else n * int(ids_per)
        vals, ids, rest = tf.split(one[head:], tf.stack([n * k, id_elems, m * k]), num=3)
        vals = tf.reshape(vals, [-1] + values.shape[1:].as_list())
        rest = tf.reshape(rest, [-1] + values.shape[1:].as_list())
        if ids_per < 1:
            ids = tf.reshape(tf.bitcast(ids, id_dtype), [-1])[:n]
        elif ids_per > 1:
            ids = tf.bitcast(tf.reshape(ids, [-1, int(ids_per)]), id_dtype)
        else:
            ids = tf.bitcast(ids, id_dtype)
        indices = tf.cast(ids, value.indices.dtype)
        if small:  # 65535: out of range again
            indices = tf.where(tf.equal(ids, _UINT16_ROWS), tf.constant(-1, indices.dtype),
                               indices)
        if wire is not None:
            vals, rest = tf.cast(vals, tf.float32), tf.cast(rest, tf.float32)
        if known_distinct(value.indices):
            mark_distinct(indices)
        return tf.IndexedSlices(vals, indices, value.dense_shape), rest


def sum_parts(parts):
    """The sum of a list of gradients of one variable (tensors or
    IndexedSlices); IndexedSlices stay sparse: their rows are concatenated."""
    parts = list(parts)
    if len(parts) == 1:
        return parts[0]
    if isinstance(parts[0], tf.IndexedSlices):
        return tf.IndexedSlices(tf.concat([p.values for p in parts], 0),
                                tf.concat([p.indices for p in parts], 0),
                                parts[0].dense_shape)
    return tf.add_n(parts)


def flat_tensors(grads):
    """The tensors of ``grads``: a dense gradient itself, an IndexedSlices'
    values and indices (for control dependencies)."""
    return [t for g in grads for t in (
        (g.values, g.indices) if isinstance(g, tf.IndexedSlices) else (g,))]
