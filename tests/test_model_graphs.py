"""bridge.models.graphs: a model's whole step captured as one CUDA graph, against the same step
composed of torch ops and kernels calls, and the server's model_step through it against a
server that composes every step. CUDA only: without a GPU every case skips, saying so (CI has
none; a lent GPU machine runs them, bench/gpu_checks.sh)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from bridge.models import load_weights
from bridge.models import graphs as graphs_module
from bridge.models.graphs import ModelStepGraphs
from bridge_fakes import RecordingConnection
from kernel_cases import NO_CUDA, random_seed

transformers = pytest.importorskip("transformers", reason="transformers (a test dependency) is not installed")
from test_models import ARCHS, VOCAB, backbone_request, randomized, rel_close  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
POOL = 6
CAPTURED_BACKEND = graphs_module.CAPTURED_BACKEND


def cuda_model(arch: str, seed: int):
    """(the transformers model, the runtime's fp32 model of its weights on the GPU)."""
    make_config, cls, _ = ARCHS[arch]
    model = randomized(getattr(transformers, cls)(make_config(seed)))
    config = json.loads(model.config.to_json_string())
    config["architectures"] = [cls]  # a backbone has no head: its class says so, as a saved one's config does
    weights = {k: v.detach() for k, v in model.state_dict().items()}
    return model, load_weights(config, weights, torch.float32, torch.device("cuda"), lambda n: None)


def random_pool(m, generator, layout: str = "separate") -> dict[str, torch.Tensor]:
    """Random state for POOL rows: a tensor a part ("separate"), or views into one flat pool as
    the server's (bridge.sessions), each part at an offset of no 16-byte multiple ("one-pool")."""
    shapes = dict(m.config.state_parts())
    if layout == "separate":
        return {name: (torch.randn((POOL, *shape), generator=generator) * 0.3).cuda() for name, shape in shapes.items()}
    sizes = {name: math.prod(shape) for name, shape in shapes.items()}
    flat = (torch.randn((POOL, sum(sizes.values()) + 3 * len(sizes) + 1), generator=generator) * 0.3).cuda()
    parts, offset = {}, 1
    for name, shape in shapes.items():
        parts[name] = flat[:, offset:offset + sizes[name]].unflatten(1, shape)
        offset += sizes[name] + 3
    return parts


def frame_inputs(m, arch: str, rows: int, generator) -> torch.Tensor:
    if arch.endswith("backbone"):
        return torch.randn(rows, m.config.d_model, generator=generator).cuda()
    return torch.randint(0, VOCAB, (rows,), generator=generator).cuda()


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
    _, m = cuda_model(arch, seed)
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


def test_a_pool_whose_parts_moved_is_captured_again():
    """A pool that grew has new parts: the capture made on the old ones is not replayed over
    them (it would write the freed memory), the step is captured again and updates the new."""
    seed = random_seed()
    generator = torch.Generator().manual_seed(seed)
    _, m = cuda_model("mamba2-lm", seed)
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


def test_a_backend_that_reads_values_on_the_host_is_left_to_the_caller(monkeypatch):
    """The torch backend's state updates find their live rows with torch.nonzero, which a
    capture cannot hold (CUDA voids the capture): its steps are not captured at all."""
    made = []
    monkeypatch.setattr(graphs_module, "_Capture", lambda *args: made.append(args))
    seed = random_seed()
    generator = torch.Generator().manual_seed(seed)
    _, m = cuda_model("mamba-lm-untied", seed)
    pool = random_pool(m, generator)
    graphs = ModelStepGraphs()
    slots = torch.tensor([4, 1], device="cuda")
    with torch.no_grad():
        assert graphs.step(m, pool, slots, frame_inputs(m, "mamba-lm-untied", 2, generator), output="logits",
                           backend="torch") is None
    assert made == [] and graphs.captured == 0


def serve_backbone(inproc, model, **config):
    srv, conn = inproc(device="cuda", **config), RecordingConnection()
    request_config, weights = backbone_request(model)
    loaded = srv.call(conn, "model_load", config=request_config, weights=weights)["model"]
    return srv, conn, srv.call(conn, "session_open", model=loaded, batch=2)["session"]


def test_the_servers_model_steps_replay_a_capture_and_agree_with_composed_ones(inproc):
    """ExPhil's case over the server on a GPU: a backbone sent by the client, a prefill, then
    frames; one server captures its steps, the other (`--no-cuda-graphs`) composes them."""
    seed = random_seed()
    model, _ = cuda_model("mamba2-backbone", seed)
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
