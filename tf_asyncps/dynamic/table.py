"""A table whose rows are handed to raw ids at run time, on parameter servers.

Recommender ids are unbounded (int64 hashes, strings) and drift: new ones
arrive, old ones go cold. A :class:`DynamicTable` keeps a fixed
``capacity x output_dim`` table (split over the ps tasks by the strategy's
``variable_partitioner``, like any table) and, beside each shard on its ps:

* the id -> row map: a ``tf.lookup.experimental.MutableHashTable``
  (checkpointed and exported to a SavedModel with the layer, so a process
  with no cluster serves raw ids);
* per row: its key, a count (0: free) and the global step it was last seen
  at (int64 variables of the shard's length);
* a counting filter of ``max(shard rows, 65,536)`` int64 counts of the
  sightings of ids without a row, each id counted in two hashed slots and
  read as the lower (DeepRec's counting Bloom filter, in fixed memory: an id
  may be admitted early when both its slots are shared, never late), for
  ``min_count`` and for the eviction pass's ranking of refused ids;
* a ``tf.CriticalSection`` that makes "look up, admit, count" one unit, so two
  workers never give one id two rows (as TorchRec and DeepRec in one process).

An id belongs to shard ``hash(id) % num_shards`` (TensorFlow's
``to_hash_bucket_fast`` of its decimal text, or of the string), and its row
is one of that shard's rows, so only the worker's distinct ids cross, each
to one ps, and the rows come back from the same ps. A lookup in training::

    unique, position = tf.unique(ids)                 # worker
    per shard s (on ps s, in its critical section):
        rows = index.lookup(ids_s)                      # -1: no row yet
        admit those seen min_count times, while rows are free
        count += 1, last_step = global step           # for eviction
    values = table rows (gathered on their ps) or the default row (zeros)
    out = tf.gather(values, position)                 # worker

Not-admitted ids read the default row (zeros, no variable, never trained);
their positions take no part in the gradient.

Eviction (:meth:`DynamicTable.maybe_evict`, :mod:`tf_asyncps.dynamic.eviction`)
frees rows after an update, once every ``evict_every`` global steps per
shard, for the ids refused a row (and those unseen for ``ttl_steps``).

Sources: TensorFlow Recommenders-Addons ``dynamic_embedding`` (restrict
policies by frequency and timestamp), DeepRec EmbeddingVariable (counter
filter admission, global-step eviction), TorchRec managed-collision modules
(LFU/LRU eviction with optimizer state reset; Zhao et al., "Monolith",
2022, for collisionless tables with frequency filtering and expiry).
"""

import functools
import types
from typing import List, Optional, Tuple

import tensorflow as tf

from tf_asyncps.compat import checkpoint as checkpoint_compat
from tf_asyncps.compat import hooks as hooks_compat
from tf_asyncps.compat import variables as variables_compat
from tf_asyncps.core import lookup as lookup_lib
from tf_asyncps.core import placement, table_seam
from tf_asyncps.dynamic import checkpoint as checkpoint_lib
from tf_asyncps.dynamic import deltas as deltas_lib
from tf_asyncps.dynamic import eviction as eviction_lib
from tf_asyncps.dynamic import generations
from tf_asyncps.dynamic import reshard as reshard_lib
from tf_asyncps.dynamic import slots as slots_lib
from tf_asyncps.validate import check_int

__all__ = ["DynamicTable", "check_arguments", "optimizer_slots"]

# Re-exported: where the table and its callers have always found it.
optimizer_slots = slots_lib.optimizer_slots

#: Slots of a shard's counting filter at least (as many as its rows above
#: that): 0.6 MB of int64 counts and bits. Shorter, a small shard's filter
#: saturates when a period brings more new ids than it has slots (measured:
#: a 5-row shard's one-off ids outranked its hot ids; 192 of 500 ids seen
#: twice passed min_count=3 with 500 slots).
FILTER_MIN_SLOTS = 1 << 16


