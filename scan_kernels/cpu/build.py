"""Build and load the C++ extension behind the "cpu" backend.

`python -m scan_kernels.cpu.build` compiles it ahead of time (the Makefile's `kernels` target; with
`--all`, every SIMD variant the CPU executes, at once);
`load_extension()` imports the built library, compiling it first only when no library matches.

Each build lives in a directory named by a digest of everything that determines the binary
(sources, flags, compiler, torch and Python versions, the CPU it is tuned for with
-march=native), under the checkout's git-ignored `build/kernels_cpu/` (torch's extension cache
when the package is installed read-only). A process that finds a matching library imports it
directly, in milliseconds, without touching the compiler or ninja; a library built for another
CPU, torch or source revision is never loaded. Concurrent builds of the same digest are
serialised by an flock in that directory (_build_lock), which a build killed midway lets go.

The kernels build in one of several SIMD variants (SIMD_VARIANTS: AVX-512, AVX2, the portable
baseline), each with its own flags and module name: by default the best this CPU executes;
SCAN_BRIDGE_SIMD=avx512|avx2|baseline forces one (for comparison, or to test a variant), and a
variant the CPU cannot execute is refused with BackendUnavailable.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import importlib.util
import logging
import os
import platform
import shutil
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import BackendUnavailable

log = logging.getLogger("scan_kernels")

# Python caches extension modules by name: a differently built library must use another name
# to be loaded beside this one. Each SIMD variant's module is MODULE_NAME + "_" + its name.
MODULE_NAME = "scan_bridge_cpu"
SOURCE_DIR = Path(__file__).resolve().parent
SOURCES = ("scan_kernel.cpp", "ssd_kernel.cpp", "scan_backward.cpp", "ssd_backward.cpp", "linear_kernel.cpp",
           "binding.cpp")
HEADERS = ("scan_kernel.h", "ssd_kernel.h", "scan_backward.h", "linear_kernel.h", "model_step.h", "simd.h",
           "helper_pool.h", "released_gil.h")
# -fvisibility=hidden: only the module's init function is exported, so two builds loaded in
# one process (tests load every SIMD variant side by side) never bind to each other's code.
# -Wno-psabi: GCC notes that vectors wider than the target's are passed differently; only
# internal functions take them, so no ABI is at stake.
CFLAGS = ("-O3", "-pthread", "-fvisibility=hidden", "-Wall", "-Wno-psabi")
LDFLAGS = ("-pthread",)
# SIMD_ENV=name builds and loads that variant instead of the best one the CPU executes.
SIMD_ENV = "SCAN_BRIDGE_SIMD"


@dataclass(frozen=True)
class SimdVariant:
    """One way to build the kernels: `flags` select the instruction set (-march=native: built
    on the machine that runs it, the digest includes the CPU's flags), `cpu_flags` are what
    /proc/cpuinfo must list for this CPU to execute it."""

    name: str
    flags: tuple[str, ...]
    cpu_flags: tuple[str, ...] = ()


def _machine_variants() -> tuple[SimdVariant, ...]:
    """This platform's variants, best first. On x86-64: AVX-512 (64-byte vectors), AVX2 + FMA
    (32-byte vectors, what -march=native keeps without AVX-512) and the baseline (x86-64's SSE2,
    16-byte generic vectors, no intrinsics); elsewhere the baseline alone, for the compiler's
    default target (NEON on aarch64)."""
    if platform.machine().lower() in ("x86_64", "amd64"):
        return (SimdVariant("avx512", ("-march=native",), ("avx512f",)),
                SimdVariant("avx2", ("-march=native", "-mno-avx512f"), ("avx2", "fma")),
                SimdVariant("baseline", ("-march=x86-64", "-mtune=generic")))
    return (SimdVariant("baseline", ()),)


SIMD_VARIANTS = _machine_variants()
# SCAN_BRIDGE_SANITIZE=address,undefined (or either) builds every extension with those
# sanitizers, each finding fatal, under a digest of its own: the test suite's sanitizer pass
# (tests/test_sanitizers.py). Python itself is not instrumented, so a process loads an
# address-sanitized library only when it preloads the runtime (see _check_sanitizer_runtime).
SANITIZE_ENV = "SCAN_BRIDGE_SANITIZE"
SANITIZERS = ("address", "undefined")
_LOCK_FILE = "lock"  # torch.utils.cpp_extension's FileBaton, present while a build runs
_BUILD_FLOCK = "build.flock"  # flocked by the process building there (_build_lock)


def _requested_sanitizers() -> tuple[str, ...]:
    """The sanitizers SANITIZE_ENV names; BackendUnavailable for a name not in SANITIZERS."""
    names = tuple(n.strip() for n in os.environ.get(SANITIZE_ENV, "").split(",") if n.strip())
    unknown = [n for n in names if n not in SANITIZERS]
    if unknown:
        raise BackendUnavailable(f"{SANITIZE_ENV}: expected a comma-separated list of {', '.join(SANITIZERS)}, "
                                 f"got {os.environ[SANITIZE_ENV]!r}")
    return names


def _cpu_flags() -> set[str] | None:
    """The instruction-set flags /proc/cpuinfo lists for the first CPU; None where it cannot
    be read (then only the baseline is known to execute)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return None


def unsupported_reason(variant: SimdVariant) -> str | None:
    """Why this CPU cannot execute `variant` (the flags it lacks); None when it can."""
    if not variant.cpu_flags:
        return None
    flags = _cpu_flags()
    if flags is None:
        return f"SIMD variant {variant.name}: this CPU's instruction sets are unknown (/proc/cpuinfo unreadable)"
    missing = [f for f in variant.cpu_flags if f not in flags]
    if missing:
        return f"SIMD variant {variant.name}: this CPU cannot execute it (it lacks {', '.join(missing)})"
    return None


def executable_variants() -> tuple[SimdVariant, ...]:
    """The variants this CPU executes, best first (the baseline always)."""
    return tuple(v for v in SIMD_VARIANTS if unsupported_reason(v) is None)


def variant_named(name: str) -> SimdVariant:
    """The variant called `name`; BackendUnavailable when this platform has none by that name."""
    for variant in SIMD_VARIANTS:
        if variant.name == name:
            return variant
    raise BackendUnavailable(f"SIMD variant {name!r}: expected one of {', '.join(v.name for v in SIMD_VARIANTS)}")


def selected_variant() -> SimdVariant:
    """The variant SIMD_ENV names, else the best this CPU executes; BackendUnavailable for a name
    not in SIMD_VARIANTS or a variant the CPU cannot execute."""
    name = os.environ.get(SIMD_ENV, "").strip()
    if not name:
        return executable_variants()[0]
    try:
        variant = variant_named(name)
    except BackendUnavailable as exc:
        raise BackendUnavailable(f"{SIMD_ENV}={name}: {exc}") from None
    reason = unsupported_reason(variant)
    if reason is not None:
        raise BackendUnavailable(f"{SIMD_ENV}={name}: {reason}; it executes "
                                 f"{', '.join(v.name for v in executable_variants())}")
    return variant


def variant_module_name(variant: SimdVariant) -> str:
    return f"{MODULE_NAME}_{variant.name}"


def compile_flags(variant: SimdVariant | None = None) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(compiler flags, linker flags) of this process's builds of `variant` (by default the
    selected one): CFLAGS and the variant's flags, LDFLAGS, plus the requested sanitizers'."""
    cflags = CFLAGS + (variant or selected_variant()).flags
    names = _requested_sanitizers()
    if not names:
        return cflags, LDFLAGS
    sanitize = "-fsanitize=" + ",".join(names)
    # -O0 (over CFLAGS' -O3) and line tables only (-g1): the sanitizer pass is mostly compiling,
    # and the suite's small shapes run no slower for it; unoptimised code also keeps every load
    # and store of the source for the sanitizers to check (docs/performance.md, "make test time").
    return (cflags + (sanitize, "-fno-sanitize-recover=all", "-fno-omit-frame-pointer", "-O0", "-g1"),
            LDFLAGS + (sanitize,))


def _check_sanitizer_runtime() -> None:
    """An address-sanitized library refuses to load (and aborts the process) unless the
    runtime came first: say so instead."""
    if "address" in _requested_sanitizers() and not hasattr(ctypes.CDLL(None), "__asan_init"):
        raise BackendUnavailable(f"{SANITIZE_ENV} asks for the address sanitizer, whose runtime this process "
                                 "has not loaded: start it with LD_PRELOAD=\"$(c++ -print-file-name=libasan.so) "
                                 "$(c++ -print-file-name=libstdc++.so)\" (libstdc++ too, so that the runtime "
                                 "finds the C++ exception functions it wraps when it starts)")


def _cpu_signature() -> str:
    """What -march=native depends on: the CPU model and its instruction-set flags."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags", "Features", "CPU part"))]
        # The first CPU's lines are enough: all cores of a machine share one ISA.
        seen, first = set(), []
        for ln in lines:
            key = ln.split(":", 1)[0].strip()
            if key in seen:
                break
            seen.add(key)
            first.append(ln.strip())
        if first:
            return "\n".join(first)
    except OSError:
        pass
    return f"{platform.machine()} {platform.processor()}"


