"""Long-run stability of one server under mixed load on every lane: the bridge is a long-lived
process, so what it holds must not grow with the requests and connections it has served, and
no request may go unanswered, be answered twice or get another's reply.

One server (`python -m bridge --stdio --unix PATH --zmq ipc://PATH`, held by a PortClient, with
a small `--max-frame-size`, a `--model-dir` holding a tiny checkpoint and `--metrics-port`) is
driven for `--rounds` rounds or `--minutes` minutes. Each round runs at once, in threads:

  * on each lane (stdio: the PortClient; unix and ZeroMQ: one long-lived connection each), the
    same script (`LaneScript`):
      - a Mamba-1 session (put A, open, a 60-frame prefill, `--steps` steps, its state read),
        snapshotted after the prefill, restored and stepped again, forked, closed;
      - a stateless scan with every option, and a burst of 8 scans of different inputs sent
        before any reply is read;
      - Mamba-2: an `ssd_scan` with every option, and an ssd session prefilled and stepped;
      - two tiny models (Mamba-1 loaded from weights sent with the request, one of them a
        handle; Mamba-2 from the checkpoint under --model-dir): a session prefilled by
        `model_forward` and stepped by `model_step`, snapshotted, restored and stepped again
        (once with a step into the snapshot, restored to that), forked; `model_free` refused
        while a session is open, then done;
      - put and free of a tensor of every wire dtype, a scan with handle arguments;
      - session churn: 16 sessions opened and closed, all requests sent before any reply read;
      - malformed frames of every kind the protocol names (`stream_cases`, `zmq_cases`): decode
        errors, bad envelopes, unknown ops, bad arguments and tensors, unknown ids, a refused
        checkpoint and path, a limit, an oversized frame, legacy requests; on ZeroMQ also
        stray, missing or mis-sized raw buffers and a body with buffers over the frame limit.
        Each is checked for its error code and reply id (nil where the id could not be read),
        and the connection serves on;
  * a ZeroMQ peer holding a session sends a single frame over the limit, which ZeroMQ itself
    refuses: the server drops the peer, its session goes with it, and the peer, reconnected,
    is served as a new one;
  * connection churn: `--churn` unix connections and as many ZeroMQ peers, each opening a
    session and a handle (every fifth a model, a model session and a snapshot too) and going
    away without closing or freeing anything;
  * killed clients: `--kills` client processes per round on unix and on ZeroMQ each, which open
    sessions, a handle, a model and a snapshot, send a burst of requests (the unix one then
    half a frame) and are sent SIGKILL once the first of the burst is answered. Each reports
    every reply as it comes, so the result counts the requests it had sent whose replies it
    had not received when it died.

Every request of the lane scripts carries its own id and its reply must carry it; replies with
id nil (or legacy replies, which have none) must be exactly those the malformed frames provoke.
Results are checked where they can be: the first of each (scans, session states after their
steps, model outputs and states) against an independent reference where there is one (the
kernels' reference backend; a model's steps against its own forward over the same tokens),
every later one, on every lane and round, against that first one bit for bit (the kernels and
the model runtime are deterministic for a given batch). A restored session stepped again must
repeat its steps bit for bit, and a fork must hold its origin's state.

After each round the bench waits (at most RELEASE_TIMEOUT_S) until the server holds nothing:
the gauges of `stats` (sessions, pool bytes, model and snapshot bytes, handles, handle bytes)
and of its metrics endpoint (models, snapshots) back to 0, since every connection but the
long-lived ones has gone and those closed and freed what they opened. Then it records the
server's resident memory (VmRSS, and the peak VmHWM), open file descriptors and threads (from
/proc). The first third of the rounds (of the minutes, with `--minutes`) is warm-up; from its
end, every round's resident memory must stay within `--rss-bound-kib` of the warm-up's last
round, and its descriptors and threads at most the warm-up's. The bench stops with an error at
the first broken rule, so a written result means every round kept every one.

    python -m bench.soak [--rounds 30 | --minutes 60] [--steps 100] [--churn 20] [--kills 1]
                         [--rss-bound-kib 16384] [--json bench/results/soak_hour.json]
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import itertools
import json
import os
import re
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

import msgpack
import numpy as np

from bridge.bench.cases import DIM, DT_CLAMP, EXPHIL_SEQ, STATE, Case
from bridge.bench.lanes import TRANSPORTS, log_tail
from bridge.bench.machine import output_path, positive_count, write_results
from bridge.client import BridgeError, PortClient, ServerExited, UnixClient, ZmqClient, server_env

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The long-lived plain session's batch: a few agents of the game loop's layer (DIM x STATE).
ROWS = 4
# The server's --max-frame-size: above the largest request here (the 60-frame prefill of ROWS
# rows, about 1 MB), small enough that an oversized frame costs little to send every round.
MAX_FRAME_SIZE = 2 << 20
# How long closed connections' sessions, handles, models and snapshots may take to be freed
# (a ZeroMQ peer's departure reaches the server asynchronously).
RELEASE_TIMEOUT_S = 10.0
REPLY_TIMEOUT_S = 60.0
# Scans of the burst sent before any reply is read, each of its own inputs.
BURST_SCANS = 8
CHURN_SESSIONS = 16
SSD_STEPS = 8
MODEL_PREFILL = 12
MODEL_STEPS = 8
MODEL_BATCH = 2
# Every how many churned connections one also loads a model, opens a session of it and
# snapshots it.
CHURN_MODEL_EVERY = 5
# A killed client's burst: requests sent without waiting, the last 10 scans of the prefill
# window's size, so that the server is still busy with them when the kill comes.
KILL_BURST = 60
# The rule after warm-up, by default: resident memory within this much of the warm-up's end.
RSS_BOUND_KIB = 16384


class Broken(RuntimeError):
    """A rule of the soak broken: a reply missing, misrouted or wrong, something left held."""


# --- inputs and references --------------------------------------------------------------------

def small_scan_inputs(seed: int) -> dict:
    """A stateless Mamba-1 scan with every option: batch 2, seq 16, dim 64, state 8."""
    rng = np.random.default_rng(seed)
    b, seq, dim, n = 2, 16, 64, 8
    return {
        "x": rng.standard_normal((b, seq, dim), dtype=np.float32),
        "dt": rng.uniform(-3.0, 0.0, (b, seq, dim)).astype(np.float32),
        "A": -rng.uniform(0.5, 4.0, (dim, n)).astype(np.float32),
        "B": rng.standard_normal((b, seq, n), dtype=np.float32),
        "C": rng.standard_normal((b, seq, n), dtype=np.float32),
        "D": rng.standard_normal(dim, dtype=np.float32),
        "z": rng.standard_normal((b, seq, dim), dtype=np.float32),
        "dt_bias": rng.uniform(-1.0, 0.5, dim).astype(np.float32),
        "dt_softplus": True, "return_state": True,
    }


SSD = {"batch": 2, "seq": 32, "heads": 4, "headdim": 16, "groups": 2, "state": 16}


def ssd_inputs(seed: int, seq: int | None = SSD["seq"], options: bool = True) -> dict:
    """Mamba-2 inputs of SSD's shape: a scan of `seq` frames, or one step's (seq None)."""
    rng = np.random.default_rng(seed)
    s = SSD
    lead = (s["batch"],) if seq is None else (s["batch"], seq)
    inputs = {
        "x": rng.standard_normal((*lead, s["heads"], s["headdim"]), dtype=np.float32),
        "dt": rng.uniform(DT_CLAMP["dt_min"], DT_CLAMP["dt_max"], (*lead, s["heads"])).astype(np.float32),
        "A": -rng.uniform(0.5, 4.0, s["heads"]).astype(np.float32),
        "B": rng.standard_normal((*lead, s["groups"], s["state"]), dtype=np.float32),
        "C": rng.standard_normal((*lead, s["groups"], s["state"]), dtype=np.float32),
    }
    if options:
        inputs.update({"D": rng.standard_normal(s["heads"], dtype=np.float32),
                       "z": rng.standard_normal((*lead, s["heads"], s["headdim"]), dtype=np.float32),
                       "dt_bias": rng.uniform(-1.0, 0.5, s["heads"]).astype(np.float32),
                       "dt_softplus": True, "return_state": True})
    return inputs


def _torch_args(inputs: dict) -> dict:
    import torch

    return {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in inputs.items()}


def reference_scan(inputs: dict, ssd: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(y, state) of the kernels' reference backend, in this process."""
    import scan_kernels

    scan = scan_kernels.ssd_scan if ssd else scan_kernels.selective_scan
    y, state = scan(**{**_torch_args(inputs), "return_state": True}, backend="reference")
    return y.numpy(), state.numpy()


