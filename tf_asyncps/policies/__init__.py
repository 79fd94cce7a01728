"""Asynchronous update policies: update rules only, each policy whole in its own module.

``get(name, **kwargs)`` builds one by name, ``register(name)`` adds your own,
``names()`` lists them, ``chain(*policies)`` composes them and
``route(sparse=..., dense=...)`` gives embedding tables and dense layers a
policy each; ``beside(var)`` places a policy's own variables with a model
variable, untracked. The protocol a
policy implements (:class:`UpdatePolicy`, every hook with a default) is
defined in ``tf_asyncps/core/protocol.py``; the machinery the rules use (the
PS lock, worker gates, local copies) lives in ``tf_asyncps/core/``.
"""

from tf_asyncps.core.grads import all_finite, map_values, scale
from tf_asyncps.core.placement import beside
from tf_asyncps.policies.base import Decision, PolicyRuntime, StepInfo, UpdatePolicy
from tf_asyncps.policies.registry import get, names, register
from tf_asyncps.policies.chain import Chain, chain
from tf_asyncps.policies.route import Route, route
from tf_asyncps.policies.async_ import Async
from tf_asyncps.policies.drop_stale import DropStale
from tf_asyncps.policies.staleness_aware import StalenessAware, StalenessAwareLR
from tf_asyncps.policies.ssp import SSP, BoundedStaleness
from tf_asyncps.policies.dc_asgd import DCASGD
from tf_asyncps.policies.sync_replicas import SyncReplicas, SyncReplicasAggregator
from tf_asyncps.policies.local_sgd import LocalSGD, LocalSteps

# Each registered policy's class is its name in CamelCase (``ssp`` -> SSP,
# ``local_sgd`` -> LocalSGD); the former class names (BoundedStaleness,
# LocalSteps, StalenessAwareLR) still import, as aliases, outside __all__.
__all__ = ["UpdatePolicy", "StepInfo", "Decision", "PolicyRuntime", "get", "names",
           "register", "chain", "Chain", "route", "Route", "Async", "DropStale", "StalenessAware",
           "SSP", "DCASGD", "SyncReplicas", "SyncReplicasAggregator",
           "LocalSGD", "scale", "map_values", "all_finite", "beside"]
