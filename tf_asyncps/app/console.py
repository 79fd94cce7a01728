"""What `tf-asyncps launch` shows of the chief's output, and what it only logs.

TensorFlow's C++ runtime writes to the chief's stderr: start-up notices
(oneDNN, cuInit, CPU features, absl's pre-init warning) in every process, and
when a worker dies, gRPC error blocks (measured: 77 blocks, 330 lines for
one SIGKILLed worker in an 8-epoch digits job). :class:`ConsoleFilter` keeps
every line in the chief's log file and shows on the console the job's own
lines, Python warnings and errors (tracebacks included), TensorFlow's fatal
C++ lines, and one line per event in place of a C++ block: which task
became unreachable, since when, and what happens next. :class:`TaskWatch`
reports a ps or worker process that exits while the chief runs, and says when
the job cannot go on (launch then stops the chief and the cluster).
"""

import io
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Callable, Dict, Optional, TextIO

__all__ = ["ConsoleFilter", "NativeStderrFilter", "TaskWatch", "describe_exit",
           "is_runtime_noise", "task_in", "run_filtered", "sigterm_as_ctrl_c"]

# glog-style lines written by C++ (file.cc:123]); absl's Python logging uses
# the same prefix with a .py file and is kept.
_CPP_LOG = re.compile(r"^[IWE]\d{4} \d\d:\d\d:\d+\.\d+\s+\d+ [\w./-]+\.(cc|h|cpp):\d+\] ")
# TensorFlow 2.18's own C++ log format (TSL logging, before the move to absl):
# "2026-12-02 18:33:08.717717: I tensorflow/core/util/port.cc:153] ...".
_TSL_LOG = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+: [IWE] [\w./-]+\.(cc|h|cpp):\d+\] ")
_NOISE = (
    re.compile(r"^WARNING: All log messages before absl::InitializeLog\(\) is called"),
    re.compile(r"^To enable the following instructions: .*rebuild TensorFlow"),
    re.compile(r"^Additional GRPC error information from remote target"),
    re.compile(r"^:\w+:Error received from peer"),
    re.compile(r"^This could happen if the remote target has been disconnected"),
)
# TensorFlow's coordinator logs each worker failure (Python, one line).
_COORDINATOR_LOG = re.compile(r"^[IWE]\d{4} [\d:.]+\s+\d+ cluster_coordinator\.py:\d+\] ")
_GRPC_FROM = re.compile(r"^Additional GRPC error information from remote target (\S+)")
_TASK = re.compile(r"/job:(worker|ps)/replica:\d+/task:(\d+)")
# What says a task cannot be reached: gRPC status 14 (UNAVAILABLE) and its
# words; not, e.g., status 3 of a function already removed at shutdown.
_UNREACHABLE = re.compile(r"(grpc_status:14|UnavailableError|failed to connect|"
                          r"Connection refused|Connection reset|Socket closed)")
#: Seconds during which one task's failure is reported once.
QUIET_S = 60.0


def is_runtime_noise(line: str) -> bool:
    """Whether ``line`` is TensorFlow C++ runtime output that only the log
    file keeps (not a fatal ``F`` line, not Python's)."""
    s = line.rstrip("\r\n")
    return bool(_CPP_LOG.match(s) or _TSL_LOG.match(s) or _COORDINATOR_LOG.match(s)) or \
        any(p.match(s) for p in _NOISE)


def task_in(line: str) -> Optional[str]:
    """``"worker:1"`` for a line naming ``/job:worker/replica:0/task:1``, else None."""
    m = _TASK.search(line)
    return f"{m.group(1)}:{m.group(2)}" if m else None


