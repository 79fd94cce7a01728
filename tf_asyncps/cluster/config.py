"""The TF_CONFIG schema of a parameter-server cluster, without TensorFlow.

:func:`validate_tf_config` checks a TF_CONFIG (chief, ps and worker jobs of
"host:port" addresses, this task's type and index) and returns a
:class:`ClusterConfig`. TensorFlow is imported only inside the functions
that build TensorFlow objects (:meth:`ClusterConfig.cluster_spec`,
:func:`cluster_resolver`), so the command line validates flags first.
"""

import ipaddress
import json
import os
import re
from typing import Dict, List, Union

from absl import logging

from tf_asyncps.validate import is_int

__all__ = ["ROLES", "ClusterConfig", "validate_tf_config", "tf_config_from_env",
           "warn_evaluators", "cluster_resolver"]

#: Task types of a training cluster. "evaluator" is accepted and ignored.
ROLES = ("chief", "ps", "worker")
_HINTS = {
    "master": 'TF1 called the coordinator "master"; name it "chief".',
    "coordinator": 'the coordinator task is called "chief".',
    "parameter_server": 'parameter servers are called "ps".',
    "workers": 'the job is called "worker" (singular).',
}
_HOST_RE = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9\-\.]*[A-Za-z0-9])?$")


class ClusterConfig(dict):
    """A validated TF_CONFIG: ``cluster`` dict plus this task's type and index.

    Behaves like ``tf.train.ClusterSpec`` for reading (``jobs``,
    ``num_tasks(job)``, ``task_address(job, i)``, ``as_dict()``) and converts
    with :meth:`cluster_spec`.

    Attributes:
      task_type: "chief", "ps", "worker" or None when TF_CONFIG had no task.
      task_id: int index of this task or None.
      rpc_layer: "grpc".
      evaluators: addresses of "evaluator" tasks (not part of training).
    """

    def __init__(self, cluster, task_type=None, task_id=None, rpc_layer="grpc",
                 evaluators=()):
        super().__init__({k: list(v) for k, v in cluster.items()})
        self.task_type = task_type
        self.task_id = task_id
        self.rpc_layer = rpc_layer
        self.evaluators = list(evaluators)

    @property
    def jobs(self) -> List[str]:
        return list(self.keys())

    def num_tasks(self, job: str) -> int:
        return len(self.get(job, ()))

    def task_address(self, job: str, index: int) -> str:
        return self[job][index]

    def as_dict(self) -> Dict[str, List[str]]:
        return {k: list(v) for k, v in self.items()}

    @property
    def num_workers(self) -> int:
        return self.num_tasks("worker")

    @property
    def num_ps(self) -> int:
        return self.num_tasks("ps")

    def cluster_spec(self):
        import tensorflow as tf
        return tf.train.ClusterSpec(self.as_dict())

    def to_tf_config(self, task_type: str, task_id: int) -> str:
        """The TF_CONFIG JSON string for one task of this cluster."""
        return json.dumps({"cluster": self.as_dict(),
                           "task": {"type": task_type, "index": task_id}})


class _Invalid(Exception):
    """A failed check: the message and the cluster it read (see validate_tf_config)."""

    def __init__(self, msg: str, cluster=None):
        super().__init__(msg)
        self.msg, self.cluster = msg, cluster


def _fail(msg: str, cluster=None) -> None:
    raise _Invalid(msg, cluster)


def _check_address(job: str, i: int, addr, cluster) -> str:
    where = f'cluster["{job}"][{i}]'
    if not isinstance(addr, str):
        _fail(f"{where} = {addr!r} is not a string; write it as \"host:port\".", cluster)
    if addr.startswith("["):  # [ipv6]:port
        host, sep, port = addr[1:].partition("]:")
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            sep = ""
    else:
        host, sep, port = addr.rpartition(":")
        if host and not _HOST_RE.match(host):
            sep = ""
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        _fail(f'{where} = "{addr}" is not a "host:port" address with a port in '
              f'1..65535; write it like "10.0.0.2:2222" (IPv6: "[::1]:2222").', cluster)
    return addr


def _canonical(addr: str) -> str:
    host, _, port = addr.rpartition(":")
    host = host.strip("[]").lower()
    if host in ("localhost", "127.0.0.1", "::1", "0.0.0.0"):
        host = "loopback"
    return f"{host}:{port}"


