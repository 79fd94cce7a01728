"""The quiet console of `tf-asyncps launch` (tf_asyncps/app/console.py).

TensorFlow's C++ runtime floods the chief's stderr when a worker dies (gRPC
error blocks) and every process prints start-up notices; launch keeps all
of it in logs/chief-0.log and shows one line per event.
"""

import io
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import ROOT, run_command, stop_process, subprocess_env, wait_dead
from tf_asyncps.app import console

# Lines as TensorFlow 2.21 writes them (from a chief whose worker:1 was SIGKILLed).
STARTUP = [
    "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\n",
    "I0000 00:00:1796147124.113111   22196 port.cc:153] oneDNN custom operations are on. "
    "You may see slightly different numerical results\n",
    "E0000 00:00:1796147125.628832   22196 cuda_platform.cc:52] failed call to cuInit: "
    "INTERNAL: CUDA error: Failed call to cuInit: UNKNOWN ERROR (303)\n",
]
# TensorFlow 2.18's C++ lines (TSL logging, the format before absl's).
STARTUP_TF218 = [
    "2026-12-02 18:33:08.717717: I tensorflow/core/util/port.cc:153] oneDNN custom "
    "operations are on.\n",
    "2026-12-02 18:33:08.749706: E external/local_xla/xla/stream_executor/cuda/"
    "cuda_fft.cc:477] Unable to register cuFFT factory\n",
]
BLOCK = [
    "Additional GRPC error information from remote target /job:worker/replica:0/task:1 "
    "while calling /tensorflow.eager.EagerService/Enqueue:\n",
    ':UNKNOWN:Error received from peer  {grpc_status:14, grpc_message:"failed to connect to '
    'all addresses; last error: UNKNOWN: ipv4:127.0.0.1:40273: Connection refused"}\n',
    "This could happen if the remote target has been disconnected from the client.\n",
]
COORDINATOR = ("E1201 17:45:54.561971 140529123395264 cluster_coordinator.py:949] Worker "
               "/job:worker/replica:0/task:1 failed with UnavailableError():failed to connect\n")
SHUTDOWN = [  # at exit: a function already gone (status 3), not a lost task
    "E0000 00:00:1796144966.716580   12252 context.cc:911] Failed to remove function "
    "remotely due to Tried to remove non-existent function '__inference_step_696'.\n",
    "Additional GRPC error information from remote target /job:ps/replica:0/task:0 while "
    "calling /tensorflow.eager.EagerService/Enqueue:\n",
    ':UNKNOWN:Error received from peer  {grpc_message:"Tried to remove non-existent '
    'function", grpc_status:3}\n',
]


class Clock:
    def __init__(self):
        self.t = 1_000_000.0

    def __call__(self):
        return self.t


def _filter(restarts=False):
    out, log, clock = io.StringIO(), io.StringIO(), Clock()
    return console.ConsoleFilter(out, log, "logs/chief-0.log", restarts, clock), out, log, clock


def test_a_flood_becomes_one_line_and_the_log_keeps_every_line():
    f, out, log, clock = _filter()
    job = ["epoch 2/8: loss=0.42 accuracy=0.92\n", "\r  steps 210/800   55.1 steps/s  "]
    lines = STARTUP + job + [COORDINATOR] + BLOCK * 77 + ["epoch 3/8: loss=0.25\n"] + SHUTDOWN
    for line in lines:
        f.feed(line)
    assert log.getvalue() == "".join(lines)  # the whole text, in order
    assert f.hidden == len(lines) - 3
    assert len(f.events) == 1
    event = f.events[0]
    assert event.startswith("tf-asyncps: worker:1 unreachable since ")
    assert "retried on the other workers" in event and "logs/chief-0.log" in event
    # Job lines and the live progress update (a \r line) pass as they came.
    assert out.getvalue() == job[0] + job[1] + event + "epoch 3/8: loss=0.25\n"


