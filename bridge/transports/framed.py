"""The stream framing shared by the stdio and unix-socket lanes (SPEC §2: a 4-byte big-endian
length, then the body), and by the Python clients that speak it.

Bodies are read straight into pooled buffers (`readinto`, no intermediate copies) and handed
to the dispatcher; replies go out as one gather-write of the prefix, the msgpack header pieces
and the tensor views.
"""

from __future__ import annotations

import array
import fcntl
import os
import termios
import threading

import protocol

from ..timing import now_ns
from .base import Connection

# Scratch size for discarding the body of an oversized frame.
DRAIN_CHUNK = 1 << 20
# os.writev takes at most IOV_MAX (1024 on Linux) buffers per call.
IOV_MAX = 1024


def byte_views(parts: list) -> list[memoryview]:
    """Flat byte views of the non-empty `parts`, for a gather-write (no copies)."""
    return [memoryview(p).cast("B") for p in parts if len(p)]


def write_all(fd: int, parts: list) -> int:
    """writev every byte of `parts`, resuming after partial writes."""
    views = byte_views(parts)
    total = sum(len(v) for v in views)
    while views:
        written = os.writev(fd, views[:IOV_MAX])
        consume(views, written)
    return total


def consume(views: list, written: int) -> None:
    """Drop the first `written` bytes from the list of byte views (after a partial write)."""
    while written:
        head = views[0]
        if written >= len(head):
            written -= len(head)
            views.pop(0)
        else:
            views[0] = head[written:]
            written = 0


def input_waiting(fd: int) -> bool:
    """Whether bytes are already waiting to be read on `fd` (a pipe or a socket)."""
    count = array.array("i", [0])
    fcntl.ioctl(fd, termios.FIONREAD, count, True)
    return count[0] > 0


def read_exact(reader, view: memoryview) -> bool:
    """Fill `view` from `reader` (anything with `readinto`); False on EOF before it is full."""
    pos, size = 0, len(view)
    while pos < size:
        n = reader.readinto(view[pos:])
        if not n:
            return False
        pos += n
    return True


class FdConnection(Connection):
    """A connection whose replies are frames written to a file descriptor, blocking (the
    stdio lane: one peer, which reads its replies)."""

    def __init__(self, kind: str, out_fd: int):
        super().__init__(kind)
        self.out_fd = out_fd
        self._write_lock = threading.Lock()

    def send(self, parts: list, buffers: list | None = None) -> int:
        if buffers:
            raise ValueError("a stream reply is one frame: it carries no raw buffers")
        framed = protocol.frame_parts(parts)
        with self._write_lock:
            return write_all(self.out_fd, framed)


def serve_frames(reader, conn, dispatcher, pool, max_frame_size: int, admit=None) -> None:
    """Read frames from `reader` until EOF and hand each body to the dispatcher for `conn`.

    A frame announcing more than `max_frame_size` is read and discarded, then answered with
    frame_too_large; the stream stays usable. `admit()`, when given, is called with each
    complete frame, before it is handed on (each one is answered exactly once), and may
    block: it is how a lane caps the requests one peer has in flight (its later frames wait
    in the kernel's buffer and the peer feels the backpressure)."""
    header = memoryview(bytearray(4))
    fd = reader.fileno()
    while True:
        if not read_exact(reader, header):
            return
        length = protocol.parse_frame_header(header)
        if length > max_frame_size:
            if not _discard(reader, length):
                return
            if admit is not None:
                admit()
            dispatcher.on_frame_error(conn, protocol.FrameTooLarge(length, max_frame_size))
            continue
        body, release = pool.acquire(length)
        if not read_exact(reader, body):
            release()
            return
        received_ns = now_ns()
        if admit is not None:
            admit()
        # With nothing more waiting, an idle server may serve this frame on this thread.
        dispatcher.on_frame(conn, body, received_ns, release, more_input=input_waiting(fd))


def _discard(reader, length: int) -> bool:
    scratch = memoryview(bytearray(min(length, DRAIN_CHUNK)))
    remaining = length
    while remaining:
        n = reader.readinto(scratch[:min(remaining, len(scratch))])
        if not n:
            return False
        remaining -= n
    return True
