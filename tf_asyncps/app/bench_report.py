"""The bench's report: ratios, target verdicts, ``bench.md`` and the plots.

:func:`summarize` turns the runs of :func:`tf_asyncps.app.bench.run_all`
into the ``bench.json`` document (ratios of medians with the range of the
per-repeat ratios, and each target's verdict), :func:`markdown` into the
table of ``bench.md``, :func:`write_outputs` writes both and the PNG plots.
"""

import json
import os
import platform
from typing import Any, Dict, List

from tf_asyncps.app.bench import MODELS

__all__ = ["summarize", "markdown", "write_outputs", "ratio", "verdict", "peak_by_kind",
           "TARGETS", "CTR_TARGETS",
           "LOCAL_SGD_TARGETS", "BACKUP_TARGET", "HOSTS_TARGETS"]

#: The CTR runs (NAME@ctr, issue 39 item 6): best@ctr's CPU and bytes per
#: worker step at most these times vanilla PSS's (26 tables) and the one-table
#: vanilla's, its held-out log loss at most 1.03x and AUC at least -0.005 from
#: vanilla's; async's CPU at most vanilla's on each model; on rate-limited
#: links best@ctr's steps/s at least 2x vanilla's.
CTR_TARGETS = {"best_cpu_x_vanilla": 0.5, "best_cpu_x_one_table": 0.75,
               "best_bytes_x_vanilla": 0.3, "best_loss_x_vanilla": 1.03,
               "best_auc_vs_vanilla": -0.005, "async_cpu_x_vanilla": 1.0,
               "best_x_vanilla_netns": 2.0}
#: Throughput ratios to vanilla PSS (same model) that the project aims for.
TARGETS = {"async": 0.95, "drop_stale": 0.95, "staleness_aware": 0.95,
           "dc_asgd": 0.85, "async+locking": 0.85}
#: local_sgd per model: ratio to single-process and to vanilla; test accuracy.
LOCAL_SGD_TARGETS = {"mlp": {"x_single": 0.35, "x_vanilla": 3.0},
                     "mlp_1m": {"x_single": 0.7, "x_vanilla": 3.0}, "accuracy": 0.90}
#: Applied updates/s of (N-1)-of-N over N-of-N with one slowed worker.
BACKUP_TARGET = 2.0
#: ``--bench_hosts=netns`` (links at --bench_bandwidth_mbit): local_sgd's
#: steps/s over vanilla PSS, and its test accuracy minus vanilla's (>= -0.01:
#: within 1 point).
HOSTS_TARGETS = {"x_vanilla": 5.0, "accuracy_vs_vanilla": -0.01,
                 # async over a bfloat16 wire: steps/s over vanilla PSS (#24).
                 "bf16_x_vanilla": 1.8}


def _paired(a, b, key, combine):
    """[min, max] of ``combine(a[k], b[k])`` over the repeats k that both
    completed (repeat k of one run beside repeat k of the other; a pair
    whose ``combine`` is None is skipped), or None if there is none."""
    out = []
    for x, y in zip(a.get("repeats") or [a], b.get("repeats") or [b]):
        if "error" in x or "error" in y or x.get(key) is None or y.get(key) is None:
            continue
        v = combine(x[key], y[key])
        if v is not None:
            out.append(v)
    return [min(out), max(out)] if out else None


def ratio(a, b, key="steps_per_sec"):
    """(median(a) / median(b), [min, max] of the paired per-repeat ratios)."""
    if not b.get(key) or a.get(key) is None:
        return None, None
    return a[key] / b[key], _paired(a, b, key, lambda x, y: x / y if y else None)


def verdict(value, value_range, target, at_most: bool = False) -> str:
    """"met" when the whole range clears ``target`` (is >= it; <= it with
    ``at_most``), "not met" when all of it falls short, "unclear" when it
    straddles; "no data" without a value."""
    if value is None:
        return "no data"
    lo, hi = value_range or (value, value)
    if at_most:
        lo, hi, target = -hi, -lo, -target
    if lo >= target:
        return "met"
    if hi < target:
        return "not met"
    return "unclear"


def _by_name(results):
    return {r["name"]: r for r in results if "error" not in r}


