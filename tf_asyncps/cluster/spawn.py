"""Child processes that die with this process: :func:`spawn`.

Linux sends the parent-death signal (``PR_SET_PDEATHSIG``) when the *thread*
that forked the child exits, not the process. So every child is forked by one
daemon "spawner" thread that lives as long as this process, and the child
sets its death signal itself, in ``deathsig_shim.py``, before it ``exec``s
the real command (no ``preexec_fn``, which is unsafe in a threaded parent).
"""

import concurrent.futures
import os
import queue
import subprocess
import sys
import threading
from typing import Optional, Sequence

__all__ = ["spawn"]

SHIM = os.path.join(os.path.dirname(os.path.abspath(__file__)), "deathsig_shim.py")

_lock = threading.Lock()
_requests: Optional[queue.SimpleQueue] = None  # (argv, popen kwargs, Future)


def _serve(requests: queue.SimpleQueue) -> None:
    """The spawner thread: forks every child, and never returns."""
    while True:
        argv, kwargs, future = requests.get()
        if not future.set_running_or_notify_cancel():
            continue
        try:
            future.set_result(subprocess.Popen(argv, **kwargs))
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            future.set_exception(e)


def _spawner() -> queue.SimpleQueue:
    """The request queue of this process's spawner thread (started on first use)."""
    global _requests
    with _lock:
        if _requests is None:
            _requests = queue.SimpleQueue()
            threading.Thread(target=_serve, args=(_requests,), daemon=True,
                             name="tf_asyncps-spawner").start()
        return _requests


def _forget_spawner() -> None:
    # A forked child has no spawner thread: it starts its own when needed.
    global _requests, _lock
    _requests, _lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_spawner)


def spawn(cmd: Sequence[str], **popen_kwargs) -> subprocess.Popen:
    """Starts ``cmd`` as a child that gets SIGTERM when this process dies.

    The death signal comes however this process ends (exit, crash, SIGKILL),
    whichever thread calls ``spawn``, and however long that thread lives.

    Args:
      cmd: the command and its arguments; ``cmd[0]`` is looked up on the
        child's ``PATH`` (its ``env``) like ``subprocess.Popen`` does.
      **popen_kwargs: passed to ``subprocess.Popen`` (``env``, ``stdout``,
        ``stderr``, ``stdin``, ``cwd``, ...), except ``preexec_fn``.

    Returns:
      The ``subprocess.Popen`` of the child. Its pid is the command's: the
      shim ``exec``s it in the same process. If ``cmd[0]`` cannot be run the
      child exits with code 127 (``Popen`` would raise instead).

    Raises:
      ValueError: ``cmd`` is empty, or ``preexec_fn`` was given.
      OSError: the child could not be forked.
    """
    cmd = [os.fspath(c) for c in cmd]
    if not cmd:
        raise ValueError("spawn: empty command.")
    if "preexec_fn" in popen_kwargs:
        raise ValueError("spawn: preexec_fn is not supported (unsafe with threads).")
    # -I: the shim's folder and PYTHON* variables stay out of the shim itself;
    # the command gets the environment unchanged.
    argv = [sys.executable, "-I", SHIM, str(os.getpid()), "--", *cmd]
    future = concurrent.futures.Future()
    _spawner().put((argv, popen_kwargs, future))
    return future.result()
