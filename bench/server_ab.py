"""Two checkouts' servers against each other, in one run: does a change to the serving path
cost time? (Issue 31's check of its one serving pipeline against the server before it.)

The server of `--baseline` (another checkout of this project, e.g. a `git worktree` of the
commit before the change) and this checkout's take turns in blocks (A B, then B A, ...), each a
fresh `python -m bridge` over stdio, driven by the same lean client (bridge.bench.floors' StreamLane).
Per block and server:
  * the ExPhil request (32×60×512×16 f32 scan), each after the settle pause: bridge cost =
    round trip − kernel_us, as bench.transports reports it;
  * the paced game loop's step (a 32×512×16 session, A a handle, one step per 60 FPS frame):
    round trip p50, as bench.game_loop part (a) reports it;
  * with `--model-steps N`, apart from the blocks, N paced frames of bench.models' ExPhil-sized
    models (embeddings in, hidden out) for each of `--model-step-cases` (arch:batch; the Mamba-2
    model at batch 1 by default), both servers up at once and each frame stepping both, a third
    of a frame apart, the order swapped every frame (a paced step's time drifts with the box
    within seconds, more than a change moves it): round trip p50 and p99; with
    `--rollback-frames K`, each frame a rollback instead (`session_restore` of a snapshot with
    K frames re-simulated as one `model_forward`, the last position out);
  * with `--windows N`, N `model_forward` calls back to back (embeddings in, the last position's
    hidden state out) at each of WINDOW_CASES (batch, window length) on sessions of that model
    and of its Mamba-1 twin: p50;
  * with `--snapshots N`, N snapshot + restore pairs (two round trips, back to back) on a batch-1
    session of that model and of its Mamba-1 twin, as bench.models times them: the pair's round
    trips and the server's time for it (the two replies' `server_us`), p50.
Reports each figure's median over the blocks per server, and this checkout's over the
baseline's; the goal is each within 5 %.

    python -m bench.server_ab --baseline ../base-checkout [--blocks 6] [--model-steps 0]
                              [--model-step-cases mamba2:1,mamba:32] [--rollback-frames 0]
                              [--snapshots 0] [--windows 0] [--json PATH]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import protocol
from bridge.bench.cases import BATCH, DIM, STATE
from bridge.bench.floors import StreamLane, encode_request, exchange, lane_call
from bridge.bench.machine import commit_info, output_path, summarize_us, write_results
from bridge.client import stop_piped_server

from .game_loop import WARMUP, constant_A, frame_inputs, step_request, wait_for_frame
from .transports import SETTLE_SECONDS, exphil_inputs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The most a figure of this checkout may exceed the baseline's by.
GOAL_RATIO = 1.05
# The frames a paced model-step case cycles through: a rollback re-simulates at most all of them.
ROLLBACK_FRAMES_MAX = 32


class TreeServer:
    """`python -m bridge` of the checkout at `tree`, on pipes."""

    def __init__(self, tree: str, server_args: list[str]):
        env = {**os.environ, "PYTHONPATH": tree}
        self.proc = subprocess.Popen([sys.executable, "-m", "bridge", "--device", "cpu", "--log-level", "warning",
                                      *server_args],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, bufsize=0, cwd=tree)
        self.lane = StreamLane(self.proc.stdout, self.proc.stdin.fileno())

    def call(self, op: str, **args) -> dict:
        return lane_call(self.lane, op, args)

    def close(self) -> None:
        stop_piped_server(self.proc)
        self.proc.stdout.close()


def exphil_bridge_cost(server: TreeServer, iterations: int) -> list[float]:
    request = protocol.frame_parts(encode_request(1, "scan", exphil_inputs()))
    for _ in range(3):
        exchange(server.lane, request, "scan")
    costs = []
    for _ in range(iterations):
        time.sleep(SETTLE_SECONDS)
        us, reply = exchange(server.lane, request, "scan")
        costs.append(us - reply.timing["kernel_us"])
    return costs


def paced_steps(server: TreeServer, steps: int) -> list[float]:
    handle = protocol.HandleRef(server.call("put", tensor=constant_A(0))["handle"])
    session = server.call("session_open", batch=BATCH, dim=DIM, state=STATE)["session"]
    frames = [server.lane.frame(step_request(i, session, handle, frame_inputs(BATCH, 1 + i))) for i in range(32)]
    return paced_round_trips(server, frames, steps)


def paced_round_trips(server: TreeServer, frames: list, steps: int) -> list[float]:
    """`steps` round trips of `frames` (cycled) after the warm-up, one a 60 FPS frame (µs)."""
    for i in range(WARMUP):
        exchange(server.lane, frames[i % len(frames)])
    rows = []
    start = time.perf_counter()
    for i in range(steps):
        wait_for_frame(start, i)
        rows.append(exchange(server.lane, frames[i % len(frames)])[0])
    return rows


def interleaved_model_steps(trees: dict, server_args: list[str], frames_n: int, arch: str,
                            batch: int, rollback: int = 0) -> dict[str, list[float]]:
    """Round trips (µs) of `frames_n` paced frames of the `arch` model at `batch` rows on each
    tree's server, both stepped every frame (after a warm-up), a third of a frame apart, the
    order swapped every frame; with `rollback` frames, each a rollback of that many."""
    import torch

    from .models import D_MODEL, exphil_model, paced_in_turns

    _, config, weights = exphil_model(arch, seed=1)
    g = torch.Generator().manual_seed(7)
    embeds = [torch.randn(batch, D_MODEL, generator=g) for _ in range(ROLLBACK_FRAMES_MAX)]
    servers = {name: TreeServer(tree, server_args) for name, tree in trees.items()}
    try:
        requests = {}
        for name, server in servers.items():
            model = server.call("model_load", config=config, weights=weights)["model"]
            session = server.call("session_open", model=model, batch=batch)["session"]
            if rollback:
                snapshot = server.call("session_snapshot", session=session)["snapshot"]
                window = torch.stack(embeds[:rollback], dim=1)
                requests[name] = [server.lane.frame(encode_request(i, "session_restore", {
                    "session": session, "snapshot": snapshot, "frames": [{"op": "model_forward", "args": {
                        "embeds": window.roll(i, dims=1), "output": "hidden", "last_only": True}}]}))
                    for i in range(len(embeds))]
            else:
                requests[name] = [server.lane.frame(encode_request(i, "model_step", {
                    "session": session, "output": "hidden", "embeds": e})) for i, e in enumerate(embeds)]
        verb = "session_restore" if rollback else "model_step"

        def round_trip(name: str):
            return lambda i: exchange(servers[name].lane, requests[name][i % len(embeds)], verb)[0]

        return paced_in_turns({name: round_trip(name) for name in servers}, frames_n, WARMUP, apart=1 / 3)
    finally:
        for server in servers.values():
            server.close()


def model_step_cases(text: str) -> list[tuple[str, int]]:
    """`--model-step-cases`: "arch:batch,..." -> [(arch, batch)]."""
    cases = []
    for item in text.split(","):
        arch, _, batch = item.partition(":")
        if arch not in MODEL_ARCHS or not batch.isdigit() or int(batch) < 1:
            raise argparse.ArgumentTypeError(f"expected arch:batch with arch one of {MODEL_ARCHS} and batch >= 1, "
                                             f"got {item!r}")
        cases.append((arch, int(batch)))
    return cases


def model_session_pairs(server: TreeServer, arch: str, pairs: int) -> tuple[list[float], list[float]]:
    """`pairs` snapshot + restore pairs (bench.models.snapshot_restore_pairs) on a batch-1 session
    of bench.models' ExPhil-sized `arch` model, after a warm-up."""
    from .models import exphil_model, snapshot_restore_pairs

    _, config, weights = exphil_model(arch, seed=1)
    model = server.call("model_load", config=config, weights=weights)["model"]
    session = server.call("session_open", model=model, batch=1)["session"]
    return snapshot_restore_pairs(server.lane, session, pairs, warmup=WARMUP)


