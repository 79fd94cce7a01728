"""``tf-asyncps bench``: every policy side by side on the same cluster shape.

One invocation runs, each in its own process (TensorFlow allows one cluster
per process) on the same local cluster shape, model, data and settings:

* ``single``: the model in one process, no strategy (the machine's limit);
* ``vanilla``: ``tf.distribute.ParameterServerStrategy``;
* each policy of this project under :class:`AsyncParameterServerStrategy`,
  and ``async`` with a ``LockingOptimizer``;
* the straggler pair: ``sync_replicas`` N-of-N and (N-1)-of-N (one backup
  worker) with one worker slowed by a fixed delay per step.

Each configuration runs ``--bench_repeats`` times (default 3), interleaved
(every configuration once, then every configuration again, ...) so that a
drift of the machine's speed hits them alike. Steps/s, examples/s and
updates/s are reported as the median and the min-max range over the
repeats; a ratio (× vanilla, × single) is the ratio of the medians, with the
range of the per-repeat ratios (repeat k of one run over repeat k of the
other, run back to back). A target is "met" when that whole range clears it,
"not met" when the whole range falls short, "unclear" when it straddles.

Every run trains the digits MLP with ``model.fit`` for ``--bench_steps``
worker steps, evaluates test accuracy every ``--bench_eval_every`` steps
(evaluation time excluded), and reports steps/s and examples/s after the
first segment (which includes tracing), applied updates/s, the staleness
histogram, and steps and seconds to ``--bench_target_accuracy``.

Output in ``--output_dir`` (:mod:`tf_asyncps.app.bench_report`):
``bench.json`` (every number), ``bench.md`` (the table, with ratios to
vanilla PSS and to single-process, and the targets marked), and PNG plots
(``throughput.png``, ``accuracy.png``, ``staleness.png``).
"""

import json
import os
import signal
import subprocess
import sys
import time
from typing import Any, Dict, List, Optional

from tf_asyncps.validate import check_int

__all__ = ["default_configs", "hosts_configs", "scaling_configs", "run_one", "run_all",
           "aggregate_repeats", "spread", "peak_rss_mb", "MODELS", "SPREAD_KEYS",
           "SCALING_SHAPES"]

#: The bench models, both on the digits data: "mlp" (64-128-10, 9,610
#: parameters: per-closure overhead dominates) and "mlp_1m" (64-1024-1024-10,
#: 1,126,410 parameters: compute and the bytes of each step matter).
MODELS = {"mlp": (128,), "mlp_1m": (1024, 1024)}
#: Runs repeated on "mlp_1m" (named NAME@1m), beside the full set on "mlp".
LARGE_MODEL_RUNS = ("single", "vanilla", "async", "local_sgd")
#: ``--bench_hosts=netns``: the runs compared over rate-limited links, each
#: task on a host (network namespace) of its own, on "mlp_1m".
HOSTS_RUNS = ("vanilla", "async", "local_sgd", "sync_replicas")

#: ``--bench_scaling``: (workers, ps tasks) of the async runs, named async@wWpP.
SCALING_SHAPES = ((1, 1), (2, 1), (4, 1), (1, 2), (2, 2), (4, 2))

POLICY_ARGS = {"drop_stale": {"max_staleness": 2}, "ssp": {"max_staleness": 2},
               "staleness_aware": {}, "dc_asgd": {}, "async": {}}


