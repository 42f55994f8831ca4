"""In-process fakes shared by the session and batcher tests: `InProcessServer`, a Server and
Dispatcher in this process, spoken to through `RecordingConnection`s, and the `inproc` fixture
that makes them."""

from __future__ import annotations

import ctypes
import itertools
import threading

import pytest

import protocol
from bridge.client import BridgeError, result_from_wire, to_wire
from bridge.device import choose_device
from bridge.dispatcher import Background, Dispatcher
from bridge.ops import REGISTRY
from bridge.server import Server, ServerConfig
from bridge.timing import now_ns
from bridge.transports.base import Connection


def served_natively(reply) -> bool:
    """Whether a step's reply came from the native step path, by its timing: it makes no
    tensors of the wire bytes, so its h2d stage is 0, and so is its d2h unless it copied the
    state into the reply (return_state)."""
    timing = reply.timing
    return timing["h2d_us"] == 0 and (timing["d2h_us"] == 0 or "state" in (reply.result or {}))


# What step.cpp calls its kernels through: (problem, its size, error buffer, the buffer's size).
KERNEL_FUNCTION = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t)
KERNEL_CAPSULES = (("run_problem", b"scan_bridge.run_problem"), ("run_ssd_update", b"scan_bridge.run_ssd_update"),
                   ("run_model_step", b"scan_bridge.run_model_step"))


def stepper_whose_kernels_fail_after_running(kept: list):
    """A native path's Stepper whose kernels run, then report a failure (a device error reported
    late): the session's rows have moved when it raises. `kept` gets what must outlive it."""
    import scan_kernels
    from bridge.native import _module

    backend = scan_kernels.get_backend("cpu", "cpu")
    get_pointer, new_capsule = ctypes.pythonapi.PyCapsule_GetPointer, ctypes.pythonapi.PyCapsule_New
    get_pointer.restype, get_pointer.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    new_capsule.restype, new_capsule.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    capsules = []
    for attribute, name in KERNEL_CAPSULES:
        run = KERNEL_FUNCTION(get_pointer(getattr(backend, attribute), name))

        def failing_after_running(problem, size, error, error_size, run=run):
            if run(problem, size, error, error_size) == 0:
                ctypes.memmove(error, b"device lost\0", 12)
            return 1

        kernel = KERNEL_FUNCTION(failing_after_running)
        kept.append(kernel)
        capsules.append(new_capsule(ctypes.cast(kernel, ctypes.c_void_p), name, None))
    return _module().Stepper(*capsules, max_tensor_bytes=protocol.encode.MAX_BIN_BYTES,
                             max_reply_bytes=protocol.framing.MAX_FRAMEABLE)


class RecordingConnection(Connection):
    """A connection whose replies are decoded and kept until asked for by id."""

    def __init__(self):
        super().__init__("test")
        self._replies: dict = {}
        self._arrived = threading.Condition()
        self.answered: list = []  # the id of every reply sent, in order, repeats included

    def send(self, parts: list, buffers: list | None = None) -> None:
        reply = protocol.decode_reply(b"".join(parts), buffers or ())
        with self._arrived:
            self.answered.append(reply.id)
            self._replies[reply.id] = reply
            self._arrived.notify_all()

    def reply(self, request_id, timeout: float = 60.0) -> protocol.Reply:
        with self._arrived:
            if not self._arrived.wait_for(lambda: request_id in self._replies, timeout):
                raise TimeoutError(f"no reply to request {request_id}")
            return self._replies.pop(request_id)


