"""Whole models (protocol/SPEC.md §6.4): model_load, model_free, model_forward, model_step.

The models themselves live in bridge.models; a model's sessions are ordinary sessions
(bridge.sessions) whose state rows hold every layer's conv window and ssm state, opened,
snapshotted, restored and forked by the session ops (bridge.ops.sessions). model_step is
batched: steps of sessions of one model share one pass through the stack; a lone step takes
the native path (bridge.native) where the server has it.
"""

from __future__ import annotations

import torch

import protocol

from .. import models
from ..batcher import BatchedOp, Item, charge, dtype_of, row_signature, stack_rows, wire_rows
from ..dispatcher import Background
from ..errors import OpError
from ..native import NativeStep
from ..sessions import WritingState
from ..tensors import TORCH_DTYPES, host_view, to_wire, wire_name
from ..timing import now_ns
from .sessions import check_reply_with_state_fits, session_of_kind, wire_state, with_states


# A model's name is kept with it and echoed in replies: a bound on what a request makes the
# server hold.
MAX_NAME_BYTES = 256
# Linux's PATH_MAX: no longer path opens, and resolving one costs the loader time quadratic in
# its length, every other connection's load waiting behind it.
MAX_PATH_BYTES = 4096


def model_load(server, call) -> dict:
    args = call.args
    dtype = TORCH_DTYPES[args.get("dtype", "f32")]
    name_bytes = len(args.get("name", "").encode())
    if name_bytes > MAX_NAME_BYTES:
        _invalid("args.name", f"a name of at most {MAX_NAME_BYTES} bytes (UTF-8)", f"{name_bytes} bytes")
    from_path = "path" in args
    path_bytes = len(args["path"].encode(errors="surrogatepass")) if from_path else 0
    if path_bytes > MAX_PATH_BYTES:
        _invalid("args.path", f"a path of at most {MAX_PATH_BYTES} bytes (UTF-8)", f"{path_bytes} bytes")
    sent = [name for name in ("config", "weights") if name in args]
    if from_path == bool(sent) or (sent and len(sent) != 2):
        got = ", ".join((["path"] if from_path else []) + sent) or "none of them"
        raise OpError("invalid_argument",
                      f"args: expected either path, or config and weights, got {got}",
                      {"field": "args", "expected": "either path, or config and weights", "got": got})
    if from_path:
        def load(hold):
            return models.load_checkpoint(args["path"], server.model_dirs, dtype, server.device, hold)
    else:
        # Wire bytes stay a view of the frame until the budget is checked: the model's own copy
        # (models._build) is then the only one. A handle's tensor is on the device already.
        weights = {name: host_view(value) if isinstance(value, protocol.WireTensor)
                   else server.tensor_in_map(call, value, protocol.key_path("args.weights", name))
                   for name, value in args["weights"].items()}

        def load(hold):
            return models.load_weights(args["config"], weights, dtype, server.device, hold)
    def finish() -> dict:
        start = now_ns()
        loaded = server.load_model(call.conn, load, args.get("name"))
        call.timing.add("h2d", now_ns() - start)
        return loaded.describe()

    # A load can take seconds: its read and build run apart from the other ops, so other
    # connections' steps go on meanwhile (the tables it adds to lock themselves). Not on CUDA,
    # where its allocations beside a step graph's capture would void the capture.
    return finish() if server.device.type == "cuda" else Background(finish)


# A reader thread serving it would read nothing else meanwhile (health, a cancel): the worker
# serves it (Dispatcher.on_frame), and finishes it in the background (Background).
model_load.worker_only = True


def model_free(server, call) -> dict:
    loaded = server.model(call.conn, call.args["model"], "args.model")
    server.free_model(call.conn, loaded)
    return {"freed": True}


def model_session(server, call):
    """The request's session and its model."""
    session = session_of_kind(server, call, ("model",), call.op)
    # The model is the session's connection's, and cannot be freed while the session is open.
    return session, server.model(call.conn, session.layout.model, "args.session")


