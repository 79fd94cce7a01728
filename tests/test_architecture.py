"""The house rules: private TensorFlow/Keras APIs only in compat/, no import
circles, and every module importable first. Size is no rule (a module holds
one idea, whatever its length): the run's summary lists modules over
LONG_MODULE_LINES lines as places to look (conftest)."""

import ast
import importlib
import inspect
import os
import re
import textwrap

import pytest

import fresh_process
from conftest import ROOT
from fresh_process import package_modules as _modules

PRIVATE = re.compile(r"^(tensorflow\.(python|core)|tf_keras\.src|keras\.src)(\.|$)")


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



_FRAME_ATTRS = {"f_back", "f_locals", "f_globals", "f_builtins", "f_code", "tb_frame",
                "gi_frame", "cr_frame", "ag_frame"}
_FRAME_CALLS = {"sys._getframe", "sys._current_frames", "inspect.currentframe", "inspect.stack",
                "inspect.trace", "inspect.getouterframes", "inspect.getinnerframes",
                "traceback.extract_stack", "traceback.walk_stack", "traceback.format_stack",
                "traceback.print_stack"}
_SETATTR_CALLS = {"setattr", "delattr", "object.__setattr__", "object.__delattr__",
                  "type.__setattr__", "type.__delattr__"}
#: Private-looking names that are documented public API.
_PUBLIC_PRIVATE = {"os._exit"}


def _private(name):
    return isinstance(name, str) and name.startswith("_") and not name.endswith("__")


