"""Errors raised by op handlers, and the mapping of every exception to a wire error code."""

from __future__ import annotations

import kernels
import protocol


class OpError(Exception):
    """A request the bridge understood but cannot serve; becomes an error reply."""

    def __init__(self, code: str, message: str, detail: dict | None = None):
        super().__init__(message)
        self.code = code
        self.detail = detail or {}


def error_fields(exc: BaseException) -> tuple[str, str, dict]:
    """(code, message, detail) for an exception raised while serving a request."""
    if isinstance(exc, (OpError, protocol.ProtocolError)):
        return exc.code, str(exc), dict(exc.detail or {})
    if isinstance(exc, kernels.KernelInputError):
        code = "shape_mismatch" if isinstance(exc, kernels.ShapeMismatch) else "invalid_argument"
        field = exc.field if exc.field.startswith("args.") else f"args.{exc.field}"
        return code, f"{field}: expected {exc.expected}, got {exc.got}", {
            "field": field, "expected": exc.expected, "got": exc.got}
    if isinstance(exc, kernels.BackendUnavailable):
        return "unsupported", str(exc), {}
    if isinstance(exc, MemoryError):
        return "limit_exceeded", "out of memory while serving the request", {"limit": "memory"}
    return "internal_error", f"{type(exc).__name__}: {exc}", {"exception": type(exc).__name__}
