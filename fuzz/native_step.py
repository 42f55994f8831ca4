"""Harness: the native step path's parser, `parse(frame)` of bridge/native/step.cpp, and the
step it then runs (`Stepper.run` for a Mamba-1 session, `Stepper.run_ssd` for a Mamba-2 one: the
shape checks against the session, the kernel reading the operands from the frame, the reply
written around y).

An input is one frame body (no length prefix). It is placed twice in memory, flush against an
inaccessible page after it and then before it, so a read past either end faults even in the
gcc build, where no sanitizer watches. The module is the sanitized clang build of
fuzz.native_build when the runner could make one (ASan + UBSan, libFuzzer's coverage of the
parser), else the server's own gcc build (bridge.native), which the runner says.

What must hold, beyond "no crash, no sanitizer report":
- both placements parse alike;
- a request `parse` takes is one the Python decoder takes too, as a step with the same id,
  session and handles, and within the native path's documented form (bridge/native/__init__.py:
  session, x, dt, B, C, z inline f32; A, D, dt_bias inline f32 or handles; the dt options), or
  as a model step with the same id and session, its embeds inline 2-d f32 or its tokens inline
  1-d i32, i64 or u8, its output and snapshot_into as given (what a model step runs is not
  fuzzed here: this build has no model kernel);
- `run` and `run_ssd` step only a request whose shapes fit the session (batch, dim, state; or
  batch, heads, headdim, state) and its handles' tensors, and the reply reads back as a v1 reply
  with y of [batch, dim] (or [batch, heads, headdim]) f32, and, with return_state, the state:
  the session's rows after the step, as they lie in the pool.
The session's kind follows x's rank, and its dims the request's own shapes, now and then the
other kind or a dim off by one (by a hash of the input, so a finding replays), so that both the
accepting and the refusing checks run.
"""

from __future__ import annotations

import array
import ctypes
import math
import mmap
import os
import random
import time
import zlib

from protocol import HandleRef, ProtocolError, Request, WireTensor, decode_reply, decode_request

from . import HarnessUnavailable, structure
from .checks import Finding, vector_frames
from .native_build import PLAN_ENV
from .tally import Tally

MAX_LEN = 4096
INLINE_ONLY = ("x", "dt", "B", "C", "z")
MAY_BE_HANDLES = ("A", "D", "dt_bias")
NATIVE_ARGS = frozenset(("session", *INLINE_ONLY, *MAY_BE_HANDLES, "dt_softplus", "dt_min", "dt_max", "return_state"))
NATIVE_MODEL_ARGS = frozenset(("session", "embeds", "tokens", "output", "return_state", "snapshot_into"))
# The state pool the harness allocates per step is bounded (the frame bounds batch and dim, but a
# handle's A could name any state size).
MAX_POOL_FLOATS = 1 << 20

# The kernels' capsules as the extension names them, and the sanitized build's shims behind them.
_CAPSULES = {"run_problem": (b"scan_bridge.run_problem", "scan_bridge_fuzz_run_problem"),
             "run_ssd_update": (b"scan_bridge.run_ssd_update", "scan_bridge_fuzz_run_ssd_update")}
_PROT_NONE = 0  # mprotect's: no access (Python's mmap module has no name for it)


