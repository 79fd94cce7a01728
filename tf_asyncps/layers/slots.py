"""The optimizer's slots of a table shard, found by name, shape and device.

An evicted row of a dynamic table gets its optimizer slots' initial values
(Adagrad's accumulator, Adam's moments); the table finds them here, for
tf_keras and Keras 3 optimizers, without their private slot maps.
"""

import functools
import re

from tf_asyncps.compat import tensorflow as tf_compat

__all__ = ["optimizer_slots"]


#: Slot names of Keras 3's optimizers (``"{variable path}_{slot}"``).
_KERAS3_SLOTS = ("accumulator", "momentum", "velocity", "velocity_hat", "average_gradient",
                 "accumulated_grad", "accumulated_delta_var", "linear", "m", "u", "r", "c",
                 "v")


def optimizer_slots(optimizer, var) -> list:
    """``[(slot, initial value)]``: the optimizer's variables beside ``var``
    (same shape, same device, named after it as a whole: tf_keras names a
    slot ``"{optimizer}/{slot}/{variable}"``, Keras 3 ``"{variable path}_{slot}"``;
    a layer named ``power_user`` is not ``user``). An accumulator starts at the
    optimizer's ``initial_accumulator_value`` (Adagrad), every other slot at 0."""
    inner = getattr(optimizer, "inner_optimizer", None)  # LossScaleOptimizer
    if inner is not None:
        optimizer = inner
    variables = optimizer.variables
    variables = variables() if callable(variables) else variables
    strip = functools.partial(re.sub, r"(/part_\d+)?(:\d+)?$", "")
    base = strip(var.name)
    # Keras 3 names a slot after the variable's path, or, for a shard under a
    # variable_partitioner, after the shard's whole name ("..._part_0_0").
    keras3 = {base.replace("/", "_"), re.sub(r"[/:]", "_", var.name)}
    named = re.compile(r"(^|/)(" + re.escape(base) + "|(" + "|".join(map(re.escape, keras3)) +
                       ")_(" + "|".join(_KERAS3_SLOTS) + "))$")
    initial = float(getattr(optimizer, "initial_accumulator_value", 0.0) or 0.0)
    out = []
    for v in variables:
        v = getattr(v, "value", v) if not hasattr(v, "device") else v
        for part in tf_compat.shards(v) or [v]:
            if part is var or getattr(part, "shape", None) != var.shape or \
                    getattr(part, "device", None) != var.device:
                continue
            if named.search(strip(part.name)):
                out.append((part, initial if "accumulator" in part.name else 0.0))
    return out
