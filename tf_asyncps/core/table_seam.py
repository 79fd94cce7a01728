"""How a table talks to the engine: one declared seam.

A table that keeps state beside its variables (a dynamic table's id -> row
map, counts and eviction; a fixed table's per-row marks) hands the engine a
:class:`TableHooks` through ``strategy.extended.register_table(hooks)``;
the strategy's ``extended`` object is a :class:`StrategySeam`, so a layer
finds the seam by ``isinstance``, never by probing attribute names. The
engine keeps the registered hooks in a :class:`Tables` and calls them where
the update runs (core/update.py)::

    to the ps:  rows_on_ps(indices): a gather's rows that stay on the ps;
                before_push(grad, var, optimizer) per gradient, on the worker
    update:     before_update(optimizer, variables), then
                filter_gradient(grad, var) per gradient, then the optimizer
    after:      after_update(optimizer, variables, global_step)

Each hook runs only for a step whose variables include one the table owns
(``owns``). A table on per-worker copies (``local_sgd``, a route's part on
local steps) hands the engine its rows' exchange guards
(``local_guards``; core/local_copies.py's ``guard_rows``).
"""

import dataclasses
import weakref
from typing import Any, Callable, List, Optional, Sequence, Tuple

import tensorflow as tf

__all__ = ["TableHooks", "Tables", "GatheredRows", "StrategySeam", "seam_in_scope"]


@dataclasses.dataclass(frozen=True)
class TableHooks:
    """What one table asks of the engine. Every hook is optional.

    Attributes:
      name: the table's name, for messages.
      owns: ``owns(variable) -> bool``: whether a variable (a shard of a
        partitioned table too) is this table's.
      before_update: ``fn(optimizer, variables) -> op or None``, traced right
        before the optimizer's own update of a step holding one of the
        table's variables; the update waits for its op (a dynamic table moves
        slot rows a restore brought).
      filter_gradient: ``fn(gradient, variable) -> gradient``, traced on the
        variable's ps after the policy's decision (an aggregator's: on the
        round's mean), right before the optimizer's update; called for the
        table's own variables only (a dynamic table drops evicted rows).
      after_update: ``fn(optimizer, variables, global_step) -> op or None``,
        traced after each update (applied or dropped) of a step holding one
        of the table's variables; ``global_step`` is the int64 scalar after
        the step. Under the update lock it runs holding the lock.
      before_push: ``fn(gradient, variable, optimizer) -> gradient``, traced
        on the worker for each of the table's own variables, once the step's
        gradient has one row per distinct id and before it crosses to the ps
        (an embedding cache keeps the rows it defers:
        core/embedding_cache.py).
      rows_on_ps: ``fn(indices) -> bool``: whether ``indices`` (a 1-D int
        tensor of a traced graph) are rows the table gathered on their ps,
        distinct; their gradient then keeps them there (core/grads.rows_on_ps).
      local_guards: ``[(variable, guard)]``: the exchange of each variable
        on per-worker copies goes through its guard
        (``LocalCopies.guard_rows``); used only where local copies exist.
    """

    name: str
    owns: Callable[[Any], bool]
    before_update: Optional[Callable] = None
    filter_gradient: Optional[Callable] = None
    after_update: Optional[Callable] = None
    before_push: Optional[Callable] = None
    rows_on_ps: Optional[Callable[[tf.Tensor], bool]] = None
    local_guards: Sequence[Tuple[Any, Any]] = ()


