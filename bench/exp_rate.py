"""The exp throughput the CPU allows the C++ kernels, per SIMD variant: decays exp(dt A) a
second, computed by the kernels' own vector math (bench/exp_rate.cpp includes
scan_kernels/cpu/scan_kernel.cpp), on 1 thread and on as many as the kernels use.

A Mamba-1 scan computes one decay per state element, so elements / rate is the time its exps
alone take: the scan's time over it says how close a variant gets to that bound (issue 32).

    python -m bench.exp_rate [--simd all|avx2,...] [--seconds 1] [--scan-json FILE]

--scan-json: a bench.kernels JSON with cpu-<variant> rows (`--simd`); each row then gets its
exp bound and its ratio to it. Results print, and go to --json when given.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from bridge.bench.machine import output_path, positive_count, write_results
from scan_kernels.cpu import build

SOURCE = Path(__file__).with_name("exp_rate.cpp")
KERNEL_DIR = Path(build.__file__).parent


def compile_probe(variant: build.SimdVariant, directory: Path) -> Path:
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        raise SystemExit(f"exp_rate: no C++ compiler {compiler!r} on PATH")
    binary = directory / f"exp_rate_{variant.name}"
    cmd = [compiler, "-std=c++17", *build.CFLAGS, *variant.flags, f"-I{KERNEL_DIR}", str(SOURCE),
           "-o", str(binary), *build.LDFLAGS]
    # Quiet: the kernels' own build shows its warnings; the probe's output is its rates.
    subprocess.run(cmd, check=True, stderr=subprocess.DEVNULL)
    return binary


def measure(binary: Path, threads: int, seconds: float) -> tuple[float, str]:
    out = subprocess.run([str(binary), str(threads), str(seconds)], check=True, capture_output=True,
                         text=True).stdout.split(" ", 1)
    return float(out[0]), out[1].strip()


def _variants(names: str) -> list[build.SimdVariant]:
    """The variants `--simd` names; BackendUnavailable for one not known or not executed here
    (its probe would die of an illegal instruction)."""
    if names == "all":
        return list(build.executable_variants())
    variants = [build.variant_named(n) for n in names.split(",")]
    for variant in variants:
        reason = build.unsupported_reason(variant)
        if reason:
            raise build.BackendUnavailable(reason)
    return variants


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--simd", default="all")
    p.add_argument("--seconds", type=float, default=1.0)
    p.add_argument("--threads", type=positive_count, default=torch.get_num_threads())
    p.add_argument("--scan-json", type=Path)
    p.add_argument("--json", type=output_path)
    args = p.parse_args(argv)
    if not 0 < args.seconds < math.inf:
        p.error(f"--seconds: expected a finite duration above 0, got {args.seconds}")
    try:
        variants = _variants(args.simd)
    except build.BackendUnavailable as exc:
        p.error(f"--simd: {exc}")
    rates = {}
    with tempfile.TemporaryDirectory() as tmp:
        for variant in variants:
            binary = compile_probe(variant, Path(tmp))
            one, description = measure(binary, 1, args.seconds)
            many, _ = measure(binary, args.threads, args.seconds)
            rates[variant.name] = {"description": description, "decays_per_s_1_thread": one,
                                   f"decays_per_s_{args.threads}_threads": many, "threads": args.threads}
            print(f"{variant.name:9s} {one / 1e9:6.2f} G decays/s on 1 thread, {many / 1e9:6.2f} on "
                  f"{args.threads}  ({description})")
    rows = []
    if args.scan_json:
        scans = json.loads(args.scan_json.read_text())
        # State elements each case updates: one decay apiece.
        elements = {c["name"]: c["batch"] * c["seq"] * c["dim"] * c["state"] for c in scans["cases"]}
        for row in scans["results"]:
            name = row["backend"].removeprefix("cpu-")
            if not row["backend"].startswith("cpu-") or name not in rates:
                continue
            bound_us = elements[row["case"]] / rates[name][f"decays_per_s_{args.threads}_threads"] * 1e6
            rows.append({"case": row["case"], "variant": name, "median_us": row["median_us"],
                         "exp_bound_us": bound_us, "over_exp_bound": row["median_us"] / bound_us})
            print(f"{row['case']:24s} {name:9s} {row['median_us']:10.1f} us  exp bound {bound_us:9.1f} us"
                  f"  {row['median_us'] / bound_us:5.2f}x")
    if args.json:
        write_results(str(args.json), "exp_rate", {"variants": rates, "rows": rows,
                                  "scan_json": str(args.scan_json) if args.scan_json else None})
    return 0


if __name__ == "__main__":
    from bridge.bench import exit_on_stop_signals

    exit_on_stop_signals()
    sys.exit(main())
