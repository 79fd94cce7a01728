"""``DynamicEmbedding``: an embedding of raw ids (int64 of any value, or
strings) in a table of fixed capacity, with admission and eviction.

The table and its map live on the parameter servers (see
:mod:`tf_asyncps.dynamic.table` for the design and its sources).
This module holds the tf_keras layer; ``tf_asyncps.keras3.DynamicEmbedding``
is the Keras 3 one (same arguments, same behaviour; :func:`keras3_layer`).
"""

from typing import Optional

import tensorflow as tf

from tf_asyncps.compat import checkpoint as checkpoint_compat
from tf_asyncps.compat import hooks as hooks_compat
from tf_asyncps.core import table_seam
from tf_asyncps.dynamic import checkpoint as dynamic_state
from tf_asyncps.dynamic import initializers as dynamic_init
from tf_asyncps.dynamic import reshard as dynamic_reshard
from tf_asyncps.dynamic import table as dt
from tf_asyncps.layers import keras_choice

__all__ = ["DynamicEmbedding", "PICKED", "attach_to_strategy", "keras3_layer"]


def attach_to_strategy(table: "dt.DynamicTable") -> Optional[object]:
    """Registers ``table``'s hooks (``DynamicTable.hooks``: eviction after
    each update, its filter of evicted rows' gradients and its move of slots
    after a restore onto other shards before each) with the
    AsyncParameterServerStrategy in scope, through its declared seam
    (``extended.register_table``); returns that strategy's extended object
    (a ``core.table_seam.StrategySeam``), else None."""
    seam = table_seam.seam_in_scope()
    if seam is not None:
        seam.register_table(table.hooks())
    return seam


def global_step(seam):
    """The global step variable (int64, on ps 0) of a ``StrategySeam``, else None."""
    return None if seam is None else seam.global_step


def _tf_keras():
    import tf_keras
    return tf_keras


