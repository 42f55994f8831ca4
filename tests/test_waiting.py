"""tests/waiting.py, the deadline poll the tests wait with instead of sleeping: a wait that
returned without its condition, or never gave up, would let other tests pass or hang."""

from __future__ import annotations

import pytest

from waiting import poll_until, wait_until


def test_wait_until_returns_as_soon_as_the_condition_holds():
    calls = []

    def third_time() -> bool:
        calls.append(1)
        return len(calls) == 3

    wait_until(third_time, "the condition never held", timeout=30)
    assert len(calls) == 3


def test_wait_until_gives_up_at_its_deadline_naming_what_never_happened():
    with pytest.raises(TimeoutError, match=r"the reply never came \(waited 0.05 s\)"):
        wait_until(lambda: False, "the reply never came", timeout=0.05)


def test_poll_until_tells_whether_the_condition_held_in_time():
    assert poll_until(lambda: True, timeout=0) is True
    assert poll_until(lambda: False, timeout=0.01) is False
