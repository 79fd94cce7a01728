"""The policy base class and its types (defined in ``tf_asyncps/core/protocol.py``,
the contract between the engine and the rules; re-exported here)."""

from tf_asyncps.core.protocol import (Decision, Keep, PolicyRuntime, StepInfo,
                                      UpdatePolicy, after_apply_of, as_decision)

__all__ = ["UpdatePolicy", "StepInfo", "Decision", "Keep", "PolicyRuntime", "as_decision",
           "after_apply_of"]
