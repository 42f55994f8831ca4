"""A model's whole step on CUDA as one captured graph (issue 34): every layer's norm, projections,
conv window, state update and gated norm, and the final norm and head, replayed in one call.
Composed, each of those is an op of its own, dozens of launches a step, each with host work that
bounds a small step on a GPU (docs/performance.md, "model step graphs").

A capture serves one (model, rows, input shape and dtype, output, state pool). It owns the
step's input and slot buffers, which a call fills before the replay, and the output the replay
writes. The model's weights and the pool's parts are read at the addresses they had at capture:
a capture holds them weakly and is replayed only while they are the same tensors (a pool that
grew has new parts, so the next step captures again); a model's captures are dropped when it
is freed, and those whose model or parts are gone when the next capture is made. A capture's
warm-up runs on scratch state laid out as the pool's parts are (strides and alignment, which
Triton specialises on: a kernel compiled inside a capture would void it), so capturing never
touches a session's state; the kernels do not check slot values inside a capture
(scan_kernels._args), so a capture trusts the session's own slots. Only the triton backend's
steps are captured: the others read values on the host.

Nothing else touches the GPU during a capture: every op runs under the dispatcher's one serving
lock (docs/architecture.md), the model step op among them.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections import OrderedDict

import torch

import scan_kernels

log = logging.getLogger("bridge")

CAPTURED_BACKEND = "triton"


class ModelStepGraphs:
    """Captured model steps, the last `capacity` used kept; kinds that failed to capture take the
    composed step from then on (the last `capacity` of them remembered)."""

    def __init__(self, capacity: int = 32):
        self.capacity = capacity
        self._captures: OrderedDict = OrderedDict()
        self._failed: OrderedDict = OrderedDict()
        self.captured = 0  # captures made, for `info`
        self._lock = threading.Lock()  # a replay's buffers are shared by every call of its kind

    def step(self, model, parts: dict[str, torch.Tensor], slots: torch.Tensor, inputs: torch.Tensor, *,
             output: str, backend: str | None) -> torch.Tensor | None:
        """The step's output (a tensor of its own), the pool rows `slots` updated, as
        `model.step` gives them; None where the backend's steps are not captured or this kind
        failed to capture (then nothing ran)."""
        with self._lock:
            return self._step(model, parts, slots, inputs, output, backend)

    def _step(self, model, parts, slots, inputs, output, backend):
        if backend != CAPTURED_BACKEND:
            return None
        kind = (id(model), tuple(inputs.shape), inputs.dtype, slots.dtype, output,
                tuple((name, p.data_ptr(), tuple(p.shape), p.stride(), p.dtype) for name, p in parts.items()))
        if kind in self._failed:
            return None
        capture = self._captures.get(kind)
        if capture is None or not capture.serves(model, parts):
            self._drop(None)
            try:
                capture = _Capture(model, parts, slots, inputs, output, backend)
            except Exception:
                log.exception("capturing a %d-row model step failed; steps like it are composed", inputs.shape[0])
                remember_recent(self._failed, kind, None, self.capacity)
                return None
            self.captured += 1
        remember_recent(self._captures, kind, capture, self.capacity)
        return capture.run(slots, inputs)

    def __len__(self) -> int:
        """Captures held."""
        return len(self._captures)

    def forget(self, model=None) -> None:
        """Drop the captures of `model` (one being freed) and those whose model or pool parts
        are gone, giving their graphs' memory back."""
        with self._lock:
            self._drop(model)

    def _drop(self, model) -> None:
        for kind in [k for k, c in self._captures.items() if not c.alive() or c.model_is(model)]:
            del self._captures[kind]


class _Held:
    """The model and pool parts a capture reads at their addresses, held weakly: a capture never
    keeps a model's or a pool's memory alive, and is replayed only over the very tensors."""

    def __init__(self, model, parts: dict[str, torch.Tensor]):
        self._model = weakref.ref(model)
        self._parts = {name: weakref.ref(p) for name, p in parts.items()}

    def alive(self) -> bool:
        """Whether the model and every part captured are still allocated."""
        return self._model() is not None and all(ref() is not None for ref in self._parts.values())

    def model_is(self, model) -> bool:
        return model is not None and self._model() is model

    def serves(self, model, parts) -> bool:
        """Whether the model and the pool's parts are still the tensors captured."""
        return self._model() is model and all(self._parts[name]() is p for name, p in parts.items())


class _Capture(_Held):
    def __init__(self, model, parts, slots, inputs, output, backend):
        super().__init__(model, parts)
        device = inputs.device
        rows = inputs.shape[0]
        self._inputs = inputs.clone()  # real values for the warm-up: tokens index the embedding
        self._slots = torch.empty_like(slots)
        scratch = {name: _scratch_like(p, rows) for name, p in parts.items()}
        scratch_slots = torch.arange(rows, dtype=slots.dtype, device=device)
        self._graph, self._out = scan_kernels.capture_graph(
            lambda: model.step(parts, self._slots, self._inputs, output=output, backend=backend), device,
            warm_up=lambda: model.step(scratch, scratch_slots, self._inputs, output=output, backend=backend))

    def run(self, slots: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
        self._inputs.copy_(inputs)
        self._slots.copy_(slots)
        self._graph.replay()
        return self._out.clone()


def _scratch_like(part: torch.Tensor, rows: int) -> torch.Tensor:
    """Zeros of `rows` rows laid out as `part` is: its strides, and its offset into a buffer of
    the allocator's alignment (parts are views into one flat pool)."""
    shape = (rows, *part.shape[1:])
    extent = part.storage_offset() + sum((n - 1) * s for n, s in zip(shape, part.stride())) + 1
    buffer = torch.zeros(extent, dtype=part.dtype, device=part.device)
    return buffer.as_strided(shape, part.stride(), part.storage_offset())


def remember_recent(table: OrderedDict, kind, value, capacity: int) -> None:
    """`kind` as the most recently used entry of `table`, which keeps the last `capacity`."""
    table[kind] = value
    table.move_to_end(kind)
    while len(table) > capacity:
        table.popitem(last=False)
