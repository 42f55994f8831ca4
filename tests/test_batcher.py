"""The dynamic batcher: requests that share a launch each get their own rows back, batches keep
their rules (equal constants, one request per session, at most --max-batch rows, arrival
order), the wait policy, and stats that add up.

Most tests use the in-process server of bridge_fakes.py: the worker is parked in a ping while
requests queue up behind it, so that what it gathers on release is known exactly.
"""

from __future__ import annotations

import gc
import math
import threading
from dataclasses import dataclass
from types import SimpleNamespace

import msgspec
import pytest
import torch

import protocol
from bridge.batcher import Batch, BatchedOp, BatchPolicy, Item, company_wait_end_ns, run_batch, same_values
from bridge.client import PortClient, result_from_wire, to_wire
from bridge.errors import OpError
from bridge.ops.scan import BATCH_MAX_X_BYTES
from bridge.sessions import unknown_session
from bridge.stats import Stats
from bridge.timing import Timing, now_ns
from kernel_cases import (ON_CUDA, SERVER_DEVICES, STATE_TOLERANCE, ScanCase, UpdateCase, assert_close,
                          make_scan_inputs, make_update_inputs, reference_scan, reference_update)
from bridge_fakes import BackgroundLoads, DrainRace, RecordingConnection, served_natively
from waiting import wait_until

SHARED = ("A", "D", "dt_bias")


def open_prefilled(srv, conn, batch: int, dim: int, state: int, groups: int = 1) -> str:
    """A session whose state is a random prefill (so that every session starts different)."""
    session = srv.call(conn, "session_open", batch=batch, dim=dim, state=state)["session"]
    srv.call(conn, "scan", session=session, **make_scan_inputs(ScanCase(batch, 3, dim, state, groups)))
    return session


def state_of(srv, conn, session: str) -> torch.Tensor:
    return srv.call(conn, "session_state", session=session)["state"]


def step_inputs(batch: int, dim: int, state: int, shared: dict, options: dict) -> dict:
    """Fresh random per-row step arguments; the constants are `shared`."""
    inputs = make_update_inputs(UpdateCase(batch, dim, state, **options))
    del inputs["state"]
    inputs.update(shared)
    return inputs


def shared_constants(dim: int, state: int, options: dict) -> dict:
    base = make_update_inputs(UpdateCase(1, dim, state, **options))
    return {k: base[k] for k in SHARED if k in base}


def check_step(reply: protocol.Reply, inputs: dict, before: torch.Tensor, after: torch.Tensor | None,
               what: str):
    """The step's y, and the session's state `after` it (None: read only after a later step,
    whose check starts from this step's reference state and so covers this one's too)."""
    assert reply.ok, reply.error
    y_ref, state_ref = reference_update({**inputs, "state": before})
    assert_close(result_from_wire(reply.result, as_torch=True)["y"], y_ref, torch.float32, f"{what} y")
    if after is not None:
        assert_close(after, state_ref, torch.float32, f"{what} state", STATE_TOLERANCE)


def launches_of(rows: list[int], max_batch: int) -> list[list[int]]:
    """The launches that consecutive compatible requests make when each launch takes requests
    until the next one does not fit."""
    launches = [[]]
    for r in rows:
        if launches[-1] and sum(launches[-1]) + r > max_batch:
            launches.append([])
        launches[-1].append(r)
    return launches


def expected_batch_rows(rows: list[int], max_batch: int) -> list[int]:
    """batch_rows each request reports, in arrival order."""
    return [sum(launch) for launch in launches_of(rows, max_batch) for _ in launch]


@dataclass(frozen=True)
class StepBatchCase:
    rows: tuple[int, ...]  # each caller's session batch, in arrival order
    dim: int
    state: int
    max_batch: int = 1024
    groups: int = 1
    options: tuple = ()  # UpdateCase flags: D, z, dt_bias, dt_softplus, clamp
    handles: bool = False  # constants uploaded once with put


STEP_BATCH_CASES = [
    pytest.param(StepBatchCase((3, 1, 2, 5, 7), 5, 3), id="odd-sizes-one-launch"),
    pytest.param(StepBatchCase((3, 1, 2, 5, 7, 4), 6, 4, max_batch=7), id="split-by-max-batch"),
    pytest.param(StepBatchCase((1,) * 9, 33, 16), id="nine-single-rows"),
    pytest.param(StepBatchCase((2, 3, 1), 12, 4, groups=2, handles=True,
                               options=(("D", True), ("z", True), ("dt_bias", True), ("dt_softplus", True),
                                        ("clamp", True))), id="groups-all-options-handles"),
]


@pytest.mark.parametrize("device", SERVER_DEVICES)
@pytest.mark.parametrize("case", STEP_BATCH_CASES)
def test_each_caller_gets_its_own_rows(inproc, case, device):
    srv = inproc(device=device, max_batch=case.max_batch, max_delay_us=0)
    conn = RecordingConnection()
    options = dict(case.options, groups=case.groups)
    shared = shared_constants(case.dim, case.state, options)
    wire_shared = {k: protocol.HandleRef(srv.call(conn, "put", tensor=v)["handle"]) for k, v in shared.items()} \
        if case.handles else shared
    sessions = [open_prefilled(srv, conn, r, case.dim, case.state, case.groups) for r in case.rows]
    idle = open_prefilled(srv, conn, 2, case.dim, case.state, case.groups)  # in the pool, not stepped
    idle_before = state_of(srv, conn, idle)
    before = [state_of(srv, conn, s) for s in sessions]
    inputs = [step_inputs(r, case.dim, case.state, shared, options) for r in case.rows]

    srv.hold(conn)
    ids = [srv.submit(conn, "step", session=s, **{**inp, **wire_shared}) for s, inp in zip(sessions, inputs)]
    srv.go()
    replies = [conn.reply(i) for i in ids]

    assert [r.timing["batch_rows"] for r in replies] == expected_batch_rows(list(case.rows), case.max_batch)
    for i, (reply, session) in enumerate(zip(replies, sessions)):
        check_step(reply, inputs[i], before[i], state_of(srv, conn, session), f"caller {i}")
    assert torch.equal(state_of(srv, conn, idle), idle_before)