@dataclass(frozen=True)
class Sources:
    """What one extension is compiled from: `files` (.cpp) and the `headers` they include, in
    `directory` (a header may also be an absolute path), with `directory` and `include_dirs`
    searched for includes. Every file and header goes into the build's digest."""

    directory: Path
    files: tuple[str, ...]
    headers: tuple[str | Path, ...]
    include_dirs: tuple[Path, ...] = ()


def _kernel_sources(directory: Path) -> Sources:
    """The kernels' SOURCES and HEADERS in `directory`."""
    return Sources(directory, SOURCES, HEADERS)


def _hash_sources(h, sources: Sources):
    """Each file's name (not where the checkout lies) and bytes; BackendUnavailable when one is
    missing (a package installed without it)."""
    for name in sources.files + sources.headers:
        path = sources.directory / name
        h.update(path.name.encode())
        try:
            h.update(path.read_bytes())
        except OSError as exc:
            raise BackendUnavailable(f"cannot read the source {path}: {exc}") from exc


def build_digest(sources: Sources | None = None, module_name: str | None = None,
                 variant: SimdVariant | None = None) -> str:
    """Of `sources` built as `module_name` in `variant` (by default this checkout's kernels in the
    selected variant, under that variant's module name)."""
    variant = variant or selected_variant()
    h = hashlib.sha256()
    _hash_sources(h, sources or _kernel_sources(SOURCE_DIR))
    for part in (module_name or variant_module_name(variant), *compile_flags(variant), torch.__version__,
                 sys.version, sys.implementation.cache_tag, os.environ.get("CXX", "c++"), _cpu_signature()):
        h.update(repr(part).encode())
    return h.hexdigest()[:16]


