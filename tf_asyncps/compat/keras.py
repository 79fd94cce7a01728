"""Keras 3 internals used by tf_asyncps, in one place.

Tested with Keras 3.10.0 (the oldest accepted), 3.12.4 (the oldest TensorFlow
2.21 accepts) and 3.15.1 (what pip installs with each of TensorFlow
2.16-2.21); :data:`SUPPORTED_RANGE` is what ``tf_asyncps/keras3`` accepts.
Importing this module imports nothing; functions import Keras when called.

Used by ``tf_asyncps/keras3/`` (model.fit on parameter servers): the model
``Trainer.compile`` runs for (hooked, :mod:`tf_asyncps.compat.call_scopes`),
the loops of a model created under the strategy but not compiled in it
(refused, :func:`hook_loops`),
``Trainer._symbolic_build`` (to build a model from a dataset's element spec),
the stateless scope (worker-local metric state for exact evaluation), and
read-then-write ``assign_add`` of Keras 3 variables (made atomic).
"""

import contextlib
import functools
import sys

__all__ = ["TESTED_VERSIONS", "SUPPORTED_RANGE", "version", "version_supported",
           "in_keras3_loop", "compiling_model", "hook_loops", "backing_variable",
           "make_assign_add_atomic", "make_seed_generator_atomic",
           "loss_scale_variable",
           "symbolic_build", "metrics_in_order", "in_stateless_scope", "compile_state",
           "loss_scale_optimizer_class", "loss_scale", "update_loss_scale", "model_strategy", "seed_generators",
           "initial_epoch", "build_layers", "sharded_value", "overrides_train_step",
           "train_step_on", "lookup_rows_in_call", "checkpoint_partitioned_whole", "layers_of", "whole_values", "optimizer_class", "is_keras3_model",
           "tensorboard_profiles"]

# tests/test_keras3.py passed whole on each (TensorFlow 2.21.0).
TESTED_VERSIONS = ("3.10.0", "3.12.4", "3.15.1")
# Keras 3 changed the fit loop's iteration protocol in 3.7 and 3.11 and
# _symbolic_build's arguments in 3.5 (docs/design.md#9-keras-3-on-parameter-servers): only releases this
# module was run against are accepted. Below 3.10: Keras 3.5.0 fails
# tests/test_keras3.py (mixed_float16 loss scaling counts 0 of 60 steps, two
# replicas differ from one process by 0.08); 3.6-3.9 were not run whole.
# 3.10-3.13: get_metrics_result() sorts its keys (metrics_in_order).
SUPPORTED_RANGE = ((3, 10), (3, 16))  # [3.10, 3.16)


def version():
    """The installed Keras version string, or None without Keras 3."""
    try:
        import keras
    except ImportError:  # pragma: no cover
        return None
    v = getattr(keras, "__version__", "")
    return v if v.startswith("3") else None


def version_supported(v) -> bool:
    """Whether Keras version string ``v`` lies in ``SUPPORTED_RANGE``."""
    try:
        major_minor = tuple(int(p) for p in str(v).split(".")[:2])
    except ValueError:
        return False
    lo, hi = SUPPORTED_RANGE
    return lo <= major_minor < hi


def is_keras3_model(obj) -> bool:
    """Whether ``obj`` is a Keras 3 ``keras.Model`` (not a tf_keras one)."""
    if "keras.src.models.model" not in sys.modules:
        return False
    from keras.src.models.model import Model
    return isinstance(obj, Model)


def compiling_model():
    """The Keras 3 model whose ``compile`` is running on this thread, or None
    (``Trainer.compile`` hooked: :mod:`tf_asyncps.compat.call_scopes`).

    ``Trainer.compile`` creates the loss tracker's variables, so the
    strategy's variable creator sees every compile under its scope.
    """
    from tf_asyncps.compat import call_scopes
    model = call_scopes.KERAS3_COMPILE.get()
    return model if model is not None and is_keras3_model(model) else None


