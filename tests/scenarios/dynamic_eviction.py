"""Scenarios of tests/test_dynamic_eviction.py: DynamicEmbedding eviction
on a cluster with legacy tf_keras optimizers, and under local_sgd."""

import os
import tempfile

import numpy as np
import tensorflow as tf
import tf_keras

from scenarios import cluster, scenario
from scenarios.dynamic_cluster import _fit, _model, _shifted_data, _strategy
from tf_asyncps.layers import DynamicEmbedding

#: Legacy tf_keras optimizers by name, and their learning rates.
LEGACY = {"adagrad": lambda: tf_keras.optimizers.legacy.Adagrad(0.1),
          "adam": lambda: tf_keras.optimizers.legacy.Adam(0.01)}


def _legacy_model(strategy, optimizer, capacity, evict_every):
    with strategy.scope():
        layer = DynamicEmbedding(4, capacity=capacity, evict_every=evict_every,
                                 initializer="zeros")
        model = _model(layer)
        model.compile(LEGACY[optimizer](), "mse")
    return model, layer


def _shard_state(model, layer):
    """Per shard: count, key, rows and every slot (name -> array) of the
    table shard, read eagerly on the chief."""
    opt, out = model.optimizer, []
    initial = {"accumulator": opt.get_config().get("initial_accumulator_value", 0.0),
               "m": 0.0, "v": 0.0}
    for shard in layer.dynamic_table.shards:
        # By the public get_slot, not the table's own search (dt.optimizer_slots).
        slots = [(n, opt.get_slot(shard.var, n).numpy(), float(initial[n]))
                 for n in opt.get_slot_names() if _has_slot(opt, shard.var, n)]
        out.append({"count": shard.count.numpy(), "key": shard.key.numpy(),
                    "rows": shard.var.numpy(), "slots": slots})
    return out


def _has_slot(opt, var, name):
    try:
        opt.get_slot(var, name)
    except KeyError:  # not built yet
        return False
    return True


@scenario
def dynamic_legacy_optimizers(optimizers=("adagrad", "adam"), capacity=6, evict_every=2):
    """Per legacy optimizer, on 2 workers and 2 ps (``async``): 10 ids for
    ``capacity`` rows, a pass every ``evict_every`` global steps; the
    table's invariants, the free rows' slots, then a tf.train.Checkpoint
    round trip onto the same shards (the restored layer with passes far
    apart, so none runs in its one zero-weight step)."""
    x, y = _shifted_data()
    out = {}
    with cluster(num_workers=2, num_ps=2) as c:
        for name in optimizers:
            strategy = _strategy(c)
            model, layer = _legacy_model(strategy, name, capacity, evict_every)
            _fit(strategy, model, x, y, epochs=1, steps=16)
            state = _shard_state(model, layer)
            r = {"stats": layer.stats(), "ids": layer.export()[0].numpy().tolist(),
                 "num_slots": sum(len(s["slots"]) for s in state),
                 "slot_names": sorted({n for s in state for n, _, _ in s["slots"]})}
            # Rows free now that held an id (RAW has no 0): evicted rows.
            freed, free_rows, free_slots = 0, 0.0, 0.0
            for s in state:
                free = np.flatnonzero(s["count"] == 0)
                freed += int(np.count_nonzero(s["key"][free] != 0))
                free_rows = max(free_rows, float(np.abs(s["rows"][free]).max(initial=0)))
                for _, value, initial in s["slots"]:
                    free_slots = max(free_slots,
                                     float(np.abs(value[free] - initial).max(initial=0)))
            r.update(freed_rows=freed, free_rows_max=free_rows, free_slots_max_diff=free_slots)
            r["round_trip"] = _round_trip(c, model, layer, name, capacity, state, x, y)
            out[name] = r
    return out


def _round_trip(c, model, layer, name, capacity, before, x, y):
    """Checkpoint ``model``, restore into a new one on the same 2 shards:
    map, rows and predictions at once; the slots after one step of zero
    gradients (the strategy restores a legacy optimizer's slots at its first
    update): Adagrad's unchanged, Adam's m and v times beta_1 and beta_2
    (float32), which a zero gradient gives exactly."""
    path = tf.train.Checkpoint(model=model, optimizer=model.optimizer).write(
        os.path.join(tempfile.mkdtemp(), "ckpt"))
    batch = tf.constant(x)
    pred = model(batch, training=False).numpy()
    again, layer2 = _legacy_model(_strategy(c), name, capacity, evict_every=10**6)
    tf.train.Checkpoint(model=again, optimizer=again.optimizer).read(path)
    r = {"pred_max_diff": float(np.abs(again(batch, training=False).numpy() - pred).max())}
    restored = _shard_state(again, layer2)  # no slots yet: built at the first update
    r["count_equal"] = all(np.array_equal(a["count"], b["count"]) for a, b in zip(before, restored))
    r["key_equal"] = all(np.array_equal(a["key"], b["key"]) for a, b in zip(before, restored))
    r["rows_max_diff"] = max(float(np.abs(a["rows"] - b["rows"]).max())
                             for a, b in zip(before, restored))
    r["index"] = [int(s.index.size()) for s in layer2.dynamic_table.shards]
    # One step of zero gradients on live ids only (nothing admitted, refused).
    live = np.array(layer.export()[0].numpy())
    xs = np.resize(live, x.shape)
    _fit(None, again, xs, y, epochs=1, steps=1, weight=0.0)
    after = _shard_state(again, layer2)
    decay = {"m": np.float32(0.9), "v": np.float32(0.999)}
    diffs, names = [], []
    for a, b in zip(before, after):
        assert len(a["slots"]) == len(b["slots"]), (a["slots"], b["slots"])
        for (na, va, _), (nb, vb, _) in zip(a["slots"], b["slots"]):
            names.append(na)
            want = va * decay[na] if name == "adam" else va
            diffs.append(float(np.abs(vb - want).max()))
    r.update(slots_max_diff=max(diffs), slots_compared=names,
             slots_max=max(float(np.abs(v).max()) for s in before for _, v, _ in s["slots"]),
             stats=layer2.stats())
    return r
