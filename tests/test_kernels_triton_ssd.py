"""The Triton backend's Mamba-2 (SSD) kernels against the float64 reference.

Without a GPU every kernel runs on Triton's CPU interpreter (tests/conftest.py sets
TRITON_INTERPRET=1) with blocks of 16, the smallest a GPU's tl.dot takes, so that the shared
cases cross several chunks, position blocks, headdim blocks and state steps and leave remainders
in each. The interpreter is slow, so the dtypes are a chosen subset: every SSD_SCAN_CASES case
runs in fp32, and fp16, bf16 and fp64 on one case that crosses chunks with every option (the
interpreter runs the 16-bit dots through the same hi/lo split a GPU does); the state update runs
every SSD_UPDATE_CASES case in fp32 and a small one with every option in each other dtype. With
CUDA the same tests run on the GPU with the production block table, plus real sizes in every
dtype; without one, tests/test_kernels_triton.py compiles them for sm_90
(scan_kernels.triton_kernels.aot_check) to prove what the interpreter cannot check (block shapes
tl.dot accepts, lowering, no spills).

Outputs are NaN-filled before the launch (the launchers take `out=` / `state_out=`), so an
element no program writes fails the comparison. Inputs are fresh random draws; the seed is in
every failure message.
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton", reason="triton is not installed: the Triton backend cannot be tested")

import scan_kernels  # noqa: E402
from kernel_cases import (  # noqa: E402
    INTERPRETER_NONFINITE_WARNINGS,
    DTYPES, LARGE_SSD_SCAN_CASES, ON_CUDA, SSD_SCAN_CASES, SSD_UPDATE_CASES,
    TRITON_NOT_SERVING, SsdCase, SsdUpdateCase, assert_close, assert_same_nans_and_close, assert_scan_outputs_match_reference,
    assert_ssd_matches_reference, assert_ssd_update_matches_reference, assert_update_outputs_match_reference,
    make_decay_regime_inputs, make_ssd_inputs, make_ssd_update_inputs, random_seed, reference_ssd_scan, reference_ssd_update, state_dtype,
    state_tolerance,
    assert_packed_matches_each_sequence, ZERO_DECAY_REGIMES, with_zero_decays,
)
from scan_kernels import _args  # noqa: E402
from scan_kernels._registry import get_backend  # noqa: E402
from scan_kernels.triton_kernels import common, configs  # noqa: E402
from scan_kernels.triton_kernels import ssd  # noqa: E402
from scan_kernels.triton_kernels.common import run_on_device_of  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICES = [
    pytest.param("cpu", id="interpreter"),
    pytest.param("cuda", id="cuda", marks=ON_CUDA),
]

# Interpreter blocks: every dot dimension at the GPU's minimum of 16 (configs.MIN_DOT_BLOCK), so
# the cases below reach several blocks per axis. The update has no dots: 8 x 16 blocks give the
# larger update cases several headdim blocks and state steps. On CUDA the tests use the
# production tables.
INTERPRETER_SSD_BLOCKS = configs.SsdBlocks(block_m=16, block_k=16, block_p=16, block_n=16, num_warps=1)
INTERPRETER_UPDATE_BLOCKS = configs.SsdUpdateBlocks(block_p=8, block_n=16, num_warps=1)


def _backend(device: str):
    try:
        return get_backend("triton", device)
    except scan_kernels.BackendUnavailable as exc:
        pytest.skip(f"{TRITON_NOT_SERVING.format(device=device)}: {exc}")


def _scan_blocks(device: str):
    return INTERPRETER_SSD_BLOCKS if device == "cpu" else None


def _update_blocks(device: str):
    return INTERPRETER_UPDATE_BLOCKS if device == "cpu" else None


def _poisoned(shape, dtype, device):
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def _run_scan(inputs: dict, blocks=None):
    """The backend's launcher on validated inputs, writing into NaN-filled outputs."""
    args = _args.check_ssd_scan(**inputs)
    d = args.dims
    y = _poisoned(args.x.shape, args.x.dtype, args.x.device)
    state = (_poisoned((d.batch, d.heads, d.headdim, d.state), state_dtype(args.x.dtype), args.x.device)
             if args.return_state else None)
    return ssd.ssd_scan(args.x, args.dt, args.A, args.B, args.C, **args.backend_kwargs(), out=y,
                        state_out=state, blocks=blocks)


