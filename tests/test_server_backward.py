"""The gradient ops through the server (protocol/SPEC.md §6.5): `scan_backward` and
`ssd_scan_backward` reply exactly what the kernels API computes in process, for the inputs given
(handles too), name the field of every malformed request and serve on; and a forward + backward
over a server process on its default backend equals the in-process one.
"""

from __future__ import annotations

import pytest
import torch

import scan_kernels
from bridge.client import PortClient, server_env
from bridge_fakes import RecordingConnection
from kernel_cases import (ScanCase, SsdCase, backward_inputs, make_cotangents, make_scan_inputs, make_ssd_inputs,
                          random_seed)


@pytest.fixture
def srv(inproc):
    return inproc(backend="cpu" if "cpu" in scan_kernels.available_backends() else "torch", max_delay_us=0)


def _expected(op: str, dy, inputs: dict, dstate, backend: str) -> dict:
    backward = scan_kernels.ssd_scan_backward if op == "ssd_scan_backward" else scan_kernels.selective_scan_backward
    return {"d" + k: v for k, v in backward(dy, **inputs, dstate=dstate, backend=backend).items()}


@pytest.mark.parametrize("op, case", [
    pytest.param("scan_backward", ScanCase(2, 9, 6, 4, groups=2, D=True, z=True, dt_bias=True, dt_softplus=True,
                                           clamp=True, h0=True), id="scan-all-options"),
    pytest.param("scan_backward", ScanCase(1, 7, 5, 3, layout="bdl", bc_3d=True), id="scan-bdl-bc3d-minimal"),
    pytest.param("ssd_scan_backward", SsdCase(1, 11, 4, 3, 5, groups=2, D=True, z=True, dt_bias=True,
                                              dt_softplus=True, h0=True), id="ssd-all-options"),
])
def test_gradients_are_the_in_process_ones(srv, op, case):
    seed = random_seed()
    inputs = backward_inputs((make_ssd_inputs if op == "ssd_scan_backward" else make_scan_inputs)(case, seed=seed))
    state_shape = ((case.batch, case.heads, case.headdim, case.state) if op == "ssd_scan_backward"
                   else (case.batch, case.dim, case.state))
    dy, dstate = make_cotangents(inputs, tuple(inputs["x"].shape), state_shape, case.h0, seed)
    extra = {"dstate": dstate} if dstate is not None else {}
    got = srv.call(RecordingConnection(), op, dy=dy, **inputs, **extra)
    expected = _expected(op, dy, inputs, dstate, srv.server.backend)
    assert set(got) == set(expected)
    for name, value in expected.items():
        assert torch.equal(got[name], value), f"{name} seed={seed}"


def test_weights_may_be_handles(srv):
    conn = RecordingConnection()
    inputs = backward_inputs(make_scan_inputs(ScanCase(1, 5, 4, 3, D=True, dt_bias=True), seed=5))
    dy = torch.randn(inputs["x"].shape)
    handles = {name: srv.call(conn, "put", tensor=inputs[name])["handle"] for name in ("A", "D", "dt_bias")}
    from protocol import HandleRef

    got = srv.call(conn, "scan_backward", dy=dy, **{**inputs, **{k: HandleRef(h) for k, h in handles.items()}})
    expected = _expected("scan_backward", dy, inputs, None, srv.server.backend)
    assert all(torch.equal(got[k], v) for k, v in expected.items())


def test_packed_sequences(srv):
    inputs = backward_inputs(make_scan_inputs(ScanCase(1, 8, 4, 3, h0=False), seed=6))
    dy = torch.randn(inputs["x"].shape)
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    dstate = torch.randn(2, 4, 3)
    got = srv.call(RecordingConnection(), "scan_backward", dy=dy, cu_seqlens=cu, dstate=dstate, **inputs)
    expected = scan_kernels.selective_scan_backward(dy, **inputs, dstate=dstate, cu_seqlens=cu, backend=srv.server.backend)
    assert all(torch.equal(got["d" + k], v) for k, v in expected.items())


