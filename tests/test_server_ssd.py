"""Mamba-2 (SSD) and packed sequences through the server: `ssd_scan`, kind "ssd" sessions
(prefill, steps batched across callers, state), `cu_seqlens` on both scans, mamba_ssm's argument
names, and a structured error naming the field for every malformed request, after which the
server serves on.

The pipeline tests run an in-process server on the torch backend (the kernels' own suites test
every backend against the reference); one test goes end to end through a server process on its
default backend.
"""

from __future__ import annotations

import math

import pytest
import torch

from bridge.client import PortClient, result_from_wire, server_env
from bridge_fakes import RecordingConnection
from kernel_cases import (STATE_TOLERANCE, SsdCase, SsdUpdateCase, assert_close, make_ssd_inputs,
                          make_ssd_update_inputs, random_seed, reference_scan, reference_ssd_scan,
                          reference_ssd_update, ScanCase, make_scan_inputs)

PER_TIMESTEP = ("x", "dt", "z", "B", "C")
CONSTANTS = ("A", "D", "dt_bias", "dt_softplus", "dt_min", "dt_max")


@pytest.fixture
def srv(inproc):
    return inproc(backend="torch", max_delay_us=0)


def _y_and_state(result: dict):
    return result["y"], result.get("state")


@pytest.mark.parametrize("case", [
    pytest.param(SsdCase(2, 9, 4, 6, 5, groups=2, D=True, z=True, dt_bias=True, dt_softplus=True), id="groups2-options"),
    pytest.param(SsdCase(1, 13, 3, 5, 7, D=True, D_per_channel=True, clamp=True, h0=True, chunk_size=4), id="h0-clamp-chunk4"),
    pytest.param(SsdCase(3, 1, 2, 3, 4), id="seq1"),
])
def test_ssd_scan_matches_the_reference(srv, case):
    seed = random_seed()
    inputs = make_ssd_inputs(case, seed=seed)
    y, state = _y_and_state(srv.call(RecordingConnection(), "ssd_scan", **inputs))
    y_ref, state_ref = reference_ssd_scan(inputs)
    assert_close(y, y_ref, torch.float32, f"y seed={seed}")
    assert_close(state, state_ref, torch.float32, f"state seed={seed}", STATE_TOLERANCE)


@pytest.mark.parametrize("op", ["scan", "ssd_scan"])
def test_the_copy_of_y_to_the_host_is_timed_as_d2h(srv, monkeypatch, op):
    """SPEC §8: d2h_us is the device → host copies. ssd_scan's copy of y was timed in no stage
    (found in review), scan's in d2h: made slow here, as a large GPU copy is."""
    import time

    import bridge.batcher
    import bridge.ops.scan

    def slow(to_wire):
        return lambda *args, **kwargs: (time.sleep(0.05), to_wire(*args, **kwargs))[1]

    for module in (bridge.ops.scan, bridge.batcher):
        monkeypatch.setattr(module, "to_wire", slow(module.to_wire))
    if op == "ssd_scan":
        inputs = make_ssd_inputs(SsdCase(1, 8, 2, 4, 3), seed=random_seed())
    else:
        inputs = make_scan_inputs(ScanCase(1, 8, 4, 3), seed=random_seed())
    inputs.pop("return_state", None)
    inputs.pop("h0", None)
    timing = srv.request(RecordingConnection(), op, **inputs).timing
    assert timing["d2h_us"] >= 50_000, timing
    stages = sum(timing.get(f"{stage}_us", 0) for stage in ("decode", "queue", "h2d", "kernel", "d2h", "encode"))
    assert timing["server_us"] - stages < 25_000, timing