class ConsoleFilter:
    """Copies a child's output to ``log`` whole and to ``console`` filtered.

    Args:
      console: where shown lines go (e.g. sys.stdout).
      log: a text file that receives every line, unfiltered.
      log_name: the log file's name for the event lines (e.g. "logs/chief-0.log").
      restarts: whether failed tasks are restarted (``--restart_failed_tasks``),
        which changes what an event line says happens next.
      clock: seconds since the epoch (for "since HH:MM:SS").
      full: show every line as it comes (``--console=full``); the log still
        gets them all and no event line is added.

    Attributes:
      hidden: lines kept out of the console (int).
      events: the event lines shown, in order (list of str).
    """

    def __init__(self, console: TextIO, log: TextIO, log_name: str, restarts: bool = False,
                 clock: Callable[[], float] = time.time, full: bool = False):
        self.console, self.log, self.log_name = console, log, log_name
        self.full = full
        self.restarts, self.clock = restarts, clock
        self.hidden = 0
        self.events = []
        self._down: Dict[str, float] = {}  # task -> when its failure was last reported
        self._block_task = None  # the task the current gRPC error block is about
        self._lock = threading.Lock()

    def _next(self, task: str) -> str:
        if task.startswith("ps:"):
            return ("the chief fails (a ps task holds variables); it is re-run from the "
                    "latest checkpoint once the ps is back" if self.restarts else
                    "the chief fails: a ps task holds variables (--restart_failed_tasks "
                    "restarts it and re-runs the chief from the latest checkpoint)")
        return ("its closures are retried on the other workers; it rejoins when it is "
                "restarted" if self.restarts else
                "its closures are retried on the other workers; it rejoins if it comes back")

    def feed(self, line: str) -> None:
        """Takes one line (with its ``\\n`` or ``\\r``) of the child's output."""
        with self._lock:
            self.log.write(line)
            if self.full or not is_runtime_noise(line):
                self._block_task = None
                self.console.write(line)
                self.console.flush()
                return
            self.hidden += 1
            m = _GRPC_FROM.match(line)
            if m:  # a block's first line names the task; its next line says why
                self._block_task = task_in(m.group(1))
                return
            task = task_in(line) or self._block_task
            if task and _UNREACHABLE.search(line):
                self._report(task)

    def _report(self, task: str) -> None:
        now = self.clock()
        if now - self._down.get(task, -QUIET_S) < QUIET_S:
            return
        self._down[task] = now
        since = time.strftime("%H:%M:%S", time.localtime(now))
        event = (f"tf-asyncps: {task} unreachable since {since}; {self._next(task)} "
                 f"(TensorFlow's gRPC errors: {self.log_name})\n")
        self.events.append(event)
        self.console.write(event)
        self.console.flush()

    def pump(self, stream) -> None:
        """Feeds every line of ``stream`` (a text stream opened with
        ``newline=""``, so ``\\r`` progress updates pass as they come) until EOF."""
        for line in iter(stream.readline, ""):
            self.feed(line)
        self.log.flush()


class NativeStderrFilter:
    """While active, this process's file descriptor 2 (where TensorFlow's C++
    runtime writes, as Python's sys.stderr does) goes to a temporary file; on
    ``release()`` (or exit, also on an exception) fd 2 is restored and what
    was written is shown again without the runtime noise. For a bounded
    stretch of work (importing TensorFlow, checking flags), not for a whole
    job: nothing is shown until release.
    """

    def __init__(self):
        self._saved = None
        self._file = None

    def __enter__(self):
        sys.stderr.flush()
        self._file = tempfile.TemporaryFile(mode="w+b")
        self._saved = os.dup(2)
        os.dup2(self._file.fileno(), 2)
        return self

    def release(self) -> None:
        if self._saved is None:
            return
        sys.stderr.flush()
        os.dup2(self._saved, 2)
        os.close(self._saved)
        self._saved = None
        self._file.seek(0)
        text = self._file.read().decode("utf-8", errors="replace")
        self._file.close()
        kept = [ln for ln in text.splitlines(keepends=True) if not is_runtime_noise(ln)]
        if kept:
            sys.stderr.write("".join(kept))
            sys.stderr.flush()

    def __exit__(self, *exc):
        self.release()
        return False


def describe_exit(rc: int) -> str:
    """``"exited with code 3"`` or ``"was killed by SIGABRT"`` (``rc`` < 0:
    that signal, as ``Popen.returncode`` gives it)."""
    if rc < 0:
        try:
            return f"was killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"was killed by signal {-rc}"
    return f"exited with code {rc}"


class TaskWatch:
    """What launch does when a ps or worker process of its cluster exits
    while the chief runs. Called every poll; returns why the job must stop,
    or None.

    A ps holds variables: its exit ends the job. A worker's closures are
    retried on the other workers (ClusterCoordinator): its exit is reported
    on ``out`` once, and ends the job when no worker is left, since the
    coordinator would wait for one to come back until --timeout_s.

    Args:
      down: returns the tasks that are down, ``{task: exit code}``
        (``LocalCluster.exited``; with restarts: the tasks given up on).
      workers: every worker task's name (``"worker:0"``, ...).
      log_path: task -> the path of its log file.
      log_tail: task -> the last lines of its log file (shown when the job stops).
      restarts: whether down tasks were restarted first (words only).
      out: where a tolerated worker exit is reported (default sys.stdout).

    Attributes:
      reported: the tasks reported so far, in order (list of str).
    """

    def __init__(self, down: Callable[[], Dict[str, int]], workers, log_path, log_tail,
                 restarts: bool = False, out: Optional[TextIO] = None):
        self.down, self.workers = down, list(workers)
        self.log_path, self.log_tail, self.restarts = log_path, log_tail, restarts
        self.out = out
        self.reported = []

    def _what(self, task: str, rc: int) -> str:
        after = (" and used its restarts" if self.restarts else "")
        tail = self.log_tail(task).rstrip("\n")
        tail = "\n".join("  " + ln for ln in tail.splitlines()) or "  (empty)"
        return (f"{task} {describe_exit(rc)}{after}; the end of its log "
                f"({self.log_path(task)}):\n{tail}")

    def __call__(self) -> Optional[str]:
        down = self.down()
        for task in sorted(down):
            if task.startswith("ps:"):
                return (f"{self._what(task, down[task])}\nA ps task holds variables: the job "
                        "cannot go on; the chief and the cluster are stopped.")
        alive = [w for w in self.workers if w not in down]
        new = [w for w in sorted(down) if w not in self.reported]
        if not alive and down:
            what = "\n".join(self._what(w, down[w]) for w in (new or sorted(down)[-1:]))
            return (f"{what}\nNo worker is left (the chief would wait for one until "
                    "--timeout_s): the chief and the cluster are stopped.")
        for task in new:
            self.reported.append(task)
            out = self.out or sys.stdout
            out.write(f"tf-asyncps: {task} {describe_exit(down[task])} (its log: "
                      f"{self.log_path(task)}); its closures are retried on the "
                      f"{len(alive)} worker(s) still running.\n")
            out.flush()
        return None


