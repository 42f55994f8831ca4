"""Builds the golden vectors and writes them next to this file:

    python -m protocol.vectors.generate

Each vector is NAME.frame (the exact framed bytes) and NAME.json (what they mean; SPEC.md §11).
Multipart messages (ZeroMQ only; SPEC.md §5) are in multipart/: their NAME.frame holds the
message's parts, body first, each framed as on a stream.
Requests are packed here by a deliberately separate, minimal msgpack writer playing the part
of a client (it can send binaries as msgpack str, as Msgpax does); replies are produced by this
package's encoders, as the server sends them. Values are small and exactly representable in
their dtype so that other-language clients can compare them exactly.
"""

from __future__ import annotations

import json
import random
import struct
import sys
from dataclasses import dataclass
from math import prod
from pathlib import Path

import msgpack

from protocol import (DEFAULT_MAX_FRAME_SIZE, OutTensor, encode_error, encode_frame,
                      encode_legacy_reply, encode_reply, frame_parts)

VECTORS_DIR = Path(__file__).resolve().parent
MULTIPART_DIR = VECTORS_DIR / "multipart"
_STRUCT_CODES = {"f32": "f", "f16": "e", "f64": "d", "i32": "i", "i64": "q", "u8": "B"}


@dataclass
class Binary:
    """Bytes holding `values` of `dtype`, little-endian; sent as msgpack bin, or as str when
    `as_str` (Msgpax's way)."""

    dtype: str
    values: list
    as_str: bool = False

    def to_bytes(self) -> bytes:
        if self.dtype == "bf16":
            # bfloat16 is the upper half of a binary32; the values are exactly representable.
            return b"".join(struct.pack("<f", v)[2:] for v in self.values)
        return struct.pack(f"<{len(self.values)}{_STRUCT_CODES[self.dtype]}", *self.values)

    def to_json(self) -> dict:
        return {"$bytes": {"format": "str" if self.as_str else "bin", "dtype": self.dtype,
                           "values": self.values}}


def values(dtype: str, count: int, seed: int) -> list:
    """`count` non-zero values exact in `dtype`: quarters in [-4, 4] for floats."""
    rng = random.Random(seed)
    if dtype in ("f32", "f16", "bf16", "f64"):
        return [rng.choice([-1, 1]) * rng.randint(1, 16) / 4 for _ in range(count)]
    if dtype == "u8":
        return [rng.randint(1, 255) for _ in range(count)]
    bound = 2**40 if dtype == "i64" else 2**20
    return [rng.choice([-1, 1]) * rng.randint(1, bound) for _ in range(count)]


def tensor(dtype: str, shape, seed: int, as_str: bool = False) -> dict:
    return {"dtype": dtype, "shape": list(shape),
            "data": Binary(dtype, values(dtype, prod(shape), seed), as_str)}


def out_tensor(t: dict) -> OutTensor:
    return OutTensor(t["dtype"], t["shape"], t["data"].to_bytes())


def out_tensors(value):
    """`value` with every tensor in it, in maps and arrays at any depth, an OutTensor: a result
    as a server hands it to the encoder."""
    if isinstance(value, dict):
        return out_tensor(value) if "dtype" in value else {k: out_tensors(v) for k, v in value.items()}
    if isinstance(value, list):
        return [out_tensors(v) for v in value]
    return value


def model_state(batch: int, layers: int, seed: int) -> dict:
    """A Mamba-2 model session's state by name (SPEC §6.4), with model_load_weights' layer
    sizes: per layer, its conv window [batch, 8 conv channels, d_conv 2] and its ssm state
    [batch, 2 heads, headdim 2, state 2]."""
    state = {}
    for layer in range(layers):
        state[f"layers.{layer}.conv"] = tensor("f32", (batch, 8, 2), seed + 2 * layer)
        state[f"layers.{layer}.ssm"] = tensor("f32", (batch, 2, 2, 2), seed + 2 * layer + 1)
    return state


# -- the client-side writer ----------------------------------------------------------------

def _header(n: int, fix: int | None, fix_max: int, codes: tuple[int | None, int, int]) -> bytes:
    """A msgpack length header: the fix form (`fix | n`) when there is one and n fits it, else
    the first of the 8/16/32-bit forms `codes` that fits."""
    if fix is not None and n <= fix_max:
        return bytes([fix | n])
    for code, size in zip(codes, (1, 2, 4)):
        if code is not None and n < 1 << (8 * size):
            return bytes([code]) + n.to_bytes(size, "big")
    raise ValueError(f"length {n} does not fit msgpack")