def test_mamba_ssm_names_map_over_one_to_one(srv):
    conn = RecordingConnection()
    inputs = make_ssd_inputs(SsdCase(2, 7, 2, 4, 3, h0=True, dt_softplus=True))
    ours = srv.call(conn, "ssd_scan", **inputs)
    theirs_args = {k: v for k, v in inputs.items() if k not in ("h0", "return_state")}
    for asking in ("return_final_states", "return_last_state"):  # mamba_chunk_scan_combined's, selective_scan's
        theirs = srv.call(conn, "ssd_scan", initial_states=inputs["h0"], **{asking: True}, **theirs_args)
        assert torch.equal(ours["y"], theirs["y"]) and torch.equal(ours["state"], theirs["state"]), asking
    both = srv.request(conn, "ssd_scan", return_final_states=True, return_last_state=True, **theirs_args)
    assert not both.ok and both.error["code"] == "invalid_argument", both.error
    # dt_limit: (0, inf) clamps nothing; another pair is dt_min, dt_max.
    plain = srv.call(conn, "ssd_scan", **theirs_args)["y"]
    assert torch.equal(srv.call(conn, "ssd_scan", dt_limit=(0.0, math.inf), **theirs_args)["y"], plain)
    clamped = srv.call(conn, "ssd_scan", dt_min=0.2, dt_max=0.4, **theirs_args)["y"]
    assert torch.equal(srv.call(conn, "ssd_scan", dt_limit=(0.2, 0.4), **theirs_args)["y"], clamped)
    assert not torch.equal(clamped, plain)
    # Mamba-1's scan: delta_softplus, delta_bias, return_last_state.
    m1 = make_scan_inputs(ScanCase(2, 6, 4, 3, dt_bias=True))
    args = {k: v for k, v in m1.items() if k not in ("dt_bias", "return_state")}
    ours = srv.call(conn, "scan", dt_bias=m1["dt_bias"], dt_softplus=True, return_state=True, **args)
    theirs = srv.call(conn, "scan", delta_bias=m1["dt_bias"], delta_softplus=True, return_last_state=True, **args)
    assert torch.equal(ours["y"], theirs["y"]) and torch.equal(ours["state"], theirs["state"])


@pytest.mark.parametrize("op", ["scan", "ssd_scan"])
def test_packed_sequences_equal_separate_scans(srv, op):
    conn = RecordingConnection()
    lengths = (3, 1, 6)
    seq = sum(lengths)
    if op == "scan":
        inputs = make_scan_inputs(ScanCase(1, seq, 6, 4, D=True))
        h0 = torch.randn(len(lengths), 6, 4)
    else:
        inputs = make_ssd_inputs(SsdCase(1, seq, 2, 3, 4, D=True))
        h0 = torch.randn(len(lengths), 2, 3, 4)
    cu = torch.tensor([0, 3, 4, 10], dtype=torch.int32)
    packed = srv.call(conn, op, **inputs, h0=h0, cu_seqlens=cu)
    assert packed["state"].shape[0] == len(lengths)
    reference = reference_scan if op == "scan" else reference_ssd_scan
    for i in range(len(lengths)):
        begin, end = int(cu[i]), int(cu[i + 1])
        one = {k: (v[:, begin:end] if k in PER_TIMESTEP else v) for k, v in inputs.items()}
        y_ref, state_ref = reference({**one, "h0": h0[i:i + 1]})
        assert_close(packed["y"][:, begin:end], y_ref, torch.float32, f"sequence {i} y")
        assert_close(packed["state"][i:i + 1], state_ref, torch.float32, f"sequence {i} state", STATE_TOLERANCE)


def test_mamba_ssm_varlen_arguments_give_the_packed_sequences(srv):
    """A mamba_chunk_scan_combined call's varlen arguments as mamba_ssm names them: seq_idx
    (alone, or beside cu_seqlens) and return_varlen_states give the reply cu_seqlens and
    return_state give, one state row per sequence."""
    conn = RecordingConnection()
    inputs = make_ssd_inputs(SsdCase(1, 10, 2, 3, 4, D=True, z=True, dt_bias=True, dt_softplus=True))
    inputs.pop("return_state")
    cu = torch.tensor([0, 3, 4, 10], dtype=torch.int32)
    seq_idx = torch.tensor([[0, 0, 0, 1, 2, 2, 2, 2, 2, 2]], dtype=torch.int32)
    expected = srv.call(conn, "ssd_scan", **inputs, cu_seqlens=cu, return_state=True)
    assert expected["state"].shape[0] == 3
    for args in ({"seq_idx": seq_idx, "return_state": True},
                 {"seq_idx": seq_idx, "cu_seqlens": cu, "return_varlen_states": True},
                 {"cu_seqlens": cu, "return_varlen_states": True},
                 {"seq_idx": seq_idx, "return_final_states": True, "return_varlen_states": True}):
        got = srv.call(conn, "ssd_scan", **inputs, **args)
        assert torch.equal(got["y"], expected["y"]) and torch.equal(got["state"], expected["state"]), sorted(args)
    plain = srv.call(conn, "ssd_scan", **inputs, seq_idx=seq_idx)
    assert torch.equal(plain["y"], expected["y"]) and "state" not in plain


