"""An optimizer's slots of sharded (partitioned) weights in
``tf.train.Checkpoint``, for tf_keras and Keras 3: saved whole, restored by
global row onto any number of shards.

Keras 3 tested with Keras 3.15.1 and TensorFlow 2.21.0; tf_keras (new and
legacy optimizers, a restore before the slots exist:
:func:`_tf_keras_build_for_pending_restore`,
:func:`legacy_sharded_slots_saved_elsewhere`) with tf_keras 2.21.0.
Importing this module imports nothing; functions import Keras, tf_keras and
TensorFlow when called.

Keras 3: private names
used: Keras 3.15's ``TFOptimizer`` (``keras.src.backend.tensorflow.optimizer``),
its ``_variables``/``_trainable_variables`` and ``add_variable_from_reference``;
TensorFlow 2.21's ``ListWrapper``, ``Trackable._trackable_children``,
``_deferred_dependencies`` and ``CheckpointPosition.restore``.

Under ``variable_partitioner`` a Keras 3 optimizer is built on a partitioned
weight's shards (``tf_asyncps/keras3``): one slot per shard (Adagrad's
accumulator, Adam's momentum and velocity). Keras tracks them by position, in
``_variables`` and in each slot list (``_accumulators``, ``_momentums``...),
and the shards themselves in ``_trainable_variables``: a checkpoint written
on 2 shards and read onto 3 (or 3 onto 2) gave each position to whatever
slot sits there now and left the shards' slots at their initial values, with
no error (tests/test_keras3_slots.py: Adagrad accumulators up to 106.0 back
at 0.1). Here such an optimizer's checkpoint holds, instead, each
partitioned weight's slots whole (one tensor per slot name and weight, rows
in global order, like the weight itself:
:func:`checkpoint_partitioned_whole`), and its
position lists without the shards and their slots, so that every position
means the same thing on any number of shards. A restore splits the whole
slot by this model's shards.
"""

import functools

__all__ = ["TESTED_VERSIONS", "checkpoint_partitioned_whole", "checkpoint_slots_whole",
           "build_for_pending_restore",
           "legacy_sharded_slots_saved_elsewhere", "WHOLE_SLOTS"]

TESTED_VERSIONS = ("3.15.1",)  # Keras 3

#: The optimizer's checkpoint child holding the whole slots.
WHOLE_SLOTS = "asyncps_sharded_slots"


def _shard_of(variable):
    """``(shard, slot name)`` when ``variable`` is a slot made for a shard of a
    partitioned weight (tagged by :func:`checkpoint_slots_whole`), else None."""
    return getattr(variable, "_asyncps_shard_slot", None)


def _container(shard):
    ref = getattr(shard, "_sharded_container", None)
    return ref() if ref is not None else None


def _partitioned(optimizer):
    """``[(ShardedVariable, {slot name: [slot per shard]})]`` in the order of
    the optimizer's trainable variables; empty if none is a shard."""
    groups, slots = [], {}
    for v in optimizer._variables:
        tag = _shard_of(v)
        if tag is not None:
            slots.setdefault(id(tag[0]), {})[tag[1]] = v
    seen = set()
    for v in getattr(optimizer, "_trainable_variables", ()):
        sv = _container(v)
        if sv is None or id(sv) in seen:
            continue
        seen.add(id(sv))
        names = {}
        for shard in sv.variables:
            for name, slot in slots.get(id(shard), {}).items():
                names.setdefault(name, []).append(slot)
        groups.append((sv, {n: s for n, s in names.items() if len(s) == len(sv.variables)}))
    return groups


