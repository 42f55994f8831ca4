"""`python -m fuzz <harness[,harness...]|all> [--runs N | --seconds S] [--jobs N] [--corpus DIR] [--json PATH]`
`python -m fuzz <harness> --replay FILE...`

Runs the harnesses one after another (one process, so one core, at a time; `--jobs N`: N at
once) and prints, for each, its executions, how long it ran and its findings; exits 1 when there
was a finding, 2 when a harness could not run here (it says why).
See docs/fuzzing.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from . import HARNESSES
from .runner import ROOT, replay, run_harness


def _say(line: str) -> None:
    print(line, flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fuzz", description=__doc__.splitlines()[0])
    parser.add_argument("harness", help=f"one of {', '.join(HARNESSES)}; several joined by commas, started in that "
                                        "order; or all")
    bound = parser.add_mutually_exclusive_group()
    bound.add_argument("--runs", type=int, help="executions per harness")
    bound.add_argument("--seconds", type=int, help="seconds of fuzzing per harness")
    parser.add_argument("--corpus", help="where new inputs go (DIR/<harness> with several); default: a scratch dir")
    parser.add_argument("--seed", type=int, help="libFuzzer's random seed (default: from the clock)")
    parser.add_argument("--minimize", action="store_true",
                        help="afterwards, rewrite fuzz/corpus/<harness>/ as the smallest set of inputs that keeps "
                             "the coverage of the committed corpus and this run's")
    parser.add_argument("--json", help="write the results (machine, commit, per harness) to this file")
    parser.add_argument("--verbose", action="store_true", help="print libFuzzer's output")
    parser.add_argument("--jobs", type=int, default=1,
                        help="harnesses fuzzed at once, each a process of its own on a core (default 1)")
    parser.add_argument("--replay", nargs="+", metavar="FILE",
                        help="run the harness once on each input (a finding's, say) and print what happens")
    args = parser.parse_args(argv)
    names = list(HARNESSES) if args.harness == "all" else args.harness.split(",")
    for name in names:
        if name not in HARNESSES:
            parser.error(f"harness: expected {', '.join(HARNESSES)} or all, got {name!r}")
    if len(set(names)) != len(names):
        parser.error(f"harness: expected each harness once, got {args.harness!r}")
    if args.replay:
        if len(names) != 1:
            parser.error("--replay takes one harness")
        return replay(names[0], args.replay, say=_say)
    if args.runs is None and args.seconds is None:
        parser.error("give --runs or --seconds (an unbounded run ends only at a finding)")
    if args.jobs < 1:
        parser.error(f"--jobs: expected a count of 1 or more, got {args.jobs}")

    def fuzz(name: str) -> dict:
        corpus = None
        if args.corpus:
            corpus = os.path.join(args.corpus, name) if len(names) > 1 else args.corpus
        result = run_harness(name, runs=args.runs, seconds=args.seconds, corpus=corpus, seed=args.seed,
                             minimize=args.minimize, verbose=args.verbose, say=_say)
        _say(f"{name}: {result['executions']} executions in {result['seconds']} s ({result['exec_per_s']}/s), "
             f"{len(result['findings'])} findings")
        for finding in result["findings"]:
            _say(f"  {finding['kind']}: {finding.get('input')} {'; '.join(finding['signatures'])}")
        for key, count in result["stats"].items():
            if key.startswith("known "):
                _say(f"  {count}+ inputs hit {key.removeprefix('known ')} (fuzz.known, not fixed yet)")
        return result

    started = time.monotonic()
    # Each harness is a child process: threads here only wait on them.
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        results = list(pool.map(fuzz, names))
    wall_seconds = round(time.monotonic() - started, 1)
    total = sum(r["executions"] for r in results)
    findings = sum(len(r["findings"]) for r in results)
    _say(f"all: {total} executions, {findings} findings")
    if args.json:
        from bridge.bench.machine import write_results

        write_results(args.json, "fuzz", {"results": summary(results, jobs=args.jobs, wall_seconds=wall_seconds)})
    if findings:
        return 1
    # A harness that could not run is not a clean run.
    return 2 if any(r.get("unavailable") for r in results) else 0


def summary(results: list[dict], jobs: int, wall_seconds: float) -> dict:
    """The results document's body: per harness, what ran against what, and the totals."""
    harnesses = {}
    for r in results:
        info = r["info"]
        harnesses[r["harness"]] = {
            "executions": r["executions"], "seconds": r["seconds"], "exec_per_s": r["exec_per_s"],
            "findings": r["findings"], "new_units": r["new_units"], "peak_rss_mb": r["peak_rss_mb"],
            # Inputs that hit a bug of fuzz.known (not fixed yet), counted rather than stopping the
            # run; as of the harness's last FUZZ-STATS line (printed every 1024 executions).
            "known_findings": {k.removeprefix("known "): v for k, v in r["stats"].items() if k.startswith("known ")},
            "libfuzzer": True, "asan": bool(info.get("asan")), "ubsan": bool(info.get("ubsan")),
            "cpp_coverage": bool(info.get("cpp_coverage")), "mutator": info.get("mutator"),
            "target": info.get("target"), "build": info.get("build"), "stats": r["stats"],
            **({"fallback_reason": r["fallback_reason"]} if "fallback_reason" in r else {}),
            **({"unavailable": r["unavailable"]} if r.get("unavailable") else {}),
        }
    return {"command": "python -m fuzz " + " ".join(sys.argv[1:]), "nice": os.nice(0),
            "cwd": str(ROOT), "harnesses": harnesses,
            "total_executions": sum(r["executions"] for r in results),
            "total_findings": sum(len(r["findings"]) for r in results),
            "seconds": round(sum(r["seconds"] for r in results), 1), "jobs": jobs, "wall_seconds": wall_seconds}


if __name__ == "__main__":
    sys.exit(main())
