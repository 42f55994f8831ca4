"""protocol: request decoding (v1 and ExPhil legacy), validation errors, encoders, round trips."""

from __future__ import annotations

import json
import math

import msgpack
import msgpack.fallback
import numpy as np
import pytest

import protocol
from protocol import (BIG_PAYLOAD, DTYPES, ERROR_CODES, OPS, HandleRef, LegacyRequest, OutTensor,
                      ProtocolError, Request, WireTensor, decode_reply, decode_request,
                      encode_error, encode_legacy_reply, encode_reply, encode_request)
from protocol.schema import FRAME_OPS, MAX_FRAMES, MAX_MAP_BYTES, MAX_NAMED_TENSORS

RNG = np.random.default_rng()
NUMPY = {"f32": "<f4", "f16": "<f2", "f64": "<f8", "i32": "<i4", "i64": "<i8", "u8": "u1"}


def random_bytes(dtype: str, shape) -> bytes:
    """Fresh random non-zero values of `dtype` in wire layout."""
    n = math.prod(shape)
    if dtype == "bf16":
        f32 = (RNG.standard_normal(n) + 3.0).astype("<f4")
        return (f32.view("<u4") >> 16).astype("<u2").tobytes()
    if dtype in ("f32", "f16", "f64"):
        return (RNG.standard_normal(n) + 3.0).astype(NUMPY[dtype]).tobytes()
    return RNG.integers(1, 100, n).astype(NUMPY[dtype]).tobytes()


def tensor_map(dtype="f32", shape=(2, 3), data=None) -> dict:
    return {"dtype": dtype, "shape": list(shape),
            "data": random_bytes(dtype, shape) if data is None else data}


def request(op, args=None, request_id=1, **envelope) -> dict:
    message = {"v": 1, "id": request_id, "op": op}
    if args is not None:
        message["args"] = args
    message.update(envelope)
    return message


def pack(message, str_binaries=False) -> bytes:
    # use_bin_type=False packs bytes as msgpack str, as Msgpax does.
    return msgpack.packb(message, use_bin_type=not str_binaries)


def scan_args(dtype="f32", batch=2, seq=5, dim=3, state=4) -> dict:
    return {"x": tensor_map(dtype, (batch, seq, dim)), "dt": tensor_map(dtype, (batch, seq, dim)),
            "A": tensor_map(dtype, (dim, state)), "B": tensor_map(dtype, (batch, seq, state)),
            "C": tensor_map(dtype, (batch, seq, state))}


def legacy_scan(batch=2, seq=5, hidden=3, state=4) -> dict:
    return {"op": "scan", "batch": batch, "seq_len": seq, "hidden": hidden, "state": state,
            "x": random_bytes("f32", (batch, seq, hidden)), "dt": random_bytes("f32", (batch, seq, hidden)),
            "A": random_bytes("f32", (hidden, state)), "B": random_bytes("f32", (batch, seq, state)),
            "C": random_bytes("f32", (batch, seq, state))}


def decode_error(body) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        decode_request(body)
    error = info.value
    assert error.code in ERROR_CODES
    json.dumps(error.detail)  # detail must be JSON-able
    return error


# -- v1 requests -----------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("shape", [
    pytest.param((7,), id="1d-odd"),
    pytest.param((3, 5, 9), id="3d-odd"),
    pytest.param((2, 1, 3, 1, 5, 1, 7, 1), id="8d"),
    pytest.param((), id="scalar"),
    pytest.param((0, 3), id="empty"),
])
@pytest.mark.parametrize("str_binaries", [pytest.param(False, id="bin"), pytest.param(True, id="str")])
def test_tensor_of_every_dtype_decodes_to_a_view_of_its_bytes(dtype, shape, str_binaries):
    t = tensor_map(dtype, shape)
    req = decode_request(pack(request("put", {"tensor": t}), str_binaries))
    got = req.args["tensor"]
    assert isinstance(got, WireTensor)
    assert (got.dtype, got.shape, bytes(got.data)) == (dtype, shape, t["data"])
    assert isinstance(got.data, memoryview) and got.data.nbytes == len(t["data"])


@pytest.mark.parametrize("str_binaries", [pytest.param(False, id="bin"), pytest.param(True, id="str")])
@pytest.mark.parametrize("as_view", [pytest.param(False, id="bytearray"), pytest.param(True, id="memoryview")])
def test_tensor_data_is_zero_copy_into_the_body(str_binaries, as_view):
    body = bytearray(pack(request("scan", scan_args(batch=3, seq=7, dim=5, state=3)), str_binaries))
    req = decode_request(memoryview(body) if as_view else body)
    x = req.args["x"].data
    body_array = np.frombuffer(body, np.uint8)
    assert np.shares_memory(np.frombuffer(x, np.uint8), body_array)
    offset = bytes(body).find(bytes(x))
    body[offset] ^= 0xFF
    assert x[0] == body[offset]  # a view sees the change; a copy would not


def test_non_utf8_str_data_is_accepted_as_bytes():
    data = bytes([0xFF, 0xFE, 0x80, 0xC0]) * 6  # not UTF-8: a str decode would fail
    req = decode_request(pack(request("put", {"tensor": tensor_map("f32", (2, 3), data)}), True))
    assert bytes(req.args["tensor"].data) == data


