"""Sessions and tensor handles (protocol/SPEC.md §6.1, §6.2): session_open, session_close, session_state, step,
put, free. What they manage lives in bridge.sessions and bridge.handles; step is batched
(bridge.batcher)."""

from __future__ import annotations

import kernels

from ..batcher import (BatchedOp, Item, charge, dt_options, member_rows, row_signature, shared_args,
                       shared_tensors, signature, stack_rows, wire_rows)
from ..errors import OpError
from ..native import NativeStep
from ..sessions import ROW_AXES
from ..tensors import to_wire
from ..timing import now_ns

# Arguments with one row per session row, stacked when steps share a launch.
ROW_ARGS = ("x", "dt", "B", "C", "z")


def session_open(server, call) -> dict:
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
                          {"field": f"args.{name}", "op": "session_open"})
    session = server.open_session(call.conn, args["batch"], kind, tuple(args[name] for name in axes))
    return {"session": session.id}


def session_of_kind(server, call, kind: str, op: str):
    """The request's session, which must be of `kind` (a Mamba-1 session takes no Mamba-2 work,
    nor the other way round)."""
    session = server.session(call.conn, call.args["session"], "args.session")
    if session.kind != kind:
        raise OpError("invalid_argument",
                      f"args.session: expected a session of kind {kind!r} for {op}, got one of kind {session.kind!r}",
                      {"field": "args.session", "expected": f"kind {kind!r}", "got": f"kind {session.kind!r}"})
    return session


def session_close(server, call) -> dict:
    server.sessions.remove(call.conn.id, call.args["session"], "args.session")
    return {"closed": True}


def session_state(server, call) -> dict:
    session = server.session(call.conn, call.args["session"], "args.session")
    start = now_ns()
    state = to_wire(session.read())
    call.timing.add("d2h", now_ns() - start)
    return {"state": state}


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
        session = server.session(call.conn, args["session"], "args.session")
        own = {name: server.tensor_arg(call, name) for name in ROW_ARGS}
        shared = shared_args(server, call)
        check_rows(session, own)
        options = dt_options(args)
        # One pool per class (kind, row shape): it names the pool and the state's shape.
        key = ("step", session.kind, session.shape, *(row_signature(t) for t in own.values()),
               *(signature(t) for t in shared.values()), *options.values())
        return Item(call, key, session.batch, own, shared, session, options)

    def run(self, server, items: list[Item]) -> list[dict]:
        lead = items[0]
        # Captured steps (CUDA graphs) replay Mamba-1 state updates only.
        mamba2 = lead.session.kind == "ssd"
        if server.step_graphs is not None and not mamba2:
            y = server.step_graphs.run(items, lead.shared)
            if y is not None:  # on the host already, its copy charged as d2h
                return [{"y": y_rows} for y_rows in member_rows(to_wire(y), items)]
        start = now_ns()
        rows = {name: stack_rows(server, [item.tensors[name] for item in items]) for name in ROW_ARGS}
        slots = stack_rows(server, [item.session.slots for item in items])
        shared = shared_tensors(server, lead)
        charge(items, "h2d", now_ns() - start)
        with server.kernel_timer(*(item.call for item in items)):
            update = kernels.ssd_state_update if mamba2 else kernels.selective_state_update
            y = update(
                lead.session.pool.rows, rows["x"], rows["dt"], shared["A"], rows["B"], rows["C"],
                D=shared["D"], z=rows["z"], dt_bias=shared["dt_bias"], **lead.options,
                slots=slots, backend=server.backend)
        return [{"y": y_rows} for y_rows in wire_rows(y, items)]


step = StepOp()

HANDLERS = {
    "session_open": session_open,
    "session_close": session_close,
    "session_state": session_state,
    "step": step,
    "put": put,
    "free": free,
}
