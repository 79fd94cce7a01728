"""Shared test helpers: run a cluster scenario in its own process, stop by pid."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
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
                            env=env or _env(), cwd=ROOT, start_new_session=True,
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


def pid_alive(pid: int) -> bool:
    """True if ``pid`` runs and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
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


def run_scenario(name, timeout=240, script=None, **kwargs):
    """Runs ``script NAME kwargs`` (default tests/scenarios.py) in a fresh
    process and returns its RESULT.

    Also checks that every cluster task the scenario started is gone.
    """
    env = _env()
    if "keras3" not in name and "keras3" not in json.dumps(kwargs):
        # Scenarios use tf_keras explicitly; this skips importing Keras 3's
        # optimizers with TensorFlow (1.4 s of CPU each).
        env.setdefault("TF_USE_LEGACY_KERAS", "1")
    _, out = run_command([sys.executable, script or os.path.join(HERE, "scenarios.py"), name,
                          json.dumps(kwargs)], timeout=timeout, env=env)
    for line in out.splitlines():
        if line.startswith("RESULT: "):
            result = json.loads(line[len("RESULT: "):])
            wait_dead(result.pop("_child_pids"))
            return result
    pytest.fail(f"scenario {name} printed no RESULT; output tail:\n{out[-6000:]}")


def pytest_collection_modifyitems(items):
    """Every test gets a timeout (pytest-timeout): 120 s unless it sets one."""
    for item in items:
        if item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(120))


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "cluster: starts TensorFlow servers (in-process or as processes); "
        "the fast tier is `python -m pytest -q -m \"not cluster\"`")
    # The suite has a time budget (20 min on 2 cores): always list the slowest tests.
    if getattr(config.option, "durations", None) is None:
        config.option.durations = 20
