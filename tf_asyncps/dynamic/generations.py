"""A DynamicTable under ``local_sgd``: eviction at the exchanges, and no
stale delta on a row that was reset.

Under ``local_sgd`` each worker trains its own copy of the table (and of
its optimizer slots) and exchanges Δ = local − anchor with the ps every
``sync_every`` steps (tf_asyncps/core/local_copies.py). The id -> row map
stays on the ps, shared: lookups admit and count there as under the other
policies. What a reused row needs:

* Each row has a generation on its ps (``gen``, int64 ``[rows]``), bumped
  when an eviction pass resets the row; each worker holds the generations
  it last pulled (``gen_view``: a model variable, so ``local_sgd`` gives
  every worker its own copy, which its steps read).
* A lookup in a local step uses a found row only if its generation is the
  one the worker pulled; otherwise (the row was reset, maybe handed to
  another id, since) the id reads the default row, zeros, with no gradient,
  until the worker's next exchange.
* The exchange (:class:`LocalGuard`, called by ``LocalCopies``) runs on the
  shard's ps, in its critical section: the pass due at the exchange's global
  step (``evict_every`` counts exchanges, the global step of ``local_sgd``),
  then Δ added only to rows whose generation is still the worker's, then
  the rows and generations read back together. The worker's copies of the
  rows, and of their optimizer slots' rows whose generation changed (reset
  to the slot's initial value), then start again from the ps's.

So a reused row, its slots and every worker's copy of it start fresh, and
live rows never exceed the capacity (admission takes free rows on the ps,
as under every policy).
"""

import functools

import tensorflow as tf

from tf_asyncps.compat import hooks as hooks_compat
from tf_asyncps.compat import strategy as strategy_compat
from tf_asyncps.dynamic import eviction as eviction_lib

__all__ = ["LocalGuard", "add_generations", "find_in_training"]


def add_generations(shard, var, name: str, local_copies: bool) -> None:
    """Gives ``shard`` its ``gen`` (on its ps, beside ``var``) and
    ``gen_view`` (a model variable colocated with ``var``: one copy per
    worker under ``local_sgd``); both None unless ``local_copies``."""
    untracked = functools.partial(hooks_compat.set_untracked_attribute, shard)
    untracked("gen", None)
    untracked("gen_view", None)
    if not local_copies:
        return
    from tf_asyncps.core import placement
    zeros = tf.zeros([int(var.shape[0])], tf.int64)
    with placement.beside(var):
        untracked("gen", tf.Variable(zeros, trainable=False, name=f"{name}_generation"))
    # Not beside: the strategy tracks it, so local_sgd gives it local copies.
    with tf.init_scope(), tf.variable_creator_scope(strategy_compat.colocating_creator(var)):
        untracked("gen_view", tf.Variable(zeros, trainable=False,
                                          name=f"{name}_generation_pulled"))


def find_in_training(shard, ids, step):
    """``(rows, usable)``: the global rows of the distinct ``ids`` (int64
    ``[n]``, -1: none), admitting and counting in the shard's critical
    section, and which of them the step may read (bool ``[n]``): those
    found, and under ``local_sgd`` those whose generation is the one the
    worker pulled."""
    # Copied here first (the caller's device: the shard's ps): the critical
    # section makes its lock wait for every input's op, and the worker's op
    # would cost a control message to the ps each step.
    ids, step = tf.identity(ids), tf.identity(step)
    if shard.gen is None:
        rows = shard.lock.execute(lambda: shard.find(ids, step, admit=True),
                                  exclusive_resource_access=False)
        return rows, rows >= 0

    def find():
        rows = shard.find(ids, step, admit=True)
        local = tf.maximum(rows - shard.offset, 0)
        return rows, tf.gather(shard.gen, local)

    rows, generations = shard.lock.execute(find, exclusive_resource_access=False)
    local = tf.maximum(rows - shard.offset, 0)
    # The worker's copy (the step reads gen_view's local copy).
    pulled = tf.gather(shard.gen_view, local)
    return rows, (rows >= 0) & tf.equal(generations, pulled)


class LocalGuard:
    """The exchange of one table shard under ``local_sgd`` (the interface
    of ``LocalCopies.guard_rows``).

    Args:
      table: the DynamicTable.
      shard: its shard (a ``_Shard``, made with ``local_copies``).
    """

    def __init__(self, table, shard):
        self.table, self.shard = table, shard

    @property
    def view(self):
        """The int64 ``[rows]`` variable of the generations a worker pulled."""
        return self.shard.gen_view

    def push(self, delta, view, g_after):
        """On the shard's ps, in its critical section: the eviction pass due
        at global step ``g_after`` (None: none), then ``delta`` (float
        ``[rows, output_dim]``) added to the rows whose generation equals
        ``view`` (int64 ``[rows]``). Returns the op."""
        shard, table = self.shard, self.table
        if g_after is not None:
            table.prepare()
        with tf.device(shard.device):
            g = None if g_after is None else tf.cast(tf.identity(g_after), tf.int64)

            def run():
                ops = []
                if g is not None:
                    period = g // table.evict_every
                    ops.append(tf.cond(
                        period > shard.passes.read_value(),
                        lambda: eviction_lib.evict_shard(
                            shard, g, period, table.eviction, table.evict_every,
                            table.ttl_steps, [(shard.var, table.initializer)]),
                        tf.no_op))
                with tf.control_dependencies(ops):
                    same = tf.equal(shard.gen.read_value(), view)
                    rows = tf.reshape(same, [-1] + [1] * (delta.shape.rank - 1))
                    return shard.var.assign_add(tf.where(rows, delta, tf.zeros_like(delta)),
                                                read_value=False)

            return shard.lock.execute(run, exclusive_resource_access=False)

    def read(self):
        """``(values, generations)`` of the shard, read together on its ps."""
        shard = self.shard
        with tf.device(shard.device):
            return shard.lock.execute(
                lambda: (tf.identity(shard.var.read_value()), shard.gen.read_value()),
                exclusive_resource_access=False)

    def slots(self, optimizer):
        """``[(slot variable, initial value)]``: ``optimizer``'s slots of the
        shard (made on the chief under ``local_sgd``: any device)."""
        from tf_asyncps.dynamic import slots as slots_lib
        return slots_lib.optimizer_slots(optimizer, self.shard.var, any_device=True)

