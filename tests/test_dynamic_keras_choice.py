"""DynamicEmbedding in Keras 3 programs, in one process (issue 37, a new user's
trial): one name for both Kerases (tf_asyncps.layers.keras_choice's rule), a
subclassed Keras 3 model built symbolically and in its first traced step, and
a subclassed model whose call takes no ``training`` admitting ids in fit."""

import numpy as np
import pytest
import tensorflow as tf
import tf_keras

import tf_asyncps
from tf_asyncps.layers import DynamicEmbedding
from tf_asyncps.layers import dynamic_embedding

keras = pytest.importorskip("keras")

IDS = np.arange(36, dtype=np.int64).reshape(12, 3) * 1_000_003  # 36 distinct raw ids
Y = np.linspace(-1, 1, 12, dtype=np.float32).reshape(12, 1)


def _made_in(code):
    """The layer ``code`` makes as ``layer``, run as a module of its own (its
    globals hold only what it imports)."""
    scope = {"__name__": "user_program"}
    exec(code, scope)  # noqa: S102 (the test's own code)
    return scope["layer"]


def test_one_name_makes_the_layer_of_the_keras_the_code_imported():
    """Rule 3: a Keras 3 program that imports tf_asyncps.layers.DynamicEmbedding
    (the guide's name) gets the Keras 3 layer (it got the tf_keras one, and
    keras.Input failed in check_ids with Keras's generic KerasTensor error);
    a tf_keras program the tf_keras one; both or neither: tf_keras."""
    k3 = tf_asyncps.keras3.DynamicEmbedding
    tfk = dynamic_embedding.DynamicEmbedding
    made = {
        "import keras\nfrom tf_asyncps.layers import DynamicEmbedding\n": k3,
        "from keras import layers\nfrom tf_asyncps.layers import DynamicEmbedding\n": k3,
        "import tf_keras\nfrom tf_asyncps.layers import DynamicEmbedding\n": tfk,
        "import tf_keras, keras\nfrom tf_asyncps.layers import DynamicEmbedding\n": tfk,
        "from tf_asyncps.layers import DynamicEmbedding\n": tfk,
        "import tf_keras\nfrom tf_asyncps.layers import DynamicEmbedding\n"
        "layer = DynamicEmbedding(4, 8, keras='keras3')\n": k3,
        "import keras\nfrom tf_asyncps.layers import DynamicEmbedding\n"
        "layer = DynamicEmbedding(4, 8, keras='tf_keras')\n": tfk,
    }
    for code, cls in made.items():
        if "layer =" not in code:
            code += "layer = DynamicEmbedding(4, 8)\n"
        layer = _made_in(code)
        assert type(layer) is cls, code
        assert isinstance(layer, DynamicEmbedding) and isinstance(layer, cls), code
    assert issubclass(k3, DynamicEmbedding) and issubclass(tfk, DynamicEmbedding)
    assert not isinstance(keras.layers.Dense(1), DynamicEmbedding)
    with pytest.raises(ValueError, match=r"keras='keras2'.*keras=\"tf_keras\" or "
                                         r"keras=\"keras3\""):
        DynamicEmbedding(4, 8, keras="keras2")


def test_the_guides_program_in_keras_3_trains_and_round_trips_its_config():
    """The guide's first example with Keras 3: keras.Input, the picked layer,
    fit admits every id; the model's config loads back (the Keras 3 class is
    registered) with the same class."""
    layer = _made_in("import keras\nfrom tf_asyncps.layers import DynamicEmbedding\n"
                     "layer = DynamicEmbedding(4, capacity=64, initializer='zeros')\n")
    i = keras.Input((3,), dtype="int64")
    model = keras.Model(i, keras.layers.Dense(1, kernel_initializer="ones")(
        keras.layers.Flatten()(layer(i))))
    model.compile(keras.optimizers.SGD(0.1), "mse")
    model.fit(IDS, Y, batch_size=4, epochs=1, verbose=0, shuffle=False)
    assert layer.stats() == {"live_rows": 36, "capacity": 64, "evicted": 0, "refused": 0}
    again = keras.Model.from_config(model.get_config())
    assert type(again.layers[1]) is tf_asyncps.keras3.DynamicEmbedding


