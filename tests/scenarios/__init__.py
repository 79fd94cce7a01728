"""Cluster scenarios, each run in its own process (one cluster per process).

TensorFlow allows one cluster per Python process
(docs/design.md#1-facts-measured-on-the-development-machine), so every
test that needs a real cluster runs one of these functions through
``conftest.run_scenario``: ``python tests/scenarios NAME JSON_KWARGS``.
The scenario starts a LocalCluster (ps/worker processes, stopped by pid on
exit), creates the strategy in this process and prints ``RESULT: {json}``.

Scenarios live in the module named after the test module that reads them
(``fit_exactness.py`` for ``tests/test_fit_exactness.py``, ...); what
scenarios of several modules share is in ``common.py``. This file is the
registry; ``__main__.py`` runs a scenario by name.

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
import importlib
import pkgutil

SCENARIOS = {}
SHARES_CLUSTER = set()
CLUSTERS = []  # LocalClusters started by this process's scenario
SHARED = {}  # under `serve`: "shape" (LocalCluster kwargs) and "cluster"


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
    """Registers a scenario; ``shares_cluster``: it may run under ``serve``."""
    def register(fn):
        SCENARIOS[fn.__name__] = fn
        if shares_cluster:
            SHARES_CLUSTER.add(fn.__name__)
        return fn
    return register(fn) if fn is not None else register


def load_all():
    """Imports every scenario module, so that SCENARIOS names them all (a
    shared cluster serves the scenarios of every test module)."""
    for m in pkgutil.iter_modules(__path__):
        if m.name not in ("__main__", "common"):
            importlib.import_module(f"{__name__}.{m.name}")
