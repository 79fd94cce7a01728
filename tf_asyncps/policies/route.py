"""``route``: a policy per label of variables (tables, dense layers, ...).

A recommender's embedding tables get sparse, rarely colliding updates that
tolerate staleness; its dense layers get a gradient from every example and
train best synchronously, or on local steps. PERSIA (Lian et al., "PERSIA:
An Open, Hybrid System Scaling Deep Learning-based Recommenders up to 100
Trillion Parameters", 2021) updates the tables asynchronously and the dense
network synchronously; ``route`` does that, and any other pairing, on
TensorFlow's parameter servers. As optax's ``multi_transform``, it gives each
variable a label and each label a policy::

    tf_asyncps.policies.route(
        sparse="async",
        dense=tf_asyncps.policies.get("sync_replicas", replicas_to_aggregate=2))
    # the same, written as a mapping of labels:
    tf_asyncps.policies.route(
        {"sparse": "async", "dense": "sync_replicas"}, labels={"sparse": "embeddings"})
    # tables every step, dense layers on local steps exchanged every 16:
    tf_asyncps.policies.route(sparse="async", dense=tf_asyncps.policies.LocalSteps(16))
    # the same, the ps averaging the workers' dense deltas (Δ / num_workers):
    tf_asyncps.policies.route(
        sparse="async", dense=tf_asyncps.policies.LocalSteps(16, exchange="mean"))

Labels. ``labels`` maps each label but one to a regular expression searched
in a variable's name, tried in the order of ``parts``; the one label without
a pattern takes every other variable. Or ``labels`` is a callable
``name -> label``. ``route(sparse=..., dense=..., sparse_names=...)`` is the
two-label case ``labels={"sparse": sparse_names}`` (default ``embeddings``:
the table of a Keras ``Embedding`` layer and each of its shards).

How one worker step reads when several policies decide on it (parts updated
per step):

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
  any policy; :meth:`Route.part_updates` gives each part's update count and
  :meth:`Route.part_staleness` each part's τ histograms (below).
  A part with no variables in a step takes no decision.

Per-part τ (``Route.part_staleness``; ``StalenessStats.part_histograms``
and ``part_dropped_histograms``): per part k, a histogram of its updates and
one of its refused gradients by the part's own τ, in the bins of the step's
(``max_tracked_staleness + 1``, the last one τ >= max_tracked). Only a step
that holds variables of part k is counted in k:

* a per-step part: τ_k = the updates of part k between the worker's read
  and this step's (``counts[k]`` then − at the read), as the step's τ is
  taken (core/update.py): the τ the part's rule read, for a rule that reads
  one (``drop_stale``, ``staleness_aware``, ``ssp``, ``dc_asgd``,
  ``sync_replicas``: under the update lock for the locked ones, so exact);
  else (``async``) from the increment of the part's counter, (counts[k]
  after) − 1 − at the read. Applied: the part's update (an aggregator: the
  round's, by the completing worker); refused: the part's rule dropped it,
  or the step was not finite; accepted into an aggregator's round: in
  neither. So with ``route(sparse="async", dense="async")`` and no two
  steps at once, each part's histogram equals the step's ``histogram``;
* the part on local steps: one entry per exchange (drains' pushes included),
  τ = the part's exchanges by other workers since this worker's previous
  exchange or its pull, taken from the part's counter as ``local_sgd``
  takes it from the global step: (counts[k] after this exchange) − 1 − the
  value the worker kept at its previous exchange or pull. Never refused.

So each histogram sums to ``part_updates()[label]`` (counted since the last
``reset_staleness_stats``, which zeroes the histograms and keeps the counts).
The cost: one dense ``assign_add`` of a (parts, 2 * (T + 1)) int64 variable
beside the counts per step (and per exchange), after the counts' increment.

A part on local steps (``LocalSteps``, the policy ``local_sgd``): its
trainable variables and the optimizer's slots of them (named after them,
so labelled alike) train on per-worker copies, exchanged through the PS
when the part's rule says so (``sync_every`` local steps, at the start of a
closure) and when the coordinator drains (``join``), exactly as
``local_sgd`` exchanges a whole model (tf_asyncps/core/local_copies.py),
under the part's ``exchange`` rule: ``"sum"`` (default: the ps adds each
worker's delta, x_ps += Δ_w) or ``"mean"`` (x_ps += Δ_w / num_workers, the
asynchronous model averaging of local SGD; tf_asyncps/policies/local_sgd.py).
Every other variable (the other parts', the optimizer's step counter,
metrics, non-trainable state) stays on the PS. Each worker step then:

* reads the global step r and the per-step parts' variables on the PS, its
  own copies of the local part's;
* applies, in one optimizer call, the per-step parts' gradients on the PS
  under their policies and the local part's to its copies (only the
  non-finite check can skip those: a step whose gradients hold NaN/Inf
  updates nothing);
* counts: the global step and ``applied``/``dropped`` as above, over the
  per-step parts only; ``StalenessStats.local_steps`` the steps the local
  part trained, pushed with each exchange; ``part_updates()[label]`` of the
  local part, its exchanges. With ``steps_per_execution=1`` a worker that
  ran c steps before a drain made ``ceil(c / sync_every)`` exchanges: one at
  the start of each closure after ``sync_every`` steps since its last, and
  the drain's push of the rest.

Refused: two parts on local steps; a part on local steps beside an atomic
part (``sync_replicas``, locked rules: the locked update would hold the
workers' local updates) or with a ``LockingOptimizer``; the sparse part of
``route(sparse=..., dense=...)`` on local steps (every worker would hold
each table whole).
"""

