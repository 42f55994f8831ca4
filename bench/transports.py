"""Every transport of one server against a raw echo of the same bytes over the same transport,
in the same run; then many concurrent clients; then the cost of handing a reply to the ZeroMQ
socket's own thread.

Lanes: stdio (the Port's pipes), unix (a unix socket), zmq-ipc and zmq-tcp (DEALER to ROUTER;
tensors as raw buffers, zero copy, and zmq-ipc once more with tensors inline). Cases: the
ExPhil request (32×60×512×16 f32 scan) and a small step (batch 2, dim 256, state 16, A a
server-resident handle). Each iteration times the echo floor (bridge/bench/floors.py: a C echo
answering with a reply of the bridge's reply sizes) and then the bridge, each after the same
pause (SETTLE_SECONDS), with the same lean client code (floors.py's lanes: the request encoded
once, the reply read whole into a reused buffer), so the two differ only by the server. Per row:
IPC cost = round trip − server_us (protocol/SPEC.md §8) and bridge cost = round trip − kernel_us
(decode, copies, queueing, encode and transport), each as a ratio to the echo's round trip. On
the stdio ExPhil row the same request also goes through the Python client library (PortClient
to a server of its own: encoding, a reader thread, decoding), as a caller sees it; reported
beside, not in the ratios.

Goals: the ExPhil request's bridge cost ≤ 1.3× its echo over stdio (issue 2); its IPC cost ≤
1.3× its echo on unix and zmq ipc, and 16 clients pipelining 10,000 requests get every reply
once, to the right client (issue 6). The echo is a reference, not a lower bound: the bridge's
own IPC can come in below it on some lanes (docs/performance.md, "transports").

    python -m bench.transports [--iterations 20] [--requests 10000] [--json bench/results/transports.json]
    python -m bench.transports --lanes stdio --cases exphil --iterations 40 --clients 0   # stdio only

This is not `python -m bridge.bench` (`make bench`): that one sweeps payload sizes back to back
through the client library and splits each round trip into stages; this one holds the lean
client fixed, paces every round trip alike, and checks many clients at once.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

import scan_kernels
import protocol
from bridge.cli import tune_malloc
from bridge.bench.cases import EXPHIL_SEQ, Case
from bridge.bench.floors import (BridgeProcess, encode_request, exchange, floor_missing, frame_bytes,
                                 lane_call, open_floor)
from bridge.bench.machine import output_path, summarize_us, write_results
from bridge.client import PortClient, UnixClient, ZmqClient

GOAL_IPC_OVER_ECHO = 1.3
GOAL_BRIDGE_COST_OVER_ECHO = 1.3
STEP = {"batch": 2, "dim": 256, "state": 16}
CASES = ("exphil", "step")
# (lane, tensors as raw buffers)
ROWS = [("stdio", False), ("unix", False), ("zmq-ipc", True), ("zmq-ipc", False), ("zmq-tcp", True)]
LANES = tuple(dict.fromkeys(lane for lane, _ in ROWS))
CLIENT_LANES = ("zmq-ipc", "unix")
# Idle time before each timed round trip, the bridge's and its echo's (roundtrip.exs pauses as
# long; bench.game_loop paces its steps by 60 FPS frames instead; bridge.bench does not pause):
# a request that comes long after the last finds cold caches and sleeping kernel helpers, which
# back to back no round trip would, and the echo must meet the same. How much a pause costs:
# docs/performance.md, "settle pause".
SETTLE_SECONDS = 0.005
CONCURRENT = {"batch": 1, "seq": 4, "dim": 8, "state": 4}
# Untimed round trips before each row's timed ones; and a whole untimed pass over the ExPhil
# rows first: the server's heap grows to hold several 8 MB requests at once over the first few
# dozen requests (each fresh page faults on first touch), which would land on the
# first row measured.
WARMUP = 5
PIPELINE_DEPTH = 16


def exphil_inputs(seed: int = 0) -> dict:
    """ExPhil's window (32×60×512×16 f32): bridge.bench's own case, so both benches send the same."""
    return Case("scan", EXPHIL_SEQ).inputs(seed)


def summarize(values: list[float]) -> dict:
    """The summary of a row's timings: the quieter fifth (p20) beside p50, p80 and p90."""
    return summarize_us(values, (20, 50, 80, 90))


class Server(BridgeProcess):
    """`python -m bridge` with `lanes` open besides stdio, which is reached through its pipes."""

    def __init__(self, server_args: list[str], lanes: tuple[str, ...] = ("unix", "zmq-ipc", "zmq-tcp")):
        self.log = tempfile.TemporaryFile()
        super().__init__(server_args, stderr=self.log, lanes=tuple(lane for lane in lanes if lane != "stdio"))
        self.info = self.info or self.call("info")
        self.backend = self.info["backend"]

    def close(self) -> None:
        super().close()
        self.log.close()


