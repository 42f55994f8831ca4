"""The unix lane in process (UnixTransport with a stand-in or in-process dispatcher, or driven
by hand): connections turned away, frames that cannot be read or answered, accept failures,
turns between connections, one writer thread per connection, requests of a peer gone, taking
over a socket path."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import selectors
import socket
import struct
import threading
import time

import pytest

import protocol
from bridge.streams import read_exact, read_frame

from bridge_fakes import RecordingConnection
from kernel_cases import ScanCase, UpdateCase, make_scan_inputs, make_update_inputs
from lane_helpers import REPLY_TIMEOUT_S, RecordingDispatcher, raw_unix, read_reply, request_frame, scan_frame
from waiting import wait_until


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


def test_a_connection_turned_away_counts_its_answer_as_sent(tmp_path, inproc):
    """The `overloaded` answer to a connection past --max-connections answers no frame read:
    it counts in replies_out, bytes_out and the errors, and in frames_in nothing."""
    srv = inproc()
    stats = srv.server.stats
    with unix_lane(tmp_path, srv.dispatcher, max_connections=1) as transport:
        transport.start()
        kept = raw_unix(transport.path)
        kept_reader = kept.makefile("rb", buffering=0)
        initial = stats.snapshot()
        kept.sendall(request_frame(1, "ping"))
        assert read_reply(kept_reader).ok
        # A reply is counted once written, which can be after its peer has read it.
        wait_until(lambda: stats.snapshot()["replies_out"] > initial["replies_out"],
                   "the first ping's reply was never counted")
        before = stats.snapshot()
        turned_away = raw_unix(transport.path)
        body = read_frame(turned_away.makefile("rb", buffering=0))
        assert protocol.decode_reply(body).error["code"] == "overloaded"
        # Read by the thread that turned the other away: answered once that is done.
        kept.sendall(request_frame(2, "ping"))
        pong = read_frame(kept_reader)
        assert protocol.decode_reply(pong).ok
        wait_until(lambda: stats.snapshot()["replies_out"] - before["replies_out"] >= 2,
                   "the turn-away's answer and the ping's reply were never both counted")
        after = stats.snapshot()
        turned_away.close()
        kept_reader.close()
        kept.close()
    assert [after[key] - before[key] for key in ("frames_in", "replies_out", "bytes_out")] == \
        [1, 2, len(body) + len(pong)]
    assert after["errors"]["overloaded"] - before["errors"].get("overloaded", 0) == 1



def test_connections_turned_away_are_warned_of_at_most_once_an_interval(tmp_path, inproc, caplog):
    """Each connection past --max-connections logged a warning: 3000 connects in a second wrote
    3000 lines (found in review). They are counted (stats, metrics) and warned of once an
    interval."""
    srv = inproc()
    with caplog.at_level(logging.WARNING, logger="bridge"), \
            unix_lane(tmp_path, srv.dispatcher, max_connections=1) as transport:
        transport.start()
        kept = raw_unix(transport.path)
        kept.sendall(request_frame(1, "ping"))
        assert read_reply(kept.makefile("rb", buffering=0)).ok
        for _ in range(5):
            with raw_unix(transport.path) as turned_away:
                body = read_frame(turned_away.makefile("rb", buffering=0))
                assert protocol.decode_reply(body).error["code"] == "overloaded"
        kept.close()
    assert len([r for r in caplog.records if "turned away" in r.getMessage()]) == 1


def test_a_unix_client_turned_away_raises_overloaded_not_server_exited(tmp_path, inproc):
    """SPEC §4: past --max-connections the server answers `overloaded` (retry later) and closes.
    Found in review: the Python client's write then failed, often before its reader had read
    that answer, and the caller got ServerExited (the server gone), also on a client that made
    no request before the close: a busy server could not be told from a dead one."""
    from bridge.client import BridgeError, ServerExited, UnixClient

    srv = inproc()
    with unix_lane(tmp_path, srv.dispatcher, max_connections=1) as transport:
        transport.start()
        with UnixClient(transport.path) as kept:
            kept.ping()
            for settle_s in (0.0, 0.0, 0.3):
                with UnixClient(transport.path) as turned_away:
                    time.sleep(settle_s)  # not synchronisation: with 0.3 s the close has come first
                    with pytest.raises(BridgeError) as refused:
                        turned_away.ping()
                    assert refused.value.code == "overloaded" and refused.value.detail == {"limit": 1}
                    # Once told, a retry on the closed connection is ServerExited: a new client's.
                    with pytest.raises(ServerExited, match="open a new client to retry"):
                        turned_away.ping()
            kept.ping()


def test_connections_already_closed_do_not_keep_a_live_one_out(tmp_path, inproc):
    """The reading thread accepts a whole backlog before it reads, so probes that connected and
    closed while it was busy (health checks) each took a place under --max-connections, and a
    live client behind them was turned away overloaded with two connections open (found in
    review). At the cap, those whose peers are gone are let go first."""
    held, inside = threading.Event(), threading.Event()

    def held_info(server, call):
        inside.set()
        if not held.wait(REPLY_TIMEOUT_S):
            raise TimeoutError("the test never let the info be answered")
        return {"info": True}

    srv = inproc(handlers={"info": held_info})
    with unix_lane(tmp_path, srv.dispatcher, max_connections=4) as transport:
        transport.start()
        busy = raw_unix(transport.path)
        busy.sendall(request_frame(1, "info"))  # served on the reading thread: the server is idle
        assert inside.wait(REPLY_TIMEOUT_S)
        for _ in range(6):
            probe = raw_unix(transport.path)
            probe.close()
        live = raw_unix(transport.path)
        live.sendall(request_frame(2, "ping"))
        held.set()
        reply = read_reply(live.makefile("rb", buffering=0))
        assert reply.ok and reply.result == {"pong": True}, reply.error
        assert read_reply(busy.makefile("rb", buffering=0)).ok
        live.close()
        busy.close()


def test_a_unix_connection_whose_frame_cannot_be_read_ends_there_and_the_lane_serves_on(tmp_path):
    """A failure inside a frame (here: a fault getting a buffer for its body, not a shortage of
    memory, which is answered) must end that connection's input: read on, the rest of the body
    would be taken for frames."""
    dispatcher = RecordingDispatcher()
    with unix_lane(tmp_path, dispatcher) as transport:
        real_acquire = transport.pool.acquire

        def acquire(size):
            if size == 1000:
                raise RuntimeError("a fault in the buffer pool")
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


def short_of_memory_past(transport, size: int, monkeypatch) -> None:
    """The lane's buffer pool fails as mmap does out of memory for bodies past `size` bytes."""
    acquire = transport.pool.acquire

    def short_of_memory(wanted):
        if wanted > size:
            raise OSError(errno.ENOMEM, "Cannot allocate memory")
        return acquire(wanted)

    monkeypatch.setattr(transport.pool, "acquire", short_of_memory)


