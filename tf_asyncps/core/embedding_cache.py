"""A bounded-staleness cache of embedding rows on each worker (HET's rule).

Source: X. Miao, H. Zhang, Y. Shi, X. Nie, Z. Yang, Y. Tao, B. Cui, "HET:
Scaling out Huge Embedding Model Training via Cache-enabled Distributed
Framework", PVLDB 15(2), 2022 (VLDB 2022). Each worker keeps hot rows with a
clock per row; the parameter server keeps a clock per row counting the
updates applied to it.

``AsyncParameterServerStrategy(embedding_cache=EmbeddingCache(rows, pull_bound,
push_bound, policy))`` gives every fixed table created in its scope (an
``Embedding``'s or ``EmbeddingCollection``'s, tf_keras or Keras 3, sharded or
not; each shard its share of ``rows``) a
:class:`CachedTable`::

    worker (per-worker variables)          ps (beside the shard)
      slot_of[id] -> slot or -1              clock[id]: updates applied (int64)
      per slot: id, row, seen clock,          stats and staleness histogram
      unpushed count, summed gradient,
      local delta, LFU count / LRU tick

Read (a row read traced in a worker step)::

    unique ids (worker) -> [ids, seen clocks (-1: not cached)]    -> ps
    ps: need = not cached or clock[id] - seen > pull_bound; the rows of
        the needed ids only, each with its clock and its position
        among the ids as bits beside it (one tensor)               -> worker
    (int32 ids where the shard has under 2**31 rows; clocks cross as their
    low 31 bits, compared modulo 2**31: exact while a copy is under 2**31
    updates of its row behind.)
    worker: a pulled row of a cached id gets the worker's own unpushed
        local delta added back; a pulled id not cached takes a slot
        (free, else the least frequently / least recently used slot
        whose updates are all pushed); served rows are the cache's.

Write (the table's gradient in the step's update, on the worker, before
it crosses; the table seam's ``before_push``)::

    cached row: count += 1, summed gradient += g, row += -lr * g (the
        local copy, plain SGD at the optimizer's learning rate)
    push: every row with count > push_bound (its summed gradient, then
        reset) and every row not cached (this step's g) as one sparse
        gradient; the ps applies the optimizer to it and adds each row's
        count to its clock.
    Keras 3 (a row per id occurrence, which its rules square one by one):
        the pushed ids' occurrence rows of this step as they are, then per
        pushed id with earlier unpushed updates their sum as one more row.

What a worker sees: a row at most ``pull_bound`` updates behind the ps
(each update a pushed gradient counted by the clock; the worker's own pushed
updates are among them, applied locally as SGD steps), plus its own unpushed
updates. An optimizer whose step moves rows outside its gradient (Adam's
moments, a momentum: every optimizer but SGD without momentum and Adagrad)
advances every row's clock by one per applied step, so a cached row is then
at most ``pull_bound`` steps of the whole table behind. What the ps applies: the optimizer (SGD, Adagrad, Adam: its slots
live on the ps, beside the table) on summed gradients, at most
``push_bound + 1`` steps of one worker per push. With ``pull_bound=0`` and
``push_bound=0`` every step pushes its gradient and every row a step's own
push touched is pulled again: the uncached step, exactly. A row leaves the
cache only once its updates are pushed, so no update waits on an eviction.

Modules: this one holds the config, a table's state and reports and the
strategy's tables; ``cache_read`` the read, ``cache_write`` the write and
the ps clock, ``cache_flush`` the flush at ``join``.
"""

import contextlib
import dataclasses
import weakref
from typing import Callable, Optional

import tensorflow as tf

from tf_asyncps.compat import graph as graph_compat
from tf_asyncps.compat import variables as variables_compat
from tf_asyncps.core import cache_flush, cache_read, cache_write, placement, table_seam
from tf_asyncps.validate import check_int

__all__ = ["EmbeddingCache", "CachedTable", "POLICIES", "STATS", "check_policy"]

#: Eviction policies: least frequently used, least recently used.
POLICIES = ("lfu", "lru")

#: ``cache_stats()`` counters, in the order of the ps's stats vector.
STATS = ("lookups", "distinct", "hits", "rows_pulled", "rows_pushed", "updates_pushed",
         "evictions", "rows_flushed", "updates", "updates_lost")

