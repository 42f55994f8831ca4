"""Mamba selective-scan kernels behind one API; they know nothing of the wire.

    selective_scan(x, dt, A, B, C, *, D=None, z=None, dt_bias=None, dt_softplus=False,
                   dt_min=None, dt_max=None, h0=None, return_state=False, layout="bld",
                   cu_seqlens=None, backend=None) -> y | (y, state)
    selective_state_update(state, x, dt, A, B, C, *, D=None, z=None, dt_bias=None,
                           dt_softplus=False, dt_min=None, dt_max=None, slots=None,
                           backend=None) -> y      (state updated in place)
    capture_state_update(state, x, dt, A, B, C, *, ..., slots, backend=None)
                        -> a replayable state update (a CUDA graph) | None
    capture_graph(run, device, *, warm_up=None) -> (a CUDA graph of run(), what it returned)
    ssd_scan(x, dt, A, B, C, *, D=None, z=None, dt_bias=None, dt_softplus=False, dt_min=None,
             dt_max=None, h0=None, return_state=False, cu_seqlens=None, seq_idx=None,
             chunk_size=None, backend=None) -> y | (y, state)
    ssd_state_update(state, x, dt, A, B, C, *, D=None, z=None, dt_bias=None, dt_softplus=False,
                     dt_min=None, dt_max=None, slots=None, backend=None) -> y   (state in place)

Math (mamba_ssm's selective_scan_ref / selective_state_update_ref): dt += dt_bias; dt =
softplus(dt) if dt_softplus; dt = clamp(dt, dt_min, dt_max); h_t = exp(dt_t A) h_{t-1} +
dt_t B_t x_t; y_t = C_t . h_t + D x_t; y *= silu(z). State and accumulation in fp32 (fp64 for
fp64 inputs); y in x's dtype; the returned state is fp32 (fp64 for fp64 inputs). `slots` picks
each row's state row; two rows naming the same slot would race, and are a KernelInputError (a
capture's replays go unchecked: the bridge runs one step per session in a launch). A state
updated in place must not overlap itself or any other operand, nor require grad, nor be an
inference tensor outside torch.inference_mode(); the update counts in its version, as torch's
in-place ops do. State updates are not differentiable: every backend runs them as under
torch.no_grad(), so an operand that requires grad (A = -exp(A_log) of a Parameter) is read as a
constant, and neither y nor the state requires grad.

Mamba-2 (SSD, mamba_ssm's mamba_chunk_scan_combined / selective_state_update with heads): the
same recurrence with a scalar decay per head, h_t = exp(dt_t A) h_{t-1} + dt_t x_t (x) B_t over
a [headdim, state] state per head; x, z [batch, seq, heads, headdim], dt [batch, seq, heads],
A, dt_bias [heads], B, C [batch, seq, groups, state] (group g serves heads g*H/G .. (g+1)*H/G - 1),
D [heads] or [heads, headdim], state [batch, heads, headdim, state]. `chunk_size` tunes the
chunked backends only (torch, triton; a larger one than 1024 runs at 1024); every backend
computes the same y, short of float's range in an intermediate (docs/performance.md).

Gradients (scan_kernels/backward.py): selective_scan_backward(dy, x, dt, A, B, C, *, ..., h0, dstate,
layout, cu_seqlens, backend) and ssd_scan_backward(...) -> {input name: gradient}; with grad
mode on and an input that requires grad, selective_scan and ssd_scan are differentiable.

cu_seqlens (both scans): an int32/int64 tensor [n + 1] of boundaries of n sequences packed
along seq of a batch-1 input; each starts from h0[i] (h0 then has n rows) or zeros, and the
returned state has one row per sequence. ssd_scan and ssd_scan_backward also take mamba_ssm's
`seq_idx` [1, seq] (each position's sequence index) for the same boundaries, alone or beside a
cu_seqlens it must agree with. Backends run them in one call where they can
(`Backend.packs_sequences`: the cpu and triton backends' scans and backwards), else
one call a sequence (scan_kernels/_varlen.py).
"""

from __future__ import annotations

import math
import numbers

import torch

from . import _args, _varlen
from .backward import ScanFunction, ScanSpec, selective_scan_backward, ssd_scan_backward, wants_grad
from ._args import FLOAT_DTYPES
from .cuda_graphs import capture_graph
from ._registry import available_backends, backend_details, get_backend, unavailable_backends
from .errors import BackendUnavailable, DtypeNotAllowed, KernelInputError, ShapeMismatch, UnknownBackend

