"""Whole models on the server (bridge.models, SPEC §6.4): parity with transformers' own Mamba
and Mamba-2 (a prefill, then steps with its cache) on tiny random models this test builds and
saves, in each public layout; snapshots, restores and forks; a model's state saved and given
back; the long-run drift of fp32 against float64; and a structured error, leaving nothing held,
for every bad checkpoint and request.

transformers is the external oracle (a test dependency only); the server runs in-process on
each CPU kernels backend.
"""

from __future__ import annotations

import copy
import json
import os
import threading

import numpy as np
import pytest
import torch

import scan_kernels

from bridge.client import BridgeError
from bridge.models import load_checkpoint, load_weights
from bridge.models.config import layer_state_names, parse_config
from bridge_fakes import RecordingConnection
from kernel_cases import cpu_backends, random_seed

transformers = pytest.importorskip("transformers", reason="transformers (a test dependency) is not installed")
from safetensors.torch import save_file  # noqa: E402  (a dependency of transformers and of the server)

VOCAB = 37
PREFIX = 9
STEPS = 20


def tiny_mamba(seed: int, **overrides):
    cfg = dict(vocab_size=VOCAB, hidden_size=12, state_size=5, num_hidden_layers=2, expand=2, conv_kernel=4,
               time_step_rank=3)
    cfg.update(overrides)
    torch.manual_seed(seed)
    return transformers.MambaConfig(**cfg)


def tiny_mamba2(seed: int, **overrides):
    cfg = dict(vocab_size=VOCAB, hidden_size=12, state_size=6, num_hidden_layers=2, expand=2, head_dim=6,
               num_heads=4, n_groups=2, conv_kernel=3, chunk_size=8)
    cfg.update(overrides)
    torch.manual_seed(seed)
    return transformers.Mamba2Config(**cfg)


def randomized(model):
    """transformers initialises norms to ones and D to ones: every weight is made random (A_log
    and dt kept in their working ranges), so that a wrong norm or skip would show."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.uniform_(-1.0, 1.5)
            elif name.endswith(("dt_bias", "dt_proj.bias")):
                p.uniform_(-3.0, 0.0)
            else:
                p.copy_(torch.randn_like(p) * (0.3 if p.dim() > 1 else 0.5) + (1.0 if name.endswith("norm.weight") else 0.0))
    return model.eval()


# (id, config maker, model class, the output a client asks for)
ARCHS = {
    "mamba-lm-tied": (tiny_mamba, "MambaForCausalLM", "logits"),
    "mamba-lm-untied": (lambda seed: tiny_mamba(seed, tie_word_embeddings=False), "MambaForCausalLM", "logits"),
    "mamba-backbone": (tiny_mamba, "MambaModel", "hidden"),
    "mamba2-lm": (tiny_mamba2, "Mamba2ForCausalLM", "logits"),
    "mamba2-backbone": (tiny_mamba2, "Mamba2Model", "hidden"),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Each ARCHS model saved by transformers under one model directory, with the model itself."""
    root = tmp_path_factory.mktemp("models")
    built = {}
    for i, (name, (make_config, cls, output)) in enumerate(ARCHS.items()):
        seed = random_seed()
        model = randomized(getattr(transformers, cls)(make_config(seed)))
        model.save_pretrained(root / name)
        built[name] = (model, output, seed)
    return root, built


def oracle_outputs(model, tokens, output, prefix=PREFIX):
    """transformers' own: a prefill of `prefix` tokens with its cache, then one token at a time."""
    def pick(out):
        return out.logits if output == "logits" else out.last_hidden_state

    with torch.no_grad():
        out = model(tokens[:, :prefix], use_cache=True)
        results, cache = [pick(out)], out.cache
        for t in range(prefix, tokens.shape[1]):
            out = model(tokens[:, t:t + 1], cache=cache, use_cache=True)
            results.append(pick(out))
            cache = out.cache
    return torch.cat(results, dim=1)


def position_width(model) -> int:
    """The position_width of a transformers model's config as the server reads it."""
    return parse_config(json.loads(model.config.to_json_string())).position_width


def rel_close(actual, expected, rtol, what):
    """Close relative to the largest magnitude (logits of random models span orders)."""
    actual, expected = torch.as_tensor(actual).double(), expected.double()
    assert actual.shape == expected.shape, what
    scale = expected.abs().max().item()
    err = (actual - expected).abs().max().item()
    assert err <= rtol * scale, f"{what}: max error {err:.3g} > {rtol} x {scale:.3g}"


@pytest.fixture
def serve(inproc, checkpoints):
    def make(backend="torch", **config):
        return inproc(backend=backend, model_dirs=(str(checkpoints[0]),), **config)
    return make


def call(srv, conn, op, **args):
    return srv.call(conn, op, **args)


def error_of(srv, conn, op, **args) -> dict:
    reply = srv.request(conn, op, **args)
    assert not reply.ok, f"{op} succeeded"
    return reply.error


@pytest.mark.parametrize("backend", cpu_backends())
@pytest.mark.parametrize("arch", list(ARCHS))
def test_prefill_then_steps_match_transformers_with_its_cache(serve, checkpoints, arch, backend):
    model, output, seed = checkpoints[1][arch]
    srv, conn = serve(backend), RecordingConnection()
    info = call(srv, conn, "model_load", path=arch)
    assert (info["arch"], info["layers"], info["d_model"]) == (
        "mamba" if arch.startswith("mamba-") else "mamba2", 2, 12)
    assert_prefill_then_steps_match(srv, conn, info["model"], model, output, batch=3, steps=STEPS, seed=seed + 1,
                                    what=f"{arch} on {backend} (seed {seed})")


def assert_prefill_then_steps_match(srv, conn, loaded, model, output, *, batch, steps, seed, what):
    """A session of the loaded model `loaded`: a prefill of PREFIX random tokens (from `seed`),
    then `steps` single steps, equal to transformers' run of `model` with its cache."""
    session = call(srv, conn, "session_open", model=loaded, batch=batch)["session"]
    torch.manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (batch, PREFIX + steps))
    got = [call(srv, conn, "model_forward", session=session, tokens=tokens[:, :PREFIX], output=output)[output]]
    for t in range(PREFIX, PREFIX + steps):
        got.append(call(srv, conn, "model_step", session=session, tokens=tokens[:, t].to(torch.int32),
                        output=output)[output][:, None])
    rel_close(torch.cat(got, dim=1), oracle_outputs(model, tokens, output), 1e-4, what)


# Models whose widest buffer a position is far wider than d_model, each with the backend where
# that buffer is held: Mamba-1 with expand 64 (its in_proj 128 x d_model) and Mamba-2 with heads
# of one channel (the torch form's decays and scores, heads x its chunk, about 2,000 x d_model);
# and one as wide as its in_proj.
WIDE_POSITION_MODELS = [
    pytest.param("MambaForCausalLM", dict(hidden_size=8, expand=64, time_step_rank=1), "cpu", id="mamba-expand-64"),
    pytest.param("Mamba2ForCausalLM", dict(hidden_size=8, expand=16, head_dim=1, num_heads=128, n_groups=1),
                 "torch", id="mamba2-heads-of-1"),
    pytest.param("MambaForCausalLM", dict(hidden_size=512, expand=1, time_step_rank=1), "cpu", id="mamba-expand-1"),
]


def test_position_width_counts_the_chunks_the_mamba2_backends_take():
    """SSD_DEFAULT_CHUNKS is the torch form's default chunk and Triton's: a backend's longer
    chunk would hold more decay and score rows a position than position_width counts."""
    from bridge.models.config import SSD_DEFAULT_CHUNKS
    from scan_kernels import eager_ssd

    pytest.importorskip("triton", reason="triton is not installed: its default chunk cannot be read")
    from scan_kernels.triton_kernels import configs

    assert SSD_DEFAULT_CHUNKS == (eager_ssd.DEFAULT_CHUNK, configs.SSD_CHUNK)


@pytest.mark.parametrize("cls, sizes, backend", WIDE_POSITION_MODELS)
def test_a_long_prefills_memory_is_bounded_by_its_passes_whatever_the_models_widths(tmp_path, cls, sizes, backend):
    """A pass holds about a dozen buffers of at most the config's position_width a position,
    PREFILL_PASS_ELEMENTS of them in all (rows x positions x width), so a window of 65,536 tokens
    raises the server's peak resident set by at most 12 x that many fp32 numbers, whatever
    d_model is. Passes sized by d_model alone ran each model below but the last as one pass
    (found in review): gigabytes for this 256 KiB request."""
    from bridge.client import PortClient, server_env
    from bridge.models import runtime

    if backend not in scan_kernels.available_backends():
        pytest.skip(f"{backend} backend unavailable: {scan_kernels.unavailable_backends().get(backend)}")
    config_class = getattr(transformers, cls.replace("ForCausalLM", "Config"))
    getattr(transformers, cls)(config_class(vocab_size=16, state_size=4, num_hidden_layers=1, **sizes)).save_pretrained(
        tmp_path / "wide")

    def status(pid, key):
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))

    with PortClient(["--device", "cpu", "--backend", backend, "--model-dir", str(tmp_path)], env=server_env()) as client:
        pid = client.request("info", {}).unwrap()["pid"]
        session = client.load_model("wide").open_session(batch=1)
        session.forward(np.zeros((1, 300), np.int32), last_only=True)  # a first pass: what stays allocated
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")  # the peak (VmHWM) back to the resident set
        before = status(pid, "VmRSS")
        session.forward(np.zeros((1, 65536), np.int32), last_only=True)
        peak_extra = status(pid, "VmHWM") - before
    bound = 12 * runtime.PREFILL_PASS_ELEMENTS * 4
    print(f"{cls} {sizes} on {backend}: peak +{peak_extra / 2**20:.0f} MiB, bound {bound / 2**20:.0f} MiB")
    assert peak_extra <= bound, f"peak +{peak_extra / 2**20:.0f} MiB, over {bound / 2**20:.0f} MiB"


@pytest.mark.parametrize("backend", cpu_backends())
@pytest.mark.parametrize("arch", ["mamba-lm-tied", "mamba2-lm", "mamba2-backbone"])
def test_a_long_window_runs_in_passes_as_transformers_runs_it_whole(serve, checkpoints, arch, backend,
                                                                    monkeypatch):
    """A window past PREFILL_PASS_ELEMENTS runs as passes, each from the state the one before
    left (a request of many tokens took memory in proportion to them, found in review): its
    outputs, its last_only output, rows of their own lengths and the steps after equal
    transformers' whole run. The bound is shrunk here to passes of 8 positions."""
    from bridge.models import runtime

    model, output, seed = checkpoints[1][arch]
    monkeypatch.setattr(runtime, "PREFILL_PASS_ALIGN", 8)
    monkeypatch.setattr(runtime, "PREFILL_PASS_ELEMENTS", 3 * position_width(model) * 9)  # 3 rows: 8 positions
    passes = []
    in_passes = runtime.Model._forward_in_passes
    monkeypatch.setattr(runtime.Model, "_forward_in_passes",
                        lambda self, *a, **k: passes.append(a[3]) or in_passes(self, *a, **k))
    srv, conn = serve(backend), RecordingConnection()
    loaded = call(srv, conn, "model_load", path=arch)["model"]
    torch.manual_seed(seed + 3)
    window, steps = 37, 2
    tokens = torch.randint(0, VOCAB, (3, window + steps))
    oracle = oracle_outputs(model, tokens, output, window)
    what = f"{arch} on {backend} (seed {seed})"
    for last_only in (False, True):
        session = call(srv, conn, "session_open", model=loaded, batch=3)["session"]
        got = call(srv, conn, "model_forward", session=session, tokens=tokens[:, :window], output=output,
                   last_only=last_only)[output]
        rel_close(got, oracle[:, window - 1:window] if last_only else oracle[:, :window], 1e-4, what)
        stepped = torch.stack([call(srv, conn, "model_step", session=session, tokens=tokens[:, t], output=output)[output]
                               for t in range(window, window + steps)], dim=1)
        rel_close(stepped, oracle[:, window:], 1e-4, what + ", the steps after")
    assert passes == [8, 8], passes
    lengths = [window, 20, 3]
    session = call(srv, conn, "session_open", model=loaded, batch=3)["session"]
    got = call(srv, conn, "model_forward", session=session, tokens=tokens[:, :window], output=output,
               lengths=torch.tensor(lengths, dtype=torch.int32))[output]
    for i, n in enumerate(lengths):
        alone = oracle_outputs(model, tokens[i:i + 1, :n], output, n)
        rel_close(got[i:i + 1, :n], alone, 1e-4, f"{what}, row {i} of length {n}")


@pytest.mark.parametrize("backend", cpu_backends())
@pytest.mark.parametrize("arch", ["mamba-lm-tied", "mamba2-lm", "mamba2-backbone"])
def test_rows_of_a_window_run_their_own_lengths_as_transformers_runs_each_alone(serve, checkpoints, arch, backend):
    """`lengths`: each row prefills only its own first positions, then the rows step together;
    every row equals transformers' run of that row alone, and its outputs past its length are
    zero."""
    model, output, seed = checkpoints[1][arch]
    srv, conn = serve(backend), RecordingConnection()
    info = call(srv, conn, "model_load", path=arch)
    session = call(srv, conn, "session_open", model=info["model"], batch=3)["session"]
    torch.manual_seed(seed + 2)
    lengths, steps = [PREFIX, 4, 1], 3
    tokens = torch.randint(0, VOCAB, (3, PREFIX + steps))
    window = call(srv, conn, "model_forward", session=session, tokens=tokens[:, :PREFIX], output=output,
                  lengths=torch.tensor(lengths, dtype=torch.int32))[output]
    stepped = torch.stack([call(srv, conn, "model_step", session=session, tokens=tokens[:, t], output=output)[output]
                           for t in range(PREFIX, PREFIX + steps)], dim=1)
    for i, n in enumerate(lengths):
        what = f"{arch} on {backend}, row {i} of length {n} (seed {seed})"
        alone = oracle_outputs(model, torch.cat([tokens[i:i + 1, :n], tokens[i:i + 1, PREFIX:]], dim=1), output, n)
        rel_close(window[i:i + 1, :n], alone[:, :n], 1e-4, what + ", its window")
        assert not window[i, n:].any(), what + ": outputs past its length"
        rel_close(stepped[i:i + 1], alone[:, n:], 1e-4, what + ", the steps after")


def test_a_row_of_length_zero_keeps_its_state_and_last_only_gives_each_rows_last(serve, checkpoints):
    srv, conn = serve("cpu"), RecordingConnection()
    model = call(srv, conn, "model_load", path="mamba2-lm")["model"]
    ragged, whole = (call(srv, conn, "session_open", model=model, batch=2)["session"] for _ in range(2))
    tokens = torch.randint(0, VOCAB, (2, 5))
    for session in (ragged, whole):
        call(srv, conn, "model_forward", session=session, tokens=tokens[:, 3:])
    before = call(srv, conn, "session_state", session=ragged)["state"]
    last = call(srv, conn, "model_forward", session=ragged, tokens=tokens, last_only=True,
                lengths=torch.tensor([3, 0]))["logits"]
    full = call(srv, conn, "model_forward", session=whole, tokens=tokens[:1, :3].expand(2, 3))["logits"]
    assert last.shape == (2, 1, VOCAB)
    rel_close(last[0], full[0, 2:3], 1e-5, "row 0's last position")
    assert not last[1].any(), "a row of length 0 has no output"
    after = call(srv, conn, "session_state", session=ragged)["state"]
    for name, part in after.items():
        assert torch.equal(part[1], before[name][1]), f"{name}: the row of length 0 moved"
        assert not torch.equal(part[0], before[name][0]), f"{name}: row 0 did not move"


@pytest.mark.parametrize("dtype", ["f32", "bf16", "f16", None])
def test_model_loads_reply_names_its_dtype_as_a_request_does(serve, dtype):
    """A client reloads or compares a model as its reply describes it: the reply's dtype is the
    wire name model_load takes (it was torch's, "bfloat16"), "f32" when the load named none."""
    srv, conn = serve(), RecordingConnection()
    args = {} if dtype is None else {"dtype": dtype}
    info = call(srv, conn, "model_load", path="mamba-lm-tied", **args)
    assert info["dtype"] == (dtype or "f32")


