"""The `health` op: live when it answers, ready when the device answered a tiny kernel launch lately
(bridge.health) and the server is not stopping."""

from __future__ import annotations

import threading

import pytest
import torch

import bridge.health
import bridge.models
import scan_kernels
from bridge.client import PortClient, result_from_wire
from bridge.health import DeviceProbe
from bridge_fakes import RecordingConnection
from kernel_cases import (ScanCase, SsdCase, UpdateCase, backward_inputs, make_scan_inputs, make_ssd_inputs,
                          make_update_inputs)
from waiting import wait_until


@pytest.fixture
def launches(monkeypatch) -> list:
    """One entry per selective scan launched (the probe's among them)."""
    launched = []
    scan = scan_kernels.selective_scan
    monkeypatch.setattr(scan_kernels, "selective_scan", lambda *a, **k: launched.append(1) or scan(*a, **k))
    return launched


def test_a_serving_server_is_live_and_ready_over_the_port():
    with PortClient(["--device", "cpu"]) as client:
        health = client.health()
        assert "health" in client.info()["protocol"]["ops"]
    assert health["live"] is True and health["ready"] is True
    assert health["device"] == "cpu"
    kernel = health["checks"]["kernel"]
    assert kernel["ok"] is True and kernel["latency_us"] > 0 and kernel["age_ms"] >= 0
    assert "error" not in kernel and health["checks"]["accepting"] is True


def test_a_recent_launch_stands_for_the_device_and_an_old_one_is_redone(monkeypatch, launches):
    clock = [100.0]
    monkeypatch.setattr(bridge.health.time, "monotonic", lambda: clock[0])
    probe = DeviceProbe(torch.device("cpu"), None)
    first = probe.check()
    clock[0] += bridge.health.PROBE_MAX_AGE_S / 2
    again = probe.check()
    assert len(launches) == 1 and again["latency_us"] == first["latency_us"]
    assert again["age_ms"] == pytest.approx(bridge.health.PROBE_MAX_AGE_S / 2 * 1e3)
    clock[0] += bridge.health.PROBE_MAX_AGE_S
    assert probe.check()["age_ms"] == 0 and len(launches) == 2


@pytest.mark.parametrize("failure, message", [
    pytest.param(RuntimeError("device lost"), "RuntimeError: device lost", id="raises"),
    pytest.param(None, "non-finite", id="non_finite"),
])
def test_a_failing_launch_is_not_ready_and_says_why(monkeypatch, failure, message):
    def broken(x, *args, **kwargs):
        if failure is not None:
            raise failure
        return torch.full_like(x, float("nan"))

    monkeypatch.setattr(scan_kernels, "selective_scan", broken)
    check = DeviceProbe(torch.device("cpu"), None).check()
    assert check["ok"] is False and message in check["error"]


def test_a_stopping_server_is_live_but_not_ready(inproc, monkeypatch):
    """A health request queued before the stop (its probe to launch) and run after it says so;
    one sent after the stop is answered so at once while that launch is recent, and refused
    shutting_down, as any new request, once the device check would need a launch."""
    srv = inproc()
    conn, other = RecordingConnection(), RecordingConnection()
    srv.hold(other)
    queued = srv.submit(conn, "health")
    srv.server.stop_requested.set()
    srv.go()
    reply = conn.reply(queued)
    health = result_from_wire(reply.result)
    assert health["live"] is True and health["ready"] is False
    assert health["checks"] == {"kernel": health["checks"]["kernel"], "accepting": False}
    assert health["checks"]["kernel"]["ok"] is True
    assert srv.call(conn, "health")["ready"] is False
    monkeypatch.setattr(bridge.health, "PROBE_MAX_AGE_S", 0.0)
    refused = srv.request(conn, "health")
    assert not refused.ok and refused.error["code"] == "shutting_down"


def test_a_server_draining_after_a_stop_signal_or_stdin_closing_is_not_ready(inproc):
    """Found in review: only the shutdown op marked the server stopping, so one draining after
    SIGTERM or stdin's end (python -m bridge calls drain() itself) answered ready: true while
    it refused every other new request shutting_down."""
    srv = inproc()
    conn, other = RecordingConnection(), RecordingConnection()
    assert srv.call(conn, "health")["ready"] is True  # its probe launch now stands for the device
    srv.hold(other)
    drainer = threading.Thread(target=srv.dispatcher.drain, args=(60,))
    drainer.start()
    try:
        wait_until(lambda: not srv.dispatcher.accepting, "the drain never began")
        health = srv.call(conn, "health")
        assert health["live"] is True and health["ready"] is False
        assert health["checks"]["kernel"]["ok"] is True and health["checks"]["accepting"] is False
    finally:
        srv.go()
        drainer.join(60)


