"""The C++ code under the sanitizers.

AddressSanitizer and UndefinedBehaviorSanitizer: the CPU kernels' and the native step path's own
suites run again in a child pytest whose extensions are built with -fsanitize=address,undefined
(scan_kernels.cpu.build's SANITIZE_ENV), every finding fatal. The native path parses untrusted frames
in a long-lived server, and the kernels write through pool slots and raw addresses: an
out-of-bounds read or write there would pass an ordinary run unnoticed. The child's servers (the
suites start some) inherit the environment and load the same builds.

ThreadSanitizer: the kernels' helper pool (scan_kernels/cpu/helper_pool.h), whose calls and helpers
meet through atomics, driven by tests/cpp/helper_pool_stress.cpp. Python and torch are not built
for TSan, so the pool is tested alone, not through the extension.

Where the compiler has no runtime for a sanitizer its test skips and says why (in CI that fails
the run, tests/conftest.py).
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from bridge import native
from scan_kernels.cpu import build
from process_runs import BackgroundRun

ROOT = Path(__file__).resolve().parents[1]
SUITES = ["tests/test_native_step.py", "tests/test_kernels_cpu.py"]
# Left out, as minutes under the sanitizers that run no C++ the other tests do not: the bench
# runner's tests (whole bench runs in fresh processes) and the build of several copies of the
# sources (kernel_ab's loading; 159 s). The SIMD variants' tests stay: they are the only ones
# that run the AVX2 and baseline vector code here. Also left out: the helper-wake test, which
# asserts that two calls come within the pool's spin of each other, a timing the sanitizers'
# slowdown breaks on a busy machine (it runs unsanitized in the main suite); and the aarch64
# cross-compile, which builds without the sanitizers and loads nothing.
DESELECT = ("not bench_runner and not kernel_ab and not each_copy_of_the_sources and not helpers_are_woken "
            "and not kernels_compile_for_aarch64")
SANITIZERS = "address,undefined"
# Python allocates for its lifetime without freeing at exit: leak reports would be its own.
ASAN_OPTIONS = "detect_leaks=0:abort_on_error=1:print_summary=1"
TIMEOUT_S = 1200


def compiler_library(name: str) -> str | None:
    """The path of a library the C++ compiler links with, None where it has none."""
    compiler = shutil.which(os.environ.get("CXX", "c++"))
    if compiler is None:
        return None
    found = subprocess.run([compiler, f"-print-file-name={name}"], capture_output=True, text=True).stdout.strip()
    # Without the library the compiler prints the bare name back.
    return found if os.path.isabs(found) and os.path.exists(found) else None


def asan_preload() -> list[str | None]:
    # libstdc++ is preloaded after the ASan runtime so that the runtime, when it starts, finds
    # the C++ exception functions it wraps (Python does not link libstdc++; without it the first
    # exception a kernel throws fails ASan's own check).
    return [compiler_library("libasan.so"), compiler_library("libstdc++.so")]


# Reports go to files: pytest captures the child's stderr, which an abort would lose.
REPORTS_DIR = Path(tempfile.gettempdir()) / f"scan-bridge-sanitizer-reports-{os.getpid()}"


@functools.cache
def sanitized_env() -> dict:
    """The environment of every sanitized child (made once: the reports directory emptied)."""
    shutil.rmtree(REPORTS_DIR, ignore_errors=True)
    REPORTS_DIR.mkdir()
    reports = REPORTS_DIR / "report"
    # PYTHONMALLOC=malloc: each Python object its own malloc block, so that ASan's bounds
    # around it catch a read past a frame's bytes (pymalloc's pools would hide most).
    return {**os.environ, build.SANITIZE_ENV: SANITIZERS, "LD_PRELOAD": " ".join(asan_preload()),
            "PYTHONMALLOC": "malloc",
            "ASAN_OPTIONS": f"{ASAN_OPTIONS}:log_path={reports}",
            "UBSAN_OPTIONS": f"print_stacktrace=1:log_path={reports}"}


def sanitized_child(*command: str):
    return [sys.executable, *command], {"timeout_s": TIMEOUT_S, "cwd": ROOT, "env": sanitized_env()}


# The longest suite of all, a child process: started beside the rest of the session as soon as
# the tests are collected (tests/conftest.py), judged by the test below. Its sanitized builds
# start with it, all at once: built one after another as its tests came to need them, they were
# most of its time. A test that needs a library still being built waits for that build (the
# build directory's lock), then loads it.
SANITIZED_BUILDS = {
    "the sanitized builds of the kernels": BackgroundRun(lambda: sanitized_child("-m", "scan_kernels.cpu.build", "--all")),
    "the sanitized build of the native step module": BackgroundRun(lambda: sanitized_child("-m", "bridge.native")),
}
SANITIZED_SUITES = BackgroundRun(lambda: sanitized_child("-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", DESELECT,
                                                         *SUITES))
SANITIZED_SUITES_TEST = "test_cpp_extensions_pass_their_suites_under_address_and_undefined_sanitizers"


def start_background_runs(selected: set[str]) -> None:
    if SANITIZED_SUITES_TEST in selected and None not in asan_preload():
        for run in (*SANITIZED_BUILDS.values(), SANITIZED_SUITES):
            run.start()


def test_cpp_extensions_pass_their_suites_under_address_and_undefined_sanitizers(monkeypatch):
    if None in asan_preload():
        pytest.skip("no ASan runtime (libasan) or libstdc++ for the C++ compiler here: the sanitizer pass needs them")
    runs = {**SANITIZED_BUILDS, "the sanitized suites": SANITIZED_SUITES}
    failures = [run.result().failure(name) for name, run in runs.items()]
    found = "".join(f"\n{path.name}:\n{path.read_text(errors='replace')[:6000]}"
                    for path in sorted(REPORTS_DIR.iterdir()))
    shutil.rmtree(REPORTS_DIR, ignore_errors=True)
    assert not found, f"sanitizer reports:{found}"
    assert failures == [None] * len(runs), "\n".join(f for f in failures if f)
    # The libraries the sanitizer setting selects (a digest of their own, which the child could
    # only load or build) exist and are linked to the ASan runtime: a pass against the ordinary
    # builds would prove nothing.
    monkeypatch.setenv(build.SANITIZE_ENV, SANITIZERS)
    for library in (build.library_path(), native.library_path()):
        assert library.is_file(), f"{library}: not built by the sanitizer pass"
        assert b"libasan.so" in library.read_bytes(), f"{library}: not linked to the ASan runtime"


def test_an_address_sanitized_build_refuses_a_process_without_its_runtime(monkeypatch):
    monkeypatch.setenv(build.SANITIZE_ENV, "address")
    with pytest.raises(build.BackendUnavailable, match="LD_PRELOAD"):
        build.load_extension()


def test_an_unknown_sanitizer_is_refused_with_what_is_accepted(monkeypatch):
    monkeypatch.setenv(build.SANITIZE_ENV, "address,thread")
    with pytest.raises(build.BackendUnavailable, match="address, undefined.*'address,thread'"):
        build.compile_flags()


POOL_STRESS = ROOT / "tests" / "cpp" / "helper_pool_stress.cpp"


def test_the_helper_pool_is_race_free_under_thread_sanitizer(tmp_path):
    """3 threads call the pool 1000 times each, then one alone calls it, waiting for its helpers:
    every sum right, every error handed back, no race. Found in CI: under load the helpers took
    part in too few of the first calls for any to throw, so the lone caller's calls make sure."""
    if compiler_library("libtsan.so") is None:
        pytest.skip("no ThreadSanitizer runtime (libtsan) for the C++ compiler here")
    binary = tmp_path / "helper_pool_stress"
    build = subprocess.run([os.environ.get("CXX", "c++"), "-std=c++17", "-O1", "-g", "-Wall", "-fsanitize=thread",
                            "-pthread", "-I", str(ROOT / "scan_kernels" / "cpu"), str(POOL_STRESS), "-o", str(binary)],
                           capture_output=True, text=True)
    assert build.returncode == 0, build.stderr
    run = subprocess.run([str(binary), "3", "1000"], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "TSAN_OPTIONS": "halt_on_error=1 exitcode=66"})
    assert run.returncode == 0 and "ThreadSanitizer" not in run.stderr, run.stderr[-6000:]
    # It exercised what it is for: calls helpers took part in, and helpers' errors handed back.
    exercised = re.search(r"helped (\d+), helper errors (\d+)", run.stdout)
    assert exercised and int(exercised[1]) > 0 and int(exercised[2]) > 0, run.stdout