@pytest.mark.parametrize("arch", ["mamba-lm-tied", "mamba2-lm"])
def test_bf16_weights_follow_transformers_in_bf16_loosely(serve, checkpoints, arch):
    model, output, seed = checkpoints[1][arch]
    srv, conn = serve(), RecordingConnection()
    info = call(srv, conn, "model_load", path=arch, dtype="bf16")
    assert info["dtype"] == "bf16"
    session = call(srv, conn, "session_open", model=info["model"], batch=2)["session"]
    torch.manual_seed(seed + 2)
    tokens = torch.randint(0, VOCAB, (2, PREFIX + 4))
    got = [call(srv, conn, "model_forward", session=session, tokens=tokens[:, :PREFIX])["logits"]]
    got += [call(srv, conn, "model_step", session=session, tokens=tokens[:, t])["logits"][:, None]
            for t in range(PREFIX, PREFIX + 4)]
    with torch.no_grad():
        exact = model(tokens).logits.double()
        theirs = copy.deepcopy(model).to(torch.bfloat16)(tokens).logits.double()
    # Two bf16 computations that round in different places drift apart over the sequence by
    # what bf16 loses. The largest single error of one such computation is too noisy to compare
    # (it is one sample of a heavy tail), so the root-mean-square error is compared: against
    # the fp32 model, ours must stay within three times transformers' own bf16 error (plus 1 %
    # of the logits' RMS, for models where that error is near nothing).
    def rms(t):
        return t.pow(2).mean().sqrt().item()

    ours_err, theirs_err = rms(torch.cat(got, dim=1).double() - exact), rms(theirs - exact)
    bound = 3 * theirs_err + 0.01 * rms(exact)
    assert ours_err <= bound, f"{arch} bf16 (seed {seed}): RMS error {ours_err:.3g} against fp32 > {bound:.3g} " \
                              f"(transformers in bf16: {theirs_err:.3g})"


def mamba_ssm_layout(model, arch: str, vocab: int) -> tuple[dict, dict]:
    """(config, weights) of a transformers model as mamba_ssm's MambaLMHeadModel saves it."""
    c = model.config
    ssm_cfg = {"d_state": c.state_size, "d_conv": c.conv_kernel, "expand": c.expand}
    if arch == "mamba2":
        ssm_cfg.update(layer="Mamba2", headdim=c.head_dim, ngroups=c.n_groups, chunk_size=c.chunk_size)
    else:
        ssm_cfg.update(dt_rank=c.time_step_rank)
    config = {"d_model": c.hidden_size, "d_intermediate": 0, "n_layer": c.num_hidden_layers, "vocab_size": vocab,
              "ssm_cfg": ssm_cfg, "rms_norm": True, "residual_in_fp32": True, "fused_add_norm": True,
              "pad_vocab_size_multiple": 8, "tie_embeddings": c.tie_word_embeddings}
    weights = {name.replace("backbone.embeddings.", "backbone.embedding."): p.detach().clone()
               for name, p in model.state_dict().items()}
    return config, weights


@pytest.mark.parametrize("config", [
    pytest.param({"d_model": 8, "n_layer": 1}, id="mamba_ssm"),
    pytest.param({"arch": "mamba", "d_model": 8, "n_layer": 1}, id="arch"),
])
def test_a_mamba_ssm_layout_keeps_the_residual_in_fp32_unless_told_not_to(config):
    """mamba_ssm's MambaConfig defaults residual_in_fp32 to True; absent, it was read as False
    (found in review: a bf16 model's composed path rounded its residual)."""
    from bridge.models.config import parse_config

    assert parse_config(config).residual_in_fp32 is True
    assert parse_config({**config, "residual_in_fp32": False}).residual_in_fp32 is False


@pytest.mark.parametrize("arch, fmt", [("mamba", "bin"), ("mamba2", "safetensors")])
def test_a_mamba_ssm_checkpoint_with_a_padded_vocabulary(serve, checkpoints, arch, fmt):
    """mamba_ssm pads the embedding to a multiple of pad_vocab_size_multiple: a vocabulary of 37
    has 40 rows, and logits come back 40 wide, as from mamba_ssm."""
    seed = random_seed()
    make = tiny_mamba if arch == "mamba" else tiny_mamba2
    model = randomized(getattr(transformers, "MambaForCausalLM" if arch == "mamba" else "Mamba2ForCausalLM")(
        make(seed, vocab_size=40, tie_word_embeddings=True)))
    config, weights = mamba_ssm_layout(model, arch, vocab=VOCAB)
    directory = checkpoints[0] / f"mamba-ssm-{arch}"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config))
    if fmt == "bin":
        torch.save(weights, directory / "pytorch_model.bin")
    else:
        weights.pop("lm_head.weight", None)  # tied: safetensors holds one copy
        save_file(weights, str(directory / "model.safetensors"))
    srv, conn = serve(), RecordingConnection()
    info = call(srv, conn, "model_load", path=directory.name)
    assert info["vocab_size"] == 40
    session = call(srv, conn, "session_open", model=info["model"], batch=2)["session"]
    tokens = torch.randint(0, VOCAB, (2, PREFIX + 3))
    got = [call(srv, conn, "model_forward", session=session, tokens=tokens[:, :PREFIX])["logits"]]
    got += [call(srv, conn, "model_step", session=session, tokens=tokens[:, t])["logits"][:, None]
            for t in range(PREFIX, PREFIX + 3)]
    rel_close(torch.cat(got, dim=1), oracle_outputs(model, tokens, "logits"), 1e-4, f"{arch} (seed {seed})")


@pytest.mark.parametrize("layout", ["transformers-mamba2", "mamba_ssm-mamba"])
def test_a_config_leaving_a_key_out_takes_its_librarys_default(serve, checkpoints, layout):
    """A key a config.json leaves out takes the default of its layout's library, as that library
    reads the config: transformers' Mamba2Config has n_groups 8, mamba_ssm's MambaConfig has
    pad_vocab_size_multiple 8 with or without an ssm_cfg. Both were read as 1, and the checkpoints
    refused as mis-shaped (found in review)."""
    seed = random_seed()
    directory = checkpoints[0] / f"library-defaults-{layout}"
    if layout == "transformers-mamba2":
        model = randomized(transformers.Mamba2ForCausalLM(tiny_mamba2(seed, num_heads=8, head_dim=3, n_groups=8)))
        model.save_pretrained(directory)
        config = json.loads((directory / "config.json").read_text())
        del config["n_groups"]
        (directory / "config.json").write_text(json.dumps(config))
        assert transformers.Mamba2Config.from_pretrained(directory).n_groups == 8
    else:
        # mamba_ssm's Mamba-1 mixer defaults throughout (d_state 16, d_conv 4, expand 2, dt_rank
        # "auto"), so no ssm_cfg; its vocabulary of 37 padded to 40 rows.
        model = randomized(transformers.MambaForCausalLM(
            tiny_mamba(seed, vocab_size=40, state_size=16, time_step_rank="auto", tie_word_embeddings=True)))
        config, weights = mamba_ssm_layout(model, "mamba", vocab=VOCAB)
        del config["ssm_cfg"], config["pad_vocab_size_multiple"]
        directory.mkdir()
        (directory / "config.json").write_text(json.dumps(config))
        weights.pop("lm_head.weight", None)  # tied: safetensors holds one copy
        save_file(weights, str(directory / "model.safetensors"))
    tokens, got = prefill_then_step_logits(serve(), directory.name, steps=3)
    rel_close(got, oracle_outputs(model, tokens, "logits"), 1e-4, f"{layout} (seed {seed})")


