"""A large embedding table on 4 ps tasks: a Zipf-distributed id stream.

    python examples/zipf_embedding.py                      # 1M and 5M rows x 32
    python examples/zipf_embedding.py --rows=5000000 --steps=300
    python examples/zipf_embedding.py --drift_every=100 --num_ps=2 --batch_size=4096  # drift

With ``--drift_every=K`` it runs the drift stream instead (``zipf_drift.py``):
``--drift_ids`` possible ids whose popularity shifts every K steps, in a
``tf_asyncps.layers.DynamicEmbedding`` of ``--drift_capacity`` rows against
fixed tables; see that module's docstring.

For each table size (each in a fresh process: TensorFlow allows one cluster
per process) it starts a LocalCluster (``--num_ps`` ps, ``--num_workers``
workers), builds an ``Embedding(rows, dim)`` table split over the ps tasks by
``FixedShardsPartitioner`` and a Dense head, and trains it with ``async``
updates (``--optimizer``, default Adagrad) on batches of ids drawn from a Zipf law (exponent ``--zipf_a``; ids hashed
over the table, as real systems hash theirs, so the hot ids spread over the
shards). It prints one JSON line per size and a table:

* ``steps_per_sec``: worker steps per second after a warm-up fit (tracing);
* ``ps_rss_mb``: resident memory of each ps process after training (MB);
* ``rows_per_step``: distinct ids per batch, the rows each step gathers from
  and scatters to the ps tasks (mean over the batches);
* ``bytes_per_step``: loopback bytes sent per worker step, all tasks (KB).

The table is ``rows * dim * 4`` bytes (5M x 32: 610 MiB); Adagrad keeps one slot of
the same size. ``--optimizer=sgd`` (tf_keras's SGD) shows why the choice matters:
it updates every row on each step, so steps/s falls with the table.
"""

import json
import os
import subprocess
import sys
import time

from absl import app, flags

import zipf_drift  # the drift stream (its flags, --drift_*) and the RSS reader

flags.DEFINE_list("rows", ["1000000", "5000000"], "Table sizes (rows), one run each.")
flags.DEFINE_integer("dim", 32, "Embedding width (float32 columns).")
flags.DEFINE_integer("num_ps", 4, "ps tasks the table is split over.")
flags.DEFINE_integer("num_workers", 2, "Worker tasks.")
flags.DEFINE_integer("batch_size", 512, "Ids per worker step.")
flags.DEFINE_integer("steps", 300, "Measured worker steps (after 40 warm-up steps).")
flags.DEFINE_float("zipf_a", 1.2, "Zipf exponent of the id stream (> 1).")
flags.DEFINE_enum("optimizer", "adagrad", ["adagrad", "legacy_sgd", "sgd"],
                  "tf_keras optimizer (learning rate 0.1); sgd updates every row each step.")
flags.DEFINE_integer("drift_every", 0, "Drift stream: worker steps (of each worker) between "
                     "shifts of the id popularity; 0: the table-size runs above.", lower_bound=0)
flags.DEFINE_string("output", None, "Also write the results (a JSON list) here.")
flags.DEFINE_bool("child", False, "Internal: train the one --rows size in this process.")
FLAGS = flags.FLAGS

WARMUP = 40
SPE = 10  # steps per closure (steps_per_execution)


def _loopback_tx_bytes():
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name.strip() == "lo":
                return int(rest.split()[8])
    return 0


def zipf_ids(rows, n, a, seed=0):
    """``n`` int64 ids in [0, rows): Zipf ranks hashed over the table."""
    import numpy as np
    rng = np.random.RandomState(seed)
    ranks = rng.zipf(a, size=n).astype(np.uint64)
    return ((ranks * np.uint64(2654435761)) % np.uint64(rows)).astype(np.int64)


