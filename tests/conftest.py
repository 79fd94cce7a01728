"""Shared test helpers: run a cluster scenario in its own process, stop by
pid; the guard that keeps TensorFlow servers out of the fast tier."""

import collections
import functools
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time

import pytest

import tmp_per_test
from scenarios import from_json

# Each test's temporary files in a directory of its own (tests/tmp_per_test.py);
# the one fresh process of the import checks, its fixture shared by test files
# (tests/fresh_process.py).
pytest_plugins = ["tmp_per_test", "fresh_process"]

# TensorFlow's and tf_keras's own test files, where placed (tests/upstream/README.md),
# run through tests/test_upstream_*.py in processes of their own: pytest would
# collect them as *_test.py and import them into its process, whose eager context
# they change (in-process tests then failed: "/job:localhost/... unknown device").
collect_ignore_glob = ["upstream/*"]

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
#: ``python SCENARIOS_DIR KEY JSON_KWARGS`` runs a cluster scenario (tests/scenarios/).
SCENARIOS_DIR = os.path.join(HERE, "scenarios")


def subprocess_env():
    """The environment for a process a test starts: this checkout first on
    PYTHONPATH, TensorFlow's C++ logs errors only, no GPU unless
    ASYNCPS_TEST_CUDA_VISIBLE_DEVICES names some."""
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    # A crash in TensorFlow's C++ (SIGSEGV) then leaves each thread's Python stack.
    env.setdefault("PYTHONFAULTHANDLER", "1")
    env["CUDA_VISIBLE_DEVICES"] = env.get("ASYNCPS_TEST_CUDA_VISIBLE_DEVICES", "")
    return env


def stop_process(proc: subprocess.Popen) -> None:
    """Stops ``proc`` and its process group by pid: SIGTERM, then SIGKILL."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


def run_command(args, timeout, env=None, check=True):
    """Runs ``args`` in a new process group; kills the group on timeout/failure.

    Returns (returncode, combined output).
    """
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env=env or subprocess_env(), cwd=ROOT, start_new_session=True,
                            text=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stop_process(proc)
        out = proc.stdout.read() if proc.stdout else ""
        pytest.fail(f"{args} ran past {timeout} s; output tail:\n{out[-4000:]}")
    finally:
        stop_process(proc)
    if check and proc.returncode != 0:
        pytest.fail(f"{args} exited {proc.returncode}; output tail:\n{out[-6000:]}")
    return proc.returncode, out


def poll_until(cond, proc, timeout_s, what):
    """Polls ``cond()`` until it is truthy and returns it; fails the test if
    ``proc`` exits first or ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        if proc.poll() is not None:
            pytest.fail(f"{proc.args[:4]} exited ({proc.returncode}) before {what}")
        time.sleep(0.05)  # polling interval, not synchronisation
    pytest.fail(f"timed out after {timeout_s} s waiting for {what}")


def proc_state(pid: int) -> str:
    """The one-letter state of ``pid`` in /proc/PID/stat ("T": stopped,
    "Z": zombie), read after the command name (which may hold spaces and
    parentheses). The tests' one reader of that file.

    Raises:
      OSError: no such process (or no /proc).
    """
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def pid_alive(pid: int) -> bool:
    """True if ``pid`` runs and is not a zombie."""
    try:
        return proc_state(pid) != "Z"
    except OSError:
        return False


