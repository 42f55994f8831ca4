"""Whole models on the server (issue 34): one frame of an ExPhil-sized model (4 layers, d_model
256, expand 2, d_conv 4; Mamba-1 with state 16, Mamba-2 with headdim 64 and state 64), embeddings
in and hidden states out, at batch 1 and 32, over the Port (stdio), frames paced 1/60 s apart.
In the same run, for the same model and frames:

(a) transformers' own cached step in this process (MambaModel / Mamba2Model with its cache), the
    in-process reference a client would otherwise run;
(b) the old way: norms, projections and the conv in the client (this process, torch), one `step`
    round trip per layer on a plain session of that layer's shape;
(c) re-running the last 60-frame window through `model_forward` every frame (a restore of a zero
    snapshot, then the window, last position only);
(d) a C pipe echo answering the model_step request with a reply of its size: moving the bytes alone;
(e) the same echo reading as many bytes of its own memory as the step's matrices hold before each
    reply (paced, so from memory, as the step's weights are): the floor of any server that must
    read the weights to answer, over the same lane.

And what bounds a step here, in this process: one torch op's dispatch, the stack's matrix
products alone, and the runtime's whole step without IPC; for a paced step, the step's matrices
read once from memory after the caches were flushed (`floors`).

Also snapshot + restore round trips at batch 1, and the server's own time for them, and the
same with the snapshot taken inside a step (`snapshot_into`: its copy's cost in the step's
kernel_us); a rollback of ROLLBACK frames (restore, then the corrected frames re-simulated as
one window) sent as two requests and as one (session_restore with frames), alternated; the same
rollback keeping the ring whole (the corrected frames stepped, each copying the state before it
into a snapshot), as a request each and as one, alternated; and
paced frames that keep a ring of ROLLBACK snapshots, by requests of their own and by the step's
`snapshot_into`. The bridge and the echo are driven by the same lean client (pre-encoded frames,
the reply read whole), one request a frame. The server's weights are sent by the client
(`model_load {config, weights}`), as ExPhil's live in Elixir; frames are embeddings (`embeds`),
as ExPhil's are.

With `--neighbour`, a process spins on one core for the whole run: a game, or a BEAM scheduler
busy-waiting, on the same 2-core machine. Everything above then shares the machine with it.

    python -m bench.models [--frames 300] [--batches 1,32] [--archs mamba,mamba2] [--neighbour]
                           [--json bench/results/models.json]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import subprocess
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

import protocol
from bridge.bench.floors import BridgeProcess, EchoUnavailable, encode_request, exchange, lane_call, open_floor
from bridge.bench.machine import at_least, comma_separated, output_path, summarize_us, write_results
from bridge.models import load_weights

from .game_loop import FRAME_SECONDS, wait_for_frame

WARMUP = 20
WINDOW = 60
ROLLBACK = 7  # frames a misprediction rolls back: the agent example's default
D_MODEL = 256
LM_VOCAB = 512  # the causal LMs' tokens: a game agent's action vocabulary, say
# Written before each read of the matrices from memory: several times any cache here.
EVICT_BYTES = 64 << 20
# exphil_model's architectures: any other name would be built as Mamba-2 and recorded under it.
ARCHS = ("mamba", "mamba2")
GOALS = {"step_over_transformers": 0.1, "step_over_echo": 3.0, "old_way_over_step": 4.0, "snapshot_restore_us": 50.0}


def archs_arg(text: str, known: tuple[str, ...] = ARCHS) -> list[str]:
    """argparse type of `--archs`: comma-separated names from `known` (a bench's own, ARCHS by
    default; `functools.partial` gives it others)."""
    names = text.split(",")
    if not all(name in known for name in names):
        raise argparse.ArgumentTypeError(f"expected comma-separated names from {', '.join(known)}, got {text!r}")
    return names


# argparse type of `--batches`
batches_arg = comma_separated(at_least(1), "batch sizes of 1 or more")


def exphil_model(arch: str, seed: int, lm: bool = False):
    """A random ExPhil-sized transformers backbone, or with `lm` a causal LM of LM_VOCAB tokens
    (its head tied to its embeddings), and the config and weights a client sends."""
    import transformers

    torch.manual_seed(seed)
    vocab = LM_VOCAB if lm else 8
    if arch == "mamba":
        config = transformers.MambaConfig(vocab_size=vocab, hidden_size=D_MODEL, state_size=16, num_hidden_layers=4,
                                          expand=2, conv_kernel=4)
        model = (transformers.MambaForCausalLM if lm else transformers.MambaModel)(config)
    else:
        config = transformers.Mamba2Config(vocab_size=vocab, hidden_size=D_MODEL, state_size=64, num_hidden_layers=4,
                                           expand=2, head_dim=64, num_heads=8, n_groups=1, conv_kernel=4)
        model = (transformers.Mamba2ForCausalLM if lm else transformers.Mamba2Model)(config)
    model.eval()
    sent = json.loads(config.to_json_string())
    sent["architectures"] = [type(model).__name__]
    weights = {name: p.detach().contiguous() for name, p in model.state_dict().items()}
    return model, sent, weights


def paced_in_turns(contenders: dict, frames: int, warmup: int, apart: float) -> dict[str, list[float]]:
    """Each of `contenders` (name -> run(frame index) -> µs) once a 60 FPS frame, `apart` of a
    frame after the one before, the order reversed every other frame (a paced time drifts with
    the box within seconds, more than the difference measured): each one's times after the first
    `warmup` frames."""
    names = list(contenders)
    times = {name: [] for name in names}
    start = time.perf_counter()
    for i in range(warmup + frames):
        for k, name in enumerate(names if i % 2 == 0 else names[::-1]):
            wait_for_frame(start, i + k * apart)
            us = contenders[name](i)
            if i >= warmup:
                times[name].append(us)
    return times


def transformers_steps(model, frames: list[torch.Tensor]) -> list[float]:
    """(a): transformers' cached step, one a frame, paced like the bridge's."""
    times = []
    with torch.no_grad():
        out = model(inputs_embeds=torch.stack(frames[:WINDOW], dim=1), use_cache=True)
        cache = out.cache
        start = time.perf_counter()
        for i, frame in enumerate(frames):
            wait_for_frame(start, i)
            t0 = time.perf_counter_ns()
            model(inputs_embeds=frame[:, None], cache=cache, use_cache=True)
            times.append((time.perf_counter_ns() - t0) / 1000)
    return times[WARMUP:]


class OldWay:
    """(b): the client runs every layer's norm, projections and conv; the server one `step` a layer."""

    def __init__(self, bridge: BridgeProcess, arch: str, config: dict, weights: dict, batch: int):
        self.model = load_weights(config, weights, torch.float32, torch.device("cpu"), lambda n: None)
        self.bridge, self.arch, self.batch = bridge, arch, batch
        c = self.model.config
        self.conv = [torch.zeros(batch, c.conv_dim, c.d_conv) for _ in self.model.layers]
        self.sessions, self.constants = [], []
        for layer in self.model.layers:
            if arch == "mamba":
                opened = bridge.call("session_open", batch=batch, dim=c.d_inner, state=c.d_state)
            else:
                opened = bridge.call("session_open", kind="ssd", batch=batch, heads=c.nheads, headdim=c.headdim,
                                     state=c.d_state)
            self.sessions.append(opened["session"])
            self.constants.append({name: protocol.HandleRef(bridge.call("put", tensor=t)["handle"])
                                   for name, t in (("A", layer.A), ("D", layer.D), ("dt_bias", layer.dt_bias))})
        self.slots = torch.arange(batch)

    def frame(self, embeds: torch.Tensor) -> float:
        """One frame's wall time, µs: the client's work and the layers' round trips."""
        from bridge.models.runtime import _conv_step, _gated_rms_norm, _rms_norm

        t0 = time.perf_counter_ns()
        c, lane = self.model.config, self.bridge.lane
        hidden = embeds
        with torch.no_grad():
            for i, layer in enumerate(self.model.layers):
                h = _rms_norm(hidden, layer.norm, c.eps)
                projected = F.linear(h, layer.in_proj)
                if self.arch == "mamba":
                    x, z = projected.split(c.d_inner, dim=-1)
                    x = _conv_step(layer, x, self.conv[i], self.slots)
                    dt, B, C = F.linear(x, layer.x_proj).split([c.dt_rank, c.d_state, c.d_state], dim=-1)
                    args = {"x": x, "dt": F.linear(dt, layer.dt_proj), "B": B, "C": C, "z": z}
                else:
                    z, xBC, dt = projected.split([c.d_inner, c.conv_dim, c.nheads], dim=-1)
                    x, B, C = _conv_step(layer, xBC, self.conv[i], self.slots).split(
                        [c.d_inner, c.ngroups * c.d_state, c.ngroups * c.d_state], dim=-1)
                    args = {"x": x.unflatten(-1, (c.nheads, c.headdim)), "dt": dt,
                            "B": B.unflatten(-1, (c.ngroups, c.d_state)), "C": C.unflatten(-1, (c.ngroups, c.d_state))}
                request = lane.frame(encode_request(i, "step", {"session": self.sessions[i], **self.constants[i],
                                                                "dt_softplus": True,
                                                                **{k: v.contiguous() for k, v in args.items()}}))
                _, reply = exchange(lane, request, "old-way step")
                y = torch.from_numpy(np.array(reply.result["y"].data, copy=True).view(np.float32)).view(
                    self.batch, -1)
                if self.arch == "mamba2":
                    y = _gated_rms_norm(y, z, layer.gate_norm, c.ngroups, c.eps)
                hidden = hidden + F.linear(y, layer.out_proj)
            _rms_norm(hidden, self.model.norm_f, c.eps)
        return (time.perf_counter_ns() - t0) / 1000