__all__ = [
    "selective_scan", "selective_state_update", "available_backends", "unavailable_backends", "backend_details",
    "select_backend", "reads_unaligned", "warmup", "WARMUP_OPTIONS", "KernelInputError", "DtypeNotAllowed", "ShapeMismatch",
    "BackendUnavailable", "UnknownBackend", "FLOAT_DTYPES", "capture_state_update", "ssd_scan",
    "ssd_state_update", "model_step_kernel", "model_forward_kernel", "linear_kernel", "dt_limit_bounds",
    "selective_scan_backward", "ssd_scan_backward", "capture_graph",
]


def select_backend(device_type: str, backend: str | None = None) -> str:
    """Name of the backend `backend=None` would pick for tensors on `device_type`."""
    return get_backend(backend, device_type).name


# The options a warmup shape bucket may name (each option set is a separately compiled kernel).
WARMUP_OPTIONS = ("D", "z", "dt_bias", "dt_softplus", "clamp", "h0", "return_state")


def reads_unaligned(backend: str, device_type: str) -> bool:
    """Whether `backend` takes inputs at any byte offset itself (no aligned copy needed)."""
    return get_backend(backend, device_type).reads_unaligned


def selective_scan(x, dt, A, B, C, *, D=None, z=None, dt_bias=None, dt_softplus=False,
                   dt_min=None, dt_max=None, h0=None, return_state=False, layout="bld",
                   cu_seqlens=None, backend=None):
    # Checked here: the autograd branch below reads it, ahead of _args' checks.
    return_state = _args._flag("return_state", return_state)
    if wants_grad(x, dt, A, B, C, D, z, dt_bias, h0):
        spec = ScanSpec(False, (("dt_softplus", dt_softplus), ("dt_min", dt_min), ("dt_max", dt_max),
                                ("layout", layout)), cu_seqlens, backend)
        y, state = ScanFunction.apply(spec, x, dt, A, B, C, D, z, dt_bias, h0)
        return (y, state) if return_state else y
    packed = cu_seqlens is not None
    # Packed sequences: checked whole (h0 then has a row per sequence: _varlen checks it).
    args = _args.check_scan(x, dt, A, B, C, D=D, z=z, dt_bias=dt_bias, dt_softplus=dt_softplus,
                            dt_min=dt_min, dt_max=dt_max, h0=None if packed else h0,
                            return_state=return_state, layout=layout)
    impl = get_backend(backend, args.x.device.type)
    kwargs = args.backend_kwargs()
    if packed:

        def one(x, dt, B, C, z, h0, return_state, **bounds):
            return impl.scan(x, dt, args.A, B, C, **{**kwargs, "z": z, "h0": h0, "return_state": return_state},
                             **bounds)

        bld = layout == "bld"
        y, state = _varlen.scan_sequences(one, args, packs="scan" in impl.packs_sequences,
                                          seq_axis=1 if bld else 2, bc_axis=1 if bld else 3, h0=h0,
                                          cu_seqlens=cu_seqlens, state_shape=(args.dims.dim, args.dims.state),
                                          state_meaning="dim, state")
    else:
        y, state = impl.scan(args.x, args.dt, args.A, args.B, args.C, **kwargs)
    return (y, state) if args.return_state else y


def selective_state_update(state, x, dt, A, B, C, *, D=None, z=None, dt_bias=None,
                           dt_softplus=False, dt_min=None, dt_max=None, slots=None, backend=None):
    args = _args.check_state_update(state, x, dt, A, B, C, D=D, z=z, dt_bias=dt_bias,
                                    dt_softplus=dt_softplus, dt_min=dt_min, dt_max=dt_max,
                                    slots=slots, distinct_slots=True)
    impl = get_backend(backend, args.x.device.type)
    # Not differentiable (module docstring): tracked in-place ops would leave the caller's state
    # requiring grad, and its next update refused.
    with torch.no_grad():
        y = impl.state_update(args.state, args.x, args.dt, args.A, args.B, args.C, **args.backend_kwargs())
    _written(args.state)
    return y


