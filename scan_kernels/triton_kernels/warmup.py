"""Ahead-of-time compilation of the Triton kernels for the shapes a server will see.

Triton compiles a kernel per specialisation: the constexpr options (which of D, z, dt_bias, h0
... are given), the dtypes, and for integer arguments whether they equal 1 or are multiples of
16 (strides among them). The surest way to build exactly the variants real requests will hit is
to run the real launchers on inputs of the bucket's shape, dtype and options, which is what
`warmup` does; it costs one launch per bucket beyond the compile.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from .._args import FLOAT_DTYPES, FLOAT_DTYPES_EXPECTED, LAYOUTS, LAYOUTS_EXPECTED, _flag
from ..errors import KernelInputError
from . import configs, scan, ssd, state_update
from .common import cdiv, interpreter_active


@dataclass(frozen=True)
class WarmupShape:
    """One bucket. batch/seq/dim/state/groups/layout give the scan's shape; the flags name the
    options the server's requests use (each option is a compile-time switch of the kernels).
    `headdim`: a Mamba-2 (SSD) bucket instead, of `dim` heads of `headdim` channels each (its
    scan has the one layout, "bld"; D is per head, as mamba_ssm's blocks hold it).
    `slots`: the state update is warmed with int64 slot indices into a pool (the bridge's
    sessions) rather than one state row per batch row.

    What selects a compiled variant, so what a bucket must match: the options; the dtypes (x,
    dt, B, C, z in the warmup dtype; A, D, dt_bias, h0 and the state pool in fp32, as mamba
    keeps its parameters); state, groups and dim (through the blocks and the strides'
    divisibility by 16); and seq only through whether the sequence is split into segments (a
    second kernel) and, in the "bdl" layout, through the strides."""
    batch: int
    seq: int
    dim: int
    state: int
    groups: int = 1
    layout: str = "bld"
    D: bool = False
    z: bool = False
    dt_bias: bool = False
    dt_softplus: bool = False
    clamp: bool = False
    h0: bool = False
    return_state: bool = False
    slots: bool = True
    dtype: torch.dtype | None = None  # of x, dt, B, C, z; None: the warmup call's
    headdim: int | None = None

    @classmethod
    def parse(cls, shape) -> "WarmupShape":
        if not isinstance(shape, dict):
            raise KernelInputError("shapes", "dicts with keys batch, seq, dim, state", type(shape).__name__)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(shape) - known)
        if unknown:
            raise KernelInputError("shapes", f"keys among {sorted(known)}", f"unknown keys {unknown}")
        missing = [k for k in ("batch", "seq", "dim", "state") if k not in shape]
        if missing:
            raise KernelInputError("shapes", "keys batch, seq, dim, state", f"missing {missing} in {shape}")
        spec = cls(**shape)
        for name in ("batch", "seq", "dim", "state", "groups") + (("headdim",) if spec.ssd else ()):
            value = getattr(spec, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise KernelInputError(f"shapes.{name}", "a positive int", repr(value))
        # The options choose compiled variants: read by truthiness, "false" would warm the one with it.
        from .. import WARMUP_OPTIONS

        for name in (*WARMUP_OPTIONS, "slots"):
            _flag(f"shapes.{name}", getattr(spec, name))
        if spec.dim % spec.groups:
            axis = "heads" if spec.ssd else "dim"
            raise KernelInputError("shapes.groups", f"a divisor of {axis} ({spec.dim})", str(spec.groups))
        if spec.layout not in LAYOUTS or (spec.ssd and spec.layout != "bld"):
            expected = '"bld" (the SSD scan\'s one layout)' if spec.ssd else LAYOUTS_EXPECTED
            raise KernelInputError("shapes.layout", expected, repr(spec.layout))
        if spec.dtype is not None and spec.dtype not in FLOAT_DTYPES:
            raise KernelInputError("shapes.dtype", FLOAT_DTYPES_EXPECTED, str(spec.dtype))
        return spec

    @property
    def ssd(self) -> bool:
        return self.headdim is not None

    def options(self) -> list[str]:
        from .. import WARMUP_OPTIONS

        return [name for name in WARMUP_OPTIONS if getattr(self, name)]


def _uniform(shape, dtype, device, low, high):
    return torch.empty(shape, dtype=torch.float32, device=device).uniform_(low, high).to(dtype)


def _per_channel(spec: WarmupShape, wanted: bool, device):
    """D or dt_bias for a bucket that uses it, else None."""
    return _uniform((spec.dim,), torch.float32, device, -0.5, 0.5) if wanted else None


def _warm_scan(spec: WarmupShape, device, dtype) -> str:
    """Whether the sequence is split in segments (a second kernel, and another variant of the
    first) depends on the batch too: fewer rows than fill the GPU are split. A batcher stacks
    any number of rows up to the bucket's, so both forms are warmed where seq allows a split."""
    b, l, d, n, g = spec.batch, spec.seq, spec.dim, spec.state, spec.groups
    seq_shape = (b, l, d) if spec.layout == "bld" else (b, d, l)
    bc_shape = (b, l, g, n) if spec.layout == "bld" else (b, g, n, l)
    inputs = (
        _uniform(seq_shape, dtype, device, -1, 1), _uniform(seq_shape, dtype, device, 0.01, 0.5),
        _uniform((d, n), torch.float32, device, -2, -0.1),
        _uniform(bc_shape, dtype, device, -1, 1), _uniform(bc_shape, dtype, device, -1, 1),
    )
    options = dict(
        D=_per_channel(spec, spec.D, device),
        z=_uniform(seq_shape, dtype, device, -1, 1) if spec.z else None,
        dt_bias=_per_channel(spec, spec.dt_bias, device),
        dt_softplus=spec.dt_softplus,
        dt_min=0.001 if spec.clamp else None, dt_max=0.1 if spec.clamp else None,
        h0=_uniform((b, d, n), torch.float32, device, -1, 1) if spec.h0 else None,
        return_state=spec.return_state, layout=spec.layout,
    )
    plan = scan.plan_scan(b, l, d, n, g, device)
    scan.selective_scan(*inputs, **options)
    chunk = plan.blocks.chunk
    other = None
    if l > chunk:
        # The other form: one segment where the plan splits, else the chunks cut in two halves.
        other_len = l if plan.n_segments > 1 else chunk * cdiv(cdiv(l, chunk), 2)
        scan.selective_scan(*inputs, **options, segment_len=other_len)
        other = scan.plan_scan(b, l, d, n, g, device, segment_len=other_len)
    return (f"scan {spec.layout} batch={b} seq={l} dim={d} state={n} groups={g} {_name(dtype)} "
            f"options={spec.options()}: {plan.describe()}"
            + (f"; also {other.describe()}" if other else ""))


def _warm_state_update(spec: WarmupShape, device, dtype) -> str:
    b, d, n, g = spec.batch, spec.dim, spec.state, spec.groups
    state_update.selective_state_update(
        _uniform((b, d, n), torch.float32, device, -1, 1),
        _uniform((b, d), dtype, device, -1, 1), _uniform((b, d), dtype, device, 0.01, 0.5),
        _uniform((d, n), torch.float32, device, -2, -0.1),
        _uniform((b, g, n), dtype, device, -1, 1), _uniform((b, g, n), dtype, device, -1, 1),
        D=_per_channel(spec, spec.D, device),
        z=_uniform((b, d), dtype, device, -1, 1) if spec.z else None,
        dt_bias=_per_channel(spec, spec.dt_bias, device),
        dt_softplus=spec.dt_softplus,
        dt_min=0.001 if spec.clamp else None, dt_max=0.1 if spec.clamp else None,
        slots=torch.arange(b, device=device) if spec.slots else None,
    )
    options = [o for o in spec.options() if o not in ("h0", "return_state")]
    plan = state_update.plan_update(b, d, n, g)
    return (f"state_update batch={b} dim={d} state={n} groups={g} {_name(dtype)} "
            f"slots={spec.slots} options={options}: {plan.describe()}")


def _warm_ssd_scan(spec: WarmupShape, device, dtype) -> str:
    b, l, h, p, n, g = spec.batch, spec.seq, spec.dim, spec.headdim, spec.state, spec.groups
    x_shape, bc_shape = (b, l, h, p), (b, l, g, n)
    inputs = (_uniform(x_shape, dtype, device, -1, 1), _uniform((b, l, h), dtype, device, 0.01, 0.5),
              _uniform((h,), torch.float32, device, -2, -0.1),
              _uniform(bc_shape, dtype, device, -1, 1), _uniform(bc_shape, dtype, device, -1, 1))
    ssd.ssd_scan(*inputs, **_ssd_options(spec, device, dtype, x_shape),
                 h0=_uniform((b, h, p, n), torch.float32, device, -1, 1) if spec.h0 else None,
                 return_state=spec.return_state)
    plan = ssd.plan_ssd_scan(inputs[0], inputs[3], inputs[4], None)
    return (f"ssd_scan batch={b} seq={l} heads={h} headdim={p} state={n} groups={g} {_name(dtype)} "
            f"options={spec.options()}: chunk {plan.chunk} x {plan.nchunks}, {plan.blocks}")


def _warm_ssd_state_update(spec: WarmupShape, device, dtype) -> str:
    b, h, p, n, g = spec.batch, spec.dim, spec.headdim, spec.state, spec.groups
    ssd.ssd_state_update(
        _uniform((b, h, p, n), torch.float32, device, -1, 1),
        _uniform((b, h, p), dtype, device, -1, 1), _uniform((b, h), dtype, device, 0.01, 0.5),
        _uniform((h,), torch.float32, device, -2, -0.1),
        _uniform((b, g, n), dtype, device, -1, 1), _uniform((b, g, n), dtype, device, -1, 1),
        **_ssd_options(spec, device, dtype, (b, h, p)),
        slots=torch.arange(b, device=device) if spec.slots else None)
    options = [o for o in spec.options() if o not in ("h0", "return_state")]
    return (f"ssd_state_update batch={b} heads={h} headdim={p} state={n} groups={g} {_name(dtype)} "
            f"slots={spec.slots} options={options}: {configs.ssd_update_blocks(p, n)}")


def _ssd_options(spec: WarmupShape, device, dtype, x_shape) -> dict:
    """D (per head, spread over headdim as scan_kernels._args leaves it), z, dt_bias and the dt
    options of a Mamba-2 bucket."""
    h, p = spec.dim, spec.headdim
    return dict(D=_uniform((h,), torch.float32, device, -0.5, 0.5).unsqueeze(1).expand(h, p) if spec.D else None,
                z=_uniform(x_shape, dtype, device, -1, 1) if spec.z else None,
                dt_bias=_uniform((h,), torch.float32, device, -0.5, 0.5) if spec.dt_bias else None,
                dt_softplus=spec.dt_softplus,
                dt_min=0.001 if spec.clamp else None, dt_max=0.1 if spec.clamp else None)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def warmup(shapes, *, device, dtype) -> list[str]:
    """Run the scan and the state update (Mamba-1's, or Mamba-2's for a bucket with `headdim`)
    once per bucket so that their kernels are compiled
    (on the interpreter nothing compiles and the runs only check the buckets). Returns one
    line per kernel warmed, for the server's `info`."""
    if dtype not in FLOAT_DTYPES:
        raise KernelInputError("dtype", FLOAT_DTYPES_EXPECTED, str(dtype))
    specs = [WarmupShape.parse(shape) for shape in shapes]
    device = torch.device(device)
    suffix = " (interpreted, nothing compiled)" if interpreter_active() else " (compiled)"
    described = []
    for spec in specs:
        spec_dtype = spec.dtype or dtype
        warm_scan, warm_update = ((_warm_ssd_scan, _warm_ssd_state_update) if spec.ssd
                                  else (_warm_scan, _warm_state_update))
        described.append("triton " + warm_scan(spec, device, spec_dtype) + suffix)
        described.append("triton " + warm_update(spec, device, spec_dtype) + suffix)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return described
