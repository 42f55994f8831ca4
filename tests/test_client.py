"""The Python client library (bridge.client) against a stand-in server driven by the test: two
pipes, the test reading each request and writing each reply when it chooses, so that every
ordering is deterministic."""

from __future__ import annotations

import gc
import math
import os
import re
import select
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path

import msgpack
import numpy as np
import pytest

import bridge.client
import protocol
from bridge.client import UNMATCHED_KEPT, BridgeError, FramedClient, PortClient, ServerExited, from_wire, to_wire
from bridge.streams import read_frame, write_all

from waiting import wait_until

REPLY_TIMEOUT_S = 10


class PipeClient(FramedClient):
    def _end_stream(self) -> None:
        os.close(self._writer_fd)
        self._writer_fd = -1


class PipeServer:
    """The far end of a FramedClient over two pipes."""

    def __init__(self):
        requests_r, requests_w = os.pipe()
        replies_r, self.replies_fd = os.pipe()
        self.requests = os.fdopen(requests_r, "rb", buffering=0)
        self.client = PipeClient(os.fdopen(replies_r, "rb", buffering=0), requests_w)

    def read_request(self) -> protocol.Request:
        return self.read_request_and_length()[0]

    def read_request_and_length(self) -> tuple[protocol.Request, int]:
        """The next request and the length of its body."""
        body = read_frame(self.requests)
        assert body is not None, "the client closed its end"
        return protocol.decode_request(body), len(body)

    def reply(self, request_id, result: dict | None = None) -> None:
        write_all(self.replies_fd, protocol.frame_parts(protocol.encode_reply(request_id, result or {}, {})))

    def error(self, request_id, code: str, detail: dict | None = None) -> None:
        write_all(self.replies_fd, protocol.frame_parts(protocol.encode_error(request_id, code, code, detail)))

    def hang_up(self) -> None:
        """End the reply stream: the client's reader sees EOF."""
        if self.replies_fd >= 0:
            os.close(self.replies_fd)
            self.replies_fd = -1

    def close(self) -> None:
        self.hang_up()
        self.client._thread.join(REPLY_TIMEOUT_S)
        self.client._reader.close()
        if self.client._writer_fd >= 0:
            os.close(self.client._writer_fd)
        self.requests.close()


@pytest.fixture
def pipe():
    server = PipeServer()
    yield server
    server.close()


def test_a_reply_with_no_memory_to_hold_it_fails_every_request_at_once(monkeypatch):
    """Whose reply was lost cannot be told: every request in flight fails, and later ones are
    refused, rather than one waiting for ever (the assembler's event escaped the reader as a
    TypeError before; found in review)."""
    assembler = protocol.FrameAssembler

    def short_of_memory(size):
        if size > 64:
            raise MemoryError("no buffer")
        return memoryview(bytearray(size)), None

    monkeypatch.setattr(protocol, "FrameAssembler", lambda limit: assembler(limit, short_of_memory))
    server = PipeServer()
    try:
        lost, waiting = server.client.submit("stats"), server.client.submit("ping")
        server.reply(server.read_request().id, {"pad": "x" * 100})
        for future in (lost, waiting):
            with pytest.raises(ServerExited, match="a reply could not be held"):
                future.result(REPLY_TIMEOUT_S)
        with pytest.raises(ServerExited):
            server.client.submit("ping")
    finally:
        server.close()


def test_a_reply_the_client_fails_on_is_told_with_its_cause_not_as_the_servers_end(monkeypatch, pipe):
    """A reply whose handling raised (a ValueError of the client's own) ended the reader as if
    the server had closed its end: every request failed with "the server closed its end before
    replying", the cause hidden (found in review)."""
    def failing(*args, **kwargs):
        raise ValueError("a tensor this client cannot read")

    monkeypatch.setattr(bridge.client, "result_from_wire", failing)
    lost, waiting = pipe.client.submit("stats"), pipe.client.submit("ping")
    pipe.reply(pipe.read_request().id, {"pad": "x"})
    for future in (lost, waiting):
        with pytest.raises(ServerExited, match="a reply could not be handled \\(ValueError: a tensor this client "
                                               "cannot read\\)") as raised:
            future.result(REPLY_TIMEOUT_S)
        assert isinstance(raised.value.__cause__, ValueError)


def test_a_cancelled_request_leaves_the_client_serving_the_others(pipe):
    cancelled, kept = pipe.client.submit("ping"), pipe.client.submit("ping")
    assert cancelled.cancel()
    first, second = pipe.read_request(), pipe.read_request()
    pipe.reply(first.id, {"which": "cancelled"})
    pipe.reply(second.id, {"which": "kept"})
    assert kept.result(REPLY_TIMEOUT_S).result == {"which": "kept"}
    assert pipe.client._thread.is_alive()
    later = pipe.client.submit("ping")
    pipe.reply(pipe.read_request().id, {"which": "later"})
    assert later.result(REPLY_TIMEOUT_S).result == {"which": "later"}



def test_an_id_in_flight_is_refused_and_the_first_request_keeps_its_reply(pipe):
    first = pipe.client.submit("ping")  # automatic id 1
    with pytest.raises(ValueError, match="request_id: expected an id not in flight, got 1"):
        pipe.client.submit("ping", request_id=1)
    with pytest.raises(ValueError, match="request_id: expected an id not in flight, got 1"):
        pipe.client.send_raw(b"\xc1", request_id=1)  # undecodable: sent under any id
    pipe.reply(pipe.read_request().id, {"which": "first"})
    assert first.result(REPLY_TIMEOUT_S).result == {"which": "first"}
    assert pipe.client._pending == {}


@pytest.mark.parametrize("send", [
    pytest.param(lambda client, request_id: client.submit("ping", request_id=request_id), id="submit"),
    pytest.param(lambda client, request_id: client.send_raw(b"\xc1", request_id=request_id), id="send_raw"),
])
@pytest.mark.parametrize("request_id", [True, False, -1, ""])
def test_a_request_id_that_is_not_an_id_is_refused_as_such(pipe, send, request_id):
    """True == 1 as a dict key: request_id=True while id 1 was in flight was refused as "an id
    in flight" (found in review). SPEC §4 ids are a uint or a non-empty str, never a bool."""
    first, zero = pipe.client.submit("ping", request_id=1), pipe.client.submit("ping", request_id=0)
    with pytest.raises(ValueError, match=f"expected a uint or a non-empty str, got {request_id!r}"):
        send(pipe.client, request_id)
    for future in (first, zero):
        pipe.reply(pipe.read_request().id)
        future.result(REPLY_TIMEOUT_S)
    assert nothing_written(pipe)


def test_a_raw_body_whose_answer_would_not_carry_the_id_it_is_sent_under_is_refused(pipe):
    """Its answer would carry the body's id (or none, for a legacy ExPhil request) and never
    resolve the Future, which held its slot of the cap for ever; one whose id another request
    in flight has took that one's answer (found in review)."""
    first = pipe.client.submit("ping")  # automatic id 1
    with pytest.raises(ValueError, match="request_id: expected 1, the id the body carries, got 'other'"):
        pipe.client.send_raw(b"".join(protocol.encode_request(1, "ping", {})), request_id="other")
    with pytest.raises(ValueError, match="request_id: expected none .* got 7"):
        pipe.client.send_raw(msgpack.packb({"op": "scan"}), request_id=7)
    pipe.reply(pipe.read_request().id, {"which": "first"})
    assert first.result(REPLY_TIMEOUT_S).result == {"which": "first"}
    assert pipe.client._pending == {} and nothing_written(pipe)


def test_an_id_nil_answer_to_a_frame_too_large_sent_without_an_id_is_told_apart_by_length(pipe):
    """Answers with id nil to raw frames whose ids the server cannot read are told apart by the
    order the frames were written; one of those frames refused as too large is answered by
    length instead, and its place in that order is not another's."""
    pipe.client.send_raw(b"\xc1" * 100)
    raw = pipe.client.send_raw(b"\xc1", request_id="raw")
    assert [read_frame(pipe.requests) for _ in range(2)] == [b"\xc1" * 100, b"\xc1"]
    pipe.error(None, "frame_too_large", {"length": 100, "limit": 64})
    pipe.error(None, "decode_error")
    assert raw.result(REPLY_TIMEOUT_S).error["code"] == "decode_error"
    assert [reply.error["code"] for reply in pipe.client.unmatched] == ["frame_too_large"]


def nothing_written(pipe) -> bool:
    return not select.select([pipe.requests], [], [], 0)[0]


def test_automatic_ids_pass_over_ids_callers_chose(pipe):
    chosen = pipe.client.submit("ping", request_id=1)
    automatic = pipe.client.submit("ping")
    assert [pipe.read_request().id for _ in range(2)] == [1, 2]
    pipe.reply(2, {"which": "automatic"})
    pipe.reply(1, {"which": "chosen"})
    assert automatic.result(REPLY_TIMEOUT_S).result == {"which": "automatic"}
    assert chosen.result(REPLY_TIMEOUT_S).result == {"which": "chosen"}


def test_a_request_that_fails_to_encode_leaves_nothing_in_flight(pipe):
    with pytest.raises(TypeError):
        pipe.client.submit("ping", {"bad": object()}, request_id="kept-free")
    assert pipe.client._pending == {}


