"""Drop-in for ParameterServerStrategy: TensorFlow's own tutorial code, with the
class name as the only change.

The tutorial scenario below runs the code paths of TensorFlow's
parameter-server tutorial (tensorflow.org/tutorials/distribute/parameter_server_training):
an in-process cluster of "worker" and "ps" jobs only (no "chief": the calling
process is the coordinator), ``SimpleClusterResolver``, ``model.fit`` with a
``DatasetCreator`` (``steps_per_execution``, ModelCheckpoint, BackupAndRestore,
inline evaluation), a custom loop with ``create_per_worker_dataset`` and
``schedule``/``join``, and exact evaluation (``pss_evaluation_shards``). Each
scenario sits above the tests that read it and runs in a process of its own
(TensorFlow allows one cluster per process; docs/tests.md#scenarios-beside-their-tests).
"""

import dataclasses
import logging as py_logging
import multiprocessing
import os
import sys
import tempfile

import numpy as np
import pytest
import tensorflow as tf
import tf_keras

import tf_asyncps
from conftest import run_command, run_scenario
from scenarios import cluster, scenario
from tf_asyncps import StalenessStats

# Two epochs of each: the loss falls, inline evaluation runs per epoch, and
# the counts are exact (a third epoch asserted nothing more).
FIT_EPOCHS, FIT_STEPS, LOOP_EPOCHS, LOOP_STEPS, EVAL_STEPS = 2, 20, 2, 10, 2
FIT_WORKER_STEPS = FIT_EPOCHS * FIT_STEPS
LOOP_WORKER_STEPS = LOOP_EPOCHS * LOOP_STEPS + 1  # the tutorial's last fetched step


def _create_in_process_cluster(tf, num_workers, num_ps):
    """The tutorial's create_in_process_cluster, as published."""
    import portpicker
    worker_ports = [portpicker.pick_unused_port() for _ in range(num_workers)]
    ps_ports = [portpicker.pick_unused_port() for _ in range(num_ps)]
    cluster_dict = {"worker": ["localhost:%s" % port for port in worker_ports]}
    if num_ps > 0:
        cluster_dict["ps"] = ["localhost:%s" % port for port in ps_ports]
    cluster_spec = tf.train.ClusterSpec(cluster_dict)
    # Workers need some inter_ops threads to work properly.
    worker_config = tf.compat.v1.ConfigProto()
    if multiprocessing.cpu_count() < num_workers + 1:
        worker_config.inter_op_parallelism_threads = num_workers + 1
    for i in range(num_workers):
        tf.distribute.Server(cluster_spec, job_name="worker", task_index=i,
                             config=worker_config, protocol="grpc")
    for i in range(num_ps):
        tf.distribute.Server(cluster_spec, job_name="ps", task_index=i, config=worker_config,
                             protocol="grpc")
    return tf.distribute.cluster_resolver.SimpleClusterResolver(cluster_spec, rpc_layer="grpc")



@dataclasses.dataclass(frozen=True)
class TutorialRun:
    """One strategy through the tutorial. Attributes: loss, val_loss: fit's
    loss and inline evaluation's loss per epoch. fit_iterations,
    loop_iterations: the fit's and the custom loop's optimizer counters.
    exact: exact evaluation's {"loss", "mae"} after fit; reference: the same
    in one process with the same weights. final_loss: the custom loop's last
    fetched loss. fit_weights, loop_weights: the two models' weights (nested
    lists). accuracy: the custom loop's training accuracy in its last epoch.
    eval_count: examples its inline evaluation counted; eval_accuracy: its
    accuracy. callback_outputs: what the callbacks wrote (folder names).
    stats: the staleness counters (None under vanilla ParameterServerStrategy)."""
    loss: list[float]
    val_loss: list[float]
    fit_iterations: int
    loop_iterations: int
    exact: dict[str, float]
    reference: dict[str, float]
    final_loss: float
    fit_weights: list
    loop_weights: list
    accuracy: float
    eval_count: float
    callback_outputs: list[str]
    eval_accuracy: float
    stats: StalenessStats | None = None


@dataclasses.dataclass(frozen=True)
class Tutorial:
    """Attributes: runs: one TutorialRun per requested run, in order."""
    runs: list[TutorialRun]


@scenario
def tutorial(runs, num_workers=2, num_ps=2) -> Tutorial:
    """One in-process cluster; for each run ``{"strategy", "policy",
    "policy_args", "callbacks"}`` a new strategy on it runs the tutorial's code
    paths (as TensorFlow's own tests build several strategies on one cluster).
    Its servers live in this process: nothing outlives it."""
    cluster_resolver = _create_in_process_cluster(tf, num_workers, num_ps)
    return Tutorial(runs=[_tutorial_run(cluster_resolver, num_ps, **run) for run in runs])


