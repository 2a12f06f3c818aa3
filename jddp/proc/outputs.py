"""This process's stdout and stderr before a hard stop: wait until whatever reads them has
taken every byte written.

Why: ``MPI_Abort`` under MPICH's ``mpiexec`` (hydra) makes ``mpiexec`` kill the job and exit
at once. The line a rank printed just before is still in the pipe to hydra's proxy when the
proxy, run late on a busy machine, reads the abort first: the user then sees nothing at all
(``experiments/abort_lines.py``: with the proxy paused for a second, 6 of 30 aborts lost every
line; with this wait, none of 30). Waiting until the pipe is empty puts the line ahead of the
abort on the proxy's one connection to ``mpiexec``.
"""

from __future__ import annotations

import array
import fcntl
import os
import stat
import termios
import time

# Long enough for a proxy starved of CPU on a loaded machine; short enough that a reader that
# never reads (a stopped pager) only delays an exit that is already under way.
DRAIN_TIMEOUT_S = 10.0
_POLL_S = 0.005


def unread_bytes(fd: int) -> int:
    """How many bytes written to ``fd`` its reader has not taken yet: 0 unless ``fd`` is a
    pipe (a file or terminal keeps nothing back)."""
    try:
        if not stat.S_ISFIFO(os.fstat(fd).st_mode):
            return 0
        count = array.array("i", [0])
        fcntl.ioctl(fd, termios.FIONREAD, count)
    except OSError:  # closed, or not ours any more: nothing to wait for
        return 0
    return count[0]


def wait_until_read(fds: tuple[int, ...] = (1, 2), timeout_s: float = DRAIN_TIMEOUT_S) -> bool:
    """Wait until the pipes behind ``fds`` (stdout and stderr) hold nothing unread, at most
    ``timeout_s``; True when they were emptied. Flush Python's buffers first."""
    deadline = time.monotonic() + timeout_s
    while any(unread_bytes(fd) for fd in fds):
        if time.monotonic() >= deadline:
            return False
        time.sleep(_POLL_S)
    return True