def test_ipc_is_the_round_trip_less_the_servers_time_and_none_without_it():
    """An error reply may carry no timing: its ipc_us was the whole round trip, the server's
    time counted as transport (found in review)."""
    timed = bridge.client.Reply(1, True, {}, None, {"server_us": 300.0}, round_trip_us=1000.0,
                                client_encode_us=50.0, client_decode_us=25.0)
    assert timed.ipc_us == 625.0
    untimed = bridge.client.Reply(2, False, None, {"code": "deadline_exceeded"}, {}, round_trip_us=1000.0)
    assert untimed.ipc_us is None


def test_a_request_nested_past_what_the_server_reads_is_refused_in_the_caller(pipe):
    """Its answer (id nil, no length: the server could not read its id) named no request, and
    the call waited out its timeout (found in review)."""
    from protocol.encode import MAX_NESTING

    deep = 1
    for _ in range(MAX_NESTING):
        deep = [deep]
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(10_000)  # as an application may: to_wire's own recursion then takes it
    try:
        with pytest.raises(ValueError, match="nested at most"):
            pipe.client.submit("model_load", {"config": {"a": deep}, "weights": {}})
    finally:
        sys.setrecursionlimit(limit)
    assert pipe.client._pending == {} and nothing_written(pipe)


def test_a_request_over_the_frame_limit_gets_the_servers_refusal_and_later_ones_are_not_sent(pipe):
    big = pipe.client.submit("put", {"tensor": np.zeros(2048, np.float32)})
    small = pipe.client.submit("ping")
    (_, put_length), (ping, _) = pipe.read_request_and_length(), pipe.read_request_and_length()
    # As a server with --max-frame-size 4096 answers: id nil, the length it skipped.
    pipe.error(None, "frame_too_large", {"length": put_length, "limit": 4096})
    pipe.reply(ping.id, {"pong": True})
    assert small.result(REPLY_TIMEOUT_S).result == {"pong": True}
    with pytest.raises(BridgeError) as refused:
        big.result(REPLY_TIMEOUT_S).unwrap()
    assert refused.value.code == "frame_too_large" and refused.value.detail["limit"] == 4096
    assert pipe.client._pending == {} and not pipe.client.unmatched
    # Now that the client knows the limit, it refuses such a request without sending it.
    with pytest.raises(BridgeError, match="frame_too_large") as local:
        pipe.client.submit("put", {"tensor": np.zeros(2048, np.float32)})
    assert local.value.detail == {"length": put_length, "limit": 4096}
    pipe.client.submit("ping")
    assert pipe.read_request().op == "ping"
    assert len(pipe.client._pending) == 1


def test_a_tensor_past_what_msgpack_carries_is_a_bridge_error_and_nothing_is_sent(pipe):
    """A tensor of 4 GiB raised protocol.FrameTooLarge, not the BridgeError (frame_too_large) a
    caller catches for a request too large (found in review)."""
    huge = np.zeros(2**32 + 8, np.uint8)  # calloc'd: never touched, no memory taken
    with pytest.raises(BridgeError, match="frame_too_large") as refused:
        pipe.client.submit("put", {"tensor": huge})
    assert refused.value.detail == {"length": 2**32 + 8, "limit": 2**32 - 1}
    assert pipe.client._pending == {} and nothing_written(pipe)


def test_an_id_nil_answer_goes_to_the_request_sent_not_to_an_older_one_not_sent_yet(pipe):
    """An id-nil answer (a frame the server dropped unread) is matched by length to the oldest
    request in flight that long: one registered first but not written yet (its thread between
    encoding and sending) was taken for it (found in review), and the request the server had
    dropped then waited for ever, holding its slot of the cap."""
    client = pipe.client
    checking, go = threading.Event(), threading.Event()
    check_frame_size = client._check_frame_size

    def paused_once(length: int) -> None:  # what submit does between encoding and sending
        if not checking.is_set():
            checking.set()
            go.wait(REPLY_TIMEOUT_S)
        check_frame_size(length)

    client._check_frame_size = paused_once
    submitted = []
    first = threading.Thread(target=lambda: submitted.append(client.submit("ping")))
    first.start()
    assert checking.wait(REPLY_TIMEOUT_S)
    dropped = client.submit("ping")  # as long as the first one
    request, length = pipe.read_request_and_length()
    assert request.id == dropped.request_id
    pipe.error(None, "limit_exceeded", {"limit": "memory", "length": length})
    assert dropped.result(REPLY_TIMEOUT_S).error["code"] == "limit_exceeded"
    go.set()
    first.join(REPLY_TIMEOUT_S)
    (sent_later,) = submitted
    assert pipe.read_request().id == sent_later.request_id
    pipe.reply(sent_later.request_id, {"pong": True})
    assert sent_later.result(REPLY_TIMEOUT_S).ok and client._pending == {}


def test_an_id_nil_answer_waits_until_one_request_of_its_length_is_left(pipe):
    """The server answers a frame it had no memory to hold as it reads it (SPEC §2): an older
    request as long may be running then. The client gave the answer to the oldest one that
    long (found in review): its caller was told limit_exceeded for a request that ran, its
    reply was dropped, and the request the server dropped waited for ever, holding its slot.
    The answer now goes to the one left once the others have their own replies."""
    client = pipe.client
    running, dropped, also_running, also_dropped = (client.submit("ping") for _ in range(4))
    lengths = [pipe.read_request_and_length()[1] for _ in range(4)]
    assert len(set(lengths)) == 1, "the requests must be as long"
    for _ in range(2):
        pipe.error(None, "limit_exceeded", {"limit": "memory", "length": lengths[0]})
    pipe.reply(also_running.request_id, {"pong": True})
    assert also_running.result(REPLY_TIMEOUT_S).result == {"pong": True}
    assert not (running.done() or dropped.done() or also_dropped.done())
    pipe.reply(running.request_id, {"pong": True})
    assert running.result(REPLY_TIMEOUT_S).result == {"pong": True}
    for future in (dropped, also_dropped):
        error = future.result(REPLY_TIMEOUT_S).error
        assert (error["code"], error["detail"]["limit"]) == ("limit_exceeded", "memory")
    assert client._pending == {} and not client.unmatched


@pytest.mark.parametrize("written, dropped", [("request, long raw, short raw", "request"),
                                              ("request, long raw, short raw", "long raw"),
                                              ("long raw, request, short raw", "long raw")])
def test_id_nil_answers_to_frames_dropped_unread_and_to_raw_frames_each_find_their_frame(pipe, written, dropped):
    """The server answers a frame it had no memory to hold (naming its length) and one whose id
    it cannot read (naming nothing) as it reads each, so id-nil answers come in the order their
    frames were written (SPEC §2, §4). With a raw frame whose id the server cannot read as long
    as a request, the client matched the two kinds apart (found in review): the request dropped
    waited for ever, or the raw frame dropped took the next raw frame's answer, which then waited
    for ever; each held its slot of the cap."""
    client = pipe.client
    length = len(b"".join(protocol.encode_request(1, "ping", {})))
    futures = {}
    for name in written.split(", "):
        if name == "request":
            futures[name] = client.submit("ping")
        else:
            futures[name] = client.send_raw(b"\xc1" * (length if name == "long raw" else 1), request_id=name)
    read = [pipe.read_request_and_length()[1] if name == "request" else len(read_frame(pipe.requests))
            for name in futures]
    assert read == [1 if name == "short raw" else length for name in futures]
    for name in futures:  # each answered as the server reads it, but the request that runs
        if name == dropped:
            pipe.error(None, "limit_exceeded", {"limit": "memory", "length": length})
        elif name != "request":
            pipe.error(None, "decode_error")
    if dropped != "request":
        pipe.reply(futures["request"].request_id, {"pong": True})
    for name, future in futures.items():
        expected = "limit_exceeded" if name == dropped else "decode_error" if name != "request" else None
        reply = future.result(REPLY_TIMEOUT_S)
        assert (name, None if reply.ok else reply.error["code"]) == (name, expected)
    assert client._pending == {} and not client.unmatched


def test_an_id_nil_answer_is_for_none_of_the_frames_written_after_it_came(pipe):
    """The server had read the frame it answers: a request as long sent later is not one it may
    be for, or, with requests that long sent on and on, it would wait for ever."""
    client = pipe.client
    running, dropped = client.submit("ping"), client.submit("ping")
    length = [pipe.read_request_and_length()[1] for _ in range(2)][-1]
    pipe.error(None, "limit_exceeded", {"limit": "memory", "length": length})
    wait_until(lambda: client._nil_answers, "the answer was never read", timeout=REPLY_TIMEOUT_S)
    later = client.submit("ping")
    assert pipe.read_request_and_length()[1] == length
    pipe.reply(running.request_id, {"pong": True})
    assert dropped.result(REPLY_TIMEOUT_S).error["code"] == "limit_exceeded"
    pipe.reply(later.request_id, {"pong": True})
    assert running.result(REPLY_TIMEOUT_S).ok and later.result(REPLY_TIMEOUT_S).ok and client._pending == {}


def test_info_tells_the_client_the_frame_limit(pipe):
    answered = threading.Thread(target=lambda: pipe.reply(pipe.read_request().id, {"limits": {"max_frame_size": 100}}))
    answered.start()
    pipe.client.info()
    answered.join()
    with pytest.raises(BridgeError, match="exceeds the server's limit of 100 bytes"):
        pipe.client.submit("put", {"tensor": np.zeros(100, np.uint8)})


def test_callers_waiting_when_the_server_turns_the_connection_away_get_overloaded(pipe):
    waiting = pipe.client.submit("ping")
    pipe.error(None, "overloaded", {"limit": 1})
    pipe.hang_up()
    with pytest.raises(BridgeError) as turned_away:
        waiting.result(REPLY_TIMEOUT_S)
    assert turned_away.value.code == "overloaded" and turned_away.value.detail == {"limit": 1}


