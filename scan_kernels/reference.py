"""The oracle: a direct transcription of the recurrence, one timestep at a time.

Slow by design and easy to check by eye. `compute_dtype=torch.float64` gives a high-precision
answer to test the fast backends against. It handles every option and both layouts by first
viewing the inputs in the "bld" layout.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._registry import Backend


def _discretize_dt(dt, dt_bias, dt_softplus, dt_min, dt_max, f):
    dt = dt.to(f)
    if dt_bias is not None:
        dt = dt + dt_bias.to(f)
    if dt_softplus:
        dt = F.softplus(dt)
    if dt_min is not None or dt_max is not None:
        dt = dt.clamp(min=dt_min, max=dt_max)
    return dt


def _compute_dtype(x, compute_dtype):
    if compute_dtype is not None:
        return compute_dtype
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def selective_scan_ref(x, dt, A, B, C, *, D=None, z=None, dt_bias=None, dt_softplus=False,
                       dt_min=None, dt_max=None, h0=None, return_state=False, layout="bld",
                       compute_dtype=None):
    """B, C: 4-D with a groups axis ([b, l, g, n] for "bld", [b, g, n, l] for "bdl"); 3-D
    is accepted too. Returns (y, state) where state is None unless return_state."""
    f = _compute_dtype(x, compute_dtype)
    out_dtype = x.dtype
    if layout == "bdl":
        x, dt = x.transpose(1, 2), dt.transpose(1, 2)
        z = None if z is None else z.transpose(1, 2)
        B = B.permute(0, 3, 1, 2) if B.dim() == 4 else B.transpose(1, 2)
        C = C.permute(0, 3, 1, 2) if C.dim() == 4 else C.transpose(1, 2)
    if B.dim() == 3:
        B, C = B.unsqueeze(2), C.unsqueeze(2)
    batch, seq, dim = x.shape
    state_size = A.shape[1]
    per_group = dim // B.shape[2]
    xf = x.to(f)
    dtf = _discretize_dt(dt, dt_bias, dt_softplus, dt_min, dt_max, f)
    Af = A.to(f)
    Bf = B.to(f).repeat_interleave(per_group, dim=2)  # [b, l, d, n]
    Cf = C.to(f).repeat_interleave(per_group, dim=2)
    h = torch.zeros(batch, dim, state_size, dtype=f, device=x.device) if h0 is None else h0.to(f).clone()
    ys = []
    # Per-step operands by unbind rather than indexing: under autograd (the reference and torch
    # backward passes) an indexed slice's gradient is a whole zero-filled tensor per step.
    for dt_t, B_t, C_t, x_t in zip(dtf.unbind(1), Bf.unbind(1), Cf.unbind(1), xf.unbind(1)):
        dt_t = dt_t[:, :, None]
        h = torch.exp(dt_t * Af) * h + dt_t * B_t * x_t[:, :, None]
        ys.append((h * C_t).sum(-1))
    y = torch.stack(ys, dim=1)
    if D is not None:
        y = y + xf * D.to(f)
    if z is not None:
        y = y * F.silu(z.to(f))
    y = y.to(out_dtype)
    if layout == "bdl":
        y = y.transpose(1, 2)
    return y, (h if return_state else None)


def selective_state_update_ref(state, x, dt, A, B, C, *, D=None, z=None, dt_bias=None,
                               dt_softplus=False, dt_min=None, dt_max=None, slots=None,
                               compute_dtype=None):
    """state [pool, dim, n] updated in place at rows `slots` (or rows 0..batch-1); x, dt, z
    [batch, dim]; B, C [batch, groups, n] or [batch, n]. Rows whose slot is negative are
    padding: y is 0 there and no state row is touched."""
    f = _compute_dtype(x, compute_dtype)
    if B.dim() == 2:
        B, C = B.unsqueeze(1), C.unsqueeze(1)
    batch, dim = x.shape
    per_group = dim // B.shape[1]
    if slots is None:
        rows = torch.arange(batch, device=x.device)
        live = torch.ones(batch, dtype=torch.bool, device=x.device)
    else:
        rows = slots.to(torch.int64)
        live = rows >= 0
    y = torch.zeros(batch, dim, dtype=x.dtype, device=x.device)
    if not bool(live.any()):
        return y
    idx = rows[live]
    h = state[idx].to(f)
    xf = x[live].to(f)
    dtf = _discretize_dt(dt[live], dt_bias, dt_softplus, dt_min, dt_max, f)[..., None]
    Bf = B[live].to(f).repeat_interleave(per_group, dim=1)
    Cf = C[live].to(f).repeat_interleave(per_group, dim=1)
    h = torch.exp(dtf * A.to(f)) * h + dtf * Bf * xf[..., None]
    out = (h * Cf).sum(-1)
    if D is not None:
        out = out + xf * D.to(f)
    if z is not None:
        out = out * F.silu(z[live].to(f))
    state[idx] = h.to(state.dtype)
    y[live] = out.to(x.dtype)
    return y


def ssd_scan_ref(x, dt, A, B, C, *, D=None, z=None, dt_bias=None, dt_softplus=False, dt_min=None,
                 dt_max=None, h0=None, return_state=False, chunk_size=None, compute_dtype=None):
    """Mamba-2 (SSD): x, z [b, l, h, p]; dt [b, l, h]; A, dt_bias [h]; B, C [b, l, g, n]; D [h]
    or [h, p]; h0 [b, h, p, n]. The recurrence one timestep at a time (chunk_size changes
    nothing here). Returns (y, state) where state is None unless return_state."""
    f = _compute_dtype(x, compute_dtype)
    batch, seq, heads, headdim = x.shape
    per_group = heads // B.shape[2]
    xf = x.to(f)
    dtf = _discretize_dt(dt, dt_bias, dt_softplus, dt_min, dt_max, f)  # [b, l, h]
    Af = A.to(f)
    Bf = B.to(f).repeat_interleave(per_group, dim=2)  # [b, l, h, n]
    Cf = C.to(f).repeat_interleave(per_group, dim=2)
    h = (torch.zeros(batch, heads, headdim, B.shape[3], dtype=f, device=x.device) if h0 is None
         else h0.to(f).clone())
    ys = []
    for dt_t, B_t, C_t, x_t in zip(dtf.unbind(1), Bf.unbind(1), Cf.unbind(1), xf.unbind(1)):  # as above
        dt_t = dt_t[:, :, None, None]  # [b, h, 1, 1]
        h = torch.exp(dt_t * Af[:, None, None]) * h + dt_t * x_t[:, :, :, None] * B_t[:, :, None, :]
        ys.append((h * C_t[:, :, None, :]).sum(-1))
    y = torch.stack(ys, dim=1)  # [b, l, h, p]
    if D is not None:
        y = y + xf * (D.to(f) if D.dim() == 2 else D.to(f)[:, None])
    if z is not None:
        y = y * F.silu(z.to(f))
    return y.to(x.dtype), (h if return_state else None)


def ssd_state_update_ref(state, x, dt, A, B, C, *, D=None, z=None, dt_bias=None, dt_softplus=False,
                         dt_min=None, dt_max=None, slots=None, compute_dtype=None):
    """state [pool, h, p, n] updated in place at rows `slots` (or rows 0..batch-1); x, z
    [batch, h, p]; dt [batch, h]; B, C [batch, g, n]. A negative slot is a padding row: y is 0
    there and no state row is touched."""
    f = _compute_dtype(x, compute_dtype)
    batch, heads, headdim = x.shape
    per_group = heads // B.shape[1]
    rows = torch.arange(batch, device=x.device) if slots is None else slots.to(torch.int64)
    live = rows >= 0
    y = torch.zeros_like(x)
    if not bool(live.any()):
        return y
    idx = rows[live]
    h = state[idx].to(f)
    xf = x[live].to(f)
    dtf = _discretize_dt(dt[live], dt_bias, dt_softplus, dt_min, dt_max, f)[:, :, None, None]
    Bf = B[live].to(f).repeat_interleave(per_group, dim=1)[:, :, None, :]  # [r, h, 1, n]
    Cf = C[live].to(f).repeat_interleave(per_group, dim=1)[:, :, None, :]
    h = torch.exp(dtf * A.to(f)[:, None, None]) * h + dtf * xf[..., None] * Bf
    out = (h * Cf).sum(-1)
    if D is not None:
        out = out + xf * (D.to(f) if D.dim() == 2 else D.to(f)[:, None])
    if z is not None:
        out = out * F.silu(z[live].to(f))
    state[idx] = h.to(state.dtype)
    y[live] = out.to(x.dtype)
    return y


def selective_scan_backward_ref(dy, x, dt, A, B, C, *, D, z, dt_bias, dt_softplus, dt_min, dt_max, h0,
                                dstate, layout, compute_dtype=torch.float64):
    """Gradients by autograd through `selective_scan_ref` in float64: the oracle."""
    from .backward import autograd_backward

    return autograd_backward(selective_scan_ref, compute_dtype, dy, dstate,
                             dict(x=x, dt=dt, A=A, B=B, C=C, D=D, z=z, dt_bias=dt_bias, h0=h0),
                             dict(dt_softplus=dt_softplus, dt_min=dt_min, dt_max=dt_max, layout=layout))


def ssd_scan_backward_ref(dy, x, dt, A, B, C, *, D, z, dt_bias, dt_softplus, dt_min, dt_max, h0, dstate,
                          chunk_size, compute_dtype=torch.float64):
    """Gradients by autograd through `ssd_scan_ref` in float64: the oracle."""
    from .backward import autograd_backward

    return autograd_backward(ssd_scan_ref, compute_dtype, dy, dstate,
                             dict(x=x, dt=dt, A=A, B=B, C=C, D=D, z=z, dt_bias=dt_bias, h0=h0),
                             dict(dt_softplus=dt_softplus, dt_min=dt_min, dt_max=dt_max))


def load_backend() -> Backend:
    return Backend(
        name="reference",
        scan=selective_scan_ref,
        state_update=selective_state_update_ref,
        ssd_scan=ssd_scan_ref,
        ssd_state_update=ssd_state_update_ref,
        device_types=frozenset({"cpu", "cuda"}),
        scan_backward=selective_scan_backward_ref,
        ssd_scan_backward=ssd_scan_backward_ref,
    )
