"""``tf-asyncps bench``: the command and its flags (the runs: bench.py; the
report: bench_report.py). It also uses the common flags --num_workers,
--batch_size, --learning_rate, --seed and --output_dir (shared_flags.py)."""

import contextlib
import os
import time

from absl import flags

from tf_asyncps.app.console import sigterm_as_ctrl_c

__all__ = ["cmd_bench"]

FLAGS = flags.FLAGS

flags.DEFINE_list("bench_only", [], "bench: run only these runs (default: all), e.g. "
                  "single,vanilla,async,local_sgd; with --bench_hosts=netns, emb: the "
                  "embedding runs vanilla@emb,async@emb,async+dedup@emb (local_sgd@emb, "
                  "dynamic@emb: by name); ctr: the CTR runs (single@ctr, vanilla@ctr, "
                  "vanilla_one_table@ctr, async@ctr, async_one_table@ctr, async_bf16@ctr, "
                  "best@ctr, keras3@ctr; loopback or netns; only when named; by name "
                  "only: async_nodedup@ctr, async_nocheck@ctr, best_f32@ctr, "
                  "collection_bf16@ctr, best_sum@ctr: best@ctr with "
                  "LocalSteps(16, exchange='sum')).")
flags.DEFINE_integer("bench_steps", 960, "bench: worker steps per run.", lower_bound=1)
flags.DEFINE_integer("bench_eval_every", 320, "bench: worker steps between test-accuracy "
                     "checks (a multiple of the steps per closure).", lower_bound=1)
flags.DEFINE_integer("bench_steps_per_execution", 16, "bench: worker steps per closure "
                     "(fit's steps_per_execution) for every run but the straggler pair.",
                     lower_bound=1)
flags.DEFINE_integer("bench_sync_every", 16, "bench: local_sgd's sync_every (also its steps "
                     "per closure).", lower_bound=1)
flags.DEFINE_float("bench_target_accuracy", 0.90, "bench: test accuracy for the "
                   "steps/seconds-to-target columns.", lower_bound=0.0, upper_bound=1.0)
flags.DEFINE_integer("bench_straggler_workers", 4, "bench: workers N of the sync_replicas "
                     "N-of-N vs (N-1)-of-N straggler pair.", lower_bound=2)
flags.DEFINE_integer("bench_straggler_steps", 640, "bench: worker steps of each run of the "
                     "straggler pair (0: --bench_steps); one step per closure with a slowed "
                     "worker makes them the slowest runs.", lower_bound=0)
flags.DEFINE_integer("bench_1m_steps", 640, "bench: worker steps of each run on the "
                     "1.1M-parameter model (NAME@1m; 0: --bench_steps).", lower_bound=0)
flags.DEFINE_float("bench_straggler_delay_ms", 100.0, "bench: delay per step (ms) of the "
                   "slowed worker in the straggler pair.", lower_bound=0.0)
flags.DEFINE_integer("bench_repeats", 3, "bench: times each run is repeated (interleaved); "
                     "figures are medians with their min-max range.", lower_bound=1)
flags.DEFINE_enum("bench_hosts", "local", ["local", "netns"],
                  "bench: local: every task on loopback (all runs); netns: each task on "
                  "a host of its own (a Linux network namespace, needs root) with links "
                  "of --bench_bandwidth_mbit, comparing vanilla, async, local_sgd and "
                  "sync_replicas on the 1.1M-parameter MLP, and vanilla, async without "
                  "and with lookup de-duplication on a 1M x 32 embedding over 2 ps "
                  "(NAME@emb; --bench_only=emb runs just those) (defaults then: "
                  "--bench_steps=320 --bench_eval_every=64).")
flags.DEFINE_integer("bench_hosts_local_sgd_steps", 1920, "bench --bench_hosts=netns: "
                     "worker steps of the local_sgd run (0: --bench_steps). At equal steps "
                     "local_sgd lags (a worker sees the others' updates once per window), so "
                     "its accuracy is compared after a longer run; it still takes less time "
                     "than vanilla's.", lower_bound=0)
flags.DEFINE_float("bench_bandwidth_mbit", 100.0, "bench --bench_hosts=netns: each host's "
                   "link rate in Mbit/s, each way (tc tbf); 0: unlimited.", lower_bound=0.0)
flags.DEFINE_boolean("bench_scaling", False, "bench: instead of the policy runs, async on "
                     "the digits MLP with 1, 2 and 4 workers and 1 and 2 ps tasks: steps/s "
                     "and peak memory per task as the cluster grows.")
