"""Packed sequences (cu_seqlens) on the CPU: one kernel call for all of them against one a sequence.

For each case, in one run and one process, alternated: the C++ backend taking the packed call
whole (`Backend.packs_sequences`), the same backend called once per sequence (the way every
backend served packed sequences before, scan_kernels/_varlen.py's split), and a padded batch (every
sequence padded to the longest, one call: what a caller without varlen sends, more work than
the others). Each sequence starts from its own row of h0 and its final state is returned.
Ratios: per-sequence calls over the packed call, and the padded batch over the packed call;
the packed and per-sequence outputs are compared (they differ by float32 rounding at most: a
one-step sequence called alone takes the step path, whose sums run in another order). The
backward likewise: the packed call's gradients in one C++ call against one call a sequence
(scan_kernels/_varlen.py's split of the backward), its gradients compared relative to the largest.

    python -m bench.varlen [--cases exphil-agents,many-short,ssd-exphil-agents,1x768-4-long] [--reps N]
                           [--json bench/results/varlen.json]
"""

from __future__ import annotations

import argparse
import os
from dataclasses import asdict, dataclass

import torch

import scan_kernels
from scan_kernels import _args, _varlen
from bench.backward import alternated_medians_ms
from bridge.bench.cases import DT_CLAMP
from bridge.bench.machine import output_path, positive_count, write_results


@dataclass(frozen=True)
class Case:
    name: str
    kind: str  # "scan" (Mamba-1) or "ssd" (Mamba-2)
    sequences: int
    shortest: int
    longest: int  # lengths drawn uniformly in [shortest, longest], seeded
    dim: int  # channels; for "ssd": heads
    state: int
    headdim: int = 0


CASES = {c.name: c for c in (
    # ExPhil's agents prefilling histories of up to a second of frames, Mamba-1 and Mamba-2 sized.
    Case("exphil-agents", "scan", 32, 1, 60, 512, 16),
    Case("ssd-exphil-agents", "ssd", 32, 1, 60, 8, 16, headdim=64),
    # Many short sequences: the per-call cost at its largest share.
    Case("many-short", "scan", 256, 1, 8, 512, 16),
    # A few long ones: the per-call cost at its smallest.
    Case("1x768-4-long", "scan", 4, 200, 300, 768, 16),
    Case("tiny", "scan", 5, 1, 9, 24, 4),  # seconds in all: the end-to-end test's
)}
DEFAULT_CASES = ("exphil-agents", "ssd-exphil-agents", "many-short", "1x768-4-long")