def scan_inputs() -> dict:
    return make_scan_inputs(ScanCase(2, 8, 4, 2))


def test_a_busy_server_whose_work_completed_answers_at_once(inproc):
    """Found in review: health was queued behind the server's work, so a healthy server busy
    with long requests answered its health check late (the Elixir client then restarted it),
    or past its --max-pending cap not at all. Its recent launches now stand for the device."""
    srv = inproc(max_delay_us=0, max_pending=3)
    conn, other = RecordingConnection(), RecordingConnection()
    assert srv.call(conn, "scan", **scan_inputs())  # a launch completed: the device answered
    srv.hold(other)
    queued = [srv.submit(conn, "scan", **scan_inputs()) for _ in range(2)]  # the cap reached
    health = conn.reply(srv.submit(conn, "health"), timeout=5)  # before the worker goes on
    assert health.ok, health.error
    health = result_from_wire(health.result)
    assert health["ready"] is True
    kernel = health["checks"]["kernel"]
    assert kernel["ok"] is True and kernel["source"] == "work" and "latency_us" not in kernel
    assert 0 <= kernel["age_ms"] <= bridge.health.PROBE_MAX_AGE_S * 1e3
    srv.go()
    assert all(conn.reply(i).ok for i in queued)


def test_a_busy_server_with_no_recent_launch_queues_the_probe(inproc):
    """The probe launch is not run beside the server's kernels: it waits its turn."""
    srv = inproc()
    conn, other = RecordingConnection(), RecordingConnection()
    srv.hold(other)
    queued = srv.submit(conn, "health")
    with pytest.raises(TimeoutError):
        conn.reply(queued, timeout=0.2)
    srv.go()
    kernel = result_from_wire(conn.reply(queued).result)["checks"]["kernel"]
    assert kernel["ok"] is True and kernel["source"] == "probe" and kernel["latency_us"] > 0



@pytest.mark.parametrize("cap", ["max_pending", "max_pending_bytes"])
def test_a_server_at_its_pending_cap_with_no_recent_launch_queues_the_probe_not_refuses_it(inproc, cap):
    """Past --max-pending (or its bytes) with no launch in the last 5 s, health was refused
    `overloaded`, and the Elixir client killed the healthy server for it (found in review). It
    waits its turn, as SPEC §6 says, and answers once the work before it is done."""
    srv = inproc(**({"max_pending": 2} if cap == "max_pending" else {"max_pending_bytes": 1}))
    conn, other = RecordingConnection(), RecordingConnection()
    srv.hold(other)  # in flight: a request past a byte cap is refused unless alone
    queued = [srv.submit(conn, "scan", **scan_inputs())] if cap == "max_pending" else []  # the cap reached
    health = srv.submit(conn, "health")
    with pytest.raises(TimeoutError):
        conn.reply(health, timeout=0.2)
    srv.go()
    assert all(conn.reply(i).ok for i in queued)
    reply = conn.reply(health)
    assert reply.ok, reply.error
    assert result_from_wire(reply.result)["ready"] is True


def test_an_idle_server_launches_the_probe(inproc, launches):
    srv = inproc()
    conn = RecordingConnection()
    kernel = srv.call(conn, "health")["checks"]["kernel"]
    assert kernel["ok"] is True and kernel["source"] == "probe" and launches == [1]


def test_work_stands_for_the_device_until_it_is_old(monkeypatch, launches):
    clock = [100.0]
    monkeypatch.setattr(bridge.health.time, "monotonic", lambda: clock[0])
    probe = DeviceProbe(torch.device("cpu"), None)
    assert not probe.fresh()
    probe.note_launch()
    clock[0] += 1.0
    assert probe.fresh() and probe.check() == {"ok": True, "source": "work", "age_ms": 1000.0}
    assert not launches
    clock[0] += bridge.health.PROBE_MAX_AGE_S
    assert not probe.fresh()
    assert probe.check()["source"] == "probe" and launches == [1]


