"""frame → decode → dispatch → op → encode → reply.

Transports call `on_frame` from their reader threads: the body is decoded and validated there
(so, while the server is busy, the next frame is read while the worker computes), then queued
for the worker, which runs the op and writes the reply through the connection. Every failure becomes a structured error
reply; nothing a client sends can stop the worker.

On the worker, a request for a batchable op (a bridge.batcher.BatchedOp: step, scan) leads a
batch: queued requests that can share its kernel launch join it, late ones too while the
batch policy waits for them (`--max-delay-us`); the batch runs as one launch and each request
gets its own reply. Any other request runs alone. Requests run in the order they arrived.

A request that finds the server idle -- nothing in flight, nothing more waiting on its
connection (the transport says so: `more_input=False`) -- runs at once on the reader thread
that decoded it, skipping the hand-off to the worker (a thread wake-up and GIL hand-over): the
game loop's queue stage was 50 µs a step in bench/results/game_loop.json as committed in
13cc2ef, and 6-9 µs since in steps back to back. It runs alone; requests that come meanwhile
queue for the worker, which gathers them into batches as usual.
One lock (`_serving`) lets one thread at a time run ops, so the ops never run concurrently.

Before any of that, the native step path (bridge.native) reads a request without raw buffers
where it lies; anything but a plain step goes on untouched. A plain step that finds nothing in
flight but native steps (other connections', see _serve_native) -- on any lane, whatever waits
behind it -- it serves in C++ from frame to reply under the same lock. That keeps the order:
nothing gone the general way is overtaken, and a connection's requests are read one after the
other. It takes steps under load too, where the batcher would have gathered them: on the CPU a
step served natively alone costs less than its share of a batch through the general path (8
callers stepping 1-row sessions: 5.05x the batched general path's throughput over stdio, 4.35x
over the unix lane, 4.62x over ZeroMQ; 32-row ones 1.71-1.77x; bench/results/game_loop.json,
part b, at 87a7503). Steps that queue behind other work, and every step where there is no
native path (CUDA, other backends, `--no-native-step`), are batched as above.
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass
from typing import Callable

import protocol

from .batcher import Batch, BatchedOp, BatchPolicy, prepare, run_batch
from .errors import OpError, error_fields
from .native import NativeStepError
from .timing import Timing, now_ns

log = logging.getLogger("bridge")


@dataclass
class Call:
    """One request in flight."""

    conn: object
    request: object  # protocol.Request | protocol.LegacyRequest
    timing: Timing
    handler: Callable  # the op's handler, from the table of the request's protocol
    legacy: bool  # an ExPhil request (protocol.LegacyRequest)
    release: Callable | None = None  # returns the frame buffer to its pool
    enqueued_ns: int = 0
    after_reply: Callable | None = None  # run once the reply is written (the shutdown op's)
    prepared: object = None  # the batcher's Item, once prepared

    @property
    def op(self) -> str:
        return self.request.op

    @property
    def args(self) -> dict:
        return self.request.args

    @property
    def batched_op(self) -> BatchedOp | None:
        """The handler when the dispatcher batches it (legacy ops have no batched handler)."""
        return self.handler if isinstance(self.handler, BatchedOp) else None

    @property
    def stats_op(self) -> str:
        """The op's name in the stats, where a legacy request's ops are counted apart."""
        return "legacy_" + self.op if self.legacy else self.op


_STOP = object()


def reply_too_large(exc: protocol.FrameTooLarge) -> OpError:
    """The answer to a request whose reply a stream lane's 4-byte length prefix cannot frame
    (SPEC §2): a result as large as that comes only from a request near --max-frame-size whose
    result is many times its input (a scan's state beside a short x)."""
    return OpError("limit_exceeded", f"reply: expected at most {exc.limit} bytes in a frame, got {exc.length}",
                   {"limit": "reply_frame_size", "max": exc.limit, "requested": exc.length})


class Dispatcher:
    def __init__(self, server, handlers: dict, legacy_handlers: dict):
        # The decoders refuse every op outside protocol.OPS (and the legacy ones), so the tables
        # must serve exactly those.
        for what, table, ops in (("handlers", handlers, protocol.OPS),
                                 ("legacy_handlers", legacy_handlers, protocol.legacy.LEGACY_OPS)):
            if set(table) != set(ops):
                raise ValueError(f"{what}: expected one handler for each of {sorted(ops)}, got {sorted(table)}")
        self.server = server
        self.handlers = handlers
        self.legacy_handlers = legacy_handlers
        self.max_pending = server.config.max_pending
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._pending = 0
        # Of those, requests taken by the native step path (see _serve_native).
        self._pending_native = 0
        self._pending_lock = threading.Lock()
        self._idle = threading.Condition(self._pending_lock)
        self._worker = threading.Thread(target=self._work, name="bridge-worker", daemon=True)
        # Held while ops run: by the worker, or by a reader thread serving an idle server's request.
        self._serving = threading.Lock()
        self.accepting = True
        self.policy = BatchPolicy(server.config.max_delay_us, server.config.max_batch)
        # A request taken from the queue while gathering a batch that it could not join: the
        # worker serves it next (worker thread only).
        self._held: Call | None = None

    # -- transport side -------------------------------------------------------------------

    def start(self) -> None:
        self._worker.start()

    def on_frame(self, conn, body, received_ns: int, release: Callable | None = None,
                 buffers=(), *, more_input: bool | Callable[[], bool] = True) -> None:
        """`more_input`: whether more input may already be waiting for the thread that read this
        frame (this connection's; over the unix lane, any connection's: one thread reads them
        all), or a function that tells it, asked only where the answer matters (an idle
        server's general-path request: the native path does not ask, so a step served natively
        costs no check); only a transport that can tell none is (stdio, unix) lets it be False,
        and so an idle server serve the request on this thread."""
        self.server.stats.frame_in(len(body) + (sum(memoryview(b).nbytes for b in buffers) if buffers else 0))
        native = self._native_request(body) if self.server.native_step is not None and not buffers else None
        if native is not None and self._serve_native(conn, native, received_ns):
            if release:
                release()
            return
        timing = Timing(received_ns)
        try:
            request = protocol.decode_request(body, buffers)
        except Exception as exc:
            # Every frame read is answered once, a bug in the decoder's too (as internal_error,
            # id nil): the transport counts it in flight until then.
            if isinstance(exc, protocol.ProtocolError):
                request_id, legacy = exc.request_id, exc.legacy
            else:
                log.exception("decoding a request failed")
                request_id, legacy = None, False
            self._reply_error(conn, request_id, exc, legacy=legacy)
            if release:
                release()
            return
        timing.add("decode", now_ns() - received_ns)
        legacy = isinstance(request, protocol.LegacyRequest)
        table = self.legacy_handlers if legacy else self.handlers
        handler = table[request.op]  # the decoder answered an op outside the table (unknown_op)
        refusal = None
        idle = False
        # Checked where the request is counted, under the lock drain() waits under: checked
        # before, drain could find nothing in flight between the two and report all answered
        # (the server then exits) with this request admitted after it.
        with self._pending_lock:
            if not self.accepting:
                refusal = OpError("shutting_down", "the server is shutting down and takes no new requests")
            elif self._pending < self.max_pending:
                idle = self._pending == 0
                self._pending += 1
            else:
                refusal = OpError("overloaded", f"more than {self.max_pending} requests in flight",
                                  {"limit": self.max_pending})
        if refusal is not None:
            self._reply_error(conn, None if legacy else request.id, refusal, legacy=legacy)
            if release:
                release()
            return
        call = Call(conn, request, timing, handler, legacy, release, enqueued_ns=now_ns())
        # An idle server serves the request on this thread, unless it is to be batched with
        # others (see _serve_on); nothing it could be queued behind exists, so order is kept.
        if not (idle and not (more_input() if callable(more_input) else more_input)
                and self._serve_on(call, reader=True)):
            self._queue.put(call)

    def _native_request(self, body):
        """The plain step `body` holds, for the native path; None for any other request, or
        when parsing fails (the general path then answers it)."""
        try:
            return self.server.native_step.parse(body)
        except Exception:
            log.exception("native step path failed parsing a request")
            return None

    def _serve_native(self, conn, request, received_ns: int) -> bool:
        """Serve a parsed plain step on this thread through the native path, if nothing is in
        flight but other native steps (other lanes' readers, each serving one). False: it
        was not taken, and goes the general way.

        A request that goes the general way is never overtaken: while one is in flight, every
        request after it goes that way too. Native steps of other connections only wait for the
        serving lock: sent to the worker instead, a step arriving while another connection's is
        served would leave the next ones behind it in flight too, and so on (8 callers over the
        unix lane, each on a connection of its own, when each had a reader thread of its own:
        24-37% of their steps native and 5.1k steps/s, against all of them and 7.2k waiting;
        bench/results/unix_callers_native_ab.json). Since one thread reads every unix
        connection, the readers that meet here are those of different lanes."""
        with self._pending_lock:
            # Past --max-pending, the general way answers `overloaded`; after drain() began,
            # `shutting_down` (checked with the count, as on_frame does).
            if not self.accepting or self._pending != self._pending_native \
                    or self._pending >= self.max_pending:
                return False
            self._pending += 1
            self._pending_native += 1
        try:
            waiting_since = now_ns()
            with self._serving:
                try:
                    outcome = self.server.native_step.serve(conn, request, received_ns, now_ns() - waiting_since)
                except NativeStepError as exc:  # its kernel ran, or may have: never served twice
                    log.error("native step failed", exc_info=exc.__cause__)
                    self._reply_error(conn, exc.request_id, exc, legacy=False, stats_op="step")
                    return True
                except Exception:  # before its kernel: nothing touched, the general path answers
                    log.exception("native step path failed before taking a request")
                    return False
            if outcome is None:
                return False
            reply, timing = outcome
            self._send(conn, [reply])
            self.server.stats.record("step", timing, ok=True)
            return True
        finally:
            self._leave(native=True)

    def on_frame_error(self, conn, exc: protocol.FrameTooLarge) -> None:
        """An oversized frame, already drained by the transport: read, as the stats count it
        (its announced bytes), and answered."""
        self.server.stats.frame_in(exc.length)
        self._reply_error(conn, None, exc, legacy=False)

    # -- shutdown -------------------------------------------------------------------------

    def drain(self, timeout: float) -> bool:
        """Stop taking requests and wait until those in flight are answered."""
        with self._idle:
            self.accepting = False
            return self._idle.wait_for(lambda: self._pending == 0, timeout)

    def stop(self) -> None:
        self._queue.put(_STOP)

    # -- worker side ----------------------------------------------------------------------
    # Every request taken from the queue ends in exactly one of _answer or _fail.

    def _work(self) -> None:
        while True:
            call = self._next_call()
            if call is _STOP:
                return
            self._serve_on(call, reader=False)

    def _serve_on(self, call: Call, *, reader: bool) -> bool:
        """Serve `call`, one thread at a time. The worker serves a batched request with the
        batch it leads. A reader thread serves it alone, unless requests like it recently came
        together: then it serves nothing and returns False, so that the worker gathers the
        request with those that arrive meanwhile (waiting for them as the batch policy says)."""
        op = call.batched_op
        with self._serving:
            try:
                if op is None:
                    self._serve(call)
                elif not reader:
                    self._serve_batch(op, call)
                else:
                    return self._serve_alone(op, call)
            except Exception:  # a bug in reply writing must not stop the serving thread
                log.exception("serving %s failed", call.op)
        return True

    def _serve_alone(self, op: BatchedOp, call: Call) -> bool:
        """Serve a batchable request as a batch of its own, unless requests like it recently
        came together (then False: it is left for the worker to gather)."""
        item = self._prepare(op, call)
        if item is not None:
            if self.policy.expects_company(item.key, now_ns()):
                return False
            self._run_batch(op, Batch(item))
        return True

    def _next_call(self, block: bool = True, timeout: float | None = None):
        """The held request if any, else the next queued one; None when nothing came in time."""
        if self._held is not None:
            call, self._held = self._held, None
            return call
        try:
            return self._queue.get(block, timeout)
        except queue.Empty:
            return None

    def _serve(self, call: Call) -> None:
        call.timing.add("queue", now_ns() - call.enqueued_ns)
        try:
            result = call.handler(self.server, call)
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
        for item in batch.items:
            item.call.timing.add("queue", start - item.call.enqueued_ns - item.prepare_ns)
        for item, outcome in run_batch(self.server, op, batch.items):
            try:
                if isinstance(outcome, BaseException):
                    self._fail(item.call, outcome)
                else:
                    self._answer(item.call, outcome)
            except Exception:  # after the reply (a release or hook failed): the others still get theirs
                log.exception("finishing %s %s of a batch failed", item.call.op, item.call.request.id)

    def _gather(self, op: BatchedOp, first: Call) -> Batch | None:
        """The batch `first` leads: the requests after it that can share its launch."""
        lead = self._prepare(op, first)
        if lead is None:
            return None
        batch = Batch(lead)
        while lead.key is not None and batch.rows < self.policy.max_batch:
            wait = self.policy.wait_s(batch, now_ns())
            call = self._next_call(block=wait is not None, timeout=wait)
            if call is None:
                break
            if call is _STOP or call.batched_op is not op:
                self._held = call
                break
            item = self._prepare(op, call)
            if item is None:
                continue
            if not batch.accepts(item, self.policy.max_batch):
                self._held = call
                break
            batch.add(item)
        self.policy.observe(batch, now_ns())
        return batch

    def _prepare(self, op: BatchedOp, call: Call):
        """The request's batch item; None when it cannot run (it has been answered)."""
        if call.prepared is None:
            try:
                call.prepared = prepare(op, self.server, call)
            except Exception as exc:
                self._fail(call, exc)
                return None
        return call.prepared

    def _answer(self, call: Call, result: dict) -> None:
        reply_timing = {}
        # A multipart request (ZeroMQ) gets its reply's tensors as raw buffers too.
        out_of_band = [] if not call.legacy and call.request.multipart else None
        try:
            if call.legacy:
                parts = protocol.encode_legacy_reply(result)
            else:
                encode_start = now_ns()

                def timing():
                    call.timing.add("encode", now_ns() - encode_start)
                    reply_timing.update(call.timing.as_reply())
                    return reply_timing

                parts = protocol.encode_reply(call.request.id, result, timing, buffers=out_of_band)
        except Exception as exc:
            self._fail(call, exc)
            return
        try:
            self._send(call.conn, parts, out_of_band)
        except protocol.FrameTooLarge as exc:  # nothing was written: the error is the answer
            self._reply_error(call.conn, None if call.legacy else call.request.id, reply_too_large(exc),
                              legacy=call.legacy, stats_op=call.stats_op)
        else:
            # A batched op's success counts no execution: its launch counted one (_launch).
            self.server.stats.record(call.stats_op, reply_timing or None, ok=True,
                                     executions=int(call.batched_op is None))
        finally:
            self._finish(call)

    def _fail(self, call: Call, exc: BaseException) -> None:
        try:
            code = self._reply_error(call.conn, None if call.legacy else call.request.id, exc,
                                     legacy=call.legacy, stats_op=call.stats_op)
            # Errors the request itself caused (every code but internal_error, as error_fields
            # sorts them) are answered, not logged as the server's failures.
            if code == "internal_error":
                log.error("op %s failed", call.op, exc_info=exc)
        finally:
            self._finish(call)

    def _finish(self, call: Call) -> None:
        """The request has been answered: its frame buffer goes back to the pool (its tensors
        were views into it), its after-reply hook runs, and it is no longer in flight. Its batch
        item is dropped: item and call refer to each other, and left so, every request (its
        tensors, their frame views) would wait for the cyclic garbage collector to be freed."""
        call.prepared = None
        try:
            if call.release:
                call.release()
            if call.after_reply:
                call.after_reply()
        finally:
            self._leave()

    def _leave(self, native: bool = False) -> None:
        """A request (`native`: one the native path took) is no longer in flight (drain waits
        for none to be)."""
        with self._idle:
            self._pending -= 1
            self._pending_native -= native
            if self._pending == 0:
                self._idle.notify_all()

    def _reply_error(self, conn, request_id, exc: BaseException, *, legacy: bool,
                     stats_op: str | None = None) -> str:
        """Answer with the error `exc` maps to; returns its code. `stats_op`: the op the stats
        count the failure for; without one (the request was refused before it became a call),
        only the error code is counted."""
        code, message, detail = error_fields(exc)
        if legacy:
            parts = protocol.encode_legacy_reply({"status": "error", "message": message})
        else:
            try:
                parts = protocol.encode_error(request_id, code, message, detail)
            except (TypeError, ValueError):  # a detail msgpack cannot carry must not cost the reply
                log.exception("error detail of %s cannot be encoded", code)
                parts = protocol.encode_error(request_id, code, message, {})
        try:
            self._send(conn, parts)
        except protocol.FrameTooLarge as exc:  # nothing was written; that error's answer is small
            # An error that echoes what the request sent (an op name or an argument's key, in
            # the message and the detail) can be several times its size.
            return self._reply_error(conn, request_id, reply_too_large(exc), legacy=legacy, stats_op=stats_op)
        if stats_op is not None:
            self.server.stats.record(stats_op, None, ok=False, error_code=code)
        else:
            self.server.stats.record_error(code)
        return code

    def _send(self, conn, parts, buffers: list | None = None) -> None:
        try:
            conn.send(parts, buffers)  # buffers: a multipart reply's (ZeroMQ only)
        except OSError as exc:
            log.warning("could not reply to %s: %s", getattr(conn, "id", conn), exc)
            return
        self.server.stats.reply_out(parts, buffers or ())
