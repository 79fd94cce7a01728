"""Criteo-shaped click data for the CTR job, generated from a seed.

No package ships a sample of the Criteo data, so the job makes data of its
shape: the 26 categorical features of the Criteo Kaggle (Display
Advertising Challenge, 2014) data at their cardinalities (``CRITEO_KAGGLE``,
capped and scaled by :func:`table_rows`), 13 log-normal counts, and a
click label drawn from a planted model, so that held-out AUC and log loss
measure how much of a known signal a trained model recovered.

Categorical ids. Feature ``f`` has ``N = rows[f]`` ids. Its ranks follow a
Zipf law of exponent ``a`` in its discretised continuous form: rank
``r = floor(X)`` with X of density proportional to ``x**-a`` on
``[1, N + 1)``, so ``P(r) = (r**(1-a) - (r+1)**(1-a)) / (1 - (N+1)**(1-a))``
(``log((r+1)/r) / log(N+1)`` at ``a = 1``) and the ``m`` most frequent ids
hold :func:`top_share` of the draws, in closed form. Rank ``r`` is id
``(r - 1) * m_f mod N`` with ``m_f`` coprime to ``N``: a permutation, so hot
ids are spread over the table's shards rather than all in the first.

Planted model (the labels' source). Each (feature, id) has a fixed vector
``e_f(id)`` of ``PLANTED_DIM`` components, each uniform on ``[-sqrt 3, sqrt 3]``
(mean 0, variance 1), computed from a 32-bit integer hash of the id and a
salt of (seed, feature, component): no table is stored, whatever ``N``. With
``z_j`` the standardised log of count j::

    logit = b + FIRST * sum_f w_f e_f(id_f)[0] / sqrt(F)
              + PAIRS * sum_{f<g} <e_f(id_f)[1:], e_g(id_g)[1:]> / sqrt(F (F-1) / 2 * (D-1))
              + DENSE * sum_j c_j z_j / sqrt(13)
    y ~ Bernoulli(sigmoid(logit))

with ``w_f`` and ``c_j`` drawn from the seed, and the bias ``b`` set (by
bisection on a calibration sample of ``CALIBRATION_EXAMPLES``) so that
``BASE_RATE`` of the labels are 1, about Criteo's click rate. The pairwise
term is what DLRM's dot-product interaction (Naumov et al. 2019) models.

Streams. Every batch is a pure function of (seed, stream, batch index)
through TensorFlow's stateless random ops, so it is made on the worker
that reads it (nothing is shipped) and is the same on every run: stream
:data:`TEST_STREAM` is the held-out split, :func:`train_stream` ``(w)`` is
worker ``w``'s training data; no two streams share an example draw.

Inputs. ``{"dense": float32 [batch, 13] log(1 + count) (DLRM's transform of
the Criteo counts), "sparse": int32 [batch, 26] ids in [0, rows[f])}`` and
float32 labels ``[batch, 1]``; with ``raw_ids`` the sparse column holds
int64 raw ids instead (a 64-bit hash of (feature, id), as hashed Criteo
strings would be) for ``DynamicEmbedding`` tables.
"""

import dataclasses
import math
from typing import Dict, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

from tf_asyncps.validate import check_int, check_number

__all__ = ["CRITEO_KAGGLE", "NUM_DENSE", "PLANTED_DIM", "BASE_RATE", "TEST_STREAM",
           "CtrData", "table_rows", "top_share", "zipf_probabilities", "mix32", "train_stream",
           "make"]

#: Distinct values of the 26 categorical features of the Criteo Kaggle data.
CRITEO_KAGGLE = (1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593,
                 3194, 27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105,
                 142572)
NUM_DENSE = 13
PLANTED_DIM = 4
#: Share of clicks the bias is set to (Criteo Kaggle: about 0.256).
BASE_RATE = 0.25
#: Scales of the planted logit's three terms (each normalised term has variance about 1
#: when ids are spread evenly; Zipf ids make the categorical terms smaller).
FIRST, PAIRS, DENSE = 1.0, 0.8, 0.6
CALIBRATION_EXAMPLES = 1 << 16
CALIBRATION_STREAM, TEST_STREAM = 0, 1
_MASK32 = 0xFFFFFFFF
_MIX = 0x45D9F3B  # < 2**27: a 32-bit value times it stays below 2**59 in int64


def train_stream(worker: int) -> int:
    """The stream of worker ``worker``'s training batches."""
    return 2 + worker


