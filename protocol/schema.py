"""Per-op argument schemas of protocol v1 (SPEC.md §6 documents the same table).

Each argument has a kind, checked by the decoder one value at a time:

    tensor       a tensor map {dtype, shape, data} or a handle reference {handle}
    tensor_data  a tensor map only (no handle)
    bool         true / false
    number       a finite int or float (delivered as float)
    str          a non-empty str
    size         a positive int below 2^63
    layout       "bld" or "bdl"
    limits       a pair [low, high] of numbers, each finite or an infinity (mamba_ssm's dt_limit)
    kind         "mamba" or "ssd" (a session's model generation)
    output       "logits" or "hidden" (what a model op returns)
    weights_dtype  "f32", "bf16" or "f16" (what a model's weights are kept in)
    map          a map with str keys, values any msgpack (a model's config)
    tensors      a map of str names to tensors or handle references (weights, a model's state)
    size_or_tensors  a size, or a map as `tensors` (session_open's state: a plain session's
                 state size, or a model session's saved state)
    request_id   a request id: a uint or a non-empty str (what cancel names)
    frames       an array of maps {op, args}: calls of an op in FRAME_OPS on the session
                 session_open opens (or session_restore restores), each args that op's own but
                 session (checked as they are)

Consistency between arguments (shapes agreeing, a session existing) is checked further in.
"""

from __future__ import annotations

from dataclasses import dataclass

PROTOCOL_VERSION = 1
SUPPORTED_VERSIONS = (1,)
# Request ids are msgpack uints (or non-empty strs).
MAX_REQUEST_ID = 2**64 - 1
# The encoded size of an argument of kind "map" (a model's config). Decoded, a map of small
# values costs many times its bytes in Python objects and serving-thread time; real configs are
# a few KB (a transformers config.json is under 10 KB), so this leaves them ample room while
# keeping the worst one's decode a fraction of a second.
MAX_MAP_BYTES = 256 << 10
# The entries of a map of named tensors (a model's weights, a model session's state): a Mamba
# checkpoint has at most about a thousand tensors, and a session's state two a layer. Each entry
# costs objects of its own decoded, so a map of many tiny tensors would cost many times its bytes.
MAX_NAMED_TENSORS = 16384
# The calls of one `frames` array: a rollback re-runs a few frames, a session reopened elsewhere
# those since its last checkpoint. Each decoded frame costs many times its bytes in objects.
MAX_FRAMES = 4096


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
    "size": "a positive int below 2^63",
    "layout": '"bld" or "bdl"',
    "limits": "a pair [low, high] of numbers (finite or infinite, not NaN)",
    "kind": '"mamba" or "ssd"',
    "output": '"logits" or "hidden"',
    "weights_dtype": '"f32", "bf16" or "f16"',
    "map": "a map with str keys",
    "tensors": "a map of str names to tensor maps or handle maps",
    "size_or_tensors": "a positive int below 2^63, or a map of str names to tensor maps or handle maps",
    "request_id": "a uint or a non-empty str",
    "frames": "an array of maps {op, args}",
}
LAYOUTS = ("bld", "bdl")
SESSION_KINDS = ("mamba", "ssd")
OUTPUTS = ("logits", "hidden")
WEIGHTS_DTYPES = ("f32", "bf16", "f16")

# The ops `frames` may call: those that advance a session's state, which a client that reopens
# a session from a saved state, or rolls one back to a snapshot, runs again.
FRAME_OPS = ("step", "scan", "ssd_scan", "model_step", "model_forward")

# alias -> canonical name; accepted by every op that has the canonical argument, so that a
# mamba_ssm call (selective_scan_fn, mamba_chunk_scan_combined) maps over one to one.
ALIASES = {"u": "x", "delta": "dt", "delta_bias": "dt_bias", "delta_softplus": "dt_softplus",
           "return_last_state": "return_state", "return_final_states": "return_state", "initial_states": "h0"}