def case_request(case: str, lane) -> tuple[str, dict]:
    """(op, args) of a case on a lane (a step needs a session and a handle of that lane's)."""
    if case == "exphil":
        return "scan", exphil_inputs()
    inputs = Case("step", 1, **STEP).inputs(seed=0)
    A = lane_call(lane, "put", {"tensor": inputs.pop("A")})["handle"]
    session = lane_call(lane, "session_open", STEP)["session"]
    return "step", {"session": session, "A": protocol.HandleRef(A), **inputs}


def measure_row(server: Server, case: str, lane_name: str, multipart: bool, iterations: int,
                python_client: PortClient | None = None) -> dict | None:
    """The case on one lane, interleaved with its echo floor (and, given `python_client` and
    the ExPhil case, with the same request through it); with no iterations, only the warm-up
    round trips (and None)."""
    lane = server.connect(lane_name)
    op, args = case_request(case, lane)
    buffers = [] if multipart else None
    frame = lane.frame(encode_request(7, op, args, buffers), buffers)
    what = f"{case} on {lane_name}"
    exchange(lane, frame, what)
    floor = open_floor(lane_name, lane.reply_sizes())
    if case != "exphil":
        python_client = None
    rows = {"round_trip": [], "ipc": [], "echo": [], "bridge_cost": []}
    if python_client is not None:
        rows["python_client_round_trip"] = []
    stages: dict[str, list[float]] = {}
    try:
        for i in range(WARMUP + iterations):
            time.sleep(SETTLE_SECONDS)
            echo_us = floor.round_trip_us(frame)
            time.sleep(SETTLE_SECONDS)
            round_trip_us, reply = exchange(lane, frame, what)
            timing = reply.timing
            if python_client is not None:
                time.sleep(SETTLE_SECONDS)
                start = time.perf_counter_ns()
                python_client.request(op, args).unwrap()  # timed in the calling thread, as a caller waits
                python_client_us = (time.perf_counter_ns() - start) / 1000.0
            if i < WARMUP:
                continue
            if python_client is not None:
                rows["python_client_round_trip"].append(python_client_us)
            rows["round_trip"].append(round_trip_us)
            rows["ipc"].append(round_trip_us - timing["server_us"])
            rows["echo"].append(echo_us)
            rows["bridge_cost"].append(round_trip_us - timing.get("kernel_us", 0.0))
            for key, value in timing.items():
                stages.setdefault(key, []).append(value)
    finally:  # an interrupted row leaves no echo behind
        floor.close()
        if lane_name != "stdio":
            lane.close()
    if not iterations:
        return None
    summary = {name: summarize(values) for name, values in rows.items()}
    return {
        "case": case, "lane": lane_name, "tensors": "raw buffers" if multipart else "inline",
        "iterations": iterations,
        "request_bytes": frame_bytes(frame), "reply_bytes": sum(lane.reply_sizes()),
        **summary,
        "stages_p50_us": {k: statistics.median(v) for k, v in stages.items()},
        "ipc_over_echo": summary["ipc"]["p50_us"] / summary["echo"]["p50_us"],
        # The quieter fifth of each: less sensitive to load from other processes.
        "ipc_over_echo_p20": summary["ipc"]["p20_us"] / summary["echo"]["p20_us"],
        "bridge_cost_over_echo": summary["bridge_cost"]["p50_us"] / summary["echo"]["p50_us"],
    }


# -- many clients -----------------------------------------------------------------------------

def concurrent_inputs(count: int, seed: int) -> tuple[dict, np.ndarray]:
    """`count` distinct small scans (one row each, sharing A) and the reference y of each."""
    inputs = Case("scan", CONCURRENT["seq"], count, CONCURRENT["dim"], CONCURRENT["state"]).inputs(seed)
    t = {k: torch.from_numpy(v).double() for k, v in inputs.items()}
    y = scan_kernels.selective_scan(t["x"], t["dt"], t["A"], t["B"], t["C"], backend="reference")
    return inputs, y.float().numpy()


