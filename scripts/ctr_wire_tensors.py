"""Lists the tensors that cross between the worker and the ps tasks in one
CTR worker step, from the partitioned function graphs (issue 39 item 5).

The bench's ``NAME@ctr`` model (``tf_asyncps.app.bench_ctr``) is built
under this strategy (``async`` policy) in tf_keras (``async``) or Keras 3
(``keras3``), and fit for a few steps on a 1-worker, 2-ps cluster in this
process, with TensorFlow's graph dumper on (``TF_DUMP_GRAPH_PREFIX``): every
multi-device function a task instantiates is dumped, and its partitions hold
a ``_Send``/``_Recv`` pair for each tensor that crosses from one task to
another. Printed per run: each transfer between the worker and a ps (the
direction, the dtype, the tensor sent), grouped by what the sent op's name
says, with counts per step function; ``--diff`` prints the groups whose
counts differ between two runs.

Run through the shared CPU slots:
``/work/helpers/locked python scripts/ctr_wire_tensors.py --runs=async,keras3 --diff``.
"""

import argparse
import collections
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def _task(device):
    m = re.search(r"/job:(\w+)/replica:\d+/task:(\d+)", device or "")
    return f"{m.group(1)}:{m.group(2)}" if m else "?"


def transfers(dump_dir, name_filter):
    """[(function file, direction, dtype, sent tensor name)] of the dumped
    partitions whose file name contains ``name_filter``."""
    from google.protobuf import text_format
    import tensorflow as tf
    out = []
    for path in sorted(glob.glob(os.path.join(dump_dir, "*"))):
        base = os.path.basename(path)
        # The partitions as they run: the last dump stage of each.
        if (name_filter not in base or "_partition_" not in base
                or not base.endswith("after_partition_passes.pbtxt")):
            continue
        g = tf.compat.v1.GraphDef()
        with open(path, "rb") as f:
            data = f.read()
        try:
            g.ParseFromString(data)
        except Exception:  # pbtxt
            text_format.Parse(data.decode(), g)
        nodes = {n.name: n for n in g.node}
        for n in g.node:
            if n.op not in ("_Send", "_HostSend"):
                continue
            src, dst = _task(n.attr["send_device"].s.decode()), \
                _task(n.attr["recv_device"].s.decode())
            if src == dst:
                continue
            inp = n.input[0].split(":")[0].lstrip("^")
            what = nodes[inp].op if inp in nodes else "?"
            out.append((base, f"{src}->{dst}", tf.as_dtype(n.attr["T"].type).name,
                        f"{inp} ({what})"))
    return out


def _group(name):
    """A transfer's name with the numbers and shard suffixes taken out."""
    name = re.sub(r"^while/body/_\d+/while/", "", name)
    name = re.sub(r"dlrm(_\d+)?/", "dlrm/", name)  # the model's name
    name = re.sub(r"_\d+", "_N", name)
    name = re.sub(r"\d+", "N", name)
    return name


def child(run, dump_dir, steps, max_rows):
    """In a fresh process: fit ``steps`` worker steps of ``run`` with the dumper on."""
    os.environ["TF_DUMP_GRAPH_PREFIX"] = dump_dir
    os.environ["TF_DUMP_GRAPH_NAME_FILTER"] = "*"
    os.environ["TF_DUMP_GRAPH_GROUPS"] = "main"
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import tensorflow as tf
    import tf_asyncps
    from scenarios.common import in_process_cluster  # tests/scenarios
    from tf_asyncps import cluster as cluster_lib
    from tf_asyncps.app import bench_ctr as b, ctr_data, ctr_model, job, models

    rows = ctr_data.table_rows(max_rows, 1.0)
    _servers, resolver = in_process_cluster(1, num_ps=2)
    cluster_lib.configure_local_context(1)
    k = models.keras_module("3" if run == "keras3" else "tf_keras")
    strategy = tf_asyncps.AsyncParameterServerStrategy(
        resolver, update_policy="async",
        variable_partitioner=job.partitioner(b.MIN_SHARD_BYTES, b.NUM_PS))
    data = ctr_data.make(rows, b.ZIPF_A, 0)
    with strategy.scope():
        model = ctr_model.build(rows, b.DIM, b.BOTTOM, b.TOP, 0, "tables", k)
        model.compile(optimizer=k.optimizers.Adagrad(b.LEARNING_RATE),
                      loss=k.losses.BinaryCrossentropy(from_logits=True),
                      steps_per_execution=steps)
    dataset_fn = data.dataset_fn(b.BATCH)
    if models.is_keras3(k):
        from tf_asyncps.keras3 import DatasetFn
        fit_data = DatasetFn(dataset_fn)
    else:
        fit_data = k.utils.experimental.DatasetCreator(dataset_fn)
    model.fit(fit_data, epochs=1, steps_per_epoch=steps, verbose=0)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", default="async,keras3")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--max_rows", type=int, default=100_000)
    p.add_argument("--filter", default="train",
                   help="only dumped functions whose file name holds this")
    p.add_argument("--diff", action="store_true")
    p.add_argument("--keep", help="keep the dumps under this folder")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--dump", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        child(a.child, a.dump, a.steps, a.max_rows)
        return
    counts = {}
    for run in a.runs.split(","):
        dump = os.path.join(a.keep, run) if a.keep else tempfile.mkdtemp(prefix=f"wire_{run}_")
        os.makedirs(dump, exist_ok=True)
        subprocess.run([sys.executable, __file__, "--child", run, "--dump", dump,
                        "--steps", str(a.steps), "--max_rows", str(a.max_rows)], check=True)
        t = transfers(dump, a.filter)
        c = collections.Counter((d, dt, _group(n)) for _, d, dt, n in t)
        counts[run] = c
        print(f"== {run}: {len(t)} transfers between tasks in "
              f"{len({f for f, *_ in t})} partitions")
        for (d, dt, n), v in sorted(c.items()):
            print(f"  {v:4d}  {d:16s} {dt:8s} {n}")
        if not a.keep:
            shutil.rmtree(dump)
    if a.diff and len(counts) >= 2:
        x, y = list(counts)[:2]
        print(f"== {y} - {x}")
        for key in sorted(set(counts[x]) | set(counts[y])):
            d = counts[y][key] - counts[x][key]
            if d:
                print(f"  {d:+4d}  {key[0]:16s} {key[1]:8s} {key[2]}")


if __name__ == "__main__":
    main()
