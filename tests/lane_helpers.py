"""What the lane tests share: a `python -m bridge` process (`ServerProcess`), raw unix and ZeroMQ
exchanges that bypass the clients, request frames, and the check of a scan's reply against the
reference."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

import numpy as np
import pytest
import torch
import zmq

import protocol
from bridge.bench.lanes import TRANSPORTS
from bridge.client import result_from_wire, server_env
from bridge.streams import read_frame

from kernel_cases import assert_close, reference_scan
from waiting import wait_until


START_TIMEOUT_S = 180.0


REPLY_TIMEOUT_S = 60.0


def ipv6_loopback_missing() -> str | None:
    """Why this machine cannot serve on ::1 (a container may have no IPv6), or None."""
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError as error:
        return f"this machine has no IPv6 loopback: {error}"
    return None


def numpy_args(inputs: dict) -> dict:
    return {k: v.numpy() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}


def assert_reply_matches_reference(reply, inputs: dict, what: str = "y") -> None:
    """`reply`: a client's, or a protocol.Reply read off a raw socket."""
    if isinstance(reply, protocol.Reply):
        assert reply.ok, f"{what}: {reply.error}"
        result = result_from_wire(reply.result)
    else:
        result = reply.unwrap()
    y_ref, state_ref = reference_scan(inputs)
    assert_close(torch.from_numpy(np.array(result["y"])), y_ref, torch.float32, what)
    if inputs.get("return_state"):
        assert_close(torch.from_numpy(np.array(result["state"])), state_ref, torch.float32, what + " state")


class ServerProcess:
    """`python -m bridge` with the given transports; its log goes to a file shown on failure."""

    def __init__(self, directory, *args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL):
        self.directory = directory
        self.log_path = os.path.join(directory, "server.log")
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "bridge", "--device", "cpu", *args],
                                         stdin=stdin, stdout=stdout, stderr=log, env=server_env())

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def wait_for_path(self, path: str) -> None:
        def created() -> bool:
            if self.proc.poll() is not None:
                pytest.fail(f"the server exited with {self.proc.returncode}:\n{self.log()}")
            return os.path.exists(path)

        try:
            wait_until(created, f"the server did not create {path}", START_TIMEOUT_S, interval=0.01)
        except TimeoutError as exc:
            pytest.fail(f"{exc}:\n{self.log()}")

    def stop(self, timeout: float = 10.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise


def zmq_endpoint(info: dict, name: str, value: str) -> str:
    """Where to connect to the ZeroMQ lane bound with `--zmq value` (`name` zmq-ipc or
    zmq-tcp), read from info as the benchmark reads it."""
    endpoint = TRANSPORTS[name].endpoint(info["transports"], value)
    if endpoint is None:
        raise AssertionError(f"no {name} endpoint for {value} in {info['transports']}")
    return endpoint


def zmq_exchange(endpoint: str, frames: list, socket_type=zmq.DEALER, timeout_s=REPLY_TIMEOUT_S) -> list:
    context = zmq.Context.instance()
    sock = context.socket(socket_type)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        sock.send_multipart(frames)
        if not sock.poll(timeout_s * 1000):
            raise TimeoutError(f"no reply from {endpoint}")
        return sock.recv_multipart()
    finally:
        sock.close()


def scan_message(inputs: dict, request_id, multipart: bool) -> list:
    wire = {k: protocol.OutTensor("f32", v.shape, v.contiguous().numpy()) if isinstance(v, torch.Tensor) else v
            for k, v in inputs.items()}
    buffers = [] if multipart else None
    parts = protocol.encode_request(request_id, "scan", wire, buffers=buffers)
    return [b"".join(parts), *map(bytes, buffers or ())]


def request_frame(request_id, op: str, args: dict | None = None) -> bytes:
    return b"".join(protocol.frame_parts(protocol.encode_request(request_id, op, args or {})))


def scan_frame(request_id, inputs: dict) -> bytes:
    return request_frame(request_id, "scan", {k: protocol.OutTensor("f32", v.shape, v.numpy())
                                              if isinstance(v, torch.Tensor) else v for k, v in inputs.items()})


def read_reply(reader) -> protocol.Reply:
    body = read_frame(reader)
    assert body is not None, "the server closed the connection instead of replying"
    return protocol.decode_reply(body)


def raw_unix(path: str) -> socket.socket:
    """A raw connection whose reads and writes fail rather than hang when the server is stuck.
    A refused connect is tried again for a while: the server's socket file appears when it binds,
    a moment before it listens, and wait_for_path may see it in between."""
    made = []

    def connected() -> bool:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(REPLY_TIMEOUT_S)
        try:
            sock.connect(path)
        except ConnectionRefusedError:
            sock.close()
            return False
        made.append(sock)
        return True

    wait_until(connected, f"the server at {path} refused every connection", START_TIMEOUT_S, interval=0.01)
    return made[0]


class RecordingDispatcher:
    """Stands in for the dispatcher behind an in-process UnixTransport: records each body and
    answers it with its own bytes."""

    def __init__(self):
        self.bodies = []

    def on_frame(self, conn, body, received_ns, release=None, buffers=(), *, more_input=True):
        self.bodies.append(bytes(body))
        release()
        conn.send([self.bodies[-1]])

    def on_frame_error(self, conn, exc):
        conn.send([b"refused"])
