"""protocol property tests: whatever bytes arrive, the decoders answer with a value or a
ProtocolError, never anything else; framing is independent of how the stream is cut."""

from __future__ import annotations

import math

import msgpack
import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocol import (DTYPES, OPS, FrameDecoder, FrameTooLarge, HandleRef, ProtocolError, WireTensor,
                      decode_reply, decode_request, encode_frame)
from protocol._reader import Reader

SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

scalars = (st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats()
           | st.text(max_size=12) | st.binary(max_size=24))
keys = st.sampled_from(["v", "id", "op", "args", "x", "dt", "A", "B", "C", "u", "dtype", "shape", "data",
                        "handle", "layout", "session", "batch", "seq_len", "hidden", "state", "status"])
values = st.recursive(scalars, lambda children: st.lists(children, max_size=4)
                      | st.dictionaries(keys | st.text(max_size=4), children, max_size=5), max_leaves=20)


def tensor_maps():
    dtype = st.sampled_from([*DTYPES, "f8", ""])
    shape = st.lists(st.integers(-2, 5), max_size=9)
    return st.fixed_dictionaries({"dtype": dtype, "shape": shape, "data": st.binary(max_size=64)})


def v1_requests():
    args = st.dictionaries(keys, values | tensor_maps(), max_size=6)
    return st.fixed_dictionaries({"v": st.just(1) | st.integers(0, 3), "id": st.integers(0, 9) | st.text(max_size=3),
                                  "op": st.sampled_from(list(OPS) + ["nope"]), "args": args})


def only_protocol_errors(decode, body):
    try:
        decode(body)
    except ProtocolError as e:
        assert e.code and isinstance(e.detail, dict) and str(e)


@SETTINGS
@given(st.binary(max_size=200))
def test_random_bytes_raise_only_protocol_errors(body):
    only_protocol_errors(decode_request, body)
    only_protocol_errors(decode_reply, body)


@SETTINGS
@given(values | v1_requests(), st.booleans())
def test_random_msgpack_values_raise_only_protocol_errors(message, str_binaries):
    body = msgpack.packb(message, use_bin_type=not str_binaries)
    only_protocol_errors(decode_request, body)
    only_protocol_errors(decode_reply, body)


@SETTINGS
@given(v1_requests(), st.data())
def test_corrupted_requests_raise_only_protocol_errors(message, data):
    body = bytearray(msgpack.packb(message))
    for _ in range(data.draw(st.integers(1, 4))):
        body[data.draw(st.integers(0, len(body) - 1))] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(body)))
    only_protocol_errors(decode_request, bytes(body[:cut]))
    only_protocol_errors(decode_request, bytes(body))


@SETTINGS
@given(tensor_maps() | st.fixed_dictionaries({"handle": st.text(max_size=3)}, optional={"dtype": st.just("f32")}),
       st.booleans(), st.booleans())
def test_fast_tensor_path_is_sound(tensor, allow_handle, str_binaries):
    """Whatever the typed fast path accepts, the field-by-field checks accept identically."""
    raw = msgspec.msgpack.decode(msgpack.packb(tensor, use_bin_type=not str_binaries), type=msgspec.Raw)
    fast = Reader.valid_tensor(raw, allow_handle)
    reader = Reader()
    try:
        careful = reader.tensor(raw, "t") if allow_handle else reader.tensor_data(raw, "t")
    except ProtocolError:
        assert fast is None
        return
    if isinstance(careful, WireTensor):
        expected = math.prod(careful.shape) * DTYPES[careful.dtype][0]
        assert careful.data.nbytes == expected
    if fast is not None:
        assert type(fast) is type(careful)
        if isinstance(fast, HandleRef):
            assert fast == careful
        else:
            assert (fast.dtype, fast.shape, bytes(fast.data)) == (careful.dtype, careful.shape, bytes(careful.data))


@SETTINGS
@given(st.lists(st.binary(max_size=300), max_size=6), st.lists(st.integers(0, 2000), max_size=8),
       st.integers(0, 200))
def test_framing_does_not_depend_on_how_the_stream_is_cut(bodies, cuts, limit):
    data = b"".join(encode_frame(b) for b in bodies)
    decoder = FrameDecoder(max_frame_size=limit)
    events, start = [], 0
    for cut in sorted(c for c in cuts if c <= len(data)) + [len(data)]:
        events += decoder.feed(data[start:cut])
        start = cut
    decoder.eof()
    expected = [bytes(b) if len(b) <= limit else FrameTooLarge(len(b), limit) for b in bodies]
    assert [bytes(e) if not isinstance(e, FrameTooLarge) else e for e in events] == expected


@SETTINGS
@given(st.binary(max_size=300), st.lists(st.integers(1, 50), min_size=1, max_size=5))
def test_framing_never_fails_on_junk(junk, reads):
    decoder = FrameDecoder(max_frame_size=64)
    pos, i = 0, 0
    while pos < len(junk):
        buffer = decoder.get_buffer()
        n = min(len(buffer), len(junk) - pos, reads[i % len(reads)])
        buffer[:n] = junk[pos:pos + n]
        pos, i = pos + n, i + 1
        for event in decoder.buffer_updated(n):
            assert isinstance(event, (bytes, memoryview, FrameTooLarge))
            if not isinstance(event, FrameTooLarge):
                only_protocol_errors(decode_request, event)


def uint_encodings(value: int) -> list[bytes]:
    """Every msgpack encoding of a small uint: fixint, uint 8, 16, 32, 64."""
    forms = [b"\xcd" + value.to_bytes(2, "big"), b"\xce" + value.to_bytes(4, "big"),
             b"\xcf" + value.to_bytes(8, "big")]
    if value < 256:
        forms.append(b"\xcc" + bytes([value]))
    if value < 128:
        forms.append(bytes([value]))
    return forms


@pytest.mark.parametrize("dtype, count", [pytest.param("f32", 3, id="f32x3"), pytest.param("f64", 33, id="f64x33"),
                                          pytest.param("u8", 300, id="u8x300")])
def test_clients_can_align_payloads_with_non_minimal_headers(dtype, count):
    """SPEC §5: wider ints (id, shape) and data headers before a payload move it to any offset
    mod 8, and the server accepts every such encoding."""
    payload = (bytes(range(1, 256)) * (count * 8 // 255 + 1))[:count * DTYPES[dtype][0]]
    n = len(payload)
    headers = [b"\xc5" + n.to_bytes(2, "big"), b"\xc6" + n.to_bytes(4, "big")]
    if n < 256:
        headers.append(b"\xc4" + bytes([n]))
    offsets = set()
    for request_id in uint_encodings(7):
        for dim in uint_encodings(count):
            for header in headers:
                body = (b"\x84\xa1v\x01\xa2id" + request_id + b"\xa2op\xa3put\xa4args\x81\xa6tensor\x83"
                        b"\xa5dtype" + msgpack.packb(dtype) + b"\xa5shape\x91" + dim + b"\xa4data" + header + payload)
                req = decode_request(body)
                t = req.args["tensor"]
                assert (req.id, t.shape, bytes(t.data)) == (7, (count,), payload)
                offsets.add((len(body) - n) % 8)
    assert offsets == set(range(8))
