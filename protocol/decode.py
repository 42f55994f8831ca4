"""Request decoding: a frame body -> `Request` (v1) or `LegacyRequest` (ExPhil); and, for
Python clients, a reply body -> `Reply`.

Nothing is copied: tensor data comes back as views into the body, whose header (bin or str)
is read in `_msgpack`, or, in a multipart message (ZeroMQ), as views of the raw buffers that
followed the body. Everything is checked before the caller allocates anything; failures
raise `ProtocolError` subclasses that carry the wire error code.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Annotated, ClassVar, Literal, NoReturn, Union

import msgspec

from ._msgpack import ANY_DECODER, DECODE_FAILURES, MAP_DECODER, count, describe, key_path, kind, shown_key
from ._reader import _ARRAY_DECODER, Reader, buffer_views, decode_top_map, more_entries
from .codecs import V1
from .errors import (DecodeError, ProtocolError, InvalidArgument, InvalidRequest, MissingArgument, UnknownOp,
                     UnsupportedVersion, ValidationError)
from .legacy import LegacyRequest, decode_legacy
from .schema import (ALIASES, FRAME_ARGS, FRAME_OPS, KIND_EXPECTED, LAYOUTS, MAX_FRAMES, OPS, OUTPUTS,
                     PROTOCOL_VERSION, SESSION_KINDS, SUPPORTED_VERSIONS, WEIGHTS_DTYPES, Arg, valid_request_id)
from .tensors import MAX_DIM

_ENVELOPE_KEYS = frozenset(("v", "id", "op", "args", "deadline_us"))
# Every valid envelope value is one of these: anything else (an array of a million items, say)
# is refused at its header, not decoded, and the checked path names it.
_ENVELOPE_DECODER = msgspec.msgpack.Decoder(Union[int, str, None])
_ID_EXPECTED = KIND_EXPECTED["request_id"]
# Schema kind -> the Reader method that checks a value of that kind.
_CHECKS = {"tensor": Reader.tensor, "tensor_data": Reader.tensor_data, "bool": Reader.boolean,
           "number": Reader.number, "str": Reader.string, "size": Reader.size,
           "layout": Reader.layout, "limits": Reader.limits, "kind": Reader.session_kind,
           "output": Reader.output, "weights_dtype": Reader.weights_dtype, "map": Reader.any_map,
           "tensors": Reader.tensors, "size_or_tensors": Reader.size_or_tensors,
           "request_id": Reader.request_ref}


@dataclass(slots=True)
class Request:
    """A v1 request. `args` maps canonical argument names (aliases resolved) to checked values:
    WireTensor / HandleRef for tensors, bool, float, str, int. Optional arguments that were
    absent (or nil) are not in `args`. `multipart`: the request came with raw buffers (its
    tensors refer to them by index), so its reply may carry its tensors the same way.
    `deadline_us`: its budget from when its frame was complete, or None (SPEC §4)."""

    id: int | str
    op: str
    args: dict
    version: int = PROTOCOL_VERSION
    multipart: bool = False
    deadline_us: int | None = None

    # How this request is answered (protocol.codecs).
    codec: ClassVar = V1

    @property
    def reply_id(self) -> int | str:
        """The id its replies carry."""
        return self.id

    @property
    def stats_op(self) -> str:
        """The op's name in the stats (a legacy request's are counted apart)."""
        return self.codec.stats_prefix + self.op


def decode_request(body, buffers=()) -> Request | LegacyRequest:
    """Decode one frame body. A map with an "id" or "v" key is v1; any other map is a legacy
    ExPhil request. Raises a `ProtocolError` subclass on anything else.

    `buffers`: the raw buffers that followed the body in a multipart message (ZeroMQ), which
    tensors name as `{"dtype", "shape", "buf": i}`; every one must be named."""
    top = decode_top_map(body)
    views = buffer_views(buffers)
    if "id" in top or "v" in top:
        return _decode_v1(top, views)
    if views:
        raise InvalidRequest("buffers", "no raw buffers (a legacy ExPhil request has none)",
                             f"{len(views)} raw buffers", legacy=True)
    return decode_legacy(top)


def _decode_v1(top: dict[str, msgspec.Raw], buffers: tuple[memoryview, ...]) -> Request:
    request = _decode_valid_v1(top, buffers)
    return request if request is not None else _decode_v1_checked(top, buffers)


# -- valid requests, in one typed decode of their arguments ----------------------------------
# Nearly every request is valid as it comes. Decoding each one's argument map as one typed
# struct (per op, from the schema, each kind's rule a msgspec constraint) is cheaper than
# checking it one argument at a time (docs/performance.md, "protocol typed decode"); whatever
# that finds amiss -- or cannot tell, such as an alias or a key given twice -- sends the request
# down the argument-by-argument path below, which names what is wrong. So this path only ever
# accepts, and accepts exactly what that one does (tests/test_protocol_properties.py holds the
# two to that). Tensor arguments stay Raw: Reader.valid_tensor checks each, its key count included.

_TENSOR_KINDS = ("tensor", "tensor_data")
# Each scalar kind of schema.KIND_EXPECTED as a msgspec type: the constraints reject what the
# Reader's checks reject (a float field takes ints as floats, and no nan, inf or bool).
_SCALAR_TYPES = {
    "bool": bool,
    "number": Annotated[float, msgspec.Meta(ge=-sys.float_info.max, le=sys.float_info.max)],
    "str": Annotated[str, msgspec.Meta(min_length=1)],
    "size": Annotated[int, msgspec.Meta(gt=0, le=MAX_DIM)],
    "layout": Literal[LAYOUTS],
    "kind": Literal[SESSION_KINDS],
    "output": Literal[OUTPUTS],
    "weights_dtype": Literal[WEIGHTS_DTYPES],
}
# Kinds no msgspec constraint expresses (a pair of possibly infinite numbers, not NaN; maps of
# any values or of tensors): a request giving one is checked argument by argument.
_CHECKED_ONLY_KINDS = ("limits", "map", "tensors", "size_or_tensors", "request_id", "frames")


@dataclass(frozen=True, slots=True)
class _ArgPlan:
    name: str
    required: bool
    tensor: bool
    allow_handle: bool
    checked_only: bool


def _args_decoder(op: str, spec: dict[str, Arg]) -> msgspec.msgpack.Decoder:
    # An absent tensor is an empty Raw, an absent scalar UNSET; nil decodes as nil / None.
    fields = [(name, msgspec.Raw, msgspec.Raw(b"")) if arg.kind in _TENSOR_KINDS + _CHECKED_ONLY_KINDS
              else (name, Union[_SCALAR_TYPES[arg.kind], None, msgspec.UnsetType], msgspec.UNSET)
              for name, arg in spec.items()]
    struct = msgspec.defstruct(f"_{op}_args", fields, forbid_unknown_fields=True)
    return msgspec.msgpack.Decoder(struct)


_ARGS_DECODERS = {
    op: (_args_decoder(op, spec),
         tuple(_ArgPlan(name, arg.required, arg.kind in _TENSOR_KINDS, arg.kind == "tensor",
                        arg.kind in _CHECKED_ONLY_KINDS)
               for name, arg in spec.items()))
    for op, spec in OPS.items()}


def _decode_valid_v1(top: dict[str, msgspec.Raw], buffers: tuple[memoryview, ...]) -> Request | None:
    """The request when it is valid and says so plainly; None to have it checked argument by
    argument."""
    if "args" not in top or "op" not in top or "id" not in top or not _ENVELOPE_KEYS.issuperset(top):
        return None
    try:
        request_id = _ENVELOPE_DECODER.decode(top["id"])
        version = _ENVELOPE_DECODER.decode(top["v"]) if "v" in top else PROTOCOL_VERSION
        op = _ENVELOPE_DECODER.decode(top["op"])
        deadline_us = _ENVELOPE_DECODER.decode(top["deadline_us"]) if "deadline_us" in top else None
    except DECODE_FAILURES:
        return None
    if not valid_request_id(request_id) or type(version) is not int or version not in SUPPORTED_VERSIONS:
        return None
    if deadline_us is not None and not (type(deadline_us) is int and deadline_us >= 0):
        return None
    entry = _ARGS_DECODERS.get(op) if type(op) is str else None
    if entry is None:
        return None
    decoder, plans = entry
    try:
        decoded = decoder.decode(top["args"])
    except (*DECODE_FAILURES, msgspec.ValidationError):
        return None
    args, given, used = {}, 0, set()
    for plan in plans:
        value = getattr(decoded, plan.name)
        if plan.checked_only:
            if memoryview(value).nbytes or plan.required:
                return None
            continue
        if plan.tensor:
            encoded = memoryview(value)
            if not encoded.nbytes:
                value = msgspec.UNSET
            elif encoded[0] == 0xC0:
                value = None
            else:
                value = Reader.valid_tensor(value, plan.allow_handle, buffers, used)
                if value is None:
                    return None
        if value is msgspec.UNSET:
            if plan.required:
                return None
            continue
        given += 1
        if value is None:
            if plan.required:
                return None
            continue
        args[plan.name] = value
    # A key given twice decodes as one: only the map's own count tells.
    if given != count(memoryview(top["args"])) or len(used) != len(buffers):
        return None
    return Request(request_id, op, args, multipart=bool(buffers), deadline_us=deadline_us)


# -- any request, one argument at a time ------------------------------------------------------

def _decode_v1_checked(top: dict[str, msgspec.Raw], buffers: tuple[memoryview, ...]) -> Request:
    reader = Reader(buffers=buffers)
    reader.request_id = _request_id(reader, top.get("id"))
    if "v" in top:
        _check_version(reader, top["v"])
    for key in top:
        if key not in _ENVELOPE_KEYS:
            reader.fail(InvalidRequest, key_path("", key), "only the envelope keys v, id, op, args, deadline_us",
                        f"unknown key {shown_key(key)}")
    deadline_us = reader.deadline(top["deadline_us"]) if "deadline_us" in top else None
    if "op" not in top:
        reader.fail(InvalidRequest, "op", "a str naming the operation", "nothing")
    op = reader.string(top["op"], "op", InvalidRequest, "a str naming the operation", allow_empty=True)
    spec = OPS.get(op)
    if spec is None:
        reader.fail(UnknownOp, "op", "one of " + ", ".join(OPS), describe(memoryview(top["op"])), known=list(OPS))
    try:
        entries = _args_map(reader, top["args"], "args", op, spec, _MOST_ARGS[op], InvalidRequest) if "args" in top else {}
        args = _read_args(reader, op, spec, entries)
        reader.check_buffers_used()
    except ProtocolError as exc:
        exc.op = op  # counted as that op's failure (one of OPS: a bounded set of names)
        raise
    return Request(reader.request_id, op, args, multipart=bool(buffers), deadline_us=deadline_us)


def _request_id(reader: Reader, raw: msgspec.Raw | None) -> int | str:
    if raw is None:
        reader.fail(InvalidRequest, "id", _ID_EXPECTED, "nothing")
    return reader.request_ref(raw, "id", InvalidRequest)


def _check_version(reader: Reader, raw: msgspec.Raw) -> None:
    encoded = memoryview(raw)
    if kind(encoded) != "int":
        reader.fail(InvalidRequest, "v", "the int protocol version", describe(encoded))
    if ANY_DECODER.decode(raw) not in SUPPORTED_VERSIONS:
        reader.fail(UnsupportedVersion, "v", " or ".join(map(str, SUPPORTED_VERSIONS)),
                    describe(encoded), supported=list(SUPPORTED_VERSIONS))


def _names(spec: dict[str, Arg]) -> int:
    # The keys a map of these arguments may hold: each name, and its alias (nil beside it is absent).
    return len(spec) + sum(name in spec for name in ALIASES.values())


_MOST_ARGS = {op: _names(spec) for op, spec in OPS.items()}
_MOST_FRAME_ARGS = {op: _names(spec) for op, spec in FRAME_ARGS.items()}


def _args_map(reader: Reader, raw: msgspec.Raw, field: str, op: str, spec: dict[str, Arg], most: int, cls) -> dict:
    """The map of `op`'s arguments at `field` (`most`: the keys it may hold)."""
    encoded = memoryview(raw)
    if more_entries(encoded, most):  # an unknown argument's error, for one that cannot be named
        reader.fail(InvalidArgument, field,
                    f"a map of at most {most} entries (the arguments of {op} and their aliases)",
                    describe(encoded), known=list(spec))
    return reader.map(raw, field, "a map of arguments", cls)


