"""The serving pipeline: frame → decode → admit → execute → op → encode → reply.

Transports hand every frame they read to `Dispatcher.on_frame`, from their reader threads. The
dispatcher is the one place that decides how a request is served:

  * fast path: the one op that offers one (the step op's native C++ path, bridge.native) looks
    at the frame first; a request it takes that finds nothing in flight but such requests (and
    general-path ones whose replies are being written) is served on this thread from frame to
    reply. Anything else goes on untouched.
  * decode: the body becomes a request that carries its reply codec (protocol.codecs: v1, or
    ExPhil's legacy form), so every later step answers it the same way.
  * admission: one count of requests in flight, under one lock, with the `--max-pending` cap
    (`overloaded`) and shutdown (`shutting_down`); drain() waits until it is 0. An op marked
    `immediate` (cancel; health while its device check needs no launch) is served at once on
    the reader thread, never refused for the cap.
  * execution: an idle server (nothing in flight, and nothing more waiting on the transport,
    or, on a thread that reads one connection, a request the batcher never gathers) serves the
    request at once on the reader thread, unless its op is `worker_only` (one that may run for
    seconds: the reader would read nothing else meanwhile); otherwise it queues for the worker,
    which serves queued requests in arrival order, gathering batchable ones (bridge.batcher)
    that can share a kernel launch.
  * background: an op whose handler returns `Background` (model_load: a checkpoint's read can
    take seconds; shutdown, so that it comes after the loads before it) finishes on the loader
    thread, one at a time, outside the serving lock, while the worker serves the other
    connections; its own connection's later requests wait for its reply, so each connection's
    requests still run in the order they came.
  * the op's handler (bridge.ops) runs; its result is encoded by the request's codec and sent.
    A request whose `deadline_us` ran out before it started is answered `deadline_exceeded`
    instead, and one whose connection's peer is known gone by then `cancelled` (its reply could
    reach nobody; a `shutdown` still runs: it acts for the server); a queued one a cancel
    dropped was answered `cancelled` and is passed over.

One lock (`_serving`) lets one thread at a time run ops, so ops never run concurrently (but a
background request's rest, which touches only what the server's tables lock), and a request
never overtakes one admitted before it (but another connection's background request): a
fast-path request is served only when every request that went the general way has been
answered or is having its reply written. Every failure becomes a structured error reply;
nothing a client sends can stop the serving threads. Why steps take the fast path under load too, and
why a lone request skips the worker: docs/performance.md (native step path; inline when idle).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable

import torch

import protocol

from .batcher import Batch, BatchedOp, BatchPolicy, prepare, run_batch
from .errors import OpError, error_fields, reply_too_large
from .native import NativeStepError
from .logs import ThrottledWarning
from .timing import Timing, now_ns

# Which threads have started their OpenMP team (Dispatcher._prepare_thread).
_thread_state = threading.local()
# Elements of the op that starts a team: above ATen's parallel grain size (32768), so it runs as
# a parallel region.
PARALLEL_OP_ELEMENTS = 1 << 17

log = logging.getLogger("bridge")


def start_openmp_team() -> None:
    """Run one parallel torch op on the calling thread, so that its OpenMP team is born now
    (Dispatcher._prepare_thread)."""
    if torch.get_num_threads() > 1:
        torch.ones(PARALLEL_OP_ELEMENTS).mul_(2)  # above ATen's grain: runs as a parallel region


@dataclass(eq=False)
class Call:
    """One request in flight."""

    conn: object
    request: object  # protocol.Request | protocol.LegacyRequest: it carries its reply codec
    timing: Timing
    handler: Callable  # the op's handler, registered for the request's codec
    release: Callable | None = None  # returns the frame buffer to its pool
    enqueued_ns: int = 0
    # Takes back what the op did when its result cannot be sent (too long to frame): the client
    # gets an error, and an error must leave what a refused request would.
    if_unsent: Callable | None = None
    prepared: object = None  # the batcher's Item, once prepared
    dropped: bool = False  # a cancel or the drain took it from the queue and answered it (bridge.queued)
    replying: bool = False  # its reply is being written: the fast path may take steps behind it
    immediate: bool = False  # served as it arrived, beside the ops in flight (Dispatcher.on_frame)
    nbytes: int = 0  # its frame's bytes (and raw buffers'), counted in flight until it is answered

    @property
    def op(self) -> str:
        return self.request.op

    @property
    def args(self) -> dict:
        return self.request.args

    @property
    def codec(self):
        return self.request.codec

    @property
    def batched_op(self) -> BatchedOp | None:
        """The handler when the dispatcher batches it (legacy ops have no batched handler)."""
        return self.handler if isinstance(self.handler, BatchedOp) else None

    @property
    def stats_op(self) -> str:
        """The op's name in the stats, where a legacy request's ops are counted apart."""
        return self.request.stats_op


_STOP = object()
# Put on the queue by drain(): a batch waiting for company stops waiting, as none can come.
_WAKE = object()


@dataclass(frozen=True)
class HandedOver:
    """A request the fast path admitted, then declined: the general way serves it without
    admitting it again. `idle`: whether the server was idle when it was admitted."""

    idle: bool


@dataclass(frozen=True)
class Background:
    """A handler's result when the rest of its request may run apart from the other ops: `finish()`
    returns the result to answer with, or raises the error to. It runs on the dispatcher's
    loader thread, outside the serving lock, so it may touch only state its own locks guard (the
    server's tables). Off the worker (an op a reader serves), it runs there and then."""

    finish: Callable[[], dict]


@dataclass(frozen=True, eq=False)
class _Resume:
    """Queued by the loader thread once a background request is answered: the worker then serves
    the requests its connection (`conn_id`: a ZeroMQ peer's requests each come with a reply
    target of their own, the peer's id on every one) sent after it."""

    conn_id: str


def deadline_error(request, received_ns: int) -> OpError | None:
    """`deadline_exceeded` when the request's budget (deadline_us, from when its frame was
    complete) has run out; None while it has not, or when it has none (SPEC §4)."""
    budget_us = request.deadline_us
    if budget_us is None:
        return None
    waited_us = (now_ns() - received_ns) // 1000
    if waited_us <= budget_us:
        return None
    return OpError("deadline_exceeded",
                   f"deadline_us: expected the request to start within {budget_us} µs, it waited {waited_us} µs",
                   {"deadline_us": budget_us, "waited_us": waited_us})


def gone_peer_error(request_id) -> OpError:
    """What a request is answered with, unrun, once its connection's peer is known gone: no
    reply could reach it (counted as a cancel's drop is)."""
    return OpError("cancelled", f"request {protocol.shown_value(request_id)} was dropped before it ran: its "
                   "connection went away")


def refusal_to_start(call: Call) -> OpError | None:
    """The error a request about to start is answered with instead of running: `cancelled` once
    its connection's peer is known gone (gone_peer_error) unless its op acts for the server
    (`runs_for_a_gone_peer`: shutdown), `deadline_exceeded` once its budget ran out; None: it
    runs. The fast path checks the same, in the same order (Dispatcher._serve_fast)."""
    if call.conn.peer_gone and not getattr(call.handler, "runs_for_a_gone_peer", False):
        return gone_peer_error(call.request.reply_id)
    return deadline_error(call.request, call.timing.received_ns)


class Dispatcher:
    def __init__(self, server):
        self.server = server
        self.registry = server.registry  # its handlers serve every op the decoders let through
        self.fast_path = server.fast_path
        self.max_pending = server.config.max_pending
        self.max_pending_bytes = server.config.max_pending_bytes
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        # Requests in flight (admitted, not yet answered), and of those the general path's
        # whose reply is not yet being written (Dispatcher._replying).
        self._pending = 0
        self._pending_bytes = 0  # their frames' bytes, which they hold until answered
        self._unanswered_general = 0
        # Of those in flight, the ones whose reply is being written (and their bytes): the caps
        # do not count them, or a client sending its next request as a reply reaches it would
        # find the one answered still counted, and be refused past a cap it never reached.
        self._leaving = 0
        self._leaving_bytes = 0
        self._pending_lock = threading.Lock()
        self._idle = threading.Condition(self._pending_lock)
        self._reply_failures = ThrottledWarning(log)
        self._worker = threading.Thread(target=self._work, name="bridge-worker", daemon=True)
        # Held while ops run: by the worker, or by a reader thread serving an idle server's request.
        self._serving = threading.Lock()
        self.accepting = True
        self._stopped = False  # set by stop() once the worker has ended: no op starts after it
        # Held while a thread's first frame starts its OpenMP team (a torch op, beside the ops).
        self._preparing = threading.Lock()
        self.policy = BatchPolicy(server.config.max_delay_us, server.config.max_batch)
        # A request taken from the queue while gathering a batch that it could not join: the
        # worker serves it next (worker thread only).
        self._held: Call | None = None
        # Background requests (Background) and the thread that finishes them, one at a time.
        self._background: queue.SimpleQueue = queue.SimpleQueue()
        self._loader = threading.Thread(target=self._load, name="bridge-loader", daemon=True)
        # Connections (by id) with a background request unanswered, each with the requests it
        # sent after it, held back in arrival order (worker thread only).
        self._waiting_for_background: dict[str, list[Call]] = {}

    # -- transport side -------------------------------------------------------------------

    def start(self) -> None:
        self._worker.start()
        self._loader.start()

    def _prepare_thread(self) -> None:
        """Start the calling thread's OpenMP team, once per thread, before it serves anything.
        OpenMP gives each thread that runs a parallel torch op a team of its own, born at its
        first such op; which thread serves a request (a reader when idle, the worker when busy)
        depends on timing, so teams born on first use made a long-lived server's thread count
        grow after warm-up. Prepared here, every thread that can serve has its team from its
        first frame (bench.soak checks the count stays flat). None starts once the dispatcher
        has stopped: it serves nothing then, and stop() waits for one in progress."""
        if getattr(_thread_state, "prepared", False):
            return
        _thread_state.prepared = True
        with self._preparing:
            if not self._stopped:
                start_openmp_team()

    def on_frame(self, conn, body, received_ns: int, release: Callable | None = None,
                 buffers=(), *, more_input: bool | Callable[[], bool] = True) -> None:
        """Serve the request in `body` (and the raw `buffers` after it, ZeroMQ's); `release`
        gives its frame buffer back once it is answered. `more_input`: whether more input may
        already be waiting for the thread that read this frame, or a function that tells it,
        asked only where the answer matters; only a transport that can tell that none is
        (stdio, unix) lets it be False, and so an idle server serve the request on this thread."""
        self._prepare_thread()
        nbytes = len(body) + (sum(memoryview(b).nbytes for b in buffers) if buffers else 0)
        self.server.stats.frame_in(nbytes, conn.lane)
        handed_over = None  # a request the fast path admitted, then declined: counted in flight already
        if self.fast_path is not None and not buffers:
            taken = self._serve_fast(conn, body, received_ns)
            if taken is True:
                if release:
                    release()
                return
            if isinstance(taken, HandedOver):
                handed_over = taken
        timing = Timing(received_ns)
        try:
            request = protocol.decode_request(body, buffers)
        except Exception as exc:
            # Every frame read is answered once, a bug in the decoder's too (as internal_error,
            # id nil): the transport counts it in flight until then.
            stats_op = None
            if isinstance(exc, protocol.ProtocolError):
                codec, request_id = exc.codec, exc.request_id
                stats_op = exc.stats_op
            else:
                log.exception("decoding a request failed")
                codec, request_id = protocol.V1, None
            self._reply_error(conn, codec, request_id, exc, stats_op=stats_op)
            if handed_over is not None:
                self._replying_uncalled()
                self._leave(nbytes)
            if release:
                release()
            return
        timing.add("decode", now_ns() - received_ns)
        handler = self.registry.handler(request)
        immediate = getattr(handler, "immediate", False)
        if callable(immediate):  # a predicate of the server: immediate as things stand now
            immediate = immediate(self.server)
        # Not admitted again: between the two, a drain could find nothing in flight and report
        # all answered, then refuse the request shutting_down.
        admitted = handed_over.idle if handed_over is not None else self._admit(
            nbytes, immediate=immediate, past_caps=getattr(handler, "past_caps", False))
        if isinstance(admitted, OpError):
            self._reply_error(conn, request.codec, request.reply_id, admitted, stats_op=request.stats_op)
            if release:
                release()
            return
        call = Call(conn, request, timing, handler, release, enqueued_ns=now_ns(), immediate=immediate,
                    nbytes=nbytes)
        if immediate:  # runs beside the ops in flight, not under the serving lock
            self._serve(call)
            return
        # An idle server serves the request on this thread, unless it is to be batched with
        # others (see _serve_on); nothing it could be queued behind exists, so order is kept.
        # On a thread that reads one connection (a function tells of its input), a request the
        # batcher never gathers is served so even when more input waits: queued, it would send
        # the native steps read behind it the general way until it is answered. A thread that
        # reads for many (True: ZeroMQ's, a unix reader with others waiting) is not held up so.
        # A `worker_only` op (one that may run for seconds) never is: the thread that reads its
        # lane would read nothing else, health and cancels included, until it ends.
        if getattr(handler, "worker_only", False):
            inline = False
        elif callable(more_input):
            inline = call.batched_op is None or not more_input()
        else:
            inline = not more_input
        if not (admitted and inline and self._serve_on(call, reader=True)):
            self.server.queued.add(call, self._fail)
            # Listed before this check, it is answered once stopped: by stop() if it stopped
            # after, else here (unless stop() took it first). No worker is left to serve it.
            if not self._stopped:
                self._queue.put(call)
            elif self.server.queued.take(call):
                self._fail(call, self._stopped_error())

    def _admit(self, nbytes: int, fast: bool = False, immediate: bool = False,
               past_caps: bool = False) -> bool | OpError | None:
        """Count a request of `nbytes` in flight. Returns whether the server was idle (nothing in
        flight); the refusal to answer instead (past --max-pending, or --max-pending-bytes unless
        it is the only one, or once drain() began; an
        `immediate` request is never refused: a cancel adds no work, and it may drop queued work
        the drain would otherwise wait for; one `past_caps` is not refused for the caps: a health
        check refused `overloaded` by a server busy with long requests would have it killed);
        for the fast path, None where it must not take the request (then the general way
        decides).

        Checked where the request is counted, under the lock drain() waits under: checked
        before, drain could find nothing in flight between the two and report all answered
        (the server then exits) with this request admitted after it."""
        with self._pending_lock:
            # stop_requested: set by the shutdown op as it runs, before the main loop's drain
            if not immediate and (not self.accepting or self.server.stop_requested.is_set()):
                refusal = OpError("shutting_down", "the server is shutting down and takes no new requests")
            elif self._pending - self._leaving >= self.max_pending and not (immediate or past_caps):
                refusal = OpError("overloaded", f"more than {self.max_pending} requests in flight",
                                  {"limit": self.max_pending})
            elif (self._pending > self._leaving and self._pending_bytes - self._leaving_bytes + nbytes >
                  self.max_pending_bytes and not (immediate or past_caps)):
                refusal = OpError("overloaded", f"more than {self.max_pending_bytes} bytes of requests in flight",
                                  {"limit": self.max_pending_bytes})
            elif fast and self._unanswered_general:
                return None  # a general-path request in flight must not be overtaken
            else:
                idle = self._pending == 0
                self._pending += 1
                self._pending_bytes += nbytes
                self._unanswered_general += not fast
                return idle
        return None if fast else refusal

    def _serve_fast(self, conn, body, received_ns: int) -> bool:
        """Serve the request in `body` through the op fast path on this thread, if that path
        takes it and no general-path request in flight is still to be answered (_replying);
        its own requests may be (other lanes' readers, each serving one, which only wait for
        the serving lock: docs/performance.md, "unix callers native"). True: answered. False: not
        taken (nothing was touched, nothing counted), it goes the general way, which also answers
        every error. HandedOver: declined once admitted (nothing touched): it goes the general
        way still counted in flight, now as a general-path request."""
        try:
            request = self.fast_path.parse(body)
        except Exception:
            log.exception("fast path failed parsing a request")
            return False
        idle = None if request is None else self._admit(len(body), fast=True)
        if idle is None:
            return False
        answered = leaving = False
        try:
            waiting_since = now_ns()
            with self._serving:
                # As refusal_to_start: the fast path's ops (steps) do nothing for a peer gone.
                refusal = (self._stopped_error() or
                           (gone_peer_error(request.id) if conn.peer_gone else deadline_error(request, received_ns)))
                if refusal is not None:
                    self._reply_error(conn, protocol.V1, request.id, refusal, stats_op=request.op)
                    answered = True
                    return True
                try:
                    outcome = self.fast_path.serve(conn, request, received_ns, now_ns() - waiting_since)
                except NativeStepError as exc:  # its kernel ran, or may have: never served twice
                    log.error("fast path failed", exc_info=exc.__cause__)
                    self._reply_error(conn, protocol.V1, exc.request_id, exc, stats_op=request.op)
                    answered = True
                    return True
                except Exception:  # before its kernel: nothing touched, the general path answers
                    log.exception("fast path failed before taking a request")
                    outcome = None
            if outcome is None:
                with self._pending_lock:
                    self._unanswered_general += 1
                return HandedOver(idle)
            answered = True
            self.server.probe.note_launch()
            reply, timing = outcome
            self._begin_leaving(len(body))
            leaving = True
            try:
                self._send(conn, [reply])
            except protocol.FrameTooLarge as exc:  # nothing was written: the error is the answer
                self._reply_error(conn, protocol.V1, request.id, reply_too_large(exc), stats_op=request.op)
                return True
            self.server.stats.record(request.op, timing, ok=True)
            return True
        finally:
            if answered:
                self._leave(len(body), leaving)

    def on_frame_error(self, conn, exc: protocol.FrameDropped) -> None:
        """A frame drained unread by the transport (oversized, or no memory to hold it): read,
        as the stats count it (its announced bytes), and answered."""
        self.server.stats.frame_in(exc.length, conn.lane)
        self._reply_error(conn, protocol.V1, None, exc)

    # -- shutdown -------------------------------------------------------------------------

    def drain(self, timeout: float) -> bool:
        """Stop taking requests and wait until those in flight are answered; those that have not
        started by then are answered `shutting_down` (work still running is not answered)."""
        with self._idle:
            self.accepting = False
            # Stopping however the stop came (a signal, stdin's end, the shutdown op): health
            # reads this. Set under the lock, so that a request's admission sees both or neither.
            self.server.stop_requested.set()
            self._queue.put(_WAKE)
            if self._idle.wait_for(lambda: self._pending == 0, timeout):
                return True
        self.server.queued.drop_all(OpError("shutting_down", "the server is shutting down: the request was still "
                                            "waiting to run when the time for requests in flight ran out"))
        return False

    def stop(self, timeout: float) -> bool:
        """Stop the worker once it has served what was queued before this (what a connection
        sent behind a background request once that is answered), wait up to `timeout` seconds
        for it to end, then for the loader thread, for an op a reader thread is serving (an idle
        server's, the fast path's) and for a thread's first-frame preparation (_prepare_thread)
        to end; returns
        whether all have. What is still queued once the worker has ended, and every request
        after that but an `immediate` one, is answered `shutting_down`, unrun. Waited for: an
        embedding that lets the interpreter finalize with a daemon thread (the worker, a lane's
        reader) inside an op has it ended as it takes the GIL back, which inside a C++ op's
        released-GIL scope (torch's) is std::terminate. Bounded: an op that never ends (a wedged
        device) must not hold the caller for good. `python -m bridge` never stops it: it
        drains, then leaves by os._exit."""
        deadline = time.monotonic() + timeout
        self._queue.put(_STOP)
        if self._worker.is_alive():
            self._worker.join(timeout)
        if self._worker.is_alive():
            return False
        # The worker's gone: none starts after this (each op checks it under the serving lock),
        # and what it left queued is answered now, even if the waits below run out of time.
        self._stopped = True
        self.server.queued.drop_all(self._stopped_error())
        # The worker waited for every background request it started (_work): the loader is idle.
        self._background.put(_STOP)
        if self._loader.is_alive():
            self._loader.join(max(0.0, deadline - time.monotonic()))
        if self._loader.is_alive():
            return False
        # Every op a reader thread serves runs under the serving lock: held, none runs.
        if not self._serving.acquire(timeout=max(0.0, deadline - time.monotonic())):
            return False
        self._serving.release()
        if not self._preparing.acquire(timeout=max(0.0, deadline - time.monotonic())):
            return False
        self._preparing.release()
        return True

    def _stopped_error(self) -> OpError | None:
        """`shutting_down` for a request about to run once stop() has found the worker ended
        (checked under the serving lock); None before."""
        if not self._stopped:
            return None
        return OpError("shutting_down", "the server has stopped: the request was not run")

    def queue_length(self) -> int:
        """Requests queued that the worker has not taken yet (approximate, as Queue.qsize)."""
        return self._queue.qsize()

    # -- worker side ----------------------------------------------------------------------
    # Every request taken from the queue ends in exactly one of _answer or _fail.

    def _work(self) -> None:
        self._prepare_thread()
        stopping = False
        while True:
            call = self._next_call()
            if call is _STOP:
                stopping = True
            elif isinstance(call, _Resume):
                self._resume(call.conn_id)
            elif call is not _WAKE and not stopping and not self._held_back(call):
                self._serve_on(call, reader=False)
            # Stopped, the worker still serves what was queued before the stop behind a
            # background request, once it is answered; what came after is left to stop().
            if stopping and not self._waiting_for_background:
                return

    def _held_back(self, call: Call) -> bool:
        """Hold `call` back if a background request of its connection is unanswered."""
        waiting = self._waiting_for_background.get(call.conn.id)
        if waiting is None:
            return False
        waiting.append(call)
        return True

    def _resume(self, conn_id: str) -> None:
        """Serve the requests a connection sent after its background one, in their order, each
        alone (a batch gathered for one could take a later request of the connection ahead of
        one held here)."""
        held = self._waiting_for_background.pop(conn_id, [])
        for i, call in enumerate(held):
            if conn_id in self._waiting_for_background:  # one of them was a background request too
                self._waiting_for_background[conn_id].extend(held[i:])
                return
            self._serve_on(call, reader=False, alone=True)

    def _load(self) -> None:
        """The loader thread: finishes background requests, one at a time, and answers them."""
        while True:
            work = self._background.get()
            if work is _STOP:
                return
            call, background = work
            self._prepare_thread()
            try:
                # Not started until now (others' loads may have gone first): a cancel or the
                # drain may have answered it meanwhile, and its budget or its peer may have gone.
                if self.server.queued.take(call):
                    try:
                        refusal = refusal_to_start(call)
                        result = refusal if refusal is not None else background.finish()
                    except Exception as exc:
                        result = exc
                    # Answered under the serving lock, as the worker answers: a fast-path step of
                    # the same connection must not be answered before this reply is written.
                    with self._serving:
                        if isinstance(result, Exception):  # every failure is answered; the loader lives on
                            self._fail(call, result)
                        else:
                            self._answer(call, result)
            except Exception:  # a bug in reply writing must not stop the loader
                log.exception("finishing %s in the background failed", call.op)
            self._queue.put(_Resume(call.conn.id))

    def _serve_on(self, call: Call, *, reader: bool, alone: bool = False) -> bool:
        """Serve `call`, one thread at a time. The worker serves a batched request with the
        batch it leads (`alone`: as a batch of its own). A reader thread serves it alone, unless
        requests like it recently came together: then it serves nothing and returns False, so
        that the worker gathers the request with those that arrive meanwhile (waiting for them
        as the batch policy says)."""
        op = call.batched_op
        with self._serving:
            # The worker takes a request from the cancellable set only once it may run it: while
            # it waits here for a thread serving inline, a cancel can still drop the request. A
            # batched one is taken at its launch (_run_batch): gathering is not running.
            if not reader and (call.dropped if op is not None else not self.server.queued.take(call)):
                return True
            try:
                stopped = self._stopped_error()  # reader only: the worker has ended by then
                if stopped is not None:
                    self._fail(call, stopped)
                elif op is None:
                    self._serve(call, worker=not reader)
                elif alone or reader:
                    return self._serve_alone(op, call, wait_for_company=reader)
                else:
                    self._serve_batch(op, call)
            except Exception:  # a bug in reply writing must not stop the serving thread
                log.exception("serving %s failed", call.op)
        return True

    def _serve_alone(self, op: BatchedOp, call: Call, *, wait_for_company: bool) -> bool:
        """Serve a batchable request as a batch of its own, unless (`wait_for_company`) requests
        like it recently came together (then False: it is left for the worker to gather)."""
        item = self._prepare(op, call)
        if item is not None:
            if wait_for_company and self.policy.expects_company(item.key, now_ns()):
                return False
            self._run_batch(op, Batch(item))
        return True

    def _next_call(self, block: bool = True, timeout: float | None = None):
        """The held request if a cancel has not dropped it, else the next queued one a cancel has
        not dropped; None when nothing came in time. It stays in the cancellable set: whoever
        runs it takes it from there under the serving lock."""
        while True:
            if self._held is not None:
                call, self._held = self._held, None
            else:
                try:
                    call = self._queue.get(block, timeout)
                except queue.Empty:
                    return None
            if call is _STOP or call is _WAKE or isinstance(call, _Resume) or not call.dropped:
                return call

    def _hold(self, call) -> None:
        """Keep `call`, met while gathering a batch it cannot join, to be served next."""
        self._held = call

    def _serve(self, call: Call, *, worker: bool = False) -> None:
        call.timing.add("queue", now_ns() - call.enqueued_ns)
        try:
            refusal = refusal_to_start(call)
            if refusal is not None:
                raise refusal
            result = call.handler(self.server, call)
            if isinstance(result, Background):
                if worker:
                    self._waiting_for_background[call.conn.id] = []
                    # Cancellable again until the loader takes it (_load).
                    self.server.queued.add(call, self._fail, oldest=True)
                    self._background.put((call, result))
                    return
                result = result.finish()
        except Exception as exc:  # every failure is answered; the worker lives on
            self._fail(call, exc)
        else:
            self._answer(call, result)

    def _serve_batch(self, op: BatchedOp, first: Call) -> None:
        batch = self._gather(op, first)
        if batch is not None:
            self._run_batch(op, batch)

    def _run_batch(self, op: BatchedOp, batch: Batch) -> None:
        start = now_ns()
        items = []
        for item in batch.items:
            call = item.call
            # Taken only now: until its launch a gathered request has not started, so a cancel
            # or the drain may have answered it, and its budget or its peer may have gone meanwhile.
            if not self.server.queued.take(call):
                continue
            call.timing.add("queue", start - call.enqueued_ns - item.prepare_ns)
            refusal = refusal_to_start(call)
            if refusal is not None:
                self._fail(call, refusal)
            else:
                items.append(item)
        if items and items[0] is not batch.items[0]:
            # The others were gathered by the lead's shared values, which a cancel or the drain
            # that answered it may have let a later frame overwrite in its buffer: they launch
            # together only as far as they match the first left, the rest in launches after.
            while items:
                group = Batch(items[0])
                for item in items[1:]:
                    if not group.accepts(item, self.policy.max_batch):
                        break
                    group.add(item)
                self._launch(op, group.items)
                items = items[len(group.items):]
        elif items:
            self._launch(op, items)

    def _launch(self, op: BatchedOp, items: list) -> None:
        for item, outcome in run_batch(self.server, op, items):
            try:
                if isinstance(outcome, BaseException):
                    self._fail(item.call, outcome)
                else:
                    self._answer(item.call, outcome)
            except Exception:  # after the reply (a release or hook failed): the others still get theirs
                log.exception("finishing %s %s of a batch failed", item.call.op, item.call.request.reply_id)

    def _gather(self, op: BatchedOp, first: Call) -> Batch | None:
        """The batch `first` leads: the requests after it that can share its launch."""
        lead = self._prepare(op, first)
        if lead is None:
            return None
        batch = Batch(lead)
        while lead.key is not None and batch.rows < self.policy.max_batch:
            # Once the server drains, no company can come: only what is queued joins.
            wait = self.policy.wait_s(batch, now_ns()) if self.accepting else None
            call = self._next_call(block=wait is not None, timeout=wait)
            if call is None or call is _WAKE:
                break
            if call is _STOP or isinstance(call, _Resume) or call.batched_op is not op \
                    or call.conn.id in self._waiting_for_background:
                self._hold(call)
                break
            item = self._prepare(op, call)
            if item is None:
                continue
            if not batch.accepts(item, self.policy.max_batch):
                self._hold(call)
                break
            batch.add(item)
        self.policy.observe(batch, now_ns())
        return batch

    def _prepare(self, op: BatchedOp, call: Call):
        """The request's batch item; None when it cannot run (it has been answered). Its deadline
        and its peer are checked each time: one prepared before (served inline, or held behind a
        launch) may have run out of budget, or lost its peer, since."""
        try:
            refusal = refusal_to_start(call)
            if refusal is not None:
                raise refusal
            if call.prepared is None:
                call.prepared = prepare(op, self.server, call)
        except Exception as exc:
            # Taken first: one still in the cancellable set must not be answered twice.
            if self.server.queued.take(call):
                self._fail(call, exc)
            return None
        return call.prepared

    def _answer(self, call: Call, result: dict) -> None:
        reply_timing = {}
        # A multipart request (ZeroMQ) gets its reply's tensors as raw buffers too.
        out_of_band = [] if call.request.multipart else None
        encode_start = now_ns()

        def timing():
            call.timing.add("encode", now_ns() - encode_start)
            reply_timing.update(call.timing.as_reply())
            return reply_timing

        try:
            parts = call.codec.reply(call.request, result, timing, out_of_band)
        except Exception as exc:
            self._take_back(call)
            # A tensor past msgpack's 4-byte bin length: too large to frame, as a whole reply can be.
            self._fail(call, reply_too_large(exc) if isinstance(exc, protocol.FrameTooLarge) else exc)
            return
        self._replying(call)
        try:
            self._send(call.conn, parts, out_of_band)
        except protocol.FrameTooLarge as exc:  # nothing was written: the error is the answer
            self._take_back(call)
            self._reply_error(call.conn, call.codec, call.request.reply_id, reply_too_large(exc),
                              stats_op=call.stats_op)
        else:
            # A batched op's success counts no execution: its launch counted one (_launch).
            self.server.stats.record(call.stats_op, reply_timing or None, ok=True,
                                     executions=int(call.batched_op is None))
        finally:
            self._finish(call)

    @staticmethod
    def _take_back(call: Call) -> None:
        if call.if_unsent is not None:
            try:
                call.if_unsent()
            except Exception:  # the error about to be sent is still the answer
                log.exception("%s: taking back what it did, its result unsent, failed", call.op)

    def _fail(self, call: Call, exc: BaseException) -> None:
        self._replying(call)
        try:
            code = self._reply_error(call.conn, call.codec, call.request.reply_id, exc, stats_op=call.stats_op)
            # Errors the request itself caused (every code but internal_error, as error_fields
            # sorts them) are answered, not logged as the server's failures.
            if code == "internal_error":
                log.error("op %s failed", call.op, exc_info=exc)
        finally:
            self._finish(call)

    def _finish(self, call: Call) -> None:
        """The request has been answered: its frame buffer goes back to the pool (its tensors
        were views into it), and it is no longer in flight. Its batch
        item is dropped: item and call refer to each other, and left so, every request (its
        tensors, their frame views) would wait for the cyclic garbage collector to be freed."""
        call.prepared = None
        try:
            if call.release:
                call.release()
        finally:
            self._leave(call.nbytes, call.replying)

    def _replying_uncalled(self) -> None:
        """_replying for a request handed over by the fast path that never became a call."""
        with self._pending_lock:
            self._unanswered_general -= 1

    def _replying(self, call: Call) -> None:
        """The general path's `call` has run (or never will) and its reply is about to be
        written: a step behind it may take the fast path. Said before the write, not after its
        finish: a client answered at once would otherwise find it still in flight, and its next
        step would go the general way. Nothing overtakes it: a reply written under the serving
        lock keeps the fast path waiting on that lock until it is sent."""
        if not call.replying:
            call.replying = True
            with self._pending_lock:
                self._unanswered_general -= 1
                self._leaving += 1
                self._leaving_bytes += call.nbytes

    def _begin_leaving(self, nbytes: int) -> None:
        """A request of `nbytes` is answered, its reply about to be written: the caps count it no
        more (drain still does, until _leave)."""
        with self._pending_lock:
            self._leaving += 1
            self._leaving_bytes += nbytes

    def _leave(self, nbytes: int, leaving: bool = False) -> None:
        """A request of `nbytes` is no longer in flight (drain waits for none to be); `leaving`:
        counted so since its reply began (_begin_leaving, _replying)."""
        with self._idle:
            self._pending -= 1
            self._pending_bytes -= nbytes
            if leaving:
                self._leaving -= 1
                self._leaving_bytes -= nbytes
            if self._pending == 0:
                self._idle.notify_all()

    def _reply_error(self, conn, codec, request_id, exc: BaseException, *, stats_op: str | None = None) -> str:
        """Answer with the error `exc` maps to, in `codec`; returns its code. `stats_op`: the op
        the stats count the failure for; without one (a frame refused before a known op was read
        from it), only the error code is counted."""
        code, message, detail = error_fields(exc)
        try:
            parts = codec.error(request_id, code, message, detail)
        except (TypeError, ValueError):  # a detail msgpack cannot carry must not cost the reply
            log.exception("error reply of %s cannot be encoded as it is", code)
            if code not in protocol.ERROR_CODES:  # a server bug, but the request is still answered
                code, message = "internal_error", f"unregistered error code {code!r}: {message}"
            # Nor a message that is no UTF-8 (a lone surrogate from a file or tensor name).
            message = message.encode("utf-8", "backslashreplace").decode("utf-8")
            parts = codec.error(request_id, code, message, {})
        try:
            self._send(conn, parts)
        except protocol.FrameTooLarge as exc:  # nothing was written; that error's answer is small
            # An error that echoes what the request sent (an op name or an argument's key, in
            # the message and the detail) can be several times its size.
            return self._reply_error(conn, codec, request_id, reply_too_large(exc), stats_op=stats_op)
        if stats_op is not None:
            self.server.stats.record(stats_op, None, ok=False, error_code=code)
        else:
            self.server.stats.record_error(code)
        return code

    def _send(self, conn, parts, buffers: list | None = None) -> None:
        try:
            conn.send(parts, buffers)  # buffers: a multipart reply's (ZeroMQ only)
        except OSError as exc:
            # A peer gone with many requests queued fails each of their replies: one warning says
            # so, and peers gone one after another are warned of at most once an interval.
            if conn.reply_failed:
                log.debug("could not reply to %s: %s (not its first)", conn.id, exc)
            else:
                conn.reply_failed = True
                self._reply_failures.warn("could not reply to %s: %s", conn.id, exc)
            return
        if not conn.counts_replies_it_sends:
            self.server.stats.reply_out(parts, buffers or (), lane=conn.lane)