def _tutorial_run(cluster_resolver, num_ps, strategy="async", policy="async", policy_args=None,
                  callbacks=True) -> "TutorialRun":
    """The tutorial's fit, inline evaluation, exact evaluation and custom loop."""
    tf_keras.utils.set_random_seed(0)
    variable_partitioner = tf.distribute.experimental.partitioners.MinSizePartitioner(
        min_shard_bytes=(256 << 10), max_shards=num_ps)
    if strategy == "vanilla":
        strategy = tf.distribute.ParameterServerStrategy(
            cluster_resolver, variable_partitioner=variable_partitioner)
    else:  # the class name changed, and the policy chosen
        strategy = tf_asyncps.AsyncParameterServerStrategy(
            cluster_resolver, variable_partitioner=variable_partitioner,
            update_policy=tf_asyncps.policies.get(policy, **(policy_args or {})))

    # -- model.fit with a DatasetCreator ---------------------------------------
    x_all = np.random.RandomState(0).uniform(size=(64, 10)).astype(np.float32)
    y_all = (x_all.sum(axis=1) / 10.0).astype(np.float32)

    def dataset_fn(input_context):
        global_batch_size = 16
        batch_size = input_context.get_per_replica_batch_size(global_batch_size)
        dataset = tf.data.Dataset.from_tensor_slices((x_all, y_all)).shuffle(64, seed=0).repeat()
        dataset = dataset.shard(input_context.num_input_pipelines,
                                input_context.input_pipeline_id)
        dataset = dataset.batch(batch_size)
        return dataset.prefetch(2)

    dc = tf_keras.utils.experimental.DatasetCreator(dataset_fn)
    with strategy.scope():
        # A seeded initializer: the same start as vanilla's, whatever else
        # either strategy draws from the global seed.
        model = tf_keras.models.Sequential([tf_keras.layers.Dense(
            1, kernel_initializer=tf_keras.initializers.GlorotUniform(seed=1))])
        model.compile(tf_keras.optimizers.legacy.SGD(0.1), loss="mse", metrics=["mae"],
                      steps_per_execution=10, pss_evaluation_shards="auto")
    work = tempfile.mkdtemp(prefix="pss_tutorial_")
    # The tutorial's callbacks (ModelCheckpoint writes a SavedModel every epoch:
    # the policy sweep leaves them to the one-worker test).
    callbacks = [tf_keras.callbacks.TensorBoard(log_dir=os.path.join(work, "log")),
                 tf_keras.callbacks.ModelCheckpoint(filepath=os.path.join(work, "ckpt")),
                 tf_keras.callbacks.BackupAndRestore(backup_dir=os.path.join(work, "backup"))
                 ] if callbacks else []
    # Inline evaluation; with pss_evaluation_shards it is exact, so the
    # validation data must be finite (tf_keras refuses a repeat()ed dataset).
    # Exact evaluation ("auto") cuts the data into 5 x num_workers shards and
    # tf.data refuses an empty shard ("Could not apply FILE based sharding"),
    # so 64 examples go in 16 batches of 4.
    eval_ds = tf.data.Dataset.from_tensor_slices((x_all, y_all)).batch(4)
    history = model.fit(dc, epochs=FIT_EPOCHS, steps_per_epoch=FIT_STEPS, callbacks=callbacks,
                        validation_data=eval_ds)
    fit_iterations = int(model.optimizer.iterations.numpy())

    # -- exact evaluation: every example once, as in one process ---------------
    exact = model.evaluate(eval_ds, return_dict=True, verbose=0)
    local = tf_keras.models.Sequential([tf_keras.layers.Dense(1)])
    local.build((None, 10))
    local.set_weights(model.get_weights())
    local.compile(loss="mse", metrics=["mae"])
    reference = local.evaluate(x_all, y_all, batch_size=4, return_dict=True, verbose=0)

    # -- the custom loop --------------------------------------------------------
    labels_all = (x_all.sum(axis=1, keepdims=True) > 5.0).astype(np.int64)

    def loop_dataset_fn(input_context):
        batch_size = input_context.get_per_replica_batch_size(16)
        dataset = tf.data.Dataset.from_tensor_slices((x_all, labels_all)).shuffle(
            64, seed=1).repeat()
        dataset = dataset.shard(input_context.num_input_pipelines,
                                input_context.input_pipeline_id)
        return dataset.batch(batch_size).prefetch(2)

    with strategy.scope():
        loop_model = tf_keras.models.Sequential([tf_keras.layers.Dense(
            1, activation="sigmoid",
            kernel_initializer=tf_keras.initializers.GlorotUniform(seed=2))])
        optimizer = tf_keras.optimizers.legacy.RMSprop(learning_rate=0.1)
        accuracy = tf_keras.metrics.Accuracy()

    @tf.function
    def step_fn(iterator):
        def replica_fn(batch_data, labels):
            with tf.GradientTape() as tape:
                pred = loop_model(batch_data, training=True)
                per_example_loss = tf_keras.losses.BinaryCrossentropy(
                    reduction=tf_keras.losses.Reduction.NONE)(labels, pred)
                loss = tf.nn.compute_average_loss(per_example_loss)
            gradients = tape.gradient(loss, loop_model.trainable_variables)
            optimizer.apply_gradients(zip(gradients, loop_model.trainable_variables))
            actual_pred = tf.cast(tf.greater(pred, 0.5), tf.int64)
            accuracy.update_state(labels, actual_pred)
            return loss

        batch_data, labels = next(iterator)
        losses = strategy.run(replica_fn, args=(batch_data, labels))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, losses, axis=None)

    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)

    @tf.function
    def per_worker_dataset_fn():
        return strategy.distribute_datasets_from_function(loop_dataset_fn)

    per_worker_iterator = iter(coordinator.create_per_worker_dataset(per_worker_dataset_fn))
    for _ in range(LOOP_EPOCHS):
        accuracy.reset_states()
        for _ in range(LOOP_STEPS):
            coordinator.schedule(step_fn, args=(per_worker_iterator,))
        coordinator.join()
    final_loss = float(coordinator.schedule(step_fn, args=(per_worker_iterator,)).fetch())
    coordinator.join()

    # -- the custom loop's inline evaluation -------------------------------------
    with strategy.scope():
        eval_accuracy = tf_keras.metrics.Accuracy()

    @tf.function
    def eval_step(iterator):
        def replica_fn(batch_data, labels):
            pred = loop_model(batch_data, training=False)
            eval_accuracy.update_state(labels, tf.cast(tf.greater(pred, 0.5), tf.int64))

        batch_data, labels = next(iterator)
        strategy.run(replica_fn, args=(batch_data, labels))

    def eval_dataset_fn():
        return tf.data.Dataset.from_tensor_slices((x_all[:16], labels_all[:16])).shuffle(
            16, seed=2).repeat().batch(8)

    per_worker_eval_iterator = iter(coordinator.create_per_worker_dataset(eval_dataset_fn))
    for _ in range(EVAL_STEPS):
        coordinator.schedule(eval_step, args=(per_worker_eval_iterator,))
    coordinator.join()

    return TutorialRun(
        loss=[float(v) for v in history.history["loss"]],
        val_loss=[float(v) for v in history.history.get("val_loss", [])],
        fit_iterations=fit_iterations, loop_iterations=int(optimizer.iterations.numpy()),
        exact={k: float(v) for k, v in exact.items()},
        reference={k: float(v) for k, v in reference.items()}, final_loss=final_loss,
        fit_weights=[w.tolist() for w in model.get_weights()],
        loop_weights=[w.tolist() for w in loop_model.get_weights()],
        accuracy=float(accuracy.result().numpy()),
        eval_count=float(eval_accuracy.count.numpy()),
        callback_outputs=sorted(os.listdir(work)),
        eval_accuracy=float(eval_accuracy.result().numpy()),
        stats=strategy.staleness_stats() if hasattr(strategy, "staleness_stats") else None)


