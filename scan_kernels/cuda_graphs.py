"""Work captured as a CUDA graph, for callers that repeat it over the same tensors: the Triton
backend's captured state update (triton_kernels/graphs.py) and the bridge's captured model
steps. Plain torch: nothing here needs Triton.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def capture_graph(run: Callable[[], Any], device: torch.device, *,
                  warm_up: Callable[[], Any] | None = None) -> tuple[torch.cuda.CUDAGraph, Any]:
    """(`run` captured as a graph on `device`, what `run` returned while captured: the tensors a
    replay writes). `warm_up` (default: `run` itself) runs once first, off the graph, on a side
    stream as torch's capture wants: a first launch compiles (Triton), which a capture cannot
    hold. A capture CUDA voids raises, and leaves torch's capture stream current (its exit
    raises before restoring the stream): the caller's stream is made current again either way."""
    with torch.cuda.device(device):
        serving = torch.cuda.current_stream()
        try:
            side = torch.cuda.Stream()
            side.wait_stream(serving)
            with torch.cuda.stream(side):
                (warm_up or run)()
            serving.wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                result = run()
        finally:
            torch.cuda.set_stream(serving)
        serving.synchronize()
    return graph, result
