"""The server end to end, through a real subprocess spoken to as a BEAM Port would."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time

import msgpack
import numpy as np
import pytest
import torch

import bridge.dispatcher
import protocol
from bridge.client import PortClient, ServerExited, server_env
from bridge.device import choose_device
from bridge.errors import OpError
from bridge.timing import now_ns
from bridge.server import Server, ServerConfig
from protocol.vectors import generate
from bridge_fakes import RecordingConnection
from kernel_cases import SCAN_CASES, ScanCase, assert_close, make_scan_inputs, reference_scan
from waiting import wait_until


@pytest.fixture(scope="module")
def client():
    with PortClient(["--device", "cpu"]) as c:
        yield c


def numpy_args(inputs: dict) -> dict:
    return {k: (v.numpy() if isinstance(v, torch.Tensor) and v.dtype != torch.bfloat16 else v)
            for k, v in inputs.items()}


def body(obj) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def tensor_map(arr: np.ndarray, dtype="f32") -> dict:
    return {"dtype": dtype, "shape": list(arr.shape), "data": arr.tobytes()}


def raw_request(client, obj_or_bytes):
    """Send one frame (bypassing the client's encoder); return the Reply to it."""
    data = obj_or_bytes if isinstance(obj_or_bytes, bytes) else body(obj_or_bytes)
    before = client.unmatched_count
    rid = obj_or_bytes.get("id") if isinstance(obj_or_bytes, dict) else None
    if isinstance(rid, (int, str)) and not isinstance(rid, bool):
        return client.send_raw(data, request_id=rid).result(30)
    client.send_raw(data)
    wait_until(lambda: client.unmatched_count != before, "no reply", timeout=30)
    return client.unmatched[-1]


def test_ping_and_info(client):
    assert client.ping() == {"pong": True}
    info = client.info()
    assert info["protocol"]["version"] == 1
    assert info["device"]["device"] == "cpu"
    assert info["backend"] in info["kernels"]["available"]
    if "cpu" in info["kernels"]["available"]:  # the SIMD variant that serves
        assert info["kernels"]["details"]["cpu"]["simd"] in ("avx512", "avx2", "baseline")
    assert {"ping", "info", "scan", "stats", "shutdown"} <= set(info["protocol"]["ops"])


def test_threads_sets_the_cpu_threads_a_kernel_call_may_use():
    """--threads reaches torch (which the cpu backend's helper pool follows), as info reports,
    and the kernels still answer (0 is refused: test_sessions' table of bad flags). The count
    asked for is not the machine's default (this process's, under the same environment)."""
    threads = 2 if torch.get_num_threads() == 1 else 1
    inputs = make_scan_inputs(ScanCase(2, 9, 6, 5, D=True))
    with PortClient(["--device", "cpu", "--threads", str(threads)]) as server:
        assert server.info()["devices"][0]["threads"] == threads
        result = server.scan(**numpy_args(inputs)).unwrap()
    assert_close(torch.from_numpy(result["y"]), reference_scan(inputs)[0], torch.float32, "y")


@pytest.mark.parametrize("codec", protocol.CODECS, ids=lambda codec: codec.name)
def test_a_server_serves_exactly_the_protocols_ops(codec):
    """The decoders answer any other op (unknown_op); a registry missing one of a codec's ops
    would leave requests for it unanswerable, so it is refused at start."""
    from bridge.ops import REGISTRY

    with pytest.raises(ValueError, match=f"{codec.name} handlers: expected one for each of"):
        Server(ServerConfig(device="cpu"), choose_device("cpu"), REGISTRY.without("scan", codec))


@pytest.mark.parametrize("case", SCAN_CASES)
def test_scan_matches_reference(client, case):
    inputs = make_scan_inputs(case)
    reply = client.scan(**numpy_args(inputs))
    result = reply.unwrap()
    y_ref, state_ref = reference_scan(inputs)
    assert_close(torch.from_numpy(result["y"]), y_ref, torch.float32, "y")
    if case.return_state:
        assert_close(torch.from_numpy(result["state"]), state_ref, torch.float32, "state")
    else:
        assert "state" not in result


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64], ids=["f16", "bf16", "f64"])
def test_scan_dtypes(client, dtype):
    case = SCAN_CASES[11].values[0]  # every option
    inputs = make_scan_inputs(case, dtype=dtype)
    result = client.scan(**numpy_args(inputs)).unwrap()
    y = result["y"]
    y = y if isinstance(y, torch.Tensor) else torch.from_numpy(y)
    assert y.dtype == dtype
    y_ref, _ = reference_scan(inputs)
    assert_close(y, y_ref, dtype, "y")


