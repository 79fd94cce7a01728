"""Asynchronous update policies. Each policy lives in its own module.

``get(name, **kwargs)`` builds one by name, ``register(name)`` adds your own,
``names()`` lists them and ``chain(*policies)`` composes them.
"""

from tf_asyncps.policies.base import StepInfo, UpdatePolicy
from tf_asyncps.policies.registry import get, names, register
from tf_asyncps.policies.chain import Chain, chain
from tf_asyncps.policies.async_ import Async
from tf_asyncps.policies.drop_stale import DropStale
from tf_asyncps.policies.staleness_aware import StalenessAwareLR
from tf_asyncps.policies.ssp import BoundedStaleness
from tf_asyncps.policies.dc_asgd import DCASGD
from tf_asyncps.policies.sync_replicas import SyncReplicas
from tf_asyncps.policies.local_sgd import LocalSteps

__all__ = ["UpdatePolicy", "StepInfo", "get", "names", "register", "chain",
           "Chain", "Async", "DropStale", "StalenessAwareLR", "BoundedStaleness",
           "DCASGD", "SyncReplicas", "LocalSteps"]