POLICIES = [
    ("async", {}), ("drop_stale", {"max_staleness": 2}), ("staleness_aware", {}),
    ("ssp", {"max_staleness": 1}), ("dc_asgd", {}),
    ("sync_replicas", {"replicas_to_aggregate": 2}), ("local_sgd", {"sync_every": 10})]


def _run(runs, num_workers, timeout):
    return run_scenario(tutorial, timeout=timeout, runs=runs, num_workers=num_workers).runs


def _assert_trained_exactly(r):
    assert r.loss[-1] < r.loss[0]
    assert len(r.val_loss) == FIT_EPOCHS  # inline evaluation ran every epoch
    assert r.eval_count == EVAL_STEPS * 8  # the custom loop's evaluation: every batch once
    # Exact evaluation visited each of the 64 examples once: the one-process value.
    assert r.exact["loss"] == pytest.approx(r.reference["loss"], rel=1e-5, abs=1e-6)
    assert r.exact["mae"] == pytest.approx(r.reference["mae"], rel=1e-5, abs=1e-6)


@pytest.mark.cluster
@pytest.mark.timeout(300)
def test_tutorial_with_one_worker_equals_vanilla_parameter_server_strategy():
    vanilla, ours = _run([{"strategy": "vanilla"}, {"strategy": "async"}], 1, timeout=240)
    for key in ("fit_weights", "loop_weights"):
        for a, b in zip(getattr(vanilla, key), getattr(ours, key)):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
    for key in ("loss", "val_loss", "accuracy", "eval_accuracy", "final_loss"):
        assert getattr(vanilla, key) == pytest.approx(getattr(ours, key), abs=1e-6), key
    assert ours.fit_iterations == vanilla.fit_iterations == FIT_WORKER_STEPS
    assert ours.loop_iterations == vanilla.loop_iterations == LOOP_WORKER_STEPS
    s = ours.stats
    assert s.applied == s.global_step == FIT_WORKER_STEPS + LOOP_WORKER_STEPS
    assert s.max == 0  # one worker alone: τ = 0
    assert vanilla.stats is None
    _assert_trained_exactly(vanilla)
    _assert_trained_exactly(ours)
    # ModelCheckpoint's SavedModel, TensorBoard's logs and BackupAndRestore's
    # folder, for both strategies alike.
    assert ours.callback_outputs == vanilla.callback_outputs == ["backup", "ckpt", "log"]