def snapshot_restore_pairs(lane, session: str, pairs: int, warmup: int) -> tuple[list[float], list[float]]:
    """`pairs` snapshot + restore pairs on `session` over `lane`, back to back after `warmup`
    more, each snapshot freed after: each pair's two round trips and the server's time for them,
    the two replies' `server_us` (µs)."""
    round_trips, server_us = [], []
    for i in range(warmup + pairs):
        start = time.perf_counter_ns()
        _, taken = exchange(lane, lane.frame(encode_request("s", "session_snapshot", {"session": session})))
        snapshot = taken.result["snapshot"]
        _, restored = exchange(lane, lane.frame(encode_request("r", "session_restore",
                                                               {"session": session, "snapshot": snapshot})))
        if i >= warmup:
            round_trips.append((time.perf_counter_ns() - start) / 1000)
            server_us.append(taken.timing["server_us"] + restored.timing["server_us"])
        exchange(lane, lane.frame(encode_request("f", "snapshot_free", {"snapshot": snapshot})))
    return round_trips, server_us


def rollback_refreshing_ring(lane, bridge, session: str, snapshot: str, corrected: list[torch.Tensor]) -> dict:
    """A rollback that keeps the ring whole: restore, then the corrected frames stepped, each
    after the first copying the state before it into its snapshot of the ring (a later
    misprediction may come back to any of them). As one request (session_restore with
    model_step frames taking snapshot_into) and as a restore and a model_step a frame,
    alternated."""
    ring = [bridge.call("session_snapshot", session=session)["snapshot"] for _ in corrected[1:]]
    steps = [{"embeds": frame, "output": "hidden", **({"snapshot_into": ring[i - 1]} if i else {})}
             for i, frame in enumerate(corrected)]
    restore = lane.frame(encode_request("r", "session_restore", {"session": session, "snapshot": snapshot}))
    one_by_one = [lane.frame(encode_request("s", "model_step", {"session": session, **step})) for step in steps]
    in_one = lane.frame(encode_request("o", "session_restore", {
        "session": session, "snapshot": snapshot, "frames": [{"op": "model_step", "args": step} for step in steps]}))
    apart_us, one_us = alternated_round_trips(lane, [restore, *one_by_one], [in_one])
    for into in ring:
        bridge.call("snapshot_free", snapshot=into)
    return {"rollback_ring_requests": summarize_us(apart_us), "rollback_ring_one_request": summarize_us(one_us)}