def _suffix(model):
    return {"mlp": "", "emb": "@emb", "ctr": "@ctr"}.get(model, "@1m")


def summarize(results: List[Dict[str, Any]], settings: Dict[str, Any]) -> Dict[str, Any]:
    """Adds ratios (of medians, with ranges; each to the baselines of the
    same model) and target checks; returns the bench.json document."""
    ok = _by_name(results)
    for r in results:
        if "error" in r:
            continue
        sfx = _suffix(r.get("model", "mlp"))
        for name, base in (("x_vanilla", ok.get("vanilla" + sfx)),
                           ("x_single", ok.get("single" + sfx))):
            r[name], r[f"{name}_range"] = ratio(r, base) if base else (None, None)
        base = ok.get("vanilla" + sfx)
        r["x_vanilla_bytes"], r["x_vanilla_bytes_range"] = (
            ratio(r, base, "bytes_per_step") if base else (None, None))
        if r.get("cpu_s_per_step_total") is not None:
            r["x_vanilla_cpu"], r["x_vanilla_cpu_range"] = (
                ratio(r, base, "cpu_s_per_step_total") if base else (None, None))
        # Bytes over the limit of the run's id stream (one stream: one limit).
        lim = r.get("limit_bytes_per_step")
        if lim and r.get("bytes_per_step") is not None:
            r["x_limit"] = r["bytes_per_step"] / lim
            r["x_limit_range"] = [x / lim for x in r["bytes_per_step_range"]]
        if lim and r.get("all_links_bytes_per_step") is not None:
            r["x_limit_all"] = r["all_links_bytes_per_step"] / lim
            r["x_limit_all_range"] = [x / lim for x in
                                      r.get("all_links_bytes_per_step_range")
                                      or [r["all_links_bytes_per_step"]] * 2]
    checks = []

    def check(what, value, value_range, target, at_most=False, spec=".2f"):
        v = verdict(value, value_range, target, at_most)
        checks.append({"check": what, "value": value, "range": value_range,
                       "target": target, "aim": f"{'<=' if at_most else '>='} {target:g}",
                       "verdict": v, "met": v == "met", "spec": spec})

    _ctr_checks(ok, settings, check)

    for model in MODELS:
        sfx, label = _suffix(model), f" ({model})"
        for name, target in TARGETS.items():
            r = ok.get(name + sfx)
            if r and r.get("x_vanilla") is not None:
                check(f"{name} throughput / vanilla PSS{label}", r["x_vanilla"],
                      r["x_vanilla_range"], target)
        bf16 = ok.get("async+bf16" + sfx)
        if bf16 and settings.get("bandwidth_mbit") and bf16.get("x_vanilla") is not None:
            check(f"async+bf16 throughput / vanilla PSS ({model}, "
                  f"{settings['bandwidth_mbit']:g} Mbit/s links)", bf16["x_vanilla"],
                  bf16["x_vanilla_range"], HOSTS_TARGETS["bf16_x_vanilla"])
        ls = ok.get("local_sgd" + sfx)
        if ls and settings.get("bandwidth_mbit"):
            at = f" ({model}, {settings['bandwidth_mbit']:g} Mbit/s links)"
            if ls.get("x_vanilla") is not None:
                check(f"local_sgd throughput / vanilla PSS{at}", ls["x_vanilla"],
                      ls["x_vanilla_range"], HOSTS_TARGETS["x_vanilla"])
            van = ok.get("vanilla" + sfx)
            if van:
                check(f"local_sgd test accuracy - vanilla PSS's{at}",
                      ls["test_accuracy"] - van["test_accuracy"],
                      _paired(ls, van, "test_accuracy", lambda x, y: x - y),
                      HOSTS_TARGETS["accuracy_vs_vanilla"])
        elif ls:
            for key, what in (("x_single", "single process"), ("x_vanilla", "vanilla PSS")):
                if ls.get(key) is not None:
                    check(f"local_sgd throughput / {what}{label}", ls[key],
                          ls[f"{key}_range"], LOCAL_SGD_TARGETS[model][key])
            check(f"local_sgd test accuracy{label}", ls["test_accuracy"],
                  ls.get("test_accuracy_range"), LOCAL_SGD_TARGETS["accuracy"])
    if "straggler_sync_all" in ok and "straggler_sync_backup" in ok:
        value, rng = ratio(ok["straggler_sync_backup"], ok["straggler_sync_all"],
                           key="updates_per_sec")
        check("sync_replicas with a backup worker: applied updates/s vs N-of-N",
              value, rng, BACKUP_TARGET)
    from importlib import metadata  # not TensorFlow itself: its import prints notices
    return {
        "machine": {"platform": platform.platform(), "python": platform.python_version(),
                    "cpus": os.cpu_count(), "tensorflow": metadata.version("tensorflow")},
        "settings": settings, "results": results, "checks": checks,
    }


