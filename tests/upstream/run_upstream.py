"""Runs TensorFlow's and tf_keras's own ParameterServerStrategy test files
(tests/upstream/README.md: their sources and pinned commits) with
``tf_asyncps.AsyncParameterServerStrategy`` swapped in, or as published.

    python tests/upstream/run_upstream.py FILE [FILE ...]            # ours
    python tests/upstream/run_upstream.py --vanilla FILE [FILE ...]  # vanilla
    python tests/upstream/run_upstream.py --json OUT.json FILE ...

FILE is a name of UPSTREAM_FILES (``cluster_coordinator_test``) or a path.
Each file runs in a fresh process (TensorFlow allows one cluster per
process) with its own temporary folder (TMPDIR and absltest's TEST_TMPDIR),
removed afterwards; its process group is killed if it runs past
``--timeout``. The results come from absltest's XML report. With the class
swapped, every test must pass or skip as under vanilla, except the entries
of ACCEPTED (tests/upstream/README.md, "Accepted differences"), which must
still fail, and only as written there; the exit status is 0 when that holds
(or, with --vanilla, always after a complete run), 1 otherwise.

The swap (this module's top level, so that it also happens in the processes
TensorFlow's MultiProcessRunner forks from its forkserver, which re-imports
this file as its main module): ``tf.distribute.ParameterServerStrategy``,
``tf.distribute.experimental.ParameterServerStrategy`` (also under
``tf.compat.v2``) and ``tensorflow.python.distribute.
parameter_server_strategy_v2.ParameterServerStrategyV2`` (the name the
TensorFlow files and tf_keras's strategy combinations call) become
``DropInStrategy`` is ``AsyncParameterServerStrategy`` itself, the class
name as the only change (a partitioner given as its second positional
parameter, as the files' ``ParameterServerStrategyV2(resolver, partitioner)``
does, is taken as ``variable_partitioner``, as vanilla's).

tf_keras's files are of its repository layout before ``tf_keras/src``
(``from tf_keras.distribute import ...``): a finder here maps
``tf_keras.distribute``, ``tf_keras.testing_infra`` and
``tf_keras.utils.dataset_creator`` to the installed ``tf_keras.src.`` modules
(the same module objects), so the files run unchanged.
"""

import argparse
import importlib
import importlib.abc
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import types
import xml.etree.ElementTree as ElementTree

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
VANILLA_ENV = "ASYNCPS_UPSTREAM_VANILLA"

_TF = ("tensorflow/tensorflow", "tensorflow/python/distribute/")
_KERAS = ("keras-team/tf-keras", "tf_keras/distribute/")
_KERAS_COMMIT = "6add81a967a830418b1507ac99ddba2d4e43a62b"

#: name -> where it comes from (repository, path, pinned commit), the sha256
#: of that version, and the test-id filters (unittest ``-k``) it runs with.
UPSTREAM_FILES = {
    "parameter_server_strategy_v2_test": dict(
        repo=_TF[0], path=_TF[1] + "parameter_server_strategy_v2_test.py",
        commit="0866b7a759f11fe6a2f9f1253da6dc26e49e19a5",
        sha256="192c9f521c9baffa51f373c09739cff2b3e2a39158d4a3a2aa23fe7338423256"),
    "cluster_coordinator_test": dict(
        repo=_TF[0], path=_TF[1] + "coordinator/cluster_coordinator_test.py",
        commit="0304934138cbfabd338ec432a630a9c3c1191564",
        sha256="3099f768cf6739bdd10eda856f91bb40d3bcee7fe06b04af8f677e58f28e06d7"),
    "parameter_server_evaluation_test": dict(
        repo=_KERAS[0], path=_KERAS[1] + "parameter_server_evaluation_test.py",
        commit=_KERAS_COMMIT,
        sha256="2bc0f14db367a6801b46da971d8243b8b4b18114e125005bc82a15d7a31fc3a0"),
    "dataset_creator_model_fit_test": dict(
        repo=_KERAS[0], path=_KERAS[1] + "dataset_creator_model_fit_test.py",
        commit=_KERAS_COMMIT,
        sha256="89567b54ef807efbb06d6ed711f0474e9aba80f903811a7f617e15b73210c69d",
        # Its strategies are all of TensorFlow's: the parameter-server ones only.
        filters=["ParameterServer3Worker2PS"]),
    "dataset_creator_model_fit_ps_only_test": dict(
        repo=_KERAS[0], path=_KERAS[1] + "dataset_creator_model_fit_ps_only_test.py",
        commit=_KERAS_COMMIT,
        sha256="5e2e7b123ba8e80d54fb16daae2a9b8c3409891235c10e78c42d547350410187"),
}