#: Policies whose tutorial paths async's case takes already (per-step updates
#: with no gate and no state of their own on the chief), left to ``-m long``.
LONG_POLICIES = {"drop_stale", "staleness_aware", "dc_asgd"}


@pytest.fixture(scope="module")
def every_policy(request):
    """The policies this session tests, one strategy each, on one chief-less
    2-worker cluster (a deselected long policy is not run)."""
    chosen = {item.callspec.params["policy"] for item in request.session.items
              if item.module is request.module and item.originalname ==
              test_tutorial_on_a_chiefless_in_process_cluster_under_every_policy.__name__}
    runs = [{"strategy": "async", "policy": p, "policy_args": a, "callbacks": False}
            for p, a in POLICIES if p in chosen]
    return dict(zip([r["policy"] for r in runs], _run(runs, 2, timeout=420)))


@pytest.mark.parametrize("policy", [pytest.param(p, marks=pytest.mark.long)
                                    if p in LONG_POLICIES else p for p, _ in POLICIES])
@pytest.mark.cluster
@pytest.mark.timeout(480)
def test_tutorial_on_a_chiefless_in_process_cluster_under_every_policy(every_policy, policy):
    r = every_policy[policy]
    s = r.stats
    steps = FIT_WORKER_STEPS + LOOP_WORKER_STEPS
    _assert_trained_exactly(r)
    if policy == "local_sgd":
        # Every worker step trained a local copy; counters are deltas, exact.
        assert s.local_steps == steps
        assert r.fit_iterations == FIT_WORKER_STEPS
        assert r.loop_iterations == LOOP_WORKER_STEPS
        return
    assert s.applied + s.dropped == steps
    if policy == "sync_replicas":
        assert s.global_step == r.fit_iterations + r.loop_iterations
        assert s.global_step * 2 <= s.applied <= s.global_step * 2 + 2
    else:
        assert s.global_step == s.applied
        assert r.fit_iterations + r.loop_iterations == s.applied


@dataclasses.dataclass(frozen=True)
class Raised:
    """An exception a call raised. Attributes: type: its class name.
    message: its text."""
    type: str
    message: str


def _raised(call):
    """The Raised of ``call()``, or None when it returns."""
    try:
        call()
    except Exception as e:  # noqa: BLE001 - reported to the test
        return Raised(type(e).__name__, str(e))
    return None


@dataclasses.dataclass(frozen=True)
class InputRunsOut:
    """Attributes: error: what fit raised (None: nothing). error_records: the
    ERROR records TensorFlow's logger let through meanwhile (each message's
    first 200 characters)."""
    error: Raised | None
    error_records: list[str]


@scenario(shares_cluster=True)
def input_runs_out(keras_lib="tf_keras", num_ps=2) -> InputRunsOut:
    """A fit whose DatasetCreator / Dataset does not repeat (4 batches for
    2 epochs x 3 steps): the error raised, and the ERROR records TensorFlow's
    logger let through meanwhile."""
    records = []

    class Count(py_logging.Handler):
        def emit(self, record):
            if record.levelno >= py_logging.ERROR:
                records.append(record.getMessage()[:200])

    handler = Count()
    tf.get_logger().addHandler(handler)
    x, y = np.zeros((32, 4), np.float32), np.zeros((32, 1), np.float32)

    def finite_fn(ctx):
        return tf.data.Dataset.from_tensor_slices((x, y)).batch(8)

    try:
        with cluster(num_workers=1, num_ps=num_ps) as c:
            strategy = tf_asyncps.AsyncParameterServerStrategy(c.resolver())
            if keras_lib == "3":
                import keras
                with strategy.scope():
                    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
                    model.compile(keras.optimizers.SGD(0.1), "mse")
                from tf_asyncps.keras3 import DatasetFn
                data = DatasetFn(finite_fn)
            else:
                with strategy.scope():
                    model = tf_keras.Sequential([tf_keras.Input((4,)),
                                                 tf_keras.layers.Dense(1)])
                    model.compile(tf_keras.optimizers.SGD(0.1), "mse")
                data = tf_keras.utils.experimental.DatasetCreator(finite_fn)
            error = _raised(lambda: model.fit(data, epochs=2, steps_per_epoch=3, verbose=0))
            return InputRunsOut(error=error, error_records=records)
    finally:
        tf.get_logger().removeHandler(handler)