def test_a_cancel_the_server_turned_away_first_neither_raises_nor_takes_the_turn_aways_telling(pipe):
    """cancel() (and so a request() whose timeout passed) writing its cancel after the server
    turned the connection away, before the reader saw the end: the write failed and cancel()
    raised BridgeError overloaded, not TimeoutError's path, and took the one telling of it from
    the next request (found in review)."""
    waiting = pipe.client.submit("ping")
    pipe.read_request()
    pipe.error(None, "overloaded", {"limit": 1})
    wait_until(lambda: pipe.client._turned_away is not None, "the turn-away was not read", REPLY_TIMEOUT_S)
    pipe.requests.close()  # the server's end, with the reply stream still open: the cancel's write fails
    assert pipe.client.cancel(waiting) is True
    with pytest.raises(BridgeError) as refused:
        pipe.client.submit("ping")
    assert refused.value.code == "overloaded" and refused.value.detail == {"limit": 1}
    pipe.hang_up()
    assert waiting.cancelled()


@pytest.mark.parametrize("op, args, result, free_op, freed", [
    pytest.param("put", {"tensor": np.zeros(2, np.float32)}, {"handle": "h7"}, "free", {"handle": "h7"}, id="put"),
    pytest.param("session_open", {"batch": 1, "dim": 2, "state": 2}, {"session": "s7"}, "session_close",
                 {"session": "s7"}, id="session_open"),
    pytest.param("session_snapshot", {"session": "s1"}, {"snapshot": "p7"}, "snapshot_free", {"snapshot": "p7"},
                 id="session_snapshot"),
    pytest.param("model_load", {"path": "m"}, {"model": "m7"}, "model_free", {"model": "m7"}, id="model_load"),
])
def test_what_a_request_given_up_on_created_anyway_is_freed(pipe, op, args, result, free_op, freed):
    """A request that started before its cancel came runs to its end: its late reply names what
    it created, which nobody else learns. The client dropped it, so a caller timing requests
    out leaked handles, sessions, snapshots or models until limit_exceeded (found in review);
    it now frees each."""
    future = pipe.client.submit(op, args)
    request = pipe.read_request()
    assert pipe.client.cancel(future)
    cancel = pipe.read_request()
    assert (cancel.op, cancel.args["id"]) == ("cancel", request.id)
    pipe.reply(cancel.id, {"cancelled": False})  # it had started
    pipe.reply(request.id, result)
    assert select.select([pipe.requests], [], [], REPLY_TIMEOUT_S)[0], f"no {free_op} was sent"
    free = pipe.read_request()
    assert (free.op, free.args) == (free_op, freed)
    pipe.reply(free.id, {"freed": True})


def test_an_error_reply_to_a_request_given_up_on_frees_nothing(pipe):
    future = pipe.client.submit("session_open", {"batch": 1, "dim": 2, "state": 2})
    request = pipe.read_request()
    assert pipe.client.cancel(future)
    pipe.reply(pipe.read_request().id, {"cancelled": True})
    pipe.error(request.id, "cancelled")
    ping = pipe.client.submit("ping")
    assert pipe.read_request().op == "ping"  # the next request, not a session_close
    pipe.reply(ping.request_id)
    ping.result(REPLY_TIMEOUT_S)


def test_a_blocking_call_in_a_done_callback_is_refused_not_left_to_freeze_the_client(pipe):
    """A done callback runs on the thread that reads the replies: a request() there waited for
    a reply only that thread could read, and every reply waited out its timeout (found in
    review)."""
    raised = []
    first = pipe.client.submit("ping")

    def callback(_):
        try:
            pipe.client.request("ping", timeout=REPLY_TIMEOUT_S)
        except RuntimeError as exc:
            raised.append(exc)

    first.add_done_callback(callback)
    pipe.reply(pipe.read_request().id)
    first.result(REPLY_TIMEOUT_S)
    wait_until(lambda: raised, "the callback's request was not refused", REPLY_TIMEOUT_S)
    assert "reader thread" in str(raised[0])


def test_a_done_callbacks_submit_leaves_the_reader_reading_while_it_is_written(pipe):
    """submit() is what a done callback may call, on the thread that reads the replies; found in
    review, it wrote there, and a request larger than the pipe waited for a server that read
    nothing while its own replies waited for that thread (SPEC §7, stdio): the client stopped
    for good. The write goes to a writer thread: a reply larger than the pipe, written while
    the callback's request waits unread, reaches its caller, and the request then goes whole."""
    big = np.arange(1 << 20, dtype=np.float32)  # 4 MiB: many times what a pipe holds
    stats, first = pipe.client.submit("stats"), pipe.client.submit("ping")
    stats_id, ping_id = pipe.read_request().id, pipe.read_request().id
    submitted = []
    first.add_done_callback(lambda _: submitted.append(pipe.client.submit("put", {"tensor": big})))
    pipe.reply(ping_id)
    answering = threading.Thread(target=pipe.reply, args=(stats_id, {"pad": "x" * (4 << 20)}), daemon=True)
    try:
        wait_until(lambda: submitted, "the callback's submit did not return", REPLY_TIMEOUT_S)
        answering.start()
        assert stats.result(REPLY_TIMEOUT_S).ok, "the reply written meanwhile did not arrive"
    finally:
        put = pipe.read_request()  # read in any case: a write stuck on the reader thread ends
    assert put.op == "put" and np.array_equal(np.frombuffer(put.args["tensor"].data, np.float32), big)
    pipe.reply(put.id, {"handle": "h1"})
    assert submitted[0].result(REPLY_TIMEOUT_S).result == {"handle": "h1"}
    answering.join(REPLY_TIMEOUT_S)


def test_a_server_that_exits_during_start_up_is_reported_with_its_status(tmp_path):
    """A refused flag (a --model-dir that does not exist) told only "the server closed its end
    before replying" (found in review): the caller learns the exit status and where the reason is."""
    with pytest.raises(ServerExited, match="exited with status 2 during start-up"):
        PortClient(["--device", "cpu", "--model-dir", str(tmp_path / "missing")], stderr=subprocess.DEVNULL)


def test_a_request_held_after_submit_sends_the_arrays_as_they_were_then(pipe):
    """A request held back (past the cap `info()` read) is written after submit() returned;
    found in review, it kept views of the caller's arrays, and a buffer the caller reused
    meanwhile went out changed. Held, it keeps copies of what it sends."""
    pipe.client.max_in_flight = 2  # one on the wire, one slot kept for cancels
    first = pipe.client.submit("ping")
    h0 = np.full((1, 64, 64), 1.0, np.float32)  # 16 KiB: sent as a view of the array
    held = pipe.client.submit("session_open", {"batch": 1, "dim": 64, "state": 64, "h0": h0})
    assert len(pipe.client._held) == 1
    h0[:] = 7.0
    pipe.reply(pipe.read_request().id)
    first.result(REPLY_TIMEOUT_S)
    request = pipe.read_request()
    assert request.op == "session_open"
    assert np.unique(np.frombuffer(request.args["h0"].data, np.float32)).tolist() == [1.0]
    pipe.reply(request.id, {"session": "s1"})
    held.result(REPLY_TIMEOUT_S)


def test_a_request_held_with_a_deadline_sends_the_arrays_as_they_were_then(pipe):
    """A held request with a deadline is encoded anew from its arguments when it is released:
    their arrays must be copies too (found by mutating the fix above: nothing failed)."""
    pipe.client.max_in_flight = 2
    first = pipe.client.submit("ping")
    h0 = np.full((1, 64, 64), 1.0, np.float32)
    held = pipe.client.submit("session_open", {"batch": 1, "dim": 64, "state": 64, "h0": h0}, deadline_s=30)
    assert len(pipe.client._held) == 1
    h0[:] = 7.0
    pipe.reply(pipe.read_request().id)
    first.result(REPLY_TIMEOUT_S)
    request = pipe.read_request()
    assert np.unique(np.frombuffer(request.args["h0"].data, np.float32)).tolist() == [1.0]
    pipe.reply(request.id, {"session": "s1"})
    held.result(REPLY_TIMEOUT_S)


def test_a_held_requests_arrays_inside_lists_are_copies_too(pipe):
    """A frame's arrays lie in a list of maps (session_open's frames): held, they are copied as
    a top-level argument's are (found by mutating the fix: nothing failed)."""
    pipe.client.max_in_flight = 2
    first = pipe.client.submit("ping")
    x = np.full((1, 64, 64), 1.0, np.float32)
    held = pipe.client.submit("session_open", {"batch": 1, "frames": [{"op": "model_step", "args": {"embeds": x}}]},
                              deadline_s=30)
    x[:] = 7.0
    pipe.reply(pipe.read_request().id)
    first.result(REPLY_TIMEOUT_S)
    request = pipe.read_request()
    sent = request.args["frames"][0].args["embeds"]
    assert np.unique(np.frombuffer(sent.data, np.float32)).tolist() == [1.0]
    pipe.reply(request.id, {"session": "s1"})
    held.result(REPLY_TIMEOUT_S)