import dataclasses
import re
from typing import Callable, Dict, Mapping, Optional, Tuple, Union

import numpy as np
import tensorflow as tf

from tf_asyncps.core import grads as grads_lib
from tf_asyncps.policies.base import Decision, after_apply_of, as_decision
from tf_asyncps.policies.composite import Composite

__all__ = ["route", "Route", "PartCounts"]

#: The labels of ``route(sparse=..., dense=...)``.
PARTS = ("sparse", "dense")


@dataclasses.dataclass
class PartCounts:
    """route's per-cluster state (what ``build`` returns), on the PS.

    Attributes:
      parts: the cluster states of the parts' policies, in label order.
      counts: int64 variable, shape (labels,): updates of each part (a part
        on local steps: its exchanges).
      read_at: int64 variable, shape (num_workers, labels): each worker's
        copy of ``counts`` at its read.
      histograms: int64 variable, shape (labels, 2 * (T + 1)), T the
        strategy's ``max_tracked_staleness``: per part, its applied updates
        by the part's τ (columns 0..T, the last τ >= T), then its refused
        gradients by τ. Made when the route is attached to a strategy
        (``attach``: T is the tracker's); None before.
    """

    parts: list
    counts: tf.Variable
    read_at: tf.Variable
    histograms: Optional[tf.Variable] = None


def _labeller(labels, names, where):
    """``labels`` (a mapping label -> pattern for all labels but one, or a
    callable) as ``name -> label``; ValueError naming the fix."""
    if callable(labels):
        def label_of(name):
            label = labels(name)
            if label not in names:
                raise ValueError(f"{where}: labels({name!r}) returned {label!r}, not one "
                                 f"of the parts' labels {list(names)}.")
            return label
        return label_of
    if not isinstance(labels, Mapping):
        raise ValueError(f"{where}: labels must be a mapping label -> regular expression "
                         f"or a callable name -> label, got {labels!r}.")
    unknown = [k for k in labels if k not in names]
    if unknown:
        raise ValueError(f"{where}: labels names {unknown}, which have no policy; the "
                         f"parts' labels are {list(names)}.")
    rest = [k for k in names if k not in labels]
    if len(rest) != 1:
        raise ValueError(
            f"{where}: labels must give a pattern to every label but one (that one takes "
            f"the other variables); labels without a pattern: {rest}.")
    patterns = []
    for label in names:
        if label not in labels:
            continue
        pattern = labels[label]
        if not isinstance(pattern, str) or not pattern:
            raise ValueError(f"{where}: the pattern of {label!r} must be a non-empty "
                             f"regular expression, got {pattern!r}.")
        try:
            patterns.append((label, re.compile(pattern)))
        except re.error as e:
            raise ValueError(f"{where}: {pattern!r} (label {label!r}) is not a regular "
                             f"expression: {e}.") from None
    default = rest[0]

    def label_of(name):
        return next((label for label, p in patterns if p.search(name)), default)
    return label_of


