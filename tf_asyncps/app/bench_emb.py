"""The bench's embedding workload (runs NAME@emb, ``--bench_hosts=netns``;
the cache sweep, ``--bench_only=cache_sweep``, on loopback or netns).

A 1M x 32 float32 table (``Embedding(1_000_000, 32)``, 128 MB) split over 2
ps tasks (``FixedShardsPartitioner(2)``), a ``Dense(1)`` head, Adagrad(0.1),
mean squared error; each worker step reads the rows of 512 ids drawn from a
Zipf(1.2) law and hashed over the table (a hot head and a long tail, as the
ids of a recommender), so a batch holds far fewer distinct ids than ids.

Beside the bytes each worker step moves (the workers' link counters; on
loopback, the cache sweep's, their sockets' payload) the run reports the
limit computed from the id stream: a step must read the rows of its batch's
distinct ids and push their gradient rows, each crossing with its int64 id:
distinct ids x (8 + 4 x 32) B x 2 = 272 B per distinct id, plus the head
(33 float32 read and 33 pushed).
"""

import contextlib
import os
import time
from typing import Any, Dict, List, Optional

import numpy as np

__all__ = ["ROWS", "DIM", "NUM_PS", "BATCH", "ZIPF_A", "STREAM_BATCHES", "EMB_RUNS",
           "DEFAULT_EMB_RUNS", "SWEEP", "SWEEP_ZIPF", "SWEEP_ROWS_PCT", "SWEEP_BOUNDS",
           "id_stream", "expand_only", "limit_bytes_per_step", "emb_configs", "sweep_name",
           "sweep_configs", "split_sweep", "sweep_table", "run_one"]

ROWS, DIM, NUM_PS = 1_000_000, 32, 2
#: Ids per worker step, the Zipf exponent, and the batches of the stream a
#: worker cycles through (its dataset repeats them).
BATCH, ZIPF_A, STREAM_BATCHES = 512, 1.2, 64
#: Every embedding run; ``local_sgd@emb`` only by name (--bench_only): its
#: exchanges move the whole table (128 MB each way; optimizer slots stay on
#: the worker), about 10 s per exchange and worker at 100 Mbit/s.
#: ``dynamic@emb`` (also by name): ``async+dedup@emb`` with the table a
#: ``tf_asyncps.layers.DynamicEmbedding`` of the same 1M rows on the same ids
#: (as raw ids: an id -> row map on the ps, admission, an eviction pass every
#: 1000 global steps).
#: ``async+nocheck@emb`` (also by name): ``async+dedup@emb`` with
#: ``skip_nonfinite=False``, what the non-finite check costs.
#: ``cache@emb`` (also by name): ``async+dedup@emb`` with
#: ``embedding_cache=EmbeddingCache(CACHE_ROWS, 5, 5)`` (HET's worker cache);
#: ``cache+bound0@emb`` (also by name): the same with bounds 0 (the uncached step).
EMB_RUNS = ("vanilla@emb", "async@emb", "async+dedup@emb", "async+bf16@emb", "local_sgd@emb",
            "dynamic@emb", "async+nocheck@emb", "cache@emb", "cache+bound0@emb")
#: Rows ``cache@emb`` caches per worker: 5% of the table.
CACHE_ROWS = ROWS // 20
#: The embedding runs of a plain ``--bench_hosts=netns`` (and ``--bench_only=emb``).
DEFAULT_EMB_RUNS = EMB_RUNS[:4]
_HASH = 2654435761  # Knuth's multiplicative hash: hot ids spread over both shards
#: The cache sweep (issue 40 item 4), a run set named in ``--bench_only``:
#: per Zipf exponent the uncached ``async+dedup`` run and a cached run per
#: cache size (% of the table's rows per worker) and bound (pull_bound =
#: push_bound); the bench's flags --bench_emb_zipf, --bench_cache_rows_pct
#: and --bench_cache_bounds choose the values (default: the issue's grid).
SWEEP = "cache_sweep"
SWEEP_ZIPF, SWEEP_ROWS_PCT, SWEEP_BOUNDS = (0.8, 1.0, 1.2), (1.0, 5.0), (0, 1, 5, 20)
#: The sweep's stream: 512 batches (262,144 ids), so that a worker does not
#: read a batch twice in a run of up to 512 of its steps and a cache's hits
#: come from the ids' skew, not from the stream repeating (the NAME@emb runs'
#: 64 batches repeat every 64 steps of a worker, which a cache of 5% holds).
SWEEP_STREAM_BATCHES = 512


