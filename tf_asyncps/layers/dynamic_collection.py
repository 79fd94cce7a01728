"""``DynamicEmbeddingCollection``: many categorical features' raw ids in one
dynamic table.

A click-through-rate model with F categorical features of raw ids (hashed
strings) would otherwise hold F ``DynamicEmbedding`` tables, and every step
pays per table and per shard: a traced lookup with its critical section, an
eviction pass, a gradient push. Here the F features share one
``DynamicTable`` of ``capacity`` rows: column f's raw id ``r`` is the key::

    key = f * 2**56 + r        # r in [0, 2**56), f in [0, 128)

so two features' equal raw ids are different keys (different rows), and no
two (feature, raw id) pairs share a key: the map is exact, no hash
collisions. A step de-duplicates the ``[batch, F]`` keys once and looks each
shard up once (one critical-section run per shard) whatever F is, as
``EmbeddingCollection`` does for bounded ids. Training equals F separate
``DynamicEmbedding`` layers while the rows they need fit (admission by
``min_count`` and the rows' updates are per key; the capacity and the
eviction's ranking are shared by the features).

Raw ids beyond 56 bits are refused: reduce 64-bit hashes with
``tf.bitwise.bitwise_and(ids, 2**56 - 1)`` (n distinct ids of one feature
then share a row with probability at most ``n**2 / 2**57``: 7e-6 at n = 10
million), or keep one ``DynamicEmbedding`` per feature. Criteo's hashed
categorical values are 32-bit.

This module holds the tf_keras layer; ``tf_asyncps.keras3.DynamicEmbeddingCollection``
is the Keras 3 one (:func:`keras3_layer`); ``tf_asyncps.layers.DynamicEmbeddingCollection``
makes either (``tf_asyncps.layers.keras_choice``). Source of the grouping:
Monolith (Liu et al., 2022) keys every feature's ids into shared
collisionless tables by a feature slot in the high bits of the key.
"""

from typing import Dict, Optional, Tuple

import numpy as np
import tensorflow as tf
import tf_keras

from tf_asyncps.layers import dynamic_embedding as de_lib
from tf_asyncps.layers import keras_choice
from tf_asyncps.validate import check_int

__all__ = ["DynamicEmbeddingCollection", "ID_BITS", "MAX_FEATURES", "PICKED", "keras3_layer",
           "keys_of", "split_keys"]

_NAME = "DynamicEmbeddingCollection"

#: Bits of a raw id in a key; the feature takes the bits above (sign bit clear).
ID_BITS = 56
#: Most features of one collection (7 bits).
MAX_FEATURES = 1 << (63 - ID_BITS)
_ID_LIMIT = 1 << ID_BITS


def check_num_features(num_features) -> int:
    """``num_features`` as an int in ``[1, MAX_FEATURES]``.

    Raises:
      ValueError: anything else, naming the argument.
    """
    return check_int(num_features, f"{_NAME}: num_features", min=1, below=MAX_FEATURES + 1,
                     hint="the number of id columns (features) sharing the table")


def keys_of(ids, num_features: int, name: str = "layer") -> tf.Tensor:
    """int64 keys ``[..., F]`` of raw ids ``[..., F]``: ``f * 2**56 + ids[..., f]``.

    Args:
      ids: int32 or int64 tensor whose last axis is the F features.
      num_features: F.
      name: the layer's name, for the errors.

    Raises:
      TypeError: ids of another dtype (strings, floats, uint64).
      ValueError: ids not of shape [batch, F] (rank 2, F columns).
      tf.errors.InvalidArgumentError: a raw id outside ``[0, 2**56)``
        (eagerly, or when the traced check runs), naming the feature and the id.
    """
    if not isinstance(ids, tf.Tensor):
        ids = tf.convert_to_tensor(ids)
    if ids.dtype not in (tf.int32, tf.int64):
        raise TypeError(f"{_NAME} {name!r}: raw ids must be int32 or int64, got "
                        f"{ids.dtype.name}; for string ids use one DynamicEmbedding("
                        f"key_dtype=tf.string) per feature, for uint64 pass "
                        f"tf.bitwise.bitwise_and(tf.bitcast(ids, tf.int64), 2**56 - 1).")
    if ids.shape.rank is not None and (ids.shape.rank != 2 or (
            ids.shape[-1] is not None and ids.shape[-1] != num_features)):
        raise ValueError(f"{_NAME} {name!r}: ids must have shape [batch, {num_features}] "
                         f"(rank 2: one row per example, one column per feature, "
                         f"num_features={num_features}), got {ids.shape}.")
    ids = tf.cast(ids, tf.int64)
    ok = tf.reduce_all(tf.logical_and(ids >= 0, ids < _ID_LIMIT))

    def first_bad():
        flat = tf.reshape(ids, [-1])
        at = tf.argmax(tf.cast(tf.logical_or(flat < 0, flat >= _ID_LIMIT), tf.int32),
                       output_type=tf.int64)
        return at % num_features, tf.gather(flat, at)

    # No quotes: the graph's assertion would print them escaped.
    what = (f"{_NAME} {name}: feature {{}} (column {{}} of the ids) got raw id {{}}; raw ids "
            f"must be in [0, 2**{ID_BITS}): reduce wider ids with tf.bitwise.bitwise_and(ids, "
            f"2**{ID_BITS} - 1), or use one DynamicEmbedding per feature.")
    if tf.executing_eagerly():
        if not bool(ok):
            f, bad = (int(t) for t in first_bad())
            raise tf.errors.InvalidArgumentError(None, None, what.format(f, f, bad))
    else:
        def fail():
            f, bad = first_bad()
            tf.debugging.Assert(False, [tf.strings.format(what, (f, f, bad))])
            return tf.constant(False)

        checked = tf.cond(ok, lambda: tf.constant(True), fail)
        with tf.control_dependencies([checked]):
            ids = tf.identity(ids)
    features = tf.range(num_features, dtype=tf.int64) * _ID_LIMIT
    return ids + features