def reference_steps(state: np.ndarray, frames: list[dict], A: np.ndarray, ssd: bool = False) -> np.ndarray:
    """The state after stepping `state` through `frames` with the kernels' reference backend."""
    import torch

    import scan_kernels

    update = scan_kernels.ssd_state_update if ssd else scan_kernels.selective_state_update
    h = torch.from_numpy(np.array(state))
    for f in frames:
        update(h, **_torch_args({**f, "A": A}), **DT_CLAMP, backend="reference")
    return h.numpy()


# fp32 against the reference, compared in float64: |actual - expected| <= ATOL + RTOL |expected|.
RTOL, ATOL = 3e-4, 1e-3


def check_close(actual, expected, what: str, rtol: float = RTOL, atol: float = ATOL) -> None:
    a, e = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    if a.shape != e.shape:
        raise Broken(f"{what}: shape {a.shape}, the reference's {e.shape}")
    excess = np.abs(a - e) - (atol + rtol * np.abs(e))
    if not np.all(excess <= 0):  # NaN fails too
        raise Broken(f"{what}: differs from the reference by up to {np.nanmax(np.abs(a - e)):.3g} "
                     f"(allowed {atol} + {rtol} x |reference|)")


class References:
    """The first result seen under each name, checked against an independent reference where
    one is given; every later result under that name must equal it bit for bit."""

    def __init__(self):
        self._first: dict[str, np.ndarray] = {}
        self._lock = threading.Lock()
        self.compared = 0

    def check(self, name: str, value, what: str, expected=None, rtol: float = RTOL, atol: float = ATOL) -> None:
        value = np.array(value)
        with self._lock:
            first = self._first.get(name)
            if first is None:
                if expected is not None:
                    check_close(value, expected, what, rtol, atol)
                self._first[name] = value
                return
            self.compared += 1
        same_bits(value, first, f"{what}: differs from the first {name}")


def same_bits(value, first, what: str) -> None:
    value, first = np.asarray(value), np.asarray(first)
    if value.dtype != first.dtype or value.shape != first.shape or value.tobytes() != first.tobytes():
        diff = (np.abs(value.astype(np.float64) - first.astype(np.float64)).max()
                if value.shape == first.shape else "a different shape")
        raise Broken(f"{what} (max |diff| {diff})")


# --- tiny models --------------------------------------------------------------------------------

VOCAB = 48
MODEL_CONFIGS = {
    "mamba": {"arch": "mamba", "d_model": 32, "n_layer": 2, "d_state": 8, "expand": 2, "d_conv": 4,
              "vocab_size": VOCAB, "rms_norm": True},
    "mamba2": {"arch": "mamba2", "d_model": 32, "n_layer": 2, "d_state": 16, "expand": 2, "d_conv": 4,
               "headdim": 16, "ngroups": 1, "chunk_size": 16, "vocab_size": VOCAB, "rms_norm": True},
}
# Where the Mamba-2 model's checkpoint lies, under the server's --model-dir.
CHECKPOINT = "tiny-mamba2"


def model_weights(arch: str, seed: int = 7) -> dict[str, np.ndarray]:
    """Random weights of the tiny model `arch` by this server's names, in their working ranges
    (A_log and the dt biases as a trained model's, norms near 1)."""
    from bridge.models.config import parse_config
    from bridge.models.weights import expected_shapes

    rng = np.random.default_rng(seed)
    weights = {}
    for name, shape in sorted(expected_shapes(parse_config(MODEL_CONFIGS[arch])).items()):
        if name.endswith("A_log"):
            w = rng.uniform(-1.0, 1.5, shape)
        elif name.endswith(("dt_bias", "dt_proj.bias")):
            w = rng.uniform(-3.0, 0.0, shape)
        elif name.endswith("norm.weight"):
            w = 1.0 + 0.1 * rng.standard_normal(shape)
        else:
            w = rng.standard_normal(shape) * (0.3 if len(shape) > 1 else 0.5)
        weights[name] = w.astype(np.float32)
    return weights


def write_checkpoint(directory: str) -> None:
    """The Mamba-2 tiny model as a checkpoint directory (config.json, model.safetensors)."""
    from safetensors.numpy import save_file

    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(MODEL_CONFIGS["mamba2"], f)
    save_file(model_weights("mamba2"), os.path.join(directory, "model.safetensors"))


def model_tokens() -> np.ndarray:
    return np.random.default_rng(11).integers(0, VOCAB, (MODEL_BATCH, MODEL_PREFILL + MODEL_STEPS)).astype(np.int32)


# --- one connection's requests -----------------------------------------------------------------

class Conn:
    """A client connection whose every request carries an id of its own (`NAME:n`, never one
    the client library would pick) and whose every reply must carry that id. Replies with id
    nil (and legacy replies) land in the client's `unmatched`; `expect_unmatched` waits for
    exactly the next one."""

    def __init__(self, client, name: str):
        self.client = client
        self.name = name
        self._ids = itertools.count()
        self.sent = 0
        self.matched = 0
        self.unmatched_expected = 0
        self._unmatched_base = client.unmatched_count

    def submit(self, op: str, args: dict | None = None):
        request_id = f"{self.name}:{next(self._ids)}"
        future = self.client.submit(op, args or {}, request_id=request_id)
        self.sent += 1
        return request_id, future

    def reply(self, request_id, future):
        try:
            reply = future.result(REPLY_TIMEOUT_S)
        except concurrent.futures.TimeoutError:
            raise Broken(f"{self.name}: no reply to request {request_id!r} within {REPLY_TIMEOUT_S:.0f} s") from None
        if reply.id != request_id:
            raise Broken(f"{self.name}: the reply to request {request_id!r} carries id {reply.id!r}")
        self.matched += 1
        return reply

    def request(self, op: str, args: dict | None = None):
        return self.reply(*self.submit(op, args))

    def call(self, op: str, **args) -> dict:
        reply = self.request(op, args)
        if not reply.ok:
            raise Broken(f"{self.name}: {op} failed: {reply.error}")
        return reply.result

    def refused(self, op: str, args: dict, code: str, what: str) -> None:
        expect_error(self.request(op, args), code, f"{self.name}: {what}")

    def send_raw(self, parts: list, request_id=None):
        """Raw bytes: a stream client's one body, a ZeroMQ client's body and buffers."""
        if request_id is not None:
            self.sent += 1
        if isinstance(self.client, ZmqClient):
            return self.client.send_raw(parts[0], request_id, parts[1:])
        (body,) = parts
        return self.client.send_raw(body, request_id)

    def expect_unmatched(self, what: str):
        """The next reply that matched no request: waits for it."""
        self.unmatched_expected += 1
        deadline = time.monotonic() + REPLY_TIMEOUT_S
        while self.client.unmatched_count - self._unmatched_base < self.unmatched_expected:
            if time.monotonic() > deadline:
                raise Broken(f"{self.name}: {what}: no reply within {REPLY_TIMEOUT_S:.0f} s")
            time.sleep(0.002)
        if self.client.unmatched_count - self._unmatched_base > self.unmatched_expected:
            raise Broken(f"{self.name}: {what}: more replies matching no request than frames sent that "
                         f"should get one ({self.client.unmatched_count - self._unmatched_base} against "
                         f"{self.unmatched_expected})")
        return self.client.unmatched[-1]

    def check_all_matched(self) -> None:
        unmatched = self.client.unmatched_count - self._unmatched_base
        if unmatched != self.unmatched_expected or self.matched != self.sent:
            raise Broken(f"{self.name}: {self.sent} requests sent with ids, {self.matched} replies matched; "
                         f"{unmatched} replies matching no request against {self.unmatched_expected} expected")


