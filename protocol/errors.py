"""Wire error codes and the exception tree of the protocol layer.

Errors are data: every `ProtocolError` carries the wire `code` the server puts in its error
reply, a JSON-able `detail` dict, and what the decoder knew when it failed (`request_id`,
`legacy`), so the bridge answers without parsing messages, in the request's own form:

    except ProtocolError as e:
        parts = e.codec.error(e.request_id, e.code, str(e), e.detail)

    ProtocolError
    ├── FrameError                  framing layer (length prefix)
    │   ├── FrameDropped            a frame read whole and dropped (a FrameAssembler event)
    │   │   ├── FrameTooLarge       frame_too_large (also raised for a reply too large to frame)
    │   │   └── FrameUnbuffered     limit_exceeded: no memory to hold it
    │   └── TruncatedFrame          stream ended inside a frame (decode_error)
    ├── DecodeError                 decode_error: body is not one msgpack map
    └── ValidationError             the map is not a valid request
        ├── InvalidRequest          invalid_request: envelope wrong
        ├── UnsupportedVersion      unsupported_version
        ├── UnknownOp               unknown_op
        ├── MissingArgument         missing_argument
        ├── InvalidArgument         invalid_argument
        ├── UnknownDtype            unknown_dtype
        └── TensorSizeMismatch      tensor_size_mismatch
"""

from __future__ import annotations

# Every code a v1 error reply may carry, with its meaning (SPEC.md has the same table; a test
# keeps the two in step). The first group is raised by this package, the rest by the bridge.
ERROR_CODES: dict[str, str] = {
    "frame_too_large": "the length prefix announces more bytes than the server accepts; the body was skipped",
    "decode_error": "the body is not exactly one msgpack map (malformed, truncated, trailing bytes, or another type)",
    "invalid_request": "the envelope is wrong: id missing or not a uint/str, op not a str, args not a map, unknown or duplicate key",
    "unsupported_version": "v is not a protocol version this server speaks",
    "unknown_op": "op names no operation this server knows",
    "missing_argument": "a required argument of the op is absent",
    "invalid_argument": "an argument has the wrong type or value, is unknown to the op, or is given twice (alias and canonical name)",
    "unknown_dtype": "a tensor's dtype is not one of the wire dtype codes",
    "tensor_size_mismatch": "a tensor's data length differs from its element count times its itemsize",
    "shape_mismatch": "tensors are each well formed but inconsistent with each other (e.g. B's seq differs from x's)",
    "unknown_session": "session names no open session",
    "unknown_handle": "handle names no server-resident tensor",
    "unknown_model": "model names no model loaded on this connection",
    "unknown_snapshot": "snapshot names no snapshot held for this connection",
    "state_lost": ("a step, prefill or restore failed partway and left this session's state undefined; restore a "
                   "snapshot into it (session_restore) or close it (or a model_step's copy into this snapshot did, "
                   "and left it so: step into it again or take a new one)"),
    "invalid_checkpoint": "a model's config or weights (files, or sent) cannot be loaded: a tensor missing, mis-shaped or unexpected, an unknown architecture, a corrupt file",
    "path_not_allowed": "a checkpoint path lies outside every directory the server was given with --model-dir (or it was given none)",
    "limit_exceeded": "a server limit (sessions, handles, resident bytes, sizes) would be exceeded, or the server ran out of memory",
    "unsupported": "a valid request this server cannot serve here (e.g. a kernels backend it has no device for)",
    "overloaded": "the server is too busy to accept the request now; retry later",
    "shutting_down": "the server is shutting down and accepts no new work",
    "deadline_exceeded": "the request's deadline_us ran out before it ran; it was not run",
    "cancelled": ("a cancel request dropped this request before it ran, or its connection went away first "
                  "(that answer reaches nobody; the server counts it); it was not run"),
    "internal_error": "the server failed in a way that is not the client's fault",
}