def split_keys(keys) -> Tuple[np.ndarray, np.ndarray]:
    """(features, raw ids) of int64 keys made by :func:`keys_of` (numpy int64 each)."""
    keys = np.asarray(keys, np.int64)
    return keys >> ID_BITS, keys & (_ID_LIMIT - 1)


class _CollectionMixin:
    """What both Keras layers add to their DynamicEmbedding: the keys, the config, export."""

    def _init_features(self, num_features):
        self.num_features = num_features  # checked before the layer is made

    def __call__(self, *args, **kwargs):
        if args:
            keras_choice.check_input(args[0], self._keras, self, module=__name__, guide="")
        return super().__call__(*args, **kwargs)

    def _dynamic_call(self, ids, training):
        return super()._dynamic_call(keys_of(ids, self.num_features, self.name), training)

    def _collection_config(self, config) -> dict:
        config = dict(config)
        config.pop("key_dtype", None)  # always int64 keys
        config["num_features"] = self.num_features
        return config

    def export(self) -> Dict[int, Tuple[np.ndarray, np.ndarray]]:
        """``{f: (raw_ids, rows)}`` of the live rows of each feature f in
        ``[0, num_features)``: raw ids int64 numpy ``[n_f]``, rows float32
        numpy ``[n_f, output_dim]`` (eager, on the chief); a feature with no
        live row has empty arrays. ``dynamic_table.export()`` gives the keys."""
        keys, rows = self.dynamic_table.export()
        features, raw = split_keys(keys.numpy())
        rows = np.asarray(rows.numpy())
        return {f: (raw[features == f], rows[features == f])
                for f in range(self.num_features)}


_DOC = """Many categorical features' raw ids in one dynamic table (tf_keras).

    One ``DynamicEmbedding`` table of ``capacity`` rows (admission, eviction,
    checkpoints as ``DynamicEmbedding``) shared by ``num_features`` features:
    column f's raw id ``r`` has the key ``f * 2**56 + r``, so two features'
    equal raw ids are different rows and no two (feature, raw id) pairs share
    a row (exact, no hashing). A training step de-duplicates the keys of
    the whole ``[batch, F]`` input once and looks each table shard up once
    on its ps, whatever F is. Training equals F separate ``DynamicEmbedding``
    layers while their rows fit in ``capacity`` (eviction ranks all the
    features' rows together). Source: Monolith (Liu et al., 2022,
    "Monolith: Real Time Recommendation System With Collisionless Embedding
    Table"): feature slots in the keys' high bits of shared tables.

    Args:
      num_features: int in [1, 128], the id columns F.
      output_dim: int >= 1, the width of each row.
      capacity: int >= 1, the most (feature, raw id) pairs holding a row at
        once, all features together.
      min_count: int >= 1, training lookups before a pair gets a row.
      eviction: "lfu" or "lru".
      evict_every: int >= 1, global steps between eviction passes.
      initializer: a tf_keras initializer (name or object) for the rows, as
        ``DynamicEmbedding``'s.
      ttl_steps: None, or int >= 1: rows unseen this many global steps are
        evicted at the next pass.
      name: layer name.

    Call: ``layer(ids, training=...)``, ids int32 or int64 ``[batch, F]``
    whose column f holds raw ids of feature f in ``[0, 2**56)``; returns
    float32 ``[batch, F, output_dim]`` (zeros for pairs without a row).

    Raises:
      ValueError: ``num_features`` not an int in [1, 128], the other fields
        as ``DynamicEmbedding``'s, naming them; ids not of shape [batch, F].
      TypeError: ids of another dtype; the other Keras's KerasTensor.
      tf.errors.InvalidArgumentError: at call, a raw id outside
        ``[0, 2**56)``, naming the feature and the id, and the fix
        (``tf.bitwise.bitwise_and(ids, 2**56 - 1)``).
    """


