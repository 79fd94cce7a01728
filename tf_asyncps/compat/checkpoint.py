"""TensorFlow checkpoint internals (TF 2.21.0; the ``Trackable`` save and
restore protocol exists since TF 2.11): an object that writes tensors of
its own making into a ``tf.train.Checkpoint`` and gets them back at restore,
and variables that write nothing there (a dynamic table saves their live
rows itself) but are still saved whole in a SavedModel; whether a
SavedModel export is tracing functions now (TF 2.16-2.21's
``save_context``). Keras 3.10.0-3.15.1's savers: a partitioned Keras 3
variable's value seen whole while saving.

Importable without TensorFlow being imported first.
"""

import contextlib
import contextvars
import functools

__all__ = ["checkpointed_tensors", "save_elsewhere", "saved_elsewhere", "in_saved_model_export",
           "writing_checkpoint", "sharded_container", "in_save_context",
           "whole_values", "trackable_paths", "assert_matched_except"]

_CLASS = []


def checkpointed_tensors(save, restore, check=None):
    """A trackable object: assigned to a tracked attribute (``tf.Module``,
    Keras layer), its checkpoint entries are ``save()`` and a restore calls
    ``restore(tensors)``.

    TensorFlow 2.21's ``Trackable._serialize_to_tensors`` /
    ``_restore_from_tensors``: each entry must be one whole tensor (TF's
    restore of a ``Trackable`` maps several slices of one name by position,
    wrongly). A restore reads an entry by name and dtype only: its shape may
    differ from what ``save()`` gives now (another number of shards).

    Args:
      save: ``save() -> {name: tensor}``; called at each save, and at a
        restore for the names and dtypes to read.
      restore: ``restore({name: tensor}) -> op or None``; called once the
        entries are read (eagerly in TF2's eager restore; also for a
        restore deferred until this object is attached).
      check: ``check(names)``, or None: called at a restore with the entry
        names the checkpoint holds for this object, before any is read; it
        raises to refuse the checkpoint (TF would fail later with
        ``NotFoundError`` naming only the first missing key). Needs TF's
        ``CheckpointPosition._create_serialize_to_tensor_saveable`` (TF
        2.11-2.21): without it, not called.

    Returns:
      The object (a ``tf.__internal__.tracking.Trackable``).
    """
    if not _CLASS:
        from tensorflow.python.trackable import base

        class CheckpointedTensors(base.Trackable):
            def __init__(self, save, restore, check):
                super().__init__()
                self._asyncps_save, self._asyncps_restore = save, restore
                self._asyncps_check = check

            def _serialize_to_tensors(self):
                return self._asyncps_save()

            def _restore_from_tensors(self, restored_tensors):
                return self._asyncps_restore(restored_tensors)

        _CLASS.append(CheckpointedTensors)
        _hook_restore_check()
    return _CLASS[0](save, restore, check)


def _hook_restore_check() -> None:
    """Calls a :func:`checkpointed_tensors` object's ``check`` with the entry
    names its node holds in the checkpoint (``object_proto.attributes``),
    in TF 2.21's ``CheckpointPosition._create_serialize_to_tensor_saveable``:
    the one place a restore of a ``_serialize_to_tensors`` object sees both
    the object and the checkpoint's names before reading them."""
    try:
        from tensorflow.python.checkpoint import restore
        position = restore.CheckpointPosition
        position._create_serialize_to_tensor_saveable  # noqa: B018 (exists?)
    except (ImportError, AttributeError):  # another TF: no early check
        return

    def make_hook(original):
        @functools.wraps(original)
        def checked(self, *args, **kwargs):
            check = getattr(self.trackable, "_asyncps_check", None)
            if check is not None:
                check(sorted(a.name for a in self.object_proto.attributes))
            return original(self, *args, **kwargs)
        return checked

    from tf_asyncps.compat import hooks as hooks_compat
    hooks_compat.hook_method(position, "_create_serialize_to_tensor_saveable", make_hook)


