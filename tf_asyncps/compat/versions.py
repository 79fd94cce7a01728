"""The TensorFlow, tf_keras and Keras 3 releases tf_asyncps supports.

``import tf_asyncps`` calls :func:`check`: a TensorFlow outside
:data:`TENSORFLOW` (or a tf_keras of another minor than TensorFlow's) raises
an ImportError naming the supported range and the install command, before
anything fails deep inside a private API. Versions are read from the
installed packages' metadata, so the check imports neither TensorFlow nor
Keras (``tf-asyncps --help`` stays fast). Keras 3 is checked where it is used
(``tf_asyncps/keras3``: :data:`KERAS3`), as a
tf_keras user does not need it.

What differs between the supported TensorFlow minors lives in the other
``compat`` modules, each difference named with the versions it covers;
:data:`TESTED` lists the releases the version matrix (``scripts/matrix.sh``)
ran. ``pyproject.toml`` states the same ranges (tests/test_packaging.py keeps
them equal).
"""

import os
import sys

__all__ = ["TENSORFLOW", "TENSORFLOW_TESTED", "KERAS3", "KERAS3_TESTED", "TESTED", "SKIP_ENV",
           "installed", "unsupported", "check", "describe", "keras3_version", "keras3_supported"]

#: TensorFlow releases supported, as ``[low, high)`` (major, minor) bounds.
#: tf_keras follows TensorFlow's minor (each tf_keras release pins one).
#: Below 2.18 a partitioned model's BackupAndRestore does not resume exactly
#: (tests/test_sharded.py; the runs: docs/guides/compatibility.md): a silent
#: loss on resume, so 2.16 and 2.17 are refused (TF_ASYNCPS_SKIP_VERSION_CHECK=1
#: runs them anyway).
TENSORFLOW = ((2, 18), (2, 22))

#: The TensorFlow releases the private TensorFlow APIs of the ``compat`` modules
#: were run against (nothing they use differs between them).
TENSORFLOW_TESTED = ("2.18.1", "2.19.1", "2.20.0", "2.21.0")

# tests/test_keras3.py passed whole on each (TensorFlow 2.21.0).
KERAS3_TESTED = ("3.10.0", "3.12.4", "3.15.1")
# Keras 3 changed the fit loop's iteration protocol in 3.7 and 3.11 and
# _symbolic_build's arguments in 3.5 (docs/design.md#9-keras-3-on-parameter-servers): only releases this
# module was run against are accepted. Below 3.10: Keras 3.5.0 fails
# tests/test_keras3.py (mixed_float16 loss scaling counts 0 of 60 steps, two
# replicas differ from one process by 0.08); 3.6-3.9 were not run whole.
# 3.10-3.13: get_metrics_result() sorts its keys (metrics_in_order).
KERAS3 = ((3, 10), (3, 16))  # [3.10, 3.16)

#: TensorFlow minor -> (TensorFlow, tf_keras, Keras) releases the matrix ran.
TESTED = {
    "2.18": ("2.18.1", "2.18.0", "3.15.1"),
    "2.19": ("2.19.1", "2.19.0", "3.15.1"),
    "2.20": ("2.20.0", "2.20.1", "3.15.1"),
    "2.21": ("2.21.0", "2.21.0", "3.15.1"),
}

#: Set to 1 to import with another TensorFlow anyway (e.g. to try a nightly).
SKIP_ENV = "TF_ASYNCPS_SKIP_VERSION_CHECK"

# Distributions that install the ``tensorflow`` module (the first one found is used).
_TF_DISTRIBUTIONS = ("tensorflow", "tensorflow-cpu", "tensorflow-intel", "tensorflow-macos",
                     "tensorflow-aarch64", "tf-nightly", "tf-nightly-cpu")


