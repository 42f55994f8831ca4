"""The C client (examples/c_client), built under AddressSanitizer and UndefinedBehaviorSanitizer
(`make scan_client-sanitized`), run against a live server over zmq ipc and tcp: it decodes every
golden vector, pings, and checks an inline and a multipart scan, and an inline Mamba-2 ssd_scan,
against its own C references.
Then the same client against replies a proxy alters (other ids, a nil id, too many parts, an
error reply, wrong types, malformed envelopes, element counts past the body's bytes), plain and
sanitized builds both, against vectors of our own (sizes that overflow), and with a
preloaded shim that sees who frees its zero-copy send buffers. Without
libzmq / msgpack-c headers the tests skip and say why, except in CI (CI=true), where that is a
failure: the CI machine installs them (.ci/system-deps.sh)."""

from __future__ import annotations

import contextlib
import math
import os
import pathlib
import re
import shutil
import subprocess
import threading
import time
import warnings

import msgpack
import pytest

from protocol import DecodeError, OutTensor, decode_reply, encode_frame, encode_reply

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLIENT_DIR = os.path.join(ROOT, "examples", "c_client")
VECTORS = os.path.join(ROOT, "protocol", "vectors")


def c_define(name: str) -> int:
    """The value of scan_client.c's `#define NAME <int>`."""
    source = pathlib.Path(CLIENT_DIR, "scan_client.c").read_text()
    return int(re.search(rf"^#define {name} (\d+)$", source, re.M).group(1))


def compiler() -> str | None:
    """The C compiler the client's Makefile would use ($CC, else cc), else gcc, else None."""
    return shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")


# For the sanitized build: an exit status of its own for a finding (the client's own failures
# exit 1).
SANITIZER_ENV = {"ASAN_OPTIONS": "exitcode=86", "LSAN_OPTIONS": "exitcode=86",
                 "UBSAN_OPTIONS": "exitcode=86:print_stacktrace=1"}


def run_client(scan_client, endpoint: str, vectors=VECTORS, *, timeout: float = 120, env=None):
    """The built client against `endpoint`, checking the vectors in `vectors` first; fails the
    test on any sanitizer report, whatever the client's exit status. A plain build runs with its
    address space capped (cap_memory), so that an allocation gone wild fails rather than
    reserving memory under overcommit."""
    sanitized = os.path.basename(scan_client).endswith("-sanitized")  # ASan reserves terabytes of shadow
    run = subprocess.run([scan_client, endpoint, str(vectors)], capture_output=True, text=True, timeout=timeout,
                         env={**(env or os.environ), **SANITIZER_ENV}, preexec_fn=None if sanitized else cap_memory)
    assert run.returncode != 86 and "Sanitizer" not in run.stderr and "runtime error:" not in run.stderr, \
        f"the sanitized client reported (exit {run.returncode}):\n{run.stderr[-6000:]}"
    return run


def cap_memory() -> None:
    """Caps the address space of the (plain) client about to start at 4 GiB: far more than it
    needs, far less than a count-sized allocation for a huge array would reserve."""
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))


def unavailable() -> str | None:
    """Why the C client cannot be built here, or None."""
    cc = compiler()
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
    """The client built under AddressSanitizer and UndefinedBehaviorSanitizer (the Makefile's
    scan_client-sanitized): its decoder meets live, altered and crafted replies here, and a
    memory error, leak or undefined behaviour fails the test (run_client). Where the compiler
    has no sanitizer runtimes, the plain build, with a warning saying so (in CI, a failure)."""
    require_toolchain()
    build = subprocess.run(["make", "-C", CLIENT_DIR, "scan_client-sanitized"], capture_output=True, text=True)
    if build.returncode == 0:
        return os.path.join(CLIENT_DIR, "scan_client-sanitized")
    reason = f"the sanitized C client did not build, so the plain one is tested:\n{build.stderr[-2000:]}"
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI must build the sanitized C client: {reason}")
    warnings.warn(reason)
    return build_plain_client()


@pytest.fixture(scope="module")
def plain_client() -> str:
    """The client as `make` builds it: for the shim tests, whose shim counts the client's calls
    to free, which ASan's allocator would take instead."""
    require_toolchain()
    return build_plain_client()


def build_plain_client() -> str:
    build = subprocess.run(["make", "-C", CLIENT_DIR], capture_output=True, text=True)
    assert build.returncode == 0, f"make -C examples/c_client failed:\n{build.stdout}\n{build.stderr}"
    return os.path.join(CLIENT_DIR, "scan_client")


@pytest.fixture(params=["sanitized", "plain"])
def either_client(request) -> str:
    """Each build in turn: a crafted reply must be refused cleanly by both, the plain one as
    users build it and the sanitized one with every memory error and leak fatal."""
    return request.getfixturevalue("scan_client" if request.param == "sanitized" else "plain_client")


@pytest.fixture(scope="module")
def endpoints(scan_client, tmp_path_factory):
    """A live server on zmq ipc and tcp; its tcp port is read from `info` over the unix lane."""
    from bridge.client import UnixClient
    from lane_helpers import ServerProcess, ipv6_loopback_missing

    directory = tmp_path_factory.mktemp("c-client")
    unix_path = str(directory / "bridge.sock")
    ipv6 = [] if ipv6_loopback_missing() else ["--zmq", "tcp://[::1]:*"]
    srv = ServerProcess(str(directory), "--unix", unix_path, "--zmq", f"ipc://{directory}/bridge.ipc",
                        "--zmq", "tcp://:*", *ipv6)
    srv.wait_for_path(unix_path)
    with UnixClient(unix_path) as client:
        zmq = [entry.split(" ", 1)[1] for entry in client.info()["transports"] if entry.startswith("zmq ")]
    yield {"ipc": next(e for e in zmq if e.startswith("ipc://")),
           "tcp": next(e for e in zmq if e.startswith("tcp://1")),
           "tcp6": next((e for e in zmq if e.startswith("tcp://[")), None)}
    assert srv.stop() == 0, srv.log()


def vector_names() -> list[str]:
    return [name[:-len(".frame")] for d in (VECTORS, os.path.join(VECTORS, "multipart"))
            for name in os.listdir(d) if name.endswith(".frame")]


def count_vectors() -> int:
    return sum(name.endswith(".frame") for d in (VECTORS, os.path.join(VECTORS, "multipart"))
               for name in os.listdir(d))


@pytest.mark.parametrize("lane", [pytest.param("ipc", id="zmq-ipc"), pytest.param("tcp", id="zmq-tcp"),
                                  pytest.param("tcp6", id="zmq-tcp-ipv6")])
