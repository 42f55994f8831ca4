"""The unix-socket and ZeroMQ lanes end to end, through real server processes: every lane and
tensor form against the reference, REQ and DEALER peers, many concurrent pipelining clients,
peers that vanish or stop reading, per-peer bounds, CURVE, and the multipart form (SPEC §5)
from the protocol layer up; the unix lane's one reading thread with frames that come in pieces,
oversized, past a peer's cap, after a half-close, and with the server out of descriptors."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import signal
import socket
import struct
import subprocess
import termios
import sys
import threading
import time
from array import array
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import msgpack
import numpy as np
import pytest
import torch
import zmq

import protocol
from bridge.client import UnixClient, ZmqClient, result_from_wire, server_env
from bridge.native import NativeStepError
from bridge.bench.lanes import TRANSPORTS
from bridge.buffers import BufferPool
from bridge.transports.framed import FrameAssembler, read_exact, read_frame
from bridge.transports.zmq import ZmqTransport, resolve_endpoint, split_envelope
from bridge_fakes import InProcessServer, served_natively
from kernel_cases import (STATE_TOLERANCE, ScanCase, UpdateCase, assert_close, make_scan_inputs,
                          make_update_inputs, reference_scan, reference_update)

START_TIMEOUT_S = 180.0
REPLY_TIMEOUT_S = 60.0


def numpy_args(inputs: dict) -> dict:
    return {k: v.numpy() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}


def assert_reply_matches_reference(reply, inputs: dict, what: str = "y") -> None:
    """`reply`: a client's, or a protocol.Reply read off a raw socket."""
    if isinstance(reply, protocol.Reply):
        assert reply.ok, f"{what}: {reply.error}"
        result = result_from_wire(reply.result)
    else:
        result = reply.unwrap()
    y_ref, state_ref = reference_scan(inputs)
    assert_close(torch.from_numpy(np.array(result["y"])), y_ref, torch.float32, what)
    if inputs.get("return_state"):
        assert_close(torch.from_numpy(np.array(result["state"])), state_ref, torch.float32, what + " state")


