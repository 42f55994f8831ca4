"""The Prometheus endpoint (`--metrics-port`, bridge.metrics): off by default; on, it exports the
server's counters, stage and batch histograms and holdings, agreeing with `stats`."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
import threading
import time
import urllib.parse
import urllib.request

import msgpack
import numpy as np
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from bridge.client import BridgeError, PortClient, server_env
from protocol import ERROR_CODES
from bridge.stats import LATENCY_BUCKETS_US, Histogram, Stats
from waiting import wait_until


def scrape(url: str) -> dict:
    """Every sample by (name, sorted labels)."""
    with urllib.request.urlopen(url, timeout=10) as response:
        assert response.headers["Content-Type"].startswith("text/plain")
        text = response.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def scan_inputs(rng, batch=2, seq=5, dim=3, state=2) -> dict:
    f32 = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
    return {"x": f32(batch, seq, dim), "dt": np.abs(f32(batch, seq, dim)), "A": -np.abs(f32(dim, state)),
            "B": f32(batch, seq, state), "C": f32(batch, seq, state)}


def test_the_endpoint_agrees_with_stats_while_serving():
    rng = np.random.default_rng()
    with PortClient(["--device", "cpu", "--metrics-port", "0"]) as client:
        url = client.info()["metrics"]
        assert url.startswith("http://127.0.0.1:") and url.endswith("/metrics")
        for _ in range(3):
            client.scan(**scan_inputs(rng)).unwrap()
        bad = scan_inputs(rng)
        bad["A"] = bad["A"][:, :1]
        with pytest.raises(BridgeError):
            client.scan(**bad).unwrap()
        session = client.call("session_open", batch=1, dim=3, state=2)["session"]
        samples = scrape(url)
        stats = client.stats()
        client.call("session_close", session=session)

    scan = stats["ops"]["scan"]
    assert samples[("scan_bridge_requests_total", (("op", "scan"), ("outcome", "success")))] == scan["success_count"] == 3
    assert samples[("scan_bridge_requests_total", (("op", "scan"), ("outcome", "failure")))] == scan["failure_count"] == 1
    assert samples[("scan_bridge_kernel_launches_total", (("op", "scan"),))] == scan["execution_count"]
    assert samples[("scan_bridge_inferences_total", (("op", "scan"),))] == scan["inference_count"] == 3
    assert samples[("scan_bridge_errors_total", (("code", "shape_mismatch"),))] == stats["errors"]["shape_mismatch"]
    # The codes no reply has used yet are there, at 0.
    assert set(stats["errors"]) == {"shape_mismatch"}
    assert {code: samples[("scan_bridge_errors_total", (("code", code),))] for code in ERROR_CODES} == {
        code: (1 if code == "shape_mismatch" else 0) for code in ERROR_CODES}
    assert samples[("scan_bridge_sessions", ())] == 1
    assert samples[("scan_bridge_frames_in_total", (("lane", "stdio"),))] >= 6
    server = (("op", "scan"), ("stage", "server"))
    assert samples[("scan_bridge_stage_seconds_count", server)] == 3
    assert samples[("scan_bridge_stage_seconds_bucket", (("le", "+Inf"),) + server)] == 3
    assert samples[("scan_bridge_stage_seconds_sum", server)] == pytest.approx(scan["server_us"] * 1e-6, rel=1e-6)
    assert samples[("scan_bridge_batch_rows_count", (("op", "scan"),))] == 3


def test_requests_refused_before_they_run_count_as_their_ops_failures(inproc):
    """Found in review: a request refused as its arguments were read (missing_argument), past
    --max-pending (overloaded) or while the server drains (shutting_down) was counted only by
    its code, so the per-op failure counts, and an alert on their ratio, read nothing during
    an overload or a restart. A frame that names no known op is counted by its code alone."""
    from bridge.transports.base import Connection
    from bridge_fakes import RecordingConnection

    srv, conn, busy = inproc(max_pending=1), RecordingConnection(), RecordingConnection()
    assert srv.request(conn, "scan", x=torch.zeros(1, 2, 3)).error["code"] == "missing_argument"
    srv.hold(busy)  # the one request --max-pending allows, in flight
    assert srv.request(conn, "session_open", batch=1, dim=2, state=2).error["code"] == "overloaded"
    srv.go()
    srv.server.stop_requested.set()
    assert srv.request(conn, "session_open", batch=1, dim=2, state=2).error["code"] == "shutting_down"
    assert srv.request(conn, "no_such_op").error["code"] == "unknown_op"
    # An ExPhil request (SPEC §9) refused for its arguments: its legacy op's failure.
    legacy_replies = []
    legacy = Connection("test")
    legacy.send = lambda parts, buffers=None: legacy_replies.append(msgpack.unpackb(b"".join(parts)))
    srv.dispatcher.on_frame(legacy, bytearray(msgpack.packb({"op": "scan", "batch": 1})), time.perf_counter_ns())
    assert legacy_replies and legacy_replies[0]["status"] == "error", legacy_replies
    stats = srv.server.stats.snapshot()
    assert stats["ops"]["scan"]["failure_count"] == 1 and stats["ops"]["session_open"]["failure_count"] == 2
    assert stats["ops"]["legacy_scan"]["failure_count"] == 1
    assert "no_such_op" not in stats["ops"]
    assert stats["errors"] == {"missing_argument": 2, "overloaded": 1, "shutting_down": 1, "unknown_op": 1}


def test_exphil_requests_are_timed_as_v1_ones_are(inproc):
    """A legacy reply has no timing to carry, and its codec never asked for it: legacy_scan,
    legacy_ping and legacy_info were counted with every stage at 0 and no histogram sample, so
    an ExPhil deployment saw its traffic and no latency (found in review)."""
    from bridge.transports.base import Connection

    srv, replies = inproc(), []
    legacy = Connection("test")
    legacy.send = lambda parts, buffers=None: replies.append(msgpack.unpackb(b"".join(parts)))
    zeros = bytes(4 * 2 * 3)
    scan = {"op": "scan", "batch": 1, "seq_len": 2, "hidden": 3, "state": 1, "x": zeros, "dt": zeros,
            "A": bytes(4 * 3), "B": bytes(4 * 2), "C": bytes(4 * 2)}
    for message in (scan, {"op": "ping"}):
        srv.dispatcher.on_frame(legacy, bytearray(msgpack.packb(message)), time.perf_counter_ns())
    wait_until(lambda: len(replies) == 2, "the legacy requests were never answered")
    assert [reply["status"] for reply in replies] == ["ok", "ok"], replies
    ops = srv.server.stats.snapshot()["ops"]
    for op, stages in (("legacy_scan", ("server_us", "kernel_us", "encode_us")), ("legacy_ping", ("server_us",))):
        assert ops[op]["success_count"] == 1 and all(ops[op][stage] > 0 for stage in stages), ops[op]


def test_lanes_and_what_closed_connections_left_are_counted_apart(tmp_path):
    """Frames and bytes per lane add up to the totals; a unix connection that closes owning a
    session and a handle shows in scan_bridge_released_total."""
    from bridge.client import UnixClient

    path = str(tmp_path / "bridge.sock")
    with PortClient(["--device", "cpu", "--metrics-port", "0", "--stdio", "--unix", path]) as client:
        url = client.info()["metrics"]
        with UnixClient(path) as unix:
            unix.call("session_open", batch=1, dim=3, state=2)
            unix.put(np.ones(4, np.float32))
            unix.ping()
        stats = {}
        for _ in range(500):  # the lane frees the connection's state once it sees it close
            stats = client.stats()
            if stats["released"]:
                break
            time.sleep(0.01)
        samples = scrape(url)
    lanes = stats["lanes"]
    assert set(lanes) == {"stdio", "unix"} and lanes["unix"]["frames_in"] == lanes["unix"]["replies_out"] == 3
    for key in ("frames_in", "bytes_in", "replies_out", "bytes_out"):
        assert sum(counts[key] for counts in lanes.values()) == stats[key], key
    assert samples[("scan_bridge_request_bytes_total", (("lane", "unix"),))] == lanes["unix"]["bytes_in"]
    assert stats["released"] == {"closed": {"peers": 1, "sessions": 1, "snapshots": 0, "models": 0, "handles": 1}}
    for kind, count in stats["released"]["closed"].items():
        assert samples[("scan_bridge_released_total", (("kind", kind), ("reason", "closed")))] == count


def test_off_by_default():
    with PortClient(["--device", "cpu"]) as client:
        assert client.info()["metrics"] is None
    assert Stats().histograms() == {}


@pytest.mark.parametrize("value, bucket", [
    pytest.param(0.0, 0, id="zero"),
    pytest.param(LATENCY_BUCKETS_US[0], 0, id="on_the_first_bound"),
    pytest.param(LATENCY_BUCKETS_US[0] + 0.5, 1, id="past_it"),
    pytest.param(LATENCY_BUCKETS_US[-1] * 2, len(LATENCY_BUCKETS_US), id="past_every_bound"),
])
def test_a_value_counts_in_the_first_bucket_it_fits(value, bucket):
    histogram = Histogram(LATENCY_BUCKETS_US)
    histogram.observe(value)
    assert histogram.counts.index(1) == bucket and histogram.sum == value


def test_bucket_bounds_are_exported_as_the_seconds_they_stand_for():
    """10 µs is le="1e-05", not 9.999999999999999e-06 (10 * 1e-6): a bound below the values
    counted in its bucket, which a query naming le="1e-05" never finds (found in review)."""
    from bridge.metrics import _histograms

    stats = Stats(histograms=True)
    stats.record("step", {"server_us": 10.0}, ok=True)
    stages, _ = _histograms(stats.histograms())
    bounds = [s.labels["le"] for s in stages.samples if s.name.endswith("_bucket")]
    assert bounds[0] == "1e-05" and bounds[-1] == "+Inf"
    assert [float(le) for le in bounds[:-1]] == [bound / 1e6 for bound in LATENCY_BUCKETS_US]


def test_row_bucket_bounds_are_exported_as_the_ints_they_are():
    """Rows are counted in rows: le="4", as queries name it, not le="4.0"."""
    from bridge.metrics import _histograms

    stats = Stats(histograms=True)
    stats.record("step", {"server_us": 10.0, "batch_rows": 4}, ok=True)
    _, rows = _histograms(stats.histograms())
    bounds = [s.labels["le"] for s in rows.samples if s.name.endswith("_bucket")]
    assert bounds[:3] == ["1", "2", "4"] and bounds[-1] == "+Inf", bounds


def test_stats_keep_histograms_only_when_asked():
    stats = Stats(histograms=True)
    stats.record("step", {"server_us": 120.0, "kernel_us": 30.0, "batch_rows": 4}, ok=True)
    histograms = stats.histograms()
    assert histograms[("step", "server_us")].sum == 120.0
    assert histograms[("step", "batch_rows")].counts[2] == 1  # 4 rows: the bucket of 4
    assert ("step", "decode_us") not in histograms


def test_uptime_counts_from_the_start_whatever_the_wall_clock_does(monkeypatch):
    """Found in review: uptime was wall-clock time since the start, so a clock stepped back
    (NTP's first sync, an operator's date) made scan_bridge_uptime_seconds and stats' uptime_s
    negative, and one stepped forward made the server look up for longer than it was."""
    stats = Stats()
    wall = time.time
    monkeypatch.setattr(time, "time", lambda: wall() - 3600)
    assert 0 <= stats.snapshot()["uptime_s"] < 60
    monkeypatch.setattr(time, "time", lambda: wall() + 3600)
    assert 0 <= stats.snapshot()["uptime_s"] < 60


@pytest.mark.parametrize("args, message", [
    pytest.param(["--metrics-port", "70000"], "expected a port in 0..65535", id="past_65535"),
    pytest.param(["--metrics-port", "-1"], "expected an int >= 0", id="negative"),
])
def test_a_bad_port_is_a_usage_error(args, message):
    run = subprocess.run([sys.executable, "-m", "bridge", *args], capture_output=True, text=True,
                         env=server_env(), timeout=120, stdin=subprocess.DEVNULL)
    assert run.returncode == 2 and message in run.stderr


def test_a_port_in_use_stops_the_start_naming_it():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        run = subprocess.run([sys.executable, "-m", "bridge", "--metrics-port", str(port)], capture_output=True,
                             text=True, env=server_env(), timeout=120, stdin=subprocess.DEVNULL)
    assert run.returncode == 2 and "--metrics-port" in run.stderr


@pytest.mark.parametrize("host", ["127..0.0.1", "a" * 64 + ".example", "192.0.2.1"],
                         ids=["empty-label", "label-too-long", "not-this-machines"])
def test_a_host_no_resolver_takes_stops_the_start_naming_it(host):
    """A name the resolver's IDNA encoding refuses raises UnicodeError, not OSError: it ended
    the start with a traceback (found in review). An address not this machine's was blamed on
    --metrics-port alone (found in review)."""
    run = subprocess.run([sys.executable, "-m", "bridge", "--metrics-port", "0", "--metrics-host", host],
                         capture_output=True, text=True, env=server_env(), timeout=120, stdin=subprocess.DEVNULL)
    assert run.returncode == 2, run.stderr
    assert "cannot start: --metrics-host" in run.stderr and "Traceback" not in run.stderr, run.stderr


def test_a_request_sent_a_byte_at_a_time_is_cut_off_at_the_timeout(monkeypatch):
    """The timeout bounded each read, not the request: a client sending a byte every so often
    held its thread for ever, and sixteen of them locked every scrape out (found in review)."""
    from bridge import metrics
    from bridge.device import choose_device
    from bridge.server import Server, ServerConfig

    monkeypatch.setattr(metrics.QuietHandler, "timeout", 0.5)
    port = metrics.serve_metrics(Server(ServerConfig(device="cpu"), choose_device("cpu")), "127.0.0.1", 0)
    closed = threading.Event()

    def trickle(conn):
        for byte in b"GET /metrics HTTP/1.1\r\nHost: x\r\n" * 100:
            if closed.is_set():
                return
            try:
                conn.sendall(bytes([byte]))
            except OSError:
                return
            time.sleep(0.05)  # not synchronisation: the trickle's pace, each byte within the read timeout

    with socket.create_connection(("127.0.0.1", port)) as conn:
        sender = threading.Thread(target=trickle, args=(conn,), daemon=True)
        started = time.monotonic()
        sender.start()
        conn.settimeout(30)
        try:
            assert conn.recv(1) == b"", "the trickling connection got an answer"
        except ConnectionResetError:
            pass  # closed with its bytes unread: closed all the same
        closed.set()
        assert time.monotonic() - started < 20, "the trickling connection was kept past its deadline"
        sender.join(10)


@pytest.mark.parametrize("name", ["scan_bridge_requests_total", "scan_bridge_uptime_seconds",
                                  "scan_bridge_stage_seconds_bucket"])
def test_a_scrape_filtered_by_name_gets_that_metric(inproc, name):
    """prometheus_client's `name[]` filter (a scrape job's `params`) found no metric of an
    undescribed collector and answered an empty 200: a target up with no series (found in
    review)."""
    from bridge import metrics
    from bridge_fakes import RecordingConnection

    srv = inproc(metrics_port=0)  # histograms kept, as the server keeps them with the endpoint on
    assert srv.request(RecordingConnection(), "info").ok  # a request's samples to find
    port = metrics.serve_metrics(srv.server, "127.0.0.1", 0)
    samples = scrape(f"http://127.0.0.1:{port}/metrics?name[]={name}")
    assert samples and {sample_name for sample_name, _ in samples} == {name}, samples


def test_a_head_request_gets_gets_headers_and_no_body():
    """`curl -I` and load balancers' checks send HEAD: prometheus_client's app answered it 405,
    with a body (RFC 9110 forbids one). Found in review. Read off the socket: an HTTP client
    reads no body for HEAD whatever comes."""
    from bridge import metrics
    from bridge.device import choose_device
    from bridge.server import Server, ServerConfig

    port = metrics.serve_metrics(Server(ServerConfig(device="cpu"), choose_device("cpu")), "127.0.0.1", 0)
    def exchange(method: str) -> tuple[bytes, bytes]:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
            conn.sendall(f"{method} /metrics HTTP/1.0\r\nHost: x\r\n\r\n".encode())
            answer = b""
            while chunk := conn.recv(65536):
                answer += chunk
        head, _, body = answer.partition(b"\r\n\r\n")
        return head, body

    head, body = exchange("HEAD")
    assert head.startswith(b"HTTP/1.0 200") and b"Content-Type: text/plain" in head and body == b""
    length = int(next(line for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:"))
                 .split(b":")[1])
    _, got = exchange("GET")
    assert b"scan_bridge_uptime_seconds" in got
    # GET's length, within the digits a counter or the uptime may have gained between the two.
    assert abs(length - len(got)) < 64, (length, len(got))


def test_a_connection_reset_by_its_client_writes_no_traceback():
    """socketserver printed each failed request's traceback to stderr, past the logs' format and
    --log-level: a client resetting its connection (a port scanner, a TCP check) wrote one a
    connection into the server's log. Found in review."""
    script = textwrap.dedent("""
        import socket, struct, time
        from bridge import metrics
        from bridge.device import choose_device
        from bridge.server import Server, ServerConfig
        port = metrics.serve_metrics(Server(ServerConfig(device="cpu"), choose_device("cpu")), "127.0.0.1", 0)
        for _ in range(3):
            conn = socket.create_connection(("127.0.0.1", port))
            conn.sendall(b"GET /metrics HTTP/1.1\\r\\nHost: x")  # half a request, then a reset
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            conn.close()
        time.sleep(1)  # not synchronisation: the handler threads' time to fail, or not
        import urllib.request
        assert urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).status == 200
    """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=server_env(), timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "Traceback" not in run.stderr and "Exception occurred" not in run.stderr, run.stderr[-3000:]


def test_idle_connections_are_bounded_and_closed_when_their_request_never_comes(monkeypatch):
    """A connection that sends part of a request and waits held a thread and a descriptor for
    ever: enough of them took every descriptor, and the endpoint and the lanes stopped
    accepting. Past the cap one is closed unread; an idle one is closed after its timeout, and
    scrapes are answered again."""
    from bridge import metrics
    from bridge.device import choose_device
    from bridge.server import Server, ServerConfig

    monkeypatch.setattr(metrics, "MAX_CONNECTIONS", 3)
    monkeypatch.setattr(metrics.QuietHandler, "timeout", 0.5)
    handled = []  # connections given a handler: the cap's refusal gives none (an idle timeout closes one too)
    setup = metrics.QuietHandler.setup
    monkeypatch.setattr(metrics.QuietHandler, "setup", lambda handler: handled.append(handler) or setup(handler))
    port = metrics.serve_metrics(Server(ServerConfig(device="cpu"), choose_device("cpu")), "127.0.0.1", 0)
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(3)]
    for conn in idle:
        conn.sendall(b"GET /metrics HTTP/1.1\r\n")  # and never the rest
    wait_until(lambda: len(handled) == 3, "the idle connections were not handled")
    with socket.create_connection(("127.0.0.1", port)) as turned_away:
        turned_away.settimeout(10)
        assert turned_away.recv(1) == b"", "a connection past the cap was kept"
    assert len(handled) == 3, "a connection past the cap was given a handler"
    for conn in idle:
        conn.settimeout(10)
        assert conn.recv(1) == b"", "an idle connection was kept past its timeout"
        conn.close()

    def answered() -> bool:
        try:
            return any(name.startswith("scan_bridge_") for name, _ in scrape(f"http://127.0.0.1:{port}/metrics"))
        except OSError:  # turned away: the last idle one's thread had not finished yet
            return False

    wait_until(answered, "no scrape was answered once the idle connections were closed", timeout=10)


