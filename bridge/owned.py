"""What connections own on the server -- sessions (bridge.sessions), tensor handles
(bridge.handles) -- kept under unguessable ids, each entry its owner's alone.

Naming an entry from another connection gets the same error as naming one never issued, so ids
reveal nothing, and what a connection owns is released when it closes (`release_owner`). Ops
run one at a time (under the dispatcher's serving lock: on its worker, on the reader thread of an
idle server, or on the native step path), but a connection closes on its transport's thread, so
every change to a table holds its lock.
"""

from __future__ import annotations

import abc
import secrets
import threading
from typing import Callable, Generic, TypeVar

from .errors import OpError

Value = TypeVar("Value")


class OwnedTable(abc.ABC, Generic[Value]):
    def __init__(self, unknown: Callable[[str, str], OpError]):
        """`unknown(id, field)`: the error for an id its asker does not own."""
        self._unknown = unknown
        self._lock = threading.Lock()
        self._entries: dict[str, tuple[str, Value]] = {}  # id -> (owner, value)
        # owner -> the ids of its entries: a connection's close frees what it holds without a
        # look at every other connection's (release_owner)
        self._owned: dict[str, set[str]] = {}
        # Called, outside the lock, with an owner whose last entry `remove` (or a subclass's
        # drop) released: it may own nothing any more (bridge.server stops watching it).
        self.on_emptied: Callable[[str], None] | None = None

    def __len__(self) -> int:
        return len(self._entries)

    def find(self, owner: str, entry_id: str) -> Value | None:
        """The value of `entry_id` if `owner` owns it, else None."""
        with self._lock:
            entry = self._entries.get(entry_id)
        return entry[1] if entry is not None and entry[0] == owner else None

    def get(self, owner: str, entry_id: str, field: str) -> Value:
        value = self.find(owner, entry_id)
        if value is None:
            raise self._unknown(entry_id, field)
        return value

    def holds_any(self, owner: str) -> bool:
        with self._lock:
            return owner in self._owned

    def remove(self, owner: str, entry_id: str, field: str) -> None:
        """Release `entry_id`, which `owner` must own."""
        with self._lock:
            entry = self._entries.get(entry_id)
            if entry is None or entry[0] != owner:
                raise self._unknown(entry_id, field)
            emptied = self._remove(entry_id)
        self._tell_emptied([emptied])

    def release_owner(self, owner: str) -> int:
        """Release everything `owner` owns (its connection went away); returns how many."""
        with self._lock:
            mine = list(self._owned.get(owner, ()))
            for entry_id in mine:
                self._remove(entry_id)
        return len(mine)

    def _refuse_past(self, most: int, op: str, what: str, flag: str) -> None:
        """limit_exceeded for `op` when `most` entries (`what`, capped by the server flag `flag`)
        are held already. Called with the lock held."""
        if len(self) >= most:
            raise OpError("limit_exceeded", f"{op}: at most {most} {what} may be held at once ({flag}), {len(self)} are",
                          {"limit": flag.removeprefix("--").replace("-", "_"), "max": most, "held": len(self)})

    def _add(self, owner: str, make: Callable[[str], Value]) -> tuple[str, Value]:
        """(id, value) of a new entry of `owner`'s, its value made by `make(id)`. Called with the
        lock held."""
        entry_id = secrets.token_urlsafe(16)
        value = make(entry_id)
        self._entries[entry_id] = (owner, value)
        self._owned.setdefault(owner, set()).add(entry_id)
        return entry_id, value

    def _remove(self, entry_id: str) -> str | None:
        """Drop an entry and free what it holds; returns its owner if that was the owner's last
        entry. Called with the lock held."""
        owner, value = self._entries.pop(entry_id)
        ids = self._owned[owner]
        ids.discard(entry_id)
        left = len(ids)
        if not left:
            del self._owned[owner]
        self._released(value)
        return None if left else owner

    def _tell_emptied(self, owners) -> None:
        """on_emptied for each owner `_remove` said it emptied (None for the others). Called
        without the lock."""
        if self.on_emptied is not None:
            for owner in owners:
                if owner is not None:
                    self.on_emptied(owner)

    @abc.abstractmethod
    def _released(self, value: Value) -> None:
        """Free what a dropped entry held. Called with the lock held."""