def pack_client(obj) -> bytes:
    if isinstance(obj, dict):
        return _header(len(obj), 0x80, 15, (None, 0xDE, 0xDF)) + b"".join(
            msgpack.packb(k) + pack_client(v) for k, v in obj.items())
    if isinstance(obj, list):
        return _header(len(obj), 0x90, 15, (None, 0xDC, 0xDD)) + b"".join(map(pack_client, obj))
    if isinstance(obj, Binary):
        data = obj.to_bytes()
        if obj.as_str:
            return _header(len(data), 0xA0, 31, (0xD9, 0xDA, 0xDB)) + data
        return _header(len(data), None, 0, (0xC4, 0xC5, 0xC6)) + data
    return msgpack.packb(obj)


def to_json(obj):
    if isinstance(obj, Binary):
        return obj.to_json()
    if isinstance(obj, dict):
        return {k: to_json(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [to_json(v) for v in obj]
    return obj


# -- the vectors ---------------------------------------------------------------------------

def _request(name, description, message, kind="request"):
    return name, encode_frame(pack_client(message)), {
        "name": name, "kind": kind, "description": description, "message": to_json(message)}


def _invalid(name, description, message, code, field, request_id, legacy=False):
    return name, encode_frame(pack_client(message)), {
        "name": name, "kind": "invalid", "description": description, "message": to_json(message),
        "error": {"code": code, "field": field, "request_id": request_id, "legacy": legacy}}


def _reply(name, description, parts, message, kind="reply"):
    return name, b"".join(frame_parts(parts)), {
        "name": name, "kind": kind, "description": description, "message": to_json(message)}


def _error(name, description, request_id, code, message, detail):
    return _reply(name, description, encode_error(request_id, code, message, detail),
                  {"v": 1, "id": request_id, "ok": False, "error": {"code": code, "message": message, "detail": detail}},
                  kind="error")


def _scan_args(dtype, batch, seq, dim, state, seed, layout="bld", as_str=False):
    bld = layout == "bld"
    x_shape = (batch, seq, dim) if bld else (batch, dim, seq)
    bc_shape = (batch, seq, state) if bld else (batch, state, seq)
    return {
        "x": tensor(dtype, x_shape, seed, as_str),
        "dt": tensor(dtype, x_shape, seed + 1, as_str),
        "A": tensor(dtype, (dim, state), seed + 2, as_str),
        "B": tensor(dtype, bc_shape, seed + 3, as_str),
        "C": tensor(dtype, bc_shape, seed + 4, as_str),
    }


def _ssd_args(dtype, batch, seq, heads, headdim, state, groups, seed):
    return {
        "x": tensor(dtype, (batch, seq, heads, headdim), seed),
        "dt": tensor(dtype, (batch, seq, heads), seed + 1),
        "A": tensor(dtype, (heads,), seed + 2),
        "B": tensor(dtype, (batch, seq, groups, state), seed + 3),
        "C": tensor(dtype, (batch, seq, groups, state), seed + 4),
    }


def build_vectors() -> list[tuple[str, bytes, dict]]:
    """(name, frame bytes, json document) for every vector, in a fixed order."""
    vectors = [
        _request("ping", "ping with an empty args map", {"v": 1, "id": 1, "op": "ping", "args": {}}),
        _request("info", "info with a str id and no args key", {"v": 1, "id": "info-1", "op": "info"}),
        _request("ping_deadline", "ping with a budget of one 60 FPS frame (deadline_us)",
                 {"v": 1, "id": "frame-42", "op": "ping", "args": {}, "deadline_us": 16_667}),
        _request("cancel", "cancel the queued request 7", {"v": 1, "id": 8, "op": "cancel", "args": {"id": 7}}),
    ]

    full = _scan_args("f32", 2, 3, 4, 2, seed=10)
    full.update(D=tensor("f32", (4,), 15), z=tensor("f32", (2, 3, 4), 16),
                dt_bias=tensor("f32", (4,), 17), dt_softplus=True, dt_min=0.25, dt_max=4.0,
                return_state=True, layout="bld")
    vectors.append(_request("scan_f32", "scan with every optional argument, f32, layout bld",
                            {"v": 1, "id": 2, "op": "scan", "args": full}))

    f16 = _scan_args("f16", 1, 5, 3, 2, seed=20)
    f16["u"], f16["delta"] = f16.pop("x"), f16.pop("dt")
    f16["delta_bias"] = tensor("f16", (3,), 25)
    vectors.append(_request("scan_f16_aliases", "scan in f16 using the aliases u, delta, delta_bias",
                            {"v": 1, "id": 3, "op": "scan", "args": f16}))
    vectors.append(_request("scan_bf16_bdl", "scan in bf16, layout bdl (x [batch, dim, seq])",
                            {"v": 1, "id": 4, "op": "scan",
                             "args": {**_scan_args("bf16", 2, 3, 2, 3, seed=30, layout="bdl"),
                                      "layout": "bdl"}}))
    vectors.append(_request("scan_f64", "scan in f64, required arguments only",
                            {"v": 1, "id": 5, "op": "scan", "args": _scan_args("f64", 1, 2, 3, 2, seed=40)}))
    vectors.append(_request("scan_str_data",
                            "scan whose tensor data are msgpack str (as Msgpax packs binaries)",
                            {"v": 1, "id": 6, "op": "scan",
                             "args": _scan_args("f32", 1, 4, 3, 2, seed=50, as_str=True)}))
    handle_args = _scan_args("f32", 1, 2, 3, 2, seed=60)
    handle_args["A"] = {"handle": "A-weights"}
    vectors.append(_request("scan_handle_ref", "scan with A given as a handle to a put tensor",
                            {"v": 1, "id": 7, "op": "scan", "args": handle_args}))
    vectors.append(_request("step_groups", "one step against a session, B/C with 2 groups",
                            {"v": 1, "id": 8, "op": "step",
                             "args": {"session": "s-1", "x": tensor("f32", (2, 4), 70),
                                      "dt": tensor("f32", (2, 4), 71), "A": tensor("f32", (4, 3), 72),
                                      "B": tensor("f32", (2, 2, 3), 73), "C": tensor("f32", (2, 2, 3), 74),
                                      "D": tensor("f32", (4,), 75), "dt_softplus": True}}))
    vectors.append(_request("session_open", "open a session for batch 2, dim 4, state 3",
                            {"v": 1, "id": 9, "op": "session_open",
                             "args": {"batch": 2, "dim": 4, "state": 3}}))
    vectors.append(_request("ssd_scan_f32", "Mamba-2 scan with every optional argument, f32, 2 groups",
                            {"v": 1, "id": 10, "op": "ssd_scan", "args": {
                                **_ssd_args("f32", 1, 4, 2, 2, 3, 2, seed=160),
                                "D": tensor("f32", (2,), 166), "z": tensor("f32", (1, 4, 2, 2), 167),
                                "dt_bias": tensor("f32", (2,), 168), "dt_softplus": True, "dt_min": 0.001,
                                "dt_max": 0.5, "h0": tensor("f32", (1, 2, 2, 3), 169), "return_state": True,
                                "chunk_size": 2}}))
    vectors.append(_request("ssd_scan_mamba_ssm_names",
                            "Mamba-2 scan named as mamba_ssm does: initial_states, dt_limit, return_last_state, "
                            "D per channel",
                            {"v": 1, "id": 11, "op": "ssd_scan", "args": {
                                **_ssd_args("f32", 1, 3, 2, 2, 2, 1, seed=170),
                                "D": tensor("f32", (2, 2), 176), "initial_states": tensor("f32", (1, 2, 2, 2), 177),
                                "dt_limit": [0.001, 0.1], "return_last_state": True}}))
    vectors.append(_request("scan_varlen", "scan of two sequences packed along seq (cu_seqlens i32)",
                            {"v": 1, "id": 12, "op": "scan", "args": {
                                **_scan_args("f32", 1, 5, 3, 2, seed=180),
                                "cu_seqlens": {"dtype": "i32", "shape": [3], "data": Binary("i32", [0, 2, 5])},
                                "h0": tensor("f32", (2, 3, 2), 185), "return_state": True}}))
    vectors.append(_request("ssd_scan_seq_idx",
                            "Mamba-2 scan of two packed sequences as mamba_ssm's varlen call names them: "
                            "seq_idx (i32 [1, seq]) beside cu_seqlens, return_varlen_states",
                            {"v": 1, "id": 38, "op": "ssd_scan", "args": {
                                **_ssd_args("f32", 1, 5, 2, 2, 2, 1, seed=190),
                                "seq_idx": {"dtype": "i32", "shape": [1, 5], "data": Binary("i32", [0, 0, 1, 1, 1])},
                                "cu_seqlens": {"dtype": "i32", "shape": [3], "data": Binary("i32", [0, 2, 5])},
                                "return_varlen_states": True}}))
    vectors.append(_request("session_open_ssd", "open a Mamba-2 session: batch 2, 2 heads x 2, state 3",
                            {"v": 1, "id": 13, "op": "session_open",
                             "args": {"kind": "ssd", "batch": 2, "heads": 2, "headdim": 2, "state": 3}}))
    vectors.append(_request("session_open_h0", "reopen a session elsewhere from its exported state: batch 2, "
                            "dim 2, state 3, starting at h0",
                            {"v": 1, "id": 27, "op": "session_open",
                             "args": {"batch": 2, "dim": 2, "state": 3, "h0": tensor("f32", (2, 2, 3), 220)}}))
    vectors.append(_request("session_open_frames", "reopen a session from its exported state and run the frame "
                            "answered since in the same request: batch 1, dim 2, state 3",
                            {"v": 1, "id": 51, "op": "session_open",
                             "args": {"batch": 1, "dim": 2, "state": 3, "h0": tensor("f32", (1, 2, 3), 230),
                                      "frames": [{"op": "step",
                                                  "args": {"x": tensor("f32", (1, 2), 231),
                                                           "dt": tensor("f32", (1, 2), 232),
                                                           "A": tensor("f32", (2, 3), 233),
                                                           "B": tensor("f32", (1, 3), 234),
                                                           "C": tensor("f32", (1, 3), 235)}}]}}))
    vectors.append(_request("step_ssd", "one step against a Mamba-2 session",
                            {"v": 1, "id": 14, "op": "step",
                             "args": {"session": "s-2", "x": tensor("f32", (2, 2, 2), 190),
                                      "dt": tensor("f32", (2, 2), 191), "A": tensor("f32", (2,), 192),
                                      "B": tensor("f32", (2, 1, 3), 193), "C": tensor("f32", (2, 1, 3), 194),
                                      "D": tensor("f32", (2,), 195), "dt_softplus": True}}))
    vectors.append(_request("model_load_path", "load a checkpoint under --model-dir, weights in bf16",
                            {"v": 1, "id": 15, "op": "model_load",
                             "args": {"path": "exphil/agent-v3", "dtype": "bf16", "name": "agent"}}))
    vectors.append(_request("model_load_weights", "load a Mamba-2 backbone the client holds (one layer, d_model 2)",
                            {"v": 1, "id": 16, "op": "model_load",
                             "args": {"config": {"arch": "mamba2", "d_model": 2, "n_layer": 1, "d_state": 2,
                                                 "d_conv": 2, "expand": 2, "headdim": 2, "ngroups": 1},
                                      "weights": {"layers.0.norm.weight": tensor("f32", (2,), 196),
                                                  "layers.0.mixer.in_proj.weight": tensor("f32", (14, 2), 197),
                                                  "layers.0.mixer.conv1d.weight": tensor("f32", (8, 1, 2), 198),
                                                  "layers.0.mixer.conv1d.bias": tensor("f32", (8,), 199),
                                                  "layers.0.mixer.dt_bias": tensor("f32", (2,), 200),
                                                  "layers.0.mixer.A_log": tensor("f32", (2,), 201),
                                                  "layers.0.mixer.D": tensor("f32", (2,), 202),
                                                  "layers.0.mixer.norm.weight": tensor("f32", (4,), 203),
                                                  "layers.0.mixer.out_proj.weight": tensor("f32", (2, 4), 204),
                                                  "norm_f.weight": {"handle": "h-norm"}}}}))
    vectors.append(_request("session_open_model", "open a session of a model: batch 2",
                            {"v": 1, "id": 17, "op": "session_open", "args": {"model": "m-1", "batch": 2}}))
    vectors.append(_request("model_forward_tokens", "prefill a model session with 3 tokens a row, last logits only",
                            {"v": 1, "id": 18, "op": "model_forward",
                             "args": {"session": "s-3", "tokens": {"dtype": "i64", "shape": [2, 3],
                                                                   "data": Binary("i64", [5, 1, 4, 1, 5, 9])},
                                      "last_only": True}}))
    vectors.append(_request("model_forward_lengths", "prefill a model session's rows with windows of their own "
                            "lengths (3 and 1 of 3 tokens), each row's last logits",
                            {"v": 1, "id": 52, "op": "model_forward",
                             "args": {"session": "s-3", "tokens": {"dtype": "i64", "shape": [2, 3],
                                                                   "data": Binary("i64", [5, 1, 4, 2, 6, 0])},
                                      "lengths": {"dtype": "i32", "shape": [2], "data": Binary("i32", [3, 1])},
                                      "last_only": True}}))
    vectors.append(_request("model_step_embeds", "one frame of embeddings through a model, hidden states out",
                            {"v": 1, "id": 19, "op": "model_step",
                             "args": {"session": "s-3", "embeds": tensor("f32", (2, 2), 205), "output": "hidden"}}))
    vectors.append(_request("model_step_return_state",
                            "one frame of tokens through a model, the session's state after it in the reply "
                            "(a checkpoint without a session_state round trip)",
                            {"v": 1, "id": 28, "op": "model_step",
                             "args": {"session": "s-3", "tokens": {"dtype": "i32", "shape": [2],
                                                                   "data": Binary("i32", [3, 7])},
                                      "return_state": True}}))
    vectors.append(_request("model_step_snapshot_into",
                            "one frame of embeddings through a model, the session's state before it copied into "
                            "snapshot p-1 (a rollback ring kept without requests of its own)",
                            {"v": 1, "id": 54, "op": "model_step",
                             "args": {"session": "s-3", "embeds": tensor("f32", (2, 2), 206),
                                      "snapshot_into": "p-1"}}))
    vectors.append(_request("session_restore", "roll a session back to a snapshot",
                            {"v": 1, "id": 24, "op": "session_restore", "args": {"session": "s-3", "snapshot": "p-1"}}))
    vectors.append(_request("session_restore_frames", "roll a model session back to a snapshot and re-simulate "
                            "the two frames since in the same request, the last one's logits",
                            {"v": 1, "id": 53, "op": "session_restore",
                             "args": {"session": "s-3", "snapshot": "p-1",
                                      "frames": [{"op": "model_forward",
                                                  "args": {"tokens": {"dtype": "i32", "shape": [2, 2],
                                                                      "data": Binary("i32", [3, 7, 2, 5])},
                                                           "last_only": True}}]}}))
    vectors.append(_request("session_restore_frames_snapshot_into", "roll a model session back to a snapshot "
                            "and re-simulate two frames, each copying the state before it into a snapshot of a "
                            "rollback ring",
                            {"v": 1, "id": 55, "op": "session_restore",
                             "args": {"session": "s-3", "snapshot": "p-1",
                                      "frames": [{"op": "model_step",
                                                  "args": {"tokens": {"dtype": "i32", "shape": [1],
                                                                      "data": Binary("i32", [token])},
                                                           "snapshot_into": into}}
                                                 for token, into in ((4, "p-2"), (9, "p-3"))]}}))
    vectors.append(_request("scan_backward_f32", "gradients of a scan with D, dt_bias, softplus, h0 and dstate",
                            {"v": 1, "id": 25, "op": "scan_backward", "args": {
                                "dy": tensor("f32", (1, 3, 2), 190), **_scan_args("f32", 1, 3, 2, 2, seed=191),
                                "D": tensor("f32", (2,), 197), "dt_bias": tensor("f32", (2,), 198),
                                "dt_softplus": True, "h0": tensor("f32", (1, 2, 2), 199),
                                "dstate": tensor("f32", (1, 2, 2), 200)}}))
    vectors.append(_request("ssd_scan_backward_f32", "gradients of a Mamba-2 scan with z and dt_limit",
                            {"v": 1, "id": 26, "op": "ssd_scan_backward", "args": {
                                "dy": tensor("f32", (1, 3, 2, 2), 210), **_ssd_args("f32", 1, 3, 2, 2, 2, 1, seed=211),
                                "z": tensor("f32", (1, 3, 2, 2), 217), "dt_limit": [0.001, 0.1]}}))
    for i, (dtype, shape) in enumerate((("i32", (3, 5)), ("i64", (7,)), ("u8", (2, 2, 3)))):
        vectors.append(_request(f"put_{dtype}", f"put an {dtype} tensor",
                                {"v": 1, "id": 20 + i, "op": "put",
                                 "args": {"tensor": tensor(dtype, shape, 80 + i)}}))

    y, state = tensor("f32", (2, 3, 4), 90), tensor("f32", (2, 4, 2), 91)
    # A scan reply's timing ends with batch_rows, a count, not microseconds (SPEC §8).
    timing = {"decode_us": 14, "queue_us": 2, "h2d_us": 0, "kernel_us": 153, "d2h_us": 0,
              "encode_us": 4, "server_us": 181, "batch_rows": 2}
    vectors.append(_reply("reply_scan", "ok reply to scan_f32 (return_state): y and state",
                          encode_reply(2, {"y": out_tensor(y), "state": out_tensor(state)}, timing),
                          {"v": 1, "id": 2, "ok": True, "result": {"y": y, "state": state},
                           "timing": timing}))
    ping_timing = {"decode_us": 3, "server_us": 9}
    vectors.append(_reply("reply_ping", "ok reply to ping",
                          encode_reply(1, {"pong": True}, ping_timing),
                          {"v": 1, "id": 1, "ok": True, "result": {"pong": True}, "timing": ping_timing}))
    detail = {"field": "args.B.shape", "expected": "[2, 3, 2] ([batch, seq, state])", "got": "[2, 4, 2]"}
    message = "args.B.shape: expected [2, 3, 2] ([batch, seq, state]), got [2, 4, 2]"
    vectors.append(_error("reply_error", "error reply with a detail map", 2, "shape_mismatch", message, detail))
    too_large = {"length": DEFAULT_MAX_FRAME_SIZE + 1, "limit": DEFAULT_MAX_FRAME_SIZE}
    message = f"frame of {too_large['length']} bytes exceeds the limit of {too_large['limit']} bytes"
    vectors.append(_error("reply_error_no_id", "error reply to a frame whose id could not be read", None,
                          "frame_too_large", message, too_large))

    # A model_step's logits (vocab 8) and, with return_state, the state in a map of its own.
    step_result = {"logits": tensor("f32", (2, 8), 240), "state": model_state(2, 1, 241)}
    step_timing = {"decode_us": 6, "queue_us": 1, "h2d_us": 2, "kernel_us": 88, "d2h_us": 2, "encode_us": 3,
                   "server_us": 104}
    vectors.append(_reply("reply_model_step_return_state",
                          "ok reply to model_step_return_state: the logits, and the session's state by name "
                          "in a map of its own (tensors nested in the result)",
                          encode_reply(28, out_tensors(step_result), step_timing),
                          {"v": 1, "id": 28, "ok": True, "result": step_result, "timing": step_timing}))

    cancelled = {"cancelled_by": 8}
    message = "request 7 was cancelled by request 8 before it ran"
    vectors.append(_error("reply_error_cancelled", "the answer to request 7, which the cancel dropped", 7,
                          "cancelled", message, cancelled))

    batch, seq, hidden, state = 2, 3, 4, 2
    legacy = {"A": Binary("f32", values("f32", hidden * state, 102), True),
              "B": Binary("f32", values("f32", batch * seq * state, 103), True),
              "C": Binary("f32", values("f32", batch * seq * state, 104), True),
              "batch": batch,
              "dt": Binary("f32", values("f32", batch * seq * hidden, 101), True),
              "hidden": hidden, "op": "scan", "seq_len": seq, "state": state,
              "x": Binary("f32", values("f32", batch * seq * hidden, 100), True)}
    vectors.append(_request("legacy_scan",
                            "ExPhil PyTorchPort scan: dims as keys, f32 binaries as msgpack str, "
                            "keys in Msgpax (atom) order", legacy, kind="legacy_request"))
    shapes = {"x": [1, 2, 3], "dt": [1, 2, 3], "A": [3, 2], "B": [1, 2, 2], "C": [1, 2, 2]}
    data = {name: Binary("f32", values("f32", prod(shape), 110 + i), True)
            for i, (name, shape) in enumerate(shapes.items())}
    legacy_shapes = {"A": data["A"], "A_shape": shapes["A"], "B": data["B"], "B_shape": shapes["B"],
                     "C": data["C"], "C_shape": shapes["C"], "dt": data["dt"], "dt_shape": shapes["dt"],
                     "op": "scan", "x": data["x"], "x_shape": shapes["x"]}
    vectors.append(_request("legacy_scan_shapes", "ExPhil Triton variant: x_shape..C_shape keys",
                            legacy_shapes, kind="legacy_request"))
    vectors.append(_request("legacy_ping", "ExPhil ping", {"op": "ping"}, kind="legacy_request"))
    result = Binary("f32", values("f32", batch * seq * hidden, 120))
    scan_reply = {"status": "ok", "result": OutTensor("f32", (batch, seq, hidden), result.to_bytes())}
    # An ok legacy reply's timing comes last (SPEC §9), a scan's with batch_rows as a v1 one's.
    legacy_timing = {"decode_us": 21, "queue_us": 1, "h2d_us": 0, "kernel_us": 310, "d2h_us": 0,
                     "encode_us": 3, "server_us": 342, "batch_rows": 2}
    vectors.append(_reply("legacy_reply_scan", "ExPhil scan reply, timing last",
                          encode_legacy_reply(scan_reply, timing=legacy_timing),
                          {"status": "ok", "result": result, "shape": [batch, seq, hidden], "timing": legacy_timing},
                          kind="legacy_reply"))
    ping_reply = {"status": "ok", "message": "pong", "device": "cpu", "cuda_available": False}
    legacy_ping_timing = {"decode_us": 2, "server_us": 6}
    vectors.append(_reply("legacy_reply_ping", "ExPhil ping reply (extra keys after status, timing last)",
                          encode_legacy_reply(ping_reply, timing=legacy_ping_timing),
                          {**ping_reply, "timing": legacy_ping_timing}, kind="legacy_reply"))
    error_reply = {"status": "error", "message": "x: expected 96 bytes (f32 [2, 3, 4]), got 92 bytes"}
    vectors.append(_reply("legacy_reply_error", "ExPhil error reply", encode_legacy_reply(error_reply),
                          error_reply, kind="legacy_reply"))

    lying = {"dtype": "f32", "shape": [2, 3], "data": Binary("f32", values("f32", 5, 130))}
    vectors.append(_invalid("invalid_lying_shape", "shape [2, 3] f32 announces 24 bytes, data has 20",
                            {"v": 1, "id": 30, "op": "put", "args": {"tensor": lying}},
                            "tensor_size_mismatch", "args.tensor.data", 30))
    unknown = {"dtype": "f8", "shape": [2], "data": Binary("u8", [1, 2])}
    vectors.append(_invalid("invalid_unknown_dtype", "dtype code f8 does not exist",
                            {"v": 1, "id": 31, "op": "put", "args": {"tensor": unknown}},
                            "unknown_dtype", "args.tensor.dtype", 31))
    vectors.append(_invalid("invalid_unknown_op", "op misspelt",
                            {"v": 1, "id": 32, "op": "scna", "args": {}}, "unknown_op", "op", 32))
    missing = _scan_args("f32", 1, 2, 3, 2, seed=140)
    del missing["C"]
    vectors.append(_invalid("invalid_missing_argument", "scan without C",
                            {"v": 1, "id": 33, "op": "scan", "args": missing},
                            "missing_argument", "args.C", 33))
    vectors.append(_invalid("invalid_session_kind", "session_open of a kind that does not exist",
                            {"v": 1, "id": 35, "op": "session_open",
                             "args": {"kind": "mamba3", "batch": 1, "dim": 2, "state": 2}},
                            "invalid_argument", "args.kind", 35))
    vectors.append(_invalid("invalid_model_output", "model_step asking for an output that does not exist",
                            {"v": 1, "id": 36, "op": "model_step",
                             "args": {"session": "s-3", "tokens": {"dtype": "i64", "shape": [1], "data": Binary("i64", [2])},
                                      "output": "probabilities"}},
                            "invalid_argument", "args.output", 36))
    vectors.append(_invalid("invalid_weights_entry", "model_load whose weights map holds a list, not a tensor",
                            {"v": 1, "id": 37, "op": "model_load",
                             "args": {"config": {"arch": "mamba"}, "weights": {"norm_f.weight": [1.0, 2.0]}}},
                            "invalid_argument", "args.weights.norm_f.weight", 37))
    vectors.append(_invalid("invalid_unsupported_version", "protocol version 2",
                            {"v": 2, "id": 34, "op": "ping", "args": {}}, "unsupported_version", "v", 34))
    vectors.append(_invalid("invalid_not_a_map", "the body is a msgpack array, not a map",
                            [1, 2, 3], "decode_error", None, None))
    short = dict(legacy, x=Binary("f32", values("f32", batch * seq * hidden - 1, 150), True))
    vectors.append(_invalid("invalid_legacy_size", "ExPhil scan whose x is one f32 short",
                            short, "tensor_size_mismatch", "x", None, legacy=True))
    length = DEFAULT_MAX_FRAME_SIZE + 1
    vectors.append(("invalid_frame_too_large", length.to_bytes(4, "big"), {
        "name": "invalid_frame_too_large", "kind": "invalid_frame",
        "description": "a header announcing one byte more than the default 256 MiB limit (no body follows)",
        "frame_length": length,
        "error": {"code": "frame_too_large", "field": None, "request_id": None, "legacy": False}}))
    return vectors


def _multipart(name, description, body: bytes, buffers: list[Binary], message, kind) -> tuple[str, bytes, dict]:
    parts = [body, *(b.to_bytes() for b in buffers)]
    return name, b"".join(encode_frame(part) for part in parts), {
        "name": name, "kind": kind, "description": description, "message": to_json(message),
        "buffers": [to_json(b) for b in buffers]}


def buffer_tensor(dtype: str, shape, seed: int, buffers: list[Binary]) -> dict:
    """A tensor map whose data travels as the next raw buffer of a multipart message."""
    buffers.append(Binary(dtype, values(dtype, prod(shape), seed)))
    return {"dtype": dtype, "shape": list(shape), "buf": len(buffers) - 1}


def with_buffers(value, buffers: list[Binary]):
    """`value` as a multipart body describes it: every tensor in it, at any depth, as
    {"dtype", "shape", "buf": i}, its data appended to `buffers` as raw buffer i, in the order
    the tensors appear (the encoder's order, SPEC §5)."""
    if isinstance(value, dict) and "dtype" in value:
        buffers.append(value["data"])
        return {"dtype": value["dtype"], "shape": value["shape"], "buf": len(buffers) - 1}
    if isinstance(value, dict):
        return {k: with_buffers(v, buffers) for k, v in value.items()}
    if isinstance(value, list):
        return [with_buffers(v, buffers) for v in value]
    return value


def _multipart_reply(name, description, request_id, result, timing) -> tuple[str, bytes, dict]:
    """The multipart reply the encoder writes for `result` (tensors nested at any depth)."""
    buffers: list[Binary] = []
    message = {"v": 1, "id": request_id, "ok": True, "result": with_buffers(result, buffers), "timing": timing}
    body = b"".join(encode_reply(request_id, out_tensors(result), timing, buffers=[]))
    return _multipart(name, description, body, buffers, message, "multipart_reply")


def build_multipart_vectors() -> list[tuple[str, bytes, dict]]:
    """(name, parts framed one after another, json document) for the multipart form."""
    buffers: list[Binary] = []
    args = {"x": buffer_tensor("f32", (2, 3, 4), 200, buffers),
            "dt": buffer_tensor("f32", (2, 3, 4), 201, buffers),
            "A": tensor("f32", (4, 2), 202),  # inline and raw buffers mix freely
            "B": buffer_tensor("f32", (2, 3, 2), 203, buffers),
            "C": buffer_tensor("f32", (2, 3, 2), 204, buffers),
            "return_state": True}
    request = {"v": 1, "id": 50, "op": "scan", "args": args}
    vectors = [_multipart("multipart_scan", "scan whose x, dt, B, C are raw buffers 0-3 (A inline)",
                          pack_client(request), buffers, request, "multipart_request")]
    y, state = Binary("f32", values("f32", 24, 210)), Binary("f32", values("f32", 16, 211))
    timing = {"decode_us": 9, "kernel_us": 40, "server_us": 71, "batch_rows": 2}
    reply_buffers: list = []
    body = b"".join(encode_reply(50, {"y": OutTensor("f32", (2, 3, 4), y.to_bytes()),
                                      "state": OutTensor("f32", (2, 4, 2), state.to_bytes())},
                                 timing, buffers=reply_buffers))
    reply = {"v": 1, "id": 50, "ok": True,
             "result": {"y": {"dtype": "f32", "shape": [2, 3, 4], "buf": 0},
                        "state": {"dtype": "f32", "shape": [2, 4, 2], "buf": 1}}, "timing": timing}
    vectors.append(_multipart("multipart_reply_scan", "the reply to multipart_scan: y and state as raw buffers",
                              body, [y, state], reply, "multipart_reply"))

    # Every tensor of a reply's result is a raw buffer, however deep it lies (SPEC §5).
    step_timing = {"decode_us": 5, "kernel_us": 61, "server_us": 80}
    vectors.append(_multipart_reply("multipart_reply_model_step_state",
                                    "the reply to a multipart model_step with return_state on a two-layer model: "
                                    "the logits, then each layer's conv and ssm state inside the state map, raw "
                                    "buffers 0-4", 60, {"logits": tensor("f32", (1, 8), 250),
                                                        "state": model_state(1, 2, 251)}, step_timing))
    frames = [{"logits": tensor("f32", (1, 8), 260 + 3 * i), "state": model_state(1, 1, 261 + 3 * i)}
              for i in range(2)]
    vectors.append(_multipart_reply("multipart_reply_session_restore_frames",
                                    "the reply to a multipart session_restore with two model_step frames, each "
                                    "with return_state: each frame's logits and state inside the frames array, "
                                    "raw buffers 0-5", 61, {"restored": True, "frames": frames}, step_timing))
    return vectors


def render_json(doc: dict) -> bytes:
    return (json.dumps(doc, indent=1) + "\n").encode()


def write(directory: Path, vectors: list[tuple[str, bytes, dict]]) -> None:
    directory.mkdir(exist_ok=True)
    names = {name for name, _, _ in vectors}
    for path in directory.iterdir():
        if path.suffix in (".frame", ".json") and path.stem not in names:
            path.unlink()
    for name, frame, doc in vectors:
        (directory / f"{name}.frame").write_bytes(frame)
        (directory / f"{name}.json").write_bytes(render_json(doc))
    print(f"wrote {len(vectors)} vectors to {directory}", file=sys.stderr)


def main() -> None:
    write(VECTORS_DIR, build_vectors())
    write(MULTIPART_DIR, build_multipart_vectors())


if __name__ == "__main__":
    main()
