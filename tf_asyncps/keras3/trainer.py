"""Keras 3 ``model.fit``, ``evaluate`` and ``predict`` on parameter servers.

Keras 3 has no parameter-server path (its ``fit`` distributes a dataset with
``experimental_distribute_dataset``, then runs every step on the chief;
keras-team/keras#18624), so a Keras 3 model compiled inside
``AsyncParameterServerStrategy.scope()`` gets this trainer's ``fit``,
``evaluate`` and ``predict`` as attributes of that model only: the model's
class, and every model outside the strategy, are untouched. The loop is the
one tf_keras runs under ParameterServerStrategy:

    fit ─> per-worker iterator ─> coordinator.schedule(train_steps)  (per closure)
        ─> on a worker: steps_per_execution x strategy.run(model.train_step)
        ─> model.optimizer.apply ─> the policy engine ─> the ps tasks
    epoch end ─> coordinator.join() ─> metric results read from the ps ─> callbacks

Keras 3 state that workers update at once is made exact: the optimizer's
``iterations`` (the engine), every metric variable's ``assign_add`` (one
atomic op instead of Keras' read-then-write; docs/design.md#9-keras-3-on-parameter-servers), the
LossScaleOptimizer's counters and the SeedGenerators' state.
``evaluate`` is exact: each worker holds the whole dataset, closures take
one shard of its batches each and keep metric state worker-local
(``keras.StatelessScope``); the chief sums the shards' states, as tf_keras's
``pss_evaluation_shards`` does. ``predict`` runs on the chief.
"""

import functools
import numbers

import numpy as np
import tensorflow as tf
import keras

from tf_asyncps.compat import checkpoint as checkpoint_compat
from tf_asyncps.compat import hooks as hooks_compat
from tf_asyncps.compat import keras_models as models_compat
from tf_asyncps.compat import optimizers as optimizers_compat
from tf_asyncps.compat import sharded_slots
from tf_asyncps.compat import variables as variables_compat
from tf_asyncps.compat import versions
from tf_asyncps.core import lookup
from tf_asyncps.callbacks import keras3 as callbacks_lib
from tf_asyncps.keras3 import data as data_lib
from tf_asyncps.validate import check_int, is_int

__all__ = ["Keras3Trainer", "attach", "refuse_unattached", "trainable_shards", "unsupported_version",
           "unsupported_version_message",
           "SHARDS_PER_WORKER"]

# Exact evaluation's closures per worker (tf_keras's pss_evaluation_shards="auto").
SHARDS_PER_WORKER = 5


def unsupported_version():
    """The message for an installed Keras outside the tested range, or None."""
    v = versions.keras3_version()
    return None if versions.keras3_supported(v) else unsupported_version_message(v)


def unsupported_version_message(version) -> str:
    lo, hi = versions.KERAS3
    return (f"Keras {version} is outside the Keras 3 versions tf_asyncps's model.fit on "
            f"parameter servers was tested with (>= {lo[0]}.{lo[1]}, < {hi[0]}.{hi[1]}; "
            f"tested: {', '.join(versions.KERAS3_TESTED)}): its fit internals change "
            f"between releases. Install keras>={lo[0]}.{lo[1]},<{hi[0]}.{hi[1]}, or use "
            f"tf_keras (`import tf_keras as keras`).")


def attach(model, strategy) -> None:
    """Gives a Keras 3 model compiled under ``strategy.scope()`` this module's
    ``fit``/``evaluate``/``predict`` (instance attributes: nothing else changes).

    Raises:
      ValueError: the model was created outside ``strategy.scope()``.
    """
    trainer = hooks_compat.untracked_attribute(model, "_asyncps_trainer")
    if trainer is not None and trainer.strategy is strategy:
        return
    created_under = models_compat.model_strategy(model)
    if created_under is not strategy:
        raise ValueError(
            f"Keras 3 model {model.name!r} was created outside "
            f"AsyncParameterServerStrategy.scope() (it was created under "
            f"{type(created_under).__name__ if created_under else 'no strategy'}), so its "
            f"variables live in this process, not on the ps tasks. Create and compile the "
            f"model inside `with strategy.scope():`.")
    trainer = Keras3Trainer(model, strategy)
    # Plain attributes, not tracked as model state.
    for name, value in (("_asyncps_trainer", trainer), ("fit", trainer.fit),
                        ("evaluate", trainer.evaluate), ("predict", trainer.predict),
                        ("train_on_batch", trainer.train_on_batch),
                        ("test_on_batch", trainer.test_on_batch),
                        ("save", trainer.save), ("save_weights", trainer.save_weights)):
        hooks_compat.set_untracked_attribute(model, name, value)


