"""What crosses the wire in a cached embedding step (issue 40's bytes target).

Runs the bench's embedding model (``Embedding(1_000_000, 32)`` on 2 ps,
``Dense(1)``, Adagrad(0.1), mse, tf_keras ``fit``, 16 steps per closure, 512
ids per step from the cache sweep's truncated Zipf stream) on a loopback
``LocalCluster`` of 1 worker and 2 ps, uncached and cached, and reports per
measured worker step:

* the worker's socket payload (``ss``, headers excluded) by peer (each ps,
  the chief), sent and received;
* the tensors received across tasks (TensorFlow's rendezvous, logged by
  ``TF_CPP_VMODULE=base_rendezvous_mgr=1`` in every task): one RecvTensor
  message each, counted by edge name and receiving task;
* the cache's counters (``cache_stats()``): distinct ids, rows pulled and
  pushed.

Run through the shared CPU slots:
``/work/helpers/locked python scripts/cache_wire.py --runs=uncached,cached``.
"""

import argparse
import collections
import json
import os
import re
import sys
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "0")

_KEY = re.compile(r"(/job:\w+/replica:\d+/task:\d+)/device:CPU:0;[0-9a-f]+;"
                  r"(/job:\w+/replica:\d+/task:\d+)/device:CPU:0;([^;]+);(\d+):(\d+)")


def rendezvous(log_dir, names, start):
    """{(src, dst, edge): count} of the rendezvous keys logged since byte
    offsets ``start`` ({name: offset}) in each task's log; and the new offsets."""
    out, ends = collections.Counter(), {}
    for n in names:
        path = os.path.join(log_dir, n.replace(":", "-") + ".log")
        with open(path, "rb") as f:
            f.seek(start.get(n, 0))
            data = f.read().decode("utf-8", "replace")
            ends[n] = f.tell()
        for line in data.splitlines():
            if "RemoteRendezvous Recv" not in line:  # one per tensor a task receives
                continue
            m = _KEY.search(line)
            if not m:
                continue
            src, dst = (x.split("/")[1][4:] + ":" + x.split("task:")[1]
                        for x in (m.group(1), m.group(2)))
            if src != dst:
                out[(src, dst, re.sub(r"^edge_\d+_", "", m.group(3)))] += 1
    return out, ends


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", default="uncached,cached")
    p.add_argument("--zipf", type=float, default=1.2)
    p.add_argument("--rows_pct", type=float, default=5.0)
    p.add_argument("--bound", type=int, default=5)
    p.add_argument("--steps", type=int, default=64, help="measured steps (after 64 warm-up)")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--dump", help="write each run's traced train function to DUMP.RUN.pbtxt")
    p.add_argument("--edges", type=int, default=60, help="print this many edge names per run")
    a = p.parse_args()

    log_dir = tempfile.mkdtemp(prefix="cache_wire_")
    from tf_asyncps.cluster import LocalCluster
    cluster = LocalCluster(num_workers=1, num_ps=2, log_dir=log_dir,
                           env={"TF_CPP_VMODULE": "base_rendezvous_mgr=1,rendezvous_mgr=1",
                                "TF_CPP_MIN_LOG_LEVEL": "0"}).start()
    try:
        results = {}
        for run in a.runs.split(","):
            results[run] = one(cluster, run, a)
            print(json.dumps({run: {k: v for k, v in results[run].items() if k != "edges"}}),
                  flush=True)
            for (src, dst, edge), n in sorted(results[run]["edges"].items(),
                                             key=lambda kv: -kv[1])[:a.edges]:
                print(f"  {src:9s} -> {dst:9s} {n:7.2f}/step  {edge}")
        if a.json:
            with open(a.json, "w") as f:
                json.dump({r: dict(v, edges={" ".join(k): n for k, n in v["edges"].items()})
                           for r, v in results.items()}, f, indent=1)
    finally:
        cluster.stop()