@pytest.mark.cluster
def test_input_that_runs_out_raises_out_of_range_with_the_fix_and_no_error_wall():
    # tf_keras DatasetCreator without repeat(): TensorFlow cancels the queued
    # closures and fit raised CancelledError("RemoteExecuteNode::RunAsync")
    # after ~160 lines; vanilla's OutOfRangeError, explained, instead.
    r = run_scenario(input_runs_out, shared=(1, 2), keras_lib="tf_keras")
    assert r.error.type == "OutOfRangeError", r.error
    assert r.error.message.startswith(
        "tf_asyncps: a worker's input ran out (End of sequence), so TensorFlow cancelled "
        "the closures scheduled after it. With model.fit(steps_per_epoch=...) the input "
        "must repeat (`.repeat()` on the dataset, in a DatasetCreator's dataset_fn too)")
    assert r.error_records == []  # no per-closure ERROR record with the whole error


@pytest.mark.cluster
def test_keras3_input_that_runs_out_says_repeat_without_an_error_wall():
    r = run_scenario(input_runs_out, shared=(1, 2), keras_lib="3")
    assert r.error.type == "ValueError", r.error
    assert "must repeat (`dataset.repeat()`)" in r.error.message
    assert r.error_records == []


@dataclasses.dataclass(frozen=True)
class EvaluateCall:
    """One evaluate call. Attributes: closures: closures run so far (all
    workers). loss: what evaluate returned (None when it raised). error:
    what it raised (None when it returned)."""
    closures: int
    loss: float | None = None
    error: Raised | None = None


@dataclasses.dataclass(frozen=True)
class EvaluateFinite:
    """Attributes: finite: evaluate of a finite Dataset without steps=.
    steps: evaluate of it repeated, with steps=2."""
    finite: EvaluateCall
    steps: EvaluateCall


@scenario(shares_cluster=True)
def tf_keras_evaluate_finite(num_ps=2) -> EvaluateFinite:
    """tf_keras evaluate of a finite Dataset without steps or
    pss_evaluation_shards: refused before any closure runs; with steps= on
    the repeated dataset it runs."""
    x, y = np.ones((32, 4), np.float32), np.zeros((32, 1), np.float32)
    finite = tf.data.Dataset.from_tensor_slices((x, y)).batch(8)
    out = {}
    with cluster(num_workers=1, num_ps=num_ps) as c:
        strategy = tf_asyncps.AsyncParameterServerStrategy(c.resolver())
        with strategy.scope():
            model = tf_keras.Sequential([tf_keras.Input((4,)), tf_keras.layers.Dense(
                1, kernel_initializer="ones")])
            model.compile(tf_keras.optimizers.SGD(0.1), "mse")
        for name, call in (("finite", lambda: model.evaluate(finite, verbose=0)),
                           ("steps", lambda: model.evaluate(finite.repeat(), steps=2,
                                                            verbose=0))):
            loss = []
            error = _raised(lambda: loss.append(call()))
            out[name] = EvaluateCall(closures=sum(strategy.closures_done_per_worker()),
                                     loss=loss[0] if loss else None, error=error)
    return EvaluateFinite(**out)


@pytest.mark.cluster
def test_tf_keras_evaluate_of_a_finite_dataset_without_shards_is_refused_before_it_runs():
    # It failed with CancelledError after 260-1,000 log lines (vanilla too).
    r = run_scenario(tf_keras_evaluate_finite, shared=(1, 2))
    assert r.finite.error.type == "ValueError"
    assert r.finite.error.message == (
        "model.evaluate got a finite tf.data.Dataset (4 batches) without steps= under a "
        "parameter-server strategy: the workers would read it until one runs out, and the "
        "closures after that would be cancelled (CancelledError). Compile with "
        "pss_evaluation_shards=\"auto\" (exact: each batch evaluated once; also for fit's "
        "validation_data), or pass steps= with a repeating dataset (`.repeat()`).")
    assert r.finite.closures == 0  # refused before scheduling
    # x = 1, kernel 1, y = 0: every prediction is 4.
    assert r.steps.error is None and r.steps.loss == pytest.approx(16.0), r.steps
    assert r.steps.closures == 2


