"""Python clients. `PortClient` spawns `python -m bridge` over pipes exactly as a BEAM Port
would ({packet, 4}: a 4-byte big-endian length before each msgpack body), pipelines requests by
id, converts numpy/torch tensors to wire tensors and back, and returns each result with the
server's timing split plus its own round trip. `UnixClient(path)` and `ZmqClient(endpoint)`
have the same API for a server started with `--unix PATH` / `--zmq ENDPOINT`; on those two,
`info()` also reads the server's per-connection cap, and the client then keeps to it: requests
past the cap but one (the slot kept for cancels) are held until replies free a slot.

    with PortClient() as client:
        reply = client.scan(x, dt, A, B, C, return_state=True)
        reply.unwrap()["y"], reply.timing["kernel_us"], reply.round_trip_us
"""

from __future__ import annotations

import collections
import contextlib
import functools
import itertools
import math
import os
import socket
import subprocess
import sys
import threading
import time
import weakref
from concurrent.futures import Future, InvalidStateError
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

import protocol
from bridge.dtypes import NUMPY_DTYPES, WIRE_CODES
from bridge.stop_signals import StopSignalsHeld
from bridge.streams import read_frame, write_all


class BridgeError(Exception):
    """The server answered with an error reply, or would have: a request over the server's
    known `max_frame_size` is refused with `frame_too_large` before it is sent."""

    def __init__(self, code: str, message: str, detail: dict | None = None, timing: dict | None = None):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.detail = detail or {}
        self.timing = timing or {}

    def __reduce__(self):
        # Exception's default rebuilds from self.args (the one formatted string): keep every
        # field, and what was set on it since (add_note's notes).
        return type(self), (self.code, self.message, self.detail, self.timing), self.__dict__


class ServerExited(ConnectionError):
    """The connection to the server is gone (the server exited or closed its end, a write failed,
    the client was closed or dropped without close()), with requests outstanding or asked for."""


@dataclass
class Reply:
    id: object
    ok: bool
    result: dict | None
    error: dict | None
    timing: dict
    round_trip_us: float  # submit → reply decoded, client codec included
    client_encode_us: float = 0.0
    client_decode_us: float = 0.0
    bytes_out: int = 0  # request frame bytes sent
    bytes_in: int = 0  # reply frame bytes received
    extra: dict = field(default_factory=dict)

    @property
    def ipc_us(self) -> float | None:
        """Round trip minus everything the server did and the client codec: transport cost. None
        for a reply without `server_us` (an error reply may have no timing, SPEC §8): the round
        trip alone would count the server's time as transport."""
        server_us = self.timing.get("server_us")
        if server_us is None:
            return None
        return self.round_trip_us - server_us - self.client_encode_us - self.client_decode_us

    def unwrap(self) -> dict:
        if not self.ok:
            err = self.error or {}
            raise BridgeError(err.get("code", "?"), err.get("message", ""), err.get("detail"), self.timing)
        return self.result


