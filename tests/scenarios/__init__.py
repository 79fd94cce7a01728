"""Cluster scenarios, each run in its own process (one cluster per process).

TensorFlow allows one cluster per Python process
(docs/design.md#1-facts-measured-on-the-development-machine), so every
test that needs a real cluster runs a scenario through
``conftest.run_scenario`` in a fresh process (``python tests/scenarios KEY
JSON_KWARGS``). The scenario starts a LocalCluster (ps/worker processes,
stopped by pid on exit), creates the strategy in that process and prints
``RESULT: {json}``.

The convention (docs/tests.md#scenarios-beside-their-tests): a scenario is a
function in the test module that reads it, decorated with :func:`scenario`
and annotated with the dataclass it returns, declared next to it with each
field's meaning and unit. A test passes the function itself,
``run_scenario(case002, shared=(4, 1), optimizer="sgd")``, and gets that
dataclass back (the JSON the process printed, typed again by
:func:`from_json`), so ``r.w_min`` reads a documented field and a misspelt
one fails. The process imports only that test module (its key is
``test_x.py::name``, the file relative to tests/).

The old convention, still read while test modules move over: scenarios in
``tests/scenarios/<module>.py``, registered by bare name, called by string
(``run_scenario("case002", ...)``) and returning a dict; what they share is in
``common.py`` (which the new convention uses too). ``__main__.py`` runs either.

Starting a cluster costs most of a short scenario (about 9 s of the 2 cores
for 4 workers). Scenarios marked ``@scenario(shares_cluster=True)`` neither
kill, stop, restart nor reconfigure a task, so they may also run on a cluster
kept up for the whole test session: ``python tests/scenarios serve
'{"num_workers": W, "num_ps": P}'`` reads one request per line on stdin and
answers each (``conftest.run_scenario(..., shared=(W, P))``). Each request
gets new variables, a new strategy and a new ClusterCoordinator, exactly as
in a fresh process; only the ps/worker processes are reused.
"""

import contextlib
import dataclasses
import importlib
import inspect
import os
import pkgutil
import sys
import types
import typing

SCENARIOS = {}  # key ("name", or "test_x.py::name" for a test module's) -> function
SHARES_CLUSTER = set()  # keys of the scenarios that may run under `serve`
CLUSTERS = []  # LocalClusters started by this process's scenario
SHARED = {}  # under `serve`: "shape" (LocalCluster kwargs) and "cluster"

#: tests/, where the key of a test module's scenario starts.
TESTS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cluster(**kwargs):
    """A new ``LocalCluster(**kwargs)`` (a context manager), or under
    ``serve`` the shared one, which must have that shape."""
    if SHARED:
        if kwargs != SHARED["shape"]:
            raise ValueError(f"this scenario needs a cluster {kwargs}, but the shared "
                             f"cluster is {SHARED['shape']}: pass shared=(num_workers, "
                             f"num_ps) that match it.")
        return contextlib.nullcontext(SHARED["cluster"])  # stays up after the scenario
    from tf_asyncps.cluster import LocalCluster
    c = LocalCluster(**kwargs)
    CLUSTERS.append(c)
    return c


def scenario(fn=None, *, shares_cluster=False):
    """Registers a scenario; ``shares_cluster``: it may run under ``serve``.

    A scenario in a test module must be annotated with the dataclass it
    returns (``def case002(...) -> Case002:``); it gets ``fn.scenario_key``
    (``"test_x.py::name"``) and ``fn.result_type``. One in
    ``tests/scenarios/<module>.py`` (the old convention) is registered by
    its bare name and returns a dict.

    Raises:
      TypeError: a test module's scenario without a dataclass return annotation.
    """
    def register(fn):
        if fn.__module__.startswith(__name__ + "."):
            key = fn.__name__
        else:
            result_type = typing.get_type_hints(fn).get("return")
            if not dataclasses.is_dataclass(result_type):
                raise TypeError(
                    f"scenario {fn.__qualname__} ({fn.__module__}) must be annotated with "
                    f"the dataclass it returns, e.g. `def {fn.__name__}(...) -> Result:` "
                    f"with `@dataclasses.dataclass(frozen=True) class Result` declared "
                    f"beside it (got {result_type!r}).")
            path = os.path.relpath(os.path.abspath(inspect.getfile(fn)), TESTS_DIR)
            key = f"{path}::{fn.__name__}"
            fn.scenario_key, fn.result_type = key, result_type
        SCENARIOS[key] = fn
        if shares_cluster:
            SHARES_CLUSTER.add(key)
        return fn
    return register(fn) if fn is not None else register


def find(key):
    """The scenario registered as ``key``, importing its test module first
    when ``key`` is ``"test_x.py::name"`` (only that module: a fresh process
    loads no other test module's imports).

    Raises:
      KeyError: no such scenario.
    """
    if key not in SCENARIOS and "::" in key:
        path = key.split("::")[0]
        folder = os.path.join(TESTS_DIR, os.path.dirname(path))
        if folder not in sys.path:
            sys.path.insert(1, folder)
        importlib.import_module(os.path.splitext(os.path.basename(path))[0])
    if key not in SCENARIOS:
        raise KeyError(f"no scenario {key!r}: a test module's scenario is "
                       f"'test_x.py::name' (decorated with @scenario), an old one its bare "
                       f"name in tests/scenarios/.")
    return SCENARIOS[key]


def to_json(value):
    """``value`` as JSON-ready data: a dataclass as a dict of its fields (one
    with ``to_dict``, such as ``StalenessStats``, through it), NumPy arrays as
    lists, NumPy scalars as Python numbers."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        if hasattr(value, "to_dict"):
            return to_json(value.to_dict())
        return {f.name: to_json(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {k: to_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_json(v) for v in value]
    if hasattr(value, "tolist"):  # a NumPy array or scalar
        return value.tolist()
    return value


def from_json(tp, data):
    """``data`` (what :func:`to_json` made of a ``tp``) as a ``tp`` again:
    dataclasses rebuilt field by field (also inside lists, dicts and
    ``Optional``); every other value as JSON gave it (arrays stay lists).

    Raises:
      TypeError: ``data`` holds a field ``tp`` does not declare, or lacks one.
    """
    if data is None:
        return None
    if dataclasses.is_dataclass(tp):
        hints = typing.get_type_hints(tp)
        fields = {f.name for f in dataclasses.fields(tp) if f.init}
        unknown = sorted(set(data) - fields)
        if unknown:
            raise TypeError(f"{tp.__qualname__} has no field(s) {unknown}: declare them "
                            f"in the dataclass (the scenario returned them).")
        return tp(**{k: from_json(hints[k], v) for k, v in data.items()})
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        return from_json(inner[0], data) if len(inner) == 1 else data
    if origin is list and args:
        return [from_json(args[0], v) for v in data]
    if origin is dict and len(args) == 2:
        return {k: from_json(args[1], v) for k, v in data.items()}
    return data


def load_all():
    """Imports every old-convention scenario module, so that SCENARIOS names
    them all (a shared cluster serves the scenarios of every test module;
    test modules' own scenarios are imported on their first request)."""
    for m in pkgutil.iter_modules(__path__):
        if m.name not in ("__main__", "common"):
            importlib.import_module(f"{__name__}.{m.name}")
