"""``tf-asyncps launch``: a local cluster of real processes (ps, workers and
the chief's ``train``) and its own flags; the job's flags: shared_flags.py."""

import contextlib
import os
import sys
import time

from absl import flags, logging

from tf_asyncps.app import job_config
from tf_asyncps.app.console import sigterm_as_ctrl_c
from tf_asyncps.app.shared_flags import EXIT_LOST_TASK, job_settings

__all__ = ["cmd_launch"]

FLAGS = flags.FLAGS

flags.DEFINE_integer("num_ps", 1, "launch: parameter-server processes.", lower_bound=1)
flags.DEFINE_float("timeout_s", 1800.0, "launch: seconds before the whole job is stopped.",
                   lower_bound=1.0)
flags.DEFINE_integer("gpus_per_worker", 0,
                     "launch: GPUs each worker process sees (worker i: GPUs i*K..i*K+K-1 via "
                     "CUDA_VISIBLE_DEVICES); ps and chief see none. 0: CPU workers. "
                     "K > 1: K replicas per worker step, their gradients summed into "
                     "one update (docs/guides/gpu.md).", lower_bound=0)
flags.DEFINE_boolean("restart_failed_tasks", False,
                     "launch: supervise the children. A ps or worker that exits is "
                     "restarted on its port (a worker rejoins by itself); a chief that "
                     "lost a task (exit status 75, e.g. its ps died) or was killed by a "
                     "signal is re-run and resumes from --backup_dir; other chief errors "
                     "would recur and are not re-run. At most --max_restarts restarts "
                     "per task.")
flags.DEFINE_integer("max_restarts", 3, "launch --restart_failed_tasks: restarts allowed "
                     "per task (chief re-runs included).", lower_bound=0)
flags.DEFINE_enum("hosts", "local", ["local", "netns"],
                  "launch: where the tasks run. local: every task on loopback; netns: "
                  "each task (chief, ps, workers) on a host of its own, a Linux network "
                  "namespace with an address in 198.18.0.0/24 on one virtual switch "
                  "(needs root; removed when launch ends).")
flags.DEFINE_float("host_bandwidth_mbit", 0.0,
                   "launch --hosts=netns: each host's link rate in Mbit/s, each way "
                   "(tc tbf); 0: unlimited.", lower_bound=0.0)


class _ShowAll(contextlib.nullcontext):
    """launch --console=full: fd 2 stays the console (NativeStderrFilter's stand-in)."""

    def release(self) -> None:
        pass


def cmd_launch(argv):
    # The flags are checked first, without TensorFlow: a bad one is refused at once.
    cfg, backup_default, gpu_plan = _launch_checks()
    from tf_asyncps.app.console import NativeStderrFilter
    # This process imports TensorFlow to check the policy; TensorFlow's C++
    # start-up notices (written to fd 2 whatever TF_CPP_MIN_LOG_LEVEL says)
    # stay off the console; any other output of the checks is shown after.
    quiet = _ShowAll() if FLAGS.console == "full" else NativeStderrFilter()
    with quiet:
        return _launch(argv, cfg, backup_default, gpu_plan, quiet)


def _launch_checks():
    """launch's checks that need no TensorFlow: memory, GPUs, the job's flags.
    Returns ``(JobConfig, whether --backup_dir was defaulted, the GPU plan)``."""
    from tf_asyncps.cluster import devices
    devices.check_memory(FLAGS.num_workers, FLAGS.num_ps, devices.available_memory_mb())
    if FLAGS["gpus"].present:
        raise ValueError("--gpus is for `train`/`server` tasks started by hand; launch gives "
                         "each worker its GPUs with --gpus_per_worker=K.")
    if FLAGS.gpus_per_worker > 1 and FLAGS.policy == "local_sgd":  # before counting GPUs
        raise ValueError(devices.local_copies_replicas_message(
            FLAGS.policy, FLAGS.gpus_per_worker, FLAGS.num_workers))
    if FLAGS.host_bandwidth_mbit and FLAGS.hosts != "netns":
        raise ValueError("--host_bandwidth_mbit limits the links of --hosts=netns; add "
                         "--hosts=netns or drop it.")
    backup_default = bool((FLAGS.restart_failed_tasks or FLAGS.backup_every_steps) and
                          not FLAGS.backup_dir)
    if backup_default:
        # A chief re-run must find the checkpoints of the run that failed.
        if FLAGS.output_dir:
            FLAGS.backup_dir = os.path.join(FLAGS.output_dir, "backup")
        else:
            import tempfile
            FLAGS.backup_dir = tempfile.mkdtemp(prefix="tf_asyncps_backup_")
    cfg = job_settings()  # bad flags fail here, before TensorFlow and any process
    gpu_plan = devices.plan_gpus(
        FLAGS.num_workers, FLAGS.gpus_per_worker,
        devices.available_gpus() if FLAGS.gpus_per_worker else (),
        memory_growth=os.environ.get(devices.ALLOW_GROWTH, "true").lower() != "false")
    return cfg, backup_default, gpu_plan


