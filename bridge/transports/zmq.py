"""The ZeroMQ lane: ROUTER sockets on ipc:// and tcp:// endpoints; one ZeroMQ message is one
request (SPEC §2): its route (the routing id, one more for each ROUTER/DEALER proxy on the
way), an empty delimiter when the client is a REQ socket, the msgpack body, then the raw buffers of a multipart request (SPEC §5). Each reply goes back with the
envelope its request came with (a DEALER may send the delimiter with one request and not with
the next): the dispatcher answers a request through a `ZmqReplyTarget`, its peer and envelope.

ZeroMQ sockets are not thread-safe, so one thread ("zmq-io") owns every socket of the lane: it
receives, hands bodies to the dispatcher (which decodes them on this thread, as on the stdio
reader), and sends every reply. Replies produced on other threads (the dispatcher's worker)
are posted to an `Outbox` that wakes the io thread through an eventfd it polls beside the
sockets; replies made on the io thread itself (the native step path's, `overloaded` answers)
are queued behind what was posted before them and sent as soon as the dispatcher returns from
the request, so that a peer's replies leave in the order they were made.

Bounds and fairness: a peer has at most `max_in_flight` requests in flight (with the
dispatcher, or answered and not yet sent); its later requests wait in its own queue (at most
`hwm` of them, after which it is answered `overloaded`), so a peer that floods delays only
itself. Sockets are ROUTER_MANDATORY: a reply to a peer that is gone fails at once, and the
peer's sessions and handles are freed; a reply to a live peer whose pipe is full (SNDHWM)
waits in the peer's own queue and is tried again every RETRY_MS, never blocking the others.
Replies to served requests are never dropped (at most `max_in_flight` wait per peer); only
`overloaded` answers, once `hwm` of them wait beside its replies, for a peer that floods
and reads nothing.

Peers that go away: a ROUTER is not told when a peer disconnects (ZMQ_ROUTER_NOTIFY is a draft
API, absent from release builds of libzmq), so each socket's monitor reports its connections'
ends (EVENT_DISCONNECTED, with the connection's file descriptor), and every message says which
descriptor it came in on (ZMQ_SRCFD). The peers seen on a descriptor whose connection ended are
gone: their sessions and handles are freed at once, as when a unix connection closes. The
monitor is read whenever it has news, and before a message is first attributed to a
descriptor (and before each message of a peer that chose its routing id, which its next
connection brings back), so that a descriptor reused by a new connection is never mistaken for
the old one. A message read from a descriptor whose end was seen, and not yet reused, was sent
just before that end: it is a gone peer's, answered to nobody (as the dispatcher answers one).
What no event reports -- a peer behind a proxy that stays connected, a process frozen with its
socket open, a libzmq that does not say which descriptor a message came on -- `idle_timeout_s`
covers: a peer that owns something and has sent nothing for that long, with nothing in flight,
counts as gone ("idle") and what it owns is freed; a late request of its finds `unknown_session`
(or the like), as for any id it does not own.
"""

from __future__ import annotations

import collections
import logging
import math
import os
import threading
import time
from dataclasses import dataclass

import zmq
import zmq.utils.monitor

import protocol

from ..outbox import Outbox
from ..timing import now_ns
from .base import FLUSH_SECONDS, Connection, SocketFile, claim_socket_path

log = logging.getLogger("bridge.zmq")

# Messages read from one socket before replies are flushed again.
RECEIVE_BATCH = 64
# Raw buffers a request may carry (SPEC §5): room for every tensor of a big model's weights sent
# raw. Parts past them are read and dropped unkept: each part held costs the io thread a frame
# object while an empty one costs its sender next to nothing, so a message of very many of them
# stalled every peer.
MAX_RAW_BUFFERS = 4096
# Routing ids a request may carry before a REQ delimiter: its peer's, and one for each ROUTER/
# DEALER proxy between that client and this socket (the nearest first).
MAX_ROUTE = 8
# The routing ids, REQ's empty delimiter and the body, before the raw buffers.
ENVELOPE_AND_BODY = MAX_ROUTE + 2
# How often replies to a peer whose pipe was full are tried again.
RETRY_MS = 2
# How long closing waits for queued replies to leave.
LINGER_MS = 200
# What a socket's monitor reports: its connections' starts and ends (the value is the fd).
CONNECTION_EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED
LOOPBACK = "127.0.0.1"


def names_ipv6_host(endpoint: str) -> bool:
    """A `tcp://[ADDRESS]:PORT` endpoint: an IPv6 literal, which libzmq binds or connects to
    only on a socket with its IPV6 option set (else "No such device")."""
    return endpoint.startswith("tcp://[")