flags.DEFINE_integer("bench_ctr_max_rows", 1_000_000, "bench NAME@ctr runs: rows per "
                     "categorical feature at most (the Criteo Kaggle cardinalities capped; "
                     "1000000: the issue's 5.57M rows; 20000 runs here in minutes).",
                     lower_bound=1)
flags.DEFINE_float("bench_ctr_scale", 1.0, "bench NAME@ctr runs: each feature's rows "
                   "(after --bench_ctr_max_rows) times this, in (0, 1].")
flags.DEFINE_list("bench_emb_zipf", ["0.8", "1.0", "1.2"], "bench run set cache_sweep "
                  "(--bench_only=cache_sweep; loopback or netns; issue 40's embedding cache "
                  "sweep): the Zipf exponents of its id streams (ranks 1..1M with P(k) "
                  "proportional to k**-a, each >= 0); per exponent one uncached run "
                  "(async+dedup_zA@emb) and the cached runs cache_zA_rP_bB@emb.")
flags.DEFINE_list("bench_cache_rows_pct", ["1", "5"], "bench run set cache_sweep: cache "
                  "sizes, % of the table's 1M rows per worker, each in (0, 100].")
flags.DEFINE_list("bench_cache_bounds", ["0", "1", "5", "20"], "bench run set cache_sweep: "
                  "the cache's bounds (pull_bound = push_bound), ints >= 0.")
flags.DEFINE_float("bench_run_timeout_s", 300.0, "bench: seconds before one run is stopped "
                   "and reported as failed.", lower_bound=1.0)



def _steps_flag(run) -> str:
    """The flag that set a run's own length."""
    if run.get("straggler"):
        return "bench_straggler_steps"
    return "bench_hosts_local_sgd_steps" if run.get("hosts") else "bench_1m_steps"


