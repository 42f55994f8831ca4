"""Shared test harness for every kernels backend: named cases, fresh random inputs (never
zeros), a per-dtype tolerance table and the helpers that compare a backend with the reference.

Each backend's tests draw cases from here and compare against `scan_kernels.reference` run in
float64, so a backend is never checked against itself.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass

import pytest
import torch

import scan_kernels

# The skips a run expects, and so the only ones CI accepts (tests/conftest.py). Without a GPU:
# the cases that need a CUDA device, and the Triton cases the interpreter runs in one split only.
# With one: the interpreter's cases (Triton then serves CUDA tensors only) and the sm_90 compile
# check, which the CUDA cases replace.
NO_CUDA = "no CUDA device here: the cuda cases (real sizes, fp16/bf16 at size, servers on a GPU) run on a GPU only"
INTERPRETER_OTHER_SPLIT = "10-15 s on the interpreter: there it runs in the other split only"
TRITON_NOT_SERVING = "the triton backend does not serve {device} tensors here"
CUDA_COMPILES_EVERY_KERNEL = "with a GPU the cuda tests compile and run every kernel"


# A test (or a parametrized case) that needs a CUDA device.
ON_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
# The devices a server test runs its server on.
SERVER_DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=ON_CUDA)]


def expected_skip(reason: str) -> bool:
    if reason.startswith("SIMD variant "):
        return _simd_variant_not_executable(reason)
    if torch.cuda.is_available():
        return reason.startswith((TRITON_NOT_SERVING.format(device="cpu"), CUDA_COMPILES_EVERY_KERNEL))
    return reason in (NO_CUDA, INTERPRETER_OTHER_SPLIT)


def _simd_variant_not_executable(reason: str) -> bool:
    """A SIMD variant's skip stands only when this CPU cannot execute that variant: the reason is
    the one scan_kernels.cpu.build gives for it now."""
    from scan_kernels.cpu import build

    name = reason.removeprefix("SIMD variant ").split(":", 1)[0]
    variants = [v for v in build.SIMD_VARIANTS if v.name == name]
    return bool(variants) and build.unsupported_reason(variants[0]) == reason


# Per-dtype tolerances (rtol, atol) against the float64 reference, as in mamba_ssm's tests:
# fp32 3e-4 / 1e-3, fp16 5e-3 / 1e-2, bf16 1e-2 / 5e-2.
TOLERANCES = {
    torch.float64: (1e-9, 1e-9),
    torch.float32: (3e-4, 1e-3),
    torch.float16: (5e-3, 1e-2),
    torch.bfloat16: (1e-2, 5e-2),
}
# The state is kept in fp32 whatever the input dtype, so it meets fp32 tolerances against
# a reference fed the same (rounded) inputs.
STATE_TOLERANCE = (3e-4, 1e-3)


@dataclass(frozen=True)
class ScanCase:
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
    return_state: bool = True
    bc_3d: bool = False  # pass B/C without the groups axis (requires groups == 1)


# Named cases: odd sizes (dim not a power of two, seq not a multiple of common chunk sizes),
# groups, each option alone and all together, both layouts.
SCAN_CASES = [
    pytest.param(ScanCase(1, 1, 1, 1), id="tiny-1x1x1x1"),
    pytest.param(ScanCase(2, 7, 5, 3, bc_3d=True), id="odd-bc3d"),
    pytest.param(ScanCase(3, 13, 12, 4, groups=2), id="groups2"),
    pytest.param(ScanCase(3, 13, 12, 4, groups=3, layout="bdl"), id="groups3-bdl"),
    pytest.param(ScanCase(2, 9, 6, 5, D=True), id="D"),
    pytest.param(ScanCase(2, 9, 6, 5, z=True), id="z"),
    pytest.param(ScanCase(2, 9, 6, 5, dt_bias=True), id="dt_bias"),
    pytest.param(ScanCase(2, 9, 6, 5, dt_softplus=True), id="softplus"),
    pytest.param(ScanCase(2, 9, 6, 5, clamp=True), id="clamp"),
    pytest.param(ScanCase(2, 9, 6, 5, h0=True), id="h0"),
    pytest.param(ScanCase(2, 9, 6, 5, return_state=False), id="no-state"),
    pytest.param(ScanCase(3, 37, 20, 16, groups=2, D=True, z=True, dt_bias=True, dt_softplus=True,
                          clamp=True, h0=True), id="all-options-bld"),
    pytest.param(ScanCase(3, 37, 20, 16, groups=2, layout="bdl", D=True, z=True, dt_bias=True,
                          dt_softplus=True, clamp=True, h0=True), id="all-options-bdl"),
    pytest.param(ScanCase(1, 130, 33, 8, D=True, dt_softplus=True, dt_bias=True), id="long-odd"),
]


# Larger cases, for backends that process the sequence in chunks or the channels in blocks:
# sizes that leave odd remainders at every common chunk length, a long sequence with every
# option, and one timestep too wide to be processed in one piece (2050 channels, state 128).
# Seconds in the float64 reference, so kept out of SCAN_CASES (which interpreter suites use).
LARGE_SCAN_CASES = [
    pytest.param(ScanCase(2, 601, 66, 16, groups=3, D=True, z=True, dt_bias=True, dt_softplus=True,
                          clamp=True, h0=True), id="long-all-options"),
    pytest.param(ScanCase(2, 5, 2050, 128, groups=2, layout="bdl", D=True, z=True, h0=True),
                 id="wide-bdl"),
]


@dataclass(frozen=True)
class UpdateCase:
    batch: int
    dim: int
    state: int
    groups: int = 1
    pool: int | None = None  # None: no slots, pool == batch
    padding_rows: int = 0  # how many of the slots are negative (padding)
    D: bool = False
    z: bool = False
    dt_bias: bool = False
    dt_softplus: bool = False
    clamp: bool = False
    bc_2d: bool = False


UPDATE_CASES = [
    pytest.param(UpdateCase(1, 1, 1), id="tiny"),
    pytest.param(UpdateCase(3, 5, 3, bc_2d=True), id="odd-bc2d"),
    pytest.param(UpdateCase(3, 12, 4, groups=2), id="groups2"),
    pytest.param(UpdateCase(2, 6, 5, D=True, z=True), id="D-z"),
    pytest.param(UpdateCase(2, 6, 5, dt_bias=True, dt_softplus=True), id="bias-softplus"),
    pytest.param(UpdateCase(2, 6, 5, clamp=True), id="clamp"),
    pytest.param(UpdateCase(5, 20, 16, pool=9), id="slots"),
    pytest.param(UpdateCase(7, 20, 16, groups=2, pool=11, padding_rows=3, D=True, z=True,
                            dt_bias=True, dt_softplus=True, clamp=True), id="slots-padding-all"),
]


def _rand(shape, dtype, device, gen, low=-1.0, high=1.0):
    # Uniform in [low, high), drawn in fp32 then cast: never all zeros.
    t = torch.rand(shape, generator=gen, dtype=torch.float32) * (high - low) + low
    return t.to(device=device, dtype=dtype)


def _add_options(args: dict, case, x_shape, dtype, device, gen) -> None:
    """The options a ScanCase and an UpdateCase share (D, z, dt_bias, softplus, clamp), drawn
    in that order from `gen`."""
    _add_dt_options(args, case, (case.dim,), (case.dim,), x_shape, dtype, device, gen)


def _add_dt_options(args: dict, case, d_shape, bias_shape, x_shape, dtype, device, gen) -> None:
    """D, z, dt_bias, softplus and clamp as `case` asks, drawn in that order from `gen`."""
    if case.D:
        args["D"] = _rand(d_shape, torch.float32, device, gen)
    if case.z:
        args["z"] = _rand(x_shape, dtype, device, gen, -2.0, 2.0)
    if case.dt_bias:
        args["dt_bias"] = _rand(bias_shape, torch.float32, device, gen, -0.5, 0.5)
    if case.dt_softplus:
        args["dt_softplus"] = True
    if case.clamp:
        args["dt_min"], args["dt_max"] = 0.05, 0.3


def _draw_slots(pool: int, batch: int, padding_rows: int, device, gen) -> torch.Tensor:
    """Distinct pool rows for `batch` rows in random order, `padding_rows` of them -1 (padding)."""
    slots = torch.randperm(pool, generator=gen)[:batch]
    if padding_rows:
        slots[torch.randperm(batch, generator=gen)[:padding_rows]] = -1
    return slots.to(device=device, dtype=torch.int64)


def make_scan_inputs(case: ScanCase, dtype=torch.float32, device="cpu", seed=None) -> dict:
    """Keyword arguments for `scan_kernels.selective_scan` (without backend)."""
    gen = torch.Generator().manual_seed(seed if seed is not None else torch.seed() % (2**31))
    b, l, d, n, g = case.batch, case.seq, case.dim, case.state, case.groups
    if case.layout == "bld":
        xs, bcs = (b, l, d), ((b, l, n) if case.bc_3d else (b, l, g, n))
    else:
        xs, bcs = (b, d, l), ((b, n, l) if case.bc_3d else (b, g, n, l))
    args = dict(
        x=_rand(xs, dtype, device, gen),
        # dt positive and modest; with softplus it is a pre-activation around zero.
        dt=_rand(xs, dtype, device, gen, -1.0, 1.0) if case.dt_softplus else _rand(xs, dtype, device, gen, 0.01, 0.5),
        # A negative (mamba: A = -exp(A_log)) in fp32, like mamba's parameters.
        A=_rand((d, n), torch.float32, device, gen, -2.0, -0.1),
        B=_rand(bcs, dtype, device, gen),
        C=_rand(bcs, dtype, device, gen),
        layout=case.layout,
        return_state=case.return_state,
    )
    _add_options(args, case, xs, dtype, device, gen)
    if case.h0:
        args["h0"] = _rand((b, d, n), torch.float32, device, gen)
    return args


def make_update_inputs(case: UpdateCase, dtype=torch.float32, device="cpu", seed=None) -> dict:
    """Keyword arguments for `scan_kernels.selective_state_update` (without backend); `state` is a
    fresh random fp32 pool."""
    gen = torch.Generator().manual_seed(seed if seed is not None else torch.seed() % (2**31))
    b, d, n, g = case.batch, case.dim, case.state, case.groups
    pool = case.pool if case.pool is not None else b
    bcs = (b, n) if case.bc_2d else (b, g, n)
    args = dict(
        state=_rand((pool, d, n), torch.float32, device, gen),
        x=_rand((b, d), dtype, device, gen),
        dt=_rand((b, d), dtype, device, gen, -1.0, 1.0) if case.dt_softplus else _rand((b, d), dtype, device, gen, 0.01, 0.5),
        A=_rand((d, n), torch.float32, device, gen, -2.0, -0.1),
        B=_rand(bcs, dtype, device, gen),
        C=_rand(bcs, dtype, device, gen),
    )
    if case.pool is not None:
        args["slots"] = _draw_slots(pool, b, case.padding_rows, device, gen)
    _add_options(args, case, (b, d), dtype, device, gen)
    return args


def reference_scan(inputs: dict):
    """(y, state) from the float64 reference for the same inputs."""
    from scan_kernels import _args
    from scan_kernels.reference import selective_scan_ref

    a = _args.check_scan(**{**inputs, "return_state": True})
    return selective_scan_ref(a.x, a.dt, a.A, a.B, a.C, **a.backend_kwargs(),
                              compute_dtype=torch.float64)


def reference_term_magnitudes(inputs: dict, reference=reference_scan):
    """(y, state) as `reference` (reference_scan or reference_ssd_scan) computes them with every
    term of every sum at its magnitude: |x|, |B|, |C|, |D|, |h0|, the discretized dt's |dt| and
    |silu(z)| (decays are positive). An fp32 evaluation of the same sums is off by a few ulps of
    these; an element that cancels to far below them (the state a 1e15 step leaves, read back
    through C) cannot be held to rtol of itself. For bld layouts without cu_seqlens."""
    from scan_kernels import _args
    from scan_kernels.reference import _discretize_dt

    ssd = reference is reference_ssd_scan
    a = (_args.check_ssd_scan if ssd else _args.check_scan)(**{**inputs, "return_state": True})
    if not ssd and a.layout != "bld":
        raise ValueError(f"reference_term_magnitudes: layout 'bld' expected, got {a.layout!r}")
    f = torch.float64
    dt = _discretize_dt(a.dt, a.dt_bias, a.dt_softplus, a.dt_min, a.dt_max, f)
    x = a.x.to(f).abs()
    # dt times x carries dt's sign: x takes it, so each input term dt x B counts at |dt x B|.
    signed_x = x * (torch.sign(dt)[..., None] if ssd else torch.sign(dt))
    y, state = reference(dict(x=signed_x, dt=dt, A=a.A.to(f), B=a.B.to(f).abs(), C=a.C.to(f).abs(),
                              h0=None if a.h0 is None else a.h0.to(f).abs(), return_state=True))
    if a.D is not None:
        y = y + x * a.D.to(f).abs()
    if a.z is not None:
        y = y * torch.nn.functional.silu(a.z.to(f)).abs()
    return y, state


def reference_update(inputs: dict):
    """(y, new_state) from the float64 reference applied to a copy of inputs["state"]."""
    from scan_kernels.reference import selective_state_update_ref

    state = inputs["state"].clone().to(torch.float64)
    kw = {k: v for k, v in inputs.items() if k != "state"}
    y = selective_state_update_ref(state, compute_dtype=torch.float64, **kw)
    return y, state


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str,
                 tolerance=None) -> None:
    """Compare in float64 with the tolerance of `dtype` (or an explicit (rtol, atol))."""
    rtol, atol = tolerance or TOLERANCES[dtype]
    if actual.shape != expected.shape:
        raise AssertionError(f"{what}: shape {tuple(actual.shape)} != expected {tuple(expected.shape)}")
    a = actual.detach().to("cpu", torch.float64)
    e = expected.detach().to("cpu", torch.float64)
    if torch.isnan(a).any():
        raise AssertionError(f"{what}: {int(torch.isnan(a).sum())} NaN elements (unwritten output?)")
    torch.testing.assert_close(a, e, rtol=rtol, atol=atol, msg=lambda m: f"{what} ({dtype}): {m}")


def assert_close_to_term_magnitudes(actual, expected, magnitudes, dtype, what: str, tolerance=None) -> None:
    """|actual - expected| within rtol of `magnitudes` (reference_term_magnitudes) plus atol,
    element by element, in float64 with the tolerance of `dtype` (or an explicit (rtol, atol))."""
    rtol, atol = tolerance or TOLERANCES[dtype]
    if actual.shape != expected.shape:
        raise AssertionError(f"{what}: shape {tuple(actual.shape)} != expected {tuple(expected.shape)}")
    a, e, m = (t.detach().to("cpu", torch.float64) for t in (actual, expected, magnitudes))
    if torch.isnan(a).any():
        raise AssertionError(f"{what}: {int(torch.isnan(a).sum())} NaN elements (unwritten output?)")
    if not (torch.isfinite(e).all() and torch.isfinite(m).all()):
        raise AssertionError(f"{what}: the reference is not finite; compare with assert_close")
    excess = (a - e).abs() - (rtol * m + atol)
    if (excess > 0).any():
        worst = tuple(int(i) for i in torch.unravel_index(excess.argmax(), excess.shape))
        raise AssertionError(
            f"{what} ({dtype}): {int((excess > 0).sum())} of {a.numel()} elements off by more than "
            f"{rtol:g} of their terms' magnitude + {atol:g}; the worst at {worst}: {a[worst].item():.8g}, "
            f"expected {e[worst].item():.8g}, terms' magnitude {m[worst].item():.4g}")


def assert_same_nans_and_close(actual, expected, what: str) -> None:
    """NaN exactly where the reference has it (which must have some), fp32-close elsewhere."""
    nan, got = torch.isnan(expected).cpu(), torch.isnan(actual).cpu()
    assert nan.any(), f"{what}: the reference has no NaN to compare"
    assert torch.equal(got, nan), f"{what}: NaN at {got.nonzero().tolist()}, the reference's at {nan.nonzero().tolist()}"
    assert_close(actual.cpu()[~nan], expected.cpu()[~nan], torch.float32, what)


def with_option(case, **changes):
    return dataclasses.replace(case, **changes)


def with_changes(**changes):
    """A change to a dict of valid arguments (for the validation tests): each value, or each
    callable's result on the arguments."""
    return lambda a: {**a, **{k: (v(a) if callable(v) else v) for k, v in changes.items()}}