def test_scan_with_every_argument_keeps_canonical_names_and_types():
    args = scan_args()
    args.update(D=tensor_map("f32", (3,)), z=tensor_map("f32", (2, 5, 3)), dt_bias=tensor_map("f32", (3,)),
                dt_softplus=True, dt_min=1, dt_max=0.5, h0=tensor_map("f32", (2, 3, 4)),
                return_state=False, layout="bdl", session="s-9")
    req = decode_request(pack(request("scan", args, request_id=42)))
    assert isinstance(req, Request) and (req.id, req.op, req.version) == (42, "scan", 1)
    assert list(req.args) == list(args)
    assert req.args["dt_min"] == 1.0 and type(req.args["dt_min"]) is float
    assert (req.args["dt_softplus"], req.args["return_state"]) == (True, False)
    assert (req.args["layout"], req.args["session"]) == ("bdl", "s-9")
    for name in ("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "h0"):
        assert bytes(req.args[name].data) == args[name]["data"]


def test_aliases_resolve_to_canonical_names():
    args = scan_args()
    args["u"], args["delta"] = args.pop("x"), args.pop("dt")
    args["delta_bias"] = tensor_map("f32", (3,))
    req = decode_request(pack(request("scan", args)))
    assert set(req.args) == {"x", "dt", "A", "B", "C", "dt_bias"}
    assert bytes(req.args["x"].data) == args["u"]["data"]


@pytest.mark.parametrize("given", [
    pytest.param(dict(delta_softplus=True, dt_softplus=None), id="alias-beside-nil-name"),
    pytest.param(dict(dt_softplus=None, delta_softplus=True), id="nil-name-then-alias"),
    pytest.param(dict(return_last_state=True, return_state=None), id="return-last-state"),
    pytest.param(dict(dt_softplus=None, delta_softplus=None), id="both-nil"),
])
def test_a_nil_beside_its_alias_is_absent_not_both(given):
    """SPEC §3: nil means absent, so a nil name beside its alias's value gives one of the two
    (found in review: refused as giving both)."""
    req = decode_request(pack(request("scan", dict(scan_args(), **given))))
    expected = {k: v for k, v in given.items() if v is not None}
    assert {"dt_softplus": req.args.get("dt_softplus"), "return_state": req.args.get("return_state")} == {
        "dt_softplus": expected.get("dt_softplus", expected.get("delta_softplus")),
        "return_state": expected.get("return_state", expected.get("return_last_state"))}


@pytest.mark.parametrize("nil_alias, name", [
    pytest.param("u", "x", id="x-beside-nil-u"),
    pytest.param("delta", "dt", id="dt-beside-nil-delta"),
])
@pytest.mark.parametrize("order", ["nil-first", "nil-last"])
def test_a_nil_alias_beside_a_required_argument_is_absent(nil_alias, name, order):
    """SPEC §6: an alias beside its name is refused, "a nil one is not given" (found in review:
    refused as a required argument's nil). Alone, a required argument's nil is still refused."""
    args = scan_args()
    given = {nil_alias: None, **args} if order == "nil-first" else {**args, nil_alias: None}
    req = decode_request(pack(request("scan", given)))
    assert bytes(req.args[name].data) == args[name]["data"]
    alone = {k: v for k, v in args.items() if k != name} | {nil_alias: None}
    with pytest.raises(ProtocolError) as refused:
        decode_request(pack(request("scan", alone)))
    assert refused.value.code == "invalid_argument"
    assert refused.value.detail["field"] == f"args.{nil_alias}" and refused.value.detail["got"] == "nil"


def test_handle_reference_in_place_of_a_tensor():
    args = scan_args()
    args["A"] = {"handle": "weights-A"}
    assert decode_request(pack(request("scan", args))).args["A"] == HandleRef("weights-A")


def test_nil_optional_argument_counts_as_absent():
    args = dict(scan_args(), D=None, dt_min=None, layout=None)
    assert set(decode_request(pack(request("scan", args))).args) == {"x", "dt", "A", "B", "C"}


@pytest.mark.parametrize("request_id", [
    pytest.param(0, id="zero"),
    pytest.param(2**64 - 1, id="max-uint64"),
    pytest.param("req-ü-7", id="str"),
])
def test_request_ids_and_optional_v_and_args(request_id):
    message = {"id": request_id, "op": "ping"}  # no v, no args
    req = decode_request(pack(message))
    assert (req.id, req.op, req.args, req.version) == (request_id, "ping", {}, 1)


def _minimal_value(kind):
    return {"tensor": tensor_map("f32", (3, 1)), "tensor_data": tensor_map("i64", (5,)), "bool": True,
            "number": 0.25, "str": "name-1", "size": 3, "layout": "bld", "limits": [0.0, float("inf")],
            "kind": "ssd", "output": "hidden", "weights_dtype": "bf16", "map": {"arch": "mamba", "n": [1, 2]},
            "tensors": {"w": tensor_map("f32", (2,)), "h": {"handle": "h1"}},
            "size_or_tensors": {"layers.0.ssm": tensor_map("f32", (1, 2))}, "request_id": 7,
            "frames": [{"op": "model_step", "args": {"tokens": tensor_map("i64", (1,))}}]}[kind]


def _wrong_value(kind):
    return {"tensor": [1, 2], "tensor_data": {"handle": "h"}, "bool": 1, "number": "0.5", "str": 7,
            "size": 0, "layout": "dbl", "limits": [0.1], "kind": "mamba2", "output": "logit",
            "weights_dtype": "f64", "map": [1, 2], "tensors": "weights", "size_or_tensors": -3,
            "request_id": -1, "frames": {"op": "step"}}[kind]


@pytest.mark.parametrize("op", list(OPS))
def test_every_op_accepts_its_required_arguments(op):
    args = {name: _minimal_value(arg.kind) for name, arg in OPS[op].items() if arg.required}
    req = decode_request(pack(request(op, args)))
    assert req.op == op and set(req.args) == set(args)


@pytest.mark.parametrize("op, name", [pytest.param(op, name, id=f"{op}.{name}")
                                      for op, spec in OPS.items() for name in spec])
def test_every_argument_rejects_a_value_of_the_wrong_kind(op, name):
    args = {n: _minimal_value(arg.kind) for n, arg in OPS[op].items() if arg.required}
    args[name] = _wrong_value(OPS[op][name].kind)
    error = decode_error(pack(request(op, args, request_id=5)))
    assert (error.code, error.detail["field"], error.request_id) == ("invalid_argument", f"args.{name}", 5)
    assert f"args.{name}" in str(error)


_ALL_SCAN = scan_args()
_TOO_DEEP = b"\x81\xa1v" + b"\x91" * 100_000 + b"\x01"

# (id, body, code, field or None, request_id)
_INVALID = [
    ("not-msgpack", b"\xc1", "decode_error", None, None),
    ("empty-body", b"", "decode_error", None, None),
    ("truncated", pack(request("ping"))[:-3], "decode_error", None, None),
    ("trailing-bytes", pack(request("ping")) + b"\x00", "decode_error", None, None),
    ("array-body", pack([1, "ping"]), "decode_error", None, None),
    ("int-body", pack(5), "decode_error", None, None),
    ("absurdly-deep", _TOO_DEEP, "decode_error", None, None),
    ("bad-utf8-key", b"\x81\xa2\xff\xfe\x01", "decode_error", None, None),
    ("int-key", pack({1: 2, "id": 3}), "invalid_request", "body", None),
    # A map or ext key is well-formed msgpack that msgspec cannot hash: a non-str key all the same.
    ("map-key", b"\x83\xa2id\x03\xa2op\xa4ping" + pack({"a": 1}) + b"\x01", "invalid_request", "body", None),
    ("ext-key", b"\x83\xa2id\x03\xa2op\xa4ping" + pack(msgpack.ExtType(1, b"x")) + b"\x01",
     "invalid_request", "body", None),
    ("duplicate-key", b"\x84\xa2id\x01\xa2op\xa4ping\xa2id\x02\xa1v\x01", "invalid_request", "body", None),
    ("v-without-id", pack({"v": 1, "op": "ping"}), "invalid_request", "id", None),
    ("negative-id", pack(request("ping", request_id=-1)), "invalid_request", "id", None),
    ("float-id", pack(request("ping", request_id=1.5)), "invalid_request", "id", None),
    ("bool-id", pack(request("ping", request_id=True)), "invalid_request", "id", None),
    ("empty-str-id", pack(request("ping", request_id="")), "invalid_request", "id", None),
    ("nil-id", pack(request("ping", request_id=None)), "invalid_request", "id", None),
    ("v2", pack(request("ping", v=2)), "unsupported_version", "v", 1),
    ("v-str", pack(request("ping", v="1")), "invalid_request", "v", 1),
    ("unknown-envelope-key", pack(request("ping", idd=1)), "invalid_request", "idd", 1),
    ("op-missing", pack({"v": 1, "id": 4}), "invalid_request", "op", 4),
    ("op-int", pack(request(3)), "invalid_request", "op", 1),
    ("op-unknown", pack(request("scna", {})), "unknown_op", "op", 1),
    ("op-empty", pack(request("", {})), "unknown_op", "op", 1),
    ("args-array", pack(request("ping", [])), "invalid_request", "args", 1),
    ("args-int-key", pack(request("ping", {1: 2})), "invalid_request", "args", 1),
    ("unknown-arg", pack(request("scan", dict(_ALL_SCAN, dt_minn=0.1))), "invalid_argument", "args.dt_minn", 1),
    ("arg-for-argless-op", pack(request("ping", {"x": 1})), "invalid_argument", "args.x", 1),
    ("alias-and-name", pack(request("scan", dict(_ALL_SCAN, u=_ALL_SCAN["x"]))), "invalid_argument", "args.u", 1),
    ("missing-C", pack(request("scan", {k: v for k, v in _ALL_SCAN.items() if k != "C"})),
     "missing_argument", "args.C", 1),
    ("missing-session", pack(request("step", _ALL_SCAN)), "missing_argument", "args.session", 1),
    ("required-nil", pack(request("scan", dict(_ALL_SCAN, x=None))), "invalid_argument", "args.x", 1),
    ("nan-dt-min", pack(request("scan", dict(_ALL_SCAN, dt_min=float("nan")))), "invalid_argument", "args.dt_min", 1),
    ("bool-dt-max", pack(request("scan", dict(_ALL_SCAN, dt_max=True))), "invalid_argument", "args.dt_max", 1),
    ("empty-session", pack(request("session_close", {"session": ""})), "invalid_argument", "args.session", 1),
    ("negative-size", pack(request("session_open", {"batch": -2, "dim": 1, "state": 1})),
     "invalid_argument", "args.batch", 1),
    ("float-size", pack(request("session_open", {"batch": 2, "dim": 1.0, "state": 1})),
     "invalid_argument", "args.dim", 1),
    ("tensor-missing-data", pack(request("put", {"tensor": {"dtype": "f32", "shape": [1]}})),
     "invalid_argument", "args.tensor.data", 1),
    ("tensor-extra-key", pack(request("put", {"tensor": dict(tensor_map(), strides=[3, 1])})),
     "invalid_argument", "args.tensor.strides", 1),
    ("unknown-dtype", pack(request("put", {"tensor": tensor_map("f32", (2,), b"\x01" * 8) | {"dtype": "f8"}})),
     "unknown_dtype", "args.tensor.dtype", 1),
    ("dtype-empty", pack(request("put", {"tensor": tensor_map("f32", (2,), b"\x01" * 8) | {"dtype": ""}})),
     "unknown_dtype", "args.tensor.dtype", 1),
    ("dtype-not-str", pack(request("put", {"tensor": tensor_map() | {"dtype": 4}})),
     "invalid_argument", "args.tensor.dtype", 1),
    ("dtype-bad-utf8", b"\x84\xa1v\x01\xa2id\x01\xa2op\xa3put\xa4args\x81\xa6tensor\x83"
                       b"\xa5dtype\xa2\xff\xfe\xa5shape\x91\x01\xa4data\xc4\x04abcd",
     "invalid_argument", "args.tensor.dtype", 1),
    ("shape-not-list", pack(request("put", {"tensor": tensor_map() | {"shape": 6}})),
     "invalid_argument", "args.tensor.shape", 1),
    ("shape-negative", pack(request("put", {"tensor": tensor_map("u8", (2, 3)) | {"shape": [2, -3]}})),
     "invalid_argument", "args.tensor.shape[1]", 1),
    ("shape-bool", pack(request("put", {"tensor": tensor_map("u8", (1,)) | {"shape": [True]}})),
     "invalid_argument", "args.tensor.shape[0]", 1),
    ("shape-float", pack(request("put", {"tensor": tensor_map("u8", (1,)) | {"shape": [1.0]}})),
     "invalid_argument", "args.tensor.shape[0]", 1),
    ("shape-9d", pack(request("put", {"tensor": tensor_map("u8", (1,) * 8) | {"shape": [1] * 9}})),
     "invalid_argument", "args.tensor.shape", 1),
    # No message holds 2^63 bytes, and no array spans them even when a 0 dim leaves it empty.
    ("shape-too-big", pack(request("put", {"tensor": tensor_map("f32", (2**62, 4), b"")})),
     "invalid_argument", "args.tensor.shape", 1),
    ("shape-too-big-empty", pack(request("put", {"tensor": tensor_map("f32", (0, 2**61), b"")})),
     "invalid_argument", "args.tensor.shape", 1),
    ("data-int", pack(request("put", {"tensor": tensor_map() | {"data": 7}})),
     "invalid_argument", "args.tensor.data", 1),
    ("data-short", pack(request("put", {"tensor": tensor_map("f32", (3, 5), random_bytes("f32", (14,)))})),
     "tensor_size_mismatch", "args.tensor.data", 1),
    ("data-long", pack(request("put", {"tensor": tensor_map("bf16", (3,), random_bytes("bf16", (4,)))})),
     "tensor_size_mismatch", "args.tensor.data", 1),
    ("handle-with-dtype", pack(request("scan", dict(_ALL_SCAN, A={"handle": "h", "dtype": "f32"}))),
     "invalid_argument", "args.A", 1),
    ("handle-empty", pack(request("scan", dict(_ALL_SCAN, A={"handle": ""}))),
     "invalid_argument", "args.A.handle", 1),
    ("put-a-handle", pack(request("put", {"tensor": {"handle": "h"}})), "invalid_argument", "args.tensor", 1),
]


@pytest.mark.parametrize("body, code, field, request_id",
                         [pytest.param(*case[1:], id=case[0]) for case in _INVALID])
def test_invalid_requests_raise_the_documented_code_naming_the_field(body, code, field, request_id):
    error = decode_error(body)
    assert (error.code, error.request_id, error.legacy) == (code, request_id, False)
    if field is not None:
        assert error.detail["field"] == field
        assert str(error).startswith(field + ":")
        assert "expected" in str(error) and "got" in str(error)


def test_every_request_error_code_of_the_protocol_layer_is_exercised():
    raised = {case[2] for case in _INVALID} | {case[2] for case in _INVALID_LEGACY}
    assert raised == {cls.code for cls in (protocol.DecodeError, *protocol.ValidationError.__subclasses__())}


def test_size_mismatch_detail_says_expected_and_received_bytes():
    error = decode_error(pack(request("put", {"tensor": tensor_map("f64", (3, 5), random_bytes("f64", (14,)))})))
    assert error.detail | {} == {"field": "args.tensor.data", "expected": "120 bytes (f64 [3, 5])",
                                 "got": "112 bytes", "dtype": "f64", "shape": [3, 5],
                                 "expected_bytes": 120, "got_bytes": 112}


@pytest.mark.parametrize("op", ["scna", ""])
def test_unknown_op_detail_lists_the_known_ops(op):
    error = decode_error(pack(request(op)))
    assert error.detail["known"] == list(OPS)


@pytest.mark.parametrize("dtype", ["f8", ""])
def test_unknown_dtype_detail_lists_the_known_dtypes(dtype):
    error = decode_error(pack(request("put", {"tensor": tensor_map("u8", (1,), b"\x01") | {"dtype": dtype}})))
    assert error.detail["known"] == list(DTYPES)


# A model_load request up to its config's value, for the config maps below as exact bytes.
_CONFIG_ARG = b"\x84\xa1v\x01\xa2id\x01\xa2op\xaamodel_load\xa4args\x81\xa6config"


@pytest.mark.parametrize("config, field, got", [
    pytest.param(b"\x81\xa1a\x82\xa1k\x01\xa1k\x02", "args.config.a", "a key given more than once",
                 id="map-duplicate-key"),
    pytest.param(b"\x81\xa1a\x81\x01\x01", "args.config.a", "a non-str key (int 1)", id="map-int-key"),
    pytest.param(b"\x81\xa1a\x91\x82\xa1k\x01\xa1k\x02", "args.config.a[0]", "a key given more than once",
                 id="map-in-array-duplicate-key"),
    pytest.param(b"\x81\xa1a\x91\x81\x01\x01", "args.config.a[0]", "a non-str key (int 1)", id="map-in-array-int-key"),
    pytest.param(b"\x81\xa1a\x91\x81\xc4\x01k\x01", "args.config.a[0]", "a non-str key (bin of 1 bytes)",
                 id="map-in-array-bin-key"),
    pytest.param(b"\x81\xa1a\x92\x01\x91\x81\xa1b\x81\x02\x03", "args.config.a[1][0].b", "a non-str key (int 2)",
                 id="map-in-array-in-array"),
])
def test_every_map_in_a_map_argument_has_distinct_str_keys_arrays_included(config, field, got):
    # SPEC §3: a map with a non-str or duplicate key is refused wherever it lies.
    error = decode_error(_CONFIG_ARG + config)
    assert (error.code, error.request_id, error.detail["field"], error.detail["got"]) == (
        "invalid_argument", 1, field, got)


_HUGE = 1 << 20


def _many_weights_after(key: bytes) -> bytes:
    # A map of weights many entries long for its bytes, read one entry at a time, `key` first.
    weights = b"\xde\x00\x64" + pack(key) + b"\x01" + b"".join(pack(f"w{i}") + b"\x01" for i in range(99))
    return b"\x84\xa1v\x01\xa2id\x01\xa2op\xaamodel_load\xa4args\x82\xa6config\x80\xa7weights" + weights


@pytest.mark.parametrize("body, field, got", [
    pytest.param(pack({b"k" * _HUGE: 1, "v": 1, "id": 1, "op": "ping"}), "body", f"a non-str key (bin of {_HUGE} bytes)",
                 id="body-bin-key"),
    pytest.param(_CONFIG_ARG + pack({tuple(range(_HUGE // 16)): 1}), "args.config",
                 f"a non-str key (array of {_HUGE // 16} items)", id="config-array-key"),
    pytest.param(_many_weights_after(b"k" * 4096), "args.weights", "a non-str key (bin of 4096 bytes)",
                 id="weights-read-one-at-a-time"),
    pytest.param(pack(request("scan", {"x": {"dtype": "f32", "shape": ["s" * _HUGE], "data": b""}})),
                 "args.x.shape[0]", f"str of {_HUGE} bytes", id="shape-dim-str"),
])
def test_a_huge_value_refused_is_described_not_echoed(body, field, got):
    # A key's or a dim's repr put the whole of it in the error: a reply as long as the request,
    # past what a reply may carry for a request near the frame limit.
    error = decode_error(body)
    assert (error.detail["field"], error.detail["got"]) == (field, got)
    assert len(str(error)) < 300


_LONG_KEY = "k" * 100_000
_ONE_F32 = {"dtype": "f32", "shape": [1], "data": b"\0" * 4}


@pytest.mark.parametrize("decode, body, code, expected", [
    pytest.param(decode_request, pack(request("ping") | {_LONG_KEY: 1}), "invalid_request", "only the envelope keys",
                 id="envelope-key"),
    pytest.param(decode_request, pack(request("scan", dict(_ALL_SCAN) | {_LONG_KEY: 1})), "invalid_argument",
                 "an argument of scan", id="argument"),
    pytest.param(decode_request, pack(request("session_open", {"frames": [{_LONG_KEY: 1, "op": "step"}]})),
                 "invalid_argument", "only the keys op and args", id="frame-key"),
    pytest.param(decode_request, pack(request("put", {"tensor": _ONE_F32 | {_LONG_KEY: 1}})), "invalid_argument",
                 "only the keys dtype, shape, data", id="tensor-key"),
    pytest.param(decode_request, pack(request("scan", dict(_ALL_SCAN, x={"handle": "h", _LONG_KEY: 1}))),
                 "invalid_argument", "a handle map with the single key", id="handle-map-key"),
    pytest.param(decode_request, pack(request("model_load", {"config": {}, "weights": {_LONG_KEY: {"dtype": "f8"}}})),
                 "invalid_argument", "a tensor shape", id="tensor-map-name"),
    pytest.param(decode_request, pack(request("model_load", {"config": {_LONG_KEY: {1: 1}}, "weights": {}})),
                 "invalid_argument", "a map with str keys", id="map-argument-key"),
    pytest.param(decode_request, pack(request(_LONG_KEY)), "unknown_op", "one of ping", id="op"),
    pytest.param(decode_request, pack(request("put", {"tensor": _ONE_F32 | {"dtype": _LONG_KEY}})), "unknown_dtype",
                 "one of f32", id="dtype"),
    pytest.param(decode_request, pack(request("session_open", {"frames": [{"op": _LONG_KEY}]})),
                 "invalid_argument", "one of step", id="frame-op"),
    pytest.param(decode_request, pack({"op": "ping", _LONG_KEY: 1}), "invalid_argument", "no other key than 'op'",
                 id="legacy-ping-key"),
    pytest.param(decode_request, pack(legacy_scan() | {_LONG_KEY: 1}), "invalid_argument", "only the keys op",
                 id="legacy-scan-key"),
    pytest.param(decode_request, pack({"op": _LONG_KEY}), "unknown_op", "(legacy ExPhil)", id="legacy-op"),
    pytest.param(decode_reply, pack({"v": 1, "id": 1, "ok": True, "result": {}, _LONG_KEY: 1}), "decode_error",
                 "only the keys v, id", id="reply-key"),
    pytest.param(decode_reply, pack({"v": 1, "id": 1, "ok": True, "result": {_LONG_KEY: {1: 1}}}), "decode_error",
                 "a map with str keys", id="reply-result-key"),
])
def test_a_long_key_or_name_refused_is_told_by_its_size_not_echoed(decode, body, code, expected):
    # A key or name a client chose went into the error whole, often twice: a reply several
    # times the request, past what a reply may carry for a request near the frame limit.
    with pytest.raises(ProtocolError) as info:
        decode(body)
    error = info.value
    reply = b"".join(error.codec.error(error.request_id, error.code, str(error), error.detail))
    assert (error.code, expected in str(error)) == (code, True), str(error)[:300]
    # The bound leaves room for an unknown_op's list of the ops there are (message and detail)
    assert f"{len(_LONG_KEY)} bytes" in str(error) and len(reply) < 1000 + 2 * len(", ".join(OPS))


def test_what_an_op_creates_is_freed_by_ops_there_are_and_both_clients_know_it():
    """A client frees what a request it gave up on made anyway (protocol.schema.FREED_BY): an op
    that creates something and is missing from a client's table leaks it on every timeout (found
    in review: the Python and Elixir tables were kept apart by hand)."""
    from protocol.schema import FREED_BY

    for op, (free_op, key) in FREED_BY.items():
        assert op in OPS and free_op in OPS and key in OPS[free_op], (op, free_op, key)
    import re
    from pathlib import Path

    server_ex = (Path(__file__).parent.parent / "elixir_client/lib/scan_bridge/server.ex").read_text()
    clauses = re.findall(r"defp frees\((.*?)do:\s*\{\"(\w+)\", %\{(\w+):", server_ex, re.S)
    elixir = {op: (free_op, key) for head, free_op, key in clauses for op in re.findall(r'"(\w+)"(?!\s*=>)', head)}
    assert elixir == FREED_BY


@pytest.mark.parametrize("level", [pytest.param(b"\x81\xa1a", id="maps"), pytest.param(b"\x91", id="arrays")])
def test_nesting_that_exhausts_the_decoder_is_a_decode_error_at_every_depth(level):
    # SPEC §3: nesting deep enough to exhaust the decoder is decode_error. The body's decode
    # skips over a value one level down; reading that value then runs out a few levels sooner,
    # and so, found in review, a band of depths the body passed was invalid_argument (in the
    # config) or invalid_request (in args) instead.
    import sys

    codes = {}
    for depth in range(sys.getrecursionlimit() // 2, sys.getrecursionlimit() + 10):
        try:
            decode_request(_CONFIG_ARG + b"\x81\xa1a" + level * depth + b"\x01")
        except ProtocolError as error:
            codes.setdefault(error.code, depth)
        else:
            codes.setdefault("ok", depth)
    assert set(codes) == {"ok", "decode_error"}, codes


def test_a_map_argument_keeps_its_arrays_and_scalars_as_they_came():
    config = {"arch": "mamba2", "sizes": [1, -2.5, None, True, "s", b"\x00\x01", [3, {"k": [4, {}]}], []],
              "ssm_cfg": {"ngroups": 1, "empty": {}}}
    assert decode_request(pack(request("model_load", {"config": config}))).args["config"] == config


@pytest.mark.parametrize("op, args", [
    pytest.param("session_open", {"batch": 1, "dim": 2, "state": 3}, id="session_open"),
    pytest.param("session_restore", {"session": "s-1", "snapshot": "p-1"}, id="session_restore"),
])
def test_a_frame_without_its_op_is_a_missing_argument_of_the_op_holding_it(op, args):
    # SPEC §7: missing_argument adds op; a frame's op key belongs to the op whose frames these are.
    error = decode_error(pack(request(op, dict(args, frames=[{"args": {}}]))))
    assert error.code == "missing_argument"
    assert error.detail | {} == {"field": "args.frames[0].op", "expected": "one of " + ", ".join(FRAME_OPS),
                                 "got": "nothing", "op": op}


def _error_and_peak(body) -> tuple[ProtocolError, int]:
    """The error decoding `body` raises, and the most memory the decode held at once."""
    import tracemalloc

    tracemalloc.start()
    try:
        return decode_error(body), tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


# An array of a million 1-byte items, the argument's last bytes.
_MILLION_NILS = b"\xdd\x00\x0f\x42\x40" + b"\xc0" * 1_000_000


@pytest.mark.parametrize("body, field, got", [
    pytest.param(pack(request("session_open", {}))[:-1] + b"\x82\xa5batch\x01\xa6frames" + _MILLION_NILS,
                 "args.frames", "array of 1000000 items", id="frames"),
    pytest.param(pack(request("ssd_scan", {}))[:-1] + b"\x81\xa8dt_limit" + _MILLION_NILS,
                 "args.dt_limit", "array of 1000000 items", id="dt_limit"),
])
def test_an_array_argument_is_refused_without_holding_an_object_per_item(body, field, got):
    # A hostile body's array of 1-byte items, decoded whole before its first item was looked
    # at, took far more memory than the frame (about 64 bytes an item for frames, 8 for a
    # limits pair): a 256 MiB frame could have the server allocate gigabytes. Both are now
    # refused from their headers.
    error, peak = _error_and_peak(body)
    assert (error.code, error.detail["field"], error.detail["got"]) == ("invalid_argument", field, got)
    assert peak < 2 * len(body)


def _entry(key: bytes, value: bytes) -> bytes:
    return msgpack.packb(key.decode()) + value


def _envelope(*entries: bytes) -> bytes:
    return bytes([0x80 | len(entries)]) + b"".join(entries)


_V, _ID, _PING, _NO_ARGS = _entry(b"v", b"\x01"), _entry(b"id", b"\x01"), _entry(b"op", b"\xa4ping"), _entry(b"args", b"\x80")
_MANY_NILS = "array of 1000000 items"


def test_a_long_key_holding_a_lone_surrogate_is_told_by_its_size():
    """A config.json key may hold a \\udc80 escape: telling it by size raised UnicodeEncodeError,
    internal_error where the config's own error was due (found in review)."""
    assert protocol.shown_key("\udc80" * 50) == "<key of 150 bytes>"


@pytest.mark.parametrize("dt_limit, field, got", [
    pytest.param([0.001, None], "args.dt_limit[1]", "nil", id="nil-for-an-open-side"),
    pytest.param([0.0, "inf"], "args.dt_limit[1]", "str", id="str"),
    pytest.param([math.nan, 0.1], "args.dt_limit[0]", "nan", id="nan"),
    pytest.param([0.1], "args.dt_limit", "array of 1 item", id="one-item"),
])
def test_a_dt_limit_pair_names_its_bad_item(dt_limit, field, got):
    """Every bad pair said only "got array of 2 items", which seems to meet "a pair of numbers"
    (found in review): the item at fault is named, and what it is."""
    error = decode_error(pack(request("ssd_scan", {"dt_limit": dt_limit})))
    assert (error.code, error.detail["field"]) == ("invalid_argument", field), error
    assert got in error.detail["got"], error.detail


@pytest.mark.parametrize("body, code, field, got", [
    pytest.param(_envelope(_V, _entry(b"id", _MILLION_NILS), _PING, _NO_ARGS), "invalid_request", "id", _MANY_NILS,
                 id="id"),
    pytest.param(_envelope(_entry(b"v", _MILLION_NILS), _ID, _PING, _NO_ARGS), "invalid_request", "v", _MANY_NILS,
                 id="v"),
    pytest.param(_envelope(_V, _ID, _entry(b"op", _MILLION_NILS), _NO_ARGS), "invalid_request", "op", _MANY_NILS,
                 id="op"),
    pytest.param(_envelope(_V, _ID, _PING, _NO_ARGS, _entry(b"deadline_us", _MILLION_NILS)), "invalid_request",
                 "deadline_us", _MANY_NILS, id="deadline_us"),
    pytest.param(pack(request("ssd_scan", {}))[:-1] + b"\x81\xa8dt_limit\x92" + _MILLION_NILS + b"\x00",
                 "invalid_argument", "args.dt_limit[0]", _MANY_NILS, id="dt_limit-item"),
    pytest.param(pack(request("put", {}))[:-1] + b"\x81\xa6tensor\x83\xa5dtype\xa3f32\xa5shape\x91" + _MILLION_NILS
                 + b"\xa4data\xc4\x00", "invalid_argument", "args.tensor.shape[0]", _MANY_NILS, id="shape-dim"),
    pytest.param(_envelope(_V, _ID, _PING, _MILLION_NILS + b"\x01"), "invalid_request", "body",
                 f"a non-str key ({_MANY_NILS})", id="body-key"),
    pytest.param(_envelope(_V, _ID, _PING, _entry(b"args", b"\x81" + _MILLION_NILS + b"\x01")), "invalid_request",
                 "args", f"a non-str key ({_MANY_NILS})", id="args-key"),
    # within the config's bound on its bytes
    pytest.param(_CONFIG_ARG + b"\x81\xdd\x00\x03\x0d\x40" + b"\xc0" * 200_000 + b"\x01", "invalid_argument",
                 "args.config", "a non-str key (array of 200000 items)", id="config-key"),
    pytest.param(pack(request("model_load", {}))[:-1] + b"\x81\xa7weights\x81" + _MILLION_NILS
                 + msgpack.packb({"dtype": "u8", "shape": [1], "data": b"\x07"}), "invalid_argument", "args.weights",
                 f"a non-str key ({_MANY_NILS})", id="weights-key"),
])
def test_a_value_refused_for_its_kind_is_not_decoded_first(body, code, field, got):
    # Found in review: an envelope value, a limits pair's item, a shape's dim and a map's key
    # were decoded whole before their kind was looked at, an object for each of an array's
    # items: a 256 MiB frame could have the server allocate gigabytes.
    error, peak = _error_and_peak(body)
    assert (error.code, error.detail["field"], error.detail["got"]) == (code, field, got)
    assert peak < 2 * len(body)


_TINY_STEP = {"op": "step", "args": {name: {"dtype": "f32", "shape": [1, 1, 1], "data": b"\0" * 4}
                                     for name in ("x", "dt", "A", "B", "C")}}
_FRAMES_OF = {
    "session_open": {"batch": 1, "dim": 1, "state": 1},
    "session_restore": {"session": "s", "snapshot": "p"},
}


@pytest.mark.parametrize("op", list(_FRAMES_OF))
def test_frames_at_their_bound_are_decoded(op):
    frames = decode_request(pack(request(op, {**_FRAMES_OF[op], "frames": [_TINY_STEP] * MAX_FRAMES}))).args["frames"]
    assert len(frames) == MAX_FRAMES and {frame.op for frame in frames} == {"step"}


@pytest.mark.parametrize("op", list(_FRAMES_OF))
def test_frames_past_their_bound_are_refused_from_the_arrays_header(op):
    # A million valid tiny steps (177 MiB, within the default frame limit) took the serving
    # thread most of a minute to decode, at 19 times their bytes in objects; a rollback re-runs
    # a few frames, a session reopened elsewhere those since its last checkpoint.
    body = pack(request(op, {**_FRAMES_OF[op], "frames": [_TINY_STEP] * (MAX_FRAMES + 1)}))
    error, peak = _error_and_peak(body)
    assert (error.code, error.request_id, error.detail["field"], error.detail["expected"], error.detail["got"]) == (
        "invalid_argument", 1, "args.frames", f"an array of at most {MAX_FRAMES} frames",
        f"array of {MAX_FRAMES + 1} items")
    assert peak < len(body)


_ENTRIES = 250_000


def _many_entries(n: int, value: bytes, head: bytes = b"", head_entries: int = 0, tail: bytes = b"") -> bytes:
    """A map32 of `head`'s entries, n entries of distinct 6-digit keys each holding `value`, and
    `tail`'s one entry."""
    total = head_entries + n + bool(tail)
    return b"\xdf" + total.to_bytes(4, "big") + head + b"".join(b"\xa6%06d" % i + value for i in range(n)) + tail


_SESSION_OPEN = pack(request("session_open", {}))[:-1] + b"\x82\xa5batch\x01"
_WEIGHTS = pack(request("model_load", {}))[:-1] + b"\x81\xa7weights"
_TINY_TENSOR = msgpack.packb({"dtype": "u8", "shape": [1], "data": b"\x07"})


@pytest.mark.parametrize("build, code, field, got", [
    pytest.param(lambda: _many_entries(_ENTRIES, b"\xc0", b"\xa1v\x01\xa2id\x01\xa2op\xa4ping", 3),
                 "invalid_request", "body", f"map of {_ENTRIES + 3} entries", id="body"),
    pytest.param(lambda: pack(request("step", {}))[:-1] + _many_entries(_ENTRIES, b"\xc0"),
                 "invalid_argument", "args", f"map of {_ENTRIES} entries", id="args"),
    pytest.param(lambda: _SESSION_OPEN + b"\xa6frames\x91" + _many_entries(_ENTRIES, b"\xc0"),
                 "invalid_argument", "args.frames[0]", f"map of {_ENTRIES} entries", id="frame"),
    pytest.param(lambda: _SESSION_OPEN + b"\xa6frames\x91\x82\xa2op\xa4step\xa4args" + _many_entries(_ENTRIES, b"\xc0"),
                 "invalid_argument", "args.frames[0].args", f"map of {_ENTRIES} entries", id="frame-args"),
    pytest.param(lambda: pack(request("put", {}))[:-1] + b"\x81\xa6tensor" + _many_entries(_ENTRIES, b"\xc0"),
                 "invalid_argument", "args.tensor", f"map of {_ENTRIES} entries", id="tensor"),
    pytest.param(lambda: _WEIGHTS + _many_entries(MAX_NAMED_TENSORS, b"\xc0"),
                 "invalid_argument", "args.weights.000000", "nil", id="weights-nil"),
    pytest.param(lambda: _WEIGHTS + _many_entries(MAX_NAMED_TENSORS, b"\x01"),
                 "invalid_argument", "args.weights.000000", "int 1", id="weights-int"),
    pytest.param(lambda: _WEIGHTS + _many_entries(MAX_NAMED_TENSORS - 1, _TINY_TENSOR, tail=b"\xa1z\xc0"),
                 "invalid_argument", "args.weights.z", "nil", id="weights-tensors-then-nil"),
    pytest.param(lambda: _SESSION_OPEN + b"\xa5state" + _many_entries(MAX_NAMED_TENSORS, b"\xc0"),
                 "invalid_argument", "args.state.000000", "nil", id="state-nil"),
])
def test_a_map_of_many_entries_is_refused_without_holding_an_object_per_entry(build, code, field, got):
    # A hostile body's map of a quarter million small entries was decoded into a dict of a key
    # and a Raw an entry, many times the frame's size, before its first key or value was looked
    # at. A map that may hold a few keys is refused from its header; a map of tensors within
    # its bound is stepped over (one copy of it for msgpack's unpacker), its first bad value
    # refused.
    body = build()
    error, peak = _error_and_peak(body)
    assert peak < 2 * len(body)
    assert (error.code, error.detail["field"], error.detail["got"]) == (code, field, got)
    assert error.request_id == (None if field == "body" else 1)


def _config_of(size: int) -> dict:
    """A config whose encoding is exactly `size` bytes (a str pad past 64 KiB: a str32 header)."""
    overhead = len(msgpack.packb({"arch": "mamba", "pad": "x" * 65536})) - 65536
    return {"arch": "mamba", "pad": "x" * (size - overhead)}


def test_a_config_at_its_bound_is_decoded():
    config = _config_of(MAX_MAP_BYTES)
    assert len(msgpack.packb(config)) == MAX_MAP_BYTES
    assert decode_request(_CONFIG_ARG + msgpack.packb(config)).args["config"] == config


def test_a_config_past_its_bound_is_refused_from_its_size():
    # A config of a few MB of 1-byte values cost the serving thread a second and 65 times its
    # bytes in objects; real ones are a few KB. Refused before any of it is decoded.
    body = _CONFIG_ARG + msgpack.packb(_config_of(MAX_MAP_BYTES + 1))
    error, peak = _error_and_peak(body)
    assert (error.code, error.request_id, error.detail["field"], error.detail["expected"], error.detail["got"]) == (
        "invalid_argument", 1, "args.config", f"a map of at most {MAX_MAP_BYTES} bytes",
        f"a map of {MAX_MAP_BYTES + 1} bytes")
    assert peak < len(body)


_TENSOR_MAPS = {
    "weights": (_WEIGHTS, "args.weights"),
    "state": (_SESSION_OPEN + b"\xa5state", "args.state"),
}


@pytest.mark.parametrize("value", [_TINY_TENSOR, msgpack.packb({"handle": "h"})], ids=["tensor", "handle"])
@pytest.mark.parametrize("arg", list(_TENSOR_MAPS))
def test_a_map_of_tensors_at_its_bound_is_decoded(arg, value):
    prefix, field = _TENSOR_MAPS[arg]
    decoded = decode_request(prefix + _many_entries(MAX_NAMED_TENSORS, value)).args[arg]
    assert len(decoded) == MAX_NAMED_TENSORS


@pytest.mark.parametrize("arg", list(_TENSOR_MAPS))
def test_a_map_of_tensors_past_its_bound_is_refused_from_its_header(arg):
    # A model_load of 200,000 valid tiny tensors cost the serving thread over a second and 19
    # times its bytes in objects; a real checkpoint has at most about a thousand tensors.
    prefix, field = _TENSOR_MAPS[arg]
    body = prefix + _many_entries(MAX_NAMED_TENSORS + 1, _TINY_TENSOR)
    error, peak = _error_and_peak(body)
    assert (error.code, error.request_id, error.detail["field"], error.detail["expected"], error.detail["got"]) == (
        "invalid_argument", 1, field, f"a map of at most {MAX_NAMED_TENSORS} tensors",
        f"map of {MAX_NAMED_TENSORS + 1} entries")
    assert peak < len(body)


@pytest.mark.parametrize("multipart", [False, True], ids=["data", "buf"])
def test_a_map_of_many_small_tensors_decodes_as_one_of_a_few(multipart):
    # Stepped over to be checked first (more than a few entries, few bytes each), then read as
    # any map of tensors, a raw buffer's index kept only once the map is read.
    weights = {f"w{i}": tensor_map("u8", (2,), bytes([i, 1])) for i in range(200)}
    buffers = []
    if multipart:
        for name, tensor in weights.items():
            weights[name] = {"dtype": "u8", "shape": [2], "buf": len(buffers)}
            buffers.append(tensor["data"])
    decoded = decode_request(pack(request("model_load", {"weights": weights})), buffers).args["weights"]
    assert list(decoded) == list(weights)
    assert [(t.dtype, t.shape, bytes(t.data)) for t in decoded.values()] == [
        ("u8", (2,), bytes([i, 1])) for i in range(200)]


def _nested(depth: int):
    value = 1
    for _ in range(depth):
        value = [value]
    return value


def test_the_encoder_refuses_what_a_decoder_could_not_read_and_takes_what_it_can():
    """A body nested past the server's decoder is refused before its id is read: the answer (id
    nil, no length) named no request, and the Python client's call waited out its timeout
    (found in review). The encoder stops at MAX_NESTING, which decoders take."""
    from protocol.encode import MAX_NESTING

    # args, config and its entry's list are three containers around the list's own levels.
    deepest = decode_request(memoryview(b"".join(
        encode_request(1, "model_load", {"config": {"a": _nested(MAX_NESTING - 2)}, "weights": {}}))))
    assert deepest.args["config"]["a"] == _nested(MAX_NESTING - 2)
    with pytest.raises(ValueError, match=rf"args.config.a(\[0\])+: expected values nested at most {MAX_NESTING}"):
        encode_request(1, "model_load", {"config": {"a": _nested(MAX_NESTING - 1)}, "weights": {}})


class _RecursingUnpacker(msgpack.fallback.Unpacker):
    """msgpack's pure-Python fallback as releases before 1.2 have it: nesting too deep for it
    raises RecursionError, where the C unpacker raises StackError."""

    def skip(self):
        try:
            return super().skip()
        except msgpack.StackError as exc:
            raise RecursionError("maximum recursion depth exceeded") from exc


@pytest.fixture(params=["c", "pure-python", "pure-python-before-1.2"])
def stepper(request, monkeypatch):
    """msgpack's unpacker as installed, and its pure-Python fallback (where no wheel fits, on
    PyPy, under MSGPACK_PUREPYTHON), whose RecursionError was an internal_error, not a
    decode_error (found in review, with msgpack 1.0.0)."""
    unpacker = {"pure-python": msgpack.fallback.Unpacker, "pure-python-before-1.2": _RecursingUnpacker}
    if request.param in unpacker:
        monkeypatch.setattr(msgpack, "Unpacker", unpacker[request.param])
    return request.param


def test_a_map_of_tensors_nested_past_the_steppers_stack_is_a_decode_error(stepper):
    # As an array's items (below): stepping over a map's entries must end in decode_error.
    from protocol._reader import Reader

    deep = memoryview(_many_entries(100, b"\xc0", b"\xa1a" + b"\x91" * 5000 + b"\xc0", 1))
    with pytest.raises(ProtocolError) as caught:
        Reader().tensors(deep, "args.weights")
    assert (caught.value.code, caught.value.detail["field"]) == ("decode_error", "args.weights")


def test_nested_config_arrays_are_not_copied_once_a_level():
    # Found in review: a config array stepped over by msgpack's unpacker, fed a copy of it at
    # each level, made 800 levels around 20,000 nils cost hundreds of times the body. The peak
    # must not grow with the nesting around the same items.
    import tracemalloc

    def peak_decoding(depth: int) -> int:
        body = _CONFIG_ARG + b"\x81\xa1a" + b"\x91" * depth + msgpack.packb([None] * 20_000)
        tracemalloc.start()
        try:
            inner = decode_request(body).args["config"]["a"]
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        for _ in range(depth):
            (inner,) = inner
        assert inner == [None] * 20_000
        return peak

    assert peak_decoding(800) < 2 * peak_decoding(1)


def test_array_items_and_map_entries_step_over_every_msgpack_type_as_the_decoder_does():
    import msgspec

    from protocol._msgpack import entries, items

    values = [0, 127, -1, -32, 255, 65535, 2**32 - 1, 2**64 - 1, -128, -2**15, -2**31, -2**63, 1.5, None,
              True, False, "", "s" * 31, "s" * 255, "s" * 65536, b"", b"b" * 256, b"b" * 65536, {}, {"k": [1, {"j": []}]},
              list(range(16)), {str(i): i for i in range(16)}, msgpack.ExtType(1, b"x"),
              *(msgpack.ExtType(2, b"y" * n) for n in (2, 4, 8, 16, 3, 256, 65536))]
    # and what a packing of Python values does not give: a float32, an array32
    parts = [msgpack.packb(v, use_bin_type=True) for v in values] + [
        msgpack.packb(1.5, use_single_float=True), b"\xdd\x00\x00\x00\x02\x01\xc0"]
    encoded = b"\xdc" + len(parts).to_bytes(2, "big") + b"".join(parts)
    expected = [bytes(raw) for raw in msgspec.msgpack.Decoder(list[msgspec.Raw]).decode(encoded)]
    assert [bytes(item) for item in items(memoryview(encoded))] == expected == parts
    keys = [msgpack.packb(f"k{i}") for i in range(len(parts))]
    mapped = b"\xde" + len(parts).to_bytes(2, "big") + b"".join(k + part for k, part in zip(keys, parts))
    assert [(bytes(k), bytes(v)) for k, v in entries(memoryview(mapped))] == list(zip(keys, parts))



def test_an_ext_type_in_a_request_or_a_reply_is_refused_naming_where_it_lies():
    """The protocol has no ext types (SPEC §3): a request's config held one as a
    msgspec.msgpack.Ext, and a reply's result handed one to the caller, where the Elixir and C
    codecs refuse them (found in review)."""
    ext = msgpack.ExtType(1, b"\x00")
    body = msgpack.packb({"v": 1, "id": 7, "op": "model_load", "args": {"config": {"a": ext}}})
    with pytest.raises(ProtocolError) as caught:
        protocol.decode_request(body)
    assert (caught.value.code, caught.value.detail["field"]) == ("invalid_argument", "args.config.a")
    assert "ext type" in caught.value.detail["got"]
    reply = msgpack.packb({"v": 1, "id": 7, "ok": True, "result": {"t": ext}, "timing": {}})
    with pytest.raises(protocol.DecodeError, match=r"result\.t: .*ext type"):
        protocol.decode_reply(reply)


def test_an_array_nested_past_the_item_steppers_stack_is_a_decode_error(stepper):
    # The body's decode refuses such nesting first today; were its limit ever deeper than
    # msgpack's unpacker's stack, stepping over the items must still end in decode_error (SPEC
    # §3), never an exception of msgpack's.
    from protocol._reader import Reader

    deep = memoryview(b"\x91" + b"\x91" * 5000 + b"\xc0")
    with pytest.raises(ProtocolError) as caught:
        list(Reader().array(deep, "args.frames", "an array"))
    assert (caught.value.code, caught.value.detail["field"]) == ("decode_error", "args.frames")


def _most_elements(dtype: str) -> int:
    """The most elements of `dtype` a shape may span: 2^63 - 1 bytes' worth."""
    return (2**63 - 1) // DTYPES[dtype][0]


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_a_shape_may_span_up_to_2_63_minus_1_bytes_counting_0_dims_as_1(dtype):
    from protocol._reader import Reader

    most = _most_elements(dtype)
    for shape in [(0, most), (most, 0, 1)]:
        t = tensor_map(dtype, shape, b"")
        assert decode_request(pack(request("put", {"tensor": t}))).args["tensor"].shape == shape
        assert Reader().tensor_data(msgpack_raw(pack(t)), "t").shape == shape  # the careful path too
    for shape in [(0, 2, most // 2 + 1), (most // 2 + 1, 0, 2), (most // 2 + 1, 2)]:
        error = decode_error(pack(request("put", {"tensor": tensor_map(dtype, shape, b"")})))
        assert (error.code, error.detail["field"]) == ("invalid_argument", "args.tensor.shape")
        assert error.detail["got"] == f"{list(shape)}: {2 * (most // 2 + 1) * DTYPES[dtype][0]} bytes"
        assert Reader.valid_tensor(msgpack_raw(pack(tensor_map(dtype, shape, b""))), False) is None


def test_a_buf_tensor_whose_shape_is_too_big_is_refused():
    body = pack(request("put", {"tensor": {"dtype": "f32", "shape": [0, 2**61], "buf": 0}}))
    with pytest.raises(ProtocolError) as info:
        decode_request(body, [b""])
    assert (info.value.code, info.value.detail["field"]) == ("invalid_argument", "args.tensor.shape")


@pytest.mark.parametrize("tensor", [
    pytest.param(tensor_map("f32", (2**62, 4), b""), id="f32-2^62x4"),
    pytest.param(tensor_map("u8", (2**63 - 1,), b"\x01"), id="u8-2^63-1"),
    pytest.param(tensor_map("f64", (2**31, 2**31, 2**2), b""), id="f64-2^64"),
])
def test_the_error_for_a_huge_tensor_keeps_its_detail_in_a_reply(tensor):
    # msgpack ints stop at 2^64 - 1: an error whose byte count passed that could not be sent.
    error = decode_error(pack(request("put", {"tensor": tensor}, request_id=3)))
    reply = decode_reply(b"".join(encode_error(error.request_id, error.code, str(error), error.detail)))
    assert reply.error["detail"] == error.detail and reply.error["detail"]["field"].startswith("args.tensor.")


# -- the typed fast path for tensors agrees with the careful one ------------------------------

@pytest.mark.parametrize("tensor, allow_handle", [
    pytest.param(tensor_map("f16", (3, 1, 5)), True, id="valid"),
    pytest.param({"handle": "h-1"}, True, id="handle"),
    pytest.param({"handle": "h-1"}, False, id="handle-not-allowed"),
    pytest.param(tensor_map("f32", (2,), b"\x01" * 7), True, id="short"),
    pytest.param(tensor_map() | {"shape": [2, None]}, True, id="nil-dim"),
    pytest.param(tensor_map() | {"dtype": None}, True, id="nil-dtype"),
    pytest.param(tensor_map() | {"data": None}, True, id="nil-data"),
    pytest.param({"dtype": "f32", "shape": [1]}, True, id="no-data"),
    pytest.param(tensor_map("u8", [0] * 9, b""), True, id="9d"),
])
def test_fast_tensor_path_only_accepts_what_the_careful_path_accepts(tensor, allow_handle):
    from protocol._reader import Reader

    raw = msgpack_raw(pack(tensor))
    fast = Reader.valid_tensor(raw, allow_handle)
    reader = Reader()
    try:
        careful = reader.checked_tensor(raw, "t", allow_handle)
    except ProtocolError:
        careful = None
    if fast is not None:
        assert careful is not None and _same(fast, careful)


def msgpack_raw(encoded: bytes):
    import msgspec

    return msgspec.msgpack.decode(encoded, type=msgspec.Raw)


def _same(a, b) -> bool:
    if isinstance(a, WireTensor):
        return (a.dtype, a.shape, bytes(a.data)) == (b.dtype, b.shape, bytes(b.data))
    return a == b


# -- ExPhil legacy ----------------------------------------------------------------------------

@pytest.mark.parametrize("batch, seq, hidden, state", [
    pytest.param(1, 1, 1, 1, id="tiny"),
    pytest.param(3, 7, 5, 2, id="odd"),
    pytest.param(2, 60, 33, 16, id="exphil-like"),
])
def test_legacy_scan_dims_form(batch, seq, hidden, state):
    message = legacy_scan(batch, seq, hidden, state)
    body = bytearray(pack(message, str_binaries=True))
    req = decode_request(body)
    assert isinstance(req, LegacyRequest) and req.op == "scan"
    shapes = {"x": (batch, seq, hidden), "dt": (batch, seq, hidden), "A": (hidden, state),
              "B": (batch, seq, state), "C": (batch, seq, state)}
    for name, shape in shapes.items():
        t = req.args[name]
        assert (t.dtype, t.shape, bytes(t.data)) == ("f32", shape, message[name])
        assert np.shares_memory(np.frombuffer(t.data, np.uint8), np.frombuffer(body, np.uint8))
    assert (req.args["dt_min"], req.args["dt_max"]) == (0.001, 0.1)


def test_legacy_scan_shapes_form_accepts_bin_or_str():
    shapes = {"x": [2, 3, 5], "dt": [2, 3, 5], "A": [5, 4], "B": [2, 3, 4], "C": [2, 3, 4]}
    message = {"op": "scan"}
    for name, shape in shapes.items():
        message[name] = random_bytes("f32", shape)
        message[name + "_shape"] = shape
    for str_binaries in (False, True):
        req = decode_request(pack(message, str_binaries))
        assert {k: list(v.shape) for k, v in req.args.items() if k in shapes} == shapes
        assert bytes(req.args["B"].data) == message["B"]


@pytest.mark.parametrize("op", ["ping", "info"])
def test_legacy_ping_and_info(op):
    assert decode_request(pack({"op": op})) == LegacyRequest(op, {})


_INVALID_LEGACY = [
    ("no-op", {"batch": 1}, "invalid_request", "op"),
    ("op-not-str", {"op": 1}, "invalid_request", "op"),
    ("unknown-op", {"op": "step"}, "unknown_op", "op"),
    ("empty-op", {"op": ""}, "unknown_op", "op"),
    ("ping-extra-key", {"op": "ping", "x": 1}, "invalid_argument", "x"),
    # No "id" or "v" among its str keys: legacy, whatever its other key is.
    ("int-key", {"op": "ping", 1: 2}, "invalid_request", "body"),
    ("missing-C", {k: v for k, v in legacy_scan().items() if k != "C"}, "missing_argument", "C"),
    ("unknown-key", dict(legacy_scan(), dt_softplus=True), "invalid_argument", "dt_softplus"),
    ("zero-batch", dict(legacy_scan(), batch=0), "invalid_argument", "batch"),
    ("x-too-big", dict(legacy_scan(), batch=2**61, seq_len=1, hidden=1), "invalid_argument", "x"),
    ("x-short", dict(legacy_scan(), x=random_bytes("f32", (29,))), "tensor_size_mismatch", "x"),
    ("A-not-binary", dict(legacy_scan(), A=[1.0, 2.0]), "invalid_argument", "A"),
    ("bad-shape", {"op": "scan", **{k: b"" for k in ("x", "dt", "A", "B", "C")},
                   **{k + "_shape": [0] for k in ("x", "dt", "A", "B")}, "C_shape": [-1]},
     "invalid_argument", "C_shape[0]"),
    ("shape-too-big", {"op": "scan", **{k: b"" for k in ("x", "dt", "A", "B", "C")},
                       **{k + "_shape": [0] for k in ("x", "dt", "A", "B")}, "C_shape": [0, 2**61]},
     "invalid_argument", "C_shape"),
]


@pytest.mark.parametrize("message, code, field", [pytest.param(*case[1:], id=case[0]) for case in _INVALID_LEGACY])
def test_invalid_legacy_requests_are_flagged_legacy(message, code, field):
    error = decode_error(pack(message, str_binaries=True))
    assert (error.code, error.detail["field"], error.legacy, error.request_id) == (code, field, True, None)
    assert str(error).startswith(field + ":")


def test_legacy_map_with_a_duplicate_key_is_rejected_in_legacy_shape():
    body = b"\x82\xa2op\xa4ping\xa2op\xa4info"
    error = decode_error(body)
    assert (error.code, error.detail["field"], error.legacy) == ("invalid_request", "body", True)


# -- encoders ---------------------------------------------------------------------------------

def _out(dtype, shape):
    return OutTensor(dtype, shape, random_bytes(dtype, shape))


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_reply_round_trip_every_dtype(dtype):
    y, extra = _out(dtype, (3, 5, 7)), _out(dtype, (1,))
    result = {"y": y, "nested": {"t": [extra, 1, -2.5, None, True, "s", b"\x00\x01"]}}
    timing = {"decode_us": 12.5, "server_us": 99}
    reply = decode_reply(b"".join(encode_reply("r-1", result, timing)))
    assert (reply.id, reply.ok, reply.error, reply.timing) == ("r-1", True, None, timing)
    got = reply.result["y"]
    assert (got.dtype, got.shape, bytes(got.data)) == (dtype, (3, 5, 7), bytes(y.data))
    t, *rest = reply.result["nested"]["t"]
    assert bytes(t.data) == bytes(extra.data) and rest == [1, -2.5, None, True, "s", b"\x00\x01"]


def test_reply_keys_in_order_with_timing_last():
    body = b"".join(encode_reply(3, {"pong": True}, {"server_us": 1}))
    assert list(msgpack.unpackb(body)) == ["v", "id", "ok", "result", "timing"]


def test_timing_callable_runs_after_the_result_is_encoded():
    result = {"late": []}

    def timing():
        result["late"].append("added after encoding")
        return {"encode_us": 4}

    reply = msgpack.unpackb(b"".join(encode_reply(1, result, timing)))
    assert reply["result"] == {"late": []} and reply["timing"] == {"encode_us": 4}


@pytest.mark.parametrize("shape", [pytest.param((0, 3), id="0x3"), pytest.param((2, 0, 5), id="2x0x5")])
def test_an_array_with_a_zero_in_its_shape_is_a_tensor_of_no_bytes(shape):
    # memoryview cannot cast such an array to bytes: OutTensor takes it as it is all the same.
    parts = encode_reply(7, {"y": OutTensor("f32", shape, np.zeros(shape, "<f4"))}, {"server_us": 2})
    y = msgpack.unpackb(b"".join(parts))["result"]["y"]
    assert y["shape"] == list(shape) and y["data"] == b""


@pytest.mark.parametrize("nbytes, separate", [
    pytest.param(BIG_PAYLOAD - 4, False, id="below-threshold"),
    pytest.param(BIG_PAYLOAD, True, id="at-threshold"),
    pytest.param(3 * BIG_PAYLOAD + 4, True, id="above"),
])
def test_big_payloads_are_separate_parts_referencing_the_callers_buffer(nbytes, separate):
    array = RNG.standard_normal(nbytes // 4).astype("<f4") + 1
    parts = encode_reply(7, {"y": OutTensor("f32", array.shape, array), "n": 3}, {"server_us": 2})
    views = [p for p in parts if isinstance(p, memoryview)]
    if separate:
        assert len(views) == 1 and np.shares_memory(np.frombuffer(views[0], np.uint8), array)
        assert all(isinstance(p, bytes) for p in parts if p is not views[0])
    else:
        assert views == [] and len(parts) == 1
    assert msgpack.unpackb(b"".join(parts))["result"]["y"]["data"] == array.tobytes()


def test_error_reply_shape():
    parts = encode_error(None, "frame_too_large", "too big", {"length": 9, "limit": 8})
    assert msgpack.unpackb(b"".join(parts)) == {
        "v": 1, "id": None, "ok": False,
        "error": {"code": "frame_too_large", "message": "too big", "detail": {"length": 9, "limit": 8}}}
    with_timing = msgpack.unpackb(b"".join(encode_error(4, "internal_error", "boom", timing=lambda: {"server_us": 3})))
    assert list(with_timing) == ["v", "id", "ok", "error", "timing"] and with_timing["error"]["detail"] == {}
    reply = decode_reply(b"".join(parts))
    assert (reply.ok, reply.result, reply.error["code"]) == (False, None, "frame_too_large")


def test_protocol_error_converts_to_an_error_reply():
    error = decode_error(pack(request("put", {"tensor": tensor_map() | {"dtype": "f8"}}, request_id=11)))
    reply = decode_reply(b"".join(encode_error(error.request_id, error.code, str(error), error.detail)))
    assert (reply.id, reply.error["code"], reply.error["detail"]["field"]) == (11, "unknown_dtype", "args.tensor.dtype")


def test_a_decoded_tensor_can_be_sent_on_unchanged():
    state = _out("f32", (2, 3, 4))
    received = decode_reply(b"".join(encode_reply(1, {"state": state}, {})))
    req = decode_request(b"".join(encode_request(2, "put", {"tensor": received.result["state"]})))
    assert bytes(req.args["tensor"].data) == bytes(state.data) and req.args["tensor"].shape == (2, 3, 4)


def test_request_round_trip_through_the_encoder():
    args = {"x": _out("bf16", (2, 5, 3)), "A": HandleRef("a"), "dt": _out("bf16", (2, 5, 3)),
            "B": _out("bf16", (2, 5, 4)), "C": _out("bf16", (2, 5, 4)), "dt_softplus": True, "layout": "bld"}
    req = decode_request(b"".join(encode_request(2**40, "scan", args)))
    # A map's order carries no meaning (the decoder gives the arguments in the schema's order).
    assert (req.id, req.op, sorted(req.args)) == (2**40, "scan", sorted(args))
    assert bytes(req.args["x"].data) == bytes(args["x"].data) and req.args["A"] == HandleRef("a")


@pytest.mark.parametrize("call, exception, says", [
    pytest.param(lambda: encode_reply(-1, {}, {}), ValueError, "request_id", id="negative-id"),
    pytest.param(lambda: encode_reply(None, {}, {}), ValueError, "request_id", id="nil-id-ok-reply"),
    pytest.param(lambda: encode_reply(1, [], {}), TypeError, "result", id="result-not-dict"),
    pytest.param(lambda: encode_reply(1, {"y": np.zeros(2)}, {}), TypeError, "result.y", id="raw-ndarray"),
    pytest.param(lambda: encode_reply(1, {3: 1}, {}), TypeError, "result", id="int-key"),
    pytest.param(lambda: encode_reply(1, {"n": [2**65]}, {}), ValueError, "result.n[0]", id="int-overflow"),
    pytest.param(lambda: encode_reply(1, {}, {"server_us": "1"}), TypeError, "timing", id="timing-str"),
    pytest.param(lambda: encode_reply(1, {}, lambda: None), TypeError, "timing", id="timing-callable-none"),
    pytest.param(lambda: encode_error(1, "no_such_code", "m"), ValueError, "code", id="unknown-code"),
    pytest.param(lambda: encode_error(1, "internal_error", "m", ["d"]), TypeError, "detail", id="detail-list"),
    pytest.param(lambda: OutTensor("f8", (1,), b"\x00"), ValueError, "dtype", id="out-dtype"),
    pytest.param(lambda: OutTensor("u8", (-1,), b""), ValueError, "shape", id="out-shape"),
    pytest.param(lambda: OutTensor("f32", (0, 2**61), b""), ValueError, "shape", id="out-shape-too-big"),
    pytest.param(lambda: OutTensor("f32", (2,), b"\x00" * 7), ValueError, "7", id="out-size"),
    pytest.param(lambda: OutTensor("f32", (2, 2), np.ones((2, 4), "<f4")[:, ::2]), ValueError, "contiguous",
                 id="out-strided"),
    pytest.param(lambda: OutTensor("f32", (1,), 1.0), TypeError, "buffer", id="out-not-buffer"),
])
def test_encoders_reject_bad_input_saying_what_and_where(call, exception, says):
    with pytest.raises(exception, match=None) as info:
        call()
    assert says in str(info.value)


def test_legacy_replies_match_exphil_patterns():
    y = _out("f32", (2, 7, 3))
    ok = msgpack.unpackb(b"".join(encode_legacy_reply({"status": "ok", "result": y})))
    assert ok == {"status": "ok", "result": bytes(y.data), "shape": [2, 7, 3]}
    ping = msgpack.unpackb(b"".join(encode_legacy_reply({"status": "ok", "message": "pong", "device": "cpu"},
                                                        timing={"server_us": 5})))
    assert ping == {"status": "ok", "message": "pong", "device": "cpu", "timing": {"server_us": 5}}
    error = msgpack.unpackb(b"".join(encode_legacy_reply({"status": "error", "message": "x: bad"})))
    assert error == {"status": "error", "message": "x: bad"}


@pytest.mark.parametrize("reply, exception", [
    pytest.param({"status": "ok", "result": _out("f16", (2,))}, TypeError, id="not-f32"),
    pytest.param({"status": "ok", "result": _out("f32", (2,)), "shape": [1, 2]}, ValueError, id="shape-lies"),
    pytest.param({"status": "fine"}, ValueError, id="bad-status"),
    pytest.param({"status": "error", "message": "m", "code": 3}, ValueError, id="error-extra-key"),
    pytest.param({"status": "error", "message": 3}, ValueError, id="error-message-not-str"),
    pytest.param({"status": "ok", "timing": {}}, ValueError, id="timing-in-reply"),
    pytest.param(["status", "ok"], TypeError, id="not-a-dict"),
])
def test_legacy_reply_rejects_maps_exphil_would_not_match(reply, exception):
    with pytest.raises(exception):
        encode_legacy_reply(reply)


# An ok reply up to its result's value, for result maps as exact bytes.
_REPLY_RESULT = b"\x84\xa1v\x01\xa2id\x01\xa2ok\xc3\xa6result"


@pytest.mark.parametrize("body, field", [
    pytest.param(pack({"v": 1, "id": 1}), "ok", id="no-ok"),
    pytest.param(pack({"v": 1, "id": 1, "ok": True, "result": 3}), "result", id="result-not-map"),
    pytest.param(pack({"v": 1, "id": 1, "ok": False, "result": {}}), "error", id="error-missing"),
    pytest.param(pack({"v": 1, "id": -4, "ok": True, "result": {}}), "id", id="negative-id"),
    pytest.param(pack({"v": 1, "id": 1, "ok": "yes", "result": {}}), "ok", id="ok-not-bool"),
    pytest.param(pack({"v": 1, "id": 1, "ok": True, "result": {}, "extra": 1}), "extra", id="unknown-key"),
    pytest.param(pack({"status": "ok"}), "status", id="legacy-reply"),
    pytest.param(pack({1: 1}), "body", id="int-key"),
    pytest.param(pack({"v": True, "id": 1, "ok": True, "result": {}}), "v", id="v-bool"),
    pytest.param(pack({"v": 1.0, "id": 1, "ok": True, "result": {}}), "v", id="v-float"),
    pytest.param(pack({"v": 1, "id": 1, "ok": True, "result": {"y": tensor_map("f32", (2, 3), b"\0" * 20)}}),
                 "result.y", id="tensor-data-short"),
    pytest.param(pack({"v": 1, "id": 1, "ok": True, "result": {"y": tensor_map("f32", (0, 2**61), b"")}}),
                 "result.y", id="tensor-shape-too-big"),
    pytest.param(pack({"v": 1, "id": 1, "ok": True, "result": {"y": [tensor_map("f32", (2,), b"\0" * 4)]}}),
                 "result.y[0]", id="tensor-in-a-list"),
    # SPEC §3 holds every map to distinct str keys, not just the envelope: a key given twice
    # hid its first value (here a short tensor) from the check, and where both were valid this
    # took the last one, the C client the first.
    pytest.param(_REPLY_RESULT + b"\x82\xa1y" + pack(tensor_map("f32", (2,), b"\0" * 7))
                 + b"\xa1y" + pack(tensor_map("f32", (2,), b"\0" * 8)), "result", id="result-key-twice"),
    pytest.param(_REPLY_RESULT + b"\x81\xa5state\x82\xa1k\x01\xa1k\x02", "result.state",
                 id="nested-key-twice"),
    pytest.param(pack({"v": 1, "id": 1, "ok": True, "result": {"frames": [{1: 2}]}}), "result.frames[0]",
                 id="int-key-in-a-list"),
])
def test_decode_reply_rejects_what_is_not_a_v1_reply(body, field):
    with pytest.raises(protocol.DecodeError) as info:
        decode_reply(body)
    assert info.value.detail["field"] == field