def _ctr_checks(ok, settings, check) -> None:
    """The CTR runs' targets (CTR_TARGETS): CPU and bytes per worker step and
    held-out quality of best@ctr and async@ctr against vanilla PSS's."""
    van, one, best = ok.get("vanilla@ctr"), ok.get("vanilla_one_table@ctr"), ok.get("best@ctr")
    t = CTR_TARGETS
    cpu = "cpu_s_per_step_total"
    for name, base, what, target in (
            ("best@ctr", van, "vanilla PSS's", t["best_cpu_x_vanilla"]),
            ("best@ctr", one, "vanilla one-table's", t["best_cpu_x_one_table"]),
            ("async@ctr", van, "vanilla PSS's", t["async_cpu_x_vanilla"]),
            ("async_one_table@ctr", one, "vanilla one-table's", t["async_cpu_x_vanilla"])):
        r = ok.get(name)
        if r and base and r.get(cpu) is not None and base.get(cpu):
            check(f"{name} CPU per worker step / {what}", *ratio(r, base, cpu), target,
                  at_most=True)
    if not (best and van):
        return
    if best.get("bytes_per_step") is not None and van.get("bytes_per_step"):
        check("best@ctr bytes per worker step / vanilla PSS's",
              *ratio(best, van, "bytes_per_step"), t["best_bytes_x_vanilla"], at_most=True)
    if best.get("test_loss") is not None and van.get("test_loss"):
        check("best@ctr held-out log loss / vanilla PSS's", *ratio(best, van, "test_loss"),
              t["best_loss_x_vanilla"], at_most=True)
    if best.get("test_auc") is not None and van.get("test_auc") is not None:
        check("best@ctr held-out AUC - vanilla PSS's", best["test_auc"] - van["test_auc"],
              _paired(best, van, "test_auc", lambda x, y: x - y), t["best_auc_vs_vanilla"],
              spec=".4f")
    if settings.get("bandwidth_mbit"):
        check(f"best@ctr steps/s / vanilla PSS's ({settings['bandwidth_mbit']:g} Mbit/s "
              f"links)", *ratio(best, van), t["best_x_vanilla_netns"])


def _fmt(v, spec=".2f"):
    return "–" if v is None else format(v, spec)


def _fmt_range(v, rng, spec=".2f"):
    """``median (min-max)``; just the value when the range is one point."""
    if v is None:
        return "–"
    if not rng or rng[0] == rng[1]:
        return format(v, spec)
    return f"{format(v, spec)} ({format(rng[0], spec)}-{format(rng[1], spec)})"


def _rate(v):
    """Format of a rate: a decimal below 100 (bandwidth-bound runs: 2.2 steps/s)."""
    return ".1f" if v is not None and v < 100 else ".0f"


def _kb(r, key, spec=".0f"):
    v, rng = r.get(key), r.get(f"{key}_range")
    return _fmt_range(v / 1e3 if v is not None else None,
                      [x / 1e3 for x in rng] if rng else None, spec)