def alternated_round_trips(lane, first: list, second: list, rounds: int = 100, warmup: int = 10):
    """The µs each of two request sequences takes, sent one after the other `rounds` times (after
    `warmup` rounds): the two ways of the same work, timed in the same minutes."""
    first_us, second_us = [], []
    for i in range(warmup + rounds):
        t0 = time.perf_counter_ns()
        for frame in first:
            exchange(lane, frame)
        t1 = time.perf_counter_ns()
        for frame in second:
            exchange(lane, frame)
        if i >= warmup:
            first_us.append((t1 - t0) / 1000)
            second_us.append((time.perf_counter_ns() - t1) / 1000)
    return first_us, second_us


def rollback_ring_frames(bridge, model: str, batch: int, frames: list[torch.Tensor], count: int) -> dict:
    """A netcode client's frame: the state before it kept in a ring of ROLLBACK snapshots, then
    the step. Two sessions, prefilled alike, paced a frame apart and half a frame from each
    other, which goes first swapped each frame: one keeps its ring with requests of its own (a
    snapshot before the step, the snapshot ROLLBACK frames old freed after it), the other with
    `snapshot_into` on the step (one request). Each frame's round trips together (µs)."""
    lane = bridge.lane
    window = torch.stack(frames[:WINDOW], dim=1)
    own, into = (bridge.call("session_open", model=model, batch=batch)["session"] for _ in range(2))
    for session in (own, into):
        bridge.call("model_forward", session=session, embeds=window, output="hidden", last_only=True)
    ring = [bridge.call("session_snapshot", session=into)["snapshot"] for _ in range(ROLLBACK)]
    kept: list[str] = []

    def with_requests(i: int, embeds: torch.Tensor) -> float:
        t0 = time.perf_counter_ns()
        _, taken = exchange(lane, lane.frame(encode_request("s", "session_snapshot", {"session": own})))
        exchange(lane, lane.frame(encode_request(i, "model_step", {"session": own, "embeds": embeds,
                                                                   "output": "hidden"})))
        kept.append(taken.result["snapshot"])
        if len(kept) > ROLLBACK:
            exchange(lane, lane.frame(encode_request("f", "snapshot_free", {"snapshot": kept.pop(0)})))
        return (time.perf_counter_ns() - t0) / 1000

    def with_snapshot_into(i: int, embeds: torch.Tensor) -> float:
        request = lane.frame(encode_request(i, "model_step", {"session": into, "embeds": embeds, "output": "hidden",
                                                              "snapshot_into": ring[i % ROLLBACK]}))
        return exchange(lane, request)[0]

    inputs = frames[WINDOW:WINDOW + WARMUP + count]
    times = paced_in_turns({"own": lambda i: with_requests(i, inputs[i]),
                            "into": lambda i: with_snapshot_into(i, inputs[i])},
                           len(inputs) - WARMUP, WARMUP, apart=0.5)
    for snapshot in kept + ring:
        bridge.call("snapshot_free", snapshot=snapshot)
    for session in (own, into):
        bridge.call("session_close", session=session)
    return {"ring_frame_own_requests": summarize_us(times["own"]),
            "ring_frame_snapshot_into": summarize_us(times["into"])}


