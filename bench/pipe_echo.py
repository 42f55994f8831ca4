"""The C pipe echo (bench/echo/pipe_echo.c): the floor for the stdio lane. Built on demand
into build/ with the system C compiler."""

from __future__ import annotations

import os
import shutil
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCE = os.path.join(ROOT, "bench", "echo", "pipe_echo.c")
BINARY = os.path.join(ROOT, "build", "pipe_echo")


class EchoUnavailable(RuntimeError):
    pass


def build_pipe_echo() -> str:
    """Path to the echo binary, (re)built when the source is newer."""
    if os.path.exists(BINARY) and os.path.getmtime(BINARY) >= os.path.getmtime(SOURCE):
        return BINARY
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if cc is None:
        raise EchoUnavailable("no C compiler (cc/gcc) on PATH to build the pipe echo")
    os.makedirs(os.path.dirname(BINARY), exist_ok=True)
    result = subprocess.run([cc, "-O2", "-o", BINARY, SOURCE], capture_output=True, text=True)
    if result.returncode != 0:
        raise EchoUnavailable(f"building the pipe echo failed: {result.stderr.strip()}")
    return BINARY