class ServerProcess:
    """`python -m bridge` with the given transports; its log goes to a file shown on failure."""

    def __init__(self, directory, *args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL):
        self.directory = directory
        self.log_path = os.path.join(directory, "server.log")
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "bridge", "--device", "cpu", *args],
                                         stdin=stdin, stdout=stdout, stderr=log, env=server_env())

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def wait_for_path(self, path: str) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not os.path.exists(path):
            if self.proc.poll() is not None:
                pytest.fail(f"the server exited with {self.proc.returncode}:\n{self.log()}")
            if time.monotonic() > deadline:
                pytest.fail(f"the server did not create {path}:\n{self.log()}")
            time.sleep(0.05)

    def stop(self, timeout: float = 10.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise


def zmq_endpoint(info: dict, name: str, value: str) -> str:
    """Where to connect to the ZeroMQ lane bound with `--zmq value` (`name` zmq-ipc or
    zmq-tcp), read from info as the benchmark reads it."""
    endpoint = TRANSPORTS[name].endpoint(info["transports"], value)
    if endpoint is None:
        raise AssertionError(f"no {name} endpoint for {value} in {info['transports']}")
    return endpoint


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """One server with every lane: stdio (its pipes), a unix socket, zmq ipc and zmq tcp."""
    directory = str(tmp_path_factory.mktemp("lanes"))
    unix_path = os.path.join(directory, "bridge.sock")
    ipc = f"ipc://{directory}/bridge.ipc"
    srv = ServerProcess(directory, "--stdio", "--unix", unix_path, "--zmq", ipc, "--zmq", "tcp://:*",
                        stdin=subprocess.PIPE)
    srv.wait_for_path(unix_path)
    with UnixClient(unix_path) as probe:
        info = probe.info()
    srv.unix = unix_path
    srv.ipc = zmq_endpoint(info, "zmq-ipc", ipc)
    # With no host, the server binds loopback (test_info_lists_every_lane_and_tcp_binds_loopback).
    srv.tcp = zmq_endpoint(info, "zmq-tcp", "tcp://:*")
    srv.info = info
    yield srv
    # stdio is served too, so closing stdin ends the server, as with a Port.
    srv.proc.stdin.close()
    assert srv.proc.wait(10) == 0, srv.log()


def lane_client(server, lane: str):
    if lane == "unix":
        return UnixClient(server.unix)
    transport, form = lane.split("-")
    return ZmqClient(getattr(server, transport), multipart=form == "multipart")


LANES = [
    pytest.param("unix", id="unix"),
    pytest.param("ipc-multipart", id="zmq-ipc-multipart"),
    pytest.param("ipc-inline", id="zmq-ipc-inline"),
    pytest.param("tcp-multipart", id="zmq-tcp-multipart"),
    pytest.param("tcp-inline", id="zmq-tcp-inline"),
]


# -- every lane -------------------------------------------------------------------------------

def test_info_lists_every_lane_and_tcp_binds_loopback(server):
    kinds = [entry.split(" ", 1)[0] for entry in server.info["transports"]]
    assert kinds == ["stdio", "unix", "zmq", "zmq"]
    # `--zmq tcp://:*` names no host: the server binds loopback, never every interface.
    (tcp,) = [entry for entry in server.info["transports"] if entry.startswith("zmq tcp://")]
    assert tcp.startswith("zmq tcp://127.0.0.1:") and int(tcp.rsplit(":", 1)[1]) > 0


def test_stdio_is_served_beside_the_sockets(server):
    # The stdio replies go to the server's stdout, which this test does not read: ask the
    # server over another lane that the frame arrived and was answered.
    with UnixClient(server.unix) as client:
        answered = client.stats()["ops"].get("info", {}).get("success_count", 0)
        body = msgpack.packb({"v": 1, "id": 5, "op": "info"})
        server.proc.stdin.write(struct.pack(">I", len(body)) + body)
        server.proc.stdin.flush()
        deadline = time.monotonic() + REPLY_TIMEOUT_S
        while client.stats()["ops"]["info"]["success_count"] < answered + 1:
            assert time.monotonic() < deadline, "the stdio request was never answered"
            time.sleep(0.05)


@pytest.mark.parametrize("lane", LANES)
@pytest.mark.parametrize("case", [
    pytest.param(ScanCase(2, 7, 5, 3, D=True, z=True), id="odd"),
    pytest.param(ScanCase(3, 37, 20, 16, groups=2, D=True, z=True, dt_bias=True, dt_softplus=True,
                          clamp=True, h0=True), id="all-options"),
    pytest.param(ScanCase(1, 300, 129, 16, layout="bdl", D=True), id="big-bdl"),
])
def test_scan_matches_reference_on_every_lane(server, lane, case):
    inputs = make_scan_inputs(case)
    with lane_client(server, lane) as client:
        assert client.ping() == {"pong": True}
        reply = client.scan(**numpy_args(inputs))
        assert_reply_matches_reference(reply, inputs)
        assert reply.timing["server_us"] > 0


@pytest.mark.parametrize("lane", LANES)
def test_stats_count_message_bytes_alike_on_every_lane(server, lane):
    """bytes_in and bytes_out count each request's and reply's body and raw buffers, not the
    length prefix of a stream lane (which the client's byte counts include)."""
    prefix = 4 if lane == "unix" else 0
    with lane_client(server, lane) as client:
        first = client.request("stats")
        scan = client.scan(**numpy_args(make_scan_inputs(ScanCase(2, 7, 5, 3, D=True))))
        second = client.request("stats")
    before, after = first.unwrap(), second.unwrap()
    # In between: the scan's and the second snapshot's requests came in; the first snapshot's
    # reply and the scan's went out.
    assert after["bytes_in"] - before["bytes_in"] == scan.bytes_out + second.bytes_out - 2 * prefix
    assert after["bytes_out"] - before["bytes_out"] == first.bytes_in + scan.bytes_in - 2 * prefix


@pytest.mark.parametrize("lane", LANES)
def test_sessions_and_handles_on_every_lane(server, lane):
    """A session prefilled by a scan, then stepped. A step in one frame (every lane but
    multipart ZeroMQ) is served by the native step path, which makes no host copies (h2d_us and
    d2h_us 0); a multipart one, its tensors in frames of their own, by the general path."""
    inputs = make_scan_inputs(ScanCase(2, 9, 6, 5, D=True))
    args = numpy_args(inputs)
    with lane_client(server, lane) as client:
        handle = client.put(args["A"])
        session = client.open_session(2, 6, 5)
        reply = client.scan(**{**args, "A": handle}, session=session)
        assert_reply_matches_reference(reply, inputs)
        kept = torch.from_numpy(np.array(client.session_state(session)))
        assert_close(kept, reference_scan(inputs)[1], torch.float32, "kept state")
        frame = {k: v for k, v in make_update_inputs(UpdateCase(2, 6, 5, D=True, bc_2d=True)).items()
                 if k not in ("state", "A")}
        reply = client.step(session, A=handle, **numpy_args(frame))
        assert reply.ok, reply.error
        y_ref, state_ref = reference_update({**frame, "A": inputs["A"], "state": kept})
        assert_close(torch.from_numpy(np.array(reply.result["y"])), y_ref, torch.float32, "step y")
        assert_close(torch.from_numpy(np.array(client.session_state(session))), state_ref, torch.float32,
                     "stepped state", STATE_TOLERANCE)
        assert served_natively(reply) is not lane.endswith("multipart"), reply.timing
        client.close_session(session)
        client.free(handle)


def zmq_exchange(endpoint: str, frames: list, socket_type=zmq.DEALER, timeout_s=REPLY_TIMEOUT_S) -> list:
    context = zmq.Context.instance()
    sock = context.socket(socket_type)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        sock.send_multipart(frames)
        if not sock.poll(timeout_s * 1000):
            raise TimeoutError(f"no reply from {endpoint}")
        return sock.recv_multipart()
    finally:
        sock.close()


def scan_message(inputs: dict, request_id, multipart: bool) -> list:
    wire = {k: protocol.OutTensor("f32", v.shape, v.contiguous().numpy()) if isinstance(v, torch.Tensor) else v
            for k, v in inputs.items()}
    buffers = [] if multipart else None
    parts = protocol.encode_request(request_id, "scan", wire, buffers=buffers)
    return [b"".join(parts), *map(bytes, buffers or ())]


@pytest.mark.parametrize("socket_type", [pytest.param(zmq.DEALER, id="dealer"), pytest.param(zmq.REQ, id="req")])
@pytest.mark.parametrize("multipart", [pytest.param(True, id="multipart"), pytest.param(False, id="inline")])
def test_replies_keep_the_peers_envelope_and_the_requests_form(server, socket_type, multipart):
    inputs = make_scan_inputs(ScanCase(2, 11, 7, 3, return_state=True))
    frames = zmq_exchange(server.ipc, scan_message(inputs, 41, multipart), socket_type)
    # REQ strips the delimiter it needs; DEALER gets none: either way the body comes first.
    body, buffers = frames[0], frames[1:]
    raw = msgpack.unpackb(body)
    assert raw["id"] == 41 and raw["ok"] is True
    if multipart:
        assert {raw["result"]["y"]["buf"], raw["result"]["state"]["buf"]} == {0, 1} and len(buffers) == 2
    else:
        assert "data" in raw["result"]["y"] and buffers == []
    reply = protocol.decode_reply(body, buffers)
    y_ref, state_ref = reference_scan(inputs)
    y = torch.frombuffer(bytearray(reply.result["y"].data), dtype=torch.float32).view(reply.result["y"].shape)
    assert_close(y, y_ref, torch.float32, "y")


@pytest.mark.parametrize("message, code, field", [
    pytest.param(lambda t: [msgpack.packb({"v": 1, "id": 1, "op": "put", "args": {"tensor": {**t, "buf": 1}}}),
                            b"\x01" * 12], "invalid_argument", "args.tensor.buf", id="index-out-of-range"),
    pytest.param(lambda t: [msgpack.packb({"v": 1, "id": 1, "op": "put", "args": {"tensor": {**t, "buf": 0}}}),
                            b"\x01" * 11], "tensor_size_mismatch", "args.tensor.buf", id="short-buffer"),
    pytest.param(lambda t: [msgpack.packb({"v": 1, "id": 1, "op": "put", "args": {"tensor": {**t, "buf": 0}}}),
                            b"\x01" * 12, b"\x02" * 4], "invalid_request", "buffers[1]", id="stray-buffer"),
    pytest.param(lambda t: [msgpack.packb({"v": 1, "id": 1, "op": "put",
                                           "args": {"tensor": {**t, "buf": 0, "data": b"\x01" * 12}}}),
                            b"\x01" * 12], "invalid_argument", "args.tensor", id="buf-and-data"),
    pytest.param(lambda t: [msgpack.packb({"v": 1, "id": 1, "op": "put", "args": {"tensor": {**t, "buf": 0}}})],
                 "invalid_argument", "args.tensor.buf", id="no-buffers"),
    pytest.param(lambda t: [msgpack.packb({"v": 1, "id": 1, "op": "put", "args": {"tensor": {**t, "buf": "0"}}}),
                            b"\x01" * 12], "invalid_argument", "args.tensor.buf", id="index-not-int"),
    pytest.param(lambda t: [msgpack.packb({"op": "ping"}), b"\x01" * 12], "invalid_request", "buffers",
                 id="legacy-with-buffers"),
    pytest.param(lambda t: [b"\xc1", b"\x01" * 12], "decode_error", None, id="body-not-msgpack"),
])
def test_a_malformed_multipart_message_gets_an_error_reply(server, message, code, field):
    frames = zmq_exchange(server.ipc, message({"dtype": "f32", "shape": [3]}))
    reply = msgpack.unpackb(frames[0])
    if field == "buffers":  # a legacy request is answered in the legacy format
        assert reply["status"] == "error" and "buffers" in reply["message"]
        return
    assert reply["ok"] is False and reply["error"]["code"] == code, reply
    assert reply["error"]["detail"].get("field") == field
    with ZmqClient(server.ipc) as client:
        assert client.ping() == {"pong": True}


def test_the_legacy_format_is_served_on_the_unix_lane(server):
    rng = np.random.default_rng()
    b, l, h, n = 2, 3, 5, 4
    f32 = lambda *shape: rng.uniform(-1, 1, shape).astype(np.float32)  # noqa: E731
    x, dt, A, B, C = f32(b, l, h), rng.uniform(0.01, 0.09, (b, l, h)).astype(np.float32), \
        -rng.uniform(0.1, 2, (h, n)).astype(np.float32), f32(b, l, n), f32(b, l, n)
    body = msgpack.packb({"op": "scan", "batch": b, "seq_len": l, "hidden": h, "state": n,
                          "x": x.tobytes(), "dt": dt.tobytes(), "A": A.tobytes(), "B": B.tobytes(),
                          "C": C.tobytes()}, use_bin_type=False)
    with UnixClient(server.unix) as client:
        client.send_raw(body)
        deadline = time.monotonic() + REPLY_TIMEOUT_S
        while not client.unmatched:
            assert time.monotonic() < deadline
            time.sleep(0.01)
    reply = msgpack.unpackb(client.unmatched[0].extra["raw"], raw=False)
    assert reply["status"] == "ok" and reply["shape"] == [b, l, h]
    inputs = {"x": torch.from_numpy(x), "dt": torch.from_numpy(dt), "A": torch.from_numpy(A),
              "B": torch.from_numpy(B), "C": torch.from_numpy(C), "dt_min": 0.001, "dt_max": 0.1}
    y = torch.frombuffer(bytearray(reply["result"]), dtype=torch.float32).view(b, l, h)
    assert_close(y, reference_scan(inputs)[0], torch.float32, "legacy y")


# -- many clients -----------------------------------------------------------------------------

CLIENT_LANES = ["ipc-multipart"] * 5 + ["ipc-inline"] * 3 + ["tcp-multipart"] * 2 + ["unix"] * 6
PIPELINED = 24


def test_sixteen_pipelining_clients_each_get_exactly_their_replies(server):
    assert len(CLIENT_LANES) == 16
    case = ScanCase(2, 7, 5, 3, D=True, z=True)
    start = threading.Barrier(len(CLIENT_LANES))

    def run(index: int, lane: str):
        with lane_client(server, lane) as client:
            requests = [make_scan_inputs(case) for _ in range(PIPELINED)]
            start.wait()
            futures = [client.submit("scan", numpy_args(inputs),
                                     request_id=f"c{index}-{i}" if i % 2 else index * 1000 + i)
                       for i, inputs in enumerate(requests)]
            replies = [f.result(REPLY_TIMEOUT_S) for f in futures]
            time.sleep(0.1)  # a duplicate reply would land in unmatched by now
            return lane, requests, replies, list(client.unmatched)

    with ThreadPoolExecutor(len(CLIENT_LANES)) as pool:
        results = list(pool.map(run, range(len(CLIENT_LANES)), CLIENT_LANES))
    for index, (lane, requests, replies, unmatched) in enumerate(results):
        assert not unmatched, f"client {index} ({lane}) got replies to nothing it asked"
        for i, (inputs, reply) in enumerate(zip(requests, replies)):
            assert reply.id == (f"c{index}-{i}" if i % 2 else index * 1000 + i)
            assert_reply_matches_reference(reply, inputs, f"client {index} ({lane}) request {i}")


@pytest.mark.parametrize("lane", [pytest.param("unix", id="unix"), pytest.param("ipc-multipart", id="zmq")])
def test_a_client_that_vanishes_mid_request_disturbs_no_one_and_loses_its_session(server, lane):
    with UnixClient(server.unix) as observer:
        sessions_before = observer.stats()["sessions"]["sessions"]
        leaver = lane_client(server, lane)
        leaver.open_session(1, 4, 2)
        assert observer.stats()["sessions"]["sessions"] == sessions_before + 1
        # Requests quick to send and slow to compute, that keep the server busy well after the
        # client has gone: it leaves once the first is answered.
        slow = numpy_args(make_scan_inputs(ScanCase(1, 200, 64, 64, D=True)))
        futures = [leaver.submit("scan", slow) for _ in range(100)]
        futures[0].result(REPLY_TIMEOUT_S)
        if lane == "unix":
            leaver.sock.shutdown(socket.SHUT_RDWR)  # gone, not a polite half-close
        leaver.close()
        stayer_inputs = [make_scan_inputs(ScanCase(2, 7, 5, 3)) for _ in range(8)]
        with lane_client(server, lane) as stayer:
            futures = [stayer.submit("scan", numpy_args(i)) for i in stayer_inputs]
            for inputs, future in zip(stayer_inputs, futures):
                assert_reply_matches_reference(future.result(REPLY_TIMEOUT_S), inputs)
        deadline = time.monotonic() + REPLY_TIMEOUT_S
        while observer.stats()["sessions"]["sessions"] != sessions_before:
            assert time.monotonic() < deadline, "the vanished client's session was never freed"
            time.sleep(0.1)


@pytest.mark.parametrize("lane", [pytest.param("unix", id="unix"), pytest.param("ipc-multipart", id="zmq-ipc"),
                                  pytest.param("tcp-inline", id="zmq-tcp")])
def test_closing_a_connection_frees_its_sessions_and_handles(server, lane):
    """With nothing in flight: on ZeroMQ the server learns of it from the socket monitor."""
    with UnixClient(server.unix) as observer:
        before = observer.stats()
        with lane_client(server, lane) as owner:
            owner.open_session(2, 3, 4)
            owner.put(np.random.default_rng().standard_normal((5, 3), dtype=np.float32))
            during = observer.stats()
            assert during["sessions"]["sessions"] == before["sessions"]["sessions"] + 1
            assert during["handles"]["handles"] == before["handles"]["handles"] + 1
        deadline = time.monotonic() + REPLY_TIMEOUT_S
        while True:
            after = observer.stats()
            if (after["sessions"]["sessions"], after["handles"]["handles"]) == \
                    (before["sessions"]["sessions"], before["handles"]["handles"]):
                break
            assert time.monotonic() < deadline, "the closed connection's session and handle were never freed"
            time.sleep(0.05)


@pytest.mark.parametrize("lane", [pytest.param("ipc-multipart", id="zmq-ipc"), pytest.param("tcp-inline", id="zmq-tcp")])
def test_a_new_zmq_connection_keeps_its_sessions_when_an_old_one_ends(server, lane):
    """A connection that ends just before another opens (which likely gets its descriptor)
    frees only its own sessions."""
    for _ in range(5):
        with lane_client(server, lane) as old:
            old.open_session(1, 3, 2)
        with lane_client(server, lane) as new:
            kept = new.open_session(1, 3, 2)
            time.sleep(0.1)  # the server has long read the old connection's end
            assert new.session_state(kept).shape == (1, 3, 2)
            new.close_session(kept)


# -- bounds: a server with small limits -------------------------------------------------------

@pytest.fixture(scope="module")
def limited(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("limited"))
    unix_path = os.path.join(directory, "bridge.sock")
    srv = ServerProcess(directory, "--unix", unix_path, "--zmq", f"ipc://{directory}/bridge.ipc",
                        "--max-in-flight-per-peer", "2", "--zmq-hwm", "3", "--max-connections", "4",
                        "--max-frame-size", "3000000")
    srv.wait_for_path(unix_path)
    srv.unix, srv.ipc = unix_path, f"ipc://{directory}/bridge.ipc"
    yield srv
    assert srv.stop() == 0, srv.log()


def request_frame(request_id, op: str, args: dict | None = None) -> bytes:
    return b"".join(protocol.frame_parts(protocol.encode_request(request_id, op, args or {})))


def scan_frame(request_id, inputs: dict) -> bytes:
    return request_frame(request_id, "scan", {k: protocol.OutTensor("f32", v.shape, v.numpy())
                                              if isinstance(v, torch.Tensor) else v for k, v in inputs.items()})


def read_reply(reader) -> protocol.Reply:
    body = read_frame(reader)
    assert body is not None, "the server closed the connection instead of replying"
    return protocol.decode_reply(body)


def raw_unix(path: str) -> socket.socket:
    """A raw connection whose reads and writes fail rather than hang when the server is stuck."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(REPLY_TIMEOUT_S)
    sock.connect(path)
    return sock


def test_info_reports_the_lanes_caps_with_the_other_limits(limited):
    """A client keeps its own in-flight bound within the server's per-connection cap, which it
    reads here (the Elixir client does)."""
    with UnixClient(limited.unix) as client:
        limits = client.info()["limits"]
    assert (limits["max_in_flight_per_peer"], limits["max_connections"], limits["max_frame_size"]) == (2, 4, 3000000)


def test_a_unix_peer_that_reads_nothing_does_not_hold_up_the_others(limited):
    # Replies of ~1 MB each: the stuck peer's socket buffer fills at once.
    inputs = make_scan_inputs(ScanCase(1, 1024, 256, 4))
    stuck = raw_unix(limited.unix)
    frame = scan_frame(1, inputs)
    sender = threading.Thread(target=lambda: [stuck.sendall(frame) for _ in range(6)], daemon=True)
    sender.start()
    try:
        time.sleep(1.0)  # its replies pile up unread; its later requests wait, unread
        with UnixClient(limited.unix) as other:
            for _ in range(5):
                started = time.monotonic()
                assert other.ping() == {"pong": True}
                assert time.monotonic() - started < 2.0
        # Once it reads, it gets every reply, in order and whole.
        reader = stuck.makefile("rb", buffering=0)
        for i in range(6):
            assert_reply_matches_reference(read_reply(reader), inputs, f"reply {i}")
        reader.close()
    finally:
        stuck.close()


def input_bytes(fd: int) -> int:
    """How many bytes wait to be read on `fd` (a pipe)."""
    count = array("i", [0])
    fcntl.ioctl(fd, termios.FIONREAD, count, True)
    return count[0]


def test_a_stdio_peer_that_reads_nothing_does_not_hold_up_the_other_lanes(tmp_path):
    """A stdio reply is written by the thread that served its request, with the dispatcher's
    serving lock held, which every lane's requests wait for: a Port that stops reading its
    replies must not stop the unix lane. Written blocking, a reply the pipe had no room for held
    the lock until the Port read. Its replies still come whole and in order when it reads, the
    last ones after its stdin has closed (the server writes them before it exits)."""
    path = str(tmp_path / "bridge.sock")
    srv = ServerProcess(str(tmp_path), "--stdio", "--unix", path, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        srv.wait_for_path(path)
        inputs = make_scan_inputs(ScanCase(1, 1024, 512, 4))  # 2 MiB replies: more than a pipe holds
        frame = scan_frame(1, inputs)
        srv.proc.stdin.write(frame + frame)
        srv.proc.stdin.flush()
        stdout = srv.proc.stdout.fileno()
        room = fcntl.fcntl(stdout, fcntl.F_GETPIPE_SZ)
        wait_until(lambda: input_bytes(stdout) >= room - 4096, "the stdio replies never filled the pipe")
        with UnixClient(path) as other:
            pong = other.submit("ping")
            try:
                assert pong.result(REPLY_TIMEOUT_S).result == {"pong": True}
            except TimeoutError:
                pytest.fail("a unix ping got no answer while the stdio peer read nothing")
        srv.proc.stdin.close()
        # The server removes its socket file as it closes its lanes, stdio's last: that one
        # still writes what the pipe had no room for (until transports.base.FLUSH_SECONDS).
        wait_until(lambda: not os.path.exists(path), "the server did not stop when its stdin closed")
        replies = [read_reply(srv.proc.stdout) for _ in range(2)]
        for i, reply in enumerate(replies):
            assert_reply_matches_reference(reply, inputs, f"stdio reply {i}")
        assert srv.proc.wait(REPLY_TIMEOUT_S) == 0, srv.log()
    finally:
        srv.stop()


def test_a_unix_request_sent_in_pieces_is_read_whole_while_other_connections_are_served(limited):
    """One thread reads every unix connection: a frame that comes in pieces (its header split
    too) must not keep it from serving the others meanwhile."""
    inputs = make_scan_inputs(ScanCase(2, 64, 32, 4, D=True))
    frame = scan_frame(7, inputs)
    pieces = [frame[:2], frame[2:4], frame[4:9]] + [frame[i:i + 3000] for i in range(9, len(frame), 3000)]
    slow = raw_unix(limited.unix)
    try:
        with UnixClient(limited.unix) as other:
            for piece in pieces:
                slow.sendall(piece)
                assert other.ping() == {"pong": True}
        reader = slow.makefile("rb", buffering=0)
        reply = read_reply(reader)
        assert reply.id == 7
        assert_reply_matches_reference(reply, inputs)
        reader.close()
    finally:
        slow.close()


def test_a_unix_frame_over_the_limit_is_drained_and_answered_and_the_connection_serves_on(limited):
    limit = 3_000_000
    body = os.urandom(1 << 16) * (limit // (1 << 16) + 1)
    body = body[:limit + 1]
    big = raw_unix(limited.unix)
    try:
        with UnixClient(limited.unix) as other:
            big.sendall(struct.pack(">I", len(body)))
            for start in range(0, len(body), 1 << 20):
                big.sendall(body[start:start + (1 << 20)])
                assert other.ping() == {"pong": True}
        big.sendall(request_frame(2, "ping"))
        reader = big.makefile("rb", buffering=0)
        refused = read_reply(reader)
        assert refused.id is None and refused.error["code"] == "frame_too_large"
        assert refused.error["detail"] == {"length": limit + 1, "limit": limit}
        pong = read_reply(reader)
        assert (pong.id, pong.result) == (2, {"pong": True})
        reader.close()
    finally:
        big.close()


def test_a_unix_peer_pipelining_past_its_cap_gets_every_reply(limited):
    """The cap is 2 in flight: the other requests wait unread in the socket until answers free
    a slot, then are read and served."""
    requests = {i: make_scan_inputs(ScanCase(1 + i % 3, 5 + i, 4, 2, z=bool(i % 2))) for i in range(12)}
    sock = raw_unix(limited.unix)
    try:
        sock.sendall(b"".join(scan_frame(i, inputs) for i, inputs in requests.items()))
        reader = sock.makefile("rb", buffering=0)
        replies = [read_reply(reader) for _ in requests]
        assert sorted(reply.id for reply in replies) == sorted(requests)
        for reply in replies:
            assert_reply_matches_reference(reply, requests[reply.id], f"request {reply.id}")
        reader.close()
    finally:
        sock.close()


def test_a_unix_peer_that_half_closes_gets_its_replies_then_its_session_is_freed(limited):
    with UnixClient(limited.unix) as observer:
        sessions_before = observer.stats()["sessions"]["sessions"]
        sock = raw_unix(limited.unix)
        try:
            reader = sock.makefile("rb", buffering=0)
            sock.sendall(request_frame("open", "session_open", {"batch": 1, "dim": 4, "state": 2}))
            assert read_reply(reader).ok
            assert observer.stats()["sessions"]["sessions"] == sessions_before + 1
            # Slow to compute, small to send back: still in flight when the end of input is read,
            # and their replies fit in the socket buffers while this test is still sending.
            requests = [make_scan_inputs(ScanCase(1, 600, 16, 32, D=True)) for _ in range(4)]
            sock.sendall(b"".join(scan_frame(i, inputs) for i, inputs in enumerate(requests)))
            sock.shutdown(socket.SHUT_WR)
            for i, inputs in enumerate(requests):
                reply = read_reply(reader)
                assert reply.id == i
                assert_reply_matches_reference(reply, inputs, f"request {i}")
            assert reader.read(1) == b"", "the server kept the connection open after answering all"
            reader.close()
        finally:
            sock.close()
        deadline = time.monotonic() + REPLY_TIMEOUT_S
        while observer.stats()["sessions"]["sessions"] != sessions_before:
            assert time.monotonic() < deadline, "the half-closed connection's session was never freed"
            time.sleep(0.05)


def test_a_zmq_peer_past_its_queue_is_answered_overloaded_and_others_are_served(limited):
    context = zmq.Context.instance()
    flood = context.socket(zmq.DEALER)
    flood.setsockopt(zmq.LINGER, 0)
    flood.connect(limited.ipc)
    # Each takes the server far longer to compute than to receive: they all arrive while the
    # first are computed.
    inputs = make_scan_inputs(ScanCase(1, 1000, 128, 64))
    sent = 30
    message = scan_message(inputs, 0, multipart=True)
    for i in range(sent):
        body = b"".join(protocol.encode_request(i, "scan", {k: protocol.OutTensor("f32", v.shape, v.numpy())
                                                             if isinstance(v, torch.Tensor) else v
                                                             for k, v in inputs.items()}, buffers=[]))
        flood.send_multipart([body, *message[1:]])
    with ZmqClient(limited.ipc) as other:
        assert other.ping() == {"pong": True}
    codes = {}
    while len(codes) < sent:
        assert flood.poll(REPLY_TIMEOUT_S * 1000), f"replies to {sorted(set(range(sent)) - set(codes))} never came"
        frames = flood.recv_multipart()
        reply = protocol.decode_reply(frames[0], frames[1:])
        assert reply.id not in codes, f"two replies to {reply.id}"
        codes[reply.id] = "ok" if reply.ok else reply.error["code"]
    flood.close()
    # 2 in flight + 3 waiting are served; what came while all 5 were taken is declined.
    assert set(codes.values()) == {"ok", "overloaded"}, codes
    assert list(codes.values()).count("ok") >= 5


def raw_ping(path: str):
    """(socket, reply, closed) of a ping on a fresh unix connection; the socket is left open;
    `closed`: an error reply was followed by the server closing the connection."""
    sock = raw_unix(path)
    try:
        sock.sendall(request_frame(1, "ping"))
    except (BrokenPipeError, ConnectionResetError):
        pass  # turned away and closed already: its one reply is waiting to be read
    reader = sock.makefile("rb", buffering=0)
    reply = read_reply(reader)
    closed = False
    if not reply.ok:
        try:
            closed = reader.read(1) == b""
        except ConnectionResetError:  # closed with our ping unread
            closed = True
    reader.close()
    return sock, reply, closed


def test_a_connection_past_the_cap_is_answered_overloaded_and_closed(limited):
    # Connections of earlier tests close once their last reply is written: wait for them.
    for _ in range(50):
        kept, turned_away = [], None
        for _ in range(5):
            sock, reply, closed = raw_ping(limited.unix)
            if reply.ok:
                kept.append(sock)
            else:
                turned_away = (reply, closed)
                sock.close()
                break
        for sock in kept:
            sock.close()
        if len(kept) == 4:
            break
        time.sleep(0.1)
    assert len(kept) == 4 and turned_away is not None
    reply, closed = turned_away
    assert reply.id is None and reply.error["code"] == "overloaded" and reply.error["detail"]["limit"] == 4
    assert closed


def test_a_connection_turned_away_counts_its_answer_as_sent(tmp_path, inproc):
    """The `overloaded` answer to a connection past --max-connections answers no frame read:
    it counts in replies_out, bytes_out and the errors, and in frames_in nothing."""
    srv = inproc()
    stats = srv.server.stats
    with unix_lane(tmp_path, srv.dispatcher, max_connections=1) as transport:
        transport.start()
        kept = raw_unix(transport.path)
        kept_reader = kept.makefile("rb", buffering=0)
        kept.sendall(request_frame(1, "ping"))
        assert read_reply(kept_reader).ok
        before = stats.snapshot()
        turned_away = raw_unix(transport.path)
        body = read_frame(turned_away.makefile("rb", buffering=0))
        assert protocol.decode_reply(body).error["code"] == "overloaded"
        # Read by the thread that turned the other away: answered once that is done.
        kept.sendall(request_frame(2, "ping"))
        pong = read_frame(kept_reader)
        assert protocol.decode_reply(pong).ok
        after = stats.snapshot()
        turned_away.close()
        kept_reader.close()
        kept.close()
    assert [after[key] - before[key] for key in ("frames_in", "replies_out", "bytes_out")] == \
        [1, 2, len(body) + len(pong)]
    assert after["errors"]["overloaded"] - before["errors"].get("overloaded", 0) == 1


def test_a_unix_server_out_of_descriptors_accepts_again_once_a_connection_closes(tmp_path):
    import resource

    path = str(tmp_path / "bridge.sock")
    srv = ServerProcess(str(tmp_path), "--unix", path)
    try:
        srv.wait_for_path(path)
        with UnixClient(path) as first:
            assert first.ping() == {"pong": True}
        # Room for a few more descriptors than it has open now: connections past them wait
        # in the listen backlog, unaccepted.
        open_now = len(os.listdir(f"/proc/{srv.proc.pid}/fd"))
        resource.prlimit(srv.proc.pid, resource.RLIMIT_NOFILE, (open_now + 4, open_now + 4))
        served, waiting = [], None
        for _ in range(20):
            client = UnixClient(path)
            pong = client.submit("ping")
            # Either it is answered, or accepting it failed (the server says so in its log).
            deadline = time.monotonic() + REPLY_TIMEOUT_S
            while not pong.done() and "accepting paused" not in srv.log():
                assert time.monotonic() < deadline, "neither answered nor refused by accept"
                time.sleep(0.02)
            if not pong.done():
                waiting = (client, pong)
                break
            assert pong.result().result == {"pong": True}
            served.append(client)
        assert waiting is not None, "20 connections were accepted under a limit of 4 more descriptors"
        assert served, "not one connection fitted under the limit"
        served.pop(0).close()
        client, pong = waiting
        assert pong.result(REPLY_TIMEOUT_S).result == {"pong": True}
        client.close()
        for client in served:
            assert client.ping() == {"pong": True}
            client.close()
    finally:
        assert srv.stop() == 0, srv.log()


def resident_bytes(pid: int) -> int:
    """The memory process `pid` has committed (VmRSS)."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS in /proc/{pid}/status")


