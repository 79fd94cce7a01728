"""What StepBackup costs on a cluster (docs/benchmarks.md, issue 41 item 4):
training steps/s of the CTR job's model with step backups on against off, and
the seconds and bytes of each backup (full or delta).

    python scripts/backup_cost.py --ctr_max_rows=100000 --order=off,on,off,on \
        --steps_per_epoch=1000 --epochs=3 --every_steps=200 --full_every=10

Starts one LocalCluster (2 ps, 2 workers on loopback; this process is the
chief) and, for each entry of ``--order``, trains a fresh model for
``epochs x steps_per_epoch`` worker steps with tf_keras ``fit`` under
AsyncParameterServerStrategy (policy async): the CTR job's DLRM at
configs/ctr.flags' settings (26 tables of 16 capped at ``--ctr_max_rows``
rows, Zipf 1.1 ids, Adagrad 0.2, 512 examples per step, 10 steps per closure,
tables split by MinSizePartitioner(256 KiB, 2 shards)). ``on`` adds
``tf_asyncps.callbacks.StepBackup(every_steps, full_every)`` into a temp
folder (removed after the run); ``off`` has none.

Prints one JSON line per run: ``steps_per_sec`` over the epochs after the
first (the first holds tracing and the first reads; with the defaults the
measured 2,000 steps hold 10 backups: 9 deltas and 1 full save, the steady
mix of full_every=10), ``fit_s``, ``loadavg_after`` and, for ``on``,
``train_begin_s`` (StepBackup's ``on_train_begin``: the optimizer's slots
built, the dirty marks registered on the ps) and one entry per backup:
``kind`` (full/delta), ``steps``, ``drain_s`` (``ClusterCoordinator.join``:
the workers finish the scheduled closures), ``write_s`` (the rest of
``backup_now``: a full save reads every table row and slot row from the ps
over the wire, a delta the marked rows; then pruning and progress.json),
``bytes`` on disk. A last line holds the medians, the write seconds by kind
and on/off of each pair of neighbouring runs (1-2, 3-4, ...). A run's rate
moves with the machine's load: interleave the modes and repeat. Run it under
both CPU slots (``/work/helpers/locked --exclusive``).
"""

import json
import os
import shutil
import statistics
import tempfile
import time

from absl import app, flags, logging

flags.DEFINE_integer("ctr_max_rows", 100_000, "Rows per categorical feature at most "
                     "(configs/ctr.flags: 100000, 840,543 rows; 1000000: 5.57M).", lower_bound=1)
flags.DEFINE_float("ctr_scale", 1.0, "Each feature's capped rows times this, in (0, 1].")
flags.DEFINE_list("order", ["off", "on"], "Runs in order, each 'off' or 'on'.")
flags.DEFINE_integer("steps_per_epoch", 1000, "Worker steps per epoch.", lower_bound=1)
flags.DEFINE_integer("epochs", 3, "Epochs per run; steps/s counts those after the first.",
                     lower_bound=2)
flags.DEFINE_integer("every_steps", 200, "StepBackup(every_steps).", lower_bound=1)
flags.DEFINE_integer("full_every", 10, "StepBackup(full_every).", lower_bound=1)
flags.DEFINE_integer("steps_per_execution", 10, "Worker steps per closure.", lower_bound=1)
flags.DEFINE_integer("seed", 0, "Data and initialisation seed.")
FLAGS = flags.FLAGS


def _bytes(folder):
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(folder) for f in fs)


