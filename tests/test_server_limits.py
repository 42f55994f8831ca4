"""A real server's bounds: per-peer caps of requests in flight, the ZeroMQ queue, the connection
cap, the frame limit, peers that stop reading (unix and stdio), frames that come in pieces, a
half-close, running out of descriptors, and headers that announce bodies never sent."""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import struct
import subprocess
import termios
import threading
import time
from array import array

import msgpack
import pytest
import torch
import zmq

import protocol
from bridge.client import UnixClient, ZmqClient

from bridge_fakes import RecordingConnection
from kernel_cases import ScanCase, make_scan_inputs
from lane_helpers import (REPLY_TIMEOUT_S, assert_reply_matches_reference, ServerProcess, zmq_exchange,
                          scan_message, request_frame, scan_frame, read_reply, raw_unix)
from waiting import wait_until


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
    try:
        with UnixClient(limited.unix) as observer:
            scans = lambda: observer.stats()["ops"].get("scan", {}).get("success_count", 0)  # noqa: E731
            answered = scans()
            sender.start()
            # Its cap of requests in flight answered: those replies pile up unread, and its later
            # requests wait, unread.
            wait_until(lambda: scans() >= answered + 2, "the stuck peer's first two requests were never answered",
                       interval=0.01)
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
        wait_until(lambda: observer.stats()["sessions"]["sessions"] == sessions_before,
                   "the half-closed connection's session was never freed", interval=0.01)


def test_a_zmq_peer_past_its_queue_is_answered_overloaded_and_others_are_served(limited):
    context = zmq.Context.instance()
    flood = context.socket(zmq.DEALER)
    flood.setsockopt(zmq.LINGER, 0)
    flood.connect(limited.ipc)
    # Each takes the server far longer to compute than to receive: they all arrive while the
    # first are computed. Square (dim = state) for the most compute a byte, under the
    # fixture's 3 MB frames: with a quarter of the state a fast CPU kept up with the sends.
    inputs = make_scan_inputs(ScanCase(1, 800, 192, 192))
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
    attempts = []  # (connections kept, the answer and closing of the one turned away) per try

    def four_kept() -> bool:
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
        attempts.append((len(kept), turned_away))
        return len(kept) == 4

    # Connections of earlier tests close once their last reply is written: wait for them.
    wait_until(four_kept, "4 connections were never kept at once", interval=0.1)
    _, turned_away = attempts[-1]
    assert turned_away is not None
    reply, closed = turned_away
    assert reply.id is None and reply.error["code"] == "overloaded" and reply.error["detail"]["limit"] == 4
    assert closed


def test_a_zmq_message_over_the_frame_limit_is_answered_frame_too_large(limited):
    frames = zmq_exchange(limited.ipc, [msgpack.packb({"v": 1, "id": 3, "op": "ping"}),
                                        b"\x01" * 2_000_000, b"\x02" * 1_500_000])
    reply = msgpack.unpackb(frames[0])
    assert reply["error"]["code"] == "frame_too_large" and reply["error"]["detail"]["limit"] == 3_000_000


def input_bytes(fd: int) -> int:
    """How many bytes wait to be read on `fd` (a pipe)."""
    count = array("i", [0])
    fcntl.ioctl(fd, termios.FIONREAD, count, True)
    return count[0]