def nan_gapped(t: torch.Tensor) -> torch.Tensor:
    """Same values, every stride doubled, NaN in the gaps: a backend that reads (or writes)
    through the wrong strides shows NaN or leaves NaN behind."""
    return torch.stack((t, torch.full_like(t, float("nan"))), dim=-1)[..., 0]


def transposed(t: torch.Tensor) -> torch.Tensor:
    """Same values and shape, last two axes laid out transposed in memory."""
    return t.transpose(-1, -2).contiguous().transpose(-1, -2) if t.dim() >= 2 else t


STRIDED = [pytest.param(nan_gapped, id="nan-gapped"), pytest.param(transposed, id="transposed")]


# -- what every backend's tests share ---------------------------------------------------------

DTYPES = [
    pytest.param(torch.float32, id="f32"),
    pytest.param(torch.float16, id="f16"),
    pytest.param(torch.bfloat16, id="bf16"),
    pytest.param(torch.float64, id="f64"),
]


def cpu_backends() -> list[str]:
    """The backends the generic suites test: every available one serving CPU tensors but the
    reference (the oracle) and Triton (its own interpreter suite)."""
    names = []
    for name in scan_kernels.available_backends():
        if name in ("reference", "triton"):
            continue
        try:
            scan_kernels.select_backend("cpu", name)
        except scan_kernels.BackendUnavailable:
            continue  # available, but for other devices only
        names.append(name)
    return names


