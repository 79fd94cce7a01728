"""Keras 3 optimizer slots of a partitioned weight in ``tf.train.Checkpoint``
(tf_asyncps.compat.sharded_slots), in one process: an Embedding whose table is
a ``ShardedVariable`` made by hand, the optimizer built on its shards as the
Keras 3 trainer builds it. On the cluster: tests/test_dynamic_cluster.py
(``test_keras3_checkpoint_round_trip``, a DynamicEmbedding 2 -> 3 shards)."""

import numpy as np
import pytest
import tensorflow as tf

keras = pytest.importorskip("keras")

from tf_asyncps.compat import call_scopes  # noqa: E402
from tf_asyncps.compat import hooks as hooks_compat
from tf_asyncps.compat import sharded_slots  # noqa: E402
from tf_asyncps.compat import variables as variables_compat  # noqa: E402

SV = tf.__internal__.distribute.ShardedVariable
ROWS = 6


@pytest.fixture(autouse=True, scope="module")
def _hooks():
    # What the strategy installs, in its order: call_scopes hooks the same
    # add_variable_from_reference first (its slots went untagged, so
    # positional, until hook_method kept both hooks).
    call_scopes.install()
    assert sharded_slots.checkpoint_partitioned_whole()


def _model(sizes):
    """Embedding(6, 2) -> Flatten -> Dense(1); the table split in ``sizes``
    rows per shard (``[6]``: not partitioned)."""
    model = keras.Sequential([keras.Input((1,), dtype="int64"),
                              keras.layers.Embedding(ROWS, 2, name="emb"),
                              keras.layers.Flatten(), keras.layers.Dense(1, name="d")])
    table = model.layers[0].embeddings
    if len(sizes) > 1:
        parts = [tf.Variable(tf.zeros([n, 2]), name=f"emb/embeddings/part_{i}")
                 for i, n in enumerate(sizes)]
        table._value = SV(parts, name="emb/embeddings")
    else:
        table.assign(tf.zeros([ROWS, 2]))
    model.layers[-1].kernel.assign(tf.ones([2, 1]))
    model.layers[-1].bias.assign(tf.zeros([1]))
    return model


def _sources(model):
    """The trainer's order: each partitioned weight replaced by its shards."""
    out = []
    for v in model.trainable_variables:
        out.extend(variables_compat.sharded_value(v) or [v])
    return out


def _grads(model, step):
    """Step ``step``'s gradients: the table's (6 x 2, by global row) split
    by this model's shards, then the Dense kernel's and bias's."""
    table = tf.reshape(tf.range(12, dtype=tf.float32), [ROWS, 2]) * (step + 1) / 4.0
    out, row = [], 0
    for v in _sources(model):
        if len(v.shape) == 2 and v.shape[1] == 2:  # the table or one of its shards
            out.append(table[row:row + v.shape[0]])
            row += v.shape[0]
        else:
            out.append(tf.ones(v.shape) * (step + 1))
    return out


def _train(model, opt, steps, first=0):
    for step in range(first, first + steps):
        opt.apply(_grads(model, step), _sources(model))


def _state(model, opt):
    """{slot name: the table's slot, whole, by global row}, the Dense
    slots, the weights, and iterations."""
    table = {}
    for v in opt.variables[2:]:
        name = v.name.rsplit("_", 1)[-1]
        if "emb" in v.name:
            table.setdefault(name, []).append(v.numpy())
    return ({k: np.concatenate(v) for k, v in table.items()},
            [v.numpy() for v in opt.variables[2:] if "emb" not in v.name],
            [np.asarray(variables_compat.tf_value(v)) if not variables_compat.sharded_value(v) else
             np.concatenate([p.numpy() for p in variables_compat.sharded_value(v)])
             for v in model.trainable_variables],
            int(opt.iterations.numpy()))


def _assert_same(a, b):
    assert sorted(a[0]) == sorted(b[0])
    for k in a[0]:
        np.testing.assert_array_equal(a[0][k], b[0][k])
    for x, y in zip(a[1], b[1]):
        np.testing.assert_array_equal(x, y)
    for x, y in zip(a[2], b[2]):
        np.testing.assert_array_equal(x, y)
    assert a[3] == b[3]


@pytest.mark.parametrize("name", ["Adagrad", "Adam"])
@pytest.mark.parametrize("sizes,again", [([3, 3], [3, 3]), ([3, 3], [2, 2, 2]),
                                         ([2, 2, 2], [3, 3]), ([3, 3], [5, 1])],
                         ids=["same", "2to3", "3to2", "2to2_uneven"])
@pytest.mark.parametrize("built", [False, True], ids=["restore_then_build",
                                                      "build_then_restore"])
