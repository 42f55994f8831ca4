"""The native step path: a plain `step` request, or a `model_step`, served from its frame to its
reply in one C++ call (step.cpp), on the CPU with the "cpu" backend, for Mamba-1 and Mamba-2
("ssd") sessions and for sessions of models whose step the backend fuses (fp32 or bf16 weights).

A step long after the last -- a 60 FPS game loop's frame -- spent much of its round trip in the
server's Python per-request work, which a pause makes several times slower than back to back
(docs/performance.md, "native step path"). Here the request is read where it lies in the
frame, the kernel reads its operands there and writes y straight into the reply.

What it takes -- anything else goes the general way (bridge.dispatcher), which answers every
error: a v1 request in one frame (no raw buffers: a stream lane's, or a one-part ZeroMQ message)
whose args are the session (this connection's), x, dt, B, C and optionally z inline as f32 (B
and C [batch, state] or [batch, groups, state]; for a Mamba-2 session the shapes of its
`step`, B and C with their groups axis), A and optionally D and dt_bias inline as f32 or as
handles to contiguous f32 tensors, and the dt options; or a model step's session, its `embeds`
inline as f32 [batch, d_model] or its `tokens` inline as i32, i64 or u8 [batch], its `output`
("hidden", "logits", or none: the model's default) and `snapshot_into` (a snapshot of this
connection's, of a session like it, which takes the state before the frame, copied in C++
before the kernel); either with `return_state`, whose state the reply carries as the general
path's does (copied from the session's rows into the reply after the kernel: its d2h); request
and session ids in ASCII; and a reply a frame can carry (SPEC §2: else the general path refuses
it before it runs). The dispatcher hands it every request without raw buffers that finds
nothing in flight but other native steps, on any lane and under load too (the step and model
step ops offer it as their fast path, bridge.ops.sessions.StepOp.fast_path and
bridge.ops.models.ModelStepOp.fast_path; docs/performance.md, "native model step"). Its replies
are the general path's, but for the timing: `queue_us` is the wait for the serving lock (behind
other connections' native steps), `decode_us` everything else before the kernel (parsing, the
session and handle lookups, the checks), h2d is 0 (the kernel reads the frame and writes the
reply), and so is d2h but for the state's copy into the reply of a step that asked for it; a
`snapshot_into`'s copy counts in `kernel_us`.
"""

from __future__ import annotations

import functools
import logging
import math
import weakref
from pathlib import Path

import torch

import scan_kernels
import protocol
from scan_kernels.errors import BackendUnavailable

from ..errors import OpError, error_fields
from ..models.config import layer_state_names
from ..sessions import lose_state
from ..timing import STAGE_KEYS

log = logging.getLogger("bridge")

NATIVE_DIR = Path(__file__).resolve().parent
MODULE_NAME = "scan_bridge_native_step"
BUILD_SUBDIRECTORY = "native_step"  # under scan_kernels.cpu.build.build_root()


def sources():
    """What the module is built from (scan_kernels.cpu.build.Sources)."""
    from scan_kernels.cpu import build

    return build.Sources(NATIVE_DIR, files=("step.cpp",),
                         headers=(build.SOURCE_DIR / "scan_kernel.h", build.SOURCE_DIR / "ssd_kernel.h",
                                  build.SOURCE_DIR / "model_step.h", build.SOURCE_DIR / "released_gil.h"),
                         include_dirs=(build.SOURCE_DIR,))


def _module():
    from scan_kernels.cpu import build

    return build.load_module(sources(), MODULE_NAME, BUILD_SUBDIRECTORY)


def library_path() -> Path:
    """Where the module's library is built for this process's flags."""
    from scan_kernels.cpu import build

    return build.module_library_path(sources(), MODULE_NAME, BUILD_SUBDIRECTORY)


class NativeStepError(OpError):
    """The native path failed once its kernel began (the module's StateWritten): the request
    must not be served again, and its session's state may have moved, so it is answered with
    this error: the cause's as the general path would answer it, the session lost
    (bridge.sessions.lose_state). What fails before the kernel is raised as it is: nothing was
    touched, and the dispatcher hands the request to the general path."""

    def __init__(self, request_id, cause: BaseException):
        super().__init__(*error_fields(cause))
        self.request_id = request_id


