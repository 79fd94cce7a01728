"""``chain(*policies)``: apply policies one after another (optax-style).

A chain is itself an :class:`UpdatePolicy` and forwards every hook of the
protocol (tf_asyncps/core/protocol.py) to its members, so what a member does
outside ``update`` (an ``ssp`` wait before the read, its clock tick after the
step, its watchdog) happens inside a chain exactly as alone. Two kinds of
policy change what a step *is*, and a chain refuses to mix them with others:

* aggregators (``sync_replicas``): their update is the mean of several
  workers' gradients, which no per-step rule after them could see;
* local-copy policies (``local_sgd``): their steps never reach a per-step
  rule at all (workers train their own copies).

Such a policy may stand alone in a chain (``chain("local_sgd")`` behaves as
``local_sgd``).
"""

import tensorflow as tf

from tf_asyncps.policies.base import Decision, after_apply_of, as_decision
from tf_asyncps.policies.composite import Composite

__all__ = ["chain", "Chain"]


class Chain(Composite):
    """Runs ``policies`` in order; a step is kept only if every policy keeps it.

    Args:
      *policies: registered names or UpdatePolicy objects (at least one).

    Attributes:
      policies: the member policy objects, in order.

    Raises:
      ValueError: no policy, or an aggregator or a local-copy policy chained
        with others.
    """

    name = "chain"

    def __init__(self, *policies):
        from tf_asyncps.policies.registry import get
        if not policies:
            raise ValueError("chain() needs at least one policy.")
        self.policies = [get(p) for p in policies]
        if len(self.policies) > 1:
            for p in self.policies:
                if p.aggregates:
                    raise ValueError(
                        f"chain(): {p!r} aggregates gradients across workers and cannot be "
                        "chained with other policies; use it as the strategy's "
                        "update_policy on its own.")
                if p.local_copies:
                    raise ValueError(
                        f"chain(): {p!r} trains per-worker copies, so its steps never reach "
                        "a per-step rule; it cannot be chained with other policies. Use it "
                        "on its own.")
        self._take_member_flags()
        self.uses_tau = any(p.uses_tau for p in self.policies)
        self.local_copies = any(p.local_copies for p in self.policies)
        self.updates_on_ps = all(p.updates_on_ps for p in self.policies)

    def members(self):
        return self.policies

    def __getattr__(self, name):
        # A chain of one is that policy: its own host-side methods
        # (ssp's clock_values, sync_replicas' rounds) stay reachable.
        members = self.__dict__.get("policies")
        if members and len(members) == 1 and not name.startswith("__"):
            return getattr(members[0], name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def init(self, variables):
        return [p.init(variables) for p in self.policies]

    def update(self, grads, state, info):
        keep, accepted, decisions = True, None, []
        for p, s in zip(self.policies, state):
            d = as_decision(p.update(grads, s, info))
            decisions.append(d)
            grads, accepted = d.grads, d.accepted
            if d.keep is not True:
                keep = d.keep if keep is True else tf.logical_and(keep, d.keep)
        return Decision(grads, keep, accepted, after_apply_of(decisions))

    def _local_member(self):
        (local,) = [p for p in self.policies if p.local_copies]
        return local

    def exchange_due(self, local_steps):
        return self._local_member().exchange_due(local_steps)

    def variable_mode(self, name, trainable, slot):
        if not self.local_copies:
            return super().variable_mode(name, trainable, slot)
        return self._local_member().variable_mode(name, trainable, slot)

    def exchange_mark(self):
        return self._local_member().exchange_mark() if self.local_copies else None

    def exchange_done(self, last_mark):
        return self._local_member().exchange_done(last_mark) if self.local_copies else None

    def get_config(self):
        return {"policies": [repr(p) for p in self.policies]}

    def __repr__(self):
        return "chain(" + ", ".join(repr(p) for p in self.policies) + ")"


def chain(*policies) -> Chain:
    """Composes policies (names or objects) into one; see :class:`Chain`.

    Example::

        tf_asyncps.policies.chain("ssp", "staleness_aware")
    """
    return Chain(*policies)