def test_timing_split(client):
    inputs = make_scan_inputs(SCAN_CASES[11].values[0])
    reply = client.scan(**numpy_args(inputs))
    t = reply.timing
    keys = {"decode_us", "queue_us", "h2d_us", "kernel_us", "d2h_us", "encode_us", "server_us"}
    assert keys <= set(t)
    assert all(t[k] >= 0 for k in keys)
    assert t["kernel_us"] > 0
    stage_sum = sum(t[k] for k in keys - {"server_us"})
    assert stage_sum <= t["server_us"] + 1.0
    assert t["server_us"] <= reply.round_trip_us


def test_pipelined_requests_match_by_id(client):
    case = SCAN_CASES[2].values[0]
    pending = []
    for i in range(24):
        inputs = make_scan_inputs(case, seed=1000 + i)
        rid = f"req-{i}" if i % 2 else 10_000 + i
        pending.append((client.submit("scan", numpy_args(inputs), request_id=rid), inputs, rid))
    for future, inputs, rid in pending:
        reply = future.result(60)
        assert reply.id == rid
        y_ref, _ = reference_scan(inputs)
        assert_close(torch.from_numpy(reply.unwrap()["y"]), y_ref, torch.float32, f"y of {rid}")


def good_scan_args(seed=0) -> dict:
    rng = np.random.default_rng(seed)
    b, l, d, n = 2, 5, 4, 3
    f = lambda *s: rng.uniform(-1, 1, s).astype(np.float32)  # noqa: E731
    return {"x": tensor_map(f(b, l, d)), "dt": tensor_map(rng.uniform(0.01, 0.5, (b, l, d)).astype(np.float32)),
            "A": tensor_map(-rng.uniform(0.1, 2, (d, n)).astype(np.float32)),
            "B": tensor_map(f(b, l, n)), "C": tensor_map(f(b, l, n))}


def with_args(**changes):
    args = good_scan_args()
    for k, v in changes.items():
        if v is None:
            args.pop(k, None)
        else:
            args[k] = v
    return args


ERROR_CASES = [
    pytest.param(b"\xc1", None, "decode_error", id="not-msgpack"),
    pytest.param(body([1, 2, 3]), None, "decode_error", id="not-a-map"),
    pytest.param(body({"v": 1, "id": 7, "op": "ping"}) + b"\x00", None, "decode_error", id="trailing-bytes"),
    pytest.param({"v": 1, "id": 1, "op": 5}, 1, "invalid_request", id="op-not-str"),
    pytest.param({"v": 1, "id": 2, "op": "scan", "args": [1]}, 2, "invalid_request", id="args-not-map"),
    pytest.param({"v": 1, "id": [1], "op": "ping"}, None, "invalid_request", id="id-wrong-type"),
    pytest.param({"v": 2, "id": 3, "op": "ping"}, 3, "unsupported_version", id="version-2"),
    pytest.param({"v": 1, "id": 4, "op": "fly"}, 4, "unknown_op", id="unknown-op"),
    pytest.param({"v": 1, "id": 5, "op": "scan", "args": with_args(B=None)}, 5, "missing_argument", id="missing-B"),
    pytest.param({"v": 1, "id": 6, "op": "scan", "args": with_args(dt_softplus="yes")}, 6, "invalid_argument",
                 id="softplus-not-bool"),
    pytest.param({"v": 1, "id": 7, "op": "scan", "args": with_args(layout="lbd")}, 7, "invalid_argument", id="bad-layout"),
    pytest.param({"v": 1, "id": 8, "op": "scan", "args": with_args(typo_arg=1)}, 8, "invalid_argument", id="unknown-arg"),
    pytest.param({"v": 1, "id": 9, "op": "scan", "args": with_args(x={"dtype": "f128", "shape": [1], "data": b"\0" * 16})},
                 9, "unknown_dtype", id="unknown-dtype"),
    pytest.param({"v": 1, "id": 10, "op": "scan", "args": with_args(x={"dtype": "f32", "shape": [1000, 1000], "data": b"\0" * 16})},
                 10, "tensor_size_mismatch", id="lying-shape"),
    pytest.param({"v": 1, "id": 11, "op": "scan", "args": with_args(dt=tensor_map(np.ones((2, 5, 7), np.float32)))},
                 11, "shape_mismatch", id="dt-shape"),
    pytest.param({"v": 1, "id": 12, "op": "scan", "args": with_args(A={"handle": "nope"})}, 12, "unknown_handle",
                 id="unknown-handle"),
    pytest.param({"v": 1, "id": 13, "op": "scan", "args": with_args(x=tensor_map(np.ones((2, 5, 4), np.int32), "i32"))},
                 13, "invalid_argument", id="int-x"),
    pytest.param({"v": 1, "id": 14, "op": "scan", "args": with_args(dt_min=0.5, dt_max=0.1)}, 14, "invalid_argument",
                 id="clamp-inverted"),
    pytest.param({"v": 1, "id": 15, "op": "scan", "args": with_args(session="s-unknown")}, 15, "unknown_session",
                 id="unknown-session"),
    # No array spans 2^63 bytes, even one a 0 dim leaves empty (SPEC §5): refused while decoding.
    pytest.param({"v": 1, "id": 16, "op": "put",
                  "args": {"tensor": {"dtype": "f32", "shape": [0, 2**61], "data": b""}}},
                 16, "invalid_argument", id="empty-shape-too-big"),
    pytest.param(b"\x83\xa2id\x11\xa2op\xa4ping" + body({"a": 1}) + b"\x01", None, "invalid_request", id="map-key"),
]