@pytest.mark.cluster
def test_example_custom_loop_is_the_tutorial_loop_and_runs():
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        "examples", "custom_loop.py")
    source = open(path).read()
    # The tutorial's one change: the class name (and its import).
    assert source.count("tf_asyncps.AsyncParameterServerStrategy(") == 1
    assert "tf.distribute.ParameterServerStrategy(" not in source.replace(
        "# tf_asyncps: was tf.distribute.ParameterServerStrategy", "")
    _, log = run_command([sys.executable, path], timeout=240)
    lines = log.splitlines()
    assert [l.split(",")[0] for l in lines if l.startswith("Finished epoch")] == [
        f"Finished epoch {i}" for i in range(4)]
    assert any(l.startswith("Final loss is ") for l in lines)
    # 4 epochs x 5 scheduled steps + the fetched one, each applied once.
    assert any(l.startswith("applied 21 gradients, dropped 0, tau mean ") for l in lines), log


@dataclasses.dataclass(frozen=True)
class EagerRun:
    """Attributes: policy: the policy of a strategy given the partitioner as
    its second positional argument. num_shards: shards of a [4] variable
    under it. test_only: ``strategy.run(next(i) + v)`` in TensorFlow's
    test-only mode. sharded_after_add: the sharded SUM variable after one
    eager ``assign_add(ones)``. warned: run without the test-only mode logged
    TensorFlow's usage warning (to use ClusterCoordinator.schedule)."""
    policy: str
    num_shards: int
    test_only: int
    sharded_after_add: list[float]
    warned: bool


@scenario(shares_cluster=True)
def eager_run() -> EagerRun:
    """``strategy.run`` outside a ``tf.function``, as TensorFlow's own
    strategy tests call it: in its test-only mode (the coordinator's process
    runs the step eagerly) and without it (the usage warning); variables with
    an aggregation, plain and sharded, updated from an eager ``run``."""
    with cluster(num_workers=1, num_ps=2) as c:
        # The partitioner second and positional, as vanilla's signature has it.
        strategy = tf_asyncps.AsyncParameterServerStrategy(
            c.resolver(), tf.distribute.experimental.partitioners.FixedShardsPartitioner(2))
        strategy.extended._allow_run_without_coordinator = True  # TF's test-only mode
        with strategy.scope():
            v = tf.Variable(1, dtype=tf.int64)
            agg = tf.Variable(tf.zeros([4]), aggregation=tf.VariableAggregation.SUM)
        it = iter(tf.data.Dataset.range(15))
        test_only = int(strategy.run(lambda i: next(i) + v, args=(it,)))
        strategy.run(lambda: agg.assign_add(tf.ones([4])))
        sharded = [float(x) for x in tf.concat([s.read_value() for s in agg.variables],
                                               0).numpy()]

        strategy2 = tf_asyncps.AsyncParameterServerStrategy(c.resolver())
        with strategy2.scope():
            w = tf.Variable(1, dtype=tf.int64)
        records = []

        class Keep(py_logging.Handler):
            def emit(self, record):
                records.append(record.getMessage())

        handler = Keep()
        tf.get_logger().addHandler(handler)
        try:
            strategy2.run(lambda i: next(i) + w, args=(iter(tf.data.Dataset.range(8)),))
        finally:
            tf.get_logger().removeHandler(handler)
        return EagerRun(policy=strategy.update_policy.name, num_shards=len(agg.variables),
                        test_only=test_only, sharded_after_add=sharded,
                        warned=any("ClusterCoordinator.schedule" in r for r in records))


@pytest.mark.cluster
def test_strategy_run_outside_a_function_runs_eagerly_as_in_vanilla():
    # TensorFlow's own strategy tests call strategy.run eagerly (its test-only
    # mode, or to see its usage warning); the engine's placement entered a
    # device function there: "tf.device does not support functions when
    # eager execution is enabled".
    r = run_scenario(eager_run, shared=(1, 2))
    # A partitioner passed second (vanilla's variable_partitioner position;
    # ours is update_policy) partitions: "not a registered policy" before.
    assert r.policy == "async" and r.num_shards == 2
    assert r.test_only == 1  # first element 0 + v (1)
    assert r.sharded_after_add == [1.0, 1.0, 1.0, 1.0]
    assert r.warned is True


@dataclasses.dataclass(frozen=True)
class OptimizerOutsideScope:
    """Attributes: compile: what compile and fit raised with the optimizer
    made outside the scope (None: nothing). loop: what a custom loop's
    schedule and join raised. closures: closures that ran (all workers)."""
    compile: Raised | None
    loop: Raised | None
    closures: int