MODEL_ARCHS = ("mamba", "mamba2")
# (batch, length) of the windows `--windows` times: a rollback's re-simulation, the 60-frame
# window a session warms up from.
WINDOW_CASES = ((1, 7), (1, 60), (32, 7), (32, 60))


def window_forwards(server: TreeServer, arch: str, calls: int) -> dict[str, list[float]]:
    """`calls` model_forward round trips at each of WINDOW_CASES on bench.models' ExPhil-sized
    `arch` model, after a warm-up of 3, by "b<batch>_l<length>" (µs)."""
    import torch

    from .models import D_MODEL, exphil_model

    _, config, weights = exphil_model(arch, seed=1)
    model = server.call("model_load", config=config, weights=weights)["model"]
    g = torch.Generator().manual_seed(7)
    times = {}
    for batch, length in WINDOW_CASES:
        session = server.call("session_open", model=model, batch=batch)["session"]
        request = server.lane.frame(encode_request("w", "model_forward", {
            "session": session, "embeds": torch.randn(batch, length, D_MODEL, generator=g) * 0.1,
            "output": "hidden", "last_only": True}))
        rows = [exchange(server.lane, request)[0] for _ in range(3 + calls)]
        times[f"b{batch}_l{length}"] = rows[3:]
        server.call("session_close", session=session)
    return times