def test_a_prefill_refuses_seq_idx(srv):
    """A session holds one state per row, as with cu_seqlens."""
    conn = RecordingConnection()
    session = srv.call(conn, "session_open", kind="ssd", batch=1, heads=4, headdim=3, state=5)["session"]
    reply = srv.request(conn, "ssd_scan", session=session, **_ssd(seq_idx=torch.zeros(1, 6, dtype=torch.int32)))
    assert (reply.error["code"], reply.error["detail"]["field"]) == ("invalid_argument", "args.seq_idx"), reply.error
    assert srv.call(conn, "session_state", session=session)["state"].abs().sum() == 0


def test_ssd_prefill_then_steps_equal_one_scan(srv):
    conn = RecordingConnection()
    case = SsdCase(2, 8, 4, 3, 5, groups=2, D=True, z=True, dt_bias=True, dt_softplus=True, clamp=True)
    inputs = make_ssd_inputs(case)
    session = srv.call(conn, "session_open", kind="ssd", batch=2, heads=4, headdim=3, state=5)["session"]
    prefill = 5
    window = {k: (v[:, :prefill] if k in PER_TIMESTEP else v) for k, v in inputs.items() if k != "return_state"}
    ys = [srv.call(conn, "ssd_scan", session=session, **window)["y"]]
    for t in range(prefill, case.seq):
        step = {k: (v[:, t] if k in PER_TIMESTEP else v) for k, v in inputs.items() if k in PER_TIMESTEP + CONSTANTS}
        ys.append(srv.call(conn, "step", session=session, **step)["y"].unsqueeze(1))
    y_ref, state_ref = reference_ssd_scan(inputs)
    assert_close(torch.cat(ys, dim=1), y_ref, torch.float32, "prefill + steps y")
    state = srv.call(conn, "session_state", session=session)["state"]
    assert state.shape == (2, 4, 3, 5)
    assert_close(state, state_ref, torch.float32, "session state", STATE_TOLERANCE)


def test_an_ssd_prefill_returns_the_fp32_state_it_keeps_from_f64_inputs(srv):
    conn = RecordingConnection()
    inputs = {k: v.double() if torch.is_tensor(v) and v.is_floating_point() else v
              for k, v in make_ssd_inputs(SsdCase(1, 5, 2, 3, 2)).items() if k not in ("h0", "return_state")}
    session = srv.call(conn, "session_open", kind="ssd", batch=1, heads=2, headdim=3, state=2)["session"]
    state = srv.call(conn, "ssd_scan", session=session, return_state=True, **inputs)["state"]
    assert state.dtype == torch.float32
    assert torch.equal(state, srv.call(conn, "session_state", session=session)["state"])


