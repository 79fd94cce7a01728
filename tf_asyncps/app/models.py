"""Models for the main job and benchmarks (tf_keras)."""

import tensorflow as tf
import tf_keras

__all__ = ["build_model", "NAMES"]

NAMES = ("mlp", "linear", "recommender")


def _recommender(num_features, num_classes, hidden, seed, vocab, embedding_dim):
    """One embedding table per id column of x (``vocab``: column -> rows),
    concatenated with the other columns, then Dense-ReLU layers and logits."""
    init = lambda i: tf_keras.initializers.GlorotUniform(seed=seed + i)
    x = tf_keras.Input(shape=(num_features,), name="x")
    id_cols = sorted(vocab)
    parts = []
    for col in id_cols:
        ids = tf.cast(x[:, col], tf.int32)
        parts.append(tf_keras.layers.Embedding(
            vocab[col], embedding_dim, name=f"embedding_{col}",
            embeddings_initializer=tf_keras.initializers.RandomUniform(
                -0.05, 0.05, seed=seed + 50 + col))(ids))
    dense_cols = [c for c in range(num_features) if c not in vocab]
    parts.append(tf.gather(x, dense_cols, axis=1))
    h = tf_keras.layers.Concatenate()(parts)
    for i, size in enumerate(hidden):
        h = tf_keras.layers.Dense(size, activation="relu", kernel_initializer=init(i))(h)
    logits = tf_keras.layers.Dense(num_classes, kernel_initializer=init(99))(h)
    if tf_keras.mixed_precision.global_policy().compute_dtype != "float32":
        logits = tf_keras.layers.Activation("linear", dtype="float32")(logits)
    return tf_keras.Model(x, logits, name="recommender")


def build_model(name: str, num_features: int, num_classes: int,
                hidden=(128,), seed: int = 0, vocab=None,
                embedding_dim: int = 32) -> "tf_keras.Model":
    """Builds an uncompiled tf_keras classifier that outputs logits.

    Under a tf_keras mixed-precision global policy the layers compute in 16
    bits and the logits come out in float32.

    Args:
      name: "mlp" (Dense-ReLU layers of sizes ``hidden``), "linear", or
        "recommender" (an embedding table of ``embedding_dim`` per id column
        of ``vocab``, then the mlp; e.g. users and movies for MovieLens).
      num_features: input width (int). num_classes: output width (int).
      hidden: hidden layer sizes for "mlp" and "recommender".
      seed: initializer seed, so runs with the same seed start equal.
      vocab: for "recommender", ``{column of x: table rows}``.
      embedding_dim: width of each embedding table (int >= 1).

    Raises:
      ValueError: unknown name, or "recommender" without ``vocab``.
    """
    if name == "recommender":
        if not vocab:
            raise ValueError("--model=recommender needs a data set with id columns "
                             "(--dataset=movielens).")
        return _recommender(num_features, num_classes, hidden, seed, vocab, embedding_dim)
    init = lambda i: tf_keras.initializers.GlorotUniform(seed=seed + i)
    layers = [tf_keras.Input(shape=(num_features,))]
    if name == "mlp":
        for i, h in enumerate(hidden):
            layers.append(tf_keras.layers.Dense(h, activation="relu",
                                                kernel_initializer=init(i)))
    elif name != "linear":
        raise ValueError(f"--model={name!r} is unknown; choose one of {list(NAMES)}.")
    layers.append(tf_keras.layers.Dense(num_classes, kernel_initializer=init(99)))
    if tf_keras.mixed_precision.global_policy().compute_dtype != "float32":
        # Mixed precision: float32 logits, so the softmax and the loss are
        # computed in float32 (no weights: the model's weights are unchanged).
        layers.append(tf_keras.layers.Activation("linear", dtype="float32"))
    return tf_keras.Sequential(layers, name=name)