def prefill_then_step_logits(srv, path: str, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random tokens [2, PREFIX + steps] and the logits of the checkpoint at `path` for them: a
    prefill of PREFIX, then a step a token."""
    conn = RecordingConnection()
    info = call(srv, conn, "model_load", path=path)
    session = call(srv, conn, "session_open", model=info["model"], batch=2)["session"]
    tokens = torch.randint(0, VOCAB, (2, PREFIX + steps))
    got = [call(srv, conn, "model_forward", session=session, tokens=tokens[:, :PREFIX])["logits"]]
    got += [call(srv, conn, "model_step", session=session, tokens=tokens[:, t])["logits"][:, None]
            for t in range(PREFIX, PREFIX + steps)]
    return tokens, torch.cat(got, dim=1)


def test_a_mamba2_time_step_limit_clamps_the_prefill_and_the_steps_alike(serve, checkpoints):
    """time_step_limit clamps dt in the prefill and in every step. transformers clamps it in its
    chunked prefill but not in its cached step (nor does mamba_ssm's step): the server's prefill
    then steps equal transformers' prefill of the whole sequence, which its own cached steps do
    not where the limit bites."""
    seed = random_seed()
    model = randomized(transformers.Mamba2ForCausalLM(tiny_mamba2(seed, time_step_limit=(0.05, 0.4))))
    directory = checkpoints[0] / "mamba2-time-step-limit"
    model.save_pretrained(directory)
    tokens, got = prefill_then_step_logits(serve(cpu_backends()[-1]), directory.name, steps=4)
    with torch.no_grad():
        whole = model(tokens).logits
    rel_close(got, whole, 1e-4, f"time_step_limit (seed {seed})")


def test_a_sharded_checkpoint_loads_like_the_whole_one(serve, checkpoints, tmp_path):
    model, _, seed = checkpoints[1]["mamba2-lm"]
    sharded = checkpoints[0] / "mamba2-sharded"
    model.save_pretrained(sharded, max_shard_size="8KB")
    assert (sharded / "model.safetensors.index.json").exists()
    srv, conn = serve(), RecordingConnection()
    tokens = torch.randint(0, VOCAB, (1, 6))
    outputs = []
    for path in ("mamba2-lm", "mamba2-sharded"):
        info = call(srv, conn, "model_load", path=path)
        session = call(srv, conn, "session_open", model=info["model"], batch=1)["session"]
        outputs.append(call(srv, conn, "model_forward", session=session, tokens=tokens)["logits"])
    assert torch.equal(*outputs)


def backbone_request(model) -> tuple[dict, dict]:
    """ExPhil's case: a Mamba-2 backbone's config and weights held by the client, no embedding."""
    c = model.config
    config = {"arch": "mamba2", "d_model": c.hidden_size, "n_layer": c.num_hidden_layers, "d_state": c.state_size,
              "d_conv": c.conv_kernel, "expand": c.expand, "headdim": c.head_dim, "ngroups": c.n_groups,
              "residual_in_fp32": True}
    weights = {name: p.detach().clone() for name, p in model.state_dict().items() if not name.startswith("embeddings")}
    return config, weights


@pytest.mark.parametrize("passes", [False, True], ids=["whole", "in-passes"])
def test_a_backbone_sent_by_the_client_takes_embeddings_and_gives_hidden_states(serve, checkpoints, passes,
                                                                               monkeypatch):
    """In passes: the prefill's window of embeddings past PREFILL_PASS_ELEMENTS (shrunk here to
    passes of 4 positions) runs as passes, as a window of tokens does."""
    from bridge.models import runtime

    ran = []
    model, _, seed = checkpoints[1]["mamba2-backbone"]
    if passes:
        monkeypatch.setattr(runtime, "PREFILL_PASS_ALIGN", 4)
        monkeypatch.setattr(runtime, "PREFILL_PASS_ELEMENTS", 2 * position_width(model) * 5)  # 2 rows: 4 positions
        in_passes = runtime.Model._forward_in_passes
        monkeypatch.setattr(runtime.Model, "_forward_in_passes",
                            lambda self, *a, **k: ran.append(a[3]) or in_passes(self, *a, **k))
    config, weights = backbone_request(model)
    srv, conn = serve(), RecordingConnection()
    handle = call(srv, conn, "put", tensor=weights.pop("norm_f.weight"))["handle"]
    info = call(srv, conn, "model_load", config=config, weights={**weights, "norm_f.weight": {"handle": handle}})
    assert "vocab_size" not in info and info["outputs"] == ["hidden"]
    session = call(srv, conn, "session_open", model=info["model"], batch=2)["session"]
    embeds = torch.randn(2, PREFIX + 5, 12)
    got = [call(srv, conn, "model_forward", session=session, embeds=embeds[:, :PREFIX])["hidden"]]
    got += [call(srv, conn, "model_step", session=session, embeds=embeds[:, t])["hidden"][:, None]
            for t in range(PREFIX, PREFIX + 5)]
    with torch.no_grad():
        expected = model(inputs_embeds=embeds).last_hidden_state
    rel_close(torch.cat(got, dim=1), expected, 1e-4, f"backbone (seed {seed})")
    assert ran == ([4] if passes else []), ran
    assert error_of(srv, conn, "model_step", session=session, tokens=torch.zeros(2, dtype=torch.int64))["detail"][
        "field"] == "args.tokens"


@pytest.fixture
def stepped(serve):
    """A Mamba-2 LM session prefilled and stepped a few frames on the C++ backend where built."""
    srv, conn = serve(cpu_backends()[-1]), RecordingConnection()
    info = call(srv, conn, "model_load", path="mamba2-lm")
    session = call(srv, conn, "session_open", model=info["model"], batch=2)["session"]
    call(srv, conn, "model_forward", session=session, tokens=torch.randint(0, VOCAB, (2, PREFIX)))
    for _ in range(3):
        call(srv, conn, "model_step", session=session, tokens=torch.randint(0, VOCAB, (2,)))
    return srv, conn, info, session


def run_frames(srv, conn, session, frames):
    return torch.stack([call(srv, conn, "model_step", session=session, tokens=f)["logits"] for f in frames])


def test_rollback_restores_the_state_exactly(stepped):
    """Netcode: snapshot at frame N, run M frames, restore, run the same M: identical outputs;
    re-simulating the M frames with one model_forward instead agrees to rounding."""
    srv, conn, _, session = stepped
    snapshot = call(srv, conn, "session_snapshot", session=session)["snapshot"]
    frames = torch.randint(0, VOCAB, (7, 2))
    first = run_frames(srv, conn, session, frames)
    call(srv, conn, "session_restore", session=session, snapshot=snapshot)
    assert torch.equal(run_frames(srv, conn, session, frames), first)
    call(srv, conn, "session_restore", session=session, snapshot=snapshot)
    resimulated = call(srv, conn, "model_forward", session=session, tokens=frames.T)["logits"]
    rel_close(resimulated.transpose(0, 1), first, 1e-5, "re-simulated window")
    call(srv, conn, "snapshot_free", snapshot=snapshot)
    assert error_of(srv, conn, "session_restore", session=session, snapshot=snapshot)["code"] == "unknown_snapshot"
    assert srv.server.sessions.usage()["snapshot_bytes"] == 0


def test_a_fork_diverges_independently(stepped):
    srv, conn, _, session = stepped
    state_before = call(srv, conn, "session_state", session=session)["state"]
    fork = call(srv, conn, "session_fork", session=session)["session"]
    ours, theirs = torch.randint(0, VOCAB, (4, 2)), torch.randint(0, VOCAB, (4, 2))
    forked = run_frames(srv, conn, fork, theirs)
    original = run_frames(srv, conn, session, ours)
    # The original saw nothing of the fork's frames: a session restored from its state agrees.
    again = call(srv, conn, "session_open", model=srv_model(srv, conn, session), batch=2, state=state_before)["session"]
    assert torch.equal(run_frames(srv, conn, again, ours), original)
    again_fork = call(srv, conn, "session_open", model=srv_model(srv, conn, session), batch=2, state=state_before)["session"]
    assert torch.equal(run_frames(srv, conn, again_fork, theirs), forked)


def srv_model(srv, conn, session_id: str) -> str:
    return srv.server.session(conn, session_id, "test").layout.model


def test_session_state_names_every_layer_part(stepped):
    srv, conn, info, session = stepped
    state = call(srv, conn, "session_state", session=session)["state"]
    assert sorted(state) == ["layers.0.conv", "layers.0.ssm", "layers.1.conv", "layers.1.ssm"]
    assert tuple(state["layers.0.ssm"].shape) == (2, 4, 6, 6) and tuple(state["layers.1.conv"].shape) == (2, 48, 3)
    assert sum(t.numel() * 4 for t in state.values()) == 2 * info["state_bytes_per_row"]


def test_steps_of_sessions_of_one_model_share_a_pass(stepped):
    srv, conn, info, session = stepped
    other = call(srv, conn, "session_fork", session=session)["session"]
    tokens = torch.randint(0, VOCAB, (2,))
    alone = call(srv, conn, "model_step", session=call(srv, conn, "session_fork", session=session)["session"],
                 tokens=tokens)["logits"]
    srv.hold(conn)
    ids = [srv.submit(conn, "model_step", session=s, tokens=tokens) for s in (session, other)]
    srv.go()
    replies = [conn.reply(i) for i in ids]
    assert [r.timing["batch_rows"] for r in replies] == [4, 4]
    from bridge.client import result_from_wire
    for reply in replies:
        assert torch.equal(result_from_wire(reply.result, as_torch=True)["logits"], alone)


@pytest.mark.parametrize("arch", ["mamba", "mamba2"])
def test_ten_thousand_fp32_steps_stay_near_a_float64_run(arch, checkpoints):
    """The state accumulates in fp32 over a long game: after 10,000 frames the fp32 stack still
    agrees with the same stack in float64."""
    model = checkpoints[1]["mamba-lm-tied" if arch == "mamba" else "mamba2-lm"][0]
    weights = {name: p.detach() for name, p in model.state_dict().items()}
    config = json.loads(model.config.to_json_string())
    runs = {}
    # fp32 on the C++ backend's fused step where it is built (the server's path), float64 composed.
    backends = {torch.float32: cpu_backends()[-1], torch.float64: "torch"}
    for dtype in (torch.float32, torch.float64):
        m = load_weights(config, weights, dtype, torch.device("cpu"), lambda n: None)
        parts = {name: torch.zeros((1, *shape), dtype=dtype) for name, shape in m.config.state_parts()}
        runs[dtype] = (m, parts)
    slots = torch.zeros(1, dtype=torch.int64)
    generator = torch.Generator().manual_seed(random_seed())
    tokens = torch.randint(0, VOCAB, (10_000, 1), generator=generator)
    worst = 0.0
    with torch.no_grad():
        for t, token in enumerate(tokens):
            out = {dtype: m.step(parts, slots, token, output="logits", backend=backends[dtype])
                   for dtype, (m, parts) in runs.items()}
            if t % 500 == 499:
                scale = out[torch.float64].abs().max().item()
                worst = max(worst, (out[torch.float32].double() - out[torch.float64]).abs().max().item() / scale)
    assert worst < 1e-4, f"fp32 drifted {worst:.3g} (relative) from float64"


@pytest.mark.parametrize("arch", ["mamba-lm-untied", "mamba2-lm"])
def test_the_fused_step_is_the_composed_one(checkpoints, arch):
    """The C++ backend's one-call model step against the same step composed of torch ops and
    kernels calls: outputs and every state part, rows in scattered pool slots, random state."""
    if scan_kernels.model_step_kernel("cpu", cpu_backends()[-1]) is None:
        pytest.skip("no fused model step: the C++ backend is not built here (make kernels)")
    model = checkpoints[1][arch][0]
    config = json.loads(model.config.to_json_string())
    m = load_weights(config, {k: v.detach() for k, v in model.state_dict().items()}, torch.float32,
                     torch.device("cpu"), lambda n: None)
    generator = torch.Generator().manual_seed(random_seed())
    fused = {name: torch.randn((6, *shape), generator=generator) * 0.3 for name, shape in m.config.state_parts()}
    composed = {name: t.clone() for name, t in fused.items()}
    slots = torch.tensor([5, 0, 3])
    with torch.no_grad():
        for _ in range(6):
            tokens = torch.randint(0, VOCAB, (3,), generator=generator)
            a = m.step(fused, slots, tokens, output="logits", backend="cpu")
            b = m.step(composed, slots, tokens, output="logits", backend="cpu", fused=False)
            rel_close(a, b, 1e-5, f"{arch} logits")
    for name in fused:
        rel_close(fused[name], composed[name], 1e-5, f"{arch} {name}")
    # Slots come from the server's sessions; one outside the pool is refused, not written past.
    with pytest.raises(ValueError, match="outside the pool"):
        m.step(fused, torch.tensor([6]), tokens[:1], output="logits", backend="cpu")


def _shorter(t: torch.Tensor, axis: int = 0) -> torch.Tensor:
    return t.narrow(axis, 0, t.shape[axis] - 1).contiguous()


def _not_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t.t().contiguous().t() if t.dim() == 2 else t[:1].expand(t.shape)


# A layer's tensors as scan_kernels.model_step_kernel takes them (binding.cpp's LayerTensor), one
# made wrong; each read through a raw pointer, past its end or at the wrong place.
FUSED_BAD_LAYER_TENSORS = {
    "norm-short": ("mamba", 0, "norm", _shorter),
    "conv-not-contiguous": ("mamba", 3, "conv", _not_contiguous),
    "conv-bias-short": ("mamba2", 4, "conv bias", _shorter),
    "A-wrong-state-size": ("mamba", 5, "A", lambda t: _shorter(t, 1)),
    "A-expanded": ("mamba2", 5, "A", _not_contiguous),
    "D-short": ("mamba2", 6, "D", _shorter),
    "dt-bias-bf16": ("mamba2", 7, "dt_bias", lambda t: t.bfloat16()),
    "in-proj-short": ("mamba2", 1, "in_proj", _shorter),
    "out-proj-short": ("mamba", 8, "out_proj", _shorter),
    "x-proj-short": ("mamba", 10, "x_proj", _shorter),
    "gate-norm-short": ("mamba2", 12, "gate norm", _shorter),
    "conv-state-narrow": ("mamba2", 13, "conv state", lambda t: _shorter(t, 2)),
    "ssm-state-short": ("mamba", 14, "ssm state", lambda t: _shorter(t, 2)),
    "ssm-state-of-mamba1-shape": ("mamba2", 14, "ssm state", lambda t: t.flatten(1, 2)),
}


@pytest.mark.parametrize("kernel", ["step", "forward"])
@pytest.mark.parametrize("case", FUSED_BAD_LAYER_TENSORS)
def test_the_fused_kernels_refuse_a_layer_tensor_they_would_misread(case, kernel):
    """scan_kernels.model_step_kernel and model_forward_kernel are public: a caller's layer
    tensor of the wrong size, layout or dtype is a ValueError naming it. Found in review: only
    their presence was checked, and the loops read norms, convs, A, D and dt_bias through raw
    pointers past their ends (a bridge model builds them right; a direct caller need not)."""
    which = scan_kernels.model_step_kernel if kernel == "step" else scan_kernels.model_forward_kernel
    fused = which("cpu", cpu_backends()[-1])
    if fused is None:
        pytest.skip("no fused model step: the C++ backend is not built here (make kernels)")
    arch, index, name, spoil = FUSED_BAD_LAYER_TENSORS[case]
    seed = random_seed()
    model = (transformers.MambaForCausalLM(tiny_mamba(seed, hidden_size=11)) if arch == "mamba" else
             transformers.Mamba2ForCausalLM(tiny_mamba2(seed, hidden_size=11, num_heads=2, head_dim=11)))
    config = json.loads(model.config.to_json_string())
    m = load_weights(config, {k: v.detach() for k, v in model.state_dict().items()}, torch.float32,
                     torch.device("cpu"), lambda n: None)
    state = {part: torch.zeros((2, *shape)) for part, shape in m.config.state_parts()}
    layers = [list(weights) + [state[part] for part in layer_state_names(i)]
              for i, weights in enumerate(m._fused_weights)]
    inputs = torch.zeros((1, m.config.d_model) if kernel == "step" else (1, 3, m.config.d_model))
    call = (inputs, torch.tensor([1]), layers, m._fused_norm_f, m._fused_dims, m.config.eps, None, None)
    with torch.no_grad():
        fused(*call)  # as the model builds them: taken
        layers[0][index] = spoil(layers[0][index])
        with pytest.raises(ValueError, match=f"layer 0 {name}: expected"):
            fused(*call)


@pytest.mark.parametrize("dims", [[2, 22, 4, 1, 2, 11, 1], [1, 22, 4, 1, 3, 11, 1], [1, 22, 4, 1, 2, 11, 4]],
                         ids=["no-such-arch", "heads-times-headdim-not-d-inner", "groups-not-dividing-heads"])
def test_the_fused_step_refuses_dims_it_would_misread(dims):
    fused = scan_kernels.model_step_kernel("cpu", cpu_backends()[-1])
    if fused is None:
        pytest.skip("no fused model step: the C++ backend is not built here (make kernels)")
    with pytest.raises(ValueError, match="model_step: dims"):
        fused(torch.zeros(1, 11), torch.tensor([0]), [], torch.ones(11), dims, 1e-5, None, None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("arch", ["mamba", "mamba2"])
def test_a_rows_fused_step_does_not_depend_on_the_rows_beside_it(arch, dtype):
    """A session's frame gives the same bits stepped alone as in a pass with other sessions'
    rows (the batcher shares passes), so that a rollback's re-simulation reproduces a frame that
    was batched. Widths of no vector size's multiple (22 channels, 46 conv outputs), so that
    some values of a pass fall past its last whole vector. The state walk found the silu of the
    conv outputs and gates taking another exp there than in the vectors; checking its reach found
    a bf16 model's products summing the remainder of their inputs otherwise for one row than for
    many."""
    if scan_kernels.model_step_kernel("cpu", cpu_backends()[-1]) is None:
        pytest.skip("no fused model step: the C++ backend is not built here (make kernels)")
    seed = random_seed()
    if arch == "mamba":
        model = transformers.MambaForCausalLM(tiny_mamba(seed, hidden_size=11, tie_word_embeddings=False))
    else:
        model = transformers.Mamba2ForCausalLM(tiny_mamba2(seed, hidden_size=11, num_heads=2, head_dim=11))
    model = randomized(model)
    config = json.loads(model.config.to_json_string())
    m = load_weights(config, {k: v.detach() for k, v in model.state_dict().items()}, dtype,
                     torch.device("cpu"), lambda n: None)
    generator = torch.Generator().manual_seed(seed)
    state = {name: torch.randn((7, *shape), generator=generator) * 0.3 for name, shape in m.config.state_parts()}
    slots = torch.tensor([6, 1, 4, 0, 2])
    tokens = torch.randint(0, VOCAB, (len(slots),), generator=generator)
    with torch.no_grad():
        together = {name: t.clone() for name, t in state.items()}
        out = m.step(together, slots, tokens, output="logits", backend="cpu")
        for row, slot in enumerate(slots.tolist()):
            alone = {name: t.clone() for name, t in state.items()}
            mine = m.step(alone, slots[row:row + 1], tokens[row:row + 1], output="logits", backend="cpu")
            assert torch.equal(mine[0], out[row]), f"{arch} {dtype}: row {row}'s logits differ stepped alone"
            for name in state:
                assert torch.equal(alone[name][slot], together[name][slot]), \
                    f"{arch} {dtype}: row {row}'s {name} differs stepped alone"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("arch", ["mamba-lm-untied", "mamba2-lm"])
def test_the_prefill_takes_the_backends_products_and_agrees_with_torchs(checkpoints, arch, dtype, monkeypatch):
    """On the C++ backend the composed prefill's matrix products are the fused step's (kernels.
    linear_kernel): every one of them, and the outputs and every state part agree with the same
    prefill through F.linear; rows in scattered pool slots, random state."""
    product = scan_kernels.linear_kernel("cpu", cpu_backends()[-1])
    if product is None:
        pytest.skip("no backend product: the C++ backend is not built here (make kernels)")
    model = checkpoints[1][arch][0]
    m = load_weights(json.loads(model.config.to_json_string()), {k: v.detach() for k, v in model.state_dict().items()},
                     dtype, torch.device("cpu"), lambda n: None)
    generator = torch.Generator().manual_seed(random_seed())
    ours = {name: torch.randn((6, *shape), generator=generator) * 0.3 for name, shape in m.config.state_parts()}
    theirs = {name: t.clone() for name, t in ours.items()}
    slots = torch.tensor([5, 0, 3])
    tokens = torch.randint(0, VOCAB, (3, 9), generator=generator)
    calls = []
    monkeypatch.setattr(scan_kernels, "linear_kernel", lambda *a: lambda *x: calls.append(1) or product(*x))
    with torch.no_grad():
        a = m.forward(ours, slots, tokens, output="logits", backend="cpu", fused=False)
        per_layer = 4 if m.arch == "mamba" else 2  # in_proj, (x_proj, dt_proj,) out_proj
        assert len(calls) == per_layer * m.config.n_layer, f"{len(calls)} products by the backend's kernel"
        monkeypatch.setattr(scan_kernels, "linear_kernel", lambda *a: None)
        b = m.forward(theirs, slots, tokens, output="logits", backend="cpu", fused=False)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: torch rounds each product's output
    rel_close(a, b, tolerance, f"{arch} {dtype} logits")
    for name in ours:
        rel_close(ours[name], theirs[name], tolerance, f"{arch} {dtype} {name}")


FUSED_PREFILLS = {  # (rows, seq, output, last_only): a window, one position, two, logits of the last
    "window-hidden": (3, 9, "hidden", False),
    "one-position": (2, 1, "logits", False),
    "two-positions": (1, 2, "hidden", False),
    "window-last-logits": (3, 7, "logits", True),
}


@pytest.mark.parametrize("case", FUSED_PREFILLS)
@pytest.mark.parametrize("arch", ["mamba-lm-untied", "mamba2-lm"])
def test_the_fused_prefill_is_the_composed_one(checkpoints, arch, case):
    """The C++ backend's one-call prefill (scan_kernels.model_forward_kernel) against the same prefill
    composed of torch ops and kernels calls: outputs and every state part, rows in scattered pool
    slots, random state, then a second window from the state the first left."""
    if scan_kernels.model_forward_kernel("cpu", cpu_backends()[-1]) is None:
        pytest.skip("no fused prefill: the C++ backend is not built here (make kernels)")
    rows, seq, output, last_only = FUSED_PREFILLS[case]
    model = checkpoints[1][arch][0]
    m = load_weights(json.loads(model.config.to_json_string()), {k: v.detach() for k, v in model.state_dict().items()},
                     torch.float32, torch.device("cpu"), lambda n: None)
    generator = torch.Generator().manual_seed(random_seed())
    fused = {name: torch.randn((7, *shape), generator=generator) * 0.3 for name, shape in m.config.state_parts()}
    composed = {name: t.clone() for name, t in fused.items()}
    slots = torch.randperm(7, generator=generator)[:rows]
    with torch.no_grad():
        for window in range(2):
            tokens = torch.randint(0, VOCAB, (rows, seq), generator=generator)
            a = m.forward(fused, slots, tokens, output=output, last_only=last_only, backend="cpu")
            b = m.forward(composed, slots, tokens, output=output, last_only=last_only, backend="cpu", fused=False)
            assert a.shape == b.shape
            rel_close(a, b, 1e-5, f"{arch} {case} window {window} {output}")
    for name in fused:
        rel_close(fused[name], composed[name], 1e-5, f"{arch} {case} {name}")
    # Slots come from the server's sessions; one outside the pool is refused, not written past.
    with pytest.raises(ValueError, match="outside the pool"):
        m.forward(fused, torch.tensor([7]), tokens[:1], output=output, backend="cpu")


def _bf16_step_frames(model, parts, slots, generator, oracle=False):
    """Six steps, hidden and logits in turn: (output, the step's output) each."""
    for t in range(6):
        tokens = torch.randint(0, VOCAB, (2,), generator=generator)
        output = "hidden" if t % 2 else "logits"
        yield output, model.step(parts, slots, tokens, output=output, backend="torch" if oracle else "cpu",
                                 fused=not oracle)


def _bf16_prefill_frames(model, parts, slots, generator, oracle=False):
    """Two windows of 8 positions, logits then the last position's hidden state."""
    for output, last_only in (("logits", False), ("hidden", True)):
        tokens = torch.randint(0, VOCAB, (2, 8), generator=generator)
        yield output, model.forward(parts, slots, tokens, output=output, last_only=last_only,
                                    backend="torch" if oracle else "cpu", fused=not oracle)


BF16_FUSED = {"step": (scan_kernels.model_step_kernel, _bf16_step_frames),
              "prefill": (scan_kernels.model_forward_kernel, _bf16_prefill_frames)}


@pytest.mark.parametrize("call", BF16_FUSED)
@pytest.mark.parametrize("arch", ["mamba-lm-untied", "mamba2-lm"])
def test_a_bf16_models_fused_kernels_are_the_float64_model_of_its_weights(checkpoints, arch, call):
    """A model loaded in bf16 steps and prefills in the fused kernels too: its matrices read as
    bf16, widened exactly, everything else fp32. So it equals, to fp32's error, a float64 model
    holding the very values the bf16 model holds (each weight rounded as param_dtype keeps it),
    the state included, and the logits (the fused head is an fp32 product of the bf16 head); the
    rounding to bf16 itself is not this test's business."""
    from bridge.models.runtime import param_dtype

    kernel, frames = BF16_FUSED[call]
    if kernel("cpu", cpu_backends()[-1]) is None:
        pytest.skip(f"no fused {call}: the C++ backend is not built here (make kernels)")
    model = checkpoints[1][arch][0]
    config = json.loads(model.config.to_json_string())
    weights = {k: v.detach() for k, v in model.state_dict().items()}
    bf16 = load_weights(config, weights, torch.bfloat16, torch.device("cpu"), lambda n: None)
    held = {k: v.to(param_dtype(k, torch.bfloat16)).double() for k, v in weights.items()}
    oracle = load_weights(config, held, torch.float64, torch.device("cpu"), lambda n: None)
    generator = torch.Generator().manual_seed(random_seed())
    ours = {name: torch.randn((4, *shape), generator=generator) * 0.3 for name, shape in bf16.config.state_parts()}
    assert bf16._fused_kernel(ours, "cpu", kernel) is not None, f"a bf16 model's {call} must take the fused kernel"
    theirs = {name: t.double() for name, t in ours.items()}
    slots = torch.tensor([3, 1])
    seed = random_seed()
    with torch.no_grad():
        got = frames(bf16, ours, slots, torch.Generator().manual_seed(seed))
        want = frames(oracle, theirs, slots, torch.Generator().manual_seed(seed), oracle=True)
        for (output, a), (_, b) in zip(got, want, strict=True):
            assert a.dtype == torch.float32
            rel_close(a, b, 1e-4, f"{arch} bf16 {call} {output}")
    for name in ours:
        rel_close(ours[name], theirs[name], 1e-4, f"{arch} bf16 {call} {name}")


# -- bad checkpoints and requests: a structured error each, nothing held, the server serves on --

def corrupt(directory, how: str) -> None:
    path = directory / "model.safetensors"
    data = bytearray(path.read_bytes())
    header_len = int.from_bytes(data[:8], "little")
    if how == "truncated":
        path.write_bytes(data[: header_len + 8 + 10])
    elif how == "lying-header":
        header = json.loads(data[8:8 + header_len])
        name = next(k for k in header if k != "__metadata__")
        header[name]["data_offsets"][1] += 4096
        encoded = json.dumps(header).encode()
        encoded += b" " * (-len(encoded) % 8)
        path.write_bytes(len(encoded).to_bytes(8, "little") + encoded + bytes(data[8 + header_len:]))
    elif how == "garbage":
        path.write_bytes(b"\xff" * 64)


def edited_copy(root, source: str, name: str, *, config=None, weights=None):
    """A copy of checkpoint `source` with its config edited by `config(dict)` or its tensors by
    `weights(dict)`."""
    from safetensors.torch import load_file

    directory = root / name
    directory.mkdir()
    cfg = json.loads((root / source / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps(config(cfg) if config else cfg))
    tensors = load_file(str(root / source / "model.safetensors"))
    save_file(weights(tensors) if weights else tensors, str(directory / "model.safetensors"))
    return directory


def _drop(name):
    def edit(t):
        del t[name]
        return t
    return edit


def _reshape(name):
    def edit(t):
        t[name] = t[name][:-1].clone()
        return t
    return edit


def _add(name):
    def edit(t):
        t[name] = torch.zeros(3)
        return t
    return edit


def _nan(name):
    def edit(t):
        t[name] = t[name].clone()
        t[name].view(-1)[0] = float("nan")
        return t
    return edit


BAD_CHECKPOINTS = [
    # id, edit (config / weights / corrupt), error code, field
    ("missing-tensor", dict(weights=_drop("backbone.layers.1.mixer.dt_bias")), "invalid_checkpoint",
     "weights.layers.1.mixer.dt_bias"),
    ("mis-shaped", dict(weights=_reshape("backbone.layers.0.mixer.conv1d.weight")), "invalid_checkpoint",
     "weights.backbone.layers.0.mixer.conv1d.weight"),
    ("unexpected", dict(weights=_add("backbone.layers.0.mixer.extra")), "invalid_checkpoint",
     "weights.backbone.layers.0.mixer.extra"),
    ("not-finite", dict(weights=_nan("backbone.layers.0.mixer.out_proj.weight")), "invalid_checkpoint",
     "weights.backbone.layers.0.mixer.out_proj.weight"),
    ("unknown-arch", dict(config=lambda c: {**c, "model_type": "llama"}), "invalid_checkpoint",
     "config.json.model_type"),
    ("layernorm", dict(config=lambda c: {**c, "rms_norm": False}), "invalid_checkpoint", "config.json.rms_norm"),
    ("heads-disagree", dict(config=lambda c: {**c, "num_heads": 5}), "invalid_checkpoint", "config.json.num_heads"),
    # JSON bounds no int: one past a float's range was an OverflowError (internal_error), found in review.
    ("epsilon-past-floats", dict(config=lambda c: {**c, "layer_norm_epsilon": 10 ** 400}), "invalid_checkpoint",
     "config.json.layer_norm_epsilon"),
    ("size-past-floats", dict(config=lambda c: {**c, "hidden_size": 10 ** 400}), "invalid_checkpoint",
     "config.json.hidden_size"),
]


@pytest.mark.parametrize("name, edit, code, field", [pytest.param(*case, id=case[0]) for case in BAD_CHECKPOINTS])
def test_a_bad_checkpoint_is_named_and_nothing_is_kept(serve, checkpoints, name, edit, code, field):
    root = checkpoints[0]
    edited_copy(root, "mamba2-lm", f"bad-{name}", **edit)
    srv, conn = serve(), RecordingConnection()
    error = error_of(srv, conn, "model_load", path=f"bad-{name}")
    assert (error["code"], error["detail"]["field"]) == (code, field), error
    assert srv.server.sessions.usage()["model_bytes"] == 0 and len(srv.server.models) == 0
    assert call(srv, conn, "model_load", path="mamba2-lm")["layers"] == 2  # serves on


def test_a_saved_copy_of_a_tied_head_loads_only_as_the_embeddings(serve, checkpoints):
    """mamba_ssm saves a tied head's copy beside the embeddings: it was checked for shape and
    dropped, so a copy that differed (or was NaN) loaded and was served as the embeddings, where
    transformers projects with the copy (found in review)."""
    srv, conn = serve(), RecordingConnection()
    tokens = torch.tensor([[3, 1, 4, 1, 5]])
    logits, held = {}, []
    for name, head in (("same", lambda t: t.clone()), ("own", lambda t: t + 0.5),
                       ("not-finite", lambda t: torch.full_like(t, float("nan")))):
        directory = edited_copy(checkpoints[0], "mamba-lm-tied", f"tied-head-{name}",
                                weights=lambda t: {**t, "lm_head.weight": head(t["backbone.embeddings.weight"])})
        if name != "same":
            error = error_of(srv, conn, "model_load", path=directory.name)
            assert (error["code"], error["detail"]["field"]) == ("invalid_checkpoint", "weights.lm_head.weight"), error
            continue
        for path in (directory.name, "mamba-lm-tied"):
            loaded = call(srv, conn, "model_load", path=path)
            held.append(loaded["weight_bytes"])
            session = call(srv, conn, "session_open", model=loaded["model"], batch=1)["session"]
            logits[path] = call(srv, conn, "model_forward", session=session, tokens=tokens)["logits"]
    assert torch.equal(*logits.values())
    # The copy is read to be checked, not kept: the budget holds the model without it.
    assert held[0] == held[1] and srv.server.sessions.usage()["model_bytes"] == sum(held)


def test_a_sent_copy_of_a_tied_head_is_checked_as_a_files(serve):
    """model_load {config, weights} takes the same path: a sent lm_head.weight that is not the
    tied embeddings is refused (found by mutating the fix: only files were tested)."""
    from bridge.models.config import parse_config
    from bridge.models.weights import expected_shapes

    config = {"arch": "mamba", "d_model": 8, "n_layer": 1, "vocab_size": 16}
    weights = {name: torch.rand(shape) for name, shape in expected_shapes(parse_config(config)).items()}
    srv, conn = serve(), RecordingConnection()
    error = error_of(srv, conn, "model_load", config=config,
                     weights={**weights, "lm_head.weight": weights["embeddings.weight"] + 1})
    assert (error["code"], error["detail"]["field"]) == ("invalid_checkpoint", "args.weights.lm_head.weight"), error
    assert call(srv, conn, "model_load", config=config,
                weights={**weights, "lm_head.weight": weights["embeddings.weight"].clone()})["model"]


@pytest.mark.parametrize("raw, width", [
    # Mamba-1 with a wide state: x_proj's output, dt_rank + 2 state, is the widest buffer.
    ({"model_type": "mamba", "hidden_size": 16, "expand": 1, "state_size": 256, "num_hidden_layers": 1,
      "vocab_size": 16, "time_step_rank": 1}, 513),
    # Mamba-2 of many groups: in_proj's output, 2 d_inner + 2 groups state + heads.
    ({"model_type": "mamba2", "hidden_size": 64, "expand": 2, "num_heads": 8, "head_dim": 16, "n_groups": 8,
      "state_size": 128, "num_hidden_layers": 1, "vocab_size": 16}, 2312),
    # Mamba-2 of a wide state and one group: the chunked scan's states, d_inner state / 64.
    ({"model_type": "mamba2", "hidden_size": 256, "expand": 2, "num_heads": 8, "head_dim": 64, "n_groups": 1,
      "state_size": 256, "num_hidden_layers": 1, "vocab_size": 16}, 2048),
], ids=["mamba-x-proj", "mamba2-in-proj", "mamba2-chunk-states"])
def test_a_models_position_width_is_its_widest_buffer_a_position(raw, width):
    """What sizes a prefill's passes (SPEC §6.4): each term, where it is the widest, is the
    width (found by mutating the fix: dropping any of these three terms failed no test)."""
    assert parse_config(raw).position_width == width


def test_a_config_naming_the_activation_swish_loads_as_silu(serve, checkpoints):
    """transformers runs "swish" as SiLU: such a config was refused as an unknown activation."""
    srv, conn = serve(), RecordingConnection()
    tokens = torch.tensor([[2, 7, 1]])
    logits = []
    for arch in ("mamba-lm-tied", "mamba2-lm"):
        directory = edited_copy(checkpoints[0], arch, f"swish-{arch}", config=lambda c: {**c, "hidden_act": "swish"})
        for path in (directory.name, arch):
            model = call(srv, conn, "model_load", path=path)["model"]
            session = call(srv, conn, "session_open", model=model, batch=1)["session"]
            logits.append(call(srv, conn, "model_forward", session=session, tokens=tokens)["logits"])
    assert torch.equal(logits[0], logits[1]) and torch.equal(logits[2], logits[3])


@pytest.mark.parametrize("how", ["truncated", "lying-header", "garbage"])
def test_a_corrupt_safetensors_file_is_refused(serve, checkpoints, how):
    directory = edited_copy(checkpoints[0], "mamba-lm-tied", f"corrupt-{how}")
    corrupt(directory, how)
    srv, conn = serve(), RecordingConnection()
    error = error_of(srv, conn, "model_load", path=directory.name)
    assert (error["code"], error["detail"]["field"]) == ("invalid_checkpoint", "model.safetensors"), error
    assert srv.server.sessions.usage()["model_bytes"] == 0


def _own_layout_tensors(config: dict) -> dict:
    from bridge.models.config import parse_config
    from bridge.models.weights import expected_shapes

    return {name: torch.rand(shape) for name, shape in expected_shapes(parse_config(config)).items()}


def _write_safetensors(path, tensors: dict, packed: str) -> None:
    """A safetensors file of `tensors` (f32), `packed` declared F4 (two values a byte) with the
    shape it has: what safetensors writes for torch's float4_e2m1fn_x2."""
    header, blobs, offset = {}, [], 0
    for name in sorted(tensors, key=lambda n: n == packed):  # the odd-sized one last: the others stay aligned
        tensor = tensors[name]
        if name == packed:
            dtype, blob = "F4", bytes((tensor.numel() + 1) // 2)
        else:
            dtype, blob = "F32", tensor.numpy().tobytes()
        header[name] = {"dtype": dtype, "shape": list(tensor.shape), "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    path.write_bytes(len(encoded).to_bytes(8, "little") + encoded + b"".join(blobs))


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_a_weight_of_a_packed_float_dtype_is_refused_by_name(serve, checkpoints, fmt):
    """safetensors' F4 (torch's float4_e2m1fn_x2) is "floating" but packs two values a byte: torch
    cannot convert it, and the tensor safetensors makes of it is not the header's shape. Found in
    review: it passed the checks and failed in the conversion as internal_error."""
    config = {"arch": "mamba", "d_model": 4, "n_layer": 1, "vocab_size": 8}
    directory = checkpoints[0] / f"packed-float-{fmt}"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config))
    tensors = _own_layout_tensors(config)
    if fmt == "safetensors":
        _write_safetensors(directory / "model.safetensors", tensors, "norm_f.weight")
        field = "model.safetensors.norm_f.weight"
    else:
        tensors["norm_f.weight"] = torch.zeros(4, dtype=torch.uint8).view(torch.float4_e2m1fn_x2)
        torch.save(tensors, directory / "pytorch_model.bin")
        field = "pytorch_model.bin.norm_f.weight"
    srv, conn = serve(), RecordingConnection()
    error = error_of(srv, conn, "model_load", path=directory.name)
    assert (error["code"], error["detail"].get("field")) == ("invalid_checkpoint", field), error
    assert srv.server.sessions.usage()["model_bytes"] == 0 and len(srv.server.models) == 0


@pytest.mark.parametrize("stored", [
    pytest.param(lambda t: t.to_sparse(), id="sparse-coo"),
    pytest.param(lambda t: t.to_sparse_csr(), id="sparse-csr",
                 marks=pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")),
    pytest.param(lambda t: torch.empty_like(t, device="meta"), id="meta-no-data"),
])
def test_a_bin_weight_that_is_not_dense_data_is_refused_by_name(serve, checkpoints, stored):
    """torch.load keeps a sparse layout, and a model saved from the meta device holds no data:
    each failed the conversion as internal_error (found in review)."""
    config = {"arch": "mamba", "d_model": 4, "n_layer": 1, "vocab_size": 8}
    directory = checkpoints[0] / f"not-dense-{random_seed()}"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config))
    tensors = _own_layout_tensors(config)
    tensors["layers.0.mixer.out_proj.weight"] = stored(tensors["layers.0.mixer.out_proj.weight"])
    torch.save(tensors, directory / "pytorch_model.bin")
    srv, conn = serve(), RecordingConnection()
    error = error_of(srv, conn, "model_load", path=directory.name)
    field = "pytorch_model.bin.layers.0.mixer.out_proj.weight"
    assert (error["code"], error["detail"].get("field")) == ("invalid_checkpoint", field), error
    assert srv.server.sessions.usage()["model_bytes"] == 0 and len(srv.server.models) == 0


def test_a_bin_saved_from_parameters_that_require_grad_runs(serve, checkpoints):
    """torch.save(dict(model.named_parameters())) keeps requires_grad: loaded so, every forward
    and step failed on the runtime's in-place ops and left the session lost (found in review)."""
    config = {"arch": "mamba", "d_model": 4, "n_layer": 1, "vocab_size": 8}
    directory = checkpoints[0] / "bin-of-parameters"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config))
    tensors = {name: torch.nn.Parameter(t * 0.3) for name, t in _own_layout_tensors(config).items()}
    torch.save(tensors, directory / "pytorch_model.bin")
    srv, conn = serve(), RecordingConnection()
    info = call(srv, conn, "model_load", path=directory.name)
    session = call(srv, conn, "session_open", model=info["model"], batch=1)["session"]
    tokens = torch.randint(0, 8, (1, 3))
    assert call(srv, conn, "model_forward", session=session, tokens=tokens)["logits"].shape == (1, 3, 8)
    assert call(srv, conn, "model_step", session=session, tokens=tokens[:, 0])["logits"].shape == (1, 8)


