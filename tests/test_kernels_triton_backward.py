"""The Triton backward pass (scan_kernels/triton_kernels/backward.py) against the float64 reference's
gradients.

Without a GPU the kernels run on Triton's CPU interpreter (tests/conftest.py sets
TRITON_INTERPRET=1 before triton is imported), where the backend takes 4-step x 4-channel tiles
(backward.INTERPRETER_BLOCKS): the small odd shapes below then cross several tiles (checkpoints)
and channel blocks with remainders in each, and the state size pads to a power of two. With
CUDA the same tests run on the GPU with the production block table, plus larger sizes and the
peak memory of a call. Every case goes through the public scan_kernels.selective_scan_backward /
scan_kernels.ssd_scan_backward with backend="triton", compared with backend="reference"; inputs are
fresh random draws and the seed is in every failure message.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

triton = pytest.importorskip("triton", reason="triton is not installed: the Triton backend cannot be tested")

import scan_kernels  # noqa: E402
from kernel_cases import (  # noqa: E402
    CUDA_COMPILES_EVERY_KERNEL, ON_CUDA, TRITON_NOT_SERVING, ZERO_DECAY_REGIMES, ScanCase, SsdCase, assert_grads_close,
    assert_grads_close_where_reference_finite, backward_inputs, make_cotangents, make_scan_inputs, make_ssd_inputs,
    nan_gapped, random_seed, with_zero_decays,
)
from scan_kernels import _args  # noqa: E402
from scan_kernels._registry import get_backend  # noqa: E402
from scan_kernels.triton_kernels import backward as triton_backward  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICES = [
    pytest.param("cpu", id="interpreter"),
    pytest.param("cuda", id="cuda", marks=ON_CUDA),
]
F32_F64 = [pytest.param(torch.float32, id="f32"), pytest.param(torch.float64, id="f64")]


def _backend(device: str):
    try:
        return get_backend("triton", device)
    except scan_kernels.BackendUnavailable as exc:
        pytest.skip(f"{TRITON_NOT_SERVING.format(device=device)}: {exc}")


def _state_shape(kind: str, inputs: dict) -> tuple:
    x, B = inputs["x"], inputs["B"]
    if kind == "ssd":
        return (*x.shape[:1], *x.shape[2:], B.shape[-1])
    return (x.shape[0], *inputs["A"].shape)


def _grads(kind: str, inputs: dict, dy, dstate, backend: str) -> dict:
    backward = scan_kernels.ssd_scan_backward if kind == "ssd" else scan_kernels.selective_scan_backward
    return backward(dy, **backward_inputs(inputs), dstate=dstate, backend=backend)


def _check(kind: str, case, dtype, device: str, transform=None, overrides=None) -> None:
    """The triton backend's gradients of `case` against the reference's (dstate given exactly
    when the case returns the state); `transform` rewrites the inputs first (strided views),
    `overrides(inputs)` returns replacements for some of them."""
    _backend(device)
    seed = random_seed()
    make = make_ssd_inputs if kind == "ssd" else make_scan_inputs
    inputs = make(case, dtype, device, seed=seed)
    if overrides is not None:
        inputs.update(overrides(inputs))
    dy, dstate = make_cotangents(inputs, tuple(inputs["x"].shape), _state_shape(kind, inputs), case.return_state, seed)
    if transform is not None:
        inputs = {k: transform(v) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
        dy, dstate = transform(dy), None if dstate is None else transform(dstate)
    got = _grads(kind, inputs, dy, dstate, "triton")
    expected = _grads(kind, inputs, dy, dstate, "reference")
    assert_grads_close(got, expected, backward_inputs(inputs), dtype, f"triton {kind} {case} seed={seed}")


ALL = dict(D=True, z=True, dt_bias=True, dt_softplus=True, clamp=True, h0=True)

# batch 2, 11 steps (three 4-step tiles, the last one short), 6 channels in 2 groups of 3 (one
# padded 4-channel block each), state 3 (padded to 4); each option alone would multiply the
# interpreter's time, so they come together, with and without dstate.
SCAN_CASES = [
    pytest.param(ScanCase(2, 11, 6, 3, groups=2), id="plain-groups2"),
    pytest.param(ScanCase(2, 11, 6, 3, groups=2, **ALL), id="all-options-bld"),
    pytest.param(ScanCase(2, 11, 6, 3, groups=2, layout="bdl", **ALL), id="all-options-bdl"),
    pytest.param(ScanCase(1, 9, 5, 3, bc_3d=True, layout="bdl", D=True, z=True, dt_bias=True, dt_softplus=True,
                          return_state=False), id="bc3d-bdl-no-dstate"),
]
# heads 4 x headdim 3 = 12 channels in 2 groups (6 each: two blocks, one with a remainder).
SSD_CASES = [
    pytest.param(SsdCase(1, 11, 4, 3, 3, groups=2), id="plain-groups2"),
    pytest.param(SsdCase(2, 11, 4, 3, 3, groups=2, chunk_size=4, **ALL), id="all-options"),
    pytest.param(SsdCase(1, 9, 2, 5, 3, D=True, D_per_channel=True, z=True, h0=True, return_state=False),
                 id="D-per-channel-no-dstate"),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", F32_F64)
@pytest.mark.parametrize("case", SCAN_CASES)
def test_scan_backward_matches_reference(case, dtype, device):
    _check("scan", case, dtype, device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", F32_F64)
@pytest.mark.parametrize("case", SSD_CASES)
def test_ssd_scan_backward_matches_reference(case, dtype, device):
    _check("ssd", case, dtype, device)


# Every step decays the state by e^-20 to e^-24 (dt in [10, 12], A = -2), far below fp32's
# resolution: dA, a sum of G_t a_t h_(t-1) alone, is then some 1e-7 of the other gradients, and
# a_t h_(t-1) taken as h_t minus the step's input was rounding only (dA off by its whole size).
STRONG_DECAY_CASES = [
    pytest.param("scan", ScanCase(2, 11, 6, 3, groups=2, D=True, z=True, h0=True), id="scan"),
    pytest.param("ssd", SsdCase(2, 11, 4, 3, 3, groups=2, D=True, z=True, h0=True), id="ssd"),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind, case", STRONG_DECAY_CASES)
def test_gradients_under_decay_below_fp32_resolution(kind, case, device):
    def strong_decay(inputs):
        dt, A = inputs["dt"], inputs["A"]
        return dict(dt=10.0 + 2.0 * torch.rand(dt.shape, generator=torch.Generator().manual_seed(7)).to(dt.device),
                    A=torch.full_like(A, -2.0))

    _check(kind, case, torch.float32, device, overrides=strong_decay)


# A of -inf: padded steps' exp(0 * A) was NaN, and q A (q of a decay of 0) NaN where the
# reference's other gradients are finite; its own ddt is NaN there (A times a decay of 0).
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("regime", ZERO_DECAY_REGIMES)
@pytest.mark.parametrize("kind, case", STRONG_DECAY_CASES)
def test_gradients_with_decays_of_zero(kind, case, regime, device):
    _backend(device)
    seed = random_seed()
    make = make_ssd_inputs if kind == "ssd" else make_scan_inputs
    inputs = with_zero_decays(make(case, torch.float32, device, seed=seed), regime)
    dy, dstate = make_cotangents(inputs, tuple(inputs["x"].shape), _state_shape(kind, inputs), True, seed)
    assert_grads_close_where_reference_finite(_grads(kind, inputs, dy, dstate, "triton"),
                                              _grads(kind, inputs, dy, dstate, "reference"), torch.float32,
                                              f"triton {kind} {regime} seed={seed}")


@pytest.mark.parametrize("device", DEVICES)
def test_half_precision_inputs(device):
    """fp16 inputs are read as they are, the math in fp32."""
    _check("scan", ScanCase(2, 7, 6, 3, groups=2, D=True, z=True, h0=True), torch.float16, device)


@pytest.mark.parametrize("device", DEVICES)
def test_reads_strided_views(device):
    """Every input and cotangent a view with doubled strides and NaN in the gaps: the kernels
    read through strides and nothing outside the views."""
    _check("scan", ScanCase(2, 7, 6, 3, groups=2, D=True, z=True, dt_bias=True, h0=True), torch.float32, device,
           transform=nan_gapped)


def test_table_blocks_on_the_interpreter():
    """The production table's blocks (two 16-step tiles here, the second short) rather than
    the interpreter's."""
    _backend("cpu")
    seed = random_seed()
    case = ScanCase(1, 21, 8, 3, groups=2, D=True, z=True, dt_softplus=True, h0=True)
    inputs = make_scan_inputs(case, torch.float32, seed=seed)
    dy, dstate = make_cotangents(inputs, tuple(inputs["x"].shape), _state_shape("scan", inputs), True, seed)
    a = _args.check_scan(**backward_inputs(inputs))
    blocks = triton_backward.backward_blocks(case.state, case.dim // case.groups, "A")[1]
    assert blocks.chunk == 16 and triton_backward.plan_backward(1, 21, 8, 3, 2, a.x.device, "A", blocks).n_chunks == 2
    kw = a.backend_kwargs()
    kw.pop("return_state")
    got = triton_backward.selective_scan_backward(dy, a.x, a.dt, a.A, a.B, a.C, **kw, dstate=dstate, blocks=blocks)
    got = {name: g for name, g in got.items() if g is not None}
    expected = _grads("scan", inputs, dy, dstate, "reference")
    assert_grads_close(got, expected, backward_inputs(inputs), torch.float32, f"seed={seed}")


@pytest.mark.parametrize("device", DEVICES)
def test_autograd_through_selective_scan(device):
    """scan_kernels.selective_scan(..., backend="triton") under autograd reaches this backward."""
    _backend(device)
    seed = random_seed()
    inputs = make_scan_inputs(ScanCase(1, 6, 4, 2, D=True, z=True), torch.float32, device, seed=seed)
    dy, dstate = make_cotangents(inputs, tuple(inputs["x"].shape), _state_shape("scan", inputs), True, seed)
    leaves = {k: v.detach().requires_grad_(True) if k in ("x", "A", "D") else v for k, v in inputs.items()}
    y, state = scan_kernels.selective_scan(**leaves, backend="triton")
    ((y * dy).sum() + (state * dstate).sum()).backward()
    expected = _grads("scan", inputs, dy, dstate, "reference")
    assert_grads_close({k: leaves[k].grad for k in ("x", "A", "D")}, expected,
                       {k: inputs[k] for k in ("x", "A", "D")}, torch.float32, f"seed={seed}")


@pytest.mark.parametrize("kind, case", [
    pytest.param("scan", ScanCase(1, 6, 4, 2, dt_bias=True, dt_softplus=True, clamp=True), id="mamba1"),
    pytest.param("ssd", SsdCase(1, 6, 2, 3, 2, dt_bias=True, dt_softplus=True, clamp=True), id="mamba2"),
])
@pytest.mark.parametrize("device", DEVICES)
def test_gradients_of_inputs_that_require_grad_carry_no_graph(kind, case, device):
    """Called with inputs that require grad (a module's parameters), the backward returns plain
    gradients as the other backends do: ddt and ddt_bias came with a graph through softplus's
    derivative alone, a wrong second derivative and a graph kept alive (found in review)."""
    _backend(device)
    seed = random_seed()
    make = make_ssd_inputs if kind == "ssd" else make_scan_inputs
    inputs = make(case, torch.float32, device, seed=seed)
    dy, _ = make_cotangents(inputs, tuple(inputs["x"].shape), _state_shape(kind, inputs), False, seed)
    leaves = {k: v.detach().requires_grad_(True) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
              for k, v in inputs.items()}
    got = _grads(kind, leaves, dy, None, "triton")
    assert not [name for name, g in got.items() if g.requires_grad], f"seed={seed}"
    expected = _grads(kind, inputs, dy, None, "reference")
    assert_grads_close(got, expected, backward_inputs(inputs), torch.float32, f"triton {kind} seed={seed}")


@pytest.mark.parametrize("kind, case, field", [
    pytest.param("scan", ScanCase(1, 2, 2, 1025), "A", id="mamba1-names-A"),
    pytest.param("ssd", SsdCase(1, 2, 2, 2, 1025), "B", id="mamba2-names-B"),
])
def test_a_state_past_the_table_is_refused_first_naming_its_argument(kind, case, field, monkeypatch):
    """A state size past BACKWARD_TABLE is refused naming the argument it is read from:
    Mamba-1's A [dim, state], Mamba-2's B (its A is [heads]), before dt is discretised."""
    _backend("cpu")

    def discretize_called(*args, **kwargs):
        raise AssertionError("dt was discretised before the refusal")

    monkeypatch.setattr(triton_backward, "_discretize_dt", discretize_called)
    make = make_ssd_inputs if kind == "ssd" else make_scan_inputs
    inputs = make(case, torch.float32, seed=random_seed())
    with pytest.raises(scan_kernels.KernelInputError) as info:
        _grads(kind, inputs, torch.ones_like(inputs["x"]), None, "triton")
    assert info.value.field == field and "1024" in str(info.value)


# -- what is allocated --------------------------------------------------------------------------


@pytest.mark.parametrize("ssd", [False, True], ids=["scan", "ssd"])
def test_only_checkpoints_are_of_state_size(ssd):
    """The launches' tensors (built, not run): the checkpoint buffer is [batch, tiles, channels,
    state], and nothing handed to a kernel holds batch x seq x channels x state values."""
    batch, seq, heads, headdim, state, groups = 2, 64, 2, 3, 8, 2
    channels = heads * headdim
    gen = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.rand(shape, generator=gen)

    x, dy, z = rand(batch, seq, channels), rand(batch, seq, channels), rand(batch, seq, channels)
    B, C = rand(batch, seq, groups, state), rand(batch, seq, groups, state)
    h0, dstate = rand(batch, channels, state), rand(batch, channels, state)
    if ssd:
        delta, A, per_decay = rand(batch, seq, heads), -rand(heads), headdim
    else:
        delta, A, per_decay = rand(batch, seq, channels), -rand(channels, state), 1
    blocks = triton_backward.INTERPRETER_BLOCKS
    grads, launches = triton_backward.backward_launches(
        dy, x, delta, A, B, C, D=rand(channels), z=z, h0=h0, dstate=dstate, per_decay=per_decay, scalar_decay=ssd,
        state_field="B" if ssd else "A", blocks=blocks)
    plan = triton_backward.plan_backward(batch, seq, channels, state, groups, x.device, "B" if ssd else "A", blocks)
    assert grads["checkpoints"].shape == triton_backward.checkpoint_shape(plan, batch, channels, state)
    assert grads["checkpoints"].shape == (batch, seq // blocks.chunk, channels, state)
    history = batch * seq * channels * state
    tensors = [a for launch in launches for a in launch.args if isinstance(a, torch.Tensor)]
    assert any(t is grads["checkpoints"] for t in tensors)
    assert grads["checkpoints"].numel() * blocks.chunk == history
    assert max(t.numel() for t in tensors) < history


@ON_CUDA
def test_cuda_peak_memory_is_far_below_the_state_history():
    """On a GPU: the call's peak allocation beyond its inputs stays near the gradients, the
    dt temporaries and the checkpoints (history / 16 at state 32), far below the history."""
    batch, seq, dim, state = 1, 4096, 1024, 32
    gen = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.rand(shape, generator=gen).cuda()

    x, dt, z, dy = rand(batch, seq, dim), rand(batch, seq, dim) * 0.3, rand(batch, seq, dim), rand(batch, seq, dim)
    B, C, A = rand(batch, seq, 1, state), rand(batch, seq, 1, state), -rand(dim, state)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    grads = scan_kernels.selective_scan_backward(dy, x, dt, A, B, C, D=rand(dim), z=z, dt_softplus=True, backend="triton")
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    history = batch * seq * dim * state * 4
    x_bytes = batch * seq * dim * 4
    # The gradients (x, dt, z, B, C and the small ones); the discretised dt or the chain
    # rule's temporaries, generously; the checkpoints; allocator rounding.
    bound = sum(g.numel() * g.element_size() for g in grads.values()) + 4 * x_bytes + history // 16 + 2**22
    assert peak <= bound < history / 2, (peak, bound, history)


# -- real sizes on a GPU, and what only a GPU compiler checks -----------------------------------------

REAL_CASES = [
    pytest.param("scan", ScanCase(2, 300, 256, 16, groups=2, **ALL), id="scan-all-options"),
    pytest.param("scan", ScanCase(2, 257, 96, 64, layout="bdl", D=True, h0=True), id="scan-bdl-state64"),
    pytest.param("ssd", SsdCase(2, 300, 8, 64, 64, groups=2, **ALL), id="ssd-all-options"),
]


@ON_CUDA
@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, id="f32"), pytest.param(torch.bfloat16, id="bf16")])
@pytest.mark.parametrize("kind, case", REAL_CASES)
def test_real_sizes_on_gpu(kind, case, dtype):
    _check(kind, case, dtype, "cuda")


