"""Two builds of the CPU backend's fused model step timed against each other in one process, as
bench.kernel_ab does for the kernels: the scan_kernels/cpu sources of a git revision (the base)
against those of the working tree (or another revision), on bench.models' ExPhil-sized models.

    python -m bench.model_step_ab [--base REV] [--other REV] [--archs mamba,mamba2]
                                  [--batches 1,32] [--frames 120] [--neighbour] [--json FILE]

Each (model, batch) is stepped in rounds that alternate the builds, the order swapped every
round; a step is timed alone, `--frames` of them per build, 1/60 s apart as a game loop's
frames are (the paced case the server serves: caches and helper threads gone cold between
frames), then `--frames` of them back to back. With `--neighbour` a process spins on one core
throughout, as a game or a busy-waiting BEAM scheduler on the same 2-core machine does. Both
builds step the same model from the same state and frames; the largest relative difference of
their outputs (over the largest output) is reported, so an A/B of builds that compute
different things shows it.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from bridge.bench.machine import output_path, summarize_us, write_results
from bridge.models import load_weights

from .kernel_ab import WORKING_TREE, RevisionError, load_builds
from .models import D_MODEL, FRAME_SECONDS, archs_arg, batches_arg, busy_neighbour, exphil_model

ROUNDS = 6  # alternations per (model, batch, pacing); --frames is split over them


def step_call(model, backend, batch: int):
    """A step of `model` on `backend`'s fused kernel over a state of its own: call(frame) ->
    hidden."""
    parts = {name: torch.zeros((batch, *shape)) for name, shape in model.config.state_parts()}
    slots = torch.arange(batch)
    fused = backend.model_step
    if fused is None:
        raise RevisionError("this build has no fused model step")

    def call(frame):
        with torch.no_grad():
            return model.step(parts, slots, frame, output="hidden", backend="cpu", fused=fused)

    return call


def time_pair(calls, frames, paced: bool) -> list[list[float]]:
    """Per build, each step's time (µs): len(frames) steps each, in ROUNDS alternated rounds."""
    times = [[] for _ in calls]
    per_round = max(1, len(frames) // ROUNDS)
    for r in range(ROUNDS):
        order = range(len(calls)) if r % 2 == 0 else reversed(range(len(calls)))
        for i in order:
            for frame in frames[r * per_round:(r + 1) * per_round]:
                if paced:
                    time.sleep(FRAME_SECONDS)
                t0 = time.perf_counter_ns()
                calls[i](frame)
                times[i].append((time.perf_counter_ns() - t0) / 1e3)
    return times


def run_case(arch: str, batch: int, frames_n: int, backends) -> dict:
    _, config, weights = exphil_model(arch, seed=batch)
    model = load_weights(config, weights, torch.float32, torch.device("cpu"), lambda n: None)
    g = torch.Generator().manual_seed(7)
    frames = [torch.randn(batch, D_MODEL, generator=g) for _ in range(frames_n)]
    steps = [step_call(model, b, batch) for b in backends]
    outputs = [[call(f) for f in frames[:8]] for call in steps]  # also the warm-up
    difference = 0.0
    for a, b in zip(*outputs):
        difference = max(difference, float((a - b).abs().max() / torch.maximum(a.abs().max(), b.abs().max())))
    result = {"arch": arch, "batch": batch, "max_relative_difference": difference}
    for pacing, paced in (("paced", True), ("back_to_back", False)):
        base, other = time_pair(steps, frames, paced)
        result[pacing] = {"base": summarize_us(base), "other": summarize_us(other)}
        result[pacing]["ratio_p50"] = result[pacing]["base"]["p50_us"] / result[pacing]["other"]["p50_us"]
        result[pacing]["ratio_p99"] = result[pacing]["base"]["p99_us"] / result[pacing]["other"]["p99_us"]
    return result


def report(r: dict) -> None:
    for pacing in ("paced", "back_to_back"):
        s = r[pacing]
        print(f"{r['arch']} batch {r['batch']}, {pacing.replace('_', ' ')}: base p50 {s['base']['p50_us']:.0f} µs "
              f"(p99 {s['base']['p99_us']:.0f}), other p50 {s['other']['p50_us']:.0f} µs (p99 {s['other']['p99_us']:.0f}); "
              f"base/other p50 {s['ratio_p50']:.2f}, p99 {s['ratio_p99']:.2f}; outputs differ by "
              f"{r['max_relative_difference']:.2g} at most (of their largest)", flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", default="HEAD", help="git revision of the base build (default HEAD)")
    p.add_argument("--other", default=WORKING_TREE, help="git revision of the other build (default: the working tree)")
    p.add_argument("--archs", type=archs_arg, default="mamba,mamba2")
    p.add_argument("--batches", type=batches_arg, default="1,32")
    p.add_argument("--frames", type=int, default=120, help="steps per build and pacing (default 120)")
    p.add_argument("--neighbour", action="store_true", help="keep one core busy with another process throughout")
    p.add_argument("--json", type=output_path, help="write results with machine and commit info to this file")
    args = p.parse_args(argv)
    if args.frames < ROUNDS:
        p.error(f"--frames: expected at least {ROUNDS} (one a round), got {args.frames}")
    cases = []
    try:
        (base, base_commit), (other, other_commit) = load_builds(args.base, args.other)
        with busy_neighbour(args.neighbour):
            for arch in args.archs:
                for batch in args.batches:
                    cases.append(run_case(arch, batch, args.frames, (base, other)))
                    report(cases[-1])
    except RevisionError as exc:
        print(f"bench.model_step_ab: {exc}", file=sys.stderr)
        return 2
    if args.json:
        write_results(args.json, "model-step-ab", {
            "base": {"revision": args.base, "commit": base_commit, "details": base.details},
            "other": {"revision": args.other, "commit": other_commit, "details": other.details},
            "neighbour": args.neighbour, "torch_threads": torch.get_num_threads(), "cases": cases})
    return 0


if __name__ == "__main__":
    from bridge.bench import exit_on_stop_signals

    exit_on_stop_signals()
    raise SystemExit(main())