class GatedLoads:
    """bridge.models.load_checkpoint held at its start until `go()`: a load that takes as long
    as the test wants. `started` is set once a load is inside it."""

    def __init__(self, monkeypatch):
        import bridge.models

        self.started, self._gate = threading.Event(), threading.Event()
        load = bridge.models.load_checkpoint

        def gated(*args, **kwargs):
            self.started.set()
            if not self._gate.wait(60):
                raise TimeoutError("the test never let the load go on")
            return load(*args, **kwargs)

        monkeypatch.setattr(bridge.models, "load_checkpoint", gated)

    def go(self) -> None:
        self._gate.set()


def test_a_load_lets_other_connections_run_and_holds_back_its_own(serve, monkeypatch):
    """A checkpoint's read runs apart from the other ops: another connection's requests are
    answered while it reads (found in review: a load on one connection stalled every game's
    steps for all of it), and its own connection's later requests wait for its reply, in order."""
    srv = serve()
    loader, other = RecordingConnection(), RecordingConnection()
    model = call(srv, other, "model_load", path="mamba-lm-tied")["model"]
    session = call(srv, other, "session_open", model=model, batch=1)["session"]
    gate = GatedLoads(monkeypatch)
    load_id = srv.submit(loader, "model_load", path="mamba2-lm")
    assert gate.started.wait(60)
    after_load = [srv.submit(loader, "ping"), srv.submit(loader, "info")]
    # Served while the load is held: a step of the other connection's model, and a ping.
    assert call(srv, other, "model_step", session=session, tokens=torch.tensor([3]))["logits"].shape == (1, VOCAB)
    assert call(srv, other, "ping")["pong"] is True
    assert loader.answered == []
    gate.go()
    assert loader.reply(load_id).ok
    assert all(loader.reply(request_id).ok for request_id in after_load)
    assert loader.answered == [load_id, *after_load]


def test_a_load_failing_in_the_background_is_answered_and_its_connection_served_on(serve, checkpoints,
                                                                                     monkeypatch):
    gate = GatedLoads(monkeypatch)
    directory = edited_copy(checkpoints[0], "mamba2-lm", "background-nan",
                            weights=_nan("backbone.layers.0.mixer.out_proj.weight"))
    srv, conn = serve(), RecordingConnection()
    load_id = srv.submit(conn, "model_load", path=directory.name)
    assert gate.started.wait(60)
    ping_id = srv.submit(conn, "ping")
    gate.go()
    assert conn.reply(load_id).error["code"] == "invalid_checkpoint"
    assert conn.reply(ping_id).ok and conn.answered == [load_id, ping_id]
    assert srv.server.sessions.usage()["model_bytes"] == 0 and len(srv.server.models) == 0


