"""How the benchmark reaches the server under test: the transports it knows (a table, so a
transport is benchmarked as soon as this checkout's server and client speak it), the server it
spawns or connects to, and each transport's floor (floors.py: a C echo of the same bytes over
the same kind of channel)."""

from __future__ import annotations

import importlib.util
import os
import tempfile
from collections import deque
from dataclasses import dataclass
from typing import Callable

import protocol
from bridge import client as clients

from . import floors
from .measure import Lane

# How long a transport the server lists may take to answer its first ping.
PROBE_TIMEOUT_S = 5.0


class BenchError(RuntimeError):
    """The benchmark cannot run as asked; the message says what was expected and what came."""


@dataclass(frozen=True)
class TransportSpec:
    """A transport the benchmark can drive, named as floors.py names its echo.

    client_class  the name of its client in bridge.client (missing there: not benchmarked)
    option        the server's option that opens it, with `value(scratch_dir)` its argument;
                  None for stdio, the spawned server's own pipes
    endpoint      (info's transport entries, the value given) → where to connect, or None when
                  the server does not list it
    multipart     requests and replies carry tensors as raw ZeroMQ frames after the body
    """

    name: str
    client_class: str
    option: str | None = None
    value: Callable[[str], str] | None = None
    endpoint: Callable[[list[str], str], str | None] | None = None
    multipart: bool = False

    def missing(self) -> str | None:
        """Why this checkout cannot drive the transport, or None."""
        if not hasattr(clients, self.client_class):
            return f"bridge.client has no {self.client_class}"
        if self.multipart and importlib.util.find_spec("zmq") is None:
            return "pyzmq is not installed"
        return None

    def connect(self, endpoint: str):
        return getattr(clients, self.client_class)(endpoint)

    def request_frames(self, op: str, wire_args: dict) -> list:
        """A request as this transport carries it: what its floor echoes."""
        if self.multipart:
            buffers: list = []
            body = protocol.encode_request(1, op, wire_args, buffers=buffers)
            return floors.ZmqLane.frame(body, buffers)
        return floors.StreamLane.frame(protocol.encode_request(1, op, wire_args))

    def reply_sizes(self, reply) -> list[int]:
        """The sizes its floor answers with: the reply body on a stream (no length prefix);
        on ZeroMQ each frame, the body and then every tensor's raw buffer."""
        if not self.multipart:
            return [reply.bytes_in - protocol.framing.HEADER_SIZE]
        tensors = [v.nbytes for v in (reply.result or {}).values() if hasattr(v, "nbytes")]
        return [reply.bytes_in - sum(tensors), *tensors]


def _listed(prefix: str) -> Callable[[list[str], str], str | None]:
    """Finds the entry `prefix + value` in info's transports; the endpoint is the value."""
    return lambda listed, value: value if f"{prefix}{value}" in listed else None


def _tcp_endpoint(listed: list[str], value: str) -> str | None:
    """The server binds `tcp://127.0.0.1:*` and lists the port it got."""
    bound = [entry.split(" ", 1)[1] for entry in listed if entry.startswith("zmq tcp://127.0.0.1:")]
    return bound[0] if bound else None


TRANSPORTS: dict[str, TransportSpec] = {spec.name: spec for spec in (
    TransportSpec("stdio", "PortClient"),
    TransportSpec("unix", "UnixClient", "--unix", lambda scratch: os.path.join(scratch, "bridge.sock"),
                  _listed("unix ")),
    TransportSpec("zmq-ipc", "ZmqClient", "--zmq", lambda scratch: f"ipc://{scratch}/bridge.ipc",
                  _listed("zmq "), multipart=True),
    TransportSpec("zmq-tcp", "ZmqClient", "--zmq", lambda scratch: "tcp://127.0.0.1:*", _tcp_endpoint,
                  multipart=True),
)}


def choose_transports(names: str | None) -> tuple[list[TransportSpec], list[dict]]:
    """The transports to benchmark (all that this checkout serves when `names` is None) and,
    for those left out, why."""
    wanted = list(TRANSPORTS) if names is None else [n.strip() for n in names.split(",") if n.strip()]
    unknown = [n for n in wanted if n not in TRANSPORTS]
    if unknown or not wanted:
        raise BenchError(f"--transports: expected names from {', '.join(TRANSPORTS)}, got {', '.join(unknown) or repr(names)}")
    repeated = sorted({n for n in wanted if wanted.count(n) > 1})
    if repeated:  # one lane's samples and floor are kept by its name: twice would mix them
        raise BenchError(f"--transports: expected each name once, got {', '.join(repeated)} more than once")
    chosen, skipped = [], []
    for name in wanted:
        reason = TRANSPORTS[name].missing()
        if reason is None:
            chosen.append(TRANSPORTS[name])
        else:
            skipped.append({"what": f"transport {name}", "reason": reason})
    if not chosen:
        raise BenchError("no transport to benchmark: " + "; ".join(s["reason"] for s in skipped))
    return chosen, skipped