def assert_launch_stages_shared(replies) -> None:
    """Members of one launch report its h2d, kernel and d2h, the same for each (SPEC §6.3)."""
    for stage in ("h2d_us", "kernel_us", "d2h_us"):
        assert len({r.timing[stage] for r in replies}) == 1, [r.timing for r in replies]


@pytest.mark.parametrize("pattern,expected", [
    pytest.param((0, 0, 0, 0), [8, 8, 8, 8], id="equal-values"),
    pytest.param((0, 1, 0, 1), [2, 2, 2, 2], id="alternating"),
    pytest.param((0, 0, 1, 1), [4, 4, 4, 4], id="two-runs"),
    pytest.param((0, "handle", 0), [6, 6, 6], id="a-handle-and-its-values-inline"),
])
def test_only_requests_with_equal_constants_share_a_launch(inproc, pattern, expected):
    """`pattern`: each request's constants, set 0 or 1 sent inline, or set 0 as handles."""
    srv = inproc(max_delay_us=0)
    conn = RecordingConnection()
    options = {"D": True, "dt_bias": True}
    constants = [shared_constants(7, 3, options) for _ in range(2)]
    handles = {k: protocol.HandleRef(srv.call(conn, "put", tensor=v)["handle"]) for k, v in constants[0].items()}
    sessions = [open_prefilled(srv, conn, 2, 7, 3) for _ in pattern]
    before = [state_of(srv, conn, s) for s in sessions]
    # Each request carries its own copy of the bytes: equal values, never the same tensor.
    inputs = [step_inputs(2, 7, 3, {k: v.clone() for k, v in constants[p if p != "handle" else 0].items()},
                          options) for p in pattern]
    srv.hold(conn)
    ids = [srv.submit(conn, "step", session=s, **({**inp, **handles} if p == "handle" else inp))
           for s, inp, p in zip(sessions, inputs, pattern)]
    srv.go()
    replies = [conn.reply(i) for i in ids]
    assert [r.timing["batch_rows"] for r in replies] == expected
    if expected[0] == 2 * len(pattern):
        assert_launch_stages_shared(replies)
    for i, reply in enumerate(replies):
        check_step(reply, inputs[i], before[i], state_of(srv, conn, sessions[i]), f"caller {i}")


@pytest.mark.parametrize("first, second", [
    pytest.param("wire", "handle", id="wire-and-handle"), pytest.param("handle", "wire", id="handle-and-wire"),
    pytest.param("handle", "handle", id="two-handles"), pytest.param("wire", "wire", id="two-wires"),
])
def test_constants_differing_only_in_the_sign_of_a_zero_share_no_launch(first, second):
    """A handle's -0.0 was taken for another member's 0.0 (torch.equal), and the launch ran with
    the lead's: the other's state came out with zeros of the other sign, not bit for bit its own
    launch's (found in review). Equal bits, a NaN's too, still share one."""
    def as_given(values, form):
        tensor = torch.tensor(values, dtype=torch.float32)
        return tensor if form == "handle" else protocol.WireTensor("f32", (len(values),), memoryview(tensor.numpy().tobytes()))

    assert not same_values(as_given([-0.0, 1.0], first), as_given([0.0, 1.0], second))
    assert same_values(as_given([-0.0, math.nan], first), as_given([-0.0, math.nan], second))


def test_two_steps_of_one_session_are_two_launches_in_order(inproc):
    srv = inproc(max_delay_us=0)
    conn = RecordingConnection()
    shared = shared_constants(6, 4, {})
    first, other = open_prefilled(srv, conn, 3, 6, 4), open_prefilled(srv, conn, 2, 6, 4)
    start = state_of(srv, conn, first)
    a, b, c = step_inputs(3, 6, 4, shared, {}), step_inputs(2, 6, 4, shared, {}), step_inputs(3, 6, 4, shared, {})
    srv.hold(conn)
    ids = [srv.submit(conn, "step", session=first, **a), srv.submit(conn, "step", session=other, **b),
           srv.submit(conn, "step", session=first, **c)]
    srv.go()
    replies = [conn.reply(i) for i in ids]
    assert [r.timing["batch_rows"] for r in replies] == [5, 5, 3]
    _, middle = reference_update({**a, "state": start})
    check_step(replies[0], a, start, None, "first step")
    check_step(replies[2], c, middle.float(), state_of(srv, conn, first), "second step")


