"""`return_state` on step, model_step and model_forward (SPEC §6.1, §6.4): the reply carries the
session's state after the frame, exactly what a session_state sent right after returns.

- on named cases: a plain Mamba-1 and a Mamba-2 session stepped, and a session of a tiny Mamba
  and Mamba-2 model stepped and prefilled; the output is the one a twin session gives without
  asking;
- a request that asks shares its launch with one that does not, and each gets its own answer;
- a value that is not a bool is refused by name, and the server serves on;
- a state that a reply cannot carry (past a tensor's or a frame's limit) is refused before the
  frame runs (step, scan and ssd_scan prefills, model_step, model_forward; the native path too);
- a step that asks is declined by the native step path and answered by the general one;
- a step replayed from a captured state update (CUDA graphs; a stand-in capture on the CPU)
  returns the state too;
- the Python client returns it beside the output, over the Port.

Servers run in-process (tests/bridge_fakes.py); inputs are fresh random values, the seed in
every failure message.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import pytest
import torch

import scan_kernels
import protocol
from bridge.client import result_from_wire
from bridge.models.config import parse_config
from bridge.models.weights import expected_shapes
from bridge.step_graphs import StepGraphs
from bridge_fakes import RecordingConnection, served_natively
from kernel_cases import random_seed

# The server's own config keys: tiny backbones that take embeddings and give hidden states.
MODEL_CONFIGS = {
    "mamba": {"arch": "mamba", "d_model": 8, "n_layer": 2, "d_state": 4, "d_conv": 4, "expand": 2},
    "mamba2": {"arch": "mamba2", "d_model": 8, "n_layer": 2, "d_state": 4, "d_conv": 3, "expand": 2,
               "headdim": 4, "ngroups": 1},
}
D_MODEL = 8


def uniform(gen: torch.Generator, shape, lo: float, hi: float) -> torch.Tensor:
    return torch.rand(*shape, generator=gen) * (hi - lo) + lo


def tiny_weights(arch: str, gen: torch.Generator) -> dict:
    """Every weight of the backbone random, A_log and the dt biases in their working ranges."""
    weights = {}
    for name, shape in expected_shapes(parse_config(MODEL_CONFIGS[arch])).items():
        if name.endswith("A_log"):
            weights[name] = uniform(gen, shape, -1.0, 1.5)
        elif name.endswith(("dt_bias", "dt_proj.bias")):
            weights[name] = uniform(gen, shape, -3.0, 0.0)
        elif name.endswith("norm.weight"):
            weights[name] = uniform(gen, shape, 0.5, 1.5)
        else:
            weights[name] = torch.randn(*shape, generator=gen) * 0.3
    return weights


@dataclass(frozen=True)
class Case:
    """`kind`: "mamba" or "ssd" (a plain session given `op`: step, or scan or ssd_scan, a
    prefill), or a model's arch, whose session gets `op`, model_step or model_forward."""

    kind: str
    op: str
    batch: int = 2


CASES = [
    pytest.param(Case("mamba", "step"), id="plain-mamba-step"),
    pytest.param(Case("ssd", "step", batch=3), id="plain-ssd-step"),
    pytest.param(Case("mamba", "model_step"), id="mamba-model-step"),
    pytest.param(Case("mamba", "model_forward"), id="mamba-model-forward"),
    pytest.param(Case("mamba2", "model_step", batch=1), id="mamba2-model-step"),
    pytest.param(Case("mamba2", "model_forward"), id="mamba2-model-forward"),
]

# Plain sessions' sizes: Mamba-1 dim and state; Mamba-2 heads, headdim, groups and state; a
# window's positions (a prefill's, a model_forward's).
DIM, STATE = 6, 4
HEADS, HEADDIM, GROUPS = 4, 3, 2
SEQ = 3