def _check_scan(case: SsdCase, dtype, device, blocks=None, what=""):
    seed = random_seed()
    inputs = make_ssd_inputs(case, dtype, device, seed=seed)
    y, state = _run_scan(inputs, blocks)
    assert_scan_outputs_match_reference(case, dtype, inputs, y, state, f"{what} seed={seed}",
                                        reference=reference_ssd_scan)


def _run_update(inputs: dict, blocks=None):
    args = _args.check_ssd_state_update(**inputs)
    y = _poisoned(args.x.shape, args.x.dtype, args.x.device)
    return ssd.ssd_state_update(args.state, args.x, args.dt, args.A, args.B, args.C, **args.backend_kwargs(),
                                out=y, blocks=blocks)


def _check_update(case: SsdUpdateCase, dtype, device, blocks=None):
    seed = random_seed()
    inputs = make_ssd_update_inputs(case, dtype, device, seed=seed)
    before = inputs["state"].clone()
    y = _run_update(inputs, blocks)
    assert_update_outputs_match_reference(case, dtype, inputs, before, y, f"seed={seed}",
                                          reference=reference_ssd_update)


# --- the scan -----------------------------------------------------------------------------------

# Packed sequences (cu_seqlens) in one set of launches: with chunks of 16, sequences of 1, 20 and
# 34 steps, so the longest takes three chunks, one ends within its second chunk, and the one-step
# sequence's chunks past its first (and the 20-step one's third) hold nothing; with chunks of 64,
# one chunk for all (no state passing: each sequence's h0 read where it enters). With and without
# the final states (without them the last chunk's own state is not computed).
PACKED_BOUNDS = [0, 1, 21, 55]


@pytest.mark.parametrize("chunk_size", [16, 64], ids=["three-chunks", "one-chunk"])
@pytest.mark.parametrize("return_state", [True, False], ids=["state", "no-state"])
@pytest.mark.parametrize("device", DEVICES)
def test_packed_ssd_scan_matches_each_sequence(device, return_state, chunk_size):
    _backend(device)
    seed = random_seed()
    case = SsdCase(1, PACKED_BOUNDS[-1], 3, 20, 18, groups=3, chunk_size=chunk_size, D=True, z=True, dt_bias=True,
                   dt_softplus=True, clamp=True, return_state=return_state)
    inputs = make_ssd_inputs(case, torch.float32, device, seed=seed)
    h0 = torch.randn(len(PACKED_BOUNDS) - 1, 3, 20, 18, generator=torch.Generator().manual_seed(seed)).to(device)
    args = _args.check_ssd_scan(**inputs)
    y = _poisoned(args.x.shape, args.x.dtype, args.x.device)
    state = _poisoned(tuple(h0.shape), torch.float32, args.x.device) if return_state else None
    ssd.ssd_scan(args.x, args.dt, args.A, args.B, args.C, **{**args.backend_kwargs(), "h0": h0},
                 cu_seqlens=torch.tensor(PACKED_BOUNDS), out=y, state_out=state, blocks=_scan_blocks(device))
    assert_packed_matches_each_sequence(y, state, inputs, h0, PACKED_BOUNDS, "ssd", torch.float32,
                                        f"{device} packed seed={seed}")



@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", SSD_SCAN_CASES)
def test_ssd_scan_matches_reference(case, device):
    _backend(device)
    _check_scan(case, torch.float32, device, _scan_blocks(device))


# Three chunks, the last partial, two groups, odd headdim and state, every option: the 16-bit
# dots (hi/lo split of the computed operand) and the fp64 ones.
DTYPE_CASE = SsdCase(2, 21, 4, 5, 6, groups=2, chunk_size=8, D=True, z=True, dt_bias=True, dt_softplus=True,
                     clamp=True, h0=True)
