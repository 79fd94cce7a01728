"""The policy engine in this process, on its CPU, with no cluster: the one
helper the fast-tier engine tests (test_engine, test_route, test_policy_state)
build their engines with."""

import tensorflow as tf

from tf_asyncps import policies
from tf_asyncps.core.engine import PolicyEngine
from tf_asyncps.core.staleness import StalenessTracker
from tf_asyncps.core.step import install_optimizer_hooks
from tf_asyncps.optimizers import is_locking, lock_timeout

#: This process's CPU: the engine's state and the policies' variables live there.
CPU = "/job:localhost/replica:0/task:0/device:CPU:0"


def local_engine(policy, num_workers=1, **policy_kwargs):
    """A built ``PolicyEngine`` for ``policy`` (a policy object, or a registry
    name with ``policy_kwargs``) and ``num_workers`` workers, as the strategy
    makes one: the optimizer hooks installed, a staleness tracker on the CPU,
    non-finite steps skipped, the policy built through the engine (its
    per-cluster state recorded, ``engine.policy_scope()``) and the default
    strategy as its strategy."""
    install_optimizer_hooks()
    if isinstance(policy, str):
        policy = policies.get(policy, **policy_kwargs)
    elif policy_kwargs:
        raise TypeError(f"arguments {sorted(policy_kwargs)} go with a policy name, not an object")
    engine = PolicyEngine(policy, StalenessTracker(max_tracked=4, device=CPU),
                          num_workers=num_workers, skip_nonfinite=True,
                          is_locking=is_locking, lock_timeout=lock_timeout)
    engine.build(CPU)
    engine.strategy = tf.distribute.get_strategy()
    return engine