def test_a_bad_request_or_another_op_does_not_spoil_the_batch(inproc):
    srv = inproc(max_delay_us=0)
    conn = RecordingConnection()
    shared = shared_constants(5, 3, {})
    sessions = [open_prefilled(srv, conn, r, 5, 3) for r in (2, 3, 1, 4)]
    before = [state_of(srv, conn, s) for s in sessions]
    inputs = [step_inputs(r, 5, 3, shared, {}) for r in (2, 3, 1, 4)]
    bad = {**inputs[1], "x": inputs[1]["x"][:2]}
    srv.hold(conn)
    ids = [srv.submit(conn, "step", session=sessions[0], **inputs[0]),
           srv.submit(conn, "step", session=sessions[1], **bad),
           srv.submit(conn, "step", session=sessions[2], **inputs[2]),
           srv.submit(conn, "session_state", session=sessions[0]),
           srv.submit(conn, "step", session=sessions[3], **inputs[3])]
    srv.go()
    replies = [conn.reply(i) for i in ids]
    assert replies[1].error["code"] == "shape_mismatch" and replies[1].error["detail"]["field"] == "args.x"
    assert [replies[i].timing["batch_rows"] for i in (0, 2, 4)] == [3, 3, 4]
    # session_state was queued after the first batch and ran after it.
    after_first = result_from_wire(replies[3].result, as_torch=True)["state"]
    check_step(replies[0], inputs[0], before[0], after_first, "caller 0")
    check_step(replies[2], inputs[2], before[2], state_of(srv, conn, sessions[2]), "caller 2")
    check_step(replies[4], inputs[3], before[3], state_of(srv, conn, sessions[3]), "caller 3")
    assert torch.equal(state_of(srv, conn, sessions[1]), before[1])


def test_no_batching_with_max_batch_one(inproc):
    srv = inproc(max_batch=1, max_delay_us=0)
    conn = RecordingConnection()
    shared = shared_constants(4, 2, {})
    sessions = [open_prefilled(srv, conn, r, 4, 2) for r in (1, 3, 1)]
    srv.hold(conn)
    ids = [srv.submit(conn, "step", session=s, **step_inputs(r, 4, 2, shared, {}))
           for s, r in zip(sessions, (1, 3, 1))]
    srv.go()
    assert [conn.reply(i).timing["batch_rows"] for i in ids] == [1, 3, 1]
    step = srv.call(conn, "stats")["ops"]["step"]
    assert step["execution_count"] == step["inference_count"] == 3


def test_stats_add_up(inproc):
    srv = inproc(max_batch=6, max_delay_us=0, metrics_port=0)  # a metrics port: histograms kept
    conn = RecordingConnection()
    shared = shared_constants(5, 3, {})
    rows = (2, 1, 3, 2, 5, 1, 1)
    sessions = [open_prefilled(srv, conn, r, 5, 3) for r in rows]
    srv.hold(conn)
    ids = [srv.submit(conn, "step", session=s, **step_inputs(r, 5, 3, shared, {})) for s, r in zip(sessions, rows)]
    ids.append(srv.submit(conn, "step", session="no-such-session", **step_inputs(1, 5, 3, shared, {})))
    srv.go()
    replies = [conn.reply(i) for i in ids]
    ok = [(r, rows[i]) for i, r in enumerate(replies) if r.ok]
    launches = sum(own / reply.timing["batch_rows"] for reply, own in ok)
    step = srv.call(conn, "stats")["ops"]["step"]
    # As Triton counts them: inferences are the requests served, so that over launches they give
    # the mean batch; the refused request is a failure only.
    assert step["success_count"] + step["failure_count"] == len(ids)
    assert step["inference_count"] == step["success_count"] == len(rows) and step["failure_count"] == 1
    assert abs(launches - round(launches)) < 1e-9
    assert step["execution_count"] == round(launches) == len(launches_of(list(rows), 6)) == 4
    assert step["kernel_us"] > 0 and step["queue_us"] > 0
    # scan_bridge_batch_rows: the rows of each launch, once a launch (found in review: each
    # member counted its launch's rows again).
    batch_rows = srv.server.stats.histograms()[("step", "batch_rows")]
    assert (sum(batch_rows.counts), batch_rows.sum) == (4, sum(rows))


def test_an_oversized_frame_counts_as_read_and_its_answer_as_sent(inproc):
    """Every frame read is counted in (body bytes: the announced length of one drained unread)
    and every reply sent is counted out: an oversized frame's answer was counted out alone."""
    srv = inproc()
    conn = RecordingConnection()
    before = srv.server.stats.snapshot()
    srv.dispatcher.on_frame_error(conn, protocol.FrameTooLarge(2000, 1000))
    assert conn.reply(None, timeout=0).error["code"] == "frame_too_large"
    after = srv.server.stats.snapshot()
    assert [after[key] - before[key] for key in ("frames_in", "bytes_in", "replies_out")] == [1, 2000, 1]


def test_a_launch_counts_once_though_its_first_reply_fails(inproc, monkeypatch):
    """The launch ran: it is one execution even when the reply of the member it is counted
    with cannot be encoded (that member gets internal_error, the others their rows)."""
    srv = inproc(max_batch=8, max_delay_us=0, native_step=False)
    conn = RecordingConnection()
    shared = shared_constants(5, 3, {})
    sessions = [open_prefilled(srv, conn, 1, 5, 3) for _ in range(3)]
    before = srv.call(conn, "stats")["ops"].get("step", {}).get("execution_count", 0)
    srv.hold(conn)
    ids = [srv.submit(conn, "step", session=s, **step_inputs(1, 5, 3, shared, {})) for s in sessions]
    reply = protocol.V1.reply

    def failing_for_the_first(request, *args, **kwargs):
        if request.id == ids[0]:
            raise ValueError("cannot encode this reply")
        return reply(request, *args, **kwargs)

    monkeypatch.setattr(protocol.V1, "reply", failing_for_the_first)
    srv.go()
    replies = [conn.reply(i) for i in ids]
    assert replies[0].error["code"] == "internal_error" and all(r.ok for r in replies[1:])
    assert {r.timing["batch_rows"] for r in replies[1:]} == {3}
    step = srv.call(conn, "stats")["ops"]["step"]
    assert step["execution_count"] - before == 1
    assert step["inference_count"] == 2 and step["failure_count"] == 1


