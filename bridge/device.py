"""Which device the server computes on, and why (reported by `info`)."""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

# cuda:N names one GPU, so that a host can run one server per GPU.
DEVICE_EXPECTED = "auto, cpu, cuda or cuda:N (N an int >= 0)"
_NUMBERED_CUDA = re.compile(r"cuda:([0-9]+)")


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


def parse_device(requested: str) -> tuple[str, int | None]:
    """A --device value as (auto, cpu or cuda; the index cuda:N names, else None). ValueError,
    saying what is taken, for anything else."""
    if requested in ("auto", "cpu", "cuda"):
        return requested, None
    numbered = _NUMBERED_CUDA.fullmatch(requested) if isinstance(requested, str) else None
    if numbered is None:
        raise ValueError(f"expected {DEVICE_EXPECTED}, got {requested!r}")
    return "cuda", int(numbered.group(1))


def choose_device(requested: str) -> DeviceChoice:
    """The device a --device value names: ValueError when it names none, DeviceUnavailable when
    this machine does not have it."""
    kind, index = parse_device(requested)
    cuda = torch.cuda.is_available()
    if kind == "cuda":
        if not cuda:
            raise DeviceUnavailable(f"--device {requested}: no CUDA device is visible to torch "
                                    f"(torch {torch.__version__}, cuda build: {torch.version.cuda})")
        if index is None:
            return DeviceChoice(torch.device("cuda", torch.cuda.current_device()), requested, "asked for cuda")
        count = torch.cuda.device_count()
        if index >= count:
            raise DeviceUnavailable(f"--device {requested}: expected a CUDA device index below {count} (torch "
                                    f"sees {count}, numbered after CUDA_VISIBLE_DEVICES), got {index}")
        # What runs on the main thread without naming a device (warmup's launches) goes to this
        # GPU too. The current device is per thread: serving threads name the device instead.
        torch.cuda.set_device(index)
        return DeviceChoice(torch.device("cuda", index), requested, f"asked for {requested}")
    if kind == "cpu":
        return DeviceChoice(torch.device("cpu"), requested, "asked for cpu")
    if cuda:
        return DeviceChoice(torch.device("cuda", torch.cuda.current_device()), requested,
                            f"auto: CUDA device {torch.cuda.get_device_name()} is available")
    why = "torch is a CPU-only build" if torch.version.cuda is None else "no CUDA device is visible"
    return DeviceChoice(torch.device("cpu"), requested, f"auto: {why}")
