"""The transfer-overhead profiler, `python -m bridge.bench` (see __main__ for what it measures
and how to run it): cases.py is the payload sweep, lanes.py the transports and the server under
test, floors.py each transport's echo floor (C echoes in echo/, built on demand) and the lean
client lanes, measure.py the stage split and statistics, baseline.py the ExPhil-format
comparison with another server, report.py and plot.py the output, machine.py the machine and
commit recorded with every result.

The repo-only benches in the checkout's top-level bench/ (`python -m bench.transports`,
`bench.game_loop`, ...) build on floors.py and machine.py; nothing here imports them, and they
are not installed."""
