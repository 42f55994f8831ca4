"""Per-op argument schemas of protocol v1 (SPEC.md §6 documents the same table).

Each argument has a kind, checked by the decoder one value at a time:

    tensor       a tensor map {dtype, shape, data} or a handle reference {handle}
    tensor_data  a tensor map only (no handle)
    bool         true / false
    number       a finite int or float (delivered as float)
    str          a non-empty str
    size         a positive int
    layout       "bld" or "bdl"
    limits       a pair [low, high] of numbers, each finite or an infinity (mamba_ssm's dt_limit)
    kind         "mamba" or "ssd" (a session's model generation)

Consistency between arguments (shapes agreeing, a session existing) is checked further in.
"""

from __future__ import annotations

from dataclasses import dataclass

PROTOCOL_VERSION = 1
SUPPORTED_VERSIONS = (1,)
# Request ids are msgpack uints (or non-empty strs).
MAX_REQUEST_ID = 2**64 - 1


def valid_request_id(value) -> bool:
    """Whether `value` is a request id: an int in 0 .. MAX_REQUEST_ID (not a bool) or a
    non-empty str."""
    return (type(value) is int and 0 <= value <= MAX_REQUEST_ID) or (isinstance(value, str) and value != "")


@dataclass(frozen=True)
class Arg:
    kind: str
    required: bool = False


KIND_EXPECTED = {
    "tensor": "a tensor map {dtype, shape, data} or a handle map {handle}",
    "tensor_data": "a tensor map {dtype, shape, data}",
    "bool": "a bool",
    "number": "a finite number",
    "str": "a non-empty str",
    "size": "a positive int",
    "layout": '"bld" or "bdl"',
    "limits": "a pair [low, high] of numbers (finite or infinite, not NaN)",
    "kind": '"mamba" or "ssd"',
}
LAYOUTS = ("bld", "bdl")
SESSION_KINDS = ("mamba", "ssd")

# alias -> canonical name; accepted by every op that has the canonical argument, so that a
# mamba_ssm call (selective_scan_fn, mamba_chunk_scan_combined) maps over one to one.
ALIASES = {"u": "x", "delta": "dt", "delta_bias": "dt_bias", "delta_softplus": "dt_softplus",
           "return_last_state": "return_state", "initial_states": "h0"}

_DT_TRANSFORM = {
    "D": Arg("tensor"),
    "z": Arg("tensor"),
    "dt_bias": Arg("tensor"),
    "dt_softplus": Arg("bool"),
    "dt_min": Arg("number"),
    "dt_max": Arg("number"),
}

OPS: dict[str, dict[str, Arg]] = {
    "ping": {},
    "info": {},
    "scan": {
        "x": Arg("tensor", True),
        "dt": Arg("tensor", True),
        "A": Arg("tensor", True),
        "B": Arg("tensor", True),
        "C": Arg("tensor", True),
        **_DT_TRANSFORM,
        "h0": Arg("tensor"),
        "return_state": Arg("bool"),
        "layout": Arg("layout"),
        "cu_seqlens": Arg("tensor"),
        "session": Arg("str"),
    },
    "ssd_scan": {
        "x": Arg("tensor", True),
        "dt": Arg("tensor", True),
        "A": Arg("tensor", True),
        "B": Arg("tensor", True),
        "C": Arg("tensor", True),
        **_DT_TRANSFORM,
        "dt_limit": Arg("limits"),
        "h0": Arg("tensor"),
        "return_state": Arg("bool"),
        "cu_seqlens": Arg("tensor"),
        "chunk_size": Arg("size"),
        "session": Arg("str"),
    },
    "step": {
        "session": Arg("str", True),
        "x": Arg("tensor", True),
        "dt": Arg("tensor", True),
        "A": Arg("tensor", True),
        "B": Arg("tensor", True),
        "C": Arg("tensor", True),
        **_DT_TRANSFORM,
        "dt_limit": Arg("limits"),
    },
    # kind "mamba" (the default) takes dim; "ssd" takes heads and headdim (checked further in).
    "session_open": {
        "kind": Arg("kind"),
        "batch": Arg("size", True),
        "dim": Arg("size"),
        "heads": Arg("size"),
        "headdim": Arg("size"),
        "state": Arg("size", True),
    },
    "session_close": {"session": Arg("str", True)},
    "session_state": {"session": Arg("str", True)},
    "put": {"tensor": Arg("tensor_data", True)},
    "free": {"handle": Arg("str", True)},
    "stats": {},
    "shutdown": {},
}
