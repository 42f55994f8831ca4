"""The scans' backward pass on the CPU (issue 35): the C++ reverse scan against torch autograd.

For each case, in one run: the cpu backend's backward (scan_kernels.selective_scan_backward /
ssd_scan_backward) in every SIMD variant this CPU executes, its forward in the same variant,
and torch autograd through the "torch" backend's step-by-step form (the forward under autograd,
then `.backward()`, each timed). Ratios: torch autograd's `.backward()` alone over the C++
backward (goal >= 5x), and the C++ backward over its own forward (goal <= 3x). Peak memory:
the growth of the process's peak resident set (VmHWM, reset through /proc/self/clear_refs)
during one C++ backward, and during torch autograd's forward + backward, over the inputs'
bytes (goal: the C++ backward's <= 2x the inputs').

`--device cuda` (a lent GPU): the triton backend's backward and forward against torch autograd
on the GPU (goal >= 20x), each call timed to its end (synchronized), and the peak memory as
torch's allocator counts it. `--backends` names the backends to time instead of the device's
default (e.g. `triton` on the CPU, on Triton's interpreter: a check that the GPU run's path works).

    python -m bench.backward [--cases exphil,1x768x1024x16,ssd-1x1024x8x64x64] [--reps N] [--torch-reps N]
                             [--device cpu|cuda] [--backends NAMES] [--json bench/results/backward.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

import torch

import scan_kernels
from bench.kernels import simd_backends
from bridge.bench.cases import DT_CLAMP
from bridge.bench.machine import output_path, positive_count, write_results
from scan_kernels import _args

GOALS = {"torch_autograd_over_backward": 5.0, "backward_over_forward": 3.0, "peak_extra_over_inputs": 2.0}
GPU_GOALS = {**GOALS, "torch_autograd_over_backward": 20.0}


@dataclass(frozen=True)
class Case:
    name: str
    kind: str  # "scan" or "ssd"
    batch: int
    seq: int
    dim: int  # channels; for "ssd": heads
    state: int
    headdim: int = 0
    exphil: bool = False  # ExPhil's math: dt clamped, no bias/softplus/D/z


# Names give batch x dim x seq x state, as bench.kernels does.
CASES = {c.name: c for c in (
    Case("exphil", "scan", 32, 60, 512, 16, exphil=True),
    Case("1x768x1024x16", "scan", 1, 1024, 768, 16),
    Case("ssd-1x1024x8x64x64", "ssd", 1, 1024, 8, 64, headdim=64),
    Case("2x64x32x16", "scan", 2, 32, 64, 16),  # seconds in all: the end-to-end test's
    # Small enough for Triton's interpreter: the end-to-end test of --backends triton.
    Case("1x8x16x4", "scan", 1, 16, 8, 4),
    Case("ssd-1x16x2x8x4", "ssd", 1, 16, 2, 4, headdim=8),
)}
DEFAULT_CASES = ("exphil", "1x768x1024x16", "ssd-1x1024x8x64x64")


def inputs_of(case: Case, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    b, l, n, channels = case.batch, case.seq, case.state, case.dim  # for "ssd", heads
    if case.kind == "ssd":
        x_shape, dt_shape = (b, l, channels, case.headdim), (b, l, channels)
        A = -torch.rand(channels, generator=g) - 0.5
    else:
        x_shape = dt_shape = (b, l, channels)
        A = -torch.rand(channels, n, generator=g) - 0.5
    bc = (b, l, 1, n)
    extra = dict(D=torch.randn(channels, generator=g), dt_bias=torch.randn(channels, generator=g) * 0.5,
                 dt_softplus=True)
    args = dict(x=torch.randn(x_shape, generator=g), dt=torch.rand(dt_shape, generator=g) * 0.1, A=A,
                B=torch.randn(bc, generator=g), C=torch.randn(bc, generator=g))
    if case.exphil:
        args.update(DT_CLAMP)
    else:
        args.update(extra, z=torch.randn(x_shape, generator=g))
    return args


def finished(device: torch.device):
    """What waits for the device's queued work: the timings are of calls run to their end."""
    return torch.cuda.synchronize if device.type == "cuda" else (lambda: None)


def alternated_medians_ms(fns, rounds: int, block: int = 2, sync=lambda: None) -> list[float]:
    """Each function's median call time over `rounds` rounds. A round times a block of calls of
    each function in turn, after one untimed call: each is timed in its own steady state (a
    forward right after a backward runs slower, its caches and allocations disturbed), while
    the ratio of two of them compares calls that met the same state of the shared machine."""
    times = [[] for _ in fns]
    for _ in range(rounds):
        for fn, out in zip(fns, times):
            fn()
            sync()
            start = time.perf_counter()
            for _ in range(block):
                fn()
            sync()
            out.append((time.perf_counter() - start) * 1e3 / block)
    return [statistics.median(t) for t in times]


def _status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))


