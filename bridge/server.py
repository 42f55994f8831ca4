"""The state every op handler sees: configuration, device, backend, counters, stop signal."""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass

import torch

import kernels
import protocol

from .device import DeviceChoice
from .errors import OpError
from .stats import Stats
from .tensors import to_device
from .timing import now_ns


@dataclass
class ServerConfig:
    device: str = "auto"
    backend: str | None = None
    max_frame_size: int = protocol.DEFAULT_MAX_FRAME_SIZE
    max_pending: int = 4096


class Server:
    def __init__(self, config: ServerConfig, device: DeviceChoice):
        self.config = config
        self.device_choice = device
        self.device = device.device
        self.backend = kernels.select_backend(self.device.type, config.backend)
        self.stats = Stats()
        self.stop_requested = threading.Event()
        self.transports: list[str] = []
        self.compiled: list[str] = []
        # Backends that read unaligned memory at full speed need no aligned copy of inputs.
        self.unaligned_ok = self.backend == "cpu"

    def tensor(self, call, name: str, *, required: bool = True) -> torch.Tensor | None:
        """The request argument `name` as a tensor on the server's device; h2d time is
        charged to the call."""
        value = call.args.get(name)
        if value is None:
            if required:
                raise OpError("missing_argument", f"args.{name}: expected a tensor, got nothing",
                              {"field": f"args.{name}", "expected": "a tensor", "got": None})
            return None
        start = now_ns()
        if isinstance(value, protocol.HandleRef):
            tensor = self.resolve_handle(call.conn, value.handle, f"args.{name}")
        else:
            tensor = to_device(value, self.device, unaligned_ok=self.unaligned_ok)
        call.timing.add("h2d", now_ns() - start)
        return tensor

    def resolve_handle(self, conn, handle: str, field: str) -> torch.Tensor:
        raise OpError("unknown_handle", f"{field}: no tensor handle {handle!r} is held for this connection",
                      {"field": field, "handle": handle})

    def session(self, conn, session_id: str, field: str):
        """The session `session_id` opened by `conn`."""
        raise OpError("unknown_session", f"{field}: no session {session_id!r} is open on this connection",
                      {"field": field, "session": session_id})

    @contextmanager
    def kernel_timer(self, call):
        """Charges the enclosed kernel work to `kernel_us`: device events on CUDA (so the
        time is the GPU's, not the launch's), wall time on the CPU."""
        if self.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            end.synchronize()
            call.timing.add("kernel", int(start.elapsed_time(end) * 1e6))
        else:
            t0 = now_ns()
            yield
            call.timing.add("kernel", now_ns() - t0)
