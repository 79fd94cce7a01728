"""Staleness tracking: the global step and the τ histograms, kept on a PS task.

Definitions (docs/design.md#3-staleness-exactly; docs/concepts/staleness.md):

* global step ``g``: int64 scalar on ``/job:ps/task:0``, incremented once per
  applied update.
* read step ``r``: the value of ``g`` a worker step observes just before it
  reads the model variables.
* staleness ``τ = g_apply - r`` where ``g_apply`` is the value of ``g`` just
  before the step's update is applied (or when it is dropped).

Everything lives in three PS variables, so a worker step adds no round trip:
the ops below are placed on the PS and run inside the PS partition of the step
function that already carries the gradients there.
"""

import dataclasses
from typing import Any, Dict, List, Optional

import numpy as np
import tensorflow as tf

__all__ = ["StalenessStats", "StalenessTracker", "PS_DEVICE"]

#: Device of the tracker's variables: the first parameter server's CPU.
PS_DEVICE = "/job:ps/replica:0/task:0/device:CPU:0"


@dataclasses.dataclass(frozen=True)
class StalenessStats:
    """A snapshot of the staleness counters.

    Attributes:
      global_step: number of applied updates (int).
      applied: gradients applied (int). Equals ``global_step`` for the async
        policies, ``global_step * replicas_to_aggregate`` for the aggregator.
      dropped: gradients dropped by the policy or the non-finite guard (int).
      histogram: int64 array of shape ``(max_tracked + 1,)``: applied gradients
        by τ; the last bin counts τ >= max_tracked.
      dropped_histogram: same shape, dropped gradients by τ.
      mean: mean τ of applied gradients (float, exact, not binned; 0.0 if none).
      max: largest τ of an applied gradient (int, exact; 0 if none).
      nonfinite: dropped gradients that held NaN or Inf (int; included in
        ``dropped``).
      local_steps: worker steps trained on local copies and pushed to the PS
        (int; ``local_sgd`` only, where ``applied`` counts exchanges).
      retried_closures: closures the coordinator put back after a worker
        failure (int, counted on the chief). Each may have run partly before
        running again in full (TensorFlow's at-least-once rule), so
        ``worker_steps`` may exceed the scheduled steps by up to this many
        closures' worth of steps.
      worker_failures: worker failures the coordinator saw (int).
      parts: under ``route``, ``{label: n}``: updates applied to each part
        (a part on local steps: its exchanges), as ``Route.part_updates``;
        counted since the start (``reset_staleness_stats`` keeps them: each
        part's τ is read from them). Empty under any other policy.
      part_histograms: under ``route``, ``{label: int64 array}`` of the
        same shape as ``histogram``: the part's updates by the part's own τ
        (``Route.part_staleness``, tf_asyncps/policies/route.py): for a
        per-step part, the updates of that part between the worker's read
        and this one (what the part's policy sees); for a part on local
        steps, each exchange by the part's exchanges since the worker's
        previous exchange or pull. A step that holds no variable of a part
        is not counted in it. Zeroed by ``reset_staleness_stats``, so
        each one sums to ``parts[label]`` counted since the last reset.
        Empty under any other policy (or a route never attached to a
        strategy).
      part_dropped_histograms: under ``route``, ``{label: int64 array}``:
        the part's refused gradients (its policy's drop, or a non-finite
        step) by the part's τ; gradients an aggregator part accepted into a
        round are in neither histogram (the round's update is). An exchange
        is never dropped.
      cached_reads: with ``embedding_cache``, ``{table: [n_0, ..., n_B]}``:
        rows a worker's cache served (every worker, since the start) by the
        updates of that row it had not pulled, 0..B = ``pull_bound``
        (core/embedding_cache.py). Empty without a cache.
    """

    global_step: int
    applied: int
    dropped: int
    histogram: np.ndarray
    dropped_histogram: np.ndarray
    mean: float
    max: int
    nonfinite: int = 0
    local_steps: int = 0
    retried_closures: int = 0
    worker_failures: int = 0
    parts: Dict[str, int] = dataclasses.field(default_factory=dict)
    part_histograms: Dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
    part_dropped_histograms: Dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
    cached_reads: Dict[str, List[int]] = dataclasses.field(default_factory=dict)

    @property
    def worker_steps(self) -> int:
        """Worker steps executed: ``applied + dropped`` (each step's gradient
        reaches the PS), or ``local_steps`` under ``local_sgd``."""
        return self.local_steps or (self.applied + self.dropped)

    def __repr__(self) -> str:
        """One line: the counts, mean and max τ, each histogram's non-zero
        buckets as ``{τ: count}`` (the last bin as ``'>=T'``), and the
        optional counters only where they are not 0."""
        parts = [f"global_step={int(self.global_step)}", f"applied={int(self.applied)}",
                 f"dropped={int(self.dropped)}", f"mean={float(self.mean):.3g}",
                 f"max={int(self.max)}", f"histogram={_buckets(self.histogram)}"]
        if int(np.sum(self.dropped_histogram)):
            parts.append(f"dropped_histogram={_buckets(self.dropped_histogram)}")
        parts += [f"{name}={int(getattr(self, name))}" for name in
                  ("nonfinite", "local_steps", "retried_closures", "worker_failures")
                  if int(getattr(self, name))]
        if self.parts:
            parts.append(f"parts={dict(self.parts)}")
        for name in ("part_histograms", "part_dropped_histograms"):
            hists = {k: h for k, h in getattr(self, name).items() if int(np.sum(h))}
            if hists:
                inner = ", ".join(f"{k!r}: {_buckets(h)}" for k, h in hists.items())
                parts.append(f"{name}={{{inner}}}")
        if self.cached_reads:
            parts.append(f"cached_reads={dict(self.cached_reads)}")
        return f"StalenessStats({', '.join(parts)})"

    def to_dict(self) -> Dict[str, Any]:
        """Returns a JSON-serialisable dict (histograms as lists of ints;
        ``parts``, the per-part histograms and ``cached_reads`` only where
        there are some)."""
        out = {
            "global_step": int(self.global_step),
            "applied": int(self.applied),
            "dropped": int(self.dropped),
            "histogram": [int(v) for v in self.histogram],
            "dropped_histogram": [int(v) for v in self.dropped_histogram],
            "mean": float(self.mean),
            "max": int(self.max),
            "nonfinite": int(self.nonfinite),
            "local_steps": int(self.local_steps),
            "retried_closures": int(self.retried_closures),
            "worker_failures": int(self.worker_failures),
        }
        if self.parts:
            out["parts"] = {str(k): int(v) for k, v in self.parts.items()}
        for name in ("part_histograms", "part_dropped_histograms"):
            if getattr(self, name):
                out[name] = {str(k): [int(n) for n in h]
                             for k, h in getattr(self, name).items()}
        if self.cached_reads:
            out["cached_reads"] = {str(k): [int(n) for n in v]
                                   for k, v in self.cached_reads.items()}
        return out