def _read_args(reader: Reader, op: str, spec: dict[str, Arg], entries: dict, parent: str = "args") -> dict:
    args = {}
    given_as = {}
    nil_required = {}  # name -> the field of its first nil: refused unless its alias gives it
    for key, raw in entries.items():
        name = ALIASES.get(key, key)
        field = key_path(parent, key)
        arg = spec.get(name)
        if arg is None:
            expected = (f"an argument of {op}: " + ", ".join(spec)) if spec else f"no arguments for {op}"
            reader.fail(InvalidArgument, field, expected, f"unknown argument {shown_key(key)}", known=list(spec))
        # nil is absent (SPEC §3): a nil name beside its alias's value is not giving both. For a
        # required argument nil alone is no value, refused once no alias has given one.
        if kind(memoryview(raw)) == "nil":
            if arg.required:
                nil_required.setdefault(name, field)
            continue
        if name in given_as:
            reader.fail(InvalidArgument, field, f"either {name!r} or its alias, not both",
                        f"both {given_as[name]!r} and {key!r}")
        given_as[name] = key
        if arg.kind == "frames":  # a frame without its op is missing an argument of this op
            args[name] = _read_frames(reader, raw, field, op)
        else:
            args[name] = _CHECKS[arg.kind](reader, raw, field)
    for name, field in nil_required.items():
        if name not in args:
            reader.fail(InvalidArgument, field, KIND_EXPECTED[spec[name].kind], "nil")
    for name, arg in spec.items():
        if arg.required and name not in args:
            reader.fail(MissingArgument, f"{parent}.{name}", KIND_EXPECTED[arg.kind], "nothing", op=op)
    return args


