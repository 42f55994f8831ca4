"""Two builds of the CPU backend's C++ kernels timed against each other in one process: the
scan_kernels/cpu sources of a git revision (the base) against those of the working tree, or of
another revision, on bench.kernels' cases and inputs.

    python -m bench.kernel_ab [--base REV] [--other REV] [--cases step-32x512x16,exphil]
                              [--threads 1] [--seconds 20] [--json FILE]

A case is one of bench.kernels' (a forward call) or "backward-" and one of bench.backward's
(the backward pass on that bench's inputs, e.g. backward-exphil). Both builds are called through
the working tree's scan_kernels/cpu/__init__.py, so two revisions whose bindings take other arguments
cannot be compared here. The other side, when its sources are the checkout's (the default: the
working tree), is the checkout's own build, the one `make kernels` made: only the base compiles.

Why one process: on a shared machine one process's speed for the same build drifts by more
than a kernel change is worth (docs/performance.md, "CPU kernels": the runs' spread), so an A/B
of separate processes needs many of them and still blurs small differences. Here each build is
loaded under a module name of its own (scan_kernels.cpu.build.load_sources), and short blocks of
calls alternate between the two, the order swapped every round, so both builds meet the same
machine state. Reported per (case, threads): the median and p20 of the blocks' mean call time
for each build, their ratio base / other (above 1: the other build is faster), and the
median over rounds of the ratio of the two blocks timed side by side.

How far two builds of the same sources differ here, the noise below which a difference is not
the code's, is recorded once (docs/performance.md, "kernel ab identical"). One thread by
default: a change to the kernels' code shows there undiluted. With more threads each build has
its own helper pool: before each block the harness sleeps past the pool's spin (1 ms), so that
the build not being timed has its helper asleep rather than spinning on the second core, then
warms the timed build up for 2 ms (a core that idled runs its first calls slowly); where the
scheduler puts the woken helper still varies from block to block, so there the p20 and the
paired ratio are the steadier figures.

Before timing, both builds run the same inputs once: the largest relative difference of their
outputs (y; the state for the state update; every gradient for a backward case) is reported,
element by element and against each output's largest magnitude, so an A/B of builds that compute
different things shows it (the first is set by entries that cancel to near zero).
"""

from __future__ import annotations

import argparse
import math
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from bridge.bench.machine import output_path, write_results
from scan_kernels.cpu import backend_from, build

from . import backward
from .kernels import CASES_BY_NAME, backend_call, make_inputs

REPO = Path(__file__).resolve().parents[1]
# Where the sources sit in a revision's tree: the first of these it has (the package was renamed).
SOURCE_PATHS = ("scan_kernels/cpu", "kernels/cpu")
WORKING_TREE = "working tree"
HELPER_SPIN_SECONDS = 0.001  # helper_pool.h's kSpin (a test keeps the two equal)
BLOCK_SECONDS = 0.001  # calls per block: about this long
WARM_SECONDS = 0.002


class RevisionError(Exception):
    """A revision whose kernel sources cannot be read."""


BACKWARD_PREFIX = "backward-"


@dataclass(frozen=True)
class BackwardCase:
    """bench.backward's case, its backward pass timed."""
    case: backward.Case

    @property
    def name(self) -> str:
        return BACKWARD_PREFIX + self.case.name


def case_named(name: str):
    """bench.kernels' case of that name, or a BackwardCase for "backward-<bench.backward case>";
    KeyError for any other name."""
    if name.startswith(BACKWARD_PREFIX) and name.removeprefix(BACKWARD_PREFIX) in backward.CASES:
        return BackwardCase(backward.CASES[name.removeprefix(BACKWARD_PREFIX)])
    return CASES_BY_NAME[name]


def known_cases() -> list[str]:
    return [*CASES_BY_NAME, *(BACKWARD_PREFIX + name for name in backward.CASES)]


def calls_on_one_input(case, backends, seed: int = 0) -> list:
    """Each backend's call of `case`, all on one set of inputs."""
    if isinstance(case, BackwardCase):
        args = backward.inputs_of(case.case, seed)
        dy = torch.randn(args["x"].shape, generator=torch.Generator().manual_seed(seed + 1))
        return [backward.backward_call(case.case, b, args, dy)[1] for b in backends]
    inputs = make_inputs(case, "bld", torch.device("cpu"), seed=seed)
    return [backend_call(case, b, inputs) for b in backends]


def sources_at(revision: str, destination: Path) -> str:
    """Writes the kernel sources (build.SOURCES and HEADERS, those the revision has) of
    `revision`, or of the working tree for WORKING_TREE, into `destination`; returns the
    revision's commit hash (or WORKING_TREE)."""
    destination.mkdir(parents=True, exist_ok=True)
    names = build.SOURCES + build.HEADERS
    if revision == WORKING_TREE:
        for name in names:
            (destination / name).write_bytes((build.SOURCE_DIR / name).read_bytes())
        return WORKING_TREE
    commit = _git("rev-parse", "--verify", f"{revision}^{{commit}}", revision=revision).decode().strip()
    # A revision older than a source file builds without it (its binding does not use it).
    tree = _git("ls-tree", "--name-only", commit, revision=revision).decode().split()
    source_path = next((p for p in SOURCE_PATHS if p.split("/")[0] in tree), SOURCE_PATHS[0])
    present = set(_git("ls-tree", "--name-only", f"{commit}:{source_path}", revision=revision).decode().split())
    for name in names:
        if name in present:
            (destination / name).write_bytes(_git("show", f"{commit}:{source_path}/{name}", revision=revision))
    return commit


