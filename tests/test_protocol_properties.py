"""protocol property tests: whatever bytes arrive, the decoders answer with a value or a
ProtocolError, never anything else; framing is independent of how the stream is cut."""

from __future__ import annotations

import math
from unittest import mock

import msgpack
import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocol import (ALIASES, DTYPES, OPS, FrameAssembler, FrameTooLarge, HandleRef, ProtocolError, TruncatedFrame,
                      WireTensor, decode_reply, decode_request, encode_frame)
from protocol._reader import Reader, buffer_views, decode_top_map
from protocol.decode import _CHECKED_ONLY_KINDS, _decode_v1_checked, _decode_valid_v1

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
        careful = reader.checked_tensor(raw, "t", allow_handle)
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


@st.composite
def valid_tensor_maps(draw):
    dtype = draw(st.sampled_from(list(DTYPES)))
    shape = draw(st.lists(st.integers(0, 3), max_size=3))
    return {"dtype": dtype, "shape": shape, "data": bytes(math.prod(shape) * DTYPES[dtype][0])}


handle_maps = st.fixed_dictionaries({"handle": st.text(min_size=1, max_size=3)})
# Per schema kind: values it accepts, and near misses of them.
KIND_VALID = {
    "tensor": valid_tensor_maps() | handle_maps,
    "tensor_data": valid_tensor_maps(),
    "bool": st.booleans(),
    "number": st.floats(allow_nan=False, allow_infinity=False) | st.integers(-2**63, 2**64 - 1),
    "str": st.text(min_size=1, max_size=3),
    "size": st.integers(1, 2**63 - 1),
    "layout": st.sampled_from(["bld", "bdl"]),
    "limits": st.tuples(st.floats(allow_nan=False) | st.integers(-2**63, 2**63 - 1),
                        st.floats(allow_nan=False)).map(list),
    "kind": st.sampled_from(["mamba", "ssd"]),
    "output": st.sampled_from(["logits", "hidden"]),
    "weights_dtype": st.sampled_from(["f32", "bf16", "f16"]),
    "map": st.dictionaries(st.text(max_size=4), scalars, max_size=3),
    "tensors": st.dictionaries(st.text(max_size=4), valid_tensor_maps() | handle_maps, max_size=3),
    "size_or_tensors": st.integers(1, 2**63 - 1) | st.dictionaries(st.text(max_size=4), valid_tensor_maps(), max_size=2),
    "request_id": st.integers(0, 2**64 - 1) | st.text(min_size=1, max_size=3),
    "frames": st.lists(st.fixed_dictionaries({"op": st.just("model_step"),
                                              "args": st.fixed_dictionaries({"tokens": valid_tensor_maps()})}),
                       max_size=2),
}
KIND_NEAR_MISS = {
    "tensor": tensor_maps() | st.fixed_dictionaries({"handle": st.just("")}) | st.none(),
    "tensor_data": tensor_maps() | handle_maps | st.none(),
    "bool": st.none() | st.integers(0, 1),
    "number": st.sampled_from([math.nan, math.inf, -math.inf]) | st.booleans() | st.none() | st.text(max_size=2),
    "str": st.just("") | st.binary(max_size=2) | st.none(),
    "size": st.integers(-1, 0) | st.integers(2**63, 2**64 - 1) | st.floats(0, 4) | st.none(),
    "layout": st.sampled_from(["bl", ""]) | st.none(),
    "limits": (st.lists(st.floats(), max_size=3) | st.tuples(st.booleans(), st.floats()).map(list)
               | st.floats() | st.none()),
    "kind": st.sampled_from(["mamba2", "", "SSD"]) | st.none(),
    "output": st.sampled_from(["logit", "", "Hidden"]) | st.none(),
    "weights_dtype": st.sampled_from(["f64", "i32", ""]) | st.none(),
    "map": st.lists(scalars, max_size=2) | st.text(max_size=2) | st.none(),
    "tensors": st.dictionaries(st.text(max_size=4), tensor_maps(), min_size=1, max_size=2) | st.none(),
    "size_or_tensors": st.integers(-1, 0) | st.text(max_size=2) | st.none(),
    "request_id": st.just("") | st.integers(-2**63, -1) | st.booleans() | st.floats(0, 4) | st.none(),
    "frames": (st.lists(st.fixed_dictionaries({"op": st.sampled_from(["ping", "session_open", ""]),
                                               "args": st.just({})}), min_size=1, max_size=2)
               | st.fixed_dictionaries({"op": st.just("step")}) | st.none()),
}