@dataclass(frozen=True, slots=True)
class Frame:
    """One call of `frames` (session_open's, session_restore's): an op of FRAME_OPS and its
    checked arguments, which name no session (the one being opened or restored is theirs)."""

    op: str
    args: dict


_FRAME_KEYS = ("op", "args")


def _read_frames(reader: Reader, raw: msgspec.Raw, field: str, op: str) -> tuple[Frame, ...]:
    """The frames of `op` (session_open's, session_restore's)."""
    items = reader.array(raw, field, KIND_EXPECTED["frames"])
    encoded = memoryview(raw)
    if count(encoded) > MAX_FRAMES:  # refused from its header, before a frame is read
        reader.fail(InvalidArgument, field, f"an array of at most {MAX_FRAMES} frames", describe(encoded))
    frames = []
    for i, item in enumerate(items):
        at = f"{field}[{i}]"
        reader.at_most(item, len(_FRAME_KEYS), at, "a map {op, args}")
        entries = reader.map(item, at, "a map {op, args}", InvalidArgument)
        for key in entries:
            if key not in _FRAME_KEYS:
                reader.fail(InvalidArgument, key_path(at, key), "only the keys op and args",
                            f"unknown key {shown_key(key)}")
        if "op" not in entries:
            reader.fail(MissingArgument, f"{at}.op", "one of " + ", ".join(FRAME_OPS), "nothing", op=op)
        frame_op = reader.string(entries["op"], f"{at}.op", expected="one of " + ", ".join(FRAME_OPS))
        if frame_op not in FRAME_OPS:
            reader.fail(InvalidArgument, f"{at}.op", "one of " + ", ".join(FRAME_OPS) + " (the ops that advance a session)",
                        describe(memoryview(entries["op"])))
        args_raw = entries.get("args")
        call_args = ({} if args_raw is None else
                     _args_map(reader, args_raw, f"{at}.args", frame_op, FRAME_ARGS[frame_op],
                               _MOST_FRAME_ARGS[frame_op], InvalidArgument))
        frames.append(Frame(frame_op, _read_args(reader, frame_op, FRAME_ARGS[frame_op], call_args, f"{at}.args")))
    return tuple(frames)


