"""The native step parser's fuzzing build: bridge/native/step.cpp compiled with clang under
AddressSanitizer and UndefinedBehaviorSanitizer, with libFuzzer's coverage instrumentation
(-fsanitize=fuzzer-no-link), into a Python module of its own, beside the CPU kernels it calls
(scan_kernels/cpu/scan_kernel.cpp and ssd_kernel.cpp behind fuzz/native/run_problem_shim.cpp),
sanitized too. The kernels are compiled by g++, as the server's is: clang 14 has no _Float16 on x86 without
AVX512-FP16, which the kernel's half-precision paths use. Both compilers' ASan and UBSan emit
calls into the same runtime interface (compiler-rt's), which the preloaded runtime serves.

The process that loads it preloads atheris's `asan_with_fuzzer.so`, an ASan runtime (with
UBSan's handlers) linked with the libFuzzer that atheris drives, so the parser's edges guide the
fuzzer and every out-of-bounds access or undefined operation in it is fatal. The library lives
in the git-ignored build/fuzz/native_step/<digest>/, the digest covering the sources, the flags
and the compiler, so an edited step.cpp is rebuilt on the next run.

`plan()` says which build a run gets: this one where clang++ and the runtimes are at hand, else
the server's own gcc build (bridge.native, -O3, no sanitizers, no C++ coverage), with the reason.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STEP_SOURCE = ROOT / "bridge" / "native" / "step.cpp"
KERNEL_DIR = ROOT / "scan_kernels" / "cpu"
KERNEL_SOURCES = ("scan_kernel.cpp", "ssd_kernel.cpp")
SHIM_SOURCE = Path(__file__).resolve().parent / "native" / "run_problem_shim.cpp"
MUTATOR_SHIM_SOURCE = Path(__file__).resolve().parent / "native" / "custom_mutator_shim.c"
MUTATOR_SHIM_NAME = "libfuzz_custom_mutator.so"
BUILD_DIR = ROOT / "build" / "fuzz" / "native_step"
MODULE_NAME = "scan_bridge_native_step_fuzz"
CLANG_ENV = "FUZZ_CLANGXX"  # another clang++ than the one on PATH
GXX_ENV = "CXX"  # the kernels' compiler, as scan_kernels/cpu/build.py reads it
# The plan the runner chose, for the harness process it starts: "asan:<library>" or "gcc".
PLAN_ENV = "FUZZ_NATIVE_STEP_BUILD"

SANITIZE = ("-fsanitize=address,undefined", "-fno-sanitize-recover=all")
# UBSan's vptr check (and clang's function check) need UBSan's C++ runtime, which the preloaded
# runtime does not carry.
CLANG_SANITIZE = (*SANITIZE, "-fno-sanitize=vptr,function")
GCC_SANITIZE = (*SANITIZE, "-fno-sanitize=vptr")
CFLAGS = ("-std=c++17", "-O1", "-g", "-fno-omit-frame-pointer", "-fPIC", "-fvisibility=hidden", "-march=native")
# The parser's warnings are shown; the kernel's are its own build's business (scan_kernels/cpu/build.py).
PARSER_FLAGS = (*CLANG_SANITIZE, "-fsanitize=fuzzer-no-link", "-Wall")
KERNEL_FLAGS = (*GCC_SANITIZE, "-w")
# Exit codes of a sanitizer finding, told apart from a Python exception's in the runner.
ASAN_OPTIONS = "detect_leaks=0:abort_on_error=1:symbolize=1:handle_segv=1:detect_stack_use_after_return=0"
UBSAN_OPTIONS = "print_stacktrace=1:halt_on_error=1"


class BuildUnavailable(RuntimeError):
    """The sanitized build cannot be made or run here (no clang++, no runtime): the reason."""


@dataclass
class Plan:
    """How the native step harness runs: `sanitized` with `library` and `env` for its process,
    or the gcc build, `reason` saying why."""

    sanitized: bool
    reason: str
    library: Path | None = None
    env: dict = field(default_factory=dict)


def clangxx() -> str | None:
    return shutil.which(os.environ.get(CLANG_ENV, "clang++"))


def gxx() -> str | None:
    return shutil.which(os.environ.get(GXX_ENV, "g++"))


def _atheris_runtime() -> Path | None:
    try:
        import atheris
    except ImportError:
        return None
    path = Path(atheris.path()) / "asan_with_fuzzer.so"
    return path if path.is_file() else None


def _compiler_library(compiler: str, name: str) -> str | None:
    found = subprocess.run([compiler, f"-print-file-name={name}"], capture_output=True, text=True).stdout.strip()
    # Without the library the compiler prints the bare name back.
    return found if os.path.isabs(found) and os.path.exists(found) else None


def _includes() -> list[str]:
    import importlib.util

    torch_spec = importlib.util.find_spec("torch")
    if torch_spec is None or not torch_spec.submodule_search_locations:
        raise BuildUnavailable("no torch installation, whose include/ carries the pybind11 headers step.cpp uses")
    torch_include = Path(list(torch_spec.submodule_search_locations)[0]) / "include"
    if not (torch_include / "pybind11" / "pybind11.h").is_file():
        raise BuildUnavailable(f"no pybind11 headers under {torch_include}")
    return [f"-I{torch_include}", f"-I{sysconfig.get_paths()['include']}", f"-I{KERNEL_DIR}"]


def _sources() -> list[Path]:
    headers = sorted(KERNEL_DIR.glob("*.h"))
    return [STEP_SOURCE, *(KERNEL_DIR / name for name in KERNEL_SOURCES), SHIM_SOURCE, MUTATOR_SHIM_SOURCE, *headers]


def _digest(compilers: tuple[str, ...]) -> str:
    h = hashlib.sha256()
    for path in _sources():
        h.update(path.name.encode())
        h.update(path.read_bytes())
    versions = [subprocess.run([c, "--version"], capture_output=True, text=True).stdout for c in compilers]
    for part in (CFLAGS, PARSER_FLAGS, KERNEL_FLAGS, versions, sys.version, MODULE_NAME):
        h.update(repr(part).encode())
    return h.hexdigest()[:16]


def build(verbose: bool = False) -> Path:
    """The sanitized library, compiled first unless this digest's is there already; raises
    BuildUnavailable with the reason."""
    compiler, kernel_compiler = clangxx(), gxx()
    if compiler is None:
        raise BuildUnavailable(f"no {os.environ.get(CLANG_ENV, 'clang++')} on PATH (Debian: clang and "
                               "libclang-rt-14-dev, which .ci/system-deps.sh installs)")
    if kernel_compiler is None:
        raise BuildUnavailable(f"no {os.environ.get(GXX_ENV, 'g++')} on PATH for the CPU kernel")
    directory = BUILD_DIR / _digest((compiler, kernel_compiler))
    library = directory / (MODULE_NAME + sysconfig.get_config_var("EXT_SUFFIX"))
    if library.is_file():
        return library
    directory.mkdir(parents=True, exist_ok=True)
    # Processes building this digest at once (test workers, fuzz jobs) take turns: the first
    # compiles, the others find its library.
    with open(directory / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not library.is_file():
            _compile(directory, library, compiler, kernel_compiler, verbose)
    return library


def _compile(directory: Path, library: Path, compiler: str, kernel_compiler: str, verbose: bool) -> None:
    includes = _includes()
    define = f"-DTORCH_EXTENSION_NAME={MODULE_NAME}"
    # The parser gets libFuzzer's coverage instrumentation; the kernel and the shim only the
    # sanitizers (their edges say nothing about the input's structure).
    compiles = [
        [compiler, *CFLAGS, *PARSER_FLAGS, define, *includes, "-c", str(STEP_SOURCE), "-o", str(directory / "step.o")],
        *([kernel_compiler, *CFLAGS, *KERNEL_FLAGS, f"-I{KERNEL_DIR}", "-c", str(KERNEL_DIR / name),
           "-o", str(directory / Path(name).with_suffix(".o"))] for name in KERNEL_SOURCES),
        [kernel_compiler, *CFLAGS, *KERNEL_FLAGS, f"-I{KERNEL_DIR}", "-c", str(SHIM_SOURCE),
         "-o", str(directory / "shim.o")],
        [compiler, "-x", "c", "-O2", "-fPIC", "-shared", str(MUTATOR_SHIM_SOURCE),
         "-o", str(directory / MUTATOR_SHIM_NAME)],
    ]
    partial = directory / (library.name + ".partial")
    link = [compiler, "-shared", *CLANG_SANITIZE, "-fsanitize=fuzzer-no-link", str(directory / "step.o"),
            *(str(directory / Path(name).with_suffix(".o")) for name in KERNEL_SOURCES),
            str(directory / "shim.o"), "-o", str(partial)]
    # The compiles at once (they are independent), then the link.
    for commands in (compiles, [link]):
        if verbose:
            for command in commands:
                print(" ".join(command), flush=True)
        running = [(command, subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
                   for command in commands]
        for command, process, (stdout, stderr) in [(c, p, p.communicate()) for c, p in running]:
            if process.returncode != 0:
                (directory / "build.log").write_text(" ".join(command) + "\n" + stdout + stderr)
                first = next((ln for ln in stderr.splitlines() if "error" in ln), stderr.strip()[-300:])
                raise BuildUnavailable(f"clang build of the native step parser failed: {first[:300]} "
                                       f"(full log: {directory / 'build.log'})")
    os.replace(partial, library)


def plan(verbose: bool = False) -> Plan:
    """The sanitized build and the environment its process needs, or why the gcc build is used."""
    runtime = _atheris_runtime()
    if runtime is None:
        return Plan(False, "atheris's asan_with_fuzzer.so is missing (pip install atheris)")
    try:
        library = build(verbose)
    except BuildUnavailable as exc:
        return Plan(False, str(exc))
    libstdcxx = _compiler_library(clangxx(), "libstdc++.so")
    if libstdcxx is None:
        return Plan(False, "clang++ has no libstdc++.so to preload beside the ASan runtime")
    # The custom mutator's shim before the runtime, which looks for it as it loads; libstdc++
    # after: Python does not link it, and the runtime wraps its exception functions when it
    # starts (tests/test_sanitizers.py preloads gcc's runtime the same way).
    # PYTHONMALLOC=malloc: every Python object its own malloc block, so that ASan's redzones
    # bound the reply bytes the parser's module writes and the buffers handed to it.
    env = {"LD_PRELOAD": f"{library.parent / MUTATOR_SHIM_NAME} {runtime} {libstdcxx}", "PYTHONMALLOC": "malloc", "ASAN_OPTIONS": ASAN_OPTIONS,
           "UBSAN_OPTIONS": UBSAN_OPTIONS, PLAN_ENV: f"asan:{library}"}
    return Plan(True, f"clang {library.parent.name}: ASan + UBSan + libFuzzer coverage", library, env)