def markdown(bench: Dict[str, Any]) -> str:
    """The bench table (and target checks) as markdown."""
    s = bench["settings"]
    emb = [r for r in bench["results"] if r.get("model") == "emb"]
    ctr = [r for r in bench["results"] if r.get("model") == "ctr"]
    bench = dict(bench, results=[r for r in bench["results"]
                                 if r.get("model") not in ("emb", "ctr")])
    if not bench["results"]:  # embedding/CTR runs only: their tables, memory and time
        lines = []
        if emb:
            lines += _emb_table(emb, s, bench["machine"]) + [""]
        if ctr:
            lines += _ctr_table(ctr, s, bench["machine"]) + [""]
        lines += _memory_table(emb + ctr)
        if s.get("bench_wall_time_s") is not None:
            lines += ["", f"The bench ran {s['bench_wall_time_s'] / 60:.1f} min "
                      f"({len(emb) + len(ctr)} runs x {s.get('repeats', 1)} repeat(s))."]
        return "\n".join(lines + _checks_table(bench["checks"])) + "\n"
    net = any(r.get("bytes_sent_per_step") is not None for r in bench["results"])
    where = (f"each task on a host of its own (Linux network namespace), links limited "
             f"to {s['bandwidth_mbit']:g} Mbit/s each way (tc tbf); "
             if s.get("bandwidth_mbit") else
             "each task on a host of its own (Linux network namespace); "
             if s.get("hosts") else "")
    longer = "".join(f" ({r['name']}: {r['steps']})" for r in bench["results"]
                     if r.get("steps") not in (None, s["steps"]))
    lines = [
        f"Digits MLP 64-128-10 (runs NAME@1m: 64-1024-1024-10, 1.1M parameters), "
        f"SGD lr {s['learning_rate']}, batch {s['batch_size']} "
        f"per worker step, {s['steps']} worker steps per run{longer}, "
        f"{'ps tasks as listed' if any(r.get('scaling') for r in bench['results']) else '1 ps'}"
        f", {where}"
        f"{s.get('repeats', 1)} repeat(s) per run, interleaved: medians (min-max); "
        f"{bench['machine']['cpus']} CPUs, TensorFlow {bench['machine']['tensorflow']}, "
        f"{bench['machine']['platform']}.",
        "",
        "| run | workers | steps/closure | steps/s | examples/s | × vanilla | × single | "
        "updates/s | τ mean | τ max | dropped | steps to "
        f"{s['target_accuracy']:.0%} | s to {s['target_accuracy']:.0%} | test acc |"
        + (" KB sent / worker step | KB received / worker step |" if net else ""),
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|---|" if net else ""),
    ]
    for r in bench["results"]:
        if "error" in r:
            lines.append(f"| {r['name']} | {r['num_workers']} | {r['spe']} | failed: "
                         f"{r['error'].splitlines()[0]} |" + " |" * 10)
            continue
        st = r.get("staleness") or {}
        rate = _rate(r["steps_per_sec"])
        lines.append(
            f"| {r['name']} | {r['num_workers']} | {r['spe']} | "
            f"{_fmt_range(r['steps_per_sec'], r.get('steps_per_sec_range'), rate)} | "
            f"{r['examples_per_sec']:.0f} | "
            f"{_fmt_range(r.get('x_vanilla'), r.get('x_vanilla_range'))} | "
            f"{_fmt_range(r.get('x_single'), r.get('x_single_range'))} | "
            f"{_fmt(r.get('updates_per_sec'), _rate(r.get('updates_per_sec')))} | "
            f"{_fmt(st.get('mean'))} | {st.get('max', '–')} | {st.get('dropped', '–')} | "
            f"{r['steps_to_target'] or 'not reached'} | {_fmt(r['seconds_to_target'], '.1f')} | "
            f"{r['test_accuracy']:.3f} |"
            + (f" {_kb(r, 'bytes_sent_per_step')} | {_kb(r, 'bytes_received_per_step')} |"
               if net else ""))
    lines += _memory_table(bench["results"])
    if emb:
        lines += [""] + _emb_table(emb, s, bench["machine"])
    if ctr:
        lines += [""] + _ctr_table(ctr, s, bench["machine"])
    if s.get("bench_wall_time_s") is not None:
        lines += ["", f"The bench ran {s['bench_wall_time_s'] / 60:.1f} min "
                  f"({len(bench['results'])} runs x {s.get('repeats', 1)} repeat(s))."]
    return "\n".join(lines + _checks_table(bench["checks"])) + "\n"


