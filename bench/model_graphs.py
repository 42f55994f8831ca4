"""Captured model steps on a GPU (issue 34): `model_step` over the Port to a server on CUDA that
replays a capture of the whole stack (bridge.models.graphs) against one that composes every step
(`--no-cuda-graphs`), in one run, on bench.models' ExPhil-sized models (embeddings in, hidden
out) at batch 1 and 32.

Both servers load the same weights, prefill the same 60-frame window, then take the same frames
in rounds that alternate between them, a round a server's frames back to back (not paced: the
comparison is of each step's own work, most of it on the host). Per (arch, batch): each
server's round trip, server_us and kernel_us (p50, p99), the ratio of the composed step's
p50 to the captured one's, and the largest difference between the two servers' outputs over
their largest output, and each server's against transformers' own forward of the same window
and frames in this process on the CPU (with any NaN counted).

    python -m bench.model_graphs [--rounds 6] [--frames 40] [--batches 1,32] [--device cuda] [--json FILE]
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from bridge.bench.floors import BridgeProcess, encode_request, exchange
from bridge.bench.machine import output_path, positive_count, summarize_us, write_results
from bridge.client import result_from_wire

from .models import D_MODEL, WINDOW, archs_arg, batches_arg, exphil_model

SERVERS = {"captured": [], "composed": ["--no-cuda-graphs"]}


def oracle(model, window: torch.Tensor, frames: list[torch.Tensor]) -> np.ndarray:
    """transformers' own outputs for the frames after the window, in this process on the CPU."""
    with torch.no_grad():
        hidden = model(inputs_embeds=torch.cat([window, torch.stack(frames, dim=1)], dim=1)).last_hidden_state
    return hidden[:, window.shape[1]:].transpose(0, 1).numpy()


def run_case(bridges: dict, arch: str, batch: int, rounds: int, frames_n: int) -> dict:
    model, config, weights = exphil_model(arch, seed=batch)
    g = torch.Generator().manual_seed(11)
    window = torch.randn(batch, WINDOW, D_MODEL, generator=g)
    frames = [torch.randn(batch, D_MODEL, generator=g) for _ in range(rounds * frames_n)]
    sessions, requests, prefill_nan = {}, {}, {}
    for name, bridge in bridges.items():
        loaded = bridge.call("model_load", config=config, weights=weights)["model"]
        sessions[name] = bridge.call("session_open", model=loaded, batch=batch)["session"]
        prefilled = bridge.call("model_forward", session=sessions[name], embeds=window, output="hidden",
                                last_only=True)
        prefill_nan[name] = int(np.isnan(np.asarray(result_from_wire(prefilled)["hidden"])).sum())
        requests[name] = [bridge.lane.frame(encode_request(i, "model_step", {
            "session": sessions[name], "embeds": f, "output": "hidden"})) for i, f in enumerate(frames)]
    times = {name: {"round_trip": [], "server": [], "kernel": []} for name in bridges}
    outputs = {name: [] for name in bridges}
    for r in range(rounds):
        order = list(bridges) if r % 2 == 0 else list(bridges)[::-1]
        for name in order:
            for request in requests[name][r * frames_n:(r + 1) * frames_n]:
                us, reply = exchange(bridges[name].lane, request, f"{name} model_step")
                times[name]["round_trip"].append(us)
                times[name]["server"].append(reply.timing.get("server_us", 0.0))
                times[name]["kernel"].append(reply.timing.get("kernel_us", 0.0))
                # A copy: the decoded tensor is a view of the lane's buffer, which the next reply fills.
                outputs[name].append(np.array(result_from_wire(reply.result)["hidden"]))
    # The first round of each warms (captures, compiles): the rest are reported.
    skip = frames_n
    result = {"arch": arch, "batch": batch, "rounds": rounds, "frames_a_round": frames_n}
    for name in bridges:
        result[name] = {stage: summarize_us(values[skip:]) for stage, values in times[name].items()}
    result["composed_over_captured"] = {
        stage: result["composed"][stage]["p50_us"] / result["captured"][stage]["p50_us"]
        for stage in ("round_trip", "server", "kernel")}
    captured, composed = np.stack(outputs["captured"]), np.stack(outputs["composed"])
    result["max_rel_diff"] = float(np.abs(captured - composed).max() / max(np.abs(composed).max(), 1e-30))
    want = oracle(model, window, frames)
    scale = float(np.abs(want).max())
    result["against_transformers_cpu"] = {
        name: {"max_rel_err": float(np.abs(got - want).max() / scale), "prefill_nan": prefill_nan[name],
               "nan_frames": int(np.isnan(got).any(axis=(1, 2)).sum()),
               "first_nan_frame": int(np.argmax(np.isnan(got).any(axis=(1, 2)))) if np.isnan(got).any() else None}
        for name, got in (("captured", captured), ("composed", composed))}
    return result


def report(r: dict) -> None:
    c, e = r["captured"], r["composed"]
    print(f"{r['arch']:7s} batch {r['batch']:3d}: round trip p50 {c['round_trip']['p50_us']:8.1f} µs captured, "
          f"{e['round_trip']['p50_us']:8.1f} composed ({r['composed_over_captured']['round_trip']:.2f}x); "
          f"server {c['server']['p50_us']:.1f} / {e['server']['p50_us']:.1f} µs; p99 "
          f"{c['round_trip']['p99_us']:.1f} / {e['round_trip']['p99_us']:.1f}; outputs within "
          f"{r['max_rel_diff']:.2e}; against transformers on the CPU {r['against_transformers_cpu']}", flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.model_graphs", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--frames", type=positive_count, default=40, help="frames a round")
    p.add_argument("--batches", type=batches_arg, default="1,32")
    p.add_argument("--archs", type=archs_arg, default="mamba,mamba2")
    p.add_argument("--device", default="cuda", help="cpu: the same plumbing with nothing captured, a check "
                   "of this script")
    p.add_argument("--json", type=output_path)
    args = p.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error(f"--device {args.device}: no CUDA device here (--device cpu checks the plumbing)")
    if args.rounds < 2:
        p.error(f"--rounds: expected at least 2 (the first warms), got {args.rounds}")
    bridges = {name: BridgeProcess(server_args, device=args.device) for name, server_args in SERVERS.items()}
    try:
        info = {name: bridge.call("info") for name, bridge in bridges.items()}
        cases = []
        for arch in args.archs:
            for batch in args.batches:
                cases.append(run_case(bridges, arch, batch, args.rounds, args.frames))
                report(cases[-1])
        captured = bridges["captured"].call("info")["cuda_graphs"]
    finally:
        for bridge in bridges.values():
            bridge.close()
    if args.json:
        write_results(args.json, "model-graphs", {
            "servers": SERVERS, "backend": info["captured"]["backend"], "cuda_graphs": captured, "cases": cases})
    return 0


if __name__ == "__main__":
    from bridge.bench import exit_on_stop_signals

    exit_on_stop_signals()
    raise SystemExit(main())