def _dotted(node):
    """``a.b.c`` for a chain of names, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return ".".join([node.id] + parts[::-1])
    return None


_FOREIGN_CACHE = {}


def _names_of_foreign_class(klass):
    """Private names a class outside tf_asyncps defines: its class attributes
    and methods, and every ``self._x`` its source reads or sets."""
    if klass not in _FOREIGN_CACHE:
        names = {n for n in vars(klass) if _private(n)}
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):  # no source (a C type): its vars() only
            tree = None
        if tree is not None:
            names |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)
                      and isinstance(n.value, ast.Name) and n.value.id in ("self", "cls")
                      and _private(n.attr)}
        _FOREIGN_CACHE[klass] = names
    return _FOREIGN_CACHE[klass]


def _foreign_names(bases):
    """(private names the non-tf_asyncps classes among ``bases``' MROs define,
    the names compat declares usable by subclasses of those bases)."""
    from tf_asyncps.compat import strategy as strategy_compat
    foreign, allowed = set(), set()
    for base in bases:
        for klass in getattr(base, "__mro__", ()):
            if klass.__module__.split(".")[0] == "tf_asyncps" or klass.__module__ == "builtins":
                continue
            foreign |= _names_of_foreign_class(klass)
            if klass is strategy_compat.pss_extended_base():
                allowed |= strategy_compat.PSS_EXTENDED_HOOKS
    return foreign, allowed


def _class_bases(node, module, outer):
    """The base classes of ClassDef ``node`` of ``module`` (objects). A class
    inside a function has its bases evaluated with the module's names and
    the imports made anywhere in its file."""
    if outer is None and isinstance(getattr(module, node.name, None), type):
        return getattr(module, node.name).__mro__[1:]
    names = dict(vars(module))
    for n in ast.walk(ast.parse(inspect.getsource(module))):
        if isinstance(n, ast.Import):
            for a in n.names:
                names.setdefault(a.asname or a.name.split(".")[0],
                                 importlib.import_module(a.name if a.asname else
                                                         a.name.split(".")[0]))
        elif isinstance(n, ast.ImportFrom) and not n.level:
            for a in n.names:
                mod = importlib.import_module(n.module)
                names.setdefault(a.asname or a.name, getattr(mod, a.name, None))
    return [eval(compile(ast.Expression(b), "<base>", "eval"), names)  # noqa: S307
            for b in node.bases]


class _PrivateAccess(ast.NodeVisitor):
    """Collects the violations of one module; see the test's docstring."""

    def __init__(self, rel, module, tree, project_names):
        self.rel, self.module, self.project = rel, module, project_names
        self.imported = {a.asname or a.name.split(".")[0] for n in ast.walk(tree)
                         if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names}
        self.functions = {n.name for n in ast.walk(tree)
                          if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
        self.classes = []  # (foreign names, allowed names) of the enclosing classes
        self.out = []

    def _flag(self, node, what):
        self.out.append(f"{self.rel}:{node.lineno}: {what}")

    def _check(self, node, receiver, name, text):
        if not _private(name):
            return
        on_self = (isinstance(receiver, ast.Name) and receiver.id in ("self", "cls")) or (
            isinstance(receiver, ast.Call) and isinstance(receiver.func, ast.Name)
            and receiver.func.id == "super")
        if on_self and self.classes:
            foreign, allowed = self.classes[-1]
            if name in foreign and name not in allowed:
                self._flag(node, f"{text}: a private attribute the base class defines")
            return
        dotted = _dotted(receiver)
        if dotted is not None and dotted.split(".")[0] in self.imported:
            if f"{dotted}.{name}" not in _PUBLIC_PRIVATE:
                self._flag(node, f"{text}: a private name of an imported module or class")
            return
        if name not in self.project:
            self._flag(node, f"{text}: a private attribute tf_asyncps does not define")

    def visit_ClassDef(self, node):
        bases = _class_bases(node, self.module, self.classes[-1] if self.classes else None)
        self.classes.append(_foreign_names(bases))
        self.generic_visit(node)
        self.classes.pop()

    def visit_Attribute(self, node):
        self._check(node, node.value, node.attr, ast.unparse(node))
        if node.attr in _FRAME_ATTRS:
            self._flag(node, f"{ast.unparse(node)}: frame walking")
        self.generic_visit(node)

    def visit_Call(self, node):
        func = ast.unparse(node.func)
        if func in _SETATTR_CALLS or (isinstance(node.func, ast.Attribute)
                                      and node.func.attr in ("__setattr__", "__delattr__")):
            self._flag(node, f"{func}(...): sets an attribute by name")
        if func in _FRAME_CALLS:
            self._flag(node, f"{func}(): frame walking")
        literal = node.args[1].value if len(node.args) > 1 and isinstance(
            node.args[1], ast.Constant) else None
        if func in ("getattr", "hasattr") and node.args:
            self._check(node, node.args[0], literal, f"{func}(..., {literal!r})")
        if isinstance(node.func, ast.Attribute) and node.func.attr == "get" and node.args \
                and isinstance(node.args[0], ast.Constant):
            owner = node.func.value
            if isinstance(owner, ast.Attribute) and owner.attr == "__dict__":
                self._check(node, owner.value, node.args[0].value, ast.unparse(node))
            elif isinstance(owner, ast.Call) and ast.unparse(owner.func) == "vars" and owner.args:
                self._check(node, owner.args[0], node.args[0].value, ast.unparse(node))
        self.generic_visit(node)

    def visit_Assign(self, node):
        function = isinstance(node.value, ast.Lambda) or (
            isinstance(node.value, ast.Name) and node.value.id in self.functions)
        for target in node.targets:
            if function and isinstance(target, ast.Attribute) and not (
                    isinstance(target.value, ast.Name) and target.value.id in ("self", "cls")):
                self._flag(node, f"{ast.unparse(target)} = <function>: replaces a method")
        self.generic_visit(node)

    def visit_ImportFrom(self, node):
        if not (node.level or (node.module or "").split(".")[0] == "tf_asyncps"):
            for a in node.names:
                if _private(a.name):
                    self._flag(node, f"from {node.module} import {a.name}: a private name")


#: The only frame walks left in the package, (file, function) -> why no hook
#: replaces them (issue 38 item 1: context is passed or hooked, not discovered).
FRAME_WALKS_ALLOWED = {
    ("tf_asyncps/compat/keras_layers.py", "in_train_step"):
        "a Keras 3 train_step (Keras' own, a model's override that need not call "
        "super, this package's) on the stack decides training=None for a "
        "DynamicEmbedding; Keras 3.15 has no hook around a model's own train_step",
    ("tf_asyncps/compat/keras_layers.py", "caller"):
        "the Keras a DynamicEmbedding is built for is the Keras of the code "
        "creating it (its module's and its locals' bindings): no library call to hook",
    ("tf_asyncps/compat/keras_layers.py", "model_being_made"):
        "as caller: the subclassed model or layer whose __init__ creates the layer",
    ("tf_asyncps/compat/keras_layers.py", "bound_values"):
        "as caller: reads the caller frame's bindings",
}


def _frame_walks(path):
    """(function, line, text) of every frame walk in ``path``: a call in
    ``_FRAME_CALLS`` or a read of a frame attribute (``f_back``, ``f_locals``, ...)."""
    tree = ast.parse(open(path).read(), path)
    out = []

    def visit(node, function):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            function = function or node.name  # the top-level function
        if isinstance(node, ast.Call) and ast.unparse(node.func) in _FRAME_CALLS:
            out.append((function, node.lineno, ast.unparse(node.func) + "()"))
        elif isinstance(node, ast.Attribute) and node.attr in _FRAME_ATTRS:
            out.append((function, node.lineno, ast.unparse(node)))
        for child in ast.iter_child_nodes(node):
            visit(child, function)

    visit(tree, None)
    return out


def test_no_frame_walking_outside_the_listed_exceptions():
    """No module of the package reads the stack (``sys._getframe``, ``f_back``,
    ``inspect.stack``, ...) but the walks in :data:`FRAME_WALKS_ALLOWED`:
    what is current during a trace is passed (core/trace_context.py) and what
    Keras is doing is hooked (compat/call_scopes.py)."""
    found = {}
    for module, path in _modules().items():
        rel = os.path.relpath(path, ROOT).replace(os.sep, "/")
        for function, line, text in _frame_walks(path):
            found.setdefault((rel, function), []).append(f"{rel}:{line} {text}")
    assert sorted(k for k in found if k not in FRAME_WALKS_ALLOWED) == []
    assert sorted(k for k in FRAME_WALKS_ALLOWED if k not in found) == []  # none stale


def test_the_frame_walk_rule_flags_each_pattern(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("import sys, inspect\n"
                   "def a():\n    return sys._getframe(1)\n"
                   "def b(f):\n    return f.f_back\n"
                   "def c():\n    return inspect.stack()\n"
                   "def d():\n    return 1\n")
    assert [(f, t) for f, _, t in _frame_walks(str(src))] == [
        ("a", "sys._getframe()"), ("b", "f.f_back"), ("c", "inspect.stack()")]


def test_private_tensorflow_and_keras_attributes_live_in_compat_only():
    """Outside ``tf_asyncps/compat/`` no code touches a private attribute of
    a TensorFlow/Keras (or any other library's) object, sets attributes by
    name, or walks frames. A "private attribute" is a ``_name`` (not a
    ``__dunder__``) read, written, or named as a string constant in
    ``getattr``/``hasattr``/``x.__dict__.get``/``vars(x).get``:

    * on ``self``/``cls``/``super()`` inside a class: allowed unless a base
      class from outside tf_asyncps defines the name (its class attributes and
      methods, and the ``self._x`` its source uses: so ``self._extended`` in a
      ParameterServerStrategy subclass is caught, ``self._tracker`` is not).
      Allowed exception: the hooks of ``ParameterServerStrategyV2Extended``
      that compat lists in ``strategy_compat.PSS_EXTENDED_HOOKS`` (tested
      versions there), in a subclass of ``strategy_compat.pss_extended_base()``;
    * on a name bound by an import (a module or an imported class, e.g.
      ``sys._getframe``, a project module's ``_helper``): never allowed,
      except ``os._exit`` (documented public API);
    * on any other object: allowed only if tf_asyncps defines that name for an
      object of its own (a method, class attribute or ``self._x`` of a
      tf_asyncps class, not inherited from a foreign base: e.g.
      ``accounting._put_back``). A foreign object's private attribute that has
      the same name as one of the project's is not caught: receivers have no
      static type.

    Also refused anywhere outside compat: ``setattr``/``delattr``/
    ``object.__setattr__`` (and any ``.__setattr__`` call); assigning a lambda
    or a function to an attribute of an object other than ``self``/``cls``
    (an instance or class method patch); frame walking (``sys._getframe``,
    ``inspect.currentframe``/``stack``, ``traceback.extract_stack``/
    ``walk_stack``, ``f_back``/``f_locals``/... attributes); importing a
    ``_name`` from a module outside tf_asyncps. Plain attribute assignment of a
    public name (``model.stop_training = True``) is public API and allowed.
    """
    modules = {m: p for m, p in _modules().items()
               if ".compat" not in m and not m.endswith(("__main__", "deathsig_shim"))}
    trees = {m: ast.parse(open(p).read(), p) for m, p in modules.items()}
    loaded = {m: importlib.import_module(m) for m, t in trees.items()
              if any(isinstance(n, ast.ClassDef) for n in ast.walk(t))}
    # The project's own private names: defined by its classes, not inherited.
    project = set()
    for m, tree in trees.items():
        def collect(node, outer):
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.ClassDef):
                    foreign, _ = _foreign_names(_class_bases(child, loaded[m], outer))
                    own = {n.name for n in child.body
                           if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
                    own |= {t.id for n in child.body if isinstance(n, (ast.Assign, ast.AnnAssign))
                            for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
                            if isinstance(t, ast.Name)}
                    own |= {t.attr for n in ast.walk(child)
                            if isinstance(n, (ast.Assign, ast.AugAssign, ast.AnnAssign))
                            for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
                            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
                            and t.value.id in ("self", "cls")}
                    project.update(n for n in own if _private(n) and n not in foreign)
                    collect(child, child)
                else:
                    collect(child, outer)
        collect(tree, None)
    leaks = []
    for m, tree in trees.items():
        visitor = _PrivateAccess(os.path.relpath(modules[m], ROOT), loaded.get(m), tree, project)
        visitor.visit(tree)
        leaks.extend(visitor.out)
    assert leaks == []
    assert {"_put_back", "_translate", "_tracker"} <= project
    assert "_extended" not in project and "_num_workers" not in project


#: TensorFlow calls that log a deprecation warning each job, with the compat helper to use.
_DEPRECATED = {"tf.compat.v1.colocate_with": "compat.graph.colocated_with / colocate_only_with"}


def test_no_module_calls_a_tensorflow_api_that_warns_deprecated():
    # tf.compat.v1.colocate_with printed TensorFlow's "_colocate_with ... is
    # deprecated" warning on every job (core/placement.py, core/nonfinite_guard.py).
    found = []
    for m, path in _modules().items():
        for node in ast.walk(ast.parse(open(path).read(), path)):
            if isinstance(node, ast.Call) and _dotted(node.func) in _DEPRECATED:
                found.append(f"{os.path.relpath(path, ROOT)}:{node.lineno} {_dotted(node.func)}"
                             f" (use {_DEPRECATED[_dotted(node.func)]})")
    assert found == []


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


def test_the_dynamic_tables_sit_between_core_and_the_layers():
    """tf_asyncps.dynamic (the table machinery) imports only compat, core,
    the argument checks and itself; compat and core import neither it nor the
    Keras layers. The layers build on the tables, the tables on the runtime."""
    modules = _modules()
    allowed = ("tf_asyncps.compat", "tf_asyncps.core", "tf_asyncps.dynamic",
               "tf_asyncps.validate")
    wrong = []
    for m, path in modules.items():
        for line, name in _imports(path, m, modules):
            if not name.startswith("tf_asyncps"):
                continue
            up = m.startswith("tf_asyncps.dynamic") and not name.startswith(allowed)
            down = m.startswith(("tf_asyncps.compat", "tf_asyncps.core")) and name.startswith(
                ("tf_asyncps.dynamic", "tf_asyncps.layers"))
            if up or down:
                wrong.append(f"{os.path.relpath(path, ROOT)}:{line} imports {name}")
    assert wrong == []
    assert {"tf_asyncps.dynamic.table", "tf_asyncps.dynamic.checkpoint"} <= set(modules)


def test_every_module_and_root_name_imports_first_in_a_fresh_package(fresh_process_facts):
    """Each module (and each lazy name of the root, e.g. SyncReplicasAggregator)
    is the first tf_asyncps import of a fresh package state: an import circle
    shows up as 'partially initialized module'."""
    facts, names = fresh_process_facts
    assert facts["failed"] == {}
    assert len(names) > 40 and "tf_asyncps.policies.sync_replicas" in names


def test_public_names_of_moved_modules_still_resolve():
    """The README's names outlive the layout moves of issue #26 (callbacks/,
    app/straggler.py): each is the moved module's object, not a copy."""
    import tf_asyncps
    from tf_asyncps.app import straggler
    from tf_asyncps.callbacks import common, recovery, tf_keras
    assert tf_asyncps.straggler is straggler
    assert tf_asyncps.recovery is recovery
    assert tf_asyncps.ResumeTracker is tf_asyncps.callbacks.ResumeTracker is recovery.ResumeTracker
    assert (tf_asyncps.callbacks.StalenessLogger, tf_asyncps.callbacks.ProgressLine,
            tf_asyncps.callbacks.format_value) == (tf_keras.StalenessLogger,
                                                   tf_keras.ProgressLine, common.format_value)
    with pytest.raises(AttributeError, match="'tf_asyncps.callbacks' has no attribute 'Nope'"):
        tf_asyncps.callbacks.Nope  # noqa: B018


@pytest.mark.parametrize("module", fresh_process.TOOLS)
def test_tools_import_without_tensorflow(module, fresh_process_facts):
    facts, _ = fresh_process_facts
    assert facts["tensorflow_imported"][module] is False


_FORBIDDEN = '''
import inspect, sys, threading
import keras
from tf_asyncps.cluster import config as _config

class Mine:
    def __init__(self):
        self._mine = 1

class Worker(threading.Thread):
    def run(self):
        self._mine_too = self._started         # 12: Thread's own
        return super()._bootstrap              # 13: Thread's own

def f(model, obj, lso):
    sys._getframe(1)                           # 16
    inspect.currentframe().f_back              # 17 (call and attribute)
    setattr(model, "x", 1)                     # 18
    object.__setattr__(model, "fit", f)        # 19
    model.fit = lambda: 0                      # 20
    getattr(lso, "_loss_scale", None)          # 21
    model.__dict__.get("_secret")              # 22
    obj._value                                 # 23
    _config._warn_once("k", "m")               # 24
    obj._mine, obj._mine_too                   # 25: the project's own names
    model.stop_training = True                 # 26: public API
'''


def test_the_private_attribute_rule_flags_each_forbidden_pattern():
    import types
    module = types.ModuleType("probe")
    tree = ast.parse(_FORBIDDEN)
    exec(compile(tree, "probe", "exec"), vars(module))  # noqa: S102
    visitor = _PrivateAccess("probe.py", module, tree, {"_mine", "_mine_too"})
    visitor.visit(tree)
    lines = sorted({int(v.split(":")[1]) for v in visitor.out})
    assert lines == [12, 13, 16, 17, 18, 19, 20, 21, 22, 23, 24], visitor.out
    assert "probe.py:16: sys._getframe(): frame walking" in visitor.out
    assert "probe.py:20: model.fit = <function>: replaces a method" in visitor.out
    assert "probe.py:23: obj._value: a private attribute tf_asyncps does not define" in visitor.out