@functools.lru_cache(maxsize=None)
def _whole_slot_class():
    import tensorflow as tf

    class WholeSlot(tf.__internal__.tracking.Trackable):
        """One slot of a partitioned weight: saved as one tensor (its shards'
        slots concatenated by row), restored split by this model's shards."""

        def __init__(self, weight, slots):
            self._weight, self._slots = weight, slots

        def _serialize_to_tensors(self):
            return {"VARIABLE_VALUE": tf.concat([s.value.read_value() for s in self._slots], 0)}

        def _restore_from_tensors(self, restored_tensors):
            value = restored_tensors["VARIABLE_VALUE"]
            rows = sum(int(s.shape[0]) for s in self._slots)
            if value.shape.rank is not None and value.shape[0] is not None and \
                    int(value.shape[0]) != rows:
                raise ValueError(
                    f"The checkpoint holds the optimizer slot {self._slots[0].name} of the "
                    f"partitioned weight {self._weight.name} with {int(value.shape[0])} rows; "
                    f"this model's weight has {rows}. Restore into a model whose weight has "
                    f"the saved shape (any number of shards).")
            ops, row = [], 0
            for s in self._slots:
                n = int(s.shape[0])
                ops.append(s.value.assign(tf.cast(value[row:row + n], s.dtype)))
                row += n
            return tf.group(ops)

    class WholeSlots(tf.__internal__.tracking.Trackable):
        """The optimizer's checkpoint child: ``{"{k}_{slot}": WholeSlot}``, k
        the partitioned weight's rank among the partitioned weights."""

        def __init__(self, groups):
            self._children = {f"{k}_{name}": WholeSlot(sv, slots)
                              for k, (sv, named) in enumerate(groups)
                              for name, slots in named.items()}

        def _trackable_children(self, save_type="checkpoint", **kwargs):
            return dict(self._children)

    return WholeSlots


def _view(optimizer, children):
    """``children`` (the optimizer's own checkpoint children) with each
    position list without the shards and their slots, plus the whole slots;
    the same objects until the optimizer's lists change (a save asks more
    than once). ``children`` itself for an optimizer with no shard."""
    from tensorflow.python.trackable import data_structures
    from tf_asyncps.compat import hooks as hooks_compat
    lists = {name: value for name, value in children.items() if _is_list(value)}
    key = tuple((name, id(value), tuple(id(v) for v in value))
                for name, value in sorted(lists.items()))
    cached = optimizer.__dict__.get("_asyncps_slots_view")
    if cached is None or cached[0] != key:
        groups = _partitioned(optimizer)
        view = None
        if groups:
            drop = {id(p) for sv, _ in groups for p in sv.variables}
            drop.update(id(v) for v in optimizer._variables if _shard_of(v) is not None)
            view = {name: data_structures.ListWrapper([v for v in value if id(v) not in drop])
                    for name, value in lists.items()}
            # A dynamic table writes its slot rows in its own entry (live
            # rows only, compat.checkpoint.save_elsewhere): left
            # out of the position lists, and not saved whole here.
            from tf_asyncps.compat.checkpoint import saved_elsewhere
            view[WHOLE_SLOTS] = _whole_slot_class()(
                [(sv, named) for sv, named in groups
                 if not (saved_elsewhere(sv) or any(saved_elsewhere(p) for p in sv.variables))])
        cached = (key, view)
        hooks_compat.set_untracked_attribute(optimizer, "_asyncps_slots_view", cached)
    view = cached[1]
    if view is None:
        return children
    out = dict(children)
    out.update(view)
    return out


def _deferred(obj):
    """The restores waiting on ``obj``'s dependencies not made yet
    (``{name: [CheckpointPosition]}``, TensorFlow 2.21's Trackable)."""
    obj._maybe_initialize_trackable()
    return obj._deferred_dependencies


def _is_list(value):
    from tensorflow.python.trackable import data_structures
    return isinstance(value, data_structures.ListWrapper)


def checkpoint_slots_whole() -> bool:
    """Makes ``tf.train.Checkpoint`` save a Keras 3 optimizer's slots of each
    partitioned weight whole (by global row) and restore them onto any
    number of shards (see the module's docstring). Optimizers with no
    shard among their variables are left to Keras. Hooks Keras 3.15's
    ``TFOptimizer.add_variable_from_reference`` (to tag the slots made for a
    shard) and ``_trackable_children`` (checkpoints only), once (idempotent).

    Returns:
      False if Keras 3 is not installed.
    """
    try:
        import keras
    except ImportError:  # pragma: no cover
        return False
    if not keras.__version__.startswith("3"):
        return False
    from keras.src.backend.tensorflow import optimizer as tf_optimizer
    from tf_asyncps.compat import hooks as hooks_compat

    def make_add(original):
        def add_variable_from_reference(self, reference_variable, name=None,
                                        initializer="zeros"):
            slot = original(self, reference_variable, name=name, initializer=initializer)
            if _container(reference_variable) is not None:
                hooks_compat.set_untracked_attribute(
                    slot, "_asyncps_shard_slot", (reference_variable, name or "var"))
            return slot
        return add_variable_from_reference

    def make_children(original):
        def _trackable_children(self, save_type="checkpoint", **kwargs):
            children = original(self, save_type, **kwargs)
            if str(getattr(save_type, "value", save_type)) != "checkpoint":
                return children
            return _view(self, children)
        return _trackable_children

    hooks_compat.hook_method(tf_optimizer.TFOptimizer, "add_variable_from_reference", make_add)
    hooks_compat.hook_method(tf_optimizer.TFOptimizer, "_trackable_children", make_children)
    return True


