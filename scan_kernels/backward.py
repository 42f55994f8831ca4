"""Gradients of the selective scan (Mamba-1) and of the SSD scan (Mamba-2).

    selective_scan_backward(dy, x, dt, A, B, C, *, D=None, z=None, dt_bias=None, dt_softplus=False,
                            dt_min=None, dt_max=None, h0=None, dstate=None, layout="bld",
                            cu_seqlens=None, backend=None) -> {"x": dx, "dt": ddt, ...}
    ssd_scan_backward(dy, x, dt, A, B, C, *, ..., h0=None, dstate=None, cu_seqlens=None,
                      seq_idx=None, chunk_size=None, backend=None) -> {"x": dx, ...}

dy is the gradient of the loss with respect to y (x's shape), dstate (optional) that with respect
to the final state the forward returns. The result holds one gradient per input given, keyed by
the input's name: x, dt, A, B, C always, D, z, dt_bias and h0 when they were given. Each has its
input's shape (a 3-D B gets a 3-D dB, a [heads] D a [heads] dD); A's, D's and dt_bias's are in the
compute dtype (fp32; fp64 for fp64 x), the others in their inputs' dtypes. softplus and the
clamp differentiate as torch's do: the clamp passes no gradient where dt lies outside it.

`scan_kernels.selective_scan` and `scan_kernels.ssd_scan` go through `ScanFunction` (a
torch.autograd.Function) when grad mode is on and an input requires grad, so their outputs
(y and the returned state) backpropagate through these functions.

Backends implement `scan_backward` / `ssd_scan_backward` over arguments normalised by
scan_kernels._args (4-D B and C; D [heads, headdim] for SSD) and return every gradient in the compute
dtype: "reference" by autograd through the float64 transcription (the oracle), "torch" by
autograd through the same step-by-step form in the compute dtype, "cpu" by its C++ reverse scan.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import _args, _varlen
from ._args import _check_devices, _require_shape, _require_tensor
from ._registry import get_backend

# The inputs that take gradients, in the order of the forward's positional arguments and then
# its optional tensors.
GRAD_INPUTS = ("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "h0")
# Gradients kept in the compute dtype rather than their input's (weights accumulated over the
# whole batch and sequence).
COMPUTE_DTYPE_GRADS = ("A", "D", "dt_bias")


def _check_cotangent(name: str, t, like: torch.Tensor, meaning: str) -> torch.Tensor:
    t = _require_tensor(name, t)
    _require_shape(name, t, tuple(like.shape), meaning)
    _check_devices({"x": like, name: t})
    return t


def _finish(grads: dict, given: dict, compute: torch.dtype) -> dict:
    """Backend gradients (compute dtype, normalised shapes) as the public result: each present
    exactly when its input was given, in its input's shape and the promised dtype."""
    out = {}
    for name in GRAD_INPUTS:
        original = given.get(name)
        if original is None:
            continue
        g = grads[name]
        if g.shape != original.shape:
            # A [heads] D was normalised to [heads, headdim]; a 3-D B or C got a groups axis.
            g = g.sum(1) if name == "D" else g.reshape(original.shape)
        out[name] = g.to(compute if name in COMPUTE_DTYPE_GRADS else original.dtype)
    return out


# The backward builds no graph (ScanFunction.backward refuses a second derivative): inputs that
# require grad gave gradients with a partial one (the Triton backend's chain rule through dt).
@torch.no_grad()
def _gradients(one, args, dy, *, h0, dstate, cu_seqlens, packs: bool, given: dict, seq_axis: int, bc_axis: int,
               state_shape: tuple[int, ...], state_meaning: str) -> dict:
    """`one(dy, x, dt, B, C, z, h0, dstate)` (a backend's backward, the rest bound) over the
    whole call, packed sequences and their boundaries (`cu_seqlens=` int64) included where the
    backend `packs` them, else once per packed sequence, as the public result."""
    if cu_seqlens is not None and packs:
        packed = _varlen.packed_arguments(args, seq_axis=seq_axis, h0=h0, cu_seqlens=cu_seqlens,
                                          state_shape=state_shape, state_meaning=state_meaning, dstate=dstate)
        grads = one(dy, args.x, args.dt, args.B, args.C, args.z, packed["h0"], packed.get("dstate"),
                    cu_seqlens=packed["cu_seqlens"])
    elif cu_seqlens is not None:
        grads = _varlen.run_packed_backward(one, args, dy, h0=h0, dstate=dstate, cu_seqlens=cu_seqlens,
                                            seq_axis=seq_axis, bc_axis=bc_axis, state_shape=state_shape,
                                            state_meaning=state_meaning)
    else:
        if dstate is not None:
            _require_shape("dstate", _require_tensor("dstate", dstate), (args.dims.batch, *state_shape),
                           f"[batch, {state_meaning}]")
            _check_devices(dict(x=args.x, dstate=dstate))
        grads = one(dy, args.x, args.dt, args.B, args.C, args.z, args.h0, dstate)
    return _finish(grads, given, _compute_dtype(args.x))