def test_ssd_packed_sequences_by_seq_idx(srv):
    """ssd_scan_backward takes mamba_ssm's seq_idx for the sequences cu_seqlens would give."""
    inputs = backward_inputs(make_ssd_inputs(SsdCase(1, 8, 2, 3, 4, h0=False), seed=8))
    dy = torch.randn(inputs["x"].shape)
    cu = torch.tensor([0, 5, 8], dtype=torch.int32)
    seq_idx = torch.tensor([[0] * 5 + [1] * 3], dtype=torch.int32)
    dstate = torch.randn(2, 2, 3, 4)
    got = srv.call(RecordingConnection(), "ssd_scan_backward", dy=dy, seq_idx=seq_idx, dstate=dstate, **inputs)
    expected = scan_kernels.ssd_scan_backward(dy, **inputs, dstate=dstate, cu_seqlens=cu, backend=srv.server.backend)
    assert all(torch.equal(got["d" + k], v) for k, v in expected.items())


def _scan():
    return backward_inputs(make_scan_inputs(ScanCase(1, 4, 3, 2), seed=7))


BAD_REQUESTS = [
    pytest.param("scan_backward", lambda: {**_scan()}, "missing_argument", "args.dy", id="no-dy"),
    pytest.param("scan_backward", lambda: {**_scan(), "dy": torch.zeros(1, 3, 3)}, "shape_mismatch", "args.dy",
                 id="dy-shape"),
    pytest.param("scan_backward", lambda: {**_scan(), "dy": torch.zeros(1, 4, 3), "dstate": torch.zeros(1, 3, 3)},
                 "shape_mismatch", "args.dstate", id="dstate-shape"),
    pytest.param("scan_backward", lambda: {**_scan(), "dy": torch.zeros(1, 4, 3), "session": "s-1"},
                 "invalid_argument", "args.session", id="no-session"),
    pytest.param("scan_backward", lambda: {**_scan(), "dy": torch.zeros(1, 4, 3), "return_state": True},
                 "invalid_argument", "args.return_state", id="no-return-state"),
    pytest.param("ssd_scan_backward", lambda: {**backward_inputs(make_ssd_inputs(SsdCase(1, 3, 2, 2, 2), seed=8)),
                                               "dy": torch.zeros(1, 3, 2, 2), "dt_limit": [0.0, 1.0], "dt_min": 0.1},
                 "invalid_argument", "args.dt_limit", id="dt-limit-and-dt-min"),
]


@pytest.mark.parametrize("op, make_args, code, field", BAD_REQUESTS)
def test_malformed_requests_get_errors_naming_the_field(srv, op, make_args, code, field):
    conn = RecordingConnection()
    reply = srv.request(conn, op, **make_args())
    assert not reply.ok, f"{op} accepted"
    assert (reply.error["code"], reply.error["detail"].get("field")) == (code, field), reply.error
    assert srv.call(conn, "ping") == {"pong": True}


def test_forward_and_backward_over_a_server_process():
    """A server process on its default backend: scan then scan_backward over the Port equal the
    kernels API in this process on the same backend, bit for bit."""
    seed = random_seed()
    case = ScanCase(2, 13, 8, 4, D=True, z=True, dt_bias=True, dt_softplus=True, h0=True)
    inputs = make_scan_inputs(case, seed=seed)
    dy, dstate = make_cotangents(inputs, tuple(inputs["x"].shape), (2, 8, 4), True, seed)
    backend = scan_kernels.select_backend("cpu")
    with PortClient(["--device", "cpu"], env=server_env(), as_torch=True) as client:
        assert client.info()["backend"] == backend
        forward = client.scan(**inputs).unwrap()
        got = client.scan_backward(dy, **backward_inputs(inputs), dstate=dstate).unwrap()
    y, state = scan_kernels.selective_scan(**inputs, backend=backend)
    assert torch.equal(forward["y"], y) and torch.equal(forward["state"], state)
    expected = scan_kernels.selective_scan_backward(dy, **backward_inputs(inputs), dstate=dstate, backend=backend)
    assert set(got) == {"d" + k for k in expected}
    for name, value in expected.items():
        assert torch.equal(got["d" + name], value), f"d{name} seed={seed}"
