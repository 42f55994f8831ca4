"""The generic Mamba-2 (SSD) suite: every available backend that serves CPU tensors (except the reference, which is the oracle, and Triton, which has its own
interpreter suite) against the float64 reference; chaining, chunk sizes, packed sequences
(cu_seqlens, for the Mamba-1 scan too), the SSD scan against the Mamba-1 scan of the same
problem written per channel, and validation.

Inputs are fresh random draws each run; the seed is in every failure message.
"""

from __future__ import annotations

import math

import pytest
import torch

import scan_kernels
from kernel_cases import (
    DTYPES, LARGE_SSD_SCAN_CASES, ON_CUDA, SSD_DECAY_REGIMES, SSD_SCAN_CASES, SSD_UPDATE_CASES, STRIDED, ScanCase, SsdCase,
    SsdUpdateCase, assert_close, assert_packed_matches_each_sequence, assert_scan_outputs_match_reference,
    assert_ssd_matches_reference, assert_ssd_update_matches_reference, assert_update_outputs_match_reference,
    make_decay_regime_inputs, make_scan_inputs, make_ssd_inputs, make_ssd_update_inputs, nan_gapped, packed_slice,
    random_seed,
    reference_ssd_scan, reference_ssd_update, cpu_backends, ZERO_DECAY_REGIMES, with_zero_decays,
)
from kernel_cases import with_changes as _with


BACKENDS = [pytest.param(name, id=name) for name in cpu_backends()]
F32 = torch.float32


# --- scan and state update against the float64 reference ------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", SSD_SCAN_CASES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_ssd_scan_matches_reference(backend, case, dtype):
    seed = random_seed()
    assert_ssd_matches_reference(backend, case, dtype, seed, f"{backend} seed={seed}")