def id_stream(seed: int, batches: int = STREAM_BATCHES, batch: int = BATCH,
              rows: int = ROWS, a: float = ZIPF_A, truncated: bool = False) -> np.ndarray:
    """The ids a worker reads: int64 [batches, batch], each in [0, rows):
    Zipf(``a``) draws (1, 2, ...) hashed over the table, seeded by ``seed``.

    ``truncated=False``: numpy's Zipf (ranks 1, 2, ... unbounded, ``a > 1``),
    wrapped modulo ``rows``: the NAME@emb runs' stream. ``truncated=True``:
    ranks 1..``rows`` with P(k) proportional to k**-a, any ``a >= 0`` (the
    cache sweep's stream, which needs exponents <= 1).

    Raises:
      ValueError: ``a`` out of range for the law.
    """
    rng = np.random.default_rng(seed)
    if truncated:
        if not a >= 0 or not np.isfinite(a):
            raise ValueError(f"a truncated Zipf exponent must be finite and >= 0, got {a}.")
        cdf = np.cumsum(np.arange(1, rows + 1, dtype=np.float64) ** -float(a))
        u = rng.random((batches, batch)) * cdf[-1]
        z = np.minimum(np.searchsorted(cdf, u, side="right"), rows - 1) + 1
    else:
        if not a > 1:
            raise ValueError(f"numpy's Zipf needs an exponent > 1, got {a}; use "
                             f"truncated=True for smaller ones.")
        z = rng.zipf(a, size=(batches, batch))
    return ((z % rows) * _HASH % rows).astype(np.int64)


def limit_bytes_per_step(ids: np.ndarray, dim: int = DIM, head_params: int = DIM + 1) -> float:
    """Bytes (sent + received) a worker step cannot go below, averaged over
    the batches of ``ids`` (int [batches, batch]): each distinct id of a
    batch crosses twice with its row (read, then its gradient pushed),
    ``(8 + 4 * dim) * 2`` B, and the ``head_params`` float32 of the dense
    head are read and pushed once, ``8 * head_params`` B. Headers excluded."""
    ids = np.asarray(ids)
    if ids.ndim != 2 or ids.shape[0] == 0:
        raise ValueError(f"ids must be [batches, batch] with batches >= 1, got shape "
                         f"{ids.shape}.")
    distinct = np.mean([len(np.unique(b)) for b in ids])
    return float(distinct * (8 + 4 * dim) * 2 + 8 * head_params)


def emb_configs(num_workers: int = 2, sync_every: int = 16,
                steps_per_execution: int = 16) -> List[Dict[str, Any]]:
    """Every embedding run (EMB_RUNS), on ``num_workers`` workers and 2 ps:
    ``vanilla@emb`` (ParameterServerStrategy), ``async@emb`` (policy
    ``async``, ``deduplicate_lookups=False``: every id's row read),
    ``async+dedup@emb`` (the default: distinct ids only), ``async+bf16@emb``
    (distinct ids, ``wire_dtype="bfloat16"``: rows read and gradients pushed
    as bfloat16), ``local_sgd@emb``,
    ``dynamic@emb`` (``async+dedup@emb`` with a DynamicEmbedding of ROWS rows),
    ``async+nocheck@emb`` (``async+dedup@emb``, ``skip_nonfinite=False``),
    ``cache@emb`` (``async+dedup@emb`` with a worker cache of CACHE_ROWS rows,
    bounds 5), ``cache+bound0@emb`` (the same, bounds 0)."""
    base = {"model": "emb", "num_workers": num_workers, "num_ps": NUM_PS, "hosts": True,
            "locking": False, "spe": steps_per_execution, "batch": BATCH}
    return [dict(base, name="vanilla@emb", kind="vanilla"),
            dict(base, name="async@emb", kind="policy", policy="async", policy_args={},
                 dedup=False),
            dict(base, name="async+dedup@emb", kind="policy", policy="async",
                 policy_args={}, dedup=True),
            dict(base, name="async+bf16@emb", kind="policy", policy="async",
                 policy_args={}, dedup=True, wire_dtype="bfloat16"),
            dict(base, name="local_sgd@emb", kind="policy", policy="local_sgd",
                 policy_args={"sync_every": sync_every}, spe=sync_every, dedup=True),
            dict(base, name="dynamic@emb", kind="policy", policy="async", policy_args={},
                 dedup=True, dynamic=True),
            dict(base, name="async+nocheck@emb", kind="policy", policy="async",
                 policy_args={}, dedup=True, skip_nonfinite=False),
            dict(base, name="cache@emb", kind="policy", policy="async", policy_args={},
                 dedup=True, cache={"rows": CACHE_ROWS, "pull_bound": 5, "push_bound": 5}),
            dict(base, name="cache+bound0@emb", kind="policy", policy="async", policy_args={},
                 dedup=True, cache={"rows": CACHE_ROWS, "pull_bound": 0, "push_bound": 0})]


