"""What the metrics endpoint (`--metrics-port`, issue 37) costs a request.

Off, a request's stats are counters; on, its stage times are also counted into histogram buckets
(bridge.stats). That is the only work the endpoint adds to serving (the rest runs at scrape), so
it is timed where it happens: `Stats.record` of a step's timing with histograms off and on, in
alternated rounds. For scale, the same run measures a served step's `server_us` (back to back,
over stdio) with the endpoint on, and what one scrape takes.

    python -m bench.metrics_cost [--records N] [--rounds N] [--steps N] [--json bench/results/metrics_cost.json]
"""

from __future__ import annotations

import argparse
import statistics
import time
import urllib.request

import numpy as np

from bridge.bench.machine import output_path, positive_count, summarize_us, write_results
from bridge.client import PortClient
from bridge.stats import Stats
from bridge.timing import STAGE_KEYS

# Steps between the served run's scrapes of /metrics.
SCRAPE_EVERY = 10
# A step's timing as the dispatcher records it: every stage, the whole, the rows of its launch.
STEP_TIMING = {**{key: 5.0 for key in STAGE_KEYS}, "server_us": 60.0, "batch_rows": 1}
STEP_SHAPES = {"batch": 32, "dim": 512, "state": 16}


def record_ns(histograms: bool, records: int) -> float:
    """Nanoseconds per `Stats.record` of a step's timing."""
    stats = Stats(histograms=histograms)
    start = time.perf_counter_ns()
    for _ in range(records):
        stats.record("step", STEP_TIMING, ok=True)
    return (time.perf_counter_ns() - start) / records


def served_steps(steps: int) -> tuple[list[float], list[float]]:
    """server_us of `steps` back-to-back steps of a 32x512x16 session, and each scrape's µs
    (one every SCRAPE_EVERY steps), from a server with the endpoint on."""
    rng = np.random.default_rng(0)
    b, d, n = STEP_SHAPES["batch"], STEP_SHAPES["dim"], STEP_SHAPES["state"]
    f32 = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
    inputs = {"x": f32(b, d), "dt": np.abs(f32(b, d)) * 0.1, "A": -np.abs(f32(d, n)), "B": f32(b, n), "C": f32(b, n)}
    server_us, scrape_us = [], []
    with PortClient(["--device", "cpu", "--metrics-port", "0"]) as client:
        url = client.info()["metrics"]
        session = client.call("session_open", **STEP_SHAPES)["session"]
        for i in range(steps):
            reply = client.request("step", {"session": session, **inputs})
            reply.unwrap()
            server_us.append(reply.timing["server_us"])
            if i % SCRAPE_EVERY == SCRAPE_EVERY - 1:
                start = time.perf_counter_ns()
                with urllib.request.urlopen(url, timeout=10) as response:
                    response.read()
                scrape_us.append((time.perf_counter_ns() - start) / 1e3)
    return server_us, scrape_us


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.metrics_cost", description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=positive_count, default=200_000, help="records a round")
    parser.add_argument("--rounds", type=positive_count, default=7, help="alternated rounds of off and on")
    parser.add_argument("--steps", type=positive_count, default=500, help="served steps for scale")
    parser.add_argument("--json", type=output_path, default="bench/out/metrics_cost.json")
    args = parser.parse_args(argv)
    if args.steps < SCRAPE_EVERY:
        parser.error(f"--steps: expected at least {SCRAPE_EVERY} (a scrape every {SCRAPE_EVERY} steps), got {args.steps}")

    off, on = [], []
    for _ in range(args.rounds):
        off.append(record_ns(False, args.records))
        on.append(record_ns(True, args.records))
    extra_us = (statistics.median(on) - statistics.median(off)) / 1e3
    server_us, scrape_us = served_steps(args.steps)
    step_p50 = float(np.percentile(server_us, 50))
    results = {
        "record_ns": {"off": off, "on": on, "off_median": statistics.median(off), "on_median": statistics.median(on)},
        "extra_per_request_us": extra_us,
        "step_server_us": summarize_us(server_us),
        "extra_over_step_server_us_p50": extra_us / step_p50,
        "scrape": summarize_us(scrape_us),
    }
    print(f"Stats.record: off {results['record_ns']['off_median']:.0f} ns, on {results['record_ns']['on_median']:.0f} ns "
          f"(medians of {args.rounds} rounds): {extra_us:.2f} µs more a request, {100 * extra_us / step_p50:.1f} % of a "
          f"32x512x16 step's server_us p50 ({step_p50:.0f} µs); a scrape p50 {results['scrape']['p50_us']:.0f} µs")
    write_results(args.json, "metrics_cost", {
        "method": __doc__.split("\n\n")[1].replace("\n", " "),
        "settings": {"records": args.records, "rounds": args.rounds, "steps": args.steps, "step": STEP_SHAPES},
        "results": results,
    })


if __name__ == "__main__":
    from bridge.bench import exit_on_stop_signals

    exit_on_stop_signals()
    main()
