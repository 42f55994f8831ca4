"""The Triton backend against the float64 reference.

Without a GPU every kernel runs on Triton's CPU interpreter (tests/conftest.py sets
TRITON_INTERPRET=1 before triton is imported) at small odd sizes and with small blocks, so that
one case crosses several tiles, channel blocks and sequence segments and leaves remainders in
each. The interpreter scans only ~10k elements a second, so the heaviest combinations run on a
GPU only. With CUDA the same tests run on the GPU with the production block table, plus real
sizes and fp16/bf16.

Every output is NaN-filled before the launch (the launchers take `out=` / `state_out=`), so an
element no program writes fails the comparison. Inputs are fresh random draws; the seed is in
every failure message.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

triton = pytest.importorskip("triton", reason="triton is not installed: the Triton backend cannot be tested")

import scan_kernels  # noqa: E402
from kernel_cases import (  # noqa: E402
    INTERPRETER_NONFINITE_WARNINGS,
    CUDA_COMPILES_EVERY_KERNEL, DTYPES, INTERPRETER_OTHER_SPLIT, LARGE_SCAN_CASES, ON_CUDA, SCAN_CASES,
    TOLERANCES, TRITON_NOT_SERVING, UPDATE_CASES, ScanCase, UpdateCase, assert_close, assert_same_nans_and_close,
    assert_scan_matches_reference, assert_scan_outputs_match_reference, assert_update_outputs_match_reference,
    make_scan_inputs, make_update_inputs, random_seed, reference_scan, reference_update, state_dtype,
    assert_packed_matches_each_sequence, ZERO_DECAY_REGIMES, with_zero_decays, INFINITE_INPUT_STATES,
    assert_infinities_as_the_reference, reference_with_an_infinite_x, with_an_infinite_x,
)
from scan_kernels import _args  # noqa: E402
from scan_kernels._registry import get_backend  # noqa: E402
from scan_kernels.triton_kernels import common, configs  # noqa: E402
from scan_kernels.triton_kernels.common import run_on_device_of  # noqa: E402
from scan_kernels.triton_kernels import scan as triton_scan  # noqa: E402
from scan_kernels.triton_kernels import state_update as triton_update  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICES = [
    pytest.param("cpu", id="interpreter"),
    pytest.param("cuda", id="cuda", marks=ON_CUDA),
]

# Interpreter blocks: tiles of 4 steps x 4 channels. On CUDA the tests use the production table.
INTERPRETER_SCAN_BLOCKS = configs.ScanBlocks(block_d=4, chunk=4, num_warps=1)
INTERPRETER_UPDATE_BLOCKS = configs.UpdateBlocks(block_d=4, num_warps=1)


def _scan_split_params():
    """Every shared case in two sequence splits: one segment (a single launch; the state crosses
    tiles in registers) and segments of two tiles (pass 1 writes carries, pass 2 looks back over
    them). The three slowest cases on the interpreter run there in one split."""
    interpreter_once = {("all-options-bld", "two-tiles"), ("all-options-bdl", "whole"),
                        ("long-odd", "whole")}
    params = []
    for case in SCAN_CASES:
        for split, split_id in (("whole", "one-segment"), ("two-tiles", "2-tile-segments")):
            slow = (case.id, split) in interpreter_once
            params.append(pytest.param(case.values[0], split, slow, id=f"{case.id}-{split_id}"))
    return params


def _backend(device: str):
    try:
        return get_backend("triton", device)
    except scan_kernels.BackendUnavailable as exc:
        pytest.skip(f"{TRITON_NOT_SERVING.format(device=device)}: {exc}")


def _poisoned(shape, dtype, device):
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def _run_scan(inputs: dict, blocks=None, segment_len=None):
    """The backend's launcher on validated inputs, writing into NaN-filled outputs."""
    args = _args.check_scan(**inputs)
    d = args.dims
    y = _poisoned(args.x.shape, args.x.dtype, args.x.device)
    state = _poisoned((d.batch, d.dim, d.state), state_dtype(args.x.dtype), args.x.device) if args.return_state else None
    return triton_scan.selective_scan(args.x, args.dt, args.A, args.B, args.C, **args.backend_kwargs(),
                                      out=y, state_out=state, blocks=blocks, segment_len=segment_len)


def _check_scan(case: ScanCase, dtype, device, blocks=None, segment_len=None, what=""):
    seed = random_seed()
    inputs = make_scan_inputs(case, dtype, device, seed=seed)
    y, state = _run_scan(inputs, blocks, segment_len)
    assert_scan_outputs_match_reference(case, dtype, inputs, y, state, f"{what} seed={seed}")


