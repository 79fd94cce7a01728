"""The docs site (mkdocs.yml, docs/) builds with `mkdocs build --strict`: no
warning (broken links or anchors, pages left out of the nav, docstrings the
API reference cannot read), without importing TensorFlow (the API reference is
read from the source by griffe), and its API reference documents every name
the package root exports."""

import ast
import json
import os
import re
import sys

import pytest

from conftest import ROOT, run_command

sys.path.insert(0, os.path.join(ROOT, "scripts"))
try:
    import docs_hooks  # noqa: E402 (imports griffe, of mkdocstrings)
except ImportError:  # _docs_tools fails every test here with the install command
    docs_hooks = None

# Runs `mkdocs build --strict` in this interpreter and reports, at exit, whether
# the build imported TensorFlow.
_BUILD = """
import atexit, json, runpy, sys
atexit.register(lambda: print("IMPORTED " + json.dumps(
    sorted(m for m in ("tensorflow", "tf_keras", "keras") if m in sys.modules))))
sys.argv = ["mkdocs", "build", "--strict", "--site-dir", sys.argv[1]]
runpy.run_module("mkdocs", run_name="__main__")
"""


@pytest.fixture(scope="module", autouse=True)
def _docs_tools():
    for module in ("mkdocs", "material", "mkdocstrings_handlers.python", "griffe"):
        try:
            __import__(module)
        except ImportError:
            pytest.fail(f"{module} is missing: the docs build needs the test extra "
                        "(pip install -e \".[test]\").")


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    out_dir = str(tmp_path_factory.mktemp("site"))
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    env.pop("PYTHONPATH", None)  # mkdocs.yml's `paths: [.]` finds the package
    rc, out = run_command([sys.executable, "-c", _BUILD, out_dir], timeout=110, env=env,
                          check=False)
    return rc, out, out_dir


def test_mkdocs_build_strict_has_no_warning(site):
    rc, out, _ = site
    warnings = [line for line in out.splitlines() if re.match(r"(WARNING|ERROR)\b", line)]
    assert rc == 0 and not warnings, out[-6000:]


def test_the_docs_build_imports_no_tensorflow(site):
    rc, out, _ = site
    imported = [line for line in out.splitlines() if line.startswith("IMPORTED ")]
    assert rc == 0 and imported, out[-6000:]
    assert json.loads(imported[-1][len("IMPORTED "):]) == []


def _all_of(module_path):
    """The literal ``__all__`` of a module's source."""
    with open(module_path) as f:
        tree = ast.parse(f.read())
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "__all__":
            return ast.literal_eval(node.value)
    raise AssertionError(f"{module_path} has no literal __all__")


def _lazy_of(module_path):
    """The literal ``_LAZY`` table (name -> defining module) of a package
    whose names load on first use (tf_asyncps.callbacks), else {}."""
    with open(module_path) as f:
        tree = ast.parse(f.read())
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "_LAZY":
            return ast.literal_eval(node.value)
    return {}


def _module_file(dotted):
    base = os.path.join(ROOT, *dotted.split("."))
    return base + ".py" if os.path.isfile(base + ".py") else os.path.join(base, "__init__.py")


def test_the_api_reference_documents_every_public_name(site):
    """Every root export and every name in `__all__` of the subpackages it
    exports has its heading (an HTML id) in the built API reference."""
    rc, out, out_dir = site
    assert rc == 0, out[-6000:]
    html = ""
    for dirpath, _, files in os.walk(os.path.join(out_dir, "api")):
        for name in files:
            if name.endswith(".html"):
                with open(os.path.join(dirpath, name)) as f:
                    html += f.read()
    ids = set(re.findall(r'id="(tf_asyncps[\w.]*)"', html))
    wanted, exports = [], docs_hooks.root_exports()
    for name, (module, attr) in exports.items():
        if attr:
            wanted.append(f"{module}.{attr}")
        else:
            wanted.append(module)
            # A lazy subpackage's names are documented where they are defined.
            lazy = _lazy_of(_module_file(module))
            wanted += [f"{lazy.get(n, module)}.{n}" for n in _all_of(_module_file(module))
                       if not n.isupper()  # constants: no heading of their own
                       and n not in exports]  # documented under its root name
    # griffe reads `from .chain import chain` in a package as its submodule
    # `chain`: the page documents the function as `chain.chain`.
    missing = sorted(w for w in set(wanted) - ids
                     if f"{w}.{w.rsplit('.', 1)[1]}" not in ids)
    assert not missing, f"no API reference entry for {missing}"


def test_the_hook_points_root_names_at_their_module():
    exports = {"ResumeTracker": ("tf_asyncps.recovery", "ResumeTracker"),
               "callbacks": ("tf_asyncps.training.callbacks", None),
               "policies": ("tf_asyncps.policies", None)}
    text = ("::: tf_asyncps.ResumeTracker\n\n::: tf_asyncps.callbacks\n\n"
            "::: tf_asyncps.policies\n\n::: tf_asyncps.cluster.LocalCluster\n")
    assert docs_hooks.resolve(text, exports) == (
        '::: tf_asyncps.recovery.ResumeTracker\n    options:\n'
        '      heading: "tf_asyncps.ResumeTracker"\n'
        '      toc_label: "tf_asyncps.ResumeTracker"\n\n'
        '::: tf_asyncps.training.callbacks\n    options:\n'
        '      heading: "tf_asyncps.callbacks"\n'
        '      toc_label: "tf_asyncps.callbacks"\n\n'
        "::: tf_asyncps.policies\n\n::: tf_asyncps.cluster.LocalCluster\n")
    # The real table: every root export is there, read without importing the package.
    assert set(docs_hooks.root_exports()) >= {"AsyncParameterServerStrategy", "policies",
                                              "ResumeTracker", "DatasetFn"}


def test_sphinx_roles_in_docstrings_become_code_spans():
    assert docs_hooks.plain_roles(
        "Use :class:`LocalCluster` or :func:`~tf_asyncps.cluster.cluster_resolver`; "
        ":mod:`tf_asyncps.policies`, ``x``.") == (
        "Use `LocalCluster` or `cluster_resolver`; `tf_asyncps.policies`, ``x``.")
