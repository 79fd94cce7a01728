"""core/table_seam.py: the one seam through which tables talk to the engine
(TableHooks registered with extended.register_table, kept in Tables)."""

import pytest
import tensorflow as tf

from local_engine import local_engine
from tf_asyncps.core import table_seam


class _Var:
    def __init__(self, name):
        self.name = name


def test_tables_call_only_the_hooks_of_tables_owning_a_step_variable():
    """Each hook runs for a step holding one of its table's variables, in
    registration order; None ops are dropped; a gradient goes through the
    filters of the tables owning its variable only."""
    a, b, other = _Var("a"), _Var("b"), _Var("other")
    calls = []
    tables = table_seam.Tables()
    assert not tables.filter_updates
    for var in (a, b):
        tables.register(table_seam.TableHooks(
            name=var.name, owns=lambda v, var=var: v is var,
            before_update=lambda opt, vs, n=var.name: calls.append(("before", n)) or n,
            filter_gradient=lambda g, v, n=var.name: g + [n],
            after_update=lambda opt, vs, step, n=var.name: calls.append(("after", n, step))))
    assert tables.filter_updates
    assert tables.before_update(None, [b, a, other]) == ["a", "b"]
    assert tables.after_update(None, [b], 7) == []  # the hook returned None
    assert calls == [("before", "a"), ("before", "b"), ("after", "b", 7)]
    assert tables.filter_gradient([], a) == ["a"]
    assert tables.filter_gradient([], other) == []
    assert tables.before_update(None, [other]) == []


def test_rows_on_ps_asks_each_tables_record():
    """rows_on_ps is True for indices one table's GatheredRows recorded in a
    traced graph, False for others and for eager tensors."""
    first, second = table_seam.GatheredRows(), table_seam.GatheredRows()
    tables = table_seam.Tables()
    tables.register(table_seam.TableHooks(name="t0", owns=lambda v: False,
                                          rows_on_ps=first.holds))
    tables.register(table_seam.TableHooks(name="t1", owns=lambda v: False,
                                          rows_on_ps=second.holds))

    @tf.function
    def answers():
        x, y, z = tf.range(3), tf.range(4), tf.range(5)
        first.add(x)
        second.add(y)
        return [tables.rows_on_ps(t) for t in (x, y, z)]

    assert answers() == [True, True, False]
    eager = tf.range(2)
    first.add(eager)
    assert tables.rows_on_ps(eager) is False


def test_register_table_refuses_anything_but_table_hooks():
    engine = local_engine("async")
    with pytest.raises(TypeError, match="TableHooks"):
        engine.register_table(lambda *a: None)
    engine.stop_watchdogs()


def test_the_default_strategy_is_no_seam():
    """A layer outside AsyncParameterServerStrategy finds no seam (and the
    engine does not gate updates under it)."""
    assert table_seam.seam_in_scope() is None
    assert not isinstance(tf.distribute.get_strategy().extended, table_seam.StrategySeam)