def expect_error(reply, code: str, what: str, request_id="any") -> None:
    if reply.ok or reply.error.get("code") != code:
        raise Broken(f"{what}: expected error {code}, got {reply.error if not reply.ok else 'ok'}")
    if request_id != "any" and reply.id != request_id:
        raise Broken(f"{what}: expected the error reply's id {request_id!r}, got {reply.id!r}")


# --- malformed frames --------------------------------------------------------------------------

def pack(value) -> bytes:
    return msgpack.packb(value, use_bin_type=True)


def envelope(rid, op, args=None, **extra) -> dict:
    return {"v": 1, "id": rid, "op": op, **({} if args is None else {"args": args}), **extra}


def f32_tensor(shape, data: bytes | None = None) -> dict:
    n = int(np.prod(shape)) if shape else 1
    return {"dtype": "f32", "shape": list(shape), "data": bytes(4 * n) if data is None else data}


def deep_map(depth: int) -> bytes:
    """{"a": {"a": ... nil}} nested `depth` deep: past any decoder's nesting limit."""
    return b"\x81\xa1a" * depth + b"\xc0"


def duplicate_op(rid) -> bytes:
    """A request map whose "op" key comes twice (msgpack allows it; the protocol does not)."""
    return b"\x84" + pack("v") + pack(1) + pack("id") + pack(rid) + pack("op") + pack("ping") + pack("op") + pack("ping")


def bad_scan_B(rid) -> bytes:
    x = f32_tensor((1, 4, 8))
    return pack(envelope(rid, "scan", {"x": x, "dt": x, "A": f32_tensor((8, 2)), "B": f32_tensor((1, 3, 2)),
                                       "C": f32_tensor((1, 4, 2))}))


def int_scan(rid) -> bytes:
    x = {"dtype": "i32", "shape": [1, 4, 8], "data": bytes(128)}
    return pack(envelope(rid, "scan", {"x": x, "dt": f32_tensor((1, 4, 8)), "A": f32_tensor((8, 2)),
                                       "B": f32_tensor((1, 4, 2)), "C": f32_tensor((1, 4, 2))}))


# (name, the body for request id rid, the error code expected, whether the reply carries rid).
# The server answers each with an error; a legacy request's is a legacy reply (`LEGACY`).
LEGACY = "legacy"
ENVELOPE_CASES = [
    ("not msgpack", lambda rid: b"\xc1\xc1 not msgpack", "decode_error", False),
    ("truncated map", lambda rid: pack(envelope(rid, "ping"))[:-3], "decode_error", False),
    ("bytes after the map", lambda rid: pack(envelope(rid, "ping")) + b"\x00", "decode_error", False),
    ("an array at the top", lambda rid: pack([1, rid, "ping"]), "decode_error", False),
    ("nested too deep", lambda rid: deep_map(100_000), "decode_error", False),
    ("a key not a str", lambda rid: pack({**envelope(rid, "ping"), 7: 1}), "invalid_request", False),
    ("a key twice", duplicate_op, "invalid_request", False),
    ("a negative id", lambda rid: pack(envelope(-5, "ping")), "invalid_request", False),
    ("an empty id", lambda rid: pack(envelope("", "ping")), "invalid_request", False),
    ("no id", lambda rid: pack({"v": 1, "op": "ping"}), "invalid_request", False),
    ("op not a str", lambda rid: pack(envelope(rid, 7)), "invalid_request", True),
    ("args not a map", lambda rid: pack(envelope(rid, "ping", [1])), "invalid_request", True),
    ("an unknown key", lambda rid: pack(envelope(rid, "ping", bogus=1)), "invalid_request", True),
    ("v not an int", lambda rid: pack({**envelope(rid, "ping"), "v": "1"}), "invalid_request", True),
    ("v 2", lambda rid: pack({**envelope(rid, "ping"), "v": 2}), "unsupported_version", True),
    ("an unknown op", lambda rid: pack(envelope(rid, "no_such_op", {})), "unknown_op", True),
    ("an empty op", lambda rid: pack(envelope(rid, "", {})), "unknown_op", True),
    ("a missing argument", lambda rid: pack(envelope(rid, "put", {})), "missing_argument", True),
    ("an unknown argument", lambda rid: pack(envelope(rid, "ping", {"bogus": 1})), "invalid_argument", True),
    ("an argument of the wrong kind",
     lambda rid: pack(envelope(rid, "session_open", {"batch": "four", "dim": 8, "state": 4})), "invalid_argument", True),
    ("an unknown dtype", lambda rid: pack(envelope(rid, "put", {"tensor": {"dtype": "f128", "shape": [1],
                                                                        "data": bytes(16)}})), "unknown_dtype", True),
    ("a lying shape", lambda rid: pack(envelope(rid, "put", {"tensor": f32_tensor([4], bytes(12))})),
     "tensor_size_mismatch", True),
    ("a tensor with another key",
     lambda rid: pack(envelope(rid, "put", {"tensor": {**f32_tensor([1]), "x": 1}})), "invalid_argument", True),
    ("a negative dim", lambda rid: pack(envelope(rid, "put", {"tensor": f32_tensor([1], bytes(4)) | {"shape": [-1]}})),
     "invalid_argument", True),
    ("nine dims", lambda rid: pack(envelope(rid, "put", {"tensor": f32_tensor([1] * 9)})), "invalid_argument", True),
    ("a shape past 2^63 bytes",
     lambda rid: pack(envelope(rid, "put", {"tensor": f32_tensor([0], b"") | {"shape": [0, 1 << 62]}})),
     "invalid_argument", True),
    ("a handle id not a str", lambda rid: pack(envelope(rid, "free", {"handle": 3})), "invalid_argument", True),
    ("a handle map with another key",
     lambda rid: pack(envelope(rid, "scan", {"x": f32_tensor((1, 4, 8)), "dt": f32_tensor((1, 4, 8)),
                                             "A": {"handle": "h", "x": 1}, "B": f32_tensor((1, 4, 2)),
                                             "C": f32_tensor((1, 4, 2))})), "invalid_argument", True),
    ("tensors inconsistent with each other", bad_scan_B, "shape_mismatch", True),
    ("an integer scan input", int_scan, "invalid_argument", True),
    ("an unknown session", lambda rid: pack(envelope(rid, "session_state", {"session": "no-such-session"})),
     "unknown_session", True),
    ("an unknown handle", lambda rid: pack(envelope(rid, "free", {"handle": "no-such-handle"})), "unknown_handle", True),
    ("an unknown model", lambda rid: pack(envelope(rid, "model_free", {"model": "no-such-model"})), "unknown_model", True),
    ("an unknown snapshot", lambda rid: pack(envelope(rid, "snapshot_free", {"snapshot": "no-such-snapshot"})),
     "unknown_snapshot", True),
    ("a checkpoint of an unknown architecture",
     lambda rid: pack(envelope(rid, "model_load", {"config": {"arch": "rnn", "d_model": 4, "n_layer": 1},
                                                   "weights": {}})), "invalid_checkpoint", True),
    ("a checkpoint outside --model-dir", lambda rid: pack(envelope(rid, "model_load", {"path": "/etc"})),
     "path_not_allowed", True),
    ("a session over the pool limit",
     lambda rid: pack(envelope(rid, "session_open", {"batch": 1 << 40, "dim": 512, "state": 16})),
     "limit_exceeded", True),
    ("a legacy scan of a wrong size", lambda rid: pack({"op": "scan", "batch": 1, "seq_len": 2, "hidden": 2,
                                                        "state": 1, "x": b"\0" * 3, "dt": b"", "A": b"", "B": b"",
                                                        "C": b""}), LEGACY, False),
]


