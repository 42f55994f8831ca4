"""The state update captured as a CUDA graph, for a caller that repeats one problem many times
(the bridge's steps: the same session pool, A, shapes and options every frame).

What it saves is host time, which bounds a small step on a GPU: a replay is one call where the
Triton backend's launch and the kernels API's checks are many, and the server's step was faster
with captures (docs/performance.md, "triton launch host time" and "CUDA graph steps").

A capture owns one pinned host buffer and one device buffer holding every per-call input (x,
dt, B, C, z, slots) at fixed offsets, and y's buffers. A call writes its inputs into the host
buffer, then `run` copies that buffer to the device in one transfer, replays the kernel, copies y
back and waits. The state pool and A, D, dt_bias are the tensors the capture was made with: the
graph holds their addresses. It holds them weakly, so a capture never keeps a pool or a handle's
memory alive; `alive()` says whether all are still there, and `run` refuses to replay otherwise
(their memory may since belong to another tensor).
"""

from __future__ import annotations

import threading
import weakref

import numpy as np
import torch

from ..cuda_graphs import capture_graph
from .common import run_on_device_of
from .state_update import update_launch

# Where each input starts in the staging buffers: aligned for every dtype and for the kernel's
# vector loads.
_ALIGN = 256

# Inputs written per call, in the staging buffer's order (z only where the capture has one).
STAGED = ("x", "dt", "B", "C", "z", "slots")


class CapturedStateUpdate:
    """One state update problem, captured; see the module docstring."""

    def __init__(self, state, x, dt, A, B, C, *, D, z, dt_bias, dt_softplus, dt_min, dt_max, slots):
        """Arguments as `scan_kernels._args.check_state_update` normalised them (B, C [batch, groups,
        state]; CUDA tensors); x, dt, B, C, z and slots give only shapes and dtypes."""
        self.device = x.device
        self.rows, self.dim = x.shape
        examples = {"x": x, "dt": dt, "B": B, "C": C, "z": z, "slots": slots}
        layout, offset = {}, 0
        for name in STAGED:
            t = examples[name]
            if t is None:
                continue
            layout[name] = (offset, t.dtype, tuple(t.shape))
            offset += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
        self._host = torch.empty(offset, dtype=torch.uint8, pin_memory=True)
        self._device_in = torch.empty(offset, dtype=torch.uint8, device=self.device)
        host_bytes = self._host.numpy()
        # Per input: the bytes a call writes (numpy, any dtype's bytes) and the kernel's view.
        self.staging: dict[str, np.ndarray] = {}
        device_views = {}
        for name, (start, dtype, shape) in layout.items():
            size = int(np.prod(shape)) * dtype.itemsize
            self.staging[name] = host_bytes[start:start + size]
            device_views[name] = self._device_in[start:start + size].view(dtype).view(shape)
        self._device_y = torch.empty((self.rows, self.dim), dtype=x.dtype, device=self.device)
        self._host_y = torch.empty((self.rows, self.dim), dtype=x.dtype, pin_memory=True)
        self._held = [weakref.ref(t) for t in (state, A, D, dt_bias) if t is not None]
        _, launch = update_launch(state, device_views["x"], device_views["dt"], A, device_views["B"],
                                  device_views["C"], D=D, z=device_views.get("z"), dt_bias=dt_bias,
                                  dt_softplus=dt_softplus, dt_min=dt_min, dt_max=dt_max,
                                  slots=device_views["slots"], out=self._device_y, blocks=None)
        self._graph = _capture(launch, device_views["slots"], device_views["x"])
        self._lock = threading.Lock()

    def stage(self, name: str, *parts) -> None:
        """Write input `name` (one of STAGED) for the next `run`: its bytes in C order, in the
        capture's dtype and shape, given whole or as consecutive parts (buffers)."""
        target = self.staging[name]
        sources = [np.frombuffer(part, np.uint8) for part in parts]
        got = sum(source.nbytes for source in sources)
        if got != target.nbytes:
            raise ValueError(f"{name}: expected {target.nbytes} bytes (the captured shape), got {got}")
        offset = 0
        for source in sources:
            target[offset:offset + source.nbytes] = source
            offset += source.nbytes

    def alive(self) -> bool:
        """Whether the state pool and A, D, dt_bias the graph reads are all still allocated."""
        return all(ref() is not None for ref in self._held)

    def run(self) -> torch.Tensor:
        """The update for the inputs written into `staging`: the state rows the slots name
        updated in place; returns y, pinned host memory that the next `run` overwrites."""
        with self._lock:
            if not self.alive():
                raise RuntimeError("the captured state update's state pool or A/D/dt_bias tensor was freed")
            with torch.cuda.device(self.device):
                stream = torch.cuda.current_stream()
                self._device_in.copy_(self._host, non_blocking=True)
                self._graph.replay()
                self._host_y.copy_(self._device_y, non_blocking=True)
                stream.synchronize()
        return self._host_y


def _capture(launch, slots: torch.Tensor, x: torch.Tensor) -> torch.cuda.CUDAGraph:
    """`launch` captured as a graph, its warm-up run with every slot -1: padding rows, whose
    state the kernel neither reads nor writes."""
    slots.fill_(-1)
    graph, _ = capture_graph(lambda: run_on_device_of(x, [launch]), x.device)
    return graph
