"""The stream framing shared by the stdio and unix-socket lanes (SPEC §2: a 4-byte big-endian
length, then the body); the clients' blocking reads and writes are bridge.streams.

Bodies are read straight into pooled buffers (no intermediate copies) by
`protocol.FrameAssembler`, a frame at a time, and handed to the dispatcher: blocking by
`serve_frames` (stdio's one
stream), without blocking by the unix lane (its many); replies go out as one gather-write of
the prefix, the msgpack header pieces and the tensor views.

Replies are written by whichever thread produced them (`StreamConnection`), without ever
blocking it on a peer that does not read: that thread may hold the dispatcher's serving lock,
which every lane's requests wait for. The reply is written non-blocking, and a peer that accepts
no byte for `STALL_SECONDS`, or whose reply is not written within `WRITE_SECONDS` in all, gets
the rest written by a writer thread of its own (later replies queue behind it, in order).
"""

from __future__ import annotations

import array
import collections
import fcntl
import functools
import logging
import os
import select
import socket
import termios
import threading
import time

import protocol

from ..streams import IOV_MAX, byte_views, consume
from ..timing import now_ns
from .base import Connection

log = logging.getLogger("bridge.transports")

# How long a reader that waits for its peer to read its replies goes on waiting once that peer
# has closed its input: about the drain a server gives requests in flight at an EOF it reads
# (cli.DRAIN_SECONDS). A peer that closed its input and reads nothing would otherwise hold the
# reader for ever, and the server, never reading the EOF, would never stop.
HANGUP_GRACE_S = 1.0
# How often such a reader looks for the hang-up.
HANGUP_POLL_S = 0.05

# How long the replying thread waits for a peer that accepts no byte of a reply before handing
# the rest to the connection's writer thread. A peer that is reading makes progress far more
# often than this; the worker is held up this long by a stuck one, once per reply it stalls on.
STALL_SECONDS = 0.02
# And how long in all it writes one reply before doing so: a peer reading just fast enough to
# make progress would otherwise hold the worker (and with it every lane's compute, and the
# reading thread when it has a reply for that same connection) for the whole of a large reply.
WRITE_SECONDS = 0.05


def input_waiting(fd: int) -> bool:
    """Whether bytes are already waiting to be read on `fd` (a pipe or a socket)."""
    count = array.array("i", [0])
    fcntl.ioctl(fd, termios.FIONREAD, count, True)
    return count[0] > 0


