"""Sessions and tensor handles (protocol/SPEC.md §6.1, §6.2): session_open, session_close, session_state, step,
put, free. What they manage lives in bridge.sessions and bridge.handles; step is batched
(bridge.batcher)."""

from __future__ import annotations

import scan_kernels
import torch

import protocol

from ..batcher import (BatchedOp, Item, charge, dt_options, dtype_of, member_rows, nbytes_of, row_signature,
                       shared_args, shared_tensors, signature, stack_rows, wire_rows)
from ..dispatcher import Call
from ..errors import OpError, check_reply_fits, error_fields
from ..native import NativeStep
from ..sessions import FRAMES_FAILED, ROW_AXES, StateLayout, StateLost, WritingState, state_row_bytes
from ..tensors import WIRE_DTYPES, host_view, to_wire
from ..timing import now_ns

# Arguments with one row per session row, stacked when steps share a launch.
ROW_ARGS = ("x", "dt", "B", "C", "z")


def session_open(server, call) -> dict:
    session = open_model_session(server, call) if "model" in call.args else open_plain_session(server, call)
    if "frames" not in call.args:
        return {"session": session.id}
    # A frame that fails closes the session: the request leaves nothing behind; so does a result
    # too long to send (a frame's logits, say).
    undo = lambda: close_quietly(server, call.conn, session)  # noqa: E731
    frames = run_frames(server, call, session, undo)
    return {"session": session.id, "frames": frames}


def run_frames(server, call, session, undo) -> list[dict]:
    """Each frame's result, in order. A frame that fails calls `undo`, which takes back what the
    request did, and its error names the frame: what a client reopening a session from a saved
    state, or rolling one back, needs is all of it or a clear refusal. So does a reply too long
    to send (`call.if_unsent`). The snapshots the frames copied into (snapshot_into) are left
    undefined then: the states they took were undone, and what they held before is gone."""
    named = frames_snapshots(server, call)

    def undo_all() -> None:
        # The copies are void whether or not the undo itself completes.
        try:
            undo()
        finally:
            for snapshot, copies_before in named.items():
                if snapshot.copies_begun != copies_before:
                    snapshot.undefined_why = FRAMES_FAILED

    results = []
    for i, frame in enumerate(call.args["frames"]):
        # multipart as the request: its reply carries the frames' results as raw buffers too, so a
        # window's output is held to no frame's length (check_reply_fits)
        request = protocol.Request(call.request.id, frame.op, {**frame.args, "session": session.id},
                                   multipart=call.request.multipart)
        handler = server.registry.handler(request)
        try:
            # on the request's connection, its times added to that request's
            results.append(handler(server, Call(call.conn, request, call.timing, handler)))
        except Exception as exc:
            undo_all()
            if isinstance(exc, StateLost) and (session.closed or not session.lost):
                exc = exc.cause  # undone: the session is closed, or holds a whole state again
            raise frame_error(exc, i) from exc
        server.stats.record_frame(frame.op, session.batch)
    call.if_unsent = undo_all
    return results


def frames_snapshots(server, call) -> dict:
    """Each snapshot a frame names in snapshot_into and held by this connection, with the copies
    begun into it so far (an unknown one is the frame's error when it runs)."""
    named = {}
    for frame in call.args["frames"]:
        snapshot_id = frame.args.get("snapshot_into")
        snapshot = None if snapshot_id is None else server.snapshots.find(call.conn.id, snapshot_id)
        if snapshot is not None:
            named[snapshot] = snapshot.copies_begun
    return named


def open_filled(server, call, batch: int, layout: StateLayout, fill=None):
    """A new session of `layout`, `fill(session)` run on it first; a fill that fails (an
    allocation, say) closes it again, so that a failed request leaves nothing open."""
    session = server.open_session(call.conn, batch, layout, call.request.op)
    if fill is not None:
        try:
            start = now_ns()
            fill(session)  # a copy into the session's pool, on its device: as session_state's out
            call.timing.add("h2d", now_ns() - start)
        except BaseException:
            close_quietly(server, call.conn, session)
            raise
    return session