class ProtocolError(Exception):
    """Base of every error the protocol layer raises for bad wire input.

    code        the wire error code (a key of ERROR_CODES)
    detail      JSON-able dict, sent as the error reply's `detail`
    request_id  the request's id when it was parsed before the failure, else None
    legacy      True when the request was recognised as ExPhil legacy (reply in legacy shape)
    op          the op named, when the failure came after a known op was read (its arguments),
                else None: the op the failure is counted for
    """

    code = "internal_error"  # every class that is raised sets its own

    def __init__(self, message: str, *, detail: dict | None = None,
                 request_id: int | str | None = None, legacy: bool = False):
        super().__init__(message)
        self.detail = {} if detail is None else detail
        self.request_id = request_id
        self.legacy = legacy
        self.op: str | None = None

    @property
    def codec(self):
        """How the request that failed is answered (protocol.codecs)."""
        from .codecs import LEGACY, V1

        return LEGACY if self.legacy else V1

    @property
    def stats_op(self) -> str | None:
        """The op the stats count the failure for, as a request's `stats_op`; None without one."""
        return None if self.op is None else self.codec.stats_prefix + self.op


class FrameError(ProtocolError):
    """The byte stream does not split into frames as announced."""


class FrameDropped(FrameError):
    """A frame read whole and dropped unread (`FrameAssembler` returns one as an event, and the
    stream goes on): a server answers it with id null. `length` is its announced body size."""

    length: int


class FrameTooLarge(FrameDropped):
    """A length prefix announced more than the limit.

    `FrameAssembler` returns an instance as an event (and skips that many bytes); the
    framing helpers raise it when a reply cannot be framed.
    """

    code = "frame_too_large"

    def __init__(self, length: int, limit: int):
        self.length = length
        self.limit = limit
        super().__init__(f"frame of {length} bytes exceeds the limit of {limit} bytes",
                         detail={"length": length, "limit": limit})

    def __eq__(self, other):
        return (type(other) is FrameTooLarge
                and (self.length, self.limit) == (other.length, other.limit))

    def __hash__(self):
        return hash((FrameTooLarge, self.length, self.limit))

    def __repr__(self):
        return f"FrameTooLarge(length={self.length}, limit={self.limit})"


class FrameUnbuffered(FrameDropped):
    """A frame within the limit for which no buffer could be had (the machine out of memory):
    read and dropped as an oversized one is, answered limit_exceeded (limit "memory", SPEC §7)."""

    code = "limit_exceeded"

    def __init__(self, length: int, reason: str):
        self.length = length
        super().__init__(f"no memory to hold a frame of {length} bytes ({reason}); it was read and dropped",
                         detail={"limit": "memory", "length": length})


class TruncatedFrame(FrameError):
    """The stream ended inside a frame (`FrameAssembler.eof()` returns one)."""

    code = "decode_error"

    def __init__(self, received: int, expected: int):
        self.received = received
        self.expected = expected
        super().__init__(f"stream ended inside a frame: {received} of {expected} bytes received "
                         "(4-byte header included)",
                         detail={"received": received, "expected": expected})


class DecodeError(ProtocolError):
    """The body is not exactly one msgpack map."""

    code = "decode_error"


class ValidationError(ProtocolError):
    """A well-formed msgpack map that is not a valid request.

    `field` is the path of the offending value (`id`, `op`, `args.B.shape[1]`); `expected` and
    `got` say what was wanted and what came. They are repeated in `detail` with any `extra`.
    """

    def __init__(self, field: str, expected: str, got: str, *, request_id=None,
                 legacy: bool = False, **extra):
        self.field = field
        self.expected = expected
        self.got = got
        detail = {"field": field, "expected": expected, "got": got}
        detail.update(extra)
        super().__init__(f"{field}: expected {expected}, got {got}", detail=detail,
                         request_id=request_id, legacy=legacy)


class InvalidRequest(ValidationError):
    code = "invalid_request"


class UnsupportedVersion(ValidationError):
    code = "unsupported_version"


class UnknownOp(ValidationError):
    code = "unknown_op"


class MissingArgument(ValidationError):
    code = "missing_argument"


class InvalidArgument(ValidationError):
    code = "invalid_argument"


class UnknownDtype(ValidationError):
    code = "unknown_dtype"


class TensorSizeMismatch(ValidationError):
    code = "tensor_size_mismatch"