def test_a_frame_the_machine_has_no_memory_for_is_answered_and_the_connection_serves_on(
        tmp_path, monkeypatch, inproc):
    """A request within --max-frame-size whose buffer cannot be had (mmap's ENOMEM) is drained
    and answered limit_exceeded, limit "memory", id null; the connection reads on. The
    exception escaped the lane's reader before (found in review)."""
    big = request_frame(1, "echo", {"pad": b"x" * 4096})
    with unix_lane(tmp_path, inproc().dispatcher) as transport:
        short_of_memory_past(transport, 1024, monkeypatch)
        transport.start()
        conn = raw_unix(transport.path)
        reader = conn.makefile("rb", buffering=0)
        conn.sendall(big + request_frame(2, "ping"))
        dropped, pong = read_reply(reader), read_reply(reader)
        assert (dropped.id, dropped.ok, dropped.error["code"]) == (None, False, "limit_exceeded"), dropped
        assert dropped.error["detail"] == {"limit": "memory", "length": len(big) - 4}
        assert (pong.id, pong.ok, pong.result) == (2, True, {"pong": True})
        reader.close()
        conn.close()


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


def test_a_native_step_reply_too_large_to_frame_is_answered_with_an_error_and_the_connection_serves_on(
        tmp_path, monkeypatch, inproc):
    """As above for a step the native path serves on the reader thread (its reply here a 4 KiB
    state): not answered, the error ended the connection's input (on stdio, the server)."""
    srv = inproc()
    native = srv.server.fast_path
    if native is None:
        pytest.skip("the native step path is not built here (python -m bridge.native says why)")
    taken = []
    serve = native.serve

    def recording(*args):
        outcome = serve(*args)
        taken.append(outcome is not None)
        return outcome

    native.serve = recording
    inputs = make_update_inputs(UpdateCase(1, 64, 16, bc_2d=True))
    del inputs["state"]
    with unix_lane(tmp_path, srv.dispatcher, max_in_flight=1) as transport:
        transport.start()
        conn = raw_unix(transport.path)
        reader = conn.makefile("rb", buffering=0)
        conn.sendall(request_frame(1, "session_open", {"batch": 1, "dim": 64, "state": 16}))
        session = read_reply(reader).result["session"]
        step = {k: protocol.OutTensor("f32", v.shape, v.numpy()) for k, v in inputs.items()}
        frames = [request_frame(2, "step", {"session": session, "return_state": True, **step}),
                  request_frame(3, "ping")]  # framed before the limit is lowered
        monkeypatch.setattr(protocol.framing, "MAX_FRAMEABLE", 2048)
        conn.sendall(b"".join(frames))
        refused, pong = read_reply(reader), read_reply(reader)
        assert (refused.id, refused.ok, refused.error["code"]) == (2, False, "limit_exceeded")
        assert refused.error["detail"]["limit"] == "reply_frame_size"
        assert (pong.id, pong.ok) == (3, True)
        assert taken == [True], "the native path did not serve the step"
        reader.close()
        conn.close()


