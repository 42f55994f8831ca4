"""bridge.exit_guard: the process that shares a server's memory so that a killed server's pipes
close before that memory is freed. What it is (one child of the server, on the server's memory,
holding one pipe, blocking signals), that it ends with the server however the server ends, and
that --no-exit-guard runs none. How much sooner a kill is noticed is
bench.exit_guard's to measure (docs/performance.md, "exit guard")."""

from __future__ import annotations

import os
import platform
import signal
import subprocess
import sys
import time

import pytest

from bridge import exit_guard
from bridge.client import PortClient, ServerExited
from process_runs import children_of, gone_or_zombie

pytestmark = pytest.mark.skipif(sys.platform != "linux" or platform.machine() not in exit_guard.MACHINES,
                                reason=f"the exit guard runs on Linux on {' and '.join(exit_guard.MACHINES)} only")


def _status(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/status") as status:
        return dict(line.rstrip("\n").split(":\t", 1) for line in status if ":\t" in line)


def _wait_until_stopped(pid: int, timeout: float = 30.0) -> None:
    """Until every thread of `pid` is stopped: a signal lands a little after kill() returns."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        states = []
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/stat") as stat:
                    states.append(stat.read().rsplit(")", 1)[1].split()[0])
            except OSError:
                continue
        if states and all(state in "tT" for state in states):
            return
        time.sleep(0.001)
    raise AssertionError(f"process {pid} not stopped after {timeout} s")


def _ready_server(*extra) -> PortClient:
    client = PortClient(["--device", "cpu", *extra], stderr=subprocess.DEVNULL)
    assert client.request("ping", timeout=120).unwrap() == {"pong": True}
    return client


def _the_guard(server_pid: int) -> int:
    (guard,) = children_of(server_pid)
    return guard


def _maps(pid: int) -> str:
    with open(f"/proc/{pid}/maps") as maps:
        return maps.read()


def _same_maps_once_still(server: int, guard: int, tries: int = 200) -> bool:
    """Whether the guard's maps equal the server's in some read while the server's hold still:
    the server's threads may map memory between two reads. The guard starts before torch is
    imported, so a child that did not share the memory would never match."""
    for _ in range(tries):
        before, theirs, after = _maps(server), _maps(guard), _maps(server)
        if before == theirs == after:
            return True
        time.sleep(0.01)
    return False


def test_a_server_runs_one_guard_on_its_memory_holding_one_pipe():
    client = _ready_server()
    try:
        server = client.proc.pid
        guard = _the_guard(server)
        assert _same_maps_once_still(server, guard), "the guard does not share the server's memory"
        (fd,) = os.listdir(f"/proc/{guard}/fd")
        assert os.readlink(f"/proc/{guard}/fd/{fd}").startswith("pipe:"), "the guard holds more than its pipe"
        blocked = int(_status(guard)["SigBlk"], 16)
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD):
            assert blocked >> (sig - 1) & 1, f"the guard does not block {sig.name}"
        assert client.request("ping", timeout=30).unwrap() == {"pong": True}
    finally:
        client.close()


def test_a_killed_server_closes_its_pipe_and_its_guard_ends():
    client = _ready_server()
    guard = _the_guard(client.proc.pid)
    os.kill(client.proc.pid, signal.SIGSTOP)  # the ping below stays unanswered until the kill
    _wait_until_stopped(client.proc.pid)
    pending = client.submit("ping")
    os.kill(client.proc.pid, signal.SIGKILL)
    with pytest.raises(ServerExited):
        pending.result(30)  # the pipe's end of file fails what was in flight
    client.proc.wait(30)
    deadline = time.monotonic() + 30
    while not gone_or_zombie(guard) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert gone_or_zombie(guard), "the guard outlived its killed server"


def test_a_server_that_exits_reaps_its_guard():
    client = _ready_server()
    guard = _the_guard(client.proc.pid)
    assert client.close() == 0
    assert not os.path.exists(f"/proc/{guard}"), "the guard was left behind (running or unreaped)"


def test_no_exit_guard_runs_none():
    client = _ready_server("--no-exit-guard")
    try:
        assert children_of(client.proc.pid) == []
    finally:
        client.close()


@pytest.mark.parametrize("compiler, call", [pytest.param("cc", None, id="this-machine"),
                                            pytest.param("aarch64-linux-gnu-gcc", "svc", id="aarch64")])
def test_the_guard_compiles_without_warnings(tmp_path, compiler, call):
    """guard.c for this machine and cross-compiled for aarch64 (its system calls by `svc`), with
    every warning an error."""
    import shutil

    if shutil.which(compiler) is None:
        pytest.skip(f"no {compiler} (the aarch64 one: Debian package gcc-aarch64-linux-gnu)")
    library = tmp_path / "guard.so"
    proc = subprocess.run([compiler, "-O2", "-Wall", "-Wextra", "-Werror", "-shared", "-fPIC", "-o", str(library),
                           str(exit_guard.SOURCE)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    if call is not None:
        objdump = shutil.which(compiler.replace("gcc", "objdump"))
        if objdump is None:
            pytest.skip(f"no objdump beside {compiler}")
        disassembly = subprocess.run([objdump, "-d", str(library)], capture_output=True, text=True, timeout=60).stdout
        assert f"\t{call}\t" in disassembly, f"no {call} in the guard's aarch64 code"


def test_a_signal_sent_to_a_guard_just_started_runs_no_handler_of_the_servers():
    """A guard that has not run yet still has the server's handlers: a signal meant for it (one
    sent to the process group as it starts) would run one on the server's memory, and the server
    would act on a signal it never got. It starts with every signal blocked."""
    import ctypes

    from bridge.c_build import compile_c

    path = exit_guard.library_path()
    if not path.is_file():
        compile_c(path, exit_guard.SOURCE, flags=("-shared", "-fPIC"))
    library = ctypes.CDLL(str(path))
    handled = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: handled.append(signum))
    try:
        for _ in range(20):
            read_end, write_end = os.pipe()
            guard = library.exit_guard_start(read_end)
            os.close(read_end)
            assert guard > 0
            os.kill(guard, signal.SIGUSR1)  # before the guard is likely to have run at all
            os.close(write_end)
            os.waitpid(guard, 0)
        time.sleep(0.01)  # not synchronisation: a handler tripped last gets its bytecode boundary
        assert handled == [], f"{len(handled)} of 20 signals sent to a guard ran the server's handler"
    finally:
        signal.signal(signal.SIGUSR1, previous)
