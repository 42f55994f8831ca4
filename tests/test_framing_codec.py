"""Sans-IO units of the wire's multipart form (SPEC §5: tensors as views of raw buffers,
malformed replies refused); the framer's are tests/test_protocol_framing.py."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

import protocol


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