class Packed(bytes):
    """A value that is msgpack already (a map packed on its own, keys twice and all)."""


def _packed_map(pairs: list, packer: msgpack.Packer | None = None) -> Packed:
    """A msgpack map of `pairs` in order, a key given twice kept twice."""
    packer = packer or msgpack.Packer()
    return Packed(packer.pack_map_header(len(pairs)) + b"".join(
        packer.pack(k) + (v if isinstance(v, Packed) else packer.pack(v)) for k, v in pairs))


def _request_top(head: list, args: list) -> dict:
    """The decoded top-level map of a request with envelope `head` and argument pairs `args`."""
    return decode_top_map(_packed_map([*head, ("args", _packed_map(args))]))


def fast_op(top) -> str:
    return msgpack.unpackb(bytes(top["op"]))


@st.composite
def op_requests(draw):
    """A request whose op and argument names mostly come from the schema, with values that
    mostly fit their kinds: requests valid and invalid in every way the fast path must tell.
    The argument map is packed by hand so that a key can come twice. Returns (body, buffers)."""
    op = draw(st.sampled_from([*OPS, "scan", "step", "scan", "step"]))  # those with most arguments, more often
    spec = OPS[op]
    names = draw(st.lists(st.sampled_from([*spec, *ALIASES, "extra"]) if spec else st.just("extra"),
                          max_size=len(spec) + 1, unique=True))
    if draw(st.booleans()):  # every argument, so that many are valid
        names = list(spec)
    # At most one value is a near miss, so that the rest of the request does not already fail it.
    miss = draw(st.integers(0, 2 * len(names)))
    pairs = []
    for i, name in enumerate(names):
        arg = spec.get(ALIASES.get(name, name))
        if arg is None:
            pairs.append((name, draw(values)))
        else:
            pairs.append((name, draw((KIND_NEAR_MISS if i == miss else KIND_VALID)[arg.kind])))
    if pairs and not draw(st.integers(0, 7)):
        pairs.append(pairs[0])
    # Now and then one tensor's data comes as a raw buffer (multipart), and a buffer is left
    # over or named out of range.
    buffers = []
    # (Tensors with bytes as data: an unknown argument's arbitrary map may have those keys too.)
    with_data = [i for i, (_, v) in enumerate(pairs)
                 if isinstance(v, dict) and {"dtype", "shape", "data"} <= set(v) and isinstance(v["data"], bytes)]
    if with_data and draw(st.booleans()):
        i = draw(st.sampled_from(with_data))
        name, tensor = pairs[i]
        pairs[i] = (name, {"dtype": tensor["dtype"], "shape": tensor["shape"], "buf": len(buffers)})
        buffers.append(tensor["data"])
        if not draw(st.integers(0, 7)):
            pairs[i][1]["buf"] = len(buffers)
    if not draw(st.integers(0, 7)):
        buffers.append(b"stray")
    packer = msgpack.Packer(use_bin_type=draw(st.booleans()))
    args = _packed_map(pairs, packer)
    # At most one envelope field is spoiled, so that each of their checks meets its own.
    # Half the requests keep their envelope whole, so that their arguments' near misses get tries.
    spoiled = draw(st.sampled_from([None] * 6 + ["v", "id", "op", "no op", "no id", "extra key", "deadline"]))
    envelope = {"v": draw(st.sampled_from([0, 2, 1.0, None])) if spoiled == "v" else 1,
                "id": draw(st.sampled_from([-1, "", True, 1.5]) if spoiled == "id"
                           else st.integers(0, 9) | st.text(min_size=1)),
                "op": draw(st.sampled_from(["scna", "", 3])) if spoiled == "op" else op}
    if spoiled != "v" and draw(st.booleans()):
        del envelope["v"]
    if spoiled == "no op":
        del envelope["op"]
    if spoiled == "no id":
        del envelope["id"]
    if spoiled == "extra key":
        envelope["idd"] = 1
    if spoiled == "deadline":
        envelope["deadline_us"] = draw(st.sampled_from([-1, 1.5, "10", True, [1]]))
    elif draw(st.booleans()):
        envelope["deadline_us"] = draw(st.integers(0, 2**64 - 1) | st.none())
    return _packed_map([*envelope.items(), ("args", args)], packer), buffers