#: Tests that fail with the class swapped, for their messages only:
#: test id -> (the failure's exception type, a regex its message matches,
#: the reason). Each must still fail so (tests/test_upstream*.py).
ACCEPTED = {
    **{
        f"parameter_server_strategy_v2_test.ClusterTypeNameTest.{name}": (
            "AssertionError", r'^"[^"]+" does not match "',
            "ours raises the same ValueError for this cluster, before any "
            "connection, with its own clearer message (naming the field and "
            "the fix); the test's regular expression is TensorFlow's wording")
        for name in ("testArbitraryJobName", "testArbitraryCurrentTaskType",
                     "testMoreThanOneChief", "testLessThanOneWorker",
                     "testLessThanOnePs")
    },
    # Not a message only: fails for vanilla too, with another exception.
    **{
        "dataset_creator_model_fit_ps_only_test."
        "DatasetCreatorModelFitParameterServerStrategyOnlyTest."
        "testClusterCoordinatorSingleInstanceWithJitCompileTrue_test_mode_eager_"
        f"strategy_ParameterServer3Worker2PSCPU_usedatasetcreator_{flag}": (
            # MultiProcessRunner re-raises the chief's error as an AssertionError
            # holding its traceback.
            "AssertionError", r"ValueError: A worker step called an optimizer update twice",
            "fails for vanilla too (jit_compile=True: XLA cannot read the variables "
            "on the ps from a worker, InvalidArgumentError 'Trying to access resource "
            "... located in device /job:ps'); ours stops before, at its one-update-"
            "per-step check, with a ValueError")
        for flag in ("True", "False")
    },
}

#: What the files give as published (--vanilla), TensorFlow 2.21.0 and
#: tf_keras 2.21.0 on CPU (tests/upstream/README.md has the counts).
VANILLA = {
    "parameter_server_strategy_v2_test": {"tests": 29},
    "cluster_coordinator_test": {"tests": 105},
    "parameter_server_evaluation_test": {"tests": 2},
    "dataset_creator_model_fit_test": {"tests": 44},
    "dataset_creator_model_fit_ps_only_test": {"tests": 40},
}
#: Tests that need a GPU (tf_keras's 1-GPU combinations): they skip without one,
#: vanilla too.
GPU_ONLY = re.compile(r"_strategy_ParameterServer\dWorker\dPS\dGPU")
#: The tests that skip themselves as published (a flaky or an open TODO).
VANILLA_SKIPPED = {
    *(f"cluster_coordinator_test.{c}.testFetchingRemoteValueStructure"
      for c in ("ClusterCoordinatorTest", "LimitedClosureQueueSizeBasicTest",
                "ScheduleStartDelayTest")),
    *(f"cluster_coordinator_test.{c}.testRemoteValueReturnError"
      for c in ("ErrorReportingTest", "LimitedClosureQueueErrorTest")),
    "dataset_creator_model_fit_ps_only_test."
    "DatasetCreatorModelFitParameterServerStrategyOnlyTest.testModelPredict_test_mode_"
    "eager_strategy_ParameterServer3Worker2PSCPU_usedatasetcreator_True",  # "Unused option."
}

_KERAS_ALIASES = ("tf_keras.distribute", "tf_keras.testing_infra",
                  "tf_keras.utils.dataset_creator")


class _KerasSrcAliases(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """``tf_keras.X`` -> the module ``tf_keras.src.X`` for X in _KERAS_ALIASES."""

    def find_spec(self, fullname, path=None, target=None):
        if any(fullname == a or fullname.startswith(a + ".") for a in _KERAS_ALIASES):
            return importlib.util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec):
        return importlib.import_module("tf_keras.src." + spec.name[len("tf_keras."):])

    def exec_module(self, module):
        pass


