"""AsyncParameterServerStrategy: ParameterServerStrategy plus update policies.

The strategy is a ``tf.distribute.ParameterServerStrategy``; everything that
differs lives in its ``extended`` object, which overrides the narrowest
StrategyExtended hooks and hands the work to the policy engine
(``tf_asyncps/core/engine.py``):

* ``_call_for_each_replica``: wraps each worker step so that it first reads
  the global step ``r`` on the PS, before any model variable is read
  (``PolicyEngine.worker_step``; K > 1 replicas: ``core/gpu_replicas.py``).
* ``_use_merge_call``/``_replica_ctx_update``/``_replica_ctx_all_reduce``:
  with one replica per worker there is nothing to merge, so updates run
  directly in the replica context (this is what lets the engine put an
  optimizer update under ``tf.cond``).
* ``_update``: each variable's update, gated by the step's non-finite check
  on the variable's own ps task while the engine asks for it
  (``core/nonfinite_guard.py``).
* ``_reduce_to``/``_batch_reduce_to``: inside a K-replica step's one update
  the optimizer's all-reduce passes the already summed gradients through.
* ``_distribute_datasets_from_function``: one input pipeline per worker.
* ``_create_variable``: remembers the variables (read snapshots, local copies),
  and keeps tf_keras's ``steps_per_execution`` counter on the chief, where
  ``fit`` reads it before every closure.

The strategy's coordinator (``tf_asyncps/coordinator.py``) starts the
engine's watchdogs while closures run, stops them and pushes local copies
when it drains, and turns a timed-out wait into a TimeoutError.
"""

import dataclasses
from typing import List, Optional, Union

import tensorflow as tf
from absl import logging

from tf_asyncps import cluster as cluster_lib
from tf_asyncps import policies as policies_lib
from tf_asyncps.cluster import devices
from tf_asyncps.compat import call_scopes
from tf_asyncps.compat import keras_models as models_compat
from tf_asyncps.compat import optimizers as optimizers_compat
from tf_asyncps.compat import sharded_slots
from tf_asyncps.compat import strategy as strategy_compat
from tf_asyncps.compat import tf_keras as tf_keras_compat
from tf_asyncps.compat import variables as variables_compat
from tf_asyncps.core import (gpu_replicas, lookup, mixed_precision, nonfinite_guard,
                             placement, table_seam, wire_reads)
from tf_asyncps.coordinator import INPUT_RAN_OUT_MESSAGE
from tf_asyncps.coordinator import AsyncClusterCoordinator as _AsyncCoordinator
from tf_asyncps.core import embedding_cache as embedding_cache_lib
from tf_asyncps.core.engine import PolicyEngine
from tf_asyncps.core.staleness import PS_DEVICE, StalenessStats, StalenessTracker
from tf_asyncps.core.step import check_optimizer_scope, install_optimizer_hooks
from tf_asyncps.optimizers import is_locking, lock_timeout
from tf_asyncps.validate import check_number

__all__ = ["AsyncParameterServerStrategy", "INPUT_RAN_OUT_MESSAGE", "KERAS3_FIT_MESSAGE"]

#: The coordinator's own device: ParameterServerStrategy connects this process
#: to the cluster as job "chief", also when the cluster has no chief job.
COORDINATOR_DEVICE = "/job:chief/replica:0/task:0/device:CPU:0"

KERAS3_FIT_MESSAGE = (
    "This Keras 3 model's fit/evaluate/predict reached Keras 3's own loop, which "
    "has no parameter-server path (it runs steps on the chief). Create AND compile "
    "the model inside `with strategy.scope():` so that it gets "
    "AsyncParameterServerStrategy's fit/evaluate/predict (tf_asyncps.keras3), or "
    "use tf_keras (`import tf_keras as keras`).")


class _WorkerInputContext(tf.distribute.InputContext):
    """InputContext with one input pipeline per worker.

    Vanilla ParameterServerStrategy passes every worker the same context
    (1 pipeline, id 0), so ``dataset.shard(ctx.num_input_pipelines,
    ctx.input_pipeline_id)`` does not shard. Here ``num_input_pipelines`` is
    the number of workers and ``input_pipeline_id`` is the worker's index: an
    int64 scalar tensor fed when the dataset is created on that worker.
    """

    def __init__(self, base, num_workers):
        super().__init__(num_input_pipelines=num_workers, input_pipeline_id=0,
                         num_replicas_in_sync=base.num_replicas_in_sync)

    @property
    def input_pipeline_id(self):
        return tf.distribute.coordinator.experimental_get_current_worker_index()