def test_the_c_client_checks_vectors_ping_and_scans(scan_client, endpoints, lane):
    if endpoints[lane] is None:
        from lane_helpers import ipv6_loopback_missing

        pytest.skip(ipv6_loopback_missing())
    run = run_client(scan_client, endpoints[lane], timeout=300)
    print(run.stdout)
    assert run.returncode == 0, run.stderr
    assert f"golden vectors: {count_vectors()} checked" in run.stdout
    for name in vector_names():  # the Mamba-2 ones among them
        assert f"vector {name} " in run.stdout
    for line in ("ping ", "scan inline ", "ssd_scan ", "scan multipart ", "all checks passed"):
        assert line in run.stdout
    assert "kernel_us=" in run.stdout and "ipc " in run.stdout


def test_the_c_client_exits_non_zero_on_a_bad_vector(scan_client, endpoints, tmp_path):
    vectors = tmp_path / "vectors"
    shutil.copytree(VECTORS, vectors)
    frame = vectors / "reply_scan.frame"
    frame.write_bytes(frame.read_bytes()[:-3])  # a valid reply, truncated
    run = run_client(scan_client, endpoints["ipc"], vectors, timeout=300)
    assert run.returncode == 1
    assert "vector reply_scan" in run.stderr and "1 failure(s)" in run.stderr


# -- the client against a server that misbehaves --------------------------------------------------
#
# A proxy between the compiled client and the live server: a ROUTER that forwards each request
# and sends back what a scenario makes of it. The client keeps one request in flight, so the
# proxy serves one at a time. The client's ids: ping 1, scan inline 2, ssd_scan 3, scan multipart 4.

@contextlib.contextmanager
def proxy(server: str, directory, scenario):
    """Yields the endpoint to give the client. `scenario(request_id, frames, forward)` returns
    the messages (lists of frames) to send back; `forward(frames)` is the server's reply to them."""
    import zmq

    context = zmq.Context()
    front, back = context.socket(zmq.ROUTER), context.socket(zmq.DEALER)
    for sock in (front, back):
        sock.setsockopt(zmq.LINGER, 0)
    endpoint = f"ipc://{directory}/proxy.ipc"
    front.bind(endpoint)
    back.connect(server)
    stop = threading.Event()

    def forward(frames):
        back.send_multipart(frames)
        return back.recv_multipart()

    def serve():
        while not stop.is_set():
            if not front.poll(50):
                continue
            peer, *frames = front.recv_multipart()
            for message in scenario(msgpack.unpackb(frames[0])["id"], frames, forward):
                front.send_multipart([peer, *message])

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield endpoint
    finally:
        stop.set()
        thread.join(10)
        front.close()
        back.close()
        context.term()


def run_through(scan_client, endpoints, tmp_path, scenario):
    with proxy(endpoints["ipc"], tmp_path, scenario) as endpoint:
        return run_client(scan_client, endpoint)


def edited(body: bytes, **changes) -> bytes:
    message = msgpack.unpackb(body, strict_map_key=False)
    message.update(changes)
    return msgpack.packb(message)


def test_a_reply_to_another_id_is_dropped_not_taken_for_the_awaited_one(scan_client, endpoints, tmp_path):
    # Before the inline scan's reply, one to ping's id again (as a late reply to a request that
    # timed out would come) and one to an id never sent: both are dropped, and said so.
    def scenario(request_id, frames, forward):
        reply = forward(frames)
        if request_id != 2:
            return [reply]
        return [[edited(reply[0], id=1, result={"pong": True})], [edited(reply[0], id="other")], reply]

    run = run_through(scan_client, endpoints, tmp_path, scenario)
    assert run.returncode == 0, run.stderr
    assert "scan inline: dropped a reply to id 1, not this request's id 2" in run.stderr
    assert "scan inline: dropped a reply to id \"other\", not this request's id 2" in run.stderr
    assert "scan inline " in run.stdout and "all checks passed" in run.stdout


def test_the_ssd_scan_check_fails_when_the_server_clamps_dt_otherwise(scan_client, endpoints, tmp_path):
    # The ssd_scan's dt_limit [0.05, inf] swapped for mamba_ssm's default [0, inf], which clamps
    # nothing, on its way to the server: y then differs from the client's reference.
    def scenario(request_id, frames, forward):
        if request_id != 3:
            return [forward(frames)]
        request = msgpack.unpackb(frames[0])
        assert request["args"]["dt_limit"] == [0.05, float("inf")]
        request["args"]["dt_limit"] = [0.0, float("inf")]
        return [forward([msgpack.packb(request)])]

    run = run_through(scan_client, endpoints, tmp_path, scenario)
    assert run.returncode == 1
    assert "FAIL: ssd_scan: " in run.stderr and " values of y differ from the reference" in run.stderr
    assert "1 failure(s)" in run.stderr and "scan multipart " in run.stdout


def test_the_scan_check_fails_when_y_is_not_finite(scan_client, endpoints, tmp_path):
    # The inline scan's y with one value made NaN and one +inf on its way back: a NaN's error
    # compares false against any tolerance, so a check written `error > tol` lets it pass.
    def scenario(request_id, frames, forward):
        reply = forward(frames)
        if request_id != 2:
            return [reply]
        message = msgpack.unpackb(reply[0])
        data = bytearray(message["result"]["y"]["data"])
        data[0:4] = b"\x00\x00\xc0\x7f"  # f32 NaN
        data[4:8] = b"\x00\x00\x80\x7f"  # f32 +inf
        message["result"]["y"]["data"] = bytes(data)
        return [[msgpack.packb(message), *reply[1:]]]

    run = run_through(scan_client, endpoints, tmp_path, scenario)
    assert run.returncode == 1, run.stdout
    assert "FAIL: scan inline: 2 of " in run.stderr and " values of y differ from the reference" in run.stderr
    assert "1 failure(s)" in run.stderr and "scan multipart " in run.stdout


@pytest.mark.parametrize("request_id, shape", [pytest.param(2, [12, 37, 2], id="scan-reversed"),
                                               pytest.param(2, [888], id="scan-flat"),
                                               pytest.param(3, [2, 9, 3, 4], id="ssd-scan-heads-and-headdim-swapped")])
