"""ExPhil's PyTorchPort requests (protocol/SPEC.md §9), answered in its own reply shapes. The protocol
layer already turned a legacy scan into v1 scan arguments (with ExPhil's dt clamp), so the scan
itself runs through the same path as a v1 scan."""

from __future__ import annotations

import torch

from . import scan as scan_ops


def _device_fields(server) -> dict:
    return {"device": server.device.type, "cuda_available": torch.cuda.is_available()}


def ping(server, call) -> dict:
    return {"status": "ok", "message": "pong", **_device_fields(server)}


def info(server, call) -> dict:
    fields = {"status": "ok", **_device_fields(server), "pytorch_version": str(torch.__version__),
              "backend": server.backend, "server": "scan-bridge"}
    if server.device.type == "cuda":
        props = torch.cuda.get_device_properties(server.device)
        fields["cuda_device"] = props.name
        fields["cuda_memory_gb"] = props.total_memory / 1e9
    return fields


def scan(server, call) -> dict:
    return {"status": "ok", "result": scan_ops.scan(server, call)["y"]}


HANDLERS = {"ping": ping, "info": info, "scan": scan}