class Tables:
    """The tables registered with one engine, in registration order."""

    def __init__(self):
        self._hooks: List[TableHooks] = []

    def register(self, hooks: TableHooks) -> None:
        """Adds ``hooks``.

        Raises:
          TypeError: ``hooks`` is not a TableHooks.
        """
        if not isinstance(hooks, TableHooks):
            raise TypeError(f"register_table takes a tf_asyncps.core.table_seam.TableHooks, "
                            f"got {type(hooks).__name__}.")
        self._hooks.append(hooks)

    def __iter__(self):
        return iter(list(self._hooks))

    def _owning(self, variables, kind):
        return [fn for fn in (getattr(h, kind) for h in self._hooks
                              if any(h.owns(v) for v in variables)) if fn is not None]

    @property
    def filter_updates(self) -> bool:
        """Whether any table has a before-update hook or a gradient filter."""
        return any(h.before_update is not None or h.filter_gradient is not None
                   for h in self._hooks)

    def before_update(self, optimizer, variables) -> list:
        """The before-update hooks' ops (None dropped)."""
        ops = [fn(optimizer, variables) for fn in self._owning(variables, "before_update")]
        return [op for op in ops if op is not None]

    def filter_gradient(self, grad, var):
        """``grad`` through the gradient filters of the tables owning ``var``."""
        for h in self._hooks:
            if h.filter_gradient is not None and h.owns(var):
                grad = h.filter_gradient(grad, var)
        return grad

    def after_update(self, optimizer, variables, global_step) -> list:
        """The after-update hooks' ops (None dropped)."""
        ops = [fn(optimizer, variables, global_step)
               for fn in self._owning(variables, "after_update")]
        return [op for op in ops if op is not None]

    def before_push(self, grad, var, optimizer):
        """``grad`` through the before-push hooks of the tables owning ``var``."""
        for h in self._hooks:
            if h.before_push is not None and grad is not None and h.owns(var):
                grad = h.before_push(grad, var, optimizer)
        return grad

    @property
    def pushes_deferred(self) -> bool:
        """Whether any table has a before-push hook."""
        return any(h.before_push is not None for h in self._hooks)

    def rows_on_ps(self, indices) -> bool:
        """Whether a table gathered ``indices`` on its ps (see TableHooks)."""
        return any(h.rows_on_ps(indices) for h in self._hooks if h.rows_on_ps is not None)


class GatheredRows:
    """A table's record of the index tensors it gathered on its ps: what its
    ``rows_on_ps`` hook answers. Weak on the graphs: a traced function's
    graph goes with it."""

    def __init__(self):
        self._names = weakref.WeakKeyDictionary()  # graph -> tensor names

    def add(self, indices) -> None:
        """Records ``indices`` (a 1-D int tensor of a traced graph; eager
        tensors are not recorded)."""
        if not tf.executing_eagerly():
            self._names.setdefault(indices.graph, set()).add(indices.name)

    def holds(self, indices) -> bool:
        """Whether :meth:`add` recorded ``indices``."""
        try:
            return indices.name in self._names.get(indices.graph, ())
        except AttributeError:  # an eager tensor has neither
            return False


class StrategySeam:
    """What the strategy's ``extended`` object offers the code below it
    (layers, tables, the engine): a base class, so they find it by
    ``isinstance``.

    Attributes:
      gates_updates: its ``_update`` gates each variable's update on the
        step's non-finite check (core/nonfinite_guard.py).
    """

    gates_updates = False

    def register_table(self, hooks: TableHooks) -> None:
        """Registers ``hooks`` (a :class:`TableHooks`) with the engine."""
        raise NotImplementedError

    @property
    def local_copies(self) -> bool:
        """Whether variables may train on per-worker copies (``local_sgd``, a
        route's part on local steps): a dynamic table then keeps row
        generations (tf_asyncps/dynamic/generations.py)."""
        raise NotImplementedError

    @property
    def global_step(self) -> tf.Variable:
        """The int64 global step variable (on ps 0)."""
        raise NotImplementedError


def seam_in_scope() -> Optional[StrategySeam]:
    """The extended object of the strategy in scope when it is a
    :class:`StrategySeam`, else None."""
    if not tf.distribute.has_strategy():
        return None
    extended = tf.distribute.get_strategy().extended
    return extended if isinstance(extended, StrategySeam) else None
