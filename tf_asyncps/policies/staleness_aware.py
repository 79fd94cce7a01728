"""``staleness_aware``: divide each gradient by its staleness.

Rule (mode ``"inverse"``): g / max(1, τ) — the staleness-dependent learning
rate of Zhang, Gupta, Lian and Liu, "Staleness-aware Async-SGD for Distributed
Deep Learning" (IJCAI 2016). Mode ``"inverse_plus_one"``: g / (τ + 1), the
DynSGD rule of Jiang et al., "Heterogeneity-aware Distributed Parameter
Servers" (SIGMOD 2017).

When to use: many workers or uneven speed, when stale gradients should count
less instead of being thrown away. Works with any optimizer (it scales the
gradient; with Adam-like optimizers the effect is partly normalised away).
"""

import tensorflow as tf

from tf_asyncps.policies import registry
from tf_asyncps.core.grads import scale
from tf_asyncps.policies.base import UpdatePolicy

__all__ = ["StalenessAware", "staleness_scale", "MODES"]

MODES = ("inverse", "inverse_plus_one")


def staleness_scale(tau, mode: str = "inverse") -> tf.Tensor:
    """The rule's factor (float32 scalar): 1/max(1, τ) or 1/(τ + 1)."""
    tau = tf.cast(tau, tf.float32)
    if mode == "inverse":
        return 1.0 / tf.maximum(1.0, tau)
    return 1.0 / (tau + 1.0)


@registry.register("staleness_aware")
class StalenessAware(UpdatePolicy):
    """Scales each step's gradients by a function of its τ.

    Args:
      mode: "inverse" (g / max(1, τ)) or "inverse_plus_one" (g / (τ + 1)).

    Raises:
      ValueError: unknown mode.
    """

    def __init__(self, mode: str = "inverse"):
        if mode not in MODES:
            raise ValueError(f"staleness_aware: mode must be one of {list(MODES)}, got {mode!r}.")
        self.mode = mode

    def update(self, grads, state, info):
        factor = staleness_scale(info.tau, self.mode)
        return [scale(g, factor) for g in grads], True

    def get_config(self):
        return {"mode": self.mode}


#: Its former name, kept as an alias (the class is now named after its registry name).
StalenessAwareLR = StalenessAware
