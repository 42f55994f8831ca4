"""Validation and normalisation shared by every backend.

The public functions in `scan_kernels/__init__.py` call these before dispatching, so a backend
receives arguments that are known to be consistent:

scan (layout "bld"):  x, dt, z [batch, seq, dim]; B, C [batch, seq, groups, state]
scan (layout "bdl"):  x, dt, z [batch, dim, seq]; B, C [batch, groups, state, seq]
both:                 A [dim, state]; D, dt_bias [dim]; h0 [batch, dim, state] or None
state update:         state [pool, dim, state]; x, dt, z [batch, dim]; B, C [batch, groups, state];
                      slots [batch] int64 or None (then pool == batch)

3-D B/C are given a groups axis of size 1 as a view (no copy). Nothing is made contiguous:
backends read through strides.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import numpy as np
import torch

from .errors import DtypeNotAllowed, KernelInputError, ShapeMismatch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
LAYOUTS = ("bld", "bdl")
# What an error says was expected of a dtype or a layout.
FLOAT_DTYPES_EXPECTED = "a floating dtype (" + ", ".join(str(d).removeprefix("torch.") for d in FLOAT_DTYPES) + ")"
LAYOUTS_EXPECTED = " or ".join(f'"{layout}"' for layout in LAYOUTS)


def _shape(t: torch.Tensor) -> str:
    return "[" + ", ".join(str(s) for s in t.shape) + "]"


def _require_tensor(name: str, t) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise KernelInputError(name, "a torch.Tensor", type(t).__name__)
    if t.layout != torch.strided:
        raise KernelInputError(name, "a dense (strided) tensor", f"layout {t.layout}")
    if t.is_nested:  # strided in layout, but its shape cannot be read (torch raises an internal error)
        raise KernelInputError(name, "a dense (strided) tensor", "a nested tensor")
    if t.is_neg():  # its memory holds the negated values, which the C++ and Triton kernels would read
        raise KernelInputError(name, "a tensor without torch's negative bit (resolve_neg() it)",
                               "a negative view (such as z.conj().imag)")
    if t.dtype not in FLOAT_DTYPES:
        raise DtypeNotAllowed(name, "a floating dtype", FLOAT_DTYPES, t.dtype)
    return t


def _require_shape(name: str, t: torch.Tensor, expected: tuple[int, ...], meaning: str) -> None:
    if tuple(t.shape) != tuple(expected):
        want = "[" + ", ".join(str(s) for s in expected) + "]"
        raise ShapeMismatch(name, f"shape {want} ({meaning})", f"shape {_shape(t)}")


# dt bounds past float32's range: the fp32 kernels (and the Triton fp64 ones, which take the
# bounds as fp32 pairs) would read them as infinite, and no dt of a real model comes near.
_BOUND_LIMIT = float(torch.finfo(torch.float32).max)


def _flag(name: str, v) -> bool:
    """A yes-or-no option: a bool (numpy's too), or None for no; never read by truthiness,
    which would take the string "false" for yes."""
    if v is None or isinstance(v, (bool, np.bool_)):
        return bool(v)
    raise KernelInputError(name, "a bool", type(v).__name__)


def _clamp_bound(name: str, v) -> float | None:
    """dt_min or dt_max as a float, or None. Any real number is taken (numpy's float32 as its
    float64), but not a bool; it must be finite, since NaN compares false with everything and
    each backend would ignore or propagate it differently, and within float32's range."""
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise KernelInputError(name, "a number or None", type(v).__name__)
    try:
        value = float(v)
    except OverflowError:  # an int (or a Fraction) beyond the float range
        raise KernelInputError(name, "a finite number or None", f"{type(v).__name__} beyond the float range") from None
    if not math.isfinite(value):
        raise KernelInputError(name, "a finite number or None", repr(value))
    if abs(value) > _BOUND_LIMIT:
        raise KernelInputError(name, f"a number within float32's range (at most {_BOUND_LIMIT:.4g} in magnitude) "
                                     "or None", repr(value))
    return value


def _clamp_bounds(dt_min, dt_max) -> tuple[float | None, float | None]:
    low, high = _clamp_bound("dt_min", dt_min), _clamp_bound("dt_max", dt_max)
    if low is not None and high is not None and low > high:
        raise KernelInputError("dt_max", f"a value >= dt_min ({low})", str(high))
    return low, high


def _check_options(D, dt_bias, z, dim: int, x: torch.Tensor):
    """D, dt_bias [dim] and z (shaped like x), each optional; returned in that order."""
    for name, t in (("D", D), ("dt_bias", dt_bias)):
        if t is not None:
            _require_shape(name, _require_tensor(name, t), (dim,), "[dim]")
    if z is not None:
        _require_shape("z", _require_tensor("z", z), tuple(x.shape), "same as x")
    return D, dt_bias, z


def _check_groups(name: str, t: torch.Tensor, groups: int, dim: int) -> torch.Tensor:
    if groups == 0 or dim % groups != 0:
        raise ShapeMismatch(name, f"a group count dividing dim ({dim})", f"{groups} groups")
    return t


def _check_devices(named: dict[str, torch.Tensor | None]) -> torch.device:
    device = None
    first = None
    for name, t in named.items():
        if t is None:
            continue
        if device is None:
            device, first = t.device, name
        elif t.device != device:
            raise KernelInputError(name, f"a tensor on {device} (like {first})", f"a tensor on {t.device}")
    return device


@dataclass(frozen=True)
class ScanDims:
    batch: int
    seq: int
    dim: int
    state: int
    groups: int


@dataclass
class ScanArgs:
    x: torch.Tensor
    dt: torch.Tensor
    A: torch.Tensor
    B: torch.Tensor
    C: torch.Tensor
    D: torch.Tensor | None
    z: torch.Tensor | None
    dt_bias: torch.Tensor | None
    dt_softplus: bool
    dt_min: float | None
    dt_max: float | None
    h0: torch.Tensor | None
    return_state: bool
    layout: str
    dims: ScanDims

    def backend_kwargs(self) -> dict:
        return dict(
            D=self.D, z=self.z, dt_bias=self.dt_bias, dt_softplus=self.dt_softplus,
            dt_min=self.dt_min, dt_max=self.dt_max, h0=self.h0,
            return_state=self.return_state, layout=self.layout,
        )


def check_scan(x, dt, A, B, C, *, D=None, z=None, dt_bias=None, dt_softplus=False,
               dt_min=None, dt_max=None, h0=None, return_state=False, layout="bld") -> ScanArgs:
    if layout not in LAYOUTS:
        raise KernelInputError("layout", LAYOUTS_EXPECTED, repr(layout))
    x = _require_tensor("x", x)
    if x.dim() != 3:
        raise ShapeMismatch("x", f"3 dimensions ({'[batch, seq, dim]' if layout == 'bld' else '[batch, dim, seq]'})",
                               f"shape {_shape(x)}")
    if layout == "bld":
        batch, seq, dim = x.shape
    else:
        batch, dim, seq = x.shape
    if batch == 0 or seq == 0 or dim == 0:
        raise ShapeMismatch("x", "non-empty batch, seq and dim", f"shape {_shape(x)}")
    dt = _require_tensor("dt", dt)
    _require_shape("dt", dt, tuple(x.shape), "same as x")
    A = _require_tensor("A", A)
    if A.dim() != 2 or A.shape[0] != dim:
        raise ShapeMismatch("A", f"shape [{dim}, state] ([dim, state])", f"shape {_shape(A)}")
    state = A.shape[1]
    if state == 0:
        raise ShapeMismatch("A", "a non-empty state axis", f"shape {_shape(A)}")
    B = _norm_bc_scan("B", _require_tensor("B", B), batch, seq, state, dim, layout)
    C = _norm_bc_scan("C", _require_tensor("C", C), batch, seq, state, dim, layout)
    groups = B.shape[2] if layout == "bld" else B.shape[1]
    c_groups = C.shape[2] if layout == "bld" else C.shape[1]
    if c_groups != groups:
        raise ShapeMismatch("C", f"{groups} groups (as B)", f"{c_groups} groups")
    D, dt_bias, z = _check_options(D, dt_bias, z, dim, x)
    if h0 is not None:
        h0 = _require_tensor("h0", h0)
        _require_shape("h0", h0, (batch, dim, state), "[batch, dim, state]")
    dt_min, dt_max = _clamp_bounds(dt_min, dt_max)
    _check_devices(dict(x=x, dt=dt, A=A, B=B, C=C, D=D, z=z, dt_bias=dt_bias, h0=h0))
    return ScanArgs(x, dt, A, B, C, D, z, dt_bias, _flag("dt_softplus", dt_softplus), dt_min, dt_max, h0,
                    _flag("return_state", return_state), layout, ScanDims(batch, seq, dim, state, groups))


def _norm_bc_scan(name, t, batch, seq, state, dim, layout) -> torch.Tensor:
    if layout == "bld":
        if t.dim() == 3:
            _require_shape(name, t, (batch, seq, state), "[batch, seq, state]")
            t = t.unsqueeze(2)
        elif t.dim() == 4:
            if (t.shape[0], t.shape[1], t.shape[3]) != (batch, seq, state):
                raise ShapeMismatch(name, f"shape [{batch}, {seq}, groups, {state}] ([batch, seq, groups, state])",
                                       f"shape {_shape(t)}")
        else:
            raise ShapeMismatch(name, "[batch, seq, state] or [batch, seq, groups, state]", f"shape {_shape(t)}")
        groups = t.shape[2]
    else:
        if t.dim() == 3:
            _require_shape(name, t, (batch, state, seq), "[batch, state, seq]")
            t = t.unsqueeze(1)
        elif t.dim() == 4:
            if (t.shape[0], t.shape[2], t.shape[3]) != (batch, state, seq):
                raise ShapeMismatch(name, f"shape [{batch}, groups, {state}, {seq}] ([batch, groups, state, seq])",
                                       f"shape {_shape(t)}")
        else:
            raise ShapeMismatch(name, "[batch, state, seq] or [batch, groups, state, seq]", f"shape {_shape(t)}")
        groups = t.shape[1]
    return _check_groups(name, t, groups, dim)


@dataclass
class UpdateArgs:
    state: torch.Tensor
    x: torch.Tensor
    dt: torch.Tensor
    A: torch.Tensor
    B: torch.Tensor
    C: torch.Tensor
    D: torch.Tensor | None
    z: torch.Tensor | None
    dt_bias: torch.Tensor | None
    dt_softplus: bool
    dt_min: float | None
    dt_max: float | None
    slots: torch.Tensor | None

    def backend_kwargs(self) -> dict:
        return dict(D=self.D, z=self.z, dt_bias=self.dt_bias, dt_softplus=self.dt_softplus,
                    dt_min=self.dt_min, dt_max=self.dt_max, slots=self.slots)


def check_state_update(state, x, dt, A, B, C, *, D=None, z=None, dt_bias=None, dt_softplus=False,
                       dt_min=None, dt_max=None, slots=None, distinct_slots=False) -> UpdateArgs:
    """`distinct_slots`: refuse two rows naming one pool row, as an update that runs does
    (scan_kernels.selective_state_update); a capture's slots give a shape and dtype alone, and the
    bridge's are placeholder zeros (scan_kernels.capture_state_update)."""
    state = _require_tensor("state", state)
    if state.dim() != 3:
        raise ShapeMismatch("state", "3 dimensions ([pool, dim, state])", f"shape {_shape(state)}")
    pool, dim, n = state.shape
    if dim == 0 or n == 0:
        raise ShapeMismatch("state", "non-empty dim and state axes", f"shape {_shape(state)}")
    x = _require_tensor("x", x)
    if x.dim() != 2 or x.shape[1] != dim:
        raise ShapeMismatch("x", f"shape [batch, {dim}] ([batch, dim])", f"shape {_shape(x)}")
    batch = x.shape[0]
    dt = _require_tensor("dt", dt)
    _require_shape("dt", dt, tuple(x.shape), "same as x")
    A = _require_tensor("A", A)
    _require_shape("A", A, (dim, n), "[dim, state]")
    B = _norm_bc_update("B", _require_tensor("B", B), batch, n, dim)
    C = _norm_bc_update("C", _require_tensor("C", C), batch, n, dim)
    if C.shape[1] != B.shape[1]:
        raise ShapeMismatch("C", f"{B.shape[1]} groups (as B)", f"{C.shape[1]} groups")
    D, dt_bias, z = _check_options(D, dt_bias, z, dim, x)
    slots = _check_slots(slots, pool, batch, distinct=distinct_slots)
    dt_min, dt_max = _clamp_bounds(dt_min, dt_max)
    operands = dict(state=state, x=x, dt=dt, A=A, B=B, C=C, D=D, z=z, dt_bias=dt_bias, slots=slots)
    _check_devices(operands)
    _require_writable_state(operands)
    return UpdateArgs(state, x, dt, A, B, C, D, z, dt_bias, _flag("dt_softplus", dt_softplus), dt_min, dt_max, slots)


def _require_writable_state(operands: dict) -> None:
    """The update writes operands["state"] in place, so what a backend computes must not depend
    on the order it takes the elements in: none may share memory with another (a broadcast or
    overlapping pool), nor with any other operand (read after a backend may have written it).
    A state that requires grad is refused too: writing a leaf in place is an autograd error."""
    state = operands["state"]
    if state.requires_grad:
        raise KernelInputError("state", "a tensor that does not require grad (it is updated in place)",
                               "requires_grad=True")
    # torch refuses in-place writes to these (the reference's index_put after it has written),
    # while a backend writing through the state's address would not notice.
    if state.is_inference() and not torch.is_inference_mode_enabled():
        raise KernelInputError("state", "a tensor that may be updated in place (an inference tensor only "
                               "under torch.inference_mode())", "an inference tensor outside inference mode")
    span = 1  # elements' reach along the axes of smaller stride, checked so far
    for stride, size in sorted((st, sz) for sz, st in zip(state.shape, state.stride()) if sz > 1):
        if stride < span:
            raise KernelInputError("state", "a tensor whose elements do not overlap in memory (each axis' "
                                   "stride at least the span of the axes of smaller stride)",
                                   f"strides {list(state.stride())} for shape {_shape(state)}")
        span = stride * size
    state_bytes = _byte_range(state)
    for name, t in operands.items():
        if name != "state" and t is not None and _overlap(state_bytes, _byte_range(t)):
            raise KernelInputError(name, "a tensor apart from state (state is updated in place)",
                                   "one sharing memory with state")


def _byte_range(t: torch.Tensor) -> tuple[int, int]:
    """The addresses [first, past the last) that `t`'s elements lie in (torch has no negative
    strides); empty for an empty tensor."""
    if t.numel() == 0:
        return 0, 0
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    start = t.data_ptr()
    return start, start + (last + 1) * t.element_size()


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] < b[1] and b[0] < a[1] and a[0] < a[1] and b[0] < b[1]


