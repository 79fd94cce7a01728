"""The CTR job: DLRM on generated Criteo-shaped click data (``--model=dlrm
--dataset=criteo_synthetic``, ``configs/ctr.flags``).

``run(CtrConfig, resolver)`` trains on the chief of a cluster
(``tf-asyncps launch``/``train``); ``run_reference(CtrConfig)`` trains the
same model in one process (``tf-asyncps reference``). Each worker makes its
own training stream from the seed (``ctr_data``: nothing is shipped to the
workers); the held-out split is evaluated on the chief. Both write
``metrics.json`` (the main job's fields, plus ``test_auc``, ``test_loss`` as
the held-out log loss, the planted model's own ``planted_test_auc`` and
``planted_test_loss`` (the ceiling), ``chief_cpu_s_per_example`` and
``ctr``: the data's and model's settings).

Backups (``--backup_dir``, ``--backup_every_steps``, launch
``--restart_failed_tasks``): ``StepBackup`` every ``--backup_every_steps``
worker steps, or every ``--steps_per_epoch`` (epoch ends) without it, full
saves with deltas of the tables between them (app/job_backup.py, shared with
the main job). A resumed run restores the newest backup, N worker steps, and
each worker reads its stream from batch N: the restored model trained on
batches 0..n_w - 1 of worker w's stream with sum(n_w) = N, so no batch it
learnt from is read again; batches n_w..N-1 of each stream are not read by
either run (all streams are draws from the same distribution). ``metrics.json``
``recovery`` holds ``stream_start_batch`` = N.
"""

import os
import time
from typing import Any, Dict

import numpy as np
import tensorflow as tf
import tf_keras

from tf_asyncps import callbacks as callbacks_lib
from tf_asyncps import cluster as cluster_lib
from tf_asyncps.app import ctr_data, ctr_model, job, models
from tf_asyncps.app.job_backup import JobBackup
from tf_asyncps.app.job_config import CtrConfig, make_policy
from tf_asyncps.callbacks import recovery
from tf_asyncps.callbacks.dynamic import DynamicEviction
from tf_asyncps.core import mixed_precision
from tf_asyncps.optimizers import LockingOptimizer
from tf_asyncps.strategy import AsyncParameterServerStrategy

__all__ = ["CtrConfig", "run", "run_reference", "auc", "log_loss"]

MODEL, DATASET = "dlrm", "criteo_synthetic"


def auc(labels, scores) -> float:
    """Area under the ROC curve (Mann-Whitney U with tied scores averaged).

    Args:
      labels: 0/1 values [n]. scores: floats [n].

    Raises:
      ValueError: labels of one class only.
    """
    y = np.asarray(labels).reshape(-1) > 0.5
    s = np.asarray(scores, np.float64).reshape(-1)
    pos, neg = int(y.sum()), int((~y).sum())
    if not pos or not neg:
        raise ValueError("AUC needs labels of both classes.")
    _, inverse, counts = np.unique(s, return_inverse=True, return_counts=True)
    starts = np.cumsum(counts) - counts  # 0-based rank of each distinct score's first
    ranks = (starts + (counts + 1) / 2.0)[inverse]  # 1-based, ties averaged
    return float((ranks[y].sum() - pos * (pos + 1) / 2.0) / (pos * neg))


def log_loss(labels, probs, eps: float = 1e-7) -> float:
    """Mean binary cross-entropy (natural log) of probabilities [n] against 0/1 labels [n]."""
    y = np.asarray(labels, np.float64).reshape(-1)
    p = np.clip(np.asarray(probs, np.float64).reshape(-1), eps, 1 - eps)
    return float(-np.mean(y * np.log(p) + (1 - y) * np.log(1 - p)))


def _held_out(cfg, data):
    x, y, planted = data.arrays(ctr_data.TEST_STREAM, cfg.ctr_test_examples)
    return x, y, planted


