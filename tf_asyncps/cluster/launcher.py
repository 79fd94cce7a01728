"""LocalCluster: a real ps/worker cluster of local processes, and its supervisor."""

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Dict, List, Optional

from absl import logging

from tf_asyncps.cluster.config import ROLES, ClusterConfig, cluster_resolver
from tf_asyncps.cluster.probe import wait_for_tasks
from tf_asyncps.cluster.spawn import spawn
from tf_asyncps.compat import startup as startup_compat
from tf_asyncps.validate import check_int, check_number

__all__ = ["LocalCluster"]

class LocalCluster:
    """A real cluster of local processes: ``num_ps`` ps and ``num_workers`` workers.

    Each task is ``python -m tf_asyncps server`` with its own TF_CONFIG, on a
    loopback port chosen by portpicker (with ``hosts``: ``tf-asyncps train``
    on its own host's address). A chief address is reserved for the
    process that creates the strategy (this one, or a child you start with
    :meth:`tf_config`). Children die with this process, even when a thread
    that started them (the supervisor) has ended (:func:`spawn`), and
    are stopped by pid on exit, on error and on Ctrl-C; if this process
    connected to the cluster, at this process's exit (see :meth:`stop`).

    Example::

        with LocalCluster(num_workers=2, num_ps=1) as cluster:
            strategy = tf_asyncps.AsyncParameterServerStrategy(cluster.resolver())

    Args:
      num_workers: worker tasks (>= 1).
      num_ps: parameter-server tasks (>= 1).
      log_dir: where each task writes ``<job>-<i>.log`` (started afresh by
        :meth:`start`, added to by restarts); default a temp dir
        (``/tmp/tf_asyncps_cluster_*``), removed when this process exits
        unless ``keep_logs``.
      keep_logs: keep the default temp dir after this process exits (its
        path is ``log_dir``); a ``log_dir`` you pass is always kept.
      start_timeout_s: seconds to wait for every task to serve.
      env: extra environment variables for the children.
      worker_env: {worker index: {var: value}} for single workers. GPUs:
        ``worker_env=tf_asyncps.cluster.devices.plan_gpus(n, k, available).worker_env``
        gives each worker its own ``CUDA_VISIBLE_DEVICES``; ps tasks never
        see a GPU.
      host: loopback address to bind.
      hosts: a :class:`~tf_asyncps.cluster.netns.NetnsHosts` with a host per
        task ("chief:0", "ps:i", "worker:i"): each task then runs on its own
        host (network namespace) at that host's address, and the chief must
        run there too (``hosts.exec_argv("chief:0", ...)``); ``host`` is then
        unused. The caller owns ``hosts`` (closes it after :meth:`stop`).

    Raises:
      ValueError: bad sizes. TimeoutError / RuntimeError: a task did not start
        (the message includes the end of its log).
    """

    def __init__(self, num_workers: int = 2, num_ps: int = 1, *,
                 log_dir: Optional[str] = None, start_timeout_s: float = 90.0,
                 env: Optional[Dict[str, str]] = None,
                 worker_env: Optional[Dict[int, Dict[str, str]]] = None,
                 host: str = "127.0.0.1", hosts=None, keep_logs: bool = False):
        for name, v in (("num_workers", num_workers), ("num_ps", num_ps)):
            check_int(v, f"LocalCluster: {name}", min=1)
        import portpicker
        import tempfile
        self.num_workers, self.num_ps = num_workers, num_ps
        self.log_dir = log_dir or tempfile.mkdtemp(prefix="tf_asyncps_cluster_")
        os.makedirs(self.log_dir, exist_ok=True)
        if not log_dir and not keep_logs:
            # At exit, not in stop(): a connected cluster's tasks stop only
            # then (see stop), and its logs stay readable until then.
            import atexit
            import shutil
            atexit.register(shutil.rmtree, self.log_dir, ignore_errors=True)
        self.start_timeout_s = start_timeout_s
        self.env = dict(env or {})
        self.worker_env = {int(k): dict(v) for k, v in (worker_env or {}).items()}
        self.hosts = hosts
        names = self.host_names(num_workers, num_ps)
        if hosts is not None:
            missing = [n for n in names if n not in hosts.names]
            if missing:
                raise ValueError(f"LocalCluster: hosts has no host for task(s) {missing}; "
                                 f"make NetnsHosts({names!r}).")
        ports = [portpicker.pick_unused_port() for _ in names]
        self._ports = ports
        where = {n: (host if hosts is None else hosts.address(n)) for n in names}
        addrs = {n: f"{where[n]}:{p}" for n, p in zip(names, ports)}
        self.config = ClusterConfig({
            "chief": [addrs["chief:0"]],
            "ps": [addrs[f"ps:{i}"] for i in range(num_ps)],
            "worker": [addrs[f"worker:{i}"] for i in range(num_workers)],
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
    @staticmethod
    def host_names(num_workers: int, num_ps: int) -> List[str]:
        """Every task of such a cluster, the chief first ("chief:0", "ps:i",
        "worker:i"): the hosts a ``NetnsHosts`` for ``hosts=`` must have."""
        return ["chief:0"] + [f"ps:{i}" for i in range(num_ps)] + [
            f"worker:{i}" for i in range(num_workers)]

    @property
    def task_names(self) -> List[str]:
        return self.host_names(self.num_workers, self.num_ps)[1:]

    def tf_config(self, task_type: str = "chief", task_id: int = 0) -> str:
        """TF_CONFIG JSON for one task of this cluster."""
        return self.config.to_tf_config(task_type, task_id)

    def resolver(self):
        """A ClusterResolver for the chief (this process)."""
        return cluster_resolver(ClusterConfig(self.config, "chief", 0))

    def log_path(self, name: str) -> str:
        return os.path.join(self.log_dir, name.replace(":", "-") + ".log")

    def cpu_seconds(self) -> Dict[str, float]:
        """CPU time (user + system, seconds) each running ps/worker process
        has used so far, by task name; read from Linux ``/proc/PID/stat``
        ({} where there is none). A restarted task counts from its restart."""
        ticks = os.sysconf("SC_CLK_TCK")
        out = {}
        for name, p in self.procs.items():
            try:
                with open(f"/proc/{p.pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()  # the name may hold spaces
                out[name] = (int(fields[11]) + int(fields[12])) / ticks  # utime, stime
            except (OSError, IndexError, ValueError):
                continue  # exited, or no /proc
        return out

    def log_tail(self, name: str, n: int = 20) -> str:
        try:
            with open(self.log_path(name), errors="replace") as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return "(no log)"

    def exited(self) -> Dict[str, int]:
        """The ps/worker tasks whose current process has exited, ``{task:
        exit code}`` (negative: killed by that signal). A task the supervisor
        restarted counts by its new process."""
        with self._proc_lock:
            return {n: p.returncode for n, p in self.procs.items() if p.poll() is not None}

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
        if job == "ps":
            env["CUDA_VISIBLE_DEVICES"] = ""
        if job == "worker":
            env.update(self.worker_env.get(int(i), {}))
        log = open(self.log_path(name), "ab")
        self._logs[name] = log
        cmd = [sys.executable, "-m", "tf_asyncps", "server"]
        if self.hosts is not None:
            # As on real hosts, where every task runs `train` (a ps/worker serves).
            cmd = self.hosts.exec_argv(name, cmd[:-1] + ["train", "--console=full"])
        p = spawn(cmd, env=env,
                  stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.procs[name] = p
        return p

    def start(self) -> "LocalCluster":
        """Starts every ps and worker and waits until they serve."""
        try:
            for name in self.task_names:
                # A new cluster starts each log afresh (a restart adds to it).
                open(self.log_path(name), "wb").close()
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
        "pid"[, "netns"]}}, "restarts": {name: n}}; ``extra_pids`` adds tasks started
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
                if self.hosts is not None:
                    tasks[n]["netns"] = self.hosts.namespace(n)
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
        # Probed from the chief's host: the others are only reachable there.
        on_chief = (self.hosts.enter("chief:0") if self.hosts is not None
                    else contextlib.nullcontext())
        try:
            with on_chief:
                wait_for_tasks(sub, self.start_timeout_s,
                               procs={n: self.procs[n] for n in names},
                               timeout_name="LocalCluster(start_timeout_s=...)")
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
        max_restarts = check_int(max_restarts, "max_restarts", min=0,
                                 hint="restarts per task")
        check_number(poll_s, "poll_s", above=0, hint="seconds")
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
        (their death signal, see :func:`spawn`): TensorFlow's teardown at exit still talks to them,
        and TensorFlow allows one cluster per process anyway.
        """
        self._stop_supervisor()
        if defer_if_connected and startup_compat.context_connected() and self._alive_children():
            logging.info("LocalCluster: tasks %s stop when this process exits.",
                         sorted(self.pids))
            self._close_logs()  # each task writes through its own descriptor
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
        self._close_logs()

    def _close_logs(self) -> None:
        for name in list(self._logs):
            self._close_log(name)

    def __enter__(self) -> "LocalCluster":
        return self.start()

    def _alive_children(self) -> bool:
        return any(p.poll() is None for p in self.procs.values())

    def __exit__(self, *exc) -> None:
        self.stop(defer_if_connected=True)