def test_stopping_serves_what_a_background_load_held_back_and_refuses_what_came_after(serve, monkeypatch):
    """stop() lets the worker serve what was queued before it, a background load's connection's
    requests behind it included, once the load is answered; what comes after the stop is
    answered shutting_down. A stop out of time leaves nothing unanswered once the load ends and
    stop() is called again (found in review: the held requests were never answered)."""
    gate = GatedLoads(monkeypatch)
    srv, conn, late = serve(), RecordingConnection(), RecordingConnection()
    load_id = srv.submit(conn, "model_load", path="mamba-lm-tied")
    assert gate.started.wait(60)
    ping_id = srv.submit(conn, "ping")
    assert srv.dispatcher.stop(0.2) is False  # the worker waits for the load
    late_id = srv.submit(late, "info")
    gate.go()
    assert srv.dispatcher.stop(60) is True
    assert conn.reply(load_id).ok and conn.reply(ping_id).ok and conn.answered == [load_id, ping_id]
    assert late.reply(late_id).error["code"] == "shutting_down"


def test_a_zmq_peers_requests_each_with_its_own_reply_target_wait_for_its_load(serve, monkeypatch):
    """A ZeroMQ peer's requests each come with a reply target of their own, the peer's id on
    every one: they were not held back behind its load (found in review), and a shutdown sent
    after a load ran beside it."""
    gate = GatedLoads(monkeypatch)
    srv, first, second = serve(), RecordingConnection(), RecordingConnection()
    second.id = first.id  # two reply targets of one peer
    load_id = srv.submit(first, "model_load", path="mamba-lm-tied")
    assert gate.started.wait(60)
    ping_id = srv.submit(second, "ping")
    with pytest.raises(TimeoutError):
        second.reply(ping_id, timeout=0.3)
    gate.go()
    assert first.reply(load_id).ok and second.reply(ping_id).ok


def test_paths_outside_the_model_dirs_are_refused_before_anything_is_read(serve, checkpoints, tmp_path, inproc):
    root = checkpoints[0]
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "config.json").write_text("{}")
    os.symlink(outside, root / "escape")
    # Inside, but its files are links out: nothing outside is read through them either.
    linked = root / "linked-config"
    linked.mkdir()
    os.symlink(outside / "config.json", linked / "config.json")
    srv, conn = serve(), RecordingConnection()
    error = error_of(srv, conn, "model_load", path="linked-config")
    assert (error["code"], error["detail"]["field"]) == ("invalid_checkpoint", "config.json"), error
    for path in (str(outside), "../" + outside.name, "escape", "/etc", str(root / ".." / "outside")):
        error = error_of(srv, conn, "model_load", path=path)
        assert (error["code"], error["detail"]["field"]) == ("path_not_allowed", "args.path"), path
    assert error_of(srv, conn, "model_load", path="no-such-model")["code"] == "invalid_checkpoint"
    unconfigured = inproc(backend="torch")
    error = error_of(unconfigured, conn, "model_load", path=str(root / "mamba2-lm"))
    assert error["code"] == "path_not_allowed" and "without --model-dir" in error["message"]


def test_a_model_dir_that_is_a_link_is_followed_where_it_points_at_each_load(checkpoints, tmp_path, inproc):
    """--model-dir was resolved once at start: a deploy re-pointing a `current` link to a new
    release (the old one removed) had every load refused, the operator's own path among them
    (found in review)."""
    import shutil

    releases = tmp_path / "releases"
    shutil.copytree(checkpoints[0] / "mamba-lm-tied", releases / "1" / "agent")
    current = tmp_path / "current"
    os.symlink(releases / "1", current)
    srv, conn = inproc(backend="torch", model_dirs=(str(current),)), RecordingConnection()
    assert call(srv, conn, "model_load", path="agent")["model"]
    shutil.copytree(checkpoints[0] / "mamba2-lm", releases / "2" / "agent")
    os.symlink(releases / "2", tmp_path / "next")
    os.replace(tmp_path / "next", current)
    shutil.rmtree(releases / "1")
    for path in ("agent", str(current / "agent")):
        assert call(srv, conn, "model_load", path=path)["arch"] == "mamba2", path
    error = error_of(srv, conn, "model_load", path=str(releases / "1" / "agent"))
    assert error["code"] == "path_not_allowed", error


def hub_cache_repo(root, model, model_id: str, revision: str, *, sharded: bool):
    """`model` saved as Hugging Face's hub cache keeps a download under `root`:
    models--ORG--NAME/snapshots/REVISION/FILE, each a link to ../../blobs/HASH, and refs/main
    naming the revision. Its snapshot directory."""
    import hashlib

    repo = root / ("models--" + model_id.replace("/", "--"))
    snapshot = repo / "snapshots" / revision
    (repo / "blobs").mkdir(parents=True)
    (repo / "refs").mkdir()
    snapshot.mkdir(parents=True)
    source = repo / "source"
    weight_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    model.save_pretrained(source, max_shard_size=weight_bytes // 3 if sharded else "10GB")
    names = sorted(p.name for p in source.iterdir())
    assert ("model.safetensors.index.json" in names) == sharded, names
    for name in names:
        data = (source / name).read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        os.symlink(os.path.join("..", "..", "blobs", blob.name), snapshot / name)
        (source / name).unlink()
    source.rmdir()
    (repo / "refs" / "main").write_text(revision)
    return snapshot


def steps_match_transformers(srv, conn, path, model, output, seed):
    loaded = call(srv, conn, "model_load", path=path)["model"]
    assert_prefill_then_steps_match(srv, conn, loaded, model, output, batch=2, steps=2, seed=seed + 2,
                                    what=f"{path} (seed {seed})")


@pytest.mark.parametrize("sharded", [False, True], ids=["one-file", "sharded"])
def test_a_hub_cache_snapshot_loads_through_its_links_into_blobs(serve, checkpoints, sharded):
    """Hugging Face's hub cache keeps models--ORG--NAME/snapshots/REV/FILE as links to
    ../../blobs/HASH: with --model-dir at the cache, a snapshot loads through them and runs as
    transformers runs the model. A name the index gives with a directory in it is refused,
    though it would resolve under --model-dir."""
    root = checkpoints[0]
    model, output, seed = checkpoints[1]["mamba2-lm"]
    snapshot = hub_cache_repo(root, model, f"tiny/mamba2-{'sharded' if sharded else 'one-file'}", "0123abcd",
                              sharded=sharded)
    srv, conn = serve(), RecordingConnection()
    steps_match_transformers(srv, conn, str(snapshot.relative_to(root)), model, output, seed)
    if sharded:
        index_link = snapshot / "model.safetensors.index.json"
        index = json.loads(index_link.read_text())
        shard = next(iter(index["weight_map"].values()))
        index["weight_map"] = {k: f"../0123abcd/{v}" if v == shard else v for k, v in index["weight_map"].items()}
        index_link.unlink()
        index_link.write_text(json.dumps(index))
        error = error_of(srv, conn, "model_load", path=str(snapshot.relative_to(root)))
        assert (error["code"], error["detail"]["field"]) == ("invalid_checkpoint", "model.safetensors.index.json.weight_map")
        assert "file name in the checkpoint's directory" in error["message"], error


def test_a_hub_model_id_loads_the_snapshot_its_main_ref_names(serve, checkpoints, tmp_path):
    """`path` ORG/NAME, where no directory of that name holds a config: the snapshot the hub
    cache's refs/main names. A ref naming no snapshot, or naming one by a path, loads nothing;
    a ref that is a link out of --model-dir is not read."""
    root = checkpoints[0]
    model, output, seed = checkpoints[1]["mamba-lm-tied"]
    hub_cache_repo(root, model, "tiny-org/mamba-by-id", "feedbeef", sharded=False)
    srv, conn = serve(), RecordingConnection()
    steps_match_transformers(srv, conn, "tiny-org/mamba-by-id", model, output, seed)
    ref = root / "models--tiny-org--mamba-by-id" / "refs" / "main"
    outside = tmp_path / "outside-ref"
    outside.write_text("feedbeef")
    for content in ("0000", "../snapshots/feedbeef", None):
        ref.unlink()
        if content is None:
            os.symlink(outside, ref)
        else:
            ref.write_text(content)
        error = error_of(srv, conn, "model_load", path="tiny-org/mamba-by-id")
        assert (error["code"], error["detail"]["field"]) == ("invalid_checkpoint", "args.path"), (content, error)
    assert error_of(srv, conn, "model_load", path="tiny-org/no-such-model")["code"] == "invalid_checkpoint"


@pytest.mark.parametrize("swapped", ["directory", "config"])
def test_a_link_swapped_in_after_the_check_is_not_followed(serve, checkpoints, tmp_path, monkeypatch, swapped):
    """Whoever may write in a model directory may swap a link in between the check of a file's
    path and its open: for the checkpoint directory, or for its config.json, leading outside to
    a file whose values an error would echo. What is read is what was checked."""
    from bridge.models import checkpoint

    root = checkpoints[0]
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "config.json").write_text(json.dumps({"model_type": "secret-of-outside"}))
    directory = edited_copy(root, "mamba-lm-tied", f"swapped-{swapped}")
    link, target = (directory, outside) if swapped == "directory" else (directory / "config.json",
                                                                          outside / "config.json")
    realpath = os.path.realpath

    def checked_then_swapped(path):
        real = realpath(path)
        if real == str(directory / "config.json") and not os.path.islink(link):
            os.rename(link, tmp_path / "moved")
            os.symlink(target, link)
        return real

    monkeypatch.setattr(checkpoint.os.path, "realpath", checked_then_swapped)
    srv, conn = serve(), RecordingConnection()
    error = error_of(srv, conn, "model_load", path=directory.name)
    assert (error["code"], error["detail"]["field"]) == ("invalid_checkpoint", "config.json"), error
    assert "secret-of-outside" not in str(error)


@pytest.mark.parametrize("rewritten", [torch.ones(4096), torch.ones(12, dtype=torch.int64)], ids=["shape", "dtype"])
def test_a_file_rewritten_after_its_header_was_read_is_refused(serve, checkpoints, monkeypatch, rewritten):
    """A shard's tensors are read after every header is checked and the budget held for them: one
    rewritten meanwhile made a model its config does not describe, of weights the budget did not
    count, or of integers converted to floats."""
    from safetensors.torch import load_file

    from bridge.models import checkpoint

    directory = edited_copy(checkpoints[0], "mamba-lm-tied", f"rewritten-after-its-header-{rewritten.dtype}")
    tensors = dict(load_file(str(directory / "model.safetensors")), **{"backbone.norm_f.weight": rewritten})
    read = checkpoint.TensorSource.tensors

    def rewritten_then_read(source, names):
        save_file(tensors, str(directory / "model.safetensors"))
        return read(source, names)

    monkeypatch.setattr(checkpoint.TensorSource, "tensors", rewritten_then_read)
    srv, conn = serve(), RecordingConnection()
    error = error_of(srv, conn, "model_load", path=directory.name)
    assert (error["code"], error["detail"]["field"]) == (
        "invalid_checkpoint", "model.safetensors.backbone.norm_f.weight"), error
    assert srv.server.sessions.usage()["model_bytes"] == 0 and len(srv.server.models) == 0


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="open files are listed from /proc")
def test_a_load_failing_mid_read_leaves_no_file_open(serve, checkpoints):
    """A weight found not finite stops the read with its file open: the reply's exception, kept
    by the thread that answered it, kept the file open (and mapped) until that thread's next load."""
    directory = edited_copy(checkpoints[0], "mamba-lm-tied", "not-finite-mid-read",
                            weights=lambda t: {**t, "backbone.norm_f.weight": torch.full((12,), float("nan"))})
    srv, conn = serve(), RecordingConnection()
    assert error_of(srv, conn, "model_load", path=directory.name)["code"] == "invalid_checkpoint"
    opened = [os.path.realpath(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")]
    assert str(directory / "model.safetensors") not in opened


def test_a_checkpoints_own_files_are_read_only_in_its_directory_and_only_if_regular(serve, checkpoints, tmp_path):
    """The index of a sharded checkpoint, like its config and shards, is refused as a link out of
    the directory, or as anything but a regular file (a FIFO there would block the serving
    thread); a pytorch_model.bin keyed by anything but names is refused by name."""
    root = checkpoints[0]
    outside = tmp_path / "outside.json"
    outside.write_text(json.dumps({"weight_map": {"x": "model.safetensors"}}))
    for name, make_index in (("index-links-out", lambda p: os.symlink(outside, p)), ("index-is-a-fifo", os.mkfifo)):
        directory = edited_copy(root, "mamba2-lm", name)
        (directory / "model.safetensors").unlink()
        make_index(directory / "model.safetensors.index.json")
        srv, conn = serve(), RecordingConnection()
        error = error_of(srv, conn, "model_load", path=name)
        assert (error["code"], error["detail"]["field"]) == ("invalid_checkpoint", "model.safetensors.index.json"), error
    numbered = root / "bin-keyed-by-ints"
    numbered.mkdir()
    (numbered / "config.json").write_text(json.dumps({"arch": "mamba", "d_model": 4, "n_layer": 1, "vocab_size": 8}))
    torch.save({0: torch.zeros(3)}, numbered / "pytorch_model.bin")
    error = error_of(srv, conn, "model_load", path=numbered.name)
    assert (error["code"], error["detail"]["field"]) == ("invalid_checkpoint", "pytorch_model.bin"), error


@pytest.mark.parametrize("char", ["\0", "\ud800"], ids=["nul", "lone-surrogate"])
def test_an_index_naming_a_shard_no_path_can_name_is_refused_by_name(serve, checkpoints, char):
    """A shard name the OS cannot take is the index's fault like any other name outside the
    directory: a NUL (JSON's \\u0000; os.path raised ValueError, an internal_error, found in
    review), or a lone surrogate (JSON's \\ud800), which no file name encodes to."""
    directory = edited_copy(checkpoints[0], "mamba2-lm", f"index-names-{ord(char)}")
    (directory / "model.safetensors").rename(directory / "shard.safetensors")
    with open(directory / "model.safetensors.index.json", "w") as f:
        json.dump({"weight_map": {"backbone.norm_f.weight": f"shard{char}.safetensors"}}, f)
    srv, conn = serve(), RecordingConnection()
    error = error_of(srv, conn, "model_load", path=directory.name)
    assert (error["code"], error["detail"].get("field")) == (
        "invalid_checkpoint", "model.safetensors.index.json.weight_map"), error


@pytest.mark.parametrize("source", ["index", "bin"])
def test_a_tensor_name_no_reply_can_encode_is_named_escaped(serve, checkpoints, source):
    """JSON's \\ud800 and a pickle's string decode to a lone surrogate, which UTF-8 cannot
    encode: an error naming such a tensor could not be written, and the load went unanswered."""
    name = "\ud800"
    directory = edited_copy(checkpoints[0], "mamba2-lm", f"tensor-named-a-surrogate-{source}")
    if source == "index":
        with open(directory / "model.safetensors.index.json", "w") as f:
            json.dump({"weight_map": {name: "model.safetensors"}}, f)
        field = "model.safetensors.\\ud800"
    else:
        from safetensors.torch import load_file

        tensors = load_file(str(directory / "model.safetensors"))
        (directory / "model.safetensors").unlink()
        torch.save({**tensors, name: torch.zeros(1)}, directory / "pytorch_model.bin")
        field = "weights.\\ud800"
    srv, conn = serve(), RecordingConnection()
    reply = conn.reply(srv.submit(conn, "model_load", path=directory.name), timeout=30)
    assert (reply.error["code"], reply.error["detail"]["field"]) == ("invalid_checkpoint", field), reply.error
    assert call(srv, conn, "model_load", path="mamba2-lm")["layers"] == 2


def test_a_config_nested_past_the_json_parsers_depth_is_a_corrupt_file(serve, checkpoints):
    """json raises RecursionError, not ValueError, for nesting past its depth (found in review: an
    internal_error where SPEC §6.4 says a corrupt file is invalid_checkpoint)."""
    directory = edited_copy(checkpoints[0], "mamba-lm-tied", "config-nested-deep")
    (directory / "config.json").write_text("[" * 200_000)
    srv, conn = serve(), RecordingConnection()
    error = error_of(srv, conn, "model_load", path=directory.name)
    assert (error["code"], error["detail"].get("field")) == ("invalid_checkpoint", "config.json"), error


@pytest.mark.parametrize("extra, refused", [(0, False), (1, True)], ids=["at-the-bound", "past-it"])
def test_a_config_file_is_held_to_the_bound_of_a_config_sent(serve, checkpoints, extra, refused):
    """config.json is read whole and parsed into objects, as a config sent is decoded: held to
    the same bound (real ones are a few KB)."""
    from protocol.schema import MAX_MAP_BYTES

    directory = edited_copy(checkpoints[0], "mamba-lm-tied", f"config-of-{MAX_MAP_BYTES + extra}-bytes")
    config = (directory / "config.json").read_bytes()
    (directory / "config.json").write_bytes(config + b" " * (MAX_MAP_BYTES + extra - len(config)))
    srv, conn = serve(), RecordingConnection()
    reply = srv.request(conn, "model_load", path=directory.name)
    if refused:
        assert (reply.error["code"], reply.error["detail"]["field"], reply.error["detail"]["expected"]) == (
            "invalid_checkpoint", "config.json", f"at most {MAX_MAP_BYTES} bytes of JSON"), reply.error
    else:
        assert reply.ok, reply.error


def test_a_config_of_more_layers_than_tensors_is_refused_before_listing_them(serve, monkeypatch):
    """A client's config may claim any number of layers: listing each layer's expected shapes
    before comparing any held the serving lock for as long as that list took to build."""
    from bridge.models import weights

    listed = []
    expected_shapes = weights.expected_shapes
    monkeypatch.setattr(weights, "expected_shapes", lambda config: listed.append(config.n_layer) or
                        expected_shapes(config))
    srv, conn = serve(), RecordingConnection()
    error = error_of(srv, conn, "model_load", config={"arch": "mamba", "d_model": 16, "n_layer": 10 ** 6},
                     weights={"norm_f.weight": torch.ones(16), "layers.0.norm.weight": torch.ones(16)})
    assert (error["code"], error["detail"]["field"]) == ("invalid_checkpoint", "args.weights.layers.1.norm.weight")
    assert listed == []


def test_a_sent_weight_not_finite_is_named_by_its_path_in_the_request(serve):
    """SPEC §6.4 and §7: a bad tensor of model_load's `weights` is named by its path in the
    request, as sent (found in review: a NaN one was "weights.<canonical name>", no "args.")."""
    from bridge.models.config import parse_config
    from bridge.models.weights import expected_shapes

    config = {"arch": "mamba", "d_model": 8, "n_layer": 1, "vocab_size": 16}
    weights = {f"backbone.{name}": torch.rand(shape) for name, shape in
               expected_shapes(parse_config(config)).items()}
    weights["backbone.layers.0.mixer.out_proj.weight"][0, 0] = float("nan")
    srv, conn = serve(), RecordingConnection()
    error = error_of(srv, conn, "model_load", config=config, weights=weights)
    assert (error["code"], error["detail"]["field"]) == (
        "invalid_checkpoint", "args.weights.backbone.layers.0.mixer.out_proj.weight"), error


def test_a_weight_past_the_load_dtypes_range_is_named_so_not_as_not_finite(serve):
    """A finite weight beyond f16's range is refused in an f16 load, as past that range, naming
    the value (found in review: "NaN or infinity", which blamed the file); it loads in f32 and
    bf16."""
    from bridge.models.config import parse_config
    from bridge.models.weights import expected_shapes

    config = {"arch": "mamba", "d_model": 8, "n_layer": 1, "vocab_size": 16}
    weights = {name: torch.rand(shape) for name, shape in expected_shapes(parse_config(config)).items()}
    weights["layers.0.mixer.out_proj.weight"][0, 0] = -1e5
    srv, conn = serve(), RecordingConnection()
    for dtype in ("f32", "bf16"):
        assert call(srv, conn, "model_load", config=config, weights=weights, dtype=dtype)["dtype"] == dtype
    error = error_of(srv, conn, "model_load", config=config, weights=weights, dtype="f16")
    assert (error["code"], error["detail"]["field"]) == (
        "invalid_checkpoint", "args.weights.layers.0.mixer.out_proj.weight"), error
    assert "f16's range" in error["detail"]["expected"] and error["detail"]["got"] == "a value of -100000", error


def test_a_bin_in_torchs_legacy_format_loads(serve, checkpoints):
    """torch.save's format before the zip one (_use_new_zipfile_serialization=False) cannot be
    memory-mapped: it was refused, naming the server's own path to the file (found in review)."""
    config = {"arch": "mamba", "d_model": 4, "n_layer": 1, "vocab_size": 8}
    tensors = {name: t * 0.3 for name, t in _own_layout_tensors(config).items()}
    outputs = {}
    for fmt, zipped in (("zip", True), ("legacy", False)):
        directory = checkpoints[0] / f"bin-format-{fmt}"
        directory.mkdir()
        (directory / "config.json").write_text(json.dumps(config))
        torch.save(tensors, directory / "pytorch_model.bin", _use_new_zipfile_serialization=zipped)
        srv, conn = serve(), RecordingConnection()
        session = call(srv, conn, "session_open", model=call(srv, conn, "model_load", path=directory.name)["model"],
                       batch=1)["session"]
        outputs[fmt] = call(srv, conn, "model_forward", session=session, tokens=torch.tensor([[1, 5, 2]]))["logits"]
    assert torch.equal(outputs["zip"], outputs["legacy"])


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_a_checkpoint_read_in_the_models_dtype_is_kept_not_copied_but_weights_sent_are(checkpoints, tmp_path,
                                                                                        monkeypatch, fmt):
    """Each tensor read was copied again into the model (found in review): a load's peak held
    every weight twice over (a .bin's whole state beside the model). One sent inline lies in the
    request's frame, which does not outlive the load: that one is copied."""
    import bridge.models.checkpoint as checkpoint_module
    config = {"arch": "mamba", "d_model": 4, "n_layer": 1, "vocab_size": 8}
    tensors = {name: t * 0.3 for name, t in _own_layout_tensors(config).items()}
    directory = tmp_path / fmt
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config))
    if fmt == "safetensors":
        save_file(tensors, str(directory / "model.safetensors"))
    else:
        torch.save(tensors, directory / "pytorch_model.bin")
    read = []
    original = (checkpoint_module.SafetensorsEntry.read if fmt == "safetensors" else checkpoint_module.load_bin)

    def recording(*args, **kwargs):
        got = original(*args, **kwargs)
        read.extend([got] if fmt == "safetensors" else got.values())
        return got

    monkeypatch.setattr(*((checkpoint_module.SafetensorsEntry, "read") if fmt == "safetensors" else
                          (checkpoint_module, "load_bin")), recording)
    model = load_checkpoint(fmt, (str(tmp_path),), torch.float32, torch.device("cpu"), lambda n: None)
    read_at = {t.data_ptr() for t in read}
    assert model.layers[0].in_proj.data_ptr() in read_at and model.norm_f.data_ptr() in read_at
    sent = load_weights(config, tensors, torch.float32, torch.device("cpu"), lambda n: None)
    assert sent.layers[0].in_proj.data_ptr() != tensors["layers.0.mixer.in_proj.weight"].data_ptr()
    assert torch.equal(sent.layers[0].in_proj, model.layers[0].in_proj)


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_a_checkpoint_read_error_names_the_file_not_where_it_lies(serve, checkpoints, fmt):
    """The reader's own message (torch's, safetensors') named the file by its whole path: where
    the operator keeps checkpoints is not the client's to learn."""
    root = checkpoints[0]
    directory = root / f"unreadable-{fmt}"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({"arch": "mamba", "d_model": 4, "n_layer": 1,
                                                       "vocab_size": 8}))
    name = "model.safetensors" if fmt == "safetensors" else "pytorch_model.bin"
    (directory / name).write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}" if fmt == "safetensors" else b"PK not a zip")
    srv, conn = serve(), RecordingConnection()
    error = error_of(srv, conn, "model_load", path=directory.name)
    assert (error["code"], error["detail"]["field"]) == ("invalid_checkpoint", name), error
    assert str(root) not in json.dumps(error), error


