"""The server's command line for its lanes: options that cannot work are refused, a socket-only
server ignores stdin and stops on SIGTERM or a shutdown request (writing a slow reader's
replies first), a stop signal during start-up (its imports too) ends it quietly, and CURVE
admits only the clients whose keys it was given."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from bridge.client import UnixClient, ZmqClient, server_env

from lane_helpers import REPLY_TIMEOUT_S, ServerProcess, zmq_endpoint, request_frame, read_reply, raw_unix
from waiting import wait_until


@pytest.mark.parametrize("argv, message", [
    pytest.param(["--zmq", "ipc:///tmp/x.ipc", "--curve-secret-key", "k"], "no --zmq tcp://", id="curve-without-tcp"),
    pytest.param(["--unix", "u.sock", "--curve-clients", "d"], "--curve-secret-key too", id="clients-without-key"),
    pytest.param(["--unix", "/nonexistent/u.sock", "--curve-secret-key", "k"], "no --zmq tcp://",
                 id="curve-without-zmq"),
])
def test_lane_options_that_cannot_work_are_refused(argv, message):
    from bridge.cli import build_parser, open_lanes

    with pytest.raises(ValueError, match=message):
        open_lanes(build_parser().parse_args(argv), dispatcher=None)


@pytest.mark.parametrize("endpoint", ["tcp://127.0.0.1:99999", "tcp://:65536", "tcp://:٣"])
def test_a_zmq_port_libzmq_would_take_modulo_is_refused(endpoint):
    from bridge.transports.zmq import resolve_endpoint

    with pytest.raises(ValueError, match="tcp://"):
        resolve_endpoint(endpoint)


@pytest.mark.parametrize("argv, env, message", [
    pytest.param(["--log-level", "bogus"], {}, "expected one of DEBUG, INFO", id="log-level-unknown"),
    pytest.param([], {"SCAN_BRIDGE_LOG": "verbose"}, "got 'verbose'", id="log-level-from-the-environment"),
    pytest.param(["--threads", "100000000000"], {}, "expected at most", id="threads-past-any-machine"),
    # info and stats report every limit: one past a msgpack uint made both internal_error for the
    # server's whole life (found in review)
    pytest.param(["--max-pool-bytes", str(2**64)], {}, "--max-pool-bytes: expected an int <= 2**64-1",
                 id="limit-past-msgpack"),
    pytest.param(["--max-frame-size", "1" + "0" * 30], {}, "--max-frame-size: expected an int <= 2**64-1",
                 id="frame-size-past-msgpack"),
    # a wait past threading's timeout raised in the gatherer and left its batch unanswered (found in review)
    pytest.param(["--max-delay-us", str(10**16)], {}, "--max-delay-us: expected at most", id="delay-past-a-minute"),
    # libzmq's int: past it the start failed saying only "value too large to convert to int" (found in review)
    pytest.param(["--zmq-hwm", str(2**31)], {}, "--zmq-hwm: expected at most 2147483647", id="hwm-past-libzmq"),
    # taken on the cpu backend, which compiles nothing, and refused only by Triton's (found in review)
    pytest.param(["--warmup", "0x60x512x16"], {}, "each a positive int, got '0x60x512x16'", id="warmup-of-no-rows"),
    pytest.param(["--warmup=-5x-1x3x4:groups=7"], {}, "each a positive int", id="warmup-negative"),
    # an unset variable in a unit file: served on an unnamed abstract socket (found in review)
    pytest.param(["--unix", ""], {}, "--unix: expected a socket path, got an empty one", id="unix-empty"),
    # a flag of at least 1 said ">= 0" for these, and the 0 it suggested was refused next (found in review)
    pytest.param(["--max-batch", "-1"], {}, "--max-batch: expected an int >= 1, got '-1'", id="count-negative"),
    pytest.param(["--threads", "two"], {}, "--threads: expected an int >= 1, got 'two'", id="threads-not-an-int"),
    pytest.param(["--zmq-hwm", "-1"], {}, "--zmq-hwm: expected an int >= 1, got '-1'", id="hwm-negative"),
    pytest.param(["--max-pool-bytes", "-1"], {}, "--max-pool-bytes: expected an int >= 0, got '-1'",
                 id="zero-allowed-negative"),
])
def test_a_bad_setting_is_refused_with_a_message_not_a_traceback(argv, env, message, capsys, monkeypatch):
    from bridge.cli import build_parser

    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(argv)
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


def test_a_bad_log_level_in_the_environment_is_refused_beside_the_flag():
    """operations.md: another name, from either, is refused at start; with --log-level given,
    $SCAN_BRIDGE_LOG was not looked at (found in review)."""
    run = subprocess.run([sys.executable, "-m", "bridge", "--log-level", "INFO"], capture_output=True, text=True,
                         env={**server_env(), "SCAN_BRIDGE_LOG": "verbose"}, timeout=120, stdin=subprocess.DEVNULL)
    assert run.returncode == 2, run.stderr
    assert "$SCAN_BRIDGE_LOG: expected one of DEBUG, INFO" in run.stderr and "got 'verbose'" in run.stderr


@pytest.mark.parametrize("simd, message", [("avx2x", "expected one of"), ("avx1024", "expected one of")],
                         ids=["misspelt", "no-such-build"])
def test_a_simd_build_the_cpu_backend_cannot_have_is_refused_at_start(simd, message):
    """A misspelt $SCAN_BRIDGE_SIMD left the C++ backend unavailable and the default backend
    served from torch, many times slower, said only at INFO (found in review)."""
    run = subprocess.run([sys.executable, "-m", "bridge"], capture_output=True, text=True, timeout=120,
                         env={**server_env(), "SCAN_BRIDGE_SIMD": simd}, stdin=subprocess.DEVNULL)
    assert run.returncode == 2, run.stderr
    assert f"$SCAN_BRIDGE_SIMD={simd}: " in run.stderr and message in run.stderr, run.stderr


@pytest.mark.parametrize("path", ["/nonexistent/dir/u.sock", "/tmp/" + "p" * 120 + ".sock"],
                         ids=["no-directory", "path-past-af-unix"])
def test_a_unix_path_that_cannot_be_bound_is_named_in_the_refusal(path):
    """The start stopped with exit 2 and only the OS's words, "AF_UNIX path too long" say, naming
    neither the flag nor the path (found in review)."""
    from bridge.cli import build_parser, open_lanes

    with pytest.raises(OSError, match=f"^--unix {path}: "):
        open_lanes(build_parser().parse_args(["--unix", path]), dispatcher=None)


def test_a_unix_path_a_live_server_holds_is_named_once_in_the_refusal(tmp_path):
    """The refusal read "--unix P: --unix P: another server is listening there" (found in review)."""
    import socket

    from bridge.cli import build_parser, open_lanes

    path = str(tmp_path / "live.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as live:
        live.bind(path)
        live.listen(1)
        with pytest.raises(OSError) as refused:
            open_lanes(build_parser().parse_args(["--unix", path]), dispatcher=None)
    assert str(refused.value) == f"--unix {path}: another server is listening there"


def test_a_frame_size_past_libzmqs_int64_is_served_on_zmq(tmp_path):
    """Any --max-frame-size up to 2^64 - 1 is taken (operations.md); libzmq's MAXMSGSIZE is an
    int64, and one past it stopped the start (found in review)."""
    endpoint = f"ipc://{tmp_path}/z.ipc"
    srv = ServerProcess(str(tmp_path), "--zmq", endpoint, "--max-frame-size", str(2**64 - 1))
    try:
        with ZmqClient(endpoint) as client:
            assert client.request("ping", timeout=REPLY_TIMEOUT_S).unwrap() == {"pong": True}
    finally:
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.stop() == 0, srv.log()


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "soon"])
def test_an_idle_timeout_must_be_a_positive_number_of_seconds(value, capsys):
    from bridge.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["--idle-timeout-s", value])
    assert f"expected a number of seconds > 0, got {value!r}" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "soon", "Never"])
def test_a_stall_timeout_must_be_a_positive_number_of_seconds_or_never(value, capsys):
    from bridge.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["--stall-timeout-s", value])
    assert f"expected a number of seconds > 0 or never, got {value!r}" in capsys.readouterr().err


def test_the_timeouts_are_reported_with_the_limits_and_a_stalled_unix_frame_is_dropped(tmp_path):
    """`info` reports both timeouts; the server's own sweep ends the input of a unix connection
    stalled inside a frame (tests/test_lane_unix.py drives that sweep by hand) and says so."""
    from bridge.cli import build_parser
    from bridge.client import PortClient

    assert build_parser().parse_args(["--stall-timeout-s", "never"]).stall_timeout_s is None
    path = str(tmp_path / "s.sock")
    log_path = tmp_path / "server.log"
    with open(log_path, "wb") as log, PortClient(["--device", "cpu", "--idle-timeout-s", "2.5", "--stdio",
                                                  "--unix", path, "--stall-timeout-s", "0.5"], stderr=log) as client:
        assert {k: client.info()["limits"][k] for k in ("idle_timeout_s", "stall_timeout_s")} == \
            {"idle_timeout_s": 2.5, "stall_timeout_s": 0.5}
        peer = raw_unix(path)
        peer.sendall(request_frame(1, "ping")[:7])
        assert peer.recv(1) == b"", "the server answered a frame it never had whole"
        peer.close()
    assert "--stall-timeout-s" in log_path.read_text(errors="replace")
    with PortClient(["--device", "cpu"]) as client:
        limits = client.info()["limits"]
        assert (limits["idle_timeout_s"], limits["stall_timeout_s"]) == (None, 60.0)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_a_socket_only_server_ignores_stdin_and_stops_on_a_stop_signal(tmp_path, signum):
    """SIGHUP as SIGTERM (found in review: it killed the server outright, its socket file left)."""
    unix_path = str(tmp_path / "s.sock")
    srv = ServerProcess(str(tmp_path), "--unix", unix_path, "--zmq", f"ipc://{tmp_path}/z.ipc",
                        stdin=subprocess.PIPE)
    srv.wait_for_path(unix_path)
    srv.proc.stdin.close()  # a Port-mode server would exit now
    with UnixClient(unix_path) as client:
        # Not synchronisation: a stretch in which a server that read its stdin would see the EOF
        # and stop; one that ignores it gives no event to wait for.
        time.sleep(0.3)
        assert client.ping() == {"pong": True}
    started = time.monotonic()
    srv.proc.send_signal(signum)
    assert srv.stop() == 0, srv.log()
    assert time.monotonic() - started < 1.0
    assert not os.path.exists(unix_path)



@pytest.mark.parametrize("closed", [0, 1, 2], ids=["stdin", "stdout", "stderr"])
def test_a_server_started_without_a_standard_descriptor_serves_and_stops_cleanly(tmp_path, closed):
    """A daemon's `2>&-` (or `>&-`, `<&-`): with stderr closed the log writer died and the exit's
    flush failed, exit 1 after seconds; with stdout closed the server never started (its
    duplicate took fd 0); with stdin closed the stdio lane logged a traceback (found in review).
    /dev/null is opened on a missing one."""
    unix_path = str(tmp_path / "s.sock")
    lanes = ["--stdio", "--unix", unix_path] if closed == 0 else ["--unix", unix_path]
    log = open(tmp_path / "log", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "bridge", "--device", "cpu", *lanes], stdin=subprocess.DEVNULL,
                            stderr=log, env={**os.environ, **server_env()}, preexec_fn=lambda: os.close(closed))
    try:
        if closed == 0:  # the stdio lane's input ends at once, which stops the server
            assert proc.wait(120) == 0
        else:
            wait_until(lambda: os.path.exists(unix_path), "the unix lane never came up", 120)
            with UnixClient(unix_path) as client:
                assert client.ping() == {"pong": True}
            started = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(15) == 0
            assert time.monotonic() - started < 2.0
    finally:
        proc.kill()
        log.close()
    if closed != 2:
        assert "Traceback" not in (tmp_path / "log").read_text(), (tmp_path / "log").read_text()


def test_a_server_whose_stderr_nobody_reads_serves_on_and_stops(tmp_path):
    """A parent that pipes the server's stderr and reads none of it: once the pipe was full, the
    unix reader logging a closed connection's freed session blocked in the write, holding
    logging's lock; every unix connection stalled, and stdin's end and SIGTERM no longer stopped
    the server, whose stop is logged too (found in review). The log's lines are dropped instead."""
    unix_path = str(tmp_path / "s.sock")
    env = {**os.environ, **server_env()}
    proc = subprocess.Popen([sys.executable, "-m", "bridge", "--device", "cpu", "--unix", unix_path],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    try:
        wait_until(lambda: os.path.exists(unix_path), "the unix lane never came up", 120)
        for i in range(800):  # a line logged each (the session it freed): far past a pipe's 64 KiB
            with raw_unix(unix_path) as sock:
                sock.sendall(request_frame(i, "session_open", {"batch": 1, "dim": 1, "state": 1}))
                assert read_reply(sock.makefile("rb", buffering=0)).ok
        with UnixClient(unix_path) as client:
            assert client.ping() == {"pong": True}
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP],
                         ids=["SIGINT", "SIGTERM", "SIGHUP"])
