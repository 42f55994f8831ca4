"""The generic kernels suite: every available backend that serves CPU tensors (except the
reference, which is the oracle, and Triton, which has its own interpreter suite) against the
float64 reference, plus chaining, strided inputs, validation and backend selection.

Inputs are fresh random draws each run; the seed is in every failure message.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

import scan_kernels
from kernel_cases import (
    DTYPES, LARGE_SCAN_CASES, SCAN_CASES, UPDATE_CASES, ScanCase, UpdateCase, assert_close,
    assert_scan_matches_reference, assert_scan_outputs_match_reference,
    assert_update_matches_reference, assert_update_outputs_match_reference, make_scan_inputs,
    make_update_inputs, random_seed, reference_scan, STRIDED, nan_gapped, with_changes, cpu_backends,
    SsdUpdateCase, make_ssd_update_inputs, ZERO_DECAY_REGIMES, with_zero_decays, INFINITE_INPUT_STATES,
    assert_infinities_as_the_reference, reference_with_an_infinite_x, with_an_infinite_x,
)


BACKENDS = [pytest.param(name, id=name) for name in cpu_backends()]
# --- scan and state update against the float64 reference ------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", SCAN_CASES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_scan_matches_reference(backend, case, dtype):
    seed = random_seed()
    assert_scan_matches_reference(backend, case, dtype, seed, f"{backend} seed={seed}")


@pytest.mark.parametrize("regime", ZERO_DECAY_REGIMES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_scan_with_decays_of_zero(backend, regime):
    case = ScanCase(2, 7, 5, 3, D=True, z=True, dt_softplus=True, h0=True)
    seed = random_seed()
    inputs = with_zero_decays(make_scan_inputs(case, seed=seed), regime)
    y, state = scan_kernels.selective_scan(**inputs, backend=backend)
    assert_scan_outputs_match_reference(case, torch.float32, inputs, y, state, f"{backend} {regime} seed={seed}",
                                        to_term_magnitudes=True)


@pytest.mark.parametrize("state_size", INFINITE_INPUT_STATES)
@pytest.mark.parametrize("kind", ["scan", "ssd_scan", "update", "ssd_update"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_an_infinite_x_gives_the_references_infinity(backend, kind, state_size):
    seed = random_seed()
    inputs = with_an_infinite_x(kind, state_size, seed)
    y_ref, state_ref = reference_with_an_infinite_x(kind, inputs)
    if kind == "scan":
        y, state = scan_kernels.selective_scan(**inputs, backend=backend)
    elif kind == "ssd_scan":
        y, state = scan_kernels.ssd_scan(**inputs, backend=backend)
    else:
        update = scan_kernels.selective_state_update if kind == "update" else scan_kernels.ssd_state_update
        y, state = update(**inputs, backend=backend), inputs["state"]
    what = f"{backend} {kind} state {state_size} seed={seed}"
    assert_infinities_as_the_reference(y, y_ref, f"{what} y")
    assert_infinities_as_the_reference(state, state_ref, f"{what} state")


@pytest.mark.parametrize("case", LARGE_SCAN_CASES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_large_scan_matches_reference(backend, case):
    seed = random_seed()
    assert_scan_matches_reference(backend, case, torch.float32, seed, f"{backend} seed={seed}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", UPDATE_CASES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_state_update_matches_reference(backend, case, dtype):
    seed = random_seed()
    assert_update_matches_reference(backend, case, dtype, seed, f"{backend} seed={seed}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_long_strong_decay_stays_finite(backend):
    """Decays of e^-3000 and below over the sequence: a formulation that takes exp of positive
    cumulative sums overflows here; the true state only keeps the latest inputs."""
    case = ScanCase(1, 3001, 8, 4, D=True, dt_bias=True, dt_softplus=True)
    seed = random_seed()
    what = f"{backend} seed={seed}"
    inputs = make_scan_inputs(case, torch.float32, seed=seed)
    inputs["dt_bias"] = inputs["dt_bias"] + 10.0  # softplus(dt) ~ 10 with A in [-2, -0.1]
    y_ref, state_ref = reference_scan(inputs)
    y, state = scan_kernels.selective_scan(**inputs, backend=backend)
    assert torch.isfinite(y).all() and torch.isfinite(state).all(), f"{what}: inf or NaN"
    assert_close(y, y_ref, torch.float32, f"{what} y")
    assert_close(state, state_ref, torch.float32, f"{what} state")


# --- chaining: state carried across calls ---------------------------------------------------

def _seq_slice(inputs: dict, layout: str, start: int, stop: int) -> dict:
    """The inputs for timesteps [start, stop): the seq axis is 1 in "bld" and last in "bdl"."""
    out = dict(inputs)
    for name in ("x", "dt", "z", "B", "C"):
        if name in inputs:
            out[name] = inputs[name][:, start:stop] if layout == "bld" else inputs[name][..., start:stop]
    return out


CHAIN_CASES = [
    pytest.param(ScanCase(2, 23, 10, 4, groups=2, D=True, z=True, dt_bias=True, dt_softplus=True,
                          clamp=True, h0=True), 9, id="all-options-bld"),
    pytest.param(ScanCase(3, 17, 9, 5, groups=3, layout="bdl", D=True, z=True, h0=True), 16,
                 id="groups3-bdl"),
    pytest.param(ScanCase(1, 40, 7, 3, bc_3d=True), 1, id="split-after-first-step"),
]


@pytest.mark.parametrize("case,split", CHAIN_CASES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_scan_in_two_calls_equals_one(backend, case, split):
    seed = random_seed()
    what = f"{backend} seed={seed}"
    inputs = make_scan_inputs(case, torch.float32, seed=seed)
    y_full, state_full = scan_kernels.selective_scan(**inputs, backend=backend)
    y1, state1 = scan_kernels.selective_scan(**_seq_slice(inputs, case.layout, 0, split), backend=backend)
    second = {**_seq_slice(inputs, case.layout, split, case.seq), "h0": state1}
    y2, state2 = scan_kernels.selective_scan(**second, backend=backend)
    seq_axis = 1 if case.layout == "bld" else 2
    assert_close(torch.cat([y1, y2], dim=seq_axis), y_full, torch.float32, f"{what} y")
    assert_close(state2, state_full, torch.float32, f"{what} state")


@pytest.mark.parametrize("steps", [pytest.param(1, id="1-step"), pytest.param(6, id="6-steps")])
@pytest.mark.parametrize("backend", BACKENDS)
def test_prefill_then_state_updates_equals_one_scan(backend, steps):
    case = ScanCase(3, 19, 12, 5, groups=2, D=True, z=True, dt_bias=True, dt_softplus=True,
                    clamp=True, h0=True)
    seed = random_seed()
    what = f"{backend} seed={seed}"
    inputs = make_scan_inputs(case, torch.float32, seed=seed)
    y_full, state_full = scan_kernels.selective_scan(**inputs, backend=backend)
    prefill = case.seq - steps
    _, state = scan_kernels.selective_scan(**_seq_slice(inputs, "bld", 0, prefill), backend=backend)
    shared = {k: inputs[k] for k in ("A", "D", "dt_bias", "dt_softplus", "dt_min", "dt_max")}
    for t in range(prefill, case.seq):
        step = {k: inputs[k][:, t] for k in ("x", "dt", "B", "C", "z")}
        y_t = scan_kernels.selective_state_update(state, **step, **shared, backend=backend)
        assert_close(y_t, y_full[:, t], torch.float32, f"{what} y at step {t}")
    assert_close(state, state_full, torch.float32, f"{what} state")


# --- strided (non-contiguous) inputs --------------------------------------------------------

STRIDED_SCAN_CASES = [
    pytest.param(ScanCase(2, 11, 12, 4, groups=2, D=True, z=True, dt_bias=True, h0=True), id="bld"),
    pytest.param(ScanCase(2, 11, 12, 4, groups=3, layout="bdl", D=True, z=True, dt_bias=True,
                          h0=True), id="bdl"),
]


@pytest.mark.parametrize("restride", STRIDED)
@pytest.mark.parametrize("case", STRIDED_SCAN_CASES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_scan_strided_inputs(backend, case, restride):
    seed = random_seed()
    inputs = make_scan_inputs(case, torch.float32, seed=seed)
    strided = {k: restride(v) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    assert not strided["x"].is_contiguous()
    y, state = scan_kernels.selective_scan(**strided, backend=backend)
    assert_scan_outputs_match_reference(case, torch.float32, inputs, y, state, f"{backend} seed={seed}")


@pytest.mark.parametrize("restride", STRIDED)
@pytest.mark.parametrize("backend", BACKENDS)
def test_state_update_strided_inputs_and_state(backend, restride):
    case = UpdateCase(5, 12, 4, groups=2, pool=8, padding_rows=2, D=True, z=True, dt_bias=True)
    seed = random_seed()
    what = f"{backend} seed={seed}"
    inputs = make_update_inputs(case, torch.float32, seed=seed)
    strided = {k: restride(v) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
               for k, v in inputs.items()}
    state = strided["state"]
    assert not state.is_contiguous()
    before = state.clone()
    y = scan_kernels.selective_state_update(**strided, backend=backend)
    assert_update_outputs_match_reference(case, torch.float32, strided, before, y, what)
    if restride is nan_gapped:
        gaps = state._base[..., 1]
        assert torch.isnan(gaps).all(), f"{what}: the update wrote outside the state view"


@pytest.mark.parametrize("backend", BACKENDS)
def test_state_update_int32_slots(backend):
    case = UpdateCase(6, 10, 3, pool=9, padding_rows=2, D=True)
    seed = random_seed()
    inputs = make_update_inputs(case, torch.float32, seed=seed)
    inputs["slots"] = inputs["slots"].to(torch.int32)
    before = inputs["state"].clone()
    y = scan_kernels.selective_state_update(**inputs, backend=backend)
    assert_update_outputs_match_reference(case, torch.float32, inputs, before, y, f"{backend} seed={seed}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_state_update_all_padding_rows_touch_nothing(backend):
    case = UpdateCase(4, 10, 3, pool=6, padding_rows=4, D=True, z=True)
    inputs = make_update_inputs(case, torch.float32, seed=random_seed())
    before = inputs["state"].clone()
    y = scan_kernels.selective_state_update(**inputs, backend=backend)
    assert torch.equal(y, torch.zeros(4, 10))
    assert torch.equal(inputs["state"], before)


# --- the torch backend's blocking -----------------------------------------------------------

# The case below: one timestep is batch 2 x dim 12 x state 4 x 4 bytes = 384 bytes, and one
# channel of every group (2 groups) 2 x 2 x 4 x 4 = 64 bytes.
@pytest.mark.parametrize("block_bytes", [
    pytest.param(64, id="one-channel-per-block"),
    pytest.param(4 * 64, id="channel-blocks-4-then-2"),
    pytest.param(3 * 384, id="3-step-chunks"),
])
@pytest.mark.parametrize("layout", ["bld", "bdl"])
def test_torch_backend_blocks_agree_with_reference(monkeypatch, block_bytes, layout):
    """The torch backend splits channels and sequence into L2-sized blocks; tiny block sizes
    force every boundary (channel blocks with a remainder, chunk carries) on a small case."""
    from scan_kernels import eager

    monkeypatch.setattr(eager, "_BLOCK_BYTES", block_bytes)
    case = ScanCase(2, 10, 12, 4, groups=2, layout=layout, D=True, z=True, dt_bias=True,
                    dt_softplus=True, h0=True)
    seed = random_seed()
    assert_scan_matches_reference("torch", case, torch.float32, seed, f"torch block_bytes={block_bytes} seed={seed}")


# --- validation -----------------------------------------------------------------------------

def _scan_base() -> dict:
    case = ScanCase(2, 5, 6, 3, groups=2, D=True, z=True, dt_bias=True, h0=True)
    return make_scan_inputs(case, torch.float32, seed=random_seed())


def _nested(t: torch.Tensor) -> torch.Tensor:
    with warnings.catch_warnings():  # torch's nested tensors warn that they are a prototype
        warnings.simplefilter("ignore", UserWarning)
        return torch.nested.nested_tensor(list(t))


def _negative_view(t: torch.Tensor) -> torch.Tensor:
    """`t`'s values as a view with torch's negative bit, as z.conj().imag gives one."""
    view = torch.complex(torch.zeros_like(t), -t).conj().imag
    assert view.is_neg() and torch.equal(view, t)
    return view


SCAN_ERRORS = [
    # (change to the valid arguments, field, a fragment of `got`)
    pytest.param(with_changes(x=lambda a: a["x"].tolist()), "x", "list", id="x-not-a-tensor"),
    pytest.param(with_changes(x=lambda a: a["x"].to(torch.int32)), "x", "int32", id="x-int-dtype"),
    pytest.param(with_changes(x=lambda a: a["x"][0]), "x", "[5, 6]", id="x-2d"),
    pytest.param(with_changes(x=lambda a: a["x"][:, :0]), "x", "[2, 0, 6]", id="x-empty"),
    pytest.param(with_changes(layout="lbd"), "layout", "lbd", id="layout-unknown"),
    pytest.param(with_changes(dt=lambda a: a["dt"][:, :4]), "dt", "[2, 4, 6]", id="dt-shape"),
    pytest.param(with_changes(A=lambda a: a["A"][:5]), "A", "[5, 3]", id="A-shape"),
    pytest.param(with_changes(A=lambda a: a["A"][:, :0]), "A", "[6, 0]", id="A-no-state"),
    pytest.param(with_changes(B=lambda a: a["B"][:, :4]), "B", "[2, 4, 2, 3]", id="B-shape"),
    pytest.param(with_changes(B=lambda a: a["B"][None]), "B", "[1, 2, 5, 2, 3]", id="B-5d"),
    pytest.param(with_changes(B=lambda a: torch.rand(2, 5, 4, 3), C=lambda a: torch.rand(2, 5, 4, 3)),
                 "B", "4 groups", id="groups-not-dividing-dim"),
    pytest.param(with_changes(C=lambda a: torch.rand(2, 5, 3, 3)), "C", "3 groups", id="C-groups-differ"),
    pytest.param(with_changes(D=lambda a: a["D"][:5]), "D", "[5]", id="D-shape"),
    pytest.param(with_changes(z=lambda a: a["z"][:1]), "z", "[1, 5, 6]", id="z-shape"),
    pytest.param(with_changes(dt_bias=lambda a: a["dt_bias"][None]), "dt_bias", "[1, 6]", id="dt_bias-shape"),
    pytest.param(with_changes(h0=lambda a: a["h0"][:, :, :2]), "h0", "[2, 6, 2]", id="h0-shape"),
    pytest.param(with_changes(dt_min="0.1"), "dt_min", "str", id="dt_min-not-a-number"),
    pytest.param(with_changes(dt_max=True), "dt_max", "bool", id="dt_max-bool"),
    pytest.param(with_changes(dt_min=float("nan")), "dt_min", "nan", id="dt_min-nan"),
    pytest.param(with_changes(dt_max=float("inf")), "dt_max", "inf", id="dt_max-inf"),
    pytest.param(with_changes(dt_min=10**400), "dt_min", "int beyond the float range", id="dt_min-int-beyond-float"),
    pytest.param(with_changes(dt_min=0.5, dt_max=0.1), "dt_max", "0.1", id="dt_min-above-dt_max"),
    # Past float32's range: the fp32 kernels would read it as infinite (found in review: the
    # Triton fp64 kernels gave NaN for it).
    pytest.param(with_changes(dt_min=1e39), "dt_min", "1e+39", id="dt_min-beyond-float32"),
    pytest.param(with_changes(dt_max=-1e300), "dt_max", "-1e+300", id="dt_max-beyond-float32"),
    pytest.param(with_changes(x=lambda a: a["x"].to_sparse()), "x", "sparse", id="x-sparse"),
    # Strided in layout, but without sizes: reading its shape raised torch's internal error.
    pytest.param(with_changes(x=lambda a: _nested(a["x"])), "x", "nested", id="x-nested"),
    pytest.param(with_changes(h0=lambda a: _nested(a["h0"])), "h0", "nested", id="h0-nested"),
    # Its memory holds the negated values: the cpu backend computed with them (found in review).
    pytest.param(with_changes(D=lambda a: _negative_view(a["D"])), "D", "negative view", id="D-negative-view"),
    pytest.param(with_changes(x=lambda a: _negative_view(a["x"])), "x", "negative view", id="x-negative-view"),
    # A flag is a bool, not a value read by its truthiness: "false" applied softplus.
    pytest.param(with_changes(dt_softplus="false"), "dt_softplus", "str", id="dt_softplus-str"),
    pytest.param(with_changes(return_state=[0]), "return_state", "list", id="return_state-list"),
]


@pytest.mark.parametrize("change,field,got", SCAN_ERRORS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_scan_rejects_malformed_arguments(backend, change, field, got):
    args = change(_scan_base())
    with pytest.raises(scan_kernels.KernelInputError) as info:
        scan_kernels.selective_scan(**args, backend=backend)
    err = info.value
    assert err.field == field, f"field {err.field!r} ({err}), expected {field!r}"
    assert got in err.got, f"got {err.got!r} does not mention {got!r}"
    assert err.expected and err.expected in str(err)


@pytest.mark.parametrize("backend", BACKENDS)
def test_scan_takes_numpy_booleans_as_flags(backend):
    """numpy 2 names its bool type "bool", not "bool_": a test of the name refused np.True_
    ("expected a bool, got bool"; found in review)."""
    args = _scan_base()
    y_np, state_np = scan_kernels.selective_scan(**{**args, "dt_softplus": np.True_, "return_state": np.True_},
                                                 backend=backend)
    y, state = scan_kernels.selective_scan(**{**args, "dt_softplus": True, "return_state": True}, backend=backend)
    assert torch.equal(y_np, y) and torch.equal(state_np, state)


def _inference_tensor(t: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return t.clone()


def _update_base() -> dict:
    case = UpdateCase(3, 6, 3, groups=2, pool=5, padding_rows=1, D=True, z=True, dt_bias=True)
    return make_update_inputs(case, torch.float32, seed=random_seed())


UPDATE_ERRORS = [
    pytest.param(with_changes(state=lambda a: _negative_view(a["state"])), "state", "negative view",
                 id="state-negative-view"),
    pytest.param(with_changes(state=lambda a: a["state"][0]), "state", "[6, 3]", id="state-2d"),
    pytest.param(with_changes(state=lambda a: a["state"].to(torch.int64)), "state", "int64",
                 id="state-int-dtype"),
    pytest.param(with_changes(state=lambda a: a["state"][:, :0]), "state", "[5, 0, 3]", id="state-no-dim"),
    pytest.param(with_changes(state=lambda a: a["state"][:, :, :0]), "state", "[5, 6, 0]", id="state-no-state-axis"),
    pytest.param(with_changes(state=lambda a: a["state"][:1].expand(5, 6, 3)), "state", "strides [0, 3, 1]",
                 id="state-rows-share-memory"),
    pytest.param(with_changes(state=lambda a: a["state"].as_strided((5, 6, 3), (3, 3, 1))), "state",
                 "strides [3, 3, 1]", id="state-rows-overlap"),
    pytest.param(with_changes(x=lambda a: a["state"][:3, :, 0]), "x", "sharing memory with state",
                 id="x-inside-state"),
    pytest.param(with_changes(state=lambda a: a["state"].clone().requires_grad_(True)), "state", "requires_grad",
                 id="state-requires-grad"),
    pytest.param(with_changes(x=lambda a: a["x"][:, :5]), "x", "[3, 5]", id="x-dim-differs"),
    pytest.param(with_changes(dt=lambda a: a["dt"][:2]), "dt", "[2, 6]", id="dt-shape"),
    pytest.param(with_changes(A=lambda a: a["A"][:, :2]), "A", "[6, 2]", id="A-shape"),
    pytest.param(with_changes(B=lambda a: a["B"][:, :, :2]), "B", "[3, 2, 2]", id="B-shape"),
    pytest.param(with_changes(B=lambda a: torch.rand(3, 4, 3), C=lambda a: torch.rand(3, 4, 3)),
                 "B", "4 groups", id="groups-not-dividing-dim"),
    pytest.param(with_changes(C=lambda a: torch.rand(3, 3, 3)), "C", "3 groups", id="C-groups-differ"),
    pytest.param(with_changes(z=lambda a: a["z"][:, :1]), "z", "[3, 1]", id="z-shape"),
    pytest.param(with_changes(slots=lambda a: a["slots"].float()), "slots", "float32", id="slots-float"),
    pytest.param(with_changes(slots=lambda a: a["slots"][:2]), "slots", "[2]", id="slots-shape"),
    pytest.param(with_changes(slots=lambda a: torch.tensor([0, 5, -1])), "slots", "5", id="slots-beyond-pool"),
    pytest.param(with_changes(slots=None), "state", "5 rows", id="pool-differs-without-slots"),
    # Two rows on one slot: the cpu kernel's second row read the first's update, the reference
    # wrote one of the two (found in review: their y and state differed).
    pytest.param(with_changes(slots=lambda a: torch.tensor([2, -1, 2])), "slots", "slot 2 named 2 times",
                 id="slots-duplicated"),
    pytest.param(with_changes(slots=lambda a: torch.tensor([4, 4, 4], dtype=torch.int32)), "slots",
                 "slot 4 named 3 times", id="slots-duplicated-int32"),
    pytest.param(with_changes(slots=lambda a: a["slots"].to("meta")), "slots", "meta", id="slots-on-meta"),
    # torch refuses in-place writes to these: the reference raised a RuntimeError after writing
    # the state, the cpu backend wrote it silently (found in review).
    pytest.param(with_changes(state=lambda a: _inference_tensor(a["state"])), "state", "inference tensor",
                 id="state-inference-tensor"),
    pytest.param(with_changes(dt_min=0.3, dt_max=0.2), "dt_max", "0.2", id="dt_min-above-dt_max"),
    pytest.param(with_changes(dt_max=float("nan")), "dt_max", "nan", id="dt_max-nan"),
    pytest.param(with_changes(dt_softplus="no"), "dt_softplus", "str", id="dt_softplus-str"),
]


@pytest.mark.parametrize("change,field,got", UPDATE_ERRORS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_state_update_rejects_malformed_arguments(backend, change, field, got):
    args = change(_update_base())
    state_before = args["state"].clone() if isinstance(args["state"], torch.Tensor) else None
    with pytest.raises(scan_kernels.KernelInputError) as info:
        scan_kernels.selective_state_update(**args, backend=backend)
    err = info.value
    assert err.field == field, f"field {err.field!r} ({err}), expected {field!r}"
    assert got in err.got, f"got {err.got!r} does not mention {got!r}"
    assert err.expected and err.expected in str(err)
    if state_before is not None:
        assert torch.equal(args["state"], state_before), "a rejected call changed the state"


@pytest.mark.parametrize("update", [pytest.param(scan_kernels.selective_state_update, id="mamba1"),
                                    pytest.param(scan_kernels.ssd_state_update, id="ssd")])
@pytest.mark.parametrize("backend", BACKENDS)
def test_an_update_is_an_in_place_write_to_autograd(backend, update):
    """A graph that saved the state before an update cannot compute its gradients from the
    values the update wrote: every backend counts the write in the state's version, as torch's
    in-place ops do (the cpu one writes through its address, which autograd does not see)."""
    if update is scan_kernels.selective_state_update:
        args = make_update_inputs(UpdateCase(2, 6, 3), torch.float32, seed=random_seed())
    else:
        args = make_ssd_update_inputs(SsdUpdateCase(2, 4, 3, 6), torch.float32, seed=random_seed())
    weight = torch.ones(1, requires_grad=True)
    loss = (weight * args["state"]).sum()
    update(**args, backend=backend)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


@pytest.mark.parametrize("update", [pytest.param(scan_kernels.selective_state_update, id="mamba1"),
                                    pytest.param(scan_kernels.ssd_state_update, id="ssd")])
@pytest.mark.parametrize("backend", [*BACKENDS, pytest.param("reference", id="reference")])
def test_an_update_reads_operands_that_require_grad_as_constants(backend, update):
    """State updates are not differentiable: with A = -exp(A_log) of a parameter, and x and D
    requiring grad, neither y nor the pool requires grad, and the pool takes the next update
    (the torch and reference backends' tracked in-place ops left it requiring grad, so the
    next call refused it); y and the state are those of the same calls without grad."""
    seed = random_seed()
    if update is scan_kernels.selective_state_update:
        args = make_update_inputs(UpdateCase(2, 6, 3, D=True), torch.float32, seed=seed)
    else:
        args = make_ssd_update_inputs(SsdUpdateCase(2, 4, 3, 6, D=True), torch.float32, seed=seed)
    A_log = torch.log(-args["A"]).requires_grad_(True)
    tracked = {**args, "A": -torch.exp(A_log), "x": args["x"].clone().requires_grad_(True),
               "D": args["D"].clone().requires_grad_(True)}
    untracked = {**args, "state": args["state"].clone()}
    for call in range(2):
        what = f"{backend} call {call + 1} seed={seed}"
        y = update(**tracked, backend=backend)
        assert not y.requires_grad and not tracked["state"].requires_grad, f"{what}: y or the state requires grad"
        assert_close(y, update(**untracked, backend=backend), torch.float32, f"{what} y")
        assert_close(tracked["state"], untracked["state"], torch.float32, f"{what} state")


@pytest.mark.parametrize("change", [
    pytest.param(with_changes(x=lambda a: a["x"].tolist()), id="x-not-a-tensor"),
    pytest.param(with_changes(dt_min="0.1"), id="dt_min-not-a-number"),
])
def test_an_argument_of_the_wrong_type_is_an_invalid_argument_on_the_wire(change):
    """Not a shape mismatch: the bridge answers ShapeMismatch as shape_mismatch, every other
    KernelInputError as invalid_argument."""
    from bridge.errors import error_fields

    with pytest.raises(scan_kernels.KernelInputError) as info:
        scan_kernels.selective_scan(**change(_scan_base()), backend="reference")
    assert not isinstance(info.value, scan_kernels.ShapeMismatch), repr(info.value)
    assert error_fields(info.value)[0] == "invalid_argument"


@pytest.mark.parametrize("bound", [
    pytest.param(np.float32(0.1), id="numpy-float32"),
    pytest.param(np.float64(0.1), id="numpy-float64"),
    pytest.param(np.int64(1), id="numpy-int64"),
])
@pytest.mark.parametrize("backend", BACKENDS)
def test_numpy_scalar_clamp_bounds_act_as_their_float(backend, bound):
    inputs = _scan_base()
    y_numpy, _ = scan_kernels.selective_scan(**inputs, dt_min=bound, dt_max=bound, backend=backend)
    y_float, _ = scan_kernels.selective_scan(**inputs, dt_min=float(bound), dt_max=float(bound), backend=backend)
    assert torch.equal(y_numpy, y_float)


def test_unknown_backend_is_rejected():
    with pytest.raises(scan_kernels.UnknownBackend) as info:
        scan_kernels.selective_scan(**_scan_base(), backend="no-such-backend")
    assert info.value.field == "backend"
    assert "no-such-backend" in info.value.got
    assert "'torch'" in info.value.expected


# --- backend selection ----------------------------------------------------------------------

def test_cpu_selection_prefers_the_native_backend():
    expected = "cpu" if "cpu" in scan_kernels.available_backends() else "torch"
    assert scan_kernels.select_backend("cpu") == expected


def test_named_backend_is_selected_as_named():
    assert scan_kernels.select_backend("cpu", "torch") == "torch"
    assert scan_kernels.select_backend("cpu", "reference") == "reference"
    with pytest.raises(scan_kernels.UnknownBackend):
        scan_kernels.select_backend("cpu", "no-such-backend")


def test_torch_backend_is_always_available():
    assert "torch" in scan_kernels.available_backends(), scan_kernels.unavailable_backends().get("torch")