def _install_keras_aliases():
    if not any(isinstance(f, _KerasSrcAliases) for f in sys.meta_path):
        sys.meta_path.insert(0, _KerasSrcAliases())


def _swap():
    """Puts DropInStrategy where TensorFlow's ParameterServerStrategy is.

    The defining module keeps its class (its methods name it: ``super(
    ParameterServerStrategyV2, self)``); everyone else, and every later
    import, gets a copy of that module whose ``ParameterServerStrategyV2``
    is DropInStrategy.
    """
    import tensorflow as tf
    from tensorflow.python import distribute as distribute_pkg
    from tensorflow.python.distribute import parameter_server_strategy_v2 as real

    import tf_asyncps

    vanilla = real.ParameterServerStrategyV2

    # The class itself: its second positional parameter takes vanilla's
    # variable_partitioner too (AsyncParameterServerStrategy's docstring).
    DropInStrategy = tf_asyncps.AsyncParameterServerStrategy

    copy = types.ModuleType(real.__name__, real.__doc__)
    copy.__dict__.update({k: v for k, v in vars(real).items() if k != "__name__"})
    copy.ParameterServerStrategyV2 = DropInStrategy
    sys.modules[real.__name__] = copy
    distribute_pkg.parameter_server_strategy_v2 = copy
    tf.compat.v2.distribute.experimental.ParameterServerStrategy  # loads the lazy API
    for name, mod in list(sys.modules.items()):
        if mod is None or mod is real or not name.startswith(("tensorflow", "tf_keras")):
            continue
        for attr, value in list(vars(mod).items()):
            if value is real:
                setattr(mod, attr, copy)
            elif value is vanilla:
                setattr(mod, attr, DropInStrategy)
    assert tf.distribute.ParameterServerStrategy is DropInStrategy
    assert tf.distribute.experimental.ParameterServerStrategy is DropInStrategy
    assert tf.compat.v2.distribute.experimental.ParameterServerStrategy is DropInStrategy
    assert real.ParameterServerStrategyV2 is vanilla


# -- every process of a child run (the child, and MultiProcessRunner's) --------
if os.environ.get("ASYNCPS_UPSTREAM_CHILD") == "1":
    import tensorflow  # noqa: F401  in the forkserver too: its processes start with it
    _install_keras_aliases()
    if os.environ.get(VANILLA_ENV) != "1":
        _swap()


# -- the child: one file ---------------------------------------------------------
def _child(path, xml_out, filters):
    name = os.path.splitext(os.path.basename(path))[0]
    sys.path.insert(0, os.path.dirname(path))
    module = importlib.import_module(name)
    main = sys.modules["__main__"]
    for attr, value in vars(module).items():
        if isinstance(value, type) and value.__module__ == name:
            setattr(main, attr, value)  # absltest runs the tests of __main__
    with open(path) as f:
        source = f.read()
    # MultiProcessRunner starts its processes with sys.argv[0]: the interpreter.
    sys.argv = [sys.executable, f"--xml_output_file={xml_out}"]
    if filters:  # absltest passes these to unittest as -k patterns
        os.environ["TESTBRIDGE_TEST_ONLY"] = " ".join(filters)
    from tensorflow.python.compat import v2_compat
    v2_compat.enable_v2_behavior()
    if "multi_process_runner.test_main()" in source:
        from tensorflow.python.distribute import multi_process_runner
        multi_process_runner.test_main()
    else:
        from tensorflow.python.eager import test
        test.main()


# -- the parent: runs, reads the report, checks --------------------------------
def upstream_dir():
    """Where the upstream files are: $ASYNCPS_UPSTREAM_DIR, else this folder."""
    return os.environ.get("ASYNCPS_UPSTREAM_DIR") or HERE


def resolve(file):
    """(path, name) of FILE, a name of UPSTREAM_FILES or a path."""
    if os.sep in file or file.endswith(".py"):
        path = os.path.abspath(file)
    else:
        path = os.path.join(upstream_dir(), file + ".py")
    return path, os.path.splitext(os.path.basename(path))[0]


