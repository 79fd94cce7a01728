"""``tf-asyncps server``: serve the ps/worker task named in TF_CONFIG (also
what ``train`` does on a ps or worker), and its flag ``--allow_foreign_address``."""

import os
import sys

from absl import flags, logging

from tf_asyncps.app.shared_flags import filtered_self, quiet_console

__all__ = ["cmd_server", "serve", "startup_checks", "apply_gpus_flag", "filtered_task"]

FLAGS = flags.FLAGS

flags.DEFINE_boolean(
    "allow_foreign_address", False,
    "train/server: start even if this task's own address in TF_CONFIG is not an "
    "address of this host. For NAT or port-forwarding set-ups, where the other tasks "
    "reach this one at an address it does not own.")


def apply_gpus_flag():
    """--gpus -> CUDA_VISIBLE_DEVICES, before TensorFlow loads CUDA."""
    if FLAGS.gpus is None:
        return
    from tf_asyncps.cluster import devices
    value = devices.parse_gpus_flag(FLAGS.gpus)
    if "tensorflow" in sys.modules:  # pragma: no cover - commands import TF later
        logging.warning("--gpus is applied after TensorFlow was imported; it may be ignored.")
    os.environ[devices.VISIBLE_DEVICES] = value


def serve(config):
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


def startup_checks(config):
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
    if quiet_console():
        return filtered_task(config, "server")
    startup_checks(config)
    apply_gpus_flag()
    serve(config)


def filtered_task(config, command="train") -> None:
    """`train`/`server` with a quiet console: the whole output goes to
    OUTPUT_DIR/logs/TYPE-INDEX.log (a temp dir without --output_dir)."""
    filtered_self(command, f"{config.task_type}-{config.task_id}",
                  os.path.join(FLAGS.output_dir, "logs") if FLAGS.output_dir else None)