class GuardedPlacement:
    """Bytes placed flush against an inaccessible page: `after(data)` ends where the page
    begins, `before(data)` starts where one ends. Any read beyond them faults. The two share
    the space between the pages: a view of one is overwritten by the other."""

    def __init__(self, capacity: int):
        page = mmap.PAGESIZE
        self._inner = -(-max(capacity, 1) // page) * page
        self._map = mmap.mmap(-1, self._inner + 2 * page)
        # An export of the map, for its address; while it lives the map cannot be closed.
        self._anchor = ctypes.c_char.from_buffer(self._map)
        base = ctypes.addressof(self._anchor)
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        for address in (base, base + page + self._inner):
            if libc.mprotect(address, page, _PROT_NONE) != 0:
                raise OSError(ctypes.get_errno(), "mprotect of a guard page failed")
        self._view = memoryview(self._map)
        self._start, self._end = page, page + self._inner

    def after(self, data: bytes) -> memoryview:
        start = self._end - len(data)
        self._view[start:self._end] = data
        return self._view[start:self._end].toreadonly()

    def before(self, data: bytes) -> memoryview:
        end = self._start + len(data)
        self._view[self._start:end] = data
        return self._view[self._start:end].toreadonly()


class _Target:
    module = None
    stepper = None
    # Two placements, so that the frame the first parse keeps views of stays as it was.
    placements = ()
    sanitized = False


_target = _Target()
_stats = Tally()


def _capsule_of(library: str, kernel: str):
    """A PyCapsule named as the kernels' export `kernel`, holding the sanitized build's shim."""
    name, symbol = _CAPSULES[kernel]
    function = getattr(ctypes.CDLL(library), symbol)
    new = ctypes.pythonapi.PyCapsule_New
    new.restype = ctypes.py_object
    new.argtypes = (ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p)
    return new(ctypes.cast(function, ctypes.c_void_p), name, None)


def setup() -> dict:
    plan = os.environ.get(PLAN_ENV, "")
    info = {"target": "bridge/native/step.cpp parse(frame), Stepper.run and run_ssd"}
    if plan.startswith("asan:"):
        library = plan.removeprefix("asan:")
        if not hasattr(ctypes.CDLL(None), "__asan_init"):
            raise HarnessUnavailable(f"{PLAN_ENV} names a sanitized build, but no ASan runtime is preloaded")
        import importlib.util

        spec = importlib.util.spec_from_file_location("scan_bridge_native_step_fuzz", library)
        _target.module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(_target.module)
        capsules = [_capsule_of(library, kernel) for kernel in _CAPSULES]
        _target.sanitized = True
        info.update(build="clang, sanitized", library=library, asan=True, ubsan=True, cpp_coverage=True,
                    kernel="scan_kernels/cpu/scan_kernel.cpp and ssd_kernel.cpp (g++, ASan + UBSan) on one thread")
    else:
        from scan_kernels.errors import BackendUnavailable

        try:
            import scan_kernels
            import torch

            from bridge import native

            torch.set_num_threads(1)  # the kernel's helper threads: one core, as the sanitized build

            _target.module = native._module()
            backend = scan_kernels.get_backend("cpu", "cpu")
            capsules = [getattr(backend, kernel) for kernel in _CAPSULES]
        except BackendUnavailable as exc:
            raise HarnessUnavailable(f"the gcc build of the native step path is unavailable: {exc}") from exc
        info.update(build="gcc (bridge.native, the server's own)", library=_target.module.__file__, asan=False,
                    ubsan=False, cpp_coverage=False, kernel="the cpu backend's (scan_kernels/cpu, gcc)",
                    fallback=plan.removeprefix("gcc:") or "no sanitized build was planned")
    _target.stepper = _target.module.Stepper(*capsules)
    _target.placements = (GuardedPlacement(MAX_LEN), GuardedPlacement(MAX_LEN))
    return info


def seeds() -> list[bytes]:
    return [frame[4:] for _, frame in vector_frames(multipart=False)]


def check_against_decoder(parsed, data: bytes) -> Request:
    """The Python decoder's reading of a frame `parse` took: the same step."""
    try:
        request = decode_request(data)
    except ProtocolError as exc:
        raise Finding(f"parse took a frame the decoder refuses: {exc.code}: {exc}") from exc
    if not isinstance(request, Request) or request.op != parsed.op or request.multipart:
        raise Finding(f"parse took a frame the decoder reads as {request!r}, as a {parsed.op}")
    if type(request.id) is not type(parsed.id) or request.id != parsed.id:
        raise Finding(f"parse read id {parsed.id!r}, the decoder {request.id!r}")
    if request.args.get("session") != parsed.session:
        raise Finding(f"parse read session {parsed.session!r}, the decoder {request.args.get('session')!r}")
    if request.args.get("return_state") not in (None, True, False) or \
            parsed.return_state != bool(request.args.get("return_state")):
        raise Finding(f"parse read return_state {parsed.return_state!r}, the decoder "
                      f"{request.args.get('return_state')!r}")
    if request.op == "model_step":
        check_model_step(parsed, request)
        return request
    handles = {name: value.handle for name, value in request.args.items() if isinstance(value, HandleRef)}
    if handles != dict(parsed.handles):
        raise Finding(f"parse read handles {dict(parsed.handles)!r}, the decoder {handles!r}")
    if not set(request.args) <= NATIVE_ARGS:
        raise Finding(f"parse took arguments outside its form: {sorted(set(request.args) - NATIVE_ARGS)}")
    for name, value in request.args.items():
        if name in INLINE_ONLY + MAY_BE_HANDLES and not isinstance(value, HandleRef):
            if not isinstance(value, WireTensor) or value.dtype != "f32" or not 1 <= len(value.shape) <= 3:
                raise Finding(f"parse took {name} as {value!r}")
    for name in ("deadline_us",):
        if hasattr(parsed, name) and getattr(parsed, name) != getattr(request, name, None):
            raise Finding(f"parse read {name} {getattr(parsed, name)!r}, the decoder {getattr(request, name, None)!r}")
    return request


def check_model_step(parsed, request: Request) -> None:
    args = request.args
    if not set(args) <= NATIVE_MODEL_ARGS:
        raise Finding(f"parse took model step arguments outside its form: {sorted(set(args) - NATIVE_MODEL_ARGS)}")
    embeds, tokens = args.get("embeds"), args.get("tokens")
    if (embeds is None) == (tokens is None):
        raise Finding(f"parse took a model step with embeds {embeds!r} and tokens {tokens!r}")
    if embeds is not None and (not isinstance(embeds, WireTensor) or embeds.dtype != "f32" or len(embeds.shape) != 2):
        raise Finding(f"parse took embeds as {embeds!r}")
    if tokens is not None and (not isinstance(tokens, WireTensor) or tokens.dtype not in ("i32", "i64", "u8")
                               or len(tokens.shape) != 1):
        raise Finding(f"parse took tokens as {tokens!r}")
    if args.get("output") not in (None, "hidden", "logits") or parsed.output != args.get("output"):
        raise Finding(f"parse read output {parsed.output!r}, the decoder {args.get('output')!r}")
    snapshot = args.get("snapshot_into")
    if parsed.snapshot_into != snapshot or not (snapshot is None or isinstance(snapshot, str) and snapshot):
        raise Finding(f"parse read snapshot_into {parsed.snapshot_into!r}, the decoder {snapshot!r}")
    if dict(parsed.handles) or parsed.deadline_us != getattr(request, "deadline_us", None):
        raise Finding(f"parse read handles {dict(parsed.handles)!r}, deadline {parsed.deadline_us!r}")


def _session_dims(request: Request, h: int) -> tuple[bool, tuple[int, ...]]:
    """(whether the session is Mamba-2, its dims): the kind x's rank says (the other for 1 input
    in 16), the dims the request's own (batch, dim, state; or batch, heads, headdim, state), one of
    them off by one for 3 inputs in 8."""
    x, a, b = request.args["x"], request.args.get("A"), request.args.get("B")
    ssd = (len(x.shape) == 3) != (h % 16 == 5)
    state = b.shape[-1] if isinstance(b, WireTensor) else 1
    if ssd:
        dims = [*(tuple(x.shape) + (1, 1))[:3], state]
    else:
        if isinstance(a, WireTensor) and len(a.shape) == 2:
            state = a.shape[1]
        dims = [x.shape[0], x.shape[-1], state]
    if (h >> 4) % 8 < 3:
        dims[(h >> 7) % len(dims)] += 1
    return ssd, tuple(dims)


def _handle_shapes(ssd: bool, dims: tuple[int, ...], h: int) -> dict:
    """The shapes each handle's tensor must have to fit the session."""
    if ssd:
        heads, headdim = dims[1], dims[2]
        return {"A": (heads,), "D": (heads, headdim) if (h >> 9) & 1 else (heads,), "dt_bias": (heads,)}
    dim, state = dims[1], dims[2]
    return {"A": (dim, state), "D": (dim,), "dt_bias": (dim,)}


def _fits(request: Request, ssd: bool, dims: tuple[int, ...], handle_shapes: dict) -> bool:
    """Whether the step's operands fit the session and the handles' tensors (what `run` and
    `run_ssd` must check before the kernel reads anything)."""
    def shape(name):
        value = request.args.get(name)
        return handle_shapes.get(name) if isinstance(value, HandleRef) else value.shape

    batch, state = dims[0], dims[-1]
    rows = dims[:3] if ssd else dims[:2]
    for name in ("x", "z"):
        if name in request.args and shape(name) != rows:
            return False
    if shape("dt") != (dims[:2] if ssd else rows):
        return False
    groups = set()
    for name in ("B", "C"):
        s = shape(name)
        if len(s) == 2 and s == (batch, state) and not ssd:
            groups.add(1)
        elif len(s) == 3 and s[0] == batch and s[2] == state:
            groups.add(s[1])
        else:
            return False
    if len(groups) != 1 or dims[1] % groups.pop():
        return False
    per_head = (dims[1],)
    if shape("A") != (per_head if ssd else dims[1:3]):
        return False
    if "D" in request.args and shape("D") not in ((per_head, dims[1:3]) if ssd else (per_head,)):
        return False
    if "dt_bias" in request.args and shape("dt_bias") != per_head:
        return False
    low, high = request.args.get("dt_min"), request.args.get("dt_max")
    return low is None or high is None or low <= high


def step(parsed, request: Request, data: bytes) -> None:
    h = zlib.crc32(data)
    ssd, dims = _session_dims(request, h)
    kind = "ssd " if ssd else ""
    if math.prod(dims) > MAX_POOL_FLOATS:
        _stats["pool too large"] += 1
        return
    keep, handle_tensors, handle_shapes = [], {}, {}
    fitting = _handle_shapes(ssd, dims, h)
    for i, name in enumerate(sorted(parsed.handles)):
        wanted = fitting[name]
        pick = (h >> (10 + 2 * i)) % 8
        if pick == 0:
            wanted = wanted[:-1] + (wanted[-1] + 1,)
        elif pick == 1:
            wanted = (1, *wanted)
        tensor = (ctypes.c_float * max(1, math.prod(wanted)))()
        keep.append(tensor)
        handle_tensors[name] = (ctypes.addressof(tensor), wanted)
        handle_shapes[name] = wanted
    batch = dims[0]
    row = math.prod(dims[1:])
    pool = (ctypes.c_float * (batch * row))()
    slots = (ctypes.c_int64 * batch)(*reversed(range(batch)))
    state_out = None
    if parsed.return_state:
        # The state goes in the reply: the pool's one part. Its floats differ, so that a copy
        # from the wrong row or column shows.
        ctypes.memmove(pool, array.array("f", range(batch * row)).tobytes(), batch * row * 4)
        state_out = _target.module.StateOut(ctypes.addressof(pool), row, False, (("state", dims[1:], 0),))
    run = _target.stepper.run_ssd if ssd else _target.stepper.run
    result = run(parsed, time.monotonic_ns(), 0, ctypes.addressof(pool), *dims, ctypes.addressof(slots),
                 handle_tensors, state_out)
    fits = _fits(request, ssd, dims, handle_shapes)
    if result is None:
        _stats[f"{kind}refused by run (fits)" if fits else f"{kind}refused by run"] += 1
        return
    if not fits:
        raise Finding(f"run stepped a request that does not fit {'Mamba-2 ' if ssd else ''}session {list(dims)} "
                      f"and handles {handle_shapes}")
    _stats[f"{kind}stepped"] += 1
    body, timing = result
    reply = decode_reply(body)
    y = reply.result.get("y") if reply.ok and isinstance(reply.result, dict) else None
    if (reply.id != request.id or not isinstance(y, WireTensor) or y.dtype != "f32"
            or y.shape != (dims[:3] if ssd else dims[:2])):
        raise Finding(f"the native reply reads back as {reply!r}")
    if dict(reply.timing) != dict(timing):
        raise Finding(f"the reply's timing {reply.timing!r} differs from the one returned {timing!r}")
    state = reply.result.get("state")
    if parsed.return_state:
        rows = memoryview(pool).cast("B")
        expected = b"".join(rows[slot * row * 4:(slot + 1) * row * 4] for slot in slots)
        if not isinstance(state, WireTensor) or state.dtype != "f32" or state.shape != dims or \
                bytes(state.data) != expected:
            raise Finding(f"the native reply's state reads back as {state!r}, not the session's rows {list(dims)}")
    elif state is not None:
        raise Finding(f"the native reply holds a state it was not asked for: {state!r}")


def one_input(data: bytes) -> None:
    _stats.execution()
    if len(data) > MAX_LEN:  # longer than the placements (libFuzzer's -max_len keeps it shorter)
        _stats["too long"] += 1
        return
    parsed = _target.module.parse(_target.placements[0].after(data))
    again = _target.module.parse(_target.placements[1].before(data))
    if (parsed is None) != (again is None):
        raise Finding(f"parse depends on where the frame lies: {parsed!r} vs {again!r}")
    del again
    if parsed is None:
        return
    _stats["parsed"] += 1
    request = check_against_decoder(parsed, data)
    if request.op == "model_step":
        _stats["model steps parsed"] += 1
        return
    step(parsed, request, data)


def mutator(data: bytes, max_size: int, seed: int, mutate_bytes=None) -> bytes:
    if mutate_bytes is None:
        import atheris

        mutate_bytes = atheris.Mutate
    rng = random.Random(seed)
    pick = rng.random()
    if pick < 0.2:
        out = mutate_bytes(data, min(max_size, len(data) + 64))
    elif pick < 0.8:
        message = structure.Message(data)
        out = structure.mutate_body(data, rng, message, lambda b: mutate_bytes(b, len(b) + 16),
                                    structure.step_request)
    else:
        out = structure.step_request(rng)
    return out if len(out) <= max_size else mutate_bytes(data, max_size)
