"""A seeded random walk over one server's sessions, snapshots and models (hypothesis's stateful
testing), against a plain model of what each connection holds.

An in-process server (tests/bridge_fakes.py) with small --max-sessions / --max-pool-bytes
limits, drawn per run, and three connections. Rules open plain Mamba-1 and Mamba-2 sessions (from
zero or an h0) and sessions of two tiny models (loaded and freed as rules too), step and prefill
them (return_state sometimes, a model step's snapshot_into too), open and restore with `frames`
(a frame that fails when it runs, or one the decoder refuses, somewhere among them; model steps
copying into snapshots), snapshot, restore, fork, close, free, read states, roll a model session
back (a ring of its snapshots, one restored with frames copying into the others, or into itself:
refused), and close a whole connection; steps of several sessions (one of them twice, say)
queued together so that they share launches; and requests whose state writes fail partway (out
of memory, injected): a step, a restore's copy, a frame of session_open or session_restore, a
model step's copy into a snapshot. Each rule draws valid and sometimes invalid arguments: another
connection's ids, ids never issued, a session of the wrong kind, a row too many, a snapshot of
another shape.

The oracle:
- every reply is the one SPEC.md says: a success, or exactly the error code (and field, or limit)
  the situation has (§6.1, §6.4, §7), never internal_error; limit_exceeded exactly where the
  usage the server reported before the request leaves no room, counting the free rows at the
  pools' ends that an open or a snapshot gives back (§6.1);
- a plain session's outputs and state follow the float64 reference kernels (scan_kernels.reference)
  within the inputs' dtype's tolerance; a model session's state is known where it was read
  (session_state, return_state) and every copy of it (snapshot, restore, fork) reads back bit
  for bit; a model op run again from the same state on the same input gives the same output and
  state bit for bit (a re-simulation after a restore);
- a session is lost (refused `state_lost` by every op that reads or advances it) exactly after a
  step or a restore's copy failed partway, until a restore; a frame failing so is undone, and
  its error says nothing was lost; a snapshot a failed copy left undefined, or one a frame
  copied into before its request failed, is refused by restores until a copy into it completes;
- after every rule, `stats`' sessions section (sessions, pools and their rows in use, model and
  snapshot bytes, pool bytes within the budget) equals what the model holds, and so do the
  server's tables (each session's lost flag too); its counts (each op's successes, failures and
  inferences, a frame's under its own op; errors by code) equal the replies'; a closed
  connection releases what it owned;
- at teardown, closing everything leaves nothing held.

CI runs a few short walks. A longer run:

    SCAN_BRIDGE_WALK_EXAMPLES=2000 .venv/bin/pytest -q -p no:cacheprovider tests/test_state_walk.py

(SCAN_BRIDGE_WALK_STEPS sets the rules per walk, 40 by default; `--hypothesis-show-statistics`
shows how often each op met each outcome.)
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
import os
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from unittest import mock

import torch
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

import scan_kernels
from bridge.client import result_from_wire
from bridge.models.config import parse_config
from bridge.models.runtime import Model
from bridge.sessions import Session
from bridge_fakes import InProcessServer, RecordingConnection
from kernel_cases import STATE_TOLERANCE, assert_close
from scan_kernels.reference import selective_scan_ref, selective_state_update_ref, ssd_scan_ref, ssd_state_update_ref
from test_return_state import D_MODEL, MODEL_CONFIGS, tiny_weights, uniform

EXAMPLES = int(os.environ.get("SCAN_BRIDGE_WALK_EXAMPLES", "0"))
STEPS = int(os.environ.get("SCAN_BRIDGE_WALK_STEPS", "40"))
CONNECTIONS = 3

# Plain sessions' row shapes: Mamba-1 [dim, state] (two, so that there are two pools), Mamba-2
# [heads, headdim, state].
MAMBA_SHAPES = ((4, 3), (6, 4))
SSD_SHAPE = (2, 3, 4)
SEQ = 3
# One model of each architecture: weights fixed, so that a model loaded again is the same.
WEIGHTS = {arch: tiny_weights(arch, torch.Generator().manual_seed(7)) for arch in MODEL_CONFIGS}
PARTS = {arch: parse_config(config).state_parts() for arch, config in MODEL_CONFIGS.items()}
STEP_DTYPES = (torch.float32, torch.float32, torch.float64, torch.bfloat16)

# A model op's input seeds come from a small set, so that one run again from a state it ran
# from before (after a restore, on a fork) is drawn often.
MODEL_INPUTS = st.integers(0, 3)
# Which entry a rule names: mostly one of a kind it takes (below MOSTLY), NEVER an id never issued.
NEVER, MOSTLY = 15, 12
PICK = st.integers(0, NEVER)
# Who names it: its owner, or another connection (FOREIGN) one time in eight.
FOREIGN = 7
ASKER = st.integers(0, FOREIGN)
CONN = st.integers(0, CONNECTIONS - 1)
SEED = st.integers(0, 1 << 16)


@dataclass(eq=False)
class Value:
    """A state some session held: `expected`, a plain session's by the float64 reference (None
    for a model's); `exact`, as the server gave it once read (a tensor, or a model's parts by
    name), shared by every session and snapshot holding a copy; `after`, a model op's (output,
    Value) by its input, for a re-run from this state."""

    expected: torch.Tensor | None
    exact: object = None
    after: dict = field(default_factory=dict)


@dataclass(eq=False)
class Held:
    """A session or a snapshot: its owner (a connection's index), class and rows, and state."""

    id: str
    conn: int
    layout: tuple  # ("mamba", (dim, state)), ("ssd", (heads, headdim, state)) or ("model", model id)
    batch: int
    row_bytes: int
    value: Value
    # A request failed partway through writing its state: a step or a restore (a session's), a
    # model step's copy into it (a snapshot's, then undefined).
    lost: bool = False

    @property
    def kind(self) -> str:
        return self.layout[0]

    @property
    def nbytes(self) -> int:
        return self.batch * self.row_bytes


@dataclass
class Planned:
    """A request planned on what the model holds: its connection, op and arguments, the check
    of its reply (run once the replies before it are checked), and the session it names."""

    conn: int
    op: str
    args: dict
    check: object
    held: Held | None
    snapshot: Held | None = None  # a restore's, or a model step's snapshot_into


@dataclass
class Frames:
    """A request's frames as sent (`wire`) and, for each, (op, args, its model op's memo key, the
    snapshot its snapshot_into names: None for none or one never taken); `spoiled`: the index of a
    bad one, `bad` how ("rows", "garbled"), `name` the input it spoils (x or embeds)."""

    wire: list
    oracle: list
    name: str
    spoiled: int | None = None
    bad: str | None = None


@dataclass(eq=False)
class Loaded:
    id: str
    conn: int
    arch: str
    weight_bytes: int
    row_bytes: int


def plain_row_bytes(shape: tuple) -> int:
    return 4 * math.prod(shape)  # fp32


def plain_inputs(kind: str, shape: tuple, batch: int, seed: int, *, seq: int | None = None,
                 dtype=torch.float32, options: tuple = (), groups: int = 1, constants: int | None = None) -> dict:
    """A step's (seq None) or a prefill's arguments for a plain session; `options` among D, z,
    dt_bias, dt_softplus. Per-row inputs in `dtype`, the constants (A, D, dt_bias) fp32, drawn
    from `constants` where given (steps of one class that share them may share a launch)."""
    gen = torch.Generator().manual_seed(seed)
    fixed = gen if constants is None else torch.Generator().manual_seed(constants)
    lead = (batch,) if seq is None else (batch, seq)
    if kind == "mamba":
        dim, n = shape
        channels, per_channel, dt_shape, a_shape = (dim,), (dim,), (*lead, dim), (dim, n)
    else:
        heads, headdim, n = shape
        channels, per_channel, dt_shape, a_shape = (heads, headdim), (heads,), (*lead, heads), (heads,)
    bc = (*lead, groups, n) if groups > 1 or kind == "ssd" else (*lead, n)
    args = {"x": torch.randn(*lead, *channels, generator=gen), "dt": uniform(gen, dt_shape, 0.05, 0.5),
            "A": -uniform(fixed, a_shape, 0.1, 2.0), "B": torch.randn(*bc, generator=gen),
            "C": torch.randn(*bc, generator=gen)}
    if "D" in options:
        args["D"] = torch.randn(*per_channel, generator=fixed)
    if "z" in options:
        args["z"] = torch.randn(*lead, *channels, generator=gen)
    if "dt_bias" in options:
        args["dt_bias"] = uniform(fixed, per_channel, -0.2, 0.2)
    if "dt_softplus" in options:
        args["dt_softplus"] = True
    for name in ("x", "dt", "B", "C", "z"):
        if name in args:
            args[name] = args[name].to(dtype)
    return args


def reference(kind: str, state: torch.Tensor, args: dict, prefill: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, the state after) by the float64 reference, from `state` [batch, *row]."""
    tensors = {k: v for k, v in args.items() if k not in ("return_state",)}
    if prefill:
        scan = selective_scan_ref if kind == "mamba" else ssd_scan_ref
        return scan(**tensors, h0=state, return_state=True, compute_dtype=torch.float64)
    state = state.clone()
    update = selective_state_update_ref if kind == "mamba" else ssd_state_update_ref
    return update(state, **tensors, compute_dtype=torch.float64), state


def model_input(batch: int, seed: int, seq: int | None) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 + seed)
    return torch.randn(batch, *(() if seq is None else (seq,)), D_MODEL, generator=gen)


def same_state(got, expected, what: str) -> None:
    if isinstance(expected, dict):
        assert sorted(got) == sorted(expected), f"{what}: parts {sorted(got)}"
        for name in expected:
            same_state(got[name], expected[name], f"{what} {name}")
        return
    assert got.dtype == torch.float32 and torch.equal(got, expected), f"{what}: differs bit for bit"


@contextlib.contextmanager
def failing_writes(layout: tuple, succeeding: int):
    """The state writes of steps of `layout`'s class (a plain step's kernel, a model's step)
    run, then fail as out of memory, after `succeeding` calls that do not."""
    if layout[0] == "model":
        owner, name = Model, "step"
    else:
        owner, name = scan_kernels, "ssd_state_update" if layout[0] == "ssd" else "selective_state_update"
    original = getattr(owner, name)
    calls = itertools.count()

    def failing_after_writing(*args, **kwargs):
        result = original(*args, **kwargs)
        if next(calls) >= succeeding:
            raise MemoryError("injected: no memory left after the state was written")
        return result

    with mock.patch.object(owner, name, failing_after_writing):
        yield


WRITE_ROWS = Session.write_rows


def write_rows_failing_after_the_first_row(session: Session, rows: torch.Tensor) -> None:
    """A restore's copy that writes the first row, then fails as out of memory."""
    first = session.read_rows()
    first[:1] = rows[:1]
    WRITE_ROWS(session, first)
    raise MemoryError("injected: no memory left partway through the copy")


READ_ROWS_INTO = Session.read_rows_into


def read_rows_into_failing_after_the_first_row(session: Session, rows: torch.Tensor) -> None:
    """A copy into a snapshot (snapshot_into) that writes the first row, then fails as out of
    memory."""
    whole = rows.clone()
    READ_ROWS_INTO(session, whole)
    rows[:1] = whole[:1]
    raise MemoryError("injected: no memory left partway through the copy")


def pool_key(pool: dict) -> tuple:
    if pool["kind"] == "model":
        return ("model", pool["model"])
    if pool["kind"] == "ssd":
        return ("ssd", (pool["heads"], pool["headdim"], pool["state"]))
    return ("mamba", (pool["dim"], pool["state"]))


# What a burst queues: steps mostly, among requests on the same sessions.
QUEUED = ("step", "step", "step", "step", "model_step", "model_step", "model_step", "model_step", "model_forward",
          "session_restore", "session_state", "session_close", "snapshot_free")

# What a model op with a bad argument is refused: (code, field).
MODEL_OP_REFUSALS = {"rows": ("shape_mismatch", "args.embeds"), "tokens": ("invalid_argument", "args.tokens"),
                     "neither": ("invalid_argument", "args"), "logits": ("invalid_argument", "args.output")}

# A request's frames, each (whether it is a window, a prefill or a model_forward; a plain
# frame's input seed; a model frame's; a model step's snapshot_into, picked); a bad one among
# them: "rows" (refused when it runs: a row too many), "garbled" (refused by the decoder: x or
# embeds not a tensor).
FRAME_SPECS = st.lists(st.tuples(st.booleans(), SEED, MODEL_INPUTS, st.none() | PICK), min_size=0, max_size=3)
BAD_FRAME = st.sampled_from([None, None, "rows", "garbled"])


def walked(rule_function):
    """A rule or invariant that marks the walk failed unless it returns: what a failed rule
    left behind is no second failure for teardown to report."""

    @functools.wraps(rule_function)
    def walking(self, **args):
        self.failed = True
        result = rule_function(self, **args)
        self.failed = False
        return result

    return walking


def plain(held: Held) -> bool:
    return held.kind != "model"


def of_model(held: Held) -> bool:
    return held.kind == "model"


class StateWalk(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.srv = None
        self.failed = False

    # -- the server, the connections and the model -------------------------------------------

    @initialize(max_sessions=st.sampled_from([3, 6, 10]), max_pool_bytes=st.sampled_from([12_000, 16_000, 40_000]),
                owners=st.lists(CONN, min_size=4, max_size=4), backend=st.sampled_from([None, None, "torch"]),
                native_step=st.booleans() | st.just(True))
    def start(self, max_sessions, max_pool_bytes, owners, backend, native_step):
        """A server (the device's default kernels backend, or torch's composed one; lone plain and
        model steps on the native path, or not) with both models loaded and a session of each
        kind open, as far as the limits allow, so that a walk spends its rules on them rather
        than on finding nothing."""
        self.srv = InProcessServer(max_sessions=max_sessions, max_pool_bytes=max_pool_bytes, backend=backend,
                                   native_step=native_step)
        self.conns = [RecordingConnection() for _ in range(CONNECTIONS)]
        self.sessions: dict[str, Held] = {}
        self.snapshots: dict[str, Held] = {}
        self.models: dict[str, Loaded] = {}
        self.zero: dict[tuple, Value] = {}
        self.released = {"peers": 0, "sessions": 0, "snapshots": 0, "models": 0, "handles": 0}
        # What `stats` counts: per op, successes, failures and inferences; errors by code.
        self.counted: dict[str, Counter] = defaultdict(Counter)
        self.errors = Counter()
        self.op_of: dict[int, str] = {}  # the op of each request not yet answered, by id
        for conn, arch in zip(owners, sorted(MODEL_CONFIGS)):
            self.load_model(conn=conn, arch=arch)
        for which in range(len(self.models)):
            self.open_model_session(which=which, asker=0, batch=1, state=None, seed=0, specs=None, bad=None,
                                    bad_at=0)
        for conn, kind in zip(owners[2:], ("mamba", "ssd")):
            self.open_plain(conn=conn, kind=kind, shape_at=0, batch=2, h0=None, seed=0, specs=None, bad=None,
                            bad_at=0)

    def teardown(self):
        if self.srv is None:
            return
        if self.failed:  # a rule's assertion is the failure to report, not what it left behind
            self.srv.close()
            return
        try:
            for held in list(self.sessions.values()):
                self.call(held.conn, "session_close", session=held.id)
            for held in list(self.snapshots.values()):
                self.call(held.conn, "snapshot_free", snapshot=held.id)
            for loaded in list(self.models.values()):
                self.call(loaded.conn, "model_free", model=loaded.id)
            usage = self.call(0, "stats")["sessions"]
            held = {k: usage[k] for k in ("sessions", "pool_bytes", "model_bytes", "snapshot_bytes", "pools")}
            assert held == {"sessions": 0, "pool_bytes": 0, "model_bytes": 0, "snapshot_bytes": 0, "pools": []}, held
            assert len(self.srv.server.snapshots) == len(self.srv.server.models) == 0
        finally:
            self.srv.close()

    def submit(self, conn: int, op: str, **args) -> int:
        request_id = self.srv.submit(self.conns[conn], op, **args)
        self.op_of[request_id] = op
        return request_id

    def request(self, conn: int, op: str, **args):
        return self.conns[conn].reply(self.submit(conn, op, **args))

    def count(self, reply) -> None:
        """What `stats` counts for `reply`: under its op, a success (and an inference) or a
        failure, and the error's code; a request the decoder refused too (SPEC §6.3: every op
        the walk sends is known)."""
        op = self.op_of.pop(reply.id)
        if reply.ok:
            self.counted[op].update(("success_count", "inference_count"))
        else:
            self.errors[reply.error["code"]] += 1
            self.counted[op]["failure_count"] += 1

    def frames_ran(self, ops) -> None:
        """Frames that ran inside a request: an inference of each one's op."""
        for op in ops:
            self.counted[op]["inference_count"] += 1

    def call(self, conn: int, op: str, **args) -> dict:
        return self.expect(self.request(conn, op, **args), None, what=op)

    def expect(self, reply, code: str | None, field: str | None = None, *, limit: str | None = None,
               frame: int | None = None, lost: Held | None = None, what: str = "") -> dict | None:
        """The reply's result where `code` is None; else check it is that error (its field,
        limit, frame where given; `lost`: the session it says it left lost, else none)."""
        self.count(reply)
        error = reply.error
        if what != "stats":
            event(f"{what.split()[0]}: {error['code'] if error else 'ok'}")
        assert error is None or error["code"] != "internal_error", f"{what}: {error}"
        if code is None:
            assert reply.ok, f"{what}: expected success, got {error}"
            return result_from_wire(reply.result, as_torch=True)
        assert not reply.ok, f"{what}: expected {code} ({field or limit}), got success"
        detail = error["detail"]
        assert error["code"] == code, f"{what}: expected {code} ({field or limit}), got {error}"
        if lost is None:
            assert "state" not in detail and "sessions" not in detail, f"{what}: no state was lost, yet {error}"
        else:
            assert (detail.get("state"), detail.get("sessions")) == ("lost", [lost.id]), f"{what}: {error}"
        if field is not None:
            assert detail.get("field") == field, f"{what}: expected {field}, got {error}"
            assert error["message"].startswith(field), f"{what}: {error['message']}"
        if limit is not None:
            assert detail.get("limit") == limit, f"{what}: expected limit {limit}, got {error}"
        if frame is not None:
            assert detail.get("frame") == frame, f"{what}: expected frame {frame}, got {error}"
        return None

    # -- what the model predicts -----------------------------------------------------------

    @staticmethod
    def pick(table: dict, which: int, prefer=None):
        """One of `table`'s entries (one `prefer` says yes to, where there is one), or None: an
        id never issued, for `which` NEVER or an empty table."""
        entries = list(table.values())
        if prefer is not None:
            entries = [entry for entry in entries if prefer(entry)] or entries
        if which == NEVER or not entries:
            return None
        return entries[which % len(entries)]

    @staticmethod
    def asker(entry, asker: int) -> int:
        """The connection that names `entry`: its owner, or another one where `asker` is FOREIGN
        (any one for an id never issued)."""
        if entry is None:
            return asker % CONNECTIONS
        return (entry.conn + 1) % CONNECTIONS if asker == FOREIGN else entry.conn

    def usage(self) -> dict:
        return self.srv.server.sessions.usage()

    def open_refusal(self, batch: int, layout: tuple, row_bytes: int) -> str | None:
        """The limit a new session of `batch` rows of `layout` exceeds, by the usage now."""
        usage = self.usage()
        if usage["sessions"] >= usage["max_sessions"]:
            return "max_sessions"
        pools = {pool_key(p): p for p in usage["pools"]}
        pool = pools.get(layout)
        missing = batch - (pool["capacity"] - pool["rows_in_use"] if pool else 0)
        if missing > 0 and missing * row_bytes > self.room(usage, keep=layout):
            return "max_pool_bytes"
        return None

    def held_refusal(self, nbytes: int, *, by_an_op: bool) -> str | None:
        """The limit `nbytes` held beside the pools exceeds: a snapshot's (`by_an_op`, which may
        take back the pools' free end rows) or a model's."""
        usage = self.usage()
        room = self.room(usage) if by_an_op else usage["max_pool_bytes"] - usage["pool_bytes"]
        return "max_pool_bytes" if nbytes > room else None

    def room(self, usage: dict, keep: tuple | None = None) -> int:
        """The bytes an op finds for what it adds (SPEC §6.1): the budget left, and the free rows
        at the end of every pool but `keep`'s, which pools give back when it is short. Read off
        the server's pools (their rows' order is not in `usage`), listed in usage's order."""
        pools = zip(usage["pools"], self.srv.server.sessions._pools.values())
        spare = sum((pool.capacity - pool.rows_to_keep()) * pool.row_bytes for listed, pool in pools
                    if pool_key(listed) != keep)
        return usage["max_pool_bytes"] - usage["pool_bytes"] + spare

    def zero_value(self, layout: tuple, batch: int) -> Value:
        """The one Value of a zero state of that class and batch (a model op's re-runs from zero
        share it)."""
        key = (layout, batch)
        if key not in self.zero:
            if layout[0] == "model":
                arch = self.models[layout[1]].arch
                exact = {name: torch.zeros(batch, *shape) for name, shape in PARTS[arch]}
                self.zero[key] = Value(None, exact)
            else:
                self.zero[key] = Value(torch.zeros(batch, *layout[1], dtype=torch.float64),
                                       torch.zeros(batch, *layout[1]))
        return self.zero[key]

    def learn(self, value: Value, state, what: str) -> None:
        """`state`, as the server gave it, is `value`: bit for bit where it was read before,
        within tolerance of the reference where that is known."""
        if value.exact is not None:
            same_state(state, value.exact, what)
            return
        if value.expected is not None:
            assert_close(state, value.expected, torch.float32, what, tolerance=STATE_TOLERANCE)
        value.exact = state

    def advance(self, layout: tuple, value: Value, op: str, args: dict, memo, result: dict, what: str) -> Value:
        """The state after `op` ran from `value` and answered `result`, its output checked."""
        if layout[0] != "model":
            prefill = op != "step"
            y, state = reference(layout[0], value.expected, args, prefill)
            # f64 inputs meet fp32's tolerance: the state they step is kept in fp32
            dtype = torch.float32 if args["x"].dtype == torch.float64 else args["x"].dtype
            assert_close(result["y"], y, dtype, f"{what}: y")
            after = Value(state)
        else:
            output = result["hidden"]
            if memo in value.after:
                before, after = value.after[memo]
                again = f"{what}: run again from the same state, another output"
                if self.srv.server.backend == "cpu":  # bit for bit, batched or alone (SPEC §6.3)
                    assert torch.equal(output, before), again
                else:  # torch's products may round otherwise with more rows in a launch
                    assert_close(output, before, torch.float32, again)
            else:
                after = Value(None)
                value.after[memo] = (output, after)
        if "state" in result:
            self.learn(after, result["state"], f"{what}: its return_state")
        return after

    def plain_frames(self, kind: str, shape: tuple, batch: int, specs, bad=None, bad_at: int = 0) -> Frames:
        """Frames for a plain session; `bad` at `bad_at` (modulo the frames) where drawn."""
        frames = Frames([], [], "x")
        for prefill, seed, _, _ in specs:
            op = ("scan" if kind == "mamba" else "ssd_scan") if prefill else "step"
            args = plain_inputs(kind, shape, batch, seed, seq=SEQ if prefill else None,
                                groups=2 if kind == "ssd" else 1)
            frames.wire.append({"op": op, "args": args})
            frames.oracle.append((op, args, None, None))
        return self.spoil(frames, bad, bad_at)

    def model_frames(self, held: Held, specs, bad=None, bad_at: int = 0) -> Frames:
        """Frames for a model session like `held`, a model step's snapshot_into mostly one its
        connection may copy into."""
        frames = Frames([], [], "embeds")
        for forward, _, seed, into in specs:
            op = "model_forward" if forward else "model_step"
            args = {"embeds": model_input(held.batch, seed, SEQ if forward else None)}
            snapshot = None
            if into is not None and not forward:
                snapshot = self.pick(self.snapshots, into, self.like(held, held.conn) if into < MOSTLY else None)
                args["snapshot_into"] = snapshot.id if snapshot else "never-taken"
            frames.wire.append({"op": op, "args": args})
            frames.oracle.append((op, args, (op, seed, torch.float32), snapshot))
        return self.spoil(frames, bad, bad_at)

    @staticmethod
    def spoil(frames: Frames, bad, bad_at: int) -> Frames:
        if bad is None or not frames.wire:
            return frames
        i = bad_at % len(frames.wire)
        args = dict(frames.wire[i]["args"])
        args[frames.name] = torch.cat([args[frames.name], args[frames.name][:1]]) if bad == "rows" else "not a tensor"
        frames.wire[i] = {"op": frames.wire[i]["op"], "args": args}
        frames.spoiled, frames.bad = i, bad
        return frames

    def refused_when_decoded(self, reply, frames: Frames | None, what: str) -> bool:
        """Whether the decoder refused the request for a garbled frame (checked so)."""
        if frames is None or frames.bad != "garbled":
            return False
        self.expect(reply, "invalid_argument", f"args.frames[{frames.spoiled}].args.{frames.name}",
                    what=what)
        return True

    def failing_frame(self, frames: Frames, held: Held, injected: int | None):
        """(index, code, field or None, limit or None, the snapshots its frames copied into) of
        the first frame to fail when it runs: the spoiled one, a copy into a snapshot the
        connection does not hold or of another class, or the `injected`-th state write failing
        partway (after its frame's copy); None when none fails."""
        copied, writes = [], 0
        for i, (op, args, _, snapshot) in enumerate(frames.oracle):
            field = f"args.frames[{i}].args"
            if i == frames.spoiled:
                return i, "shape_mismatch", f"{field}.{frames.name}", None, copied
            if "snapshot_into" in args:
                if not self.holds_snapshot(snapshot, held.conn):
                    return i, "unknown_snapshot", f"{field}.snapshot_into", None, copied
                if (snapshot.layout, snapshot.batch) != (held.layout, held.batch):
                    return i, "invalid_argument", f"{field}.snapshot_into", None, copied
                copied.append(snapshot)
            if op in ("step", "model_step"):
                if writes == injected:
                    return i, "limit_exceeded", None, "memory", copied
                writes += 1
        return None

    def expect_frames(self, reply, held: Held, frames: Frames, what: str, injected: int | None = None):
        """The result of a request whose frames run on `held` once it is open or restored, its
        frames checked and `held` advanced through them; None where a frame fails (checked so):
        what the frames before it did is undone, and the snapshots its frames copied into are
        left undefined (SPEC §6.1)."""
        failing = self.failing_frame(frames, held, injected)
        if failing is None:
            result = self.expect(reply, None, what=what)
            assert len(result["frames"]) == len(frames.oracle), f"{what}: {len(result['frames'])} frame results"
            value = held.value
            for i, ((op, args, memo, snapshot), frame) in enumerate(zip(frames.oracle, result["frames"])):
                assert "state" not in frame, f"{what}: frame {i} carries the state unasked"
                if snapshot is not None:  # the state before the frame, whole again
                    snapshot.value, snapshot.lost = value, False
                    event("frames: a copy into a snapshot")
                value = self.advance(held.layout, value, op, args, memo, frame, f"{what}, frame {i}")
            held.value = value
            self.frames_ran(op for op, _, _, _ in frames.oracle)
            return result
        i, code, field, limit, copied = failing
        self.expect(reply, code, field, limit=limit, frame=i, what=what)
        self.frames_ran(op for op, _, _, _ in frames.oracle[:i])
        for snapshot in copied:
            snapshot.value, snapshot.lost = Value(None), True
            event("frames: a copy into a snapshot undone")
        return None

    # -- opening ---------------------------------------------------------------------------

    @rule(conn=CONN, kind=st.sampled_from(["mamba", "mamba", "ssd"]), shape_at=st.integers(0, 1),
          batch=st.integers(1, 3), h0=st.sampled_from([None, None, torch.float32, torch.float64, "bad"]),
          seed=SEED, specs=st.none() | FRAME_SPECS, bad=BAD_FRAME, bad_at=st.integers(0, 2))
    @walked
    def open_plain(self, conn, kind, shape_at, batch, h0, seed, specs, bad, bad_at):
        shape = MAMBA_SHAPES[shape_at] if kind == "mamba" else SSD_SHAPE
        layout = (kind, shape)
        args = ({"batch": batch, "dim": shape[0], "state": shape[1]} if kind == "mamba"
                else {"kind": "ssd", "batch": batch, "heads": shape[0], "headdim": shape[1], "state": shape[2]})
        value = self.zero_value(layout, batch)
        if h0 == "bad":
            args["h0"] = torch.zeros(batch + 1, *shape)
        elif h0 is not None:
            state = torch.randn(batch, *shape, generator=torch.Generator().manual_seed(seed), dtype=h0)
            args["h0"] = state
            value = Value(state.to(torch.float64), state.float())
        frames = None
        if specs is not None:
            frames = self.plain_frames(kind, shape, batch, specs, bad, bad_at)
            args["frames"] = frames.wire
        row_bytes = plain_row_bytes(shape)
        refusal = self.open_refusal(batch, layout, row_bytes)
        what = f"session_open {kind} {list(shape)} batch {batch}"
        reply = self.request(conn, "session_open", **args)
        if self.refused_when_decoded(reply, frames, what):
            return
        if h0 == "bad":
            return self.expect(reply, "shape_mismatch", "args.h0", what=what)
        self.expect_opened(reply, Held("", conn, layout, batch, row_bytes, value), refusal, frames, what)

    def expect_opened(self, reply, held: Held, refusal: str | None, frames: Frames | None, what: str,
                      injected: int | None = None) -> None:
        """A session_open whose arguments passed: refused by the limit it exceeds, or failing
        at a frame that runs (opened, then closed again), or `held` opened, its frames run on it."""
        if refusal is not None:
            return self.expect(reply, "limit_exceeded", limit=refusal, what=what)
        if frames is None:
            result = self.expect(reply, None, what=what)
            assert "frames" not in result, f"{what}: frames unasked"
        else:
            result = self.expect_frames(reply, held, frames, what, injected)
            if result is None:
                return
        held.id = result["session"]
        self.sessions[held.id] = held

    @rule(which=PICK, asker=ASKER, batch=st.integers(1, 2),
          state=st.sampled_from([None, None, "zero", "random", "bad"]), seed=SEED, specs=st.none() | FRAME_SPECS,
          bad=BAD_FRAME, bad_at=st.integers(0, 2))
    @walked
    def open_model_session(self, which, asker, batch, state, seed, specs, bad, bad_at):
        loaded = self.pick(self.models, which)
        conn = self.asker(loaded, asker)
        args = {"model": loaded.id if loaded else "never-loaded", "batch": batch}
        layout = ("model", args["model"])
        value = self.zero_value(layout, batch) if loaded else None
        if state is not None and loaded:
            gen = torch.Generator().manual_seed(seed)
            parts = {name: torch.zeros(batch, *shape) if state == "zero" else torch.randn(batch, *shape, generator=gen)
                     for name, shape in PARTS[loaded.arch]}
            if state == "bad":
                parts["layers.1.conv"] = parts["layers.1.conv"][:, :-1]
            elif state == "random":
                value = Value(None, parts)
            args["state"] = parts
        opened = Held("", conn, layout, batch, loaded.row_bytes if loaded else 0, value)
        frames = None
        if specs is not None:
            frames = self.model_frames(opened, specs, bad, bad_at)
            args["frames"] = frames.wire
        refusal = self.open_refusal(batch, layout, loaded.row_bytes) if loaded else None
        what = f"session_open of a model, batch {batch}"
        reply = self.request(conn, "session_open", **args)
        if self.refused_when_decoded(reply, frames, what):
            return
        if loaded is None or loaded.conn != conn:
            return self.expect(reply, "unknown_model", "args.model", what=what)
        if state == "bad":
            return self.expect(reply, "shape_mismatch", "args.state.layers.1.conv", what=what)
        self.expect_opened(reply, opened, refusal, frames, what)

    # -- stepping --------------------------------------------------------------------------

    def owns(self, held: Held | None, conn: int) -> bool:
        """Whether `conn` holds the session `held` now (a request queued after its close does not)."""
        return held is not None and self.sessions.get(held.id) is held and held.conn == conn

    def holds_snapshot(self, snapshot: Held | None, conn: int) -> bool:
        return snapshot is not None and self.snapshots.get(snapshot.id) is snapshot and snapshot.conn == conn

    def refused_for_the_session(self, reply, held: Held | None, conn: int, what: str) -> bool:
        """Whether the request was refused for the session it names (checked so): not the
        asker's (unknown_session), or lost (state_lost)."""
        if not self.owns(held, conn):
            self.expect(reply, "unknown_session", "args.session", what=what)
        elif held.lost:
            self.expect(reply, "state_lost", "args.session", what=what)
        else:
            return False
        return True

    def session_for(self, which: int, asker: int, prefer=None):
        """(the session picked or None, the connection asking, the id it names)."""
        held = self.pick(self.sessions, which, prefer)
        conn = self.asker(held, asker)
        return held, conn, held.id if held else "never-issued"

    def plan_step(self, which, asker, prefill, seed, dtype, options, groups, return_state, bad,
                  constants: int | None = None):
        """A step or prefill of a plain session: (its connection, op, arguments, the check of its
        reply, run once the requests before it are checked)."""
        held, conn, session = self.session_for(which, asker, prefer=plain if which < MOSTLY else None)
        kind, shape = held.layout if held is not None and held.kind != "model" else ("mamba", MAMBA_SHAPES[0])
        batch = held.batch if held is not None else 1
        op = ("scan" if kind == "mamba" else "ssd_scan") if prefill else "step"
        args = plain_inputs(kind, shape, batch, seed, seq=SEQ if prefill else None, dtype=dtype,
                            options=tuple(sorted(options)), groups=groups, constants=constants)
        if bad == "rows":
            args["x"] = torch.cat([args["x"], args["x"][:1]])
        if return_state:
            args["return_state"] = True
        what = f"{op} ({dtype}, {sorted(options)})"

        def check(reply):
            if self.refused_for_the_session(reply, held, conn, what):
                return
            if held.kind == "model":
                return self.expect(reply, "invalid_argument", "args.session", what=what)
            if bad == "rows":
                return self.expect(reply, "shape_mismatch", "args.x", what=what)
            result = self.expect(reply, None, what=what)
            assert ("state" in result) == return_state, f"{what}: state {'missing' if return_state else 'unasked'}"
            held.value = self.advance(held.layout, held.value, op, args, None, result, what)

        return Planned(conn, op, {"session": session, **args}, check, held)

    def plan_model_op(self, which, asker, forward, seed, return_state, into, bad, dtype=torch.float32):
        """A model_step or model_forward, as plan_step."""
        held, conn, session = self.session_for(which, asker, prefer=of_model if which < MOSTLY else None)
        batch = held.batch if held is not None else 1
        op = "model_forward" if forward else "model_step"
        args = {"embeds": model_input(batch, seed, SEQ if forward else None).to(dtype)}
        if bad == "rows":
            args["embeds"] = torch.cat([args["embeds"], args["embeds"][:1]])
        elif bad == "tokens":
            args = {"tokens": torch.zeros(batch, *((SEQ,) if forward else ()), dtype=torch.int32)}
        elif bad == "neither":
            args = {}
        elif bad == "logits":
            args["output"] = "logits"
        if return_state:
            args["return_state"] = True
        snapshot = None
        if into is not None and not forward:
            snapshot = self.pick(self.snapshots, into, self.like(held, conn) if into < MOSTLY else None)
            args["snapshot_into"] = snapshot.id if snapshot else "never-taken"
        what = f"{op}{' into a snapshot' if 'snapshot_into' in args else ''}"

        def check(reply):
            if self.refused_for_the_session(reply, held, conn, what):
                return
            if held.kind != "model":
                return self.expect(reply, "invalid_argument", "args.session", what=what)
            if bad is not None:
                return self.expect(reply, *MODEL_OP_REFUSALS[bad], what=what)
            if "snapshot_into" in args:
                if not self.holds_snapshot(snapshot, conn):
                    return self.expect(reply, "unknown_snapshot", "args.snapshot_into", what=what)
                if (snapshot.layout, snapshot.batch) != (held.layout, held.batch):
                    return self.expect(reply, "invalid_argument", "args.snapshot_into", what=what)
            result = self.expect(reply, None, what=what)
            if snapshot is not None:  # the state before the frame, whole again
                snapshot.value, snapshot.lost = held.value, False
            held.value = self.advance(held.layout, held.value, op, args, (op, seed, dtype), result, what)

        return Planned(conn, op, {"session": session, **args}, check, held, snapshot)

    def run_alone(self, planned: Planned) -> None:
        planned.check(self.request(planned.conn, planned.op, **planned.args))

    @rule(which=PICK, asker=ASKER, prefill=st.booleans(), seed=SEED, dtype=st.sampled_from(STEP_DTYPES),
          options=st.sets(st.sampled_from(["D", "z", "dt_bias", "dt_softplus"])), groups=st.sampled_from([1, 2]),
          return_state=st.booleans(), bad=st.sampled_from([None, None, None, "rows"]))
    @walked
    def step_or_prefill(self, which, asker, prefill, seed, dtype, options, groups, return_state, bad):
        self.run_alone(self.plan_step(which, asker, prefill, seed, dtype, options, groups, return_state, bad))

    @rule(which=PICK, asker=ASKER, forward=st.booleans(), seed=MODEL_INPUTS, return_state=st.booleans(),
          into=st.none() | PICK, bad=st.sampled_from([None, None, None, None, "rows", "tokens", "neither", "logits"]))
    @walked
    def model_op(self, which, asker, forward, seed, return_state, into, bad):
        self.run_alone(self.plan_model_op(which, asker, forward, seed, return_state, into, bad))

    @rule(queued=st.lists(st.tuples(st.sampled_from(QUEUED), PICK, ASKER, SEED, st.booleans(), st.none() | PICK,
                                    st.sampled_from([None, None, None, None, "rows"])), min_size=2, max_size=6),
          constants=SEED, options=st.sets(st.sampled_from(["D", "z", "dt_bias", "dt_softplus"])))
    @walked
    def burst(self, queued, constants, options):
        """Requests queued behind a held one, then served: steps and model steps (some of one
        session, some refused) among model_forwards, restores, state reads, closes and snapshot
        frees of the same sessions and snapshots.
        Steps that fit share a launch (SPEC §6.3), and every request is answered as if it had
        run alone, in the order they arrived. The plain steps share A, D and dt_bias, so that
        they may batch."""
        planned = []
        for op, which, asker, seed, return_state, into, bad in queued:
            if op == "step":
                planned.append(self.plan_step(which, asker, False, seed, torch.float32, options, 1, return_state, bad,
                                              constants))
            elif op in ("model_step", "model_forward"):
                planned.append(self.plan_model_op(which, asker, op == "model_forward", seed % 4, return_state, into,
                                                  bad))
            elif op == "session_restore":
                planned.append(self.plan_restore(which, asker, which if into is None else into, None, None, 0))
            elif op == "session_state":
                planned.append(self.plan_read_state(which, asker))
            elif op == "snapshot_free":
                planned.append(self.plan_free_snapshot(which if into is None else into, asker))
            else:
                planned.append(self.plan_close(which, asker))
        self.srv.hold(self.conns[0])
        ids = [self.submit(p.conn, p.op, **p.args) for p in planned]
        self.srv.go()
        self.counted["ping"].update(("success_count", "inference_count"))  # the held request
        for p, request_id in zip(planned, ids):
            reply = self.conns[p.conn].reply(request_id)
            p.check(reply)
            rows = next((p.args[name].shape[0] for name in ("x", "embeds") if name in p.args), 0)
            if reply.ok and reply.timing.get("batch_rows", 0) > rows:
                event("burst: a launch shared")

    # -- failures partway ------------------------------------------------------------------

    @rule(what=st.sampled_from(["step", "restore", "open frames", "restore frames", "snapshot_into"]), which=PICK,
          asker=ASKER,
          into=PICK, frames=st.integers(1, 3), at=st.integers(0, 2), seed=SEED)
    @walked
    def fail_partway(self, what, which, asker, into, frames, at, seed):
        """A request whose state writes fail partway (out of memory, injected): a step (of f64
        inputs, which the general path serves) or a restore's copy leave their session lost (SPEC
        §6.1); a frame of session_open or session_restore is undone instead, nothing opened, or
        the snapshot's state restored, and its error says nothing lost; a model step's copy into
        a snapshot leaves the session as it was and the snapshot undefined (SPEC §6.4)."""
        if what == "step":
            planned = (self.plan_model_op(which, asker, False, seed % 4, True, None, None, torch.float64) if seed % 2
                       else self.plan_step(which, asker, False, seed, torch.float64, (), 1, True, None))
            held = planned.held
            with failing_writes(held.layout if held is not None else ("mamba",), succeeding=0):
                reply = self.request(planned.conn, planned.op, **planned.args)
            if not self.owns(held, planned.conn) or held.lost or (held.kind == "model") != (planned.op == "model_step"):
                return planned.check(reply)  # refused before it ran
            self.lose(reply, held, f"{planned.op} failing partway")
        elif what == "snapshot_into":
            planned = self.plan_model_op(which, asker, False, seed % 4, False, into, None, torch.float64)
            held, snapshot = planned.held, planned.snapshot
            with mock.patch.object(Session, "read_rows_into", read_rows_into_failing_after_the_first_row):
                reply = self.request(planned.conn, planned.op, **planned.args)
            if (not self.owns(held, planned.conn) or held.lost or held.kind != "model"
                    or not self.holds_snapshot(snapshot, planned.conn)
                    or (snapshot.layout, snapshot.batch) != (held.layout, held.batch)):
                return planned.check(reply)  # refused before it ran
            self.expect(reply, "limit_exceeded", limit="memory", what="model_step whose snapshot copy fails")
            snapshot.value, snapshot.lost = Value(None), True
        elif what == "restore":
            snapshot = self.pick(self.snapshots, into)
            held, conn, session = self.session_for(which, asker, self.restorable(snapshot))
            with mock.patch.object(Session, "write_rows", write_rows_failing_after_the_first_row):
                reply = self.request(conn, "session_restore", session=session,
                                     snapshot=snapshot.id if snapshot else "never-taken")
            what = "session_restore failing partway"
            if not self.expect_restore_refusal(reply, held, conn, snapshot, what):
                self.lose(reply, held, what)
        else:
            # steps only (each a state write), a model step's copying into a snapshot now and then
            failing = at % frames
            specs = [(False, seed + i, (seed + i) % 4, into + i if i % 2 == 0 else None) for i in range(frames)]
            if what == "restore frames":
                planned = self.plan_restore(which, asker, into, specs, None, 0, injected=failing)
                with failing_writes(planned.held.layout if planned.held is not None else ("mamba",), failing):
                    reply = self.request(planned.conn, planned.op, **planned.args)
                return planned.check(reply)
            loaded = self.pick(self.models, which)
            if loaded is not None and asker % 2 == 0:
                layout, row_bytes, args = ("model", loaded.id), loaded.row_bytes, {"model": loaded.id}
                conn = loaded.conn
            else:
                shape = MAMBA_SHAPES[0]
                layout, row_bytes, args = ("mamba", shape), plain_row_bytes(shape), {"dim": shape[0], "state": shape[1]}
                conn = asker % CONNECTIONS
            batch = 1 + seed % 2
            opened = Held("", conn, layout, batch, row_bytes, self.zero_value(layout, batch))
            frames = (self.model_frames(opened, specs) if layout[0] == "model"
                      else self.plain_frames("mamba", layout[1], batch, specs))
            refusal = self.open_refusal(batch, layout, row_bytes)
            with failing_writes(layout, failing):
                reply = self.request(conn, "session_open", batch=batch, **args, frames=frames.wire)
            self.expect_opened(reply, opened, refusal, frames, "session_open whose frame fails partway",
                               injected=failing)

    def expect_restore_refusal(self, reply, held, conn: int, snapshot, what: str) -> bool:
        """Whether the restore is refused before its copy (checked so), the session as it was."""
        if not self.owns(held, conn):
            self.expect(reply, "unknown_session", "args.session", what=what)
        elif not self.holds_snapshot(snapshot, conn):
            self.expect(reply, "unknown_snapshot", "args.snapshot", what=what)
        elif (snapshot.layout, snapshot.batch) != (held.layout, held.batch):
            self.expect(reply, "invalid_argument", "args.snapshot", what=what)
        elif snapshot.lost:
            self.expect(reply, "state_lost", "args.snapshot", what=what)
        else:
            return False
        return True

    def lose(self, reply, held: Held, what: str) -> None:
        self.expect(reply, "limit_exceeded", limit="memory", lost=held, what=what)
        held.value, held.lost = Value(None), True

    # -- snapshots, restores, forks --------------------------------------------------------

    @staticmethod
    def restorable(snapshot: Held | None):
        """Whether a session is one its owner may restore `snapshot` into."""
        if snapshot is None:
            return None
        return lambda held: (held.conn, held.layout, held.batch) == (snapshot.conn, snapshot.layout, snapshot.batch)

    @staticmethod
    def like(held: Held | None, conn: int):
        """Whether a snapshot is one `conn` may restore into `held`."""
        if held is None:
            return None
        return lambda snapshot: (snapshot.conn, snapshot.layout, snapshot.batch) == (conn, held.layout, held.batch)

    @rule(fork=st.booleans(), which=PICK, asker=ASKER)
    @walked
    def copy(self, fork, which, asker):
        """session_snapshot or session_fork: a copy of the session's state, held against the
        pool budget (a fork's rows as any session's, a snapshot's beside the pools)."""
        self.take_copy(*self.session_for(which, asker), fork)

    def take_copy(self, held: Held | None, conn: int, session: str, fork: bool) -> Held | None:
        """The copy `conn` asked for of the session it names (None: refused, checked so)."""
        op = "session_fork" if fork else "session_snapshot"
        refusal = None
        if self.owns(held, conn):
            refusal = (self.open_refusal(held.batch, held.layout, held.row_bytes) if fork
                       else self.held_refusal(held.nbytes, by_an_op=True))
        reply = self.request(conn, op, session=session)
        if self.refused_for_the_session(reply, held, conn, op):
            return None
        if refusal is not None:
            return self.expect(reply, "limit_exceeded", limit=refusal, what=op)
        copied = self.expect(reply, None, what=op)["session" if fork else "snapshot"]
        copy = Held(copied, conn, held.layout, held.batch, held.row_bytes, held.value)
        (self.sessions if fork else self.snapshots)[copied] = copy
        return copy

    def restore_frames(self, held: Held | None, specs, bad=None, bad_at: int = 0) -> Frames:
        """Frames for a restore into `held` (one of the first plain class for an id never issued)."""
        if held is not None and held.kind == "model":
            return self.model_frames(held, specs, bad, bad_at)
        kind, shape = held.layout if held is not None else ("mamba", MAMBA_SHAPES[0])
        return self.plain_frames(kind, shape, held.batch if held else 1, specs, bad, bad_at)

    def plan_restore(self, which, asker, into, specs, bad, bad_at, injected: int | None = None,
                     chosen: tuple | None = None) -> Planned:
        """A session_restore, with frames where `specs` are given; `injected`: the frame whose
        state write fails partway (failing_writes), if any; `chosen`: (the session, its
        connection, the snapshot) where not picked by `which`, `asker` and `into`."""
        if chosen is not None:
            held, conn, snapshot = chosen
            session = held.id
        else:  # mostly a snapshot first, then a session it restores into
            snapshot = self.pick(self.snapshots, into)
            held, conn, session = self.session_for(which, asker,
                                                   self.restorable(snapshot) if which < MOSTLY else None)
        args = {"session": session, "snapshot": snapshot.id if snapshot else "never-taken"}
        frames = None
        if specs is not None:
            frames = self.restore_frames(held, specs, bad, bad_at)
            args["frames"] = frames.wire
        what = "session_restore" + (" with frames" if specs is not None else "")

        def check(reply):
            if self.refused_when_decoded(reply, frames, what):
                return
            if self.owns(held, conn) and frames is not None:
                # a frame copying into the snapshot being restored, which a later frame's failure
                # would restore again: nothing restored or run
                into_it = [i for i, frame in enumerate(frames.wire)
                           if frame["args"].get("snapshot_into") == args["snapshot"]]
                if into_it:
                    self.expect(reply, "invalid_argument", f"args.frames[{into_it[0]}].args.snapshot_into", what=what)
                    # refused before anything ran: no detail.frame, which says the restore was done
                    assert "frame" not in reply.error["detail"], f"{what}: {reply.error}"
                    return
            if self.expect_restore_refusal(reply, held, conn, snapshot, what):
                return
            held.value, held.lost = snapshot.value, False
            if frames is None:
                result = self.expect(reply, None, what=what)
                assert "frames" not in result, f"{what}: frames unasked"
            else:
                result = self.expect_frames(reply, held, frames, what, injected)
                if result is None:  # the session holds the snapshot's state, as a restore alone leaves it
                    held.value = snapshot.value
                    return
            assert result["restored"] is True, f"{what}: {result}"

        return Planned(conn, "session_restore", args, check, held, snapshot)

    @rule(which=PICK, asker=ASKER, into=PICK, specs=st.none() | FRAME_SPECS, bad=BAD_FRAME, bad_at=st.integers(0, 2))
    @walked
    def restore(self, which, asker, into, specs, bad, bad_at):
        self.run_alone(self.plan_restore(which, asker, into, specs, bad, bad_at))

    @rule(which=PICK, ring=st.integers(1, 3), restored=st.integers(0, 2),
          steps=st.lists(st.tuples(MODEL_INPUTS, st.none() | PICK), min_size=1, max_size=4), bad=BAD_FRAME,
          bad_at=st.integers(0, 3))
    @walked
    def rollback(self, which, ring, restored, steps, bad, bad_at):
        """A netcode client's rollback on a model session: a ring of snapshots of it, then a
        restore of one of them whose model steps copy into the ring (SPEC §6.4), the restored
        one among them now and then (refused)."""
        specs = [(False, 0, seed, into) for seed, into in steps]
        held = self.pick(self.sessions, which, of_model)
        if held is None or held.kind != "model" or held.lost:
            return
        taken = [self.take_copy(held, held.conn, held.id, fork=False) for _ in range(ring)]
        taken = [snapshot for snapshot in taken if snapshot is not None]
        if not taken:
            return
        chosen = (held, held.conn, taken[restored % len(taken)])
        self.run_alone(self.plan_restore(0, 0, 0, specs, bad, bad_at, chosen=chosen))

    def plan_read_state(self, which, asker) -> Planned:
        held, conn, session = self.session_for(which, asker)

        def check(reply):
            if self.refused_for_the_session(reply, held, conn, "session_state"):
                return
            state = self.expect(reply, None, what="session_state")["state"]
            self.learn(held.value, state, f"session_state of a {held.kind} session")

        return Planned(conn, "session_state", {"session": session}, check, held)

    @rule(which=PICK, asker=ASKER)
    @walked
    def read_state(self, which, asker):
        self.run_alone(self.plan_read_state(which, asker))

    @rule(what=st.sampled_from(["session", "session", "snapshot", "model"]), which=PICK, asker=ASKER)
    @walked
    def release(self, what, which, asker):
        """session_close, snapshot_free or model_free: one rule, so that a walk frees no more
        often than it makes."""
        if what == "model":
            return self.free_model(which, asker)
        self.run_alone((self.plan_close if what == "session" else self.plan_free_snapshot)(which, asker))

    def plan_close(self, which, asker) -> Planned:
        held, conn, session = self.session_for(which, asker)

        def check(reply):
            if not self.owns(held, conn):
                return self.expect(reply, "unknown_session", "args.session", what="session_close")
            assert self.expect(reply, None, what="session_close") == {"closed": True}
            del self.sessions[held.id]

        return Planned(conn, "session_close", {"session": session}, check, held)

    def plan_free_snapshot(self, which, asker) -> Planned:
        snapshot = self.pick(self.snapshots, which)
        conn = self.asker(snapshot, asker)

        def check(reply):
            if not self.holds_snapshot(snapshot, conn):
                return self.expect(reply, "unknown_snapshot", "args.snapshot", what="snapshot_free")
            assert self.expect(reply, None, what="snapshot_free") == {"freed": True}
            del self.snapshots[snapshot.id]

        return Planned(conn, "snapshot_free", {"snapshot": snapshot.id if snapshot else "never-taken"}, check,
                       None, snapshot)

    # -- models and connections ------------------------------------------------------------

    @rule(conn=CONN, arch=st.sampled_from(sorted(MODEL_CONFIGS)))
    @walked
    def load_model(self, conn, arch):
        weight_bytes = sum(t.numel() * 4 for t in WEIGHTS[arch].values())
        refusal = self.held_refusal(weight_bytes, by_an_op=False)
        reply = self.request(conn, "model_load", config=MODEL_CONFIGS[arch], weights=WEIGHTS[arch])
        if refusal is not None:
            return self.expect(reply, "limit_exceeded", limit=refusal, what="model_load")
        info = self.expect(reply, None, what="model_load")
        assert (info["arch"], info["weight_bytes"], info["dtype"]) == (arch, weight_bytes, "f32"), info
        row_bytes = sum(plain_row_bytes(shape) for _, shape in PARTS[arch])
        assert info["state_bytes_per_row"] == row_bytes, info
        self.models[info["model"]] = Loaded(info["model"], conn, arch, weight_bytes, row_bytes)

    def free_model(self, which, asker):
        # mostly one in use, refused: a model freed early leaves the walk without its sessions
        loaded = self.pick(self.models, which, self.in_use if which < MOSTLY else None)
        conn = self.asker(loaded, asker)
        reply = self.request(conn, "model_free", model=loaded.id if loaded else "never-loaded")
        if loaded is None or loaded.conn != conn:
            return self.expect(reply, "unknown_model", "args.model", what="model_free")
        layout = ("model", loaded.id)
        if self.in_use(loaded):
            return self.expect(reply, "invalid_argument", "args.model", what="model_free")
        assert self.expect(reply, None, what="model_free") == {"freed": True}
        del self.models[loaded.id]
        for snapshot in [s for s in self.snapshots.values() if s.layout == layout]:
            del self.snapshots[snapshot.id]

    def in_use(self, loaded: Loaded) -> bool:
        return any(held.layout == ("model", loaded.id) for held in self.sessions.values())

    @rule(conn=CONN)
    @walked
    def close_connection(self, conn):
        """The connection goes, with everything it owns; a new one takes its place."""
        owned = {"sessions": [h for h in self.sessions.values() if h.conn == conn],
                 "snapshots": [h for h in self.snapshots.values() if h.conn == conn],
                 "models": [m for m in self.models.values() if m.conn == conn]}
        self.conns[conn].mark_closed()
        self.conns[conn] = RecordingConnection()
        for what, entries in owned.items():
            table = getattr(self, what)
            for entry in entries:
                del table[entry.id]
        if any(owned.values()):  # a connection that owns nothing has nothing released
            self.released["peers"] += 1
            for what, entries in owned.items():
                self.released[what] += len(entries)
        released = self.call(conn, "stats")["released"].get("closed", dict.fromkeys(self.released, 0))
        assert released == self.released, f"released {released}, expected {self.released}"

    # -- what the server holds -------------------------------------------------------------

    @invariant()
    @walked
    def holds_what_the_model_holds(self):
        if self.srv is None:
            return
        counted = {op: dict(counts) for op, counts in self.counted.items()}
        errors = +self.errors
        stats = self.call(0, "stats")  # counted once it is answered: not in what it reports
        for op, counts in counted.items():
            got = {key: stats["ops"].get(op, {}).get(key, 0) for key in counts}
            assert got == counts, f"stats counts {op}: {got}, expected {counts}"
        assert stats["errors"] == errors, f"stats counts errors {stats['errors']}, expected {dict(errors)}"
        usage = stats["sessions"]
        assert usage["sessions"] == len(self.sessions), usage
        assert usage["model_bytes"] == sum(m.weight_bytes for m in self.models.values()), usage
        assert usage["snapshot_bytes"] == sum(s.nbytes for s in self.snapshots.values()), usage
        rows: dict[tuple, int] = {}
        for held in self.sessions.values():
            rows[held.layout] = rows.get(held.layout, 0) + held.batch
        pools = {pool_key(p): p for p in usage["pools"]}
        assert {k: p["rows_in_use"] for k, p in pools.items()} == rows, usage
        row_bytes = {held.layout: held.row_bytes for held in self.sessions.values()}
        pool_bytes = sum(p["capacity"] * row_bytes[k] for k, p in pools.items())
        assert usage["pool_bytes"] == pool_bytes + usage["model_bytes"] + usage["snapshot_bytes"], usage
        assert usage["pool_bytes"] <= usage["max_pool_bytes"], usage
        assert len(self.srv.server.snapshots) == len(self.snapshots)
        assert len(self.srv.server.models) == len(self.models)
        for held in self.sessions.values():
            session = self.srv.server.sessions.find(self.conns[held.conn].id, held.id)
            assert session is not None and session.lost == held.lost, f"session {held.id}: lost {session.lost}"
        for held in self.snapshots.values():
            snapshot = self.srv.server.snapshots.find(self.conns[held.conn].id, held.id)
            assert snapshot is not None and snapshot.defined != held.lost, f"snapshot {held.id}: {snapshot}"


# A few short walks in CI (the module's docstring says how to run longer ones).
StateWalk.TestCase.settings = settings(max_examples=EXAMPLES or 8, stateful_step_count=STEPS, deadline=None,
                                       suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
test_state_walk = StateWalk.TestCase
