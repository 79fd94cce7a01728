"""``EmbeddingCollection``: many categorical features' tables in one table.

A click-through-rate model has dozens of categorical features, each with a
table of its own (DLRM, Naumov et al. 2019; TorchRec's
``EmbeddingBagCollection`` groups them the same way). Under a parameter
server every table is its own variable, split into its own shards, and each
step pays per table and per shard: one lookup, one gradient push. Here the
features' tables are the row ranges of one variable::

    table   [sum(input_dims), output_dim]      # feature f: rows offsets[f] ...
    offsets = [0, d0, d0 + d1, ...]            #   ... offsets[f] + input_dims[f] - 1
    rows    = gather(table, ids + offsets)     # ids [batch, F] -> [batch, F, output_dim]

so a step reads the table once per shard, whatever F is, and pushes one
gradient per shard. The read is the strategy's own row read
(``tf_asyncps.core.lookup``: each shard's distinct ids cross once, rows in
``wire_dtype``), as for a plain Embedding table; the variable is named
``embeddings``, which ``route``'s default ``sparse_names`` matches. Training
is the same as F separate Embedding layers (rows of different features are
different rows): the same optimizer updates the same rows by the same rule.

This module holds the tf_keras layer; ``tf_asyncps.keras3.EmbeddingCollection``
is the Keras 3 one (:func:`keras3_layer`); ``tf_asyncps.layers.EmbeddingCollection``
makes either (``tf_asyncps.layers.keras_choice``).
"""

from typing import Optional

import numpy as np
import tensorflow as tf

from tf_asyncps.core import lookup as lookup_lib
from tf_asyncps.layers import keras_choice
from tf_asyncps.validate import check_int

__all__ = ["EmbeddingCollection", "PICKED", "check_arguments", "keras3_layer"]

_NAME = "EmbeddingCollection"


def _tf_keras():
    import tf_keras
    return tf_keras


_INT64_MAX = 2 ** 63 - 1


def check_arguments(input_dims, output_dim):
    """The constructor's checks.

    Args:
      input_dims: a non-empty sequence of ints >= 1, feature f's number of ids.
      output_dim: int >= 1.

    Returns:
      ``(input_dims, output_dim)`` as a tuple of Python ints and an int.

    Raises:
      ValueError: an argument out of range or of the wrong kind, naming it;
        ``sum(input_dims) * output_dim`` beyond int64.
    """
    if isinstance(input_dims, (str, bytes)) or not hasattr(input_dims, "__len__") \
            or len(input_dims) == 0:
        raise ValueError(f"{_NAME}(input_dims={input_dims!r}): input_dims must be a non-empty "
                         f"list of ints >= 1, one per feature (its number of ids), e.g. "
                         f"input_dims=[1000, 24, 3].")
    dims = tuple(check_int(d, f"{_NAME}: input_dims[{f}]", min=1,
                           hint=f"feature {f}'s number of ids")
                 for f, d in enumerate(input_dims))
    output_dim = check_int(output_dim, f"{_NAME}: output_dim", min=1,
                           hint="the width of each row")
    # Rows and offsets are int64 (the lookup adds offsets[f] to the ids), and
    # so is the table's element count.
    rows = sum(dims)
    if rows * output_dim > _INT64_MAX:
        raise ValueError(
            f"{_NAME}: input_dims sum to {rows} rows of output_dim={output_dim}: "
            f"{rows * output_dim} values, more than one int64-indexed table holds "
            f"(2**63 - 1); give each feature the ids it has (hash or map larger id "
            f"spaces into fewer rows, or use tf_asyncps.layers.DynamicEmbedding for raw ids).")
    return dims, output_dim