def _checks_table(checks) -> List[str]:
    """The target checks: value, range, aim and verdict."""
    if not checks:
        return []
    lines = ["", "| target | measured: median (range) | aim | verdict |", "|---|---|---|---|"]
    for c in checks:
        v = c["verdict"]
        lines.append(f"| {c['check']} | "
                     f"{_fmt_range(c['value'], c.get('range'), c.get('spec', '.2f'))} | "
                     f"{c.get('aim', '>= ' + str(c['target']))} | "
                     f"{v if v == 'met' else '**' + v + '**'} |")
    return lines + ["", "A target is met when the whole range of the per-repeat values "
                    "clears the aim, not met when all of it falls short, and unclear when "
                    "it straddles the aim."]


def _ctr_table(results, s, machine) -> List[str]:
    """The CTR runs (NAME@ctr): steps/s, CPU per worker step by task, bytes per
    worker step beside vanilla's and the limit, held-out AUC and log loss."""
    from tf_asyncps.app import bench_ctr as c
    ok = [r for r in results if "error" not in r]
    rows = next((r["repeats"][0].get("rows") for r in ok
                 if r.get("repeats") and "rows" in r["repeats"][0]), None)
    tasks = sorted({t for r in ok for t in r.get("cpu_s_per_step") or {}} - {"chief", "single"})
    on = ("the workers' links (headers included)" if s.get("hosts") else
          "the workers' TCP connections (payload, kernel counters)")
    lines = [
        f"DLRM (bottom MLP {'-'.join(map(str, c.BOTTOM))}-{c.DIM}, rows of {c.DIM}, top MLP "
        f"{'-'.join(map(str, c.TOP))}-1) on the CTR job's Criteo-shaped data: 26 tables, "
        f"{'?' if rows is None else format(sum(rows), ',')} rows (--bench_ctr_max_rows="
        f"{ok[0]['max_rows'] if ok else '?'}, --bench_ctr_scale={ok[0]['scale'] if ok else '?'}"
        f"), Zipf({c.ZIPF_A}) ids, Adagrad({c.LEARNING_RATE}), {c.BATCH} examples per worker "
        f"step, {s['steps']} worker steps per run, {ok[0]['spe'] if ok else '?'} per closure, "
        f"2 workers and {c.NUM_PS} ps"
        + (f", links limited to {s['bandwidth_mbit']:g} Mbit/s" if s.get("bandwidth_mbit")
           else "") + f"; {s.get('repeats', 1)} repeat(s) per run, interleaved: medians "
        f"(min-max); {machine['cpus']} CPUs, TensorFlow {machine['tensorflow']}. CPU: ms of "
        f"each process (/proc/PID/stat) per worker step after the first segment. Bytes: "
        f"{on}, sent + received, per worker step. Limit: distinct (feature, id) pairs of a "
        f"batch x (8 B id + 4 B x {c.DIM}) both ways, plus the dense part's float32 "
        f"both ways. AUC and log loss: {c.TEST_EXAMPLES:,} held-out examples after the run.",
        "",
        "| run | steps/s | CPU ms / step | × vanilla CPU | chief (single) ms | "
        + " | ".join(f"{t} ms" for t in tasks) + " | KB / step | × vanilla bytes | limit KB | "
        "× limit | AUC | log loss |",
        "|---" * (11 + len(tasks)) + "|"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['name']} | failed: {r['error'].splitlines()[0]} |"
                         + " |" * (9 + len(tasks)))
            continue
        cpu, rng = r.get("cpu_s_per_step") or {}, r.get("cpu_s_per_step_range") or {}
        def ms(t):
            return _fmt_range(None if cpu.get(t) is None else cpu[t] * 1e3,
                              rng.get(t) and [x * 1e3 for x in rng[t]], ".1f")
        tot, tot_rng = r.get("cpu_s_per_step_total"), r.get("cpu_s_per_step_total_range")
        lim = r.get("limit_bytes_per_step")
        total = _fmt_range(None if tot is None else tot * 1e3,
                           tot_rng and [x * 1e3 for x in tot_rng], ".1f")
        lines.append(
            f"| {r['name']} | "
            f"{_fmt_range(r['steps_per_sec'], r.get('steps_per_sec_range'), '.1f')} | "
            f"{total} | "
            f"{_fmt_range(r.get('x_vanilla_cpu'), r.get('x_vanilla_cpu_range'))} | "
            f"{ms('chief') if 'chief' in cpu else ms('single')} | "
            + "".join(f"{ms(t)} | " for t in tasks)
            + f"{_kb(r, 'bytes_per_step', '.0f')} | "
            f"{_fmt_range(r.get('x_vanilla_bytes'), r.get('x_vanilla_bytes_range'))} | "
            f"{_fmt(None if lim is None else lim / 1e3, '.0f')} | "
            f"{_fmt_range(r.get('x_limit'), r.get('x_limit_range'))} | "
            f"{_fmt_range(r.get('test_auc'), r.get('test_auc_range'), '.4f')} | "
            f"{_fmt_range(r.get('test_loss'), r.get('test_loss_range'), '.4f')} |")
    return lines