def test_a_stop_signal_during_start_up_ends_the_server_quietly(tmp_path, signum):
    """The debug log's first line comes before start-up's slow part (importing torch, loading
    the kernels): a stop signal then ends the server with status 0 and a line saying so, where
    SIGINT gave KeyboardInterrupt's traceback and SIGTERM killed it outright."""
    srv = ServerProcess(str(tmp_path), "--log-level", "debug", stdin=subprocess.PIPE)
    try:
        wait_until(lambda: "DEBUG bridge: starting" in srv.log(), "the server never logged its start", 60,
                   interval=0.005)
        srv.proc.send_signal(signum)
        assert srv.proc.wait(60) == 0, srv.log()
    finally:
        srv.stop()
    log = srv.log()
    assert f"stop requested during start-up ({signal.Signals(signum).name}); exiting" in log, log
    assert "Traceback" not in log and "serving" not in log, log


@pytest.mark.parametrize("signum, delay_s", [
    pytest.param(signal.SIGINT, 0.0, id="SIGINT-at-once"),
    pytest.param(signal.SIGTERM, 0.0, id="SIGTERM-at-once"),
    pytest.param(signal.SIGHUP, 0.0, id="SIGHUP-at-once"),
    pytest.param(signal.SIGINT, 0.03, id="SIGINT-30ms-on"),
    pytest.param(signal.SIGTERM, 0.06, id="SIGTERM-60ms-on"),
])
def test_a_stop_signal_while_the_server_imports_its_modules_ends_it_quietly(tmp_path, signum, delay_s):
    """As during the rest of start-up, from the first line `python -m bridge` runs. Found in
    review: in the tenth of a second or so it took to import its modules, before cli.main's
    handlers, SIGINT gave KeyboardInterrupt's traceback and SIGTERM or SIGHUP killed it. The
    interpreter's import log tells when that line has run (the stdio guard's import comes right
    after it); the signal goes then, or `delay_s` on."""
    log_path = tmp_path / "server.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "bridge", "--device", "cpu"], stdin=subprocess.PIPE,
                                stderr=log, env=server_env({"PYTHONPROFILEIMPORTTIME": "1"}))
    try:
        wait_until(lambda: "| bridge.stdio_guard\n" in log_path.read_text(errors="replace"),
                   "the server never imported its stdio guard", 60, interval=0.001)
        time.sleep(delay_s)
        proc.send_signal(signum)
        status = proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdin.close()
    log = log_path.read_text(errors="replace")
    assert status == 0, log[-3000:]
    assert f"stop requested during start-up ({signal.Signals(signum).name}); exiting" in log, log[-3000:]
    assert "Traceback" not in log, log[-3000:]