class _Mixin:
    """What both Keras layers share (constructor checks, the table, calls)."""

    def _init_dynamic(self, output_dim, capacity, key_dtype, min_count, eviction, evict_every,
                      ttl_steps, initializer):
        self.key_dtype = dt.check_arguments(output_dim, capacity, key_dtype, min_count,
                                            eviction, evict_every, ttl_steps)
        # Python ints (numpy's too): the config stays JSON.
        self.output_dim, self.capacity = int(output_dim), int(capacity)
        self.min_count, self.eviction = int(min_count), eviction
        self.evict_every = int(evict_every)
        self.ttl_steps = None if ttl_steps is None else int(ttl_steps)
        self.initializer_name = initializer

    def __call__(self, *args, **kwargs):
        if args:  # the other Keras's symbolic tensor: an error naming the class to use
            keras_choice.check_input(args[0], self._keras, self)
        return super().__call__(*args, **kwargs)

    def _make_table(self, table_var, initializer):
        seam = table_seam.seam_in_scope()
        table = dt.DynamicTable(
            table_var, key_dtype=self.key_dtype, min_count=self.min_count,
            eviction=self.eviction, evict_every=self.evict_every, ttl_steps=self.ttl_steps,
            initializer=self._row_sampler, name=self.name,
            local_copies=seam is not None and seam.local_copies)
        attach_to_strategy(table)
        # Tracked: the map's variables are checkpointed with the layer.
        self.dynamic_table = table
        hooks_compat.set_untracked_attribute(self, "_global_step", global_step(seam))
        return table

    def _dynamic_call(self, ids, training):
        # An export traces inference only (tf_keras also traces training=True
        # calls): the served function captures nothing of the cluster (no
        # global step, no lock), so it runs in a process with no cluster.
        serving = checkpoint_compat.in_save_context()
        if serving:  # the served function then reads the index only
            dynamic_reshard.prepare_export(self.dynamic_table)
        training = bool(training) and not serving
        step = self._global_step
        step = step if training else None  # the variable: read beside each shard
        return self.dynamic_table.lookup(ids, step, training=training, serving=serving)

    def _dynamic_config(self) -> dict:
        return {"output_dim": self.output_dim, "capacity": self.capacity,
                "key_dtype": self.key_dtype.name, "min_count": self.min_count,
                "eviction": self.eviction, "evict_every": self.evict_every,
                "ttl_steps": self.ttl_steps, "initializer": self.initializer_name}

    # Keras's own files (.keras, .weights.h5) hold a layer's variables by
    # position; the id -> row map is not a variable, so the layer writes its
    # live rows with their ids instead (the checkpoint entry's arrays) and a
    # load rebuilds the map from them.
    def save_own_variables(self, store):
        """Writes the live rows, their ids and metadata into a Keras file's
        ``store`` (``dynamic_state.file_entries``); the optimizer writes its
        slots of the table itself, whole."""
        for name, value in dynamic_state.file_entries(self._built_table("saving")).items():
            store[name] = value

    def load_own_variables(self, store):
        """Puts :meth:`save_own_variables`' entries back (eager).

        Raises:
          ValueError: the layer is not built, the entries are not a
            DynamicEmbedding's, or their table has another capacity (each
            naming the fix).
        """
        dynamic_state.load_file_entries(self._built_table("loading"), store)

    def _built_table(self, what):
        if getattr(self, "dynamic_table", None) is None:
            raise ValueError(f"DynamicEmbedding {self.name!r} is not built: build the model "
                             f"(call it on a batch) before {what} its weights.")
        return self.dynamic_table

    _own_step = False  # whether use_step gave the step variable
    _global_step = None  # the step variable, once built (see dynamic_step)

    # -- public ---------------------------------------------------------------
    @property
    def under_strategy(self) -> bool:
        """Whether AsyncParameterServerStrategy runs this table's eviction
        passes (the layer was built in its scope)."""
        return self._global_step is not None and not self._own_step

    @property
    def dynamic_step(self):
        """The variable read as the step of a training lookup (rows' last
        step, LRU, ``ttl_steps``): the strategy's global step, the one given
        to :meth:`use_step`, or None (lookups count at step 0)."""
        return self._global_step

    def use_step(self, variable) -> None:
        """Reads ``variable`` (an int64 scalar variable, e.g. the optimizer's
        ``iterations``) as the step of training lookups where no
        AsyncParameterServerStrategy gives a global step (one process; see
        ``tf_asyncps.callbacks.DynamicEviction``). Call it before the first
        training call is traced.

        Raises:
          ValueError: the layer is under the strategy, whose global step it reads.
        """
        if self.under_strategy:
            raise ValueError(f"DynamicEmbedding {self.name!r} reads the strategy's global "
                             "step; use_step is for training without the strategy.")
        if not isinstance(variable, tf.Variable):  # a Keras 3 variable
            from tf_asyncps.compat import variables as variables_compat
            variable = variables_compat.tf_value(variable)
        hooks_compat.set_untracked_attribute(self, "_global_step", variable)
        hooks_compat.set_untracked_attribute(self, "_own_step", True)

    def use_optimizer(self, optimizer, variables=None) -> None:
        """Makes checkpoints hold ``optimizer``'s slots of this table for the
        live rows only (until then they are saved whole, as any variable's),
        and puts in slot rows a restore brought before this call. Under
        AsyncParameterServerStrategy each update does it; in one process the
        ``DynamicEviction`` callback does, or call it yourself once the
        optimizer has its slots (e.g. ``optimizer.build(model.trainable_variables)``)
        and again after a restore. Eager.

        Args:
          optimizer: a tf_keras (new or legacy) or Keras 3 optimizer.
          variables: the model variables it updates (``model.trainable_variables``):
            a tf_keras optimizer with no slots yet is built for them when
            restored slot rows wait.

        Raises:
          ValueError: restored slot rows wait and the optimizer has no slots of
            the table yet and cannot be built here.
          tf.errors.InvalidArgumentError: it has another number of slots of
            the table than the checkpoint.
        """
        dynamic_state.track_optimizer(self.dynamic_table, optimizer, variables)

    def export(self):
        """(ids, rows) of the live rows only: ids ``[n]`` of ``key_dtype``,
        rows float32 ``[n, output_dim]`` (eager, on the chief)."""
        return self.dynamic_table.export()

    def stats(self) -> dict:
        """``{"live_rows", "capacity", "evicted", "refused"}`` (ints)."""
        return self.dynamic_table.stats()