def test_frame_headers_alone_commit_no_memory_for_the_bodies_they_announce(tmp_path):
    """A body's buffer is taken as soon as its frame's header is read, before any of the body
    has come. Were its pages committed then (a zero-filled bytearray), a few connections that
    each send a header announcing --max-frame-size, and nothing more, would take the server's
    memory: 512 MiB for these four, 64 GiB for the default caps."""
    path = str(tmp_path / "bridge.sock")
    announced, count = 128 << 20, 4
    srv = ServerProcess(str(tmp_path), "--unix", path, "--max-frame-size", str(announced))
    idle = []
    try:
        srv.wait_for_path(path)
        with UnixClient(path) as probe:
            assert probe.ping() == {"pong": True}
            before = resident_bytes(srv.proc.pid)
            idle.extend(raw_unix(path) for _ in range(count))
            for sock in idle:
                sock.sendall(struct.pack(">I", announced) + b"x")
            # Each ping is read in a later round of the reading thread than the one before: by
            # the third's answer, the round that accepted the connections and the next one,
            # which read their headers (and took their buffers), are over.
            for _ in range(3):
                assert probe.ping() == {"pong": True}
            grown = resident_bytes(srv.proc.pid) - before
        assert grown < count * announced / 16, \
            f"{count} headers announcing {announced >> 20} MiB each committed {grown >> 20} MiB"
    finally:
        for sock in idle:
            sock.close()
        assert srv.stop() == 0, srv.log()


