"""Gradients of the selective scan (Mamba-1) and of the SSD scan (Mamba-2) in Triton.

The cpu backend's design (scan_kernels/cpu/scan_backward.cpp) on the GPU. Storing the state history
would take [batch, seq, dim, state] values, `state` times the size of x, so it is never stored.
A program owns (batch row, BLOCK_D channels of one group), as in the forward, and two launches
run over the same grid:

  1. `_checkpoint_kernel` walks the sequence forward once and stores the state entering every
     tile of CHUNK steps: [batch, ceil(seq / CHUNK), dim, state] in the accumulation dtype,
     CHUNK times smaller than the history.
  2. `_reverse_kernel` walks the tiles backward. Each tile's states are recomputed from its
     checkpoint in registers (an associative scan, as the forward's), then the reverse recurrence
     G_t = dy_t C_t + a_{t+1} G_{t+1} (G: the gradient of the loss with respect to h_t) is one
     more associative scan over the tile read back to front, and every gradient of the tile
     follows element-wise from h_t and G_t (formulas at `_reverse_kernel`).

Reductions. dB and dC sum over the channels of a group, i.e. over programs: each program sums
its BLOCK_D channels (tl.sum) and adds the [CHUNK, state] result into fp32 (fp64) dB / dC with
tl.atomic_add, since per-program partials would be [channel blocks] times the size of B. dA and
dD sum over the batch only: each program writes its row's sums once to [batch, dim(, state)]
partials that torch adds up, which keeps them deterministic.

dt's discretisation (bias, softplus, clamp) and its chain rule stay in torch
(scan_kernels.eager._discretize_dt, scan_kernels.backward.discretize_backward): the kernels take
the discretised dt ("delta") and return its gradient. Mamba-2 runs on the same kernels with
heads x headdim as channels, one decay per channel (SCALAR_DECAY) and each head's dt shared by
its headdim channels; the per-channel gradients of dt and A are summed back over headdim.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..backward import bdl_layout, discretize_backward
from ..eager import _discretize_dt
from ..errors import KernelInputError
from . import configs
from .common import (
    Launch, accumulation_dtype, cdiv, finite_decay_rate, next_power_of_2, offset_index, packed_rows, program_coords,
    row_strides, run_on_device_of, triton_dtype, wide_offsets,
)
from .scan import _combine, _sequence_of

# BLOCK_N -> blocks. The reverse pass keeps several [CHUNK, BLOCK_D, BLOCK_N] tiles live at once
# (the states, their reversed copy, G, two decays, q) besides the tile's loads, so a row holds a
# quarter of the forward table's tile (configs.SCAN_TABLE): 1024 values over 8 warps, 4 per
# thread per tile. Compiled for sm_90 (ptxas -v, as scan_kernels.triton_kernels.aot_check does) every
# row fits the registers without spilling in fp32 and in fp64, which twice the tile did not.
# CHUNK is also the checkpoint interval (the checkpoints are the state history / CHUNK), so it
# stays 16 while the channels can shrink and gives way only past BLOCK_N 64, down to 2 (at 1024
# that is 2048 values, which still fit). Timed on a GPU by bench.backward --device cuda
# (docs/performance.md, "backward pass").
#             BLOCK_N  block_d  chunk  warps
BACKWARD_TABLE = (
    (4, configs.ScanBlocks(16, 16, 8)),
    (8, configs.ScanBlocks(8, 16, 8)),
    (16, configs.ScanBlocks(4, 16, 8)),
    (32, configs.ScanBlocks(2, 16, 8)),
    (64, configs.ScanBlocks(1, 16, 8)),
    (128, configs.ScanBlocks(1, 8, 8)),
    (256, configs.ScanBlocks(1, 4, 8)),
    (512, configs.ScanBlocks(1, 2, 8)),
    (1024, configs.ScanBlocks(1, 2, 8)),
)
# On the CPU the kernels run on Triton's interpreter, which exists to test them: the smallest
# tiles, so that small shapes already cross several tiles and channel blocks with remainders
# (the interpreter's cost follows the elements computed, not the number of programs).
INTERPRETER_BLOCKS = configs.ScanBlocks(block_d=4, chunk=4, num_warps=1)


@triton.jit
def _decay_rates(A_ptr, d, mask_d, n, mask_n, per_decay, s_A_d, s_A_n, SCALAR_DECAY: tl.constexpr,
                 ACC: tl.constexpr):
    """A as [BLOCK_D, BLOCK_N] (0 where masked, so padded state entries never decay), or with
    SCALAR_DECAY one rate per channel, A[d // per_decay], as [BLOCK_D, 1]; -inf as
    `finite_decay_rate` reads it."""
    if SCALAR_DECAY:
        A = tl.load(A_ptr + (d // per_decay) * s_A_d, mask=mask_d, other=0.0).to(ACC)[:, None]
    else:
        A = tl.load(A_ptr + d[:, None] * s_A_d + n[None, :] * s_A_n,
                    mask=mask_d[:, None] & mask_n[None, :], other=0.0).to(ACC)
    return finite_decay_rate(A)


@triton.jit
def _load_td(base, t, mask_t, cols, mask_cols, s_l, s_c, ACC: tl.constexpr):
    """base[t, cols] as [CHUNK, len(cols)] in ACC, 0 where masked."""
    return tl.load(base + t[:, None] * s_l + cols[None, :] * s_c,
                   mask=mask_t[:, None] & mask_cols[None, :], other=0.0).to(ACC)


@triton.jit
def _tile_states(h_in, delta, x, A, B_tile):
    """States after each step of a tile in time order, [CHUNK, BLOCK_D, BLOCK_N], and the
    state after its last step; delta and x are 0 on padded steps, which then keep the state."""
    decay = tl.exp(delta[:, :, None] * A[None, :, :])
    inputs = (delta * x)[:, :, None] * B_tile[:, None, :]
    decay, inputs = tl.broadcast(decay, inputs)  # SCALAR_DECAY: one decay for the whole state
    step = tl.arange(0, inputs.shape[0])[:, None, None]
    inputs = tl.where(step == 0, decay * h_in[None, :, :] + inputs, inputs)
    _, states = tl.associative_scan((decay, inputs), 0, _combine)
    h_out = tl.sum(tl.where(step == inputs.shape[0] - 1, states, 0.0), axis=0)
    return states, h_out


@triton.jit
def _tile_decayed_states(h_in, decay, inputs_before):
    """a_t h_(t-1) for each step t of a tile in time order, [CHUNK, BLOCK_D, BLOCK_N]: the
    state entering each step times the step's decay, from `decay` (a_t) and `inputs_before`
    (step t - 1's input; ignored in row 0, where h_in enters). A scan of its own rather than
    h_t minus step t's input, whose rounding at h_t's magnitude is all of it once a_t is below
    fp32's resolution."""
    step = tl.arange(0, decay.shape[0])[:, None, None]
    decay, inputs_before = tl.broadcast(decay, inputs_before)  # SCALAR_DECAY: one decay for the whole state
    carried = decay * tl.where(step == 0, h_in[None, :, :], inputs_before)
    _, decayed = tl.associative_scan((decay, carried), 0, _combine)
    return decayed


# Loop bounds: not specialising on them keeps one compiled variant whatever the sequence length.
_UNSPECIALISED = ["seq", "n_chunks"]


@triton.jit(do_not_specialize=_UNSPECIALISED)
def _checkpoint_kernel(
    x_ptr, delta_ptr, A_ptr, B_ptr, h0_ptr, ckpt_ptr, cu_seqlens_ptr,
    seq, dim, nstate, groups, dim_per_group, per_decay, n_chunks,
    s_x_b, s_x_l, s_x_d, s_dl_b, s_dl_l, s_dl_d, s_B_b, s_B_l, s_B_g, s_B_n, s_A_d, s_A_n,
    s_h0_b, s_h0_d, s_h0_n,
    HAS_H0: tl.constexpr, SCALAR_DECAY: tl.constexpr, PACKED: tl.constexpr,
    ACC: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr,
    WIDE_OFFSETS: tl.constexpr,
):
    """ckpt[row, c] = the state entering tile c (c = 0: h0, or zeros). With PACKED a row is a
    sequence packed at cu_seqlens (the operands' batch strides passed as 0), with its own tiles."""
    row, group, d, mask_d = program_coords(dim_per_group, groups, BLOCK_D, WIDE_OFFSETS)
    first, length = _sequence_of(row, cu_seqlens_ptr, seq, PACKED)
    n = offset_index(tl.arange(0, BLOCK_N), WIDE_OFFSETS)
    mask_n = n < nstate
    mask_dn = mask_d[:, None] & mask_n[None, :]
    A = _decay_rates(A_ptr, d, mask_d, n, mask_n, per_decay, s_A_d, s_A_n, SCALAR_DECAY, ACC)
    d_delta = d // per_decay
    if HAS_H0:
        h = tl.load(h0_ptr + row * s_h0_b + d[:, None] * s_h0_d + n[None, :] * s_h0_n,
                    mask=mask_dn, other=0.0).to(ACC)
    else:
        h = tl.zeros([BLOCK_D, BLOCK_N], dtype=ACC)
    x_base = x_ptr + row * s_x_b + first * s_x_l
    delta_base = delta_ptr + row * s_dl_b + first * s_dl_l
    B_base = B_ptr + row * s_B_b + first * s_B_l + group * s_B_g
    in_ckpt = d[:, None] * nstate + n[None, :]
    tl.store(ckpt_ptr + row * n_chunks * dim * nstate + in_ckpt, h, mask=mask_dn)
    for c in range(1, tl.cdiv(length, CHUNK)):  # the last tile's states are never needed here
        t = offset_index((c - 1) * CHUNK + tl.arange(0, CHUNK), WIDE_OFFSETS)
        mask_t = t < length
        x = _load_td(x_base, t, mask_t, d, mask_d, s_x_l, s_x_d, ACC)
        delta = _load_td(delta_base, t, mask_t, d_delta, mask_d, s_dl_l, s_dl_d, ACC)
        B_tile = _load_td(B_base, t, mask_t, n, mask_n, s_B_l, s_B_n, ACC)
        _, h = _tile_states(h, delta, x, A, B_tile)
        tl.store(ckpt_ptr + (row * n_chunks + c) * dim * nstate + in_ckpt, h, mask=mask_dn)


@triton.jit(do_not_specialize=_UNSPECIALISED)
def _reverse_kernel(
    x_ptr, delta_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, dy_ptr, ckpt_ptr, dstate_ptr,
    dx_ptr, ddelta_ptr, dz_ptr, dB_ptr, dC_ptr, dA_ptr, dD_ptr, dh0_ptr, cu_seqlens_ptr,
    seq, dim, nstate, groups, dim_per_group, per_decay, n_chunks,
    s_x_b, s_x_l, s_x_d, s_dl_b, s_dl_l, s_dl_d, s_z_b, s_z_l, s_z_d, s_dy_b, s_dy_l, s_dy_d,
    s_B_b, s_B_l, s_B_g, s_B_n, s_C_b, s_C_l, s_C_g, s_C_n,
    s_A_d, s_A_n, s_D, s_ds_b, s_ds_d, s_ds_n,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_DSTATE: tl.constexpr, STORE_DH0: tl.constexpr,
    SCALAR_DECAY: tl.constexpr, PACKED: tl.constexpr,
    ACC: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr,
    WIDE_OFFSETS: tl.constexpr,
):
    """The tiles from last to first, each read back to front (row i of a tile is step
    t0 + CHUNK - 1 - i), so the reverse recurrence is an ordinary (forward) associative scan:
    Triton's reverse=True scan is not relied on (triton-lang/triton#4362). With g = dy input:

        dy_t = g_t silu(z_t);  dz_t = g_t (C_t . h_t + D x_t) silu'(z_t)   (without z: dy_t = g_t)
        G_t = dy_t C_t + a_{t+1} G_{t+1}   (a_t = exp(delta_t A); at the last step a G is dstate)
        dC_t = sum_d dy_t h_t;  dB_t = sum_d G_t delta_t x_t;  dD = sum_t dy_t x_t
        dx_t = dy_t D + delta_t (G_t . B_t);  q_t = G_t a_t h_{t-1}
        ddelta_t = x_t (G_t . B_t) + q_t . A;  dA = sum_t delta_t q_t;  dh0 = a_0 G_0

    a_t h_{t-1} is scanned from the checkpoint with each step's decay and the input of the step
    before it (`_tile_decayed_states`), and h_t is it plus the step's input: under decays below
    fp32's resolution, dA (a sum of those terms alone) is then as accurate as they are.
    PACKED: as the checkpoints."""
    row, group, d, mask_d = program_coords(dim_per_group, groups, BLOCK_D, WIDE_OFFSETS)
    first, length = _sequence_of(row, cu_seqlens_ptr, seq, PACKED)
    n = offset_index(tl.arange(0, BLOCK_N), WIDE_OFFSETS)
    mask_n = n < nstate
    mask_dn = mask_d[:, None] & mask_n[None, :]
    A = _decay_rates(A_ptr, d, mask_d, n, mask_n, per_decay, s_A_d, s_A_n, SCALAR_DECAY, ACC)
    d_delta = d // per_decay
    if HAS_D:
        D = tl.load(D_ptr + d * s_D, mask=mask_d, other=0.0).to(ACC)

    # carry: the gradient with respect to the state entering the tile after this one, times
    # that tile's first decay (a_{t+1} G_{t+1} for the tile's last step t).
    if HAS_DSTATE:
        carry = tl.load(dstate_ptr + row * s_ds_b + d[:, None] * s_ds_d + n[None, :] * s_ds_n,
                        mask=mask_dn, other=0.0).to(ACC)
    else:
        carry = tl.zeros([BLOCK_D, BLOCK_N], dtype=ACC)
    dA = tl.zeros(A.shape, dtype=ACC)
    dD = tl.zeros([BLOCK_D], dtype=ACC)

    x_base = x_ptr + row * s_x_b + first * s_x_l
    delta_base = delta_ptr + row * s_dl_b + first * s_dl_l
    dy_base = dy_ptr + row * s_dy_b + first * s_dy_l
    B_base = B_ptr + row * s_B_b + first * s_B_l + group * s_B_g
    C_base = C_ptr + row * s_C_b + first * s_C_l + group * s_C_g
    # The gradients' own buffers are contiguous: dx, ddelta, dz [batch, seq, dim] share one
    # offset tile, dB and dC [batch, seq, groups, state] another (fewer live registers). A
    # packed sequence's positions start at its first step in the one batch row.
    if PACKED:
        start = first
    else:
        start = row * seq
    out_row = start * dim
    bc_row = start * groups * nstate + group * nstate
    in_ckpt = d[:, None] * nstate + n[None, :]
    i = tl.arange(0, CHUNK)
    first_row = i[:, None, None] == 0
    tiles = tl.cdiv(length, CHUNK)
    for k in range(0, tiles):
        c = tiles - 1 - k
        # a_t h_{t-1} over the tile in time order, from its checkpoint, then read back to front.
        t_fwd = offset_index(c * CHUNK + i, WIDE_OFFSETS)
        t_before = t_fwd - 1
        mask_before = (i > 0) & (t_before < length)
        h_in = tl.load(ckpt_ptr + (row * n_chunks + c) * dim * nstate + in_ckpt, mask=mask_dn, other=0.0)
        delta_fwd = _load_td(delta_base, t_fwd, t_fwd < length, d_delta, mask_d, s_dl_l, s_dl_d, ACC)
        u_before = (_load_td(delta_base, t_before, mask_before, d_delta, mask_d, s_dl_l, s_dl_d, ACC)
                    * _load_td(x_base, t_before, mask_before, d, mask_d, s_x_l, s_x_d, ACC))
        B_before = _load_td(B_base, t_before, mask_before, n, mask_n, s_B_l, s_B_n, ACC)
        decayed = tl.flip(_tile_decayed_states(h_in, tl.exp(delta_fwd[:, :, None] * A[None, :, :]),
                                               u_before[:, :, None] * B_before[:, None, :]), 0)

        t = offset_index(c * CHUNK + (CHUNK - 1) - i, WIDE_OFFSETS)
        mask_t = t < length
        mask_td = mask_t[:, None] & mask_d[None, :]
        mask_tn = mask_t[:, None] & mask_n[None, :]
        t_d = t[:, None] * dim + d[None, :]
        x = _load_td(x_base, t, mask_t, d, mask_d, s_x_l, s_x_d, ACC)
        delta = _load_td(delta_base, t, mask_t, d_delta, mask_d, s_dl_l, s_dl_d, ACC)
        # delta_{t+1} within the tile (row i - 1); 0, i.e. decay 1, past the tile or the sequence.
        delta_next = _load_td(delta_base, t + 1, (i > 0) & (t + 1 < length), d_delta, mask_d, s_dl_l, s_dl_d, ACC)
        g = _load_td(dy_base, t, mask_t, d, mask_d, s_dy_l, s_dy_d, ACC)
        B_tile = _load_td(B_base, t, mask_t, n, mask_n, s_B_l, s_B_n, ACC)
        C_tile = _load_td(C_base, t, mask_t, n, mask_n, s_C_l, s_C_n, ACC)
        u = delta * x
        h = decayed + u[:, :, None] * B_tile[:, None, :]

        if HAS_Z:
            z = _load_td(z_ptr + row * s_z_b + first * s_z_l, t, mask_t, d, mask_d, s_z_l, s_z_d, ACC)
            y = tl.sum(h * C_tile[:, None, :], axis=2)
            if HAS_D:
                y += x * D[None, :]
            sg = tl.sigmoid(z)
            dz = g * y * sg * (1.0 + z * (1.0 - sg))
            tl.store(dz_ptr + out_row + t_d, dz, mask=mask_td)
            dy = g * z * sg
        else:
            dy = g
        # dC here, so that h is dead before the G scan (only `decayed` stays live for q).
        t_n = bc_row + t[:, None] * (groups * nstate) + n[None, :]
        tl.atomic_add(dC_ptr + t_n, tl.sum(dy[:, :, None] * h, axis=1), mask=mask_tn)

        # G over the tile back to front; the carry enters at the tile's last step (row 0).
        # Padded steps past the sequence end have dy = 0 and decay 1, so the carry (dstate)
        # passes through them unchanged to the last real step.
        v = dy[:, :, None] * C_tile[:, None, :]
        v = tl.where(first_row, v + carry[None, :, :], v)
        decay_next = tl.exp(delta_next[:, :, None] * A[None, :, :])
        decay_next, v = tl.broadcast(decay_next, v)
        _, G = tl.associative_scan((decay_next, v), 0, _combine)

        tl.atomic_add(dB_ptr + t_n, tl.sum(G * u[:, :, None], axis=1), mask=mask_tn)

        dhB = tl.sum(G * B_tile[:, None, :], axis=2)
        q = G * decayed
        ddelta = x * dhB + tl.sum(q * A[None, :, :], axis=2)
        dx = delta * dhB
        if HAS_D:
            dx += dy * D[None, :]
            dD += tl.sum(dy * x, axis=0)
        dq = tl.sum(delta[:, :, None] * q, axis=0)
        if SCALAR_DECAY:
            dA += tl.sum(dq, axis=1)[:, None]
        else:
            dA += dq
        tl.store(dx_ptr + out_row + t_d, dx, mask=mask_td)
        tl.store(ddelta_ptr + out_row + t_d, ddelta, mask=mask_td)

        # The next carry, a_{t0} G_{t0}: the tile's first step is its last row.
        G_first = tl.sum(tl.where(i[:, None, None] == CHUNK - 1, G, 0.0), axis=0)
        delta_first = tl.sum(tl.where(i[:, None] == CHUNK - 1, delta, 0.0), axis=0)
        carry = tl.exp(delta_first[:, None] * A) * G_first

    if STORE_DH0:
        tl.store(dh0_ptr + (row * dim * nstate) + in_ckpt, carry, mask=mask_dn)
    if SCALAR_DECAY:
        tl.store(dA_ptr + row * dim + d, tl.sum(dA, axis=1), mask=mask_d)
    else:
        tl.store(dA_ptr + row * dim * nstate + in_ckpt, dA, mask=mask_dn)
    if HAS_D:
        tl.store(dD_ptr + row * dim + d, dD, mask=mask_d)


@dataclass(frozen=True)
class BackwardPlan:
    """How one backward call is cut up."""
    block_n: int
    blocks: configs.ScanBlocks
    n_chunks: int  # tiles of blocks.chunk steps, and so checkpoints per row
    programs: int  # the grid of both launches


def check_state_size(state: int, state_field: str) -> None:
    """Refuses a state size past BACKWARD_TABLE, naming `state_field`: the argument the state
    size is read from (Mamba-1's A [dim, state]; Mamba-2's B, its A being [heads])."""
    if next_power_of_2(state) > BACKWARD_TABLE[-1][0]:
        raise KernelInputError(state_field, f"a state size <= {BACKWARD_TABLE[-1][0]} (Triton backend)",
                               f"state size {state}")


def backward_blocks(state: int, dim_per_group: int, state_field: str) -> tuple[int, configs.ScanBlocks]:
    """(BLOCK_N, blocks) from BACKWARD_TABLE; block_d shrinks to a group's channels when a
    group is narrower than the table's block. A state past the table is refused (check_state_size)."""
    check_state_size(state, state_field)
    block_n = next_power_of_2(state)
    blocks = next(blocks for limit, blocks in BACKWARD_TABLE if block_n <= limit)
    block_d = min(blocks.block_d, next_power_of_2(dim_per_group))
    return block_n, configs.ScanBlocks(block_d, blocks.chunk, blocks.num_warps)


def plan_backward(batch: int, seq: int, channels: int, state: int, groups: int, device: torch.device,
                  state_field: str, blocks: configs.ScanBlocks | None = None) -> BackwardPlan:
    """Blocks from the table on CUDA, INTERPRETER_BLOCKS on the CPU, or `blocks`; block_d never
    wider than a group's channels rounded up to a power of two. `state_field`: as backward_blocks."""
    dim_per_group = channels // groups
    block_n, table_blocks = backward_blocks(state, dim_per_group, state_field)
    if blocks is None:
        blocks = table_blocks if device.type == "cuda" else INTERPRETER_BLOCKS
    blocks = configs.ScanBlocks(min(blocks.block_d, next_power_of_2(dim_per_group)), blocks.chunk,
                                blocks.num_warps)
    programs = batch * groups * cdiv(dim_per_group, blocks.block_d)
    return BackwardPlan(block_n, blocks, cdiv(seq, blocks.chunk), programs)


def checkpoint_shape(plan: BackwardPlan, batch: int, channels: int, state: int) -> tuple[int, int, int, int]:
    """The checkpoint buffer's shape: the only [batch, ..., channels, state] tensor a call
    allocates besides the state-sized dh0 and dA partials (never [batch, seq, channels, state])."""
    return (batch, plan.n_chunks, channels, state)


def backward_launches(dy, x, delta, A, B, C, *, D, z, h0, dstate, per_decay: int, scalar_decay: bool,
                      state_field: str, blocks: configs.ScanBlocks | None = None,
                      cu_seqlens=None) -> tuple[dict, list[Launch]]:
    """(gradient buffers, the two launches that fill them), allocated, nothing run; a state
    past the table refused naming `state_field` (backward_blocks).

    Operands as "bld" [batch, seq, channels] tensors of any strides (x, dy, z), delta with
    channels // per_decay columns (one per `per_decay` channels), B and C [batch, seq, groups,
    state], A [channels, state] or, with scalar_decay, [channels // per_decay], D [channels],
    h0 and dstate [batch, channels, state]. Buffers, contiguous, in the accumulation dtype:
    "x", "delta" (per channel) and "z" [batch, seq, channels]; "B" and "C" [batch, seq, groups,
    state]; "A" [batch, channels(, state)] and "D" [batch, channels]: each batch row's sums;
    "h0" [batch, channels, state]; "checkpoints" (checkpoint_shape). With `cu_seqlens` (a CPU
    int64 tensor of n + 1 boundaries along a batch-1 input's seq) the n packed sequences are the
    rows: of the launches, of h0, dstate and the "A", "D", "h0" and checkpoint buffers."""
    batch, seq, channels = x.shape
    groups, nstate = B.shape[2], B.shape[3]
    device = x.device
    acc = accumulation_dtype(x)
    packed = cu_seqlens is not None
    rows, longest, cu_seqlens = packed_rows(cu_seqlens, batch, seq, device)
    plan = plan_backward(rows, longest, channels, nstate, groups, device, state_field, blocks)

    grads = dict(
        x=torch.empty((batch, seq, channels), dtype=acc, device=device),
        delta=torch.empty((batch, seq, channels), dtype=acc, device=device),
        z=None if z is None else torch.empty((batch, seq, channels), dtype=acc, device=device),
        B=torch.zeros((batch, seq, groups, nstate), dtype=acc, device=device),
        C=torch.zeros((batch, seq, groups, nstate), dtype=acc, device=device),
        A=torch.empty((rows, channels) if scalar_decay else (rows, channels, nstate), dtype=acc, device=device),
        D=None if D is None else torch.empty((rows, channels), dtype=acc, device=device),
        h0=None if h0 is None else torch.empty((rows, channels, nstate), dtype=acc, device=device),
        checkpoints=torch.empty(checkpoint_shape(plan, rows, channels, nstate), dtype=acc, device=device),
    )
    ckpt = grads["checkpoints"]
    wide = wide_offsets(per_row=(x, delta, dy, z, B, C, h0, dstate, *(g for g in grads.values())),
                        whole=(A, D))
    s_A = (A.stride(0), 0) if scalar_decay else (A.stride(0), A.stride(1))
    s_x, s_dl, s_B = (row_strides(t.stride(), packed) for t in (x, delta, B))
    common = (seq, channels, nstate, groups, channels // groups, per_decay, plan.n_chunks)
    constexprs = dict(SCALAR_DECAY=scalar_decay, ACC=triton_dtype(acc), BLOCK_D=plan.blocks.block_d,
                      BLOCK_N=plan.block_n, CHUNK=plan.blocks.chunk, WIDE_OFFSETS=wide)

    def strides(t):  # of a 3-D operand that may be absent
        return t.stride() if t is not None else (0, 0, 0)

    checkpoints = Launch(
        _checkpoint_kernel, (plan.programs,),
        (x, delta, A, B, h0, ckpt, cu_seqlens, *common, *s_x, *s_dl, *s_B, *s_A, *strides(h0)),
        dict(HAS_H0=h0 is not None, PACKED=packed, **constexprs), plan.blocks.num_warps)
    reverse = Launch(
        _reverse_kernel, (plan.programs,),
        (x, delta, A, B, C, D, z, dy, ckpt, dstate,
         grads["x"], grads["delta"], grads["z"], grads["B"], grads["C"], grads["A"], grads["D"], grads["h0"],
         cu_seqlens, *common,
         *s_x, *s_dl, *row_strides(strides(z), packed), *row_strides(dy.stride(), packed), *s_B,
         *row_strides(C.stride(), packed), *s_A, D.stride(0) if D is not None else 0, *strides(dstate)),
        dict(HAS_D=D is not None, HAS_Z=z is not None, HAS_DSTATE=dstate is not None, STORE_DH0=h0 is not None,
             PACKED=packed, **constexprs),
        plan.blocks.num_warps)
    return grads, [checkpoints, reverse]


def selective_scan_backward(dy, x, dt, A, B, C, *, D, z, dt_bias, dt_softplus, dt_min, dt_max, h0, dstate,
                            layout, cu_seqlens=None, blocks=None):
    """The "triton" backend's scan_backward (scan_kernels/_registry.py), packed sequences whole;
    `blocks` overrides the block table (tests)."""
    check_state_size(A.shape[1], "A")  # refused before any work; A is [dim, state]
    f = accumulation_dtype(x)
    if layout == "bdl":  # read through "bld" views; the gradients go back as "bdl" views
        x, dt, dy = x.transpose(1, 2), dt.transpose(1, 2), dy.transpose(1, 2)
        z = None if z is None else z.transpose(1, 2)
        B, C = B.permute(0, 3, 1, 2), C.permute(0, 3, 1, 2)
    delta = _discretize_dt(dt, dt_bias, dt_softplus, dt_min, dt_max, f)
    g, launches = backward_launches(dy, x, delta, A, B, C, D=D, z=z, h0=h0, dstate=dstate, per_decay=1,
                                    scalar_decay=False, state_field="A", blocks=blocks, cu_seqlens=cu_seqlens)
    run_on_device_of(x, launches)
    del delta, launches, g["checkpoints"]  # freed before the chain rule's temporaries
    ddt, ddt_bias = discretize_backward(g["delta"], dt, dt_bias, dt_softplus, dt_min, dt_max, f)
    grads = dict(x=g["x"], dt=ddt, A=g["A"].sum(0), B=g["B"], C=g["C"], D=None if D is None else g["D"].sum(0),
                 z=g["z"], dt_bias=ddt_bias, h0=g["h0"])
    return bdl_layout(grads) if layout == "bdl" else grads


def ssd_scan_backward(dy, x, dt, A, B, C, *, D, z, dt_bias, dt_softplus, dt_min, dt_max, h0, dstate,
                      chunk_size, cu_seqlens=None, blocks=None):
    """The "triton" backend's ssd_scan_backward: heads x headdim as the channels of the
    Mamba-1 kernels, each head's dt and A shared by its headdim channels (chunk_size tunes the
    chunked forward; this recurrent backward has none to tune). A state past the table is refused
    before any work, naming B: A is [heads] here, the state size is B's."""
    check_state_size(B.shape[3], "B")
    f = accumulation_dtype(x)
    batch, seq, heads, headdim = x.shape
    channels = heads * headdim

    def flat(t, *shape):
        return None if t is None else t.reshape(*shape)

    delta = _discretize_dt(dt, dt_bias, dt_softplus, dt_min, dt_max, f)
    g, launches = backward_launches(
        flat(dy, batch, seq, channels), flat(x, batch, seq, channels), delta, A, B, C,
        D=flat(D, channels), z=flat(z, batch, seq, channels), h0=None if h0 is None else h0.flatten(1, 2),
        dstate=None if dstate is None else dstate.flatten(1, 2), per_decay=headdim, scalar_decay=True,
        state_field="B", blocks=blocks, cu_seqlens=cu_seqlens)
    run_on_device_of(x, launches)
    del delta, launches, g["checkpoints"]  # freed before the chain rule's temporaries
    ddelta = g["delta"].reshape(batch, seq, heads, headdim).sum(-1)
    ddt, ddt_bias = discretize_backward(ddelta, dt, dt_bias, dt_softplus, dt_min, dt_max, f)
    return dict(x=g["x"].reshape(x.shape), dt=ddt, A=g["A"].sum(0).reshape(heads, headdim).sum(1), B=g["B"],
                C=g["C"], D=None if D is None else g["D"].sum(0).reshape(heads, headdim),
                z=None if z is None else g["z"].reshape(x.shape), dt_bias=ddt_bias,
                h0=None if h0 is None else g["h0"].reshape(h0.shape))
