"""Backend registry.

Each backend lives in its own module exposing `load_backend() -> Backend`, which raises
`BackendUnavailable(reason)` when it cannot run here. Modules are imported lazily, once; the
reason a backend is unavailable is logged once and kept for `unavailable_backends()` (the
server's `info` op reports it).

Backend call signatures (arguments already validated and normalised by `scan_kernels._args`):

    scan(x, dt, A, B, C, *, D, z, dt_bias, dt_softplus, dt_min, dt_max, h0, return_state, layout)
        -> (y, state_or_None)
    state_update(state, x, dt, A, B, C, *, D, z, dt_bias, dt_softplus, dt_min, dt_max, slots) -> y
    ssd_scan(x, dt, A, B, C, *, D, z, dt_bias, dt_softplus, dt_min, dt_max, h0, return_state,
             chunk_size) -> (y, state_or_None)            (D already [heads, headdim])
    ssd_state_update(state, x, dt, A, B, C, *, D, z, dt_bias, dt_softplus, dt_min, dt_max, slots) -> y
    scan_backward(dy, x, dt, A, B, C, *, D, z, dt_bias, dt_softplus, dt_min, dt_max, h0, dstate,
                  layout) -> {input name: gradient in the compute dtype}   (scan_kernels/backward.py)
    ssd_scan_backward(dy, x, dt, A, B, C, *, D, z, dt_bias, dt_softplus, dt_min, dt_max, h0,
                      dstate, chunk_size) -> {input name: gradient}
"""

from __future__ import annotations

import importlib
import logging
import threading
from dataclasses import dataclass, field
from typing import Callable

from .errors import BackendUnavailable, UnknownBackend

log = logging.getLogger("scan_kernels")

# name -> module; order is the listing order of available_backends().
BACKEND_MODULES = {
    "reference": "scan_kernels.reference",
    "torch": "scan_kernels.eager",
    "cpu": "scan_kernels.cpu",
    "triton": "scan_kernels.triton_kernels",
}

# For backend=None: the first available backend that serves the tensors' device type.
# The Triton interpreter also serves CPU tensors, but it interprets every program instance
# in Python (it exists to test the kernels), so it is only used on the CPU when asked for by
# name.
PREFERENCE = {
    "cuda": ("triton", "torch", "reference"),
    "cpu": ("cpu", "torch", "reference"),
}


@dataclass(frozen=True)
class Backend:
    name: str
    scan: Callable
    state_update: Callable
    # Mamba-2 (SSD): the scan over [batch, seq, heads, headdim] and the one-step update.
    ssd_scan: Callable
    ssd_state_update: Callable
    device_types: frozenset
    # Compiles kernels for the given shape buckets ahead of the first request; returns a list
    # of human-readable descriptions of what was compiled. None: nothing to compile.
    warmup: Callable | None = None
    # True when the backend reads inputs at any byte offset itself (tensor bytes decoded from a
    # frame may sit at any offset); callers then need no aligned copy of their inputs.
    reads_unaligned: bool = False
    # The ops ("scan", "ssd_scan", "scan_backward", "ssd_scan_backward") that take `cu_seqlens`
    # (a CPU int64 tensor [n + 1]) themselves: sequences packed along seq in one call; for the
    # others scan_kernels/_varlen.py makes one call per sequence.
    packs_sequences: frozenset = frozenset()
    details: dict = field(default_factory=dict)
    # A PyCapsule "scan_bridge.run_problem" running the backend's kernel on a ScanProblem
    # (scan_kernels/cpu/scan_kernel.h) that a native caller in this process fills itself (the
    # bridge's native step path); None for backends without one.
    run_problem: object | None = None
    # Likewise "scan_bridge.run_ssd_update", the Mamba-2 state update on an SsdUpdateProblem
    # (scan_kernels/cpu/ssd_kernel.h).
    run_ssd_update: object | None = None
    # Captures a state update for replay (scan_kernels.capture_state_update); None: nothing to capture.
    capture_state_update: Callable | None = None
    # One frame through a whole Mamba / Mamba-2 stack in one call (scan_kernels.model_step_kernel);
    # None: the caller composes the step from the ops above.
    model_step: Callable | None = None
    # A prefill of such a stack in one call (scan_kernels.model_forward_kernel); None: composed.
    model_forward: Callable | None = None
    # That step's matrix product, for callers that compose a sequence from the ops above
    # (scan_kernels.linear_kernel): x [rows, in] fp32 times w [features, in]^T (fp32 or bf16) plus an
    # fp32 bias -> [rows, features] fp32; None: the caller uses torch's.
    linear: Callable | None = None
    # For native callers' model steps (scan_kernels/cpu/model_step.h): prepare_model(layers' weights,
    # norm_f, dims, eps, dt_min, dt_max) -> a "scan_bridge.fused_model" capsule, and the capsule
    # "scan_bridge.run_model_step" that steps one; None for backends without them.
    prepare_model: Callable | None = None
    run_model_step: object | None = None
    # Gradients of the two scans (scan_kernels/backward.py); None: this backend has no backward pass.
    scan_backward: Callable | None = None
    ssd_scan_backward: Callable | None = None


_lock = threading.Lock()
_loaded: dict[str, Backend] = {}
_unavailable: dict[str, str] = {}


def _load(name: str) -> Backend | None:
    with _lock:
        if name in _loaded:
            return _loaded[name]
        if name in _unavailable:
            return None
        try:
            module = importlib.import_module(BACKEND_MODULES[name])
            backend = module.load_backend()
        except BackendUnavailable as exc:
            _unavailable[name] = str(exc)
            log.info("kernels backend %r unavailable: %s", name, exc)
            return None
        except (ImportError, AttributeError) as exc:
            # AttributeError: a module without load_backend() (a broken or partial install).
            _unavailable[name] = f"import failed: {exc}"
            log.info("kernels backend %r unavailable: import failed: %s", name, exc)
            return None
        _loaded[name] = backend
        return backend


def available_backends() -> list[str]:
    return [name for name in BACKEND_MODULES if _load(name) is not None]


def unavailable_backends() -> dict[str, str]:
    available_backends()
    return dict(_unavailable)


def backend_details() -> dict[str, dict]:
    """What each available backend says of itself, where it says something (the cpu backend:
    its SIMD variant, "simd")."""
    return {name: dict(backend.details) for name in available_backends()
            if (backend := _load(name)) is not None and backend.details}


def get_backend(name: str | None, device_type: str, capability: str | None = None) -> Backend:
    """The backend `name` (None: the preferred one for `device_type`). `capability`: a Backend
    field that may be None (a backward pass); None picks the first preferred backend that has
    it, and a named backend without it is refused."""
    if name is None:
        for candidate in PREFERENCE.get(device_type, ("torch", "reference")):
            backend = _load(candidate)
            if (backend is not None and device_type in backend.device_types
                    and (capability is None or getattr(backend, capability) is not None)):
                return backend
        what = f"{capability} on" if capability else "device type"
        raise BackendUnavailable(f"no backend serves {what} {device_type!r}")
    if name not in BACKEND_MODULES:
        raise UnknownBackend("backend", "one of " + ", ".join(repr(n) for n in BACKEND_MODULES), repr(name))
    backend = _load(name)
    if backend is None:
        raise BackendUnavailable(f"backend {name!r} is unavailable: {_unavailable[name]}")
    if device_type not in backend.device_types:
        raise BackendUnavailable(
            f"backend {name!r} serves {sorted(backend.device_types)}, not {device_type!r} tensors")
    if capability is not None and getattr(backend, capability) is None:
        raise BackendUnavailable(f"backend {name!r} has no {capability}")
    return backend
