"""The unix-socket lane: the stdio framing (SPEC §2) on a listening unix socket, for many
connections at once, all served by the one dispatcher.

One thread reads every connection: it waits on all of them at once (a selector), reads what
each has without blocking into pooled buffers (as on stdio), and hands each complete frame to
the dispatcher on the spot, so a plain step is served natively on that thread as one over stdio
is. With a reader thread per connection, as this lane had before, many callers lost most of
their throughput, most likely to a thread wake-up and a GIL hand-over at every step
(docs/performance.md, "unix event loop").

Each connection has a cap on the requests it has in flight: at the cap its input is no longer
read, so the peer's further requests wait in its own socket buffer and nobody else's. Replies
are written as on stdio (framed.StreamConnection: non-blocking, the rest of a reply a peer does
not take in time handed to a writer thread of its own), with a shorter budget when the reading
thread writes, which every connection waits on (`READER_STALL_SECONDS`, `READER_WRITE_SECONDS`).
A connection whose peer has closed its end and whose replies are all written (or undeliverable)
is closed, and what it owned (sessions, tensor handles) is freed through `mark_closed`. So is
one whose peer stopped partway through a frame and sent nothing more for `stall_timeout_s`:
that frame is lost, as when a stream ends inside one (SPEC §2), and the connection's slot and
the bytes its frame holds are not kept for ever by a peer that hung or left them on purpose.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import os
import selectors
import socket
import threading
import time

import protocol

from ..buffers import BufferPool
from ..logs import ThrottledWarning
from ..timing import now_ns
from .base import FLUSH_SECONDS, SocketFile, claim_socket_path
from .framed import IOV_MAX, StreamConnection, WriterThreads, hung_up, input_waiting

log = logging.getLogger("bridge.unix")

# framed.STALL_SECONDS and WRITE_SECONDS for the reading thread (a native step's reply, an
# error, a request served inline), which every connection waits on: a shorter stall, and a
# bound on the whole write, so that a peer reading just fast enough to make progress cannot
# hold it for a whole large reply.
READER_STALL_SECONDS = 0.001
READER_WRITE_SECONDS = 0.005
# How often the reading thread looks, without being woken, at connections it is not reading
# (a wake-up that could not be sent) and at a listener it stopped accepting on.
SWEEP_SECONDS = 1.0
LISTEN_BACKLOG = 128
# accept() failures that pause accepting (it would fail again at once); any other costs only the
# connection it was for.
OUT_OF_RESOURCES = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
# Enough pooled receive buffers for several connections with a big request each in flight.
POOLED_BUFFERS = 32
# Socket buffers of each connection (the kernel caps them at net.core.wmem_max / rmem_max).
# The default ~200 KiB made a 4 MB reply and an 8 MB request take dozens of wake-ups each
# side; 4 MiB made the Elixir client's ExPhil round trip cheaper
# (docs/performance.md, "elixir unix socket buffers").
SOCKET_BUFFER_BYTES = 4 << 20
# Frames, and bytes, taken from one connection before the reading thread looks at the others
# again, so that neither a peer pipelining many small requests nor one streaming a large frame
# (up to --max-frame-size) can keep the others waiting. The byte cap cost a lone ExPhil request
# no measurable IPC (docs/performance.md, "unix bytes per turn").
FRAMES_PER_TURN = 16
BYTES_PER_TURN = 1 << 20


class UnixConnection(StreamConnection):
    def __init__(self, sock: socket.socket, max_in_flight: int, incoming: protocol.FrameAssembler, wake,
                 start_writer, reading_thread: threading.Thread):
        super().__init__("unix", sock, start_writer)
        self._reading_thread = reading_thread
        self.sock = sock
        self.max_in_flight = max_in_flight
        # Whether more of its input waits (for the dispatcher, which asks only when it matters).
        self.more_input = functools.partial(input_waiting, sock.fileno())
        # The frame being read (reading thread only).
        self.incoming = incoming
        # Asks the reading thread to look at this connection again (it resumes reading, or
        # closes the connection); called when an answer frees a slot it waits for.
        self._wake = wake
        # Requests read and not yet answered (reply written, or undeliverable).
        self._in_flight = 0
        self._count_lock = threading.Lock()
        # Set by the reading thread, under _count_lock: it stopped reading at the cap, or the
        # peer's input ended (EOF or an error); either way an answer may be what it waits for.
        self._paused = False
        self._input_ended = False
        # When its input last brought bytes (reading thread only): a frame begun and not
        # continued since is stalled.
        self.last_input = time.monotonic()

    # -- reading side (the transport's reading thread) ------------------------------------

    def pause_at_cap(self) -> bool:
        """Before a new frame: True (and paused) when the connection has its cap in flight."""
        with self._count_lock:
            self._paused = self._in_flight >= self.max_in_flight
            return self._paused

    def end_input(self) -> bool:
        """The peer sends nothing more. True when nothing is in flight: close it now."""
        self.incoming.eof()
        with self._count_lock:
            self._input_ended = True
            return self._in_flight == 0

    def admit(self) -> None:
        """Count a complete frame in flight (it will be answered exactly once)."""
        with self._count_lock:
            self._in_flight += 1

    def _done(self, count: int = 1) -> None:
        with self._count_lock:
            self._in_flight -= count
            wake = (self._paused and self._in_flight < self.max_in_flight) or \
                (self._input_ended and self._in_flight == 0)
            if wake:
                self._paused = False
        if wake:
            self._wake(self)

    @property
    def peer_gone(self) -> bool:
        """Also once the peer closed its socket (hung up, not merely done sending: a peer that
        shut down only its sending side still reads its replies) where its input is not read:
        after its last request, or while paused at its cap, where its end of input is not seen.
        Not while its input is read: what it sent before closing is read first (a `shutdown`
        among it still runs), and a step read then pays for no system call."""
        return super().peer_gone or ((self._input_ended or self._paused) and hung_up(self.sock.fileno()))

    @property
    def finished(self) -> bool:
        """Input ended and every request read is answered."""
        with self._count_lock:
            return self._input_ended and self._in_flight == 0

    @property
    def resumable(self) -> bool:
        """Not read (paused at its cap) but below it now: a wake-up for it may have been lost."""
        with self._count_lock:
            return not self._input_ended and self._in_flight < self.max_in_flight

    # -- replies --------------------------------------------------------------------------

    def _write_nowait(self, views: list[memoryview]) -> int:
        return self.sock.sendmsg(views[:IOV_MAX], (), socket.MSG_DONTWAIT)

    def _abandon_stream(self) -> None:
        # Both ways: the peer reads its end, and the reading thread, woken, closes the connection.
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)

    def _write_budget(self) -> tuple[float, float]:
        if threading.current_thread() is self._reading_thread:
            return READER_STALL_SECONDS, READER_WRITE_SECONDS
        return super()._write_budget()


class UnixTransport:
    """Listens on `path`; one thread accepts and reads every connection."""

    def __init__(self, dispatcher, path: str, *, max_frame_size: int, max_in_flight: int,
                 max_connections: int, stall_timeout_s: float | None = None):
        """`stall_timeout_s`: how long a connection may leave a frame half-sent before its input
        is ended (None: for ever)."""
        self.dispatcher = dispatcher
        self.path = path
        self.max_frame_size = max_frame_size
        self.max_in_flight = max_in_flight
        self.max_connections = max_connections
        self.stall_timeout_s = stall_timeout_s
        self.pool = BufferPool(max_buffers=POOLED_BUFFERS)
        self._connections: set[UnixConnection] = set()
        self._turned_away = ThrottledWarning(log)
        # Out of descriptors, accepting pauses and is tried again at each sweep: said once a while.
        self._paused = ThrottledWarning(log)
        self._listener = _listen(path)
        self._socket_file = SocketFile(path)
        self._listener.setblocking(False)
        self._selector = selectors.DefaultSelector()
        # Other threads ask the reading thread to look at a connection again by adding it to
        # _woken and, when the set was empty, writing a byte to _wake_send.
        self._wake_receive, self._wake_send = socket.socketpair()
        self._wake_receive.setblocking(False)
        self._wake_send.setblocking(False)
        self._woken: set[UnixConnection | None] = set()
        self._woken_lock = threading.Lock()
        self._writers = WriterThreads()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="unix-reader", daemon=True)

    @property
    def names(self) -> list[str]:
        """How `info` lists this lane."""
        return [f"unix {self.path}"]

    def start(self) -> None:
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._selector.register(self._wake_receive, selectors.EVENT_READ)
        self._thread.start()

    def close(self, deadline: float | None = None) -> None:
        """Stop accepting, remove the socket file, and give the writer threads until `deadline`
        (time.monotonic(); FLUSH_SECONDS from now by default) to write the replies they were
        handed (connections end with the process, and the dispatcher counts a reply handed to a
        writer as answered)."""
        self._socket_file.remove()
        if self._thread.is_alive():
            self._stopping = True  # the reading thread closes the listener it waits on
            self._wake(None)
        else:  # never started (another lane failed to open): nothing else closes these
            for closeable in (self._listener, self._selector, self._wake_receive, self._wake_send):
                closeable.close()
        unwritten = self._writers.join(time.monotonic() + FLUSH_SECONDS if deadline is None else deadline)
        if unwritten:
            log.warning("unix lane: %d connections' replies still unwritten at the shutdown deadline are lost",
                        unwritten)

    # -- the reading thread ---------------------------------------------------------------

    def _run(self) -> None:
        next_sweep = time.monotonic() + SWEEP_SECONDS
        while True:
            ready = [key for key, _ in self._selector.select(max(0.0, next_sweep - time.monotonic()))]
            if time.monotonic() >= next_sweep:
                try:
                    self._sweep()
                except Exception:
                    log.exception("unix lane: the sweep failed")
                next_sweep = time.monotonic() + SWEEP_SECONDS
            # Connections with input waiting after the one being read (the listener's and the
            # wake-up socket's keys carry no connection).
            waiting = sum(key.data is not None for key in ready)
            for key in ready:
                if key.data is None:
                    try:
                        if key.fileobj is self._wake_receive:
                            self._look_again()
                        elif self._registered(key.fileobj):  # not closed since the select
                            self._accept()
                    except Exception:  # a bug here must not stop every connection's input
                        log.exception("unix lane: a wake-up or an accept failed")
                    continue
                waiting -= 1
                if self._registered(key.fileobj):  # not closed or paused since the select
                    self._read_guarded(key.data, waiting > 0)

    def _read_guarded(self, conn: UnixConnection, others_waiting: bool) -> None:
        """_read, ending the connection's input if it fails: the frame it was in is lost, and
        what follows could not be told apart from frames."""
        try:
            self._read(conn, others_waiting)
        except Exception:
            log.exception("%s: reading failed; its input ends here", conn.id)
            try:
                self._end_input(conn)
            except Exception:
                log.exception("%s: ending its input failed", conn.id)

    def _wake(self, conn: UnixConnection | None) -> None:
        """From any thread: have the reading thread look at `conn` again (None: at the lane)."""
        with self._woken_lock:
            first = not self._woken
            self._woken.add(conn)
        if first:
            try:
                self._wake_send.send(b"\0")
            except BlockingIOError:  # a wake-up is pending already
                pass
            except OSError as exc:  # the next sweep finds it
                log.warning("unix lane: a wake-up could not be sent: %s", exc)

    def _look_again(self) -> None:
        try:
            while self._wake_receive.recv(4096):
                pass
        except BlockingIOError:
            pass
        with self._woken_lock:
            woken, self._woken = self._woken, set()
        woken.discard(None)
        if self._stopping:
            self._stop_accepting()
        for conn in woken:
            self._look_at(conn, others_waiting=len(woken) > 1)

    def _look_at(self, conn: UnixConnection, others_waiting: bool = False) -> None:
        """Close a connection whose input ended once all is answered; resume reading one that
        was paused at its cap."""
        if conn.finished:
            self._close(conn)
        elif conn in self._connections and not self._registered(conn.sock) and conn.resumable:
            self._selector.register(conn.sock, selectors.EVENT_READ, conn)
            self._read_guarded(conn, others_waiting)

    def _sweep(self) -> None:
        """Every SWEEP_SECONDS: retry a paused accept, look at every connection not being read,
        in case a wake-up for it was lost, and end the input of those stalled inside a frame."""
        self._resume_accepting()
        now = time.monotonic()
        for conn in list(self._connections):
            if not self._registered(conn.sock):
                self._look_at(conn)
            elif self._stalled(conn, now):
                log.warning("%s: sent part of a frame and nothing more for %g s (--stall-timeout-s): that "
                            "frame is dropped and the connection's input ends", conn.id, self.stall_timeout_s)
                self._end_input(conn)

    def _stalled(self, conn: UnixConnection, now: float) -> bool:
        """Inside a frame, no bytes for stall_timeout_s, and none waiting now: bytes waiting
        unread mean this thread was the one held up (serving a request), not the peer."""
        return (self.stall_timeout_s is not None and not conn.incoming.at_frame_start
                and now - conn.last_input >= self.stall_timeout_s and not input_waiting(conn.sock.fileno()))

    def _registered(self, fileobj) -> bool:
        return fileobj.fileno() >= 0 and self._selector.get_map().get(fileobj) is not None

    def _resume_accepting(self) -> None:
        """Take the listener back into the selector after an accept failed (see _accept)."""
        if not self._stopping and not self._registered(self._listener):
            self._selector.register(self._listener, selectors.EVENT_READ)

    def _stop_accepting(self) -> None:
        if self._listener.fileno() >= 0:
            if self._registered(self._listener):
                self._selector.unregister(self._listener)
            self._listener.close()

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except BlockingIOError:
                return
            except OSError as exc:
                if exc.errno not in OUT_OF_RESOURCES:  # that one connection failed (it was aborted)
                    log.info("unix lane: a connection could not be accepted: %s", exc)
                    continue
                # Out of file descriptors, say: the listener is left out of the selector, which
                # would report it ready again at once, until a connection closes or the next sweep.
                self._paused.warn("unix lane: accepting paused until a connection closes (or for %g s): %s",
                                  SWEEP_SECONDS, exc)
                self._selector.unregister(self._listener)
                return
            sock.setblocking(True)  # replies are written blocking by writer threads
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER_BYTES)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER_BYTES)
            conn = UnixConnection(sock, self.max_in_flight, protocol.FrameAssembler(self.max_frame_size, self.pool.acquire),
                                  self._wake, self._writers.start, self._thread)
            if len(self._connections) >= self.max_connections:
                self._reap_ended()
            if len(self._connections) >= self.max_connections:
                self._turn_away(conn)
                continue
            self._connections.add(conn)
            self._selector.register(sock, selectors.EVENT_READ, conn)

    def _reap_ended(self) -> None:
        """End the input of connections whose peers closed with nothing left to read: this
        thread accepts a whole backlog before it reads, so connections already gone (a health
        check's, a probe's) would otherwise fill the cap ahead of live ones."""
        for conn in list(self._connections):
            if self._registered(conn.sock) and _peer_closed(conn.sock):
                self._end_input(conn)

    def _turn_away(self, conn: UnixConnection) -> None:
        """Answer a connection over the cap with one `overloaded` error (id nil) and close it."""
        message = f"the server serves at most {self.max_connections} unix connections at once"
        self._turned_away.warn("%s turned away: %s", conn.id, message)
        parts = protocol.encode_error(None, "overloaded", message, {"limit": self.max_connections})
        stats = self.dispatcher.server.stats
        stats.record_error("overloaded")
        try:
            # A fresh connection's send buffer is empty: this small frame fits without blocking.
            conn.sock.send(b"".join(protocol.frame_parts(parts)), socket.MSG_DONTWAIT)
        except OSError:
            pass  # the peer is already gone
        else:
            stats.reply_out(parts, lane=conn.lane)  # a reply that answers no frame read (SPEC §4)
        conn.sock.close()

    def _read(self, conn: UnixConnection, others_waiting: bool) -> None:
        """Read what `conn` has without blocking, handing on each frame as it completes: until
        it has nothing more, has its cap in flight, has sent FRAMES_PER_TURN frames or
        BYTES_PER_TURN bytes this turn, or its input ends. `others_waiting`: other connections
        have input waiting too."""
        incoming = conn.incoming
        frames = taken = 0
        while frames < FRAMES_PER_TURN and taken < BYTES_PER_TURN:
            if incoming.at_frame_start and conn.peer_gone:
                # What it left unread (past its cap, or behind a request served on this thread)
                # could never be answered: read, it would only be run for nobody.
                self._end_input(conn)
                return
            if incoming.at_frame_start and conn.pause_at_cap():
                self._selector.unregister(conn.sock)  # an answer wakes it (UnixConnection._done)
                return
            try:
                space = incoming.space()
                n = conn.sock.recv_into(space, min(len(space), BYTES_PER_TURN - taken), socket.MSG_DONTWAIT)
            except BlockingIOError:
                return
            except OSError as exc:  # reset by the peer: its replies will fail and free their slots
                log.info("%s: %s", conn.id, exc)
                n = 0
            if not n:
                self._end_input(conn)
                return
            conn.last_input = time.monotonic()
            taken += n
            frame = incoming.advance(n)
            if frame is None:
                continue
            frames += 1
            conn.admit()
            if isinstance(frame, protocol.FrameDropped):
                self.dispatcher.on_frame_error(conn, frame)
                continue
            body, release = frame
            # With nothing more waiting, an idle server may serve this frame on this thread. Not
            # while other connections wait to be read: this thread reads them all, and serving
            # one after another here would keep the batcher from ever gathering them.
            self.dispatcher.on_frame(conn, body, now_ns(), release,
                                     more_input=True if others_waiting else conn.more_input)

    def _end_input(self, conn: UnixConnection) -> None:
        """The peer sent its last frame (or is gone): the connection closes once every request
        it sent is answered (the peer may have only shut down its sending side)."""
        if self._registered(conn.sock):
            self._selector.unregister(conn.sock)
        if conn.end_input():
            self._close(conn)

    def _close(self, conn: UnixConnection) -> None:
        if conn not in self._connections:
            return
        self._connections.discard(conn)
        if self._registered(conn.sock):
            self._selector.unregister(conn.sock)
        try:
            conn.mark_closed()
        finally:
            conn.sock.close()
        self._resume_accepting()  # its descriptor is free now


def _peer_closed(sock: socket.socket) -> bool:
    """Whether the peer closed (or reset) `sock` with nothing left unread: a request it sent
    before closing is still to be read and answered."""
    try:
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def _listen(path: str) -> socket.socket:
    """A listening socket at `path`, replacing a stale socket file left by a dead server but
    never a live server's socket or any other file."""
    claim_socket_path(path, "--unix")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(path)
        listener.listen(LISTEN_BACKLOG)
    except BaseException:
        listener.close()
        raise
    return listener
