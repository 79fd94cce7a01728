"""Per-row dirty marks of embedding tables, set on the ps by each update,
and their readers (delta backups, a serving stream): the rows written since
a reader's last read (tf_asyncps/callbacks/delta_chain.py writes them).

Dirty marks (:class:`DirtyRows`): an int8 variable of shape ``[rows]``
beside each table variable (each shard of a partitioned one), created on
that variable's device, set to 1 at the rows of every sparse gradient the
engine applies (a dense gradient marks every row). The mark is written on
the ps inside the update from indices already there: no byte more on the
wire. :meth:`DirtyRows.clear` zeroes the marks after a save.

Several readers (the backups, a serving stream; as TorchRec's
ModelDeltaTracker has consumers) share one mark per row: the update sets
all 8 bits (one scatter, whatever the number of readers) and each reader
(:class:`DirtyReader`, :func:`shared_reader`) owns one bit, reads the rows
with its bit set and clears only its bit.
"""

import weakref
from typing import Dict, Sequence, Tuple

import numpy as np
import tensorflow as tf

__all__ = ["DirtyRows", "DirtyReader", "shared_reader"]

_ALL = -1  # int8 with its 8 bits set: every reader's
_READER_BITS = 8


def _backing(var):
    """The tf.Variable behind a Keras 3 variable (its ``value``), else ``var``."""
    return var if isinstance(var, tf.Variable) else getattr(var, "value", var)


class DirtyRows:
    """Per-row dirty marks of embedding table variables, set on the ps by
    each update (see the module docstring).

    Args:
      variables: the table variables (each shard of a partitioned table;
        a 2-D ``tf.Variable`` each), in a strategy's scope or not: each mark
        is created on its variable's device (in a strategy's scope,
        ``colocate_vars_with`` it).

    Attributes:
      marks: ``{variable name: int8 tf.Variable [rows]}``.

    Raises:
      ValueError: a variable is not 2-D with a known row count.
    """

    def __init__(self, variables: Sequence[tf.Variable]):
        self.marks: Dict[str, tf.Variable] = {}
        self._by_id: Dict[int, tf.Variable] = {}
        self.bits_taken = 0  # readers' bits (DirtyReader)
        for v in variables:
            if v.shape.rank != 2 or v.shape[0] is None:
                raise ValueError(f"DirtyRows: {v.name} has shape {v.shape}; give 2-D table "
                                 "variables (rows, dim) with a known row count.")
            # Under a strategy: on the shard's ps, never partitioned.
            place = (tf.distribute.get_strategy().extended.colocate_vars_with(v)
                     if tf.distribute.has_strategy() else tf.device(v.device))
            with tf.init_scope(), place:
                mark = tf.Variable(tf.zeros([v.shape[0]], tf.int8), trainable=False,
                                   name=v.name.split(":")[0].replace("/", "_") + "_dirty",
                                   synchronization=tf.VariableSynchronization.ON_WRITE,
                                   aggregation=tf.VariableAggregation.NONE)
            self.marks[v.name] = mark
            self._by_id[id(v)] = mark

    def _key(self, var) -> int:
        # Keras 3 updates its Variable; the mark is keyed by the tf.Variable behind it.
        return id(var) if id(var) in self._by_id else id(_backing(var))

    def owns(self, var) -> bool:
        """Whether ``var`` (or the tf.Variable behind a Keras 3 one) is tracked."""
        return self._key(var) in self._by_id

    def mark(self, grad, var):
        """Marks the rows of ``grad`` dirty on ``var``'s device and returns
        ``grad`` itself: a gradient filter
        (core/table_seam.TableHooks.filter_gradient).

        The very object comes back, not a copy behind a control dependency:
        Keras 3's row-wise update (core/rowwise.py) knows a gradient by
        identity and applies it with the per-occurrence squares the worker
        sent; a copy made it fall back to the squares of the summed rows
        (Adagrad's accumulator off). The mark runs anyway: a traced step
        runs every stateful op it holds (tf.function's automatic control
        dependencies), eagerly it runs here, and a reader reads the marks
        only at a quiet point, after the step has ended."""
        mark = self._by_id.get(self._key(var))
        if mark is None or grad is None:
            return grad
        with tf.device(mark.device):
            if isinstance(grad, tf.IndexedSlices):
                ids = tf.cast(grad.indices, tf.int64)
                mark.scatter_update(tf.IndexedSlices(
                    tf.fill(tf.shape(ids), tf.constant(_ALL, tf.int8)), ids))
            else:
                mark.assign(tf.fill(tf.shape(mark), tf.constant(_ALL, tf.int8)))
        return grad

    def hooks(self, name: str = "dirty_rows"):
        """A ``TableHooks`` to register with ``strategy.extended.register_table``."""
        from tf_asyncps.core.table_seam import TableHooks
        return TableHooks(name=name, owns=self.owns, filter_gradient=self.mark)

    def mark_of(self, var) -> tf.Variable:
        """The mark variable of ``var`` (KeyError if not tracked)."""
        return self._by_id[self._key(var)]

    def dirty_ids(self, var) -> np.ndarray:
        """Rows of ``var`` marked since the last :meth:`clear` (int64 ``[k]``, sorted)."""
        return np.flatnonzero(self.mark_of(var).numpy()).astype(np.int64)

    def clear(self) -> None:
        """Zeroes every mark, every reader's bit (after a save, at a quiet point)."""
        for mark in self.marks.values():
            mark.assign(tf.zeros_like(mark))


