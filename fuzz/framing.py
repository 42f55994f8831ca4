"""Harness: the stream framer, `protocol.FrameAssembler` (SPEC §2), against a model of the
framing written from the spec: the same bytes, read in whatever pieces, must give the same
bodies, `FrameTooLarge` events and end-of-stream verdict.

An input is: one byte of `max_frame_size` (0 .. 255, so that oversized frames are common), one
byte `k`, then `k % 8` bytes of read sizes (each `% 65`; 0 is an `advance(0)`), then the stream.
The stream is read as a transport reads it -- `space()`, then `advance(n)` for a read of n
bytes, cycling through the read sizes -- or, when `k` is odd, handed to `feed()` whole.
"""

from __future__ import annotations

from protocol import FrameAssembler, FrameTooLarge, TruncatedFrame

from .checks import Finding, vector_frames
from .tally import Tally

# Streams of a few frames are enough; longer ones only slow each execution down.
MAX_LEN = 1024
HEADER = 4


def setup() -> dict:
    return {"target": "protocol.FrameAssembler (space/advance, feed, eof)", "coverage": "Python (protocol, atheris)"}


def seeds() -> list[bytes]:
    frames = [frame for name, frame in vector_frames(multipart=False)]
    stream = b"".join(frames[:6])
    # max_frame_size, k, then k % 8 read sizes (the feed() seed, k odd, too: one_input skips them)
    return [bytes([255, 2, 7, 64]) + stream, bytes([40, 1, 7]) + stream,
            bytes([16, 0]) + b"\x00\x00\x00\x00" + b"\x00\x00\x01\x00" + bytes(300)]


def model(stream: bytes, max_frame_size: int) -> tuple[list, tuple | None]:
    """SPEC §2 read directly: the events (a body's bytes, or ("too large", length)) and the
    end-of-stream verdict (received, expected) when the stream ends inside a frame."""
    events, pos, n = [], 0, len(stream)
    while pos < n:
        if n - pos < HEADER:
            return events, (n - pos, HEADER)
        length = int.from_bytes(stream[pos:pos + HEADER], "big")
        available = n - pos - HEADER
        if available < length:
            return events, (HEADER + available, HEADER + length)
        body = stream[pos + HEADER:pos + HEADER + length]
        events.append(("too large", length) if length > max_frame_size else body)
        pos += HEADER + length
    return events, None


def _event(event, max_frame_size: int):
    if isinstance(event, FrameTooLarge):
        if event.limit != max_frame_size:
            raise Finding(f"FrameTooLarge with limit {event.limit}, the assembler's is {max_frame_size}")
        return ("too large", event.length)
    body, release = event
    if release is not None:
        raise Finding("a body of the assembler's own buffer came with a release")
    return bytes(body)


tally = Tally()


def one_input(data: bytes) -> None:
    tally.execution()
    if len(data) < 2:
        return
    max_frame_size, k = data[0], data[1]
    reads = [b % 65 for b in data[2:2 + k % 8]]
    stream = data[2 + k % 8:]
    expected, verdict = model(stream, max_frame_size)
    assembler = FrameAssembler(max_frame_size)
    events = []
    if k & 1:
        events = [_event(e, max_frame_size) for e in assembler.feed(stream)]
    else:
        if not any(reads):  # no read that moves: one byte at a time
            reads = [1]
        pos, i = 0, 0
        while pos < len(stream):
            size = reads[i % len(reads)]
            i += 1
            if size == 0:
                if assembler.advance(0) is not None:
                    raise Finding("advance(0) completed a frame")
                continue
            space = assembler.space()
            if not len(space):
                raise Finding("space() is empty inside a stream")
            size = min(size, len(space), len(stream) - pos)
            space[:size] = stream[pos:pos + size]
            pos += size
            event = assembler.advance(size)
            if event is not None:
                events.append(_event(event, max_frame_size))
    if events != expected:
        raise Finding(f"events {events!r}, expected {expected!r}")
    if assembler.at_frame_start != (verdict is None):
        raise Finding(f"at_frame_start {assembler.at_frame_start} with the stream ending at {verdict}")
    end = assembler.eof()
    got = None if end is None else (end.received, end.expected)
    if end is not None and not isinstance(end, TruncatedFrame):
        raise Finding(f"eof() gave {end!r}")
    if got != verdict:
        raise Finding(f"eof() says {got}, expected {verdict}")
    tally["bodies"] += sum(isinstance(e, bytes) for e in events)
    tally["too large"] += sum(isinstance(e, tuple) for e in events)
    tally["ends inside a frame"] += verdict is not None
    if not assembler.at_frame_start or assembler.eof() is not None:
        raise Finding("the assembler did not start over after eof()")


# libFuzzer's own mutations: the format has no structure that a mutator must keep.
mutator = None