# A load in a process of its own, while another thread saves the checkpoint over itself as
# save_file does (the file opened for writing, so truncated, then written): the process must
# live to print what each load got.
_SAVED_OVER_WHILE_LOADING = """
import os, sys, threading, time, torch
from bridge.models import load_checkpoint
from bridge.errors import OpError
root, seconds = sys.argv[1], float(sys.argv[2])
path = os.path.join(root, "saved-over", "model.safetensors")
data = open(path, "rb").read()
stop = threading.Event()
def save_over():
    while not stop.is_set():
        with open(path, "wb") as f:
            f.write(data[: len(data) // 2])
            f.write(data[len(data) // 2:])
threading.Thread(target=save_over, daemon=True).start()
got, end = {}, time.monotonic() + seconds
while time.monotonic() < end:
    try:
        load_checkpoint("saved-over", (root,), torch.float32, torch.device("cpu"), lambda n: None)
        what = "loaded"
    except OpError as e:
        what = e.code
    got[what] = got.get(what, 0) + 1
stop.set()
print(got)
"""


def test_a_checkpoint_saved_over_while_it_loads_is_refused_or_loaded_and_the_server_lives(tmp_path):
    """The files were mapped: a save in place truncating one while its tensors were read killed
    the server with SIGBUS (found in review). Each load now either gets the weights or is
    invalid_checkpoint."""
    import subprocess
    import sys

    config = {"arch": "mamba", "d_model": 64, "n_layer": 24, "vocab_size": 64}
    directory = tmp_path / "saved-over"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config))
    save_file(_own_layout_tensors(config), str(directory / "model.safetensors"))
    run = subprocess.run([sys.executable, "-c", _SAVED_OVER_WHILE_LOADING, str(tmp_path), "3"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, (run.returncode, run.stderr[-2000:])
    got = eval(run.stdout)  # a dict of counts the child printed
    assert set(got) <= {"loaded", "invalid_checkpoint"} and sum(got.values()) > 0, got


def _bin_directory(root, name: str, tensors: dict, *, compressed: bool = False):
    import io
    import zipfile

    config = {"arch": "mamba", "d_model": 4, "n_layer": 1, "vocab_size": 8}
    directory = root / name
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config))
    saved = io.BytesIO()
    torch.save(tensors, saved)
    if compressed:  # each record as torch.save stores it, then deflated
        source, saved = zipfile.ZipFile(io.BytesIO(saved.getvalue())), io.BytesIO()
        with zipfile.ZipFile(saved, "w", zipfile.ZIP_DEFLATED) as out:
            for record in source.infolist():
                out.writestr(record.filename, source.read(record))
    (directory / "pytorch_model.bin").write_bytes(saved.getvalue())
    return directory


def test_a_bin_whose_records_are_compressed_or_bigger_than_its_tensors_is_refused(serve, checkpoints):
    """torch.load inflates a deflated record whole before anything is checked: a pytorch_model.bin
    of a few MB made the server allocate GBs (found in review). torch.save never compresses. A
    tensor kept as a view of a bigger storage would read more than the budget was held for."""
    config = {"arch": "mamba", "d_model": 4, "n_layer": 1, "vocab_size": 8}
    tensors = {name: t * 0.3 for name, t in _own_layout_tensors(config).items()}
    srv, conn = serve(), RecordingConnection()
    compressed = _bin_directory(checkpoints[0], "bin-compressed", tensors, compressed=True)
    error = error_of(srv, conn, "model_load", path=compressed.name)
    assert (error["code"], error["detail"]["field"]) == ("invalid_checkpoint", "pytorch_model.bin"), error
    assert "uncompressed" in error["detail"]["expected"], error
    name = next(iter(tensors))
    viewed = dict(tensors, **{name: torch.zeros(tensors[name].numel() + 4096)[:tensors[name].numel()]
                               .view(tensors[name].shape)})
    error = error_of(srv, conn, "model_load", path=_bin_directory(checkpoints[0], "bin-viewed", viewed).name)
    assert (error["code"], error["detail"]["field"]) == ("invalid_checkpoint", "pytorch_model.bin"), error
    assert "bytes of storage" in error["detail"]["got"], error
    assert len(srv.server.models) == 0
    stored = _bin_directory(checkpoints[0], "bin-stored", tensors)
    assert call(srv, conn, "model_load", path=stored.name)["model"]


def test_a_zip_bin_rewritten_after_its_shapes_were_learnt_is_refused(serve, checkpoints, monkeypatch):
    """As a shard rewritten after its header was read: a pytorch_model.bin is read anew once the
    budget is held, and one holding more storage than its shapes said is refused, not read past
    the budget (found by mutating the fix: nothing failed)."""
    from bridge.models import checkpoint

    config = {"arch": "mamba", "d_model": 4, "n_layer": 1, "vocab_size": 8}
    tensors = {name: t * 0.3 for name, t in _own_layout_tensors(config).items()}
    directory = _bin_directory(checkpoints[0], "bin-rewritten", tensors)
    grown = dict(tensors, extra=torch.zeros(1 << 20))  # 4 MiB the budget was not held for
    read = checkpoint.TensorSource.tensors

    def rewritten_then_read(source, names):
        torch.save(grown, str(directory / "pytorch_model.bin"))
        return read(source, names)

    monkeypatch.setattr(checkpoint.TensorSource, "tensors", rewritten_then_read)
    srv, conn = serve(), RecordingConnection()
    error = error_of(srv, conn, "model_load", path=directory.name)
    assert (error["code"], error["detail"]["field"]) == ("invalid_checkpoint", "pytorch_model.bin"), error


def test_a_bin_whose_pickle_is_past_16_mib_is_refused_before_it_is_unpickled(serve, checkpoints):
    """A real state dict's pickle is a few KB: a bigger one is not what torch.save wrote."""
    import zipfile

    from bridge.models import checkpoint

    directory = checkpoints[0] / "bin-big-pickle"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({"arch": "mamba", "d_model": 4, "n_layer": 1, "vocab_size": 8}))
    with zipfile.ZipFile(directory / "pytorch_model.bin", "w", zipfile.ZIP_STORED) as archive:
        archive.writestr("archive/data.pkl", b"\x80\x02}q\x00." + b"\x00" * checkpoint.MAX_BIN_PICKLE_BYTES)
    srv, conn = serve(), RecordingConnection()
    error = error_of(srv, conn, "model_load", path=directory.name)
    assert (error["code"], error["detail"]["field"]) == ("invalid_checkpoint", "pytorch_model.bin"), error
    assert "pickle of at most" in error["detail"]["expected"], error


@pytest.mark.parametrize("offsets, why", [([[0, 64], [32, 96]], "shared"), ([[-4, 60], [64, 128]], "non-negative")],
                         ids=["overlapping", "negative"])
def test_a_safetensors_header_whose_tensors_overlap_or_start_before_the_data_is_refused(serve, checkpoints,
                                                                                          offsets, why):
    """The header's byte ranges are checked as safetensors checks them: two tensors sharing bytes,
    or one starting before the data (in the header itself), are a corrupt file."""
    directory = edited_copy(checkpoints[0], "mamba-lm-tied", f"header-{why}")
    header = {f"t{i}": {"dtype": "F32", "shape": [16], "data_offsets": pair} for i, pair in enumerate(offsets)}
    encoded = json.dumps(header).encode()
    (directory / "model.safetensors").write_bytes(len(encoded).to_bytes(8, "little") + encoded + bytes(128))
    srv, conn = serve(), RecordingConnection()
    error = error_of(srv, conn, "model_load", path=directory.name)
    assert (error["code"], error["detail"]["field"]) == ("invalid_checkpoint", "model.safetensors"), error
    assert why in error["detail"]["expected"] + error["detail"]["got"], error


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="open files are listed from /proc")
def test_a_safetensors_file_too_big_to_map_is_refused_and_leaves_no_file_open(serve, checkpoints):
    """Its mapping failed and left a descriptor open, each load another, until no file could be
    opened (found in review). The file is sparse: its header declares more than memory holds."""
    directory = edited_copy(checkpoints[0], "mamba-lm-tied", "too-big-to-map")
    header = json.dumps({"backbone.norm_f.weight": {"dtype": "F32", "shape": [1 << 39],
                                                    "data_offsets": [0, 1 << 41]}}).encode()
    path = directory / "model.safetensors"
    with open(path, "wb") as f:
        f.write(len(header).to_bytes(8, "little") + header)
        f.truncate(8 + len(header) + (1 << 41))
    srv, conn = serve(), RecordingConnection()
    opened = len(os.listdir("/proc/self/fd"))
    for _ in range(3):
        assert error_of(srv, conn, "model_load", path=directory.name)["code"] in ("invalid_checkpoint",
                                                                                  "limit_exceeded")
    assert len(os.listdir("/proc/self/fd")) == opened


def test_a_path_climbing_out_or_failing_to_resolve_is_refused_alike(serve, checkpoints, monkeypatch):
    """`X/../model` was resolved, looking up X wherever it lay, so that whether it loaded told a
    client what existed outside --model-dir; a link along a path that could not be read
    answered internal_error with its reader's message (both found in review)."""
    from bridge.models import checkpoint

    srv, conn = serve(), RecordingConnection()
    for path in ("no-such-dir/../mamba-lm-tied", "mamba-lm-tied/../mamba-lm-tied",
                 "/proc/self/exe/" + "../" * 12 + str(checkpoints[0] / "mamba-lm-tied").lstrip("/")):
        error = error_of(srv, conn, "model_load", path=path)
        assert (error["code"], error["detail"]["field"]) == ("path_not_allowed", "args.path"), (path, error)

    def unreadable(path):
        raise PermissionError(13, "Permission denied", path)

    monkeypatch.setattr(checkpoint.os.path, "realpath", unreadable)
    error = error_of(srv, conn, "model_load", path="mamba-lm-tied")
    assert (error["code"], error["detail"]["field"]) == ("path_not_allowed", "args.path"), error
    assert str(checkpoints[0]) not in json.dumps(error), error


