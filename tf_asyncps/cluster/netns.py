"""Several hosts on one Linux machine: network namespaces on one bridge.

:class:`NetnsHosts` makes one network namespace per host, each with its own
address from the benchmarking range 198.18.0.0/15 (RFC 2544) on a virtual
Ethernet link (veth) to a bridge in a "switch" namespace of its own, and
optionally a ``tc tbf`` rate limit on each host's link, both ways. Nothing
is attached to the machine's own (root) namespace, so the hosts' traffic
stays among them. A task runs on a host with :meth:`NetnsHosts.exec_argv`
(``ip netns exec``); :meth:`NetnsHosts.link_down` pulls a host's cable.

Needs Linux, iproute2 (``ip``, ``tc``) and root with CAP_NET_ADMIN and
CAP_SYS_ADMIN; :func:`unavailable` says why not, for tests to skip with.
``netem`` is not needed (it is missing on some kernels): there is no
added delay, only a rate.

Every namespace is named ``tfa<pid>-...`` after the process that made it:
:meth:`NetnsHosts.close` (also at exit, and on leaving ``with``) kills the
processes inside by pid and deletes the namespaces (which deletes their
links); namespaces left by a process that no longer exists (SIGKILLed) are
removed by the next :class:`NetnsHosts` made, or by :func:`remove_namespaces_of`.
"""

import atexit
import contextlib
import ctypes
import ipaddress
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from typing import Dict, List, Optional, Sequence

from tf_asyncps.validate import check_number

__all__ = ["NetnsHosts", "unavailable", "remove_namespaces_of", "SUBNET"]

#: The hosts' subnet: the start of the benchmarking range 198.18.0.0/15.
SUBNET = ipaddress.ip_network("198.18.0.0/24")
_NETNS_DIR = "/run/netns"
_CLONE_NEWNET = 0x40000000
_CAP_NET_ADMIN, _CAP_SYS_ADMIN = 12, 21
_CMD_TIMEOUT_S = 30.0
_PREFIX = re.compile(r"^tfa(\d+)-")


def _run(argv: Sequence[str], check: bool = True) -> subprocess.CompletedProcess:
    """Runs one iproute2 command (bounded); raises RuntimeError with its stderr."""
    try:
        p = subprocess.run(list(argv), capture_output=True, text=True,
                           timeout=_CMD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"`{' '.join(argv)}` did not finish in {_CMD_TIMEOUT_S:g} s")
    except OSError as e:
        raise RuntimeError(f"`{' '.join(argv)}` could not run: {e}") from None
    if check and p.returncode != 0:
        raise RuntimeError(f"`{' '.join(argv)}` failed ({p.returncode}): "
                           f"{(p.stderr or p.stdout).strip()}")
    return p


def _capabilities() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return int(line.split()[1], 16)
    except (OSError, ValueError):
        pass
    return 0


_unavailable_cache: Dict[bool, Optional[str]] = {}


def unavailable(rate: bool = False) -> Optional[str]:
    """Why :class:`NetnsHosts` cannot work here, or None if it can.

    Checks Linux, ``ip`` (and ``tc`` with ``rate``), CAP_NET_ADMIN and
    CAP_SYS_ADMIN, then makes and deletes one namespace, and with ``rate``
    a veth with a ``tbf`` qdisc, as evidence. The answer is cached.

    Args:
      rate: also require ``tc qdisc ... tbf``.

    Returns:
      None, or a sentence for a skip reason.
    """
    if rate in _unavailable_cache:
        return _unavailable_cache[rate]
    why = None
    caps = _capabilities()
    if not sys.platform.startswith("linux"):
        why = f"network namespaces need Linux (this is {sys.platform})"
    elif shutil.which("ip") is None or (rate and shutil.which("tc") is None):
        why = "iproute2 (`ip`, `tc`) is not installed"
    elif not caps >> _CAP_NET_ADMIN & 1 or not caps >> _CAP_SYS_ADMIN & 1:
        why = "this process lacks CAP_NET_ADMIN/CAP_SYS_ADMIN (run as root)"
    else:
        ns = f"tfa{os.getpid()}-probe"
        try:
            _run(["ip", "netns", "add", ns])
            if rate:
                _run(["ip", "-n", ns, "link", "add", "name", "tx0", "type", "veth",
                      "peer", "name", "rx0"])
                _run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "tx0", "root",
                      "tbf", "rate", "10mbit", "burst", "64kb", "latency", "50ms"])
        except RuntimeError as e:
            why = f"network namespaces do not work here: {e}"
        finally:
            _run(["ip", "netns", "del", ns], check=False)
    _unavailable_cache[rate] = why
    return why