def stream_cases() -> list:
    """ENVELOPE_CASES and what only a stream lane has: an empty frame, a tensor naming a raw
    buffer (streams have none)."""
    return [
        ("an empty frame", lambda rid: b"", "decode_error", False),
        *ENVELOPE_CASES,
        ("a raw buffer on a stream",
         lambda rid: pack(envelope(rid, "put", {"tensor": {"dtype": "f32", "shape": [1], "buf": 0}})),
         "invalid_argument", True),
    ]


def zmq_cases() -> list:
    """ENVELOPE_CASES as ZeroMQ messages, and what only ZeroMQ has: raw buffers (a stray one, an
    index past them, one of the wrong length, a legacy request with one, body and buffers over
    the frame limit). Each case's parts: the body, then the buffers."""
    buf_tensor = {"dtype": "f32", "shape": [2], "buf": 0}
    return [
        *[(name, (lambda make: lambda rid: [make(rid)])(make), code, has_id)
          for name, make, code, has_id in ENVELOPE_CASES],
        ("a stray raw buffer", lambda rid: [pack(envelope(rid, "put", {"tensor": f32_tensor([1])})), bytes(8)],
         "invalid_request", True),
        ("a buffer index past the buffers",
         lambda rid: [pack(envelope(rid, "put", {"tensor": {**buf_tensor, "buf": 1}})), bytes(8)],
         "invalid_argument", True),
        ("a raw buffer of the wrong length", lambda rid: [pack(envelope(rid, "put", {"tensor": buf_tensor})), bytes(12)],
         "tensor_size_mismatch", True),
        ("a legacy request with a raw buffer", lambda rid: [pack({"op": "ping"}), bytes(4)], LEGACY, False),
        ("body and buffers over the frame limit",
         lambda rid: [pack(envelope(rid, "put", {"tensor": buf_tensor})), bytes(MAX_FRAME_SIZE)],
         "frame_too_large", False),
    ]


def run_malformed(conn: Conn, cases: list, counts: dict) -> None:
    """Send every case, check each reply's code and id, then that the connection still serves."""
    zmq_lane = isinstance(conn.client, ZmqClient)
    for name, make, code, has_id in cases:
        rid = f"{conn.name}:bad{next(conn._ids)}"
        body = make(rid)
        parts = body if zmq_lane else [body]
        what = f"{conn.name}: {name}"
        if has_id:
            reply = conn.reply(rid, conn.send_raw(parts, rid))
            expect_error(reply, code, what, rid)
        else:
            conn.send_raw(parts)
            reply = conn.expect_unmatched(what)
            if code == LEGACY:
                legacy = msgpack.unpackb(reply.extra.get("raw", b"\xc0"))
                if not isinstance(legacy, dict) or legacy.get("status") != "error":
                    raise Broken(f"{what}: expected a legacy error reply, got {legacy!r}")
            else:
                expect_error(reply, code, what, None)
        counts[code] = counts.get(code, 0) + 1
    if not zmq_lane:
        # A frame longer than the server accepts: its body is read and dropped unparsed.
        conn.client._send(protocol_frame_header(MAX_FRAME_SIZE + 1) + [bytes(MAX_FRAME_SIZE + 1)])
        expect_error(conn.expect_unmatched(f"{conn.name}: an oversized frame"), "frame_too_large",
                     f"{conn.name}: an oversized frame", None)
        counts["frame_too_large"] = counts.get("frame_too_large", 0) + 1
    conn.call("ping")


def protocol_frame_header(length: int) -> list:
    return [struct.pack(">I", length)]


def zmq_peer_dropped(endpoint: str, counts: dict) -> None:
    """A ZeroMQ peer holding a session sends one frame longer than the server accepts: ZeroMQ
    drops the peer's connection (no reply), the server frees the session with it, and the peer,
    reconnected, is served as a new one (its old session unknown)."""
    with ZmqClient(endpoint) as client:
        conn = Conn(client, "zmq-dropped")
        session = conn.call("session_open", batch=1, dim=8, state=4)["session"]
        conn.send_raw([bytes(MAX_FRAME_SIZE + 1)])
        # Requests sent on the connection being dropped fail with it (ServerExited, the client
        # seeing it end): ask until one is answered on the new connection.
        deadline = time.monotonic() + REPLY_TIMEOUT_S
        while True:
            request_id, future = conn.submit("session_state", {"session": session})
            try:
                reply = future.result(0.5)
            except (concurrent.futures.TimeoutError, ServerExited):
                if time.monotonic() > deadline:
                    raise Broken("zmq: a peer dropped for an oversized frame was not served again") from None
                continue
            if reply.ok:
                # Still the old connection: ZeroMQ has not dropped it yet.
                if time.monotonic() > deadline:
                    raise Broken("zmq: a peer that sent a frame over --max-frame-size was not dropped")
                time.sleep(0.05)
                continue
            expect_error(reply, "unknown_session", "zmq: the session of a peer dropped for an oversized frame",
                         request_id)
            break
    counts["zmq_peer_dropped"] = counts.get("zmq_peer_dropped", 0) + 1


# --- the lanes' script --------------------------------------------------------------------------

