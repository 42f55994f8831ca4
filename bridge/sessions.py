"""Sessions: SSM state kept on the server's device between requests, so that a client steps one
timestep at a time instead of resending its whole window.

State lives in pools, one per class of session (a `StateLayout`): Mamba-1's kind "mamba" holds
one part [dim, state] a row, Mamba-2's "ssd" one part [heads, headdim, state], and a model's
sessions (kind "model", one class per loaded model) every layer's conv and ssm state. Each part is
a [capacity, *part shape] fp32 tensor on the device whose rows are handed out as slots. A session of `batch` rows owns `batch` slots (any
rows of its class's pool, not necessarily contiguous), and a step passes them to
`scan_kernels.selective_state_update(..., slots=...)` (`scan_kernels.ssd_state_update` for "ssd"); that is what lets steps of many sessions of one
class share a kernel launch (bridge.batcher).

A pool grows by doubling (one device copy of its rows; slot numbers stay valid) as far as the
pool-bytes limit allows, gives back the free rows at its end when at most a quarter of it is in
use or the budget is short (at the next session open or snapshot), and is dropped when its last
session closes. Every session belongs to
the connection that opened it (bridge.owned).

Snapshots are copies of a session's rows (every part), kept on the device and owned like
sessions; they, and loaded models' weights, are held against the same pool-bytes budget.

A step or prefill writes its sessions' rows in place, layer after layer, and a restore copies a
snapshot's rows over them: one that fails partway leaves them neither the state before nor after
it. The ops run that work in `WritingState`, which marks such sessions lost; a lost session is
refused (`state_lost`) by every op that reads or advances its state until a restore overwrites
the whole of it, or it is closed. A copy into a snapshot (a model step's snapshot_into) that
fails partway leaves the snapshot undefined instead, and so does a request whose frames copied
into it and then failed (bridge.ops.sessions.run_frames); restores from it are refused
(`state_lost`, naming the snapshot) until a copy into it completes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from protocol import shown_value

from .errors import OpError, allocation, error_fields, is_out_of_memory
from .owned import OwnedTable

# The state is kept and accumulated in fp32 whatever the dtype of the inputs (SPEC.md §6.1).
STATE_DTYPE = torch.float32


# The largest whole-state copy on the CPU made on the serving thread (numpy) rather than by
# torch's thread team: below it waking the team costs more than it saves, above it two threads
# copy faster (docs/performance.md, "state copies").
ONE_THREAD_COPY_BYTES = 1 << 20

# A session's kind -> the names of its state row's axes (session_open's arguments).
ROW_AXES = {"mamba": ("dim", "state"), "ssd": ("heads", "headdim", "state")}


def state_row_bytes(shape: tuple[int, ...]) -> int:
    """Bytes of one row of state of that shape."""
    return math.prod(shape) * STATE_DTYPE.itemsize


# The part of a one-part layout (kinds "mamba" and "ssd").
STATE_PART = "state"


@dataclass(frozen=True)
class StateLayout:
    """What one row of a class of sessions holds: named fp32 parts, each of a shape. Sessions of
    equal layouts share a pool (and steps of them a launch); `model` keeps two models' pools
    apart even where their shapes agree."""

    kind: str
    parts: tuple[tuple[str, tuple[int, ...]], ...]
    model: str | None = None

    @classmethod
    def single(cls, kind: str, shape: tuple[int, ...]) -> StateLayout:
        return cls(kind, ((STATE_PART, tuple(shape)),))

    @property
    def row_bytes(self) -> int:
        return sum(state_row_bytes(shape) for _, shape in self.parts)

    def split(self, rows: torch.Tensor) -> dict[str, torch.Tensor]:
        """Each part of `rows` [n, row floats] laid out this way, as a view [n, *part shape]."""
        parts, offset = {}, 0
        for name, shape in self.parts:
            size = math.prod(shape)
            parts[name] = rows[:, offset:offset + size].unflatten(1, shape)
            offset += size
        return parts

    @property
    def shape(self) -> tuple[int, ...]:
        """The row shape of a one-part layout."""
        (_, shape), = self.parts
        return shape


def unknown_session(session_id: str, field: str) -> OpError:
    """The one error for a session that is not open on the asking connection (never issued,
    closed, or another connection's)."""
    return OpError("unknown_session", f"{field}: no session {shown_value(session_id)} is open on this connection",
                   {"field": field, "session": session_id})


def state_lost(session_id: str, field: str) -> OpError:
    """The one error for a session whose state a failed step, prefill or restore left undefined."""
    return OpError("state_lost",
                   f"{field}: session {session_id!r} has no defined state: a step, prefill or restore failed "
                   "partway and left it undefined; restore a snapshot into it (session_restore) or close it",
                   {"field": field, "session": session_id})


class StatePool:
    """The rows of one class (a StateLayout) on the device, and which of them are free. All parts
    of a row lie together in one [capacity, row floats] tensor, each part a view of its columns,
    so that copying a session's whole state (a snapshot, a restore, a fork) is one op."""

    def __init__(self, layout: StateLayout, device: torch.device):
        self.layout = layout
        self.kind = layout.kind
        self.row_bytes = layout.row_bytes
        self.device = device
        self._set_rows(torch.empty((0, layout.row_bytes // STATE_DTYPE.itemsize), dtype=STATE_DTYPE, device=device))
        # Low rows first, so that sessions sit close together: sorted when read, not at each
        # give_back (a connection's close gives back each of its sessions' rows in turn).
        self._free: list[int] = []
        self._free_unsorted = False

    def _set_rows(self, flat: torch.Tensor) -> None:
        self.flat = flat
        self.capacity = flat.shape[0]
        self.parts = self.layout.split(flat)

    @property
    def shape(self) -> tuple[int, ...]:
        """One row's shape in a one-part pool (kinds "mamba", "ssd")."""
        return self.layout.shape

    @property
    def rows(self) -> torch.Tensor:
        """The one part of a one-part pool, [capacity, *shape] (contiguous); replaced when the
        pool grows."""
        return self.parts[STATE_PART]

    @property
    def free_rows(self) -> int:
        return len(self._free)

    @property
    def nbytes(self) -> int:
        return self.capacity * self.row_bytes

    def grow(self, capacity: int) -> None:
        old = self.flat
        flat = torch.empty((capacity, old.shape[1]), dtype=STATE_DTYPE, device=self.device)
        flat[: old.shape[0]].copy_(old)
        self._free.extend(range(old.shape[0], capacity))
        self._set_rows(flat)

    def _sorted_free(self) -> list[int]:
        if self._free_unsorted:
            self._free.sort()
            self._free_unsorted = False
        return self._free

    def rows_to_keep(self) -> int:
        """The capacity the rows in use need where they stay where they are: one past the last."""
        end = self.capacity
        for slot in reversed(self._sorted_free()):  # the free rows at the end come last
            if slot != end - 1:
                break
            end = slot
        return end

    def shrink(self, capacity: int) -> None:
        """Drop the rows from `capacity` on, all free (rows_to_keep): one copy of the rest, whose
        slot numbers stay valid, as a growth's do."""
        self._set_rows(self.flat[:capacity].clone())
        self._free = [slot for slot in self._free if slot < capacity]

    def take(self, count: int) -> list[int]:
        free = self._sorted_free()
        taken, self._free = free[:count], free[count:]
        return taken

    def give_back(self, slots: list[int]) -> None:
        self._free.extend(slots)
        self._free_unsorted = True


class Session:
    """`batch` rows of state in `pool`, stepped together.

    Whole-state copies (snapshot, restore, fork) on the CPU of at most ONE_THREAD_COPY_BYTES go
    through numpy, on the calling thread: for a session's few rows, waking ATen's thread team,
    asleep between requests, costs several times the copy (docs/performance.md, "state copies")."""

    # __weakref__: the native step path (bridge.native) forgets what it kept of a session when
    # the session goes.
    __slots__ = ("id", "batch", "pool", "slot_list", "slots", "slot_bytes", "span", "closed", "lost",
                 "__weakref__")

    def __init__(self, session_id: str, batch: int, pool: StatePool, slot_list: list[int]):
        self.id = session_id
        self.batch = batch
        self.pool = pool
        self.slot_list = slot_list
        # The kernel's view of the same rows: [batch] int64 on the device, built once.
        self.slots = torch.tensor(slot_list, dtype=torch.int64, device=pool.device)
        # And as int64 bytes on the host, which a captured step stages (bridge.step_graphs).
        self.slot_bytes = np.asarray(slot_list, dtype=np.int64).tobytes()
        # Consecutive rows (the usual case) as a slice: copying a slice of the pool is a plain
        # memory copy, where index_select / index_copy_ go element by element.
        first = slot_list[0] if slot_list else 0
        self.span = slice(first, first + batch) if slot_list == list(range(first, first + batch)) else None
        # Set (under the table's lock) when closed; a batch already holding the session checks it
        # before its launch.
        self.closed = False
        # Set when a step, prefill or restore failed while writing the rows (lose_state); cleared
        # when the whole state is written again (write_rows).
        self.lost = False

    @property
    def kind(self) -> str:
        return self.pool.kind

    @property
    def layout(self) -> StateLayout:
        return self.pool.layout

    @property
    def nbytes(self) -> int:
        """Bytes of the whole state (every part of its rows)."""
        return self.batch * self.pool.row_bytes

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
        """Replace the state with `state` [batch, *shape] (any float dtype, on any device; stored
        as fp32 on the pool's)."""
        self.pool.rows.index_copy_(0, self.slots, state.to(device=self.pool.rows.device, dtype=STATE_DTYPE))

    def read_rows(self) -> torch.Tensor:
        """A copy of the whole state, [batch, row floats] fp32 (every part, as the pool lays them out)."""
        flat = self.pool.flat
        if self._one_thread_copy:
            host = flat.numpy()
            rows = host[self.span].copy() if self.span is not None else host.take(self.slot_list, axis=0)
            return torch.from_numpy(rows)
        if self.span is not None:
            return flat[self.span].clone()
        return flat.index_select(0, self.slots)

    def read_rows_into(self, rows: torch.Tensor) -> None:
        """Copy the whole state into `rows`, a tensor read_rows gave (of a session of the same
        layout and batch): a snapshot taken again without a new allocation. (read_rows does not
        call this: its numpy allocation is cheaper than a torch one filled through a view.)"""
        flat = self.pool.flat
        if self._one_thread_copy:
            host = flat.numpy()
            out = rows.numpy()
            if self.span is not None:
                np.copyto(out, host[self.span])
            else:
                host.take(self.slot_list, axis=0, out=out)
        elif self.span is not None:
            rows.copy_(flat[self.span])
        else:
            torch.index_select(flat, 0, self.slots, out=rows)

    def write_rows(self, rows: torch.Tensor) -> None:
        """Replace the whole state with what read_rows gave (of a session of the same layout):
        a defined state again, whatever a failed step left."""
        flat = self.pool.flat
        if self._one_thread_copy:
            flat.numpy()[self.span if self.span is not None else self.slot_list] = rows.numpy()
        elif self.span is not None:
            flat[self.span].copy_(rows)
        else:
            flat.index_copy_(0, self.slots, rows)
        self.lost = False

    @property
    def _one_thread_copy(self) -> bool:
        return self.pool.device.type == "cpu" and self.nbytes <= ONE_THREAD_COPY_BYTES

    def read_parts(self) -> dict[str, torch.Tensor]:
        """A copy of every part, [batch, *part shape] fp32 each (views of one copy)."""
        return self.layout.split(self.read_rows())

    def write_parts(self, parts: dict[str, torch.Tensor]) -> None:
        """Replace every part (shapes already checked; any float dtype on any device, stored as
        fp32 on the pool's)."""
        for name, part in self.pool.parts.items():
            part.index_copy_(0, self.slots, parts[name].to(device=part.device, dtype=STATE_DTYPE))


class StateLost(OpError):
    """The error of a call that failed while writing sessions' state (lose_state): the call's
    own code, message and detail, the detail adding `state: "lost"` and the sessions' ids."""

    def __init__(self, cause: BaseException, sessions: list[Session]):
        code, message, detail = error_fields(cause)
        ids = [session.id for session in sessions]
        super().__init__(code, f"{message}; it left the state of session {', '.join(map(repr, ids))} undefined "
                               "(state_lost until a session_restore)", {**detail, "state": "lost", "sessions": ids})
        self.cause = cause
        # Chained even where it is not raised (`of`): the server's log of an internal error
        # then shows where the failure itself happened.
        self.__cause__ = cause
        self.sessions = sessions

    def of(self, session: Session) -> BaseException:
        """The error as the request on `session` sees it (one of a batch): naming that session
        alone where the call had begun writing its state, else the call's own error."""
        return StateLost(self.cause, [session]) if session in self.sessions else self.cause


def lose_state(cause: BaseException, sessions: list[Session]) -> StateLost:
    """Mark `sessions` lost, a call writing their rows having raised `cause`; the error to
    raise instead."""
    for session in sessions:
        session.lost = True
    return StateLost(cause, list(sessions))


class WritingState:
    """Around a call that writes `sessions`' rows in place (layer after layer, session after
    session): where it raises, they are lost (lose_state). The list is read then, so a call may
    add each session as it begins writing it. `unwritten`: what the call raises only before it
    writes anything (a kernel's argument checks), passed on as it is. A class, not a generator:
    a step pays for it on every call."""

    __slots__ = ("sessions", "unwritten")

    def __init__(self, sessions: list[Session], unwritten: tuple[type[Exception], ...] = ()):
        self.sessions = sessions
        self.unwritten = unwritten

    def __enter__(self) -> None:
        pass

    def __exit__(self, kind, exc, traceback) -> bool:
        if isinstance(exc, Exception) and not isinstance(exc, self.unwritten) and self.sessions:
            raise lose_state(exc, self.sessions) from exc
        return False


# What the bytes held against the pool budget beside the pools are, as a refusal names them.
HELD_DESCRIPTIONS = {"models": "the model's weights", "snapshots": "the snapshot's rows"}


class SessionTable(OwnedTable[Session]):
    def __init__(self, device: torch.device, *, max_sessions: int, max_pool_bytes: int):
        super().__init__(unknown_session)
        self.device = device
        self.max_sessions = max_sessions
        self.max_pool_bytes = max_pool_bytes
        self._pools: dict[StateLayout, StatePool] = {}
        # Bytes held against the same budget by what is not a pool: loaded models' weights,
        # session snapshots.
        self._held = {"models": 0, "snapshots": 0}

    def open(self, owner: str, batch: int, layout: StateLayout, op: str = "session_open") -> Session:
        """A new session of `batch` rows whose state is zero, for the request `op` (named by a
        refusal). Limits are checked before anything is allocated."""
        with self._lock:
            if len(self) >= self.max_sessions:
                raise OpError("limit_exceeded",
                              f"{op}: at most {self.max_sessions} sessions may be open at once "
                              f"(--max-sessions), {len(self)} are",
                              {"limit": "max_sessions", "max": self.max_sessions, "open": len(self)})
            pool = self._pools.get(layout)
            row_bytes = layout.row_bytes
            missing = batch - (pool.free_rows if pool else 0)
            self._shrink_pools(max(missing, 0) * row_bytes, op, keep=layout)
            if missing > 0:
                room = (self.max_pool_bytes - self._pool_bytes()) // row_bytes  # rows the budget still allows
                if missing > room:
                    what = (f"{list(layout.shape)} fp32 state" if len(layout.parts) == 1
                            else f"{row_bytes}-byte model state")
                    self._refuse(op, f"{batch} rows of {what}", missing * row_bytes)
                grown = pool if pool is not None else StatePool(layout, self.device)
                # Double when the budget allows, so that n opens cost O(log n) pool copies; where
                # the machine has no memory for the doubling, only what this open needs.
                with allocation(op):
                    try:
                        grown.grow(grown.capacity + max(missing, min(grown.capacity, room)))
                    except Exception as exc:
                        if not is_out_of_memory(exc) or min(grown.capacity, room) <= missing:
                            raise
                        grown.grow(grown.capacity + missing)
                # Kept only once it holds rows: a pool whose growth failed would hold no session
                # that could ever close it.
                pool = self._pools[layout] = grown
            slots = pool.take(batch)
            try:
                with allocation(op):
                    _, session = self._add(owner, lambda session_id: Session(session_id, batch, pool, slots))
            except BaseException:
                self._give_back(pool, slots)
                raise
            pool.flat.index_fill_(0, session.slots, 0.0)
            return session

    def _shrink_pools(self, needed: int, op: str, keep: StateLayout | None = None) -> None:
        """Give back the free rows at the end of pools (a pool doubles, and is otherwise kept
        whole until its last session closes, so that one session left after a burst held the
        burst's rows, and the budget they took): those of a pool at most a quarter in use, or of
        every pool while the budget lacks `needed` bytes; not `keep`'s, about to take rows. Moves
        no row, but replaces pools' tensors: only an op may call it (they run one at a time,
        Dispatcher._serving), never a load running beside them."""
        in_use = self._pool_bytes()  # kept up to date here: summed again per pool, a look cost O(pools²)
        for pool in list(self._pools.values()):
            short = needed > self.max_pool_bytes - in_use
            if pool.layout == keep or not (short or pool.free_rows * 4 >= 3 * pool.capacity):
                continue
            end = pool.rows_to_keep()
            if end < pool.capacity and (short or end * 4 <= pool.capacity):
                before = pool.nbytes
                with allocation(op):
                    pool.shrink(end)
                in_use -= before - pool.nbytes

    def hold(self, what: str, nbytes: int, op: str, *, from_op: bool = False) -> None:
        """Count `nbytes` of `what` ("models", "snapshots") against --max-pool-bytes, or raise
        limit_exceeded when they do not fit; called before they are allocated. `from_op`: called
        by an op, which may shrink pools (_shrink_pools) to make room."""
        with self._lock:
            if from_op:
                self._shrink_pools(nbytes, op)
            if nbytes > self.max_pool_bytes - self._pool_bytes():
                self._refuse(op, HELD_DESCRIPTIONS[what], nbytes)
            self._held[what] += nbytes

    def unhold(self, what: str, nbytes: int) -> None:
        with self._lock:
            self._held[what] -= nbytes

    def _refuse(self, op: str, what: str, requested: int):
        in_use = self._pool_bytes()
        detail = {"limit": "max_pool_bytes", "max": self.max_pool_bytes, "in_use": in_use}
        if requested < 2**64:  # what a msgpack uint holds; the message has it anyway
            detail["requested"] = requested
        raise OpError("limit_exceeded",
                      f"{op}: {what} need {requested} more bytes of state pool; {in_use} of "
                      f"{self.max_pool_bytes} are in use (--max-pool-bytes)", detail)

    def of_model(self, model_id: str) -> int:
        """How many open sessions hold a model's state."""
        with self._lock:
            return sum(1 for _, session in self._entries.values() if session.layout.model == model_id)

    def _released(self, session: Session) -> None:
        session.closed = True
        self._give_back(session.pool, session.slot_list)

    def _give_back(self, pool: StatePool, slots: list[int]) -> None:
        pool.give_back(slots)
        if pool.free_rows == pool.capacity:  # its last session: give the device memory back
            del self._pools[pool.layout]

    def _pool_bytes(self) -> int:
        return sum(pool.nbytes for pool in self._pools.values()) + sum(self._held.values())

    def usage(self) -> dict:
        with self._lock:
            return {
                "sessions": len(self),
                "max_sessions": self.max_sessions,
                "pool_bytes": self._pool_bytes(),
                "max_pool_bytes": self.max_pool_bytes,
                "model_bytes": self._held["models"],
                "snapshot_bytes": self._held["snapshots"],
                "pools": [_pool_usage(p) for p in self._pools.values()],
            }


def _pool_usage(pool: StatePool) -> dict:
    shape = (dict(zip(ROW_AXES[pool.kind], pool.shape)) if pool.kind in ROW_AXES
             else {"model": pool.layout.model, "row_bytes": pool.row_bytes})
    return {"kind": pool.kind, **shape, "capacity": pool.capacity, "rows_in_use": pool.capacity - pool.free_rows}


def unknown_snapshot(snapshot_id: str, field: str) -> OpError:
    return OpError("unknown_snapshot", f"{field}: no snapshot {shown_value(snapshot_id)} is held for this connection",
                   {"field": field, "snapshot": snapshot_id})


# Why a snapshot holds no defined state (Snapshot.undefined_why).
COPY_FAILED = "a model_step's copy into it (snapshot_into) failed partway"
FRAMES_FAILED = ("a frame of a request that then failed copied into it (snapshot_into): the state it took "
                 "was undone")


def snapshot_undefined(snapshot_id: str, field: str, why: str) -> OpError:
    """The error of a restore from a snapshot left undefined, `why` saying what left it so."""
    return OpError("state_lost",
                   f"{field}: snapshot {snapshot_id!r} has no defined state: {why}; step into it again "
                   "(snapshot_into) or take a new one",
                   {"field": field, "snapshot": snapshot_id})


class Snapshot:
    """A copy of a session's every part at one moment: restorable into any session of the same
    layout and batch (the session it came from, or a fork of it). `undefined_why` says why it
    holds no defined state, None while it does: a copy into it failed partway and left it part
    one state, part another (take_again), or the request whose frame copied into it failed;
    `copies_begun` counts the copies into it, so that a request can tell which of its snapshots
    its frames wrote."""

    __slots__ = ("layout", "batch", "rows", "nbytes", "undefined_why", "copies_begun")

    def __init__(self, session: Session):
        self.layout = session.layout
        self.batch = session.batch
        self.rows = session.read_rows()
        self.nbytes = session.nbytes
        self.undefined_why: str | None = None
        self.copies_begun = 0

    @property
    def defined(self) -> bool:
        return self.undefined_why is None

    def is_like(self, session: Session) -> bool:
        """Whether `session` has this snapshot's model or state shape, and batch: one it can be
        restored into, or taken again from."""
        return self.layout == session.layout and self.batch == session.batch

    def take_again(self, session: Session) -> None:
        """Hold `session`'s state now, in the same memory (a session like the one it came from:
        SnapshotTable.of_session_like). Raising, it may have written some rows: it is left
        undefined until a copy into it completes."""
        self.copies_begun += 1
        self.undefined_why = COPY_FAILED
        session.read_rows_into(self.rows)
        self.undefined_why = None


class SnapshotTable(OwnedTable[Snapshot]):
    """Snapshots, each held against the sessions' pool budget."""

    def __init__(self, sessions: SessionTable, *, max_snapshots: int):
        super().__init__(unknown_snapshot)
        self.sessions = sessions
        # A count apart from the bytes: a snapshot of a small session costs the host more than
        # the rows it holds against the pool.
        self.max_snapshots = max_snapshots

    def take(self, owner: str, session: Session) -> str:
        with self._lock:
            self._refuse_past(self.max_snapshots, "session_snapshot", "snapshots", "--max-snapshots")
        nbytes = session.nbytes
        self.sessions.hold("snapshots", nbytes, "session_snapshot", from_op=True)
        try:
            with allocation("session_snapshot"):
                snapshot = Snapshot(session)
            with self._lock:
                self._refuse_past(self.max_snapshots, "session_snapshot", "snapshots", "--max-snapshots")
                snapshot_id, _ = self._add(owner, lambda _: snapshot)
        except BaseException:
            self.sessions.unhold("snapshots", nbytes)
            raise
        return snapshot_id

    def restore(self, owner: str, snapshot_id: str, session: Session, field: str) -> None:
        snapshot = self.of_session_like(owner, snapshot_id, session, field)
        if not snapshot.defined:
            raise snapshot_undefined(snapshot_id, field, snapshot.undefined_why)
        # A copy failing partway leaves some rows the snapshot's and some what they were.
        with WritingState([session]):
            session.write_rows(snapshot.rows)

    def of_session_like(self, owner: str, snapshot_id: str, session: Session, field: str) -> Snapshot:
        """The owner's snapshot `snapshot_id`, checked to be one of a session like `session` (its
        model or state shape, and batch): one it can be restored into, or taken again from."""
        snapshot = self.get(owner, snapshot_id, field)
        if not snapshot.is_like(session):
            raise OpError("invalid_argument",
                          f"{field}: expected a snapshot of a session like args.session (its model or state "
                          f"shape, batch {session.batch}), got one of another",
                          {"field": field, "expected": f"a snapshot of {_describe(session.layout, session.batch)}",
                           "got": f"a snapshot of {_describe(snapshot.layout, snapshot.batch)}"})
        return snapshot

    def drop_model(self, model_id: str) -> None:
        """Free every snapshot of a model's sessions (the model is being freed)."""
        with self._lock:
            emptied = [self._remove(snapshot_id)
                       for snapshot_id in [i for i, (_, s) in self._entries.items() if s.layout.model == model_id]]
        self._tell_emptied(emptied)

    def _released(self, snapshot: Snapshot) -> None:
        self.sessions.unhold("snapshots", snapshot.nbytes)


def _describe(layout: StateLayout, batch: int) -> str:
    what = f"model {layout.model}" if layout.model is not None else f"kind {layout.kind} {list(layout.shape)}"
    return f"{what}, batch {batch}"