def ssd_scan(x, dt, A, B, C, *, D=None, z=None, dt_bias=None, dt_softplus=False, dt_min=None,
             dt_max=None, h0=None, return_state=False, cu_seqlens=None, seq_idx=None, chunk_size=None,
             backend=None):
    # Checked here: the autograd branch below reads it, ahead of _args' checks.
    return_state = _args._flag("return_state", return_state)
    if seq_idx is not None:
        cu_seqlens = _args.cu_seqlens_of_seq_idx(seq_idx, cu_seqlens, x)
    if wants_grad(x, dt, A, B, C, D, z, dt_bias, h0):
        spec = ScanSpec(True, (("dt_softplus", dt_softplus), ("dt_min", dt_min), ("dt_max", dt_max),
                               ("chunk_size", chunk_size)), cu_seqlens, backend)
        y, state = ScanFunction.apply(spec, x, dt, A, B, C, D, z, dt_bias, h0)
        return (y, state) if return_state else y
    packed = cu_seqlens is not None
    args = _args.check_ssd_scan(x, dt, A, B, C, D=D, z=z, dt_bias=dt_bias, dt_softplus=dt_softplus,
                                dt_min=dt_min, dt_max=dt_max, h0=None if packed else h0,
                                return_state=return_state, chunk_size=chunk_size)
    impl = get_backend(backend, args.x.device.type)
    kwargs = args.backend_kwargs()
    if packed:

        def one(x, dt, B, C, z, h0, return_state, **bounds):
            return impl.ssd_scan(x, dt, args.A, B, C, **{**kwargs, "z": z, "h0": h0, "return_state": return_state},
                                 **bounds)

        d = args.dims
        y, state = _varlen.scan_sequences(one, args, packs="ssd_scan" in impl.packs_sequences, seq_axis=1,
                                          bc_axis=1, h0=h0, cu_seqlens=cu_seqlens,
                                          state_shape=(d.heads, d.headdim, d.state),
                                          state_meaning="heads, headdim, state")
    else:
        y, state = impl.ssd_scan(args.x, args.dt, args.A, args.B, args.C, **kwargs)
    return (y, state) if args.return_state else y


def ssd_state_update(state, x, dt, A, B, C, *, D=None, z=None, dt_bias=None, dt_softplus=False,
                     dt_min=None, dt_max=None, slots=None, backend=None):
    args = _args.check_ssd_state_update(state, x, dt, A, B, C, D=D, z=z, dt_bias=dt_bias,
                                        dt_softplus=dt_softplus, dt_min=dt_min, dt_max=dt_max,
                                        slots=slots)
    impl = get_backend(backend, args.x.device.type)
    # Not differentiable (module docstring): tracked in-place ops would leave the caller's state
    # requiring grad, and its next update refused.
    with torch.no_grad():
        y = impl.ssd_state_update(args.state, args.x, args.dt, args.A, args.B, args.C, **args.backend_kwargs())
    _written(args.state)
    return y


def _written(state: torch.Tensor) -> None:
    """Count an in-place update of `state` in its version, as torch's own in-place ops do: the
    cpu and triton backends write it through its address, which autograd does not see, and a
    graph that saved it would otherwise compute its gradients from the new values."""
    torch.autograd.graph.increment_version(state)


def dt_limit_bounds(dt_limit: tuple[float, float] | list[float]) -> tuple[float | None, float | None]:
    """mamba_ssm's `dt_limit` pair as this API's (dt_min, dt_max): its default (0, inf) clamps
    nothing; otherwise each finite side is a bound and an infinite side none. A pair whose low
    side is above its high, or a finite side past float32's range, is a KernelInputError naming
    dt_limit, as it was given; so is anything but a pair of real numbers (bools and tensors too)."""
    pair = tuple(dt_limit) if isinstance(dt_limit, (tuple, list)) else None
    if pair is None or len(pair) != 2 or not all(isinstance(v, numbers.Real) and not isinstance(v, bool)
                                                 for v in pair):
        raise KernelInputError("dt_limit", "a pair (low, high) of numbers", _shown_limit(dt_limit))
    try:
        low, high = float(pair[0]), float(pair[1])
    except OverflowError:  # an int beyond the float range
        raise KernelInputError("dt_limit", "a pair (low, high) of numbers within the float range",
                               _shown_limit(dt_limit)) from None
    if math.isnan(low) or math.isnan(high):  # compares false with everything: no bound, silently
        raise KernelInputError("dt_limit", "a pair (low, high) of numbers, not NaN", f"({low!r}, {high!r})")
    if low > high:
        raise KernelInputError("dt_limit", "a pair (low, high) with low <= high", f"({low!r}, {high!r})")
    if (low, high) == (0.0, math.inf):
        return None, None
    bounds = (low if math.isfinite(low) else None), (high if math.isfinite(high) else None)
    # Refused here, by the name the caller gave: dt_min and dt_max would refuse it by theirs.
    if any(b is not None and abs(b) > _args._BOUND_LIMIT for b in bounds):
        raise KernelInputError("dt_limit", "a pair (low, high) whose finite sides are within float32's range "
                                           f"(at most {_args._BOUND_LIMIT:.4g} in magnitude)", f"({low!r}, {high!r})")
    return bounds