def test_an_error_reply_too_large_to_frame_is_answered_with_a_small_one(tmp_path, monkeypatch, inproc):
    """An error reply echoes what the request sent (here an unknown session's id, in the
    detail) and says more, so it may be too long to frame where the request was not: it is
    answered limit_exceeded as a result too long is, not left unanswered (at a cap of one
    request in flight, the connection would never be read again)."""
    frames = [request_frame(1, "session_close", {"session": "x" * 1500}),
              request_frame(2, "ping")]  # framed before the limit is lowered
    # The request's own length: its reply, the id and more, is longer.
    monkeypatch.setattr(protocol.framing, "MAX_FRAMEABLE", len(frames[0]) - protocol.framing.HEADER_SIZE)
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


def test_a_reply_no_writer_thread_can_be_started_for_ends_the_connection(tmp_path):
    """Out of memory, no writer thread could be started for a reply the peer did not take at
    once: the connection hung for good, its peer answered nothing and told nothing (found in
    review). The connection is ended: its peer reads its end."""
    class ReplyingAsTheDispatcherDoes(BigReplyDispatcher):
        def on_frame(self, conn, body, received_ns, release=None, buffers=(), *, more_input=True):
            release()

            def send():
                with contextlib.suppress(OSError):  # the dispatcher logs a reply it could not write
                    conn.send([bytes(body[:1]) * self.REPLY_BYTES])

            threading.Thread(target=send, daemon=True).start()

    size = BigReplyDispatcher.REPLY_BYTES
    with unix_lane(tmp_path, ReplyingAsTheDispatcherDoes()) as transport, \
            contextlib.closing(raw_unix(transport.path)) as conn:
        def no_thread(_conn):
            raise RuntimeError("can't start new thread")

        transport._writers.start = no_thread
        transport.start()
        conn.sendall(protocol.encode_frame(b"A"))  # its reply, far past the socket's buffer, is not read yet
        time.sleep(0.5)  # not synchronisation: the reply's write stalls meanwhile, and would go to a writer
        conn.settimeout(REPLY_TIMEOUT_S)
        got = 0
        while chunk := conn.recv(1 << 20):
            got += len(chunk)
        assert 0 < got < 4 + size, got  # a part, then the end


