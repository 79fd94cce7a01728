"""What ``tf-asyncps --help`` prints: each command, an example, its flags."""

__all__ = ["HELP", "JOB_FLAGS", "COMMAND_HELP", "help_text", "command_help"]

HELP = """tf-asyncps: asynchronous parameter-server training (absl command line).

Usage: tf-asyncps COMMAND [--flags]   (or: python -m tf_asyncps COMMAND ...)

{commands}
The job's flags: {job_flags}
Failures: launch --restart_failed_tasks restarts ps/worker tasks that exit and
re-runs a chief that lost its ps, resuming from --backup_dir (epoch checkpoints;
with --backup_every_steps=N, a backup every N worker steps, resumed mid-epoch).
GPU workers: launch --gpus_per_worker=K (K GPUs per worker process);
train/server --gpus=0 (or CUDA_VISIBLE_DEVICES). See README.md.

Every flag with its help: tf-asyncps --helpfull (bench's: tf-asyncps bench --helpfull)
Versions (tf_asyncps, TensorFlow, tf_keras, Keras; the supported ranges): tf-asyncps --version
"""

#: What --help says of each command: what it does, an example, its flags.
#: "the job's" stands for JOB_FLAGS (tests/test_cli.py checks every flag is named).
JOB_FLAGS = ("keras", "model", "dataset", "hidden", "embedding_dim", "min_shard_bytes",
             "dynamic_ids", "dynamic_capacity", "dynamic_evict_every",
             "ctr_max_rows", "ctr_scale", "ctr_zipf", "ctr_embedding", "ctr_bottom_mlp",
             "ctr_top_mlp", "ctr_test_examples",
             "epochs", "steps_per_epoch", "batch_size", "learning_rate", "optimizer",
             "policy", "policy_args", "locking", "steps_per_execution", "mixed_precision",
             "wire_dtype",
             "max_tracked_staleness", "connect_timeout_s", "backup_dir", "backup_every_steps", "seed",
             "output_dir")
COMMAND_HELP = (
    ("launch", "start a local cluster (ps, workers, chief as processes) and train",
     "tf-asyncps launch --flagfile=configs/digits_async.flags",
     ("the job's", "num_workers", "num_ps", "timeout_s", "gpus_per_worker",
      "restart_failed_tasks", "max_restarts", "hosts", "host_bandwidth_mbit", "console")),
    ("train", "one binary for every role: reads TF_CONFIG; ps/worker serve, the chief "
     "trains", "TF_CONFIG='{...}' tf-asyncps train --flagfile=...",
     ("the job's", "gpus", "console", "allow_foreign_address")),
    ("server", "serve the ps/worker task named in TF_CONFIG",
     "TF_CONFIG='{...}' tf-asyncps server",
     ("gpus", "console", "allow_foreign_address")),
    ("bench", "every policy side by side with vanilla ParameterServerStrategy and "
     "single-process training (bench.json, bench.md, PNG plots)",
     "tf-asyncps bench --output_dir=runs/bench",
     ("num_workers", "batch_size", "learning_rate", "seed", "output_dir",
      "bench_*")),
    ("reference", "the job's model trained in this one process (no cluster), written "
     "beside the job's results (OUTPUT_DIR_reference)",
     "tf-asyncps reference --flagfile=configs/movielens_async.flags",
     ("the job's (its policy, locking, connect and backup flags do not apply)",
      "console")),
)


def help_text() -> str:
    """What ``tf-asyncps --help`` prints (``cli.run`` prints it and exits 0)."""
    import textwrap
    lines = []
    for name, what, example, names in COMMAND_HELP:
        flag_list = " ".join(n if " " in n else f"--{n}" for n in names)
        lines += textwrap.wrap(f"{name:10} {what}:", 79, subsequent_indent=" " * 11)
        lines.append(" " * 13 + example)
        lines += textwrap.wrap(f"flags: {flag_list}", 79, initial_indent=" " * 11,
                               subsequent_indent=" " * 18)
    job = textwrap.fill(" ".join(f"--{n}" for n in JOB_FLAGS), 79,
                        initial_indent=" " * 16, subsequent_indent=" " * 2).lstrip()
    return HELP.format(commands="\n".join(lines) + "\n", job_flags=job)


def command_help(command: str, flag_values) -> str:
    """What ``tf-asyncps COMMAND --help`` prints: that command's line, its
    example and each of its flags with absl's help and default.

    Args:
      command: a name of ``COMMAND_HELP``.
      flag_values: the defined absl flags (``absl.flags.FLAGS``); bench's
        ``--bench_*`` flags must be defined already.

    Raises:
      KeyError: an unknown command.
    """
    import textwrap
    name, what, example, names = next(c for c in COMMAND_HELP if c[0] == command)
    wanted = []
    for n in names:
        if n.startswith("the job's"):
            wanted += list(JOB_FLAGS)
        elif n.endswith("*"):
            wanted += sorted(f for f in flag_values if f.startswith(n[:-1]))
        else:
            wanted.append(n)
    lines = textwrap.wrap(f"tf-asyncps {name}: {what}.", 79) + [
        "", "Example:", f"  {example}", "", "Flags:"]
    for n in dict.fromkeys(wanted):
        flag = flag_values[n]
        lines.append(f"  --{n}: " + " ".join(str(flag.help).split()))
        lines[-1:] = textwrap.wrap(lines[-1], 79, subsequent_indent=" " * 4)
        lines.append(f"    (default: {flag.default_as_str or repr(flag.default)})")
    note = [n for n in names if n.startswith("the job's (")]
    if note:
        lines += ["", textwrap.fill(f"Note: {note[0][len('the job' + chr(39) + 's '):]}", 79)]
    lines += ["", "Every flag: tf-asyncps --helpfull; every command: tf-asyncps --help"]
    return "\n".join(lines) + "\n"
