"""The Port lane: frames on stdin, replies on the private protocol fd (see stdio_guard).

A reader thread reads each frame into a pooled buffer and hands it to the dispatcher
(`framed.serve_frames`); replies are written with one `os.writev` of the prefix, the msgpack
header pieces and the tensor views (one send, where stdout is a socket), non-blocking as on the
unix lane (framed.StreamConnection): a peer that stops reading its replies must not hold up the
thread writing one, which may hold the dispatcher's serving lock that every lane's requests wait
for. Its requests are not read meanwhile (serve_frames)."""

from __future__ import annotations

import logging
import os
import socket
import stat
import threading
import time

from ..buffers import BufferPool
from .base import FLUSH_SECONDS
from .framed import (HANGUP_GRACE_S, FdConnection, SocketFdConnection, StreamConnection, WriterThreads, hung_up,
                     input_waiting, serve_frames)

log = logging.getLogger("bridge.stdio")


def reply_connection(fd: int, start_writer) -> StreamConnection:
    """The connection replies go out on: a socket written with sends that never wait, else
    nonblocking_pipe's descriptor."""
    if stat.S_ISSOCK(os.fstat(fd).st_mode):
        return SocketFdConnection("stdio", socket.socket(fileno=os.dup(fd)), start_writer)
    return FdConnection("stdio", nonblocking_pipe(fd), start_writer)


def nonblocking_pipe(fd: int) -> int:
    """Where `fd` is a pipe (a Port's, a client's), a descriptor of that pipe whose writes
    never block, on a file description of its own: O_NONBLOCK belongs to the description, which
    `fd` may share with other processes (a shell's) that expect blocking writes. Anything else
    (a file, a terminal; a socket goes to reply_connection), or a pipe that cannot be opened
    anew, is `fd` itself, written as it is."""
    if not stat.S_ISFIFO(os.fstat(fd).st_mode):
        return fd
    try:
        return os.open(f"/proc/self/fd/{fd}", os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        log.warning("stdio replies are written blocking (the pipe could not be opened anew: %s): "
                    "a peer that stops reading them holds up every lane", exc)
        return fd


# How long the peer's end is seen closed, with nothing left to read, before the input counts as
# ended though the reader has not read its end (input_ended): far longer than the reader takes
# to put the last frame it read in flight. A peer with replies still to read has the reader's
# grace (framed.HANGUP_GRACE_S) instead, as operations.md promises it.
HANGUP_SEEN_S = 0.3


class StdioTransport:
    def __init__(self, dispatcher, in_fd: int, out_fd: int, max_frame_size: int):
        self.dispatcher = dispatcher
        self.reader = open(in_fd, "rb", buffering=0, closefd=False)
        self._writers = WriterThreads()
        self.conn = reply_connection(out_fd, self._writers.start)
        self.max_frame_size = max_frame_size
        self.pool = BufferPool()
        self.eof = threading.Event()
        self._hung_up_since: float | None = None  # input_ended's
        self._thread = threading.Thread(target=self._run, name="stdio-reader", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def input_ended(self) -> bool:
        """The peer closed its end and nothing of its input is left unread. Asked of the pipe
        too, not only told by the reader, which reads the end only once done serving a request
        an idle server gave it (a long scan): the server would serve on for nobody meanwhile,
        where SPEC §1 has it answer what is in flight within its drain, or not. Seen so for
        HANGUP_SEEN_S first: the last frame read may not yet be in flight; HANGUP_GRACE_S while
        replies wait for the peer to read them, the time the reader gives it. Called by one thread."""
        if self.eof.is_set():
            return True
        fd = self.reader.fileno()
        if not hung_up(fd, sending_side=True) or input_waiting(fd):
            self._hung_up_since = None
            return False
        now = time.monotonic()
        if self._hung_up_since is None:
            self._hung_up_since = now
        return now - self._hung_up_since >= (HANGUP_GRACE_S if self.conn.replies_waiting else HANGUP_SEEN_S)

    def close(self, deadline: float | None = None) -> None:
        """Give the writer thread until `deadline` (time.monotonic(); FLUSH_SECONDS from now by
        default) to write the replies it was handed (the dispatcher counts them answered)."""
        if self._writers.join(time.monotonic() + FLUSH_SECONDS if deadline is None else deadline):
            log.warning("stdio lane: replies still unwritten at the shutdown deadline are lost")

    def _run(self) -> None:
        try:
            serve_frames(self.reader, self.conn, self.dispatcher, self.pool, self.max_frame_size)
        except Exception:  # a transport fault ends this lane, never silently
            log.exception("stdio reader failed")
        finally:
            self.eof.set()
