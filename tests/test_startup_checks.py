"""Start-up checks (issue 6): a bad TF_CONFIG fails before TensorFlow is
imported, a port that is not a TF gRPC server is named instead of hanging,
and evaluator jobs are left out of training."""

import http.server
import json
import logging
import socket
import subprocess
import sys
import threading
import time

import portpicker
import pytest

from conftest import ROOT, _env, run_command, stop_process, wait_dead
from tf_asyncps import cluster
from tf_asyncps.cluster import validate_tf_config

pytestmark = pytest.mark.timeout(120)


def _config(ps="127.0.0.1:2001", worker="127.0.0.1:2002", chief="127.0.0.1:2000",
            task=("worker", 0), **extra):
    cfg = {"cluster": {"chief": [chief], "ps": [ps], "worker": [worker], **extra},
           "task": {"type": task[0], "index": task[1]}}
    return cfg


def _cli(*args, tf_config, timeout=60):
    env = _env()
    env["TF_CONFIG"] = tf_config if isinstance(tf_config, str) else json.dumps(tf_config)
    t0 = time.perf_counter()
    rc, out = run_command([sys.executable, "-m", "tf_asyncps", *args], timeout=timeout,
                          env=env, check=False)
    return rc, out, time.perf_counter() - t0


@pytest.fixture(autouse=True)
def _fresh_warnings(monkeypatch):
    monkeypatch.setattr(cluster, "_WARNED", set())


# -- a malformed TF_CONFIG fails in under 2 s, before TensorFlow ------------

CLI_BAD = [
    ({"cluster": {"ps": ["127.0.0.1:2001"], "worker": ["127.0.0.1:2002"]},
      "task": {"type": "worker", "index": 0}}, 'no "chief" task'),
    ('{"cluster": {"chief": ["127.0.0.1:2000"]', "not valid JSON"),
    (_config(ps="127.0.0.1:70000"), 'cluster["ps"][0] = "127.0.0.1:70000"'),
    (_config(workers=["127.0.0.1:2003"]), 'unknown job "workers"'),
    (_config(task=("worker", 3)), "task index 3 is out of range"),
]


@pytest.mark.parametrize("command", ["train", "server"])
@pytest.mark.parametrize("tf_config,words", CLI_BAD, ids=[str(i) for i in range(len(CLI_BAD))])
def test_cli_fails_on_bad_tf_config_in_under_2_s(command, tf_config, words):
    rc, out, seconds = _cli(command, tf_config=tf_config)
    assert rc == 1 and f"tf-asyncps {command}: error: Invalid TF_CONFIG" in out, out
    assert words in out, out
    assert "Traceback" not in out
    assert seconds < 2.0, f"took {seconds:.2f} s"


def test_cli_validates_before_importing_tensorflow():
    code = ("import sys\n"
            "sys.argv = ['tf-asyncps', 'train']\n"
            "from tf_asyncps import cli\n"
            "try:\n    cli.run()\nexcept SystemExit as e:\n    print('EXIT', e.code)\n"
            "print('TF_IMPORTED', 'tensorflow' in sys.modules)\n")
    env = _env()
    env["TF_CONFIG"] = json.dumps(_config(ps="127.0.0.1:0"))
    _, out = run_command([sys.executable, "-c", code], timeout=60, env=env)
    assert 'cluster["ps"][0] = "127.0.0.1:0"' in out
    assert "TF_IMPORTED False" in out, out


# -- the gRPC handshake probe -----------------------------------------------

