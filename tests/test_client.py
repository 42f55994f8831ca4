"""The Python client library (bridge.client) against a stand-in server driven by the test: two
pipes, the test reading each request and writing each reply when it chooses, so that every
ordering is deterministic."""

from __future__ import annotations

import os

import pytest

import protocol
from bridge.client import FramedClient
from bridge.transports.framed import read_exact, write_all

REPLY_TIMEOUT_S = 10


class PipeServer:
    """The far end of a FramedClient over two pipes."""

    def __init__(self):
        requests_r, requests_w = os.pipe()
        replies_r, self.replies_fd = os.pipe()
        self.requests = os.fdopen(requests_r, "rb", buffering=0)
        self.client = FramedClient(os.fdopen(replies_r, "rb", buffering=0), requests_w)

    def read_request(self) -> protocol.Request:
        header = memoryview(bytearray(4))
        assert read_exact(self.requests, header), "the client closed its end"
        body = memoryview(bytearray(protocol.parse_frame_header(header)))
        assert read_exact(self.requests, body), "the client closed its end inside a frame"
        return protocol.decode_request(body)

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
        os.close(self.client._writer_fd)
        self.requests.close()


@pytest.fixture
def pipe():
    server = PipeServer()
    yield server
    server.close()


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
    with pytest.raises(ValueError, match="got 1"):
        pipe.client.send_raw(b"\x80", request_id=1)
    pipe.reply(pipe.read_request().id, {"which": "first"})
    assert first.result(REPLY_TIMEOUT_S).result == {"which": "first"}
    assert pipe.client._pending == {}


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
