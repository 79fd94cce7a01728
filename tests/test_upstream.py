"""The rules of the upstream tier (tests/upstream/run_upstream.py), without a
cluster: how a run of TensorFlow's and tf_keras's own test files with the
class swapped is judged against vanilla and the list of accepted differences.
The runs themselves are tests/test_upstream_*.py (cluster tier)."""

import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "upstream"))
import run_upstream  # noqa: E402

ACCEPTED_ID = "parameter_server_strategy_v2_test.ClusterTypeNameTest.testLessThanOnePs"


def _results(**overrides):
    """A full run of parameter_server_strategy_v2_test as ours gives it."""
    results = {f"parameter_server_strategy_v2_test.T.test{i}": {"status": "passed"}
               for i in range(run_upstream.VANILLA["parameter_server_strategy_v2_test"]
                              ["tests"])}
    for test_id in [t for t in run_upstream.ACCEPTED
                    if t.startswith("parameter_server_strategy_v2_test.")]:
        results.pop(next(iter(results)))
        results[test_id] = {"status": "failed", "type": "AssertionError",
                            "message": '"There must be at least one ps." does not match '
                                       '"Invalid ...: the cluster has no "ps" task"',
                            "traceback": ""}
    results.update(overrides)
    return results


def test_a_run_as_ours_gives_it_has_no_problem():
    assert run_upstream.check(_results()) == []


def test_a_failure_outside_the_accepted_list_is_a_problem():
    results = _results()
    test_id = next(t for t, r in results.items() if r["status"] == "passed")
    results[test_id] = {"status": "failed", "type": "RuntimeError", "message": "boom",
                        "traceback": "Traceback ..."}
    [problem] = run_upstream.check(results)
    assert problem.startswith(f"{test_id} failed: RuntimeError: boom")


def test_an_accepted_test_that_passes_must_leave_the_list():
    [problem] = run_upstream.check(_results(**{ACCEPTED_ID: {"status": "passed"}}))
    assert f"{ACCEPTED_ID} passed: it is in ACCEPTED" in problem


def test_an_accepted_test_failing_otherwise_is_a_problem():
    # Another exception type (the ValueError's absence, or another error).
    other = {"status": "failed", "type": "TypeError", "message": "bad", "traceback": ""}
    [problem] = run_upstream.check(_results(**{ACCEPTED_ID: other}))
    assert "failed other than ACCEPTED says" in problem
    # The same type for another reason than the message.
    other = {"status": "failed", "type": "AssertionError",
             "message": "ValueError not raised", "traceback": ""}
    [problem] = run_upstream.check(_results(**{ACCEPTED_ID: other}))
    assert "failed other than ACCEPTED says" in problem


def test_a_skip_vanilla_does_not_make_and_a_lost_test_are_problems():
    results = _results()
    test_id = next(t for t, r in results.items() if r["status"] == "passed")
    results[test_id] = {"status": "skipped"}
    assert run_upstream.check(results) == [f"{test_id} skipped; vanilla runs it"]
    del results[test_id]
    assert run_upstream.check(results) == [
        "parameter_server_strategy_v2_test: 28 tests ran, vanilla runs 29"]


def test_every_accepted_entry_names_an_upstream_test_its_type_and_reason():
    for test_id, (exc_type, message_re, reason) in run_upstream.ACCEPTED.items():
        assert test_id.split(".")[0] in run_upstream.UPSTREAM_FILES, test_id
        assert exc_type and message_re and len(reason) > 20, test_id
    for name, pin in run_upstream.UPSTREAM_FILES.items():
        assert len(pin["commit"]) == 40 and len(pin["sha256"]) == 64, name
        assert pin["path"].endswith(name + ".py"), name


def test_the_runner_imports_no_tensorflow_outside_its_child_processes():
    out = subprocess.run(
        [sys.executable, "-c", "import sys; sys.path.insert(0, 'tests/upstream'); "
         "import run_upstream; print('tensorflow' in sys.modules)"],
        cwd=os.path.dirname(HERE), capture_output=True, text=True, check=True,
        env={k: v for k, v in os.environ.items() if k != "ASYNCPS_UPSTREAM_CHILD"})
    assert out.stdout.strip() == "False"