@contextlib.contextmanager
def stdio_server(tmp_path, kind: str, *args):
    """A server on `kind` stdio ("pipe", a Port's; "socket", a socketpair's, as a libuv parent
    or socat gives) beside `args`' lanes: (the server, its stdin to write to, its stdout to read
    from, the stdout's descriptor here, end(): the stdin closed)."""
    if kind == "pipe":
        srv = ServerProcess(str(tmp_path), *args, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        try:
            yield srv, srv.proc.stdin, srv.proc.stdout, srv.proc.stdout.fileno(), srv.proc.stdin.close
        finally:
            srv.stop()
        return
    ours, theirs = socket.socketpair()
    srv = ServerProcess(str(tmp_path), *args, stdin=theirs.fileno(), stdout=theirs.fileno())
    theirs.close()
    writer, reader = ours.makefile("wb"), ours.makefile("rb", buffering=0)
    try:
        yield srv, writer, reader, ours.fileno(), lambda: ours.shutdown(socket.SHUT_WR)
    finally:
        srv.stop()
        writer.close()
        reader.close()
        ours.close()


@pytest.mark.parametrize("kind", ["pipe", "socket"])
def test_a_stdio_peer_that_reads_nothing_does_not_hold_up_the_other_lanes(tmp_path, kind):
    """A stdio reply is written by the thread that served its request, with the dispatcher's
    serving lock held, which every lane's requests wait for: a Port that stops reading its
    replies must not stop the unix lane. Written blocking, a reply the pipe had no room for held
    the lock until the Port read; on a socket it still did (found in review). Its replies still
    come whole and in order when it reads, and closing its stdin then stops the server."""
    path = str(tmp_path / "bridge.sock")
    with stdio_server(tmp_path, kind, "--stdio", "--unix", path) as (srv, stdin, stdout, stdout_fd, end):
        srv.wait_for_path(path)
        inputs = make_scan_inputs(ScanCase(1, 1024, 512, 4))  # 2 MiB replies: more than a pipe holds
        frame = scan_frame(1, inputs)
        # From a thread: the server reads no more of a peer's requests while its replies wait for
        # it, so whether the second frame is taken before the first reply backs up is the
        # scheduler's choice, and the rest of it may wait until that reply is read.
        writing = threading.Thread(target=lambda: (stdin.write(frame + frame), stdin.flush()), daemon=True)
        writing.start()
        # A pipe's room is its size; a socket's, its buffers' (its reply past them in any case).
        room = fcntl.fcntl(stdout_fd, fcntl.F_GETPIPE_SZ) - 4096 if kind == "pipe" else 64 * 1024
        wait_until(lambda: input_bytes(stdout_fd) >= room, "the stdio replies never filled the pipe")
        with UnixClient(path) as other:
            pong = other.submit("ping")
            try:
                assert pong.result(REPLY_TIMEOUT_S).result == {"pong": True}
            except TimeoutError:
                pytest.fail("a unix ping got no answer while the stdio peer read nothing")
        replies = [read_reply(stdout) for _ in range(2)]
        for i, reply in enumerate(replies):
            assert_reply_matches_reference(reply, inputs, f"stdio reply {i}")
        writing.join(REPLY_TIMEOUT_S)
        assert not writing.is_alive(), "the server never read the second frame"
        end()
        assert srv.proc.wait(REPLY_TIMEOUT_S) == 0, srv.log()
        assert not os.path.exists(path)


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
            wait_until(lambda: pong.done() or "accepting paused" in srv.log(),
                       "neither answered nor refused by accept", interval=0.01)
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


def test_a_reply_tensor_past_msgpacks_bin_length_is_limit_exceeded_not_a_failure(monkeypatch, inproc):
    """A tensor of 2^32 bytes or more cannot go in-band: msgpack's bin carries a 4-byte length
    (here lowered). Found in review: the encoder's OverflowError was answered internal_error and
    logged as the server's failure; it is the reply_frame_size limit (SPEC §2)."""
    import protocol.encode

    srv, conn = inproc(), RecordingConnection()
    inputs = make_scan_inputs(ScanCase(1, 1, 64, 16, return_state=True))
    # A by handle: every tensor the request carries stays under the lowered limit.
    inputs["A"] = protocol.HandleRef(srv.call(conn, "put", tensor=inputs["A"])["handle"])
    monkeypatch.setattr(protocol.encode, "MAX_BIN_BYTES", 1024)
    reply = srv.request(conn, "scan", **inputs)  # its state: 4 KiB
    assert not reply.ok
    assert (reply.error["code"], reply.error["detail"]["limit"]) == ("limit_exceeded", "reply_frame_size")
    assert reply.error["detail"]["requested"] == 64 * 16 * 4
    assert srv.call(conn, "ping") == {"pong": True}