class Scene:
    """One in-process server (None: the inputs only), its connection and the seeded inputs of
    one case's sessions: a model loaded for a model op, one A shared by a plain case's steps."""

    def __init__(self, srv, case: Case, seed: int, conn: RecordingConnection | None = None):
        self.srv, self.case, self.seed = srv, case, seed
        self.conn = conn or RecordingConnection()
        self.gen = torch.Generator().manual_seed(seed)
        self.model = self.A = None
        if not case.op.startswith("model_"):
            self.A = -uniform(self.gen, (HEADS,) if case.kind == "ssd" else (DIM, STATE), 0.1, 2.0)
        elif srv is not None:
            weights = tiny_weights(case.kind, self.gen)
            self.model = self.call("model_load", config=MODEL_CONFIGS[case.kind], weights=weights)["model"]

    def call(self, op: str, **args) -> dict:
        return self.srv.call(self.conn, op, **args)

    def open(self) -> str:
        b = self.case.batch
        if self.model is not None:
            dims = {"model": self.model, "batch": b}
        elif self.case.kind == "ssd":
            dims = {"kind": "ssd", "batch": b, "heads": HEADS, "headdim": HEADDIM, "state": STATE}
        else:
            dims = {"batch": b, "dim": DIM, "state": STATE}
        return self.call("session_open", **dims)["session"]

    def frame(self) -> dict:
        """One request's inputs (session and return_state aside)."""
        b = self.case.batch
        if self.case.op == "model_step":
            return {"embeds": torch.randn(b, D_MODEL, generator=self.gen)}
        if self.case.op == "model_forward":
            return {"embeds": torch.randn(b, SEQ, D_MODEL, generator=self.gen)}
        if self.case.op == "scan":
            return {"x": torch.randn(b, SEQ, DIM, generator=self.gen),
                    "dt": uniform(self.gen, (b, SEQ, DIM), 0.05, 0.5), "A": self.A,
                    "B": torch.randn(b, SEQ, STATE, generator=self.gen),
                    "C": torch.randn(b, SEQ, STATE, generator=self.gen)}
        if self.case.op == "ssd_scan":
            return {"x": torch.randn(b, SEQ, HEADS, HEADDIM, generator=self.gen),
                    "dt": uniform(self.gen, (b, SEQ, HEADS), 0.05, 0.5), "A": self.A,
                    "B": torch.randn(b, SEQ, GROUPS, STATE, generator=self.gen),
                    "C": torch.randn(b, SEQ, GROUPS, STATE, generator=self.gen)}
        if self.case.kind == "ssd":
            return {"x": torch.randn(b, HEADS, HEADDIM, generator=self.gen),
                    "dt": uniform(self.gen, (b, HEADS), 0.05, 0.5), "A": self.A,
                    "B": torch.randn(b, GROUPS, STATE, generator=self.gen),
                    "C": torch.randn(b, GROUPS, STATE, generator=self.gen)}
        return {"x": torch.randn(b, DIM, generator=self.gen), "dt": uniform(self.gen, (b, DIM), 0.05, 0.5),
                "A": self.A, "B": torch.randn(b, STATE, generator=self.gen),
                "C": torch.randn(b, STATE, generator=self.gen)}

    def state(self, session: str):
        return self.call("session_state", session=session)["state"]


def output_of(result: dict) -> torch.Tensor:
    (out,) = (value for key, value in result.items() if key != "state")
    return out


def assert_same_state(got, expected, what: str) -> None:
    """Equal bit for bit, of the form session_state gives: a tensor, or a map of parts."""
    if isinstance(expected, dict):
        assert isinstance(got, dict) and sorted(got) == sorted(expected), f"{what}: parts {sorted(got)}"
        for name in expected:
            assert_same_state(got[name], expected[name], f"{what} {name}")
        return
    assert isinstance(got, torch.Tensor), f"{what}: got {type(got).__name__}"
    assert got.dtype == expected.dtype == torch.float32, f"{what}: {got.dtype}, {expected.dtype}"
    assert torch.equal(got, expected), f"{what}: differs by {(got - expected).abs().max()}"


def is_zero(state) -> bool:
    parts = state.values() if isinstance(state, dict) else [state]
    return all(bool((part == 0).all()) for part in parts)


@pytest.mark.parametrize("case", CASES)
def test_the_state_returned_is_session_state_right_after(inproc, case):
    seed = random_seed()
    scene = Scene(inproc(), case, seed)
    asking, twin = scene.open(), scene.open()
    for t in range(3):
        frame = scene.frame()
        asked = scene.call(case.op, session=asking, return_state=True, **frame)
        plain = scene.call(case.op, session=twin, **frame)
        assert "state" not in plain, f"seed={seed}: a reply that did not ask carries the state"
        assert torch.equal(output_of(asked), output_of(plain)), f"seed={seed}: frame {t}'s output changed"
        after = scene.state(asking)
        assert_same_state(asked["state"], after, f"seed={seed}, frame {t}")
        assert not is_zero(after), f"seed={seed}: the frames left the state zero"
        assert_same_state(after, scene.state(twin), f"seed={seed}, frame {t}, the twin's")