def test_one_writer_thread_at_a_time_writes_a_unix_connections_replies(tmp_path, monkeypatch):
    """A writer thread that has written the last reply of its backlog must be gone as far as a
    new reply can tell: here it lingers (its _done held), while reply B, written by another
    thread, stalls and is handed to a writer. Two writers would both write B, one stream."""
    from bridge.transports import unix

    real_done = unix.UnixConnection._done
    lingering, may_go_on, gone_on = threading.Event(), threading.Event(), threading.Event()

    def done_held_on_the_first_writer(self, count=1):
        first = threading.current_thread().name.endswith("-writer") and not lingering.is_set()
        if first:
            lingering.set()
            may_go_on.wait(REPLY_TIMEOUT_S)
        real_done(self, count)
        if first:
            gone_on.set()

    monkeypatch.setattr(unix.UnixConnection, "_done", done_held_on_the_first_writer)
    size = BigReplyDispatcher.REPLY_BYTES
    with unix_lane(tmp_path, BigReplyDispatcher()) as transport, \
            contextlib.closing(raw_unix(transport.path)) as conn, conn.makefile("rb", buffering=0) as reader:
        writers_started = []
        start_writer = transport._writers.start
        transport._writers.start = lambda c: (writers_started.append(c), start_writer(c))
        transport.start()
        conn.sendall(protocol.encode_frame(b"A"))
        # A is not read meanwhile: its writer thread takes it over.
        wait_until(lambda: len(writers_started) == 1, "A was never handed to a writer thread")
        frame = memoryview(bytearray(4 + size))
        assert read_exact(reader, frame) and bytes(frame[4:]) == b"A" * size
        assert lingering.wait(REPLY_TIMEOUT_S), "A's writer never finished"
        conn.sendall(protocol.encode_frame(b"B"))  # while A's writer lingers in _done
        # B is not read meanwhile either: it is handed to a writer, and A's goes on before it
        # is written.
        wait_until(lambda: len(writers_started) == 2, "B was never handed to a writer thread")
        may_go_on.set()
        assert gone_on.wait(REPLY_TIMEOUT_S), "A's writer never went on"
        assert read_exact(reader, frame) and protocol.parse_frame_header(frame[:4]) == size
        assert bytes(frame[4:]) == b"B" * size
        conn.settimeout(1.0)
        with pytest.raises(socket.timeout):  # nothing after B: it was written once
            conn.recv(1)
        (served,) = transport._connections
        wait_until(lambda: not served._in_flight, "B was never counted answered")
        assert served._in_flight == 0 and not served._backlog


class HoldingDispatcher(RecordingDispatcher):
    """Records each body and answers none of them: the test answers them through `held`."""

    def __init__(self):
        super().__init__()
        self.held = []

    def on_frame(self, conn, body, received_ns, release=None, buffers=(), *, more_input=True):
        self.bodies.append(bytes(body))
        release()
        self.held.append(conn)


def test_a_connection_stalled_inside_a_frame_is_answered_up_to_it_and_closed(tmp_path):
    """--stall-timeout-s: a peer that sent a whole request, then part of another and nothing
    more, gets the first answered; past the timeout the sweep drops the part (SPEC §2: a stream
    that ends inside a frame loses that frame) and the connection closes, its slot free again.
    Before, the half-sent frame held the connection and its bytes for ever. Driven by hand,
    the peer's silence made by moving its last input back."""
    with unix_lane(tmp_path, RecordingDispatcher(), stall_timeout_s=5.0) as transport, \
            contextlib.closing(raw_unix(transport.path)) as peer:
        transport._accept()
        (conn,) = transport._connections
        peer.sendall(protocol.encode_frame(b"whole") + struct.pack(">I", 100) + b"begun")
        transport._read(conn, others_waiting=False)
        assert transport.dispatcher.bodies == [b"whole"] and not conn.incoming.at_frame_start
        transport._sweep()
        assert conn in transport._connections, "a frame stalled for less than the timeout was dropped"
        conn.last_input -= 5.0
        transport._sweep()
        assert conn not in transport._connections
        reader = peer.makefile("rb", buffering=0)
        assert read_frame(reader) == b"whole"
        assert reader.read(1) == b"", "the connection stayed open, or the dropped frame was answered"


@pytest.mark.parametrize("stall_timeout_s, begun", [(5.0, False), (None, True)],
                         ids=["idle-between-frames", "no-timeout"])