def build_for_pending_restore(optimizer, variables) -> bool:
    """Builds an optimizer's slots now, eagerly, if a checkpoint was restored
    into it before it had them, so that the slots of sharded (partitioned)
    variables come back whole, by global row: a tf_keras optimizer
    (:func:`_tf_keras_build_for_pending_restore`) or a Keras 3 one
    (:func:`_keras3_build_for_pending_restore`, which may raise ValueError);
    anything else is left alone.

    Returns:
      True if it built the optimizer.
    """
    return _tf_keras_build_for_pending_restore(optimizer, variables) or \
        _keras3_build_for_pending_restore(optimizer, variables)


def _keras3_build_for_pending_restore(optimizer, variables) -> bool:
    """Builds an unbuilt Keras 3 optimizer on ``variables`` (a partitioned
    weight's shards in place of the weight) now, eagerly, applying a
    checkpoint restored into it before it had slots onto the checkpoint's
    own view (:func:`checkpoint_slots_whole`): the whole slots split by
    these shards, the other slots by their position without the shards'.
    Keras alone would hand the restored positions to whatever slot it
    creates at that position (another shard's, another weight's).

    Args:
      optimizer: a Keras 3 optimizer (a LossScaleOptimizer builds its inner
        one); anything else is left alone.
      variables: the variables it will update (tf.Variable shards and Keras
        variables, as ``tf_asyncps.keras3.trainable_shards(model)`` gives).

    Returns:
      True if it built the optimizer; False if it was built already, is not a
      Keras 3 optimizer, or no variable is a shard (Keras builds it then).

    Raises:
      ValueError: if a checkpoint restored into it holds whole slots of
        partitioned weights and ``variables`` holds no shard, or holds no
        whole slots while ``variables`` holds shards: slot values would be
        lost (or start again) silently otherwise; or if a whole slot has
        another number of rows than this weight.
    """
    import sys
    import tensorflow as tf
    keras = sys.modules.get("keras")  # a Keras 3 optimizer has imported it
    if keras is None or not str(getattr(keras, "__version__", "")).startswith("3") or \
            not isinstance(optimizer, keras.optimizers.Optimizer):
        return False
    variables = list(variables)
    if not any(_container(v) is not None for v in variables):
        _check_no_whole_slots(optimizer)
        return False
    if optimizer.built:
        return False
    objects = [optimizer]
    inner = getattr(optimizer, "inner_optimizer", None)
    if inner is not None and not inner.built:
        objects.append(inner)
    held = []  # (object, its deferred restores, {list name: the list's})
    for obj in objects:
        lists = {}
        for name, value in obj._trackable_children().items():
            if _is_list(value) and _deferred(value):
                lists[name] = dict(_deferred(value))
                _deferred(value).clear()
        held.append((obj, dict(_deferred(obj)), lists))
        _deferred(obj).clear()
    with tf.init_scope():
        optimizer.build(variables)
    restored = any(deferred or lists for _, deferred, lists in held)
    whole = any(WHOLE_SLOTS in deferred for _, deferred, _ in held)
    if restored and not whole and any(named for obj in objects
                                      for _, named in _partitioned(obj)):
        raise ValueError(
            "The checkpoint restored into this optimizer holds no whole slots of "
            "partitioned weights (it was written with the weights unpartitioned, or "
            "before tf_asyncps saved Keras 3 slots whole), and this model's weights are "
            "partitioned (variable_partitioner): their slots would start again from their "
            "initial values. Restore the model alone (tf.train.Checkpoint(model=model)) "
            "to start the optimizer afresh, or restore onto unpartitioned weights.")
    with tf.init_scope():
        for obj, deferred, lists in held:
            _apply(obj, deferred, lists)
    return True


def _check_no_whole_slots(optimizer):
    for obj in (optimizer, getattr(optimizer, "inner_optimizer", None)):
        if obj is not None and WHOLE_SLOTS in _deferred(obj):
            raise ValueError(
                f"The checkpoint holds the optimizer slots of partitioned weights (saved "
                f"on shards, variable_partitioner) and {type(obj).__name__} here updates "
                f"no partitioned weight: those slots would not be restored. Restore it "
                f"under a strategy whose variable_partitioner splits the same weights "
                f"(into any number of shards >= 2).")


