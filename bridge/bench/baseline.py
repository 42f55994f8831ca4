"""`--baseline CMD`: ExPhil's own requests against any Port-style server command, beside ours.

Both servers get the same bytes: legacy ExPhil scans (protocol/SPEC.md §9: no id, f32 tensors as msgpack
*str*, the way Msgpax packs binaries), one request at a time over a fresh pair of pipes, the way
ExPhil's GenServer drives its Port, the two servers taking turns at going first. The round trip
is write → whole reply read; both sides share the client's encoding (done once, untimed), so the
ratio compares servers and their pipes. The first reply of each is checked against the other's,
so a fast wrong answer cannot pass."""

from __future__ import annotations

import select
import shlex
import subprocess
import sys
import tempfile
import time

import msgpack
import numpy as np

import protocol
from bridge.client import server_env, spawn, stop_piped_server
from bridge.streams import read_exact, write_all

from .cases import EXPHIL_SEQ, Case
from .lanes import BenchError, log_tail
from .measure import MIN_ITERATIONS, percentiles

START_TIMEOUT_S = 120.0
REPLY_TIMEOUT_S = 300.0
# ExPhil's per-step loop and our kernels sum in different orders; f32 results agree to this,
# relative to the largest |y|.
AGREE_TOLERANCE = 1e-4


class PortProcess:
    """A Port-style server (4-byte big-endian length, then a msgpack body, on stdin/stdout)
    spoken to one request at a time."""

    def __init__(self, command: list[str]):
        self.command = command
        self.log = tempfile.TemporaryFile(mode="w+b")
        try:
            self.proc = spawn(command, stop_piped_server, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=self.log, env=server_env(), bufsize=0)
        except OSError as exc:
            self.log.close()
            raise BenchError(f"--baseline: cannot start {shlex.join(command)}: {exc}") from exc
        self.header = memoryview(bytearray(protocol.framing.HEADER_SIZE))

    def exchange(self, parts: list, timeout: float = REPLY_TIMEOUT_S) -> tuple[float, bytearray]:
        """Send one framed request; (round trip µs, reply body)."""
        start = time.perf_counter_ns()
        try:
            write_all(self.proc.stdin.fileno(), parts)
        except BrokenPipeError as exc:
            raise self._gone("closed its stdin") from exc
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            raise BenchError(f"{shlex.join(self.command)}: no reply within {timeout:.0f} s")
        if not read_exact(self.proc.stdout, self.header):
            raise self._gone("exited before replying")
        body = bytearray(protocol.parse_frame_header(self.header))
        if not read_exact(self.proc.stdout, memoryview(body)):
            raise self._gone("exited in the middle of a reply")
        return (time.perf_counter_ns() - start) / 1000.0, body

    def _gone(self, what: str) -> BenchError:
        self.proc.wait(5)
        return BenchError(f"{shlex.join(self.command)} {what} (exit status {self.proc.returncode}); "
                          f"its stderr ends:\n{log_tail(self.log)}")

    def close(self) -> None:
        stop_piped_server(self.proc)
        self.proc.stdout.close()
        self.log.close()


def legacy_scan(case: Case, inputs: dict[str, np.ndarray]) -> list:
    """The frame ExPhil's PyTorchPort sends for `case`'s window."""
    request = {"op": "scan", "batch": case.batch, "seq_len": case.seq, "hidden": case.dim,
               "state": case.state, **{name: inputs[name].tobytes() for name in ("x", "dt", "A", "B", "C")}}
    return protocol.frame_parts([msgpack.packb(request, use_bin_type=False)])