WIRE_DTYPES = (None, "float32", "bfloat16")


def _wire_dtype(wire_dtype):
    """``wire_dtype`` -> None (float32 as it is) or tf.bfloat16; ValueError else."""
    name = getattr(wire_dtype, "name", wire_dtype)  # a tf.DType too
    if isinstance(name, bool) or name not in WIRE_DTYPES:
        raise ValueError(
            f"wire_dtype must be one of None, 'float32', 'bfloat16' (the dtype float32 "
            f"gradients and weights read cross the network in), got {wire_dtype!r}.")
    return tf.bfloat16 if name == "bfloat16" else None


class _AsyncExtended(strategy_compat.pss_extended_base(), table_seam.StrategySeam):
    """The strategy's ``extended``: StrategyExtended hooks, the rest in
    ``engine``; the seam tables and layers talk to (core/table_seam.py)."""

    def __init__(self, container_strategy, cluster_resolver, variable_partitioner, engine, *,
                 deduplicate_lookups: bool = True, wire_dtype=None, embedding_cache=None):
        super().__init__(container_strategy, cluster_resolver, variable_partitioner)
        self.engine = engine
        self.deduplicate_lookups = deduplicate_lookups
        self.wire_dtype = wire_dtype  # None or tf.bfloat16 (see the strategy's Args)
        # core/embedding_cache.Caches, or None (the strategy's embedding_cache)
        self.caches = None if embedding_cache is None else embedding_cache_lib.Caches(
            embedding_cache, container_strategy, engine.register_table, wire_dtype)

    @property
    def policy(self):
        return self.engine.policy

    # -- the seam below (core/table_seam.py) ----------------------------------
    def register_table(self, hooks) -> None:
        self.engine.register_table(hooks)

    @property
    def local_copies(self) -> bool:
        return self.engine.uses_local_copies

    @property
    def global_step(self):
        return self.engine.tracker.global_step

    # -- one replica per worker: no merge_call needed -------------------------
    def _use_merge_call(self):
        return self._num_replicas_in_sync > 1

    gates_updates = True  # see _update (a StrategySeam attribute)

    def _update(self, var, fn, args, kwargs, group):
        # A step's non-finite check: one cond per variable, on its ps task
        # (core/nonfinite_guard.py), when the engine gates this update.
        return super()._update(var, nonfinite_guard.guard(var, fn), args, kwargs, group)

    def _replica_ctx_update(self, var, fn, args=(), kwargs=None, group=True):
        if self._use_merge_call():
            return super()._replica_ctx_update(var, fn, args, kwargs, group)
        return self._update(var, fn, args, kwargs or {}, group)

    def _replica_ctx_all_reduce(self, reduce_op, value, options=None):
        if self._use_merge_call():
            return super()._replica_ctx_all_reduce(reduce_op, value, options)
        return value  # one replica: the sum and the mean are the value itself

    # -- K replicas per worker: the summed gradients are reduced already ------
    def _reduce_to(self, reduce_op, value, destinations, options):
        if gpu_replicas.in_single_update() and \
                not isinstance(value, tf.distribute.DistributedValues):
            return value  # the optimizer's all-reduce of a K-replica sum
        return super()._reduce_to(reduce_op, value, destinations, options)

    def _batch_reduce_to(self, reduce_op, value_destination_pairs, options):
        if gpu_replicas.in_single_update() and not any(
                isinstance(v, tf.distribute.DistributedValues)
                for v, _ in value_destination_pairs):
            return [v for v, _ in value_destination_pairs]
        return super()._batch_reduce_to(reduce_op, value_destination_pairs, options)

    # -- per-worker datasets: each worker reads its own shard ---------------------
    def _distribute_datasets_from_function(self, dataset_fn, options):
        num_workers = self._num_workers

        def per_worker_fn(ctx):
            return dataset_fn(_WorkerInputContext(ctx, num_workers))

        return super()._distribute_datasets_from_function(per_worker_fn, options)

    # -- variables: the engine remembers them (read snapshots, local copies) ---
    def _create_variable(self, next_creator, **kwargs):
        # One job per step, in this order (each step's docstring says why).
        self._attach_compiling_keras3_model()
        compiling = tf_keras_compat.compiling_model()  # its _steps_per_execution, else None
        if compiling is not None:
            return self._create_steps_counter(compiling, next_creator, kwargs)
        kwargs = self._one_update_aggregation(kwargs)
        var = self._create_outside_the_step(next_creator, kwargs)
        if not self._is_model_variable(kwargs):
            return var
        trainable = kwargs.get("trainable", True) is not False
        # A partitioned variable is its shards to the engine: each shard is a
        # variable on one ps task, and its gradient arrives on its own.
        for part in variables_compat.shards(var) or [var]:
            if isinstance(part, tf.Variable):
                self._track_for_the_engine(part, trainable, var.shape)
        return var

    def _attach_compiling_keras3_model(self) -> None:
        """A Keras 3 model compiling in this scope (its loss tracker's
        variables come here) gets fit/evaluate/predict that schedule
        closures; one created here and not compiled here is refused
        (_attach_hooks)."""
        model = models_compat.compiling_model()
        if model is not None:
            from tf_asyncps import keras3
            keras3.attach(model, self._container_strategy())

    def _create_steps_counter(self, compiling, next_creator, kwargs):
        """tf_keras's ``_steps_per_execution`` of the model ``compiling``,
        created on the chief; an optimizer made outside the scope is refused
        here (compile sets model.optimizer first), before fit."""
        check_optimizer_scope(getattr(compiling, "optimizer", None),
                              self._container_strategy())
        # tf_keras reads this counter on the coordinator twice per closure
        # and never in a step: on a ps each read is a round trip, which
        # took most of the chief's time under local_sgd
        # (docs/benchmarks.md#performance). It lives on the chief.
        with tf.device(COORDINATOR_DEVICE):
            return next_creator(**kwargs)

    def _one_update_aggregation(self, kwargs) -> dict:
        """``kwargs`` with a non-trainable variable of no aggregation set to
        ONLY_FIRST_REPLICA under K replicas per worker: a step's update runs
        once (core/gpu_replicas.py), so one assigned in replica context, such
        as tf_keras's current learning rate under a schedule, takes that one
        update's value instead of raising."""
        none = tf.VariableAggregation.NONE
        if self._num_replicas_in_sync > 1 and not kwargs.get("trainable", True) and \
                kwargs.get("aggregation", none) in (none, None):
            kwargs["aggregation"] = tf.VariableAggregation.ONLY_FIRST_REPLICA
        return kwargs

    def _create_outside_the_step(self, next_creator, kwargs):
        """The variable, created by ParameterServerStrategy without the
        control dependencies around it: one created inside a worker step (an
        optimizer built by its first apply_gradients in a scheduled
        tf.function) has its initializer lifted out of the step by
        tf.function, which cannot lift one depending on the step's read of
        the global step (engine.worker_step: UnliftableError)."""
        with tf.control_dependencies(None):
            return super()._create_variable(next_creator, **kwargs)

    @staticmethod
    def _is_model_variable(kwargs) -> bool:
        """Whether the engine tracks the variable: not a per-worker one, not
        a function-local one (tf_keras's exact evaluation clones its metrics
        with lifting off: they live and die in one closure), not a policy's
        or the engine's own state (placement.beside)."""
        per_worker = kwargs.get("per_worker_variable", False)
        local = kwargs.get("experimental_enable_variable_lifting", True) is False
        return not (per_worker or local or placement.creating_beside())

    def _track_for_the_engine(self, part, trainable: bool, shape=None) -> None:
        """``part`` (a variable or one shard) given to the engine (its mode:
        per step or local copies), and a trainable one's reads set up:
        distinct ids only and rows in wire_dtype for row reads, wire_dtype
        for dense reads. On local copies a step reads the worker's copy,
        nothing crosses, so no wire dtype (it would only round the values)."""
        self.engine.track_variable(part, trainable=trainable)
        wire = None if self.engine.trains_locally(part) else self.wire_dtype
        if trainable and self.caches is not None and not self.engine.trains_locally(part) \
                and self.caches.add(part, shape):
            # Row reads through the worker's cache (distinct ids, wire dtype).
            wire_reads.cast_dense_reads(part, wire)
            return
        if trainable and (self.deduplicate_lookups or wire is not None):
            lookup.read_distinct_rows(part, distinct=self.deduplicate_lookups, wire_dtype=wire)
        if trainable:
            wire_reads.cast_dense_reads(part, wire)

    # -- the worker step ------------------------------------------------------
    def _call_for_each_replica(self, fn, args, kwargs):
        # The policy's hooks see this strategy's cluster state while traced.
        with self.engine.policy_scope():
            return self._worker_steps(strategy_compat.autograph_convert(fn), args, kwargs)

    def _worker_steps(self, fn, args, kwargs):
        if gpu_replicas.in_single_update():
            # Inside a K-replica step's single update (LossScaleOptimizer calls
            # call_for_each_replica there): one replica holds the summed
            # gradients, so fn runs once.
            with tf.distribute.ReplicaContext(self._container_strategy(),
                                              replica_id_in_sync_group=0):
                return fn(*args, **(kwargs or {}))
        if self._num_replicas_in_sync > 1 and not self.engine.uses_local_copies:
            return gpu_replicas.replicated_step(self.engine, fn, args, kwargs,
                                            super()._call_for_each_replica,
                                            self._num_replicas_in_sync)
        return super()._call_for_each_replica(self.engine.worker_step(fn), args, kwargs)