#: The counters of :data:`STATS` each worker keeps itself (summed over the
#: live workers at ``cache_stats()``; a restarted worker's start at 0).
WORKER_STATS = ("lookups", "evictions")



@dataclasses.dataclass(frozen=True)
class EmbeddingCache:
    """A worker-side cache of embedding rows with bounded staleness (HET,
    Miao et al., VLDB 2022): ``AsyncParameterServerStrategy(embedding_cache=...)``.

    Attributes:
      rows: at most this many rows cached per table on each worker (int >= 1;
        a sharded table's shards share it by their rows).
      pull_bound: a cached row is served while at most this many updates
        (pushed gradients, counted per row on the ps) landed on it since the
        worker pulled it; else it is pulled again (int >= 0).
      push_bound: a cached row's gradients are summed on the worker and pushed
        once more than this many accumulated (int >= 0).
      policy: which clean slot a new row takes when the cache is full: "lfu"
        (fewest reads) or "lru" (least recently read).

    Raises:
      ValueError: a field out of range, naming it.
    """

    rows: int
    pull_bound: int = 5
    push_bound: int = 5
    policy: str = "lfu"

    def __post_init__(self):
        check_int(self.rows, "EmbeddingCache: rows", min=1, hint="rows cached per table "
                  "on each worker")
        check_int(self.pull_bound, "EmbeddingCache: pull_bound", min=0,
                  hint="updates of a row a cached read may miss; 0: always fresh")
        check_int(self.push_bound, "EmbeddingCache: push_bound", min=0,
                  hint="a row's updates held on the worker before its push; 0: every step")
        if self.policy not in POLICIES:
            raise ValueError(f"EmbeddingCache: policy must be one of {POLICIES} (which row "
                             f"leaves a full cache), got {self.policy!r}.")


def check_policy(policy) -> None:
    """Refuses an update policy the cache cannot apply to.

    Raises:
      ValueError: ``local_sgd`` (no step pushes to the ps) or an aggregating
        policy (``sync_replicas``: a round's mean of gradients, where a
        deferred push would carry several steps of one worker), naming the
        reason and the fix.
    """
    parts = list(getattr(policy, "parts", ()) or ()) + [policy]
    if any(getattr(p, "aggregates", False) for p in parts):
        raise ValueError(
            f"embedding_cache cannot apply under {policy.name}: it averages one gradient per "
            "worker per round, and a cached table pushes several steps' summed gradients at "
            "once. Use a per-step policy (async, drop_stale, staleness_aware, ssp, dc_asgd, "
            "route) or drop embedding_cache.")
    if not policy.updates_on_ps:
        raise ValueError(
            f"embedding_cache cannot apply under {policy.name}: every variable trains on "
            "per-worker copies and no step reads or pushes rows on the ps. Use a per-step "
            "policy, or route(sparse=..., dense=LocalSteps(k)) to keep the tables per step.")