def test_the_alias_return_last_state_asks_too(inproc):
    seed = random_seed()
    scene = Scene(inproc(), Case("mamba2", "model_step"), seed)
    session = scene.open()
    asked = scene.call("model_step", session=session, return_last_state=True, **scene.frame())
    assert_same_state(asked["state"], scene.state(session), f"seed={seed}")


@pytest.mark.parametrize("asking_first", [pytest.param(True, id="asking-first"),
                                          pytest.param(False, id="asking-second")])
@pytest.mark.parametrize("case", [pytest.param(Case("mamba", "step"), id="step"),
                                  pytest.param(Case("ssd", "step"), id="ssd-step"),
                                  pytest.param(Case("mamba2", "model_step"), id="model-step")])
def test_one_asking_and_one_not_share_a_launch(inproc, case, asking_first):
    seed = random_seed()
    scene = Scene(inproc(max_delay_us=0), case, seed)
    srv, conn = scene.srv, scene.conn
    asking, quiet, asking_alone, quiet_alone = (scene.open() for _ in range(4))
    frames = [scene.frame(), scene.frame()]
    srv.hold(conn)
    requests = [(asking, frames[0], {"return_state": True}), (quiet, frames[1], {})]
    ids = [srv.submit(conn, case.op, session=session, **frame, **ask)
           for session, frame, ask in (requests if asking_first else requests[::-1])]
    srv.go()
    replies = [conn.reply(i) for i in (ids if asking_first else ids[::-1])]
    assert all(r.ok for r in replies), f"seed={seed}: {[r.error for r in replies]}"
    assert [r.timing["batch_rows"] for r in replies] == [2 * case.batch] * 2, f"seed={seed}: not one launch"
    (asked, plain) = (result_from_wire(r.result, as_torch=True) for r in replies)
    assert "state" not in plain, f"seed={seed}: the member that did not ask got the state"
    assert_same_state(asked["state"], scene.state(asking), f"seed={seed}, the asking member")
    # Each member's rows are its own: sessions stepped alone with the same frames agree.
    for session, frame, result in ((asking_alone, frames[0], asked), (quiet_alone, frames[1], plain)):
        alone = scene.call(case.op, session=session, **frame)
        assert torch.equal(output_of(alone), output_of(result)), f"seed={seed}"
    assert_same_state(scene.state(quiet), scene.state(quiet_alone), f"seed={seed}, the quiet member")
    assert_same_state(scene.state(asking), scene.state(asking_alone), f"seed={seed}, the asking member")


@pytest.mark.parametrize("op", ["step", "model_step", "model_forward"])
@pytest.mark.parametrize("value", [pytest.param(1, id="int-1"), pytest.param("true", id="str")])
def test_a_return_state_that_is_not_a_bool_is_refused_by_name(inproc, op, value):
    seed = random_seed()
    case = Case("mamba" if op == "step" else "mamba2", op)
    scene = Scene(inproc(), case, seed)
    session = scene.open()
    frame = scene.frame()
    reply = scene.srv.request(scene.conn, op, session=session, return_state=value, **frame)
    assert not reply.ok and reply.error["code"] == "invalid_argument", reply.error
    assert reply.error["detail"]["field"] == "args.return_state", reply.error
    assert is_zero(scene.state(session)), "the refused frame changed the state"
    assert "state" in scene.call(op, session=session, return_state=True, **frame)


class FramingConnection(RecordingConnection):
    """As a stream lane's: each reply framed, its 4-byte length prefix checked, before it goes."""

    def send(self, parts: list, buffers: list | None = None) -> None:
        protocol.frame_parts(parts)
        super().send(parts, buffers)


# What a reply carries (SPEC §2), lowered here as a state or reply of 4 GiB reaches the real
# limit: a tensor's bytes (msgpack's bin length) and a frame's (a stream lane's length prefix).
REPLY_LIMITS = {"tensor": (protocol.encode, "MAX_BIN_BYTES"), "frame": (protocol.framing, "MAX_FRAMEABLE")}


@contextlib.contextmanager
def lowered(monkeypatch, limit: str, cap: int):
    with monkeypatch.context() as patch:
        patch.setattr(*REPLY_LIMITS[limit], cap)
        yield


def state_part_bytes(case: Case) -> list[int]:
    """The bytes of each tensor of a case's session state, as a reply carries it (f32)."""
    if case.op.startswith("model_"):
        shapes = [shape for _, shape in parse_config(MODEL_CONFIGS[case.kind]).state_parts()]
    else:
        shapes = [(HEADS, HEADDIM, STATE) if case.kind == "ssd" else (DIM, STATE)]
    return [case.batch * math.prod(shape) * 4 for shape in shapes]