def _git(*args, revision: str) -> bytes:
    done = subprocess.run(["git", *args], cwd=REPO, capture_output=True)
    if done.returncode != 0:
        reason = done.stderr.decode(errors="replace").strip() or f"git {args[0]} exited {done.returncode}"
        raise RevisionError(f"revision {revision!r}: {reason}")
    return done.stdout


def module_prefix(side: str) -> str:
    return f"{build.MODULE_NAME}_ab_{side}"


def load_build(source_dir: Path, revision: str, commit: str, side: str):
    """The Backend over the sources in `source_dir` (`revision`'s), its module named for `side`
    (and, by load_sources, for its sources), so that both sides load side by side even when
    their sources are the same."""
    started = time.perf_counter()
    backend = backend_from(build.load_sources(source_dir, module_prefix(side)))
    print(f"{side}: {revision} ({commit[:12]}) {backend.details['library']} "
          f"ready in {time.perf_counter() - started:.1f} s", flush=True)
    return backend


def are_the_checkouts_sources(source_dir: Path) -> bool:
    """Whether `source_dir` holds the checkout's own kernel sources, byte for byte."""
    return all((source_dir / name).is_file()
               and (source_dir / name).read_bytes() == (build.SOURCE_DIR / name).read_bytes()
               for name in build.SOURCES + build.HEADERS)


def load_builds(base: str, other: str) -> tuple[tuple, tuple]:
    """(backend, commit) of both sides; RevisionError when either cannot be read. The other
    side, when its sources are the checkout's (the working tree, or a revision equal to it), is
    the checkout's own build, the one `make kernels` made, with the same flags as a copy's;
    otherwise it compiles in a process of its own while this one compiles the base: a build is
    mostly one long compile, which leaves a core idle that the other build can use."""
    with tempfile.TemporaryDirectory(prefix="kernel_ab_") as scratch:
        sides = {"base": (base, Path(scratch) / "base"), "other": (other, Path(scratch) / "other")}
        commits = {side: sources_at(revision, directory) for side, (revision, directory) in sides.items()}
        checkouts_own = are_the_checkouts_sources(sides["other"][1])
        # A failure there is reported when this process loads that side (and builds it again).
        beside = None if checkouts_own else subprocess.Popen(
            [sys.executable, "-m", "scan_kernels.cpu.build", "--sources", str(sides["other"][1]),
             "--module-prefix", module_prefix("other")], cwd=REPO)
        try:
            loaded = {"base": load_build(sides["base"][1], base, commits["base"], "base")}
        finally:
            if beside is not None:
                beside.wait()
        if checkouts_own:
            loaded["other"] = backend_from(build.load_extension())
            print(f"other: {other} ({commits['other'][:12]}), the checkout's own build "
                  f"{loaded['other'].details['library']}", flush=True)
        else:
            loaded["other"] = load_build(sides["other"][1], other, commits["other"], "other")
        return tuple((loaded[side], commits[side]) for side in ("base", "other"))


def outputs_of(case, backend) -> list[torch.Tensor]:
    """One call's outputs on fresh inputs, each flattened to float64: y (and the updated state),
    or every gradient of a backward case."""
    if isinstance(case, BackwardCase):
        grads = calls_on_one_input(case, [backend], seed=1)[0]()
        return [grads[k].double().flatten() for k in sorted(grads) if grads[k] is not None]
    inputs = make_inputs(case, "bld", torch.device("cpu"), seed=1)
    y = backend_call(case, backend, inputs)()
    if isinstance(y, tuple):
        y = y[0]
    parts = [y.double().flatten()]
    if case.kind == "step":
        parts.append(inputs["state"].double().flatten())
    return parts