def validate_tf_config(tf_config: Union[str, dict, None] = None,
                       require_task: bool = True, *, require_chief: bool = True,
                       source: str = "TF_CONFIG") -> ClusterConfig:
    """Checks a TF_CONFIG for a parameter-server training cluster.

    The "chief" rule follows TensorFlow. Every ps and worker task, and a
    chief started from TF_CONFIG, needs the "chief" job in the cluster: the
    other tasks reach the coordinator there, and a TF_CONFIG without it stalls
    training (shared/cases/001). Only the coordinator process itself, when its
    resolver names no task (TensorFlow's in-process clusters and
    ``SimpleClusterResolver(spec)``), may leave it out:
    ``ParameterServerStrategy`` then adds a local "chief" job on an unused
    port (``tf.config.experimental_connect_to_cluster``). The strategy passes
    ``require_chief=False`` in that case only.

    Args:
      tf_config: JSON string or dict; None reads the ``TF_CONFIG`` env var.
      require_task: whether ``task`` must be present.
      require_chief: whether the cluster must have a "chief" job (see above).
      source: where the cluster came from, for messages ("TF_CONFIG", or
        e.g. "SimpleClusterResolver.cluster_spec()").

    Returns:
      A :class:`ClusterConfig` (ClusterSpec-like) with ``task_type``/``task_id``.

    Raises:
      ValueError: naming the field at fault and the fix, and showing the
        cluster that was read and where it came from. Runs in microseconds:
        no network access.
    """
    try:
        return _validate(tf_config, require_task, require_chief)
    except _Invalid as e:
        msg = e.msg
        if e.cluster is not None:
            msg += f"\n  cluster read from {source}: {json.dumps(e.cluster, default=str)}"
        raise ValueError(f"Invalid {source}: {msg}") from None


def _validate(tf_config, require_task: bool, require_chief: bool) -> ClusterConfig:
    if tf_config is None:
        tf_config = os.environ.get("TF_CONFIG")
        if not tf_config:
            raise ValueError(
                "TF_CONFIG is not set. Set it to a JSON string like "
                '{"cluster": {"chief": ["host:port"], "ps": [...], "worker": [...]}, '
                '"task": {"type": "worker", "index": 0}} (see configs/).')
    if isinstance(tf_config, (bytes, str)):
        try:
            cfg = json.loads(tf_config)
        except ValueError as e:
            raise ValueError(
                f"Invalid TF_CONFIG: not valid JSON ({e}); got {str(tf_config)[:200]!r}. "
                "Check the quoting: TF_CONFIG must be a JSON object.") from None
    else:
        cfg = tf_config
    if not isinstance(cfg, dict):
        _fail(f"must be a JSON object with \"cluster\" and \"task\", got {type(cfg).__name__}.")
    cluster = cfg.get("cluster")
    if not isinstance(cluster, dict) or not cluster:
        _fail('"cluster" is missing or empty; it maps "chief", "ps" and "worker" '
              'to lists of "host:port" addresses.', cluster)
    evaluators = []
    for job, addrs in cluster.items():
        if job == "evaluator":
            evaluators = list(addrs) if isinstance(addrs, list) else [addrs]
            continue
        if job not in ROLES:
            hint = _HINTS.get(str(job).lower(), "")
            _fail(f'unknown job "{job}" in "cluster"; jobs are {list(ROLES)} '
                  f'(and "evaluator", which training ignores). {hint}', cluster)
        if not isinstance(addrs, list):
            _fail(f'cluster["{job}"] must be a list of "host:port" strings, got '
                  f'{type(addrs).__name__}.', cluster)
    jobs = [j for j in ROLES if j in cluster or require_chief or j != "chief"]
    for job in jobs:
        if job not in cluster:
            what = {"chief": "the coordinator that runs model.fit",
                    "ps": "a parameter server that holds the variables",
                    "worker": "a worker that computes gradients"}[job]
            _fail(f'the cluster has no "{job}" task: add "{job}": ["host:port"] '
                  f'({what}).', cluster)
        if not cluster[job]:
            _fail(f'cluster["{job}"] is an empty list: give at least one '
                  f'"host:port".', cluster)
    if len(cluster.get("chief", [None])) != 1:
        _fail(f'cluster["chief"] has {len(cluster["chief"])} addresses; a cluster '
              'has exactly one chief: keep one address there (extra trainers are '
              '"worker" tasks).', cluster)
    seen = {}
    for job in jobs:
        for i, addr in enumerate(cluster[job]):
            _check_address(job, i, addr, cluster)
            key = _canonical(addr)
            if key in seen:
                _fail(f'address "{addr}" is used twice: by {seen[key]} and '
                      f'{job}:{i}; every task needs its own port.', cluster)
            seen[key] = f"{job}:{i}"
    for i, addr in enumerate(evaluators):
        _check_address("evaluator", i, addr, cluster)
    rpc = cfg.get("rpc_layer", "grpc")
    if rpc != "grpc":
        _fail(f'"rpc_layer" is {rpc!r}; only "grpc" is supported: set '
              '"rpc_layer": "grpc" or leave it out.', cluster)
    task = cfg.get("task")
    task_type = task_id = None
    if task is None or task == {}:
        if require_task:
            _fail('"task" is missing; add "task": {"type": "worker", "index": 0} '
                  '(this process\'s role).', cluster)
    else:
        if not isinstance(task, dict):
            _fail(f'"task" must be an object like {{"type": "worker", "index": 0}}, '
                  f"got {task!r}.", cluster)
        task_type = task.get("type")
        task_id = task.get("index", 0)
        if task_type == "evaluator":
            _fail('this task is an "evaluator": it takes no part in parameter-server '
                  "training; run it with a separate evaluation job (sidecar "
                  "evaluation), not with tf-asyncps train.", cluster)
        if task_type not in ROLES:
            hint = _HINTS.get(str(task_type).lower(), "")
            _fail(f'task "type" is {task_type!r}; it must be one of {list(ROLES)}. '
                  f"{hint}", cluster)
        if not is_int(task_id):
            _fail(f'task "index" is {task_id!r} ({type(task_id).__name__}); it must be '
                  f'an integer such as 0.', cluster)
        if task_type not in cluster:  # only "chief", with require_chief=False
            _fail(f'this task is "chief" but the cluster has no "chief" job: add "chief": '
                  '["host:port"], or give the coordinator no task (ParameterServerStrategy '
                  'then adds a local chief itself).', cluster)
        n = len(cluster[task_type])
        if not 0 <= task_id < n:
            _fail(f'task index {task_id} is out of range: cluster["{task_type}"] '
                  f"has {n} task(s), so the index must be in 0..{n - 1}.", cluster)
    training = {job: cluster[job] for job in jobs}
    return ClusterConfig(training, task_type, task_id, "grpc", evaluators)


