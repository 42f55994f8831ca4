"""ExPhil compatibility (protocol/SPEC.md §9): its GenServers' exact request and reply formats.

ExPhil packs with Msgpax, which writes Elixir binaries as msgpack *str*; `use_bin_type=False`
reproduces that here. Replies are matched the way its GenServer pattern-matches them."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
import torch

from bridge.client import PortClient
from scan_kernels.reference import selective_scan_ref

from waiting import wait_until


@pytest.fixture(scope="module")
def client():
    with PortClient(["--device", "cpu"]) as c:
        yield c


def msgpax(obj) -> bytes:
    return msgpack.packb(obj, use_bin_type=False)


def exphil_call(client, obj, pack=msgpax) -> dict:
    before = client.unmatched_count
    client.send_raw(pack(obj))
    wait_until(lambda: client.unmatched_count != before, "no reply")
    return last_raw(client)


def last_raw(client) -> dict:
    return msgpack.unpackb(client.unmatched[-1].extra["raw"])


def exphil_inputs(b, l, h, n, seed):
    rng = np.random.default_rng(seed)
    return dict(
        x=rng.standard_normal((b, l, h), dtype=np.float32),
        # Wider than ExPhil's clamp range on purpose: the clamp must be applied.
        dt=rng.uniform(0.0, 0.3, (b, l, h)).astype(np.float32),
        A=-rng.uniform(0.5, 4.0, (h, n)).astype(np.float32),
        B=rng.standard_normal((b, l, n), dtype=np.float32),
        C=rng.standard_normal((b, l, n), dtype=np.float32),
    )


def exphil_expected(inp):
    t = {k: torch.from_numpy(v) for k, v in inp.items()}
    y, _ = selective_scan_ref(t["x"], t["dt"], t["A"], t["B"], t["C"], dt_min=0.001, dt_max=0.1,
                              compute_dtype=torch.float64)
    return y.to(torch.float32)


def check_ok_reply(reply, inp, shape):
    # The timing last, as a v1 reply's: the kernel/bridge split (found in review: none was sent).
    assert list(reply) == ["status", "result", "shape", "timing"]
    assert reply["timing"]["kernel_us"] > 0 and reply["timing"]["server_us"] >= reply["timing"]["kernel_us"]
    assert reply["status"] == "ok"
    assert reply["shape"] == list(shape)
    y = torch.from_numpy(np.frombuffer(reply["result"], dtype=np.float32).reshape(shape).copy())
    torch.testing.assert_close(y, exphil_expected(inp), rtol=3e-4, atol=1e-3)


@pytest.mark.parametrize("dims", [(2, 7, 5, 3), (3, 60, 32, 16)], ids=["odd", "exphil-shaped"])
def test_pytorch_port_scan(client, dims):
    b, l, h, n = dims
    inp = exphil_inputs(b, l, h, n, seed=b * l)
    req = {"op": "scan", "batch": b, "seq_len": l, "hidden": h, "state": n,
           **{k: v.tobytes() for k, v in inp.items()}}
    check_ok_reply(exphil_call(client, req), inp, (b, l, h))


def test_triton_variant_scan_with_shapes(client):
    b, l, h, n = 2, 9, 6, 4
    inp = exphil_inputs(b, l, h, n, seed=7)
    req = {"op": "scan"}
    for k, v in inp.items():
        req[k] = v.tobytes()
        req[f"{k}_shape"] = list(v.shape)
    check_ok_reply(exphil_call(client, req), inp, (b, l, h))


def test_bin_encoded_binaries_also_accepted(client):
    b, l, h, n = 1, 4, 3, 2
    inp = exphil_inputs(b, l, h, n, seed=3)
    req = {"op": "scan", "batch": b, "seq_len": l, "hidden": h, "state": n,
           **{k: v.tobytes() for k, v in inp.items()}}
    reply = exphil_call(client, req, pack=lambda obj: msgpack.packb(obj, use_bin_type=True))
    check_ok_reply(reply, inp, (b, l, h))


@pytest.mark.parametrize("op", ["ping", "info"])
def test_ping_and_info(client, op):
    reply = exphil_call(client, {"op": op})
    assert reply["status"] == "ok"
    assert "device" in reply


@pytest.mark.parametrize("req", [
    pytest.param({"op": "scan", "batch": 2, "seq_len": 3, "hidden": 4, "state": 2, "x": b"\0" * 7,
                  "dt": b"", "A": b"", "B": b"", "C": b""}, id="short-binaries"),
    pytest.param({"op": "scan", "batch": 1}, id="missing-fields"),
    pytest.param({"op": "teleport"}, id="unknown-op"),
])
def test_errors_use_exphil_shape(client, req):
    reply = exphil_call(client, req)
    assert set(reply) == {"status", "message"}
    assert reply["status"] == "error" and isinstance(reply["message"], str) and reply["message"]
    assert exphil_call(client, {"op": "ping"})["status"] == "ok"


def test_an_error_found_by_the_scan_op_names_the_legacy_key(client):
    # SPEC §7 (legacy: the top-level key): the op checks the v1 arguments the request became, and
    # its message named "args.A" (found in review).
    f32 = lambda n: b"\0" * (4 * n)  # noqa: E731
    reply = exphil_call(client, {"op": "scan", "x": f32(2), "dt": f32(2), "A": f32(4), "B": f32(2), "C": f32(2),
                                 "x_shape": [1, 2, 1], "dt_shape": [1, 2, 1], "A_shape": [2, 2],
                                 "B_shape": [1, 2, 1], "C_shape": [1, 2, 1]})
    assert reply["status"] == "error" and reply["message"].startswith("A: expected shape"), reply