def build_root() -> Path:
    """`<checkout>/build/kernels_cpu`, or torch's extension cache outside a writable checkout."""
    checkout = SOURCE_DIR.parents[1]
    if (checkout / "pyproject.toml").is_file() and os.access(checkout, os.W_OK):
        return checkout / "build" / "kernels_cpu"
    from torch.utils.cpp_extension import get_default_build_root

    return Path(get_default_build_root()) / "scan_bridge_cpu"


def _read_only_checkout_root() -> Path | None:
    """`<checkout>/build/kernels_cpu` where the checkout is not writable: a tree `make setup` built,
    deployed read-only or run as another user, whose libraries serve rather than a build of the
    same in torch's cache (tens of seconds at a server's start)."""
    checkout = SOURCE_DIR.parents[1]
    if (checkout / "pyproject.toml").is_file() and not os.access(checkout, os.W_OK):
        return checkout / "build" / "kernels_cpu"
    return None


def located(relative: Path) -> Path:
    """`build_root()/relative`, or the read-only checkout's built file of that name where only
    it exists (a library of the same digest: the same sources, flags, compiler and CPU)."""
    built = build_root() / relative
    prebuilt_root = _read_only_checkout_root()
    if built.exists() or prebuilt_root is None or not (prebuilt_root / relative).is_file():
        return built
    if (prebuilt_root / relative).with_name(_LOCK_FILE).exists():  # a build killed midway left it
        return built
    return prebuilt_root / relative