def test_slots_come_back_by_global_row_on_any_shard_count(tmp_path, name, sizes, again,
                                                          built):
    """Saved on ``sizes`` shards after 3 steps, restored onto ``again``: the
    table's slots (Adagrad's accumulator, Adam's momentum and velocity),
    the Dense slots and iterations come back exact, and 2 more steps give
    exactly what the saved model gets from the same 2 steps. Before
    compat.sharded_slots, 2 -> 3 left the table's slots at their initial
    values (Adagrad's accumulators up to 106.0 back at 0.1), with no error."""
    model, opt = _model(sizes), getattr(keras.optimizers, name)(0.1)
    opt.build(_sources(model))
    _train(model, opt, 3)
    path = tf.train.Checkpoint(model=model, optimizer=opt).write(str(tmp_path / "ckpt"))
    saved = _state(model, opt)
    assert max(float(np.abs(v).max()) for v in saved[0].values()) > 1.0  # it can fail

    model2, opt2 = _model(again), getattr(keras.optimizers, name)(0.1)
    if built:
        opt2.build(_sources(model2))
        tf.train.Checkpoint(model=model2, optimizer=opt2).read(path).assert_consumed()
        assert not sharded_slots.build_for_pending_restore(opt2, _sources(model2))
    else:
        tf.train.Checkpoint(model=model2, optimizer=opt2).read(path)
        assert sharded_slots.build_for_pending_restore(opt2, _sources(model2))
    _assert_same(_state(model2, opt2), saved)
    assert len(opt2.variables) == 2 + len(saved[0]) * (len(again) + 2)  # nothing doubled

    _train(model, opt, 2, first=3)
    _train(model2, opt2, 2, first=3)
    _assert_same(_state(model2, opt2), _state(model, opt))


@pytest.mark.parametrize("sizes,again", [([3, 3], [2, 2, 2]), ([2, 2, 2], [3, 3])],
                         ids=["2to3", "3to2"])
def test_a_loss_scale_optimizer_restores_its_inner_slots(tmp_path, sizes, again):
    """mixed_float16's LossScaleOptimizer: its inner optimizer holds the slots."""
    make = lambda: keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(0.1))
    model, opt = _model(sizes), make()
    opt.build(_sources(model))
    _train(model, opt, 3)
    path = tf.train.Checkpoint(model=model, optimizer=opt).write(str(tmp_path / "ckpt"))
    model2, opt2 = _model(again), make()
    tf.train.Checkpoint(model=model2, optimizer=opt2).read(path)
    assert sharded_slots.build_for_pending_restore(opt2, _sources(model2))
    _assert_same(_state(model2, opt2.inner_optimizer), _state(model, opt.inner_optimizer))
    _train(model, opt, 2, first=3)
    _train(model2, opt2, 2, first=3)
    _assert_same(_state(model2, opt2.inner_optimizer), _state(model, opt.inner_optimizer))


def test_checkpoint_holds_each_slot_whole(tmp_path):
    """One tensor per slot of the partitioned table (6 rows), none per
    shard: the checkpoint reads the same on any shard count."""
    model, opt = _model([3, 3]), keras.optimizers.Adam(0.1)
    opt.build(_sources(model))
    path = tf.train.Checkpoint(model=model, optimizer=opt).write(str(tmp_path / "ckpt"))
    shapes = {n: s for n, s in tf.train.list_variables(path) if n.startswith("optimizer/")}
    assert shapes == {
        "optimizer/_iterations/.ATTRIBUTES/VARIABLE_VALUE": [],
        "optimizer/_learning_rate/.ATTRIBUTES/VARIABLE_VALUE": [],
        "optimizer/_trainable_variables/0/.ATTRIBUTES/VARIABLE_VALUE": [2, 1],
        "optimizer/_trainable_variables/1/.ATTRIBUTES/VARIABLE_VALUE": [1],
        "optimizer/_variables/2/.ATTRIBUTES/VARIABLE_VALUE": [2, 1],
        "optimizer/_variables/3/.ATTRIBUTES/VARIABLE_VALUE": [2, 1],
        "optimizer/_variables/4/.ATTRIBUTES/VARIABLE_VALUE": [1],
        "optimizer/_variables/5/.ATTRIBUTES/VARIABLE_VALUE": [1],
        f"optimizer/{sharded_slots.WHOLE_SLOTS}/0_momentum/.ATTRIBUTES/VARIABLE_VALUE": [6, 2],
        f"optimizer/{sharded_slots.WHOLE_SLOTS}/0_velocity/.ATTRIBUTES/VARIABLE_VALUE": [6, 2],
    }


