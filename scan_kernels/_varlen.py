"""Variable-length batches: n sequences packed along seq (batch 1), cut at `cu_seqlens`.

A backend that packs an op's sequences itself (`Backend.packs_sequences`) takes the whole call
with its boundaries. For the others the call, checked once as a whole, is split into one
backend call per sequence (views, no copies of the inputs), each starting from its own row of
h0, and the outputs are joined again (y along seq, the final states stacked). A sequence never
sees another's state.
"""

from __future__ import annotations

import torch

from ._args import _check_devices, _require_shape, _require_tensor, check_cu_seqlens


def check_packed(args, *, seq_axis: int, h0, cu_seqlens, state_shape: tuple[int, ...], state_meaning: str,
                 dstate=None):
    """(boundaries as a list, h0, dstate) of a packed call whose other inputs `args` holds,
    checked: cu_seqlens against x's time axis `seq_axis`, h0 and dstate (a backward's) a row of
    `state_shape` per sequence."""
    x = args.x
    bounds = check_cu_seqlens(cu_seqlens, x.shape[0], x.shape[seq_axis])
    rows = {"h0": h0, "dstate": dstate}
    for name, t in rows.items():
        if t is not None:
            rows[name] = _require_tensor(name, t)
            _require_shape(name, rows[name], (len(bounds) - 1, *state_shape), f"[sequences, {state_meaning}]")
            _check_devices(dict(x=x, **{name: rows[name]}))
    return bounds, rows["h0"], rows["dstate"]


def packed_arguments(args, *, seq_axis: int, h0, cu_seqlens, state_shape: tuple[int, ...], state_meaning: str,
                     dstate=None) -> dict:
    """The keywords of a packed call for a backend that packs the op itself: h0 (and a
    backward's dstate, where given) checked as check_packed checks them, and the boundaries as
    the CPU int64 tensor backends take."""
    bounds, h0, checked_dstate = check_packed(args, seq_axis=seq_axis, h0=h0, cu_seqlens=cu_seqlens,
                                              state_shape=state_shape, state_meaning=state_meaning, dstate=dstate)
    packed = {"h0": h0, "cu_seqlens": torch.tensor(bounds, dtype=torch.int64)}
    return packed if dstate is None else {**packed, "dstate": checked_dstate}


def scan_sequences(one, args, *, packs: bool, seq_axis: int, bc_axis: int, h0, cu_seqlens,
                   state_shape: tuple[int, ...], state_meaning: str):
    """(y, state or None) of a packed call: `one(x, dt, B, C, z, h0, return_state)` (a
    backend's scan, the rest bound) over the whole call with its boundaries (`cu_seqlens=` int64)
    where the backend `packs` the op, else once per packed sequence (run_packed)."""
    where = dict(h0=h0, cu_seqlens=cu_seqlens, state_shape=state_shape, state_meaning=state_meaning)
    if packs:
        packed = packed_arguments(args, seq_axis=seq_axis, **where)
        return one(args.x, args.dt, args.B, args.C, args.z, packed["h0"], args.return_state,
                   cu_seqlens=packed["cu_seqlens"])
    return run_packed(one, args, seq_axis=seq_axis, bc_axis=bc_axis, **where)


def run_packed(scan_one, args, *, seq_axis: int, bc_axis: int, h0, cu_seqlens, state_shape: tuple[int, ...],
               state_meaning: str):
    """(y, state or None) of `args` (checked, h0 left out) scanned once per packed sequence by
    `scan_one(x, dt, B, C, z, h0, return_state)`, a backend's scan with the other arguments bound.

    seq_axis: the time axis of x, dt and z; bc_axis: that of B and C (with their groups axis);
    state_shape: one sequence's state (h0 is [sequences, *state_shape])."""
    x = args.x
    bounds, h0, _ = check_packed(args, seq_axis=seq_axis, h0=h0, cu_seqlens=cu_seqlens, state_shape=state_shape,
                                 state_meaning=state_meaning)
    count = len(bounds) - 1
    ys, states = [], []
    for i in range(count):
        begin, length = bounds[i], bounds[i + 1] - bounds[i]

        def cut(t, axis):
            return None if t is None else t.narrow(axis, begin, length)

        y, state = scan_one(cut(x, seq_axis), cut(args.dt, seq_axis), cut(args.B, bc_axis), cut(args.C, bc_axis),
                            cut(args.z, seq_axis), None if h0 is None else h0[i:i + 1], args.return_state)
        ys.append(y)
        states.append(state)
    return torch.cat(ys, dim=seq_axis), (torch.cat(states, dim=0) if args.return_state else None)


def run_packed_backward(one, args, dy, *, h0, dstate, cu_seqlens, seq_axis: int, bc_axis: int,
                state_shape: tuple[int, ...], state_meaning: str) -> dict:
    """The gradients of a packed call: one backend backward per sequence,
    its slices of x, dt, z, B, C and dy with its rows of h0 and dstate, joined as the forward
    joins y (weights' gradients summed over the sequences)."""
    x = args.x
    bounds, h0, dstate = check_packed(args, seq_axis=seq_axis, h0=h0, cu_seqlens=cu_seqlens, state_shape=state_shape,
                                      state_meaning=state_meaning, dstate=dstate)
    count = len(bounds) - 1
    parts = []
    for i in range(count):
        begin, length = bounds[i], bounds[i + 1] - bounds[i]

        def cut(t, axis):
            return None if t is None else t.narrow(axis, begin, length)

        parts.append(one(cut(dy, seq_axis), cut(x, seq_axis), cut(args.dt, seq_axis), cut(args.B, bc_axis),
                         cut(args.C, bc_axis), cut(args.z, seq_axis), None if h0 is None else h0[i:i + 1],
                         None if dstate is None else dstate[i:i + 1]))
    joined = {}
    for name in parts[0]:
        pieces = [p[name] for p in parts]
        if pieces[0] is None:  # an input not given
            continue
        if name in ("x", "dt", "z"):
            joined[name] = torch.cat(pieces, dim=seq_axis)
        elif name in ("B", "C"):
            joined[name] = torch.cat(pieces, dim=bc_axis)
        elif name == "h0":
            joined[name] = torch.cat(pieces, dim=0)
        else:
            joined[name] = torch.stack(pieces).sum(0)
    return joined