def sweep_name(zipf: float, rows_pct: Optional[float] = None,
               bound: Optional[int] = None) -> str:
    """A cache sweep run's name: ``async+dedup_z1.2@emb`` (uncached) or
    ``cache_z1.2_r5_b20@emb`` (Zipf 1.2, 5% of the rows, bounds 20)."""
    if rows_pct is None:
        return f"async+dedup_z{zipf:g}@emb"
    return f"cache_z{zipf:g}_r{rows_pct:g}_b{bound}@emb"


def sweep_configs(zipf=SWEEP_ZIPF, rows_pct=SWEEP_ROWS_PCT, bounds=SWEEP_BOUNDS,
                  num_workers: int = 2, steps_per_execution: int = 16,
                  hosts: bool = False) -> List[Dict[str, Any]]:
    """The cache sweep's runs (run set :data:`SWEEP`): for each Zipf exponent
    in ``zipf`` (floats >= 0; the ids a truncated Zipf over the table's rows,
    :func:`id_stream`), ``async+dedup@emb``'s run uncached, then with an
    ``EmbeddingCache`` of each ``rows_pct`` (% of ROWS per worker, in (0,
    100]) and each bound in ``bounds`` (ints >= 0, pull_bound = push_bound),
    named by :func:`sweep_name`, each on a stream of SWEEP_STREAM_BATCHES
    batches. ``hosts``: on netns hosts (else loopback).

    Raises:
      ValueError: an empty list, a value out of range or repeated, naming
        the bench flag that sets it.
    """
    def check(values, flag, ok, what):
        values = list(values)
        if not values:
            raise ValueError(f"--{flag}: give at least one value ({what}).")
        bad = [v for v in values if not ok(v)]
        if bad:
            raise ValueError(f"--{flag}: {bad} out of range; each must be {what}.")
        if len(set(values)) < len(values):
            raise ValueError(f"--{flag}: {values} repeats a value.")
        return values

    zipf = check(zipf, "bench_emb_zipf", lambda v: isinstance(v, (int, float))
                 and np.isfinite(v) and 0 <= v <= 10, "a Zipf exponent in [0, 10]")
    rows_pct = check(rows_pct, "bench_cache_rows_pct", lambda v: isinstance(v, (int, float))
                     and 0 < v <= 100 and ROWS * v / 100 >= 1,
                     f"a % of the {ROWS:,} rows in (0, 100], at least one row")
    bounds = check(bounds, "bench_cache_bounds", lambda v: isinstance(v, int)
                   and not isinstance(v, bool) and v >= 0, "an int >= 0")
    (base,) = [r for r in emb_configs(num_workers, steps_per_execution=steps_per_execution)
               if r["name"] == "async+dedup@emb"]
    base = dict(base, hosts=hosts, truncated=True, stream_batches=SWEEP_STREAM_BATCHES)
    runs = []
    for z in zipf:
        runs.append(dict(base, name=sweep_name(z), zipf=float(z)))
        for p in rows_pct:
            for b in bounds:
                runs.append(dict(base, name=sweep_name(z, p, b), zipf=float(z), cache={
                    "rows": int(round(ROWS * p / 100)), "pull_bound": b, "push_bound": b}))
    return runs