def check_arguments(output_dim, capacity, key_dtype, min_count, eviction, evict_every,
                    ttl_steps) -> tf.DType:
    """Checks the layer's arguments; returns ``key_dtype`` as a tf.DType.

    Raises:
      ValueError / TypeError: naming the field and the fix.
    """
    def positive_int(name, value, hint):
        check_int(value, f"DynamicEmbedding: {name}", min=1, hint=hint)

    positive_int("output_dim", output_dim, "the width of each row")
    positive_int("capacity", capacity, "the most rows the table holds, e.g. capacity=1_000_000")
    positive_int("min_count", min_count, "sightings before an id gets a row; 1 admits at "
                 "once")
    positive_int("evict_every", evict_every, "global steps between eviction passes")
    if ttl_steps is not None:
        positive_int("ttl_steps", ttl_steps, "rows unseen this many global steps are "
                     "evicted; None for no time-to-live")
    if eviction not in eviction_lib.EVICTIONS:
        raise ValueError(f"DynamicEmbedding(eviction={eviction!r}): use one of "
                         f"{', '.join(map(repr, eviction_lib.EVICTIONS))} (lowest count or "
                         "oldest last step goes first), and ttl_steps=N for a time-to-live.")
    try:
        dtype = tf.as_dtype(key_dtype)
    except TypeError:
        dtype = None
    if dtype not in (tf.int64, tf.int32, tf.string):
        raise TypeError(f"DynamicEmbedding(key_dtype={key_dtype!r}): use tf.int64 (raw "
                        "integer ids of any value) or tf.string.")
    return tf.int64 if dtype == tf.int32 else dtype


#: Keys of the counting filter's two hashes (independent of the routing one).
_FILTER_KEYS = ([0x5EED, 0xF11E], [0xC0DE, 0xB10B])


def _bucket(ids, buckets: int, key=None):
    """int64 bucket in [0, buckets) of each id (int64 or string), stable
    across processes and TensorFlow versions; ``key``: a keyed (SipHash) hash."""
    text = ids if ids.dtype == tf.string else tf.strings.as_string(ids)
    if key is not None:
        return tf.strings.to_hash_bucket_strong(text, buckets, key=key)
    return tf.strings.to_hash_bucket_fast(text, buckets)