def test_a_model_being_made_picks_its_keras_and_the_other_kerases_input_names_the_class():
    """Rule 2: made in a subclassed Keras 3 model's or layer's __init__ (this
    module imports both Kerases): the Keras 3 layer; in a tf_keras model's, tf_keras. The tf_keras layer given
    keras.Input, and the Keras 3 one given tf_keras.Input, fail naming the
    class to use."""
    class Model(keras.Model):
        def __init__(self):
            super().__init__()
            self.emb = DynamicEmbedding(4, capacity=8)

    assert type(Model().emb) is tf_asyncps.keras3.DynamicEmbedding

    class TfKerasModel(tf_keras.Model):
        def __init__(self):
            super().__init__()
            self.emb = DynamicEmbedding(4, capacity=8)

    assert type(TfKerasModel().emb) is dynamic_embedding.DynamicEmbedding

    class Tower(keras.layers.Layer):  # a layer of Keras 3 holding the table
        def __init__(self):
            super().__init__()
            self.emb = DynamicEmbedding(4, capacity=8)

    assert type(Tower().emb) is tf_asyncps.keras3.DynamicEmbedding
    with pytest.raises(TypeError, match=r"is the tf_keras layer and got a Keras 3 KerasTensor: "
                                        r"make it with tf_asyncps.layers.DynamicEmbedding\(\.\.\., "
                                        r"keras=\"keras3\"\) or tf_asyncps.keras3.DynamicEmbedding"):
        DynamicEmbedding(4, 8, keras="tf_keras")(keras.Input((3,), dtype="int64"))
    with pytest.raises(TypeError, match=r"is the Keras 3 layer and got a tf_keras KerasTensor: "
                                        r"make it with .*keras=\"tf_keras\""):
        DynamicEmbedding(4, 8, keras="keras3")(tf_keras.Input((3,), dtype="int64"))


class SilentModel(keras.Model):
    """A subclassed Keras 3 model whose call takes no ``training`` (Keras 3's
    fit then calls it without)."""

    def __init__(self):
        super().__init__()
        self.emb = tf_asyncps.keras3.DynamicEmbedding(4, capacity=64, initializer="zeros")
        self.head = keras.layers.Dense(1, kernel_initializer="ones")

    def call(self, ids):
        return self.head(keras.ops.reshape(self.emb(ids), (-1, 12)))


class PassingModel(SilentModel):
    """The same model passing ``training`` on."""

    def call(self, ids, training=None):
        return self.head(keras.ops.reshape(self.emb(ids, training=training), (-1, 12)))


def _fit(model, epochs=1):
    model.compile(keras.optimizers.SGD(0.1), "mse")
    return model.fit(IDS, Y, batch_size=4, epochs=epochs, verbose=0, shuffle=False)


def test_a_subclassed_keras3_model_builds_symbolically_and_in_its_first_step():
    """model(keras.Input(...)) builds the table (it failed: 'NoneType' object
    has no attribute 'shape', Keras deferred the weight); an unbuilt model's
    fit builds it inside the traced step (it failed: a tensor of that graph
    out of scope) and admits every id."""
    model = PassingModel()
    out = model(keras.Input((3,), dtype="int64"))
    assert tuple(out.shape) == (None, 1)
    assert model.emb.dynamic_table.capacity == 64 and model.emb.stats()["live_rows"] == 0
    _fit(model)
    assert model.emb.stats()["live_rows"] == 36
    fresh = PassingModel()  # built by fit, in its first step
    _fit(fresh)
    assert fresh.emb.stats() == {"live_rows": 36, "capacity": 64, "evicted": 0, "refused": 0}
    np.testing.assert_allclose(fresh.predict(IDS, verbose=0), model.predict(IDS, verbose=0),
                               rtol=0, atol=1e-6)


def test_a_subclassed_model_whose_call_takes_no_training_admits_in_fit_only():
    """Keras 3's train_step calls such a model without ``training``: the layer
    admitted nothing (0 live rows, the loss stuck, no warning). Now a call
    made within a train_step trains: the same predictions as the model that
    passes training=True; predict and evaluate admit nothing."""
    silent, passing = SilentModel(), PassingModel()
    history = _fit(silent, epochs=3)
    _fit(passing, epochs=3)
    assert silent.emb.stats()["live_rows"] == 36
    assert history.history["loss"][-1] < history.history["loss"][0]
    np.testing.assert_allclose(silent.predict(IDS, verbose=0), passing.predict(IDS, verbose=0),
                               rtol=0, atol=1e-6)
    new = IDS + 7
    silent.predict(new, verbose=0)
    silent.evaluate(new, Y, verbose=0)
    assert silent.emb.stats()["live_rows"] == 36
