"""One layer name for both Kerases: which Keras a layer is made for.

``tf_asyncps.layers.DynamicEmbedding(...)`` makes the tf_keras layer or the
Keras 3 one (``tf_asyncps.keras3.DynamicEmbedding``); the object is an
instance of that concrete class (registered with its Keras, so
``get_config``, ``from_config`` and ``load_model`` find it), and
``isinstance(obj, tf_asyncps.layers.DynamicEmbedding)`` holds for both.
:func:`picker` makes such a name; every layer of this package that exists
for both Kerases uses it, with this rule (:func:`choose`), first match wins:

1. ``keras="tf_keras"`` or ``keras="keras3"`` given to the constructor;
2. made while a model or layer is being made on this thread (a subclassed
   model's or layer's ``__init__`` on the stack): its Keras;
3. the Keras the code making the layer imported: the module objects bound
   in the calling function's locals and its module's globals, when they are
   of one Keras only (``import keras`` / ``from keras import layers``:
   Keras 3; ``import tf_keras`` / ``from tf_keras import layers``: tf_keras);
4. otherwise tf_keras (what the name meant before this rule).

A layer called on the other Keras's symbolic tensor (``keras.Input`` given
to the tf_keras layer) fails with a ``TypeError`` naming the class to use
(:func:`check_input`). Importing this module imports no Keras.
"""

import sys

from tf_asyncps.compat import keras_layers as frames_compat

__all__ = ["KERASES", "choose", "check_input", "picker"]

KERASES = ("tf_keras", "keras3")


def _owner_keras(obj):
    """"keras3"/"tf_keras" if ``obj`` is a layer (a model too) of that Keras, else None."""
    if obj is None:
        return None
    keras = sys.modules.get("keras")
    if (keras is not None and str(getattr(keras, "__version__", "")).startswith("3.")
            and isinstance(obj, keras.layers.Layer)):
        return "keras3"
    tf_keras = sys.modules.get("tf_keras")
    if tf_keras is not None and isinstance(obj, tf_keras.layers.Layer):
        return "tf_keras"
    return None


def _module_keras(value):
    """The Keras a module object belongs to, else None."""
    if type(value).__name__ not in ("module", "KerasLazyLoader"):
        return None
    top = getattr(value, "__name__", "").split(".")[0]
    if top == "tf_keras":
        return "tf_keras"
    if top == "keras" and str(getattr(sys.modules.get("keras"), "__version__", "")
                              ).startswith("3."):
        return "keras3"
    return None


def choose(keras=None, frame=None, layer: str = "DynamicEmbedding", frames: int = 60) -> str:
    """Which Keras a layer made now is for (the module docstring's rule).

    Args:
      keras: the constructor's ``keras`` argument: None, "tf_keras" or "keras3".
      frame: the frame of the code making the layer (rule 3); None: the caller's.
      layer: the layer's name, for the error.
      frames: how far up the stack rule 2 looks.

    Returns:
      "tf_keras" or "keras3".

    Raises:
      ValueError: ``keras`` is not None, "tf_keras" or "keras3".
    """
    if keras is not None:
        if keras not in KERASES:
            raise ValueError(f"{layer}(keras={keras!r}): use keras=\"tf_keras\" or "
                             f"keras=\"keras3\" (Keras 3), or leave it out (the rule in "
                             f"docs/guides/dynamic_embeddings.md, \"Which Keras\").")
        return keras
    frame = frame or frames_compat.caller(1)
    found = frames_compat.model_being_made(frame, _owner_keras, frames)
    if found:
        return found
    seen = {_module_keras(v) for v in frames_compat.bound_values(frame)} - {None}
    if len(seen) == 1:
        return seen.pop()
    return "tf_keras"


def check_input(x, keras: str, layer, *,
                module: str = "tf_asyncps.layers.dynamic_embedding",
                guide: str = ' (which Keras tf_asyncps.layers.{name} picks: '
                             'docs/guides/dynamic_embeddings.md, "Which Keras")') -> None:
    """Refuses the other Keras's symbolic tensor as a layer's input.

    Args:
      x: the input.
      keras: the Keras the layer is for ("tf_keras" or "keras3").
      layer: the layer (its class and name go in the error).
      module: the module of the layer's tf_keras class (named in the error).
      guide: said after the fix; ``{name}`` is the class name.

    Raises:
      TypeError: ``x`` is a symbolic tensor (``KerasTensor``) of the other
        Keras, naming the class (or ``keras=`` argument) to use.
    """
    kind = type(x)
    if kind.__name__ != "KerasTensor":
        return
    other = "keras3" if kind.__module__.startswith("keras.") else (
        "tf_keras" if kind.__module__.startswith("tf_keras.") else None)
    if other is None or other == keras:
        return
    name = type(layer).__name__
    use = (f"tf_asyncps.keras3.{name}" if other == "keras3"
           else f"{module}.{name}")
    raise TypeError(
        f"{name} {layer.name!r} is the {'tf_keras' if keras == 'tf_keras' else 'Keras 3'} "
        f"layer and got a {'Keras 3' if other == 'keras3' else 'tf_keras'} KerasTensor: make "
        f"it with tf_asyncps.layers.{name}(..., keras=\"{other}\") or {use}(...)"
        f"{guide.format(name=name)}.")


class _Picker(type):
    """Metaclass of a name made by :func:`picker`."""

    def __call__(cls, *args, keras=None, **kwargs):
        return cls._concrete(choose(keras, frames_compat.caller(1), cls.__name__))(
            *args, **kwargs)

    def __instancecheck__(cls, obj):
        return any(isinstance(obj, c) for c in cls._made())

    def __subclasscheck__(cls, sub):
        return sub is cls or any(issubclass(sub, c) for c in cls._made())


def picker(name: str, doc: str, classes: dict, made, module: str):
    """A class-like name whose call makes the layer of the Keras :func:`choose` picks.

    Args:
      name: the layer's name (e.g. "DynamicEmbedding").
      doc: its docstring.
      classes: ``{"tf_keras": fn, "keras3": fn}``, each ``fn()`` returning
        that Keras's concrete class (made, and registered, on first use).
      made: ``made()``: the concrete classes made so far (``isinstance`` and
        ``issubclass`` look at these: an object exists only if its class does).
      module: the ``__module__`` to show.

    Returns:
      The name: calling it (with an optional ``keras=`` argument) returns an
      instance of the chosen concrete class; ``isinstance``/``issubclass``
      hold for both concrete classes; ``from_config(config, keras=None)``
      picks the same way.
    """
    def concrete(keras):
        return classes[keras]()

    def from_config(cls, config, keras=None):
        return concrete(choose(keras, frames_compat.caller(1), name)).from_config(config)

    return _Picker(name, (), {
        "__doc__": doc, "__module__": module, "_concrete": staticmethod(concrete),
        "_made": staticmethod(made), "from_config": classmethod(from_config)})
