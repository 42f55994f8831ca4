"""The "torch" backend: the selective scan and the state update in eager PyTorch.

It runs wherever torch runs (CPU and CUDA), so it is the fallback on every machine and the GPU
path when Triton is missing: correctness and robustness come first, speed second.

Scan strategy. The recurrence h_t = exp(dt_t A) h_{t-1} + dt_t B_t x_t is evaluated step by step,
one tensor op per timestep over all of batch x channels x state at once, inside blocks of
(sequence chunk x channel block). Per block, fp32 buffers [batch, T, groups, channels, state]
hold the decays exp(dt A) and the inputs dt B x; the recurrence overwrites the inputs with the
states h_t in place, and y for the whole block is one contraction with C. The block size is
chosen so that one buffer is about L2-sized (see `_BLOCK_BYTES`), so the block's ops work on
cache-resident data and no [batch, seq, dim, state] tensor is ever materialized; channels are
split into blocks only when one timestep of all of them is already larger than that.

Why not a log-space cumulative-sum (exp(S_t) * cumsum(exp(-S_s) u_s)): it needs exp of positive
cumulative sums, which overflows as soon as a chunk decays by more than e^88 (fp32), a case that
real inputs reach (large softplus(dt) times a very negative A). The step-by-step form multiplies
decays <= 1 only, so long sequences merely underflow towards 0, which is the correct answer.
The per-step Python cost is expected to be small against the elementwise work for the sizes the
bridge serves, and to dominate only for tiny batch*dim*state with very long sequences (no
benchmark isolates it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._registry import Backend

# Target size of one per-block work buffer (decays; the state buffers have the same shape).
# About the L2 of this machine (2 MiB in all; the elementwise ops split each buffer between
# the two cores' threads): smaller blocks pay more per-op overhead (more chunks, strided
# channel views), larger ones spill to L3. An L2-sized choice, not a measured optimum; the
# torch backend's times are in docs/performance.md, "CPU kernels".
_BLOCK_BYTES = 2 * 1024 * 1024


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _discretize_dt(dt, dt_bias, dt_softplus, dt_min, dt_max, f):
    """dt in the compute dtype, with bias, softplus (torch's threshold 20) and clamp applied.
    Every step is out of place: `dt` may be a view of the caller's tensor."""
    dt = dt.to(f)
    if dt_bias is not None:
        dt = dt + dt_bias.to(f)
    if dt_softplus:
        dt = F.softplus(dt)
    if dt_min is not None or dt_max is not None:
        dt = dt.clamp(min=dt_min, max=dt_max)
    return dt


def _block_sizes(batch: int, seq: int, groups: int, per_group: int, state: int, itemsize: int):
    """(channels per group in a block, timesteps in a block) so that one buffer
    [batch, T, groups, channels, state] is about _BLOCK_BYTES. Channels are split only when a
    single timestep of all channels is already larger than that."""
    step_bytes = batch * groups * per_group * state * itemsize
    if step_bytes <= _BLOCK_BYTES:
        return per_group, max(1, min(seq, _BLOCK_BYTES // step_bytes))
    channel_bytes = batch * groups * state * itemsize
    return max(1, min(per_group, _BLOCK_BYTES // channel_bytes)), 1


def selective_scan(x, dt, A, B, C, *, D, z, dt_bias, dt_softplus, dt_min, dt_max, h0,
                   return_state, layout):
    """Arguments as normalised by `scan_kernels._args.check_scan` (B, C with a groups axis)."""
    f = _compute_dtype(x)
    # Read both layouts through "bld"-ordered views: x, dt, z [b, l, d]; B, C [b, l, g, n].
    if layout == "bdl":
        x, dt = x.transpose(1, 2), dt.transpose(1, 2)
        z = None if z is None else z.transpose(1, 2)
        B, C = B.permute(0, 3, 1, 2), C.permute(0, 3, 1, 2)
    batch, seq, dim = x.shape
    groups, n = B.shape[2], A.shape[1]
    per_group = dim // groups

    # y is allocated in the caller's layout (C-contiguous) and written through a "bld" view.
    if layout == "bdl":
        y = torch.empty(batch, dim, seq, dtype=f, device=x.device)
        y_bld = y.transpose(1, 2)
    else:
        y = torch.empty(batch, seq, dim, dtype=f, device=x.device)
        y_bld = y
    # Channel axis split as (group, channel within group): a block of channels within every
    # group is then a plain strided view, and B/C broadcast over it without repeat_interleave.
    x4, dt4, y4 = (t.unflatten(2, (groups, per_group)) for t in (x, dt, y_bld))
    A3 = A.to(f).unflatten(0, (groups, per_group))  # [g, dg, n]
    bias2 = None if dt_bias is None else dt_bias.to(f).unflatten(0, (groups, per_group))
    if h0 is None:
        h = torch.zeros(batch, groups, per_group, n, dtype=f, device=x.device)
    else:
        h = h0.to(f, copy=True).unflatten(1, (groups, per_group))

    block_channels, block_steps = _block_sizes(batch, seq, groups, per_group, n, f.itemsize)
    buf_shape = (batch, block_steps, groups, block_channels, n)
    decay_buf = torch.empty(buf_shape, dtype=f, device=x.device)
    # Two state buffers used in turn: a chunk's first step reads the previous chunk's last
    # state where it was written, instead of copying it out of a buffer about to be refilled.
    state_bufs = (torch.empty(buf_shape, dtype=f, device=x.device),
                  torch.empty(buf_shape, dtype=f, device=x.device))

    for c0 in range(0, per_group, block_channels):
        c1 = min(per_group, c0 + block_channels)
        width = c1 - c0
        A_blk = A3[:, c0:c1]
        bias_blk = None if bias2 is None else bias2[:, c0:c1]
        h_blk = h[:, :, c0:c1]
        prev = h_blk
        for chunk, t0 in enumerate(range(0, seq, block_steps)):
            t1 = min(seq, t0 + block_steps)
            steps = t1 - t0
            dt_c = _discretize_dt(dt4[:, t0:t1, :, c0:c1], bias_blk, dt_softplus, dt_min, dt_max, f)
            decay = decay_buf[:, :steps, :, :width]
            states = state_bufs[chunk % 2][:, :steps, :, :width]
            torch.mul(dt_c.unsqueeze(-1), A_blk, out=decay)
            decay.exp_()
            # dt x [b, T, g, w, 1] times B [b, T, g, 1, n]: the inputs dt_t B_t x_t.
            torch.mul(torch.mul(dt_c, x4[:, t0:t1, :, c0:c1]).unsqueeze(-1),
                      B[:, t0:t1].unsqueeze(3), out=states)
            for t in range(steps):
                cur = states[:, t]
                cur.addcmul_(decay[:, t], prev)  # h_t = dA_t h_{t-1} + dt_t B_t x_t, in place
                prev = cur
            # y_t = C_t . h_t for the whole block, as one einsum rather than a matmul of
            # [b, T, g, w, n] @ [b, T, g, n, 1] (a batch of matrix-vector products).
            y4[:, t0:t1, :, c0:c1] = torch.einsum("btgwn,btgn->btgw", states, C[:, t0:t1].to(f))
        h_blk.copy_(prev)

    if D is not None:
        y_bld.addcmul_(x.to(f), D.to(f))
    if z is not None:
        y_bld.mul_(F.silu(z.to(f)))
    state = h.flatten(1, 2) if return_state else None
    return y.to(x.dtype), state


class LiveRows:
    """The pool rows a state update touches: rows 0..batch-1 without slots; else the rows the
    non-negative slots name (a negative slot is padding: its y is 0 and no pool row is read or
    written). Selecting them is data-dependent, a host sync per call on CUDA: acceptable for
    this fallback backend, and the only way to leave padding rows' slots untouched."""

    def __init__(self, state: torch.Tensor, slots: torch.Tensor | None):
        self.state = state
        self.live = None if slots is None else torch.nonzero(slots >= 0).squeeze(1)
        self.pool = None if slots is None else slots.index_select(0, self.live).to(torch.int64)

    def state_rows(self, f: torch.dtype) -> torch.Tensor:
        """The touched rows in the compute dtype: the caller's tensor itself where it can be."""
        return self.state.to(f) if self.pool is None else self.state.index_select(0, self.pool).to(f)

    def select(self, t: torch.Tensor | None) -> torch.Tensor | None:
        """A per-row argument's live rows."""
        return t if t is None or self.live is None else t.index_select(0, self.live)

    def write_back(self, h: torch.Tensor) -> None:
        if self.pool is not None:
            self.state.index_copy_(0, self.pool, h.to(self.state.dtype))
        elif h is not self.state:
            self.state.copy_(h)

    def full_rows(self, out: torch.Tensor, batch: int) -> torch.Tensor:
        """y for every batch row from the live rows' `out`: zeros at padding rows."""
        if self.live is None:
            return out
        y = out.new_zeros((batch, *out.shape[1:]))
        y.index_copy_(0, self.live, out)
        return y


def selective_state_update(state, x, dt, A, B, C, *, D, z, dt_bias, dt_softplus, dt_min, dt_max,
                           slots):
    """Arguments as normalised by `scan_kernels._args.check_state_update` (B, C with a groups axis).
    Updates `state` in place at rows `slots` (rows 0..batch-1 when None); a negative slot is a
    padding row: its y is 0 and no state row is touched."""
    f = _compute_dtype(x)
    batch, dim = x.shape
    groups = B.shape[1]
    per_group = dim // groups

    rows = LiveRows(state, slots)
    h = rows.state_rows(f)
    x, dt, B, C, z = (rows.select(t) for t in (x, dt, B, C, z))

    dt_f = _discretize_dt(dt, dt_bias, dt_softplus, dt_min, dt_max, f)
    h4 = h.unflatten(1, (groups, per_group))  # [r, g, dg, n], a view: updates land in h
    decay = torch.mul(dt_f.unflatten(1, (groups, per_group)).unsqueeze(-1),
                      A.to(f).unflatten(0, (groups, per_group)))
    decay.exp_()
    h4.mul_(decay)
    h4.addcmul_(torch.mul(dt_f, x).unflatten(1, (groups, per_group)).unsqueeze(-1),
                B.unsqueeze(2))
    out = torch.einsum("rgwn,rgn->rgw", h4, C.to(f)).flatten(1)  # [r, dim]; see the scan's einsum
    if D is not None:
        out.addcmul_(x.to(f), D.to(f))
    if z is not None:
        out.mul_(F.silu(z.to(f)))

    rows.write_back(h)
    return rows.full_rows(out.to(x.dtype), batch)


def _autograd_backward(ref_backward):
    """The compact autograd form: torch.autograd through the step-by-step transcription
    (scan_kernels/reference.py) in the compute dtype rather than float64. Autograd keeps every step's
    state: memory grows with batch x seq x dim x state, unlike the cpu backend's."""

    def backward(dy, x, *args, **kwargs):
        return ref_backward(dy, x, *args, **kwargs, compute_dtype=_compute_dtype(x))

    return backward


def load_backend() -> Backend:
    from . import eager_ssd  # imported here: it takes its dt discretisation from this module
    from .reference import selective_scan_backward_ref, ssd_scan_backward_ref

    return Backend(
        name="torch",
        scan=selective_scan,
        state_update=selective_state_update,
        ssd_scan=eager_ssd.ssd_scan,
        ssd_state_update=eager_ssd.ssd_state_update,
        device_types=frozenset({"cpu", "cuda"}),
        details={"block_bytes": _BLOCK_BYTES},
        scan_backward=_autograd_backward(selective_scan_backward_ref),
        ssd_scan_backward=_autograd_backward(ssd_scan_backward_ref),
    )