@tf_keras.saving.register_keras_serializable(package="tf_asyncps")
class DynamicEmbeddingCollection(_CollectionMixin, de_lib.DynamicEmbedding):
    __doc__ = _DOC

    def __init__(self, num_features: int, output_dim: int, capacity: int, min_count: int = 1,
                 eviction: str = "lfu", evict_every: int = 1000, initializer="uniform",
                 name: Optional[str] = None, ttl_steps: Optional[int] = None, **kwargs):
        num_features = check_num_features(num_features)
        super().__init__(output_dim, capacity, key_dtype=tf.int64, min_count=min_count,
                         eviction=eviction, evict_every=evict_every, initializer=initializer,
                         name=name, ttl_steps=ttl_steps, **kwargs)
        self._init_features(num_features)

    def get_config(self):
        return self._collection_config(super().get_config())


_KERAS3_CLASS = []


def keras3_layer():
    """The Keras 3 ``DynamicEmbeddingCollection`` class (made once). Same
    arguments and behaviour as the tf_keras layer, on the Keras 3
    ``DynamicEmbedding`` (its known difference: a repeated key's rows are
    summed before Adam's or Adagrad's square, as tf_keras does)."""
    if _KERAS3_CLASS:
        return _KERAS3_CLASS[0]
    import keras

    base = de_lib.keras3_layer()

    class DynamicEmbeddingCollection(_CollectionMixin, base):
        __doc__ = _DOC.replace("(tf_keras)", "(Keras 3)").replace(
            "a tf_keras initializer", "a Keras 3 initializer")

        def __init__(self, num_features: int, output_dim: int, capacity: int,
                     min_count: int = 1, eviction: str = "lfu", evict_every: int = 1000,
                     initializer="uniform", name: Optional[str] = None,
                     ttl_steps: Optional[int] = None, **kwargs):
            num_features = check_num_features(num_features)
            super().__init__(output_dim, capacity, key_dtype=tf.int64, min_count=min_count,
                             eviction=eviction, evict_every=evict_every,
                             initializer=initializer, name=name, ttl_steps=ttl_steps, **kwargs)
            self._init_features(num_features)

        def get_config(self):
            return self._collection_config(super().get_config())

    DynamicEmbeddingCollection.__module__ = "tf_asyncps.keras3"
    DynamicEmbeddingCollection.__qualname__ = _NAME
    DynamicEmbeddingCollection = keras.saving.register_keras_serializable(
        package="tf_asyncps")(DynamicEmbeddingCollection)
    _KERAS3_CLASS.append(DynamicEmbeddingCollection)
    return DynamicEmbeddingCollection


_KERAS_ARG = """      name: layer name.
      keras: "tf_keras" or "keras3": the Keras the layer is for; None (the
        default): picked by the rule of ``tf_asyncps.layers.keras_choice``.
        The object is an instance of the tf_keras class
        (``tf_asyncps.layers.dynamic_collection.DynamicEmbeddingCollection``)
        or of the Keras 3 one (``tf_asyncps.keras3.DynamicEmbeddingCollection``).
"""


def _picked_doc():
    doc = _DOC.replace("(tf_keras)", "(tf_keras or Keras 3)").replace(
        "a tf_keras initializer", "an initializer of the layer's Keras")
    return doc.replace("      name: layer name.\n", _KERAS_ARG)


#: ``tf_asyncps.layers.DynamicEmbeddingCollection``: makes the tf_keras or
#: the Keras 3 layer (``keras_choice``'s rule).
PICKED = keras_choice.picker(
    _NAME, _picked_doc(),
    {"tf_keras": lambda: DynamicEmbeddingCollection, "keras3": keras3_layer},
    lambda: [DynamicEmbeddingCollection] + _KERAS3_CLASS, "tf_asyncps.layers")
