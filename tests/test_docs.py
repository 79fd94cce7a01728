"""The docs site (mkdocs.yml, docs/) builds with `mkdocs build --strict`: no
warning (broken links or anchors, pages left out of the nav, docstrings the
API reference cannot read), without importing TensorFlow (the API reference is
read from the source by griffe), and its API reference documents every name
the package root exports. Every `docs/<page>.md#<anchor>` the code and the
tests cite resolves, and none cites the design notes outside the repository
or a README section by name."""

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


# References from the code to the docs: `docs/<page>.md` or
# `docs/<page>.md#<anchor>` in a comment, docstring or message.
_DOCS_REF = re.compile(r"\bdocs/([\w./-]+?\.md)(?:#([\w-]+))?")
# Citations of the old design notes (kept outside the repository) and of README
# sections by name: the README is a front page; the sections live in docs/.
_DESIGN_REF = re.compile(r"\bDESIGN\b")
_README_SECTION = re.compile(r"""\bREADME(?::\s+["'A-Z]|,?\s+["'])|\(README,""")


def _sources():
    """(relative path, text) of every .py file of the package, the tests and
    the examples."""
    this = os.path.abspath(__file__)
    for top in ("tf_asyncps", "tests", "examples"):
        for dirpath, _, files in os.walk(os.path.join(ROOT, top)):
            for name in sorted(files):
                path = os.path.join(dirpath, name)
                if name.endswith(".py") and os.path.abspath(path) != this:
                    with open(path, encoding="utf-8") as f:
                        yield os.path.relpath(path, ROOT), f.read()


def _page_anchors(path):
    """The anchors MkDocs gives the headings of a docs page (toc's slugify:
    lowercase, punctuation dropped, spaces and runs of hyphens to one '-';
    `{#id}` kept as written; a repeated heading gets `_1`, `_2`...)."""
    from markdown.extensions.toc import slugify  # of mkdocs' markdown
    anchors, in_code = set(), False
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.lstrip().startswith(("```", "~~~")):
                in_code = not in_code
            m = None if in_code else re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
            if not m:
                continue
            title = m.group(1)
            custom = re.search(r"\{[^}]*#([\w-]+)[^}]*\}\s*$", title)
            slug = custom.group(1) if custom else slugify(re.sub(r"<[^>]+>", "", title), "-")
            unique, n = slug, 0
            while unique in anchors:
                n += 1
                unique = f"{slug}_{n}"
            anchors.add(unique)
    return anchors


def test_page_anchors_are_mkdocs_anchors(tmp_path):
    """As the built site's ids (docs/benchmarks.md, read in site/benchmarks/)."""
    assert {"benchmarks", "how-cost-grows-bench_scaling", "bfloat16-on-the-wire-asyncbf161m",
            "bytes-per-step-by-policy", "bytes-per-step-on-an-embedding-nameemb"} <= \
        _page_anchors(os.path.join(ROOT, "docs", "benchmarks.md"))
    page = tmp_path / "page.md"
    page.write_text("# A, b\n\n```\n# not a heading\n```\n## A b\n## x {#own}\n")
    assert _page_anchors(str(page)) == {"a-b", "a-b_1", "own"}


def test_every_docs_reference_in_the_code_resolves():
    """Every `docs/<page>.md[#anchor]` in tf_asyncps/ and tests/ names a page
    that exists and, with an anchor, a heading of that page; nothing cites the
    old design notes ("DESIGN section N") or a README section by name."""
    broken, design, readme, checked, anchors = [], [], [], 0, {}
    for rel, text in _sources():
        for lineno, line in enumerate(text.splitlines(), 1):
            where = f"{rel}:{lineno}: {line.strip()}"
            for m in _DOCS_REF.finditer(line):
                page, anchor = m.group(1), m.group(2)
                full = os.path.join(ROOT, "docs", page)
                checked += 1
                if not os.path.isfile(full):
                    broken.append(f"{where}  (no page docs/{page})")
                elif anchor:
                    if full not in anchors:
                        anchors[full] = _page_anchors(full)
                    if anchor not in anchors[full]:
                        broken.append(f"{where}  (no heading #{anchor} in docs/{page})")
            if _DESIGN_REF.search(line):
                design.append(where)
            if _README_SECTION.search(line):
                readme.append(where)
        # A message may be split over source lines and adjacent string literals.
        joined = re.sub(r"""["']\s*["']""", "", " ".join(text.replace("#", " ").split()))
        for m in _README_SECTION.finditer(joined):
            if not any(w.startswith(rel + ":") for w in readme):
                readme.append(f"{rel}: ...{joined[m.start():m.end() + 40]}")
    assert not broken, "docs references that do not resolve:\n" + "\n".join(broken)
    assert not design, ("cites the design notes outside the repository; point at "
                        "docs/design.md#<section> instead:\n" + "\n".join(design))
    assert not readme, ("cites a README section (README.md is a front page); point at "
                        "the docs page that holds it:\n" + "\n".join(readme))
    assert checked >= 10


def test_every_test_the_behaviour_map_names_exists():
    """docs/tests.md's "Which test checks what" names test files and
    ``file::test`` functions: each must exist (a rename or a removed test
    shows up here)."""
    text = open(os.path.join(ROOT, "docs", "tests.md")).read()
    table = text[text.index("## Which test checks what"):].split("\nRenamed so far")[0]
    missing, named, last = [], 0, None
    for file, test in re.findall(r"`(?:(test_\w+\.py)|)(?:::(test_\w+))?`", table):
        if not file and not test:
            continue
        last = file or last
        path = os.path.join(ROOT, "tests", last)
        if not os.path.exists(path):
            missing.append(last)
            continue
        named += 1
        if test:
            defs = {n.name for n in ast.walk(ast.parse(open(path).read()))
                    if isinstance(n, ast.FunctionDef)}
            if test not in defs:
                missing.append(f"{last}::{test}")
    assert missing == []
    assert named >= 60