def close_quietly(server, conn, session) -> None:
    """Close `session` unless its connection's going away released it first: the frame's own
    error is the one to report."""
    try:
        server.sessions.remove(conn.id, session.id, "args.session")
    except OpError:
        pass


def frame_error(exc: BaseException, index: int) -> OpError:
    """The frame's own error, its field named within the request's arguments."""
    code, message, detail = error_fields(exc)
    field = detail.get("field")
    if field == "args.session":
        # A frame has no session of its own (the decoder refuses one): what does not fit the
        # session (an op of the other generation, a plain op on a model's) is the frame's op.
        detail["field"] = f"args.frames[{index}].op"
    elif field == "args":  # the op's arguments as a whole (exactly one of tokens and embeds, say)
        detail["field"] = f"args.frames[{index}].args"
    elif isinstance(field, str) and field.startswith("args."):
        detail["field"] = f"args.frames[{index}].{field}"
    if detail.get("field") != field and message.startswith(field):
        message = detail["field"] + message[len(field):]
    detail["frame"] = index
    return OpError(code, message, detail)


def open_plain_session(server, call):
    args = call.args
    kind = args.get("kind", "mamba")
    axes = ROW_AXES[kind]
    for other_kind, other_axes in ROW_AXES.items():
        for name in other_axes:
            if name not in axes and name in args:
                raise OpError("invalid_argument",
                              f"args.{name}: expected only {', '.join(axes)} for kind {kind!r}, got {name} "
                              f"(an argument of kind {other_kind!r})",
                              {"field": f"args.{name}", "expected": f"the axes of kind {kind!r}: {', '.join(axes)}",
                               "got": name})
    for name in axes:
        if name not in args:
            raise OpError("missing_argument", f"args.{name}: expected a positive int (kind {kind!r}), got nothing",
                          {"field": f"args.{name}", "expected": "a positive int", "got": "nothing",
                           "op": "session_open"})
    if isinstance(args["state"], dict):
        raise OpError("invalid_argument",
                      f"args.state: expected a positive int (the state size of kind {kind!r}), got a map of tensors "
                      "(a model session's state, which needs args.model)",
                      {"field": "args.state", "expected": "a positive int", "got": "a map of tensors"})
    layout = StateLayout.single(kind, tuple(args[name] for name in axes))
    h0 = initial_state(server, call, kind, (args["batch"], *layout.shape))
    return open_filled(server, call, args["batch"], layout, None if h0 is None else lambda session: session.write(h0))


def require_float(value, field: str) -> None:
    """invalid_argument unless `value` (a tensor or WireTensor) has a floating dtype: a state's."""
    dtype = dtype_of(value)
    if dtype not in scan_kernels.FLOAT_DTYPES:
        expected = f"a floating dtype ({', '.join(WIRE_DTYPES[d] for d in scan_kernels.FLOAT_DTYPES)})"
        got = WIRE_DTYPES[dtype]
        raise OpError("invalid_argument", f"{field}: expected {expected}, got {got}",
                      {"field": field, "expected": expected, "got": got})


def initial_state(server, call, kind: str, shape: tuple[int, ...]) -> torch.Tensor | None:
    """args.h0 of the plain session's state shape (any float dtype; the session keeps it as
    fp32 on its device; a handle's tensor, else a view of the wire bytes), or None when it is
    not given: what a client that exported a
    session with session_state sends to reopen it elsewhere."""
    value = server.tensor_arg(call, "h0")
    if value is None:
        return None
    require_float(value, "args.h0")
    if tuple(value.shape) != shape:
        expected = f"shape {list(shape)} ([batch, {', '.join(ROW_AXES[kind])}])"
        raise OpError("shape_mismatch", f"args.h0: expected {expected}, got shape {list(value.shape)}",
                      {"field": "args.h0", "expected": expected, "got": f"shape {list(value.shape)}"})
    # Wire bytes stay a view of the frame until the session is open (its limits checked):
    # Session.write makes the one copy, on the device.
    return value if isinstance(value, torch.Tensor) else host_view(value)


