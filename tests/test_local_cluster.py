"""LocalCluster's lifecycle: its tasks stop with it (also when the body
raises or the launcher is killed), the supervisor's and manual restarts, bad
sizes refused; children die with their launcher, not with the thread that
started them.

Linux sends the parent-death signal when the forking *thread* exits; the
launcher tests end that thread (a helper thread, the LocalCluster
supervisor) while the launcher lives, then SIGKILL the launcher.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from conftest import ROOT, pid_alive, run_command, subprocess_env, wait_dead
from tf_asyncps import cluster
from tf_asyncps.cluster import PROBE_OK, LocalCluster, probe_grpc
from tf_asyncps.cluster import spawn as spawn_lib

pytestmark = pytest.mark.timeout(120)

# Waits until the thread's OS thread is gone: Thread.join returns a little
# before, and the death signal is sent at the OS thread's exit.
_GONE = ("def gone(t, timeout_s=10):\n"
         "    deadline = time.monotonic() + timeout_s\n"
         "    while os.path.exists(f'/proc/self/task/{t.native_id}'):\n"
         "        assert time.monotonic() < deadline, 'thread still there'\n"
         "        time.sleep(0.01)\n")


def _launcher(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                            stdin=subprocess.PIPE, text=True, cwd=ROOT, env=subprocess_env())


def _line(p: subprocess.Popen) -> dict:
    line = p.stdout.readline()
    assert line, f"the launcher exited with code {p.wait(timeout=10)} before answering"
    return json.loads(line)


def _stays_up(check, seconds: float = 3.0) -> None:
    """Asserts ``check()`` for ``seconds``: a death signal, if sent, has landed."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert check()
        time.sleep(0.1)  # polling interval


def _cleanup(launcher: subprocess.Popen, pids) -> None:
    """Kills the launcher and every pid left, by pid (runs even on failure)."""
    if launcher.poll() is None:
        launcher.kill()
    launcher.wait(timeout=10)
    for pid in pids:
        if pid_alive(pid):
            os.kill(pid, signal.SIGKILL)


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def test_child_spawned_by_an_ended_thread_lives_until_the_launcher_dies():
    code = ("import json, os, subprocess, sys, threading, time\n"
            "from tf_asyncps.cluster.spawn import spawn\n" + _GONE +
            "box = {}\n"
            "t = threading.Thread(target=lambda: box.update(p=spawn(\n"
            "    [sys.executable, '-c', 'import time; time.sleep(600)  # spawned'],\n"
            "    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)))\n"
            "t.start(); t.join(); gone(t)\n"
            "print(json.dumps({'pid': box['p'].pid}), flush=True)\n"
            "sys.stdin.read()\n")
    launcher = _launcher(code)
    pids = []
    try:
        pid = _line(launcher)["pid"]
        pids.append(pid)
        deadline = time.monotonic() + 20
        while "# spawned" not in _cmdline(pid):  # the shim has exec'd the command
            assert pid_alive(pid) and time.monotonic() < deadline, _cmdline(pid)
            time.sleep(0.02)
        _stays_up(lambda: pid_alive(pid), seconds=1.0)
        launcher.kill()
        launcher.wait(timeout=10)
        wait_dead([pid])
    finally:
        _cleanup(launcher, pids)


