"""The `health` op: live when it answers, ready when the device answered a tiny kernel launch lately
(bridge.health) and the server is not stopping."""

from __future__ import annotations

import pytest
import torch

import bridge.health
import kernels
from bridge.client import PortClient, result_from_wire
from bridge.health import DeviceProbe
from bridge_fakes import RecordingConnection


def test_a_serving_server_is_live_and_ready_over_the_port():
    with PortClient(["--device", "cpu"]) as client:
        health = client.health()
        assert "health" in client.info()["protocol"]["ops"]
    assert health["live"] is True and health["ready"] is True
    assert health["device"] == "cpu"
    kernel = health["checks"]["kernel"]
    assert kernel["ok"] is True and kernel["latency_us"] > 0 and kernel["age_ms"] >= 0
    assert "error" not in kernel and health["checks"]["accepting"] is True


def test_a_recent_launch_stands_for_the_device_and_an_old_one_is_redone(monkeypatch):
    launches = []
    scan = kernels.selective_scan
    monkeypatch.setattr(kernels, "selective_scan", lambda *a, **k: launches.append(1) or scan(*a, **k))
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

    monkeypatch.setattr(kernels, "selective_scan", broken)
    check = DeviceProbe(torch.device("cpu"), None).check()
    assert check["ok"] is False and message in check["error"]


def test_a_stopping_server_is_live_but_not_ready(inproc):
    """A health request taken before the stop and run after it says so; one sent after the
    stop is not taken (shutting_down), as no new request is."""
    srv = inproc()
    conn, other = RecordingConnection(), RecordingConnection()
    assert srv.call(conn, "health")["ready"] is True
    srv.hold(other)
    queued = srv.submit(conn, "health")
    srv.server.stop_requested.set()
    srv.go()
    reply = conn.reply(queued)
    health = result_from_wire(reply.result)
    assert health["live"] is True and health["ready"] is False
    assert health["checks"] == {"kernel": health["checks"]["kernel"], "accepting": False}
    assert health["checks"]["kernel"]["ok"] is True
    refused = srv.request(conn, "health")
    assert not refused.ok and refused.error["code"] == "shutting_down"