def peaks_in_fresh_process(case_name: str) -> dict:
    """{"cpu": bytes, "torch_autograd": bytes} measured by `--peaks CASE` in a new process: in
    this one, memory freed by earlier cases stays resident and hides the growth."""
    # A fixed mmap threshold: glibc then maps every large block and unmaps it when freed, so
    # the warm-up's freed blocks do not stay resident and absorb the measured call's.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}
    run = subprocess.run([sys.executable, "-m", "bench.backward", "--peaks", case_name], capture_output=True,
                         text=True, timeout=600, env=env)
    if run.returncode != 0:
        raise RuntimeError(f"--peaks {case_name}: {run.stderr.strip()}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def measure_peaks(case: Case) -> dict:
    args = inputs_of(case)
    dy = torch.randn(args["x"].shape, generator=torch.Generator().manual_seed(1))
    _, backward = backward_call(case, scan_kernels._registry.get_backend("cpu", "cpu"), args, dy)
    backward()  # loads the library and starts the helper threads
    cpu = peak_extra_bytes(backward)
    return {"cpu": cpu, "torch_autograd": torch_autograd(case, args, dy, reps=0, peak=True)["peak_extra_bytes"]}


def peak_extra_bytes(fn, device: torch.device = torch.device("cpu")) -> int | None:
    """How far the peak resident set (on CUDA: the memory torch's allocator holds for tensors)
    rises above the current one while fn runs (None where /proc/self/clear_refs cannot reset
    the peak)."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return None
    before = _status_bytes("VmRSS")
    fn()
    return _status_bytes("VmHWM") - before


def backward_call(case: Case, backend, args: dict, dy: torch.Tensor):
    """(forward, backward) closures on a Backend object (the registry's or a SIMD variant's
    build), over arguments normalised as the public API normalises them."""
    if case.kind == "ssd":
        a = _args.check_ssd_scan(**args)
        kw = dict(D=a.D, z=a.z, dt_bias=a.dt_bias, dt_softplus=a.dt_softplus, dt_min=a.dt_min, dt_max=a.dt_max,
                  h0=None, chunk_size=None)
        return (lambda: backend.ssd_scan(a.x, a.dt, a.A, a.B, a.C, **kw, return_state=False),
                lambda: backend.ssd_scan_backward(dy, a.x, a.dt, a.A, a.B, a.C, **kw, dstate=None))
    a = _args.check_scan(**args)
    kw = dict(D=a.D, z=a.z, dt_bias=a.dt_bias, dt_softplus=a.dt_softplus, dt_min=a.dt_min, dt_max=a.dt_max,
              h0=None, layout="bld")
    return (lambda: backend.scan(a.x, a.dt, a.A, a.B, a.C, **kw, return_state=False),
            lambda: backend.scan_backward(dy, a.x, a.dt, a.A, a.B, a.C, **kw, dstate=None))


def torch_autograd(case: Case, args: dict, dy: torch.Tensor, reps: int, peak: bool = False) -> dict:
    """Forward under autograd through the torch backend's differentiable form, then .backward(),
    on the inputs' device."""
    from scan_kernels.reference import selective_scan_ref, ssd_scan_ref

    trained = [k for k in ("x", "dt", "A", "B", "C", "D", "z", "dt_bias") if k in args]
    forward_ref = ssd_scan_ref if case.kind == "ssd" else selective_scan_ref
    normalized = (_args.check_ssd_scan(**args) if case.kind == "ssd" else _args.check_scan(**args))
    base = {k: getattr(normalized, k) for k in trained}

    def forward():
        leaves = {k: v.detach().requires_grad_(True) for k, v in base.items()}
        options = dict(dt_softplus=normalized.dt_softplus, dt_min=normalized.dt_min, dt_max=normalized.dt_max)
        if case.kind == "scan":
            options["layout"] = "bld"
        y, _ = forward_ref(**{**{k: None for k in ("D", "z", "dt_bias")}, **leaves}, **options,
                           compute_dtype=torch.float32)
        return y

    if peak:
        return {"peak_extra_bytes": peak_extra_bytes(lambda: forward().backward(dy), dy.device)}
    sync = finished(dy.device)
    forward_times, backward_times = [], []
    for _ in range(reps + 1):
        sync()
        start = time.perf_counter()
        y = forward()
        sync()
        middle = time.perf_counter()
        y.backward(dy)
        sync()
        end = time.perf_counter()
        forward_times.append((middle - start) * 1e3)
        backward_times.append((end - middle) * 1e3)
    return {"forward_ms": statistics.median(forward_times[1:]), "backward_ms": statistics.median(backward_times[1:])}


def run_case(case: Case, variants: dict, reps: int, torch_reps: int, device: torch.device) -> dict:
    """The first of `variants` is the one the ratios and the peak memory are of."""
    args = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs_of(case).items()}
    dy = torch.randn(args["x"].shape, generator=torch.Generator().manual_seed(1)).to(device)
    inputs_bytes = sum(t.numel() * t.element_size() for t in [*args.values(), dy] if isinstance(t, torch.Tensor))
    goals = GPU_GOALS if device.type == "cuda" else GOALS
    rows = {}
    for name, backend in variants.items():
        forward, backward = backward_call(case, backend, args, dy)
        fwd, bwd = alternated_medians_ms((forward, backward), reps, sync=finished(device))
        rows[name] = {"forward_ms": fwd, "backward_ms": bwd, "backward_over_forward": bwd / fwd,
                      "simd": backend.details.get("simd")}
        print(f"  {case.name:>20} {name:>12}: forward {fwd:8.2f} ms  backward {bwd:8.2f} ms  ({bwd / fwd:.2f}x)")
    primary_name = next(iter(variants))
    if primary_name == "cpu" and device.type == "cpu":
        peaks = peaks_in_fresh_process(case.name)
    else:
        _, primary_backward = backward_call(case, variants[primary_name], args, dy)
        peaks = {"cpu": peak_extra_bytes(primary_backward, device),
                 "torch_autograd": torch_autograd(case, args, dy, reps=0, peak=True)["peak_extra_bytes"]}
    peak = peaks["cpu"]
    reference = {**torch_autograd(case, args, dy, torch_reps), "peak_extra_bytes": peaks["torch_autograd"]}
    for row in rows.values():
        row["torch_autograd_over_backward"] = reference["backward_ms"] / row["backward_ms"]
    primary = rows[primary_name]
    ratios = {"torch_autograd_over_backward": reference["backward_ms"] / primary["backward_ms"],
              "torch_autograd_total_over_backward": (reference["forward_ms"] + reference["backward_ms"])
              / primary["backward_ms"],
              "backward_over_forward": primary["backward_over_forward"]}
    if peak is not None:
        ratios["peak_extra_over_inputs"] = peak / inputs_bytes
    print(f"  {case.name:>20} torch autograd: forward {reference['forward_ms']:.1f} ms, backward "
          f"{reference['backward_ms']:.1f} ms -> {ratios['torch_autograd_over_backward']:.1f}x the {primary_name} "
          f"backward (goal >= {goals['torch_autograd_over_backward']}); its peak extra "
          + (f"{peak / 2**20:.1f} MiB = {ratios['peak_extra_over_inputs']:.2f}x the inputs' {inputs_bytes / 2**20:.1f} MiB"
             if peak is not None else "not measurable here")
          + (f", torch autograd's {reference['peak_extra_bytes'] / 2**20:.0f} MiB"
             if reference["peak_extra_bytes"] is not None else ""))
    print("  " + ", ".join(f"{name} {row['torch_autograd_over_backward']:.1f}x" for name, row in rows.items())
          + " torch autograd's backward")
    # "cpu_peak_extra_bytes": the first backend's, named so since the CPU-only recordings.
    return {"case": asdict(case), "inputs_bytes": inputs_bytes, "cpu_peak_extra_bytes": peak, "variants": rows,
            "torch_autograd": reference, "ratios": ratios}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default=",".join(DEFAULT_CASES), help=f"comma-separated, of {', '.join(CASES)}")
    p.add_argument("--reps", type=positive_count, default=30)
    p.add_argument("--torch-reps", type=positive_count, default=3)
    p.add_argument("--device", default="cpu", help="cpu, or cuda (cuda:N) on a GPU")
    p.add_argument("--backends", help="comma-separated backends to time (default: cpu and its SIMD variants on the "
                                      "CPU, triton on CUDA); the first is the one the ratios are of")
    p.add_argument("--json", type=output_path)
    p.add_argument("--peaks", metavar="CASE", help=argparse.SUPPRESS)  # one case's peak memory, as JSON
    args = p.parse_args(argv)
    unknown = [name for name in args.cases.split(",") if name not in CASES]
    if unknown:
        p.error(f"--cases: expected names from {', '.join(CASES)}, got {', '.join(map(repr, unknown))}")
    if args.peaks:
        print(json.dumps(measure_peaks(CASES[args.peaks])))
        return 0
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here")
    names = args.backends.split(",") if args.backends else ["triton" if device.type == "cuda" else "cpu"]
    # Only the backends named are loaded: available_backends() loads every one, and on a fresh
    # GPU machine would build the C++ CPU extension inside the lease's minutes, timing none of it.
    variants, unusable = {}, []
    for name in names:
        try:
            variants[name] = scan_kernels._registry.get_backend(name, device.type)
        except scan_kernels.BackendUnavailable as exc:
            unusable.append(f"{name} ({exc})")
    if unusable:
        raise SystemExit(f"--backends on {device.type}: unavailable here: {', '.join(unusable)}")
    unavailable = {}
    if names == ["cpu"]:
        extra, unavailable = simd_backends(["all"])
        variants.update(extra)
    load_before = os.getloadavg()
    cases = [run_case(CASES[name], variants, args.reps, args.torch_reps, device) for name in args.cases.split(",")]
    if args.json:
        write_results(args.json, "backward", {"goals": GPU_GOALS if device.type == "cuda" else GOALS,
                                              "device": str(device), "backends": names, "cases": cases,
                                              "unavailable_variants": unavailable,
                                              "load_before": load_before, "load_after": os.getloadavg(),
                                              "torch_threads": torch.get_num_threads()})
    return 0


if __name__ == "__main__":
    from bridge.bench import exit_on_stop_signals

    exit_on_stop_signals()
    raise SystemExit(main())
