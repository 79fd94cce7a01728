"""The training job that runs on the chief: data -> strategy -> model.fit -> outputs.

``run(JobConfig, resolver)`` is what ``tf-asyncps train`` calls on the chief
(and what ``tf-asyncps launch`` starts in its chief process). It writes, under
``output_dir``: ``metrics.json``, ``tensorboard/``, ``saved_model/`` (loadable
by plain TensorFlow in one process; with ``--dynamic_ids`` raw ids) and
``test_predictions.npy``.
"""

import os
import shutil
import tempfile
import time
from typing import Any, Dict, Optional

import numpy as np
import tensorflow as tf
import tf_keras

from tf_asyncps import callbacks as callbacks_lib
from tf_asyncps.callbacks import recovery
from tf_asyncps.callbacks.dynamic import DynamicEviction
from tf_asyncps import cluster as cluster_lib
from tf_asyncps.app import datasets, dynamic_ids
from tf_asyncps.app.job_backup import JobBackup
from tf_asyncps.app.job_config import OPTIMIZERS, JobConfig, make_policy, parse_policy_args
from tf_asyncps.compat import variables as variables_compat
from tf_asyncps.core import mixed_precision
from tf_asyncps.app import models
from tf_asyncps.optimizers import LockingOptimizer
from tf_asyncps.strategy import AsyncParameterServerStrategy

__all__ = ["JobConfig", "run", "run_reference", "reference_dir", "partitioner",
           "parse_policy_args", "set_precision", "steady_rate", "sharding",
           "make_optimizer", "OPTIMIZERS"]

def make_optimizer(name: str, learning_rate: float, keras=tf_keras):
    """An optimizer of ``keras`` (tf_keras or Keras 3) by name (see OPTIMIZERS)."""
    opt = keras.optimizers
    return {
        "sgd": lambda: opt.SGD(learning_rate),
        "momentum": lambda: opt.SGD(learning_rate, momentum=0.9),
        "adam": lambda: opt.Adam(learning_rate),
        "adagrad": lambda: opt.Adagrad(learning_rate),
        "rmsprop": lambda: opt.RMSprop(learning_rate),
    }[name]()


def _compile(model, optimizer, steps_per_execution=1, keras=tf_keras):
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"], steps_per_execution=steps_per_execution)


def dropped_warning(staleness: Dict[str, Any]) -> Optional[str]:
    """The warning for a job whose update policy dropped more than half of
    its worker steps (a drop is counted, not an error), else None.

    Args:
      staleness: ``StalenessStats.to_dict()`` (``applied``, ``dropped``,
        ``nonfinite``: counts of worker steps).
    """
    applied, dropped = staleness["applied"], staleness["dropped"]
    if 2 * dropped <= applied + dropped:
        return None
    nonfinite = staleness.get("nonfinite", 0)
    return (f"warning: {dropped} of {applied + dropped} worker steps were dropped "
            f"({nonfinite} of them held NaN/Inf), only {applied} updated the model: "
            "lower --learning_rate if the gradients or updates overflow, or let the policy "
            "drop less (--policy_args, e.g. a larger max_staleness).")


def steady_rate(epochs) -> float:
    """Worker steps per second after the first epoch (tracing, warm-up) of
    ``StalenessLogger.epochs``; the whole run's with one epoch."""
    later = epochs[1:] or epochs
    seconds = sum(e["seconds"] for e in later)
    return sum(e["steps"] for e in later) / seconds if seconds > 0 else 0.0


def export_saved_model(model, path: str, num_features: int) -> None:
    """Saves ``model`` with a ``serving_default`` signature: ``x`` float32
    ``(batch, num_features)`` -> ``{"probabilities": float32 (batch, classes)}``."""

    @tf.function(input_signature=[tf.TensorSpec([None, num_features], tf.float32, name="x")])
    def serve(x):
        return {"probabilities": tf.nn.softmax(model(x, training=False))}

    # Written beside the target and renamed into place: a crash mid-save
    # leaves the previous SavedModel (or none), never a partial one.
    tmp, old = f"{path}.tmp-{os.getpid()}", f"{path}.old-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tf.saved_model.save(model, tmp, signatures={"serving_default": serve})
    if os.path.exists(path):
        os.rename(path, old)
    os.rename(tmp, path)
    shutil.rmtree(old, ignore_errors=True)


