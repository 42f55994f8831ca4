"""The state every op handler sees: configuration, device, backend, counters, stop signal, and
what lives on the device between requests (sessions, snapshots, models, tensor handles) with their owners."""

from __future__ import annotations

import logging
import os
import threading
import weakref
from contextlib import contextmanager
import dataclasses

import torch

import scan_kernels
import protocol

from .device import DeviceChoice
from .errors import allocation
from .handles import HandleTable
from .health import DeviceProbe
from .models import allowed_dirs
from .models.graphs import ModelStepGraphs
from .models.table import LoadedModel, ModelTable
from .queued import QueuedRequests
from .sessions import Session, SessionTable, SnapshotTable, StateLayout, state_lost
from .step_graphs import StepGraphs
from .stats import Stats
from .tensors import host_view, to_device
from .timing import now_ns

log = logging.getLogger("bridge")


@dataclasses.dataclass
class ServerConfig:
    device: str = "auto"
    backend: str | None = None
    max_frame_size: int = protocol.DEFAULT_MAX_FRAME_SIZE
    max_pending: int = 4096
    # Bytes of requests in flight (their frames, held until answered) over all connections: the
    # count above alone let thousands of large frames be held at once.
    max_pending_bytes: int = 4 << 30
    # Dynamic batching (bridge.batcher): how long a batch may wait for company after its first
    # request arrived (0: never wait; requests already queued still join), and the most rows
    # one launch takes. On the CPU no delay beat 0, since requests queue up behind each launch
    # anyway (docs/performance.md, "max_delay_us default"); a GPU, where a launch costs more than
    # a request, may gain from a few hundred µs. A lone caller never waits (BatchPolicy).
    max_delay_us: int = 0
    max_batch: int = 1024
    # What may stay on the device between requests, over all connections.
    max_sessions: int = 4096
    max_pool_bytes: int = 1 << 30
    max_snapshots: int = 65536
    max_models: int = 256
    max_handles: int = 4096
    max_handle_bytes: int = 1 << 30
    # The socket lanes' caps (bridge.transports): requests one unix connection or ZeroMQ peer may
    # have in flight before its later ones wait, and unix connections served at once. Here, not
    # only in the CLI, so that `info` reports them with the other limits: a client keeps its own
    # in-flight bound within the first.
    max_in_flight_per_peer: int = 64
    max_connections: int = 256
    # ZeroMQ peers held at once: each route is a peer with its own cap and queue, and one
    # connection may make up routes at will, so they are bounded over the lane as connections are.
    max_zmq_peers: int = 4096
    # Seconds a ZeroMQ peer owning something may stay silent before it counts as gone and what
    # it owns is freed (ZeroMQ does not always tell when a peer leaves); None: never.
    idle_timeout_s: float | None = None
    # Seconds a unix connection may leave a frame half-sent before its input is ended and that
    # frame dropped, so that a hung or hostile peer cannot hold a connection's slot and its
    # frame's bytes for ever; None: never.
    stall_timeout_s: float | None = 60.0
    # Serve plain steps that find nothing but native steps in flight in C++ (bridge.native), where it can.
    native_step: bool = True
    # On CUDA, replay captured state updates for steps like ones seen before (bridge.step_graphs).
    cuda_graphs: bool = True
    # CPU threads one kernel call may use (torch.set_num_threads, which the cpu backend's helper
    # pool follows), set by `python -m bridge` at start: it is the whole process's, so a Server
    # made in-process leaves it alone. None: torch's default, the machine's cores. Fewer than the
    # cores leaves cores to clients on the same machine, trading throughput for their tail
    # latency (docs/performance.md, "threads default").
    threads: int | None = None
    # Directories model_load may read checkpoints under (--model-dir); none: it reads no files.
    model_dirs: tuple[str, ...] = ()
    # The Prometheus endpoint (--metrics-port; 0 takes a free port; None: no endpoint, and no
    # histograms kept) and the address it binds.
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"


# The limits `info` reports: every max_* setting, and the timeouts.
LIMITS = tuple(f.name for f in dataclasses.fields(ServerConfig) if f.name.startswith("max_")) + (
    "idle_timeout_s", "stall_timeout_s")