class LaneScript:
    """One long-lived connection's work of one round: the same inputs every round, on every
    lane, so that every result must equal the first of its kind bit for bit."""

    def __init__(self, steps: int, refs: References):
        self.refs = refs
        self.window = Case("scan", EXPHIL_SEQ, ROWS).inputs(0)
        self.frames = [Case("step", 1, ROWS).inputs(1 + i) for i in range(steps)]
        self.A = self.window["A"]
        self.scans = [small_scan_inputs(100 + i) for i in range(BURST_SCANS)]
        self.ssd_scan = ssd_inputs(200)
        self.ssd_window = ssd_inputs(201, options=False)
        # A step's A is the window's (a session's decay is its layer's).
        self.ssd_frames = [{k: v for k, v in ssd_inputs(300 + i, seq=None, options=False).items() if k != "A"}
                           for i in range(SSD_STEPS)]
        self.weights = model_weights("mamba")
        self.tokens = model_tokens()
        self.dtypes = self._every_dtype()

    @staticmethod
    def _every_dtype() -> list:
        import torch

        rng = np.random.default_rng(5)
        base = rng.standard_normal((3, 5))
        return [base.astype(np.float32), base.astype(np.float16), torch.from_numpy(base).to(torch.bfloat16),
                base, (base * 100).astype(np.int32), (base * 100).astype(np.int64), rng.integers(0, 255, (3, 5),
                                                                                                 dtype=np.uint8)]

    def independent_references(self) -> dict:
        """What the kernels' reference backend computes for the inputs here."""
        window_y, window_state = reference_scan({k: self.window[k] for k in ("x", "dt", "A", "B", "C")} | DT_CLAMP)
        ssd_y, ssd_state = reference_scan(self.ssd_window, ssd=True)
        return {
            "prefill y": window_y,
            "session state": reference_steps(window_state, self.frames, self.A),
            **{f"scan {i} y": y for i, (y, _) in enumerate(map(reference_scan, self.scans))},
            "scan 0 state": reference_scan(self.scans[0])[1],
            "ssd scan": reference_scan(self.ssd_scan, ssd=True),
            "ssd session state": reference_steps(ssd_state, self.ssd_frames, self.ssd_window["A"], ssd=True),
        }

    def run(self, conn: Conn, expected: dict, malformed: list, counts: dict) -> None:
        self.plain_session(conn, expected)
        self.scan_burst(conn, expected)
        self.ssd(conn, expected)
        for arch in MODEL_CONFIGS:
            self.model(conn, arch)
        self.put_free(conn)
        self.session_churn(conn)
        run_malformed(conn, malformed, counts)

    def plain_session(self, conn: Conn, expected: dict) -> None:
        refs, w, name = self.refs, self.window, conn.name
        A = conn.call("put", tensor=self.A)["handle"]
        A_ref = {"handle": A}
        session = conn.call("session_open", batch=ROWS, dim=DIM, state=STATE)["session"]
        y = conn.call("scan", x=w["x"], dt=w["dt"], A=A_ref, B=w["B"], C=w["C"], session=session, **DT_CLAMP)["y"]
        refs.check("prefill y", y, f"{name}: the prefill's y", expected["prefill y"])
        snapshot = conn.call("session_snapshot", session=session)["snapshot"]
        state = self.step_through(conn, session, A_ref)
        refs.check("session state", state, f"{name}: the session's state after its steps", expected["session state"])
        conn.call("session_restore", session=session, snapshot=snapshot)
        same_bits(self.step_through(conn, session, A_ref), state,
                  f"{name}: the session restored to its snapshot and stepped again")
        fork = conn.call("session_fork", session=session)["session"]
        same_bits(conn.call("session_state", session=fork)["state"], state, f"{name}: a fork's state")
        conn.call("session_close", session=fork)
        conn.call("snapshot_free", snapshot=snapshot)
        conn.call("session_close", session=session)
        f = self.frames[-1]
        conn.refused("step", {"session": session, "x": f["x"], "dt": f["dt"], "A": A_ref, "B": f["B"], "C": f["C"]},
                     "unknown_session", "a step after session_close")
        other = conn.call("session_open", batch=ROWS, dim=DIM, state=STATE)["session"]
        conn.refused("step", {"session": other, "x": f["x"][:, :-1], "dt": f["dt"], "A": A_ref, "B": f["B"],
                              "C": f["C"]}, "shape_mismatch", "a step whose x lacks a channel")
        conn.call("session_close", session=other)
        conn.call("free", handle=A)
        conn.refused("free", {"handle": A}, "unknown_handle", "a handle freed twice")

    def step_through(self, conn: Conn, session: str, A_ref: dict) -> np.ndarray:
        for f in self.frames:
            conn.call("step", session=session, x=f["x"], dt=f["dt"], A=A_ref, B=f["B"], C=f["C"], **DT_CLAMP)
        return np.array(conn.call("session_state", session=session)["state"])

    def scan_burst(self, conn: Conn, expected: dict) -> None:
        """Every scan sent before any reply is read; each reply must be its own request's."""
        sent = [conn.submit("scan", inputs) for inputs in self.scans]
        for i, (request_id, future) in enumerate(sent):
            reply = conn.reply(request_id, future)
            if not reply.ok:
                raise Broken(f"{conn.name}: scan {i} of the burst failed: {reply.error}")
            self.refs.check(f"scan {i} y", reply.result["y"], f"{conn.name}: scan {i} of the burst's y",
                            expected[f"scan {i} y"])
            if i == 0:
                self.refs.check("scan 0 state", reply.result["state"], f"{conn.name}: scan 0's state",
                                expected["scan 0 state"])

    def ssd(self, conn: Conn, expected: dict) -> None:
        refs, name = self.refs, conn.name
        result = conn.call("ssd_scan", **self.ssd_scan)
        y_ref, state_ref = expected["ssd scan"]
        refs.check("ssd y", result["y"], f"{name}: ssd_scan's y", y_ref)
        refs.check("ssd state", result["state"], f"{name}: ssd_scan's state", state_ref)
        s = SSD
        session = conn.call("session_open", kind="ssd", batch=s["batch"], heads=s["heads"], headdim=s["headdim"],
                            state=s["state"])["session"]
        conn.call("ssd_scan", **self.ssd_window, session=session)
        A = self.ssd_window["A"]
        for f in self.ssd_frames:
            conn.call("step", session=session, **f, A=A, **DT_CLAMP)
        refs.check("ssd session state", conn.call("session_state", session=session)["state"],
                   f"{name}: the ssd session's state after its steps", expected["ssd session state"])
        conn.refused("scan", {**self.scans[0], "session": session, "return_state": False}, "invalid_argument",
                     "a Mamba-1 scan of an ssd session")
        conn.call("session_close", session=session)

    def model(self, conn: Conn, arch: str) -> None:
        """A tiny model's session: prefill, steps, snapshot and restore, fork, state; the steps'
        logits must be those of one forward over the same tokens (within fp32 tolerance), and
        equal to the first lane's bit for bit."""
        refs, name = self.refs, f"{conn.name}: {arch}"
        if arch == "mamba":
            embedding = conn.call("put", tensor=self.weights["embeddings.weight"])["handle"]
            weights = {**self.weights, "embeddings.weight": {"handle": embedding}}
            model = conn.call("model_load", config=MODEL_CONFIGS[arch], weights=weights)["model"]
            conn.call("free", handle=embedding)
        else:
            model = conn.call("model_load", path=CHECKPOINT)["model"]
        tokens = self.tokens
        session = conn.call("session_open", model=model, batch=MODEL_BATCH)["session"]
        prefill = conn.call("model_forward", session=session, tokens=tokens[:, :MODEL_PREFILL], last_only=True)
        snapshot = conn.call("session_snapshot", session=session)["snapshot"]
        logits = self.model_steps(conn, session)
        whole = conn.call("session_open", model=model, batch=MODEL_BATCH)["session"]
        forward = conn.call("model_forward", session=whole, tokens=tokens)["logits"]
        conn.call("session_close", session=whole)
        check_close(logits, np.asarray(forward)[:, MODEL_PREFILL:], f"{name}: steps against one forward", 1e-3, 1e-3)
        refs.check(f"{arch} prefill", prefill["logits"], f"{name}: the prefill's last logits")
        refs.check(f"{arch} steps", logits, f"{name}: the steps' logits")
        state = conn.call("session_state", session=session)["state"]
        for part, value in sorted(state.items()):
            refs.check(f"{arch} {part}", value, f"{name}: the session's {part} after its steps")
        conn.call("session_restore", session=session, snapshot=snapshot)
        same_bits(self.model_steps(conn, session), logits, f"{name}: steps again after a restore")
        # The second step takes the state before it into the snapshot (a rollback ring's frame);
        # restored to that, the steps from the second on come out as before.
        conn.call("session_restore", session=session, snapshot=snapshot)
        same_bits(self.model_steps(conn, session, into={1: snapshot}), logits,
                  f"{name}: steps, the second into the snapshot")
        conn.call("session_restore", session=session, snapshot=snapshot)
        same_bits(self.model_steps(conn, session, first=1), logits[:, 1:],
                  f"{name}: steps again from the state the second step took into the snapshot")
        fork = conn.call("session_fork", session=session)["session"]
        fork_state = conn.call("session_state", session=fork)["state"]
        for part, value in state.items():
            same_bits(fork_state[part], value, f"{name}: a fork's {part}")
        conn.refused("model_free", {"model": model}, "invalid_argument", "model_free of a model with open sessions")
        conn.call("session_close", session=fork)
        conn.call("session_close", session=session)
        conn.call("snapshot_free", snapshot=snapshot)
        conn.call("model_free", model=model)
        conn.refused("session_open", {"model": model, "batch": 1}, "unknown_model", "a session of a freed model")

    def model_steps(self, conn: Conn, session: str, first: int = 0, into: dict | None = None) -> np.ndarray:
        """The logits of the steps from the `first` on; `into`: step index → the snapshot it
        takes the state before it into."""
        into = into or {}
        return np.stack([np.array(conn.call("model_step", session=session, tokens=self.tokens[:, MODEL_PREFILL + t],
                                            **({"snapshot_into": into[t]} if t in into else {}))["logits"])
                         for t in range(first, MODEL_STEPS)], axis=1)

    def put_free(self, conn: Conn) -> None:
        """A tensor of every wire dtype held and freed; a scan whose constants are handles."""
        sent = [conn.submit("put", {"tensor": t}) for t in self.dtypes]
        handles = [conn.reply(*s).unwrap()["handle"] for s in sent]
        if len(set(handles)) != len(handles):
            raise Broken(f"{conn.name}: put returned one handle twice: {handles}")
        scan = self.scans[1]
        constants = {k: conn.call("put", tensor=scan[k])["handle"] for k in ("A", "D", "dt_bias")}
        y = conn.call("scan", **{**scan, **{k: {"handle": h} for k, h in constants.items()}})["y"]
        self.refs.check("scan 1 y", y, f"{conn.name}: a scan with handles")
        for request_id, future in [conn.submit("free", {"handle": h}) for h in [*handles, *constants.values()]]:
            conn.reply(request_id, future).unwrap()

    def session_churn(self, conn: Conn) -> None:
        """Sessions of both kinds opened, all sent before any reply is read, then closed so."""
        opens = [conn.submit("session_open", {"batch": 2, "dim": 16, "state": 4} if i % 2 else
                             {"kind": "ssd", "batch": 1, "heads": 2, "headdim": 4, "state": 4})
                 for i in range(CHURN_SESSIONS)]
        sessions = [conn.reply(*o).unwrap()["session"] for o in opens]
        if len(set(sessions)) != len(sessions):
            raise Broken(f"{conn.name}: session_open returned one id twice")
        for request_id, future in [conn.submit("session_close", {"session": sid}) for sid in sessions]:
            conn.reply(request_id, future).unwrap()