# Batches at which a state outweighs a reply's envelope: the reply without it fits the frame.
PAST_THE_LIMIT_CASES = [
    pytest.param(Case("mamba", "step", batch=4), False, id="plain-mamba-step"),
    pytest.param(Case("mamba", "step", batch=4), True, id="plain-mamba-step-native"),
    pytest.param(Case("ssd", "step", batch=3), False, id="plain-ssd-step"),
    pytest.param(Case("ssd", "step", batch=3), True, id="plain-ssd-step-native"),
    pytest.param(Case("mamba", "scan", batch=4), False, id="mamba-scan-prefill"),
    pytest.param(Case("ssd", "ssd_scan", batch=3), False, id="ssd-scan-prefill"),
    pytest.param(Case("mamba", "model_step"), False, id="mamba-model-step"),
    pytest.param(Case("mamba", "model_step"), True, id="mamba-model-step-native"),
    pytest.param(Case("mamba2", "model_step", batch=1), True, id="mamba2-model-step-native"),
    pytest.param(Case("mamba", "model_forward"), False, id="mamba-model-forward"),
    pytest.param(Case("mamba2", "model_forward"), False, id="mamba2-model-forward"),
]


@pytest.mark.parametrize("limit", list(REPLY_LIMITS))
@pytest.mark.parametrize(("case", "native"), PAST_THE_LIMIT_CASES)
def test_a_state_past_what_a_reply_carries_is_refused_before_the_frame_runs(inproc, monkeypatch, case, native,
                                                                            limit):
    """A frame whose reply with its state cannot be carried is refused limit_exceeded
    (reply_frame_size) before it runs, the session's state as it was. Found in review: steps and
    prefills ran, moved the state on, and only then were refused, so a client sending the frame
    again ran it twice. The native path declines such a step, for the general one to refuse."""
    seed = random_seed()
    parts = state_part_bytes(case)
    (inputs,) = (v for k, v in Scene(None, case, seed).frame().items() if k in ("x", "embeds"))
    output_bytes = 4 * inputs.numel()  # y or the hidden states: f32, of x's or the embeds' shape
    # The least that refuses the reply with the state; the reply without it fits.
    cap = max(parts) - 1 if limit == "tensor" else output_bytes + sum(parts) - 1
    with lowered(monkeypatch, limit, cap):
        srv = inproc(native_step=native)  # the native path takes the limits as it is made
    if native and srv.server.fast_path is None:
        pytest.skip("the native step path is unavailable here (not the cpu kernels backend, or not built)")
    scene = Scene(srv, case, seed, FramingConnection())
    asking, twin = scene.open(), scene.open()
    frame = scene.frame()
    for session in (asking, twin):
        scene.call(case.op, session=session, **frame)
    with lowered(monkeypatch, limit, cap):
        refused = srv.request(scene.conn, case.op, session=asking, return_state=True, **scene.frame())
    assert not refused.ok, f"seed={seed}: a reply past the limit was sent"
    error = refused.error
    assert (error["code"], error["detail"]["limit"], error["detail"]["max"]) == \
        ("limit_exceeded", "reply_frame_size", cap), error
    assert_same_state(scene.state(asking), scene.state(twin), f"seed={seed}: the refused frame's")
    # A tensor past the limit is named by its own bytes, as the codec names it; a frame by its
    # tensors' bytes (checked before the reply is made, its envelope uncounted).
    assert error["detail"]["requested"] == (max(parts) if limit == "tensor" else output_bytes + sum(parts)), error
    frame = scene.frame()
    following = srv.request(scene.conn, case.op, session=asking, **frame)
    assert following.ok and (served_natively(following) or not native), f"seed={seed}: {following.error}"
    expected = scene.call(case.op, session=twin, **frame)
    assert torch.equal(output_of(result_from_wire(following.result, as_torch=True)), output_of(expected)), \
        f"seed={seed}: the frame after the refused one"