def _check_slots(slots, pool: int, batch: int, *, distinct: bool = True):
    """slots: an int32/int64 tensor [batch] of pool rows below `pool`, negative for padding, and
    (with `distinct`) no pool row named twice: two rows updating one state row would race (the
    cpu kernel's second row read the first's update; the reference wrote one of the two)."""
    if slots is None:
        if pool != batch:
            raise ShapeMismatch("state", f"{batch} rows (batch of x) when no slots are given",
                                f"{pool} rows")
        return None
    if not isinstance(slots, torch.Tensor) or slots.dtype not in (torch.int32, torch.int64):
        raise KernelInputError("slots", "an int32/int64 tensor", str(getattr(slots, "dtype", type(slots).__name__)))
    _require_shape("slots", slots, (batch,), "[batch]")
    if slots.is_meta:
        raise KernelInputError("slots", "a tensor with values (its indices are checked against the pool)",
                               "a tensor on meta")
    if slots.is_cuda and torch.cuda.is_current_stream_capturing():
        # Inside a CUDA graph capture there are no values to read (a read would end the
        # capture) and a replay reads whatever the tensor holds then: the capturer vouches.
        return slots
    # The slots on the host: a sync on CUDA (one per step), as int() of their max was; kept,
    # since an index past the pool would make the Triton kernel write outside `state`.
    values = slots.tolist() if slots.numel() <= _LISTED_SLOTS else slots.cpu().numpy()
    top = max(values, default=-1) if isinstance(values, list) else int(values.max())
    if top >= pool:
        raise ShapeMismatch("slots", f"indices < {pool} (pool rows) or negative for padding",
                            f"max index {top}")
    repeated = _repeated_slot(values) if distinct else None
    if repeated is not None:
        slot, count = repeated
        raise KernelInputError("slots", "distinct pool rows (negative for padding): two rows on one slot race",
                               f"slot {slot} named {count} times")
    return slots