def _quality(y, probs, planted) -> Dict[str, float]:
    # No accuracy at 0.5: with a base rate under 0.5 it is about 1 - base rate
    # whatever the model learnt; AUC and log loss say what it learnt.
    return {"test_auc": auc(y, probs), "test_loss": log_loss(y, probs),
            "test_base_rate": float(np.mean(y)),
            "planted_test_auc": auc(y, planted), "planted_test_loss": log_loss(y, planted)}


def _build(cfg, k):
    rows = cfg.rows()
    dynamic = None
    if cfg.ctr_embedding in ctr_model.RAW_ID_EMBEDDINGS:
        dynamic = {"capacity": [max(1, int(round(cfg.dynamic_capacity * r))) for r in rows],
                   "evict_every": cfg.dynamic_evict_every}
    return ctr_model.build(rows, cfg.embedding_dim, cfg.ctr_bottom_mlp, cfg.ctr_top_mlp,
                           cfg.seed, cfg.ctr_embedding, k, dynamic)


def _compile(model, optimizer, cfg, k):
    model.compile(optimizer=optimizer, loss=k.losses.BinaryCrossentropy(from_logits=True),
                  steps_per_execution=cfg.steps_per_execution)


def _predict(model, x) -> np.ndarray:
    logits = model.predict(x, batch_size=8192, verbose=0)
    return tf.sigmoid(tf.cast(logits, tf.float32)).numpy().reshape(-1)


def _line(m) -> str:
    return (f"held-out AUC {m['test_auc']:.4f} log loss {m['test_loss']:.4f} (planted model: "
            f"AUC {m['planted_test_auc']:.4f} log loss {m['planted_test_loss']:.4f})")


def _data(cfg):
    return ctr_data.make(cfg.rows(), cfg.ctr_zipf, cfg.seed,
                         raw_ids=cfg.ctr_embedding in ctr_model.RAW_ID_EMBEDDINGS)


def run(cfg: CtrConfig, resolver=None, print_fn=None) -> Dict[str, Any]:
    """Trains the DLRM with ``model.fit`` under AsyncParameterServerStrategy.

    Args:
      cfg: the settings (validated here).
      resolver: the chief's ClusterResolver; default: from TF_CONFIG.
      print_fn: where progress lines go (default print).

    Returns:
      The metrics dict, also written to ``output_dir/metrics.json``.

    Raises:
      ValueError: bad settings or cluster; a backup in ``backup_dir`` of
        another model. TimeoutError: a task unreachable within
        ``connect_timeout_s``.
    """
    t_job = time.perf_counter()
    cfg.validate()
    say = print_fn or (lambda s: print(s, flush=True))
    if resolver is None:
        resolver = cluster_lib.cluster_resolver()
    spec = resolver.cluster_spec()
    num_workers, num_ps = spec.num_tasks("worker"), spec.num_tasks("ps")
    strategy = AsyncParameterServerStrategy(
        resolver, update_policy=make_policy(cfg.policy, cfg.policy_args),
        variable_partitioner=job.partitioner(cfg.min_shard_bytes, num_ps),
        connect_timeout_s=cfg.connect_timeout_s, _connect_timeout_name="--connect_timeout_s",
        max_tracked_staleness=cfg.max_tracked_staleness, wire_dtype=cfg.wire_dtype)
    precision = mixed_precision.resolve(cfg.mixed_precision, strategy.gpus_per_worker)
    mixed_precision.check_local_copies(strategy.update_policy, precision=precision)
    k = models.keras_module(cfg.keras)
    data = _data(cfg)  # TensorFlow ops: after the strategy set the runtime's threads
    previous = job.set_precision(k, precision)
    try:
        return _train(cfg, data, strategy, num_workers, num_ps, precision, t_job, say)
    finally:
        job.set_precision(k, previous)


