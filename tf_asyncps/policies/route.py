"""``route(sparse=..., dense=...)``: one policy for embedding tables, another for the rest.

A recommender's embedding tables get sparse, rarely colliding updates that
tolerate staleness; its dense layers get a gradient from every example and
train best synchronously. PERSIA (Lian et al., "PERSIA: An Open, Hybrid
System Scaling Deep Learning-based Recommenders up to 100 Trillion
Parameters", 2021) updates the tables asynchronously and the dense network
synchronously; ``route`` does that (and any other pairing) on TensorFlow's
parameter servers::

    tf_asyncps.policies.route(
        sparse="async",
        dense=tf_asyncps.policies.get("sync_replicas", replicas_to_aggregate=2))

How one worker step reads when two policies decide on it:

* Each part's policy sees only its own variables and gradients, and its own
  τ: the updates *of its part* since the worker read the model (one counter
  per part on the PS, beside the global step, read with it before each
  step). So ``sync_replicas`` on the dense part counts its own rounds, not
  the table updates in between, and ``drop_stale`` on the tables drops only
  the table part of a stale step.
* The parts a step keeps are applied together, in one optimizer call:
  ``optimizer.iterations`` and the global step advance by one per worker
  step that updated any part (Adam's bias correction counts those steps).
* Accounting: a step is ``applied`` if any part applied it or, for an
  aggregator, accepted it into a round; ``dropped`` only if every part
  refused it. So ``applied + dropped`` = worker steps still holds. The τ
  histograms hold the step's global τ (global step now - at read), as for
  any policy; :meth:`Route.part_updates` gives each part's update count.

Which variables are "sparse": those whose name matches ``sparse_names`` (a
regular expression; default ``embeddings``, the table of a Keras
``Embedding`` layer and each of its shards). Every other trainable variable
is "dense". A part with no variables in a step takes no decision.
"""

import dataclasses
import re

import tensorflow as tf

from tf_asyncps.core import grads as grads_lib
from tf_asyncps.policies.base import Decision, after_apply_of, as_decision
from tf_asyncps.policies.composite import Composite

__all__ = ["route", "Route", "PartCounts"]

PARTS = ("sparse", "dense")


@dataclasses.dataclass
class PartCounts:
    """route's per-cluster state (what ``build`` returns), on the PS.

    Attributes:
      parts: the cluster states of the sparse and dense policies.
      counts: int64 variable, shape (2,): updates of each part.
      read_at: int64 variable, shape (num_workers, 2): each worker's copy of
        ``counts`` at its read.
    """

    parts: list
    counts: tf.Variable
    read_at: tf.Variable


