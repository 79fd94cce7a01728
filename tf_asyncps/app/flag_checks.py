"""Checks of flag values that more than one command reads (no TensorFlow import)."""

import os

__all__ = ["check_writable_dir"]


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
