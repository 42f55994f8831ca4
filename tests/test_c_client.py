"""The C client (examples/c_client) built with `make` and run against a live server over zmq
ipc and tcp: it decodes every golden vector, pings, and checks an inline and a multipart scan
against its own C reference. Without libzmq / msgpack-c headers the tests skip and say why,
except in CI (CI=true), where that is a failure: the CI machine installs them
(.ci/system-deps.sh)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLIENT_DIR = os.path.join(ROOT, "examples", "c_client")
VECTORS = os.path.join(ROOT, "protocol", "vectors")
START_TIMEOUT_S = 180.0


def unavailable() -> str | None:
    """Why the C client cannot be built here, or None."""
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if cc is None or shutil.which("make") is None:
        return "no C compiler or make on PATH"
    probe = subprocess.run([cc, "-E", "-x", "c", "-"], input="#include <zmq.h>\n#include <msgpack.h>\n",
                           capture_output=True, text=True)
    if probe.returncode != 0:
        error = next((line for line in probe.stderr.splitlines() if "error" in line),
                     probe.stderr.strip() or f"{cc} could not preprocess them")
        return f"libzmq / msgpack-c headers missing ({error}); install libzmq3-dev and libmsgpack-dev"
    return None


def require_toolchain() -> None:
    reason = unavailable()
    if reason is None:
        return
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI must build the C client: {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def scan_client() -> str:
    require_toolchain()
    build = subprocess.run(["make", "-C", CLIENT_DIR], capture_output=True, text=True)
    assert build.returncode == 0, f"make -C examples/c_client failed:\n{build.stdout}\n{build.stderr}"
    return os.path.join(CLIENT_DIR, "scan_client")


@pytest.fixture(scope="module")
def endpoints(scan_client, tmp_path_factory):
    """A live server on zmq ipc and tcp; its tcp port is read from `info` over the unix lane."""
    from bridge.client import UnixClient, server_env

    directory = tmp_path_factory.mktemp("c-client")
    unix_path = str(directory / "bridge.sock")
    env = server_env()
    log = open(directory / "server.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "bridge", "--device", "cpu", "--unix", unix_path,
                             "--zmq", f"ipc://{directory}/bridge.ipc", "--zmq", "tcp://:*"],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log, env=env)
    deadline = time.monotonic() + START_TIMEOUT_S
    while not os.path.exists(unix_path):
        assert proc.poll() is None and time.monotonic() < deadline, (directory / "server.log").read_text()
        time.sleep(0.05)
    with UnixClient(unix_path) as client:
        zmq = [entry.split(" ", 1)[1] for entry in client.info()["transports"] if entry.startswith("zmq ")]
    yield {"ipc": next(e for e in zmq if e.startswith("ipc://")), "tcp": next(e for e in zmq if e.startswith("tcp://"))}
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(10) == 0
    log.close()


def count_vectors() -> int:
    return sum(name.endswith(".frame") for d in (VECTORS, os.path.join(VECTORS, "multipart"))
               for name in os.listdir(d))


@pytest.mark.parametrize("lane", [pytest.param("ipc", id="zmq-ipc"), pytest.param("tcp", id="zmq-tcp")])
def test_the_c_client_checks_vectors_ping_and_scans(scan_client, endpoints, lane):
    run = subprocess.run([scan_client, endpoints[lane], VECTORS], capture_output=True, text=True, timeout=300)
    print(run.stdout)
    assert run.returncode == 0, run.stderr
    assert f"golden vectors: {count_vectors()} checked" in run.stdout
    for line in ("ping ", "scan inline ", "scan multipart ", "all checks passed"):
        assert line in run.stdout
    assert "kernel_us=" in run.stdout and "ipc " in run.stdout


def test_the_c_client_exits_non_zero_on_a_bad_vector(scan_client, endpoints, tmp_path):
    vectors = tmp_path / "vectors"
    shutil.copytree(VECTORS, vectors)
    frame = vectors / "reply_scan.frame"
    frame.write_bytes(frame.read_bytes()[:-3])  # a valid reply, truncated
    run = subprocess.run([scan_client, endpoints["ipc"], str(vectors)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 1
    assert "vector reply_scan" in run.stderr and "1 failure(s)" in run.stderr