def snapshot_into_restores(lane, session: str, frame: torch.Tensor, rounds: int, warmup: int) -> dict:
    """The snapshot taken inside a step (`snapshot_into`) and the restore back to it, back to back
    after `warmup` more rounds: each round a step without it and one with it, in turns first, and
    a restore of that snapshot. The copy's cost is the difference of the two steps' `kernel_us`
    medians (the native path counts the copy there); with the restore's `server_us` median, the
    server's part of a snapshot + restore taken this way (µs)."""
    snapshot = lane_call(lane, "session_snapshot", {"session": session})["snapshot"]
    args = {"session": session, "embeds": frame, "output": "hidden"}
    plain = lane.frame(encode_request("p", "model_step", args))
    into = lane.frame(encode_request("i", "model_step", {**args, "snapshot_into": snapshot}))
    restore = lane.frame(encode_request("r", "session_restore", {"session": session, "snapshot": snapshot}))
    kernel = {"plain": [], "into": []}
    restore_us = []
    for i in range(warmup + rounds):
        for name, request in (("plain", plain), ("into", into))[::1 if i % 2 else -1]:
            _, reply = exchange(lane, request)
            if i >= warmup:
                kernel[name].append(reply.timing["kernel_us"])
        _, restored = exchange(lane, restore)
        if i >= warmup:
            restore_us.append(restored.timing["server_us"])
    lane_call(lane, "snapshot_free", {"snapshot": snapshot})
    copy_us = float(np.median(kernel["into"]) - np.median(kernel["plain"]))
    return {"step_kernel_plain": summarize_us(kernel["plain"]), "step_kernel_snapshot_into": summarize_us(kernel["into"]),
            "restore_server": summarize_us(restore_us), "snapshot_into_copy_us": copy_us,
            "snapshot_into_restore_server_us": copy_us + float(np.median(restore_us))}


