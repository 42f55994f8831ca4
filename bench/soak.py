"""Long-run stability of one server: the bridge is a long-lived process, so what it holds must
not grow with the requests and connections it has served.

One server (`python -m bridge --stdio --unix PATH --zmq ipc://PATH`, held by a PortClient) is
driven through the Python client library for `--rounds` rounds. Each round:

  * over one long-lived unix connection: a session opened, prefilled by a 60-frame scan, stepped
    `--steps` times, read back and closed; tensor handles put and freed; requests that must fail
    (a step of an unknown session, an unknown op, a step whose x has the wrong shape), each
    checked for its error code;
  * connection churn: `--churn` unix connections and as many ZeroMQ peers, each opening a
    session and a handle (the unix ones stepping once) and going away without closing or
    freeing anything: the server frees what a connection owned when it goes.

The session's inputs are the same every round, so its state after the steps must be bit for bit
the state of round 0 (the kernels are deterministic): a pool row reused after churn that kept an
old state, or any drift, shows there. After each round the bench records the server's resident
memory (VmRSS), open file descriptors and threads (from /proc); the server's sessions and
handles gauges (counts, pool bytes, handle bytes) must be back to 0. The bench stops with an
error at the first round that breaks either rule (`check_round`), so a written result means
every round kept both. The first third of the rounds is
warm-up, where resident memory climbs most (the rounds of bench/results/soak.json show it);
growth is measured from its end to the last round's.

    python -m bench.soak [--rounds 90] [--steps 100] [--churn 50] [--json bench/results/soak.json]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np

from bridge.bench.cases import DIM, DT_CLAMP, EXPHIL_SEQ, STATE, Case
from bridge.bench.lanes import TRANSPORTS, log_tail
from bridge.bench.machine import write_results
from bridge.client import BridgeError, PortClient, ServerExited, UnixClient, ZmqClient

# The long-lived session's batch: a few agents of the game loop's layer (DIM x STATE).
ROWS = 4
# How long closed connections' sessions and handles may take to be freed.
RELEASE_TIMEOUT_S = 10.0


def process_usage(pid: int) -> dict:
    """Resident memory (kB), open file descriptors and threads of process `pid` (Linux /proc)."""
    usage = {"fds": len(os.listdir(f"/proc/{pid}/fd"))}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key == "VmRSS":
                usage["rss_kB"] = int(value.split()[0])
            elif key == "Threads":
                usage["threads"] = int(value)
    return usage


def expect_error(reply, code: str, what: str) -> None:
    if reply.ok or reply.error.get("code") != code:
        raise RuntimeError(f"{what}: expected error {code}, got {reply.error if not reply.ok else 'ok'}")


class SessionScript:
    """The long-lived connection's work of one round: the same inputs every round."""

    def __init__(self, steps: int):
        self.window = Case("scan", EXPHIL_SEQ, ROWS).inputs(0)
        self.frames = [Case("step", 1, ROWS).inputs(1 + i) for i in range(steps)]
        self.A = self.window["A"]

    def run(self, client: UnixClient) -> np.ndarray:
        """The session's final state."""
        A = client.put(self.A)
        session = client.open_session(ROWS, DIM, STATE)
        w = self.window
        client.scan(w["x"], w["dt"], A, w["B"], w["C"], session=session, **DT_CLAMP).unwrap()
        for f in self.frames:
            client.step(session, f["x"], f["dt"], A, f["B"], f["C"], **DT_CLAMP).unwrap()
        state = np.array(client.session_state(session))
        client.close_session(session)
        f = self.frames[-1]
        expect_error(client.step(session, f["x"], f["dt"], A, f["B"], f["C"], **DT_CLAMP),
                     "unknown_session", "a step after session_close")
        expect_error(client.request("no_such_op", {}), "unknown_op", "an unknown op")
        other = client.open_session(ROWS, DIM, STATE)
        expect_error(client.step(other, f["x"][:, :-1], f["dt"], A, f["B"], f["C"], **DT_CLAMP),
                     "shape_mismatch", "a step whose x lacks a channel")
        client.close_session(other)
        for i in range(10):
            client.free(client.put(self.A * (i + 1)))
        client.free(A)
        return state


def churn(unix_path: str, zmq_endpoint: str, connections: int, A: np.ndarray, frame: dict) -> None:
    """Connections that open a session and a handle and leave without freeing them."""
    for _ in range(connections):
        with UnixClient(unix_path) as client:
            session = client.open_session(ROWS, DIM, STATE)
            client.step(session, frame["x"], frame["dt"], client.put(A), frame["B"], frame["C"]).unwrap()
        with ZmqClient(zmq_endpoint) as client:
            client.open_session(ROWS, DIM, STATE)
            client.put(A)


def held(stats: dict) -> dict:
    """What the server still holds for sessions and handles, by its gauges."""
    sessions, handles = stats["sessions"], stats["handles"]
    return {"sessions": sessions["sessions"], "pool_bytes": sessions["pool_bytes"],
            "handles": handles["handles"], "handle_bytes": handles["handle_bytes"]}


