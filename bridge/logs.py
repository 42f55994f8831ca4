"""The server's log: what never holds up the thread that logs, and what a client cannot flood.

StderrLog: a parent that pipes the server's stderr and does not read it fills the pipe (64 KiB):
a write to it then blocks, in the thread that logged, holding logging's lock, and with it every
thread that logs after it (a lane's reader freeing a closed connection's sessions; the main
loop, whose stop is logged: the server could no longer stop). Lines go through a bounded queue
to a writer thread instead; past the bound they are dropped, and the next line written says how
many were.

ThrottledWarning: warnings a peer can cause at will (a connection turned away past
--max-connections, a reply left unread by a peer that went) would otherwise be a log line per
connection, as many as a client cares to open. Logged at once the first time, then at most once
an interval, saying how many went unlogged between."""

from __future__ import annotations

import logging
import queue
import threading
import time

# Lines waiting for stderr before later ones are dropped: a few MB of log.
MAX_WAITING_LINES = 10_000
# How long a flush (the exit's) waits for the lines still queued.
FLUSH_S = 2.0


class StderrLog(logging.Handler):
    def __init__(self, stream, max_waiting: int = MAX_WAITING_LINES):
        super().__init__()
        self._stream = stream
        self._lines: queue.Queue[str] = queue.Queue(max_waiting)
        self._dropped = 0
        self._dropped_lock = threading.Lock()
        threading.Thread(target=self._write, name="log-writer", daemon=True).start()

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = self.format(record) + "\n"
        except Exception:  # logging's own policy for a record that cannot be formatted
            self.handleError(record)
            return
        try:
            self._lines.put_nowait(line)
        except queue.Full:
            with self._dropped_lock:
                self._dropped += 1

    def _write(self) -> None:
        while True:
            line = self._lines.get()
            with self._dropped_lock:
                dropped, self._dropped = self._dropped, 0
            if dropped:
                line = f"({dropped} log lines dropped before this one: stderr was not read)\n{line}"
            try:
                self._stream.write(line)
                self._stream.flush()
            except (OSError, ValueError):  # stderr closed: nothing more can be said
                pass
            finally:
                self._lines.task_done()

    def flush(self, timeout_s: float = FLUSH_S) -> None:
        """Wait, at most `timeout_s`, for the queued lines to be written."""
        deadline = time.monotonic() + timeout_s
        while self._lines.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.005)


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