# Up to this many slots are checked as a Python list, more through numpy's sort: each the
# cheaper at its sizes (the bridge's steps are mostly a few rows, its launches up to --max-batch).
_LISTED_SLOTS = 64


def _repeated_slot(values) -> tuple[int, int] | None:
    """(slot, times named) of a pool row `values` (a list or a numpy array) names twice or more;
    None when each is named once (negative padding may repeat)."""
    if isinstance(values, list):
        if len(set(values)) == len(values):
            return None
        live = [v for v in values if v >= 0]
        slot = next((v for v in live if live.count(v) > 1), None)
        return None if slot is None else (slot, live.count(slot))
    live = np.sort(values[values >= 0])
    same = np.flatnonzero(live[1:] == live[:-1])
    if not same.size:
        return None
    slot = int(live[same[0]])
    return slot, int((live == slot).sum())


def _norm_bc_update(name, t, batch, n, dim) -> torch.Tensor:
    if t.dim() == 2:
        _require_shape(name, t, (batch, n), "[batch, state]")
        t = t.unsqueeze(1)
    elif t.dim() == 3:
        if (t.shape[0], t.shape[2]) != (batch, n):
            raise ShapeMismatch(name, f"shape [{batch}, groups, {n}] ([batch, groups, state])", f"shape {_shape(t)}")
    else:
        raise ShapeMismatch(name, "[batch, state] or [batch, groups, state]", f"shape {_shape(t)}")
    return _check_groups(name, t, t.shape[1], dim)