def test_a_task_that_fails_again_later_gets_a_new_line_and_a_ps_says_the_chief_fails():
    f, out, log, clock = _filter(restarts=True)
    for line in BLOCK * 3:
        f.feed(line)
    clock.t += console.QUIET_S + 1
    for line in BLOCK:
        f.feed(line)
    assert len(f.events) == 2 and "rejoins when it is restarted" in f.events[0]
    for line in [b.replace("/job:worker/replica:0/task:1", "/job:ps/replica:0/task:0")
                 for b in BLOCK]:
        f.feed(line)
    assert f.events[2].startswith("tf-asyncps: ps:0 unreachable")
    assert "the chief fails" in f.events[2] and "latest checkpoint" in f.events[2]


@pytest.mark.parametrize("line", [
    "W1201 17:45:54.561971 1405 job.py:12] warning: a Python warning of this project\n",
    "F0000 00:00:1796147125.628832   22196 gpu_device.cc:52] Check failed: a fatal error\n",
    "Traceback (most recent call last):\n",
    "tensorflow.python.framework.errors_impl.InvalidArgumentError: a real error\n"])
def test_what_explains_a_real_error_is_shown(line):
    f, out, log, _ = _filter()
    f.feed(line)
    assert out.getvalue() == line and f.hidden == 0


def test_native_stderr_filter_replays_only_what_is_not_runtime_noise(capfd):
    with console.NativeStderrFilter() as quiet:
        os.write(2, "".join(STARTUP).encode())
        os.write(2, b"warning: a real message\n")
        print("a Python warning", file=sys.stderr, flush=True)
        quiet.release()
        os.write(2, b"after release\n")
    err = capfd.readouterr().err
    # (Under pytest, sys.stderr is not fd 2: its line may come first.)
    assert sorted(err.splitlines()) == ["a Python warning", "after release",
                                        "warning: a real message"]
    assert err.endswith("after release\n")


@pytest.mark.cluster
@pytest.mark.timeout(300)
def test_a_killed_worker_shows_one_line_and_the_full_text_stays_on_disk(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "tf_asyncps", "launch", "--flagfile=configs/digits_async.flags",
         "--epochs=6", "--steps_per_execution=10", f"--output_dir={out}"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=subprocess_env(),
        start_new_session=True)
    lines, killed = [], None
    try:
        for line in proc.stdout:
            lines.append(line)
            if killed is None and line.startswith("epoch 2/"):
                state = json.load(open(out / "logs" / "cluster.json"))
                killed = state["tasks"]["worker:1"]["pid"]
                os.kill(killed, signal.SIGKILL)
        assert proc.wait(timeout=240) == 0, "".join(lines[-30:])
    finally:
        stop_process(proc)
    assert killed is not None, "".join(lines)
    text = "".join(lines)
    # One event line for the lost worker; no runtime noise on the console.
    assert sum("worker:1 unreachable since" in l for l in lines) == 1, text
    # launch saw its process exit (tolerated: worker:0 runs on).
    assert sum(l.startswith("tf-asyncps: worker:1 was killed by SIGKILL (its log: ") and
               l.endswith("its closures are retried on the 1 worker(s) still running.\n")
               for l in lines) == 1, text
    assert not [l for l in lines if console.is_runtime_noise(l)], text
    assert len(lines) <= 21, text  # cluster, job, 6 epochs, 2 event lines, results
    assert "test accuracy" in text
    chief_log = (out / "logs" / "chief-0.log").read_text()
    assert chief_log.count("Additional GRPC error information") >= 5
    assert "epoch 6/6" in chief_log and "unreachable since" not in chief_log
    wait_dead([killed], 5)


def _watch(down):
    out = io.StringIO()
    watch = console.TaskWatch(lambda: dict(down), ["worker:0", "worker:1"],
                              lambda t: f"logs/{t.replace(':', '-')}.log",
                              lambda t: f"last line of {t}\n", out=out)
    return watch, out