def test_a_table_of_another_size_fails_with_the_shapes(tmp_path):
    model, opt = _model([3, 3]), keras.optimizers.Adagrad(0.1)
    opt.build(_sources(model))
    path = tf.train.Checkpoint(optimizer=opt).write(str(tmp_path / "ckpt"))
    parts = [tf.Variable(tf.zeros([2, 2]), name=f"t/part_{i}") for i in range(2)]
    table = SV(parts, name="t")  # noqa: F841 (the shards know it by a weak reference)
    opt2 = keras.optimizers.Adagrad(0.1)
    tf.train.Checkpoint(optimizer=opt2).read(path)
    with pytest.raises(ValueError, match=r"with 6 rows; this model's weight has 4\. Restore "
                                         r"into a model whose weight has the saved shape"):
        sharded_slots.build_for_pending_restore(opt2, parts)


def test_sharded_slots_onto_an_unpartitioned_table_fail_loudly(tmp_path):
    """2 shards -> 1 (not partitioned): the whole slots have nowhere to go;
    the first update under the strategy says so instead of training on."""
    model, opt = _model([3, 3]), keras.optimizers.Adagrad(0.1)
    opt.build(_sources(model))
    path = tf.train.Checkpoint(model=model, optimizer=opt).write(str(tmp_path / "ckpt"))
    model2, opt2 = _model([6]), keras.optimizers.Adagrad(0.1)
    tf.train.Checkpoint(model=model2, optimizer=opt2).read(path)
    with pytest.raises(ValueError, match=r"holds the optimizer slots of partitioned weights"
                                         r".*Adagrad here updates no partitioned weight"):
        sharded_slots.build_for_pending_restore(opt2, _sources(model2))


def test_unsharded_slots_onto_a_partitioned_table_fail_loudly(tmp_path):
    """1 -> 2 shards: the saved slots of the table are positions that the
    partitioned optimizer's checkpoint does not have; refused, not restarted."""
    model, opt = _model([6]), keras.optimizers.Adagrad(0.1)
    opt.build(_sources(model))
    _train(model, opt, 1)
    path = tf.train.Checkpoint(model=model, optimizer=opt).write(str(tmp_path / "ckpt"))
    model2, opt2 = _model([3, 3]), keras.optimizers.Adagrad(0.1)
    tf.train.Checkpoint(model=model2, optimizer=opt2).read(path)
    with pytest.raises(ValueError, match=r"holds no whole slots of partitioned weights.*"
                                         r"tf.train.Checkpoint\(model=model\)"):
        sharded_slots.build_for_pending_restore(opt2, _sources(model2))


def test_nothing_partitioned_nothing_built():
    """Keras builds an optimizer with no shard among its variables itself."""
    model, opt = _model([6]), keras.optimizers.Adagrad(0.1)
    assert not sharded_slots.build_for_pending_restore(opt, _sources(model))
    assert not opt.built


def test_slot_creation_runs_both_hooks_of_the_strategy():
    """call_scopes (installed first, as the strategy does) and sharded_slots
    hook the same ``TFOptimizer.add_variable_from_reference``: every slot is
    made with CREATING_SLOT set and the shards' slots are tagged (so saved
    whole). Since 7e63bfa until hook_method kept both, only the first hook
    ran: no tag, the shards' slots saved by position, and a restore onto 3
    shards put the Dense kernel's slot into a table shard's."""
    model, opt = _model([3, 3]), keras.optimizers.Adam(0.1)
    seen = []

    def creator(next_creator, **kwargs):
        seen.append((kwargs["name"], call_scopes.CREATING_SLOT.get() is opt))
        return next_creator(**kwargs)

    with tf.variable_creator_scope(creator):
        opt.build(_sources(model))
    assert [s for _, s in seen] == [True] * 8, seen  # 4 weights (2 shards), 2 slots each
    tags = [(v.name, sharded_slots._shard_of(v)) for v in opt.variables]
    assert [(n, t[1]) for n, t in tags if t is not None] == [
        ("emb_embeddings_part_0_0_momentum", "momentum"),
        ("emb_embeddings_part_0_0_velocity", "velocity"),
        ("emb_embeddings_part_1_0_momentum", "momentum"),
        ("emb_embeddings_part_1_0_velocity", "velocity")]


def test_hook_method_keeps_each_hook_once():
    """Two hooks on one method both run (the later one outside); the same
    hook again (same function or same key), on the class or on a subclass
    that inherits the method, is not added twice."""
    class Base:
        def f(self):
            return ["f"]

    class Sub(Base):
        pass

    def tag(original):
        return lambda self: original(self) + ["tag"]

    def scope(original):
        return lambda self: ["scope"] + original(self)

    assert hooks_compat.hook_method(Base, "f", scope)
    assert hooks_compat.hook_method(Base, "f", tag)
    assert not hooks_compat.hook_method(Base, "f", scope)
    assert not hooks_compat.hook_method(Sub, "f", tag)
    assert hooks_compat.hook_method(Base, "f", lambda original: original, key="k")
    assert not hooks_compat.hook_method(Base, "f", lambda original: None, key="k")
    assert Sub().f() == ["scope", "f", "tag"]
