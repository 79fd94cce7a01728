"""A ``tf.lookup.experimental.MutableHashTable`` with a shared name of the caller's.

TensorFlow 2.21.0 (tested; the same code since 2.4) names an eagerly created
``MutableHashTable``'s resource ``"table_%d" % ops.uid()``: a per-process
counter, and the table has no ``shared_name`` argument. On a ps task that
outlives the chief (a chief re-run by ``launch --restart_failed_tasks``, a
second job's chief on the same tasks), the new chief process counts the same
numbers and gets the old chief's tables back, contents and all, as it did
its queues (``tf_asyncps.core.placement``). :func:`mutable_hash_table` sets
the name before the resource is made; the table is otherwise TensorFlow's
own (its checkpoint entry is keyed by the object's path, not this name; a
SavedModel re-creates it under the same name, in a process of its own).
Importing this module imports nothing.
"""

__all__ = ["mutable_hash_table"]

_CLASS = []


def _named_class():
    """MutableHashTable whose resource is made under ``_asyncps_shared_name``."""
    if not _CLASS:
        import tensorflow as tf

        class NamedMutableHashTable(tf.lookup.experimental.MutableHashTable):
            """TensorFlow's table, its resource's shared name given (private:
            ``_shared_name`` is read by ``_create_resource``)."""

            def __init__(self, *args, asyncps_shared_name, **kwargs):
                self._asyncps_shared_name = asyncps_shared_name
                super().__init__(*args, **kwargs)

            def _create_resource(self):
                self._shared_name = self._asyncps_shared_name
                return super()._create_resource()

        _CLASS.append(NamedMutableHashTable)
    return _CLASS[0]


def mutable_hash_table(key_dtype, value_dtype, default_value, name: str, shared_name: str):
    """``tf.lookup.experimental.MutableHashTable(key_dtype, value_dtype,
    default_value, name=name)`` made (on the current device) under the
    resource name ``shared_name`` (str) instead of a per-process counter."""
    return _named_class()(key_dtype, value_dtype, default_value, name=name,
                          asyncps_shared_name=shared_name)