class Route(Composite):
    """Decides each worker step's sparse and dense parts with two policies.

    Args:
      sparse: policy (registered name or UpdatePolicy) for the variables
        whose name matches ``sparse_names``.
      dense: policy for every other trainable variable.
      sparse_names: regular expression searched in each variable's name (str).

    Raises:
      ValueError: a local-copy policy (``local_sgd``: its steps never reach a
        per-step rule), another route, the same policy object for both
        parts, or a bad ``sparse_names``.
    """

    name = "route"

    def __init__(self, sparse="async", dense="async", sparse_names: str = "embeddings"):
        from tf_asyncps.policies.registry import get
        self.parts = []
        for part, p in zip(PARTS, (sparse, dense)):
            try:
                self.parts.append(get(p))
            except ValueError as e:
                raise ValueError(f"route(): {part}={p!r}: {e}") from None
        if self.parts[0] is self.parts[1]:
            raise ValueError("route(): sparse and dense got the same policy object; give "
                             "each part its own (policy state is per object).")
        for part, p in zip(PARTS, self.parts):
            if p.local_copies:
                raise ValueError(
                    f"route(): {part}={p!r} trains per-worker copies, so its steps never "
                    "reach a per-step rule; use it as the strategy's update_policy alone.")
            if isinstance(p, Route):
                raise ValueError(f"route(): {part}= is itself a route; give a policy.")
        if not isinstance(sparse_names, str) or not sparse_names:
            raise ValueError(f"route(): sparse_names must be a non-empty regular "
                             f"expression, got {sparse_names!r}.")
        try:
            self._pattern = re.compile(sparse_names)
        except re.error as e:
            raise ValueError(f"route(): sparse_names={sparse_names!r} is not a regular "
                             f"expression: {e}.") from None
        self.sparse_names = sparse_names
        self._take_member_flags()
        self.uses_tau = True  # each part's τ comes from its own counter

    def get_config(self):
        return {"sparse": repr(self.parts[0]), "dense": repr(self.parts[1]),
                "sparse_names": self.sparse_names}

    def __repr__(self):
        return (f"route(sparse={self.parts[0]!r}, dense={self.parts[1]!r}, "
                f"sparse_names={self.sparse_names!r})")

    def members(self):
        return self.parts

    # -- set-up ---------------------------------------------------------------
    def build(self, num_workers, device):
        parts = super().build(num_workers, device)
        with tf.init_scope(), tf.device(device):
            # Updates of each part; each worker's copy of them at its read.
            counts = tf.Variable(tf.zeros([2], tf.int64), trainable=False,
                                 name="route_part_updates")
            read_at = tf.Variable(tf.zeros([num_workers, 2], tf.int64),
                                  trainable=False, name="route_part_read_points")
        return PartCounts(parts, counts, read_at)

    def split(self, variables):
        """``(sparse indices, dense indices)`` of ``variables`` (lists of int)."""
        sparse = [i for i, v in enumerate(variables) if self._pattern.search(v.name)]
        chosen = set(sparse)
        return sparse, [i for i in range(len(variables)) if i not in chosen]

    def init(self, variables):
        return [p.init([variables[i] for i in idx]) if idx else ()
                for p, idx in zip(self.parts, self.split(variables))]

    # -- graph side -----------------------------------------------------------
    def before_read(self, worker_index):
        waits = super().before_read(worker_index)
        with tf.control_dependencies(waits):
            w = tf.reshape(tf.cast(worker_index, tf.int64), [1])
            mark = self.cluster.read_at.scatter_update(
                tf.IndexedSlices(self.cluster.counts.read_value()[None], w))
        return waits + [mark]

    def update(self, grads, state, info):
        n = len(grads)
        keep, out, accepted, bumps, decisions = [True] * n, list(grads), [], [], []
        cluster = self.cluster
        counts = cluster.counts.read_value()
        read = cluster.read_at.sparse_read(tf.cast(info.worker_index, tf.int64))
        for k, (p, s, idx) in enumerate(zip(self.parts, state, self.split(info.variables))):
            if not idx:
                continue
            part_info = dataclasses.replace(
                info, tau=counts[k] - read[k], read_step=read[k], global_step=counts[k],
                variables=[info.variables[i] for i in idx],
                read_values=None if info.read_values is None
                else [info.read_values[i] for i in idx])
            d = as_decision(p.update([grads[i] for i in idx], s, part_info))
            decisions.append(d)
            part_keep = d.keep
            if info.finite is not None:  # a non-finite step updates no part
                part_keep = info.finite if part_keep is True else tf.logical_and(
                    part_keep, info.finite)
            for j, i in enumerate(idx):
                keep[i], out[i] = d.keep, d.grads[j]
            if d.accepted is not None:
                accepted.append(d.accepted)
            bumps.append(tf.cast(part_keep, tf.int64) * tf.one_hot(k, 2, dtype=tf.int64))
        if bumps:
            bump = cluster.counts.assign_add(tf.add_n(bumps))
            with tf.control_dependencies([bump]):
                out = [grads_lib.map_values(tf.identity, g) for g in out]
        any_accepted = None
        if accepted:
            any_accepted = accepted[0] if len(accepted) == 1 else tf.reduce_any(tf.stack(accepted))
        return Decision(out, keep, any_accepted, after_apply_of(decisions))

    # -- chief side -----------------------------------------------------------
    def part_updates(self):
        """``{"sparse": n, "dense": n}``: updates applied to each part (read from the PS)."""
        return dict(zip(PARTS, (int(c) for c in self.cluster.counts.numpy())))


def route(sparse="async", dense="async", sparse_names: str = "embeddings") -> Route:
    """One policy for the embedding tables, another for the dense layers; see :class:`Route`.

    Example::

        tf_asyncps.policies.route(sparse="async", dense="sync_replicas")
    """
    return Route(sparse, dense, sparse_names)