class NativeStep:
    """Serves plain step requests for `server` (see the module docstring)."""

    def __init__(self, server, module, backend):
        if tuple(module.STAGE_KEYS) != STAGE_KEYS:
            raise BackendUnavailable(f"native step path: its replies' stages {tuple(module.STAGE_KEYS)}, "
                                     f"expected bridge.timing's {STAGE_KEYS}")
        # Weakly: the server keeps its path (server.fast_path, and _PATHS while it lives), and a
        # path holding it back would keep every server, its pools and models, for good.
        self._server = weakref.ref(server)
        # parse(frame): the plain step request in `frame` (its id, session, handles and
        # deadline_us, read where it lies: valid while the frame is), or None for any other
        # request. Pure: the dispatcher asks before any bookkeeping. The module's own function,
        # with no Python call around it.
        self.parse = module.parse
        # A reply past these is declined, for the general path to refuse before the step runs.
        self._native = module.Stepper(backend.run_problem, backend.run_ssd_update, backend.run_model_step,
                                      max_tensor_bytes=protocol.encode.MAX_BIN_BYTES,
                                      max_reply_bytes=protocol.framing.MAX_FRAMEABLE)
        self._state_out_type = module.StateOut
        self._state_written = module.StateWritten
        self._prepare_model = backend.prepare_model
        # What the kernel needs of a session's pool rows and of a handle's tensor, read from
        # torch once rather than on every step (Python-level work, which a pause makes several
        # times slower). An entry holds a weak reference to the tensor it was read from (valid
        # while that is still the one in use) and leaves with its session or tensor (a weak
        # reference's callback), so the caches hold nothing alive and keep nothing of what is
        # gone.
        self._pools: dict[str, tuple] = {}
        self._handles: dict[str, tuple] = {}
        # The same for a model session's rows (every layer's parts), and a loaded model's
        # weights as the kernel prepared them (its capsule, or None where its step is not fused).
        self._model_rows: dict[str, tuple] = {}
        self._models: dict[str, tuple] = {}
        # And where a session's state lies, for the steps that return it.
        self._states: dict[str, tuple] = {}

    @classmethod
    def for_server(cls, server) -> NativeStep | None:
        """The server's native path (one, whichever op asks: the step and model step ops both
        offer it) when the server runs the "cpu" backend on the CPU, else None; also None, with
        the reason logged, when its extension cannot be built. It runs the kernel of the backend
        the server already loaded."""
        if server.device.type != "cpu" or server.backend != "cpu":
            return None
        if server not in _PATHS:
            try:
                _PATHS[server] = cls(server, _module(), scan_kernels.get_backend("cpu", "cpu"))
            except BackendUnavailable as exc:
                log.warning("native step path unavailable, steps take the general path: %s", exc)
                _PATHS[server] = None
        return _PATHS[server]

    @property
    def server(self):
        return self._server()

    def serve(self, conn, request, received_ns: int, queued_ns: int) -> tuple[bytes, dict] | None:
        """(reply body, timing) of a parsed plain step, the session's state stepped; None when
        its session or a handle is not this connection's or not usable here (nothing touched).
        `queued_ns`: how long it waited to be served, its queue_us. NativeStepError where its
        kernel began and failed; anything else it raises failed before, nothing touched."""
        session = self.server.sessions.find(conn.id, request.session)
        # A lost one (a step that failed partway) is refused by the general path (state_lost).
        if session is None or session.closed or session.lost:
            return None
        if request.op == "model_step":
            return self._serve_model(conn, request, session, received_ns, queued_ns)
        if session.kind not in ("mamba", "ssd"):
            return None
        # The kernel gets the handles' addresses only: their tensors are held here until it is
        # done, whatever frees the handles meanwhile.
        handle_tensors, held = {}, []
        for name, handle in request.handles.items():
            tensor = self.server.handles.find(conn.id, handle)
            if tensor is None:
                return None
            ref = self._handle_ref(handle, tensor)
            if ref is None:
                return None
            handle_tensors[name] = ref
            held.append(tensor)
        pool_address, slots_address = self._pool_addresses(session)
        state_out = self._state_out(session) if request.return_state else None
        try:
            if session.kind == "ssd":
                return self._native.run_ssd(request, received_ns, queued_ns, pool_address, session.batch,
                                            *session.shape, slots_address, handle_tensors, state_out)
            return self._native.run(request, received_ns, queued_ns, pool_address, session.batch, session.dim,
                                    session.state, slots_address, handle_tensors, state_out)
        except self._state_written as exc:
            raise self._lost(request, session, exc) from exc.__cause__

    def _serve_model(self, conn, request, session, received_ns: int, queued_ns: int):
        if session.kind != "model":
            return None
        loaded = self.server.models.find(conn.id, session.layout.model)
        if loaded is None:
            return None
        config = loaded.model.config
        prepared = self._prepared(loaded)
        if prepared is None:
            return None
        state_out = self._state_out(session) if request.return_state else None
        snapshot = None
        if request.snapshot_into is not None:
            # The general path names an unknown or unlike snapshot in its error.
            snapshot = self.server.snapshots.find(conn.id, request.snapshot_into)
            if snapshot is None or not snapshot.is_like(session):
                return None
        rows = self._model_row_addresses(session, config.n_layer)
        state = self._state_out(session) if snapshot is not None else None
        try:
            # `snapshot` is held here while the kernel writes into its rows.
            served = self._native.run_model(request, received_ns, queued_ns, prepared, session.batch, config.d_model,
                                            config.vocab_size or 0, config.has_logits, *rows, state_out,
                                            snapshot.rows.data_ptr() if snapshot is not None else 0, state)
        except self._state_written as exc:
            self._took(snapshot)
            raise self._lost(request, session, exc) from exc.__cause__
        if served is not None:
            self._took(snapshot)
        return served

    @staticmethod
    def _took(snapshot) -> None:
        """A model step that reached its kernel copied the state into `snapshot` (if it named
        one) whole first, a copy that cannot fail: it holds a defined state again, whatever an
        earlier copy left (bridge.sessions.Snapshot.take_again)."""
        if snapshot is not None:
            snapshot.copies_begun += 1
            snapshot.undefined_why = None

    @staticmethod
    def _lost(request, session, exc: BaseException) -> NativeStepError:
        """The error of a step whose kernel began and then failed (`exc`, StateWritten): its
        cause's, the session lost."""
        return NativeStepError(request.id, lose_state(exc.__cause__, [session]))

    def _prepared(self, loaded):
        """The kernel's prepared weights of a loaded model, or None where its step is not fused."""
        def prepare():
            arguments = loaded.model.fused_arguments() if self._prepare_model is not None else None
            return None if arguments is None else self._prepare_model(*arguments)

        return _cached(self._models, loaded.id, loaded.model, loaded.model, prepare)

    def _model_row_addresses(self, session, layers: int) -> tuple:
        """(slots, pool rows, each layer's conv and ssm part of row 0, the row stride in floats) of
        a model session: what run_model takes after the model."""
        flat = session.pool.flat  # replaced when the pool grows

        def addresses():
            parts = session.pool.parts
            conv, ssm = zip(*((parts[c].data_ptr(), parts[s].data_ptr())
                              for c, s in map(layer_state_names, range(layers))))
            return session.slots.data_ptr(), flat.shape[0], list(conv), list(ssm), flat.stride(0)

        return _cached(self._model_rows, session.id, session, flat, addresses)

    def _state_out(self, session):
        """Where the session's state lies, for a reply that returns it (step.cpp's StateOut: the
        pool's address, its row floats, whether the parts go by name (a model's), each part's
        name, row shape and column offset), the parts in the order session_state gives them."""
        flat = session.pool.flat  # replaced when the pool grows

        def describe():
            parts, offset = [], 0
            for name, shape in session.layout.parts:
                parts.append((name, tuple(shape), offset))
                offset += math.prod(shape)
            return self._state_out_type(flat.data_ptr(), flat.shape[1], session.kind == "model", tuple(parts))

        return _cached(self._states, session.id, session, flat, describe)

    def _pool_addresses(self, session) -> tuple[int, int]:
        """The addresses of the session's pool rows (contiguous fp32) and of its slots (int64)."""
        rows = session.pool.rows  # replaced when the pool grows
        return _cached(self._pools, session.id, session, rows, lambda: (rows.data_ptr(), session.slots.data_ptr()))

    def _handle_ref(self, handle: str, tensor: torch.Tensor) -> tuple | None:
        """(address, shape) of a handle's tensor when it is contiguous fp32 on the CPU, else None."""
        def reference():
            usable = tensor.dtype == torch.float32 and tensor.device.type == "cpu" and tensor.is_contiguous()
            return (tensor.data_ptr(), tuple(tensor.shape)) if usable else None

        return _cached(self._handles, handle, tensor, tensor, reference)


# Each server's native path (or None where it could not be made), while the server lives.
_PATHS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _cached(cache: dict, key: str, owner, source, make):
    """`make()`, kept in `cache` under `key` while `source` is still the object in use, and
    dropped when `owner` goes (weak references to both: the cache keeps nothing alive)."""
    entry = cache.get(key)
    if entry is None or entry[1]() is not source:
        entry = (weakref.ref(owner, functools.partial(_forget, cache, key)), weakref.ref(source), make())
        cache[key] = entry
    return entry[2]


def _forget(cache: dict, key: str, _dead_reference) -> None:
    cache.pop(key, None)