def _chunk(case: ScanCase, blocks) -> int:
    return (blocks or configs.scan_blocks(case.state, case.dim // case.groups)[1]).chunk


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case, split, interpreter_slow", _scan_split_params())
def test_scan_matches_reference(case, split, interpreter_slow, device):
    _backend(device)
    if device == "cpu" and interpreter_slow:
        pytest.skip(INTERPRETER_OTHER_SPLIT)
    blocks = INTERPRETER_SCAN_BLOCKS if device == "cpu" else None
    segment_len = case.seq if split == "whole" else 2 * _chunk(case, blocks)
    _check_scan(case, torch.float32, device, blocks, segment_len, what=split)


# Padded steps past a tile's end have dt 0, and with A of -inf their exp(0 * A) was NaN, the
# final state NaN with it. Segments of two tiles: the look-back over carries decays by -inf too.
@INTERPRETER_NONFINITE_WARNINGS
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("regime", ZERO_DECAY_REGIMES)
@pytest.mark.parametrize("split", ["whole", "two-tiles"])
def test_scan_with_decays_of_zero(split, regime, device):
    _backend(device)
    case = ScanCase(2, 11, 5, 3, D=True, z=True, dt_softplus=True, h0=True)
    seed = random_seed()
    inputs = with_zero_decays(make_scan_inputs(case, torch.float32, device, seed=seed), regime)
    blocks = INTERPRETER_SCAN_BLOCKS if device == "cpu" else None
    segment_len = case.seq if split == "whole" else 2 * _chunk(case, blocks)
    y, state = _run_scan(inputs, blocks, segment_len)
    assert_scan_outputs_match_reference(case, torch.float32, inputs, y, state, f"{split} {regime} seed={seed}",
                                        to_term_magnitudes=True)


# kernel_cases.INFINITE_INPUT_STATES: the padded state entries past a state of 3, 5 (BLOCK_N 4, 8)
# held 0 * inf, NaN, which y's sum took where the reference's y is +inf; and an A of +inf made a
# padded step's exp(0 * A) NaN, the final state with it.
@INTERPRETER_NONFINITE_WARNINGS
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("state_size", INFINITE_INPUT_STATES)
@pytest.mark.parametrize("kind", ["scan", "update", "ssd_update"])
def test_an_infinite_input_gives_the_references_infinity(kind, state_size, device):
    _backend(device)
    seed = random_seed()
    inputs = with_an_infinite_x(kind, state_size, seed)
    y_ref, state_ref = reference_with_an_infinite_x(kind, inputs)
    inputs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    if kind == "scan":
        y, state = scan_kernels.selective_scan(**inputs, backend="triton")
    else:
        update = scan_kernels.selective_state_update if kind == "update" else scan_kernels.ssd_state_update
        y, state = update(**inputs, backend="triton"), inputs["state"]
    what = f"{device} {kind} state {state_size} seed={seed}"
    assert_infinities_as_the_reference(y.cpu(), y_ref, f"{what} y")
    assert_infinities_as_the_reference(state.cpu(), state_ref, f"{what} state")
    if kind == "scan":
        # h0 of ones: from a zero state the reference's first decay of inf times 0 is NaN.
        grows = dict(inputs, x=torch.ones_like(inputs["x"]), A=inputs["A"].clone(),
                     h0=torch.ones(state.shape, device=device))
        grows["A"][1, 0] = float("inf")
        _, state = scan_kernels.selective_scan(**grows, backend="triton")
        assert_infinities_as_the_reference(state.cpu(), reference_scan(grows)[1].cpu(), f"{what} A = +inf state")


# Packed sequences (cu_seqlens) in one launch: sequences of 1, 5 and 11 steps, so with
# segments of two 4-step tiles the longest takes two segments (carries), one ends mid-tile and
# one ends before the second segment starts.
PACKED_BOUNDS = [0, 1, 6, 17]


@pytest.mark.parametrize("layout", ["bld", "bdl"])
@pytest.mark.parametrize("device", DEVICES)
def test_packed_scan_matches_each_sequence(device, layout):
    _backend(device)
    seed = random_seed()
    case = ScanCase(1, PACKED_BOUNDS[-1], 12, 4, groups=2, layout=layout, D=True, z=True, dt_bias=True,
                    dt_softplus=True, clamp=True)
    inputs = make_scan_inputs(case, torch.float32, device, seed=seed)
    h0 = torch.randn(len(PACKED_BOUNDS) - 1, 12, 4, generator=torch.Generator().manual_seed(seed)).to(device)
    args = _args.check_scan(**inputs)
    y = _poisoned(args.x.shape, args.x.dtype, args.x.device)
    state = _poisoned(tuple(h0.shape), torch.float32, args.x.device)
    blocks = INTERPRETER_SCAN_BLOCKS if device == "cpu" else None
    triton_scan.selective_scan(args.x, args.dt, args.A, args.B, args.C, **{**args.backend_kwargs(), "h0": h0},
                               cu_seqlens=torch.tensor(PACKED_BOUNDS), out=y, state_out=state, blocks=blocks,
                               segment_len=2 * _chunk(case, blocks))
    assert_packed_matches_each_sequence(y, state, inputs, h0, PACKED_BOUNDS, layout, torch.float32,
                                        f"{device} packed seed={seed}")


def test_the_public_api_hands_packed_sequences_to_the_kernels_whole(monkeypatch):
    """scan_kernels.selective_scan gives the backend the packed call with its boundaries: one set of
    launches, not one a sequence (scan_kernels/_varlen.py's split)."""
    _backend("cpu")
    seen = []
    launches = triton_scan.scan_launches

    def counted(*args, **kwargs):
        seen.append(kwargs["cu_seqlens"])
        return launches(*args, **kwargs)

    monkeypatch.setattr(triton_scan, "scan_launches", counted)
    inputs = make_scan_inputs(ScanCase(1, PACKED_BOUNDS[-1], 4, 4), torch.float32, "cpu", seed=random_seed())
    scan_kernels.selective_scan(**inputs, cu_seqlens=torch.tensor(PACKED_BOUNDS, dtype=torch.int32), backend="triton")
    assert [None if b is None else b.tolist() for b in seen] == [PACKED_BOUNDS]


# Reduced-precision and fp64 inputs on the interpreter: small cases that still cross tiles,
# channel blocks, groups and segments. fp64 checks the fp64 accumulation (and exact fp64 clamp
# bounds) at the fp64 tolerance.
DTYPE_CASES = [
    pytest.param(ScanCase(2, 11, 12, 4, groups=2, layout="bdl", D=True, z=True, dt_bias=True,
                          dt_softplus=True, h0=True), id="options-bdl"),
    pytest.param(ScanCase(3, 9, 6, 5, clamp=True, D=True), id="clamp-D"),
]
# f32 has the cases above; these add the other dtypes (the interpreter runs them on the CPU).
NON_F32_DTYPES = [p for p in DTYPES if p.values[0] != torch.float32]


@pytest.mark.parametrize("dtype", NON_F32_DTYPES)
@pytest.mark.parametrize("case", DTYPE_CASES)
def test_scan_dtypes_on_interpreter(case, dtype):
    _backend("cpu")
    _check_scan(case, dtype, "cpu", INTERPRETER_SCAN_BLOCKS, 2 * INTERPRETER_SCAN_BLOCKS.chunk,
                what="2-tile-segments")


# Real sizes on a GPU, with the planned split: the ExPhil request (one launch), batch 1 with a
# long sequence (split into segments to fill the GPU), "bdl" with groups, a larger state.
REAL_SCAN_CASES = [
    pytest.param(ScanCase(32, 60, 512, 16, clamp=True), id="exphil-32x60x512x16"),
    pytest.param(ScanCase(1, 4096, 512, 16, D=True, z=True, dt_bias=True, dt_softplus=True),
                 id="batch1-seq4096"),
    pytest.param(ScanCase(2, 1000, 768, 16, groups=2, layout="bdl", D=True, z=True, dt_bias=True,
                          dt_softplus=True, clamp=True, h0=True), id="bdl-groups2-all-options"),
    pytest.param(ScanCase(3, 257, 200, 64, h0=True), id="state64-odd"),
    *LARGE_SCAN_CASES,
]


@ON_CUDA
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", REAL_SCAN_CASES)
def test_scan_real_sizes_on_gpu(case, dtype):
    _backend("cuda")
    _check_scan(case, dtype, "cuda", what="planned split")


@pytest.mark.parametrize("device", DEVICES)
def test_scan_table_blocks_and_planned_split(device):
    """The production table and split (not the tests' small blocks) on an odd grouped case."""
    _backend(device)
    _check_scan(ScanCase(3, 21, 12, 4, groups=2, D=True, z=True, h0=True), torch.float32, device,
                what="table blocks")


@pytest.mark.parametrize("device", DEVICES)
def test_scan_reads_strided_views(device):
    """Non-contiguous views of larger buffers, and a non-contiguous y: the kernels follow
    strides (nothing is made contiguous) and write only y's elements."""
    _backend(device)
    seed = random_seed()
    gen = torch.Generator().manual_seed(seed)
    b, l, d, n, g = 2, 10, 6, 3, 2

    def rand(*shape):
        return (torch.rand(shape, generator=gen) * 2 - 1).to(device)

    x = rand(b, l, 2 * d)[:, :, ::2]  # every other channel
    dt = rand(b, d, l).transpose(1, 2).abs() * 0.5 + 0.01  # "bdl" memory read as "bld"
    B = rand(b, n, g, l).permute(0, 3, 2, 1)  # [b, l, g, n], state axis not innermost
    C = rand(b, l, g, n + 2)[..., 1:-1]
    A = -rand(n, d).t().abs() - 0.1
    D = rand(2 * d)[::2]
    h0 = rand(b, n, d).transpose(1, 2)
    inputs = dict(x=x, dt=dt, A=A, B=B, C=C, D=D, h0=h0, return_state=True)
    args = _args.check_scan(**inputs)
    y_buffer = _poisoned((b, l, 2 * d), torch.float32, device)
    y, state = triton_scan.selective_scan(
        args.x, args.dt, args.A, args.B, args.C, **args.backend_kwargs(), out=y_buffer[:, :, 1::2],
        blocks=INTERPRETER_SCAN_BLOCKS if device == "cpu" else None)
    y_ref, state_ref = reference_scan(inputs)
    assert_close(y, y_ref, torch.float32, f"y seed={seed}")
    assert_close(state, state_ref, torch.float32, f"state seed={seed}")
    assert torch.isnan(y_buffer[:, :, ::2]).all(), "wrote outside the strided y view"


@pytest.mark.parametrize("device", DEVICES)
def test_scan_through_public_api(device):
    """`scan_kernels.selective_scan(..., backend="triton")` reaches these kernels (3-D B/C included)."""
    _backend(device)
    seed = random_seed()
    assert_scan_matches_reference("triton", ScanCase(2, 7, 5, 3, bc_3d=True, D=True), torch.float32, seed,
                                  f"seed={seed}", device)


def _run_update(inputs: dict, blocks=None):
    args = _args.check_state_update(**inputs)
    y = _poisoned(args.x.shape, args.x.dtype, args.x.device)
    return triton_update.selective_state_update(args.state, args.x, args.dt, args.A, args.B, args.C,
                                                **args.backend_kwargs(), out=y, blocks=blocks)


def _check_update(case: UpdateCase, dtype, device, blocks=None):
    seed = random_seed()
    inputs = make_update_inputs(case, dtype, device, seed=seed)
    before = inputs["state"].clone()
    y = _run_update(inputs, blocks)
    assert_update_outputs_match_reference(case, dtype, inputs, before, y, f"seed={seed}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", UPDATE_CASES)
def test_state_update_matches_reference(case, dtype, device):
    _backend(device)
    _check_update(case, dtype, device, INTERPRETER_UPDATE_BLOCKS if device == "cpu" else None)


def _stage(capture, inputs: dict):
    """Write `inputs`' x, dt, B, C, z and slots into `capture`; returns it."""
    for name in ("x", "dt", "B", "C", "z", "slots"):
        if inputs.get(name) is not None:
            capture.stage(name, inputs[name].cpu().contiguous().view(torch.uint8).numpy())
    return capture


def _capture_and_stage(inputs: dict):
    """A capture made from `inputs`' shapes, with `inputs` staged."""
    return _stage(scan_kernels.capture_state_update(**inputs, backend="triton"), inputs)


@ON_CUDA
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", [p for p in UPDATE_CASES if p.values[0].pool is not None])
def test_captured_state_update_replays_fresh_inputs(case, dtype):
    """A capture replayed three times, each time on fresh inputs written into it, against the
    reference: y, padding rows, the slots' state rows updated and every other row untouched.
    The state pool and A/D/dt_bias stay the capture's; x, dt, B, C, z and slots change."""
    seed = random_seed()
    inputs = make_update_inputs(case, dtype, "cuda", seed=seed)
    capture = _capture_and_stage(inputs)
    for replay in range(3):
        fresh = make_update_inputs(case, dtype, "cuda", seed=seed + 1 + replay)
        fresh.update({name: inputs[name] for name in ("state", "A", "D", "dt_bias") if name in inputs})
        _stage(capture, fresh)
        before = inputs["state"].clone()
        y = capture.run()
        assert y.device.type == "cpu" and y.is_pinned() and y.dtype == dtype
        assert_update_outputs_match_reference(case, dtype, fresh, before, y.to("cuda"),
                                              f"seed={seed} replay {replay}")


@ON_CUDA
def test_a_capture_refuses_to_replay_once_its_pool_is_freed():
    case = UpdateCase(3, 20, 16, pool=5)
    inputs = make_update_inputs(case, torch.float32, "cuda", seed=random_seed())
    capture = _capture_and_stage(inputs)
    capture.run()
    assert capture.alive()
    del inputs["state"]
    assert not capture.alive()
    with pytest.raises(RuntimeError, match="freed"):
        capture.run()


@ON_CUDA
def test_a_capture_takes_only_its_own_sizes():
    inputs = make_update_inputs(UpdateCase(3, 20, 16, pool=5), torch.float32, "cuda", seed=random_seed())
    capture = _capture_and_stage(inputs)
    with pytest.raises(ValueError, match=r"x: expected 240 bytes \(the captured shape\), got 236"):
        capture.stage("x", bytes(236))


@pytest.mark.parametrize("device", DEVICES)
def test_capture_checks_its_arguments_and_captures_only_on_cuda(device):
    _backend(device)
    inputs = make_update_inputs(UpdateCase(3, 20, 16, pool=5), torch.float32, device, seed=random_seed())
    with pytest.raises(scan_kernels.ShapeMismatch, match="slots"):
        scan_kernels.capture_state_update(**{**inputs, "slots": inputs["slots"][:2]}, backend="triton")
    with pytest.raises(scan_kernels.KernelInputError, match="slots: expected an int32/int64 tensor"):
        scan_kernels.capture_state_update(**{**inputs, "slots": None}, backend="triton")
    capture = scan_kernels.capture_state_update(**inputs, backend="triton")
    # The interpreter compiles nothing to capture; a GPU's Triton does.
    assert (capture is None) == (device == "cpu")


# dt pre-activations where log(1 + exp(dt)) in fp32 lost softplus's relative precision (4e-4 at
# -10, 9e-3 at -12, all of it from -17), ordinary ones, and both sides of the threshold (20)
# above which softplus is dt itself.
SOFTPLUS_POINTS = (-30.0, -17.0, -12.0, -10.0, -3.0, 0.0, 4.0, 19.5, 20.5, 40.0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, id="f32"), pytest.param(torch.float64, id="f64")])
def test_softplus_keeps_its_relative_precision_far_below_zero(device, dtype):
    """From a zero state y = softplus(dt) x (B . C) and the state is softplus(dt) x B, both
    proportional to softplus(dt): against the reference with the dtype's rtol and no atol,
    which at softplus(-30) = 9e-14 would accept anything. B, C and x are positive, so that no
    sum cancels. fp16 and bf16 are left out: y in fp16 cannot hold such small values."""
    _backend(device)
    seed = random_seed()
    gen = torch.Generator().manual_seed(seed)
    batch, dim, nstate = 2, len(SOFTPLUS_POINTS), 4

    def positive(*shape):
        return (torch.rand(shape, generator=gen) + 0.5).to(device=device, dtype=dtype)

    inputs = dict(state=torch.zeros(batch, dim, nstate, dtype=dtype, device=device), x=positive(batch, dim),
                  dt=torch.tensor(SOFTPLUS_POINTS, dtype=dtype, device=device).repeat(batch, 1),
                  A=-positive(dim, nstate).float(), B=positive(batch, nstate), C=positive(batch, nstate),
                  dt_softplus=True)
    y_ref, state_ref = reference_update(inputs)
    y = _run_update(inputs, INTERPRETER_UPDATE_BLOCKS if device == "cpu" else None)
    relative_only = (TOLERANCES[dtype][0], 0.0)
    assert_close(y, y_ref, dtype, f"y seed={seed}", relative_only)
    assert_close(inputs["state"], state_ref, dtype, f"state seed={seed}", relative_only)