class StreamConnection(Connection):
    """A connection whose replies are frames written to a stream (a socket, a pipe) in order,
    without blocking the thread that made one for longer than its write budget (the module
    docstring says how). A transport gives the non-blocking write (`_write_nowait`), the
    `stream` polled for room (a descriptor, or an object with `fileno()`), and `start_writer`,
    which runs `write_backlog` on a writer thread it keeps track of (`WriterThreads`)."""

    def __init__(self, kind: str, stream, start_writer):
        super().__init__(kind)
        self._stream = stream
        self._start_writer = start_writer
        self._send_lock = threading.Lock()
        # Replies (lists of byte views, the first possibly partly written) the writer thread
        # still has to write, in order; non-empty exactly while the writer thread runs.
        self._backlog: collections.deque[list[memoryview]] = collections.deque()
        self._written = threading.Condition(self._send_lock)  # notified when the backlog empties
        self._broken: OSError | None = None

    def _write_nowait(self, views: list[memoryview]) -> int:  # pragma: no cover - each transport implements it
        """Write what the stream takes of `views` now: the bytes written, or BlockingIOError."""
        raise NotImplementedError

    def _write_budget(self) -> tuple[float, float]:
        """(stall_s, budget_s) for a reply written by the calling thread (see _write_now)."""
        return STALL_SECONDS, WRITE_SECONDS

    def _abandon_stream(self) -> None:
        """A reply cut off mid-frame leaves the stream unusable: end it where the transport can,
        so that the peer sees its end rather than waiting for replies that cannot come."""

    def _done(self, count: int = 1) -> None:
        """`count` replies are answered: written, or never to be (the peer is gone)."""

    @property
    def replies_waiting(self) -> bool:
        """Replies the peer has not taken yet wait for the writer thread."""
        return bool(self._backlog)

    @property
    def peer_gone(self) -> bool:
        """A reply could not be written: the peer reads nothing more (it closed)."""
        return self._broken is not None

    def send(self, parts: list, buffers: list | None = None) -> None:
        if buffers:
            raise ValueError("a stream reply is one frame: it carries no raw buffers")
        views = byte_views(protocol.frame_parts(parts))
        stall_s, budget_s = self._write_budget()
        failure = None
        with self._send_lock:
            if self._broken is not None:
                failure = BrokenPipeError(f"{self.id}: the peer is gone ({self._broken})")
            elif self._backlog:  # earlier replies still queued for a slow peer: keep the order
                self._backlog.append(views)
                return
            else:
                try:
                    if not self._write_now(views, stall_s, budget_s):
                        self._backlog.append(views)
                        try:
                            self._start_writer(self)
                            return
                        except RuntimeError as exc:
                            # No thread to be had (out of memory, a thread limit): the reply,
                            # perhaps written in part, can never be finished, nor any after it.
                            self._backlog.clear()
                            self._abandon_stream()
                            raise OSError(f"no thread to write the rest of a reply: {exc}") from exc
                except OSError as exc:
                    self._broken = self._broken or exc
                    failure = exc
        # Answered: written, or never to be (outside the lock, and once, whatever _done does).
        self._done()
        if failure is not None:
            raise failure

    def _write_now(self, views: list[memoryview], stall_s: float, budget_s: float) -> bool:
        """Write without blocking for longer than `stall_s` without progress, nor past `budget_s`
        in all. True when all is written; False when the peer stalled or the budget ran out
        (`views` then holds the rest)."""
        poller = None
        deadline = time.monotonic() + budget_s
        while views:
            try:
                written = self._write_nowait(views)
            except BlockingIOError:
                wait_s = min(stall_s, deadline - time.monotonic())
                if wait_s <= 0:
                    return False
                if poller is None:
                    poller = select.poll()
                    poller.register(self._stream, select.POLLOUT)
                if not poller.poll(wait_s * 1000):
                    return False
                continue
            consume(views, written)
        return True

    def write_backlog(self) -> None:
        """The writer thread: write the backlog's replies in order, waiting for the peer as long
        as it takes, until the backlog is empty."""
        poller = select.poll()
        poller.register(self._stream, select.POLLOUT)
        while True:
            with self._send_lock:
                views = self._backlog[0]
            try:
                while views:
                    try:
                        consume(views, self._write_nowait(views))
                    except BlockingIOError:
                        poller.poll()
            except OSError as exc:
                with self._send_lock:
                    self._broken = self._broken or exc
                    dropped = len(self._backlog)
                    self._backlog.clear()
                    self._written.notify_all()
                log.warning("%s: dropped %d replies: %s", self.id, dropped, exc)
                self._done(dropped)
                return
            # Whether to go on is decided with the reply's removal, under the lock: an empty
            # backlog must mean no writer runs, or a `send` finding it empty would write beside
            # this thread (and start a second one), the same reply twice on one stream.
            with self._send_lock:
                self._backlog.popleft()
                more = bool(self._backlog)
                if not more:
                    self._written.notify_all()
            self._done()
            if not more:
                return

    def wait_until_written(self, input_fd: int) -> bool:
        """Return True once no reply waits for the writer thread: a reader that takes no more of
        a peer's requests meanwhile keeps what a peer that does not read its replies costs
        bounded (the unix lane bounds it by its cap of requests in flight instead). False when
        the peer hung up `input_fd` (closed its end, or a socket's sending side: a stdio peer
        on a socket ends its input so) and its replies were still unwritten HANGUP_GRACE_S
        later: its input is then at its end."""
        if not self._backlog:  # the check without the lock costs a request nearly nothing
            return True
        hung_up_at = None
        with self._written:
            while self._backlog:
                self._written.wait(HANGUP_POLL_S)
                if not self._backlog:
                    continue
                if hung_up_at is None:
                    hung_up_at = time.monotonic() if hung_up(input_fd, sending_side=True) else None
                elif time.monotonic() - hung_up_at > HANGUP_GRACE_S:
                    return False
        return True


