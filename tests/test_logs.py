"""bridge.logs: a warning a peer can cause at will, logged at once, then at most once an
interval with the count of those left out."""

from __future__ import annotations

import logging

from bridge import logs


def test_a_warning_is_logged_at_once_then_once_an_interval_saying_what_it_left_out(monkeypatch, caplog):
    now = [100.0]
    monkeypatch.setattr(logs.time, "monotonic", lambda: now[0])
    warning = logs.ThrottledWarning(logging.getLogger("bridge.test"), interval_s=60.0)
    with caplog.at_level(logging.WARNING, logger="bridge.test"):
        for peer in "abcde":
            warning.warn("peer %s went", peer)
        now[0] += 59.9
        warning.warn("peer %s went", "f")
        now[0] += 0.1
        warning.warn("peer %s went", "g")
        now[0] += 60.0
        warning.warn("peer %s went", "h")
    assert [r.getMessage() for r in caplog.records] == [
        "peer a went", "peer g went (5 more like it since the last one logged)", "peer h went"]