@pytest.mark.parametrize("device", DEVICES)
def test_clamp_keeps_a_nan_dt_nan(device):
    """A NaN dt (an upstream overflow, say) under dt_min/dt_max stays NaN in y and the state, as
    torch.clamp keeps it in the reference, rather than becoming a bound and a finite output."""
    _backend(device)
    seed = random_seed()
    case = ScanCase(1, 6, 4, 2, clamp=True)
    inputs = make_scan_inputs(case, torch.float32, device, seed=seed)
    inputs["dt"][0, 3, 0] = float("nan")
    y_ref, state_ref = reference_scan(inputs)
    y, state = scan_kernels.selective_scan(**inputs, backend="triton")
    assert_same_nans_and_close(y, y_ref, f"scan y seed={seed}")
    assert_same_nans_and_close(state, state_ref, f"scan state seed={seed}")

    update = make_update_inputs(UpdateCase(2, 4, 3, pool=3, clamp=True), torch.float32, device, seed=seed)
    update["dt"][0, 1] = float("nan")
    y_ref, state_ref = reference_update(update)
    y = scan_kernels.selective_state_update(**update, backend="triton")
    assert_same_nans_and_close(y, y_ref, f"update y seed={seed}")
    assert_same_nans_and_close(update["state"], state_ref, f"update state seed={seed}")


