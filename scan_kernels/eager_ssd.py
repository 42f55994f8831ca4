"""Mamba-2 (SSD) for the "torch" backend: the chunked scan as matrix products, and the one-step
state update.

Scan ("SSD minimal", mamba_ssm's ssd_minimal_discrete, laid out for batched matmuls). The
sequence is cut into chunks of Q timesteps (the last one zero-padded: dt 0 there, so a padded
step decays by exp(0) = 1 and adds nothing). Per chunk, with cs the cumulative sum of dt·A over
the chunk's own steps (so cs is non-increasing, its magnitude bounded by one chunk's decay):

  L[m, k]    = exp(cs_m - cs_k) for k <= m, else 0              decay from step k to step m
  Y_diag     = (C Bᵀ ∘ L) (dt·x)                                the chunk's own inputs
  S_c        = Σ_k exp(cs_last - cs_k) dt_k x_k ⊗ B_k            its end state from a zero state
  H_{c+1}    = exp(cs_last) H_c + S_c,  H_0 = h0 (or 0)         states entering each chunk
  Y_off      = exp(cs_m) C_m · H_c                               the carried state's share

and y = Y_diag + Y_off (+ D x, ∘ silu(z)); the final state is H after the last chunk. The
recurrence over chunk states is a Python loop over chunks (seq / Q steps, each one multiply-add
over [batch, heads, headdim, state]) rather than a [chunks x chunks] decay matrix, whose size
grows with the square of seq.

Exponents. Those used are differences cs_m - cs_k with k <= m, cs_last - cs_k, or cs itself:
all <= 0 when dt >= 0 and A < 0, so no decay exceeds 1 and strong decays shrink towards 0 (the
true answer) instead of overflowing, which a cumulative sum over the whole sequence would not
avoid. The decays that reach y directly (the intra-chunk L, and exp(cs_m) on the carried state)
have their exponents clamped from below at -E, E = `_exp_bound` (exp(-E) is about the square root
of the dtype's smallest normal number): a decay that small is kept at exp(-E) rather than reaching
subnormal numbers or 0 through them, which torch's exp computes many times slower on x86 CPUs
(on the [Q, Q] decays of every chunk and head, most of the exps here), and what it adds to y is
below exp(-E) times the term it decays, a term y met undecayed where it entered. The decays
carried into the state (exp(cs_last - cs_k), exp(cs_last), and the update's exp(dt·A)) are not
clamped: a later step that grows the state (A > 0, or dt < 0; in this call or a later one)
multiplies them back up, a clamped one as much too large as the clamp made it. Not from above
either: positive exponents mean what they say. The intra-chunk decays' upper triangle (k > m,
unused: the scores C Bᵀ are masked there) is zero before exp, so that no inf from it is ever
multiplied by 0.

The differences cs_m - cs_k and cs_last - cs_k are not taken from cs: each is summed over its
own steps, dt_(k+1) A + ... + dt_m A, as a cumulative sum down the columns of the masked
[Q, Q] matrix of each step's dt·A (mamba_ssm's `segsum`). cs rounds at its own magnitude, and
one large step early in a chunk (dt·A in the thousands, its own input large too) makes that
magnitude large, so its differences between the small steps after it would be off by that
rounding in the exponent, a relative error that the large input's share of y, decaying slowly
over those steps, carries. cs itself serves only as exp(cs), where a large |cs| is a decay of 0 (or an
overflow) whatever its rounding.

Layouts. The heads of a group share B and C: C Bᵀ is computed once per group, and the chunk
states are kept transposed, [state, heads of the group x headdim] per group, so that the states
(Bᵀ times the decayed dt·x, in x's own order) and C H are each one batched matmul per (batch,
chunk, group). Y_diag is one matmul per (batch, chunk, head) on dt·x laid out head-major.

Non-finite inputs. The chunked form is exact for finite numbers only: a NaN or inf at step k is
multiplied by the zeros above the diagonal (0 x NaN = NaN) into the rows of its chunk before k,
and the form sums C·B over the state before it meets x, where the recurrence sums C_n h_n over
state entries that are already infinite (it gives NaN for inf - inf where the form gives ±inf).
So a scan whose y or final state comes out non-finite is computed again by the recurrence
(scan_kernels/reference.py in the compute dtype), which puts NaN and inf where every other backend
does; a finite one pays only the sums that find out (on CUDA, a host sync).

Accumulation in fp32 (fp64 for fp64 inputs); y in x's dtype, the state in the compute dtype.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ._args import MAX_CHUNK
from .eager import LiveRows, _compute_dtype, _discretize_dt
from .reference import ssd_scan_ref

# Timesteps per chunk when the caller names none. The decay and score matrices hold
# seq x heads x Q numbers, the chunk states seq x heads x headdim x state / Q: the two balance
# near Q = sqrt(headdim x state), which is between 64 and 128 at Mamba-2's usual head (64 x 128).
# Timed on the CPU at Mamba-2-130m's layer (24 heads x 64 headdim, state 128, seq 1024) over
# chunks of 32 to 256, 64 was fastest with one thread and with two (32 to 128 somewhat slower,
# 256 clearly). Not timed on CUDA, where the same balance of memory traffic applies.
DEFAULT_CHUNK = 64


def _chunk_size(chunk_size: int | None, seq: int) -> int:
    """The chunk actually used: the caller's or the default, at most _args.MAX_CHUNK, and never more
    than seq (a shorter sequence is one unpadded chunk)."""
    return min(seq, chunk_size or DEFAULT_CHUNK, MAX_CHUNK)


def _exp_bound(f: torch.dtype) -> float:
    """E: exponents are clamped from below at -E; exp(-E) is about sqrt(smallest normal) of dtype f."""
    return -math.log(torch.finfo(f).tiny) / 2


def _exp(t: torch.Tensor, bound: float) -> torch.Tensor:
    """exp(t) in place, t clamped from below at -bound first."""
    return t.clamp_(min=-bound).exp_()


def _padded(t: torch.Tensor, length: int, f: torch.dtype) -> torch.Tensor:
    """t [batch, seq, ...] in dtype f, zero-padded along seq to `length`; t itself (or its cast)
    when nothing is to be padded."""
    seq = t.shape[1]
    if seq == length:
        return t.to(f)
    out = torch.empty((t.shape[0], length, *t.shape[2:]), dtype=f, device=t.device)
    out[:, :seq] = t
    out[:, seq:] = 0
    return out


def _skip_and_gate(y, x, D, z, f):
    """y + D x, then times silu(z) (each where given), in place in y (compute dtype f)."""
    if D is not None:
        y.addcmul_(x.to(f), D.to(f))
    if z is not None:
        y.mul_(F.silu(z.to(f)))
    return y


def _all_finite(*tensors) -> bool:
    """Whether every element of the tensors given (None skipped) is finite, read from their sums:
    one NaN or inf term makes a sum non-finite. Finite terms whose sum overflows read as not
    finite too, which costs the caller its slower exact path and nothing else."""
    return all(bool(torch.isfinite(t.sum())) for t in tensors if t is not None)


def ssd_scan(x, dt, A, B, C, *, D, z, dt_bias, dt_softplus, dt_min, dt_max, h0, return_state,
             chunk_size):
    """Arguments as normalised by `scan_kernels._args.check_ssd_scan` (D [heads, headdim])."""
    options = dict(D=D, z=z, dt_bias=dt_bias, dt_softplus=dt_softplus, dt_min=dt_min, dt_max=dt_max, h0=h0,
                   return_state=return_state)
    y, final = _chunked_scan(x, dt, A, B, C, **options, chunk_size=chunk_size)
    if _all_finite(y, final):
        return y.to(x.dtype).contiguous(), final  # a padded y's slice is not contiguous for batch > 1
    # The chunked form puts NaN where the recurrence has none (module docstring, "Non-finite inputs").
    return ssd_scan_ref(x, dt, A, B, C, **options, compute_dtype=_compute_dtype(x))


def _chunked_scan(x, dt, A, B, C, *, D, z, dt_bias, dt_softplus, dt_min, dt_max, h0, return_state,
                  chunk_size):
    """The chunked scan: y [batch, seq, heads, headdim] in the compute dtype (a view of a padded
    buffer) and the final state (None unless return_state)."""
    f = _compute_dtype(x)
    batch, seq, heads, headdim = x.shape
    groups, n = B.shape[2], B.shape[3]
    per_group = heads // groups
    Q = _chunk_size(chunk_size, seq)
    chunks = -(-seq // Q)
    length = chunks * Q
    dev = x.device

    dt_f = _padded(_discretize_dt(dt, dt_bias, dt_softplus, dt_min, dt_max, f), length, f)
    dt_c = dt_f.view(batch, chunks, Q, heads)
    x_c = _padded(x, length, f).view(batch, chunks, Q, heads, headdim)
    # B, C as [batch, chunk, group, Q, state]: the matrix operands of every product below.
    B_c, C_c = (_padded(t, length, f).view(batch, chunks, Q, groups, n).transpose(2, 3).contiguous()
                for t in (B, C))

    # dtA [batch, chunk, head, Q]: each step's log decay dt·A; cs its cumulative sum within each chunk.
    dtA = torch.mul(dt_c.transpose(2, 3), A.to(f)[:, None])
    cs = dtA.cumsum(-1)

    bound = _exp_bound(f)
    # Intra-chunk: scores (C Bᵀ per group, 0 above the diagonal) times the decays, per head,
    # times dt·x (head-major, [b, c, h, Q, p]).
    scores = torch.matmul(C_c, B_c.transpose(-1, -2)).tril_()  # [b, c, g, Q, Q]
    # decay[m, k] = dtA_(k+1) + ... + dtA_m for k < m (0 on and above the diagonal): "segsum",
    # summed over those steps only (module docstring, "Exponents").
    decay = dtA.unsqueeze(-1).expand(batch, chunks, heads, Q, Q).tril(-1).cumsum_(-2)
    # Each step's decay to the chunk's end, exp(cs_last - cs_k): the decays' last row, unclamped
    # as it goes into the state.
    to_end = decay[..., -1, :].exp().mul_(dt_c.transpose(2, 3))  # [b, c, h, Q], dt times it
    _exp(decay, bound)
    weights = decay.view(batch, chunks, groups, per_group, Q, Q).mul_(scores.unsqueeze(3))
    xdt = torch.empty(batch, chunks, heads, Q, headdim, dtype=f, device=dev)
    torch.mul(x_c.transpose(2, 3), dt_c.transpose(2, 3).unsqueeze(-1), out=xdt)
    y_diag = torch.matmul(weights.view(batch, chunks, heads, Q, Q), xdt)  # [b, c, h, Q, p]

    # Each chunk's end state from a zero state, transposed: Bᵀ (dt·x decayed to the chunk's end),
    # [b, c, g, state, h/g x p], the group's heads side by side (x's own order within a group).
    x_end = torch.empty(batch, chunks, groups, Q, per_group, headdim, dtype=f, device=dev)
    torch.mul(x_c.view(batch, chunks, Q, groups, per_group, headdim).transpose(2, 3),
              to_end.view(batch, chunks, groups, per_group, Q, 1).transpose(3, 4), out=x_end)
    states = torch.matmul(B_c.transpose(-1, -2), x_end.view(batch, chunks, groups, Q, per_group * headdim))

    # Across chunks: entering[c] is the state entering chunk c (same transposed layout, viewed
    # [b, c, g, state, h/g, p]); the loop carries it along.
    chunk_decay = cs[..., -1].exp().view(batch, chunks, groups, 1, per_group, 1)  # unclamped: into the state
    entering = torch.empty_like(states)
    states6, entering6 = (t.view(batch, chunks, groups, n, per_group, headdim) for t in (states, entering))
    if h0 is None:
        entering6[:, 0] = 0
    else:
        entering6[:, 0] = h0.view(batch, groups, per_group, headdim, n).permute(0, 1, 4, 2, 3)
    for c in range(1, chunks):
        torch.addcmul(states6[:, c - 1], chunk_decay[:, c - 1], entering6[:, c - 1], out=entering6[:, c])
    final = None
    if return_state:
        last = torch.addcmul(states6[:, -1], chunk_decay[:, -1], entering6[:, -1])  # [b, g, n, h/g, p]
        # contiguous as every other backend's state (with one group reshape keeps a strided view)
        final = last.permute(0, 1, 3, 4, 2).reshape(batch, heads, headdim, n).contiguous()

    # y [batch, seq, heads, headdim] written as [b, c, Q, g, h/g, p].
    y = torch.empty(batch, length, heads, headdim, dtype=f, device=dev)
    y6 = y.view(batch, chunks, Q, groups, per_group, headdim)
    y_diag6 = y_diag.view(batch, chunks, groups, per_group, Q, headdim).permute(0, 1, 4, 2, 3, 5)
    if h0 is None and chunks == 1:
        y6.copy_(y_diag6)  # no state enters the only chunk
    else:
        # C_m · H_c for every head of the group at once: [b, c, g, Q, h/g x p].
        y_off = torch.matmul(C_c, entering)
        y_off6 = y_off.view(batch, chunks, groups, Q, per_group, headdim).transpose(2, 3)
        scale = _exp(cs.clone(), bound).view(batch, chunks, groups, per_group, Q).permute(0, 1, 4, 2, 3)
        torch.mul(y_off6, scale.unsqueeze(-1), out=y6)
        y6.add_(y_diag6)

    return _skip_and_gate(y[:, :seq], x, D, z, f), final


def ssd_state_update(state, x, dt, A, B, C, *, D, z, dt_bias, dt_softplus, dt_min, dt_max, slots):
    """Arguments as normalised by `scan_kernels._args.check_ssd_state_update`. Updates `state` in
    place at rows `slots` (rows 0..batch-1 when None); a negative slot is a padding row: its y is
    0 and no state row is touched."""
    f = _compute_dtype(x)
    batch, heads, headdim = x.shape
    groups = B.shape[1]
    per_group = heads // groups

    rows = LiveRows(state, slots)
    h = rows.state_rows(f)
    x, dt, B, C, z = (rows.select(t) for t in (x, dt, B, C, z))

    dt_f = _discretize_dt(dt, dt_bias, dt_softplus, dt_min, dt_max, f)  # [r, h]
    h.mul_(torch.mul(dt_f, A.to(f)).exp_()[..., None, None])  # unclamped, as the scan's state decays
    h5 = h.unflatten(1, (groups, per_group))  # [r, g, h/g, p, n], a view: updates land in h
    h5.addcmul_(torch.mul(x, dt_f.unsqueeze(-1)).unflatten(1, (groups, per_group)).unsqueeze(-1),
                B.to(f)[:, :, None, None, :])
    out = _skip_and_gate(torch.einsum("rgkpn,rgn->rgkp", h5, C.to(f)).flatten(1, 2), x, D, z, f)  # [r, h, p]

    rows.write_back(h)
    return rows.full_rows(out.to(x.dtype), batch)
