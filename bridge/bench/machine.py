"""Machine and commit information recorded with every benchmark result."""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import os
import platform
import subprocess

import numpy as np


def _cpu_model() -> str:
    return _first_cpu().get("model name") or platform.processor() or "unknown"


def _first_cpu() -> dict[str, str]:
    """The first CPU's /proc/cpuinfo fields (empty where it cannot be read)."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return fields


# The instruction sets the kernels' SIMD variants need (scan_kernels/cpu/build.py).
SIMD_FLAGS = ("avx2", "fma", "f16c", "avx512f")


def _cpu_identity() -> dict:
    """What tells machines with one model name apart (a VM's "AMD EPYC" is Zen 3 or Zen 5): the
    CPU family and model numbers, the SIMD instruction sets present, and the variant the CPU
    kernels build in here (None where they cannot)."""
    cpu = _first_cpu()
    flags = set(cpu.get("flags", "").split())
    try:
        from scan_kernels.cpu.build import BackendUnavailable, selected_variant
    except ImportError:  # a bench run where the kernels package is not installed
        variant = None
    else:
        try:
            variant = selected_variant().name
        except BackendUnavailable:  # the environment names a variant this CPU cannot run
            variant = None
    return {"cpu_family": cpu.get("cpu family"), "cpu_model_number": cpu.get("model"),
            "cpu_simd_flags": [f for f in SIMD_FLAGS if f in flags], "cpu_kernels_simd": variant}


def cpu_times(path: str = "/proc/stat") -> tuple[int, int] | None:
    """(all, stolen): the machine's CPU time since boot and the part of it the hypervisor gave to
    others (steal), in clock ticks, from /proc/stat's first line; None where it cannot be read."""
    try:
        with open(path) as f:
            fields = f.readline().split()
    except OSError:
        return None
    if len(fields) < 9 or fields[0] != "cpu":
        return None
    # user nice system idle iowait irq softirq steal (guest time is already within user and nice)
    ticks = [int(v) for v in fields[1:9]]
    return sum(ticks), ticks[7]


def stolen_fraction(start: tuple[int, int] | None, end: tuple[int, int] | None) -> float | None:
    """The share of the CPU time between two cpu_times readings that was stolen."""
    if start is None or end is None or end[0] <= start[0]:
        return None
    return (end[1] - start[1]) / (end[0] - start[0])


# Read when a benchmark imports this module, so that its results say how much of the machine the
# hypervisor took while it ran: on a shared VM the same code's timings move with that.
_TIMES_AT_IMPORT = cpu_times()


def machine_info() -> dict:
    import torch

    info = {
        "cpu_model": _cpu_model(),
        **_cpu_identity(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "cpu_time_stolen": stolen_fraction(_TIMES_AT_IMPORT, cpu_times()),
    }
    # The installed version, without importing triton (slow, and irrelevant on CPU runs).
    try:
        info["triton"] = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        info["triton"] = None
    return info


# Names the commit of a tree shipped without (current) git history (see commit_info).
COMMIT_VARIABLE = "SCAN_BRIDGE_COMMIT"


# The most changed paths commit_info names; the digest of the diff covers them all.
DIRTY_PATHS_KEPT = 100


def commit_info(root: str | None = None) -> dict:
    """The commit of the checkout at `root` (by default this one), whether its files differ
    from it (tracked files changed, or files git does not ignore added), which (`dirty_paths`,
    as `git status --porcelain` names them) and a SHA-256 of `git diff HEAD` (`diff_sha256`,
    tracked changes only; None when clean), so that a recording from an edited tree says what
    was edited; and its branch (empty strings, `dirty` None, where `root` is not a checkout's
    root, as for an installed package)."""
    this_checkout = root is None
    root = root or os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

    def git(*args, strip=True):
        try:
            out = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=10).stdout
        except (OSError, subprocess.TimeoutExpired):
            return ""
        return out.strip() if strip else out

    if this_checkout and os.environ.get(COMMIT_VARIABLE):
        # A copy of the tree shipped elsewhere (to a GPU machine, say), whose git metadata may be
        # missing or stale: the commit is named by whoever shipped it, and whether the copy
        # matched it is not known here.
        return {"commit": os.environ[COMMIT_VARIABLE], "dirty": None, "branch": None, "named_by": COMMIT_VARIABLE}
    top = git("rev-parse", "--show-toplevel")
    if not top or os.path.realpath(top) != os.path.realpath(root):
        # Not a checkout's root: an installed package, whose site-packages may lie inside some
        # other project's repository (a venv in it), whose commit and edits are not this code's.
        return {"commit": "", "dirty": None, "dirty_paths": [], "diff_sha256": None, "branch": ""}
    # "XY PATH" a line: the status letters' leading space is part of the format
    changed = [line[3:] for line in git("status", "--porcelain", strip=False).splitlines() if line]
    diff = git("diff", "HEAD", strip=False) if changed else ""
    return {"commit": git("rev-parse", "HEAD"), "dirty": bool(changed),
            "dirty_paths": changed[:DIRTY_PATHS_KEPT],
            "diff_sha256": hashlib.sha256(diff.encode()).hexdigest() if changed else None,
            "branch": git("rev-parse", "--abbrev-ref", "HEAD")}


def output_path(path: str) -> str:
    """argparse type of a results file (--json, --plot): a path the run could not write is
    refused before the run, not after it. Its directory is created; the file is not touched
    (opening a tracked results file would truncate it, and mark the tree dirty in commit_info)."""
    target = os.path.abspath(path)
    if os.path.isdir(target):
        raise argparse.ArgumentTypeError(f"expected a file to write, got the directory {path!r}")
    directory = os.path.dirname(target)
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"cannot create the directory of {path!r}: {exc.strerror}") from None
    if not os.access(directory, os.W_OK) or (os.path.exists(target) and not os.access(target, os.W_OK)):
        raise argparse.ArgumentTypeError(f"cannot write {path!r}: permission denied")
    return path


def positive_count(text: str) -> int:
    """argparse type of a count of rounds, calls or records: at least 1, as a run of none has no
    median to report (it raised once the run was over)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number of at least 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected at least 1, got {value}")
    return value


def comma_separated(parse, expected: str):
    """An argparse type: comma-separated values, each `parse`d (ValueError: not one), so that a
    bad one is refused before the run, not found minutes into it."""
    def parse_all(text: str) -> list:
        try:
            return [parse(item) for item in text.split(",")]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated {expected}, got {text!r}") from None
    return parse_all


def at_least(least: int):
    """comma_separated's `parse` of a whole number of at least `least`."""
    def parse(item: str) -> int:
        if not item.strip().isdigit() or int(item) < least:
            raise ValueError(item)
        return int(item)
    return parse


def write_results(path: str, benchmark: str, fields: dict) -> None:
    """The results document for `path`: the benchmark's name, machine_info, commit_info, then
    `fields`. The document is built before the file is opened: opening it first truncates a
    tracked results file, and commit_info would always call the tree dirty."""
    document = {"benchmark": benchmark, "machine": machine_info(), "commit": commit_info(), **fields}
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(document, f, indent=2)
    print(f"wrote {path}")


def summarize_us(values, points=(50, 90, 99)) -> dict:
    """Percentiles (numpy's linear interpolation), min, max and count of timings in µs."""
    a = np.asarray(values, dtype=np.float64)
    return {**{f"p{p}_us": float(v) for p, v in zip(points, np.percentile(a, points))},
            "min_us": float(a.min()), "max_us": float(a.max()), "n": len(values)}
