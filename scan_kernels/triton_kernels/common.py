"""What the scan and the state-update kernels share, so the two cannot drift apart: the
element-wise math (dt discretisation, silu gate) on the device side, and on the host side the
accumulation dtype, the clamp bounds' encoding and the check of caller-supplied outputs.
"""

from __future__ import annotations

import contextlib
import math
import os
import struct
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from ..errors import KernelInputError

# torch.nn.functional.softplus's default threshold: above it softplus(x) is x to fp32 precision
# and exp(x) would only add overflow risk.
SOFTPLUS_THRESHOLD = tl.constexpr(20.0)


@triton.jit
def _bound(high, low, dtype: tl.constexpr):
    value = tl.cast(high, dtype)
    if dtype == tl.float64:
        value += tl.cast(low, dtype)
    return value


@triton.jit
def _log1p(e):
    """log(1 + e) to full relative precision for small e, without libdevice's log1p, which the
    interpreter cannot run (so the tests could not prove it). u = 1 + e is rounded, but
    log(u) / (u - 1) is accurate to a few ulps for the rounded u, and times e it gives log1p(e)
    (tl.log is libdevice's accurate log on CUDA). Where u rounds to 1, log1p(e) is e to working
    precision; the divisor there is 1, not 0, which the interpreter would warn about."""
    u = 1.0 + e
    rounded_away = u == 1.0
    return tl.where(rounded_away, e, tl.log(u) * (e / tl.where(rounded_away, 1.0, u - 1.0)))


@triton.jit
def discretize_dt(dt, exists, DT_SOFTPLUS: tl.constexpr, HAS_CLAMP: tl.constexpr,
                  dt_min_hi, dt_min_lo, dt_max_hi, dt_max_lo):
    """dt (bias already added, in the accumulation dtype) -> softplus if asked -> clamp if asked,
    and 0 wherever `exists` is false (padded timesteps or channels), so that a padded step has
    decay exp(0 * A) = 1 and input 0 and leaves the state as it was.

    Softplus is log1p(exp(dt)), dt itself above torch's threshold: log(1 + exp(dt)) rounds
    exp(dt) away in fp32 (4e-4 relative error at dt = -10, softplus 0 from dt = -17), and y
    and the state, both proportional to dt, would carry that relative error.
    The clamp keeps a NaN dt NaN, as torch.clamp does: Triton's maximum and minimum return the
    bound by default, which would hide the NaN in a finite y. The clamp bounds come as fp32
    pairs (see clamp_bounds)."""
    if DT_SOFTPLUS:
        dt = tl.where(dt > SOFTPLUS_THRESHOLD, dt, _log1p(tl.exp(dt)))
    if HAS_CLAMP:
        dt = tl.maximum(dt, _bound(dt_min_hi, dt_min_lo, dt.dtype), propagate_nan=tl.PropagateNan.ALL)
        dt = tl.minimum(dt, _bound(dt_max_hi, dt_max_lo, dt.dtype), propagate_nan=tl.PropagateNan.ALL)
    return tl.where(exists, dt, 0.0)


# The largest finite fp32: a decay rate A of -inf (A = -exp(A_log) past fp32's range) or +inf
# is read as -+ this, so that a padded step's dt of 0 gives 0 * A = 0 and decay 1 rather than
# NaN. A real step's decay is then 0 (or inf) as the reference's, for any dt above 1e-35.
FINITE_RATE_BOUND = tl.constexpr(3.4028234663852886e38)


@triton.jit
def finite_decay_rate(A):
    """A with -inf and inf read as -+FINITE_RATE_BOUND; NaN stays NaN (its comparisons are false)."""
    A = tl.where(A < -FINITE_RATE_BOUND, -FINITE_RATE_BOUND, A)
    return tl.where(A > FINITE_RATE_BOUND, FINITE_RATE_BOUND, A)


@triton.jit
def offset_index(index, WIDE_OFFSETS: tl.constexpr):
    """An index the kernels multiply by a stride: int64 in the WIDE_OFFSETS variant (see
    `wide_offsets`), else as it is."""
    if WIDE_OFFSETS:
        index = index.to(tl.int64)
    return index