# The operands every scan, step and backward takes.
_OPERANDS = {name: Arg("tensor", True) for name in ("x", "dt", "A", "B", "C")}

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
    "health": {},
    "info": {},
    # Drops the same connection's queued request `id` before it runs (served at once, never queued).
    "cancel": {"id": Arg("request_id", True)},
    "scan": {
        **_OPERANDS,
        **_DT_TRANSFORM,
        "h0": Arg("tensor"),
        "return_state": Arg("bool"),
        "layout": Arg("layout"),
        "cu_seqlens": Arg("tensor"),
        "session": Arg("str"),
    },
    "ssd_scan": {
        **_OPERANDS,
        **_DT_TRANSFORM,
        "dt_limit": Arg("limits"),
        "h0": Arg("tensor"),
        "return_state": Arg("bool"),
        "return_varlen_states": Arg("bool"),
        "cu_seqlens": Arg("tensor"),
        "seq_idx": Arg("tensor"),
        "chunk_size": Arg("size"),
        "session": Arg("str"),
    },
    # The forward's arguments (no session, no return_state) plus the gradient of y, dy, and
    # optionally that of the final state, dstate.
    "scan_backward": {
        "dy": Arg("tensor", True),
        **_OPERANDS,
        **_DT_TRANSFORM,
        "h0": Arg("tensor"),
        "dstate": Arg("tensor"),
        "layout": Arg("layout"),
        "cu_seqlens": Arg("tensor"),
    },
    "ssd_scan_backward": {
        "dy": Arg("tensor", True),
        **_OPERANDS,
        **_DT_TRANSFORM,
        "dt_limit": Arg("limits"),
        "h0": Arg("tensor"),
        "dstate": Arg("tensor"),
        "cu_seqlens": Arg("tensor"),
        "seq_idx": Arg("tensor"),
        "chunk_size": Arg("size"),
    },
    # return_state (here and on the model ops): the reply also carries the session's state
    # after this frame, as session_state gives it.
    "step": {
        "session": Arg("str", True),
        **_OPERANDS,
        **_DT_TRANSFORM,
        "dt_limit": Arg("limits"),
        "return_state": Arg("bool"),
    },
    # kind "mamba" (the default) takes dim and state (a size), "ssd" heads, headdim and state,
    # and either an initial state h0 or none (zero); a model's session takes model, and a saved
    # state (tensors) or none (checked further in). frames: calls run on the new session, in
    # order, before the reply.
    "session_open": {
        "kind": Arg("kind"),
        "batch": Arg("size", True),
        "dim": Arg("size"),
        "heads": Arg("size"),
        "headdim": Arg("size"),
        "state": Arg("size_or_tensors"),
        "h0": Arg("tensor"),
        "model": Arg("str"),
        "frames": Arg("frames"),
    },
    "session_close": {"session": Arg("str", True)},
    "session_state": {"session": Arg("str", True)},
    "session_snapshot": {"session": Arg("str", True)},
    # frames: calls run on the restored session, in order, before the reply (a rollback's
    # re-simulation in the same request).
    "session_restore": {"session": Arg("str", True), "snapshot": Arg("str", True), "frames": Arg("frames")},
    "session_fork": {"session": Arg("str", True)},
    "snapshot_free": {"snapshot": Arg("str", True)},
    # Either path (a checkpoint under --model-dir) or config and weights (checked further in).
    "model_load": {
        "path": Arg("str"),
        "config": Arg("map"),
        "weights": Arg("tensors"),
        "dtype": Arg("weights_dtype"),
        "name": Arg("str"),
    },
    "model_free": {"model": Arg("str", True)},
    # Exactly one of tokens and embeds (checked further in).
    "model_forward": {
        "session": Arg("str", True),
        "tokens": Arg("tensor"),
        "embeds": Arg("tensor"),
        "output": Arg("output"),
        "last_only": Arg("bool"),
        "return_state": Arg("bool"),
        # [batch] ints: the positions each row runs (checked further in).
        "lengths": Arg("tensor"),
    },
    "model_step": {
        "session": Arg("str", True),
        "tokens": Arg("tensor"),
        "embeds": Arg("tensor"),
        "output": Arg("output"),
        "return_state": Arg("bool"),
        # a snapshot of this connection's that takes the session's state before the frame
        "snapshot_into": Arg("str"),
    },
    "put": {"tensor": Arg("tensor_data", True)},
    "free": {"handle": Arg("str", True)},
    "stats": {},
    "shutdown": {},
}

# Each frame op's arguments: its own but the session (the request's is the frame's).
FRAME_ARGS = {op: {name: arg for name, arg in OPS[op].items() if name != "session"} for op in FRAME_OPS}

# Ops whose result names something the connection then owns, with the op (and its argument, the
# result's key) that frees it. A client frees what a request it gave up on made anyway (a late
# reply nobody reads would otherwise leave it held for the connection's life); the Python client
# reads this table, the Elixir client's `frees/2` mirrors it (a test compares them). An op that
# creates something belongs here.
FREED_BY = {
    "put": ("free", "handle"),
    "session_open": ("session_close", "session"),
    "session_fork": ("session_close", "session"),
    "session_snapshot": ("snapshot_free", "snapshot"),
    "model_load": ("model_free", "model"),
}