def test_ssd_steps_of_two_sessions_share_a_launch(srv):
    conn = RecordingConnection()
    constants = make_ssd_update_inputs(SsdUpdateCase(1, 4, 3, 8, D=True))
    sessions, inputs, before = [], [], []
    for rows in (2, 3):
        session = srv.call(conn, "session_open", kind="ssd", batch=rows, heads=4, headdim=3, state=8)["session"]
        srv.call(conn, "ssd_scan", session=session, **make_ssd_inputs(SsdCase(rows, 3, 4, 3, 8)))
        before.append(srv.call(conn, "session_state", session=session)["state"])
        one = make_ssd_update_inputs(SsdUpdateCase(rows, 4, 3, 8))
        one.update(A=constants["A"], D=constants["D"])
        del one["state"]
        sessions.append(session)
        inputs.append(one)
    srv.hold(conn)
    ids = [srv.submit(conn, "step", session=s, **i) for s, i in zip(sessions, inputs)]
    srv.go()
    replies = [conn.reply(i) for i in ids]
    assert [r.timing["batch_rows"] for r in replies] == [5, 5]
    for reply, session, one, start in zip(replies, sessions, inputs, before):
        assert reply.ok, reply.error
        y_ref, state_ref = reference_ssd_update({**one, "state": start})
        assert_close(result_from_wire(reply.result, as_torch=True)["y"], y_ref, torch.float32, "y")
        assert_close(srv.call(conn, "session_state", session=session)["state"], state_ref, torch.float32,
                     "state", STATE_TOLERANCE)


def _ssd(**changes):
    inputs = make_ssd_inputs(SsdCase(1, 6, 4, 3, 5, groups=2))
    inputs.update(changes)
    return {k: v for k, v in inputs.items() if v is not None}


BAD_REQUESTS = [
    pytest.param("ssd_scan", lambda: _ssd(B=torch.randn(1, 6, 3, 5), C=torch.randn(1, 6, 3, 5)),
                 "shape_mismatch", "args.B", id="heads-not-divisible-by-groups"),
    pytest.param("ssd_scan", lambda: _ssd(x=torch.randn(1, 6, 12)), "shape_mismatch", "args.x", id="x-rank"),
    pytest.param("ssd_scan", lambda: _ssd(D=torch.randn(3)), "shape_mismatch", "args.D", id="D-shape"),
    pytest.param("ssd_scan", lambda: _ssd(cu_seqlens=torch.tensor([0, 4, 2, 6], dtype=torch.int32)),
                 "invalid_argument", "args.cu_seqlens", id="cu_seqlens-not-increasing"),
    pytest.param("ssd_scan", lambda: _ssd(cu_seqlens=torch.tensor([0, 4], dtype=torch.int32)),
                 "invalid_argument", "args.cu_seqlens", id="cu_seqlens-not-ending-at-seq"),
    pytest.param("ssd_scan", lambda: _ssd(cu_seqlens=torch.tensor([0, 2, 6], dtype=torch.float32)),
                 "invalid_argument", "args.cu_seqlens", id="cu_seqlens-float"),
    pytest.param("ssd_scan", lambda: _ssd(h0=torch.zeros(3, 4, 3, 5), cu_seqlens=torch.tensor([0, 2, 6])),
                 "shape_mismatch", "args.h0", id="h0-rows-not-sequences"),
    pytest.param("ssd_scan", lambda: _ssd(seq_idx=torch.tensor([[0, 0, 1, 1, 1, 1]], dtype=torch.int32),
                                          cu_seqlens=torch.tensor([0, 4, 6])),
                 "invalid_argument", "args.seq_idx", id="seq_idx-disagrees-with-cu_seqlens"),
    pytest.param("ssd_scan", lambda: _ssd(seq_idx=torch.zeros(1, 5, dtype=torch.int32)), "shape_mismatch",
                 "args.seq_idx", id="seq_idx-shorter-than-x"),
    pytest.param("ssd_scan", lambda: _ssd(return_varlen_states=True), "invalid_argument",
                 "args.return_varlen_states", id="varlen-states-of-no-packed-sequences"),
    pytest.param("scan", lambda: {**make_scan_inputs(ScanCase(1, 6, 4, 3)), "seq_idx": torch.zeros(1, 6)},
                 "invalid_argument", "args.seq_idx", id="seq_idx-on-mamba1"),
    pytest.param("scan", lambda: {**make_scan_inputs(ScanCase(2, 6, 4, 3)), "cu_seqlens": torch.tensor([0, 6])},
                 "shape_mismatch", "args.x", id="cu_seqlens-batch-not-1"),
    pytest.param("ssd_scan", lambda: _ssd(dt_limit=(0.1, 0.2), dt_max=0.3), "invalid_argument", "args.dt_limit",
                 id="dt_limit-and-dt_max"),
    # named as sent, not as the dt_max it becomes
    pytest.param("ssd_scan", lambda: _ssd(dt_limit=(0.5, 0.1)), "invalid_argument", "args.dt_limit",
                 id="dt_limit-reversed"),
    pytest.param("ssd_scan", lambda: _ssd(dt_limit=(0.1, math.nan)), "invalid_argument", "args.dt_limit[1]",
                 id="dt_limit-nan"),
    pytest.param("ssd_scan", lambda: _ssd(dt_limit=(0.0, 1e39)), "invalid_argument", "args.dt_limit",
                 id="dt_limit-past-float32"),
    pytest.param("ssd_scan", lambda: _ssd(chunk_size=0), "invalid_argument", "args.chunk_size", id="chunk_size-0"),
    pytest.param("ssd_scan", lambda: _ssd(h0=torch.zeros(1, 4, 3, 5), initial_states=torch.zeros(1, 4, 3, 5)),
                 "invalid_argument", "args.initial_states", id="alias-and-name"),
    pytest.param("session_open", lambda: dict(kind="ssd", batch=1, dim=4, heads=2, headdim=2, state=3),
                 "invalid_argument", "args.dim", id="ssd-session-with-dim"),
    pytest.param("session_open", lambda: dict(kind="ssd", batch=1, heads=2, state=3),
                 "missing_argument", "args.headdim", id="ssd-session-without-headdim"),
    pytest.param("session_open", lambda: dict(batch=1, state=3), "missing_argument", "args.dim",
                 id="mamba-session-without-dim"),
    pytest.param("session_open", lambda: dict(kind="mamba2", batch=1, dim=2, state=3),
                 "invalid_argument", "args.kind", id="unknown-kind"),
]


