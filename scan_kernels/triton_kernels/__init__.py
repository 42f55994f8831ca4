"""The "triton" backend: the forward scan and the state update as Triton kernels.

Runs on CUDA tensors when a GPU is present, and on CPU tensors through Triton's interpreter when
TRITON_INTERPRET=1 is set before triton is first imported (how the tests prove the kernels on a
machine without a GPU; far too slow to serve). Nothing here imports triton until
`load_backend()` runs, so `import scan_kernels` stays cheap and works without triton installed.

    scan.py          forward scan: chunked associative scan, sequence segments with carries
    state_update.py  one timestep for many rows, state in place, slots into a state pool
    ssd.py           Mamba-2 (SSD): the chunked scan (tl.dot tiles) and its one-step update
    backward.py      gradients of both scans: checkpoints every tile, tiles recomputed in reverse
    graphs.py        the state update captured as a CUDA graph, for calls that repeat one problem
    common.py        math and host helpers both kernels share
    configs.py       the block-size table and the sequence split (no autotuning)
    warmup.py        compile the kernels for a server's shape buckets ahead of requests
"""

from __future__ import annotations

from .._registry import Backend
from ..errors import BackendUnavailable


def load_backend() -> Backend:
    try:
        import triton
    except ImportError as exc:
        raise BackendUnavailable(f"triton is not importable: {exc}") from exc
    import torch

    from . import backward, scan, ssd, state_update
    from .common import interpreter_active
    from .graphs import CapturedStateUpdate
    from .warmup import warmup

    interpreted = interpreter_active()
    device_types = set()
    if torch.cuda.is_available():
        device_types.add("cuda")
    if interpreted:
        device_types.add("cpu")
    if not device_types:
        raise BackendUnavailable(
            "no CUDA device (and the CPU interpreter is off: it needs TRITON_INTERPRET=1 set "
            "before triton is imported)")
    return Backend(
        name="triton",
        scan=scan.selective_scan,
        # Every op's programs read their packed sequence's boundaries themselves.
        packs_sequences=frozenset({"scan", "ssd_scan", "scan_backward", "ssd_scan_backward"}),
        state_update=state_update.selective_state_update,
        ssd_scan=ssd.ssd_scan,
        ssd_state_update=ssd.ssd_state_update,
        device_types=frozenset(device_types),
        warmup=warmup,
        details={"triton": triton.__version__, "interpreter": interpreted},
        # A CUDA graph holds a compiled kernel; the interpreter compiles none.
        capture_state_update=None if interpreted else CapturedStateUpdate,
        scan_backward=backward.selective_scan_backward,
        ssd_scan_backward=backward.ssd_scan_backward,
    )
