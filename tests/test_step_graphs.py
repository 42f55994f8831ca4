"""bridge.step_graphs: which steps replay a captured state update, what each replay is given,
and what they fall back to. Captures exist only on CUDA (scan_kernels.capture_state_update; their own
tests are in test_kernels_triton.py, and the server's CUDA cases in test_batcher.py and
test_sessions.py step through them); here a stand-in capture on the CPU computes what a replay
would, from the bytes it was given, so that the bridge's part runs in every CI.
"""

from __future__ import annotations

import weakref

import numpy as np
import pytest
import torch

import scan_kernels
import protocol
from scan_kernels import _args
from bridge.client import result_from_wire
from bridge.models.graphs import ModelStepGraphs
from bridge.step_graphs import StepGraphs
from bridge.timing import Timing
from bridge_fakes import RecordingConnection
from kernel_cases import STATE_TOLERANCE, UpdateCase, assert_close, make_update_inputs, reference_update

DIM, STATE = 12, 4


class StandInCapture:
    """kernels' CapturedStateUpdate on the CPU: staged bytes in, the cpu backend's update out,
    against the capture's own pool and A/D/dt_bias (held weakly, as the real one holds them)."""

    made: list["StandInCapture"] = []

    def __init__(self, state, x, dt, A, B, C, *, D, z, dt_bias, slots, backend, **options):
        _args.check_state_update(state, x, dt, A, B, C, D=D, z=z, dt_bias=dt_bias, slots=slots, **options)
        self.shapes = {name: (t.dtype, tuple(t.shape)) for name, t in
                       dict(x=x, dt=dt, B=B, C=C, z=z, slots=slots).items() if t is not None}
        self.held = {name: weakref.ref(t) for name, t in dict(state=state, A=A, D=D, dt_bias=dt_bias).items()
                     if t is not None}
        self.options = options
        self.staged: dict[str, bytes] = {}
        self.runs = 0
        StandInCapture.made.append(self)

    def stage(self, name, *parts):
        self.staged[name] = b"".join(bytes(part) for part in parts)

    def alive(self):
        return all(ref() is not None for ref in self.held.values())

    def run(self):
        self.runs += 1
        inputs = {}
        for name, (dtype, shape) in self.shapes.items():
            inputs[name] = torch.from_numpy(np.frombuffer(self.staged[name], np.uint8).copy()).view(dtype).view(shape)
        held = {name: ref() for name, ref in self.held.items()}
        return scan_kernels.selective_state_update(held.pop("state"), inputs.pop("x"), inputs.pop("dt"), held.pop("A"),
                                              inputs.pop("B"), inputs.pop("C"), **held, **inputs, **self.options)


@pytest.fixture
def graphs(inproc, monkeypatch):
    """An in-process CPU server whose steps go through StepGraphs, with stand-in captures."""
    StandInCapture.made = []
    monkeypatch.setattr(scan_kernels, "capture_state_update", StandInCapture)
    srv = inproc(device="cpu", native_step=False, max_delay_us=0)
    srv.server.step_graphs = StepGraphs(srv.server.backend, capacity=2)
    srv.server.model_step_graphs = ModelStepGraphs()  # as a CUDA server has; no model steps here
    return srv


def constants(handles: bool, srv, conn) -> tuple[dict, dict]:
    """(A and D as tensors, as the requests send them: handles or inline bytes)."""
    base = make_update_inputs(UpdateCase(1, DIM, STATE, D=True))
    values = {"A": base["A"], "D": base["D"]}
    if not handles:
        return values, values
    return values, {k: protocol.HandleRef(srv.call(conn, "put", tensor=v)["handle"]) for k, v in values.items()}


def step_inputs(rows: int, values: dict) -> dict:
    """Fresh per-row step arguments, with the constants `values`."""
    inputs = make_update_inputs(UpdateCase(rows, DIM, STATE, D=True))
    del inputs["state"]
    return {**inputs, **values}