def wait_for_release(port: PortClient) -> dict:
    """The server's stats once churned connections' sessions and handles are freed (a ZeroMQ
    peer's departure reaches the server asynchronously), or as they stand after
    RELEASE_TIMEOUT_S."""
    deadline = time.monotonic() + RELEASE_TIMEOUT_S
    while True:
        stats = port.stats()
        if not any(held(stats).values()) or time.monotonic() > deadline:
            return stats
        time.sleep(0.05)


def requests_served(stats: dict) -> int:
    """Requests the server has read, its stats requests (wait_for_release's polls) left out:
    frames_in counts the stats request being answered, the ops table those answered before."""
    return stats["frames_in"] - stats["ops"].get("stats", {}).get("inference_count", 0) - 1


def check_round(r: int, state: np.ndarray, first_state: np.ndarray, stats: dict) -> None:
    """Raise unless round `r` ended with round 0's session state and nothing left held."""
    if not np.array_equal(state, first_state):
        raise RuntimeError(f"round {r}: the session's final state differs from round 0's "
                           f"(max |diff| {np.abs(state - first_state).max()})")
    left = held(stats)
    if any(left.values()):
        raise RuntimeError(f"round {r}: still held {RELEASE_TIMEOUT_S:.0f} s after every connection "
                           f"but the long-lived one closed: {left}")


def soak(rounds: int, steps: int, connections: int) -> dict:
    script = SessionScript(steps)
    with tempfile.TemporaryDirectory(prefix="bridge-soak-") as scratch, \
            tempfile.TemporaryFile(mode="w+b") as log:
        unix_path = TRANSPORTS["unix"].value(scratch)
        zmq_endpoint = TRANSPORTS["zmq-ipc"].value(scratch)
        port = PortClient(["--device", "cpu", "--stdio", "--unix", unix_path, "--zmq", zmq_endpoint],
                          stderr=log)
        try:
            samples = []
            with UnixClient(unix_path) as client:
                for r in range(rounds):
                    state = script.run(client)
                    if r == 0:
                        first_state = state
                    churn(unix_path, zmq_endpoint, connections, script.A, script.frames[0])
                    stats = wait_for_release(port)
                    check_round(r, state, first_state, stats)
                    sample = {"round": r, "requests": requests_served(stats), **process_usage(port.proc.pid)}
                    samples.append(sample)
                    print(f"round {r}: {sample['requests']} requests, rss {sample['rss_kB']} kB, "
                          f"{sample['fds']} fds, {sample['threads']} threads", flush=True)
        except (ServerExited, TimeoutError, OSError) as exc:
            raise RuntimeError(f"the server failed: {exc!r}; its log ends:\n{log_tail(log)}") from exc
        finally:
            port.close()
    return summarize(samples, steps, connections)


def summarize(samples: list[dict], steps: int, connections: int) -> dict:
    rounds = len(samples)
    first, warm, last = samples[0], samples[rounds // 3 - 1], samples[-1]
    served = last["requests"] - warm["requests"]
    growth = last["rss_kB"] - warm["rss_kB"]
    return {
        "case": f"{rounds} rounds: a {ROWS}x{DIM}x{STATE} session prefilled and stepped {steps} times over a "
                f"long-lived unix connection, handles, refused requests, and {connections} unix and "
                f"{connections} ZeroMQ connections churned per round",
        "requests": last["requests"],
        "connections": rounds * 2 * connections + 1,
        "warmup_rounds": warm["round"] + 1,
        "rss_kB_after_round_0": first["rss_kB"],
        "rss_kB_after_warmup": warm["rss_kB"],
        "rss_kB_last": last["rss_kB"],
        "rss_growth_kB": growth,
        "rss_growth_bytes_per_request": growth * 1024 / served,
        "fds": [first["fds"], last["fds"]],
        "threads": [first["threads"], last["threads"]],
        "rounds": samples,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=90, help="rounds; the first third warms up")
    p.add_argument("--steps", type=int, default=100, help="steps of the long-lived session per round")
    p.add_argument("--churn", type=int, default=50, help="unix and ZeroMQ connections churned per round")
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args(argv)
    if args.rounds < 3:
        p.error(f"--rounds: expected at least 3 (the first third warms up), got {args.rounds}")
    if args.steps < 1:
        p.error(f"--steps: expected at least 1, got {args.steps}")
    try:
        result = soak(args.rounds, args.steps, args.churn)
    except (RuntimeError, BridgeError) as exc:
        print(f"soak failed: {exc}", file=sys.stderr)
        return 1
    print(f"{result['requests']} requests over {result['connections']} connections: rss "
          f"{result['rss_kB_after_round_0']} kB after round 0, {result['rss_kB_after_warmup']} kB after "
          f"{result['warmup_rounds']} rounds of warm-up, {result['rss_kB_last']} kB at the end "
          f"({result['rss_growth_bytes_per_request']:.1f} bytes a request since warm-up), fds {result['fds']}, "
          f"threads {result['threads']}; every round's state equal to round 0's, nothing left held")
    if args.json:
        write_results(args.json, "soak", {"results": result})
    return 0


if __name__ == "__main__":
    sys.exit(main())
