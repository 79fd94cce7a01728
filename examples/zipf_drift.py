"""The drift stream of ``zipf_embedding.py --drift_every=K``: ids whose
popularity shifts, in a DynamicEmbedding of fixed capacity vs fixed tables.

    python examples/zipf_embedding.py --drift_every=100 --num_ps=2 --batch_size=4096 \\
        --drift_repeats=2 --output=drift.json

(2,400 worker steps of 4,096 draws: about 1.6M distinct ids, so the 1M-row
table fills after ~1,800 steps and evicts from then on.)

The stream: ``--drift_ids`` possible ids (default 10M). Worker ``w``'s batch
``i`` holds ``--batch_size`` draws of a Zipf-like rank r = 1, 2, ...
(P(rank >= r) = r^-(a-1), a discretised Pareto law, ``--zipf_a``) made on the
worker (stateless random, seeded by (w, i)); rank r in phase
p = i // K is the id ``hash((r - 1 + p * --drift_shift) mod ids)``
(Knuth's multiplicative hash, a permutation of the ids). So every K steps
the ranking rotates: the ``--drift_shift`` hottest ids go cold for good and
every other id climbs that many ranks. Each id has a fixed binary label
(a bit of a second hash): the model must remember ids, and an id it has no
row for can only be guessed (logit = the bias).

Each table runs in a fresh process (one cluster per process), on
``--num_workers`` workers and ``--num_ps`` ps tasks (table split by
``FixedShardsPartitioner``), async updates, Adagrad(0.1), logistic loss,
``Embedding -> Dense(1)``:

* ``dynamic``: ``tf_asyncps.layers.DynamicEmbedding(dim, capacity=
  --drift_capacity, eviction="lfu", evict_every=--drift_evict_every,
  min_count=--drift_min_count)`` on the raw ids;
* ``hashed``: ``Embedding(--drift_capacity, dim)`` on ``id mod capacity``
  (the usual fixed-memory answer: colliding ids share a row);
* ``fixed``: ``Embedding(--drift_ids, dim)``, a row for every possible id
  (10M x 32 float32 = 1.2 GiB, and as much again for Adagrad's slot).

Every ``--drift_segment`` worker steps it records: the training loss of the
segment (each batch's loss before its update: progressive validation on the
live stream, new ids included); AUC and log loss on 4,096 fresh draws of the
stream as it was half a phase back (batch index steps / workers - K / 2, a
seed apart from training's; the same draws for every table); the
resident memory (VmRSS) of each ps process; and the DynamicEmbedding's live
rows, evictions and refusals. ``steps_per_sec`` is over the segments after
the first (tracing). A JSON line per run; ``--output`` writes them all.
"""

import json
import os
import subprocess
import sys
import time

from absl import flags

flags.DEFINE_integer("drift_ids", 10_000_000, "Drift stream: possible ids.", lower_bound=2)
flags.DEFINE_integer("drift_capacity", 1_000_000, "Drift stream: rows of the dynamic and the "
                     "hashed table.", lower_bound=1)
flags.DEFINE_integer("drift_shift", 100_000, "Drift stream: ranks the ranking rotates by "
                     "at each shift.", lower_bound=1)
flags.DEFINE_integer("drift_steps", 2400, "Drift stream: worker steps (all workers).",
                     lower_bound=1)
flags.DEFINE_integer("drift_segment", 200, "Drift stream: worker steps between measurements.",
                     lower_bound=1)
flags.DEFINE_integer("drift_evict_every", 20, "Drift stream: the DynamicEmbedding's "
                     "evict_every (global steps).", lower_bound=1)
flags.DEFINE_integer("drift_min_count", 1, "Drift stream: the DynamicEmbedding's min_count "
                     "(steps an id is seen in before it gets a row).", lower_bound=1)
flags.DEFINE_list("drift_tables", ["dynamic", "fixed"],
                  "Drift stream: tables to run (dynamic, hashed, fixed).")
flags.DEFINE_integer("drift_repeats", 1, "Drift stream: runs of each table (interleaved).",
                     lower_bound=1)
flags.DEFINE_string("drift_table", None, "Internal: the one table this process trains.")