def default_configs(num_workers: int = 2, sync_every: int = 16,
                    steps_per_execution: int = 16, straggler_workers: int = 4,
                    straggler_delay_ms: float = 100.0,
                    only: Optional[List[str]] = None,
                    large_model: bool = True,
                    straggler_steps: Optional[int] = None,
                    large_model_steps: Optional[int] = None,
                    ctr: Optional[Dict[str, Any]] = None) -> List[Dict[str, Any]]:
    """The runs of one bench invocation (dicts, JSON-serialisable).

    Args:
      num_workers: workers of every run except the straggler pair.
      sync_every: local_sgd's window (steps); its closures hold that many steps.
      steps_per_execution: worker steps per closure for the other runs.
      straggler_workers: N of the straggler pair (>= 2).
      straggler_delay_ms: delay per step of the slowed worker (ms).
      only: run names to keep (None: all). Names: single, vanilla, async,
        drop_stale, staleness_aware, ssp, dc_asgd, sync_replicas,
        async+locking, local_sgd, straggler_sync_all, straggler_sync_backup,
        and on the 1M-parameter model single@1m, vanilla@1m, async@1m,
        local_sgd@1m.
      large_model: add the LARGE_MODEL_RUNS on "mlp_1m".
      straggler_steps: the straggler pair's run length in worker steps (its
        ``"steps"``; None: the bench's). One step per closure with a slowed
        worker makes its steps the slowest of the bench.
      large_model_steps: the "mlp_1m" runs' length in worker steps (None: the
        bench's); their steps are the bench's next slowest.
      ctr: the CTR runs' table sizes, ``{"max_rows", "scale"}``; those runs
        (NAME@ctr, :mod:`tf_asyncps.app.bench_ctr`) run only when ``only``
        names them, or holds ``ctr`` (all of them).

    Raises:
      ValueError: an unknown name in ``only``.
    """
    spe = steps_per_execution
    runs = [{"name": "single", "kind": "single", "spe": spe, "num_workers": 0},
            {"name": "vanilla", "kind": "vanilla", "spe": spe}]
    for p in ("async", "drop_stale", "staleness_aware", "ssp", "dc_asgd"):
        runs.append({"name": p, "kind": "policy", "policy": p,
                     "policy_args": POLICY_ARGS[p], "spe": spe})
    runs.append({"name": "sync_replicas", "kind": "policy", "policy": "sync_replicas",
                 "policy_args": {"replicas_to_aggregate": num_workers}, "spe": spe})
    runs.append({"name": "async+locking", "kind": "policy", "policy": "async",
                 "policy_args": {}, "locking": True, "spe": spe})
    runs.append({"name": "local_sgd", "kind": "policy", "policy": "local_sgd",
                 "policy_args": {"sync_every": sync_every}, "spe": sync_every})
    n = straggler_workers
    for name, agg in (("straggler_sync_all", n), ("straggler_sync_backup", n - 1)):
        runs.append({"name": name, "kind": "policy", "policy": "sync_replicas",
                     "policy_args": {"replicas_to_aggregate": agg, "total_num_replicas": n},
                     "spe": 1, "num_workers": n, "slow_worker": 0,
                     "delay_ms": straggler_delay_ms, "straggler": True})
        if straggler_steps is not None:
            runs[-1]["steps"] = straggler_steps
    for r in runs:
        r.setdefault("num_workers", num_workers)
        r.setdefault("locking", False)
        r.setdefault("model", "mlp")
    if large_model:
        more = {} if large_model_steps is None else {"steps": large_model_steps}
        runs += [dict(r, name=f"{r['name']}@1m", model="mlp_1m", **more) for r in runs
                 if r["name"] in LARGE_MODEL_RUNS]
    return _with_ctr(runs, only, num_workers, steps_per_execution, ctr, hosts=False)


def _with_ctr(runs, only, num_workers, steps_per_execution, ctr, hosts, mode=""):
    """``runs`` and the CTR runs (NAME@ctr, bench_ctr.py), which run only when
    named in ``only`` (``ctr``: all of them); ``ctr``: their
    ``{"max_rows", "scale"}`` (default: the issue's scale)."""
    from tf_asyncps.app import bench_ctr
    only = bench_ctr.expand_only(only)
    if not only or not any(o.endswith("@ctr") for o in only):
        return _only(runs, only, mode)
    runs = runs + bench_ctr.ctr_configs(num_workers, steps_per_execution, hosts=hosts,
                                        **(ctr or {}))
    return _only(runs, only, mode)


def _only(runs, only, mode=""):
    """The runs named in ``only`` (all if empty); ValueError names unknown ones."""
    if not only:
        return runs
    names = [r["name"] for r in runs]
    unknown = [o for o in only if o not in names]
    if unknown:
        raise ValueError(f"--bench_only: unknown run(s) {unknown}{mode}; choose from "
                         f"{sorted(names)}.")
    return [r for r in runs if r["name"] in only]


