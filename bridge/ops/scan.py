"""scan and ssd_scan: the full Mamba-1 / Mamba-2 scan over a window (protocol/SPEC.md §6); a scan is
batched with other scans of the same shape. With `session`, a prefill: the session's state is the
initial state and the last state is written back to it. With `cu_seqlens`, packed sequences, run
alone."""

from __future__ import annotations

import torch

import scan_kernels
from protocol import WireTensor

from ..batcher import (BatchedOp, Item, charge, dt_options, nbytes_of, row_signature, shared_args, shared_tensors,
                       signature, split_rows, stack_rows, wire_rows)
from ..errors import OpError
from ..sessions import STATE_DTYPE, WritingState
from ..tensors import host_view, to_wire
from ..timing import now_ns
from .sessions import check_reply_with_state_fits, check_rows, session_of_kind

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


def prefilled_session(server, call, kind: str, op: str):
    """The session a scan prefills (of `kind`), or None; a session excludes h0 and packed sequences."""
    args = call.args
    if args.get("session") is None:
        return None
    session = session_of_kind(server, call, (kind,), op)
    packed = "a session holds one state per row, not per packed sequence"
    for name, why in (("h0", "the session's state is the initial state"), ("cu_seqlens", packed), ("seq_idx", packed)):
        if name in args:
            raise OpError("invalid_argument", f"args.{name}: expected no {name} with a session ({why}), got a tensor",
                          {"field": f"args.{name}", "expected": "nothing", "got": "a tensor"})
    return session


def boundaries_arg(server, call, name: str = "cu_seqlens"):
    """cu_seqlens or seq_idx as a host tensor: the kernels read the boundaries on the host in any case."""
    value = server.tensor_arg(call, name)
    return host_view(value) if isinstance(value, WireTensor) else value.cpu()


def kept_state(item: Item, state: torch.Tensor) -> torch.Tensor:
    """The final state a reply returns: with a session, the one it keeps (SPEC §6.1: fp32 whatever
    the inputs' dtype), else the kernel's own."""
    return state.to(STATE_DTYPE) if item.session is not None else state


class ScanOp(BatchedOp):
    """The scan of a window for every row; with a session, its state in and out."""

    def prepare(self, server, call) -> Item:
        args = call.args
        layout = args.get("layout", "bld")
        session = prefilled_session(server, call, "mamba", "scan")
        own = {name: server.tensor_arg(call, name) for name in ROW_ARGS if name != "h0"}
        shared = shared_args(server, call)
        if session is not None:
            _check_session_dims(session, own["x"], shared["A"], layout)
            check_reply_with_state_fits(call, session, nbytes_of(own["x"]))
            h0_signature = (session.pool.rows.dtype, (session.dim, session.state))
        else:
            own["h0"] = server.tensor_arg(call, "h0")
            h0_signature = row_signature(own["h0"])
        x = own["x"]
        options = dt_options(args)
        key = None
        if "cu_seqlens" in args:
            options["cu_seqlens"] = boundaries_arg(server, call)
        # Only requests whose per-row values all have x's rows share a launch (else one request's
        # extra row could make up for another's missing one), and none of x's sizes is 0 (the
        # stacked x would not be empty); a malformed request runs alone, and the kernel's error
        # names its own shapes.
        elif len(x.shape) == 3 and 0 not in x.shape and nbytes_of(x) <= BATCH_MAX_X_BYTES and \
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
        # The kernel reads the sessions' states from copies (h0): only the writes back change them.
        written = []
        with WritingState(written):
            with server.kernel_timer(*(item.call for item in items)):
                out = scan_kernels.selective_scan(
                    stacked["x"], stacked["dt"], shared["A"], stacked["B"], stacked["C"],
                    D=shared["D"], z=stacked["z"], dt_bias=shared["dt_bias"], **lead.options,
                    h0=stacked["h0"], return_state=need_state, layout=lead.call.args.get("layout", "bld"),
                    backend=server.backend)
                y, state = out if need_state else (out, None)
                if not need_state:
                    states = [None] * len(items)
                elif len(items) == 1:  # alone: with cu_seqlens, one state row per packed sequence
                    states = [state]
                else:
                    states = split_rows(state, items)
                for item, item_state in zip(items, states):
                    if item.session is not None:
                        written.append(item.session)
                        item.session.write(item_state)
            results = [{"y": y_rows} for y_rows in wire_rows(y, items)]
            start = now_ns()
            for item, result, item_state in zip(items, results, states):
                if item.call.args.get("return_state"):
                    result["state"] = to_wire(kept_state(item, item_state))
        charge(items, "d2h", now_ns() - start)
        return results


