"""The exit guard (guard.c): a process that shares the server's memory, so that a server killed
by a signal closes its pipes and sockets before the kernel frees that memory, not after.

A client learns that the server died when its pipe or socket to it closes. The kernel closes a
killed process's descriptors only after it has freed the process's memory, and a server's
(torch's libraries alone are about 200 MiB resident) took 25 ms at the median to free here
(docs/performance.md, "exit guard"): every Port owner and the cluster's failover waited that
long to notice a kill -9. While the guard shares the memory, a killed server's exit goes straight
on to closing its descriptors; the guard then reads its pipe's end of file, exits, and the
memory is freed by its exit instead.

The guard holds no descriptor but the read end of that pipe (the server holds the only write
end, non-inheritable), blocks every signal (SIGKILL still ends it), and calls no libc function.
It runs at the server's priority: under SCHED_IDLE it was no faster to fail over, and on a busy
machine a normal exit, which waits for it, waited longer (docs/performance.md, "exit guard").
A server that exits normally ends and reaps it first (atexit). After a kill, it is reaped by
whatever adopts orphans (init, a subreaper); where that reaps nothing, it stays a zombie. `ps`
lists it as a second process with the server's command line. Linux on x86-64 and aarch64 with
a C compiler (built once, like the kernels); elsewhere, or with --no-exit-guard, the server runs
without it.
"""

from __future__ import annotations

import atexit
import ctypes
import hashlib
import logging
import os
import platform
import sys
import time
from pathlib import Path

from ..c_build import c_compiler, compile_c

log = logging.getLogger("bridge.exit_guard")

SOURCE = Path(__file__).resolve().parent / "guard.c"
MACHINES = ("x86_64", "aarch64")
# How long a normal exit waits for the guard to end before leaving it to whoever adopts it.
STOP_TIMEOUT_S = 1.0

_running: tuple[int, int] | None = None  # (the guard's pid, the pipe's write end)


def library_path() -> Path:
    """Where the guard's library is built (or was, in a read-only checkout): beside the kernels'
    builds, by the digest of its source and compiler."""
    from scan_kernels.cpu.build import located

    digest = hashlib.sha256(SOURCE.read_bytes() + str(c_compiler()).encode()).hexdigest()[:16]
    return located(Path("exit_guard") / digest / "libexit_guard.so")


def start() -> int | None:
    """Starts the guard: its pid, or None (the reason logged) where it cannot run here."""
    global _running
    if _running is not None:
        return _running[0]
    if sys.platform != "linux" or platform.machine() not in MACHINES:
        log.info("no exit guard: it runs on Linux on %s only", " and ".join(MACHINES))
        return None
    try:
        path = library_path()
        if not path.is_file():
            compile_c(path, SOURCE, flags=("-shared", "-fPIC"))
        library = ctypes.CDLL(str(path))
    except OSError as exc:
        log.warning("no exit guard: %s", exc)
        return None
    read_end, write_end = os.pipe()
    pid = library.exit_guard_start(read_end)
    os.close(read_end)
    if pid < 0:
        os.close(write_end)
        log.warning("no exit guard: clone failed")
        return None
    _running = (pid, write_end)
    atexit.register(stop)
    log.debug("exit guard %d", pid)
    return pid


def stop() -> None:
    """Ends the guard and reaps it (a normal exit leaves nothing behind)."""
    global _running
    if _running is None:
        return
    pid, write_end = _running
    _running = None
    os.close(write_end)
    deadline = time.monotonic() + STOP_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                return
        except ChildProcessError:
            return
        time.sleep(0.001)
    log.warning("exit guard %d still running after %.1f s", pid, STOP_TIMEOUT_S)
