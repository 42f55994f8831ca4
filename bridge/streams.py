"""Blocking stream I/O over protocol framing, for the Python clients, the benches and the
stream lanes' writers: gather-writes that resume after partial writes, and whole-frame reads
(protocol.FrameAssembler)."""

from __future__ import annotations

import os

import protocol

# os.writev takes at most IOV_MAX (1024 on Linux) buffers per call.
IOV_MAX = 1024


def byte_views(parts: list) -> list[memoryview]:
    """Flat byte views of the non-empty `parts`, for a gather-write (no copies)."""
    return [memoryview(p).cast("B") for p in parts if len(p)]


def write_all(fd: int, parts: list) -> None:
    """writev every byte of `parts`, resuming after partial writes."""
    views = byte_views(parts)
    while views:
        written = os.writev(fd, views[:IOV_MAX])
        consume(views, written)


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


def read_exact(reader, view: memoryview) -> bool:
    """Fill `view` from `reader` (anything with `readinto`); False on EOF before it is full."""
    pos, size = 0, len(view)
    while pos < size:
        n = reader.readinto(view[pos:])
        if not n:
            return False
        pos += n
    return True


def read_frame(reader) -> memoryview | None:
    """The body of the next frame on `reader` (anything with `readinto`, blocking), read whole
    into a buffer of its own; None when the stream ends before it is whole. MemoryError when
    no buffer could be had for it (the frame is then read and dropped)."""
    frames = protocol.FrameAssembler(protocol.framing.MAX_FRAMEABLE)
    while count := reader.readinto(frames.space()):
        frame = frames.advance(count)
        if isinstance(frame, protocol.FrameDropped):
            raise MemoryError(str(frame))
        if frame is not None:
            return frame[0]
    return None