NON_F32_DTYPES = [p for p in DTYPES if p.values[0] != torch.float32]


@pytest.mark.parametrize("dtype", NON_F32_DTYPES)
def test_ssd_scan_dtypes_on_interpreter(dtype):
    _backend("cpu")
    _check_scan(DTYPE_CASE, dtype, "cpu", INTERPRETER_SSD_BLOCKS)


# fp16 scans whose fp32-computed dot operand passes fp16's largest value (65504), one split dot
# each: (inputs, that operand's largest magnitude). Each value is its scale times 1 to 1.5; y
# stays well inside fp16.
def _h0_past_fp16(around):
    """A session's fp32 state carried into a one-chunk fp16 prefill: C times h0 of 7e4."""
    h0 = around(7e4, 1, 2, 3, 4, dtype=torch.float32)
    return dict(x=around(1.0, 1, 3, 2, 3), dt=around(0.1, 1, 3, 2), B=around(1.0, 1, 3, 1, 4),
                C=around(1e-3, 1, 3, 1, 4), h0=h0), h0.abs().max()


def _entering_state_past_fp16(around):
    """x B dt of 4e4 a step: the state entering the second and third chunks passes 65504."""
    x, dt, B = around(200.0, 1, 6, 2, 3), around(1.0, 1, 6, 2), around(200.0, 1, 6, 1, 4)
    # The second chunk's, without the decay (A is small enough to leave it out).
    entering = (dt.float()[0, :2, :, None, None] * x.float()[0, :2, :, :, None] * B.float()[0, :2, :, None, :]).sum(0)
    return dict(x=x, dt=dt, B=B, C=around(1e-3, 1, 6, 1, 4), chunk_size=2), entering.abs().max()


def _decayed_B_past_fp16(around):
    """B dt of 1e5 (the chunk state's operand): y is fine, the final state is what overflows."""
    dt, B = around(100.0, 1, 3, 2), around(1000.0, 1, 3, 1, 4)
    decayed_B = dt.float()[..., :1, None] * B.float()  # head 0's; A is small enough to leave out the decay
    return dict(x=around(0.01, 1, 3, 2, 3), dt=dt, B=B, C=around(1e-3, 1, 3, 1, 4)), decayed_B.abs().max()


def _scores_past_fp16(around):
    """C.B over 8 state entries of 100 each, times dt 1: scores of 8e4 and more."""
    dt, B, C = around(1.0, 1, 3, 2), around(100.0, 1, 3, 1, 8), around(100.0, 1, 3, 1, 8)
    scores = C.float()[0, :, 0] @ B.float()[0, :, 0].T * dt.float()[0, None, :, 0]  # head 0's
    return dict(x=around(0.01, 1, 3, 2, 3), dt=dt, B=B, C=C), scores.abs().max()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("operands", [
    pytest.param(_h0_past_fp16, id="h0"),
    pytest.param(_entering_state_past_fp16, id="entering-state"),
    pytest.param(_decayed_B_past_fp16, id="B-dt"),
    pytest.param(_scores_past_fp16, id="C-B-dt"),
])
def test_fp16_ssd_scan_dot_operands_past_fp16_range(operands, device):
    """An fp16 scan whose computed dot operand (entering state or h0, decayed B, scores) passes
    65504 gives the reference's finite y and state: the split into fp16 halves is scaled."""
    _backend(device)
    seed = random_seed()
    gen = torch.Generator().manual_seed(seed)

    def around(scale, *shape, dtype=torch.float16):
        return (scale * (1 + 0.5 * torch.rand(shape, generator=gen))).to(dtype).to(device)

    inputs, largest = operands(around)
    assert largest > 65504, f"the case stays inside fp16's range ({largest})"
    inputs = dict(inputs, A=-around(1e-4, 2, dtype=torch.float32), return_state=True)
    y, state = _run_scan(inputs, _scan_blocks(device))
    y_ref, state_ref = reference_ssd_scan(inputs)
    assert_close(y, y_ref, torch.float16, f"y seed={seed}")
    assert_close(state, state_ref, torch.float16, f"state seed={seed}", state_tolerance(torch.float16))


