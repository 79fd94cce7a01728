"""The policy base class and its types (defined in ``tf_asyncps/core/protocol.py``,
the contract between the engine and the rules; re-exported here)."""

from tf_asyncps.core.protocol import (Decision, Keep, PolicyRuntime, StepInfo,
                                      UpdatePolicy, after_apply_of, as_decision)
from tf_asyncps.validate import check_int

__all__ = ["UpdatePolicy", "StepInfo", "Decision", "Keep", "PolicyRuntime", "as_decision",
           "after_apply_of", "check_count"]

_INT64_LIMIT = 2 ** 63  # the policies' counts meet int64 counters in the graph


def check_count(policy: str, name: str, value, minimum: int, unit: str) -> int:
    """``value`` as a Python int, if it is an integer (also a NumPy one; not
    a bool) with ``minimum <= value < 2**63``.

    Raises:
      ValueError: naming ``policy``, ``name``, the range and ``unit``.
    """
    return check_int(value, f"{policy}: {name}", min=minimum, below=_INT64_LIMIT, hint=unit)
