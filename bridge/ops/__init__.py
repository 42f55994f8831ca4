"""Op handlers, registered by op name and reply codec (protocol.codecs).

A handler is `handler(server, call) -> result dict`, or a `bridge.dispatcher.Background` whose
`finish()` returns it apart from the other ops (model_load). One module per family of ops, each with
its table of handlers, registered in `REGISTRY` below. Handlers that are
`bridge.batcher.BatchedOp`s (step, scan) are batched by the dispatcher; an op with a fast path
for requests it can serve straight from their frame (the native step) offers it through
`fast_path(server)` (see bridge.dispatcher).

A new op: its arguments in protocol/schema.py's OPS, one handler in a module here, registered.
"""

from __future__ import annotations

import protocol

from . import core, grad, legacy, models, scan, sessions


class Registry:
    """Which handler serves each op of each codec."""

    def __init__(self, tables: dict | None = None):
        self._tables = {codec.name: dict((tables or {}).get(codec.name, {})) for codec in protocol.CODECS}

    def register(self, op: str, handler, codec=protocol.V1) -> None:
        if op not in codec.ops:
            raise ValueError(f"op: expected one of the {codec.name} protocol's ops {sorted(codec.ops)}, got {op!r}")
        self._tables[codec.name][op] = handler

    def replacing(self, handlers: dict, codec=protocol.V1) -> Registry:
        """A copy with `handlers` serving in place of the registered ones (tests)."""
        copy = Registry(self._tables)
        for op, handler in handlers.items():
            copy.register(op, handler, codec)
        return copy

    def without(self, op: str, codec=protocol.V1) -> Registry:
        """A copy with no handler for `op` (tests of check_complete)."""
        copy = Registry(self._tables)
        del copy._tables[codec.name][op]
        return copy

    def check_complete(self) -> None:
        """Every op a codec's decoder lets through has a handler: the decoders answer any other op
        (unknown_op), so a missing one would leave its requests unanswerable."""
        for codec in protocol.CODECS:
            table = self._tables[codec.name]
            if set(table) != set(codec.ops):
                raise ValueError(f"{codec.name} handlers: expected one for each of {sorted(codec.ops)}, "
                                 f"got {sorted(table)}")

    def handler(self, request):
        """The handler of a decoded request (its codec's decoder refused any op not registered)."""
        return self._tables[request.codec.name][request.op]

    def fast_path(self, server):
        """The fast path ops offer for `server` (`handler.fast_path(server)`), or None: the
        dispatcher hands it every frame first, so there is one at most (several ops may offer
        the same one: the native path serves steps and model steps)."""
        offered = []
        for table in self._tables.values():
            for handler in table.values():
                path = handler.fast_path(server) if hasattr(handler, "fast_path") else None
                if path is not None and not any(path is other for other in offered):
                    offered.append(path)
        if len(offered) > 1:
            raise ValueError(f"fast paths: expected one at most, got {len(offered)}")
        return offered[0] if offered else None


REGISTRY = Registry()
for _op, _handler in {**core.HANDLERS, **scan.HANDLERS, **grad.HANDLERS, **sessions.HANDLERS,
                     **models.HANDLERS}.items():
    REGISTRY.register(_op, _handler)
for _op, _handler in legacy.HANDLERS.items():
    REGISTRY.register(_op, _handler, protocol.LEGACY)
