"""Kernel benchmark: each backend on a registry of cases, against the memory floor, the
reference and the torch backend, all measured in the same run.

    python -m bench.kernels [--backends cpu,torch] [--cases exphil,step-32x512x16] [--quick]
                            [--simd all|avx512,avx2,baseline] [--rounds N]
                            [--layout bld|bdl] [--threads N] [--runs N [--gap-seconds S]]
                            [--json bench/results/kernels-cpu.json]

Cases: Mamba-1 scans and steps (selective_scan / selective_state_update), and Mamba-2 (SSD)
scans and steps (ssd_scan / ssd_state_update, named ssd-*) at Mamba-2-130m's layer and at
ExPhil's window; a backend without the SSD kernels is skipped on those, with the reason printed.
`--layout` concerns the Mamba-1 scans only (the SSD scan has one layout).

Per (case, backend): kernel time (median, p20, p80) of the backend's own call on arguments
validated once beforehand (so API validation is not counted); achieved GB/s; the ratio to the
memory floor; and the speedup over the reference and over the torch backend.

Memory floor: the bytes a kernel must move -- every input read once and every output written
once (y; for the state update also the state rows, read and written in place) -- over the copy
bandwidth measured in this run: a 64 MiB tensor copy on the CPU, device-to-device on a GPU
(both count bytes read plus bytes written). Small cases live in caches and can beat it.

Timing: on the CPU, perf_counter around repeated calls, within a time budget per measurement;
on CUDA, triton.testing.do_bench (CUDA events when triton is missing). triton is only imported
where CUDA is present. The reference loops over time in Python and materialises large tensors
(Mamba-1's [batch, seq, dim, state], the SSD one's B and C repeated per head): its repetitions
are capped, it is measured once whatever `--rounds`, and above a size it is skipped with the
reason printed (the speedup over it is then absent).

`--simd` also measures each variant's exp throughput (bench.exp_rate) in the run and gives its
Mamba-1 rows their exp bound: one decay per state element at that rate. `--simd` adds the C++
backend built in each named SIMD variant (scan_kernels.cpu.build.SIMD_VARIANTS;
`all`: every one this CPU executes) as rows `cpu-<variant>`, side by side with the "cpu" backend
(the variant that serves by default, or SCAN_BRIDGE_SIMD's; `backend_details` names it) and the
baselines. `--rounds N` measures every backend of a case N times, in alternating order (the
reference once), and reports the median of the rounds' medians: ratios between backends then
come from interleaved measurements, which a shared machine's drift affects alike.

`--runs N` repeats the whole measurement in N fresh processes, `--gap-seconds` apart, and
reports per (case, backend) the median of the runs' medians with their range: on a shared
machine a process's speed depends on its placement and on what its neighbours do (how much:
docs/performance.md, "CPU kernels"), which one process cannot show.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from dataclasses import asdict, dataclass

import torch

import scan_kernels
from bridge.bench.cases import DT_CLAMP
from bridge.bench.machine import output_path, positive_count, summarize_us, write_results
from scan_kernels import _args
from scan_kernels._registry import BACKEND_MODULES, get_backend

BASELINES = ("reference", "torch")
# Candidate backends per device type, in report order; only available ones run.
BACKENDS = {"cpu": ("reference", "torch", "cpu"), "cuda": ("reference", "torch", "triton")}


@dataclass(frozen=True)
class KernelCase:
    name: str
    # "scan" or "step" (selective_state_update: one timestep); "ssd-scan" or "ssd-step" for
    # Mamba-2 (ssd_scan / ssd_state_update), whose dim is heads x headdim.
    kind: str
    batch: int
    dim: int
    state: int
    seq: int = 1
    exphil: bool = False  # ExPhil's math: dt clamped to [0.001, 0.1], no bias/softplus/D/z
    heads: int | None = None  # SSD cases only

    @property
    def ssd(self) -> bool:
        return self.kind.startswith("ssd-")

    @property
    def step(self) -> bool:
        """One timestep that updates a state pool in place (rather than a scan)."""
        return self.kind in ("step", "ssd-step")

    @property
    def headdim(self) -> int:
        return self.dim // self.heads

    @property
    def elements(self) -> int:
        """The size of the largest tensor the reference materialises: batch x seq x dim x state
        for Mamba-1; for SSD, B and C repeated per head or the y it stacks (batch x seq x heads x
        the larger of state and headdim)."""
        if self.ssd:
            return self.batch * self.seq * self.heads * max(self.state, self.headdim)
        return self.batch * self.seq * self.dim * self.state


def _scan(name, batch, dim, seq, state, **kw):
    return KernelCase(name, "scan", batch=batch, dim=dim, state=state, seq=seq, **kw)


def _ssd(name, kind, batch, heads, headdim, state, seq=1, **kw):
    return KernelCase(name, kind, batch=batch, dim=heads * headdim, state=state, seq=seq, heads=heads, **kw)


# Names give batch x dim x seq x state, as in the issue; "exphil" is ExPhil's request
# (32 x 60 x 512 x 16: batch x seq x dim x state).
CASES = [
    _scan("exphil", 32, 512, 60, 16, exphil=True),
    _scan("1x4x16x4", 1, 4, 16, 4),
    _scan("4x16x64x16", 4, 16, 64, 16),
    _scan("16x64x256x64", 16, 64, 256, 64),
    _scan("1x256x1024x16", 1, 256, 1024, 16),
    _scan("1x512x1024x16", 1, 512, 1024, 16),
    _scan("1x768x1024x16", 1, 768, 1024, 16),
    _scan("1x1536x4096x16", 1, 1536, 4096, 16),
    KernelCase("step-32x512x16", "step", batch=32, dim=512, state=16),
    # Mamba-2: one layer of Mamba-2-130m (24 heads x 64 headdim, state 128, one group) over a
    # 1024-token prefill, ExPhil's window (batch 32 x seq 60) with 8 heads x 64 (dim 512, as its
    # Mamba-1 model) and state 16, and one decoding step of each for 32 sessions (pool rows by slot).
    _ssd("ssd-130m", "ssd-scan", 1, 24, 64, 128, seq=1024),
    _ssd("ssd-exphil", "ssd-scan", 32, 8, 64, 16, seq=60, exphil=True),
    _ssd("ssd-step-130m", "ssd-step", 32, 24, 64, 128),
    _ssd("ssd-step-exphil", "ssd-step", 32, 8, 64, 16, exphil=True),
]
CASES_BY_NAME = {c.name: c for c in CASES}


# --- inputs --------------------------------------------------------------------------------

def _samplers(g: torch.Generator):
    """randn(*shape) and uniform(lo, hi, *shape), both drawing from g."""
    def randn(*shape):
        return torch.randn(*shape, generator=g)

    def uniform(lo, hi, *shape):
        return torch.rand(*shape, generator=g) * (hi - lo) + lo

    return randn, uniform


def make_inputs(case: KernelCase, layout: str, device: torch.device, seed: int = 0) -> dict:
    """Keyword arguments for selective_scan / selective_state_update. ExPhil's request as it
    sends it; the other cases as a Mamba block calls the kernel (S4D-real A = -(1..state),
    dt through bias and softplus into ~[0.001, 0.1], D, z). SSD cases: `make_ssd_inputs`."""
    g = torch.Generator().manual_seed(seed)
    if case.ssd:
        return {k: v.to(device) if isinstance(v, torch.Tensor) else v
                for k, v in make_ssd_inputs(case, g).items()}
    b, d, n, l = case.batch, case.dim, case.state, case.seq
    randn, uniform = _samplers(g)
    if case.kind == "step":
        args = dict(state=randn(b, d, n), x=randn(b, d), dt=uniform(-4.0, -2.0, b, d),
                    B=randn(b, n), C=randn(b, n), z=randn(b, d))
    else:
        x_shape, bc_shape = ((b, l, d), (b, l, n)) if layout == "bld" else ((b, d, l), (b, n, l))
        args = dict(x=randn(*x_shape), B=randn(*bc_shape), C=randn(*bc_shape), layout=layout)
        if case.exphil:
            args.update(dt=uniform(DT_CLAMP["dt_min"], DT_CLAMP["dt_max"], *x_shape),
                        A=-uniform(0.5, 4.0, d, n), **DT_CLAMP)
        else:
            args.update(dt=uniform(-4.0, -2.0, *x_shape), z=randn(*x_shape))
    if not case.exphil:
        args.update(A=-torch.arange(1, n + 1, dtype=torch.float32).repeat(d, 1), D=torch.ones(d),
                    dt_bias=uniform(-2.5, -0.5, d), dt_softplus=True)
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in args.items()}


def make_ssd_inputs(case: KernelCase, g: torch.Generator) -> dict:
    """Keyword arguments for ssd_scan / ssd_state_update (on the CPU). ExPhil's math as in its
    Mamba-1 case (dt drawn within the clamp, no bias/softplus/D/z); otherwise as a Mamba-2 block
    calls the kernel: A = -[1, 16) per head, dt through bias and softplus into ~[0.001, 0.1],
    D per head, z. A step updates pool rows by slot (a shuffled pool of `batch` sessions)."""
    b, h, p, n, l = case.batch, case.heads, case.headdim, case.state, case.seq
    randn, uniform = _samplers(g)
    lead = (b,) if case.step else (b, l)
    args = dict(x=randn(*lead, h, p), B=randn(*lead, 1, n), C=randn(*lead, 1, n))
    if case.step:
        args.update(state=randn(b, h, p, n), slots=torch.randperm(b, generator=g))
    if case.exphil:
        args.update(dt=uniform(DT_CLAMP["dt_min"], DT_CLAMP["dt_max"], *lead, h), A=-uniform(0.5, 4.0, h),
                    **DT_CLAMP)
    else:
        args.update(dt=uniform(-4.0, -2.0, *lead, h), A=-uniform(1.0, 16.0, h), D=torch.ones(h),
                    z=randn(*lead, h, p), dt_bias=uniform(-2.5, -0.5, h), dt_softplus=True)
    return args


def moved_bytes(case: KernelCase, inputs: dict) -> int:
    """Inputs read once plus outputs written once (y, same size as x; the state update also
    writes the state it reads)."""
    tensors = [v for v in inputs.values() if isinstance(v, torch.Tensor)]
    read = sum(t.numel() * t.element_size() for t in tensors)
    written = inputs["x"].numel() * inputs["x"].element_size()
    if case.step:
        written += inputs["state"].numel() * inputs["state"].element_size()
    return read + written


def kernel_call(case: KernelCase, backend: str, inputs: dict, extra: dict | None = None):
    """The backend's own call on arguments validated and normalised once, here; `extra` maps
    names to Backends outside the registry (the SIMD variants' builds)."""
    impl = (extra or {}).get(backend) or get_backend(backend, inputs["x"].device.type)
    return backend_call(case, impl, inputs)


def backend_call(case: KernelCase, impl, inputs: dict):
    """`impl`'s (a kernels Backend's) call on arguments validated and normalised once, here."""
    if case.kind == "ssd-step":
        a = _args.check_ssd_state_update(**inputs)
        kw = a.backend_kwargs()
        return lambda: impl.ssd_state_update(a.state, a.x, a.dt, a.A, a.B, a.C, **kw)
    if case.kind == "ssd-scan":
        a = _args.check_ssd_scan(**inputs)
        kw = a.backend_kwargs()
        return lambda: impl.ssd_scan(a.x, a.dt, a.A, a.B, a.C, **kw)
    if case.kind == "step":
        a = _args.check_state_update(**inputs)
        kw = a.backend_kwargs()
        return lambda: impl.state_update(a.state, a.x, a.dt, a.A, a.B, a.C, **kw)
    a = _args.check_scan(**inputs)
    kw = a.backend_kwargs()
    return lambda: impl.scan(a.x, a.dt, a.A, a.B, a.C, **kw)


# --- timing --------------------------------------------------------------------------------

@dataclass(frozen=True)
class Budget:
    seconds: float  # per measurement, after the warm-up call
    min_reps: int
    max_reps: int


def measure(fn, device: torch.device, budget: Budget) -> dict:
    """median / p20 / p80 of one call, in microseconds."""
    if device.type == "cuda":
        try:
            from triton.testing import do_bench
        except ImportError:
            return _summary(_event_times(fn, budget))
        median, p20, p80 = do_bench(fn, warmup=max(1, round(budget.seconds * 250)),
                                    rep=max(1, round(budget.seconds * 1000)), quantiles=[0.5, 0.2, 0.8])
        return {"median_us": median * 1e3, "p20_us": p20 * 1e3, "p80_us": p80 * 1e3, "reps": None}
    return _summary(_wall_times(fn, budget))


def _repeat(fn, budget: Budget, timed_call) -> list[float]:
    fn()  # warm-up: first-touch page faults, lazily built state, compilation
    times = []
    start = time.perf_counter()
    while len(times) < budget.min_reps or (
            len(times) < budget.max_reps and time.perf_counter() - start < budget.seconds):
        times.append(timed_call())
    return times


def _wall_times(fn, budget: Budget) -> list[float]:
    def call():
        t0 = time.perf_counter_ns()
        fn()
        return (time.perf_counter_ns() - t0) / 1e3
    return _repeat(fn, budget, call)


def _event_times(fn, budget: Budget) -> list[float]:
    def call():
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        fn()
        end.record()
        end.synchronize()
        return begin.elapsed_time(end) * 1e3
    return _repeat(fn, budget, call)


def _summary(times: list[float]) -> dict:
    s = summarize_us(times, (20, 50, 80))
    return {"median_us": s["p50_us"], "p20_us": s["p20_us"], "p80_us": s["p80_us"], "reps": s["n"]}


def copy_bandwidth(device: torch.device, budget: Budget) -> float:
    """Bytes per second of a 64 MiB tensor copy (larger than the last-level caches of the
    machines it targets), counting bytes read plus bytes written."""
    src = torch.rand(16 * 1024 * 1024, device=device)
    dst = torch.empty_like(src)
    median_us = measure(lambda: dst.copy_(src), device, budget)["median_us"]
    return 2 * src.numel() * src.element_size() / (median_us * 1e-6)


# --- the run -------------------------------------------------------------------------------

def backend_status(names, device_type: str) -> tuple[list[str], dict]:
    """(available names, {unavailable name: reason}); loads only the backends named."""
    ok, skipped = [], {}
    for name in names:
        try:
            scan_kernels.select_backend(device_type, name)
        except (scan_kernels.BackendUnavailable, scan_kernels.UnknownBackend) as exc:
            skipped[name] = str(exc)
        else:
            ok.append(name)
    return ok, skipped


def simd_backends(names: list[str]) -> tuple[dict, dict]:
    """({"cpu-<variant>": Backend}, {"cpu-<variant>": reason unavailable}) for the SIMD variants
    named ("all": every one this CPU executes), each built as its own module."""
    from scan_kernels.cpu import backend_from, build

    if names == ["all"]:
        names = [v.name for v in build.executable_variants()]
    loaded, unavailable = {}, {}
    for name in names:
        try:
            loaded[f"cpu-{name}"] = backend_from(build.load_extension(variant=build.variant_named(name)))
        except scan_kernels.BackendUnavailable as exc:
            unavailable[f"cpu-{name}"] = str(exc)
    return loaded, unavailable


def measure_exp_rates(extra: dict, details: dict, available: list[str]) -> dict:
    """{backend: decays a second} for each SIMD variant's row and for "cpu" (the variant that
    serves), measured now by bench.exp_rate's probe on as many threads as the kernels use."""
    from scan_kernels.cpu import build

    from . import exp_rate

    rates = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in [*extra, *(["cpu"] if "cpu" in available else [])]:
            variant = build.variant_named(name.removeprefix("cpu-") if name != "cpu" else details["cpu"]["simd"])
            binary = exp_rate.compile_probe(variant, Path(tmp))
            rates[name], _ = exp_rate.measure(binary, torch.get_num_threads(), 0.5)
            print(f"exp rate {name}: {rates[name] / 1e9:.2f} G decays/s on {torch.get_num_threads()} threads")
    return rates


def _over_rounds(measurements: list[dict]) -> dict:
    """One backend's rounds: the median of their medians (and of their p20, p80)."""
    if len(measurements) == 1:
        return measurements[0]
    return {"median_us": statistics.median(m["median_us"] for m in measurements),
            "p20_us": statistics.median(m["p20_us"] for m in measurements),
            "p80_us": statistics.median(m["p80_us"] for m in measurements),
            "reps": sum(m["reps"] or 0 for m in measurements) or None,
            "round_medians_us": [m["median_us"] for m in measurements]}


def run(cases, backends, device: torch.device, layout: str, quick: bool, reference_reps: int,
        reference_max_elements: int, log=print, extra: dict | None = None, rounds: int = 1,
        exp_rates: dict | None = None) -> dict:
    """exp_rates: {backend: decays a second} (bench.exp_rate) for the C++ rows; Mamba-1 rows of
    those backends then get their exp bound (one decay per state element) and their ratio to it."""
    budget = Budget(0.15, 3, 200) if quick else Budget(0.6, 5, 2000)
    ref_budget = Budget(0.0, reference_reps, reference_reps)
    bandwidth = copy_bandwidth(device, budget)
    log(f"copy bandwidth: {bandwidth / 1e9:.1f} GB/s (64 MiB tensor copy, read + write)")
    results = []
    for case in cases:
        inputs = make_inputs(case, layout, device)
        nbytes = moved_bytes(case, inputs)
        floor_us = nbytes / bandwidth * 1e6
        rows, calls, measured = {}, {}, {}
        for name in backends:
            row = {"case": case.name, "backend": name, "bytes": nbytes, "floor_us": floor_us}
            if name == "reference" and case.elements > reference_max_elements:
                row["skipped"] = (f"reference skipped: {case.elements:,} elements in its largest tensor > "
                                  f"{reference_max_elements:,} (KernelCase.elements)")
                log(f"  {case.name}: {row['skipped']}")
            else:
                fresh = make_inputs(case, layout, device)  # in-place state updates stay per backend
                calls[name] = kernel_call(case, name, fresh, extra)
                measured[name] = []
            rows[name] = row
        for i in range(rounds):
            for name in (list(calls) if i % 2 == 0 else list(calls)[::-1]):
                if name == "reference" and measured[name]:
                    continue  # the reference's seconds are measured once
                measured[name].append(measure(calls[name], device, ref_budget if name == "reference" else budget))
        for name, measurements in measured.items():
            row = rows[name]
            row.update(_over_rounds(measurements))
            row["GBps"] = nbytes / (row["median_us"] * 1e-6) / 1e9
            row["over_floor"] = row["median_us"] / floor_us
            if exp_rates and name in exp_rates and not case.ssd:
                row["exp_bound_us"] = case.batch * case.seq * case.dim * case.state / exp_rates[name] * 1e6
                row["over_exp_bound"] = row["median_us"] / row["exp_bound_us"]
        for row in rows.values():
            for base in BASELINES:
                if "median_us" in row and "median_us" in rows.get(base, {}):
                    row[f"speedup_vs_{base}"] = rows[base]["median_us"] / row["median_us"]
        results.extend(rows.values())
        log(format_rows(case, list(rows.values())))
    return {"copy_bandwidth_GBps": bandwidth / 1e9, "results": results}


def _us(v: float) -> str:
    return f"{v / 1000:.2f} ms" if v >= 1000 else f"{v:.1f} us"


def format_rows(case: KernelCase, rows: list[dict]) -> str:
    channels = (f"heads {case.heads} x headdim {case.headdim}" if case.ssd else f"dim {case.dim}")
    shape = (f"batch {case.batch} x {channels} x state {case.state}" if case.step
             else f"batch {case.batch} x seq {case.seq} x {channels} x state {case.state}")
    lines = [f"{case.name} ({case.kind}: {shape}; {rows[0]['bytes'] / 1e6:.2f} MB moved, "
             f"floor {_us(rows[0]['floor_us'])})"]
    for r in rows:
        if "median_us" not in r:
            lines.append(f"  {r['backend']:<12} skipped")
            continue
        speedups = "  ".join(f"{r[k]:7.1f}x vs {k[11:]}" for k in ("speedup_vs_reference", "speedup_vs_torch")
                             if k in r)
        lines.append(f"  {r['backend']:<12} {_us(r['median_us']):>10}  ({_us(r['p20_us'])} - {_us(r['p80_us'])})"
                     f"  {r['GBps']:6.2f} GB/s  {r['over_floor']:6.1f}x floor  {speedups}"
                     + (f"  {r['over_exp_bound']:5.2f}x exp bound" if "over_exp_bound" in r else ""))
    return "\n".join(lines)


def over_runs(runs: list[list[dict]]) -> list[dict]:
    """Per (case, backend), in the order of the first run: each run's median, the median of
    those with their range, and the median of each run's speedups."""
    rows: dict[tuple, list[dict]] = {}
    for results in runs:
        for row in results:
            if "median_us" in row:
                rows.setdefault((row["case"], row["backend"]), []).append(row)
    summary = []
    for (case, backend), mine in rows.items():
        medians = [r["median_us"] for r in mine]
        entry = {"case": case, "backend": backend, "runs": len(mine), "run_medians_us": medians,
                 "median_of_medians_us": statistics.median(medians), "min_median_us": min(medians),
                 "max_median_us": max(medians),
                 "median_of_p20_us": statistics.median(r["p20_us"] for r in mine)}
        for base in BASELINES:
            speedups = [r[f"speedup_vs_{base}"] for r in mine if f"speedup_vs_{base}" in r]
            if speedups and base != backend:
                entry[f"median_speedup_vs_{base}"] = statistics.median(speedups)
        summary.append(entry)
    return summary


def repeated(args, argv: list[str]) -> int:
    """`--runs N`: the measurement in N fresh processes, each given `argv` as it came with
    `--runs 1 --json FILE` after it (argparse keeps an option's last value), so every other
    option reaches them unchanged; their results and the summary over them."""
    runs, documents = [], []
    with tempfile.TemporaryDirectory(prefix="bench-kernels-") as scratch:
        for i in range(args.runs):
            if i and args.gap_seconds:
                time.sleep(args.gap_seconds)
            out = f"{scratch}/run{i}.json"
            proc = subprocess.run([sys.executable, "-m", "bench.kernels", *argv, "--runs", "1", "--json", out],
                                  capture_output=True, text=True)
            if proc.returncode != 0:
                print(proc.stdout + proc.stderr, file=sys.stderr)
                print(f"run {i + 1} of {args.runs} failed (exit status {proc.returncode})", file=sys.stderr)
                return 1
            with open(out) as f:
                document = json.load(f)
            documents.append(document)
            runs.append(document["results"])
            print(f"run {i + 1}/{args.runs}: " + ", ".join(
                f"{r['case']} {r['backend']} {_us(r['median_us'])}" for r in document["results"] if "median_us" in r),
                flush=True)
    summary = over_runs(runs)
    print(f"over {args.runs} runs, {args.gap_seconds:g} s apart (median of the runs' medians, their range):")
    for e in summary:
        print(f"  {e['case']:<16} {e['backend']:<10} {_us(e['median_of_medians_us']):>10}  "
              f"({_us(e['min_median_us'])} - {_us(e['max_median_us'])})")
    if args.json:
        first = documents[0]
        write_results(args.json, "kernels", {
            **{k: first[k] for k in ("device", "torch_threads", "layout", "quick", "backend_details",
                                     "unavailable_backends", "cases")},
            "runs": args.runs, "gap_seconds": args.gap_seconds, "over_runs": summary,
            "each_run": [{"commit": d["commit"], "copy_bandwidth_GBps": d["copy_bandwidth_GBps"],
                          "results": d["results"]} for d in documents]})
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backends", help="comma-separated backends to time (default: every available "
                   "one for the device); the reference and torch backends always run as baselines")
    p.add_argument("--cases", help="comma-separated case names (default: all): " + ", ".join(CASES_BY_NAME))
    p.add_argument("--quick", action="store_true", help="short time budget per measurement")
    p.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda when available")
    p.add_argument("--layout", choices=_args.LAYOUTS, default="bld", help="layout of the scan cases")
    p.add_argument("--simd", help="comma-separated SIMD variants of the C++ backend to time beside it, each "
                   "built as its own module (rows cpu-<variant>); 'all': every one this CPU executes")
    p.add_argument("--rounds", type=positive_count, default=1, help="measure each backend this many times per case, "
                   "in alternating order, and report the median of the rounds (default 1)")
    p.add_argument("--threads", type=int, help="torch.set_num_threads before measuring")
    p.add_argument("--reference-reps", type=int, default=3, help="repetitions of the reference (default 3)")
    p.add_argument("--reference-max-elements", type=int, default=1 << 25,
                   help="skip the reference above this size of its largest tensor (batch*seq*dim*state for "
                   "Mamba-1; default 2^25)")
    p.add_argument("--runs", type=positive_count, default=1, help="repeat the measurement in this many fresh "
                   "processes and summarise over them (default 1: this process only)")
    p.add_argument("--gap-seconds", type=float, default=0.0, help="pause between runs (with --runs)")
    p.add_argument("--json", type=output_path, help="write results with machine and commit info to this file")
    argv = sys.argv[1:] if argv is None else list(argv)
    args = p.parse_args(argv)
    if args.gap_seconds < 0:
        p.error(f"--gap-seconds: expected 0 or more, got {args.gap_seconds}")
    if args.reference_reps < 1:
        p.error(f"--reference-reps: expected at least 1, got {args.reference_reps}")
    if args.threads is not None and args.threads < 1:
        p.error(f"--threads: expected at least 1, got {args.threads}")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device here")
    # A name no build knows is a typo, refused; a known one this machine lacks is reported and
    # skipped, as the results record what each machine could run.
    unknown = [name for name in args.backends.split(",") if name not in BACKEND_MODULES] if args.backends else []
    if unknown:
        p.error(f"--backends: expected names from {', '.join(BACKEND_MODULES)}, got {', '.join(map(repr, unknown))}")
    if args.simd and args.simd != "all":
        from scan_kernels.cpu.build import SIMD_VARIANTS

        unknown = [name for name in args.simd.split(",") if name not in {v.name for v in SIMD_VARIANTS}]
        if unknown:
            p.error(f"--simd: expected 'all' or names from {', '.join(v.name for v in SIMD_VARIANTS)}, "
                    f"got {', '.join(map(repr, unknown))}")
    if args.runs > 1:
        return repeated(args, argv)

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        cases = [CASES_BY_NAME[n] for n in args.cases.split(",")] if args.cases else CASES
    except KeyError as exc:
        p.error(f"unknown case {exc}; known: {', '.join(CASES_BY_NAME)}")
    wanted = args.backends.split(",") if args.backends else BACKENDS[device.type]
    names = list(dict.fromkeys([*BASELINES, *wanted]))
    available, unavailable = backend_status(names, device.type)
    extra = {}
    if args.simd:
        extra, extra_unavailable = simd_backends(args.simd.split(","))
        available += list(extra)
        unavailable.update(extra_unavailable)
    for name, reason in unavailable.items():
        print(f"backend {name}: unavailable: {reason}", file=sys.stderr)
    details = {n: (extra.get(n) or get_backend(n, device.type)).details for n in available}
    print(f"device {device}, torch threads {torch.get_num_threads()}, backends {', '.join(available)}"
          + "".join(f"; {n}: {d}" for n, d in details.items() if d))

    exp_rates = measure_exp_rates(extra, details, available) if args.simd else None
    start = time.perf_counter()
    report = run(cases, available, device, args.layout, args.quick, args.reference_reps,
                 args.reference_max_elements, extra=extra, rounds=args.rounds, exp_rates=exp_rates)
    print(f"total {time.perf_counter() - start:.0f} s")
    if args.json:
        write_results(args.json, "kernels", {
            "device": str(device), "torch_threads": torch.get_num_threads(), "layout": args.layout,
            "quick": args.quick, "rounds": args.rounds, "backend_details": details,
            "unavailable_backends": unavailable, "cases": [asdict(c) for c in cases],
            "exp_decays_per_s": exp_rates, **report})
    return 0


if __name__ == "__main__":
    from bridge.bench import exit_on_stop_signals

    exit_on_stop_signals()
    raise SystemExit(main())
