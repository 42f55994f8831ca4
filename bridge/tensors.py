"""Wire tensors ↔ torch tensors. The only place where protocol meets torch.

Inbound bytes are viewed, not copied, on the CPU: `torch.frombuffer` over the memoryview the
decoder produced (a view into the received frame). A payload at an address that is not a
multiple of its item size is copied once to aligned memory (the kernels expect aligned
operands) unless the backend reads unaligned memory itself (the "cpu" backend). On CUDA the
copy to the device is the staging copy.
"""

from __future__ import annotations

import warnings

import torch

from protocol import OutTensor, WireTensor

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

# Frames are received into buffers we own and never reuse while a request is in flight, so the
# read-only flag some decoders put on views is no hazard; torch warns about it once per process.
warnings.filterwarnings("ignore", message="The given buffer is not writable")


def host_view(t: WireTensor) -> torch.Tensor:
    """A CPU tensor over the wire bytes, zero-copy (possibly unaligned)."""
    dtype = TORCH_DTYPES[t.dtype]
    if len(t.data) == 0:
        return torch.empty(t.shape, dtype=dtype)
    return torch.frombuffer(t.data, dtype=dtype).view(t.shape)


def to_device(t: WireTensor, device: torch.device, *, unaligned_ok: bool = False) -> torch.Tensor:
    host = host_view(t)
    if device.type != "cpu":
        return host.to(device)
    if not unaligned_ok and host.numel() and host.data_ptr() % host.element_size():
        return host.clone()
    return host


def to_wire(t: torch.Tensor) -> OutTensor:
    """A reply tensor whose data is a view of the (host, contiguous) tensor's memory."""
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    data = memoryview(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else b""
    return OutTensor(WIRE_DTYPES[t.dtype], tuple(t.shape), data)