# Compiles each kernel variant family for sm_90 in a fresh process without the interpreter, as
# scan_kernels.triton_kernels.aot_check does for the forward kernels (through its helpers).
_COMPILE_SCRIPT = textwrap.dedent("""
    import dataclasses, torch, triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend
    from scan_kernels.triton_kernels import aot_check, backward as tb
    gen = torch.Generator().manual_seed(0)
    def rand(*shape, dtype=torch.float32):
        return torch.rand(shape, generator=gen).to(dtype)
    def launches(dtype, state, ssd, everything):
        b, l, heads, headdim, g = 2, 40, 4, 16, 2
        c = heads * headdim
        f = torch.float64 if dtype == torch.float64 else torch.float32
        _, found = tb.backward_launches(
            rand(b, l, c, dtype=dtype), rand(b, l, c, dtype=dtype),
            rand(b, l, heads if ssd else c, dtype=f), -rand(heads) if ssd else -rand(c, state),
            rand(b, l, g, state, dtype=dtype), rand(b, l, g, state, dtype=dtype),
            D=rand(c) if everything else None, z=rand(b, l, c, dtype=dtype) if everything else None,
            h0=rand(b, c, state) if everything else None, dstate=rand(b, c, state) if everything else None,
            per_decay=headdim if ssd else 1, scalar_decay=ssd, state_field="B" if ssd else "A",
            blocks=tb.backward_blocks(state, c // g, "B" if ssd else "A")[1])
        return found
    calls = [("scan f32 all", launches(torch.float32, 16, False, True)),
             ("scan f64 all", launches(torch.float64, 16, False, True)),
             ("ssd bf16 plain state 128", launches(torch.bfloat16, 128, True, False))]
    calls.append(("scan f32 all int64 offsets", [dataclasses.replace(
        x, constexprs={**x.constexprs, "WIDE_OFFSETS": True}) for x in launches(torch.float32, 16, False, True)]))
    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    for label, found in calls:
        for launch in found:
            compiled = triton.compile(aot_check._source(launch, backend), target=target,
                                      options={"num_warps": launch.num_warps})
            summary, spilled = aot_check._ptxas_report(compiled.asm["ptx"], 90)
            print(f"{label} [{launch.kernel.__name__}]: {summary}{' SPILLS' if spilled else ''}")
""")


