"""scan_backward and ssd_scan_backward: the gradients of a scan (protocol/SPEC.md §6.5). Each
takes the forward's arguments plus dy (and optionally dstate) and replies one gradient per
tensor input given, "d" + its name. They run alone (not batched)."""

from __future__ import annotations

import scan_kernels
from protocol import WireTensor

from ..batcher import dt_options
from ..tensors import to_wire
from ..timing import now_ns
from .scan import boundaries_arg

INPUTS = ("dy", "x", "dt", "A", "B", "C", "D", "z", "dt_bias", "h0", "dstate")


def _gradients(server, call, backward, options: dict) -> dict:
    start = now_ns()
    t = {}
    for name in INPUTS:
        value = server.tensor_arg(call, name)
        t[name] = server.device_tensor(value) if isinstance(value, WireTensor) else value
    call.timing.add("h2d", now_ns() - start)
    for name in ("cu_seqlens", "seq_idx"):
        if name in call.args:
            options[name] = boundaries_arg(server, call, name)
    with server.kernel_timer(call):
        grads = backward(t["dy"], t["x"], t["dt"], t["A"], t["B"], t["C"], D=t["D"], z=t["z"],
                         dt_bias=t["dt_bias"], h0=t["h0"], dstate=t["dstate"], backend=server.backend,
                         **dt_options(call.args), **options)
    start = now_ns()
    result = {"d" + name: to_wire(g) for name, g in grads.items()}
    call.timing.add("d2h", now_ns() - start)
    return result


def scan_backward(server, call) -> dict:
    return _gradients(server, call, scan_kernels.selective_scan_backward, {"layout": call.args.get("layout", "bld")})


def ssd_scan_backward(server, call) -> dict:
    return _gradients(server, call, scan_kernels.ssd_scan_backward, {"chunk_size": call.args.get("chunk_size")})


# Training's calls can take seconds, and a reader thread serving one reads nothing else meanwhile
# (health, a cancel): the worker serves them (Dispatcher.on_frame).
scan_backward.worker_only = ssd_scan_backward.worker_only = True

HANDLERS = {"scan_backward": scan_backward, "ssd_scan_backward": ssd_scan_backward}