# --- Mamba-2 (SSD) --------------------------------------------------------------------------
#
# ssd scan:      x, z [batch, seq, heads, headdim]; dt [batch, seq, heads]; A, dt_bias [heads];
#                B, C [batch, seq, groups, state]; D [heads, headdim] (a [heads] D is given that
#                axis as a stride-0 view); h0 [batch, heads, headdim, state] or None
# ssd update:    state [pool, heads, headdim, state]; x, z [batch, heads, headdim]; dt [batch, heads];
#                B, C [batch, groups, state]; slots [batch] or None (then pool == batch)


@dataclass(frozen=True)
class SsdDims:
    batch: int
    seq: int
    heads: int
    headdim: int
    state: int
    groups: int


@dataclass
class SsdScanArgs:
    x: torch.Tensor
    dt: torch.Tensor
    A: torch.Tensor
    B: torch.Tensor
    C: torch.Tensor
    D: torch.Tensor | None
    z: torch.Tensor | None
    dt_bias: torch.Tensor | None
    dt_softplus: bool
    dt_min: float | None
    dt_max: float | None
    h0: torch.Tensor | None
    return_state: bool
    chunk_size: int | None
    dims: SsdDims

    def backend_kwargs(self) -> dict:
        return dict(D=self.D, z=self.z, dt_bias=self.dt_bias, dt_softplus=self.dt_softplus,
                    dt_min=self.dt_min, dt_max=self.dt_max, h0=self.h0,
                    return_state=self.return_state, chunk_size=self.chunk_size)