def test_steps_from_many_unix_connections_are_gathered_into_batches(tmp_path):
    """One thread reads every unix connection: it must hand a request on to the batcher while
    other connections' requests wait to be read, not serve each alone in turn. The general path
    only (--no-native-step), as on a GPU, where there is no native path."""
    path = str(tmp_path / "bridge.sock")
    srv = ServerProcess(str(tmp_path), "--unix", path, "--no-native-step", "--max-delay-us", "2000")
    connections = 8
    try:
        srv.wait_for_path(path)
        clients = [UnixClient(path) for _ in range(connections)]
        try:
            rng = np.random.default_rng()
            A = -np.exp(rng.standard_normal((6, 3), dtype=np.float32))
            sessions = [client.open_session(1, 6, 3) for client in clients]
            most_rows = 0
            for _ in range(20):
                futures = [client.submit("step", {"session": session, "A": A,
                                                  "x": rng.standard_normal((1, 6), dtype=np.float32),
                                                  "dt": rng.uniform(0.01, 0.5, (1, 6)).astype(np.float32),
                                                  "B": rng.standard_normal((1, 3), dtype=np.float32),
                                                  "C": rng.standard_normal((1, 3), dtype=np.float32)})
                           for client, session in zip(clients, sessions)]
                replies = [future.result(REPLY_TIMEOUT_S) for future in futures]
                for reply in replies:
                    reply.unwrap()
                most_rows = max(most_rows, *(reply.timing["batch_rows"] for reply in replies))
                if most_rows > 1:
                    break
            assert most_rows > 1, "no two connections' steps ever shared a launch"
        finally:
            for client in clients:
                client.close()
    finally:
        assert srv.stop() == 0, srv.log()


def test_a_zmq_message_over_the_frame_limit_is_answered_frame_too_large(limited):
    frames = zmq_exchange(limited.ipc, [msgpack.packb({"v": 1, "id": 3, "op": "ping"}),
                                        b"\x01" * 2_000_000, b"\x02" * 1_500_000])
    reply = msgpack.unpackb(frames[0])
    assert reply["error"]["code"] == "frame_too_large" and reply["error"]["detail"]["limit"] == 3_000_000


# -- lifecycle --------------------------------------------------------------------------------

def test_a_socket_only_server_ignores_stdin_and_stops_on_sigterm(tmp_path):
    unix_path = str(tmp_path / "s.sock")
    srv = ServerProcess(str(tmp_path), "--unix", unix_path, "--zmq", f"ipc://{tmp_path}/z.ipc",
                        stdin=subprocess.PIPE)
    srv.wait_for_path(unix_path)
    srv.proc.stdin.close()  # a Port-mode server would exit now
    with UnixClient(unix_path) as client:
        time.sleep(0.3)
        assert client.ping() == {"pong": True}
    started = time.monotonic()
    assert srv.stop() == 0, srv.log()
    assert time.monotonic() - started < 1.0
    assert not os.path.exists(unix_path)


def test_curve_admits_only_known_clients(tmp_path):
    import zmq.auth

    keys = tmp_path / "keys"
    clients = tmp_path / "clients"
    keys.mkdir()
    clients.mkdir()
    server_public_file, server_secret_file = zmq.auth.create_certificates(str(keys), "server")
    known_public_file, known_secret_file = zmq.auth.create_certificates(str(clients), "known")
    os.rename(known_secret_file, keys / "known.key_secret")  # the server sees only public keys
    unix_path = str(tmp_path / "s.sock")
    srv = ServerProcess(str(tmp_path), "--unix", unix_path, "--zmq", "tcp://:*",
                        "--curve-secret-key", server_secret_file, "--curve-clients", str(clients))
    try:
        srv.wait_for_path(unix_path)
        with UnixClient(unix_path) as probe:
            endpoint = zmq_endpoint(probe.info(), "zmq-tcp", "tcp://:*")
        server_public, _ = zmq.auth.load_certificate(server_public_file)
        known = zmq.auth.load_certificate(str(keys / "known.key_secret"))
        with ZmqClient(endpoint, curve_server_key=server_public, curve_keypair=known) as client:
            assert client.ping() == {"pong": True}
        for stranger in ({"curve_server_key": server_public}, {}):  # unknown key; no CURVE at all
            with ZmqClient(endpoint, **stranger) as client:
                with pytest.raises(TimeoutError):
                    client.request("ping", timeout=1.5)
            # Refused, it never had a peer to send to: its io thread waited for one without
            # blocking, and stopped when closed (a blocked one was left in use as its socket was
            # closed, which aborts the process).
            assert not client._thread.is_alive()
    finally:
        assert srv.stop() == 0, srv.log()


# -- in process: endpoints, lane setup, the multipart form ------------------------------------

class CountingPool(BufferPool):
    def __init__(self):
        super().__init__()
        self.out = 0

    def acquire(self, size):
        view, release = super().acquire(size)
        self.out += 1

        def give_back():
            self.out -= 1
            release()
        return view, give_back


ASSEMBLER_LIMIT = 40
# Frame body lengths; those over ASSEMBLER_LIMIT must come out as FrameTooLarge.
ASSEMBLER_FRAMES = [0, 1, 7, 300, 50, 13, 41, 0, 40, 2 * 1024 * 1024 + 3]


@pytest.mark.parametrize("chunking", ["whole", "byte_by_byte", "odd_pieces", "random"])
def test_the_frame_assembler_yields_each_frame_whole_however_the_stream_is_cut(chunking):
    seed = int(np.random.SeedSequence().entropy % 2**32)
    rng = np.random.default_rng(seed)
    bodies = [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in ASSEMBLER_FRAMES]
    stream = b"".join(struct.pack(">I", len(b)) + b for b in bodies)
    pool = CountingPool()
    assembler = FrameAssembler(pool, ASSEMBLER_LIMIT)
    frame_starts = set(np.cumsum([0] + [4 + len(b) for b in bodies]).tolist())
    events, pos = [], 0
    while pos < len(stream):
        assert assembler.at_frame_start == (pos in frame_starts), f"at byte {pos} (seed {seed})"
        space = assembler.space()
        want = {"whole": len(stream), "byte_by_byte": 1, "odd_pieces": 3,
                "random": int(rng.integers(1, 200))}[chunking]
        count = min(len(space), want)
        space[:count] = stream[pos:pos + count]
        pos += count
        event = assembler.advance(count)
        if event is not None:
            events.append(event)
    assert len(events) == len(bodies), f"seed {seed}"
    for body, event in zip(bodies, events):
        if len(body) > ASSEMBLER_LIMIT:
            assert isinstance(event, protocol.FrameTooLarge)
            assert (event.length, event.limit) == (len(body), ASSEMBLER_LIMIT)
        else:
            view, release = event
            assert bytes(view) == body
            release()
    assert pool.out == 0


