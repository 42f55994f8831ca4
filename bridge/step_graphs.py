"""Steps on CUDA through captured state updates (scan_kernels.capture_state_update): a launch whose
rows, session pool, shapes, options and A/D/dt_bias tensors were seen before replays that
capture instead of going through the kernels API and Triton's launch path again.

A launch qualifies when its per-row inputs all came as wire bytes (no per-row handles) and A,
D and dt_bias are handles or absent: the capture reads those tensors at their addresses, so
bytes that came with the request, which would need a fresh device copy, do not qualify. The
first launch of each kind captures (then replays); captures are kept per kind, the least
recently used dropped past `capacity`, and a capture whose pool or handle tensor was freed is
captured again. Kinds that failed to capture (other than by a bad argument, which is the
request's error) go the general way from then on; the last `capacity` of them are remembered
(a kind names device addresses, so a long-lived server could otherwise gather them forever).
"""

from __future__ import annotations

import logging
from collections import OrderedDict

import torch

import scan_kernels
from protocol import WireTensor

from .models.graphs import remember_recent
from .tensors import TORCH_DTYPES
from .timing import now_ns

log = logging.getLogger("bridge")


class StepGraphs:
    def __init__(self, backend: str, capacity: int = 64):
        self.backend = backend
        self.capacity = capacity
        self._captures: OrderedDict = OrderedDict()
        self._failed: OrderedDict = OrderedDict()  # kinds that failed to capture, oldest first
        self.captured = 0  # captures made, for `info`

    def run(self, items, shared: dict):
        """y [rows, dim] on the host, a copy of its own, for the launch of `items` (prepared
        steps, bridge.ops.sessions.StepOp) with `shared` A, D, dt_bias; None when the launch does
        not qualify or its kind failed to capture (then nothing ran). Charges h2d (staging),
        kernel (replay with its device copies and wait) and d2h (y's copy: y reaches the host
        within the replay, so this is all the d2h there is) to every item."""
        if any(value is not None and not isinstance(value, torch.Tensor) for value in shared.values()):
            return None
        if any(value is not None and not isinstance(value, WireTensor)
               for item in items for value in item.tensors.values()):
            return None
        lead = items[0]
        rows = sum(item.rows for item in items)
        pool = lead.session.pool
        kind = (lead.key, rows, pool.rows.data_ptr(),
                *(None if t is None else t.data_ptr() for t in shared.values()))
        if kind in self._failed:
            return None
        capture = self._capture(kind, lead, rows, shared)
        if capture is None:
            return None
        start = now_ns()
        for name, value in lead.tensors.items():
            if value is not None:
                capture.stage(name, *(item.tensors[name].data for item in items))
        capture.stage("slots", *(item.session.slot_bytes for item in items))
        staged = now_ns()
        y = capture.run()
        ran = now_ns()
        y = y.clone()
        done = now_ns()
        for item in items:
            item.call.timing.add("h2d", staged - start)
            item.call.timing.add("kernel", ran - staged)
            item.call.timing.add("d2h", done - ran)
        return y

    def _capture(self, kind, lead, rows: int, shared: dict):
        capture = self._captures.get(kind)
        if capture is not None and capture.alive():
            self._captures.move_to_end(kind)
            return capture
        device = lead.session.pool.rows.device
        # Shapes and dtypes only: the capture computes nothing with these.
        examples = {name: None if value is None else
                    torch.zeros((rows, *value.shape[1:]), dtype=TORCH_DTYPES[value.dtype], device=device)
                    for name, value in lead.tensors.items()}
        try:
            capture = scan_kernels.capture_state_update(
                lead.session.pool.rows, examples["x"], examples["dt"], shared["A"], examples["B"],
                examples["C"], D=shared["D"], z=examples["z"], dt_bias=shared["dt_bias"], **lead.options,
                slots=torch.zeros(rows, dtype=torch.int64, device=device), backend=self.backend)
        except scan_kernels.KernelInputError:
            raise  # the request's own error, as the general path would report it
        except Exception:
            log.exception("capturing a %d-row step failed; steps like it take the general path", rows)
            capture = None
        if capture is None:
            remember_recent(self._failed, kind, None, self.capacity)
            return None
        self.captured += 1
        remember_recent(self._captures, kind, capture, self.capacity)
        return capture