def resolve_endpoint(endpoint: str) -> str:
    """The endpoint to bind: `ipc://PATH` as given; `tcp://HOST:PORT` with HOST defaulting to
    the loopback address (a server is reachable from other hosts only when a host, such as *
    or an interface address, is named). PORT may be * for any free port; a number past 65535,
    which libzmq would take modulo 2^16, is refused. An IPv6 address is written in brackets
    (RFC 3986): bare, its colons would read as the port's."""
    scheme, _, rest = endpoint.partition("://")
    if scheme == "ipc" and rest:
        return endpoint
    if scheme == "tcp":
        host, sep, port = rest.rpartition(":")
        bracketed = host.startswith("[") and host.endswith("]") and len(host) > 2
        if (sep and (port == "*" or (port.isascii() and port.isdigit() and int(port) <= 65535))
                and (bracketed or not any(c in host for c in ":[]"))):
            return f"tcp://{host or LOOPBACK}:{port}"
    raise ValueError(f"--zmq: expected ipc://PATH or tcp://HOST:PORT (an IPv6 HOST in brackets), got {endpoint!r}")


@dataclass(frozen=True)
class CurveKeys:
    """CURVE security for tcp endpoints: the server's key pair (z85) and, optionally, a
    directory of client public-key certificates that alone may connect (without it, any
    client that knows the server's public key may)."""

    public: bytes
    secret: bytes
    clients_dir: str | None = None

    @classmethod
    def load(cls, secret_file: str, clients_dir: str | None = None) -> "CurveKeys":
        """From a secret certificate as written by `zmq.auth.create_certificates`."""
        import zmq.auth

        public, secret = zmq.auth.load_certificate(secret_file)
        if secret is None:
            raise ValueError(f"--curve-secret-key {secret_file}: expected a secret certificate "
                             "(the .key_secret file), got one without a secret key")
        if clients_dir is not None:
            if not os.path.isdir(clients_dir):
                raise ValueError(f"--curve-clients {clients_dir}: expected a directory of public certificates")
            # pyzmq's authenticator logs a certificate it cannot read and then admits no client
            # at all: one bad file would lock every client out of a server that looks healthy.
            for name in sorted(os.listdir(clients_dir)):
                if name.endswith(".key"):
                    try:
                        zmq.auth.load_certificate(os.path.join(clients_dir, name))
                    except (OSError, ValueError) as exc:
                        raise ValueError(f"--curve-clients {clients_dir}: expected public certificates, got "
                                         f"{name} ({exc})") from None
        return cls(public, secret, clients_dir)


def chose_its_routing_id(routing_id: bytes) -> bool:
    """Whether a peer set its routing id itself: one libzmq gives starts with a zero byte and is
    never given again, where a chosen one comes back with the peer's next connection."""
    return routing_id[:1] != b"\0"


# What a body's first byte is (a msgpack map: fixmap, map 16, map 32), and a routing id a proxy
# added may not start with: the two are told apart by it.
_MAP_FIRST_BYTES = frozenset(range(0x80, 0x90)) | {0xDE, 0xDF}


def _starts_as_map(frame) -> bool:
    return len(frame) > 0 and memoryview(frame)[0] in _MAP_FIRST_BYTES


def split_envelope(frames: list) -> tuple[list, list]:
    """(envelope, message) of a message received on a ROUTER: its route, the routing ids before
    the body (the peer's, then one for each ROUTER/DEALER proxy between the client and this
    socket, up to MAX_ROUTE in all), and REQ's empty delimiter when the request had one; the
    message is the body and raw buffers. A routing id is 1 to 255 bytes and does not start as a
    msgpack map does, which every body does; anything else leaves the route the peer's id alone
    and the rest the message (a malformed request, answered as such), but a malformed (non-map)
    body of at most 255 bytes followed by an empty frame or a map is read as a routing id (its
    error reply then goes astray)."""
    for i in range(1, min(len(frames), MAX_ROUTE + 1)):
        frame = frames[i]
        if len(frame) == 0:
            if i + 1 < len(frames):
                return frames[:i + 1], frames[i + 1:]
            break
        if _starts_as_map(frame):
            return frames[:i], frames[i:]
        if len(frame) > 255:
            break
    return frames[:1], frames[1:]


