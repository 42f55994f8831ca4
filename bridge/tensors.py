"""Wire tensors ↔ torch tensors. The only place where protocol meets torch.

Inbound bytes are viewed, not copied, on the CPU: a tensor over the memoryview the decoder
produced (a view into the received frame). A payload at an address that is not a
multiple of its item size is copied once to aligned memory (the kernels expect aligned
operands) unless the backend reads unaligned memory itself (the "cpu" backend). On CUDA the
copy to the device is the staging copy.

Each conversion is one torch call (through numpy, which makes the views more cheaply): after a
kernel has swept megabytes through the caches, every torch call pays for its deep dispatch path
in cache misses, so fewer calls made a game-loop step's copies in and out faster
(docs/performance.md, "game loop tensor views").
"""

from __future__ import annotations

import warnings

import numpy as np
import torch

from protocol import OutTensor, WireTensor

from .dtypes import HOST_DTYPES

TORCH_DTYPES = {
    "f32": torch.float32,
    "f16": torch.float16,
    "bf16": torch.bfloat16,
    "f64": torch.float64,
    "i32": torch.int32,
    "i64": torch.int64,
    "u8": torch.uint8,
}
WIRE_DTYPES = {v: k for k, v in TORCH_DTYPES.items()}


def wire_name(dtype: torch.dtype) -> str:
    """A dtype's wire name (SPEC §5), or torch's own for one the wire has none for."""
    return WIRE_DTYPES.get(dtype, str(dtype))


# Frames are received into buffers we own and never reuse while a request is in flight, so the
# read-only flag some decoders put on views is no hazard; torch warns about it.
warnings.filterwarnings("ignore", message="The given NumPy array is not writable")


def host_view(t: WireTensor) -> torch.Tensor:
    """A CPU tensor over the wire bytes, zero-copy (possibly unaligned)."""
    tensor = torch.from_numpy(np.ndarray(t.shape, HOST_DTYPES[t.dtype], t.data))
    return tensor.view(torch.bfloat16) if t.dtype == "bf16" else tensor


def to_device(t: WireTensor, device: torch.device, *, unaligned_ok: bool = False) -> torch.Tensor:
    host = host_view(t)
    if device.type != "cpu":
        return host.to(device)
    if not unaligned_ok and host.numel() and host.data_ptr() % host.element_size():
        return host.clone()
    return host


def to_wire(t: torch.Tensor) -> OutTensor:
    """A reply tensor whose data is a view of the (host, contiguous) tensor's memory."""
    code = WIRE_DTYPES.get(t.dtype)
    if code is None:
        raise TypeError(f"torch dtype {t.dtype} has no wire code; expected one of {sorted(map(str, WIRE_DTYPES))}")
    if t.device.type != "cpu":
        t = t.cpu()
    array = (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy()
    if not array.flags.c_contiguous:
        array = np.ascontiguousarray(array)
    return OutTensor(code, array.shape, array)
