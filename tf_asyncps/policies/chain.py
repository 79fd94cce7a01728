"""``chain(*policies)``: apply policies one after another (optax-style)."""

import tensorflow as tf

from tf_asyncps.policies.base import UpdatePolicy

__all__ = ["chain", "Chain"]


class Chain(UpdatePolicy):
    """Runs ``policies`` in order; a step is kept only if every policy keeps it.

    ``atomic`` is True if any member is atomic.
    """

    name = "chain"

    def __init__(self, *policies: UpdatePolicy):
        from tf_asyncps.policies.registry import get
        if not policies:
            raise ValueError("chain() needs at least one policy.")
        self.policies = [get(p) for p in policies]
        self.atomic = any(p.atomic for p in self.policies)
        self.needs_read_values = any(p.needs_read_values for p in self.policies)
        self.uses_tau = any(p.uses_tau for p in self.policies)
        for p in self.policies:
            if getattr(p, "aggregates", False):
                raise ValueError(
                    f"chain(): {p!r} aggregates gradients across workers and cannot be "
                    "chained; use it as the strategy's update_policy on its own.")

    def validate_cluster(self, num_workers):
        for p in self.policies:
            p.validate_cluster(num_workers)

    def build(self, num_workers, device):
        for p in self.policies:
            p.build(num_workers, device)

    def before_read(self, worker_index):
        return [op for p in self.policies for op in p.before_read(worker_index)]

    def step_without_update(self, worker_index):
        return [op for p in self.policies for op in p.step_without_update(worker_index)]

    def after_step(self, worker_index):
        return [op for p in self.policies for op in p.after_step(worker_index)]

    def init(self, variables):
        return [p.init(variables) for p in self.policies]

    def update(self, grads, state, info):
        keep = True
        for p, s in zip(self.policies, state):
            grads, k = p.update(grads, s, info)
            if k is not True:
                keep = k if keep is True else tf.logical_and(keep, k)
        return grads, keep

    def __repr__(self):
        return "chain(" + ", ".join(repr(p) for p in self.policies) + ")"


def chain(*policies) -> Chain:
    """Composes policies (names or objects) into one; see :class:`Chain`."""
    return Chain(*policies)