@_tf_keras().saving.register_keras_serializable(package="tf_asyncps")
class DynamicEmbedding(_Mixin, _tf_keras().layers.Layer):
    """Embedding of raw ids with fixed memory: admission and eviction (tf_keras).

    Args:
      output_dim: int >= 1, the width of each row.
      capacity: int >= 1, the most ids holding a row at once (the table is
        ``capacity x output_dim`` float32, split over the ps tasks by the
        strategy's ``variable_partitioner``).
      key_dtype: tf.int64 (raw integer ids of any value; int32 accepted) or
        tf.string.
      min_count: int >= 1, training lookups (one per call of the layer) before an
        id gets a row; until then it reads the default row.
      eviction: "lfu" or "lru": which rows a pass frees when ids were refused
        a row (lowest count, oldest last step).
      evict_every: int >= 1, global steps between eviction passes (each
        shard's pass runs once per period, by one worker; under local_sgd
        the global step counts exchanges, and the passes run at them).
      initializer: a tf_keras initializer (name or object) for the rows, used
        again for a row when it is evicted: every elementwise one (zeros,
        uniform, he_normal, glorot_uniform, ...; a reset row's elements follow
        its distribution with the whole table's fans, see
        ``tf_asyncps.dynamic.initializers``), or a callable ``f(shape, dtype)``
        taking a shape tensor.
      ttl_steps: None, or int >= 1: rows unseen for this many global steps are
        evicted at the next pass.
      name: layer name.

    Call: ``layer(ids, training=...)``, ids int or string tensor of any
    shape; returns float32 ``ids.shape + [output_dim]``. Only training calls
    admit ids and count them; ids without a row read the default row, zeros.

    Raises:
      ValueError: a field out of range (capacity < 1, min_count < 1, an
        unknown eviction), naming it; an initializer that cannot draw rows
        alone (orthogonal, identity), naming those that work.
      TypeError: float, bool or uint64 ids, string ids with key_dtype=tf.int64,
        integer ids with key_dtype=tf.string, the other Keras's KerasTensor
        (at call, naming the fix).
    """

    _keras = "tf_keras"

    def __init__(self, output_dim: int, capacity: int, key_dtype=tf.int64, min_count: int = 1,
                 eviction: str = "lfu", evict_every: int = 1000, initializer="uniform",
                 name: Optional[str] = None, ttl_steps: Optional[int] = None, **kwargs):
        super().__init__(name=name, **kwargs)
        self._init_dynamic(output_dim, capacity, key_dtype, min_count, eviction, evict_every,
                           ttl_steps, initializer)
        self.initializer = _tf_keras().initializers.get(initializer)
        self._row_sampler = dynamic_init.row_sampler(self.initializer, self.capacity,
                                                     self.output_dim, initializer)

    def build(self, input_shape):
        embeddings = self.add_weight("embeddings", shape=[self.capacity, self.output_dim],
                                     initializer=self.initializer, dtype=tf.float32,
                                     trainable=True)
        self._make_table(embeddings, self.initializer)
        super().build(input_shape)

    def call(self, ids, training=None):
        return self._dynamic_call(ids, training)

    def compute_output_shape(self, input_shape):
        return tf.TensorShape(input_shape).concatenate([self.output_dim])

    def get_config(self):
        config = super().get_config()
        config.update(self._dynamic_config())
        return config


_KERAS3_CLASS = []