def test_a_y_of_the_right_values_in_another_shape_fails_the_check(scan_client, endpoints, tmp_path, request_id,
                                                                   shape):
    # Found in review: only y's element count was checked, so a y of x's values in any other
    # shape (a bdl layout's, say) passed.
    def scenario(this_id, frames, forward):
        reply = forward(frames)
        if this_id != request_id:
            return [reply]
        message = msgpack.unpackb(reply[0])
        assert math.prod(message["result"]["y"]["shape"]) == math.prod(shape)
        message["result"]["y"]["shape"] = shape
        return [[msgpack.packb(message), *reply[1:]]]

    run = run_through(scan_client, endpoints, tmp_path, scenario)
    assert run.returncode == 1, run.stdout
    assert f"y's shape is not x's (got [{', '.join(map(str, shape))}])" in run.stderr, run.stderr
    assert "1 failure(s)" in run.stderr


def test_a_reply_with_a_nil_id_is_reported(scan_client, endpoints, tmp_path):
    error = {"code": "decode_error", "message": "body: expected a msgpack map", "detail": {}}
    nil_id = msgpack.packb({"v": 1, "id": None, "ok": False, "error": error})
    run = run_through(scan_client, endpoints, tmp_path, lambda request_id, frames, forward: [[nil_id]])
    assert run.returncode == 1
    assert "ping: a reply with no id, to a request the server could not read" in run.stderr
    assert '"decode_error"' in run.stderr


def test_a_reply_of_too_many_parts_is_read_to_its_end_and_dropped(scan_client, endpoints, tmp_path):
    # The inline scan's reply comes with MAX_PARTS extra frames (one part too many): it fails,
    # and none of its frames is taken for the multipart scan's reply.
    max_parts = c_define("MAX_PARTS")

    def scenario(request_id, frames, forward):
        reply = forward(frames)
        return [reply + [b"x"] * max_parts] if request_id == 2 else [reply]

    run = run_through(scan_client, endpoints, tmp_path, scenario)
    assert run.returncode == 1
    assert f"scan inline: no reply: a message of more than {max_parts} parts" in run.stderr
    assert "1 failure(s)" in run.stderr and "scan multipart " in run.stdout


def test_a_reply_whose_raw_buffers_belong_to_nested_tensors_is_taken_whole(scan_client, endpoints, tmp_path):
    # SPEC §5: a multipart reply carries every tensor of its result as a raw buffer, at any depth.
    # The multipart scan's reply gains a state by name, two tensors a layer for 20 layers, and a
    # frames array: 42 raw buffers beside y's, every one named by a nested tensor.
    def scenario(request_id, frames, forward):
        body, *buffers = forward(frames)
        if request_id != 4:
            return [[body, *buffers]]
        reply = msgpack.unpackb(body)
        state = {}
        for layer in range(20):
            for part in ("conv", "ssm"):
                state[f"layers.{layer}.{part}"] = {"dtype": "u8", "shape": [1], "buf": len(buffers)}
                buffers.append(bytes([layer]))
        reply["result"]["state"] = state
        reply["result"]["frames"] = [{"y": {"dtype": "u8", "shape": [2], "buf": len(buffers)}}]
        buffers.append(b"ab")
        return [[msgpack.packb(reply), *buffers]]

    run = run_through(scan_client, endpoints, tmp_path, scenario)
    assert run.returncode == 0, run.stderr
    assert "scan multipart " in run.stdout and "all checks passed" in run.stdout


def test_a_real_error_reply_with_dtype_and_shape_in_its_detail_is_an_error_reply(scan_client, endpoints, tmp_path):
    # The server's tensor_size_mismatch reply (its detail has dtype and shape keys) is reported
    # as the error it is, not rejected as a malformed tensor.
    lying = msgpack.unpackb((pathlib.Path(VECTORS) / "invalid_lying_shape.frame").read_bytes()[4:])

    def scenario(request_id, frames, forward):
        return [forward([msgpack.packb({**lying, "id": 2})] if request_id == 2 else frames)]

    run = run_through(scan_client, endpoints, tmp_path, scenario)
    assert run.returncode == 1
    assert "scan inline: an error reply: " in run.stderr and '"tensor_size_mismatch"' in run.stderr
    assert '"dtype"=>"f32", "shape"=>[2, 3]' in run.stderr  # msgpack-c prints maps so


@pytest.mark.parametrize("size", [510, 511, 600])
def test_an_error_detail_holding_a_long_printable_bin_is_printed_cut_short(either_client, endpoints, tmp_path, size):
    # msgpack-c leaves its print buffer unterminated where a bin of printable bytes fills it: the
    # client printed the message on past its buffer (the sanitized build's stack-buffer-overflow).
    def scenario(request_id, frames, forward):
        if request_id != 1:
            return [forward(frames)]
        error = {"code": "internal_error", "message": "boom", "detail": {"blob": b"a" * size}}
        return [[msgpack.packb({"v": 1, "id": 1, "ok": False, "error": error})]]

    run = run_through(either_client, endpoints, tmp_path, scenario)
    assert run.returncode == 1, run.stderr
    line = next(line for line in run.stderr.splitlines() if line.startswith("FAIL: ping: an error reply: "))
    assert '"internal_error"' in line and len(line) <= len("FAIL: ping: an error reply: ") + 511, line


def test_an_ok_that_is_not_a_bool_is_a_malformed_reply(scan_client, endpoints, tmp_path):
    def scenario(request_id, frames, forward):
        reply = forward(frames)
        return [[edited(reply[0], ok=1)]] if request_id == 2 else [reply]

    run = run_through(scan_client, endpoints, tmp_path, scenario)
    assert run.returncode == 1
    assert "scan inline: a malformed reply (ok is not a bool)" in run.stderr


def build_waiting_200_ms(scan_client, tmp_path) -> str:
    """The client built to wait 200 ms for a reply, not a minute (sanitized as the fixture's
    build is, or not)."""
    client = tmp_path / os.path.basename(scan_client)
    sanitize = ["-fsanitize=address,undefined", "-fno-sanitize-recover=all"] if scan_client.endswith("-sanitized") else []
    build = subprocess.run([compiler(), "-O1", "-std=c11", *sanitize, "-DREPLY_TIMEOUT_MS=200", "-o", str(client),
                            os.path.join(CLIENT_DIR, "scan_client.c"), "-lzmq", "-lmsgpackc", "-lm"],
                           capture_output=True, text=True)
    assert build.returncode == 0, build.stderr
    return str(client)


def test_a_reply_that_never_comes_is_reported_as_a_timeout(scan_client, endpoints, tmp_path):
    # ZMQ_RCVTIMEO running out is EAGAIN, which zmq_strerror calls "Resource temporarily
    # unavailable": the client said that of a server that never answered. The proxy drops the ping.
    client = build_waiting_200_ms(scan_client, tmp_path)
    run = run_through(client, endpoints, tmp_path, lambda request_id, frames, forward: [])
    assert run.returncode == 1
    assert "FAIL: ping: no reply: none came within 200 ms\n1 failure(s)" in run.stderr