def table_rows(max_rows: int = 1_000_000, scale: float = 1.0,
               cardinalities: Sequence[int] = CRITEO_KAGGLE) -> Tuple[int, ...]:
    """Rows of each feature's table: ``max(1, round(min(card, max_rows) * scale))``.

    Raises:
      ValueError: ``max_rows < 1`` or ``scale`` not in (0, 1].
    """
    check_int(max_rows, "--ctr_max_rows", min=1, hint="rows per feature at most")
    if not 0 < scale <= 1:
        raise ValueError(f"--ctr_scale must be in (0, 1] (a fraction of each feature's rows), "
                         f"got {scale!r}.")
    return tuple(max(1, int(round(min(c, max_rows) * scale))) for c in cardinalities)


def top_share(m: int, n: int, a: float) -> float:
    """Share of the draws that the ``m`` most frequent of ``n`` ids receive
    (closed form of the module's Zipf law of exponent ``a``)."""
    if a == 1.0:
        return math.log(m + 1) / math.log(n + 1)
    return (1.0 - (m + 1) ** (1.0 - a)) / (1.0 - (n + 1) ** (1.0 - a))


def zipf_probabilities(n: int, a: float) -> np.ndarray:
    """float64 [n]: ``P(rank r)`` for r = 1..n (the module's Zipf law)."""
    edges = np.arange(1, n + 2, dtype=np.float64)
    if a == 1.0:
        c = np.log(edges)
    else:
        c = -(edges ** (1.0 - a))
    c = c - c[0]
    return np.diff(c) / c[-1]


def mix32(x):
    """A 32-bit integer hash (xor-shift-multiply, 3 rounds), bijective on
    [0, 2**32); numpy int64 arrays or int64 tensors, same values."""
    if isinstance(x, np.ndarray) or np.isscalar(x):
        x = np.asarray(x, np.int64) & _MASK32
        for _ in range(2):
            x = (((x >> 16) ^ x) * _MIX) & _MASK32
        return (x >> 16) ^ x
    x = tf.bitwise.bitwise_and(tf.cast(x, tf.int64), _MASK32)
    for _ in range(2):
        x = tf.bitwise.bitwise_and(
            tf.bitwise.bitwise_xor(tf.bitwise.right_shift(x, 16), x) * _MIX, _MASK32)
    return tf.bitwise.bitwise_xor(tf.bitwise.right_shift(x, 16), x)


def _coprime_multiplier(n: int, start: int) -> int:
    m = start % n if n > 1 else 0
    while n > 1 and math.gcd(m, n) != 1:
        m = (m + 1) % n
    return m