def test_a_batch_member_whose_finishing_fails_leaves_the_others_answered(inproc):
    """Finishing a request (giving its frame buffer back, here) may fail after its reply went
    out; the batch's other members must still get theirs, and nothing stays in flight (which
    would keep the native path off and every drain waiting)."""
    srv = inproc(max_batch=8, max_delay_us=0, native_step=False)
    conn = RecordingConnection()
    shared = shared_constants(5, 3, {})
    sessions = [open_prefilled(srv, conn, 1, 5, 3) for _ in range(3)]
    srv.hold(conn)

    def failing_release():
        raise RuntimeError("a pool bug")

    ids = []
    for i, session in enumerate(sessions):
        request_id = 100 + i
        args = {"session": session, **step_inputs(1, 5, 3, shared, {})}
        body = protocol.encode_request(request_id, "step", {k: to_wire(v) for k, v in args.items()})
        srv.dispatcher.on_frame(conn, bytearray(b"".join(body)), now_ns(), failing_release if i == 0 else None)
        ids.append(request_id)
    srv.go()
    replies = [conn.reply(i) for i in ids]
    assert all(r.ok for r in replies) and {r.timing["batch_rows"] for r in replies} == {3}
    assert srv.dispatcher.drain(5.0)


def test_a_scan_with_no_rows_is_refused_beside_others_as_alone(inproc):
    """A zero-row x queued behind a scan it could share a launch with is refused as it is alone
    (found in review: stacked, x was not empty, and it was answered with empty results)."""
    srv = inproc(max_delay_us=0)
    conn = RecordingConnection()
    srv.hold(conn)
    ids = [srv.submit(conn, "scan", **make_scan_inputs(ScanCase(rows, 3, 4, 2))) for rows in (2, 0)]
    srv.go()
    assert conn.reply(ids[0]).ok
    refused = conn.reply(ids[1])
    assert not refused.ok and refused.error["detail"]["field"] == "args.x", refused.error


@pytest.mark.parametrize("device", SERVER_DEVICES)
def test_scans_of_equal_shapes_share_a_launch(inproc, device):
    srv = inproc(device=device, max_delay_us=0)
    conn = RecordingConnection()
    dim, state, seq = 6, 4, 5
    case = ScanCase(1, seq, dim, state, D=True)
    constants = make_scan_inputs(case)
    shared = {k: constants[k] for k in ("A", "D")}

    def inputs(batch, h0=False):
        fresh = make_scan_inputs(ScanCase(batch, seq, dim, state, D=True, h0=h0))
        return {**fresh, **shared}

    plain = [inputs(2), {**inputs(3), "return_state": False}]
    session = open_prefilled(srv, conn, 1, dim, state)
    session_start = state_of(srv, conn, session)
    prefill, with_h0 = inputs(1), inputs(4, h0=True)
    srv.hold(conn)
    ids = [srv.submit(conn, "scan", **plain[0]), srv.submit(conn, "scan", **plain[1]),
           srv.submit(conn, "scan", session=session, **{k: v for k, v in prefill.items() if k != "return_state"}),
           srv.submit(conn, "scan", **with_h0)]
    srv.go()
    replies = [conn.reply(i) for i in ids]
    assert [r.timing["batch_rows"] for r in replies] == [5, 5, 5, 5]  # no h0 | initial state given
    assert_launch_stages_shared(replies[:2])
    assert_launch_stages_shared(replies[2:])
    for what, reply, inp in (("plain 0", replies[0], plain[0]), ("plain 1", replies[1], plain[1]),
                             ("h0", replies[3], with_h0)):
        y_ref, state_ref = reference_scan(inp)
        result = result_from_wire(reply.result, as_torch=True)
        assert_close(result["y"], y_ref, torch.float32, f"{what} y")
        if inp.get("return_state"):
            assert_close(result["state"], state_ref, torch.float32, f"{what} state", STATE_TOLERANCE)
        else:
            assert "state" not in result
    y_ref, state_ref = reference_scan({**prefill, "h0": session_start})
    assert_close(result_from_wire(replies[2].result, as_torch=True)["y"], y_ref, torch.float32, "session y")
    assert_close(state_of(srv, conn, session), state_ref, torch.float32, "session state", STATE_TOLERANCE)


def test_big_scans_run_alone(inproc):
    srv = inproc(max_delay_us=0)
    conn = RecordingConnection()
    dim, state = 64, 2
    seq = BATCH_MAX_X_BYTES // (4 * dim) + 1  # one row of x is just over the cap
    shared = make_scan_inputs(ScanCase(1, 1, dim, state))
    scans = [{**make_scan_inputs(ScanCase(1, seq, dim, state)), "A": shared["A"]} for _ in range(2)]
    srv.hold(conn)
    ids = [srv.submit(conn, "scan", **s) for s in scans]
    srv.go()
    for i, s in zip(ids, scans):
        reply = conn.reply(i)
        assert reply.timing["batch_rows"] == 1
        assert_close(result_from_wire(reply.result, as_torch=True)["y"], reference_scan(s)[0], torch.float32, "y")