def run_one(rows):
    """Trains on one table size; returns its measurements (dict)."""
    import numpy as np
    import tensorflow as tf
    import tf_keras

    import tf_asyncps

    n = (WARMUP + FLAGS.steps) * FLAGS.batch_size * FLAGS.num_workers
    ids = zipf_ids(rows, n, FLAGS.zipf_a)
    y = ((ids % 7) / 7.0).astype(np.float32)[:, None]
    batches = ids[:FLAGS.steps * FLAGS.batch_size].reshape(-1, FLAGS.batch_size)
    rows_per_step = float(np.mean([len(np.unique(b)) for b in batches]))

    def dataset_fn(ctx):
        ds = tf.data.Dataset.from_tensor_slices((ids[:, None], y))
        ds = ds.shard(ctx.num_input_pipelines, ctx.input_pipeline_id)
        return ds.repeat().batch(FLAGS.batch_size)

    with tf_asyncps.cluster.LocalCluster(num_workers=FLAGS.num_workers,
                                         num_ps=FLAGS.num_ps) as cluster:
        strategy = tf_asyncps.AsyncParameterServerStrategy(
            cluster.resolver(), update_policy="async",
            variable_partitioner=tf.distribute.experimental.partitioners.
            FixedShardsPartitioner(FLAGS.num_ps))
        with strategy.scope():
            model = tf_keras.Sequential([
                tf_keras.Input(shape=(1,), dtype=tf.int64),
                tf_keras.layers.Embedding(rows, FLAGS.dim, embeddings_initializer=
                                          tf_keras.initializers.RandomUniform(-0.05, 0.05)),
                tf_keras.layers.Flatten(),
                tf_keras.layers.Dense(1)])
            optimizer = {"adagrad": tf_keras.optimizers.Adagrad,
                         "legacy_sgd": tf_keras.optimizers.legacy.SGD,
                         "sgd": tf_keras.optimizers.SGD}[FLAGS.optimizer](0.1)
            model.compile(optimizer, "mse", steps_per_execution=SPE)
        data = tf_keras.utils.experimental.DatasetCreator(dataset_fn)
        model.fit(data, epochs=1, steps_per_epoch=WARMUP, verbose=0)  # traces, warms up
        tx0, t0 = _loopback_tx_bytes(), time.perf_counter()
        model.fit(data, epochs=1, steps_per_epoch=FLAGS.steps, verbose=0)
        seconds = time.perf_counter() - t0
        tx = _loopback_tx_bytes() - tx0
        table = model.layers[0].embeddings
        shards = getattr(table, "variables", [table])
        result = {
            "rows": rows, "dim": FLAGS.dim, "num_ps": FLAGS.num_ps, "optimizer": FLAGS.optimizer,
            "num_workers": FLAGS.num_workers, "batch_size": FLAGS.batch_size,
            "table_mb": rows * FLAGS.dim * 4 / 2**20, "shards": len(shards),
            "steps": FLAGS.steps, "steps_per_sec": FLAGS.steps / seconds,
            "rows_per_step": rows_per_step, "bytes_per_step": tx / FLAGS.steps,
            "ps_rss_mb": {name: zipf_drift.rss_mb(pid) for name, pid in sorted(cluster.pids.items())
                          if name.startswith("ps:")},
            "global_step": strategy.staleness_stats().global_step
            if hasattr(strategy, "staleness_stats") else None}
    return result


def main(argv):
    del argv
    if FLAGS.drift_every:
        return zipf_drift.main(FLAGS, __file__)
    rows = [int(r) for r in FLAGS.rows]
    if any(r < 1 for r in rows) or FLAGS.zipf_a <= 1 or FLAGS.steps < 1:
        raise app.UsageError("--rows must be positive, --zipf_a > 1 and --steps >= 1.")
    if FLAGS.child:
        print("RESULT: " + json.dumps(run_one(rows[0])), flush=True)
        os._exit(0)  # the cluster is stopped: skip TensorFlow's teardown
    results = []
    for r in rows:  # one process per size: one cluster per process
        args = [a for a in sys.argv[1:] if not a.startswith(("--rows", "--output"))]
        out = subprocess.run([sys.executable, __file__, f"--rows={r}", "--child"] + args,
                             stdout=subprocess.PIPE, text=True, check=True).stdout
        results.append(json.loads(out.split("RESULT: ", 1)[1].splitlines()[0]))
        print(json.dumps(results[-1]), flush=True)
    print(f"{'rows':>10} {'table MiB':>9} {'steps/s':>8} {'rows/step':>10} "
          f"{'KB/step':>8}  RSS per ps task (MiB)")
    for r in results:
        rss = ", ".join(f"{v:.0f}" for v in r["ps_rss_mb"].values())
        print(f"{r['rows']:>10} {r['table_mb']:>9.0f} {r['steps_per_sec']:>8.1f} "
              f"{r['rows_per_step']:>10.1f} {r['bytes_per_step'] / 1024:>8.1f}  {rss}")
    if FLAGS.output:
        with open(FLAGS.output, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    app.run(main)
