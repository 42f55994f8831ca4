"""Framing: a 4-byte unsigned big-endian length, then that many body bytes (one msgpack map).

Sans-IO: `FrameAssembler` takes whatever bytes a transport or client read (into the space it
gives, or fed split anywhere) and hands back complete bodies; the encoders return lists of
buffers that `frame_parts` prefixes without joining them, for `os.writev` / `socket.sendmsg`.
"""

from __future__ import annotations

from .errors import FrameTooLarge, FrameUnbuffered, TruncatedFrame

DEFAULT_MAX_FRAME_SIZE = 256 * 1024 * 1024
HEADER_SIZE = 4
# The largest length a 4-byte prefix can announce.
MAX_FRAMEABLE = 0xFFFFFFFF

# Scratch size for discarding the body of an oversized frame.
_DISCARD_CHUNK = 1 << 20


def parse_frame_header(header) -> int:
    """The body length announced by a 4-byte header."""
    view = memoryview(header).cast("B")
    if view.nbytes != HEADER_SIZE:
        raise ValueError(f"frame header: expected {HEADER_SIZE} bytes, got {view.nbytes}")
    return int.from_bytes(view, "big")


def _frame_header(length: int) -> bytes:
    if length > MAX_FRAMEABLE:
        raise FrameTooLarge(length, MAX_FRAMEABLE)
    return length.to_bytes(HEADER_SIZE, "big")


def encode_frame(body) -> bytes:
    """Length prefix + body as one bytes object (copies: meant for small bodies)."""
    view = memoryview(body).cast("B")
    return _frame_header(view.nbytes) + view


def frame_parts(parts: list) -> list:
    """`[prefix, *parts]` for a body given as a list of buffers; nothing is joined or copied."""
    total = sum(memoryview(p).nbytes for p in parts)
    return [_frame_header(total), *parts]


def _own_buffer(length: int):
    """A frame body's buffer when no pool gives one: a bytearray of its own (16-byte aligned, as
    CPython's allocators align every block), nothing to give back."""
    return memoryview(bytearray(length)), None


class FrameAssembler:
    """One stream's frames, assembled as bytes come, for server lanes and clients alike.

    `space()` is where the next bytes go (read into it: `readinto`, `recv_into`); `advance(n)`,
    after `n` more bytes are in, returns None until a frame is complete, then `(body, release)`:
    the body in a buffer from `acquire(length)` (a pool's, or one of its own by default), and
    the callable that gives it back (None for a buffer of its own). A header announcing more
    than `max_frame_size` gives a `FrameTooLarge` event once that many body bytes have been
    read and discarded, and one for which `acquire` finds no memory a `FrameUnbuffered`: the
    stream stays usable, so a server answers and serves on.

    It never asks for bytes past the end of the frame it is in: a frame not begun stays in the
    socket, so that a server at its cap of requests in flight leaves the rest of its input
    unread (backpressure), and whether more input is waiting can still be asked of the socket.
    `feed(data)` is the same for bytes already read (tests, a caller with its own buffers).
    """

    def __init__(self, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE, acquire=_own_buffer):
        if type(max_frame_size) is not int or max_frame_size < 0:
            raise ValueError(f"max_frame_size: expected a non-negative int, got {max_frame_size!r}")
        self.max_frame_size = max_frame_size
        self._acquire = acquire
        self._header = memoryview(bytearray(HEADER_SIZE))
        self._target = self._header  # the header's or the body's view, or the discard scratch
        self._pos = 0
        self._release = None  # gives the body's buffer back
        self._discard_left = 0  # bytes of an oversized (or unbuffered) body still to be discarded
        self._oversized = 0
        self._unbuffered: str | None = None  # why the body being discarded had no buffer

    @property
    def at_frame_start(self) -> bool:
        """No byte of the next frame has been read."""
        return self._target is self._header and self._pos == 0

    def space(self) -> memoryview:
        return self._target[self._pos:]

    def advance(self, count: int):
        if not 0 <= count <= len(self._target) - self._pos:
            raise ValueError(f"count: expected 0..{len(self._target) - self._pos} (the space given), got {count}")
        self._pos += count
        if self._pos < len(self._target):
            return None
        self._pos = 0
        if self._target is self._header:
            length = parse_frame_header(self._header)
            if length > self.max_frame_size:
                self._discard(length)
                return None
            try:
                self._target, self._release = self._acquire(length)
            except (MemoryError, OSError) as exc:  # mmap's ENOMEM: the machine, not the peer, is short
                if not length:
                    raise
                self._unbuffered = f"{type(exc).__name__}: {exc}"
                self._discard(length)
                return None
            if length:
                return None
        elif self._discard_left:
            self._discard_left -= len(self._target)
            if self._discard_left:
                self._target = self._target[:min(self._discard_left, len(self._target))]
                return None
            self._target = self._header
            if self._unbuffered is not None:
                reason, self._unbuffered = self._unbuffered, None
                return FrameUnbuffered(self._oversized, reason)
            return FrameTooLarge(self._oversized, self.max_frame_size)
        frame = (self._target, self._release)
        self._target, self._release = self._header, None
        return frame

    def _discard(self, length: int) -> None:
        """Read the next `length` body bytes into scratch, keeping none."""
        self._oversized = self._discard_left = length
        self._target = memoryview(bytearray(min(length, _DISCARD_CHUNK)))

    def feed(self, data) -> list:
        """The events of `data` (bytes already read, split anywhere), in order: each `(body,
        release)` completed, or a `FrameDropped` (`FrameTooLarge`, `FrameUnbuffered`)."""
        view = memoryview(data).cast("B")
        events = []
        while view:
            space = self.space()
            step = min(len(space), len(view))
            space[:step] = view[:step]
            view = view[step:]
            event = self.advance(step)
            if event is not None:
                events.append(event)
        return events

    def eof(self) -> TruncatedFrame | None:
        """The stream ended: gives back the buffer of a frame read only in part; a
        `TruncatedFrame` when the stream ended inside a frame, else None."""
        if self.at_frame_start:
            return None
        if self._target is self._header:
            got, expected = self._pos, HEADER_SIZE
        elif self._discard_left:
            done = self._oversized - self._discard_left + self._pos
            got, expected = HEADER_SIZE + done, HEADER_SIZE + self._oversized
        else:
            got, expected = HEADER_SIZE + self._pos, HEADER_SIZE + len(self._target)
        if self._release is not None:
            self._release()
        self._target, self._release, self._pos, self._discard_left = self._header, None, 0, 0
        self._unbuffered = None
        return TruncatedFrame(got, expected)