# -- the wait policy --------------------------------------------------------------------------


@dataclass
class FakeCall:
    enqueued_ns: int
    timing: Timing
    stats_op: str = "step"


def fake_item(key, rows=1, enqueued_ns=0, session=None) -> Item:
    return Item(FakeCall(enqueued_ns, Timing(0)), key, rows, {}, {}, session)


def test_policy_waits_no_later_than_a_members_deadline():
    """A batch waiting for company stops a margin before its earliest member's deadline_us runs
    out, so that member still starts in time (found in review: it waited out max_delay_us)."""
    policy = BatchPolicy(max_delay_us=500_000, max_batch=64)
    company = Batch(fake_item(("k",)))
    for _ in range(3):
        company.add(fake_item(("k",)))
    policy.observe(company, 0)  # four came together: three wait for a fourth
    batch = Batch(fake_item(("k",), enqueued_ns=1_000))
    assert policy.wait_s(batch, 1_000) == pytest.approx(0.5, abs=1e-5)
    late = fake_item(("k",), enqueued_ns=2_000)
    late.wait_end_ns = 30_000_000
    batch.add(late)
    soon = fake_item(("k",), enqueued_ns=3_000)
    soon.wait_end_ns = 20_000_000
    batch.add(soon)
    assert batch.wait_end_ns == 20_000_000
    assert policy.wait_s(batch, 4_000) == pytest.approx((20_000_000 - 4_000) / 1e9)
    assert policy.wait_s(batch, 20_000_000) is None


@pytest.mark.parametrize("budget_us, margin_us", [(400, 1_000), (4_000, 1_000), (50_000, 12_500)],
                         ids=["budget-under-the-least-margin", "least-margin", "quarter"])
def test_the_wait_for_company_leaves_a_quarter_of_a_deadline_at_least_a_millisecond(budget_us, margin_us):
    """A fixed millisecond before the deadline was too little on a loaded machine, whose worker
    woke later than that, so a member that could have started missed its deadline (seen in CI)."""
    assert company_wait_end_ns(7_000, budget_us * 1_000) == 7_000 + (budget_us - margin_us) * 1_000


def test_a_waiting_batch_starts_its_members_within_their_deadlines(inproc):
    # The margin the wait leaves, a quarter of the budget, outlasts a loaded box's late wake-up;
    # the delay is past the budget, so a wait that ignored the deadline would miss it.
    budget_us = 400_000
    srv = inproc(max_delay_us=5 * budget_us, native_step=False)
    conn = RecordingConnection()
    shared = shared_constants(4, 2, {})
    a, b = open_prefilled(srv, conn, 1, 4, 2), open_prefilled(srv, conn, 1, 4, 2)
    srv.hold(conn)
    ids = [srv.submit(conn, "step", session=s, **step_inputs(1, 4, 2, shared, {})) for s in (a, b)]
    srv.go()
    assert [conn.reply(i).timing["batch_rows"] for i in ids] == [2, 2]  # company is now expected
    reply = conn.reply(srv.submit(conn, "step", session=a, deadline_us=budget_us, **step_inputs(1, 4, 2, shared, {})))
    assert reply.ok, reply.error
    assert reply.timing["queue_us"] < budget_us and reply.timing["batch_rows"] == 1


def test_a_request_gathered_into_a_waiting_batch_can_be_cancelled(inproc):
    """Gathered is not started: a cancel drops the batch's lead and its member while they wait
    for company (found in review: `cancelled` false, and both ran)."""
    srv = inproc(max_delay_us=2_000_000, native_step=False)
    conn = RecordingConnection()
    shared = shared_constants(4, 2, {})
    sessions = [open_prefilled(srv, conn, 1, 4, 2) for _ in range(3)]
    srv.hold(conn)
    ids = [srv.submit(conn, "step", session=s, **step_inputs(1, 4, 2, shared, {})) for s in sessions]
    srv.go()
    assert [conn.reply(i).timing["batch_rows"] for i in ids] == [3, 3, 3]
    before = [state_of(srv, conn, s) for s in sessions]
    lead = srv.submit(conn, "step", session=sessions[0], **step_inputs(1, 4, 2, shared, {}))
    wait_until(lambda: srv.dispatcher.queue_length() == 0, "the worker took the lead")
    member = srv.submit(conn, "step", session=sessions[1], **step_inputs(1, 4, 2, shared, {}))
    wait_until(lambda: srv.dispatcher.queue_length() == 0, "the worker gathered the member")
    for request_id in (member, lead):
        assert srv.call(conn, "cancel", id=request_id) == {"cancelled": True}
        reply = conn.reply(request_id, timeout=1)
        assert not reply.ok and reply.error["code"] == "cancelled", reply.error
    assert all(torch.equal(state_of(srv, conn, s), old) for s, old in zip(sessions, before))


def test_a_drain_ends_a_batchs_wait_for_company(inproc):
    """Once the server drains no company can come: a batch waiting for it runs at once and is
    answered (found in review: it waited out max_delay_us, past the drain's time, unanswered)."""
    srv = inproc(max_delay_us=3_000_000, native_step=False)
    conn = RecordingConnection()
    shared = shared_constants(4, 2, {})
    a, b = open_prefilled(srv, conn, 1, 4, 2), open_prefilled(srv, conn, 1, 4, 2)
    srv.hold(conn)
    ids = [srv.submit(conn, "step", session=s, **step_inputs(1, 4, 2, shared, {})) for s in (a, b)]
    srv.go()
    assert [conn.reply(i).timing["batch_rows"] for i in ids] == [2, 2]
    lone = srv.submit(conn, "step", session=a, **step_inputs(1, 4, 2, shared, {}))
    wait_until(lambda: srv.dispatcher.queue_length() == 0, "the worker took the step")
    assert srv.dispatcher.drain(1.0) is True
    reply = conn.reply(lone, timeout=0)
    assert reply.ok and reply.timing["batch_rows"] == 1, reply.error