# --- connection churn and killed clients ---------------------------------------------------------

def churn(unix_path: str, zmq_endpoint: str, connections: int, script: LaneScript) -> int:
    """Connections that open sessions and handles (and some a model, its session and a
    snapshot) and leave without freeing them; how many."""
    f = script.frames[0]
    for i in range(connections):
        for make, name in ((lambda: UnixClient(unix_path), "unix churn"), (lambda: ZmqClient(zmq_endpoint), "zmq churn")):
            with make() as client:
                conn = Conn(client, name)
                session = conn.call("session_open", batch=ROWS, dim=DIM, state=STATE)["session"]
                A = conn.call("put", tensor=script.A)["handle"]
                conn.call("step", session=session, x=f["x"], dt=f["dt"], A={"handle": A}, B=f["B"], C=f["C"])
                if i % CHURN_MODEL_EVERY == 0:
                    model = conn.call("model_load", path=CHECKPOINT)["model"]
                    ms = conn.call("session_open", model=model, batch=1)["session"]
                    conn.call("model_step", session=ms, tokens=script.tokens[:1, 0])
                    conn.call("session_snapshot", session=ms)
                conn.check_all_matched()
    return 2 * connections


def killed_client_main(lane: str, endpoint: str) -> int:
    """A client process that opens state, sends a burst and waits to be killed: prints
    "holding", one "r" a reply of the burst as it comes, and "ready N" (N requests sent) once
    the first is answered."""
    out_lock = threading.Lock()

    def say(line: str) -> None:
        with out_lock:
            sys.stdout.write(line + "\n")
            sys.stdout.flush()

    client = UnixClient(endpoint) if lane == "unix" else ZmqClient(endpoint)
    conn = Conn(client, f"killed {lane}")
    window = Case("scan", EXPHIL_SEQ, ROWS).inputs(0)
    frame = Case("step", 1, ROWS).inputs(1)
    session = conn.call("session_open", batch=ROWS, dim=DIM, state=STATE)["session"]
    A = {"handle": conn.call("put", tensor=window["A"])["handle"]}
    model = conn.call("model_load", config=MODEL_CONFIGS["mamba"], weights=model_weights("mamba"))["model"]
    ms = conn.call("session_open", model=model, batch=MODEL_BATCH)["session"]
    tokens = model_tokens()
    conn.call("model_forward", session=ms, tokens=tokens[:, :MODEL_PREFILL])
    conn.call("session_snapshot", session=ms)
    say("holding")
    answered = threading.Event()

    def on_reply(_future) -> None:
        answered.set()
        say("r")

    for i in range(KILL_BURST):
        if i >= KILL_BURST - 10:
            op, args = "scan", {**window, "A": A, "session": session, **DT_CLAMP}
        elif i % 2:
            op, args = "model_step", {"session": ms, "tokens": tokens[:, MODEL_PREFILL]}
        else:
            op, args = "step", {"session": session, **frame, "A": A, **DT_CLAMP}
        conn.submit(op, args)[1].add_done_callback(on_reply)
    if lane == "unix":
        # Half a frame: the server must drop it with the connection.
        client.sock.sendall(struct.pack(">I", 1 << 16) + bytes(1 << 14))
    answered.wait(REPLY_TIMEOUT_S)
    say(f"ready {KILL_BURST}")
    time.sleep(REPLY_TIMEOUT_S)
    return 1  # not killed: the parent reports it


