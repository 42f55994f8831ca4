"""Tensor handles: tensors uploaded once with `put` and named by `{"handle": id}` wherever a
request takes a tensor, so constants (A, D, dt_bias) cross the wire once.

A handle's tensor is the server's own copy on its device (request frames are pooled buffers that
are reused after the reply, bridge.buffers). Ownership, id secrecy and thread safety are as for
sessions (bridge.sessions): a handle belongs to the connection that put it, another
connection's handle is indistinguishable from an unknown one, and the table is locked because
connections close on their transport's thread.
"""

from __future__ import annotations

import secrets
import threading

import torch

from .errors import OpError


def unknown_handle(handle: str, field: str) -> OpError:
    return OpError("unknown_handle", f"{field}: no tensor handle {handle!r} is held for this connection",
                   {"field": field, "handle": handle})


class HandleTable:
    def __init__(self, *, max_handles: int, max_bytes: int):
        self.max_handles = max_handles
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._tensors: dict[str, tuple[str, torch.Tensor]] = {}  # id -> (owner, tensor)
        self._bytes = 0

    def check_room(self, nbytes: int) -> None:
        """Raise limit_exceeded unless one more tensor of `nbytes` fits; called before the
        tensor is copied to the device."""
        with self._lock:
            self._check_room(nbytes)

    def _check_room(self, nbytes: int) -> None:
        if len(self._tensors) >= self.max_handles:
            raise OpError("limit_exceeded",
                          f"put: at most {self.max_handles} tensor handles may be held at once "
                          f"(--max-handles), {len(self._tensors)} are",
                          {"limit": "max_handles", "max": self.max_handles, "held": len(self._tensors)})
        if self._bytes + nbytes > self.max_bytes:
            raise OpError("limit_exceeded",
                          f"put: a tensor of {nbytes} bytes does not fit: {self._bytes} of "
                          f"{self.max_bytes} bytes are held (--max-handle-bytes)",
                          {"limit": "max_handle_bytes", "max": self.max_bytes, "in_use": self._bytes,
                           "requested": nbytes})

    def put(self, owner: str, tensor: torch.Tensor) -> str:
        """Hold `tensor` (which must be the server's own copy) for `owner`; returns its id."""
        nbytes = tensor.numel() * tensor.element_size()
        with self._lock:
            # Again, should puts ever run side by side: today ops run one at a time, and only a
            # closing connection can change the table meanwhile, which frees room.
            self._check_room(nbytes)
            handle = secrets.token_urlsafe(16)
            self._tensors[handle] = (owner, tensor)
            self._bytes += nbytes
        return handle

    def find(self, owner: str, handle: str) -> torch.Tensor | None:
        """The tensor of `handle` if `owner` holds it, else None."""
        with self._lock:
            entry = self._tensors.get(handle)
        return entry[1] if entry is not None and entry[0] == owner else None

    def get(self, owner: str, handle: str, field: str) -> torch.Tensor:
        tensor = self.find(owner, handle)
        if tensor is None:
            raise unknown_handle(handle, field)
        return tensor

    def free(self, owner: str, handle: str, field: str) -> None:
        with self._lock:
            entry = self._tensors.get(handle)
            if entry is None or entry[0] != owner:
                raise unknown_handle(handle, field)
            self._drop(handle)

    def release_owner(self, owner: str) -> int:
        """Free every handle of `owner` (its connection went away); returns how many."""
        with self._lock:
            mine = [h for h, (o, _) in self._tensors.items() if o == owner]
            for handle in mine:
                self._drop(handle)
        return len(mine)

    def _drop(self, handle: str) -> None:
        _, tensor = self._tensors.pop(handle)
        self._bytes -= tensor.numel() * tensor.element_size()

    def usage(self) -> dict:
        with self._lock:
            return {"handles": len(self._tensors), "max_handles": self.max_handles,
                    "handle_bytes": self._bytes, "max_handle_bytes": self.max_bytes}
