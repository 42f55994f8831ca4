"""The transfer-overhead profiler, `python -m bridge.bench` (see __main__ for what it measures
and how to run it): cases.py is the payload sweep, lanes.py the transports and the server under
test, floors.py each transport's echo floor (C echoes in echo/, built on demand) and the lean
client lanes, measure.py the stage split and statistics, baseline.py the ExPhil-format
comparison with another server, report.py and plot.py the output, machine.py the machine and
commit recorded with every result.

The repo-only benches in the checkout's top-level bench/ (`python -m bench.transports`,
`bench.game_loop`, ...) build on floors.py and machine.py; nothing here imports them, and they
are not installed. Each bench's main installs exit_on_stop_signals."""

import signal


def exit_on_stop_signals() -> None:
    """SIGTERM and SIGHUP end the run through every `finally`, as Ctrl-C does: the servers and
    echoes it started are stopped and their scratch directories removed, where the signals'
    default action would end the process with none of that done."""
    def stop(signum, _frame):
        raise SystemExit(128 + signum)

    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, stop)
