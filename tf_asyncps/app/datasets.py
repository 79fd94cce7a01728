"""Real data sets for the main job: scikit-learn digits (bundled) and MNIST."""

import dataclasses

import numpy as np

__all__ = ["Data", "load", "NAMES", "make_dataset_fn"]

NAMES = ("digits", "mnist")


@dataclasses.dataclass
class Data:
    """Train/test arrays: x float32 ``(n, features)`` in [0, 1], y int64 ``(n,)``."""

    name: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int

    @property
    def num_features(self) -> int:
        return int(self.x_train.shape[1])


def _digits(seed: int, test_fraction: float) -> Data:
    try:
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split
    except ImportError:
        raise RuntimeError(
            "--dataset=digits needs scikit-learn: pip install -e '.[examples]' "
            "(or pip install scikit-learn).") from None
    d = load_digits()  # 1797 8x8 images, shipped inside scikit-learn
    x = (d.data / 16.0).astype(np.float32)
    y = d.target.astype(np.int64)
    xtr, xte, ytr, yte = train_test_split(
        x, y, test_size=test_fraction, random_state=seed, stratify=y)
    return Data("digits", xtr, ytr, xte, yte, 10)


def _mnist() -> Data:
    import tf_keras
    try:
        (xtr, ytr), (xte, yte) = tf_keras.datasets.mnist.load_data()
    except Exception as e:  # no network and no cached copy
        raise RuntimeError(
            f"--dataset=mnist could not be loaded ({type(e).__name__}: {e}). It is "
            "downloaded by Keras on first use (cached in ~/.keras/datasets). "
            "Offline, use --dataset=digits, which ships with scikit-learn.") from None
    f = lambda a: (a.reshape(len(a), -1) / 255.0).astype(np.float32)
    return Data("mnist", f(xtr), ytr.astype(np.int64), f(xte), yte.astype(np.int64), 10)


def load(name: str, seed: int = 0, test_fraction: float = 0.2) -> Data:
    """Loads a data set by name.

    Args:
      name: "digits" (1797 images, 20% held out as test with ``seed``) or
        "mnist" (60000/10000, downloaded by Keras).
      seed: split seed (int).
      test_fraction: held-out fraction for digits (0 < f < 1).

    Raises:
      ValueError: unknown name. RuntimeError: data cannot be loaded (the
        message says what to do).
    """
    if name == "digits":
        return _digits(seed, test_fraction)
    if name == "mnist":
        return _mnist()
    raise ValueError(f"--dataset={name!r} is unknown; choose one of {list(NAMES)}.")


def make_dataset_fn(x: np.ndarray, y: np.ndarray, batch_size: int, seed: int = 0,
                    shuffle: bool = True):
    """A per-worker ``dataset_fn(input_context)`` for ``DatasetCreator``.

    Each worker keeps the shard ``input_context.input_pipeline_id`` of
    ``input_context.num_input_pipelines`` (one per worker under
    AsyncParameterServerStrategy), shuffles it, repeats it and batches it
    (``batch_size`` examples per worker step).
    """
    import tensorflow as tf

    def dataset_fn(input_context):
        ds = tf.data.Dataset.from_tensor_slices((x, y))
        ds = ds.shard(input_context.num_input_pipelines, input_context.input_pipeline_id)
        if shuffle:
            ds = ds.shuffle(len(x), seed=seed, reshuffle_each_iteration=True)
        return ds.repeat().batch(batch_size, drop_remainder=True).prefetch(2)

    return dataset_fn
