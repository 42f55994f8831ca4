"""Whole Mamba and Mamba-2 models hosted on the server: a checkpoint (or a client's own config
and weights) in, a stack run a sequence or a timestep at a time over state kept in the server's
pool (bridge.sessions). The runtime builds on the kernels API and knows nothing of the wire.

    config.py      the architecture, from transformers', mamba_ssm's or this server's config
    weights.py     which tensors a config has, and the check of a checkpoint's against them
    checkpoint.py  where the server may read, and which files hold the tensors
    runtime.py     the forward pass and the step
    table.py       loaded models, owned by connections and held against the pool budget
"""

from __future__ import annotations

import contextlib
import math
from typing import Callable

import torch

from protocol import key_path

from ..errors import OpError
from ..tensors import wire_name
from .checkpoint import (CONFIG, MAX_CONFIG_BYTES, TensorSource, allowed_dirs, checkpoint_file, read_json,
                         resolve_checkpoint)
from .config import ARCHS, ModelConfig, checkpoint_error, parse_config
from .runtime import Model, param_dtype
from .weights import EMBEDDINGS, LM_HEAD, canonical_name, check_weights

__all__ = ["ARCHS", "Model", "ModelConfig", "allowed_dirs", "load_checkpoint", "load_weights", "parse_config"]


def load_checkpoint(path: str, model_dirs: tuple[str, ...], dtype: torch.dtype, device: torch.device,
                    hold: Callable[[int], None]) -> Model:
    """The model in checkpoint directory `path` (under `model_dirs`), its weights in `dtype` on
    `device`. `hold(nbytes)` is called with the bytes the weights will take before any is read
    (but a legacy-format pytorch_model.bin's, read whole to learn its shapes): it raises to
    refuse them."""
    directory = resolve_checkpoint(path, model_dirs)
    with checkpoint_file(directory, CONFIG, CONFIG, model_dirs) as config_path:
        config = parse_config(read_json(config_path, CONFIG, MAX_CONFIG_BYTES), CONFIG)
    source = TensorSource(directory, model_dirs)
    wanted, tied_copy = check_weights(config, source.shapes, "weights")
    hold(planned_bytes(source.shapes, wanted, dtype))
    # Closed here: a build that fails mid-read leaves the reader paused with its file open, for
    # as long as anything keeps the error's traceback.
    with contextlib.closing(source.tensors(wanted | {tied_copy} - {None})) as named:
        return _build(config, named, dtype, device, "weights", owned=True)


def load_weights(raw_config, weights: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device,
                 hold: Callable[[int], None]) -> Model:
    """The model a client sends: a config map and its tensors by name (on any device)."""
    config = parse_config(raw_config, "args.config")
    for name, tensor in weights.items():
        # As a checkpoint's (checkpoint.py): integers would convert to floats and load as a
        # model of nonsense.
        if not tensor.is_floating_point():
            raise checkpoint_error(key_path("args.weights", name), "a floating tensor (f32, bf16, f16, f64)",
                                   wire_name(tensor.dtype), tensor=key_path("", name))
    shapes = {name: tuple(t.shape) for name, t in weights.items()}
    wanted, tied_copy = check_weights(config, shapes, "args.weights")
    hold(planned_bytes(shapes, wanted, dtype))
    return _build(config, ((name, weights[name]) for name in wanted | {tied_copy} - {None}), dtype, device,
                  "args.weights", owned=False)


def planned_bytes(shapes: dict[str, tuple[int, ...]], wanted: set[str], dtype: torch.dtype) -> int:
    """The bytes a model's weights take once converted (see runtime.param_dtype)."""
    return sum(math.prod(shapes[name]) * param_dtype(canonical_name(name), dtype).itemsize for name in wanted)


def _build(config: ModelConfig, named, dtype: torch.dtype, device: torch.device, field: str, *,
           owned: bool) -> Model:
    """The model of `named` (each tensor under its name as given); a tensor that is not finite is
    invalid_checkpoint, named `field`.<its name as given>, as check_weights names the others.
    `owned`: the tensors were read for this load alone, so one already in the model's dtype and
    on its device is kept, not copied (a load's peak memory would otherwise hold each twice)."""
    tensors, given = {}, {}
    for name, tensor in named:
        canonical = canonical_name(name)
        given[canonical] = name
        # Otherwise a copy: a request's frame does not outlive the load. Detached, as a .bin saved
        # from parameters keeps requires_grad, which the runtime's in-place ops refuse.
        converted = tensor.detach().to(device=device, dtype=param_dtype(canonical, dtype),
                                       copy=not owned).contiguous()
        if not torch.isfinite(converted).all():
            raise _not_finite(f"{field}.{name}", canonical, tensor, converted.dtype)
        tensors[canonical] = converted
    if config.lm_head == "tied" and LM_HEAD in tensors:
        # A saved copy of the tied head: one that differs is a contradiction the libraries
        # resolve apart (transformers projects with it, mamba_ssm loads it as the embeddings).
        if not torch.equal(tensors.pop(LM_HEAD), tensors[EMBEDDINGS]):
            raise checkpoint_error(f"{field}.{given[LM_HEAD]}", "a copy of the embeddings, as the config ties "
                                   "the head to them", "a matrix of its own", tensor=LM_HEAD)
    return Model(config, tensors)


def _not_finite(field: str, canonical: str, stored: torch.Tensor, dtype: torch.dtype) -> OpError:
    """The error for a weight that is not finite in the model's dtype: stored so, or finite as
    stored but past the range of the dtype it was converted to (an f16 load of a large weight)."""
    wide = stored.detach().to(torch.float64).flatten()
    if not torch.isfinite(wide).all():
        return checkpoint_error(field, "finite values", "NaN or infinity", tensor=canonical)
    return checkpoint_error(field, f"values within {wire_name(dtype)}'s range (|x| <= {torch.finfo(dtype).max:g})",
                            f"a value of {wide[wide.abs().argmax()].item():g}", tensor=canonical)
