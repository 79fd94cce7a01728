"""Private TensorFlow APIs used by tf_asyncps, in one place.

Tested with TensorFlow 2.21.0 (``setup.py`` pins ``tensorflow>=2.21,<2.22``).
Every function imports TensorFlow when called, so importing this module is
free (the CLI validates flags before TensorFlow loads).
"""

import sys

__all__ = ["context_connected"]

TESTED_VERSIONS = ("2.21.0",)


def context_connected() -> bool:
    """Whether this process's TensorFlow context is connected to a cluster.

    Reads ``tensorflow.python.eager.context.context_safe()._server_def``
    (TF 2.21). False when TensorFlow was never imported, or when the private
    API moved (assume not connected).
    """
    if "tensorflow" not in sys.modules:
        return False
    try:
        from tensorflow.python.eager import context
        ctx = context.context_safe()
        return ctx is not None and getattr(ctx, "_server_def", None) is not None
    except Exception:  # pragma: no cover - private API moved: assume not
        return False
