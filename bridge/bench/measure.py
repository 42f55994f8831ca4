"""Where one request's time goes, measured: each round trip cut into stages, the floor beside
it, percentiles, the a + b·bytes fit and the 60 FPS verdict."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from bridge.client import to_wire

from .cases import Case

# A round trip, in the order its time is spent. Every stage is measured except the last two of
# the server's part and the transport, which are what the measured stages leave over; so the
# stages of one reply sum to its round trip exactly.
STAGES = ("client_encode", "server_decode", "queue", "h2d", "kernel", "d2h", "server_encode",
          "server_other", "client_decode", "transport")
# The reply `timing` key of each stage the server measures (protocol/SPEC.md §8).
SERVER_STAGE_KEYS = {"server_decode": "decode_us", "queue": "queue_us", "h2d": "h2d_us",
                     "kernel": "kernel_us", "d2h": "d2h_us", "server_encode": "encode_us"}
PERCENTILES = (50, 90, 99)
FRAME_BUDGET_60FPS_US = 1e6 / 60
# A timed run stops at its time cap only after this many timed iterations.
MIN_ITERATIONS = 3


class TimingMissing(KeyError):
    """A reply without the timing split this benchmark cuts round trips with."""


def stage_split(reply) -> dict[str, float]:
    """One reply's round trip (µs) cut into STAGES. `server_other` is the server's time not in
    a measured stage (dispatch, handler glue); `transport` is the round trip less the server's
    time and the client's codec: writing, waking the peer, reading, both ways."""
    timing = reply.timing
    missing = [key for key in (*SERVER_STAGE_KEYS.values(), "server_us") if key not in timing]
    if missing:
        raise TimingMissing(f"reply timing: expected the keys {sorted(SERVER_STAGE_KEYS.values())} and "
                            f"server_us, got {sorted(timing)} (missing {missing})")
    split = {"client_encode": reply.client_encode_us}
    for stage, key in SERVER_STAGE_KEYS.items():
        split[stage] = float(timing[key])
    server_us = float(timing["server_us"])
    split["server_other"] = server_us - sum(split[stage] for stage in SERVER_STAGE_KEYS)
    split["client_decode"] = reply.client_decode_us
    split["transport"] = reply.round_trip_us - server_us - reply.client_encode_us - reply.client_decode_us
    return {stage: split[stage] for stage in STAGES}


def percentiles(values, prefix: str) -> dict[str, float | None]:
    """{prefix_p50_us, prefix_p90_us, prefix_p99_us}; None for each when there are no values."""
    if len(values) == 0:
        return {f"{prefix}_p{p}_us": None for p in PERCENTILES}
    points = np.percentile(np.asarray(values, dtype=np.float64), PERCENTILES)
    return {f"{prefix}_p{p}_us": float(v) for p, v in zip(PERCENTILES, points)}


@dataclass
class Samples:
    """Every timed iteration of one case on one transport."""

    request_bytes: int = 0
    reply_bytes: int = 0
    round_trip_us: list[float] = field(default_factory=list)
    stages_us: dict[str, list[float]] = field(default_factory=lambda: {s: [] for s in STAGES})
    floor_us: list[float] = field(default_factory=list)

    def add(self, reply, floor_us: float | None) -> None:
        self.round_trip_us.append(reply.round_trip_us)
        for stage, value in stage_split(reply).items():
            self.stages_us[stage].append(value)
        if floor_us is not None:
            self.floor_us.append(floor_us)


@dataclass
class Lane:
    """One transport to the server under test.

    client           `request(op, args) -> Reply` over this transport
    request_frames   (op, wire args) → the request as this transport carries it
    make_floor       first Reply of a case → an echo answering replies of its sizes over the same
                     kind of channel, with `round_trip_us(request_frames)` and `close()`; None
                     (with `floor_missing` saying why) where there can be none
    """

    transport: str
    client: object
    request_frames: Callable[[str, dict], list]
    make_floor: Callable[[object], object] | None
    floor_missing: str | None = None


def case_request(case: Case, client, inputs: dict) -> tuple[dict, object]:
    """The request arguments for `case` on `client`, and how to undo what was set up for it
    (a step runs against a session of its own)."""
    if case.op == "step":
        session = client.open_session(case.batch, case.dim, case.state)
        return {"session": session, **inputs}, lambda: client.close_session(session)
    return dict(inputs), lambda: None


