"""Echo floors: per transport, the cost of moving a request's bytes to a server and a reply's
bytes back with nothing done in between, the physical floor a server's round trip is compared
to in the same run.

    lane = open_floor("unix", [reply_body_bytes])
    us = lane.round_trip_us(lane.frame(protocol.encode_request(1, "scan", args)))
    lane.close()

Transports (`FLOORS`): `stdio` (pipes, as a BEAM Port), `unix` (a unix socket, same framing),
`zmq-ipc` and `zmq-tcp` (a DEALER to a ROUTER, one message per request). Each echo is a small C
program (echo/*.c beside this module) built on demand into `echo_build_dir()`; it answers every
request with a reply of the sizes it was started with, from one buffer it filled once.

Every lane has `round_trip_us(frame_parts) -> float`, where `frame_parts` is the request as its
transport carries it (`lane.frame(body_parts, buffers)` makes it from an encoded request: the
length-prefixed parts on a stream; the message frames, body then raw buffers, on ZeroMQ), and
`last_reply` (the reply's body, or its frames on ZeroMQ; `reply()` decodes it). The same client
code reaches the bridge itself (`connect_unix`, `ZmqLane`, `BridgeProcess` on pipes), so a
server is timed exactly as its floor is.
"""

from __future__ import annotations

import glob
import os
import socket
import subprocess
import sys
import tempfile
import time
from typing import Callable

import protocol
from bridge.c_build import c_compiler, compile_c
from bridge.client import server_env, spawn, stop_piped_server, to_wire
from bridge.streams import read_exact, write_all
from bridge.transports.unix import SOCKET_BUFFER_BYTES

# The echoes' C sources ship inside the package (package data), so that an installed bridge.bench
# finds its floors as a checkout does.
ECHO_SOURCES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "echo")
START_TIMEOUT_S = 10.0


def echo_build_dir() -> str:
    """Where the echo binaries go: `<checkout>/build/echo` (git-ignored) in a writable checkout,
    else a per-user cache directory (an installed package's own directory may not be writable)."""
    checkout = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if os.path.isfile(os.path.join(checkout, "pyproject.toml")) and os.access(checkout, os.W_OK):
        return os.path.join(checkout, "build", "echo")
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "scan-bridge", "echo")


class EchoUnavailable(RuntimeError):
    """An echo cannot be built or started here; the message says why."""


def build_echo(name: str, libs: tuple[str, ...] = ()) -> str:
    """Path to the echo binary of echo/NAME.c (beside this module), (re)built when the source or
    a header in echo/ (which the echoes include) is newer."""
    source = os.path.join(ECHO_SOURCES, f"{name}.c")
    build_dir = echo_build_dir()
    binary = os.path.join(build_dir, name)
    inputs = [source, *glob.glob(os.path.join(ECHO_SOURCES, "*.h"))]
    if os.path.exists(binary) and os.path.getmtime(binary) >= max(map(os.path.getmtime, inputs)):
        return binary
    if c_compiler() is None:
        raise EchoUnavailable(f"no C compiler (cc/gcc) on PATH to build the {name} echo")
    try:
        compile_c(binary, source, libs=libs)
    except OSError as exc:
        raise EchoUnavailable(f"building the {name} echo failed: {exc}") from exc
    return binary


class _Lane:
    """What both kinds of lane share: a timed round trip (send, then receive the whole reply)
    and `close`, which runs the `on_close` given (stopping an echo, say)."""

    _on_close = None

    def send(self, frame_parts: list) -> None:
        raise NotImplementedError

    def receive(self) -> memoryview:
        raise NotImplementedError

    def round_trip_us(self, frame_parts: list) -> float:
        start = time.perf_counter_ns()
        self.send(frame_parts)
        self.receive()
        return (time.perf_counter_ns() - start) / 1000.0

    def close(self) -> None:
        if self._on_close is not None:
            self._on_close()


class StreamLane(_Lane):
    """A client of a stream transport (pipes or a unix socket): writes a framed request, reads
    the one reply frame into a buffer reused from call to call."""

    def __init__(self, reader, writer_fd: int, on_close=None):
        self.reader = reader
        self.writer_fd = writer_fd
        self._on_close = on_close
        self._header = memoryview(bytearray(protocol.framing.HEADER_SIZE))
        self._buffer = bytearray(1 << 16)
        self.last_reply: memoryview = memoryview(b"")

    @staticmethod
    def frame(body_parts: list, buffers: list | None = None) -> list:
        if buffers:
            raise ValueError("a stream transport carries one frame per request: no raw buffers")
        return protocol.frame_parts(body_parts)

    def send(self, frame_parts: list) -> None:
        write_all(self.writer_fd, frame_parts)

    def fileno(self) -> int:
        """What to poll for a reply (the reader is unbuffered: nothing waits in Python)."""
        return self.reader.fileno()

    def receive(self) -> memoryview:
        """The next reply's body, in the lane's buffer (valid until the next receive)."""
        if not read_exact(self.reader, self._header):
            raise EOFError("the server closed the stream")
        n = protocol.parse_frame_header(self._header)
        if n > len(self._buffer):
            self._buffer = bytearray(n)
        body = memoryview(self._buffer)[:n]
        if not read_exact(self.reader, body):
            raise EOFError("the server closed the stream inside a reply")
        self.last_reply = body
        return body

    def reply(self) -> protocol.Reply:
        """The last reply, decoded."""
        return protocol.decode_reply(self.last_reply)

    def reply_sizes(self) -> list[int]:
        return [len(self.last_reply)]