def _shown_limit(value) -> str:
    shown = repr(value)
    return shown if len(shown) <= 80 else shown[:77] + "..."


def model_step_kernel(device_type: str, backend: str | None = None):
    """The backend's fused step of a whole Mamba / Mamba-2 stack (fp32, weights and state as
    bridge.models lays them out; see scan_kernels/cpu/binding.cpp `model_step`), or None where it has
    none. Its math is bridge.models.runtime's, which tests hold it to."""
    return get_backend(backend, device_type).model_step


def model_forward_kernel(device_type: str, backend: str | None = None):
    """The backend's fused prefill of such a stack (hidden [rows, seq, d_model], the states in pool
    rows read and left after the last timestep; scan_kernels/cpu/binding.cpp `model_forward`), or None
    where it has none. Its math is bridge.models.runtime's composed prefill, which tests hold it
    to."""
    return get_backend(backend, device_type).model_forward


def linear_kernel(device_type: str, backend: str | None = None):
    """The backend's matrix product, the one its fused model step runs (x [rows, in] fp32 times
    w [features, in]^T, w fp32 or bf16, plus an optional fp32 bias, fp32 out; scan_kernels/cpu/
    binding.cpp `linear`), or None where it has none and torch's serves."""
    return get_backend(backend, device_type).linear


def capture_state_update(state, x, dt, A, B, C, *, D=None, z=None, dt_bias=None, dt_softplus=False,
                         dt_min=None, dt_max=None, slots, backend=None):
    """The state update for calls like this one, captured for replay, or None where the backend
    captures nothing (only "triton" does, on CUDA and not under its interpreter). Checked as
    `selective_state_update` checks its arguments. x, dt, B, C, z and slots give only shapes and
    dtypes (nothing is computed here, no state touched); state, A, D and dt_bias are the very
    tensors every replay reads. The capture's `stage(name, bytes)` writes one call's x, dt, B,
    C, z or slots, and `run()` computes it, updating the state in place, and returns y in pinned
    host memory that the next run overwrites; `alive()` is false once state, A, D or dt_bias is
    freed, and then it refuses to run (scan_kernels/triton_kernels/graphs.py)."""
    if slots is None:
        raise KernelInputError("slots", "an int32/int64 tensor (a capture updates pool rows by slot)", "None")
    # The slots' values are placeholders here (the bridge's are zeros): repeats are not refused.
    args = _args.check_state_update(state, x, dt, A, B, C, D=D, z=z, dt_bias=dt_bias,
                                    dt_softplus=dt_softplus, dt_min=dt_min, dt_max=dt_max,
                                    slots=slots)
    impl = get_backend(backend, args.x.device.type)
    if impl.capture_state_update is None:
        return None
    return impl.capture_state_update(args.state, args.x, args.dt, args.A, args.B, args.C,
                                     **args.backend_kwargs())


def warmup(shapes, *, device="cpu", dtype=None, backend=None) -> list[str]:
    """Compile ahead of time the kernels for `shapes`, an iterable of dicts with keys batch,
    seq, dim, state (and optionally headdim: a Mamba-2 bucket of `dim` heads; groups, layout,
    dtype (`dtype` where absent), and the
    options the server will use: booleans D, z, dt_bias, dt_softplus, clamp, h0, return_state,
    slots — each option set is a separate compiled kernel). Returns what was compiled (for `info`); an empty list where the
    chosen backend compiles nothing."""
    import torch

    device = torch.device(device)
    impl = get_backend(backend, device.type)
    if impl.warmup is None:
        return []
    return list(impl.warmup(list(shapes), device=device, dtype=dtype or torch.float32))