def test_spawn_passes_popen_arguments_and_refuses_preexec_fn():
    env = dict(os.environ, TF_ASYNCPS_SPAWN_TEST="yes")
    p = spawn_lib.spawn([sys.executable, "-c", "import os, sys; print(os.environ["
                         "'TF_ASYNCPS_SPAWN_TEST'], sys.stdin.read())"],
                        env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert p.communicate("in", timeout=30) == ("yes in\n", None) and p.returncode == 0
    missing = spawn_lib.spawn(["/nonexistent/tf-asyncps-cmd"], stderr=subprocess.PIPE)
    assert missing.wait(timeout=30) == 127
    assert b"cannot run" in missing.stderr.read()
    missing.stderr.close()
    with pytest.raises(ValueError, match="preexec_fn"):
        spawn_lib.spawn([sys.executable, "-c", ""], preexec_fn=lambda: None)
    with pytest.raises(ValueError, match="empty"):
        spawn_lib.spawn([])


def test_shim_does_not_run_the_command_when_its_parent_is_not_the_expected_one():
    out = subprocess.run([sys.executable, spawn_lib.SHIM, "1", "--", sys.executable, "-c",
                          "print('ran')"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 1 and "ran" not in out.stdout


@pytest.mark.cluster
def test_supervisor_restarted_task_outlives_supervision_and_dies_with_launcher(tmp_path):
    code = ("import json, os, sys, time\n"
            "from tf_asyncps.cluster import LocalCluster, reachable\n" + _GONE +
            f"c = LocalCluster(1, 1, log_dir={str(tmp_path)!r}).start()\n"
            "print(json.dumps(c.pids), flush=True)\n"
            "c.supervise(max_restarts=1, poll_s=0.1)\n"
            "c.kill('worker:0')\n"
            "deadline = time.monotonic() + 60\n"
            "while not (c.restarts == {'worker:0': 1}\n"
            "           and reachable(c.config['worker'][0], 0.5)):\n"
            "    assert time.monotonic() < deadline, 'worker:0 was not restarted'\n"
            "    time.sleep(0.05)\n"
            "supervisor = c._supervisor\n"
            "c._stop_supervisor(); gone(supervisor)\n"
            "print(json.dumps({'pids': c.pids, 'worker': c.config['worker'][0]}),"
            " flush=True)\n"
            "sys.stdin.read()\n")
    launcher = _launcher(code)
    pids = []
    try:
        first = _line(launcher)
        pids += first.values()
        now = _line(launcher)
        restarted, ps, addr = now["pids"]["worker:0"], now["pids"]["ps:0"], now["worker"]
        pids += [restarted]
        assert restarted != first["worker:0"] and ps == first["ps:0"]
        # (a) Supervision has ended, the launcher lives: the restarted worker serves.
        _stays_up(lambda: pid_alive(restarted) and probe_grpc(addr)[0] == PROBE_OK)
        # (b) The launcher dies without any cleanup: its tasks die with it.
        launcher.kill()
        launcher.wait(timeout=10)
        wait_dead([restarted, ps])
    finally:
        state = tmp_path / "cluster.json"  # the pids of tasks restarted meanwhile
        if state.exists():
            pids += [t["pid"] for t in json.loads(state.read_text())["tasks"].values()]
        _cleanup(launcher, pids)


@pytest.mark.cluster  # starts a TensorFlow server (a worker task)
def test_a_task_server_starts_without_tensorflows_api_package():
    """A ps/worker task imports only TensorFlow's server and config modules
    (compat.serving_runtime: ~0.6 s of CPU instead of ~3.5 s for
    ``import tensorflow`` with Keras) and serves gRPC; every cluster test
    trains on such tasks (LocalCluster runs `tf-asyncps server`)."""
    import portpicker
    port = portpicker.pick_unused_port()
    serve = (
        "import json, sys\n"
        "from tf_asyncps.compat import startup as startup_compat\n"
        "from tf_asyncps.cluster import server_config\n"
        "rt = startup_compat.serving_runtime()\n"
        f"server = rt.Server({{'worker': ['localhost:{port}']}}, job_name='worker',\n"
        "                   task_index=0, protocol='grpc', config=server_config(1, 'worker'))\n"
        "print('MODULES', json.dumps(sorted({m.split('.')[0] for m in sys.modules}\n"
        "      & {'keras', 'tf_keras'} | {m for m in sys.modules\n"
        "      if m in ('tensorflow', 'tensorflow._api.v2')})), flush=True)\n"
        "server.join()\n")
    server = subprocess.Popen([sys.executable, "-c", serve], stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True, env=subprocess_env())
    try:
        line = server.stdout.readline()  # printed once the server is up (or EOF)
        assert line.startswith("MODULES "), line
        assert json.loads(line.split(" ", 1)[1]) == []  # no Keras, no tensorflow API package
        status, detail = probe_grpc(f"localhost:{port}", timeout=10.0)
        assert status == PROBE_OK, detail
    finally:
        server.kill()
        server.wait(timeout=30)


@pytest.mark.parametrize("keep_logs", [False, True])
def test_default_log_dir_is_removed_at_exit_unless_kept(keep_logs, tmp_path):
    # Every LocalCluster() without log_dir left a /tmp/tf_asyncps_cluster_*
    # directory behind.
    script = ("from tf_asyncps.cluster import LocalCluster\n"
              f"c = LocalCluster(1, 1, keep_logs={keep_logs})\n"
              "open(c.log_path('ps:0'), 'w').write('a log line')\n"
              "print('LOG_DIR', c.log_dir)\n")
    _, out = run_command([sys.executable, "-c", script], timeout=60)
    log_dir = next(l.split(" ", 1)[1] for l in out.splitlines() if l.startswith("LOG_DIR "))
    assert os.path.basename(log_dir).startswith("tf_asyncps_cluster_")
    try:
        assert os.path.isdir(log_dir) == keep_logs
    finally:
        shutil.rmtree(log_dir, ignore_errors=True)


@pytest.mark.cluster
def test_local_cluster_stops_every_child_even_when_the_body_raises(tmp_path):
    pids = {}
    with pytest.raises(RuntimeError, match="boom"):
        with LocalCluster(num_workers=2, num_ps=1, log_dir=str(tmp_path)) as c:
            pids = c.pids
            assert sorted(pids) == ["ps:0", "worker:0", "worker:1"]
            assert all(pid_alive(p) for p in pids.values())
            raise RuntimeError("boom")
    assert pids and not any(pid_alive(p) for p in pids.values())
    assert (tmp_path / "worker-1.log").exists()


def _poll(cond, timeout_s=60.0):
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)  # polling interval, not synchronisation


@pytest.mark.cluster
def test_supervisor_and_manual_restarts_then_giving_up(tmp_path):
    with LocalCluster(num_workers=1, num_ps=1, log_dir=str(tmp_path)) as c:
        with pytest.raises(ValueError, match="max_restarts must be an int >= 0"):
            c.supervise(max_restarts=-1)
        with pytest.raises(ValueError, match="poll_s"):
            c.supervise(poll_s=0)
        c.supervise(max_restarts=1, poll_s=0.1)
        with pytest.raises(ValueError, match="already supervised"):
            c.supervise()
        old = c.pids["worker:0"]
        c.kill("worker:0")
        _poll(lambda: c.restarts == {"worker:0": 1} and c.pids["worker:0"] != old
              and cluster.reachable(c.config["worker"][0], 0.5))
        state = json.loads((tmp_path / "cluster.json").read_text())
        assert state["tasks"]["worker:0"]["pid"] == c.pids["worker:0"]
        assert state["restarts"] == {"worker:0": 1}
        # A restart by hand while supervised is not doubled by the supervisor.
        manual = c.pids["worker:0"]
        c.restart("worker:0")
        assert not pid_alive(manual) and pid_alive(c.pids["worker:0"])
        assert cluster.reachable(c.config["worker"][0], 1.0) and c.restarts == {"worker:0": 1}
        with pytest.raises(ValueError, match="no task 'worker:7'"):
            c.kill("worker:7")
        second = c.pids["worker:0"]
        c.kill("worker:0")  # its one supervised restart is used up: it stays down
        _poll(lambda: "worker:0" in c.gave_up)
        assert c.gave_up == {"worker:0": -signal.SIGKILL}
        assert c.pids["worker:0"] == second and not pid_alive(second)
        assert pid_alive(c.pids["ps:0"]) and c.restarts == {"worker:0": 1}
    assert not pid_alive(c.pids["ps:0"])


@pytest.mark.cluster
def test_children_die_with_a_killed_parent(tmp_path):
    """A parent killed with SIGKILL (no cleanup runs) still takes its children."""
    code = (
        "import sys, time; from tf_asyncps.cluster import LocalCluster\n"
        f"c = LocalCluster(1, 1, log_dir={str(tmp_path)!r}).start()\n"
        "print(' '.join(str(p) for p in c.pids.values()), flush=True)\n"
        "print('tensorflow' in sys.modules, flush=True)\n"
        "time.sleep(600)\n")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(x) for x in p.stdout.readline().split()]
        assert len(pids) == 2 and all(pid_alive(x) for x in pids)
        # Starting a LocalCluster (cluster.json included) never loads TensorFlow.
        assert p.stdout.readline().strip() == "False"
        p.kill()
        p.wait(timeout=10)
        deadline = time.monotonic() + 20
        while any(pid_alive(x) for x in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(pid_alive(x) for x in pids)
    finally:
        if p.poll() is None:
            p.kill()
        for x in locals().get("pids", []):
            if pid_alive(x):
                os.kill(x, signal.SIGKILL)


@pytest.mark.cluster
def test_local_cluster_rejects_bad_sizes():
    with pytest.raises(ValueError, match="num_workers must be an int >= 1"):
        LocalCluster(num_workers=0)
    with pytest.raises(ValueError, match="num_ps"):
        LocalCluster(num_workers=1, num_ps=True)


def test_leaving_a_connected_cluster_closes_this_process_log_files(tmp_path, monkeypatch):
    """Before: the deferred stop returned before closing the parent's log
    handles (the tasks keep writing through their own descriptors)."""
    from tf_asyncps.cluster import launcher
    cluster = launcher.LocalCluster(1, 1, log_dir=str(tmp_path))

    class Alive:
        pid = 1

        def poll(self):
            return None

    cluster.procs["ps:0"] = Alive()
    log = open(cluster.log_path("ps:0"), "ab")
    cluster._logs["ps:0"] = log
    monkeypatch.setattr(launcher.startup_compat, "context_connected", lambda: True)
    cluster.stop(defer_if_connected=True)
    assert log.closed and cluster._logs == {}