def one(cluster, run, a):
    import numpy as np
    import tensorflow as tf
    import tf_keras

    import tf_asyncps
    from tf_asyncps import cluster as cluster_lib
    from tf_asyncps import policies
    from tf_asyncps.app import bench_emb as b
    from tf_asyncps.app.bench_ctr import socket_bytes

    ids = b.id_stream(0, batches=b.SWEEP_STREAM_BATCHES, a=a.zipf, truncated=True)
    labels = (ids % 2).astype(np.float32)

    def dataset_fn(ctx):
        ds = tf.data.Dataset.from_tensor_slices((ids.reshape(-1, 1), labels.reshape(-1, 1)))
        return ds.batch(b.BATCH, drop_remainder=True).repeat().prefetch(2)

    cluster_lib.configure_local_context(1)
    cache = None
    if run == "cached":
        cache = tf_asyncps.EmbeddingCache(int(b.ROWS * a.rows_pct / 100), a.bound, a.bound)
    part = tf.distribute.experimental.partitioners.FixedShardsPartitioner(b.NUM_PS)
    strategy = tf_asyncps.AsyncParameterServerStrategy(
        cluster.resolver(), update_policy=policies.get("async"), variable_partitioner=part,
        deduplicate_lookups=True, embedding_cache=cache)
    tf_keras.utils.set_random_seed(0)
    with strategy.scope():
        model = tf_keras.Sequential([
            tf_keras.Input([1], dtype="int64"), tf_keras.layers.Embedding(b.ROWS, b.DIM),
            tf_keras.layers.Flatten(), tf_keras.layers.Dense(1)])
        model.compile(tf_keras.optimizers.Adagrad(0.1), "mse", steps_per_execution=16)
    names = cluster.task_names
    pids = {n: pid for n, pid in cluster.pids.items()}
    marks = {}

    def snapshot():
        """{(other end's task, sent|recv): bytes} of worker:0's sockets."""
        every = socket_bytes(list(pids.values()) + [os.getpid()])
        owner = {local: pid for (pid, local, _peer) in every}
        name = {pid: n for n, pid in pids.items()}
        name[os.getpid()] = "chief"
        per = collections.Counter()
        for (pid, local, peer), (sent, recv) in every.items():
            if pid != pids["worker:0"]:
                continue
            other = name.get(owner.get(peer), "?")
            per[(other, "sent")] += sent
            per[(other, "recv")] += recv
        return per

    class Probe(tf_keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            stats = strategy.cache_stats() if cache else {}
            tot = collections.Counter()
            for t in stats.values():
                for k, v in t.items():
                    if isinstance(v, int):
                        tot[k] += v
            _, ends = rendezvous(cluster.log_dir, names, {})
            marks[epoch] = (snapshot(), ends, tot)
            marks["loss"] = float((logs or {}).get("loss", float("nan")))

    steps = a.steps
    model.fit(tf_keras.utils.experimental.DatasetCreator(dataset_fn), epochs=2,
              steps_per_epoch=steps, verbose=0, callbacks=[Probe()])
    if a.dump:
        concrete = model.train_tf_function._list_all_concrete_functions()
        with open(f"{a.dump}.{run}.pbtxt", "w") as f:
            for c in concrete:
                f.write(str(c.graph.as_graph_def()))
    (b0, e0, s0), (b1, e1, s1) = marks[0], marks[1]
    edges, _ = rendezvous(cluster.log_dir, names, e0)
    bytes_by_peer = collections.defaultdict(lambda: [0.0, 0.0])
    for (peer, kind), v in b1.items():
        d = v - b0.get((peer, kind), 0)
        bytes_by_peer[peer][0 if kind == "sent" else 1] += d / steps
    ds = {k: (s1[k] - s0[k]) / steps for k in s1}
    return {"bytes_per_step": {k: [round(x, 1) for x in v] for k, v in bytes_by_peer.items()},
            "total": round(sum(sum(v) for v in bytes_by_peer.values()), 1),
            "cache_per_step": {k: round(v, 2) for k, v in ds.items()},
            "loss": marks["loss"], "kernel": float(model.layers[-1].kernel.numpy().sum()),
            "messages_per_step": round(sum(edges.values()) / steps, 2),
            "edges": {k: v / steps for k, v in edges.items()}}


if __name__ == "__main__":
    sys.exit(main())