#: What a model created inside the scope, then compiled outside it, says for
#: every input form (Keras 3's own fit refuses a DatasetFn with "Unrecognized
#: data type" before it reaches the strategy).
COMPILED_OUTSIDE_MESSAGE = (
    "Keras 3 model {name!r} was created inside AsyncParameterServerStrategy.scope() but "
    "{how}, so its {method} would be Keras 3's own loop, which has no parameter-server "
    "path (it runs steps on the chief and takes no DatasetFn). Create AND compile the "
    "model inside `with strategy.scope():` (its fit/evaluate/predict then run on the "
    "workers), or use tf_keras (`import tf_keras as keras`).")


def refuse_unattached(strategy_class) -> None:
    """Makes Keras 3's ``fit``/``evaluate``/``predict`` of a model created
    under the scope of a ``strategy_class`` strategy (Keras 3 records it as
    the model's strategy) refuse with :data:`COMPILED_OUTSIDE_MESSAGE`, until
    :func:`attach` (a compile inside the scope) gives the model its own.
    Every other model calls Keras 3's methods as before. Once; idempotent."""

    def make_hook(original, method):
        @functools.wraps(original)
        def call(model, *args, **kwargs):
            if isinstance(models_compat.model_strategy(model), strategy_class) and \
                    hooks_compat.untracked_attribute(model, "_asyncps_trainer") is None:
                how = ("compiled outside it" if getattr(model, "compiled", False)
                       else "not compiled")
                raise ValueError(COMPILED_OUTSIDE_MESSAGE.format(name=model.name, how=how,
                                                                 method=method))
            return original(model, *args, **kwargs)
        return call

    models_compat.hook_loops(make_hook)


def _lookup_per_id(value, ids):
    with lookup.per_id_gradients():
        return tf.nn.embedding_lookup(value, ids)


def trainable_shards(model):
    """The model's trainable variables with each partitioned weight (a Keras 3
    variable over a ShardedVariable) replaced by its shards, in order.

    Keras 3 takes gradients with respect to one tf.Variable handle per weight
    and a partitioned weight has none: a custom loop over a model with
    ``variable_partitioner`` takes ``tape.gradient(loss, trainable_shards(model))``
    and applies the optimizer to the same list (each shard's gradient is an
    IndexedSlices for an Embedding table).
    """
    out = []
    for v in model.trainable_variables:
        out.extend(variables_compat.sharded_value(v) or [v])
    return out


def _to_python(v):
    a = np.asarray(v)
    return a.item() if a.ndim == 0 else a


def _positive_int(value, field, fix):
    return check_int(value, field, min=1, hint=fix.rstrip("."))


