"""The unix-socket lane: the stdio framing (SPEC §2) on a listening unix socket, for many
connections at once, all served by the one dispatcher.

Each connection has a reader thread (frames read into pooled buffers, as on stdio) and a cap on
the requests it has in flight: past the cap its reader stops reading, so the peer's further
requests wait in its own socket buffer and nobody else's. Replies are written by whichever
thread produced them, without ever blocking it on a peer that does not read: the reply is
written non-blocking, and a peer that accepts no byte for `STALL_SECONDS` gets the rest
written by a writer thread of its own (later replies queue behind it, in order). A
connection whose peer has closed its end and whose replies are all written (or undeliverable)
is closed, and what it owned (sessions, tensor handles) is freed through `mark_closed`.
"""

from __future__ import annotations

import collections
import logging
import os
import select
import socket
import stat
import threading

import protocol

from ..buffers import BufferPool
from .base import Connection
from .framed import IOV_MAX, byte_views, consume, serve_frames

log = logging.getLogger("bridge.unix")

# How long the replying thread waits for a peer that accepts no byte of a reply before handing
# the rest to the connection's writer thread. A peer that is reading makes progress far more
# often than this; the dispatcher's worker is held up at most this long by a stuck one.
STALL_SECONDS = 0.02
LISTEN_BACKLOG = 128
# Enough pooled receive buffers for several connections with a big request each in flight.
POOLED_BUFFERS = 32
# Socket buffers of each connection (the kernel caps them at net.core.wmem_max / rmem_max).
# The default ~200 KiB made a 4 MB reply and an 8 MB request take dozens of wake-ups each
# side; at 4 MiB the Elixir client's ExPhil round trip lost ~0.4 ms of IPC (median IPC
# 3.37 ms against 3.80 ms over three alternated runs each,
# bench/results/elixir_unix_socket_buffers_ab.json).
SOCKET_BUFFER_BYTES = 4 << 20


class UnixConnection(Connection):
    def __init__(self, sock: socket.socket, max_in_flight: int):
        super().__init__("unix")
        self.sock = sock
        self.max_in_flight = max_in_flight
        # Requests read and not yet answered (reply written, or undeliverable).
        self._in_flight = 0
        self._answered = threading.Condition()
        self._send_lock = threading.Lock()
        # Replies (lists of byte views, the first possibly partly written) the writer thread
        # still has to write, in order; non-empty exactly while the writer thread runs.
        self._backlog: collections.deque[list[memoryview]] = collections.deque()
        self._broken: OSError | None = None

    # -- reader side ----------------------------------------------------------------------

    def admit(self) -> None:
        """Count a request read; wait while the connection has its cap in flight."""
        with self._answered:
            self._answered.wait_for(lambda: self._in_flight < self.max_in_flight)
            self._in_flight += 1

    def _done(self, count: int = 1) -> None:
        with self._answered:
            self._in_flight -= count
            self._answered.notify_all()

    def wait_answered(self) -> None:
        """Wait until every request read on this connection has been answered."""
        with self._answered:
            self._answered.wait_for(lambda: self._in_flight == 0)

    # -- replies --------------------------------------------------------------------------

    def send(self, parts: list, buffers: list | None = None) -> int:
        if buffers:
            raise ValueError("a unix-socket reply is one frame: it carries no raw buffers")
        views = byte_views(protocol.frame_parts(parts))
        total = sum(len(v) for v in views)
        with self._send_lock:
            try:
                if self._broken is not None:
                    raise BrokenPipeError(f"{self.id}: the peer is gone ({self._broken})")
                if self._backlog:  # earlier replies still queued for a slow peer: keep the order
                    self._backlog.append(views)
                    return total
                if self._write_now(views):
                    self._done()
                else:
                    self._backlog.append(views)
                    threading.Thread(target=self._write_backlog, name=f"{self.id}-writer", daemon=True).start()
                return total
            except OSError as exc:
                self._broken = self._broken or exc
                self._done()
                raise

    def _write_now(self, views: list[memoryview]) -> bool:
        """Write without blocking for longer than STALL_SECONDS without progress. True when
        all is written; False when the peer stalled (`views` then holds the rest)."""
        poller = None
        while views:
            try:
                written = self.sock.sendmsg(views[:IOV_MAX], (), socket.MSG_DONTWAIT)
            except BlockingIOError:
                if poller is None:
                    poller = select.poll()
                    poller.register(self.sock, select.POLLOUT)
                if not poller.poll(STALL_SECONDS * 1000):
                    return False
                continue
            consume(views, written)
        return True

    def _write_backlog(self) -> None:
        while True:
            with self._send_lock:
                if not self._backlog:
                    return
                views = self._backlog[0]
            try:
                while views:
                    consume(views, self.sock.sendmsg(views[:IOV_MAX]))
            except OSError as exc:
                with self._send_lock:
                    self._broken = self._broken or exc
                    dropped = len(self._backlog)
                    self._backlog.clear()
                log.warning("%s: dropped %d replies: %s", self.id, dropped, exc)
                self._done(dropped)
                return
            with self._send_lock:
                self._backlog.popleft()
            self._done()