class CachedTable(cache_read.CacheRead, cache_write.CacheWrite):
    """One table (or shard)'s cache: per-worker state, its ps clock, the
    read and the write.

    Args:
      var: the table variable (rank 2, static shape, on its ps).
      config: the :class:`EmbeddingCache`.
      capacity: slots of this table on each worker (int >= 1).
      worker_variable: ``(initial_value_fn, name) -> variable`` on each
        worker (the strategy's per-worker variables; plain variables in one
        process).
      scope: ``() -> context`` to create variables in (the strategy's scope).
      wire_dtype: None or tf.bfloat16: pulled rows cross in it.
    """

    def __init__(self, var, config: EmbeddingCache, capacity: int,
                 worker_variable: Callable, scope: Callable, wire_dtype=None,
                 name: Optional[str] = None):
        if var.shape.rank != 2 or not var.shape.is_fully_defined():
            raise ValueError(f"embedding_cache caches tables of a static [rows, dim] shape; "
                             f"{var.name} has shape {var.shape}.")
        self.var = var
        self.config = config
        self.capacity = int(capacity)
        self.num_rows, self.dim = var.shape.as_list()
        self.name = name or var.name
        self.wire_dtype = wire_dtype
        self._worker_variable = worker_variable
        self._scope = scope
        self.built = False
        self._handles = weakref.WeakKeyDictionary()  # outermost graph -> {name: handle}
        self._counts = weakref.WeakKeyDictionary()  # outermost graph -> pushed counts
        self.optimizer = None  # the optimizer of the last push traced (the flush's)
        self._said_uncached = False

    # -- state --------------------------------------------------------------------
    def build(self) -> None:
        """Creates the ps clock, counters and the per-worker state (once)."""
        if self.built:
            return
        n, r, d, dtype = self.num_rows, self.capacity, self.dim, self.var.dtype
        with tf.init_scope(), self._scope():
            with placement.beside(self.var):
                self.clock = tf.Variable(tf.zeros([n], tf.int64), trainable=False,
                                         name="cache_clock")
                # STATS, then the staleness histogram (index = updates missed):
                # one variable, so a read adds to both in one op.
                self.counters = tf.Variable(
                    tf.zeros([len(STATS) + self.config.pull_bound + 1], tf.int64),
                    trainable=False, name="cache_stats")
            wv = self._worker_variable
            self.slot_of = wv(lambda: tf.fill([n], tf.constant(-1, tf.int32)), "cache_slot_of")
            self.ids = wv(lambda: tf.fill([r], tf.constant(-1, tf.int64)), "cache_ids")
            self.rows = wv(lambda: tf.zeros([r, d], dtype), "cache_rows")
            self.seen = wv(lambda: tf.zeros([r], tf.int64), "cache_seen")
            self.count = wv(lambda: tf.zeros([r], tf.int64), "cache_count")
            self.gsum = wv(lambda: tf.zeros([r, d], dtype), "cache_gsum")
            self.delta = wv(lambda: tf.zeros([r, d], dtype), "cache_delta")
            self.score = wv(lambda: tf.zeros([r], tf.int64), "cache_score")
            self.tick = wv(lambda: tf.zeros([], tf.int64), "cache_tick")
            # WORKER_STATS, counted where they arise (no message per read).
            self.local = wv(lambda: tf.zeros([len(WORKER_STATS)], tf.int64), "cache_local_stats")
        self.built = True

    _WORKER_STATE = ("slot_of", "ids", "rows", "seen", "count", "gsum", "delta", "score",
                     "tick", "local")

    def worker_state(self):
        """``{name: variable}`` of the per-worker state (built)."""
        return {k: getattr(self, k) for k in self._WORKER_STATE}

    def _h(self):
        """The per-worker variables' handles, taken once per scheduled
        function in its outermost graph (a call-time capture is fed there
        only; nested graphs capture the tensor)."""
        top = graph_compat.outermost_graph()
        hs = self._handles.get(top)
        if hs is None:
            with top.as_default():
                hs = {k: v.handle for k, v in self.worker_state().items()}
            self._handles[top] = hs
        return hs

    # -- the seam -----------------------------------------------------------------
    def owns(self, var) -> bool:
        """Whether ``var`` (a tf.Variable, or a Keras 3 variable over one) is
        this table."""
        return variables_compat.backing_variable(var) is self.var

    def hooks(self) -> table_seam.TableHooks:
        """What this cache asks of the engine: its write before the push
        (``before_push``) and the clock's advance on the ps
        (``filter_gradient``)."""
        return table_seam.TableHooks(name=f"cache:{self.name}", owns=self.owns,
                                     before_push=self.push, filter_gradient=self.count_updates,
                                     before_update=self.count_pushed)

    def _count(self, histogram=None, **values):
        """Adds ``values`` (int scalars by :data:`STATS` name) and
        ``histogram`` (int64 ``[pull_bound + 1]``, cached reads by updates
        missed) to the counters, in one op on their ps."""
        names = [k for k in STATS if k in values]
        with tf.device(self.counters.device):
            at = [STATS.index(k) for k in names]
            parts = [tf.stack([tf.cast(values[k], tf.int64) for k in names])]
            if histogram is not None:
                at += range(len(STATS), len(STATS) + self.config.pull_bound + 1)
                parts.append(histogram)
            vector = tf.concat(parts, 0) if len(parts) > 1 else parts[0]
            # A constant shape: tf.shape of the variable would read it (one
            # more stateful op of the step).
            return self.counters.scatter_add(tf.IndexedSlices(
                vector, tf.constant(at, tf.int32), tf.constant(self.counters.shape.as_list(), tf.int32)))

    def count_lost(self) -> int:
        """Once every live worker's updates are pushed (the flush): the
        updates made but never pushed (a worker that died holding them, its
        cache rebuilt empty) are counted in ``updates_lost``. Returns them."""
        c = dict(zip(STATS, self.counters.numpy().tolist()[:len(STATS)]))
        lost = c["updates"] - c["updates_pushed"] - c["updates_lost"]
        if lost > 0:
            self._count(updates_lost=lost)
        return max(lost, 0)

    # -- reports ------------------------------------------------------------------
    def stats(self) -> dict:
        """``{counter: int}`` (see :data:`STATS`) and ``"staleness"``: the
        histogram of cached reads by the updates they missed (list of
        ints, index = updates, 0..pull_bound). Eager reads on the ps."""
        if not self.built:
            return dict({k: 0 for k in STATS}, staleness=[0] * (self.config.pull_bound + 1))
        counters = self.counters.numpy().tolist()
        out = dict(zip(STATS, counters[:len(STATS)]))
        for values in self._local_values():
            for k, v in zip(WORKER_STATS, values):
                out[k] += v
        return dict(out, staleness=counters[len(STATS):])

    def _local_values(self):
        """Each reachable worker's WORKER_STATS (lists of ints)."""
        per_worker = variables_compat.per_worker_values(self.local)
        if per_worker is None:  # one process: a plain variable
            return [self.local.numpy().tolist()]
        out = []
        for v in per_worker:
            try:
                with tf.device(v.device):
                    out.append(v.read_value().numpy().tolist())
            except cache_flush.WORKER_GONE:
                pass  # its counts went with it
        return out