def wait_dead(pids, timeout=20.0):
    """Waits until none of ``pids`` runs; kills and fails on the ones left."""
    deadline = time.monotonic() + timeout
    while any(pid_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = [p for p in pids if pid_alive(p)]
    for p in left:
        os.kill(p, signal.SIGKILL)
    assert not left, f"child processes {left} outlived their parent"


class SharedCluster:
    """``tests/scenarios serve``: one process holding a cluster of one shape
    for the whole session, running scenarios on it on request.

    A request that fails or runs past its timeout stops the process (by its
    process group); the next request starts a new one.
    """

    def __init__(self, num_workers, num_ps):
        self.shape = {"num_workers": num_workers, "num_ps": num_ps}
        self.proc = None
        self.child_pids = []
        self._busy = False  # a request whose answer was not read (its test timed out)
        self._lines = queue.Queue()
        self._tail = []

    def _start(self, deadline):
        env = subprocess_env()
        # It outlives the test that starts it: a directory of its own.
        self.tmp = env["TMPDIR"] = tmp_per_test.shared_dir(
            "shared_{num_workers}w{num_ps}ps".format(**self.shape))
        env.setdefault("TF_USE_LEGACY_KERAS", "1")  # Keras 3 comes in by `import keras`
        self._lines = queue.Queue()
        self._tail = []
        self.proc = subprocess.Popen(
            [sys.executable, SCENARIOS_DIR, "serve",
             json.dumps(self.shape)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True, text=True)
        threading.Thread(target=self._read, args=(self.proc.stdout, self._lines),
                         daemon=True).start()
        self.child_pids = self._answer("READY", deadline)["_child_pids"]

    @staticmethod
    def _read(stream, lines):
        for line in stream:
            lines.put(line)
        lines.put(None)

    def _answer(self, word, deadline):
        while True:
            try:
                line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                self.close(failed=True)
                pytest.fail(f"shared cluster {self.shape}: no answer in time; output "
                            f"tail:\n{''.join(self._tail[-40:])}")
            if line is None:
                self.close(failed=True)
                pytest.fail(f"shared cluster {self.shape} exited; output tail:\n"
                            f"{''.join(self._tail[-40:])}")
            if line.startswith(word + ": ") or line.startswith("ERROR: "):
                kind, _, body = line.partition(": ")
                if kind == "ERROR":
                    self.close(failed=True)
                    pytest.fail(f"scenario failed on the shared cluster {self.shape}:\n"
                                f"{json.loads(body)}")
                return json.loads(body)
            self._tail.append(line)

    def run(self, name, kwargs, timeout):
        deadline = time.monotonic() + timeout
        if self._busy:
            self.close(failed=True)
        if self.proc is None or self.proc.poll() is not None:
            self._start(deadline)
        self._busy = True
        self.proc.stdin.write(json.dumps({"name": name, "kwargs": kwargs}) + "\n")
        self.proc.stdin.flush()
        result = self._answer("RESULT", deadline)
        self._busy = False
        return result

    def close(self, failed=False):
        """Ends the process (end of input, then by process group) and checks
        that every task it started is gone. Its temporary files (the cluster's
        logs) go, or stay when ``failed``."""
        if self.proc is None:
            return
        proc, self.proc = self.proc, None
        self._busy = False
        try:
            proc.stdin.close()
            proc.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            pass
        stop_process(proc)
        try:
            wait_dead(self.child_pids)
        finally:
            tmp_per_test.finish(self.tmp, failed, f"shared cluster {self.shape}")


_SHARED_CLUSTERS = collections.OrderedDict()  # shape -> SharedCluster, least recent first
# An idle shared cluster holds about 1 GB (its tasks and the serve process):
# at most this many stay up.
MAX_SHARED_CLUSTERS = 4


def pytest_sessionfinish(session, exitstatus):
    for c in _SHARED_CLUSTERS.values():
        c.close()


#: The running test's node id when it lacks the ``cluster`` marker (set before
#: its fixtures), else None: such a test may not start TensorFlow servers.
_UNMARKED_TEST = None


def refuse_servers_outside_cluster_tests(what: str) -> None:
    """Fails the running test if it starts TensorFlow servers (``what``)
    without ``@pytest.mark.cluster``: the fast tier is ``-m "not cluster"``,
    so a test that starts servers unmarked would slip into it."""
    if _UNMARKED_TEST is not None:
        pytest.fail(f"{_UNMARKED_TEST} starts TensorFlow servers ({what}) without the "
                    f"cluster marker: add @pytest.mark.cluster (or the module's pytestmark) "
                    f"so that the fast tier (-m \"not cluster\") leaves it out.", pytrace=False)


def _refusing(what, method):
    @functools.wraps(method)
    def guarded(*args, **kwargs):
        refuse_servers_outside_cluster_tests(what)
        return method(*args, **kwargs)
    guarded.refuses_unmarked_tests = True
    return guarded


def _guard_server_starts():
    """Wraps, once per process, what starts servers from the test process:
    ``LocalCluster.start``/``restart`` and ``tf.distribute.Server`` (once
    TensorFlow is loaded; every test module that makes servers imports it
    at the top). Scenarios are refused in :func:`run_scenario`."""
    from tf_asyncps.cluster.launcher import LocalCluster
    for name in ("start", "restart"):
        if not getattr(getattr(LocalCluster, name), "refuses_unmarked_tests", False):
            setattr(LocalCluster, name, _refusing(f"LocalCluster.{name}",
                                                  getattr(LocalCluster, name)))
    tf = sys.modules.get("tensorflow")
    server = getattr(getattr(tf, "distribute", None), "Server", None)
    if server is not None and not getattr(server.__init__, "refuses_unmarked_tests", False):
        server.__init__ = _refusing("tf.distribute.Server", server.__init__)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    global _UNMARKED_TEST
    _UNMARKED_TEST = None if item.get_closest_marker("cluster") else item.nodeid
    _guard_server_starts()


def run_scenario(scenario, timeout=240, script=None, shared=None, **kwargs):
    """Runs ``scenario(**kwargs)`` in a fresh process and returns its result.

    Args:
      scenario: a function of the calling test module decorated with
        ``scenarios.scenario`` (docs/tests.md#scenarios-beside-their-tests):
        its result comes back as the dataclass it is annotated with. Or, the
        old convention while test modules move over, a scenario's name in
        ``tests/scenarios/<module>.py`` (its result: a dict).
      timeout: seconds before the process is stopped and the test fails.
      script: the old convention only: a script run as ``script NAME kwargs``
        instead of tests/scenarios.
      shared: ``(num_workers, num_ps)``: the scenario (one marked
        ``shares_cluster``) runs instead on that session-wide cluster
        (SharedCluster): same code, no cluster start.
      **kwargs: the scenario's arguments (JSON values).

    Also checks that every cluster task the scenario started is gone. Fails a
    test without the ``cluster`` marker
    (:func:`refuse_servers_outside_cluster_tests`).
    """
    if callable(scenario):
        if not hasattr(scenario, "scenario_key"):
            pytest.fail(f"{scenario.__qualname__} is not a scenario: decorate it with "
                        f"@scenario (from scenarios import scenario) and annotate the "
                        f"dataclass it returns.", pytrace=False)
        name, key = scenario.__name__, scenario.scenario_key
    else:
        name = key = scenario
    result = _run_scenario(name, key, timeout, script, shared, kwargs)
    return from_json(scenario.result_type, result) if callable(scenario) else result


def _run_scenario(name, key, timeout, script, shared, kwargs):
    """The JSON dict the scenario ``key`` printed (see :func:`run_scenario`)."""
    refuse_servers_outside_cluster_tests(f"scenario {name!r}")
    if shared is not None:
        shape = tuple(shared)
        if shape not in _SHARED_CLUSTERS:
            while len(_SHARED_CLUSTERS) >= MAX_SHARED_CLUSTERS:
                _SHARED_CLUSTERS.popitem(last=False)[1].close()
            _SHARED_CLUSTERS[shape] = SharedCluster(*shape)
        _SHARED_CLUSTERS.move_to_end(shape)
        return _SHARED_CLUSTERS[shape].run(key, kwargs, timeout)
    env = subprocess_env()
    if "keras3" not in name and "keras3" not in json.dumps(kwargs):
        # Scenarios use tf_keras explicitly; this skips importing Keras 3's
        # optimizers with TensorFlow (1.4 s of CPU each).
        env.setdefault("TF_USE_LEGACY_KERAS", "1")
    _, out = run_command([sys.executable, script or SCENARIOS_DIR, key,
                          json.dumps(kwargs)], timeout=timeout, env=env)
    for line in out.splitlines():
        if line.startswith("RESULT: "):
            result = json.loads(line[len("RESULT: "):])
            wait_dead(result.pop("_child_pids"))
            return result
    pytest.fail(f"scenario {key} printed no RESULT; output tail:\n{out[-6000:]}")


def pytest_collection_modifyitems(items):
    """Every test gets a timeout (pytest-timeout): 120 s unless it sets one."""
    for item in items:
        if item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(120))


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "cluster: starts TensorFlow servers (in-process or as processes); "
        "the fast tier is `python -m pytest -q -m \"not cluster\"`")
    config.addinivalue_line(
        "markers", "solo: its assertion needs the cores to itself (a race it must "
        "see happen); the README's test command runs these after the -n 2 pass")
    config.addinivalue_line(
        "markers", "soak: a long fault-injection run (about 5 min); outside the README's "
        "test command (20 min budget), run it with `python -m pytest -q -m soak`")
    config.addinivalue_line(
        "markers", "long: a costly variant of a behaviour that a test in the README's "
        "command already checks (another policy, optimizer or Keras on the same path); "
        "outside that command (20 min budget), run it with `python -m pytest -q -m long`")
    # The suite has a time budget (20 min on 2 cores): always list the slowest tests.
    if getattr(config.option, "durations", None) is None:
        config.option.durations = 20


#: Modules longer than this are listed at the end of a run: a hint that one may
#: hold two ideas, not a rule (a module is split by idea, never by length).
LONG_MODULE_LINES = 600


def pytest_terminal_summary(terminalreporter):
    pkg = os.path.join(ROOT, "tf_asyncps")
    long = []
    for d, _, files in os.walk(pkg):
        for f in files:
            if f.endswith(".py"):
                with open(os.path.join(d, f)) as fh:
                    n = sum(1 for _ in fh)
                if n > LONG_MODULE_LINES:
                    long.append(f"{os.path.relpath(os.path.join(d, f), ROOT)} ({n} lines)")
    if long:
        terminalreporter.write_sep("-", f"modules over {LONG_MODULE_LINES} lines (one idea each?)")
        for line in sorted(long):
            terminalreporter.write_line(line)