def test_policy_waits_only_for_expected_company():
    policy = BatchPolicy(max_delay_us=500, max_batch=64)
    lone = Batch(fake_item(("k",), enqueued_ns=1_000))
    assert policy.wait_s(lone, 1_100) is None  # nobody came together before: no wait
    pair = Batch(fake_item(("k",), enqueued_ns=1_000))
    pair.add(fake_item(("k",), enqueued_ns=1_050))
    policy.observe(pair, 2_000)
    alone_again = Batch(fake_item(("k",), enqueued_ns=10_000))
    assert policy.wait_s(alone_again, 10_100) == pytest.approx(499_900e-9)  # until 500 µs after arrival
    assert policy.wait_s(alone_again, 10_000 + 500_000) is None  # the window is over
    assert policy.wait_s(Batch(fake_item(("other",), enqueued_ns=10_000)), 10_100) is None  # per key
    later = 2_000 + 1_000_000_001  # a second after the pair: forgotten
    assert policy.wait_s(Batch(fake_item(("k",), enqueued_ns=later)), later + 100) is None
    assert BatchPolicy(max_delay_us=0, max_batch=64).wait_s(alone_again, 10_100) is None


@pytest.mark.parametrize("more_input", [True, False], ids=["queued", "idle-lane"])
def test_a_lone_caller_never_waits_and_company_is_waited_for(inproc, more_input):
    """The wait policy, where steps go through the batcher: without the native step path (on
    the CPU it serves at once every step that finds nothing in flight, tests/test_native_step.py)."""
    delay_us = 500_000
    srv = inproc(max_delay_us=delay_us, native_step=False)
    conn = RecordingConnection()
    shared = shared_constants(4, 2, {})
    a, b = open_prefilled(srv, conn, 1, 4, 2), open_prefilled(srv, conn, 1, 4, 2)
    for _ in range(3):
        reply = conn.reply(srv.submit(conn, "step", session=a, more_input=more_input,
                                      **step_inputs(1, 4, 2, shared, {})))
        # A wait for company is the whole delay at least; anything shorter is a loaded box's lateness.
        assert reply.ok and reply.timing["queue_us"] < 0.8 * delay_us
    srv.hold(conn)
    ids = [srv.submit(conn, "step", session=s, **step_inputs(1, 4, 2, shared, {})) for s in (a, b)]
    srv.go()
    assert [conn.reply(i).timing["batch_rows"] for i in ids] == [2, 2]
    # Two came together a moment ago: one alone now waits for the other, up to the delay, even
    # on an idle server with nothing more waiting on its lane (it goes through the worker).
    reply = conn.reply(srv.submit(conn, "step", session=a, more_input=more_input,
                                  **step_inputs(1, 4, 2, shared, {})))
    assert reply.ok and reply.timing["queue_us"] >= 0.9 * delay_us and reply.timing["batch_rows"] == 1


def test_an_idle_server_serves_a_request_on_the_thread_that_read_it(inproc):
    srv = inproc()
    conn = RecordingConnection()
    me = threading.current_thread().name
    request_id = srv.submit(conn, "ping", more_input=False)
    # Served before submit returned: the reply is already there, written by this thread.
    assert conn.reply(request_id, timeout=0).ok and srv.ping_threads == [me]
    srv.request(conn, "ping")  # more input may be waiting, the transport cannot tell: the worker
    assert srv.ping_threads == [me, "bridge-worker"]
    # One that can tell (a function: its thread reads this connection only): a request the
    # batcher never gathers is served on the reading thread even when more input waits.
    assert conn.reply(srv.submit(conn, "ping", more_input=lambda: True), timeout=0).ok
    assert srv.ping_threads[-1] == me
    # One that finds another in flight is queued: the worker serves it.
    srv.hold(conn)
    queued = srv.submit(conn, "ping", more_input=lambda: False)
    srv.go()
    assert conn.reply(queued).ok and srv.ping_threads[-1] == "bridge-worker"
    # A failure on this thread is answered like any other, and the server serves on.
    bad = conn.reply(srv.submit(conn, "step", session="nope", more_input=False,
                                **step_inputs(1, 4, 2, shared_constants(4, 2, {}), {})), timeout=0)
    assert not bad.ok and bad.error["code"] == "unknown_session"
    assert conn.reply(srv.submit(conn, "ping", more_input=False), timeout=0).ok
    assert srv.ping_threads[-1] == me
    # A transport may pass a function that tells, asked only for an idle server's request.
    assert conn.reply(srv.submit(conn, "ping", more_input=lambda: False), timeout=0).ok
    assert srv.ping_threads[-1] == me


def test_drain_does_not_report_all_answered_before_a_request_admitted_meanwhile_is(inproc):
    """drain() stops admission and waits until nothing is in flight; a request is admitted by
    reading that it may be, then counting itself in flight. Done apart, a reader between the two
    let drain find nothing in flight and return (the server then exits) with the request
    admitted after it, never answered."""
    srv = inproc()
    conn = RecordingConnection()
    race = DrainRace(srv.dispatcher, conn)
    request_id = srv.submit(conn, "ping")
    assert race.finish() == ["replied", ("drained", True)]
    assert conn.reply(request_id, timeout=0).ok