@pytest.mark.parametrize("device", DEVICES)
def test_state_update_table_blocks(device):
    _backend(device)
    _check_update(UpdateCase(5, 40, 16, groups=2, pool=8, padding_rows=2, D=True, z=True), torch.float32, device)


REAL_UPDATE_CASES = [
    pytest.param(UpdateCase(32, 512, 16, pool=100, padding_rows=5, D=True, z=True, dt_bias=True,
                            dt_softplus=True), id="batch32-pool100"),
    pytest.param(UpdateCase(3, 2050, 128, groups=2, clamp=True), id="wide-state128"),
]


@ON_CUDA
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", REAL_UPDATE_CASES)
def test_state_update_real_sizes_on_gpu(case, dtype):
    _backend("cuda")
    _check_update(case, dtype, "cuda")


@pytest.mark.parametrize("device", DEVICES)
def test_scan_then_steps_continue_the_sequence(device):
    """A scan's final state fed to state updates gives the same y as one longer scan."""
    _backend(device)
    seed = random_seed()
    case = ScanCase(2, 9, 6, 4, D=True, z=True, dt_bias=True, dt_softplus=True)
    inputs = make_scan_inputs(case, torch.float32, device, seed=seed)
    y_ref, _ = reference_scan(inputs)
    prefix = 6
    head = {**inputs, **{k: inputs[k][:, :prefix] for k in ("x", "dt", "z", "B", "C")}, "return_state": True}
    blocks = INTERPRETER_SCAN_BLOCKS if device == "cpu" else None
    _, state = triton_scan.selective_scan(**_normalised_scan(head), blocks=blocks)
    for t in range(prefix, case.seq):
        step = {k: inputs[k][:, t] for k in ("x", "dt", "z", "B", "C")}
        y_t = scan_kernels.selective_state_update(state, **step, A=inputs["A"], D=inputs["D"],
                                             dt_bias=inputs["dt_bias"], dt_softplus=True, backend="triton")
        assert_close(y_t, y_ref[:, t], torch.float32, f"y at step {t} seed={seed}")


