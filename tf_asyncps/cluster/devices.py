"""Which GPUs each task of a cluster sees, and the GPU settings of a server.

Pure logic, no CUDA: the launcher decides every task's ``CUDA_VISIBLE_DEVICES``
before any process starts (``tf-asyncps launch --gpus_per_worker=K``):

* worker ``i`` sees GPUs ``i*K .. i*K+K-1`` of the GPUs available to the
  launcher (its own ``CUDA_VISIBLE_DEVICES`` if set, else every GPU that
  ``nvidia-smi -L`` lists);
* ps and chief tasks see none (``CUDA_VISIBLE_DEVICES=""``): they hold
  variables and coordinate, and would otherwise reserve GPU memory;
* GPU workers get ``TF_FORCE_GPU_ALLOW_GROWTH=true`` (unless the environment
  sets it) so a process takes GPU memory as it needs it.

A worker server also reads ``TF_ASYNCPS_LOGICAL_GPUS=N``: it splits each of
its physical GPUs into N logical GPUs of ``TF_ASYNCPS_LOGICAL_GPU_MEMORY_MB``
MiB each (default 2048), e.g. to test several GPUs per worker on one GPU.
"""

import dataclasses
import os
import re
import shutil
import subprocess
from typing import Dict, Mapping, Optional, Sequence, Tuple, Union

from tf_asyncps.validate import check_int

__all__ = [
    "TASK_MEMORY_MB", "available_memory_mb", "check_memory",
    "VISIBLE_DEVICES", "ALLOW_GROWTH", "LOGICAL_GPUS", "LOGICAL_GPU_MEMORY_MB",
    "count_gpus", "available_gpus", "GpuPlan", "plan_gpus", "parse_gpus_flag",
    "configure_server_gpus",
]

VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"
ALLOW_GROWTH = "TF_FORCE_GPU_ALLOW_GROWTH"
LOGICAL_GPUS = "TF_ASYNCPS_LOGICAL_GPUS"
LOGICAL_GPU_MEMORY_MB = "TF_ASYNCPS_LOGICAL_GPU_MEMORY_MB"
_DEFAULT_LOGICAL_MB = 2048
_GPU_ID = re.compile(r"^(\d+|(GPU|MIG)-[0-9A-Za-z/-]+)$")


#: Peak resident memory (MB) of one TensorFlow process of the digits job
#: (VmHWM, docs/benchmarks.md#how-cost-grows-bench_scaling): chief, ps task, worker task.
#: Larger models need more; these make a lower bound.
TASK_MEMORY_MB = {"chief": 790, "ps": 470, "worker": 480}


def available_memory_mb(meminfo: str = "/proc/meminfo") -> Optional[float]:
    """MemAvailable in MB, or None where the kernel does not say."""
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return None


def check_memory(num_workers: int, num_ps: int, available_mb: Optional[float]) -> None:
    """Raises ValueError when ``available_mb`` cannot hold a local cluster of
    that shape even at :data:`TASK_MEMORY_MB` per process (None: unknown,
    no check)."""
    m = TASK_MEMORY_MB
    need = m["chief"] + num_ps * m["ps"] + num_workers * m["worker"]
    if available_mb is None or need <= available_mb:
        return
    fits = int((available_mb - m["chief"] - num_ps * m["ps"]) // m["worker"])
    raise ValueError(
        f"--num_workers={num_workers} with --num_ps={num_ps} needs at least "
        f"{need / 1024:.1f} GiB ({m['chief']} MB for the chief, {m['ps']} MB per ps and "
        f"{m['worker']} MB per worker: each task is a TensorFlow process, measured on the "
        f"digits job), but this machine has {available_mb / 1024:.1f} GiB available "
        f"(MemAvailable). " + (f"Use --num_workers={fits} or fewer" if fits >= 1 else
                               f"Even one worker does not fit beside {num_ps} ps: use "
                               "fewer --num_ps") +
        ", or hosts of their own (docs/guides/several_hosts.md).")


def local_copies_replicas_message(policy_name: str, gpus_per_worker: int,
                                  num_workers: Optional[int] = None) -> str:
    """Why a policy that trains per-worker copies (``local_sgd``) refuses K > 1
    GPUs per worker, and the fix (one GPU per worker task)."""
    layout = ("--gpus_per_worker=1" if num_workers is None else
              f"--gpus_per_worker=1 and --num_workers={num_workers * gpus_per_worker}")
    return (f"policy {policy_name!r} trains per-worker copies and supports one replica per "
            f"worker, but every worker has {gpus_per_worker} GPUs: give each worker task "
            f"one GPU ({layout}) or use another policy.")

def count_gpus(timeout_s: float = 20.0) -> int:
    """GPUs listed by ``nvidia-smi -L``; 0 without nvidia-smi or if it fails.

    Does not load CUDA or TensorFlow.
    """
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return 0
    try:
        out = subprocess.run([exe, "-L"], capture_output=True, text=True,
                             timeout=timeout_s, check=False)
    except (OSError, subprocess.SubprocessError):
        return 0
    if out.returncode != 0:
        return 0
    return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))