class ZmqLane(_Lane):
    """A DEALER client of a ZeroMQ endpoint: sends one message, receives one, without copies."""

    def __init__(self, endpoint: str, on_close=None):
        import zmq

        self.endpoint = endpoint
        self._on_close = on_close
        # The process's one context: one libzmq I/O thread however many lanes are open (a
        # context each gave the game-loop bench's 8 callers 8 of them on the 2 cores).
        self._socket = zmq.Context.instance().socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.connect(endpoint)
        self.last_reply: list = []

    @staticmethod
    def frame(body_parts: list, buffers: list | None = None) -> list:
        body = body_parts[0] if len(body_parts) == 1 else b"".join(body_parts)
        return [body, *(buffers or ())]

    def send(self, frame_parts: list) -> None:
        self._socket.send_multipart(frame_parts, copy=False)

    def receive(self) -> memoryview:
        """The next reply's body (its first frame)."""
        self.last_reply = self._socket.recv_multipart(copy=False)
        return self.last_reply[0].buffer

    @property
    def socket(self):
        """What to poll for a reply."""
        return self._socket

    def reply(self) -> protocol.Reply:
        """The last reply, decoded."""
        return protocol.decode_reply(self.last_reply[0].buffer, [f.buffer for f in self.last_reply[1:]])

    def reply_sizes(self) -> list[int]:
        return [len(f) for f in self.last_reply]

    def close(self) -> None:
        self._socket.close()
        super().close()


def connect_unix(path: str, on_close=None) -> StreamLane:
    """A stream lane over a unix socket connection to `path`; `on_close` runs after it closes."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    reader = sock.makefile("rb", buffering=0)

    def close():
        reader.close()
        sock.close()
        if on_close is not None:
            on_close()

    return StreamLane(reader, sock.fileno(), close)


def encode_request(request_id, op: str, args: dict, buffers: list | None = None) -> list:
    """A request's body parts, with numpy/torch arguments made wire tensors."""
    return protocol.encode_request(request_id, op, {k: to_wire(v) for k, v in args.items()}, buffers=buffers)


def frame_bytes(parts: list) -> int:
    return sum(memoryview(part).nbytes for part in parts)


def exchange(lane, frame_parts: list, what: str = "request") -> tuple[float, protocol.Reply]:
    """One round trip over a lane to the bridge (µs: request written → reply read whole) and the
    decoded reply; raises on an error reply."""
    us = lane.round_trip_us(frame_parts)
    reply = lane.reply()
    if not reply.ok:
        raise RuntimeError(f"{what} failed: {reply.error}")
    return us, reply


def lane_call(lane, op: str, args: dict, multipart: bool = False) -> dict:
    """One request over a lane to the bridge; its result (raises on an error reply)."""
    buffers = [] if multipart else None
    return exchange(lane, lane.frame(encode_request("setup", op, args, buffers), buffers), op)[1].result


class BridgeProcess:
    """`python -m bridge --device DEVICE ARGS` on pipes, spoken to through a StreamLane (`lane`),
    so that it is timed exactly as the echoes are. Closing its stdin stops it. With `lanes`
    (names of bridge.bench.lanes.TRANSPORTS: "unix", "zmq-ipc", "zmq-tcp") it serves those too,
    opened as that table says; `connect` opens a client lane to any of them."""

    def __init__(self, server_args: list[str], stderr=None, lanes: tuple[str, ...] = (), device: str = "cpu"):
        from bridge.bench.lanes import TRANSPORTS  # it imports this module

        self._scratch = tempfile.TemporaryDirectory(prefix="bridge-lanes-") if lanes else None
        lane_args = ["--stdio"] if lanes else []
        values = {name: TRANSPORTS[name].value(self._scratch.name) for name in lanes}
        for name, value in values.items():
            lane_args += [TRANSPORTS[name].option, value]
        self.proc = spawn([sys.executable, "-m", "bridge", "--device", device, *server_args, *lane_args],
                          stop_piped_server, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr,
                          env=server_env(), bufsize=0)
        self.lane = StreamLane(self.proc.stdout, self.proc.stdin.fileno())
        self.endpoints: dict[str, str] = {}
        self.info: dict | None = None
        if lanes:
            try:
                # Answered once the server serves, every lane bound; it lists where (zmq tcp:
                # the port the server got).
                self.info = self.call("info")
                self.endpoints = {name: TRANSPORTS[name].endpoint(self.info["transports"], value)
                                  for name, value in values.items()}
            except BaseException:
                self.close()  # a stop signal's exit, say: no caller holds this server yet to stop it
                raise

    def call(self, op: str, **args) -> dict:
        return lane_call(self.lane, op, args)

    def connect(self, lane: str):
        """A client lane: the pipes for "stdio", else a new connection to that lane."""
        if lane == "stdio":
            return self.lane
        return connect_unix(self.endpoints[lane]) if lane == "unix" else ZmqLane(self.endpoints[lane])

    def close(self) -> None:
        try:
            stop_piped_server(self.proc)
            self.proc.stdout.close()
        finally:
            if self._scratch is not None:
                self._scratch.cleanup()