def tf_config_from_env(require_task: bool = True) -> ClusterConfig:
    """:func:`validate_tf_config` on the ``TF_CONFIG`` environment variable."""
    return validate_tf_config(None, require_task=require_task)


_WARNED = set()  # keys of the warnings this process has logged


def warn_once(key: str, msg: str, *args) -> bool:
    """Logs ``msg`` with absl ``logging.warning`` unless ``key`` already was."""
    if key in _WARNED:
        return False
    _WARNED.add(key)
    logging.warning(msg, *args)
    return True


def warn_evaluators(config: ClusterConfig) -> bool:
    """Logs (once per process) that the cluster's evaluator tasks are ignored.

    Returns:
      True if the warning was logged by this call.
    """
    if not config.evaluators:
        return False
    return warn_once(
        "evaluator",
        "TF_CONFIG lists evaluator task(s) %s: training ignores them and leaves them "
        "out of the cluster it gives TensorFlow (run sidecar evaluation separately).",
        config.evaluators)


def cluster_resolver(config: Union[ClusterConfig, str, dict, None] = None):
    """A ``SimpleClusterResolver`` for a validated config (default: TF_CONFIG).

    Args:
      config: a ClusterConfig, a TF_CONFIG string or dict, or None (reads the
        ``TF_CONFIG`` environment variable).

    Returns:
      A ``tf.distribute.cluster_resolver.SimpleClusterResolver`` over the
      chief, ps and worker jobs only: an "evaluator" job is left out, with a
      warning, so TensorFlow never waits for it.

    Raises:
      ValueError: an invalid TF_CONFIG (see :func:`validate_tf_config`).
    """
    import tensorflow as tf
    if not isinstance(config, ClusterConfig):
        config = validate_tf_config(config)
    warn_evaluators(config)
    return tf.distribute.cluster_resolver.SimpleClusterResolver(
        config.cluster_spec(), task_type=config.task_type,
        task_id=config.task_id, rpc_layer="grpc")