class Route(Composite):
    """Decides each worker step's parts with a policy per label.

    Args:
      sparse: policy (registered name or UpdatePolicy) for the variables
        whose name matches ``sparse_names`` (two-label form).
      dense: policy for every other variable (two-label form).
      sparse_names: regular expression searched in each variable's name (str).
      parts: instead of ``sparse``/``dense``: a mapping label (str) -> policy,
        with ``labels``.
      labels: with ``parts``: a mapping label -> regular expression for
        every label but one, or a callable ``name -> label`` (see the module
        docstring).

    Raises:
      ValueError: another route as a part, the same policy object for two
        parts, two parts on local steps, a part on local steps beside an
        atomic one, the sparse part on local steps, ``parts`` mixed with
        ``sparse``/``dense``/``sparse_names``, or bad labels.
    """

    name = "route"

    def __init__(self, sparse=None, dense=None, sparse_names: Optional[str] = None, *,
                 parts: Optional[Mapping[str, object]] = None,
                 labels: Union[Mapping[str, str], Callable[[str], str], None] = None):
        from tf_asyncps.policies.registry import get
        where = "route()"
        if parts is None:
            if labels is not None:
                raise ValueError(f"{where}: labels= goes with parts= (a mapping label -> "
                                 "policy); with sparse=/dense= use sparse_names=.")
            sparse_names = "embeddings" if sparse_names is None else sparse_names
            if not isinstance(sparse_names, str) or not sparse_names:
                raise ValueError(f"route(): sparse_names must be a non-empty regular "
                                 f"expression, got {sparse_names!r}.")
            parts = {"sparse": "async" if sparse is None else sparse,
                     "dense": "async" if dense is None else dense}
            labels = {"sparse": sparse_names}
        elif sparse is not None or dense is not None or sparse_names is not None:
            raise ValueError(f"{where}: give parts= (with labels=) or sparse=/dense=/"
                             "sparse_names=, not both.")
        if not isinstance(parts, Mapping) or not parts or not all(
                isinstance(k, str) and k for k in parts):
            raise ValueError(f"{where}: parts must be a non-empty mapping label (str) -> "
                             f"policy, got {parts!r}.")
        if labels is None:
            raise ValueError(f"{where}: parts= needs labels= (label -> regular expression "
                             "for every label but one, or a callable name -> label).")
        self.labels = tuple(parts)
        self.parts = []
        for label, p in parts.items():
            try:
                self.parts.append(get(p))
            except ValueError as e:
                raise ValueError(f"route(): {label}={p!r}: {e}") from None
        if len({id(p) for p in self.parts}) < len(self.parts):
            raise ValueError("route(): sparse and dense got the same policy object; give "
                             "each part its own (policy state is per object)."
                             if self.labels == PARTS else
                             "route(): two parts got the same policy object; give each "
                             "part its own (policy state is per object).")
        for label, p in zip(self.labels, self.parts):
            if isinstance(p, Route):
                raise ValueError(f"route(): {label}= is itself a route; give a policy.")
            if p.local_copies and (p.updates_on_ps or p.aggregates):
                raise ValueError(f"route(): {label}={p!r} mixes local steps with other "
                                 "rules; give local steps alone as a part.")
        local = [label for label, p in zip(self.labels, self.parts) if p.local_copies]
        if local and self.labels == PARTS and local[0] == "sparse":
            raise ValueError(
                f"route(): sparse={self.parts[0]!r} trains per-worker copies: every "
                "worker would hold each table whole. Put the tables on a per-step policy "
                "and the dense part on local steps (dense=LocalSteps(sync_every=k)).")
        if len(local) > 1:
            raise ValueError(f"route(): parts {local} are on local steps; at most one part "
                             "may be (one exchange rule per worker).")
        atomic = [label for label, p in zip(self.labels, self.parts) if p.atomic]
        if local and atomic:
            raise ValueError(
                f"route(): {local[0]} is on local steps and {atomic} is atomic (its update "
                "runs under a lock on the PS, which would hold the workers' local updates); "
                "pair local steps with a rule that is not atomic (async, staleness_aware, "
                "ssp, dc_asgd).")
        self._local = self.labels.index(local[0]) if local else None
        self._label_of = _labeller(labels, self.labels, where)
        self._labels_arg = labels
        self.sparse_names = labels.get("sparse") if self.labels == PARTS else None
        self._take_member_flags()
        self.uses_tau = True  # each part's τ comes from its own counter
        self.local_copies = bool(local)
        self.updates_on_ps = any(p.updates_on_ps for p in self.parts)

    def get_config(self):
        if self.labels == PARTS and self.sparse_names is not None:
            return {"sparse": repr(self.parts[0]), "dense": repr(self.parts[1]),
                    "sparse_names": self.sparse_names}
        return {"parts": {k: repr(p) for k, p in zip(self.labels, self.parts)},
                "labels": self._labels_arg if isinstance(self._labels_arg, Mapping)
                else repr(self._labels_arg)}

    def __repr__(self):
        if self.labels == PARTS and self.sparse_names is not None:
            return (f"route(sparse={self.parts[0]!r}, dense={self.parts[1]!r}, "
                    f"sparse_names={self.sparse_names!r})")
        parts = ", ".join(f"{k!r}: {p!r}" for k, p in zip(self.labels, self.parts))
        return f"route({{{parts}}}, labels={self._labels_arg!r})"

    def members(self):
        return self.parts

    # -- labels -----------------------------------------------------------------
    def label_of(self, name: str) -> str:
        """The label of a variable named ``name`` (str)."""
        return self._label_of(name)

    def variable_mode(self, name, trainable, slot):
        # The local part's trainable variables and their optimizer slots
        # train on local copies; all else (the optimizer's counter, metrics,
        # non-trainable state) stays on the PS.
        if self._local is not None and (trainable or slot) and \
                self.label_of(name) == self.labels[self._local]:
            return "local_copies"
        return "per_step"

    def exchange_due(self, local_steps):
        if self._local is None:
            return super().exchange_due(local_steps)
        return self.parts[self._local].exchange_due(local_steps)

    def exchange_mark(self):
        if self._local is None:
            return super().exchange_mark()
        counts = self.cluster.counts
        with tf.device(counts.device):
            return counts.read_value()[self._local]

    def exchange_done(self, last_mark):
        """Counts an exchange of the local part k: ``counts[k] += 1``, and
        its τ = (counts[k] after) − 1 − ``last_mark`` (the part's exchanges
        by other workers since this worker's previous exchange or pull, the
        value it kept then) in the part's histogram. Returns counts[k]
        after: the worker's next mark."""
        if self._local is None:
            return super().exchange_done(last_mark)
        c, k = self.cluster, self._local
        with tf.device(c.counts.device):
            after = tf.convert_to_tensor(c.counts.assign_add(
                tf.one_hot(k, len(self.labels), dtype=tf.int64)))[k]
            ops = []
            if c.histograms is not None:
                tau = after - 1 - tf.cast(last_mark, tf.int64)
                ops.append(self._add_to_histograms([(k, tau, True, None)]))
            with tf.control_dependencies(ops):
                return tf.identity(after)

    def _add_to_histograms(self, entries):
        """One dense ``assign_add`` of ``histograms``: ``entries`` are
        ``(part k, τ, applied, dropped)`` with τ an int64 scalar (clipped to
        [0, T]) and applied/dropped True, None (0) or a scalar tf.bool.
        Dense, like the tracker's counters (core/staleness.py
        ``_add_counts``): a resource scatter of int64 runs under a shared
        lock, so two workers' increments of one bin could lose one."""
        hist = self.cluster.histograms
        width = int(hist.shape[1])
        bins = width // 2
        indices, values = [], []
        for k, tau, applied, dropped in entries:
            b = tf.minimum(tf.maximum(tf.cast(tau, tf.int64), 0), bins - 1)
            for flag, offset in ((applied, 0), (dropped, bins)):
                if flag is None or flag is False:
                    continue
                indices.append(k * width + offset + b)
                values.append(tf.constant(1, tf.int64) if flag is True
                              else tf.cast(flag, tf.int64))
        if not indices:
            return tf.no_op()
        dense = tf.scatter_nd(tf.reshape(tf.stack(indices), [-1, 1]), tf.stack(values),
                              tf.constant([hist.shape[0] * width], tf.int64))
        return hist.assign_add(tf.reshape(dense, hist.shape), read_value=False)

    # -- per-part staleness (attach) -------------------------------------------
    def attach(self, runtime):
        """Makes the per-part τ histograms beside ``counts``, with the
        strategy's tracker's ``max_tracked + 1`` bins each (once per strategy)."""
        super().attach(runtime)
        c = self.cluster
        if c.histograms is None:
            bins = runtime.tracker.max_tracked + 1
            with tf.init_scope(), tf.device(c.counts.device):
                c.histograms = tf.Variable(
                    tf.zeros([len(self.labels), 2 * bins], tf.int64), trainable=False,
                    name="route_part_staleness")

    # -- set-up ---------------------------------------------------------------
    def build(self, num_workers, device):
        parts = super().build(num_workers, device)
        n = len(self.labels)
        with tf.init_scope(), tf.device(device):
            # Updates of each part; each worker's copy of them at its read.
            counts = tf.Variable(tf.zeros([n], tf.int64), trainable=False,
                                 name="route_part_updates")
            read_at = tf.Variable(tf.zeros([num_workers, n], tf.int64),
                                  trainable=False, name="route_part_read_points")
        return PartCounts(parts, counts, read_at)

    def split(self, variables):
        """Indices of ``variables`` per label, in label order (a tuple of
        lists of int; two-label form: ``(sparse, dense)``)."""
        out = tuple([] for _ in self.labels)
        for i, v in enumerate(variables):
            out[self.labels.index(self.label_of(v.name))].append(i)
        return out

    def init(self, variables):
        return [p.init([variables[i] for i in idx]) if idx and not p.local_copies else ()
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
        cluster, width = self.cluster, len(self.labels)
        counted = []  # (part k, its τ or None: from the increment, applied, dropped)
        # Read when the step's τ is (once its gradients exist), not earlier.
        deps = [info.global_step] if isinstance(info.global_step, tf.Tensor) else []
        with tf.control_dependencies(deps):
            counts = cluster.counts.read_value()
        read = cluster.read_at.sparse_read(tf.cast(info.worker_index, tf.int64))
        for k, (p, s, idx) in enumerate(zip(self.parts, state, self.split(info.variables))):
            if not idx:
                continue
            if p.local_copies:  # the engine applies them to the local copies
                raise ValueError(
                    f"route(): variables {[info.variables[i].name for i in idx]} reached "
                    f"the per-step update of {self.labels[k]!r}, a part on local steps; "
                    "create them in the strategy's scope.")
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
            bumps.append(tf.cast(part_keep, tf.int64) * tf.one_hot(k, width, dtype=tf.int64))
            # Refused: neither kept nor taken into an aggregator's round.
            if part_keep is True:
                refused = None
            elif d.accepted is None:
                refused = tf.logical_not(part_keep)
            else:
                refused = tf.logical_not(tf.logical_or(part_keep, d.accepted))
            counted.append((k, part_info.tau if p.uses_tau else None, part_keep, refused))
        if bumps:
            bump = cluster.counts.assign_add(tf.add_n(bumps))
            ops = [bump]
            if cluster.histograms is not None:
                # τ as the step's (core/update.py): the rule's own τ where
                # it reads one, else from the increment of the part's counter.
                after = tf.convert_to_tensor(bump)
                ops.append(self._add_to_histograms([
                    (k, tau if tau is not None else
                     after[k] - tf.cast(keep_k, tf.int64) - read[k], keep_k, refused)
                    for k, tau, keep_k, refused in counted]))
            with tf.control_dependencies(ops):
                out = [grads_lib.map_values(tf.identity, g) for g in out]
        any_accepted = None
        if accepted:
            any_accepted = accepted[0] if len(accepted) == 1 else tf.reduce_any(tf.stack(accepted))
        return Decision(out, keep, any_accepted, after_apply_of(decisions))

    # -- chief side -----------------------------------------------------------
    def part_updates(self) -> Dict[str, int]:
        """``{label: n}`` read from the PS: updates applied to each part (a
        part on local steps: its exchanges with the PS, drains' pushes
        included); two-label form ``{"sparse": n, "dense": n}``."""
        return dict(zip(self.labels, (int(c) for c in self.cluster.counts.numpy())))

    def part_staleness(self) -> Tuple[Dict[str, np.ndarray], Dict[str, np.ndarray]]:
        """``(histograms, dropped_histograms)`` read from the PS, each
        ``{label: int64 array of shape (max_tracked + 1,)}`` (the last bin
        counts τ >= max_tracked): per part, its updates and its refused
        gradients by the part's τ (module docstring, "Per-part τ"). Each
        histogram sums to ``part_updates()[label]`` counted since the
        strategy's last ``reset_staleness_stats``. ``({}, {})`` for a
        route not attached to a strategy."""
        hist = self.cluster.histograms
        if hist is None:
            return {}, {}
        values = hist.numpy().astype(np.int64)
        bins = values.shape[1] // 2
        return ({k: values[i, :bins] for i, k in enumerate(self.labels)},
                {k: values[i, bins:] for i, k in enumerate(self.labels)})

    def reset_part_staleness(self) -> None:
        """Zeroes the per-part τ histograms (``part_updates`` is kept)."""
        hist = self.cluster.histograms
        if hist is not None:
            hist.assign(tf.zeros_like(hist))


def route(parts: Optional[Mapping[str, object]] = None, labels=None, *, sparse=None,
          dense=None, sparse_names: Optional[str] = None) -> Route:
    """A policy per label of variables; see :class:`Route` and the module docstring.

    Examples::

        tf_asyncps.policies.route(sparse="async", dense="sync_replicas")
        tf_asyncps.policies.route(sparse="async", dense=LocalSteps(sync_every=16))
        tf_asyncps.policies.route(sparse="async",
                                  dense=LocalSteps(sync_every=16, exchange="mean"))
        tf_asyncps.policies.route({"user": "async", "item": "drop_stale", "dense": "ssp"},
                                  labels={"user": "user_ids", "item": "item_ids"})
    """
    return Route(sparse, dense, sparse_names, parts=parts, labels=labels)
