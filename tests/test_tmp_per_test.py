"""The suite's temporary files: a passing test leaves none, a failing test's
are kept and named (tests/tmp_per_test.py)."""

import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))

_TESTS = '''
import os, subprocess, sys, tempfile

def _make(name):
    made = [tempfile.mkdtemp(prefix=name + "_in_test_")]
    # A child that is killed, so its atexit never runs (a stopped cluster task).
    child = subprocess.run([sys.executable, "-c",
        "import os, tempfile, signal; print(tempfile.mkdtemp(prefix='child_'), flush=True); "
        "os.kill(os.getpid(), signal.SIGKILL)"], stdout=subprocess.PIPE, text=True)
    made.append(child.stdout.strip())
    with open(os.environ["MADE_LOG"], "a") as f:
        f.write(name + " " + " ".join(made) + "\\n")

import pytest

@pytest.fixture(scope="module")
def before_any_test():
    # A module-scoped fixture runs before the test's own directory exists.
    with open(os.environ["MADE_LOG"], "a") as f:
        f.write("module " + tempfile.mkdtemp(prefix="module_") + "\\n")

def test_passes(before_any_test):
    _make("passes")

def test_uses_tmp_path_first(tmp_path):
    (tmp_path / "x").write_text("x")

def test_uses_tmp_path_after_it(tmp_path):
    # The base of tmp_path outlives the test that used it first.
    (tmp_path / "y").write_text("y")

def test_fails():
    _make("fails")
    assert False
'''


def test_a_passing_test_removes_its_temporary_files_and_a_failing_one_keeps_them(tmp_path):
    (tmp_path / "test_made.py").write_text(_TESTS)
    outer = tmp_path / "tmp"
    outer.mkdir()
    log = tmp_path / "made.log"
    env = dict(os.environ, TMPDIR=str(outer), MADE_LOG=str(log),
               PYTHONPATH=HERE + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "tmp_per_test",
                          "-p", "no:cacheprovider", str(tmp_path / "test_made.py")],
                         cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, timeout=60).stdout
    assert "1 failed, 3 passed" in out, out
    made = dict(line.split(" ", 1) for line in log.read_text().splitlines())
    passed, failed = made["passes"].split(), made["fails"].split()
    assert all(p.startswith(str(outer)) for p in passed + failed + [made["module"]]), made
    assert not any(os.path.exists(p) for p in passed + [made["module"]])
    assert all(os.path.isdir(p) for p in failed)
    test_dir = os.path.dirname(failed[0])
    assert os.path.dirname(failed[1]) == test_dir  # the child's went with the test's
    assert "temporary files kept" in out and test_dir in out
    # Nothing else was left: the session root holds only the failed test's.
    (root,) = os.listdir(outer)
    assert os.listdir(outer / root) == [os.path.basename(test_dir)]