def missing(name):
    """Why the pinned version of ``name`` cannot run here, or None."""
    import hashlib
    path, _ = resolve(name)
    pin = UPSTREAM_FILES[name]
    where = f"{pin['repo']} {pin['path']} at {pin['commit']}"
    if not os.path.exists(path):
        return f"{path} is not here: place {where} there (tests/upstream/README.md)"
    with open(path, "rb") as f:
        if hashlib.sha256(f.read()).hexdigest() != pin["sha256"]:
            return f"{path} is not the pinned version ({where}, sha256 {pin['sha256']})"
    return None


def read_report(xml_path, name):
    """{test id: {"status": passed|failed|skipped, "type", "message"}}."""
    results = {}
    for case in ElementTree.parse(xml_path).getroot().iter("testcase"):
        if case.get("name") == "test_session":
            continue  # tf.test.TestCase's, reported as skipped: "Not a test."
        test_id = f"{name}.{case.get('classname').rsplit('.', 1)[-1]}.{case.get('name')}"
        bad = [e for e in case if e.tag in ("failure", "error")]
        if bad:
            exc_type = re.sub(r"^<class '(?:[\w.]*\.)?(\w+)'>$", r"\1", bad[0].get("type") or "")
            results[test_id] = {"status": "failed", "type": exc_type,
                                "message": bad[0].get("message") or "",
                                "traceback": bad[0].text or ""}
        elif case.get("result") == "suppressed":
            results[test_id] = {"status": "skipped"}
        else:
            results[test_id] = {"status": "passed"}
    return results


def _stop(proc):
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


def run_file(file, vanilla=False, timeout=600, log=None, filters=None):
    """Runs one file in a fresh process; returns (results, seconds, output).
    ``filters``: unittest -k patterns (default: the file's own, if any)."""
    path, name = resolve(file)
    if name in UPSTREAM_FILES and missing(name):
        raise FileNotFoundError(missing(name))
    # MultiProcessRunner's forkserver listens on a Unix socket under TMPDIR,
    # whose path must stay under 108 bytes: a deep TMPDIR (the suite's
    # per-test one) gives way to the system's.
    base = tempfile.gettempdir()
    tmp = tempfile.mkdtemp(prefix="asyncps-up-",
                           dir=base if len(base) < 40 else "/tmp")
    try:
        xml_out = os.path.join(tmp, "report.xml")
        os.mkdir(os.path.join(tmp, "test"))
        env = dict(os.environ)
        env.update({"ASYNCPS_UPSTREAM_CHILD": "1", VANILLA_ENV: "1" if vanilla else "0",
                    # TensorFlow's get_temp_dir() makes mkdtemp(prefix=TEST_TMPDIR):
                    # a sibling of TEST_TMPDIR, here inside tmp.
                    "TMPDIR": tmp, "TEST_TMPDIR": os.path.join(tmp, "test"),
                    "PYTHONPATH": os.pathsep.join([ROOT, HERE, env.get("PYTHONPATH", "")]),
                    "CUDA_VISIBLE_DEVICES": env.get("ASYNCPS_TEST_CUDA_VISIBLE_DEVICES", ""),
                    "TF_USE_LEGACY_KERAS": "1"})
        env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        env.setdefault("PYTHONFAULTHANDLER", "1")
        args = [sys.executable, os.path.abspath(__file__), "--child", path, xml_out,
                json.dumps(filters or UPSTREAM_FILES.get(name, {}).get("filters"))]
        output = os.path.join(tmp, "output.log")
        start = time.monotonic()
        with open(output, "w") as sink:
            proc = subprocess.Popen(args, stdout=sink, stderr=subprocess.STDOUT, env=env,
                                    cwd=tmp, start_new_session=True)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
        finally:
            timed_out = proc.poll() is None
            _stop(proc)
        seconds = time.monotonic() - start
        with open(output, errors="replace") as f:
            out = f.read()
        if log:
            with open(log, "a") as f:
                f.write(out)
        if timed_out:
            raise TimeoutError(f"{name} ran past {timeout} s; output tail:\n{out[-6000:]}")
        if not os.path.exists(xml_out) or not os.path.getsize(xml_out):
            raise RuntimeError(f"{name} wrote no report (exit {proc.returncode}); output "
                               f"tail:\n{out[-6000:]}")
        return read_report(xml_out, name), seconds, out
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def check(results):
    """The ways ``results`` (ours) break the promise: a list of lines. Each
    file must run VANILLA's number of tests and skip only those vanilla
    skips; every other test passes, but for ACCEPTED's, which fail as
    written there."""
    problems = []
    for name in sorted({t.split(".")[0] for t in results}):
        ran = [t for t in results if t.split(".")[0] == name]
        want = VANILLA.get(name)
        if want and want["tests"] is not None and len(ran) != want["tests"]:
            problems.append(f"{name}: {len(ran)} tests ran, vanilla runs {want['tests']}")
        problems += [f"{t}: in ACCEPTED but not run" for t in ACCEPTED
                     if t.split(".")[0] == name and t not in results]
    for test_id, r in sorted(results.items()):
        accepted = ACCEPTED.get(test_id)
        if r["status"] == "skipped":
            if test_id not in VANILLA_SKIPPED and not GPU_ONLY.search(test_id):
                problems.append(f"{test_id} skipped; vanilla runs it")
        elif accepted is None:
            if r["status"] == "failed":
                problems.append(f"{test_id} failed: {r['type']}: {r['message']}\n"
                                f"{r['traceback']}")
        elif r["status"] != "failed":
            problems.append(f"{test_id} {r['status']}: it is in ACCEPTED ({accepted[2]}); "
                            "take it out of the list")
        elif r["type"] != accepted[0] or not re.search(accepted[1], r["message"]):
            problems.append(f"{test_id} failed other than ACCEPTED says ({accepted[0]} "
                            f"matching {accepted[1]!r}): {r['type']}: {r['message']}")
    return problems


