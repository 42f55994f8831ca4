"""Mamba-2 (SSD) in Triton: the chunked scan and the one-step state update.

The scan cuts the sequence into chunks of `chunk` timesteps and runs these steps in order:

  1. `_ssd_cumsum`          dt discretised (bias, softplus, clamp; 0 past the sequence end) and
                            cs_t = sum_{s <= t} dt_s A within each chunk    -> dt_d, cs [b, c, h, chunk]
  2. `_ssd_cb`              C_m . B_k for k <= m within each chunk, once per group (the heads of
                            a group share it)                                -> cb [b, c, g, chunk, chunk]
  3. `_ssd_chunk_state_kernel`  each chunk's end state from a zero state and its own inputs:
                            S_c = sum_k exp(cs_last - cs_k) dt_k x_k (x) B_k -> states [b, c, h, p, n]
  4. `_ssd_state_passing_kernel`  H_c = exp(cs_last of c-1) H_{c-1} + S_{c-1}, from H_0 = h0 (or
                            0), sequential over chunks: `states` is overwritten with the state
                            entering each chunk, and the state after the last chunk is the final state
  5. `_ssd_chunk_scan_kernel`  y_m = exp(cs_m) C_m . H_c + sum_{k <= m} (C_m . B_k)
                            exp(cs_m - cs_k) dt_k x_k, + D x_m, * silu(z_m)

On a GPU a small call's time is mostly host work, much of it Triton's launch call
(docs/performance.md, "triton launch host time"), so the launches are as few as the steps'
dependencies allow: 1 and 2 are one launch (`_ssd_prep_kernel`); a scan of one chunk (ExPhil's
60-frame window) skips 4, h0 being the state entering its chunk and step 3 (run only for the
final state) adding h0's decay to write the final state itself: 2 launches, 3 with the final
state. Several chunks take 4 (3 computes every chunk's state but the last's unless the final
state is asked for).

Every exponent is a difference cs_m - cs_k with k <= m (or cs itself), so with A < 0 and dt >= 0
no exp exceeds 1; the causal mask is applied to the exponent, before exp, so that the masked
upper triangle cannot overflow. The cumsums restart at every chunk, and are kept in fp64 and
differenced there before the exponent goes back to the accumulation dtype: one step of dt·A in
the thousands early in a chunk makes cs that large after it, and in fp32 the differences between
the small steps after it would be off by its rounding in the exponent, an error the large
step's share of y, decaying slowly over those steps, carries. A step's dt·A below -1024 (its
decay 0 in fp32 and fp64 alike) counts as -1024: an A of -inf or a huge dt would otherwise put
-inf or a value whose rounding swamps every later step into cs, and differences of them would
be NaN or garbage where the recurrence's decays are 0. A NaN dt makes y NaN from its step on
and the final state NaN, for its head only, as the recurrence does.

Dots. The contractions (C.B^T, the masked scores times x, C times the entering state, x^T times
the decayed B) are tl.dot tiles, each block dimension at least 16 (configs.MIN_DOT_BLOCK) as a
GPU's tl.dot requires; smaller heads, states and chunks are padded and masked. When x, B and C
are all fp16 (or all bf16) the dots run on 16-bit operands with fp32 accumulation: the inputs
themselves are exact in that dtype, and an operand computed in fp32 (scores, decayed B,
entering state) is split into hi + lo 16-bit halves and multiplied twice, which keeps it to ~2^-17
of its value (bf16; fp16 2^-22), so the state meets fp32 tolerances. In fp16 each row of the
scores (each column of the decayed B or entering state) is first divided by the power of two
that brings its max |v| into [2^14, 2^15), and that row (column) of the product multiplied back,
both exactly: any finite fp32 operand fits fp16's range (65504) that way, a row's values down to
2^-17 of its max keep the 2^-22, and smaller ones are off by at most 2^-39 of the max. bf16 has
fp32's exponent range, so its split is not scaled (only values within 2^-9 of fp32's largest
would round to inf). Other dtypes (fp32, mixed, fp64) multiply in IEEE fp32 (no tf32) or fp64.

Non-finite x. An inf or NaN x at step k reaches the rows before k in its chunk and head channel
too: the causal dot multiplies it by the zeros above the diagonal, and 0 x inf is NaN (the rows
before its chunk, other channels and heads, and everything the reference makes non-finite come
out as there). The torch backend recomputes such a scan by the recurrence, which needs a host
sync; taking the non-finite values out of the dots and adding their part back by counting dots
was tried and left out: the chunk-scan kernel has no registers to spare for it at sm_90 (it
spilled in every 16-bit and the fp64 variant; docs/performance.md, "Triton SSD tiles").

Offsets: the batch row, the chunk and the head are int64 scalars in every base pointer; offsets
within a chunk tile are int32 unless an input's per-row extent reaches 2^31 elements (the
WIDE_OFFSETS variant, common.wide_offsets). Inputs are read through strides; y is stored in x's
dtype and the state in the accumulation dtype (fp32, fp64 for fp64 x).

The state update is one timestep for many rows (`_ssd_update_kernel`), state in place, rows
mapped to pool slots; a negative slot is padding: y 0, no state row read or written.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .._args import MAX_CHUNK
from ..errors import KernelInputError
from . import configs
from .common import (
    Launch, accumulation_dtype, cdiv, check_out, clamp_bounds, discretize_dt, finite_decay_rate, interpreter_active,
    next_power_of_2, offset_index, packed_rows, row_strides, run_on_device_of, silu, triton_dtype, wide_offsets,
)


@triton.jit
def _mma(a, b, acc, UPCAST: tl.constexpr, FP32_DOT: tl.constexpr):
    """acc + a @ b, both operands in the dot dtype: 16-bit operands multiply exactly into the
    fp32 accumulator (tensor cores), fp32 ones as FP32_DOT says (configs.SSD_FP32_DOT), fp64
    ones in IEEE precision. UPCAST (the interpreter, bf16 only): its dot reads bf16 data as
    integers, so the bf16 values are widened to fp32 first, which gives the same exact products."""
    if UPCAST:
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    elif a.dtype.primitive_bitwidth == 16:
        acc = tl.dot(a, b, acc)
    elif a.dtype.primitive_bitwidth == 32:
        acc = tl.dot(a, b, acc, input_precision=FP32_DOT)
    else:
        acc = tl.dot(a, b, acc, input_precision="ieee", out_dtype=tl.float64)
    return acc


@triton.jit
def _fp16_scales(a, AXIS: tl.constexpr):
    """(s, 1 / s) for each row (AXIS 1) or column (AXIS 0) of the fp32 tile `a`: powers of two,
    read off the exponent of the row's max |a|, that bring that max into [2^14, 2^15)."""
    # The highest binade fp16 holds whole (the next one's top rounds to inf), which keeps the
    # row's smaller values clear of fp16's subnormals. The floor keeps s and 1 / s normal for a
    # row under 2^-112; an inf or NaN max (exponent 255) stays inf or NaN, as unscaled.
    exponent = tl.maximum(tl.max(tl.abs(a), axis=AXIS).to(tl.int32, bitcast=True) >> 23, 15) - 14
    return (exponent << 23).to(tl.float32, bitcast=True), ((254 - exponent) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _split(a, dtype: tl.constexpr):
    """(hi, lo) in `dtype` whose sum is a to twice that dtype's precision."""
    hi = a.to(dtype)
    return hi, (a - hi.to(a.dtype)).to(dtype)


@triton.jit
def _dot_computed_left(a, b, acc, UPCAST: tl.constexpr, FP32_DOT: tl.constexpr):
    """acc + a @ b where a was computed in the accumulation dtype and b is an input in the dot
    dtype: with a 16-bit b, a goes in as hi + lo halves, its rows scaled first for fp16 (see the
    module docstring)."""
    if b.dtype.is_fp16():
        scale, inverse = _fp16_scales(a, 1)
        hi, lo = _split(a * inverse[:, None], b.dtype)
        acc += _mma(lo, b, _mma(hi, b, tl.zeros_like(acc), UPCAST, FP32_DOT), UPCAST, FP32_DOT) * scale[:, None]
    elif b.dtype.is_bf16():
        hi, lo = _split(a, b.dtype)
        acc = _mma(lo, b, _mma(hi, b, acc, UPCAST, FP32_DOT), UPCAST, FP32_DOT)
    else:
        acc = _mma(a.to(b.dtype), b, acc, UPCAST, FP32_DOT)
    return acc


@triton.jit
def _dot_computed_right(a, b, acc, UPCAST: tl.constexpr, FP32_DOT: tl.constexpr):
    """acc + a @ b where a is an input in the dot dtype and b was computed (the mirror of
    `_dot_computed_left`: for fp16, b's columns are scaled)."""
    if a.dtype.is_fp16():
        scale, inverse = _fp16_scales(b, 0)
        hi, lo = _split(b * inverse[None, :], a.dtype)
        acc += _mma(a, lo, _mma(a, hi, tl.zeros_like(acc), UPCAST, FP32_DOT), UPCAST, FP32_DOT) * scale[None, :]
    elif a.dtype.is_bf16():
        hi, lo = _split(b, a.dtype)
        acc = _mma(a, lo, _mma(a, hi, acc, UPCAST, FP32_DOT), UPCAST, FP32_DOT)
    else:
        acc = _mma(a, b.to(a.dtype), acc, UPCAST, FP32_DOT)
    return acc


@triton.jit
def _chunk_coords(pid, nchunks, chunk, seq, cu_seqlens_ptr, PACKED: tl.constexpr):
    """(batch row, chunk index, first timestep, timesteps in this chunk) of the chunk that a
    program's (batch x chunks) index names, as int64. With PACKED the rows are the sequences
    packed at cu_seqlens along one batch row (whose stride the launch passes as 0): the first
    timestep counts from that row's start, and a chunk past its sequence's end has none."""
    pid = pid.to(tl.int64)
    c = pid % nchunks
    b = pid // nchunks
    if PACKED:
        first = tl.load(cu_seqlens_ptr + b)
        length = tl.load(cu_seqlens_ptr + b + 1) - first
    else:
        first = b * 0
        length = seq + b * 0
    return b, c, first + c * chunk, tl.minimum(chunk, length - c * chunk)


@triton.jit
def _block_coords(pid, n_inner, n_middle):
    """(inner, middle, rest) block indices of a program index over rest x middle x inner."""
    return pid % n_inner, (pid // n_inner) % n_middle, pid // (n_inner * n_middle)


@triton.jit
def _span(start, BLOCK: tl.constexpr, WIDE_OFFSETS: tl.constexpr):
    """Indices start .. start + BLOCK - 1 as `offset_index` has them."""
    return offset_index(start + tl.arange(0, BLOCK), WIDE_OFFSETS)


@triton.jit
def _load_tile(base, rows, s_rows, mask_rows, cols, s_cols, mask_cols, dtype: tl.constexpr):
    """The [rows, cols] tile at `base` through the two strides, 0 where masked, in `dtype`."""
    return tl.load(base + rows[:, None] * s_rows + cols[None, :] * s_cols,
                   mask=mask_rows[:, None] & mask_cols[None, :], other=0.0).to(dtype)


# Per-step log decays are floored here (module docstring): exp of it is 0 in fp32 and in fp64.
LOG_DECAY_FLOOR = tl.constexpr(-1024.0)

# Sequence and chunk counts change with every call: not specialising on them keeps one compiled
# variant per option set and block choice.
_UNSPECIALISED = ["seq", "nchunks", "chunk", "n_local", "cumsum_programs"]


@triton.jit(do_not_specialize=_UNSPECIALISED)
def _ssd_prep_kernel(
    dt_ptr, A_ptr, dt_bias_ptr, dt_out_ptr, cs_ptr, B_ptr, C_ptr, cb_ptr, cu_seqlens_ptr,
    seq, nchunks, chunk, heads, groups, nstate, cumsum_programs,
    dt_min_hi, dt_min_lo, dt_max_hi, dt_max_lo,
    s_dt_b, s_dt_l, s_dt_h, s_A, s_bias, s_B_b, s_B_l, s_B_g, s_B_n, s_C_b, s_C_l, s_C_g, s_C_n,
    HAS_DT_BIAS: tl.constexpr, DT_SOFTPLUS: tl.constexpr, HAS_CLAMP: tl.constexpr, PACKED: tl.constexpr,
    DOT: tl.constexpr, UPCAST: tl.constexpr, FP32_DOT: tl.constexpr, ACC: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, WIDE_OFFSETS: tl.constexpr,
):
    """Steps 1 and 2, which depend on nothing but the inputs, in one launch (see the module
    docstring): the first `cumsum_programs` programs run `_ssd_cumsum`, the rest `_ssd_cb`."""
    pid = tl.program_id(0)
    if pid < cumsum_programs:
        _ssd_cumsum(pid, dt_ptr, A_ptr, dt_bias_ptr, dt_out_ptr, cs_ptr, cu_seqlens_ptr, seq, nchunks, chunk, heads,
                    dt_min_hi, dt_min_lo, dt_max_hi, dt_max_lo, s_dt_b, s_dt_l, s_dt_h, s_A, s_bias,
                    HAS_DT_BIAS, DT_SOFTPLUS, HAS_CLAMP, PACKED, ACC, BLOCK_T, BLOCK_H, WIDE_OFFSETS)
    else:
        _ssd_cb(pid - cumsum_programs, B_ptr, C_ptr, cb_ptr, cu_seqlens_ptr, seq, nchunks, chunk, groups, nstate,
                s_B_b, s_B_l, s_B_g, s_B_n, s_C_b, s_C_l, s_C_g, s_C_n,
                PACKED, DOT, UPCAST, FP32_DOT, ACC, BLOCK_M, BLOCK_K, BLOCK_N, WIDE_OFFSETS)


@triton.jit
def _ssd_cumsum(
    pid, dt_ptr, A_ptr, dt_bias_ptr, dt_out_ptr, cs_ptr, cu_seqlens_ptr,
    seq, nchunks, chunk, heads,
    dt_min_hi, dt_min_lo, dt_max_hi, dt_max_lo,
    s_dt_b, s_dt_l, s_dt_h, s_A, s_bias,
    HAS_DT_BIAS: tl.constexpr, DT_SOFTPLUS: tl.constexpr, HAS_CLAMP: tl.constexpr, PACKED: tl.constexpr,
    ACC: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, WIDE_OFFSETS: tl.constexpr,
):
    """dt_out = discretised dt (0 past the sequence end), cs = its running sum times A within
    the chunk, for BLOCK_H heads of one chunk (program `pid`); both [batch, chunks, heads, chunk]."""
    n_hblocks = tl.cdiv(heads, BLOCK_H)
    b, c, t0, chunk_len = _chunk_coords(pid // n_hblocks, nchunks, chunk, seq, cu_seqlens_ptr, PACKED)
    hh = _span((pid % n_hblocks) * BLOCK_H, BLOCK_H, WIDE_OFFSETS)
    t = _span(0, BLOCK_T, WIDE_OFFSETS)
    mask_h = hh < heads
    mask = (t < chunk_len)[:, None] & mask_h[None, :]
    dt = _load_tile(dt_ptr + b * s_dt_b + t0 * s_dt_l, t, s_dt_l, t < chunk_len, hh, s_dt_h, mask_h, ACC)
    if HAS_DT_BIAS:
        dt += tl.load(dt_bias_ptr + hh * s_bias, mask=mask_h, other=0.0).to(ACC)[None, :]
    dt = discretize_dt(dt, mask, DT_SOFTPLUS, HAS_CLAMP, dt_min_hi, dt_min_lo, dt_max_hi, dt_max_lo)
    A = finite_decay_rate(tl.load(A_ptr + hh * s_A, mask=mask_h, other=0.0).to(ACC))
    # Past the end dt is 0, so cs holds its last value there: cs[chunk - 1] is the chunk's total.
    log_decay = (dt * A[None, :]).to(tl.float64)
    log_decay = tl.where(log_decay < LOG_DECAY_FLOOR, LOG_DECAY_FLOOR, log_decay)
    cs = tl.cumsum(log_decay, axis=0)  # fp64: module docstring
    out = (b * nchunks + c) * heads * chunk + hh[None, :] * chunk + t[:, None]
    store_mask = (t < chunk)[:, None] & mask_h[None, :]
    tl.store(dt_out_ptr + out, dt, mask=store_mask)
    tl.store(cs_ptr + out, cs, mask=store_mask)


@triton.jit
def _ssd_cb(
    pid, B_ptr, C_ptr, cb_ptr, cu_seqlens_ptr,
    seq, nchunks, chunk, groups, nstate,
    s_B_b, s_B_l, s_B_g, s_B_n, s_C_b, s_C_l, s_C_g, s_C_n,
    PACKED: tl.constexpr, DOT: tl.constexpr, UPCAST: tl.constexpr, FP32_DOT: tl.constexpr, ACC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, WIDE_OFFSETS: tl.constexpr,
):
    """cb[b, c, g, m, k] = C_m . B_k for the block (m block, k block) of one chunk and group
    (program `pid`); only blocks holding some k <= m are computed (the rest is never read)."""
    kb, mb, rest = _block_coords(pid, tl.cdiv(chunk, BLOCK_K), tl.cdiv(chunk, BLOCK_M))
    g = (rest % groups).to(tl.int64)
    b, c, t0, chunk_len = _chunk_coords(rest // groups, nchunks, chunk, seq, cu_seqlens_ptr, PACKED)
    m0 = mb * BLOCK_M
    k0 = kb * BLOCK_K
    if (k0 < m0 + BLOCK_M) & (m0 < chunk_len):
        m = _span(m0, BLOCK_M, WIDE_OFFSETS)
        k = _span(k0, BLOCK_K, WIDE_OFFSETS)
        mask_m = m < chunk_len
        mask_k = k < chunk_len
        C_base = C_ptr + b * s_C_b + t0 * s_C_l + g * s_C_g
        B_base = B_ptr + b * s_B_b + t0 * s_B_l + g * s_B_g
        acc = tl.zeros([BLOCK_M, BLOCK_K], dtype=ACC)
        for n0 in range(0, nstate, BLOCK_N):
            n = _span(n0, BLOCK_N, WIDE_OFFSETS)
            mask_n = n < nstate
            C_tile = _load_tile(C_base, m, s_C_l, mask_m, n, s_C_n, mask_n, DOT)
            B_tile = _load_tile(B_base, n, s_B_n, mask_n, k, s_B_l, mask_k, DOT)
            acc = _mma(C_tile, B_tile, acc, UPCAST, FP32_DOT)
        out = ((b * nchunks + c) * groups + g) * chunk * chunk
        tl.store(cb_ptr + out + m[:, None] * chunk + k[None, :], acc,
                 mask=(m < chunk)[:, None] & (k < chunk)[None, :])


@triton.jit(do_not_specialize=_UNSPECIALISED)
def _ssd_chunk_state_kernel(
    x_ptr, B_ptr, dt_d_ptr, cs_ptr, h0_ptr, states_ptr, cu_seqlens_ptr,
    seq, nchunks, chunk, n_local, heads, heads_per_group, headdim, nstate,
    s_x_b, s_x_l, s_x_h, s_x_p, s_B_b, s_B_l, s_B_g, s_B_n, s_h0_b, s_h0_h, s_h0_p, s_h0_n,
    s_st_b, s_st_c, s_st_h, s_st_p, s_st_n,
    ADD_H0: tl.constexpr, PACKED: tl.constexpr, DOT: tl.constexpr, UPCAST: tl.constexpr, FP32_DOT: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, WIDE_OFFSETS: tl.constexpr,
):
    """states[b, c, h] = sum_k exp(cs_last - cs_k) dt_k x_k (x) B_k over chunk c (from a zero
    state), a [BLOCK_P, BLOCK_N] block per program, for the first n_local chunks; `states`
    through its strides. ADD_H0 (a scan of one chunk): plus exp(cs_last) h0, which makes it the
    final state, so step 4 is not launched."""
    pid = tl.program_id(0)
    nb, pb, rest = _block_coords(pid, tl.cdiv(nstate, BLOCK_N), tl.cdiv(headdim, BLOCK_P))
    h = (rest % heads).to(tl.int64)
    b, c, t0, chunk_len = _chunk_coords(rest // heads, n_local, chunk, seq, cu_seqlens_ptr, PACKED)
    g = h // heads_per_group
    p = _span(pb * BLOCK_P, BLOCK_P, WIDE_OFFSETS)
    n = _span(nb * BLOCK_N, BLOCK_N, WIDE_OFFSETS)
    mask_p = p < headdim
    mask_n = n < nstate
    row = ((b * nchunks + c) * heads + h) * chunk  # this chunk and head in dt_d and cs
    cs_last = tl.load(cs_ptr + row + chunk - 1)
    x_base = x_ptr + b * s_x_b + t0 * s_x_l + h * s_x_h
    B_base = B_ptr + b * s_B_b + t0 * s_B_l + g * s_B_g
    if ADD_H0:
        h0 = _load_tile(h0_ptr + b * s_h0_b + h * s_h0_h, p, s_h0_p, mask_p, n, s_h0_n, mask_n, ACC)
        acc = tl.exp(cs_last.to(ACC)) * h0
    else:
        acc = tl.zeros([BLOCK_P, BLOCK_N], dtype=ACC)
    for k0 in range(0, chunk_len, BLOCK_K):
        k = _span(k0, BLOCK_K, WIDE_OFFSETS)
        mask_k = k < chunk_len
        x_t = _load_tile(x_base, p, s_x_p, mask_p, k, s_x_l, mask_k, DOT)
        B_tile = _load_tile(B_base, k, s_B_l, mask_k, n, s_B_n, mask_n, ACC)
        cs_k = tl.load(cs_ptr + row + k, mask=mask_k, other=0.0)
        dt_k = tl.load(dt_d_ptr + row + k, mask=mask_k, other=0.0)
        weight = tl.where(mask_k, tl.exp((cs_last - cs_k).to(ACC)) * dt_k, 0.0)
        acc = _dot_computed_right(x_t, B_tile * weight[:, None], acc, UPCAST, FP32_DOT)
    out = states_ptr + b * s_st_b + c * s_st_c + h * s_st_h
    tl.store(out + p[:, None] * s_st_p + n[None, :] * s_st_n, acc.to(states_ptr.dtype.element_ty),
             mask=mask_p[:, None] & mask_n[None, :])


@triton.jit(do_not_specialize=_UNSPECIALISED)
def _ssd_state_passing_kernel(
    states_ptr, cs_ptr, h0_ptr, state_out_ptr,
    nchunks, chunk, n_local, heads, headdim, nstate,
    s_h0_b, s_h0_h, s_h0_p, s_h0_n, s_st_b, s_st_h, s_st_p, s_st_n,
    HAS_H0: tl.constexpr, STORE_STATE: tl.constexpr, ACC: tl.constexpr, BLOCK_E: tl.constexpr,
    WIDE_OFFSETS: tl.constexpr,
):
    """Walks the chunks of one head in order, BLOCK_E of its headdim x state entries per program:
    states[c] (chunk c's own end state, for c < n_local) is replaced by the state entering chunk
    c; the state after the last chunk goes to state_out (then n_local is every chunk)."""
    pid = tl.program_id(0)
    n_eblocks = tl.cdiv(headdim * nstate, BLOCK_E)
    e = (pid % n_eblocks) * BLOCK_E + tl.arange(0, BLOCK_E)
    bh = (pid // n_eblocks).to(tl.int64)
    h = bh % heads
    b = bh // heads
    mask = e < headdim * nstate
    p = offset_index(e // nstate, WIDE_OFFSETS)
    n = offset_index(e % nstate, WIDE_OFFSETS)
    if HAS_H0:
        running = tl.load(h0_ptr + b * s_h0_b + h * s_h0_h + p * s_h0_p + n * s_h0_n,
                          mask=mask, other=0.0).to(ACC)
    else:
        running = tl.zeros([BLOCK_E], dtype=ACC)
    for c in range(0, n_local):
        block = states_ptr + ((b * nchunks + c) * heads + h) * headdim * nstate + e
        local = tl.load(block, mask=mask, other=0.0)
        tl.store(block, running, mask=mask)
        decay = tl.exp(tl.load(cs_ptr + ((b * nchunks + c) * heads + h) * chunk + chunk - 1).to(ACC))
        running = decay * running + local
    if n_local < nchunks:
        # The last chunk's own end state was not computed (no final state asked for): only the
        # state entering it is needed.
        tl.store(states_ptr + ((b * nchunks + nchunks - 1) * heads + h) * headdim * nstate + e, running, mask=mask)
    if STORE_STATE:
        tl.store(state_out_ptr + b * s_st_b + h * s_st_h + p * s_st_p + n * s_st_n,
                 running.to(state_out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=_UNSPECIALISED)
def _ssd_chunk_scan_kernel(
    x_ptr, z_ptr, C_ptr, D_ptr, cb_ptr, dt_d_ptr, cs_ptr, states_ptr, y_ptr, cu_seqlens_ptr,
    seq, nchunks, chunk, heads, heads_per_group, groups, headdim, nstate,
    s_x_b, s_x_l, s_x_h, s_x_p, s_z_b, s_z_l, s_z_h, s_z_p, s_y_b, s_y_l, s_y_h, s_y_p,
    s_C_b, s_C_l, s_C_g, s_C_n, s_D_h, s_D_p, s_st_b, s_st_c, s_st_h, s_st_p, s_st_n,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_STATES: tl.constexpr, PACKED: tl.constexpr,
    DOT: tl.constexpr, UPCAST: tl.constexpr, FP32_DOT: tl.constexpr, ACC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
    WIDE_OFFSETS: tl.constexpr,
):
    """y for BLOCK_M positions x BLOCK_P channels of one chunk and head: the entering state's
    part (HAS_STATES: `states`, through its strides, holds the entering states: step 4's, or h0
    for a scan of one chunk; without it there is one chunk and no h0, so the state enters at
    zero), the causal part within the chunk, D and the gate."""
    pid = tl.program_id(0)
    pb, mb, rest = _block_coords(pid, tl.cdiv(headdim, BLOCK_P), tl.cdiv(chunk, BLOCK_M))
    h = (rest % heads).to(tl.int64)
    b, c, t0, chunk_len = _chunk_coords(rest // heads, nchunks, chunk, seq, cu_seqlens_ptr, PACKED)
    g = h // heads_per_group
    m0 = mb * BLOCK_M
    if m0 < chunk_len:
        m = _span(m0, BLOCK_M, WIDE_OFFSETS)
        p = _span(pb * BLOCK_P, BLOCK_P, WIDE_OFFSETS)
        mask_m = m < chunk_len
        mask_p = p < headdim
        mask_mp = mask_m[:, None] & mask_p[None, :]
        row = ((b * nchunks + c) * heads + h) * chunk
        cs_m = tl.load(cs_ptr + row + m, mask=mask_m, other=0.0)
        acc = tl.zeros([BLOCK_M, BLOCK_P], dtype=ACC)

        if HAS_STATES:
            C_base = C_ptr + b * s_C_b + t0 * s_C_l + g * s_C_g
            state_base = states_ptr + b * s_st_b + c * s_st_c + h * s_st_h
            for n0 in range(0, nstate, BLOCK_N):
                n = _span(n0, BLOCK_N, WIDE_OFFSETS)
                mask_n = n < nstate
                C_tile = _load_tile(C_base, m, s_C_l, mask_m, n, s_C_n, mask_n, DOT)
                entering = _load_tile(state_base, n, s_st_n, mask_n, p, s_st_p, mask_p, ACC)
                acc = _dot_computed_right(C_tile, entering, acc, UPCAST, FP32_DOT)
            acc *= tl.exp(cs_m.to(ACC))[:, None]

        cb_base = cb_ptr + ((b * nchunks + c) * groups + g) * chunk * chunk
        x_base = x_ptr + b * s_x_b + t0 * s_x_l + h * s_x_h
        # Columns past this block's last row are all above the diagonal.
        for k0 in range(0, tl.minimum(m0 + BLOCK_M, chunk_len), BLOCK_K):
            k = _span(k0, BLOCK_K, WIDE_OFFSETS)
            mask_k = k < chunk_len
            causal = (k[None, :] <= m[:, None]) & mask_m[:, None] & mask_k[None, :]
            # Masked loads: the C.B^T kernel never wrote above the diagonal.
            cb = tl.load(cb_base + m[:, None] * chunk + k[None, :], mask=causal, other=0.0)
            cs_k = tl.load(cs_ptr + row + k, mask=mask_k, other=0.0)
            dt_k = tl.load(dt_d_ptr + row + k, mask=mask_k, other=0.0)
            # Masked twice: in the exponent, since above the diagonal cs_m - cs_k may be large
            # and positive (exp would overflow), and on the product, so that a NaN dt at step k
            # reaches no row before k (as in the recurrence).
            decay = tl.exp(tl.where(causal, cs_m[:, None] - cs_k[None, :], 0.0).to(ACC))
            scores = tl.where(causal, cb * decay * dt_k[None, :], 0.0)
            x_k = _load_tile(x_base, k, s_x_l, mask_k, p, s_x_p, mask_p, DOT)
            acc = _dot_computed_left(scores, x_k, acc, UPCAST, FP32_DOT)

        if HAS_D:
            x_m = _load_tile(x_base, m, s_x_l, mask_m, p, s_x_p, mask_p, ACC)
            acc += x_m * tl.load(D_ptr + h * s_D_h + p * s_D_p, mask=mask_p, other=0.0).to(ACC)[None, :]
        if HAS_Z:
            z_base = z_ptr + b * s_z_b + t0 * s_z_l + h * s_z_h
            acc *= silu(_load_tile(z_base, m, s_z_l, mask_m, p, s_z_p, mask_p, ACC))
        tl.store(y_ptr + b * s_y_b + t0 * s_y_l + h * s_y_h + m[:, None] * s_y_l + p[None, :] * s_y_p,
                 acc.to(y_ptr.dtype.element_ty), mask=mask_mp)


@dataclass(frozen=True)
class SsdPlan:
    """How one scan is cut up."""
    chunk: int
    nchunks: int
    blocks: configs.SsdBlocks
    dot: torch.dtype  # the dtype the dots multiply in
    fp32_dot: str  # tl.dot's input_precision for fp32 operands (configs.SSD_FP32_DOT)


def _dot_dtype(x: torch.Tensor, B: torch.Tensor, C: torch.Tensor, acc: torch.dtype) -> torch.dtype:
    """16-bit when x, B and C share that dtype (their values are then exact operands); else the
    accumulation dtype."""
    if acc == torch.float32 and x.dtype == B.dtype == C.dtype and x.dtype in (torch.float16, torch.bfloat16):
        return x.dtype
    return acc


_TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32,
              torch.float64: tl.float64}


def plan_ssd_scan(x, B, C, chunk_size: int | None, blocks: configs.SsdBlocks | None = None,
                  seq: int | None = None) -> SsdPlan:
    """The chunk (the caller's, the default, at most _args.MAX_CHUNK and never longer
    than the sequence, `seq` or x's: one chunk of the whole sequence is the same computation)
    and the blocks (the table's, or `blocks`, which tests shrink to reach several blocks per
    axis)."""
    headdim = x.shape[3]
    seq = seq or x.shape[1]
    chunk = min(chunk_size or configs.SSD_CHUNK, MAX_CHUNK, seq)
    dot = _dot_dtype(x, B, C, accumulation_dtype(x))
    return SsdPlan(chunk, cdiv(seq, chunk), configs.ssd_blocks(headdim, B.shape[3], chunk, dot, blocks), dot,
                   configs.SSD_FP32_DOT)


def _grid(*counts: int) -> tuple[int]:
    total = 1
    for count in counts:
        total *= count
    return (total,)


def _state_strides(state: torch.Tensor | None) -> tuple[int, ...]:
    """A [rows, heads, headdim, state] tensor's strides as the chunk kernels take a state's:
    (row, chunk, head, headdim, state), the chunk's 0 (one chunk); zeros where there is none."""
    if state is None:
        return (0, 0, 0, 0, 0)
    s_row, s_head, s_p, s_n = state.stride()
    return (s_row, 0, s_head, s_p, s_n)


def ssd_scan(x, dt, A, B, C, *, D=None, z=None, dt_bias=None, dt_softplus=False, dt_min=None,
             dt_max=None, h0=None, return_state=False, chunk_size=None, cu_seqlens=None, out=None,
             state_out=None, blocks=None):
    """The "triton" backend's SSD scan; arguments as normalised by `scan_kernels._args.check_ssd_scan`
    (D [heads, headdim]), and `cu_seqlens` (int64 [n + 1], checked) for sequences packed along a
    batch-1 input's seq. Returns (y in x's dtype, the final state or None).

    Internal keywords: `out` / `state_out` receive y / the final state instead of fresh tensors
    (tests pass NaN-filled ones, so that an element no program writes shows up; `state_out`
    must not share memory with h0, which a scan of one chunk reads after writing the final
    state); `blocks` overrides the table (configs.SsdBlocks)."""
    out, state_out, launches = ssd_scan_launches(
        x, dt, A, B, C, D=D, z=z, dt_bias=dt_bias, dt_softplus=dt_softplus, dt_min=dt_min,
        dt_max=dt_max, h0=h0, return_state=return_state, chunk_size=chunk_size, out=out,
        state_out=state_out, blocks=blocks, cu_seqlens=cu_seqlens)
    run_on_device_of(x, launches)
    return out, state_out


def ssd_scan_launches(x, dt, A, B, C, *, D, z, dt_bias, dt_softplus, dt_min, dt_max, h0, return_state,
                      chunk_size, out, state_out, blocks, cu_seqlens=None):
    """(y, state or None, the launches that fill them), outputs and buffers allocated, nothing run.

    With `cu_seqlens` (a CPU int64 tensor of n + 1 boundaries along a batch-1 input's seq), the
    n sequences are the launches' rows, each cut into chunks of its own (as many as the longest
    needs; those past a sequence's end hold nothing and pass its state on unchanged), and the
    operands' batch stride is passed as 0."""
    batch, seq, heads, headdim = x.shape
    groups, nstate = B.shape[2], B.shape[3]
    device = x.device
    acc = accumulation_dtype(x)
    packed = cu_seqlens is not None
    batch, longest, cu_seqlens = packed_rows(cu_seqlens, batch, seq, device)  # batch: the programs' rows
    plan = plan_ssd_scan(x, B, C, chunk_size, blocks, seq=longest)
    chunk, nchunks, bl = plan.chunk, plan.nchunks, plan.blocks

    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=device)
    else:
        check_out("out", out, x.shape, x.dtype, device)
    if return_state:
        if state_out is None:
            state_out = torch.empty((batch, heads, headdim, nstate), dtype=acc, device=device)
        else:
            check_out("state_out", state_out, (batch, heads, headdim, nstate), acc, device)
            if h0 is not None and state_out.untyped_storage().data_ptr() == h0.untyped_storage().data_ptr():
                raise KernelInputError("state_out", "a tensor of its own (not h0's memory)", "h0's storage")
    else:
        state_out = None

    dt_d = torch.empty((batch, nchunks, heads, chunk), dtype=acc, device=device)
    cs = torch.empty_like(dt_d, dtype=torch.float64)  # differenced in fp64 (module docstring)
    cb = torch.empty((batch, nchunks, groups, chunk, chunk), dtype=acc, device=device)
    # The chunks whose own end state is used: all but the last, and the last for the final state.
    n_local = nchunks if return_state else nchunks - 1
    # One chunk needs no state passing: h0 is the state entering it, and its own end state plus
    # its decay of h0 is the final state, which step 3 then writes where the caller wants it.
    one_chunk = nchunks == 1
    if one_chunk:
        states, state_strides = state_out, _state_strides(state_out)
        entering, entering_strides = h0, _state_strides(h0)
    else:
        states = torch.empty((batch, nchunks, heads, headdim, nstate), dtype=acc, device=device)
        state_strides = entering_strides = states.stride()
        entering = states

    has_clamp, bounds = clamp_bounds(dt_min, dt_max)
    wide = wide_offsets(per_row=(x, dt, z, out, B, C, h0, state_out), whole=(A, D, dt_bias))
    acc_tl, dot_tl = triton_dtype(acc), _TL_DTYPES[plan.dot]
    # The interpreter's dot reads bf16 operands as integers (see _mma).
    upcast = plan.dot == torch.bfloat16 and interpreter_active()
    dots = dict(DOT=dot_tl, UPCAST=upcast, FP32_DOT=plan.fp32_dot, WIDE_OFFSETS=wide)
    warps = bl.num_warps
    heads_per_group = heads // groups
    s_x, s_B, s_C, s_dt = (row_strides(t.stride(), packed) for t in (x, B, C, dt))
    s_h0 = h0.stride() if h0 is not None else (0, 0, 0, 0)
    launches = []

    block_t = next_power_of_2(chunk)
    block_h = min(next_power_of_2(heads), max(1, configs.SSD_ELEMENTWISE_BLOCK // block_t))
    cumsum_programs = batch * nchunks * cdiv(heads, block_h)
    cb_programs = batch * nchunks * groups * cdiv(chunk, bl.block_m) * cdiv(chunk, bl.block_k)
    launches.append(Launch(
        _ssd_prep_kernel, (cumsum_programs + cb_programs,),
        (dt, A, dt_bias, dt_d, cs, B, C, cb, cu_seqlens, seq, nchunks, chunk, heads, groups, nstate, cumsum_programs,
         *bounds, *s_dt, A.stride(0), dt_bias.stride(0) if dt_bias is not None else 0, *s_B, *s_C),
        dict(HAS_DT_BIAS=dt_bias is not None, DT_SOFTPLUS=bool(dt_softplus), HAS_CLAMP=has_clamp, PACKED=packed,
             ACC=acc_tl, BLOCK_T=block_t, BLOCK_H=block_h, BLOCK_M=bl.block_m, BLOCK_K=bl.block_k,
             BLOCK_N=bl.block_n, **dots),
        warps))
    if n_local:
        launches.append(Launch(
            _ssd_chunk_state_kernel,
            _grid(batch, n_local, heads, cdiv(headdim, bl.block_p), cdiv(nstate, bl.block_n)),
            (x, B, dt_d, cs, h0, states, cu_seqlens, seq, nchunks, chunk, n_local, heads, heads_per_group, headdim,
             nstate, *s_x, *s_B, *s_h0, *state_strides),
            # IEEE fp32 here whatever the plan: tf32x3's split operands spilled this kernel's
            # registers when compiled for sm_90 (docs/performance.md, "Triton SSD tiles").
            dict(ADD_H0=one_chunk and h0 is not None, PACKED=packed, ACC=acc_tl, BLOCK_K=bl.block_k,
                 BLOCK_P=bl.block_p, BLOCK_N=bl.block_n, **dict(dots, FP32_DOT="ieee")),
            warps))
    if not one_chunk:
        block_e = min(next_power_of_2(headdim * nstate), configs.SSD_ELEMENTWISE_BLOCK)
        launches.append(Launch(
            _ssd_state_passing_kernel, _grid(batch, heads, cdiv(headdim * nstate, block_e)),
            (states, cs, h0, state_out, nchunks, chunk, n_local, heads, headdim, nstate, *s_h0,
             *(state_out.stride() if state_out is not None else (0, 0, 0, 0))),
            dict(HAS_H0=h0 is not None, STORE_STATE=state_out is not None, ACC=acc_tl, BLOCK_E=block_e,
                 WIDE_OFFSETS=wide),
            warps))
    launches.append(Launch(
        _ssd_chunk_scan_kernel,
        _grid(batch, nchunks, heads, cdiv(chunk, bl.block_m), cdiv(headdim, bl.block_p)),
        (x, z, C, D, cb, dt_d, cs, entering, out, cu_seqlens, seq, nchunks, chunk, heads, heads_per_group, groups,
         headdim, nstate, *s_x, *(row_strides(z.stride(), packed) if z is not None else (0, 0, 0, 0)),
         *row_strides(out.stride(), packed), *s_C, *(D.stride() if D is not None else (0, 0)), *entering_strides),
        dict(HAS_D=D is not None, HAS_Z=z is not None, HAS_STATES=entering is not None, PACKED=packed, ACC=acc_tl,
             BLOCK_M=bl.block_m, BLOCK_K=bl.block_k, BLOCK_P=bl.block_p, BLOCK_N=bl.block_n, **dots),
        warps))
    return out, state_out, launches


# --- one timestep ------------------------------------------------------------------------------


@triton.jit
def _ssd_update_kernel(
    state_ptr, x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, dt_bias_ptr, slots_ptr, y_ptr,
    heads, heads_per_group, headdim, nstate,
    dt_min_hi, dt_min_lo, dt_max_hi, dt_max_lo,
    s_st_r, s_st_h, s_st_p, s_st_n, s_x_b, s_x_h, s_x_p, s_dt_b, s_dt_h, s_z_b, s_z_h, s_z_p,
    s_y_b, s_y_h, s_y_p, s_B_b, s_B_g, s_B_n, s_C_b, s_C_g, s_C_n, s_A, s_D_h, s_D_p, s_bias, s_slots,
    HAS_SLOTS: tl.constexpr, HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_DT_BIAS: tl.constexpr,
    DT_SOFTPLUS: tl.constexpr, HAS_CLAMP: tl.constexpr, ACC: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, WIDE_OFFSETS: tl.constexpr,
):
    """BLOCK_P channels of one head of one row: h = exp(dt A) h + dt x (x) B over the state in
    BLOCK_N steps, written back in place, and y = C . h (+ D x) (* silu(z))."""
    pid = tl.program_id(0)
    n_pblocks = tl.cdiv(headdim, BLOCK_P)
    p = _span((pid % n_pblocks) * BLOCK_P, BLOCK_P, WIDE_OFFSETS)
    rest = (pid // n_pblocks).to(tl.int64)
    h = rest % heads
    row = rest // heads
    g = h // heads_per_group
    if HAS_SLOTS:
        slot = tl.load(slots_ptr + row * s_slots).to(tl.int64)
    else:
        slot = row
    live = slot >= 0
    mask_p = p < headdim
    # A padding row reads and writes nothing: its masks admit no channel and no state entry.
    mask_live_p = tl.where(live, mask_p, False)
    nstate_live = tl.where(live, nstate, 0)

    x = tl.load(x_ptr + row * s_x_b + h * s_x_h + p * s_x_p, mask=mask_live_p, other=0.0).to(ACC)
    dt = tl.load(dt_ptr + row * s_dt_b + h * s_dt_h, mask=live, other=0.0).to(ACC)
    if HAS_DT_BIAS:
        dt += tl.load(dt_bias_ptr + h * s_bias, mask=live, other=0.0).to(ACC)
    dt = discretize_dt(dt, live, DT_SOFTPLUS, HAS_CLAMP, dt_min_hi, dt_min_lo, dt_max_hi, dt_max_lo)
    decay = tl.exp(dt * tl.load(A_ptr + h * s_A, mask=live, other=0.0).to(ACC))
    dt_x = dt * x
    B_base = B_ptr + row * s_B_b + g * s_B_g
    C_base = C_ptr + row * s_C_b + g * s_C_g
    state_base = state_ptr + slot * s_st_r + h * s_st_h
    y = tl.zeros([BLOCK_P], dtype=ACC)
    for n0 in range(0, nstate, BLOCK_N):
        n = _span(n0, BLOCK_N, WIDE_OFFSETS)
        mask_n = n < nstate_live
        mask_pn = mask_live_p[:, None] & mask_n[None, :]
        B = tl.load(B_base + n * s_B_n, mask=mask_n, other=0.0).to(ACC)
        C = tl.load(C_base + n * s_C_n, mask=mask_n, other=0.0).to(ACC)
        state_ptrs = state_base + p[:, None] * s_st_p + n[None, :] * s_st_n
        hs = tl.load(state_ptrs, mask=mask_pn, other=0.0).to(ACC)
        hs = decay * hs + dt_x[:, None] * B[None, :]
        tl.store(state_ptrs, hs.to(state_ptr.dtype.element_ty), mask=mask_pn)
        # Padded entries hold 0 * B's padding, NaN for an infinite dt x or decay (0 * inf).
        y += tl.sum(tl.where(mask_n[None, :], hs * C[None, :], 0.0), axis=1)
    if HAS_D:
        y += x * tl.load(D_ptr + h * s_D_h + p * s_D_p, mask=mask_live_p, other=0.0).to(ACC)
    if HAS_Z:
        y *= silu(tl.load(z_ptr + row * s_z_b + h * s_z_h + p * s_z_p, mask=mask_live_p, other=0.0).to(ACC))
    # A padding row loaded every input as 0, so its y is exactly 0; it is still stored.
    tl.store(y_ptr + row * s_y_b + h * s_y_h + p * s_y_p, y.to(y_ptr.dtype.element_ty), mask=mask_p)


def ssd_state_update(state, x, dt, A, B, C, *, D=None, z=None, dt_bias=None, dt_softplus=False,
                     dt_min=None, dt_max=None, slots=None, out=None, blocks=None):
    """The "triton" backend's SSD state update; arguments as normalised by
    `scan_kernels._args.check_ssd_state_update`. Returns y [batch, heads, headdim] in x's dtype;
    `state` rows are updated in place. Rows must name distinct slots (two rows on one slot
    would race on its state).

    Internal keywords: `out` receives y instead of a fresh tensor; `blocks` overrides the
    table (configs.SsdUpdateBlocks)."""
    out, launch = ssd_update_launch(state, x, dt, A, B, C, D=D, z=z, dt_bias=dt_bias,
                                    dt_softplus=dt_softplus, dt_min=dt_min, dt_max=dt_max,
                                    slots=slots, out=out, blocks=blocks)
    run_on_device_of(x, [launch])
    return out


def ssd_update_launch(state, x, dt, A, B, C, *, D, z, dt_bias, dt_softplus, dt_min, dt_max, slots,
                      out, blocks):
    """(y, the launch that fills it and updates `state`), y allocated, nothing run."""
    batch, heads, headdim = x.shape
    groups, nstate = B.shape[1], B.shape[2]
    bl = blocks or configs.ssd_update_blocks(headdim, nstate)
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    else:
        check_out("out", out, x.shape, x.dtype, x.device)
    has_clamp, bounds = clamp_bounds(dt_min, dt_max)
    return out, Launch(
        _ssd_update_kernel, _grid(batch, heads, cdiv(headdim, bl.block_p)),
        (state, x, dt, A, B, C, D, z, dt_bias, slots, out,
         heads, heads // groups, headdim, nstate,
         *bounds,
         *state.stride(), *x.stride(), *dt.stride(),
         *(z.stride() if z is not None else (0, 0, 0)), *out.stride(), *B.stride(), *C.stride(),
         A.stride(0), *(D.stride() if D is not None else (0, 0)),
         dt_bias.stride(0) if dt_bias is not None else 0, slots.stride(0) if slots is not None else 0),
        dict(HAS_SLOTS=slots is not None, HAS_D=D is not None, HAS_Z=z is not None,
             HAS_DT_BIAS=dt_bias is not None, DT_SOFTPLUS=bool(dt_softplus), HAS_CLAMP=has_clamp,
             ACC=triton_dtype(accumulation_dtype(x)), BLOCK_P=bl.block_p, BLOCK_N=bl.block_n,
             WIDE_OFFSETS=wide_offsets(per_row=(state, x, dt, z, out, B, C), whole=(A, D, dt_bias))),
        bl.num_warps)