def partitioner(min_shard_bytes: int, num_ps: int):
    """``MinSizePartitioner(min_shard_bytes, max_shards=num_ps)``, or None for 0.

    A variable of B bytes is split on axis 0 into min(num_ps, B // min_shard_bytes)
    shards (at least 1): large embedding tables spread over the ps tasks,
    small Dense kernels stay whole.
    """
    if not min_shard_bytes:
        return None
    return tf.distribute.experimental.partitioners.MinSizePartitioner(
        min_shard_bytes=min_shard_bytes, max_shards=num_ps)


def _build(cfg, data):
    return models.build_model(cfg.model, data.num_features, data.num_classes, cfg.hidden,
                              cfg.seed, vocab=data.vocab, embedding_dim=cfg.embedding_dim,
                              keras=models.keras_module(cfg.keras),
                              dynamic=dynamic_ids.spec(cfg, data))


def set_precision(k, name):
    """Sets the global dtype policy of tf_keras or Keras 3; returns the old one."""
    mp = k.mixed_precision
    old = mp.global_policy() if k is tf_keras else k.config.dtype_policy()
    mp.set_global_policy(name)
    return old


def _local_copy(cfg, data, model):
    """A single-process float32 copy of the trained (maybe partitioned) model.

    Partitioned variables are copied through a checkpoint, which TensorFlow
    restores onto any partitioning, none included.
    """
    local = _build(cfg, data)
    if len(local.weights) == len(model.weights):
        local.set_weights(model.get_weights())
        return local
    # The layers only: the optimizer stays behind (its restore would be
    # deferred to the copy's compile, after the files are gone).
    layers = lambda m: tf.train.Checkpoint(**{f"layer_{i}": l for i, l in enumerate(m.layers)})
    with tempfile.TemporaryDirectory(prefix="asyncps_copy_") as tmp:
        path = layers(model).write(os.path.join(tmp, "model"))
        layers(local).read(path).assert_consumed()
    return local


def sharding(model) -> Dict[str, Any]:
    """Partitioned variables of ``model``: name -> ps task of each shard."""
    out = {}
    from tf_asyncps.compat import variables as variables_compat
    for layer in model.layers:
        for attr in ("embeddings", "kernel"):
            var = getattr(layer, attr, None)
            parts = variables_compat.shards(var) or (
                var is not None and variables_compat.sharded_value(var))
            if parts:
                out[f"{layer.name}/{attr}"] = [
                    tf.DeviceSpec.from_string(p.device).task for p in parts]
    return out


def _binary_metrics(data, probs) -> Dict[str, float]:
    """``{"test_auc": ...}`` (AUC of the positive class, by scikit-learn) for
    2-class data, else ``{}``."""
    if data.num_classes != 2:
        return {}
    from sklearn.metrics import roc_auc_score
    return {"test_auc": float(roc_auc_score(data.y_test, probs[:, 1]))}


def _quality_line(metrics, test_acc, test_loss) -> str:
    """``test AUC ...  test accuracy ...  test loss ...`` for progress lines."""
    auc = f"test AUC {metrics['test_auc']:.4f}  " if "test_auc" in metrics else ""
    return f"{auc}test accuracy {test_acc:.4f}  test loss {test_loss:.4f}"