class RecordingDispatcher:
    """Stands in for the dispatcher behind an in-process UnixTransport: records each body and
    answers it with its own bytes."""

    def __init__(self):
        self.bodies = []

    def on_frame(self, conn, body, received_ns, release=None, buffers=(), *, more_input=True):
        self.bodies.append(bytes(body))
        release()
        conn.send([self.bodies[-1]])

    def on_frame_error(self, conn, exc):
        conn.send([b"refused"])


class ReaderWatchingBacklog:
    """The stdio reader's input, which notes whether it is read while replies of `conn` wait
    for its writer thread."""

    def __init__(self, raw, conn):
        self.raw, self.conn = raw, conn
        self.read_while_backlogged = threading.Event()

    def readinto(self, view):
        if self.conn._backlog:
            self.read_while_backlogged.set()
        return self.raw.readinto(view)

    def fileno(self):
        return self.raw.fileno()


def test_a_stdio_peer_whose_replies_wait_for_it_has_no_more_requests_read_meanwhile(tmp_path):
    """Written non-blocking, a reply the peer does not take in time goes to a writer thread;
    requests read and answered meanwhile would queue replies for a peer that reads none without
    bound. The stdio reader takes the next frame once its replies are written."""
    from bridge.transports.framed import FdConnection, WriterThreads, serve_frames

    requests_in, requests_out = os.pipe()
    replies_in, replies_out = os.pipe()
    os.set_blocking(replies_out, False)
    writers = WriterThreads()
    conn = FdConnection("stdio", replies_out, writers.start)
    big = bytes(range(256)) * 1024  # echoed: more than the pipe (64 KiB) holds
    reader_waits = threading.Event()
    real_wait = conn.wait_until_written

    def noting_the_wait():
        if conn._backlog:
            reader_waits.set()
        real_wait()

    conn.wait_until_written = noting_the_wait
    with open(requests_in, "rb", buffering=0) as raw, open(replies_in, "rb", buffering=0) as replies:
        watched = ReaderWatchingBacklog(raw, conn)
        reading = threading.Thread(target=serve_frames, args=(watched, conn, RecordingDispatcher(),
                                                              BufferPool(), 1 << 20), daemon=True)
        reading.start()
        with open(requests_out, "wb", buffering=0) as requests:
            requests.write(protocol.encode_frame(big) + protocol.encode_frame(b"next"))
        wait_until(lambda: watched.read_while_backlogged.is_set() or reader_waits.is_set(),
                   "the reader neither read on nor waited for the writer")
        assert not watched.read_while_backlogged.is_set(), "a frame was read while replies waited"
        assert bytes(read_frame(replies)) == big and bytes(read_frame(replies)) == b"next"
        reading.join(REPLY_TIMEOUT_S)
        assert not reading.is_alive()
    os.close(replies_out)
    assert writers.join(time.monotonic() + REPLY_TIMEOUT_S) == 0


@contextlib.contextmanager
def unix_lane(tmp_path, dispatcher, **caps):
    """An in-process unix lane for `dispatcher` at tmp_path/lane.sock, not yet started (a test
    may reach in first), closed after; `caps` override its small limits."""
    from bridge.transports.unix import UnixTransport

    options = {"max_frame_size": 1 << 20, "max_in_flight": 4, "max_connections": 4, **caps}
    transport = UnixTransport(dispatcher, str(tmp_path / "lane.sock"), **options)
    try:
        yield transport
    finally:
        transport.close()


def test_a_unix_connection_whose_frame_cannot_be_read_ends_there_and_the_lane_serves_on(tmp_path):
    """A failure inside a frame (here: no buffer for its body) must end that connection's input:
    read on, the rest of the body would be taken for frames."""
    dispatcher = RecordingDispatcher()
    with unix_lane(tmp_path, dispatcher) as transport:
        real_acquire = transport.pool.acquire

        def acquire(size):
            if size == 1000:
                raise MemoryError("no buffer for this body")
            return real_acquire(size)

        transport.pool.acquire = acquire
        transport.start()
        failing = raw_unix(transport.path)
        # A body that reads as a run of 4-byte frames if it were taken for the stream.
        failing.sendall(protocol.encode_frame(bytes(4) * 250))
        try:
            assert failing.recv(1) == b"", "the connection was not closed"
        except ConnectionResetError:  # closed with the rest of the body unread
            pass
        failing.close()
        healthy = raw_unix(transport.path)
        healthy.sendall(protocol.encode_frame(b"hello"))
        reader = healthy.makefile("rb", buffering=0)
        assert bytes(read_frame(reader)) == b"hello"
        reader.close()
        healthy.close()
        assert dispatcher.bodies == [b"hello"]


def test_a_reply_too_large_to_frame_is_answered_with_an_error_and_the_connection_serves_on(
        tmp_path, monkeypatch, inproc):
    """A stream reply's 4-byte prefix frames at most 2^32 - 1 bytes (SPEC §2). A reply longer
    than that (here the limit is lowered so that a scan's state exceeds it) gets limit_exceeded
    instead of no answer, and counts as answered: with one request allowed in flight, the
    connection would otherwise never be read again."""
    inputs = make_scan_inputs(ScanCase(1, 1, 64, 16, return_state=True))  # a 4 KiB state
    frames = [scan_frame(1, inputs), request_frame(2, "ping")]  # framed before the limit is lowered
    monkeypatch.setattr(protocol.framing, "MAX_FRAMEABLE", 2048)
    with unix_lane(tmp_path, inproc().dispatcher, max_in_flight=1) as transport:
        transport.start()
        conn = raw_unix(transport.path)
        reader = conn.makefile("rb", buffering=0)
        for frame in frames:
            conn.sendall(frame)
        refused, pong = read_reply(reader), read_reply(reader)
        assert (refused.id, refused.ok, refused.error["code"]) == (1, False, "limit_exceeded")
        detail = refused.error["detail"]
        assert (detail["limit"], detail["max"]) == ("reply_frame_size", 2048)
        assert detail["requested"] > 64 * 16 * 4
        assert (pong.id, pong.ok, pong.result) == (2, True, {"pong": True})
        reader.close()
        conn.close()


def test_an_error_reply_too_large_to_frame_is_answered_with_a_small_one(tmp_path, monkeypatch, inproc):
    """An error reply echoes what the request sent (here an unknown op's name, in the message
    and the detail), and may be too long to frame where the request was not: it is answered
    limit_exceeded as a result too long is, not left unanswered (at a cap of one request in
    flight, the connection would never be read again)."""
    frames = [request_frame(1, "x" * 1500), request_frame(2, "ping")]  # framed before the limit is lowered
    monkeypatch.setattr(protocol.framing, "MAX_FRAMEABLE", 2048)
    with unix_lane(tmp_path, inproc().dispatcher, max_in_flight=1) as transport:
        transport.start()
        conn = raw_unix(transport.path)
        reader = conn.makefile("rb", buffering=0)
        conn.sendall(b"".join(frames))
        refused, pong = read_reply(reader), read_reply(reader)
        assert (refused.id, refused.ok, refused.error["code"]) == (1, False, "limit_exceeded")
        assert refused.error["detail"]["limit"] == "reply_frame_size"
        assert (pong.id, pong.ok) == (2, True)
        reader.close()
        conn.close()


class BigReplyDispatcher:
    """Stands in for the dispatcher behind an in-process UnixTransport: a frame's first byte is
    answered, from a thread of its own as by the worker, with REPLY_BYTES of that byte."""

    REPLY_BYTES = 16 << 20

    def on_frame(self, conn, body, received_ns, release=None, buffers=(), *, more_input=True):
        tag = bytes(body[:1])
        release()
        threading.Thread(target=conn.send, args=([tag * self.REPLY_BYTES],), daemon=True).start()

    def on_frame_error(self, conn, exc):
        conn.send([b"refused"])


class ListenerFailingOnce:
    """A listening socket whose first accept() fails with `error` (as when the connection it
    was for was aborted); the rest is the socket's own."""

    def __init__(self, listener, error: int):
        self._listener = listener
        self._error = error

    def accept(self):
        if self._error:
            error, self._error = self._error, 0
            raise OSError(error, os.strerror(error))
        return self._listener.accept()

    def __getattr__(self, name):
        return getattr(self._listener, name)


def test_an_aborted_connection_does_not_pause_accepting_the_next(tmp_path, monkeypatch):
    """Only running out of descriptors or memory pauses accepting (until a connection closes
    or the sweep, here made too late to matter): a failure for one connection costs that one."""
    from bridge.transports import unix

    monkeypatch.setattr(unix, "SWEEP_SECONDS", 3600.0)
    with unix_lane(tmp_path, RecordingDispatcher()) as transport:
        transport._listener = ListenerFailingOnce(transport._listener, errno.ECONNABORTED)
        transport.start()
        conn = raw_unix(transport.path)
        conn.settimeout(10)
        conn.sendall(protocol.encode_frame(b"hello"))
        reader = conn.makefile("rb", buffering=0)
        assert bytes(read_frame(reader)) == b"hello"
        reader.close()
        conn.close()


def test_a_unix_connection_streaming_a_large_frame_gives_the_others_their_turn(tmp_path):
    """The reading thread takes at most about BYTES_PER_TURN from one connection per turn, a
    frame's end or not: a peer streaming a frame of up to --max-frame-size would otherwise hold
    every other connection for as long as its bytes keep coming. Driven by hand (no reading
    thread), with more than a turn's bytes waiting in the socket."""
    from bridge.transports import unix

    with unix_lane(tmp_path, RecordingDispatcher(), max_frame_size=64 << 20) as transport, \
            contextlib.closing(raw_unix(transport.path)) as streaming:
        transport._accept()
        (conn,) = transport._connections
        waiting = 2 * unix.BYTES_PER_TURN
        streaming.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 * unix.BYTES_PER_TURN)  # room for them
        streaming.sendall(struct.pack(">I", 64 << 20) + bytes(waiting))  # a 64 MiB frame, begun
        transport._read(conn, others_waiting=True)
        assert conn.more_input(), "one turn read everything the connection had"
        assert not conn.incoming.at_frame_start and transport.dispatcher.bodies == []