def split_sweep(only: Optional[List[str]]):
    """``--bench_only`` without the run set :data:`SWEEP`, and whether it
    was named: ``(others, swept)``."""
    only = list(only or [])
    return [o for o in only if o != SWEEP], SWEEP in only


def sweep_table(results: List[Dict[str, Any]]) -> List[str]:
    """The cache sweep's table (markdown lines) from the bench's results
    (``bench.json``'s ``results``; runs of :func:`sweep_configs`; medians over
    each run's repeats, with their min-max where they differ): per run
    steps/s, KB per worker step and its ratio to the limit, ps rows read
    (pulled) and written (pushed) per worker step in the measured epochs, the
    hit rate (cached reads / distinct ids), the rows the flush at fit's end
    pushed, held-out loss and its ratio to the uncached run's of the same
    exponent. Uncached: rows read = rows written = the stream's distinct ids
    per batch."""
    def values(r, key):
        return [x[key] for x in (r or {}).get("repeats", [r] if r else [])
                if x.get(key) is not None]

    def med(r, key):
        vals = values(r, key)
        return float(np.median(vals)) if vals else None

    def f(v, spec):
        return "–" if v is None else format(v, spec)

    def spread(r, key, spec, scale=1.0):
        vals = [v / scale for v in values(r, key)]
        if not vals:
            return "–"
        lo, hi = format(min(vals), spec), format(max(vals), spec)
        mid = format(float(np.median(vals)), spec)
        return mid if lo == hi else f"{mid} ({lo}-{hi})"

    ok = [r for r in results if "error" not in r and r["name"].endswith("@emb")
          and "_z" in r["name"]]
    uncached = {r["name"]: r for r in ok if r["name"].startswith("async+dedup_z")}
    lines = ["| Zipf | cache | bounds | steps/s | KB / worker step | × limit | limit KB | "
             "rows read / step | rows written / step | hit rate | rows flushed at the end | "
             "held-out loss | × uncached |", "|---" * 13 + "|"]
    for r in ok:
        name = r["name"]
        z = name.split("_z")[1].split("_")[0].split("@")[0]
        base = uncached.get(f"async+dedup_z{z}@emb")
        kb, lim = med(r, "bytes_per_step"), med(r, "limit_bytes_per_step")
        loss, base_loss = med(r, "heldout_loss"), med(base, "heldout_loss")
        if name.startswith("cache_"):
            _, _, pct, bound = name.split("@")[0].split("_")
            cache, bounds = f"{pct[1:]}%", bound[1:]
            reads, writes = med(r, "rows_pulled_per_step"), med(r, "rows_pushed_per_step")
            hits, flushed = spread(r, "hit_rate", ".3f"), med(r, "closing_rows_flushed")
        else:
            cache, bounds, hits, flushed = "none", "–", "–", None
            reads = writes = med(r, "distinct_per_step")
        lines.append(
            f"| {z} | {cache} | {bounds} | {spread(r, 'steps_per_sec', '.0f')} | "
            f"{spread(r, 'bytes_per_step', '.1f', 1e3)} | "
            f"{f(None if kb is None or not lim else kb / lim, '.3f')} | "
            f"{f(None if lim is None else lim / 1e3, '.1f')} | "
            f"{f(reads, '.1f')} | {f(writes, '.1f')} | {hits} | {f(flushed, ',.0f')} | "
            f"{spread(r, 'heldout_loss', '.5f')} | "
            f"{f(None if loss is None or not base_loss else loss / base_loss, '.3f')} |")
    return lines