def kill_clients(lane: str, endpoint: str, count: int) -> dict:
    """`count` killed clients on `lane`, one after another; what they had sent and had answered."""
    totals = {"clients": 0, "sent": 0, "answered": 0}
    for _ in range(count):
        proc = subprocess.Popen([sys.executable, "-m", "bench.soak", "--as-killed-client", lane, endpoint],
                                cwd=REPO, env=server_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            lines = []
            while not (lines and lines[-1].startswith("ready")):
                line = proc.stdout.readline()
                if not line:
                    raise Broken(f"a killed {lane} client ended before it was killed: {proc.stderr.read()[-2000:]}")
                lines.append(line.strip())
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            lines += [line.strip() for line in proc.stdout]
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            proc.stdout.close()
            proc.stderr.close()
        totals["clients"] += 1
        totals["sent"] += int(next(line for line in lines if line.startswith("ready")).split()[1])
        totals["answered"] += lines.count("r")
    return totals


# --- what the server holds and uses ----------------------------------------------------------------

def open_fds(pid: int) -> dict[str, str]:
    """Process `pid`'s open file descriptors and what each is (a socket, a pipe, a file)."""
    found = {}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            found[fd] = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            pass  # closed meanwhile
    return found


def thread_names(pid: int) -> collections.Counter:
    """How many of process `pid`'s threads bear each name (the kernels' helpers and ZeroMQ's
    threads are named; Python's all read "python")."""
    names = collections.Counter()
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                names[f.read().strip()] += 1
        except OSError:
            pass  # ended meanwhile
    return names


def process_usage(pid: int) -> dict:
    """Resident memory and its peak (kB), open file descriptors and threads of process `pid`
    (Linux /proc)."""
    usage = {"fds": len(os.listdir(f"/proc/{pid}/fd"))}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key == "VmRSS":
                usage["rss_kB"] = int(value.split()[0])
            elif key == "VmHWM":
                usage["rss_peak_kB"] = int(value.split()[0])
            elif key == "Threads":
                usage["threads"] = int(value)
    return usage


METRIC_GAUGES = ("models", "snapshots")


def held(stats: dict, metrics: dict) -> dict:
    """What the server still holds, by the gauges of `stats` and of its metrics endpoint."""
    sessions, handles = stats["sessions"], stats["handles"]
    return {"sessions": sessions["sessions"], "pool_bytes": sessions["pool_bytes"],
            "model_bytes": sessions["model_bytes"], "snapshot_bytes": sessions["snapshot_bytes"],
            "handles": handles["handles"], "handle_bytes": handles["handle_bytes"],
            **{name: metrics[name] for name in METRIC_GAUGES}}


def scrape(url: str) -> dict:
    """The metrics endpoint's models and snapshots gauges."""
    with urllib.request.urlopen(url, timeout=REPLY_TIMEOUT_S) as response:
        text = response.read().decode()
    found = {}
    for name in METRIC_GAUGES:
        match = re.search(rf"^scan_bridge_{name} (\S+)$", text, re.M)
        if match is None:
            raise Broken(f"the metrics endpoint has no scan_bridge_{name}")
        found[name] = float(match.group(1))
    return found


def wait_for_release(port: PortClient, metrics_url: str) -> tuple[dict, dict]:
    """The server's stats and what it holds once everything is freed, or as they stand after
    RELEASE_TIMEOUT_S."""
    deadline = time.monotonic() + RELEASE_TIMEOUT_S
    while True:
        stats = port.stats()
        left = held(stats, scrape(metrics_url))
        if not any(left.values()) or time.monotonic() > deadline:
            return stats, left
        time.sleep(0.05)


def requests_served(stats: dict) -> int:
    """Requests (frames) the server has read, its stats requests (wait_for_release's polls) left
    out: frames_in counts the stats request being answered, the ops table those answered before."""
    return stats["frames_in"] - stats["ops"].get("stats", {}).get("inference_count", 0) - 1


def check_released(r: int, left: dict) -> None:
    """Raise unless round `r` ended with nothing held."""
    if any(left.values()):
        raise Broken(f"round {r}: still held {RELEASE_TIMEOUT_S:.0f} s after every connection but the "
                     f"long-lived ones closed, and those freed what they opened: {left}")


def flat_usage(r: int, pid: int, warm: dict, warm_fds: dict, warm_threads: collections.Counter,
               rss_bound_kib: int, settle_s: float = RELEASE_TIMEOUT_S) -> dict:
    """Round `r`'s usage after warm-up; raises unless it kept the warm-up's end's memory (within
    the bound), descriptors and threads (`warm_fds`, `warm_threads`: what they were). Descriptors
    and threads are given `settle_s` to come back: a connection's socket may close after its
    sessions are freed."""
    deadline = time.monotonic() + settle_s
    while True:
        usage = process_usage(pid)
        over = [key for key in ("fds", "threads") if usage[key] > warm[key]]
        if not over or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    growth = usage["rss_kB"] - warm["rss_kB"]
    if growth > rss_bound_kib:
        raise Broken(f"round {r}: resident memory {usage['rss_kB']} kB, {growth} kB above the end of warm-up "
                     f"(round {warm['round']}); the bound is {rss_bound_kib} kB")
    if over:
        now = open_fds(pid)
        new = sorted(f"{fd} -> {what}" for fd, what in now.items() if warm_fds.get(fd) != what)
        new_threads = dict(thread_names(pid) - warm_threads)
        raise Broken(f"round {r}: " + ", ".join(f"{usage[k]} {k}" for k in over) + " after "
                     f"{settle_s:.0f} s, more than at the end of warm-up (round {warm['round']}: "
                     + ", ".join(f"{warm[k]} {k}" for k in over) + f"); descriptors new since then: {new}, "
                     f"threads by name: {new_threads}")
    return usage


# --- the run ---------------------------------------------------------------------------------------

LANES = ("stdio", "unix", "zmq")


def soak(rounds: int | None, minutes: float | None, steps: int, connections: int, kills: int,
         rss_bound_kib: int) -> dict:
    refs = References()
    script = LaneScript(steps, refs)
    expected = script.independent_references()
    malformed = {"stdio": stream_cases(), "unix": stream_cases(), "zmq": zmq_cases()}
    counts = {lane: {} for lane in LANES}
    kill_totals = {lane: {"clients": 0, "sent": 0, "answered": 0} for lane in ("unix", "zmq")}
    churned = 0
    duration_s = None if minutes is None else minutes * 60.0
    with tempfile.TemporaryDirectory(prefix="bridge-soak-") as scratch, \
            tempfile.TemporaryFile(mode="w+b") as log:
        unix_path = TRANSPORTS["unix"].value(scratch)
        zmq_endpoint = TRANSPORTS["zmq-ipc"].value(scratch)
        model_dir = os.path.join(scratch, "models")
        write_checkpoint(os.path.join(model_dir, CHECKPOINT))
        port = PortClient(["--device", "cpu", "--stdio", "--unix", unix_path, "--zmq", zmq_endpoint,
                           "--max-frame-size", str(MAX_FRAME_SIZE), "--model-dir", model_dir, "--metrics-port", "0"],
                          stderr=log)
        samples: list[dict] = []
        warm, warm_fds, warm_threads = None, {}, collections.Counter()
        started = time.monotonic()
        try:
            metrics_url = port.info()["metrics"]
            with UnixClient(unix_path) as unix, ZmqClient(zmq_endpoint) as zmq_client, \
                    concurrent.futures.ThreadPoolExecutor(max_workers=len(LANES) + 3) as pool:
                conns = {"stdio": Conn(port, "stdio"), "unix": Conn(unix, "unix"), "zmq": Conn(zmq_client, "zmq")}
                for r in itertools.count():
                    if (rounds is not None and r >= rounds) or \
                            (duration_s is not None and time.monotonic() - started >= duration_s):
                        break
                    jobs = [pool.submit(script.run, conns[lane], expected, malformed[lane], counts[lane])
                            for lane in LANES]
                    jobs.append(pool.submit(churn, unix_path, zmq_endpoint, connections, script))
                    jobs.append(pool.submit(zmq_peer_dropped, zmq_endpoint, counts["zmq"]))
                    kill_jobs = {lane: pool.submit(kill_clients, lane, endpoint, kills)
                                 for lane, endpoint in (("unix", unix_path), ("zmq", zmq_endpoint))}
                    for job in concurrent.futures.as_completed([*jobs, *kill_jobs.values()]):
                        job.result()
                    churned += jobs[3].result()
                    for lane, job in kill_jobs.items():
                        for key, value in job.result().items():
                            kill_totals[lane][key] += value
                    for conn in conns.values():
                        conn.check_all_matched()
                    stats, left = wait_for_release(port, metrics_url)
                    check_released(r, left)
                    elapsed = time.monotonic() - started
                    warming = (r < rounds // 3) if rounds is not None else (elapsed < duration_s / 3)
                    if warming or warm is None:
                        usage = process_usage(port.proc.pid)
                    else:
                        usage = flat_usage(r, port.proc.pid, warm, warm_fds, warm_threads, rss_bound_kib)
                    sample = {"round": r, "elapsed_s": round(elapsed, 1), "requests": requests_served(stats), **usage}
                    samples.append(sample)
                    if warming or warm is None:
                        # The mark the rounds after warm-up are held to: the warm-up's last round.
                        warm, warm_fds, warm_threads = sample, open_fds(port.proc.pid), thread_names(port.proc.pid)
                    print(f"round {r} ({elapsed:.0f} s): {sample['requests']} requests, rss {sample['rss_kB']} kB "
                          f"(peak {sample['rss_peak_kB']}), {sample['fds']} fds, {sample['threads']} threads"
                          f"{' (warm-up)' if warming else ''}", flush=True)
        except (ServerExited, OSError) as exc:
            raise Broken(f"the server failed: {exc!r}; its log ends:\n{log_tail(log)}") from exc
        finally:
            port.close()
    lanes = {lane: {"requests_with_ids": conns[lane].sent, "replies_matched": conns[lane].matched,
                    "replies_without_id": conns[lane].unmatched_expected, "malformed_by_code": counts[lane]}
             for lane in LANES}
    return summarize(samples, warm, steps, connections, kills, rss_bound_kib, lanes, kill_totals, churned, refs)


def summarize(samples: list[dict], warm: dict | None, steps: int, connections: int, kills: int,
              rss_bound_kib: int, lanes: dict, kill_totals: dict, churned: int, refs: References) -> dict:
    first, last = samples[0], samples[-1]
    warm = warm or last
    served = last["requests"] - warm["requests"]
    growth = last["rss_kB"] - warm["rss_kB"]
    after = [s for s in samples if s["round"] >= warm["round"]]  # the mark and the rounds held to it
    return {
        "case": f"on stdio, unix and ZeroMQ at once: a {ROWS}x{DIM}x{STATE} session prefilled and stepped {steps} "
                f"times, snapshotted, restored, forked; scans (a burst of {BURST_SCANS}), ssd_scan, an ssd session; "
                f"two tiny models (sent and from --model-dir) prefilled, stepped, snapshotted, restored, forked; "
                f"put/free of every dtype; {CHURN_SESSIONS} sessions churned; every malformed frame kind; "
                f"{connections} unix and {connections} ZeroMQ connections churned, {kills} client(s) killed "
                f"mid-request on each per round",
        "rounds_run": len(samples),
        "elapsed_s": last["elapsed_s"],
        "requests": last["requests"],
        # The churned ones, the three long-lived ones, the killed clients' and each round's
        # dropped ZeroMQ peer (counted once, though it reconnects).
        "connections": churned + 3 + sum(k["clients"] for k in kill_totals.values()) + len(samples),
        "lanes": lanes,
        "killed_clients": {lane: {**k, "unanswered_when_killed": k["sent"] - k["answered"]}
                           for lane, k in kill_totals.items()},
        "results_compared_bit_for_bit": refs.compared,
        "warmup_rounds": warm["round"] + 1,
        "rss_bound_kB": rss_bound_kib,
        "rss_kB_after_round_0": first["rss_kB"],
        "rss_kB_after_warmup": warm["rss_kB"],
        "rss_kB_last": last["rss_kB"],
        "rss_kB_max_after_warmup": max(s["rss_kB"] for s in after),
        "rss_growth_kB": growth,
        "rss_growth_bytes_per_request": growth * 1024 / served if served else None,
        "rss_peak_kB": last["rss_peak_kB"],
        "fds": [first["fds"], warm["fds"], last["fds"]],
        "threads": [first["threads"], warm["threads"], last["threads"]],
        "rounds": samples,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    length = p.add_mutually_exclusive_group()
    length.add_argument("--rounds", type=int, help="rounds (default 30); the first third warms up")
    length.add_argument("--minutes", type=float, help="run this long instead; the first third warms up")
    p.add_argument("--steps", type=positive_count, default=100, help="steps of each lane's plain session per round")
    p.add_argument("--churn", type=int, default=20, help="unix and ZeroMQ connections churned per round")
    p.add_argument("--kills", type=int, default=1, help="clients killed mid-request per round on unix and on ZeroMQ")
    p.add_argument("--rss-bound-kib", type=int, default=RSS_BOUND_KIB,
                   help="resident memory allowed above the warm-up's end")
    p.add_argument("--json", type=output_path, metavar="FILE")
    p.add_argument("--as-killed-client", nargs=2, metavar=("LANE", "ENDPOINT"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.as_killed_client:
        return killed_client_main(*args.as_killed_client)
    if args.minutes is None and args.rounds is None:
        args.rounds = 30
    if args.rounds is not None and args.rounds < 3:
        p.error(f"--rounds: expected at least 3 (the first third warms up), got {args.rounds}")
    if args.minutes is not None and args.minutes <= 0:
        p.error(f"--minutes: expected a positive duration, got {args.minutes}")
    try:
        result = soak(args.rounds, args.minutes, args.steps, args.churn, args.kills, args.rss_bound_kib)
    except (Broken, BridgeError) as exc:
        print(f"soak failed: {exc}", file=sys.stderr)
        return 1
    killed = result["killed_clients"]
    print(f"{result['rounds_run']} rounds in {result['elapsed_s']:.0f} s, {result['requests']} requests over "
          f"{result['connections']} connections, {sum(k['clients'] for k in killed.values())} clients killed with "
          f"{sum(k['unanswered_when_killed'] for k in killed.values())} requests unanswered; rss "
          f"{result['rss_kB_after_round_0']} kB after round 0, {result['rss_kB_after_warmup']} kB after warm-up, "
          f"{result['rss_kB_last']} kB at the end (max {result['rss_kB_max_after_warmup']} kB since warm-up), "
          f"fds {result['fds']}, threads {result['threads']}; every reply matched, every result checked, "
          f"nothing left held")
    if args.json:
        write_results(args.json, "soak", {"results": result})
    return 0


if __name__ == "__main__":
    from bridge.bench import exit_on_stop_signals

    exit_on_stop_signals()
    sys.exit(main())
