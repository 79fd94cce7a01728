"""Crash-safe JSON files: a reader sees the old file or the new one, never a
partial one. No TensorFlow import: ``LocalCluster`` and the CLI use these
before (or without) loading TensorFlow."""

import json
import os
import tempfile
from typing import Any, Dict, Optional

__all__ = ["atomic_write_json", "read_json"]


def atomic_write_json(path: str, obj: Any) -> None:
    """Writes ``obj`` as JSON to ``path`` so that readers see the old or the
    new file, never a partial one (write to a temp file, fsync, rename).

    Raises:
      OSError: the directory is not writable.
    """
    d = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".json", dir=d)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f, indent=2)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def read_json(path: str) -> Optional[Dict[str, Any]]:
    """The JSON object at ``path``, or None if missing or unreadable."""
    try:
        with open(path) as f:
            obj = json.load(f)
        return obj if isinstance(obj, dict) else None
    except (OSError, ValueError):
        return None
