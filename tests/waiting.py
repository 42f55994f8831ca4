"""Waiting for a condition in tests: polling under a deadline, in one place, instead of sleeping
for a time that is long enough on a quiet machine and too short on a loaded one."""

from __future__ import annotations

import time

# Long enough that only a real hang reaches it on a loaded 2-core runner.
DEFAULT_TIMEOUT_S = 60.0


def poll_until(condition, timeout: float = DEFAULT_TIMEOUT_S, interval: float = 0.001) -> bool:
    """Whether `condition()` became true within `timeout` seconds (checked every `interval`),
    for a caller to whom the timeout is an outcome, not a failure."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)
    return True


def wait_until(condition, what: str, timeout: float = DEFAULT_TIMEOUT_S, interval: float = 0.001) -> None:
    """Return once `condition()` is true, or raise TimeoutError with `what` (what did not
    happen: "the reply never came") after `timeout` seconds. `condition` may itself fail
    (pytest.fail, an assert) to say why it never can be true."""
    if not poll_until(condition, timeout, interval):
        raise TimeoutError(f"{what} (waited {timeout:g} s)")