def _metadata_version(names):
    from importlib import metadata
    for name in names:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def installed():
    """The installed versions, read without importing the libraries.

    Returns:
      A dict with ``tensorflow``, ``tf_keras`` and ``keras`` version strings
      (None where not installed). An already imported TensorFlow reports its
      own ``__version__``.
    """
    tf = sys.modules.get("tensorflow")
    tf_version = getattr(tf, "__version__", None) or _metadata_version(_TF_DISTRIBUTIONS)
    return {"tensorflow": tf_version, "tf_keras": _metadata_version(("tf_keras", "tf-keras")),
            "keras": _metadata_version(("keras",))}


def _major_minor(version):
    try:
        return tuple(int(p) for p in str(version).split(".")[:2])
    except ValueError:
        return None


def _range_text(bounds):
    (lo_major, lo_minor), (hi_major, hi_minor) = bounds
    return f">={lo_major}.{lo_minor},<{hi_major}.{hi_minor}"


def unsupported(tensorflow, tf_keras=None):
    """Why these installed versions cannot run tf_asyncps, or None.

    Args:
      tensorflow: TensorFlow's version string (None: not installed, not checked).
      tf_keras: tf_keras's version string (None: not installed, not checked).

    Returns:
      A message naming the supported range and the pip command that installs
      it, or None when the versions are supported.
    """
    spec = _range_text(TENSORFLOW)
    tf_mm = _major_minor(tensorflow) if tensorflow else None
    if tensorflow and (tf_mm is None or not TENSORFLOW[0] <= tf_mm < TENSORFLOW[1]):
        (lo_a, lo_b), (hi_a, hi_b) = TENSORFLOW
        return (f"tf_asyncps supports TensorFlow {spec} ({lo_a}.{lo_b} through {hi_a}."
                f"{hi_b - 1}); found TensorFlow {tensorflow}. Install a "
                f"supported one with its tf_keras: pip install \"tensorflow{spec}\" "
                f"\"tf_keras{spec}\" (or set {SKIP_ENV}=1 to try this one anyway).")
    if tensorflow and tf_keras and _major_minor(tf_keras) != tf_mm:
        minor = f"{tf_mm[0]}.{tf_mm[1]}"
        return (f"tf_asyncps needs the tf_keras of TensorFlow's minor: found TensorFlow "
                f"{tensorflow} with tf_keras {tf_keras}. Install the matching one: "
                f"pip install \"tf_keras~={minor}.0\" (or set {SKIP_ENV}=1 to try anyway).")
    return None


def check():
    """Raises ImportError when the installed TensorFlow/tf_keras is unsupported
    (:func:`unsupported`); nothing when ``TF_ASYNCPS_SKIP_VERSION_CHECK=1``."""
    if os.environ.get(SKIP_ENV) == "1":
        return
    v = installed()
    message = unsupported(v["tensorflow"], v["tf_keras"])
    if message:
        raise ImportError(message)


def describe(version):
    """One line for ``tf-asyncps --version``: tf_asyncps's ``version``, the
    installed TensorFlow/tf_keras/Keras and the supported ranges."""
    v = installed()
    found = ", ".join(f"{name} {v[key] or 'not installed'}" for name, key in
                      (("TensorFlow", "tensorflow"), ("tf_keras", "tf_keras"), ("Keras", "keras")))
    return (f"tf-asyncps {version} ({found}; supported: TensorFlow {_range_text(TENSORFLOW)} "
            f"with its tf_keras, Keras 3 {_range_text(KERAS3)})")


def keras3_version():
    """The installed Keras version string, or None without Keras 3."""
    try:
        import keras
    except ImportError:  # pragma: no cover
        return None
    v = getattr(keras, "__version__", "")
    return v if v.startswith("3") else None


def keras3_supported(v) -> bool:
    """Whether Keras version string ``v`` lies in :data:`KERAS3`."""
    try:
        major_minor = tuple(int(p) for p in str(v).split(".")[:2])
    except ValueError:
        return False
    lo, hi = KERAS3
    return lo <= major_minor < hi
