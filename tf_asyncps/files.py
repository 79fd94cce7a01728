"""Crash-safe JSON files: a reader sees the old file or the new one, never a
partial one. No TensorFlow import: ``LocalCluster`` and the CLI use these
before (or without) loading TensorFlow."""

import json
import os
import tempfile
from typing import Any, Dict, Optional

__all__ = ["atomic_write_json", "read_json", "check_writable_dir"]


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


def check_writable_dir(path: str, flag: str, holds: str, if_empty: str = "") -> None:
    """Makes ``path`` a directory if needed and checks that files can be written there.

    Args:
      path: the directory.
      flag: the flag that named it (``"--output_dir"``), for the message.
      holds: what goes there (``"checkpoints"``), for the message.
      if_empty: what to do instead of an empty path, added to that message.

    Raises:
      ValueError: ``path`` is empty, is a file, or is not a writable directory
        (the message names the flag and the reason).
    """
    if not isinstance(path, str) or not path.strip():
        raise ValueError(f"{flag} must be a directory path, got {path!r}"
                         f"{'; ' + if_empty if if_empty else ''}.")
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"{flag}={path} is a file, not a directory; {holds} go there: "
                         "name a directory (it is made if missing).")
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, f".write-test-{os.getpid()}")
        with open(probe, "w"):
            pass
        os.remove(probe)
    except OSError as e:
        raise ValueError(f"{flag}={path} is not a writable directory ({e.strerror}); "
                         f"{holds} go there.") from None
