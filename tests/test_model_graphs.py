"""bridge.models.graphs: a model's whole step captured as one CUDA graph, against the same step
composed of torch ops and kernels calls, and the server's model_step through it against a
server that composes every step. Captures exist on CUDA only: those cases skip without a GPU,
saying so (CI has none; a lent GPU machine runs them, bench/gpu_checks.sh). The cache around
them (which kinds capture, what is replayed, forgotten or not tried again) runs in every CI with
a stand-in capture on the CPU that composes the step it stands for."""

from __future__ import annotations

import gc
import json

import pytest
import torch

from bridge.models import load_weights
from bridge.sessions import STATE_DTYPE, StateLayout
from bridge.models import graphs as graphs_module
from bridge.models.graphs import ModelStepGraphs
from bridge_fakes import RecordingConnection
from kernel_cases import NO_CUDA, random_seed

transformers = pytest.importorskip("transformers", reason="transformers (a test dependency) is not installed")
from test_models import ARCHS, VOCAB, backbone_request, randomized, rel_close  # noqa: E402

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
POOL = 6
CAPTURED_BACKEND = graphs_module.CAPTURED_BACKEND


def model_on(arch: str, seed: int, device: str = "cuda"):
    """(the transformers model, the runtime's fp32 model of its weights on `device`)."""
    make_config, cls, _ = ARCHS[arch]
    model = randomized(getattr(transformers, cls)(make_config(seed)))
    config = json.loads(model.config.to_json_string())
    config["architectures"] = [cls]  # a backbone has no head: its class says so, as a saved one's config does
    weights = {k: v.detach() for k, v in model.state_dict().items()}
    return model, load_weights(config, weights, torch.float32, torch.device(device), lambda n: None)