def output_differences(case, backends) -> tuple[float, float]:
    """When both backends run one call on the same fresh inputs, on one thread (at more, the
    backward's dB and dC sum the threads' parts in the order the threads took their items, so
    two runs of one build can differ in the last bits): the largest |a - b| / max(|a|, |b|,
    1e-30) over the outputs' elements (outputs_of), which an entry that cancels to near zero
    sets, and the largest over the outputs of max |a - b| / their largest magnitude."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a_parts, b_parts = (outputs_of(case, backend) for backend in backends)
    finally:
        torch.set_num_threads(threads)
    elementwise = of_largest = 0.0
    for a, b in zip(a_parts, b_parts):
        difference = (a - b).abs()
        elementwise = max(elementwise, float((difference / torch.maximum(a.abs(), b.abs()).clamp_min(1e-30)).max()))
        largest = max(float(a.abs().max()), float(b.abs().max()), 1e-30)
        of_largest = max(of_largest, float(difference.max()) / largest)
    return elementwise, of_largest


def time_pair(case, backends, seconds: float, min_rounds: int = 10) -> list[list[float]]:
    """Per backend, the mean call time (us) of each of its blocks, in alternated rounds."""
    # One set of inputs for both: tensors placed differently (their offsets within pages) can
    # time differently, which would pass for a difference between the builds.
    calls = calls_on_one_input(case, backends)
    for call in calls:
        call()
    started = time.perf_counter()
    calls[0]()
    estimate = max(time.perf_counter() - started, 1e-6)
    block = max(1, round(BLOCK_SECONDS / estimate))
    warm = max(1, round(WARM_SECONDS / estimate))
    blocks = [[] for _ in calls]
    started = time.perf_counter()
    rounds = 0
    while rounds < min_rounds or time.perf_counter() - started < seconds:
        order = range(len(calls)) if rounds % 2 == 0 else reversed(range(len(calls)))
        for i in order:
            if torch.get_num_threads() > 1:
                time.sleep(HELPER_SPIN_SECONDS * 3)
            for _ in range(warm):
                calls[i]()
            t0 = time.perf_counter_ns()
            for _ in range(block):
                calls[i]()
            blocks[i].append((time.perf_counter_ns() - t0) / 1e3 / block)
        rounds += 1
    return blocks


def summary(blocks: list[float]) -> dict:
    ordered = sorted(blocks)
    return {"median_us": statistics.median(ordered), "p20_us": ordered[len(ordered) // 5],
            "blocks": len(ordered)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", default="HEAD", help="git revision of the base build (default HEAD)")
    p.add_argument("--other", default=WORKING_TREE,
                   help="git revision of the other build (default: the working tree's sources)")
    p.add_argument("--cases", default="step-32x512x16",
                   help="comma-separated case names (default step-32x512x16): " + ", ".join(known_cases()))
    p.add_argument("--threads", default="1", help="comma-separated thread counts (default 1)")
    p.add_argument("--seconds", type=float, default=20.0,
                   help="timing per (case, thread count), both builds together (default 20)")
    p.add_argument("--json", type=output_path, help="write results with machine and commit info to this file")
    args = p.parse_args(argv)
    try:
        cases = [case_named(n) for n in args.cases.split(",")]
    except KeyError as exc:
        p.error(f"--cases: unknown case {exc}; known: {', '.join(known_cases())}")
    try:
        threads = [int(t) for t in args.threads.split(",")]
    except ValueError:
        p.error(f"--threads: expected comma-separated integers, got {args.threads!r}")
    if min(threads) < 1:
        p.error(f"--threads: expected counts of 1 or more, got {args.threads!r}")
    if not (args.seconds >= 0 and math.isfinite(args.seconds)):
        p.error(f"--seconds: expected a finite number of 0 or more, got {args.seconds}")

    try:
        (base, base_commit), (other, other_commit) = load_builds(args.base, args.other)
    except RevisionError as exc:
        print(f"bench.kernel_ab: {exc}", file=sys.stderr)
        return 2
    rows = []
    for case in cases:
        difference, of_largest = output_differences(case, (base, other))
        for count in threads:
            torch.set_num_threads(count)
            base_blocks, other_blocks = time_pair(case, (base, other), args.seconds)
            row = {"case": case.name, "threads": count, "base": summary(base_blocks),
                   "other": summary(other_blocks), "max_relative_difference": difference,
                   "max_difference_of_largest": of_largest}
            row["ratio_median"] = row["base"]["median_us"] / row["other"]["median_us"]
            row["ratio_p20"] = row["base"]["p20_us"] / row["other"]["p20_us"]
            row["ratio_paired_median"] = statistics.median(
                b / o for b, o in zip(base_blocks, other_blocks))
            rows.append(row)
            print(f"{case.name}, {count} thread(s): base {row['base']['median_us']:.1f} us "
                  f"(p20 {row['base']['p20_us']:.1f}), other {row['other']['median_us']:.1f} us "
                  f"(p20 {row['other']['p20_us']:.1f}); base/other {row['ratio_median']:.3f} "
                  f"(p20 {row['ratio_p20']:.3f}, paired by round {row['ratio_paired_median']:.3f}) over {row['base']['blocks']} blocks each; "
                  f"outputs differ by {difference:.2g} at most (relative), {of_largest:.2g} of each one's largest",
                  flush=True)
    if args.json:
        write_results(args.json, "kernel-ab", {
            "base": {"revision": args.base, "commit": base_commit, "details": base.details},
            "other": {"revision": args.other, "commit": other_commit, "details": other.details},
            "seconds": args.seconds, "results": rows})
    return 0


if __name__ == "__main__":
    from bridge.bench import exit_on_stop_signals

    exit_on_stop_signals()
    raise SystemExit(main())