@pytest.mark.parametrize("call, op, result", [
    pytest.param(lambda c, t: c.load_model("m", timeout=t), "model_load", {"model": "m1"}, id="load_model"),
    pytest.param(lambda c, t: bridge.client.RemoteModel(c, {"model": "m1"}).open_session(timeout=t), "session_open",
                 {"session": "s1"}, id="open_session"),
    pytest.param(lambda c, t: bridge.client.ModelSession(c, "s1", 1).forward(np.zeros((1, 3), np.int64), timeout=t),
                 "model_forward", {"logits": to_wire(np.zeros((1, 3, 2), np.float32))}, id="forward"),
    pytest.param(lambda c, t: bridge.client.ModelSession(c, "s1", 1).snapshot(timeout=t), "session_snapshot",
                 {"snapshot": "p1"}, id="snapshot"),
    pytest.param(lambda c, t: bridge.client.ModelSession(c, "s1", 1).restore_with_frames("p1", [], timeout=t),
                 "session_restore", {"frames": []}, id="restore_with_frames"),
    pytest.param(lambda c, t: bridge.client.ModelSession(c, "s1", 1).fork(timeout=t), "session_fork",
                 {"session": "s2"}, id="fork"),
])
def test_the_model_api_takes_a_timeout_that_is_the_requests_deadline(pipe, call, op, result):
    """A large checkpoint's load or a long prefill outlasted the fixed 60 s the model API gave
    every call but step (found in review): each takes `timeout`, its deadline on the server."""
    done = []
    caller = threading.Thread(target=lambda: done.append(call(pipe.client, 300.0)))
    caller.start()
    request = pipe.read_request()
    assert request.op == op and request.deadline_us == 300_000_000
    pipe.reply(request.id, result)
    caller.join(REPLY_TIMEOUT_S)
    assert done, "the call did not return"


def test_a_forwards_lengths_given_as_a_list_or_tuple_go_as_an_integer_tensor(pipe):
    """The docstring's "[batch] ints" taken at its word, a list, went as a msgpack array the
    server refuses (found in review; the Elixir client takes a list)."""
    done = []
    session = bridge.client.ModelSession(pipe.client, "s1", 2)
    caller = threading.Thread(target=lambda: done.append(session.forward(np.zeros((2, 3), np.int64), lengths=(1, 3))))
    caller.start()
    request = pipe.read_request()
    lengths = request.args["lengths"]
    assert (lengths.dtype, tuple(lengths.shape)) == ("i64", (2,)), lengths
    assert np.frombuffer(lengths.data, np.int64).tolist() == [1, 3]
    pipe.reply(request.id, {"logits": to_wire(np.zeros((2, 3, 2), np.float32))})
    caller.join(REPLY_TIMEOUT_S)
    assert done, "the call did not return"


def test_a_forward_of_neither_or_both_inputs_says_which_came(pipe):
    session = bridge.client.ModelSession(pipe.client, "s1", 2)
    with pytest.raises(ValueError, match="exactly one of tokens and embeds, got neither$"):
        session.forward()
    with pytest.raises(ValueError, match="got tokens and embeds$"):
        session.forward(np.zeros((2, 3), np.int64), embeds=np.zeros((2, 3, 4), np.float32))
    assert nothing_written(pipe)


def test_a_lengths_list_takes_every_i64_up_to_its_bounds():
    assert bridge.client.integer_list([-(2**63), 2**63 - 1, np.int64(3)], "lengths").tolist() == [-(2**63), 2**63 - 1, 3]


@pytest.mark.parametrize("lengths, refusal", [
    pytest.param([3, 1.5], r"\[1\]: expected an int, got float 1.5$", id="a-float-not-truncated"),
    pytest.param([True, 2], r"\[0\]: expected an int, got bool True$", id="a-bool-not-taken-for-one"),
    pytest.param([2**63, 1], r"\[0\]: expected an int within i64", id="past-i64-not-wrapped"),
    pytest.param([-(2**63) - 1, 1], r"\[0\]: expected an int within i64", id="below-i64-not-wrapped"),
    pytest.param([*range(100_000), 1.5], r"\[100000\]: expected an int, got float 1.5$", id="long-not-echoed"),
])
def test_a_forwards_lengths_list_that_is_not_i64_ints_is_refused(pipe, lengths, refusal):
    """numpy took [True, 2] for [1, 2] and wrapped 2**63 to -2**63 (found in review)."""
    session = bridge.client.ModelSession(pipe.client, "s1", 2)
    with pytest.raises(ValueError, match="lengths" + refusal):
        session.forward(np.zeros((2, 3), np.int64), lengths=lengths)
    assert nothing_written(pipe)


def test_the_scan_methods_take_their_timeout_by_name_only(pipe):
    """A mamba_ssm call's sixth positional (chunk_size, D) became the timeout and the server's
    deadline, silently (found in review)."""
    x = np.zeros((1, 4, 2, 2), np.float32)
    with pytest.raises(TypeError):
        pipe.client.ssd_scan(x, x[..., 0], np.zeros(2, np.float32), x, x, 4)
    assert nothing_written(pipe)


def test_a_rollback_frame_asking_for_its_state_by_an_alias_gets_it(pipe):
    """restore_with_frames looked for return_state only: a frame asking by mamba_ssm's name
    had its state dropped from what it returned (found in review)."""
    done = []
    session = bridge.client.ModelSession(pipe.client, "s1", 1)
    frame = ("model_step", {"tokens": np.zeros(1, np.int64), "return_last_state": True})
    caller = threading.Thread(target=lambda: done.append(session.restore_with_frames("p1", [frame])))
    caller.start()
    request = pipe.read_request()
    state = {"layers.0.ssm": to_wire(np.ones((1, 2), np.float32))}
    pipe.reply(request.id, {"frames": [{"logits": to_wire(np.zeros((1, 3), np.float32)), "state": state}]})
    caller.join(REPLY_TIMEOUT_S)
    ((out, got_state),) = done[0]
    assert out.shape == (1, 3) and set(got_state) == {"layers.0.ssm"}


@pytest.mark.parametrize("timeout, deadline_us", [
    pytest.param(math.inf, None, id="infinity-is-none"),
    pytest.param(1e20, 2**64 - 1, id="past-uint64-is-the-longest"),
])
def test_any_timeout_a_caller_may_mean_is_a_deadline_the_server_takes(pipe, timeout, deadline_us):
    """`request(timeout=math.inf)` raised OverflowError, and a timeout past what deadline_us
    holds one from the encoder (found in review): both mean a wait for ever, no deadline to
    speak of."""
    done = []
    caller = threading.Thread(target=lambda: done.append(pipe.client.request("ping", timeout=timeout)))
    caller.start()
    request = pipe.read_request()
    assert request.deadline_us == deadline_us
    pipe.reply(request.id, {"pong": True})
    caller.join(REPLY_TIMEOUT_S)
    assert done and done[0].ok


@pytest.mark.parametrize("deadline_s", [-1.0, math.nan, -math.inf], ids=["negative", "nan", "minus-infinity"])
def test_a_deadline_no_request_can_have_is_refused_before_sending(pipe, deadline_s):
    with pytest.raises(ValueError, match=f"deadline: expected seconds >= 0, infinity or None, got {deadline_s!r}"):
        pipe.client.submit("ping", deadline_s=deadline_s)
    ping = pipe.client.submit("ping")  # nothing of the refused one was sent or kept in flight
    request = pipe.read_request()
    assert request.op == "ping" and request.deadline_us is None
    pipe.reply(request.id, {"pong": True})
    assert ping.result(REPLY_TIMEOUT_S).ok


def test_a_bridge_error_survives_pickling_as_a_process_pool_sends_it():
    import copy
    import pickle

    error = BridgeError("unknown_session", "args.session: no such session", {"field": "args.session"}, {"server_us": 3})
    error.add_note("while stepping frame 7")
    for again in (pickle.loads(pickle.dumps(error)), copy.copy(error)):
        assert (again.code, again.message, again.detail, again.timing) == (
            error.code, error.message, error.detail, error.timing)
        assert str(again) == str(error) and again.__notes__ == ["while stepping frame 7"]


def test_replies_to_nothing_in_flight_are_kept_only_up_to_a_bound(pipe):
    for index in range(UNMATCHED_KEPT + 5):
        pipe.reply(f"stray-{index}")
    ping = pipe.client.submit("ping")
    pipe.reply(pipe.read_request().id)
    ping.result(REPLY_TIMEOUT_S)
    assert len(pipe.client.unmatched) == UNMATCHED_KEPT
    assert pipe.client.unmatched[-1].id == f"stray-{UNMATCHED_KEPT + 4}"


class ResetAfter:
    """A reader that, once `start` is set, yields `data`, then fails as a unix socket that the
    server closed with requests unread in it does."""

    def __init__(self, data: bytes, start: threading.Event):
        self.data = data
        self.start = start

    def readinto(self, view) -> int:
        self.start.wait(REPLY_TIMEOUT_S)
        if not self.data:
            raise ConnectionResetError(104, "Connection reset by peer")
        count = min(len(view), len(self.data))
        view[:count] = self.data[:count]
        self.data = self.data[count:]
        return count


def test_a_connection_reset_after_overloaded_fails_the_callers_with_overloaded(monkeypatch):
    reader_failures = []
    monkeypatch.setattr(threading, "excepthook", reader_failures.append)
    overloaded = protocol.encode_frame(b"".join(protocol.encode_error(None, "overloaded", "busy", {"limit": 1})))
    requests_r, requests_w = os.pipe()
    in_flight = threading.Event()
    client = FramedClient(ResetAfter(overloaded, in_flight), requests_w)
    try:
        waiting = client.submit("ping")
        in_flight.set()
        with pytest.raises(BridgeError, match="overloaded"):
            waiting.result(REPLY_TIMEOUT_S)
        client._thread.join(REPLY_TIMEOUT_S)
        assert reader_failures == []
    finally:
        os.close(requests_r)
        os.close(requests_w)


