"""Bytes of a delta backup and of a serving delta against a full save, for
one table under tf_keras Adagrad with Zipf ids (docs/benchmarks.md, issue 41
item 4), and the seconds each write takes. One process, no cluster.

    python scripts/delta_sizes.py --rows 1000000 --dim 16 --batch 512 \
        --every 200 --zipf 1.1 1.2

Per exponent: ``every`` steps of ``batch`` ids drawn by ctr_data's Zipf law
(the CTR job's) mark their rows as an update would; then a full save
(tf.train.Checkpoint of the table and its optimizer), a backup delta
(rows + slot rows, ModelDeltas's format) and a serving delta (rows only) are
written and their bytes on disk and wall seconds (the delta's: reading the
marks, gathering the rows and slot rows, writing, fsync, sha256) printed as
one JSON line.
"""

import argparse
import json
import os
import tempfile
import time

import numpy as np
import tensorflow as tf
import tf_keras

from tf_asyncps.app.ctr_data import zipf_probabilities
from tf_asyncps.callbacks import delta_chain
from tf_asyncps.compat.optimizers import slot


def _bytes(folder):
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(folder) for f in fs)


def measure(rows, dim, batch, every, a, seed=0):
    table = tf.Variable(tf.random.stateless_normal([rows, dim], seed=[seed, 1]))
    opt = tf_keras.optimizers.Adagrad()
    opt.build([table])
    reader = delta_chain.shared_reader([table], "sizes")
    rng = np.random.default_rng(seed)
    ids = rng.choice(rows, size=batch * every, p=zipf_probabilities(rows, a))
    reader.mark(tf.IndexedSlices(tf.zeros([len(ids), dim]), tf.constant(ids, tf.int64)), table)
    changed = reader.dirty_ids(table)
    acc = slot(opt, "accumulator", table)
    with tempfile.TemporaryDirectory() as root:
        t0 = time.perf_counter()
        tf.train.Checkpoint(t=table, o=opt).write(os.path.join(root, "full", "ckpt"))
        t1 = time.perf_counter()
        backup = delta_chain.write_delta(
            os.path.join(root, "delta"), base_id="b", seq=1,
            shards={"t0": delta_chain.gather_rows(table, reader.dirty_ids(table),
                                                  {"accumulator": acc})},
            dense={})
        t2 = time.perf_counter()
        serving = delta_chain.write_delta(
            os.path.join(root, "serving"), base_id="b", seq=1, kind="serving",
            shards={"t0": delta_chain.gather_rows(table, changed, {})}, dense={})
        full_b, delta_b, serving_b = (_bytes(os.path.join(root, "full")), _bytes(backup),
                                      _bytes(serving))
    return {"zipf": a, "rows": rows, "dim": dim, "steps": every, "ids": int(len(ids)),
            "rows_changed": int(changed.size), "share_changed": changed.size / rows,
            "full_bytes": full_b, "delta_bytes": delta_b, "serving_bytes": serving_b,
            "delta_over_full": delta_b / full_b, "serving_over_full": serving_b / full_b,
            "full_s": round(t1 - t0, 3), "delta_s": round(t2 - t1, 3)}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--batch", type=int, default=512, help="ids per step (one feature)")
    p.add_argument("--every", type=int, default=200, help="steps between saves")
    p.add_argument("--zipf", type=float, nargs="+", default=[1.1, 1.2])
    args = p.parse_args()
    for a in args.zipf:
        print(json.dumps(measure(args.rows, args.dim, args.batch, args.every, a)), flush=True)


if __name__ == "__main__":
    main()
