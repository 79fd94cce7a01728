"""What a process needs of TensorFlow before any strategy exists: TensorFlow
imported without the Keras import of its ``__init__``
(:func:`import_without_keras`, for a process that checks flags), the part of
TensorFlow a ps/worker task process uses, imported lean
(:func:`serving_runtime`), and whether this process's eager context is
connected to a cluster (:func:`context_connected`).

Tested with TensorFlow 2.18.1, 2.19.1, 2.20.0 and 2.21.0
(:data:`tf_asyncps.compat.versions.TENSORFLOW_TESTED`; ``pyproject.toml``
asks for ``tensorflow>=2.18,<2.22``): nothing below differs between them,
unless a function names its own versions.
Importing this module is free (the CLI validates flags before TensorFlow
loads): each function imports TensorFlow when called.
"""

import functools
import sys

__all__ = ["import_without_keras", "serving_runtime", "context_connected"]


def import_without_keras():
    """Imports TensorFlow without the Keras import of its ``__init__``.

    TensorFlow 2.21's ``__init__`` imports Keras eagerly (``keras.src.optimizers``,
    or ``tf_keras.src.optimizers`` under ``TF_USE_LEGACY_KERAS``, for SavedModel
    registrations, b/196254385): 1.2-1.9 s of CPU, Keras 3 pulling in pandas
    and scipy. For a process that checks flags with TensorFlow (``launch``)
    and may never run Keras: Keras is hidden while TensorFlow imports
    (TensorFlow catches the ImportError, as where Keras is not installed) and
    imports normally afterwards. A TensorFlow already imported is returned as
    it is.

    Returns:
      The ``tensorflow`` module.
    """
    if "tensorflow" not in sys.modules:
        hidden = [m for m in ("keras", "tf_keras") if m not in sys.modules]
        for m in hidden:
            sys.modules[m] = None  # makes `import m` raise ImportError
        try:
            import tensorflow  # noqa: F401
        finally:
            for m in hidden:
                sys.modules.pop(m, None)
    return sys.modules["tensorflow"]


@functools.lru_cache(maxsize=None)
def serving_runtime():
    """The part of TensorFlow a ps/worker task process uses, imported lean.

    A ps/worker task only starts a ``tf.distribute.Server`` and joins it; the
    functions it runs come from the chief as graphs, executed by the C++
    runtime. Importing ``tensorflow`` costs ~3.5 s of CPU (4.5 s wall here)
    per process, most of it the generated public API (``tensorflow._api.v2``)
    and Keras; the modules below cost ~0.6 s. Unless TensorFlow is already
    imported, ``tensorflow``'s ``__init__`` is skipped while they import (a
    bare package object stands in for it, then is removed, so a later
    ``import tensorflow`` runs the real one). The C++ runtime, its kernels and
    the gRPC server are the same shared library either way.

    Tested with TensorFlow 2.21.0 (``tensorflow.python.training.server_lib``,
    ``tensorflow.python.framework.config``/``errors``,
    ``tensorflow.core.protobuf.config_pb2``).

    Returns:
      A namespace with ``Server`` (``tf.distribute.Server``), ``ConfigProto``
      (``tf.compat.v1.ConfigProto``), ``OpError`` (``tf.errors.OpError``),
      ``set_visible_devices`` and ``list_physical_devices`` (``tf.config``);
      the same one on every call.
    """
    import types
    stub = None
    if "tensorflow" not in sys.modules:
        import importlib.util
        spec = importlib.util.find_spec("tensorflow")
        stub = types.ModuleType("tensorflow")
        stub.__spec__, stub.__path__ = spec, list(spec.submodule_search_locations)
        sys.modules["tensorflow"] = stub
    try:
        from tensorflow.core.protobuf import config_pb2
        from tensorflow.python.framework import config, errors
        from tensorflow.python.training import server_lib
    finally:
        if stub is not None and sys.modules.get("tensorflow") is stub:
            del sys.modules["tensorflow"]
    return types.SimpleNamespace(
        Server=server_lib.Server, ConfigProto=config_pb2.ConfigProto, OpError=errors.OpError,
        set_visible_devices=config.set_visible_devices,
        list_physical_devices=config.list_physical_devices)


def context_connected() -> bool:
    """Whether this process's TensorFlow context is connected to a cluster.

    Reads ``context.context_safe()._server_def``. False when TensorFlow was
    never imported, or when the private API moved (assume not connected).
    """
    if "tensorflow" not in sys.modules:
        return False
    try:
        from tensorflow.python.eager import context
        ctx = context.context_safe()
        return ctx is not None and getattr(ctx, "_server_def", None) is not None
    except Exception:  # pragma: no cover - private API moved: assume not
        return False
