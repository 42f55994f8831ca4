"""Tensor values on the wire: dtype codes, decoded tensors, tensor references, reply tensors.

A tensor is the map `{"dtype": code, "shape": [d0, ...], "data": <bin or str>}`: little-endian,
C-contiguous, `len(data) == prod(shape) * itemsize`. `{"handle": name}` stands in for a tensor
that lives on the server.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

# wire code -> (itemsize in bytes, what the bytes are). All little-endian.
DTYPES: dict[str, tuple[int, str]] = {
    "f32": (4, "IEEE 754 binary32"),
    "f16": (2, "IEEE 754 binary16"),
    "bf16": (2, "bfloat16: the upper 16 bits of an IEEE 754 binary32"),
    "f64": (8, "IEEE 754 binary64"),
    "i32": (4, "two's complement 32-bit integer"),
    "i64": (8, "two's complement 64-bit integer"),
    "u8": (1, "unsigned 8-bit integer"),
}
MAX_NDIM = 8
# Dimensions are int64 on the server side.
MAX_DIM = 2**63 - 1
# The most bytes a shape may span (SPEC §5): array libraries keep a tensor's extent in an int64,
# counting a 0 dim as 1, so numpy refuses f32 [0, 2^61] as too big though it holds nothing.
MAX_EXTENT_BYTES = 2**63 - 1


def extent_bytes(shape, itemsize: int) -> int:
    """The bytes `shape` spans with each 0 dim counted as 1: at least its data's length, and
    what must not pass MAX_EXTENT_BYTES."""
    return prod(d or 1 for d in shape) * itemsize


@dataclass(slots=True)
class WireTensor:
    """A tensor decoded from a request. `data` is a read-only view into the received body
    (no copy; it keeps the body alive) of exactly prod(shape) * itemsize bytes; its address
    has whatever alignment the sender gave it."""

    dtype: str
    shape: tuple[int, ...]
    data: memoryview


@dataclass(slots=True)
class HandleRef:
    """`{"handle": name}` given where a tensor is expected: a tensor resident on the server."""

    handle: str


class OutTensor:
    """A tensor to put in a reply (or a request): encoded as the tensor map with `data` as
    msgpack bin, referencing `data`'s memory without copying it.

    `data` is any C-contiguous buffer (bytes, bytearray, memoryview, numpy array) holding
    exactly prod(shape) * itemsize bytes in the wire layout (little-endian, C order).
    """

    __slots__ = ("dtype", "shape", "data")

    def __init__(self, dtype: str, shape, data):
        if dtype not in DTYPES:
            raise ValueError(f"OutTensor dtype: expected one of {', '.join(DTYPES)}, got {dtype!r}")
        shape = tuple(shape)
        if len(shape) > MAX_NDIM or not all(type(d) is int and 0 <= d <= MAX_DIM for d in shape):
            raise ValueError(f"OutTensor shape: expected at most {MAX_NDIM} non-negative ints, got {shape!r}")
        try:
            view = memoryview(data)
        except TypeError:
            raise TypeError(f"OutTensor data: expected a buffer (bytes, memoryview, numpy array), "
                            f"got {type(data).__name__}") from None
        if not view.c_contiguous:
            raise ValueError("OutTensor data: expected a C-contiguous buffer, got a strided one")
        if view.nbytes == 0:  # memoryview cannot cast a view with a 0 in its shape
            view = memoryview(b"")
        elif view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        expected = prod(shape) * DTYPES[dtype][0]
        if view.nbytes != expected:
            raise ValueError(f"OutTensor data: expected {expected} bytes ({dtype} {list(shape)}), "
                             f"got {view.nbytes}")
        # Data that fills its shape is no bigger than a buffer: only a 0 dim can hide a shape
        # too big to send.
        if not expected and extent_bytes(shape, DTYPES[dtype][0]) > MAX_EXTENT_BYTES:
            raise ValueError(f"OutTensor shape: expected at most {MAX_EXTENT_BYTES} bytes of {dtype} "
                             f"with each 0 dim counted as 1, got {shape!r}")
        self.dtype = dtype
        self.shape = shape
        self.data = view

    def __repr__(self):
        return f"OutTensor(dtype={self.dtype!r}, shape={self.shape!r}, {self.data.nbytes} bytes)"
