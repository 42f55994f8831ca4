"""Warnings a peer can cause at will (a connection turned away past --max-connections, a reply
left unread by a peer that went): each would otherwise be a log line per connection, as many as
a client cares to open. Logged at once the first time, then at most once an interval, saying
how many went unlogged between."""

from __future__ import annotations

import logging
import threading
import time

# How often at most such a warning is logged.
INTERVAL_S = 60.0


class ThrottledWarning:
    def __init__(self, logger: logging.Logger, interval_s: float = INTERVAL_S):
        self._logger = logger
        self._interval_s = interval_s
        self._lock = threading.Lock()
        self._last = None  # when it was last logged (time.monotonic), None before the first
        self._unlogged = 0

    def warn(self, message: str, *args) -> None:
        with self._lock:
            now = time.monotonic()
            if self._last is not None and now - self._last < self._interval_s:
                self._unlogged += 1
                return
            unlogged, self._unlogged, self._last = self._unlogged, 0, now
        if unlogged:
            message += f" ({unlogged} more like it since the last one logged)"
        self._logger.warning(message, *args)