def _normalised_scan(inputs: dict) -> dict:
    args = _args.check_scan(**inputs)
    return dict(x=args.x, dt=args.dt, A=args.A, B=args.B, C=args.C, **args.backend_kwargs())


# --- element offsets past 2^31: the WIDE_OFFSETS variant ----------------------------------------

@pytest.mark.parametrize("shape, strides, largest", [
    pytest.param((2, 3, 4), (12, 4, 1), 23, id="contiguous"),
    pytest.param((2, 3, 4), (1, 8, 2), 1 + 16 + 6, id="permuted"),
    pytest.param((5, 3), (0, 1), 2, id="broadcast-axis"),
    pytest.param((2, 0, 4), (4, 4, 1), 0, id="empty"),
    pytest.param((), (), 0, id="scalar"),
])
def test_largest_offset(shape, strides, largest):
    assert common.largest_offset(shape, strides) == largest


def _meta(shape, strides=None, dtype=torch.float32):
    """A tensor with shape and strides but no memory (device "meta"): launches can be built for
    views of buffers far larger than this machine could allocate; they are never run."""
    strides = strides or torch.empty(shape, device="meta").stride()
    return torch.empty_strided(shape, strides, dtype=dtype, device="meta")


@pytest.mark.parametrize("x_shape, x_strides, wide", [
    # x [1, 3, 5]: timesteps `step` elements apart, so its largest offset is 2 step + 4.
    pytest.param((1, 3, 5), (0, 2**30 - 3, 1), False, id="largest-offset-2^31-2"),
    pytest.param((1, 3, 5), (0, 2**30 - 2, 1), True, id="largest-offset-2^31"),
    pytest.param((1, 3, 5), (0, 3 * 2**29, 1), True, id="review-repro-3.2e9"),
    # Rows 2^40 elements apart: the kernels index rows in int64 already.
    pytest.param((4, 3, 5), (2**40, 5, 1), False, id="far-apart-rows"),
])
def test_scan_launches_take_int64_offsets_from_2_31_elements_in_a_row(x_shape, x_strides, wide):
    batch, seq, dim = x_shape
    x = _meta(x_shape, x_strides, torch.float16)
    bc = _meta((batch, seq, 1, 2), dtype=torch.float16)
    _, _, launches = triton_scan.scan_launches(
        x, _meta(x_shape, dtype=torch.float16), _meta((dim, 2)), bc, bc, D=None, z=None, dt_bias=None,
        dt_softplus=False, dt_min=None, dt_max=None, h0=None, return_state=True, layout="bld",
        out=None, state_out=None, blocks=configs.ScanBlocks(block_d=4, chunk=1, num_warps=1), segment_len=1)
    assert len(launches) == 2  # both kernels: one segment per timestep
    assert [launch.constexprs["WIDE_OFFSETS"] for launch in launches] == [wide, wide]


