"""The per-request timing split carried by every reply (protocol/SPEC.md §8).

Stages, in microseconds: decode (frame complete → request validated), queue (waiting for the
worker or the batcher), h2d (wire bytes → device tensors), kernel, d2h (device → host bytes),
encode (reply body built), server (frame complete → reply ready to write). A client's IPC cost
is its round trip minus server_us.
"""

from __future__ import annotations

import time

STAGES = ("decode", "queue", "h2d", "kernel", "d2h", "encode")
# Each stage's key in a reply's timing map.
STAGE_KEYS = tuple(f"{stage}_us" for stage in STAGES)

now_ns = time.perf_counter_ns


class Timing:
    __slots__ = ("received_ns", "stages_ns", "extra")

    def __init__(self, received_ns: int):
        # When the last byte of the request frame arrived.
        self.received_ns = received_ns
        self.stages_ns = dict.fromkeys(STAGES, 0)
        self.extra: dict[str, int] = {}

    def add(self, stage: str, ns: int) -> None:
        self.stages_ns[stage] += ns

    def as_reply(self) -> dict:
        """The `timing` map of a reply; server_us is measured now, so call this last."""
        server_ns = now_ns() - self.received_ns
        reply = {key: ns / 1000.0 for key, ns in zip(STAGE_KEYS, self.stages_ns.values())}
        reply["server_us"] = server_ns / 1000.0
        reply.update(self.extra)
        return reply