def run(cfg: JobConfig, resolver=None, print_fn=None) -> Dict[str, Any]:
    """Trains with ``model.fit`` under AsyncParameterServerStrategy.

    Args:
      cfg: the job settings (validated here).
      resolver: the chief's ClusterResolver; default: from TF_CONFIG.
      print_fn: where progress lines go (default print).

    Returns:
      The metrics dict also written to ``output_dir/metrics.json``.

    Raises:
      ValueError: bad settings or cluster. RuntimeError: data not loadable.
      TimeoutError: a task unreachable within ``connect_timeout_s``.
    """
    t_job = time.perf_counter()
    cfg.validate()
    say = print_fn or (lambda s: print(s, flush=True))
    data = datasets.load(cfg.dataset, seed=cfg.seed, raw_ids=cfg.dynamic_ids)
    if resolver is None:
        resolver = cluster_lib.cluster_resolver()
    spec = resolver.cluster_spec()
    num_workers, num_ps = spec.num_tasks("worker"), spec.num_tasks("ps")
    strategy = AsyncParameterServerStrategy(
        resolver, update_policy=make_policy(cfg.policy, cfg.policy_args),
        variable_partitioner=partitioner(cfg.min_shard_bytes, num_ps),
        connect_timeout_s=cfg.connect_timeout_s, _connect_timeout_name="--connect_timeout_s",
        max_tracked_staleness=cfg.max_tracked_staleness, wire_dtype=cfg.wire_dtype)
    precision = mixed_precision.resolve(cfg.mixed_precision, strategy.gpus_per_worker)
    mixed_precision.check_local_copies(strategy.update_policy, precision=precision)
    k = models.keras_module(cfg.keras)
    # The dtype policy applies to layers built (and metrics created) while it
    # is set: keep it for building and training; the export is float32.
    previous_policy = set_precision(k, precision)
    try:
        return _train_and_export(cfg, data, strategy, num_workers, num_ps, precision,
                                 t_job, say)
    finally:
        set_precision(k, previous_policy)