@scenario(shares_cluster=True)
def tf_keras_optimizer_outside_scope(num_ps=2) -> OptimizerOutsideScope:
    """A tf_keras optimizer created outside the scope: passed to compile
    (the model made inside the scope), and used by a custom loop. Each
    error (type and message) and the closures that ran."""
    x, y = np.zeros((32, 4), np.float32), np.zeros((32, 1), np.float32)
    with cluster(num_workers=1, num_ps=num_ps) as c:
        strategy = tf_asyncps.AsyncParameterServerStrategy(c.resolver())
        with strategy.scope():
            model = tf_keras.Sequential([tf_keras.Input((4,)), tf_keras.layers.Dense(1)])

        def compile_and_fit():
            model.compile(tf_keras.optimizers.SGD(0.1), "mse")
            model.fit(tf_keras.utils.experimental.DatasetCreator(
                lambda ctx: tf.data.Dataset.from_tensor_slices((x, y)).batch(8).repeat()),
                epochs=1, steps_per_epoch=2, verbose=0)

        compile_error = _raised(compile_and_fit)
        opt = tf_keras.optimizers.Adam(0.01)
        with strategy.scope():
            w = tf.Variable(tf.zeros([4]))
        coord = tf.distribute.coordinator.ClusterCoordinator(strategy)

        @tf.function
        def step():
            def body():
                with tf.GradientTape() as tape:
                    loss = tf.reduce_sum(w * w)
                opt.apply_gradients(zip(tape.gradient(loss, [w]), [w]))
            strategy.run(body)

        def loop():
            coord.schedule(step)
            coord.join()

        loop_error = _raised(loop)
        return OptimizerOutsideScope(compile=compile_error, loop=loop_error,
                                     closures=sum(strategy.closures_done_per_worker()))


@pytest.mark.cluster
def test_tf_keras_optimizer_made_outside_the_scope_is_refused_naming_the_fix():
    """Vanilla hangs; before, TensorFlow's 'Must not nest tf.distribute.Strategy
    scopes' came from fit's first closure, with no fix named. compile refuses
    the optimizer at once, and a custom loop's first schedule does."""
    r = run_scenario(tf_keras_optimizer_outside_scope, shared=(1, 2))
    fix = ("Create the optimizer inside the scope: create and compile the model inside "
           "`with strategy.scope():`")
    compile_error, loop_error = r.compile, r.loop
    assert compile_error.type == "ValueError", compile_error
    assert compile_error.message.startswith(
        "The optimizer SGD was created outside AsyncParameterServerStrategy.scope() "
        "(it belongs to _DefaultDistributionStrategy)")
    assert fix in compile_error.message
    assert loop_error.type == "ValueError", loop_error
    assert "The optimizer Adam was created outside" in loop_error.message
    assert fix in loop_error.message
    assert r.closures == 0


@dataclasses.dataclass(frozen=True)
class SeedDiffs:
    """Largest absolute differences of initial weights, one Keras. Attributes:
    ours: this strategy's from vanilla's. one_process_dense: one process's
    Dense layers from vanilla's. one_process: one process's (all weights,
    shards in order) from vanilla's. nonzero: the largest absolute weight of
    ours (it is not all zeros)."""
    ours: float
    one_process_dense: float
    one_process: float
    nonzero: float


@dataclasses.dataclass(frozen=True)
class InitialWeights:
    """Attributes: tf_keras, keras3: SeedDiffs with each Keras' set_random_seed.
    shapes: {"vanilla", "ours": the tf_keras model's weight shapes}.
    tf_seed_only_vanilla_twice: largest difference between two vanilla
    models seeded by tf.random.set_seed alone."""
    tf_keras: SeedDiffs
    keras3: SeedDiffs
    shapes: dict[str, list[list[int]]]
    tf_seed_only_vanilla_twice: float