def _apply(obj, deferred, lists):
    """Restores the held positions into ``obj``'s checkpoint view now; what
    the view does not have yet stays deferred (Keras' own handling)."""
    children = obj._trackable_children()
    for name, positions in lists.items():
        target = children.get(name)
        if target is None:  # not after Keras 3.15's build: it keeps both lists
            continue
        target_children = target._trackable_children()
        for index, index_positions in positions.items():
            _restore_or_defer(target, target_children, index, index_positions)
    for name, positions in deferred.items():
        _restore_or_defer(obj, children, name, positions)


def _restore_or_defer(parent, children, key, positions):
    """Restores ``positions`` into ``children[key]``, or defers them on
    ``parent`` under ``key`` until that child exists."""
    target = children.get(key)
    if target is None:
        _deferred(parent).setdefault(key, []).extend(positions)
        return
    for p in positions:
        p.restore(target)


def _tf_keras_build_for_pending_restore(optimizer, variables) -> bool:
    """Builds a tf_keras optimizer's slots now, eagerly, if a checkpoint was
    restored into it before it had them, so that the slots of sharded
    variables come back whole, by global row.

    tf_keras (measured on 2.21.0) gets them wrong on its own: its new optimizers track
    each slot twice (in a slot list, e.g. Adagrad's ``_accumulators``, and in
    ``_variables``, where a variable's shards are one ``ShardedVariable``), and
    a restore deferred until ``build`` matches the saved ``ShardedVariable`` to
    the list's first shard: the slots come back wrong, with no error (Adagrad
    accumulators off by up to 121 on a 6-row table, onto the same or another
    shard count). Here the restore goes through ``_variables`` only.

    Legacy optimizers (``tf_keras.optimizers.legacy``) restore such a slot
    eagerly, as one whole variable under the ``ShardedVariable``'s key, which
    their first step replaces by the shards' fresh slots (measured on 2.21.0:
    Adagrad accumulators back at their initial 0.1 instead of 4.1, no error).
    Here they create their slots now and take the whole slot's rows, by global
    row, and the whole slot is dropped from ``optimizer.weights``.

    Args:
      optimizer: any optimizer (of a LossScaleOptimizer, its inner one); only
        tf_keras's are built here.
      variables: the model variables about to be updated (shards, not
        ``ShardedVariable`` objects, as ``model.trainable_variables`` gives).

    Returns:
      True if it built the optimizer.
    """
    import tensorflow as tf
    try:
        import tf_keras
    except ImportError:  # pragma: no cover - tf_keras is a dependency
        return False
    optimizer = getattr(optimizer, "inner_optimizer", optimizer)  # LossScaleOptimizer
    variables = list(variables)
    if isinstance(optimizer, tf_keras.optimizers.Optimizer):
        if getattr(optimizer, "_built", False) or not optimizer._deferred_dependencies:
            return False
        deferred = optimizer._deferred_dependencies
        held = dict(deferred)
        deferred.clear()
        try:
            with tf.name_scope(optimizer.name or "optimizer"), tf.init_scope():
                optimizer.build(variables)
        finally:
            in_variables = _object_ids(optimizer.variables)
            for name, positions in held.items():
                value = getattr(optimizer, name, None)
                if isinstance(value, (list, tuple)) and value and \
                        all(id(v) in in_variables for v in value):
                    continue  # restored through _variables
                deferred.setdefault(name, []).extend(positions)
                if value is not None and hasattr(value, "_maybe_initialize_trackable"):
                    with tf.init_scope():
                        optimizer._handle_deferred_dependencies(name, value)
        return True
    if isinstance(optimizer, tf_keras.optimizers.legacy.Optimizer):
        return _build_legacy_for_pending_restore(optimizer, variables)
    return False