def _train_and_export(cfg, data, strategy, num_workers, num_ps, precision, t_job, say):
    k = models.keras_module(cfg.keras)
    k.utils.set_random_seed(cfg.seed)
    with strategy.scope():
        model = _build(cfg, data)
        optimizer = make_optimizer(cfg.optimizer, cfg.learning_rate, k)
        if precision == "mixed_float16":
            # float16 gradients underflow without loss scaling; its loss-scale
            # variables are created here, on the PS.
            optimizer = k.mixed_precision.LossScaleOptimizer(optimizer)
        if cfg.locking:
            optimizer = LockingOptimizer(optimizer)
        _compile(model, optimizer, cfg.steps_per_execution, k)
    total = cfg.epochs * cfg.steps_per_epoch
    gpus = strategy.gpus_per_worker
    say(f"training {cfg.model} on {cfg.dataset} ({len(data.x_train)} train / "
        f"{len(data.x_test)} test examples) with {num_workers} worker(s)"
        f"{f' ({gpus} GPU each)' if gpus else ''}, {num_ps} ps, "
        f"policy {strategy.update_policy!r}{' with locking' if cfg.locking else ''}"
        f"{', Keras ' + k.__version__ if models.is_keras3(k) else ''}"
        f"{'' if precision == 'float32' else ', ' + precision}: {cfg.epochs} epochs x "
        f"{cfg.steps_per_epoch} worker steps of {cfg.batch_size} examples")
    tb_dir = os.path.join(cfg.output_dir, "tensorboard") if cfg.output_dir else None
    logger = callbacks_lib.StalenessLogger(log_dir=tb_dir, batch_size=cfg.batch_size,
                                           print_fn=say)
    # Under launch the chief's stderr is a pipe to a terminal (app/console.py).
    cbs = [callbacks_lib.ProgressLine(total, force=os.environ.get("TF_ASYNCPS_PROGRESS_LINE")
                                      == "1"), logger]
    backup = JobBackup(cfg.backup_dir, cfg.backup_every_steps, cfg.steps_per_epoch,
                       cfg.steps_per_execution, k)
    cbs += backup.callbacks
    s0 = strategy.staleness_stats()
    t0 = time.perf_counter()
    try:
        dataset_fn = datasets.make_dataset_fn(data.x_train, data.y_train, cfg.batch_size,
                                              cfg.seed)
        if models.is_keras3(k):
            from tf_asyncps.keras3 import DatasetFn
            per_worker = DatasetFn(dataset_fn)
        else:
            per_worker = tf_keras.utils.experimental.DatasetCreator(dataset_fn)
        model.fit(
            per_worker,
            epochs=cfg.epochs, steps_per_epoch=cfg.steps_per_epoch, callbacks=cbs, verbose=0)
    except BaseException as e:
        backup.failed(e, total, say)
        raise
    train_s = time.perf_counter() - t0
    stats = strategy.staleness_stats()
    worker_steps = stats.worker_steps - s0.worker_steps
    resumed = backup.resumed(total, cfg.epochs, say)

    # Evaluate and export a plain single-process float32 copy of the trained
    # model (mixed-precision variables are float32 already).
    # (run() restores the caller's policy afterwards.)
    set_precision(k, "float32")
    local = None
    if cfg.dynamic_ids:  # the id -> row maps live on the ps: evaluate there
        test_loss, test_acc, probs = dynamic_ids.evaluate(model, data)
    else:
        local = _local_copy(cfg, data, model)
        _compile(local, make_optimizer(cfg.optimizer, cfg.learning_rate, k), keras=k)
        test_loss, test_acc = local.evaluate(data.x_test, data.y_test, verbose=0,
                                             batch_size=256)
        probs = tf.nn.softmax(local(data.x_test, training=False)).numpy()
    metrics = {
        "policy": strategy.update_policy.name,
        "policy_args": dict(cfg.policy_args),
        "locking": bool(cfg.locking),
        "wire_dtype": cfg.wire_dtype,
        "num_workers": num_workers,
        "num_ps": num_ps,
        "epochs": cfg.epochs,
        "steps_per_epoch": cfg.steps_per_epoch,
        "batch_size": cfg.batch_size,
        "worker_steps": int(worker_steps),
        # Steps fit scheduled in this run; worker_steps may exceed it by the
        # retried closures' steps (TensorFlow runs closures at least once).
        "scheduled_steps": int(max(0, total - resumed)),
        "retried_closures": int(stats.retried_closures),
        "worker_failures": int(stats.worker_failures),
        "recovery": backup.summary(),
        "steps_per_sec": worker_steps / train_s,
        "examples_per_sec": worker_steps * cfg.batch_size / train_s,
        "train_time_s": train_s,
        # After the first epoch (which includes tracing and warm-up).
        "steady_steps_per_sec": steady_rate(logger.epochs),
        "wall_time_s": time.perf_counter() - t_job,
        "test_accuracy": float(test_acc),
        "test_loss": float(test_loss),
        **_binary_metrics(data, probs),
        "sharded_variables": sharding(model),
        "dynamic_tables": dynamic_ids.table_stats(model, data) if cfg.dynamic_ids else None,
        "optimizer_iterations": int(model.optimizer.iterations.numpy()),
        "mixed_precision": precision,
        "gpus_per_worker": int(gpus),
        "loss_scale": _loss_scale(model.optimizer),
        "keras": k.__version__,
        "staleness": stats.to_dict(),
        "epoch_log": logger.epochs,
    }
    say(f"{_quality_line(metrics, test_acc, test_loss)}  "
        f"{metrics['steps_per_sec']:.1f} steps/s overall, "
        f"{metrics['steady_steps_per_sec']:.1f} after epoch 1  "
        f"tau mean {stats.mean:.2f} max {stats.max}  "
        f"applied {stats.applied} dropped {stats.dropped}")
    metrics["warnings"] = [w for w in (dropped_warning(metrics["staleness"]),) if w]
    for w in metrics["warnings"]:
        say(w)
    for name, t in (metrics["dynamic_tables"] or {}).items():
        say(f"{name}: {t['live_rows']} of {t['capacity']} rows live ({t['distinct_ids']} "
            f"distinct ids), {t['evicted']} evicted, {t['refused']} refusals")
    if cfg.output_dir:
        os.makedirs(cfg.output_dir, exist_ok=True)
        # --dynamic_ids: no single-process copy (the maps are per ps shard);
        # the chief's model exports itself, maps included, and serves raw ids
        # in a process with no cluster.
        export_saved_model(model if cfg.dynamic_ids else local,
                           os.path.join(cfg.output_dir, "saved_model"), data.num_features)
        np.save(os.path.join(cfg.output_dir, "test_predictions.npy"), probs)
        metrics["wall_time_s"] = time.perf_counter() - t_job
        recovery.atomic_write_json(os.path.join(cfg.output_dir, "metrics.json"), metrics)
        say(f"wrote {cfg.output_dir}/metrics.json, saved_model/, tensorboard/")
    return metrics


