"""Cluster configuration: TF_CONFIG validation, server settings and LocalCluster.

A parameter-server cluster has one ``chief`` (the coordinator that runs
``model.fit``), one or more ``ps`` tasks holding the variables and one or more
``worker`` tasks computing gradients. Every task reads the same ``cluster``
from its ``TF_CONFIG`` environment variable and its own ``task``.
"""

import contextlib
import ctypes
import ipaddress
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Dict, List, Optional, Sequence, Union

from absl import logging

from tf_asyncps.compat import tensorflow as tf_compat

__all__ = [
    "ClusterConfig", "validate_tf_config", "tf_config_from_env",
    "cluster_resolver", "server_config", "configure_local_context",
    "warn_evaluators", "warn_if_exposed", "exposed_addresses", "is_loopback",
    "host_is_local", "check_own_address",
    "wait_for_tasks", "probe_grpc", "start_server", "LocalCluster", "ROLES",
]

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


def _fail(msg: str, cluster=None) -> None:
    if cluster is not None:
        msg += f"\n  cluster read from TF_CONFIG: {json.dumps(cluster, default=str)}"
    raise ValueError("Invalid TF_CONFIG: " + msg)


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
                       require_task: bool = True) -> ClusterConfig:
    """Checks a TF_CONFIG for a parameter-server training cluster.

    Args:
      tf_config: JSON string or dict; None reads the ``TF_CONFIG`` env var.
      require_task: whether ``task`` must be present.

    Returns:
      A :class:`ClusterConfig` (ClusterSpec-like) with ``task_type``/``task_id``.

    Raises:
      ValueError: naming the field at fault and the fix, and showing the
        cluster that was read. Runs in microseconds: no network access.
    """
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
    for job in ROLES:
        if job not in cluster:
            what = {"chief": "the coordinator that runs model.fit",
                    "ps": "a parameter server that holds the variables",
                    "worker": "a worker that computes gradients"}[job]
            _fail(f'the cluster has no "{job}" task: add "{job}": ["host:port"] '
                  f'({what}).', cluster)
        if not cluster[job]:
            _fail(f'cluster["{job}"] is an empty list: give at least one '
                  f'"host:port".', cluster)
    if len(cluster["chief"]) != 1:
        _fail(f'cluster["chief"] has {len(cluster["chief"])} addresses; a cluster '
              'has exactly one chief: keep one address there (extra trainers are '
              '"worker" tasks).', cluster)
    seen = {}
    for job in ROLES:
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
        if isinstance(task_id, bool) or not isinstance(task_id, int):
            _fail(f'task "index" is {task_id!r} ({type(task_id).__name__}); it must be '
                  f'an integer such as 0.', cluster)
        n = len(cluster[task_type])
        if not 0 <= task_id < n:
            _fail(f'task index {task_id} is out of range: cluster["{task_type}"] '
                  f"has {n} task(s), so the index must be in 0..{n - 1}.", cluster)
    training = {job: cluster[job] for job in ROLES}
    return ClusterConfig(training, task_type, task_id, "grpc", evaluators)


def tf_config_from_env(require_task: bool = True) -> ClusterConfig:
    """:func:`validate_tf_config` on the ``TF_CONFIG`` environment variable."""
    return validate_tf_config(None, require_task=require_task)


_WARNED = set()  # keys of the warnings this process has logged


