"""``async``: apply every gradient as it arrives (Hogwild!/Downpour SGD).

Rule: apply g unchanged, whatever its staleness τ. This is TensorFlow's
default parameter-server behaviour (Dean et al., "Large Scale Distributed Deep
Networks", NIPS 2012; Recht et al., "Hogwild!", NIPS 2011), with τ measured and
recorded. Use it as the baseline and when workers are of similar speed.
"""

from tf_asyncps.policies import registry
from tf_asyncps.policies.base import UpdatePolicy

__all__ = ["Async"]


@registry.register("async")
class Async(UpdatePolicy):
    """Applies each worker's gradient as is; no arguments."""

    name = "async"
    uses_tau = False

    def update(self, grads, state, info):
        del state, info
        return grads, True
