"""Receive buffers that are reused across requests.

A fresh multi-MB allocation page-faults on the first touch of every page, for every request.
Frames are read into pooled buffers instead; the decoded tensors are views into them, so a buffer goes back to the pool
only when its request has been answered. Op handlers must therefore never keep a reference to
an input tensor beyond the request (copy what must outlive it, as `put` does).

A buffer is an anonymous private mapping, not a bytearray: its pages are committed as the
frame's bytes are written into them, while a bytearray is zero-filled when made, which commits
every page of the body a frame's 4-byte header announces before any of it has come (a few
connections announcing --max-frame-size each could exhaust the memory). A mapping starts on a
page boundary, so bodies keep their 16-byte alignment (SPEC §5).
"""

from __future__ import annotations

import mmap
import threading

MIN_CAPACITY = 64 * 1024
# Pooled buffers keep their pages committed for as long as the server runs, its clients gone or
# not: a lane keeps at most this much, and no buffer larger than MAX_POOLED_BUFFER (a frame past
# it, far larger than the ExPhil-sized ones the pool is for, pays its page faults each time).
MAX_POOLED_BYTES = 128 * 1024 * 1024
MAX_POOLED_BUFFER = 32 * 1024 * 1024


class BufferPool:
    def __init__(self, max_buffers: int = 8, max_pooled_bytes: int = MAX_POOLED_BYTES):
        self._free: list[mmap.mmap] = []
        self._lock = threading.Lock()
        self.max_buffers = max_buffers
        self.max_pooled_bytes = max_pooled_bytes

    def acquire(self, size: int) -> tuple[memoryview, callable]:
        """A writable view of exactly `size` bytes and the function that gives it back."""
        buf = None
        with self._lock:
            best = -1
            for i, candidate in enumerate(self._free):
                if len(candidate) >= size and (best < 0 or len(candidate) < len(self._free[best])):
                    best = i
            if best >= 0:
                buf = self._free.pop(best)
        if buf is None:
            buf = mmap.mmap(-1, max(size, MIN_CAPACITY), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        return memoryview(buf)[:size], lambda: self._release(buf)

    def _release(self, buf: mmap.mmap) -> None:
        with self._lock:
            if len(buf) <= MAX_POOLED_BUFFER and len(self._free) < self.max_buffers and \
                    sum(map(len, self._free)) + len(buf) <= self.max_pooled_bytes:
                self._free.append(buf)