def test_a_failing_probe_after_old_work_is_not_ready(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(bridge.health.time, "monotonic", lambda: clock[0])
    probe = DeviceProbe(torch.device("cpu"), None)
    probe.note_launch()
    clock[0] += bridge.health.PROBE_MAX_AGE_S + 1
    monkeypatch.setattr(scan_kernels, "selective_scan", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("device lost")))
    check = probe.check()
    assert check["ok"] is False and check["source"] == "probe" and "device lost" in check["error"]
    assert probe.check(launch=False)["ok"] is False  # the newest answer stands while recent


@pytest.mark.parametrize("op, make_inputs", [
    pytest.param("scan_backward", lambda: make_scan_inputs(ScanCase(2, 8, 4, 2)), id="scan_backward"),
    pytest.param("ssd_scan_backward", lambda: make_ssd_inputs(SsdCase(1, 8, 2, 2, 4)), id="ssd_scan_backward"),
])
def test_a_server_busy_with_work_that_is_not_batched_answers_at_once(inproc, op, make_inputs):
    """Found in review: only batched launches and native steps stood for the device, so a server
    busy with gradients (or model_forward) still queued its health check behind them."""
    srv = inproc(max_delay_us=0)
    conn, other = RecordingConnection(), RecordingConnection()
    inputs = backward_inputs(make_inputs())
    assert srv.call(conn, op, dy=torch.randn(inputs["x"].shape), **inputs)
    srv.hold(other)
    health = conn.reply(srv.submit(conn, "health"), timeout=5)
    srv.go()
    assert health.ok, health.error
    kernel = result_from_wire(health.result)["checks"]["kernel"]
    assert kernel["ok"] is True and kernel["source"] == "work"


def test_kernel_work_that_raised_does_not_stand_for_the_device(inproc):
    srv = inproc()
    with pytest.raises(RuntimeError), srv.server.kernel_timer():
        raise RuntimeError("device lost")
    assert not srv.server.probe.fresh()
    with srv.server.kernel_timer():
        pass
    assert srv.server.probe.check(launch=False)["source"] == "work"


def _model_load_args() -> dict:
    # Enough to reach the weights' load (patched below): nothing is built.
    return {"config": {"model_type": "mamba"}, "weights": {"w": torch.zeros(1)}}


@pytest.mark.parametrize("op, patched, make_args", [
    pytest.param("scan_backward", (scan_kernels, "selective_scan_backward"),
                 lambda: backward_inputs(make_scan_inputs(ScanCase(2, 8, 4, 2))), id="scan_backward"),
    pytest.param("ssd_scan_backward", (scan_kernels, "ssd_scan_backward"),
                 lambda: backward_inputs(make_ssd_inputs(SsdCase(1, 8, 2, 2, 4))), id="ssd_scan_backward"),
    pytest.param("model_load", (bridge.models, "load_weights"), _model_load_args, id="model_load"),
])
def test_a_call_that_may_run_for_seconds_leaves_its_lane_read(inproc, monkeypatch, op, patched, make_args):
    """Found in review: on a lane one thread reads (stdio; unix), an idle server served a training
    call or a model's load on that thread, which read nothing else until it ended: health waited
    behind it (the Elixir client's health check could stop a healthy server) and a cancel could
    not reach the requests sent after it. Such ops go to the worker."""
    srv = inproc()
    conn = RecordingConnection()
    assert srv.call(conn, "scan", **scan_inputs())  # a recent launch: health is answered at once
    session = srv.call(conn, "session_open", batch=1, dim=4, state=2)["session"]
    reader, ran_on, release = threading.current_thread(), [], threading.Event()

    def held(*args, **kwargs):
        ran_on.append(threading.current_thread())
        if ran_on[0] is not reader:
            release.wait(60)
        raise RuntimeError("held, then failed")

    monkeypatch.setattr(*patched, held)
    args = make_args()
    if op != "model_load":
        args["dy"] = torch.randn(args["x"].shape)
    long = srv.submit(conn, op, more_input=False, **args)  # as a stdio or a lone unix reader would
    try:
        wait_until(lambda: ran_on, f"{op} never ran")
        assert ran_on[0] is not reader, f"{op} was served on the thread that read it"
        assert srv.call(conn, "health")["ready"] is True
        step = make_update_inputs(UpdateCase(1, 4, 2))
        queued = srv.submit(conn, "step", session=session, **{k: v for k, v in step.items() if k != "state"})
        assert srv.call(conn, "cancel", id=queued) == {"cancelled": True}
    finally:
        release.set()
    assert conn.reply(queued).error["code"] == "cancelled"
    assert not conn.reply(long).ok