def selective_scan_backward(dy, x, dt, A, B, C, *, D=None, z=None, dt_bias=None, dt_softplus=False,
                            dt_min=None, dt_max=None, h0=None, dstate=None, layout="bld",
                            cu_seqlens=None, backend=None) -> dict:
    packed = cu_seqlens is not None
    args = _args.check_scan(x, dt, A, B, C, D=D, z=z, dt_bias=dt_bias, dt_softplus=dt_softplus,
                            dt_min=dt_min, dt_max=dt_max, h0=None if packed else h0, layout=layout)
    dy = _check_cotangent("dy", dy, args.x, "same as x")
    d = args.dims
    impl = get_backend(backend, args.x.device.type, capability="scan_backward")
    options = dict(D=args.D, dt_bias=args.dt_bias, dt_softplus=args.dt_softplus, dt_min=args.dt_min,
                   dt_max=args.dt_max, layout=args.layout)

    def one(dy, x, dt, B, C, z, h0, dstate, **packed):
        return impl.scan_backward(dy, x, dt, args.A, B, C, z=z, h0=h0, dstate=dstate, **options, **packed)

    bld = layout == "bld"
    return _gradients(one, args, dy, h0=h0, dstate=dstate, cu_seqlens=cu_seqlens,
                      packs="scan_backward" in impl.packs_sequences,
                      given=dict(x=x, dt=dt, A=A, B=B, C=C, D=D, z=z, dt_bias=dt_bias, h0=h0),
                      seq_axis=1 if bld else 2, bc_axis=1 if bld else 3, state_shape=(d.dim, d.state),
                      state_meaning="dim, state")


def ssd_scan_backward(dy, x, dt, A, B, C, *, D=None, z=None, dt_bias=None, dt_softplus=False, dt_min=None,
                      dt_max=None, h0=None, dstate=None, cu_seqlens=None, seq_idx=None, chunk_size=None,
                      backend=None) -> dict:
    if seq_idx is not None:
        cu_seqlens = _args.cu_seqlens_of_seq_idx(seq_idx, cu_seqlens, x)
    packed = cu_seqlens is not None
    args = _args.check_ssd_scan(x, dt, A, B, C, D=D, z=z, dt_bias=dt_bias, dt_softplus=dt_softplus,
                                dt_min=dt_min, dt_max=dt_max, h0=None if packed else h0, chunk_size=chunk_size)
    dy = _check_cotangent("dy", dy, args.x, "same as x")
    d = args.dims
    impl = get_backend(backend, args.x.device.type, capability="ssd_scan_backward")
    options = dict(D=args.D, dt_bias=args.dt_bias, dt_softplus=args.dt_softplus, dt_min=args.dt_min,
                   dt_max=args.dt_max, chunk_size=args.chunk_size)

    def one(dy, x, dt, B, C, z, h0, dstate, **packed):
        return impl.ssd_scan_backward(dy, x, dt, args.A, B, C, z=z, h0=h0, dstate=dstate, **options, **packed)

    return _gradients(one, args, dy, h0=h0, dstate=dstate, cu_seqlens=cu_seqlens,
                      packs="ssd_scan_backward" in impl.packs_sequences,
                      given=dict(x=x, dt=dt, A=A, B=B, C=C, D=D, z=z, dt_bias=dt_bias, h0=h0),
                      seq_axis=1, bc_axis=1, state_shape=(d.heads, d.headdim, d.state),
                      state_meaning="heads, headdim, state")


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


# --- autograd through a differentiable forward (the reference and torch backends) -----------


def autograd_backward(forward, compute: torch.dtype, dy, dstate, tensors: dict, options: dict) -> dict:
    """Gradients of `forward(**tensors, **options, return_state=..., compute_dtype=compute)`
    (a reference-style function returning (y, state)) by torch.autograd, every input taken as
    a `compute` leaf: the gradients come out in `compute`. An input the output does not depend
    on gets zeros. Under torch.inference_mode too (as the C++ backward runs there): the graph is
    built outside it, from copies of any inference tensors (they cannot require grad)."""
    with torch.inference_mode(False), torch.enable_grad():
        leaves = {name: t.detach().to(compute, copy=t.is_inference()).requires_grad_(True)
                  for name, t in tensors.items() if t is not None}
        y, state = forward(**{name: leaves.get(name) for name in tensors}, **options,
                           return_state=dstate is not None, compute_dtype=compute)
        outputs, cotangents = [y], [dy.to(compute)]
        if dstate is not None:
            outputs.append(state)
            cotangents.append(dstate.to(compute))
        got = torch.autograd.grad(outputs, list(leaves.values()), cotangents, allow_unused=True)
    return {name: torch.zeros_like(leaves[name]) if g is None else g for name, g in zip(leaves, got)}