def _warn_once(key: str, msg: str, *args) -> bool:
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
    return _warn_once(
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


def _split(addr: str):
    host, _, port = addr.rpartition(":")
    return host.strip("[]"), int(port)


def is_loopback(host: str) -> bool:
    """Whether ``host`` is a loopback address, without any name lookup.

    Args:
      host: a name or an IP (IPv6 with or without brackets).

    Returns:
      True for "localhost" (and "*.localhost") and loopback IPs; False for
      every other name, even one that resolves to loopback.
    """
    h = host.strip("[]").lower()
    if h == "localhost" or h.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:
        return False


def exposed_addresses(config: ClusterConfig) -> List[str]:
    """The tasks of ``config`` (evaluators included) whose host is not loopback.

    Args:
      config: a validated cluster.

    Returns:
      A list of "job:i at host:port" strings, in cluster order.
    """
    named = [(f"{j}:{i}", a) for j in config.jobs for i, a in enumerate(config[j])]
    named += [(f"evaluator:{i}", a) for i, a in enumerate(config.evaluators)]
    return [f"{n} at {a}" for n, a in named if not is_loopback(_split(a)[0])]


def warn_if_exposed(config: ClusterConfig) -> bool:
    """Warns loudly (once per process) when the cluster reaches past loopback.

    TensorFlow's gRPC servers accept unauthenticated requests that can run any
    op, and listen on all interfaces whatever host the cluster names.

    Args:
      config: a validated cluster.

    Returns:
      True if the warning was logged by this call.
    """
    exposed = exposed_addresses(config)
    if not exposed:
        return False
    shown = ", ".join(exposed[:6]) + (f" and {len(exposed) - 6} more" if len(exposed) > 6 else "")
    return _warn_once(
        "exposed",
        "\n*** SECURITY: this cluster has non-loopback addresses: %s.\n"
        "*** TensorFlow's gRPC servers accept UNAUTHENTICATED requests that can run\n"
        "*** any op (read and write files, run code), and listen on ALL interfaces\n"
        "*** (*:port) whatever host TF_CONFIG names. Run this job only on a network\n"
        "*** that nothing but the job's own tasks can reach (firewall, Kubernetes\n"
        "*** NetworkPolicy: configs/k8s_networkpolicy.yaml). See .github/SECURITY.md.",
        shown)


def _bounded(fn, timeout_s: float):
    """Runs ``fn()`` in a daemon thread; raises TimeoutError after ``timeout_s``."""
    box = {}

    def run():
        try:
            box["value"] = fn()
        except Exception as e:  # noqa: BLE001 - re-raised in the caller's thread
            box["error"] = e

    t = threading.Thread(target=run, daemon=True, name="tf_asyncps-resolve")
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        raise TimeoutError(f"no answer within {timeout_s:g} s")
    if "error" in box:
        raise box["error"]
    return box["value"]


def _nonlocal_bind_allowed(family) -> bool:
    path = ("/proc/sys/net/ipv4/ip_nonlocal_bind" if family == socket.AF_INET
            else "/proc/sys/net/ipv6/ip_nonlocal_bind")
    try:
        with open(path) as f:
            return f.read().strip() == "1"
    except OSError:
        return False


def _binds_here(family, sockaddr) -> bool:
    """Whether a socket can bind ``sockaddr`` (port 0): the IP is this host's."""
    if _nonlocal_bind_allowed(family):
        return False  # bind would succeed for any address: no evidence
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind((sockaddr[0], 0) + tuple(sockaddr[2:]))
        return True
    except OSError:
        return False


def host_is_local(host: str, timeout_s: float = 2.0) -> bool:
    """Whether ``host`` names this machine.

    True for loopback, the wildcard, this host's name, and any name or IP
    that resolves to an address a socket can bind here (that is, an address
    of a local interface) or to an address of this host's name. Sends no
    packet; name lookups are bounded by ``timeout_s``.

    Args:
      host: a name or an IP (IPv6 with or without brackets).
      timeout_s: bound on each name lookup, in seconds.

    Returns:
      bool.

    Raises:
      ValueError: ``host`` does not resolve (or not within ``timeout_s``).
    """
    h = host.strip("[]").lower()
    if is_loopback(h) or h in ("0.0.0.0", "::"):
        return True
    me = socket.gethostname().lower()
    if h in (me, me.split(".")[0]):
        return True
    try:
        infos = _bounded(lambda: socket.getaddrinfo(h, None, proto=socket.IPPROTO_TCP),
                         timeout_s)
    except (OSError, TimeoutError, UnicodeError) as e:
        raise ValueError(f'host "{host}" does not resolve on this machine ({e})') from None
    try:
        mine = set(_bounded(lambda: socket.gethostbyname_ex(socket.gethostname())[2],
                            timeout_s))
    except (OSError, TimeoutError, UnicodeError):
        mine = set()
    for family, _, _, _, sockaddr in infos:
        ip = sockaddr[0].split("%")[0]
        if ip in mine or is_loopback(ip) or _binds_here(family, sockaddr):
            return True
    return False


def check_own_address(config: ClusterConfig, allow_foreign: bool = False,
                      timeout_s: float = 2.0) -> None:
    """Checks that this task's address in the cluster belongs to this host.

    Other tasks reach this one at ``cluster[task.type][task.index]``; when that
    address is another machine's, the task index or type is usually wrong, and
    this task's traffic would go to someone else.

    Args:
      config: the validated cluster with this task's type and index.
      allow_foreign: skip the check (NAT or port forwarding, where the address
        others use is not one of this host's own).
      timeout_s: bound on each name lookup, in seconds.

    Raises:
      ValueError: naming the address and the fix.
    """
    if allow_foreign or config.task_type is None:
        return
    where = f'cluster["{config.task_type}"][{config.task_id}]'
    addr = config[config.task_type][config.task_id]
    host = _split(addr)[0]
    fix = ('Fix this task\'s "type"/"index" or the address; behind NAT or port '
           'forwarding pass --allow_foreign_address.')
    try:
        local = host_is_local(host, timeout_s)
    except ValueError as e:
        raise ValueError(f"Invalid TF_CONFIG: this task is {config.task_type}:"
                         f"{config.task_id} at {where} = \"{addr}\", and {e}. {fix}") from None
    if not local:
        raise ValueError(
            f"Invalid TF_CONFIG: this task is {config.task_type}:{config.task_id}, but "
            f"its address {where} = \"{addr}\" is not an address of this host "
            f"({socket.gethostname()}): the other tasks would send its traffic to "
            f"another machine. {fix}")


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
    import tensorflow as tf
    from tf_asyncps.cluster import devices
    config = tf.compat.v1.ConfigProto(
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


def _reachable(addr: str, timeout: float) -> bool:
    host, _, port = addr.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            return True
    except OSError:
        return False


# HTTP/2 client preface + an empty SETTINGS frame (RFC 9113 3.4, 6.5).
_H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
_H2_SETTINGS = 0x04

#: Results of :func:`probe_grpc`.
PROBE_OK, PROBE_UNREACHABLE, PROBE_SILENT, PROBE_WRONG = "ok", "unreachable", "silent", "wrong"


def probe_grpc(addr: str, timeout: float = 1.0):
    """Checks that ``addr`` is an HTTP/2 (gRPC) server, such as a TF server.

    Connects, sends the HTTP/2 client preface and an empty SETTINGS frame,
    and requires the peer's first frame to be SETTINGS (every HTTP/2 server
    opens with one). A TCP connect alone is not enough: a port held by some
    other program accepts it, and TensorFlow's connect then hangs.

    Args:
      addr: "host:port" (IPv6 as "[::1]:port").
      timeout: seconds for the connect and, again, for the answer.

    Returns:
      (status, detail): status is PROBE_OK, PROBE_UNREACHABLE (no TCP
      connection), PROBE_SILENT (accepted but no answer within ``timeout``,
      or closed) or PROBE_WRONG (answered with something that is not
      HTTP/2); detail says what was seen.
    """
    host, _, port = addr.rpartition(":")
    try:
        sock = socket.create_connection((host.strip("[]"), int(port)), timeout=timeout)
    except OSError as e:
        return PROBE_UNREACHABLE, f"connect failed: {e.strerror or e}"
    with sock:
        head = b""
        deadline = time.monotonic() + timeout
        try:
            sock.sendall(_H2_PREFACE)
            while len(head) < 4:  # frame header: length (3 bytes), type (1 byte)
                sock.settimeout(max(0.001, deadline - time.monotonic()))
                chunk = sock.recv(9 - len(head))
                if not chunk:
                    return PROBE_SILENT, "it closed the connection without an HTTP/2 answer"
                head += chunk
        except socket.timeout:
            return PROBE_SILENT, (f"it accepted the connection but sent no HTTP/2 "
                                  f"SETTINGS frame within {timeout:.1f} s")
        except OSError as e:  # reset: the process went away
            return PROBE_UNREACHABLE, f"the connection failed: {e.strerror or e}"
    if head[3] != _H2_SETTINGS:
        return PROBE_WRONG, f"it answered {head!r}, not an HTTP/2 SETTINGS frame"
    return PROBE_OK, ""


def wait_for_tasks(config: ClusterConfig, timeout_s: float = 30.0,
                   jobs: Sequence[str] = ("ps", "worker"),
                   procs: Optional[Dict[str, subprocess.Popen]] = None,
                   probe_timeout_s: float = 1.0) -> None:
    """Waits until every task of ``jobs`` is a serving gRPC server.

    Each task must accept a TCP connection and answer the HTTP/2 handshake
    (:func:`probe_grpc`), so a port held by another program is reported
    instead of hanging TensorFlow's connect.

    Args:
      config: the cluster.
      timeout_s: seconds to wait in all.
      jobs: which jobs to check.
      procs: optional {"job:i": Popen}; a process that exits fails at once.
      probe_timeout_s: seconds for one probe's connect and for its answer.

    Raises:
      TimeoutError: naming each task still unreachable or silent after
        ``timeout_s``.
      RuntimeError: a task answered with something that is not HTTP/2 (fails
        at once), or a process in ``procs`` exited during the wait.
    """
    pending = {f"{j}:{i}": a for j in jobs for i, a in enumerate(config.get(j, []))}
    state = {}  # name -> (status, detail) of its last probe
    deadline = time.monotonic() + timeout_s
    delay = 0.05
    while pending:
        for name, addr in list(pending.items()):
            left = max(0.05, min(probe_timeout_s, deadline - time.monotonic()))
            status, detail = state[name] = probe_grpc(addr, timeout=left)
            if status == PROBE_OK:
                del pending[name]
            elif status == PROBE_WRONG:
                raise RuntimeError(
                    f"{name} at {addr} answers but is not a TensorFlow gRPC server: "
                    f"{detail}. Another program holds that port: fix the address "
                    "in TF_CONFIG or stop that program.")
        if not pending:
            return
        for name, p in (procs or {}).items():
            if name in pending and p.poll() is not None:
                raise RuntimeError(
                    f"task {name} exited with code {p.returncode} before serving at "
                    f"{pending[name]}.")
        if time.monotonic() > deadline:
            silent = {n: a for n, a in pending.items() if state[n][0] == PROBE_SILENT}
            parts = []
            if silent:
                parts.append("; ".join(
                    f"{n} at {a} answers but is not a TensorFlow gRPC server "
                    f"({state[n][1]})" for n, a in silent.items()))
            down = {n: a for n, a in pending.items() if n not in silent}
            if down:
                parts.append("cannot reach " + ", ".join(
                    f"{n} at {a}" for n, a in down.items()))
            raise TimeoutError(
                "; ".join(parts) + f" after {timeout_s:g} s: is the task running "
                "(`tf-asyncps server`), is the address right and is its port open? "
                "(connect timeout: --connect_timeout_s)")
        time.sleep(delay)
        delay = min(delay * 1.5, 0.5)


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
    import tensorflow as tf
    if config.task_type not in ("ps", "worker"):
        raise ValueError(
            f'only "ps" and "worker" tasks serve; this task is {config.task_type!r}.')
    warn_evaluators(config)
    from tf_asyncps.cluster import devices
    num_gpus = 0
    if config.task_type == "ps":
        # Parameter servers keep variables on CPU; don't grab GPU memory.
        try:
            tf.config.set_visible_devices([], "GPU")
        except (RuntimeError, ValueError):
            pass
    elif os.environ.get(devices.LOGICAL_GPUS, "").strip() not in ("", "0", "1"):
        # Enumerating GPUs does not create devices: the server creates them
        # below, from its ConfigProto.
        num_gpus = len(tf.config.list_physical_devices("GPU"))
    return tf.distribute.Server(
        config.cluster_spec(), job_name=config.task_type,
        task_index=config.task_id, protocol="grpc",
        config=server_config(config.num_workers, config.task_type, num_gpus), start=True)


def _set_pdeathsig():  # runs in the child before exec
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class LocalCluster:
    """A real cluster of local processes: ``num_ps`` ps and ``num_workers`` workers.

    Each task is ``python -m tf_asyncps server`` with its own TF_CONFIG, on a
    loopback port chosen by portpicker. A chief address is reserved for the
    process that creates the strategy (this one, or a child you start with
    :meth:`tf_config`). Children die with their parent (PR_SET_PDEATHSIG) and
    are stopped by pid on exit, on error and on Ctrl-C; if this process
    connected to the cluster, at this process's exit (see :meth:`stop`).

    Example::

        with LocalCluster(num_workers=2, num_ps=1) as cluster:
            strategy = tf_asyncps.AsyncParameterServerStrategy(cluster.resolver())

    Args:
      num_workers: worker tasks (>= 1).
      num_ps: parameter-server tasks (>= 1).
      log_dir: where each task writes ``<job>-<i>.log``; default a temp dir.
      start_timeout_s: seconds to wait for every task to serve.
      env: extra environment variables for the children.
      worker_env: {worker index: {var: value}} for single workers. GPUs:
        ``worker_env=tf_asyncps.cluster.devices.plan_gpus(n, k, available).worker_env``
        gives each worker its own ``CUDA_VISIBLE_DEVICES``; ps tasks never
        see a GPU.
      host: loopback address to bind.

    Raises:
      ValueError: bad sizes. TimeoutError / RuntimeError: a task did not start
        (the message includes the end of its log).
    """

    def __init__(self, num_workers: int = 2, num_ps: int = 1, *,
                 log_dir: Optional[str] = None, start_timeout_s: float = 90.0,
                 env: Optional[Dict[str, str]] = None,
                 worker_env: Optional[Dict[int, Dict[str, str]]] = None,
                 host: str = "127.0.0.1"):
        for name, v in (("num_workers", num_workers), ("num_ps", num_ps)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"LocalCluster: {name} must be an int >= 1, got {v!r}.")
        import portpicker
        import tempfile
        self.num_workers, self.num_ps = num_workers, num_ps
        self.log_dir = log_dir or tempfile.mkdtemp(prefix="tf_asyncps_cluster_")
        os.makedirs(self.log_dir, exist_ok=True)
        self.start_timeout_s = start_timeout_s
        self.env = dict(env or {})
        self.worker_env = {int(k): dict(v) for k, v in (worker_env or {}).items()}
        ports = [portpicker.pick_unused_port() for _ in range(1 + num_ps + num_workers)]
        self._ports = ports
        addr = lambda p: f"{host}:{p}"
        self.config = ClusterConfig({
            "chief": [addr(ports[0])],
            "ps": [addr(p) for p in ports[1:1 + num_ps]],
            "worker": [addr(p) for p in ports[1 + num_ps:]],
        }, task_type="chief", task_id=0)
        self.procs: Dict[str, subprocess.Popen] = {}
        self._logs = {}
        # Supervision (see supervise()): restarts per task and tasks given up on.
        self.restarts: Dict[str, int] = {}
        self.gave_up: Dict[str, int] = {}
        self._proc_lock = threading.RLock()
        self._supervisor: Optional[threading.Thread] = None
        self._supervisor_stop = threading.Event()
        self._extra_pids: Dict[str, int] = {}

    # -- addresses and configs ---------------------------------------------
    @property
    def task_names(self) -> List[str]:
        return [f"ps:{i}" for i in range(self.num_ps)] + [
            f"worker:{i}" for i in range(self.num_workers)]

    def tf_config(self, task_type: str = "chief", task_id: int = 0) -> str:
        """TF_CONFIG JSON for one task of this cluster."""
        return self.config.to_tf_config(task_type, task_id)

    def resolver(self):
        """A ClusterResolver for the chief (this process)."""
        return cluster_resolver(ClusterConfig(self.config, "chief", 0))

    def log_path(self, name: str) -> str:
        return os.path.join(self.log_dir, name.replace(":", "-") + ".log")

    def log_tail(self, name: str, n: int = 20) -> str:
        try:
            with open(self.log_path(name), errors="replace") as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return "(no log)"

    @property
    def pids(self) -> Dict[str, int]:
        return {n: p.pid for n, p in self.procs.items()}

    # -- lifecycle ------------------------------------------------------------
    def _spawn(self, name: str) -> subprocess.Popen:
        job, i = name.split(":")
        env = dict(os.environ)
        env.update(self.env)
        env["TF_CONFIG"] = self.tf_config(job, int(i))
        env.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
        # `import tensorflow` eagerly imports Keras's optimizers: Keras 3's pull
        # in scikit-learn (1.4 s of CPU per task). A server runs no Python
        # Keras code, so it takes tf_keras's lighter ones.
        env.setdefault("TF_USE_LEGACY_KERAS", "1")
        if job == "ps":
            env["CUDA_VISIBLE_DEVICES"] = ""
        if job == "worker":
            env.update(self.worker_env.get(int(i), {}))
        log = open(self.log_path(name), "ab")
        self._logs[name] = log
        p = subprocess.Popen(
            [sys.executable, "-m", "tf_asyncps", "server"], env=env,
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            preexec_fn=_set_pdeathsig)
        self.procs[name] = p
        return p

    def start(self) -> "LocalCluster":
        """Starts every ps and worker and waits until they serve."""
        try:
            for name in self.task_names:
                self._spawn(name)
            self._wait(self.task_names)
        except BaseException:
            self.stop()
            raise
        self.write_state()
        return self

    @property
    def state_path(self) -> str:
        """``log_dir/cluster.json``: every task's address and current pid."""
        return os.path.join(self.log_dir, "cluster.json")

    def write_state(self, extra_pids: Optional[Dict[str, int]] = None) -> None:
        """Writes :attr:`state_path` atomically: {"tasks": {name: {"address",
        "pid"}}, "restarts": {name: n}}; ``extra_pids`` adds tasks started
        elsewhere (launch's chief). Tools and tests find pids to signal here."""
        from tf_asyncps.files import atomic_write_json
        with self._proc_lock:
            if extra_pids is not None:
                self._extra_pids = dict(extra_pids)
            pids = {n: p.pid for n, p in self.procs.items()}
            pids.update(self._extra_pids)
            tasks = {}
            for n, pid in pids.items():
                job, i = n.split(":")
                tasks[n] = {"address": self.config[job][int(i)], "pid": int(pid)}
            try:
                atomic_write_json(self.state_path, {"tasks": tasks,
                                                    "restarts": dict(self.restarts)})
            except OSError as e:  # informational only
                logging.warning("LocalCluster: could not write %s: %s", self.state_path, e)

    def _wait(self, names):
        sub = ClusterConfig({j: [] for j in ROLES})
        for n in names:
            job, i = n.split(":")
            sub[job].append(self.config[job][int(i)])
        try:
            wait_for_tasks(sub, self.start_timeout_s,
                           procs={n: self.procs[n] for n in names})
        except (TimeoutError, RuntimeError) as e:
            tails = "\n".join(f"--- {n} ({self.log_path(n)}):\n{self.log_tail(n)}"
                              for n in names)
            raise type(e)(f"{e}\n{tails}") from None

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Sends ``sig`` to task ``name`` ("worker:1", "ps:0") and, for a
        terminating signal, waits for it to exit (10 s at most)."""
        p = self._proc(name)
        if p.poll() is None:
            p.send_signal(sig)
            if sig in (signal.SIGKILL, signal.SIGTERM, signal.SIGINT):
                p.wait(timeout=10)

    def restart(self, name: str) -> None:
        """Kills task ``name`` if alive and starts it again on the same port."""
        with self._proc_lock:  # the supervisor must not restart it as well
            self.kill(name)
            self._close_log(name)
            self._spawn(name)
        self._wait([name])

    def supervise(self, max_restarts: int = 3, poll_s: float = 0.5) -> "LocalCluster":
        """Restarts any ps or worker task that exits, on its own port.

        A background thread polls the children every ``poll_s`` seconds; a task
        that exited (crash, SIGKILL, OOM kill) is started again, at most
        ``max_restarts`` times per task; after that it is left down and named
        in ``gave_up`` ({task: exit code}) with an error in the log. A
        restarted worker rejoins by itself (ClusterCoordinator reconnects and
        rebuilds its per-worker datasets); a restarted ps holds fresh
        variables, so the chief must restore them from a checkpoint (``launch
        --restart_failed_tasks`` re-runs the chief for that).

        Args:
          max_restarts: restarts allowed per task (int >= 0).
          poll_s: seconds between checks (float > 0).

        Returns:
          self. ``restarts`` ({task: count}) says what was restarted.

        Raises:
          ValueError: bad arguments.
        """
        if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) \
                or max_restarts < 0:
            raise ValueError(f"max_restarts must be an int >= 0, got {max_restarts!r}.")
        if not (isinstance(poll_s, (int, float)) and poll_s > 0):
            raise ValueError(f"poll_s must be seconds > 0, got {poll_s!r}.")
        if self._supervisor is not None:
            raise ValueError("this LocalCluster is already supervised.")
        self._supervisor_stop.clear()
        self._supervisor = threading.Thread(
            target=self._supervise, args=(max_restarts, poll_s), daemon=True,
            name="LocalCluster-supervisor")
        self._supervisor.start()
        return self

    def _supervise(self, max_restarts: int, poll_s: float) -> None:
        while not self._supervisor_stop.wait(poll_s):
            for name in self.task_names:
                with self._proc_lock:
                    if self._supervisor_stop.is_set():
                        return
                    p = self.procs.get(name)
                    if p is None or p.poll() is None or name in self.gave_up:
                        continue
                    n = self.restarts.get(name, 0)
                    if n >= max_restarts:
                        self.gave_up[name] = p.returncode
                        logging.error("LocalCluster: %s exited with code %s and has used its "
                                      "%d restart(s); it stays down. Its log: %s", name,
                                      p.returncode, max_restarts, self.log_path(name))
                        continue
                    self.restarts[name] = n + 1
                    logging.warning("LocalCluster: %s exited with code %s; restarting it "
                                    "(restart %d of %d).", name, p.returncode, n + 1,
                                    max_restarts)
                    self._close_log(name)
                    self._spawn(name)
                    self.write_state()
                try:
                    self._wait([name])
                except (TimeoutError, RuntimeError) as e:  # its next exit is seen above
                    logging.error("LocalCluster: restarted %s did not serve: %s", name, e)

    def _stop_supervisor(self) -> None:
        if self._supervisor is not None:
            self._supervisor_stop.set()
            with self._proc_lock:
                pass  # a restart in progress has finished spawning
            self._supervisor.join(timeout=self.start_timeout_s + 5)
            self._supervisor = None

    def _proc(self, name: str) -> subprocess.Popen:
        if name not in self.procs:
            raise ValueError(f"no task {name!r}; tasks are {self.task_names}.")
        return self.procs[name]

    def _close_log(self, name):
        log = self._logs.pop(name, None)
        if log:
            log.close()

    def stop(self, grace_s: float = 5.0, *, defer_if_connected: bool = False) -> None:
        """Stops every child by pid: SIGTERM, then SIGKILL after ``grace_s``.

        With ``defer_if_connected`` (what leaving the ``with`` block uses) and
        this process connected to the cluster (a strategy was created here),
        the children are left to stop when this process exits
        (PR_SET_PDEATHSIG): TensorFlow's teardown at exit still talks to them,
        and TensorFlow allows one cluster per process anyway.
        """
        self._stop_supervisor()
        if defer_if_connected and tf_compat.context_connected() and self._alive_children():
            logging.info("LocalCluster: tasks %s stop when this process exits.",
                         sorted(self.pids))
            return
        for p in self.procs.values():
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    p.send_signal(signal.SIGCONT)  # a SIGSTOPped task can't exit
                    p.terminate()
        deadline = time.monotonic() + grace_s
        for p in self.procs.values():
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    p.kill()
                p.wait(timeout=10)
        for name in list(self._logs):
            self._close_log(name)

    def __enter__(self) -> "LocalCluster":
        return self.start()

    def _alive_children(self) -> bool:
        return any(p.poll() is None for p in self.procs.values())

    def __exit__(self, *exc) -> None:
        self.stop(defer_if_connected=True)
