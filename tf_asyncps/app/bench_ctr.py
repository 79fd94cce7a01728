"""The bench's CTR workload (runs NAME@ctr, ``--bench_only=ctr``).

The CTR job's DLRM (:mod:`tf_asyncps.app.ctr_model`) on its generated
Criteo-shaped clicks (:mod:`tf_asyncps.app.ctr_data`): the 26 Criteo Kaggle
cardinalities capped at ``--bench_ctr_max_rows`` (default 1,000,000: the
issue's 5.57M rows) and multiplied by ``--bench_ctr_scale`` (default 1),
Zipf(1.1) ids, rows of 16, bottom MLP 64-16, top MLP 256-128-1, Adagrad(0.2),
512 examples per worker step, 2 workers and 2 ps, tables split by
``MinSizePartitioner(256 KiB, max_shards=2)``. The runs (CTR_RUNS):

* ``single@ctr``: the model in one process, no cluster;
* ``vanilla@ctr``: ``tf.distribute.ParameterServerStrategy``, 26 tables;
* ``vanilla_one_table@ctr``: the same, one table read at offset ids;
* ``async@ctr``, ``async_one_table@ctr``: this strategy, policy ``async``;
* ``async_bf16@ctr``: ``async`` with ``wire_dtype="bfloat16"``;
* ``best@ctr``: ``EmbeddingCollection`` + ``route(sparse="async",
  dense=LocalSteps(16, exchange="mean"))`` + bfloat16 on the wire (the ps
  averages the workers' dense deltas: docs/guides/ctr.md, "Dense layers on
  local steps: sum or mean");
* ``keras3@ctr``: ``async@ctr``'s model and optimizer in Keras 3.

Per run, over the steps after the first segment (which holds tracing):

* CPU seconds per worker step of each task (``/proc/PID/stat`` utime +
  stime of the chief, each ps and each worker process; the one process for
  ``single@ctr``) and of all of them;
* bytes per worker step: on loopback the TCP payload bytes of the workers'
  own sockets (``ss``'s per-connection ``bytes_sent`` + ``bytes_received``,
  kernel counters); with ``--bench_hosts=netns`` the workers' link counters
  (headers included). Beside it the limit (:func:`limit_bytes_per_step`);
* steps/s, and held-out AUC and log loss on the CTR job's held-out split
  after the run (every run trains on the same number of examples).
"""

import os
import re
import subprocess
import time
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

__all__ = ["BATCH", "NUM_PS", "DIM", "BOTTOM", "TOP", "ZIPF_A", "LEARNING_RATE",
           "MIN_SHARD_BYTES", "SYNC_EVERY", "TEST_EXAMPLES", "CTR_RUNS", "CTR_VARIANTS",
           "ctr_configs",
           "expand_only", "dense_params", "limit_bytes_per_step", "distinct_ids_per_step",
           "task_cpu_seconds", "socket_bytes", "run_one"]

BATCH, NUM_PS, DIM, BOTTOM, TOP = 512, 2, 16, (64,), (256, 128)
ZIPF_A, LEARNING_RATE, MIN_SHARD_BYTES = 1.1, 0.2, 256 * 1024
#: best@ctr's dense part: exchanged every SYNC_EVERY local steps.
SYNC_EVERY = 16
TEST_EXAMPLES = 65536
#: Batches of each worker's stream whose distinct ids give the limit.
LIMIT_BATCHES = 32
CTR_RUNS = ("single@ctr", "vanilla@ctr", "vanilla_one_table@ctr", "async@ctr",
            "async_one_table@ctr", "async_bf16@ctr", "best@ctr", "keras3@ctr")
#: Variants, by name only (not in ``ctr``): of async@ctr, where its CPU goes
#: (without lookup de-duplication, without the non-finite check); of
#: best@ctr, one lever off each (which lever costs held-out AUC): without
#: bfloat16, without LocalSteps (the collection under ``async`` + bfloat16);
#: best@ctr with LocalSteps's default exchange, the sum (the ps adds each
#: worker's dense delta, not delta / num_workers).
CTR_VARIANTS = ("async_nodedup@ctr", "async_nocheck@ctr", "best_f32@ctr",
                "collection_bf16@ctr", "best_sum@ctr")
_ID_BYTES, _FLOAT_BYTES = 8, 4


