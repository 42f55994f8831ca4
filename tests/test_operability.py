"""Issue 37's acceptance in one run of a real server with every lane and its metrics endpoint:
while clients work on two lanes, the endpoint is scraped; requests with spent deadlines and
cancels are sent; every malformed frame of the golden vectors and an oversized one come in;
connections owning sessions, handles and snapshots go away. Every request is answered, the pool
drains, and the server lives on."""

from __future__ import annotations

import threading
import time

import msgpack
import numpy as np

from bridge.client import PortClient, UnixClient, ZmqClient
from protocol.vectors import generate

from lane_helpers import raw_unix, read_reply, request_frame
from test_metrics import scan_inputs, scrape
from waiting import wait_until

MAX_FRAME = 1 << 20


def traffic(client, stop: threading.Event, counts: dict, failures: list, name: str) -> None:
    """Scans and steps until told to stop; every reply must be ok (a failure is kept in
    `failures` for the test to report: raised here, it would end only this thread)."""
    try:
        rng = np.random.default_rng()
        session = client.call("session_open", batch=2, dim=3, state=2)["session"]
        while not stop.is_set():
            client.scan(**scan_inputs(rng)).unwrap()
            step = {k: v[:, 0] for k, v in scan_inputs(rng).items() if k not in ("A",)}
            client.step(session, A=scan_inputs(rng)["A"], **step).unwrap()
            counts[name] += 2
        client.close_session(session)
    except Exception as exc:
        failures.append(f"{name}: {exc!r}")


def malformed_frames() -> list:
    """(name, frame, expected code, legacy) of every invalid golden vector that fits the frame
    limit (the oversized one is sent apart, at this server's limit)."""
    return [(name, frame, doc["error"]["code"], doc["error"]["legacy"])
            for name, frame, doc in generate.build_vectors() if doc["kind"] == "invalid"]


def test_an_operators_worst_day(tmp_path):
    unix_path, zmq_path = str(tmp_path / "b.sock"), f"ipc://{tmp_path}/b.ipc"
    args = ["--device", "cpu", "--stdio", "--unix", unix_path, "--zmq", zmq_path, "--metrics-port", "0",
            "--max-frame-size", str(MAX_FRAME)]
    with PortClient(args) as port:
        url = port.info()["metrics"]
        stop, counts, failures = threading.Event(), {"unix": 0, "zmq": 0}, []
        with UnixClient(unix_path) as unix, ZmqClient(zmq_path) as zmq_client:
            workers = [threading.Thread(target=traffic, args=(c, stop, counts, failures, n), daemon=True)
                       for c, n in ((unix, "unix"), (zmq_client, "zmq"))]
            for w in workers:
                w.start()
            try:
                # Scrapes while traffic flows: each parses, and the request counters never go back.
                seen = 0.0
                for _ in range(5):
                    samples = scrape(url)
                    served = sum(v for (name, _), v in samples.items() if name == "scan_bridge_requests_total")
                    assert served >= seen
                    seen = served
                    time.sleep(0.05)

                # Spent deadlines and cancels, beside the traffic.
                with UnixClient(unix_path) as late:
                    rng = np.random.default_rng()
                    replies = [late.submit("scan", scan_inputs(rng), deadline_s=0) for _ in range(5)]
                    assert {f.result(60).error["code"] for f in replies} == {"deadline_exceeded"}
                    cancels = [late.submit("cancel", {"id": i}) for i in (10**9, "gone")]
                    assert [f.result(60).result for f in cancels] == [{"cancelled": False}] * 2

                # Every malformed frame is answered with its code, on one connection that serves on.
                sock = raw_unix(unix_path)
                reader = sock.makefile("rb", buffering=0)
                for name, frame, code, legacy in malformed_frames():
                    sock.sendall(frame)
                    if legacy:
                        body = read_frame_body(reader)
                        assert msgpack.unpackb(body)["status"] == "error", name
                    else:
                        assert read_reply(reader).error["code"] == code, name
                sock.sendall((MAX_FRAME + 1).to_bytes(4, "big") + bytes(MAX_FRAME + 1))
                assert read_reply(reader).error["code"] == "frame_too_large"
                sock.sendall(request_frame(1, "ping"))
                assert read_reply(reader).result == {"pong": True}
                sock.close()

                # Connections that go away owning things.
                for _ in range(3):
                    with UnixClient(unix_path) as owner:
                        session = owner.call("session_open", batch=1, dim=3, state=2)["session"]
                        owner.call("session_snapshot", session=session)
                        owner.put(np.ones(8, np.float32))
                with ZmqClient(zmq_path) as owner:
                    owner.call("session_open", batch=1, dim=3, state=2)
                    owner.put(np.ones(8, np.float32))
            finally:
                stop.set()
                for w in workers:
                    w.join(60)
        assert not any(w.is_alive() for w in workers), "a traffic thread never finished"
        assert not failures, f"traffic beside the rest got errors: {failures}"
        assert counts["unix"] > 0 and counts["zmq"] > 0

        def drained() -> bool:
            stats = port.stats()
            return stats["sessions"]["sessions"] == 0 and stats["handles"]["handles"] == 0 \
                and stats["sessions"]["snapshot_bytes"] == 0

        wait_until(drained, "what the departed connections owned was not freed", timeout=30, interval=0.05)
        stats = port.stats()
        assert stats["released"]["closed"]["sessions"] >= 4 and stats["released"]["closed"]["snapshots"] == 3
        assert stats["errors"]["deadline_exceeded"] == 5 and stats["errors"]["frame_too_large"] == 1
        assert port.health()["ready"]
        samples = scrape(url)
        assert samples[("scan_bridge_sessions", ())] == 0
        assert samples[("scan_bridge_errors_total", (("code", "deadline_exceeded"),))] == 5


def read_frame_body(reader) -> bytes:
    from bridge.streams import read_frame

    body = read_frame(reader)
    assert body is not None, "the server closed the connection instead of replying"
    return body
