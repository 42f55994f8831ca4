"""Whether the server can do its work: the `health` op's device check (protocol/SPEC.md §6).

A server is ready when its device has answered a tiny kernel launch lately. A launch that is
recent enough is reused, so that a health check polled every second costs one launch every
few seconds, not one a poll."""

from __future__ import annotations

import threading
import time

import torch

import kernels

# How recent a launch must be to stand for the device now.
PROBE_MAX_AGE_S = 5.0


class DeviceProbe:
    """A 1×2×1×1 selective scan on the server's device and backend, its outcome kept for
    `PROBE_MAX_AGE_S`."""

    def __init__(self, device: torch.device, backend: str | None):
        self.device = device
        self.backend = backend
        self._lock = threading.Lock()
        self._last: dict | None = None
        self._last_at = 0.0

    def check(self) -> dict:
        """`{"ok", "age_ms", "latency_us"}` (and `"error"` when the launch failed), launching the
        probe first unless the last one is recent enough."""
        with self._lock:
            if self._last is None or time.monotonic() - self._last_at > PROBE_MAX_AGE_S:
                self._last, self._last_at = self._launch(), time.monotonic()
            return {**self._last, "age_ms": round((time.monotonic() - self._last_at) * 1e3, 3)}

    def _launch(self) -> dict:
        start = time.perf_counter_ns()
        try:
            ones = torch.ones(1, 2, 1, device=self.device)
            y = kernels.selective_scan(ones, ones, -ones[0, :1], ones, ones, backend=self.backend)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            ok = bool(torch.isfinite(y).all())
            outcome = {"ok": ok} if ok else {"ok": False, "error": "the probe scan gave non-finite values"}
        except Exception as exc:  # any failure of the device is what this check reports
            outcome = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        return {**outcome, "latency_us": (time.perf_counter_ns() - start) // 1000}