@pytest.mark.skipif(CUDA, reason=CUDA_COMPILES_EVERY_KERNEL)
def test_backward_kernels_compile_for_sm90():
    """The interpreter compiles nothing: both kernels compile for an H100/H200 (sm_90) with
    every option and none, in fp32, fp64 and bf16, with scalar decay (SSD) and in the
    int64-offset variant, and the ordinary variants do not spill."""
    from triton.backends import backends

    if "nvidia" not in backends:
        pytest.skip("this triton build has no NVIDIA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, without its warning
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT], cwd=root, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 8, done.stdout
    # The int64-offset variant (inputs of 2^31 elements and more) may spill a few bytes.
    assert all("SPILLS" not in line for line in lines if "int64" not in line), done.stdout



# Packed sequences (cu_seqlens) in one pair of launches: with 4-step tiles, sequences of 1, 5 and
# 11 steps (one tile, two with a short last one, three), each from its own h0 row, against the
# reference's gradients of the same packed call (which it takes a sequence at a time).
PACKED_BOUNDS = [0, 1, 6, 17]
PACKED_CASES = [
    pytest.param("scan", ScanCase(1, 17, 6, 3, groups=2, **ALL), id="scan-bld"),
    pytest.param("scan", ScanCase(1, 17, 6, 3, groups=2, layout="bdl", **ALL), id="scan-bdl"),
    pytest.param("ssd", SsdCase(1, 17, 4, 3, 3, groups=2, **ALL), id="ssd"),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind, case", PACKED_CASES)
def test_packed_backward_matches_reference(kind, case, device):
    _backend(device)
    seed = random_seed()
    inputs = (make_ssd_inputs if kind == "ssd" else make_scan_inputs)(case, torch.float32, device, seed=seed)
    rows = (len(PACKED_BOUNDS) - 1, *_state_shape(kind, inputs)[1:])
    inputs["h0"] = torch.randn(rows, generator=torch.Generator().manual_seed(seed)).to(device)
    dy, dstate = make_cotangents(inputs, tuple(inputs["x"].shape), rows, True, seed)
    backward = scan_kernels.ssd_scan_backward if kind == "ssd" else scan_kernels.selective_scan_backward
    cu = torch.tensor(PACKED_BOUNDS)
    got = backward(dy, **backward_inputs(inputs), dstate=dstate, cu_seqlens=cu, backend="triton")
    expected = backward(dy, **backward_inputs(inputs), dstate=dstate, cu_seqlens=cu, backend="reference")
    assert_grads_close(got, expected, backward_inputs(inputs), torch.float32, f"triton packed {kind} seed={seed}")