def test_a_dt_limit_past_float32_is_refused_at_load_by_its_path_in_the_config(serve):
    """As a request's dt_limit is: such a model loaded, then every prefill and step was refused
    naming args.dt_max, which no request had sent."""
    from test_return_state import MODEL_CONFIGS, tiny_weights

    weights = tiny_weights("mamba2", torch.Generator().manual_seed(random_seed()))
    srv, conn = serve(), RecordingConnection()
    error = error_of(srv, conn, "model_load", config={**MODEL_CONFIGS["mamba2"], "dt_limit": [0.0, 1e39]},
                     weights=weights)
    assert (error["code"], error["detail"]["field"]) == ("invalid_checkpoint", "args.config.dt_limit"), error


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int32, torch.int64])
def test_a_sent_weight_of_an_integer_dtype_is_refused_by_name(serve, dtype):
    """A checkpoint's integer tensor is refused (checkpoint.py); one sent in model_load's
    `weights` was converted to floats and loaded (found in review: a client sending quantized
    bytes got a model of garbage). It is named as sent, and nothing is held."""
    from test_return_state import MODEL_CONFIGS, tiny_weights

    weights = tiny_weights("mamba", torch.Generator().manual_seed(random_seed()))
    name = "layers.0.mixer.in_proj.weight"
    weights[name] = weights[name].to(dtype)
    srv, conn = serve(), RecordingConnection()
    error = error_of(srv, conn, "model_load", config=MODEL_CONFIGS["mamba"], weights=weights)
    assert (error["code"], error["detail"]["field"], error["detail"]["tensor"]) == (
        "invalid_checkpoint", f"args.weights.{name}", name), error
    assert srv.server.sessions.usage()["model_bytes"] == 0 and len(srv.server.models) == 0


def test_a_model_over_the_pool_budget_is_refused_before_it_is_read(serve):
    srv, conn = serve(max_pool_bytes=4096), RecordingConnection()
    error = error_of(srv, conn, "model_load", path="mamba2-lm")
    assert (error["code"], error["detail"]["limit"]) == ("limit_exceeded", "max_pool_bytes")
    assert srv.server.sessions.usage()["pool_bytes"] == 0


def test_weights_sent_over_the_pool_budget_are_refused_before_any_is_copied(serve, monkeypatch):
    """SPEC §6.4: limit_exceeded before any weight is read. Sent weights were each made a
    device tensor (a copy on a GPU, or where the backend needs aligned data) before the budget
    was checked (found in review); now the one copy is the model's own."""
    from test_return_state import MODEL_CONFIGS, tiny_weights

    weights = tiny_weights("mamba", torch.Generator().manual_seed(random_seed()))
    srv, conn = serve(max_pool_bytes=4096), RecordingConnection()
    copied = []
    device_tensor = srv.server.device_tensor
    monkeypatch.setattr(srv.server, "device_tensor", lambda wire: copied.append(wire) or device_tensor(wire))
    error = error_of(srv, conn, "model_load", config=MODEL_CONFIGS["mamba"], weights=weights)
    assert (error["code"], error["detail"]["limit"]) == ("limit_exceeded", "max_pool_bytes")
    assert copied == [] and srv.server.sessions.usage()["model_bytes"] == 0
    roomy = serve()
    monkeypatch.setattr(roomy.server, "device_tensor", lambda wire: copied.append(wire) or device_tensor(wire))
    loaded = call(roomy, conn, "model_load", config=MODEL_CONFIGS["mamba"], weights=weights)
    assert copied == [] and roomy.server.sessions.usage()["model_bytes"] == loaded["weight_bytes"] > 0


def test_a_freed_model_gives_back_what_its_load_held(serve, monkeypatch):
    """The load holds its planned bytes before reading; freeing gave back the weights' own
    count instead, so any difference between the two stayed held for the server's life (found
    in review)."""
    import bridge.models
    from test_return_state import MODEL_CONFIGS, tiny_weights

    planned_bytes = bridge.models.planned_bytes
    monkeypatch.setattr(bridge.models, "planned_bytes", lambda *args: planned_bytes(*args) + 64)
    srv, conn = serve(), RecordingConnection()
    weights = tiny_weights("mamba", torch.Generator().manual_seed(random_seed()))
    loaded = call(srv, conn, "model_load", config=MODEL_CONFIGS["mamba"], weights=weights)
    assert srv.server.sessions.usage()["model_bytes"] == loaded["weight_bytes"] + 64
    call(srv, conn, "model_free", model=loaded["model"])
    assert srv.server.sessions.usage()["model_bytes"] == 0


def test_models_and_snapshots_held_at_once_are_capped_apart_from_their_bytes(serve):
    """A tiny model or snapshot holds a few bytes against --max-pool-bytes and costs the host
    far more (its tensors and entries): without a count a client could fill the host's memory
    under the pool budget (found in review). --max-models and --max-snapshots bound them."""
    srv, conn = serve(max_models=2, max_snapshots=2), RecordingConnection()
    models = [call(srv, conn, "model_load", path="mamba2-lm")["model"] for _ in range(2)]
    error = error_of(srv, conn, "model_load", path="mamba2-lm")
    assert (error["code"], error["detail"]) == ("limit_exceeded", {"limit": "max_models", "max": 2, "held": 2}), error
    assert error["message"].startswith("model_load: at most 2 models may be held at once (--max-models)"), error
    session = call(srv, conn, "session_open", model=models[0], batch=1)["session"]
    snapshots = [call(srv, conn, "session_snapshot", session=session)["snapshot"] for _ in range(2)]
    error = error_of(srv, conn, "session_snapshot", session=session)
    assert (error["code"], error["detail"]) == ("limit_exceeded", {"limit": "max_snapshots", "max": 2, "held": 2})
    limits = call(srv, conn, "info")["limits"]
    assert (limits["max_models"], limits["max_snapshots"]) == (2, 2), limits
    call(srv, conn, "snapshot_free", snapshot=snapshots[0])
    call(srv, conn, "session_snapshot", session=session)
    call(srv, conn, "model_free", model=models[1])
    call(srv, conn, "model_load", path="mamba2-lm")


def test_a_model_name_is_held_to_256_bytes(serve):
    srv, conn = serve(), RecordingConnection()
    error = error_of(srv, conn, "model_load", path="mamba2-lm", name="é" * 129)
    assert (error["code"], error["detail"]["field"]) == ("invalid_argument", "args.name"), error
    assert "at most 256 bytes" in error["message"] and "258 bytes" in error["message"], error
    assert call(srv, conn, "model_load", path="mamba2-lm", name="é" * 128)["name"] == "é" * 128


@pytest.mark.parametrize("config, got", [
    pytest.param({"y" * 100_000: 1}, "keys <key of 100000 bytes>", id="a-long-key"),
    pytest.param({}, "an empty map", id="no-keys"),
])
def test_a_config_of_no_known_layout_is_told_by_its_keys_not_echoing_them(serve, config, got):
    """Its keys went into the error whole, a 100,000-byte key twice (found in review); none
    said "keys " and nothing."""
    srv, conn = serve(), RecordingConnection()
    error = error_of(srv, conn, "model_load", config=config, weights={})
    assert (error["code"], error["detail"]["field"], error["detail"]["got"]) == ("invalid_checkpoint", "args.config",
                                                                              got), str(error)[:300]
    assert len(error["message"]) < 1000


@pytest.mark.parametrize("path", [pytest.param("a/" * 2049, id="many-components"),
                                  pytest.param("é" * 2049, id="one-long-name")])
def test_a_model_path_past_path_max_is_refused_before_it_is_resolved(serve, monkeypatch, path):
    """A path of megabytes ("a/" repeated) took realpath minutes on the loader, which every
    connection's loads waited behind (found in review): refused past PATH_MAX, unresolved."""
    srv, conn = serve(), RecordingConnection()
    monkeypatch.setattr(os.path, "realpath", lambda *a, **k: pytest.fail("the long path was resolved"))
    error = error_of(srv, conn, "model_load", path=path)
    assert (error["code"], error["detail"]["field"]) == ("invalid_argument", "args.path"), error
    assert "at most 4096 bytes" in error["message"] and f"{len(path.encode())} bytes" in error["message"], error
    monkeypatch.undo()
    at_the_bound = "./" * 2043 + "mamba2-lm/"  # 4,096 bytes
    assert len(at_the_bound) == 4096 and call(srv, conn, "model_load", path=at_the_bound)["arch"] == "mamba2"


def test_weights_snapshots_and_sessions_share_the_pool_budget(serve):
    srv, conn = serve(), RecordingConnection()
    info = call(srv, conn, "model_load", path="mamba2-lm")
    used = srv.server.sessions.usage()
    assert used["model_bytes"] == info["weight_bytes"] == used["pool_bytes"]
    session = call(srv, conn, "session_open", model=info["model"], batch=2)["session"]
    call(srv, conn, "session_snapshot", session=session)
    assert srv.server.sessions.usage()["snapshot_bytes"] == 2 * info["state_bytes_per_row"]
    budget = info["weight_bytes"] + 3 * info["state_bytes_per_row"]  # the model, its session, one row more
    tight = serve(max_pool_bytes=budget)
    info = call(tight, conn, "model_load", path="mamba2-lm")
    session = call(tight, conn, "session_open", model=info["model"], batch=2)["session"]
    assert error_of(tight, conn, "session_snapshot", session=session)["detail"]["limit"] == "max_pool_bytes"
    assert error_of(tight, conn, "session_fork", session=session)["detail"]["limit"] == "max_pool_bytes"


def test_closing_the_connection_frees_models_sessions_and_snapshots(serve):
    srv, conn = serve(), RecordingConnection()
    info = call(srv, conn, "model_load", path="mamba-lm-tied")
    session = call(srv, conn, "session_open", model=info["model"], batch=1)["session"]
    call(srv, conn, "session_snapshot", session=session)
    conn.mark_closed()
    usage = srv.server.sessions.usage()
    assert (usage["sessions"], usage["pool_bytes"], len(srv.server.models), len(srv.server.snapshots)) == (0, 0, 0, 0)


def test_model_free_refuses_a_model_in_use_then_frees_it_and_its_snapshots(serve):
    """Freeing the model and with it the snapshot, the last things the connection held, ends the
    wait for its close (test_sessions.py: a ZeroMQ peer is held while one waits)."""
    srv, conn = serve(), RecordingConnection()
    info = call(srv, conn, "model_load", path="mamba-lm-tied", name="agent")
    assert info["name"] == "agent"
    session = call(srv, conn, "session_open", model=info["model"], batch=1)["session"]
    call(srv, conn, "session_snapshot", session=session)
    other = call(srv, conn, "session_open", model=info["model"], batch=1)["session"]
    error = error_of(srv, conn, "model_free", model=info["model"])
    assert (error["detail"]["field"], error["detail"]["got"]) == ("args.model", "a model 2 open sessions use")
    assert error["message"] == ("args.model: expected a model no open session uses, got a model 2 open sessions "
                                "use (close them first)")
    call(srv, conn, "session_close", session=other)
    assert error_of(srv, conn, "model_free", model=info["model"])["detail"]["got"] == "a model an open session uses"
    call(srv, conn, "session_close", session=session)
    assert conn.has_close_callbacks, "not watched while it held a model and a snapshot"
    assert call(srv, conn, "model_free", model=info["model"]) == {"freed": True}
    assert srv.server.sessions.usage()["pool_bytes"] == 0
    assert not conn.has_close_callbacks, "still watched with nothing held"
    assert error_of(srv, conn, "model_free", model=info["model"])["code"] == "unknown_model"


BAD_REQUESTS = [
    # id, op, args (MODEL / SESSION / PLAIN stand for ids), code, field
    ("both-path-and-config", "model_load", dict(path="mamba-lm-tied", config={"arch": "mamba"}), "invalid_argument", "args"),
    ("config-without-weights", "model_load", dict(config={"arch": "mamba"}), "invalid_argument", "args"),
    ("sent-config-unknown", "model_load", dict(config={"d_model": 4}, weights={}), "invalid_checkpoint", "args.config"),
    ("expand-overflows", "model_load", dict(config={"arch": "mamba", "d_model": 16, "n_layer": 1, "expand": 1e308},
                                            weights={}), "invalid_checkpoint", "args.config.expand"),
    ("expand-rounds-to-no-channel", "model_load", dict(config={"arch": "mamba2", "d_model": 4, "n_layer": 1,
                                                               "expand": 0.1}, weights={}),
     "invalid_checkpoint", "args.config.expand"),
    # A null dt rank is "auto", as an absent one: the weights are then checked against it.
    ("dt-rank-null", "model_load", dict(config={"arch": "mamba", "d_model": 16, "n_layer": 1, "dt_rank": None},
                                        weights={"norm_f.weight": torch.ones(16)}),
     "invalid_checkpoint", "args.weights.layers.0.norm.weight"),
    # This server's flat layout has no nested ssm_cfg: its keys (dt_limit, norm_before_gate) went unread.
    ("arch-with-ssm-cfg", "model_load", dict(config={"arch": "mamba2", "d_model": 8, "n_layer": 1,
                                                     "ssm_cfg": {"dt_limit": [0.1, 0.2]}}, weights={}),
     "invalid_checkpoint", "args.config.ssm_cfg"),
    # mamba_ssm's Mamba-2 gated norm keeps eps 1e-5 whatever norm_epsilon says; this runtime has one eps.
    ("mamba-ssm-mamba2-norm-epsilon", "model_load", dict(config={"d_model": 8, "n_layer": 1, "norm_epsilon": 1e-2,
                                                                 "ssm_cfg": {"layer": "Mamba2", "headdim": 4}},
                                                         weights={}), "invalid_checkpoint", "args.config.norm_epsilon"),
    # mamba_ssm settings this runtime cannot run were refused only as a tensor missing, if at all:
    # attention layers in the stack, a Mamba-2 mixer without its gated norm.
    ("mamba-ssm-attention-layers", "model_load", dict(config={"d_model": 8, "n_layer": 2, "attn_layer_idx": [1],
                                                              "ssm_cfg": {"layer": "Mamba2", "headdim": 4}},
                                                      weights={}), "invalid_checkpoint", "args.config.attn_layer_idx"),
    ("mamba-ssm-mamba2-without-its-norm", "model_load", dict(config={"d_model": 8, "n_layer": 1, "ssm_cfg": {
        "layer": "Mamba2", "headdim": 4, "rmsnorm": False}}, weights={}), "invalid_checkpoint", "args.config.rmsnorm"),
    # Values of another type than the key takes were a TypeError (internal_error), found in review.
    ("architectures-not-a-list", "model_load", dict(config={"model_type": "mamba", "hidden_size": 4,
                                                            "num_hidden_layers": 1, "vocab_size": 8,
                                                            "architectures": 5}, weights={}),
     "invalid_checkpoint", "args.config.architectures"),
    ("dt-limit-float-of-a-map", "model_load", dict(config={"arch": "mamba2", "d_model": 8, "n_layer": 1, "headdim": 4,
                                                           "dt_limit": [0, {"__float__": {}}]}, weights={}),
     "invalid_checkpoint", "args.config.dt_limit"),
    ("nul-in-path", "model_load", dict(path="mamba-lm-tied\0x"), "path_not_allowed", "args.path"),
    ("weights-dtype", "model_load", dict(path="mamba-lm-tied", dtype="f64"), "invalid_argument", "args.dtype"),
    ("unknown-model", "session_open", dict(model="nope", batch=1), "unknown_model", "args.model"),
    ("model-and-dim", "session_open", dict(model="MODEL", batch=1, dim=4), "invalid_argument", "args.dim"),
    ("state-part-missing", "session_open", dict(model="MODEL", batch=1, state={}), "missing_argument",
     "args.state.layers.0.conv"),
    ("plain-state-map", "session_open", dict(batch=1, dim=4, state={}), "invalid_argument", "args.state"),
    ("tokens-and-embeds", "model_step", dict(session="SESSION", tokens=torch.zeros(1, dtype=torch.int64),
                                              embeds=torch.zeros(1, 12)), "invalid_argument", "args"),
    ("neither", "model_step", dict(session="SESSION"), "invalid_argument", "args"),
    ("token-out-of-range", "model_step", dict(session="SESSION", tokens=torch.tensor([VOCAB])), "invalid_argument",
     "args.tokens"),
    ("negative-token", "model_forward", dict(session="SESSION", tokens=torch.tensor([[1, -1]])), "invalid_argument",
     "args.tokens"),
    ("float-tokens", "model_step", dict(session="SESSION", tokens=torch.zeros(1)), "invalid_argument", "args.tokens"),
    ("wrong-batch", "model_step", dict(session="SESSION", tokens=torch.zeros(2, dtype=torch.int64)), "shape_mismatch",
     "args.tokens"),
    ("embeds-width", "model_step", dict(session="SESSION", embeds=torch.zeros(1, 11)), "shape_mismatch", "args.embeds"),
    ("empty-window", "model_forward", dict(session="SESSION", tokens=torch.zeros(1, 0, dtype=torch.int64)),
     "shape_mismatch", "args.tokens"),
    ("lengths-of-other-rows", "model_forward", dict(session="SESSION", tokens=torch.zeros(1, 2, dtype=torch.int64),
                                                    lengths=torch.tensor([1, 1])), "shape_mismatch", "args.lengths"),
    ("length-past-window", "model_forward", dict(session="SESSION", tokens=torch.zeros(1, 2, dtype=torch.int64),
                                                 lengths=torch.tensor([3])), "invalid_argument", "args.lengths"),
    ("negative-length", "model_forward", dict(session="SESSION", tokens=torch.zeros(1, 2, dtype=torch.int64),
                                              lengths=torch.tensor([-1])), "invalid_argument", "args.lengths"),
    ("float-lengths", "model_forward", dict(session="SESSION", tokens=torch.zeros(1, 2, dtype=torch.int64),
                                            lengths=torch.tensor([1.0])), "invalid_argument", "args.lengths"),
    ("logits-of-backbone", "model_step", dict(session="BACKBONE", embeds=torch.zeros(1, 12), output="logits"),
     "invalid_argument", "args.output"),
    ("plain-session-model-step", "model_step", dict(session="PLAIN", tokens=torch.zeros(1, dtype=torch.int64)),
     "invalid_argument", "args.session"),
    ("model-session-plain-step", "step", dict(session="SESSION", x=torch.zeros(1, 4), dt=torch.zeros(1, 4),
                                              A=torch.zeros(4, 2), B=torch.zeros(1, 2), C=torch.zeros(1, 2)),
     "invalid_argument", "args.session"),
    ("restore-other-kind", "session_restore", dict(session="PLAIN", snapshot="SNAPSHOT"), "invalid_argument",
     "args.snapshot"),
]