def _attach_hooks() -> None:
    """How Keras reaches the strategy, installed once (idempotent): the
    Keras calls the variable creator and the coordinator ask about
    (compat/call_scopes.py: compile, tf_keras's evaluate), and the refusal of
    Keras 3's own loops for a model created in the scope but not compiled in
    it."""
    call_scopes.install()
    if optimizers_compat.optimizer_class() is not None:
        from tf_asyncps.keras3 import trainer as keras3_trainer
        keras3_trainer.refuse_unattached(AsyncParameterServerStrategy)


def _check_embedding_cache(cache, policy, deduplicate_lookups) -> None:
    """Refuses an ``embedding_cache`` that is no EmbeddingCache or cannot
    apply (the policy, or every id's row read)."""
    if not isinstance(cache, embedding_cache_lib.EmbeddingCache):
        raise TypeError(f"embedding_cache must be a tf_asyncps.EmbeddingCache(rows, "
                        f"pull_bound, push_bound, policy) or None, got {cache!r}.")
    embedding_cache_lib.check_policy(policy)
    if deduplicate_lookups is not True:
        raise ValueError("embedding_cache reads each distinct id once; it cannot apply with "
                         "deduplicate_lookups=False. Drop one of them.")


def _describe_source(resolver) -> str:
    """Where a resolver's cluster came from, for messages."""
    if isinstance(resolver, tf.distribute.cluster_resolver.TFConfigClusterResolver):
        return "TF_CONFIG"
    return f"{type(resolver).__name__}.cluster_spec()"