@triton.jit
def program_coords(dim_per_group, groups, BLOCK_D: tl.constexpr, WIDE_OFFSETS: tl.constexpr):
    """(batch row as int64, group, channel indices [BLOCK_D], channel mask) of a program on a
    (rows x groups x channel blocks) first grid axis; the group and the channels as
    `offset_index` has them."""
    pid = tl.program_id(0)
    n_dblocks = tl.cdiv(dim_per_group, BLOCK_D)
    dblock = pid % n_dblocks
    group = offset_index((pid // n_dblocks) % groups, WIDE_OFFSETS)
    row = (pid // (n_dblocks * groups)).to(tl.int64)
    in_group = dblock * BLOCK_D + tl.arange(0, BLOCK_D)
    return row, group, group * dim_per_group + in_group, in_group < dim_per_group


@triton.jit
def silu(z):
    return z * tl.sigmoid(z)


def _to_fp32(value: float) -> float:
    try:
        return struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:  # beyond fp32's range: as far as an fp32 dt can reach
        return math.copysign(math.inf, value)


def _fp32_pair(value: float) -> tuple[float, float]:
    high = _to_fp32(value)
    if math.isinf(high):
        return high, 0.0
    return high, _to_fp32(value - high)


def clamp_bounds(dt_min: float | None, dt_max: float | None) -> tuple[bool, tuple[float, ...]]:
    """(clamp or not, (min_hi, min_lo, max_hi, max_lo)) for `discretize_dt`.

    Triton passes a Python float to a kernel as fp32 (and its interpreter does the same), so a
    bound like 0.05 would be rounded before an fp64 clamp. Each bound is sent as two fp32
    values, the rounded bound and the rounding error: the fp32 kernel uses the first (what torch
    uses for a float clamp), the fp64 kernel their sum, exact to ~1e-15. An open side is +-inf."""
    if dt_min is None and dt_max is None:
        return False, (0.0, 0.0, 0.0, 0.0)
    low = _fp32_pair(float("-inf") if dt_min is None else dt_min)
    high = _fp32_pair(float("inf") if dt_max is None else dt_max)
    return True, low + high


# The ordinary kernel variant computes every element offset but the row's in int32 (see
# wide_offsets); from this many elements on, a launch takes the WIDE_OFFSETS variant. Tests
# lower it to run that variant at sizes the interpreter can run.
INT32_OFFSET_LIMIT = 2**31


def largest_offset(shape, strides) -> int:
    """The largest element offset of a tensor from its first element: the sum over its axes of
    (size - 1) * |stride|; 0 for an empty tensor, which the kernels never index."""
    if 0 in tuple(shape):
        return 0
    return sum((size - 1) * abs(stride) for size, stride in zip(shape, strides))


def wide_offsets(per_row, whole) -> bool:
    """Whether a launch needs the kernels' WIDE_OFFSETS variant, which computes element offsets
    in int64. The ordinary variant takes only the batch row (or pool slot) as an int64; the
    timestep, channel, group and state indices are int32, and Triton passes a stride that fits
    int32 as an int32, so their products with the strides wrap once an offset reaches 2^31
    elements (a [1, 524288, 4096] x, or a strided view of a larger buffer). Ordinary sizes keep
    the int32 variant, compiled exactly as before.

    `per_row`: tensors whose first axis is the row or the slot, counted without it; `whole`:
    tensors indexed without a row (A, D, dt_bias). None entries are skipped."""
    # No offset within a tensor passes the elements its storage holds, so with every storage
    # below the limit (ordinary sizes) the launch needs no per-axis sums, which would cost every
    # launch host time (docs/performance.md, "triton wide offsets").
    if all(t.untyped_storage().nbytes() < INT32_OFFSET_LIMIT * t.element_size()
           for t in (*per_row, *whole) if t is not None):
        return False
    extents = [largest_offset(t.shape[1:], t.stride()[1:]) for t in per_row if t is not None]
    extents += [largest_offset(t.shape, t.stride()) for t in whole if t is not None]
    return max(extents, default=0) >= INT32_OFFSET_LIMIT


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for host ints. triton.cdiv and triton.next_power_of_2 are constexpr functions
    that host code may call, but each call goes through their device-side wrapper, which costs
    a launch's planning more than all of its own arithmetic."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of 2 at least n (n >= 1), for host ints: see cdiv."""
    return 1 << (n - 1).bit_length()


def packed_rows(cu_seqlens, batch: int, seq: int, device) -> tuple[int, int, torch.Tensor | None]:
    """(program rows, longest sequence, boundaries on `device` as int64 or None) of a launch:
    `batch` rows of `seq` steps, or the sequences packed at `cu_seqlens` (a CPU tensor [n + 1]),
    each a row of its own."""
    if cu_seqlens is None:
        return batch, seq, None
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    return lengths.numel(), int(lengths.max()), cu_seqlens.to(device=device, dtype=torch.int64)


def row_strides(strides: tuple[int, ...], packed: bool) -> tuple[int, ...]:
    """Strides with the batch row's (the first) as 0 for packed sequences, whose programs' rows
    are the sequences in the one batch row."""
    return (0, *strides[1:]) if packed else tuple(strides)


def interpreter_active() -> bool:
    """Whether Triton runs kernels on its CPU interpreter (TRITON_INTERPRET=1 when the kernels
    were defined) instead of compiling them."""
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


@dataclass(frozen=True)
class Launch:
    """One kernel launch, its arguments built before it runs: the launchers run these, and
    `aot_check` compiles the very same specialisations for a GPU that is not present."""
    kernel: Any  # a @triton.jit function
    grid: tuple[int, ...]
    args: tuple  # the kernel's non-constexpr parameters, in order
    constexprs: dict[str, Any]
    num_warps: int

    def run(self) -> None:
        self.kernel[self.grid](*self.args, num_warps=self.num_warps, **self.constexprs)


def run_on_device_of(t: torch.Tensor, launches: list[Launch]) -> None:
    """Run `launches` in order on `t`'s device. Triton launches on the current CUDA device (with
    its current stream), not on the device its tensors are on, so `t`'s device is made current
    for them (off CUDA, under the interpreter, there is nothing to make current)."""
    with torch.cuda.device(t.device) if t.device.type == "cuda" else contextlib.nullcontext():
        for launch in launches:
            launch.run()


def accumulation_dtype(x: torch.Tensor) -> torch.dtype:
    """State and math dtype: fp64 for fp64 x, fp32 otherwise."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def triton_dtype(dtype: torch.dtype):
    return {torch.float32: tl.float32, torch.float64: tl.float64}[dtype]


def check_out(name: str, t: torch.Tensor, shape, dtype: torch.dtype, device: torch.device) -> None:
    """A caller-supplied output tensor must be exactly what the launcher would allocate
    (any strides)."""
    if not isinstance(t, torch.Tensor):
        raise KernelInputError(name, "a torch.Tensor", type(t).__name__)
    if tuple(t.shape) != tuple(shape) or t.dtype != dtype or t.device != device:
        raise KernelInputError(name, f"a {dtype} tensor of shape {list(shape)} on {device}",
                               f"a {t.dtype} tensor of shape {list(t.shape)} on {t.device}")