def ctr_configs(num_workers: int = 2, steps_per_execution: int = 16, max_rows: int = 1_000_000,
                scale: float = 1.0, hosts: bool = False) -> List[Dict[str, Any]]:
    """Every CTR run (CTR_RUNS, then CTR_VARIANTS; see the module docstring)
    as bench run dicts (``model="ctr"``, 2 ps; ``single@ctr`` without a cluster)."""
    from tf_asyncps.validate import check_int
    check_int(max_rows, "--bench_ctr_max_rows", min=1, hint="rows per feature at most")
    if not 0 < scale <= 1:
        raise ValueError(f"--bench_ctr_scale must be in (0, 1] (a fraction of each feature's "
                         f"rows), got {scale!r}.")
    base = {"model": "ctr", "num_workers": num_workers, "num_ps": NUM_PS, "hosts": hosts,
            "locking": False, "spe": steps_per_execution, "batch": BATCH,
            "max_rows": max_rows, "scale": scale, "embedding": "tables", "keras": "tf_keras"}
    pol = dict(base, kind="policy", policy="async", policy_args={})
    # best@ctr's policy: tables async, the dense part on local steps, averaged.
    best = dict(pol, embedding="collection", policy="route",
                policy_args={"sparse": "async", "local_steps": SYNC_EVERY, "exchange": "mean"})
    return [dict(base, name="single@ctr", kind="single", num_workers=0, num_ps=0),
            dict(base, name="vanilla@ctr", kind="vanilla"),
            dict(base, name="vanilla_one_table@ctr", kind="vanilla", embedding="offset"),
            dict(pol, name="async@ctr"),
            dict(pol, name="async_one_table@ctr", embedding="offset"),
            dict(pol, name="async_bf16@ctr", wire_dtype="bfloat16"),
            dict(best, name="best@ctr", wire_dtype="bfloat16"),
            dict(pol, name="keras3@ctr", keras="3"),
            dict(pol, name="async_nodedup@ctr", dedup=False),
            dict(pol, name="async_nocheck@ctr", skip_nonfinite=False),
            dict(best, name="best_f32@ctr"),
            dict(pol, name="collection_bf16@ctr", embedding="collection",
                 wire_dtype="bfloat16"),
            dict(best, name="best_sum@ctr", wire_dtype="bfloat16",
                 policy_args=dict(best["policy_args"], exchange="sum"))]


def expand_only(only: Optional[List[str]]) -> Optional[List[str]]:
    """``--bench_only`` with the group name ``ctr`` replaced by CTR_RUNS."""
    if not only:
        return only
    out = []
    for o in only:
        out += [n for n in (CTR_RUNS if o == "ctr" else (o,)) if n not in out]
    return out


def dense_params(num_features: int, dim: int = DIM, bottom: Sequence[int] = BOTTOM,
                 top: Sequence[int] = TOP, num_dense: int = 13) -> int:
    """Parameters of the DLRM's dense part (both MLPs, kernels and biases)."""
    n, width = 0, num_dense
    for size in tuple(bottom) + (dim,):
        n, width = n + width * size + size, size
    width = dim + (num_features + 1) * num_features // 2  # ctr_model.interaction_width
    for size in tuple(top) + (1,):
        n, width = n + width * size + size, size
    return n


def distinct_ids_per_step(sparse_batches) -> float:
    """Mean over batches of the distinct (feature, id) pairs of a batch.

    Args:
      sparse_batches: ints [batches, batch, F] (column f: feature f's ids).
    """
    s = np.asarray(sparse_batches)
    if s.ndim != 3 or s.shape[0] == 0:
        raise ValueError(f"sparse_batches must be [batches, batch, F] with batches >= 1, "
                         f"got shape {s.shape}.")
    return float(np.mean([sum(len(np.unique(b[:, f])) for f in range(s.shape[2]))
                          for b in s]))


def limit_bytes_per_step(distinct_ids: float, dense: int, dim: int = DIM) -> float:
    """Bytes (sent + received) a worker step cannot go below: each distinct
    (feature, id) crosses with its float32 row both ways (read, gradient
    pushed), ``(8 + 4 * dim) * 2`` B, and the ``dense`` float32 parameters
    are read and their gradient pushed, ``8 * dense`` B. Headers excluded."""
    return float(distinct_ids * (_ID_BYTES + _FLOAT_BYTES * dim) * 2 + 2 * _FLOAT_BYTES * dense)


def task_cpu_seconds(pids: Dict[str, int]) -> Dict[str, Optional[float]]:
    """CPU seconds (user + system, all threads) each named process has used,
    from Linux ``/proc/PID/stat``; None for a process that cannot be read."""
    ticks = os.sysconf("SC_CLK_TCK")
    out = {}
    for name, pid in pids.items():
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # the name may hold spaces
            out[name] = (int(fields[11]) + int(fields[12])) / ticks
        except (OSError, IndexError, ValueError):
            out[name] = None
    return out


# ``ss -H state established`` lines: Recv-Q Send-Q local peer users:((...)).
_SOCKET = re.compile(r"^\d+\s+\d+\s+(\S+)\s+(\S+)\s+users:\((.*)\)\s*$")