def _one_run(strategy, data, rows, mode):
    """Trains one fresh model; returns the run's JSON dict."""
    import tensorflow as tf
    import tf_keras

    from tf_asyncps.app import bench_ctr, ctr_model
    from tf_asyncps.callbacks import StepBackup

    tf_keras.utils.set_random_seed(FLAGS.seed)
    with strategy.scope():
        model = ctr_model.build(rows, bench_ctr.DIM, bench_ctr.BOTTOM, bench_ctr.TOP,
                                FLAGS.seed, "tables", tf_keras)
        model.compile(optimizer=tf_keras.optimizers.Adagrad(bench_ctr.LEARNING_RATE),
                      loss=tf_keras.losses.BinaryCrossentropy(from_logits=True),
                      steps_per_execution=FLAGS.steps_per_execution)
    epochs = []

    class Epochs(tf_keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.t0 = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):  # fit joined the schedule before this
            epochs.append(time.perf_counter() - self.t0)

    backups = []
    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)

    setup = []

    class Timed(StepBackup):
        def on_train_begin(self, logs=None):  # restore, marks registered on the ps
            t0 = time.perf_counter()
            super().on_train_begin(logs)
            setup.append(time.perf_counter() - t0)

        def backup_now(self):
            t0 = time.perf_counter()
            coordinator.join()  # the drain StepBackup does first, timed apart
            t1 = time.perf_counter()
            path = super().backup_now()
            t2 = time.perf_counter()
            with open(os.path.join(path, "meta.json")) as f:
                kind = json.load(f).get("kind", "full")
            backups.append({"kind": kind, "steps": int(os.path.basename(path)[5:]),
                            "drain_s": t1 - t0, "write_s": t2 - t1, "bytes": _bytes(path)})
            return path

    callbacks = [Epochs()]
    folder = None
    if mode == "on":
        folder = tempfile.mkdtemp(prefix="backup_cost_")
        callbacks.append(Timed(folder, FLAGS.every_steps, full_every=FLAGS.full_every))
    dataset = tf_keras.utils.experimental.DatasetCreator(
        data.dataset_fn(bench_ctr.BATCH))
    t0 = time.perf_counter()
    try:
        model.fit(dataset, epochs=FLAGS.epochs, steps_per_epoch=FLAGS.steps_per_epoch,
                  callbacks=callbacks, verbose=0)
        fit_s = time.perf_counter() - t0
    finally:
        if folder:
            shutil.rmtree(folder, ignore_errors=True)
    steady = FLAGS.steps_per_epoch * (FLAGS.epochs - 1)
    with open("/proc/loadavg") as f:
        load = f.read().split()[0]
    return {"mode": mode, "steps_per_sec": steady / sum(epochs[1:]), "fit_s": fit_s,
            "epoch_s": epochs, "loadavg_after": float(load), "backups": backups,
            "train_begin_s": setup[0] if setup else None,
            "rows": int(sum(rows))}


def main(argv):
    del argv
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if not FLAGS["verbosity"].present:  # TensorFlow logs every join at INFO
        logging.set_verbosity(logging.WARNING)
    bad = [m for m in FLAGS.order if m not in ("off", "on")]
    if bad:
        raise app.UsageError(f"--order takes 'off' and 'on', got {bad}.")
    from tf_asyncps import cluster as cluster_lib
    from tf_asyncps.app import bench_ctr, ctr_data, job
    from tf_asyncps.strategy import AsyncParameterServerStrategy

    rows = ctr_data.table_rows(FLAGS.ctr_max_rows, FLAGS.ctr_scale)
    with cluster_lib.LocalCluster(num_workers=2, num_ps=bench_ctr.NUM_PS) as c:
        strategy = AsyncParameterServerStrategy(
            c.resolver(), update_policy="async",
            variable_partitioner=job.partitioner(bench_ctr.MIN_SHARD_BYTES, bench_ctr.NUM_PS))
        data = ctr_data.make(rows, bench_ctr.ZIPF_A, FLAGS.seed)
        runs = []
        for mode in FLAGS.order:
            runs.append(_one_run(strategy, data, rows, mode))
            print(json.dumps(runs[-1]), flush=True)
    rate = {m: [r["steps_per_sec"] for r in runs if r["mode"] == m] for m in ("off", "on")}
    # Non-overlapping neighbours (runs 1-2, 3-4, ...): on / off of each pair.
    pairs = []
    for a, b in zip(runs[0::2], runs[1::2]):
        if a["mode"] != b["mode"]:
            on, off = (a, b) if a["mode"] == "on" else (b, a)
            pairs.append(on["steps_per_sec"] / off["steps_per_sec"])
    summary = {m: statistics.median(v) for m, v in rate.items() if v}
    for kind in ("full", "delta"):
        secs = [b["write_s"] for r in runs for b in r["backups"] if b["kind"] == kind]
        if secs:
            summary[f"{kind}_write_s_median"] = statistics.median(secs)
            summary[f"{kind}_write_s_range"] = [min(secs), max(secs)]
    summary["on_over_off_pairs"] = pairs
    print(json.dumps({"summary": summary}), flush=True)


if __name__ == "__main__":
    app.run(main)
