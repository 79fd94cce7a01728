"""One fresh Python process for the tests that need one to import the
package (test_architecture, test_packaging, test_dynamic_embedding): started
once per session, it reports several facts, each test asserting its own.

In order, in the one process:

1. each module of :data:`TOOLS` imported alone (the tf_asyncps modules
   dropped before each): whether TensorFlow came with it;
2. ``import tf_keras``, then ``import tf_asyncps``, then a .keras file of
   test_dynamic_embedding's trained DynamicEmbedding model (saved by this
   session) loaded with tf_keras: its predictions for :data:`KERAS_FILE_IDS`
   (no tf_asyncps layer was imported before: the root's import registers it);
3. a plain ``import tf_asyncps`` (tf_asyncps modules dropped), then every
   root name: ``export.DeltaPublisher``'s name and the root names that
   resolve to None;
4. each module of the package, then each lazy root name, as the first
   tf_asyncps import of a fresh package state (all tf_asyncps modules
   dropped; TensorFlow and Keras stay loaded): the ones that raised.
"""

import json
import os
import subprocess
import sys
import tempfile

import pytest

from conftest import ROOT

#: Modules a command-line tool imports before it needs TensorFlow.
TOOLS = ["tf_asyncps.cluster.config", "tf_asyncps.app.cli", "tf_asyncps.compat.startup"]
#: The ids the .keras file's model predicts for, here and in the process.
KERAS_FILE_IDS = [[5, 6, 7], [5, 9, 9]]

_SCRIPT = r"""
import importlib, importlib.machinery, json, os, sys
tools, names, attrs, keras_file = (json.loads(a) for a in sys.argv[1:5])
# Each fresh state re-runs the package's modules: each is compiled once, its
# code kept here (this machine sets PYTHONDONTWRITEBYTECODE), not from source
# in every round. Other libraries load from their own bytecode as usual.
package, codes = os.path.join(os.getcwd(), "tf_asyncps") + os.sep, {}
get_code = importlib.machinery.SourceFileLoader.get_code
def compiled_once(loader, fullname):
    path = loader.get_filename(fullname)
    if not path.startswith(package):
        return get_code(loader, fullname)
    if path not in codes:
        codes[path] = get_code(loader, fullname)
    return codes[path]
importlib.machinery.SourceFileLoader.get_code = compiled_once
facts = {"tensorflow_imported": {}, "keras_file": None, "plain_import": None, "failed": {}}
def fresh():
    for m in [m for m in sys.modules if m == "tf_asyncps" or m.startswith("tf_asyncps.")]:
        del sys.modules[m]
for name in tools:
    if "tensorflow" in sys.modules:  # by an earlier tool: this one can't tell
        facts["tensorflow_imported"][name] = "not judged: imported before"
        continue
    fresh()
    try:
        importlib.import_module(name)
    except Exception as e:
        facts["tensorflow_imported"][name] = f"raised {type(e).__name__}: {e}"
    else:
        facts["tensorflow_imported"][name] = "tensorflow" in sys.modules
if keras_file is not None:
    fresh()
    try:
        import numpy as np, tf_keras
        importlib.import_module("tf_asyncps")
        model = tf_keras.models.load_model(keras_file["path"])
        facts["keras_file"] = model.predict(np.array(keras_file["ids"]), verbose=0).tolist()
    except Exception as e:
        facts["keras_file"] = f"raised {type(e).__name__}: {e}"
fresh()
try:
    root = importlib.import_module("tf_asyncps")
    facts["plain_import"] = {
        "export.DeltaPublisher": root.export.DeltaPublisher.__name__,
        "none": sorted(n for n in root.__all__ if getattr(root, n) is None)}
except Exception as e:
    facts["plain_import"] = f"raised {type(e).__name__}: {e}"
for name in names:
    fresh()
    try:
        importlib.import_module(name)
    except Exception as e:
        facts["failed"][name] = f"{type(e).__name__}: {e}"
for attr in attrs:
    fresh()
    try:
        getattr(importlib.import_module("tf_asyncps"), attr)
    except Exception as e:
        facts["failed"]["tf_asyncps." + attr] = f"{type(e).__name__}: {e}"
print("FACTS " + json.dumps(facts))
"""


def package_modules():
    """{module name: path} of every module of the package."""
    out = {}
    for d, _, files in os.walk(os.path.join(ROOT, "tf_asyncps")):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(d, f)
                rel = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                out[rel[:-len(".__init__")] if rel.endswith(".__init__") else rel] = path
    return out


def _keras_file(folder):
    """``({"path", "ids"}, predictions)``: test_dynamic_embedding's trained
    tf_keras model with a DynamicEmbedding saved as ``folder``/m.keras, and
    its predictions here for :data:`KERAS_FILE_IDS` (or ``(None, error)``)."""
    try:
        import numpy as np
        from test_dynamic_embedding import _trained_tf_keras_model
        model = _trained_tf_keras_model()
        path = os.path.join(folder, "m.keras")
        model.save(path)
        return ({"path": path, "ids": KERAS_FILE_IDS},
                model.predict(np.array(KERAS_FILE_IDS, np.int64), verbose=0).tolist())
    except Exception as e:  # the other facts still come
        return None, f"raised {type(e).__name__}: {e}"


@pytest.fixture(scope="session")
def fresh_process_facts():
    """``(facts, names)``: the facts the process reports (the module's
    docstring; a dict: ``tensorflow_imported`` {tool: bool}, ``keras_file``
    (predictions there), ``keras_file_here`` (predictions in this process),
    ``plain_import`` {...}, ``failed`` {module or root name: error}) and the
    modules it imported first in step 4."""
    import tf_asyncps
    names = sorted(m for m in package_modules() if not m.endswith(("__main__", "deathsig_shim")))
    attrs = [a for a in tf_asyncps.__all__ if a != "__version__"]
    env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="3", CUDA_VISIBLE_DEVICES="")
    with tempfile.TemporaryDirectory() as folder:
        keras_file, here = _keras_file(folder)
        out = subprocess.run([sys.executable, "-c", _SCRIPT, json.dumps(TOOLS), json.dumps(names),
                              json.dumps(attrs), json.dumps(keras_file)],
                             capture_output=True, text=True, timeout=240, env=env, cwd=ROOT)
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("FACTS ")]
    assert line, out.stderr[-3000:]
    facts = json.loads(line[-1][len("FACTS "):])
    facts["keras_file_here"] = here
    return facts, names