def step_and_check(srv, conn, session: str, rows: int, values: dict, sent: dict, state: torch.Tensor) -> torch.Tensor:
    """One step of `session` checked against the reference from `state`; the new state."""
    inputs = step_inputs(rows, values)
    reply = srv.request(conn, "step", session=session, **{**inputs, **sent})
    assert reply.ok, reply.error
    y_ref, state_ref = reference_update({**inputs, "state": state})
    assert_close(result_from_wire(reply.result, as_torch=True)["y"], y_ref, torch.float32, "y")
    after = srv.call(conn, "session_state", session=session)["state"]
    assert_close(after, state_ref, torch.float32, "state", STATE_TOLERANCE)
    return after


def open_and_step(srv, conn, rows: int, steps: int, values: dict, sent: dict) -> tuple[str, torch.Tensor]:
    """A new session of `rows` stepped `steps` times, each step checked; (its id, its state)."""
    session = srv.call(conn, "session_open", batch=rows, dim=DIM, state=STATE)["session"]
    state = torch.zeros(rows, DIM, STATE)
    for _ in range(steps):
        state = step_and_check(srv, conn, session, rows, values, sent, state)
    return session, state


def test_steps_like_earlier_ones_replay_one_capture(graphs):
    conn = RecordingConnection()
    values, sent = constants(True, graphs, conn)
    open_and_step(graphs, conn, 3, 4, values, sent)
    assert [c.runs for c in StandInCapture.made] == [4]
    assert graphs.call(conn, "info")["cuda_graphs"] == {"captured": 1, "model_steps_captured": 0}


def test_a_cpu_server_has_no_step_graphs(inproc):
    srv = inproc(device="cpu")
    assert srv.server.step_graphs is None
    assert srv.call(RecordingConnection(), "info")["cuda_graphs"] is None


def test_a_batch_stages_its_members_rows_and_slots_in_order(graphs):
    conn = RecordingConnection()
    values, sent = constants(True, graphs, conn)
    rows = [1, 3, 2]
    sessions = [graphs.call(conn, "session_open", batch=r, dim=DIM, state=STATE)["session"] for r in rows]
    inputs = [step_inputs(r, values) for r in rows]
    graphs.hold(conn)
    ids = [graphs.submit(conn, "step", session=s, **{**inp, **sent}) for s, inp in zip(sessions, inputs)]
    graphs.go()
    for i, (request_id, r) in enumerate(zip(ids, rows)):
        reply = conn.reply(request_id)
        assert reply.ok and reply.timing["batch_rows"] == 6, (reply.error, reply.timing)
        y_ref, _ = reference_update({**inputs[i], "state": torch.zeros(r, DIM, STATE)})
        assert_close(result_from_wire(reply.result, as_torch=True)["y"], y_ref, torch.float32, f"caller {i} y")
    (capture,) = StandInCapture.made
    slots = np.frombuffer(capture.staged["slots"], np.int64).tolist()
    owned = [graphs.server.sessions.get(conn.id, s, "session").slot_list for s in sessions]
    assert slots == [slot for mine in owned for slot in mine]
    assert capture.staged["x"] == b"".join(inp["x"].numpy().tobytes() for inp in inputs)


def test_steps_with_inline_constants_take_the_general_path(graphs):
    """Bytes that came with the request have no lasting device address to capture."""
    conn = RecordingConnection()
    values, sent = constants(False, graphs, conn)
    open_and_step(graphs, conn, 2, 1, values, sent)
    assert StandInCapture.made == []


@pytest.fixture
def failing_captures(graphs, monkeypatch) -> list[int]:
    """Every capture fails as a CUDA error would; the rows of each attempt, in order."""
    attempts = []

    def failing(state, x, *args, **kwargs):
        attempts.append(x.shape[0])
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(scan_kernels, "capture_state_update", failing)
    return attempts


def test_a_kind_that_failed_to_capture_goes_the_general_path_from_then_on(graphs, failing_captures):
    conn = RecordingConnection()
    values, sent = constants(True, graphs, conn)
    open_and_step(graphs, conn, 2, 3, values, sent)
    assert failing_captures == [2]


