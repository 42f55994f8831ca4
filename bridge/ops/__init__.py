"""Op handlers: `handler(server, call) -> result dict`. One module per family of ops."""

from . import core, legacy, scan

HANDLERS = {
    **core.HANDLERS,
    **scan.HANDLERS,
}
LEGACY_HANDLERS = legacy.HANDLERS