class Caches:
    """The strategy's cached tables: one :class:`CachedTable` per table
    variable (or shard) created in its scope, the flush, the reports.

    Args:
      config: the :class:`EmbeddingCache`.
      strategy: the ``AsyncParameterServerStrategy``.
      register: ``hooks -> None`` (the engine's ``register_table``).
      wire_dtype: None or tf.bfloat16 (pulled rows cross in it).
    """

    def __init__(self, config: EmbeddingCache, strategy, register, wire_dtype=None):
        self.config = config
        self.tables = []
        self._strategy = strategy
        self._register = register
        self._wire_dtype = wire_dtype
        self._flush_observers = []

    def add(self, part, table_shape=None) -> bool:
        """Caches ``part`` (a trainable rank-2 variable of static shape, a
        table or one of its shards; ``table_shape``: the whole table's):
        its row reads in functions go through the cache. Its state is built
        at its first traced row read (a Dense kernel, never read by rows,
        gets none). Returns False for any other variable."""
        shape = part.shape
        if shape.rank != 2 or not shape.is_fully_defined():
            return False
        table_rows = shape[0]
        if table_shape is not None and table_shape.rank == 2 and table_shape[0]:
            table_rows = table_shape[0]
        capacity = max(1, -(-self.config.rows * shape[0] // table_rows))
        strategy = self._strategy
        table = CachedTable(
            part, self.config, min(capacity, shape[0]),
            worker_variable=lambda init, name: variables_compat.per_worker_variable(
                strategy, init, name),
            scope=strategy.scope, wire_dtype=self._wire_dtype)
        self.tables.append(table)
        self._register(table.hooks())
        return variables_compat.replace_sparse_read(part, table.read)

    def stats(self) -> dict:
        """``{table name: CachedTable.stats()}`` of the tables read so far."""
        return {t.name: t.stats() for t in self.tables if t.built}

    def flush(self) -> int:
        """Pushes every worker's unpushed updates (on the chief, once the
        schedule drained: ``join``): see :func:`cache_flush.flush`.
        Returns the rows pushed."""
        with contextlib.ExitStack() as stack:
            for observe in self._flush_observers:
                stack.enter_context(observe())
            return cache_flush.flush(self.tables, self._strategy)

    def observe_flushes(self, observer: Callable) -> None:
        """Enters ``observer()`` (a context manager) around each flush from
        now on: a tool measuring the flushes apart from the steps (the bench
        counts their bytes and seconds)."""
        self._flush_observers.append(observer)