def spec_for_endpoint(endpoint: str) -> TransportSpec:
    """The transport `--connect ENDPOINT` names: ipc://… and tcp://… are ZeroMQ, unix:PATH a
    unix socket."""
    for prefix, name in (("ipc://", "zmq-ipc"), ("tcp://", "zmq-tcp"), ("unix:", "unix")):
        if endpoint.startswith(prefix):
            spec = TRANSPORTS[name]
            reason = spec.missing()
            if reason:
                raise BenchError(f"--connect {endpoint}: cannot drive {name} here: {reason}")
            return spec
    raise BenchError(f"--connect: expected unix:PATH, ipc://PATH or tcp://HOST:PORT, got {endpoint!r}")


def make_lane(spec: TransportSpec, client) -> Lane:
    missing = floors.floor_missing(spec.name)
    make_floor = None if missing else (lambda reply: floors.open_floor(spec.name, spec.reply_sizes(reply)))
    return Lane(spec.name, client, spec.request_frames, make_floor, missing)


def _unanswered_ping(client) -> str | None:
    """Why a transport the server lists does not work (so that it is skipped, not waited on
    for every request of the sweep), or None."""
    try:
        client.request("ping", timeout=PROBE_TIMEOUT_S).unwrap()
    except TimeoutError:
        return f"no reply to ping within {PROBE_TIMEOUT_S:.0f} s"
    except (clients.BridgeError, clients.ServerExited, OSError) as exc:
        return f"ping failed: {exc}"
    return None


def log_tail(log, lines: int = 15) -> str:
    """The last `lines` lines of a server's log file, for an error message."""
    log.seek(0)
    return b"".join(deque(log, maxlen=lines)).decode(errors="replace").rstrip()


class BenchServer:
    """What the benchmark reads of a server: its `info`, its `lanes`; `close` in subclasses."""

    info: dict
    lanes: list

    @property
    def backend(self) -> str:
        return self.info["backend"]

    @property
    def device(self) -> str:
        return self.info["device"]["device"]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class SpawnedServer(BenchServer):
    """`python -m bridge` with every chosen transport open, and a Lane per transport its `info`
    lists. The benchmark holds it by its stdin/stdout (the stdio lane, and the server's life:
    it exits when stdin closes), so stdio is always served. Its log goes to a temporary file,
    shown when it fails to start."""

    def __init__(self, specs: list[TransportSpec], server_args: list[str]):
        self.scratch = tempfile.TemporaryDirectory(prefix="bridge-bench-")
        self.log = tempfile.TemporaryFile(mode="w+b")
        self.lanes: list[Lane] = []
        self.skipped: list[dict] = []
        self.port = None
        values = {spec.name: spec.value(self.scratch.name) for spec in specs if spec.option}
        args = list(server_args)
        if values:
            args.append("--stdio")
        for spec in specs:
            if spec.option:
                args += [spec.option, values[spec.name]]
        try:
            self.port = clients.PortClient(args, stderr=self.log)
            self.info = self.port.info()
            listed = self.info["transports"]
            for spec in specs:
                if spec.option is None:
                    self.lanes.append(make_lane(spec, self.port))
                    continue
                endpoint = spec.endpoint(listed, values[spec.name])
                if endpoint is None:
                    self.skipped.append({"what": f"transport {spec.name}",
                                         "reason": f"the server's info lists only {listed}"})
                    continue
                client = spec.connect(endpoint)
                reason = _unanswered_ping(client)
                if reason is None:
                    self.lanes.append(make_lane(spec, client))
                else:
                    client.close()
                    self.skipped.append({"what": f"transport {spec.name}", "reason": f"{endpoint}: {reason}"})
        except (clients.ServerExited, TimeoutError, OSError) as exc:
            tail = log_tail(self.log)
            self.close()
            raise BenchError(f"the server (python -m bridge {' '.join(args)}) did not start: {exc}; "
                             f"its log ends:\n{tail}") from exc
        except BaseException:
            self.close()  # a stop signal's exit, say: no caller holds this server yet to stop it
            raise

    def close(self) -> None:
        for lane in self.lanes:
            if lane.client is not self.port:
                lane.client.close()
        if self.port is not None:
            self.port.close()
        self.log.close()
        self.scratch.cleanup()


class ConnectedServer(BenchServer):
    """A server somebody else started (`--connect ENDPOINT`), over the one transport named."""

    def __init__(self, endpoint: str):
        spec = spec_for_endpoint(endpoint)
        address = endpoint.removeprefix("unix:") if spec.name == "unix" else endpoint
        try:
            client = spec.connect(address)
        except (OSError, TimeoutError) as exc:
            raise BenchError(f"--connect {endpoint}: {exc}") from exc
        try:
            self.info = client.info()
        except (OSError, TimeoutError, clients.ServerExited) as exc:
            client.close()
            raise BenchError(f"--connect {endpoint}: no answer to info: {exc!r}") from exc
        self.lanes = [make_lane(spec, client)]
        self.skipped: list[dict] = []

    def close(self) -> None:
        self.lanes[0].client.close()
