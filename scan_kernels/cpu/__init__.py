"""The "cpu" backend: C++ SIMD kernels (scan_kernels/cpu/scan_kernel.cpp) for CPU tensors.

One pass over the sequence per (batch row, block of channels) with the state in L1,
vectorized over channels; the state update works on the pool in place, vectorized over the
state; as many threads as torch.get_num_threads(). The extension is compiled once per machine
by `python -m scan_kernels.cpu.build` (see build.py), in the best SIMD variant the CPU executes or
the one SCAN_BRIDGE_SIMD names; where it cannot be built, `load_backend` raises
BackendUnavailable with the reason and the registry falls back to the "torch" backend.
"""

from __future__ import annotations

import torch

from .._registry import Backend
from ..backward import bdl_layout
from ..eager import _compute_dtype


def load_backend() -> Backend:
    # Imported here, not at module level, so `python -m scan_kernels.cpu.build` runs it only once.
    from . import build

    ext = build.load_extension()
    # Every helper thread from the start, not when some call's timing first offers it work: a
    # server's thread count then stays what it was at start (bench.soak checks it does).
    ext.start_helpers()
    return backend_from(ext)


def _in_dtype(f, *tensors):
    """Each tensor contiguous in the compute dtype f and aligned to its element (a copy only
    where it is not already: the SSD kernels read typed pointers, and tensors decoded from a
    frame may start at any byte); None stays None."""
    return [None if t is None else _aligned(t.to(f).contiguous()) for t in tensors]


def _aligned(t):
    return t.clone() if t.data_ptr() % t.element_size() else t


def _packed(cu_seqlens) -> tuple:
    """The bindings' trailing cu_seqlens, passed only for a packed call: builds of revisions
    before it (bench.kernel_ab loads them) take one argument fewer."""
    return () if cu_seqlens is None else (cu_seqlens,)


