"""Sessions: SSM state kept on the server's device between requests, so that a client steps one
timestep at a time instead of resending its whole window.

State lives in pools, one per class -- a kind and its row shape: Mamba-1's [dim, state], Mamba-2's
(kind "ssd") [heads, headdim, state] -- each a [capacity, *row shape] fp32 tensor on the device
whose rows are handed out as slots. A session of `batch` rows owns `batch` slots (any
rows of its class's pool, not necessarily contiguous), and a step passes them to
`kernels.selective_state_update(..., slots=...)` (`kernels.ssd_state_update` for "ssd"); that is what lets steps of many sessions of one
class share a kernel launch (bridge.batcher).

A pool grows by doubling (one device copy of its rows; slot numbers stay valid) as far as the
pool-bytes limit allows, and is dropped when its last session closes. Every session belongs to
the connection that opened it (bridge.owned).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from .errors import OpError, allocation
from .owned import OwnedTable

# The state is kept and accumulated in fp32 whatever the dtype of the inputs (SPEC.md §6.1).
STATE_DTYPE = torch.float32


# A session's kind -> the names of its state row's axes (session_open's arguments).
ROW_AXES = {"mamba": ("dim", "state"), "ssd": ("heads", "headdim", "state")}


def state_row_bytes(shape: tuple[int, ...]) -> int:
    """Bytes of one row of state of that shape."""
    return math.prod(shape) * STATE_DTYPE.itemsize


def unknown_session(session_id: str, field: str) -> OpError:
    """The one error for a session that is not open on the asking connection (never issued,
    closed, or another connection's)."""
    return OpError("unknown_session", f"{field}: no session {session_id!r} is open on this connection",
                   {"field": field, "session": session_id})


class StatePool:
    """The rows of one class (kind, row shape) on the device, and which of them are free."""

    def __init__(self, kind: str, shape: tuple[int, ...], device: torch.device):
        self.kind = kind
        self.shape = shape
        self.row_bytes = state_row_bytes(shape)
        self.rows = torch.empty((0, *shape), dtype=STATE_DTYPE, device=device)
        self._free: list[int] = []  # kept sorted: low rows first, so sessions sit close together

    @property
    def capacity(self) -> int:
        return self.rows.shape[0]

    @property
    def free_rows(self) -> int:
        return len(self._free)

    @property
    def nbytes(self) -> int:
        return self.capacity * self.row_bytes

    def grow(self, capacity: int) -> None:
        old = self.rows
        self.rows = torch.empty((capacity, *self.shape), dtype=STATE_DTYPE, device=old.device)
        self.rows[: old.shape[0]].copy_(old)
        self._free.extend(range(old.shape[0], capacity))

    def take(self, count: int) -> list[int]:
        taken, self._free = self._free[:count], self._free[count:]
        return taken

    def give_back(self, slots: list[int]) -> None:
        self._free.extend(slots)
        self._free.sort()


class Session:
    """`batch` rows of state in `pool`, stepped together."""

    # __weakref__: the native step path (bridge.native) forgets what it kept of a session when
    # the session goes.
    __slots__ = ("id", "batch", "pool", "slot_list", "slots", "slot_bytes", "closed", "__weakref__")

    def __init__(self, session_id: str, batch: int, pool: StatePool, slot_list: list[int]):
        self.id = session_id
        self.batch = batch
        self.pool = pool
        self.slot_list = slot_list
        # The kernel's view of the same rows: [batch] int64 on the device, built once.
        self.slots = torch.tensor(slot_list, dtype=torch.int64, device=pool.rows.device)
        # And as int64 bytes on the host, which a captured step stages (bridge.step_graphs).
        self.slot_bytes = np.asarray(slot_list, dtype=np.int64).tobytes()
        # Set (under the table's lock) when closed; a batch already holding the session checks it
        # before its launch.
        self.closed = False

    @property
    def kind(self) -> str:
        return self.pool.kind

    @property
    def shape(self) -> tuple[int, ...]:
        """One row's state shape: [dim, state], or [heads, headdim, state] for kind "ssd"."""
        return self.pool.shape

    @property
    def dim(self) -> int:
        """Mamba-1's channels (the first axis of a row)."""
        return self.pool.shape[0]

    @property
    def state(self) -> int:
        return self.pool.shape[-1]

    def read(self) -> torch.Tensor:
        """A copy of the state, [batch, *shape] fp32."""
        return self.pool.rows.index_select(0, self.slots)

    def write(self, state: torch.Tensor) -> None:
        """Replace the state with `state` [batch, *shape] (any float dtype; stored as fp32)."""
        self.pool.rows.index_copy_(0, self.slots, state.to(STATE_DTYPE))


class SessionTable(OwnedTable[Session]):
    def __init__(self, device: torch.device, *, max_sessions: int, max_pool_bytes: int):
        super().__init__(unknown_session)
        self.device = device
        self.max_sessions = max_sessions
        self.max_pool_bytes = max_pool_bytes
        self._pools: dict[tuple, StatePool] = {}

    def open(self, owner: str, batch: int, kind: str, shape: tuple[int, ...]) -> Session:
        """A new session of `batch` rows whose state is zero. Limits are checked before anything
        is allocated."""
        with self._lock:
            if len(self) >= self.max_sessions:
                raise OpError("limit_exceeded",
                              f"session_open: at most {self.max_sessions} sessions may be open at once "
                              f"(--max-sessions), {len(self)} are",
                              {"limit": "max_sessions", "max": self.max_sessions, "open": len(self)})
            pool = self._pools.get((kind, shape))
            row_bytes = state_row_bytes(shape)
            missing = batch - (pool.free_rows if pool else 0)
            if missing > 0:
                in_use = self._pool_bytes()
                room = (self.max_pool_bytes - in_use) // row_bytes  # rows the budget still allows
                if missing > room:
                    requested = missing * row_bytes
                    detail = {"limit": "max_pool_bytes", "max": self.max_pool_bytes, "in_use": in_use}
                    if requested < 2**64:  # what a msgpack uint holds; the message has it anyway
                        detail["requested"] = requested
                    raise OpError(
                        "limit_exceeded",
                        f"session_open: {batch} rows of {list(shape)} fp32 state need "
                        f"{requested} more bytes of state pool; {in_use} of "
                        f"{self.max_pool_bytes} are in use (--max-pool-bytes)", detail)
                grown = pool if pool is not None else StatePool(kind, shape, self.device)
                # Double when the budget allows, so that n opens cost O(log n) pool copies.
                with allocation("session_open"):
                    grown.grow(grown.capacity + max(missing, min(grown.capacity, room)))
                # Kept only once it holds rows: a pool whose growth failed would hold no session
                # that could ever close it.
                pool = self._pools[(kind, shape)] = grown
            slots = pool.take(batch)
            try:
                with allocation("session_open"):
                    _, session = self._add(owner, lambda session_id: Session(session_id, batch, pool, slots))
            except BaseException:
                self._give_back(pool, slots)
                raise
            pool.rows.index_fill_(0, session.slots, 0.0)
            return session

    def _released(self, session: Session) -> None:
        session.closed = True
        self._give_back(session.pool, session.slot_list)

    def _give_back(self, pool: StatePool, slots: list[int]) -> None:
        pool.give_back(slots)
        if pool.free_rows == pool.capacity:  # its last session: give the device memory back
            del self._pools[(pool.kind, pool.shape)]

    def _pool_bytes(self) -> int:
        return sum(pool.nbytes for pool in self._pools.values())

    def usage(self) -> dict:
        with self._lock:
            return {
                "sessions": len(self),
                "max_sessions": self.max_sessions,
                "pool_bytes": self._pool_bytes(),
                "max_pool_bytes": self.max_pool_bytes,
                "pools": [{"kind": p.kind, **dict(zip(ROW_AXES[p.kind], p.shape)), "capacity": p.capacity,
                           "rows_in_use": p.capacity - p.free_rows} for p in self._pools.values()],
            }
