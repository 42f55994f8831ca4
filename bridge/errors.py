"""Errors raised by op handlers, and the mapping of every exception to a wire error code."""

from __future__ import annotations

import contextlib

import torch

import scan_kernels
import protocol

from .tensors import WIRE_DTYPES


class OpError(Exception):
    """A request the bridge understood but cannot serve; becomes an error reply."""

    def __init__(self, code: str, message: str, detail: dict | None = None):
        super().__init__(message)
        self.code = code
        self.detail = detail or {}


def reply_too_large(exc: protocol.FrameTooLarge) -> OpError:
    """The answer to a request whose reply a stream lane's 4-byte length prefix cannot frame, or
    one of whose tensors msgpack's 4-byte bin length cannot carry in-band (SPEC §2)."""
    return OpError("limit_exceeded", f"reply: expected at most {exc.limit} bytes in a frame, got {exc.length}",
                   {"limit": "reply_frame_size", "max": exc.limit, "requested": exc.length})


def check_reply_fits(request, tensor_bytes: list[int]) -> None:
    """limit_exceeded (reply_frame_size), as reply_too_large, for a request whose reply's tensors
    (`tensor_bytes`, each known from shapes) an in-band reply cannot carry: refused before it
    runs, since once run its session's state has moved on, and a client told the request failed
    would send it again. Multipart replies carry tensors as raw buffers, without either limit."""
    if request.multipart:
        return
    for nbytes in tensor_bytes:
        if nbytes > protocol.encode.MAX_BIN_BYTES:
            raise reply_too_large(protocol.FrameTooLarge(nbytes, protocol.encode.MAX_BIN_BYTES))
    total = sum(tensor_bytes)
    if total > protocol.framing.MAX_FRAMEABLE:
        raise reply_too_large(protocol.FrameTooLarge(total, protocol.framing.MAX_FRAMEABLE))


def out_of_memory(what: str, exc: BaseException) -> OpError:
    first_line = (str(exc).strip() or type(exc).__name__).splitlines()[0]
    return OpError("limit_exceeded", f"{what}: out of memory ({first_line})", {"limit": "memory"})


# What torch's CPU allocator says when it fails: it raises a plain RuntimeError (CUDA's raises
# torch.OutOfMemoryError).
CPU_ALLOCATOR_FAILED = "can't allocate memory"


def is_out_of_memory(exc: BaseException) -> bool:
    """An allocator failed: Python's, CUDA's, or torch's CPU allocator. Any other RuntimeError
    (a CUDA error an earlier kernel left, say) is not."""
    return (isinstance(exc, (MemoryError, torch.OutOfMemoryError))
            or (isinstance(exc, RuntimeError) and CPU_ALLOCATOR_FAILED in str(exc)))


@contextlib.contextmanager
def allocation(what: str):
    """Around a device allocation whose sizes are already checked: its failure is an
    out-of-memory error that names `what` was being allocated for."""
    try:
        yield
    except Exception as exc:
        if not is_out_of_memory(exc):
            raise
        raise out_of_memory(what, exc) from exc


def error_fields(exc: BaseException) -> tuple[str, str, dict]:
    """(code, message, detail) for an exception raised while serving a request."""
    if isinstance(exc, (OpError, protocol.ProtocolError)):
        return exc.code, str(exc), dict(exc.detail or {})
    if isinstance(exc, scan_kernels.KernelInputError):
        code = "shape_mismatch" if isinstance(exc, scan_kernels.ShapeMismatch) else "invalid_argument"
        field = exc.field if exc.field.startswith("args.") else f"args.{exc.field}"
        expected, got = exc.expected, exc.got
        if isinstance(exc, scan_kernels.DtypeNotAllowed):
            # named as the client sent them and SPEC §5 lists them, not as torch does
            expected = f"{exc.kind} ({', '.join(WIRE_DTYPES[d] for d in exc.allowed)})"
            got = WIRE_DTYPES.get(exc.dtype, got)
        return code, f"{field}: expected {expected}, got {got}", {"field": field, "expected": expected, "got": got}
    if isinstance(exc, scan_kernels.BackendUnavailable):
        return "unsupported", str(exc), {}
    if is_out_of_memory(exc):
        return error_fields(out_of_memory("serving the request", exc))
    return "internal_error", f"{type(exc).__name__}: {exc}", {"exception": type(exc).__name__}
