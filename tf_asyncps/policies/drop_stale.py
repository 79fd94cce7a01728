"""``drop_stale``: apply a gradient only if its staleness is at most s.

Rule: apply g iff τ <= max_staleness, else drop it and count it in
``dropped_histogram``. A bounded-delay variant of asynchronous SGD in the
spirit of Dutta et al., "Slow and Stale Gradients Can Win the Race" (AISTATS
2018) and TF1's SyncReplicasOptimizer, which dropped stale gradients.

When to use: workers of uneven speed, where very stale gradients hurt
convergence more than the lost work. ``max_staleness=0`` applies only
gradients computed on the current parameters (exactly sequential SGD on the
applied steps). The decision and the update run under a PS lock (atomic), so
τ is exact when it is tested.
"""

import tensorflow as tf

from tf_asyncps.policies import registry
from tf_asyncps.policies.base import UpdatePolicy, check_count

__all__ = ["DropStale", "keep_if_fresh"]


def keep_if_fresh(tau, max_staleness) -> tf.Tensor:
    """The rule: scalar tf.bool ``tau <= max_staleness``."""
    return tf.cast(tau, tf.int64) <= tf.cast(max_staleness, tf.int64)


@registry.register("drop_stale")
class DropStale(UpdatePolicy):
    """Drops gradients with τ > ``max_staleness``.

    Args:
      max_staleness: int >= 0, in global steps.

    Raises:
      ValueError: max_staleness is not an integer in [0, 2**63) (NumPy ones pass).
    """

    atomic = True

    def __init__(self, max_staleness: int = 2):
        self.max_staleness = check_count("drop_stale", "max_staleness", max_staleness, 0,
                                         "global steps")

    def update(self, grads, state, info):
        return grads, keep_if_fresh(info.tau, self.max_staleness)

    def get_config(self):
        return {"max_staleness": self.max_staleness}