class DirtyReader:
    """One reader's view of shared dirty marks: the rows written since this
    reader's last :meth:`clear`, whatever the other readers cleared.

    Args:
      marks: ``[(variable, DirtyRows tracking it)]``.
      bit: int in [0, 8), this reader's bit in each mark.
      name: the reader's name, for messages.
    """

    def __init__(self, marks, bit: int, name: str):
        self.name = name
        self.bit = int(bit)
        self._mask = np.int8(np.uint8(1 << self.bit).view(np.int8))
        self._rows = {id(v): (v, rows) for v, rows in marks}

    def _get(self, var):
        return self._rows.get(id(var)) or self._rows.get(
            id(_backing(var)))

    def owns(self, var) -> bool:
        """Whether ``var`` (or the tf.Variable behind a Keras 3 one) is read."""
        return self._get(var) is not None

    def mark(self, grad, var):
        """``grad`` after its rows are marked (every reader's bit): for a
        one-process loop without the strategy's table seam; ``grad`` as it
        is for a variable not read."""
        owner = self._get(var)
        return grad if owner is None else owner[1].mark(grad, var)

    def mark_of(self, var) -> tf.Variable:
        """The shared int8 mark variable of ``var`` (KeyError if not read)."""
        owner = self._get(var)
        if owner is None:
            raise KeyError(f"{self.name}: {getattr(var, 'name', var)} is not read")
        return owner[1].mark_of(var)

    @property
    def mask(self) -> int:
        """This reader's bit as an int (``1 << bit``)."""
        return 1 << self.bit

    def dirty_ids(self, var) -> np.ndarray:
        """Rows of ``var`` written since this reader's last :meth:`clear`
        (int64 ``[k]``, sorted)."""
        _, rows = self._get(var)
        return np.flatnonzero(rows.mark_of(var).numpy() & self._mask).astype(np.int64)

    def clear(self) -> None:
        """Clears this reader's bit in every mark (on each mark's device);
        the other readers' bits stay. Call it at a quiet point (no update
        in flight), right after reading."""
        keep = tf.constant(~self._mask, tf.int8)
        for var, rows in self._rows.values():
            mark = rows.mark_of(var)
            with tf.device(mark.device):
                mark.assign(tf.bitwise.bitwise_and(mark, keep))


#: id(variable) -> (weak reference to it, the DirtyRows tracking it).
_SHARED: Dict[int, Tuple[weakref.ref, DirtyRows]] = {}


def shared_reader(variables: Sequence[tf.Variable], name: str) -> DirtyReader:
    """A new reader of the dirty marks of ``variables``, shared by every
    reader of the same variables: the marks are made (and registered with
    the strategy's table seam in scope, when it is this package's) for the
    variables without any yet, and the reader takes a bit free in all of
    them. Call it before the step that updates the variables is traced
    (a traced step marks only with the filters registered before).

    Args:
      variables: the table variables (2-D, each shard of a partitioned one).
      name: the reader's name (messages).

    Raises:
      ValueError: 8 readers read these marks already; or a variable is not 2-D.
    """
    from tf_asyncps.core.table_seam import seam_in_scope
    for key in [k for k, (ref, _) in _SHARED.items() if ref() is None]:
        del _SHARED[key]
    new = [v for v in variables
           if id(v) not in _SHARED or _SHARED[id(v)][0]() is not v]
    if new:
        rows = DirtyRows(new)
        seam = seam_in_scope()
        if seam is not None:
            seam.register_table(rows.hooks("dirty_rows"))
        for v in new:
            _SHARED[id(v)] = (weakref.ref(v), rows)
    pairs = [(v, _SHARED[id(v)][1]) for v in variables]
    owners = list({id(r): r for _, r in pairs}.values())
    taken = 0
    for r in owners:
        taken |= r.bits_taken
    free = [b for b in range(_READER_BITS) if not taken >> b & 1]
    if not free:
        raise ValueError(f"shared_reader({name!r}): {_READER_BITS} readers read these tables' "
                         "dirty marks already; use fewer DeltaPublisher/StepBackup objects.")
    for r in owners:
        r.bits_taken |= 1 << free[0]
    reader = DirtyReader(pairs, free[0], name)
    weakref.finalize(reader, _release, owners, free[0])  # a dropped reader frees its bit
    return reader


def _release(owners, bit: int) -> None:
    for r in owners:
        r.bits_taken &= ~(1 << bit)