def arg_key(value):
    if isinstance(value, WireTensor):
        return ("tensor", value.dtype, value.shape, bytes(value.data))
    return (type(value).__name__, value)


def test_whole_request_path_accepts_only_what_the_checks_accept():
    """The one-typed-decode path for valid requests: whatever it accepts, the argument-by-argument
    checks accept identically; anything they reject, it leaves to them (None). It must also take
    all of what they accept but an alias key (the one valid input it hands on by design): a fast
    path that gave up would pass the rest vacuously."""
    accepted = {"checks": 0, "fast": 0}

    @settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(op_requests())
    def check(request):
        body, buffers = request
        try:
            top = decode_top_map(body)
        except ProtocolError:
            return
        fast = _decode_valid_v1(top, buffer_views(buffers))
        try:
            # The checks try each tensor's fast path first: without it they stand alone.
            with mock.patch.object(Reader, "valid_tensor", staticmethod(lambda *args: None)):
                careful = _decode_v1_checked(top, buffer_views(buffers))
        except ProtocolError:
            assert fast is None
            return
        accepted["checks"] += 1
        if fast is None:
            # keys only: a tensor's data may be a str that is not UTF-8, which the checks take as bytes
            names = msgspec.msgpack.decode(top["args"], type=dict[str, msgspec.Raw])
            # Only an alias, or a kind no msgspec constraint expresses, leaves a valid request to the checks.
            checked_only = {name for name, arg in OPS[fast_op(top)].items() if arg.kind in _CHECKED_ONLY_KINDS}
            assert any(name in ALIASES or name in checked_only for name in names), \
                f"a valid request without an alias left to the checks: {names}"
            return
        accepted["fast"] += 1
        assert ((fast.id, fast.op, fast.multipart, fast.deadline_us)
                == (careful.id, careful.op, careful.multipart, careful.deadline_us))
        assert {k: arg_key(v) for k, v in fast.args.items()} == {k: arg_key(v) for k, v in careful.args.items()}

    check()
    assert accepted["fast"] > 0, accepted


_F32 = {"dtype": "f32", "shape": [1, 2], "data": bytes(8)}
_STEP_ARGS = [("session", "s"), ("x", _F32), ("dt", _F32), ("A", {"handle": "a"}), ("B", _F32), ("C", _F32),
              ("dt_min", 0.001)]