def test_help_is_printed_on_stdout_for_a_person_to_page():
    """Found by a newcomer's walk: the stdout guard sent argparse's help to stderr, so
    `python -m bridge --help | less` showed nothing. A bad option's message stays on stderr."""
    shown = subprocess.run([sys.executable, "-m", "bridge", "--help"], capture_output=True, env=server_env(),
                           timeout=120)
    assert shown.returncode == 0, shown.stderr[-2000:]
    assert shown.stdout.startswith(b"usage: python -m bridge") and b"--max-pool-bytes" in shown.stdout
    assert shown.stderr == b""
    refused = subprocess.run([sys.executable, "-m", "bridge", "--no-such-option"], capture_output=True,
                             env=server_env(), timeout=120)
    assert refused.returncode == 2 and refused.stdout == b""
    assert b"unrecognized arguments: --no-such-option" in refused.stderr


def test_shutdown_writes_the_replies_a_slow_unix_reader_has_not_taken_yet(tmp_path):
    """A reply handed to a writer thread counts as answered; the server must not exit before
    the writer has written it (within transports.base.FLUSH_SECONDS): a client that reads 0.1 s after
    asking for a 32 MiB state and a shutdown gets both replies whole."""
    path = str(tmp_path / "bridge.sock")
    srv = ServerProcess(str(tmp_path), "--unix", path)
    try:
        srv.wait_for_path(path)
        conn = raw_unix(path)
        reader = conn.makefile("rb", buffering=0)
        conn.sendall(request_frame(1, "session_open", {"batch": 1, "dim": 4096, "state": 2048}))
        session = read_reply(reader).result["session"]
        conn.sendall(request_frame(2, "session_state", {"session": session}) + request_frame(3, "shutdown"))
        # Not synchronisation: the slow reader under test, busy elsewhere, so that the state's
        # reply outlasts the worker's stall and is left to a writer thread.
        time.sleep(0.1)
        state, stopping = read_reply(reader), read_reply(reader)
        assert state.id == 2 and state.ok and state.result["state"].shape == (1, 4096, 2048), state.error
        assert (stopping.id, stopping.result) == (3, {"stopping": True})
        reader.close()
        conn.close()
        assert srv.proc.wait(REPLY_TIMEOUT_S) == 0, srv.log()
        # any client may stop the server: the log names the connection that did
        assert re.search(r"unix:\d+ asked the server to stop \(shutdown\)", srv.log()), srv.log()
    finally:
        assert srv.stop() == 0, srv.log()


