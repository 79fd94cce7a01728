"""``local_sgd``: each worker trains a local copy and pushes its delta.

Rule: every worker trains its own copy of the model with no parameter-server
traffic per step; once it has taken ``sync_every`` or more steps since its
last exchange, it pushes its delta (copy − copy last received) to the PS and
pulls the merged model. This is Downpour SGD's n_push/n_fetch windows (Dean
et al., NIPS 2012) and local SGD / periodic averaging (Stich, "Local SGD
Converges Fast and Communicates Little", ICLR 2019), in its asynchronous
form: workers exchange whenever they reach their window, never waiting for
each other. With one worker it is exactly sequential training (Δ is the sum
of its own updates).

How the PS merges a delta, ``exchange`` (x_ps the PS copy, N the workers of
the cluster, y the PS copy the worker reads just before its add):

* ``"sum"`` (the default): x_ps ← x_ps + Δ_w, and the worker continues from
  y + Δ_w. Downpour's rule: every worker's steps land in full, so N workers
  that each took k steps from one model move it by N windows' worth (their
  deltas on the same data distribution point the same way and add up).
* ``"mean"``: x_ps ← x_ps + Δ_w / N, and the worker continues from
  y + Δ_w / N. Periodic model averaging, the rule of local SGD (Stich, "Local
  SGD Converges Fast and Communicates Little", ICLR 2019; Lin et al., "Don't
  Use Large Mini-Batches, Use Local SGD", ICLR 2020: x ← (1/N) Σ_w x_w every
  H steps) in its asynchronous form: when all N workers exchange once from
  the same anchor x, the PS copy is x + (1/N) Σ_w Δ_w = (1/N) Σ_w x_w,
  exactly their synchronous average; here each worker's share lands when it
  exchanges, without waiting for the others. With one worker it is the sum.
  Only trainable variables are averaged: the optimizer's step counter and
  the metrics' accumulators (non-trainable) are still summed, so they stay
  exact; the optimizer's slots are never exchanged
  (tf_asyncps/core/local_copies.py).

The machinery (per-worker copies, the exchange at each closure start, the
chief's flush when the coordinator drains) is ``tf_asyncps/core/local_copies.py``;
this module is the rule. Use ``steps_per_execution`` = ``sync_every`` (or a
divisor of it): the check runs once per closure, so an exchange happens at the
first closure start after ``sync_every`` steps.
"""

import tensorflow as tf

from tf_asyncps.policies import registry
from tf_asyncps.policies.base import UpdatePolicy, check_count

__all__ = ["LocalSGD", "EXCHANGES"]

#: The ``exchange`` rules: how the PS merges a worker's delta (module docstring).
EXCHANGES = ("sum", "mean")


@registry.register("local_sgd")
class LocalSGD(UpdatePolicy):
    """Local SGD: train local copies, push deltas every ``sync_every`` steps.

    Every numeric variable created in the strategy's scope gets a local copy:
    the model's weights, the optimizer's slots and step counter and the
    metrics' accumulators. Deltas of all of them but the optimizer's slots
    (each worker's own state) are pushed, so sums and counters stay exact
    (the PS counter ends at the total number of steps).

    Args:
      sync_every: local worker steps between two exchanges with the PS
        (int >= 1); 1 pushes every step.
      exchange: how the PS merges a worker's delta Δ (of its trainable
        variables) with N workers in the cluster: ``"sum"`` (default,
        Downpour: x_ps += Δ) or ``"mean"`` (asynchronous model averaging,
        local SGD's rule: x_ps += Δ / N); see the module docstring.

    Raises:
      ValueError: ``sync_every`` is not an integer in [1, 2**63) (NumPy ones
        pass), or ``exchange`` is not one of ``"sum"``, ``"mean"``.
    """

    name = "local_sgd"
    uses_tau = False
    local_copies = True
    updates_on_ps = False

    def __init__(self, sync_every: int = 16, exchange: str = "sum"):
        self.sync_every = check_count("local_sgd", "sync_every", sync_every, 1, "worker steps")
        if not isinstance(exchange, str) or exchange not in EXCHANGES:
            raise ValueError(
                f"local_sgd: exchange must be one of {list(EXCHANGES)} (how the PS merges a "
                f"worker's delta: 'sum' adds it, 'mean' adds it / num_workers), got "
                f"{exchange!r}.")
        self.exchange = exchange

    def get_config(self):
        return {"sync_every": self.sync_every, "exchange": self.exchange}

    def exchange_due(self, local_steps):
        return local_steps >= tf.constant(self.sync_every, tf.int64)

    def update(self, grads, state, info):
        del state, info  # never called: steps apply to the local copies
        return grads, True


#: Its former name, kept as an alias (the class is now named after its registry name).
LocalSteps = LocalSGD