# --- what the C++ and Triton backward passes share -----------------------------------------


def discretize_backward(ddelta, dt, dt_bias, dt_softplus, dt_min, dt_max, f):
    """(ddt, ddt_bias or None) from `ddelta`, the gradient with respect to the discretized dt
    (compute dtype f, overwritten: it becomes ddt), through dt + bias, softplus (threshold 20)
    and the clamp as torch differentiates them: the clamp passes the gradient only where its
    input lies within the bounds (NaN: nowhere)."""
    raw = dt.to(f)
    if dt_bias is not None:
        raw = raw + dt_bias.to(f)
    grad = ddelta
    if dt_min is not None or dt_max is not None:
        clamped_input = F.softplus(raw) if dt_softplus else raw
        inside = clamped_input >= dt_min if dt_min is not None else None
        if dt_max is not None:
            inside = clamped_input <= dt_max if inside is None else inside.logical_and_(clamped_input <= dt_max)
        grad.masked_fill_(~inside, 0)  # selected, as torch.clamp's: an infinite grad times 0 is NaN
        del clamped_input, inside
    if dt_softplus:
        grad.mul_(torch.sigmoid(raw).masked_fill_(raw > 20, 1))
    dbias = None if dt_bias is None else grad.sum(dim=tuple(range(grad.dim() - 1)))
    return grad, dbias


def bdl_layout(grads: dict) -> dict:
    """Gradients computed over "bld" views of "bdl" inputs, as views in the "bdl" layout."""
    for name in ("x", "dt", "z"):
        if grads[name] is not None:
            grads[name] = grads[name].transpose(1, 2)
    grads["B"], grads["C"] = grads["B"].permute(0, 2, 3, 1), grads["C"].permute(0, 2, 3, 1)
    return grads


# --- scan_kernels.selective_scan / scan_kernels.ssd_scan under autograd --------------------------------


@dataclass(frozen=True)
class ScanSpec:
    """What a differentiable call needs besides its tensors: which scan, and its options."""

    ssd: bool
    options: tuple  # (name, value) pairs: dt_softplus, dt_min, dt_max, layout or chunk_size, ...
    cu_seqlens: torch.Tensor | None
    backend: str | None

    def kwargs(self) -> dict:
        return dict(self.options, cu_seqlens=self.cu_seqlens, backend=self.backend)


def wants_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)


class ScanFunction(torch.autograd.Function):
    """y and the final state of a scan, differentiable in every tensor input."""

    @staticmethod
    def forward(ctx, spec: ScanSpec, x, dt, A, B, C, D, z, dt_bias, h0):
        from . import selective_scan, ssd_scan  # the public forward, run without autograd here

        scan = ssd_scan if spec.ssd else selective_scan
        y, state = scan(x, dt, A, B, C, D=D, z=z, dt_bias=dt_bias, h0=h0, return_state=True, **spec.kwargs())
        # The backward reads the boundaries the forward ran on, whatever the caller refills its
        # buffer with meanwhile (a copy: a few ints).
        ctx.spec = spec if spec.cu_seqlens is None else dataclasses.replace(spec, cu_seqlens=spec.cu_seqlens.clone())
        ctx.save_for_backward(x, dt, A, B, C, D, z, dt_bias, h0)
        ctx.set_materialize_grads(False)
        return y, state

    @staticmethod
    def backward(ctx, dy, dstate):
        # Grad mode is on here only under create_graph=True. The backward kernels build no graph
        # of their own, so a second derivative through them would silently be zero.
        if torch.is_grad_enabled():
            raise RuntimeError("kernels: the scans are differentiable once: their backward pass builds no graph, "
                               "so create_graph=True (a second derivative through them) is not supported")
        x, dt, A, B, C, D, z, dt_bias, h0 = ctx.saved_tensors
        spec = ctx.spec
        if dy is None:
            dy = torch.zeros_like(x)
        backward = ssd_scan_backward if spec.ssd else selective_scan_backward
        grads = backward(dy, x, dt, A, B, C, D=D, z=z, dt_bias=dt_bias, h0=h0, dstate=dstate, **spec.kwargs())
        tensors = dict(x=x, dt=dt, A=A, B=B, C=C, D=D, z=z, dt_bias=dt_bias, h0=h0)
        return (None, *(grads.get(name) if needed and tensors[name] is not None else None
                        for name, needed in zip(GRAD_INPUTS, ctx.needs_input_grad[1:])))