# The chunk against the sequence: one step a chunk (state passing over every step), a partial
# last chunk, a last chunk of one step, a chunk of exactly the sequence, one longer than it, and
# one longer than the position blocks and not a power of two (several m and k blocks a chunk).
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seq, chunk_size", [
    pytest.param(7, 1, id="chunk-1"),
    pytest.param(19, 6, id="partial-last"),
    pytest.param(19, 18, id="last-of-one-step"),
    pytest.param(19, 19, id="chunk-eq-seq"),
    pytest.param(19, 40, id="chunk-gt-seq"),
    pytest.param(37, 17, id="chunk-17-two-position-blocks"),
])
def test_ssd_scan_chunk_boundaries(seq, chunk_size, device):
    _backend(device)
    case = SsdCase(2, seq, 3, 5, 7, chunk_size=chunk_size, D=True, h0=True)
    _check_scan(case, torch.float32, device, _scan_blocks(device), what=f"seq {seq} chunk {chunk_size}")


# One large step early in every chunk, small ones after it (as tests/test_kernels_ssd.py's
# SSD_LARGE_STEP_REGIMES: minus A, the large dt): the chunk kernels took each decay as
# exp(cs_m - cs_k) of an fp32 cumulative sum, off by its rounding once cs is in the thousands
# (found in review); cs is kept and differenced in fp64 (scan_kernels/triton_kernels/ssd.py).
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("minus_A, large_dt", [
    pytest.param(16.0, 500.0, id="dtA-8000"),
    pytest.param(2.0, 5000.0, id="dtA-10000"),
])
def test_ssd_scan_one_large_step_then_small_ones(minus_A, large_dt, device):
    _backend(device)
    case = SsdCase(1, 40, 2, 4, 4, chunk_size=16, h0=True)
    seed = random_seed()
    inputs = make_decay_regime_inputs(case, minus_A, (0.001, 0.05), seed)
    inputs["dt"][:, 1::16] = large_dt  # the second step of every chunk
    inputs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    y, state = _run_scan(inputs, _scan_blocks(device))
    assert_scan_outputs_match_reference(case, torch.float32, inputs, y, state, f"{device} seed={seed}",
                                        reference=reference_ssd_scan)


