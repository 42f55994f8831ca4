"""scan: the full selective scan over a window (DESIGN §2)."""

from __future__ import annotations

import kernels

from ..tensors import to_wire
from ..timing import now_ns

TENSOR_ARGS = ("x", "dt", "A", "B", "C")
OPTIONAL_TENSOR_ARGS = ("D", "z", "dt_bias", "h0")


def scan(server, call) -> dict:
    args = call.args
    if args.get("session") is not None:
        server.session(call.conn, args["session"], "args.session")
    tensors = {name: server.tensor(call, name) for name in TENSOR_ARGS}
    for name in OPTIONAL_TENSOR_ARGS:
        tensors[name] = server.tensor(call, name, required=False)
    return_state = bool(args.get("return_state", False))
    with server.kernel_timer(call):
        out = kernels.selective_scan(
            tensors["x"], tensors["dt"], tensors["A"], tensors["B"], tensors["C"],
            D=tensors["D"], z=tensors["z"], dt_bias=tensors["dt_bias"],
            dt_softplus=bool(args.get("dt_softplus", False)),
            dt_min=args.get("dt_min"), dt_max=args.get("dt_max"), h0=tensors["h0"],
            return_state=return_state, layout=args.get("layout", "bld"), backend=server.backend)
    y, state = out if return_state else (out, None)
    start = now_ns()
    result = {"y": to_wire(y)}
    if state is not None:
        result["state"] = to_wire(state)
    call.timing.add("d2h", now_ns() - start)
    return result


HANDLERS = {"scan": scan}
