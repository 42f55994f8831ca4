"""Encoding replies (and requests, for Python clients) as lists of buffers.

Big binary payloads (tensor data, bytes of at least BIG_PAYLOAD) are list items of their own
that reference the caller's memory; everything between them is coalesced into `bytes`. The
list is one msgpack body, unframed: `frame_parts(parts)` prefixes it for `os.writev`, a ZeroMQ
transport sends `b"".join(parts)` or the parts as one zero-copy message.

Given a `buffers` list, the encoders write the multipart form instead (SPEC §5, "Multipart
messages"): every tensor becomes `{"dtype", "shape", "buf": i}` and its data, untouched, is
appended to `buffers` as raw buffer i, to travel as its own ZeroMQ frame after the body.

Reply maps are written in a fixed key order: v, id, ok, result, timing. `timing` comes last so
that, given as a callable, it is called after everything before it is encoded and can include
the encoding time itself.
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec

from .errors import ERROR_CODES, FrameTooLarge
from .schema import PROTOCOL_VERSION, valid_request_id
from .tensors import HandleRef, OutTensor, WireTensor

# Payloads from this size on are not copied into the coalesced buffers.
BIG_PAYLOAD = 16 * 1024
# msgpack's bin 32 carries its length in 4 bytes.
MAX_BIN_BYTES = 0xFFFFFFFF
# Containers nested deeper are refused by the encoder: a server's decoder refuses such a body
# before it reads the id, and its answer (id nil, no length) names no request to wake.
MAX_NESTING = 512
_SCALAR_ENCODER = msgspec.msgpack.Encoder()


class Packer:
    """Writes msgpack into a growing bytearray, splitting out big binary payloads; with a
    `buffers` list, tensor data goes there instead of into the body."""

    __slots__ = ("parts", "small", "buffers")

    def __init__(self, buffers: list | None = None):
        if buffers:
            raise ValueError(f"buffers: expected an empty list to collect tensor data, got {len(buffers)} items")
        self.parts: list = []
        self.small = bytearray()
        self.buffers = buffers

    def map_header(self, n: int) -> None:
        self._header(n, 0x80, 0xDE, 0xDF)

    def _header(self, n: int, fix: int, code16: int, code32: int) -> None:
        if n < 16:
            self.small.append(fix | n)
        elif n < 0x10000:
            self.small.append(code16)
            self.small += n.to_bytes(2, "big")
        else:
            self.small.append(code32)
            self.small += n.to_bytes(4, "big")

    def binary(self, view: memoryview) -> None:
        n = view.nbytes
        if n > MAX_BIN_BYTES:
            raise FrameTooLarge(n, MAX_BIN_BYTES)
        if n < 0x100:
            self.small += bytes((0xC4, n))
        elif n < 0x10000:
            self.small.append(0xC5)
            self.small += n.to_bytes(2, "big")
        else:
            self.small.append(0xC6)
            self.small += n.to_bytes(4, "big")
        if n >= BIG_PAYLOAD:
            if self.small:
                self.parts.append(bytes(self.small))
                self.small.clear()
            self.parts.append(view)
        else:
            self.small += view

    def value(self, value, path: str, depth: int = 0) -> None:
        """Encode `value`: dict (str keys), list, tuple, str, int, float, bool, None, bytes-like
        (as bin), OutTensor or WireTensor (as a tensor map), HandleRef (as {"handle": ...}).
        `depth`: the containers around it, at most MAX_NESTING."""
        if depth > MAX_NESTING:
            raise ValueError(f"{path}: expected values nested at most {MAX_NESTING} containers deep (SPEC §3)")
        if isinstance(value, (OutTensor, WireTensor)):
            self.small.append(0x83)
            self.small += b"\xa5dtype"
            _SCALAR_ENCODER.encode_into(value.dtype, self.small, -1)
            self.small += b"\xa5shape"
            _SCALAR_ENCODER.encode_into(list(value.shape), self.small, -1)
            if self.buffers is None:
                self.small += b"\xa4data"
                self.binary(value.data)
            else:
                self.small += b"\xa3buf"
                _SCALAR_ENCODER.encode_into(len(self.buffers), self.small, -1)
                self.buffers.append(value.data)
        elif isinstance(value, HandleRef):
            self.small += b"\x81\xa6handle"
            _SCALAR_ENCODER.encode_into(value.handle, self.small, -1)
        elif isinstance(value, dict):
            self.map_header(len(value))
            for key, item in value.items():
                if not isinstance(key, str):
                    raise TypeError(f"{path}: expected str keys, got {type(key).__name__} key {key!r}")
                _SCALAR_ENCODER.encode_into(key, self.small, -1)
                self.value(item, f"{path}.{key}", depth + 1)
        elif isinstance(value, (list, tuple)):
            self._header(len(value), 0x90, 0xDC, 0xDD)
            for i, item in enumerate(value):
                self.value(item, f"{path}[{i}]", depth + 1)
        elif isinstance(value, (bytes, bytearray, memoryview)):
            view = memoryview(value)
            self.binary(view if view.format == "B" and view.ndim == 1 else view.cast("B"))
        elif value is None or isinstance(value, (str, int, float)):
            try:
                _SCALAR_ENCODER.encode_into(value, self.small, -1)
            except OverflowError:
                raise ValueError(f"{path}: expected an int that fits msgpack (-2**63 .. 2**64-1), "
                                 f"got {value}") from None
        else:
            raise TypeError(f"{path}: cannot encode a {type(value).__module__}.{type(value).__qualname__} "
                            "(use dict, list, str, int, float, bool, None, bytes, OutTensor)")

    def timing(self, timing: dict | Callable[[], dict]) -> None:
        """The timing map, checked (str -> number), in one encoder call: the same bytes as
        `value` writes, without its per-entry dispatch."""
        _SCALAR_ENCODER.encode_into(check_timing(timing), self.small, -1)

    def finish(self) -> list:
        if self.small:
            self.parts.append(bytes(self.small))
        return self.parts


def _check_request_id(request_id, allow_none: bool) -> None:
    if (request_id is None and allow_none) or valid_request_id(request_id):
        return
    raise ValueError(f"request_id: expected a uint or a non-empty str{' or None' if allow_none else ''}, "
                     f"got {request_id!r}")


def _envelope(packer: Packer, keys: int, request_id) -> None:
    """Start a map of `keys` entries with the two every message opens with: v, then id."""
    packer.map_header(keys)
    packer.small += b"\xa1v"
    packer.value(PROTOCOL_VERSION, "v")
    packer.small += b"\xa2id"
    packer.value(request_id, "id")


def check_timing(timing: dict | Callable[[], dict]) -> dict:
    """The timing dict (calling `timing` if it is callable): str keys, int/float values."""
    if callable(timing):
        timing = timing()
    if not isinstance(timing, dict):
        raise TypeError(f"timing: expected a dict of str -> number, got {type(timing).__name__}")
    for key, value in timing.items():
        if not isinstance(key, str) or isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"timing: expected str -> number entries, got {key!r}: {value!r}")
    return timing


def encode_reply(request_id, result: dict, timing: dict | Callable[[], dict], *,
                 buffers: list | None = None) -> list:
    """`{"v": 1, "id", "ok": true, "result", "timing"}` as a list of buffers; with `buffers`,
    in the multipart form (tensor data appended to `buffers`)."""
    _check_request_id(request_id, allow_none=False)
    if not isinstance(result, dict):
        raise TypeError(f"result: expected a dict, got {type(result).__name__}")
    packer = Packer(buffers)
    _envelope(packer, 5, request_id)
    packer.small += b"\xa2ok\xc3\xa6result"
    packer.value(result, "result")
    packer.small += b"\xa6timing"
    packer.timing(timing)
    return packer.finish()


def encode_error(request_id, code: str, message: str, detail: dict | None = None, *,
                 timing: dict | Callable[[], dict] | None = None) -> list:
    """`{"v": 1, "id", "ok": false, "error": {"code", "message", "detail"}}` (plus "timing"
    last when given) as a list of buffers. `request_id` is None when the request's id could
    not be read."""
    _check_request_id(request_id, allow_none=True)
    if code not in ERROR_CODES:
        raise ValueError(f"code: expected one of {', '.join(ERROR_CODES)}, got {code!r}")
    if not isinstance(message, str):
        raise TypeError(f"message: expected a str, got {type(message).__name__}")
    if detail is not None and not isinstance(detail, dict):
        raise TypeError(f"detail: expected a dict or None, got {type(detail).__name__}")
    packer = Packer()
    _envelope(packer, 4 if timing is None else 5, request_id)
    packer.small += b"\xa2ok\xc2\xa5error"
    packer.value({"code": code, "message": message, "detail": {} if detail is None else detail}, "error")
    if timing is not None:
        packer.small += b"\xa6timing"
        packer.timing(timing)
    return packer.finish()


def encode_request(request_id, op: str, args: dict | None = None, *, buffers: list | None = None,
                   deadline_us: int | None = None) -> list:
    """`{"v": 1, "id", "op", "args"}` (and `deadline_us` when given) as a list of buffers, for
    Python clients and tests. Tensor arguments are OutTensor (or HandleRef); the server checks
    everything else. With `buffers`, in the multipart form (tensor data appended to `buffers`)."""
    _check_request_id(request_id, allow_none=False)
    if deadline_us is not None and not (type(deadline_us) is int and 0 <= deadline_us < 2**64):
        raise ValueError(f"deadline_us: expected an int of microseconds in 0 .. 2^64 - 1, got {deadline_us!r}")
    if not isinstance(op, str) or not op:
        raise ValueError(f"op: expected a non-empty str, got {op!r}")
    args = {} if args is None else args
    if not isinstance(args, dict):
        raise TypeError(f"args: expected a dict, got {type(args).__name__}")
    packer = Packer(buffers)
    _envelope(packer, 4 if deadline_us is None else 5, request_id)
    packer.small += b"\xa2op"
    packer.value(op, "op")
    packer.small += b"\xa4args"
    packer.value(args, "args")
    if deadline_us is not None:
        packer.small += b"\xabdeadline_us"
        packer.value(deadline_us, "deadline_us")
    return packer.finish()
