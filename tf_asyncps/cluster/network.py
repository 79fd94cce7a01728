"""Network and security checks of a cluster's addresses (no TensorFlow).

* :func:`warn_if_exposed`: the loud warning for tasks reachable past loopback
  (TensorFlow's gRPC servers are unauthenticated);
* :func:`check_own_address`: this task's own address must be this host's.
"""

import ipaddress
import socket
import threading
from typing import List

from tf_asyncps.cluster import config as _config
from tf_asyncps.cluster.config import ClusterConfig

__all__ = ["is_loopback", "exposed_addresses", "warn_if_exposed", "host_is_local",
           "check_own_address"]

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
    return _config.warn_once(
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