@pytest.mark.parametrize("frame,expected_id,code", ERROR_CASES)
def test_every_bad_input_gets_a_structured_error(client, frame, expected_id, code):
    reply = raw_request(client, frame)
    assert reply.ok is False
    assert reply.id == expected_id
    assert reply.error["code"] == code, reply.error
    assert reply.error["message"]
    assert code in protocol.ERROR_CODES
    assert client.ping() == {"pong": True}


def test_errors_name_the_field(client):
    reply = raw_request(client, {"v": 1, "id": 99, "op": "scan",
                                 "args": with_args(dt=tensor_map(np.ones((2, 5, 7), np.float32)))})
    assert "dt" in reply.error["message"] and "[2, 5, 4]" in reply.error["message"]
    assert reply.error["detail"]["field"] == "args.dt"


@pytest.mark.parametrize("shape, field", [
    pytest.param([0, 2**61], "args.tensor.shape", id="empty-past-2^63-1-bytes"),
    pytest.param([2**62, 4], "args.tensor.shape", id="2^66-bytes"),
    pytest.param([2**61 - 1], "args.tensor.data", id="2^63-4-bytes"),
])
def test_a_huge_tensor_is_answered_with_its_whole_detail(client, shape, field):
    # A byte count past 2^64 - 1 would not fit the reply: its detail would be lost.
    reply = raw_request(client, {"v": 1, "id": 100, "op": "put",
                                 "args": {"tensor": {"dtype": "f32", "shape": shape, "data": b""}}})
    assert reply.error["detail"]["field"] == field, reply.error
    assert str(shape[-1]) in reply.error["detail"]["got" if field.endswith("shape") else "expected"]


def test_the_largest_empty_tensor_is_put_and_freed(client):
    reply = raw_request(client, {"v": 1, "id": 101, "op": "put",
                                 "args": {"tensor": {"dtype": "f32", "shape": [0, 2**61 - 1], "data": b""}}})
    assert reply.ok, reply.error
    assert client.request("free", {"handle": reply.result["handle"]}).unwrap() == {"freed": True}


def test_a_dtype_the_kernels_refuse_is_named_by_its_wire_code(client):
    reply = raw_request(client, {"v": 1, "id": 102, "op": "scan",
                                 "args": with_args(x=tensor_map(np.ones((2, 5, 4), np.int32), "i32"))})
    assert reply.error["detail"] == {"field": "args.x", "expected": "a floating dtype (f32, f16, bf16, f64)",
                                     "got": "i32"}
    assert reply.error["message"] == "args.x: expected a floating dtype (f32, f16, bf16, f64), got i32"


def test_the_golden_scan_replies_have_the_timing_keys_of_a_scan_reply(client):
    vectors = {name: doc for name, _, doc in generate.build_vectors() + generate.build_multipart_vectors()}
    live = client.scan(**numpy_args(make_scan_inputs(SCAN_CASES[1].values[0])))
    assert live.ok and list(live.timing)[-1] == "batch_rows", live.error
    assert set(live.timing) <= set(vectors["reply_scan"]["message"]["timing"])
    for name in ("reply_scan", "multipart_reply_scan"):
        assert list(vectors[name]["message"]["timing"])[-1] == "batch_rows", name