def available_gpus(environ: Optional[Mapping[str, str]] = None,
                   gpu_count: Optional[int] = None) -> Tuple[str, ...]:
    """The GPU ids the launcher may hand out, as ``CUDA_VISIBLE_DEVICES`` entries.

    Args:
      environ: the launcher's environment (default ``os.environ``). If it sets
        ``CUDA_VISIBLE_DEVICES``, only those GPUs are handed out ("" = none).
      gpu_count: GPUs on the machine; default :func:`count_gpus`.

    Returns:
      A tuple of ids such as ``("0", "1")``; empty on a machine without GPUs.
    """
    environ = os.environ if environ is None else environ
    n = count_gpus() if gpu_count is None else gpu_count
    if n <= 0:
        return ()
    if VISIBLE_DEVICES in environ:
        return tuple(s.strip() for s in environ[VISIBLE_DEVICES].split(",") if s.strip())
    return tuple(str(i) for i in range(n))


@dataclasses.dataclass(frozen=True)
class GpuPlan:
    """The GPUs of every task of a local cluster.

    Attributes:
      gpus_per_worker: K, GPUs per worker task (0: CPU workers).
      worker_gpus: per worker index, the ``CUDA_VISIBLE_DEVICES`` entries it sees.
      memory_growth: whether GPU workers get ``TF_FORCE_GPU_ALLOW_GROWTH=true``.
    """

    gpus_per_worker: int
    worker_gpus: Tuple[Tuple[str, ...], ...]
    memory_growth: bool = True

    def task_env(self, job: str, index: int = 0) -> Dict[str, str]:
        """Environment variables of task ``job:index`` ("worker", "ps", "chief")."""
        if job != "worker":
            return {VISIBLE_DEVICES: ""}
        env = {VISIBLE_DEVICES: ",".join(self.worker_gpus[index])}
        if self.gpus_per_worker and self.memory_growth:
            env[ALLOW_GROWTH] = "true"
        return env

    @property
    def worker_env(self) -> Dict[int, Dict[str, str]]:
        """``{worker index: env}``, what ``LocalCluster(worker_env=...)`` takes."""
        return {i: self.task_env("worker", i) for i in range(len(self.worker_gpus))}

    def describe(self) -> str:
        """One line, e.g. ``worker 0: GPU 0; worker 1: GPU 1; ps and chief: no GPU``."""
        if not self.gpus_per_worker:
            return "CPU only: no task sees a GPU"
        parts = [f"worker {i}: GPU {','.join(g)}" for i, g in enumerate(self.worker_gpus)]
        return "; ".join(parts + ["ps and chief: no GPU"])


def plan_gpus(num_workers: int, gpus_per_worker: int,
              available: Union[int, Sequence[str]], *,
              memory_growth: bool = True) -> GpuPlan:
    """Gives worker ``i`` the GPUs ``available[i*K : i*K+K]``.

    Args:
      num_workers: worker tasks (int >= 1).
      gpus_per_worker: K (int >= 0); 0 hides every GPU from every task.
      available: GPU ids (see :func:`available_gpus`) or a count (ids 0..n-1).
      memory_growth: set ``TF_FORCE_GPU_ALLOW_GROWTH=true`` for GPU workers.

    Returns:
      A :class:`GpuPlan`.

    Raises:
      ValueError: fewer GPUs than ``num_workers * K``, or bad counts; the
        message names the flags and the fix.
    """
    for name, v, low in (("num_workers", num_workers, 1), ("gpus_per_worker", gpus_per_worker, 0)):
        check_int(v, f"--{name}", min=low)
    ids = tuple(str(i) for i in range(available)) if isinstance(available, int) else tuple(available)
    k = gpus_per_worker
    need = num_workers * k
    if need > len(ids):
        raise ValueError(
            f"--gpus_per_worker={k} with --num_workers={num_workers} needs {need} GPU(s), "
            f"but {len(ids)} {'is' if len(ids) == 1 else 'are'} available"
            f"{' (' + ','.join(ids) + ')' if ids else ''}. Lower --num_workers or "
            "--gpus_per_worker (--gpus_per_worker=0 trains on CPU); GPUs are counted with "
            "`nvidia-smi -L`, limited to CUDA_VISIBLE_DEVICES when it is set.")
    return GpuPlan(k, tuple(ids[i * k:(i + 1) * k] for i in range(num_workers)),
                   memory_growth)