def socket_bytes(pids: Sequence[int]) -> Dict[tuple, List[int]]:
    """The TCP connections of processes ``pids`` in this network namespace:
    ``{(pid, local, peer): [bytes_sent, bytes_received]}``, the kernel's
    per-connection payload counters (``ss -tinp``: tcp_info, headers
    excluded). A connection closed between two readings takes its bytes with
    it, so a difference of two readings can only undercount.

    Raises:
      RuntimeError: ``ss`` is missing or fails.
    """
    try:
        p = subprocess.run(["ss", "-tinpH", "state", "established"], capture_output=True,
                           text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise RuntimeError(f"the @ctr runs count bytes with `ss` (iproute2): {e}") from None
    if p.returncode:
        raise RuntimeError(f"`ss -tinpH` failed: {p.stderr.strip()}")
    want, out, key = {int(x) for x in pids}, {}, None
    for line in p.stdout.splitlines():
        m = _SOCKET.match(line)
        if m:
            owners = {int(x) for x in re.findall(r"pid=(\d+)", m.group(3))} & want
            key = (min(owners), m.group(1), m.group(2)) if owners else None
            continue
        if key is not None and line[:1].isspace():
            sent = re.search(r"\bbytes_sent:(\d+)", line)
            recv = re.search(r"\bbytes_received:(\d+)", line)
            out[key] = [int(sent.group(1)) if sent else 0, int(recv.group(1)) if recv else 0]
            key = None
    return out


def _bytes_between(before, after):
    """Sent and received bytes from one :func:`socket_bytes` reading to the next."""
    sent = recv = 0
    for k, (s, r) in after.items():
        s0, r0 = before.get(k, (0, 0))
        sent, recv = sent + s - s0, recv + r - r0
    return sent, recv


def _policy(run):
    from tf_asyncps import policies
    if run["policy"] == "route":
        args = run["policy_args"]
        return policies.route(sparse=args["sparse"], dense=policies.LocalSteps(
            sync_every=args["local_steps"], exchange=args.get("exchange", "sum")))
    return policies.get(run["policy"], **run["policy_args"])


def run_one(run: Dict[str, Any], settings: Dict[str, Any]) -> Dict[str, Any]:
    """One CTR run (in its own process; called by ``bench.run_one``, whose
    ``settings`` it takes). Returns ``bench.run_one``'s keys but
    ``peak_rss_mb`` (``test_accuracy`` None: at a base rate of 0.25 the accuracy
    at 0.5 is about 0.75 whatever the model learnt; ``test_auc`` instead), plus
    ``test_auc``, ``test_loss``, ``cpu_s_per_step`` (by task), ``cpu_s_per_step_total``,
    ``bytes_per_step``, ``limit_bytes_per_step``, ``distinct_ids_per_step``,
    ``dense_params`` and per segment ``loss``."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    from tf_asyncps import cluster as cluster_lib
    from tf_asyncps.app import ctr_data, ctr_job, ctr_model, job, models
    from tf_asyncps.cluster.netns import NetnsHosts
    from tf_asyncps.strategy import AsyncParameterServerStrategy

    steps_total, eval_every = run.get("steps", settings["steps"]), settings["eval_every"]
    k = models.keras_module(run["keras"])
    rows = ctr_data.table_rows(run["max_rows"], run["scale"])
    strategy = hosts = None
    task_pids = {}
    if run["kind"] != "single":
        shared = settings["cluster"]
        task_pids = shared["pids"]
        hosts = NetnsHosts(spec=settings["hosts"]) if settings.get("hosts") else None
        config = cluster_lib.validate_tf_config(shared["tf_config"])
        part = job.partitioner(MIN_SHARD_BYTES, run["num_ps"])
        if run["kind"] == "vanilla":
            cluster_lib.wait_for_tasks(config, 30.0)
            cluster_lib.configure_local_context(run["num_workers"])
            strategy = tf.distribute.ParameterServerStrategy(
                cluster_lib.cluster_resolver(config), variable_partitioner=part)
        else:
            strategy = AsyncParameterServerStrategy(
                cluster_lib.cluster_resolver(config), update_policy=_policy(run),
                variable_partitioner=part, wire_dtype=run.get("wire_dtype"),
                deduplicate_lookups=run.get("dedup", True),
                skip_nonfinite=run.get("skip_nonfinite", True))
    # TensorFlow ops after the strategy set the runtime's threads.
    data = ctr_data.make(rows, ZIPF_A, settings["seed"])
    k.utils.set_random_seed(settings["seed"])

    def build():
        model = ctr_model.build(rows, DIM, BOTTOM, TOP, settings["seed"], run["embedding"], k)
        model.compile(optimizer=k.optimizers.Adagrad(LEARNING_RATE),
                      loss=k.losses.BinaryCrossentropy(from_logits=True),
                      steps_per_execution=run["spe"])
        return model

    if strategy is None:
        model = build()
        fit_data = data.dataset(ctr_data.train_stream(0), BATCH)
    else:
        with strategy.scope():
            model = build()
        dataset_fn = data.dataset_fn(BATCH)
        if models.is_keras3(k):
            from tf_asyncps.keras3 import DatasetFn
            fit_data = DatasetFn(dataset_fn)
        else:
            fit_data = k.utils.experimental.DatasetCreator(dataset_fn)

    me = "single" if strategy is None else "chief"
    cpu_pids = dict(task_pids, **{me: os.getpid()})
    workers = [f"worker:{i}" for i in range(run["num_workers"])]
    worker_pids = [task_pids[w] for w in workers if w in task_pids]
    segments, sockets = [], []

    def wire():
        if hosts is not None:
            c = [hosts.counters(w) for w in workers]
            return {"worker_tx_bytes": sum(x["tx_bytes"] for x in c),
                    "worker_rx_bytes": sum(x["rx_bytes"] for x in c)}
        if worker_pids:
            sockets.append(socket_bytes(worker_pids))
        return {}

    def on_epoch_begin(self, epoch, logs=None):
        self.t0 = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        seconds = time.perf_counter() - self.t0
        gs = (strategy.staleness_stats().global_step
              if isinstance(strategy, AsyncParameterServerStrategy) else None)
        segments.append({"steps": eval_every, "seconds": seconds, "global_step": gs,
                         "loss": float((logs or {}).get("loss", float("nan"))),
                         "test_accuracy": None, "cpu_s": task_cpu_seconds(cpu_pids),
                         **wire()})

    # The Keras of the run (tf_keras or Keras 3) calls its own Callback class.
    probe = type("Probe", (k.callbacks.Callback,), {"on_epoch_begin": on_epoch_begin,
                                                    "on_epoch_end": on_epoch_end})()
    model.fit(fit_data, epochs=max(2, steps_total // eval_every), steps_per_epoch=eval_every,
              verbose=0, callbacks=[probe])
    steady = segments[1:]  # the first segment holds tracing and the first reads
    secs, steps = sum(s["seconds"] for s in steady), sum(s["steps"] for s in steady)
    first, last = segments[0], segments[-1]
    cpu = {n: (None if first["cpu_s"][n] is None or last["cpu_s"][n] is None
               else (last["cpu_s"][n] - first["cpu_s"][n]) / steps) for n in cpu_pids}
    x_test, y_test, planted = data.arrays(ctr_data.TEST_STREAM, TEST_EXAMPLES)
    logits = model.predict(x_test, batch_size=8192, verbose=0)
    probs = tf.sigmoid(tf.cast(logits, tf.float32)).numpy().reshape(-1)
    # The limit: each worker's first LIMIT_BATCHES batches (the streams are
    # stationary, so their mean is the measured steps' expectation).
    per_worker = max(1, run["num_workers"])
    sparse = np.concatenate([
        data.arrays(ctr_data.train_stream(w), LIMIT_BATCHES * BATCH, BATCH)[0]["sparse"]
        for w in range(per_worker)]).reshape(-1, BATCH, len(rows))
    distinct = distinct_ids_per_step(sparse)
    dense = dense_params(len(rows))
    out = {"segments": segments, "steps_per_sec": steps / secs,
           "examples_per_sec": steps * BATCH / secs, "updates_per_sec": None,
           "test_accuracy": None,
           "test_auc": ctr_job.auc(y_test, probs), "test_loss": ctr_job.log_loss(y_test, probs),
           "planted_test_auc": ctr_job.auc(y_test, planted),
           "steps_to_target": None, "seconds_to_target": None, "staleness": None,
           "cpu_s_per_step": cpu,
           "cpu_s_per_step_total": (None if any(v is None for v in cpu.values())
                                    else sum(cpu.values())),
           "distinct_ids_per_step": distinct, "dense_params": dense, "rows": list(rows),
           "limit_bytes_per_step": limit_bytes_per_step(distinct, dense),
           "bytes_counted_on": "links" if hosts is not None else "sockets",
           "task_pids": task_pids}  # bench.run_one adds peak_rss_mb
    if hosts is not None and "worker_tx_bytes" in first:
        for key, name in (("worker_tx_bytes", "bytes_sent_per_step"),
                          ("worker_rx_bytes", "bytes_received_per_step")):
            out[name] = (last[key] - first[key]) / steps
    elif len(sockets) >= 2:
        sent, recv = _bytes_between(sockets[0], sockets[-1])
        out["bytes_sent_per_step"], out["bytes_received_per_step"] = sent / steps, recv / steps
    if "bytes_sent_per_step" in out:
        out["bytes_per_step"] = out["bytes_sent_per_step"] + out["bytes_received_per_step"]
    if isinstance(strategy, AsyncParameterServerStrategy):
        out["updates_per_sec"] = (last["global_step"] - first["global_step"]) / secs
        out["staleness"] = strategy.staleness_stats().to_dict()
    return out