def test_a_curve_clients_directory_with_a_file_that_is_no_certificate_is_refused_at_start(tmp_path):
    """pyzmq's authenticator logged the file it could not read and then admitted no client: one
    empty .key locked every known client out of a server that started and looked healthy (found
    in review)."""
    import zmq.auth

    from bridge.transports.zmq import CurveKeys

    keys, clients = tmp_path / "keys", tmp_path / "clients"
    keys.mkdir()
    clients.mkdir()
    _, server_secret_file = zmq.auth.create_certificates(str(keys), "server")
    zmq.auth.create_certificates(str(clients), "alice")
    os.unlink(clients / "alice.key_secret")
    CurveKeys.load(server_secret_file, str(clients))
    (clients / "bob.key").write_text("")
    with pytest.raises(ValueError, match=r"--curve-clients .*: expected public certificates, got bob.key"):
        CurveKeys.load(server_secret_file, str(clients))


def test_curve_admits_only_known_clients(tmp_path):
    import zmq.auth

    keys = tmp_path / "keys"
    clients = tmp_path / "clients"
    keys.mkdir()
    clients.mkdir()
    server_public_file, server_secret_file = zmq.auth.create_certificates(str(keys), "server")
    known_public_file, known_secret_file = zmq.auth.create_certificates(str(clients), "known")
    os.rename(known_secret_file, keys / "known.key_secret")  # the server sees only public keys
    unix_path = str(tmp_path / "s.sock")
    srv = ServerProcess(str(tmp_path), "--unix", unix_path, "--zmq", "tcp://:*",
                        "--curve-secret-key", server_secret_file, "--curve-clients", str(clients))
    try:
        srv.wait_for_path(unix_path)
        with UnixClient(unix_path) as probe:
            endpoint = zmq_endpoint(probe.info(), "zmq-tcp", "tcp://:*")
        server_public, _ = zmq.auth.load_certificate(server_public_file)
        known = zmq.auth.load_certificate(str(keys / "known.key_secret"))
        with ZmqClient(endpoint, curve_server_key=server_public, curve_keypair=known) as client:
            assert client.ping() == {"pong": True}
        for stranger in ({"curve_server_key": server_public}, {}):  # unknown key; no CURVE at all
            with ZmqClient(endpoint, **stranger) as client:
                with pytest.raises(TimeoutError):
                    client.request("ping", timeout=1.5)
            # Refused, it never had a peer to send to: its io thread waited for one without
            # blocking, and stopped when closed (a blocked one was left in use as its socket was
            # closed, which aborts the process).
            assert not client._thread.is_alive()
    finally:
        assert srv.stop() == 0, srv.log()