def test_a_connection_is_not_ended_idle_between_frames_or_without_a_timeout(tmp_path, stall_timeout_s, begun):
    """A peer silent between frames is idle, not stalled (the Elixir client holds its connection
    open between calls), and without a timeout a half-sent frame waits as long as it takes."""
    with unix_lane(tmp_path, RecordingDispatcher(), stall_timeout_s=stall_timeout_s) as transport, \
            contextlib.closing(raw_unix(transport.path)) as peer:
        transport._accept()
        (conn,) = transport._connections
        peer.sendall(protocol.encode_frame(b"whole") + (struct.pack(">I", 100) if begun else b""))
        transport._read(conn, others_waiting=False)
        conn.last_input -= 3600.0
        transport._sweep()
        assert conn in transport._connections
        peer.sendall(bytes(100) if begun else protocol.encode_frame(b"next"))
        transport._read(conn, others_waiting=False)
        assert transport.dispatcher.bodies == [b"whole", bytes(100) if begun else b"next"]


def test_a_frame_whose_rest_waits_unread_is_not_stalled(tmp_path):
    """The reading thread serves some requests itself and sweeps late after one that ran long:
    a frame whose rest came meanwhile, waiting unread in the socket, was held up by the server,
    not by its peer, and is read whole."""
    with unix_lane(tmp_path, RecordingDispatcher(), stall_timeout_s=5.0) as transport, \
            contextlib.closing(raw_unix(transport.path)) as peer:
        transport._accept()
        (conn,) = transport._connections
        frame = protocol.encode_frame(b"a frame sent in two parts")
        peer.sendall(frame[:10])
        transport._read(conn, others_waiting=False)
        peer.sendall(frame[10:])
        wait_until(conn.more_input, "the frame's rest never reached the server's socket")
        conn.last_input -= 3600.0
        transport._sweep()
        assert conn in transport._connections, "a frame whose rest was waiting to be read was dropped"
        transport._read(conn, others_waiting=False)
        assert transport.dispatcher.bodies == [b"a frame sent in two parts"]


def test_frames_a_peer_left_unread_past_its_cap_are_not_read_once_it_hung_up(tmp_path):
    """A peer at its cap that closes leaves its later frames unread in the socket: nothing it
    sent can be answered any more, so they are not read and run for nobody once its last
    request in flight is answered; the connection closes and what it owned is freed."""
    dispatcher = HoldingDispatcher()
    with unix_lane(tmp_path, dispatcher, max_in_flight=1) as transport:
        transport.start()
        peer = raw_unix(transport.path)
        peer.sendall(b"".join(protocol.encode_frame(name) for name in (b"first", b"second", b"third")))
        wait_until(lambda: dispatcher.held, "the first frame was never read")
        (conn,) = transport._connections
        freed = threading.Event()
        conn.on_close(lambda _: freed.set())
        peer.close()
        with pytest.raises(OSError):
            dispatcher.held[0].send([b"too late"])
        wait_until(lambda: freed.is_set() or len(dispatcher.bodies) > 1,
                   "the connection of a peer gone was neither closed nor read again")
        assert dispatcher.bodies == [b"first"]
        assert freed.is_set()


SESSION = {"batch": 1, "dim": 4, "state": 2}


def queue_session_opens(srv, transport, count: int, *, then: tuple = ()):
    """`count` session_open requests of a fresh connection (and the requests `then` names, as
    (op, args)), read and queued behind a ping that holds the worker (srv.hold): the raw socket
    and the lane's connection."""
    srv.hold(RecordingConnection())
    peer = raw_unix(transport.path)
    requests = [("session_open", SESSION)] * count + list(then)
    peer.sendall(b"".join(request_frame(i, op, args) for i, (op, args) in enumerate(requests)))
    wait_until(lambda: len(srv.server.queued) == len(requests), "the requests were never queued")
    (conn,) = transport._connections
    return peer, conn


