"""Is a task serving? A TCP and HTTP/2 (gRPC) probe, without TensorFlow."""

import socket
import subprocess
import time
from typing import Dict, Optional, Sequence

from tf_asyncps.cluster.config import ClusterConfig

__all__ = ["reachable", "probe_grpc", "wait_for_tasks", "PROBE_OK",
           "PROBE_UNREACHABLE", "PROBE_SILENT", "PROBE_WRONG"]

def reachable(addr: str, timeout: float) -> bool:
    """Whether ``addr`` accepts a TCP connection (any program, not only gRPC).

    Args:
      addr: "host:port" (IPv6 as "[::1]:port").
      timeout: seconds for the connect.

    Returns:
      True if the connect succeeded (the connection is closed at once).
    """
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
                   probe_timeout_s: float = 1.0,
                   timeout_name: str = "--connect_timeout_s") -> None:
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
      timeout_name: how the caller set ``timeout_s`` (a flag, an argument),
        named in the TimeoutError.

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
                f"(to wait longer: {timeout_name})")
        time.sleep(delay)
        delay = min(delay * 1.5, 0.5)
