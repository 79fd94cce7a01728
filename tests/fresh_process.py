"""One fresh Python process for the tests that need one to import the
package (test_architecture, test_packaging): started once per session, it
reports several facts, each test asserting its own.

In order, in the one process:

1. each module of :data:`TOOLS` imported alone (the tf_asyncps modules
   dropped before each): whether TensorFlow came with it;
2. a plain ``import tf_asyncps`` (TensorFlow not imported yet, tf_asyncps
   modules dropped), then every root name: ``export.DeltaPublisher``'s name
   and the root names that resolve to None;
3. each module of the package, then each lazy root name, as the first
   tf_asyncps import of a fresh package state (all tf_asyncps modules
   dropped; TensorFlow and Keras stay loaded): the ones that raised.
"""

import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT

#: Modules a command-line tool imports before it needs TensorFlow.
TOOLS = ["tf_asyncps.cluster.config", "tf_asyncps.app.cli", "tf_asyncps.compat.startup"]

_SCRIPT = r"""
import importlib, importlib.machinery, json, os, sys
tools, names, attrs = (json.loads(a) for a in sys.argv[1:4])
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
facts = {"tensorflow_imported": {}, "plain_import": None, "failed": {}}
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
fresh()
try:
    root = importlib.import_module("tf_asyncps")
    facts["plain_import"] = {
        "tensorflow_before": "tensorflow" in sys.modules,
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


@pytest.fixture(scope="session")
def fresh_process_facts():
    """``(facts, names)``: the facts the process reports (the module's
    docstring; a dict: ``tensorflow_imported`` {tool: bool}, ``plain_import``
    {...}, ``failed`` {module or root name: error}) and the modules it imported
    first in step 3."""
    import tf_asyncps
    names = sorted(m for m in package_modules() if not m.endswith(("__main__", "deathsig_shim")))
    attrs = [a for a in tf_asyncps.__all__ if a != "__version__"]
    env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="3", CUDA_VISIBLE_DEVICES="")
    out = subprocess.run([sys.executable, "-c", _SCRIPT, json.dumps(TOOLS), json.dumps(names),
                          json.dumps(attrs)],
                         capture_output=True, text=True, timeout=240, env=env, cwd=ROOT)
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("FACTS ")]
    assert line, out.stderr[-3000:]
    return json.loads(line[-1][len("FACTS "):]), names