def test_replies_to_other_requests_do_not_stretch_the_wait_for_a_reply(scan_client, endpoints, tmp_path):
    # Each message had the whole timeout to come, so a reply to another id every 50 ms kept the
    # client waiting as long as they came (found in review): the timeout runs from the send.
    client = build_waiting_200_ms(scan_client, tmp_path)
    flood = 60  # 3 s of them

    def scenario(request_id, frames, forward):
        reply = forward(frames)
        for _ in range(flood):
            time.sleep(0.05)
            yield [edited(reply[0], id=999)]

    run = run_through(client, endpoints, tmp_path, scenario)
    assert run.returncode == 1
    # On a loaded box none may have come within the 200 ms (the count then left out): stretched,
    # the wait would have taken most of the flood.
    dropped = re.search(r"FAIL: ping: no reply: none came within 200 ms(?: \((\d+) replies to other requests "
                        r"dropped meanwhile\))?\n", run.stderr)
    assert dropped and int(dropped.group(1) or 0) < flood // 2, run.stderr[-2000:]


# The start of the client's refusal of a tensor's dtype; what came follows it.
UNKNOWN_DTYPE = "unknown dtype: expected f32, f16, bf16, f64, i32, i64 or u8, got"


def _ping_reply_with(**entries) -> bytes:
    """Ping's reply with `entries` (result, timing), as msgpack's own str for raw bytes."""
    return msgpack.packb({"v": 1, "id": 1, "ok": True, **entries}, use_bin_type=False)


# Each map's keys UTF-8 strs, each once, every other str UTF-8, at any depth of result, error and
# timing (SPEC §3), as protocol/decode.py's decode_reply holds a reply: the client took such
# replies (found in review), and printed what it could of a timing map with other keys.
@pytest.mark.parametrize("body, why", [
    pytest.param(_ping_reply_with(result={"pong": True, 5: 1}), "a map key that is not a str", id="int-key-in-result"),
    pytest.param(_ping_reply_with(result={"pong": True}, timing={"server_us": 7, 5: 1}), "a map key that is not a str",
                 id="int-key-in-timing"),
    pytest.param(b"\x84\xa1v\x01\xa2id\x01\xa2ok\xc3\xa6result\x82\xa4pong\xc3\xa4pong\xc3",
                 "a map key given twice", id="key-twice-in-result"),
    pytest.param(_ping_reply_with(result={"pong": True, "a": [{"b": b"\xff"}]}), "a str that is not UTF-8",
                 id="non-utf8-str-in-result"),
    pytest.param(_ping_reply_with(result={"pong": True, b"\xc3\x28": 1}), "a map key that is not UTF-8",
                 id="non-utf8-key"),
    pytest.param(_ping_reply_with(result={"pong": True}, timing={"t": {"shape": [1], "data": 5}}),
                 f"{UNKNOWN_DTYPE} nothing", id="bad-tensor-in-timing"),
    pytest.param(msgpack.packb({"v": 1, "id": b"\xed\xa0\x80", "ok": True, "result": {"pong": True}},
                               use_bin_type=False), "id a str that is not UTF-8", id="surrogate-in-str-id"),
    # The protocol has no ext types (SPEC §3): the other codecs refuse one (found in review).
    pytest.param(_ping_reply_with(result={"pong": True, "e": msgpack.ExtType(1, b"\x00")}),
                 "an ext type (the protocol has none)", id="ext-in-result"),
])
def test_a_reply_with_a_bad_key_or_str_anywhere_is_malformed(scan_client, endpoints, tmp_path, body, why):
    def scenario(request_id, frames, forward):
        reply = forward(frames)
        return [[body]] if request_id == 1 else [reply]

    run = run_through(scan_client, endpoints, tmp_path, scenario)
    assert run.returncode == 1
    assert f"ping: a malformed reply ({why})" in run.stderr, run.stderr


def test_a_timing_key_longer_than_the_client_prints_is_cut_short(scan_client, endpoints, tmp_path):
    # printf's "%.*s" takes its precision as an int: a key of 2 GiB or more made it negative,
    # and the key was read to a NUL past its end (found in review). Keys print cut short.
    limit = c_define("MAX_PRINTED_KEY")
    keys = {"k" * limit: 1, "l" * (limit + 1): 2, "m" * 300: 3}

    def scenario(request_id, frames, forward):
        reply = forward(frames)
        return [[edited(reply[0], timing={**keys, "server_us": 7})]] if request_id == 1 else [reply]

    run = run_through(scan_client, endpoints, tmp_path, scenario)
    assert run.returncode == 0, run.stderr
    ping = next(line for line in run.stdout.splitlines() if line.startswith("ping "))
    expected = f" {'k' * limit}=1.0 {'l' * limit}...=2.0 {'m' * limit}...=3.0 server_us=7.0 | ipc "
    assert expected in ping, ping


def build_driver(tmp_path, source: str) -> str:
    """A C program `source` that includes scan_client.c (its main renamed) to call its functions,
    built strictly; returns its path."""
    require_toolchain()
    (tmp_path / "driver.c").write_text(source)
    build = subprocess.run([compiler(), "-std=c11", "-Wall", "-Wextra", "-Werror", "-I", CLIENT_DIR, "-o",
                            str(tmp_path / "driver"), str(tmp_path / "driver.c"), "-lzmq", "-lmsgpackc", "-lm"],
                           capture_output=True, text=True)
    assert build.returncode == 0, build.stderr
    return str(tmp_path / "driver")


DRIVER = r"""
/* scan_client.c's printed_length at the int boundary a str's 4-byte size crosses. */
#define main scan_client_main
#include "scan_client.c"
#undef main

int main(void) {
    const uint32_t sizes[] = {0, MAX_PRINTED_KEY, MAX_PRINTED_KEY + 1, INT32_MAX, (uint32_t)INT32_MAX + 1, UINT32_MAX};
    for (size_t i = 0; i < sizeof sizes / sizeof *sizes; i++) printf("%u %d\n", sizes[i], printed_length(sizes[i]));
    return 0;
}
"""


