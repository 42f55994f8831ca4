"""Reply codecs: how the answers to a request are written.

A decoded request carries its codec (`request.codec`), and so does a `ProtocolError` raised while
decoding one (`error.codec`), so a server answers every request the same way whatever form it
came in: v1 (SPEC.md §3) or ExPhil's legacy form (§9), whose requests have their own ops and
whose replies have their own shape.

    parts = request.codec.reply(request, result, timing, buffers)
    parts = request.codec.error(request.reply_id, code, message, detail)
"""

from __future__ import annotations

from typing import Callable

from .encode import encode_error, encode_reply
from .legacy import LEGACY
from .schema import OPS


class V1Codec:
    """Protocol v1: `{"v", "id", "ok", "result" | "error", "timing"}`."""

    name = "v1"
    ops = tuple(OPS)
    stats_prefix = ""

    def reply(self, request, result: dict, timing: dict | Callable[[], dict], buffers: list | None = None) -> list:
        """The success reply; with `buffers` (a multipart request's), its tensors go there."""
        return encode_reply(request.id, result, timing, buffers=buffers)

    def error(self, request_id, code: str, message: str, detail: dict | None = None) -> list:
        return encode_error(request_id, code, message, detail)


V1 = V1Codec()
CODECS = (V1, LEGACY)


def request_facts(body, buffers) -> tuple:
    """(codec, id to reply under, op the stats count it for) of the request in `body`, as far as
    they can be read (else v1, no id, None): for a transport that answers or drops it unread."""
    from .decode import decode_request  # decode imports this module
    from .errors import ProtocolError

    try:
        request = decode_request(body, buffers)
    except ProtocolError as exc:
        return exc.codec, exc.request_id, exc.stats_op
    return request.codec, request.reply_id, request.stats_op


def error_reply_for(body, buffers, code: str, message: str, detail: dict | None = None) -> tuple[list, str | None]:
    """An error reply to the request in `body`, in its codec and with its id where they can be
    read (else v1 with no id), and the op the stats count it for (None where no known op was
    read): for a transport that turns a request away unread."""
    codec, request_id, stats_op = request_facts(body, buffers)
    return codec.error(request_id, code, message, detail), stats_op
