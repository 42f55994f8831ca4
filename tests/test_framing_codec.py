"""Sans-IO units of the wire: the frame assembler the stream lanes read into (every way a stream
can be cut, oversized frames drained, a frame abandoned part-read) and the multipart form of the
codec (SPEC §5: tensors as views of raw buffers, malformed replies refused)."""

from __future__ import annotations

import os
import struct

import msgpack
import numpy as np
import pytest

import protocol
from bridge.buffers import BufferPool
from bridge.transports import framed
from bridge.transports.framed import FrameAssembler


class CountingPool(BufferPool):
    def __init__(self):
        super().__init__()
        self.out = 0

    def acquire(self, size):
        view, release = super().acquire(size)
        self.out += 1

        def give_back():
            self.out -= 1
            release()
        return view, give_back


ASSEMBLER_LIMIT = 40


def assembler_frames(drain_chunk: int) -> list[int]:
    """Frame body lengths; those over ASSEMBLER_LIMIT must come out as FrameTooLarge, the last
    one drained in two whole chunks and part of a third."""
    return [0, 1, 7, 300, 50, 13, 41, 0, 40, 2 * drain_chunk + 3]


@pytest.mark.parametrize("chunking", ["whole", "byte_by_byte", "odd_pieces", "random"])
def test_the_frame_assembler_yields_each_frame_whole_however_the_stream_is_cut(chunking, monkeypatch):
    if chunking in ("byte_by_byte", "odd_pieces"):
        # Fed a byte or three at a time, the real chunk's megabytes keep Python busy for most
        # of this file's time; a small chunk has the same boundaries to cross.
        monkeypatch.setattr(framed, "DRAIN_CHUNK", 64)
    seed = int(np.random.SeedSequence().entropy % 2**32)
    rng = np.random.default_rng(seed)
    bodies = [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in assembler_frames(framed.DRAIN_CHUNK)]
    stream = b"".join(struct.pack(">I", len(b)) + b for b in bodies)
    pool = CountingPool()
    assembler = FrameAssembler(pool, ASSEMBLER_LIMIT)
    frame_starts = set(np.cumsum([0] + [4 + len(b) for b in bodies]).tolist())
    events, pos = [], 0
    while pos < len(stream):
        assert assembler.at_frame_start == (pos in frame_starts), f"at byte {pos} (seed {seed})"
        space = assembler.space()
        want = {"whole": len(stream), "byte_by_byte": 1, "odd_pieces": 3,
                "random": int(rng.integers(1, 200))}[chunking]
        count = min(len(space), want)
        space[:count] = stream[pos:pos + count]
        pos += count
        event = assembler.advance(count)
        if event is not None:
            events.append(event)
    assert len(events) == len(bodies), f"seed {seed}"
    for body, event in zip(bodies, events):
        if len(body) > ASSEMBLER_LIMIT:
            assert isinstance(event, protocol.FrameTooLarge)
            assert (event.length, event.limit) == (len(body), ASSEMBLER_LIMIT)
        else:
            view, release = event
            assert bytes(view) == body
            release()
    assert pool.out == 0


def test_the_frame_assembler_gives_back_a_frame_read_in_part():
    pool = CountingPool()
    assembler = FrameAssembler(pool, 1 << 20)
    frame = struct.pack(">I", 1000) + os.urandom(400)
    space = assembler.space()
    space[:4] = frame[:4]
    assert assembler.advance(4) is None and not assembler.at_frame_start
    space = assembler.space()
    space[:400] = frame[4:]
    assert assembler.advance(400) is None and pool.out == 1
    assembler.abandon()
    assert pool.out == 0 and assembler.at_frame_start


def random_tensor(rng, dtype: str, shape) -> protocol.OutTensor:
    values = rng.uniform(-4, 4, shape) if dtype in ("f32", "f64") else rng.integers(1, 100, shape)
    array = values.astype({"f32": np.float32, "f64": np.float64, "i32": np.int32, "u8": np.uint8}[dtype])
    return protocol.OutTensor(dtype, shape, array)


@pytest.mark.parametrize("dtypes", [
    pytest.param(("f32",), id="one"), pytest.param(("f32", "f64", "i32", "u8"), id="mixed"),
])
def test_multipart_requests_decode_to_views_of_the_buffers(dtypes):
    rng = np.random.default_rng()
    tensors = {f"t{i}": random_tensor(rng, dtype, (3, 5 + i)) for i, dtype in enumerate(dtypes)}
    buffers = []
    body = b"".join(protocol.encode_request(9, "put", {"tensor": tensors["t0"]}, buffers=buffers))
    assert msgpack.unpackb(body)["args"]["tensor"] == {"dtype": dtypes[0], "shape": [3, 5], "buf": 0}
    received = [bytearray(b) for b in buffers]
    request = protocol.decode_request(body, received)
    assert request.multipart and bytes(request.args["tensor"].data) == bytes(tensors["t0"].data)
    received[0][0] ^= 0xFF  # a view, not a copy
    assert bytes(request.args["tensor"].data) == bytes(received[0])
    buffers = []
    parts = protocol.encode_reply(9, {"out": tensors}, {"server_us": 1.5}, buffers=buffers)
    assert len(buffers) == len(dtypes)
    reply = protocol.decode_reply(b"".join(parts), buffers)
    for name, tensor in tensors.items():
        got = reply.result["out"][name]
        assert (got.dtype, got.shape, bytes(got.data)) == (tensor.dtype, tensor.shape, bytes(tensor.data))


def test_inline_requests_are_not_multipart():
    body = b"".join(protocol.encode_request(1, "ping", {}))
    assert protocol.decode_request(body).multipart is False


def test_encoders_want_an_empty_list_for_buffers():
    with pytest.raises(ValueError, match="empty list"):
        protocol.encode_request(1, "ping", {}, buffers=[b"left over"])


@pytest.mark.parametrize("frames, field", [
    pytest.param(lambda body, data: [body], "result.y", id="missing-buffer"),
    pytest.param(lambda body, data: [body, data, b"x"], "buffers[1]", id="stray-buffer"),
    pytest.param(lambda body, data: [body, data[:-1]], "result.y", id="short-buffer"),
])
def test_a_malformed_multipart_reply_is_a_decode_error(frames, field):
    data = np.random.default_rng().standard_normal(6).astype(np.float32)
    buffers = []
    body = b"".join(protocol.encode_reply(4, {"y": protocol.OutTensor("f32", (2, 3), data)}, {}, buffers=buffers))
    with pytest.raises(protocol.DecodeError) as info:
        message = frames(body, bytes(buffers[0]))
        protocol.decode_reply(message[0], message[1:])
    assert info.value.detail["field"] == field
