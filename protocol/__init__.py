"""scan-bridge wire protocol v1, sans-IO: bytes in, typed messages out, and back.

No sockets, threads or torch here; transports move bytes, the bridge acts on messages.
SPEC.md (next to this file) is the language-neutral contract; vectors/ holds golden frames.

    decoder = FrameDecoder()
    for event in decoder.feed(chunk):
        if isinstance(event, FrameTooLarge):
            send(frame_parts(encode_error(None, event.code, str(event), event.detail)))
            continue
        try:
            request = decode_request(event)          # Request | LegacyRequest
        except ProtocolError as e:
            ...                                      # e.code, e.detail, e.request_id, e.legacy

A transport that reads with `readinto` uses `decoder.get_buffer()` / `decoder.buffer_updated(n)`
instead of `feed`, so big bodies land in place without a copy.
"""

from .codecs import CODECS, LEGACY, V1, error_reply_for
from .decode import Reply, Request, decode_reply, decode_request
from .encode import BIG_PAYLOAD, encode_error, encode_reply, encode_request
from .errors import (ERROR_CODES, DecodeError, FrameError, FrameTooLarge, InvalidArgument,
                     InvalidRequest, MissingArgument, ProtocolError, TensorSizeMismatch,
                     TruncatedFrame, UnknownDtype, UnknownOp, UnsupportedVersion, ValidationError)
from .framing import DEFAULT_MAX_FRAME_SIZE, FrameDecoder, encode_frame, frame_parts, parse_frame_header
from .legacy import LegacyRequest, encode_legacy_reply
from .schema import ALIASES, OPS, PROTOCOL_VERSION
from .tensors import DTYPES, MAX_NDIM, HandleRef, OutTensor, WireTensor

__all__ = [
    # framing
    "FrameDecoder", "FrameTooLarge", "DEFAULT_MAX_FRAME_SIZE", "parse_frame_header", "encode_frame",
    "frame_parts",
    # messages
    "decode_request", "Request", "LegacyRequest", "decode_reply", "Reply", "WireTensor", "HandleRef",
    "OutTensor", "encode_reply", "encode_error", "encode_request", "encode_legacy_reply", "DTYPES", "MAX_NDIM",
    "CODECS", "V1", "LEGACY", "error_reply_for", "ERROR_CODES", "OPS", "ALIASES", "PROTOCOL_VERSION", "BIG_PAYLOAD",
    # exceptions
    "ProtocolError", "FrameError", "TruncatedFrame", "DecodeError", "ValidationError",
    "InvalidRequest", "UnsupportedVersion", "UnknownOp", "MissingArgument", "InvalidArgument",
    "UnknownDtype", "TensorSizeMismatch",
]