class _Mixin:
    """What both Keras layers share: the checks, the offsets, the lookup, export."""

    def _init_collection(self, input_dims, output_dim):
        self.input_dims, self.output_dim = check_arguments(input_dims, output_dim)
        self.offsets = tuple(int(o) for o in np.cumsum((0,) + self.input_dims[:-1]))
        self.total_rows = int(sum(self.input_dims))

    def __call__(self, *args, **kwargs):
        if args:
            keras_choice.check_input(args[0], self._keras, self, module=__name__, guide="")
        return super().__call__(*args, **kwargs)

    def _table_value(self):
        """The tf.Variable (or ShardedVariable) of the table."""
        return self.embeddings

    def _check_shape(self, shape):
        """Refuses ids of a known shape other than [batch, F] (a rank-1 or
        rank-3 input would be read as other features' ids)."""
        shape = tf.TensorShape(shape)
        features = len(self.input_dims)
        if shape.rank is not None and (shape.rank != 2 or (
                shape[-1] is not None and shape[-1] != features)):
            raise ValueError(f"{_NAME} {self.name!r}: ids must have shape [batch, {features}] "
                             f"(rank 2: one row per example, one column per feature of "
                             f"input_dims), got {shape}.")

    def _check_ids(self, ids):
        """``ids`` as int64, after the range check of each column."""
        if not isinstance(ids, tf.Tensor) or ids.dtype not in (tf.int32, tf.int64):
            ids = tf.convert_to_tensor(ids)
        if ids.dtype not in (tf.int32, tf.int64):
            raise TypeError(f"{_NAME} {self.name!r}: ids must be int32 or int64, got "
                            f"{ids.dtype.name}; cast them (column f holds feature f's ids "
                            f"in [0, input_dims[f])).")
        features = len(self.input_dims)
        self._check_shape(ids.shape)
        ids = tf.cast(ids, tf.int64)
        dims = tf.constant(self.input_dims, tf.int64)
        ok = tf.reduce_all(tf.logical_and(ids >= 0, ids < dims))

        def first_bad():
            flat = tf.reshape(ids, [-1])
            bad = tf.logical_or(flat < 0, flat >= tf.tile(dims, [tf.size(flat) // features]))
            at = tf.argmax(tf.cast(bad, tf.int32), output_type=tf.int64)
            return at % features, tf.gather(dims, at % features), tf.gather(flat, at)

        # No quotes: the graph's assertion would print them escaped.
        what = (f"{_NAME} {self.name}: feature {{}} (column {{}} of the ids) takes ids in "
                f"[0, {{}}) (input_dims[{{}}]), got id {{}}; map the values of that feature "
                f"to [0, input_dims[f]) or raise input_dims[f].")
        if tf.executing_eagerly():
            if not bool(ok):
                f, dim, bad = (int(t) for t in first_bad())
                raise tf.errors.InvalidArgumentError(None, None, what.format(f, f, dim, f, bad))
            return ids

        def fail():
            f, dim, bad = first_bad()
            tf.debugging.Assert(False, [tf.strings.format(what, (f, f, dim, f, bad))])
            return tf.constant(False)

        # The message is formatted only for a bad batch (the false branch).
        checked = tf.cond(ok, lambda: tf.constant(True), fail)
        with tf.control_dependencies([checked]):
            return tf.identity(ids)

    def _lookup(self, ids, compute_dtype, every_id=False):
        rows = self._check_ids(ids) + tf.constant(self.offsets, tf.int64)
        if every_id:  # Keras 3's own sparse rules (core/lookup.per_id_gradients)
            with lookup_lib.per_id_gradients():
                out = tf.nn.embedding_lookup(self._table_value(), rows)
        else:
            out = tf.nn.embedding_lookup(self._table_value(), rows)
        return out if out.dtype == compute_dtype else tf.cast(out, compute_dtype)

    def _collection_config(self, serialize) -> dict:
        return {"input_dims": list(self.input_dims), "output_dim": self.output_dim,
                "embeddings_initializer": serialize(self.embeddings_initializer)}

    # -- public ---------------------------------------------------------------
    def feature_table(self, feature: int) -> np.ndarray:
        """Feature ``feature``'s table: float32 ``[input_dims[feature], output_dim]``
        (eager, on the chief; reads only that feature's rows from the ps).

        Raises:
          ValueError: the layer is not built, or ``feature`` is not in
            ``[0, len(input_dims))``.
        """
        feature = check_int(feature, f"{_NAME} {self.name!r}: feature", min=0,
                            below=len(self.input_dims), hint="a feature index")
        if getattr(self, "embeddings", None) is None:
            raise ValueError(f"{_NAME} {self.name!r} is not built: call it on a batch (or "
                             f"build the model) before reading its tables.")
        start = self.offsets[feature]
        rows = tf.range(start, start + self.input_dims[feature], dtype=tf.int64)
        return np.asarray(tf.nn.embedding_lookup(self._table_value(), rows).numpy())

    def export(self) -> dict:
        """``{f: feature_table(f)}`` for every feature f: float32 numpy
        ``[input_dims[f], output_dim]`` each (eager, on the chief).

        Raises:
          ValueError: the layer is not built.
        """
        return {f: self.feature_table(f) for f in range(len(self.input_dims))}


@_tf_keras().saving.register_keras_serializable(package="tf_asyncps")
class EmbeddingCollection(_Mixin, _tf_keras().layers.Layer):
    """Many categorical features' embedding tables in one table (tf_keras).

    Feature f's table is rows ``offsets[f] .. offsets[f] + input_dims[f] - 1``
    of one float32 variable ``embeddings`` of shape
    ``[sum(input_dims), output_dim]`` (``offsets[f] = sum(input_dims[:f])``),
    created in the strategy's scope, so its ``variable_partitioner`` splits it
    over the ps tasks. A step looks the table up once per shard and pushes
    one gradient per shard whatever the number of features F: under
    AsyncParameterServerStrategy each shard's distinct ids cross once
    (``deduplicate_lookups``) and rows may cross as bfloat16 (``wire_dtype``),
    as for a plain Embedding table; ``route``'s default ``sparse_names``
    (``embeddings``) matches the table. Training equals F separate Embedding
    layers of ``input_dims[f]`` rows each. Source: DLRM (Naumov et al., 2019,
    "Deep Learning Recommendation Model for Personalization and
    Recommendation Systems"), TorchRec's ``EmbeddingBagCollection``.

    Args:
      input_dims: non-empty list of ints >= 1: feature f's ids are in
        ``[0, input_dims[f])``.
      output_dim: int >= 1, the width of each row.
      embeddings_initializer: a tf_keras initializer (name or object) of the
        whole table (its fans are the whole table's).
      name: layer name.

    Call: ``layer(ids)``, ids an int32 or int64 tensor ``[batch, F]`` whose
    column f holds ids of feature f; returns ``[batch, F, output_dim]`` of the
    layer's compute dtype (float32, float16 under mixed precision).

    Raises:
      ValueError: empty ``input_dims``, an entry or ``output_dim`` that is not
        an int >= 1 (bools too), naming it; a table of more than 2**63 - 1
        values (``sum(input_dims) * output_dim``); ids (or a built input) not of
        shape [batch, F].
      TypeError: ids of another dtype; the other Keras's KerasTensor.
      tf.errors.InvalidArgumentError: at call, an id out of its feature's
        range, naming the feature, its range and the id.
    """

    _keras = "tf_keras"

    def __init__(self, input_dims, output_dim: int, *, embeddings_initializer="uniform",
                 name: Optional[str] = None, **kwargs):
        super().__init__(name=name, **kwargs)
        self._init_collection(input_dims, output_dim)
        self.embeddings_initializer = _tf_keras().initializers.get(embeddings_initializer)

    def build(self, input_shape):
        self._check_shape(input_shape)
        # No AutoCastVariable (it wraps no ShardedVariable): float32 table,
        # rows cast to the compute dtype, as tf_keras's Embedding.
        self.embeddings = self.add_weight(
            "embeddings", shape=[self.total_rows, self.output_dim],
            initializer=self.embeddings_initializer, dtype=self.dtype,
            trainable=True, experimental_autocast=False)
        super().build(input_shape)

    def call(self, ids):
        return self._lookup(ids, self.compute_dtype)

    def compute_output_shape(self, input_shape):
        return tf.TensorShape(input_shape).concatenate([self.output_dim])

    def get_config(self):
        config = super().get_config()
        config.update(self._collection_config(_tf_keras().initializers.serialize))
        return config


_KERAS3_CLASS = []


def keras3_layer():
    """The Keras 3 ``EmbeddingCollection`` class (made once, when
    ``tf_asyncps.keras3`` is imported or a Keras 3 layer is first made). Same
    arguments and behaviour as the tf_keras layer; its reads keep Keras 3's
    own sparse rules (each distinct id read once and a gradient row per id,
    as Keras 3's Embedding under the strategy: ``core.lookup.per_id_gradients``), so
    training equals F Keras 3 Embedding layers with any optimizer."""
    if _KERAS3_CLASS:
        return _KERAS3_CLASS[0]
    import keras

    from tf_asyncps.compat import variables as variables_compat

    class EmbeddingCollection(_Mixin, keras.layers.Layer):
        __doc__ = _keras3_doc()
        _keras = "keras3"

        def __init__(self, input_dims, output_dim: int, *, embeddings_initializer="uniform",
                     name: Optional[str] = None, **kwargs):
            super().__init__(name=name, **kwargs)
            self._init_collection(input_dims, output_dim)
            self.embeddings_initializer = keras.initializers.get(embeddings_initializer)

        def build(self, input_shape=None):
            if input_shape is not None:
                self._check_shape(input_shape)
            self.embeddings = self.add_weight(
                shape=(self.total_rows, self.output_dim), initializer=self.embeddings_initializer,
                dtype=self.variable_dtype, trainable=True, name="embeddings", autocast=False)

        def _table_value(self):
            # The tf.Variable or ShardedVariable: rows read by a gather (the
            # Keras variable converts to the whole table).
            return variables_compat.tf_value(self.embeddings)

        def call(self, ids):
            return self._lookup(ids, self.compute_dtype, every_id=True)

        def compute_output_shape(self, input_shape):
            return tuple(input_shape) + (self.output_dim,)

        def compute_output_spec(self, ids):
            return keras.KerasTensor(tuple(ids.shape) + (self.output_dim,), self.compute_dtype)

        def get_config(self):
            config = super().get_config()
            config.update(self._collection_config(keras.initializers.serialize))
            return config

    EmbeddingCollection.__module__ = "tf_asyncps.keras3"
    EmbeddingCollection.__qualname__ = "EmbeddingCollection"
    EmbeddingCollection = keras.saving.register_keras_serializable(package="tf_asyncps")(
        EmbeddingCollection)
    _KERAS3_CLASS.append(EmbeddingCollection)
    return EmbeddingCollection


def _keras3_doc():
    return EmbeddingCollection.__doc__.replace("(tf_keras)", "(Keras 3)").replace(
        "a tf_keras initializer", "a Keras 3 initializer")


_KERAS_ARG = """      name: layer name.
      keras: "tf_keras" or "keras3": the Keras the layer is for; None (the
        default): picked by the rule of ``tf_asyncps.layers.keras_choice``
        (a model being made on this thread, then the Keras the calling code
        imported, else tf_keras). The object is an instance of the tf_keras
        class (``tf_asyncps.layers.embedding_collection.EmbeddingCollection``)
        or of the Keras 3 one (``tf_asyncps.keras3.EmbeddingCollection``).
"""


def _picked_doc():
    doc = EmbeddingCollection.__doc__.replace("(tf_keras)", "(tf_keras or Keras 3)").replace(
        "a tf_keras initializer", "an initializer of the layer's Keras")
    return doc.replace("      name: layer name.\n", _KERAS_ARG)


#: ``tf_asyncps.layers.EmbeddingCollection``: makes the tf_keras or the Keras 3
#: layer (``keras_choice``'s rule).
PICKED = keras_choice.picker(
    _NAME, _picked_doc(),
    {"tf_keras": lambda: EmbeddingCollection, "keras3": keras3_layer},
    lambda: [EmbeddingCollection] + _KERAS3_CLASS, "tf_asyncps.layers")
