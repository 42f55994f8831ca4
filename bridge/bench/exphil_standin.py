"""A stand-in for ExPhil's Python Port server, for `--baseline` where ExPhil is not installed:

    python -m bridge.bench --baseline "python -m bridge.bench.exphil_standin"

It answers the same legacy requests (protocol/SPEC.md §9) the way that server is built:
blocking buffered reads of each frame on default 64 KiB pipes, msgpack-python decoding that
copies every binary, one more copy into a torch tensor per input, a Python loop over the
timesteps that materializes [batch, hidden, state] per step, and a reply packed in one piece.
Same math as ExPhil: dt clamped to [0.001, 0.1], h0 = 0, no bias, softplus, D or z.
With `--device cuda` the inputs are copied to the GPU and y back, as ExPhil's server does there.
"""

from __future__ import annotations

import argparse
import struct
import sys

import msgpack
import torch

DT_MIN, DT_MAX = 0.001, 0.1


def scan_per_step(x, dt, A, B, C):
    """y [b, l, h] for x, dt [b, l, h], A [h, n], B, C [b, l, n], one timestep at a time."""
    dt = dt.clamp(DT_MIN, DT_MAX)
    h = x.new_zeros(x.shape[0], x.shape[2], A.shape[1])
    ys = []
    for t in range(x.shape[1]):
        step = dt[:, t, :, None]
        h = torch.exp(step * A) * h + step * B[:, t, None, :] * x[:, t, :, None]
        ys.append((h * C[:, t, None, :]).sum(-1))
    return torch.stack(ys, dim=1)


def scan(request: dict, device: torch.device) -> dict:
    b, l, hidden, n = (request[k] for k in (b"batch", b"seq_len", b"hidden", b"state"))
    shapes = {b"x": (b, l, hidden), b"dt": (b, l, hidden), b"A": (hidden, n), b"B": (b, l, n), b"C": (b, l, n)}
    tensors = [torch.frombuffer(bytearray(request[k]), dtype=torch.float32).reshape(shape).to(device)
               for k, shape in shapes.items()]
    y = scan_per_step(*tensors).cpu()
    return {"status": "ok", "result": y.numpy().tobytes(), "shape": list(y.shape)}


def answer(request, device: torch.device) -> dict:
    op = request.get(b"op", b"") if isinstance(request, dict) else b""
    cuda = torch.cuda.is_available()
    if op == b"ping":
        return {"status": "ok", "message": "pong", "device": device.type, "cuda_available": cuda}
    if op == b"info":
        return {"status": "ok", "device": device.type, "cuda_available": cuda, "pytorch_version": torch.__version__}
    if op == b"scan":
        return scan(request, device)
    return {"status": "error", "message": f"unknown op {op!r}"}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    device = torch.device(p.parse_args(argv).device)
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    while True:
        header = stdin.read(4)
        if len(header) < 4:
            return 0
        body = stdin.read(struct.unpack(">I", header)[0])
        try:
            reply = answer(msgpack.unpackb(body, raw=True), device)
        except Exception as exc:  # every request is answered, as ExPhil's GenServer waits for one
            reply = {"status": "error", "message": f"{type(exc).__name__}: {exc}"}
        packed = msgpack.packb(reply, use_bin_type=True)
        stdout.write(struct.pack(">I", len(packed)))
        stdout.write(packed)
        stdout.flush()


if __name__ == "__main__":
    raise SystemExit(main())