def to_wire(value):
    """numpy array / torch tensor → protocol.OutTensor (data is a zero-copy view when the
    array is little-endian and C-contiguous, else a copy that is); numpy scalars → Python
    numbers, as options such as dt_min take them (np.asarray(x) makes a 0-d tensor); a dict's
    values each (a model's weights or state), and a list's or tuple's items (session_open's
    frames, dt_limit), as a list; other values pass through."""
    if isinstance(value, dict):
        return {k: to_wire(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_wire(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        # The wire is little-endian: a big-endian array is sent as a little-endian copy.
        wire_dtype = value.dtype.newbyteorder("<") if value.dtype.byteorder == ">" else value.dtype
        if wire_dtype not in WIRE_CODES:
            raise TypeError(f"dtype {value.dtype} has no wire code; expected one of {sorted(map(str, WIRE_CODES))}")
        # np.require keeps a 0-d array 0-d (np.ascontiguousarray makes it 1-d).
        arr = np.require(value, wire_dtype, "C")
        return protocol.OutTensor(WIRE_CODES[wire_dtype], arr.shape, arr)
    # Looked up, not imported: a client that never made a torch tensor need not load torch. A
    # subclass (another library's tensor type) is sent as the tensor it is.
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        from bridge.tensors import to_wire as tensor_to_wire

        return tensor_to_wire(value.detach().as_subclass(torch.Tensor))
    return value


def from_wire(t: protocol.WireTensor, *, as_torch: bool = False):
    """Wire tensor → numpy array (torch tensor for bf16, or when as_torch), zero-copy: a view
    into the reply's body, which was read into a buffer of its own and stays alive as long
    as the array does."""
    if as_torch or t.dtype == "bf16":
        from bridge.tensors import host_view

        return host_view(t)
    return np.frombuffer(t.data, dtype=NUMPY_DTYPES[t.dtype]).reshape(t.shape)


def result_from_wire(value, *, as_torch: bool = False):
    """A decoded reply's result with every wire tensor in it made an array (see from_wire)."""
    if isinstance(value, protocol.WireTensor):
        return from_wire(value, as_torch=as_torch)
    if isinstance(value, dict):
        return {k: result_from_wire(v, as_torch=as_torch) for k, v in value.items()}
    if isinstance(value, list):
        return [result_from_wire(v, as_torch=as_torch) for v in value]
    return value


class RemoteModel:
    """A model loaded on the server (`Client.load_model`); `info` is model_load's reply."""

    def __init__(self, client, info: dict):
        self.client = client
        self.info = info
        self.id = info["model"]

    def open_session(self, batch: int = 1, state: dict | None = None, timeout: float | None = 60.0) -> ModelSession:
        """A session of `batch` rows: zero state, or `state` as `ModelSession.state()` gave it.
        Here and in ModelSession, `timeout` is as `request`'s."""
        args = {"model": self.id, "batch": batch}
        if state is not None:
            args["state"] = state
        return ModelSession(self.client, self.client.call("session_open", timeout, **args)["session"], batch)

    def free(self) -> None:
        self.client.call("model_free", model=self.id)


class ModelSession:
    """Every layer's state of `batch` rows of a model, kept on the server."""

    def __init__(self, client, session_id: str, batch: int):
        self.client = client
        self.id = session_id
        self.batch = batch

    def _args(self, tokens, embeds, output: str | None, return_state: bool) -> dict:
        if (tokens is None) == (embeds is None):
            raise ValueError("expected exactly one of tokens and embeds, got "
                             + ("neither" if tokens is None else "tokens and embeds"))
        args = {"session": self.id, **({"tokens": tokens} if tokens is not None else {"embeds": embeds})}
        if output is not None:
            args["output"] = output
        if return_state:
            args["return_state"] = True
        return args

    @staticmethod
    def _answer(result: dict, return_state: bool):
        """A model op's one output (logits or hidden), and beside it the state when asked for."""
        state = result.get("state")
        (out,) = (value for key, value in result.items() if key != "state")
        return (out, state) if return_state else out

    def forward(self, tokens=None, *, embeds=None, output: str | None = None, last_only: bool = False,
                return_state: bool = False, lengths=None, timeout: float | None = 60.0):
        """Prefill tokens [batch, seq] (or embeds [batch, seq, d_model]) from the current
        state, leaving the state at the end; the logits (or hidden states) [batch, seq, ...].
        With lengths ([batch] ints, at most seq: an integer array or a list), row i runs only
        its first lengths[i] positions (its outputs past them zero). With return_state, (output, state): the state
        after the window as `state()` gives it, with no round trip of its own."""
        args = self._args(tokens, embeds, output, return_state)
        if last_only:
            args["last_only"] = True
        if lengths is not None:
            args["lengths"] = integer_list(lengths, "lengths") if isinstance(lengths, (list, tuple)) else lengths
        return self._answer(self.client.call("model_forward", timeout, **args), return_state)

    def step_reply(self, tokens=None, *, embeds=None, output: str | None = None, return_state: bool = False,
                   snapshot_into: str | None = None, timeout: float | None = 60.0) -> Reply:
        """The Reply to one frame (its timing too); with return_state, its result holds "state"
        beside the output, as a scan's does."""
        args = self._args(tokens, embeds, output, return_state)
        if snapshot_into is not None:
            args["snapshot_into"] = snapshot_into
        return self.client.request("model_step", args, timeout)

    def step(self, tokens=None, *, embeds=None, output: str | None = None, return_state: bool = False,
             snapshot_into: str | None = None, timeout: float | None = 60.0):
        """One frame: tokens [batch] (or embeds [batch, d_model]) -> logits (or hidden) [batch, ...];
        with return_state, (output, state) as `forward` gives them. With snapshot_into (a
        snapshot's id, from `snapshot`), that snapshot takes the state as it was before this frame,
        in the same round trip: a rollback ring kept without requests of its own."""
        reply = self.step_reply(tokens, embeds=embeds, output=output, return_state=return_state,
                                snapshot_into=snapshot_into, timeout=timeout)
        return self._answer(reply.unwrap(), return_state)

    def snapshot(self, timeout: float | None = 60.0) -> str:
        """A copy of the whole state, kept on the server; its id, for `restore`."""
        return self.client.call("session_snapshot", timeout, session=self.id)["snapshot"]

    def restore(self, snapshot: str, timeout: float | None = 60.0) -> None:
        self.client.call("session_restore", timeout, session=self.id, snapshot=snapshot)

    def restore_with_frames(self, snapshot: str, frames, timeout: float | None = 60.0) -> list:
        """A rollback in one round trip: restore `snapshot`, then run `frames` on this session,
        (op, args) pairs with op "model_step" or "model_forward" and args that op's own but the
        session; each frame's output (and state, with return_state) as step and forward return
        them. A model_step frame's snapshot_into refreshes a rollback ring with the corrected
        states. A frame that fails leaves the session holding the snapshot's state, and the
        snapshots its frames copied into undefined (SPEC §6.1)."""
        frames = list(frames)
        results = self.client.restore_with_frames(self.id, snapshot, frames, timeout)
        return [self._answer(result, asks_for_state(args)) for (_, args), result in zip(frames, results)]

    def free_snapshot(self, snapshot: str) -> None:
        self.client.call("snapshot_free", snapshot=snapshot)

    def fork(self, timeout: float | None = 60.0) -> ModelSession:
        """A new session holding a copy of this one's state, stepped independently."""
        return ModelSession(self.client, self.client.call("session_fork", timeout, session=self.id)["session"],
                            self.batch)

    def state(self, timeout: float | None = 60.0) -> dict:
        """Every layer's state by name (layers.<i>.conv, layers.<i>.ssm), fp32."""
        return self.client.call("session_state", timeout, session=self.id)["state"]

    def close(self) -> None:
        self.client.call("session_close", session=self.id)


# return_state and the names mamba_ssm gives it, each of which the server takes (SPEC §6).
STATE_FLAGS = ("return_state", *(alias for alias, name in protocol.ALIASES.items() if name == "return_state"))


def asks_for_state(args: dict) -> bool:
    """Whether a frame's args ask for the state after it, by any of its names."""
    return any(args.get(flag) for flag in STATE_FLAGS)


def wire_arguments(args: dict) -> dict:
    """A request's arguments as to_wire makes them; one it refuses (an array of a dtype the
    wire has no code for) is named, as the encoder names what it refuses."""
    wired = {}
    for name, value in args.items():
        try:
            wired[name] = to_wire(value)
        except TypeError as exc:
            raise TypeError(f"args.{name}: {exc}") from exc
    return wired


def integer_list(values, name: str) -> np.ndarray:
    """A list of ints as the i64 tensor the server takes (a msgpack array it refuses); a float
    or a bool among them is refused, not converted, and one past i64 is refused, not wrapped."""
    for index, value in enumerate(values):  # the first bad one named: the list may be long
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
            raise ValueError(f"{name}[{index}]: expected an int, got {type(value).__name__} {value!r:.40}")
        if not -(2**63) <= value < 2**63:
            raise ValueError(f"{name}[{index}]: expected an int within i64, got {value!r:.40}")
    return np.array(values, dtype=np.int64)


def wait_settled(futures: list[Future], timeout: float) -> None:
    """Wait up to `timeout` seconds for each of `futures` to be answered or cancelled:
    concurrent.futures.wait never counts one cancelled by Future.cancel() (its waiters are told
    only of a cancel the executor notifies), and would wait out the timeout for it."""
    settled = threading.Semaphore(0)
    for future in futures:
        future.add_done_callback(lambda _: settled.release())  # at once for one done already
    deadline = time.monotonic() + timeout
    for _ in futures:
        if not settled.acquire(timeout=max(0.0, deadline - time.monotonic())):
            return


def settle(future: Future, outcome) -> None:
    """Resolve `future` with a Reply, or fail it with an exception, unless its caller has
    cancelled it already (cancel() succeeds on a pending Future at any time, even between a
    done() check and set_result, so InvalidStateError is the one race-free test)."""
    try:
        if isinstance(outcome, BaseException):
            future.set_exception(outcome)
        else:
            future.set_result(outcome)
    except InvalidStateError:
        pass


@dataclass(slots=True)
class InFlight:
    """What the client keeps of a request until its reply comes."""

    future: Future
    start_ns: int  # perf_counter_ns when submit began
    encode_us: float = 0.0
    bytes_out: int = 0
    # Its place in the order frames were written, from when its write began; None before.
    write_order: int | None = None
    # A raw frame whose id the server cannot read: its answer has id nil (SPEC §4), told apart
    # by the order frames were written.
    id_unread: bool = False
    # For a cancel that cancel() sent, the Future of the request it names: once that request is
    # out of flight, the cancel is dropped unwritten. None for others, a caller's own cancel too.
    cancelling: Future | None = None
    # ZmqClient: the connection its message went out on (how many had ended before), None
    # while none has taken it.
    sent_on: int | None = None
    # The request's op (None for send_raw's): what a late reply to a cancelled one created is freed.
    op: str | None = None


@dataclass
class HeldRequest:
    """A request kept back from the wire while the connection's cap is full: sent, re-encoded
    with what is left of its deadline, when an earlier reply frees a slot."""

    op: str | None  # None: a body from send_raw, sent as it is
    wire_args: dict
    parts: list
    deadline_ns: int | None  # perf_counter_ns when its budget runs out; None: it has none

    def owned(self) -> "HeldRequest":
        """This request with copies of the bytes its parts and tensors view: written after
        submit returned, it sends what the caller's arrays held when it was submitted."""
        return HeldRequest(self.op, _owned_args(self.wire_args), [bytes(memoryview(p)) for p in self.parts],
                           self.deadline_ns)


def _owned_args(value):
    """Request arguments with each tensor's data copied (to_wire's are views of the arrays)."""
    if isinstance(value, protocol.OutTensor):
        return protocol.OutTensor(value.dtype, value.shape, bytes(memoryview(value.data)))
    if isinstance(value, dict):
        return {k: _owned_args(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_owned_args(v) for v in value]
    return value


@dataclass
class TakenOut:
    """A held request the releasing thread took out to send, until it is written."""

    request: HeldRequest
    entry: InFlight
    # cancel() asked for it meanwhile: it is dropped unsent, or its cancel sent after it.
    cancel_asked: bool = False


@dataclass(slots=True)
class Received:
    """A reply as it came, until the request it answers is known."""

    decoded: protocol.Reply
    result: dict | None  # decoded's result, its tensors converted
    received_ns: int  # perf_counter_ns when its frame was read
    done_ns: int  # and when it was decoded
    nbytes: int


@dataclass(slots=True)
class NilAnswer:
    """An answer with id nil (SPEC §4) until the frame it is for is known: one the server dropped
    unread for want of memory, `length` bytes long (SPEC §2), or, with no length, one whose id
    the server could not read."""

    received: Received
    length: int | None
    # How many frames had their places in the write order when it came: its frame is one of them.
    written: int
    # Its frame once known, kept while an earlier answer's is not: those after are for frames
    # written after it.
    frame: InFlight | None = None


# What a late reply to a cancelled request created is freed (FramedClient._free_late): by op, the
# op that frees it and its argument.
FREED_BY = protocol.schema.FREED_BY

# How many replies to nothing in flight a client keeps (the latest): a long-lived client
# must not grow without bound.
UNMATCHED_KEPT = 1000


class FramedClient:
    """Pipelined request/reply over a pair of byte streams with 4-byte length framing.
    Subclasses provide the streams and `close`; replies are matched to requests by id.

    `max_frame_size` is the server's limit on a request body once the client knows it (from
    `info()` or a `frame_too_large` reply); a request over it is refused before it is sent.

    Thread-safe (so PortClient and UnixClient are too): any number of threads may submit at
    once; ids come from one counter under a lock, each frame is written whole under a write
    lock, and one reader thread resolves the Futures. When the server goes away, the callers
    waiting fail with ServerExited (with BridgeError `overloaded` when the server turned the
    connection away, SPEC §4)."""

    # Bytes of a request's frame that do not count against max_frame_size: the length prefix.
    _frame_overhead = protocol.framing.HEADER_SIZE
    # Whether a write can wait for the server to read, which it may not do while replies wait
    # for this client to read them (SPEC §7): the reader thread then leaves writes to a writer
    # thread of their own (a Future's done callback's submit, the held requests a reply frees).
    _writes_wait_for_the_server = True
    # Whether an `overloaded` reply with id nil turns the connection away (a unix server past
    # --max-connections) rather than answering a frame whose id the server could not read.
    _turns_connections_away = True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __init__(self, reader, writer_fd: int, *, as_torch: bool = False):
        self._reader = reader
        self._writer_fd = writer_fd
        self._ids = itertools.count(1)
        self._writes = 0  # frames given a place in the write order
        self._pending: dict[object, InFlight] = {}
        self._lock = threading.Lock()
        self._write_lock = threading.Lock()
        self.as_torch = as_torch
        # Why new requests are refused (set under self._lock); the writer fd is closed only
        # with it set and self._write_lock held, so no write starts on a closed fd's number.
        self._refusal: str | None = None
        # The latest UNMATCHED_KEPT replies whose id matches no request in flight (e.g.
        # replies with id null to undecodable frames send_raw sent without an id), and how many came in
        # all (what a caller waiting for the next one watches: the deque stops growing).
        self.unmatched: collections.deque = collections.deque(maxlen=UNMATCHED_KEPT)
        self.unmatched_count = 0
        self.max_frame_size: int | None = None
        # The server's cap on this connection's requests in flight (info's
        # max_in_flight_per_peer, adopted on the lanes that have one), or None. Past the cap a
        # frame waits unread, and a cancel behind the very request it names would arrive after
        # it ran, so what is on the wire keeps to the cap, cancels included, and requests leave
        # one slot of it to cancels (where it has one to spare). Requests past that are held
        # here, in order, where cancel drops them unsent; cancels past the cap wait apart and go
        # first, the server answering a cancel as it reads it.
        self.max_in_flight: int | None = None
        self._held: collections.OrderedDict[object, HeldRequest] = collections.OrderedDict()
        self._held_cancels: collections.OrderedDict[object, HeldRequest] = collections.OrderedDict()
        # Held requests the releasing thread took out to send, by id. One thread at a time
        # releases (_send_released; _releaser is its ident, or None), so that they go in order,
        # and no request goes past them meanwhile.
        self._releasing: dict[object, TakenOut] = {}
        self._releaser: int | None = None
        # The thread that releases held requests for the reader thread (_wake_writer), once needed.
        self._writer: threading.Thread | None = None
        self._writer_wake = threading.Event()
        # Raw frames sent without an id whose ids the server cannot read, written and not yet
        # answered: an answer with id nil may be one's, and is then nobody's.
        self._unread_unnamed: list[InFlight] = []
        # Answers with id nil, in the order they came, from the first whose frame is not yet
        # known (_nil_answers_told_apart).
        self._nil_answers: list[NilAnswer] = []
        # An `overloaded` reply with id nil: the server turned this connection away and closes
        # it (SPEC §4), which the requests in flight then fail with.
        self._turned_away: BridgeError | None = None
        self._turned_away_told = False  # a request refused so has been told (_refusal_error)
        # Cleared once the server refuses `deadline_us` (a v1 server older than it, SPEC §4): no
        # request on this connection carries one after that.
        self._sends_deadlines = True
        self._pid = os.getpid()
        self._leftovers = Leftovers(self._release_when_dropped())
        self._thread = self._start_reader()
        _clients.add(self)

    # -- requests -------------------------------------------------------------------------

    def submit(self, op: str, args: dict | None = None, *, request_id=None,
               deadline_s: float | None = None) -> Future:
        """Send one request (or, past the cap `info()` read, hold it to send when a reply frees a
        slot, with what is left of its deadline, and with copies of its arrays' bytes: they may
        change once this returns); the Future resolves to its Reply. From a Future's done
        callback (the reader thread) a writer thread sends it, so the replies keep being read. `request_id` (a uint or a
        non-empty str) must not be one in flight (SPEC §1): that is a ValueError. By default
        the client numbers requests 1, 2, ..., passing over ids that callers chose.
        `deadline_s`: the request's budget on the server (SPEC §4 `deadline_us`): still waiting
        to run when it is spent, it is answered `deadline_exceeded` without running. Give up on
        it sooner with `cancel(future)`. A `cancel` submitted here keeps to the cap as those of
        `cancel` do, and is sent and answered as any request."""
        return self._submit(op, args, request_id, deadline_s)

    def _submit(self, op: str, args: dict | None, request_id, deadline_s: float | None,
                cancelling: Future | None = None) -> Future:
        """submit's work; `cancelling`: as InFlight's."""
        entry = InFlight(Future(), time.perf_counter_ns(), cancelling=cancelling, op=op)
        deadline_us = wire_deadline_us(deadline_s) if self._sends_deadlines else None
        with self._in_flight(request_id, entry) as request_id:
            wire_args = wire_arguments(args or {})
            try:
                parts = self._encode(request_id, op, wire_args, deadline_us)
            except protocol.FrameTooLarge as too_large:
                raise BridgeError("frame_too_large", f"{too_large.length} bytes exceed the {too_large.limit} "
                                  "that msgpack's bin or a 4-byte length prefix can carry; it was not sent",
                                  too_large.detail) from too_large
            entry.bytes_out = sum(memoryview(p).nbytes for p in parts)
            self._check_frame_size(entry.bytes_out - self._frame_overhead)
            entry.encode_us = (time.perf_counter_ns() - entry.start_ns) / 1000.0
            deadline_ns = None if deadline_us is None else entry.start_ns + deadline_us * 1000
            held = self._send_or_hold(request_id, entry, HeldRequest(op, wire_args, parts, deadline_ns))
        if held:
            self._send_released()
        return entry.future

    def _send_or_hold(self, request_id, entry: InFlight, request: HeldRequest) -> bool:
        """Send `request` (registered in flight already, as `entry`), or hold it; whether it was
        held, or dropped unwritten (a cancel whose request was answered meanwhile). The caller
        then releases what the cap has room for (`_send_released`): while it was being encoded
        it counted as on the wire, so a reply that came then released nothing, and with nothing
        left to answer, it and those before it would wait for ever."""
        if self._held_back(request_id, request):
            return True
        return not self._send(request.parts, entry)

    def _held_back(self, request_id, request: HeldRequest) -> bool:
        """Whether `request` is held instead of sent: a request while this connection has its
        cap's worth but one on the wire, or others wait before it (held, cancels too, or a
        thread is releasing them: it sends this one in its turn); a cancel while it has the
        cap's worth, or other cancels wait before it; any request made on the reader thread where
        a write can wait for the server (the writer thread sends it: _send_released). Held, it
        keeps copies of what its tensors view (HeldRequest.owned)."""
        on_reader = self._writes_wait_for_the_server and threading.current_thread() is self._thread
        if self.max_in_flight is None and not on_reader:
            return False
        with self._lock:
            if request.op == "cancel":
                if not on_reader and not self._held_cancels and self._wire_room(not_counting=1, for_cancel=True):
                    return False
                self._held_cancels[request_id] = request.owned()
                return True
            others_first = self._held or self._held_cancels or self._releaser is not None
            if not on_reader and not others_first and self._wire_room(not_counting=1):
                return False
            self._held[request_id] = request.owned()
            return True

    def _wire_room(self, not_counting: int = 0, *, for_cancel: bool = False) -> bool:
        """Whether the cap has room for one more request on the wire (less the slot kept for
        cancels, where it has one to spare), or, `for_cancel`, one more cancel: those in flight
        and not held count, less `not_counting` registered but not yet sent or held. Called with
        self._lock held. Without a cap, always."""
        if self.max_in_flight is None:
            return True
        on_wire = len(self._pending) - len(self._held) - len(self._held_cancels) - not_counting
        return on_wire < (self.max_in_flight if for_cancel else max(self.max_in_flight - 1, 1))

    def _send_released(self) -> None:
        """Send what is held while the cap has room (after a reply freed a slot): cancels first,
        then requests, each oldest first. One thread at a time does, so that each is written
        before the next is taken out: a thread that finds another at it leaves it what it freed
        (that one looks again after each send). A request whose deadline has passed goes with a
        spent budget, which the server answers deadline_exceeded; a send that fails fails its
        request. An interrupt (Ctrl-C) ends this thread's turn, with what it took out and had
        not begun to write held again (_hold_again), and what is held left to another thread to
        release (_release_elsewhere). On the reader thread where a write can wait for the
        server, the writer thread does it (_wake_writer)."""
        if self._writes_wait_for_the_server and threading.current_thread() is self._thread:
            with self._lock:
                releasable = self._releasable()
            if releasable:
                self._wake_writer()
            return
        this_thread = threading.get_ident()
        try:
            # Claimed inside the `try`: an interrupt just after would keep the turn for ever.
            with self._lock:
                if self._releaser is not None:
                    return
                self._releaser = this_thread
            while (taken := self._take_released()) is not None:
                self._send_taken(*taken)
        except BaseException:
            with self._lock:
                cancels_owed = []
                if self._releaser == this_thread:
                    self._releaser = None
                    cancels_owed = self._hold_again()
                left_held = self._releaser is None and bool(self._held or self._held_cancels)
            if cancels_owed or left_held:
                self._release_elsewhere(cancels_owed)
            raise

    def _wake_writer(self) -> None:
        """Have the writer thread release what is held, for the reader thread: a write there
        could wait for the server to read while the server waits for this reader to read its
        replies (a big request from a done callback over stdio would stop the client for good)."""
        with self._lock:
            if self._writer is None:
                self._writer = threading.Thread(target=write_released, args=(self._writer_wake, weakref.ref(self)),
                                                name="bridge-client-writer", daemon=True)
                self._writer.start()
        self._writer_wake.set()

    def _release_elsewhere(self, cancels_owed: list[Future]) -> None:
        """After an interrupt ended a thread's turn to release, on a thread of its own: ask the
        server to drop the requests of `cancels_owed` (see _hold_again), then release what is
        held: the replies that freed slots for it came already (their threads left it to that
        one), and with nothing else on the wire no reply would come to release it."""
        def resume():
            for future in cancels_owed:
                self._cancel_at_server(future)
            self._send_released()

        threading.Thread(target=resume, name="bridge-client-release", daemon=True).start()

    def _take_released(self) -> tuple[object, TakenOut] | None:
        """The next held request the cap has room for, taken out to send (its id, and it in
        `_releasing`); None when there is none, this thread then no longer releasing (decided
        under the one lock, so that a slot freed after is released by the thread that freed it)."""
        with self._lock:
            while (held := self._releasable()) is not None:
                request_id, request = next(iter(held.items()))
                entry = self._pending.get(request_id)
                if entry is None:  # answered before it was sent (a stray reply with its id)
                    del held[request_id]
                    continue
                # In `_releasing` before it leaves `held`: an interrupt never finds it in neither.
                taken = self._releasing[request_id] = TakenOut(request, entry)
                del held[request_id]
                return request_id, taken
            self._releaser = None
            return None

    def _releasable(self):
        """Where the next request the cap has room for is held (the held cancels, else the held
        requests), or None. Called with self._lock held."""
        if self._held_cancels and self._wire_room(for_cancel=True):
            return self._held_cancels
        if self._held and self._wire_room():
            return self._held
        return None

    def _hold_again(self) -> list[Future]:
        """Hold again, first, what this thread took out to send and had not begun to write when
        an interrupt ended its turn: in flight unsent, it would keep a slot of the cap for ever,
        its Future never resolved. One cancel() asked for meanwhile leaves flight instead.
        Returns the Futures of those whose write began and whose cancel this thread was to send
        after them: unsent, the request would run, its reply dropped. Called with self._lock
        held, by the releasing thread."""
        cancels_owed = []
        for request_id, taken in self._releasing.items():
            if self._pending.get(request_id) is not taken.entry:
                continue  # out of flight already
            if taken.entry.write_order is not None:  # its write began (one cut short ends a stream: _send)
                if taken.cancel_asked:
                    cancels_owed.append(taken.entry.future)
                continue
            if taken.cancel_asked:
                del self._pending[request_id]
                continue
            held = self._held_cancels if taken.request.op == "cancel" else self._held
            held[request_id] = taken.request
            held.move_to_end(request_id, last=False)
        self._releasing.clear()
        return cancels_owed

    def _send_taken(self, request_id, taken: TakenOut) -> None:
        """Send a request `_take_released` took out, re-encoded with what is left of its
        deadline; one that fails to be (re-encoded, or written) fails alone."""
        request, entry = taken.request, taken.entry
        try:
            parts = request.parts
            if request.deadline_ns is not None:
                left_us = max(0, (request.deadline_ns - time.perf_counter_ns()) // 1000)
                parts = self._encode(request_id, request.op, request.wire_args, left_us)
                # Its length may have changed: an id-nil answer to it is matched by length.
                entry.bytes_out = sum(memoryview(p).nbytes for p in parts)
            with self._lock:
                if taken.cancel_asked:  # cancelled while taken out: never sent
                    del self._releasing[request_id]
                    self._pending.pop(request_id, None)
                    return
            self._send(parts, entry)
        except Exception as exc:
            with self._lock:
                self._releasing.pop(request_id, None)
                self._pending.pop(request_id, None)
            settle(entry.future, exc)
            return
        with self._lock:
            cancel_asked = taken.cancel_asked
            if not cancel_asked:
                del self._releasing[request_id]
        if cancel_asked:  # once it was on its way: the cancel goes behind it
            # Left in `_releasing` until the cancel is asked: an interrupt before that has it
            # asked from another thread (_hold_again).
            self._cancel_at_server(entry.future)
            with self._lock:
                del self._releasing[request_id]

    @contextlib.contextmanager
    def _in_flight(self, request_id, entry: InFlight):
        """`entry` in flight under `request_id` (None: the next automatic id), which this yields,
        while its request is sent: registered before the write, as the reply may arrive before
        the write returns, and taken out again if sending raises (its caller gets the
        exception, never the Future) -- unless it was sent, an interrupt (Ctrl-C) coming after
        its write or post: then it stays in flight until answered, counted against the cap, its
        id not given again meanwhile (a stream ended with requests refused aside)."""
        entry.future.request_id = None  # what cancel() names, once registered
        try:
            # Registered inside the `try`: an interrupt as it returned would leave it in flight,
            # never sent nor resolved, its slot of the cap taken for ever.
            yield self._register(request_id, entry)
        except BaseException:
            with self._lock:
                request_id = entry.future.request_id
                leaves_flight = entry.write_order is None or self._refusal
                # An interrupt as the hold let go of its lock finds it held (or taken out to send):
                # it leaves that too, or the cap would count it neither held nor on the wire.
                if leaves_flight and not self._answered(entry.future) and not self._dropped_unsent(request_id):
                    del self._pending[request_id]
            # It counted against the cap while registered: what it held back may go now.
            if self._held or self._held_cancels:
                self._send_released()
            raise

    def _register(self, request_id, entry: InFlight):
        """Put `entry` in flight under `request_id`, or under the next automatic id not in
        flight when that is None, and name it in its Future; returns the id."""
        with self._lock:
            if self._refusal:
                raise self._refusal_error(entry)
            if request_id is None:
                request_id = next(self._ids)
                while request_id in self._pending:
                    request_id = next(self._ids)
            elif not protocol.schema.valid_request_id(request_id):
                # Checked before the lookup: True is a key equal to 1, so it would pass for that id.
                raise ValueError(f"request_id: expected a uint or a non-empty str, got {request_id!r}")
            elif request_id in self._pending:
                raise ValueError(f"request_id: expected an id not in flight, got {request_id!r}, "
                                 "which a request still waiting for its reply has")
            self._pending[request_id] = entry
            entry.future.request_id = request_id
        return request_id

    def _check_frame_size(self, length: int) -> None:
        limit = self.max_frame_size
        if limit is not None and length > limit:
            raise BridgeError("frame_too_large", f"a request of {length} bytes exceeds the server's limit of "
                              f"{limit} bytes (max_frame_size); it was not sent", {"length": length, "limit": limit})

    def _encode(self, request_id, op: str, wire_args: dict, deadline_us: int | None = None) -> list:
        """The buffers that carry one request."""
        return protocol.frame_parts(protocol.encode_request(request_id, op, wire_args, deadline_us=deadline_us))

    def _send(self, parts: list, entry: InFlight | None = None) -> bool:
        """Write one frame (of request `entry`, where `_begin_write` lets it); whether it was
        written. A write that fails or is interrupted (KeyboardInterrupt) may have sent part of
        it, after which the server would read the next request's bytes as the rest: the stream
        is ended instead (the server drops the partial frame at EOF and answers what came before
        it), and later requests are refused. An OSError is raised as ServerExited."""
        with self._write_lock:
            if self._refusal:
                raise self._refusal_error(entry)
            if not self._begin_write(entry):
                return False
            try:
                write_all(self._writer_fd, parts)
            except BaseException as exc:
                self._refuse_requests(f"a write failed part way ({exc!r}); the stream was ended")
                self._end_stream()
                if not isinstance(exc, OSError):
                    raise
                failed = exc
            else:
                return True
        # The server closed its end first: a unix server past --max-connections says why in an
        # `overloaded` reply the reader may not have read yet (SPEC §4); give it a moment.
        if threading.current_thread() is not self._thread:
            self._thread.join(1.0)
        if entry is not None and entry.future.done() and not entry.future.cancelled():
            # The reader failed it with the rest in flight at the close (_fail_all): that is its answer.
            if (answer := entry.future.exception()) is not None:
                raise answer from failed
        raise self._refusal_error(entry) from failed

    def _refusal_error(self, entry: InFlight | None = None) -> Exception:
        """Why requests are refused (`entry`: the one refused): the server's `overloaded` where it
        turned this connection away, for the first request refused so (a retry belongs on a new
        client: this connection is closed, and `overloaded` again for ever would keep a retry
        loop on it), else ServerExited. A cancel of cancel()'s is never the one told: nobody
        sees its refusal (_cancel_at_server)."""
        turned = self._turned_away
        if turned is None or (entry is not None and entry.cancelling is not None):
            return ServerExited(self._refusal)
        # Unlocked (a caller may hold self._lock): two first refusals at once may both say overloaded.
        told, self._turned_away_told = self._turned_away_told, True
        if not told:
            return BridgeError(turned.code, turned.message, turned.detail)
        return ServerExited(f"the server turned this connection away ({turned.code}, {turned.detail}): "
                            "open a new client to retry")

    def _begin_write(self, entry: InFlight | None) -> bool:
        """Whether the frame of `entry` is written, as it is about to be (called with
        self._write_lock held). Not a cancel of cancel()'s whose request is out of flight: its
        id may be a later request's already, which the cancel would drop (SPEC §1, §6), and one
        written after this check is written after the cancel too; it is taken out of flight
        instead. Otherwise `entry` takes the next place in the write order, by which answers
        with id nil are told apart (_nil_answers_told_apart): before the write, as the answer
        may come before the write returns."""
        if entry is not None:
            if entry.cancelling is not None:
                with self._lock:
                    if self._answered(entry.cancelling):
                        self._pending.pop(entry.future.request_id, None)
                        return False
            entry.write_order = self._writes
            self._writes += 1
            if entry.id_unread and entry.future.request_id is None:
                with self._lock:
                    self._unread_unnamed.append(entry)
        return True

    def _write_undone(self, entry: InFlight) -> None:
        """Undo `_begin_write` of `entry`, whose frame did not go after all (an interrupt came
        first): out of the write order, no answer with id nil is laid over it, and a released
        request is held again (_hold_again) instead of keeping its slot of the cap for ever."""
        with self._lock:
            entry.write_order = None
            if entry in self._unread_unnamed:
                self._unread_unnamed.remove(entry)

    def _end_stream(self) -> None:
        """End the outgoing stream, so that the server sees EOF, with requests refused. Where it
        closes the writer fd (PortClient), it is called with self._write_lock held, so that no
        write starts on the fd's number once freed; shutting a socket's sending side needs no
        lock (and also ends a write in progress)."""
        raise NotImplementedError

    def _refuse_requests(self, reason: str) -> None:
        with self._lock:
            self._refusal = self._refusal or reason
        self._writer_wake.set()  # to fail what it holds, and end

    def _forsaken_in_child(self) -> None:
        """This process is a fork of the client's (_forsake_clients_in_child): its requests are
        refused and its copies of the client's descriptors closed. The locks are new ones: a
        thread of the parent's may have held one at the fork, and none runs here."""
        self._lock = threading.Lock()
        self._write_lock = threading.Lock()
        self._refusal = f"the client belongs to process {self._pid}, of which this one is a fork"
        self._close_copies()

    def _close_copies(self) -> None:
        """Close this process's copies of the client's descriptors, ending nothing of the
        parent's (a close, not a shutdown); by default there is none to close."""

    def _closed_elsewhere(self, timeout: float) -> bool:
        """Whether close() was called on the reader thread (a Future's done callback): it cannot
        wait for itself, so requests are refused now and the close goes on in a thread of its
        own, which waits for the reader once the callback has returned."""
        if threading.current_thread() is not self._thread:
            return False
        self._refuse_requests("the client is closed")
        threading.Thread(target=self.close, args=(timeout,), name="bridge-client-close", daemon=True).start()
        return True

    def request(self, op: str, args: dict | None = None, timeout: float | None = 60.0) -> Reply:
        """Send a request and wait at most `timeout` seconds (None: for ever) for its reply.
        The timeout is its deadline on the server too (a v1 server older than `deadline_us`
        refuses it unrun: the request goes again without one, as the connection's later
        requests do); when it passes the request is cancelled
        (`cancel`: what it created anyway is freed) and TimeoutError raised. It bounds the wait
        for the reply, not the send: a request larger than what the connection buffers waits
        for the server to read it (a server past its per-connection cap reads more only as it
        answers, SPEC §7). Not from a Future's done callback, which runs on the thread that
        reads the replies (RuntimeError: use submit there)."""
        if threading.current_thread() is self._thread:
            raise RuntimeError(f"{op!r}: a blocking call on the client's reader thread (a Future's done "
                               "callback) would wait for a reply that only this thread can read; use submit()")
        sends_deadline = self._sends_deadlines and wire_deadline_us(timeout) is not None
        future = self.submit(op, args, deadline_s=timeout)
        # A wait past what a lock's wait takes (infinity included) is a wait for ever.
        wait_s = None if timeout is None or timeout > threading.TIMEOUT_MAX else timeout
        try:
            reply = future.result(wait_s)
        except FutureTimeout:  # the builtin TimeoutError from Python 3.11 on, a class of its own before
            if self.cancel(future):
                raise TimeoutError(f"no reply to {op!r} within {timeout} s") from None
            reply = future.result()  # its reply came meanwhile
        except BaseException:
            # Interrupted (Ctrl-C, a signal handler's exception): nobody waits for the reply now,
            # so the request is given up as at a timeout and what it creates is freed.
            with contextlib.suppress(Exception):
                self.cancel(future)
            raise
        if not reply.ok and reply.error["code"] == "deadline_exceeded":
            # The deadline is this timeout: the server found it spent before this thread woke.
            raise TimeoutError(f"no reply to {op!r} within {timeout} s (the server found its deadline passed)")
        if sends_deadline and _refuses_deadlines(reply.error):
            # Refused unrun by a server older than deadline_us: sent again without one.
            return self.request(op, args, timeout)
        return reply

    def cancel(self, future: Future) -> bool:
        """Give up on a submitted request: its Future is cancelled (its late reply is dropped,
        and what that reply says it created, a handle, session, snapshot or model, freed: nobody
        else learns its id) and the server asked to drop it if it has not started (SPEC §6 `cancel`; its answer is
        not waited for); one still held here is dropped unsent, nothing asked of the server.
        False when its reply has come already.

        Under the cap `info()` read, the cancel takes the slot kept for cancels; with that slot
        taken (others cancelling at once) it waits for the next reply, goes before held
        requests, and is dropped if its request is answered meanwhile. So with a cap of 1, where
        no slot is left, a cancel of the request on the wire is never sent (the server would
        read it only once that request was answered): only its Future is cancelled, and its
        deadline (`request`'s timeout, `submit`'s deadline_s) still bounds its wait on the
        server. A held request that another thread is sending as it is cancelled is not sent,
        or has its cancel sent after it. A cancel is never written once its request is out of
        flight, so that a request given the same id after that is not the one it drops."""
        if not future.cancel():
            return False
        request_id = future.request_id
        with self._lock:
            if self._answered(future) or self._dropped_unsent(request_id):
                return True  # its reply came meanwhile, or it failed, or it was not sent: nothing to drop
        self._cancel_at_server(future)
        return True

    def _dropped_unsent(self, request_id) -> bool:
        """Whether the request `request_id` (in flight) was held, and is now out of flight, or
        taken out to send, and the thread sending it now drops it or cancels it after it; False
        for one sent. Called with self._lock held."""
        # A `cancel` the caller submitted waits with those of cancel(), apart from requests.
        held = self._held_cancels if request_id in self._held_cancels else self._held
        if held.pop(request_id, None) is not None:
            del self._pending[request_id]
            return True
        if request_id in self._releasing:
            self._releasing[request_id].cancel_asked = True
            return True
        return False

    def _answered(self, future: Future) -> bool:
        """Whether the request of `future` is out of flight: answered, or failed. Called with
        self._lock held."""
        entry = self._pending.get(future.request_id)
        return entry is None or entry.future is not future

    def _cancel_at_server(self, future: Future) -> None:
        """Ask the server to drop the request of `future` (sent already); its answer is not waited for."""
        try:
            self._submit("cancel", {"id": future.request_id}, None, None, cancelling=future)
        except (ServerExited, BridgeError):
            # Nothing left to drop it from: the connection is gone, or the server turned it away
            # (the cancel's write failed and the reader failed it with `overloaded`, _send).
            pass

    def call(self, op: str, timeout: float | None = 60.0, **args) -> dict:
        """The result map; raises BridgeError on an error reply."""
        return self.request(op, args, timeout).unwrap()

    def ping(self) -> dict:
        return self.call("ping")

    def health(self) -> dict:
        """`{"live", "ready", "device", "checks"}`: ready when the device answered a tiny kernel
        launch lately (SPEC §6)."""
        return self.call("health")

    def info(self) -> dict:
        """The server's `info`; adopts its limits: `max_frame_size` (larger requests are refused
        unsent) and, on the unix and ZeroMQ lanes, `max_in_flight_per_peer`: beyond the cap less
        one (at least one) on the wire, requests are held here until replies free a slot, and
        cancels beyond the cap itself (see `max_in_flight` and `cancel`)."""
        info = self.call("info")
        limits = info.get("limits", {})
        self.max_frame_size = limits.get("max_frame_size", self.max_frame_size)
        if self._capped_lane and isinstance(limits.get("max_in_flight_per_peer"), int):
            self.max_in_flight = limits["max_in_flight_per_peer"]
            self._send_released()
        return info

    # Whether the server caps this lane's requests in flight per connection (SPEC §7).
    _capped_lane = False

    def stats(self) -> dict:
        return self.call("stats")

    def scan(self, x, dt, A, B, C, *, timeout: float | None = 60.0, **options) -> Reply:
        """Reply to a scan; `reply.unwrap()["y"]` (and "state" with return_state=True)."""
        return self.request("scan", {"x": x, "dt": dt, "A": A, "B": B, "C": C, **options}, timeout)

    def ssd_scan(self, x, dt, A, B, C, *, timeout: float | None = 60.0, **options) -> Reply:
        """Reply to a Mamba-2 (SSD) scan (x [batch, seq, heads, headdim], dt [batch, seq, heads],
        A [heads], B, C [batch, seq, groups, state]); `reply.unwrap()["y"]` (and "state"
        [batch, heads, headdim, state] with return_state=True; a row per packed sequence with
        cu_seqlens or seq_idx). mamba_ssm's option names (initial_states, dt_limit, seq_idx,
        return_varlen_states, ...) are taken as they are."""
        return self.request("ssd_scan", {"x": x, "dt": dt, "A": A, "B": B, "C": C, **options}, timeout)

    def scan_backward(self, dy, x, dt, A, B, C, *, timeout: float | None = 60.0, **options) -> Reply:
        """Reply to a scan's backward pass: the forward's arguments (as `scan` takes them, no
        session) plus dy, the gradient of y, and optionally dstate, that of the final state;
        `reply.unwrap()` holds "dx", "ddt", "dA", "dB", "dC" and "dD", "dz", "ddt_bias", "dh0"
        for the options given."""
        return self.request("scan_backward", {"dy": dy, "x": x, "dt": dt, "A": A, "B": B, "C": C, **options},
                            timeout)

    def ssd_scan_backward(self, dy, x, dt, A, B, C, *, timeout: float | None = 60.0, **options) -> Reply:
        """Reply to a Mamba-2 (SSD) scan's backward pass, as `scan_backward` for `ssd_scan`."""
        return self.request("ssd_scan_backward", {"dy": dy, "x": x, "dt": dt, "A": A, "B": B, "C": C, **options},
                            timeout)

    # -- sessions and handles (state and constants that stay on the server) ---------------

    def open_session(self, batch: int, dim: int, state: int, h0=None) -> str:
        """A new session with a zero [batch, dim, state] state, or `h0` (what `session_state`
        returned, here or on another server); returns its id. Prefill it with
        `scan(..., session=id)`, then `step` it one timestep at a time."""
        return self.call("session_open", batch=batch, dim=dim, state=state, h0=h0)["session"]

    def open_ssd_session(self, batch: int, heads: int, headdim: int, state: int, h0=None) -> str:
        """A new Mamba-2 session with a zero [batch, heads, headdim, state] state, or `h0`;
        returns its id. Prefill it with `ssd_scan(..., session=id)`, then `step` it."""
        return self.call("session_open", kind="ssd", batch=batch, heads=heads, headdim=headdim,
                         state=state, h0=h0)["session"]

    def open_session_with_frames(self, frames, **dims) -> tuple[str, list[dict]]:
        """A session opened as session_open's `dims` say (batch, dim, state; kind="ssd", heads,
        headdim; model; h0 or a model's saved `state`) with `frames` run on it in the same
        request: (op, args) pairs, op one of step, scan, ssd_scan, model_step, model_forward and
        args that op's own but the session (SPEC §6.1). Returns its id and each frame's result. What a
        client reopening a session from a saved state runs: the frames answered since, in one
        round trip (SPEC §6.1)."""
        result = self.call("session_open", frames=[{"op": op, "args": args} for op, args in frames], **dims)
        return result["session"], result["frames"]

    def restore_with_frames(self, session: str, snapshot: str, frames, timeout: float | None = 60.0) -> list[dict]:
        """Restore `snapshot` into `session` and run `frames` on it in the same request, as
        `open_session_with_frames` runs its own: each frame's result. A rollback and its
        re-simulation in one round trip; a frame that fails leaves the snapshot's state
        (SPEC §6.4)."""
        result = self.call("session_restore", timeout, session=session, snapshot=snapshot,
                           frames=[{"op": op, "args": args} for op, args in frames])
        return result["frames"]

    def step(self, session: str, x, dt, A, B, C, *, timeout: float | None = 60.0, **options) -> Reply:
        """Reply to one timestep of `session` (x, dt, z [batch, dim]; B, C [batch, state]; a
        Mamba-2 session: x, z [batch, heads, headdim], dt [batch, heads], B, C [batch, groups,
        state], A [heads]); `reply.unwrap()["y"]`, and with return_state=True "state", the
        session's state after the step (as `session_state` gives it, without its round trip).
        Tensor arguments may be handles from `put`."""
        return self.request("step", {"session": session, "x": x, "dt": dt, "A": A, "B": B, "C": C,
                                     **options}, timeout)

    def session_state(self, session: str):
        """The session's state [batch, dim, state] ([batch, heads, headdim, state] for Mamba-2; fp32)."""
        return self.call("session_state", session=session)["state"]

    def close_session(self, session: str) -> None:
        self.call("session_close", session=session)

    # -- whole models (SPEC §6.4) -----------------------------------------------------------

    def load_model(self, path: str | None = None, *, config: dict | None = None, weights: dict | None = None,
                   dtype: str | None = None, name: str | None = None, timeout: float | None = 60.0) -> RemoteModel:
        """A model loaded on the server: from a checkpoint directory `path` under the server's
        --model-dir, or from a `config` map and `weights` (name -> array or handle) sent here.
        `dtype`: "f32" (default), "bf16" or "f16" for the weights; state is always fp32. A
        transformers model goes as `config=json.loads(model.config.to_json_string())` and
        `weights=model.state_dict()`: `config.to_dict()` keeps int keys (id2label), which the
        protocol refuses (SPEC §3)."""
        args = {"path": path, "config": config, "weights": weights, "dtype": dtype, "name": name}
        info = self.call("model_load", timeout, **{k: v for k, v in args.items() if v is not None})
        return RemoteModel(self, info)

    def put(self, tensor) -> protocol.HandleRef:
        """Upload `tensor` once; pass the returned handle wherever a tensor argument goes."""
        return protocol.HandleRef(self.call("put", tensor=tensor)["handle"])

    def free(self, handle: protocol.HandleRef | str) -> None:
        self.call("free", handle=handle.handle if isinstance(handle, protocol.HandleRef) else handle)

    def send_raw(self, body: bytes, request_id=None) -> Future | None:
        """Write an arbitrary body as one frame (tests and benchmarks). With `request_id`, the
        reply to it resolves the returned Future, and the frame keeps to the cap as a request
        does (held while the cap is full); without, it is sent at once and not counted against
        the cap, its reply being one the client cannot tell. `request_id` is the id the body
        carries, or any id (a uint or a non-empty str) where the server can read none (an
        undecodable body: its answer has id null, and comes in the order such frames were
        written); a body with another id, or a legacy ExPhil request (answered with none), or a
        request_id that is not an id, is a ValueError. Replies with ids that
        match nothing in flight (e.g. id null to an undecodable body sent without an id) land
        in `self.unmatched`."""
        return self._send_raw(body, (), protocol.frame_parts([body]), request_id)

    def _send_raw(self, body, buffers, parts: list, request_id) -> Future | None:
        """send_raw's work: `parts` carry `body` and its raw `buffers` (ZeroMQ's)."""
        entry = InFlight(Future(), time.perf_counter_ns(), bytes_out=sum(memoryview(p).nbytes for p in parts))
        limit = self.max_frame_size
        # A frame over the limit is never decoded: its answer is matched by length.
        if limit is None or entry.bytes_out - self._frame_overhead <= limit:
            entry.id_unread = self._raw_id_unread(body, buffers, request_id)
        if request_id is None:
            entry.future.request_id = None  # tracked only while an id-nil answer may be its
            self._send(parts, entry if entry.id_unread else None)
            return None
        with self._in_flight(request_id, entry):
            held = self._send_or_hold(request_id, entry, HeldRequest(None, {}, parts, None))
        if held:
            self._send_released()
        return entry.future

    @staticmethod
    def _raw_id_unread(body, buffers, request_id) -> bool:
        """Whether the server reads no id from `body` (decoding it as the server does), so that
        its answer has id nil; a body whose answer carries an id other than `request_id` (when
        given) is a ValueError: that answer would never be the request's."""
        try:
            request = protocol.decode_request(body, buffers)
        except protocol.ProtocolError as exc:
            legacy, carried = exc.legacy, exc.request_id
        except Exception:  # a decoder's own failure: the server answers it internal_error, id nil
            return True
        else:
            legacy, carried = request.codec is protocol.LEGACY, request.reply_id
        if request_id is not None and legacy:
            raise ValueError(f"request_id: expected none for a legacy ExPhil request, whose answer carries "
                             f"no id, got {request_id!r}")
        if request_id is not None and carried is not None and carried != request_id:
            raise ValueError(f"request_id: expected {carried!r}, the id the body carries, got {request_id!r}")
        return carried is None and not legacy

    # -- replies --------------------------------------------------------------------------

    def _start_reader(self) -> threading.Thread:
        target, args = self._reader_target()
        thread = threading.Thread(target=target, args=args, name="bridge-client-reader", daemon=True)
        thread.start()
        return thread

    def _reader_target(self) -> tuple:
        """(function, args) the reader thread runs: a stream's reader holds the client weakly."""
        return read_replies, (self._reader, weakref.ref(self), self._leftovers)

    def _release_when_dropped(self) -> Callable[[], None]:
        """What close() would have closed, for whichever comes last of the stream's end and the
        client's collection without close() to close (Leftovers); it must not hold the client."""
        return lambda: None

    def _deliver(self, body, received_ns: int, nbytes: int, buffers=()) -> None:
        """Resolve the request a reply body answers (`buffers`: the raw buffers of a multipart
        reply, which its tensors refer to)."""
        try:
            decoded = protocol.decode_reply(body, buffers)
        except protocol.ProtocolError:
            # Not a v1 reply (e.g. an ExPhil-format answer to a legacy request): keep the bytes.
            self._keep_unmatched(Reply(None, False, None, None, {}, 0.0, bytes_in=nbytes,
                                       extra={"raw": bytes(body)}))
            return
        result = result_from_wire(decoded.result, as_torch=self.as_torch) if decoded.ok else None
        received = Received(decoded, result, received_ns, time.perf_counter_ns(), nbytes)
        error = decoded.error or {}
        with self._lock:
            # Each reply whose request is now known, with it (None: no request in flight).
            answered: list[tuple[InFlight | None, Received]]
            code, detail = error.get("code"), error.get("detail") or {}
            if _refuses_deadlines(error):
                self._sends_deadlines = False
            if isinstance(decoded.id, (int, str)):
                answered = [(self._pending.pop(decoded.id, None), received)]
                if self._nil_answers:  # that request was none of theirs
                    answered += self._nil_answers_told_apart()
            elif code == "frame_too_large":
                answered = [(self._refused_as_too_large(detail), received)]
            elif code == "overloaded" and self._turns_connections_away:
                # The connection turned away (SPEC §4): no frame's.
                self._turned_away = BridgeError("overloaded", error.get("message", ""), error.get("detail"))
                answered = [(None, received)]
            else:
                # A frame the server had no memory to hold, named by its length, or one whose id
                # it could not read.
                memory = code == "limit_exceeded" and detail.get("limit") == "memory"
                self._nil_answers.append(NilAnswer(received, detail.get("length") if memory else None, self._writes))
                answered = self._nil_answers_told_apart()
        # Settled before the held requests the replies freed slots for are written: a large one
        # waits for the server to read it, and the replies read must not wait with it.
        for entry, answer in answered:
            if entry is None:
                self._keep_unmatched(self._reply(answer, None))
            else:
                settle(entry.future, self._reply(answer, entry))
                if entry.future.cancelled() and answer.decoded.ok and entry.op in FREED_BY:
                    self._free_late(entry.op, answer.result)
        if self._held or self._held_cancels:
            self._send_released()

    def _free_late(self, op: str, result: dict) -> None:
        """Free what a request its caller gave up on (a timeout, cancel()) created anyway: it had
        started, so the cancel could not drop it, and nobody holds the id its reply names. Sent
        from a thread of its own: this reader must not wait for a write."""
        free_op, key = FREED_BY[op]

        def send():
            try:
                self._submit(free_op, {key: result[key]}, None, None)
            except (ServerExited, BridgeError, KeyError):
                pass

        threading.Thread(target=send, name="bridge-client-free-late", daemon=True).start()

    @staticmethod
    def _reply(received: Received, entry: InFlight | None) -> Reply:
        """The Reply to request `entry` (None: to no request in flight)."""
        decoded, done = received.decoded, received.done_ns
        start = entry.start_ns if entry else received.received_ns
        return Reply(decoded.id, decoded.ok, received.result, decoded.error, decoded.timing or {},
                     round_trip_us=(done - start) / 1000.0, client_encode_us=entry.encode_us if entry else 0.0,
                     client_decode_us=(done - received.received_ns) / 1000.0,
                     bytes_out=entry.bytes_out if entry else 0, bytes_in=received.nbytes)

    def _refused_as_too_large(self, detail: dict) -> InFlight | None:
        """The request a `frame_too_large` reply (id nil) refused, taken out of flight: the
        first frame written whose body has the length the reply names (every frame that long
        was refused); None where that was a raw frame sent without an id, or none is that long.
        Called with self._lock held."""
        if isinstance(detail.get("limit"), int):
            self.max_frame_size = detail["limit"]
        length = detail.get("length")
        refused = next((frame for frame in self._written() if frame.bytes_out - self._frame_overhead == length), None)
        return None if refused is None else self._answered_frame(refused)

    def _written(self) -> list[InFlight]:
        """The frames written (or being written) that an answer with id nil may be for, in the
        order written: the requests in flight, and raw frames sent without an id whose ids the
        server cannot read. Called with self._lock held."""
        requests = [entry for entry in self._pending.values() if entry.write_order is not None]
        return sorted(requests + self._unread_unnamed, key=lambda entry: entry.write_order)

    def _answered_frame(self, frame: InFlight) -> InFlight | None:
        """Take `frame` (of `_written`) out of flight: its request, or None for a raw frame sent
        without an id. Called with self._lock held."""
        if frame.future.request_id is None:
            self._unread_unnamed.remove(frame)
            return None
        return self._pending.pop(frame.future.request_id)

    def _nil_answers_told_apart(self) -> list[tuple[InFlight | None, Received]]:
        """The answers with id nil whose frames are now known, each with its request (taken out
        of flight), or None: a raw frame sent without an id, or none in flight can be the one
        (a raw frame sent without an id that the server read an id from is not tracked).

        The server sends each as it reads the frame (SPEC §2, §4), so they come in the order
        the frames were written, and every frame whose id it cannot read has one. An answer
        naming a length is for a frame that long it dropped unread, which a reply by id may yet
        rule out (a request as long may be running); one naming none is for a frame whose id it
        cannot read. Each goes to its frame once every way of laying the answers so far over the
        frames in flight, in order, gives it the same one. Called with self._lock held."""
        told, answers = [], self._nil_answers
        while answers:
            # A frame written after the last answer came is none's, nor lies between two
            # answers' frames: left out, a reply re-lays only frames written before that answer.
            horizon = answers[-1].written
            frames = sorted([frame for frame in self._written() if frame.write_order < horizon]
                            + [answer.frame for answer in answers if answer.frame is not None],
                            key=lambda frame: frame.write_order)
            places = self._nil_answer_places(answers, frames)
            if places[-1]:
                break
            # The first answer that no frame can be given is for one the client does not track.
            unplaced = answers.pop(next(index for index, found in enumerate(places) if not found))
            if unplaced.frame is None:
                told.append((None, unplaced.received))
        if answers:  # each has a place
            for answer, found in zip(answers, places):
                if answer.frame is None and len(found) == 1:
                    answer.frame = frames[min(found)]
                    told.append((self._answered_frame(answer.frame), answer.received))
            while answers and answers[0].frame is not None:
                del answers[0]
        return told

    def _nil_answer_places(self, answers: list[NilAnswer], frames: list[InFlight]) -> list[set[int]]:
        """For each of `answers`, the places in `frames` (in the order written) its frame can
        have in some way of laying them all over the frames in order, skipping no frame surely
        answered with id nil before the last one's; all empty from the first that has none."""
        known = {answer.frame.write_order for answer in answers if answer.frame is not None}
        certain = [frame.id_unread or frame.write_order in known for frame in frames]

        def fits(answer: NilAnswer, frame: InFlight) -> bool:
            if answer.frame is not None or frame.write_order in known:
                return frame is answer.frame
            if frame.write_order >= answer.written:
                return False
            if answer.length is None:
                return frame.id_unread
            return frame.bytes_out - self._frame_overhead == answer.length

        # Given the answers before: after the place of the one before, no certain frame between.
        forward, reachable = [], {-1}
        for answer in answers:
            found, latest, last_certain = set(), (-1 if -1 in reachable else None), -1
            for place, frame in enumerate(frames):
                if latest is not None and latest >= last_certain and fits(answer, frame):
                    found.add(place)
                latest = place if place in reachable else latest
                last_certain = place if certain[place] else last_certain
            forward.append(reachable := found)
        if not forward[-1]:
            return forward
        # Given the answers after too (past the last answer's frame, frames wait for theirs).
        places, reachable = [], None
        for index in reversed(range(len(answers))):
            found, earliest, next_certain = set(), None, len(frames)
            for place in reversed(range(len(frames))):
                if place in forward[index] and (reachable is None or (earliest is not None and earliest <= next_certain)):
                    found.add(place)
                earliest = place if reachable is not None and place in reachable else earliest
                next_certain = place if certain[place] else next_certain
            places.append(reachable := found)
        return places[::-1]

    def _keep_unmatched(self, reply: Reply) -> None:
        self.unmatched.append(reply)
        self.unmatched_count += 1

    def _fail_all(self, exc: BaseException) -> None:
        with self._lock:
            self._refusal = self._refusal or "the server is gone"
            # Emptied, not replaced: the finalizer (abandon) holds this same dict.
            pending = list(self._pending.values())
            self._pending.clear()
            self._held.clear()
            self._held_cancels.clear()
            self._unread_unnamed.clear()
            self._nil_answers.clear()
            if pending and exc is self._turned_away:
                # Those requests are told the turn-away; later ones are a new client's (_refusal_error).
                self._turned_away_told = True
        for entry in pending:
            settle(entry.future, exc)


# SPEC §4: deadline_us is a uint64; a longer budget than it holds is as good as none.
_LONGEST_DEADLINE_US = 2**64 - 1


def _refuses_deadlines(error: dict | None) -> bool:
    """Whether a reply's `error` refuses its request's `deadline_us`: this client sends only
    those SPEC §4 takes, so the server is a v1 one older than it."""
    return bool(error) and error.get("code") == "invalid_request" and \
        (error.get("detail") or {}).get("field") == "deadline_us"


def wire_deadline_us(deadline_s: float | None) -> int | None:
    """A request's budget in seconds as its `deadline_us`: None (and infinity) for none; a
    ValueError for one no request can have (negative, NaN), not a frame the server refuses."""
    if deadline_s is None or deadline_s == math.inf:
        return None
    if not deadline_s >= 0:
        raise ValueError(f"deadline: expected seconds >= 0, infinity or None, got {deadline_s!r}")
    return min(int(deadline_s * 1e6), _LONGEST_DEADLINE_US)


class Leftovers:
    """What a stream client collected without close() leaves to close (its socket, or its
    server's pipe and exit): closed by whichever comes last of the stream's end (the reader
    thread) and the client's collection (its finalizer, abandon). Either may come first: a
    server that went, or a client dropped with its server still up."""

    def __init__(self, release: Callable[[], None]):
        self._release: Callable[[], None] | None = release
        self._lock = threading.Lock()
        self._ended = self._dropped = False

    def stream_ended(self) -> None:
        self._came("_ended")

    def client_dropped(self) -> None:
        self._came("_dropped")

    def _came(self, which: str) -> None:
        with self._lock:
            setattr(self, which, True)
            release = self._release if self._ended and self._dropped else None
            if release is not None:
                self._release = None
        if release is not None:
            release()


def read_replies(reader, client_ref: weakref.ref, leftovers: Leftovers) -> None:
    """A stream client's reader thread: hands each reply frame to the client. It holds the
    client weakly, so that a client dropped without close() is collected (its finalizer ends the
    stream, abandon), and the thread reads what the server still writes to the stream's end;
    then what the client leaves is closed, once it is collected too (`leftovers`)."""
    ended = None
    try:
        while (body := _next_reply_frame(reader)) is not None:
            received = time.perf_counter_ns()
            client = client_ref()
            if client is None:
                continue  # dropped: the server, its stream ended, answers what is in flight and closes
            try:
                client._deliver(body, received, len(body) + protocol.framing.HEADER_SIZE)
            except MemoryError:
                raise
            except Exception as exc:
                # A reply this client failed on (its own bug, most likely): told as such, with
                # its cause, not as the server's end.
                ended = ServerExited(f"a reply could not be handled ({type(exc).__name__}: {exc}); "
                                     "the connection is no longer used")
                ended.__cause__ = exc
                return
            del client  # not held while waiting for the next frame
    except MemoryError as exc:
        # A reply with no memory to hold it is lost, and whose it was cannot be told: every
        # request fails now rather than one waiting for ever.
        ended = ServerExited(f"a reply could not be held ({exc}); the connection is no longer used")
    finally:
        client = client_ref()
        if client is not None:
            client._fail_all(ended or client._turned_away or ServerExited("the server closed its end before replying"))
        del client
        leftovers.stream_ended()


def write_released(wake: threading.Event, client_ref: weakref.ref) -> None:
    """A stream client's writer thread (FramedClient._wake_writer): releases what is held each
    time it is woken, until requests are refused (the client closed, the server gone), when what
    is still held fails so. It holds the client weakly, as the reader does: a client dropped
    without close() is collected, and its finalizer wakes this thread to end."""
    while True:
        wake.wait()
        wake.clear()
        client = client_ref()
        if client is None:
            return
        client._send_released()
        if client._refusal:
            return
        del client  # not held while waiting to be woken


def _next_reply_frame(reader) -> memoryview | None:
    """read_frame, None at any end of the stream."""
    try:
        return read_frame(reader)
    except ConnectionResetError:
        return None  # the server closed with our requests unread (a unix peer it turned away): an end like EOF
    except (OSError, ValueError):
        return None  # the client closed the stream under this read (close() gave up waiting): an end too


def server_env(extra: dict | None = None) -> dict:
    """The environment for `python -m bridge` of this checkout from any working directory:
    the checkout first on PYTHONPATH (and no empty entry, which would put the working
    directory on it), then `extra`."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": root + (os.pathsep + path if path else ""), **(extra or {})}


def stop_piped_server(proc: subprocess.Popen, timeout: float = 10.0) -> int:
    """Close a server's stdin (it answers what is in flight within its drain and exits) and wait
    for its exit status; a server still there after `timeout` seconds is killed, never left behind."""
    if proc.stdin and not proc.stdin.closed:
        proc.stdin.close()
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


def _stop_and_close(proc: subprocess.Popen, reader: threading.Thread | None = None) -> None:
    """stop_piped_server, then the server's stdout closed once `reader`, if any, is done with it
    (a close under its read would not wake it): for a server no client reads any more (a dropped
    PortClient's, once its reader saw the end; one whose client was never made), which is waited
    for, not left a zombie."""
    stop_piped_server(proc)
    if reader is not None:
        reader.join(10.0)
    if proc.stdout is not None:
        proc.stdout.close()


def _close_all(closeables) -> None:
    for closeable in closeables:
        closeable.close()


def spawn(command: list[str], stop: Callable[[subprocess.Popen], object], **popen_args) -> subprocess.Popen:
    """subprocess.Popen(command, **popen_args) with the stop signals held while it runs: a
    handler's exception (Ctrl-C, the bench's SIGTERM) raised after its fork would leave the child
    running unheld, and a server still starting reads the end of its stdin only once started.
    A signal held is delivered once Popen has returned, and `stop(child)` runs before its
    exception goes on."""
    child = None
    try:
        with StopSignalsHeld():
            child = subprocess.Popen(command, **popen_args)
    except BaseException:
        if child is not None:
            stop(child)
        raise
    return child


def abandon(end_stream, pending: dict, writer_wake: threading.Event, pid: int,
            leftovers: Leftovers | None = None) -> None:
    """What a client collected without close() (or still open at exit) leaves: its outgoing
    stream is ended (`end_stream`), so that the server answers what is in flight, frees what the
    connection owned and closes its end (a Port server exits), which ends the reader thread (a
    ZeroMQ client's io loop is told to end instead, and closes its sockets); its writer thread
    is woken to end; the callers still waiting fail (nothing is left to hand them replies); and
    what it leaves is closed once the stream has ended too (`leftovers`). Nothing in a forked
    child (another `pid`): the stream is its parent's."""
    if os.getpid() != pid:
        return
    end_stream()
    writer_wake.set()
    for entry in list(pending.values()):
        settle(entry.future, ServerExited("the client was dropped without close()"))
    if leftovers is not None:
        leftovers.client_dropped()


# The clients this process made, for a child forked from it (register_at_fork below).
_clients: weakref.WeakSet = weakref.WeakSet()


def _forsake_clients_in_child() -> None:
    """In a forked child, the parent's clients are the parent's: the child's copies of their
    descriptors are closed, so that the parent's close still ends its stream (a Port server sees
    EOF only once every copy of its stdin's writing end is closed) and nothing the child does,
    or leaves at its exit, reaches the parent's connection; their calls in the child raise."""
    for client in list(_clients):
        client._forsaken_in_child()
    _clients.clear()


os.register_at_fork(after_in_child=_forsake_clients_in_child)


def shut_sending(sock: socket.socket) -> None:
    """End a socket's outgoing stream (the server sees EOF), whatever state it is in."""
    try:
        sock.shutdown(socket.SHUT_WR)
    except OSError:
        pass  # closed already, or the server is gone


class PortClient(FramedClient):
    """Spawns the server as a BEAM Port would and talks to it over its stdin/stdout."""

    def __init__(self, server_args=(), *, python: str = sys.executable, env: dict | None = None,
                 stderr=None, as_torch: bool = False, start_timeout: float = 120.0, command=None):
        cmd = list(command) if command else [python, "-m", "bridge", *server_args]
        self.proc = spawn(cmd, _stop_and_close, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr,
                          env=server_env(env), bufsize=0)
        try:
            super().__init__(self.proc.stdout, self.proc.stdin.fileno(), as_torch=as_torch)
        except BaseException:  # a signal's SystemExit, say: with no client made, nobody would stop it
            _stop_and_close(self.proc, getattr(self, "_thread", None))
            raise
        weakref.finalize(self, abandon, self.proc.stdin.close, self._pending, self._writer_wake, self._pid,
                         self._leftovers)
        if command is None:
            # Readiness handshake: the first reply proves imports and device setup are done.
            try:
                self.request("ping", timeout=start_timeout).unwrap()
            except ServerExited as exc:
                status = self.close()
                if status is None:
                    raise
                # Its reason went to its stderr: the status at least tells a refused flag (2).
                raise ServerExited(f"the server exited with status {status} during start-up, before "
                                   "answering (its log, on stderr, says why)") from exc
            except BaseException:
                self.close()  # no client reaches the caller to close: the server must not run on
                raise

    def close(self, timeout: float = 10.0) -> int | None:
        """Wait up to `timeout` seconds for the requests in flight to be answered, then close
        stdin (the server answers what is still in flight within its drain, docs/operations.md
        "Shutdown", and exits) and wait up to `timeout` more; its exit status, once the reader
        has handed over the replies it wrote and its stdout is closed. From a Future's done
        callback it returns None at once, closing once the callback has returned (the status is
        then `proc.returncode`): waiting there for the server's exit, the reader would read none
        of the replies the server still writes. In a forked child, None: the server is the
        parent's."""
        if os.getpid() != self._pid:
            return None
        if self._closed_elsewhere(timeout):
            return None
        self._refuse_requests("the client is closed")
        # Answered before stdin closes: past the server's drain, work still running would not be.
        with self._lock:
            in_flight = [entry.future for entry in self._pending.values()]
        wait_settled(in_flight, timeout)
        if not self._write_lock.acquire(timeout=timeout):
            # A write is stuck on a server that reads nothing: killing it ends the write (EPIPE).
            self.proc.kill()
            self._write_lock.acquire()
        try:
            self._end_stream()
        finally:
            self._write_lock.release()
        status = stop_piped_server(self.proc, timeout)
        # Its stdout ends with its exit, unless a process it started holds it. Closed only once
        # the reader is done: a close under its read would not wake it, and frees the fd's number.
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self.proc.stdout.close()
        return status

    def _end_stream(self) -> None:
        self.proc.stdin.close()

    def _release_when_dropped(self) -> Callable[[], None]:
        return functools.partial(_stop_and_close, self.proc)

    def _close_copies(self) -> None:
        self.proc.stdin.close()  # unbuffered (bufsize=0): nothing of the parent's is flushed
        self.proc.stdout.close()


class UnixClient(FramedClient):
    """PortClient's API over a unix socket served by `python -m bridge --unix PATH` (the same
    framing as the Port). Connecting retries for `connect_timeout` seconds while the server is
    still starting."""

    def __init__(self, path: str, *, as_torch: bool = False, connect_timeout: float = 30.0):
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        deadline = time.monotonic() + connect_timeout
        try:
            while True:
                try:
                    self.sock.connect(path)
                    break
                except (FileNotFoundError, ConnectionRefusedError):
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)
        except BaseException:  # no client reaches the caller to close it (a path AF_UNIX refuses, Ctrl-C)
            self.sock.close()
            raise
        super().__init__(self.sock.makefile("rb", buffering=0), self.sock.fileno(), as_torch=as_torch)
        weakref.finalize(self, abandon, functools.partial(shut_sending, self.sock), self._pending, self._writer_wake,
                         self._pid, self._leftovers)

    _capped_lane = True

    def close(self, timeout: float = 10.0) -> None:
        """Stop sending; the server answers what is in flight and closes its end; then close.
        From a Future's done callback it returns at once, closing once the callback has returned;
        in a forked child at once (the connection is the parent's)."""
        if os.getpid() != self._pid or self._closed_elsewhere(timeout):
            return
        self._refuse_requests("the client is closed")
        # Also ends a write in progress (EPIPE), which the lock below waits for.
        self._end_stream()
        self._thread.join(timeout)
        if self._thread.is_alive():
            # The server has not closed its end: what is in flight fails now, and the reader,
            # blocked in recv (which closing the descriptor would not wake), sees its end.
            self._fail_all(ServerExited(f"the client was closed with requests unanswered after {timeout:g} s"))
            with contextlib.suppress(OSError):
                self.sock.shutdown(socket.SHUT_RDWR)
            self._thread.join(timeout)
        with self._write_lock:
            self._reader.close()
            self.sock.close()

    def _end_stream(self) -> None:
        shut_sending(self.sock)

    def _release_when_dropped(self) -> Callable[[], None]:
        return functools.partial(_close_all, (self._reader, self.sock))

    def _close_copies(self) -> None:
        self._reader.close()  # the socket's descriptor closes with the last of the two
        self.sock.close()


class ZmqClient(FramedClient):
    """PortClient's API over ZeroMQ: a DEALER socket connected to a server started with
    `--zmq ENDPOINT`. With `multipart` (the default) tensors travel as raw buffers after the
    body (SPEC §5), from and into the arrays' own memory: do not modify an array passed to
    `submit` before its reply has come; arrays in replies are read-only views of the received
    message. `curve_server_key` (z85) secures a tcp endpoint served with CURVE; the client's
    own key pair is `curve_keypair`, or a fresh one.

    ZeroMQ sockets are not thread-safe: one io thread owns the socket, sends what `submit`
    posts from any thread, and resolves replies; so the client is thread-safe.

    ZeroMQ connects again behind the socket when the connection ends (the server died or
    restarted, a tcp connection broke): the requests that went out on it fail with
    ServerExited, as no reply to them can come (the server drops what a gone peer asked for,
    its sessions and handles with it), and the client goes on, those held back by the cap and
    new ones going out on the next connection: the end of a connection never ends the client;
    close() does, and so does dropping the last reference to it. A message past the
    server's max_frame_size is such an end too (ZeroMQ drops the connection, SPEC §2), with no
    reply to learn the limit from: call info() first, and larger requests are refused here."""

    def __init__(self, endpoint: str, *, multipart: bool = True, as_torch: bool = False,
                 curve_server_key: bytes | None = None, curve_keypair: tuple[bytes, bytes] | None = None):
        import zmq

        from bridge.outbox import Outbox

        self.endpoint = endpoint
        self.multipart = multipart
        self._context = zmq.Context(io_threads=1)
        try:
            self._socket = self._context.socket(zmq.DEALER)
            self._socket.setsockopt(zmq.LINGER, 0)
            # The server bounds what it accepts; the client never blocks (or drops) its own sends.
            self._socket.setsockopt(zmq.SNDHWM, 0)
            self._socket.setsockopt(zmq.RCVHWM, 0)
            # Messages queue only on a connection made, and are dropped with it when it ends, so
            # that none of those failed with it reaches the next server (_connection_ended).
            self._socket.setsockopt(zmq.IMMEDIATE, 1)
            # An IPv6 literal only: a name resolving to ::1 first would not reach an IPv4 server.
            self._socket.setsockopt(zmq.IPV6, endpoint.startswith("tcp://["))
            self._monitor = self._socket.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECTED)
            if curve_server_key is not None:
                public, secret = curve_keypair or zmq.curve_keypair()
                self._socket.curve_serverkey = curve_server_key
                self._socket.curve_publickey = public
                self._socket.curve_secretkey = secret
            self._socket.connect(endpoint)
        except BaseException:
            # A bad endpoint or key: what was made is closed now, not whenever the half-built
            # client is collected (its traceback holds it).
            self._context.destroy(linger=0)
            raise
        self._connections_ended = 0  # the io thread's count
        # Between a connection's end and the next connection's start (the io thread's): no send.
        self._reconnecting = False
        self._outbox = Outbox()
        # FramedClient's streams stay unused: the reader thread it starts runs zmq_io_loop, the
        # socket's io loop.
        super().__init__(None, -1, as_torch=as_torch)
        # Dropped without close(): the post ends the io loop, which closes what it owns.
        weakref.finalize(self, abandon, functools.partial(self._outbox.post, None), self._pending, self._writer_wake,
                         self._pid)

    # A ZeroMQ message has no length prefix: its body and buffers count against the limit.
    _frame_overhead = 0
    _capped_lane = True
    # Its sends are posted to the io thread, which is the reader: none waits.
    _writes_wait_for_the_server = False
    # Its `overloaded` with id nil answers a message past the peer's --zmq-hwm whose id the
    # server could not read: it turns no connection away.
    _turns_connections_away = False

    def _encode(self, request_id, op: str, wire_args: dict, deadline_us: int | None = None) -> list:
        """The message's frames: the body, then (multipart) the tensors' raw buffers."""
        buffers = [] if self.multipart else None
        parts = protocol.encode_request(request_id, op, wire_args, buffers=buffers, deadline_us=deadline_us)
        return [parts[0] if len(parts) == 1 else b"".join(parts), *(buffers or ())]

    def _send(self, frames: list, entry: InFlight | None = None) -> bool:
        # The io thread takes what was posted under this lock too: it sends in the order posted,
        # and a post an interrupt (Ctrl-C) cut short can tell whether its message went in.
        message = (frames, entry)
        with self._write_lock:
            # Refused as a stream's is: once closed, nothing takes the outbox's messages.
            if self._refusal:
                raise self._refusal_error(entry)
            try:
                if not self._begin_write(entry):
                    return False
                self._outbox.post(message)
            except BaseException:
                if entry is not None and entry.write_order is not None and not self._outbox.holds_last(message):
                    self._write_undone(entry)
                raise
        return True

    def send_raw(self, body: bytes, request_id=None, buffers=()) -> Future | None:
        """Send an arbitrary body (and raw buffers) as one message (tests and benchmarks);
        replies as in FramedClient.send_raw."""
        return self._send_raw(body, buffers, [body, *buffers], request_id)

    def _reader_target(self) -> tuple:
        return zmq_io_loop, (self._context, self._socket, self._monitor, self._outbox, self._write_lock,
                             weakref.ref(self))

    def _take_connection_events(self) -> None:
        import zmq
        from zmq.utils.monitor import recv_monitor_message

        while True:
            try:
                event = recv_monitor_message(self._monitor, zmq.NOBLOCK)["event"]
            except zmq.Again:
                return
            if event == zmq.EVENT_DISCONNECTED:
                self._reconnecting = True
                self._connection_ended()
            elif self._reconnecting:  # EVENT_CONNECTED: the next connection
                # libzmq reports an end before it tells the socket to drop the ended connection's
                # queue, and a send may skip reading what it was told: a message sent on the end's
                # report alone could go into that queue and be lost. The drop was told before the
                # next connection began, so once the socket has read what it was told (EVENTS
                # makes it read all), a send goes on the next connection.
                self._socket.getsockopt(zmq.EVENTS)
                self._reconnecting = False

    def _connection_ended(self) -> None:
        """The connection ended: the requests whose messages went out on it fail (their replies
        can no longer come: they would go to the gone connection), and what is held goes out on
        the next (on the io thread: a post to the outbox, sent once connected)."""
        ended = self._connections_ended
        self._connections_ended += 1
        with self._lock:
            lost = [(request_id, entry) for request_id, entry in self._pending.items() if entry.sent_on == ended]
            for request_id, _ in lost:
                del self._pending[request_id]
            self._unread_unnamed[:] = [entry for entry in self._unread_unnamed if entry.sent_on != ended]
            # Answers with id nil still to be matched came on it, and their frames went on it.
            self._nil_answers.clear()
        for _, entry in lost:
            settle(entry.future, ServerExited("the connection to the server ended before its reply "
                                              "(ZeroMQ connects again; the server dropped what it held for it)"))
        self._send_released()

    def _receive_all(self) -> None:
        import zmq

        while True:
            try:
                frames = self._socket.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            received = time.perf_counter_ns()
            self._deliver(frames[0].buffer, received, sum(len(f) for f in frames),
                          [f.buffer for f in frames[1:]])

    def close(self, timeout: float = 10.0) -> None:
        """Stop the io thread (requests still in flight fail with ServerExited) and close.
        From a Future's done callback it returns at once, closing once the callback has returned;
        in a forked child at once (the sockets are the parent's, and no io thread runs there)."""
        if os.getpid() != self._pid or self._closed_elsewhere(timeout):
            return
        self._refuse_requests("the client is closed")
        self._outbox.post(None)
        self._thread.join(timeout)
        if self._thread.is_alive():
            # Closing a socket its thread still uses aborts the process: leave both behind.
            raise RuntimeError(f"the ZeroMQ client's io thread did not stop within {timeout} s")


def zmq_io_loop(context, sock, monitor, outbox, write_lock, client_ref: weakref.ref) -> None:
    """A ZmqClient's io thread: it owns the socket, sends what the client posts, hands replies
    and connection ends to the client, and closes the sockets, the context and the outbox when
    it ends. It holds the client only between polls, so that a client dropped without close()
    is collected: its finalizer's post (abandon) wakes the loop, which finds it gone."""
    import zmq

    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    poller.register(outbox.fd, zmq.POLLIN)
    poller.register(monitor, zmq.POLLIN)
    # Messages the socket would not take yet: a DEALER with no connected peer (the server
    # not up yet, or refusing this client's CURVE handshake) blocks a send, and a blocked
    # io thread could neither receive nor stop for close().
    unsent: collections.deque = collections.deque()
    watching_out = False  # polling for room to send: only while something waits for it
    try:
        while True:
            ready = dict(poller.poll())
            client = client_ref()
            if client is None:
                return
            if outbox.fd in ready:
                with write_lock:  # see ZmqClient._send
                    posted = outbox.take()
                for message in posted:
                    if message is None:  # close(), or the client's finalizer
                        return
                    unsent.append(message)
            if ready.get(sock, 0) & zmq.POLLIN:
                client._receive_all()
            # Every end reported is taken before a send: a message that goes now goes on a
            # connection whose end, if any, is still to be reported.
            client._take_connection_events()
            while unsent and not client._reconnecting:
                frames, entry = unsent[0]
                try:
                    sock.send_multipart(frames, zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                if entry is not None:
                    entry.sent_on = client._connections_ended
                unsent.popleft()
            # Not while reconnecting: the ended connection's queue may still take messages.
            if (bool(unsent) and not client._reconnecting) != watching_out:
                watching_out = not watching_out
                poller.register(sock, zmq.POLLIN | (zmq.POLLOUT if watching_out else 0))
            del client  # not held while polling
    finally:
        client = client_ref()
        if client is not None:
            client._fail_all(ServerExited("the client was closed with requests outstanding"))
        del client
        sock.disable_monitor()
        monitor.close()
        sock.close()
        context.term()
        outbox.close()