def hosts_configs(num_workers: int = 2, sync_every: int = 16,
                  steps_per_execution: int = 16,
                  only: Optional[List[str]] = None,
                  local_sgd_steps: Optional[int] = None,
                  ctr: Optional[Dict[str, Any]] = None) -> List[Dict[str, Any]]:
    """The runs of ``--bench_hosts=netns``: HOSTS_RUNS on "mlp_1m", named
    NAME@1m, and ``async+bf16@1m`` (``async``, ``wire_dtype="bfloat16"``),
    with ``num_workers`` workers and 1 ps, each task on its own host,
    then the embedding runs (:mod:`tf_asyncps.app.bench_emb`, NAME@emb, 2 ps;
    ``local_sgd@emb`` only when named). In ``only``, ``emb`` stands for the
    default embedding runs; ``ctr`` the CTR runs (NAME@ctr, by name only, as
    in :func:`default_configs`).
    ``local_sgd_steps`` (if set) is local_sgd's run length in worker steps
    (its ``"steps"``), in place of the bench's: at equal steps it lags (each
    worker sees the others' updates once per window), so its accuracy is
    compared after a longer run, which still takes less time.

    Raises:
      ValueError: an unknown name in ``only``.
    """
    runs = [dict(r, name=f"{r['name']}@1m", model="mlp_1m", hosts=True)
            for r in default_configs(num_workers, sync_every, steps_per_execution,
                                     large_model=False) if r["name"] in HOSTS_RUNS]
    if local_sgd_steps is not None:
        for r in runs:
            if r.get("policy") == "local_sgd":
                r["steps"] = local_sgd_steps
    # async with every read and gradient in bfloat16 on the wire (#24 item 4).
    runs += [dict(r, name="async+bf16@1m", wire_dtype="bfloat16") for r in runs
             if r["name"] == "async@1m"]
    from tf_asyncps.app import bench_emb
    runs += bench_emb.emb_configs(num_workers, sync_every, steps_per_execution)
    if not only:
        return [r for r in runs if r["model"] != "emb"
                or r["name"] in bench_emb.DEFAULT_EMB_RUNS]
    return _with_ctr(runs, bench_emb.expand_only(only), num_workers, steps_per_execution,
                     ctr, hosts=True, mode=" for --bench_hosts=netns")


def scaling_configs(steps_per_execution: int = 16,
                    only: Optional[List[str]] = None) -> List[Dict[str, Any]]:
    """The runs of ``--bench_scaling``: ``async`` on the digits MLP for each
    (workers, ps tasks) of SCALING_SHAPES, named async@wWpP, and the
    single-process baseline.

    Raises:
      ValueError: an unknown name in ``only``.
    """
    runs = [{"name": "single", "kind": "single", "spe": steps_per_execution,
             "num_workers": 0, "num_ps": 0}]
    runs += [{"name": f"async@w{w}p{p}", "kind": "policy", "policy": "async",
              "policy_args": {}, "spe": steps_per_execution, "num_workers": w, "num_ps": p,
              "scaling": True} for w, p in SCALING_SHAPES]
    for r in runs:
        r.update(locking=False, model="mlp")
    return _only(runs, only, " for --bench_scaling")


def peak_rss_mb(pids: Dict[str, int]) -> Dict[str, Optional[float]]:
    """Peak resident memory (VmHWM, MB) of each named process; None where it
    cannot be read (a process gone, or no /proc)."""
    out = {}
    for name, pid in pids.items():
        try:
            with open(f"/proc/{pid}/status") as f:
                kb = next(int(ln.split()[1]) for ln in f if ln.startswith("VmHWM:"))
            out[name] = round(kb / 1024.0, 1)
        except (OSError, StopIteration, ValueError):
            out[name] = None
    return out