def _namespaces() -> List[str]:
    try:
        return sorted(os.listdir(_NETNS_DIR))
    except OSError:
        return []


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _delete_namespace(ns: str) -> None:
    """Kills every process in ``ns`` (by pid), then deletes it and its links."""
    p = _run(["ip", "netns", "pids", ns], check=False)
    for tok in p.stdout.split():
        with contextlib.suppress(ValueError, ProcessLookupError, PermissionError):
            os.kill(int(tok), signal.SIGKILL)
    _run(["ip", "netns", "del", ns], check=False)


def remove_namespaces_of(pid: int) -> List[str]:
    """Deletes every namespace made by process ``pid`` (``tfa<pid>-*``) and
    kills the processes inside. For tests and tools cleaning up after a
    process that was SIGKILLed. Returns the names removed."""
    gone = [ns for ns in _namespaces() if ns.startswith(f"tfa{int(pid)}-")]
    for ns in gone:
        _delete_namespace(ns)
    return gone


def _remove_stale() -> None:
    for ns in _namespaces():
        m = _PREFIX.match(ns)
        if m and int(m.group(1)) != os.getpid() and not _pid_alive(int(m.group(1))):
            _delete_namespace(ns)


def _rate_args(mbit: float) -> List[str]:
    # burst: at least one 64 KiB GSO segment and 10 ms at the rate (tbf needs
    # rate/HZ); latency bounds the queue (100 ms of traffic).
    burst = max(64 * 1024, int(mbit * 1e6 / 8 * 0.01))
    return ["tbf", "rate", f"{mbit:g}mbit", "burst", str(burst), "latency", "100ms"]


