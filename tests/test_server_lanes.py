"""Every lane of a real `python -m bridge` process (stdio, unix, ZeroMQ ipc and tcp; REQ and
DEALER; inline and multipart, SPEC §5) against the reference: sessions and handles, the legacy
format, many concurrent pipelining clients, peers that vanish or close, and steps of many unix
connections gathered into one launch."""

from __future__ import annotations

import os
import socket
import struct
import subprocess
import threading
from concurrent.futures import ThreadPoolExecutor

import msgpack
import numpy as np
import pytest
import torch
import zmq

import protocol
from bridge.client import UnixClient, ZmqClient

from bridge_fakes import served_natively
from kernel_cases import (STATE_TOLERANCE, ScanCase, UpdateCase, assert_close, make_scan_inputs,
                          make_update_inputs, reference_scan, reference_update)
from lane_helpers import (REPLY_TIMEOUT_S, ServerProcess, assert_reply_matches_reference, numpy_args,
                          scan_message, zmq_endpoint, zmq_exchange)
from waiting import wait_until


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
        wait_until(lambda: client.stats()["ops"]["info"]["success_count"] >= answered + 1,
                   "the stdio request was never answered", interval=0.01)


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
        wait_until(lambda: client.unmatched, "the legacy request was never answered")
    reply = msgpack.unpackb(client.unmatched[0].extra["raw"], raw=False)
    assert reply["status"] == "ok" and reply["shape"] == [b, l, h]
    inputs = {"x": torch.from_numpy(x), "dt": torch.from_numpy(dt), "A": torch.from_numpy(A),
              "B": torch.from_numpy(B), "C": torch.from_numpy(C), "dt_min": 0.001, "dt_max": 0.1}
    y = torch.frombuffer(bytearray(reply["result"]), dtype=torch.float32).view(b, l, h)
    assert_close(y, reference_scan(inputs)[0], torch.float32, "legacy y")


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
            # A connection's replies arrive in the order the server sent them: a duplicate sent
            # with those above is in unmatched before the answer to a ping sent after them all.
            assert client.ping() == {"pong": True}
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
        wait_until(lambda: observer.stats()["sessions"]["sessions"] == sessions_before,
                   "the vanished client's session was never freed", interval=0.01)


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

        def freed() -> bool:
            after = observer.stats()
            return (after["sessions"]["sessions"], after["handles"]["handles"]) == \
                (before["sessions"]["sessions"], before["handles"]["handles"])

        wait_until(freed, "the closed connection's session and handle were never freed", interval=0.01)


@pytest.mark.parametrize("lane", [pytest.param("ipc-multipart", id="zmq-ipc"), pytest.param("tcp-inline", id="zmq-tcp")])
def test_a_new_zmq_connection_keeps_its_sessions_when_an_old_one_ends(server, lane):
    """A connection that ends just before another opens (which likely gets its descriptor)
    frees only its own sessions."""
    with UnixClient(server.unix) as observer:
        sessions = lambda: observer.stats()["sessions"]["sessions"]  # noqa: E731
        before = sessions()
        for _ in range(5):
            with lane_client(server, lane) as old:
                old.open_session(1, 3, 2)
            with lane_client(server, lane) as new:
                kept = new.open_session(1, 3, 2)
                # The server has read the old connection's end once its session is freed.
                wait_until(lambda: sessions() <= before + 1, "the old connection's session was never freed",
                           interval=0.01)
                assert new.session_state(kept).shape == (1, 3, 2)
                new.close_session(kept)


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