def _check_heads_options(D, dt_bias, heads: int, headdim: int):
    """D ([heads] or [heads, headdim], returned as [heads, headdim]) and dt_bias [heads]."""
    if dt_bias is not None:
        _require_shape("dt_bias", _require_tensor("dt_bias", dt_bias), (heads,), "[heads]")
    if D is not None:
        D = _require_tensor("D", D)
        if D.dim() == 1 and D.shape[0] == heads:
            D = D.unsqueeze(1).expand(heads, headdim)
        elif tuple(D.shape) != (heads, headdim):
            raise ShapeMismatch("D", f"shape [{heads}] or [{heads}, {headdim}] ([heads] or [heads, headdim])",
                                f"shape {_shape(D)}")
    return D, dt_bias


def _check_ssd_groups(name: str, t: torch.Tensor, heads: int) -> None:
    groups = t.shape[-2]
    if groups == 0 or heads % groups != 0:
        raise ShapeMismatch(name, f"a group count dividing heads ({heads})", f"{groups} groups")


# The chunked backends (torch, triton) run a larger chunk_size at this size; the result does not
# depend on it. Their per-chunk buffers (the torch form's [Q, Q] decays and scores, Triton's
# C.B^T, its cumsum's one block) grow as seq x chunk: uncapped, a chunk as long as a request's
# sequence makes them quadratic in it.
MAX_CHUNK = 1024


