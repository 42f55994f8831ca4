"""Forward selective scan in Triton.

Grid: (batch x groups x channel blocks, sequence segments). A program owns BLOCK_D channels of
one group (so B_t and C_t are one [BLOCK_N] row per timestep for all its channels) and walks its
segment in tiles of CHUNK timesteps. Inside a tile the recurrence h_t = a_t h_{t-1} + b_t, with
a_t = exp(dt_t A) and b_t = dt_t x_t B_t, is one `tl.associative_scan` over the time axis of
[CHUNK, BLOCK_D, BLOCK_N] tensors with the combine (a1, b1), (a2, b2) -> (a1 a2, a2 b1 + b2);
the state entering the tile is folded into its first element, and the state after the tile's
last step is carried in registers to the next tile. Nothing of size [batch, seq, dim, state]
ever reaches device memory.

Sequence segments and carries. When batch x groups x channel blocks is too small to fill the
GPU (batch 1, long sequence) the sequence is cut into segments (configs.segment_tiles) and
two launches run:

  1. `_segment_state_kernel`, for every segment but the last: the state at the segment's end
     starting from zero, and the segment's summed dt per channel. Since A is constant along
     the sequence, the segment's total decay is exp(A * sum(dt)), so a [batch, segments, dim]
     sum stands for a [batch, segments, dim, state] product.
  2. `_scan_output_kernel`, for every segment: fold h0 (or zero) through the carries of the
     segments before it, H_k = exp(A * dtsum_k) H_{k-1} + h_k (a look-back, linear in the
     segment's index, over carries that sit in L2), then scan the segment again from the true
     entering state and write y (and the final state, from the last segment).

Recomputing the segment in pass 2 costs a second read of x, dt, B but needs no stored per-step
data; a decoupled look-back would save that launch but needs inter-program spinning on flags,
which the interpreter cannot prove and which deadlocks if programs are not scheduled in order.
When one segment covers the sequence (batch x channel blocks already fill the GPU, as for the
ExPhil shape 32 x 60 x 512) only pass 2 runs: one launch per call.

Both layouts are read through strides: "bld" x [batch, seq, dim], B/C [batch, seq, groups,
state]; "bdl" x [batch, dim, seq], B/C [batch, groups, state, seq]. Inputs may be fp32, fp16,
bf16 or fp64 (each tensor its own dtype); all math is fp32 (fp64 when x is fp64); y is stored in
x's dtype and the state in the accumulation dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..errors import KernelInputError
from . import configs
from .common import (
    Launch, accumulation_dtype, cdiv, check_out, clamp_bounds, discretize_dt, finite_decay_rate, offset_index,
    program_coords, packed_rows, row_strides, run_on_device_of, silu, triton_dtype, wide_offsets,
)


@triton.jit
def _combine(a_first, b_first, a_second, b_second):
    # Applying step (a_first, b_first) then (a_second, b_second) to h:
    # a_second (a_first h + b_first) + b_second.
    return a_first * a_second, a_second * b_first + b_second


@triton.jit
def _tile_states(h_in, dt, x, A, B_tile, CHUNK: tl.constexpr):
    """States after each step of one tile and the state after its last step.

    h_in [BLOCK_D, BLOCK_N]: state entering the tile. dt, x [CHUNK, BLOCK_D]: discretised dt
    (0 on padded steps/channels) and x. A [BLOCK_D, BLOCK_N]. B_tile [CHUNK, BLOCK_N]."""
    decay = tl.exp(dt[:, :, None] * A[None, :, :])
    inputs = (dt * x)[:, :, None] * B_tile[:, None, :]
    step = tl.arange(0, CHUNK)[:, None, None]
    inputs = tl.where(step == 0, decay * h_in[None, :, :] + inputs, inputs)
    _, states = tl.associative_scan((decay, inputs), 0, _combine)
    # Padded steps past the sequence end have decay 1 and input 0, so the last row is the
    # state after the last real step.
    h_out = tl.sum(tl.where(step == CHUNK - 1, states, 0.0), axis=0)
    return states, h_out


@triton.jit
def _load_tile(x_base, dt_base, B_base, t0, t_end, d, mask_d, n, mask_n, bias,
               s_x_l, s_x_d, s_dt_l, s_dt_d, s_B_l, s_B_n,
               dt_min_hi, dt_min_lo, dt_max_hi, dt_max_lo,
               HAS_DT_BIAS: tl.constexpr, DT_SOFTPLUS: tl.constexpr, HAS_CLAMP: tl.constexpr,
               ACC: tl.constexpr, CHUNK: tl.constexpr, WIDE_OFFSETS: tl.constexpr):
    """One tile's timesteps t [CHUNK] and their masks, x and discretised dt [CHUNK, BLOCK_D]
    and B [CHUNK, BLOCK_N], all in ACC (0 where masked)."""
    t = offset_index(t0 + tl.arange(0, CHUNK), WIDE_OFFSETS)
    mask_t = t < t_end
    mask_td = mask_t[:, None] & mask_d[None, :]
    mask_tn = mask_t[:, None] & mask_n[None, :]
    x = tl.load(x_base + t[:, None] * s_x_l + d[None, :] * s_x_d, mask=mask_td, other=0.0).to(ACC)
    dt = tl.load(dt_base + t[:, None] * s_dt_l + d[None, :] * s_dt_d, mask=mask_td, other=0.0).to(ACC)
    if HAS_DT_BIAS:
        dt += bias[None, :]
    dt = discretize_dt(dt, mask_td, DT_SOFTPLUS, HAS_CLAMP, dt_min_hi, dt_min_lo, dt_max_hi, dt_max_lo)
    B_tile = tl.load(B_base + t[:, None] * s_B_l + n[None, :] * s_B_n, mask=mask_tn, other=0.0).to(ACC)
    return t, mask_td, mask_tn, x, dt, B_tile


# Loop bounds and counters: knowing they are multiples of 16 buys nothing, and not specialising
# on them keeps one compiled variant per bucket whatever the sequence length.
_UNSPECIALISED = ["seq", "segment_len", "n_carries"]


@triton.jit
def _sequence_of(row, cu_seqlens_ptr, seq, PACKED: tl.constexpr):
    """(first timestep, length) of a program's sequence: with PACKED, sequence `row` of those
    packed along one batch row at cu_seqlens (the operands' batch stride then passed as 0);
    else the whole of batch row `row`."""
    if PACKED:
        first = tl.load(cu_seqlens_ptr + row)
        length = (tl.load(cu_seqlens_ptr + row + 1) - first).to(tl.int32)
    else:
        first = row * 0
        length = seq
    return first, length


@triton.jit(do_not_specialize=_UNSPECIALISED)
def _segment_state_kernel(
    x_ptr, dt_ptr, A_ptr, B_ptr, dt_bias_ptr, carry_h_ptr, carry_dt_ptr, cu_seqlens_ptr,
    seq, dim, nstate, groups, dim_per_group, segment_len, n_carries,
    dt_min_hi, dt_min_lo, dt_max_hi, dt_max_lo,
    s_x_b, s_x_l, s_x_d, s_dt_b, s_dt_l, s_dt_d,
    s_B_b, s_B_l, s_B_g, s_B_n, s_A_d, s_A_n, s_bias,
    HAS_DT_BIAS: tl.constexpr, DT_SOFTPLUS: tl.constexpr, HAS_CLAMP: tl.constexpr, PACKED: tl.constexpr,
    ACC: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr,
    WIDE_OFFSETS: tl.constexpr,
):
    """Pass 1: carry_h[row, seg] = state after segment `seg` from a zero state;
    carry_dt[row, seg] = the segment's summed (discretised) dt."""
    row, group, d, mask_d = program_coords(dim_per_group, groups, BLOCK_D, WIDE_OFFSETS)
    first, length = _sequence_of(row, cu_seqlens_ptr, seq, PACKED)
    seg = tl.program_id(1)
    n = offset_index(tl.arange(0, BLOCK_N), WIDE_OFFSETS)
    mask_n = n < nstate
    mask_dn = mask_d[:, None] & mask_n[None, :]
    A = finite_decay_rate(tl.load(A_ptr + d[:, None] * s_A_d + n[None, :] * s_A_n, mask=mask_dn, other=0.0).to(ACC))
    bias = tl.zeros([BLOCK_D], dtype=ACC)  # read only when HAS_DT_BIAS
    if HAS_DT_BIAS:
        bias = tl.load(dt_bias_ptr + d * s_bias, mask=mask_d, other=0.0).to(ACC)
    x_base = x_ptr + row * s_x_b + first * s_x_l
    dt_base = dt_ptr + row * s_dt_b + first * s_dt_l
    B_base = B_ptr + row * s_B_b + first * s_B_l + group * s_B_g
    h = tl.zeros([BLOCK_D, BLOCK_N], dtype=ACC)
    dt_total = tl.zeros([BLOCK_D], dtype=ACC)
    t_start = seg * segment_len
    t_end = tl.minimum(t_start + segment_len, length)
    for t0 in range(t_start, t_end, CHUNK):
        _, _, _, x, dt, B_tile = _load_tile(
            x_base, dt_base, B_base, t0, t_end, d, mask_d, n, mask_n, bias,
            s_x_l, s_x_d, s_dt_l, s_dt_d, s_B_l, s_B_n, dt_min_hi, dt_min_lo, dt_max_hi, dt_max_lo,
            HAS_DT_BIAS, DT_SOFTPLUS, HAS_CLAMP, ACC, CHUNK, WIDE_OFFSETS)
        _, h = _tile_states(h, dt, x, A, B_tile, CHUNK)
        dt_total += tl.sum(dt, axis=0)
    carry = (row * n_carries + seg) * dim + d
    tl.store(carry_dt_ptr + carry, dt_total, mask=mask_d)
    tl.store(carry_h_ptr + carry[:, None] * nstate + n[None, :], h, mask=mask_dn)


@triton.jit(do_not_specialize=_UNSPECIALISED)
def _scan_output_kernel(
    x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, dt_bias_ptr, h0_ptr,
    carry_h_ptr, carry_dt_ptr, y_ptr, state_ptr, cu_seqlens_ptr,
    seq, dim, nstate, groups, dim_per_group, segment_len, n_carries,
    dt_min_hi, dt_min_lo, dt_max_hi, dt_max_lo,
    s_x_b, s_x_l, s_x_d, s_dt_b, s_dt_l, s_dt_d, s_z_b, s_z_l, s_z_d, s_y_b, s_y_l, s_y_d,
    s_B_b, s_B_l, s_B_g, s_B_n, s_C_b, s_C_l, s_C_g, s_C_n,
    s_A_d, s_A_n, s_D, s_bias, s_h0_b, s_h0_d, s_h0_n, s_st_b, s_st_d, s_st_n,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_DT_BIAS: tl.constexpr,
    DT_SOFTPLUS: tl.constexpr, HAS_CLAMP: tl.constexpr, HAS_H0: tl.constexpr,
    HAS_CARRIES: tl.constexpr, STORE_STATE: tl.constexpr, PACKED: tl.constexpr,
    ACC: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr,
    WIDE_OFFSETS: tl.constexpr,
):
    """Pass 2 (the only pass when there is one segment): y for one segment, and the final state
    from the last segment."""
    row, group, d, mask_d = program_coords(dim_per_group, groups, BLOCK_D, WIDE_OFFSETS)
    first, length = _sequence_of(row, cu_seqlens_ptr, seq, PACKED)
    seg = tl.program_id(1)
    n = offset_index(tl.arange(0, BLOCK_N), WIDE_OFFSETS)
    mask_n = n < nstate
    mask_dn = mask_d[:, None] & mask_n[None, :]
    A = finite_decay_rate(tl.load(A_ptr + d[:, None] * s_A_d + n[None, :] * s_A_n, mask=mask_dn, other=0.0).to(ACC))
    bias = tl.zeros([BLOCK_D], dtype=ACC)  # read only when HAS_DT_BIAS
    if HAS_DT_BIAS:
        bias = tl.load(dt_bias_ptr + d * s_bias, mask=mask_d, other=0.0).to(ACC)
    if HAS_D:
        D = tl.load(D_ptr + d * s_D, mask=mask_d, other=0.0).to(ACC)

    if HAS_H0:
        h = tl.load(h0_ptr + row * s_h0_b + d[:, None] * s_h0_d + n[None, :] * s_h0_n,
                    mask=mask_dn, other=0.0).to(ACC)
    else:
        h = tl.zeros([BLOCK_D, BLOCK_N], dtype=ACC)
    if HAS_CARRIES:
        # Look-back: the state entering this segment from h0 and the earlier segments' carries.
        for k in range(0, seg):
            carry = (row * n_carries + k) * dim + d
            dt_sum = tl.load(carry_dt_ptr + carry, mask=mask_d, other=0.0)
            h_k = tl.load(carry_h_ptr + carry[:, None] * nstate + n[None, :], mask=mask_dn, other=0.0)
            h = tl.exp(dt_sum[:, None] * A) * h + h_k

    x_base = x_ptr + row * s_x_b + first * s_x_l
    dt_base = dt_ptr + row * s_dt_b + first * s_dt_l
    y_base = y_ptr + row * s_y_b + first * s_y_l
    B_base = B_ptr + row * s_B_b + first * s_B_l + group * s_B_g
    C_base = C_ptr + row * s_C_b + first * s_C_l + group * s_C_g
    t_start = seg * segment_len
    t_end = tl.minimum(t_start + segment_len, length)
    for t0 in range(t_start, t_end, CHUNK):
        t, mask_td, mask_tn, x, dt, B_tile = _load_tile(
            x_base, dt_base, B_base, t0, t_end, d, mask_d, n, mask_n, bias,
            s_x_l, s_x_d, s_dt_l, s_dt_d, s_B_l, s_B_n, dt_min_hi, dt_min_lo, dt_max_hi, dt_max_lo,
            HAS_DT_BIAS, DT_SOFTPLUS, HAS_CLAMP, ACC, CHUNK, WIDE_OFFSETS)
        C_tile = tl.load(C_base + t[:, None] * s_C_l + n[None, :] * s_C_n, mask=mask_tn, other=0.0).to(ACC)
        states, h = _tile_states(h, dt, x, A, B_tile, CHUNK)
        # Padded state entries hold 0 * B's padding; an infinite dt x makes them NaN (0 * inf).
        y = tl.sum(tl.where(mask_n[None, None, :], states * C_tile[:, None, :], 0.0), axis=2)
        if HAS_D:
            y += x * D[None, :]
        if HAS_Z:
            z_base = z_ptr + row * s_z_b + first * s_z_l
            z = tl.load(z_base + t[:, None] * s_z_l + d[None, :] * s_z_d, mask=mask_td, other=0.0).to(ACC)
            y *= silu(z)
        tl.store(y_base + t[:, None] * s_y_l + d[None, :] * s_y_d, y.to(y_ptr.dtype.element_ty), mask=mask_td)

    if STORE_STATE:
        if seg == tl.num_programs(1) - 1:
            tl.store(state_ptr + row * s_st_b + d[:, None] * s_st_d + n[None, :] * s_st_n,
                     h.to(state_ptr.dtype.element_ty), mask=mask_dn)


# CUDA's limit on the second grid axis (the segments).
_MAX_GRID_Y = 65535


@dataclass(frozen=True)
class ScanPlan:
    """How one call is cut up; `warmup` reports it."""
    block_n: int
    blocks: configs.ScanBlocks
    segment_len: int  # timesteps per segment, a multiple of blocks.chunk
    n_segments: int
    programs_per_segment: int

    def describe(self) -> str:
        passes = "1 launch" if self.n_segments == 1 else "2 launches"
        return (f"{self.programs_per_segment}x{self.n_segments} programs ({passes}), "
                f"block_d={self.blocks.block_d} block_n={self.block_n} chunk={self.blocks.chunk} "
                f"segment={self.segment_len} warps={self.blocks.num_warps}")


def plan_scan(batch: int, seq: int, dim: int, state: int, groups: int, device: torch.device,
              blocks: configs.ScanBlocks | None = None, segment_len: int | None = None) -> ScanPlan:
    """Blocks from the table (or `blocks`) and the sequence split (or `segment_len`, rounded up
    to whole chunks). The overrides exist for tests, which need small tiles and several
    segments to reach every code path at sizes the interpreter can run."""
    dim_per_group = dim // groups
    block_n, table_blocks = configs.scan_blocks(state, dim_per_group)
    blocks = blocks or table_blocks
    programs = batch * groups * cdiv(dim_per_group, blocks.block_d)
    n_tiles = cdiv(seq, blocks.chunk)
    if segment_len is None:
        tiles = configs.segment_tiles(n_tiles, programs, device)
    else:
        if segment_len < 1:
            raise KernelInputError("segment_len", "a positive number of timesteps", str(segment_len))
        tiles = min(n_tiles, cdiv(segment_len, blocks.chunk))
    n_segments = cdiv(n_tiles, tiles)
    if n_segments > _MAX_GRID_Y:
        raise KernelInputError("segment_len", f"a split into at most {_MAX_GRID_Y} segments",
                               f"{n_segments} segments")
    return ScanPlan(block_n, blocks, tiles * blocks.chunk, n_segments, programs)


def _seq_strides(t: torch.Tensor, layout: str) -> tuple[int, int, int]:
    """(batch, seq, dim) strides of x, dt, z or y in either layout."""
    if layout == "bld":
        return t.stride(0), t.stride(1), t.stride(2)
    return t.stride(0), t.stride(2), t.stride(1)


def _bc_strides(t: torch.Tensor, layout: str) -> tuple[int, int, int, int]:
    """(batch, seq, group, state) strides of B or C in either layout."""
    if layout == "bld":
        return t.stride(0), t.stride(1), t.stride(2), t.stride(3)
    return t.stride(0), t.stride(3), t.stride(1), t.stride(2)


def selective_scan(x, dt, A, B, C, *, D=None, z=None, dt_bias=None, dt_softplus=False,
                   dt_min=None, dt_max=None, h0=None, return_state=False, layout="bld",
                   cu_seqlens=None, out=None, state_out=None, blocks=None, segment_len=None):
    """The "triton" backend's scan; arguments as normalised by `scan_kernels._args.check_scan`, and
    `cu_seqlens` (int64 [n + 1], checked) for sequences packed along a batch-1 input's seq.

    Internal keywords: `out` / `state_out` receive y / the final state instead of fresh
    tensors (tests pass NaN-filled ones so that an element the kernels never write shows up);
    `blocks` / `segment_len` override the table and the sequence split (see plan_scan)."""
    out, state_out, launches = scan_launches(
        x, dt, A, B, C, D=D, z=z, dt_bias=dt_bias, dt_softplus=dt_softplus, dt_min=dt_min,
        dt_max=dt_max, h0=h0, return_state=return_state, layout=layout, out=out,
        state_out=state_out, blocks=blocks, segment_len=segment_len, cu_seqlens=cu_seqlens)
    run_on_device_of(x, launches)
    return out, state_out


def scan_launches(x, dt, A, B, C, *, D, z, dt_bias, dt_softplus, dt_min, dt_max, h0,
                  return_state, layout, out, state_out, blocks, segment_len, cu_seqlens=None):
    """(y, state or None, the launches that fill them), outputs allocated, nothing run.

    With `cu_seqlens` (a CPU int64 tensor of n + 1 boundaries along a batch-1 input's seq), the
    n sequences are the launches' rows: each program reads its sequence's boundaries, the
    operands' batch stride is passed as 0, and the split into segments follows the longest."""
    if layout == "bld":
        batch, seq, dim = x.shape
        groups = B.shape[2]
    else:
        batch, dim, seq = x.shape
        groups = B.shape[1]
    nstate = A.shape[1]
    device = x.device
    acc = accumulation_dtype(x)
    packed = cu_seqlens is not None
    rows, longest, cu_seqlens = packed_rows(cu_seqlens, batch, seq, device)
    plan = plan_scan(rows, longest, dim, nstate, groups, device, blocks, segment_len)

    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=device)
    else:
        check_out("out", out, x.shape, x.dtype, device)
    if return_state:
        if state_out is None:
            state_out = torch.empty((rows, dim, nstate), dtype=acc, device=device)
        else:
            check_out("state_out", state_out, (rows, dim, nstate), acc, device)
    else:
        state_out = None

    has_clamp, bounds = clamp_bounds(dt_min, dt_max)
    dim_per_group = dim // groups
    n_carries = plan.n_segments - 1
    s_x, s_dt = row_strides(_seq_strides(x, layout), packed), row_strides(_seq_strides(dt, layout), packed)
    s_B, s_C = row_strides(_bc_strides(B, layout), packed), row_strides(_bc_strides(C, layout), packed)
    s_bias = dt_bias.stride(0) if dt_bias is not None else 0
    wide = wide_offsets(per_row=(x, dt, z, out, B, C, h0, state_out), whole=(A, D, dt_bias))
    blocks_constexprs = dict(ACC=triton_dtype(acc), BLOCK_D=plan.blocks.block_d,
                             BLOCK_N=plan.block_n, CHUNK=plan.blocks.chunk, WIDE_OFFSETS=wide)
    launches = []

    carry_h = carry_dt = None
    if n_carries:
        carry_h = torch.empty((rows, n_carries, dim, nstate), dtype=acc, device=device)
        carry_dt = torch.empty((rows, n_carries, dim), dtype=acc, device=device)
        launches.append(Launch(
            _segment_state_kernel, (plan.programs_per_segment, n_carries),
            (x, dt, A, B, dt_bias, carry_h, carry_dt, cu_seqlens,
             seq, dim, nstate, groups, dim_per_group, plan.segment_len, n_carries,
             *bounds,
             *s_x, *s_dt, *s_B, A.stride(0), A.stride(1), s_bias),
            dict(HAS_DT_BIAS=dt_bias is not None, DT_SOFTPLUS=bool(dt_softplus), HAS_CLAMP=has_clamp,
                 PACKED=packed, **blocks_constexprs),
            plan.blocks.num_warps))

    s_z = row_strides(_seq_strides(z, layout), packed) if z is not None else (0, 0, 0)
    s_h0 = h0.stride() if h0 is not None else (0, 0, 0)
    s_st = state_out.stride() if state_out is not None else (0, 0, 0)
    launches.append(Launch(
        _scan_output_kernel, (plan.programs_per_segment, plan.n_segments),
        (x, dt, A, B, C, D, z, dt_bias, h0, carry_h, carry_dt, out, state_out, cu_seqlens,
         seq, dim, nstate, groups, dim_per_group, plan.segment_len, n_carries,
         *bounds,
         *s_x, *s_dt, *s_z, *row_strides(_seq_strides(out, layout), packed), *s_B, *s_C,
         A.stride(0), A.stride(1), D.stride(0) if D is not None else 0, s_bias, *s_h0, *s_st),
        dict(HAS_D=D is not None, HAS_Z=z is not None, HAS_DT_BIAS=dt_bias is not None,
             DT_SOFTPLUS=bool(dt_softplus), HAS_CLAMP=has_clamp, HAS_H0=h0 is not None,
             HAS_CARRIES=n_carries > 0, STORE_STATE=state_out is not None, PACKED=packed, **blocks_constexprs),
        plan.blocks.num_warps))
    return out, state_out, launches
