"""One timestep of the selective scan for many rows, in Triton, state updated in place.

Grid: (rows x groups x channel blocks,). A program owns BLOCK_D channels of one group of one row:
it reads that row's slot, streams its [BLOCK_D, BLOCK_N] slice of the state in, applies
h = exp(dt A) h + dt B x, writes the slice back and writes y = C . h (+ D x) (* silu(z)).
A row whose slot is negative is padding: its y is zeros and its state slice is neither read nor
written (every state access is masked by the slot's sign).

Rows must name distinct slots: two rows on one slot would race on the same state slice.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import configs
from .common import (
    Launch, accumulation_dtype, cdiv, check_out, clamp_bounds, discretize_dt, offset_index, program_coords,
    run_on_device_of, silu, triton_dtype, wide_offsets,
)


@triton.jit
def _state_update_kernel(
    state_ptr, x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, dt_bias_ptr, slots_ptr, y_ptr,
    nstate, groups, dim_per_group,
    dt_min_hi, dt_min_lo, dt_max_hi, dt_max_lo,
    s_st_p, s_st_d, s_st_n, s_x_b, s_x_d, s_dt_b, s_dt_d, s_z_b, s_z_d, s_y_b, s_y_d,
    s_B_b, s_B_g, s_B_n, s_C_b, s_C_g, s_C_n, s_A_d, s_A_n, s_D, s_bias, s_slots,
    HAS_SLOTS: tl.constexpr, HAS_D: tl.constexpr, HAS_Z: tl.constexpr,
    HAS_DT_BIAS: tl.constexpr, DT_SOFTPLUS: tl.constexpr, HAS_CLAMP: tl.constexpr,
    ACC: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, WIDE_OFFSETS: tl.constexpr,
):
    row, group, d, mask_d = program_coords(dim_per_group, groups, BLOCK_D, WIDE_OFFSETS)
    n = offset_index(tl.arange(0, BLOCK_N), WIDE_OFFSETS)

    if HAS_SLOTS:
        slot = tl.load(slots_ptr + row * s_slots).to(tl.int64)
    else:
        slot = row
    live = slot >= 0
    # A padding row reads and writes nothing: its masks admit no channel and no state index.
    mask_live_d = tl.where(live, mask_d, False)
    mask_live_n = n < tl.where(live, nstate, 0)
    mask_live_dn = mask_live_d[:, None] & mask_live_n[None, :]

    x = tl.load(x_ptr + row * s_x_b + d * s_x_d, mask=mask_live_d, other=0.0).to(ACC)
    dt = tl.load(dt_ptr + row * s_dt_b + d * s_dt_d, mask=mask_live_d, other=0.0).to(ACC)
    if HAS_DT_BIAS:
        dt += tl.load(dt_bias_ptr + d * s_bias, mask=mask_live_d, other=0.0).to(ACC)
    dt = discretize_dt(dt, mask_live_d, DT_SOFTPLUS, HAS_CLAMP, dt_min_hi, dt_min_lo, dt_max_hi, dt_max_lo)
    A = tl.load(A_ptr + d[:, None] * s_A_d + n[None, :] * s_A_n, mask=mask_live_dn, other=0.0).to(ACC)
    B = tl.load(B_ptr + row * s_B_b + group * s_B_g + n * s_B_n, mask=mask_live_n, other=0.0).to(ACC)
    C = tl.load(C_ptr + row * s_C_b + group * s_C_g + n * s_C_n, mask=mask_live_n, other=0.0).to(ACC)

    state_ptrs = state_ptr + slot * s_st_p + d[:, None] * s_st_d + n[None, :] * s_st_n
    h = tl.load(state_ptrs, mask=mask_live_dn, other=0.0).to(ACC)
    h = tl.exp(dt[:, None] * A) * h + (dt * x)[:, None] * B[None, :]
    tl.store(state_ptrs, h.to(state_ptr.dtype.element_ty), mask=mask_live_dn)

    # Padded state entries hold 0 * B's padding; an infinite dt x makes them NaN (0 * inf).
    y = tl.sum(tl.where(mask_live_n[None, :], h * C[None, :], 0.0), axis=1)
    if HAS_D:
        y += x * tl.load(D_ptr + d * s_D, mask=mask_live_d, other=0.0).to(ACC)
    if HAS_Z:
        y *= silu(tl.load(z_ptr + row * s_z_b + d * s_z_d, mask=mask_live_d, other=0.0).to(ACC))
    # A padding row loaded every input as 0, so its y is exactly 0 here; it is still stored.
    tl.store(y_ptr + row * s_y_b + d * s_y_d, y.to(y_ptr.dtype.element_ty), mask=mask_d)


@dataclass(frozen=True)
class UpdatePlan:
    """How one call is cut up; `warmup` reports it."""
    block_n: int
    blocks: configs.UpdateBlocks
    programs: int

    def describe(self) -> str:
        return (f"{self.programs} programs, block_d={self.blocks.block_d} block_n={self.block_n} "
                f"warps={self.blocks.num_warps}")


def plan_update(batch: int, dim: int, state: int, groups: int,
                blocks: configs.UpdateBlocks | None = None) -> UpdatePlan:
    """Blocks from the table, or `blocks` (tests use small ones to reach several channel blocks
    per group at sizes the interpreter runs quickly)."""
    block_n, table_blocks = configs.update_blocks(state, dim // groups)
    blocks = blocks or table_blocks
    return UpdatePlan(block_n, blocks, batch * groups * cdiv(dim // groups, blocks.block_d))


def selective_state_update(state, x, dt, A, B, C, *, D=None, z=None, dt_bias=None,
                           dt_softplus=False, dt_min=None, dt_max=None, slots=None,
                           out=None, blocks=None):
    """The "triton" backend's state update; arguments as normalised by
    `scan_kernels._args.check_state_update` (B, C [batch, groups, state]). Returns y [batch, dim] in
    x's dtype; `state` rows are updated in place.

    Internal keywords: `out` receives y instead of a fresh tensor (tests pass a NaN-filled one);
    `blocks` overrides the table (configs.UpdateBlocks)."""
    out, launch = update_launch(state, x, dt, A, B, C, D=D, z=z, dt_bias=dt_bias,
                                dt_softplus=dt_softplus, dt_min=dt_min, dt_max=dt_max,
                                slots=slots, out=out, blocks=blocks)
    run_on_device_of(x, [launch])
    return out


def update_launch(state, x, dt, A, B, C, *, D, z, dt_bias, dt_softplus, dt_min, dt_max, slots,
                  out, blocks):
    """(y, the launch that fills it and updates `state`), y allocated, nothing run."""
    batch, dim = x.shape
    nstate = state.shape[2]
    groups = B.shape[1]
    plan = plan_update(batch, dim, nstate, groups, blocks)
    if out is None:
        out = torch.empty((batch, dim), dtype=x.dtype, device=x.device)
    else:
        check_out("out", out, (batch, dim), x.dtype, x.device)
    has_clamp, bounds = clamp_bounds(dt_min, dt_max)
    return out, Launch(
        _state_update_kernel, (plan.programs,),
        (state, x, dt, A, B, C, D, z, dt_bias, slots, out,
         nstate, groups, dim // groups,
         *bounds,
         *state.stride(), *x.stride(), *dt.stride(),
         *(z.stride() if z is not None else (0, 0)), *out.stride(),
         *B.stride(), *C.stride(), *A.stride(),
         D.stride(0) if D is not None else 0, dt_bias.stride(0) if dt_bias is not None else 0,
         slots.stride(0) if slots is not None else 0),
        dict(HAS_SLOTS=slots is not None, HAS_D=D is not None, HAS_Z=z is not None,
             HAS_DT_BIAS=dt_bias is not None, DT_SOFTPLUS=bool(dt_softplus), HAS_CLAMP=has_clamp,
             ACC=triton_dtype(accumulation_dtype(x)), BLOCK_D=plan.blocks.block_d,
             BLOCK_N=plan.block_n,
             WIDE_OFFSETS=wide_offsets(per_row=(state, x, dt, z, out, B, C), whole=(A, D, dt_bias))),
        plan.blocks.num_warps)
