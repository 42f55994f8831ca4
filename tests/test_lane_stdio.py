"""The stdio lane in process: its reader (`serve_frames`) on pipes or a socket, with a stand-in dispatcher."""

from __future__ import annotations

import os
import select
import socket
import threading
import time

import pytest

import protocol
from bridge.buffers import BufferPool
from bridge.streams import read_frame

from lane_helpers import REPLY_TIMEOUT_S, RecordingDispatcher
from waiting import wait_until


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

    def noting_the_wait(*args):
        if conn._backlog:
            reader_waits.set()
        return real_wait(*args)

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


def test_a_reply_no_writer_thread_can_be_started_for_breaks_the_connection_not_the_lane(monkeypatch):
    """Out of memory, a thread could not be started for a reply the peer did not take at once:
    the reply stayed queued with no writer, every later one behind it, the connection silent for
    good, and the lane's close failed joining a thread never started (found in review). The
    connection is now broken (its peer gone), and the lane closes."""
    from bridge.transports.framed import FdConnection, WriterThreads

    replies_in, replies_out = os.pipe()
    os.set_blocking(replies_out, False)
    writers = WriterThreads()
    conn = FdConnection("stdio", replies_out, writers.start)

    def no_thread(self):
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Thread, "start", no_thread)
    with pytest.raises(OSError, match="no thread to write the rest of a reply"):
        conn.send([bytes(1 << 20)])  # more than the pipe holds: the rest would go to a writer
    monkeypatch.undo()
    assert conn.peer_gone and not conn._backlog
    with pytest.raises(BrokenPipeError):
        conn.send([b"later"])
    assert writers.join(time.monotonic() + REPLY_TIMEOUT_S) == 0
    os.close(replies_in)
    os.close(replies_out)


def test_a_peer_that_closes_its_input_and_reads_no_replies_ends_the_readers_wait():
    """The reader waits for a peer to read its replies before it reads on; a peer that closed
    its input and reads nothing held it there for ever, and the server, never reading the EOF,
    never stopped. Once the peer has hung up and HANGUP_GRACE_S passed, its input ends."""
    from bridge.transports import framed
    from bridge.transports.framed import FdConnection, WriterThreads, serve_frames

    requests_in, requests_out = os.pipe()
    replies_in, replies_out = os.pipe()
    os.set_blocking(replies_out, False)
    writers = WriterThreads()
    conn = FdConnection("stdio", replies_out, writers.start)
    with open(requests_in, "rb", buffering=0) as raw:
        reading = threading.Thread(target=serve_frames, args=(raw, conn, RecordingDispatcher(), BufferPool(), 1 << 20),
                                   daemon=True)
        reading.start()
        with open(requests_out, "wb", buffering=0) as requests:
            requests.write(protocol.encode_frame(bytes(256) * 1024))  # echoed: more than the pipe holds
            # The grace runs from the hang-up, this close: timed from before it, not from when this
            # thread next runs, which on a loaded box can be after the reader saw the hang-up.
            before_hang_up = time.monotonic()
        wait_until(lambda: conn._backlog, "the reply never waited for its reader")
        reading.join(REPLY_TIMEOUT_S)
        assert not reading.is_alive(), "the reader still waits for a peer that closed its input"
        assert time.monotonic() - before_hang_up >= framed.HANGUP_GRACE_S
    os.close(replies_in)
    writers.join(time.monotonic() + REPLY_TIMEOUT_S)
    os.close(replies_out)


def test_a_stdio_peer_that_closes_its_input_has_the_grace_to_read_its_replies_before_it_counts_as_ended():
    """operations.md: a peer that closes stdin gets HANGUP_GRACE_S to read the replies waiting
    for it before its input counts as ended. The server's own poll (input_ended) ended it after
    HANGUP_SEEN_S and began the shutdown, cutting off a reply the peer read within the grace
    (found in review)."""
    from bridge.transports import framed
    from bridge.transports.stdio import StdioTransport

    requests_in, requests_out = os.pipe()
    replies_in, replies_out = os.pipe()
    transport = StdioTransport(RecordingDispatcher(), requests_in, replies_out, 1 << 20)
    transport.start()
    try:
        with open(requests_out, "wb", buffering=0) as requests:
            requests.write(protocol.encode_frame(bytes(256) * 1024))  # echoed: more than the pipe holds
            wait_until(lambda: transport.conn.replies_waiting, "the reply never waited for its reader")
            before_hang_up = time.monotonic()
        wait_until(transport.input_ended, "the input never counted as ended")
        assert time.monotonic() - before_hang_up >= framed.HANGUP_GRACE_S
    finally:
        with open(replies_in, "rb", buffering=0) as replies:
            assert len(read_frame(replies)) == 256 * 1024, "the reply the peer reads late is cut off"
            transport.close()
        os.close(requests_in)
        os.close(replies_out)