def test_a_port_client_whose_server_never_answers_its_handshake_stops_that_server(tmp_path):
    pid_file = tmp_path / "server.pid"
    silent_python = tmp_path / "python"
    # `python -m bridge ...` becomes the silent server, its pid noted.
    silent_python.write_text(f"#!/bin/sh\necho $$ > {pid_file}\nexec {shlex.join(SILENT_SERVER)}\n")
    silent_python.chmod(0o755)
    with pytest.raises(FutureTimeout):
        PortClient(python=str(silent_python), start_timeout=0.2)
    with pytest.raises(ProcessLookupError):
        os.kill(int(pid_file.read_text()), 0)


def test_a_port_client_stopped_while_it_sets_up_stops_the_server_it_spawned(tmp_path, monkeypatch):
    """A stop signal's SystemExit (the bench's SIGTERM) between the spawn and the readiness
    handshake left the server running with nobody to stop it (found by a CI run: it outlived
    the bench)."""
    pid_file = tmp_path / "server.pid"
    silent_python = tmp_path / "python"
    silent_python.write_text(f"#!/bin/sh\necho $$ > {pid_file}\nexec {shlex.join(SILENT_SERVER)}\n")
    silent_python.chmod(0o755)

    def stopped_while_setting_up(*args, **kwargs):
        wait_until(pid_file.exists, "the server did not start")
        raise SystemExit(128 + signal.SIGTERM)

    spawned = []
    spawn = bridge.client.spawn
    monkeypatch.setattr(bridge.client, "spawn", lambda *args, **kwargs: spawned.append(spawn(*args, **kwargs)) or
                        spawned[-1])
    monkeypatch.setattr(FramedClient, "__init__", stopped_while_setting_up)
    with pytest.raises(SystemExit):
        PortClient(python=str(silent_python))
    with pytest.raises(ProcessLookupError):
        os.kill(int(pid_file.read_text()), 0)
    assert spawned[0].stdout.closed  # not left to the collector (a ResourceWarning, found in review)


def test_a_stop_signal_while_the_server_is_spawned_stops_it(tmp_path, monkeypatch):
    """A stop signal whose handler raises (the bench's SIGTERM) coming while Popen still runs,
    after its fork, raised out of Popen: the server went on starting with nobody to stop it, and
    read the end of its stdin only once started (found by a CI run: it outlived the bench)."""
    pid_file = tmp_path / "server.pid"
    slow_python = tmp_path / "python"
    # `python -m bridge ...` becomes a server that takes a while to start, its pid noted.
    slow_python.write_text(f"#!/bin/sh\necho $$ > {pid_file}\nexec {shlex.join(SLOW_STARTING_SERVER)}\n")
    slow_python.chmod(0o755)

    spawned = []

    class SignalledWhileSpawning(subprocess.Popen):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            spawned.append(self)
            wait_until(pid_file.exists, "the server did not start")
            signal.raise_signal(signal.SIGTERM)

    def stop(signum, frame):
        raise SystemExit(128 + signum)

    monkeypatch.setattr(subprocess, "Popen", SignalledWhileSpawning)
    previous = signal.signal(signal.SIGTERM, stop)
    try:
        with pytest.raises(SystemExit):
            PortClient(python=str(slow_python))
    finally:
        signal.signal(signal.SIGTERM, previous)
    with pytest.raises(ProcessLookupError):
        os.kill(int(pid_file.read_text()), 0)
    assert spawned[0].stdout.closed


# A stand-in for a v1 server older than deadline_us (SPEC §4): it refuses the key, as those did,
# and answers anything else with the op and the envelope's keys it was sent.
BEFORE_DEADLINES = [sys.executable, "-c", """
import msgpack, sys
from bridge.streams import read_frame, write_all
import protocol
while (frame := read_frame(sys.stdin.buffer.raw)) is not None:
    request = msgpack.unpackb(frame)
    if "deadline_us" in request:
        error = {"code": "invalid_request", "message": "deadline_us: expected only the envelope keys v, id, op, "
                 "args, got unknown key 'deadline_us'", "detail": {"field": "deadline_us"}}
        reply = {"v": 1, "id": request["id"], "ok": False, "error": error}
    else:
        reply = {"v": 1, "id": request["id"], "ok": True, "result": {"op": request["op"], "keys": sorted(request)}}
    write_all(1, protocol.frame_parts([msgpack.packb(reply)]))
"""]


def test_a_server_older_than_deadlines_is_sent_none_and_the_call_goes_again():
    """Every call sent its timeout as deadline_us, which v1 servers before it refuse as an
    unknown envelope key: against one, each call failed, ping too (found in review). The
    refused call goes again without it, and the connection's later requests carry none."""
    with PortClient(command=BEFORE_DEADLINES) as client:
        assert client.call("ping") == {"op": "ping", "keys": ["args", "id", "op", "v"]}
        later = client.submit("stats", deadline_s=5.0)
        assert later.result(REPLY_TIMEOUT_S).unwrap()["keys"] == ["args", "id", "op", "v"]
        assert not client.unmatched


# A stand-in for a server: answers "bad" invalid_request naming args.x, and anything else with
# whether it carried deadline_us and how many "bad" it has seen.
REFUSES_AN_ARGUMENT = [sys.executable, "-c", """
import struct, sys, msgspec
bad = 0
while len(head := sys.stdin.buffer.read(4)) == 4:
    request = msgspec.msgpack.decode(sys.stdin.buffer.read(struct.unpack(">I", head)[0]))
    if request["op"] == "bad":
        bad += 1
        outcome = {"ok": False, "error": {"code": "invalid_request", "message": "args.x: expected an int",
                                          "detail": {"field": "args.x", "expected": "an int", "got": "a str"}}}
    else:
        outcome = {"ok": True, "result": {"deadline_us": "deadline_us" in request, "bad_seen": bad}, "timing": {}}
    body = msgspec.msgpack.encode({"v": 1, "id": request["id"], **outcome})
    sys.stdout.buffer.write(struct.pack(">I", len(body)) + body)
    sys.stdout.buffer.flush()
"""]


def test_a_refusal_of_another_field_keeps_deadlines_and_is_not_sent_again():
    with PortClient(command=REFUSES_AN_ARGUMENT) as client:
        assert client.call("ping") == {"deadline_us": True, "bad_seen": 0}
        assert client.request("bad").error["code"] == "invalid_request"
        assert client.call("ping") == {"deadline_us": True, "bad_seen": 1}


# A stand-in for `python -m bridge` still importing when its stdin closes: it reads it only later.
SLOW_STARTING_SERVER = [sys.executable, "-c", "import sys, time; time.sleep(3); sys.stdin.buffer.read()"]

# A stand-in for `python -m bridge`: reads its stdin to the end, answering nothing.
SILENT_SERVER = [sys.executable, "-c", "import sys; sys.stdin.buffer.read()"]


def test_a_port_client_dropped_without_close_is_collected_and_its_server_stops():
    """...and is waited for, its stdout closed: it was left a zombie, the pipe open (found in
    review: ResourceWarnings, and under -W error never reaped)."""
    client = PortClient(command=SILENT_SERVER)
    server, collected = client.proc, weakref.ref(client)
    waiting = client.submit("ping")
    del client
    gc.collect()
    assert collected() is None
    wait_until(lambda: server.returncode is not None and server.stdout.closed, "the dropped client's server "
               "waited for and its stdout closed", timeout=REPLY_TIMEOUT_S)
    assert server.returncode == 0
    with pytest.raises(ServerExited, match="dropped without close"):
        waiting.result(REPLY_TIMEOUT_S)


# Stand-ins for `python -m bridge`: one that drains for seconds once its stdin ends; one that
# answers its one request, once its stdin ends, with more than a pipe holds, then exits.
DRAINS_FOR_SECONDS = [sys.executable, "-c", "import sys, time; sys.stdin.buffer.read(); time.sleep(5)"]
ANSWERS_MORE_THAN_A_PIPE_HOLDS = [sys.executable, "-c", """
import sys, protocol
from bridge.streams import read_frame, write_all
request = protocol.decode_request(read_frame(sys.stdin.buffer.raw))
sys.stdin.buffer.read()
for _ in range(4):
    write_all(1, protocol.frame_parts(protocol.encode_reply(request.id, {"pad": b"x" * (1 << 20)}, {})))
"""]


def test_dropping_a_port_client_waits_for_nothing_and_its_server_finishes_its_replies():
    """The drop ends the stream; what it leaves is closed by the reader once its server is done:
    the collecting thread does not wait out the server's drain, and the replies the server
    still writes are read (not left to fill the pipe until the server is killed)."""
    client = PortClient(command=DRAINS_FOR_SECONDS)
    server = client.proc
    dropped_at = time.monotonic()
    del client
    gc.collect()
    assert time.monotonic() - dropped_at < 2.5 and server.returncode is None, "the drop waited for the server"
    server.wait(REPLY_TIMEOUT_S)

    client = PortClient(command=ANSWERS_MORE_THAN_A_PIPE_HOLDS)
    server = client.proc
    client.submit("ping")
    del client
    gc.collect()
    assert server.wait(REPLY_TIMEOUT_S) == 0, "the server was killed, its replies unread"


def test_a_live_port_clients_pipe_stays_open_after_its_server_ended():
    client = PortClient(command=SILENT_SERVER)
    client.proc.kill()
    client._thread.join(REPLY_TIMEOUT_S)
    assert not client.proc.stdout.closed, "closed under a client still in use"
    client.close()


