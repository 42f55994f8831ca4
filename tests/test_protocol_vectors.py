"""protocol golden vectors and SPEC.md: the files match what the generator builds, each vector
decodes to what its JSON says, and SPEC's examples and tables agree with the code."""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import msgpack
import pytest

from protocol import (DTYPES, ERROR_CODES, OPS, Frame, FrameAssembler, FrameTooLarge, HandleRef, LegacyRequest,
                      OutTensor, ProtocolError, Request, WireTensor, decode_reply, decode_request,
                      encode_reply, encode_request, frame_parts)
from protocol.schema import ALIASES
from protocol.vectors import generate

VECTORS = generate.build_vectors()
MULTIPART_VECTORS = generate.build_multipart_vectors()
SPEC = (Path(generate.VECTORS_DIR).parent / "SPEC.md").read_text()


@pytest.mark.parametrize("directory, vectors", [
    pytest.param(generate.VECTORS_DIR, VECTORS, id="single"),
    pytest.param(generate.MULTIPART_DIR, MULTIPART_VECTORS, id="multipart"),
])
def test_files_on_disk_are_exactly_what_the_generator_builds(directory, vectors):
    on_disk = {p.name for p in directory.iterdir() if p.suffix in (".frame", ".json")}
    assert on_disk == {f"{name}.{ext}" for name, _, _ in vectors for ext in ("frame", "json")}, \
        "run: python -m protocol.vectors.generate"
    for name, frame, doc in vectors:
        assert (directory / f"{name}.frame").read_bytes() == frame, name
        assert (directory / f"{name}.json").read_bytes() == generate.render_json(doc), name


def from_json(value):
    """The JSON description back to Python values, binaries as their exact bytes."""
    if isinstance(value, dict):
        if set(value) == {"$bytes"}:
            b = value["$bytes"]
            return generate.Binary(b["dtype"], b["values"], b["format"] == "str").to_bytes()
        return {k: from_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [from_json(v) for v in value]
    return value


def as_raw(value):
    """`value` with every str as its UTF-8 bytes: how msgpack-python's raw mode returns it."""
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, dict):
        return {as_raw(k): as_raw(v) for k, v in value.items()}
    if isinstance(value, list):
        return [as_raw(v) for v in value]
    return value


def independent_decode(body):
    # raw mode: tensor data sent as msgpack str need not be UTF-8.
    return msgpack.unpackb(body, raw=True)


def only_body(frame: bytes):
    decoder = FrameAssembler()
    ((body, _),) = decoder.feed(frame)
    assert decoder.eof() is None
    return body


def vector_params(*kinds):
    return [pytest.param(frame, doc, id=name) for name, frame, doc in VECTORS if doc["kind"] in kinds]


def test_every_kind_of_vector_is_present():
    kinds = {doc["kind"] for _, _, doc in VECTORS}
    assert kinds == {"request", "reply", "error", "legacy_request", "legacy_reply", "invalid", "invalid_frame"}
    dtypes = {t["dtype"] for _, _, doc in VECTORS if doc["kind"] == "request"
              for t in doc["message"].get("args", {}).values() if isinstance(t, dict) and "dtype" in t}
    assert dtypes == set(DTYPES)


def assert_same_value(decoded, described):
    if isinstance(decoded, WireTensor):
        assert (decoded.dtype, list(decoded.shape)) == (described["dtype"], described["shape"])
        assert bytes(decoded.data) == described["data"]
    elif isinstance(decoded, HandleRef):
        assert described == {"handle": decoded.handle}
    elif isinstance(decoded, Frame):  # one of session_open's frames
        assert set(described) == {"op", "args"} and decoded.op == described["op"]
        assert_same_value(decoded.args, described["args"])
    elif isinstance(decoded, (tuple, list)):  # an array: a limits pair, session_open's frames, a reply's frames
        assert len(decoded) == len(described)
        for item, expected in zip(decoded, described):
            assert_same_value(item, expected)
    elif isinstance(decoded, dict):  # a map of tensors (weights, a model's state) or a config
        assert set(decoded) == set(described)
        for key, value in decoded.items():
            assert_same_value(value, described[key])
    else:
        assert decoded == described