def backend_from(ext) -> Backend:
    """The Backend over a loaded extension module (tests also load differently built ones)."""

    def scan(x, dt, A, B, C, *, D, z, dt_bias, dt_softplus, dt_min, dt_max, h0, return_state,
             layout, cu_seqlens=None):
        return ext.scan(x, dt, A, B, C, D, z, dt_bias, dt_softplus, dt_min, dt_max, h0,
                        return_state, layout, *_packed(cu_seqlens))

    def state_update(state, x, dt, A, B, C, *, D, z, dt_bias, dt_softplus, dt_min, dt_max,
                     slots):
        return ext.state_update(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, dt_min,
                                dt_max, slots)

    def ssd_scan(x, dt, A, B, C, *, D, z, dt_bias, dt_softplus, dt_min, dt_max, h0, return_state,
                 chunk_size, cu_seqlens=None):
        # chunk_size tunes chunked backends; this recurrent kernel has none to tune.
        f = _compute_dtype(x)
        batch, _, heads, headdim = x.shape
        rows = batch if cu_seqlens is None else cu_seqlens.shape[0] - 1
        y = torch.empty(x.shape, dtype=f)
        state = torch.empty((rows, heads, headdim, B.shape[3]), dtype=f) if return_state else None
        ext.ssd_scan(*_in_dtype(f, x, dt, A, B, C, D, z, dt_bias), dt_softplus, dt_min, dt_max,
                     *_in_dtype(f, h0), y, state, *_packed(cu_seqlens))
        return y.to(x.dtype), state

    def ssd_state_update(state, x, dt, A, B, C, *, D, z, dt_bias, dt_softplus, dt_min, dt_max, slots):
        f = _compute_dtype(x)
        batch = x.shape[0]
        rows = torch.arange(batch) if slots is None else slots.to(torch.int64)
        # The server's pools (fp32, each row contiguous) are updated where they lie; any other pool
        # through a packed copy of its live rows.
        in_place = (state.dtype == f and (state.shape[0] == 0 or state[0].is_contiguous())
                    and state.data_ptr() % state.element_size() == 0)
        if in_place:
            # The kernel reads the slots as int64 too: int64 slots from a frame may start at any byte.
            pool, kernel_rows = state, _aligned(rows.contiguous())
        else:
            live = torch.nonzero(rows >= 0).squeeze(1)
            pool_rows = rows.index_select(0, live)
            pool = state.index_select(0, pool_rows).to(f).contiguous()
            kernel_rows = torch.full((batch,), -1, dtype=torch.int64)
            kernel_rows[live] = torch.arange(live.numel())
        y = torch.empty(x.shape, dtype=f)
        ext.ssd_state_update(pool, kernel_rows, *_in_dtype(f, x, dt, A, B, C, D, z, dt_bias), dt_softplus, dt_min,
                             dt_max, y)
        if not in_place:
            state.index_copy_(0, pool_rows, pool.to(state.dtype))
        return y.to(x.dtype)

    def run_backward(dy, x, dt, A, B, C, D, z, dt_bias, dt_softplus, dt_min, dt_max, h0, dstate, f, headdim=None,
                     cu_seqlens=None):
        """The C++ reverse scan over "bld" [batch, seq, channel] operands: every gradient, that of
        dt through its bias, softplus and clamp included. With `headdim`, Mamba-2's heads of that
        many channels: one decay per head, and dt, dt_bias, A and their gradients per head.
        With `cu_seqlens`, sequences packed along seq, h0 and dstate a row for each."""
        x, dt, dy, A, B, C, D, z, dt_bias, h0, dstate = _in_dtype(f, x, dt, dy, A, B, C, D, z, dt_bias, h0, dstate)
        dx, ddt = torch.empty_like(x), torch.empty_like(dt)
        dz = None if z is None else torch.empty_like(z)
        dh0 = None if h0 is None else torch.empty_like(h0)
        dA, dD, ddt_bias, dB, dC = ext.scan_backward(x, dt, z, dy, A, B, C, D, dt_bias, dt_softplus, dt_min, dt_max,
                                                     h0, dstate, headdim is not None, headdim or 1, dx, ddt, dz,
                                                     dh0, *_packed(cu_seqlens))
        return dict(x=dx, dt=ddt, A=dA, B=dB, C=dC, D=None if D is None else dD, z=dz,
                    dt_bias=None if dt_bias is None else ddt_bias, h0=dh0)

    def scan_backward(dy, x, dt, A, B, C, *, D, z, dt_bias, dt_softplus, dt_min, dt_max, h0, dstate, layout,
                      cu_seqlens=None):
        f = _compute_dtype(x)
        bdl = layout == "bdl"
        if bdl:  # read as "bld"; the gradients are handed back as views in the caller's layout
            x, dt, dy = x.transpose(1, 2), dt.transpose(1, 2), dy.transpose(1, 2)
            z = None if z is None else z.transpose(1, 2)
            B, C = B.permute(0, 3, 1, 2), C.permute(0, 3, 1, 2)
        grads = run_backward(dy, x, dt, A, B, C, D, z, dt_bias, dt_softplus, dt_min, dt_max, h0, dstate, f,
                             cu_seqlens=cu_seqlens)
        return bdl_layout(grads) if bdl else grads

    def ssd_scan_backward(dy, x, dt, A, B, C, *, D, z, dt_bias, dt_softplus, dt_min, dt_max, h0, dstate,
                          chunk_size, cu_seqlens=None):
        # Heads x headdim as channels, through the binding's Mamba-2 runner (one decay per head); dt,
        # dt_bias and A are read per head, and their gradients come back per head.
        f = _compute_dtype(x)
        batch, seq, heads, headdim = x.shape
        channels = heads * headdim
        h0_rows, dstate_rows = (None if t is None else t.reshape(t.shape[0], channels, -1) for t in (h0, dstate))
        g = run_backward(dy.reshape(batch, seq, channels), x.reshape(batch, seq, channels), dt, A, B, C,
                         None if D is None else D.reshape(channels),
                         None if z is None else z.reshape(batch, seq, channels), dt_bias, dt_softplus, dt_min,
                         dt_max, h0_rows, dstate_rows, f, headdim=headdim, cu_seqlens=cu_seqlens)
        return dict(x=g["x"].view(x.shape), dt=g["dt"], A=g["A"], B=g["B"], C=g["C"],
                    D=None if D is None else g["D"].view(heads, headdim), z=None if z is None else g["z"].view(x.shape),
                    dt_bias=g["dt_bias"], h0=None if h0 is None else g["h0"].view(h0.shape))

    return Backend(
        name="cpu",
        scan=scan,
        state_update=state_update,
        device_types=frozenset({"cpu"}),
        # It reads every input at whatever byte offset it lies (unaligned loads, or packed
        # into aligned tiles), so the bridge makes no aligned copy.
        reads_unaligned=True,
        packs_sequences=frozenset({"scan", "ssd_scan", "scan_backward", "ssd_scan_backward"}),
        # "simd": the variant that serves (build.SIMD_VARIANTS' name, the description's first
        # word), with its description and library.
        details={"simd": ext.simd().split(" ", 1)[0], "simd_description": ext.simd(), "library": ext.__file__},
        run_problem=ext.run_problem,
        run_ssd_update=ext.run_ssd_update,
        ssd_scan=ssd_scan,
        ssd_state_update=ssd_state_update,
        model_step=ext.model_step,
        linear=ext.linear,
        # A build of a revision before them (bench.kernel_ab loads such) lacks these.
        model_forward=getattr(ext, "model_forward", None),
        prepare_model=getattr(ext, "prepare_model", None),
        run_model_step=getattr(ext, "run_model_step", None),
        scan_backward=scan_backward,
        ssd_scan_backward=ssd_scan_backward,
    )

