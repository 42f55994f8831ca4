from __future__ import annotations

import itertools
import threading

_ids = itertools.count(1)


class Connection:
    """One peer. Sessions and handles opened over it belong to it and are freed when it closes
    (`on_close` callbacks)."""

    def __init__(self, kind: str):
        self.id = f"{kind}:{next(_ids)}"
        self.closed = False
        self._close_callbacks = []
        self._close_lock = threading.Lock()

    def send(self, parts: list) -> int:  # pragma: no cover - each transport implements it
        raise NotImplementedError

    def on_close(self, callback) -> None:
        with self._close_lock:
            if self.closed:
                callback(self)
            else:
                self._close_callbacks.append(callback)

    def mark_closed(self) -> None:
        with self._close_lock:
            if self.closed:
                return
            self.closed = True
            callbacks, self._close_callbacks = self._close_callbacks, []
        for callback in callbacks:
            callback(self)