@pytest.mark.parametrize("frame, doc", vector_params("request"))
def test_request_vectors_decode_as_described(frame, doc):
    message = from_json(doc["message"])
    assert independent_decode(only_body(frame)) == as_raw(message)
    req = decode_request(only_body(frame))
    assert isinstance(req, Request) and (req.id, req.op) == (message["id"], message["op"])
    assert req.deadline_us == message.get("deadline_us")
    described = {ALIASES.get(k, k): v for k, v in message.get("args", {}).items()}
    assert set(req.args) == set(described)
    for name, value in req.args.items():
        assert_same_value(value, described[name])


@pytest.mark.parametrize("frame, doc", vector_params("legacy_request"))
def test_legacy_request_vectors_decode_as_described(frame, doc):
    message = from_json(doc["message"])
    req = decode_request(only_body(frame))
    assert isinstance(req, LegacyRequest) and req.op == message["op"]
    for name, t in req.args.items():
        if isinstance(t, WireTensor):
            assert bytes(t.data) == message[name]


@pytest.mark.parametrize("frame, doc", vector_params("reply", "error", "legacy_reply"))
def test_reply_vectors_decode_as_described(frame, doc):
    body = only_body(frame)
    assert independent_decode(body) == as_raw(from_json(doc["message"]))
    if doc["kind"] != "legacy_reply":
        reply = decode_reply(body)
        message = from_json(doc["message"])
        assert (reply.id, reply.ok, reply.error, reply.timing) == (
            message["id"], message["ok"], message.get("error"), message.get("timing", {}))
        for name, value in (reply.result or {}).items():
            assert_same_value(value, message["result"][name])


@pytest.mark.parametrize("frame, doc", vector_params("invalid"))
def test_invalid_vectors_raise_the_described_error(frame, doc):
    with pytest.raises(ProtocolError) as info:
        decode_request(only_body(frame))
    expected = doc["error"]
    error = info.value
    assert (error.code, error.request_id, error.legacy) == (expected["code"], expected["request_id"], expected["legacy"])
    assert error.detail.get("field") == expected["field"]


@pytest.mark.parametrize("frame, doc", vector_params("invalid_frame"))
def test_frame_vectors_are_reported_by_the_frame_assembler(frame, doc):
    """Once the announced body has been read and discarded (no body follows in the vector: the
    discarded bytes' content does not matter, so none is written)."""
    frames = FrameAssembler(doc["frame_length"] - 1)
    assert frames.feed(frame) == []
    events = []
    while not events:
        event = frames.advance(len(frames.space()))
        events += [event] if event is not None else []
    assert events == [FrameTooLarge(doc["frame_length"], doc["frame_length"] - 1)]
    assert events[0].code == doc["error"]["code"] and frames.at_frame_start


def test_request_vectors_with_bin_data_are_what_encode_request_writes():
    """The client-side writer of the generator and the package's encoder agree byte for byte."""
    for name, frame, doc in VECTORS:
        if (doc["kind"] != "request" or name == "scan_str_data"
                or not {"v", "id", "op", "args"} <= set(doc["message"]) <= {"v", "id", "op", "args", "deadline_us"}):
            continue
        message = from_json(doc["message"])
        args = {k: as_encoder_arg(v) for k, v in message["args"].items()}
        encoded = encode_request(message["id"], message["op"], args, deadline_us=message.get("deadline_us"))
        assert b"".join(frame_parts(encoded)) == frame, name


def as_encoder_arg(value):
    """A described argument as encode_request takes it: tensor and handle maps (nested in a map
    of tensors too) as OutTensor / HandleRef."""
    if isinstance(value, dict):
        if "dtype" in value:
            return OutTensor(value["dtype"], value["shape"], value["data"])
        if set(value) == {"handle"}:
            return HandleRef(value["handle"])
        return {k: as_encoder_arg(v) for k, v in value.items()}
    return value


# -- SPEC.md ----------------------------------------------------------------------------------