def test_a_port_client_dropped_after_its_server_ended_waits_for_it_and_closes_its_pipe():
    """The other order: the server gone first (killed, or a shutdown), its end seen while the
    client lived, then the client dropped (found in review: a zombie and an open pipe still)."""
    client = PortClient(command=SILENT_SERVER)
    server = client.proc
    server.kill()
    client._thread.join(REPLY_TIMEOUT_S)
    assert not client._thread.is_alive(), "the reader did not see the server's end"
    del client
    gc.collect()
    wait_until(lambda: server.returncode is not None and server.stdout.closed, "the dropped client's server "
               "waited for and its stdout closed", timeout=REPLY_TIMEOUT_S)


# A stand-in for `python -m bridge` that answers its one request once its stdin ends, then exits.
ANSWERS_AT_THE_END = [sys.executable, "-c", """
import sys, protocol
from bridge.streams import read_frame, write_all
request = protocol.decode_request(read_frame(sys.stdin.buffer.raw))
sys.stdin.buffer.read()
write_all(1, protocol.frame_parts(protocol.encode_reply(request.id, {"last": True}, {})))
"""]


# A stand-in for `python -m bridge` that answers its one request a second after it came, unless
# its stdin ends first: as the server, which at stdin's end drains for less than that.
GIVES_UP_AT_THE_END = [sys.executable, "-c", """
import os, sys, threading, protocol
from bridge.streams import read_frame, write_all
request = protocol.decode_request(read_frame(sys.stdin.buffer.raw))
ended = threading.Event()
def read_to_the_end():  # os.read: a daemon thread in a buffered read would hold its lock at exit
    while os.read(0, 65536):
        pass
    ended.set()
threading.Thread(target=read_to_the_end, daemon=True).start()
if not ended.wait(1.0):
    write_all(1, protocol.frame_parts(protocol.encode_reply(request.id, {"done": True}, {})))
ended.wait(10)
"""]


def test_closing_a_port_client_waits_for_the_requests_in_flight_before_ending_stdin():
    """close() said the server finishes what is in flight, but closed stdin at once, and the
    server answers only what its drain allows: a `with PortClient()` block's submitted work was
    lost at its end (found in review). It waits for the replies first, within its timeout."""
    client = PortClient(command=GIVES_UP_AT_THE_END)
    answered = client.submit("ping")
    assert client.close(timeout=REPLY_TIMEOUT_S) == 0
    assert answered.result(0).result == {"done": True}


# A stand-in for `python -m bridge` that answers cancels only, and exits at its stdin's end.
ANSWERS_CANCELS = [sys.executable, "-c", """
import sys, protocol
from bridge.streams import read_frame, write_all
while (body := read_frame(sys.stdin.buffer.raw)) is not None:
    request = protocol.decode_request(body)
    if request.op == "cancel":
        write_all(1, protocol.frame_parts(protocol.encode_reply(request.id, {"cancelled": True}, {})))
"""]


def test_closing_a_port_client_does_not_wait_for_a_request_it_gave_up_on():
    """close() waited for the requests in flight with concurrent.futures.wait, which never
    counts a Future cancelled by its caller: after any timed-out or interrupted request it
    waited out its whole timeout (found in review)."""
    client = PortClient(command=ANSWERS_CANCELS)
    with pytest.raises(TimeoutError):
        client.request("ping", timeout=0.2)
    started = time.monotonic()
    assert client.close(timeout=REPLY_TIMEOUT_S) == 0
    assert time.monotonic() - started < REPLY_TIMEOUT_S / 2


def test_closing_a_port_client_hands_over_the_last_replies_and_closes_the_servers_stdout():
    """close() waited for the server's exit but not for the reader to read what the server wrote
    before it, and left the server's stdout open until the client was collected (found in
    review: a ResourceWarning for every client closed)."""
    client = PortClient(command=ANSWERS_AT_THE_END)
    answered = client.submit("ping")
    assert client.close() == 0
    assert answered.result(0).result == {"last": True}
    assert client.proc.stdout.closed
    assert not client._thread.is_alive()


# A stand-in for `python -m bridge` that answers the first of two requests, then exits a while
# after its stdin ends.
ANSWERS_THE_FIRST_THEN_LINGERS = [sys.executable, "-c", """
import sys, time, protocol
from bridge.streams import read_frame, write_all
first = protocol.decode_request(read_frame(sys.stdin.buffer.raw))
read_frame(sys.stdin.buffer.raw)
write_all(1, protocol.frame_parts(protocol.encode_reply(first.id, {}, {})))
sys.stdin.buffer.read()
time.sleep(2)
"""]


def test_a_port_client_closed_in_a_done_callback_returns_at_once_and_closes_after():
    """close() on the reader thread waited there for the server's exit, while the server wrote
    replies no one read: a server with replies still to write blocked until close() killed it
    (found in review). It returns None at once, the close going on once the callback has
    returned: the server is still running then, and exits in its own time."""
    client = PortClient(command=ANSWERS_THE_FIRST_THEN_LINGERS)
    outcome = []
    first = client.submit("ping")
    # (its close waits for `second`, which this server answers only at stdin's end: 3 s, then
    # as long again for the exit, which comes 2 s after that end)
    first.add_done_callback(lambda _: outcome.append((client.close(timeout=3), client.proc.poll())))
    second = client.submit("ping")
    first.result(REPLY_TIMEOUT_S)
    wait_until(lambda: outcome, "the done callback did not run", REPLY_TIMEOUT_S)
    assert outcome == [(None, None)]
    with pytest.raises(ServerExited):
        second.result(REPLY_TIMEOUT_S)
    assert client.proc.wait(REPLY_TIMEOUT_S) == 0
    wait_until(lambda: client.proc.stdout.closed, "the server's stdout was not closed", REPLY_TIMEOUT_S)
    assert client.close() == 0


