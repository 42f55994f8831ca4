"""The Port lane: frames on stdin, replies on the private protocol fd (see stdio_guard).

A reader thread reads the 4-byte header and then the body straight into a pooled buffer
(`readinto`, no intermediate copies) and hands it to the dispatcher; replies are written with
one `os.writev` of the prefix, the msgpack header pieces and the tensor views."""

from __future__ import annotations

import logging
import os
import threading

import protocol

from ..buffers import BufferPool
from ..timing import now_ns
from .base import Connection

log = logging.getLogger("bridge.stdio")

DRAIN_CHUNK = 1 << 20


def write_all(fd: int, parts: list) -> int:
    """writev every byte of `parts`, resuming after partial writes."""
    views = [memoryview(p).cast("B") for p in parts if len(p)]
    total = sum(len(v) for v in views)
    while views:
        written = os.writev(fd, views[:1024])
        while written:
            head = views[0]
            if written >= len(head):
                written -= len(head)
                views.pop(0)
            else:
                views[0] = head[written:]
                written = 0
    return total


class FdConnection(Connection):
    """A connection whose replies are frames written to a file descriptor."""

    def __init__(self, kind: str, out_fd: int):
        super().__init__(kind)
        self.out_fd = out_fd
        self._write_lock = threading.Lock()

    def send(self, parts: list) -> int:
        framed = protocol.frame_parts(parts)
        with self._write_lock:
            return write_all(self.out_fd, framed)


def read_exact(reader, view: memoryview) -> bool:
    """Fill `view` from `reader`; False on EOF before it is full."""
    pos, size = 0, len(view)
    while pos < size:
        n = reader.readinto(view[pos:])
        if not n:
            return False
        pos += n
    return True


class StdioTransport:
    def __init__(self, dispatcher, in_fd: int, out_fd: int, max_frame_size: int):
        self.dispatcher = dispatcher
        self.reader = open(in_fd, "rb", buffering=0, closefd=False)
        self.conn = FdConnection("stdio", out_fd)
        self.max_frame_size = max_frame_size
        self.pool = BufferPool()
        self.eof = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stdio-reader", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        try:
            self._read_frames()
        except Exception:  # a transport fault ends this lane, never silently
            log.exception("stdio reader failed")
        finally:
            self.eof.set()

    def _read_frames(self) -> None:
        header = memoryview(bytearray(4))
        while True:
            if not read_exact(self.reader, header):
                return
            length = protocol.parse_frame_header(header)
            if length > self.max_frame_size:
                if not self._drain(length):
                    return
                self.dispatcher.on_frame_error(
                    self.conn, protocol.FrameTooLarge(length, self.max_frame_size), now_ns())
                continue
            body, release = self.pool.acquire(length)
            if not read_exact(self.reader, body):
                release()
                return
            self.dispatcher.on_frame(self.conn, body, now_ns(), release)

    def _drain(self, length: int) -> bool:
        scratch = memoryview(bytearray(min(length, DRAIN_CHUNK)))
        remaining = length
        while remaining:
            n = self.reader.readinto(scratch[:min(remaining, len(scratch))])
            if not n:
                return False
            remaining -= n
        return True
