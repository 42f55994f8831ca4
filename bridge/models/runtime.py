"""A loaded Mamba or Mamba-2 model, run a sequence (prefill) or a timestep at a time over state
rows kept elsewhere (the server's pool): every layer's conv window and ssm state.

Each block is transformers' MambaBlock / Mamba2Block: RMSNorm, the mixer, the residual added
(kept in fp32 where the config says); the mixer is in_proj, a causal depthwise conv1d and SiLU,
then Mamba-1's x_proj/dt_proj and selective scan, or Mamba-2's split of x, B, C, dt, its SSD
scan and gated RMSNorm; out_proj last. Every scan and state update goes through `scan_kernels`, so a
model runs on whichever backend the server serves. Nothing here knows of the wire.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import scan_kernels

from .config import ModelConfig, layer_state_names
from .weights import EMBEDDINGS, LM_HEAD

# Per-channel constants and the conv kept in fp32 whatever the weights' dtype: the kernels take
# them so, and the conv's window is fp32 state. A is -exp(A_log), computed once at load.
FP32_TENSORS = ("A_log", "D", "dt_bias", "dt_proj.bias", "conv1d.weight", "conv1d.bias")
# The weight dtypes the backends' fused model step reads (scan_kernels.model_step_kernel); state and
# activations are fp32 in it whatever they are.
FUSED_STEP_DTYPES = (torch.float32, torch.bfloat16)
# A prefill longer than this many rows x positions x the config's position_width runs as
# several, each from the state the one before left: its activations, a few buffers of at most
# that width a position, are held to a bound whatever window a request sends, where one pass
# let a small request of many tokens take gigabytes (docs/performance.md, "prefill passes").
# Ordinary windows are one pass.
PREFILL_PASS_ELEMENTS = 1 << 23
# Passes start at multiples of this many positions: the chunked SSD scan's chunks (up to 256)
# then fall where one pass's would.
PREFILL_PASS_ALIGN = 256


def param_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype a tensor is kept in when a model is loaded in `dtype` (f64, for tests, keeps all)."""
    if dtype != torch.float64 and name.rsplit(".mixer.", 1)[-1] in FP32_TENSORS:
        return torch.float32
    return dtype


@dataclass
class Layer:
    norm: torch.Tensor
    in_proj: torch.Tensor
    in_proj_bias: torch.Tensor | None
    conv: torch.Tensor  # [conv_dim, d_conv], at least fp32
    conv_bias: torch.Tensor | None
    A: torch.Tensor  # fp32: [d_inner, d_state] or [nheads]
    D: torch.Tensor  # fp32
    dt_bias: torch.Tensor  # fp32: dt_proj.bias (Mamba-1) or dt_bias (Mamba-2)
    out_proj: torch.Tensor
    out_proj_bias: torch.Tensor | None
    x_proj: torch.Tensor | None = None  # Mamba-1
    dt_proj: torch.Tensor | None = None  # Mamba-1
    gate_norm: torch.Tensor | None = None  # Mamba-2