def long_file_marks(minutes, timeout):
    """``pytestmark`` of a file too long for the suite's 20 minutes (a
    MultiProcessRunner cluster and TensorFlow's 3 s waits per test): it runs
    only with ASYNCPS_UPSTREAM_LONG=1."""
    import pytest
    return [pytest.mark.cluster, pytest.mark.timeout(timeout), pytest.mark.skipif(
        os.environ.get("ASYNCPS_UPSTREAM_LONG") != "1",
        reason=f"about {minutes} min on 2 cores: ASYNCPS_UPSTREAM_LONG=1 runs it "
               "(tests/upstream/README.md)")]


def pytest_check(name, timeout):
    """The test of the suite's tests/test_upstream_*.py: runs ``name`` with the
    class swapped and fails on any problem of :func:`check`; skips, saying
    why, where the pinned file is not here."""
    import pytest
    why = missing(name)
    if why:
        pytest.skip(why)
    try:
        import dill  # noqa: F401  MultiProcessRunner skips every test without it
    except ImportError:
        pytest.fail("TensorFlow's MultiProcessRunner needs dill (the test extra)")
    results, seconds, _ = run_file(name, timeout=timeout)
    problems = check(results)
    assert not problems, (f"{name} ({counts(results)}, {seconds:.0f} s):\n"
                          + "\n".join(problems))


def counts(results):
    c = {"passed": 0, "failed": 0, "skipped": 0}
    for r in results.values():
        c[r["status"]] += 1
    return c


def main(argv=None):
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["--child"]:
        _child(argv[1], argv[2], json.loads(argv[3]))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="*", default=list(UPSTREAM_FILES))
    parser.add_argument("--vanilla", action="store_true",
                        help="run the files as published (no swap)")
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--json", help="write every result here")
    parser.add_argument("--log", help="append each run's output here")
    parser.add_argument("-k", action="append", dest="filters",
                        help="run the tests whose id holds this (unittest -k)")
    args = parser.parse_args(argv)
    everything, ok = {}, True
    for file in args.files:
        results, seconds, _ = run_file(file, args.vanilla, args.timeout, args.log,
                                       args.filters)
        everything.update(results)
        failed = sorted(t for t, r in results.items() if r["status"] == "failed")
        print(f"{file}: {counts(results)} in {seconds:.0f} s"
              + "".join(f"\n  failed: {t}: {results[t]['type']}: "
                        f"{results[t]['message'][:300]}" for t in failed), flush=True)
        if not args.vanilla:
            problems = check(results)
            ok = ok and not problems
            for p in problems:
                print("PROBLEM: " + p, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(everything, f, indent=1, sort_keys=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