def _launch(argv, cfg, backup_default, gpu_plan, quiet):
    from tf_asyncps import cluster
    from tf_asyncps.cluster import devices
    from tf_asyncps.compat import startup as startup_compat
    startup_compat.import_without_keras()  # for the checks below; this process runs no Keras
    cfg.validate()
    policy = job_config.make_policy(cfg.policy, cfg.policy_args)
    policy.validate_cluster(FLAGS.num_workers)
    if policy.local_copies and FLAGS.gpus_per_worker > 1:  # a registered local-copy policy
        raise ValueError(devices.local_copies_replicas_message(
            cfg.policy, FLAGS.gpus_per_worker, FLAGS.num_workers))
    if cfg.dataset not in ("digits", "criteo_synthetic"):  # may need a download: fail before starting anything
        from tf_asyncps.app import datasets
        datasets.load(cfg.dataset, seed=cfg.seed)
    if os.environ.get("TF_CONFIG"):
        logging.warning("launch ignores TF_CONFIG: it makes its own local cluster.")
    log_dir = os.path.join(FLAGS.output_dir, "logs") if FLAGS.output_dir else None
    args = [a for a in sys.argv[1:] if a != "launch"]
    if backup_default:
        args.append(f"--backup_dir={FLAGS.backup_dir}")
    # SIGTERM (e.g. from a scheduler) stops the job like Ctrl-C.
    sigterm_as_ctrl_c()
    quiet.release()  # the checks are done: fd 2 is the console again
    t0 = time.perf_counter()
    with contextlib.ExitStack() as stack:
        hosts = None
        if FLAGS.hosts == "netns":
            hosts = stack.enter_context(cluster.NetnsHosts(
                cluster.LocalCluster.host_names(FLAGS.num_workers, FLAGS.num_ps),
                rate_mbit=FLAGS.host_bandwidth_mbit or None))
        c = stack.enter_context(cluster.LocalCluster(
            FLAGS.num_workers, FLAGS.num_ps, log_dir=log_dir,
            worker_env=gpu_plan.worker_env, hosts=hosts, keep_logs=True))
        print(f"tf-asyncps: cluster up in {time.perf_counter() - t0:.1f} s: "
              f"{FLAGS.num_ps} ps, {FLAGS.num_workers} worker(s) ({gpu_plan.describe()}); "
              f"task logs in {c.log_dir} (the chief's whole output: chief-0.log)", flush=True)
        if hosts is not None:
            print(f"tf-asyncps: one host (network namespace) per task: {hosts}", flush=True)
        cpu_at_start = c.cpu_seconds()  # TensorFlow's import and start-up, left out below
        links_at_start = _worker_links(hosts)
        if FLAGS.restart_failed_tasks:
            c.supervise(max_restarts=FLAGS.max_restarts)
        env = dict(os.environ, TF_CONFIG=c.tf_config("chief", 0))
        env.update(gpu_plan.task_env("chief"))
        deadline = time.monotonic() + FLAGS.timeout_s
        runs, why = 0, ""
        while True:
            runs += 1
            rc = _run_chief(c, args, env, deadline, append=runs > 1)
            if rc == 0 or not FLAGS.restart_failed_tasks:
                break
            if rc > 0 and rc != EXIT_LOST_TASK:
                why = (" with an error that a re-run would repeat (see above); "
                       "it is not re-run")
                break
            if runs > FLAGS.max_restarts:
                why = f"; --max_restarts={FLAGS.max_restarts} re-runs are used up"
                break
            print(f"tf-asyncps launch: the chief {_describe_exit(rc)}; re-running it "
                  f"(restart {runs} of {FLAGS.max_restarts}), it resumes from the latest "
                  "checkpoint.", flush=True)
        links = {k: v - links_at_start[k] for k, v in _worker_links(hosts).items()}
        _report_task_cpu({n: s - (0.0 if n in c.restarts else cpu_at_start.get(n, 0.0))
                          for n, s in c.cpu_seconds().items()}, rc, links)
        if c.restarts:
            print(f"tf-asyncps launch: tasks restarted: {dict(sorted(c.restarts.items()))}",
                  flush=True)
        if c.gave_up:
            print(f"tf-asyncps launch: tasks left down after --max_restarts="
                  f"{FLAGS.max_restarts}: {sorted(c.gave_up)}", flush=True)
    if rc != 0:
        hint = ""
        if not FLAGS.restart_failed_tasks and (rc < 0 or rc == EXIT_LOST_TASK):
            hint = (" Running the same command again resumes from the latest checkpoint "
                    "in --backup_dir." if FLAGS.backup_dir else
                    " Add --restart_failed_tasks (epoch checkpoints, restarts) to survive "
                    "such failures.")
        raise SystemExit(f"tf-asyncps launch: the chief {_describe_exit(rc)}"
                         f"{f' after {runs} runs' if runs > 1 else ''}{why}.{hint}")