class Model:
    """Weights on a device in one dtype (f32, bf16, f16; f64 for tests), state in fp32."""

    def __init__(self, config: ModelConfig, tensors: dict[str, torch.Tensor]):
        """`tensors`: by canonical name (bridge.models.weights), already converted and on the device."""
        self.config = config
        self.nbytes = sum(t.nbytes for t in tensors.values())
        self.dtype = tensors["norm_f.weight"].dtype
        self.device = tensors["norm_f.weight"].device
        self.norm_f = tensors["norm_f.weight"]
        self.embeddings = tensors.get(EMBEDDINGS)
        self.lm_head = self.embeddings if config.lm_head == "tied" else tensors.get(LM_HEAD)
        self.layers = [self._layer(tensors, f"layers.{i}.") for i in range(config.n_layer)]
        dt_min, dt_max = scan_kernels.dt_limit_bounds(config.dt_limit)
        self.dt_limits = {"dt_min": dt_min, "dt_max": dt_max}
        # What the backend's fused step takes that never changes: the sizes, and each layer's
        # weights in its order (the pool's parts follow them per call: they move when it grows).
        # It reads the matrices as they are, fp32 or bf16 (half the bytes a paced step streams),
        # and the norms and biases in fp32: copies, for a bf16 model.
        self._fused_dims = [0 if config.arch == "mamba" else 1, config.d_inner, config.d_state, config.dt_rank,
                            config.nheads, config.headdim, config.ngroups]
        self._fused = self.dtype in FUSED_STEP_DTYPES
        self._steps_fused = self._fused and self.device.type == "cpu"  # the fused kernel is the CPU's
        if self._fused:
            self._fused_weights = [[_wide(layer.norm), layer.in_proj, _wide(layer.in_proj_bias), layer.conv,
                                    layer.conv_bias, layer.A, layer.D, layer.dt_bias, layer.out_proj,
                                    _wide(layer.out_proj_bias), layer.x_proj, layer.dt_proj, _wide(layer.gate_norm)]
                                   for layer in self.layers]
            self._fused_norm_f = _wide(self.norm_f)

    def _layer(self, t: dict, prefix: str) -> Layer:
        m = prefix + "mixer."
        mamba1 = self.config.arch == "mamba"
        return Layer(
            norm=t[prefix + "norm.weight"], in_proj=t[m + "in_proj.weight"], in_proj_bias=t.get(m + "in_proj.bias"),
            conv=_wide(t[m + "conv1d.weight"][:, 0, :]), conv_bias=_wide(t.get(m + "conv1d.bias")),
            A=-torch.exp(_wide(t[m + "A_log"])), D=t[m + "D"],
            dt_bias=t[m + ("dt_proj.bias" if mamba1 else "dt_bias")],
            out_proj=t[m + "out_proj.weight"], out_proj_bias=t.get(m + "out_proj.bias"),
            x_proj=t.get(m + "x_proj.weight"), dt_proj=t.get(m + "dt_proj.weight"),
            gate_norm=t.get(m + "norm.weight"))

    @property
    def arch(self) -> str:
        return self.config.arch

    # -- the stack ----------------------------------------------------------------------

    def forward(self, parts: dict[str, torch.Tensor], slots: torch.Tensor, inputs: torch.Tensor, *,
                output: str, last_only: bool = False, backend: str | None = None,
                lengths: torch.Tensor | None = None, fused: bool = True) -> torch.Tensor:
        """A prefill of `inputs` (tokens [b, l] or embeddings [b, l, d_model]) from the state in
        rows `slots` of `parts`, which are left holding the state at the end; the scan runs once
        per layer over the whole sequence (a long one in passes: PREFILL_PASS_ELEMENTS).
        `lengths` ([b] ints in 0 .. l, on the host): row i runs only its first lengths[i]
        positions, its state left after them, its outputs past them zero; with `last_only`, its
        output is its own last position's. In one call where
        the backend has a fused prefill (as `step`'s fused step; `fused=False` composes it)."""
        if lengths is not None and bool((lengths != inputs.shape[1]).any()):
            return self._forward_ragged(parts, slots, inputs, lengths, output=output, last_only=last_only,
                                        backend=backend, fused=fused)
        per_pass = self.prefill_pass_positions(inputs.shape[0])
        if inputs.shape[1] > per_pass:
            return self._forward_in_passes(parts, slots, inputs, per_pass, output=output, last_only=last_only,
                                           backend=backend, fused=fused)
        kernel = self._fused_kernel(parts, backend, scan_kernels.model_forward_kernel) if fused else None
        if kernel is not None:
            return self._call_fused(kernel, parts, slots, inputs, output, copy=False, last_only=last_only)
        product = self._product(backend)
        hidden = self._embed(inputs)
        for i, layer in enumerate(self.layers):
            conv, ssm = (parts[name] for name in layer_state_names(i))
            hidden = self._block(layer, hidden, lambda h, layer=layer, conv=conv, ssm=ssm:
                                 self._mixer_seq(layer, h, conv, ssm, slots, backend, product))
        if last_only:
            hidden = hidden[:, -1:]
        return self._output(hidden, output)

    def prefill_pass_positions(self, rows: int) -> int:
        """The most positions one prefill pass of `rows` rows runs (PREFILL_PASS_ELEMENTS)."""
        positions = PREFILL_PASS_ELEMENTS // max(1, rows * self.config.position_width)
        return max(PREFILL_PASS_ALIGN, positions - positions % PREFILL_PASS_ALIGN)

    def _forward_in_passes(self, parts, slots, inputs, per_pass: int, *, output, last_only, backend,
                           fused) -> torch.Tensor:
        """forward() as passes of `per_pass` positions, each continuing from the state the one
        before left; their outputs written into one tensor (only the last pass's last, with
        `last_only`)."""
        seq = inputs.shape[1]
        out = None
        for begin in range(0, seq, per_pass):
            end = min(seq, begin + per_pass)
            part = self.forward(parts, slots, inputs[:, begin:end], output=output, last_only=last_only,
                                backend=backend, fused=fused)
            if last_only:
                out = part
                continue
            if out is None:
                out = part.new_empty((part.shape[0], seq, *part.shape[2:]))
            out[:, begin:end] = part
        return out

    def _forward_ragged(self, parts, slots, inputs, lengths, *, output, last_only, backend, fused) -> torch.Tensor:
        """forward() with rows of several lengths: one prefill for the rows of each length, each
        running only its rows' own positions, their outputs placed in one zeroed tensor."""
        width = self.config.d_model if output == "hidden" else self.lm_head.shape[0]
        positions = 1 if last_only else inputs.shape[1]
        out = torch.zeros((inputs.shape[0], positions, width), device=inputs.device,
                          dtype=torch.promote_types(self.dtype, torch.float32))  # as _output's
        for length in sorted(set(lengths.tolist()) - {0}):
            rows = (lengths == length).nonzero().flatten().to(inputs.device)
            part = self.forward(parts, slots.index_select(0, rows.to(slots.device)),
                                inputs[:, :length].index_select(0, rows), output=output, last_only=last_only,
                                backend=backend, fused=fused)
            out[rows, :part.shape[1]] = part
        return out

    def step(self, parts: dict[str, torch.Tensor], slots: torch.Tensor, inputs: torch.Tensor, *,
             output: str, backend: str | None = None, fused: bool | Callable = True) -> torch.Tensor:
        """One timestep of `inputs` (tokens [b] or embeddings [b, d_model]) for rows `slots`,
        their state updated in place: in one call where the backend has a fused model step, the
        weights are fp32 or bf16 and the state fp32 (`fused=False` composes it from torch ops and
        the kernels API; a callable is the fused step to call instead of the backend's, as
        bench.model_step_ab times two builds')."""
        if callable(fused):
            kernel = fused
        else:
            kernel = self._fused_kernel(parts, backend, scan_kernels.model_step_kernel) if fused else None
        if kernel is not None:
            return self._call_fused(kernel, parts, slots, inputs, output)
        hidden = self._embed(inputs)
        for i, layer in enumerate(self.layers):
            conv, ssm = (parts[name] for name in layer_state_names(i))
            hidden = self._block(layer, hidden, lambda h, layer=layer, conv=conv, ssm=ssm:
                                 self._mixer_step(layer, h, conv, ssm, slots, backend))
        return self._output(hidden, output)

    def fused_arguments(self) -> tuple | None:
        """What a backend's fused step reads of this model, for a native caller to prepare once
        (scan_kernels/cpu/model_step.h): (each layer's weights, norm_f, dims, eps, dt_min, dt_max,
        the embedding, the head), the last two None where the model has none; None where the
        model composes its step (weights in another dtype, or not on the CPU)."""
        if not self._steps_fused:
            return None
        return (self._fused_weights, self._fused_norm_f, self._fused_dims, self.config.eps,
                self.dt_limits["dt_min"], self.dt_limits["dt_max"], self.embeddings, self.lm_head)

    def _product(self, backend: str | None) -> Callable:
        """F.linear's work for the prefill: by the backend's own product where it has one and
        takes these weights (the fused step's, fp32 products of fp32 or bf16 weights), since
        torch's CPU products of a few rows cost several times it (docs/performance.md,
        "model forward"); else F.linear."""
        kernel = scan_kernels.linear_kernel(self.device.type, backend) if self._fused else None
        if kernel is None:
            return F.linear

        def product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
            rows = x.reshape(-1, x.shape[-1]).to(torch.float32).contiguous()
            out = kernel(rows, weight, None if bias is None else bias.to(torch.float32))
            return out.view(*x.shape[:-1], weight.shape[0]).to(x.dtype)

        return product

    def _fused_kernel(self, parts: dict[str, torch.Tensor], backend: str | None, which: Callable):
        """`which` (scan_kernels.model_step_kernel or model_forward_kernel) for this model, or None where
        its step or prefill is composed."""
        if not self._steps_fused:
            return None
        if any(p.dtype != torch.float32 for p in parts.values()):
            return None
        return which(self.device.type, backend)

    def _call_fused(self, kernel: Callable, parts, slots, inputs, output: str, *, copy: bool = True,
                    **options) -> torch.Tensor:
        # The step adds the residuals into `hidden` in place: never the caller's embeddings. The
        # prefill copies them itself (`copy=False`).
        hidden = (inputs.to(torch.float32, copy=copy) if inputs.is_floating_point()
                  else self._embed(inputs).float()).contiguous()
        layers = [weights + [parts[name] for name in layer_state_names(i)]
                  for i, weights in enumerate(self._fused_weights)]
        # The head too, for logits: fp32 products of the fp32 or bf16 head, as the native path's.
        head = (self.lm_head,) if output == "logits" else ()
        return kernel(hidden, slots.to(torch.int64), layers, self._fused_norm_f, self._fused_dims,
                      self.config.eps, self.dt_limits["dt_min"], self.dt_limits["dt_max"], *head, **options)

    def _embed(self, inputs: torch.Tensor) -> torch.Tensor:
        if inputs.is_floating_point():
            return inputs.to(self.dtype)
        return F.embedding(inputs.to(torch.int64), self.embeddings)

    def _block(self, layer: Layer, hidden: torch.Tensor, mixer) -> torch.Tensor:
        residual = _wide(hidden) if self.config.residual_in_fp32 else hidden
        return residual + mixer(_rms_norm(hidden.to(self.dtype), layer.norm, self.config.eps))

    def _output(self, hidden: torch.Tensor, output: str) -> torch.Tensor:
        hidden = _rms_norm(hidden, self.norm_f, self.config.eps)
        if output == "hidden":
            return _wide(hidden)
        return _wide(F.linear(hidden.to(self.lm_head.dtype), self.lm_head))

    # -- mixers -------------------------------------------------------------------------

    def _mixer_seq(self, layer, h, conv, ssm, slots, backend, product):
        c = self.config
        projected = product(h, layer.in_proj, layer.in_proj_bias)
        h0 = ssm.index_select(0, slots)
        if c.arch == "mamba":
            x, z = projected.split(c.d_inner, dim=-1)
            x = _conv_seq(layer, x, conv, slots)
            dt, B, C = product(x, layer.x_proj, None).split([c.dt_rank, c.d_state, c.d_state], dim=-1)
            y, state = scan_kernels.selective_scan(
                x, product(dt, layer.dt_proj, None), layer.A, B, C, D=layer.D, z=z, dt_bias=layer.dt_bias,
                dt_softplus=True, h0=h0, return_state=True, backend=backend)
        else:
            z, xBC, dt = projected.split([c.d_inner, c.conv_dim, c.nheads], dim=-1)
            x, B, C = _conv_seq(layer, xBC, conv, slots).split(
                [c.d_inner, c.ngroups * c.d_state, c.ngroups * c.d_state], dim=-1)
            y, state = scan_kernels.ssd_scan(
                x.unflatten(-1, (c.nheads, c.headdim)), dt, layer.A, B.unflatten(-1, (c.ngroups, c.d_state)),
                C.unflatten(-1, (c.ngroups, c.d_state)), D=layer.D, dt_bias=layer.dt_bias, dt_softplus=True,
                **self.dt_limits, h0=h0, return_state=True, backend=backend)
            y = _gated_rms_norm(y.flatten(-2), z, layer.gate_norm, c.ngroups, c.eps)
        ssm.index_copy_(0, slots, state.to(ssm.dtype))
        return product(y.to(self.dtype), layer.out_proj, layer.out_proj_bias)

    def _mixer_step(self, layer, h, conv, ssm, slots, backend):
        c = self.config
        projected = F.linear(h, layer.in_proj, layer.in_proj_bias)
        if c.arch == "mamba":
            x, z = projected.split(c.d_inner, dim=-1)
            x = _conv_step(layer, x, conv, slots)
            dt, B, C = F.linear(x, layer.x_proj).split([c.dt_rank, c.d_state, c.d_state], dim=-1)
            y = scan_kernels.selective_state_update(
                ssm, x, F.linear(dt, layer.dt_proj), layer.A, B, C, D=layer.D, z=z, dt_bias=layer.dt_bias,
                dt_softplus=True, slots=slots, backend=backend)
        else:
            z, xBC, dt = projected.split([c.d_inner, c.conv_dim, c.nheads], dim=-1)
            x, B, C = _conv_step(layer, xBC, conv, slots).split(
                [c.d_inner, c.ngroups * c.d_state, c.ngroups * c.d_state], dim=-1)
            y = scan_kernels.ssd_state_update(
                ssm, x.unflatten(-1, (c.nheads, c.headdim)), dt, layer.A, B.unflatten(-1, (c.ngroups, c.d_state)),
                C.unflatten(-1, (c.ngroups, c.d_state)), D=layer.D, dt_bias=layer.dt_bias, dt_softplus=True,
                **self.dt_limits, slots=slots, backend=backend)
            y = _gated_rms_norm(y.flatten(-2), z, layer.gate_norm, c.ngroups, c.eps)
        return F.linear(y.to(self.dtype), layer.out_proj, layer.out_proj_bias)