def test_requests_a_vanished_unix_peer_left_queued_are_dropped_not_run(tmp_path, inproc):
    """Requests read and queued behind other work when their peer closed its socket could only
    be run for nobody: found in review, each ran (a session_open opened a session that the
    connection's release freed again right after). They are answered `cancelled` unrun,
    counted as cancelled ones are, and the connection closes owning nothing."""
    srv = inproc()
    with unix_lane(tmp_path, srv.dispatcher, max_in_flight=8) as transport:
        transport.start()
        peer, conn = queue_session_opens(srv, transport, 4)
        peer.close()
        wait_until(lambda: conn._input_ended, "the peer's end of input was never read")
        srv.go()
        wait_until(lambda: not transport._connections, "the vanished peer's connection never closed")
        # The connection closes as the last answer goes; its count is recorded right after.
        wait_until(lambda: srv.dispatcher._pending == 0, "the dropped requests were never answered")
        observer = raw_unix(transport.path)
        observer.sendall(request_frame("stats", "stats"))
        stats = read_reply(observer.makefile("rb", buffering=0)).result
        observer.close()
    opens = stats["ops"]["session_open"]
    assert (opens["success_count"], opens["failure_count"], stats["errors"]) == (0, 4, {"cancelled": 4})
    assert stats["sessions"]["sessions"] == 0 and stats["released"] == {}, "a session was opened for nobody"


def test_a_shutdown_a_vanished_unix_peer_left_queued_still_stops_the_server(tmp_path, inproc):
    """A client may send `shutdown` and close without waiting for the answer: what it does is
    the server's, not its connection's, so it runs once its peer is gone (found in review: it
    was dropped as `cancelled` with the requests queued before it, and the server ran on)."""
    srv = inproc()
    with unix_lane(tmp_path, srv.dispatcher, max_in_flight=8) as transport:
        transport.start()
        peer, conn = queue_session_opens(srv, transport, 1, then=[("shutdown", None)])
        peer.close()
        wait_until(lambda: conn._input_ended, "the peer's end of input was never read")
        srv.go()
        wait_until(lambda: not transport._connections, "the vanished peer's connection never closed")
        wait_until(lambda: srv.dispatcher._pending == 0, "the queued requests were never answered")
    stats = srv.server.stats.snapshot()
    assert srv.server.stop_requested.is_set(), "the shutdown was not run"
    assert (stats["ops"]["shutdown"]["success_count"], stats["errors"]) == (1, {"cancelled": 1})


@pytest.mark.parametrize("at_cap", [pytest.param(False, id="read"), pytest.param(True, id="paused-at-its-cap")])
def test_a_unix_peer_that_only_stopped_sending_has_its_queued_requests_run(tmp_path, inproc, at_cap):
    """A peer that shuts down only its sending side still reads: its queued requests run and
    are answered, and only then is what they opened freed. At its cap, where its input is not
    read, that is not taken for a hang-up either."""
    srv = inproc()
    with unix_lane(tmp_path, srv.dispatcher, max_in_flight=3 if at_cap else 8) as transport:
        transport.start()
        peer, conn = queue_session_opens(srv, transport, 3)
        if at_cap:
            wait_until(lambda: conn._paused, "the connection never stopped being read at its cap")
        peer.shutdown(socket.SHUT_WR)
        if not at_cap:
            wait_until(lambda: conn._input_ended, "the peer's end of input was never read")
        srv.go()
        reader = peer.makefile("rb", buffering=0)
        replies = [read_reply(reader) for _ in range(3)]
        assert reader.read(1) == b"", "the server kept the connection open after answering all"
        reader.close()
        peer.close()
        wait_until(lambda: not transport._connections, "the half-closed connection never closed")
    assert [(reply.id, reply.ok) for reply in replies] == [(0, True), (1, True), (2, True)]
    assert srv.server.stats.snapshot()["released"] == {
        "closed": {"peers": 1, "sessions": 3, "snapshots": 0, "models": 0, "handles": 0}}


@pytest.mark.parametrize("half_close_first", [pytest.param(False, id="closed"),
                                              pytest.param(True, id="half-closed-then-closed")])
def test_requests_of_a_peer_that_closed_at_its_cap_are_dropped_not_run(tmp_path, inproc, half_close_first):
    """A connection at its cap is not read, so the end of its input is not seen: found in
    review, a peer that closed then (having shut down its sending side first or not) was seen
    gone only once a reply to it failed, so its first queued request still ran for nobody (a
    session opened and freed again). Its hang-up is looked for while it is not read: each
    queued request is answered `cancelled` unrun."""
    srv = inproc()
    with unix_lane(tmp_path, srv.dispatcher, max_in_flight=3) as transport:
        transport.start()
        peer, conn = queue_session_opens(srv, transport, 3)
        wait_until(lambda: conn._paused, "the connection never stopped being read at its cap")
        if half_close_first:
            peer.shutdown(socket.SHUT_WR)
        peer.close()
        srv.go()
        wait_until(lambda: not transport._connections, "the vanished peer's connection never closed")
        wait_until(lambda: srv.dispatcher._pending == 0, "the queued requests were never answered")
    stats = srv.server.stats.snapshot()
    opens = stats["ops"]["session_open"]
    assert (opens["success_count"], opens["failure_count"], stats["errors"]) == (0, 3, {"cancelled": 3})
    assert stats["released"] == {}, "a session was opened for nobody"