class _Shard(tf.Module):
    """The map and metadata beside one table shard (rows ``offset`` ..
    ``offset + rows - 1`` of the table), all on that shard's ps. Its index
    is checkpointed with it; its variables (Keras weights of the layer) are
    checkpointed by the table, live rows only (checkpoint.py); the lock
    and the restore marks are not."""

    def __init__(self, var, offset: int, key_dtype, min_count: int, num_shards: int,
                 name: str, local_copies: bool = False):
        super().__init__(name=name)
        untracked = functools.partial(hooks_compat.set_untracked_attribute, self)
        # The layer's weight (a shard of it): held where neither checkpoints
        # nor tf.Module's variable walk (Keras's weight lists) look.
        untracked("refs", types.SimpleNamespace(var=var))
        self.offset, self.min_count, self.num_shards = offset, min_count, num_shards
        self.rows = int(var.shape[0])
        self.filter_slots = max(self.rows, FILTER_MIN_SLOTS)
        self.device = var.device
        zeros = tf.zeros([self.rows], tf.int64)
        with placement.beside(var):
            empty_key = tf.fill([self.rows], "") if key_dtype == tf.string else zeros

            def variable(attr, value, suffix=None):
                # Not a checkpoint dependency: saved by the table (by global
                # row); still a Keras weight of the layer (.h5 files).
                untracked(attr, tf.Variable(value, trainable=False,
                                            name=f"{name}_{suffix or attr}"))

            variable("key", empty_key)
            variable("count", zeros)
            variable("last", zeros, "last_step")
            # Sightings of ids without a row, by hashed slot (admission), and
            # the slots of ids refused a row since the last pass (eviction).
            variable("filter", tf.zeros([self.filter_slots], tf.int64))
            variable("waiting", tf.zeros([self.filter_slots], tf.bool))
            # Free local rows as a stack (its first `free_rows` entries; the
            # lowest row on top): admission pops, eviction pushes.
            variable("free", tf.range(self.rows - 1, -1, -1, dtype=tf.int64))
            variable("free_rows", tf.constant(self.rows, tf.int64))
            # Rows holding an id. A restore that brings the rows back but not
            # the index (tf_keras .h5 files hold weights only) leaves the index
            # smaller than this: the next lookup rebuilds it from the keys.
            scalar = tf.constant(0, tf.int64)
            for attr in ("live", "refused", "passes", "evicted"):
                variable(attr, scalar)
            # Restore marks (not weights): the shard count of a checkpoint
            # restored onto other shards (0: none; reshard.rehome
            # runs first), and slots still to move (reshard.move_slots).
            untracked("marks", types.SimpleNamespace(
                pending=tf.Variable(scalar, trainable=False, name=f"{name}_pending"),
                slots_pending=tf.Variable(False, trainable=False,
                                          name=f"{name}_slots_pending")))
        generations.add_generations(self, var, name, local_copies)
        with tf.init_scope(), tf.device(var.device):
            # Its own name: a re-run chief must not get the last one's map.
            self.index = placement.mutable_hash_table(key_dtype, tf.int64, -1,
                                                      name=f"{name}_index")
            # Not model state: a plain object (no checkpoint, no Keras weight).
            untracked("process_local", types.SimpleNamespace(
                lock=placement.critical_section(f"{name}_lock")))

    @property
    def lock(self):
        return self.process_local.lock

    @property
    def var(self):
        return self.refs.var

    # -- inside the critical section, on the ps -------------------------------
    def index_complete(self):
        """Rebuilds the index from the rows' keys if it holds fewer ids than
        there are live rows (see ``live``), the rows' metadata from the index
        if it holds more (a SavedModel holds the index only)."""
        def rebuild():
            live = tf.where(self.count > 0)[:, 0]
            return self.index.insert(tf.gather(self.key, live), live + self.offset)
        size, live = self.index.size(), self.live.read_value()
        return tf.cond(size < live, rebuild, lambda: tf.cond(
            size > live, lambda: reshard_lib.metadata_from_index(self), tf.no_op))

    def find(self, ids, step, admit: bool, serving: bool = False):
        """Global rows of ``ids`` (distinct, 1-D), -1 where there is none;
        in training (``admit``) admits ids and counts sightings. ``serving``
        (a SavedModel export): the index only."""
        with tf.control_dependencies(
                [] if serving else [reshard_lib.check(self), self.index_complete()]):
            rows = self.index.lookup(ids)
        rows.set_shape(ids.shape)
        if not admit:
            return rows
        new = rows < 0
        waiting = tf.boolean_mask(ids, new)
        # A counting Bloom filter of two hashes (DeepRec's CBF filter): an id's
        # sightings are the lower of its two slots' counts.
        slot, slot2 = (_bucket(waiting, self.filter_slots, key) for key in _FILTER_KEYS)
        both = tf.concat([slot, slot2], 0)
        with tf.control_dependencies([self.filter.scatter_add(
                tf.IndexedSlices(tf.ones_like(both), both))]):
            seen = tf.minimum(tf.gather(self.filter, slot), tf.gather(self.filter, slot2))
        eligible = seen >= self.min_count
        candidates = tf.boolean_mask(waiting, eligible)
        candidate_slots = tf.boolean_mask(slot, eligible)

        def admit_rows():
            # Pop k free rows off the stack: O(k), not a scan of the shard.
            top = self.free_rows.read_value()
            k = tf.minimum(tf.size(candidates, out_type=tf.int64), top)
            # Gathered from the variable: a slice of it would read (copy, as
            # sparse ops touch it) the whole stack.
            take = tf.gather(self.free, tf.range(top - 1, top - k - 1, -1))
            admitted = candidates[:k]
            refused = candidate_slots[k:]
            return tf.group(
                self.free_rows.assign(top - k), self.live.assign_add(k),
                self.index.insert(admitted, take + self.offset),
                self.key.scatter_update(tf.IndexedSlices(admitted, take)),
                self.waiting.scatter_update(tf.IndexedSlices(
                    tf.ones_like(refused, tf.bool), refused)),
                self.refused.assign_add(tf.size(refused, out_type=tf.int64)))

        inserted = tf.cond(tf.size(candidates) > 0, admit_rows, tf.no_op)
        with tf.control_dependencies([inserted]):
            rows = self.index.lookup(ids)
        rows.set_shape(ids.shape)
        local = tf.boolean_mask(rows, rows >= 0) - self.offset
        counted = tf.group(
            self.count.scatter_add(tf.IndexedSlices(tf.ones_like(local), local)),
            self.last.scatter_update(tf.IndexedSlices(tf.fill(tf.shape(local), step), local)),
            *deltas_lib.mark_lookup(self, local, both))
        with tf.control_dependencies([counted]):
            return tf.identity(rows)


