"""tests/process_runs.py, the runner of commands whose children may outlive them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid

from process_runs import RUN_MARKER, processes_with_marker, reap_marked, run_marked

# Starts a child that inherits stdout and stderr, freezes it and exits: stopped, the child would
# hold a capture_output pipe open until someone killed it.
LEAVES_A_FROZEN_CHILD = """
import os, signal, subprocess
child = subprocess.Popen(["sleep", "60"])
os.kill(child.pid, signal.SIGSTOP)
os.waitpid(child.pid, os.WUNTRACED)
print("started", child.pid, flush=True)
"""


def test_a_frozen_leftover_is_named_and_killed():
    marker = uuid.uuid4().hex
    frozen = subprocess.Popen(["sleep", "60"], env=dict(os.environ, **{RUN_MARKER: marker}),
                              start_new_session=True)
    try:
        os.kill(frozen.pid, signal.SIGSTOP)
        # Popen returns once exec has closed the child's descriptors, before the kernel has set
        # the new environment's bounds: /proc/PID/environ reads empty until then (CI, stop 28).
        # A stop is taken only on the way back to user space, after exec has finished.
        os.waitpid(frozen.pid, os.WUNTRACED)
        # the marker matches whole: neither a prefix of it nor a longer value does
        assert processes_with_marker(marker[:-1]) == [] and processes_with_marker(marker + "0") == []
        assert processes_with_marker(marker) == [frozen.pid]
        leftovers = reap_marked(marker, grace_s=0.5)
        assert len(leftovers) == 1 and leftovers[0].startswith(f"{frozen.pid} state T: sleep 60"), leftovers
        assert frozen.wait(timeout=5) == -signal.SIGKILL
    finally:
        frozen.kill()
        frozen.wait()


def test_a_run_ends_with_its_command_and_fails_on_what_it_left():
    started = time.monotonic()
    run = run_marked([sys.executable, "-c", LEAVES_A_FROZEN_CHILD], timeout_s=30, leftover_grace_s=0.5)
    assert time.monotonic() - started < 20  # not the child's 60 s
    assert run.returncode == 0
    (child_pid,) = [int(word) for word in run.stdout.split()[1:2]]
    assert len(run.leftovers) == 1 and run.leftovers[0].startswith(f"{child_pid} state T: sleep 60")
    failure = run.failure("the command")
    assert "1 process(es) it started outlived it by more than 0.5 s" in failure and "started" in failure


def test_a_clean_run_passes_and_a_hung_one_is_killed_at_its_timeout():
    clean = run_marked([sys.executable, "-c", "print('ok')"], timeout_s=30, leftover_grace_s=0.5)
    assert clean.failure() is None and clean.stdout == "ok\n"
    # Not synchronisation: a command that hangs, for the timeout under test.
    hung = run_marked([sys.executable, "-c", "import time; time.sleep(60)"], timeout_s=1, leftover_grace_s=0.5)
    assert hung.returncode is None and "was still running after 1 s and was killed" in hung.failure()
