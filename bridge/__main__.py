# The stdout guard runs before any other import so that nothing (Python or C, at import time
# or later) can write into the protocol stream.
from bridge.stdio_guard import claim_protocol_stdout

_PROTOCOL_FD = claim_protocol_stdout()

from bridge.cli import main  # noqa: E402

raise SystemExit(main(protocol_fd=_PROTOCOL_FD))