def test_stats_count_requests_and_errors(client):
    before = client.stats()
    client.scan(**{k: v for k, v in numpy_args(make_scan_inputs(SCAN_CASES[1].values[0])).items()}).unwrap()
    raw_request(client, {"v": 1, "id": 777, "op": "fly"})
    after = client.stats()
    assert after["ops"]["scan"]["inference_count"] == before["ops"].get("scan", {}).get("inference_count", 0) + 1
    assert after["ops"]["scan"]["kernel_us"] > before["ops"].get("scan", {}).get("kernel_us", 0)
    assert after["errors"].get("unknown_op", 0) == before["errors"].get("unknown_op", 0) + 1
    assert after["frames_in"] >= before["frames_in"] + 3


def test_oversized_frame_is_drained_and_answered():
    with PortClient(["--device", "cpu", "--max-frame-size", "4096"]) as c:
        c.send_raw(b"\x00" * 10_000)
        ok = c.submit("ping")
        assert ok.result(30).unwrap() == {"pong": True}
        assert len(c.unmatched) == 1
        err = c.unmatched[0]
        assert err.id is None and err.error["code"] == "frame_too_large"


def spawn_server(*extra, command=None):
    cmd = command or [sys.executable, "-m", "bridge", "--device", "cpu", *extra]
    return PortClient(command=cmd, stderr=subprocess.DEVNULL)


def wait_ready(c):
    assert c.request("ping", timeout=120).unwrap() == {"pong": True}


def test_exits_zero_within_a_second_of_eof():
    c = spawn_server()
    wait_ready(c)
    c.proc.stdin.close()
    start = time.monotonic()
    assert c.proc.wait(5) == 0
    assert time.monotonic() - start < 1.0


def test_eof_finishes_requests_in_flight():
    c = spawn_server()
    wait_ready(c)
    inputs = make_scan_inputs(SCAN_CASES[12].values[0])
    futures = [c.submit("scan", numpy_args(inputs)) for _ in range(3)]
    c.proc.stdin.close()
    for f in futures:
        assert "y" in f.result(30).unwrap()
    assert c.proc.wait(5) == 0



def test_eof_while_a_lone_long_request_runs_exits_within_the_drain():
    """An idle server serves a lone request on the thread that reads stdin, which reads the
    input's end only once that request is done: a 10 s scan kept the server running for nobody
    that long after its Port closed (found in review). Its drain now gives up on it within seconds."""
    c = spawn_server("--backend", "reference")
    wait_ready(c)
    steps = 2_000_000  # the reference's plain recurrence: tens of seconds, whatever the machine
    inputs = {"x": np.ones((1, steps, 1), np.float32), "dt": np.full((1, steps, 1), 0.01, np.float32),
              "A": -np.ones((1, 1), np.float32), "B": np.ones((1, steps, 1), np.float32),
              "C": np.ones((1, steps, 1), np.float32)}
    running = c.submit("scan", inputs)
    time.sleep(1.0)
    c.proc.stdin.close()
    # Within a few seconds (the reference's loop holds the GIL the main loop needs), not the
    # scan's tens: its reply never comes.
    assert c.proc.wait(15) == 0
    with pytest.raises(ServerExited):  # unanswered: the drain does not wait for it
        running.result(5)


def test_requests_written_before_eof_are_answered_though_a_lone_long_one_runs():
    """The hang-up the main loop sees counts as the input's end only with nothing left unread:
    a request written before stdin closed, behind a long one the reader serves, is read and
    answered (found by mutating that fix: nothing failed)."""
    c = spawn_server("--backend", "reference")
    wait_ready(c)
    steps = 250_000  # seconds of the reference's plain recurrence
    inputs = {"x": np.ones((1, steps, 1), np.float32), "dt": np.full((1, steps, 1), 0.01, np.float32),
              "A": -np.ones((1, 1), np.float32), "B": np.ones((1, steps, 1), np.float32),
              "C": np.ones((1, steps, 1), np.float32)}
    running = c.submit("scan", inputs)
    time.sleep(0.3)  # the reader now serves it
    after = c.submit("ping")
    time.sleep(0.3)
    c.proc.stdin.close()
    assert running.result(120).ok
    assert after.result(10).ok
    assert c.proc.wait(15) == 0


def test_sigterm_exits_zero_within_a_second():
    c = spawn_server()
    wait_ready(c)
    start = time.monotonic()
    c.proc.send_signal(signal.SIGTERM)
    assert c.proc.wait(5) == 0
    assert time.monotonic() - start < 1.0