# -- one run (in its own process) ---------------------------------------------
def run_one(run: Dict[str, Any], settings: Dict[str, Any]) -> Dict[str, Any]:
    """Trains one configuration and measures it. Runs in a fresh process.

    Args:
      run: one of :func:`default_configs`.
      settings: batch_size, learning_rate, seed, steps, eval_every,
        target_accuracy; for every run but "single", ``cluster``: the
        ``tf_config`` of the chief of a running cluster of the run's shape and
        the ``pids`` of its tasks (``run_all`` keeps one up per shape); with
        ``hosts`` (a ``NetnsHosts.spec()``) that cluster runs on those hosts
        and this process must run on the chief's (``run_all`` does that).

    Returns:
      A JSON-serialisable dict: ``segments`` (per evaluation: steps, seconds,
      test_accuracy, global_step), ``steps_per_sec``, ``examples_per_sec``,
      ``updates_per_sec``, ``steps_to_target``, ``seconds_to_target``,
      ``test_accuracy``, ``staleness`` (StalenessStats.to_dict() or None);
      on hosts also ``bytes_sent_per_step`` and ``bytes_received_per_step``:
      the workers' link counters (bytes on the wire, headers included) over
      the steps measured, per worker step.
    """
    if run.get("model") in ("emb", "ctr"):
        from tf_asyncps.app import bench_ctr, bench_emb
        out = (bench_emb if run["model"] == "emb" else bench_ctr).run_one(run, settings)
        out["peak_rss_mb"] = peak_rss_mb(dict(out["task_pids"], chief=os.getpid()))
        return out
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf
    import tf_keras

    from tf_asyncps import policies
    from tf_asyncps.app import straggler
    from tf_asyncps.app import datasets
    from tf_asyncps.app import models
    from tf_asyncps import cluster as cluster_lib
    from tf_asyncps.cluster.netns import NetnsHosts
    from tf_asyncps.optimizers import LockingOptimizer
    from tf_asyncps.strategy import AsyncParameterServerStrategy

    batch, seed = settings["batch_size"], settings["seed"]
    settings = dict(settings, steps=run.get("steps", settings["steps"]))
    spe, eval_every = run["spe"], settings["eval_every"]
    data = datasets.load("digits", seed=seed)
    ds_fn = datasets.make_dataset_fn(data.x_train, data.y_train, batch, seed)
    if run.get("slow_worker") is not None:
        ds_fn = straggler.slow_dataset_fn(ds_fn, run["slow_worker"], run["delay_ms"])
    tf_keras.utils.set_random_seed(seed)

    hidden = MODELS[run.get("model", "mlp")]

    def build():
        model = models.build_model("mlp", data.num_features, data.num_classes, hidden, seed)
        opt = tf_keras.optimizers.SGD(settings["learning_rate"])
        if run["locking"]:
            opt = LockingOptimizer(opt)
        model.compile(opt, tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      steps_per_execution=spe)
        return model

    strategy = hosts = None
    task_pids = {}
    if run["kind"] == "single":
        model = build()
        fit_data = ds_fn(tf.distribute.InputContext())
    else:
        # The ps/worker tasks the caller keeps up for runs of this shape (run_all).
        shared = settings["cluster"]
        task_pids = shared["pids"]
        hosts = NetnsHosts(spec=settings["hosts"]) if settings.get("hosts") else None
        config = cluster_lib.validate_tf_config(shared["tf_config"])
        if run["kind"] == "vanilla":
            cluster_lib.wait_for_tasks(config, 30.0)
            cluster_lib.configure_local_context(run["num_workers"])
            strategy = tf.distribute.ParameterServerStrategy(
                cluster_lib.cluster_resolver(config))
        else:
            strategy = AsyncParameterServerStrategy(
                cluster_lib.cluster_resolver(config), update_policy=policies.get(
                    run["policy"], **run["policy_args"]), wire_dtype=run.get("wire_dtype"))
        with strategy.scope():
            model = build()
        fit_data = tf_keras.utils.experimental.DatasetCreator(ds_fn)

    # Built after connecting: the connection replaces the local devices.
    evaluator = models.build_model("mlp", data.num_features, data.num_classes, hidden, seed)

    def global_step():
        if isinstance(strategy, AsyncParameterServerStrategy):
            return strategy.staleness_stats().global_step
        return None

    segments = []
    workers = [f"worker:{i}" for i in range(run["num_workers"])]

    def link_bytes():
        if hosts is None:
            return {}
        c = [hosts.counters(w) for w in workers]
        return {"worker_tx_bytes": sum(x["tx_bytes"] for x in c),
                "worker_rx_bytes": sum(x["rx_bytes"] for x in c)}

    class Probe(tf_keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.t0 = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            seconds = time.perf_counter() - self.t0  # before evaluation
            net = link_bytes()
            evaluator.set_weights(model.get_weights())
            # A direct call: evaluate() inside fit would take the PSS path.
            logits = evaluator(data.x_test, training=False).numpy()
            acc = float((logits.argmax(axis=1) == data.y_test).mean())
            segments.append({"steps": eval_every, "seconds": seconds,
                             "test_accuracy": float(acc), "global_step": global_step(),
                             **net})

    n_segments = max(1, settings["steps"] // eval_every)
    model.fit(fit_data, epochs=n_segments, steps_per_epoch=eval_every, verbose=0,
              callbacks=[Probe()])
    # Each task's peak since run_all reset it before this run, and this process's.
    peak = peak_rss_mb(dict(task_pids, **{"chief" if task_pids else "single": os.getpid()}))
    steady = segments[1:] or segments
    secs = sum(s["seconds"] for s in steady)
    steps = sum(s["steps"] for s in steady)
    out = {"segments": segments, "steps_per_sec": steps / secs,
           "examples_per_sec": steps * batch / secs, "updates_per_sec": None,
           "test_accuracy": segments[-1]["test_accuracy"],
           "steps_to_target": None, "seconds_to_target": None, "staleness": None,
           "peak_rss_mb": peak, "task_pids": task_pids}
    if len(steady) < len(segments) and "worker_tx_bytes" in segments[0]:
        # After the first segment (its bytes include the model's first reads).
        for key, name in (("worker_tx_bytes", "bytes_sent_per_step"),
                          ("worker_rx_bytes", "bytes_received_per_step")):
            out[name] = (segments[-1][key] - segments[0][key]) / steps
    if len(steady) < len(segments) and steady[0]["global_step"] is not None:
        out["updates_per_sec"] = (segments[-1]["global_step"] -
                                  segments[0]["global_step"]) / secs
    cum_steps = cum_secs = 0
    for s in segments:
        cum_steps += s["steps"]
        cum_secs += s["seconds"]
        if s["test_accuracy"] >= settings["target_accuracy"]:
            out["steps_to_target"], out["seconds_to_target"] = cum_steps, cum_secs
            break
    if isinstance(strategy, AsyncParameterServerStrategy):
        out["staleness"] = strategy.staleness_stats().to_dict()
    return out


# -- orchestration ---------------------------------------------------------------
def run_all(runs: List[Dict[str, Any]], settings: Dict[str, Any],
            timeout_s: float = 300.0, say=print, repeats: int = 1,
            hosts=None) -> List[Dict[str, Any]]:
    """Runs each configuration ``repeats`` times in child processes, one after
    the other, interleaved: repeat 1 of every run, then repeat 2, ...

    Each child is a fresh chief process (new strategy, variables and
    coordinator); the ps/worker tasks of each cluster shape (workers, ps
    tasks) are started once and shared by every run of that shape, as a
    chief re-run reconnects to them (started again if a task died). The
    tasks' peak memory is reset before each run, so each run reports its own.
    With ``hosts`` (a ``NetnsHosts`` holding ``LocalCluster.host_names(N, P)``, P the most ps),
    each task runs on its host and each child on the chief's.

    A run that fails or outlives ``timeout_s`` is reported with an ``error``
    (its process group is killed) and the others still run.

    Returns:
      One dict per run (:func:`aggregate_repeats`): the run's settings, the
      medians and ranges, and ``repeats``: each repeat's :func:`run_one` result.
    """
    repeats = check_int(repeats, "--bench_repeats", min=1)
    per_run = {i: [] for i in range(len(runs))}
    clusters = {}
    t_start = time.perf_counter()
    total = len(runs) * repeats
    k = 0
    try:
        for rep in range(repeats):
            for i, run in enumerate(runs):
                k += 1
                where = (f"{run['num_workers']} worker(s)" if run["num_workers"]
                         else "one process, no strategy")
                say(f"[{k}/{total}] {run['name']}"
                    + (f" (repeat {rep + 1}/{repeats})" if repeats > 1 else "")
                    + f": {where}, {run['spe']} steps per closure"
                    + (f", worker {run['slow_worker']} slowed by {run['delay_ms']:g} ms/step"
                       if run.get("straggler") else "") + " ...")
                t0 = time.perf_counter()
                run_settings = settings
                if run["num_workers"]:
                    c = _cluster_for(run, clusters, hosts)
                    for pid in c.pids.values():
                        _reset_peak(pid)
                    run_settings = dict(settings, cluster={"tf_config": c.tf_config("chief", 0),
                                                           "pids": c.pids})
                result, error = _run_child(run, run_settings, timeout_s, hosts)
                if result is None:
                    say(f"    FAILED ({error.splitlines()[0]}); last output:\n"
                        + "\n".join(error.splitlines()[1:]))
                    per_run[i].append({"error": error})
                else:
                    per_run[i].append(result)
                    acc = result["test_accuracy"]
                    say(f"    {result['steps_per_sec']:.0f} steps/s"
                        + ("" if acc is None else f", test accuracy {acc:.3f}")
                        + (f", held-out AUC {result['test_auc']:.4f}"
                           if result.get("test_auc") is not None else "")
                        + f" ({time.perf_counter() - t0:.0f} s; "
                        f"{time.perf_counter() - t_start:.0f} s so far)")
    finally:
        for c in clusters.values():
            c.stop()
    return [aggregate_repeats(run, per_run[i]) for i, run in enumerate(runs)]


#: Clusters kept up at once (about 0.7 GB per task): --bench_scaling's six
#: shapes would hold 23 tasks.
MAX_CLUSTERS = 2


def _cluster_for(run, clusters, hosts):
    """The running LocalCluster for ``run``'s shape (``clusters``: shape ->
    cluster, least recently used first): started on first use, and again if
    one of its tasks exited; the least recently used one is stopped when
    MAX_CLUSTERS are up."""
    from tf_asyncps.cluster import LocalCluster
    shape = (run["num_workers"], run.get("num_ps", 1))
    c = clusters.pop(shape, None)
    if c is not None and any(p.poll() is not None for p in c.procs.values()):
        c.stop()
        c = None
    if c is None:
        while len(clusters) >= MAX_CLUSTERS:
            clusters.pop(next(iter(clusters))).stop()
        c = LocalCluster(num_workers=shape[0], num_ps=shape[1], hosts=hosts).start()
    clusters[shape] = c  # now the most recently used
    return c


def _reset_peak(pid: int) -> None:
    """Resets a process's peak resident memory (VmHWM) to its current size
    (Linux ``/proc/PID/clear_refs``, 5); where that is refused the peak
    stays the process's own since its start."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _run_child(run, settings, timeout_s, hosts=None):
    """One repeat of ``run`` in its own process: (result, None) or (None, error)."""
    if hosts is not None:
        settings = dict(settings, hosts=hosts.spec())
    cmd = [sys.executable, "-m", "tf_asyncps.app.bench", json.dumps(run), json.dumps(settings)]
    if hosts is not None:
        cmd = hosts.exec_argv("chief:0", cmd)
    # The run uses tf_keras: TensorFlow's import then loads tf_keras's
    # optimizers instead of Keras 3's (0.7 s less of each run's start-up).
    env = dict(os.environ, TF_USE_LEGACY_KERAS="1")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True, env=env)
    try:
        output, _ = proc.communicate(timeout=timeout_s)
        error = None if proc.returncode == 0 else f"exit status {proc.returncode}"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        error = f"timed out after {timeout_s:g} s"
    for line in (output or "").splitlines():
        if line.startswith("BENCH_RESULT: "):
            return json.loads(line[len("BENCH_RESULT: "):]), None
    tail = "\n".join((output or "").splitlines()[-8:])
    return None, (error or "no result") + (f"\n{tail}" if tail else "")


#: Per-repeat numbers reported as a median and a [min, max] range.
SPREAD_KEYS = ("steps_per_sec", "examples_per_sec", "updates_per_sec", "test_accuracy",
               "steps_to_target", "seconds_to_target", "bytes_sent_per_step",
               "bytes_received_per_step", "bytes_per_step", "limit_bytes_per_step",
               "all_links_bytes_per_step", "test_auc", "test_loss", "cpu_s_per_step_total",
               "flush_bytes_per_step", "heldout_loss")


def spread(values) -> Optional[Dict[str, float]]:
    """``{"median", "min", "max"}`` of the numbers in ``values`` (None
    entries skipped), or None if there are none."""
    xs = sorted(v for v in values if v is not None)
    if not xs:
        return None
    n = len(xs)
    median = xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2
    return {"median": median, "min": xs[0], "max": xs[-1]}


def aggregate_repeats(run: Dict[str, Any], repeats: List[Dict[str, Any]]) -> Dict[str, Any]:
    """One run's entry from its repeats (each a :func:`run_one` result or
    ``{"error": ...}``).

    The entry has the run's settings; ``repeats`` (every repeat as measured);
    for each of ``SPREAD_KEYS`` the median under the key itself and
    ``KEY_range`` = [min, max]; the median repeat's ``segments`` and
    ``staleness``; ``peak_rss_mb`` per task, the highest over the repeats. If every repeat failed, ``error`` (the first one's).
    A target not reached in some repeats: ``steps_to_target`` is the median
    of those that reached it and ``target_reached`` counts them.
    """
    entry = dict(run)
    entry["repeats"] = repeats
    ok = [r for r in repeats if "error" not in r]
    entry["failed_repeats"] = len(repeats) - len(ok)
    if not ok:
        entry["error"] = repeats[0]["error"] if repeats else "no repeat ran"
        return entry
    for key in SPREAD_KEYS:
        sp = spread(r.get(key) for r in ok)
        entry[key] = None if sp is None else sp["median"]
        entry[f"{key}_range"] = None if sp is None else [sp["min"], sp["max"]]
    entry["target_reached"] = sum(1 for r in ok if r.get("steps_to_target") is not None)
    # The repeat whose steps/s is the median (the lower middle one for an
    # even count) supplies the segments and the staleness counters.
    peaks = [r.get("peak_rss_mb") or {} for r in ok]
    entry["peak_rss_mb"] = {  # per task: the highest over the repeats
        k: max((p[k] for p in peaks if p.get(k) is not None), default=None)
        for k in sorted({k for p in peaks for k in p})}
    if any(r.get("cpu_s_per_step") for r in ok):  # NAME@ctr: CPU per step by task
        tasks = sorted({t for r in ok for t in r.get("cpu_s_per_step") or {}})
        sp = {t: spread((r.get("cpu_s_per_step") or {}).get(t) for r in ok) for t in tasks}
        entry["cpu_s_per_step"] = {t: v and v["median"] for t, v in sp.items()}
        entry["cpu_s_per_step_range"] = {t: v and [v["min"], v["max"]] for t, v in sp.items()}
    middle = sorted(ok, key=lambda r: r["steps_per_sec"])[(len(ok) - 1) // 2]
    entry["segments"] = middle["segments"]
    entry["staleness"] = middle.get("staleness")
    return entry


def main_child(argv: List[str]) -> None:
    result = run_one(json.loads(argv[1]), json.loads(argv[2]))
    print("BENCH_RESULT: " + json.dumps(result), flush=True)
    sys.stdout.flush()
    os._exit(0)  # skip TF's teardown against the stopped cluster


if __name__ == "__main__":
    main_child(sys.argv)