# A chunk's summed log decays were -inf (A of -inf), -inf minus -inf NaN, or -1e30 with every
# later step's share lost in its rounding: y and the state NaN or garbage. Several chunks, the
# last one short.
@INTERPRETER_NONFINITE_WARNINGS
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("regime", ZERO_DECAY_REGIMES)
def test_ssd_scan_with_decays_of_zero(regime, device):
    _backend(device)
    case = SsdCase(2, 11, 3, 4, 3, chunk_size=4, D=True, z=True, dt_softplus=True, h0=True)
    seed = random_seed()
    inputs = with_zero_decays(make_ssd_inputs(case, torch.float32, device, seed=seed), regime)
    y, state = _run_scan(inputs, _scan_blocks(device))
    assert_scan_outputs_match_reference(case, torch.float32, inputs, y, state, f"{device} {regime} seed={seed}",
                                        reference=reference_ssd_scan, to_term_magnitudes=True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("split", [pytest.param(8, id="at-a-chunk-boundary"), pytest.param(11, id="mid-chunk")])
def test_ssd_scan_chains_through_h0(split, device):
    """A scan of the first `split` steps, then one of the rest from its final state (h0), gives
    the y and the final state of one scan over the whole sequence."""
    _backend(device)
    seed = random_seed()
    case = SsdCase(2, 17, 2, 5, 6, groups=2, chunk_size=4, D=True, z=True, dt_bias=True, dt_softplus=True,
                   h0=True)
    inputs = make_ssd_inputs(case, torch.float32, device, seed=seed)
    y_ref, state_ref = reference_ssd_scan(inputs)
    seq_inputs = ("x", "dt", "z", "B", "C")
    head = {**inputs, **{k: inputs[k][:, :split] for k in seq_inputs}}
    y_head, state_head = _run_scan(head, _scan_blocks(device))
    tail = {**inputs, **{k: inputs[k][:, split:] for k in seq_inputs}, "h0": state_head}
    y_tail, state = _run_scan(tail, _scan_blocks(device))
    assert_close(torch.cat([y_head, y_tail], dim=1), y_ref, torch.float32, f"chained y seed={seed}")
    assert_close(state, state_ref, torch.float32, f"chained state seed={seed}")


@pytest.mark.parametrize("device", DEVICES)
def test_ssd_scan_then_steps_continue_the_sequence(device):
    """A scan's final state fed to state updates gives the y of one longer scan."""
    _backend(device)
    seed = random_seed()
    case = SsdCase(2, 11, 4, 3, 5, groups=2, chunk_size=4, D=True, z=True, dt_bias=True, dt_softplus=True)
    inputs = make_ssd_inputs(case, torch.float32, device, seed=seed)
    y_ref, _ = reference_ssd_scan(inputs)
    prefix = 6
    seq_inputs = ("x", "dt", "z", "B", "C")
    head = {**inputs, **{k: inputs[k][:, :prefix] for k in seq_inputs}}
    _, state = _run_scan(head, _scan_blocks(device))
    for t in range(prefix, case.seq):
        step = {k: inputs[k][:, t] for k in seq_inputs}
        y_t = _run_update(dict(state=state, **step, A=inputs["A"], D=inputs["D"], dt_bias=inputs["dt_bias"],
                               dt_softplus=True), _update_blocks(device))
        assert_close(y_t, y_ref[:, t], torch.float32, f"y at step {t} seed={seed}")


@pytest.mark.parametrize("device", DEVICES)
def test_ssd_scan_reads_strided_views(device):
    """Non-contiguous views of larger buffers, a per-head D (a stride-0 view once normalised) and
    a non-contiguous y: the kernels follow strides and write only y's elements."""
    _backend(device)
    seed = random_seed()
    gen = torch.Generator().manual_seed(seed)
    b, l, h, p, n, g = 2, 10, 4, 3, 5, 2

    def rand(*shape):
        return (torch.rand(shape, generator=gen) * 2 - 1).to(device)

    x = rand(b, l, h, 2 * p)[..., ::2]
    dt = rand(b, h, l).transpose(1, 2).abs() * 0.5 + 0.01
    B = rand(b, n, g, l).permute(0, 3, 2, 1)  # state axis not innermost
    C = rand(b, l, g, n + 2)[..., 1:-1]
    A = -rand(2 * h)[::2].abs() - 0.1
    D = rand(h)
    h0 = rand(b, h, n, p).transpose(2, 3)
    inputs = dict(x=x, dt=dt, A=A, B=B, C=C, D=D, h0=h0, return_state=True, chunk_size=4)
    args = _args.check_ssd_scan(**inputs)
    y_buffer = _poisoned((b, l, h, 2 * p), torch.float32, device)
    y, state = ssd.ssd_scan(args.x, args.dt, args.A, args.B, args.C, **args.backend_kwargs(),
                            out=y_buffer[..., 1::2], blocks=_scan_blocks(device))
    y_ref, state_ref = reference_ssd_scan(inputs)
    assert_close(y, y_ref, torch.float32, f"y seed={seed}")
    assert_close(state, state_ref, torch.float32, f"state seed={seed}")
    assert torch.isnan(y_buffer[..., ::2]).all(), "wrote outside the strided y view"


@pytest.mark.parametrize("device", DEVICES)
def test_ssd_through_public_api(device):
    """`scan_kernels.ssd_scan` / `scan_kernels.ssd_state_update` with backend="triton" reach these
    kernels, with the production blocks."""
    _backend(device)
    seed = random_seed()
    scan_case = SsdCase(2, 21, 3, 6, 5, groups=3, chunk_size=8, D=True, z=True, h0=True)
    assert_ssd_matches_reference("triton", scan_case, torch.float32, seed, f"scan seed={seed}", device)
    update_case = SsdUpdateCase(3, 4, 6, 5, groups=2, pool=5, padding_rows=1, D=True)
    assert_ssd_update_matches_reference("triton", update_case, torch.float32, seed, f"update seed={seed}", device)


@pytest.mark.parametrize("device", DEVICES)
def test_a_nan_dt_spreads_as_in_the_recurrence(device):
    """A NaN dt under a clamp makes y NaN from its step on, and the final state NaN, for its head
    only, as in the reference: not earlier rows of its chunk (the intra-chunk matmul sums over
    every column), not the other heads."""
    _backend(device)
    seed = random_seed()
    case = SsdCase(1, 13, 3, 2, 4, chunk_size=8, clamp=True)
    inputs = make_ssd_inputs(case, torch.float32, device, seed=seed)
    inputs["dt"][0, 5, 1] = float("nan")
    y_ref, state_ref = reference_ssd_scan(inputs)
    y, state = _run_scan(inputs, _scan_blocks(device))
    assert_same_nans_and_close(y, y_ref, f"scan y seed={seed}")
    assert_same_nans_and_close(state, state_ref, f"scan state seed={seed}")

    update = make_ssd_update_inputs(SsdUpdateCase(2, 3, 2, 4, pool=3, clamp=True), torch.float32, device, seed=seed)
    update["dt"][0, 1] = float("nan")
    y_ref, state_ref = reference_ssd_update(update)
    y = _run_update(update, _update_blocks(device))
    assert_same_nans_and_close(y, y_ref, f"update y seed={seed}")
    assert_same_nans_and_close(update["state"], state_ref, f"update state seed={seed}")


@INTERPRETER_NONFINITE_WARNINGS
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("device", DEVICES)
def test_a_non_finite_x_stays_in_its_channel_from_its_chunk_on(device, value, dtype):
    """An inf or NaN x at step k: y is non-finite wherever the reference's is (from k on, in its
    channel), and elsewhere only in that channel's rows of k's chunk before k (the module
    docstring's "Non-finite x"); the state in that channel's row, as the reference's."""
    _backend(device)
    seed = random_seed()
    case = SsdCase(2, 21, 3, 5, 6, chunk_size=8, D=True, z=True, h0=True)
    inputs = make_ssd_inputs(case, dtype, device, seed=seed)
    inputs["x"][1, 10, 2, 3] = value
    y_ref, state_ref = (t.cpu() for t in reference_ssd_scan(inputs))
    y, state = (t.cpu() for t in _run_scan(inputs, _scan_blocks(device)))
    allowed = ~torch.isfinite(y_ref)
    allowed[1, 8:10, 2, 3] = True  # the rows of its chunk (8 to 15) before it
    for name, actual, expected, may in (("y", y, y_ref, allowed), ("state", state, state_ref, ~torch.isfinite(state_ref))):
        finite = torch.isfinite(expected)
        assert (~finite).any(), f"{name} seed={seed}: the reference is finite"
        bad = ~torch.isfinite(actual)
        assert bad[~finite].all(), f"{name} seed={seed}: finite where the reference is not"
        assert not bad[~may].any(), f"{name} seed={seed}: non-finite at {(bad & ~may).nonzero().tolist()}"
        assert_close(actual[~may], expected[~may], dtype if name == "y" else torch.float32, f"{name} seed={seed}")


# --- the state update -----------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", SSD_UPDATE_CASES)
def test_ssd_state_update_matches_reference(case, device):
    _backend(device)
    _check_update(case, torch.float32, device, _update_blocks(device))


# Every option, padding rows, two headdim blocks and two state steps of the interpreter's blocks.
UPDATE_DTYPE_CASE = SsdUpdateCase(3, 4, 10, 20, groups=2, pool=5, padding_rows=1, D=True, z=True, dt_bias=True,
                                  dt_softplus=True, clamp=True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", NON_F32_DTYPES)
def test_ssd_state_update_dtypes(dtype, device):
    _backend(device)
    _check_update(UPDATE_DTYPE_CASE, dtype, device, _update_blocks(device))


@pytest.mark.parametrize("device", DEVICES)
def test_ssd_state_update_table_blocks(device):
    """The production blocks: the state axis in one step, headdim cut to the budget."""
    _backend(device)
    _check_update(SsdUpdateCase(5, 4, 40, 24, groups=2, pool=8, padding_rows=2, D=True, z=True), torch.float32, device)


def test_ssd_scan_refuses_a_final_state_in_h0s_memory():
    """A scan of one chunk writes the final state before its chunk scan reads h0: the two in one
    storage would give y from the wrong state, so the launcher refuses it, naming state_out."""
    inputs = make_ssd_inputs(SsdCase(1, 5, 2, 4, 3, h0=True), torch.float32, "cpu", seed=random_seed())
    args = _args.check_ssd_scan(**inputs)
    with pytest.raises(scan_kernels.KernelInputError) as info:
        ssd.ssd_scan_launches(args.x, args.dt, args.A, args.B, args.C, **args.backend_kwargs(), out=None,
                              state_out=args.h0, blocks=INTERPRETER_SSD_BLOCKS)
    assert info.value.field == "state_out"


# --- element offsets past 2^31: the WIDE_OFFSETS variant -------------------------------------------


@pytest.fixture
def wide_offsets_everywhere(monkeypatch):
    """Every launch takes the WIDE_OFFSETS variant, whatever its size."""
    monkeypatch.setattr(common, "INT32_OFFSET_LIMIT", 0)


@pytest.mark.parametrize("device", DEVICES)
def test_ssd_int64_offsets_variant_matches_reference(device, wide_offsets_everywhere):
    _backend(device)
    seed = random_seed()
    case = SsdCase(2, 21, 4, 5, 6, groups=2, chunk_size=8, D=True, z=True, dt_bias=True, dt_softplus=True,
                   h0=True)
    inputs = make_ssd_inputs(case, torch.float32, device, seed=seed)
    args = _args.check_ssd_scan(**inputs)
    y, state, launches = ssd.ssd_scan_launches(
        args.x, args.dt, args.A, args.B, args.C, **args.backend_kwargs(),
        out=_poisoned(args.x.shape, torch.float32, device), state_out=_poisoned((2, 4, 5, 6), torch.float32, device),
        blocks=_scan_blocks(device))
    assert len(launches) == 4 and all(launch.constexprs["WIDE_OFFSETS"] for launch in launches)
    run_on_device_of(args.x, launches)
    assert_scan_outputs_match_reference(case, torch.float32, inputs, y, state, f"int64 offsets seed={seed}",
                                        reference=reference_ssd_scan)

    update_case = SsdUpdateCase(3, 4, 6, 5, groups=2, pool=5, padding_rows=1, D=True, z=True, dt_bias=True)
    update = make_ssd_update_inputs(update_case, torch.float32, device, seed=seed)
    before = update["state"].clone()
    args = _args.check_ssd_state_update(**update)
    y, launch = ssd.ssd_update_launch(args.state, args.x, args.dt, args.A, args.B, args.C, **args.backend_kwargs(),
                                      out=_poisoned(args.x.shape, torch.float32, device), blocks=_update_blocks(device))
    assert launch.constexprs["WIDE_OFFSETS"]
    run_on_device_of(args.x, [launch])
    assert_update_outputs_match_reference(update_case, torch.float32, update, before, y, f"int64 offsets seed={seed}",
                                          reference=reference_ssd_update)


# --- the plan -------------------------------------------------------------------------------------


def _meta(*shape, dtype=torch.float32):
    return torch.empty(shape, dtype=dtype, device="meta")


@pytest.mark.parametrize("seq, chunk_size, chunk", [
    pytest.param(1000, None, configs.SSD_CHUNK, id="default"),
    pytest.param(100, None, 100, id="default-longer-than-seq"),
    pytest.param(1000, 7, 7, id="as-asked"),
    pytest.param(10, 64, 10, id="longer-than-seq"),
    pytest.param(5000, 4096, 1024, id="capped"),
])
def test_ssd_plan_chunk(seq, chunk_size, chunk):
    bc = _meta(1, seq, 1, 16)
    plan = ssd.plan_ssd_scan(_meta(1, seq, 2, 8), bc, bc, chunk_size)
    assert (plan.chunk, plan.nchunks) == (chunk, -(-seq // chunk))


@pytest.mark.parametrize("x_dtype, bc_dtype, dot", [
    pytest.param(torch.bfloat16, torch.bfloat16, torch.bfloat16, id="bf16"),
    pytest.param(torch.float16, torch.float16, torch.float16, id="f16"),
    pytest.param(torch.bfloat16, torch.float32, torch.float32, id="mixed-bf16-f32"),
    pytest.param(torch.float16, torch.bfloat16, torch.float32, id="mixed-f16-bf16"),
    pytest.param(torch.float32, torch.float32, torch.float32, id="f32"),
    pytest.param(torch.float64, torch.float64, torch.float64, id="f64"),
    pytest.param(torch.float64, torch.bfloat16, torch.float64, id="f64-x"),
])
def test_ssd_dots_multiply_in_16_bits_only_when_x_B_C_share_it(x_dtype, bc_dtype, dot):
    bc = _meta(1, 40, 1, 16, dtype=bc_dtype)
    assert ssd.plan_ssd_scan(_meta(1, 40, 2, 8, dtype=x_dtype), bc, bc, None).dot == dot


@pytest.mark.parametrize("dot", [torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("headdim, state, chunk",
                         [(1, 1, 1), (5, 3, 7), (17, 33, 100), (64, 128, 256), (80, 512, 1024)])
def test_ssd_dot_blocks_fit_a_gpu_dot(dot, headdim, state, chunk):
    """Every block a tl.dot sees is a power of two of at least 16 (what a GPU's tl.dot takes),
    and no larger than its axis needs or the table allows."""
    blocks = configs.ssd_blocks(headdim, state, chunk, dot)
    table = configs.SSD_BLOCKS[dot]
    for name, size in (("block_m", chunk), ("block_k", chunk), ("block_p", headdim), ("block_n", state)):
        value = getattr(blocks, name)
        assert value >= configs.MIN_DOT_BLOCK and value & (value - 1) == 0, (name, value)
        needed = min(getattr(table, name), triton.next_power_of_2(size))
        assert value <= max(configs.MIN_DOT_BLOCK, needed), (name, value)


# --- real sizes on a GPU ----------------------------------------------------------------------------

REAL_SSD_SCAN_CASES = [
    pytest.param(SsdCase(2, 1000, 24, 64, 128, D=True, z=True, dt_bias=True, dt_softplus=True, h0=True),
                 id="mamba2-heads-1000"),
    pytest.param(SsdCase(1, 2048, 16, 64, 64, groups=8, chunk_size=128, clamp=True), id="groups8-chunk128"),
    pytest.param(SsdCase(3, 333, 8, 48, 96, groups=2, chunk_size=100, D=True, D_per_channel=True), id="odd-chunk100"),
    *LARGE_SSD_SCAN_CASES,
]
REAL_SSD_UPDATE_CASES = [
    pytest.param(SsdUpdateCase(32, 80, 64, 128, pool=100, padding_rows=5, D=True, z=True, dt_bias=True,
                               dt_softplus=True), id="batch32-heads80-pool100"),
    pytest.param(SsdUpdateCase(3, 8, 64, 384, groups=2, clamp=True), id="state384-two-steps"),
]


@ON_CUDA
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", REAL_SSD_SCAN_CASES)
def test_ssd_scan_real_sizes_on_gpu(case, dtype):
    _backend("cuda")
    _check_scan(case, dtype, "cuda", what="table blocks")


@ON_CUDA
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", REAL_SSD_UPDATE_CASES)
def test_ssd_state_update_real_sizes_on_gpu(case, dtype):
    _backend("cuda")
    _check_update(case, dtype, "cuda")


