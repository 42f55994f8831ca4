"""The ExPhil request (32×60×512×16 f32) over stdio from PortClient, against the physical floor.

Measures, interleaved in one run:
  * server: PortClient → `python -m bridge` → reply; round trip and the server's timing split;
  * floor:  the same request bytes through the same kind of pipes to a C program that reads the
            frame and answers with a frame of the reply's size (bench/echo/pipe_echo.c).
Reports the bridge cost — round trip − kernel_us, i.e. decode, copies, queueing, encode and
transport — as a ratio to the floor's round trip. Goal (issue 2): ≤ 1.3×.

    python -m bench.roundtrip [--iterations 40] [--json bench/results/roundtrip-stdio.json]
"""

from __future__ import annotations

import argparse
import statistics
import time

import protocol
from bridge.bench.cases import EXPHIL_SEQ, Case
from bridge.client import PortClient

from .floors import SETTLE_SECONDS, encode_request, frame_bytes, open_floor
from .machine import summarize_us, write_results


def exphil_inputs(seed: int = 0) -> dict:
    """ExPhil's window (32×60×512×16 f32): the sweep's own case, so both benches send the same."""
    return Case("scan", EXPHIL_SEQ).inputs(seed)


def summarize(values: list[float]) -> dict:
    """The round-trip benches' summary: the quieter fifth (p20) beside p50, p80 and p90."""
    return summarize_us(values, (20, 50, 80, 90))


def run(iterations: int, server_args: list[str]) -> dict:
    inputs = exphil_inputs()
    with PortClient(["--device", "cpu", *server_args]) as client:
        first = client.scan(**inputs)
        first.unwrap()
        reply_frame = first.bytes_in
        request_parts = protocol.frame_parts(encode_request(1, "scan", inputs))
        request_frame = frame_bytes(request_parts)
        echo = open_floor("stdio", [reply_frame - protocol.framing.HEADER_SIZE])
        rows = {"round_trip": [], "bridge_cost": [], "echo": [], "ipc": []}
        stages = {}
        for i in range(iterations + 3):
            time.sleep(SETTLE_SECONDS)
            echo_us = echo.round_trip_us(request_parts)
            time.sleep(SETTLE_SECONDS)
            reply = client.scan(**inputs)
            reply.unwrap()
            if i < 3:  # warm-up: page faults, first-call allocations
                continue
            t = reply.timing
            rows["round_trip"].append(reply.round_trip_us)
            rows["bridge_cost"].append(reply.round_trip_us - t["kernel_us"])
            rows["echo"].append(echo_us)
            rows["ipc"].append(reply.ipc_us)
            for key in [k for k in t if k.endswith("_us")] + ["client_encode_us", "client_decode_us"]:
                value = t.get(key, getattr(reply, key, None))
                if isinstance(value, (int, float)):
                    stages.setdefault(key, []).append(value)
        echo.close()
        backend = client.info()["backend"]
    summary = {k: summarize(v) for k, v in rows.items()}
    return {
        "case": "exphil 32x60x512x16 f32, stdio (PortClient)",
        "backend": backend,
        "iterations": iterations,
        "request_frame_bytes": request_frame,
        "reply_frame_bytes": reply_frame,
        "round_trip": summary["round_trip"],
        "bridge_cost": summary["bridge_cost"],
        "echo_floor": summary["echo"],
        "ipc": summary["ipc"],
        "stages_p50_us": {k: statistics.median(v) for k, v in stages.items()},
        "bridge_cost_over_floor": summary["bridge_cost"]["p50_us"] / summary["echo"]["p50_us"],
        "goal_bridge_cost_over_floor": 1.3,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iterations", type=int, default=40)
    p.add_argument("--json", help="write results (with machine and commit info) to this file")
    p.add_argument("--server-arg", action="append", default=[], help="extra argument for the server")
    args = p.parse_args(argv)
    result = run(args.iterations, args.server_arg)
    r = result
    print(f"{r['case']}  backend={r['backend']}  request {r['request_frame_bytes']/1e6:.2f} MB, "
          f"reply {r['reply_frame_bytes']/1e6:.2f} MB, {r['iterations']} iterations (medians, p20–p80)")
    for name in ("round_trip", "bridge_cost", "echo_floor", "ipc"):
        s = r[name]
        print(f"  {name:<12} {s['p50_us']/1000:8.2f} ms   ({s['p20_us']/1000:.2f}–{s['p80_us']/1000:.2f})")
    print("  stages p50:  " + "  ".join(f"{k}={v/1000:.2f}ms" for k, v in r["stages_p50_us"].items()))
    print(f"  bridge cost / echo floor = {r['bridge_cost_over_floor']:.2f}×  (goal ≤ {r['goal_bridge_cost_over_floor']}×)")
    if args.json:
        write_results(args.json, "roundtrip-stdio", {"results": [result]})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