def measure_case(case: Case, lanes: list[Lane], *, iterations: int, warmup: int, max_seconds: float,
                 seed: int = 0, on_iteration=lambda: None, timeout: float = 300.0) -> dict[str, Samples]:
    """Run `case` on every lane, interleaved (floor, then the server, lane after lane, per
    iteration) so that all of them see the same machine load. Stops after `iterations` timed
    iterations, or once `max_seconds` have passed and at least MIN_ITERATIONS were timed."""
    inputs = case.inputs(seed)
    samples: dict[str, Samples] = {}
    requests, cleanups, floors, floor_frames = {}, [], {}, {}
    try:
        for lane in lanes:
            args, cleanup = case_request(case, lane.client, inputs)
            cleanups.append(cleanup)
            requests[lane.transport] = args
            first = lane.client.request(case.op, args, timeout)
            first.unwrap()
            # The request as it goes on the channel: what the floor echoes, and its size
            # (within the few bytes by which request ids differ).
            frames = lane.request_frames(case.op, {k: to_wire(v) for k, v in args.items()})
            floor_frames[lane.transport] = frames
            samples[lane.transport] = Samples(request_bytes=sum(memoryview(f).nbytes for f in frames),
                                              reply_bytes=first.bytes_in)
            if lane.make_floor is not None:
                floors[lane.transport] = lane.make_floor(first)
        started = time.monotonic()
        for i in range(warmup + iterations):
            timed = i >= warmup
            for lane in lanes:
                floor = floors.get(lane.transport)
                floor_us = floor.round_trip_us(floor_frames[lane.transport]) if floor else None
                reply = lane.client.request(case.op, requests[lane.transport], timeout)
                reply.unwrap()
                if timed:
                    samples[lane.transport].add(reply, floor_us)
            on_iteration()
            if timed and i + 1 - warmup >= MIN_ITERATIONS and time.monotonic() - started > max_seconds:
                break
    finally:
        for floor in floors.values():
            floor.close()
        for cleanup in cleanups:
            cleanup()
    return samples


def make_row(case: Case, transport: str, backend: str, device: str, samples: Samples) -> dict:
    """One flat row: what ran, sizes, p50/p90/p99 of the round trip, of every stage and of the
    floor, and the transport's cost as a ratio to its floor."""
    row = {"transport": transport, "backend": backend, "device": device, "case": case.name,
           "op": case.op, "batch": case.batch, "seq": case.seq, "dim": case.dim, "state": case.state,
           "iterations": len(samples.round_trip_us), "request_bytes": samples.request_bytes,
           "reply_bytes": samples.reply_bytes}
    row.update(percentiles(samples.round_trip_us, "round_trip"))
    for stage in STAGES:
        row.update(percentiles(samples.stages_us[stage], stage))
    row.update(percentiles(samples.floor_us, "floor"))
    floor_p50 = row["floor_p50_us"]
    if floor_p50:
        # The transport stage against an echo of the same bytes over the same channel: what this
        # lane costs above moving the bytes at all.
        row["ipc_over_floor_ratio"] = row["transport_p50_us"] / floor_p50
        # Everything but the kernel (codecs, copies, queueing, transport) against the echo.
        overhead = np.subtract(samples.round_trip_us, samples.stages_us["kernel"])
        row["overhead_over_floor_ratio"] = float(np.median(overhead)) / floor_p50
    else:
        row["ipc_over_floor_ratio"] = row["overhead_over_floor_ratio"] = None
    row["fits_60fps"] = row["round_trip_p99_us"] <= FRAME_BUDGET_60FPS_US
    return row


def fit_latency(bytes_moved, latency_us) -> dict | None:
    """latency ≈ a + b·bytes by least squares on relative error (weights 1/latency), so a
    4 KB step and a 64 MB window count alike. None with fewer than two distinct sizes."""
    x = np.asarray(bytes_moved, dtype=np.float64)
    y = np.asarray(latency_us, dtype=np.float64)
    if len(np.unique(x)) < 2:
        return None
    slope, intercept = np.polyfit(x, y, 1, w=1.0 / np.maximum(np.abs(y), 1.0))
    predicted = intercept + slope * x
    return {"points": len(x), "intercept_us": float(intercept), "slope_us_per_mb": float(slope * 1e6),
            # 1 / (µs per byte) is MB/s; / 1000 is GB/s.
            "bandwidth_gb_per_s": float(1.0 / slope / 1000.0) if slope > 0 else None,
            "max_error_ratio": float(np.max(np.abs(predicted - y) / np.maximum(np.abs(y), 1.0)))}


def fit_rows(rows: list[dict]) -> list[dict]:
    """Per transport and backend, the fit of the transport stage and of the floor (p50s)
    against the bytes moved both ways."""
    fits = []
    lanes = dict.fromkeys((r["transport"], r["backend"]) for r in rows)
    for transport, backend in lanes:
        mine = [r for r in rows if (r["transport"], r["backend"]) == (transport, backend)]
        for measure, key in (("transport", "transport_p50_us"), ("floor", "floor_p50_us")):
            points = [r for r in mine if r[key] is not None]
            fit = fit_latency([r["request_bytes"] + r["reply_bytes"] for r in points],
                              [r[key] for r in points])
            if fit is not None:
                fits.append({"transport": transport, "backend": backend, "measure": measure, **fit})
    return fits