def _buckets(histogram) -> str:
    """``{τ: count}`` of a histogram's non-zero bins; the last bin, which
    counts every τ from its index on, as ``'>=T'``."""
    last = len(histogram) - 1
    items = [f"{repr(f'>={last}') if t == last else t}: {int(c)}"
             for t, c in enumerate(histogram) if int(c)]
    return "{" + ", ".join(items) + "}"


class StalenessTracker:
    """PS-resident counters behind :class:`StalenessStats`.

    Layout of the int64 ``counts`` vector (length ``2 * (T + 1) + 4`` with
    ``T = max_tracked``): applied histogram, dropped histogram, sum of applied
    τ, sum of dropped τ, non-finite drops, local steps (``local_sgd``).
    ``tau_max`` holds ``[max applied τ, max dropped τ]``.

    Per worker step the tracker adds, all on the PS: one scalar read of ``g``
    (the read step), one scalar read of ``g`` at apply time, and at most one
    ``assign_add`` of ``g``, one dense ``assign_add`` of ``counts`` and one
    ``scatter_max`` of one element.

    Args:
      max_tracked: last histogram bin (int >= 1); τ >= max_tracked share it.
      device: where the variables live (default: first PS CPU).

    Raises:
      ValueError: if ``max_tracked`` < 1.
    """

    def __init__(self, max_tracked: int = 32, device: str = PS_DEVICE):
        if int(max_tracked) < 1:
            raise ValueError(
                f"max_tracked_staleness must be >= 1, got {max_tracked!r}.")
        self.max_tracked = int(max_tracked)
        self.device = device
        bins = self.max_tracked + 1
        self._sum_applied = 2 * bins
        self._sum_dropped = 2 * bins + 1
        self._nonfinite = 2 * bins + 2
        self._local_steps = 2 * bins + 3
        with tf.init_scope(), tf.device(device):
            self.global_step = tf.Variable(
                tf.constant(0, tf.int64), trainable=False, name="asyncps_global_step")
            self.counts = tf.Variable(
                tf.zeros([2 * bins + 4], tf.int64), trainable=False,
                name="asyncps_staleness_counts")
            self.tau_max = tf.Variable(
                tf.zeros([2], tf.int64), trainable=False, name="asyncps_tau_max")

    # -- graph side (called while tracing a worker step) ---------------------
    def _add_counts(self, slices: tf.IndexedSlices) -> tf.Tensor:
        """``counts[indices] += values`` as one dense ``assign_add``: TensorFlow
        runs a resource scatter of a plain dtype under a shared lock (its
        kernel takes the exclusive one only with ``use_locking``, an attribute
        ``ResourceScatterAdd`` lacks), so two workers' increments of one bin
        could both read the old count and one was lost (seen: applied 499
        with global_step 500). ``AssignAddVariableOp`` holds the variable's
        exclusive lock; the vector is 2 * (max_tracked + 1) + 4 int64s."""
        dense = tf.scatter_nd(tf.reshape(slices.indices, [-1, 1]), slices.values,
                              tf.constant(self.counts.shape.as_list(), tf.int64))
        return self.counts.assign_add(dense)


    def read_step(self) -> tf.Tensor:
        """Returns ``g`` now (int64 scalar, placed on the PS)."""
        with tf.device(self.device):
            return self.global_step.read_value()

    def record(self, tau: tf.Tensor, applied, increment: Optional[int] = None,
               nonfinite=None) -> tf.Tensor:
        """Counts one gradient with staleness ``tau``.

        Args:
          tau: int64 scalar τ (clipped at 0).
          applied: Python bool: True counts an applied gradient, False a drop.
          increment: how much ``g`` advances; default 1 for an applied
            gradient, 0 for a drop (the aggregator passes 0 for a gradient
            accepted into an aggregate that is not yet applied).
          nonfinite: optional scalar tf.bool for a drop: the gradient held
            NaN/Inf (counted in ``StalenessStats.nonfinite``).

        Returns:
          int64 scalar: ``g`` after this record.
        """
        bins = self.max_tracked + 1
        if increment is None:
            increment = 1 if applied else 0
        with tf.device(self.device):
            tau = tf.maximum(tf.cast(tau, tf.int64), 0)
            b = tf.minimum(tau, self.max_tracked)
            one = tf.constant(1, tf.int64)
            if applied:
                idx = tf.stack([b, tf.constant(self._sum_applied, tf.int64)])
                upd = tf.stack([one, tau])
                which = 0
            else:
                idx = tf.stack([b + bins, tf.constant(self._sum_dropped, tf.int64),
                                tf.constant(self._nonfinite, tf.int64)])
                bad = tf.constant(0, tf.int64) if nonfinite is None else tf.cast(
                    nonfinite, tf.int64)
                upd = tf.stack([one, tau, bad])
                which = 1
            ops = [
                self._add_counts(tf.IndexedSlices(upd, idx)),
                self.tau_max.scatter_max(tf.IndexedSlices(
                    tf.reshape(tau, [1]), tf.constant([which], tf.int64))),
            ]
            with tf.control_dependencies(ops):
                if increment:
                    return self.global_step.assign_add(
                        tf.constant(increment, tf.int64))
                return self.global_step.read_value()

    def record_increment(self, read_step: tf.Tensor) -> tf.Tensor:
        """Advances ``g`` for an applied update and takes τ from the atomic
        increment: τ = (g after) − 1 − r. Concurrent updates each get their
        own g, so τ is exact without a lock.

        Returns:
          int64 scalar: ``g`` after this update.
        """
        with tf.device(self.device):
            g_after = self.global_step.assign_add(tf.constant(1, tf.int64))
            tau = tf.maximum(g_after - 1 - tf.cast(read_step, tf.int64), 0)
            b = tf.minimum(tau, self.max_tracked)
            ops = [
                self._add_counts(tf.IndexedSlices(
                    tf.stack([tf.constant(1, tf.int64), tau]),
                    tf.stack([b, tf.constant(self._sum_applied, tf.int64)]))),
                self.tau_max.scatter_max(tf.IndexedSlices(
                    tf.reshape(tau, [1]), tf.constant([0], tf.int64))),
            ]
            with tf.control_dependencies(ops):
                return tf.identity(g_after)

    def record_gated(self, read_step: tf.Tensor, applied: tf.Tensor,
                     tau: Optional[tf.Tensor] = None) -> tf.Tensor:
        """Counts one gradient, applied or dropped as non-finite by the
        tensor ``applied``, with no ``tf.cond``: ``g`` advances by
        ``cast(applied)`` and each counter's index is arithmetic on it
        (core/nonfinite_guard.py gates the update itself).

        Args:
          read_step: int64 scalar r, the step the worker read.
          applied: scalar tf.bool; False counts a non-finite drop.
          tau: int64 scalar τ taken before the update (a rule that used τ);
            None takes it from the increment, as :meth:`record_increment`.

        Returns:
          int64 scalar: ``g`` after this record.
        """
        bins = self.max_tracked + 1
        with tf.device(self.device):
            a = tf.cast(applied, tf.int64)
            g_after = self.global_step.assign_add(a)
            if tau is None:
                tau = g_after - a - tf.cast(read_step, tf.int64)
            tau = tf.maximum(tf.cast(tau, tf.int64), 0)
            b = tf.minimum(tau, self.max_tracked)
            dropped = 1 - a
            idx = tf.stack([b + dropped * bins,
                            self._sum_applied + dropped * (self._sum_dropped - self._sum_applied),
                            tf.constant(self._nonfinite, tf.int64)])
            ops = [
                self._add_counts(tf.IndexedSlices(
                    tf.stack([tf.constant(1, tf.int64), tau, dropped]), idx)),
                self.tau_max.scatter_max(tf.IndexedSlices(
                    tf.reshape(tau, [1]), tf.reshape(dropped, [1]))),
            ]
            with tf.control_dependencies(ops):
                return tf.identity(g_after)

    def add_local_steps(self, n: tf.Tensor) -> tf.Tensor:
        """Adds ``n`` (int64 scalar) worker steps trained on local copies
        (``local_sgd``). Returns the op's output (int64 vector, the counts)."""
        with tf.device(self.device):
            return self._add_counts(tf.IndexedSlices(
                tf.reshape(tf.cast(n, tf.int64), [1]),
                tf.constant([self._local_steps], tf.int64)))

    # -- host side ----------------------------------------------------------
    def stats(self) -> StalenessStats:
        """Reads the counters from the PS (a direct read: no training sync)."""
        g = int(self.global_step.numpy())
        counts = self.counts.numpy()
        tmax = self.tau_max.numpy()
        bins = self.max_tracked + 1
        hist = counts[:bins].astype(np.int64)
        dhist = counts[bins:2 * bins].astype(np.int64)
        applied = int(hist.sum())
        mean = float(counts[self._sum_applied]) / applied if applied else 0.0
        return StalenessStats(
            global_step=g, applied=applied, dropped=int(dhist.sum()),
            histogram=hist, dropped_histogram=dhist, mean=mean,
            max=int(tmax[0]), nonfinite=int(counts[self._nonfinite]),
            local_steps=int(counts[self._local_steps]))

    def reset(self) -> None:
        """Zeroes the histograms and maxima (the global step is kept)."""
        self.counts.assign(tf.zeros_like(self.counts))
        self.tau_max.assign(tf.zeros_like(self.tau_max))