def _wide(t: torch.Tensor | None) -> torch.Tensor | None:
    """At least fp32 (f64 stays f64): what the conv and A are computed in."""
    return t if t is None or t.dtype == torch.float64 else t.float()


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' MambaRMSNorm: normalised in fp32, cast back to x's dtype, then scaled (one
    fused op where x and the weight are already the compute dtype: each op costs a dispatch,
    which dominates a step, docs/performance.md "model step")."""
    if x.dtype == weight.dtype == _wide(x).dtype:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return weight * F.rms_norm(_wide(x), (x.shape[-1],), eps=eps).to(x.dtype)


def _gated_rms_norm(y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, groups: int, eps: float) -> torch.Tensor:
    """Mamba-2's norm: y * silu(z), normalised per group of channels (gate before the norm)."""
    gated = (_wide(y) * F.silu(_wide(z))).unflatten(-1, (groups, -1))
    normed = F.rms_norm(gated, (gated.shape[-1],), eps=eps).flatten(-2)
    return weight * normed.to(y.dtype)


def _conv_seq(layer: Layer, x: torch.Tensor, conv: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The causal depthwise conv and SiLU over x [b, l, channels], continuing from the windows in
    rows `slots` of `conv` [pool, channels, d_conv], which are left holding the last d_conv inputs.
    Summed tap by tap (d_conv multiply-adds over the window): inside a prefill, F.conv1d's grouped
    CPU kernel cost more than that (docs/performance.md, "model forward")."""
    width, length = conv.shape[-1], x.shape[1]
    window = torch.cat([conv.index_select(0, slots), x.transpose(1, 2).to(conv.dtype)], dim=2)
    conv.index_copy_(0, slots, window[:, :, -width:].contiguous())
    taps = window[:, :, 1:].to(layer.conv.dtype)
    weight = layer.conv
    out = taps[:, :, :length] * weight[:, :1]
    for k in range(1, width):
        out.addcmul_(taps[:, :, k:k + length], weight[:, k:k + 1])
    if layer.conv_bias is not None:
        out += layer.conv_bias[:, None]
    return F.silu(out).transpose(1, 2).to(x.dtype)


def _conv_step(layer: Layer, x: torch.Tensor, conv: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """One timestep of the conv and SiLU for x [b, channels]."""
    window = torch.cat([conv.index_select(0, slots)[:, :, 1:], x.to(conv.dtype)[:, :, None]], dim=2)
    conv.index_copy_(0, slots, window)
    out = torch.linalg.vecdot(window.to(layer.conv.dtype), layer.conv)
    if layer.conv_bias is not None:
        out += layer.conv_bias
    return F.silu(out).to(x.dtype)