def test_shutdown_op_replies_then_exits():
    c = spawn_server()
    wait_ready(c)
    assert c.call("shutdown") == {"stopping": True}
    assert c.proc.wait(5) == 0


# An embedding (an in-process server, as the tests' are) with a torch op running, the GIL
# released, when it stops the dispatcher and the interpreter then finalizes: on the worker
# (argv[1] "worker"), or inline on a daemon thread as a lane's reader serves an idle server's
# request ("reader"). The op runs until the thread that stopped the dispatcher waits for it, so
# without that wait it is still running at exit.
EMBEDDING_STOPPED_IN_AN_OP = r"""
import sys
import threading

import torch

from bridge_fakes import InProcessServer, RecordingConnection


def waited_for(thread) -> bool:
    # The main thread joins `thread` (the worker), or is in stop() once the worker has ended:
    # all that stop() can still wait for is the op a reader thread serves.
    frame = sys._current_frames().get(threading.main_thread().ident)
    while frame is not None:
        if frame.f_code.co_name == "join" and frame.f_locals.get("self") is thread:
            return True
        if frame.f_code.co_name == "stop" and frame.f_locals.get("self") is srv.dispatcher:
            return not srv.dispatcher._worker.is_alive()
        frame = frame.f_back
    return False


inside = threading.Event()


def busy(server, call):
    inside.set()
    x = torch.ones(1 << 20)
    while not waited_for(threading.current_thread()):
        x.mul_(1.0)
    return {}


srv = InProcessServer(handlers={"info": busy})
if sys.argv[1] == "worker":
    srv.submit(RecordingConnection(), "info")  # more input may follow: queued for the worker
else:
    threading.Thread(target=srv.submit, args=(RecordingConnection(), "info"), kwargs={"more_input": False},
                     name="reader", daemon=True).start()
if not inside.wait(60):
    raise SystemExit("the op never started")
srv.close()
"""


@pytest.mark.parametrize("serving", ["worker", "reader"])
def test_an_embedding_that_stops_its_dispatcher_during_an_op_exits_quietly(serving):
    """Dispatcher.stop() waits for the op in progress to end. Found in review: it only queued
    the stop, so an embedding that stopped the dispatcher and let the interpreter finalize with
    the worker inside a torch op died at exit (the worker, taking the GIL back, was ended from
    inside the op's released-GIL scope: std::terminate, SIGABRT); then it joined the worker, but
    an op served inline on a reader thread (an idle server's, the native step path's) died so."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.pathsep.join([root, os.path.join(root, "tests")])
    proc = subprocess.run([sys.executable, "-c", EMBEDDING_STOPPED_IN_AN_OP, serving], cwd=root,
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": path}, timeout=120)
    assert proc.returncode == 0 and "terminate" not in proc.stderr, (proc.returncode, proc.stderr)


@pytest.mark.parametrize("exc, message", [
    pytest.param(ValueError("no tensor named '\ud800' here"), "ValueError: no tensor named '\\ud800' here",
                 id="internal-message"),
    pytest.param(OpError("invalid_argument", "args.name: got '\ud800'", {"got": "\ud800"}),
                 "args.name: got '\\ud800'", id="message-and-detail"),
    pytest.param(OpError("invalid_argument", "args.name: not a name", {"got": "\ud800"}),
                 "args.name: not a name", id="detail"),
])
def test_an_error_whose_text_is_no_utf8_is_still_answered(inproc, exc, message, monkeypatch):
    """A message or detail holding a lone surrogate (a name read from a file) cannot be encoded as
    msgpack's UTF-8: the detail was dropped, but the message, encoded again as it was, failed the
    reply too, and the request went unanswered (found in review)."""
    def raising(server, call):
        raise exc

    # Its log lines hold the surrogate too, which a pytest-xdist worker cannot send in its report.
    monkeypatch.setattr(bridge.dispatcher.log, "disabled", True)
    srv = inproc(handlers={"info": raising})
    conn = RecordingConnection()
    reply = srv.request(conn, "info")
    assert not reply.ok and reply.error["code"] in ("internal_error", "invalid_argument")
    assert reply.error["message"] == message and reply.error["detail"] == {}, reply.error
    assert srv.call(conn, "ping") == {"pong": True}


def test_a_request_a_reader_thread_would_serve_once_the_dispatcher_stopped_is_refused_unrun(inproc):
    """Once stop() has waited for the ops in progress, none starts: found in review, an idle
    server's request was still served inline on its reader thread (the worker gone), where an
    embedding's exit could end it inside a torch op."""
    ran = []
    srv = inproc(handlers={"info": lambda server, call: ran.append(call) or {}})
    assert srv.dispatcher.stop(60)
    conn = RecordingConnection()
    reply = conn.reply(srv.submit(conn, "info", more_input=False))
    assert not reply.ok and reply.error["code"] == "shutting_down"
    assert not ran