def _train(cfg, data, strategy, num_workers, num_ps, precision, t_job, say):
    k = models.keras_module(cfg.keras)
    k.utils.set_random_seed(cfg.seed)
    with strategy.scope():
        model = _build(cfg, k)
        optimizer = job.make_optimizer(cfg.optimizer, cfg.learning_rate, k)
        if precision == "mixed_float16":
            optimizer = k.mixed_precision.LossScaleOptimizer(optimizer)
        if cfg.locking:
            optimizer = LockingOptimizer(optimizer)
        _compile(model, optimizer, cfg, k)
    total = cfg.epochs * cfg.steps_per_epoch
    say(f"training dlrm ({cfg.ctr_embedding}: {len(data.rows)} features, "
        f"{sum(data.rows):,} rows x {cfg.embedding_dim}; Zipf {data.zipf_a}) on generated "
        f"Criteo-shaped data with {num_workers} worker(s), {num_ps} ps, policy "
        f"{strategy.update_policy!r}{', Keras ' + k.__version__ if models.is_keras3(k) else ''}"
        f": {cfg.epochs} epochs x {cfg.steps_per_epoch} worker steps of {cfg.batch_size} "
        f"examples")
    tb_dir = os.path.join(cfg.output_dir, "tensorboard") if cfg.output_dir else None
    logger = callbacks_lib.StalenessLogger(log_dir=tb_dir, batch_size=cfg.batch_size,
                                           print_fn=say)
    cbs = [callbacks_lib.ProgressLine(total, force=os.environ.get("TF_ASYNCPS_PROGRESS_LINE")
                                      == "1"), logger]
    # Without --backup_every_steps, a backup at each epoch end (StepBackup's,
    # not BackupAndRestore's: the resume step is known before fit makes the
    # workers' streams, and the tables get deltas).
    backup = JobBackup(cfg.backup_dir, cfg.backup_every_steps or cfg.steps_per_epoch,
                       cfg.steps_per_epoch, cfg.steps_per_execution, k)
    cbs += backup.callbacks
    dataset_fn = data.dataset_fn(cfg.batch_size, start=backup.resume_step)
    if models.is_keras3(k):
        from tf_asyncps.keras3 import DatasetFn
        per_worker = DatasetFn(dataset_fn)
    else:
        per_worker = tf_keras.utils.experimental.DatasetCreator(dataset_fn)
    x_test, y_test, planted = _held_out(cfg, data)
    s0 = strategy.staleness_stats()
    t0, c0 = time.perf_counter(), time.process_time()
    try:
        model.fit(per_worker, epochs=cfg.epochs, steps_per_epoch=cfg.steps_per_epoch,
                  callbacks=cbs, verbose=0)
    except BaseException as e:
        backup.failed(e, total, say)
        raise
    train_s, chief_cpu = time.perf_counter() - t0, time.process_time() - c0
    stats = strategy.staleness_stats()
    worker_steps = stats.worker_steps - s0.worker_steps
    resumed = backup.resumed(total, cfg.epochs, say)
    recovered = backup.summary()
    if recovered is not None:
        recovered["stream_start_batch"] = backup.resume_step
    probs = _predict(model, x_test)
    examples = worker_steps * cfg.batch_size
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
        "scheduled_steps": int(max(0, total - resumed)),
        "retried_closures": int(stats.retried_closures),
        "worker_failures": int(stats.worker_failures),
        "recovery": recovered,
        "steps_per_sec": worker_steps / train_s,
        "examples_per_sec": examples / train_s,
        "train_time_s": train_s,
        "steady_steps_per_sec": job.steady_rate(logger.epochs),
        # The chief's CPU while fit ran (scheduling, the coordinator's threads).
        "chief_cpu_s": chief_cpu,
        "chief_cpu_s_per_example": chief_cpu / examples if examples else None,
        **_quality(y_test, probs, planted),
        "sharded_variables": job.sharding(model),
        "optimizer_iterations": int(model.optimizer.iterations.numpy()),
        "mixed_precision": precision,
        "keras": k.__version__,
        "ctr": cfg.summary(data),
        "staleness": stats.to_dict(),
        "epoch_log": logger.epochs,
        "wall_time_s": time.perf_counter() - t_job,
    }
    say(f"{_line(metrics)}  {metrics['examples_per_sec']:.0f} examples/s  "
        f"tau mean {stats.mean:.2f} max {stats.max}  applied {stats.applied} "
        f"dropped {stats.dropped}")
    metrics["warnings"] = [w for w in (job.dropped_warning(metrics["staleness"]),) if w]
    for w in metrics["warnings"]:
        say(w)
    if cfg.output_dir:
        os.makedirs(cfg.output_dir, exist_ok=True)
        metrics["wall_time_s"] = time.perf_counter() - t_job
        recovery.atomic_write_json(os.path.join(cfg.output_dir, "metrics.json"), metrics)
        say(f"wrote {cfg.output_dir}/metrics.json, tensorboard/")
    return metrics