def timed_us(fn, n: int) -> list[float]:
    times = []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        fn()
        times.append((time.perf_counter_ns() - t0) / 1000)
    return times


def floors(config: dict, weights: dict, frames: list[torch.Tensor], batch: int) -> dict:
    """What bounds a model step on this machine, in this process, back to back: one torch op's
    dispatch (a [1, 256] add), the stack's matrix products alone (its weights streamed once), and
    the runtime's whole step (bridge.models on the cpu backend, no IPC); and what bounds a paced
    one: the step's matrices read once from memory, after a write of EVICT_BYTES has pushed them
    out of the caches (as a frame's wait does: docs/performance.md, "model step")."""
    m = load_weights(config, weights, torch.float32, torch.device("cpu"), lambda n: None)
    parts = {name: torch.zeros((batch, *shape)) for name, shape in m.config.state_parts()}
    slots, x = torch.arange(batch), frames[0]
    small = torch.randn(1, D_MODEL)
    products = []
    for layer in m.layers:
        width = layer.in_proj.shape[1]
        products.append((torch.randn(batch, width), layer.in_proj))
        products.append((torch.randn(batch, layer.out_proj.shape[1]), layer.out_proj))
        for w in (layer.x_proj, layer.dt_proj):
            if w is not None:
                products.append((torch.randn(batch, w.shape[1]), w))

    def all_products():
        for a, w in products:
            F.linear(a, w)

    matrices = torch.cat([w.flatten() for _, w in products])
    scratch = torch.zeros(EVICT_BYTES // 4)

    def matrices_from_memory() -> float:
        scratch.add_(1.0)
        t0 = time.perf_counter_ns()
        matrices.sum()
        return (time.perf_counter_ns() - t0) / 1000

    with torch.no_grad():
        for fn in (lambda: small + 1, all_products, lambda: m.step(parts, slots, x, output="hidden", backend="cpu")):
            timed_us(fn, 20)
        return {"torch_op": summarize_us(timed_us(lambda: small + 1, 2000)),
                "matrix_products": summarize_us(timed_us(all_products, 200)),
                "stack_step_in_process": summarize_us(timed_us(
                    lambda: m.step(parts, slots, x, output="hidden", backend="cpu"), 200)),
                "matrices_from_memory": {**summarize_us([matrices_from_memory() for _ in range(50)]),
                                         "bytes": matrices.nbytes}}


def run_case(arch: str, batch: int, frames_n: int, server_args: list[str]) -> dict:
    model, config, weights = exphil_model(arch, seed=batch)
    g = torch.Generator().manual_seed(7)
    frames = [torch.randn(batch, D_MODEL, generator=g) for _ in range(frames_n + WINDOW)]
    result = {"arch": arch, "batch": batch, "layers": 4, "d_model": D_MODEL, "frames": frames_n}

    result["transformers_step"] = summarize_us(transformers_steps(model, frames))
    result["floors"] = floors(config, weights, frames, batch)

    bridge = BridgeProcess(server_args)
    lane = bridge.lane
    try:
        info = bridge.call("model_load", config=config, weights=weights)
        result["backend"] = bridge.call("info")["backend"]
        session = bridge.call("session_open", model=info["model"], batch=batch)["session"]
        bridge.call("model_forward", session=session, embeds=torch.stack(frames[:WINDOW], dim=1), output="hidden")
        steps = [lane.frame(encode_request(i, "model_step", {"session": session, "embeds": f, "output": "hidden"}))
                 for i, f in enumerate(frames[WINDOW:])]
        for request in steps[:WARMUP]:
            exchange(lane, request)
        try:
            echo = open_floor("stdio", lane.reply_sizes())
            # (e) the echo that first reads as many bytes as the step's matrices hold
            reading = open_floor("stdio", lane.reply_sizes(), read_bytes=result["floors"]["matrices_from_memory"]["bytes"])
            for request in steps[:WARMUP]:
                echo.round_trip_us(request)
                reading.round_trip_us(request)
        except EchoUnavailable as exc:
            echo, reading, result["echo_skipped"] = None, None, str(exc)
        step_us, echo_us, reading_us, kernel_us, server_us = [], [], [], [], []
        start = time.perf_counter()
        for i, request in enumerate(steps):
            wait_for_frame(start, i)
            us, reply = exchange(lane, request)
            step_us.append(us)
            kernel_us.append(reply.timing.get("kernel_us", 0.0))
            server_us.append(reply.timing.get("server_us", 0.0))
            if echo is not None:
                wait_for_frame(start, i + 0.5)
                echo_us.append(echo.round_trip_us(request))
                wait_for_frame(start, i + 0.75)
                reading_us.append(reading.round_trip_us(request))
        if echo is not None:
            echo.close()
            reading.close()
        result["model_step"] = summarize_us(step_us)
        result["model_step_server"] = summarize_us(server_us)
        result["model_step_kernel"] = summarize_us(kernel_us)
        result["request_bytes"] = sum(memoryview(p).nbytes for p in steps[0])
        if echo_us:
            result["echo"] = summarize_us(echo_us)
            result["echo_reading_matrices"] = summarize_us(reading_us)

        # (c) the window re-run every frame, from a zero state.
        blank = bridge.call("session_open", model=info["model"], batch=batch)["session"]
        zero = bridge.call("session_snapshot", session=blank)["snapshot"]
        window_us = []
        start = time.perf_counter()
        for i in range(min(frames_n, 60)):
            wait_for_frame(start, i)
            window = torch.stack(frames[i + 1:i + 1 + WINDOW], dim=1)
            t0 = time.perf_counter_ns()
            exchange(lane, lane.frame(encode_request("r", "session_restore", {"session": blank, "snapshot": zero})))
            exchange(lane, lane.frame(encode_request("w", "model_forward", {
                "session": blank, "embeds": window, "output": "hidden", "last_only": True})))
            window_us.append((time.perf_counter_ns() - t0) / 1000)
        result["window_forward"] = summarize_us(window_us)

        # Snapshot + restore, the rollback's own cost.
        pair_us, pair_server_us = snapshot_restore_pairs(lane, session, 90, warmup=10)
        result["snapshot_restore_round_trips"] = summarize_us(pair_us)
        result["snapshot_restore_server"] = summarize_us(pair_server_us)
        result["snapshot_into_restore"] = snapshot_into_restores(lane, session, frames[WINDOW], 90, warmup=10)

        # A rollback: restore and re-simulate ROLLBACK frames, in two requests and in one.
        snapshot = bridge.call("session_snapshot", session=session)["snapshot"]
        resimulate = {"embeds": torch.stack(frames[WINDOW:WINDOW + ROLLBACK], dim=1), "output": "hidden",
                      "last_only": True}
        restore = lane.frame(encode_request("r", "session_restore", {"session": session, "snapshot": snapshot}))
        forward = lane.frame(encode_request("w", "model_forward", {"session": session, **resimulate}))
        in_one = lane.frame(encode_request("o", "session_restore", {
            "session": session, "snapshot": snapshot, "frames": [{"op": "model_forward", "args": resimulate}]}))
        two_us, one_us = alternated_round_trips(lane, [restore, forward], [in_one])
        result["rollback_two_requests"] = summarize_us(two_us)
        result["rollback_one_request"] = summarize_us(one_us)
        result.update(rollback_refreshing_ring(lane, bridge, session, snapshot, frames[WINDOW:WINDOW + ROLLBACK]))
        result.update(rollback_ring_frames(bridge, info["model"], batch, frames, min(frames_n, 120)))

        # (b) the old way: a round trip per layer.
        old = OldWay(bridge, arch, config, weights, batch)
        for f in frames[:WARMUP]:
            old.frame(f)
        old_us = []
        start = time.perf_counter()
        for i, f in enumerate(frames[WINDOW:WINDOW + min(frames_n, 120)]):
            wait_for_frame(start, i)
            old_us.append(old.frame(f))
        result["old_way"] = summarize_us(old_us)
    finally:
        bridge.close()

    p50 = result["model_step"]["p50_us"]
    result["ratios"] = {
        "step_over_transformers": p50 / result["transformers_step"]["p50_us"],
        "old_way_over_step": result["old_way"]["p50_us"] / p50,
        "window_over_step": result["window_forward"]["p50_us"] / p50,
        "rollback_two_over_one": result["rollback_two_requests"]["p50_us"] / result["rollback_one_request"]["p50_us"],
        "rollback_ring_requests_over_one": (result["rollback_ring_requests"]["p50_us"]
                                            / result["rollback_ring_one_request"]["p50_us"]),
        "rollback_ring_one_over_window": (result["rollback_ring_one_request"]["p50_us"]
                                          / result["rollback_one_request"]["p50_us"]),
        "ring_own_requests_over_snapshot_into": (result["ring_frame_own_requests"]["p50_us"]
                                                 / result["ring_frame_snapshot_into"]["p50_us"]),
    }
    if "echo" in result:
        result["ratios"]["step_over_echo"] = p50 / result["echo"]["p50_us"]
        # What any server that reads the matrices to answer would give, over the goals' baselines
        reading = result["echo_reading_matrices"]["p50_us"]
        result["ratios"]["echo_reading_matrices_over_transformers"] = reading / result["transformers_step"]["p50_us"]
        result["ratios"]["echo_reading_matrices_over_echo"] = reading / result["echo"]["p50_us"]
    return result


def report(r: dict) -> None:
    def line(name, s):
        return f"    {name:<34} p50 {s['p50_us']:9.1f} µs  p99 {s['p99_us']:9.1f} µs"

    print(f"{r['arch']} batch {r['batch']} (backend {r.get('backend')}):")
    print(line("model_step over the Port", r["model_step"]))
    for name, floor in r["floors"].items():
        print(line(f"  floor: {name}", floor))
    print(line("  of which the server", r["model_step_server"]))
    print(line("  of which the stack (kernel_us)", r["model_step_kernel"]))
    print(line("(a) transformers cached step", r["transformers_step"]))
    print(line("(b) old way, a step a layer", r["old_way"]))
    print(line("(c) 60-frame window re-run", r["window_forward"]))
    if "echo" in r:
        print(line("(d) echo of the same bytes", r["echo"]))
        print(line("(e) echo reading the matrices", r["echo_reading_matrices"]))
    print(line("snapshot + restore round trips", r["snapshot_restore_round_trips"]))
    print(line("  of which the server", r["snapshot_restore_server"]))
    into = r["snapshot_into_restore"]
    print(f"    snapshot_into's copy {into['snapshot_into_copy_us']:.1f} µs (step kernel_us p50 "
          f"{into['step_kernel_snapshot_into']['p50_us']:.1f} against {into['step_kernel_plain']['p50_us']:.1f}), "
          f"with the restore's server part {into['snapshot_into_restore_server_us']:.1f} µs")
    print(line(f"rollback of {ROLLBACK}: two requests", r["rollback_two_requests"]))
    print(line(f"rollback of {ROLLBACK}: one request", r["rollback_one_request"]))
    print(line(f"rollback of {ROLLBACK}, ring refreshed: a request each", r["rollback_ring_requests"]))
    print(line(f"rollback of {ROLLBACK}, ring refreshed: one request", r["rollback_ring_one_request"]))
    print(line(f"ring of {ROLLBACK}: own requests a frame", r["ring_frame_own_requests"]))
    print(line(f"ring of {ROLLBACK}: snapshot_into", r["ring_frame_snapshot_into"]))
    ratios = r["ratios"]
    print(f"    step / transformers {ratios['step_over_transformers']:.3f} (goal ≤ {GOALS['step_over_transformers']}),"
          f" old way / step {ratios['old_way_over_step']:.2f}× (goal ≥ {GOALS['old_way_over_step']}),"
          + (f" step / echo {ratios['step_over_echo']:.2f}× (goal ≤ {GOALS['step_over_echo']})"
             if "step_over_echo" in ratios else " echo skipped"))


@contextlib.contextmanager
def busy_neighbour(enabled: bool):
    """While the block runs, a process spinning on one core (`--neighbour`) where `enabled`;
    the block is given that process (its Popen), or None."""
    neighbour = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if enabled else None
    try:
        yield neighbour
    finally:
        if neighbour is not None:
            neighbour.kill()
            neighbour.wait()


def case_main(prog: str, doc: str, benchmark: str, run_case, report, argv=None, archs: tuple[str, ...] = ARCHS) -> int:
    """The command line of a bench over bench.models' ExPhil-sized cases: `run_case(arch, batch,
    frames)` for each arch (of `archs`, the names run_case builds) and batch asked for, each
    reported, all written as `benchmark`."""
    p = argparse.ArgumentParser(prog=prog, description=doc.splitlines()[0])
    p.add_argument("--frames", type=int, default=300)
    p.add_argument("--batches", type=batches_arg, default="1,32")
    p.add_argument("--archs", type=functools.partial(archs_arg, known=archs), default="mamba,mamba2")
    p.add_argument("--json", type=output_path)
    args = p.parse_args(argv)
    if args.frames <= WARMUP:
        p.error(f"--frames: expected more than the {WARMUP} warm-up frames, got {args.frames}")
    cases = []
    for arch in args.archs:
        for batch in args.batches:
            cases.append(run_case(arch, batch, args.frames))
            report(cases[-1])
    if args.json:
        write_results(args.json, benchmark, {"frame_seconds": FRAME_SECONDS, "cases": cases})
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--frames", type=int, default=300)
    p.add_argument("--batches", type=batches_arg, default="1,32")
    p.add_argument("--archs", type=archs_arg, default="mamba,mamba2")
    p.add_argument("--server-arg", action="append", default=[])
    p.add_argument("--neighbour", action="store_true", help="keep one core busy with another process throughout")
    p.add_argument("--json", type=output_path)
    args = p.parse_args(argv)
    if args.frames <= WARMUP:
        p.error(f"--frames: expected more than the {WARMUP} warm-up frames, got {args.frames}")
    load_before = os.getloadavg()
    cases = []
    with busy_neighbour(args.neighbour):
        for arch in args.archs:
            for batch in args.batches:
                cases.append(run_case(arch, batch, args.frames, args.server_arg))
                report(cases[-1])
    if args.json:
        write_results(args.json, "models", {"goals": GOALS, "cases": cases, "load_before": load_before,
                                            "load_after": os.getloadavg(), "torch_threads": torch.get_num_threads(),
                                            "neighbour": args.neighbour})
    return 0


if __name__ == "__main__":
    from bridge.bench import exit_on_stop_signals

    exit_on_stop_signals()
    raise SystemExit(main())