TABLES = ("dynamic", "hashed", "fixed")
EVAL_SEED, EVAL_SIZE = 999_983, 4096
_PERM, _LABEL = 2654435761, 1481765933


def stream(tf, index, worker, size, F, seed=0):
    """int64 ids [size] and float32 labels [size, 1] of batch ``index`` of
    ``worker`` (phase ``index // F.drift_every``); see the module docstring."""
    index = tf.cast(index, tf.int64)
    u = tf.random.stateless_uniform([size], seed=tf.stack([seed * 1000 + worker, index]),
                                    dtype=tf.float64)
    rank = tf.floor(tf.pow(1.0 - u, -1.0 / (F.zipf_a - 1.0)))  # 1, 2, ... heavy tail
    rank = tf.cast(tf.minimum(rank, 1e15), tf.int64)
    pos = (rank - 1 + (index // F.drift_every) * F.drift_shift) % F.drift_ids
    ids = pos * _PERM % F.drift_ids  # < 2**63: ids < 2**24 here
    labels = tf.cast((ids * _LABEL // 8192) % 2, tf.float32)[:, None]
    return ids, labels


def rss_mb(pid):
    """Resident memory of process ``pid`` (MB), from /proc/PID/status."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def run_table(F, table):
    """Trains ``table`` on the drift stream; returns its measurements."""
    import numpy as np
    import tensorflow as tf
    import tf_keras
    from sklearn.metrics import roc_auc_score

    import tf_asyncps
    from tf_asyncps.layers import DynamicEmbedding

    def dataset_fn(ctx):
        w = ctx.input_pipeline_id
        ds = tf.data.Dataset.range(10**9).map(
            lambda i: stream(tf, i, w, F.batch_size, F))
        if table == "hashed":
            ds = ds.map(lambda ids, y: (ids % F.drift_capacity, y))
        return ds.map(lambda ids, y: (ids[:, None], y)).prefetch(2)

    init = tf_keras.initializers.RandomUniform(-0.05, 0.05, seed=0)
    with tf_asyncps.cluster.LocalCluster(num_workers=F.num_workers,
                                         num_ps=F.num_ps) as cluster:
        strategy = tf_asyncps.AsyncParameterServerStrategy(
            cluster.resolver(), update_policy="async",
            variable_partitioner=tf.distribute.experimental.partitioners.
            FixedShardsPartitioner(F.num_ps))
        ps = {n: pid for n, pid in sorted(cluster.pids.items()) if n.startswith("ps:")}
        rss_start = {n: rss_mb(p) for n, p in ps.items()}
        t_build = time.perf_counter()
        with strategy.scope():
            if table == "dynamic":
                emb = DynamicEmbedding(F.dim, capacity=F.drift_capacity, eviction="lfu",
                                       evict_every=F.drift_evict_every,
                                       min_count=F.drift_min_count, initializer=init)
            else:
                emb = tf_keras.layers.Embedding(
                    F.drift_capacity if table == "hashed" else F.drift_ids, F.dim,
                    embeddings_initializer=init)
            model = tf_keras.Sequential([tf_keras.Input([1], dtype=tf.int64), emb,
                                         tf_keras.layers.Flatten(), tf_keras.layers.Dense(1)])
            model.compile(tf_keras.optimizers.Adagrad(0.1),
                          tf_keras.losses.BinaryCrossentropy(from_logits=True),
                          steps_per_execution=10)
        build_s = time.perf_counter() - t_build
        segments = []

        class Probe(tf_keras.callbacks.Callback):
            def on_epoch_begin(self, epoch, logs=None):
                self.t0 = time.perf_counter()

            def on_epoch_end(self, epoch, logs=None):
                seconds = time.perf_counter() - self.t0
                done = (epoch + 1) * F.drift_segment
                # Each worker made about done / workers steps; draws from half
                # a phase back: traffic both workers trained on (at a phase's
                # first batches the result would hang on which worker led).
                index = max(0, done // F.num_workers - F.drift_every // 2)
                ids, y = stream(tf, index, 0, EVAL_SIZE, F, seed=EVAL_SEED)
                x = ids % F.drift_capacity if table == "hashed" else ids
                logits = model(x[:, None], training=False).numpy()[:, 0]
                y = y.numpy()[:, 0]
                p = 1 / (1 + np.exp(-logits))
                seg = {"worker_steps": done, "phase": int(index // F.drift_every),
                       "seconds": seconds, "train_loss": float(logs["loss"]),
                       "eval_auc": float(roc_auc_score(y, logits)),
                       "eval_loss": float(-np.mean(y * np.log(p + 1e-12) +
                                                   (1 - y) * np.log(1 - p + 1e-12))),
                       "ps_rss_mb": {n: round(rss_mb(pid), 1) for n, pid in ps.items()}}
                if table == "dynamic":
                    seg.update(emb.stats())
                segments.append(seg)
                print("SEGMENT " + json.dumps(seg), flush=True)

        n = max(2, F.drift_steps // F.drift_segment)
        model.fit(tf_keras.utils.experimental.DatasetCreator(dataset_fn), epochs=n,
                  steps_per_epoch=F.drift_segment, verbose=0, callbacks=[Probe()])
    later = segments[1:]
    return {"table": table, "ids": F.drift_ids, "capacity": F.drift_capacity,
            "rows": {"dynamic": F.drift_capacity, "hashed": F.drift_capacity,
                     "fixed": F.drift_ids}[table],
            "dim": F.dim, "batch_size": F.batch_size, "num_workers": F.num_workers,
            "num_ps": F.num_ps, "drift_every": F.drift_every, "drift_shift": F.drift_shift,
            "evict_every": F.drift_evict_every if table == "dynamic" else None,
            "min_count": F.drift_min_count if table == "dynamic" else None,
            "zipf_a": F.zipf_a, "build_s": build_s, "ps_rss_start_mb": rss_start,
            "steps_per_sec": len(later) * F.drift_segment / sum(s["seconds"] for s in later),
            "segments": segments}


def _check(F):
    bad = [t for t in F.drift_tables if t not in TABLES]
    if bad:
        raise ValueError(f"--drift_tables={','.join(F.drift_tables)}: {bad[0]!r} is unknown; "
                         f"choose from {', '.join(TABLES)}.")
    if F.zipf_a <= 1:
        raise ValueError(f"--zipf_a must be > 1, got {F.zipf_a}.")


def main(F, script):
    """Runs each table ``--drift_repeats`` times (interleaved), each in a
    child process; prints a summary; writes ``--output``."""
    _check(F)
    if F.drift_table:
        print("RESULT: " + json.dumps(run_table(F, F.drift_table)), flush=True)
        os._exit(0)  # the cluster is stopped: skip TensorFlow's teardown
    results = []
    args = [a for a in sys.argv[1:] if not a.startswith(("--drift_tables", "--output",
                                                         "--drift_repeats"))]
    for repeat in range(F.drift_repeats):
        for table in F.drift_tables:
            out = subprocess.run([sys.executable, script, f"--drift_table={table}"] + args,
                                 stdout=subprocess.PIPE, text=True, check=True).stdout
            r = json.loads(out.split("RESULT: ", 1)[1].splitlines()[0])
            r["repeat"] = repeat
            results.append(r)
            print(json.dumps(r), flush=True)
    print(f"{'table':>8} {'rows':>9} {'steps/s':>8} {'last AUC':>8} {'last loss':>9} "
          f"{'live rows':>9}  ps RSS MiB: start, first segment, last")
    for r in results:
        first, last = r["segments"][0], r["segments"][-1]
        rss = "; ".join(f"{r['ps_rss_start_mb'][n]:.0f}, {first['ps_rss_mb'][n]:.0f}, "
                        f"{last['ps_rss_mb'][n]:.0f}" for n in sorted(last["ps_rss_mb"]))
        print(f"{r['table']:>8} {r['rows']:>9} {r['steps_per_sec']:>8.1f} "
              f"{last['eval_auc']:>8.4f} {last['eval_loss']:>9.4f} "
              f"{last.get('live_rows', '-'):>9}  {rss}")
    if F.output:
        with open(F.output, "w") as f:
            json.dump(results, f, indent=1)
