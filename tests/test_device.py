"""--device: which values it takes (auto, cpu, cuda, cuda:N), what each picks, and how a value
that names no device, or a device this machine lacks, is refused. The CUDA cases run on the CPU
with torch.cuda's queries stood in for a two-GPU machine."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from bridge.client import server_env
from bridge.device import DeviceUnavailable, choose_device, parse_device

MALFORMED = ["cuda:x", "cuda:-1", "cuda:", "cuda:1.0", "gpu", "CUDA", " cuda", "cuda:0 "]


@pytest.fixture
def two_gpus(monkeypatch):
    """torch.cuda answering as on a machine with two GPUs; the list records set_device's calls."""
    current = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_device", current.append)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Stand-in GPU")
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: SimpleNamespace(name="Stand-in GPU", total_memory=2**30))
    return current


@pytest.mark.parametrize("requested, parsed", [
    ("auto", ("auto", None)), ("cpu", ("cpu", None)), ("cuda", ("cuda", None)),
    ("cuda:0", ("cuda", 0)), ("cuda:7", ("cuda", 7)), ("cuda:12", ("cuda", 12)),
])
def test_device_values_parse(requested, parsed):
    assert parse_device(requested) == parsed


@pytest.mark.parametrize("requested", MALFORMED)
def test_a_malformed_device_says_what_is_taken(requested):
    with pytest.raises(ValueError) as raised:
        parse_device(requested)
    assert str(raised.value) == f"expected auto, cpu, cuda or cuda:N (N an int >= 0), got {requested!r}"
    with pytest.raises(ValueError):
        choose_device(requested)


def test_cuda_n_picks_that_gpu_and_makes_it_current(two_gpus):
    choice = choose_device("cuda:1")
    assert choice.device == torch.device("cuda", 1)
    assert two_gpus == [1]
    assert choice.describe() == {"device": "cuda:1", "requested": "cuda:1", "reason": "asked for cuda:1",
                                 "name": "Stand-in GPU", "memory_bytes": 2**30}


def test_cuda_n_beyond_the_visible_gpus_is_unavailable(two_gpus):
    with pytest.raises(DeviceUnavailable) as raised:
        choose_device("cuda:2")
    assert str(raised.value) == ("--device cuda:2: expected a CUDA device index below 2 (torch sees 2, numbered "
                                 "after CUDA_VISIBLE_DEVICES), got 2")
    assert two_gpus == []  # the current device is left alone


@pytest.mark.parametrize("requested", ["cuda", "cuda:0"])
def test_cuda_without_a_gpu_is_unavailable(monkeypatch, requested):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(DeviceUnavailable, match=rf"^--device {requested}: no CUDA device is visible to torch"):
        choose_device(requested)


def test_plain_cuda_keeps_the_current_device(two_gpus):
    choice = choose_device("cuda")
    assert (choice.device, choice.describe()["device"], two_gpus) == (torch.device("cuda", 0), "cuda:0", [])


@pytest.mark.parametrize("requested", ["cuda:x", "cuda:-1", "gpu"])
def test_the_command_line_refuses_a_malformed_device_as_a_usage_error(capsys, requested):
    from bridge.cli import build_parser

    with pytest.raises(SystemExit) as raised:
        build_parser().parse_args(["--device", requested])
    assert raised.value.code == 2
    assert (f"argument --device: expected auto, cpu, cuda or cuda:N (N an int >= 0), got {requested!r}"
            in capsys.readouterr().err)


def test_the_command_line_takes_cuda_n():
    from bridge.cli import build_parser

    assert build_parser().parse_args(["--device", "cuda:3"]).device == "cuda:3"


def test_a_server_asked_for_cuda_0_without_a_gpu_exits_saying_why():
    # CUDA_VISIBLE_DEVICES="" hides any GPU this machine has.
    proc = subprocess.run([sys.executable, "-m", "bridge", "--device", "cuda:0"], capture_output=True, text=True,
                          timeout=120, stdin=subprocess.DEVNULL, env=server_env({"CUDA_VISIBLE_DEVICES": ""}))
    assert proc.returncode == 2, proc.stderr
    assert "--device cuda:0: no CUDA device is visible to torch" in proc.stderr