def test_probe_passes_for_a_real_tensorflow_server_and_evaluator_is_left_out(tmp_path):
    """A real `tf-asyncps server` (tf.distribute.Server) in a subprocess. Its
    TF_CONFIG names an evaluator at a silent port: the server must ignore it."""
    ports = [portpicker.pick_unused_port() for _ in range(4)]
    silent = socket.create_server(("127.0.0.1", ports[3]), backlog=4)  # never accepts
    cfg = _config(ps=f"127.0.0.1:{ports[0]}", worker=f"127.0.0.1:{ports[1]}",
                  chief=f"127.0.0.1:{ports[2]}", task=("ps", 0),
                  evaluator=[f"127.0.0.1:{ports[3]}"])
    env = _env()
    env["TF_CONFIG"] = json.dumps(cfg)
    log = tmp_path / "ps.log"
    with open(log, "wb") as f:
        p = subprocess.Popen([sys.executable, "-m", "tf_asyncps", "server"], env=env,
                             cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                             start_new_session=True)
    try:
        config = validate_tf_config(cfg)
        cluster.wait_for_tasks(config, timeout_s=60, jobs=("ps",), procs={"ps:0": p})
        assert cluster.probe_grpc(f"127.0.0.1:{ports[0]}") == (cluster.PROBE_OK, "")
        assert p.poll() is None
    finally:
        stop_process(p)
        silent.close()
    wait_dead([p.pid])
    text = log.read_text()
    assert f"serving ps:0 at 127.0.0.1:{ports[0]}" in text, text
    assert text.count("TF_CONFIG lists evaluator task(s)") == 1, text


def test_silent_open_port_is_named_within_the_timeout():
    port = portpicker.pick_unused_port()
    with socket.create_server(("127.0.0.1", port), backlog=4):  # accepts, says nothing
        assert cluster.probe_grpc(f"127.0.0.1:{port}", timeout=0.5)[0] == cluster.PROBE_SILENT
        config = validate_tf_config(_config(ps=f"127.0.0.1:{port}"))
        t0 = time.perf_counter()
        with pytest.raises(TimeoutError) as e:
            cluster.wait_for_tasks(config, timeout_s=1.5, jobs=("ps",))
        seconds = time.perf_counter() - t0
    assert (f"ps:0 at 127.0.0.1:{port} answers but is not a TensorFlow gRPC server"
            in str(e.value))
    assert "no HTTP/2 SETTINGS frame" in str(e.value)
    assert 1.5 <= seconds < 3.5, seconds


def test_http_server_is_named_at_once():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        addr = f"127.0.0.1:{server.server_address[1]}"
        config = validate_tf_config(_config(ps=addr))
        t0 = time.perf_counter()
        with pytest.raises(RuntimeError) as e:
            cluster.wait_for_tasks(config, timeout_s=30, jobs=("ps",))
        seconds = time.perf_counter() - t0
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
    msg = str(e.value)
    assert f"ps:0 at {addr} answers but is not a TensorFlow gRPC server" in msg
    assert "it answered b'" in msg and "not an HTTP/2 SETTINGS frame" in msg
    assert "Another program holds that port" in msg
    assert seconds < 1.0, seconds


def test_unreachable_and_silent_tasks_are_each_named_within_the_timeout():
    dead, quiet = portpicker.pick_unused_port(), portpicker.pick_unused_port()
    with socket.create_server(("127.0.0.1", quiet), backlog=4):
        config = validate_tf_config(_config(ps=f"127.0.0.1:{dead}",
                                            worker=f"127.0.0.1:{quiet}"))
        t0 = time.perf_counter()
        with pytest.raises(TimeoutError) as e:
            cluster.wait_for_tasks(config, timeout_s=1.0)
        seconds = time.perf_counter() - t0
    msg = str(e.value)
    assert f"cannot reach ps:0 at 127.0.0.1:{dead}" in msg
    assert f"worker:0 at 127.0.0.1:{quiet} answers but is not" in msg
    assert "after 1 s" in msg and "--connect_timeout_s" in msg
    assert 1.0 <= seconds < 3.0, seconds


# -- evaluator jobs ----------------------------------------------------------

def test_evaluator_is_left_out_of_the_resolver_with_one_warning(caplog):
    caplog.set_level(logging.WARNING)
    cfg = validate_tf_config(_config(task=("chief", 0), evaluator=["127.0.0.1:2011"]))
    resolver = cluster.cluster_resolver(cfg)
    cluster.cluster_resolver(cfg)
    assert resolver.cluster_spec().as_dict() == {
        "chief": ["127.0.0.1:2000"], "ps": ["127.0.0.1:2001"], "worker": ["127.0.0.1:2002"]}
    assert (resolver.task_type, resolver.task_id, resolver.rpc_layer) == ("chief", 0, "grpc")
    warnings = [r.getMessage() for r in caplog.records if "evaluator" in r.getMessage()]
    assert len(warnings) == 1 and "['127.0.0.1:2011']" in warnings[0], warnings