class UnixTransport:
    """Listens on `path`; one reader thread per connection."""

    def __init__(self, dispatcher, path: str, *, max_frame_size: int, max_in_flight: int,
                 max_connections: int):
        self.dispatcher = dispatcher
        self.path = path
        self.max_frame_size = max_frame_size
        self.max_in_flight = max_in_flight
        self.max_connections = max_connections
        self.pool = BufferPool(max_buffers=POOLED_BUFFERS)
        self._connections: set[UnixConnection] = set()
        self._lock = threading.Lock()
        self._listener = _listen(path)
        self._thread = threading.Thread(target=self._accept, name="unix-accept", daemon=True)

    @property
    def names(self) -> list[str]:
        """How `info` lists this lane."""
        return [f"unix {self.path}"]

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        """Stop accepting and remove the socket file (connections end with the process)."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        self._listener.close()

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except OSError:  # the listener was closed: the server is stopping
                return
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER_BYTES)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER_BYTES)
            conn = UnixConnection(sock, self.max_in_flight)
            with self._lock:
                full = len(self._connections) >= self.max_connections
                if not full:
                    self._connections.add(conn)
            if full:
                self._turn_away(conn)
                continue
            threading.Thread(target=self._serve, args=(conn,), name=f"{conn.id}-reader", daemon=True).start()

    def _turn_away(self, conn: UnixConnection) -> None:
        """Answer a connection over the cap with one `overloaded` error (id nil) and close it."""
        message = f"the server serves at most {self.max_connections} unix connections at once"
        log.warning("%s turned away: %s", conn.id, message)
        reply = protocol.frame_parts(protocol.encode_error(None, "overloaded", message,
                                                           {"limit": self.max_connections}))
        try:
            # A fresh connection's send buffer is empty: this small frame fits without blocking.
            conn.sock.send(b"".join(reply), socket.MSG_DONTWAIT)
        except OSError:
            pass  # the peer is already gone
        conn.sock.close()

    def _serve(self, conn: UnixConnection) -> None:
        reader = conn.sock.makefile("rb", buffering=0)
        try:
            serve_frames(reader, conn, self.dispatcher, self.pool, self.max_frame_size, admit=conn.admit)
        except OSError as exc:  # reset by the peer: its replies will fail and free their slots
            log.info("%s: %s", conn.id, exc)
        except Exception:
            log.exception("%s: reader failed", conn.id)
        # The peer may have only shut down its sending side: answer what it asked first.
        conn.wait_answered()
        with self._lock:
            self._connections.discard(conn)
        conn.mark_closed()
        reader.close()
        conn.sock.close()


def _listen(path: str) -> socket.socket:
    """A listening socket at `path`, replacing a stale socket file left by a dead server but
    never a live server's socket or any other file."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        pass
    else:
        if not stat.S_ISSOCK(mode):
            raise OSError(f"--unix {path}: expected a free path or a stale socket, got an existing non-socket file")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(path)
        except ConnectionRefusedError:
            os.unlink(path)  # nobody listens: a dead server's leftover
        else:
            raise OSError(f"--unix {path}: another server is listening there")
        finally:
            probe.close()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(LISTEN_BACKLOG)
    return listener
