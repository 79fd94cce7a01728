"""The house rules: private TensorFlow/Keras APIs only in compat/, no import
circles, no file over 600 lines, and every module importable first."""

import ast
import json
import os
import re
import subprocess
import sys

import pytest

from conftest import ROOT

PKG = os.path.join(ROOT, "tf_asyncps")
PRIVATE = re.compile(r"^(tensorflow\.(python|core)|tf_keras\.src|keras\.src)(\.|$)")


def _modules():
    """{module name: path} of every module of the package."""
    out = {}
    for d, _, files in os.walk(PKG):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(d, f)
                rel = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                out[rel[:-len(".__init__")] if rel.endswith(".__init__") else rel] = path
    return out


def _imports(path, module, modules=()):
    """(line, imported module) of every import in ``path``, at any depth.
    ``from pkg import sub`` names the module ``pkg.sub`` when it is one of
    ``modules`` (it then does not depend on what pkg's __init__ defines)."""
    tree = ast.parse(open(path).read(), path)
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield node.lineno, a.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in modules]
            if len(subs) < len(node.names):
                yield node.lineno, base
            for sub in subs:
                yield node.lineno, sub


def test_private_tensorflow_and_keras_imports_live_in_compat_only():
    leaks = [f"{os.path.relpath(path, ROOT)}:{line} imports {name}"
             for module, path in _modules().items() if ".compat" not in module
             for line, name in _imports(path, module) if PRIVATE.match(name)]
    assert leaks == []


def test_the_package_has_no_import_circles():
    modules = _modules()
    # Imports at any depth count (one inside a function is still an arrow).
    # Importing "a.b.c" from outside package "a.b" runs a/b/__init__.py first.
    graph = {}
    for m, path in modules.items():
        deps = set()
        for _, n in _imports(path, m, modules):
            parts = n.split(".")
            for i in range(2, len(parts) + 1):
                d = ".".join(parts[:i])
                if d in modules and d != m and (i == len(parts) or not m.startswith(d + ".")):
                    deps.add(d)
        graph[m] = sorted(deps)
    circles, state = [], {}

    def visit(m, path):
        state[m] = "open"
        for n in graph[m]:
            if state.get(n) == "open":
                circles.append(path[path.index(n):] + [n])
            elif n not in state:
                visit(n, path + [n])
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert circles == []


def test_no_file_is_over_600_lines():
    long = {os.path.relpath(p, ROOT): n for p in _modules().values()
            if (n := sum(1 for _ in open(p))) > 600}
    assert long == {}


_FIRST_TOUCH = r"""
import importlib, json, sys
names, attrs = json.loads(sys.argv[1]), json.loads(sys.argv[2])
failed = {}
def fresh():
    for m in [m for m in sys.modules if m == "tf_asyncps" or m.startswith("tf_asyncps.")]:
        del sys.modules[m]
for name in names:
    fresh()
    try:
        importlib.import_module(name)
    except Exception as e:
        failed[name] = f"{type(e).__name__}: {e}"
for attr in attrs:
    fresh()
    try:
        getattr(importlib.import_module("tf_asyncps"), attr)
    except Exception as e:
        failed["tf_asyncps." + attr] = f"{type(e).__name__}: {e}"
print("FAILED " + json.dumps(failed))
"""


def test_every_module_and_root_name_imports_first_in_a_fresh_package():
    """Each module (and each lazy name of the root, e.g. SyncReplicasAggregator)
    is the first tf_asyncps import of a fresh package state: an import circle
    shows up as 'partially initialized module'."""
    import tf_asyncps
    names = sorted(m for m in _modules() if not m.endswith(("__main__", "deathsig_shim")))
    attrs = [a for a in tf_asyncps.__all__ if a != "__version__"]
    env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="3", CUDA_VISIBLE_DEVICES="")
    out = subprocess.run([sys.executable, "-c", _FIRST_TOUCH, json.dumps(names), json.dumps(attrs)],
                         capture_output=True, text=True, timeout=240, env=env, cwd=ROOT)
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("FAILED ")]
    assert line, out.stderr[-3000:]
    assert json.loads(line[-1][len("FAILED "):]) == {}
    assert len(names) > 40 and "tf_asyncps.policies.sync_replicas" in names


@pytest.mark.parametrize("module", ["tf_asyncps.cluster.config", "tf_asyncps.app.cli",
                                    "tf_asyncps.compat.tensorflow"])
def test_tools_import_without_tensorflow(module):
    code = f"import sys, {module}; print('tensorflow' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, env=dict(os.environ, PYTHONPATH=ROOT), cwd=ROOT)
    assert out.stdout.strip() == "False", out.stderr[-2000:]
