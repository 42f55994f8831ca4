"""Harness: the legacy ExPhil decoder (SPEC §9, protocol/legacy.py), reached as the server
reaches it: `protocol.decode_request(body)` on a map with neither "id" nor "v".

An input is one body (no length prefix). The mutator builds ExPhil's requests (ping, info, and
scan in both of its forms, binaries as Msgpax's str) and mutates their msgpack.

Expected: a LegacyRequest whose scan tensors hold what their shapes say, or a ProtocolError
answered in the legacy shape when the map was legacy (`legacy` set, so the reply is
{"status": "error", "message"}), or a v1 request or error when a mutation added "id" or "v".
A legacy request that came with raw buffers is refused (SPEC §5).
"""

from __future__ import annotations

import random

from protocol import InvalidRequest, LegacyRequest, ProtocolError, decode_request

from . import known, structure
from .checks import Finding, check_error_reply, check_legacy_request, check_request, vector_frames
from .mpack import Pairs, unpack
from .tally import Tally

MAX_LEN = 4096


def setup() -> dict:
    return {"target": "protocol.decode_request(body) on legacy ExPhil maps (protocol/legacy.py)",
            "legacy_ops": list(structure.LEGACY_OPS), "coverage": "Python (protocol, atheris)"}


def seeds() -> list[bytes]:
    return [frame[4:] for name, frame in vector_frames(multipart=False)
            if name.startswith(("legacy_", "invalid_legacy"))]


def _is_legacy_map(body: bytes) -> bool:
    """Whether the body is a map with str keys, distinct, none of them "id" or "v"."""
    try:
        top = unpack(body)
    except ValueError:
        return False
    if not isinstance(top, Pairs):
        return False
    keys = top.keys()
    return (all(type(k) is str for k in keys) and len(set(keys)) == len(keys)
            and "id" not in keys and "v" not in keys)


tally = Tally()


def one_input(body: bytes) -> None:
    tally.execution()
    legacy = _is_legacy_map(body)
    try:
        request = decode_request(body)
    except ProtocolError as error:
        tally[("legacy error " if error.legacy else "error ") + error.code] += 1
        if legacy and not error.legacy and error.code != "decode_error":
            raise Finding(f"a legacy map's {error.code} error is not answered in the legacy shape: {error}")
        check_error_reply(error)
        return
    except Exception as exc:
        known.count_or_raise(exc, tally)
        return
    if not isinstance(request, LegacyRequest):
        tally["v1 " + request.op] += 1
        if legacy:
            raise Finding(f"a legacy map was decoded as {request!r}")
        check_request(request, body, [])
        return
    tally["legacy " + request.op] += 1
    check_legacy_request(request)
    try:
        decode_request(body, [b""])
    except InvalidRequest as error:
        if not error.legacy or error.detail.get("field") != "buffers":
            raise Finding(f"a legacy request with a raw buffer refused as {error!r}") from error
    else:
        raise Finding("a legacy request with a raw buffer was accepted")


def mutator(data: bytes, max_size: int, seed: int, mutate_bytes=None) -> bytes:
    if mutate_bytes is None:
        import atheris

        mutate_bytes = atheris.Mutate
    rng = random.Random(seed)
    pick = rng.random()
    if pick < 0.25:
        out = mutate_bytes(data, min(max_size, len(data) + 64))
    elif pick < 0.88:
        message = structure.Message(data)
        out = structure.mutate_body(data, rng, message, lambda b: mutate_bytes(b, len(b) + 16),
                                    structure.legacy_request)
    else:
        out = structure.legacy_request(rng)
    return out if len(out) <= max_size else mutate_bytes(data, max_size)
