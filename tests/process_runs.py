"""Running a command whose children may outlive it: `mix test`, the benches.

Their servers inherit the command's stderr. With `capture_output` a server that outlived the
command would hold that pipe open, and the reader would wait for its EOF until the timeout,
losing the output (CI's `mix test` run of stop 14: exited 2, then 600 s of waiting). Here the
output goes to files, so the run ends when the command does, and the command's environment
carries a marker that every process it spawns inherits, so that one still running after the
command has exited is found in /proc, named in the failure and killed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import threading
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from waiting import poll_until

RUN_MARKER = "SCAN_BRIDGE_TEST_RUN"
# A server whose client went away exits on stdin EOF within a second, one still starting up
# once it is ready; one still there after this long was left behind.
LEFTOVER_GRACE_S = 10.0


@dataclass
class ProcessRun:
    command: list[str]
    timeout_s: float
    leftover_grace_s: float
    returncode: int | None  # None: still running at the timeout, and killed
    stdout: str
    stderr: str
    leftovers: list[str]  # "pid state T: command line" of processes that outlived the command

    @property
    def output(self) -> str:
        return self.stdout + self.stderr

    def failure(self, what: str | None = None, excerpts: Sequence[str] = ()) -> str | None:
        """Why the run failed, with `excerpts` of its output (what the caller knows to look for)
        and the output's end; None when it exited 0 alone."""
        what = what or " ".join(self.command)
        problems = []
        if self.returncode is None:
            problems.append(f"{what} was still running after {self.timeout_s} s and was killed")
        elif self.returncode != 0:
            problems.append(f"{what} exited {self.returncode}")
        if self.leftovers:
            problems.append(f"{len(self.leftovers)} process(es) it started outlived it by more than "
                            f"{self.leftover_grace_s} s (killed now): " + "; ".join(self.leftovers))
        return "\n".join(problems + list(excerpts) + [self.output[-8000:]]) if problems else None


def run_marked(command: list[str], *, timeout_s: float, cwd=None, env: dict | None = None,
               leftover_grace_s: float = LEFTOVER_GRACE_S) -> ProcessRun:
    """Run `command` to its end (killed, with its process group, at `timeout_s`), then reap
    whatever it started that is still running after `leftover_grace_s`."""
    marker = uuid.uuid4().hex
    env = dict(os.environ if env is None else env, **{RUN_MARKER: marker})
    with tempfile.TemporaryFile(mode="w+") as out, tempfile.TemporaryFile(mode="w+") as err:
        proc = subprocess.Popen(command, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                stderr=err, start_new_session=True)
        try:
            returncode = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            returncode = None
        leftovers = reap_marked(marker, leftover_grace_s)
        out.seek(0)
        err.seek(0)
        return ProcessRun(list(command), timeout_s, leftover_grace_s, returncode, out.read(), err.read(), leftovers)


def reap_marked(marker: str, grace_s: float = LEFTOVER_GRACE_S) -> list[str]:
    """Waits up to `grace_s` for the processes carrying `marker` in their environment to exit,
    then kills and describes those still there."""
    left: list[int] = []

    def all_gone() -> bool:
        left[:] = processes_with_marker(marker)
        return not left

    poll_until(all_gone, grace_s, interval=0.1)
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


def children_of(pid: int) -> list[int]:
    """The processes whose parent is `pid`, from /proc."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    fields = stat.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry))
    return found


def gone_or_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def describe_process(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            state = stat.read().rsplit(") ", 1)[1].split()[0]  # T: stopped, as by SIGSTOP
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            command = cmdline.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return f"{pid} (exited while being described)"
    return f"{pid} state {state}: {command}"


class BackgroundRun:
    """A `run_marked` started ahead of the test that judges it, on a thread of its own, so that
    a long child suite (the sanitizer pass) runs beside the rest of the session instead of
    after it. `start()` is idempotent; `result()` starts it if nothing has, then waits."""

    def __init__(self, make_command):
        # make_command() -> (command, run_marked's keyword arguments); called once, at start.
        self._make_command = make_command
        self._thread: threading.Thread | None = None
        self._run: ProcessRun | None = None
        self._error: BaseException | None = None

    def start(self) -> None:
        if self._thread is not None:
            return
        command, options = self._make_command()

        def run():
            try:
                self._run = run_marked(command, **options)
            except BaseException as exc:  # handed to the test that waits for it
                self._error = exc

        self._thread = threading.Thread(target=run, name="background-run", daemon=True)
        self._thread.start()

    @property
    def started(self) -> bool:
        return self._thread is not None

    def result(self) -> ProcessRun:
        self.start()
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._run
