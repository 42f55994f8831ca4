"""The Triton SSD scan's tile table, timed: each candidate (how fp32 operands multiply, the
blocks, the warps, the chunk) on the issue's Mamba-2 cases, beside torch's chunked form, in one
run, with each candidate's error against a float64 run of the same inputs.

    python -m bench.ssd_tune [--runs ssd-130m:float32,ssd-130m:bfloat16,ssd-exphil:float32]
                             [--seconds 0.3] [--json FILE]

Per (case, dtype, candidate): the call's time as `bench.kernels` takes it (do_bench: host work
and launches included, which bounds small calls on a GPU), the device's own time (the call
captured as a CUDA graph and replayed, so host work drops out), the host's part of the call (unsynchronised), the largest |y - y64| and
|state - state64| over the largest |y64| and |state64|, and a per-kernel split of the device
time (torch.profiler; torch's form, which reads values on the host and cannot be captured, has
only that split and its sum). The candidates are set through `configs` (SSD_FP32_DOT and the SSD_BLOCKS
row of the dots' dtype) for the run and put back after it. `--device cpu` runs the same plumbing
on small sizes under TRITON_INTERPRET=1 (wall time, no graphs): a check of the script, not a
measurement.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from collections import defaultdict

import torch

import scan_kernels
from bridge.bench.machine import output_path, write_results
from scan_kernels.triton_kernels import configs

from .kernels import CASES_BY_NAME, Budget, KernelCase, make_inputs, measure

Blocks = configs.SsdBlocks


@dataclasses.dataclass(frozen=True)
class Candidate:
    name: str
    fp32_dot: str  # configs.SSD_FP32_DOT
    blocks: Blocks | None  # None: the table's row for the dtype
    chunk: int | None = None  # None: configs.SSD_CHUNK


# fp32 rows: the table's (tf32x3 at 32 x 32 tiles, chunk 128), the IEEE dots it replaced, and
# neighbours in tiles and chunk; one plain tf32 row shows what the split costs (its error is
# tf32's, not a candidate for fp32 work).
FP32_CANDIDATES = [
    Candidate("table", "tf32x3", None),
    Candidate("ieee-32", "ieee", Blocks(32, 32, 32, 32, 4)),
    Candidate("ieee-32-c256", "ieee", Blocks(32, 32, 32, 32, 4), chunk=256),
    Candidate("tf32x3-32-c256", "tf32x3", Blocks(32, 32, 32, 32, 4), chunk=256),
    Candidate("tf32x3-32-c64", "tf32x3", Blocks(32, 32, 32, 32, 4), chunk=64),
    Candidate("tf32x3-64-k32-w4", "tf32x3", Blocks(64, 32, 64, 64, 4)),
    Candidate("tf32x3-64-k64-w4", "tf32x3", Blocks(64, 64, 64, 64, 4)),
    Candidate("tf32x3-32-k64-w4", "tf32x3", Blocks(32, 64, 32, 32, 4)),
    Candidate("tf32-32", "tf32", Blocks(32, 32, 32, 32, 4)),
]
HALF_CANDIDATES = [
    Candidate("table", "tf32x3", None),
    Candidate("16b-c256", "tf32x3", None, chunk=256),
    Candidate("16b-c64", "tf32x3", None, chunk=64),
    Candidate("16b-128-k32-w8", "tf32x3", Blocks(128, 32, 64, 64, 8)),
]
# Small enough for the interpreter: the script's own check on a CPU.
SMOKE_CASE = KernelCase("ssd-smoke", "ssd-scan", batch=2, dim=2 * 16, state=16, seq=40, heads=2)


def scan_inputs(case: KernelCase, dtype: torch.dtype, device: torch.device) -> dict:
    inputs = make_inputs(case, "bld", device)
    for name in ("x", "B", "C", "z"):
        if name in inputs:
            inputs[name] = inputs[name].to(dtype)
    inputs["return_state"] = True
    return inputs


def call_of(inputs: dict, backend: str, chunk: int | None):
    kw = dict(inputs, chunk_size=chunk, backend=backend)
    return lambda: scan_kernels.ssd_scan(**kw)


def relative_errors(got, want) -> dict:
    def rel(a, b):
        scale = b.abs().max().item() or 1.0
        return (a.double() - b).abs().max().item() / scale
    return {"y_rel_err": rel(got[0], want[0]), "state_rel_err": rel(got[1], want[1])}


def time_call(fn, device: torch.device, seconds: float) -> float:
    """Median µs of a call, as bench.kernels times one (do_bench on a GPU, wall time on the CPU)."""
    return measure(fn, device, Budget(seconds, min_reps=1, max_reps=100_000))["median_us"]


def host_time(fn, calls: int = 50) -> float:
    """Median µs of the host's part of a call: each call timed to its return, unsynchronised (its
    launches queued), the device drained every few calls so the queue never fills."""
    times = []
    for i in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
        if i % 5 == 4:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    return sorted(times)[len(times) // 2]


def graph_time(fn, device: torch.device, seconds: float) -> float | None:
    """Median µs of a replay of `fn` captured as a CUDA graph: the device's time, host work gone."""
    try:
        graph, _ = scan_kernels.capture_graph(fn, device)
    except Exception as exc:  # a form that syncs with the host cannot be captured: say so
        print(f"  capture failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return None
    return measure(graph.replay, device, Budget(seconds, min_reps=1, max_reps=100_000))["median_us"]


def kernel_split(fn, reps: int = 20) -> dict:
    """µs a call per kernel name, from torch.profiler's CUDA activity over `reps` calls."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    totals = defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[event.name] += event.device_time / reps
    return dict(sorted(totals.items(), key=lambda kv: -kv[1]))


def with_candidate(candidate: Candidate, dot: torch.dtype, body):
    saved = (configs.SSD_FP32_DOT, configs.SSD_BLOCKS[dot])
    configs.SSD_FP32_DOT = candidate.fp32_dot
    if candidate.blocks is not None:
        configs.SSD_BLOCKS[dot] = candidate.blocks
    try:
        return body()
    finally:
        configs.SSD_FP32_DOT, configs.SSD_BLOCKS[dot] = saved


def run_case(case: KernelCase, dtype: torch.dtype, device: torch.device, seconds: float) -> list[dict]:
    inputs = scan_inputs(case, dtype, device)
    wide = {k: v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in inputs.items()}
    want = scan_kernels.ssd_scan(**wide, backend="torch")
    rows = []
    on_gpu = device.type == "cuda"
    torch_fn = call_of(inputs, "torch", None)
    # torch's chunked form reads values on the host (no capture): its device time is its kernels' sum.
    rows.append({"candidate": "torch-chunked", "call_us": time_call(torch_fn, device, seconds),
                 **relative_errors(torch_fn(), want)})
    if on_gpu:
        rows[-1]["host_us"] = host_time(torch_fn)
        rows[-1]["kernels_us"] = kernel_split(torch_fn)
        rows[-1]["kernel_sum_us"] = sum(rows[-1]["kernels_us"].values())
    print(f"{case.name} {dtype}: torch {rows[-1]['call_us']:.1f} µs", flush=True)
    dot = dtype if dtype in (torch.float16, torch.bfloat16) else torch.float32
    for candidate in FP32_CANDIDATES if dot == torch.float32 else HALF_CANDIDATES:
        fn = call_of(inputs, "triton", candidate.chunk)

        def measure(fn=fn):
            row = {"candidate": candidate.name, "fp32_dot": candidate.fp32_dot,
                   "blocks": dataclasses.asdict(candidate.blocks or configs.SSD_BLOCKS[dot]),
                   "chunk": candidate.chunk or configs.SSD_CHUNK}
            try:
                row.update(relative_errors(fn(), want))
                row["call_us"] = time_call(fn, device, seconds)
                if on_gpu:
                    row["host_us"] = host_time(fn)
                    row["device_us"] = graph_time(fn, device, seconds)
                    row["kernels_us"] = kernel_split(fn)
                    row["kernel_sum_us"] = sum(row["kernels_us"].values())
            except Exception as exc:  # a candidate that fails to compile is reported, the rest run
                row["error"] = f"{type(exc).__name__}: {exc}"[:500]
            return row

        row = with_candidate(candidate, dot, measure)
        row["speedup_vs_torch"] = rows[0]["call_us"] / row["call_us"] if "call_us" in row else None
        rows.append(row)
        print(f"  {candidate.name}: " + (row.get("error") or
              f"call {row['call_us']:.1f} µs host {row.get('host_us') or float('nan'):.1f} "
              f"device {row.get('device_us') or float('nan'):.1f} µs "
              f"y err {row['y_rel_err']:.2e} state err {row['state_rel_err']:.2e} "
              f"x{row['speedup_vs_torch']:.2f} torch"), flush=True)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", default="ssd-130m:float32,ssd-130m:bfloat16,ssd-exphil:float32",
                   help="comma-separated case:dtype pairs")
    p.add_argument("--seconds", type=float, default=0.3, help="time budget per measurement")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    p.add_argument("--json", type=output_path)
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device here (--device cpu checks the script under the interpreter)")
    if args.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        # Read when triton is first imported, which this module's imports have done: run anew.
        os.execve(sys.executable, [sys.executable, "-m", "bench.ssd_tune", *(sys.argv[1:] if argv is None else argv)],
                  {**os.environ, "TRITON_INTERPRET": "1"})
    device = torch.device(args.device)
    results = []
    for pair in args.runs.split(","):
        name, dtype_name = pair.split(":")
        case = CASES_BY_NAME[name] if device.type == "cuda" else SMOKE_CASE
        results.append({"case": case.name, "dtype": dtype_name,
                        "rows": run_case(case, getattr(torch, dtype_name), device, args.seconds)})
    if args.json:
        write_results(args.json, "ssd-tune", {"device": str(device), "seconds": args.seconds, "results": results})
    untimed = [f"{r['case']}:{r['dtype']}" for r in results if not any("call_us" in row for row in r["rows"][1:])]
    if untimed:
        print(f"no Triton candidate ran for {', '.join(untimed)} (each one's error is above)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    from bridge.bench import exit_on_stop_signals

    exit_on_stop_signals()
    raise SystemExit(main())
