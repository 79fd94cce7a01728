"""A pytest plugin: each test's temporary files in a directory of its own,
removed when the test passes and kept, its path in the report, when it fails.

Tests start clusters, scenarios and jobs in other processes, and those write
their logs and TensorFlow's autograph files with ``tempfile`` (a
``LocalCluster``'s ``/tmp/tf_asyncps_cluster_*``, a scenario's
``mkdtemp()``). A process stopped by SIGTERM or SIGKILL runs no ``atexit``, so
one run of the suite left ~60 cluster log directories and ~9
``pss_tutorial_*`` in /tmp. Here every test runs with ``TMPDIR`` (inherited by
the processes it starts) and ``tempfile.tempdir`` set to
``<session root>/<test>``; the session root is
``$TMPDIR/tf_asyncps_tests_*``, where what runs outside a test writes too
(a module-scoped fixture's cluster); it is cleared at the session's end but
for the failed tests' directories. A shared
cluster (conftest's ``SharedCluster``) outlives the test that started it, so
it gets a directory of its own from :func:`shared_dir`.
"""

import os
import re
import shutil
import tempfile

import pytest

_state = {"root": None, "outer_env": None, "kept": []}


def _root() -> str:
    if _state["root"] is None:
        _state["root"] = tempfile.mkdtemp(prefix="tf_asyncps_tests_")
    return _state["root"]


def pytest_configure(config):
    # What runs outside a test (a module-scoped fixture's cluster, the
    # collection) writes into the session root, cleared at the end.
    _state["outer_env"] = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = tempfile.tempdir = _root()


def shared_dir(name: str) -> str:
    """A new directory under the session root for something that outlives
    one test (a shared cluster); the caller removes it (:func:`finish`)."""
    return tempfile.mkdtemp(prefix=re.sub(r"[^\w.-]+", "_", name)[:40] + "_", dir=_root())


def finish(path: str, keep: bool, what: str) -> None:
    """Removes ``path``, or keeps it and lists it at the session's end."""
    if keep:
        _state["kept"].append((what, path))
    else:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(autouse=True)
def _tmpdir_per_test(request, tmp_path_factory):
    # pytest's own base directory (tmp_path's) is made on first use under
    # tempfile's directory: make it in the session root, not in the first
    # test's directory, which goes when that test passes.
    tmp_path_factory.getbasetemp()
    path = tempfile.mkdtemp(prefix=re.sub(r"[^\w.-]+", "_", request.node.name)[:60] + "_",
                            dir=_root())
    request.node._asyncps_tmp = path
    os.environ["TMPDIR"] = tempfile.tempdir = path
    try:
        yield path
    finally:
        os.environ["TMPDIR"] = tempfile.tempdir = _root()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    path = getattr(item, "_asyncps_tmp", None)
    if path is None:
        return
    if rep.failed:
        item._asyncps_failed = True
        rep.sections.append(("temporary files kept", path))
    if rep.when == "teardown":
        finish(path, getattr(item, "_asyncps_failed", False), item.nodeid)


@pytest.hookimpl(trylast=True)  # after conftest's, which closes the shared clusters
def pytest_sessionfinish(session, exitstatus):
    root = _state["root"]
    if root is None:
        return
    tempfile.tempdir = None
    if _state["outer_env"] is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = _state["outer_env"]
    kept = {os.path.basename(path) for _, path in _state["kept"]}
    for name in os.listdir(root):
        if name not in kept:
            path = os.path.join(root, name)
            shutil.rmtree(path, ignore_errors=True) if os.path.isdir(path) else os.remove(path)
    if not kept:
        os.rmdir(root)


def pytest_terminal_summary(terminalreporter):
    if _state["kept"]:
        terminalreporter.write_sep("-", "temporary files of failed tests, kept")
        for what, path in _state["kept"]:
            terminalreporter.write_line(f"{what}: {path}")