@pytest.mark.parametrize("case", LARGE_SSD_SCAN_CASES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_large_ssd_scan_matches_reference(backend, case):
    seed = random_seed()
    assert_ssd_matches_reference(backend, case, F32, seed, f"{backend} seed={seed}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", SSD_UPDATE_CASES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_ssd_state_update_matches_reference(backend, case, dtype):
    seed = random_seed()
    assert_ssd_update_matches_reference(backend, case, dtype, seed, f"{backend} seed={seed}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_ssd_update_int32_slots(backend):
    case = SsdUpdateCase(6, 4, 5, 3, groups=2, pool=9, padding_rows=2, D=True, z=True)
    seed = random_seed()
    inputs = make_ssd_update_inputs(case, F32, seed=seed)
    inputs["slots"] = inputs["slots"].to(torch.int32)
    before = inputs["state"].clone()
    y = scan_kernels.ssd_state_update(**inputs, backend=backend)
    assert_update_outputs_match_reference(case, F32, inputs, before, y, f"{backend} seed={seed}",
                                          reference=reference_ssd_update)


@pytest.mark.parametrize("backend", BACKENDS)
def test_ssd_update_all_padding_rows_touch_nothing(backend):
    case = SsdUpdateCase(4, 2, 3, 5, pool=6, padding_rows=4, D=True, z=True)
    inputs = make_ssd_update_inputs(case, F32, seed=random_seed())
    before = inputs["state"].clone()
    y = scan_kernels.ssd_state_update(**inputs, backend=backend)
    assert torch.equal(y, torch.zeros(4, 2, 3))
    assert torch.equal(inputs["state"], before)


@pytest.mark.parametrize("backend", BACKENDS)
def test_ssd_long_strong_decay_stays_finite(backend):
    """Decays of e^-1 to e^-20 per step, e^-1500 and below over the sequence: a formulation
    that takes exp of positive sums (a cumulative sum over the whole sequence, or the masked
    upper triangle of a chunk's decays) overflows here; the true state keeps the latest inputs."""
    case = SsdCase(1, 1501, 3, 4, 5, chunk_size=64, D=True, dt_bias=True, dt_softplus=True)
    seed = random_seed()
    what = f"{backend} seed={seed}"
    inputs = make_ssd_inputs(case, F32, seed=seed)
    inputs["dt_bias"] = inputs["dt_bias"] + 10.0  # softplus(dt) ~ 10 with A in [-2, -0.1]
    y, state = scan_kernels.ssd_scan(**inputs, backend=backend)
    assert torch.isfinite(y).all() and torch.isfinite(state).all(), f"{what}: inf or NaN"
    assert_scan_outputs_match_reference(case, F32, inputs, y, state, what, reference=reference_ssd_scan)


@pytest.mark.parametrize("minus_A, dt_range, seq", SSD_DECAY_REGIMES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_ssd_scan_decay_regimes(backend, minus_A, dt_range, seq):
    case = SsdCase(2, seq, 2, 20, 5, D=True, h0=True)
    seed = random_seed()
    what = f"{backend} A={-minus_A} dt in {dt_range} seed={seed}"
    inputs = make_decay_regime_inputs(case, minus_A, dt_range, seed)
    y, state = scan_kernels.ssd_scan(**inputs, backend=backend)
    y_ref, state_ref = reference_ssd_scan(inputs)
    # Against the largest magnitude (at least 1): where the state grows a millionfold, entries
    # of y that cancel to near zero carry fp32 rounding of that size in any formulation.
    for got, expected, name in ((y, y_ref, "y"), (state, state_ref, "state")):
        scale = max(1.0, float(expected.abs().max()))
        assert_close(got.double() / scale, expected.double() / scale, F32, f"{what} {name} / {scale:.3g}")


# One large step early in every chunk (its dt·A in the thousands, its input dt x large too), the
# others small: minus A, the large dt. The chunk's cumulative log decay then reaches thousands
# after that step, and decays between the small steps after it, taken as differences of it, were
# off by its fp32 rounding there (1e-3 in the exponent), which the large input's share of y,
# decaying slowly over those steps, carried (the torch form did; scan_kernels/eager_ssd.py,
# "Exponents").
SSD_LARGE_STEP_REGIMES = [
    pytest.param(16.0, 500.0, id="dtA-8000"),
    pytest.param(2.0, 5000.0, id="dtA-10000"),
]


@pytest.mark.parametrize("minus_A, large_dt", SSD_LARGE_STEP_REGIMES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_ssd_scan_one_large_step_then_small_ones(backend, minus_A, large_dt):
    case = SsdCase(2, 100, 2, 8, 5, chunk_size=32, h0=True)
    seed = random_seed()
    inputs = make_decay_regime_inputs(case, minus_A, (0.001, 0.05), seed)
    inputs["dt"][:, 1::32] = large_dt  # the second step of every chunk
    y, state = scan_kernels.ssd_scan(**inputs, backend=backend)
    assert_scan_outputs_match_reference(case, F32, inputs, y, state, f"{backend} seed={seed}",
                                        reference=reference_ssd_scan)


@pytest.mark.parametrize("regime", ZERO_DECAY_REGIMES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_ssd_scan_with_decays_of_zero(backend, regime):
    case = SsdCase(2, 7, 3, 4, 3, chunk_size=4, D=True, z=True, dt_softplus=True, h0=True)
    seed = random_seed()
    inputs = with_zero_decays(make_ssd_inputs(case, seed=seed), regime)
    y, state = scan_kernels.ssd_scan(**inputs, backend=backend)
    assert_scan_outputs_match_reference(case, F32, inputs, y, state, f"{backend} {regime} seed={seed}",
                                        reference=reference_ssd_scan, to_term_magnitudes=True)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_state_growing_past_e44_within_a_chunk_or_a_step(backend):
    """A > 0: every decay a growth, e^48 or so over one chunk of the scan (the torch form's
    exponents were capped at the bound that keeps its masked ones finite, about e^43.7 in fp32)
    and e^50 in one step of the update. The answers fit fp32; each backend's is the reference's."""
    seed = random_seed()
    gen = torch.Generator().manual_seed(seed)
    seq = 40
    inputs = dict(x=torch.rand(1, seq, 2, 3, generator=gen), dt=torch.rand(1, seq, 2, generator=gen) * 0.2 + 1.1,
                  A=torch.ones(2), B=torch.rand(1, seq, 1, 4, generator=gen), C=torch.rand(1, seq, 1, 4, generator=gen),
                  return_state=True)
    y, state = scan_kernels.ssd_scan(**inputs, chunk_size=64, backend=backend)
    y_ref, state_ref = reference_ssd_scan(inputs)
    for got, expected, name in ((y, y_ref, "y"), (state, state_ref, "state")):
        scale = float(expected.abs().max())
        assert scale > math.exp(44), f"seed={seed}: the case grows only to {scale:.3g}"
        assert_close(got.double() / scale, expected.double() / scale, F32, f"{backend} seed={seed} {name}")
    step = dict(state=torch.rand(2, 2, 3, 4, generator=gen), x=torch.rand(2, 2, 3, generator=gen),
                dt=torch.full((2, 2), 50.0), A=torch.ones(2), B=torch.rand(2, 1, 4, generator=gen),
                C=torch.rand(2, 1, 4, generator=gen))
    expected = scan_kernels.ssd_state_update(**{**step, "state": step["state"].double(),
                                           **{k: step[k].double() for k in ("x", "dt", "A", "B", "C")}},
                                        backend="reference")
    got = scan_kernels.ssd_state_update(**step, backend=backend)
    scale = float(expected.abs().max())
    assert_close(got.double() / scale, expected / scale, F32, f"{backend} seed={seed} one step of e^50")


@pytest.mark.parametrize("chunk_size", [pytest.param(1, id="chunk1"), pytest.param(4, id="chunk4"),
                                        pytest.param(None, id="default-chunk")])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_state_decayed_past_e44_then_grown_back(backend, chunk_size):
    """One step decays the state by e^-50 and a later one (dt < 0) grows it by e^50, once in the
    prefill (ssd_scan, the growth in a later chunk than the decay for chunks of 1 and 4) and once
    over its decoding steps (ssd_state_update), with no input in between: the state comes back
    as it was, and y after it. The torch form kept decays below about e^-43.6 at that bound,
    which the growth then multiplied back up (e^6 too large)."""
    seed = random_seed()
    what = f"{backend} chunk_size={chunk_size} seed={seed}"
    gen = torch.Generator().manual_seed(seed)
    seq, prefill, heads = 16, 10, 2
    inputs = dict(x=torch.rand(1, seq, heads, 3, generator=gen), dt=torch.rand(1, seq, heads, generator=gen) * 0.25 + 0.05,
                  A=-torch.ones(heads), B=torch.rand(1, seq, 1, 4, generator=gen), C=torch.rand(1, seq, 1, 4, generator=gen),
                  h0=torch.rand(1, heads, 3, 4, generator=gen), return_state=True)
    for decay_step, growth_step in ((5, 9), (11, 14)):
        inputs["dt"][:, decay_step], inputs["dt"][:, growth_step] = 50.0, -50.0
        inputs["x"][:, decay_step:growth_step] = 0.0
    y_ref, state_ref = reference_ssd_scan(inputs)
    y, state = scan_kernels.ssd_scan(**{**packed_slice(inputs, "ssd", 0, prefill), "chunk_size": chunk_size}, backend=backend)
    assert_close(y, y_ref[:, :prefill], F32, f"{what} prefill y")
    for t in range(prefill, seq):
        step = {k: inputs[k][:, t] for k in ("x", "dt", "B", "C")}
        y_t = scan_kernels.ssd_state_update(state, **step, A=inputs["A"], backend=backend)
        assert_close(y_t, y_ref[:, t], F32, f"{what} y at step {t}")
    assert_close(state, state_ref, F32, f"{what} state")


def _assert_same_nans_infs_and_close(actual, expected, what: str) -> None:
    """NaN exactly where `expected` has it; elsewhere fp32-close, an inf equal to an inf of the
    same sign. (kernel_cases.assert_same_nans_and_close requires some NaN: the state an inf
    input leaves has none.)"""
    nan, got = torch.isnan(expected), torch.isnan(actual)
    assert torch.equal(got, nan), f"{what}: NaN at {got.nonzero().tolist()}, the reference's at {nan.nonzero().tolist()}"
    assert_close(actual[~nan], expected[~nan], F32, what)


# One non-finite value in x or dt (batch row 0, step 5, head 1): step 5 lies inside a chunk for
# each chunk size below (the second of 4, the first of 8, the only one by default). inf dt is
# unclamped (the clamp would make it finite); NaN dt clamped, as Mamba's dt_limit clamps it.
NON_FINITE_INPUTS = [
    pytest.param("dt", float("nan"), True, id="nan-dt-clamped"),
    pytest.param("x", float("nan"), False, id="nan-x"),
    pytest.param("dt", float("inf"), False, id="inf-dt"),
    pytest.param("x", float("inf"), False, id="inf-x"),
]


@pytest.mark.parametrize("chunk_size", [pytest.param(4, id="chunk4"), pytest.param(8, id="chunk8"),
                                        pytest.param(None, id="default-chunk")])
@pytest.mark.parametrize("name, value, clamp", NON_FINITE_INPUTS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_non_finite_input_spreads_as_in_the_recurrence(backend, name, value, clamp, chunk_size):
    """y and the final state are NaN (and inf) exactly where the reference's are: from the bad
    step on, in its batch row and head only; never at the earlier steps of its chunk, which the
    torch backend's intra-chunk matmul reached (0 x NaN above the diagonal)."""
    seed = random_seed()
    what = f"{backend} {name}={value} chunk_size={chunk_size} seed={seed}"
    case = SsdCase(2, 13, 3, 2, 4, chunk_size=chunk_size, D=True, clamp=clamp, h0=True)
    inputs = make_ssd_inputs(case, F32, seed=seed)
    if name == "x":
        inputs["x"][0, 5, 1, 0] = value
    else:
        inputs["dt"][0, 5, 1] = value
    y, state = scan_kernels.ssd_scan(**inputs, backend=backend)
    y_ref, state_ref = reference_ssd_scan(inputs)
    assert not torch.isfinite(y_ref[0, 5, 1]).all(), f"{what}: the case does not reach y"
    _assert_same_nans_infs_and_close(y, y_ref, f"{what} y")
    _assert_same_nans_infs_and_close(state, state_ref, f"{what} state")


@ON_CUDA
def test_torch_ssd_on_cuda():
    """The torch backend on CUDA tensors (the GPU's fallback where Triton is missing): every
    scan and update case, fp32 and bf16."""
    for dtype in (F32, torch.bfloat16):
        for case in SSD_SCAN_CASES + LARGE_SSD_SCAN_CASES:
            seed = random_seed()
            assert_ssd_matches_reference("torch", case.values[0], dtype, seed,
                                         f"cuda {case.id} seed={seed}", device="cuda")
        for case in SSD_UPDATE_CASES:
            seed = random_seed()
            assert_ssd_update_matches_reference("torch", case.values[0], dtype, seed,
                                                f"cuda {case.id} seed={seed}", device="cuda")


# --- chaining and chunking: the split of the sequence changes nothing ------------------------

SSD_CHAIN_CASES = [
    pytest.param(SsdCase(2, 23, 4, 6, 5, groups=2, chunk_size=8, D=True, z=True, dt_bias=True,
                         dt_softplus=True, clamp=True, h0=True), 11, id="mid-chunk-all-options"),
    pytest.param(SsdCase(1, 24, 3, 5, 7, chunk_size=8, D=True, D_per_channel=True), 16,
                 id="at-chunk-boundary"),
    pytest.param(SsdCase(2, 40, 2, 3, 4, groups=2, h0=True), 1, id="after-first-step-default-chunk"),
]


@pytest.mark.parametrize("case,split", SSD_CHAIN_CASES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_ssd_scan_in_two_calls_equals_one(backend, case, split):
    seed = random_seed()
    what = f"{backend} seed={seed}"
    inputs = make_ssd_inputs(case, F32, seed=seed)
    y_full, state_full = scan_kernels.ssd_scan(**inputs, backend=backend)
    y1, state1 = scan_kernels.ssd_scan(**packed_slice(inputs, "ssd", 0, split), backend=backend)
    y2, state2 = scan_kernels.ssd_scan(**{**packed_slice(inputs, "ssd", split, case.seq), "h0": state1}, backend=backend)
    assert_close(torch.cat([y1, y2], dim=1), y_full, F32, f"{what} y")
    assert_close(state2, state_full, F32, f"{what} state")


CHUNK_SIZES = [1, 2, 5, 8, 13, 64, None]


@pytest.mark.parametrize("seq, chunk_size, chunk", [
    pytest.param(1000, None, 64, id="default"),
    pytest.param(10, 64, 10, id="longer-than-seq"),
    pytest.param(5000, 4096, 1024, id="capped"),
    pytest.param(5000, 2 ** 40, 1024, id="capped-huge"),
])
def test_the_torch_backends_chunk_is_capped(seq, chunk_size, chunk):
    """A chunk_size as long as the sequence made the torch form's [Q, Q] decays and scores
    quadratic in seq (a wire client sends chunk_size): larger chunks run at _args.MAX_CHUNK, as on Triton."""
    from scan_kernels import _args, eager_ssd

    assert (eager_ssd.DEFAULT_CHUNK, _args.MAX_CHUNK) == (64, 1024)
    assert eager_ssd._chunk_size(chunk_size, seq) == chunk


@pytest.mark.parametrize("case", [
    pytest.param(SsdCase(2, 13, 4, 3, 6, groups=2, D=True, z=True, dt_bias=True, dt_softplus=True,
                         h0=True), id="seq13"),
    pytest.param(SsdCase(3, 1, 2, 5, 4, h0=True), id="seq1"),
    pytest.param(SsdCase(1, 3, 3, 2, 5, D=True, clamp=True), id="seq3"),
])
@pytest.mark.parametrize("backend", BACKENDS)
def test_chunk_size_changes_nothing(backend, case):
    """Chunks of 1, of sizes that divide seq or leave a remainder, of exactly seq and beyond it:
    each matches the reference, and each the others; y and the state are contiguous however seq
    was padded and however many groups there are (the torch form's state was a strided view
    with one group)."""
    seed = random_seed()
    inputs = make_ssd_inputs(case, F32, seed=seed)
    first = None
    for chunk in CHUNK_SIZES:
        what = f"{backend} chunk_size={chunk} seed={seed}"
        y, state = scan_kernels.ssd_scan(**{**inputs, "chunk_size": chunk}, backend=backend)
        assert y.is_contiguous() and state.is_contiguous(), f"{what}: y or the state not contiguous"
        assert_scan_outputs_match_reference(case, F32, inputs, y, state, what, reference=reference_ssd_scan)
        if first is None:
            first = (y, state)
        else:
            assert_close(y, first[0], F32, f"{what} y against chunk_size={CHUNK_SIZES[0]}")
            assert_close(state, first[1], F32, f"{what} state against chunk_size={CHUNK_SIZES[0]}")


@pytest.mark.parametrize("steps", [pytest.param(1, id="1-step"), pytest.param(6, id="6-steps")])
@pytest.mark.parametrize("backend", BACKENDS)
def test_ssd_prefill_then_state_updates_equals_one_scan(backend, steps):
    """A session's prefill (ssd_scan) then its decoding steps (ssd_state_update on pool rows by
    slot, beside other sessions' rows that must stay untouched) give the one scan's y and state."""
    case = SsdCase(3, 19, 4, 3, 5, groups=2, chunk_size=8, D=True, z=True, dt_bias=True,
                   dt_softplus=True, clamp=True, h0=True)
    seed = random_seed()
    what = f"{backend} seed={seed}"
    inputs = make_ssd_inputs(case, F32, seed=seed)
    y_full, state_full = scan_kernels.ssd_scan(**inputs, backend=backend)
    prefill = case.seq - steps
    _, state = scan_kernels.ssd_scan(**packed_slice(inputs, "ssd", 0, prefill), backend=backend)
    slots = torch.tensor([4, 0, 2])
    pool = torch.randn(6, *state.shape[1:], generator=torch.Generator().manual_seed(seed))
    pool[slots] = state
    others = pool[[1, 3, 5]].clone()
    shared = {k: inputs[k] for k in ("A", "D", "dt_bias", "dt_softplus", "dt_min", "dt_max")}
    for t in range(prefill, case.seq):
        step = {k: inputs[k][:, t] for k in ("x", "dt", "B", "C", "z")}
        y_t = scan_kernels.ssd_state_update(pool, **step, **shared, slots=slots, backend=backend)
        assert_close(y_t, y_full[:, t], F32, f"{what} y at step {t}")
    assert_close(pool[slots], state_full, F32, f"{what} state")
    assert torch.equal(pool[[1, 3, 5]], others), f"{what}: other sessions' rows changed"


# --- Mamba-2 is Mamba-1 with one decay per head --------------------------------------------------

def _as_mamba1(inputs: dict, headdim: int, head_axis: int) -> dict:
    """The SSD problem (a scan's inputs, or an update's, whose heads axis is 1 rather than 2) as
    the Mamba-1 problem over heads x headdim channels: x and z flattened, dt and dt_bias
    repeated over headdim, A over headdim and state, D per channel, h0 and the pool (copied)
    flattened; B and C keep their groups (a group's heads are a contiguous run of channels)."""
    p = headdim
    out = {k: v for k, v in inputs.items() if k != "chunk_size"}
    out["x"] = inputs["x"].flatten(head_axis, head_axis + 1)
    out["dt"] = inputs["dt"].repeat_interleave(p, dim=head_axis)
    n = inputs["B"].shape[-1]
    out["A"] = inputs["A"].repeat_interleave(p)[:, None].expand(-1, n).contiguous()
    if "z" in inputs:
        out["z"] = inputs["z"].flatten(head_axis, head_axis + 1)
    if "dt_bias" in inputs:
        out["dt_bias"] = inputs["dt_bias"].repeat_interleave(p)
    if "D" in inputs:
        D = inputs["D"]
        out["D"] = (D if D.dim() == 2 else D[:, None].expand(-1, p)).flatten()
    for name in ("h0", "state"):
        if name in inputs:
            out[name] = inputs[name].flatten(1, 2).clone()
    return out


CROSS_CASES = [
    pytest.param(SsdCase(2, 21, 4, 3, 5, groups=2, chunk_size=8, D=True, D_per_channel=True, z=True,
                         dt_bias=True, dt_softplus=True, clamp=True, h0=True), id="groups2-all-options"),
    pytest.param(SsdCase(1, 9, 3, 4, 6, D=True), id="D-per-head"),
]
WITH_REFERENCE = [*BACKENDS, pytest.param("reference", id="reference")]


@pytest.mark.parametrize("case", CROSS_CASES)
@pytest.mark.parametrize("backend", WITH_REFERENCE)
def test_ssd_scan_equals_mamba1_scan_per_channel(backend, case):
    """The tie between the generations, on each backend (the reference too: its two oracles
    were written apart): y alike, and the state [b, h, p, n] is Mamba-1's [b, h*p, n]."""
    seed = random_seed()
    what = f"{backend} seed={seed}"
    inputs = make_ssd_inputs(case, F32, seed=seed)
    y, state = scan_kernels.ssd_scan(**inputs, backend=backend)
    y1, state1 = scan_kernels.selective_scan(**_as_mamba1(inputs, case.headdim, head_axis=2), backend=backend)
    assert_close(y.flatten(2), y1, F32, f"{what} y")
    assert_close(state.flatten(1, 2), state1, F32, f"{what} state")


@pytest.mark.parametrize("backend", WITH_REFERENCE)
def test_ssd_update_equals_mamba1_update_per_channel(backend):
    case = SsdUpdateCase(5, 4, 3, 6, groups=2, pool=7, padding_rows=1, D=True, D_per_channel=True,
                         z=True, dt_bias=True, dt_softplus=True, clamp=True)
    seed = random_seed()
    what = f"{backend} seed={seed}"
    inputs = make_ssd_update_inputs(case, F32, seed=seed)
    mamba1 = _as_mamba1(inputs, case.headdim, head_axis=1)
    y = scan_kernels.ssd_state_update(**inputs, backend=backend)
    y1 = scan_kernels.selective_state_update(**mamba1, backend=backend)
    assert_close(y.flatten(1), y1, F32, f"{what} y")
    assert_close(inputs["state"].flatten(1, 2), mamba1["state"], F32, f"{what} pool")


# --- packed sequences (cu_seqlens) -------------------------------------------------------------

# Sequences of 5, 1, 11 and 12 timesteps: one shorter than a chunk of 4, one of a single step,
# two crossing chunk boundaries at different offsets.
BOUNDS = [0, 5, 6, 17, 29]
PACKED_OPTIONS = [
    pytest.param(True, True, id="h0-state"),
    pytest.param(False, True, id="state"),
    pytest.param(True, False, id="h0"),
    pytest.param(False, False, id="plain"),
]


def _seq_rows(shape, seed: int) -> torch.Tensor:
    return torch.randn(len(BOUNDS) - 1, *shape, generator=torch.Generator().manual_seed(seed + 1))


@pytest.mark.parametrize("h0,return_state", PACKED_OPTIONS)
@pytest.mark.parametrize("dtype", [pytest.param(F32, id="f32"), pytest.param(torch.bfloat16, id="bf16")])
@pytest.mark.parametrize("backend", BACKENDS)
def test_ssd_packed_sequences_are_separate_scans(backend, dtype, h0, return_state):
    case = SsdCase(1, BOUNDS[-1], 4, 3, 5, groups=2, chunk_size=4, D=True, z=True, dt_bias=True,
                   dt_softplus=True, return_state=return_state)
    seed = random_seed()
    inputs = make_ssd_inputs(case, dtype, seed=seed)
    rows = _seq_rows((4, 3, 5), seed) if h0 else None
    out = scan_kernels.ssd_scan(**inputs, h0=rows, cu_seqlens=torch.tensor(BOUNDS), backend=backend)
    y, state = out if return_state else (out, None)
    assert_packed_matches_each_sequence(y, state, inputs, rows, BOUNDS, "ssd", dtype, f"{backend} seed={seed}")


@pytest.mark.parametrize("h0,return_state", PACKED_OPTIONS)
@pytest.mark.parametrize("layout", ["bld", "bdl"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_mamba1_packed_sequences_are_separate_scans(backend, layout, h0, return_state):
    case = ScanCase(1, BOUNDS[-1], 6, 4, groups=2, layout=layout, D=True, z=True, dt_bias=True,
                    dt_softplus=True, return_state=return_state)
    seed = random_seed()
    inputs = make_scan_inputs(case, F32, seed=seed)
    rows = _seq_rows((6, 4), seed) if h0 else None
    cu = torch.tensor(BOUNDS, dtype=torch.int32)
    out = scan_kernels.selective_scan(**inputs, h0=rows, cu_seqlens=cu, backend=backend)
    y, state = out if return_state else (out, None)
    assert_packed_matches_each_sequence(y, state, inputs, rows, BOUNDS, layout, F32, f"{backend} seed={seed}")


# --- strided (non-contiguous) inputs ----------------------------------------------------------

@pytest.mark.parametrize("restride", STRIDED)
@pytest.mark.parametrize("backend", BACKENDS)
def test_ssd_scan_strided_inputs(backend, restride):
    case = SsdCase(2, 11, 4, 3, 5, groups=2, chunk_size=4, D=True, D_per_channel=True, z=True,
                   dt_bias=True, h0=True)
    seed = random_seed()
    inputs = make_ssd_inputs(case, F32, seed=seed)
    strided = {k: restride(v) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    assert not strided["x"].is_contiguous()
    y, state = scan_kernels.ssd_scan(**strided, backend=backend)
    assert_scan_outputs_match_reference(case, F32, inputs, y, state, f"{backend} seed={seed}",
                                        reference=reference_ssd_scan)


@pytest.mark.parametrize("restride", STRIDED)
@pytest.mark.parametrize("backend", BACKENDS)
def test_ssd_update_strided_inputs_and_state(backend, restride):
    case = SsdUpdateCase(5, 4, 3, 6, groups=2, pool=8, padding_rows=2, D=True, z=True, dt_bias=True)
    seed = random_seed()
    what = f"{backend} seed={seed}"
    inputs = make_ssd_update_inputs(case, F32, seed=seed)
    strided = {k: restride(v) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
               for k, v in inputs.items()}
    state = strided["state"]
    assert not state.is_contiguous()
    before = state.clone()
    y = scan_kernels.ssd_state_update(**strided, backend=backend)
    assert_update_outputs_match_reference(case, F32, strided, before, y, what, reference=reference_ssd_update)
    if restride is nan_gapped:
        assert torch.isnan(state._base[..., 1]).all(), f"{what}: the update wrote outside the state view"


# --- validation --------------------------------------------------------------------------------

def _ssd_base() -> dict:
    # x [2, 5, 4, 3], dt [2, 5, 4], A [4], B/C [2, 5, 2, 6], D [4], h0 [2, 4, 3, 6]
    case = SsdCase(2, 5, 4, 3, 6, groups=2, D=True, z=True, dt_bias=True, h0=True)
    return make_ssd_inputs(case, F32, seed=random_seed())


SHAPE, INPUT, DTYPE = scan_kernels.ShapeMismatch, scan_kernels.KernelInputError, scan_kernels.DtypeNotAllowed

SSD_SCAN_ERRORS = [
    # (change to the valid arguments, error class, field, a fragment of `got`)
    pytest.param(_with(x=lambda a: a["x"][:, :, 0]), SHAPE, "x", "[2, 5, 3]", id="x-3d"),
    pytest.param(_with(x=lambda a: a["x"][None]), SHAPE, "x", "[1, 2, 5, 4, 3]", id="x-5d"),
    pytest.param(_with(x=lambda a: a["x"][:, :0]), SHAPE, "x", "[2, 0, 4, 3]", id="x-empty"),
    pytest.param(_with(x=lambda a: a["x"].to(torch.int32)), DTYPE, "x", "int32", id="x-int-dtype"),
    pytest.param(_with(dt=lambda a: a["dt"][..., None]), SHAPE, "dt", "[2, 5, 4, 1]", id="dt-4d"),
    pytest.param(_with(dt=lambda a: a["dt"][:, :, :3]), SHAPE, "dt", "[2, 5, 3]", id="dt-heads"),
    pytest.param(_with(A=lambda a: a["A"][:, None]), SHAPE, "A", "[4, 1]", id="A-2d"),
    pytest.param(_with(A=lambda a: a["A"][:3]), SHAPE, "A", "[3]", id="A-heads"),
    pytest.param(_with(B=lambda a: a["B"][:, :, 0]), SHAPE, "B", "[2, 5, 6]", id="B-3d"),
    pytest.param(_with(B=lambda a: a["B"][:, :4]), SHAPE, "B", "[2, 4, 2, 6]", id="B-seq"),
    pytest.param(_with(B=lambda a: a["B"][..., :0]), SHAPE, "B", "[2, 5, 2, 0]", id="B-no-state"),
    pytest.param(_with(B=lambda a: torch.rand(2, 5, 3, 6), C=lambda a: torch.rand(2, 5, 3, 6)), SHAPE, "B",
                 "3 groups", id="heads-not-divisible-by-groups"),
    pytest.param(_with(C=lambda a: a["C"][:, :, :1]), SHAPE, "C", "[2, 5, 1, 6]", id="C-groups-differ"),
    pytest.param(_with(D=lambda a: a["D"][:3]), SHAPE, "D", "[3]", id="D-heads"),
    pytest.param(_with(D=lambda a: torch.rand(4, 2)), SHAPE, "D", "[4, 2]", id="D-headdim"),
    pytest.param(_with(D=lambda a: torch.rand(4, 3, 1)), SHAPE, "D", "[4, 3, 1]", id="D-3d"),
    pytest.param(_with(dt_bias=lambda a: a["dt_bias"][None]), SHAPE, "dt_bias", "[1, 4]", id="dt_bias-2d"),
    pytest.param(_with(z=lambda a: a["z"][:1]), SHAPE, "z", "[1, 5, 4, 3]", id="z-shape"),
    pytest.param(_with(h0=lambda a: a["h0"][:, :, :2]), SHAPE, "h0", "[2, 4, 2, 6]", id="h0-shape"),
    pytest.param(_with(chunk_size=0), INPUT, "chunk_size", "0", id="chunk_size-0"),
    pytest.param(_with(chunk_size=-4), INPUT, "chunk_size", "-4", id="chunk_size-negative"),
    pytest.param(_with(chunk_size=True), INPUT, "chunk_size", "True", id="chunk_size-bool"),
    pytest.param(_with(chunk_size=8.0), INPUT, "chunk_size", "8.0", id="chunk_size-float"),
    pytest.param(_with(dt_min=0.5, dt_max=0.1), INPUT, "dt_max", "0.1", id="dt_min-above-dt_max"),
    pytest.param(_with(dt_min=1e39), INPUT, "dt_min", "1e+39", id="dt_min-beyond-float32"),
    pytest.param(_with(dt_softplus="false"), INPUT, "dt_softplus", "str", id="dt_softplus-str"),
    pytest.param(_with(return_state="no"), INPUT, "return_state", "str", id="return_state-str"),
]


def _assert_rejected(call, args, exc, field, got):
    with pytest.raises(scan_kernels.KernelInputError) as info:
        call(**args)
    err = info.value
    assert type(err) is exc, f"{type(err).__name__} ({err}), expected {exc.__name__}"
    assert err.field == field, f"field {err.field!r} ({err}), expected {field!r}"
    assert got in err.got, f"got {err.got!r} does not mention {got!r}"
    assert err.expected and err.expected in str(err)


@pytest.mark.parametrize("change,exc,field,got", SSD_SCAN_ERRORS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_ssd_scan_rejects_malformed_arguments(backend, change, exc, field, got):
    _assert_rejected(lambda **a: scan_kernels.ssd_scan(**a, backend=backend), change(_ssd_base()), exc, field, got)


def _inference_tensor(t: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return t.clone()


def _ssd_update_base() -> dict:
    # state [5, 4, 3, 6], x [3, 4, 3], dt [3, 4], B/C [3, 2, 6], slots [3] into 5 rows
    case = SsdUpdateCase(3, 4, 3, 6, groups=2, pool=5, padding_rows=1, D=True, z=True, dt_bias=True)
    return make_ssd_update_inputs(case, F32, seed=random_seed())


SSD_UPDATE_ERRORS = [
    pytest.param(_with(state=lambda a: a["state"][:, 0]), SHAPE, "state", "[5, 3, 6]", id="state-3d"),
    pytest.param(_with(state=lambda a: a["state"][:, :, :, :0]), SHAPE, "state", "[5, 4, 3, 0]",
                 id="state-no-state-axis"),
    pytest.param(_with(state=lambda a: a["state"].to(torch.int64)), DTYPE, "state", "int64", id="state-int-dtype"),
    pytest.param(_with(state=lambda a: a["state"][:1].expand(5, 4, 3, 6)), INPUT, "state", "strides [0,",
                 id="state-rows-share-memory"),
    pytest.param(_with(state=lambda a: a["state"].as_strided((5, 4, 3, 6), (6, 18, 6, 1))), INPUT, "state",
                 "strides [6, 18, 6, 1]", id="state-rows-overlap"),
    pytest.param(_with(x=lambda a: a["state"][:3, :, :, 0]), INPUT, "x", "sharing memory with state",
                 id="x-inside-state"),
    pytest.param(_with(state=lambda a: a["state"].clone().requires_grad_(True)), INPUT, "state", "requires_grad",
                 id="state-requires-grad"),
    pytest.param(_with(x=lambda a: a["x"].flatten(1)), SHAPE, "x", "[3, 12]", id="x-2d"),
    pytest.param(_with(x=lambda a: a["x"][:, :, :2]), SHAPE, "x", "[3, 4, 2]", id="x-headdim"),
    pytest.param(_with(dt=lambda a: a["dt"][..., None]), SHAPE, "dt", "[3, 4, 1]", id="dt-3d"),
    pytest.param(_with(A=lambda a: a["A"][:, None]), SHAPE, "A", "[4, 1]", id="A-2d"),
    pytest.param(_with(B=lambda a: a["B"][:, 0]), SHAPE, "B", "[3, 6]", id="B-2d"),
    pytest.param(_with(B=lambda a: torch.rand(3, 3, 6), C=lambda a: torch.rand(3, 3, 6)), SHAPE, "B",
                 "3 groups", id="heads-not-divisible-by-groups"),
    pytest.param(_with(C=lambda a: a["C"][:, :, :5]), SHAPE, "C", "[3, 2, 5]", id="C-shape"),
    pytest.param(_with(D=lambda a: torch.rand(4, 3, 2)), SHAPE, "D", "[4, 3, 2]", id="D-3d"),
    pytest.param(_with(D=lambda a: torch.rand(2)), SHAPE, "D", "[2]", id="D-heads"),
    pytest.param(_with(z=lambda a: a["z"][:, :1]), SHAPE, "z", "[3, 1, 3]", id="z-shape"),
    pytest.param(_with(slots=lambda a: torch.tensor([0, 5, -1])), SHAPE, "slots", "5", id="slots-beyond-pool"),
    pytest.param(_with(slots=lambda a: a["slots"].float()), INPUT, "slots", "float32", id="slots-float"),
    pytest.param(_with(slots=lambda a: a["slots"][:2]), SHAPE, "slots", "[2]", id="slots-shape"),
    pytest.param(_with(slots=None), SHAPE, "state", "5 rows", id="pool-differs-without-slots"),
    # Two rows on one slot: the cpu kernel's second row read the first's update, the reference
    # wrote one of the two (found in review: their y and state differed).
    pytest.param(_with(slots=lambda a: torch.tensor([3, 3, -1])), INPUT, "slots", "slot 3 named 2 times",
                 id="slots-duplicated"),
    pytest.param(_with(slots=lambda a: a["slots"].to("meta")), INPUT, "slots", "meta", id="slots-on-meta"),
    pytest.param(_with(state=lambda a: _inference_tensor(a["state"])), INPUT, "state", "inference tensor",
                 id="state-inference-tensor"),
]


@pytest.mark.parametrize("change,exc,field,got", SSD_UPDATE_ERRORS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_ssd_update_rejects_malformed_arguments(backend, change, exc, field, got):
    args = change(_ssd_update_base())
    before = args["state"].clone()
    _assert_rejected(lambda **a: scan_kernels.ssd_state_update(**a, backend=backend), args, exc, field, got)
    assert torch.equal(args["state"], before), "a rejected call changed the state"


def _packed_base(kind: str) -> dict:
    """Batch-1 inputs of seq 7 cut [0, 3, 7], with h0 rows for the two sequences."""
    seed = random_seed()
    if kind == "ssd":
        inputs = make_ssd_inputs(SsdCase(1, 7, 4, 3, 6, groups=2, D=True, z=True), F32, seed=seed)
        rows = (4, 3, 6)
    else:
        inputs = make_scan_inputs(ScanCase(1, 7, 6, 4, groups=2, layout=kind, D=True, z=True), F32, seed=seed)
        rows = (6, 4)
    return {**inputs, "h0": _seq_rows(rows, seed)[:2], "cu_seqlens": torch.tensor([0, 3, 7])}


def _batch_doubled(a: dict) -> dict:
    return {**a, **{k: torch.cat([a[k], a[k]]) for k in ("x", "dt", "z", "B", "C")}}


PACKED_ERRORS = [
    pytest.param(_with(cu_seqlens=lambda a: torch.tensor([0, 3, 3, 7])), INPUT, "cu_seqlens", "3 then 3",
                 id="empty-sequence"),
    pytest.param(_with(cu_seqlens=lambda a: torch.tensor([0, 5, 4, 7])), INPUT, "cu_seqlens", "5 then 4",
                 id="decreasing"),
    pytest.param(_with(cu_seqlens=lambda a: torch.tensor([0, 3, 6])), INPUT, "cu_seqlens", "0 .. 6",
                 id="not-ending-at-seq"),
    pytest.param(_with(cu_seqlens=lambda a: torch.tensor([1, 3, 7])), INPUT, "cu_seqlens", "1 .. 7",
                 id="not-starting-at-0"),
    pytest.param(_with(cu_seqlens=lambda a: torch.tensor([0.0, 3.0, 7.0])), DTYPE, "cu_seqlens", "float32",
                 id="float-dtype"),
    pytest.param(_with(cu_seqlens=[0, 3, 7]), INPUT, "cu_seqlens", "list", id="a-list"),
    pytest.param(_with(cu_seqlens=lambda a: a["cu_seqlens"].to("meta")), INPUT, "cu_seqlens", "meta",
                 id="on-meta"),
    pytest.param(_with(cu_seqlens=lambda a: torch.tensor([7])), SHAPE, "cu_seqlens", "[1]", id="no-sequence"),
    pytest.param(_with(cu_seqlens=lambda a: torch.tensor([[0, 3, 7]])), SHAPE, "cu_seqlens", "[1, 3]", id="2d"),
    pytest.param(_batch_doubled, SHAPE, "x", "batch 2", id="batch-not-1"),
    pytest.param(_with(h0=lambda a: torch.cat([a["h0"], a["h0"][:1]])), SHAPE, "h0", "[3, ",
                 id="h0-rows-not-sequences"),
]


@pytest.mark.parametrize("change,exc,field,got", PACKED_ERRORS)
@pytest.mark.parametrize("kind", ["ssd", "bld", "bdl"])
def test_packed_scans_reject_malformed_boundaries(kind, change, exc, field, got):
    """Both scans, Mamba-1 in both layouts; the checks come before any backend runs, so the
    first backend of each scan is enough."""
    args = change(_packed_base(kind))
    if kind == "ssd":
        _assert_rejected(scan_kernels.ssd_scan, {**args, "backend": BACKENDS[0].values[0]}, exc, field, got)
    else:
        _assert_rejected(scan_kernels.selective_scan, {**args, "backend": BACKENDS[0].values[0]}, exc, field, got)


def _seq_idx_of(bounds: list[int], values: list[int]) -> torch.Tensor:
    """mamba_ssm's seq_idx [1, seq] for sequences cut at `bounds`, sequence i marked values[i]."""
    lengths = [b - a for a, b in zip(bounds, bounds[1:])]
    return torch.tensor(values, dtype=torch.int32).repeat_interleave(torch.tensor(lengths))[None]


# mamba_ssm's callers number the sequences 0, 1, 2, ...; a sequence ends wherever the index
# grows, so any increasing values (with gaps, from any start) mean the same.
SEQ_IDX_VALUES = [pytest.param([0, 1, 2, 3], id="numbered"), pytest.param([2, 5, 6, 11], id="gaps")]


@pytest.mark.parametrize("values", SEQ_IDX_VALUES)
@pytest.mark.parametrize("with_cu_seqlens", [False, True], ids=["alone", "beside-cu_seqlens"])
@pytest.mark.parametrize("h0,return_state", PACKED_OPTIONS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_ssd_seq_idx_gives_the_sequences_it_marks(backend, h0, return_state, with_cu_seqlens, values):
    case = SsdCase(1, BOUNDS[-1], 4, 3, 5, groups=2, chunk_size=4, D=True, z=True, dt_bias=True,
                   dt_softplus=True, return_state=return_state)
    seed = random_seed()
    inputs = make_ssd_inputs(case, F32, seed=seed)
    rows = _seq_rows((4, 3, 5), seed) if h0 else None
    cu = {"cu_seqlens": torch.tensor(BOUNDS, dtype=torch.int32)} if with_cu_seqlens else {}
    out = scan_kernels.ssd_scan(**inputs, h0=rows, seq_idx=_seq_idx_of(BOUNDS, values), **cu, backend=backend)
    y, state = out if return_state else (out, None)
    assert_packed_matches_each_sequence(y, state, inputs, rows, BOUNDS, "ssd", F32, f"{backend} seed={seed}")


SEQ_IDX_ERRORS = [
    pytest.param(_with(seq_idx=lambda a: _seq_idx_of([0, 2, 7], [0, 1])), INPUT, "seq_idx",
                 "2 sequences, boundary 1 at 2", id="disagrees-with-cu_seqlens"),
    pytest.param(_with(seq_idx=lambda a: _seq_idx_of([0, 3, 5, 7], [0, 1, 2])), INPUT, "seq_idx",
                 "3 sequences, boundary 2 at 5", id="one-more-sequence"),
    pytest.param(_with(seq_idx=lambda a: _seq_idx_of([0, 3, 7], [1, 0])), INPUT, "seq_idx", "1 then 0 at position 3",
                 id="decreasing"),
    pytest.param(_with(seq_idx=lambda a: _seq_idx_of([0, 3, 7], [0, 1])[:, :6]), SHAPE, "seq_idx", "[1, 6]",
                 id="shorter-than-x"),
    pytest.param(_with(seq_idx=lambda a: _seq_idx_of([0, 3, 7], [0, 1])[0]), SHAPE, "seq_idx", "[7]", id="1d"),
    pytest.param(_with(seq_idx=lambda a: _seq_idx_of([0, 3, 7], [0, 1]).float()), DTYPE, "seq_idx", "float32",
                 id="float-dtype"),
    pytest.param(_with(seq_idx=[[0, 0, 0, 1, 1, 1, 1]]), INPUT, "seq_idx", "list", id="a-list"),
    pytest.param(_with(seq_idx=lambda a: _seq_idx_of([0, 3, 7], [0, 1]).to("meta")), INPUT, "seq_idx", "meta",
                 id="on-meta"),
    pytest.param(lambda a: {**_batch_doubled(a), "cu_seqlens": None,
                            "seq_idx": _seq_idx_of([0, 3, 7], [0, 1]).repeat(2, 1)}, SHAPE, "seq_idx", "[2, 7]",
                 id="batch-not-1"),
]


@pytest.mark.parametrize("change,exc,field,got", SEQ_IDX_ERRORS)
@pytest.mark.parametrize("op", ["forward", "backward"])
def test_ssd_seq_idx_rejects_what_marks_no_packed_sequences(op, change, exc, field, got):
    """The checks come before any backend runs; `_packed_base` cuts seq 7 at [0, 3, 7]."""
    args = change({**_packed_base("ssd"), "seq_idx": _seq_idx_of([0, 3, 7], [0, 1])})
    backend = BACKENDS[0].values[0]
    if op == "forward":
        _assert_rejected(scan_kernels.ssd_scan, {**args, "backend": backend}, exc, field, got)
    else:
        args = {k: v for k, v in args.items() if k != "return_state"}  # the forward's alone
        _assert_rejected(lambda **a: scan_kernels.ssd_scan_backward(torch.ones_like(a["x"]), **a),
                         {**args, "backend": backend}, exc, field, got)


def test_torch_backend_has_the_ssd_kernels():
    """So the suite above always runs on at least one backend."""
    assert "torch" in cpu_backends(), scan_kernels.unavailable_backends().get("torch")


# --- the SSD cases of bench.kernels ------------------------------------------------------------

def test_bench_times_ssd_cases():
    """bench.kernels on small SSD cases (a scan, an ExPhil-style step by slot): the torch
    backend's timed call computes the reference's y, and its rows carry the speedup over the
    reference."""
    from bench import kernels as bench_kernels

    cpu = torch.device("cpu")
    cases = [bench_kernels.KernelCase("ssd-tiny", "ssd-scan", batch=2, dim=24, state=16, seq=37, heads=3),
             bench_kernels.KernelCase("ssd-step-tiny", "ssd-step", batch=5, dim=24, state=16, heads=3, exphil=True)]
    for case in cases:
        y = {}
        for name in ("torch", "reference"):
            out = bench_kernels.kernel_call(case, name, bench_kernels.make_inputs(case, "bld", cpu))()
            y[name] = out[0] if isinstance(out, tuple) else out
        assert_close(y["torch"], y["reference"], F32, f"{case.name} y")
    report = bench_kernels.run(cases, ["reference", "torch"], cpu, "bld", True, 1, 1 << 25, log=lambda *_: None)
    rows = {(r["case"], r["backend"]): r for r in report["results"]}
    for case in ("ssd-tiny", "ssd-step-tiny"):
        assert rows[(case, "torch")]["speedup_vs_reference"] > 0


@pytest.mark.parametrize("dt_limit, bounds", [
    pytest.param((0.0, math.inf), (None, None), id="default-clamps-nothing"),
    pytest.param((0.0, 0.5), (0.0, 0.5), id="zero-low-is-a-bound-beside-a-finite-high"),
    pytest.param((1e-3, 0.1), (1e-3, 0.1), id="both"),
    pytest.param((-math.inf, 2.0), (None, 2.0), id="infinite-low"),
    pytest.param((0.25, math.inf), (0.25, None), id="infinite-high"),
])
def test_dt_limit_bounds_maps_mamba_ssm_pairs(dt_limit, bounds):
    assert scan_kernels.dt_limit_bounds(dt_limit) == bounds


def test_dt_limit_bounds_refuses_a_reversed_pair_by_its_own_name():
    with pytest.raises(scan_kernels.KernelInputError) as info:
        scan_kernels.dt_limit_bounds((0.5, 0.1))
    assert info.value.field == "dt_limit" and info.value.got == "(0.5, 0.1)"


@pytest.mark.parametrize("dt_limit", [
    pytest.param((math.nan, 0.1), id="nan-low"),
    pytest.param((0.001, math.nan), id="nan-high"),
    pytest.param((math.nan, math.nan), id="nan-both"),
])
def test_dt_limit_bounds_refuses_nan(dt_limit):
    """NaN compares false with everything: it passed the order check and was dropped as no
    bound (found in review), where dt_min and dt_max refuse it."""
    with pytest.raises(scan_kernels.KernelInputError) as info:
        scan_kernels.dt_limit_bounds(dt_limit)
    assert info.value.field == "dt_limit" and "nan" in info.value.got


@pytest.mark.parametrize("dt_limit", [
    pytest.param((0.0, 1.0, 2.0), id="three"),
    pytest.param((0.1,), id="one"),
    pytest.param(None, id="none"),
    pytest.param(("a", "b"), id="strs"),
    pytest.param((True, 2.0), id="a-bool"),
    pytest.param((torch.tensor(0.0), torch.tensor(1.0)), id="tensors"),
    pytest.param((0, 10 ** 400), id="an-int-past-floats"),
])
def test_dt_limit_bounds_refuses_what_is_not_a_pair_of_numbers_by_its_own_name(dt_limit):
    """Unpacked and compared first, these raised ValueError or TypeError from inside, or (a
    pair of tensors) went on to be refused as dt_min (found in review)."""
    with pytest.raises(scan_kernels.KernelInputError) as info:
        scan_kernels.dt_limit_bounds(dt_limit)
    assert info.value.field == "dt_limit" and "a pair (low, high) of numbers" in info.value.expected


@pytest.mark.parametrize("dt_limit", [
    pytest.param((0.0, 1e39), id="high"),
    pytest.param((-1e39, 0.5), id="low"),
])
def test_dt_limit_bounds_refuses_a_side_past_float32_by_its_own_name(dt_limit):
    """A finite side past float32's range went on as the dt_min or dt_max that refuses it, so
    the error named an argument the caller never gave."""
    with pytest.raises(scan_kernels.KernelInputError) as info:
        scan_kernels.dt_limit_bounds(dt_limit)
    assert info.value.field == "dt_limit" and info.value.got == f"({dt_limit[0]!r}, {dt_limit[1]!r})"