def _eval_every_for(steps: int, runs) -> int:
    """The largest --bench_eval_every that ``steps`` allows (a multiple of every
    run's steps per closure that divides ``steps`` at least twice), else the
    smallest multiple of those."""
    import math
    unit = math.lcm(*[r["spe"] for r in runs]) if runs else 1
    for every in range(steps // 2 // unit * unit, 0, -unit):
        if steps % every == 0:
            return every
    return unit


_SWEEP_FLAGS = (("bench_emb_zipf", float), ("bench_cache_rows_pct", float),
                ("bench_cache_bounds", int))


def _sweep_runs(swept: bool, netns: bool):
    """The cache sweep's runs (bench_emb.sweep_configs) when --bench_only
    names it, from its flags; else [].

    Raises:
      ValueError: a sweep flag without the run set, or a value that is not
        a number of the flag's type, naming the flag.
    """
    from tf_asyncps.app import bench_emb
    given = [f for f, _ in _SWEEP_FLAGS if FLAGS[f].present]
    if not swept:
        if given:
            raise ValueError(f"--{given[0]} sets the runs of the cache sweep; add "
                             f"{bench_emb.SWEEP} to --bench_only or drop it.")
        return []
    values = {}
    for flag, kind in _SWEEP_FLAGS:
        try:
            values[flag] = [kind(v) for v in FLAGS[flag].value]
        except ValueError:
            raise ValueError(f"--{flag}={','.join(FLAGS[flag].value)}: each value must be "
                             f"{'an int' if kind is int else 'a number'}.") from None
    return bench_emb.sweep_configs(
        values["bench_emb_zipf"], values["bench_cache_rows_pct"],
        values["bench_cache_bounds"], num_workers=FLAGS["num_workers"].value,
        steps_per_execution=FLAGS["bench_steps_per_execution"].value, hosts=netns)


def cmd_bench(argv):
    from tf_asyncps.app import bench, bench_emb
    netns = FLAGS.bench_hosts == "netns"
    only, swept = bench_emb.split_sweep(FLAGS.bench_only)
    if FLAGS["bench_bandwidth_mbit"].present and not netns:
        raise ValueError("--bench_bandwidth_mbit limits the links of --bench_hosts=netns; add "
                         "--bench_hosts=netns or drop it.")
    if FLAGS.bench_scaling and netns:
        raise ValueError("--bench_scaling runs on loopback; drop --bench_hosts=netns (or "
                         "--bench_scaling).")
    if FLAGS.bench_scaling and swept:
        raise ValueError(f"--bench_scaling replaces the policy runs; drop it or "
                         f"{bench_emb.SWEEP} from --bench_only.")
    sweep = _sweep_runs(swept, netns)
    ctr = {"max_rows": FLAGS.bench_ctr_max_rows, "scale": FLAGS.bench_ctr_scale}
    if FLAGS.bench_scaling:
        runs = bench.scaling_configs(steps_per_execution=FLAGS.bench_steps_per_execution,
                                     only=only or None)
    elif netns:
        runs = bench.hosts_configs(
            num_workers=FLAGS.num_workers, sync_every=FLAGS.bench_sync_every,
            steps_per_execution=FLAGS.bench_steps_per_execution,
            only=only or None,
            local_sgd_steps=FLAGS.bench_hosts_local_sgd_steps or None, ctr=ctr)
        # Bandwidth-bound steps are slow: shorter runs unless asked.
        if not FLAGS["bench_steps"].present:
            FLAGS.bench_steps = 320
        if not FLAGS["bench_eval_every"].present:
            FLAGS.bench_eval_every = 64
    else:
        runs = bench.default_configs(
            num_workers=FLAGS.num_workers, sync_every=FLAGS.bench_sync_every,
            steps_per_execution=FLAGS.bench_steps_per_execution,
            straggler_workers=FLAGS.bench_straggler_workers,
            straggler_delay_ms=FLAGS.bench_straggler_delay_ms, only=only or None,
            straggler_steps=FLAGS.bench_straggler_steps or None,
            large_model_steps=FLAGS.bench_1m_steps or None, ctr=ctr)
    if swept:  # the sweep alone, or beside the runs named with it
        runs = (runs if only else []) + sweep
    for r in runs:
        if FLAGS.bench_eval_every % r["spe"]:
            raise ValueError(f"--bench_eval_every={FLAGS.bench_eval_every} must be a multiple "
                             f"of the steps per closure of run {r['name']} ({r['spe']}).")
    for flag, steps in [("bench_steps", FLAGS.bench_steps)] + [
            (_steps_flag(r), r["steps"]) for r in runs if "steps" in r]:
        if steps % FLAGS.bench_eval_every or steps < 2 * FLAGS.bench_eval_every:
            raise ValueError(
                f"--{flag}={steps} must be a multiple of --bench_eval_every="
                f"{FLAGS.bench_eval_every} and at least twice it (the first segment includes "
                "tracing and is left out of steps/s); e.g. "
                f"--bench_eval_every={_eval_every_for(steps, runs)}.")
    out = FLAGS.output_dir or os.path.join("runs", "bench")
    from tf_asyncps.app.flag_checks import check_writable_dir
    # Now, not after the runs:
    check_writable_dir(out, "--output_dir", "bench.json, bench.md and the plots")
    settings = {"batch_size": FLAGS.batch_size, "learning_rate": FLAGS.learning_rate,
                "seed": FLAGS.seed, "steps": FLAGS.bench_steps,
                "eval_every": FLAGS.bench_eval_every,
                "target_accuracy": FLAGS.bench_target_accuracy,
                "repeats": FLAGS.bench_repeats}
    print(f"tf-asyncps bench: {len(runs)} runs x {FLAGS.bench_repeats} repeats (interleaved), "
          f"{FLAGS.bench_steps} worker steps each; results in {out}/", flush=True)
    # SIGTERM stops the bench like Ctrl-C: its hosts are removed on the way out.
    sigterm_as_ctrl_c()
    with contextlib.ExitStack() as stack:
        hosts = None
        if netns:
            from tf_asyncps.cluster import LocalCluster, NetnsHosts
            settings["hosts"] = True
            settings["bandwidth_mbit"] = FLAGS.bench_bandwidth_mbit or None
            num_ps = max(r.get("num_ps", 1) for r in runs)  # 2 for the NAME@emb runs
            hosts = stack.enter_context(NetnsHosts(LocalCluster.host_names(FLAGS.num_workers,
                                                                           num_ps),
                                                   rate_mbit=settings["bandwidth_mbit"]))
            print(f"tf-asyncps bench: hosts {hosts}", flush=True)
        t0 = time.perf_counter()
        results = bench.run_all(runs, settings, timeout_s=FLAGS.bench_run_timeout_s,
                                say=lambda s: print(s, flush=True),
                                repeats=FLAGS.bench_repeats, hosts=hosts)
        settings["bench_wall_time_s"] = round(time.perf_counter() - t0, 1)
    from tf_asyncps.app import bench_report
    doc = bench_report.summarize(results, settings)
    paths = bench_report.write_outputs(doc, out)
    print(bench_report.markdown(doc), flush=True)
    if swept:  # its own table: rows read and written, hit rate, held-out loss
        table = "\n".join(bench_emb.sweep_table(doc["results"])) + "\n"
        paths.append(os.path.join(out, "cache_sweep.md"))
        with open(paths[-1], "w") as f:
            f.write(table)
        print(table, flush=True)
    print("wrote " + ", ".join(paths), flush=True)
    failed = [r["name"] for r in results if "error" in r]
    if failed:
        raise RuntimeError(f"runs failed: {failed} (see {paths[1]}).")
