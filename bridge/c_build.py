"""Compiling one C file with the system's compiler (`$CC`, else cc, else gcc): the small native
pieces that need no torch headers (the exit guard, the benches' echoes)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess


def c_compiler() -> str | None:
    """The compiler's path, or None where there is none."""
    return shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")


def compile_c(output: str | os.PathLike, source: str | os.PathLike, flags=(), libs=()) -> None:
    """`cc -O2 FLAGS -o OUTPUT SOURCE LIBS`, built under a name of its own and renamed into place:
    a process loading or starting OUTPUT meanwhile (a parallel test, a server starting beside
    another) gets the old file or the new one, never a half-written one. OSError says why it
    could not."""
    compiler = c_compiler()
    if compiler is None:
        raise OSError("no C compiler (cc/gcc) on PATH")
    output = os.fspath(output)
    os.makedirs(os.path.dirname(output) or ".", exist_ok=True)
    partial = f"{output}.{os.getpid()}.partial"
    # In a group of its own, stopped whole if the caller is stopped meanwhile (a bench's SIGTERM):
    # killing the driver alone left its cc1 and as running, and their temporary files behind.
    compiling = subprocess.Popen([compiler, "-O2", *flags, "-o", partial, os.fspath(source), *libs],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _, errors = compiling.communicate()
        if compiling.returncode != 0:
            raise OSError(f"{os.path.basename(compiler)} failed on {os.path.basename(source)}: {errors.strip()}")
        os.replace(partial, output)
    except BaseException:
        if compiling.poll() is None:
            # SIGTERM first: the driver then removes its temporary files itself.
            os.killpg(compiling.pid, signal.SIGTERM)
            try:
                compiling.wait(5)
            except subprocess.TimeoutExpired:
                os.killpg(compiling.pid, signal.SIGKILL)
                compiling.wait()
        if os.path.exists(partial):
            os.unlink(partial)
        raise