def test_a_drain_out_of_time_answers_what_never_started_shutting_down(inproc):
    """drain() waits for what is in flight; what is still queued when its time runs out, never
    started, is answered shutting_down, legacy requests (no id) too (found in review: they got
    no reply at all, and a ZeroMQ peer waited out its own timeout)."""
    srv = inproc()
    conn, other, legacy_peer = RecordingConnection(), RecordingConnection(), LegacyConnection()
    srv.hold(other)  # the worker parked in a ping: nothing behind it starts
    queued = [srv.submit(conn, "ping"), srv.submit(conn, "session_open", batch=1, dim=2, state=2)]
    srv.dispatcher.on_frame(legacy_peer, bytearray(msgspec.msgpack.encode({"op": "ping"})), now_ns())
    assert srv.dispatcher.drain(0.05) is False
    for request_id in queued:
        reply = conn.reply(request_id, timeout=5)
        assert not reply.ok and reply.error["code"] == "shutting_down", reply.error
    (legacy,) = legacy_peer.replies
    assert legacy["status"] == "error" and "shutting down" in legacy["message"], legacy
    srv.go()  # the parked ping finishes and is answered; the dropped requests never run
    assert srv.server.sessions.usage()["sessions"] == 0
    assert srv.dispatcher.drain(1) is True


class LegacyConnection(RecordingConnection):
    """Keeps replies in ExPhil's legacy shape (SPEC §9), decoded as plain msgpack."""

    def __init__(self):
        super().__init__()
        self.replies: list = []

    def send(self, parts: list, buffers: list | None = None) -> None:
        self.replies.append(msgspec.msgpack.decode(b"".join(parts)))


def test_after_shutdown_answers_no_new_request_is_taken(inproc):
    """SPEC §6: after {"stopping": true} the server takes no new request. The stop was asked
    for only once the reply was written, and the main loop noticed it up to a poll later:
    requests sent meanwhile were served (found in review)."""
    srv = inproc()
    conn = RecordingConnection()
    assert srv.call(conn, "shutdown") == {"stopping": True}
    reply = srv.request(conn, "session_open", batch=1, dim=2, state=2)
    assert not reply.ok and reply.error["code"] == "shutting_down", reply.error
    assert srv.server.sessions.usage()["sessions"] == 0


def test_a_shutdown_waits_for_a_load_another_connection_sent_before_it(inproc):
    """docs/operations.md: a shutdown runs in its turn, after the requests admitted before it.
    A CPU model_load finishes on the loader thread, beside the worker: the shutdown ran there
    meanwhile, and the drain that followed cut the load off unanswered once it took longer than
    the drain's time (found in review)."""
    loads = BackgroundLoads()
    srv = inproc(handlers={"model_load": loads.handler})
    loader, operator, other = RecordingConnection(), RecordingConnection(), RecordingConnection()
    load_id = srv.submit(loader, "model_load", path="checkpoint")
    loads.wait_started("checkpoint")
    stop_id = srv.submit(operator, "shutdown")
    try:
        # The worker serves in arrival order: once this ping is answered, it has served the shutdown.
        assert srv.request(other, "ping").ok
        assert operator.answered == [] and not srv.server.stop_requested.is_set()
    finally:
        loads.go()
    assert loader.reply(load_id).ok
    assert operator.reply(stop_id).result == {"stopping": True}
    assert srv.server.stop_requested.is_set()
    assert srv.dispatcher.drain(5) is True


def test_a_request_behind_one_in_flight_waits_its_turn(inproc):
    srv = inproc(max_delay_us=0)
    conn = RecordingConnection()
    shared = shared_constants(5, 3, {})
    session = open_prefilled(srv, conn, 2, 5, 3)
    start = state_of(srv, conn, session)
    first, second = step_inputs(2, 5, 3, shared, {}), step_inputs(2, 5, 3, shared, {})
    srv.hold(conn)
    # Something is in flight: even with nothing more waiting on its lane, the step is queued
    # (submit returns at once although the worker is parked) and runs after the ping.
    ids = [srv.submit(conn, "step", session=session, more_input=False, **first)]
    srv.go()
    ids.append(srv.submit(conn, "step", session=session, more_input=False, **second))
    replies = [conn.reply(i) for i in ids]
    _, middle = reference_update({**first, "state": start})
    check_step(replies[0], first, start, None, "first step")
    check_step(replies[1], second, middle.float(), state_of(srv, conn, session), "second step")


def test_answered_requests_leave_no_reference_cycles(inproc):
    """Reference counting frees a request (its tensors, their views of the frame) once it is
    answered, on either serving thread: a cycle between the call and its batch item once left
    every request to the cyclic garbage collector, whose pauses made the game loop's p99."""
    srv = inproc(max_delay_us=0)
    conn = RecordingConnection()
    shared = shared_constants(5, 3, {})
    sessions = [open_prefilled(srv, conn, 2, 5, 3) for _ in range(2)]
    gc.collect()
    # Held through the window: nothing made before it (an earlier test's server, let go when its
    # thread ends, with the cycles its test's stand-ins made) can turn to garbage in it.
    made_before = gc.get_objects()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        alone = srv.submit(conn, "step", session=sessions[0], more_input=False, **step_inputs(2, 5, 3, shared, {}))
        assert conn.reply(alone, timeout=0).ok  # served on this thread
        srv.hold(conn)
        batched = [srv.submit(conn, "step", session=s, **step_inputs(2, 5, 3, shared, {})) for s in sessions]
        srv.go()
        assert all(conn.reply(i).ok for i in batched)
        srv.request(conn, "ping")  # the worker has finished the batch before it answers this
        gc.collect()
        ours = [type(o).__qualname__ for o in gc.garbage
                if type(o).__module__.split(".")[0] in ("bridge", "protocol", "scan_kernels")]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        del made_before
    assert ours == []