@dataclasses.dataclass(frozen=True)
class CtrData:
    """The generator of one seed: table sizes, the Zipf exponent and the
    planted model. Build with :func:`make`.

    Attributes:
      rows: ids per feature (26 ints). zipf_a: the Zipf exponent (>= 0).
      seed: the data seed. bias: the planted logit's bias (calibrated).
      raw_ids: ``inputs`` carry int64 raw ids instead of int32 ids.
    """

    rows: Tuple[int, ...]
    zipf_a: float
    seed: int
    feature_weights: Tuple[float, ...]
    dense_coefs: Tuple[float, ...]
    dense_mu: Tuple[float, ...]
    dense_sigma: Tuple[float, ...]
    multipliers: Tuple[int, ...]
    salts: Tuple[Tuple[int, ...], ...]  # [feature][component], then 2 raw-id salts
    bias: float = 0.0
    raw_ids: bool = False

    @property
    def num_features(self) -> int:
        return len(self.rows)

    # -- one batch, as tensors ------------------------------------------------
    def _seed(self, stream, index, k):
        s = tf.cast(self.seed, tf.int64) * 65536 + tf.cast(stream, tf.int64)
        return tf.stack([s, tf.cast(index, tf.int64) * 8 + k])

    def ids(self, stream, index, batch: int):
        """int64 [batch, F]: feature f's ids in [0, rows[f])."""
        u = tf.random.stateless_uniform([batch, self.num_features],
                                        self._seed(stream, index, 0), dtype=tf.float64)
        n = tf.constant(self.rows, tf.float64)
        if self.zipf_a == 1.0:
            x = tf.exp(u * tf.math.log(n + 1.0))
        else:
            e = 1.0 - self.zipf_a
            x = tf.pow(1.0 - u * (1.0 - tf.pow(n + 1.0, e)), 1.0 / e)
        rank = tf.clip_by_value(tf.cast(tf.floor(x), tf.int64), 1, tf.cast(n, tf.int64))
        return ((rank - 1) * tf.constant(self.multipliers, tf.int64)) % \
            tf.constant(self.rows, tf.int64)

    def counts(self, stream, index, batch: int):
        """float32 [batch, 13]: the log-normal counts, and their standard
        normal draws z (float64 [batch, 13])."""
        z = tf.random.stateless_normal([batch, NUM_DENSE], self._seed(stream, index, 1),
                                       dtype=tf.float64)
        x = tf.exp(tf.constant(self.dense_mu, tf.float64) +
                   tf.constant(self.dense_sigma, tf.float64) * z)
        return tf.cast(x, tf.float32), z

    def planted_vectors(self, ids):
        """float64 [..., F, PLANTED_DIM]: e_f(id) for int64 ids [..., F]."""
        comps = []
        for k in range(PLANTED_DIM):
            salt = tf.constant([s[k] for s in self.salts], tf.int64)
            h = mix32(tf.bitwise.bitwise_xor(mix32(tf.bitwise.bitwise_xor(ids, salt)), salt))
            comps.append(tf.cast(h, tf.float64) / 2.0 ** 32)
        return (tf.stack(comps, axis=-1) * 2.0 - 1.0) * math.sqrt(3.0)

    def planted_logit(self, ids, z):
        """float64 [batch]: the planted logit of ids [batch, F] and z [batch, 13]."""
        e = self.planted_vectors(ids)
        f = self.num_features
        first = tf.reduce_sum(e[..., 0] * tf.constant(self.feature_weights, tf.float64),
                              -1) / math.sqrt(f)
        v = e[..., 1:]
        total = tf.reduce_sum(v, axis=-2)
        pairs = (tf.reduce_sum(total * total, -1) - tf.reduce_sum(v * v, [-2, -1])) / 2.0
        pairs /= math.sqrt(f * (f - 1) / 2 * (PLANTED_DIM - 1))
        dense = tf.reduce_sum(z * tf.constant(self.dense_coefs, tf.float64), -1) / \
            math.sqrt(NUM_DENSE)
        return self.bias + FIRST * first + PAIRS * pairs + DENSE * dense

    def raw(self, ids):
        """int64 [..., F]: raw ids, a 64-bit hash of (feature, id) (distinct per
        feature and id)."""
        hi = tf.constant([s[PLANTED_DIM] for s in self.salts], tf.int64)
        lo = tf.constant([s[PLANTED_DIM + 1] for s in self.salts], tf.int64)
        return tf.bitwise.bitwise_or(
            tf.bitwise.left_shift(mix32(tf.bitwise.bitwise_xor(ids, hi)), 32),
            mix32(tf.bitwise.bitwise_xor(ids, lo)))

    def batch(self, stream, index, batch: int):
        """One batch ``(inputs, labels)`` (see the module docstring),
        stateless in (seed, stream, index)."""
        return self._batch(stream, index, batch)[:2]

    def _batch(self, stream, index, batch):
        ids = self.ids(stream, index, batch)
        counts, z = self.counts(stream, index, batch)
        p = tf.sigmoid(self.planted_logit(ids, z))
        u = tf.random.stateless_uniform([batch], self._seed(stream, index, 2), dtype=tf.float64)
        labels = tf.cast(u < p, tf.float32)[:, None]
        sparse = self.raw(ids) if self.raw_ids else tf.cast(ids, tf.int32)
        return {"dense": tf.math.log1p(counts), "sparse": sparse}, labels, p

    # -- datasets and arrays ----------------------------------------------------
    def dataset(self, stream, batch: int, start: int = 0, batches: Optional[int] = None):
        """``tf.data.Dataset`` of batches ``start, start + 1, ...`` of ``stream``
        (endless without ``batches``); ``stream`` may be a tensor (the worker's
        index under the strategy)."""
        idx = tf.data.Dataset.range(start, start + batches) if batches is not None else \
            tf.data.Dataset.range(start, 2 ** 62)
        return idx.map(lambda i: self.batch(stream, i, batch)).prefetch(2)

    def dataset_fn(self, batch: int, start: int = 0):
        """Per-worker ``dataset_fn(input_context)`` (``DatasetCreator`` /
        ``tf_asyncps.keras3.DatasetFn``): worker w reads ``train_stream(w)``
        from batch ``start`` (int >= 0; a resumed run passes the worker
        steps of its backup, see ctr_job)."""
        start = check_int(start, "start", min=0, below=2 ** 62, hint="a batch index")

        def dataset_fn(input_context):
            worker = tf.cast(input_context.input_pipeline_id, tf.int64)
            return self.dataset(train_stream(0) + worker, batch, start=start)
        return dataset_fn

    def arrays(self, stream: int, examples: int, batch: int = 8192):
        """Numpy ``(inputs, labels, planted_probabilities)`` of the first
        ``examples`` of ``stream`` (eager; e.g. the held-out split)."""
        parts = []
        for i in range(-(-examples // batch)):
            x, y, p = self._batch(stream, i, batch)
            parts.append((x["dense"].numpy(), x["sparse"].numpy(), y.numpy(), p.numpy()))
        cat = lambda j: np.concatenate([p[j] for p in parts])[:examples]
        return {"dense": cat(0), "sparse": cat(1)}, cat(2), cat(3)


def _calibrate_bias(data: CtrData, target: float) -> float:
    """The bias b with mean(sigmoid(logit0 + b)) = target on the calibration
    stream (bisection; the mean is increasing in b)."""
    ids = data.ids(CALIBRATION_STREAM, 0, CALIBRATION_EXAMPLES)
    _, z = data.counts(CALIBRATION_STREAM, 0, CALIBRATION_EXAMPLES)
    logit0 = data.planted_logit(ids, z).numpy() - data.bias
    lo, hi = -30.0, 30.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if np.mean(1.0 / (1.0 + np.exp(-(logit0 + mid)))) < target:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def make(rows: Sequence[int], zipf_a: float = 1.1, seed: int = 0, raw_ids: bool = False,
         base_rate: float = BASE_RATE) -> CtrData:
    """The generator of ``seed``: planted weights drawn, bias calibrated.

    Args:
      rows: ids per feature (ints >= 1), e.g. :func:`table_rows`.
      zipf_a: the Zipf exponent (float >= 0; 0: uniform ids).
      seed: int >= 0.
      raw_ids: emit int64 raw ids (for ``DynamicEmbedding``).
      base_rate: the share of positive labels the bias is set to, in (0, 1).

    Raises:
      ValueError: a field out of range, naming its flag.
    """
    rows = tuple(int(r) for r in rows)
    if not rows or min(rows) < 1:
        raise ValueError(f"every feature needs >= 1 row, got {rows!r}.")
    check_number(zipf_a, "--ctr_zipf", min=0, below=float("inf"),
                 hint="the Zipf exponent of the ids; Criteo-like: 1.1")
    check_int(seed, "--seed", min=0, below=2 ** 40, hint="for the CTR data")
    if not 0 < base_rate < 1:
        raise ValueError(f"base_rate must be in (0, 1), got {base_rate!r}.")
    rng = np.random.default_rng([seed, 0xC7])
    f = len(rows)
    weights = np.exp(rng.normal(0.0, 0.5, f))
    weights /= np.sqrt(np.mean(weights ** 2))  # mean square 1: the term's variance stays 1
    salts = mix32(rng.integers(0, 2 ** 32, size=(f, PLANTED_DIM + 2), dtype=np.int64))
    mults = rng.integers(2 ** 20, 2 ** 31, size=f)
    data = CtrData(
        rows=rows, zipf_a=float(zipf_a), seed=int(seed),
        feature_weights=tuple(float(w) for w in weights),
        dense_coefs=tuple(float(c) for c in rng.uniform(-1.0, 1.0, NUM_DENSE) * math.sqrt(3)),
        dense_mu=tuple(float(m) for m in rng.uniform(0.0, 3.0, NUM_DENSE)),
        dense_sigma=tuple(float(s) for s in rng.uniform(0.5, 1.5, NUM_DENSE)),
        multipliers=tuple(_coprime_multiplier(n, int(m)) for n, m in zip(rows, mults)),
        salts=tuple(tuple(int(s) for s in row) for row in salts), raw_ids=bool(raw_ids))
    return dataclasses.replace(data, bias=_calibrate_bias(data, base_rate))


def summary(data: CtrData) -> Dict[str, object]:
    """What metrics.json records of the data (JSON types)."""
    return {"rows": list(data.rows), "total_rows": int(sum(data.rows)), "zipf_a": data.zipf_a,
            "planted_bias": data.bias, "raw_ids": data.raw_ids}
