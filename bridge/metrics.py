"""The Prometheus endpoint (`--metrics-port`): the server's counters, histograms and holdings in
the text exposition format, read from `Server.stats` and its tables when scraped, so that serving
pays nothing for it but the histograms' bucket counts (bridge.stats)."""

from __future__ import annotations

import contextlib
import errno
import logging
import socket
import socketserver
import threading
import time
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from protocol import ERROR_CODES

from .stats import TOTALLED_KEYS

log = logging.getLogger("bridge.metrics")

# A scraper needs one connection and sends its request at once: past these, a connection is
# closed, so that idle or half-sent ones cannot hold a thread and a descriptor each for ever.
MAX_CONNECTIONS = 16
REQUEST_TIMEOUT_S = 10.0
# Out of descriptors, accept fails at once and the socket stays readable: pause between tries
# instead of spinning on a core (as the unix lane does).
ACCEPT_RETRY_S = 0.1


def serve_metrics(server, host: str, port: int) -> int:
    """Serves `server`'s metrics at http://host:port/metrics from a daemon thread; the port bound
    (`port` 0 takes a free one)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ServerCollector(server))
    family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    httpd = BoundedServer(family, address[:2], QuietHandler)
    httpd.set_app(answering_head(make_wsgi_app(registry)))
    threading.Thread(target=httpd.serve_forever, name="metrics", daemon=True).start()
    return httpd.server_port


def answering_head(app):
    """`app`, with HEAD answered as GET is, its status and headers (the length GET's body would
    have, RFC 9110 §8.6), but without a body (§9.3.2), as `curl -I` and load balancers' checks
    send it: prometheus_client's app refuses it, with a body."""
    def head_as_get(environ, start_response):
        if environ.get("REQUEST_METHOD") != "HEAD":
            return app(environ, start_response)
        started = []
        body = app({**environ, "REQUEST_METHOD": "GET"}, lambda *args: started.append(args))
        try:
            length = sum(len(chunk) for chunk in body)
        finally:
            if hasattr(body, "close"):
                body.close()
        status, headers, *exc_info = started[0]
        headers = [(k, v) for k, v in headers if k.lower() != "content-length"] + [("Content-Length", str(length))]
        start_response(status, headers, *exc_info)
        return []
    return head_as_get


def endpoint_url(host: str, port: int) -> str:
    """The endpoint's URL: an IPv6 literal in brackets (RFC 3986), or its colons would read as
    the port's."""
    return f"http://{f'[{host}]' if ':' in host else host}:{port}/metrics"


class QuietHandler(WSGIRequestHandler):
    """Answers one request, logging nothing; a connection not done within `timeout`
    (REQUEST_TIMEOUT_S) is closed."""

    timeout = REQUEST_TIMEOUT_S

    def setup(self):
        super().setup()
        # The socket timeout bounds each read, not the request: one sent a byte at a time would
        # hold its thread for ever. The whole exchange gets `timeout`.
        self._deadline = threading.Timer(self.timeout, self._cut)
        self._deadline.daemon = True
        self._deadline.start()

    def _cut(self):
        with contextlib.suppress(OSError):
            self.connection.shutdown(socket.SHUT_RDWR)

    def finish(self):
        self._deadline.cancel()
        super().finish()

    def log_message(self, format, *args):
        pass


class BoundedServer(socketserver.ThreadingMixIn, WSGIServer):
    """A thread a connection, at most MAX_CONNECTIONS at once: one past them is closed unread."""

    daemon_threads = True

    def __init__(self, family: int, address, handler):
        self.address_family = family  # read by the base class's __init__, which binds
        self._room = threading.BoundedSemaphore(MAX_CONNECTIONS)
        super().__init__(address, handler)

    def get_request(self):
        try:
            return super().get_request()
        except OSError as exc:
            if exc.errno in (errno.EMFILE, errno.ENFILE):
                time.sleep(ACCEPT_RETRY_S)
            raise

    def process_request(self, request, client_address):
        if not self._room.acquire(blocking=False):
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._room.release()
            raise

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._room.release()

    def handle_error(self, request, client_address):
        # socketserver prints a traceback to stderr, past the logs' format and level: a client
        # that resets its connection, or a port scanner's, is no fault of the server's.
        log.debug("metrics: a request from %s failed", client_address, exc_info=True)