def random_pool(m, generator, layout: str = "separate", device: str = "cuda") -> dict[str, torch.Tensor]:
    """Random state for POOL rows: a tensor a part ("separate"), or the server's views into one
    flat pool (StateLayout.split), one float off the allocator's alignment ("one-pool")."""
    if layout == "separate":
        return {name: (torch.randn((POOL, *shape), generator=generator) * 0.3).to(device)
                for name, shape in m.config.state_parts()}
    layout = StateLayout("model", tuple(m.config.state_parts()))
    flat = (torch.randn((POOL, 1 + layout.row_bytes // STATE_DTYPE.itemsize), generator=generator) * 0.3).to(device)
    return layout.split(flat[:, 1:])


def frame_inputs(m, arch: str, rows: int, generator, device: str = "cuda") -> torch.Tensor:
    if arch.endswith("backbone"):
        return torch.randn(rows, m.config.d_model, generator=generator).to(device)
    return torch.randint(0, VOCAB, (rows,), generator=generator).to(device)


@needs_cuda
@pytest.mark.parametrize("layout", ["separate", "one-pool"])
@pytest.mark.parametrize("arch", ["mamba-lm-untied", "mamba2-lm", "mamba2-backbone"])
def test_a_captured_step_is_the_composed_one(arch, layout, backend=CAPTURED_BACKEND):
    """Frames through the capture and through the composed step, from one random state in
    scattered pool slots: every output and every state part alike. Other slots of as many rows
    replay the same capture (slots are an input); another row count captures anew. "one-pool"
    lays the parts out as the server does, off 16-byte alignment, which the capture's warm-up
    must copy (Triton specialises on it)."""
    seed = random_seed()
    generator = torch.Generator().manual_seed(seed)
    _, m = model_on(arch, seed)
    output = ARCHS[arch][2]
    captured = random_pool(m, generator, layout)
    composed = {name: t.clone() for name, t in captured.items()}
    graphs = ModelStepGraphs()
    what = f"{arch} {backend} seed={seed}"
    with torch.no_grad():
        for frame, slots in enumerate([[5, 0, 3]] * 4 + [[1, 4, 2]] * 2 + [[3]] * 2):
            slots = torch.tensor(slots, device="cuda")
            inputs = frame_inputs(m, arch, len(slots), generator)
            got = graphs.step(m, captured, slots, inputs, output=output, backend=backend)
            assert got is not None, f"{what}: the step did not capture"
            want = m.step(composed, slots, inputs, output=output, backend=backend)
            rel_close(got, want, 1e-5, f"{what} frame {frame} {output}")
            for name in captured:
                rel_close(captured[name], composed[name], 1e-5, f"{what} frame {frame} {name}")
    assert graphs.captured == 2, f"{what}: {graphs.captured} captures for two row counts"


@needs_cuda
def test_a_pool_whose_parts_moved_is_captured_again():
    """A pool that grew has new parts: the capture made on the old ones is not replayed over
    them (it would write the freed memory), the step is captured again and updates the new."""
    seed = random_seed()
    generator = torch.Generator().manual_seed(seed)
    _, m = model_on("mamba2-lm", seed)
    pool = random_pool(m, generator)
    graphs = ModelStepGraphs()
    slots = torch.tensor([2], device="cuda")
    tokens = frame_inputs(m, "mamba2-lm", 1, generator)
    with torch.no_grad():
        graphs.step(m, pool, slots, tokens, output="logits", backend=CAPTURED_BACKEND)
        grown = {name: torch.cat([t, torch.zeros_like(t)]) for name, t in pool.items()}
        expected = {name: t.clone() for name, t in grown.items()}
        want = m.step(expected, slots, tokens, output="logits", backend=CAPTURED_BACKEND)
        got = graphs.step(m, grown, slots, tokens, output="logits", backend=CAPTURED_BACKEND)
    assert graphs.captured == 2
    rel_close(got, want, 1e-5, f"seed={seed}: logits on the grown pool")
    for name in grown:
        rel_close(grown[name], expected[name], 1e-5, f"seed={seed}: {name} of the grown pool")


class StandInCapture(graphs_module._Held):
    """_Capture on the CPU: holds what a capture holds, and runs the composed step it stands for
    (on the torch backend) instead of a replay."""

    made: list["StandInCapture"] = []
    refuse = False  # make the next captures fail, as one CUDA voids would

    def __init__(self, model, parts, slots, inputs, output, backend):
        if StandInCapture.refuse:
            raise RuntimeError("the capture was voided")
        super().__init__(model, parts)
        self.output, self.runs = output, 0
        StandInCapture.made.append(self)

    def run(self, slots, inputs):
        self.runs += 1
        parts = {name: ref() for name, ref in self._parts.items()}
        return self._model().step(parts, slots, inputs, output=self.output, backend="torch")


@pytest.fixture
def stand_in(monkeypatch):
    StandInCapture.made, StandInCapture.refuse = [], False
    monkeypatch.setattr(graphs_module, "_Capture", StandInCapture)
    seed = random_seed()
    generator = torch.Generator().manual_seed(seed)
    _, m = model_on("mamba2-lm", seed, "cpu")
    return m, random_pool(m, generator, "one-pool", "cpu"), generator


def cpu_step(graphs, m, pool, slots, generator, backend=CAPTURED_BACKEND):
    tokens = frame_inputs(m, "mamba2-lm", len(slots), generator, "cpu")
    with torch.no_grad():
        return graphs.step(m, pool, torch.tensor(slots), tokens, output="logits", backend=backend)


def test_steps_of_one_kind_replay_one_capture_and_a_new_row_count_captures_anew(stand_in):
    m, pool, generator = stand_in
    graphs = ModelStepGraphs()
    composed = {name: t.clone() for name, t in pool.items()}
    for slots in ([5, 0, 3], [1, 4, 2], [5, 0, 3]):
        tokens = frame_inputs(m, "mamba2-lm", len(slots), generator, "cpu")
        with torch.no_grad():
            got = graphs.step(m, pool, torch.tensor(slots), tokens, output="logits", backend=CAPTURED_BACKEND)
            want = m.step(composed, torch.tensor(slots), tokens, output="logits", backend="torch")
        assert torch.equal(got, want)
    assert [c.runs for c in StandInCapture.made] == [3] and graphs.captured == 1
    cpu_step(graphs, m, pool, [2], generator)
    assert [c.runs for c in StandInCapture.made] == [3, 1] and len(graphs) == 2


def test_other_backends_steps_are_not_captured(stand_in):
    """The torch backend's state updates find their live rows with torch.nonzero, a read that
    voids a capture: its steps are left to the caller, no capture tried."""
    m, pool, generator = stand_in
    graphs = ModelStepGraphs()
    assert cpu_step(graphs, m, pool, [4, 1], generator, backend="torch") is None
    assert StandInCapture.made == [] and graphs.captured == 0


def test_a_kind_that_failed_to_capture_is_not_tried_again(stand_in):
    m, pool, generator = stand_in
    graphs = ModelStepGraphs()
    StandInCapture.refuse = True
    assert cpu_step(graphs, m, pool, [4, 1], generator) is None
    StandInCapture.refuse = False
    assert cpu_step(graphs, m, pool, [0, 3], generator) is None  # the same kind: composed by the caller
    assert StandInCapture.made == [] and graphs.captured == 0
    assert cpu_step(graphs, m, pool, [2], generator) is not None  # another kind captures
    assert graphs.captured == 1


def test_a_freed_models_captures_and_those_of_a_moved_pool_are_dropped(stand_in):
    """Captures hold their model and parts weakly; forgetting a model drops its captures, and a
    model or pool that is gone drops its captures at the next capture or forget."""
    m, pool, generator = stand_in
    graphs = ModelStepGraphs()
    cpu_step(graphs, m, pool, [1], generator)
    _, other = model_on("mamba2-lm", random_seed(), "cpu")
    other_pool = random_pool(other, generator, "separate", "cpu")
    cpu_step(graphs, other, other_pool, [1], generator)
    assert len(graphs) == 2
    graphs.forget(m)
    assert len(graphs) == 1
    del other, other_pool
    gc.collect()
    graphs.forget()
    assert len(graphs) == 0
    mine = random_pool(m, generator, "one-pool", "cpu")
    cpu_step(graphs, m, mine, [1], generator)
    grown = {name: torch.cat([t, torch.zeros_like(t)]) for name, t in mine.items()}
    cpu_step(graphs, m, grown, [1], generator)  # the pool moved: captured anew
    del mine
    gc.collect()
    cpu_step(graphs, m, grown, [2, 3], generator)  # a new capture drops the old pool's
    assert graphs.captured == 5 and len(graphs) == 2


def test_the_least_recently_used_capture_goes_past_capacity(stand_in):
    m, pool, generator = stand_in
    graphs = ModelStepGraphs(capacity=2)
    for slots in ([1], [1, 2], [1], [1, 2, 3], [1, 2]):
        cpu_step(graphs, m, pool, slots, generator)
    # 1 row, 2 rows, 1 row again (most recent), 3 rows (2 rows out), 2 rows anew.
    assert graphs.captured == 4 and len(graphs) == 2


def serve_backbone(inproc, model, **config):
    srv, conn = inproc(device="cuda", **config), RecordingConnection()
    request_config, weights = backbone_request(model)
    loaded = srv.call(conn, "model_load", config=request_config, weights=weights)["model"]
    return srv, conn, srv.call(conn, "session_open", model=loaded, batch=2)["session"]


@needs_cuda
def test_the_servers_model_steps_replay_a_capture_and_agree_with_composed_ones(inproc):
    """ExPhil's case over the server on a GPU: a backbone sent by the client, a prefill, then
    frames; one server captures its steps, the other (`--no-cuda-graphs`) composes them."""
    seed = random_seed()
    model, _ = model_on("mamba2-backbone", seed)
    servers = {graphs: serve_backbone(inproc, model, cuda_graphs=graphs, backend=CAPTURED_BACKEND)
               for graphs in (True, False)}
    generator = torch.Generator().manual_seed(seed)
    embeds = torch.randn(2, 12, model.config.hidden_size, generator=generator)
    outputs = {}
    for graphs, (srv, conn, session) in servers.items():
        got = [srv.call(conn, "model_forward", session=session, embeds=embeds[:, :6])["hidden"][:, -1]]
        got += [srv.call(conn, "model_step", session=session, embeds=embeds[:, t])["hidden"] for t in range(6, 12)]
        outputs[graphs] = torch.stack([torch.as_tensor(g) for g in got])
    rel_close(outputs[True], outputs[False], 1e-5, f"seed={seed}: captured against composed steps")
    srv, conn, _ = servers[True]
    assert srv.call(conn, "info")["cuda_graphs"]["model_steps_captured"] == 1
    assert servers[False][0].call(servers[False][1], "info")["cuda_graphs"] is None
