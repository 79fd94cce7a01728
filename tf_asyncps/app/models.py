"""Models for the main job and benchmarks, in tf_keras or Keras 3.

``build_model(..., keras=module)`` builds the same layers with either
library: ``keras_module("tf_keras")`` or ``keras_module("3")``.
"""

import tensorflow as tf
import tf_keras

__all__ = ["build_model", "NAMES", "KERAS_CHOICES", "keras_module", "is_keras3"]

#: "dlrm" is the CTR job's model (tf_asyncps.app.ctr_model), built there.
NAMES = ("mlp", "linear", "recommender", "dlrm")
KERAS_CHOICES = ("tf_keras", "3")


def keras_module(name: str = "tf_keras"):
    """The Keras library for ``--keras=name``: tf_keras, or Keras 3 (``keras``).

    Raises:
      ValueError: an unknown name.
    """
    if name == "tf_keras":
        return tf_keras
    if name == "3":
        import keras
        return keras
    raise ValueError(f"--keras={name!r} is unknown; choose one of {list(KERAS_CHOICES)}.")


def is_keras3(k) -> bool:
    return k is not tf_keras and getattr(k, "__version__", "").startswith("3")


def _recommender(k, num_features, num_classes, hidden, seed, vocab, embedding_dim,
                 dynamic=None):
    """One embedding table per id column of x (``vocab``: column -> rows),
    concatenated with the other columns, then Dense-ReLU layers and logits.
    With ``dynamic`` the id columns hold raw ids, looked up in
    ``DynamicEmbedding`` tables."""
    # Keras 3 functional models take keras.ops on symbolic inputs, not tf ops.
    cast = k.ops.cast if is_keras3(k) else tf.cast
    gather = (lambda t, cols: k.ops.take(t, cols, axis=1)) if is_keras3(k) else \
        (lambda t, cols: tf.gather(t, cols, axis=1))
    init = lambda i: k.initializers.GlorotUniform(seed=seed + i)
    x = k.Input(shape=(num_features,), name="x")
    id_cols = sorted(vocab)
    parts = []
    for col in id_cols:
        rows_init = k.initializers.RandomUniform(-0.05, 0.05, seed=seed + 50 + col)
        if dynamic:
            parts.append(_dynamic_layer(k, dynamic, col, embedding_dim, rows_init)(
                cast(x[:, col], "int64")))
            continue
        ids = cast(x[:, col], "int32")
        parts.append(k.layers.Embedding(
            vocab[col], embedding_dim, name=f"embedding_{col}",
            embeddings_initializer=rows_init)(ids))
    dense_cols = [c for c in range(num_features) if c not in vocab]
    parts.append(gather(x, dense_cols))
    h = k.layers.Concatenate()(parts)
    for i, size in enumerate(hidden):
        h = k.layers.Dense(size, activation="relu", kernel_initializer=init(i))(h)
    logits = k.layers.Dense(num_classes, kernel_initializer=init(99))(h)
    if _compute_dtype(k) != "float32":
        logits = k.layers.Activation("linear", dtype="float32")(logits)
    return k.Model(x, logits, name="recommender")


def _dynamic_layer(k, dynamic, col, embedding_dim, initializer):
    """The ``DynamicEmbedding`` of id column ``col`` (raw int64 ids)."""
    if is_keras3(k):
        raise ValueError("--dynamic_ids needs --keras=tf_keras: tf_asyncps.layers."
                         "DynamicEmbedding is a tf_keras layer.")
    from tf_asyncps.layers import DynamicEmbedding
    return DynamicEmbedding(embedding_dim, capacity=dynamic["capacity"][col],
                            evict_every=dynamic["evict_every"], initializer=initializer,
                            name=f"embedding_{col}")


def _compute_dtype(k) -> str:
    policy = k.mixed_precision.global_policy() if not is_keras3(k) else k.config.dtype_policy()
    return policy.compute_dtype


def build_model(name: str, num_features: int, num_classes: int,
                hidden=(128,), seed: int = 0, vocab=None,
                embedding_dim: int = 32, keras=None, dynamic=None) -> "tf_keras.Model":
    """Builds an uncompiled classifier that outputs logits.

    Under a mixed-precision global policy the layers compute in 16 bits and
    the logits come out in float32.

    Args:
      name: "mlp" (Dense-ReLU layers of sizes ``hidden``), "linear", or
        "recommender" (an embedding table of ``embedding_dim`` per id column
        of ``vocab``, then the mlp; e.g. users and movies for MovieLens).
      num_features: input width (int). num_classes: output width (int).
      hidden: hidden layer sizes for "mlp" and "recommender".
      seed: initializer seed, so runs with the same seed start equal.
      vocab: for "recommender", ``{column of x: table rows}``.
      embedding_dim: width of each embedding table (int >= 1).
      keras: the library (``keras_module(...)``; default tf_keras).
      dynamic: for "recommender" on raw ids: ``{"capacity": {column: rows},
        "evict_every": global steps}``, one ``tf_asyncps.layers.DynamicEmbedding``
        per id column instead of an ``Embedding`` (tf_keras only).

    Raises:
      ValueError: unknown name, "recommender" without ``vocab``, or
        ``dynamic`` with Keras 3.
    """
    k = keras or tf_keras
    if name == "dlrm":
        raise ValueError("--model=dlrm is the CTR job's model: tf_asyncps.app.ctr_model.build "
                         "(tf-asyncps launch --flagfile=configs/ctr.flags).")
    if name == "recommender":
        if not vocab:
            raise ValueError("--model=recommender needs a data set with id columns "
                             "(--dataset=movielens).")
        return _recommender(k, num_features, num_classes, hidden, seed, vocab, embedding_dim,
                            dynamic)
    init = lambda i: k.initializers.GlorotUniform(seed=seed + i)
    layers = [k.Input(shape=(num_features,))]
    if name == "mlp":
        for i, h in enumerate(hidden):
            layers.append(k.layers.Dense(h, activation="relu", kernel_initializer=init(i)))
    elif name != "linear":
        raise ValueError(f"--model={name!r} is unknown; choose one of {list(NAMES)}.")
    layers.append(k.layers.Dense(num_classes, kernel_initializer=init(99)))
    if _compute_dtype(k) != "float32":
        # Mixed precision: float32 logits, so the softmax and the loss are
        # computed in float32 (no weights: the model's weights are unchanged).
        layers.append(k.layers.Activation("linear", dtype="float32"))
    return k.Sequential(layers, name=name)