@pytest.mark.parametrize("spoil, field", [
    pytest.param(("dt_min", math.nan), "args.dt_min", id="number-nan"),
    pytest.param(("dt_min", math.inf), "args.dt_min", id="number-inf"),
    pytest.param(("dt_min", -math.inf), "args.dt_min", id="number--inf"),
    pytest.param(("dt_min", True), "args.dt_min", id="number-bool"),
    pytest.param(("session", ""), "args.session", id="str-empty"),
    pytest.param(("dt_softplus", 1), "args.dt_softplus", id="bool-int"),
    pytest.param(("x", {"dtype": "f32", "shape": [1, 3], "data": bytes(8)}), "args.x.data", id="tensor-size"),
    pytest.param(("x", None), "args.x", id="required-nil"),
    pytest.param(("A", {"handle": ""}), "args.A.handle", id="handle-empty"),
    pytest.param(("delta", _F32), "args.delta", id="alias-beside-name"),
    pytest.param(("extra", 1), "args.extra", id="unknown-argument"),
])
def test_whole_request_path_leaves_each_near_miss_to_the_checks(spoil, field):
    """One spoiled argument of an otherwise valid step: deterministic cases beside the property
    test, each a check of the fast path, the careful one naming the argument."""
    name, value = spoil
    args = [(k, value if k == name else v) for k, v in _STEP_ARGS]
    if name not in dict(args):
        args.append((name, value))
    assert _decode_valid_v1(_request_top([("v", 1), ("id", 5), ("op", "step")], _STEP_ARGS), ()) is not None
    top = _request_top([("v", 1), ("id", 5), ("op", "step")], args)
    assert _decode_valid_v1(top, ()) is None
    with pytest.raises(ProtocolError) as exc:
        _decode_v1_checked(top, ())
    assert exc.value.detail["field"] == field


_SSD_ARGS = [("x", _F32), ("dt", _F32), ("A", _F32), ("B", _F32), ("C", _F32), ("chunk_size", 2)]
_SCAN_ARGS = [("x", _F32), ("dt", _F32), ("A", _F32), ("B", _F32), ("C", _F32), ("layout", "bld")]
_PUT_ARGS = [("tensor", {"dtype": "u8", "shape": [3], "buf": 0})]
# Each op's unspoiled request (envelope, arguments, raw buffers), which the fast path takes.
_VALID = {"ssd_scan": ([("v", 1), ("id", 5), ("op", "ssd_scan")], _SSD_ARGS, ()),
          "step": ([("v", 1), ("id", 5), ("op", "step")], _STEP_ARGS, ()),
          "scan": ([("id", 5), ("op", "scan")], _SCAN_ARGS, ()),
          "put": ([("id", 5), ("op", "put")], _PUT_ARGS, (b"abc",))}


@pytest.mark.parametrize("valid, head, args, buffers, field", [
    pytest.param("ssd_scan", [("v", 2), ("id", 5), ("op", "ssd_scan")], None, (), "v", id="version"),
    pytest.param("ssd_scan", [("v", 1), ("id", -1), ("op", "ssd_scan")], None, (), "id", id="id-negative"),
    pytest.param("ssd_scan", [("v", 1), ("id", True), ("op", "ssd_scan")], None, (), "id", id="id-bool"),
    pytest.param("ssd_scan", [("v", 1), ("id", ""), ("op", "ssd_scan")], None, (), "id", id="id-empty"),
    pytest.param("ssd_scan", [("v", 1), ("id", 5), ("op", "ssd_scn")], None, (), "op", id="op-unknown"),
    pytest.param("ssd_scan", [("v", 1), ("op", "ssd_scan")], None, (), "id", id="id-missing"),
    pytest.param("ssd_scan", [("id", 5), ("op", "ssd_scan"), ("x", 1)], None, (), "x",
                 id="envelope-extra-key"),
    pytest.param("ssd_scan", None, [*_SSD_ARGS[:-1], ("chunk_size", 0)], (), "args.chunk_size", id="size-zero"),
    pytest.param("ssd_scan", None, [*_SSD_ARGS[:-1], ("chunk_size", 2**63)], (), "args.chunk_size",
                 id="size-too-big"),
    pytest.param("ssd_scan", None, [*_SSD_ARGS, ("chunk_size", 4)], (), "args", id="key-twice"),
    pytest.param("step", None, [(k, v) for k, v in _STEP_ARGS if k != "x"], (), "args.x", id="required-missing"),
    pytest.param("scan", None, [*_SCAN_ARGS[:-1], ("layout", "bl")], (), "args.layout", id="layout"),
    pytest.param("put", None, [("tensor", {"handle": "h"})], (), "args.tensor", id="put-a-handle"),
    pytest.param("put", None, [("tensor", {"dtype": "u8", "shape": [3], "buf": 1})], (b"abc",), "args.tensor.buf",
                 id="buf-out-of-range"),
    pytest.param("put", None, _PUT_ARGS, (b"abc", b"x"), "buffers[1]", id="buf-stray"),
])
def test_whole_request_path_leaves_each_bad_envelope_or_map_to_the_checks(valid, head, args, buffers, field):
    """One spoiled envelope field, argument map or buffer list of a request the fast path takes
    unspoiled (`valid`: head or args None keep the valid one's), each a check of the fast path,
    the careful one naming what it found."""
    valid_head, valid_args, valid_buffers = _VALID[valid]
    assert _decode_valid_v1(_request_top(valid_head, valid_args), buffer_views(valid_buffers)) is not None
    top = _request_top(valid_head if head is None else head, valid_args if args is None else args)
    assert _decode_valid_v1(top, buffer_views(buffers)) is None
    with pytest.raises(ProtocolError) as exc:
        _decode_v1_checked(top, buffer_views(buffers))
    assert exc.value.detail["field"] == field


