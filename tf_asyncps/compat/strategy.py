"""ParameterServerStrategy's ``extended`` object: the class that
``tf_asyncps/strategy.py``'s ``_AsyncExtended`` subclasses and the private
``StrategyExtended`` hooks such a subclass overrides or reads
(:data:`PSS_EXTENDED_HOOKS`), the strategy's ``extended`` replaced by it,
its worker and GPU counts, autograph conversion as
``ParameterServerStrategyV2Extended._call_for_each_replica`` does it, and the
``colocate_with`` argument its ``_create_variable`` honours.

Tested with TensorFlow 2.18.1, 2.19.1, 2.20.0 and 2.21.0
(:data:`tf_asyncps.compat.versions.TENSORFLOW_TESTED`; ``pyproject.toml``
asks for ``tensorflow>=2.18,<2.22``): nothing below differs between them,
unless a function names its own versions.
Importing this module imports nothing; each function imports TensorFlow
when called.
"""

__all__ = ["pss_extended_base", "PSS_EXTENDED_HOOKS", "replace_extended", "num_workers",
           "num_gpus_per_worker", "autograph_convert", "colocating_creator"]


def pss_extended_base():
    """``ParameterServerStrategyV2Extended``: the class the strategy's
    ``extended`` object subclasses."""
    from tensorflow.python.distribute import parameter_server_strategy_v2 as pss_v2
    return pss_v2.ParameterServerStrategyV2Extended


#: The private names of ``ParameterServerStrategyV2Extended`` (and its
#: ``StrategyExtended`` bases) that a subclass of :func:`pss_extended_base`
#: overrides or reads: ``tf_asyncps/strategy.py``'s ``_AsyncExtended``
#: (tested with TensorFlow 2.21.0; ``tests/test_architecture.py`` allows
#: these names, and only these, on ``self``/``super()`` in such a subclass).
PSS_EXTENDED_HOOKS = frozenset({
    # overridden hooks
    "_use_merge_call", "_replica_ctx_update", "_replica_ctx_all_reduce", "_reduce_to",
    "_batch_reduce_to", "_distribute_datasets_from_function", "_create_variable",
    "_call_for_each_replica", "_update",
    # read
    "_num_replicas_in_sync", "_num_workers", "_container_strategy",
})


def replace_extended(strategy, extended) -> None:
    """Makes ``extended`` the ``extended`` object of ``strategy`` (a
    ParameterServerStrategy whose ``__init__`` built its own), carrying the
    per-device retrace setting over from the one it replaces.

    ``tf.distribute.Strategy.extended`` returns ``strategy._extended``; the
    strategy's constructor takes no ``extended`` argument in TF 2.21.
    """
    old = strategy._extended
    strategy._extended = extended
    extended._retrace_functions_for_each_device = old._retrace_functions_for_each_device


def num_workers(extended) -> int:
    """Worker tasks of a ParameterServerStrategy's ``extended``."""
    return int(extended._num_workers)


def num_gpus_per_worker(extended) -> int:
    """GPUs per worker task of a ParameterServerStrategy's ``extended``."""
    return int(extended._num_gpus_per_worker)


def autograph_convert(fn):
    """``fn`` converted by autograph with the caller's control status, as
    ``ParameterServerStrategyV2Extended._call_for_each_replica`` does; ``fn``
    itself when executing eagerly."""
    import tensorflow as tf
    if tf.executing_eagerly():
        return fn
    from tensorflow.python.autograph.core import ag_ctx
    from tensorflow.python.autograph.impl import api as autograph
    return autograph.tf_convert(fn, ag_ctx.control_status_ctx())


def colocating_creator(var):
    """A variable creator that places new variables with ``var``, unpartitioned.

    What ``strategy.extended.colocate_vars_with(var)`` does, without its check
    that ``var`` was made in the strategy's scope (the global step is made
    before it). The ``colocate_with`` creator argument is what
    ParameterServerStrategy's ``_create_variable`` honours (never partitioned,
    ``ops.colocate_with(var)``).
    """
    def creator(next_creator, **kwargs):
        kwargs["colocate_with"] = var
        return next_creator(**kwargs)
    return creator