def test_one_writer_thread_at_a_time_writes_a_unix_connections_replies(tmp_path, monkeypatch):
    """A writer thread that has written the last reply of its backlog must be gone as far as a
    new reply can tell: here it lingers (its _done made slow), while reply B, written by another
    thread, stalls and is handed to a writer. Two writers would both write B, one stream."""
    from bridge.transports import unix

    real_done = unix.UnixConnection._done

    def slow_done_on_writers(self, count=1):
        if threading.current_thread().name.endswith("-writer"):
            time.sleep(0.5)
        real_done(self, count)

    monkeypatch.setattr(unix.UnixConnection, "_done", slow_done_on_writers)
    size = BigReplyDispatcher.REPLY_BYTES
    with unix_lane(tmp_path, BigReplyDispatcher()) as transport, \
            contextlib.closing(raw_unix(transport.path)) as conn, conn.makefile("rb", buffering=0) as reader:
        transport.start()
        conn.sendall(protocol.encode_frame(b"A"))
        time.sleep(0.2)  # A is not read meanwhile: its writer thread takes it over
        frame = memoryview(bytearray(4 + size))
        assert read_exact(reader, frame) and bytes(frame[4:]) == b"A" * size
        conn.sendall(protocol.encode_frame(b"B"))  # while A's writer lingers in _done
        # B is not read meanwhile either: it is handed to a writer, and A's wakes up before it
        # is written.
        time.sleep(0.8)
        assert read_exact(reader, frame) and protocol.parse_frame_header(frame[:4]) == size
        assert bytes(frame[4:]) == b"B" * size
        conn.settimeout(1.0)
        with pytest.raises(socket.timeout):  # nothing after B: it was written once
            conn.recv(1)
        (served,) = transport._connections
        deadline = time.monotonic() + 5
        while served._in_flight and time.monotonic() < deadline:
            time.sleep(0.05)
        assert served._in_flight == 0 and not served._backlog


def test_shutdown_writes_the_replies_a_slow_unix_reader_has_not_taken_yet(tmp_path):
    """A reply handed to a writer thread counts as answered; the server must not exit before
    the writer has written it (within transports.base.FLUSH_SECONDS): a client that reads 0.1 s after
    asking for a 32 MiB state and a shutdown gets both replies whole."""
    path = str(tmp_path / "bridge.sock")
    srv = ServerProcess(str(tmp_path), "--unix", path)
    try:
        srv.wait_for_path(path)
        conn = raw_unix(path)
        reader = conn.makefile("rb", buffering=0)
        conn.sendall(request_frame(1, "session_open", {"batch": 1, "dim": 4096, "state": 2048}))
        session = read_reply(reader).result["session"]
        conn.sendall(request_frame(2, "session_state", {"session": session}) + request_frame(3, "shutdown"))
        time.sleep(0.1)  # a client busy elsewhere: the state's reply outlasts the worker's stall
        state, stopping = read_reply(reader), read_reply(reader)
        assert state.id == 2 and state.ok and state.result["state"].shape == (1, 4096, 2048), state.error
        assert (stopping.id, stopping.result) == (3, {"stopping": True})
        reader.close()
        conn.close()
        assert srv.proc.wait(REPLY_TIMEOUT_S) == 0, srv.log()
    finally:
        assert srv.stop() == 0, srv.log()


def test_a_request_the_decoder_fails_on_is_answered_and_the_connection_serves_on(tmp_path, monkeypatch, inproc):
    """A bug in decoding (not a ProtocolError) still answers the frame, internal_error with a
    nil id: the unix lane counts it in flight until then, and at a cap of one the connection
    would never be read again (nor closed, nor its sessions freed)."""
    real_decode = protocol.decode_request

    def decode_failing_on_ping(body, buffers=()):
        request = real_decode(body, buffers)
        if request.op == "ping":
            raise RuntimeError("a decoder bug")
        return request

    monkeypatch.setattr(protocol, "decode_request", decode_failing_on_ping)
    with unix_lane(tmp_path, inproc(native_step=False).dispatcher, max_in_flight=1) as transport:
        transport.start()
        conn = raw_unix(transport.path)
        reader = conn.makefile("rb", buffering=0)
        conn.sendall(request_frame(1, "ping") + request_frame(2, "stats"))
        failed, served = read_reply(reader), read_reply(reader)
        assert (failed.id, failed.ok, failed.error["code"]) == (None, False, "internal_error")
        assert failed.error["detail"] == {"exception": "RuntimeError"}
        assert served.id == 2 and served.ok
        reader.close()
        conn.close()


def test_the_frame_assembler_gives_back_a_frame_read_in_part():
    pool = CountingPool()
    assembler = FrameAssembler(pool, 1 << 20)
    frame = struct.pack(">I", 1000) + os.urandom(400)
    space = assembler.space()
    space[:4] = frame[:4]
    assert assembler.advance(4) is None and not assembler.at_frame_start
    space = assembler.space()
    space[:400] = frame[4:]
    assert assembler.advance(400) is None and pool.out == 1
    assembler.abandon()
    assert pool.out == 0 and assembler.at_frame_start


@pytest.mark.parametrize("given, bound", [
    pytest.param("tcp://:5555", "tcp://127.0.0.1:5555", id="no-host-is-loopback"),
    pytest.param("tcp://:*", "tcp://127.0.0.1:*", id="any-port-on-loopback"),
    pytest.param("tcp://*:5555", "tcp://*:5555", id="every-interface-when-named"),
    pytest.param("tcp://10.1.2.3:7", "tcp://10.1.2.3:7", id="named-address"),
    pytest.param("ipc:///tmp/x.ipc", "ipc:///tmp/x.ipc", id="ipc"),
])
def test_endpoints_bind_loopback_unless_a_host_is_named(given, bound):
    assert resolve_endpoint(given) == bound


@pytest.mark.parametrize("endpoint", [
    pytest.param("tcp://localhost", id="no-port"), pytest.param("inproc://x", id="inproc"),
    pytest.param("ipc://", id="no-path"), pytest.param("127.0.0.1:5555", id="no-scheme"),
])
def test_bad_endpoints_are_refused_with_what_was_expected(endpoint):
    with pytest.raises(ValueError, match="expected ipc://PATH or tcp://"):
        resolve_endpoint(endpoint)


@pytest.mark.parametrize("argv, message", [
    pytest.param(["--zmq", "ipc:///tmp/x.ipc", "--curve-secret-key", "k"], "no --zmq tcp://", id="curve-without-tcp"),
    pytest.param(["--unix", "u.sock", "--curve-clients", "d"], "--curve-secret-key too", id="clients-without-key"),
])
def test_lane_options_that_cannot_work_are_refused(argv, message):
    from bridge.cli import build_parser, open_lanes

    with pytest.raises(ValueError, match=message):
        open_lanes(build_parser().parse_args(argv), dispatcher=None)


def test_a_unix_path_is_taken_over_only_from_a_dead_server(tmp_path):
    from bridge.transports.unix import UnixTransport

    options = dict(max_frame_size=1024, max_in_flight=1, max_connections=1)
    path = str(tmp_path / "live.sock")
    live = UnixTransport(None, path, **options)
    with pytest.raises(OSError, match="another server is listening"):
        UnixTransport(None, path, **options)
    live.close()
    assert not os.path.exists(path)
    stale = str(tmp_path / "stale.sock")
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(stale)  # a server that died without removing its socket file
    dead.close()
    UnixTransport(None, stale, **options).close()
    (tmp_path / "file").write_text("data")
    with pytest.raises(OSError, match="non-socket file"):
        UnixTransport(None, str(tmp_path / "file"), **options)
    assert (tmp_path / "file").read_text() == "data"


@pytest.mark.parametrize("frames, envelope, message", [
    pytest.param([b"id", b"body"], [b"id"], [b"body"], id="dealer"),
    pytest.param([b"id", b"body", b"buf"], [b"id"], [b"body", b"buf"], id="dealer-multipart"),
    pytest.param([b"id", b"", b"body"], [b"id", b""], [b"body"], id="req"),
    pytest.param([b"id", b"", b"body", b"buf"], [b"id", b""], [b"body", b"buf"], id="req-multipart"),
    pytest.param([b"id", b""], [b"id"], [b""], id="dealer-empty-body"),
])
def test_the_envelope_is_the_routing_id_and_a_req_delimiter(frames, envelope, message):
    assert split_envelope(frames) == (envelope, message)


@pytest.mark.parametrize("first_delimited", [pytest.param(True, id="delimiter-then-none"),
                                             pytest.param(False, id="none-then-delimiter")])
def test_each_zmq_reply_keeps_the_envelope_its_request_came_with(tmp_path, first_delimited):
    """SPEC §2: a DEALER may send a REQ's empty delimiter, to be answered with it; the server
    answers with the envelope the request came with. A DEALER's first request is answered
    after its second, sent in the other form: each reply must keep its own request's, or the
    peer finds the delimiter where it expects the body, or the body where it expects the
    delimiter."""
    held = []

    def on_frame(target, body, received_ns, buffers):
        if bytes(body) == b"first":
            held.append(target)  # answered after the second
        else:
            target.send([b"answered " + bytes(body)])

    with_delimiter, without = (lambda body: [b"", body]), (lambda body: [body])
    first_form, second_form = (with_delimiter, without) if first_delimited else (without, with_delimiter)
    with zmq_lane_and_dealer(tmp_path, on_frame, max_in_flight=2) as (_, client):
        client.send_multipart(first_form(b"first"))
        client.send_multipart(second_form(b"second"))
        assert client.poll(REPLY_TIMEOUT_S * 1000, zmq.POLLIN), "the second request was not answered"
        assert client.recv_multipart() == second_form(b"answered second")
        held[0].send([b"first done"])
        assert client.poll(REPLY_TIMEOUT_S * 1000, zmq.POLLIN), "the first request was not answered"
        assert client.recv_multipart() == first_form(b"first done")


def test_zmq_overloaded_answers_that_leave_start_no_request_past_the_peer_cap():
    """`overloaded` answers count as in flight until they leave; as each leaves, a waiting
    request may start only while the peer is under its cap, or a peer that floods and reads
    nothing would get one more request served per answer dropped."""
    started = []

    def dispatch(peer, request):
        started.append(request)
        peer.in_flight += 1

    transport = SimpleNamespace(max_in_flight=2, _dispatch=dispatch, _forget=lambda peer: None)
    # Two served requests in flight, three overloaded answers unsent, four requests waiting.
    peer = SimpleNamespace(in_flight=2 + 3, waiting=deque(["r1", "r2", "r3", "r4"]), closed=False,
                           unsent=deque(), has_close_callbacks=False)
    for _ in range(3):
        ZmqTransport._answered(transport, peer)
    assert started == [] and peer.in_flight == 2
    ZmqTransport._answered(transport, peer)  # a served request's reply left
    assert started == ["r1"] and peer.in_flight == 2


def test_zmq_a_peer_on_a_reused_descriptor_outlives_the_old_connections_end(tmp_path):
    """A connection ends and a new one is accepted on its descriptor before the io loop has
    read the monitor's report of that end; the new peer's first message, in the same round,
    settles the old connection before it is filed under the descriptor, so that report frees
    the old peer (and its sessions) only. Which descriptor the new connection gets is the
    kernel's choice: the case is tried until it gets the old one (nearly always the first
    time; other descriptors opened in between can take it under load)."""
    assert any(reused_descriptor_round(str(tmp_path / f"reuse{n}.ipc")) for n in range(10)), \
        "in 10 tries the new connection never got the old one's descriptor"