def build_directory(variant: SimdVariant | None = None) -> Path:
    return build_root() / build_digest(variant=variant)


def library_path(variant: SimdVariant | None = None) -> Path:
    """The variant's library: where it was built, or where it is built when loaded."""
    variant = variant or selected_variant()
    return located(_library_in(Path(build_digest(variant=variant)), variant_module_name(variant)))


def _library_in(directory: Path, module_name: str) -> Path:
    # The name torch.utils.cpp_extension.load gives the library it links.
    return directory / (module_name + (".pyd" if sys.platform == "win32" else ".so"))


def _import_built(path: Path, module_name: str):
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _first_error_line(text: str) -> str:
    """The compiler's first diagnostic ("file:line:col: error: ..."), else the first line
    that mentions an error, else the last line."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for wanted in (lambda ln: "error:" in ln, lambda ln: "error" in ln.lower()):
        for line in lines:
            if wanted(line):
                return line[:300]
    return lines[-1][:300] if lines else "no compiler output"


def _compile(directory: Path, verbose: bool, sources: Sources, module_name: str, variant: SimdVariant):
    """Build with torch.utils.cpp_extension (ninja) and import the result."""
    try:
        from torch.utils import cpp_extension
    except ImportError as exc:  # torch builds without the extension tooling
        raise BackendUnavailable(f"torch.utils.cpp_extension unavailable: {exc}") from exc
    path_before = os.environ.get("PATH", "")
    # A sanitized build's process has the ASan runtime preloaded for the library it loads, not
    # for its compiler: a compiler under it allocates through ASan's allocator, and is slower
    # for it (docs/performance.md, "make test time").
    preload_before = os.environ.pop("LD_PRELOAD", None) if _requested_sanitizers() else None
    venv_bin = os.path.dirname(sys.executable)
    if shutil.which("ninja") is None and os.path.exists(os.path.join(venv_bin, "ninja")):
        # A venv's pip-installed ninja is only on PATH when the venv is activated.
        os.environ["PATH"] = venv_bin + os.pathsep + path_before
    cflags, ldflags = compile_flags(variant)
    try:
        return cpp_extension.load(
            name=module_name,
            sources=[str(sources.directory / s) for s in sources.files],
            extra_cflags=list(cflags),
            extra_ldflags=list(ldflags),
            extra_include_paths=[str(d) for d in (sources.directory, *sources.include_dirs)],
            build_directory=str(directory),
            verbose=verbose,
        )
    except (RuntimeError, OSError, ImportError) as exc:
        text = str(exc)
        (directory / "build.log").write_text(text, encoding="utf-8")
        raise BackendUnavailable(
            f"C++ build failed: {_first_error_line(text)} (full log: {directory / 'build.log'})") from exc
    finally:
        os.environ["PATH"] = path_before
        if preload_before is not None:
            os.environ["LD_PRELOAD"] = preload_before


def load_extension(*, verbose: bool = False, variant: SimdVariant | None = None):
    """The extension module in `variant` (by default the selected one: SIMD_ENV's, else the
    best this CPU executes); compiled first if no library matches this machine and source.
    Raises BackendUnavailable with one line of reason when it cannot be built or loaded, or the
    CPU cannot execute the variant."""
    variant = variant or selected_variant()
    reason = unsupported_reason(variant)
    if reason is not None:
        raise BackendUnavailable(reason)
    return _load(Path(build_digest(variant=variant)), _kernel_sources(SOURCE_DIR), variant_module_name(variant),
                 verbose, variant)


def load_sources(source_dir: Path, name_prefix: str):
    """The extension built from another copy of the sources (SOURCES and HEADERS in
    `source_dir`, a git revision's for bench.kernel_ab), in a directory of its own digest under
    build_root()/"other". Its module is named `name_prefix` and the sources' digest: Python
    caches extension modules by name, and under a name already taken it hands back the module
    first loaded, so copies of different sources need different names, while the same sources
    loaded again give the same module."""
    # Only the files that copy has: a revision older than one of them builds without it.
    sources = Sources(source_dir, tuple(n for n in SOURCES if (source_dir / n).is_file()),
                      tuple(n for n in HEADERS if (source_dir / n).is_file()))
    if not sources.files:
        raise BackendUnavailable(f"{source_dir}: expected the kernel sources ({', '.join(SOURCES)}), found none")
    h = hashlib.sha256()
    _hash_sources(h, sources)
    return load_module(sources, f"{name_prefix}_{h.hexdigest()[:12]}", "other")


def load_module(sources: Sources, module_name: str, subdirectory: str):
    """Another extension built like the kernels' (same flags, digest and cache; the bridge's
    native step module), in build_root()/`subdirectory`/<digest>; BackendUnavailable with one
    line of reason when it cannot be built or loaded."""
    return _load(_module_directory(sources, module_name, subdirectory), sources, module_name, False)


def module_library_path(sources: Sources, module_name: str, subdirectory: str) -> Path:
    """Where load_module builds (or finds) that extension's library for this process's flags."""
    return located(_library_in(_module_directory(sources, module_name, subdirectory), module_name))


def _module_directory(sources: Sources, module_name: str, subdirectory: str) -> Path:
    """Relative to the build root."""
    return Path(subdirectory) / build_digest(sources, module_name)


def _load(relative: Path, sources: Sources, module_name: str, verbose: bool, variant: SimdVariant | None = None):
    """The library in `relative` (to the build root) imported, compiled first (in `variant`, by
    default the selected one) if it is not there; BackendUnavailable with one line of reason
    when it cannot be built or loaded."""
    _check_sanitizer_runtime()
    library = located(_library_in(relative, module_name))
    directory = library.parent
    if library.is_file() and not (directory / _LOCK_FILE).exists():
        return _import_library(library, module_name)
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        raise BackendUnavailable(f"no C++ compiler ({compiler!r} not found)")
    try:
        with _build_lock(directory) as killed_mid_build:
            if library.is_file() and not killed_mid_build:  # built by the process this one waited for
                return _import_library(library, module_name)
            if killed_mid_build:  # its library may be half written: linked again
                library.unlink(missing_ok=True)
            log.info("kernels: building the C++ extension %s in %s (once per machine)", module_name, directory)
            return _compile(directory, verbose, sources, module_name, variant or selected_variant())
    except OSError as exc:  # a read-only or full cache: the torch backend serves
        raise BackendUnavailable(f"cannot build in {directory}: {exc}") from exc


def _import_library(library: Path, module_name: str):
    try:
        return _import_built(library, module_name)
    except ImportError as exc:
        raise BackendUnavailable(f"cannot load {library}: {exc}") from exc


@contextmanager
def _build_lock(directory: Path):
    """Held while this process builds in `directory`: an flock, which the system lets go when its
    holder dies. torch's own lock file (_LOCK_FILE) is removed only by a build that ends, so one
    killed mid-build (a client's start timeout) left it for every later build to wait on for
    ever; under the flock no build of ours runs, and one found is stale: removed, and whether
    there was one yielded."""
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / _BUILD_FLOCK, "a") as held:
        try:
            fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("kernels: waiting for another process's build in %s", directory)
            fcntl.flock(held, fcntl.LOCK_EX)
        stale = directory / _LOCK_FILE
        killed_mid_build = stale.exists()
        if killed_mid_build:
            _wait_for_orphans(directory)
        stale.unlink(missing_ok=True)
        yield killed_mid_build


# How long at most a build waits for what a killed one left compiling (_wait_for_orphans).
ORPHAN_WAIT_S = 600.0


def _wait_for_orphans(directory: Path) -> None:
    """Wait while processes work in `directory`: ninja and the compilers of a build whose server
    was killed outlive it, and go on writing objects there, which a build of ours beside them
    would write too. Found by their working directory (/proc, Linux; elsewhere nothing is
    waited for)."""
    def working_there() -> list[int]:
        pids = []
        for entry in Path("/proc").glob("[0-9]*"):
            try:
                if int(entry.name) != os.getpid() and os.readlink(entry / "cwd") == str(directory):
                    pids.append(int(entry.name))
            except OSError:  # gone meanwhile, or not ours to look at
                continue
        return pids

    deadline = time.monotonic() + ORPHAN_WAIT_S
    pids = working_there()
    if pids:
        log.info("kernels: waiting for %d processes a killed build left running in %s", len(pids), directory)
    while pids and time.monotonic() < deadline:
        time.sleep(0.2)
        pids = working_there()


def _build_all(verbose: bool) -> int:
    """Every executable variant built concurrently: a build spends much of its time in one long
    compile (binding.cpp's), which leaves a core idle that another build can use
    (docs/performance.md, "make test time")."""
    import subprocess

    command = [sys.executable, "-m", "scan_kernels.cpu.build", *(["--verbose"] if verbose else [])]
    builds = [(variant, subprocess.Popen(command, env={**os.environ, SIMD_ENV: variant.name}))
              for variant in executable_variants()]
    failed = [variant.name for variant, build in builds if build.wait() != 0]
    if failed:
        print(f"scan_kernels.cpu: variants not built: {', '.join(failed)} (see above)", file=sys.stderr)
    return 1 if failed else 0


def main(argv=None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m scan_kernels.cpu.build", description=__doc__.splitlines()[0])
    parser.add_argument("--verbose", action="store_true", help="show the compiler commands")
    parser.add_argument("--print-dir", action="store_true",
                        help="print the directory the library is loaded from (or built in) and exit")
    parser.add_argument("--all", action="store_true",
                        help="build every SIMD variant this CPU executes, each in a process of its own, at once")
    parser.add_argument("--sources", type=Path, metavar="DIR",
                        help="build another copy of the sources instead (load_sources: bench.kernel_ab's revisions)")
    parser.add_argument("--module-prefix", default=MODULE_NAME, help="with --sources: its module's name prefix")
    args = parser.parse_args(argv)
    if args.all:
        return _build_all(args.verbose)
    if args.sources is not None:
        try:
            ext = load_sources(args.sources, args.module_prefix)
        except BackendUnavailable as exc:
            print(f"scan_kernels.cpu: {args.sources} not built: {exc}", file=sys.stderr)
            return 1
        print(f"scan_kernels.cpu: {ext.__file__} ready ({ext.simd()})")
        return 0
    try:
        variant = selected_variant()
    except BackendUnavailable as exc:
        print(f"scan_kernels.cpu: not built: {exc}", file=sys.stderr)
        return 1
    if args.print_dir:
        print(library_path(variant).parent)
        return 0
    start = time.perf_counter()
    if not library_path(variant).is_file():
        print(f"scan_kernels.cpu: compiling the {variant.name} variant into {build_directory(variant)} (about 20 s)",
              flush=True)
    try:
        ext = load_extension(verbose=args.verbose, variant=variant)
    except BackendUnavailable as exc:
        print(f"scan_kernels.cpu: not built: {exc}", file=sys.stderr)
        return 1
    print(f"scan_kernels.cpu: {ext.__file__} ready ({ext.simd()}) in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
