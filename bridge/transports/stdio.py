"""The Port lane: frames on stdin, replies on the private protocol fd (see stdio_guard).

A reader thread reads each frame into a pooled buffer and hands it to the dispatcher
(`framed.serve_frames`); replies are written with one `os.writev` of the prefix, the msgpack
header pieces and the tensor views."""

from __future__ import annotations

import logging
import threading

from ..buffers import BufferPool
from .framed import FdConnection, serve_frames

log = logging.getLogger("bridge.stdio")


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
            serve_frames(self.reader, self.conn, self.dispatcher, self.pool, self.max_frame_size)
        except Exception:  # a transport fault ends this lane, never silently
            log.exception("stdio reader failed")
        finally:
            self.eof.set()