def run_clients(server: Server, lane: str, clients: int, requests: int, seed: int) -> dict:
    inputs, expected = concurrent_inputs(requests, seed)
    per_client = [range(i, requests, clients) for i in range(clients)]
    start = threading.Barrier(clients + 1)
    lost, misrouted, duplicated, latencies, finished = [], [], [], [], []

    def client_run(index: int):
        try:
            client = UnixClient(server.endpoints["unix"]) if lane == "unix" else ZmqClient(server.endpoints[lane])
        except BaseException:
            start.abort()  # the others, and the timer, would wait for this client forever
            raise
        try:
            start.wait()
            window: list = []
            for i in per_client[index]:
                args = {k: v[i:i + 1] for k, v in inputs.items() if k != "A"}
                window.append((i, client.submit("scan", {**args, "A": inputs["A"]}, request_id=f"{index}-{i}")))
                if len(window) >= PIPELINE_DEPTH:
                    check(*window.pop(0))
            for item in window:
                check(*item)
            finished.append(time.perf_counter())
            time.sleep(0.2)  # a duplicate would have arrived by now (not part of the throughput)
            duplicated.extend(client.unmatched)
        finally:
            client.close()

    def check(i, future):
        try:
            reply = future.result(120)
        except Exception as exc:  # a lost reply
            lost.append((i, repr(exc)))
            return
        latencies.append(reply.round_trip_us)
        y = reply.result["y"] if reply.ok else None
        if reply.id != f"{i % clients}-{i}" or y is None or not np.allclose(y[0], expected[i], rtol=3e-4, atol=1e-3):
            misrouted.append(i)

    with ThreadPoolExecutor(clients) as pool:
        futures = [pool.submit(client_run, i) for i in range(clients)]
        try:
            start.wait()
        except threading.BrokenBarrierError:  # a client could not start: raise its error
            errors = [f.exception() for f in futures]
            raise next(e for e in errors if not isinstance(e, (threading.BrokenBarrierError, type(None))))
        began = time.perf_counter()
        for f in futures:
            f.result()
        elapsed = max(finished) - began
    return {"lane": lane, "clients": clients, "requests": requests, "pipeline_depth": PIPELINE_DEPTH,
            "lost": len(lost), "duplicated": len(duplicated), "misrouted": len(misrouted),
            "seconds": elapsed, "requests_per_s": requests / elapsed,
            "latency": summarize(latencies) if latencies else None}


# -- the hop to the ZeroMQ socket's thread ----------------------------------------------------

def outbox_hop(samples: int = 2000) -> dict:
    """Microseconds from `Outbox.post` on one thread to the owner thread, polling the eventfd
    with zmq.Poller as the transport does, holding the item: the cost of routing each reply to
    the socket's own thread."""
    import zmq

    from bridge.outbox import Outbox

    outbox, hops, done = Outbox(), [], threading.Event()

    def owner():
        poller = zmq.Poller()
        poller.register(outbox.fd, zmq.POLLIN)
        while len(hops) < samples:
            poller.poll()
            for posted in outbox.take():
                hops.append((time.perf_counter_ns() - posted) / 1000.0)
                done.set()

    thread = threading.Thread(target=owner, daemon=True)
    thread.start()
    for _ in range(samples):
        done.clear()
        outbox.post(time.perf_counter_ns())
        done.wait(5)
        time.sleep(0.0002)  # let the owner go back to sleep, as between replies
    thread.join(5)
    outbox.close()
    return summarize(hops)


# -- report -----------------------------------------------------------------------------------

def run(args) -> dict:
    tune_malloc()  # the client reads multi-MB replies into fresh buffers, as the server does
    table = [(lane, multipart) for lane, multipart in ROWS if lane in args.lanes]
    client_lanes = [lane for lane in CLIENT_LANES if lane in args.lanes] if args.clients else []
    for lane in dict.fromkeys(lane for lane, _ in table):
        reason = floor_missing(lane)
        if reason:
            raise SystemExit(f"bench.transports: no echo floor for {lane}: {reason}")
    server = Server(args.server_arg, lanes=args.lanes)
    python_client = None
    try:
        if "stdio" in args.lanes and "exphil" in args.cases:
            python_client = PortClient(["--device", "cpu", *args.server_arg])
        if "exphil" in args.cases:
            for lane, multipart in table:
                measure_row(server, "exphil", lane, multipart, iterations=0)
        rows = [measure_row(server, case, lane, multipart, args.iterations * (1 if case == "exphil" else 5),
                            python_client if lane == "stdio" else None)
                for case in args.cases for lane, multipart in table]
        concurrency = [run_clients(server, lane, args.clients, args.requests, seed=i)
                       for i, lane in enumerate(client_lanes)]
    finally:
        if python_client is not None:
            python_client.close()
        server.close()
    # The server's arguments and own info: machine info is the bench process's (its threads, say).
    return {"backend": server.backend, "server_args": args.server_arg, "server_info": server.info,
            "rows": rows, "concurrency": concurrency, "outbox_hop_us": outbox_hop(),
            "goals": {"big_ipc_over_echo": GOAL_IPC_OVER_ECHO,
                      "stdio_big_bridge_cost_over_echo": GOAL_BRIDGE_COST_OVER_ECHO,
                      "lost_duplicated_misrouted": 0}}