class ServerCollector:
    def __init__(self, server):
        self.server = server

    def describe(self):
        """The metric families, by which the registry finds this collector for a scrape that
        asks for some by name (`?name[]=`): none, without it."""
        return list(self.collect())

    def collect(self):
        stats = self.server.stats.snapshot()
        yield from _requests(stats["ops"])
        yield from _histograms(self.server.stats.histograms())
        errors = CounterMetricFamily("scan_bridge_errors", "Error replies by code (SPEC §7).",
                                     labels=["code"])
        # Every code from the start, at 0 until its first reply: a series that appears only with
        # its first error reads as missing to a rate or absence alert until then.
        for code in sorted(set(ERROR_CODES) | set(stats["errors"])):
            errors.add_metric([code], stats["errors"].get(code, 0))
        yield errors
        for name, key, what in (("frames_in", "frames_in", "Request frames read, by lane."),
                                ("replies_out", "replies_out", "Replies handed to the lane to send, by lane."),
                                ("request_bytes", "bytes_in", "Bytes of request bodies read, by lane."),
                                ("reply_bytes", "bytes_out",
                                 "Bytes of reply bodies handed to the lane to send, by lane.")):
            family = CounterMetricFamily(f"scan_bridge_{name}", what, labels=["lane"])
            for lane, counts in sorted(stats["lanes"].items()):
                family.add_metric([lane], counts[key])
            yield family
        released = CounterMetricFamily(
            "scan_bridge_released", "What connections that went away owned, freed: by reason (closed, or idle "
            "past --idle-timeout-s) and kind (peers: the connections themselves).", labels=["reason", "kind"])
        for reason, kinds in sorted(stats["released"].items()):
            for kind, count in sorted(kinds.items()):
                released.add_metric([reason, kind], count)
        yield released
        yield from _holdings(self.server, stats)


def _requests(ops: dict):
    requests = CounterMetricFamily("scan_bridge_requests", "Requests answered, by op and outcome.",
                                   labels=["op", "outcome"])
    inferences = CounterMetricFamily("scan_bridge_inferences",
                                     "Requests served successfully and frames run inside session_open or "
                                     "session_restore, by op.",
                                     labels=["op"])
    launches = CounterMetricFamily("scan_bridge_kernel_launches",
                                   "Executions, by op, as Triton's execution_count: a batch of requests is one "
                                   "launch, and any other request one execution, a ping's too.", labels=["op"])
    for op, entry in sorted(ops.items()):
        requests.add_metric([op, "success"], entry["success_count"])
        requests.add_metric([op, "failure"], entry["failure_count"])
        inferences.add_metric([op], entry["inference_count"])
        launches.add_metric([op], entry["execution_count"])
    yield requests
    yield inferences
    yield launches


def _histograms(histograms: dict):
    stages = HistogramMetricFamily("scan_bridge_stage_seconds",
                                   "Time of each stage of a request (timing keys, server_us the whole), by op.",
                                   labels=["op", "stage"])
    rows = HistogramMetricFamily("scan_bridge_batch_rows", "Rows a kernel launch served, by op.",
                                 labels=["op"])
    for (op, key), histogram in sorted(histograms.items()):
        if key in TOTALLED_KEYS:
            stages.add_metric([op, key.removesuffix("_us")], _buckets(histogram, 1e6),
                              histogram.sum / 1e6)
        else:
            rows.add_metric([op], _buckets(histogram), histogram.sum)
    yield stages
    yield rows


def _buckets(histogram, per_unit: float | None = None) -> list:
    """Prometheus's cumulative buckets, `le` in the exported unit (`per_unit` of the counted
    one make one; None: the counted unit, its bounds as they are), +Inf last. Divided, not
    multiplied by the reciprocal: 10 * 1e-6 is 9.999999999999999e-06, a bound below the 10 µs
    its bucket counts, and not the le="1e-05" a query names."""
    buckets, seen = [], 0
    for bound, count in zip((*histogram.bounds, float("inf")), histogram.counts):
        seen += count
        le = bound if per_unit is None else bound / per_unit
        buckets.append(("+Inf" if bound == float("inf") else repr(le), seen))
    return buckets


def _holdings(server, stats: dict):
    sessions, handles = stats["sessions"], stats["handles"]
    for name, value, what in (
            ("sessions", sessions["sessions"], "Sessions open (plain and models')."),
            ("session_pool_bytes", sessions["pool_bytes"], "Device bytes of session state pools, models and snapshots."),
            ("model_bytes", sessions["model_bytes"], "Device bytes of loaded models' weights."),
            ("snapshot_bytes", sessions["snapshot_bytes"], "Device bytes of session snapshots."),
            ("models", len(server.models), "Models loaded."),
            ("snapshots", len(server.snapshots), "Snapshots held."),
            ("handles", handles["handles"], "Tensors held as handles."),
            ("handle_bytes", handles["handle_bytes"], "Bytes of tensors held as handles."),
            ("uptime_seconds", stats["uptime_s"], "Seconds since the server started.")):
        yield GaugeMetricFamily(f"scan_bridge_{name}", what, value=value)
