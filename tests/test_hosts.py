"""Several hosts on one machine (#17): tasks on Linux network namespaces.

Each host is a namespace with its own address in 198.18.0.0/24 on one
virtual switch (tf_asyncps.cluster.netns). The tests need root with
CAP_NET_ADMIN: without it they skip, saying so. Every namespace, link and
process a test makes is removed by name / pid, also when it fails.
"""

import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from conftest import ROOT, poll_until, run_command, stop_process, subprocess_env
from tf_asyncps.cluster import netns
from tf_asyncps.cluster.netns import NetnsHosts

WHY = netns.unavailable()
WHY_RATE = netns.unavailable(rate=True)
needs_netns = pytest.mark.skipif(WHY is not None, reason=f"needs network namespaces: {WHY}")
needs_tbf = pytest.mark.skipif(WHY_RATE is not None,
                               reason=f"needs network namespaces and tc tbf: {WHY_RATE}")


def _mine(pid):
    return [n for n in netns._namespaces() if n.startswith(f"tfa{pid}-")]


@pytest.fixture
def hosts_factory():
    made = []

    def make(*args, **kwargs):
        h = NetnsHosts(*args, **kwargs)
        made.append(h)
        return h
    yield make
    for h in made:
        h.close()


def _serve_once(hosts, name, port, received):
    """A TCP server on host ``name`` that counts the bytes of one connection."""
    ready = threading.Event()

    def run():
        with hosts.enter(name):
            srv = socket.create_server((hosts.address(name), port))
        ready.set()
        with srv:
            srv.settimeout(30)
            conn, _ = srv.accept()
            with conn:
                conn.settimeout(30)
                while True:
                    chunk = conn.recv(1 << 16)
                    if not chunk:
                        break
                    received.append(len(chunk))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    assert ready.wait(10)
    return t


# -- the hosts themselves (no TensorFlow) -------------------------------------------
@needs_netns
def test_hosts_reach_each_other_only_inside_and_are_removed_with_their_processes(
        hosts_factory):
    h = hosts_factory(["chief:0", "ps:0", "worker:0"])
    assert [h.address(n) for n in h.names] == ["198.18.0.1", "198.18.0.2", "198.18.0.3"]
    assert len(_mine(os.getpid())) == 4  # three hosts and the switch
    received = []
    t = _serve_once(h, "ps:0", 5000, received)
    with h.enter("worker:0"):
        with socket.create_connection((h.address("ps:0"), 5000), timeout=10) as c:
            c.sendall(b"x" * 100_000)
    t.join(10)
    assert sum(received) == 100_000
    # Nothing was attached to this machine's own namespace.
    own = subprocess.run(["ip", "-j", "addr"], capture_output=True, text=True, timeout=10)
    assert "198.18." not in own.stdout
    # A process on a host dies with the hosts, by pid.
    sleeper = subprocess.Popen(h.exec_argv("worker:0", ["sleep", "600"]))
    try:
        h.close()
        assert sleeper.wait(timeout=10) == -signal.SIGKILL
    finally:
        if sleeper.poll() is None:
            sleeper.kill()
    assert _mine(os.getpid()) == []


@needs_netns
def test_link_down_cuts_a_host_off_and_link_up_restores_it(hosts_factory):
    h = hosts_factory(["a", "b"])
    h.link_down("a")
    with h.enter("a"):
        with pytest.raises(OSError):
            socket.create_connection((h.address("b"), 5001), timeout=2)
    h.link_up("a")
    received = []
    t = _serve_once(h, "b", 5001, received)
    with h.enter("a"):
        with socket.create_connection((h.address("b"), 5001), timeout=10) as c:
            c.sendall(b"y" * 1000)
    t.join(10)
    assert sum(received) == 1000


@needs_tbf
def test_a_rate_limit_bounds_throughput_and_the_counters_count_the_bytes(hosts_factory):
    mbit, nbytes = 20.0, 2_500_000
    h = hosts_factory(["a", "b"], rate_mbit=mbit)
    before = h.counters("a")
    received = []
    t = _serve_once(h, "b", 5002, received)
    with h.enter("a"):
        t0 = time.perf_counter()
        with socket.create_connection((h.address("b"), 5002), timeout=30) as c:
            c.sendall(b"z" * nbytes)
    t.join(30)
    elapsed = time.perf_counter() - t0
    assert sum(received) == nbytes
    # The limiter's bound (not a speed target): the bytes cannot pass faster
    # than the rate, beyond the one burst (64 KiB) tbf lets through at once.
    assert elapsed >= (nbytes - 64 * 1024) * 8 / (mbit * 1e6) * 0.95, elapsed
    sent = h.counters("a")["tx_bytes"] - before["tx_bytes"]
    assert nbytes <= sent <= nbytes * 1.10  # payload plus TCP/IP/Ethernet headers


