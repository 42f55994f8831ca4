"""A hand-off to the one thread that owns some ZeroMQ sockets (they are not thread-safe), used
by the server's ZeroMQ lane and by the ZeroMQ client alike."""

from __future__ import annotations

import collections
import os
import threading


class Outbox:
    """Messages for sockets owned by one thread, posted from any thread: zmq sockets are not
    thread-safe, so the owner sends them. `post` wakes the owner through an eventfd it polls."""

    def __init__(self):
        self._items: collections.deque = collections.deque()
        self.fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        # Keeps `post` from writing to the fd's number once closed: it may name another file by
        # then (a reply posted after a drain that gave up is dropped instead).
        self._closing = threading.Lock()
        self._closed = False

    def post(self, item) -> None:
        try:
            self._items.append(item)
        finally:
            # Woken even when an interrupt (Ctrl-C) cuts this short: what went in would
            # otherwise wait for the next post.
            with self._closing:
                if not self._closed:
                    os.eventfd_write(self.fd, 1)

    def take(self) -> list:
        """Everything posted so far, in order (called by the owner when the fd is readable)."""
        try:
            os.eventfd_read(self.fd)
        except BlockingIOError:
            pass
        items = []
        while self._items:
            items.append(self._items.popleft())
        return items

    def holds_last(self, item) -> bool:
        """Whether `item` is the last thing posted and not yet taken: after a post an interrupt
        cut short, whether it went in (while the poster keeps the owner from taking)."""
        try:
            return self._items[-1] is item
        except IndexError:
            return False

    @property
    def pending(self) -> bool:
        """Something was posted and not taken yet."""
        return bool(self._items)

    def close(self) -> None:
        """Close the fd, once: a second close would close whatever file took its number since."""
        with self._closing:
            if not self._closed:
                self._closed = True
                os.close(self.fd)