@pytest.mark.parametrize("state_shape, state_strides, wide", [
    # A pool of one row whose channels lie `step` elements apart: largest offset 2 step + 1.
    pytest.param((1, 3, 2), (0, 2**30 - 1, 1), False, id="largest-offset-2^31-1"),
    pytest.param((1, 3, 2), (0, 2**30, 1), True, id="largest-offset-2^31+1"),
    # A pool of 2^25 sessions, 2^34 elements: slots are indexed in int64 already.
    pytest.param((2**25, 32, 16), None, False, id="large-pool"),
])
def test_state_update_launch_takes_int64_offsets_from_2_31_elements_in_a_row(state_shape, state_strides, wide):
    _, dim, nstate = state_shape
    bc = _meta((1, 1, nstate))
    _, launch = triton_update.update_launch(
        _meta(state_shape, state_strides), _meta((1, dim)), _meta((1, dim)), _meta((dim, nstate)), bc, bc,
        D=None, z=None, dt_bias=None, dt_softplus=False, dt_min=None, dt_max=None,
        slots=_meta((1,), dtype=torch.int64), out=None, blocks=None)
    assert launch.constexprs["WIDE_OFFSETS"] == wide


@pytest.fixture
def wide_offsets_everywhere(monkeypatch):
    """Every launch takes the WIDE_OFFSETS variant, whatever its size."""
    monkeypatch.setattr(common, "INT32_OFFSET_LIMIT", 0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["bld", "bdl"])
def test_scan_int64_offsets_variant_matches_reference(device, layout, wide_offsets_everywhere):
    """The variant inputs of 2^31 elements and more take, at a size the interpreter runs: both
    kernels (segments of two tiles), groups, every option."""
    _backend(device)
    blocks = INTERPRETER_SCAN_BLOCKS if device == "cpu" else None
    chunk = (blocks or configs.scan_blocks(4, 6)[1]).chunk
    case = ScanCase(2, 3 * chunk + 1, 12, 4, groups=2, layout=layout, D=True, z=True, dt_bias=True,
                    dt_softplus=True, clamp=True, h0=True)
    seed = random_seed()
    inputs = make_scan_inputs(case, torch.float32, device, seed=seed)
    args = _args.check_scan(**inputs)
    y, state, launches = triton_scan.scan_launches(
        args.x, args.dt, args.A, args.B, args.C, **args.backend_kwargs(),
        out=_poisoned(args.x.shape, torch.float32, device), state_out=_poisoned((2, 12, 4), torch.float32, device),
        blocks=blocks, segment_len=2 * chunk)
    assert [launch.constexprs["WIDE_OFFSETS"] for launch in launches] == [True, True]
    run_on_device_of(args.x, launches)
    assert_scan_outputs_match_reference(case, torch.float32, inputs, y, state, f"int64 offsets seed={seed}")