def open_model_session(server, call):
    """A session of a model's: zero state, or the state given (as session_state returned it)."""
    args = call.args
    for name in ("kind", *{axis for axes in ROW_AXES.values() for axis in axes} - {"state"}):
        if name in args:
            raise OpError("invalid_argument", f"args.{name}: expected no {name} with a model (its layers fix the "
                          f"state's shape), got one",
                          {"field": f"args.{name}", "expected": "no " + name + " with args.model", "got": name})
    if "h0" in args:
        expected = "no h0 with args.model (a model session's saved state goes in args.state)"
        raise OpError("invalid_argument", f"args.h0: expected {expected}, got h0",
                      {"field": "args.h0", "expected": expected, "got": "h0"})
    loaded = server.model(call.conn, args["model"], "args.model")
    saved = args.get("state")
    if saved is not None and not isinstance(saved, dict):
        raise OpError("invalid_argument",
                      "args.state: expected a map of the model's state tensors by name, got an int",
                      {"field": "args.state", "expected": "a map of state tensors by name", "got": "an int"})
    parts = None if saved is None else state_parts(server, call, loaded.layout, args["batch"], saved)
    return open_filled(server, call, args["batch"], loaded.layout,
                       None if parts is None else lambda session: session.write_parts(parts))


def state_parts(server, call, layout, batch: int, saved: dict) -> dict:
    """A saved state's tensors, every part of `layout` present with `batch` rows, floating."""
    expected = {name: (batch, *shape) for name, shape in layout.parts}
    for name in saved:
        if name not in expected:
            field = protocol.key_path("args.state", name)
            raise OpError("invalid_argument", f"{field}: expected only the model's state parts "
                          f"(layers.<i>.conv, layers.<i>.ssm), got {protocol.shown_key(name)}",
                          {"field": field, "expected": "a state part of the model",
                           "got": protocol.key_path("", name)})
    parts = {}
    for name, shape in expected.items():
        field = f"args.state.{name}"
        if name not in saved:
            raise OpError("missing_argument", f"{field}: expected a tensor of shape {list(shape)}, got nothing",
                          {"field": field, "expected": f"a tensor of shape {list(shape)}", "got": "nothing",
                           "op": "session_open"})
        value = saved[name]
        # as initial_state's: the session's own copy, made once it is open, is the only one
        tensor = (host_view(value) if isinstance(value, protocol.WireTensor)
                  else server.tensor_in_map(call, value, field))
        require_float(tensor, field)
        if tuple(tensor.shape) != shape:
            raise OpError("shape_mismatch", f"{field}: expected shape {list(shape)}, got shape {list(tensor.shape)}",
                          {"field": field, "expected": f"shape {list(shape)}", "got": f"shape {list(tensor.shape)}"})
        parts[name] = tensor
    return parts


def session_of_kind(server, call, kinds: tuple[str, ...], op: str):
    """The request's session, which must be of one of `kinds`: a Mamba-1 session takes no
    Mamba-2 work, nor the other way round, and a model's session only the model ops."""
    session = server.session(call.conn, call.args["session"], "args.session")
    if session.kind not in kinds:
        wanted = " or ".join(map(repr, kinds))
        raise OpError("invalid_argument",
                      f"args.session: expected a session of kind {wanted} for {op}, got one of kind {session.kind!r}",
                      {"field": "args.session", "expected": f"kind {wanted}", "got": f"kind {session.kind!r}"})
    return session


def session_close(server, call) -> dict:
    server.sessions.remove(call.conn.id, call.args["session"], "args.session")
    return {"closed": True}