@needs_netns
def test_namespaces_of_a_sigkilled_owner_are_removed_by_the_next_one(hosts_factory):
    code = ("import sys; from tf_asyncps.cluster.netns import NetnsHosts\n"
            "h = NetnsHosts(['x', 'y']); print('up', flush=True); sys.stdin.read()")
    p = subprocess.Popen([sys.executable, "-c", code], env=subprocess_env(), cwd=ROOT,
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "up"
        assert len(_mine(p.pid)) == 3
        p.kill()
        p.wait(10)
        assert len(_mine(p.pid)) == 3  # SIGKILL: no cleanup ran
        hosts_factory(["z"])
        assert _mine(p.pid) == []
    finally:
        if p.poll() is None:
            p.kill()
        netns.remove_namespaces_of(p.pid)


def test_bad_hosts_are_refused_with_the_field():
    with pytest.raises(ValueError, match="unique"):
        NetnsHosts(["a", "a"])
    with pytest.raises(ValueError, match="rate_mbit"):
        NetnsHosts(["a"], rate_mbit=0)


@needs_netns
def test_the_own_address_check_refuses_another_hosts_address(hosts_factory):
    h = hosts_factory(["worker:0", "worker:1", "ps:0"])
    cluster = {"chief": ["198.18.0.9:2222"], "ps": [f"{h.address('ps:0')}:2222"],
               "worker": [f"{h.address('worker:1')}:2222", f"{h.address('worker:0')}:2222"]}
    env = subprocess_env()
    env["TF_CONFIG"] = json.dumps({"cluster": cluster, "task": {"type": "worker", "index": 0}})
    # worker:0's address in the cluster is worker:1's host: refused before serving.
    rc, out = run_command(h.exec_argv("worker:0", [sys.executable, "-m", "tf_asyncps",
                                                   "server"]), 60, env=env, check=False)
    assert rc == 1 and "is not an address of this host" in out, out
    assert 'cluster["worker"][0] = "198.18.0.2:2222"' in out, out
    # On its own host the same check passes.
    code = ("import os; from tf_asyncps import cluster\n"
            "cluster.check_own_address(cluster.tf_config_from_env()); print('own ok')")
    env["TF_CONFIG"] = json.dumps({"cluster": cluster, "task": {"type": "worker", "index": 1}})
    rc, out = run_command(h.exec_argv("worker:0", [sys.executable, "-c", code]), 60, env=env)
    assert "own ok" in out


# -- jobs across hosts --------------------------------------------------------------
def _launch(out, *flags):
    cmd = [sys.executable, "-m", "tf_asyncps", "launch", "--hosts=netns", "--hidden=64",
           "--seed=0", f"--output_dir={out}", *flags]
    return subprocess.Popen(cmd, env=subprocess_env(), cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _finish(proc, timeout_s, out_dir=None):
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        stacks = _chief_stacks(out_dir) if out_dir else ""
        stop_process(proc)
        pytest.fail(f"launch ran past {timeout_s} s; the chief's threads:\n{stacks}")
    return proc.returncode, out


def _chief_stacks(out_dir):
    """The chief's Python stacks (SIGUSR1: cli.main's faulthandler), read from
    its log: what a run past its time waits on."""
    log = os.path.join(out_dir, "logs", "chief-0.log")
    try:
        start = os.path.getsize(log)
        os.kill(_tasks(out_dir)["chief:0"]["pid"], signal.SIGUSR1)
        deadline = time.monotonic() + 10
        while os.path.getsize(log) == start and time.monotonic() < deadline:
            time.sleep(0.1)  # polling for the dump
        time.sleep(1)  # the rest of it (a dump is written in pieces)
        with open(log, errors="replace") as f:
            f.seek(start)
            return f.read()[-6000:]
    except (OSError, KeyError, ValueError) as e:
        return f"(none: {e!r})"


def _epoch_lines(out):
    try:
        with open(os.path.join(out, "logs", "chief-0.log")) as f:
            return sum(1 for line in f if line.startswith("epoch "))
    except OSError:
        return 0


def _tasks(out):
    with open(os.path.join(out, "logs", "cluster.json")) as f:
        return json.load(f)["tasks"]


def _metrics(out):
    with open(os.path.join(out, "metrics.json")) as f:
        return json.load(f)


def _accounting_holds(m, spe):
    s = m["staleness"]
    return m["scheduled_steps"] <= s["applied"] + s["dropped"] <= \
        m["scheduled_steps"] + spe * s["retried_closures"]


@needs_netns
@pytest.mark.cluster
@pytest.mark.timeout(240)
def test_the_digits_job_across_four_hosts(tmp_path):
    out = str(tmp_path / "out")
    proc = _launch(out, "--epochs=6", "--steps_per_epoch=100")
    try:
        rc, text = _finish(proc, 200, out)
    finally:
        stop_process(proc)
        leftover = netns.remove_namespaces_of(proc.pid)
    assert rc == 0, text[-4000:]
    assert leftover == []  # launch removed its hosts itself
    m = _metrics(out)
    assert round(m["test_accuracy"] * 360) >= 324 and m["worker_steps"] == 600  # 90%, counted
    tasks = _tasks(out)
    assert sorted(tasks) == ["chief:0", "ps:0", "worker:0", "worker:1"]
    hosts = {t["address"].rsplit(":", 1)[0] for t in tasks.values()}
    namespaces = {t["netns"] for t in tasks.values()}
    assert len(hosts) == 4 and all(a.startswith("198.18.0.") for a in hosts)
    assert len(namespaces) == 4
    # The non-loopback warning: once per task, in each task's own log.
    for name in tasks:
        with open(os.path.join(out, "logs", name.replace(":", "-") + ".log")) as f:
            assert sum(line.startswith("*** SECURITY:") for line in f) == 1, name
    assert text.count("*** SECURITY:") == 1  # the console shows the chief's one


@needs_netns
@pytest.mark.cluster
@pytest.mark.timeout(300)
def test_a_worker_whose_link_goes_down_mid_fit_is_survived(tmp_path):
    out = str(tmp_path / "out")
    proc = _launch(out, "--epochs=12", "--steps_per_epoch=100")
    try:
        poll_until(lambda: _epoch_lines(out) >= 2, proc, 150, "epoch 2")
        ns = _tasks(out)["worker:1"]["netns"]
        subprocess.run(["ip", "-n", ns, "link", "set", "eth0", "down"], check=True, timeout=10)
        try:
            time.sleep(6.0)  # the outage itself: 6 s without a link
        finally:
            subprocess.run(["ip", "-n", ns, "link", "set", "eth0", "up"], check=True,
                           timeout=10)
        assert proc.poll() is None, "the job ended during the outage"
        epochs_at_up = _epoch_lines(out)
        rc, text = _finish(proc, 220, out)
    finally:
        stop_process(proc)
        netns.remove_namespaces_of(proc.pid)
    assert rc == 0, text[-4000:]
    m = _metrics(out)
    assert m["worker_steps"] == 1200 and _accounting_holds(m, 1)
    assert round(m["test_accuracy"] * 360) >= 324  # 90% of the 360 digits, counted (float32)
    # worker:1 came back: it completed closures after its link was up again.
    log = m["epoch_log"]
    assert epochs_at_up < len(log)
    assert log[-1]["closures_per_worker"][1] > log[epochs_at_up]["closures_per_worker"][1]


@needs_netns
@pytest.mark.cluster
@pytest.mark.soak
@pytest.mark.timeout(900)
def test_soak_random_worker_kills_and_link_drops(tmp_path):
    """About 3-5 minutes under --restart_failed_tasks: every 14-20 epochs
    (paced by the job's progress, not the clock, so a faster step cannot
    leave too few faults) a random worker is SIGKILLed or its link dropped
    for 2-6 s. The job completes, the accounting bound holds, at least 8
    faults are injected and every fault is survived (the worker completed
    closures after it)."""
    rng = random.Random(0)
    out = str(tmp_path / "out")
    epochs, quiet_end = 200, 20  # no fault in the last 20 epochs: time to rejoin
    proc = _launch(out, f"--epochs={epochs}", "--steps_per_epoch=100",
                   "--restart_failed_tasks", "--max_restarts=20", "--timeout_s=800")
    faults = []
    try:
        poll_until(lambda: _epoch_lines(out) >= 2, proc, 150, "epoch 2")
        while proc.poll() is None and _epoch_lines(out) < epochs - quiet_end:
            at = min(_epoch_lines(out) + rng.randint(14, 20), epochs - quiet_end)
            poll_until(lambda: _epoch_lines(out) >= at, proc, 300, f"epoch {at}")
            if _epoch_lines(out) >= epochs - quiet_end:
                break
            worker = f"worker:{rng.randrange(2)}"
            task = _tasks(out)[worker]
            if rng.random() < 0.5:
                try:
                    os.kill(task["pid"], signal.SIGKILL)
                except ProcessLookupError:
                    continue  # already down (restarting): not a fault of ours
                kind = "sigkill"
            else:
                down_s = rng.uniform(2, 6)
                subprocess.run(["ip", "-n", task["netns"], "link", "set", "eth0", "down"],
                               check=True, timeout=10)
                time.sleep(down_s)  # the outage itself
                subprocess.run(["ip", "-n", task["netns"], "link", "set", "eth0", "up"],
                               check=True, timeout=10)
                kind = f"link down {down_s:.1f} s"
            faults.append({"worker": worker, "kind": kind, "epoch": _epoch_lines(out)})
        rc, text = _finish(proc, 60, out)
    finally:
        stop_process(proc)
        netns.remove_namespaces_of(proc.pid)
    assert rc == 0, text[-4000:]
    m = _metrics(out)
    log = m["epoch_log"]
    survived = [f for f in faults if f["epoch"] < len(log) and
                log[-1]["closures_per_worker"][int(f["worker"][-1])] >
                log[f["epoch"]]["closures_per_worker"][int(f["worker"][-1])]]
    report = {"faults": faults, "injected": len(faults), "survived": len(survived),
              "chief_runs": m["recovery"].get("chief_runs"),
              "retried_closures": m["retried_closures"],
              "worker_failures": m["worker_failures"], "test_accuracy": m["test_accuracy"],
              "wall_time_s": m["wall_time_s"]}
    print("SOAK:", json.dumps(report))
    assert len(faults) >= 8, report
    assert len(survived) == len(faults), report
    assert _accounting_holds(m, 1), report
    assert m["test_accuracy"] >= 0.85, report