class WriterThreads:
    """A lane's writer threads (StreamConnection.write_backlog), which its close waits for: the
    dispatcher counts a reply handed to one as answered already."""

    def __init__(self):
        self._threads: set[threading.Thread] = set()
        self._lock = threading.Lock()

    def start(self, conn: StreamConnection) -> None:
        """Start `conn`'s writer thread; RuntimeError where none can be started (nothing kept)."""
        writer = threading.Thread(target=self._write, args=(conn,), name=f"{conn.id}-writer", daemon=True)
        # Listed once started (join() cannot wait on one that never was), under the lock its end
        # takes to unlist itself.
        with self._lock:
            writer.start()
            self._threads.add(writer)

    def _write(self, conn: StreamConnection) -> None:
        try:
            conn.write_backlog()
        finally:
            with self._lock:
                self._threads.discard(threading.current_thread())

    def join(self, deadline: float) -> int:
        """Wait until `deadline` (time.monotonic()) for the writers to finish; how many have not."""
        with self._lock:
            writers = list(self._threads)
        for writer in writers:
            writer.join(max(0.0, deadline - time.monotonic()))
        return sum(writer.is_alive() for writer in writers)


class FdConnection(StreamConnection):
    """A connection whose replies are frames written to a non-blocking file descriptor (the
    stdio lane's pipe: one peer); the stream is that descriptor."""

    def _write_nowait(self, views: list[memoryview]) -> int:
        return os.writev(self._stream, views[:IOV_MAX])


class SocketFdConnection(StreamConnection):
    """As FdConnection where the descriptor is a socket (stdio as a libuv parent, socat or
    systemd hands it): the stream is a socket on a duplicate of it, and each send is told not to
    wait, as O_NONBLOCK would be set on a description other processes may share."""

    def _write_nowait(self, views: list[memoryview]) -> int:
        return self._stream.sendmsg(views[:IOV_MAX], (), socket.MSG_DONTWAIT)


def hung_up(fd: int, *, sending_side: bool = False) -> bool:
    """Whether the other end of `fd` (a pipe's writer, a socket's peer) has closed it; with
    `sending_side`, also a socket's peer that shut down only its sending side (POLLRDHUP): our
    input from it has ended, though it may still read; where poll has no such flag (it is
    Linux's), such a peer is seen once it closes."""
    ended = getattr(select, "POLLRDHUP", 0) if sending_side else 0
    poller = select.poll()
    poller.register(fd, select.POLLIN | ended)  # POLLHUP and POLLERR are reported whatever is asked
    return any(events & (select.POLLHUP | select.POLLERR | ended) for _, events in poller.poll(0))


def serve_frames(reader, conn, dispatcher, pool, max_frame_size: int) -> None:
    """Read frames from `reader` (blocking, with `readinto`) until EOF and hand each body to the
    dispatcher for `conn`.

    A frame announcing more than `max_frame_size` is read and discarded, then answered with
    frame_too_large; the stream stays usable. `conn` is a StreamConnection: the next frame is
    read only when none of its replies waits for a writer thread (wait_until_written)."""
    incoming = protocol.FrameAssembler(max_frame_size, pool.acquire)
    more_input = functools.partial(input_waiting, reader.fileno())
    while True:
        count = reader.readinto(incoming.space())
        if count is None:
            # No input yet, not its end: a stdin whose description a parent, sharing it, made
            # non-blocking (left so: the parent expects it). Waited for as a blocking read would.
            waiting = select.poll()
            waiting.register(reader.fileno(), select.POLLIN)
            waiting.poll()
            continue
        if not count:
            incoming.eof()  # the peer is gone: a frame it left unfinished gets no answer
            return
        frame = incoming.advance(count)
        if frame is None:
            continue
        if isinstance(frame, protocol.FrameDropped):
            dispatcher.on_frame_error(conn, frame)
        else:
            body, release = frame
            # With nothing more waiting, an idle server may serve this frame on this thread.
            dispatcher.on_frame(conn, body, now_ns(), release, more_input=more_input)
        # A peer whose replies wait for it to read them gets no more requests read meanwhile.
        if not conn.wait_until_written(reader.fileno()):
            log.warning("%s: its peer closed its input and has not read its replies: its input ends here", conn.id)
            incoming.eof()
            return
