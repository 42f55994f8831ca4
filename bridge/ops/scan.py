"""scan: the full selective scan over a window (protocol/SPEC.md §6), batched with other scans of the same
shape; with `session`, a prefill: the session's state is the initial state and the last state is
written back to it."""

from __future__ import annotations

import kernels
from protocol import WireTensor

from ..batcher import (BatchedOp, Item, charge, dt_options, row_signature, shared_args, shared_tensors,
                       signature, split_rows, stack_rows, wire_rows)
from ..errors import OpError
from ..tensors import to_wire
from ..timing import now_ns
from .sessions import check_rows

ROW_ARGS = ("x", "dt", "B", "C", "z", "h0")
# A request whose x is bigger runs alone: stacking it with others copies every input once more,
# which costs more than the launch it would save (see SPEC, "Batching").
BATCH_MAX_X_BYTES = 256 * 1024


def _check_session_dims(session, x, A, layout: str) -> None:
    """x and A agree with the session's [batch, dim, state] (when they have the shapes the kernel
    takes; otherwise the kernel's own check names the problem)."""
    if len(x.shape) != 3 or len(A.shape) != 2:
        return
    check_rows(session, {"x": x})
    dim = x.shape[2] if layout == "bld" else x.shape[1]
    if dim != session.dim:
        raise OpError("shape_mismatch",
                      f"args.x: expected {session.dim} channels (the session's dim) in layout {layout}, "
                      f"got shape {list(x.shape)}",
                      {"field": "args.x", "expected": f"dim {session.dim}", "got": str(list(x.shape))})
    if A.shape[1] != session.state:
        raise OpError("shape_mismatch",
                      f"args.A: expected {session.state} states (the session's state) on its second axis, "
                      f"got shape {list(A.shape)}",
                      {"field": "args.A", "expected": f"state {session.state}", "got": str(list(A.shape))})


def _nbytes(value) -> int:
    return value.data.nbytes if isinstance(value, WireTensor) else value.numel() * value.element_size()


class ScanOp(BatchedOp):
    """The scan of a window for every row; with a session, its state in and out."""

    def prepare(self, server, call) -> Item:
        args = call.args
        layout = args.get("layout", "bld")
        session = None
        if args.get("session") is not None:
            session = server.session(call.conn, args["session"], "args.session")
            if "h0" in args:
                raise OpError("invalid_argument",
                              "args.h0: expected no h0 with a session (the session's state is the "
                              "initial state), got a tensor",
                              {"field": "args.h0", "expected": "nothing", "got": "a tensor"})
        own = {name: server.tensor_arg(call, name) for name in ROW_ARGS if name != "h0"}
        shared = shared_args(server, call)
        if session is not None:
            _check_session_dims(session, own["x"], shared["A"], layout)
            h0_signature = (session.pool.rows.dtype, (session.dim, session.state))
        else:
            own["h0"] = server.tensor_arg(call, "h0")
            h0_signature = row_signature(own["h0"])
        x = own["x"]
        options = dt_options(args)
        key = None
        # Only requests whose per-row values all have x's rows share a launch (else one request's
        # extra row could make up for another's missing one); a malformed request runs alone, and
        # the kernel's error names its own shapes.
        if len(x.shape) == 3 and _nbytes(x) <= BATCH_MAX_X_BYTES and \
                all(v is None or (len(v.shape) >= 1 and v.shape[0] == x.shape[0]) for v in own.values()):
            key = ("scan", layout, *(row_signature(own[name]) for name in ("x", "dt", "B", "C", "z")),
                   h0_signature, *(signature(t) for t in shared.values()), *options.values())
        rows = x.shape[0] if len(x.shape) else 1
        return Item(call, key, rows, own, shared, session, options)

    def run(self, server, items: list[Item]) -> list[dict]:
        lead = items[0]
        start = now_ns()
        for item in items:
            if item.session is not None:
                item.tensors["h0"] = item.session.read()
        stacked = {name: stack_rows(server, [item.tensors[name] for item in items]) for name in ROW_ARGS}
        shared = shared_tensors(server, lead)
        charge(items, "h2d", now_ns() - start)
        # The final state is computed when anyone needs it: to return, or to keep in a session.
        need_state = any(item.session is not None or item.call.args.get("return_state") for item in items)
        with server.kernel_timer(*(item.call for item in items)):
            out = kernels.selective_scan(
                stacked["x"], stacked["dt"], shared["A"], stacked["B"], stacked["C"],
                D=shared["D"], z=stacked["z"], dt_bias=shared["dt_bias"], **lead.options,
                h0=stacked["h0"], return_state=need_state, layout=lead.call.args.get("layout", "bld"),
                backend=server.backend)
            y, state = out if need_state else (out, None)
            states = split_rows(state, items) if need_state else [None] * len(items)
            for item, item_state in zip(items, states):
                if item.session is not None:
                    item.session.write(item_state)
        results = [{"y": y_rows} for y_rows in wire_rows(y, items)]
        start = now_ns()
        for item, result, item_state in zip(items, results, states):
            if item.call.args.get("return_state"):
                result["state"] = to_wire(item_state)
        charge(items, "d2h", now_ns() - start)
        return results


scan = ScanOp()

HANDLERS = {"scan": scan}