def test_a_step_that_asks_is_served_natively_with_the_general_paths_state(inproc):
    """The native path serves a step that asks for the state as one that does not, its state
    copied into the reply: the session's, and the general path's bit for bit."""
    seed = random_seed()
    native = Scene(inproc(), Case("mamba", "step"), seed)
    if native.srv.server.fast_path is None:
        pytest.skip("the native step path is unavailable here (not the cpu kernels backend, or not built)")
    general = Scene(inproc(native_step=False), Case("mamba", "step"), seed)
    sessions = [scene.open() for scene in (native, general)]
    for t in range(3):
        frame = native.frame()
        plain = native.srv.request(native.conn, "step", session=sessions[0], more_input=False, **frame)
        assert plain.ok and served_natively(plain), f"seed={seed}: frame {t}: {plain.timing}"
        general.call("step", session=sessions[1], **frame)
        frame = native.frame()
        asked = native.srv.request(native.conn, "step", session=sessions[0], more_input=False, return_state=True,
                                   **frame)
        assert asked.ok and served_natively(asked), f"seed={seed}: frame {t}: {asked.timing}"
        expected = general.call("step", session=sessions[1], return_state=True, **frame)
        asked = result_from_wire(asked.result, as_torch=True)
        assert torch.equal(asked["y"], expected["y"]), f"seed={seed}: frame {t}"
        assert_same_state(asked["state"], native.state(sessions[0]), f"seed={seed}, frame {t}")
        assert_same_state(asked["state"], expected["state"], f"seed={seed}, frame {t}, the general path's")


def test_a_step_replayed_from_a_capture_returns_the_state_too(inproc, monkeypatch):
    """The captured path (StepOp.run's CUDA-graph branch, which returns early) on the CPU, with
    test_step_graphs' stand-in capture: one asking and one quiet step share each replay."""
    from test_step_graphs import StandInCapture

    monkeypatch.setattr(StandInCapture, "made", [])
    monkeypatch.setattr(scan_kernels, "capture_state_update", StandInCapture)
    seed = random_seed()
    srv = inproc(device="cpu", native_step=False, max_delay_us=0)
    srv.server.step_graphs = StepGraphs(srv.server.backend)
    scene = Scene(srv, Case("mamba", "step"), seed)
    # A capture reads A at its device address: a handle's, never bytes that came with a request.
    A = protocol.HandleRef(scene.call("put", tensor=scene.A)["handle"])
    asking, quiet = scene.open(), scene.open()
    for t in range(2):
        srv.hold(scene.conn)
        ids = [srv.submit(scene.conn, "step", session=asking, return_state=True, **{**scene.frame(), "A": A}),
               srv.submit(scene.conn, "step", session=quiet, **{**scene.frame(), "A": A})]
        srv.go()
        asked, plain = (scene.conn.reply(i) for i in ids)
        assert asked.ok and plain.ok, f"seed={seed}: {asked.error}, {plain.error}"
        assert "state" not in plain.result, f"seed={seed}: frame {t}"
        asked = result_from_wire(asked.result, as_torch=True)
        assert_same_state(asked["state"], scene.state(asking), f"seed={seed}, frame {t}")
    assert [capture.runs for capture in StandInCapture.made] == [2], f"seed={seed}: not replayed"


def test_the_python_client_returns_the_state_beside_the_output():
    """Over the Port: a model session's forward and step give (output, state) with
    return_state, a plain step's reply holds "state" beside "y", as a scan's does."""
    from bridge.client import PortClient

    seed = random_seed()
    gen = torch.Generator().manual_seed(seed)
    with PortClient(["--device", "cpu"], as_torch=True) as client:
        model = client.load_model(config=MODEL_CONFIGS["mamba2"], weights=tiny_weights("mamba2", gen))
        session = model.open_session(batch=2)
        hidden, state = session.forward(embeds=torch.randn(2, 3, D_MODEL, generator=gen), return_state=True)
        assert tuple(hidden.shape) == (2, 3, D_MODEL)
        assert_same_state(state, session.state(), f"seed={seed}, forward")
        frame = torch.randn(2, D_MODEL, generator=gen)
        twin = session.fork()
        hidden, state = session.step(embeds=frame, return_state=True)
        assert torch.equal(hidden, twin.step(embeds=frame)), f"seed={seed}"
        assert_same_state(state, session.state(), f"seed={seed}, step")
        assert set(session.step_reply(embeds=frame, return_state=True).unwrap()) == {"hidden", "state"}

        plain = client.open_session(batch=2, dim=DIM, state=STATE)
        scene = Scene(None, Case("mamba", "step"), seed)
        result = client.step(plain, return_state=True, **scene.frame()).unwrap()
        assert set(result) == {"y", "state"}
        assert_same_state(result["state"], client.session_state(plain), f"seed={seed}, plain step")