@pytest.mark.parametrize("name, op, args, code, field", [pytest.param(*case, id=case[0]) for case in BAD_REQUESTS])
def test_every_bad_model_request_is_named_and_the_session_survives(serve, name, op, args, code, field):
    srv, conn = serve(), RecordingConnection()
    lm = call(srv, conn, "model_load", path="mamba-lm-tied")["model"]
    backbone = call(srv, conn, "model_load", path="mamba2-backbone")["model"]
    ids = {"MODEL": lm, "SESSION": call(srv, conn, "session_open", model=lm, batch=1)["session"],
           "BACKBONE": call(srv, conn, "session_open", model=backbone, batch=1)["session"],
           "PLAIN": call(srv, conn, "session_open", batch=1, dim=4, state=2)["session"]}
    ids["SNAPSHOT"] = call(srv, conn, "session_snapshot", session=ids["SESSION"])["snapshot"]
    args = {k: ids.get(v, v) if isinstance(v, str) else v for k, v in args.items()}
    error = error_of(srv, conn, op, **args)
    assert (error["code"], error["detail"].get("field")) == (code, field), error
    logits = call(srv, conn, "model_step", session=ids["SESSION"], tokens=torch.tensor([3]))["logits"]
    assert logits.shape == (1, VOCAB)


_LONG_NAME = "k" * 100_000
_LONG_PATH = "k" * 4000  # under PATH_MAX, so looked for


def _state_with_long_part(srv, conn) -> tuple[str, dict]:
    lm = call(srv, conn, "model_load", path="mamba-lm-tied")["model"]
    session = call(srv, conn, "session_open", model=lm, batch=1)["session"]
    state = call(srv, conn, "session_state", session=session)["state"]
    return "session_open", dict(model=lm, batch=1, state={**state, _LONG_NAME: state["layers.0.ssm"]})


def _weights_with(*names, dtype=torch.float32):
    # model_load of a tiny mamba model's weights and a tensor under each of `names`.
    def request(srv, conn) -> tuple[str, dict]:
        from test_return_state import MODEL_CONFIGS, tiny_weights

        weights = tiny_weights("mamba", torch.Generator().manual_seed(random_seed()))
        weights.update((name, torch.zeros(1, dtype=dtype)) for name in names)
        return "model_load", dict(config=MODEL_CONFIGS["mamba"], weights=weights)
    return request


@pytest.mark.parametrize("request_of, code, expected", [
    pytest.param(_state_with_long_part, "invalid_argument", "a state part of the model", id="state-part"),
    pytest.param(_weights_with(_LONG_NAME, dtype=torch.int32), "invalid_checkpoint", "a floating tensor",
                 id="weight-of-an-integer-dtype"),
    pytest.param(_weights_with(_LONG_NAME), "invalid_checkpoint", "only the tensors of this mamba config",
                 id="unexpected-weight"),
    pytest.param(_weights_with(_LONG_NAME, "backbone." + _LONG_NAME), "invalid_checkpoint", "each tensor once",
                 id="weight-given-twice"),
])
def test_a_long_name_refused_is_told_by_its_size_not_echoed(serve, request_of, code, expected):
    """A state part's or a weight's name a client chose went into the error whole, up to four
    times (field, got, the detail's tensor, the message): a reply many times the request."""
    srv, conn = serve(), RecordingConnection()
    op, args = request_of(srv, conn)
    error = error_of(srv, conn, op, **args)
    told = error["message"] + repr(error["detail"])
    assert (error["code"], expected in error["detail"]["expected"]) == (code, True), told[:300]
    assert f"{len(_LONG_NAME)} bytes" in told and len(told) < 1000


def _config_with(**entries):
    # model_load of a tiny mamba model's config with `entries` over it, and its weights.
    def request(srv, conn) -> tuple[str, dict]:
        from test_return_state import MODEL_CONFIGS, tiny_weights

        weights = tiny_weights("mamba", torch.Generator().manual_seed(random_seed()))
        return "model_load", dict(config={**MODEL_CONFIGS["mamba"], **entries}, weights=weights)
    return request


@pytest.mark.parametrize("request_of, code, field", [
    pytest.param(_config_with(arch=_LONG_NAME), "invalid_checkpoint", "args.config.arch", id="config-arch"),
    pytest.param(_config_with(d_model=_LONG_NAME), "invalid_checkpoint", "args.config.d_model", id="config-size"),
    pytest.param(lambda srv, conn: ("model_load", dict(weights={}, config={**tiny_mamba(0).to_diff_dict(),
                                                                           "architectures": _LONG_NAME})),
                 "invalid_checkpoint", "args.config.architectures", id="config-architectures"),
    # Paths up to PATH_MAX are looked for; a longer one is refused unresolved.
    pytest.param(lambda srv, conn: ("model_load", dict(path=_LONG_PATH)), "invalid_checkpoint", "args.path",
                 id="path-not-there"),
    pytest.param(lambda srv, conn: ("model_load", dict(path="../" + _LONG_PATH[3:])), "path_not_allowed", "args.path",
                 id="path-outside"),
    pytest.param(lambda srv, conn: ("model_load", dict(path=_LONG_NAME)), "invalid_argument", "args.path",
                 id="path-past-path-max"),
])
def test_a_long_value_refused_is_told_by_its_size_not_echoed(serve, request_of, code, field):
    """A checkpoint's config value or a path a client chose went into the error whole (its repr
    in the message and the got, the path again in the detail)."""
    srv, conn = serve(), RecordingConnection()
    op, args = request_of(srv, conn)
    error = error_of(srv, conn, op, **args)
    told = error["message"] + repr(error["detail"])
    assert (error["code"], error["detail"].get("field")) == (code, field), told[:300]
    size = len(_LONG_PATH) if field == "args.path" and code != "invalid_argument" else len(_LONG_NAME)
    assert f"{size} bytes" in told and len(told) < 1000, told[:300]


def test_a_saved_state_part_of_an_integer_dtype_is_invalid_not_mis_shaped(serve):
    """SPEC §6.1: a state of a dtype not floating is invalid_argument, as a plain session's h0
    is (found in review: shape_mismatch, expected and got the same shape)."""
    srv, conn = serve(), RecordingConnection()
    lm = call(srv, conn, "model_load", path="mamba-lm-tied")["model"]
    session = call(srv, conn, "session_open", model=lm, batch=1)["session"]
    state = call(srv, conn, "session_state", session=session)["state"]
    state["layers.0.ssm"] = state["layers.0.ssm"].to(torch.int32)
    error = error_of(srv, conn, "session_open", model=lm, batch=1, state=state)
    assert (error["code"], error["detail"]["field"], error["detail"]["got"]) == (
        "invalid_argument", "args.state.layers.0.ssm", "i32"), error
    assert srv.server.sessions.usage()["sessions"] == 1


@pytest.mark.parametrize("args", [
    pytest.param(dict(), id="logits"),
    pytest.param(dict(output="hidden", return_state=True), id="hidden-and-state"),
])
def test_a_window_whose_output_cannot_be_framed_is_refused_before_it_runs(serve, monkeypatch, args):
    """A model_forward reply past what a frame carries (SPEC §2; here the limit is lowered, as a
    long window of a big vocabulary's logits reaches the real one) is refused before the window
    runs: found in review, the session's state had moved on behind the limit_exceeded, and a
    client sending the window again ran it twice. last_only's one position still fits."""
    import protocol

    srv, conn = serve(), RecordingConnection()
    lm = call(srv, conn, "model_load", path="mamba-lm-tied")["model"]
    session = call(srv, conn, "session_open", model=lm, batch=2)["session"]
    before = call(srv, conn, "session_state", session=session)["state"]
    tokens = torch.randint(0, VOCAB, (2, 12))
    monkeypatch.setattr(protocol.framing, "MAX_FRAMEABLE", 2 * 4 * max(VOCAB, 12) * 6)
    error = error_of(srv, conn, "model_forward", session=session, tokens=tokens, **args)
    assert (error["code"], error["detail"]["limit"]) == ("limit_exceeded", "reply_frame_size"), error
    assert error["detail"]["requested"] > error["detail"]["max"]
    after = call(srv, conn, "session_state", session=session)["state"]
    assert all(torch.equal(before[name], after[name]) for name in before)
    assert call(srv, conn, "model_forward", session=session, tokens=tokens, last_only=True)


def test_an_open_over_the_session_limit_copies_no_model_state_it_was_sent(serve, monkeypatch):
    """A model session's saved state, as a plain session's h0 (tests/test_sessions.py), was made
    device tensors before the session limits were checked (found in review); the session's own
    copy, made once it is open, is the only one. The state comes through whole all the same."""
    srv, conn = serve(max_sessions=1), RecordingConnection()
    lm = call(srv, conn, "model_load", path="mamba-lm-tied")["model"]
    session = call(srv, conn, "session_open", model=lm, batch=1)["session"]
    call(srv, conn, "model_step", session=session, tokens=torch.tensor([3]))
    state = call(srv, conn, "session_state", session=session)["state"]
    call(srv, conn, "session_close", session=session)
    copied = []
    device_tensor = srv.server.device_tensor
    monkeypatch.setattr(srv.server, "device_tensor", lambda wire: copied.append(wire) or device_tensor(wire))
    reopened = call(srv, conn, "session_open", model=lm, batch=1, state=state)["session"]
    assert all(torch.equal(call(srv, conn, "session_state", session=reopened)["state"][name], part)
               for name, part in state.items())
    error = error_of(srv, conn, "session_open", model=lm, batch=1, state=state)
    assert (error["code"], error["detail"]["limit"]) == ("limit_exceeded", "max_sessions"), error
    assert copied == []


def test_another_connections_model_and_snapshot_are_unknown(serve):
    srv, mine, theirs = serve(), RecordingConnection(), RecordingConnection()
    model = call(srv, mine, "model_load", path="mamba-lm-tied")["model"]
    session = call(srv, mine, "session_open", model=model, batch=1)["session"]
    snapshot = call(srv, mine, "session_snapshot", session=session)["snapshot"]
    other = call(srv, theirs, "session_open", batch=1, dim=4, state=2)["session"]
    assert error_of(srv, theirs, "session_open", model=model, batch=1)["code"] == "unknown_model"
    assert error_of(srv, theirs, "session_restore", session=other, snapshot=snapshot)["code"] == "unknown_snapshot"
    assert error_of(srv, theirs, "model_free", model=model)["code"] == "unknown_model"


def test_a_client_loads_steps_and_rolls_back_through_a_server_process(checkpoints):
    """End to end over the Port, on the server's default backend, with the Python client's
    model objects."""
    from bridge.client import PortClient, server_env

    model, _, seed = checkpoints[1]["mamba-lm-tied"]
    tokens = torch.randint(0, VOCAB, (1, PREFIX + 6))
    with PortClient(["--model-dir", str(checkpoints[0])], env=server_env()) as client:
        remote = client.load_model("mamba-lm-tied")
        session = remote.open_session(batch=1)
        got = [torch.as_tensor(session.forward(tokens[:, :PREFIX].numpy()))]
        snapshot = session.snapshot()
        steps = [torch.as_tensor(session.step(tokens[:, t].numpy())) for t in range(PREFIX, PREFIX + 6)]
        session.restore(snapshot)
        again = [torch.as_tensor(session.step(tokens[:, t].numpy())) for t in range(PREFIX, PREFIX + 6)]
        assert all(torch.equal(a, b) for a, b in zip(steps, again))
        # the rollback in one round trip: the frames since, as a step and a two-frame window
        frames = [("model_step", {"tokens": tokens[:, PREFIX].numpy()}),
                  ("model_forward", {"tokens": tokens[:, PREFIX + 1:PREFIX + 3].numpy(), "return_state": True})]
        first, (window, state) = session.restore_with_frames(snapshot, frames)
        assert torch.equal(torch.as_tensor(first), steps[0])
        rel_close(torch.as_tensor(window).transpose(0, 1), torch.stack(steps[1:3]), 1e-5, "re-simulated window")
        assert all(torch.equal(torch.as_tensor(state[k]), torch.as_tensor(v)) for k, v in session.state().items())
        fork = session.fork()
        assert set(fork.state()) == set(session.state())
        # a frame that also keeps the state before it, for a later rollback, in one round trip
        before = session.state()
        session.step(tokens[:, PREFIX + 3].numpy(), snapshot_into=snapshot)
        fork.restore(snapshot)
        assert all(torch.equal(torch.as_tensor(fork.state()[k]), torch.as_tensor(v)) for k, v in before.items())
        # a rollback whose re-simulated frame refreshes a ring's snapshot with the state before it
        ring = session.snapshot()
        session.restore_with_frames(snapshot, [("model_step", {"tokens": tokens[:, PREFIX + 3].numpy(),
                                                               "snapshot_into": ring})])
        fork.restore(ring)
        assert all(torch.equal(torch.as_tensor(fork.state()[k]), torch.as_tensor(v)) for k, v in before.items())
        short = remote.open_session(batch=1)
        ragged = torch.as_tensor(short.forward(tokens[:, :PREFIX].numpy(), lengths=np.array([3], np.int32)))
        rel_close(ragged[:, :3], torch.as_tensor(remote.open_session(batch=1).forward(tokens[:, :3].numpy())), 1e-5,
                  "a row of length 3 against a window of 3")
        assert not ragged[:, 3:].any()
        with pytest.raises(BridgeError) as exc:
            client.load_model("/etc")
        assert exc.value.code == "path_not_allowed"
    got += [s[:, None] for s in steps]
    rel_close(torch.cat(got, dim=1), oracle_outputs(model, tokens, "logits"), 1e-4, f"over the Port (seed {seed})")


@pytest.mark.parametrize("short_of, limit", [("EMFILE", "open_files"), ("ENFILE", "open_files"),
                                             ("ENOMEM", "memory")])
def test_a_checkpoint_file_the_server_had_no_descriptor_for_is_a_limit_not_a_bad_checkpoint(
        tmp_path, monkeypatch, short_of, limit):
    """Out of descriptors, config.json's open failed and the load was answered invalid_checkpoint,
    which a client takes for good; the same load succeeds once descriptors are free (found in
    review under `ulimit -n`)."""
    import errno

    import bridge.models.checkpoint as checkpoint
    from bridge.errors import OpError

    (tmp_path / "config.json").write_text("{}")

    def short(real, flags):
        raise OSError(getattr(errno, short_of), os.strerror(getattr(errno, short_of)))

    monkeypatch.setattr(checkpoint, "_open_unlinked", short)
    with pytest.raises(OpError) as refused:
        with checkpoint.checkpoint_file(str(tmp_path), "config.json", "config.json", (str(tmp_path),)):
            pass
    assert refused.value.code == "limit_exceeded"
    assert refused.value.detail == {"limit": limit, "field": "config.json"}


def test_a_hub_models_ref_the_server_had_no_descriptor_for_is_a_limit_too(tmp_path, monkeypatch):
    """hub_snapshot took every OpError of its ref's open for a cache without the model: out of
    descriptors, `org/name` was answered invalid_checkpoint "(none there)" (found in review)."""
    import errno

    import bridge.models.checkpoint as checkpoint
    from bridge.errors import OpError

    (tmp_path / "models--org--tiny" / "refs").mkdir(parents=True)
    (tmp_path / "models--org--tiny" / "refs" / "main").write_text("abc123")

    def short(real, flags):
        raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))

    monkeypatch.setattr(checkpoint, "_open_unlinked", short)
    with pytest.raises(OpError) as refused:
        checkpoint.hub_snapshot("org/tiny", (str(tmp_path),))
    assert (refused.value.code, refused.value.detail["limit"]) == ("limit_exceeded", "open_files")