@scenario(shares_cluster=True)
def initial_weights_by_seed(seed=7) -> InitialWeights:
    """The same models' initial weights under vanilla ParameterServerStrategy
    and this strategy on one cluster (one worker, two ps, an Embedding
    partitioned over both), each seeded by Keras's set_random_seed, and in
    one process; and vanilla twice after tf.random.set_seed alone."""
    import keras
    partitioner = tf.distribute.experimental.partitioners.MinSizePartitioner(
        min_shard_bytes=4 << 10, max_shards=2)

    def tf_keras_model():
        model = tf_keras.Sequential([tf_keras.Input((3,), dtype="int64"),
                                     tf_keras.layers.Embedding(500, 16),
                                     tf_keras.layers.Flatten(), tf_keras.layers.Dense(8),
                                     tf_keras.layers.Dense(1)])
        model.compile(tf_keras.optimizers.Adam(0.01), "mse")
        return model

    def keras3_model():
        model = keras.Sequential([keras.Input((3,), dtype="int64"),
                                  keras.layers.Embedding(500, 16), keras.layers.Flatten(),
                                  keras.layers.Dense(8), keras.layers.Dense(1)])
        model.compile(keras.optimizers.Adam(0.01), "mse")
        return model

    def weights(strategy, make, seed_fn):
        seed_fn(seed)
        if strategy is None:
            return [np.asarray(w) for w in make().get_weights()]
        with strategy.scope():
            model = make()
        return [np.asarray(w) for w in model.get_weights()]

    def max_diff(a, b):
        # A partitioned table's shards split its rows: in order, their
        # values are the whole table's (one process has it whole).
        a, b = (np.concatenate([w.ravel() for w in ws]) for ws in (a, b))
        return float(np.max(np.abs(a - b)))

    with cluster(num_workers=1, num_ps=2) as c:
        made = {}
        for name, make_strategy in (
                ("vanilla", lambda: tf.distribute.ParameterServerStrategy(
                    c.resolver(), variable_partitioner=partitioner)),
                ("ours", lambda: tf_asyncps.AsyncParameterServerStrategy(
                    c.resolver(), variable_partitioner=partitioner)),
                ("one_process", lambda: None)):
            strategy = make_strategy()
            made[name] = {
                "tf_keras": weights(strategy, tf_keras_model, tf_keras.utils.set_random_seed),
                "keras3": weights(strategy, keras3_model, keras.utils.set_random_seed),
                "tf_keras_tf_seed": weights(strategy, tf_keras_model, tf.random.set_seed)}
            if name == "vanilla":
                made["vanilla_again"] = {"tf_keras_tf_seed": weights(
                    strategy, tf_keras_model, tf.random.set_seed)}
        diffs = {}
        for lib in ("tf_keras", "keras3"):
            ours, vanilla, one = (made[n][lib] for n in ("ours", "vanilla", "one_process"))
            diffs[lib] = SeedDiffs(
                ours=max_diff(ours, vanilla),
                # the Dense layers (the last 4 arrays): never partitioned
                one_process_dense=max_diff(one[-4:], vanilla[-4:]),
                one_process=max_diff(one, vanilla),
                nonzero=float(max(np.max(np.abs(w)) for w in ours)))
        return InitialWeights(
            **diffs, shapes={name: [list(w.shape) for w in made[name]["tf_keras"]]
                             for name in ("vanilla", "ours")},
            tf_seed_only_vanilla_twice=max_diff(made["vanilla"]["tf_keras_tf_seed"],
                                                made["vanilla_again"]["tf_keras_tf_seed"]))


@pytest.mark.cluster
def test_seeded_initial_weights_equal_vanillas_exactly():
    """tf_keras.utils.set_random_seed (keras.utils.set_random_seed for Keras 3)
    before building the model: this strategy's initial weights are vanilla's
    exactly (an Embedding partitioned over two ps, Dense layers), as in one
    process. tf.random.set_seed alone does not seed Keras initializers (they
    draw their seeds from Python's random module): vanilla itself then
    starts from other weights each time (docs/guides/compatibility.md)."""
    r = run_scenario(initial_weights_by_seed, shared=(1, 2))
    # The same placement: the 500 x 16 table in two shards under both.
    assert r.shapes["ours"] == r.shapes["vanilla"]
    assert r.shapes["ours"][:2] == [[250, 16], [250, 16]]
    for lib in ("tf_keras", "keras3"):
        d = getattr(r, lib)
        assert d.ours == 0.0, lib
        assert d.one_process_dense == 0.0, lib
        assert d.nonzero > 0.01, lib
    # Keras 3 initializes a partitioned table whole, as one process does;
    # tf_keras draws each shard on its own (vanilla and ours alike).
    assert r.keras3.one_process == 0.0
    assert r.tf_keras.one_process > 0.01
    assert r.tf_seed_only_vanilla_twice > 0.01


def test_a_partitioner_given_both_ways_is_refused_naming_both_parameters():
    from tf_asyncps.strategy import _positional_partitioner
    part = lambda shape, dtype: [1]  # noqa: E731 - any callable partitions
    assert _positional_partitioner(part, None) == ("async", part)
    assert _positional_partitioner("ssp", part) == ("ssp", part)
    with pytest.raises(ValueError, match="is a partitioner, and variable_partitioner is given "
                                         "too: pass the policy as update_policy="):
        _positional_partitioner(part, part)