class ZmqPeer(Connection):
    """One ZeroMQ peer of one socket: owner of the sessions and handles it opens. Its state
    is touched only by the io thread; replies to it go through a ZmqReplyTarget."""

    def __init__(self, transport: "ZmqTransport", key: tuple[int, tuple[bytes, ...]]):
        super().__init__("zmq")
        self.transport = transport
        # (index of its socket, route): the routing ids of its requests' envelope, the nearest
        # hop's first; behind a proxy, each client is a peer of its own, all on the proxy's
        # connection.
        self.key = key
        self.socket = transport.sockets[key[0]]
        self.fd: int | None = None  # the descriptor of the connection its messages come in on
        self.last_seen = time.monotonic()  # when its latest message came, or its latest answer left
        # Requests with the dispatcher or answered but not yet sent; requests waiting for one of
        # those to finish; replies waiting for room in the peer's pipe (ZeroMQ frames, in order).
        self.in_flight = 0
        self.waiting: collections.deque = collections.deque()
        self.unsent: collections.deque = collections.deque()
        # False for one made up past the lane's cap of peers: filed nowhere, it is only answered.
        self.kept = True
        # `overloaded` answers dropped since its replies last left: logged once, not one a message.
        self.answers_dropped = 0


class ZmqReplyTarget:
    """What the dispatcher answers one request through, as it would a connection: the peer
    (whose id owns the sessions and handles the request opens, freed when it goes) and the
    envelope the request came with, which its reply is sent after: the route (its routing ids),
    and the empty delimiter when the request had one."""

    __slots__ = ("peer", "envelope", "id")
    lane = "zmq"
    # Posted to the io thread, a reply may still be dropped there (its peer gone): counted as
    # it leaves (ZmqTransport._send_unsent).
    counts_replies_it_sends = True

    def __init__(self, peer: ZmqPeer, envelope: list):
        self.peer = peer
        self.envelope = envelope
        self.id = peer.id

    @property
    def peer_gone(self) -> bool:
        return self.peer.closed

    @property
    def reply_failed(self) -> bool:
        return self.peer.reply_failed

    @reply_failed.setter
    def reply_failed(self, failed: bool) -> None:
        self.peer.reply_failed = failed

    def send(self, parts: list, buffers: list | None = None) -> None:
        self.peer.transport.reply(self, parts, buffers)

    def on_close(self, callback) -> None:
        self.peer.on_close(callback)

    def remove_close_callback(self, callback) -> None:
        self.peer.remove_close_callback(callback)


