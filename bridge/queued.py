"""Requests waiting for the dispatcher's worker (or, handed back by it, for its loader thread),
by connection and id, so that a `cancel` can drop one before it runs (SPEC §6), and a drain that
runs out of time can answer those that never started.

Each time it waits, a request is taken exactly once: by the thread that then runs it, or by a
cancel or the drain, which has it answered (`cancelled`, `shutting_down`) at once through the
answer function it was queued with (that thread then passes over it).
"""

from __future__ import annotations

import threading
from typing import Callable

from protocol import shown_value

from .errors import OpError


class QueuedRequests:
    def __init__(self):
        self._lock = threading.Lock()
        # (connection id, request id) -> [(call, answer)] waiting, oldest first (ids may repeat)
        self._waiting: dict[tuple, list] = {}

    def add(self, call, answer: Callable[[object, OpError], None], *, oldest: bool = False) -> None:
        """`call` waits to run; a cancel, or the shutdown's drop_all, answers it with
        `answer(call, error)`. Requests without an id (legacy ones) are listed under None, which
        no cancel can name. `oldest`: it goes before the others with its id (one taken and
        handed back: they all came after it)."""
        request_id = call.request.reply_id
        with self._lock:
            entries = self._waiting.setdefault((call.conn.id, request_id), [])
            entries.insert(0 if oldest else len(entries), (call, answer))

    def take(self, call) -> bool:
        """The worker (or the loader) takes `call` to run it: False when a cancel took it first
        (it has been answered)."""
        request_id = call.request.reply_id
        with self._lock:
            if call.dropped:
                return False
            key = (call.conn.id, request_id)
            entries = self._waiting.get(key, [])
            for i, (waiting, _) in enumerate(entries):
                if waiting is call:
                    del entries[i]
                    break
            if not entries:
                self._waiting.pop(key, None)
            return True

    def cancel(self, conn_id: str, request_id, by) -> bool:
        """Drop `conn_id`'s oldest waiting request `request_id` and have it answered
        `cancelled`; False when none waits. `by`: the cancel request's own id."""
        with self._lock:
            entries = self._waiting.get((conn_id, request_id))
            if not entries:
                return False
            call, answer = entries.pop(0)
            if not entries:
                del self._waiting[(conn_id, request_id)]
            call.dropped = True
        answer(call, OpError("cancelled", f"request {shown_value(request_id)} was cancelled by request "
                                          f"{shown_value(by)} before it ran",
                             {"cancelled_by": by}))
        return True

    def drop_all(self, error: OpError) -> int:
        """Drop every waiting request and have each answered `error` (the server stopping);
        how many there were."""
        with self._lock:
            waiting = [entry for entries in self._waiting.values() for entry in entries]
            self._waiting.clear()
            for call, _ in waiting:
                call.dropped = True
        for call, answer in waiting:
            answer(call, error)
        return len(waiting)

    def __len__(self) -> int:
        with self._lock:
            return sum(len(entries) for entries in self._waiting.values())