def test_a_socket_peer_that_shuts_down_its_sending_side_and_reads_no_replies_ends_the_readers_wait():
    """As above where stdin and stdout are one socket (a libuv parent's socketpair, socat,
    systemd): such a peer ends its input by shutting down its sending side only, which poll
    tells as POLLRDHUP, not the POLLHUP of a pipe's close, so the reader waited for it for ever
    and the server never stopped."""
    from bridge.transports import framed
    from bridge.transports.framed import WriterThreads, serve_frames
    from bridge.transports.stdio import reply_connection

    server_end, peer = socket.socketpair()
    writers = WriterThreads()
    conn = reply_connection(server_end.fileno(), writers.start)
    with server_end, peer, open(server_end.fileno(), "rb", buffering=0, closefd=False) as raw:
        reading = threading.Thread(target=serve_frames, args=(raw, conn, RecordingDispatcher(), BufferPool(), 8 << 20),
                                   daemon=True)
        reading.start()
        peer.sendall(protocol.encode_frame(bytes(4 << 20)))  # echoed: more than the socket holds
        before_hang_up = time.monotonic()  # the grace runs from this shutdown (see above)
        peer.shutdown(socket.SHUT_WR)
        wait_until(lambda: conn._backlog, "the reply never waited for its reader")
        reading.join(REPLY_TIMEOUT_S)
        assert not reading.is_alive(), "the reader still waits for a peer that ended its input"
        assert time.monotonic() - before_hang_up >= framed.HANGUP_GRACE_S
    assert writers.join(time.monotonic() + REPLY_TIMEOUT_S) == 0


class ReadsNoted:
    """The reader's input, which notes that a read was tried (and returned)."""

    def __init__(self, raw):
        self.raw = raw
        self.tried = threading.Event()

    def readinto(self, view):
        try:
            return self.raw.readinto(view)
        finally:
            self.tried.set()

    def fileno(self):
        return self.raw.fileno()


def test_a_stdin_whose_description_a_parent_made_non_blocking_is_waited_on_not_taken_for_its_end():
    """O_NONBLOCK belongs to an open file description, which stdin may share with the parent
    that set it: a read with no input yet then finds none (readinto returns None), which the
    reader took for the end of its input, so the server stopped at once ("stdin closed")."""
    from bridge.transports.framed import FdConnection, WriterThreads, serve_frames

    requests_in, requests_out = os.pipe()
    replies_in, replies_out = os.pipe()
    os.set_blocking(requests_in, False)
    writers = WriterThreads()
    conn = FdConnection("stdio", replies_out, writers.start)
    with open(requests_in, "rb", buffering=0) as raw, open(replies_in, "rb", buffering=0) as replies:
        watched = ReadsNoted(raw)
        reading = threading.Thread(target=serve_frames, args=(watched, conn, RecordingDispatcher(), BufferPool(),
                                                              1 << 20), daemon=True)
        reading.start()
        assert watched.tried.wait(REPLY_TIMEOUT_S), "the reader never tried to read"
        with open(requests_out, "wb", buffering=0) as requests:
            requests.write(protocol.encode_frame(b"late"))
            answered = select.poll()
            answered.register(replies, select.POLLIN)
            assert answered.poll(REPLY_TIMEOUT_S * 1000), "a request sent late got no answer"
            assert bytes(read_frame(replies)) == b"late"
        reading.join(REPLY_TIMEOUT_S)
        assert not reading.is_alive(), "the reader did not end at its input's end"
    os.close(replies_out)


def test_a_hang_up_is_still_seen_where_poll_has_no_sending_side_flag(monkeypatch):
    """POLLRDHUP (a socket's peer that shut down its sending side) is Linux's: elsewhere the
    stdio reader's wait for a peer that stops reading raised AttributeError, ending the lane,
    where a closed pipe is still seen as hung up."""
    from bridge.transports.framed import hung_up

    monkeypatch.delattr(select, "POLLRDHUP", raising=False)
    read_end, write_end = os.pipe()
    try:
        assert not hung_up(read_end, sending_side=True)
        os.close(write_end)
        assert hung_up(read_end, sending_side=True)
    finally:
        os.close(read_end)