@contextlib.contextmanager
def zmq_lane_and_dealer(tmp_path, on_frame, max_in_flight: int, hwm: int = 16):
    """An in-process ZeroMQ lane whose dispatcher is `on_frame`, started, and a DEALER
    connected to it; both closed after."""
    transport = ZmqTransport(SimpleNamespace(on_frame=on_frame), [f"ipc://{tmp_path}/lane.ipc"],
                             max_frame_size=1 << 20, max_in_flight=max_in_flight, hwm=hwm)
    transport.start()
    context = zmq.Context()
    client = context.socket(zmq.DEALER)
    try:
        client.connect(transport.endpoints[0])
        yield transport, client
    finally:
        client.close(linger=0)
        context.term()
        transport.close()


def test_a_fault_in_one_zmq_message_costs_that_message_not_the_lane(tmp_path, monkeypatch):
    """An unexpected exception while the io thread handles one message (a bug) must not end
    the thread: every peer's requests would go unanswered while the server runs on."""
    import bridge.transports.zmq as zmq_lane

    real_split = zmq_lane.split_envelope

    def split_failing_on_the_first(frames):
        if frames[-1].bytes == b"first":
            raise RuntimeError("a bug handling this message")
        return real_split(frames)

    monkeypatch.setattr(zmq_lane, "split_envelope", split_failing_on_the_first)

    def echo(target, body, received_ns, buffers):
        target.send([bytes(body)])

    with zmq_lane_and_dealer(tmp_path, echo, max_in_flight=4) as (_, client):
        client.send(b"first")
        client.send(b"second")
        assert client.poll(REPLY_TIMEOUT_S * 1000, zmq.POLLIN), "the lane answered nothing after the fault"
        assert client.recv() == b"second"


def test_a_zmq_reply_that_cannot_be_sent_is_dropped_and_the_next_ones_go(tmp_path, caplog):
    """A send that fails for good (ENOTSOCK here; pyzmq retries EINTR itself) drops that reply
    with a warning and gives back its place: with a cap of one request in flight, the peer's
    next request is still served."""
    failures = []

    def echo(target, body, received_ns, buffers):
        if not failures:
            real_send = target.peer.socket.send_multipart

            def send_failing_once(*args, **kwargs):
                if not failures:
                    failures.append(1)
                    raise zmq.ZMQError(errno.ENOTSOCK)
                return real_send(*args, **kwargs)

            target.peer.socket.send_multipart = send_failing_once
        target.send([b"answered " + bytes(body)])

    with zmq_lane_and_dealer(tmp_path, echo, max_in_flight=1) as (_, client):
        client.send(b"first")
        client.send(b"second")
        assert client.poll(REPLY_TIMEOUT_S * 1000, zmq.POLLIN), "the request after the dropped reply was not served"
        assert client.recv() == b"answered second"
    assert failures == [1]
    assert any("a reply could not be sent and is dropped" in r.getMessage() and r.levelno == logging.WARNING
               for r in caplog.records)


class FakeNativeStep:
    """A native step path for a real Dispatcher: it takes bodies that start with b"step" and
    answers b"native " + body; b"step-fail" fails after its kernel would have run
    (NativeStepError). `before_parsing(body)` runs first, on the reading thread, before the
    dispatcher decides whether the native path may serve it."""

    def __init__(self, before_parsing=lambda body: None):
        self.before_parsing = before_parsing

    def parse(self, body):
        body = bytes(body)
        self.before_parsing(body)
        return body if body.startswith(b"step") else None

    def serve(self, conn, request, received_ns, queued_ns):
        if request == b"step-fail":
            raise NativeStepError(7, RuntimeError("the kernel failed"))
        return b"native " + request, {}


@contextlib.contextmanager
def zmq_lane_with_dispatcher(tmp_path, native_step, max_in_flight: int, handlers: dict | None = None,
                             hwm: int = 16):
    """A ZeroMQ lane in front of a real Dispatcher whose native step path is `native_step`,
    started; closed after."""
    srv = InProcessServer(native_step=False, handlers=handlers)
    srv.server.native_step = native_step
    transport = ZmqTransport(srv.dispatcher, [f"ipc://{tmp_path}/lane.ipc"], max_frame_size=1 << 20,
                             max_in_flight=max_in_flight, hwm=hwm)
    transport.start()
    try:
        yield srv.dispatcher, transport
    finally:
        transport.close()
        srv.close()


@contextlib.contextmanager
def dealers(transport, count: int):
    """`count` DEALER sockets connected to the lane's endpoint; closed after."""
    context = zmq.Context()
    sockets = [context.socket(zmq.DEALER) for _ in range(count)]
    try:
        for sock in sockets:
            sock.connect(transport.endpoints[0])
        yield sockets
    finally:
        for sock in sockets:
            sock.close(linger=0)
        context.term()


def wait_until(condition, what: str) -> None:
    deadline = time.monotonic() + REPLY_TIMEOUT_S
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.001)


def reply_ids(client, count: int) -> list:
    """The ids of the next `count` replies on `client`, a native step's as its body."""
    replies = []
    while len(replies) < count and client.poll(REPLY_TIMEOUT_S * 1000, zmq.POLLIN):
        body = client.recv()
        replies.append(body if body.startswith(b"native") else msgpack.unpackb(body)["id"])
    return replies


def test_a_failed_native_step_answered_on_the_zmq_io_thread_leaves_the_server_serving(tmp_path):
    """A native step's error reply is made while the dispatcher still serves it (its serving
    lock held, the step counted in flight). Sending it then, with another peer's reply already
    posted, would start that peer's step that waited past its cap on the same thread, which
    takes the same lock: the lane and the server would hang. Replies made on the io thread are
    sent once the dispatcher has returned."""
    ping_may_answer = threading.Event()

    def held_ping(server, call):
        if not ping_may_answer.wait(REPLY_TIMEOUT_S):
            raise TimeoutError("the test never let the ping be answered")
        return {"pong": True}

    def until_the_ping_is_answered(body):
        if body == b"step-fail":  # the other peer's pong posted and its request left
            ping_may_answer.set()
            wait_until(lambda: transport.outbox.pending and dispatcher._pending == 0,
                       "the ping's reply was never posted")

    with zmq_lane_with_dispatcher(tmp_path, FakeNativeStep(until_the_ping_is_answered), max_in_flight=1,
                                  handlers={"ping": held_ping}) as (dispatcher, transport):
        with dealers(transport, 2) as (first, second):
            second.send(b"".join(protocol.encode_request(1, "ping", {})))
            second.send(b"step-2")  # waits: its peer has the ping in flight
            wait_until(lambda: any(p.waiting for p in list(transport._peers.values())),
                       "the step never waited behind the ping")
            first.send(b"step-fail")
            assert reply_ids(first, 1) == [7]
            assert reply_ids(second, 2) == [1, b"native step-2"]
        assert not dispatcher._serving.locked()


def test_a_zmq_peers_replies_leave_in_the_order_they_were_made(tmp_path):
    """A peer's request that waited past its cap starts, and is answered on the io thread,
    while a reply the worker posted for the same peer's earlier request is not sent yet: that
    one leaves first."""
    info_done = threading.Event()

    def slow_info(server, call):
        if not info_done.wait(REPLY_TIMEOUT_S):
            raise TimeoutError("the test never let the info be answered")
        return {"info": True}

    with zmq_lane_with_dispatcher(tmp_path, FakeNativeStep(), max_in_flight=2,
                                  handlers={"info": slow_info}) as (dispatcher, transport):
        real_send = transport.sockets[0].send_multipart

        def send_after_the_info(frames, *args, **kwargs):
            # The pong leaves only once the info's reply is posted and its request has left,
            # so that sending the pong starts the waiting step, served natively.
            if any(b"pong" in bytes(frame) for frame in frames):
                info_done.set()
                wait_until(lambda: transport.outbox.pending and dispatcher._pending == 0,
                           "the info's reply was never posted")
            return real_send(frames, *args, **kwargs)

        transport.sockets[0].send_multipart = send_after_the_info
        with dealers(transport, 1) as (client,):
            client.send(b"".join(protocol.encode_request(1, "ping", {})))
            client.send(b"".join(protocol.encode_request(2, "info", {})))
            client.send(b"step-3")  # waits: two in flight
            assert reply_ids(client, 3) == [1, 2, b"native step-3"]


def test_a_reply_made_while_a_full_pipe_is_retried_leaves_in_the_same_flush(tmp_path, monkeypatch):
    """A peer's reply meets a full pipe until its next request waits behind it; when the retry
    lets it leave, the waiting step starts and is answered on the io thread. That reply leaves
    in the same flush, not a RETRY_MS later (made long here so that a wait would show)."""
    import bridge.transports.zmq as zmq_lane

    monkeypatch.setattr(zmq_lane, "RETRY_MS", 4000)
    with zmq_lane_with_dispatcher(tmp_path, FakeNativeStep(), max_in_flight=1) as (_, transport):
        real_send = transport.sockets[0].send_multipart

        def full_until_a_request_waits(frames, *args, **kwargs):  # on the io thread
            if b"native step-1" in frames and not any(p.waiting for p in transport._peers.values()):
                raise zmq.Again()
            return real_send(frames, *args, **kwargs)

        transport.sockets[0].send_multipart = full_until_a_request_waits
        with dealers(transport, 1) as (client,):
            client.send(b"step-1")
            client.send(b"step-2")  # waits: one in flight
            arrivals = []
            for _ in range(2):
                assert client.poll(REPLY_TIMEOUT_S * 1000, zmq.POLLIN)
                arrivals.append((client.recv(), time.monotonic()))
    assert [body for body, _ in arrivals] == [b"native step-1", b"native step-2"]
    # milliseconds apart when both leave in one flush; a stall of the loaded runner is no retry
    assert arrivals[1][1] - arrivals[0][1] < 2.0, "the second reply waited for another retry"


def test_an_overloaded_answer_leaves_after_the_replies_posted_before_it(tmp_path):
    """The worker posts a peer's reply; before the io thread has sent it, the same peer's next
    request, past its cap and its queue, is answered overloaded on the io thread: that answer
    leaves second (an id-less legacy client tells replies apart by their order alone)."""
    ping_may_answer = threading.Event()
    declined_sent = threading.Event()
    armed = []

    def held_ping(server, call):
        if not ping_may_answer.wait(REPLY_TIMEOUT_S):
            raise TimeoutError("the test never let the ping be answered")
        return {"pong": True}

    def post_then_decline(body):
        # On the io thread, reading the other peer's request: let the worker post the first
        # peer's pong, then send that peer a request to decline, which this same round of
        # reading finds once this returns.
        if armed and armed.pop():
            ping_may_answer.set()
            wait_until(lambda: transport.outbox.pending and dispatcher._pending == 0,
                       "the ping's reply was never posted")
            first.send(b"".join(protocol.encode_request(3, "ping", {})))
            # In the server's socket before this returns, so that this round of reading finds it
            # (asked on the io thread, which owns the socket).
            wait_until(lambda: transport.sockets[0].getsockopt(zmq.EVENTS) & zmq.POLLIN,
                       "the request to decline never reached the server")
            declined_sent.set()

    with zmq_lane_with_dispatcher(tmp_path, FakeNativeStep(post_then_decline), max_in_flight=1,
                                  handlers={"ping": held_ping}, hwm=1) as (dispatcher, transport):
        with dealers(transport, 2) as (first, second):
            first.send(b"".join(protocol.encode_request(1, "ping", {})))
            first.send(b"".join(protocol.encode_request(2, "ping", {})))  # waits: its queue is full
            wait_until(lambda: any(p.waiting for p in list(transport._peers.values())),
                       "the second ping never waited")
            armed.append(True)
            second.send(b"".join(protocol.encode_request(9, "info", {})))
            assert declined_sent.wait(REPLY_TIMEOUT_S)
            replies = []
            while len(replies) < 3 and first.poll(REPLY_TIMEOUT_S * 1000, zmq.POLLIN):
                reply = msgpack.unpackb(first.recv())
                replies.append((reply["id"], reply["ok"] or reply["error"]["code"]))
    assert replies == [(1, True), (3, "overloaded"), (2, True)]