def test_a_lane_closing_leaves_the_socket_file_of_a_server_started_since_on_its_path(tmp_path):
    """A lane removed whatever file lay at its path when it closed: a server started after the
    first one's file was deleted (a /tmp cleaner, an operator's rm) lost its own file when the
    first stopped, and nobody could reach it (found in review)."""
    from bridge.transports.unix import UnixTransport

    options = dict(max_frame_size=1024, max_in_flight=1, max_connections=1)
    path = str(tmp_path / "lane.sock")
    first = UnixTransport(None, path, **options)
    os.unlink(path)
    second = UnixTransport(None, path, **options)
    try:
        first.close()
        assert os.path.exists(path), "the first lane removed the second's socket file"
    finally:
        second.close()
    assert not os.path.exists(path)


def test_a_unix_path_starting_with_at_is_a_file_removed_on_close(tmp_path, monkeypatch):
    """`--unix @name` binds a file of that name (only ZeroMQ spells the abstract namespace so):
    the lane took it for an abstract socket and left it behind (found in review)."""
    from bridge.transports.unix import UnixTransport

    monkeypatch.chdir(tmp_path)
    UnixTransport(None, "@lane", max_frame_size=1024, max_in_flight=1, max_connections=1).close()
    assert not (tmp_path / "@lane").exists()


def test_a_unix_lane_that_fails_to_open_or_never_starts_leaves_no_socket_open(tmp_path, monkeypatch):
    """A path that cannot be bound left its listener open, and a lane closed before it started
    (another lane failing to open) its wake-up pair and selector: sockets unclosed until the
    collector found them (ResourceWarnings, found in review)."""
    import bridge.transports.unix as unix

    made = []

    class Recorded(socket.socket):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(unix.socket, "socket", Recorded)
    monkeypatch.setattr(unix.socket, "socketpair", lambda: (Recorded(socket.AF_UNIX), Recorded(socket.AF_UNIX)))
    options = dict(max_frame_size=1024, max_in_flight=1, max_connections=1)
    open_before = sorted(os.listdir("/proc/self/fd"))
    with pytest.raises(OSError):
        unix.UnixTransport(None, str(tmp_path / "no-such-directory" / "lane.sock"), **options)
    lane = unix.UnixTransport(None, str(tmp_path / "lane.sock"), **options)
    lane.close()
    assert len(made) == 4 and [sock.fileno() for sock in made] == [-1] * 4
    assert sorted(os.listdir("/proc/self/fd")) == open_before  # the selector's epoll descriptor too


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


def test_accepting_paused_out_of_descriptors_is_warned_once_a_while_not_at_every_sweep(tmp_path, caplog):
    """Out of descriptors, accepting pauses and is tried again at each sweep (every second),
    and each try warned again: a log line a second while the shortage lasted (found in review
    under `ulimit -n`)."""
    from bridge.transports.unix import UnixTransport

    lane = UnixTransport(None, str(tmp_path / "lane.sock"), max_frame_size=1024, max_in_flight=1, max_connections=1)
    try:
        class OutOfDescriptors:
            def __init__(self, listener):
                self._listener = listener

            def accept(self):
                raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))

            def __getattr__(self, name):
                return getattr(self._listener, name)

        real = lane._listener
        lane._selector.register(real, selectors.EVENT_READ)
        lane._listener = OutOfDescriptors(real)
        with caplog.at_level(logging.WARNING, logger="bridge"):
            for _ in range(5):  # five sweeps' tries
                lane._accept()
                lane._selector.register(real, selectors.EVENT_READ)
        assert sum("accepting paused" in record.getMessage() for record in caplog.records) == 1
        lane._listener = real
    finally:
        lane.close()