_DESCRIPTOR_LIMIT = """
import argparse, logging, resource, sys
logging.basicConfig(stream=sys.stdout, level=logging.INFO, format="%(levelname)s %(message)s")
from bridge.cli import raise_descriptor_limit
args = argparse.Namespace(unix=["lane.sock"] * int(sys.argv[2]), zmq=[], max_connections=int(sys.argv[1]),
                          max_zmq_peers=4096)
print("limit", raise_descriptor_limit(args), resource.getrlimit(resource.RLIMIT_NOFILE)[0])
"""


@pytest.mark.parametrize("connections, lanes", [(16, 1), ("past the hard limit", 1), ("each lane's half", 2)])
def test_the_server_raises_its_open_files_limit_to_the_hard_one_and_warns_below_its_caps(connections, lanes):
    """Each connection holds a descriptor, and past the limit libzmq aborts the server on an
    ipc:// lane (found in review at the soft limit of 1024, under the default caps)."""
    import resource

    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard == resource.RLIM_INFINITY:
        with open("/proc/sys/fs/nr_open") as nr_open:
            hard = int(nr_open.read())
    # --max-connections caps each --unix lane: two lanes of half the limit are past it.
    allowed = {16: 16, "past the hard limit": hard + 1, "each lane's half": hard // 2 + 1}[connections]
    run = subprocess.run([sys.executable, "-c", _DESCRIPTOR_LIMIT, str(allowed), str(lanes)], capture_output=True,
                         text=True,
                         timeout=60, env=server_env(),
                         preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(
                             resource.RLIMIT_NOFILE)[1])))
    assert run.returncode == 0, run.stderr
    assert f"limit {hard} {hard}" in run.stdout
    assert ("WARNING the open-files limit" in run.stdout) == (connections != 16), run.stdout
