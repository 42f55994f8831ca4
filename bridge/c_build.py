"""Compiling one C file with the system's compiler (`$CC`, else cc, else gcc): the small native
pieces that need no torch headers (the exit guard, the benches' echoes)."""

from __future__ import annotations

import os
import shutil
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
    result = subprocess.run([compiler, "-O2", *flags, "-o", partial, os.fspath(source), *libs],
                            capture_output=True, text=True)
    if result.returncode != 0:
        if os.path.exists(partial):
            os.unlink(partial)
        raise OSError(f"{os.path.basename(compiler)} failed on {os.path.basename(source)}: {result.stderr.strip()}")
    os.replace(partial, output)
