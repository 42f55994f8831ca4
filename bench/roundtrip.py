"""The ExPhil request (32×60×512×16 f32) over stdio, against an echo of the same bytes.

Measures, interleaved in one run, each after the same pause:
  * server: `python -m bridge` → reply, spoken to by a lean client (the request encoded once,
            the reply read whole into a reused buffer: bridge/bench/floors.py's StreamLane); round trip
            and the server's timing split;
  * echo:   the same request bytes, from the same client, through the same kind of pipes to a C
            program that reads the frame and answers with a frame of the reply's size
            (bridge/bench/echo/pipe_echo.c);
  * the Python client library (PortClient → its own server), as a caller sees it: encoding
    each request, a reader thread, decoding each reply. Reported beside, not in the ratio.
Reports the bridge cost — round trip − kernel_us, i.e. decode, copies, queueing, encode and
transport — as a ratio to the echo's round trip. Goal (issue 2): ≤ 1.3×. The echo is a reference,
not a lower bound: on this machine the bridge's own IPC has measured below it on some lanes
(bench/results/transports.json).

    python -m bench.roundtrip [--iterations 40] [--json bench/results/roundtrip-stdio.json]
"""

from __future__ import annotations

import argparse
import statistics
import time

import protocol
from bridge.bench.cases import EXPHIL_SEQ, Case
from bridge.client import PortClient

from bridge.bench.floors import (SETTLE_SECONDS, BridgeProcess, encode_request, exchange, frame_bytes,
                                 open_floor)
from bridge.bench.machine import summarize_us, write_results


def exphil_inputs(seed: int = 0) -> dict:
    """ExPhil's window (32×60×512×16 f32): the sweep's own case, so both benches send the same."""
    return Case("scan", EXPHIL_SEQ).inputs(seed)


def summarize(values: list[float]) -> dict:
    """The round-trip benches' summary: the quieter fifth (p20) beside p50, p80 and p90."""
    return summarize_us(values, (20, 50, 80, 90))


WARMUP = 3  # untimed rounds: page faults, first-call allocations


def run(iterations: int, server_args: list[str]) -> dict:
    inputs = exphil_inputs()
    request_parts = protocol.frame_parts(encode_request(1, "scan", inputs))
    request_frame = frame_bytes(request_parts)
    bridge = BridgeProcess(server_args)
    client = PortClient(["--device", "cpu", *server_args])
    echo = None
    try:
        exchange(bridge.lane, request_parts, "scan")
        reply_frame = protocol.framing.HEADER_SIZE + len(bridge.lane.last_reply)
        echo = open_floor("stdio", bridge.lane.reply_sizes())
        rows = {"round_trip": [], "bridge_cost": [], "echo": [], "ipc": [], "python_client": []}
        stages = {}
        for i in range(iterations + WARMUP):
            time.sleep(SETTLE_SECONDS)
            echo_us = echo.round_trip_us(request_parts)
            time.sleep(SETTLE_SECONDS)
            round_trip, reply = exchange(bridge.lane, request_parts, "scan")
            time.sleep(SETTLE_SECONDS)
            start = time.perf_counter_ns()
            client.scan(**inputs).unwrap()  # timed in the calling thread, as a caller waits
            python_client_us = (time.perf_counter_ns() - start) / 1000.0
            if i < WARMUP:
                continue
            t = reply.timing
            rows["round_trip"].append(round_trip)
            rows["bridge_cost"].append(round_trip - t["kernel_us"])
            rows["echo"].append(echo_us)
            rows["ipc"].append(round_trip - t["server_us"])
            rows["python_client"].append(python_client_us)
            for key, value in t.items():
                if key.endswith("_us"):
                    stages.setdefault(key, []).append(value)
        backend = bridge.call("info")["backend"]
    finally:
        if echo is not None:
            echo.close()
        client.close()
        bridge.close()
    summary = {k: summarize(v) for k, v in rows.items()}
    return {
        "case": "exphil 32x60x512x16 f32, stdio",
        "backend": backend,
        "iterations": iterations,
        "request_frame_bytes": request_frame,
        "reply_frame_bytes": reply_frame,
        "round_trip": summary["round_trip"],
        "bridge_cost": summary["bridge_cost"],
        "echo_floor": summary["echo"],
        "ipc": summary["ipc"],
        "python_client_round_trip": summary["python_client"],
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
    for name in ("round_trip", "bridge_cost", "echo_floor", "ipc", "python_client_round_trip"):
        s = r[name]
        print(f"  {name:<24} {s['p50_us']/1000:8.2f} ms   ({s['p20_us']/1000:.2f}–{s['p80_us']/1000:.2f})")
    print("  stages p50:  " + "  ".join(f"{k}={v/1000:.2f}ms" for k, v in r["stages_p50_us"].items()))
    print(f"  bridge cost / echo floor = {r['bridge_cost_over_floor']:.2f}×  (goal ≤ {r['goal_bridge_cost_over_floor']}×)")
    if args.json:
        write_results(args.json, "roundtrip-stdio", {"results": [result]})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