def symbolic_build(model, element_spec) -> None:
    """Builds ``model``'s layers, compiled metrics/loss and optimizer from a
    dataset's ``element_spec`` (``(x, y[, sample_weight])`` of TensorSpecs),
    without running a batch: Keras 3's ``Trainer._symbolic_build``."""
    model._symbolic_build(data_batch=element_spec)


def metrics_in_order(model, logs):
    """``evaluate``'s list form of ``logs`` (a ``{name: value}`` dict), as
    Keras 3's own ``evaluate`` returns it: ``Trainer._flatten_metrics_in_order``
    (the loss, then the compiled metrics in ``compile`` order, then the other
    names sorted); one value alone is returned bare. Keras 3.10-3.13's
    ``get_metrics_result`` sorts its keys by name (``accuracy`` before
    ``loss``), so the dict's own order is not Keras' (3.14 and 3.15 keep it)."""
    return model._flatten_metrics_in_order(logs)


def compile_state(model):
    """What a ``compile`` sets (ids of the optimizer, the compiled loss and
    metrics, the loss tracker): a new compile changes it."""
    return tuple(id(getattr(model, a, None)) for a in
                 ("optimizer", "_compile_loss", "_compile_metrics", "_loss_tracker"))


def hook_loops(make_hook) -> bool:
    """Replaces ``fit``, ``evaluate`` and ``predict`` of Keras 3's
    ``keras.Model`` (``keras.src.models.model.Model``; Keras 3.10-3.15 define
    them in the TensorFlow backend's trainer) by ``make_hook(original,
    name)``, once per method (see :func:`tf_asyncps.compat.tensorflow.hook_method`).
    A model's own instance attributes of those names (tf_asyncps.keras3's
    ``attach``) come first.

    Returns:
      False if Keras 3 is not installed.
    """
    if optimizer_class() is None:
        return False
    from keras.src.models.model import Model
    from tf_asyncps.compat import call_scopes
    from tf_asyncps.compat import tensorflow as tf_compat

    def make(original, name):
        checked = make_hook(original, name)

        @functools.wraps(original)
        def loop(self, *args, **kwargs):
            token = call_scopes.KERAS3_LOOP.set(self)
            try:
                return checked(self, *args, **kwargs)
            finally:
                call_scopes.KERAS3_LOOP.reset(token)
        return loop

    for name in ("fit", "evaluate", "predict"):
        tf_compat.hook_method(Model, name, lambda original, name=name: make(original, name))
    return True


def model_strategy(model):
    """The strategy a Keras 3 model was created under (None: outside any)."""
    return getattr(model, "_distribute_strategy", None)


def seed_generators(model):
    """Every ``SeedGenerator`` of the model's layers (e.g. Dropout's)."""
    out = []
    for layer in model._flatten_layers(include_self=True, recursive=True):
        out.extend(getattr(layer, "_seed_generators", ()) or ())
    return out


def initial_epoch(model):
    """The epoch ``BackupAndRestore.on_train_begin`` restored (Keras 3 sets
    ``model._initial_epoch``), else None."""
    return getattr(model, "_initial_epoch", None)


def set_initial_epoch(model, epoch: int) -> None:
    """Makes Keras 3's ``fit`` (and this package's) start at ``epoch``, as
    Keras 3.15's ``BackupAndRestore._load_model`` does (``model._initial_epoch``,
    read after ``on_train_begin``)."""
    model._initial_epoch = int(epoch)


def build_layers(model, element_spec) -> None:
    """Builds an unbuilt model's layers from a dataset's element spec (the
    first part of ``Trainer._symbolic_build``: ``compute_output_spec``)."""
    if all(layer.built for layer in model._flatten_layers()):
        return
    import keras
    from keras.src import backend
    x, _, _ = keras.utils.unpack_x_y_sample_weight(element_spec)
    x = keras.tree.map_structure(
        lambda v: None if v is None else backend.KerasTensor(
            v.shape, backend.standardize_dtype(v.dtype)), x)
    backend.compute_output_spec(model, x, training=False)


