"""The optimizer's slots of a table shard, found by name, shape and device.

An evicted row of a dynamic table gets its optimizer slots' initial values
(Adagrad's accumulator, Adam's moments); the table finds them here, for
tf_keras and Keras 3 optimizers, without their private slot maps.
"""

import functools
import re

import tensorflow as tf

from tf_asyncps.compat import checkpoint as checkpoint_compat
from tf_asyncps.compat import variables as variables_compat

__all__ = ["optimizer_slots", "tracked_slots"]


#: Slot names of Keras 3's optimizers (``"{variable path}_{slot}"``).
_KERAS3_SLOTS = ("accumulator", "momentum", "velocity", "velocity_hat", "average_gradient",
                 "accumulated_grad", "accumulated_delta_var", "linear", "m", "u", "r", "c",
                 "v")


def optimizer_slots(optimizer, var, any_device: bool = False) -> list:
    """``[(slot, initial value)]``: the optimizer's variables beside ``var``
    (same shape, same device, named after it as a whole: tf_keras names a
    slot ``"{optimizer}/{slot}/{variable}"``, Keras 3 ``"{variable path}_{slot}"``;
    a layer named ``power_user`` is not ``user``; shard ``part_1`` is not
    ``part_0``, even on one ps). Legacy tf_keras optimizers are asked by
    their public ``get_slot_names`` / ``get_slot``. An accumulator starts at
    the optimizer's ``initial_accumulator_value`` (Adagrad), every other slot
    at 0. ``any_device``: on any device (under ``local_sgd`` a slot's own
    variable is made on the chief; the workers train copies of it)."""
    inner = getattr(optimizer, "inner_optimizer", None)  # LossScaleOptimizer
    if inner is not None:
        optimizer = inner
    legacy = callable(getattr(optimizer, "get_slot_names", None))  # tf_keras legacy
    initial = getattr(optimizer, "initial_accumulator_value", None)
    if initial is None and legacy:
        with tf.init_scope():  # its config reads hyperparameters eagerly
            initial = optimizer.get_config().get("initial_accumulator_value")
    initial = float(initial or 0.0)
    initial_of = lambda name: initial if "accumulator" in name else 0.0
    if legacy:
        out = []
        for name in optimizer.get_slot_names():
            try:
                out.append((optimizer.get_slot(var, name), initial_of(name)))
            except KeyError:  # no slots for var (yet)
                pass
        return out
    variables = optimizer.variables
    variables = variables() if callable(variables) else variables
    no_index = functools.partial(re.sub, r"(:\d+)?$", "")
    strip = functools.partial(re.sub, r"(/part_\d+)?(:\d+)?$", "")
    base, full = strip(var.name), no_index(var.name)
    # Keras 3 names a slot after the variable's path, or, for a shard under a
    # variable_partitioner, after the shard's whole name ("..._part_0_0").
    keras3 = {base.replace("/", "_"), re.sub(r"[/:]", "_", var.name)}
    keras3_slots = "(" + "|".join(map(re.escape, keras3)) + ")_(" + \
        "|".join(_KERAS3_SLOTS) + ")"
    candidates = []
    for v in variables:
        v = getattr(v, "value", v) if not hasattr(v, "device") else v
        for part in variables_compat.shards(v) or [v]:
            if part is var or getattr(part, "shape", None) != var.shape or (
                    not any_device and getattr(part, "device", None) != var.device):
                continue
            candidates.append(part)
    # The shard's whole name first; its name without "/part_N" only if that
    # finds nothing (a table whose slots are named after the whole table).
    for name in (full, base):
        named = re.compile(r"(^|/)(" + re.escape(name) + "|" + keras3_slots + ")$")
        out = [(part, initial_of(part.name)) for part in candidates
               if named.search(no_index(part.name))]
        if out:
            return out
    return []


def tracked_slots(optimizer, parts) -> list:
    """The objects a checkpoint saves for the slot variables ``parts`` (table
    shards' slots): each of them, the ShardedVariable a tf_keras optimizer
    holds them in (each shard's ``_sharded_container``), and the optimizer's
    variables whose value is one of them or holds them (Keras 3 variables)."""
    inner = getattr(optimizer, "inner_optimizer", None)  # LossScaleOptimizer
    optimizer = inner if inner is not None else optimizer
    ids = {id(p) for p in parts}
    out = list(parts)
    for p in parts:
        container = checkpoint_compat.sharded_container(p)
        if container is not None:
            out.append(container)
    variables = optimizer.variables
    variables = variables() if callable(variables) else variables
    for v in variables:
        value = v if hasattr(v, "device") else getattr(v, "value", v)
        if any(id(x) in ids for x in [value] + (variables_compat.shards(value) or [])):
            out.append(v)
    seen, unique = set(), []
    for obj in out:
        if id(obj) not in seen:
            seen.add(id(obj))
            unique.append(obj)
    return unique
