"""Gradients of the scans (scan_kernels.selective_scan_backward, scan_kernels.ssd_scan_backward, and
autograd through scan_kernels.selective_scan / scan_kernels.ssd_scan).

- torch.autograd.gradcheck in float64: the reference (the oracle), and the cpu backend's own
  float64 path against finite differences of its own forward;
- every CPU backend against the float64 reference's gradients, over the forward's named cases
  (every option, both layouts, groups, odd sizes, h0) with dstate, in each dtype;
- packed sequences against per-sequence reference gradients;
- autograd through the public forward, the clamp's zero gradient outside it, bad cotangents;
- the cpu backward's peak memory at 1x768x4096x16 against a bound from its chunk size.
"""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
import textwrap

import pytest
import torch

import scan_kernels
from scan_kernels import _registry
from kernel_cases import (DTYPES, LARGE_SCAN_CASES, LARGE_SSD_SCAN_CASES, SCAN_CASES, SSD_DECAY_REGIMES,
                          SSD_SCAN_CASES, ZERO_DECAY_REGIMES, ScanCase, SsdCase, assert_grads_close,
                          assert_grads_close_where_reference_finite, backward_inputs, cpu_backends, make_cotangents,
                          make_decay_regime_inputs, make_scan_inputs, make_ssd_inputs, random_seed, with_zero_decays)