def session_state(server, call) -> dict:
    session = server.session(call.conn, call.args["session"], "args.session")
    start = now_ns()
    state = wire_state(session)
    call.timing.add("d2h", now_ns() - start)
    return {"state": state}


def wire_state(session):
    """A plain session's state tensor; a model session's every part, by name."""
    if session.kind == "model":
        return {name: to_wire(part) for name, part in session.read_parts().items()}
    return to_wire(session.read())


def state_tensor_bytes(session) -> list[int]:
    """The bytes of each tensor of the session's state as wire_state gives it."""
    return [session.batch * state_row_bytes(shape) for _, shape in session.layout.parts]


def check_reply_with_state_fits(call, session, output_bytes: int) -> None:
    """A step's or a prefill's reply, its output of `output_bytes` (a plain step's or scan's y:
    x's shape and dtype) and the session's state where it asks for it, checked before it runs
    (check_reply_fits)."""
    state = state_tensor_bytes(session) if call.args.get("return_state") else []
    check_reply_fits(call.request, [output_bytes, *state])


def with_states(items: list[Item], results: list[dict]) -> list[dict]:
    """`results` of a launch, those of the requests that asked for return_state with their
    session's state after it (as session_state gives it). The copies are the launch's d2h,
    charged to every member as its other shared stages are (SPEC §6.3)."""
    asking = [(item, result) for item, result in zip(items, results) if item.call.args.get("return_state")]
    if asking:
        start = now_ns()
        for item, result in asking:
            result["state"] = wire_state(item.session)
        charge(items, "d2h", now_ns() - start)
    return results


def session_snapshot(server, call) -> dict:
    session = server.session(call.conn, call.args["session"], "args.session")
    return {"snapshot": server.take_snapshot(call.conn, session)}


def session_restore(server, call) -> dict:
    # The whole state is overwritten: a session a failed step left lost is whole again.
    session = server.session(call.conn, call.args["session"], "args.session", lost_ok=True)
    if "frames" not in call.args:
        server.snapshots.restore(call.conn.id, call.args["snapshot"], session, "args.snapshot")
        return {"restored": True}
    # A rollback and its re-simulation in one request; a frame that fails leaves the snapshot's
    # state, as a restore alone would (undoing the request entirely would cost a copy of the
    # state, see docs/performance.md, "rollback in one request").
    def restore() -> None:
        if not session.closed:
            server.snapshots.restore(call.conn.id, call.args["snapshot"], session, "args.snapshot")

    refuse_copies_into_restored(call)
    restore()
    return {"restored": True, "frames": run_frames(server, call, session, undo=restore)}


def refuse_copies_into_restored(call) -> None:
    """A frame may not copy into the snapshot its request restores: a frame failing after it
    would restore the copy instead of the state the request was asked to restore. Refused before
    anything runs, so without detail.frame, which says that the restore was done (SPEC §6.4)."""
    snapshot_id = call.args["snapshot"]
    for i, frame in enumerate(call.args["frames"]):
        if frame.args.get("snapshot_into") == snapshot_id:
            field = f"args.frames[{i}].args.snapshot_into"
            raise OpError("invalid_argument",
                          f"{field}: expected a snapshot other than args.snapshot (the one this request restores, "
                          f"and restores again should a frame fail), got {protocol.shown_value(snapshot_id)}",
                          {"field": field, "expected": "a snapshot other than args.snapshot", "got": snapshot_id})


def session_fork(server, call) -> dict:
    """A new session of the same class and batch holding a copy of the session's state."""
    session = server.session(call.conn, call.args["session"], "args.session")
    fork = open_filled(server, call, session.batch, session.layout, lambda fork: fork.write_rows(session.read_rows()))
    return {"session": fork.id}


def snapshot_free(server, call) -> dict:
    server.snapshots.remove(call.conn.id, call.args["snapshot"], "args.snapshot")
    return {"freed": True}