SIGNALLED_DRIVER = r"""
/* scan_client.c's ping with a timer's signal every 20 ms meanwhile, as in a program with a
 * profiler or a SIGCHLD handler: libzmq's receive gives EINTR whatever SA_RESTART says. */
#define _POSIX_C_SOURCE 200809L
#include <signal.h>
#include <sys/time.h>
#define main scan_client_main
#include "scan_client.c"
#undef main

static void tick(int signum) { (void)signum; }

int main(int argc, char **argv) {
    (void)argc;
    struct sigaction action = {.sa_handler = tick, .sa_flags = SA_RESTART};
    sigaction(SIGALRM, &action, NULL);
    struct itimerval every = {.it_interval = {0, 20000}, .it_value = {0, 20000}};
    setitimer(ITIMER_REAL, &every, NULL);
    void *context = zmq_ctx_new(), *sock = zmq_socket(context, ZMQ_DEALER);
    int linger = 0;
    zmq_setsockopt(sock, ZMQ_LINGER, &linger, sizeof linger);
    zmq_connect(sock, argv[1]);
    int ok = run_ping(sock);
    zmq_close(sock);
    zmq_ctx_term(context);
    return ok ? 0 : 1;
}
"""


def test_a_signal_during_the_wait_for_a_reply_is_waited_through(endpoints, tmp_path):
    # A signal while waiting failed the request "Interrupted system call" (found in review).
    driver = build_driver(tmp_path, SIGNALLED_DRIVER)

    def scenario(request_id, frames, forward):
        reply = forward(frames)
        time.sleep(0.3)  # fifteen signals meanwhile
        return [reply]

    with proxy(endpoints["ipc"], tmp_path, scenario) as endpoint:
        run = subprocess.run([driver, endpoint], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr


def test_the_printed_length_of_a_key_stays_in_range_past_2_gib(tmp_path):
    driver = build_driver(tmp_path, DRIVER)
    limit = c_define("MAX_PRINTED_KEY")
    printed = dict(line.split() for line in subprocess.run([driver], capture_output=True,
                                                           text=True, check=True).stdout.splitlines())
    assert printed == {"0": "0", str(limit): str(limit), str(limit + 1): str(limit), str(2**31 - 1): str(limit),
                       str(2**31): str(limit), str(2**32 - 1): str(limit)}


PRINT_DRIVER = r"""
/* scan_client.c's print_object on objects holding a str of 2 GiB or more, whose bytes are not
 * there: msgpack-c's printer would read them to a NUL, past the end. */
#define main scan_client_main
#include "scan_client.c"
#undef main

int main(void) {
    char text[128];
    msgpack_object str = {.type = MSGPACK_OBJECT_STR, .via.str = {.size = 3, .ptr = "abc"}};
    print_object(text, sizeof text, &str);
    printf("%s\n", text);
    str.via.str.size = (uint32_t)INT32_MAX + 1;
    print_object(text, sizeof text, &str);
    printf("%s\n", text);
    msgpack_object_kv kv = {.key = {.type = MSGPACK_OBJECT_STR, .via.str = {.size = 7, .ptr = "message"}}, .val = str};
    msgpack_object map = {.type = MSGPACK_OBJECT_MAP, .via.map = {.size = 1, .ptr = &kv}};
    msgpack_object array = {.type = MSGPACK_OBJECT_ARRAY, .via.array = {.size = 1, .ptr = &map}};
    print_object(text, sizeof text, &array);
    printf("%s\n", text);
    return 0;
}
"""


def test_a_reply_holding_a_str_of_2_gib_is_not_printed_past_its_end(tmp_path):
    # Found in review: an error reply (or an id) was printed by msgpack-c, which casts a str's
    # size to an int, and one of 2^31 bytes was read to a NUL, past the body.
    run = subprocess.run([build_driver(tmp_path, PRINT_DRIVER)], capture_output=True, text=True, timeout=30)
    assert run.returncode == 0, run.stderr
    not_printed = "(not printed: it holds a str or bin of 2 GiB or more)"
    assert run.stdout.splitlines() == ['"abc"', not_printed, not_printed]


# msgpack-c allocates room for an array's or map's elements as soon as it reads their count: the
# client refuses a count beyond the bytes left before unpacking (scan_body).
TOO_MANY = "an array or map of more elements than the body has bytes"
HUGE_COUNTS = [
    pytest.param(b"\xdd\xff\xff\xff\xff", id="array32-of-2^32-1"),
    pytest.param(b"\xdf\xff\xff\xff\xff", id="map32-of-2^32-1"),
]


@pytest.mark.parametrize("body", HUGE_COUNTS + [
    pytest.param(b"\x83\xa1v\x01\xa2id\x01\xa6result\xdd\xff\xff\xff\xff", id="array32-as-a-value"),
    pytest.param(b"\x81\xa1a\xde\xff\xff" + b"\x00" * 1000, id="map16-past-the-bytes-left"),
    pytest.param(b"\x82\xa1a\x01\x92\x01", id="array-of-2-with-1-byte-left"),
])
def test_a_reply_announcing_more_elements_than_it_has_bytes_is_refused(either_client, endpoints, tmp_path, body):
    run = run_through(either_client, endpoints, tmp_path, lambda request_id, frames, forward: [[body]])
    assert run.returncode == 1
    assert f"FAIL: ping: a reply that does not decode ({TOO_MANY})\n1 failure(s)" in run.stderr


@pytest.mark.parametrize("levels, why", [
    pytest.param(31, f"values nested more than {c_define('MAX_DEPTH')} levels below args, result, error or timing",
                 id="32-deep"),
    pytest.param(32, "values nested more than msgpack-c's 32 levels, or no memory to unpack them", id="33-deep"),
])
def test_a_reply_nested_deeper_than_msgpack_c_unpacks_is_told_so(scan_client, endpoints, tmp_path, levels, why):
    # msgpack-c unpacks maps and arrays 32 deep at most and answers NOMEM past that: the client
    # called such a reply, one msgpack value, "not one msgpack value".
    body = msgpack.packb({"v": 1, "id": 1, "ok": True, "result": nested(True, levels)})
    run = run_through(scan_client, endpoints, tmp_path, lambda request_id, frames, forward: [[body]])
    assert run.returncode == 1
    assert why in run.stderr, run.stderr


def envelope(*entries) -> bytes:
    """A map of `entries` ((key, value) pairs, repeats kept), packed."""
    return bytes([0x80 | len(entries)]) + b"".join(msgpack.packb(k) + msgpack.packb(v) for k, v in entries)


HELD_TENSOR = "a tensor as result, error or timing, not a map of values"
PONG = [("v", 1), ("id", 1), ("ok", True), ("result", {"pong": True}), ("timing", {"server_us": 1})]
ERROR = {"code": "internal_error", "message": "x", "detail": {}}


def pong(**changes) -> list:
    """ping's reply with `changes` (None: the key left out), keys in the usual order."""
    return [(k, changes.get(k, v)) for k, v in PONG if changes.get(k, v) is not None] + \
           [(k, v) for k, v in changes.items() if k not in dict(PONG) and v is not None]


@pytest.mark.parametrize("entries, why", [
    pytest.param(pong() + [("ok", False), ("id", 99), ("error", ERROR)], "a key given twice", id="ok-and-id-twice"),
    pytest.param(pong() + [("timing", {})], "a key given twice", id="timing-twice"),
    pytest.param(pong(bogus=1), "a key other than v, id, ok, result, error and timing", id="unknown-key"),
    pytest.param(pong() + [(5, 1)], "a key other than v, id, ok, result, error and timing", id="int-key"),
    pytest.param(pong(v=7), "v is not 1", id="v-7"),
    pytest.param(pong(v=True), "v is not 1", id="v-true"),
    pytest.param(pong(v=1.0), "v is not 1", id="v-float"),
    pytest.param(pong(v=None), "no v", id="no-v"),
    pytest.param(pong(id=None), "no id", id="no-id"),
    pytest.param(pong(ok=None), "no ok", id="no-ok"),
    pytest.param(pong(id=""), "id neither nil, a uint nor a non-empty str", id="id-empty-str"),
    pytest.param(pong(id=-1), "id neither nil, a uint nor a non-empty str", id="id-negative"),
    pytest.param(pong(id=1.0), "id neither nil, a uint nor a non-empty str", id="id-float"),
    pytest.param(pong(result=[True]), "result is not a map", id="result-not-a-map"),
    pytest.param(pong(result=None), "result is not a map", id="ok-without-result"),
    pytest.param(pong(ok=False, result=None, error="boom"), "error is not a map", id="error-not-a-map"),
    pytest.param(pong(timing=[]), "timing is not a map", id="timing-not-a-map"),
    # A tensor's map holds no values: the client took these (found in review), and printed the
    # malformed tensor's keys as timing stages.
    pytest.param(pong(result={"dtype": "f32", "shape": [1], "data": bytes(4)}), HELD_TENSOR, id="result-a-tensor"),
    pytest.param(pong(ok=False, result=None, error={"dtype": "u8", "shape": [0], "data": b""}), HELD_TENSOR,
                 id="error-a-tensor"),
    pytest.param(pong(timing={"dtype": "f32", "shape": [1], "data": bytes(3)}), HELD_TENSOR,
                 id="timing-a-malformed-tensor"),
    # The holder ok does not name is read too, as decode_reply reads it (found in review).
    pytest.param(pong(error={"dtype": "zz", "shape": [2], "data": bytes(8)}),
                 'unknown dtype: expected f32, f16, bf16, f64, i32, i64 or u8, got "zz"', id="ok-with-a-malformed-tensor-error"),
    pytest.param(pong(ok=False, result={"dtype": "f32", "shape": [2], "data": bytes(3)}, error=ERROR),
                 "tensor size mismatch: its shape and dtype need 8 bytes, its data holds 3",
                 id="error-with-a-malformed-tensor-result"),
])
def test_a_reply_with_a_malformed_envelope_is_refused(either_client, endpoints, tmp_path, entries, why):
    # As the Python client refuses it (decode_reply), whatever its id. The real reply comes
    # after it, so that a client taking the bad one for another request's ends at once too.
    bad = envelope(*entries)
    with pytest.raises(DecodeError):
        decode_reply(bad)
    run = run_through(either_client, endpoints, tmp_path, lambda request_id, frames, forward: [[bad], forward(frames)])
    assert run.returncode == 1
    assert f"FAIL: ping: a malformed reply ({why})\n1 failure(s)" in run.stderr


@pytest.mark.parametrize("entries", [
    pytest.param(pong(timing=None), id="ok-without-timing"),
    pytest.param([("timing", {}), ("result", {"pong": True}), ("ok", True), ("id", 1), ("v", 1)], id="keys-in-any-order"),
    pytest.param(pong(error="ignored"), id="ok-with-an-error-key"),
])
def test_a_reply_envelope_the_python_client_accepts_is_accepted(scan_client, endpoints, tmp_path, entries):
    good = envelope(*entries)
    decode_reply(good)
    run = run_through(scan_client, endpoints, tmp_path,
                      lambda request_id, frames, forward: [[good] if request_id == 1 else forward(frames)])
    assert run.returncode == 0, run.stderr
    assert "ping " in run.stdout and "all checks passed" in run.stdout


# -- the client's decoder, on vectors of our own ---------------------------------------------------

def run_on_vectors(scan_client, endpoints, tmp_path, extra: dict[str, bytes], kind: str = "reply"):
    """The client run on the golden vectors plus `extra` ({name: .frame bytes}, each a `kind`)."""
    vectors = tmp_path / "vectors"
    shutil.copytree(VECTORS, vectors)
    for name, frame in extra.items():
        (vectors / f"{name}.frame").write_bytes(frame)
        (vectors / f"{name}.json").write_text(f'{{"name": "{name}", "kind": "{kind}"}}')
    return run_client(scan_client, endpoints["ipc"], vectors)


def reply_with_y(y: dict) -> bytes:
    return msgpack.packb({"v": 1, "id": 9, "ok": True, "result": {"y": y}, "timing": {}})


def buf_past_the_end() -> bytes:
    """A reply whose y names buffer 2^64 − 1 and has no buffers; its shape is the body's own
    length in u8, so that a client taking part `buf + 1` (wrapped to 0, the body) finds the
    byte count right."""
    body = b""
    for _ in range(3):
        body = reply_with_y({"dtype": "u8", "shape": [len(body)], "buf": 2**64 - 1})
    return body


TOO_BIG = "shape of more than 2^63 - 1 bytes"


@pytest.mark.parametrize("body, why", [
    pytest.param(reply_with_y({"dtype": "f32", "shape": [2**62, 4], "data": b""}), TOO_BIG,
                 id="element-count-wraps-to-0"),
    pytest.param(reply_with_y({"dtype": "u8", "shape": [2**63], "data": b""}),
                 f"bad dimension 0: expected at most 2^63 - 1, got {2**63}", id="dimension-past-2^63-1"),
    pytest.param(reply_with_y({"dtype": "f64", "shape": [2**61], "data": b""}), TOO_BIG,
                 id="byte-count-past-2^63-1"),
    pytest.param(reply_with_y({"dtype": "f32", "shape": [0, 2**61], "data": b""}), TOO_BIG,
                 id="empty-but-extent-past-2^63-1"),
    pytest.param(reply_with_y({"dtype": "f32", "shape": [2**62, 2**62, 0], "data": b""}), TOO_BIG,
                 id="empty-but-extent-wraps"),
    pytest.param(buf_past_the_end(), f"buf names no raw buffer: the frame has none after its body, got buf {2**64 - 1}",
                 id="buf-2^64-1"),
])
def test_the_decoder_rejects_tensors_whose_sizes_overflow(scan_client, endpoints, tmp_path, body, why):
    run = run_on_vectors(scan_client, endpoints, tmp_path, {"reply_crafted": encode_frame(body)})
    assert run.returncode == 1
    assert f"FAIL: vector reply_crafted (reply): {why}\n1 failure(s)" in run.stderr


def nested(value, levels: int):
    """`value` inside `levels` maps, one in another."""
    for _ in range(levels):
        value = {"a": value}
    return value


VALID_Y = {"dtype": "f32", "shape": [2], "data": bytes(8)}


@pytest.mark.parametrize("result, why", [
    pytest.param({"state": {"layers.0.conv": {"dtype": "f32", "shape": [2], "data": bytes(7)}}},
                 "tensor size mismatch: its shape and dtype need 8 bytes, its data holds 7", id="in-a-map"),
    pytest.param({"frames": [{"y": VALID_Y}, {"y": {"dtype": "f8", "shape": [1], "data": bytes(1)}}]},
                 f'{UNKNOWN_DTYPE} "f8"', id="in-an-array"),
    pytest.param({"frames": [{"y": {"dtype": "f32", "shape": [1], "buf": 0}}]},
                 "buf names no raw buffer: the frame has none after its body, got buf 0", id="buf-in-an-array"),
    pytest.param(nested(VALID_Y, c_define("MAX_DEPTH") + 1),
                 f"values nested more than {c_define('MAX_DEPTH')} levels below args, result, error or timing", id="too-deep"),
])
def test_the_decoder_checks_tensors_at_any_depth(scan_client, endpoints, tmp_path, result, why):
    body = msgpack.packb({"v": 1, "id": 9, "ok": True, "result": result, "timing": {}})
    run = run_on_vectors(scan_client, endpoints, tmp_path, {"reply_crafted": encode_frame(body)})
    assert run.returncode == 1
    assert f"FAIL: vector reply_crafted (reply): {why}\n1 failure(s)" in run.stderr


# A transformers config as model_load sends it: newer ones name the weights' dtype "dtype".
HF_CONFIG = {"model_type": "mamba2", "hidden_size": 2, "num_hidden_layers": 1, "dtype": "float32"}


def model_load(config: dict, weight: dict = VALID_Y) -> bytes:
    return encode_frame(msgpack.packb({"v": 1, "id": 16, "op": "model_load",
                                       "args": {"config": config, "weights": {"norm_f.weight": weight}}}))


@pytest.mark.parametrize("frame, why", [
    pytest.param(model_load(HF_CONFIG), None, id="config-with-a-dtype"),
    pytest.param(model_load({**HF_CONFIG, "extra": {"dtype": "f32", "shape": [2], "data": bytes(7)}}),
                 "tensor size mismatch: its shape and dtype need 8 bytes, its data holds 7",
                 id="tensor-inside-a-config-with-a-dtype"),
    pytest.param(model_load({"d_model": 2, "n_layer": 1}, {"shape": [2], "data": bytes(8)}),
                 f"{UNKNOWN_DTYPE} nothing", id="tensor-without-a-dtype"),
])
def test_a_map_is_a_tensor_by_its_shape_and_data_not_by_a_dtype_key(scan_client, endpoints, tmp_path, frame, why):
    """SPEC §5: a tensor map has a dtype, a shape and data or buf. Found in review, the client
    took any map with a dtype key for one, so model_load's config, a transformers config with
    "dtype": "float32", was refused as an unknown dtype, and a tensor lacking only its dtype was
    looked through unchecked. It now tells a tensor as the Python client does: by its shape and
    data (or buf); any other map is looked through, the tensors inside it checked."""
    run = run_on_vectors(scan_client, endpoints, tmp_path, {"model_load_crafted": frame}, kind="request")
    if why is None:
        assert run.returncode == 0, run.stderr
        assert "vector model_load_crafted " in run.stdout
    else:
        assert run.returncode == 1
        assert f"FAIL: vector model_load_crafted (request): {why}\n1 failure(s)" in run.stderr


@pytest.mark.parametrize("body", HUGE_COUNTS)
def test_a_vector_announcing_more_elements_than_it_has_bytes_is_refused(either_client, endpoints, tmp_path, body):
    run = run_on_vectors(either_client, endpoints, tmp_path, {"reply_crafted": encode_frame(body)})
    assert run.returncode == 1
    assert f"FAIL: vector reply_crafted (reply): {TOO_MANY}\n1 failure(s)" in run.stderr


def test_a_reply_vector_with_a_malformed_envelope_is_refused(scan_client, endpoints, tmp_path):
    body = msgpack.packb({"v": 2, "id": 9, "ok": True, "result": {}, "timing": {}})
    run = run_on_vectors(scan_client, endpoints, tmp_path, {"reply_crafted": encode_frame(body)})
    assert run.returncode == 1
    assert "FAIL: vector reply_crafted (reply): v is not 1\n1 failure(s)" in run.stderr


def test_tensors_as_deep_as_the_decoder_looks_decode(scan_client, endpoints, tmp_path):
    body = msgpack.packb({"v": 1, "id": 9, "ok": True, "result": nested(VALID_Y, c_define("MAX_DEPTH")),
                          "timing": {}})
    run = run_on_vectors(scan_client, endpoints, tmp_path, {"reply_deep": encode_frame(body)})
    assert run.returncode == 0, run.stderr
    assert "vector reply_deep " in run.stdout


def test_a_multipart_vector_of_an_eight_layer_model_state_decodes(scan_client, endpoints, tmp_path):
    # The logits and 16 state tensors: 18 parts, more than the 16 the client once kept.
    state = {f"layers.{layer}.{part}": OutTensor("f32", (1, 2), bytes(8))
             for layer in range(8) for part in ("conv", "ssm")}
    buffers = []
    body = b"".join(encode_reply(9, {"logits": OutTensor("f32", (1, 8), bytes(32)), "state": state},
                                 {"server_us": 1}, buffers=buffers))
    frame = b"".join(encode_frame(part) for part in [body, *buffers])
    run = run_on_vectors(scan_client, endpoints, tmp_path, {"reply_eight_layers": frame})
    assert run.returncode == 0, run.stderr
    assert "vector reply_eight_layers " in run.stdout


def test_a_zero_dimension_makes_no_elements_up_to_the_largest_extent(scan_client, endpoints, tmp_path):
    body = reply_with_y({"dtype": "f32", "shape": [2**61 - 1, 0], "data": b""})
    run = run_on_vectors(scan_client, endpoints, tmp_path, {"reply_empty": encode_frame(body)})
    assert run.returncode == 0, run.stderr
    assert "vector reply_empty " in run.stdout


def test_a_vector_that_is_a_directory_is_refused(scan_client, endpoints, tmp_path):
    # Sized by ftell, a directory named as a vector announced LONG_MAX bytes, and reserving room
    # for them and a NUL overflowed a long: the sanitized client stopped there.
    vectors = tmp_path / "vectors"
    shutil.copytree(VECTORS, vectors)
    (vectors / "reply_odd.frame").mkdir()
    (vectors / "reply_odd.json").write_text('{"name": "reply_odd", "kind": "reply"}')
    run = run_client(scan_client, endpoints["ipc"], vectors)
    assert run.returncode == 1
    assert f"FAIL: vector reply_odd: cannot read {vectors}/reply_odd.frame: not a regular file\n1 failure(s)" \
        in run.stderr


def test_every_vector_is_checked_however_many(scan_client, endpoints, tmp_path):
    reply = (pathlib.Path(VECTORS) / "reply_ping.frame").read_bytes()
    run = run_on_vectors(scan_client, endpoints, tmp_path, {f"reply_ping_{i:03}": reply for i in range(300)})
    assert run.returncode == 0, run.stderr
    assert f"golden vectors: {count_vectors() + 300} checked" in run.stdout


def test_the_client_does_not_build_for_a_big_endian_host(scan_client):
    cc = compiler()
    run = subprocess.run([cc, "-fsyntax-only", "-std=c11", "-U__BYTE_ORDER__", "-D__BYTE_ORDER__=__ORDER_BIG_ENDIAN__",
                          os.path.join(CLIENT_DIR, "scan_client.c")], capture_output=True, text=True)
    assert run.returncode != 0
    assert "scan_client needs a little-endian host" in run.stderr


# -- zero-copy sends: who frees the buffers --------------------------------------------------------

SHIM = r"""
/* LD_PRELOAD'ed into scan_client. SHIM=hold: each frame sent with zmq_msg_send is also kept (a
 * copy sharing its bytes, as ZeroMQ's I/O thread keeps a frame it has not written out yet)
 * until zmq_close; frees of kept bytes are counted, while kept and after. SHIM=fail: the second
 * zmq_msg_send fails (EINTR), and whether the client closes that message is counted. Counts go
 * to stderr at exit. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zmq.h>

extern void __libc_free(void *);
enum { KEPT = 1, RELEASED, FREED_AFTER };
static zmq_msg_t copies[64];
static void *kept[64];
static int state[64], count, sends, freed_while_kept, failed_closed;
static void *failed;

static int mode(const char *name) { const char *m = getenv("SHIM"); return m && strcmp(m, name) == 0; }

void free(void *p) {
    for (int i = 0; p && i < count; i++)
        if (kept[i] == p && state[i] == KEPT) freed_while_kept++;
        else if (kept[i] == p && state[i] == RELEASED) state[i] = FREED_AFTER;
    __libc_free(p);
}

int zmq_msg_send(zmq_msg_t *msg, void *s, int flags) {
    int (*real)(zmq_msg_t *, void *, int) = (int (*)(zmq_msg_t *, void *, int))dlsym(RTLD_NEXT, "zmq_msg_send");
    if (mode("fail") && ++sends == 2) {
        failed = zmq_msg_data(msg);
        errno = EINTR;
        return -1;
    }
    if (mode("hold") && count < 64) {
        zmq_msg_init(&copies[count]);
        zmq_msg_copy(&copies[count], msg);
        kept[count] = zmq_msg_data(msg);
        state[count++] = KEPT;
    }
    return real(msg, s, flags);
}

int zmq_msg_close(zmq_msg_t *msg) {
    int (*real)(zmq_msg_t *) = (int (*)(zmq_msg_t *))dlsym(RTLD_NEXT, "zmq_msg_close");
    if (failed && zmq_msg_data(msg) == failed) failed_closed = 1;
    return real(msg);
}

int zmq_close(void *s) {
    int (*real)(void *) = (int (*)(void *))dlsym(RTLD_NEXT, "zmq_close");
    for (int i = 0; i < count; i++)
        if (state[i] == KEPT) state[i] = RELEASED, zmq_msg_close(&copies[i]);
    return real(s);
}

__attribute__((destructor)) static void report(void) {
    int after = 0;
    for (int i = 0; i < count; i++) after += state[i] == FREED_AFTER;
    if (mode("hold")) fprintf(stderr, "shim: %d kept, %d freed while kept, %d freed after\n", count, freed_while_kept, after);
    if (mode("fail")) fprintf(stderr, "shim: the unsent message %s\n", failed_closed ? "was closed" : "was never closed");
}
"""


@pytest.fixture(scope="module")
def shim(plain_client, tmp_path_factory) -> str:
    directory = tmp_path_factory.mktemp("shim")
    (directory / "shim.c").write_text(SHIM)
    cc = compiler()
    build = subprocess.run([cc, "-shared", "-fPIC", "-o", str(directory / "shim.so"), str(directory / "shim.c"),
                            "-ldl", "-lzmq"], capture_output=True, text=True)
    assert build.returncode == 0, build.stderr
    return str(directory / "shim.so")


def test_zero_copy_buffers_are_freed_by_zeromq_once_it_lets_go_never_before(plain_client, endpoints, shim):
    # The multipart scan sends its 7 inputs zero copy; ZeroMQ keeps them past the reply here.
    env = {**os.environ, "LD_PRELOAD": shim, "SHIM": "hold"}
    run = run_client(plain_client, endpoints["ipc"], env=env)
    assert run.returncode == 0, run.stderr
    assert "shim: 7 kept, 0 freed while kept, 7 freed after" in run.stderr


def test_a_frame_that_fails_to_send_is_closed_and_its_buffer_freed(plain_client, endpoints, shim):
    env = {**os.environ, "LD_PRELOAD": shim, "SHIM": "fail"}
    run = run_client(plain_client, endpoints["ipc"], env=env)
    assert run.returncode == 1
    assert "scan multipart: not sent: Interrupted system call" in run.stderr
    assert "shim: the unsent message was closed" in run.stderr