def _positional_partitioner(update_policy, variable_partitioner):
    """``(update_policy, variable_partitioner)`` with vanilla's positional
    call honoured: its second parameter is ``variable_partitioner``, so code
    written for ``ParameterServerStrategy(resolver, partitioner)`` passes a
    partitioner (a callable, never a policy name or object) where ours takes
    the policy.

    Raises:
      ValueError: a partitioner given both ways.
    """
    if isinstance(update_policy, (str, policies_lib.UpdatePolicy)) or not callable(update_policy):
        return update_policy, variable_partitioner
    if variable_partitioner is not None:
        raise ValueError(
            f"update_policy={update_policy!r} is a partitioner, and variable_partitioner is "
            "given too: pass the policy as update_policy= and the partitioner as "
            "variable_partitioner=.")
    return "async", update_policy


class AsyncParameterServerStrategy(tf.distribute.ParameterServerStrategy):
    """Parameter-server training with pluggable asynchronous update policies.

    Use it as ``tf.distribute.ParameterServerStrategy``: build and compile a
    tf_keras model inside ``strategy.scope()`` and call ``model.fit`` with a
    ``DatasetCreator`` and ``steps_per_epoch`` (worker steps), or drive steps
    yourself with ``tf.distribute.coordinator.ClusterCoordinator.schedule``.
    Every worker step reads the global step before reading the variables, and
    its gradients reach the optimizer through ``update_policy``, which may
    scale, transform or drop them according to the step's staleness τ.

    Cost per worker step: a few scalar ops on ``/job:ps/task:0`` (read of the
    global step, an ``assign_add``, a two-element ``scatter_add`` and
    ``scatter_max``) placed in the PS partition of the step: no extra round
    trip; atomic policies add one lock acquisition on the PS.

    Args:
      cluster_resolver: any ``tf.distribute.cluster_resolver.ClusterResolver``
        with "ps" and "worker" jobs and, unless the resolver names no task
        (the coordinator of an in-process cluster, as in TensorFlow's
        tutorial), a "chief" job; an "evaluator" job is left out of the
        cluster TensorFlow connects to, with a warning.
      update_policy: a registered policy name (``tf_asyncps.policies.names()``)
        or a ``tf_asyncps.policies.UpdatePolicy``. A partitioner here (any
        callable, as vanilla's second positional parameter is
        ``variable_partitioner``: ``ParameterServerStrategy(resolver,
        partitioner)``) is taken as ``variable_partitioner``, with the policy
        ``"async"``.
      variable_partitioner: as in ``ParameterServerStrategy``.
      max_tracked_staleness: last bin of the τ histograms (int >= 1).
      connect_timeout_s: seconds to wait for every ps and worker to accept
        connections before failing (float > 0).
      skip_nonfinite: drop (and count in ``StalenessStats.nonfinite``) any
        step whose gradients hold NaN or Inf, so the shared model never
        receives a non-finite update. With a tf_keras, legacy tf_keras or
        Keras 3 optimizer (no EMA, no gradient accumulation) and a policy
        that keeps the step (``async``, ``staleness_aware``, ``ssp``, ``dc_asgd``),
        each variable's update is a ``tf.cond`` on its own ps task
        (``core/nonfinite_guard.py``); otherwise one ``tf.cond`` spans the ps
        tasks. The check adds a little traffic between the tasks per step
        (figures: docs/benchmarks.md#the-non-finite-check).
      deduplicate_lookups: row reads of the tables created in the scope
        (``tf.nn.embedding_lookup``, tf_keras and Keras 3 ``Embedding``) send
        each distinct id of a batch to its ps once and expand the rows on the
        worker; the gradient then carries one row per distinct id
        (core/lookup.py). Same values and updates; False: TensorFlow's gather
        (every id, every row), as vanilla ParameterServerStrategy. Either
        way, a sparse gradient of a table under 2**31 rows crosses to its ps
        as one tensor with int32 indices (``core/grads.copy_to``); with
        de-duplication the distinct ids cross as int32 too (a gradient taken
        of such a read has int32 indices, and an out-of-range id is refused
        with its value clipped to int32's range in the message).
      wire_dtype: None or "float32" (default: float32 crosses as it is), or
        "bfloat16": the float32 gradients a worker pushes (dense tensors, the
        values of IndexedSlices) are cast to bfloat16 on the worker and back
        to float32 on their variable's ps, and what a worker step reads of
        the float32 trainable variables created in the scope (row reads:
        ``tf.nn.embedding_lookup``, tf_keras and Keras 3 ``Embedding``; dense
        reads: a Dense kernel, a bias) is cast to bfloat16 on the ps and back
        to float32 on the worker: half the bytes of those values on the
        wire, rounded to bfloat16 (8 significant bits, relative error <=
        2^-8). Variables, optimizer slots, policies, the update's own reads
        and the non-finite check stay float32, and so do the chief's eager
        reads; evaluation and prediction scheduled on the workers read as
        training does (docs/guides/mixed_precision.md, "bfloat16 on the
        wire"). No effect on variables on local copies
        (``local_sgd``, a route's part on local steps: whole variables move,
        core/local_copies.py) nor on non-float32 values.
      embedding_cache: None, or a ``tf_asyncps.EmbeddingCache(rows,
        pull_bound, push_bound, policy)``: every table created in the scope
        (a trainable variable of shape ``[rows, dim]`` read by rows; each
        shard of a sharded one) gets a bounded-staleness cache of at most
        ``rows`` rows on each worker (HET, Miao et al., VLDB 2022;
        core/embedding_cache.py, docs/guides/embedding_cache.md). Refused
        under ``sync_replicas`` and ``local_sgd`` and with
        ``deduplicate_lookups=False``; tf_keras optimizers. Counters:
        :meth:`cache_stats`; the cached reads' staleness:
        ``staleness_stats().cached_reads``.
      _connect_timeout_name: internal: how the caller set
        ``connect_timeout_s``, for the TimeoutError (the CLI: its flag).

    Raises:
      TypeError: cluster_resolver is not a ClusterResolver.
      ValueError: an invalid cluster (naming the field and the fix) or policy.
      TimeoutError: a ps or worker unreachable within ``connect_timeout_s``.
    """

    def __init__(self, cluster_resolver, update_policy: Union[str, "policies_lib.UpdatePolicy"] = "async",
                 variable_partitioner=None, *, max_tracked_staleness: int = 32,
                 connect_timeout_s: float = 30.0, skip_nonfinite: bool = True,
                 deduplicate_lookups: bool = True, wire_dtype: Optional[str] = None,
                 embedding_cache: Optional["embedding_cache_lib.EmbeddingCache"] = None,
                 _connect_timeout_name: str = ""):
        if not callable(getattr(cluster_resolver, "cluster_spec", None)):
            raise TypeError(
                "cluster_resolver must be a tf.distribute.cluster_resolver.ClusterResolver "
                "(e.g. tf_asyncps.cluster.cluster_resolver() for TF_CONFIG, or "
                f"LocalCluster(...).resolver()), got {cluster_resolver!r}.")
        update_policy, variable_partitioner = _positional_partitioner(update_policy,
                                                                      variable_partitioner)
        policy = policies_lib.get(update_policy)
        wire = _wire_dtype(wire_dtype)
        check_number(connect_timeout_s, "connect_timeout_s", above=0, hint="seconds")
        if embedding_cache is not None:
            _check_embedding_cache(embedding_cache, policy, deduplicate_lookups)
        if not isinstance(deduplicate_lookups, bool):
            raise TypeError(f"deduplicate_lookups must be True or False, got "
                            f"{deduplicate_lookups!r}.")
        spec = cluster_resolver.cluster_spec().as_dict()
        task_type = cluster_resolver.task_type
        # A coordinator whose resolver names no task may have no "chief" job,
        # as in vanilla PSS (see cluster.validate_tf_config): TensorFlow then
        # adds a local one. Otherwise the cluster must have its chief.
        config = cluster_lib.validate_tf_config(
            {"cluster": spec,
             "task": {"type": task_type or "chief", "index": cluster_resolver.task_id or 0}
             if task_type is not None or "chief" in spec else {}},
            # A "chief" task without a chief job gets its own message there.
            require_task=False, require_chief=task_type not in (None, "chief"),
            source=_describe_source(cluster_resolver))
        if config.task_type not in (None, "chief"):
            raise ValueError(
                f"AsyncParameterServerStrategy runs on the coordinator (the chief); this "
                f"task is {config.task_type}:{config.task_id}. Start ps and worker tasks "
                "with `tf-asyncps server` (or `train`, which serves them).")
        if set(spec) - set(cluster_lib.ROLES):
            # An evaluator is no server of this cluster: connecting to it would hang.
            cluster_resolver = cluster_lib.cluster_resolver(config)
        cluster_lib.wait_for_tasks(config, connect_timeout_s, timeout_name=(
            _connect_timeout_name or "AsyncParameterServerStrategy(connect_timeout_s=...)"))
        cluster_lib.configure_local_context(config.num_workers)
        super().__init__(cluster_resolver, variable_partitioner)
        self._tracker = StalenessTracker(max_tracked_staleness)
        engine = PolicyEngine(policy, self._tracker, config.num_workers, skip_nonfinite,
                              is_locking=is_locking, lock_timeout=lock_timeout, wire_dtype=wire)
        # Built once with its configuration; TensorFlow's constructor built
        # its own and takes none, so this one takes its place.
        strategy_compat.replace_extended(self, _AsyncExtended(
            self, cluster_resolver, variable_partitioner, engine,
            deduplicate_lookups=deduplicate_lookups, wire_dtype=wire,
            embedding_cache=embedding_cache))
        if policy.local_copies and self.num_replicas_in_sync > 1:
            raise ValueError(devices.local_copies_replicas_message(
                policy.name, self.num_replicas_in_sync))
        engine.build(PS_DEVICE)
        install_optimizer_hooks()
        _attach_hooks()
        sharded_slots.checkpoint_partitioned_whole()
        mixed_precision.allow_loss_scaling(AsyncParameterServerStrategy)
        # Model.fit and user code get this coordinator (one per strategy).
        self._coordinator = _AsyncCoordinator(self)
        engine.attach(self, self._coordinator.has_queued_closures)
        logging.info("AsyncParameterServerStrategy: %d worker(s), %d ps, policy %r",
                     config.num_workers, config.num_ps, policy)

    @property
    def update_policy(self) -> "policies_lib.UpdatePolicy":
        """The UpdatePolicy object in use."""
        return self.extended.policy

    @property
    def gpus_per_worker(self) -> int:
        """GPUs each worker task has (0: CPU workers); with K > 1 every worker
        step runs K replicas (``num_replicas_in_sync``) and makes one update."""
        return strategy_compat.num_gpus_per_worker(self.extended)

    @property
    def staleness_tracker(self) -> StalenessTracker:
        return self._tracker

    def staleness_stats(self) -> StalenessStats:
        """Reads the staleness counters from the PS.

        A direct read of three small PS variables (five under ``route``:
        ``parts``, each part's updates, and ``part_histograms`` /
        ``part_dropped_histograms``, each part's τ): it does not wait for
        scheduled steps (no ``coordinator.join``), so it can be polled while
        training runs.
        """
        stats = self._tracker.stats()
        acct = self._coordinator.accounting
        parts, (part_hists, part_dropped) = self._part_updates()
        return dataclasses.replace(stats, retried_closures=acct.retried_closures,
                                   worker_failures=sum(acct.worker_failures),
                                   parts=parts, part_histograms=part_hists,
                                   part_dropped_histograms=part_dropped,
                                   cached_reads=self._cached_reads())

    def _part_updates(self) -> tuple:
        """``route``'s updates per part and its per-part τ histograms
        (``Route.part_updates``, ``Route.part_staleness``), else ``{}, ({}, {})``."""
        policy = self.extended.policy
        if not isinstance(policy, policies_lib.Route):
            return {}, ({}, {})
        with self.extended.engine.policy_scope():  # this strategy's counts
            return policy.part_updates(), policy.part_staleness()

    def cache_stats(self) -> dict:
        """The embedding cache's counters per table (``embedding_cache``):
        ``{table name: {"lookups", "distinct", "hits", "rows_pulled",
        "rows_pushed", "updates_pushed", "evictions", "rows_flushed": int,
        "staleness": [int] * (pull_bound + 1)}}``, summed over the workers
        (read on the ps; tables read by rows so far). {} without a cache."""
        caches = self.extended.caches
        return {} if caches is None else caches.stats()

    def _cached_reads(self) -> dict:
        """Per cached table, its reads served from a worker's cache by the
        updates of the row they missed (0..pull_bound), else {}."""
        return {name: s["staleness"] for name, s in self.cache_stats().items()}

    def closures_done_per_worker(self) -> List[int]:
        """Closures each worker completed (chief-side count, list of ints by
        worker index). A worker that failed and rejoined resumes counting."""
        return self._coordinator.accounting.closures_done

    def reset_staleness_stats(self) -> None:
        """Zeroes the histograms and counters (under ``route`` its per-part
        τ histograms too); the global step and ``parts`` are kept."""
        self._tracker.reset()
        self._coordinator.accounting.reset()
        policy = self.extended.policy
        if isinstance(policy, policies_lib.Route):
            with self.extended.engine.policy_scope():
                policy.reset_part_staleness()

    def experimental_distribute_dataset(self, dataset, options=None):
        if models_compat.in_keras3_loop():
            raise NotImplementedError(KERAS3_FIT_MESSAGE)
        return super().experimental_distribute_dataset(dataset, options)
