"""The transfer-overhead profiler, `python -m bridge.bench` (see __main__ for what it measures
and how to run it): cases.py is the payload sweep, lanes.py the transports and the server under
test, measure.py the stage split and statistics, baseline.py the ExPhil-format comparison with
another server, report.py and plot.py the output."""