def keras3_layer():
    """The Keras 3 ``DynamicEmbedding`` class (made once, when
    ``tf_asyncps.keras3`` is imported: it imports Keras 3). Same arguments and
    behaviour as the tf_keras layer; under the strategy its table may be
    partitioned like any Keras 3 weight.

    Known difference: Keras 3's Adam and Adagrad square each row of a
    repeated id on its own (tf_asyncps.core.lookup.every_id); here the rows
    of one id in a batch are summed first (the distinct-id read), as tf_keras
    does. SGD is the same either way.
    """
    if _KERAS3_CLASS:
        return _KERAS3_CLASS[0]
    import keras

    from tf_asyncps.compat import checkpoint as checkpoint_compat
    from tf_asyncps.compat import keras_layers
    from tf_asyncps.compat import variables as variables_compat

    class DynamicEmbedding(_Mixin, keras.layers.Layer):
        __doc__ = _tf_keras_doc()
        _keras = "keras3"

        def __init__(self, output_dim: int, capacity: int, key_dtype=tf.int64,
                     min_count: int = 1, eviction: str = "lfu", evict_every: int = 1000,
                     initializer="uniform", name: Optional[str] = None,
                     ttl_steps: Optional[int] = None, **kwargs):
            super().__init__(name=name, **kwargs)
            self._init_dynamic(output_dim, capacity, key_dtype, min_count, eviction,
                               evict_every, ttl_steps, initializer)
            self.initializer = keras.initializers.get(initializer)
            self._row_sampler = dynamic_init.row_sampler(self.initializer, self.capacity,
                                                         self.output_dim, initializer)

        def build(self, input_shape):
            # Made now, with its value, also under a symbolic build (a
            # subclassed model's model(keras.Input(...)), the strategy's fit:
            # Keras defers variables there) and inside a traced step (Keras 3
            # builds a subclassed model's layers in its first train step).
            # (Eagerly: under the strategy, its variable creator refuses an
            # initial value made in the graph Keras traces the call in.)
            with tf.init_scope(), keras_layers.outside_stateless_scope():
                self.embeddings = self.add_weight(
                    shape=(self.capacity, self.output_dim), initializer=self.initializer,
                    dtype="float32", trainable=True, name="embeddings")
                self._make_table(variables_compat.tf_value(self.embeddings), self.initializer)
            # The tracked object (the table saves its live rows itself).
            checkpoint_compat.save_elsewhere(self.embeddings)

        def call(self, ids, training=None):
            if training is None and keras_layers.in_train_step():
                # A subclassed model whose call takes no `training`: Keras 3's
                # train_step calls it without, and no layer gets training=True.
                training = True
            return self._dynamic_call(ids, training)

        def compute_output_shape(self, input_shape):
            return tuple(input_shape) + (self.output_dim,)

        def compute_output_spec(self, ids, training=None):
            return keras.KerasTensor(tuple(ids.shape) + (self.output_dim,), "float32")

        def get_config(self):
            config = super().get_config()
            config.update(self._dynamic_config())
            return config

    DynamicEmbedding.__module__ = "tf_asyncps.keras3"
    DynamicEmbedding.__qualname__ = "DynamicEmbedding"
    # load_model / from_config find it without custom_objects.
    DynamicEmbedding = keras.saving.register_keras_serializable(package="tf_asyncps")(
        DynamicEmbedding)
    _KERAS3_CLASS.append(DynamicEmbedding)
    return DynamicEmbedding


def _tf_keras_doc():
    return DynamicEmbedding.__doc__.replace("(tf_keras)", "(Keras 3)").replace(
        "a tf_keras initializer", "a Keras 3 initializer")


_KERAS_ARG = """      name: layer name.
      keras: "tf_keras" or "keras3": the Keras the layer is for; None (the
        default): picked by the rule of ``tf_asyncps.layers.keras_choice``
        (a model being made on this thread, then the Keras the calling code
        imported, else tf_keras). The object is an instance of the tf_keras
        class (``tf_asyncps.layers.dynamic_embedding.DynamicEmbedding``) or of
        the Keras 3 one (``tf_asyncps.keras3.DynamicEmbedding``).
"""


def _picked_doc():
    doc = DynamicEmbedding.__doc__.replace("(tf_keras)", "(tf_keras or Keras 3)").replace(
        "a tf_keras initializer", "an initializer of the layer's Keras")
    return doc.replace("      name: layer name.\n", _KERAS_ARG)


#: ``tf_asyncps.layers.DynamicEmbedding``: makes the tf_keras or the Keras 3
#: layer (``keras_choice``'s rule).
PICKED = keras_choice.picker(
    "DynamicEmbedding", _picked_doc(),
    {"tf_keras": lambda: DynamicEmbedding, "keras3": keras3_layer},
    lambda: [DynamicEmbedding] + _KERAS3_CLASS, "tf_asyncps.layers")