def random_seed() -> int:
    """A fresh seed per test (printed in failure messages, so a failure can be replayed)."""
    return random.randrange(2**31)


def state_dtype(dtype):
    """The dtype the state is kept and accumulated in: fp32 for every input dtype but float64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def state_tolerance(dtype):
    return TOLERANCES[torch.float64] if dtype == torch.float64 else STATE_TOLERANCE


def assert_scan_matches_reference(backend: str, case, dtype, seed: int, what: str, device="cpu") -> None:
    """scan_kernels.selective_scan on `backend` (inputs on `device`) against the float64 reference:
    y (shape and dtype too) and, with return_state, the state."""
    inputs = make_scan_inputs(case, dtype, device, seed=seed)
    out = scan_kernels.selective_scan(**inputs, backend=backend)
    y, state = out if isinstance(out, tuple) else (out, None)
    assert_scan_outputs_match_reference(case, dtype, inputs, y, state, what)


def assert_scan_outputs_match_reference(case, dtype, inputs: dict, y, state, what: str,
                                        reference=reference_scan, to_term_magnitudes=False) -> None:
    """A scan's outputs on `inputs`, however it was called, against the float64 reference
    (`reference_ssd_scan` for a Mamba-2 scan); with `to_term_magnitudes`, within rtol of the
    magnitudes of the terms each element sums (reference_term_magnitudes) rather than of itself."""
    y_ref, state_ref = reference(inputs)
    y_terms, state_terms = reference_term_magnitudes(inputs, reference) if to_term_magnitudes else (None, None)

    def compare(got, expected, terms, *args):
        if terms is None:
            assert_close(got, expected, *args)
        else:
            assert_close_to_term_magnitudes(got, expected, terms, *args)

    assert y.dtype == dtype, f"{what}: y dtype {y.dtype}, expected {dtype}"
    compare(y, y_ref, y_terms, dtype, f"{what} y")
    if case.return_state:
        assert state.dtype == state_dtype(dtype), f"{what}: state dtype {state.dtype}"
        compare(state, state_ref, state_terms, dtype, f"{what} state", state_tolerance(dtype))
    else:
        assert state is None, f"{what}: a state without return_state"


def assert_update_matches_reference(backend: str, case, dtype, seed: int, what: str) -> None:
    """scan_kernels.selective_state_update on `backend` against the float64 reference: y, padding
    rows' y zero, the live slots' state rows updated and every other pool row untouched."""
    inputs = make_update_inputs(case, dtype, seed=seed)
    before = inputs["state"].clone()
    y = scan_kernels.selective_state_update(**inputs, backend=backend)
    assert_update_outputs_match_reference(case, dtype, inputs, before, y, what)


def assert_update_outputs_match_reference(case, dtype, inputs: dict, before, y, what: str,
                                          reference=reference_update) -> None:
    """A state update's y and pool (`inputs["state"]`, updated in place from `before`), however
    it was called, against the float64 reference run on `before` (`reference_ssd_update` for a
    Mamba-2 update)."""
    y_ref, state_ref = reference({**inputs, "state": before})
    state = inputs["state"]
    assert y.dtype == dtype, f"{what}: y dtype {y.dtype}, expected {dtype}"
    assert_close(y, y_ref, dtype, f"{what} y")
    slots = inputs.get("slots")
    touched = torch.zeros(state.shape[0], dtype=torch.bool, device=state.device)
    if slots is None:
        touched[:case.batch] = True
    else:
        live = slots >= 0
        assert torch.equal(y[~live], torch.zeros_like(y[~live])), f"{what}: padding rows' y not 0"
        touched[slots[live]] = True
    # The tolerance of the pool's own dtype: fp32 (make_update_inputs) or a float64 pool.
    assert_close(state[touched], state_ref[touched], dtype, f"{what} updated rows", state_tolerance(state.dtype))
    assert torch.equal(state[~touched], before[~touched]), f"{what}: rows outside the live slots changed"


# -- Mamba-2 (SSD) ------------------------------------------------------------------------------


@dataclass(frozen=True)
class SsdCase:
    batch: int
    seq: int
    heads: int
    headdim: int
    state: int
    groups: int = 1
    chunk_size: int | None = None
    D: bool = False
    D_per_channel: bool = False  # D [heads, headdim] rather than [heads]
    z: bool = False
    dt_bias: bool = False
    dt_softplus: bool = False
    clamp: bool = False
    h0: bool = False
    return_state: bool = True


# Named cases: odd sizes, groups, seq 1, seq shorter than the chunk and seq not a multiple of it,
# each option alone and all together.
SSD_SCAN_CASES = [
    pytest.param(SsdCase(1, 1, 1, 1, 1), id="tiny-1x1x1x1x1"),
    pytest.param(SsdCase(2, 1, 3, 5, 4, chunk_size=4), id="seq1"),
    pytest.param(SsdCase(2, 3, 2, 4, 3, chunk_size=8), id="seq-lt-chunk"),
    pytest.param(SsdCase(2, 13, 4, 3, 5, groups=2, chunk_size=4), id="groups2-seq13-chunk4"),
    pytest.param(SsdCase(1, 16, 6, 2, 7, groups=3, chunk_size=8), id="groups3-seq-eq-2chunks"),
    pytest.param(SsdCase(2, 9, 2, 6, 5, D=True), id="D-per-head"),
    pytest.param(SsdCase(2, 9, 2, 6, 5, D=True, D_per_channel=True), id="D-per-channel"),
    pytest.param(SsdCase(2, 9, 2, 6, 5, z=True), id="z"),
    pytest.param(SsdCase(2, 9, 2, 6, 5, dt_bias=True, dt_softplus=True), id="bias-softplus"),
    pytest.param(SsdCase(2, 9, 2, 6, 5, clamp=True), id="clamp"),
    pytest.param(SsdCase(2, 9, 2, 6, 5, h0=True, chunk_size=4), id="h0"),
    # One chunk with h0: the Triton scan reads h0 as the entering state and skips state passing.
    pytest.param(SsdCase(2, 9, 2, 6, 5, h0=True), id="h0-one-chunk"),
    pytest.param(SsdCase(2, 9, 2, 6, 5, h0=True, return_state=False), id="h0-one-chunk-no-state"),
    pytest.param(SsdCase(2, 9, 2, 6, 5, return_state=False), id="no-state"),
    pytest.param(SsdCase(3, 37, 4, 10, 16, groups=2, chunk_size=16, D=True, z=True, dt_bias=True,
                         dt_softplus=True, clamp=True, h0=True), id="all-options"),
    pytest.param(SsdCase(1, 70, 3, 17, 9, chunk_size=32, D=True, dt_softplus=True), id="long-odd"),
]

# Mamba-2 decay regimes (minus A, dt's range, seq) at the edges of the recurrence: a memory that barely fades over a long
# sequence, the product of the decays falling a millionfold every few dozen steps, a decay that
# underflows to zero, a state that grows (A > 0) a millionfold, steps of every decay from none to
# underflow mixed over an odd length, and a state that grows past e^30 (where the C++ scan,
# which keeps its state scaled by the decay since a recent step, rescales it: both last ones).
SSD_DECAY_REGIMES = [
    pytest.param(1e-3, (0.01, 0.02), 400, id="long-memory"),
    pytest.param(2.0, (0.3, 0.6), 300, id="strong-decay"),
    pytest.param(2.0, (100.0, 120.0), 20, id="decay-underflows"),
    pytest.param(-0.05, (0.4, 0.5), 700, id="state-grows"),
    pytest.param(2.0, (0.001, 20.0), 301, id="decay-mixed"),
    pytest.param(-0.5, (0.1, 0.12), 601, id="state-grows-far"),
]


# Larger: a Mamba-2-like head (headdim 64, state 128) over several chunks, and a long sequence.
LARGE_SSD_SCAN_CASES = [
    pytest.param(SsdCase(1, 300, 4, 64, 128, chunk_size=64, D=True, z=True, dt_bias=True,
                         dt_softplus=True, h0=True), id="mamba2-head-300"),
    pytest.param(SsdCase(2, 601, 6, 16, 16, groups=3, chunk_size=128, D=True, dt_softplus=True,
                         clamp=True, h0=True), id="long-601"),
]


@dataclass(frozen=True)
class SsdUpdateCase:
    batch: int
    heads: int
    headdim: int
    state: int
    groups: int = 1
    pool: int | None = None
    padding_rows: int = 0
    D: bool = False
    D_per_channel: bool = False
    z: bool = False
    dt_bias: bool = False
    dt_softplus: bool = False
    clamp: bool = False


SSD_UPDATE_CASES = [
    pytest.param(SsdUpdateCase(1, 1, 1, 1), id="tiny"),
    pytest.param(SsdUpdateCase(3, 4, 3, 5, groups=2), id="odd-groups2"),
    pytest.param(SsdUpdateCase(2, 2, 6, 5, D=True, z=True), id="D-z"),
    pytest.param(SsdUpdateCase(2, 2, 6, 5, D=True, D_per_channel=True), id="D-per-channel"),
    pytest.param(SsdUpdateCase(2, 2, 6, 5, dt_bias=True, dt_softplus=True, clamp=True), id="bias-softplus-clamp"),
    pytest.param(SsdUpdateCase(5, 8, 16, 16, pool=9), id="slots"),
    pytest.param(SsdUpdateCase(7, 6, 10, 32, groups=3, pool=11, padding_rows=3, D=True, z=True,
                               dt_bias=True, dt_softplus=True, clamp=True), id="slots-padding-all"),
    # The C++ update's whole-vector path (state a multiple of every variant's lanes) with rows
    # of headdim past its last block of W.
    pytest.param(SsdUpdateCase(4, 3, 21, 16, D=True, D_per_channel=True), id="rows-past-a-vector-block"),
    pytest.param(SsdUpdateCase(3, 4, 64, 128, groups=2, pool=5, padding_rows=1, D=True, z=True, dt_bias=True,
                               dt_softplus=True, clamp=True), id="mamba2-head-all-options"),
]


def _add_ssd_options(args: dict, case, x_shape, dtype, device, gen) -> None:
    h, p = case.heads, case.headdim
    _add_dt_options(args, case, (h, p) if case.D_per_channel else (h,), (h,), x_shape, dtype, device, gen)


def make_ssd_inputs(case: SsdCase, dtype=torch.float32, device="cpu", seed=None) -> dict:
    """Keyword arguments for `scan_kernels.ssd_scan` (without backend)."""
    gen = torch.Generator().manual_seed(seed if seed is not None else torch.seed() % (2**31))
    b, l, h, p, n, g = case.batch, case.seq, case.heads, case.headdim, case.state, case.groups
    xs = (b, l, h, p)
    args = dict(
        x=_rand(xs, dtype, device, gen),
        dt=(_rand((b, l, h), dtype, device, gen, -1.0, 1.0) if case.dt_softplus
            else _rand((b, l, h), dtype, device, gen, 0.01, 0.5)),
        A=_rand((h,), torch.float32, device, gen, -2.0, -0.1),
        B=_rand((b, l, g, n), dtype, device, gen),
        C=_rand((b, l, g, n), dtype, device, gen),
        return_state=case.return_state,
    )
    if case.chunk_size is not None:
        args["chunk_size"] = case.chunk_size
    _add_ssd_options(args, case, xs, dtype, device, gen)
    if case.h0:
        args["h0"] = _rand((b, h, p, n), torch.float32, device, gen)
    return args


def make_decay_regime_inputs(case: SsdCase, minus_A: float, dt_range: tuple[float, float], seed: int) -> dict:
    """make_ssd_inputs (float32) with one A for every head, -minus_A, and dt drawn uniformly in
    dt_range: an SSD_DECAY_REGIMES regime."""
    inputs = make_ssd_inputs(case, torch.float32, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    lo, hi = dt_range
    inputs["dt"] = lo + (hi - lo) * torch.rand(inputs["dt"].shape, generator=gen)
    inputs["A"] = torch.full_like(inputs["A"], -minus_A)
    return inputs


def make_ssd_update_inputs(case: SsdUpdateCase, dtype=torch.float32, device="cpu", seed=None) -> dict:
    """Keyword arguments for `scan_kernels.ssd_state_update` (without backend); `state` is a fresh
    random fp32 pool."""
    gen = torch.Generator().manual_seed(seed if seed is not None else torch.seed() % (2**31))
    b, h, p, n, g = case.batch, case.heads, case.headdim, case.state, case.groups
    pool = case.pool if case.pool is not None else b
    args = dict(
        state=_rand((pool, h, p, n), torch.float32, device, gen),
        x=_rand((b, h, p), dtype, device, gen),
        dt=(_rand((b, h), dtype, device, gen, -1.0, 1.0) if case.dt_softplus
            else _rand((b, h), dtype, device, gen, 0.01, 0.5)),
        A=_rand((h,), torch.float32, device, gen, -2.0, -0.1),
        B=_rand((b, g, n), dtype, device, gen),
        C=_rand((b, g, n), dtype, device, gen),
    )
    if case.pool is not None:
        args["slots"] = _draw_slots(pool, b, case.padding_rows, device, gen)
    _add_ssd_options(args, case, (b, h, p), dtype, device, gen)
    return args


def reference_ssd_scan(inputs: dict):
    """(y, state) from the float64 reference for the same inputs."""
    from scan_kernels import _args
    from scan_kernels.reference import ssd_scan_ref

    a = _args.check_ssd_scan(**{**inputs, "return_state": True})
    return ssd_scan_ref(a.x, a.dt, a.A, a.B, a.C, **a.backend_kwargs(), compute_dtype=torch.float64)


def reference_ssd_update(inputs: dict):
    """(y, new_state) from the float64 reference applied to a float64 copy of inputs["state"]."""
    from scan_kernels.reference import ssd_state_update_ref

    state = inputs["state"].clone().to(torch.float64)
    kw = {k: v for k, v in inputs.items() if k != "state"}
    y = ssd_state_update_ref(state, compute_dtype=torch.float64, **kw)
    return y, state


def assert_ssd_matches_reference(backend: str, case, dtype, seed: int, what: str, device="cpu") -> None:
    """scan_kernels.ssd_scan on `backend` against the float64 reference: y and, with return_state,
    the state."""
    inputs = make_ssd_inputs(case, dtype, device, seed=seed)
    out = scan_kernels.ssd_scan(**inputs, backend=backend)
    y, state = out if isinstance(out, tuple) else (out, None)
    assert_scan_outputs_match_reference(case, dtype, inputs, y, state, what, reference=reference_ssd_scan)


def assert_ssd_update_matches_reference(backend: str, case, dtype, seed: int, what: str, device="cpu") -> None:
    """scan_kernels.ssd_state_update on `backend` against the float64 reference: y, padding rows'
    y zero, the live slots' state rows updated and every other pool row untouched."""
    inputs = make_ssd_update_inputs(case, dtype, device, seed=seed)
    before = inputs["state"].clone()
    y = scan_kernels.ssd_state_update(**inputs, backend=backend)
    assert_update_outputs_match_reference(case, dtype, inputs, before, y, what, reference=reference_ssd_update)