def _worker_links(hosts) -> dict:
    """--hosts=netns: the workers' link counters summed, ``{"sent": bytes,
    "received": bytes}`` (headers included); {} on loopback."""
    if hosts is None:
        return {}
    c = [hosts.counters(f"worker:{i}") for i in range(FLAGS.num_workers)]
    return {"sent": sum(x["tx_bytes"] for x in c), "received": sum(x["rx_bytes"] for x in c)}


def _report_task_cpu(cpu, rc, links=None) -> None:
    """Prints the CPU seconds each ps/worker task used while the chief ran
    (from the cluster being up; a restarted task: since its restart), so a
    ps doing more than its share shows, and after a successful run adds
    them to metrics.json as ``task_cpu_s`` and, per example trained,
    ``task_cpu_s_per_example``; with ``links`` (--hosts=netns: the workers'
    link bytes while the chief ran) ``bytes_sent_per_step`` and
    ``bytes_received_per_step`` per worker step."""
    if not cpu:
        return
    print("tf-asyncps launch: CPU seconds per task while the job ran: " +
          ", ".join(f"{n} {s:.1f}" for n, s in sorted(cpu.items())), flush=True)
    path = os.path.join(FLAGS.output_dir or "", "metrics.json")
    if rc == 0 and FLAGS.output_dir and os.path.exists(path):
        from tf_asyncps import files
        metrics = files.read_json(path)
        metrics["task_cpu_s"] = dict(sorted(cpu.items()))
        examples = metrics.get("worker_steps", 0) * metrics.get("batch_size", 0)
        if examples:
            metrics["task_cpu_s_per_example"] = {n: s / examples for n, s in sorted(cpu.items())}
        if links and metrics.get("worker_steps"):
            for key in ("sent", "received"):
                metrics[f"bytes_{key}_per_step"] = links[key] / metrics["worker_steps"]
        files.atomic_write_json(path, metrics)


def _run_chief(c, args, env, deadline, append=False) -> int:
    """Runs the chief (`train`) until it exits; returns its exit code.

    Its output goes whole to ``logs/chief-0.log`` (a re-run, ``append``,
    adds to the first run's) and filtered to the console
    (app/console.py): TensorFlow's C++ start-up notices and gRPC error blocks
    become one line per unreachable task. A ps or worker process that exits
    meanwhile is reported; when the job cannot go on (a ps is down, or no
    worker is left) the chief is stopped (console.TaskWatch).

    Raises:
      SystemExit: the job cannot go on (naming the task, its exit and the
        end of its log), or past the deadline.
    """
    from tf_asyncps.app.console import TaskWatch, run_filtered
    restarts = FLAGS.restart_failed_tasks
    watch = TaskWatch((lambda: dict(c.gave_up)) if restarts else c.exited,
                      [n for n in c.task_names if n.startswith("worker:")],
                      c.log_path, c.log_tail, restarts=restarts)
    cmd = [sys.executable, "-m", "tf_asyncps", "train"] + args + ["--console=full"]
    if c.hosts is not None:
        cmd = c.hosts.exec_argv("chief:0", cmd)
    return run_filtered(cmd, env, os.path.join(c.log_dir, "chief-0.log"),
                        restarts=FLAGS.restart_failed_tasks,
                        timeout_s=max(1.0, deadline - time.monotonic()),
                        on_start=lambda p: c.write_state({"chief:0": p.pid}),
                        full=FLAGS.console == "full", watch=watch, append=append)


def _describe_exit(rc: int) -> str:
    from tf_asyncps.app.console import describe_exit
    if rc == EXIT_LOST_TASK:
        return f"exited with code {rc} (a task of the cluster was lost)"
    return describe_exit(rc)