def legacy_result(body: bytes, case: Case, who: str) -> np.ndarray:
    """y from an ExPhil-format reply; BenchError unless it is {"status": "ok", "result", "shape"}."""
    # raw=True: a server may pack the result as str (as Msgpax would) or bin.
    reply = msgpack.unpackb(body, raw=True)
    status = reply.get(b"status") if isinstance(reply, dict) else None
    if status != b"ok":
        message = reply.get(b"message", b"") if isinstance(reply, dict) else b""
        raise BenchError(f"{who}: expected an ExPhil reply with status ok to {case.label}, got status "
                         f"{status!r} ({message.decode(errors='replace')})")
    shape = [case.batch, case.seq, case.dim]
    if reply.get(b"shape") != shape:
        raise BenchError(f"{who}: expected shape {shape} for {case.label}, got {reply.get(b'shape')!r}")
    return np.frombuffer(reply[b"result"], dtype=np.float32).reshape(shape)


def legacy_ping(server: PortProcess) -> None:
    _, body = server.exchange(protocol.frame_parts([msgpack.packb({"op": "ping"})]), START_TIMEOUT_S)
    reply = msgpack.unpackb(body, raw=True)
    if not isinstance(reply, dict) or reply.get(b"status") != b"ok":
        raise BenchError(f"{shlex.join(server.command)}: expected {{status: ok}} to a legacy ping, got {reply!r}")


def baseline_cases(cases: list[Case]) -> list[Case]:
    """The sweep's payloads that ExPhil sends: windows up to its own (a step goes as a window
    of one timestep)."""
    windows = [case.as_window() for case in cases]
    return [w for w in dict.fromkeys(windows) if w.seq <= EXPHIL_SEQ]


def run_baseline(command: str, cases: list[Case], bridge_args: list[str], *, iterations: int, warmup: int,
                 max_seconds: float, seed: int = 0, on_iteration=lambda: None) -> list[dict]:
    """A row per case: both servers' round trips (p50/p90/p99) and baseline p50 / bridge p50."""
    argv = shlex.split(command)
    if not argv:
        raise BenchError("--baseline: expected a command line, got an empty string")
    theirs = PortProcess(argv)
    try:
        ours = PortProcess([sys.executable, "-m", "bridge", *bridge_args])
    except BenchError:
        theirs.close()
        raise
    servers = (("bridge", ours), ("baseline", theirs))
    rows = []
    try:
        legacy_ping(ours)
        legacy_ping(theirs)
        for case in cases:
            inputs = case.inputs(seed)
            frame = legacy_scan(case, inputs)
            _, our_body = ours.exchange(frame)
            _, their_body = theirs.exchange(frame)
            y_ours = legacy_result(our_body, case, "python -m bridge")
            y_theirs = legacy_result(their_body, case, command)
            scale = max(float(np.max(np.abs(y_ours))), 1.0)
            agree = bool(np.max(np.abs(y_ours - y_theirs)) <= AGREE_TOLERANCE * scale)
            times = {"bridge": [], "baseline": []}
            started = time.monotonic()
            for i in range(warmup + iterations):
                # Who goes first alternates: the second of a pair meets caches and a CPU the
                # first has just warmed (or taken), which would favour one side throughout.
                pair = servers if i % 2 == 0 else servers[::-1]
                took = {name: server.exchange(frame)[0] for name, server in pair}
                if i >= warmup:
                    times["bridge"].append(took["bridge"])
                    times["baseline"].append(took["baseline"])
                on_iteration()
                if i + 1 - warmup >= MIN_ITERATIONS and time.monotonic() - started > max_seconds:
                    break
            row = {"case": case.name, "seq": case.seq,
                   "request_bytes": sum(len(memoryview(p).cast("B")) for p in frame),
                   "bridge_reply_bytes": len(our_body) + protocol.framing.HEADER_SIZE,
                   "baseline_reply_bytes": len(their_body) + protocol.framing.HEADER_SIZE,
                   "iterations": len(times["bridge"])}
            row.update(percentiles(times["bridge"], "bridge"))
            row.update(percentiles(times["baseline"], "baseline"))
            # A wrong answer has no speed worth comparing: no ratio (and the bench exits 1).
            row["baseline_over_bridge_ratio"] = row["baseline_p50_us"] / row["bridge_p50_us"] if agree else None
            row["results_agree"] = agree
            rows.append(row)
    finally:
        ours.close()
        theirs.close()
    return rows
