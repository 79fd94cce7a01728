"""``sync_replicas``: N-of-M synchronous updates with backup workers (SyncReplicasAggregator).

TF1's ``SyncReplicasOptimizer`` (graph-only, deprecated) brought to TF2's
ParameterServerStrategy, with staleness made visible (Chen et al., "Revisiting
Distributed Synchronous SGD", 2016, for backup workers).

Rule, for each worker gradient g computed at read step r (τ = g_step − r):

* accept g iff τ <= max_staleness; else drop it and count it (with its τ) in
  ``dropped_histogram``;
* accepted gradients are summed per variable on the variable's own PS task
  (dense: one buffer of the variable's shape; tf.IndexedSlices: rows added to
  the buffer and their indices remembered, so the update stays sparse), in
  float32 at least (16-bit gradients are cast up; mixed-precision tf_keras
  models have float32 variables and gradients anyway);
* the gradient that makes the count reach ``replicas_to_aggregate`` = N
  triggers one optimizer update with the mean of exactly those N gradients,
  resets the buffers and advances the global step by one.

Counting (docs/design.md#3-staleness-exactly): ``applied`` counts accepted gradients, including
the (at most N − 1) accepted into a round that is not complete yet, so at a
quiet point ``global_step == applied // replicas_to_aggregate`` and
``applied + dropped`` equals the worker steps run.

Backup workers: with total_num_replicas = M > N, the first N accepted
gradients make the update; gradients still being computed on the old
parameters arrive with τ >= 1 and are dropped, so no update waits for the
slowest M − N workers.

Fresh parameters (max_staleness = 0): each worker has a token queue on the PS.
A worker takes a token before reading the model; every update grants one
token to each worker holding none, and a refused (late or non-finite) gradient
gives its worker a token back at once. A worker whose gradient is in waits
for the next update before reading again, so each step starts from the latest
update and each worker contributes at most one gradient per round; updates
that land while it computes still make its gradient late (τ >= 1), and a late
gradient is dropped and counted, never waited for (N smaller than the workers:
common). A watchdog on the chief releases waiting workers when the
program drains the schedule (``join``) with no closure queued, and fails with
a TimeoutError naming the round if no update happens for ``timeout_s`` (e.g.
fewer than N live workers).

``model.fit``'s ``steps_per_epoch`` counts worker steps (gradients), not
updates: an epoch of S steps makes at most S / N updates.
"""

import dataclasses
from typing import Any, Optional

import tensorflow as tf

from tf_asyncps.core import grads as grads_lib
from tf_asyncps.core import placement
from tf_asyncps.core.worker_gate import GatedPolicy, WorkerGate
from tf_asyncps.policies import registry
from tf_asyncps.policies.base import Decision, UpdatePolicy, check_count
from tf_asyncps.validate import check_number

__all__ = ["SyncReplicas", "SyncReplicasAggregator", "Rounds"]


@dataclasses.dataclass
class Rounds:
    """sync_replicas' per-cluster state (what ``build`` returns), on the PS.

    Attributes:
      round: int64 variable, shape (2,): [accepted in this round, rounds done].
      sent: int64 variable, shape (num_workers,): gradients each worker sent.
      gate: the WorkerGate of the workers' tokens.
      num_workers: worker tasks in the cluster (int).
    """

    round: Any
    sent: Any
    gate: Any
    num_workers: int


def _accumulator_dtype(dtype):
    """float32 for 16-bit float variables, else the variable's own dtype."""
    dtype = tf.as_dtype(dtype).base_dtype
    return tf.float32 if dtype in (tf.float16, tf.bfloat16) else dtype