@pytest.mark.parametrize("host, url", [
    pytest.param("127.0.0.1", "http://127.0.0.1:9100/metrics", id="ipv4"),
    pytest.param("::1", "http://[::1]:9100/metrics", id="ipv6-bracketed"),
    pytest.param("localhost", "http://localhost:9100/metrics", id="name"),
])
def test_the_endpoint_url_is_one_a_client_can_parse(host, url):
    """`info`'s metrics URL: an IPv6 literal was written bare, http://::1:9100/metrics, which
    no client parses (found in review)."""
    from bridge.metrics import endpoint_url

    assert endpoint_url(host, 9100) == url
    assert urllib.parse.urlsplit(url).port == 9100


def test_a_frame_inside_a_session_open_is_a_launch_of_its_sessions_rows(inproc):
    """Found in review: a frame counted a launch but no batch_rows, so the two counts of an op
    run as frames disagreed."""
    from bridge.client import result_from_wire
    from bridge_fakes import RecordingConnection

    srv = inproc()
    srv.server.stats = Stats(histograms=True)  # as a server with --metrics-port keeps them
    conn = RecordingConnection()
    rng = np.random.default_rng()
    step = {"x": rng.standard_normal((2, 3), dtype=np.float32), "dt": np.full((2, 3), 0.1, np.float32),
            "A": -np.ones((3, 2), np.float32), "B": rng.standard_normal((2, 2), dtype=np.float32),
            "C": rng.standard_normal((2, 2), dtype=np.float32)}
    frames = [{"op": "step", "args": step}] * 3
    assert srv.call(conn, "session_open", batch=2, dim=3, state=2, frames=frames)["session"]
    histogram = srv.server.stats.histograms()[("step", "batch_rows")]
    assert sum(histogram.counts) == 3 and histogram.sum == 6
    assert result_from_wire(srv.call(conn, "stats"))["ops"]["step"]["execution_count"] == 3