class NetnsHosts:
    """Hosts as Linux network namespaces on one bridge, each with an address.

    Example::

        with NetnsHosts(["chief:0", "ps:0", "worker:0"], rate_mbit=100) as hosts:
            hosts.address("ps:0")                      # "198.18.0.2"
            subprocess.run(hosts.exec_argv("ps:0", ["tf-asyncps", "train"]), ...)

    Args:
      names: one name per host (task names such as "worker:1" work), at most
        250, each unique.
      rate_mbit: if set, a ``tbf`` limit of this many Mbit/s (10^6 bit/s) on
        each host's link, in each direction; None for none (veth speed).
      spec: internal: attach to hosts made by another process (see
        :meth:`spec`) without owning them (no cleanup here).

    Raises:
      ValueError: bad ``names`` or ``rate_mbit``.
      RuntimeError: namespaces do not work here (the reason from
        :func:`unavailable`), or an ``ip``/``tc`` command failed (its text);
        whatever was made is removed first.
    """

    def __init__(self, names: Sequence[str] = (), rate_mbit: Optional[float] = None, *,
                 spec: Optional[dict] = None):
        if spec is not None:
            self._ns, self._ip = dict(spec["namespaces"]), dict(spec["addresses"])
            self._switch, self.rate_mbit, self._owner = spec["switch"], spec["rate_mbit"], False
            return
        names = list(names)
        if not names or len(set(names)) != len(names) or len(names) > 250:
            raise ValueError(f"NetnsHosts: names must be 1-250 unique host names, got {names!r}.")
        if rate_mbit is not None:
            check_number(rate_mbit, "NetnsHosts: rate_mbit", above=0, hint="Mbit/s, or None")
        why = unavailable(rate=rate_mbit is not None)
        if why:
            raise RuntimeError(f"NetnsHosts: {why}.")
        _remove_stale()
        self.rate_mbit, self._owner, self._closed = rate_mbit, True, False
        tag = f"tfa{os.getpid()}-{id(self) % 10000:04d}"
        self._switch = f"{tag}-sw"
        self._ns = {n: f"{tag}-{re.sub(r'[^A-Za-z0-9_.-]', '-', n)}" for n in names}
        self._ip = {n: str(SUBNET[k + 1]) for k, n in enumerate(names)}
        atexit.register(self.close)
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _build(self) -> None:
        sw = self._switch
        _run(["ip", "netns", "add", sw])
        _run(["ip", "-n", sw, "link", "add", "br0", "type", "bridge"])
        _run(["ip", "-n", sw, "link", "set", "br0", "up"])
        for k, (name, ns) in enumerate(self._ns.items()):
            port = f"p{k}"
            _run(["ip", "netns", "add", ns])
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
            _run(["ip", "-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", port,
                  "netns", sw])
            _run(["ip", "-n", sw, "link", "set", port, "master", "br0"])
            _run(["ip", "-n", sw, "link", "set", port, "up"])
            _run(["ip", "-n", ns, "addr", "add", f"{self._ip[name]}/{SUBNET.prefixlen}",
                  "dev", "eth0"])
            _run(["ip", "-n", ns, "link", "set", "eth0", "up"])
            if self.rate_mbit is not None:
                # Egress both ways: the host's sending and its receiving.
                _run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "eth0", "root",
                      *_rate_args(self.rate_mbit)])
                _run(["ip", "netns", "exec", sw, "tc", "qdisc", "add", "dev", port, "root",
                      *_rate_args(self.rate_mbit)])

    # -- what the hosts are --------------------------------------------------------
    @property
    def names(self) -> List[str]:
        return list(self._ns)

    def namespace(self, name: str) -> str:
        """The namespace of host ``name`` (for ``ip netns exec``/``ip -n``)."""
        return self._ns[self._known(name)]

    def address(self, name: str) -> str:
        """Host ``name``'s IPv4 address, e.g. "198.18.0.2"."""
        return self._ip[self._known(name)]

    def spec(self) -> dict:
        """JSON-serialisable description for ``NetnsHosts(spec=...)`` in
        another process (which then uses the hosts but does not remove them)."""
        return {"namespaces": dict(self._ns), "addresses": dict(self._ip),
                "switch": self._switch, "rate_mbit": self.rate_mbit}

    def _known(self, name: str) -> str:
        if name not in self._ns:
            raise ValueError(f"NetnsHosts: no host {name!r}; hosts are {self.names}.")
        return name

    # -- using them ------------------------------------------------------------------
    def exec_argv(self, name: str, argv: Sequence[str]) -> List[str]:
        """``argv`` run on host ``name``: ``ip netns exec NS argv...``. The
        command keeps its pid (``ip`` execs it), environment and files."""
        return ["ip", "netns", "exec", self.namespace(name), *[os.fspath(a) for a in argv]]

    def link_down(self, name: str) -> None:
        """Takes host ``name``'s link down (``ip link set eth0 down``): its
        connections stay open but nothing passes, as with a pulled cable."""
        _run(["ip", "-n", self.namespace(name), "link", "set", "eth0", "down"])

    def link_up(self, name: str) -> None:
        """Brings host ``name``'s link back up (address and rate limit kept)."""
        _run(["ip", "-n", self.namespace(name), "link", "set", "eth0", "up"])

    def counters(self, name: str) -> Dict[str, int]:
        """Host ``name``'s link counters: {"tx_bytes", "rx_bytes",
        "tx_packets", "rx_packets"} since the link was made (bytes include
        Ethernet headers)."""
        p = _run(["ip", "-j", "-s", "-n", self.namespace(name), "link", "show", "eth0"])
        stats = json.loads(p.stdout)[0]["stats64"]
        return {"tx_bytes": int(stats["tx"]["bytes"]), "rx_bytes": int(stats["rx"]["bytes"]),
                "tx_packets": int(stats["tx"]["packets"]),
                "rx_packets": int(stats["rx"]["packets"])}

    @contextlib.contextmanager
    def enter(self, name: str):
        """Runs the ``with`` body's sockets on host ``name``: the calling
        thread switches to its namespace (``setns``) and back at the end.
        Only this thread moves; threads it starts inside stay there."""
        libc = ctypes.CDLL(None, use_errno=True)
        own = os.open(f"/proc/self/task/{threading.get_native_id()}/ns/net", os.O_RDONLY)
        try:
            target = os.open(os.path.join(_NETNS_DIR, self.namespace(name)), os.O_RDONLY)
            try:
                if libc.setns(target, _CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), f"setns into {self.namespace(name)}")
            finally:
                os.close(target)
            try:
                yield self
            finally:
                if libc.setns(own, _CLONE_NEWNET) != 0:  # pragma: no cover - cannot fail as root
                    raise OSError(ctypes.get_errno(), "setns back to this thread's namespace")
        finally:
            os.close(own)

    # -- cleanup ----------------------------------------------------------------------
    def close(self) -> None:
        """Kills the processes inside the hosts and deletes every namespace
        and link made (idempotent; a no-op for hosts attached by ``spec``)."""
        if not self._owner or self._closed:
            return
        self._closed = True
        for ns in list(self._ns.values()) + [self._switch]:
            if ns in _namespaces():
                _delete_namespace(ns)
        atexit.unregister(self.close)

    def __enter__(self) -> "NetnsHosts":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        rate = f", {self.rate_mbit:g} Mbit/s" if self.rate_mbit else ""
        return f"NetnsHosts({', '.join(f'{n}={a}' for n, a in self._ip.items())}{rate})"