#: Set on an object by :func:`save_elsewhere`.
_ELSEWHERE = "_asyncps_saved_elsewhere"


def save_elsewhere(obj) -> None:
    """Makes ``obj`` (a ``tf.Variable``, a ``ShardedVariable`` or a Keras 3
    variable) write no entry of its own when a ``tf.train.Checkpoint`` (or
    ``save_weights`` in the TensorFlow format, ``BackupAndRestore``) is
    written: its values are saved by another object (a dynamic table writes
    its live rows and their optimizer slots). Its node then holds no tensors,
    so a restore of such a checkpoint leaves it as it is, even into an object
    not marked (yet). A SavedModel export still saves it whole, and a
    checkpoint that holds it whole restores it whole. Idempotent.

    TensorFlow 2.21's save protocol: a ``Trackable`` is saved through an
    instance's own ``_serialize_to_tensors`` when it has one in its
    ``__dict__``, else through its class's ``_serialize_to_tensors`` or
    (``ShardedVariable``) legacy ``_gather_saveables_for_checkpoint``; both
    are overridden on this one instance (tf_keras 2.21.0 and Keras 3.15.1
    variables are plain ``Trackable`` objects there). A restore asks the same
    method which tensors to read, so the override gives nothing only while
    ``TrackableSaver.save`` writes a checkpoint outside a SavedModel export
    (:func:`writing_checkpoint`).
    """
    if getattr(obj, _ELSEWHERE, False):
        return
    from tensorflow.python.training.saving import saveable_object_util

    _hook_savers()
    if saveable_object_util.trackable_has_serialize_to_tensor(obj):
        original = type(obj)._serialize_to_tensors

        def _serialize_to_tensors():
            return {} if writing_checkpoint() else original(obj)
        object.__setattr__(obj, "_serialize_to_tensors", _serialize_to_tensors)
    else:
        gather = obj._gather_saveables_for_checkpoint

        def _gather_saveables_for_checkpoint():
            return {} if writing_checkpoint() else gather()
        object.__setattr__(obj, "_gather_saveables_for_checkpoint",
                           _gather_saveables_for_checkpoint)
    object.__setattr__(obj, _ELSEWHERE, True)


def saved_elsewhere(obj) -> bool:
    """Whether :func:`save_elsewhere` marked ``obj``."""
    return bool(getattr(obj, _ELSEWHERE, False))


# Calls under way in this thread (a new thread starts at 0, as a
# threading.local did); each hooked call sets one more and restores.
_DEPTH = {"export": contextvars.ContextVar("tf_asyncps.export_depth", default=0),
          "write": contextvars.ContextVar("tf_asyncps.write_depth", default=0)}


def in_saved_model_export() -> bool:
    """Whether a SavedModel export is under way: tracing its functions
    (TF 2.21's ``save_context``) or writing its variables, which
    ``saved_model/save.py``'s ``save_and_return_nodes`` does after leaving
    that context (``tf.saved_model.save`` and tf_keras's SavedModel saves
    both go through it; hooked by :func:`save_elsewhere`)."""
    from tensorflow.python.saved_model import save_context
    return save_context.in_save_context() or _DEPTH["export"].get() > 0


def writing_checkpoint() -> bool:
    """Whether ``TrackableSaver.save`` (``tf.train.Checkpoint.write/save``,
    tf_keras ``save_weights``) is writing a checkpoint now, not for a
    SavedModel export."""
    return _DEPTH["write"].get() > 0 and not in_saved_model_export()


def _counting(attr):
    def make_hook(original):
        @functools.wraps(original)
        def counted(*args, **kwargs):
            depth = _DEPTH[attr]
            token = depth.set(depth.get() + 1)
            try:
                return original(*args, **kwargs)
            finally:
                depth.reset(token)
        return counted
    return make_hook