@registry.register("sync_replicas")
class SyncReplicas(GatedPolicy, UpdatePolicy):
    """Aggregates exactly ``replicas_to_aggregate`` gradients per update.

    Args:
      replicas_to_aggregate: N, gradients averaged into each update (int >= 1).
      total_num_replicas: M, workers taking part (default: all workers);
        M > N makes M − N backup workers. Must equal the cluster's worker
        count when given.
      max_staleness: largest τ of an accepted gradient (int >= 0).
      timeout_s: seconds without an update while workers wait before training
        fails with TimeoutError (float > 0).

    Raises:
      ValueError: non-positive counts, M < N, or (when the strategy is built)
        N or M larger than the cluster's worker count.
    """

    atomic = True
    aggregates = True
    name = "sync_replicas"

    def __init__(self, replicas_to_aggregate: int = 1,
                 total_num_replicas: Optional[int] = None, max_staleness: int = 0,
                 timeout_s: float = 120.0):
        replicas_to_aggregate = check_count("sync_replicas", "replicas_to_aggregate",
                                            replicas_to_aggregate, 1, "gradients per update")
        if total_num_replicas is not None:
            total_num_replicas = check_count("sync_replicas", "total_num_replicas",
                                             total_num_replicas, 1, "workers")
            if total_num_replicas < replicas_to_aggregate:
                raise ValueError(
                    f"sync_replicas: total_num_replicas={total_num_replicas} < "
                    f"replicas_to_aggregate={replicas_to_aggregate}; M counts every worker "
                    "and must be >= N (M - N are backup workers).")
        max_staleness = check_count("sync_replicas", "max_staleness", max_staleness, 0,
                                    "global steps")
        timeout_s = check_number(timeout_s, "sync_replicas: timeout_s", above=0, hint="seconds")
        self.replicas_to_aggregate = replicas_to_aggregate
        self.total_num_replicas = total_num_replicas
        self.max_staleness = max_staleness
        self.timeout_s = float(timeout_s)

    def get_config(self):
        return {"replicas_to_aggregate": self.replicas_to_aggregate,
                "total_num_replicas": self.total_num_replicas,
                "max_staleness": self.max_staleness, "timeout_s": self.timeout_s}

    # -- per-cluster state -----------------------------------------------------
    def validate_cluster(self, num_workers):
        n, m = self.replicas_to_aggregate, self.total_num_replicas
        if m is not None and m != num_workers:
            raise ValueError(
                f"sync_replicas: total_num_replicas={m} but the cluster has {num_workers} "
                f"worker(s); set total_num_replicas={num_workers} (or leave it unset).")
        if n > num_workers:
            raise ValueError(
                f"sync_replicas: replicas_to_aggregate={n} can never be reached with "
                f"{num_workers} worker(s): each worker gives at most one gradient per "
                f"update. Use replicas_to_aggregate <= {num_workers}.")

    def build(self, num_workers, device):
        self.validate_cluster(num_workers)
        with tf.init_scope(), tf.device(device):
            # [accepted in this round, rounds done], then per-worker gradients sent
            round_ = tf.Variable(tf.zeros([2], tf.int64), trainable=False,
                                 name="sync_replicas_round")
            sent = tf.Variable(tf.zeros([num_workers], tf.int64), trainable=False,
                               name="sync_replicas_sent_per_worker")
        gate = WorkerGate(
            num_workers, device, initial_tokens=1, timeout_s=self.timeout_s,
            name="sync_replicas", progress=lambda: int(round_.numpy()[1]),
            describe=lambda waiting: self._describe(waiting, round_))
        return Rounds(round_, sent, gate, num_workers)

    def _describe(self, waiting, round_):
        accepted, rounds = (int(v) for v in round_.numpy())
        return (f"sync_replicas: no update for {self.timeout_s:.0f} s (timeout_s): round "
                f"{rounds + 1} has {accepted} of replicas_to_aggregate="
                f"{self.replicas_to_aggregate} gradients; worker(s) {waiting} wait for it. "
                "Fewer than replicas_to_aggregate workers are alive or making progress; "
                "restart the dead worker(s), lower replicas_to_aggregate, or raise timeout_s.")

    def init(self, variables):
        state = []
        for v in variables:
            with placement.beside(v):  # on v's ps task: the sum stays local to it
                buf = tf.Variable(tf.zeros(v.shape, _accumulator_dtype(v.dtype)),
                                  trainable=False, name="sync_replicas_accumulator")
                rows = tf.Variable(tf.zeros([v.shape[0]] if v.shape.rank else [1], tf.bool),
                                   trainable=False, name="sync_replicas_touched_rows")
            state.append((buf, rows))
        return state

    # -- graph side -------------------------------------------------------------
    def before_read(self, worker_index):
        return [self.cluster.gate.wait(worker_index)]

    def step_without_update(self, worker_index):
        # An evaluation step took a token but gave no gradient: give it back.
        return [self.cluster.gate.grant(worker_index)]

    def update(self, grads, state, info):
        c = self.cluster
        n = self.replicas_to_aggregate
        accept = tf.cast(info.tau, tf.int64) <= self.max_staleness
        w = tf.reshape(tf.cast(info.worker_index, tf.int64), [1])
        sent = c.sent.scatter_add(tf.IndexedSlices(tf.ones([1], tf.int64), w))

        def accumulate():
            ops = []
            for g, (buf, rows) in zip(grads, state):
                g = grads_lib.cast(g, buf.dtype)  # sums of 16-bit gradients lose precision
                with tf.device(buf.device):
                    if isinstance(g, tf.IndexedSlices):
                        ops.append(buf.scatter_add(g))
                        ops.append(rows.scatter_update(tf.IndexedSlices(
                            tf.ones_like(g.indices, tf.bool), g.indices)))
                    else:
                        ops.append(buf.assign_add(g))
            with tf.control_dependencies(ops):
                bump = c.round.scatter_add(tf.IndexedSlices(
                    tf.constant([1], tf.int64), tf.constant([0], tf.int64)))
            with tf.control_dependencies([bump]):
                return tf.gather(c.round.read_value(), 0)

        if info.finite is not None:  # a NaN/Inf gradient must not poison the round
            accept = tf.logical_and(accept, info.finite)
        def refused():
            # The step was wasted (late or non-finite): let the worker read
            # the current parameters at once instead of waiting for an update
            # that may need its gradient.
            with tf.control_dependencies([c.gate.grant(info.worker_index)]):
                return tf.gather(c.round.read_value(), 0)

        with tf.control_dependencies([sent]):
            count = tf.cond(accept, accumulate, refused)
        complete = tf.logical_and(accept, tf.equal(count, n))
        with tf.control_dependencies([count]):
            means = self._take_means(grads, state, complete)

        def wake():
            # After the update and the global step's increment (the engine
            # runs it there): a worker woken before them read the old global
            # step (its gradient then came in late, τ = 1, and was dropped).
            return [tf.cond(complete, lambda: tf.group(c.gate.grant_all(only_if_empty=True)),
                            tf.no_op)]
        return Decision(means, complete, accepted=accept, after_apply=wake)

    def _take_means(self, grads, state, complete):
        """Mean of the round's gradients; buffers reset when ``complete``."""
        c = self.cluster
        n = self.replicas_to_aggregate
        out = []
        resets = []
        for g, (buf, rows) in zip(grads, state):
            with tf.device(buf.device):
                if isinstance(g, tf.IndexedSlices):
                    idx = tf.reshape(tf.where(rows.read_value()), [-1])
                    # A gather from the variable, not of a read of it: a read of a
                    # variable that sparse ops touch copies all of it (copy-on-read).
                    vals = tf.gather(buf, idx) / tf.cast(n, buf.dtype)
                    mean = tf.IndexedSlices(tf.cast(vals, g.dtype), idx,
                                            tf.shape(buf, out_type=tf.int64))
                    resets.append(lambda buf=buf, rows=rows, idx=idx, vals=vals: [
                        buf.scatter_update(tf.IndexedSlices(tf.zeros_like(vals), idx)),
                        rows.scatter_update(tf.IndexedSlices(
                            tf.zeros_like(idx, tf.bool), idx))])
                else:
                    mean = tf.cast(buf.read_value() / tf.cast(n, buf.dtype), g.dtype)
                    resets.append(lambda buf=buf: [buf.assign(tf.zeros_like(buf))])
            out.append(mean)
        flat = [t for m in out for t in ((m.values, m.indices)
                                         if isinstance(m, tf.IndexedSlices) else (m,))]

        def reset():
            with tf.control_dependencies(flat):
                ops = [op for r in resets for op in r()]
                ops.append(c.round.scatter_update(tf.IndexedSlices(
                    tf.constant([0], tf.int64), tf.constant([0], tf.int64))))
                ops.append(c.round.scatter_add(tf.IndexedSlices(
                    tf.constant([1], tf.int64), tf.constant([1], tf.int64))))
            with tf.control_dependencies(ops):
                return tf.constant(True)

        done = tf.cond(complete, reset, lambda: tf.constant(False))
        with tf.control_dependencies([done]):
            return [tf.IndexedSlices(tf.identity(m.values), tf.identity(m.indices),
                                     m.dense_shape)
                    if isinstance(m, tf.IndexedSlices) else tf.identity(m) for m in out]

    # -- host side --------------------------------------------------------------
    def rounds(self) -> int:
        """Updates applied so far (read from the PS)."""
        return int(self.cluster.round.numpy()[1])

    def gradients_sent(self):
        """Per-worker count of gradients that reached the PS (int64 array)."""
        return self.cluster.sent.numpy()


SyncReplicasAggregator = SyncReplicas
"""The name the docs and TF1 users know (``tf_asyncps.SyncReplicasAggregator``)."""