class SsdScanOp(BatchedOp):
    """The Mamba-2 (SSD) scan of a window, run alone; with a session of kind "ssd", its state in
    and out."""

    def prepare(self, server, call) -> Item:
        args = call.args
        session = prefilled_session(server, call, "ssd", "ssd_scan")
        own = {name: server.tensor_arg(call, name) for name in ROW_ARGS}
        if session is not None:
            check_rows(session, {"x": own["x"]})
            if len(own["x"].shape) == 4 and tuple(own["x"].shape[2:]) != session.shape[:2]:
                raise OpError("shape_mismatch",
                              f"args.x: expected heads and headdim {list(session.shape[:2])} (the session's), "
                              f"got shape {list(own['x'].shape)}",
                              {"field": "args.x", "expected": f"[batch, seq, {session.shape[0]}, {session.shape[1]}]",
                               "got": str(list(own["x"].shape))})
            B = own["B"]
            if len(B.shape) == 4 and B.shape[3] != session.state:
                raise OpError("shape_mismatch",
                              f"args.B: expected {session.state} states (the session's state) on its last axis, "
                              f"got shape {list(B.shape)}",
                              {"field": "args.B", "expected": f"state {session.state}", "got": str(list(B.shape))})
            check_reply_with_state_fits(call, session, nbytes_of(own["x"]))
        options = dt_options(args)
        for name in ("cu_seqlens", "seq_idx"):
            if name in args:
                options[name] = boundaries_arg(server, call, name)
        if "chunk_size" in args:
            options["chunk_size"] = args["chunk_size"]
        if args.get("return_varlen_states") and not ("cu_seqlens" in options or "seq_idx" in options):
            raise OpError("invalid_argument",
                          "args.return_varlen_states: expected packed sequences (cu_seqlens or seq_idx) to return "
                          "a state for, got neither",
                          {"field": "args.return_varlen_states", "expected": "cu_seqlens or seq_idx",
                           "got": "neither"})
        rows = own["x"].shape[0] if len(own["x"].shape) else 1
        return Item(call, None, rows, own, shared_args(server, call), session, options)

    def run(self, server, items: list[Item]) -> list[dict]:
        (item,) = items
        start = now_ns()
        rows = {name: stack_rows(server, [item.tensors[name]]) for name in ROW_ARGS}
        if item.session is not None:
            rows["h0"] = item.session.read()
        shared = shared_tensors(server, item)
        charge(items, "h2d", now_ns() - start)
        returned = bool(item.call.args.get("return_state") or item.call.args.get("return_varlen_states"))
        need_state = item.session is not None or returned
        written = []  # as ScanOp's: only the write back changes the session's state
        with WritingState(written):
            with server.kernel_timer(item.call):
                out = scan_kernels.ssd_scan(
                    rows["x"], rows["dt"], shared["A"], rows["B"], rows["C"], D=shared["D"], z=rows["z"],
                    dt_bias=shared["dt_bias"], h0=rows["h0"], return_state=need_state, backend=server.backend,
                    **item.options)
                y, state = out if need_state else (out, None)
                if item.session is not None:
                    written.append(item.session)
                    item.session.write(state)
            start = now_ns()
            result = {"y": to_wire(y)}
            if returned:
                result["state"] = to_wire(kept_state(item, state))
        charge(items, "d2h", now_ns() - start)
        return [result]


scan = ScanOp()
ssd_scan = SsdScanOp()

HANDLERS = {"scan": scan, "ssd_scan": ssd_scan}
