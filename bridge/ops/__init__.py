"""Op handlers: `handler(server, call) -> result dict`. One module per family of ops. Handlers
that are `bridge.batcher.BatchedOp`s (step, scan) are batched by the dispatcher."""

from . import core, legacy, scan, sessions

HANDLERS = {
    **core.HANDLERS,
    **scan.HANDLERS,
    **sessions.HANDLERS,
}
LEGACY_HANDLERS = legacy.HANDLERS
