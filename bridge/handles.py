"""Tensor handles: tensors uploaded once with `put` and named by `{"handle": id}` wherever a
request takes a tensor, so constants (A, D, dt_bias) cross the wire once.

A handle's tensor is the server's own copy on its device (request frames are pooled buffers that
are reused after the reply, bridge.buffers). A handle belongs to the connection that put it
(bridge.owned).
"""

from __future__ import annotations

import torch

from protocol import shown_value

from .errors import OpError
from .owned import OwnedTable


def unknown_handle(handle: str, field: str) -> OpError:
    return OpError("unknown_handle", f"{field}: no tensor handle {shown_value(handle)} is held for this connection",
                   {"field": field, "handle": handle})


class HandleTable(OwnedTable[torch.Tensor]):
    def __init__(self, *, max_handles: int, max_bytes: int):
        super().__init__(unknown_handle)
        self.max_handles = max_handles
        self.max_bytes = max_bytes
        self._bytes = 0

    def check_room(self, nbytes: int) -> None:
        """Raise limit_exceeded unless one more tensor of `nbytes` fits; called before the
        tensor is copied to the device."""
        with self._lock:
            self._check_room(nbytes)

    def _check_room(self, nbytes: int) -> None:
        self._refuse_past(self.max_handles, "put", "tensor handles", "--max-handles")
        if self._bytes + nbytes > self.max_bytes:
            raise OpError("limit_exceeded",
                          f"put: a tensor of {nbytes} bytes does not fit: {self._bytes} of "
                          f"{self.max_bytes} bytes are held (--max-handle-bytes)",
                          {"limit": "max_handle_bytes", "max": self.max_bytes, "in_use": self._bytes,
                           "requested": nbytes})

    def put(self, owner: str, tensor: torch.Tensor) -> str:
        """Hold `tensor` (which must be the server's own copy) for `owner`; returns its id."""
        nbytes = tensor.nbytes
        with self._lock:
            # Again, should puts ever run side by side: today ops run one at a time, and only a
            # closing connection can change the table meanwhile, which frees room.
            self._check_room(nbytes)
            handle_id, _ = self._add(owner, lambda _: tensor)
            self._bytes += nbytes
        return handle_id

    def _released(self, tensor: torch.Tensor) -> None:
        self._bytes -= tensor.nbytes

    def usage(self) -> dict:
        with self._lock:
            return {"handles": len(self), "max_handles": self.max_handles,
                    "handle_bytes": self._bytes, "max_handle_bytes": self.max_bytes}