def run_filtered(cmd, env, log_path: str, *, restarts: bool = False,
                 timeout_s: Optional[float] = None, on_start=None, who: str = "launch",
                 full: bool = False, watch: Optional[Callable[[], Optional[str]]] = None,
                 poll_s: float = 0.5, append: bool = False) -> int:
    """Runs ``cmd`` to its end with its output through a :class:`ConsoleFilter`:
    whole into ``log_path`` (line-buffered; a new run starts it afresh unless
    ``append``), filtered to sys.stdout.

    Args:
      cmd: the command (started with ``cluster.spawn``: it dies with this process).
      env: its environment.
      log_path: the log file.
      restarts: passed to :class:`ConsoleFilter`.
      timeout_s: seconds before it is killed (None: no limit).
      on_start: called with the ``Popen`` once it runs (e.g. to record its pid).
      who: the command named in the messages below.
      full: show every line (``--console=full``), see :class:`ConsoleFilter`.
      watch: called every ``poll_s`` seconds while it runs (e.g. a
        :class:`TaskWatch`); a message it returns stops it.
      poll_s: seconds between calls of ``watch``.
      append: add to ``log_path`` (a re-run of the same job, e.g. launch's
        chief after a lost task) instead of truncating it.

    Returns:
      Its exit code (negative: killed by that signal).

    Raises:
      SystemExit: past ``timeout_s``, on Ctrl-C (KeyboardInterrupt) or when
        ``watch`` returned a message (which it carries), after stopping it
        (SIGTERM, then SIGKILL after 10 s).
    """
    from tf_asyncps.cluster.spawn import spawn
    os.makedirs(os.path.dirname(os.path.abspath(log_path)), exist_ok=True)
    if sys.stdout.isatty():  # its stderr is a pipe: keep its live progress line
        env = dict(env, TF_ASYNCPS_PROGRESS_LINE="1")
    child = spawn(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    if on_start is not None:
        on_start(child)
    log = open(log_path, "a" if append else "w", buffering=1)  # line-buffered: tail -f and tools see each line
    console = ConsoleFilter(sys.stdout, log, log_path, restarts=restarts, full=full)
    reader = threading.Thread(
        target=console.pump, name="child-output", daemon=True,
        args=(io.TextIOWrapper(child.stdout, encoding="utf-8", errors="replace",
                               newline=""),))
    reader.start()
    try:
        ended = _wait(child, timeout_s, watch, poll_s)
        if isinstance(ended, str):
            _stop(child)
            raise SystemExit(f"tf-asyncps {who}: {ended}")
        return ended
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()
        raise SystemExit(f"tf-asyncps {who}: the job ran past --timeout_s="
                         f"{timeout_s:.0f} s and was stopped.")
    except KeyboardInterrupt:
        _stop(child)
        raise SystemExit(f"tf-asyncps {who}: interrupted; every process stopped.")
    finally:
        if child.poll() is None:
            child.kill()
        reader.join(timeout=10)  # the rest of its output, up to EOF
        log.close()


def _wait(child, timeout_s, watch, poll_s):
    """The child's exit code, or the message of ``watch`` that ends its wait.

    Raises:
      subprocess.TimeoutExpired: past ``timeout_s``.
    """
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        step = left if watch is None else (poll_s if left is None else min(poll_s, left))
        try:
            return child.wait(timeout=step)
        except subprocess.TimeoutExpired:
            if left is not None and step >= left:
                raise
        message = watch()
        if message:
            return message


def _stop(child) -> None:
    child.terminate()
    try:
        child.wait(timeout=10)
    except subprocess.TimeoutExpired:
        child.kill()


def sigterm_as_ctrl_c() -> None:
    """SIGTERM (a scheduler, `kill`) stops this command like Ctrl-C: its
    children and hosts are stopped and removed on the way out."""
    def interrupt(*_):
        raise KeyboardInterrupt()
    signal.signal(signal.SIGTERM, interrupt)