def report(result: dict) -> None:
    print(f"backend {result['backend']}; medians in µs; IPC = round trip - server_us; "
          f"bridge = round trip - kernel_us; (p20s): IPC/echo of the p20s")
    print(f"{'case':<7} {'lane':<8} {'tensors':<12} {'request':>9} {'reply':>9} {'round trip':>11} "
          f"{'IPC':>9} {'bridge':>9} {'echo':>9} {'IPC/echo':>8} {'(p20s)':>7} {'bridge/echo':>11}")
    for r in result["rows"]:
        print(f"{r['case']:<7} {r['lane']:<8} {r['tensors']:<12} {r['request_bytes']:>9} {r['reply_bytes']:>9} "
              f"{r['round_trip']['p50_us']:>11.1f} {r['ipc']['p50_us']:>9.1f} {r['bridge_cost']['p50_us']:>9.1f} "
              f"{r['echo']['p50_us']:>9.1f} {r['ipc_over_echo']:>8.2f} {r['ipc_over_echo_p20']:>7.2f} "
              f"{r['bridge_cost_over_echo']:>11.2f}")
        if "python_client_round_trip" in r:
            print(f"{'':<7} {'':<8} through the Python client library (PortClient): round trip "
                  f"{r['python_client_round_trip']['p50_us']:.1f}")
    for c in result["concurrency"]:
        print(f"{c['clients']} clients on {c['lane']}, {c['requests']} pipelined requests: {c['lost']} lost, "
              f"{c['duplicated']} duplicated, {c['misrouted']} misrouted; {c['requests_per_s']:.0f} req/s, "
              f"latency p50 {c['latency']['p50_us']:.0f} µs")
    hop = result["outbox_hop_us"]
    print(f"reply hop to the zmq thread (Outbox): p50 {hop['p50_us']:.1f} µs (p20 {hop['p20_us']:.1f}, "
          f"p80 {hop['p80_us']:.1f})")
    for r in result["rows"]:
        if r["case"] == "exphil" and (r["lane"], r["tensors"]) in (("unix", "inline"), ("zmq-ipc", "raw buffers")):
            verdict = "meets" if r["ipc_over_echo"] <= GOAL_IPC_OVER_ECHO else "MISSES"
            print(f"goal: big request on {r['lane']}: IPC {r['ipc_over_echo']:.2f}× its echo "
                  f"({verdict} ≤ {GOAL_IPC_OVER_ECHO}×)")
        if r["case"] == "exphil" and r["lane"] == "stdio":
            verdict = "meets" if r["bridge_cost_over_echo"] <= GOAL_BRIDGE_COST_OVER_ECHO else "MISSES"
            print(f"goal: big request on stdio: bridge cost {r['bridge_cost_over_echo']:.2f}× its echo "
                  f"({verdict} ≤ {GOAL_BRIDGE_COST_OVER_ECHO}×)")


def names(allowed: tuple[str, ...], option: str):
    """An argparse type: comma-separated names from `allowed`, in `allowed`'s order."""
    def parse(text: str) -> tuple[str, ...]:
        given = [n.strip() for n in text.split(",") if n.strip()]
        unknown = [n for n in given if n not in allowed]
        if unknown or not given:
            raise argparse.ArgumentTypeError(f"{option}: expected names from {','.join(allowed)}, got {text!r}")
        return tuple(n for n in allowed if n in given)

    return parse


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iterations", type=int, default=20, help="timed ExPhil round trips per lane (steps: 5×)")
    p.add_argument("--lanes", type=names(LANES, "--lanes"), default=LANES,
                   help=f"comma-separated lanes to measure (default {','.join(LANES)})")
    p.add_argument("--cases", type=names(CASES, "--cases"), default=CASES,
                   help=f"comma-separated cases to measure (default {','.join(CASES)})")
    p.add_argument("--clients", type=int, default=16,
                   help=f"concurrent clients on each of {', '.join(CLIENT_LANES)} measured (0: none)")
    p.add_argument("--requests", type=int, default=10_000, help="requests over all concurrent clients, per lane")
    p.add_argument("--json", type=output_path, help="write results (with machine and commit info) to this file")
    p.add_argument("--server-arg", action="append", default=[], help="extra argument for the server")
    args = p.parse_args(argv)
    for flag, value, least in (("--iterations", args.iterations, 1), ("--clients", args.clients, 0),
                               ("--requests", args.requests, 1)):
        if value < least:
            p.error(f"{flag}: expected {least} or more, got {value}")
    result = run(args)
    report(result)
    if args.json:
        write_results(args.json, "transports", {"results": result})
    failed = any(c["lost"] or c["duplicated"] or c["misrouted"] for c in result["concurrency"])
    return 1 if failed else 0


if __name__ == "__main__":
    from bridge.bench import exit_on_stop_signals

    exit_on_stop_signals()
    raise SystemExit(main())