def sharded_value(var):
    """The shards (tf.Variables) of a Keras 3 variable whose value is a
    ShardedVariable (variable_partitioner), else None."""
    from tf_asyncps.compat import variables as variables_compat
    inner = getattr(var, "_value", None)
    return variables_compat.shards(inner) if inner is not None else None


def tf_variables(var) -> list:
    """The tf.Variables behind ``var``: a Keras 3 variable's value, or its
    shards under ``variable_partitioner`` (its ``_value``; Keras 3.10-3.15);
    ``[var]`` for any other variable."""
    from tf_asyncps.compat import variables as variables_compat
    inner = getattr(var, "_value", None)
    if inner is None or not hasattr(inner, "dtype"):
        return [var]
    return variables_compat.shards(inner) or [inner]


def tf_value(var):
    """The TensorFlow variable behind a Keras 3 variable: a tf.Variable, or
    a ShardedVariable under ``variable_partitioner`` (its ``_value``; Keras
    3.10-3.15)."""
    return var._value


def overrides_train_step(model) -> bool:
    """Whether the model's class defines its own ``train_step``."""
    from keras.src.backend.tensorflow.trainer import TensorFlowTrainer
    return type(model).train_step is not TensorFlowTrainer.train_step


def train_step_on(model, sources, targets):
    """Keras 3.15's ``TensorFlowTrainer.train_step``, with gradients taken with
    respect to ``sources`` (a partitioned weight's shards in place of the
    weight, which has no single handle) and applied to ``targets``.

    Returns a ``train_step(data)`` function returning the metrics' results.
    """
    import keras
    import tensorflow as tf
    from keras.src.losses import loss as loss_module

    def train_step(data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        with tf.GradientTape() as tape:
            y_pred = model(x, training=True) if model._call_has_training_arg else model(x)
            loss = model._compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight,
                                       training=True)
            model._loss_tracker.update_state(
                loss_module.unscale_loss_for_distribution(loss),
                sample_weight=tf.shape(next(i for i in keras.tree.flatten(x)
                                            if i is not None))[0])
            loss = model.optimizer.scale_loss(loss)
        grads = tape.gradient(loss, sources)
        model.optimizer.apply_gradients(zip(grads, targets))
        return model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    return train_step


@contextlib.contextmanager
def whole_values(variables):
    """While saving: each partitioned Keras 3 variable's value is its whole
    tensor (read once from the ps), since Keras' savers call ``np.asarray``
    on the value and a ShardedVariable has no ``__array__``. Restored on
    exit. Loading needs nothing: ``assign`` of a whole value works on a
    ShardedVariable."""
    import tensorflow as tf
    swapped = []
    try:
        for v in variables:
            if sharded_value(v):
                swapped.append((v, v._value))
                v._value = tf.convert_to_tensor(v._value)
        yield
    finally:
        for v, value in swapped:
            v._value = value


def layers_of(model):
    """Every layer of ``model``, nested ones included."""
    return list(model._flatten_layers(include_self=False, recursive=True))


def lookup_rows_in_call(layer, table, lookup=None) -> bool:
    """Makes a Keras 3 ``Embedding`` read only the rows it looks up from its
    table ``table`` (a Keras 3 variable whose value is a tf.Variable on a ps,
    or a ShardedVariable over several): ``tf.nn.embedding_lookup`` on that
    value, as tf_keras's Embedding does. Keras 3.15's ``Embedding.call`` is
    ``ops.take(self.embeddings, ...)``, which converts the whole table to one
    tensor: every step read the whole table from its ps. The lookup goes
    through ``lookup(value, ids)`` (default ``tf.nn.embedding_lookup``).
    This layer instance only; False if it cannot (mask_zero, LoRA or
    quantization change its call). Tested with Keras 3.15.1."""
    import tensorflow as tf
    value = table._value
    lookup = lookup or tf.nn.embedding_lookup
    if getattr(layer, "mask_zero", False) or getattr(layer, "lora_enabled", False) or \
            getattr(layer, "quantization_mode", None):
        return False

    def call(inputs):
        if inputs.dtype not in (tf.int32, tf.int64):
            inputs = tf.cast(inputs, tf.int32)
        return tf.cast(lookup(value, inputs), layer.compute_dtype)

    object.__setattr__(layer, "call", call)
    return True