def _check_chunk_size(chunk_size) -> int | None:
    if chunk_size is None:
        return None
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, numbers.Integral) or chunk_size < 1:
        raise KernelInputError("chunk_size", "a positive integer or None", repr(chunk_size))
    return int(chunk_size)


def check_ssd_scan(x, dt, A, B, C, *, D=None, z=None, dt_bias=None, dt_softplus=False,
                   dt_min=None, dt_max=None, h0=None, return_state=False,
                   chunk_size=None) -> SsdScanArgs:
    x = _require_tensor("x", x)
    if x.dim() != 4:
        raise ShapeMismatch("x", "4 dimensions ([batch, seq, heads, headdim])", f"shape {_shape(x)}")
    batch, seq, heads, headdim = x.shape
    if 0 in x.shape:
        raise ShapeMismatch("x", "non-empty batch, seq, heads and headdim", f"shape {_shape(x)}")
    dt = _require_tensor("dt", dt)
    _require_shape("dt", dt, (batch, seq, heads), "[batch, seq, heads]")
    A = _require_tensor("A", A)
    _require_shape("A", A, (heads,), "[heads]")
    B = _require_tensor("B", B)
    if B.dim() != 4 or (B.shape[0], B.shape[1]) != (batch, seq) or B.shape[3] == 0:
        raise ShapeMismatch("B", f"shape [{batch}, {seq}, groups, state] ([batch, seq, groups, state])",
                            f"shape {_shape(B)}")
    _check_ssd_groups("B", B, heads)
    groups, n = B.shape[2], B.shape[3]
    C = _require_tensor("C", C)
    _require_shape("C", C, tuple(B.shape), "same as B")
    D, dt_bias = _check_heads_options(D, dt_bias, heads, headdim)
    if z is not None:
        _require_shape("z", _require_tensor("z", z), tuple(x.shape), "same as x")
    if h0 is not None:
        h0 = _require_tensor("h0", h0)
        _require_shape("h0", h0, (batch, heads, headdim, n), "[batch, heads, headdim, state]")
    dt_min, dt_max = _clamp_bounds(dt_min, dt_max)
    chunk_size = _check_chunk_size(chunk_size)
    _check_devices(dict(x=x, dt=dt, A=A, B=B, C=C, D=D, z=z, dt_bias=dt_bias, h0=h0))
    return SsdScanArgs(x, dt, A, B, C, D, z, dt_bias, _flag("dt_softplus", dt_softplus), dt_min, dt_max, h0,
                       _flag("return_state", return_state), chunk_size, SsdDims(batch, seq, heads, headdim, n, groups))