class RecordingOp(BatchedOp):
    """Records the launches it is given."""

    def __init__(self):
        self.launches = []

    def prepare(self, server, call):
        raise NotImplementedError("items are made by the test")

    def run(self, server, items):
        self.launches.append(list(items))
        return [{"rows": item.rows} for item in items]


def test_members_whose_session_closed_or_was_lost_while_waiting_are_left_out():
    """A member's session may have closed, or been left lost by a launch that failed partway
    (SPEC §6.1, state_lost), after the member was prepared."""
    class FakeSession:
        def __init__(self, closed, lost=False):
            self.id, self.closed, self.lost = f"s-{closed}-{lost}", closed, lost

    op = RecordingOp()
    items = [fake_item(("k",), 2, session=FakeSession(False)), fake_item(("k",), 3, session=FakeSession(True)),
             fake_item(("k",), 1, session=FakeSession(False)), fake_item(("k",), 4, session=FakeSession(False, True))]
    server = SimpleNamespace(stats=Stats())
    outcomes = dict((id(item), outcome) for item, outcome in run_batch(server, op, items))
    assert [len(launch) for launch in op.launches] == [2]
    assert server.stats.ops["step"]["execution_count"] == 1
    assert outcomes[id(items[0])] == {"rows": 2} and outcomes[id(items[2])] == {"rows": 1}
    closed, lost = outcomes[id(items[1])], outcomes[id(items[3])]
    assert isinstance(closed, OpError) and closed.code == "unknown_session"
    assert str(closed) == str(unknown_session("s-True-False", "args.session"))
    assert isinstance(lost, OpError) and lost.code == "state_lost"
    assert lost.detail == {"field": "args.session", "session": "s-False-True"}
    assert items[0].call.timing.extra["batch_rows"] == items[2].call.timing.extra["batch_rows"] == 3


# -- real concurrency through a subprocess ---------------------------------------------------


@pytest.mark.parametrize("device, flags, native", [
    pytest.param("cpu", [], True, id="native-path"),
    pytest.param("cpu", ["--no-native-step"], False, id="batcher"),
    # On a GPU there is no native path: the batcher gathers every step.
    pytest.param("cuda", [], False, id="cuda", marks=ON_CUDA),
])
def test_concurrent_callers_over_stdio_each_get_their_rows(device, flags, native):
    """8 threads of one client step sessions of their own at once. By default the native path
    serves every step that finds nothing in flight and the batcher the ones queued behind it;
    with --no-native-step (and on a GPU) the batcher gathers them all."""
    callers, steps, dim, state = 8, 12, 16, 4
    shared = shared_constants(dim, state, {"D": True})
    args = ["--device", device, "--max-delay-us", "5000", *flags]
    with PortClient(args, as_torch=True) as client:
        handles = {k: client.put(v) for k, v in shared.items()}
        sessions = [client.open_session(1 + i % 3, dim, state) for i in range(callers)]
        failures, seen = [], []  # (rows, batch_rows, served natively) of every reply
        start = threading.Barrier(callers)

        def caller(i):
            rows = 1 + i % 3
            state_ref = torch.zeros(rows, dim, state, dtype=torch.float64)
            start.wait()
            for t in range(steps):
                inputs = step_inputs(rows, dim, state, shared, {"D": True})
                reply = client.step(sessions[i], **{**inputs, **handles})
                if not reply.ok:
                    failures.append((i, t, reply.error))
                    return
                seen.append((rows, reply.timing["batch_rows"], served_natively(reply)))
                y_ref, state_ref = reference_update({**inputs, "state": state_ref})
                try:
                    assert_close(reply.result["y"], y_ref, torch.float32, f"caller {i} step {t}")
                except AssertionError as exc:
                    failures.append((i, t, str(exc)))
                    return

        threads = [threading.Thread(target=caller, args=(i,)) for i in range(callers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not failures, failures[:3]
        assert len(seen) == callers * steps
        stats = client.stats()["ops"]["step"]
        assert stats["execution_count"] == round(sum(own / total for own, total, _ in seen))
        natively = sum(served for _, _, served in seen)
        if native:
            assert natively > 0
        else:
            assert natively == 0
            # Some launch took rows of several callers: a reply's launch had more rows than its own.
            assert any(total > own for own, total, _ in seen), seen


def test_an_unregistered_error_code_is_still_answered(inproc):
    """A handler raising a code ERROR_CODES lacks is a server bug; its request is answered all
    the same (internal_error, the code named), and the server serves on."""
    from bridge.errors import OpError

    def broken(server, call):
        raise OpError("not_a_code", "the handler's own words", {"field": "args"})

    srv = inproc(handlers={"stats": broken})
    conn = RecordingConnection()
    error = srv.request(conn, "stats").error
    assert error["code"] == "internal_error" and "'not_a_code'" in error["message"]
    assert srv.call(conn, "ping") == {"pong": True}