class DynamicTable(tf.Module):
    """The map, metadata and eviction of one dynamic embedding table.

    Framework-neutral: the Keras layers (:class:`tf_asyncps.layers.DynamicEmbedding`)
    create the table variable with their own ``add_weight`` and hand its
    ``tf.Variable`` (or ``ShardedVariable``) here.

    Args:
      table: float ``tf.Variable`` or ``ShardedVariable`` of shape
        ``[capacity, output_dim]``.
      key_dtype: tf.int64 or tf.string.
      min_count: sightings (training lookups, one per call) before an
        id gets a row.
      eviction: "lfu" or "lru".
      evict_every: global steps between eviction passes.
      ttl_steps: None, or global steps after which an unseen row is evicted.
      initializer: ``initializer(shape, dtype)`` giving an evicted row its
        fresh values.
      name: prefix of the map's variables.
      local_copies: under ``local_sgd`` (:mod:`tf_asyncps.dynamic.generations`).
    """

    def __init__(self, table, *, key_dtype, min_count: int, eviction: str, evict_every: int,
                 ttl_steps: Optional[int], initializer, name: str, local_copies: bool = False):
        super().__init__(name=name)
        # The layer's weight: see _Shard.refs.
        hooks_compat.set_untracked_attribute(self, "refs", types.SimpleNamespace(table=table))
        self.key_dtype = key_dtype
        self.capacity, self.output_dim = int(table.shape[0]), int(table.shape[1])
        self.eviction, self.evict_every, self.ttl_steps = eviction, evict_every, ttl_steps
        self.initializer = initializer
        parts = variables_compat.shards(table) or [table]
        self.shards: List[_Shard] = []
        offset = 0
        for i, var in enumerate(parts):
            self.shards.append(_Shard(var, offset, key_dtype, min_count, len(parts),
                                      f"{name}_{i}", local_copies))
            offset += int(var.shape[0])
        # Not model state (see reshard.py, checkpoint.py).
        hooks_compat.set_untracked_attribute(self, "reshard", reshard_lib.plan_variables(
            parts[0], name))
        hooks_compat.set_untracked_attribute(self, "saving",
                                          checkpoint_lib.process_state(parts[0], name))
        # The rows its lookups gathered on their ps (see hooks()).
        hooks_compat.set_untracked_attribute(self, "gathered", table_seam.GatheredRows())
        for var in [table] + parts:  # (Keras 3's optimizer tracks the shards too)
            checkpoint_compat.save_elsewhere(var)  # live rows: in `state`
        # Last: a restore deferred until now finds every shard's variables.
        self.state = checkpoint_compat.checkpointed_tensors(
            lambda: checkpoint_lib.save_state(self),
            lambda restored: checkpoint_lib.restore_state(self, restored),
            lambda names: checkpoint_lib.check_entry(self, names))

    @property
    def table(self):
        """The table variable (``tf.Variable`` or ``ShardedVariable``)."""
        return self.refs.table

    # -- a restore onto other shards (reshard.py) -------------------------
    def prepare(self) -> None:
        """Re-homes the table now (eagerly) if a restore onto another number
        of shards is pending; every lookup and eviction pass calls it as it
        is traced (or run eagerly)."""
        reshard_lib.prepare(self, lambda ids: _bucket(ids, len(self.shards)))

    def before_update(self, optimizer, variables):
        """The engine's before-update hook (traced with the update): slot rows
        a restore kept waiting put in (checkpoint.track_optimizer), then the
        slots of rows a restore onto other shards moved, moved; eagerly, once."""
        if not any(self.owns(v) for v in variables):
            return None
        checkpoint_lib.track_optimizer(self, optimizer, variables)
        return reshard_lib.prepare_slots(self, checkpoint_lib.slot_sets(self, optimizer))

    def after_update(self, optimizer, variables, step):
        """The engine's after-update hook: the eviction pass due at global
        ``step`` (int64 scalar, after the update). Traced after the
        optimizer's own update: its slots exist now, and checkpoints hold
        their live rows only from here on."""
        if not any(self.owns(v) for v in variables):
            return None
        checkpoint_lib.track_optimizer(self, optimizer)
        return self.maybe_evict(step, lambda var: optimizer_slots(optimizer, var))

    def hooks(self) -> table_seam.TableHooks:
        """What this table asks of the engine (``extended.register_table``):
        slot moves before an update, the evicted rows' gradients dropped,
        the eviction pass after it, its gathered rows kept on their ps, and
        under local copies each shard's exchange guarded
        (:class:`~tf_asyncps.dynamic.generations.LocalGuard`)."""
        guards = tuple((shard.var, generations.LocalGuard(self, shard))
                       for shard in self.shards if shard.gen is not None)
        return table_seam.TableHooks(
            name=self.name, owns=self.owns, before_update=self.before_update,
            filter_gradient=self.drop_free_rows, after_update=self.after_update,
            rows_on_ps=self.gathered.holds, local_guards=guards)

    def reshard_stats(self) -> dict:
        """The last restore onto other shards in this process (eager; ints):
        ``{"from_shards", "moved", "dropped"}`` (ids whose row moved to their
        home shard; ids evicted because that shard was full), zeros if none."""
        return dict(zip(("from_shards", "moved", "dropped"),
                        self.reshard.counts.numpy().tolist()))

    # -- lookups ----------------------------------------------------------------
    def check_ids(self, ids):
        """``ids`` as a tensor of the key dtype.

        Raises:
          TypeError: float, bool or uint64 ids, or ids of the other kind.
        """
        if isinstance(ids, (tf.RaggedTensor, tf.SparseTensor)):
            raise TypeError(f"DynamicEmbedding got a {type(ids).__name__} of ids: pass a dense "
                            "tensor (ragged.to_tensor(default_value=...) or "
                            "tf.sparse.to_dense(...)) and mask the padding's rows yourself.")
        ids = tf.convert_to_tensor(ids)
        if self.key_dtype == tf.string:
            if ids.dtype != tf.string:
                raise TypeError(f"DynamicEmbedding(key_dtype=tf.string) got ids of dtype "
                                f"{ids.dtype.name}: pass the ids as strings, or make the "
                                "layer with key_dtype=tf.int64.")
            return ids
        if ids.dtype == tf.string:
            raise TypeError("DynamicEmbedding(key_dtype=tf.int64) got string ids: make the "
                            "layer with key_dtype=tf.string.")
        if not ids.dtype.is_integer:  # bool and float ids
            raise TypeError(f"DynamicEmbedding got {ids.dtype.name} ids: ids are integers "
                            "(key_dtype=tf.int64) or strings (key_dtype=tf.string); cast float "
                            "ids with tf.cast(ids, tf.int64) only if they hold whole numbers.")
        if ids.dtype == tf.uint64:  # a cast would wrap ids >= 2**63 to negative ones
            raise TypeError("DynamicEmbedding got uint64 ids: pass tf.bitcast(ids, tf.int64) "
                            "(the same 64 bits, every id distinct; tf.bitcast(export()[0], "
                            "tf.uint64) gives them back), or tf.cast if all are below 2**63.")
        return tf.cast(ids, tf.int64)

    def _parts(self, ids):
        """(ids of each shard, their positions in ``ids``; None for one shard)."""
        n = len(self.shards)
        if n == 1:
            return [ids], None
        owner = tf.cast(_bucket(ids, n), tf.int32)
        return (tf.dynamic_partition(ids, owner, n),
                tf.dynamic_partition(tf.range(tf.size(ids)), owner, n))

    def rows_of(self, ids, serving: bool = False) -> Tuple[tf.Tensor, tf.Tensor]:
        """Global rows of the distinct ``ids``, without admitting or counting
        (inference; no device named: the index's ops run beside it, and a
        SavedModel serves with no cluster).

        Args:
          ids: 1-D distinct ids of the key dtype.
          serving: a SavedModel export traces this: only the index is read
            (reshard.prepare_export made it whole).

        Returns:
          (rows, found): int64 [n] global rows (-1: none), bool [n].
        """
        parts, where = self._parts(ids)
        found = [shard.find(part, None, admit=False, serving=serving)
                 for shard, part in zip(self.shards, parts)]
        rows = self._stitch(found, where)
        return rows, rows >= 0

    @staticmethod
    def _stitch(per_shard, where):
        """Per-shard results back in the order of the ids ``_parts`` split."""
        return per_shard[0] if len(per_shard) == 1 else tf.dynamic_stitch(where, per_shard)

    def _rows_at(self, found, values, n):
        """[n, output_dim]: ``values`` (rows of the found ids, in order) where
        ``found``, the default row (zeros) elsewhere; placed with the ids."""
        return tf.scatter_nd(tf.where(found), values,
                             tf.stack([tf.cast(n, tf.int64), self.output_dim]))

    def lookup(self, ids, step=None, training: bool = False,
               serving: bool = False) -> tf.Tensor:
        """Rows of ``ids``: float ``ids.shape + [output_dim]``; the default row
        (zeros) for ids without a row. The gradient reaches admitted rows only.
        ``step``: None (0), an int64 tensor or a step variable (read on each
        shard's ps). ``serving``: a SavedModel export traces it (see :meth:`rows_of`).

        In training each shard's ps finds the rows (admitting and counting in its
        critical section) and gathers them: an id crosses to its ps once, its row
        (and a found bit) comes back."""
        ids = self.check_ids(ids)
        if not serving:  # (an export: reshard.prepare_export did it)
            self.prepare()
        unique, position = tf.unique(tf.reshape(ids, [-1]))
        if not training:
            # By global row on the whole table: a SavedModel restores a
            # partitioned table as one variable, which a shard's own gather
            # would not index right.
            rows, found = self.rows_of(unique, serving=serving)
            values = tf.nn.embedding_lookup(self.table, tf.boolean_mask(rows, found))
            out = self._rows_at(found, values, tf.size(unique))
        else:
            parts, where = self._parts(unique)
            outs = []
            for shard, part in zip(self.shards, parts):
                with tf.device(shard.device):  # a step variable read here: ps -> ps at most
                    step_now = tf.constant(0, tf.int64) if step is None else tf.cast(
                        step.read_value() if hasattr(step, "read_value") else step, tf.int64)
                    rows, found = generations.find_in_training(shard, part, step_now)
                    local = tf.boolean_mask(rows, found) - shard.offset
                    self.gathered.add(local)  # the gradient's rows stay here
                    # Distinct already: not the strategy's de-duplicating read.
                    with lookup_lib.every_id():
                        values = tf.gather(shard.var, local)
                outs.append(self._rows_at(found, values, tf.size(part)))  # worker: found bits cross
            out = self._stitch(outs, where)
        out = tf.gather(out, position)
        return tf.reshape(out, tf.concat([tf.shape(ids), [self.output_dim]], 0))

    # -- eviction ---------------------------------------------------------------
    def maybe_evict(self, step, slots_of=lambda var: ()) -> tf.Operation:
        """Runs each shard's eviction pass if one is due at global ``step``.

        Args:
          step: int64 scalar, the global step after this update.
          slots_of: ``slots_of(shard) -> [(slot_variable, initial_value)]``,
            the optimizer's slots of one table shard (same shape, same ps).

        Returns:
          The op (one critical-section run per shard).
        """
        return eviction_lib.maybe_evict(self, step, slots_of)

    def drop_free_rows(self, grad, var):
        """``grad`` of ``var`` without the rows that are free now.

        A gradient computed before its row was evicted would otherwise land
        on the freed row (or its next id): under ``sync_replicas`` the round's
        mean is applied steps after its lookups; under the asynchronous
        policies another worker's eviction pass can run between a step's
        lookup and its update. Runs on the shard's ps right before the
        optimizer's update (its ``TableHooks.filter_gradient``); an eviction
        pass that runs between this read and the update itself is not
        covered (the update is not in the shard's critical section).

        Args:
          grad: ``tf.IndexedSlices`` (rows of ``var``) or a dense tensor of
            ``var``'s shape.
          var: a variable; ``grad`` is returned as it is unless ``var`` is
            one of this table's shards (or the unpartitioned table).

        Returns:
          ``grad`` with the free rows' slices dropped (dense: zeroed).
        """
        shard = next((s for s in self.shards if var is s.var), None)
        if shard is None:
            return grad
        with tf.device(shard.device):
            if isinstance(grad, tf.IndexedSlices):
                live = tf.gather(shard.count, grad.indices) > 0
                return tf.IndexedSlices(tf.boolean_mask(grad.values, live),
                                        tf.boolean_mask(grad.indices, live),
                                        grad.dense_shape)
            live = tf.cast(shard.count > 0, grad.dtype)
            return grad * tf.reshape(live, [-1] + [1] * (grad.shape.rank - 1))

    def owns(self, var) -> bool:
        """Whether ``var`` is this table or one of its shards."""
        return var is self.table or any(var is s.var for s in self.shards)

    # -- state --------------------------------------------------------------------
    def live_rows(self) -> int:
        """Rows holding an id now (eager; int)."""
        return int(sum(tf.reduce_sum(tf.cast(s.count > 0, tf.int64)) for s in self.shards))

    def stats(self) -> dict:
        """``{"live_rows", "capacity", "evicted", "refused"}`` (ints, eager)."""
        return {"live_rows": self.live_rows(), "capacity": self.capacity,
                "evicted": int(sum(s.evicted.numpy() for s in self.shards)),
                "refused": int(sum(s.refused.numpy() for s in self.shards))}

    def export(self) -> Tuple[tf.Tensor, tf.Tensor]:
        """(ids [n] key dtype, rows [n, output_dim]) of the live rows only."""
        ids, rows = [], []
        for shard in self.shards:
            live = tf.where(shard.count > 0)[:, 0]
            ids.append(tf.gather(shard.key, live))
            rows.append(tf.gather(shard.var, live))
        return tf.concat(ids, 0), tf.concat(rows, 0)