# -- gradients (scan_kernels.selective_scan_backward / ssd_scan_backward) -----------------------------

# Gradients sum many products (dA and dB over a whole sequence), so each is compared with an
# absolute tolerance scaled by the reference gradient's largest magnitude; the relative part is
# the forward's. Half-precision inputs are rounded once, and the reference is fed the same
# rounded values; their gradients are rounded once more on the way out.
GRAD_TOLERANCES = {
    torch.float64: (1e-7, 1e-9),
    torch.float32: (1e-3, 1e-4),
    torch.float16: (1e-2, 5e-3),
    torch.bfloat16: (2e-2, 2e-2),
}


def make_cotangents(inputs: dict, x_shape, state_shape, with_dstate: bool, seed: int):
    """(dy like x, dstate fp32 [*state_shape] or None), fresh random values."""
    gen = torch.Generator().manual_seed(seed + 1)
    x = inputs["x"]
    dy = _rand(x_shape, x.dtype, x.device, gen)
    dstate = _rand(state_shape, torch.float32, x.device, gen) if with_dstate else None
    return dy, dstate


def backward_inputs(inputs: dict) -> dict:
    """A forward's keyword arguments as the backward takes them (no return_state)."""
    return {k: v for k, v in inputs.items() if k != "return_state"}


def assert_grads_close(actual: dict, expected: dict, given: dict, dtype, what: str) -> None:
    """Every gradient present exactly for the inputs given, in its input's shape and the
    promised dtype (A, D, dt_bias: fp32, or fp64 for fp64 x), and close to `expected`."""
    tensor_inputs = {k for k, v in given.items() if isinstance(v, torch.Tensor) and k != "cu_seqlens"}
    assert set(actual) == tensor_inputs, f"{what}: gradients {sorted(actual)}, inputs {sorted(tensor_inputs)}"
    compute = torch.float64 if given["x"].dtype == torch.float64 else torch.float32
    rtol, atol = GRAD_TOLERANCES[dtype]
    for name, g in actual.items():
        want_dtype = compute if name in ("A", "D", "dt_bias") else given[name].dtype
        assert g.dtype == want_dtype, f"{what}: d{name} dtype {g.dtype}, expected {want_dtype}"
        e = expected[name]
        scale = float(e.detach().abs().max()) or 1.0
        assert_close(g, e, dtype, f"{what}: d{name}", tolerance=(rtol, atol * scale))