def unix_client_of_a_stand_in(tmp_path):
    """A UnixClient connected to a listener the test holds: (client, listener, the accepted
    connection), the server's end for the test to read, answer or leave mute."""
    import socket

    path = str(tmp_path / "lane.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)
    listener.settimeout(REPLY_TIMEOUT_S)
    client = bridge.client.UnixClient(path)
    served, _ = listener.accept()
    return client, listener, served


def test_a_unix_client_that_cannot_connect_closes_its_socket(tmp_path, monkeypatch):
    """Only a missing or refusing server's socket was closed: any other failure to connect (a
    path too long for AF_UNIX) left it open for as long as the exception was held (found in
    review)."""
    made = []

    class Recorded(socket.socket):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(bridge.client.socket, "socket", Recorded)
    with pytest.raises(OSError, match="path too long"):
        bridge.client.UnixClient(str(tmp_path / ("x" * 200)))
    assert [sock.fileno() for sock in made] == [-1]


def test_a_unix_client_dropped_without_close_ends_its_connection(tmp_path):
    """The server frees what a connection owned when it ends: a client collected without
    close() must end it (its reader thread, blocked on the socket, would keep it open)."""
    client, listener, served = unix_client_of_a_stand_in(tmp_path)
    served.settimeout(REPLY_TIMEOUT_S)
    reader = served.makefile("rb", buffering=0)
    try:
        waiting = client.submit("ping")
        assert read_frame(reader) is not None
        collected, client_socket = weakref.ref(client), client.sock
        del client
        gc.collect()
        assert collected() is None
        assert reader.read(1) == b"", "the dropped client's connection did not end"
        with pytest.raises(ServerExited, match="dropped without close"):
            waiting.result(REPLY_TIMEOUT_S)
        reader.close()
        served.close()  # the end of the stream the dropped client's reader waits for
        # Closed by its reader, not left to the collector (a ResourceWarning, found in review).
        wait_until(lambda: client_socket.fileno() == -1, "the dropped client's socket closed", timeout=REPLY_TIMEOUT_S)
    finally:
        reader.close()
        served.close()
        listener.close()


def test_a_unix_client_dropped_after_its_server_closed_closes_its_socket(tmp_path):
    client, listener, served = unix_client_of_a_stand_in(tmp_path)
    client_socket = client.sock
    served.close()
    listener.close()
    client._thread.join(REPLY_TIMEOUT_S)
    assert not client._thread.is_alive(), "the reader did not see the server's end"
    del client
    gc.collect()
    assert client_socket.fileno() == -1, "the socket of a client dropped after its server closed is left open"


def test_a_unix_client_dropped_once_its_writer_thread_ran_is_collected(tmp_path):
    """The writer thread (a done callback's submit) held the client strongly: one dropped
    without close() was never collected, its threads, socket and place under the server's
    --max-connections kept for the life of the process (found in review)."""
    writers_before = {t for t in threading.enumerate() if t.name == "bridge-client-writer"}
    client, listener, served = unix_client_of_a_stand_in(tmp_path)
    served.settimeout(REPLY_TIMEOUT_S)
    reader = served.makefile("rb", buffering=0)
    try:
        client_ref, submitted = weakref.ref(client), []
        first = client.submit("ping")
        first.add_done_callback(lambda _: submitted.append(client_ref().submit("ping")))
        request = protocol.decode_request(read_frame(reader))
        write_all(served.fileno(), protocol.frame_parts(protocol.encode_reply(request.id, {}, {})))
        assert protocol.decode_request(read_frame(reader)).op == "ping"  # written by the writer thread
        writers = {t for t in threading.enumerate() if t.name == "bridge-client-writer"} - writers_before
        assert writers
        del client, first
        gc.collect()
        assert client_ref() is None
        assert reader.read(1) == b"", "the dropped client's connection did not end"
        for writer in writers:
            writer.join(REPLY_TIMEOUT_S)
            assert not writer.is_alive()
        with pytest.raises(ServerExited, match="dropped without close"):
            submitted[0].result(REPLY_TIMEOUT_S)
    finally:
        reader.close()
        served.close()
        listener.close()


# A client made before a fork, its server a stand-in; the child exits normally (its finalizers
# and atexit run) or lives on, and the parent's client must go on (unix: its connection not
# ended by the child) or close as if the child were not there (port: the server sees stdin's end).
FORKED_CLIENT = """
import os, socket, sys, time
import bridge.client, protocol
from bridge.streams import read_frame, write_all

case = sys.argv[1]
if case == "unix":
    path = os.path.join(sys.argv[2], "fork.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)
    client = bridge.client.UnixClient(path)
    served, _ = listener.accept()
else:
    client = bridge.client.PortClient(command=[sys.executable, "-c", "import sys; sys.stdin.buffer.read()"])
print("parent is", os.getpid(), flush=True)
if case == "unix":  # in flight at the fork: the child's exit must not settle it, nor run its callback
    pending = client.submit("ping")
    pending.add_done_callback(lambda f: print("callback ran in", os.getpid(), flush=True))
child = os.fork()
if child == 0:
    try:
        client.submit("ping")
    except bridge.client.ServerExited as exc:
        print("child:", exc, flush=True)
    if case == "port":
        time.sleep(30)  # alive, holding whatever it inherited
    sys.exit(0)
if case == "unix":
    os.waitpid(child, 0)
    served.settimeout(5)
    future = client.submit("ping")
    reader = served.makefile("rb", buffering=0)
    for _ in range(2):
        request = protocol.decode_request(read_frame(reader))
        write_all(served.fileno(), protocol.frame_parts(protocol.encode_reply(request.id, {"pong": True}, {})))
    print("parent:", future.result(5).result, pending.result(5).result, flush=True)
else:
    started = time.monotonic()
    status = client.close(timeout=5)
    print("parent:", status, "in", round(time.monotonic() - started), "s", flush=True)
    os.kill(child, 9)
    os.waitpid(child, 0)
"""


@pytest.mark.parametrize("case", ["unix", "port"])
def test_a_forked_child_neither_ends_nor_holds_up_its_parents_client(tmp_path, case):
    """A child forked from a process holding a UnixClient shut the shared socket down at its
    normal exit (its finalizer), ending the parent's connection; one alive holding a
    PortClient's stdin kept the server from seeing its end, so the parent's close waited out
    its timeout and killed the server (found in review). The child's copies are closed at the
    fork, and its calls refused."""
    script = tmp_path / "forked.py"
    script.write_text(FORKED_CLIENT)
    done = subprocess.run([sys.executable, str(script), case, str(tmp_path)], capture_output=True, text=True,
                          timeout=60, env=bridge.client.server_env())
    assert done.returncode == 0, done.stderr
    assert "child: the client belongs to process" in done.stdout, done.stdout
    assert ("parent: {'pong': True} {'pong': True}" if case == "unix" else "parent: 0 in 0 s") in done.stdout, \
        done.stdout
    parent = re.search(r"parent is (\d+)", done.stdout).group(1)
    callbacks = [line for line in done.stdout.splitlines() if line.startswith("callback ran in")]
    assert callbacks == ([f"callback ran in {parent}"] if case == "unix" else []), done.stdout


class Interrupted(Exception):
    pass


@pytest.mark.parametrize("interruption", [KeyboardInterrupt, Interrupted], ids=["ctrl-c", "a-handlers-exception"])
def test_an_interrupted_request_is_cancelled(pipe, interruption):
    """A request whose caller was interrupted (Ctrl-C, a signal handler's exception) stayed in
    flight: the server ran it and what it created (a session) was never freed (found in review).
    It is cancelled as at a timeout."""
    def interrupt(*_):
        raise interruption

    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.2)
        with pytest.raises(interruption):
            pipe.client.request("session_open", {"batch": 1, "dim": 2, "state": 2}, timeout=REPLY_TIMEOUT_S)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    request = pipe.read_request()
    assert select.select([pipe.requests], [], [], REPLY_TIMEOUT_S)[0], "no cancel was sent"
    cancel = pipe.read_request()
    assert (cancel.op, cancel.args["id"]) == ("cancel", request.id)


def test_a_turn_away_settling_requests_in_flight_is_told_to_them_once(tmp_path):
    """A request in flight when the server turned the connection away fails `overloaded` at
    the close; the next is ServerExited, a new client's to retry. Found in CI: failing those
    in flight did not count as telling, and the next request got `overloaded` again."""
    client, listener, served = unix_client_of_a_stand_in(tmp_path)
    served.settimeout(REPLY_TIMEOUT_S)
    reader = served.makefile("rb", buffering=0)
    try:
        waiting = client.submit("ping")
        assert read_frame(reader) is not None  # read before it is turned away: in flight
        write_all(served.fileno(), protocol.frame_parts(
            protocol.encode_error(None, "overloaded", "at most 1 connection", {"limit": 1})))
        served.shutdown(socket.SHUT_RDWR)
        with pytest.raises(BridgeError) as refused:
            waiting.result(REPLY_TIMEOUT_S)
        assert refused.value.code == "overloaded" and refused.value.detail == {"limit": 1}
        with pytest.raises(ServerExited, match="open a new client to retry"):
            client.ping()
    finally:
        reader.close()
        served.close()
        listener.close()
        client.close()


def test_closing_a_unix_client_whose_server_never_answers_fails_what_is_in_flight(tmp_path):
    """close(timeout) against a server that reads but neither answers nor closes (hung, or
    stopped): past the timeout, what is in flight fails and the reader thread ends (found in
    review: the reader stayed blocked in recv and the callers waited for ever)."""
    client, listener, served = unix_client_of_a_stand_in(tmp_path)
    try:
        waiting = client.submit("ping")
        client.close(timeout=0.2)
        with pytest.raises(ServerExited, match="closed with requests unanswered"):
            waiting.result(REPLY_TIMEOUT_S)
        assert not client._thread.is_alive()
    finally:
        served.close()
        listener.close()


def close_in_a_done_callback(client, answer) -> list:
    """Call client.close() in the done callback of a request that `answer()` (the test's server)
    replies to; what the close raised, once the callback has run (None: nothing)."""
    outcome = []

    def callback(_):
        try:
            client.close()
        except Exception as exc:
            outcome.append(exc)
        else:
            outcome.append(None)

    future = client.submit("ping")
    future.add_done_callback(callback)
    answer()
    future.result(REPLY_TIMEOUT_S)
    wait_until(lambda: outcome, "the done callback did not run", REPLY_TIMEOUT_S)
    return outcome


def test_a_unix_client_closed_in_a_done_callback_closes_its_socket(tmp_path):
    """close() on the reader thread joined that very thread: "cannot join current thread", which
    the Future only logged, and the socket stayed open until garbage collection (found in
    review). It returns at once instead, the close going on once the callback has returned."""
    client, listener, served = unix_client_of_a_stand_in(tmp_path)
    served.settimeout(REPLY_TIMEOUT_S)
    reader = served.makefile("rb", buffering=0)
    try:
        def answer():
            request = protocol.decode_request(read_frame(reader))
            write_all(served.fileno(), protocol.frame_parts(protocol.encode_reply(request.id, {}, {})))

        assert close_in_a_done_callback(client, answer) == [None]
        with pytest.raises(ServerExited, match="the client is closed"):
            client.submit("ping")
        assert read_frame(reader) is None, "the client did not stop sending"
        served.shutdown(socket.SHUT_WR)  # the server's end, after what was in flight
        wait_until(lambda: client.sock.fileno() == -1, "the socket was not closed", REPLY_TIMEOUT_S)
    finally:
        reader.close()
        served.close()
        listener.close()


@pytest.mark.parametrize("endpoint, kwargs", [pytest.param("bogus://nowhere", {}, id="bad-endpoint"),
                                              pytest.param("tcp://127.0.0.1:9", {"curve_server_key": b"short"},
                                                           id="bad-server-key")])
def test_a_zmq_client_that_fails_to_start_leaves_nothing_open(endpoint, kwargs):
    """Its context and sockets (eight descriptors) stayed open while the exception lived, its
    traceback holding the half-built client, until the collector ran (found in review)."""
    import zmq

    def open_fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    failures = []
    before = open_fds()
    for _ in range(3):
        with pytest.raises((zmq.ZMQError, ValueError, TypeError)) as failed:
            bridge.client.ZmqClient(endpoint, **kwargs)
        failures.append(failed.value)  # kept alive, with its traceback
    assert open_fds() == before


def test_a_zmq_client_closed_in_a_done_callback_closes_its_context(tmp_path):
    """As a unix client's: close() on the io thread joined that very thread, and the socket and
    ZeroMQ context stayed open (found in review)."""
    import zmq

    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(f"ipc://{tmp_path}/peer.ipc")
    client = bridge.client.ZmqClient(f"ipc://{tmp_path}/peer.ipc")
    try:
        def answer():
            assert router.poll(REPLY_TIMEOUT_S * 1000), "nothing was sent"
            peer, body = router.recv_multipart()
            router.send_multipart([peer, b"".join(protocol.encode_reply(protocol.decode_request(body).id, {}, {}))])

        assert close_in_a_done_callback(client, answer) == [None]
        with pytest.raises(ServerExited, match="the client is closed"):
            client.submit("ping")
        wait_until(lambda: client._context.closed, "the ZeroMQ context was not closed", REPLY_TIMEOUT_S)
    finally:
        client.close()
        router.close()
        context.term()