def _loss_scale(optimizer):
    """The current dynamic loss scale (float), or None without loss scaling."""
    if not mixed_precision.loss_scale_optimizer(optimizer):
        return None
    scale = getattr(optimizer, "dynamic_scale", None)  # Keras 3's LossScaleOptimizer
    return float((scale if scale is not None else optimizer.loss_scale).numpy())


def run_reference(cfg: JobConfig, print_fn=None) -> Dict[str, Any]:
    """The same model, data and number of steps, trained in one process.

    Plain tf_keras (or Keras 3) ``model.fit`` (no cluster, no strategy) for ``epochs x
    steps_per_epoch`` steps of ``batch_size`` examples, i.e. as many steps as
    the distributed job's workers make together, one after another: the
    reference a distributed run is measured against. Writes
    ``OUTPUT_DIR_reference/metrics.json`` (``"policy": "single_process"``),
    beside the distributed job's ``output_dir``, not over it.

    Raises:
      ValueError: bad settings. RuntimeError: data not loadable.
    """
    t_job = time.perf_counter()
    cfg.validate()
    say = print_fn or (lambda s: print(s, flush=True))
    data = datasets.load(cfg.dataset, seed=cfg.seed, raw_ids=cfg.dynamic_ids)
    k = models.keras_module(cfg.keras)
    k.utils.set_random_seed(cfg.seed)
    model = _build(cfg, data)
    _compile(model, make_optimizer(cfg.optimizer, cfg.learning_rate, k), cfg.steps_per_execution,
             k)
    ds = tf.data.Dataset.from_tensor_slices((data.x_train, data.y_train)).shuffle(
        len(data.x_train), seed=cfg.seed, reshuffle_each_iteration=True).repeat().batch(
        cfg.batch_size, drop_remainder=True)
    say(f"reference: {cfg.model} on {cfg.dataset} in one process, {cfg.epochs} epochs x "
        f"{cfg.steps_per_epoch} steps of {cfg.batch_size} examples (no cluster: the "
        "policy, locking, worker, ps and partitioner flags do not apply)")
    t0 = time.perf_counter()
    # Raw ids: the tables' eviction passes run here, as the ps tasks run them
    # in the distributed job.
    callbacks = [DynamicEviction()] if cfg.dynamic_ids else []
    model.fit(ds, epochs=cfg.epochs, steps_per_epoch=cfg.steps_per_epoch, verbose=0,
              callbacks=callbacks)
    train_s = time.perf_counter() - t0
    test_loss, test_acc = model.evaluate(data.x_test, data.y_test, verbose=0, batch_size=4096)
    probs = tf.nn.softmax(model.predict(data.x_test, batch_size=4096, verbose=0)).numpy()
    steps = cfg.epochs * cfg.steps_per_epoch
    metrics = {"policy": "single_process", "num_workers": 0, "num_ps": 0,
               "epochs": cfg.epochs, "steps_per_epoch": cfg.steps_per_epoch,
               "batch_size": cfg.batch_size, "worker_steps": steps,
               "steps_per_sec": steps / train_s, "train_time_s": train_s,
               "test_accuracy": float(test_acc), "test_loss": float(test_loss),
               **_binary_metrics(data, probs),
               "wall_time_s": time.perf_counter() - t_job}
    if cfg.dynamic_ids:
        metrics["dynamic_tables"] = dynamic_ids.table_stats(model, data)
    say(f"reference: {_quality_line(metrics, test_acc, test_loss)}  "
        f"{metrics['steps_per_sec']:.1f} steps/s")
    if cfg.output_dir:
        out = reference_dir(cfg.output_dir)
        os.makedirs(out, exist_ok=True)
        recovery.atomic_write_json(os.path.join(out, "metrics.json"), metrics)
        say(f"wrote {out}/metrics.json")
    return metrics


def reference_dir(output_dir: str) -> str:
    """Where ``run_reference`` writes: ``runs/x`` -> ``runs/x_reference``."""
    return os.path.normpath(output_dir) + "_reference"