@pytest.mark.parametrize("device", DEVICES)
def test_state_update_int64_offsets_variant_matches_reference(device, wide_offsets_everywhere):
    _backend(device)
    case = UpdateCase(7, 20, 16, groups=2, pool=11, padding_rows=3, D=True, z=True, dt_bias=True,
                      dt_softplus=True, clamp=True)
    seed = random_seed()
    inputs = make_update_inputs(case, torch.float32, device, seed=seed)
    before = inputs["state"].clone()
    args = _args.check_state_update(**inputs)
    y, launch = triton_update.update_launch(
        args.state, args.x, args.dt, args.A, args.B, args.C, **args.backend_kwargs(),
        out=_poisoned(args.x.shape, torch.float32, device),
        blocks=INTERPRETER_UPDATE_BLOCKS if device == "cpu" else None)
    assert launch.constexprs["WIDE_OFFSETS"]
    run_on_device_of(args.x, [launch])
    assert_update_outputs_match_reference(case, torch.float32, inputs, before, y, f"int64 offsets seed={seed}")


def test_backend_serves_cpu_only_through_the_interpreter():
    backend = _backend("cpu") if not CUDA else get_backend("triton", "cuda")
    assert backend.name == "triton"
    assert backend.details["interpreter"] == ("cpu" in backend.device_types)
    assert ("cuda" in backend.device_types) == CUDA
    assert backend.warmup is not None


@pytest.mark.parametrize("device", DEVICES)
def test_warmup_runs_each_bucket_and_describes_it(device):
    _backend(device)
    shapes = [
        dict(batch=2, seq=5, dim=6, state=3),
        dict(batch=1, seq=9, dim=4, state=2, groups=2, layout="bdl", D=True, z=True, clamp=True,
             h0=True, return_state=True, slots=False),
        dict(batch=1, seq=40, dim=4, state=2),  # long enough to split: both forms are warmed
        dict(batch=2, seq=7, dim=4, headdim=3, state=5, groups=2, D=True, z=True, dt_bias=True, dt_softplus=True,
             clamp=True, h0=True, return_state=True),  # Mamba-2
    ]
    described = scan_kernels.warmup(shapes, device=device, dtype=torch.float32, backend="triton")
    assert len(described) == 8
    assert described[0].startswith("triton scan bld batch=2 seq=5 dim=6 state=3 groups=1 float32")
    assert described[1].startswith("triton state_update batch=2 dim=6 state=3 groups=1 float32 slots=True")
    assert "options=['D', 'z', 'clamp', 'h0', 'return_state']" in described[2]
    assert "slots=False options=['D', 'z', 'clamp']" in described[3]
    assert "(1 launch)" in described[4] and "; also " in described[4] and "(2 launches)" in described[4]
    assert "; also " not in described[0]  # seq 5 fits one chunk: there is no other form
    assert described[6].startswith("triton ssd_scan batch=2 seq=7 heads=4 headdim=3 state=5 groups=2 float32 "
                                   "options=['D', 'z', 'dt_bias', 'dt_softplus', 'clamp', 'h0', 'return_state']")
    assert described[7].startswith("triton ssd_state_update batch=2 heads=4 headdim=3 state=5 groups=2 float32 "
                                   "slots=True options=['D', 'z', 'dt_bias', 'dt_softplus', 'clamp']")
    suffix = "(interpreted, nothing compiled)" if device == "cpu" else "(compiled)"
    assert all(line.endswith(suffix) for line in described)


@pytest.mark.parametrize("shape, field", [
    pytest.param(dict(batch=1, seq=2, dim=3), "shapes", id="missing-state"),
    pytest.param(dict(batch=1, seq=2, dim=3, state=2, chunk=4), "shapes", id="unknown-key"),
    pytest.param(dict(batch=0, seq=2, dim=3, state=2), "shapes.batch", id="zero-batch"),
    pytest.param(dict(batch=1, seq=2, dim=3, state=2, groups=2), "shapes.groups", id="groups-not-dividing"),
    pytest.param(dict(batch=1, seq=2, dim=4, state=2, layout="lbd"), "shapes.layout", id="bad-layout"),
    pytest.param(dict(batch=1, seq=2, dim=4, state=2, dtype=torch.int32), "shapes.dtype", id="integer-dtype"),
    pytest.param(dict(batch=1, seq=2, dim=4, headdim=0, state=2), "shapes.headdim", id="zero-headdim"),
    pytest.param(dict(batch=1, seq=2, dim=3, headdim=4, state=2, groups=2), "shapes.groups",
                 id="groups-not-dividing-heads"),
    pytest.param(dict(batch=1, seq=2, dim=4, headdim=4, state=2, layout="bdl"), "shapes.layout",
                 id="ssd-bdl-layout"),
    # An option is a bool, not read by its truthiness: "false" warmed the variant with D.
    pytest.param(dict(batch=1, seq=2, dim=4, state=2, D="false"), "shapes.D", id="option-str"),
    pytest.param(dict(batch=1, seq=2, dim=4, state=2, slots=0), "shapes.slots", id="slots-int"),
])
def test_warmup_rejects_bad_buckets(shape, field):
    _backend("cpu" if not CUDA else "cuda")
    with pytest.raises(scan_kernels.KernelInputError) as info:
        scan_kernels.warmup([shape], device="cpu" if not CUDA else "cuda", backend="triton")
    assert info.value.field == field


