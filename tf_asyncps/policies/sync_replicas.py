"""``sync_replicas``: N-of-M synchronous aggregation with backup workers.

The rule and its implementation live in :mod:`tf_asyncps.aggregator`
(``SyncReplicasAggregator``); this module registers it as a policy.
"""

from tf_asyncps.aggregator import SyncReplicasAggregator
from tf_asyncps.policies import registry

__all__ = ["SyncReplicas"]


@registry.register("sync_replicas")
class SyncReplicas(SyncReplicasAggregator):
    """``SyncReplicas(replicas_to_aggregate, total_num_replicas=None,
    max_staleness=0, timeout_s=120)``: see SyncReplicasAggregator."""