def _build_legacy_for_pending_restore(optimizer, variables) -> bool:
    """The legacy half of :func:`_tf_keras_build_for_pending_restore` (tf_keras
    2.21.0's ``OptimizerV2``: ``_slots``, ``_weights``, ``_create_all_weights``)."""
    import tensorflow as tf
    from tf_keras.src.optimizers.legacy import optimizer_v2
    containers = {}
    for v in variables:
        container = getattr(v, "_sharded_container", None)
        if container is not None:
            sv = container()
            containers.setdefault(optimizer_v2._var_key(sv), sv)
    # A restored slot of a whole ShardedVariable sits where, once built, the
    # ShardedVariable itself marks that its shards hold the slots.
    restored = [(sv, name, slot) for key, sv in containers.items()
                for name, slot in optimizer._slots.get(key, {}).items() if slot is not sv]
    if not restored:
        return False
    with tf.name_scope(optimizer._name), tf.init_scope():
        optimizer._create_all_weights(variables)
        for sv, name, whole in restored:
            # Same rows as the table: restoring the table itself checked them.
            row = 0
            for p in sv.variables:
                n = int(p.shape[0])
                optimizer.get_slot(p, name).assign(whole[row:row + n])
                row += n
            optimizer._weights[:] = [w for w in optimizer._weights if w is not whole]
    return True


def _object_ids(variables) -> set:
    """ids of ``variables`` and of each ``ShardedVariable``'s shards."""
    out = set()
    for v in variables:
        out.add(id(v))
        out.update(id(p) for p in getattr(v, "variables", ()) if p is not v)
    return out


def legacy_sharded_slots_saved_elsewhere() -> bool:
    """Makes tf_keras's legacy optimizers (``OptimizerV2.get_slot``, tf_keras
    2.21.0) hand out the slot of a ``ShardedVariable`` marked by
    :func:`tf_asyncps.compat.checkpoint.save_elsewhere` when all
    its shards' slots are marked: ``get_slot`` builds a new
    ``ShardedVariable`` over the shards' slots at each call, and a checkpoint
    saves what it returns. Other slots are returned as they are. Hooks the
    class once (idempotent).

    Returns:
      False if tf_keras is not installed.
    """
    from tf_asyncps.compat import checkpoint as checkpoint_compat
    from tf_asyncps.compat import hooks as hooks_compat
    from tf_asyncps.compat import variables as variables_compat
    try:
        from tf_keras.src.optimizers.legacy import optimizer_v2
    except ImportError:  # pragma: no cover - tf_keras is a dependency
        return False

    def make_hook(original):
        def get_slot(self, var, slot_name):
            slot = original(self, var, slot_name)
            parts = variables_compat.shards(slot)
            if parts and all(map(checkpoint_compat.saved_elsewhere, parts)):
                checkpoint_compat.save_elsewhere(slot)
            return slot
        return get_slot

    hooks_compat.hook_method(optimizer_v2.OptimizerV2, "get_slot", make_hook)
    return True


def checkpoint_partitioned_whole() -> bool:
    """Makes ``tf.train.Checkpoint`` save a partitioned Keras 3 variable (its
    value a ShardedVariable, under ``variable_partitioner``) as one whole
    tensor, and restore it onto any number of shards. Keras 3.15's TensorFlow
    ``Variable._serialize_to_tensors`` hands the saver the ShardedVariable
    itself, which fails there (``'ShardedVariable' object has no attribute
    'device'``), so no such model could be written. Other variables are left
    to Keras. Hooks the class once (idempotent). The optimizer's slots of
    such a weight are saved whole too (:func:`checkpoint_slots_whole`).

    Returns:
      False if Keras 3 is not installed.
    """
    from tf_asyncps.compat.optimizers import optimizer_class
    from tf_asyncps.compat.variables import sharded_value
    if optimizer_class() is None:
        return False
    import tensorflow as tf
    from keras.src.backend.tensorflow import core
    from tf_asyncps.compat import hooks as hooks_compat

    def make_serialize(original):
        def _serialize_to_tensors(self):
            shards = sharded_value(self)
            if not shards:
                return original(self)
            return {"VARIABLE_VALUE": tf.concat([s.read_value() for s in shards], 0)}
        return _serialize_to_tensors

    def make_restore(original):
        def _restore_from_tensors(self, restored_tensors):
            shards = sharded_value(self)
            if not shards:
                return original(self, restored_tensors)
            value, ops, row = restored_tensors["VARIABLE_VALUE"], [], 0
            for s in shards:  # the saved rows split by this model's shards
                ops.append(s.assign(value[row:row + s.shape[0]]))
                row += s.shape[0]
            return tf.group(ops)
        return _restore_from_tensors

    hooks_compat.hook_method(core.Variable, "_serialize_to_tensors", make_serialize)
    hooks_compat.hook_method(core.Variable, "_restore_from_tensors", make_restore)
    checkpoint_slots_whole()  # and the optimizer's slots of such a weight
    return True