def lengths_of(case: Case, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(case.shortest, case.longest + 1, (case.sequences,), generator=g).tolist()


def inputs_of(case: Case, batch: int, seq: int, seed: int) -> dict:
    """A scan's inputs [batch, seq, ...] with ExPhil's math (dt clamped)."""
    g = torch.Generator().manual_seed(seed)
    if case.kind == "ssd":
        x_shape, dt_shape = (batch, seq, case.dim, case.headdim), (batch, seq, case.dim)
        A = -torch.rand(case.dim, generator=g) - 0.5
    else:
        x_shape = dt_shape = (batch, seq, case.dim)
        A = -torch.rand(case.dim, case.state, generator=g) - 0.5
    bc = (batch, seq, 1, case.state)
    return dict(x=torch.randn(x_shape, generator=g), dt=torch.rand(dt_shape, generator=g) * 0.1, A=A,
                B=torch.randn(bc, generator=g), C=torch.randn(bc, generator=g), **DT_CLAMP)


def state_shape(case: Case) -> tuple[int, ...]:
    return (case.dim, case.headdim, case.state) if case.kind == "ssd" else (case.dim, case.state)


def run_case(case: Case, reps: int) -> dict:
    lengths = lengths_of(case)
    bounds = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    bounds[1:] = torch.cumsum(torch.tensor(lengths), 0)
    total = int(bounds[-1])
    packed = inputs_of(case, 1, total, seed=1)
    padded = inputs_of(case, len(lengths), max(lengths), seed=2)
    h0 = torch.randn(len(lengths), *state_shape(case), generator=torch.Generator().manual_seed(3))
    ssd = case.kind == "ssd"
    scan = scan_kernels.ssd_scan if ssd else scan_kernels.selective_scan
    cpu = scan_kernels._registry.get_backend("cpu", "cpu")
    backend_scan = cpu.ssd_scan if ssd else cpu.scan

    def one_call():
        return scan(**packed, h0=h0, return_state=True, cu_seqlens=bounds, backend="cpu")

    def per_sequence():
        # scan_kernels/_varlen.py's split, as scan_kernels.selective_scan / ssd_scan run it for a backend
        # that does not pack: the call checked once, then one backend call a sequence.
        a = (_args.check_ssd_scan if ssd else _args.check_scan)(**packed, return_state=True)
        kw = a.backend_kwargs()

        def one(x, dt, B, C, z, h0_row, return_state):
            return backend_scan(x, dt, a.A, B, C, **{**kw, "z": z, "h0": h0_row, "return_state": return_state})

        return _varlen.run_packed(one, a, seq_axis=1, bc_axis=1, h0=h0, cu_seqlens=bounds,
                                  state_shape=state_shape(case), state_meaning="state")

    def padded_call():
        return scan(**padded, h0=h0, return_state=True, backend="cpu")

    dy = torch.randn(packed["x"].shape, generator=torch.Generator().manual_seed(4))
    gradients = scan_kernels.ssd_scan_backward if ssd else scan_kernels.selective_scan_backward
    backend_backward = cpu.ssd_scan_backward if ssd else cpu.scan_backward

    def backward_one_call():
        return gradients(dy, **packed, h0=h0, cu_seqlens=bounds, backend="cpu")

    def backward_per_sequence():
        a = (_args.check_ssd_scan if ssd else _args.check_scan)(**packed)
        options = dict(D=a.D, dt_bias=a.dt_bias, dt_softplus=a.dt_softplus, dt_min=a.dt_min, dt_max=a.dt_max,
                       **({"chunk_size": None} if ssd else {"layout": "bld"}))

        def one(dy, x, dt, B, C, z, h0_row, dstate):
            return backend_backward(dy, x, dt, a.A, B, C, z=z, h0=h0_row, dstate=dstate, **options)

        return _varlen.run_packed_backward(one, a, dy, h0=h0, dstate=None, cu_seqlens=bounds, seq_axis=1, bc_axis=1,
                                           state_shape=state_shape(case), state_meaning="state")

    (y_one, state_one), (y_split, state_split) = one_call(), per_sequence()
    difference = max(float((y_one - y_split).abs().max()), float((state_one - state_split).abs().max()))
    grads_one, grads_split = backward_one_call(), backward_per_sequence()
    # Relative: dA and dB sum over many terms, in another order across the seats of one call.
    gradient_difference = max(float((grads_one[k] - grads_split[k]).abs().max() / grads_split[k].abs().max())
                              for k in grads_split if grads_split[k] is not None)
    one_ms, split_ms, padded_ms, backward_ms, backward_split_ms = alternated_medians_ms(
        (one_call, per_sequence, padded_call, backward_one_call, backward_per_sequence), reps)
    ratios = {"per_sequence_over_packed": split_ms / one_ms, "padded_over_packed": padded_ms / one_ms,
              "backward_per_sequence_over_packed": backward_split_ms / backward_ms}
    print(f"  {case.name:>18}: {len(lengths)} sequences of {case.shortest}-{case.longest} steps ({total} in all): "
          f"packed {one_ms:.3f} ms, per sequence {split_ms:.3f} ms ({ratios['per_sequence_over_packed']:.2f}x), "
          f"padded to {max(lengths)} {padded_ms:.3f} ms ({ratios['padded_over_packed']:.2f}x); "
          f"backward packed {backward_ms:.3f} ms, per sequence {backward_split_ms:.3f} ms "
          f"({ratios['backward_per_sequence_over_packed']:.2f}x); outputs differ by {difference:.3g}, "
          f"gradients by {gradient_difference:.3g} of their largest")
    return {"case": asdict(case), "lengths": lengths, "steps": total, "packed_ms": one_ms,
            "per_sequence_ms": split_ms, "padded_ms": padded_ms, "backward_packed_ms": backward_ms,
            "backward_per_sequence_ms": backward_split_ms, "ratios": ratios, "max_abs_difference": difference,
            "max_gradient_difference": gradient_difference}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default=",".join(DEFAULT_CASES), help=f"comma-separated, of {', '.join(CASES)}")
    p.add_argument("--reps", type=positive_count, default=30)
    p.add_argument("--json", type=output_path)
    args = p.parse_args(argv)
    unknown = [name for name in args.cases.split(",") if name not in CASES]
    if unknown:
        p.error(f"--cases: expected names from {', '.join(CASES)}, got {', '.join(map(repr, unknown))}")
    if "cpu" not in scan_kernels.available_backends():
        raise SystemExit(f"the cpu backend is unavailable: {scan_kernels.unavailable_backends().get('cpu')}")
    load_before = os.getloadavg()
    cases = [run_case(CASES[name], args.reps) for name in args.cases.split(",")]
    if args.json:
        write_results(args.json, "varlen", {
            "cases": cases, "simd": scan_kernels.backend_details().get("cpu", {}).get("simd"),
            "load_before": load_before, "load_after": os.getloadavg(), "torch_threads": torch.get_num_threads()})
    return 0


if __name__ == "__main__":
    from bridge.bench import exit_on_stop_signals

    exit_on_stop_signals()
    raise SystemExit(main())
