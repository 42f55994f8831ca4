"""Cumulative counters for the `stats` op, modelled on Triton Inference Server's statistics
extension: per op, `inference_count` (requests served successfully, as Triton counts them, and
frames run inside session_open or session_restore) and `execution_count` (executions: a batch's
launch is one, any other request one; their ratio is the mean batch in requests: a failed
request is counted for no execution),
successes and failures (of requests: a frame is part of its request's), and cumulative
microseconds per stage; plus gauges of what the server holds now (sessions, tensor handles).
Frames and bytes are counted per lane too (stdio, unix, zmq), and what connections that went
away left behind, freed."""

from __future__ import annotations

import bisect
import threading
import time
from collections import Counter, defaultdict

from .timing import STAGE_KEYS

# The timing keys added up per op: each stage's, then the whole server time.
TOTALLED_KEYS = STAGE_KEYS + ("server_us",)
# Upper bounds of the histograms the metrics endpoint exports (bridge.metrics): a stage's
# microseconds, from a step's few to a big scan's second, and the rows a launch served.
LATENCY_BUCKETS_US = (10, 25, 50, 100, 250, 500, 1_000, 2_500, 5_000, 10_000, 25_000, 50_000,
                      100_000, 250_000, 500_000, 1_000_000)
BATCH_ROWS_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# What is counted per lane.
LANE_COUNTERS = ("frames_in", "bytes_in", "replies_out", "bytes_out")


class Histogram:
    """Counts per bucket (the last one past every bound) and the sum of what was observed."""

    def __init__(self, bounds: tuple):
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def copy(self) -> Histogram:
        other = Histogram(self.bounds)
        other.counts, other.sum = list(self.counts), self.sum
        return other


class Stats:
    def __init__(self, histograms: bool = False):
        """`histograms`: also count each op's stage times and batch rows into buckets (what the
        metrics endpoint exports; off, recording skips it)."""
        self._lock = threading.Lock()
        # op -> timing key -> Histogram, or None when not kept
        self._histograms: dict | None = {} if histograms else None
        # Monotonic: a wall clock stepped back or forward must not move the uptime.
        self.started = time.monotonic()
        self.frames_in = 0
        self.bytes_in = 0
        self.replies_out = 0
        self.bytes_out = 0
        self.lanes = defaultdict(lambda: dict.fromkeys(LANE_COUNTERS, 0))
        # (reason, kind) -> entries freed for connections that went away: reason "closed" (seen
        # leaving) or "idle" (a ZeroMQ peer silent past --idle-timeout-s); kind "peers" counts
        # the connections themselves.
        self.released = Counter()
        self.errors = Counter()
        self.ops = defaultdict(self._new_op)
        self._gauges: dict = {}  # name -> callable returning a JSON-able dict

    def add_gauge(self, name: str, read) -> None:
        """Report `read()` under `name` in every snapshot."""
        self._gauges[name] = read

    @staticmethod
    def _new_op() -> dict:
        entry = {"inference_count": 0, "execution_count": 0, "success_count": 0, "failure_count": 0}
        entry.update({key: 0.0 for key in TOTALLED_KEYS})
        return entry

    # bytes_in and bytes_out count requests' and replies' bodies with their raw buffers (ZeroMQ),
    # not the length prefix a stream lane adds: the same on every lane.
    def frame_in(self, nbytes: int, lane: str) -> None:
        with self._lock:
            self.frames_in += 1
            self.bytes_in += nbytes
            counts = self.lanes[lane]
            counts["frames_in"] += 1
            counts["bytes_in"] += nbytes

    def reply_out(self, parts, buffers=(), *, lane: str) -> None:
        """One reply sent on `lane`: its body's `parts` and a multipart reply's raw `buffers`,
        counted as frame_in counts a request (no length prefix)."""
        nbytes = sum(memoryview(p).nbytes for p in parts) + sum(memoryview(b).nbytes for b in buffers)
        with self._lock:
            self.replies_out += 1
            self.bytes_out += nbytes
            counts = self.lanes[lane]
            counts["replies_out"] += 1
            counts["bytes_out"] += nbytes

    def record_release(self, reason: str, freed: dict, gone_now: bool = True) -> None:
        """`freed` ({kind: count}) of what a connection owned was freed because it went away
        (`reason`: "closed" or "idle"): just now (`gone_now`), or earlier, with this freed from
        requests that finished after."""
        with self._lock:
            self.released[(reason, "peers")] += int(gone_now)
            for kind, count in freed.items():
                self.released[(reason, kind)] += count

    def record_launch(self, op: str, rows: int) -> None:
        """One kernel launch that served a batch of `op` requests (`rows` rows), counted apart
        from them."""
        with self._lock:
            self._launched(op, rows)

    def record_frame(self, op: str, rows: int) -> None:
        """A frame of `op` that ran inside a session_open or session_restore request: one
        inference and its own launch of its session's `rows` (frames run unbatched), its time
        and outcome counted with that request's."""
        with self._lock:
            self.ops[op]["inference_count"] += 1
            self._launched(op, rows)

    def _launched(self, op: str, rows: int) -> None:
        # Called with the lock held.
        self.ops[op]["execution_count"] += 1
        if self._histograms is not None:
            self._op_histograms(op)["batch_rows"].observe(rows)

    def record(self, op: str, timing: dict | None, *, ok: bool, executions: int = 1,
               error_code: str | None = None) -> None:
        with self._lock:
            entry = self.ops[op]
            if ok:  # a failed request is counted for no launch
                entry["inference_count"] += 1
                entry["execution_count"] += executions
            entry["success_count" if ok else "failure_count"] += 1
            if timing:
                for key in TOTALLED_KEYS:
                    entry[key] += timing.get(key, 0.0)
                if self._histograms is not None:
                    self._observe(op, timing, own_launch=executions > 0)
            if error_code:
                self.errors[error_code] += 1

    def _op_histograms(self, op: str) -> dict:
        histograms = self._histograms.get(op)
        if histograms is None:
            histograms = self._histograms[op] = {key: Histogram(LATENCY_BUCKETS_US) for key in TOTALLED_KEYS}
            histograms["batch_rows"] = Histogram(BATCH_ROWS_BUCKETS)
        return histograms

    def _observe(self, op: str, timing: dict, own_launch: bool) -> None:
        histograms = self._op_histograms(op)
        for key, value in timing.items():
            # A batch member's launch rows are counted once, for the launch (record_launch).
            if key == "batch_rows" and not own_launch:
                continue
            histogram = histograms.get(key)
            if histogram is not None:
                histogram.observe(value)

    def histograms(self) -> dict:
        """A copy of every histogram that has counted something, by (op, timing key); empty when
        they are not kept."""
        with self._lock:
            return {(op, key): h.copy() for op, by_key in (self._histograms or {}).items()
                    for key, h in by_key.items() if any(h.counts)}

    def record_error(self, code: str) -> None:
        with self._lock:
            self.errors[code] += 1

    def snapshot(self) -> dict:
        with self._lock:
            counters = {
                "uptime_s": time.monotonic() - self.started,
                "frames_in": self.frames_in,
                "bytes_in": self.bytes_in,
                "replies_out": self.replies_out,
                "bytes_out": self.bytes_out,
                "lanes": {lane: dict(counts) for lane, counts in self.lanes.items()},
                "released": {reason: {kind: count for (r, kind), count in self.released.items() if r == reason}
                             for reason in sorted({r for r, _ in self.released})},
                "errors": dict(self.errors),
                "ops": {op: dict(entry) for op, entry in self.ops.items()},
            }
        return counters | {name: read() for name, read in self._gauges.items()}
