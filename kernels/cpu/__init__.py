"""The "cpu" backend: C++ SIMD kernels (kernels/cpu/scan_kernel.cpp) for CPU tensors.

One pass over the sequence per (batch row, block of channels) with the state in L1,
vectorized over channels; the state update works on the pool in place, vectorized over the
state; as many threads as torch.get_num_threads(). The extension is compiled once per machine
by `python -m kernels.cpu.build` (see build.py), in the best SIMD variant the CPU executes or
the one SCAN_BRIDGE_SIMD names; where it cannot be built, `load_backend` raises
BackendUnavailable with the reason and the registry falls back to the "torch" backend.
"""

from __future__ import annotations

from .._registry import Backend


def load_backend() -> Backend:
    # Imported here, not at module level, so `python -m kernels.cpu.build` runs it only once.
    from . import build

    return backend_from(build.load_extension())


def backend_from(ext) -> Backend:
    """The Backend over a loaded extension module (tests also load differently built ones)."""

    def scan(x, dt, A, B, C, *, D, z, dt_bias, dt_softplus, dt_min, dt_max, h0, return_state,
             layout):
        return ext.scan(x, dt, A, B, C, D, z, dt_bias, dt_softplus, dt_min, dt_max, h0,
                        return_state, layout)

    def state_update(state, x, dt, A, B, C, *, D, z, dt_bias, dt_softplus, dt_min, dt_max,
                     slots):
        return ext.state_update(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, dt_min,
                                dt_max, slots)

    return Backend(
        name="cpu",
        scan=scan,
        state_update=state_update,
        device_types=frozenset({"cpu"}),
        # It reads every input at whatever byte offset it lies (unaligned loads, or packed
        # into aligned tiles), so the bridge makes no aligned copy.
        reads_unaligned=True,
        # "simd": the variant that serves (build.SIMD_VARIANTS' name, the description's first
        # word), with its description and library.
        details={"simd": ext.simd().split(" ", 1)[0], "simd_description": ext.simd(), "library": ext.__file__},
        run_problem=ext.run_problem,
    )