def test_whole_request_path_takes_the_requests_clients_send():
    """Not a path that never fires: a step with every option, a scan with a handle and a
    multipart put all go through it."""
    tensor = {"dtype": "f32", "shape": [1, 2], "data": bytes(8)}
    bodies = [
        ({"v": 1, "id": 3, "op": "step", "args": {
            "session": "s", "x": tensor, "dt": tensor, "A": {"handle": "a"}, "B": tensor, "C": tensor,
            "D": tensor, "z": tensor, "dt_bias": tensor, "dt_softplus": True, "dt_min": 0, "dt_max": 0.5}}, ()),
        ({"id": "r", "op": "scan", "args": {"x": tensor, "dt": tensor, "A": {"handle": "a"}, "B": tensor,
                                             "C": tensor, "layout": "bdl", "return_state": False}}, ()),
        ({"id": 4, "op": "put", "args": {"tensor": {"dtype": "u8", "shape": [3], "buf": 0}}}, (b"abc",)),
    ]
    for message, buffers in bodies:
        top = decode_top_map(msgpack.packb(message))
        fast = _decode_valid_v1(top, buffer_views(buffers))
        assert fast is not None, message["op"]
        careful = _decode_v1_checked(top, buffer_views(buffers))
        assert {k: arg_key(v) for k, v in fast.args.items()} == {k: arg_key(v) for k, v in careful.args.items()}


@SETTINGS
@given(st.lists(st.binary(max_size=300), max_size=6), st.lists(st.integers(0, 2000), max_size=8),
       st.integers(0, 200))
def test_framing_does_not_depend_on_how_the_stream_is_cut(bodies, cuts, limit):
    data = b"".join(encode_frame(b) for b in bodies)
    decoder = FrameAssembler(max_frame_size=limit)
    events, start = [], 0
    for cut in sorted(c for c in cuts if c <= len(data)) + [len(data)]:
        events += decoder.feed(data[start:cut])
        start = cut
    assert decoder.eof() is None
    expected = [bytes(b) if len(b) <= limit else FrameTooLarge(len(b), limit) for b in bodies]
    assert [bytes(e[0]) if not isinstance(e, FrameTooLarge) else e for e in events] == expected


@SETTINGS
@given(st.binary(max_size=300), st.lists(st.integers(1, 50), min_size=1, max_size=5))
def test_framing_never_fails_on_junk(junk, reads):
    decoder = FrameAssembler(max_frame_size=64)
    pos, i = 0, 0
    while pos < len(junk):
        space = decoder.space()
        n = min(len(space), len(junk) - pos, reads[i % len(reads)])
        space[:n] = junk[pos:pos + n]
        pos, i = pos + n, i + 1
        event = decoder.advance(n)
        if event is not None and not isinstance(event, FrameTooLarge):
            body, release = event
            assert isinstance(body, memoryview) and release is None
            only_protocol_errors(decode_request, body)
    truncated = decoder.eof()
    assert truncated is None or isinstance(truncated, TruncatedFrame)


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