def test_a_request_queued_as_or_after_the_dispatcher_stops_is_refused_unrun(inproc):
    """What goes to the queue once the worker has taken its stop is answered shutting_down,
    unrun: found in review, it was never answered (no worker was left to serve it), so an
    embedding's caller waited for good. Queued while stop() waits for a reader's op, it is
    answered as stop() ends; queued once stopped, as it is handed over."""
    ran = []
    srv = inproc(handlers={"info": lambda server, call: ran.append(call) or {}})
    conn = RecordingConnection()
    srv.hold_on_reader(conn)
    stopped = []
    stopper = threading.Thread(target=lambda: stopped.append(srv.dispatcher.stop(60)), name="stopper")
    stopper.start()
    wait_until(lambda: not srv.dispatcher._worker.is_alive(), "the worker never took its stop")
    while_stopping = srv.submit(conn, "info")  # more input may follow: queued
    srv.go()
    stopper.join(60)
    assert stopped == [True]
    once_stopped = srv.submit(conn, "info")
    for request_id in (while_stopping, once_stopped):
        reply = conn.reply(request_id, timeout=0)
        assert not reply.ok and reply.error["code"] == "shutting_down", (request_id, reply)
    assert not ran


def test_a_stop_out_of_time_for_a_readers_op_still_refuses_what_is_queued_after_it(inproc):
    """stop() that runs out of time waiting for an op a reader thread serves leaves no worker:
    found in review, a request queued then (another connection's, the server busy) was never
    answered, nor was any after it. It is refused unrun; the op in progress still ends ok."""
    ran = []
    srv = inproc(handlers={"info": lambda server, call: ran.append(call) or {}})
    conn, other = RecordingConnection(), RecordingConnection()
    srv.hold_on_reader(conn)
    assert not srv.dispatcher.stop(0.1), "stop() said the held op had ended"
    reply = other.reply(srv.submit(other, "info"), timeout=0)
    assert not reply.ok and reply.error["code"] == "shutting_down", reply
    srv.go()
    assert srv.dispatcher.stop(60)
    assert not ran


def test_stop_waits_for_a_reader_threads_first_frame_preparation_and_none_starts_after(inproc, monkeypatch):
    """A reader thread's first frame runs a torch op (bridge.dispatcher.start_openmp_team)
    outside the serving lock: found in review, stop() neither waited for one in progress (it
    said all had ended) nor kept one from starting after, on a daemon thread an embedding's
    exit could end inside it (as test_an_embedding_that_stops_its_dispatcher_during_an_op_exits_quietly)."""
    ran = []
    srv = inproc(handlers={"info": lambda server, call: ran.append(call) or {}})
    inside, release, teams = threading.Event(), threading.Event(), []
    start_team = bridge.dispatcher.start_openmp_team

    def held_team() -> None:
        if not threading.current_thread().name.startswith("first-frame"):
            return start_team()  # the worker's, say: not this test's
        teams.append(threading.current_thread().name)
        inside.set()
        if not release.wait(60):
            raise TimeoutError("the test never let the preparation end")

    monkeypatch.setattr(bridge.dispatcher, "start_openmp_team", held_team)
    conn = RecordingConnection()
    ids = []
    reader = threading.Thread(target=lambda: ids.append(srv.submit(conn, "info")), name="first-frame-1")
    reader.start()
    assert inside.wait(60)
    assert not srv.dispatcher.stop(1), "stop() said all had ended with a preparation in progress"
    release.set()
    reader.join(60)
    assert srv.dispatcher.stop(60)
    after = threading.Thread(target=lambda: ids.append(srv.submit(conn, "info")), name="first-frame-2")
    after.start()
    after.join(60)
    assert teams == ["first-frame-1"]
    for request_id in ids:
        assert conn.reply(request_id, timeout=0).error["code"] == "shutting_down"
    assert not ran


