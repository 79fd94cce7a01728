"""SavedModels: Keras 3's export with extra objects under stable names, and
the object paths a SavedModel on disk holds.

``model.export(path, format="tf_saved_model")`` (Keras 3.15.1,
``keras/src/export/saved_model.py``'s ``export_saved_model``) writes an
``ExportArchive`` whose root is a fresh ``AutoTrackable``: the model is not
a child of it, and the lookup tables its endpoint uses are kept as
``_misc_assets/<k>``, numbered in the order of a walk of the model, so a
reader cannot tell which table is which. :func:`export_saved_model` writes
the same archive (the ``serve`` endpoint of the model's own input
signature, ``export_utils.get_input_signature``) with given objects set as
children of that root (``ExportArchive._tf_trackable``), under names the
loaded object keeps (the served functions are the same: TensorFlow's save
traces them again in its save context, where
``tf_asyncps.layers.DynamicEmbedding`` reads its map only).

:func:`missing_paths` checks object paths
(``layer_with_weights-0/dynamic_table/shards/0/index``) in a SavedModel's
``saved_model.pb`` (TensorFlow 2.21.0's ``SavedObjectGraph`` proto) without
loading it; :func:`object_at` follows one on a loaded object.

Tested with Keras 3.15.1 and TensorFlow 2.21.0. Imports Keras when called.
"""

__all__ = ["export_saved_model", "missing_paths", "object_at", "SERVE"]

#: The endpoint's name, as ``model.export`` names it.
SERVE = "serve"


def export_saved_model(model, path: str, children: dict) -> None:
    """Writes ``model``'s SavedModel to ``path`` as ``model.export(path,
    format="tf_saved_model", verbose=False)`` does (a ``serve`` endpoint
    taking the model's inputs), plus each ``children[name]`` (a trackable,
    or a dict/list of them) as the root's attribute ``name``
    (``tf.saved_model.load(path).<name>``).

    Raises:
      ValueError: Keras's, for a model not built; a child name the archive
        uses itself (``serve``, ``variables``, ...).
    """
    from keras.export import ExportArchive
    from keras.src.export import export_utils

    archive = ExportArchive()
    root = archive._tf_trackable
    for name in children:
        if name == SERVE or hasattr(root, name):
            raise ValueError(f"export_saved_model: the child name {name!r} is the archive's "
                             "own; pick another.")
    archive.track_and_add_endpoint(SERVE, model, export_utils.get_input_signature(model))
    for name, obj in children.items():
        setattr(root, name, obj)
    archive.write_out(path, verbose=False)


def missing_paths(saved_model_dir: str, paths) -> list:
    """Those of ``paths`` (object paths, ``a/b/0``: child names from the root,
    as :func:`object_at` follows them) that the SavedModel in
    ``saved_model_dir`` does not hold, read from its ``saved_model.pb``
    without loading it.

    Raises:
      OSError: no ``saved_model.pb`` there.
    """
    import os

    from tensorflow.core.protobuf import saved_model_pb2

    proto = saved_model_pb2.SavedModel()
    with open(os.path.join(saved_model_dir, "saved_model.pb"), "rb") as f:
        proto.ParseFromString(f.read())
    nodes = proto.meta_graphs[0].object_graph_def.nodes

    def holds(path):
        node = 0
        for name in path.split("/"):
            ids = [c.node_id for c in nodes[node].children if c.local_name == name]
            if not ids:
                return False
            node = ids[0]
        return True

    return [p for p in paths if not holds(p)]


def object_at(root, path: str):
    """The object at ``path`` (child names from ``root``, ``a/b/0``) in
    ``root``'s object graph (TensorFlow 2.21's
    ``Trackable._trackable_children``: a loaded SavedModel's names), else None."""
    obj = root
    for name in path.split("/"):
        try:
            obj = obj._trackable_children().get(name)
        except (AttributeError, TypeError, ValueError):
            return None
        if obj is None:
            return None
    return obj