class Server:
    def __init__(self, config: ServerConfig, device: DeviceChoice, registry=None):
        """`registry`: the ops served (bridge.ops.Registry; default: every op's handler)."""
        if registry is None:
            from .ops import REGISTRY as registry  # the ops import this module
        registry.check_complete()
        self.registry = registry
        self.config = config
        self.device_choice = device
        self.device = device.device
        self.backend = scan_kernels.select_backend(self.device.type, config.backend)
        self.stats = Stats(histograms=config.metrics_port is not None)
        # http://host:port/metrics once bridge.metrics serves it (info reports it)
        self.metrics_endpoint: str | None = None
        self.stop_requested = threading.Event()
        # Requests waiting for the dispatcher's worker, which a cancel may drop (bridge.queued).
        self.queued = QueuedRequests()
        self.probe = DeviceProbe(self.device, self.backend)
        self.transports: list[str] = []
        self.compiled: list[str] = []
        # Backends that read unaligned memory themselves need no aligned copy of inputs.
        self.unaligned_ok = scan_kernels.reads_unaligned(self.backend, self.device.type)
        self.sessions = SessionTable(self.device, max_sessions=config.max_sessions,
                                     max_pool_bytes=config.max_pool_bytes)
        self.handles = HandleTable(max_handles=config.max_handles, max_bytes=config.max_handle_bytes)
        self.snapshots = SnapshotTable(self.sessions, max_snapshots=config.max_snapshots)
        self.models = ModelTable(self.sessions, max_models=config.max_models)
        # Absolute now (the working directory is this start's), resolved at each load (model_dirs).
        self._model_dirs_given = tuple(os.path.abspath(d) for d in config.model_dirs)
        # The one op fast path that serves requests straight from their frames (the step op's
        # native path; bridge.dispatcher says when), or None: every request goes the general way.
        self.fast_path = registry.fast_path(self)
        # Steps on CUDA replaying captured state updates (None: every step calls the kernels API).
        graphs = config.cuda_graphs and self.device.type == "cuda"
        self.step_graphs = StepGraphs(self.backend) if graphs else None
        # Model steps on CUDA replaying a capture of the whole stack (None: composed every time).
        self.model_step_graphs = ModelStepGraphs() if graphs else None
        self.stats.add_gauge("sessions", self.sessions.usage)
        self.stats.add_gauge("handles", self.handles.usage)
        self._watched: dict[str, object] = {}  # id -> connection whose close frees what it owns
        self._tables = (self.sessions, self.snapshots, self.models, self.handles)
        for table in self._tables:
            table.on_emptied = self._owner_emptied
        self._watched_lock = threading.Lock()
        self._released = weakref.WeakSet()  # connections gone, whose release has run

    @property
    def model_dirs(self) -> tuple[str, ...]:
        """The --model-dir roots as they resolve now: a link among them re-pointed while the
        server runs (a deploy's `current` link) is followed from then on."""
        return allowed_dirs(self._model_dirs_given)

    def tensor_arg(self, call, name: str) -> protocol.WireTensor | torch.Tensor | None:
        """The request argument `name` as it came: wire bytes not yet made a tensor, or a
        handle's tensor (None when absent: protocol.OPS has already refused a request missing a
        required one). Batched ops join members' bytes first and make one tensor of them."""
        value = call.args.get(name)
        if isinstance(value, protocol.HandleRef):
            return self.resolve_handle(call.conn, value.handle, f"args.{name}")
        return value

    def tensor_in_map(self, call, value: protocol.WireTensor | protocol.HandleRef, field: str) -> torch.Tensor:
        """A tensor given inside a map argument (a model's weights or state) as a device tensor:
        a handle's tensor, or the wire bytes as device_tensor makes them."""
        if isinstance(value, protocol.HandleRef):
            return self.resolve_handle(call.conn, value.handle, field)
        return self.device_tensor(value)

    def device_tensor(self, wire: protocol.WireTensor) -> torch.Tensor:
        """Wire bytes as a tensor on the device (a view of them where the device is the CPU)."""
        return to_device(wire, self.device, unaligned_ok=self.unaligned_ok)

    def resolve_handle(self, conn, handle: str, field: str) -> torch.Tensor:
        return self.handles.get(conn.id, handle, field)

    def session(self, conn, session_id: str, field: str, *, lost_ok: bool = False) -> Session:
        """The session `session_id` opened by `conn`; state_lost where a failed step left its
        state undefined, unless `lost_ok` (for an op that overwrites the whole state)."""
        session = self.sessions.get(conn.id, session_id, field)
        if session.lost and not lost_ok:
            raise state_lost(session_id, field)
        return session

    def open_session(self, conn, batch: int, layout: StateLayout, op: str = "session_open") -> Session:
        session = self.sessions.open(conn.id, batch, layout, op)
        self._watch(conn)
        return session

    def model(self, conn, model_id: str, field: str) -> LoadedModel:
        """The model `model_id` loaded by `conn`."""
        return self.models.get(conn.id, model_id, field)

    def load_model(self, conn, load, name: str | None) -> LoadedModel:
        """A model built by `load(hold)` (bridge.models.table), owned by `conn`."""
        loaded = self.models.load(conn.id, load, name)
        self._watch(conn)
        return loaded

    def free_model(self, conn, loaded: LoadedModel) -> None:
        """Free a model no session uses, and its sessions' snapshots."""
        self.models.free(conn.id, loaded.id, "args.model")
        self.snapshots.drop_model(loaded.id)
        if self.model_step_graphs is not None:
            self.model_step_graphs.forget(loaded.model)

    def take_snapshot(self, conn, session: Session) -> str:
        snapshot = self.snapshots.take(conn.id, session)
        self._watch(conn)
        return snapshot

    def put_tensor(self, call, name: str) -> str:
        """Copy the request's tensor argument `name` to the device as a handle of the caller's."""
        wire = call.args[name]
        self.handles.check_room(len(wire.data))
        start = now_ns()
        # Always a copy: the frame the bytes arrived in goes back to its pool after the reply.
        with allocation("put"):
            tensor = host_view(wire).to(self.device, copy=True)
        call.timing.add("h2d", now_ns() - start)
        handle = self.handles.put(call.conn.id, tensor)
        self._watch(call.conn)
        return handle

    def _watch(self, conn) -> None:
        """Free what `conn` owns when it closes. Called after something was created for it: if
        it closed meanwhile, on_close runs the release at once, so nothing is left behind."""
        with self._watched_lock:
            if conn.id in self._watched:
                return
            self._watched[conn.id] = conn
        conn.on_close(self._release_connection)

    def _owner_emptied(self, owner: str) -> None:
        """Stop watching a connection that freed the last of what it owned: a ZeroMQ peer is held
        (against --max-zmq-peers, and freed as idle past --idle-timeout-s) while something waits
        for its close. One that creates something again is watched again (_watch)."""
        with self._watched_lock:
            if any(table.holds_any(owner) for table in self._tables):
                return
            conn = self._watched.pop(owner, None)
        if conn is not None:
            conn.remove_close_callback(self._release_connection)

    def _release_connection(self, conn) -> None:
        with self._watched_lock:
            self._watched.pop(conn.id, None)
            # Released before: this is what requests it left behind made after it went.
            gone_now = conn not in self._released
            self._released.add(conn)
        # Sessions before the models whose state they hold.
        sessions = self.sessions.release_owner(conn.id)
        snapshots = self.snapshots.release_owner(conn.id)
        models = self.models.release_owner(conn.id)
        if models and self.model_step_graphs is not None:
            self.model_step_graphs.forget()  # the captures of the models just released
        handles = self.handles.release_owner(conn.id)
        reason = getattr(conn, "close_reason", "closed")
        self.stats.record_release(reason, {"sessions": sessions, "snapshots": snapshots, "models": models,
                                           "handles": handles}, gone_now)
        if sessions or snapshots or models or handles:
            log.info("%s %s: freed %d sessions, %d snapshots, %d models and %d tensor handles",
                     conn.id, "closed" if reason == "closed" else f"went {reason}", sessions, snapshots,
                     models, handles)

    @contextmanager
    def kernel_timer(self, *calls):
        """Charges the enclosed kernel work to `kernel_us` of every call in the launch: wall time
        on the CPU; on CUDA, device events recorded around the kernels API's call, so the time
        includes what the host does inside that call before the kernels reach the GPU (argument
        checks, Triton's launch path), which for a step's microseconds-long kernel may be most of
        it (docs/performance.md, "GPU kernel timing"). Work that completes (waited for, on CUDA)
        tells the health check the device answered (bridge.health); work that raised does not."""
        if self.device.type == "cuda":
            # The server's device's stream, named: the current device is per thread, and ops run on
            # reader threads as well as the worker, where it is GPU 0 whatever --device cuda:N said.
            stream = torch.cuda.current_stream(self.device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            yield
            end.record(stream)
            end.synchronize()
            elapsed = int(start.elapsed_time(end) * 1e6)
        else:
            t0 = now_ns()
            yield
            elapsed = now_ns() - t0
        self.probe.note_launch()
        for call in calls:
            call.timing.add("kernel", elapsed)
