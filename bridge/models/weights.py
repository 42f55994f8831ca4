"""Which tensors a model of a config has, under the names transformers and mamba_ssm give them.

Both libraries name a block's tensors alike (`layers.{i}.mixer.in_proj.weight`, ...) under a
`backbone.` prefix; they differ only in the embedding (`embeddings` / `embedding`). Names are
taken without the prefix, and the embedding under either. A weight map is checked whole -- every
tensor present and of its shape, nothing unexpected -- before anything is converted or moved.
"""

from __future__ import annotations

from protocol import key_path, shown_key

from .config import ModelConfig, checkpoint_error

EMBEDDINGS = "embeddings.weight"
LM_HEAD = "lm_head.weight"
_ALIASES = {"embedding.weight": EMBEDDINGS}


def canonical_name(name: str) -> str:
    name = name.removeprefix("backbone.")
    return _ALIASES.get(name, name)


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of the model, by canonical name. A tied head is the embedding itself, so
    `lm_head.weight` is listed only for a head of its own (a saved copy of a tied one is read to
    be checked, see `check_weights`)."""
    c = config
    shapes: dict[str, tuple[int, ...]] = {}
    if c.has_embeddings:
        shapes[EMBEDDINGS] = (c.vocab_size, c.d_model)
        if c.lm_head == "own":
            shapes[LM_HEAD] = (c.vocab_size, c.d_model)
    for i in range(c.n_layer):
        m = f"layers.{i}.mixer."
        shapes[f"layers.{i}.norm.weight"] = (c.d_model,)
        if c.arch == "mamba":
            shapes[m + "in_proj.weight"] = (2 * c.d_inner, c.d_model)
            shapes[m + "x_proj.weight"] = (c.dt_rank + 2 * c.d_state, c.d_inner)
            shapes[m + "dt_proj.weight"] = (c.d_inner, c.dt_rank)
            shapes[m + "dt_proj.bias"] = (c.d_inner,)
            shapes[m + "A_log"] = (c.d_inner, c.d_state)
            shapes[m + "D"] = (c.d_inner,)
        else:
            shapes[m + "in_proj.weight"] = (2 * c.d_inner + 2 * c.ngroups * c.d_state + c.nheads, c.d_model)
            shapes[m + "dt_bias"] = (c.nheads,)
            shapes[m + "A_log"] = (c.nheads,)
            shapes[m + "D"] = (c.nheads,)
            shapes[m + "norm.weight"] = (c.d_inner,)
        if c.use_bias:
            shapes[m + "in_proj.bias"] = (shapes[m + "in_proj.weight"][0],)
            shapes[m + "out_proj.bias"] = (c.d_model,)
        shapes[m + "conv1d.weight"] = (c.conv_dim, 1, c.d_conv)
        if c.use_conv_bias:
            shapes[m + "conv1d.bias"] = (c.conv_dim,)
        shapes[m + "out_proj.weight"] = (c.d_model, c.d_inner)
    shapes["norm_f.weight"] = (c.d_model,)
    return shapes


def check_weights(config: ModelConfig, shapes: dict[str, tuple[int, ...]],
                  field: str) -> tuple[set[str], str | None]:
    """Check the checkpoint's tensor shapes (by original name) against the config's; returns the
    original names to load, and the name of a saved copy of a tied head (mamba_ssm saves one),
    to be read only to check that it is the embeddings (_build). Raises invalid_checkpoint
    naming the first tensor missing, mis-shaped or unexpected."""
    by_canonical: dict[str, str] = {}
    for name in shapes:
        canonical = canonical_name(name)
        if canonical in by_canonical:
            raise checkpoint_error(key_path(field, name), "each tensor once",
                                   f"{shown_key(name)} and {shown_key(by_canonical[canonical])} for one tensor",
                                   tensor=key_path("", canonical))
        by_canonical[canonical] = name
    # The layer count is the config's (a client's) to say: more layers than tensors cannot all
    # be there, and the first missing is found without listing every layer's shapes first.
    if config.n_layer > len(shapes):
        first = next(i for i in range(len(shapes) + 1) if f"layers.{i}.norm.weight" not in by_canonical)
        missing = f"layers.{first}.norm.weight"
        raise checkpoint_error(f"{field}.{missing}", f"a tensor of shape {[config.d_model]}", "nothing", tensor=missing)
    expected = expected_shapes(config)
    for canonical, shape in expected.items():
        if canonical not in by_canonical:
            raise checkpoint_error(f"{field}.{canonical}", f"a tensor of shape {list(shape)}", "nothing",
                                   tensor=canonical)
    tied_head = config.lm_head == "tied"
    wanted, tied_copy = set(), None
    for canonical, name in by_canonical.items():
        want = expected.get(canonical)
        if want is None and tied_head and canonical == LM_HEAD:
            want, tied_copy = expected[EMBEDDINGS], name
        elif want is not None:
            wanted.add(name)
        if want is None:
            raise checkpoint_error(key_path(field, name), f"only the tensors of this {config.arch} config",
                                   f"an unexpected tensor {shown_key(name)}", tensor=key_path("", name))
        if tuple(shapes[name]) != want:
            raise checkpoint_error(f"{field}.{name}", f"shape {list(want)}", f"shape {list(shapes[name])}",
                                   tensor=canonical)
    return wanted, tied_copy
