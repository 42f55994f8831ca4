"""Framing: a 4-byte unsigned big-endian length, then that many body bytes (one msgpack map).

Sans-IO: `FrameDecoder` is fed whatever bytes a transport received (split anywhere) and hands
back complete bodies; the encoders return lists of buffers that `frame_parts` prefixes without
joining them, for `os.writev` / `socket.sendmsg`.
"""

from __future__ import annotations

from .errors import FrameTooLarge, TruncatedFrame

DEFAULT_MAX_FRAME_SIZE = 256 * 1024 * 1024
HEADER_SIZE = 4
# The largest length a 4-byte prefix can announce.
MAX_FRAMEABLE = 0xFFFFFFFF

# Size of the buffer `get_buffer` hands out between frames.
_SCRATCH_SIZE = 256 * 1024


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


class FrameDecoder:
    """Splits a byte stream into frame bodies.

    `feed(data)` takes bytes of any size and returns, in order, one event per frame completed:
    the body (`bytes` or `memoryview`), or a `FrameTooLarge` for a header announcing more than
    `max_frame_size`. After that event the decoder discards exactly the announced number of
    bytes and carries on with the next frame, so a server can answer with an error and keep
    serving. A frame that spans several chunks is filled into one buffer allocated at its
    announced length (no quadratic re-copying).

    Bodies live in memory of their own (`bytes`, or the per-frame buffer), never in the
    caller's chunks, which it may reuse; they start at 16-byte aligned addresses, so a tensor
    payload is aligned when its offset in the body is (SPEC.md §5).

    `get_buffer()` / `buffer_updated(n)` (the `asyncio.BufferedProtocol` pair) let a transport
    read straight into the frame buffer, saving the copy from its receive buffer:

        n = stdin.readinto(decoder.get_buffer())
        events = decoder.buffer_updated(n)

    Do not call `feed` between the two.
    """

    def __init__(self, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE):
        if type(max_frame_size) is not int or max_frame_size < 0:
            raise ValueError(f"max_frame_size: expected a non-negative int, got {max_frame_size!r}")
        self._limit = max_frame_size
        self._header = bytearray()   # a header split across chunks (fewer than 4 bytes)
        self._body: bytearray | None = None   # the frame being filled
        self._filled = 0
        self._drain = 0              # bytes of an oversized frame still to discard
        self._drain_length = 0       # that frame's announced length
        self._scratch: bytearray | None = None
        self._reading_into_body = False

    @property
    def max_frame_size(self) -> int:
        return self._limit

    def feed(self, data) -> list:
        view = memoryview(data)
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        events = []
        pos, end = 0, view.nbytes
        while pos < end:
            if self._drain:
                step = min(self._drain, end - pos)
                self._drain -= step
                pos += step
                continue
            body = self._body
            if body is not None:
                step = min(len(body) - self._filled, end - pos)
                body[self._filled:self._filled + step] = view[pos:pos + step]
                self._filled += step
                pos += step
                if self._filled == len(body):
                    events.append(self._take_body())
                continue
            if not self._header and end - pos >= HEADER_SIZE:
                length = int.from_bytes(view[pos:pos + HEADER_SIZE], "big")
                pos += HEADER_SIZE
            else:
                step = min(HEADER_SIZE - len(self._header), end - pos)
                self._header += view[pos:pos + step]
                pos += step
                if len(self._header) < HEADER_SIZE:
                    break
                length = int.from_bytes(self._header, "big")
                self._header.clear()
            if length > self._limit:
                events.append(FrameTooLarge(length, self._limit))
                self._drain = self._drain_length = length
            elif end - pos >= length:
                events.append(bytes(view[pos:pos + length]))
                pos += length
            else:
                body = self._body = bytearray(length)
                self._filled = end - pos
                body[:self._filled] = view[pos:]
                pos = end
        return events

    def _take_body(self) -> memoryview:
        body = memoryview(self._body)
        self._body = None
        self._filled = 0
        return body

    def get_buffer(self, sizehint: int = -1) -> memoryview:
        """A writable buffer for the next bytes; hand the count read to `buffer_updated`.

        Inside a frame's body this is the unfilled rest of the frame's own buffer (the bytes
        land where the decoder keeps them); otherwise a scratch buffer of at least `sizehint`
        bytes whose content is parsed and copied as by `feed`.
        """
        if self._body is not None:
            self._reading_into_body = True
            return memoryview(self._body)[self._filled:]
        self._reading_into_body = False
        size = max(sizehint, _SCRATCH_SIZE)
        if self._scratch is None or len(self._scratch) < size:
            self._scratch = bytearray(size)
        return memoryview(self._scratch)

    def buffer_updated(self, nbytes: int) -> list:
        """Events for the `nbytes` just written into the buffer from `get_buffer`."""
        if self._reading_into_body:
            self._reading_into_body = False
            if nbytes < 0 or self._filled + nbytes > len(self._body):
                raise ValueError(f"nbytes: expected 0..{len(self._body) - self._filled}, got {nbytes}")
            self._filled += nbytes
            return [self._take_body()] if self._filled == len(self._body) else []
        if self._scratch is None or not 0 <= nbytes <= len(self._scratch):
            raise ValueError(f"nbytes: expected 0..{0 if self._scratch is None else len(self._scratch)}, "
                             f"got {nbytes} (call get_buffer first)")
        return self.feed(memoryview(self._scratch)[:nbytes])

    def eof(self) -> None:
        """Call when the stream has ended: raises `TruncatedFrame` if it ended inside a frame."""
        if self._header:
            raise TruncatedFrame(len(self._header), HEADER_SIZE)
        if self._body is not None:
            raise TruncatedFrame(HEADER_SIZE + self._filled, HEADER_SIZE + len(self._body))
        if self._drain:
            raise TruncatedFrame(HEADER_SIZE + self._drain_length - self._drain,
                                 HEADER_SIZE + self._drain_length)
