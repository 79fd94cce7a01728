"""Counts the ops of one traced CTR worker step, by task (issue 39 item 4).

The bench's ``NAME@ctr`` model (``tf_asyncps.app.bench_ctr``: the DLRM on 26
tables, Adagrad, 512 examples, tables split by ``MinSizePartitioner(256 KiB,
max_shards=2)``) is built under vanilla ``ParameterServerStrategy`` and under
this strategy (``async``; ``--runs`` picks), and its ``train_step`` under
``strategy.run`` is traced in a ``tf.function`` as fit's step function calls
it. Printed per run: every op of the traced graph and of its function bodies
(cond branches, the ps-side functions) by the task it is placed on (``worker``
is every op with no ps device: it runs on the worker that runs the closure),
and with ``--by_type`` the op types whose counts differ most between the runs.

Starts a 2-ps, 1-worker cluster in this process (no step is run), so run it
through the shared CPU slots: ``/work/helpers/locked python scripts/ctr_step_ops.py``.
Numbers go to docs/benchmarks.md's op table.
"""

import argparse
import collections
import json
import os
import re
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))


def _task(device):
    m = re.search(r"/job:ps/replica:\d+/task:(\d+)", device or "")
    return f"ps:{m.group(1)}" if m else "worker"


def count(graph_def):
    """({task: ops}, {task: Counter(op type)}) of a graph and its functions."""
    nodes = list(graph_def.node) + [n for f in graph_def.library.function for n in f.node_def]
    by_type = collections.defaultdict(collections.Counter)
    for n in nodes:
        by_type[_task(n.device)][n.op] += 1
    return {t: sum(c.values()) for t, c in sorted(by_type.items())}, by_type


def trace(kind, resolver, rows, policy="async", embedding="tables", wire_dtype=None):
    import tensorflow as tf
    import tf_keras

    import tf_asyncps
    from tf_asyncps.app import bench_ctr as b, ctr_model, job

    part = job.partitioner(b.MIN_SHARD_BYTES, b.NUM_PS)
    if kind == "vanilla":
        strategy = tf.distribute.ParameterServerStrategy(resolver, variable_partitioner=part)
    else:
        strategy = tf_asyncps.AsyncParameterServerStrategy(
            resolver, update_policy=policy, variable_partitioner=part, wire_dtype=wire_dtype)
    with strategy.scope():
        model = ctr_model.build(rows, b.DIM, b.BOTTOM, b.TOP, 0, embedding, tf_keras)
        model.compile(optimizer=tf_keras.optimizers.Adagrad(b.LEARNING_RATE),
                      loss=tf_keras.losses.BinaryCrossentropy(from_logits=True))
        model.optimizer.build(model.trainable_variables)

    @tf.function
    def step(x, y):
        return strategy.run(model.train_step, args=((x, y),))

    spec = ({"dense": tf.TensorSpec([b.BATCH, 13], tf.float32),
             "sparse": tf.TensorSpec([b.BATCH, len(rows)], tf.int32)},
            tf.TensorSpec([b.BATCH, 1], tf.float32))
    return step.get_concrete_function(*spec).graph.as_graph_def()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--max_rows", type=int, default=100_000,
                   help="rows per feature at most (100000: 840,543 rows, 38 table shards)")
    p.add_argument("--runs", default="vanilla,async", help="comma list of vanilla, async")
    p.add_argument("--by_type", type=int, default=0,
                   help="print the N op types (by task) whose counts differ most between runs")
    p.add_argument("--json", help="write {run: {task: ops}} here")
    p.add_argument("--dump", help="write each run's GraphDef to DUMP/RUN.pb (to read offline)")
    a = p.parse_args()

    from scenarios.common import in_process_cluster  # tests/scenarios
    from tf_asyncps.app import ctr_data
    from tf_asyncps import cluster as cluster_lib

    rows = ctr_data.table_rows(a.max_rows, 1.0)
    _servers, resolver = in_process_cluster(1, num_ps=2)
    cluster_lib.configure_local_context(1)
    out, types = {}, {}
    for run in a.runs.split(","):
        graph_def = trace(run, resolver, rows)
        if a.dump:
            os.makedirs(a.dump, exist_ok=True)
            with open(os.path.join(a.dump, f"{run}.pb"), "wb") as f:
                f.write(graph_def.SerializeToString())
        totals, types[run] = count(graph_def)
        out[run] = dict(totals, total=sum(totals.values()))
        print(run, json.dumps(out[run]), flush=True)
    if a.by_type and len(types) >= 2:
        first, last = list(types)[0], list(types)[-1]
        diff = collections.Counter()
        for task in set(types[first]) | set(types[last]):
            for op in set(types[first][task]) | set(types[last][task]):
                diff[(task, op)] = types[last][task][op] - types[first][task][op]
        for (task, op), d in sorted(diff.items(), key=lambda kv: -abs(kv[1]))[:a.by_type]:
            print(f"  {task:7s} {op:28s} {last} - {first}: {d:+d}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