def test_a_zmq_client_dropped_without_close_is_collected_and_closes_its_sockets(tmp_path):
    """Its io thread held the client, so one dropped without close() was never collected: its
    thread, sockets, context and eventfd lived as long as the process (found in review). Now
    it is collected, the thread ends and closes them, and a caller still waiting is told."""
    import zmq

    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(f"ipc://{tmp_path}/peer.ipc")
    try:
        client = bridge.client.ZmqClient(f"ipc://{tmp_path}/peer.ipc")
        waiting = client.submit("ping")
        assert router.poll(REPLY_TIMEOUT_S * 1000), "nothing was sent"
        thread, zmq_context, outbox = client._thread, client._context, client._outbox
        collected = weakref.ref(client)
        del client
        gc.collect()
        assert collected() is None
        thread.join(REPLY_TIMEOUT_S)
        assert not thread.is_alive() and zmq_context.closed and outbox._closed
        with pytest.raises(ServerExited, match="dropped without close"):
            waiting.result(REPLY_TIMEOUT_S)
    finally:
        router.close()
        context.term()


def test_a_zmq_client_closed_twice_closes_its_files_once(tmp_path):
    """The second close() closed the outbox eventfd's number again, by then maybe another
    file's (found in review)."""
    client = bridge.client.ZmqClient(f"ipc://{tmp_path}/nobody.ipc")
    outbox_fd = client._outbox.fd
    client.close()
    reused = []  # files opened until one has the outbox's old number (the lowest free comes first)
    try:
        while not reused or reused[-1] < outbox_fd:
            reused.append(os.open(os.devnull, os.O_RDONLY))
        assert outbox_fd in reused, f"the number {outbox_fd} was not free after the first close"
        client.close()
        os.fstat(outbox_fd)  # still open: the second close left another file's number alone
    finally:
        for fd in reused:
            os.close(fd)


def test_a_raw_frame_sent_on_a_closed_zmq_client_is_refused(tmp_path):
    """send_raw without an id on a closed ZmqClient went into an outbox nobody read and
    returned as if sent, where the stream clients raise ServerExited (found in review)."""
    client = bridge.client.ZmqClient(f"ipc://{tmp_path}/nobody.ipc")
    client.close()
    with pytest.raises(ServerExited, match="the client is closed"):
        client.send_raw(b"\xc1")


def test_a_deadline_exceeded_reply_to_a_timed_request_is_its_timeout(pipe):
    """The timeout is the request's deadline on the server: when the server's deadline_exceeded
    comes before the waiting thread wakes, request() still raises TimeoutError, as documented."""
    done = {}
    caller = threading.Thread(target=lambda: done.setdefault("outcome", _outcome(pipe.client, 30.0)))
    caller.start()
    request = pipe.read_request()
    assert request.deadline_us == 30_000_000
    pipe.error(request.id, "deadline_exceeded", {"deadline_us": request.deadline_us})
    caller.join(REPLY_TIMEOUT_S)
    assert isinstance(done["outcome"], TimeoutError), done


def _outcome(client, timeout):
    try:
        return client.request("ping", timeout=timeout)
    except Exception as exc:
        return exc


def test_cancel_names_a_raw_request_sent_with_an_id(pipe):
    """send_raw(..., request_id=...)'s Future can be cancelled like submit()'s (it lacked the
    id cancel() names: AttributeError, found in review)."""
    future = pipe.client.send_raw(b"".join(protocol.encode_request(7, "ping", {})), request_id=7)
    pipe.read_request()
    assert pipe.client.cancel(future) is True
    cancel = pipe.read_request()
    assert (cancel.op, cancel.args) == ("cancel", {"id": 7})


def test_a_request_submitted_while_close_waits_for_the_server_is_refused(tmp_path):
    stdin_closed = tmp_path / "stdin-closed"
    # Reads its stdin to the end, says so, and exits only when the test lets it (SIGUSR1, held
    # pending from the start so that it cannot come too early).
    lingering = f"""
import signal, sys
signal.pthread_sigmask(signal.SIG_BLOCK, {{signal.SIGUSR1}})
sys.stdin.buffer.read()
open({str(stdin_closed)!r}, "w").close()
signal.sigwait({{signal.SIGUSR1}})
"""
    client = PortClient(command=[sys.executable, "-c", lingering])
    closing = threading.Thread(target=client.close)
    closing.start()
    try:
        wait_until(stdin_closed.exists, "the server never read its stdin to the end", REPLY_TIMEOUT_S)
        assert closing.is_alive(), "close() did not wait for the server"
        # stdin's fd number is free now, for any file opened next: nothing may be written to it.
        with pytest.raises(ServerExited, match="the client is closed"):
            client.submit("ping")
    finally:
        client.proc.send_signal(signal.SIGUSR1)
        closing.join(REPLY_TIMEOUT_S)
    assert client.proc.returncode == 0


def test_a_write_interrupted_part_way_ends_the_stream_instead_of_misframing_later_requests(pipe, monkeypatch):
    def interrupted(fd, parts):
        os.write(fd, bytes(parts[0])[:2])  # half the length prefix
        raise KeyboardInterrupt

    answered = pipe.client.submit("ping")
    monkeypatch.setattr(bridge.client, "write_all", interrupted)
    with pytest.raises(KeyboardInterrupt):
        pipe.client.submit("ping")
    monkeypatch.undo()
    with pytest.raises(ServerExited, match="a write failed part way"):
        pipe.client.submit("ping")
    # The server reads the whole first request, then the partial frame, then the end.
    assert pipe.read_request().op == "ping"
    assert pipe.requests.read() == b"\x00\x00"
    assert list(pipe.client._pending) == [1]
    pipe.reply(1)
    assert answered.result(REPLY_TIMEOUT_S).ok


def test_a_failed_write_raises_server_exited(pipe, monkeypatch):
    def broken_pipe(fd, parts):
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(bridge.client, "write_all", broken_pipe)
    with pytest.raises(ServerExited, match="BrokenPipeError"):
        pipe.client.submit("ping")
    assert pipe.client._pending == {}


def through_the_wire(value):
    """`value` as a server receives it in a request."""
    body = b"".join(protocol.encode_request(1, "put", {"tensor": to_wire(value)}))
    return protocol.decode_request(memoryview(body)).args["tensor"]


@pytest.mark.parametrize("array", [
    pytest.param(np.array(3.0, np.float32), id="0-d"),
    pytest.param(np.zeros((0, 3), np.float32), id="empty"),
    pytest.param(np.zeros((3, 0), np.float32).T, id="empty-not-contiguous"),
    pytest.param(np.arange(6, dtype=">f4").reshape(2, 3), id="big-endian"),
    pytest.param(np.arange(6, dtype=np.int64).reshape(2, 3)[:, ::2], id="not-contiguous"),
])
def test_numpy_arrays_travel_with_their_shape_and_values(array):
    received = from_wire(through_the_wire(array))
    assert received.shape == array.shape
    np.testing.assert_array_equal(received, array)


def test_numpy_scalars_travel_as_numbers():
    assert [to_wire(v) for v in (np.float32(0.5), np.int64(3), np.bool_(True))] == [0.5, 3, True]
    # In a tuple too, as mamba_ssm's callers pass dt_limit.
    assert to_wire((np.float32(0.5), np.float32(2.0))) == [0.5, 2.0]
    assert type(to_wire(np.int64(3))) is int


def test_a_torch_tensor_subclass_travels_as_its_tensor_and_other_torch_objects_are_refused():
    """Tensors were told apart by their class's module: another library's subclass (MONAI's
    MetaTensor) was refused as not encodable, and a torch.dtype failed on .detach() (found in
    review)."""
    torch = pytest.importorskip("torch")

    class MetaTensor(torch.Tensor):
        pass

    tensor = torch.arange(6, dtype=torch.float32).reshape(2, 3).as_subclass(MetaTensor)
    received = from_wire(through_the_wire(tensor))
    np.testing.assert_array_equal(received, np.arange(6, dtype=np.float32).reshape(2, 3))
    with pytest.raises(TypeError, match="cannot encode a torch.dtype"):
        protocol.encode_request(1, "model_load", to_wire({"dtype": torch.bfloat16}))


def test_an_argument_of_a_dtype_without_a_wire_code_is_named(pipe):
    """Found in review: the error named the dtype but not which argument had it."""
    with pytest.raises(TypeError, match=r"^args.D: dtype bool has no wire code"):
        pipe.client.submit("scan", {"D": np.ones(2, bool)})
    assert pipe.client._pending == {} and nothing_written(pipe)


def test_a_dtype_without_a_wire_code_is_a_type_error_naming_it():
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match="torch dtype torch.bool has no wire code; expected one of"):
        to_wire(torch.tensor([True, False]))
    with pytest.raises(TypeError, match="dtype complex64 has no wire code"):
        to_wire(np.zeros(2, np.complex64))


# What the client shares with the server: the wire (protocol) and neutral helpers; never the
# server, its dispatcher, ops or transports, so a client can change without reading them.
CLIENT_SHARED_MODULES = {"bridge.dtypes", "bridge.tensors", "bridge.streams", "bridge.outbox", "bridge.stop_signals"}


def test_the_client_imports_protocol_and_no_server_module():
    import ast

    source = Path(bridge.client.__file__).read_text()
    imported = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            imported.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            imported.add(node.module)
    ours = {name for name in imported if name.split(".")[0] in ("bridge", "scan_kernels", "protocol")}
    assert "protocol" in ours
    assert ours - {"protocol"} <= CLIENT_SHARED_MODULES, sorted(ours - {"protocol"} - CLIENT_SHARED_MODULES)
