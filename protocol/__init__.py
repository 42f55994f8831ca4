"""scan-bridge wire protocol v1, sans-IO: bytes in, typed messages out, and back.

No sockets, threads or torch here; transports move bytes, the bridge acts on messages.
SPEC.md (next to this file) is the language-neutral contract; vectors/ holds golden frames.

    frames = FrameAssembler()
    while (n := stream.readinto(frames.space())):    # bodies land in place, no copy
        event = frames.advance(n)                    # None until a frame is whole
        if isinstance(event, FrameDropped):          # too large, or no memory to hold it
            send(frame_parts(encode_error(None, event.code, str(event), event.detail)))
        elif event is not None:
            body, release = event
            try:
                request = decode_request(body)       # Request | LegacyRequest
            except ProtocolError as e:
                send(frame_parts(e.codec.error(e.request_id, e.code, str(e), e.detail)))
"""

from ._msgpack import key_path, shown_key, shown_value
from .codecs import CODECS, LEGACY, V1, error_reply_for
from .decode import Frame, Reply, Request, decode_reply, decode_request
from .encode import BIG_PAYLOAD, encode_error, encode_reply, encode_request
from .errors import (ERROR_CODES, DecodeError, FrameDropped, FrameError, FrameTooLarge, FrameUnbuffered,
                     InvalidArgument, InvalidRequest, MissingArgument, ProtocolError, TensorSizeMismatch,
                     TruncatedFrame, UnknownDtype, UnknownOp, UnsupportedVersion, ValidationError)
from .framing import DEFAULT_MAX_FRAME_SIZE, FrameAssembler, encode_frame, frame_parts, parse_frame_header
from .legacy import LegacyRequest, encode_legacy_reply
from .schema import ALIASES, OPS, PROTOCOL_VERSION
from .tensors import DTYPES, MAX_NDIM, HandleRef, OutTensor, WireTensor

__all__ = [
    # framing
    "FrameAssembler", "FrameDropped", "FrameTooLarge", "FrameUnbuffered", "DEFAULT_MAX_FRAME_SIZE",
    "parse_frame_header", "encode_frame", "frame_parts",
    # messages
    "decode_request", "Request", "Frame", "LegacyRequest", "decode_reply", "Reply", "WireTensor", "HandleRef",
    "OutTensor", "encode_reply", "encode_error", "encode_request", "encode_legacy_reply", "DTYPES", "MAX_NDIM",
    "CODECS", "V1", "LEGACY", "error_reply_for", "ERROR_CODES", "OPS", "ALIASES", "PROTOCOL_VERSION", "BIG_PAYLOAD",
    # client-chosen keys in errors
    "shown_key", "key_path", "shown_value",
    # exceptions
    "ProtocolError", "FrameError", "TruncatedFrame", "DecodeError", "ValidationError",
    "InvalidRequest", "UnsupportedVersion", "UnknownOp", "MissingArgument", "InvalidArgument",
    "UnknownDtype", "TensorSizeMismatch",
]
