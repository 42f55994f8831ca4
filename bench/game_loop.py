"""Sessions and batching over stdio (issue 5), each part compared within the same run.

(a) The 60 FPS game loop: one session of 32×512×16, prefilled with a 60-frame scan, then 600
    steps of one frame each (A uploaded once as a handle). Per-frame round trip p50/p99 and
    bytes per frame (request + reply frames) against re-sending the 60-frame window every frame
    (the ExPhil way: 8.1 MB in, 3.9 MB out). For scale, the same step requests also go through
    a C pipe echo answering with a reply of the step's size (bridge/bench/floors.py): what
    moving the bytes alone costs (a reference, not a bound no server can beat:
    docs/performance.md, "transports"). The bridge is driven by the same client as that echo
    (pre-encoded requests written, the reply read whole into a reused buffer, one at a time),
    so the two differ only by the server. Both are paced as a 60 FPS loop: each gets one
    request a frame (FRAME_SECONDS), the bridge's at the frame's start and the echo's half a
    frame later, so each finds the machine idle since the other's (back to back, the cores stay
    warm and the server's kernel helpers still poll, which no such frame finds: a step after a
    pause is slower in every stage, docs/performance.md, "settle pause"). The same steps are
    also timed back to back (a server kept busy, as by many agents stepping), the bridge alone. The same steps
    through the Python client library (bridge.client.PortClient: encoding each request, a reader
    thread, decoding each reply) are measured beside them, one a frame, timed in the calling
    thread, as a Python caller waits. Repeated `--repeats` times, each with a fresh server: one
    600-step p99 on a shared machine says more about its neighbours than about the bridge, so
    the medians over the runs are reported and every run is kept.
(b) 8 concurrent callers, each stepping its own session in a closed loop through one server
    (over stdio, or with `--lanes` over the unix lane and ZeroMQ too, CALLER_LANES):
    throughput with the server's defaults against `--max-delay-us 0 --max-batch 1`, and the same
    two with `--no-native-step` (every step through the batcher, CONCURRENT_SERVERS), the four
    servers taking turns for several rounds. The callers are driven by one lean loop
    (CallerLoop) so that the client's CPU, on the same cores, is not what is measured.
(c) Optional (`--delays`): (b) through the batcher (`--no-native-step`) at several `--max-delay-us`,
    to choose its default.

    python -m bench.game_loop [--steps 600] [--windows 40] [--repeats 3] [--seconds 2] [--rounds 3]
                              [--lanes stdio,unix,zmq] [--delays 0,100,200,400]
                              [--json bench/results/game_loop.json]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import msgspec
import numpy as np
import zmq

import protocol
from bridge.bench.cases import BATCH, DIM, DT_CLAMP, EXPHIL_SEQ, STATE, Case
from bridge.bench.floors import (BridgeProcess, EchoUnavailable, ZmqLane, encode_request, exchange,
                                 frame_bytes, lane_call, open_floor)
from bridge.bench.machine import at_least, comma_separated, output_path, positive_count, summarize_us, write_results
from bridge.cli import positive_seconds
from bridge.bench.measure import FRAME_BUDGET_60FPS_US
from bridge.client import PortClient

# Untimed round trips before the timed ones: first-call allocations, page faults.
WARMUP = 20
FRAME_SECONDS = FRAME_BUDGET_60FPS_US / 1e6
# Issue 5's goal for batching's throughput gain, by the servers' device.
GOAL_BATCHING_SPEEDUP = {"cpu": 2.0, "cuda": 4.0}


def wait_for_frame(start: float, frame: float) -> None:
    """Sleep until `frame` frames (a fraction for a point within one) after `start`
    (time.perf_counter()); return at once where that point has passed."""
    delay = start + frame * FRAME_SECONDS - time.perf_counter()
    if delay > 0:
        time.sleep(delay)


def frame_inputs(batch: int, seed: int, seq: int | None = None) -> dict:
    """Random per-frame arguments (the sweep's own ranges, bridge.bench.cases): x, dt
    [batch, (seq,) dim]; B, C [batch, (seq,) state]."""
    case = Case("step", 1, batch) if seq is None else Case("scan", seq, batch)
    inputs = case.inputs(seed)
    del inputs["A"]
    return inputs


def round_trip_bytes(lane, request: list) -> int:
    """Bytes on the wire for `request` and the lane's last reply: both frames, headers included."""
    return frame_bytes(request) + protocol.framing.HEADER_SIZE + sum(lane.reply_sizes())


def constant_A(seed: int) -> np.ndarray:
    return Case("step", 1).inputs(seed)["A"]


def step_request(request_id, session: str, handle, inputs: dict) -> list:
    """The body parts of a step of `session` with per-frame `inputs`, A as `handle`, ExPhil's clamp."""
    return encode_request(request_id, "step", {"session": session, "A": handle, **DT_CLAMP, **inputs})


# -- (a) the game loop ------------------------------------------------------------------------


def game_loop(steps: int, windows: int, server_args: list[str], device: str = "cpu") -> dict:
    A = constant_A(0)
    window = frame_inputs(BATCH, 0, seq=EXPHIL_SEQ)
    frames = [frame_inputs(BATCH, 1 + i) for i in range(32)]  # cycled; content does not matter
    bridge = BridgeProcess(server_args, device=device)
    lane = bridge.lane
    try:
        handle = protocol.HandleRef(bridge.call("put", tensor=A)["handle"])
        session = bridge.call("session_open", batch=BATCH, dim=DIM, state=STATE)["session"]
        prefill_us, _ = exchange(lane, lane.frame(encode_request(
            "prefill", "scan", {"A": handle, "session": session, **DT_CLAMP, **window})))
        step_frames = [lane.frame(step_request(i, session, handle, f)) for i, f in enumerate(frames)]
        for i in range(WARMUP):
            exchange(lane, step_frames[i % len(step_frames)])
        echo, echo_missing = open_step_echo(lane.reply_sizes(), step_frames)
        step_bytes = []
        step_rows, step_timing, echo_rows = paced_exchanges(
            lane, step_frames, steps, echo, lambda request: step_bytes.append(round_trip_bytes(lane, request)))
        # The same steps back to back: a server kept busy (many agents) rather than a frame's
        # lone step; the bridge alone, this series is not held against a floor.
        back_to_back_rows, back_to_back_timing = [], []
        for i in range(steps):
            us, reply = exchange(lane, step_frames[i % len(step_frames)])
            back_to_back_rows.append(us)
            back_to_back_timing.append(reply.timing)
        window_frame = lane.frame(encode_request("window", "scan", {"A": A, **DT_CLAMP, **window}))
        for _ in range(3):
            exchange(lane, window_frame)
        window_rows, window_bytes, window_timing = [], [], []
        for _ in range(windows):
            us, reply = exchange(lane, window_frame)
            window_rows.append(us)
            window_bytes.append(round_trip_bytes(lane, window_frame))
            window_timing.append(reply.timing)
        backend = bridge.call("info")["backend"]
    finally:
        bridge.close()

    def stage_medians(timings):
        return {k: statistics.median(t[k] for t in timings) for k in timings[0] if k.endswith("_us")}

    python_client = python_client_steps(steps, A, frames, server_args, device)
    floor = summarize_us(echo_rows) if echo is not None else {"skipped": echo_missing}
    step_frame_bytes, window_frame_bytes = statistics.median(step_bytes), statistics.median(window_bytes)
    step = summarize_us(step_rows)
    return {
        "case": f"game loop: session {BATCH}x{DIM}x{STATE}, prefill {EXPHIL_SEQ} frames, {steps} steps; "
                f"vs re-sending the {EXPHIL_SEQ}-frame window ({windows} frames)",
        "backend": backend,
        "step_round_trip": step,
        "step_stages_p50_us": stage_medians(step_timing),
        "step_bytes_per_frame": step_frame_bytes,
        "step_echo_floor": floor,
        "step_p50_over_echo": step["p50_us"] / floor["p50_us"] if echo is not None else None,
        "step_round_trip_back_to_back": summarize_us(back_to_back_rows),
        "step_stages_p50_us_back_to_back": stage_medians(back_to_back_timing),
        "step_round_trip_python_client": python_client,
        "prefill_round_trip_us": prefill_us,
        "window_round_trip": summarize_us(window_rows),
        "window_stages_p50_us": stage_medians(window_timing),
        "window_bytes_per_frame": window_frame_bytes,
        "bytes_ratio": window_frame_bytes / step_frame_bytes,
        "goals": {"step_p99_us": 1000, "step_p50_us": 150, "bytes_ratio": 50},
    }


def python_client_steps(steps: int, A, frames: list, server_args: list[str], device: str = "cpu") -> dict:
    """The same steps through bridge.client.PortClient, one a frame, each timed in the calling
    thread from the call to its reply in hand (request encoding, the reader thread's hand-over
    and reply decoding included)."""
    with PortClient(["--device", device, *server_args]) as client:
        handle = client.put(A)
        session = client.open_session(BATCH, DIM, STATE)
        rows = []
        first_frame = time.perf_counter()
        for i in range(WARMUP + steps):
            wait_for_frame(first_frame, i)
            start = time.perf_counter_ns()
            client.step(session, **frames[i % len(frames)], A=handle, **DT_CLAMP).unwrap()
            if i >= WARMUP:
                rows.append((time.perf_counter_ns() - start) / 1000.0)
    return summarize_us(rows)


def game_loop_runs(repeats: int, steps: int, windows: int, server_args: list[str], device: str = "cpu") -> dict:
    """(a) `repeats` times; the medians over the runs of what each run reports."""
    runs = [game_loop(steps, windows, server_args, device) for _ in range(repeats)]
    floors = [r["step_echo_floor"] for r in runs if "skipped" not in r["step_echo_floor"]]

    def median(values):
        return statistics.median(values) if values else None

    return {
        "case": runs[0]["case"] + f", {repeats} runs",
        "backend": runs[0]["backend"],
        "median_step_p50_us": median([r["step_round_trip"]["p50_us"] for r in runs]),
        "median_step_p99_us": median([r["step_round_trip"]["p99_us"] for r in runs]),
        "median_step_back_to_back_p50_us": median([r["step_round_trip_back_to_back"]["p50_us"] for r in runs]),
        "median_step_back_to_back_p99_us": median([r["step_round_trip_back_to_back"]["p99_us"] for r in runs]),
        "median_step_echo_p50_us": median([f["p50_us"] for f in floors]),
        "median_step_p50_over_echo": median([r["step_p50_over_echo"] for r in runs
                                             if r["step_p50_over_echo"] is not None]),
        "median_step_python_client_p50_us": median([r["step_round_trip_python_client"]["p50_us"] for r in runs]),
        "median_step_python_client_p99_us": median([r["step_round_trip_python_client"]["p99_us"] for r in runs]),
        "median_window_p50_us": median([r["window_round_trip"]["p50_us"] for r in runs]),
        "median_bytes_ratio": median([r["bytes_ratio"] for r in runs]),
        "goals": runs[0]["goals"],
        "runs": runs,
    }


def paced_exchanges(lane, frames: list, steps: int, echo, on_reply=None) -> tuple[list, list, list]:
    """`steps` requests of `frames` (cycled) to `lane`, one at each 60 FPS frame's start, and,
    where `echo` is a lane, the same request to it half a frame later: bridge and echo take
    turns within each frame, so that both see the same machine. (round trips in µs, the
    replies' timings, the echo's round trips); `on_reply(request)` is called after each reply.
    Closes the echo."""
    rows, timings, echo_rows = [], [], []
    try:
        start = time.perf_counter()
        for i in range(steps):
            request = frames[i % len(frames)]
            wait_for_frame(start, i)
            us, reply = exchange(lane, request)
            rows.append(us)
            timings.append(reply.timing)
            if on_reply is not None:
                on_reply(request)
            if echo is not None:
                wait_for_frame(start, i + 0.5)
                echo_rows.append(echo.round_trip_us(request))
    finally:
        if echo is not None:
            echo.close()
    return rows, timings, echo_rows


def open_step_echo(reply_sizes: list[int], step_frames: list):
    """(lane, None): a C pipe echo answering each step frame with a reply of `reply_sizes`
    (as a lane's reply_sizes() gives them), warmed up; (None, why) where the echo cannot be built."""
    try:
        lane = open_floor("stdio", reply_sizes)
    except EchoUnavailable as exc:
        return None, str(exc)
    for request in step_frames[:WARMUP]:
        lane.round_trip_us(request)
    return lane, None


# -- (b) concurrent callers -------------------------------------------------------------------


class ReplyHead(msgspec.Struct):
    """The parts of a reply the caller loop reads (the rest, y included, is skipped)."""

    id: str
    ok: bool
    timing: dict = {}
    error: dict = {}


# Part (b)'s lanes, by their --lanes name, as BridgeProcess names them: stdio (the callers share
# the server's pipes, as the processes behind one Port owner do), unix and zmq (ipc) (a
# connection per caller, as separate client processes have).
CALLER_LANES = {"stdio": "stdio", "unix": "unix", "zmq": "zmq-ipc"}


class CallerLoop(BridgeProcess):
    """A server with 8 (or n) callers, each stepping its own session in a closed loop: each
    caller has one request in flight and sends its next the moment its reply is in. One thread
    drives them all and reads only each reply's head, so that the client's CPU (on the same 2
    cores as the server) is as small as it can be and the same for every server. Over unix and
    zmq the server also serves its pipes, which `call` (stats) uses."""

    def __init__(self, server_args: list[str], lane: str = "stdio", device: str = "cpu"):
        if lane not in CALLER_LANES:
            raise ValueError(f"lane: expected one of {', '.join(CALLER_LANES)}, got {lane!r}")
        self.lane_name = CALLER_LANES[lane]
        super().__init__(server_args, lanes=() if lane == "stdio" else (self.lane_name,), device=device)
        self._heads = msgspec.msgpack.Decoder(ReplyHead)
        # A connection per caller over unix and zmq (made by step_frames); over stdio all share
        # the server's pipes.
        self._connections: list = []

    def step_frames(self, rows: int, callers: int) -> list[list]:
        """Each caller's one pre-encoded step request frame, for a session of its own (A a
        handle put on its lane: a handle belongs to the connection that put it)."""
        if self.lane_name != "stdio":
            self._connections = [self.connect(self.lane_name) for _ in range(callers)]
        frames = []
        for i in range(callers):
            lane = self._lane_of(i)
            if i == 0 or self._connections:
                handle = protocol.HandleRef(lane_call(lane, "put", {"tensor": constant_A(1)})["handle"])
            session = lane_call(lane, "session_open", {"batch": rows, "dim": DIM, "state": STATE})["session"]
            frames.append(lane.frame(step_request(str(i), session, handle, frame_inputs(rows, 1 + i))))
        return frames

    def _lane_of(self, caller: int):
        return self._connections[caller] if self._connections else self.lane

    def run(self, frames: list[list], seconds: float) -> dict:
        callers = len(frames)
        lanes = [self._lane_of(i) for i in range(callers)]
        counts, round_trips, batch_rows = [0] * callers, [], []
        sent_at = [0] * callers
        shared = not self._connections
        if not shared:  # a connection per caller: wait for whichever answers
            poller, polled = zmq.Poller(), {}
            for lane in lanes:
                key = lane.socket if isinstance(lane, ZmqLane) else lane.fileno()
                poller.register(key, zmq.POLLIN)
                polled[key] = lane
        began = time.perf_counter_ns()
        deadline = began + int(seconds * 1e9)
        for i, frame in enumerate(frames):
            sent_at[i] = time.perf_counter_ns()
            lanes[i].send(frame)
        in_flight = callers
        while in_flight:
            for lane in [lanes[0]] if shared else [polled[key] for key, _ in poller.poll()]:
                head = self._heads.decode(lane.receive())
                now = time.perf_counter_ns()
                if not head.ok:
                    raise RuntimeError(f"step failed: {head.error}")
                i = int(head.id)
                counts[i] += 1
                round_trips.append((now - sent_at[i]) / 1000.0)
                batch_rows.append(head.timing["batch_rows"])
                if now < deadline:
                    sent_at[i] = time.perf_counter_ns()
                    lane.send(frames[i])
                else:
                    in_flight -= 1
        elapsed = (time.perf_counter_ns() - began) / 1e9
        return {"elapsed_s": elapsed, "counts": counts, "round_trips": round_trips, "batch_rows": batch_rows}

    def close(self) -> None:
        for connection in self._connections:
            connection.close()
        super().close()


def run_callers(server_args: list[str], rows: int, callers: int, seconds: float, lane: str = "stdio",
                device: str = "cpu") -> dict:
    loop = CallerLoop(server_args, lane, device)
    try:
        frames = loop.step_frames(rows, callers)
        loop.run(frames, 0.2)  # warm-up
        before = loop.call("stats")["ops"]["step"]
        run = loop.run(frames, seconds)
        after = loop.call("stats")["ops"]["step"]
    finally:
        loop.close()
    steps = sum(run["counts"])
    executions = after["execution_count"] - before["execution_count"]
    return {
        "server_args": server_args,
        "steps_per_s": steps / run["elapsed_s"],
        "rows_per_s": steps * rows / run["elapsed_s"],
        "round_trip": summarize_us(run["round_trips"]),
        "mean_batch_requests": (after["inference_count"] - before["inference_count"]) / max(executions, 1),
        "mean_batch_rows": statistics.mean(run["batch_rows"]),
        "per_caller_steps": run["counts"],
    }


# The servers part (b) compares, by name: their flags after --server-arg's. By default the native
# step path (bridge/native) serves every plain step that finds nothing in flight, unbatched; only
# steps queued behind another request reach the batcher. Without it (--no-native-step) every step
# goes through the batcher, so the last two show what sharing a launch gains where it is used.
CONCURRENT_SERVERS = {
    "batched": [],
    "unbatched": ["--max-delay-us", "0", "--max-batch", "1"],
    "batched_general": ["--no-native-step"],
    "unbatched_general": ["--no-native-step", "--max-delay-us", "0", "--max-batch", "1"],
}


def concurrent(rows: int, callers: int, seconds: float, rounds: int, server_args: list[str],
               lane: str = "stdio", device: str = "cpu") -> dict:
    # The native path serves CPU sessions only: on a GPU the --no-native-step servers would be
    # the first two again.
    servers = CONCURRENT_SERVERS if device == "cpu" else {k: CONCURRENT_SERVERS[k] for k in ("batched", "unbatched")}
    runs = {name: [] for name in servers}
    for _ in range(rounds):  # taking turns, so that drift in the machine's load hits all alike
        for name, flags in servers.items():
            runs[name].append(run_callers(server_args + flags, rows, callers, seconds, lane, device))
    median = {k: statistics.median(r["steps_per_s"] for r in v) for k, v in runs.items()}
    general = "batched_general" in median
    return {
        "case": f"{callers} callers over {lane} each stepping a {rows}x{DIM}x{STATE} session, "
                f"{rounds} rounds of {seconds} s per server",
        "lane": lane,
        "device": device,
        "server_args": server_args,
        "servers": servers,
        "median_steps_per_s": median,
        # The comparison: the server's defaults against --max-delay-us 0 --max-batch 1.
        "speedup": median["batched"] / median["unbatched"],
        # What batching gains where every step goes through the batcher.
        "general_path_speedup": median["batched_general"] / median["unbatched_general"] if general else None,
        # The defaults against the general path with batching.
        "defaults_over_batched_general": median["batched"] / median["batched_general"] if general else None,
        "runs": runs,
        "goal_speedup": GOAL_BATCHING_SPEEDUP[device],
    }


def delay_sweep(delays: list[int], rows: int, callers: int, seconds: float, rounds: int,
                server_args: list[str], device: str = "cpu") -> list[dict]:
    """(c), over stdio: the callers of (b) at each --max-delay-us, servers taking turns."""
    results = {d: [] for d in delays}
    for _ in range(rounds):
        for delay in delays:
            # Without the native path, which would serve most steps before the batcher saw them.
            results[delay].append(run_callers([*server_args, "--no-native-step", "--max-delay-us", str(delay)],
                                              rows, callers, seconds, device=device))
    return [{"max_delay_us": d, "callers": callers, "rows": rows, "rounds": rounds, "seconds": seconds,
             "median_steps_per_s": statistics.median(r["steps_per_s"] for r in runs),
             "median_p50_us": statistics.median(r["round_trip"]["p50_us"] for r in runs),
             "median_p99_us": statistics.median(r["round_trip"]["p99_us"] for r in runs),
             "median_mean_batch_requests": statistics.median(r["mean_batch_requests"] for r in runs)}
            for d, runs in results.items()]


def _lane(item: str) -> str:
    # bridge.bench's name for the ZeroMQ lane (zmq-ipc) is taken too
    lane = {"zmq-ipc": "zmq"}.get(item.strip(), item.strip())
    if lane not in CALLER_LANES:
        raise ValueError(item)
    return lane


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=positive_count, default=600)
    p.add_argument("--windows", type=positive_count, default=40, help="window re-sends to compare with")
    p.add_argument("--repeats", type=positive_count, default=3, help="(a) runs, each with a fresh server")
    p.add_argument("--callers", type=positive_count, default=8)
    p.add_argument("--rows", type=comma_separated(at_least(1), "batch sizes of 1 or more"), default=[1, 32],
                   help="session batch of each caller in (b), comma-separated")
    p.add_argument("--lanes", type=comma_separated(_lane, f"lanes of {', '.join(CALLER_LANES)}"), default=["stdio"],
                   help=f"(b)'s lanes, comma-separated, of {', '.join(CALLER_LANES)}")
    p.add_argument("--seconds", type=positive_seconds, default=2.0, help="length of one (b) run")
    p.add_argument("--rounds", type=positive_count, default=3)
    p.add_argument("--delays", type=comma_separated(at_least(0), "--max-delay-us values of 0 or more"), default=[],
                   help="(c): --max-delay-us values to sweep, comma-separated "
                                                "(over stdio, with (b)'s first --rows)")
    p.add_argument("--skip", default="", help="parts to skip, e.g. a or b")
    p.add_argument("--server-arg", action="append", default=[], help="extra argument for the servers")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="the servers' --device")
    p.add_argument("--json", type=output_path, help="write the results (with machine and commit info) to this file, "
                                   "e.g. bench/results/game_loop.json")
    args = p.parse_args(argv)
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            p.error("--device cuda: no CUDA device here")
    # The machine may be shared: its load is recorded with the results.
    load_before = os.getloadavg()
    results = {}
    if "a" not in args.skip:
        summary = results["game_loop"] = game_loop_runs(args.repeats, args.steps, args.windows,
                                                        args.server_arg, args.device)
        print(f"(a) {summary['case']}, backend {summary['backend']}")
        for i, r in enumerate(summary["runs"], 1):
            s, w = r["step_round_trip"], r["window_round_trip"]
            print(f"  run {i}: step p50 {s['p50_us']:8.1f} µs  p99 {s['p99_us']:8.1f} µs  "
                  f"{r['step_bytes_per_frame'] / 1e3:8.1f} kB/frame  (goals p50 ≤ 150, p99 < 1000)")
            floor = r["step_echo_floor"]
            if "skipped" in floor:
                print(f"    step echo floor skipped: {floor['skipped']}")
            else:
                print(f"    step echo floor (C pipe echo, same bytes) p50 {floor['p50_us']:8.1f} µs  "
                      f"p99 {floor['p99_us']:8.1f} µs: step p50 = {r['step_p50_over_echo']:.2f}× the floor")
            bb = r["step_round_trip_back_to_back"]
            print(f"    step back to back (no pause) p50 {bb['p50_us']:8.1f} µs  p99 {bb['p99_us']:8.1f} µs; stages p50: " +
                  "  ".join(f"{k}={v:.1f}" for k, v in r["step_stages_p50_us_back_to_back"].items()))
            py = r["step_round_trip_python_client"]
            print(f"    step through the Python client library p50 {py['p50_us']:8.1f} µs  p99 {py['p99_us']:8.1f} µs")
            print(f"    window  p50 {w['p50_us']:8.1f} µs  p99 {w['p99_us']:8.1f} µs  "
                  f"{r['window_bytes_per_frame'] / 1e3:8.1f} kB/frame")
            print(f"    bytes ratio {r['bytes_ratio']:.1f}× (goal ≥ 50×); step stages p50: " +
                  "  ".join(f"{k}={v:.1f}" for k, v in r["step_stages_p50_us"].items()))
        echo = summary["median_step_echo_p50_us"]
        print(f"  median of {args.repeats} runs: step p50 {summary['median_step_p50_us']:.1f} µs, "
              f"p99 {summary['median_step_p99_us']:.1f} µs" +
              (f", echo p50 {echo:.1f} µs ({summary['median_step_p50_over_echo']:.2f}×)" if echo is not None else "") +
              f", bytes ratio {summary['median_bytes_ratio']:.1f}×")
    if "b" not in args.skip:
        results["concurrent"] = []
        for lane in args.lanes:
            for rows in args.rows:
                r = concurrent(rows, args.callers, args.seconds, args.rounds, args.server_arg, lane, args.device)
                results["concurrent"].append(r)
                m = r["median_steps_per_s"]
                batched = "batched_general" if r["general_path_speedup"] is not None else "batched"
                batch = statistics.median(x["mean_batch_requests"] for x in r["runs"][batched])
                line = (f"(b) {r['case']}, steps/s: defaults {m['batched']:.0f}, --max-batch 1 {m['unbatched']:.0f} "
                        f"({r['speedup']:.2f}×")
                if r["general_path_speedup"] is None:
                    line += f"; goal ≥ {r['goal_speedup']:g}× on {args.device}); mean batch {batch:.1f} requests"
                else:
                    line += (f"); with --no-native-step: batched {m['batched_general']:.0f} "
                             f"(mean batch {batch:.1f} requests), unbatched {m['unbatched_general']:.0f} "
                             f"({r['general_path_speedup']:.2f}×; goal ≥ {r['goal_speedup']:g}× on {args.device}); "
                             f"defaults over batched --no-native-step {r['defaults_over_batched_general']:.2f}×")
                print(line)
    if args.delays:
        rows = args.rows[0]
        results["delay_sweep"] = delay_sweep(args.delays, rows, args.callers,
                                             args.seconds, args.rounds, args.server_arg, args.device)
        for r in results["delay_sweep"]:
            print(f"(c) --max-delay-us {r['max_delay_us']:5d}: {r['median_steps_per_s']:7.0f} steps/s, "
                  f"p50 {r['median_p50_us']:.0f} µs, p99 {r['median_p99_us']:.0f} µs, "
                  f"mean batch {r['median_mean_batch_requests']:.1f}")
    if args.json:
        write_results(args.json, "game-loop", {"device": args.device,
                                               "load_average": {"before": load_before, "after": os.getloadavg()},
                                               "results": results})
    return 0


if __name__ == "__main__":
    from bridge.bench import exit_on_stop_signals

    exit_on_stop_signals()
    raise SystemExit(main())