def assert_grads_close_where_reference_finite(actual: dict, expected: dict, dtype, what: str) -> None:
    """Gradients finite and close to `expected` wherever it is finite (`dtype`'s tolerances).
    Where the reference has NaN (its autograd's 0 * inf), anything."""
    rtol, atol = GRAD_TOLERANCES[dtype]
    for name, e in expected.items():
        finite = torch.isfinite(e)
        assert finite.any(), f"{what}: d{name} of the reference has no finite element"
        g = actual[name]
        lost = finite & ~torch.isfinite(g)
        assert not lost.any(), f"{what}: d{name} non-finite at {lost.nonzero().tolist()}, the reference's finite"
        scale = float(e[finite].abs().max()) or 1.0
        assert_close(g[finite], e[finite], dtype, f"{what}: d{name}", tolerance=(rtol, atol * scale))


# Decays of exactly 0 (a memoryless channel or head, layout bld, no clamp): A of -inf in channel
# (head) 1, as A = -exp(A_log) gives past fp32's range, or one step whose dt is 1e15 (dt·A finite,
# its fp64 ulp about 0.1, and within the AVX-512 exp2's range: README, Limits). The Triton kernels
# took padded steps' 0 * -inf, and the SSD chunks' summed log decays -inf minus -inf or -1e15 plus
# its rounding, as NaN or garbage where the reference's decay is 0. The 1e15 step leaves a state of
# about 1e15 whose later y can cancel far below it: those tests hold each output to its terms'
# magnitudes (reference_term_magnitudes); held to itself, a rare seed failed on every backend.
# The Triton interpreter computes in numpy, which warns of the overflow and invalid values that
# non-finite inputs make on purpose: for the tests of those inputs, kept out of the run's summary.
INTERPRETER_NONFINITE_WARNINGS = pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")

