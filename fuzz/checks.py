"""What must hold of every decode, whatever the bytes: the properties the harnesses check
beyond "nothing but a ProtocolError escapes". Each raises `Finding` (or lets the exception
that broke it propagate), which libFuzzer records with the input.
"""

from __future__ import annotations

import math
from pathlib import Path

import msgpack

from protocol import (DTYPES, ERROR_CODES, LEGACY, MAX_NDIM, OPS, V1, HandleRef, LegacyRequest, ProtocolError,
                      Request, WireTensor, decode_reply)
from protocol import decode as _decode
from protocol._reader import buffer_views, decode_top_map
from protocol.legacy import LEGACY_OPS
from protocol.schema import FRAME_ARGS

VECTORS_DIR = Path(__file__).resolve().parents[1] / "protocol" / "vectors"
_TENSOR_KINDS = {"tensor": (WireTensor, HandleRef), "tensor_data": (WireTensor,)}


class Finding(AssertionError):
    """A property of the decoders that an input broke."""


def vector_frames(multipart: bool = True) -> list[tuple[str, bytes]]:
    """(name, bytes) of every golden vector frame, multipart ones (parts, each framed) too."""
    paths = sorted(VECTORS_DIR.glob("*.frame"))
    if multipart:
        paths += sorted((VECTORS_DIR / "multipart").glob("*.frame"))
    return [(p.stem, p.read_bytes()) for p in paths]


def check_tensor(value: WireTensor, where: str) -> None:
    if value.dtype not in DTYPES:
        raise Finding(f"{where}: dtype {value.dtype!r} accepted")
    if len(value.shape) > MAX_NDIM or not all(type(d) is int and d >= 0 for d in value.shape):
        raise Finding(f"{where}: shape {value.shape!r} accepted")
    expected = math.prod(value.shape) * DTYPES[value.dtype][0]
    if memoryview(value.data).nbytes != expected:
        raise Finding(f"{where}: {memoryview(value.data).nbytes} bytes accepted for {value.dtype} {value.shape}")


def _check_value(value, kind: str, where: str) -> None:
    if kind in _TENSOR_KINDS:
        if not isinstance(value, _TENSOR_KINDS[kind]):
            raise Finding(f"{where}: a {type(value).__name__} accepted as a {kind}")
        if isinstance(value, WireTensor):
            check_tensor(value, where)
    elif kind in ("tensors", "size_or_tensors") and isinstance(value, dict):
        for name, item in value.items():
            _check_value(item, "tensor", f"{where}.{name}")
    elif kind == "frames":
        for i, frame in enumerate(value):
            if frame.op not in FRAME_ARGS:
                raise Finding(f"{where}[{i}]: a frame of {frame.op!r} accepted")
            _check_args(frame.args, frame.op, f"{where}[{i}].args.", FRAME_ARGS[frame.op])


def _check_args(args: dict, op: str, prefix: str, spec: dict | None = None) -> None:
    spec = OPS[op] if spec is None else spec
    for name, value in args.items():
        if name not in spec:
            raise Finding(f"argument {prefix}{name} accepted for {op}")
        _check_value(value, spec[name].kind, prefix + name)
    for name, arg in spec.items():
        if arg.required and name not in args:
            raise Finding(f"{op} accepted without its required {prefix}{name}")


def check_request(request: Request, body, buffers) -> None:
    """An accepted v1 request: its op and arguments are the schema's, its tensors hold what
    they say, and the fast path (one typed decode) accepted nothing that the argument-by-
    argument path does not accept the same way (decode.py: "this path only ever accepts, and
    accepts exactly what that one does")."""
    if request.op not in OPS:
        raise Finding(f"op {request.op!r} accepted")
    _check_args(request.args, request.op, "args.")
    if request.multipart != bool(buffers):
        raise Finding(f"multipart {request.multipart} for {len(buffers)} raw buffers")
    top = decode_top_map(body)
    views = buffer_views(buffers)
    fast = _decode._decode_valid_v1(top, views)
    if fast is None:
        return
    try:
        careful = _decode._decode_v1_checked(top, views)
    except ProtocolError as exc:
        raise Finding(f"the fast path accepted what the checked path refuses ({exc.code}: {exc})") from exc
    if careful != fast:
        raise Finding(f"the fast and checked paths disagree: {fast!r} != {careful!r}")


def check_legacy_request(request: LegacyRequest) -> None:
    if request.op not in LEGACY_OPS:
        raise Finding(f"legacy op {request.op!r} accepted")
    if request.op != "scan":
        if request.args:
            raise Finding(f"legacy {request.op} with arguments {sorted(request.args)}")
        return
    for name in ("x", "dt", "A", "B", "C"):
        tensor = request.args.get(name)
        if not isinstance(tensor, WireTensor) or tensor.dtype != "f32":
            raise Finding(f"legacy scan {name}: {tensor!r}")
        check_tensor(tensor, f"legacy {name}")


def check_error_reply(error: ProtocolError) -> None:
    """The error a server answers with can be written and read back: its code is a wire code,
    its detail encodes, and the reply says what the error says."""
    if error.code not in ERROR_CODES:
        raise Finding(f"error code {error.code!r} is not a wire code ({type(error).__name__}: {error})")
    parts = error.codec.error(error.request_id, error.code, str(error), error.detail)
    reply = b"".join(bytes(memoryview(p)) for p in parts)
    if error.codec is V1:
        decoded = decode_reply(reply)
        if decoded.ok or decoded.error.get("code") != error.code or decoded.id != error.request_id:
            raise Finding(f"error reply reads back as {decoded!r} for {error.code} id {error.request_id!r}")
    elif error.codec is LEGACY:
        decoded = msgpack.unpackb(reply, raw=False)
        if decoded != {"status": "error", "message": str(error)}:
            raise Finding(f"legacy error reply reads back as {decoded!r}")
    else:
        raise Finding(f"error with an unknown codec {error.codec!r}")
