"""How soon a client learns that the server was killed: from kill -9 to the end of file on the
server's stdout (what a Port's owner and the cluster's failover wait for), for servers with the
exit guard (bridge.exit_guard) and without it (--no-exit-guard), and for a bare `import torch`
process killed alike (the floor without a guard), the three alternated in rounds in one run.

    python -m bench.exit_guard [--rounds 10] [--json bench/results/exit_guard.json]

A killed process's descriptors close only after its memory is freed, unless another process
still shares that memory: the guard does (docs/performance.md, "exit guard"). Each server
answers a ping before it is killed, and is killed 0.3 s later, idle.
"""

from __future__ import annotations

import argparse
import os
import select
import signal
import statistics
import subprocess
import sys
import time

from bridge.bench.machine import output_path, positive_count, summarize_us, write_results
from protocol.encode import encode_request
from protocol.framing import HEADER_SIZE, encode_frame, parse_frame_header

VARIANTS = {
    "server with the exit guard": [sys.executable, "-m", "bridge", "--device", "cpu"],
    "server --no-exit-guard": [sys.executable, "-m", "bridge", "--device", "cpu", "--no-exit-guard"],
    "import torch (no guard)": [sys.executable, "-c", "import sys, torch; sys.stdout.write('ready'); "
                                                       "sys.stdout.flush(); sys.stdin.read()"],
}
SETTLE_S = 0.3


def _read_exactly(fd: int, count: int, deadline: float) -> bytes:
    data = b""
    while len(data) < count:
        if not select.select([fd], [], [], max(0.0, deadline - time.monotonic()))[0]:
            raise TimeoutError(f"expected {count} bytes, got {len(data)} before the deadline")
        chunk = os.read(fd, count - len(data))
        if not chunk:
            raise EOFError(f"expected {count} bytes, got {len(data)} and end of file")
        data += chunk
    return data


def _wait_ready(name: str, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    fd = proc.stdout.fileno()
    if name.startswith("server"):
        proc.stdin.write(encode_frame(b"".join(bytes(p) for p in encode_request(1, "ping"))))
        proc.stdin.flush()
        length = parse_frame_header(_read_exactly(fd, HEADER_SIZE, deadline))
        _read_exactly(fd, length, deadline)
    else:
        _read_exactly(fd, len(b"ready"), deadline)


def kill_to_eof_ms(name: str) -> float:
    """One process of `name` started, made ready, killed: milliseconds to its stdout's EOF."""
    proc = subprocess.Popen(VARIANTS[name], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        _wait_ready(name, proc)
        time.sleep(SETTLE_S)
        fd = proc.stdout.fileno()
        start = time.perf_counter()
        os.kill(proc.pid, signal.SIGKILL)
        while True:
            select.select([fd], [], [])
            if not os.read(fd, 1 << 16):
                return (time.perf_counter() - start) * 1e3
    finally:
        proc.kill()
        proc.wait()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=positive_count, default=10)
    p.add_argument("--json", type=output_path)
    args = p.parse_args(argv)
    names = list(VARIANTS)
    times = {name: [] for name in names}
    for r in range(args.rounds):
        order = names[r % len(names):] + names[:r % len(names)]  # each variant first in turn
        for name in order:
            times[name].append(kill_to_eof_ms(name))
    summary = {name: {**summarize_us([t * 1e3 for t in values]), "ms": values} for name, values in times.items()}
    guarded, bare = statistics.median(times[names[0]]), statistics.median(times[names[1]])
    for name in names:
        s = summary[name]
        print(f"{name:>28}: p50 {s['p50_us'] / 1e3:6.2f} ms  p90 {s['p90_us'] / 1e3:6.2f} ms  "
              f"max {s['max_us'] / 1e3:6.2f} ms  over {s['n']} kills")
    print(f"the guard: kill to EOF {bare / guarded:.1f}x sooner at the median")
    if args.json:
        write_results(args.json, "exit_guard", {"rounds": args.rounds, "settle_s": SETTLE_S, "variants": summary,
                                                "median_ratio_without_over_with": bare / guarded})
    return 0


if __name__ == "__main__":
    from bridge.bench import exit_on_stop_signals

    exit_on_stop_signals()
    raise SystemExit(main())
