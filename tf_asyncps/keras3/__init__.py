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
in ``tf_asyncps/callbacks/keras3.py``; ``DynamicEmbedding`` is
``tf_asyncps.layers.DynamicEmbedding`` for Keras 3. Keras internals it needs
are in ``tf_asyncps/compat/keras.py``.
"""

from tf_asyncps.keras3.data import DatasetFn
from tf_asyncps.keras3.trainer import Keras3Trainer, attach, trainable_shards

# DynamicEmbedding (the Keras 3 layer) is made on first use (__getattr__):
# documented with tf_asyncps.layers.
__all__ = ["DatasetFn", "Keras3Trainer", "attach", "trainable_shards"]


def __getattr__(name):
    if name == "DynamicEmbedding":  # imports Keras 3: on first use
        from tf_asyncps.layers.dynamic_embedding import keras3_layer
        return keras3_layer()
    raise AttributeError(f"module 'tf_asyncps.keras3' has no attribute {name!r}")