# A C-level writer hammering fd 1 from another thread while requests are served: the guard
# must have moved the protocol off fd 1 before any such write can happen.
STRAY_WRITER = r"""
import sys
from bridge.stdio_guard import claim_protocol_stdout
fd = claim_protocol_stdout()
import ctypes, threading, time
libc = ctypes.CDLL(None)
def scribble():
    while True:
        libc.write(1, b"\x00\x00\x00\x05hello stray C write\n", 24)
        libc.printf(b"printf noise %d\n", 42)
        libc.fflush(None)
        print("python print noise")
        time.sleep(0.001)  # not synchronisation: the pace of the stray writes
threading.Thread(target=scribble, daemon=True).start()
from bridge.cli import main
main(["--device", "cpu"], protocol_fd=fd)
"""


def test_stray_writes_to_fd1_leave_frames_intact():
    c = spawn_server(command=[sys.executable, "-c", STRAY_WRITER])
    wait_ready(c)
    case = SCAN_CASES[11].values[0]
    for i in range(20):
        inputs = make_scan_inputs(case, seed=i)
        y_ref, _ = reference_scan(inputs)
        assert_close(torch.from_numpy(c.scan(**numpy_args(inputs)).unwrap()["y"]), y_ref, torch.float32, "y")
    assert not c.unmatched
    c.close()


# Output a library buffered in sys.stdout before the guard ran (stdout is a pipe under a Port,
# so Python buffers it in blocks): claiming stdout must send it to the log, not into the frames.
BUFFERED_BEFORE_CLAIM = r"""
import os, sys
sys.stdout.write("buffered before the guard ran")
from bridge.stdio_guard import claim_protocol_stdout
fd = claim_protocol_stdout()
os.write(fd, b"FRAME")
"""