def _hook_savers() -> None:
    """Counts calls of TF 2.21's ``save.save_and_return_nodes`` and
    ``TrackableSaver.save`` (once; idempotent)."""
    from tensorflow.python.checkpoint import checkpoint
    from tensorflow.python.saved_model import save

    from tf_asyncps.compat import hooks as hooks_compat
    hooks_compat.hook_method(save, "save_and_return_nodes", _counting("export"))
    hooks_compat.hook_method(checkpoint.TrackableSaver, "save", _counting("write"))


def sharded_container(var):
    """The ``ShardedVariable`` that ``var`` is a shard of (TF 2.21 sets a weak
    ``_sharded_container`` reference on each shard), else None."""
    ref = getattr(var, "_sharded_container", None)
    return ref() if callable(ref) else None


def in_save_context() -> bool:
    """Whether a SavedModel export is tracing functions now
    (``tf.saved_model.save`` and Keras saves; TF 2.16-2.21's
    ``save_context.in_save_context``)."""
    from tensorflow.python.saved_model import save_context
    return save_context.in_save_context()


@contextlib.contextmanager
def whole_values(variables):
    """While saving: each partitioned Keras 3 variable's value is its whole
    tensor (read once from the ps), since Keras' savers call ``np.asarray``
    on the value and a ShardedVariable has no ``__array__``. Restored on
    exit. Loading needs nothing: ``assign`` of a whole value works on a
    ShardedVariable."""
    import tensorflow as tf
    from tf_asyncps.compat.variables import sharded_value
    swapped = []
    try:
        for v in variables:
            if sharded_value(v):
                swapped.append((v, v._value))
                v._value = tf.convert_to_tensor(v._value)
        yield
    finally:
        for v, value in swapped:
            v._value = value


def trackable_paths(root, wanted=None, max_depth: int = 12) -> dict:
    """``{path: object}`` of the objects under ``root`` in its object graph
    (TensorFlow 2.11-2.21's ``Trackable._trackable_children``, the names a
    SavedModel keeps: ``layer_with_weights-0/dynamic_table/shards/0/index``),
    breadth first, each object once; ``wanted(obj)`` filters (default all)."""
    out, seen, todo = {}, {id(root)}, [("", root, 0)]
    while todo:
        path, obj, depth = todo.pop(0)
        if path and (wanted is None or wanted(obj)):
            out[path] = obj
        if depth >= max_depth:
            continue
        try:
            children = obj._trackable_children()
        except (AttributeError, TypeError, ValueError):
            continue
        for name, child in children.items():
            if id(child) not in seen:
                seen.add(id(child))
                todo.append((f"{path}/{name}" if path else name, child, depth + 1))
    return out


def assert_matched_except(status, allowed) -> None:
    """``status.assert_existing_objects_matched()`` (a ``tf.train.Checkpoint``
    read's status), except that the objects in ``allowed`` may be unmatched
    (e.g. the id -> row map of a DynamicEmbedding shard the checkpoint,
    written over fewer shards, does not hold). TF 2.21's
    ``CheckpointLoadStatus``: its ``_checkpoint.all_python_objects`` and
    ``object_by_proto_id``, filled by the assertion; without them the
    assertion's error stands.

    Raises:
      AssertionError: TensorFlow's, when an object not in ``allowed`` is unmatched.
    """
    try:
        status.assert_existing_objects_matched()
        return
    except AssertionError as e:
        error = e
    try:
        from tensorflow.python.checkpoint import checkpoint as tf_checkpoint
        state = status._checkpoint
        matched = {id(o) for o in state.object_by_proto_id.values()}
        unused = [o for o in tf_checkpoint._objects_with_attributes(state.all_python_objects)
                  if id(o) not in matched]
    except (AttributeError, ImportError):
        raise error from None
    allowed = {id(o) for o in allowed}
    if not unused or any(id(o) not in allowed for o in unused):
        raise error
