"""Runs a command that dies with a given parent: ``shim.py PARENT_PID -- CMD...``.

Started by :func:`tf_asyncps.cluster.spawn.spawn`, by path (never imported,
imports nothing from tf_asyncps). It asks Linux for SIGTERM when its parent
dies (``prctl(PR_SET_PDEATHSIG)``, which survives ``exec``), checks that the
parent is still ``PARENT_PID`` (it may have died before the ``prctl``), then
replaces itself with ``CMD``.

Exit codes: 2 for bad arguments, 1 if the parent is already gone, 127 if
``CMD`` cannot be run.
"""

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def main(argv):
    if len(argv) < 4 or argv[2] != "--" or not argv[1].isdigit():
        sys.stderr.write("usage: deathsig_shim.py PARENT_PID -- COMMAND [ARG...]\n")
        return 2
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):  # not Linux: run without the death signal
        pass
    if os.getppid() != int(argv[1]):
        return 1  # the parent died before prctl: nobody would stop the command
    cmd = argv[3:]
    try:
        os.execvp(cmd[0], cmd)
    except OSError as e:
        sys.stderr.write(f"deathsig_shim: cannot run {cmd[0]!r}: {e}\n")
    return 127


if __name__ == "__main__":
    sys.exit(main(sys.argv))