def _emb_table(results, s, machine) -> List[str]:
    """The embedding runs (NAME@emb): steps/s and bytes per worker step
    beside vanilla's and the id stream's limit."""
    from tf_asyncps.app import bench_emb as e
    where = (f"links limited to {s['bandwidth_mbit']:g} Mbit/s each way (tc tbf)"
             if s.get("bandwidth_mbit") else "unlimited links")
    where = (f"each task on a host of its own, {where}" if s.get("hosts") else
             "every task on loopback (bytes: the TCP payload of the tasks' sockets, "
             "headers excluded)")
    lines = [
        f"Embedding({e.ROWS:,}, {e.DIM}) on {e.NUM_PS} ps (FixedShardsPartitioner), Dense(1), "
        f"Adagrad(0.1), {e.BATCH} Zipf({e.ZIPF_A}) ids per worker step, "
        f"{s['steps']} worker steps per run, {where}; "
        f"{s.get('repeats', 1)} repeat(s) per run, interleaved: medians (min-max); "
        f"{machine['cpus']} CPUs, TensorFlow {machine['tensorflow']}. Limit: the id "
        f"stream's distinct ids per batch x 272 B (id and row read, id and gradient row "
        f"pushed) plus the head, headers excluded. KB / worker step: the workers' links "
        f"(sent + received); all links: every host's sent bytes (the ps tasks' traffic "
        f"between themselves and the chief's too), per worker step. With a worker cache "
        f"the steps' bytes leave out its flushes at the joins (tf_keras fit joins at every "
        f"epoch end): closing traffic, in its own column per measured worker step.",
        "",
        "| run | workers | steps/closure | steps/s | × vanilla | KB sent / worker step | "
        "KB received / worker step | KB / worker step | × vanilla bytes | limit KB | "
        "× limit | KB all links / worker step | × limit, all links | flush KB / worker step |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['name']} | {r['num_workers']} | {r['spe']} | failed: "
                         f"{r['error'].splitlines()[0]} |" + " |" * 10)
            continue
        lim = r.get("limit_bytes_per_step")
        lines.append(
            f"| {r['name']} | {r['num_workers']} | {r['spe']} | "
            f"{_fmt_range(r['steps_per_sec'], r.get('steps_per_sec_range'), '.1f')} | "
            f"{_fmt_range(r.get('x_vanilla'), r.get('x_vanilla_range'))} | "
            f"{_kb(r, 'bytes_sent_per_step', '.1f')} | "
            f"{_kb(r, 'bytes_received_per_step', '.1f')} | {_kb(r, 'bytes_per_step', '.1f')} | "
            f"{_fmt_range(r.get('x_vanilla_bytes'), r.get('x_vanilla_bytes_range'))} | "
            f"{_fmt(None if lim is None else lim / 1e3, '.1f')} | "
            f"{_fmt_range(r.get('x_limit'), r.get('x_limit_range'))} | "
            f"{_kb(r, 'all_links_bytes_per_step', '.1f')} | "
            f"{_fmt_range(r.get('x_limit_all'), r.get('x_limit_all_range'))} | "
            f"{_kb(r, 'flush_bytes_per_step', '.1f')} |")
    return lines