@pytest.mark.parametrize("op, make_args, code, field", BAD_REQUESTS)
def test_malformed_requests_get_errors_naming_the_field(srv, op, make_args, code, field):
    conn = RecordingConnection()
    reply = srv.request(conn, op, **make_args())
    assert not reply.ok, f"{op} accepted"
    assert (reply.error["code"], reply.error["detail"].get("field")) == (code, field), reply.error
    # SPEC §7: validation errors say what was expected and what came (found in review: a
    # session's missing axis said neither).
    assert {"expected", "got"} <= set(reply.error["detail"]), reply.error
    assert srv.call(conn, "ping") == {"pong": True}


def test_a_cu_seqlens_of_another_dtype_names_the_wire_dtypes(srv):
    """As every other tensor's dtype error does (SPEC §5's names): it said it got torch.float32."""
    reply = srv.request(RecordingConnection(), "ssd_scan",
                        **_ssd(cu_seqlens=torch.tensor([0, 2, 6], dtype=torch.float32)))
    assert (reply.error["detail"]["expected"], reply.error["detail"]["got"]) == ("an integer dtype (i32, i64)", "f32")


# More boundaries than seq + 1 cannot be strictly increasing from 0 to seq. Refused from the
# shape: reading the values first made a Python int of each, many times the frame's bytes (found
# in review).
@pytest.mark.parametrize("op, make_args", [
    pytest.param("ssd_scan", lambda: _ssd(cu_seqlens=torch.tensor([0, 1, 2, 3, 4, 5, 6, 6])), id="ssd-one-too-many"),
    pytest.param("ssd_scan", lambda: _ssd(cu_seqlens=torch.full((1 << 20,), 1000, dtype=torch.int32)),
                 id="ssd-many-out-of-range"),
    pytest.param("scan", lambda: {**make_scan_inputs(ScanCase(1, 6, 4, 3)),
                                  "cu_seqlens": torch.full((1 << 20,), 1000, dtype=torch.int32)},
                 id="scan-many-out-of-range"),
])
def test_a_cu_seqlens_longer_than_seq_is_refused_from_its_shape(srv, op, make_args):
    reply = srv.request(RecordingConnection(), op, **make_args())
    assert (reply.error["code"], reply.error["detail"]["field"]) == ("shape_mismatch", "args.cu_seqlens"), reply.error
    assert "n <= seq (6)" in reply.error["detail"]["expected"], reply.error


