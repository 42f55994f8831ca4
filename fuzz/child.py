"""`python -m fuzz.child HARNESS [libFuzzer flags] [corpus dirs]`: one harness under atheris.

HARNESS is a name of fuzz.HARNESSES, or the dotted name of another module with the same
interface (one_input, mutator, setup, seeds, MAX_LEN), importable on PYTHONPATH, whose Python
code is not instrumented: the tests plant bugs in such modules to see findings come out.

The runner (fuzz.runner) starts this, one process per harness: libFuzzer ends the process when
it is done or finds something, and the native step harness needs the sanitizer runtime
preloaded into a process of its own. It prints one `FUZZ-INFO {json}` line (what the harness
runs against: sanitizers, coverage, fallbacks and why) before libFuzzer starts.
"""

from __future__ import annotations

import ctypes
import importlib
import json
import os
import sys
import traceback

from . import HARNESSES, HarnessUnavailable

INFO_PREFIX = "FUZZ-INFO "
UNAVAILABLE_PREFIX = "FUZZ-UNAVAILABLE "
UNAVAILABLE_EXIT = 3
# The command that starts this harness again, for libFuzzer's -merge (which runs its own
# command line in a subprocess): the runner's wrapper script, as argv[0] is this file.
ARGV0_ENV = "FUZZ_ARGV0"


def _preloaded_mutator_shim():
    """The process itself when fuzz/native/custom_mutator_shim.c was preloaded (with a
    preloaded libFuzzer, which finds a custom mutator only there), else None."""
    process = ctypes.CDLL(None)
    return process if hasattr(process, "fuzz_set_custom_mutator") else None


_C_MUTATOR = ctypes.CFUNCTYPE(ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte), ctypes.c_size_t, ctypes.c_size_t,
                              ctypes.c_uint)
_kept = []  # the C callback must outlive the fuzzing


def _as_c_mutator(mutator):
    def call(data, size, max_size, seed):
        try:
            out = mutator(ctypes.string_at(data, size), max_size, seed)
            n = min(len(out), max_size)
            ctypes.memmove(data, out, n)
            return n
        except BaseException:
            # ctypes would print this and go on with 0 bytes: a broken mutator must stop the run.
            traceback.print_exc()
            sys.stderr.flush()
            os.abort()

    callback = _C_MUTATOR(call)
    _kept.append(callback)
    return callback


def module_name(harness: str) -> str:
    return f"fuzz.{harness}" if harness in HARNESSES else harness


def main(argv: list[str]) -> None:
    if len(argv) < 2:
        raise SystemExit(f"usage: python -m fuzz.child {{{','.join(HARNESSES)}|MODULE}} [libFuzzer flags]")
    name = argv[1]
    import atheris

    # The Python packages named for this harness are instrumented as they are first imported,
    # by the harness module's own imports.
    packages = HARNESSES.get(name, ())
    if packages:
        with atheris.instrument_imports(include=list(packages)):
            harness = importlib.import_module(module_name(name))
    else:
        harness = importlib.import_module(module_name(name))
    mutator, how = harness.mutator, "libFuzzer's own"
    if mutator is not None and _preloaded_mutator_shim() is not None:
        _preloaded_mutator_shim().fuzz_set_custom_mutator(_as_c_mutator(mutator))
        mutator, how = None, "structure-aware (fuzz.structure), through the preloaded shim"
    elif mutator is not None:
        how = "structure-aware (fuzz.structure)"
    atheris.Setup([os.environ.get(ARGV0_ENV, argv[0]), *argv[2:]], harness.one_input, custom_mutator=mutator)
    try:
        info = harness.setup()
    except HarnessUnavailable as exc:
        print(UNAVAILABLE_PREFIX + str(exc), flush=True)
        sys.exit(UNAVAILABLE_EXIT)
    print(INFO_PREFIX + json.dumps({"harness": name, "mutator": how, **info}), flush=True)
    atheris.Fuzz()


if __name__ == "__main__":
    main(sys.argv)