GRAD_INPUT_NAMES = ("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "h0")


def _scan_state_shape(inputs: dict) -> tuple:
    x, A = inputs["x"], inputs["A"]
    return (x.shape[0], A.shape[0], A.shape[1])


def _ssd_state_shape(inputs: dict) -> tuple:
    b, _, h, p = inputs["x"].shape
    return (b, h, p, inputs["B"].shape[-1])


def _scan_x_shape(inputs: dict) -> tuple:
    return tuple(inputs["x"].shape)


def _grads(kind: str, inputs: dict, dy, dstate, backend: str) -> dict:
    backward = scan_kernels.ssd_scan_backward if kind == "ssd" else scan_kernels.selective_scan_backward
    return backward(dy, **backward_inputs(inputs), dstate=dstate, backend=backend)


def _check_backend(kind: str, backend: str, case, dtype, seed: int) -> None:
    make = make_ssd_inputs if kind == "ssd" else make_scan_inputs
    inputs = make(case, dtype, seed=seed)
    state_shape = _ssd_state_shape(inputs) if kind == "ssd" else _scan_state_shape(inputs)
    dy, dstate = make_cotangents(inputs, tuple(inputs["x"].shape), state_shape, case.return_state, seed)
    got = _grads(kind, inputs, dy, dstate, backend)
    expected = _grads(kind, inputs, dy, dstate, "reference")
    assert_grads_close(got, expected, backward_inputs(inputs), dtype, f"{backend} {kind} {case} seed={seed}")


# -- gradcheck -----------------------------------------------------------------------------------

GRADCHECK_SCAN_CASES = [
    pytest.param(ScanCase(2, 5, 3, 2, bc_3d=True, D=True, z=True), id="bc3d-D-z"),
    pytest.param(ScanCase(1, 6, 4, 3, groups=2, layout="bdl", dt_bias=True, dt_softplus=True, h0=True), id="groups-bdl-h0"),
    pytest.param(ScanCase(2, 4, 2, 2, clamp=True, D=True), id="clamp"),
]
GRADCHECK_SSD_CASES = [
    pytest.param(SsdCase(1, 5, 2, 3, 2, groups=2, D=True, z=True, h0=True), id="groups-D-z-h0"),
    pytest.param(SsdCase(2, 4, 2, 2, 3, D=True, D_per_channel=True, dt_bias=True, dt_softplus=True, clamp=True),
                 id="D-per-channel-softplus-clamp"),
]


def _gradcheck(kind: str, backend: str, case, seed: int) -> None:
    make = make_ssd_inputs if kind == "ssd" else make_scan_inputs
    inputs = make(case, torch.float64, seed=seed)
    inputs = {k: v.double() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    names = [n for n in GRAD_INPUT_NAMES if inputs.get(n) is not None]
    leaves = [inputs[n].detach().requires_grad_(True) for n in names]
    scan = scan_kernels.ssd_scan if kind == "ssd" else scan_kernels.selective_scan
    options = {k: v for k, v in inputs.items() if k not in names and k != "return_state"}

    def f(*tensors):
        return scan(**dict(zip(names, tensors)), **options, return_state=True, backend=backend)

    assert torch.autograd.gradcheck(f, leaves, eps=1e-6, atol=1e-6, rtol=1e-5), f"{backend} {case} seed={seed}"


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("case", GRADCHECK_SCAN_CASES)
def test_scan_gradcheck(backend, case):
    if backend not in scan_kernels.available_backends():
        pytest.skip(f"backend {backend} unavailable: {scan_kernels.unavailable_backends().get(backend)}")
    _gradcheck("scan", backend, case, random_seed())


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("case", GRADCHECK_SSD_CASES)
def test_ssd_gradcheck(backend, case):
    if backend not in scan_kernels.available_backends():
        pytest.skip(f"backend {backend} unavailable: {scan_kernels.unavailable_backends().get(backend)}")
    _gradcheck("ssd", backend, case, random_seed())


# -- every backend against the reference -----------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", SCAN_CASES)
@pytest.mark.parametrize("backend", cpu_backends())
def test_scan_backward_matches_reference(backend, case, dtype):
    _check_backend("scan", backend, case, dtype, random_seed())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", SSD_SCAN_CASES)
@pytest.mark.parametrize("backend", cpu_backends())
def test_ssd_scan_backward_matches_reference(backend, case, dtype):
    _check_backend("ssd", backend, case, dtype, random_seed())


# Where A is -inf the reference's autograd gives ddt NaN (A times a decay of 0); every other
# gradient is finite.
@pytest.mark.parametrize("regime", ZERO_DECAY_REGIMES)
@pytest.mark.parametrize("kind", ["scan", "ssd"])
@pytest.mark.parametrize("backend", cpu_backends())
def test_backward_with_decays_of_zero(backend, kind, regime):
    seed = random_seed()
    if kind == "ssd":
        inputs = make_ssd_inputs(SsdCase(2, 7, 3, 4, 3, chunk_size=4, D=True, z=True, h0=True), seed=seed)
        state_shape = _ssd_state_shape(inputs)
    else:
        inputs = make_scan_inputs(ScanCase(2, 7, 5, 3, D=True, z=True, h0=True), seed=seed)
        state_shape = _scan_state_shape(inputs)
    inputs = with_zero_decays(inputs, regime)
    dy, dstate = make_cotangents(inputs, tuple(inputs["x"].shape), state_shape, True, seed)
    assert_grads_close_where_reference_finite(_grads(kind, inputs, dy, dstate, backend),
                                              _grads(kind, inputs, dy, dstate, "reference"), torch.float32,
                                              f"{backend} {kind} {regime} seed={seed}")


@pytest.mark.parametrize("case", LARGE_SCAN_CASES)
def test_cpu_scan_backward_large_cases(case):
    _check_backend("scan", "cpu", case, torch.float32, random_seed())


@pytest.mark.parametrize("case", LARGE_SSD_SCAN_CASES)
def test_cpu_ssd_scan_backward_large_cases(case):
    """States of a whole head (headdim 64, state 128) and long sequences: too many to keep, so
    the backward walks them in chunks from checkpoints."""
    _check_backend("ssd", "cpu", case, torch.float32, random_seed())


# The C++ Mamba-2 backward walks chunks of 32 steps (16 in the baseline build): sequences that end
# one step short of a chunk's end, on it, and one step past it.
@pytest.mark.parametrize("seq", [31, 32, 33, 64, 65])
def test_cpu_ssd_scan_backward_at_chunk_boundaries(seq):
    case = SsdCase(2, seq, 3, 10, 12, groups=3, D=True, z=True, dt_bias=True, dt_softplus=True, h0=True)
    _check_backend("ssd", "cpu", case, torch.float32, random_seed())


@pytest.mark.parametrize("minus_A, dt_range, seq", SSD_DECAY_REGIMES)
def test_cpu_ssd_scan_backward_decay_regimes(minus_A, dt_range, seq):
    """The chunked form takes exps of differences of a chunk's summed log decays: at the edges
    of the recurrence its gradients still meet the float64 reference's."""
    case = SsdCase(2, seq, 2, 20, 5, D=True, z=True, h0=True)
    seed = random_seed()
    inputs = make_decay_regime_inputs(case, minus_A, dt_range, seed)
    dy, dstate = make_cotangents(inputs, tuple(inputs["x"].shape), _ssd_state_shape(inputs), True, seed)
    got = _grads("ssd", inputs, dy, dstate, "cpu")
    expected = _grads("ssd", inputs, dy, dstate, "reference")
    assert_grads_close(got, expected, backward_inputs(inputs), torch.float32,
                       f"cpu A={-minus_A} dt in {dt_range} seed={seed}")


def test_cpu_backward_does_not_depend_on_the_thread_count():
    """Each thread sums its items' dA, dD, dB and dC apart: any split gives the same totals up
    to the order of the additions."""
    case = ScanCase(3, 70, 96, 16, groups=2, D=True, z=True, dt_bias=True, dt_softplus=True, h0=True)
    seed = random_seed()
    inputs = make_scan_inputs(case, seed=seed)
    dy, dstate = make_cotangents(inputs, _scan_x_shape(inputs), _scan_state_shape(inputs), True, seed)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _grads("scan", inputs, dy, dstate, "cpu")
        torch.set_num_threads(max(2, threads))
        many = _grads("scan", inputs, dy, dstate, "cpu")
    finally:
        torch.set_num_threads(threads)
    for name in one:
        torch.testing.assert_close(many[name], one[name], rtol=1e-5, atol=1e-5 * float(one[name].abs().max()),
                                   msg=lambda m, name=name: f"d{name} seed={seed}: {m}")


# -- packed sequences ----------------------------------------------------------------------


def _per_sequence_reference(kind: str, inputs: dict, dy, dstate, bounds: list[int]) -> dict:
    """The reference's gradients of each packed sequence alone, joined as the packed call's are."""
    seq_axis = 2 if inputs.get("layout") == "bdl" else 1
    bc_axis = 3 if inputs.get("layout") == "bdl" else 1
    parts = []
    for i in range(len(bounds) - 1):
        begin, length = bounds[i], bounds[i + 1] - bounds[i]
        one = {}
        for name, value in backward_inputs(inputs).items():
            if name in ("x", "dt", "z"):
                value = value.narrow(seq_axis, begin, length)
            elif name in ("B", "C"):
                value = value.narrow(bc_axis, begin, length)
            elif name == "h0":
                value = value[i:i + 1]
            one[name] = value
        parts.append(_grads(kind, one, dy.narrow(seq_axis, begin, length),
                            None if dstate is None else dstate[i:i + 1], "reference"))
    joined = {}
    for name in parts[0]:
        pieces = [p[name] for p in parts]
        if name in ("x", "dt", "z"):
            joined[name] = torch.cat(pieces, seq_axis)
        elif name in ("B", "C"):
            joined[name] = torch.cat(pieces, bc_axis)
        elif name == "h0":
            joined[name] = torch.cat(pieces, 0)
        else:
            joined[name] = sum(pieces)
    return joined


@pytest.mark.parametrize("layout", ["bld", "bdl"])
@pytest.mark.parametrize("backend", cpu_backends())
def test_packed_scan_backward_matches_each_sequence(backend, layout):
    seed = random_seed()
    bounds = [0, 5, 6, 19]
    case = ScanCase(1, bounds[-1], 12, 4, groups=2, layout=layout, D=True, z=True, dt_bias=True, dt_softplus=True,
                    h0=True)
    inputs = make_scan_inputs(case, seed=seed)
    inputs["h0"] = torch.randn(len(bounds) - 1, 12, 4, generator=torch.Generator().manual_seed(seed))
    dy, dstate = make_cotangents(inputs, _scan_x_shape(inputs), (len(bounds) - 1, 12, 4), True, seed)
    cu = torch.tensor(bounds, dtype=torch.int32)
    got = scan_kernels.selective_scan_backward(dy, **backward_inputs(inputs), dstate=dstate, cu_seqlens=cu, backend=backend)
    expected = _per_sequence_reference("scan", inputs, dy, dstate, bounds)
    assert_grads_close(got, expected, backward_inputs(inputs), torch.float32, f"{backend} packed seed={seed}")


@pytest.mark.parametrize("backend", cpu_backends())
def test_packed_ssd_scan_backward_matches_each_sequence(backend):
    seed = random_seed()
    bounds = [0, 7, 16]
    case = SsdCase(1, bounds[-1], 4, 3, 5, groups=2, D=True, z=True, dt_bias=True, dt_softplus=True, clamp=True)
    inputs = make_ssd_inputs(case, seed=seed)
    inputs["h0"] = torch.randn(len(bounds) - 1, 4, 3, 5, generator=torch.Generator().manual_seed(seed))
    dy, dstate = make_cotangents(inputs, tuple(inputs["x"].shape), (len(bounds) - 1, 4, 3, 5), True, seed)
    cu = torch.tensor(bounds, dtype=torch.int64)
    got = scan_kernels.ssd_scan_backward(dy, **backward_inputs(inputs), dstate=dstate, cu_seqlens=cu, backend=backend)
    expected = _per_sequence_reference("ssd", inputs, dy, dstate, bounds)
    assert_grads_close(got, expected, backward_inputs(inputs), torch.float32, f"{backend} packed ssd seed={seed}")


@pytest.mark.parametrize("backend", cpu_backends())
def test_ssd_scan_backward_takes_seq_idx_for_the_sequences_it_marks(backend):
    """mamba_ssm's seq_idx gives the gradients of the packed sequences it marks (each a sequence
    of its own, from its own h0 row), alone or beside the cu_seqlens it agrees with."""
    seed = random_seed()
    bounds = [0, 5, 6, 13]
    case = SsdCase(1, bounds[-1], 4, 3, 5, groups=2, D=True, z=True, dt_bias=True, dt_softplus=True)
    inputs = make_ssd_inputs(case, seed=seed)
    inputs["h0"] = torch.randn(len(bounds) - 1, 4, 3, 5, generator=torch.Generator().manual_seed(seed))
    dy, dstate = make_cotangents(inputs, tuple(inputs["x"].shape), (len(bounds) - 1, 4, 3, 5), True, seed)
    seq_idx = torch.tensor([0] * 5 + [1] + [2] * 7, dtype=torch.int32)[None]
    expected = _per_sequence_reference("ssd", inputs, dy, dstate, bounds)
    for cu in ({}, {"cu_seqlens": torch.tensor(bounds)}):
        got = scan_kernels.ssd_scan_backward(dy, **backward_inputs(inputs), dstate=dstate, seq_idx=seq_idx, **cu,
                                             backend=backend)
        assert_grads_close(got, expected, backward_inputs(inputs), torch.float32,
                           f"{backend} seq_idx {'with' if cu else 'without'} cu_seqlens seed={seed}")


# -- autograd through the public forward -----------------------------------------------------


@pytest.mark.parametrize("backend", cpu_backends())
def test_autograd_through_selective_scan(backend):
    """loss = y . w + state . v backpropagates to exactly the inputs that require grad, with the
    backward's gradients for dy = w, dstate = v."""
    seed = random_seed()
    case = ScanCase(2, 11, 8, 4, D=True, z=True, dt_bias=True, dt_softplus=True, h0=True)
    inputs = make_scan_inputs(case, seed=seed)
    dy, dstate = make_cotangents(inputs, _scan_x_shape(inputs), _scan_state_shape(inputs), True, seed)
    trained = ("A", "D", "dt_bias", "x")
    leaves = {k: (v.detach().requires_grad_(True) if k in trained else v) for k, v in inputs.items()}
    y, state = scan_kernels.selective_scan(**{**leaves, "return_state": True}, backend=backend)
    assert y.grad_fn is not None
    ((y * dy).sum() + (state * dstate).sum()).backward()
    expected = _grads("scan", inputs, dy, dstate, "reference")
    assert_grads_close({k: leaves[k].grad for k in trained}, expected, {k: inputs[k] for k in trained},
                       torch.float32, f"autograd {backend} seed={seed}")
    assert all(leaves[k].grad is None for k in ("dt", "B", "C", "z", "h0"))


def _small_problem(scan: str, seq: int, states: int, seed: int):
    """(inputs with D and z, dy) of a small batch-1 Mamba-1 ("scan") or Mamba-2 ("ssd") problem
    whose state cotangent would have `states` rows."""
    if scan == "scan":
        inputs, state_shape = make_scan_inputs(ScanCase(1, seq, 5, 3, D=True, z=True), seed=seed), (states, 5, 3)
    else:
        inputs, state_shape = make_ssd_inputs(SsdCase(1, seq, 2, 3, 4, D=True, z=True), seed=seed), (states, 2, 3, 4)
    dy, _ = make_cotangents(inputs, tuple(inputs["x"].shape), state_shape, False, seed)
    return inputs, dy


@pytest.mark.parametrize("scan", ["scan", "ssd"])
@pytest.mark.parametrize("backend", cpu_backends())
def test_autograd_keeps_the_sequence_bounds_the_forward_ran_on(backend, scan):
    """A caller that refills its cu_seqlens buffer before .backward() (the next micro-batch's
    bounds, gradient accumulation) gets the gradients of the forward it ran: the function kept
    the caller's tensor itself and read the new bounds (found in review)."""
    seed = random_seed()
    bounds, refilled = [0, 2, 9], [0, 6, 9]
    inputs, dy = _small_problem(scan, 9, 2, seed)
    forward = scan_kernels.selective_scan if scan == "scan" else scan_kernels.ssd_scan
    A = inputs["A"].detach().requires_grad_(True)
    cu = torch.tensor(bounds, dtype=torch.int32)
    y = forward(**{**inputs, "A": A, "return_state": False}, cu_seqlens=cu, backend=backend)
    cu.copy_(torch.tensor(refilled))
    (y * dy).sum().backward()
    expected = _per_sequence_reference(scan, inputs, dy, None, bounds)["A"]
    torch.testing.assert_close(A.grad.double(), expected.double(), rtol=1e-4, atol=1e-5 * float(expected.abs().max()))


@pytest.mark.parametrize("scan", ["scan", "ssd"])
@pytest.mark.parametrize("backend", cpu_backends())
def test_the_backward_runs_under_inference_mode_as_under_no_grad(backend, scan):
    """The explicit backward of the torch backend (the fallback where the C++ build fails) built
    its autograd graph under enable_grad, which does not leave inference mode: inside
    torch.inference_mode, or given tensors made there, it raised (found in review)."""
    inputs, dy = _small_problem(scan, 7, 1, random_seed())
    backward = scan_kernels.selective_scan_backward if scan == "scan" else scan_kernels.ssd_scan_backward
    args = backward_inputs(inputs)
    expected = backward(dy, **args, backend=backend)
    with torch.inference_mode():
        inside = backward(dy, **args, backend=backend)
        made_there = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in args.items()}
        dy_made_there = dy.clone()
    outside = backward(dy_made_there, **made_there, backend=backend)
    for got, where in ((inside, "inside inference_mode"), (outside, "of inference tensors")):
        assert got.keys() == expected.keys(), where
        for name in expected:
            torch.testing.assert_close(got[name], expected[name], rtol=0, atol=0, msg=f"{backend} d{name} {where}")


def test_autograd_through_ssd_scan_y_only():
    seed = random_seed()
    case = SsdCase(1, 9, 2, 4, 3, D=True, z=True)
    inputs = make_ssd_inputs(case, seed=seed)
    dy, _ = make_cotangents(inputs, tuple(inputs["x"].shape), _ssd_state_shape(inputs), False, seed)
    A = inputs["A"].detach().requires_grad_(True)
    y = scan_kernels.ssd_scan(**{**inputs, "A": A, "return_state": False})
    (y * dy).sum().backward()
    expected = _grads("ssd", inputs, dy, None, "reference")["A"]
    torch.testing.assert_close(A.grad, expected.float(), rtol=1e-3, atol=1e-4 * float(expected.abs().max()))


@pytest.mark.parametrize("scan", ["scan", "ssd"])
def test_a_second_derivative_is_refused_not_silently_zero(scan):
    """The backward kernels build no graph: a gradient penalty through them would lose its
    second-order term without a word (found in review), so differentiating twice raises."""
    inputs = (make_scan_inputs(ScanCase(1, 5, 3, 2), seed=1) if scan == "scan"
              else make_ssd_inputs(SsdCase(1, 5, 2, 3, 2), seed=1))
    x = inputs["x"].detach().requires_grad_(True)
    forward = scan_kernels.selective_scan if scan == "scan" else scan_kernels.ssd_scan
    y = forward(**{**inputs, "x": x, "return_state": False})
    with pytest.raises(RuntimeError, match="differentiable once"):
        torch.autograd.grad(y.sum(), x, create_graph=True)
    (gx,) = torch.autograd.grad(forward(**{**inputs, "x": x, "return_state": False}).sum(), x)  # once is fine
    assert gx.shape == x.shape and not gx.requires_grad


@pytest.mark.parametrize("value", [pytest.param("false", id="str"), pytest.param(1, id="int"),
                                   pytest.param(1.0, id="float")])
@pytest.mark.parametrize("requires_grad", [pytest.param(False, id="no-grad"), pytest.param(True, id="x-requires-grad")])
@pytest.mark.parametrize("scan", ["scan", "ssd"])
def test_return_state_is_checked_with_autograd_as_without(scan, requires_grad, value):
    """return_state is a bool, with grad or without: the autograd path read it by truthiness,
    so the string "false" returned (y, state)."""
    inputs = (make_scan_inputs(ScanCase(1, 5, 3, 2), seed=1) if scan == "scan"
              else make_ssd_inputs(SsdCase(1, 5, 2, 3, 2), seed=1))
    x = inputs["x"].detach().requires_grad_(requires_grad)
    forward = scan_kernels.selective_scan if scan == "scan" else scan_kernels.ssd_scan
    with pytest.raises(scan_kernels.KernelInputError) as info:
        forward(**{**inputs, "x": x, "return_state": value})
    assert info.value.field == "return_state", f"field {info.value.field!r} ({info.value})"


def test_no_autograd_without_requires_grad_or_under_no_grad():
    inputs = make_scan_inputs(ScanCase(1, 4, 3, 2), seed=1)
    y, _ = scan_kernels.selective_scan(**inputs)  # ScanCase returns the state by default
    assert y.grad_fn is None
    x = inputs["x"].detach().requires_grad_(True)
    with torch.no_grad():
        y, _ = scan_kernels.selective_scan(**{**inputs, "x": x})
    assert y.grad_fn is None


# -- clamp, softplus and bad input ------------------------------------------------------------


@pytest.mark.parametrize("backend", cpu_backends())
def test_clamp_passes_no_gradient_outside_its_bounds(backend):
    """ddt is zero wherever dt lies outside [dt_min, dt_max] and not elsewhere; and there the
    backend agrees with the reference (torch.clamp's gradient)."""
    gen = torch.Generator().manual_seed(random_seed())
    b, l, d, n = 1, 12, 5, 3
    x, B, C, dy = (torch.randn(*s, generator=gen) for s in ((b, l, d), (b, l, n), (b, l, n), (b, l, d)))
    dt = torch.rand(b, l, d, generator=gen) * 0.6  # below, inside and above [0.1, 0.4]
    A = -torch.rand(d, n, generator=gen) - 0.2
    grads = scan_kernels.selective_scan_backward(dy, x, dt, A, B, C, dt_min=0.1, dt_max=0.4, backend=backend)
    outside = (dt < 0.1) | (dt > 0.4)
    assert outside.any() and (~outside).any()
    assert bool((grads["dt"][outside] == 0).all())
    assert bool((grads["dt"][~outside] != 0).all())


def test_bad_cotangents_are_named():
    inputs = backward_inputs(make_scan_inputs(ScanCase(2, 5, 4, 3), seed=2))
    x = inputs["x"]
    with pytest.raises(scan_kernels.ShapeMismatch, match=r"dy: expected shape \[2, 5, 4\]"):
        scan_kernels.selective_scan_backward(x[:, :3], **inputs)
    with pytest.raises(scan_kernels.DtypeNotAllowed, match="dy: expected a floating dtype"):
        scan_kernels.selective_scan_backward(x.to(torch.int32), **inputs)
    with pytest.raises(scan_kernels.ShapeMismatch, match=r"dstate: expected shape \[2, 4, 3\]"):
        scan_kernels.selective_scan_backward(x, **inputs, dstate=torch.zeros(2, 4, 4))
    with pytest.raises(scan_kernels.KernelInputError, match="dy: expected a torch.Tensor"):
        scan_kernels.selective_scan_backward([1.0], **inputs)


def test_a_named_backend_without_a_backward_pass_is_refused(monkeypatch):
    """backend="name" without a backward is an error naming it; backend=None passes it over."""
    cpu_default = scan_kernels.select_backend("cpu")
    without = dataclasses.replace(_registry.get_backend(cpu_default, "cpu"), scan_backward=None,
                                  ssd_scan_backward=None)
    monkeypatch.setitem(_registry._loaded, cpu_default, without)
    inputs = backward_inputs(make_scan_inputs(ScanCase(1, 3, 2, 2), seed=3))
    with pytest.raises(scan_kernels.BackendUnavailable, match=f"backend '{cpu_default}' has no scan_backward"):
        scan_kernels.selective_scan_backward(inputs["x"], **inputs, backend=cpu_default)
    assert set(scan_kernels.selective_scan_backward(inputs["x"], **inputs)) == {"x", "dt", "A", "B", "C"}


# -- memory ---------------------------------------------------------------------------------------

# The cpu backward at 1 x 768 channels x 4096 steps x state 16 (every option), measured in a fresh
# process as the growth of its peak resident set (VmHWM, reset through /proc/self/clear_refs)
# over what the inputs already hold.
_MEMORY_SCRIPT = textwrap.dedent("""
    import json, torch, scan_kernels
    def status(key):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))
    batch, seq, dim, n = 1, 4096, 768, 16
    gen = torch.Generator().manual_seed(0)
    x, dt, z, dy = (torch.randn(batch, seq, dim, generator=gen) for _ in range(4))
    B, C = (torch.randn(batch, seq, 1, n, generator=gen) for _ in range(2))
    A, D, bias = -torch.rand(dim, n, generator=gen) - 0.1, torch.randn(dim), torch.randn(dim)
    options = dict(D=D, z=z, dt_bias=bias, dt_softplus=True, dt_min=0.001, dt_max=1.0, backend="cpu")
    scan_kernels.selective_scan_backward(dy[:, :64], x[:, :64], dt[:, :64], A, B[:, :64], C[:, :64],
                                    **{**options, "z": z[:, :64]})  # loads the library, starts helpers
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = status("VmRSS")
    grads = scan_kernels.selective_scan_backward(dy, x, dt, A, B, C, **options)
    print(json.dumps({"peak_extra": status("VmHWM") - before, "threads": torch.get_num_threads(),
                      "grads": sum(g.numel() * g.element_size() for g in grads.values()),
                      "inputs": sum(t.numel() * t.element_size() for t in (x, dt, z, dy, B, C, A, D, bias))}))
""")


def test_cpu_backward_peak_memory_is_bounded_by_its_chunks():
    """Bound: the gradients themselves, plus per thread its scratch: the states at every 16th
    step (seq / 16 x state vectors of its channel block) and one chunk's states, decays and
    tiles, plus 8 MiB of allocator slack. dt is discretized inside the kernel, so no [batch,
    seq, dim] temporary counts. The whole state history (4096 x 768 x 16 fp32: 192 MiB) would be
    far above it."""
    if "cpu" not in scan_kernels.available_backends():
        pytest.skip(f"cpu backend unavailable: {scan_kernels.unavailable_backends().get('cpu')}")
    run = subprocess.run([sys.executable, "-c", _MEMORY_SCRIPT], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    m = json.loads(run.stdout.strip().splitlines()[-1])
    seq, dim, state, chunk, vector = 4096, 768, 16, 16, 64  # chunk: kBackwardChunk
    per_thread = (math.ceil(seq / chunk) + 3 * chunk + 16) * state * vector
    bound = m["grads"] + m["threads"] * per_thread + 8 * 2**20
    history = seq * dim * state * 4
    print(f"peak extra {m['peak_extra'] / 2**20:.1f} MiB, bound {bound / 2**20:.1f} MiB, "
          f"inputs {m['inputs'] / 2**20:.1f} MiB, history {history / 2**20:.0f} MiB")
    assert m["peak_extra"] <= bound, m
    assert bound < history / 2


@pytest.mark.parametrize("dt_softplus", [pytest.param(False, id="plain"), pytest.param(True, id="softplus")])
def test_the_clamps_cut_passes_no_infinite_gradient_as_nan(dt_softplus):
    """The Triton backward's discretization: torch.clamp selects a zero gradient outside its
    bounds, where a multiply by the mask made an infinite one NaN, in ddt and in the summed
    ddt_bias (found in review)."""
    from scan_kernels.backward import discretize_backward

    dt = torch.tensor([[0.2, 0.9, 0.01, 0.3]])  # the second past dt_max, the third below dt_min
    if dt_softplus:
        dt = torch.log(torch.expm1(dt))  # softplus gives the values above back
    ddelta = torch.tensor([[1.5, math.inf, -math.inf, 2.0]])
    ddt, ddt_bias = discretize_backward(ddelta.clone(), dt, torch.zeros(4), dt_softplus, 0.05, 0.5, torch.float32)
    dt_leaf = dt.clone().requires_grad_()
    clamped = (torch.nn.functional.softplus(dt_leaf) if dt_softplus else dt_leaf).clamp(0.05, 0.5)
    clamped.backward(ddelta)
    assert ddt[0, 1] == ddt[0, 2] == 0, ddt
    torch.testing.assert_close(ddt, dt_leaf.grad, rtol=1e-6, atol=0)  # sigmoid against softplus' own form
    torch.testing.assert_close(ddt_bias, dt_leaf.grad[0], rtol=1e-6, atol=0)
