"""ExPhil legacy format (SPEC.md §9): the requests `ExPhil.Bridge.PyTorchPort` and its Triton
variant send, and the replies their GenServers pattern-match. Served unchanged.

Requests (maps without "id" or "v"; binaries packed by Msgpax as msgpack str, f32, bld):

    {"op": "scan", "batch", "seq_len", "hidden", "state", "x", "dt", "A", "B", "C"}
    {"op": "scan", "x", "dt", "A", "B", "C", "x_shape", "dt_shape", "A_shape", "B_shape", "C_shape"}
    {"op": "ping"}    {"op": "info"}

Replies:

    {"status": "ok", "result": <f32 bin>, "shape": [batch, seq_len, hidden]}
    {"status": "ok", ...extra keys}           (ping, info)
    {"status": "error", "message": str}

ExPhil's math is a plain scan with dt clamped to [0.001, 0.1] (no bias, softplus, D, z;
h0 = 0); `LegacyRequest.args` spells it as v1 scan arguments so the bridge runs one path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import msgspec

from ._msgpack import describe, key_path, shown_key
from ._reader import Reader
from .encode import Packer
from .errors import InvalidArgument, InvalidRequest, MissingArgument, ProtocolError, UnknownOp
from .tensors import OutTensor, WireTensor

LEGACY_OPS = ("scan", "ping", "info")
LEGACY_DT_MIN = 0.001
LEGACY_DT_MAX = 0.1
_TENSORS = ("x", "dt", "A", "B", "C")
_DIMS = ("batch", "seq_len", "hidden", "state")
_SHAPE_KEYS = tuple(name + "_shape" for name in _TENSORS)
_OP_EXPECTED = ("a str naming the operation (a map with neither 'id' nor 'v' is read as a "
                "legacy ExPhil request)")


class LegacyCodec:
    """How legacy requests are answered (protocol.codecs): `{"status": "ok", ...}` or
    `{"status": "error", "message"}`, with no id and no error code (ExPhil tells replies apart
    by order)."""

    name = "legacy"
    ops = LEGACY_OPS
    stats_prefix = "legacy_"

    def reply(self, request, result: dict, timing, buffers: list | None = None) -> list:
        # ExPhil's map patterns ignore the key; its client reads the kernel/bridge split from it.
        return encode_legacy_reply(result, timing=timing)

    def error(self, request_id, code: str, message: str, detail: dict | None = None) -> list:
        # SPEC §7: a legacy error names the request's top-level key; the scan op's own checks
        # name the v1 argument it became ("args.A.shape").
        field = (detail or {}).get("field")
        if isinstance(field, str) and field.startswith("args.") and message.startswith(field):
            message = field[len("args."):] + message[len(field):]
        return encode_legacy_reply({"status": "error", "message": message})


LEGACY = LegacyCodec()


@dataclass(slots=True)
class LegacyRequest:
    """An ExPhil request. For "scan", `args` holds the equivalent v1 scan arguments: x, dt, A,
    B, C as f32 WireTensors (layout bld) and ExPhil's dt_min / dt_max; for "ping" and "info"
    it is empty."""

    op: str
    args: dict
    # Legacy requests come in one frame: no raw buffers, no id to answer with, no deadline.
    multipart: ClassVar = False
    reply_id: ClassVar = None
    deadline_us: ClassVar = None
    codec: ClassVar = LEGACY

    @property
    def stats_op(self) -> str:
        """The op's name in the stats: counted apart from v1's."""
        return self.codec.stats_prefix + self.op


def decode_legacy(top: dict[str, msgspec.Raw]) -> LegacyRequest:
    reader = Reader(legacy=True)
    if "op" not in top:
        reader.fail(InvalidRequest, "op", _OP_EXPECTED, "nothing")
    op = reader.string(top["op"], "op", InvalidRequest, _OP_EXPECTED, allow_empty=True)
    if op not in LEGACY_OPS:
        reader.fail(UnknownOp, "op", "one of " + ", ".join(LEGACY_OPS) + " (legacy ExPhil)",
                    describe(memoryview(top["op"])), known=list(LEGACY_OPS))
    try:
        return _legacy_request(reader, top, op)
    except ProtocolError as exc:
        exc.op = op  # counted as that op's failure, as a v1 request's (decode.py)
        raise


def _legacy_request(reader: Reader, top: dict[str, msgspec.Raw], op: str) -> LegacyRequest:
    if op != "scan":
        for key in top:
            if key != "op":
                reader.fail(InvalidArgument, key_path("", key), f"no other key than 'op' for legacy {op}",
                            f"unknown key {shown_key(key)}")
        return LegacyRequest(op, {})
    shapes = _declared_shapes(reader, top) if "x_shape" in top else _dims_shapes(reader, top)
    args = {}
    for name in _TENSORS:
        data = reader.data(top[name], name)
        reader.check_size(name, "f32", shapes[name], data)
        args[name] = WireTensor("f32", shapes[name], data)
    args["dt_min"] = LEGACY_DT_MIN
    args["dt_max"] = LEGACY_DT_MAX
    return LegacyRequest("scan", args)


def _check_keys(reader: Reader, top: dict, keys: tuple[str, ...], form: str) -> None:
    for key in top:
        if key not in keys:
            reader.fail(InvalidArgument, key_path("", key), f"only the keys {', '.join(keys)} ({form})",
                        f"unknown key {shown_key(key)}")
    for key in keys:
        if key not in top:
            reader.fail(MissingArgument, key, f"the key {key!r} ({form})", "nothing")


def _dims_shapes(reader: Reader, top: dict) -> dict[str, tuple[int, ...]]:
    _check_keys(reader, top, ("op", *_DIMS, *_TENSORS), "legacy scan with batch/seq_len/hidden/state")
    b, l, h, s = (reader.size(top[key], key) for key in _DIMS)
    shapes = {"x": (b, l, h), "dt": (b, l, h), "A": (h, s), "B": (b, l, s), "C": (b, l, s)}
    for name, shape in shapes.items():
        reader.check_extent(name, "f32", shape)
    return shapes


def _declared_shapes(reader: Reader, top: dict) -> dict[str, tuple[int, ...]]:
    _check_keys(reader, top, ("op", *_TENSORS, *_SHAPE_KEYS), "legacy scan with x_shape..C_shape")
    return {name: reader.shape(top[key], key, "f32") for name, key in zip(_TENSORS, _SHAPE_KEYS)}


def encode_legacy_reply(reply: dict, *, timing=None) -> list:
    """An ExPhil reply body as a list of buffers (tensor bytes referenced, not copied).
    `reply` is one of the maps ExPhil's GenServers match:

        {"status": "ok", "result": <f32 OutTensor>}    scan; "shape" is added from the tensor
                                                        (or, if given, must equal its shape)
        {"status": "ok", **extra}                       ping, info (no "result")
        {"status": "error", "message": str}

    `timing` (a dict, or a callable returning one, called last) adds a "timing" key, which
    ExPhil's map patterns ignore.
    """
    if not isinstance(reply, dict):
        raise TypeError(f"reply: expected a dict, got {type(reply).__name__}")
    reply = dict(reply)
    status = reply.get("status")
    if status == "error":
        if set(reply) != {"status", "message"} or not isinstance(reply["message"], str):
            raise ValueError(f'reply: expected {{"status": "error", "message": str}}, got keys {sorted(reply)}')
    elif status != "ok":
        raise ValueError(f'reply["status"]: expected "ok" or "error", got {status!r}')
    elif "result" in reply:
        result = reply["result"]
        if not isinstance(result, OutTensor) or result.dtype != "f32":
            raise TypeError(f'reply["result"]: expected an f32 OutTensor, got {result!r}')
        shape = list(result.shape)
        if reply.setdefault("shape", shape) != shape:
            raise ValueError(f'reply["shape"]: expected the result\'s shape {shape}, got {reply["shape"]!r}')
        reply["result"] = result.data  # a bare f32 binary, not a tensor map
    if "timing" in reply:
        raise ValueError('reply: "timing" is given as the timing argument')
    packer = Packer()
    packer.map_header(len(reply) + (timing is not None))
    for key, value in reply.items():
        packer.value(key, "reply key")
        packer.value(value, f"reply[{key!r}]")
    if timing is not None:
        packer.value("timing", "reply key")
        packer.timing(timing)
    return packer.finish()
