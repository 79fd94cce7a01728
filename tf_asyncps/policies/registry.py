"""Name -> policy class registry: ``register``, ``get``, ``names``."""

import inspect
from typing import Callable, Dict, List, Type, Union

from tf_asyncps.policies.base import UpdatePolicy

__all__ = ["register", "get", "names"]

_REGISTRY: Dict[str, Type[UpdatePolicy]] = {}


def register(name: str) -> Callable[[type], type]:
    """Class decorator registering an :class:`UpdatePolicy` under ``name``.

    Raises:
      ValueError: if ``name`` is empty or already registered to another class.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"policy name must be a non-empty str, got {name!r}.")

    def deco(cls):
        if not (isinstance(cls, type) and issubclass(cls, UpdatePolicy)):
            raise TypeError(
                f"@register({name!r}) needs a subclass of UpdatePolicy, got {cls!r}.")
        old = _REGISTRY.get(name, cls)
        same_definition = (old.__module__, old.__qualname__) == (cls.__module__, cls.__qualname__)
        if old is not cls and not same_definition:  # a re-run cell may redefine it
            raise ValueError(
                f"policy name {name!r} is already registered to "
                f"{_REGISTRY[name].__name__}; choose another name.")
        _REGISTRY[name] = cls
        cls.name = name
        return cls

    return deco


def names() -> List[str]:
    """Sorted registered policy names."""
    return sorted(_REGISTRY)


def get(policy: Union[str, UpdatePolicy], **kwargs) -> UpdatePolicy:
    """Returns a policy object from a registered name or passes one through.

    Args:
      policy: a registered name (see :func:`names`) or an UpdatePolicy.
      **kwargs: constructor arguments, e.g. ``get("drop_stale", max_staleness=2)``.

    Raises:
      ValueError: unknown name (the message lists the choices) or arguments
        the policy does not take or rejects.
    """
    if isinstance(policy, UpdatePolicy):
        if kwargs:
            raise ValueError(
                f"policy arguments {sorted(kwargs)} given with a policy object "
                f"{policy!r}; pass them to its constructor instead.")
        return policy
    if not isinstance(policy, str) or policy not in _REGISTRY:
        raise ValueError(
            f"update_policy={policy!r} is not a registered policy; choose one of "
            f"{names()} or pass a tf_asyncps.policies.UpdatePolicy object.")
    cls = _REGISTRY[policy]
    try:
        inspect.signature(cls).bind(**kwargs)
    except TypeError as e:
        raise ValueError(
            f"bad arguments for policy {policy!r}: {e}. It takes "
            f"{cls.__name__}{inspect.signature(cls)}.") from None
    return cls(**kwargs)
