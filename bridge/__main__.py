# Stop signals are recorded first: the imports below take a tenth of a second or so, in which one
# would otherwise end the server with a traceback or the signal's default death (stop_signals).
from bridge.stop_signals import record_stop_signals

_SIGNALLED: list[int] = []
record_stop_signals(_SIGNALLED)

# The stdout guard runs before any other import (the one above writes nothing) so that nothing
# (Python or C, at import time or later) can write into the protocol stream.
from bridge.stdio_guard import claim_protocol_stdout  # noqa: E402

_PROTOCOL_FD = claim_protocol_stdout()

from bridge.cli import main  # noqa: E402

raise SystemExit(main(protocol_fd=_PROTOCOL_FD, signalled=_SIGNALLED))
