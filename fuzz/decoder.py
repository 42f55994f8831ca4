"""Harness: the request decoder, `protocol.decode_request(body, buffers)`, on every op of
`protocol.OPS`, tensor maps inline and in raw buffers (multipart, SPEC §5), and whatever bytes.

An input is a message's parts, each a 4-byte big-endian length and its bytes: the body, then
the raw buffers that followed it in a ZeroMQ multipart message (the format of
protocol/vectors/*.frame and multipart/*.frame, which seed it as they are).

Expected: a Request, a LegacyRequest, or a ProtocolError. A finding: any other exception (but
those of fuzz.known, counted), an
error reply that cannot be written or reads back otherwise (fuzz.checks.check_error_reply), an
accepted request that breaks the schema, or the decoder's fast path accepting what its checked
path does not accept the same way (fuzz.checks.check_request).
"""

from __future__ import annotations

import random

from protocol import OPS, LegacyRequest, ProtocolError, decode_request

from . import known, structure
from .checks import check_error_reply, check_legacy_request, check_request, vector_frames
from .structure import Message, join_parts, split_parts
from .tally import Tally

MAX_LEN = 4096


def setup() -> dict:
    return {"target": "protocol.decode_request(body, buffers)", "ops": sorted(OPS),
            "envelope_keys": list(structure.ENVELOPE_KEYS), "coverage": "Python (protocol, atheris)",
            "unknown_kinds": structure.unknown_kinds()}


def seeds() -> list[bytes]:
    return [frame for _, frame in vector_frames()]


tally = Tally()


def check_message(body: bytes, buffers: list[bytes]) -> None:
    try:
        request = decode_request(body, buffers)
    except ProtocolError as error:
        tally["error " + error.code] += 1
        check_error_reply(error)
        return
    except Exception as exc:
        known.count_or_raise(exc, tally)
        return
    if isinstance(request, LegacyRequest):
        tally["legacy " + request.op] += 1
        check_legacy_request(request)
    else:
        tally[("multipart " if request.multipart else "") + request.op] += 1
        check_request(request, body, buffers)


def one_input(data: bytes) -> None:
    tally.execution()
    parts = split_parts(data)
    check_message(parts[0], parts[1:])


def _generate(rng: random.Random) -> bytes:
    return structure.request(rng).body


def mutator(data: bytes, max_size: int, seed: int, mutate_bytes=None) -> bytes:
    """One of: libFuzzer's byte mutation of the body or a buffer; a structural mutation of the
    body's msgpack (fuzz.structure); a freshly generated request, multipart now and then.
    `mutate_bytes(data, max_size)` is libFuzzer's mutator (atheris.Mutate) by default."""
    if mutate_bytes is None:
        import atheris

        mutate_bytes = atheris.Mutate
    rng = random.Random(seed)
    parts = split_parts(data)
    message = Message(parts[0], list(parts[1:]))
    pick = rng.random()
    if pick < 0.3:
        message.body = mutate_bytes(message.body, len(message.body) + 64)
    elif pick < 0.4:
        if message.buffers and rng.random() < 0.7:
            i = rng.randrange(len(message.buffers))
            if rng.random() < 0.3:
                del message.buffers[i]
            else:
                message.buffers[i] = mutate_bytes(message.buffers[i], len(message.buffers[i]) + 16)
        else:
            message.buffers.append(rng.randbytes(rng.choice((0, 1, 4, 8, 24))))
    elif pick < 0.88:
        message.body = structure.mutate_body(message.body, rng, message, lambda b: mutate_bytes(b, len(b) + 16),
                                             _generate)
    elif pick < 0.95:
        message = structure.request(rng, multipart=rng.random() < 0.4)
    else:
        message = Message(structure.legacy_request(rng))
    out = join_parts([message.body, *message.buffers])
    return out if len(out) <= max_size else mutate_bytes(data, max_size)
