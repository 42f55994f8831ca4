"""A model's architecture, read from the config of any of the public layouts.

Three layouts are recognised by their keys:
  * Hugging Face transformers: `model_type` "mamba" (MambaConfig) or "mamba2" (Mamba2Config);
  * mamba_ssm's MambaConfig: `d_model`, `n_layer`, `ssm_cfg` (its `layer` "Mamba2" or Mamba-1);
  * this server's own (a backbone a client sends with its weights): `arch` "mamba" or
    "mamba2" and mamba_ssm's names (`d_model`, `n_layer`, `d_state`, ...), `vocab_size`
    optional: without it the model takes embeddings in and gives hidden states out.
Missing optional keys take the defaults of the layout's own library; keys this runtime does not
use are ignored, and settings it cannot run (LayerNorm blocks, MLP layers) are refused by name.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import scan_kernels
from protocol import shown_key, shown_value

from ..errors import OpError

ARCHS = ("mamba", "mamba2")
# The largest size a config may give: a tensor dimension (torch's are int64).
MAX_SIZE = 2**63 - 1
# The chunks the chunked Mamba-2 scans take by default (a model's prefill names none), the torch
# form's and Triton's: a position holds heads x a chunk of decays and scores there, and
# d_inner x state / a chunk of the chunk states.
SSD_DEFAULT_CHUNKS = (64, 128)
# mamba_ssm's Mamba2 builds its gated RMSNorm with this eps, whatever norm_epsilon says.
MAMBA_SSM_GATED_EPS = 1e-5


def checkpoint_error(field: str, expected: str, got: str, **extra) -> OpError:
    """The one error for a checkpoint (files, or config and weights sent) that cannot be loaded.
    Its text may name a file's keys or tensors, which JSON (\\ud800) and pickle may give as lone
    surrogates that no reply can encode: those are written escaped, as repr writes them."""
    field, expected, got = _encodable(field), _encodable(expected), _encodable(got)
    extra = {key: _encodable(value) if isinstance(value, str) else value for key, value in extra.items()}
    return OpError("invalid_checkpoint", f"{field}: expected {expected}, got {got}",
                   {"field": field, "expected": expected, "got": got, **extra})


def _encodable(text: str) -> str:
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


@dataclass(frozen=True)
class ModelConfig:
    arch: str  # "mamba" (Mamba-1) or "mamba2"
    d_model: int
    n_layer: int
    vocab_size: int | None  # rows of the embedding (padded as the checkpoint pads); None: embeddings in
    d_state: int
    d_conv: int
    d_inner: int
    dt_rank: int  # Mamba-1
    headdim: int  # Mamba-2
    ngroups: int  # Mamba-2
    eps: float
    residual_in_fp32: bool
    lm_head: str | None  # "tied" (the embedding), "own" (lm_head.weight) or None: hidden states out
    use_bias: bool
    use_conv_bias: bool
    dt_limit: tuple[float, float]  # Mamba-2; (0, inf) clamps nothing
    chunk_size: int | None  # Mamba-2

    @property
    def nheads(self) -> int:
        return self.d_inner // self.headdim

    @property
    def conv_dim(self) -> int:
        """Channels of the causal conv: x alone (Mamba-1), or x, B and C (Mamba-2)."""
        return self.d_inner if self.arch == "mamba" else self.d_inner + 2 * self.ngroups * self.d_state

    @property
    def position_width(self) -> int:
        """The most numbers a layer holds in one buffer a position (logits aside): the residual,
        the in_proj's output (z and x; for Mamba-2 B, C and dt too), Mamba-1's x_proj output,
        and the chunked Mamba-2 scans' decay and score rows and share of the chunk states."""
        if self.arch == "mamba":
            return max(self.d_model, 2 * self.d_inner, self.dt_rank + 2 * self.d_state)
        in_proj = 2 * self.d_inner + 2 * self.ngroups * self.d_state + self.nheads
        shortest, longest = SSD_DEFAULT_CHUNKS
        return max(self.d_model, in_proj, self.nheads * longest, -(-self.d_inner * self.d_state // shortest))

    @property
    def has_embeddings(self) -> bool:
        return self.vocab_size is not None

    @property
    def has_logits(self) -> bool:
        return self.lm_head is not None

    def ssm_shape(self) -> tuple[int, ...]:
        return (self.d_inner, self.d_state) if self.arch == "mamba" else (self.nheads, self.headdim, self.d_state)

    def state_parts(self) -> tuple[tuple[str, tuple[int, ...]], ...]:
        """Every layer's state, one row's: its conv window (the last d_conv inputs, newest last,
        as mamba_ssm and transformers keep it) and its ssm state."""
        parts = []
        for i in range(self.n_layer):
            conv, ssm = layer_state_names(i)
            parts.append((conv, (self.conv_dim, self.d_conv)))
            parts.append((ssm, self.ssm_shape()))
        return tuple(parts)


def layer_state_names(i: int) -> tuple[str, str]:
    """The names of layer i's conv window and ssm state among a row's state parts."""
    return f"layers.{i}.conv", f"layers.{i}.ssm"


class _Keys:
    """A config map read one key at a time, each error naming the key."""

    def __init__(self, raw: dict, field: str):
        self.raw = raw
        self.field = field

    def _get(self, key: str, default):
        if key in self.raw and self.raw[key] is not None:
            return self.raw[key]
        if default is _REQUIRED:
            raise checkpoint_error(f"{self.field}.{key}", "a value (the layout's required key)", "nothing")
        return default

    def size(self, key: str, default=None) -> int | None:
        value = self._get(key, default)
        if value is None:
            return None
        if type(value) is not int or not 0 < value <= MAX_SIZE:
            raise checkpoint_error(f"{self.field}.{key}", f"a positive int (at most {MAX_SIZE})", shown_value(value))
        return value

    def number(self, key: str, default) -> float:
        value = self._get(key, default)
        number = _as_float(value)
        if number is None or not math.isfinite(number) or number <= 0:
            raise checkpoint_error(f"{self.field}.{key}", "a positive finite number", shown_value(value))
        return number

    def flag(self, key: str, default: bool) -> bool:
        value = self._get(key, default)
        if type(value) is not bool:
            raise checkpoint_error(f"{self.field}.{key}", "a bool", shown_value(value))
        return value

    def limits(self, key: str) -> tuple[float, float]:
        value = self._get(key, (0.0, math.inf))
        pair = [_as_float(_json_float(v)) for v in value] if isinstance(value, (list, tuple)) else None
        if pair is None or len(pair) != 2 or any(v is None or math.isnan(v) for v in pair) or pair[0] > pair[1]:
            raise checkpoint_error(f"{self.field}.{key}", "a pair [low, high] with low <= high", shown_value(value))
        try:  # a side past float32's range, refused as a request's dt_limit is: at load, not at each call
            scan_kernels.dt_limit_bounds((pair[0], pair[1]))
        except scan_kernels.KernelInputError as exc:
            raise checkpoint_error(f"{self.field}.{key}", exc.expected, shown_value(value)) from None
        return pair[0], pair[1]

    def require(self, key: str, allowed: tuple, meaning: str) -> None:
        """A setting this runtime only runs with one of `allowed` values."""
        value = self._get(key, allowed[0])
        if value not in allowed:
            raise checkpoint_error(f"{self.field}.{key}", f"{' or '.join(map(repr, allowed))} ({meaning})",
                                   shown_value(value))


_REQUIRED = object()
# How transformers writes a float JSON has no literal for.
_JSON_FLOATS = {"Infinity": math.inf, "-Infinity": -math.inf}


def _json_float(value):
    if (isinstance(value, dict) and set(value) == {"__float__"} and isinstance(value["__float__"], str)
            and value["__float__"] in _JSON_FLOATS):
        return _JSON_FLOATS[value["__float__"]]
    return value


def _as_float(value) -> float | None:
    """An int or float as a float; None for any other value, or for an int past a float's range
    (JSON bounds no int, and float() of one overflows)."""
    if type(value) not in (int, float):
        return None
    try:
        return float(value)
    except OverflowError:
        return None


def parse_config(raw, field: str = "config") -> ModelConfig:
    """The architecture a config map describes; raises invalid_checkpoint naming the key."""
    if not isinstance(raw, dict):
        raise checkpoint_error(field, "a map (config.json's object)", type(raw).__name__)
    keys = _Keys(raw, field)
    if "model_type" in raw:
        if raw["model_type"] == "mamba":
            return _hf_mamba(keys)
        if raw["model_type"] == "mamba2":
            return _hf_mamba2(keys)
        raise checkpoint_error(f"{field}.model_type", '"mamba" or "mamba2" (transformers\' Mamba layouts)',
                               shown_value(raw["model_type"]))
    if "arch" in raw:
        if raw["arch"] not in ARCHS:
            raise checkpoint_error(f"{field}.arch", '"mamba" or "mamba2"', shown_value(raw["arch"]))
        if "ssm_cfg" in raw:  # its keys would go unread, dt_limit and norm_before_gate among them
            raise checkpoint_error(f"{field}.ssm_cfg", "no ssm_cfg with arch (this layout has mamba_ssm's keys "
                                   "at the top level)", "a nested ssm_cfg")
        return _mamba_ssm(keys, raw["arch"], raw, library=False)
    if "d_model" in raw and "n_layer" in raw:
        ssm_cfg = raw.get("ssm_cfg") or {}
        if not isinstance(ssm_cfg, dict):
            raise checkpoint_error(f"{field}.ssm_cfg", "a map", type(ssm_cfg).__name__)
        layer = ssm_cfg.get("layer", "Mamba1")
        if layer not in ("Mamba1", "Mamba2"):
            raise checkpoint_error(f"{field}.ssm_cfg.layer", '"Mamba1" or "Mamba2"', shown_value(layer))
        return _mamba_ssm(keys, "mamba2" if layer == "Mamba2" else "mamba", {**raw, **ssm_cfg}, library=True)
    raise checkpoint_error(field, "a Mamba config: transformers' (model_type), mamba_ssm's (d_model, n_layer) "
                           "or this server's (arch)",
                           "keys " + ", ".join(shown_key(str(key)) for key in sorted(map(str, raw))[:12]) if raw else "an empty map")


def _hf_mamba(k: _Keys) -> ModelConfig:
    d_model = k.size("hidden_size", _REQUIRED)
    d_inner = k.size("intermediate_size", None) or _inner(k, d_model)
    dt_rank = _dt_rank(k, "time_step_rank", d_model)
    k.require("hidden_act", ("silu", "swish"), "the activation this runtime runs")
    return ModelConfig(
        arch="mamba", d_model=d_model, n_layer=k.size("num_hidden_layers", _REQUIRED),
        vocab_size=k.size("vocab_size", _REQUIRED), d_state=k.size("state_size", 16),
        d_conv=k.size("conv_kernel", 4), d_inner=d_inner, dt_rank=dt_rank, headdim=1, ngroups=1,
        eps=k.number("layer_norm_epsilon", 1e-5), residual_in_fp32=k.flag("residual_in_fp32", True),
        lm_head=_hf_head(k, k.flag("tie_word_embeddings", True)), use_bias=k.flag("use_bias", False),
        use_conv_bias=k.flag("use_conv_bias", True), dt_limit=(0.0, math.inf), chunk_size=None)


def _hf_mamba2(k: _Keys) -> ModelConfig:
    d_model = k.size("hidden_size", _REQUIRED)
    nheads, headdim = k.size("num_heads", 128), k.size("head_dim", 64)
    d_inner = _inner(k, d_model)
    if nheads * headdim != d_inner:
        raise checkpoint_error(f"{k.field}.num_heads", f"num_heads x head_dim = expand x hidden_size ({d_inner})",
                               f"{nheads} x {headdim}")
    k.require("rms_norm", (True,), "RMSNorm blocks; this runtime has no LayerNorm")
    k.require("hidden_act", ("silu", "swish"), "the activation this runtime runs")
    return ModelConfig(
        arch="mamba2", d_model=d_model, n_layer=k.size("num_hidden_layers", _REQUIRED),
        vocab_size=k.size("vocab_size", _REQUIRED), d_state=k.size("state_size", 128),
        d_conv=k.size("conv_kernel", 4), d_inner=d_inner, dt_rank=0, headdim=headdim,
        ngroups=_groups(k, "n_groups", nheads, 8), eps=k.number("layer_norm_epsilon", 1e-5),
        residual_in_fp32=k.flag("residual_in_fp32", True), lm_head=_hf_head(k, k.flag("tie_word_embeddings", False)),
        use_bias=k.flag("use_bias", False), use_conv_bias=k.flag("use_conv_bias", True),
        dt_limit=k.limits("time_step_limit"), chunk_size=k.size("chunk_size", 256))


def _mamba_ssm(k: _Keys, arch: str, merged: dict, library: bool) -> ModelConfig:
    """mamba_ssm's MambaConfig with its ssm_cfg (which it may leave out) merged in (`library`), or
    this server's flat config."""
    k = _Keys(merged, k.field)
    d_model = k.size("d_model", _REQUIRED)
    k.require("rms_norm", (True,), "RMSNorm blocks; this runtime has no LayerNorm")
    if merged.get("d_intermediate", 0):
        raise checkpoint_error(f"{k.field}.d_intermediate", "0 (Mamba blocks only; this runtime has no MLP layers)",
                               shown_value(merged["d_intermediate"]))
    if merged.get("attn_layer_idx"):
        raise checkpoint_error(f"{k.field}.attn_layer_idx", "no layers (Mamba blocks only; this runtime has no "
                               "attention layers)", shown_value(merged["attn_layer_idx"]))
    vocab = k.size("vocab_size", None)
    if vocab is not None:
        multiple = k.size("pad_vocab_size_multiple", 8 if library else 1)
        vocab += (-vocab) % multiple  # mamba_ssm's embedding has the padded rows
    d_inner = _inner(k, d_model)
    common = dict(d_model=d_model, n_layer=k.size("n_layer", _REQUIRED), vocab_size=vocab,
                  d_conv=k.size("d_conv", 4), d_inner=d_inner, eps=k.number("norm_epsilon", 1e-5),
                  residual_in_fp32=k.flag("residual_in_fp32", True),  # mamba_ssm's default
                  lm_head=None if vocab is None else ("tied" if k.flag("tie_embeddings", True) else "own"),
                  use_bias=k.flag("bias", False),
                  use_conv_bias=k.flag("conv_bias", True))
    if arch == "mamba":
        dt_rank = _dt_rank(k, "dt_rank", d_model)
        return ModelConfig(arch="mamba", d_state=k.size("d_state", 16), dt_rank=dt_rank, headdim=1, ngroups=1,
                           dt_limit=(0.0, math.inf), chunk_size=None, **common)
    headdim = k.size("headdim", 64)
    if d_inner % headdim:
        raise checkpoint_error(f"{k.field}.headdim", f"a divisor of expand x d_model ({d_inner})", str(headdim))
    if merged.get("d_ssm") not in (None, d_inner):
        raise checkpoint_error(f"{k.field}.d_ssm", f"expand x d_model ({d_inner}; no MLP part)",
                               shown_value(merged["d_ssm"]))
    k.require("norm_before_gate", (False,), "the gate before the norm, as mamba_ssm's default")
    k.require("rmsnorm", (True,), "the gated RMSNorm after the scan, as mamba_ssm's default")
    if library and common["eps"] != MAMBA_SSM_GATED_EPS:
        # mamba_ssm's Mamba-2 gated norm keeps its own eps whatever the blocks' is; this runtime
        # has one eps for every norm (transformers' rule, and this server's arch layout's).
        raise checkpoint_error(f"{k.field}.norm_epsilon", f"{MAMBA_SSM_GATED_EPS:g} for a mamba_ssm Mamba-2 config "
                               "(its gated norm's eps is fixed there; this runtime uses one eps for every norm)",
                               shown_value(merged["norm_epsilon"]))
    return ModelConfig(arch="mamba2", d_state=k.size("d_state", 128), dt_rank=0, headdim=headdim,
                       ngroups=_groups(k, "ngroups", d_inner // headdim), dt_limit=k.limits("dt_limit"),
                       chunk_size=k.size("chunk_size", 256), **common)


def _inner(k: _Keys, d_model: int) -> int:
    """The blocks' channels: expand x d_model, as the libraries round it, at least one."""
    expand = k.number("expand", 2)
    channels = expand * d_model
    if not math.isfinite(channels) or int(channels) < 1:
        raise checkpoint_error(f"{k.field}.expand", f"a factor that makes expand x d_model ({d_model}) "
                               "at least 1 channel", shown_value(k.raw.get("expand")))
    return int(channels)


def _dt_rank(k: _Keys, key: str, d_model: int) -> int:
    """Mamba-1's dt rank: a positive int, or "auto" (also when absent or null) for d_model / 16."""
    if k.raw.get(key) in (None, "auto"):
        return math.ceil(d_model / 16)
    return k.size(key)


def _hf_head(k: _Keys, tied: bool) -> str | None:
    """A transformers checkpoint saved from MambaModel / Mamba2Model (its `architectures` says
    so) has no head; a *ForCausalLM one has the embedding's (tied) or its own."""
    architectures = k.raw.get("architectures") or []
    if not isinstance(architectures, (list, tuple)):
        raise checkpoint_error(f"{k.field}.architectures", "a list of class names", shown_value(architectures))
    if architectures and all(isinstance(a, str) and not a.endswith("ForCausalLM") for a in architectures):
        return None
    return "tied" if tied else "own"


def _groups(k: _Keys, key: str, nheads: int, default: int = 1) -> int:
    """The B/C groups: transformers' Mamba2Config defaults them to 8, mamba_ssm's Mamba2 to 1."""
    groups = k.size(key, default)
    if nheads % groups:
        raise checkpoint_error(f"{k.field}.{key}", f"a divisor of the heads ({nheads})", str(groups))
    return groups