@dataclass(slots=True)
class Reply:
    """A v1 reply as a client reads it. In `result`, every tensor map comes back as a
    WireTensor (a view into the body); `error` is {"code", "message", "detail"} when not ok."""

    id: int | str | None
    ok: bool
    result: dict | None
    error: dict | None
    timing: dict
    version: int = PROTOCOL_VERSION


_REPLY_KEYS = ("v", "id", "ok", "result", "error", "timing")


def decode_reply(body, buffers=()) -> Reply:
    """Decode one v1 reply body (client side), with the raw buffers that followed it in a
    multipart message. Raises DecodeError when it is not one."""
    try:
        top = decode_top_map(body)
    except ValidationError as e:  # a map with non-str or duplicate keys
        _bad_reply("body", e.expected, e.got)
    for key in top:
        if key not in _REPLY_KEYS:
            _bad_reply(key_path("", key), "only the keys " + ", ".join(_REPLY_KEYS), f"unknown key {shown_key(key)}")
    for key in ("v", "id", "ok"):
        if key not in top:
            _bad_reply(key, "a reply envelope key", "nothing")
    views = buffer_views(buffers)
    used: set[int] = set()
    values = {key: _reply_value(raw, key, views, used) for key, raw in top.items()}
    if len(used) != len(views):
        unused = min(set(range(len(views))) - used)
        _bad_reply(f"buffers[{unused}]", "every raw buffer referred to by a tensor's buf",
                   f"raw buffer {unused} referred to by no tensor")
    if type(values["v"]) is not int or values["v"] not in SUPPORTED_VERSIONS:
        _bad_reply("v", " or ".join(map(str, SUPPORTED_VERSIONS)), repr(values["v"]))
    request_id = values["id"]
    if not (request_id is None or valid_request_id(request_id)):
        _bad_reply("id", _ID_EXPECTED + " or nil", repr(request_id))
    ok = values["ok"]
    if type(ok) is not bool:
        _bad_reply("ok", "a bool", repr(ok))
    body_key = "result" if ok else "error"
    if not isinstance(values.get(body_key), dict):
        _bad_reply(body_key, "a map", repr(values.get(body_key)))
    timing = values.get("timing", {})
    if not isinstance(timing, dict):
        _bad_reply("timing", "a map", repr(timing))
    return Reply(request_id, ok, values.get("result"), values.get("error"), timing, values["v"])


