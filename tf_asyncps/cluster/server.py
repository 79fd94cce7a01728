"""Settings and start of a task's ``tf.distribute.Server``.

TensorFlow is imported inside the functions that use it.
"""

import os
from typing import Dict, Optional

from absl import logging

from tf_asyncps.cluster.config import ClusterConfig, warn_evaluators

__all__ = ["inter_op_threads", "server_config", "configure_local_context", "start_server"]

def inter_op_threads(num_workers: int) -> int:
    """Inter-op threads a task needs so concurrent steps never starve.

    Each worker's step may block a thread on the PS (and the chief) while it
    waits for tensors, so fewer than ``num_workers + 1`` threads can deadlock
    on small machines (seen on 2 cores). Never below the core count.
    """
    return max(int(num_workers) + 1, os.cpu_count() or 1, 2)


def server_config(num_workers: int, task_type: Optional[str] = None, num_gpus: int = 0,
                  environ: Optional[Dict[str, str]] = None):
    """``tf.compat.v1.ConfigProto`` for a ps/worker server of this cluster.

    Args:
      num_workers: workers in the cluster (sets the inter-op threads).
      task_type: "ps" or "worker"; with it, GPU memory growth and logical GPUs
        are set (see :func:`tf_asyncps.cluster.devices.configure_server_gpus`).
      num_gpus: physical GPUs this process sees.
      environ: default ``os.environ``.

    Raises:
      ValueError: bad logical-GPU settings in the environment.
    """
    from tf_asyncps.cluster import devices
    from tf_asyncps.compat import startup as startup_compat
    config = startup_compat.serving_runtime().ConfigProto(
        inter_op_parallelism_threads=inter_op_threads(num_workers))
    if task_type is not None:
        devices.configure_server_gpus(config, task_type, num_gpus, environ)
    return config


def configure_local_context(num_workers: int) -> None:
    """Sets this process's inter-op threads (call before TF's context starts).

    If the context has already started with fewer threads, logs a warning
    saying how to fix it instead of failing.
    """
    import tensorflow as tf
    want = inter_op_threads(num_workers)
    have = tf.config.threading.get_inter_op_parallelism_threads()
    if have and have >= want:
        return
    try:
        tf.config.threading.set_inter_op_parallelism_threads(want)
    except RuntimeError:
        logging.warning(
            "TensorFlow was initialised before the strategy with %s inter-op "
            "threads; %d workers need >= %d or steps may deadlock on small "
            "machines. Create the strategy before running any TensorFlow op.",
            have or "default", num_workers, want)


def start_server(config: ClusterConfig):
    """Starts the ``tf.distribute.Server`` of this ps/worker task (not joined).

    An "evaluator" job in the TF_CONFIG is left out of the server's cluster
    (with a warning, see :func:`warn_evaluators`).

    Args:
      config: the validated cluster; its task must be a ps or a worker.

    Returns:
      The started ``tf.distribute.Server``.

    Raises:
      ValueError: if the task is not a ps or worker.
    """
    from tf_asyncps.compat import startup as startup_compat
    if config.task_type not in ("ps", "worker"):
        raise ValueError(
            f'only "ps" and "worker" tasks serve; this task is {config.task_type!r}.')
    warn_evaluators(config)
    from tf_asyncps.cluster import devices
    tf = startup_compat.serving_runtime()  # no TensorFlow API package: ~3 s less start-up
    num_gpus = 0
    if config.task_type == "ps":
        # Parameter servers keep variables on CPU; don't grab GPU memory.
        try:
            tf.set_visible_devices([], "GPU")
        except (RuntimeError, ValueError):
            pass
    elif os.environ.get(devices.LOGICAL_GPUS, "").strip() not in ("", "0", "1"):
        # Enumerating GPUs does not create devices: the server creates them
        # below, from its ConfigProto.
        num_gpus = len(tf.list_physical_devices("GPU"))
    return tf.Server(
        config.as_dict(), job_name=config.task_type,
        task_index=config.task_id, protocol="grpc",
        config=server_config(config.num_workers, config.task_type, num_gpus), start=True)
