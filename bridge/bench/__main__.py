"""`python -m bridge.bench`: where does a request's time go — the pipe, the codec, the copies
or the kernel?

Spawns `python -m bridge` with every transport this checkout serves and, per backend, sends a
payload sweep (a 32×512×16 step, scans up to ExPhil's 32×60×512×16 window, then up to ~64 MB)
over each transport, one request at a time. Each round trip is cut into stages — client
encode, server decode, queue, h2d, kernel, d2h, server encode, the server's unmeasured rest,
client decode and the transport (round trip − server_us − client codec) — reported as
p50/p90/p99. Interleaved with it, the same request bytes go through an echo over the same
channel (a C echo for pipes): the floor, to which each transport's cost is a ratio. Per
transport, latency ≈ a + b·bytes is fitted, and the step and the ExPhil window are judged
against a 60 FPS frame (16.7 ms).

    python -m bridge.bench --quick --json bench/out/bridge-bench-quick.json --plot bench/out/bridge-bench.png
    python -m bridge.bench --backends all --sizes step,60,496
    python -m bridge.bench --baseline ".venv/bin/python -m bridge.bench.exphil_standin"   # an interpreter with msgpack
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time

from bridge import client as clients

from . import baseline as baseline_mod
from . import exit_on_stop_signals
from . import floors
from .cases import DEFAULT_SIZES, EXPHIL_SEQ, QUICK_SIZES, Case, parse_sizes
from .lanes import BenchError, ConnectedServer, SpawnedServer, choose_transports
from .machine import commit_info, machine_info, output_path
from .measure import fit_rows, make_row, measure_case
from .plot import plot
from .report import Progress, baseline_table, fits_table, frame_budget_table, results_table

SCHEMA_VERSION = 1
# "--backends all" leaves out the float64 oracle: it materializes [batch, seq, dim, state]
# (half a GB at the largest size) and serves tests, not traffic.
ORACLE_BACKEND = "reference"


def connect_endpoint(text: str) -> str:
    """argparse type of --connect: refused here, not by libzmq once the run started."""
    if re.fullmatch(r"unix:.+|ipc://.+|tcp://[^/]+:\d+", text):
        return text
    raise argparse.ArgumentTypeError(f"expected unix:PATH, ipc://PATH or tcp://HOST:PORT, got {text!r}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bridge.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help=f"fewer sizes ({QUICK_SIZES}) and iterations: under a minute on a 2-core machine")
    p.add_argument("--sizes", help=f"comma-separated 'step' and scan sequence lengths (default {DEFAULT_SIZES})")
    p.add_argument("--iterations", type=int, help="timed iterations per size (default 100; --quick 15)")
    p.add_argument("--warmup", type=int, help="untimed iterations per size first (default 2; --quick 1)")
    p.add_argument("--max-seconds", type=float,
                   help="time cap per size, after at least 3 timed iterations (default 10; --quick 1.5)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"), help="the server's --device")
    p.add_argument("--backends", default="default",
                   help="'default' (the server's pick for the device), 'all' (every available backend but "
                        "the reference oracle) or comma-separated names")
    p.add_argument("--transports", help="comma-separated transports from stdio, unix, zmq-ipc, zmq-tcp "
                                         "(default: all that this checkout serves)")
    p.add_argument("--connect", metavar="ENDPOINT", type=connect_endpoint,
                   help="measure a running server instead of spawning one: unix:PATH, ipc://PATH or tcp://HOST:PORT")
    p.add_argument("--server-arg", action="append", default=[], help="one more argument for the server (repeatable)")
    p.add_argument("--baseline", metavar="CMD",
                   help="also send ExPhil-format requests to this Port-style server command and to ours, "
                        "and print the ratio (exit 1 where their results differ or it fails)")
    p.add_argument("--json", type=output_path, metavar="FILE",
                   help="write the rows, machine_info, commit_info and each server's info here")
    p.add_argument("--plot", type=output_path, metavar="FILE.png", help="write stacked bars of the stages here (needs matplotlib)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    return p


def _plan(args) -> tuple[int, int, float]:
    iterations = args.iterations if args.iterations is not None else (15 if args.quick else 100)
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
    max_seconds = args.max_seconds if args.max_seconds is not None else (1.5 if args.quick else 10.0)
    if iterations < 1 or warmup < 0 or not 0 < max_seconds < math.inf:
        raise BenchError(f"expected --iterations >= 1, --warmup >= 0 and a finite --max-seconds > 0, got "
                         f"{iterations}, {warmup} and {max_seconds}")
    return iterations, warmup, max_seconds


def _named_backends(text: str) -> list[str] | None:
    """Backends to run: [None] for the server's default, None for 'all' (known once a server
    says what it has)."""
    if text == "default":
        return [None]
    if text == "all":
        return None
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise BenchError(f"--backends: expected 'default', 'all' or names, got {text!r}")
    return names


def run_sweep(cases: list[Case], open_server, backends: list[str] | None, plan: tuple[int, int, float],
              seed: int, progress: Progress) -> tuple[list[dict], list[dict], list[dict]]:
    """Rows for every backend × case × transport, what was skipped with why, and the `info` of
    each server measured. `open_server(backend)` gives a SpawnedServer or ConnectedServer
    (backend None: its default)."""
    iterations, warmup, max_seconds = plan
    per_backend = len(cases) * (warmup + iterations)
    progress.total = per_backend * (len(backends) if backends else 1)
    rows, skipped, infos = [], [], []
    queue = list(backends) if backends else [None]
    discover = backends is None  # "all": the first server says which backends there are
    while queue:
        backend = queue.pop(0)
        progress.start(f"starting the server (backend {backend or 'default'})")
        try:
            server = open_server(backend)
        except BenchError as exc:
            skipped.append({"what": f"backend {backend}", "reason": str(exc)})
            progress.skip_to(progress.done + per_backend)
            continue
        with server:
            skipped += server.skipped
            infos.append(server.info)
            if discover:
                discover = False
                others = [b for b in server.info["kernels"]["available"]
                          if b not in (ORACLE_BACKEND, server.backend)]
                queue += others
                progress.total += per_backend * len(others)
            ops = server.info["protocol"]["ops"]
            for case in cases:
                start = progress.done
                if case.op not in ops:
                    skipped.append({"what": f"{case.name} on backend {server.backend}",
                                    "reason": f"the server has no {case.op!r} op (ops: {', '.join(ops)})"})
                    progress.skip_to(start + warmup + iterations)
                    continue
                progress.start(f"{case.label} · backend {server.backend} · {', '.join(l.transport for l in server.lanes)}")
                try:
                    samples = measure_case(case, server.lanes, iterations=iterations, warmup=warmup,
                                           max_seconds=max_seconds, seed=seed, on_iteration=progress.advance)
                except (clients.BridgeError, clients.ServerExited, floors.EchoUnavailable, TimeoutError,
                        OSError, EOFError) as exc:
                    # The run stops here, so that no results document stands for a sweep cut short.
                    raise BenchError(f"{case.label} on backend {server.backend} failed, so nothing is "
                                     f"written: {exc}") from exc
                progress.skip_to(start + warmup + iterations)
                for lane in server.lanes:
                    rows.append(make_row(case, lane.transport, server.backend, server.device, samples[lane.transport]))
                    if lane.floor_missing:
                        skipped.append({"what": f"floor of {lane.transport}", "reason": lane.floor_missing})
    return rows, _unique(skipped), infos


def _unique(items: list[dict]) -> list[dict]:
    return list({(i["what"], i["reason"]): i for i in items}.values())


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    started = time.monotonic()
    server_args = ["--device", args.device, *args.server_arg]
    try:
        cases = parse_sizes(args.sizes or (QUICK_SIZES if args.quick else DEFAULT_SIZES))
        plan = _plan(args)
        backends = _named_backends(args.backends)
        if args.connect:
            if backends != [None] or args.transports or args.server_arg or args.device != "auto":
                raise BenchError("--connect: the server is already running; expected no --backends, "
                                 "--transports, --server-arg or --device with it")
            if args.baseline:  # it would be measured beside a server of its own, not the one connected to
                raise BenchError("--baseline: it compares a server it spawns; expected no --connect with it")
            skipped = []

            def open_server(backend):
                return ConnectedServer(args.connect)
        else:
            specs, skipped = choose_transports(args.transports)

            def open_server(backend):
                return SpawnedServer(specs, [*server_args, *(["--backend", backend] if backend else [])])
    except (ValueError, BenchError) as exc:
        print(f"python -m bridge.bench: {exc}", file=sys.stderr)
        return 2
    progress = Progress(1)
    baseline_rows = []
    failures = []  # why the run exits 1 after reporting what it measured
    try:
        rows, sweep_skipped, servers = run_sweep(cases, open_server, backends, plan, args.seed, progress)
    except BenchError as exc:
        progress.finish()
        print(f"python -m bridge.bench: {exc}", file=sys.stderr)
        return 1
    skipped += sweep_skipped
    windows = baseline_mod.baseline_cases(cases)
    if args.baseline and not windows:
        skipped.append({"what": "--baseline", "reason": f"--sizes has no window of at most ExPhil's "
                                                        f"{EXPHIL_SEQ} timesteps"})
    elif args.baseline:
        iterations, warmup, max_seconds = plan
        measured = list(dict.fromkeys(info["backend"] for info in servers))  # started, so named by their info
        progress.total = progress.done + len(measured) * len(windows) * (warmup + iterations)
        progress.start(f"baseline: {args.baseline}")
        for backend in measured:  # against each server the sweep measured
            try:  # a baseline that fails loses only itself: the finished sweep is still reported
                rows_of = baseline_mod.run_baseline(args.baseline, windows,
                                                    [*server_args, "--backend", backend],
                                                    iterations=iterations, warmup=warmup, max_seconds=max_seconds,
                                                    seed=args.seed, on_iteration=progress.advance)
            except BenchError as exc:
                failures.append(f"--baseline (backend {backend}): {exc}")
                continue
            baseline_rows += [{"backend": backend, **row} for row in rows_of]
        differ = [r["case"] for r in baseline_rows if not r["results_agree"]]
        if differ:
            failures.append(f"--baseline: its results differ from python -m bridge's on {', '.join(differ)}")
    progress.finish()
    if not rows:
        print("python -m bridge.bench: nothing was measured: " + "; ".join(s["reason"] for s in skipped),
              file=sys.stderr)
        return 1

    labels = {case.name: case.label for case in cases}
    step = next((c.name for c in cases if c.op == "step"), None)
    window = next((c.name for c in cases if c.is_exphil_window), None)
    fits = fit_rows(rows)
    print(results_table(rows, labels))
    print(fits_table(fits))
    print(frame_budget_table(rows, step, window, labels))
    if baseline_rows:
        print(baseline_table(args.baseline, baseline_rows))
    for s in skipped:
        print(f"skipped {s['what']}: {s['reason']}")
    elapsed = time.monotonic() - started
    print(f"\n{sum(r['iterations'] for r in rows)} timed round trips in {elapsed:.1f} s")

    if args.json:
        document = {"benchmark": "bridge-bench", "schema_version": SCHEMA_VERSION,
                    "machine_info": machine_info(), "commit_info": commit_info(),
                    # What each server said of itself: its threads, kernels' SIMD variant, limits
                    # and versions, which machine_info (this process's) does not show for a
                    # server with arguments of its own or one reached by --connect.
                    "servers": servers,
                    "config": {"argv": sys.argv[1:] if argv is None else list(argv), "quick": args.quick,
                               "sizes": [c.name for c in cases], "iterations": plan[0], "warmup": plan[1],
                               "max_seconds": plan[2], "server_args": None if args.connect else server_args},
                    "rows": rows, "fits": fits,
                    "baseline_command": args.baseline, "baseline": baseline_rows, "skipped": skipped,
                    "failures": failures, "elapsed_s": elapsed}
        with open(args.json, "w") as f:
            json.dump(document, f, indent=1)
        print(f"wrote {args.json}")
    if args.plot:
        device = rows[0]["device"]
        why_not = plot(rows, args.plot, labels, f"scan-bridge: where a request's time goes (p50 per stage), device {device}")
        print(f"wrote {args.plot}" if why_not is None else f"no plot: {why_not}")
    for failure in failures:
        print(f"python -m bridge.bench: {failure}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    exit_on_stop_signals()
    raise SystemExit(main())
