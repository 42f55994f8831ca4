"""Wire dtype codes ↔ numpy dtypes, for the client (which never imports torch) and the server's
tensor views (bridge.tensors). numpy has no bfloat16: see HOST_DTYPES."""

from __future__ import annotations

import numpy as np

NUMPY_DTYPES = {
    "f32": np.float32, "f16": np.float16, "f64": np.float64,
    "i32": np.int32, "i64": np.int64, "u8": np.uint8,
}
WIRE_CODES = {np.dtype(v): k for k, v in NUMPY_DTYPES.items()}
# Every wire dtype as a numpy dtype of its size: bf16's bytes travel as int16, reinterpreted on
# the torch side.
HOST_DTYPES = {**NUMPY_DTYPES, "bf16": np.int16}