def _reply_value(raw: msgspec.Raw, field: str, buffers: tuple[memoryview, ...], used: set[int]):
    encoded = memoryview(raw)
    what = kind(encoded)
    try:
        if what == "map":
            tensor = Reader.valid_tensor(raw, False, buffers, used)
            if tensor is not None:
                return tensor
            # SPEC §3: every map's keys are distinct strs, inside the result too. Decoded into
            # a dict, a key given twice keeps only its last value, unchecked the others.
            try:
                try:
                    entries = MAP_DECODER.decode(raw)
                except msgspec.ValidationError:
                    Reader().not_str_key(encoded, field, InvalidRequest)
                Reader().check_keys(entries, encoded, field, InvalidRequest)
            except ValidationError as e:
                _bad_reply(field, e.expected, e.got)
            if "shape" in entries and ("data" in entries or "buf" in entries):
                # Meant as a tensor, which the typed check refused: the careful path reads it,
                # naming what is wrong (the C client refuses such a reply too).
                reader = Reader(buffers=buffers)
                try:
                    tensor = reader.tensor_data(raw, field)
                except ValidationError as e:
                    _bad_reply(field, "a valid tensor map (dtype, shape, and data or buf holding its bytes)", str(e))
                used |= reader.used
                return tensor
            return {key: _reply_value(item, key_path(field, key), buffers, used) for key, item in entries.items()}
        if what == "array":
            return [_reply_value(item, f"{field}[{i}]", buffers, used)
                    for i, item in enumerate(_ARRAY_DECODER.decode(raw))]
        return ANY_DECODER.decode(raw)
    except DECODE_FAILURES as e:
        _bad_reply(field, "a decodable value", f"an undecodable {what} ({e})")


def _bad_reply(field: str, expected: str, got: str) -> NoReturn:
    raise DecodeError(f"reply {field}: expected {expected}, got {got}",
                      detail={"field": field, "expected": expected, "got": got})