def test_launcher_rejects_a_wrong_out_tensor():
    device = "cpu" if not CUDA else "cuda"
    _backend(device)
    args = _args.check_scan(**make_scan_inputs(ScanCase(1, 3, 2, 2), torch.float32, device, seed=random_seed()))
    with pytest.raises(scan_kernels.KernelInputError) as info:
        triton_scan.selective_scan(args.x, args.dt, args.A, args.B, args.C, **args.backend_kwargs(),
                                   out=torch.empty(1, 3, 3, device=device))
    assert info.value.field == "out"


def _nvidia_backend_present() -> bool:
    from triton.backends import backends

    return "nvidia" in backends


@pytest.mark.skipif(CUDA, reason=CUDA_COMPILES_EVERY_KERNEL)
def test_kernels_compile_for_sm90_without_spills():
    """The interpreter compiles nothing: compile every kernel variant family for an H100/H200
    (sm_90) here, as the JIT would specialise it, and check ptxas reports no spills."""
    if not _nvidia_backend_present():
        pytest.skip("this triton build has no NVIDIA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, without its warning
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "-m", "scan_kernels.triton_kernels.aot_check", "--arch", "90"],
                          cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    names = ("_scan_output_kernel", "_segment_state_kernel", "_state_update_kernel", "_ssd_prep_kernel",
             "_ssd_chunk_state_kernel", "_ssd_state_passing_kernel", "_ssd_chunk_scan_kernel", "_ssd_update_kernel")
    missing = [name for name in names if not any(name in line for line in lines)]
    assert not missing, (missing, done.stdout)
    assert all(": ok," in line for line in lines), done.stdout


@pytest.mark.parametrize("shape, segments", [
    # (batch, seq, dim, state) on a 132-SM H100 with the table's blocks
    pytest.param((32, 60, 512, 16), 1, id="exphil-fills-the-gpu-alone"),
    pytest.param((1, 4096, 512, 16), 9, id="batch1-long-split-to-2-waves"),
    pytest.param((1, 1 << 20, 16, 16), 32, id="capped-at-max-segments"),
    pytest.param((1, 40, 16, 16), 1, id="too-short-to-split"),
    pytest.param((1, 64, 16, 16), 2, id="min-two-tiles-per-segment"),
])
def test_sequence_split_plan(shape, segments):
    batch, seq, dim, state = shape
    _, blocks = configs.scan_blocks(state, dim)
    programs = batch * triton.cdiv(dim, blocks.block_d)
    n_tiles = triton.cdiv(seq, blocks.chunk)
    tiles = configs.tiles_per_segment(n_tiles, programs, sm_count=132)
    assert triton.cdiv(n_tiles, tiles) == segments


def test_host_integer_helpers_agree_with_tritons():
    """The launchers plan with common.cdiv and common.next_power_of_2 (plain ints, no constexpr
    wrapper): the same values as Triton's own, over sizes and block widths a plan meets."""
    from scan_kernels.triton_kernels import common

    sizes = [*range(1, 1100), 4095, 4096, 4097, (1 << 31) - 1, 1 << 31, (1 << 31) + 1]
    assert [common.next_power_of_2(n) for n in sizes] == [triton.next_power_of_2(n) for n in sizes]
    for block in (1, 3, 16, 32, 64, 128, 1000):
        assert [common.cdiv(n, block) for n in sizes] == [triton.cdiv(n, block) for n in sizes]


def test_state_beyond_the_table_is_refused():
    with pytest.raises(scan_kernels.KernelInputError) as info:
        configs.scan_blocks(configs.MAX_STATE + 1, 8)
    assert info.value.field == "A"


@pytest.mark.parametrize("value", [
    pytest.param(0.05, id="inexact-in-fp32"),
    pytest.param(1e-3, id="small"),
    pytest.param(1e39, id="beyond-fp32"),
])
def test_clamp_bound_pairs_recover_the_fp64_value(value):
    from scan_kernels.triton_kernels.common import clamp_bounds

    _, (high, low, *_rest) = clamp_bounds(value, None)
    assert high == float(torch.tensor(value, dtype=torch.float32))
    if high != float("inf"):
        assert abs((high + low) - value) <= abs(value) * 2**-46
    else:  # the fp64 kernel adds the pair: inf + (value - inf) would be NaN
        assert low == 0.0