def run_one(run: Dict[str, Any], settings: Dict[str, Any]) -> Dict[str, Any]:
    """One embedding run (in its own process; called by ``bench.run_one``,
    whose ``settings`` it takes). Returns ``bench.run_one``'s keys but
    ``peak_rss_mb`` (accuracy ones None: the ids carry no test set), plus ``bytes_per_step`` (sent +
    received by the workers in their steps; a cache's flushes at the joins taken out),
    with a cache ``flush_bytes_per_step`` (the flushes' bytes on the workers' links per
    measured step), ``flush_bytes_per_join`` and ``joins`` (flushes inside the measured
    epochs), ``closing_flush_bytes`` and ``closing_flush_seconds`` (the flush at fit's
    end), ``cpu_s_per_step`` (CPU seconds per measured step by task) and
    ``cpu_s_per_step_total``, ``limit_bytes_per_step``,
    per segment ``loss`` and ``heldout_loss`` (mse on 16 batches of the seed + 1
    stream, after training), ``distinct_per_step`` (the stream's distinct ids
    per batch); with a cache, over the measured epochs, ``rows_pulled_per_step``,
    ``rows_pushed_per_step`` (rows the steps read from and wrote to the ps, per
    worker step), ``hit_rate`` (cached reads / distinct ids) and
    ``closing_rows_flushed`` (rows pushed by the flush at fit's end).

    ``run["zipf"]``, ``run["truncated"]`` and ``run["stream_batches"]`` (the
    cache sweep) choose the id stream (:func:`id_stream`; default Zipf(ZIPF_A),
    numpy's, STREAM_BATCHES batches). On hosts the
    bytes are the workers' link counters (headers included), on loopback
    their sockets' payload (``ss``, headers excluded)."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf
    import tf_keras

    from tf_asyncps import cluster as cluster_lib
    from tf_asyncps import policies
    from tf_asyncps.app.bench_ctr import socket_bytes, task_cpu_seconds
    from tf_asyncps.cluster.netns import NetnsHosts
    from tf_asyncps.strategy import AsyncParameterServerStrategy

    steps_total, eval_every = run.get("steps", settings["steps"]), settings["eval_every"]
    law = {"a": run.get("zipf", ZIPF_A), "truncated": run.get("truncated", False)}
    ids = id_stream(settings["seed"], batches=run.get("stream_batches", STREAM_BATCHES), **law)
    labels = (ids % 2).astype(np.float32)

    def dataset_fn(ctx):
        ds = tf.data.Dataset.from_tensor_slices((ids.reshape(-1, 1), labels.reshape(-1, 1)))
        return ds.batch(BATCH, drop_remainder=True).repeat().prefetch(2)

    shared = settings["cluster"]
    hosts = NetnsHosts(spec=settings["hosts"]) if settings.get("hosts") else None
    config = cluster_lib.validate_tf_config(shared["tf_config"])
    part = tf.distribute.experimental.partitioners.FixedShardsPartitioner(NUM_PS)
    if run["kind"] == "vanilla":
        cluster_lib.wait_for_tasks(config, 30.0)
        cluster_lib.configure_local_context(run["num_workers"])
        strategy = tf.distribute.ParameterServerStrategy(
            cluster_lib.cluster_resolver(config), variable_partitioner=part)
    else:
        from tf_asyncps.core.embedding_cache import EmbeddingCache
        cache = run.get("cache")
        strategy = AsyncParameterServerStrategy(
            cluster_lib.cluster_resolver(config),
            update_policy=policies.get(run["policy"], **run["policy_args"]),
            variable_partitioner=part, deduplicate_lookups=run["dedup"],
            wire_dtype=run.get("wire_dtype"), skip_nonfinite=run.get("skip_nonfinite", True),
            embedding_cache=EmbeddingCache(**cache) if cache else None)
    tf_keras.utils.set_random_seed(settings["seed"])
    with strategy.scope():
        if run.get("dynamic"):
            from tf_asyncps.layers import DynamicEmbedding
            table = DynamicEmbedding(DIM, capacity=ROWS)  # the same "uniform" initializer
        else:
            table = tf_keras.layers.Embedding(ROWS, DIM)
        model = tf_keras.Sequential([
            tf_keras.Input([1], dtype="int64"), table,
            tf_keras.layers.Flatten(), tf_keras.layers.Dense(1)])
        model.compile(tf_keras.optimizers.Adagrad(0.1), "mse", steps_per_execution=run["spe"])

    workers = [f"worker:{i}" for i in range(run["num_workers"])]
    cpu_pids = dict(shared["pids"], chief=os.getpid())
    every_host = ["chief:0"] + [f"ps:{i}" for i in range(NUM_PS)] + workers
    segments = []
    # The cache's flush at each join (tf_keras fit joins at every epoch end)
    # is closing traffic, not a step's: its bytes on the workers' links and
    # every host's are summed apart and taken out of the steps' bytes.
    flushed = {"worker_tx_bytes": 0, "worker_rx_bytes": 0, "all_tx_bytes": 0, "joins": 0,
               "seconds": 0.0}

    def link_bytes():
        if hosts is None:  # loopback: the tasks' sockets' payload counters
            per_pid = {}  # the chief's, the ps tasks' and the workers'
            for (pid, _, _), (sent, recv) in socket_bytes(list(cpu_pids.values())).items():
                acc = per_pid.setdefault(pid, [0, 0])
                acc[0], acc[1] = acc[0] + sent, acc[1] + recv
            wp = {cpu_pids[w] for w in workers}
            return {"worker_tx_bytes": sum(v[0] for p, v in per_pid.items() if p in wp),
                    "worker_rx_bytes": sum(v[1] for p, v in per_pid.items() if p in wp),
                    "all_tx_bytes": sum(v[0] for v in per_pid.values())}
        c = [hosts.counters(w) for w in workers]
        return {"worker_tx_bytes": sum(x["tx_bytes"] for x in c),
                "worker_rx_bytes": sum(x["rx_bytes"] for x in c),
                "all_tx_bytes": sum(hosts.counters(h)["tx_bytes"] for h in every_host)}

    caches = getattr(getattr(strategy, "extended", None), "caches", None)
    if caches is not None:
        @contextlib.contextmanager
        def counted_flush():
            before, t0 = link_bytes(), time.perf_counter()
            try:
                yield
            finally:
                flushed["seconds"] += time.perf_counter() - t0
                after = link_bytes()
                for k in before:
                    flushed[k] += after[k] - before[k]
                flushed["joins"] += 1

        caches.observe_flushes(counted_flush)

    class Probe(tf_keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.t0 = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            seconds = time.perf_counter() - self.t0
            # Every host's sent bytes (all_tx_bytes): each byte on the network
            # once, the ps tasks' traffic between themselves and the chief's
            # included. flush_*: the joins' flushes so far (in the others).
            wire = link_bytes()
            wire.update({f"flush_{k}": v for k, v in flushed.items()})
            if caches is not None:  # the cache's counters, summed over its tables
                wire["cache"] = _cache_totals(strategy.cache_stats())
            gs = (strategy.staleness_stats().global_step
                  if isinstance(strategy, AsyncParameterServerStrategy) else None)
            segments.append({"steps": eval_every, "seconds": seconds, "global_step": gs,
                             "loss": float((logs or {}).get("loss", float("nan"))),
                             "test_accuracy": None, "cpu_s": task_cpu_seconds(cpu_pids),
                             **wire})

    model.fit(tf_keras.utils.experimental.DatasetCreator(dataset_fn),
              epochs=max(2, steps_total // eval_every), steps_per_epoch=eval_every, verbose=0,
              callbacks=[Probe()])
    # Held-out: 16 batches of another seed's stream (the Zipf head is shared,
    # the tail mostly unseen), read as the workers read (a cache included).
    held = id_stream(settings["seed"] + 1, batches=16, **law)
    if caches is not None:  # before evaluate, whose reads go through the cache
        closing = _cache_totals(strategy.cache_stats())
    heldout_loss = float(model.evaluate(tf_keras.utils.experimental.DatasetCreator(
        lambda ctx: tf.data.Dataset.from_tensor_slices(
            (held.reshape(-1, 1), (held % 2).astype(np.float32).reshape(-1, 1))).batch(
                BATCH, drop_remainder=True).repeat()), steps=16, verbose=0))
    steady = segments[1:]  # the first segment includes tracing and the first reads
    secs, steps = sum(s["seconds"] for s in steady), sum(s["steps"] for s in steady)
    out = {"segments": segments, "steps_per_sec": steps / secs,
           "examples_per_sec": steps * BATCH / secs, "updates_per_sec": None,
           "test_accuracy": None, "steps_to_target": None, "seconds_to_target": None,
           "staleness": None, "limit_bytes_per_step": limit_bytes_per_step(ids),
           "heldout_loss": heldout_loss,
           "distinct_per_step": float(np.mean([len(np.unique(b)) for b in ids])),
           "task_pids": shared["pids"]}  # bench.run_one adds peak_rss_mb
    first, last = segments[0], segments[-1]
    # CPU seconds per measured step by task (the joins' flushes included).
    out["cpu_s_per_step"] = {n: (None if first["cpu_s"][n] is None or last["cpu_s"][n] is None
                                 else (last["cpu_s"][n] - first["cpu_s"][n]) / steps)
                             for n in cpu_pids}
    out["cpu_s_per_step_total"] = (None if None in out["cpu_s_per_step"].values()
                                   else sum(out["cpu_s_per_step"].values()))
    if "worker_tx_bytes" in segments[0]:
        def per_step(key):  # the steps' bytes, the joins' flushes taken out
            flush = last[f"flush_{key}"] - first[f"flush_{key}"]
            return (last[key] - first[key] - flush) / steps, flush / steps

        (out["bytes_sent_per_step"], sent_flush), (out["bytes_received_per_step"],
                                                    recv_flush) = map(
            per_step, ("worker_tx_bytes", "worker_rx_bytes"))
        out["bytes_per_step"] = out["bytes_sent_per_step"] + out["bytes_received_per_step"]
        out["all_links_bytes_per_step"], all_flush = per_step("all_tx_bytes")
        joins = last["flush_joins"] - first["flush_joins"]
        if flushed["joins"] > last["flush_joins"]:
            # The flush at fit's end (its epochs' joins defer theirs there),
            # after the measured epochs: bytes on the workers' links, seconds.
            out["closing_flush_bytes"] = (
                flushed["worker_tx_bytes"] + flushed["worker_rx_bytes"]
                - last["flush_worker_tx_bytes"] - last["flush_worker_rx_bytes"])
            out["closing_flush_seconds"] = flushed["seconds"] - last["flush_seconds"]
        if joins:
            # Closing traffic, per step of the measured epochs (it shrinks
            # as epochs lengthen) and per join.
            out["flush_bytes_per_step"] = sent_flush + recv_flush
            out["flush_all_links_bytes_per_step"] = all_flush
            out["flush_bytes_per_join"] = (sent_flush + recv_flush) * steps / joins
            out["joins"] = joins
            out["flush_seconds"] = last["flush_seconds"] - first["flush_seconds"]
    if isinstance(strategy, AsyncParameterServerStrategy):
        out["updates_per_sec"] = (segments[-1]["global_step"] -
                                  segments[0]["global_step"]) / secs
        out["staleness"] = strategy.staleness_stats().to_dict()
    if run.get("dynamic"):
        out["dynamic_table"] = table.stats()
    if run.get("cache"):
        out["cache"] = strategy.cache_stats()
        a, b = first["cache"], last["cache"]
        out["rows_pulled_per_step"] = (b["rows_pulled"] - a["rows_pulled"]) / steps
        out["rows_pushed_per_step"] = (b["rows_pushed"] - a["rows_pushed"]) / steps
        distinct = b["distinct"] - a["distinct"]
        out["hit_rate"] = (b["hits"] - a["hits"]) / distinct if distinct else None
        out["closing_rows_flushed"] = closing["rows_flushed"] - b["rows_flushed"]
    return out


def _cache_totals(stats: Dict[str, Dict[str, Any]]) -> Dict[str, int]:
    """``cache_stats()``'s counters summed over the tables (shards)."""
    out = {}
    for table in stats.values():
        for k, v in table.items():
            if isinstance(v, int):
                out[k] = out.get(k, 0) + v
    return out


def expand_only(only: Optional[List[str]]) -> Optional[List[str]]:
    """``--bench_only`` with the group name ``emb`` replaced by DEFAULT_EMB_RUNS."""
    if not only:
        return only
    out = []
    for o in only:
        out += [n for n in (DEFAULT_EMB_RUNS if o == "emb" else (o,)) if n not in out]
    return out
