"""Mamba-2 session steps over stdio: the native step path against `--no-native-step`.

A Mamba-2 ("ssd") session of 32 rows x 8 heads x 64 headdim, state 16 (ExPhil's batch of
agents at bench.kernels' ssd-step-exphil size), stepped as a Mamba-2 block calls the update: x,
z [32, 8, 64], dt [32, 8] through dt_bias and softplus, B, C [32, 1, 16]; A, D and dt_bias
uploaded once as handles. Per server: `--steps` steps paced as a 60 FPS loop (a frame's lone
step), with a C pipe echo of the same bytes half a frame later (bench.game_loop's method: what
moving the bytes alone costs), then as many back to back. The two servers take turns for
`--rounds` rounds, a fresh process each; the medians over the rounds are compared.

    python -m bench.ssd_step [--steps 300] [--rounds 3] [--json bench/results/ssd_step_ab.json]
"""

from __future__ import annotations

import argparse
import statistics
import sys

import numpy as np

import protocol
from bench.game_loop import WARMUP, open_step_echo, paced_exchanges
from bridge.bench.floors import BridgeProcess, encode_request, exchange
from bridge.bench.machine import output_path, positive_count, summarize_us, write_results

ROWS, HEADS, HEADDIM, STATE = 32, 8, 64, 16
MODES = {"native": [], "general": ["--no-native-step"]}


def frame_inputs(rng: np.random.Generator) -> dict:
    def rand(*shape, lo=-1.0, hi=1.0):
        return rng.uniform(lo, hi, shape).astype(np.float32)

    return {"x": rand(ROWS, HEADS, HEADDIM), "z": rand(ROWS, HEADS, HEADDIM), "dt": rand(ROWS, HEADS, lo=-4.0, hi=-2.0),
            "B": rand(ROWS, 1, STATE), "C": rand(ROWS, 1, STATE)}


def constants(rng: np.random.Generator) -> dict:
    return {"A": -rng.uniform(1.0, 16.0, HEADS).astype(np.float32), "D": np.ones(HEADS, np.float32),
            "dt_bias": rng.uniform(-2.5, -0.5, HEADS).astype(np.float32)}


def run(mode: str, steps: int) -> dict:
    rng = np.random.default_rng(0)
    consts = constants(rng)
    frames = [frame_inputs(rng) for _ in range(16)]  # cycled; content does not matter
    bridge = BridgeProcess(MODES[mode])
    lane = bridge.lane
    try:
        shared = {name: protocol.HandleRef(bridge.call("put", tensor=t)["handle"]) for name, t in consts.items()}
        session = bridge.call("session_open", kind="ssd", batch=ROWS, heads=HEADS, headdim=HEADDIM,
                              state=STATE)["session"]
        step_frames = [lane.frame(encode_request(i, "step", {"session": session, **shared, "dt_softplus": True, **f}))
                       for i, f in enumerate(frames)]
        for i in range(WARMUP):
            exchange(lane, step_frames[i % len(step_frames)])
        echo, echo_missing = open_step_echo(lane.reply_sizes(), step_frames)
        paced, paced_timing, echo_rows = paced_exchanges(lane, step_frames, steps, echo)
        back_to_back = [exchange(lane, step_frames[i % len(step_frames)])[0] for i in range(steps)]
        native = bridge.call("stats")["ops"]["step"]["h2d_us"] == 0
    finally:
        bridge.close()
    return {"mode": mode, "served_natively": native, "paced": summarize_us(paced),
            "paced_stages_p50_us": {k: statistics.median(t[k] for t in paced_timing)
                                    for k in paced_timing[0] if k.endswith("_us")},
            "echo": summarize_us(echo_rows) if echo is not None else {"skipped": echo_missing},
            "back_to_back": summarize_us(back_to_back)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=positive_count, default=300)
    p.add_argument("--rounds", type=positive_count, default=3)
    p.add_argument("--json", type=output_path, help="write the results (with machine and commit info) to this file")
    args = p.parse_args(argv)
    runs = {mode: [] for mode in MODES}
    for round_index in range(args.rounds):
        order = list(MODES) if round_index % 2 == 0 else list(reversed(MODES))
        for mode in order:
            runs[mode].append(run(mode, args.steps))
            r = runs[mode][-1]
            print(f"round {round_index + 1} {mode:8s} paced p50 {r['paced']['p50_us']:8.1f} us  "
                  f"p99 {r['paced']['p99_us']:8.1f} us  back to back p50 {r['back_to_back']['p50_us']:8.1f} us",
                  flush=True)

    def median(mode, *path):
        values = []
        for r in runs[mode]:
            for key in path:
                r = r[key]
            values.append(r)
        return statistics.median(values)

    summary = {mode: {"paced_p50_us": median(mode, "paced", "p50_us"), "paced_p99_us": median(mode, "paced", "p99_us"),
                      "back_to_back_p50_us": median(mode, "back_to_back", "p50_us")} for mode in MODES}
    echoes = [r["echo"]["p50_us"] for mode in MODES for r in runs[mode] if "p50_us" in r["echo"]]
    summary["echo_p50_us"] = statistics.median(echoes) if echoes else None
    summary["general_over_native_paced_p50"] = summary["general"]["paced_p50_us"] / summary["native"]["paced_p50_us"]
    summary["general_over_native_back_to_back_p50"] = (summary["general"]["back_to_back_p50_us"]
                                                       / summary["native"]["back_to_back_p50_us"])
    if summary["echo_p50_us"]:
        summary["native_paced_p50_over_echo"] = summary["native"]["paced_p50_us"] / summary["echo_p50_us"]
    print({k: (round(v, 2) if isinstance(v, float) else v) for k, v in summary.items()})
    if args.json:
        write_results(args.json, "ssd-step-ab", {
            "case": f"Mamba-2 session {ROWS} x {HEADS} heads x {HEADDIM} headdim, state {STATE}, over stdio; "
                    f"{args.steps} paced steps (60 FPS) and {args.steps} back to back per server, "
                    f"{args.rounds} alternated rounds",
            "command": " ".join(["python -m bench.ssd_step", *(sys.argv[1:] if argv is None else argv)]),
            "summary": summary, "runs": runs})
    return 0


if __name__ == "__main__":
    from bridge.bench import exit_on_stop_signals

    exit_on_stop_signals()
    raise SystemExit(main())
