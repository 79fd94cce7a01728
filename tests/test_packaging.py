"""Packaging: one version, the supported ranges, the import-time version
check, ``tf-asyncps --version``, and a built wheel run from outside the repo."""

import json
import os
import subprocess
import sys
import tomllib

import pytest

from conftest import ROOT, run_command
from tf_asyncps.compat import versions


def _pyproject():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)


def _requirement(name):
    deps = _pyproject()["project"]["dependencies"]
    return next(d for d in deps if d.split(">")[0].split("<")[0].split("~")[0] == name)


def test_the_version_lives_in_one_place():
    import tf_asyncps
    meta = _pyproject()
    assert "version" not in meta["project"] and meta["project"]["dynamic"] == ["version"]
    assert meta["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "tf_asyncps.__version__"}
    assert tf_asyncps.__version__.count(".") == 2
    assert not os.path.exists(os.path.join(ROOT, "setup.py"))


def test_pyproject_states_the_ranges_the_import_check_enforces():
    assert _requirement("tensorflow") == "tensorflow>=2.18,<2.22"
    assert _requirement("tf_keras") == "tf_keras>=2.18,<2.22"
    assert versions.TENSORFLOW == ((2, 18), (2, 22))
    (lo_a, lo_b), (hi_a, hi_b) = versions.KERAS3
    assert _requirement("keras") == f"keras>={lo_a}.{lo_b},<{hi_a}.{hi_b}"
    gpu = _pyproject()["project"]["optional-dependencies"]["gpu"]
    assert gpu == ["tensorflow[and-cuda]>=2.18,<2.22"]


@pytest.mark.parametrize("tf, tf_keras", [("2.18.0", "2.18.0"), ("2.18.1", None),
                                          ("2.21.0", "2.21.0"), ("2.19.1", "2.19.0")])
def test_supported_versions_pass(tf, tf_keras):
    assert versions.unsupported(tf, tf_keras) is None


@pytest.mark.parametrize("tf", ["2.15.1", "2.17.1", "2.22.0", "3.0.0", "nightly"])
def test_an_unsupported_tensorflow_gets_the_range_and_the_install_command(tf):
    assert versions.unsupported(tf, None) == (
        f"tf_asyncps supports TensorFlow >=2.18,<2.22 (2.18 through 2.21); found TensorFlow "
        f"{tf}. Install a supported one with its "
        f"tf_keras: pip install \"tensorflow>=2.18,<2.22\" \"tf_keras>=2.18,<2.22\" (or set "
        f"TF_ASYNCPS_SKIP_VERSION_CHECK=1 to try this one anyway).")


def test_a_tf_keras_of_another_minor_gets_the_matching_install_command():
    assert versions.unsupported("2.18.1", "2.21.0") == (
        "tf_asyncps needs the tf_keras of TensorFlow's minor: found TensorFlow 2.18.1 with "
        "tf_keras 2.21.0. Install the matching one: pip install \"tf_keras~=2.18.0\" (or set "
        "TF_ASYNCPS_SKIP_VERSION_CHECK=1 to try anyway).")


# Imports tf_asyncps with package metadata that reports TensorFlow 2.15.1.
_FAKE_OLD_TF = """
import sys
from importlib import metadata
real = metadata.version
metadata.version = lambda name: "2.15.1" if name == "tensorflow" else real(name)
try:
    import tf_asyncps
except ImportError as e:
    print("IMPORT ERROR:", e)
else:
    print("IMPORTED", "tensorflow" in sys.modules)
"""


@pytest.mark.parametrize("skip, expected", [
    ("", "IMPORT ERROR: tf_asyncps supports TensorFlow >=2.18,<2.22 (2.18 through 2.21); "
         "found TensorFlow 2.15.1."),
    ("1", "IMPORTED False"),
])
def test_importing_with_an_unsupported_tensorflow_fails_at_import(skip, expected):
    env = dict(os.environ, PYTHONPATH=ROOT, TF_ASYNCPS_SKIP_VERSION_CHECK=skip)
    out = subprocess.run([sys.executable, "-c", _FAKE_OLD_TF], capture_output=True, text=True,
                         timeout=60, env=env, cwd=ROOT)
    assert out.stdout.strip().startswith(expected), out.stdout + out.stderr[-2000:]


def test_every_root_name_resolves_from_a_plain_import(fresh_process_facts):
    # docs/guides/failures.md writes tf_asyncps.export.DeltaPublisher after
    # `import tf_asyncps`; the root's lazy map had no "export". In a fresh
    # process, tf_asyncps's modules dropped first (tests/fresh_process.py, step 3).
    facts, _ = fresh_process_facts
    assert facts["plain_import"] == {"export.DeltaPublisher": "DeltaPublisher", "none": []}


def test_version_flag_prints_the_versions_without_importing_tensorflow():
    import keras
    import tensorflow as tf
    import tf_keras

    import tf_asyncps
    out = subprocess.run([sys.executable, "-c", "import sys\n"
                          "sys.argv = ['tf-asyncps', '--version']\n"
                          "from tf_asyncps.app import cli\n"
                          "try:\n    cli.run()\nexcept SystemExit as e:\n    code = e.code\n"
                          "print('tensorflow imported:', 'tensorflow' in sys.modules, code)"],
                         capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, PYTHONPATH=ROOT), cwd=ROOT)
    (lo_a, lo_b), (hi_a, hi_b) = versions.KERAS3
    assert out.stdout.splitlines() == [
        f"tf-asyncps {tf_asyncps.__version__} (TensorFlow {tf.__version__}, tf_keras "
        f"{tf_keras.__version__}, Keras {keras.__version__}; supported: TensorFlow "
        f">=2.18,<2.22 with its tf_keras, Keras 3 >={lo_a}.{lo_b},<{hi_a}.{hi_b})",
        "tensorflow imported: False None"], out.stderr[-2000:]


@pytest.mark.cluster
@pytest.mark.timeout(600)
def test_a_built_wheel_installs_and_runs_the_main_job_outside_the_repo(tmp_path):
    """Builds the wheel (no network: the installed setuptools), installs it
    without dependencies into a folder of its own, and runs ``tf-asyncps
    --version`` and a short main job from a directory outside the repo, with
    the repo off the path: the wheel alone carries the package, its console
    script and its version."""
    import tf_asyncps
    dist, target, work = tmp_path / "dist", tmp_path / "site", tmp_path / "elsewhere"
    work.mkdir()
    run_command([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                 "-q", "-w", str(dist), ROOT], timeout=300)
    wheels = sorted(p.name for p in dist.iterdir())
    assert wheels == [f"tf_asyncps-{tf_asyncps.__version__}-py3-none-any.whl"]
    run_command([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target",
                 str(target), str(dist / wheels[0])], timeout=300)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PYTHONPATH=str(target), TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="")
    script = str(target / "bin" / "tf-asyncps")

    def run(args, timeout):
        out = subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=env,
                             cwd=str(work))
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
        return out.stdout

    where = run([sys.executable, "-c", "import tf_asyncps; print(tf_asyncps.__file__)"], 60)
    assert where.strip() == str(target / "tf_asyncps" / "__init__.py")
    assert run([script, "--version"], 60).startswith(f"tf-asyncps {tf_asyncps.__version__} (")
    # The main job (configs/digits_async.flags is these defaults), one epoch.
    run([script, "launch", "--output_dir=out", "--epochs=1"], 480)
    with open(work / "out" / "metrics.json") as f:
        metrics = json.load(f)
    assert (metrics["policy"], metrics["num_workers"], metrics["worker_steps"]) == \
        ("async", 2, 100)
    assert metrics["test_accuracy"] > 0.5