def check_ssd_state_update(state, x, dt, A, B, C, *, D=None, z=None, dt_bias=None, dt_softplus=False,
                           dt_min=None, dt_max=None, slots=None) -> UpdateArgs:
    state = _require_tensor("state", state)
    if state.dim() != 4:
        raise ShapeMismatch("state", "4 dimensions ([pool, heads, headdim, state])", f"shape {_shape(state)}")
    pool, heads, headdim, n = state.shape
    if 0 in (heads, headdim, n):
        raise ShapeMismatch("state", "non-empty heads, headdim and state axes", f"shape {_shape(state)}")
    x = _require_tensor("x", x)
    if x.dim() != 3 or tuple(x.shape[1:]) != (heads, headdim):
        raise ShapeMismatch("x", f"shape [batch, {heads}, {headdim}] ([batch, heads, headdim])", f"shape {_shape(x)}")
    batch = x.shape[0]
    dt = _require_tensor("dt", dt)
    _require_shape("dt", dt, (batch, heads), "[batch, heads]")
    A = _require_tensor("A", A)
    _require_shape("A", A, (heads,), "[heads]")
    B = _require_tensor("B", B)
    if B.dim() != 3 or B.shape[0] != batch or B.shape[2] != n:
        raise ShapeMismatch("B", f"shape [{batch}, groups, {n}] ([batch, groups, state])", f"shape {_shape(B)}")
    _check_ssd_groups("B", B, heads)
    C = _require_tensor("C", C)
    _require_shape("C", C, tuple(B.shape), "same as B")
    D, dt_bias = _check_heads_options(D, dt_bias, heads, headdim)
    if z is not None:
        _require_shape("z", _require_tensor("z", z), tuple(x.shape), "same as x")
    slots = _check_slots(slots, pool, batch)
    dt_min, dt_max = _clamp_bounds(dt_min, dt_max)
    operands = dict(state=state, x=x, dt=dt, A=A, B=B, C=C, D=D, z=z, dt_bias=dt_bias, slots=slots)
    _check_devices(operands)
    _require_writable_state(operands)
    return UpdateArgs(state, x, dt, A, B, C, D, z, dt_bias, _flag("dt_softplus", dt_softplus), dt_min, dt_max, slots)


# --- variable-length batches ----------------------------------------------------------------


