"""Keeps the Port protocol stream on stdout safe from stray writes.

A Port reads frames from our fd 1. Any byte written there by a library (a C `printf`, a
Python `print`, a warning) would corrupt the framing and the BEAM would misread every frame
after it. So before anything else we move the protocol to a private duplicate of fd 1 and point
fd 1 at stderr: stray writes end up in the log, frames stay intact.
"""

from __future__ import annotations

import fcntl
import os
import sys

# fcntl(F_SETPIPE_SZ) is Linux-only; the constant is missing from older Pythons' fcntl module.
F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)
PIPE_SIZE = 1 << 20


def open_missing_std_fds() -> None:
    """Open /dev/null on each of fds 0-2 the server was started without (a daemon's `2>&-`):
    the next descriptor made would take its number (the protocol's duplicate of stdout taking 0),
    and Python, finding it closed at start, left its sys stream None, which logging and the exit's
    flush then fail on."""
    for fd, name, mode in ((0, "stdin", "r"), (1, "stdout", "w"), (2, "stderr", "w")):
        try:
            os.fstat(fd)
            continue
        except OSError:
            pass
        null = os.open(os.devnull, os.O_RDONLY if mode == "r" else os.O_WRONLY)
        if null != fd:
            os.dup2(null, fd)
            os.close(null)
        setattr(sys, name, open(fd, mode, closefd=False))


def claim_protocol_stdout() -> int:
    """Return a private fd carrying what was stdout; fd 1 (and sys.stdout) now go to stderr."""
    open_missing_std_fds()
    protocol_fd = os.dup(1)
    os.set_inheritable(protocol_fd, False)
    os.dup2(2, 1)
    # Flushed only once fd 1 is stderr: what is still buffered (printed before the guard ran)
    # is a stray write too, and flushed before the dup2 it would go into the protocol stream.
    sys.stdout.flush()
    sys.stdout = sys.stderr
    return protocol_fd


def enlarge_pipe(fd: int, size: int = PIPE_SIZE) -> int | None:
    """Grow a pipe's kernel buffer (the BEAM creates 64 KiB pipes; a bigger buffer means fewer
    wake-ups per multi-MB frame). Returns the new size, or None where the fd is not a
    pipe or the OS refuses (e.g. above /proc/sys/fs/pipe-max-size for unprivileged users)."""
    try:
        return fcntl.fcntl(fd, F_SETPIPE_SZ, size)
    except OSError:
        return None
