"""``python tests/scenarios KEY JSON_KWARGS``: runs one scenario (KEY:
``test_x.py::name``, or an old one's bare name) and prints ``RESULT: {json}``;
``python tests/scenarios serve JSON_SHAPE``: runs scenarios on one cluster
(see ``__init__.py``)."""

import json
import os
import sys
import traceback

# Python put tests/scenarios first on sys.path; its modules (bench, common,
# ...) are imported as scenarios.<name> from tests/ instead.
sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tf_keras  # noqa: E402

from tf_asyncps.cluster import LocalCluster  # noqa: E402

import scenarios  # noqa: E402
from scenarios import CLUSTERS, SHARED, SHARES_CLUSTER, find, to_json  # noqa: E402


def _reset_process_state(environ):
    """What one scenario may leave behind for the next one under ``serve``."""
    os.environ.clear()
    os.environ.update(environ)
    tf_keras.mixed_precision.set_global_policy("float32")
    if "keras" in sys.modules:
        sys.modules["keras"].mixed_precision.set_global_policy("float32")


def serve(num_workers, num_ps=1):
    """Keeps one LocalCluster up; runs each request line ``{"name", "kwargs"}``
    (``name``: a scenario's key)
    read on stdin on it and prints ``RESULT: {json}`` or ``ERROR: {json}``.

    Prints ``READY: {"_child_pids": [...]}`` once the cluster serves and exits
    at end of input (its tasks stop with it: their death signal).
    """
    shape = {"num_workers": num_workers, "num_ps": num_ps}
    cluster = LocalCluster(**shape).start()
    SHARED.update(shape=shape, cluster=cluster)
    print("READY: " + json.dumps({"_child_pids": list(cluster.pids.values())}), flush=True)
    environ = dict(os.environ)
    for line in sys.stdin:
        request = json.loads(line)
        name = request["name"]
        try:
            fn = find(name)
            if name not in SHARES_CLUSTER:
                raise ValueError(f"scenario {name!r} is not marked shares_cluster=True")
            print("RESULT: " + json.dumps(to_json(fn(**request["kwargs"]))), flush=True)
        except Exception:  # the test fails with this; the next one gets a new cluster
            print("ERROR: " + json.dumps(traceback.format_exc()), flush=True)
        finally:
            _reset_process_state(environ)
    sys.stderr.flush()
    os._exit(0)


def _print_task_logs():
    """Each cluster task's exit status and log tail, for a failed scenario's
    output (the logs are removed at exit): a task that died before the stop
    shows there (a stopped one exited -15)."""
    for c in CLUSTERS:
        for task, proc in sorted(c.procs.items()):
            tail = "\n    ".join(line[:300] for line in c.log_tail(task, 8).splitlines())
            print(f"--- {task} (pid {proc.pid}, exit {proc.poll()}):\n    {tail}",
                  file=sys.stderr)
    sys.stderr.flush()


def main():
    name = sys.argv[1]
    kwargs = json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
    if name == "serve":
        serve(**kwargs)
    try:
        result = to_json(find(name)(**kwargs))
    except Exception:
        traceback.print_exc()
        _print_task_logs()  # after the traceback: the test shows the output's tail
        sys.exit(1)
    result["_child_pids"] = [p for c in CLUSTERS for p in c.pids.values()]
    print("RESULT: " + json.dumps(result), flush=True)
    sys.stderr.flush()
    # The cluster is already stopped: skip TensorFlow's teardown, which would
    # try (and loudly fail) to reach the stopped servers.
    os._exit(0)


if __name__ == "__main__":
    if "::" not in sys.argv[1]:  # an old scenario by name, or `serve`
        scenarios.load_all()
    main()