def spec_hex(name: str) -> bytes:
    block = re.search(rf"<!-- hex: {name} -->\n```\n(.*?)```", SPEC, re.S).group(1)
    hex_columns = [re.match(r"((?:[0-9a-f]{2} )*[0-9a-f]{2})(?: {2,}|$)", line).group(1)
                   for line in block.splitlines()]
    return bytes.fromhex(" ".join(hex_columns))


def test_spec_examples_are_what_the_encoders_write():
    tensor = OutTensor("f32", (2,), struct.pack("<2f", 1.5, -2.0))
    assert spec_hex("put_request") == b"".join(frame_parts(encode_request(7, "put", {"tensor": tensor})))
    reply = encode_reply(7, {"handle": "h-1"}, {"decode_us": 3, "server_us": 11})
    assert spec_hex("put_reply") == b"".join(frame_parts(reply))
    req = decode_request(only_body(spec_hex("put_request")))
    assert bytes(req.args["tensor"].data) == struct.pack("<2f", 1.5, -2.0)


def spec_table(heading: str) -> list[list[str]]:
    """Rows (cells stripped) of the first table under the given `## heading`."""
    section = SPEC.split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ")]
    return [[cell.strip() for cell in row.strip("|").split(" | ")] for row in rows[1:]]


def test_spec_error_table_is_error_codes():
    table = {code.strip("`"): meaning for code, meaning in spec_table("7. Errors")}
    assert table == ERROR_CODES


def test_spec_dtype_table_is_dtypes():
    table = {code.strip("`"): (int(size), what) for code, size, what in spec_table("5. Tensors")}
    assert table == DTYPES


def test_spec_ops_table_lists_every_op_and_argument():
    rows = {op.strip("`"): args for op, args, _ in spec_table("6. Ops")}
    assert list(rows) == list(OPS)
    for op, spec in OPS.items():
        named = re.findall(r"`(\w+)`", rows[op])
        required = re.findall(r"\*\*`(\w+)`\*\*", rows[op])
        assert set(named) - {"bld", "bdl"} == set(spec), op
        assert set(required) == {name for name, arg in spec.items() if arg.required}, op


def test_spec_lists_every_vector():
    for name, _, _ in VECTORS + MULTIPART_VECTORS:
        assert f"`{name}`" in SPEC, name


def test_json_documents_are_plain_json():
    for name, _, doc in VECTORS + MULTIPART_VECTORS:
        assert json.loads(generate.render_json(doc)) == doc, name


# -- the multipart golden vectors (protocol/vectors/multipart) --------------------------------

@pytest.mark.parametrize("frame, doc", [pytest.param(frame, doc, id=name) for name, frame, doc in MULTIPART_VECTORS])
def test_multipart_vectors_decode_as_described(frame, doc):
    body, *buffers = (body for body, _ in FrameAssembler().feed(frame))
    message = from_json(doc["message"])
    assert [bytes(b) for b in buffers] == [from_json(b) for b in doc["buffers"]]
    assert msgpack.unpackb(body) == message
    if doc["kind"] == "multipart_request":
        request = decode_request(body, buffers)
        assert request.multipart and (request.id, request.op) == (message["id"], message["op"])
        tensors = request.args
    else:
        reply = decode_reply(body, buffers)
        assert (reply.id, reply.ok, reply.timing) == (message["id"], message["ok"], message["timing"])
        tensors = reply.result
    described = message["args"] if doc["kind"] == "multipart_request" else message["result"]
    assert set(tensors) == set(described)
    for name, value in described.items():
        assert_same_value(tensors[name], with_data(value, buffers))


def with_data(value, buffers):
    """A described multipart value with each tensor naming a raw buffer, at any depth, as the
    tensor map holding that buffer's bytes."""
    if isinstance(value, dict) and "buf" in value:
        return {"dtype": value["dtype"], "shape": value["shape"], "data": bytes(buffers[value["buf"]])}
    if isinstance(value, dict):
        return {k: with_data(v, buffers) for k, v in value.items()}
    if isinstance(value, list):
        return [with_data(v, buffers) for v in value]
    return value