def test_a_prefill_of_another_state_size_names_b_not_the_h0_it_never_sent(srv):
    """ssd_scan with a session whose state size B does not have: the state is the scan's h0 behind
    the scenes, but the client sent B (found in review: the error named args.h0)."""
    conn = RecordingConnection()
    session = srv.call(conn, "session_open", kind="ssd", batch=1, heads=4, headdim=3, state=4)["session"]
    reply = srv.request(conn, "ssd_scan", session=session, **_ssd())
    assert (reply.error["code"], reply.error["detail"]["field"]) == ("shape_mismatch", "args.B"), reply.error
    assert "the session's state" in reply.error["message"]


def test_sessions_take_only_their_own_generation(srv):
    conn = RecordingConnection()
    mamba = srv.call(conn, "session_open", batch=1, dim=6, state=4)["session"]
    ssd = srv.call(conn, "session_open", kind="ssd", batch=1, heads=4, headdim=3, state=5)["session"]
    errors = [
        srv.request(conn, "ssd_scan", session=mamba, **_ssd()),
        srv.request(conn, "scan", session=ssd, **make_scan_inputs(ScanCase(1, 3, 6, 4))),
        srv.request(conn, "ssd_scan", session=ssd, cu_seqlens=torch.tensor([0, 6]), **_ssd()),
    ]
    assert [(r.error["code"], r.error["detail"]["field"]) for r in errors] == [
        ("invalid_argument", "args.session"), ("invalid_argument", "args.session"),
        ("invalid_argument", "args.cu_seqlens")]
    # A Mamba-1 step's shapes on a Mamba-2 session: the kernel names the argument.
    m1_step = {k: v[:, 0] if k in PER_TIMESTEP else v
               for k, v in make_scan_inputs(ScanCase(1, 1, 12, 5)).items() if k in PER_TIMESTEP + CONSTANTS}
    reply = srv.request(conn, "step", session=ssd, **m1_step)
    assert reply.error["code"] == "shape_mismatch" and reply.error["detail"]["field"].startswith("args.")
    assert torch.equal(srv.call(conn, "session_state", session=ssd)["state"], torch.zeros(1, 4, 3, 5))
    pools = srv.call(conn, "stats")["sessions"]["pools"]
    assert sorted((p["kind"], p.get("dim"), p.get("heads")) for p in pools) == [("mamba", 6, None), ("ssd", None, 4)]


def test_ssd_end_to_end_on_the_default_backend():
    """A server process on its default CPU backend: an SSD scan, then an SSD session's prefill and
    a step, each against the float64 reference."""
    inputs = make_ssd_inputs(SsdCase(2, 5, 4, 8, 16, D=True, dt_softplus=True))
    with PortClient(["--device", "cpu"], env=server_env(), as_torch=True) as client:
        reply = client.ssd_scan(**inputs).unwrap()
        y_ref, state_ref = reference_ssd_scan(inputs)
        assert_close(reply["y"], y_ref, torch.float32, "ssd_scan y")
        assert_close(reply["state"], state_ref, torch.float32, "ssd_scan state", STATE_TOLERANCE)
        session = client.open_ssd_session(2, 4, 8, 16)
        window = {k: (v[:, :4] if k in PER_TIMESTEP else v) for k, v in inputs.items() if k != "return_state"}
        client.ssd_scan(session=session, **window).unwrap()
        last = {k: (v[:, 4] if k in PER_TIMESTEP else v) for k, v in inputs.items() if k in PER_TIMESTEP + CONSTANTS}
        y = client.step(session, **last).unwrap()["y"]
        assert_close(y, y_ref[:, 4], torch.float32, "step y")
        assert_close(client.session_state(session), state_ref, torch.float32, "session state", STATE_TOLERANCE)