def peak_by_kind(r) -> Dict[str, Any]:
    """A run's peak memory (MB, highest over the repeats) of the chief (or the
    single process), and the highest of its ps tasks and of its workers."""
    peak = r.get("peak_rss_mb") or {}

    def top(prefix):
        vals = [v for k, v in peak.items() if k.startswith(prefix) and v is not None]
        return max(vals) if vals else None

    return {"chief": peak.get("chief", peak.get("single")), "ps": top("ps:"),
            "worker": top("worker:")}


def _memory_table(results) -> List[str]:
    """Peak memory per task; for --bench_scaling runs also workers, ps tasks
    and steps/s relative to 1 worker and 1 ps."""
    ok = [r for r in results if "error" not in r and r.get("peak_rss_mb")]
    if not ok:
        return []
    scaling = any(r.get("scaling") for r in ok)
    base = next((r for r in ok if r.get("num_workers") == 1 and r.get("num_ps") == 1), None)
    head = ("| run | workers | ps | steps/s | × 1 worker, 1 ps | " if scaling else "| run | ")
    lines = ["", "Peak memory per task (MB, VmHWM; the highest over the repeats). The "
             "ps and worker tasks of a shape serve all its runs, so their figures also "
             "hold what earlier runs left there:", "",
             head + "chief (or single) MB | ps MB (max) | worker MB (max) |",
             "|---" * (head.count("|") + 2) + "|"]
    for r in ok:
        m = peak_by_kind(r)
        row = f"| {r['name']} | "
        if scaling:
            x, rng = ratio(r, base) if base else (None, None)
            row += (f"{r['num_workers']} | {r.get('num_ps', 1)} | "
                    f"{_fmt_range(r['steps_per_sec'], r.get('steps_per_sec_range'), '.0f')} | "
                    f"{_fmt_range(x, rng)} | ")
        lines.append(row + f"{_fmt(m['chief'], '.0f')} | {_fmt(m['ps'], '.0f')} | "
                           f"{_fmt(m['worker'], '.0f')} |")
    return lines


def write_outputs(bench: Dict[str, Any], output_dir: str) -> List[str]:
    """Writes bench.json, bench.md and the PNG plots; returns the paths."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(output_dir, exist_ok=True)
    paths = [os.path.join(output_dir, n) for n in
             ("bench.json", "bench.md", "throughput.png", "accuracy.png", "staleness.png")]
    with open(paths[0], "w") as f:
        json.dump(bench, f, indent=2)
    with open(paths[1], "w") as f:
        f.write(markdown(bench))
    ok = [r for r in bench["results"] if "error" not in r]

    fig, ax = plt.subplots(figsize=(9, 4))
    med = [r["steps_per_sec"] for r in ok]
    rng = [r.get("steps_per_sec_range") or [m, m] for r, m in zip(ok, med)]
    ax.bar([r["name"] for r in ok], med,
           yerr=[[m - lo for m, (lo, _) in zip(med, rng)],
                 [hi - m for m, (_, hi) in zip(med, rng)]], capsize=4)
    ax.set_ylabel("worker steps / s")
    ax.set_title("Throughput after the first segment: median, min-max over repeats")
    ax.tick_params(axis="x", rotation=45)
    fig.tight_layout()
    fig.savefig(paths[2], dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in ok:
        if r["segments"][0].get("test_accuracy") is None:
            continue  # NAME@emb: no test set
        xs, ys, t = [], [], 0.0
        for seg in r["segments"]:
            t += seg["seconds"]
            xs.append(t)
            ys.append(seg["test_accuracy"])
        ax.plot(xs, ys, marker="o", label=r["name"])
    ax.axhline(bench["settings"]["target_accuracy"], color="gray", linestyle="--")
    ax.set_xlabel("training seconds")
    ax.set_ylabel("test accuracy")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(paths[3], dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in ok:
        st = r.get("staleness")
        if st and sum(st["histogram"]):
            h = st["histogram"]
            last = max(i for i, c in enumerate(h) if c) + 1
            total = float(sum(h))
            ax.plot(range(last), [c / total for c in h[:last]], marker=".", label=r["name"])
    ax.set_xlabel("staleness τ (global steps; local_sgd: exchanges)")
    ax.set_ylabel("fraction of applied updates")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(paths[4], dpi=100)
    plt.close(fig)
    return paths


