"""Which device the server computes on, and why (reported by `info`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

DEVICE_CHOICES = ("auto", "cpu", "cuda")


class DeviceUnavailable(RuntimeError):
    pass


@dataclass(frozen=True)
class DeviceChoice:
    device: torch.device
    requested: str
    reason: str

    def describe(self) -> dict:
        info = {"device": str(self.device), "requested": self.requested, "reason": self.reason}
        if self.device.type == "cuda":
            props = torch.cuda.get_device_properties(self.device)
            info["name"] = props.name
            info["memory_bytes"] = props.total_memory
        return info


def choose_device(requested: str) -> DeviceChoice:
    if requested not in DEVICE_CHOICES:
        raise DeviceUnavailable(f"--device: expected one of {DEVICE_CHOICES}, got {requested!r}")
    cuda = torch.cuda.is_available()
    if requested == "cuda":
        if not cuda:
            raise DeviceUnavailable("--device cuda: no CUDA device is visible to torch "
                                    f"(torch {torch.__version__}, cuda build: {torch.version.cuda})")
        return DeviceChoice(torch.device("cuda", torch.cuda.current_device()), requested, "asked for cuda")
    if requested == "cpu":
        return DeviceChoice(torch.device("cpu"), requested, "asked for cpu")
    if cuda:
        return DeviceChoice(torch.device("cuda", torch.cuda.current_device()), requested,
                            f"auto: CUDA device {torch.cuda.get_device_name()} is available")
    why = "torch is a CPU-only build" if torch.version.cuda is None else "no CUDA device is visible"
    return DeviceChoice(torch.device("cpu"), requested, f"auto: {why}")
