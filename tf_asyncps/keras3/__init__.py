"""Keras 3 ``model.fit``/``evaluate``/``predict`` on parameter servers.

Plain Keras 3 code with only the strategy added::

    import keras
    with strategy.scope():
        model = keras.Sequential([...])
        model.compile(optimizer=keras.optimizers.Adam(), loss=..., metrics=[...])
    model.fit(dataset.repeat(), epochs=E, steps_per_epoch=S,
              validation_data=val_dataset, callbacks=[...])

A model compiled inside ``AsyncParameterServerStrategy.scope()`` gets this
package's ``fit``/``evaluate``/``predict`` (``trainer.py``); input forms are
in ``data.py`` (``DatasetFn``: one pipeline per worker), the callback rules
in ``tf_asyncps/callbacks/keras3.py``; ``DynamicEmbedding``,
``EmbeddingCollection`` and ``DynamicEmbeddingCollection`` are
``tf_asyncps.layers``' layers for Keras 3. Keras internals it needs are in
``tf_asyncps/compat/keras_models.py`` (its versions: ``compat/versions.py``).
"""

from tf_asyncps.keras3.data import DatasetFn
from tf_asyncps.keras3.optimizers import LazyAdam
from tf_asyncps.keras3.trainer import Keras3Trainer, attach, trainable_shards

from tf_asyncps.layers.dynamic_embedding import keras3_layer as _keras3_layer
from tf_asyncps.layers.embedding_collection import keras3_layer as _keras3_collection
from tf_asyncps.layers.dynamic_collection import keras3_layer as _keras3_dynamic_collection

# Made (and registered with Keras 3, as "tf_asyncps>DynamicEmbedding") when this
# package is imported: a process loading a .keras file imports it first.
# Documented with tf_asyncps.layers.
DynamicEmbedding = _keras3_layer()
EmbeddingCollection = _keras3_collection()
DynamicEmbeddingCollection = _keras3_dynamic_collection()

__all__ = ["DatasetFn", "Keras3Trainer", "LazyAdam", "attach", "trainable_shards"]