def run_reference(cfg: CtrConfig, print_fn=None) -> Dict[str, Any]:
    """The same model trained in one process: plain ``model.fit`` for
    ``epochs x steps_per_epoch`` steps of ``batch_size`` examples (as many as
    the cluster's workers make together) on worker 0's stream, evaluated on
    the same held-out split. Writes ``OUTPUT_DIR_reference/metrics.json``.

    Raises:
      ValueError: bad settings.
    """
    t_job = time.perf_counter()
    cfg.validate()
    say = print_fn or (lambda s: print(s, flush=True))
    data = _data(cfg)
    k = models.keras_module(cfg.keras)
    k.utils.set_random_seed(cfg.seed)
    model = _build(cfg, k)
    _compile(model, job.make_optimizer(cfg.optimizer, cfg.learning_rate, k), cfg, k)
    say(f"reference: dlrm ({cfg.ctr_embedding}, {sum(data.rows):,} rows) in one process, "
        f"{cfg.epochs} epochs x {cfg.steps_per_epoch} steps of {cfg.batch_size} examples (no "
        "cluster: the policy, locking, worker, ps and partitioner flags do not apply)")
    x_test, y_test, planted = _held_out(cfg, data)
    callbacks = [DynamicEviction()] if cfg.ctr_embedding in ctr_model.RAW_ID_EMBEDDINGS else []
    t0, c0 = time.perf_counter(), time.process_time()
    model.fit(data.dataset(ctr_data.train_stream(0), cfg.batch_size), epochs=cfg.epochs,
              steps_per_epoch=cfg.steps_per_epoch, verbose=0, callbacks=callbacks)
    train_s, cpu = time.perf_counter() - t0, time.process_time() - c0
    steps = cfg.epochs * cfg.steps_per_epoch
    probs = _predict(model, x_test)
    metrics = {"policy": "single_process", "num_workers": 0, "num_ps": 0,
               "epochs": cfg.epochs, "steps_per_epoch": cfg.steps_per_epoch,
               "batch_size": cfg.batch_size, "worker_steps": steps,
               "steps_per_sec": steps / train_s,
               "examples_per_sec": steps * cfg.batch_size / train_s,
               "train_time_s": train_s, "cpu_s": cpu,
               "cpu_s_per_example": cpu / (steps * cfg.batch_size),
               **_quality(y_test, probs, planted), "keras": k.__version__,
               "ctr": cfg.summary(data), "wall_time_s": time.perf_counter() - t_job}
    say(f"reference: {_line(metrics)}  {metrics['examples_per_sec']:.0f} examples/s")
    if cfg.output_dir:
        out = job.reference_dir(cfg.output_dir)
        os.makedirs(out, exist_ok=True)
        recovery.atomic_write_json(os.path.join(out, "metrics.json"), metrics)
        say(f"wrote {out}/metrics.json")
    return metrics