def in_stateless_scope() -> bool:
    from keras.src.backend.common.stateless_scope import in_stateless_scope as inside
    return inside()


def in_keras3_loop() -> bool:
    """Whether Keras 3's own ``fit``/``evaluate``/``predict`` runs on this
    thread (hooked by :func:`hook_loops`), e.g. its ``fit`` distributing a
    dataset."""
    from tf_asyncps.compat import call_scopes
    return call_scopes.KERAS3_LOOP.get() is not None


def creating_optimizer_slot() -> bool:
    """Whether an optimizer is creating a slot variable on this thread: its
    ``add_variable_from_reference`` (Keras 3.15.1's BaseOptimizer and TF
    backend optimizer, tf_keras 2.21's Optimizer) or ``add_slot`` (tf_keras's
    legacy OptimizerV2) is running (hooked:
    :mod:`tf_asyncps.compat.call_scopes`), lazily inside a step or eagerly in
    a build before the first one."""
    from tf_asyncps.compat import call_scopes
    return call_scopes.CREATING_SLOT.get() is not None


def backing_variable(var):
    """The tf.Variable behind a Keras 3 ``Variable`` (its ``value``), else ``var``."""
    inner = getattr(var, "value", None)
    return inner if getattr(inner, "device", None) else var


def make_assign_add_atomic(var) -> None:
    """Makes a Keras 3 variable's ``assign_add``/``assign_sub`` one atomic op.

    Keras 3's ``Variable.assign_add`` is ``assign(self + value)``: a read then
    a write, so concurrent workers lose increments of metric totals and counts
    (docs/design.md#9-keras-3-on-parameter-servers). This instance (only) gets the backing tf.Variable's
    atomic ``assign_add``; inside a ``keras.StatelessScope`` (exact
    evaluation's worker-local state) the original, recorded update is kept.
    """
    backing = getattr(var, "_value", None)
    if backing is None or getattr(var, "_asyncps_atomic", False) or \
            not callable(getattr(backing, "assign_add", None)):
        return
    import tensorflow as tf
    plain_add, plain_sub = var.assign_add, var.assign_sub

    def assign_add(value):
        if in_stateless_scope():
            return plain_add(value)
        return backing.assign_add(tf.cast(value, backing.dtype))

    def assign_sub(value):
        if in_stateless_scope():
            return plain_sub(value)
        return backing.assign_sub(tf.cast(value, backing.dtype))

    var.assign_add, var.assign_sub = assign_add, assign_sub
    var._asyncps_atomic = True


def make_seed_generator_atomic(generator) -> None:
    """Makes a Keras 3 ``SeedGenerator.next()`` advance its state atomically.

    Keras 3 reads the state, then assigns ``state + [0, 1]``; two workers can
    read the same state and both write it (a lost advance). Here the state
    advances by one atomic ``assign_add`` and the seed is the state read back
    minus the increment: with one worker exactly the state before this
    advance, as in one process; with several, the counter never loses an
    advance, but a read back that includes another worker's advance can
    repeat a seed. Only ``ordered=True`` (Keras' default) is changed.
    """
    state = getattr(generator, "state", None)
    backing = getattr(state, "_value", None)
    if backing is None or getattr(generator, "_asyncps_atomic", False):
        return
    import tensorflow as tf
    plain_next = generator.next

    def next_seed(ordered=True):
        if not ordered or in_stateless_scope():
            return plain_next(ordered)
        inc = tf.constant([0, 1], dtype=backing.dtype)
        return backing.assign_add(inc, read_value=True) - inc

    generator.next = next_seed
    generator._asyncps_atomic = True


def loss_scale_optimizer_class():
    """``keras.optimizers.LossScaleOptimizer`` when Keras 3 is installed, else None."""
    return optimizer_class() and __import__("keras").optimizers.LossScaleOptimizer