def model_input(server, call, session, loaded, step: bool) -> tuple[str, object]:
    """("tokens" | "embeds", the value as it came), checked against the session and model:
    tokens [batch] (a step) or [batch, seq], integer ids in the vocabulary; embeds the same
    with d_model after them, floating."""
    args = call.args
    given = [name for name in ("tokens", "embeds") if name in args]
    if len(given) != 1:
        got = " and ".join(given) or "neither"
        raise OpError("invalid_argument", f"args: expected exactly one of tokens and embeds, got {got}",
                      {"field": "args", "expected": "exactly one of tokens and embeds", "got": got})
    name = given[0]
    value = server.tensor_arg(call, name)
    config = loaded.model.config
    field = f"args.{name}"
    want = [session.batch] if step else [session.batch, "seq"]
    if name == "embeds":
        want.append(config.d_model)
    shape = list(value.shape)
    if len(shape) != len(want) or any(s != w if w != "seq" else s == 0 for w, s in zip(want, shape)):
        raise OpError("shape_mismatch", f"{field}: expected shape {want} (the session's batch), got {shape}",
                      {"field": field, "expected": f"shape {want}", "got": str(shape)})
    if name == "embeds":
        dtype = dtype_of(value)
        if not dtype.is_floating_point:
            _invalid(field, "a floating tensor (f32, bf16, f16, f64)", wire_name(dtype))
        return name, value
    if not config.has_embeddings:
        _invalid(field, "embeds, not tokens: this model has no embedding", "tokens")
    checked_ints(value, field, config.vocab_size, f"token ids in [0, {config.vocab_size})")
    return name, value


TOKEN_DTYPES = (torch.int32, torch.int64, torch.uint8)


def checked_ints(value, field: str, limit: int, expected: str) -> torch.Tensor:
    """`value` (wire bytes or a handle's tensor) as a tensor of integers each in [0, limit),
    read where it lies; else invalid_argument naming `field`, `expected` saying the range."""
    dtype = dtype_of(value)
    if dtype not in TOKEN_DTYPES:
        _invalid(field, "an integer tensor (i32, i64, u8)", wire_name(dtype))
    ints = host_view(value) if isinstance(value, protocol.WireTensor) else value
    if ints.numel():
        low, high = int(ints.min()), int(ints.max())
        if low < 0 or high >= limit:
            _invalid(field, expected, str(low if low < 0 else high))
    return ints


def window_lengths(server, call, session, seq: int) -> torch.Tensor | None:
    """`lengths`, how many of the window's positions each row runs (0 .. seq), as int64 on the
    host; None where not given. Checked before anything runs, so a bad one changes no state."""
    if "lengths" not in call.args:
        return None
    value = server.tensor_arg(call, "lengths")
    field = "args.lengths"
    shape = list(value.shape)
    if shape != [session.batch]:
        raise OpError("shape_mismatch", f"{field}: expected shape [{session.batch}] (the session's batch), got {shape}",
                      {"field": field, "expected": f"shape [{session.batch}]", "got": str(shape)})
    lengths = checked_ints(value, field, seq + 1, f"lengths in [0, {seq}] (the window's positions)")
    return lengths.to("cpu", torch.int64)


def _invalid(field: str, expected: str, got: str):
    raise OpError("invalid_argument", f"{field}: expected {expected}, got {got}",
                  {"field": field, "expected": expected, "got": got})


def output_of(call, loaded) -> str:
    """What the request asks for: logits by default where the model has a head, else hidden."""
    has_logits = loaded.model.config.has_logits
    output = call.args.get("output", "logits" if has_logits else "hidden")
    if output == "logits" and not has_logits:
        _invalid("args.output", '"hidden": this model has no head', '"logits"')
    return output


