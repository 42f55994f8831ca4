"""Variable-length batches: n sequences packed along seq (batch 1), cut at `cu_seqlens`.

Every backend serves them the same way: the checked call is split into one call per sequence
(views, no copies of the inputs), each starting from its own row of h0, and the outputs are
joined again (y along seq, the final states stacked). A sequence never sees another's state.
"""

from __future__ import annotations

import torch

from ._args import _require_shape, _require_tensor, check_cu_seqlens


def run_packed(scan_one, *, x, seq_axis: int, packed: dict, h0, return_state: bool, cu_seqlens,
               state_shape: tuple[int, ...], state_meaning: str):
    """Runs `scan_one(h0=..., return_state=..., **packed sliced)` once per sequence.

    packed: the tensors (or None) cut along seq; each maps to its seq axis. x is among them.
    state_shape: one sequence's state shape, without the leading row axis (h0 is [n, *it])."""
    bounds = check_cu_seqlens(cu_seqlens, x.shape[0], x.shape[seq_axis])
    count = len(bounds) - 1
    if h0 is not None:
        h0 = _require_tensor("h0", h0)
        _require_shape("h0", h0, (count, *state_shape), f"[sequences, {state_meaning}]")
    ys, states = [], []
    for i in range(count):
        begin, end = bounds[i], bounds[i + 1]
        sliced = {name: (None if t is None else t.narrow(axis, begin, end - begin))
                  for name, (t, axis) in packed.items()}
        out = scan_one(h0=None if h0 is None else h0[i:i + 1], return_state=return_state, **sliced)
        if return_state:
            ys.append(out[0])
            states.append(out[1])
        else:
            ys.append(out)
    y = torch.cat(ys, dim=seq_axis)
    return (y, torch.cat(states, dim=0)) if return_state else y

