"""Keras 3 models in training, the internals ``tf_asyncps/keras3/`` (model.fit
on parameter servers) uses: which model a ``Trainer.compile`` runs for
(hooked, :mod:`tf_asyncps.compat.call_scopes`) and what it set; the loops of a
model created under the strategy but not compiled in it (refused,
:func:`hook_loops`); ``Trainer._symbolic_build`` (to build a model from a
dataset's element spec); ``evaluate``'s metric order; the trainer's
``train_step`` on a partitioned weight's shards; a model's layers, seed
generators and strategy; an ``Embedding`` that reads only its looked-up
rows; the epoch ``BackupAndRestore`` restored; TensorBoard's profiling range.

Tested with Keras 3.10.0 (the oldest accepted), 3.12.4 (the oldest TensorFlow
2.21 accepts) and 3.15.1 (what pip installs with each of TensorFlow
2.16-2.21; :data:`tf_asyncps.compat.versions.KERAS3_TESTED`); a function
that names a release was checked there.
:data:`tf_asyncps.compat.versions.KERAS3` is what ``tf_asyncps/keras3``
accepts. Importing this module imports nothing; functions import Keras when
called.
"""

import functools
import sys

__all__ = ["is_keras3_model", "compiling_model", "hook_loops", "in_keras3_loop", "compile_state",
           "symbolic_build", "build_layers", "metrics_in_order", "overrides_train_step",
           "train_step_on", "model_strategy", "layers_of", "seed_generators",
           "lookup_rows_in_call", "initial_epoch", "set_initial_epoch", "tensorboard_profiles"]


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


def hook_loops(make_hook) -> bool:
    """Replaces ``fit``, ``evaluate`` and ``predict`` of Keras 3's
    ``keras.Model`` (``keras.src.models.model.Model``; Keras 3.10-3.15 define
    them in the TensorFlow backend's trainer) by ``make_hook(original,
    name)``, once per method (see :func:`tf_asyncps.compat.hooks.hook_method`).
    A model's own instance attributes of those names (tf_asyncps.keras3's
    ``attach``) come first.

    Returns:
      False if Keras 3 is not installed.
    """
    from tf_asyncps.compat.optimizers import optimizer_class
    if optimizer_class() is None:
        return False
    from keras.src.models.model import Model
    from tf_asyncps.compat import call_scopes
    from tf_asyncps.compat import hooks as hooks_compat

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
        hooks_compat.hook_method(Model, name, lambda original, name=name: make(original, name))
    return True


def in_keras3_loop() -> bool:
    """Whether Keras 3's own ``fit``/``evaluate``/``predict`` runs on this
    thread (hooked by :func:`hook_loops`), e.g. its ``fit`` distributing a
    dataset."""
    from tf_asyncps.compat import call_scopes
    return call_scopes.KERAS3_LOOP.get() is not None


def compile_state(model):
    """What a ``compile`` sets (ids of the optimizer, the compiled loss and
    metrics, the loss tracker): a new compile changes it."""
    return tuple(id(getattr(model, a, None)) for a in
                 ("optimizer", "_compile_loss", "_compile_metrics", "_loss_tracker"))


def symbolic_build(model, element_spec) -> None:
    """Builds ``model``'s layers, compiled metrics/loss and optimizer from a
    dataset's ``element_spec`` (``(x, y[, sample_weight])`` of TensorSpecs),
    without running a batch: Keras 3's ``Trainer._symbolic_build``."""
    model._symbolic_build(data_batch=element_spec)


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


def metrics_in_order(model, logs):
    """``evaluate``'s list form of ``logs`` (a ``{name: value}`` dict), as
    Keras 3's own ``evaluate`` returns it: ``Trainer._flatten_metrics_in_order``
    (the loss, then the compiled metrics in ``compile`` order, then the other
    names sorted); one value alone is returned bare. Keras 3.10-3.13's
    ``get_metrics_result`` sorts its keys by name (``accuracy`` before
    ``loss``), so the dict's own order is not Keras' (3.14 and 3.15 keep it)."""
    return model._flatten_metrics_in_order(logs)


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


def model_strategy(model):
    """The strategy a Keras 3 model was created under (None: outside any)."""
    return getattr(model, "_distribute_strategy", None)


def layers_of(model):
    """Every layer of ``model``, nested ones included."""
    return list(model._flatten_layers(include_self=False, recursive=True))


def seed_generators(model):
    """Every ``SeedGenerator`` of the model's layers (e.g. Dropout's)."""
    out = []
    for layer in model._flatten_layers(include_self=True, recursive=True):
        out.extend(getattr(layer, "_seed_generators", ()) or ())
    return out


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


def initial_epoch(model):
    """The epoch ``BackupAndRestore.on_train_begin`` restored (Keras 3 sets
    ``model._initial_epoch``), else None."""
    return getattr(model, "_initial_epoch", None)


def set_initial_epoch(model, epoch: int) -> None:
    """Makes Keras 3's ``fit`` (and this package's) start at ``epoch``, as
    Keras 3.15's ``BackupAndRestore._load_model`` does (``model._initial_epoch``,
    read after ``on_train_begin``)."""
    model._initial_epoch = int(epoch)


def tensorboard_profiles(callback) -> bool:
    """Whether a Keras 3 ``TensorBoard`` callback profiles batches
    (``profile_batch`` other than 0): Keras 3.15 keeps the range as
    ``_start_batch``/``_stop_batch`` (``_profile_batch`` is read too, as
    releases before it may name it)."""
    return bool(getattr(callback, "_profile_batch", 0) or getattr(callback, "_start_batch", 0))
