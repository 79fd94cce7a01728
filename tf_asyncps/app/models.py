"""Models for the main job and benchmarks (tf_keras)."""

import tf_keras

__all__ = ["build_model", "NAMES"]

NAMES = ("mlp", "linear")


def build_model(name: str, num_features: int, num_classes: int,
                hidden=(128,), seed: int = 0) -> "tf_keras.Model":
    """Builds an uncompiled tf_keras classifier that outputs logits.

    Under a tf_keras mixed-precision global policy the layers compute in 16
    bits and the logits come out in float32.

    Args:
      name: "mlp" (Dense-ReLU layers of sizes ``hidden``) or "linear".
      num_features: input width (int). num_classes: output width (int).
      hidden: hidden layer sizes for "mlp".
      seed: initializer seed, so runs with the same seed start equal.

    Raises:
      ValueError: unknown name.
    """
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