class ZmqTransport:
    """One ROUTER socket per endpoint, all served by one io thread."""

    def __init__(self, dispatcher, endpoints: list[str], *, max_frame_size: int, max_in_flight: int,
                 hwm: int, curve: CurveKeys | None = None, idle_timeout_s: float | None = None,
                 max_peers: int = 4096):
        self.dispatcher = dispatcher
        # Peers held at once, over all sockets: each route a message names is a peer with a cap
        # and a queue of its own, and a connection can make up routes without end.
        self.max_peers = max_peers
        self.idle_timeout_s = idle_timeout_s
        # How often peers are looked at for idleness: a fraction of the timeout, so one is
        # freed at most a quarter of it late.
        self._idle_check_s = None if idle_timeout_s is None else min(idle_timeout_s / 4, 1.0)
        self._next_idle_check = 0.0
        self.max_frame_size = max_frame_size
        self.max_in_flight = max_in_flight
        self.hwm = hwm
        self.context = zmq.Context(io_threads=1)
        self.outbox = Outbox()
        self.endpoints: list[str] = []
        self._ipc_files: list[SocketFile] = []  # the socket files of its ipc endpoints, removed on close
        self.sockets: list[zmq.Socket] = []
        self.monitors: list[zmq.Socket] = []  # one per socket, same index
        self._authenticator = None
        self._peers: dict[tuple[int, tuple[bytes, ...]], ZmqPeer] = {}
        self._on_fd: dict[tuple[int, int], set[ZmqPeer]] = {}  # (socket index, fd) -> its peers
        # (socket index, fd) whose connection ended, no new one accepted on it since: what is read
        # from there still was sent before the end, by a peer gone.
        self._ended: set[tuple[int, int]] = set()
        self._fds_known = True
        self._backlogged: set[ZmqPeer] = set()  # peers with replies waiting for room in their pipe
        # Replies to send, in order: those made on the io thread and, ahead of each, what other
        # threads had posted by then (see reply).
        self._replies: collections.deque = collections.deque()
        self._flushing = False
        self._stop = threading.Event()
        self._closed = False
        # Who closes the sockets when the io thread outlives close()'s wait: the thread itself,
        # once it returns from what held it (_io_stopped and _close_deadline, under _ending).
        self._ending = threading.Lock()
        self._io_stopped = False
        self._close_deadline: float | None = None
        self._thread = threading.Thread(target=self._run, name="zmq-io", daemon=True)
        try:
            for endpoint in endpoints:
                self._bind(resolve_endpoint(endpoint), curve)
        except Exception:
            self._close_sockets()
            raise

    @property
    def names(self) -> list[str]:
        """How `info` lists this lane: one entry per bound endpoint."""
        return [f"zmq {endpoint}" for endpoint in self.endpoints]

    def _bind(self, endpoint: str, curve: CurveKeys | None) -> None:
        sock = self.context.socket(zmq.ROUTER)
        self.sockets.append(sock)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.SNDHWM, self.hwm)
        sock.setsockopt(zmq.RCVHWM, self.hwm)
        sock.setsockopt(zmq.LINGER, LINGER_MS)
        # A bigger single frame is refused by ZeroMQ itself (the peer is disconnected) before
        # it is buffered; bodies plus raw buffers over the limit are answered frame_too_large.
        # libzmq takes an int64: a limit past it limits no frame either.
        sock.setsockopt(zmq.MAXMSGSIZE, min(self.max_frame_size, 2**63 - 1))
        # Only for a bracketed host: on `*` it would listen on IPv6 as well, which `*` never meant.
        sock.setsockopt(zmq.IPV6, names_ipv6_host(endpoint))
        if curve is not None and endpoint.startswith("tcp://"):
            if curve.clients_dir is not None and self._authenticator is None:
                from zmq.auth.thread import ThreadAuthenticator

                self._authenticator = ThreadAuthenticator(self.context)
                self._authenticator.start()
                self._authenticator.configure_curve(domain="*", location=curve.clients_dir)
            sock.curve_server = True
            sock.curve_publickey = curve.public
            sock.curve_secretkey = curve.secret
        self.monitors.append(sock.get_monitor_socket(CONNECTION_EVENTS))
        ipc_path = endpoint.removeprefix("ipc://") if endpoint.startswith("ipc://") else None
        # ipc://@name (Linux's abstract namespace, libzmq's spelling) is no file to claim or remove.
        socket_file = ipc_path is not None and not ipc_path.startswith("@")
        if socket_file and ipc_path != "*":
            # libzmq would unlink a live server's socket there and bind over it.
            claim_socket_path(ipc_path, "--zmq ipc://")
        sock.bind(endpoint)
        self.endpoints.append(sock.getsockopt_string(zmq.LAST_ENDPOINT))
        if socket_file:
            self._ipc_files.append(SocketFile(self.endpoints[-1].removeprefix("ipc://")))

    def start(self) -> None:
        # pyzmq starts the thread that holds zero-copy sends' buffers (a large reply's) at the
        # first such send: started here, a thread shortage fails the start rather than that
        # send, again at every retry, its peer waiting for good.
        import zmq.utils.garbage

        if not zmq.utils.garbage.gc.is_alive():
            zmq.utils.garbage.gc.start()
        if self._idle_check_s is not None:  # the first check is due a check's interval from now
            self._next_idle_check = time.monotonic() + self._idle_check_s
        self._thread.start()

    def close(self, deadline: float | None = None) -> None:
        """Stop the io thread, send the replies already posted and those posted meanwhile (until
        `deadline`, time.monotonic(); FLUSH_SECONDS from now by default), and close the sockets
        (queued messages get LINGER_MS to leave). An io thread still busy at the deadline (a
        request it serves where it read it, a huge message it drops) is not waited for: it sends
        and closes the lane itself when it returns; the ipc socket files go at once, so that a
        server started next finds the paths free."""
        if self._closed:
            return
        self._closed = True
        deadline = time.monotonic() + FLUSH_SECONDS if deadline is None else deadline
        if self._thread.ident is not None:  # started
            self._stop.set()
            self.outbox.post(None)
            self._thread.join(max(0.0, deadline - time.monotonic()))
            with self._ending:
                if not self._io_stopped:
                    self._close_deadline = deadline
                    log.warning("the zmq io thread is still busy at the shutdown deadline; it closes the "
                                "lane when it returns, replies queued until then are sent then")
                    self._unlink_ipc_paths()
                    return
        self._finish(deadline)

    def _finish(self, deadline: float) -> None:
        """Send what is queued and posted (one try, then until `deadline`), and close the
        sockets: on close()'s thread, or on the io thread where it outlived close()'s wait."""
        self._flush()
        while (self.outbox.pending or self._replies or self._backlogged) and time.monotonic() < deadline:
            time.sleep(RETRY_MS / 1000)
            self._flush()
        if self.outbox.pending or self._replies or self._backlogged:
            log.warning("zmq lane: replies to %d peers still unsent at the shutdown deadline are lost",
                        len(self._backlogged) + bool(self.outbox.pending or self._replies))
        self._close_sockets()

    def _close_sockets(self) -> None:
        for sock in self.sockets:
            sock.disable_monitor()
            sock.close()
        for monitor in self.monitors:
            monitor.close()
        if self._authenticator is not None:
            self._authenticator.stop()
        self.context.term()
        self.outbox.close()
        self._unlink_ipc_paths()

    def _unlink_ipc_paths(self) -> None:
        files, self._ipc_files = self._ipc_files, []
        for socket_file in files:  # libzmq leaves the socket files of ipc endpoints behind
            socket_file.remove()

    # -- the io thread --------------------------------------------------------------------

    def _run(self) -> None:
        poller = zmq.Poller()
        for sock in self.sockets:
            poller.register(sock, zmq.POLLIN)
        for monitor in self.monitors:
            poller.register(monitor, zmq.POLLIN)
        poller.register(self.outbox.fd, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                # Replies left queued by a fault are tried again like a full pipe's.
                timeout_ms = RETRY_MS if self._backlogged or self._replies else None
                if self._idle_check_s is not None:
                    # Rounded up: a check due in under a millisecond would otherwise poll with 0
                    # until it is due, spinning a core (a tiny --idle-timeout-s).
                    wait_ms = max(0, math.ceil((self._next_idle_check - time.monotonic()) * 1000))
                    timeout_ms = wait_ms if timeout_ms is None else min(timeout_ms, wait_ms)
                ready = dict(poller.poll(timeout_ms))
                for index, monitor in enumerate(self.monitors):
                    if monitor in ready:
                        self._connection_events(index)
                for index, sock in enumerate(self.sockets):
                    if sock in ready:
                        self._receive(index, sock)
                # The eventfd is read only when set: reading it unset costs a failing syscall.
                self._flush(take_posted=self.outbox.fd in ready or self.outbox.pending)
                if self._idle_check_s is not None and time.monotonic() >= self._next_idle_check:
                    self._free_idle_peers()
            except Exception:
                # A fault in one message or event (a bug) costs that one, not the lane: every
                # peer's requests would go unanswered while the server runs on.
                log.exception("zmq io thread: a message or event could not be handled")
        with self._ending:
            self._io_stopped = True
            deadline = self._close_deadline
        if deadline is not None:  # close() gave up waiting for this thread: the lane is its to close
            self._finish(deadline)

    def _receive(self, index: int, sock: zmq.Socket) -> None:
        for _ in range(RECEIVE_BATCH):
            try:
                frames, parts, unkept_bytes = self._receive_message(sock)
            except zmq.Again:
                return
            received_ns = now_ns()
            received_at = time.monotonic()
            envelope, message = split_envelope(frames)
            delimited = len(envelope) > 1 and len(envelope[-1]) == 0  # routing ids are never empty
            route = tuple(frame.bytes for frame in (envelope[:-1] if delimited else envelope))
            routing_id = route[0]
            key = (index, route)
            fd = self._source_fd(frames[0])
            peer = self._peers.get(key)
            if peer is None or (fd is not None and (peer.fd != fd or chose_its_routing_id(routing_id))):
                # A connection that ended before this message came is settled before the
                # message is attributed to its descriptor: that one may be reused already, by a
                # new connection of a peer that chose its routing id too.
                self._connection_events(index)
                if (index, fd) in self._ended:
                    # Sent just before its connection ended, read after the end was seen: its
                    # peer is gone. Filed under no routing id, so that a peer that comes back
                    # under its own gets neither its reply nor what it opens.
                    peer = ZmqPeer(self, key)
                    peer.mark_closed()
                else:
                    peer = self._peers.get(key)
                    if peer is None:
                        peer = ZmqPeer(self, key)
                        if len(self._peers) < self.max_peers:
                            self._peers[key] = peer
                        else:
                            peer.kept = False
                    if peer.kept and fd is not None and peer.fd != fd:
                        self._unlist(peer)
                        peer.fd = fd
                        self._on_fd.setdefault((index, fd), set()).add(peer)
            peer.last_seen = received_at
            # Replies go back along the route; a REQ peer's need its delimiter, a DEALER's must
            # have one only when its request had one.
            target = ZmqReplyTarget(peer, [*route, b""] if delimited else [*route])
            request = (message, received_ns, target)
            buffers = parts - len(envelope) - 1
            if buffers > MAX_RAW_BUFFERS:
                self._turn_away(peer, request, "limit_exceeded", f"buffers: expected at most {MAX_RAW_BUFFERS} raw "
                                f"buffers after the body, got {buffers}",
                                {"limit": "raw_buffers", "max": MAX_RAW_BUFFERS, "requested": buffers},
                                unkept_bytes)
            elif not peer.kept:
                self._turn_away(peer, request, "overloaded", f"more than {self.max_peers} ZeroMQ peers held at "
                                "once; retry later", {"limit": self.max_peers})
            elif peer.in_flight < self.max_in_flight:
                self._dispatch(peer, request)
            elif len(peer.waiting) < self.hwm:
                peer.waiting.append(request)
            else:
                self._decline(peer, request)

    @staticmethod
    def _receive_message(sock: zmq.Socket) -> tuple[list, int, int]:
        """The next message's parts, up to the most a request may have (the rest read and
        dropped), how many it had, and the bytes of those dropped; zmq.Again when none waits. A
        message arrives whole, so only its first part can find none."""
        frames = [sock.recv(zmq.NOBLOCK, copy=False)]
        while frames[-1].more and len(frames) < ENVELOPE_AND_BODY + MAX_RAW_BUFFERS + 1:
            frames.append(sock.recv(copy=False))
        parts, unkept_bytes = len(frames), 0
        while sock.get(zmq.RCVMORE):
            unkept_bytes += len(sock.recv(copy=True))
            parts += 1
        return frames, parts, unkept_bytes

    def _source_fd(self, frame: zmq.Frame) -> int | None:
        """The descriptor a message came in on; None where libzmq no longer tells (its peers'
        ends are then noticed only when a reply to them fails)."""
        if not self._fds_known:
            return None
        try:
            return frame.get(zmq.SRCFD)
        except zmq.ZMQError as exc:
            self._fds_known = False
            log.warning("libzmq does not tell which connection a message came on (%s): a peer that "
                        "leaves with nothing in flight keeps its sessions until the server stops", exc)
            return None

    def _connection_events(self, index: int) -> None:
        """Settle the connections of socket `index` that ended (or whose descriptor a new
        connection now has): their peers are gone. The monitor reports nothing but those
        (CONNECTION_EVENTS), each with its descriptor."""
        monitor = self.monitors[index]
        while monitor.get(zmq.EVENTS) & zmq.POLLIN:
            event = zmq.utils.monitor.recv_monitor_message(monitor)
            where = (index, event["value"])
            if event["event"] == zmq.EVENT_DISCONNECTED:
                self._ended.add(where)
            else:
                self._ended.discard(where)
            for peer in self._on_fd.pop(where, ()):
                if not peer.closed:
                    self._gone(peer, "disconnected")

    def _unlist(self, peer: ZmqPeer) -> None:
        """Take `peer` off its descriptor's list."""
        listed = self._on_fd.get((peer.key[0], peer.fd))
        if listed is not None:
            listed.discard(peer)
            if not listed:
                del self._on_fd[(peer.key[0], peer.fd)]

    def _dispatch(self, peer: ZmqPeer, request: tuple) -> None:
        message, received_ns, target = request
        peer.in_flight += 1
        try:
            body, buffers = message[0].buffer, [frame.buffer for frame in message[1:]]
            size = sum(len(frame) for frame in message)
            if size > self.max_frame_size:
                self.dispatcher.on_frame_error(target, protocol.FrameTooLarge(size, self.max_frame_size))
            else:
                self.dispatcher.on_frame(target, body, received_ns, buffers=buffers)
        except Exception:
            log.exception("%s: dispatching a request failed", peer.id)
            self._answered(peer)
        self._send_queued()

    def _decline(self, peer: ZmqPeer, request: tuple) -> None:
        """Answer `overloaded` at once: the peer has `hwm` requests waiting already."""
        self._turn_away(peer, request, "overloaded", f"more than {self.hwm} requests of this peer waiting; retry later",
                        {"limit": self.hwm})

    def _turn_away(self, peer: ZmqPeer, request: tuple, code: str, text: str, detail: dict,
                   unkept_bytes: int = 0) -> None:
        """Answer `request` with error `code` at once, unread by the dispatcher; `unkept_bytes`:
        those of its parts read and dropped, which count as read too."""
        message, _, target = request
        parts, op = protocol.error_reply_for(message[0].buffer, [frame.buffer for frame in message[1:]],
                                             code, text, detail)
        # Read as the dispatcher counts a request (SPEC §6.3); its answer counts as it leaves.
        stats = self.dispatcher.server.stats
        stats.frame_in(sum(len(frame) for frame in message) + unkept_bytes, target.lane)
        if op is None:
            stats.record_error(code)
        else:
            stats.record(op, None, ok=False, error_code=code)
        peer.in_flight += 1  # answered like any other request: _answered gives it back
        # Queued like a reply made here (behind replies the worker posted for this peer before,
        # which an id-less legacy client tells apart by order alone) and sent at once: the
        # reading loop that declines it is outside the dispatcher.
        self._queue((peer, target.envelope, parts, None, True))
        self._send_queued()

    def reply(self, target: ZmqReplyTarget, parts: list, buffers: list | None) -> None:
        """Send a reply to `target`'s peer. From another thread (the dispatcher's worker) it is posted for
        the io thread. Made on the io thread (a request served where it was read, as the native
        step path serves one) it is queued behind what was posted before it and sent as soon as
        the dispatcher returns from the request (_dispatch), instead of being posted to this
        thread through the eventfd and held until the loop's next flush (docs/performance.md,
        "zmq direct reply"). Never sent from in here: the dispatcher may
        still hold its serving lock and count the request in flight, and a send can start a
        request that waited past its peer's cap (_answered), which needs both."""
        entry = (target.peer, target.envelope, parts, buffers)
        if threading.current_thread() is not self._thread:
            self.outbox.post(entry)
            return
        self._queue(entry)

    def _queue(self, entry: tuple) -> None:
        """Queue a reply made on the io thread, (peer, envelope, parts, buffers[, droppable]) as
        _send takes them, behind what other threads posted before it was made."""
        if self.outbox.pending:
            self._take_posted()
        self._replies.append(entry)

    def _send_queued(self) -> None:
        """Send the replies queued on the io thread, outside the dispatcher; under a flush (a
        request it started) that flush sends them."""
        if self._replies and not self._flushing:
            try:
                self._flush(take_posted=self.outbox.pending)
            except Exception:  # as in the loop: a fault costs a reply, not the messages after it
                log.exception("zmq io thread: replies could not be sent")

    def _take_posted(self) -> None:
        self._replies.extend(item for item in self.outbox.take() if item is not None)  # None: close()'s wake-up

    def _flush(self, take_posted: bool = True) -> None:
        """Send the replies in order -- with what other threads posted (`take_posted`) after those
        queued already -- then retry the peers whose pipes were full. Not re-entered: sending a
        reply may start a request that waited past its peer's cap, whose reply, made here too,
        is sent by the loop below, so a queue of waiting requests is worked off in turn rather
        than by a recursion as deep as the queue."""
        self._flushing = True
        try:
            if take_posted:
                self._take_posted()
            # A retried peer's reply that leaves may start its waiting request, whose reply is
            # queued meanwhile: sent in the same flush, not a poll timeout later.
            while True:
                while self._replies:
                    self._send(*self._replies.popleft())
                for peer in list(self._backlogged):
                    self._send_unsent(peer)
                if not self._replies:
                    break
        finally:
            self._flushing = False

    def _send(self, peer: ZmqPeer, envelope: list, parts: list, buffers: list | None,
              droppable: bool = False) -> None:
        if peer.closed:  # it vanished after this request came: nobody to answer
            self._answered(peer)
            return
        # One ZeroMQ frame per body: a body of several parts (big inline tensors) is joined;
        # raw buffers go as frames of their own, without copies.
        body = parts[0] if len(parts) == 1 else b"".join(parts)
        reply = ([*envelope, body, *(buffers or ())], len(envelope))  # its frames, and where its body is
        # Replies to served requests are never dropped: at most max_in_flight of them can wait
        # (a request is not dispatched while that many are unsent). Only the lane's own refusals
        # (`overloaded`, too many raw buffers) to a peer that floods without reading are
        # unbounded, and only those are dropped.
        if droppable and len(peer.unsent) >= self.hwm + self.max_in_flight:
            peer.answers_dropped += 1
            if peer.answers_dropped == 1:
                log.warning("%s: overloaded answer dropped: the peer reads none of its replies (%d waiting); "
                            "further ones are counted until its replies leave again", peer.id, len(peer.unsent))
            self._answered(peer)
            return
        peer.unsent.append(reply)
        self._send_unsent(peer)

    def _send_unsent(self, peer: ZmqPeer) -> None:
        """Send the peer's replies in order, until its pipe is full (SNDHWM: they wait for a
        later round of the loop, which polls briefly while any wait) or it is found gone. A
        reply that fails otherwise is dropped, with a warning, and the next ones are tried:
        pyzmq retries EINTR itself, so what fails here (ENOTSOCK, ETERM: the lane is closing)
        would fail again, and kept it would hold the peer at its cap for good."""
        while peer.unsent:
            frames, body_at = peer.unsent[0]
            try:
                peer.socket.send_multipart(frames, zmq.NOBLOCK, copy=False)
            except zmq.Again:
                if not peer.kept:  # it holds nothing, its answer neither: dropped
                    peer.unsent.popleft()
                    self._answered(peer)
                    return
                self._backlogged.add(peer)
                return
            except zmq.ZMQError as exc:
                if exc.errno == zmq.EHOSTUNREACH:
                    self._gone(peer)
                    return
                log.warning("%s: a reply could not be sent and is dropped: %s", peer.id, exc)
            else:
                body_and_buffers = frames[body_at:]
                self.dispatcher.server.stats.reply_out(body_and_buffers[:1], body_and_buffers[1:], lane=peer.lane)
                if peer.answers_dropped:
                    log.warning("%s: its replies leave again; %d overloaded answers were dropped in all",
                                peer.id, peer.answers_dropped)
                    peer.answers_dropped = 0
            peer.unsent.popleft()
            self._answered(peer)
        self._backlogged.discard(peer)

    def _free_idle_peers(self) -> None:
        """Peers that own something, have nothing in flight and sent nothing for idle_timeout_s
        are gone: what they own is freed. A check much later than due finds the io thread was
        held (the process paused, SIGSTOP or a container's freezer; a long stall): peers were
        not listened to meanwhile, so that time is not counted as their silence (their messages
        of it may still be on their way through libzmq)."""
        now = time.monotonic()
        due = self._next_idle_check
        held_s = now - due if now - due > self._idle_check_s else 0.0
        self._next_idle_check = now + self._idle_check_s
        for peer in list(self._peers.values()):
            if held_s and peer.last_seen < due:  # silent through the hold, not heard since
                peer.last_seen = min(now, peer.last_seen + held_s)
            if (now - peer.last_seen > self.idle_timeout_s and peer.in_flight == 0 and not peer.waiting
                    and peer.has_close_callbacks):
                self._gone(peer, "idle")

    def _gone(self, peer: ZmqPeer, how: str = "vanished") -> None:
        log.info("%s %s; %d replies and %d requests of its dropped", peer.id, how, len(peer.unsent),
                 len(peer.waiting))
        self._drop_waiting(peer)
        self._backlogged.discard(peer)
        self._forget(peer)
        peer.mark_closed("idle" if how == "idle" else "closed")
        for _ in range(len(peer.unsent)):
            peer.unsent.popleft()
            self._answered(peer)

    def _drop_waiting(self, peer: ZmqPeer) -> None:
        """Drop the requests a gone peer sent past its in-flight cap: read off the socket, each
        counts in frames_in, and as `cancelled`, as the dispatcher counts a request it drops for
        a peer gone (SPEC §6.3)."""
        stats = self.dispatcher.server.stats
        while peer.waiting:
            message, _, target = peer.waiting.popleft()
            stats.frame_in(sum(len(frame) for frame in message), target.lane)
            _, _, op = protocol.codecs.request_facts(message[0].buffer, [frame.buffer for frame in message[1:]])
            if op is None:
                stats.record_error("cancelled")
            else:
                stats.record(op, None, ok=False, error_code="cancelled")

    def _answered(self, peer: ZmqPeer) -> None:
        peer.in_flight -= 1
        # Idle counts from its last message or its last answer, whichever came later: a peer
        # waiting on its own long request has not been silent.
        peer.last_seen = time.monotonic()
        # `overloaded` answers count too, so the peer may still be at its cap.
        if peer.waiting and not peer.closed and peer.in_flight < self.max_in_flight:
            self._dispatch(peer, peer.waiting.popleft())
        elif peer.in_flight == 0 and not peer.waiting and not peer.unsent and not peer.has_close_callbacks:
            # Idle and owning nothing: forget it (a later message makes a fresh peer).
            self._forget(peer)

    def _forget(self, peer: ZmqPeer) -> None:
        self._unlist(peer)
        if self._peers.get(peer.key) is peer:  # not a newer peer with the same routing id
            del self._peers[peer.key]