def test_a_worker_exit_is_reported_once_and_the_last_worker_s_stops_the_job():
    down = {}
    watch, out = _watch(down)
    assert watch() is None and out.getvalue() == ""
    down["worker:1"] = -signal.SIGKILL
    assert watch() is None and watch() is None
    assert out.getvalue() == ("tf-asyncps: worker:1 was killed by SIGKILL (its log: "
                              "logs/worker-1.log); its closures are retried on the 1 "
                              "worker(s) still running.\n")
    down["worker:0"] = 1
    assert watch() == ("worker:0 exited with code 1; the end of its log (logs/worker-0.log):"
                       "\n  last line of worker:0\nNo worker is left (the chief would wait "
                       "for one until --timeout_s): the chief and the cluster are stopped.")
    assert watch.reported == ["worker:1"]


def test_a_ps_exit_stops_the_job_whatever_its_code():
    watch, out = _watch({"ps:0": 0, "worker:1": -signal.SIGABRT})
    assert watch() == ("ps:0 exited with code 0; the end of its log (logs/ps-0.log):\n"
                       "  last line of ps:0\nA ps task holds variables: the job cannot go "
                       "on; the chief and the cluster are stopped.")
    assert console.describe_exit(-signal.SIGABRT) == "was killed by SIGABRT"


def test_run_filtered_stops_the_child_when_the_watch_says_so(tmp_path):
    calls = []

    def watch():
        calls.append(1)
        return "worker:0 was killed by SIGKILL" if len(calls) == 2 else None

    started = []
    with pytest.raises(SystemExit, match=r"^tf-asyncps launch: worker:0 was killed by SIGKILL$"):
        console.run_filtered([sys.executable, "-c", "import time; print('up', flush=True); "
                              "time.sleep(600)"], subprocess_env(), str(tmp_path / "c.log"),
                             timeout_s=300, watch=watch, poll_s=0.05,
                             on_start=started.append)
    assert started[0].poll() is not None and len(calls) == 2