# -- the echoes ---------------------------------------------------------------------------------

def _spawn(command: list[str]) -> tuple[subprocess.Popen, str]:
    """Start an echo that prints where it listens once ready; (process, that line)."""
    proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    line = proc.stdout.readline().decode().strip()
    if not line:
        proc.wait(START_TIMEOUT_S)
        raise EchoUnavailable(f"{os.path.basename(command[0])} did not start: {proc.stderr.read().decode().strip()}")
    return proc, line


def _stopper(proc: subprocess.Popen, scratch: tempfile.TemporaryDirectory | None = None):
    def stop():
        proc.terminate()
        proc.wait(5)
        proc.stdout.close()
        proc.stderr.close()
        if scratch is not None:
            scratch.cleanup()

    return stop


def _stdio_floor(reply_sizes: list[int], read_bytes: int = 0) -> StreamLane:
    (size,) = reply_sizes
    proc = subprocess.Popen([build_echo("pipe_echo"), str(size), str(read_bytes)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, bufsize=0)

    def stop():
        stop_piped_server(proc, 5)
        proc.stdout.close()

    return StreamLane(proc.stdout, proc.stdin.fileno(), stop)


def _unix_floor(reply_sizes: list[int]) -> StreamLane:
    (size,) = reply_sizes
    scratch = tempfile.TemporaryDirectory(prefix="unix-echo-")
    # The server's socket buffers: the echo must not move the bytes through smaller ones.
    proc, path = _spawn([build_echo("unix_echo"), os.path.join(scratch.name, "echo.sock"), str(size),
                         str(SOCKET_BUFFER_BYTES)])
    return connect_unix(path, _stopper(proc, scratch))


def _zmq_floor(endpoint_for: Callable[[str], str]) -> Callable[[list[int]], ZmqLane]:
    def open_lane(reply_sizes: list[int]) -> ZmqLane:
        scratch = tempfile.TemporaryDirectory(prefix="zmq-echo-")
        proc, endpoint = _spawn([build_echo("zmq_echo", ("-lzmq",)), endpoint_for(scratch.name),
                                 *map(str, reply_sizes)])
        return ZmqLane(endpoint, _stopper(proc, scratch))

    return open_lane


FLOORS = {
    "stdio": _stdio_floor,
    "unix": _unix_floor,
    "zmq-ipc": _zmq_floor(lambda scratch: f"ipc://{scratch}/echo.ipc"),
    "zmq-tcp": _zmq_floor(lambda scratch: "tcp://127.0.0.1:*"),
}
_ECHO_PROGRAMS = {"stdio": ("pipe_echo", ()), "unix": ("unix_echo", ()),
                  "zmq-ipc": ("zmq_echo", ("-lzmq",)), "zmq-tcp": ("zmq_echo", ("-lzmq",))}


def floor_missing(transport: str) -> str | None:
    """Why `transport` can have no echo floor here (no compiler, no libzmq headers), or None."""
    try:
        build_echo(*_ECHO_PROGRAMS[transport])
    except EchoUnavailable as exc:
        return str(exc)
    return None


def open_floor(transport: str, reply_sizes: list[int], read_bytes: int = 0):
    """A connected lane to a fresh echo for `transport` answering every request with a reply
    of `reply_sizes`: on a stream transport one item, the reply body's bytes (without the
    length prefix); on ZeroMQ the bytes of each reply frame (body, then raw buffers). With
    `read_bytes` (stdio only), the echo reads that many bytes of its own memory before each
    reply: the floor of a server that must read them (a model's weights) to answer."""
    if transport not in FLOORS:
        raise ValueError(f"transport: expected one of {', '.join(FLOORS)}, got {transport!r}")
    if read_bytes:
        if transport != "stdio":
            raise ValueError(f"read_bytes: only the stdio echo reads before replying, got transport {transport!r}")
        return _stdio_floor(list(reply_sizes), read_bytes)
    return FLOORS[transport](list(reply_sizes))