def cu_seqlens_of_seq_idx(seq_idx, cu_seqlens, x):
    """mamba_ssm's `seq_idx` (an int32/int64 tensor [batch, seq] of each position's sequence
    index, never decreasing; the state starts again wherever it grows) as the cu_seqlens it
    describes, checked against the cu_seqlens given beside it (mamba_ssm passes both for
    per-sequence states). Decreasing indexes are refused: mamba_ssm's kernels assume none, and
    would let positions of one index see each other across the sequences between them."""
    if not isinstance(seq_idx, torch.Tensor):
        raise KernelInputError("seq_idx", "an int32/int64 tensor", type(seq_idx).__name__)
    if seq_idx.dtype not in (torch.int32, torch.int64):
        raise DtypeNotAllowed("seq_idx", "an integer dtype", (torch.int32, torch.int64), seq_idx.dtype)
    if seq_idx.is_meta:
        raise KernelInputError("seq_idx", "a tensor with values (its boundaries are read)", "a tensor on meta")
    if isinstance(x, torch.Tensor) and x.dim() >= 2 and tuple(seq_idx.shape) != tuple(x.shape[:2]):
        raise ShapeMismatch("seq_idx", f"shape [batch, seq] = {list(x.shape[:2])} (x's)", f"shape {_shape(seq_idx)}")
    if seq_idx.dim() != 2 or seq_idx.shape[0] != 1 or seq_idx.shape[1] == 0:
        raise ShapeMismatch("seq_idx", "shape [1, seq] with seq >= 1 (sequences are packed along seq of batch 1)",
                            f"shape {_shape(seq_idx)}")
    row = seq_idx[0].cpu()
    falls = torch.nonzero(row[1:] < row[:-1]).flatten()
    if falls.numel():
        at = int(falls[0]) + 1
        raise KernelInputError("seq_idx", "sequence indexes that never decrease",
                               f"{int(row[at - 1])} then {int(row[at])} at position {at}")
    starts = (torch.nonzero(row[1:] != row[:-1]).flatten() + 1).tolist()
    bounds = [0, *starts, row.shape[0]]
    if cu_seqlens is not None:
        given = check_cu_seqlens(cu_seqlens, 1, row.shape[0])
        if given != bounds:
            at = next((i for i, (g, b) in enumerate(zip(given, bounds)) if g != b), min(len(given), len(bounds)))
            raise KernelInputError("seq_idx", f"the sequences cu_seqlens gives ({len(given) - 1}, boundary {at} at "
                                   f"{given[at] if at < len(given) else 'none'})",
                                   f"{len(bounds) - 1} sequences, boundary {at} at "
                                   f"{bounds[at] if at < len(bounds) else 'none'}")
        return cu_seqlens
    return torch.tensor(bounds, dtype=torch.int64)


def check_cu_seqlens(cu_seqlens, batch: int, seq: int) -> list[int]:
    """cu_seqlens: an int32/int64 tensor [n + 1] of sequence boundaries along seq: 0 first, seq
    last, strictly increasing (no empty sequence); the batch must be 1. Returns the boundaries."""
    if not isinstance(cu_seqlens, torch.Tensor):
        raise KernelInputError("cu_seqlens", "an int32/int64 tensor", type(cu_seqlens).__name__)
    if cu_seqlens.dtype not in (torch.int32, torch.int64):  # named as the caller names dtypes (the bridge: i32, i64)
        raise DtypeNotAllowed("cu_seqlens", "an integer dtype", (torch.int32, torch.int64), cu_seqlens.dtype)
    if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 2:
        raise ShapeMismatch("cu_seqlens", "shape [n + 1] with n >= 1 sequences", f"shape {_shape(cu_seqlens)}")
    if cu_seqlens.is_meta:
        raise KernelInputError("cu_seqlens", "a tensor with values (its boundaries are read)", "a tensor on meta")
    if batch != 1:
        raise ShapeMismatch("x", "batch 1 (sequences are packed along seq when cu_seqlens is given)",
                            f"batch {batch}")
    # Refused before its values are read: listed, each costs a Python int, many times its bytes.
    if cu_seqlens.shape[0] > seq + 1:
        raise ShapeMismatch("cu_seqlens", f"shape [n + 1] with n <= seq ({seq}) sequences (none empty)",
                            f"shape {_shape(cu_seqlens)}")
    bounds = [int(v) for v in cu_seqlens.tolist()]
    if bounds[0] != 0 or bounds[-1] != seq:
        raise KernelInputError("cu_seqlens", f"boundaries from 0 to seq ({seq})",
                               f"{bounds[0]} .. {bounds[-1]}")
    for i in range(1, len(bounds)):
        if bounds[i] <= bounds[i - 1]:
            raise KernelInputError("cu_seqlens", "strictly increasing boundaries (no empty sequence)",
                                   f"{bounds[i - 1]} then {bounds[i]} at index {i}")
    return bounds