def parse_gpus_flag(text: str) -> str:
    """``--gpus`` value -> ``CUDA_VISIBLE_DEVICES`` value.

    Args:
      text: "none" (or "") for no GPU, else comma-separated GPU indices or
        UUIDs, e.g. "0,1".

    Raises:
      ValueError: an entry that is not an index or UUID (names the flag).
    """
    text = (text or "").strip()
    if text.lower() in ("", "none"):
        return ""
    ids = [s.strip() for s in text.split(",")]
    bad = [s for s in ids if not _GPU_ID.match(s)]
    if bad:
        raise ValueError(
            f"--gpus={text!r}: {bad[0]!r} is not a GPU index; write e.g. --gpus=0 or "
            "--gpus=0,1 (the indices nvidia-smi -L shows), or --gpus=none for no GPU.")
    return ",".join(ids)


def configure_server_gpus(config, task_type: str, num_gpus: int,
                          environ: Optional[Mapping[str, str]] = None):
    """Sets the GPU options of a ps/worker server's ConfigProto.

    A ``tf.distribute.Server`` creates its devices from the ConfigProto it is
    given, not from ``tf.config`` settings, so memory growth and logical GPUs
    go here: ``gpu_options.allow_growth`` (unless ``TF_FORCE_GPU_ALLOW_GROWTH``
    is "false") and, for a worker with ``TF_ASYNCPS_LOGICAL_GPUS=N`` > 1, each
    physical GPU split into N logical GPUs.

    Args:
      config: a ``tf.compat.v1.ConfigProto`` (modified in place).
      task_type: "ps" or "worker".
      num_gpus: physical GPUs this process sees.
      environ: default ``os.environ``.

    Returns:
      ``config``.

    Raises:
      ValueError: a bad ``TF_ASYNCPS_LOGICAL_GPUS``/``..._MEMORY_MB`` value,
        or logical GPUs asked for on a worker without a GPU.
    """
    environ = os.environ if environ is None else environ
    config.gpu_options.allow_growth = environ.get(ALLOW_GROWTH, "true").lower() != "false"
    raw = environ.get(LOGICAL_GPUS, "").strip()
    if task_type != "worker" or raw in ("", "0", "1"):
        return config
    try:
        n = int(raw)
        mb = float(environ.get(LOGICAL_GPU_MEMORY_MB, _DEFAULT_LOGICAL_MB))
    except ValueError:
        n, mb = -1, -1.0
    if n < 1 or mb <= 0:
        raise ValueError(
            f"{LOGICAL_GPUS}={raw!r} / {LOGICAL_GPU_MEMORY_MB}="
            f"{environ.get(LOGICAL_GPU_MEMORY_MB)!r}: give a number of logical GPUs >= 1 and "
            "a memory size in MiB > 0, e.g. TF_ASYNCPS_LOGICAL_GPUS=2.")
    if num_gpus < 1:
        raise ValueError(
            f"{LOGICAL_GPUS}={n} but this worker sees no GPU (CUDA_VISIBLE_DEVICES="
            f"{environ.get(VISIBLE_DEVICES)!r}); give it a GPU (tf-asyncps launch "
            f"--gpus_per_worker=1) or unset {LOGICAL_GPUS}.")
    del config.gpu_options.experimental.virtual_devices[:]
    for _ in range(num_gpus):
        config.gpu_options.experimental.virtual_devices.add(memory_limit_mb=[mb] * n)
    return config