@pytest.mark.cluster
@pytest.mark.timeout(180)
def test_launch_stops_at_once_when_its_only_worker_dies(tmp_path):
    # The coordinator waits for a lost worker to come back: without a worker
    # left, launch waited for --timeout_s (1800 s by default), saying nothing.
    out = tmp_path / "run"
    (out / "logs").mkdir(parents=True)
    for name in ("chief-0.log", "worker-0.log"):  # an earlier run's: started afresh
        (out / "logs" / name).write_text("an earlier run\n")
    proc = subprocess.Popen(
        [sys.executable, "-m", "tf_asyncps", "launch", "--num_workers=1", "--epochs=50",
         f"--output_dir={out}"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, cwd=ROOT, env=subprocess_env(), start_new_session=True)
    lines, killed = [], None
    try:
        for line in proc.stdout:
            lines.append(line)
            if killed is None and line.startswith("tf-asyncps: cluster up in "):
                tasks = json.load(open(out / "logs" / "cluster.json"))["tasks"]
                killed = tasks["worker:0"]["pid"], time.monotonic()
                os.kill(killed[0], signal.SIGKILL)
        rc = proc.wait(timeout=60)
    finally:
        stop_process(proc)
    text = "".join(lines)
    assert killed is not None, text
    took = time.monotonic() - killed[1]
    assert rc == 1, text
    assert (f"tf-asyncps launch: worker:0 was killed by SIGKILL; the end of its log "
            f"({out / 'logs' / 'worker-0.log'}):\n") in text
    assert "serving worker:0 at 127.0.0.1:" in text  # the log's last lines
    assert text.rstrip().endswith("No worker is left (the chief would wait for one until "
                                  "--timeout_s): the chief and the cluster are stopped."), text
    assert took < 30, took  # chief and ps stopped: seconds, not --timeout_s
    for name in ("chief-0.log", "worker-0.log"):
        assert "an earlier run" not in (out / "logs" / name).read_text()
    wait_dead([t["pid"] for t in tasks.values()], 5)


def test_each_run_starts_its_log_afresh_and_a_re_run_adds_to_it(tmp_path):
    log = tmp_path / "chief-0.log"
    say = lambda word: [sys.executable, "-c", f"print({word!r})"]
    for word in ("first", "second"):
        assert console.run_filtered(say(word), subprocess_env(), str(log), timeout_s=60) == 0
    assert log.read_text() == "second\n"  # chief-0.log appended across launches before
    assert console.run_filtered(say("re-run"), subprocess_env(), str(log), timeout_s=60,
                                append=True) == 0
    assert log.read_text() == "second\nre-run\n"


def test_full_console_shows_every_line_and_logs_them_all():
    out, log = io.StringIO(), io.StringIO()
    f = console.ConsoleFilter(out, log, "logs/chief-0.log", full=True)
    for line in STARTUP + BLOCK + [COORDINATOR, "epoch 1/1: loss=0.5\n"]:
        f.feed(line)
    every = "".join(STARTUP + BLOCK + [COORDINATOR, "epoch 1/1: loss=0.5\n"])
    assert out.getvalue() == every == log.getvalue()
    assert f.hidden == 0 and f.events == []  # no event line under full


def test_reference_on_a_quiet_console_keeps_tensorflow_lines_in_its_log(tmp_path):
    # `reference` printed TensorFlow's start-up notices (oneDNN, cuInit; written
    # before TensorFlow's logging is set up, whatever TF_CPP_MIN_LOG_LEVEL
    # says) while launch hid them: by default (auto), here a pipe, it is quiet
    # as launch is.
    out = tmp_path / "run"
    rc, text = run_command(
        [sys.executable, "-m", "tf_asyncps", "reference", "--epochs=1",
         "--steps_per_epoch=2", f"--output_dir={out}"], timeout=120)
    lines = text.splitlines(keepends=True)
    log = tmp_path / "run_reference" / "logs" / "reference.log"
    assert lines[0] == (f"tf-asyncps reference: TensorFlow's runtime lines go to {log} "
                        "(--console=full shows them here)\n")
    assert [l.split(":")[0] for l in lines[1:3]] == ["reference", "reference"]
    assert lines[3:] == [f"wrote {out}_reference/metrics.json\n"]
    assert not [l for l in lines if console.is_runtime_noise(l)], text
    logged = log.read_text().splitlines(keepends=True)
    assert [l for l in logged if console.is_runtime_noise(l)], "nothing to hide?"
    assert [l for l in logged if not console.is_runtime_noise(l)] == lines[1:]


@pytest.mark.cluster
@pytest.mark.timeout(300)
def test_launch_console_full_prints_what_quiet_keeps_in_the_log(tmp_path):
    out = tmp_path / "run"
    rc, text = run_command(
        [sys.executable, "-m", "tf_asyncps", "launch", "--console=full", "--epochs=1",
         "--steps_per_epoch=4", f"--output_dir={out}"], timeout=240)
    chief_log = (out / "logs" / "chief-0.log").read_text()
    noise = [l for l in chief_log.splitlines() if console.is_runtime_noise(l)]
    assert noise  # the chief's TensorFlow start-up notices at least
    shown = text.splitlines()
    for line in noise:
        assert line in shown, line
    assert "unreachable since" not in text


def test_tensorflow_218_runtime_lines_are_noise_and_python_lines_are_not():
    assert all(console.is_runtime_noise(l) for l in STARTUP_TF218)
    # The same timestamp with a Python source (absl logging) or plain text is kept.
    assert not console.is_runtime_noise("2026-12-02 18:33:08.717717: I job.py:12] epoch 1\n")
    assert not console.is_runtime_noise("2026-12-02 18:33:08 epoch 1/1: loss=0.5\n")