def test_only_the_last_capacity_failed_kinds_are_remembered(graphs, failing_captures):
    """A kind names device addresses, so failed kinds are not remembered forever: past
    `capacity` (2 here), the oldest is forgotten and tried again."""
    conn = RecordingConnection()
    values, sent = constants(True, graphs, conn)
    # Opened first: a session opened later could grow the pool, which makes new kinds.
    sessions = {rows: graphs.call(conn, "session_open", batch=rows, dim=DIM, state=STATE)["session"]
                for rows in (1, 2, 3)}
    states = {rows: torch.zeros(rows, DIM, STATE) for rows in sessions}
    for rows in (1, 2, 3, 3, 2, 1):  # 1 was forgotten when 3 failed; 3 and 2 are still remembered
        states[rows] = step_and_check(graphs, conn, sessions[rows], rows, values, sent, states[rows])
    assert failing_captures == [1, 2, 3, 1]
    assert len(graphs.server.step_graphs._failed) == 2


def test_a_replayed_step_charges_its_copy_to_the_host_once(graphs, monkeypatch):
    """y reaches the host within the replay: its copy is the step's one d2h charge."""
    conn = RecordingConnection()
    values, sent = constants(True, graphs, conn)
    session = graphs.call(conn, "session_open", batch=2, dim=DIM, state=STATE)["session"]
    added = []
    real_add = Timing.add

    def recording_add(timing, stage, ns):
        added.append(stage)
        real_add(timing, stage, ns)

    inputs = step_inputs(2, values)
    with monkeypatch.context() as patched:
        patched.setattr(Timing, "add", recording_add)
        reply = graphs.request(conn, "step", session=session, **{**inputs, **sent})
    assert reply.ok, reply.error
    y_ref, _ = reference_update({**inputs, "state": torch.zeros(2, DIM, STATE)})
    assert_close(result_from_wire(reply.result, as_torch=True)["y"], y_ref, torch.float32, "y")
    assert [c.runs for c in StandInCapture.made] == [1]
    assert added.count("d2h") == 1, added


def test_a_bad_argument_is_the_requests_error_not_a_failed_capture(graphs):
    conn = RecordingConnection()
    _, sent = constants(True, graphs, conn)
    session = graphs.call(conn, "session_open", batch=2, dim=DIM, state=STATE)["session"]
    inputs = make_update_inputs(UpdateCase(2, DIM + 1, STATE))
    del inputs["state"], inputs["A"]
    reply = graphs.request(conn, "step", session=session, **inputs, **sent)
    assert not reply.ok and reply.error["code"] == "shape_mismatch", reply.error
    assert reply.error["detail"]["field"] == "args.x", reply.error
    assert StandInCapture.made == []


def test_a_grown_pool_is_captured_again_and_old_captures_are_dropped(graphs):
    """Growing the pool frees its old rows, whose address a capture holds: the next step
    captures anew. Past `capacity` kinds, the least recently used capture goes."""
    conn = RecordingConnection()
    values, sent = constants(True, graphs, conn)
    first, state = open_and_step(graphs, conn, 1, 1, values, sent)
    graphs.call(conn, "session_open", batch=4, dim=DIM, state=STATE)  # the pool grows
    assert not StandInCapture.made[0].alive()
    step_and_check(graphs, conn, first, 1, values, sent, state)
    assert len(StandInCapture.made) == 2
    for rows in (2, 3):  # two more kinds: the capacity of 2 drops the oldest
        open_and_step(graphs, conn, rows, 1, values, sent)
    assert len(graphs.server.step_graphs._captures) == 2



def test_a_replayed_step_stands_for_the_device_in_the_health_check(graphs):
    """A replay runs no kernel_timer: it notes the device's answer itself (bridge.health)."""
    conn = RecordingConnection()
    values, sent = constants(True, graphs, conn)
    session = graphs.call(conn, "session_open", batch=2, dim=DIM, state=STATE)["session"]
    assert not graphs.server.probe.fresh()
    step_and_check(graphs, conn, session, 2, values, sent, torch.zeros(2, DIM, STATE))
    assert [c.runs for c in StandInCapture.made] == [1]
    assert graphs.server.probe.check(launch=False)["source"] == "work"
