"""The stop signals, recorded from the first line `python -m bridge` runs (bridge/__main__.py):
one that comes while the server imports and starts ends start-up quietly (bridge.cli), where
before its handlers were in place SIGINT gave KeyboardInterrupt's traceback and SIGTERM or
SIGHUP killed it without a word. Imports nothing but `signal`, to be in place that early."""

from __future__ import annotations

import signal

# SIGHUP too: an operator's terminal closing would otherwise kill the server without its drain,
# leaving replies unsent and a --unix socket file behind.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def record_stop_signals(signalled: list[int]) -> dict:
    """Have every stop signal appended to `signalled`, and nothing more; returns the handlers
    replaced. The handler only records: it runs in the main thread between bytecodes, possibly
    while that thread holds a lock (Event.wait holds its Condition's), so taking any lock there
    (Event.set() included) can deadlock the process."""
    return {signum: signal.signal(signum, lambda signum, frame: signalled.append(signum)) for signum in STOP_SIGNALS}


class StopSignalsHeld:
    """Within the block a stop signal is only recorded; leaving it puts the handlers back and
    delivers what came. So no signal's exception cuts a step that must finish as one: Popen
    interrupted after its fork returns no child, and nobody would stop the one it started.
    Only handlers written in Python are held, and only in the main thread, the one Python runs
    them in; a signal's default action stays as it is."""

    def __enter__(self) -> StopSignalsHeld:
        import threading  # here, so that importing this module stays as early as it must be

        self.signalled: list[int] = []
        self.replaced: dict = {}
        if threading.current_thread() is threading.main_thread():
            for signum in STOP_SIGNALS:
                if callable(signal.getsignal(signum)):
                    self.replaced[signum] = signal.signal(signum, lambda signum, frame: self.signalled.append(signum))
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self.replaced.items():
            signal.signal(signum, handler)
        for signum in self.signalled:
            signal.raise_signal(signum)  # runs its handler before returning
