"""The Elixir client's ExUnit suite (elixir_client/), run against this checkout's server.

`mix test` needs Elixir (Debian's `elixir` package, installed by `make system-deps`). Where mix
is missing the suite is skipped with the reason — except in CI (CI=true), where that fails.
A server process that outlives `mix` (a test left it frozen, say) fails the run by name.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass

import pytest

from bridge.client import server_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROJECT = os.path.join(ROOT, "elixir_client")
# Generous: the suite itself takes well under 2 minutes, plus compiling on a cold _build.
TIMEOUT_S = 600
# A server whose client went away exits on stdin EOF within a second; one still there after
# this long was left behind.
ORPHAN_GRACE_S = 10.0
# Set in mix's environment, inherited by every server the suite spawns: how a leftover is found.
RUN_MARKER = "SCAN_BRIDGE_TEST_RUN"


def mix_env() -> dict:
    # server_env: this checkout first on PYTHONPATH, for the server the suite spawns.
    env = server_env()
    build = os.path.join(PROJECT, "_build")
    env.update({
        "MIX_ENV": "test",
        # Mix's home must be writable, and hex.pm is unreachable: the project has no deps.
        "MIX_HOME": os.path.join(build, "mix_home"),
        "HEX_HOME": os.path.join(build, "hex_home"),
        "HEX_OFFLINE": "1",
        # The interpreter running this suite has the server's dependencies.
        "PYTHON": sys.executable,
    })
    env.setdefault("LANG", "C.UTF-8")  # the BEAM warns and mangles output under a latin1 locale
    return env


def find_mix() -> str:
    """mix's path; skips with the reason where Elixir is missing, except in CI (CI=true)."""
    mix = shutil.which("mix")
    if mix is None:
        reason = ("mix (Elixir) is not installed: run `make system-deps` (Debian package elixir) "
                  "to run the Elixir client's suite")
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI: {reason}")
        print(reason, file=sys.stderr)
        pytest.skip(reason)
    return mix


@dataclass
class MixRun:
    returncode: int | None  # None: killed at the timeout
    output: str
    orphans: list[str]  # "pid state cmdline" of servers still running after mix exited

    def failure(self, what: str) -> str | None:
        """Why the run failed, with the end of its output; None when it passed."""
        problems = []
        if self.returncode is None:
            problems.append(f"{what} was still running after {TIMEOUT_S} s and was killed")
        elif self.returncode != 0:
            problems.append(f"{what} exited {self.returncode}")
        if self.orphans:
            problems.append(f"{len(self.orphans)} server process(es) outlived it by more than "
                            f"{ORPHAN_GRACE_S} s (killed now): " + "; ".join(self.orphans))
        return "\n".join(problems + [self.output[-8000:]]) if problems else None


def run_mix(args: list[str]) -> MixRun:
    """`mix ARGS` in elixir_client/, its output in a file rather than a pipe: a server that
    outlived mix would hold a pipe open and hang the reader, where here it is named and killed."""
    marker = uuid.uuid4().hex
    env = mix_env()
    env[RUN_MARKER] = marker
    with tempfile.TemporaryFile(mode="w+") as log:
        mix = subprocess.Popen([find_mix(), *args], cwd=PROJECT, env=env, stdin=subprocess.DEVNULL,
                               stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            returncode = mix.wait(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(mix.pid, signal.SIGKILL)
            mix.wait()
            returncode = None
        orphans = reap_servers_of_run(marker)
        log.seek(0)
        return MixRun(returncode, log.read(), orphans)


def reap_servers_of_run(marker: str, grace_s: float = ORPHAN_GRACE_S) -> list[str]:
    """Waits up to `grace_s` for the processes carrying `marker` in their environment to exit,
    then kills and describes those still there."""
    deadline = time.monotonic() + grace_s
    while (left := processes_with_marker(marker)) and time.monotonic() < deadline:
        time.sleep(0.1)
    described = []
    for pid in left:
        described.append(describe_process(pid))
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return described


def processes_with_marker(marker: str) -> list[int]:
    needle = f"{RUN_MARKER}={marker}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as environ:
                if needle in environ.read().split(b"\0"):
                    found.append(int(entry))
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return found


def describe_process(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            state = stat.read().rsplit(") ", 1)[1].split()[0]  # T: stopped, as by SIGSTOP
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            command = cmdline.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return f"{pid} (exited while being described)"
    return f"{pid} state {state}: {command}"


def test_leftover_processes_of_a_run_are_named_and_killed():
    marker = uuid.uuid4().hex
    env = dict(os.environ, **{RUN_MARKER: marker})
    frozen = subprocess.Popen(["sleep", "60"], env=env, start_new_session=True)
    try:
        os.kill(frozen.pid, signal.SIGSTOP)
        assert processes_with_marker(uuid.uuid4().hex) == []
        orphans = reap_servers_of_run(marker, grace_s=0.5)
        assert len(orphans) == 1 and orphans[0].startswith(f"{frozen.pid} state T: sleep 60"), orphans
        assert frozen.wait(timeout=5) == -signal.SIGKILL
    finally:
        frozen.kill()
        frozen.wait()


def test_exunit_suite_passes():
    run = run_mix(["test"])
    print(run.output)
    if failure := run.failure("`mix test` in elixir_client/"):
        pytest.fail(failure)


def test_roundtrip_benchmark_runs(tmp_path):
    """`mix run bench/roundtrip.exs` end to end with a few iterations (its numbers are not
    judged here): it must keep working as the server and the echo floors change."""
    out = tmp_path / "elixir-roundtrip.json"
    run = run_mix(["run", "bench/roundtrip.exs", "--iterations", "2", "--step-iterations", "3",
                   "--out", str(out)])
    if failure := run.failure("the Elixir round-trip benchmark"):
        pytest.fail(failure)
    results = json.loads(out.read_text())["results"]
    lanes = {(r["case"].split()[0], r["lane"]) for r in results}
    assert {("exphil", "port"), ("step", "port")} <= lanes, lanes
    for r in results:
        assert r["round_trip"]["p50_us"] > 0 and r["echo_floor"]["p50_us"] > 0, r["case"]