def test_a_zmq_request_answered_overloaded_counts_as_read_and_its_answer_as_sent(tmp_path):
    """A peer's request past its cap and its queue is declined by the lane, not the
    dispatcher: it must still count in frames_in and bytes_in, and its answer in replies_out
    and bytes_out, as the dispatcher counts every other request and reply."""
    ping_may_answer = threading.Event()

    def held_ping(server, call):
        if not ping_may_answer.wait(REPLY_TIMEOUT_S):
            raise TimeoutError("the test never let the ping be answered")
        return {"pong": True}

    with zmq_lane_with_dispatcher(tmp_path, None, max_in_flight=1, handlers={"ping": held_ping},
                                  hwm=1) as (dispatcher, transport), dealers(transport, 1) as (client,):
        stats = dispatcher.server.stats
        before = stats.snapshot()
        pings = [b"".join(protocol.encode_request(i, "ping", {})) for i in (1, 2, 3)]
        for ping in pings:  # in flight, waiting, declined
            client.send(ping)
        assert client.poll(REPLY_TIMEOUT_S * 1000, zmq.POLLIN), "the third ping was not declined"
        declined = client.recv()
        assert msgpack.unpackb(declined)["error"]["code"] == "overloaded"
        after = stats.snapshot()
        assert [after[key] - before[key] for key in ("frames_in", "bytes_in", "replies_out", "bytes_out")] == \
            [2, len(pings[0]) + len(pings[2]), 1, len(declined)]
        ping_may_answer.set()
        assert sorted(reply_ids(client, 2)) == [1, 2]
        assert stats.snapshot()["frames_in"] - before["frames_in"] == 3


def test_closing_the_zmq_lane_answers_requests_that_waited_past_the_peers_cap(tmp_path):
    """A peer's request past its in-flight cap waits in the lane; when the one before it is
    answered at shutdown, it is dispatched and answered shutting_down, a reply posted while
    close() sends the others: it must go out too."""
    held = []

    def on_frame(target, body, received_ns, buffers):
        if bytes(body) == b"first":
            held.append(target)  # answered later, as by a request still running
        else:  # the dispatcher, draining, refuses what comes now
            target.send([b"shutting down: " + bytes(body)])

    with zmq_lane_and_dealer(tmp_path, on_frame, max_in_flight=1) as (transport, client):
        client.send(b"first")
        client.send(b"second")  # waits in the lane: the peer has its one request in flight
        deadline = time.monotonic() + REPLY_TIMEOUT_S
        while not (held and held[0].peer.waiting) and time.monotonic() < deadline:
            time.sleep(0.01)
        # The io thread stops first, as close() stops it, so that close() is what sends the
        # first request's late reply and so dispatches the second.
        transport._stop.set()
        transport.outbox.post(None)
        transport._thread.join(REPLY_TIMEOUT_S)
        held[0].send([b"first done"])
        transport.close()
        replies = []
        while client.poll(2000, zmq.POLLIN):
            replies.append(client.recv())
        assert replies == [b"first done", b"shutting down: second"]


def test_a_long_queue_of_requests_answered_on_the_io_thread_is_worked_off_in_turn(tmp_path, caplog):
    """A peer's requests wait past its cap of one in flight; when the first is answered, each
    waiting one is dispatched in turn and answered on the io thread itself (as the native step
    path answers), a reply that is sent at once and lets the next one start. Far more of them
    than Python's recursion limit allows frames: all answered, in order, and no fault logged,
    so they were worked off in a loop, not by each reply sending the next."""
    waiting = sys.getrecursionlimit() * 2
    held = []

    def on_frame(target, body, received_ns, buffers):
        if bytes(body) == b"first":
            held.append(target)  # answered later, from another thread, as by the worker
        else:
            target.send([b"answered " + bytes(body)])

    with zmq_lane_and_dealer(tmp_path, on_frame, max_in_flight=1, hwm=waiting) as (transport, client):
        client.send(b"first")
        for n in range(waiting):
            client.send(b"%d" % n)
        deadline = time.monotonic() + REPLY_TIMEOUT_S
        while not (held and len(held[0].peer.waiting) == waiting) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert held and len(held[0].peer.waiting) == waiting, "the requests past the cap did not all wait"
        held[0].send([b"first done"])
        replies = []
        while len(replies) < waiting + 1 and client.poll(REPLY_TIMEOUT_S * 1000, zmq.POLLIN):
            replies.append(client.recv())
    assert replies == [b"first done"] + [b"answered %d" % n for n in range(waiting)]
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []


def reused_descriptor_round(ipc_path: str) -> bool:
    """One try of the case above, the io loop driven by hand (without its thread) so that the
    monitor is read exactly when a round reads it. Its checks hold whatever the descriptors;
    returns whether the new connection got the old one's, the case that can fail them."""
    opened, freed = [], []

    def on_frame(target, body, received_ns, buffers):
        opened.append((target.peer, bytes(body)))
        target.on_close(freed.append)  # as a session it opened would

    transport = ZmqTransport(SimpleNamespace(on_frame=on_frame), [f"ipc://{ipc_path}"],
                             max_frame_size=1 << 20, max_in_flight=4, hwm=16)
    server_socket, monitor = transport.sockets[0], transport.monitors[0]
    context = zmq.Context()
    try:
        def peer_sends(body: bytes) -> zmq.Socket:
            client = context.socket(zmq.DEALER)
            client.connect(transport.endpoints[0])
            client.send(body)
            assert server_socket.poll(5000, zmq.POLLIN), "the server never got the message"
            return client

        idle = context.socket(zmq.DEALER)  # opens the client context's own descriptors for good
        fds_before = set(os.listdir("/proc/self/fd"))
        old_client = peer_sends(b"old")
        transport._receive(0, server_socket)
        (old_peer, _), = opened
        old_fds = set(os.listdir("/proc/self/fd")) - fds_before  # both ends' (and the listing's)
        old_client.close(linger=0)
        # The monitor now holds the end of the old connection, unread, as a round would find it.
        assert monitor.poll(5000, zmq.POLLIN), "no report of the old connection's end"
        # Both ends' descriptors closed (libzmq closes them on its own threads), so that the
        # new connection's ends can take the same lowest free ones.
        deadline = time.monotonic() + 5
        while any(os.path.lexists(f"/proc/self/fd/{fd}") for fd in old_fds):
            assert time.monotonic() < deadline, "the old connection's descriptors stayed open"
            time.sleep(0.001)
        new_client = peer_sends(b"new")
        transport._receive(0, server_socket)
        (new_peer, body) = opened[1]
        assert body == b"new" and new_peer is not old_peer
        transport._connection_events(0)  # the next round reads whatever the monitor still has
        assert freed == [old_peer] and not new_peer.closed
        assert transport._on_fd == {(0, new_peer.fd): {new_peer}}
        new_client.close(linger=0)
        assert monitor.poll(5000, zmq.POLLIN), "no report of the new connection's end"
        transport._connection_events(0)
        assert freed == [old_peer, new_peer] and transport._on_fd == {}
        idle.close()
        return new_peer.fd == old_peer.fd
    finally:
        context.destroy(linger=0)
        transport.close()


def random_tensor(rng, dtype: str, shape) -> protocol.OutTensor:
    values = rng.uniform(-4, 4, shape) if dtype in ("f32", "f64") else rng.integers(1, 100, shape)
    array = values.astype({"f32": np.float32, "f64": np.float64, "i32": np.int32, "u8": np.uint8}[dtype])
    return protocol.OutTensor(dtype, shape, array)


@pytest.mark.parametrize("dtypes", [
    pytest.param(("f32",), id="one"), pytest.param(("f32", "f64", "i32", "u8"), id="mixed"),
])
def test_multipart_requests_decode_to_views_of_the_buffers(dtypes):
    rng = np.random.default_rng()
    tensors = {f"t{i}": random_tensor(rng, dtype, (3, 5 + i)) for i, dtype in enumerate(dtypes)}
    buffers = []
    body = b"".join(protocol.encode_request(9, "put", {"tensor": tensors["t0"]}, buffers=buffers))
    assert msgpack.unpackb(body)["args"]["tensor"] == {"dtype": dtypes[0], "shape": [3, 5], "buf": 0}
    received = [bytearray(b) for b in buffers]
    request = protocol.decode_request(body, received)
    assert request.multipart and bytes(request.args["tensor"].data) == bytes(tensors["t0"].data)
    received[0][0] ^= 0xFF  # a view, not a copy
    assert bytes(request.args["tensor"].data) == bytes(received[0])
    buffers = []
    parts = protocol.encode_reply(9, {"out": tensors}, {"server_us": 1.5}, buffers=buffers)
    assert len(buffers) == len(dtypes)
    reply = protocol.decode_reply(b"".join(parts), buffers)
    for name, tensor in tensors.items():
        got = reply.result["out"][name]
        assert (got.dtype, got.shape, bytes(got.data)) == (tensor.dtype, tensor.shape, bytes(tensor.data))


def test_inline_requests_are_not_multipart():
    body = b"".join(protocol.encode_request(1, "ping", {}))
    assert protocol.decode_request(body).multipart is False


def test_encoders_want_an_empty_list_for_buffers():
    with pytest.raises(ValueError, match="empty list"):
        protocol.encode_request(1, "ping", {}, buffers=[b"left over"])


@pytest.mark.parametrize("frames, field", [
    pytest.param(lambda body, data: [body], "result.y", id="missing-buffer"),
    pytest.param(lambda body, data: [body, data, b"x"], "buffers[1]", id="stray-buffer"),
    pytest.param(lambda body, data: [body, data[:-1]], "result.y", id="short-buffer"),
])
def test_a_malformed_multipart_reply_is_a_decode_error(frames, field):
    data = np.random.default_rng().standard_normal(6).astype(np.float32)
    buffers = []
    body = b"".join(protocol.encode_reply(4, {"y": protocol.OutTensor("f32", (2, 3), data)}, {}, buffers=buffers))
    with pytest.raises(protocol.DecodeError) as info:
        message = frames(body, bytes(buffers[0]))
        protocol.decode_reply(message[0], message[1:])
    assert info.value.detail["field"] == field