def test_stdout_buffered_before_the_guard_goes_to_stderr_not_the_protocol():
    env = server_env()
    env.pop("PYTHONUNBUFFERED", None)  # as a Port starts it: stdout buffered
    proc = subprocess.run([sys.executable, "-c", BUFFERED_BEFORE_CLAIM], env=env, capture_output=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == b"FRAME"
    assert b"buffered before the guard ran" in proc.stderr


def test_warmup_compiles_before_serving_and_info_lists_it():
    # Without a GPU the Triton backend runs on the CPU interpreter (TRITON_INTERPRET=1); with
    # one, the server compiles for real, for CUDA.
    device, env = ("cuda", {}) if torch.cuda.is_available() else ("cpu", {"TRITON_INTERPRET": "1"})
    cmd = [sys.executable, "-m", "bridge", "--device", device, "--backend", "triton",
           "--warmup", "2x5x4x3:D,z", "--warmup", "1x3x4x2",
           "--warmup", "1x3x4x2:groups=2,layout=bdl,dtype=bf16", "--warmup", "2x5x4x3x2:D,dt_softplus"]
    c = PortClient(command=cmd, env=env, stderr=subprocess.DEVNULL)
    wait_ready(c)
    compiled = c.info()["kernels"]["compiled"]
    assert len(compiled) == 8 and all(line.startswith("triton ") for line in compiled), compiled
    assert sum("float32" in line for line in compiled) == 6
    assert any(line.startswith("triton scan bdl batch=1 seq=3 dim=4 state=2 groups=2 bfloat16") for line in compiled)
    assert any(line.startswith("triton ssd_scan batch=2 seq=5 heads=4 headdim=3 state=2 groups=1 float32")
               for line in compiled), compiled
    c.close()


def test_a_warmup_that_fails_to_compile_stops_the_server_with_its_traceback(monkeypatch, caplog):
    """A compile failure is not a bad bucket: the log keeps its traceback, which says where."""
    import scan_kernels
    from bridge import cli

    def failing_warmup(*args, **kwargs):
        raise RuntimeError("the compiler gave up")

    monkeypatch.setattr(scan_kernels, "warmup", failing_warmup)
    with open(os.devnull, "wb") as protocol_out, caplog.at_level(logging.ERROR, logger="bridge"):
        assert cli.main(["--device", "cpu", "--warmup", "1x3x4x2"], protocol_fd=protocol_out.fileno()) == 2
    record = caplog.records[-1]
    assert "compiling failed" in record.getMessage()
    assert record.exc_info and record.exc_info[0] is RuntimeError


@pytest.mark.parametrize("bucket, expected", [
    pytest.param("2x5x4", "BATCHxSEQxDIMxSTATE", id="three-dims"),
    pytest.param("2x5x4x3x2x1", "BATCHxSEQxHEADSxHEADDIMxSTATE", id="six-dims"),
    pytest.param("2x5x4x3:dtype=i32", "dtype=f32|f16|bf16|f64, got 'dtype=i32'", id="integer-dtype"),
    pytest.param("2x5x4x3:groups=0", "groups=<a positive int>", id="zero-groups"),
    pytest.param("2x5x4x3:layout=lbd", "layout=bld|bdl", id="bad-layout"),
])
def test_a_bad_warmup_bucket_stops_the_server_with_a_reason(bucket, expected):
    result = subprocess.run([sys.executable, "-m", "bridge", "--device", "cpu", "--warmup", bucket],
                            env=server_env(), stdin=subprocess.DEVNULL,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert expected in result.stderr, result.stderr


class GoneConnection(RecordingConnection):
    """A peer gone: every reply fails to be written, as a stream lane's does then."""

    def __init__(self):
        super().__init__()
        self.attempts = 0

    def send(self, parts: list, buffers: list | None = None) -> None:
        self.attempts += 1
        raise BrokenPipeError(f"{self.id}: the peer is gone")


def test_a_gone_peer_with_many_requests_queued_is_warned_of_once(inproc, caplog):
    """Found in review: each queued request of a vanished unix peer logged its own warning that
    its reply could not be written (64 for a peer gone at its in-flight cap)."""
    srv = inproc()
    gone, other = GoneConnection(), RecordingConnection()
    srv.hold(other)
    for _ in range(5):
        srv.submit(gone, "info")
    with caplog.at_level(logging.DEBUG, logger="bridge"):
        srv.go()
        wait_until(lambda: gone.attempts == 5, "the replies were never attempted")
    failures = [r for r in caplog.records if "could not reply" in r.getMessage()]
    assert [r.levelno for r in failures] == [logging.WARNING] + [logging.DEBUG] * 4, failures



def test_peers_gone_one_after_another_are_warned_of_at_most_once_an_interval(inproc, caplog):
    """Each connection that went before reading its replies logged a warning of its own: a
    client could write the log full by connecting, sending and closing (found in review)."""
    srv = inproc()
    gone, other = [GoneConnection() for _ in range(5)], RecordingConnection()
    srv.hold(other)
    for conn in gone:
        srv.submit(conn, "info")
    with caplog.at_level(logging.DEBUG, logger="bridge"):
        srv.go()
        wait_until(lambda: all(conn.attempts == 1 for conn in gone), "the replies were never attempted")
    failures = [r for r in caplog.records if "could not reply" in r.getMessage()]
    assert [r.levelno for r in failures] == [logging.WARNING], failures


# An id no server issues, whose repr is four times its size.
CHOSEN_ID = "\x00" * 4096


@pytest.mark.parametrize("op, args, key", [
    pytest.param("session_state", {"session": CHOSEN_ID}, "session", id="session"),
    pytest.param("free", {"handle": CHOSEN_ID}, "handle", id="handle"),
    pytest.param("model_free", {"model": CHOSEN_ID}, "model", id="model"),
    pytest.param("snapshot_free", {"snapshot": CHOSEN_ID}, "snapshot", id="snapshot"),
])
def test_an_unknown_id_the_client_chose_is_told_by_its_size_in_the_message(inproc, op, args, key):
    """Found in review: the message quoted the id given with repr(), up to four times its bytes
    (a NUL is `\\x00`), on top of the copy in `detail`: a request made its error reply five times
    its own size. A long id is told by its size, as a long key is; `detail` still carries it."""
    srv, conn = inproc(), RecordingConnection()
    error = srv.request(conn, op, **args).error
    assert error["code"] == f"unknown_{key}" and error["detail"][key] == CHOSEN_ID
    assert len(error["message"]) < 200 and "str of 4096 bytes" in error["message"], error["message"][:200]


def test_a_cancelled_request_whose_id_the_client_chose_is_told_by_its_size(inproc):
    """As above, for the ids a cancel's answer names (the request's and the cancel's own)."""
    srv, conn = inproc(), RecordingConnection()
    srv.hold(conn)
    try:
        for request_id, op, args in ((CHOSEN_ID, "ping", {}), (CHOSEN_ID + "!", "cancel", {"id": CHOSEN_ID})):
            srv.dispatcher.on_frame(conn, bytearray(b"".join(protocol.encode_request(request_id, op, args))),
                                    now_ns())
        assert conn.reply(CHOSEN_ID + "!").result == {"cancelled": True}
        error = conn.reply(CHOSEN_ID).error
    finally:
        srv.go()
    assert error["code"] == "cancelled" and error["detail"] == {"cancelled_by": CHOSEN_ID + "!"}
    assert len(error["message"]) < 200, error["message"][:200]
