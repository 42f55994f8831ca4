"""frame → decode → dispatch → op → encode → reply.

Transports call `on_frame` from their reader threads: the body is decoded and validated there
(so the next frame is read while the worker computes), then queued for the worker, which runs
the op and writes the reply through the connection. Every failure becomes a structured error
reply; nothing a client sends can stop the worker.
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass, field
from typing import Callable

import protocol

from .errors import OpError, error_fields
from .timing import Timing, now_ns

log = logging.getLogger("bridge")


@dataclass
class Call:
    """One request in flight."""

    conn: object
    request: object  # protocol.Request | protocol.LegacyRequest
    timing: Timing
    release: Callable | None = None  # returns the frame buffer to its pool
    enqueued_ns: int = 0
    executions: int = 1  # kernel launches this request took part in (for stats)
    extra: dict = field(default_factory=dict)

    @property
    def op(self) -> str:
        return self.request.op

    @property
    def args(self) -> dict:
        return self.request.args


_STOP = object()


class Dispatcher:
    def __init__(self, server, handlers: dict, legacy_handlers: dict, *, max_pending: int = 4096):
        self.server = server
        self.handlers = handlers
        self.legacy_handlers = legacy_handlers
        self.max_pending = max_pending
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._pending = 0
        self._pending_lock = threading.Lock()
        self._idle = threading.Condition(self._pending_lock)
        self._worker = threading.Thread(target=self._work, name="bridge-worker", daemon=True)
        self.accepting = True

    # -- transport side -------------------------------------------------------------------

    def start(self) -> None:
        self._worker.start()

    def on_frame(self, conn, body, received_ns: int, release: Callable | None = None) -> None:
        self.server.stats.frame_in(len(body))
        timing = Timing(received_ns)
        try:
            request = protocol.decode_request(body)
        except protocol.ProtocolError as exc:
            self._reply_error(conn, exc.request_id, exc, timing, legacy=exc.legacy)
            if release:
                release()
            return
        timing.add("decode", now_ns() - received_ns)
        legacy = isinstance(request, protocol.LegacyRequest)
        table = self.legacy_handlers if legacy else self.handlers
        if request.op not in table:
            known = sorted(table)
            exc = OpError("unknown_op", f"op: expected one of {', '.join(known)}, got {request.op!r}",
                          {"field": "op", "expected": known, "got": request.op})
            self._reply_error(conn, None if legacy else request.id, exc, timing, legacy=legacy)
            if release:
                release()
            return
        if not self.accepting:
            exc = OpError("shutting_down", "the server is shutting down and takes no new requests")
            self._reply_error(conn, None if legacy else request.id, exc, timing, legacy=legacy)
            if release:
                release()
            return
        with self._pending_lock:
            if self._pending >= self.max_pending:
                full = True
            else:
                full = False
                self._pending += 1
        if full:
            exc = OpError("overloaded", f"more than {self.max_pending} requests in flight",
                          {"limit": self.max_pending})
            self._reply_error(conn, None if legacy else request.id, exc, timing, legacy=legacy)
            if release:
                release()
            return
        call = Call(conn, request, timing, release, enqueued_ns=now_ns())
        self._queue.put(call)

    def on_frame_error(self, conn, exc: protocol.ProtocolError, received_ns: int) -> None:
        """A framing-level problem (e.g. an oversized frame, already drained by the decoder)."""
        self._reply_error(conn, None, exc, Timing(received_ns), legacy=False)

    # -- shutdown -------------------------------------------------------------------------

    def drain(self, timeout: float) -> bool:
        """Stop taking requests and wait until those in flight are answered."""
        self.accepting = False
        with self._idle:
            return self._idle.wait_for(lambda: self._pending == 0, timeout)

    def stop(self) -> None:
        self._queue.put(_STOP)

    # -- worker side ----------------------------------------------------------------------

    def _work(self) -> None:
        while True:
            call = self._queue.get()
            if call is _STOP:
                return
            try:
                self._serve(call)
            except Exception:  # a bug in reply writing must not stop the worker
                log.exception("serving %s failed", getattr(call, "op", "?"))
            finally:
                with self._idle:
                    self._pending -= 1
                    if self._pending == 0:
                        self._idle.notify_all()

    def _serve(self, call: Call) -> None:
        call.timing.add("queue", now_ns() - call.enqueued_ns)
        legacy = isinstance(call.request, protocol.LegacyRequest)
        handler = (self.legacy_handlers if legacy else self.handlers)[call.op]
        stats_op = "legacy_" + call.op if legacy else call.op
        try:
            result = handler(self.server, call)
            reply_timing = {}
            if legacy:
                parts = protocol.encode_legacy_reply(result)
            else:
                encode_start = now_ns()

                def timing():
                    call.timing.add("encode", now_ns() - encode_start)
                    reply_timing.update(call.timing.as_reply())
                    return reply_timing

                parts = protocol.encode_reply(call.request.id, result, timing)
        except Exception as exc:  # every failure is answered; the worker lives on
            if not isinstance(exc, (OpError, protocol.ProtocolError)) and type(exc).__module__ != "kernels.errors":
                log.exception("op %s failed", call.op)
            self._reply_error(call.conn, None if legacy else call.request.id, exc, call.timing,
                              legacy=legacy, op=call.op)
        else:
            self._send(call.conn, parts)
            self.server.stats.record(stats_op, reply_timing or None, ok=True, executions=call.executions)
        finally:
            if call.release:
                call.release()
            hook = call.extra.get("after_reply")
            if hook:
                hook()

    def _reply_error(self, conn, request_id, exc: BaseException, timing: Timing, *, legacy: bool,
                     op: str | None = None) -> None:
        code, message, detail = error_fields(exc)
        if legacy:
            parts = protocol.encode_legacy_reply({"status": "error", "message": message})
        else:
            parts = protocol.encode_error(request_id, code, message, detail)
        self._send(conn, parts)
        if op is not None:
            self.server.stats.record(op if not legacy else "legacy_" + op, None, ok=False,
                                     error_code=code, executions=0)
        else:
            self.server.stats.record_error(code)

    def _send(self, conn, parts) -> None:
        try:
            n = conn.send(parts)
        except OSError as exc:
            log.warning("could not reply to %s: %s", getattr(conn, "id", conn), exc)
            return
        self.server.stats.reply_out(n or 0)
