"""The cluster layer: who the tasks are, how they find and check each other.

A parameter-server cluster has one ``chief`` (the coordinator that runs
``model.fit``), one or more ``ps`` tasks holding the variables and one or more
``worker`` tasks computing gradients. Every task reads the same ``cluster``
(job name -> list of "host:port") from its ``TF_CONFIG`` environment variable,
and its own ``task`` (type and index) from the same variable.

Modules, from the bottom up (each imports only those above it in this list):

* :mod:`~tf_asyncps.cluster.config`: the TF_CONFIG schema (``ClusterConfig``,
  ``validate_tf_config``, ``cluster_resolver``); importable without TensorFlow.
* :mod:`~tf_asyncps.cluster.network`: security and address checks (loopback,
  exposed addresses, this task's own address).
* :mod:`~tf_asyncps.cluster.probe`: is a task serving (TCP and gRPC probes,
  ``wait_for_tasks``).
* :mod:`~tf_asyncps.cluster.server`: a task's ``tf.distribute.Server`` and its
  thread settings.
* :mod:`~tf_asyncps.cluster.devices`: which GPUs each task sees.
* :mod:`~tf_asyncps.cluster.spawn`: child processes that die with this
  process (``spawn``, through the standalone ``deathsig_shim.py``).
* :mod:`~tf_asyncps.cluster.netns`: several hosts on one Linux machine
  (``NetnsHosts``: network namespaces with their own addresses and an
  optional rate limit per link).
* :mod:`~tf_asyncps.cluster.launcher`: ``LocalCluster``, a real cluster of local
  processes, and its supervisor.

This package only re-exports their public names.
"""

from tf_asyncps.cluster.config import (
    ROLES, ClusterConfig, cluster_resolver, tf_config_from_env, validate_tf_config,
    warn_evaluators)
from tf_asyncps.cluster.launcher import LocalCluster
from tf_asyncps.cluster.netns import NetnsHosts
from tf_asyncps.cluster.network import (
    check_own_address, exposed_addresses, host_is_local, is_loopback, warn_if_exposed)
from tf_asyncps.cluster.probe import (
    PROBE_OK, PROBE_SILENT, PROBE_UNREACHABLE, PROBE_WRONG, probe_grpc, reachable,
    wait_for_tasks)
from tf_asyncps.cluster.server import (
    configure_local_context, inter_op_threads, server_config, start_server)

__all__ = [
    "ClusterConfig", "validate_tf_config", "tf_config_from_env",
    "cluster_resolver", "server_config", "configure_local_context",
    "warn_evaluators", "warn_if_exposed", "exposed_addresses", "is_loopback",
    "host_is_local", "check_own_address",
    "wait_for_tasks", "probe_grpc", "start_server", "LocalCluster", "NetnsHosts", "ROLES",
]