class Keras3Trainer:
    """``fit``/``evaluate``/``predict`` of one Keras 3 model on one strategy.

    Args:
      model: a compiled ``keras.Model`` created under ``strategy.scope()``.
      strategy: the ``AsyncParameterServerStrategy``.
    """

    def __init__(self, model, strategy):
        self.model = model
        self.strategy = strategy
        self.coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
        self.num_workers = len(strategy.closures_done_per_worker())
        self._reset()

    def _reset(self):
        """Forgets the traced functions: they hold the compiled optimizer,
        loss and metrics, which a new ``compile`` replaces."""
        self._compiled = models_compat.compile_state(self.model)
        self._train_fn = None
        self._step = None  # model.train_step, or its partitioned-weights form
        self._shard_fn = None
        self._predict_fn = None

    # -- checks and build ---------------------------------------------------
    @staticmethod
    def _check_version():
        message = unsupported_version()
        if message:
            raise NotImplementedError(message)

    def _build(self, inp):
        """Builds layers, metrics and the optimizer on the chief (their
        variables go to the ps), then makes the concurrent counters exact."""
        model = self.model
        if models_compat.compile_state(model) != self._compiled:
            self._reset()  # compiled again since the last fit/evaluate/predict
        spec = data_lib.element_spec(inp, self.num_workers)
        if not isinstance(spec, tuple) or len(spec) not in (2, 3) or spec[1] is None:
            raise ValueError(
                f"The dataset yields {spec!r}; fit and evaluate need (x, y) or (x, y, "
                f"sample_weight) per batch: Dataset.from_tensor_slices((x, y)).batch(n).")
        with self.strategy.scope():
            models_compat.build_layers(model, spec)
            if self._step is None:
                self._step = self._make_step()
            models_compat.symbolic_build(model, spec)
        local = [v.path for v in model.metrics_variables
                 if "/job:ps/" not in (variables_compat.backing_variable(v).device or "")]
        if local:
            raise ValueError(
                f"The metrics {local} live in this process, not on the ps tasks: the model "
                f"was compiled outside strategy.scope(). Compile it inside "
                f"`with strategy.scope():` (every worker updates them).")
        for v in model.metrics_variables:
            variables_compat.make_assign_add_atomic(v)
        opt = model.optimizer
        if opt is not None:
            optimizers_compat.make_iterations_atomic(opt)
            for v in opt.variables:
                if v.path.endswith(("step_counter", "dynamic_scale")):
                    variables_compat.make_assign_add_atomic(v)  # LossScaleOptimizer's
        for g in models_compat.seed_generators(model):
            variables_compat.make_seed_generator_atomic(g)

    def _make_step(self):
        """``model.train_step``; with partitioned weights, the same step taking
        gradients per shard (each shard is a tf.Variable on one ps task, as
        in tf_keras) and the optimizer built on the shards (slots beside
        them). Either way each Embedding looks up only its rows."""
        model = self.model
        # Each Embedding reads only its rows (Keras 3 reads the whole table),
        # each distinct id read once, a gradient row per id (core/lookup.per_id_gradients:
        # Keras 3's own sparse update rules see what they see in one process).
        for layer in models_compat.layers_of(model):
            table = getattr(layer, "embeddings", None) if isinstance(
                layer, keras.layers.Embedding) else None
            if table is not None:
                models_compat.lookup_rows_in_call(layer, table, _lookup_per_id)
        if not any(variables_compat.sharded_value(v) for v in model.trainable_variables):
            return model.train_step
        sources = trainable_shards(model)
        if models_compat.overrides_train_step(model):
            raise ValueError(
                f"{type(model).__name__} overrides train_step and has partitioned weights "
                f"(variable_partitioner): Keras 3 cannot take a gradient with respect to a "
                f"partitioned weight, so its train_step must use "
                f"tf_asyncps.keras3.trainable_shards(model) for tape.gradient and "
                f"apply_gradients; this trainer replaces only Keras' own train_step.")
        if model.optimizer.built:
            raise ValueError(
                "The optimizer was built before fit on whole weights, but some weights are "
                "partitioned: let fit build it (do not call optimizer.build), so that its "
                "slots are made per shard, beside each shard.")
        # Built now, on the shards; a checkpoint read before applies by global
        # row (compat.sharded_slots: Keras alone matches slots by position).
        sharded_slots.build_for_pending_restore(model.optimizer, sources)
        return models_compat.train_step_on(model, sources, sources)

    def _join(self, what):
        try:
            self.coordinator.join()
        except tf.errors.OutOfRangeError as e:
            raise ValueError(
                f"{what}: a worker's input ran out before the scheduled steps ran. Training "
                f"input must repeat (`dataset.repeat()`): each epoch runs steps_per_epoch "
                f"worker steps from one iterator per worker that lasts the whole fit.") from e

    def _logs(self):
        return {k: _to_python(v) for k, v in self.model.get_metrics_result().items()}

    # -- fit ------------------------------------------------------------------
    def _train_function(self):
        if self._train_fn is None:
            step, strategy = self._step, self.strategy

            @tf.function
            def train_steps(iterator, n):
                for _ in tf.range(n):
                    strategy.run(step, args=(next(iterator),))

            self._train_fn = train_steps
        return self._train_fn

    def fit(self, x=None, y=None, batch_size=None, epochs=1, verbose="auto", callbacks=None,
            validation_split=0.0, validation_data=None, shuffle=True, class_weight=None,
            sample_weight=None, initial_epoch=0, steps_per_epoch=None, validation_steps=None,
            validation_batch_size=None, validation_freq=1):
        """Trains on parameter servers; Keras 3 ``Model.fit``'s signature.

        Args:
          x: a batched ``tf.data.Dataset`` of ``(x, y[, sample_weight])``
            (every worker reads it from the start) or a
            ``tf_asyncps.keras3.DatasetFn`` (one pipeline per worker). It must
            repeat: the fit draws ``epochs * steps_per_epoch`` batches per
            worker from one iterator.
          epochs: int >= 0.
          steps_per_epoch: worker steps per epoch (int > 0), required.
          validation_data: a finite Dataset, DatasetFn or ``(x, y)`` arrays,
            evaluated exactly (each batch once) every ``validation_freq``
            epochs; ``validation_steps`` limits it to that many batches.
          callbacks: epoch-level callbacks (batch-level ones are refused).
          verbose: 0 silent; 1 or "auto": the live progress line (on a
            terminal) and one line per epoch; 2: one line per epoch.
          initial_epoch: first epoch index (``BackupAndRestore`` overrides it).

        Returns:
          A ``keras.callbacks.History``: per-epoch logs (loss and metrics over
          the epoch's worker steps, ``val_*``).

        Raises:
          ValueError/TypeError: an argument parameter-server training cannot
            honour (``y``, ``sample_weight``, ``class_weight``,
            ``validation_split``, ``batch_size`` with a dataset, a missing
            ``steps_per_epoch``, batch-level callbacks), naming it and the fix.
          NotImplementedError: an untested Keras version.
        """
        self._check_version()
        for field, value, fix in (
                ("y", y, "put the labels in the dataset: Dataset.from_tensor_slices((x, y))"),
                ("sample_weight", sample_weight, "yield (x, y, sample_weight) from the dataset"),
                ("class_weight", class_weight, "map class weights to sample weights in the dataset"),
                ("batch_size", batch_size, "batch the dataset itself (dataset.batch(n))"),
                ("validation_batch_size", validation_batch_size, "batch validation_data itself")):
            if value is not None:
                raise ValueError(f"fit({field}=...) is not supported with parameter-server "
                                 f"training: workers read a tf.data input; {fix}.")
        if validation_split:
            raise ValueError("fit(validation_split=...) is not supported with parameter-server "
                             "training: pass validation_data= (a finite dataset).")
        inp = data_lib.as_input(x, "x")
        steps = _positive_int(
            steps_per_epoch, "steps_per_epoch",
            "parameter-server training runs that many worker steps per epoch from a repeating "
            "input (as tf_keras requires under ParameterServerStrategy).")
        check_int(epochs, "epochs", min=0)
        if isinstance(validation_freq, (list, tuple)):
            if not all(is_int(e) and e >= 1 for e in validation_freq):
                raise ValueError(f"validation_freq as a list must hold epoch numbers >= 1, "
                                 f"got {validation_freq!r}.")
        else:
            _positive_int(validation_freq, "validation_freq",
                          "validate every N epochs, or pass a list of epoch numbers.")
        val = None
        if validation_data is not None:
            val = self._eval_input(validation_data, None, None, "validation_data")
            if validation_steps is not None:
                validation_steps = _positive_int(validation_steps, "validation_steps",
                                                 "the number of validation batches.")
            data_lib.check_eval_input(val, validation_steps, "validation_data")
        cbs = callbacks_lib.check_callbacks(callbacks)
        if verbose not in (0, 1, 2, "auto"):
            raise ValueError(f"verbose must be 0, 1, 2 or 'auto', got {verbose!r}.")
        self._build(inp)

        model = self.model
        history = keras.callbacks.History()
        extra = [history]
        if verbose in (1, "auto"):
            from tf_asyncps.callbacks import ProgressLine
            extra.append(ProgressLine(total_steps=epochs * steps))
        from tf_asyncps.callbacks import StalenessLogger
        if verbose in (1, 2, "auto") and not any(isinstance(c, StalenessLogger) for c in cbs):
            extra.append(callbacks_lib.EpochLine(epochs, steps))  # else it prints the line
        cb_list = keras.callbacks.CallbackList(
            cbs + extra, add_history=False, add_progbar=False, model=model,
            verbose=verbose, epochs=epochs, steps=steps)

        iterator = data_lib.train_iterator(inp, self.strategy, self.coordinator)
        train_steps = self._train_function()
        per_closure = max(1, int(getattr(model, "steps_per_execution", 1) or 1))
        model.stop_training = False
        cb_list.on_train_begin()
        first = models_compat.initial_epoch(model) or initial_epoch
        # StepBackup: a mid-epoch resume point, and a call after each closure.
        between = [cb for cb in cbs if getattr(cb, "runs_between_closures", False)]
        done = 0  # steps of the first epoch already done
        for cb in between:
            point = cb.fit_resume_point(steps)
            if point is not None:
                first, done = point
        logs = {}
        for epoch in range(first, epochs):
            model.reset_metrics()
            cb_list.on_epoch_begin(epoch)
            left = steps - (done if epoch == first else 0)
            while left > 0:
                n = min(per_closure, left)
                self.coordinator.schedule(train_steps, args=(iterator, tf.constant(n)))
                left -= n
                for cb in between:
                    cb.after_closures(epoch, steps - left)
            self._join("fit")
            logs = self._logs()
            if val is not None and _should_eval(epoch, validation_freq):
                val_logs = self._evaluate(val, validation_steps)
                logs.update({f"val_{k}": v for k, v in val_logs.items()})
            cb_list.on_epoch_end(epoch, logs)
            if model.stop_training:
                break
        if epochs > 0 and model.optimizer is not None:
            model.optimizer.finalize_variable_values(model.trainable_weights)
        cb_list.on_train_end(logs)
        return history

    # -- evaluate -------------------------------------------------------------
    def _eval_input(self, x, y, batch_size, field, sample_weight=None):
        if data_lib.is_input(x):
            if y is not None or sample_weight is not None:
                raise ValueError(f"{field}: pass y and sample_weight inside the dataset, "
                                 f"not beside it.")
            return data_lib.as_input(x, field)
        if isinstance(x, tuple) and y is None:
            x, y, sample_weight = (tuple(x) + (None, None))[:3]
        if y is None:
            raise ValueError(f"{field} needs labels: a dataset of (x, y) or arrays (x, y).")
        parts = (x, y) if sample_weight is None else (x, y, sample_weight)
        return tf.data.Dataset.from_tensor_slices(parts).batch(batch_size or 32)

    def _shard_function(self):
        if self._shard_fn is None:
            model = self.model
            metric_vars = list(model.metrics_variables)

            @tf.function
            def evaluate_shard(dataset, num_shards, index):
                # Worker-local metric state: a retried shard starts again from
                # zeros, so each batch counts once however often a worker fails.
                state = tuple(tf.zeros(v.shape, v.dtype) for v in metric_vars)
                for batch in dataset.shard(num_shards, index):
                    state = _stateless_test_step(model, metric_vars, state, batch)
                return state

            self._shard_fn = (evaluate_shard, metric_vars)
        return self._shard_fn

    def _evaluate(self, inp, steps):
        self._build(inp)
        shards = SHARDS_PER_WORKER * self.num_workers
        per_worker = data_lib.eval_datasets(inp, steps, self.coordinator)
        fn, metric_vars = self._shard_function()
        results = [self.coordinator.schedule(
            fn, args=(per_worker, tf.constant(shards, tf.int64), tf.constant(i, tf.int64)))
            for i in range(shards)]
        self._join("evaluate")
        states = [r.fetch() for r in results]
        for j, v in enumerate(metric_vars):
            v.assign(np.sum([np.asarray(s[j]) for s in states], axis=0).astype(v.dtype))
        return self._logs()

    def evaluate(self, x=None, y=None, batch_size=None, verbose="auto", sample_weight=None,
                 steps=None, callbacks=None, return_dict=False, **kwargs):
        """Exact evaluation on the workers: every batch of ``x`` (or its first
        ``steps`` batches) counts exactly once, whichever worker runs it and
        however often a worker fails (shards of batches, worker-local metric
        state, summed on the chief).

        Args:
          x: a finite batched Dataset or DatasetFn, or arrays with ``y``.
          steps: batches to evaluate (int) or None for all.
          return_dict: a dict of results instead of a list.

        Returns:
          The loss and metrics as Keras 3 ``evaluate`` returns them (a scalar,
          a list in ``model.metrics_names`` order, or a dict).

        Raises:
          ValueError: an infinite dataset without ``steps``; batch-level callbacks.
          NotImplementedError: an untested Keras version.
        """
        self._check_version()
        if kwargs:
            raise TypeError(f"evaluate() got unexpected arguments {sorted(kwargs)}.")
        inp = self._eval_input(x, y, batch_size, "x", sample_weight)
        if steps is not None:
            steps = _positive_int(steps, "steps", "the number of batches to evaluate.")
        data_lib.check_eval_input(inp, steps, "x")
        cb_list = keras.callbacks.CallbackList(
            callbacks_lib.check_callbacks(callbacks), add_history=False, add_progbar=False,
            model=self.model, verbose=verbose, epochs=1, steps=steps)
        cb_list.on_test_begin()
        logs = self._evaluate(inp, steps)
        cb_list.on_test_end(logs)
        if return_dict:
            return logs
        # Keras' own order (loss, then compile's metrics), not the dict's:
        # Keras 3.10-3.13 return get_metrics_result() sorted by name.
        return models_compat.metrics_in_order(self.model, logs)

    # -- predict --------------------------------------------------------------
    def predict(self, x, batch_size=None, verbose="auto", steps=None, callbacks=None):
        """Predicts on the chief, batch by batch in ``x``'s order (variables
        are read from the ps); returns numpy arrays of the model's outputs,
        rows in input order.

        Raises:
          ValueError: batch-level callbacks. NotImplementedError: an
            untested Keras version.
        """
        self._check_version()
        callbacks_lib.check_callbacks(callbacks)
        ds = data_lib.chief_dataset(x, batch_size)
        if steps is not None:
            ds = ds.take(_positive_int(steps, "steps", "the number of batches to predict."))
        elif ds.cardinality() == tf.data.INFINITE_CARDINALITY:
            raise ValueError("predict: x is an infinite dataset (it repeats) and no steps "
                             "were given: pass steps= or drop the repeat().")
        if models_compat.compile_state(self.model) != self._compiled:
            self._reset()
        if self._predict_fn is None:
            self._predict_fn = tf.function(self.model.predict_step)
        outs = [self._predict_fn(batch) for batch in ds]
        if not outs:
            raise ValueError("predict: x yielded no batch.")
        return tf.nest.map_structure(lambda *t: np.concatenate([np.asarray(a) for a in t]),
                                     *outs)

    # -- saving -----------------------------------------------------------
    def save(self, filepath, *args, **kwargs):
        """Keras 3 ``Model.save``; partitioned weights are saved whole (one
        array each, loadable by an unpartitioned model in one process)."""
        with checkpoint_compat.whole_values(self.model.variables):
            return type(self.model).save(self.model, filepath, *args, **kwargs)

    def save_weights(self, filepath, *args, **kwargs):
        """Keras 3 ``Model.save_weights``; partitioned weights saved whole."""
        with checkpoint_compat.whole_values(self.model.variables):
            return type(self.model).save_weights(self.model, filepath, *args, **kwargs)

    def train_on_batch(self, *args, **kwargs):
        raise NotImplementedError(
            "train_on_batch is not supported with parameter-server training: steps run as "
            "closures on the workers. Use fit(dataset, steps_per_epoch=...) or "
            "ClusterCoordinator.schedule.")

    def test_on_batch(self, *args, **kwargs):
        raise NotImplementedError(
            "test_on_batch is not supported with parameter-server training: use "
            "evaluate(dataset), which runs on the workers.")


@tf.autograph.experimental.do_not_convert
def _stateless_test_step(model, metric_vars, state, batch):
    """``model.test_step(batch)`` with the metric variables read from and
    written to ``state`` (a tuple of tensors) instead of the ps.

    The trainable weights with a regularizer are in the scope too, at their
    values read now: Keras 3 computes a weight's regularization term from the
    stateless scope's value of that weight (``Layer._get_regularization_losses``),
    and a weight missing there gave the regularizer None (``'NoneType' object
    has no attribute 'dtype'``). The forward pass reads the same value."""
    regularized = [(v, v.value) for v in model.trainable_weights
                   if getattr(v, "regularizer", None) is not None]
    mapping = list(zip(metric_vars, state)) + regularized
    with keras.StatelessScope(state_mapping=mapping) as scope:
        model.test_step(batch)
    return tuple(scope.get_current_value(v) for v in metric_vars)


def _should_eval(epoch, freq):
    if isinstance(freq, numbers.Integral):
        return (epoch + 1) % freq == 0
    return (epoch + 1) in freq