def run(baseline: str, blocks: int, iterations: int, steps: int, server_args: list[str],
        model_steps: int = 0, snapshots: int = 0, windows: int = 0,
        step_cases: list[tuple[str, int]] = (("mamba2", 1),), rollback: int = 0) -> dict:
    trees = {"baseline": os.path.abspath(baseline), "this": ROOT}
    per_block = {name: {"exphil_bridge_cost_p50_us": [], "step_p50_us": []} for name in trees}
    if snapshots:
        for figures in per_block.values():
            for arch in MODEL_ARCHS:
                figures[f"snapshot_restore_{arch}_p50_us"] = []
                figures[f"snapshot_restore_{arch}_server_p50_us"] = []
    if windows:
        for figures in per_block.values():
            for arch in MODEL_ARCHS:
                for batch, length in WINDOW_CASES:
                    figures[f"forward_{arch}_b{batch}_l{length}_p50_us"] = []
    for block in range(blocks):
        order = list(trees) if block % 2 == 0 else list(reversed(trees))
        for name in order:
            server = TreeServer(trees[name], server_args)
            try:
                cost = exphil_bridge_cost(server, iterations)
                step = paced_steps(server, steps)
                pairs = {arch: model_session_pairs(server, arch, snapshots) for arch in MODEL_ARCHS if snapshots}
                forwards = {arch: window_forwards(server, arch, windows) for arch in MODEL_ARCHS if windows}
            finally:
                server.close()
            per_block[name]["exphil_bridge_cost_p50_us"].append(statistics.median(cost))
            per_block[name]["step_p50_us"].append(statistics.median(step))
            line = (f"block {block + 1}/{blocks} {name:8s}: ExPhil bridge cost {statistics.median(cost):8.0f} µs, "
                    f"paced step p50 {statistics.median(step):6.0f} µs")
            for arch, (round_trips, server_us) in pairs.items():
                per_block[name][f"snapshot_restore_{arch}_p50_us"].append(statistics.median(round_trips))
                per_block[name][f"snapshot_restore_{arch}_server_p50_us"].append(statistics.median(server_us))
                line += (f", {arch} snapshot + restore p50 {statistics.median(round_trips):5.0f} µs "
                         f"(server {statistics.median(server_us):4.0f})")
            for arch, cases in forwards.items():
                for case, rows in cases.items():
                    per_block[name][f"forward_{arch}_{case}_p50_us"].append(statistics.median(rows))
                line += f", {arch} forwards " + " ".join(f"{case} {statistics.median(rows):5.0f}"
                                                          for case, rows in cases.items())
            print(line, flush=True)
    medians = {name: {key: statistics.median(values) for key, values in figures.items() if values}
               for name, figures in per_block.items()}
    model_step_spread = {}
    for arch, batch in step_cases if model_steps else ():
        times = interleaved_model_steps(trees, server_args, model_steps, arch, batch, rollback)
        key = f"rollback{rollback}_{arch}_b{batch}" if rollback else f"model_step_{arch}_b{batch}"
        model_step_spread[key] = {name: summarize_us(rows) for name, rows in times.items()}
        for name, rows in times.items():
            medians[name][f"{key}_p50_us"] = statistics.median(rows)
        print(f"paced {arch} {f'rollback of {rollback}' if rollback else 'model step'} at batch {batch}: " + ", ".join(
            f"{name} p50 {statistics.median(rows):6.0f} µs" for name, rows in times.items()), flush=True)
    ratios = {key: medians["this"][key] / medians["baseline"][key] for key in medians["this"]}
    return {
        "case": f"ExPhil scan 32x60x512x16 f32 ({iterations} a block, settle pause before each) and a paced "
                f"{BATCH}x{DIM}x{STATE} step ({steps} a block, one per 60 FPS frame), over stdio"
                + (f"; paced ExPhil-sized model {f'rollbacks of {rollback} frames' if rollback else 'steps'} "
                   f"({model_steps} frames a case, both servers stepped each frame) at (arch, batch) "
                   f"{list(step_cases)}" if model_steps else "")
                + (f"; model_forward back to back at (batch, length) {list(WINDOW_CASES)} on the ExPhil-sized "
                   f"Mamba-1 and Mamba-2 models, the last position's hidden state out ({windows} a case and "
                   f"block)" if windows else "")
                + (f"; snapshot + restore pairs back to back on batch-1 sessions of the ExPhil-sized Mamba-1 and "
                   f"Mamba-2 models ({snapshots} a block)" if snapshots else ""),
        "trees": {name: commit_info(tree) for name, tree in trees.items()},
        "blocks": blocks,
        "per_block": per_block,
        "spread": {name: {key: summarize_us(values, (50,)) for key, values in figures.items() if values}
                   for name, figures in per_block.items()},
        "model_steps": model_step_spread,
        "medians": medians,
        "this_over_baseline": ratios,
        "goal_ratio_at_most": GOAL_RATIO,
        "met": all(ratio <= GOAL_RATIO for ratio in ratios.values()),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline", required=True, help="the other checkout, whose server is the baseline")
    p.add_argument("--blocks", type=int, default=6, help="blocks of the ExPhil request and paced steps (0: none)")
    p.add_argument("--iterations", type=int, default=10, help="ExPhil requests a block")
    p.add_argument("--steps", type=int, default=200, help="paced steps a block")
    p.add_argument("--model-steps", type=int, default=0,
                   help="paced model step frames a case, both servers stepped each frame (0: none; needs "
                        "transformers to build the model)")
    p.add_argument("--model-step-cases", type=model_step_cases, default=[("mamba2", 1)],
                   help="arch:batch of the paced model steps, comma-separated (default mamba2:1)")
    p.add_argument("--rollback-frames", type=int, default=0,
                   help=f"with --model-steps, each frame a rollback re-simulating this many frames, at most "
                        f"{ROLLBACK_FRAMES_MAX} (0: a step)")
    p.add_argument("--snapshots", type=int, default=0,
                   help="snapshot + restore pairs a block and model (0: none; needs transformers to build the models)")
    p.add_argument("--windows", type=int, default=0,
                   help="model_forward calls a block, model and window case (0: none; needs transformers)")
    p.add_argument("--server-arg", action="append", default=[], help="extra argument for both servers")
    p.add_argument("--json", type=output_path, help="write the results (with machine and commit info) to this file")
    args = p.parse_args(argv)
    if not 0 <= args.rollback_frames <= ROLLBACK_FRAMES_MAX:
        p.error(f"--rollback-frames: expected 0 to {ROLLBACK_FRAMES_MAX}, got {args.rollback_frames}")
    if not os.path.isfile(os.path.join(args.baseline, "bridge", "__main__.py")):
        p.error(f"--baseline: expected a checkout of this project (with bridge/__main__.py), got {args.baseline!r}")
    results = run(args.baseline, args.blocks, args.iterations, args.steps, args.server_arg, args.model_steps,
                  args.snapshots, args.windows, args.model_step_cases, args.rollback_frames)
    for key, ratio in results["this_over_baseline"].items():
        print(f"{key}: baseline {results['medians']['baseline'][key]:.0f} µs, this {results['medians']['this'][key]:.0f} µs, "
              f"ratio {ratio:.3f} (goal ≤ {GOAL_RATIO})")
    if args.json:
        write_results(args.json, "server_ab", {**results, "server_args": args.server_arg})
    return 0


if __name__ == "__main__":
    from bridge.bench import exit_on_stop_signals

    exit_on_stop_signals()
    sys.exit(main())