def loss_scale(lso):
    """A Keras 3 LossScaleOptimizer's current scale (float32 scalar tensor)."""
    import tensorflow as tf
    return tf.convert_to_tensor(lso.dynamic_scale)


def loss_scale_variable(lso):
    """The tf.Variable under a Keras 3 LossScaleOptimizer's ``dynamic_scale``."""
    return lso.dynamic_scale._value


def update_loss_scale(lso, values):
    """Ops that update a Keras 3 LossScaleOptimizer's scale for a step the
    engine skipped, as its own ``apply`` would: non-finite ``values`` halve
    the scale and reset the counter; finite ones count a good step (doubling
    the scale every ``dynamic_growth_steps``)."""
    import tensorflow as tf
    counter, scale = lso.step_counter._value, lso.dynamic_scale._value
    finite = tf.reduce_all([tf.reduce_all(tf.math.is_finite(v)) for v in values])

    def lower():
        return tf.group(counter.assign(tf.zeros_like(counter)), scale.assign(scale * 0.5))

    def good():
        grow = tf.equal(counter, lso.dynamic_growth_steps - 1)
        return tf.cond(grow, lambda: tf.group(counter.assign(tf.zeros_like(counter)),
                                              scale.assign(scale * 2.0)),
                       lambda: tf.group(counter.assign_add(tf.ones_like(counter))))

    return [tf.cond(finite, good, lower)]


def optimizer_class():
    """``keras.optimizers.Optimizer`` when Keras 3 is installed, else None."""
    try:
        import keras
    except ImportError:  # pragma: no cover
        return None
    return keras.optimizers.Optimizer if keras.__version__.startswith("3") else None


def tensorboard_profiles(callback) -> bool:
    """Whether a Keras 3 ``TensorBoard`` callback profiles batches
    (``profile_batch`` other than 0): Keras 3.15 keeps the range as
    ``_start_batch``/``_stop_batch`` (``_profile_batch`` is read too, as
    releases before it may name it)."""
    return bool(getattr(callback, "_profile_batch", 0) or getattr(callback, "_start_batch", 0))


def checkpoint_partitioned_whole() -> bool:
    """Makes ``tf.train.Checkpoint`` save a partitioned Keras 3 variable (its
    value a ShardedVariable, under ``variable_partitioner``) as one whole
    tensor, and restore it onto any number of shards. Keras 3.15's TensorFlow
    ``Variable._serialize_to_tensors`` hands the saver the ShardedVariable
    itself, which fails there (``'ShardedVariable' object has no attribute
    'device'``), so no such model could be written. Other variables are left
    to Keras. Hooks the class once (idempotent). The optimizer's slots of
    such a weight are saved whole too
    (:func:`tf_asyncps.compat.sharded_slots.checkpoint_slots_whole`).

    Returns:
      False if Keras 3 is not installed.
    """
    if optimizer_class() is None:
        return False
    import tensorflow as tf
    from keras.src.backend.tensorflow import core
    from tf_asyncps.compat import tensorflow as tf_compat

    def make_serialize(original):
        def _serialize_to_tensors(self):
            shards = sharded_value(self)
            if not shards:
                return original(self)
            return {"VARIABLE_VALUE": tf.concat([s.read_value() for s in shards], 0)}
        return _serialize_to_tensors

    def make_restore(original):
        def _restore_from_tensors(self, restored_tensors):
            shards = sharded_value(self)
            if not shards:
                return original(self, restored_tensors)
            value, ops, row = restored_tensors["VARIABLE_VALUE"], [], 0
            for s in shards:  # the saved rows split by this model's shards
                ops.append(s.assign(value[row:row + s.shape[0]]))
                row += s.shape[0]
            return tf.group(ops)
        return _restore_from_tensors

    tf_compat.hook_method(core.Variable, "_serialize_to_tensors", make_serialize)
    tf_compat.hook_method(core.Variable, "_restore_from_tensors", make_restore)
    from tf_asyncps.compat import sharded_slots  # and the optimizer's slots of such a weight
    sharded_slots.checkpoint_slots_whole()
    return True

