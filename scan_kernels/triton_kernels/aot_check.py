"""Compile the Triton kernels for CUDA GPUs on a machine that has none.

    python -m scan_kernels.triton_kernels.aot_check [--arch 90] [--arch 80] ...

The interpreter proves the kernels' arithmetic but compiles nothing, so it cannot catch what only
the GPU compiler rejects (a non-constexpr global, an op without a lowering) or a block size that
spills registers. This builds the launches of representative calls on CPU tensors (every kernel,
both layouts, each input dtype, every option, one and several sequence segments, each row of the
block tables), specialises each launch as Triton's JIT would on a GPU, compiles it to a cubin
for each architecture and prints the registers and spills ptxas reports. Exit status 1 when a
variant fails to compile or spills. Run it without TRITON_INTERPRET (the tests start it in a
subprocess for that reason).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import replace

import torch


def _representative_launches():
    """(label, Launch) for calls that together reach every compiled variant family."""
    from .. import WARMUP_OPTIONS
    from . import configs
    from .scan import scan_launches
    from .ssd import ssd_scan_launches, ssd_update_launch
    from .state_update import update_launch

    gen = torch.Generator().manual_seed(0)

    def rand(*shape, dtype=torch.float32):
        return torch.rand(shape, generator=gen).to(dtype)

    def scan_call(label, dtype, layout, state, options, segment_len=None, batch=2, seq=40, dim=64, groups=2):
        seq_shape = (batch, seq, dim) if layout == "bld" else (batch, dim, seq)
        bc_shape = (batch, seq, groups, state) if layout == "bld" else (batch, groups, state, seq)
        def on(name):
            return name in options

        _, _, launches = scan_launches(
            rand(*seq_shape, dtype=dtype), rand(*seq_shape, dtype=dtype), -rand(dim, state),
            rand(*bc_shape, dtype=dtype), rand(*bc_shape, dtype=dtype),
            D=rand(dim) if on("D") else None, z=rand(*seq_shape, dtype=dtype) if on("z") else None,
            dt_bias=rand(dim) if on("dt_bias") else None, dt_softplus=on("dt_softplus"),
            dt_min=0.001 if on("clamp") else None, dt_max=0.1 if on("clamp") else None,
            h0=rand(batch, dim, state) if on("h0") else None, return_state=on("return_state"),
            layout=layout, out=None, state_out=None, blocks=None, segment_len=segment_len)
        return [(f"{label} [{launch.kernel.__name__}]", launch) for launch in launches]

    def update_call(label, dtype, state, options, batch=5, dim=64, groups=2):
        def on(name):
            return name in options

        _, launch = update_launch(
            rand(batch + 3, dim, state), rand(batch, dim, dtype=dtype), rand(batch, dim, dtype=dtype),
            -rand(dim, state), rand(batch, groups, state, dtype=dtype), rand(batch, groups, state, dtype=dtype),
            D=rand(dim) if on("D") else None, z=rand(batch, dim, dtype=dtype) if on("z") else None,
            dt_bias=rand(dim) if on("dt_bias") else None, dt_softplus=on("dt_softplus"),
            dt_min=0.001 if on("clamp") else None, dt_max=0.1 if on("clamp") else None,
            slots=torch.arange(batch) if on("slots") else None, out=None, blocks=None)
        return [(f"{label} [{launch.kernel.__name__}]", launch)]

    def ssd_scan_call(label, dtype, every: bool, headdim=64, state=128, seq=300):
        b, l, h, g = 2, seq, 4, 2
        xs, bcs = (b, l, h, headdim), (b, l, g, state)
        _, _, launches = ssd_scan_launches(
            rand(*xs, dtype=dtype), rand(b, l, h, dtype=dtype), -rand(h), rand(*bcs, dtype=dtype),
            rand(*bcs, dtype=dtype), D=rand(h, headdim) if every else None, z=rand(*xs, dtype=dtype) if every else None,
            dt_bias=rand(h) if every else None, dt_softplus=every, dt_min=0.001 if every else None,
            dt_max=0.1 if every else None, h0=rand(b, h, headdim, state) if every else None, return_state=every,
            chunk_size=None, out=None, state_out=None, blocks=None)
        return [(f"{label} [{launch.kernel.__name__}]", launch) for launch in launches]

    def ssd_update_call(label, dtype, every: bool):
        b, h, p, n, g = 5, 8, 64, 128, 2
        _, launch = ssd_update_launch(
            rand(b + 3, h, p, n), rand(b, h, p, dtype=dtype), rand(b, h, dtype=dtype), -rand(h),
            rand(b, g, n, dtype=dtype), rand(b, g, n, dtype=dtype), D=rand(h, p) if every else None,
            z=rand(b, h, p, dtype=dtype) if every else None, dt_bias=rand(h) if every else None,
            dt_softplus=every, dt_min=0.001 if every else None, dt_max=0.1 if every else None,
            slots=torch.arange(b) if every else None, out=None, blocks=None)
        return [(f"{label} [{launch.kernel.__name__}]", launch)]

    def int64_offsets(calls):
        """The same launches in the variant for inputs of 2^31 elements and more (too large to
        allocate here)."""
        return [(f"{label} int64 offsets", replace(launch, constexprs={**launch.constexprs, "WIDE_OFFSETS": True}))
                for label, launch in calls]

    every = WARMUP_OPTIONS
    found = []
    found += scan_call("scan bld f16 all options, segments", torch.float16, "bld", 16, every, segment_len=16)
    found += scan_call("scan bdl f32 plain", torch.float32, "bdl", 16, ("return_state",))
    found += scan_call("scan bld bf16 clamp (ExPhil)", torch.bfloat16, "bld", 16, ("clamp",))
    found += scan_call("scan bdl f64 all options, segments", torch.float64, "bdl", 16, every, segment_len=16)
    for limit, _ in configs.SCAN_TABLE:
        found += scan_call(f"scan bld f32 state {limit}, segments", torch.float32, "bld", limit,
                           ("return_state",), segment_len=16, dim=64, groups=1)
    found += update_call("update bf16 all options, slots", torch.bfloat16, 16,
                         ("D", "z", "dt_bias", "dt_softplus", "clamp", "slots"))
    found += update_call("update f32 plain", torch.float32, 16, ())
    found += int64_offsets(scan_call("scan bld bf16 all options, segments", torch.bfloat16, "bld", 16, every,
                                     segment_len=16))
    found += int64_offsets(update_call("update f32 all options, slots", torch.float32, 16,
                                       ("D", "z", "dt_bias", "dt_softplus", "clamp", "slots")))
    found += update_call("update f64 clamp, slots", torch.float64, 16, ("clamp", "slots"))
    for limit, _ in configs.UPDATE_TABLE:
        found += update_call(f"update f32 state {limit}", torch.float32, limit, ("slots",), dim=64, groups=1)
    # Mamba-2: each dot path of the scan (the bf16 split, the fp16 one with its scaling, fp32 IEEE,
    # fp64) with every option, small heads (padded blocks), one chunk, and the update.
    found += ssd_scan_call("ssd_scan bf16 every option", torch.bfloat16, True)
    found += ssd_scan_call("ssd_scan f16 every option", torch.float16, True)
    found += ssd_scan_call("ssd_scan f16 plain, headdim 17 state 16", torch.float16, False, headdim=17, state=16)
    found += ssd_scan_call("ssd_scan f32 every option", torch.float32, True)
    found += ssd_scan_call("ssd_scan f64 every option", torch.float64, True)
    # One chunk (ExPhil's window): h0 read as the entering state, the final state written by step 3.
    found += ssd_scan_call("ssd_scan f32 one chunk, every option", torch.float32, True, seq=60)
    found += ssd_update_call("ssd_update bf16 every option", torch.bfloat16, True)
    found += ssd_update_call("ssd_update f64 plain", torch.float64, False)
    return found


def _source(launch, backend):
    """The ASTSource Triton's JIT would compile for this launch on a GPU: constexprs, None
    arguments and ints equal to 1 become constants; pointers and ints that are multiples of 16
    carry the divisibility hint (the JIT's own specialisation function decides both)."""
    from triton.compiler import ASTSource
    from triton.runtime.jit import native_specialize_impl

    kernel = launch.kernel
    runtime_params = [p for p in kernel.params if not p.is_constexpr]
    if len(runtime_params) != len(launch.args):
        raise ValueError(f"{kernel.__name__}: {len(launch.args)} arguments for {len(runtime_params)} parameters")
    values = dict(zip((p.name for p in runtime_params), launch.args))
    signature, constexprs, attrs = {}, {}, {}
    for index, param in enumerate(kernel.params):
        if param.is_constexpr:
            signature[param.name] = "constexpr"
            constexprs[param.name] = launch.constexprs[param.name]
            continue
        value = values[param.name]
        kind, attr = native_specialize_impl(type(backend), value, False, not param.do_not_specialize, True)
        if kind == "constexpr":
            signature[param.name] = "constexpr"
            constexprs[param.name] = value
            continue
        signature[param.name] = kind
        if attr:
            attrs[(index,)] = backend.parse_attr(attr)
    return ASTSource(kernel, signature, constexprs, attrs)


def _ptxas_report(ptx: str, arch: int) -> tuple[str, bool]:
    """(ptxas -v summary, spills or not); ('', False) when no ptxas can be found."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability
        ptxas = get_ptxas(arch).path
        gpu_name = sm_arch_from_capability(arch)
    except (ImportError, AttributeError, RuntimeError):
        return "", False
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        done = subprocess.run([ptxas, "-v", f"--gpu-name={gpu_name}", path, "-o", os.devnull],
                              capture_output=True, text=True)
    log = done.stdout + done.stderr
    registers = re.search(r"Used (\d+) registers", log)
    spills = [int(v) for v in re.findall(r"(\d+) bytes spill (?:stores|loads)", log)]
    summary = f"{registers.group(1) if registers else '?'} registers, {max(spills, default=0)} bytes spilled"
    return summary, any(spills)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, action="append",
                        help="CUDA compute capability as an int (90 = H100/H200); repeatable; default 90")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("aot_check: unset TRITON_INTERPRET (the interpreter compiles nothing)", file=sys.stderr)
        return 2
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend

    failed = False
    launches = _representative_launches()
    for arch in args.arch or [90]:
        target = GPUTarget("cuda", arch, 32)
        backend = make_backend(target)
        for label, launch in launches:
            try:
                compiled = triton.compile(_source(launch, backend), target=target,
                                          options={"num_warps": launch.num_warps})
            except Exception as exc:  # report every failing variant, not just the first
                failed = True
                print(f"sm_{arch} {label}: FAILED {type(exc).__name__}: {exc}")
                continue
            summary, spilled = _ptxas_report(compiled.asm["ptx"], arch)
            failed |= spilled
            print(f"sm_{arch} {label}: ok, {launch.num_warps} warps, {summary or 'ptxas -v unavailable'}"
                  f"{' SPILLS' if spilled else ''}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