ZERO_DECAY_REGIMES = [
    pytest.param("A-minus-inf", id="A-minus-inf"),
    pytest.param("dt-1e15", id="dt-1e15"),
]


def with_zero_decays(inputs: dict, regime: str) -> dict:
    """A copy of a scan's or an SSD scan's `inputs` in a ZERO_DECAY_REGIMES regime."""
    out = dict(inputs)
    if regime == "A-minus-inf":
        out["A"] = inputs["A"].clone()
        out["A"][1] = float("-inf")
    else:
        out["dt"] = inputs["dt"].clone()
        out["dt"][:, 2, 1] = 1e15
    return out


# An infinite x in one (row, channel) of a state update (Mamba-1's, "update", or Mamba-2's,
# "ssd_update"), of a scan's step 2 ("scan") or of an SSD scan's step 5 ("ssd_scan": the second
# of a chunk of 4, with chunks after it), where B and C are positive: the reference's y is +inf
# there and from there on, its steps before finite. State sizes with padding lanes past them at every vector width (3, 5; 8 with
# AVX-512's 16 fp32 lanes) and none (16): B's padding times dt x there is 0 * inf, NaN, which the
# updates' sums over the state took into y (found in review).
INFINITE_INPUT_STATES = [3, 5, 8, 16]


def with_an_infinite_x(kind: str, state: int, seed: int) -> dict:
    """Inputs (no D, whose D x would make the reference's y NaN) as INFINITE_INPUT_STATES says."""
    if kind == "scan":
        inputs = make_scan_inputs(ScanCase(3, 5, 6, state, z=True), seed=seed)
        at = (1, 2, 1)
    elif kind == "update":
        inputs = make_update_inputs(UpdateCase(3, 6, state, z=True), seed=seed)
        at = (1, 1)
    elif kind == "ssd_scan":
        inputs = make_ssd_inputs(SsdCase(2, 11, 2, 5, state, z=True, chunk_size=4, h0=True), seed=seed)
        at = (1, 5, 1, 2)
    else:
        inputs = make_ssd_update_inputs(SsdUpdateCase(3, 2, 5, state, z=True), seed=seed)
        at = (1, 1, 2)
    inputs["x"][at] = float("inf")
    inputs["B"], inputs["C"] = inputs["B"].abs() + 0.1, inputs["C"].abs() + 0.1
    return inputs


