"""Python clients. `PortClient` spawns `python -m bridge` over pipes exactly as a BEAM Port
would ({packet, 4}: a 4-byte big-endian length before each msgpack body), pipelines requests by
id, converts numpy/torch tensors to wire tensors and back, and returns each result with the
server's timing split plus its own round trip.

    with PortClient() as client:
        reply = client.scan(x, dt, A, B, C, return_state=True)
        reply.result["y"], reply.timing["kernel_us"], reply.round_trip_us
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np

import protocol

NUMPY_DTYPES = {
    "f32": np.float32, "f16": np.float16, "f64": np.float64,
    "i32": np.int32, "i64": np.int64, "u8": np.uint8,
}
WIRE_CODES = {np.dtype(v): k for k, v in NUMPY_DTYPES.items()}


class BridgeError(Exception):
    """The server answered with an error reply."""

    def __init__(self, code: str, message: str, detail: dict | None = None, timing: dict | None = None):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.detail = detail or {}
        self.timing = timing or {}


class ServerExited(ConnectionError):
    """The server process went away with requests outstanding."""


@dataclass
class Reply:
    id: object
    ok: bool
    result: dict | None
    error: dict | None
    timing: dict
    round_trip_us: float  # submit → reply decoded, client codec included
    client_encode_us: float = 0.0
    client_decode_us: float = 0.0
    bytes_out: int = 0  # request frame bytes sent
    bytes_in: int = 0  # reply frame bytes received
    extra: dict = field(default_factory=dict)

    @property
    def ipc_us(self) -> float:
        """Round trip minus everything the server did and the client codec: transport cost."""
        return self.round_trip_us - self.timing.get("server_us", 0.0) - self.client_encode_us - self.client_decode_us

    def unwrap(self) -> dict:
        if not self.ok:
            err = self.error or {}
            raise BridgeError(err.get("code", "?"), err.get("message", ""), err.get("detail"), self.timing)
        return self.result


def to_wire(value):
    """numpy array / torch tensor → protocol.OutTensor (data is a zero-copy view when the
    array is C-contiguous); other values pass through."""
    if isinstance(value, np.ndarray):
        arr = np.ascontiguousarray(value)
        if arr.dtype not in WIRE_CODES:
            raise TypeError(f"dtype {arr.dtype} has no wire code; expected one of {sorted(map(str, WIRE_CODES))}")
        return protocol.OutTensor(WIRE_CODES[arr.dtype], tuple(arr.shape), memoryview(arr).cast("B"))
    if type(value).__module__.startswith("torch"):
        import torch

        from bridge.tensors import WIRE_DTYPES

        t = value.detach().cpu().contiguous()
        data = memoryview(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else b""
        return protocol.OutTensor(WIRE_DTYPES[t.dtype], tuple(t.shape), data)
    return value


def from_wire(t: protocol.WireTensor, *, as_torch: bool = False):
    """Wire tensor → numpy array (torch tensor for bf16, or when as_torch), zero-copy: a view
    into the reply's body, which was read into a buffer of its own and stays alive as long
    as the array does."""
    if as_torch or t.dtype == "bf16":
        from bridge.tensors import host_view

        return host_view(t)
    return np.frombuffer(t.data, dtype=NUMPY_DTYPES[t.dtype]).reshape(t.shape)


def _convert_result(value, as_torch):
    if isinstance(value, protocol.WireTensor):
        return from_wire(value, as_torch=as_torch)
    if isinstance(value, dict):
        return {k: _convert_result(v, as_torch) for k, v in value.items()}
    if isinstance(value, list):
        return [_convert_result(v, as_torch) for v in value]
    return value


class FramedClient:
    """Pipelined request/reply over a pair of byte streams with 4-byte length framing.
    Subclasses provide the streams; replies are matched to requests by id."""

    def __init__(self, reader, writer_fd: int, *, as_torch: bool = False):
        self._reader = reader
        self._writer_fd = writer_fd
        self._ids = itertools.count(1)
        self._pending: dict[object, tuple[Future, int, float, int]] = {}
        self._lock = threading.Lock()
        self._write_lock = threading.Lock()
        self.as_torch = as_torch
        self._closed = threading.Event()
        # Replies whose id matches no request in flight (e.g. replies with id null to
        # undecodable frames sent with send_raw).
        self.unmatched: list = []
        self._thread = threading.Thread(target=self._read_replies, name="bridge-client-reader", daemon=True)
        self._thread.start()

    # -- requests -------------------------------------------------------------------------

    def submit(self, op: str, args: dict | None = None, *, request_id=None) -> Future:
        """Send one request now; the Future resolves to its Reply."""
        from bridge.transports.stdio import write_all

        request_id = next(self._ids) if request_id is None else request_id
        future: Future = Future()
        start = time.perf_counter_ns()
        wire_args = {k: to_wire(v) for k, v in (args or {}).items()}
        parts = protocol.frame_parts(protocol.encode_request(request_id, op, wire_args))
        encoded = time.perf_counter_ns()
        with self._lock:
            if self._closed.is_set():
                raise ServerExited("the server is gone")
            self._pending[request_id] = (future, start, (encoded - start) / 1000.0, 0)
        with self._write_lock:
            sent = write_all(self._writer_fd, parts)
        with self._lock:
            if request_id in self._pending:
                f, s, enc, _ = self._pending[request_id]
                self._pending[request_id] = (f, s, enc, sent)
        return future

    def request(self, op: str, args: dict | None = None, timeout: float | None = 60.0) -> Reply:
        return self.submit(op, args).result(timeout)

    def call(self, op: str, timeout: float | None = 60.0, **args) -> dict:
        """The result map; raises BridgeError on an error reply."""
        return self.request(op, args, timeout).unwrap()

    def ping(self) -> dict:
        return self.call("ping")

    def info(self) -> dict:
        return self.call("info")

    def stats(self) -> dict:
        return self.call("stats")

    def scan(self, x, dt, A, B, C, timeout: float | None = 60.0, **options) -> Reply:
        """Reply to a scan; `reply.unwrap()["y"]` (and "state" with return_state=True)."""
        return self.request("scan", {"x": x, "dt": dt, "A": A, "B": B, "C": C, **options}, timeout)

    def send_raw(self, body: bytes, request_id=None) -> Future | None:
        """Write an arbitrary body as one frame (tests and benchmarks). With `request_id`, the
        reply carrying that id resolves the returned Future; replies with ids that match
        nothing in flight (e.g. id null for an undecodable body) land in `self.unmatched`."""
        from bridge.transports.stdio import write_all

        future = None
        if request_id is not None:
            future = Future()
            with self._lock:
                self._pending[request_id] = (future, time.perf_counter_ns(), 0.0, len(body) + 4)
        with self._write_lock:
            write_all(self._writer_fd, protocol.frame_parts([body]))
        return future

    # -- replies --------------------------------------------------------------------------

    def _read_replies(self) -> None:
        from bridge.transports.stdio import read_exact

        header = memoryview(bytearray(4))
        try:
            while read_exact(self._reader, header):
                length = protocol.parse_frame_header(header)
                body = memoryview(bytearray(length))
                if not read_exact(self._reader, body):
                    break
                received = time.perf_counter_ns()
                self._deliver(body, received, length + 4)
        finally:
            self._fail_all(ServerExited("the server closed its end before replying"))

    def _deliver(self, body, received_ns: int, nbytes: int) -> None:
        try:
            decoded = protocol.decode_reply(body)
        except protocol.ProtocolError:
            # Not a v1 reply (e.g. an ExPhil-format answer to a legacy request): keep the bytes.
            self.unmatched.append(Reply(None, False, None, None, {}, 0.0, bytes_in=nbytes,
                                        extra={"raw": bytes(body)}))
            return
        result = _convert_result(decoded.result, self.as_torch) if decoded.ok else None
        done = time.perf_counter_ns()
        with self._lock:
            entry = self._pending.pop(decoded.id, None) if isinstance(decoded.id, (int, str)) else None
        start, encode_us, sent = (entry[1], entry[2], entry[3]) if entry else (received_ns, 0.0, 0)
        reply = Reply(decoded.id, decoded.ok, result, decoded.error, decoded.timing or {},
                      round_trip_us=(done - start) / 1000.0, client_encode_us=encode_us,
                      client_decode_us=(done - received_ns) / 1000.0, bytes_out=sent, bytes_in=nbytes)
        if entry is None:
            self.unmatched.append(reply)
        else:
            entry[0].set_result(reply)

    def _fail_all(self, exc: BaseException) -> None:
        with self._lock:
            self._closed.set()
            pending, self._pending = self._pending, {}
        for future, *_ in pending.values():
            if not future.done():
                future.set_exception(exc)


class PortClient(FramedClient):
    """Spawns the server as a BEAM Port would and talks to it over its stdin/stdout."""

    def __init__(self, server_args=(), *, python: str = sys.executable, env: dict | None = None,
                 stderr=None, as_torch: bool = False, start_timeout: float = 120.0, command=None):
        cmd = list(command) if command else [python, "-m", "bridge", *server_args]
        full_env = dict(os.environ)
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        full_env["PYTHONPATH"] = root + os.pathsep + full_env.get("PYTHONPATH", "")
        full_env.update(env or {})
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr,
                                     env=full_env, bufsize=0)
        super().__init__(self.proc.stdout, self.proc.stdin.fileno(), as_torch=as_torch)
        if command is None:
            # Readiness handshake: the first reply proves imports and device setup are done.
            self.request("ping", timeout=start_timeout).unwrap()

    def close(self, timeout: float = 10.0) -> int:
        """Close stdin (the server finishes what is in flight and exits) and wait."""
        if self.proc.stdin and not self.proc.stdin.closed:
            self.proc.stdin.close()
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