def put(server, call) -> dict:
    return {"handle": server.put_tensor(call, "tensor")}


def free(server, call) -> dict:
    server.handles.remove(call.conn.id, call.args["handle"], "args.handle")
    return {"freed": True}


def check_rows(session, values: dict) -> None:
    """Every per-row value has the session's batch on its first axis. Checked here, not left to
    the kernel: in a batched launch, one request's extra row and another's missing row would
    add up to the right total and shift rows between callers."""
    for name, value in values.items():
        if value is not None and (len(value.shape) == 0 or value.shape[0] != session.batch):
            raise OpError("shape_mismatch",
                          f"args.{name}: expected {session.batch} rows on the first axis (the session's "
                          f"batch), got shape {list(value.shape)}",
                          {"field": f"args.{name}", "expected": f"{session.batch} rows",
                           "got": str(list(value.shape))})


class StepOp(BatchedOp):
    """One timestep for every row of a session, its state updated in place in the pool."""

    def fast_path(self, server) -> NativeStep | None:
        """Plain steps served from frame to reply in C++ (bridge.native), where the server runs
        the CPU kernels and its config allows it; None: every step goes the general way."""
        return NativeStep.for_server(server) if server.config.native_step else None

    def prepare(self, server, call) -> Item:
        args = call.args
        session = session_of_kind(server, call, tuple(ROW_AXES), "step")
        own = {name: server.tensor_arg(call, name) for name in ROW_ARGS}
        shared = shared_args(server, call)
        check_rows(session, own)
        check_reply_with_state_fits(call, session, nbytes_of(own["x"]))
        options = dt_options(args)
        # One pool per class (kind, row shape): it names the pool and the state's shape.
        key = ("step", session.kind, session.shape, *(row_signature(t) for t in own.values()),
               *(signature(t) for t in shared.values()), *options.values())
        return Item(call, key, session.batch, own, shared, session, options)

    def run(self, server, items: list[Item]) -> list[dict]:
        lead = items[0]
        sessions = [item.session for item in items]
        # The kernels (and a capture, which computes nothing) check every argument before they
        # compute: a step they refuse wrote no row.
        refused = (scan_kernels.KernelInputError,)
        # Captured steps (CUDA graphs) replay Mamba-1 state updates only.
        mamba2 = lead.session.kind == "ssd"
        if server.step_graphs is not None and not mamba2:
            with WritingState(sessions, unwritten=refused):
                y = server.step_graphs.run(items, lead.shared)
                if y is not None:  # on the host already, its copy charged as d2h
                    server.probe.note_launch()  # the replay waited for the device (no kernel_timer here)
                    return with_states(items, [{"y": y_rows} for y_rows in member_rows(to_wire(y), items)])
        start = now_ns()
        rows = {name: stack_rows(server, [item.tensors[name] for item in items]) for name in ROW_ARGS}
        slots = stack_rows(server, [item.session.slots for item in items])
        shared = shared_tensors(server, lead)
        charge(items, "h2d", now_ns() - start)
        with WritingState(sessions, unwritten=refused):
            with server.kernel_timer(*(item.call for item in items)):
                update = scan_kernels.ssd_state_update if mamba2 else scan_kernels.selective_state_update
                y = update(
                    lead.session.pool.rows, rows["x"], rows["dt"], shared["A"], rows["B"], rows["C"],
                    D=shared["D"], z=rows["z"], dt_bias=shared["dt_bias"], **lead.options,
                    slots=slots, backend=server.backend)
            return with_states(items, [{"y": y_rows} for y_rows in wire_rows(y, items)])


step = StepOp()

HANDLERS = {
    "session_open": session_open,
    "session_close": session_close,
    "session_state": session_state,
    "session_snapshot": session_snapshot,
    "session_restore": session_restore,
    "session_fork": session_fork,
    "snapshot_free": snapshot_free,
    "step": step,
    "put": put,
    "free": free,
}
