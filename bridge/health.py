"""Whether the server can do its work: the `health` op's device check (protocol/SPEC.md §6).

A server is ready when its device has answered a kernel launch lately: the server's own work
(a launch that served requests, noted by `note_launch`) or, on a server with none, a tiny probe
launch. Either is reused while recent enough, so that a busy server answers a health check
without a launch, and one polled every second costs an idle server one launch every few
seconds, not one a poll."""

from __future__ import annotations

import threading
import time

import torch

import scan_kernels

# How recent a launch must be to stand for the device now.
PROBE_MAX_AGE_S = 5.0


class DeviceProbe:
    """The device's latest answer: the server's last completed launch or a 1×2×1×1 selective
    scan on its device and backend, whichever is newer, kept for `PROBE_MAX_AGE_S`."""

    def __init__(self, device: torch.device, backend: str | None):
        self.device = device
        self.backend = backend
        self._lock = threading.Lock()
        self._last: dict | None = None  # the probe's last outcome
        self._last_at = float("-inf")
        self._work_at = float("-inf")  # when a launch of the server's work last completed

    def note_launch(self) -> None:
        """A kernel launch that served requests completed: the device answered."""
        # One float store, atomic under the GIL, from the serving threads: a check that reads
        # it a moment early sees an older launch, never a torn value.
        self._work_at = time.monotonic()

    def fresh(self) -> bool:
        """Whether `check` can answer without launching the probe."""
        return time.monotonic() - max(self._work_at, self._last_at) <= PROBE_MAX_AGE_S

    def check(self, launch: bool = True) -> dict:
        """`{"ok", "source", "age_ms"}` of the newest answer: "work" when it is the server's own
        launch, "probe" with its `"latency_us"` (and `"error"` when it failed) otherwise. The
        probe is launched first unless one of them is recent enough; `launch` False (for a
        caller running beside the server's kernels, once `fresh` said so) never launches it."""
        with self._lock:
            if launch and not self.fresh():
                self._last, self._last_at = self._launch(), time.monotonic()
            work_at = self._work_at
            if work_at > self._last_at:
                return {"ok": True, "source": "work", "age_ms": _age_ms(work_at)}
            return {**self._last, "source": "probe", "age_ms": _age_ms(self._last_at)}

    def _launch(self) -> dict:
        start = time.perf_counter_ns()
        try:
            ones = torch.ones(1, 2, 1, device=self.device)
            y = scan_kernels.selective_scan(ones, ones, -ones[0, :1], ones, ones, backend=self.backend)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            ok = bool(torch.isfinite(y).all())
            outcome = {"ok": ok} if ok else {"ok": False, "error": "the probe scan gave non-finite values"}
        except Exception as exc:  # any failure of the device is what this check reports
            outcome = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        return {**outcome, "latency_us": (time.perf_counter_ns() - start) // 1000}


def _age_ms(at: float) -> float:
    return round((time.monotonic() - at) * 1e3, 3)