def reference_with_an_infinite_x(kind: str, inputs: dict):
    """(y, state) of the float64 reference; a state update's pool left as it was."""
    reference = {"scan": reference_scan, "ssd_scan": reference_ssd_scan, "update": reference_update,
                 "ssd_update": reference_ssd_update}[kind]
    return reference({**inputs, "return_state": True} if kind == "scan" else inputs)


def assert_infinities_as_the_reference(actual, expected, what: str) -> None:
    """NaN where the reference has NaN, its very infinities where it has them (some), and
    fp32-close elsewhere."""
    inf = torch.isinf(expected)
    assert inf.any(), f"{what}: the reference has no infinity to compare"
    nan = torch.isnan(actual)
    assert torch.equal(nan, torch.isnan(expected)), f"{what}: NaN at {nan.nonzero().tolist()}"
    assert torch.equal(actual[inf].double(), expected[inf].double()), \
        f"{what}: {actual[inf].tolist()} where the reference has {expected[inf].tolist()}"
    finite = torch.isfinite(expected)
    assert_close(actual[finite], expected[finite], torch.float32, what)


# --- packed sequences (cu_seqlens) -------------------------------------------------------------

def packed_slice(inputs: dict, kind: str, start: int, stop: int) -> dict:
    """One packed sequence's inputs: times start .. stop of x, dt, z, B and C. kind: "bld" or
    "bdl" (Mamba-1 layouts) or "ssd" (time on axis 1)."""
    out = dict(inputs)
    for name in ("x", "dt", "z", "B", "C"):
        if name in inputs:
            out[name] = inputs[name][..., start:stop] if kind == "bdl" else inputs[name][:, start:stop]
    return out


def assert_packed_matches_each_sequence(y, state, inputs: dict, h0, bounds, kind: str, dtype, what: str) -> None:
    """A packed call's y and states (state None without return_state) against the float64
    reference run on each sequence alone, from its own row of h0 (or zeros)."""
    reference = reference_ssd_scan if kind == "ssd" else reference_scan
    ys, states = [], []
    for i in range(len(bounds) - 1):
        one = packed_slice(inputs, kind, bounds[i], bounds[i + 1])
        if h0 is not None:
            one["h0"] = h0[i:i + 1]
        y_i, state_i = reference(one)
        ys.append(y_i)
        states.append(state_i)
    assert y.dtype == dtype, f"{what}: y dtype {y.dtype}"
    assert_close(y, torch.cat(ys, dim=2 if kind == "bdl" else 1), dtype, f"{what} y")
    if state is not None:
        assert state.dtype == state_dtype(dtype), f"{what}: state dtype {state.dtype}"
        assert_close(state, torch.cat(states), dtype, f"{what} states", state_tolerance(dtype))