def output_bytes(loaded, positions: int, output: str) -> int:
    """Bytes of a model's output (logits or hidden) of `positions` vectors (its rows times its
    positions): what a reply carries beside any state."""
    config = loaded.model.config
    width = config.vocab_size if output == "logits" else config.d_model
    return positions * width * torch.promote_types(loaded.model.dtype, torch.float32).itemsize  # as the runtime's


def model_forward(server, call) -> dict:
    session, loaded = model_session(server, call)
    _, value = model_input(server, call, session, loaded, step=False)
    lengths = window_lengths(server, call, session, seq=value.shape[1])
    output = output_of(call, loaded)
    # Logits of a big vocabulary over a long window may be past what a reply carries.
    positions = value.shape[0] * (1 if call.args.get("last_only") else value.shape[1])
    check_reply_with_state_fits(call, session, output_bytes(loaded, positions, output))
    start = now_ns()
    inputs = server.device_tensor(value) if isinstance(value, protocol.WireTensor) else value
    call.timing.add("h2d", now_ns() - start)
    with WritingState([session]):
        with server.kernel_timer(call):
            out = loaded.model.forward(session.pool.parts, session.slots, inputs, output=output,
                                       last_only=bool(call.args.get("last_only", False)), backend=server.backend,
                                       lengths=lengths)
        start = now_ns()
        result = {output: to_wire(out)}
        if call.args.get("return_state"):
            result["state"] = wire_state(session)
    call.timing.add("d2h", now_ns() - start)
    return result


class ModelStepOp(BatchedOp):
    """One frame through the whole stack for every row of a session; steps of sessions of one
    model (and one input kind, dtype and output) share the pass."""

    def fast_path(self, server) -> NativeStep | None:
        """Model steps served from frame to reply in C++ (bridge.native, the path plain steps
        take too), where the server runs the CPU kernels and its config allows it; None: every
        model step goes the general way."""
        return NativeStep.for_server(server) if server.config.native_step else None

    def prepare(self, server, call) -> Item:
        session, loaded = model_session(server, call)
        name, value = model_input(server, call, session, loaded, step=True)
        output = output_of(call, loaded)
        check_reply_with_state_fits(call, session, output_bytes(loaded, session.batch, output))
        key = ("model_step", loaded.id, name, row_signature(value), output)
        options = {"output": output, "model": loaded}
        if "snapshot_into" in call.args:
            options["snapshot_into"] = server.snapshots.of_session_like(call.conn.id, call.args["snapshot_into"],
                                                                        session, "args.snapshot_into")
        return Item(call, key, session.batch, {name: value}, {}, session, options)

    def run(self, server, items: list[Item]) -> list[dict]:
        lead = items[0]
        loaded, output = lead.options["model"], lead.options["output"]
        (name,) = lead.tensors
        start = now_ns()
        inputs = stack_rows(server, [item.tensors[name] for item in items])
        slots = stack_rows(server, [item.session.slots for item in items])
        charge(items, "h2d", now_ns() - start)
        # The sessions are written from the step on: a snapshot copy failing before it leaves
        # them as they were, the snapshot undefined (Snapshot.take_again).
        written = []
        with WritingState(written):
            with server.kernel_timer(*(item.call for item in items)):
                # The state before the frame, into the snapshots asked for (a rollback's point
                # without a round trip of its own); part of the frame's device work.
                for item in items:
                    if "snapshot_into" in item.options:
                        item.options["snapshot_into"].take_again(item.session)
                written.extend(item.session for item in items)
                out = None
                if server.model_step_graphs is not None:
                    out = server.model_step_graphs.step(loaded.model, lead.session.pool.parts, slots, inputs,
                                                        output=output, backend=server.backend)
                if out is None:
                    out = loaded.model.step(lead.session.pool.parts, slots, inputs, output=output,
                                            backend=server.backend)
            return with_states(items, [{output: rows} for rows in wire_rows(out, items)])


model_step = ModelStepOp()

HANDLERS = {
    "model_load": model_load,
    "model_free": model_free,
    "model_forward": model_forward,
    "model_step": model_step,
}