class InProcessServer:
    """A Server (on the CPU unless `device` says otherwise) and its Dispatcher in this process.
    `hold()` parks the worker inside a ping so that requests queue up behind it; `go()` lets it
    on, and it gathers what is queued. `handlers` replace ops of the dispatcher's table (a
    "ping" among them: hold() then holds nothing)."""

    def __init__(self, device: str = "cpu", handlers: dict | None = None, **config):
        registry = REGISTRY.replacing({"ping": self._gated_ping, **(handlers or {})})
        self.server = Server(ServerConfig(device=device, **config), choose_device(device), registry)
        self._gate = threading.Event()
        self._gate.set()
        self._parked = threading.Event()
        self._held_ping = None
        self.ping_threads: list[str] = []  # the thread that served each ping
        self.dispatcher = Dispatcher(self.server)
        self.dispatcher.start()
        self._ids = itertools.count(1)

    def _gated_ping(self, server, call) -> dict:
        self.ping_threads.append(threading.current_thread().name)
        self._parked.set()
        if not self._gate.wait(60):
            raise TimeoutError("the test never let the worker go on")
        return {"pong": True}

    def hold(self, conn: RecordingConnection) -> None:
        self._gate.clear()
        self._parked.clear()
        self._held_ping = (conn, self.submit(conn, "ping"))
        if not self._parked.wait(60):
            raise TimeoutError("the worker did not reach the held ping")

    def hold_on_reader(self, conn: RecordingConnection) -> None:
        """As hold(), but the ping is served inline by a reader thread of its own (the server
        idle, nothing more waiting on its connection), which holds the serving lock while the
        worker is free to take queued requests."""
        self._gate.clear()
        self._parked.clear()
        ids: list = []
        reader = threading.Thread(target=lambda: ids.append(self.submit(conn, "ping", more_input=False)))
        reader.start()
        if not self._parked.wait(60):
            raise TimeoutError("the reader thread did not reach the held ping")
        self._held_ping = (conn, ids, reader)

    def go(self) -> None:
        self._gate.set()
        conn, request_id, *reader = self._held_ping
        if reader:  # held on a reader thread: its id is known once it returns
            reader[0].join(60)
            (request_id,) = request_id
        assert conn.reply(request_id).ok

    def submit(self, conn: RecordingConnection, op: str, *, more_input=True, deadline_us: int | None = None,
               age_ns: int = 0, **args) -> int:
        """Hand a request to the dispatcher as a transport would; `more_input=False` (or a
        function returning False) says that nothing else waits on the connection (an idle
        server then serves it on this thread). `age_ns`: how long ago its frame was complete."""
        request_id = next(self._ids)
        body = b"".join(protocol.encode_request(request_id, op, {k: to_wire(v) for k, v in args.items()},
                                                deadline_us=deadline_us))
        self.dispatcher.on_frame(conn, bytearray(body), now_ns() - age_ns, more_input=more_input)
        return request_id

    def request(self, conn: RecordingConnection, op: str, **args) -> protocol.Reply:
        return conn.reply(self.submit(conn, op, **args))

    def call(self, conn: RecordingConnection, op: str, **args) -> dict:
        reply = self.request(conn, op, **args)
        if not reply.ok:
            raise BridgeError(reply.error["code"], reply.error["message"], reply.error["detail"])
        return result_from_wire(reply.result, as_torch=True)

    def close(self) -> None:
        """Let the worker go and wait for it to end: no op of this server runs on afterwards."""
        self._gate.set()
        if not self.dispatcher.stop(60):
            raise TimeoutError("the dispatcher's worker was still serving 60 s after it was stopped")


class DrainRace:
    """Runs `dispatcher.drain()` at the first read of its `accepting` flag that finds it set, as
    a thread preempted right after that read would let drain() run: on the reading thread
    itself when nothing holds the dispatcher's pending-count lock there (the flag is read apart
    from the count), else on a thread of its own, which waits for that lock. `events` gets
    ("drained", what drain returned) when drain returns, and "replied" for each reply to `conn`."""

    def __init__(self, dispatcher: Dispatcher, conn: RecordingConnection):
        self.events: list = []
        self._drainer: threading.Thread | None = None
        race = self

        class Racing(type(dispatcher)):
            @property
            def accepting(self) -> bool:
                accepting = self.__dict__["_accepting"]
                if accepting and race._drainer is None:
                    if self._pending_lock.acquire(blocking=False):
                        self._pending_lock.release()
                        race._drainer = threading.current_thread()
                        race._drain()
                    else:
                        race._drainer = threading.Thread(target=race._drain, name="drainer", daemon=True)
                        race._drainer.start()
                return accepting

            @accepting.setter
            def accepting(self, value: bool) -> None:
                self.__dict__["_accepting"] = value

        dispatcher.__dict__["_accepting"] = dispatcher.__dict__.pop("accepting")
        dispatcher.__class__ = Racing
        self._dispatcher = dispatcher
        send = conn.send

        def noting_the_reply(parts, buffers=None):
            send(parts, buffers)
            self.events.append("replied")

        conn.send = noting_the_reply

    def _drain(self) -> None:
        self.events.append(("drained", self._dispatcher.drain(60)))

    def finish(self) -> list:
        """The events, once drain() has returned."""
        if self._drainer is not threading.current_thread():
            self._drainer.join(60)
        return self.events


class BackgroundLoads:
    """A model_load stand-in for InProcessServer's `handlers` (`{"model_load": loads.handler}`)
    that finishes in the background as a CPU load does (bridge.dispatcher.Background), its
    answer `{"model": path}`. Every load but those whose `path` is in `quick` holds the loader
    thread until `go()`; `started` lists the paths whose finishing began, in order."""

    def __init__(self, quick: tuple = ()):
        self.quick = quick
        self.started: list = []
        self._began = threading.Condition()
        self._gate = threading.Event()

    def handler(self, server, call):
        path = call.args["path"]

        def finish() -> dict:
            with self._began:
                self.started.append(path)
                self._began.notify_all()
            if path not in self.quick and not self._gate.wait(60):
                raise TimeoutError("the test never let the load go on")
            return {"model": path}

        return Background(finish)

    handler.worker_only = True  # as model_load's

    def wait_started(self, path: str) -> None:
        with self._began:
            if not self._began.wait_for(lambda: path in self.started, 60):
                raise TimeoutError(f"the load of {path} never began")

    def go(self) -> None:
        self._gate.set()


@pytest.fixture
def inproc():
    servers = []

    def make(**config) -> InProcessServer:
        servers.append(InProcessServer(**config))
        return servers[-1]

    yield make
    for s in servers:
        s.close()
