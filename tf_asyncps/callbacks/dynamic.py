"""Eviction passes of DynamicEmbedding tables in a ``fit`` without the strategy.

Under AsyncParameterServerStrategy a table's eviction pass runs on its ps
after the updates (tf_asyncps/dynamic/table.py). In one process
(plain ``fit``, ``tf-asyncps reference``) nothing runs it, so a full table
would refuse new ids for good; :class:`DynamicEviction` runs it there.
"""

import numpy as np
import tf_keras

from tf_asyncps.dynamic import table as dt

__all__ = ["DynamicEviction", "dynamic_layers", "maps_to_rehome"]


def dynamic_layers(model) -> list:
    """The DynamicEmbedding layers of ``model`` (tf_keras or Keras 3), nested
    models included, each once."""
    out, seen, todo = [], set(), [model]
    while todo:
        layer = todo.pop()
        if id(layer) in seen:
            continue
        seen.add(id(layer))
        if isinstance(getattr(layer, "dynamic_table", None), dt.DynamicTable):
            out.append(layer)
        todo.extend(getattr(layer, "layers", None) or [])
    return out


def maps_to_rehome(model) -> list:
    """The id -> row maps (lookup tables) of ``model``'s DynamicEmbedding
    shards that a checkpoint just read holds none of: those beyond the shard
    count the checkpoint was written over, when it was restored onto more ps
    tasks (the table re-homes its ids at the first lookup). A restore lets
    exactly these go unmatched."""
    maps = []
    for layer in dynamic_layers(model):
        shards = layer.dynamic_table.shards
        saved = int(shards[0].marks.pending.numpy())  # 0: written over these shards
        if saved:
            maps += [s.index for s in shards[saved:]]
    return maps


class DynamicEviction(tf_keras.callbacks.Callback):
    """Runs the eviction passes of a model's ``DynamicEmbedding`` tables in a
    ``fit`` without AsyncParameterServerStrategy (one process).

    Before training it gives each table the optimizer's ``iterations`` as its
    step (for ``last`` step, LRU and ``ttl_steps``); after each batch
    (``steps_per_execution`` steps) it runs the passes due at that step,
    resetting the evicted rows' optimizer slots; it gives each table the
    optimizer (``DynamicEmbedding.use_optimizer``), so that checkpoints hold
    its slots of the live rows only. Not for a fit under the
    strategy: there the passes run on the ps (and batch-level callbacks are
    refused). Works in tf_keras and Keras 3 ``fit``, from any ``fit``: the
    training function is traced again with the step.

    Raises:
      ValueError: (at ``on_train_begin``) the model has no DynamicEmbedding
        layer, is not compiled with an optimizer, or has tables under
        AsyncParameterServerStrategy.
    """

    def __init__(self):
        super().__init__()
        self._layers = []

    def on_train_begin(self, logs=None):
        layers = dynamic_layers(self.model)
        if not layers:
            raise ValueError("DynamicEviction: the model has no DynamicEmbedding layer; "
                             "remove the callback.")
        optimizer = getattr(self.model, "optimizer", None)
        if optimizer is None:
            raise ValueError("DynamicEviction: compile the model with an optimizer first.")
        under = [layer.name for layer in layers if layer.under_strategy]
        if under:
            raise ValueError(f"DynamicEviction: {under} train under "
                             "AsyncParameterServerStrategy, whose ps tasks run their eviction "
                             "passes; remove the callback.")
        self._layers = layers
        for layer in layers:
            layer.use_step(optimizer.iterations)
            # Slot rows of a restore go in before the first update (a tf_keras
            # optimizer is built for them); checkpoints hold live rows only.
            layer.use_optimizer(optimizer, self.model.trainable_variables)
        # A training function traced before (an earlier fit without this
        # callback) reads no step: trace it again (tf_keras and Keras 3 both
        # call model.train_function afresh on each step).
        self.model.make_train_function(force=True)

    def on_train_batch_end(self, batch, logs=None):
        optimizer = self.model.optimizer
        step = int(np.asarray(optimizer.iterations))
        for layer in self._layers:
            layer.use_optimizer(optimizer)  # its slots exist now (a no-op after)
            layer.dynamic_table.maybe_evict(
                step, lambda var, o=optimizer: dt.optimizer_slots(o, var))
