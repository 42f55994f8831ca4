"""The native step path (bridge/native): plain steps served in C++ from frame to reply.

- what it serves is bit for bit what the general path serves (y, the state after, the reply's
  keys), on named cases: odd sizes, groups, every option, constants inline or as handles;
- what it does not take (other dtypes, per-row handles, bad shapes, another connection's
  session, freed handles, unknown keys) is handed on untouched and answered as the general path
  answers it;
- mutated frames never crash it, and the server answers every one;
- the kernels' capsule refuses a caller built against another ScanProblem.

Two in-process servers, one with the native path and one without, get the same requests with
fresh random inputs (the seed is in every failure message). The native path is offered every
request without raw buffers that finds nothing in flight, whatever waits behind it.
"""

from __future__ import annotations

import ctypes
import os
import random
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

import protocol
from bridge.native import NativeStep
from bridge.tensors import to_wire
from bridge.timing import STAGE_KEYS, now_ns
from bridge_fakes import DrainRace, RecordingConnection, served_natively, stepper_whose_kernels_fail_after_running
from kernel_cases import random_seed
from waiting import wait_until

def _native_available() -> str | None:
    from bridge.device import choose_device
    from bridge.server import Server, ServerConfig

    server = Server(ServerConfig(device="cpu"), choose_device("cpu"))
    if server.backend != "cpu":
        return f"the cpu backend is unavailable (the server runs {server.backend})"
    return None if NativeStep.for_server(server) is not None else "the native step extension cannot be built"


_UNAVAILABLE = _native_available()
pytestmark = pytest.mark.skipif(_UNAVAILABLE is not None, reason=str(_UNAVAILABLE))


@dataclass(frozen=True)
class StepCase:
    batch: int
    dim: int
    state: int
    groups: int = 0  # 0: B and C [batch, state]; else [batch, groups, state]
    options: bool = False  # D, z, dt_bias, softplus, clamp
    handles: bool = False  # A (and D, dt_bias) as handles
    steps: int = 3


CASES = [
    pytest.param(StepCase(1, 1, 1), id="1x1x1"),
    pytest.param(StepCase(3, 37, 5), id="odd-3x37x5"),
    pytest.param(StepCase(2, 40, 16, groups=2, options=True), id="groups-all-options"),
    pytest.param(StepCase(5, 24, 7, options=True, handles=True), id="options-as-handles"),
    pytest.param(StepCase(32, 512, 16, handles=True, steps=2), id="game-loop-32x512x16"),
    pytest.param(StepCase(4, 33, 16, groups=3, handles=True), id="3d-bc-1-group-per-11-channels"),
]


def step_inputs(case: StepCase, gen: torch.Generator) -> dict:
    b, d, n = case.batch, case.dim, case.state
    bc = (b, case.groups, n) if case.groups else (b, n)

    def rand(*shape, lo=-1.0, hi=1.0):
        return torch.rand(*shape, generator=gen) * (hi - lo) + lo

    args = {"x": rand(b, d), "dt": rand(b, d, lo=0.01, hi=0.5), "B": rand(*bc), "C": rand(*bc)}
    if case.options:
        args.update(z=rand(b, d), dt=rand(b, d, lo=-3.0, hi=1.0), dt_softplus=True, dt_min=0.005, dt_max=0.3)
    return args


def constants(case: StepCase, gen: torch.Generator) -> dict:
    out = {"A": -(torch.rand(case.dim, case.state, generator=gen) * 2 + 0.1)}
    if case.options:
        out.update(D=torch.rand(case.dim, generator=gen), dt_bias=torch.rand(case.dim, generator=gen) - 0.5)
    return out


class Served:
    """Records the connection of every request the native path of `srv` served; with
    `hold_first`, holds the first inside it (under the serving lock) until `let_go` is set."""

    def __init__(self, srv, hold_first: bool = False):
        native = srv.server.fast_path
        serve = native.serve
        self.conns, self.inside, self.let_go = [], threading.Event(), threading.Event()

        def recording(conn, request, *timings):
            outcome = serve(conn, request, *timings)
            if outcome is not None:
                self.conns.append(conn)
                if hold_first and len(self.conns) == 1:
                    self.inside.set()
                    self.let_go.wait(60)
            return outcome

        native.serve = recording

    @property
    def taken(self) -> int:
        return len(self.conns)


def submit(srv, conn, op, **args) -> protocol.Reply:
    return conn.reply(srv.submit(conn, op, more_input=False, **args))


def wire_array(t) -> np.ndarray:
    return np.frombuffer(bytes(t.data), dtype=np.float32).reshape(t.shape)


def open_session(srv, conn, case: StepCase, consts: dict) -> tuple[str, dict]:
    session = submit(srv, conn, "session_open", batch=case.batch, dim=case.dim, state=case.state).result["session"]
    if not case.handles:
        return session, dict(consts)
    return session, {name: protocol.HandleRef(submit(srv, conn, "put", tensor=t).result["handle"])
                     for name, t in consts.items()}


def seeded_session(inproc, case: StepCase) -> tuple:
    """(seed, its generator, an in-process server, a connection, a session of `case` on it, the
    session's constants: handles where the case says so), what a test of one session starts with."""
    seed = random_seed()
    gen = torch.Generator().manual_seed(seed)
    srv, conn = inproc(), RecordingConnection()
    session, consts = open_session(srv, conn, case, constants(case, gen))
    return seed, gen, srv, conn, session, consts


@pytest.mark.parametrize("case", CASES)
def test_native_steps_equal_the_general_path(inproc, case):
    seed = random_seed()
    gen = torch.Generator().manual_seed(seed)
    consts = constants(case, gen)
    frames = [step_inputs(case, gen) for _ in range(case.steps)]
    native_srv, general_srv = inproc(), inproc(native_step=False)
    assert general_srv.server.fast_path is None
    served = Served(native_srv)
    results = []
    for srv in (native_srv, general_srv):
        conn = RecordingConnection()
        session, shared = open_session(srv, conn, case, consts)
        # the last step returns the state it leaves (a checkpoint riding on the frame)
        replies = [submit(srv, conn, "step", session=session, **shared, **frame, return_state=t == case.steps - 1)
                   for t, frame in enumerate(frames)]
        assert all(r.ok for r in replies), (seed, [r.error for r in replies if not r.ok])
        state = submit(srv, conn, "session_state", session=session).result["state"]
        results.append(([wire_array(r.result["y"]) for r in replies], wire_array(state), replies))
    assert served.taken == case.steps, (seed, served.__dict__)
    (native_ys, native_state, native_replies), (general_ys, general_state, general_replies) = results
    for t, (a, b) in enumerate(zip(native_ys, general_ys)):
        assert np.array_equal(a, b), f"seed={seed}: y of step {t} differs by {np.abs(a - b).max()}"
    assert np.array_equal(native_state, general_state), f"seed={seed}: the state after the steps differs"
    assert not np.all(native_state == 0), f"seed={seed}: the steps left the state zero"
    returned = native_replies[-1].result["state"]
    assert returned.dtype == "f32" and np.array_equal(wire_array(returned), native_state), f"seed={seed}"
    for a, b in zip(native_replies, general_replies):
        assert (a.id, a.ok, list(a.result)) == (b.id, b.ok, list(b.result))
        assert a.result["y"].dtype == "f32" and tuple(a.result["y"].shape) == (case.batch, case.dim)
        assert set(a.timing) == set(b.timing), (a.timing, b.timing)
        stages = sum(a.timing[k] for k in STAGE_KEYS)
        assert a.timing["kernel_us"] > 0 and a.timing["server_us"] > stages, a.timing  # the stages fit
    stats = native_srv.server.stats.snapshot()["ops"]["step"]
    assert (stats["inference_count"], stats["execution_count"], stats["success_count"]) == (case.steps,) * 3


def declined_cases():
    """(id, how the request differs from a plain step, the error the general path gives or None)."""
    return [
        pytest.param("f16", lambda a, s, h, other: {**a, "x": a["x"].half(), "dt": a["dt"].half()}, None, id="f16-inputs"),
        pytest.param("z-handle", lambda a, s, h, other: {**a, "z": h["z"]}, None, id="z-as-handle"),
        pytest.param("x-rows", lambda a, s, h, other: {**a, "x": a["x"][:1]}, "shape_mismatch", id="x-rows"),
        pytest.param("A-shape", lambda a, s, h, other: {**a, "A": -torch.rand(3, 4) - 0.1}, "shape_mismatch",
                     id="A-shape"),
        pytest.param("clamp", lambda a, s, h, other: {**a, "dt_min": 0.5, "dt_max": 0.1}, "invalid_argument",
                     id="dt-min-above-max"),
        # Past float32's range the general path refuses a bound (found in review: the native path ran it).
        pytest.param("bound", lambda a, s, h, other: {**a, "dt_max": 1e39}, "invalid_argument",
                     id="dt-max-past-float32"),
        pytest.param("bound", lambda a, s, h, other: {**a, "dt_min": -1e39}, "invalid_argument",
                     id="dt-min-past-float32"),
        pytest.param("session", lambda a, s, h, other: {**a, "session": other}, "unknown_session",
                     id="another-connections-session"),
        pytest.param("handle", lambda a, s, h, other: {**a, "A": h["freed"]}, "unknown_handle", id="freed-handle"),
        pytest.param("key", lambda a, s, h, other: {**a, "h0": torch.rand(2, 6, 3)}, "invalid_argument",
                     id="argument-a-step-does-not-take"),
        pytest.param("bf16-A", lambda a, s, h, other: {**a, "A": a["A"].bfloat16()}, None, id="bf16-A-inline"),
    ]


@pytest.mark.parametrize("name,change,code", declined_cases())
def test_what_the_native_path_does_not_take_is_answered_as_before(inproc, name, change, code):
    seed = random_seed()
    gen = torch.Generator().manual_seed(seed)
    case = StepCase(2, 6, 3)
    consts = constants(case, gen)
    frame = step_inputs(case, gen)
    outcomes = []
    for native in (True, False):
        srv = inproc(native_step=native)
        served = Served(srv) if native else None
        conn, other = RecordingConnection(), RecordingConnection()
        session = submit(srv, conn, "session_open", batch=2, dim=6, state=3).result["session"]
        others = submit(srv, other, "session_open", batch=2, dim=6, state=3).result["session"]
        handles = {"z": protocol.HandleRef(submit(srv, conn, "put", tensor=frame["x"]).result["handle"]),
                   "freed": protocol.HandleRef(submit(srv, conn, "put", tensor=consts["A"]).result["handle"])}
        submit(srv, conn, "free", handle=handles["freed"].handle)
        args = change({**frame, **consts, "session": session}, session, handles, others)
        reply = submit(srv, conn, "step", **args)
        state = wire_array(submit(srv, conn, "session_state", session=session).result["state"])
        outcomes.append((reply, state))
        if native:
            assert served.taken == 0, f"seed={seed}: the native path took a {name} request"
    assert_answered_alike(outcomes, code, seed)


def assert_answered_alike(outcomes: list, code: str | None, seed: int) -> None:
    """(reply, state after) from the native server, then from the general one: the same y or the
    same error (`code`; None: a success), and the same state."""
    (native_reply, native_state), (general_reply, general_state) = outcomes
    assert native_reply.ok == general_reply.ok == (code is None), (native_reply.error, general_reply.error)
    if code is None:
        a, b = native_reply.result["y"], general_reply.result["y"]
        assert (a.dtype, a.shape, bytes(a.data)) == (b.dtype, b.shape, bytes(b.data)), f"seed={seed}"
    else:
        # The same error, but for the ids in its message (each server issues its own).
        assert native_reply.error["code"] == general_reply.error["code"] == code, native_reply.error
        assert native_reply.error["detail"].get("field") == general_reply.error["detail"].get("field")
    assert np.array_equal(native_state, general_state), f"seed={seed}"


def test_every_step_that_finds_nothing_in_flight_is_served_natively(inproc):
    """Whatever waits behind it (a stream lane with more input, or ZeroMQ, which cannot tell)
    and however recently steps were batched together; a step behind a request in flight is
    queued instead (served at once it would overtake that one), and the batcher gathers it."""
    seed = random_seed()
    gen = torch.Generator().manual_seed(seed)
    case = StepCase(2, 8, 4, handles=True)
    srv = inproc(max_delay_us=0)
    served = Served(srv)
    conn = RecordingConnection()
    consts = constants(case, gen)
    (first, shared), (second, _) = open_session(srv, conn, case, consts), open_session(srv, conn, case, consts)

    def step(session, more_input):
        return srv.submit(conn, "step", session=session, more_input=more_input, **shared, **step_inputs(case, gen))

    assert conn.reply(step(first, more_input=True)).ok and served.taken == 1, f"seed={seed}"
    srv.hold(conn)
    behind = [step(first, more_input=False), step(second, more_input=False)]
    assert served.taken == 1, f"seed={seed}"
    srv.go()
    assert [conn.reply(i).timing["batch_rows"] for i in behind] == [2 * case.batch] * 2, f"seed={seed}"
    reply = conn.reply(step(second, more_input=True))
    assert reply.ok and reply.timing["batch_rows"] == case.batch and served.taken == 2, f"seed={seed}"
    # Served natively, a step never has the transport check for more input.
    asked = []
    reply = conn.reply(step(first, more_input=lambda: asked.append(1) or False))
    assert reply.ok and served.taken == 3 and asked == [], f"seed={seed}"


@pytest.mark.parametrize("inline", [pytest.param(False, id="queued-for-the-worker"),
                                    pytest.param(True, id="served-on-its-reader")])
def test_a_step_sent_before_the_last_reply_is_finished_is_served_natively(inproc, inline):
    """A client that steps the moment a general-path reply reaches it can beat that request's
    finish (its buffer released, its count dropped): the step, admitted while the reply is still
    being written, is served natively all the same, once the serving lock is free."""
    case = StepCase(3, 5, 4, handles=True)
    seed, gen, srv, conn, session, shared = seeded_session(inproc, case)
    frame = {**shared, **step_inputs(case, gen)}
    served = Served(srv)
    step_ids, stepping = [], threading.Event()
    send = conn.send

    def replying_then_stepping(parts, buffers=None):
        send(parts, buffers)
        if not stepping.is_set():
            stepping.set()
            threading.Thread(target=lambda: step_ids.append(srv.submit(conn, "step", session=session, **frame)),
                             daemon=True).start()
            wait_until(lambda: srv.dispatcher._pending >= 2, "the step was never admitted")

    conn.send = replying_then_stepping
    assert conn.reply(srv.submit(conn, "session_state", session=session, more_input=not inline)).ok
    wait_until(lambda: step_ids, "the step was never submitted")
    reply = conn.reply(step_ids[0])
    assert reply.ok and served_natively(reply) and served.taken == 1, f"seed={seed}: {reply}"


# How long the first step is held once the second is in flight: long beside a step's decode
# even under the sanitizers on a loaded box, where the wait must still be told from the decode.
HELD_S = 0.5


def steps_of_two_connections(srv, seed: int) -> tuple[list, list[protocol.Reply], Served]:
    """The first connection's step held inside the native path until the second's is in flight
    too (waiting, or queued) or answered; both replies once let go."""
    gen = torch.Generator().manual_seed(seed)
    case = StepCase(2, 8, 4, handles=True)
    conns = [RecordingConnection(), RecordingConnection()]
    opened = [open_session(srv, conn, case, constants(case, gen)) for conn in conns]
    held = Served(srv, hold_first=True)
    ids = [None, None]

    def step(i):
        session, shared = opened[i]
        ids[i] = srv.submit(conns[i], "step", session=session, **shared, **step_inputs(case, gen))

    threads = [threading.Thread(target=step, args=(i,)) for i in range(2)]
    threads[0].start()
    assert held.inside.wait(60)
    threads[1].start()
    wait_until(lambda: srv.dispatcher._pending >= 2 or not threads[1].is_alive(), "the second step never arrived")
    # Not synchronisation: the hold under test, which a second step waiting meanwhile reports
    # as its queue_us, at least.
    time.sleep(HELD_S)
    held.let_go.set()
    for thread in threads:
        thread.join(60)
    return conns, [conn.reply(i) for conn, i in zip(conns, ids)], held


def test_a_step_behind_only_native_steps_waits_for_them_and_is_served_natively(inproc):
    """Connections stepping at once, each read by a thread of its own (as lanes are: stdio, unix
    and ZeroMQ each have one reader): a step that finds only other connections' native steps in
    flight waits for the serving lock and is served natively too, rather than queued for the
    worker, where the steps after it would follow; its timing shows the wait as queue_us."""
    seed = random_seed()
    conns, replies, held = steps_of_two_connections(inproc(max_delay_us=0), seed)
    assert all(r.ok and served_natively(r) for r in replies), f"seed={seed}: {replies}"
    assert held.conns == conns, f"seed={seed}"
    # Its wait for the first is its queue_us, not part of its decode.
    assert replies[1].timing["queue_us"] >= HELD_S * 1e6, replies[1].timing
    assert replies[1].timing["decode_us"] < replies[1].timing["queue_us"], replies[1].timing


def test_drain_does_not_report_all_answered_before_a_native_step_admitted_meanwhile_is(inproc):
    """As for the general path (test_batcher): the native path reads whether it may take a step
    where it counts the step in flight, under the lock drain() waits under."""
    case = StepCase(1, 4, 2)
    seed, gen, srv, conn, session, consts = seeded_session(inproc, case)
    served = Served(srv)
    race = DrainRace(srv.dispatcher, conn)
    request_id = srv.submit(conn, "step", session=session, more_input=False, **consts, **step_inputs(case, gen))
    assert race.finish() == ["replied", ("drained", True)], f"seed={seed}"
    reply = conn.reply(request_id, timeout=0)
    assert reply.ok and served.taken == 1, f"seed={seed}: {reply}"


def test_a_step_the_native_path_declines_during_a_drain_is_served_and_drained_for(inproc):
    """A step the native path counts in flight, then declines (here an f64 A handle, which it
    does not read), goes the general way still counted: found in review, it was let go and
    admitted again, so a drain begun meanwhile reported all answered first and the step was
    refused shutting_down though in flight when the drain began."""
    case = StepCase(1, 4, 2)
    seed, gen, srv, conn, session, consts = seeded_session(inproc, case)
    consts["A"] = protocol.HandleRef(submit(srv, conn, "put", tensor=consts["A"].double()).result["handle"])
    dispatcher, native = srv.dispatcher, srv.server.fast_path
    serve, events, drainer = native.serve, [], []

    def serve_while_a_drain_begins(*args):
        drainer.append(threading.Thread(target=lambda: events.append(("drained", dispatcher.drain(30)))))
        drainer[0].start()
        wait_until(lambda: not dispatcher.accepting, "the drain did not begin")
        outcome = serve(*args)
        events.append("declined" if outcome is None else "served natively")
        return outcome

    native.serve = serve_while_a_drain_begins
    send = conn.send
    conn.send = lambda parts, buffers=None: (send(parts, buffers), events.append("replied"))
    request_id = srv.submit(conn, "step", session=session, more_input=False, **consts, **step_inputs(case, gen))
    drainer[0].join(30)
    reply = conn.reply(request_id, timeout=0)
    assert reply.ok, f"seed={seed}: {reply.error}"
    assert events == ["declined", "replied", ("drained", True)], f"seed={seed}"


def test_a_server_let_go_is_freed_with_its_native_path():
    """Found in review: the native path held its server, and the module's weak map of each
    server's path held the path, so no server made in a process was ever freed, with its pools."""
    import gc
    import weakref

    from bridge.device import choose_device
    from bridge.server import Server, ServerConfig

    server = Server(ServerConfig(device="cpu"), choose_device("cpu"))
    assert server.fast_path is not None
    freed = weakref.ref(server)
    del server
    gc.collect()
    assert freed() is None, "the server outlived every reference to it"


def test_native_steps_keep_to_max_pending(inproc):
    """A step that would take the in-flight count past --max-pending is answered `overloaded`,
    native steps in flight counted like any other."""
    seed = random_seed()
    conns, replies, held = steps_of_two_connections(inproc(max_delay_us=0, max_pending=1), seed)
    assert replies[0].ok, f"seed={seed}: {replies[0]}"
    assert not replies[1].ok and replies[1].error["code"] == "overloaded", f"seed={seed}: {replies[1]}"
    assert held.conns == conns[:1], f"seed={seed}"


def test_native_steps_keep_to_max_pending_bytes(inproc):
    """--max-pending-bytes as --max-pending: a step alone is taken whatever its bytes, one that
    would take the bytes in flight past the cap is answered `overloaded`, and every native
    step's bytes leave the count with its answer."""
    seed = random_seed()
    srv = inproc(max_delay_us=0, max_pending_bytes=1)
    conns, replies, held = steps_of_two_connections(srv, seed)
    assert replies[0].ok, f"seed={seed}: {replies[0]}"
    assert replies[1].error == {"code": "overloaded", "message": "more than 1 bytes of requests in flight",
                                "detail": {"limit": 1}}, f"seed={seed}: {replies[1]}"
    assert held.conns == conns[:1], f"seed={seed}"
    assert (srv.dispatcher._pending, srv.dispatcher._pending_bytes) == (0, 0)


def test_a_native_step_sent_as_the_last_reply_arrives_is_not_refused_for_it(inproc):
    """A client stepping one frame at a time at --max-pending 1 was refused `overloaded` now and
    then (found in review): its next step came while the one answered, its reply written, was
    still counted in flight."""
    case = StepCase(1, 4, 2)
    seed = random_seed()
    gen = torch.Generator().manual_seed(seed)
    srv, conn = inproc(max_pending=1), RecordingConnection()
    session, consts = open_session(srv, conn, case, constants(case, gen))
    served, later, replies = Served(srv), [], []
    send = conn.send

    def answering(parts, buffers=None):
        send(parts, buffers)
        replies.append(None)
        if len(replies) == 1:  # the next step, sent as the first reply arrives
            later.append(srv.submit(conn, "step", session=session, more_input=False, **consts,
                                    **step_inputs(case, gen)))

    conn.send = answering
    first = srv.submit(conn, "step", session=session, more_input=False, **consts, **step_inputs(case, gen))
    for request_id in (first, later[0]):
        reply = conn.reply(request_id)
        assert reply.ok, f"seed={seed}: {reply.error}"
    assert served.taken == 2, f"seed={seed}"
    assert (srv.dispatcher._pending, srv.dispatcher._leaving) == (0, 0)


def test_a_step_of_a_peer_known_gone_is_answered_cancelled_unrun_as_the_general_path_answers_it(inproc):
    """A stream peer that closed its end (here the reading end of the reply pipe, a stdio
    client's stdout) is known gone once a reply to it could not be written, and its steps read
    after that could only run for nobody. The general path answers them `cancelled` unrun
    (dispatcher.refusal_to_start); found in review, the native path ran them. Both now answer
    such a step alike, and count it alike."""
    from bridge.streams import read_frame
    from bridge.transports.framed import FdConnection

    case = StepCase(2, 6, 3)
    seed = random_seed()
    gen = torch.Generator().manual_seed(seed)
    consts, frame = constants(case, gen), step_inputs(case, gen)
    counted = []
    for native in (True, False):
        srv = inproc(native_step=native)
        served = Served(srv) if native else None
        replies, ours = os.pipe()
        conn = FdConnection("stdio", ours, start_writer=None)  # a small reply never waits for a writer
        try:
            with os.fdopen(replies, "rb", buffering=0) as reader:
                srv.submit(conn, "session_open", more_input=False, batch=case.batch, dim=case.dim, state=case.state)
                session = protocol.decode_reply(read_frame(reader)).result["session"]
            srv.submit(conn, "ping", more_input=False)  # its reply is the one that cannot be written
            assert conn.peer_gone
            srv.submit(conn, "step", more_input=False, session=session, **consts, **frame)
            wait_until(lambda: srv.dispatcher._pending == 0, "the step was never answered")
        finally:
            os.close(ours)
        stats = srv.server.stats.snapshot()
        step = stats["ops"]["step"]
        counted.append((step["success_count"], step["failure_count"], step["execution_count"], stats["errors"]))
        if native:
            assert served.taken == 0, f"seed={seed}: the native path ran a step of a peer gone"
    assert counted == [(0, 1, 0, {"cancelled": 1})] * 2, f"seed={seed}"


def test_a_step_a_reader_thread_would_serve_once_the_dispatcher_stopped_is_refused_unrun(inproc):
    """Dispatcher.stop() waits for an op a reader thread serves, and one it would serve after
    that is answered shutting_down unrun: found in review, the native path (as an idle server's
    inline path: test_server) ran it, on a daemon thread an embedding's exit could end inside it."""
    case = StepCase(2, 6, 3)
    seed, gen, srv, conn, session, consts = seeded_session(inproc, case)
    served = Served(srv)
    assert srv.dispatcher.stop(60)
    reply = submit(srv, conn, "step", session=session, **consts, **step_inputs(case, gen))
    assert not reply.ok and reply.error["code"] == "shutting_down", f"seed={seed}"
    assert served.taken == 0, f"seed={seed}: the native path ran a step once stopped"


def test_mutated_frames_are_answered_and_the_server_lives_on(inproc):
    """Random byte flips, truncations and insertions in a plain step frame: whatever the native
    parser makes of each, the request gets exactly one reply and the server still steps."""
    seed = random_seed()
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    case = StepCase(2, 8, 4, options=True)
    srv = inproc()
    served = Served(srv)
    conn = CountingConnection()
    session, shared = open_session(srv, conn, case, constants(case, gen))
    args = {**step_inputs(case, gen), **shared, "session": session}
    body = bytearray(b"".join(protocol.encode_request(
        1, "step", {k: to_wire(v) if isinstance(v, torch.Tensor) else v for k, v in args.items()})))
    before = conn.sent
    conn.decoding = False  # a frame whose mutation hides its "v" is answered in the legacy shape
    for _ in range(300):
        mutated = bytearray(body)
        kind = rng.randrange(3)
        at = rng.randrange(len(mutated))
        if kind == 0:
            mutated[at] ^= 1 << rng.randrange(8)
        elif kind == 1:
            del mutated[at:]
        else:
            mutated[at:at] = bytes([rng.randrange(256)])
        srv.dispatcher.on_frame(conn, mutated, now_ns(), more_input=False)
    conn.decoding = True
    assert conn.sent - before == 300, f"seed={seed}: {conn.sent - before} replies to 300 frames"
    # Flips in the tensor data (most of the frame) leave valid steps, which the native path took.
    assert served.taken > 0, f"seed={seed}"
    assert submit(srv, conn, "step", **args).ok


# msgpack type bytes, each announcing something different to read: nil; bin 8 and 32; float
# 32 and 64; uint 64 and int 64; str 8 and 32; array 32 and map 32 (a 4-byte count); the
# largest positive fixint, empty and longest fixstr, longest fixarray and fixmap; fixint -1.
TYPE_BYTES = bytes([0xC0, 0xC4, 0xC6, 0xCA, 0xCB, 0xCF, 0xD3, 0xD9, 0xDB, 0xDD, 0xDF, 0x7F, 0xA0, 0xBF, 0x9F,
                    0x8F, 0xFF])


@pytest.mark.parametrize("handles", [False, True], ids=["inline", "handles"])
def test_every_cut_and_every_type_byte_of_a_step_frame_is_answered(inproc, handles):
    """Every prefix of a plain step frame, and the frame with each of its bytes replaced by each
    of msgpack's type bytes: one reply each, and the server still steps. Exhaustive where
    test_mutated_frames_... samples, so that the sanitizer pass (test_sanitizers.py) sees the
    parser read every header cut short or made to claim more than the frame holds."""
    gen = torch.Generator().manual_seed(random_seed())
    case = StepCase(1, 2, 1, options=True, handles=handles)
    srv = inproc()
    conn = CountingConnection()
    session, shared = open_session(srv, conn, case, constants(case, gen))
    args = {**step_inputs(case, gen), **shared, "session": session}
    body = b"".join(protocol.encode_request(
        1, "step", {k: to_wire(v) if isinstance(v, torch.Tensor) else v for k, v in args.items()}))
    frames = [body[:cut] for cut in range(len(body))]
    frames += [body[:at] + bytes([b]) + body[at + 1:] for at in range(len(body)) for b in TYPE_BYTES if b != body[at]]
    before = conn.sent
    conn.decoding = False  # a frame made legacy (no id left) gets a legacy reply
    for frame in frames:
        srv.dispatcher.on_frame(conn, frame, now_ns(), more_input=False)
    conn.decoding = True
    assert conn.sent - before == len(frames), f"{conn.sent - before} replies to {len(frames)} frames"
    assert submit(srv, conn, "step", **args).ok


class CountingConnection(RecordingConnection):
    """Also counts every reply, whatever its id (a mutated frame's may be unreadable: nil);
    with `decoding` off it only counts."""

    def __init__(self):
        super().__init__()
        self.sent = 0
        self.decoding = True

    def send(self, parts: list, buffers: list | None = None) -> None:
        self.sent += 1
        if self.decoding:
            super().send(parts, buffers)


def test_a_missing_source_leaves_the_general_path_serving(monkeypatch, tmp_path, caplog):
    """A package installed without step.cpp: the native path is unavailable, and says why,
    instead of stopping the server."""
    import bridge.native
    from bridge.device import choose_device
    from bridge.server import Server, ServerConfig

    monkeypatch.setattr(bridge.native, "NATIVE_DIR", tmp_path)
    with caplog.at_level("WARNING", logger="bridge"):
        server = Server(ServerConfig(device="cpu"), choose_device("cpu"))
    assert server.fast_path is None
    assert "native step path unavailable" in caplog.text and str(tmp_path / "step.cpp") in caplog.text, \
        caplog.text


# (the backend's capsule attribute, its name, the problem struct it takes)
CAPSULES = [
    pytest.param("run_problem", b"scan_bridge.run_problem", b"ScanProblem", id="mamba-1-step"),
    pytest.param("run_ssd_update", b"scan_bridge.run_ssd_update", b"SsdUpdateProblem", id="mamba-2-step"),
    pytest.param("run_model_step", b"scan_bridge.run_model_step", b"ModelStepProblem", id="model-step"),
]


def capsule_function(attribute: str, name: bytes):
    """The cpu backend's capsule `attribute` as a callable: (problem, its size, error buffer,
    the buffer's size) -> 0, or 1 with the error's message in the buffer."""
    import scan_kernels

    capsule = getattr(scan_kernels.get_backend("cpu", "cpu"), attribute)
    get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
    get_pointer.restype, get_pointer.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    return ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p, ctypes.c_size_t)(
        get_pointer(capsule, name))


@pytest.mark.parametrize("attribute,name,problem_type", CAPSULES)
def test_the_kernel_capsules_refuse_another_problem_layout(attribute, name, problem_type):
    """A caller compiled against another header passes another problem size: refused with the
    sizes named, nothing run."""
    run = capsule_function(attribute, name)
    error = ctypes.create_string_buffer(256)
    problem = ctypes.create_string_buffer(4096)  # zeros: a problem with no work, were it run
    assert run(ctypes.cast(problem, ctypes.c_void_p), 3, error, 256) == 1
    assert problem_type + b" size 3, expected" in error.value, error.value


@pytest.mark.parametrize("attribute,name,problem_type", CAPSULES)
def test_the_kernel_capsules_refuse_a_problem_of_zeros(attribute, name, problem_type):
    """A problem of the right layout but no sizes (a caller's bug) is refused with an error,
    not run: a zero group count was a division by zero that killed the process."""
    run = capsule_function(attribute, name)
    error = ctypes.create_string_buffer(256)
    problem = ctypes.create_string_buffer(4096)
    assert run(ctypes.cast(problem, ctypes.c_void_p), 3, error, 256) == 1
    size = int(error.value.split(b"expected ")[1].split()[0])
    assert run(ctypes.cast(problem, ctypes.c_void_p), size, error, 256) == 1
    assert problem_type in error.value, error.value


def test_run_problem_refuses_slots_past_a_step():
    """Slots choose pool rows for a step (seq 1); past it they are the binding's own (a model's
    prefill, whose slots it checks), so a native caller's ScanProblem with both is refused."""
    run = capsule_function("run_problem", b"scan_bridge.run_problem")
    error = ctypes.create_string_buffer(256)
    problem = ctypes.create_string_buffer(4096)
    assert run(ctypes.cast(problem, ctypes.c_void_p), 3, error, 256) == 1
    size = int(error.value.split(b"expected ")[1].split()[0])
    # ScanProblem (scan_kernel.h): five int64 sizes, then 48-byte Strided operands x, dt, z, B,
    # C, A, D, dt_bias, slots: slots' data pointer lies at 40 + 8 * 48.
    slot = ctypes.c_int64(0)
    for offset, value in ((8, 2), (16, 1), (24, 1), (32, 1)):  # seq, dim, state, groups; batch 0
        ctypes.c_int64.from_buffer(problem, offset).value = value
    ctypes.c_void_p.from_buffer(problem, 40 + 8 * 48).value = ctypes.addressof(slot)
    assert run(ctypes.cast(problem, ctypes.c_void_p), size, error, 256) == 1
    assert b"slots are for a step" in error.value, error.value


@pytest.mark.parametrize("args, native", [([], True), (["--no-native-step"], False)], ids=["default", "flag-off"])
def test_a_piped_server_steps_natively_unless_told_not_to(args, native):
    """Over stdio, as a Port client steps: `info` says whether the native path is on, and the
    step stats show which path served (the native one makes no host copies: h2d_us stays 0)."""
    from bridge.client import PortClient

    seed = random_seed()
    gen = torch.Generator().manual_seed(seed)
    case = StepCase(3, 20, 4, options=True)
    consts = constants(case, gen)
    with PortClient(["--device", "cpu", *args]) as client:
        assert client.info()["native_step"] is native
        session = client.open_session(case.batch, case.dim, case.state)
        A = client.put(consts["A"])
        for _ in range(3):
            frame = step_inputs(case, gen)
            x, dt, B, C = (frame.pop(k) for k in ("x", "dt", "B", "C"))
            assert client.step(session, x, dt, A, B, C, D=consts["D"], dt_bias=consts["dt_bias"], **frame).ok
        step_stats = client.stats()["ops"]["step"]
    assert step_stats["success_count"] == 3, step_stats
    assert (step_stats["h2d_us"] == 0) is native, f"seed={seed}: {step_stats}"


def test_failures_inside_the_native_path_are_answered(inproc, monkeypatch):
    """Before its kernel, a failure hands the request to the general path, which serves it; at
    the kernel, the request is answered with internal_error and never served again (its state
    may have moved)."""
    case = StepCase(2, 8, 4)
    seed, gen, srv, conn, session, shared = seeded_session(inproc, case)
    native = srv.server.fast_path
    served = Served(srv)

    def broken_parse(frame):
        raise RuntimeError("a parser bug")

    def broken_lookup(session):
        raise RuntimeError("a lookup bug")

    for name, broken in (("parse", broken_parse), ("_pool_addresses", broken_lookup)):
        monkeypatch.setattr(native, name, broken)
        assert submit(srv, conn, "step", session=session, **shared, **step_inputs(case, gen)).ok, name
        assert served.taken == 0, name
        monkeypatch.undo()

    kept = []
    monkeypatch.setattr(native, "_native", stepper_whose_kernels_fail_after_running(kept))
    reply = submit(srv, conn, "step", session=session, **shared, **step_inputs(case, gen))
    assert not reply.ok and reply.error["code"] == "internal_error", reply.error
    assert "device lost" in reply.error["message"]
    stats = srv.server.stats.snapshot()["ops"]["step"]
    assert (stats["success_count"], stats["failure_count"]) == (2, 1), stats


def test_what_the_native_path_keeps_goes_with_its_session_and_handle(inproc):
    """The addresses kept of a session's pool and a handle's tensor leave when the session
    closes and the handle is freed, or their connection goes (a long-lived server sees
    thousands come and go)."""
    seed = random_seed()
    gen = torch.Generator().manual_seed(seed)
    case = StepCase(2, 8, 4, options=True, handles=True)
    srv = inproc()
    native = srv.server.fast_path
    served = Served(srv)
    kept = []
    for ending in ("close-and-free", "connection-goes"):
        conn = RecordingConnection()
        session, shared = open_session(srv, conn, case, constants(case, gen))
        assert submit(srv, conn, "step", session=session, **shared, **step_inputs(case, gen)).ok
        kept.append((len(native._pools), len(native._handles)))
        if ending == "close-and-free":
            submit(srv, conn, "session_close", session=session)
            for handle in shared.values():
                submit(srv, conn, "free", handle=handle.handle)
        else:
            conn.mark_closed()
        assert (native._pools, native._handles) == ({}, {}), f"seed={seed}: {ending} left entries"
    assert served.taken == 2 and kept == [(1, 3), (1, 3)], (served.taken, kept)


# --- Mamba-2 ("ssd") sessions -----------------------------------------------------------------

@dataclass(frozen=True)
class SsdStepCase:
    batch: int
    heads: int
    headdim: int
    state: int
    groups: int = 1
    options: bool = False  # z, dt_bias, softplus, clamp, and D (per channel unless D_per_head)
    D_per_head: bool = False
    handles: bool = False  # A (and D, dt_bias) as handles
    steps: int = 3


SSD_CASES = [
    pytest.param(SsdStepCase(1, 1, 1, 1), id="1x1x1x1"),
    pytest.param(SsdStepCase(3, 4, 21, 16, groups=2, options=True), id="vector-rows-and-tail-all-options"),
    pytest.param(SsdStepCase(2, 3, 5, 7, options=True, D_per_head=True, handles=True), id="odd-state-D-per-head-handles"),
    pytest.param(SsdStepCase(32, 8, 64, 16, handles=True, steps=2), id="exphil-32x8x64x16"),
]


def ssd_step_inputs(case: SsdStepCase, gen: torch.Generator) -> dict:
    b, h, p, n, g = case.batch, case.heads, case.headdim, case.state, case.groups

    def rand(*shape, lo=-1.0, hi=1.0):
        return torch.rand(*shape, generator=gen) * (hi - lo) + lo

    args = {"x": rand(b, h, p), "dt": rand(b, h, lo=0.01, hi=0.5), "B": rand(b, g, n), "C": rand(b, g, n)}
    if case.options:
        args.update(z=rand(b, h, p), dt=rand(b, h, lo=-3.0, hi=1.0), dt_softplus=True, dt_min=0.005, dt_max=0.3)
    return args


def ssd_constants(case: SsdStepCase, gen: torch.Generator) -> dict:
    out = {"A": -(torch.rand(case.heads, generator=gen) * 4 + 0.5)}
    if case.options:
        D_shape = (case.heads,) if case.D_per_head else (case.heads, case.headdim)
        out.update(D=torch.rand(*D_shape, generator=gen), dt_bias=torch.rand(case.heads, generator=gen) - 0.5)
    return out


def open_ssd_session(srv, conn, case: SsdStepCase, consts: dict) -> tuple[str, dict]:
    session = submit(srv, conn, "session_open", kind="ssd", batch=case.batch, heads=case.heads,
                     headdim=case.headdim, state=case.state).result["session"]
    if not case.handles:
        return session, dict(consts)
    return session, {name: protocol.HandleRef(submit(srv, conn, "put", tensor=t).result["handle"])
                     for name, t in consts.items()}


def steps_both_ways(inproc, open_one, frames_for) -> tuple[list, Served]:
    """The same steps on a server with the native path and on one without: per server, (the
    replies, the state after them)."""
    native_srv, general_srv = inproc(), inproc(native_step=False)
    served = Served(native_srv)
    results = []
    for srv in (native_srv, general_srv):
        conn = RecordingConnection()
        session, shared = open_one(srv, conn)
        replies = [submit(srv, conn, "step", **frame(session, shared)) for frame in frames_for]
        state = submit(srv, conn, "session_state", session=session).result["state"]
        results.append((replies, wire_array(state)))
    return results, served


@pytest.mark.parametrize("case", SSD_CASES)
def test_native_ssd_steps_equal_the_general_path(inproc, case):
    seed = random_seed()
    gen = torch.Generator().manual_seed(seed)
    consts = ssd_constants(case, gen)
    inputs = [ssd_step_inputs(case, gen) for _ in range(case.steps)]
    # the last step returns the state it leaves
    frames = [lambda session, shared, f=f, t=t: {"session": session, **shared, **f, "return_state": t == case.steps - 1}
              for t, f in enumerate(inputs)]
    results, served = steps_both_ways(inproc, lambda srv, conn: open_ssd_session(srv, conn, case, consts), frames)
    (native_replies, native_state), (general_replies, general_state) = results
    returned = native_replies[-1].result["state"]
    assert returned.dtype == "f32" and np.array_equal(wire_array(returned), native_state), f"seed={seed}"
    assert all(r.ok for r in native_replies + general_replies), (seed, [r.error for r in native_replies])
    assert served.taken == case.steps, (seed, served.__dict__)
    for t, (a, b) in enumerate(zip(native_replies, general_replies)):
        ya, yb = wire_array(a.result["y"]), wire_array(b.result["y"])
        assert ya.shape == (case.batch, case.heads, case.headdim), ya.shape
        assert np.array_equal(ya, yb), f"seed={seed}: y of step {t} differs by {np.abs(ya - yb).max()}"
        assert (a.id, list(a.result), set(a.timing)) == (b.id, list(b.result), set(b.timing))
        assert a.timing["h2d_us"] == 0 and a.timing["kernel_us"] > 0, a.timing
    assert np.array_equal(native_state, general_state), f"seed={seed}: the state after the steps differs"
    assert not np.all(native_state == 0), f"seed={seed}: the steps left the state zero"


# Keys that change nothing here, placed before the operands so that every operand's bytes move:
# a prefix of 0, 1, 2 and 3 bytes modulo 4 (`dt_softplus` false: 13 bytes; `dt_max` 1000, an
# int 16: 10 bytes).
OFFSET_PREFIXES = [{}, {"dt_softplus": False}, {"dt_max": 1000}, {"dt_softplus": False, "dt_max": 1000}]


def test_native_ssd_steps_read_operands_at_every_byte_offset(inproc):
    """Tensor bytes in a frame lie at whatever offset the keys before them leave: the Mamba-2
    kernel reads typed pointers, so the native path reads such operands from aligned copies and
    still answers exactly what the general path does."""
    seed = random_seed()
    gen = torch.Generator().manual_seed(seed)
    case = SsdStepCase(2, 3, 20, 16, groups=3, options=True)
    consts = ssd_constants(case, gen)
    inputs = ssd_step_inputs(case, gen)
    del inputs["dt_softplus"], inputs["dt_max"]
    frames = [lambda session, shared, p=p: {**p, "session": session, **shared, **inputs} for p in OFFSET_PREFIXES]
    x_offsets = set()
    for prefix in OFFSET_PREFIXES:
        args = {**prefix, "session": "s", **consts, **inputs}
        body = b"".join(protocol.encode_request(1, "step", {k: to_wire(v) if isinstance(v, torch.Tensor) else v
                                                            for k, v in args.items()}))
        x_offsets.add(body.index(inputs["x"].numpy().tobytes()) % 4)
    assert x_offsets == {0, 1, 2, 3}, x_offsets
    results, served = steps_both_ways(inproc, lambda srv, conn: open_ssd_session(srv, conn, case, consts), frames)
    (native_replies, native_state), (general_replies, general_state) = results
    assert served.taken == len(OFFSET_PREFIXES), (seed, served.__dict__)
    for a, b in zip(native_replies, general_replies):
        assert a.ok and b.ok, (a.error, b.error)
        assert np.array_equal(wire_array(a.result["y"]), wire_array(b.result["y"])), f"seed={seed}"
    assert np.array_equal(native_state, general_state), f"seed={seed}"


def ssd_declined_cases():
    """(id, how the request differs from a plain Mamba-2 step, the error the general path gives or None)."""
    return [
        pytest.param(lambda a: {**a, "x": a["x"].half()}, None, id="f16-x"),
        pytest.param(lambda a: {**a, "x": a["x"].reshape(2, -1)}, "shape_mismatch", id="x-2d"),
        pytest.param(lambda a: {**a, "dt": a["dt"][:, :2]}, "shape_mismatch", id="dt-heads"),
        pytest.param(lambda a: {**a, "B": a["B"][:, 0]}, "shape_mismatch", id="B-without-groups"),
        pytest.param(lambda a: {**a, "B": a["B"][:, :, :3]}, "shape_mismatch", id="B-state"),
        pytest.param(lambda a: {**a, "B": torch.rand(2, 2, 4), "C": torch.rand(2, 2, 4)}, "shape_mismatch",
                     id="heads-not-divisible-by-groups"),
        pytest.param(lambda a: {**a, "A": -torch.rand(3, 4) - 0.1}, "shape_mismatch", id="A-per-state"),
        pytest.param(lambda a: {**a, "D": torch.rand(3, 2)}, "shape_mismatch", id="D-shape"),
        pytest.param(lambda a: {**a, "dt_min": 0.5, "dt_max": 0.1}, "invalid_argument", id="dt-min-above-max"),
        pytest.param(lambda a: {**a, "dt_max": 1e39}, "invalid_argument", id="dt-max-past-float32"),
        pytest.param(lambda a: {**a, "dt_limit": [0.001, 0.1]}, None, id="mamba-ssm-name"),
    ]


@pytest.mark.parametrize("change,code", ssd_declined_cases())
def test_what_the_native_path_does_not_take_of_ssd_steps_is_answered_as_before(inproc, change, code):
    seed = random_seed()
    gen = torch.Generator().manual_seed(seed)
    case = SsdStepCase(2, 3, 5, 4)
    consts = ssd_constants(case, gen)
    frame = ssd_step_inputs(case, gen)
    outcomes = []
    for native in (True, False):
        srv = inproc(native_step=native)
        served = Served(srv) if native else None
        conn = RecordingConnection()
        session, _ = open_ssd_session(srv, conn, case, consts)
        reply = submit(srv, conn, "step", **change({**frame, **consts, "session": session}))
        state = wire_array(submit(srv, conn, "session_state", session=session).result["state"])
        outcomes.append((reply, state))
        if native:
            assert served.taken == 0, f"seed={seed}: the native path took it"
    assert_answered_alike(outcomes, code, seed)



# --- model sessions ---------------------------------------------------------------------------

@dataclass(frozen=True)
class ModelCase:
    arch: str
    batch: int
    dtype: str = "f32"
    head: bool = False  # a language model (an embedding and a head)
    tokens: bool = False  # token ids in, each step's in another integer dtype; else embeddings
    output: str | None = None  # named in the request; None: the model's default
    steps: int = 3

    @property
    def result(self) -> str:
        return self.output or ("logits" if self.head else "hidden")


MODEL_CASES = [
    pytest.param(ModelCase("mamba", 1), id="mamba-backbone-1-row"),
    pytest.param(ModelCase("mamba", 3, dtype="bf16"), id="mamba-backbone-3-rows-bf16"),
    pytest.param(ModelCase("mamba", 2, tokens=True, dtype="bf16"), id="mamba-backbone-2-rows-tokens-bf16"),
    pytest.param(ModelCase("mamba", 2, head=True, output="hidden"), id="mamba-lm-2-rows-embeds-to-hidden"),
    pytest.param(ModelCase("mamba", 2, head=True, tokens=True), id="mamba-lm-2-rows-tokens-to-logits"),
    pytest.param(ModelCase("mamba2", 1), id="mamba2-backbone-1-row"),
    pytest.param(ModelCase("mamba2", 5, head=True, output="hidden"), id="mamba2-lm-5-rows-embeds-to-hidden"),
    pytest.param(ModelCase("mamba2", 3, head=True, tokens=True, output="logits", dtype="bf16"),
                 id="mamba2-lm-3-rows-tokens-to-logits-bf16"),
    pytest.param(ModelCase("mamba2", 1, head=True, output="logits"), id="mamba2-lm-1-row-embeds-to-logits"),
    pytest.param(ModelCase("mamba2", 2, dtype="bf16"), id="mamba2-backbone-2-rows-bf16"),
]
TOKEN_DTYPES = (torch.int64, torch.int32, torch.uint8)
VOCAB = 11
D_MODEL = 12


def tiny_model(arch: str, head: bool, seed: int, embedding: bool = True) -> tuple[dict, dict]:
    """A random transformers Mamba or Mamba-2 model (test_models' `randomized`: a wrong norm or
    skip shows): the config and weights a client sends; without `embedding`, a Mamba-2 backbone
    sent as ExPhil sends one, with no embedding (test_models' `backbone_request`)."""
    import json

    transformers = pytest.importorskip("transformers", reason="transformers (a test dependency) is not installed")
    torch.manual_seed(seed)
    if arch == "mamba":
        config = transformers.MambaConfig(vocab_size=VOCAB, hidden_size=D_MODEL, state_size=5, num_hidden_layers=2,
                                          expand=2, conv_kernel=4, time_step_rank=3)
        model = (transformers.MambaForCausalLM if head else transformers.MambaModel)(config)
    else:
        config = transformers.Mamba2Config(vocab_size=VOCAB, hidden_size=D_MODEL, state_size=6, num_hidden_layers=2,
                                           expand=2, head_dim=6, num_heads=4, n_groups=2, conv_kernel=3)
        model = (transformers.Mamba2ForCausalLM if head else transformers.Mamba2Model)(config)
    from test_models import backbone_request, randomized

    randomized(model)
    if not embedding:
        return backbone_request(model)
    sent = json.loads(config.to_json_string())
    sent["architectures"] = [type(model).__name__]
    return sent, {name: p.detach().contiguous() for name, p in model.state_dict().items()}


def open_model_session(srv, conn, config: dict, weights: dict, batch: int, dtype: str = "f32") -> str:
    model = srv.call(conn, "model_load", config=config, weights=weights, dtype=dtype)["model"]
    return srv.call(conn, "session_open", model=model, batch=batch)["session"]


def model_state(srv, conn, session: str) -> dict:
    return {name: t.numpy() for name, t in srv.call(conn, "session_state", session=session)["state"].items()}


@pytest.mark.parametrize("case", MODEL_CASES)
def test_native_model_steps_equal_the_general_path(inproc, case):
    """Bit for bit: the outputs and every layer's state after, after a prefill, with the output
    named or left to the model, embeddings or token ids of each integer dtype, the inputs' bytes
    at two offsets in the frame, and the pool grown between two steps (its rows move); the last
    step also copies the state before it into a snapshot (`snapshot_into`)."""
    seed = random_seed()
    gen = torch.Generator().manual_seed(seed)
    config, weights = tiny_model(case.arch, case.head, seed)
    if case.tokens:
        prefix = {"tokens": torch.randint(0, VOCAB, (case.batch, 4), generator=gen)}
        frames = [torch.randint(0, VOCAB, (case.batch,), generator=gen).to(TOKEN_DTYPES[t % len(TOKEN_DTYPES)])
                  for t in range(case.steps)]
    else:
        prefix = {"embeds": torch.randn(case.batch, 4, D_MODEL, generator=gen)}
        frames = [torch.randn(case.batch, D_MODEL, generator=gen) for _ in range(case.steps)]
    name = "tokens" if case.tokens else "embeds"

    def returns_state(t: int) -> bool:  # the step after the pool grew among them
        return t % 2 == 1 or t == case.steps - 1

    results = []
    for native in (True, False):
        srv = inproc(native_step=native)
        served = Served(srv) if native else None
        conn = RecordingConnection()
        session = open_model_session(srv, conn, config, weights, case.batch, case.dtype)
        srv.call(conn, "model_forward", session=session, output="hidden", **prefix)
        snapshot = srv.call(conn, "session_snapshot", session=session)["snapshot"]
        replies = []
        for t, frame in enumerate(frames):
            if t == 1:  # a second session of the model: the pool grows and its rows move
                pool = srv.server.sessions.find(conn.id, session).pool
                capacity = pool.capacity
                srv.call(conn, "session_open", model=srv_model_of(srv, conn, session), batch=9)
                assert pool.capacity > capacity, (capacity, pool.capacity)
            # "output" before the input moves its bytes (the frame's offset changes).
            named = {"output": case.output} if case.output else {}
            args = {**named, name: frame} if t % 2 else {name: frame, **named}
            if returns_state(t):
                args["return_state"] = True
            if t == case.steps - 1:
                args["snapshot_into"] = snapshot
            replies.append(submit(srv, conn, "model_step", session=session, **args))
        results.append((replies, model_state(srv, conn, session), snapshot_rows(srv, conn, snapshot)))
        if native:
            assert served.taken == case.steps, (seed, served.__dict__)
    (native_replies, native_state, native_snapshot), (general_replies, general_state, general_snapshot) = results
    assert np.array_equal(native_snapshot, general_snapshot), f"seed={seed}: the snapshots differ"
    assert returns_state(case.steps - 2)
    before_last = native_replies[-2].result["state"]
    assert np.array_equal(native_snapshot, np.concatenate(
        [wire_array(before_last[name]).reshape(case.batch, -1) for name in before_last], axis=1)), \
        f"seed={seed}: the snapshot is not the state before the last step"
    width = VOCAB if case.result == "logits" else D_MODEL
    for t, (a, b) in enumerate(zip(native_replies, general_replies)):
        assert a.ok and b.ok, (seed, a.error, b.error)
        ya, yb = wire_array(a.result[case.result]), wire_array(b.result[case.result])
        assert ya.shape == (case.batch, width), ya.shape
        assert np.array_equal(ya, yb), f"seed={seed}: {case.result} of step {t} differs by {np.abs(ya - yb).max()}"
        assert (a.id, list(a.result), set(a.timing)) == (b.id, list(b.result), set(b.timing))
        assert served_natively(a) and a.timing["kernel_us"] > 0 and a.timing["batch_rows"] == case.batch, a.timing
        if returns_state(t):
            assert list(a.result["state"]) == list(b.result["state"]), f"seed={seed}: the parts or their order"
            for part, tensor in a.result["state"].items():
                other = b.result["state"][part]
                assert (tensor.dtype, tensor.shape) == (other.dtype, other.shape), f"seed={seed}: {part}"
                assert bytes(tensor.data) == bytes(other.data), f"seed={seed}: {part} after step {t} differs"
    last = native_replies[-1].result["state"]  # the state the session keeps
    assert all(np.array_equal(wire_array(last[n]), native_state[n]) for n in native_state), f"seed={seed}"
    assert native_state.keys() == general_state.keys()
    for name in native_state:
        assert np.array_equal(native_state[name], general_state[name]), f"seed={seed}: {name} differs"
        assert not np.all(native_state[name] == 0), f"seed={seed}: {name} left zero"


def snapshot_rows(srv, conn, snapshot: str) -> np.ndarray:
    """A snapshot's rows as the server holds them, [batch, row floats] (every part in order)."""
    return srv.server.snapshots.get(conn.id, snapshot, "test").rows.numpy().copy()


@pytest.mark.parametrize("native", [True, False], ids=["native-path", "general-path"])
def test_steps_into_a_ring_of_snapshots_roll_back_exactly(inproc, native):
    """Netcode at one round trip a frame: each step copies the state before it into the next
    snapshot of a ring; restoring any of them and re-running the frames since gives the same
    outputs bit for bit, and the ring holds no more bytes than when it was made."""
    seed = random_seed()
    gen = torch.Generator().manual_seed(seed)
    config, weights = tiny_model("mamba2", True, seed)
    srv, conn = inproc(native_step=native), RecordingConnection()
    served = Served(srv) if native else None
    session = open_model_session(srv, conn, config, weights, 2)
    srv.call(conn, "model_forward", session=session, tokens=torch.randint(0, VOCAB, (2, 4), generator=gen))
    ring = [srv.call(conn, "session_snapshot", session=session)["snapshot"] for _ in range(3)]
    held = srv.server.sessions.usage()["snapshot_bytes"]
    frames = torch.randint(0, VOCAB, (7, 2), generator=gen)
    states, outputs = [], []
    for t, tokens in enumerate(frames):
        states.append(model_state(srv, conn, session))
        reply = submit(srv, conn, "model_step", session=session, tokens=tokens, snapshot_into=ring[t % 3])
        assert reply.ok, (seed, reply.error)
        outputs.append(wire_array(reply.result["logits"]))
    if native:
        assert served.taken == len(frames), f"seed={seed}: {served.taken} taken"
    assert srv.server.sessions.usage()["snapshot_bytes"] == held
    for t in range(len(frames) - 3, len(frames)):  # what the ring holds now: the last three frames'
        srv.call(conn, "session_restore", session=session, snapshot=ring[t % 3])
        restored = model_state(srv, conn, session)
        assert all(np.array_equal(restored[n], states[t][n]) for n in restored), f"seed={seed}: frame {t}"
        for again, tokens in enumerate(frames[t:]):
            reply = submit(srv, conn, "model_step", session=session, tokens=tokens)
            assert np.array_equal(wire_array(reply.result["logits"]), outputs[t + again]), f"seed={seed}: {t}"


@pytest.mark.parametrize("native", [True, False], ids=["native-path", "general-path"])
def test_a_step_into_a_snapshot_it_cannot_take_is_refused_and_runs_nothing(inproc, native):
    """An unknown snapshot, another connection's, one of a session of another batch or model, a
    freed one, or an id that is not a string: a named error, the session's state and the
    snapshot untouched, the server serving on."""
    seed = random_seed()
    gen = torch.Generator().manual_seed(seed)
    config, weights = tiny_model("mamba", False, seed)
    other_config, other_weights = tiny_model("mamba2", False, seed + 1)
    srv, conn, other_conn = inproc(native_step=native), RecordingConnection(), RecordingConnection()
    served = Served(srv) if native else None
    session = open_model_session(srv, conn, config, weights, 2)
    srv.call(conn, "model_forward", session=session, embeds=torch.randn(2, 3, D_MODEL, generator=gen))
    model = srv_model_of(srv, conn, session)
    one_row = srv.call(conn, "session_open", model=model, batch=1)["session"]
    other_model = open_model_session(srv, conn, other_config, other_weights, 2)
    freed = srv.call(conn, "session_snapshot", session=session)["snapshot"]
    srv.call(conn, "snapshot_free", snapshot=freed)
    theirs = open_model_session(srv, other_conn, config, weights, 2)
    snapshots = {
        "unknown": ("p-404", "unknown_snapshot"),
        "freed": (freed, "unknown_snapshot"),
        "another-connections": (srv.call(other_conn, "session_snapshot", session=theirs)["snapshot"],
                                "unknown_snapshot"),
        "another-batch": (srv.call(conn, "session_snapshot", session=one_row)["snapshot"], "invalid_argument"),
        "another-model": (srv.call(conn, "session_snapshot", session=other_model)["snapshot"], "invalid_argument"),
        "not-a-string": (7, "invalid_argument"),
    }
    before = model_state(srv, conn, session)
    for name, (snapshot, code) in snapshots.items():
        held = snapshot_rows(srv, conn, snapshot) if name in ("another-batch", "another-model") else None
        reply = submit(srv, conn, "model_step", session=session, embeds=torch.randn(2, D_MODEL, generator=gen),
                       snapshot_into=snapshot)
        assert not reply.ok and reply.error["code"] == code, (name, seed, reply.error)
        assert reply.error["detail"]["field"] == "args.snapshot_into", (name, reply.error)
        if held is not None:
            assert np.array_equal(snapshot_rows(srv, conn, snapshot), held), name
    after = model_state(srv, conn, session)
    assert all(np.array_equal(after[n], before[n]) for n in before), f"seed={seed}: a refused step ran"
    if native:
        assert served.taken == 0, f"seed={seed}: the native path took a step it cannot serve"
    assert submit(srv, conn, "model_step", session=session, embeds=torch.randn(2, D_MODEL, generator=gen)).ok


def srv_model_of(srv, conn, session: str) -> str:
    return srv.server.session(conn, session, "test").layout.model


def model_declined_cases():
    """(id, the model (arch; "lm", "backbone" or "bare": a backbone without an embedding;
    dtype), how the request differs from a model step of embeddings, the error the general path
    gives or None)."""
    def tokens(values, dtype=torch.int64):
        return lambda a, other: {"session": a["session"], "tokens": torch.tensor(values, dtype=dtype)}

    return [
        pytest.param(("mamba", "backbone", "f16"), lambda a, other: {**a, "return_state": True}, None,
                     id="f16-model-composed-step-returning-state"),
        pytest.param(("mamba", "backbone", "f16"), lambda a, other: a, None, id="f16-model-composed-step"),
        pytest.param(("mamba2", "backbone", "f32"), lambda a, other: {**a, "embeds": a["embeds"].half()}, None,
                     id="f16-embeds"),
        pytest.param(("mamba2", "backbone", "f32"), lambda a, other: {**a, "embeds": a["embeds"][:1]}, "shape_mismatch",
                     id="embeds-rows"),
        pytest.param(("mamba2", "backbone", "f32"), lambda a, other: {**a, "embeds": a["embeds"][:, :5]}, "shape_mismatch",
                     id="embeds-width"),
        pytest.param(("mamba2", "backbone", "f32"), lambda a, other: {**a, "embeds": a["embeds"][:, None]},
                     "shape_mismatch", id="embeds-3d"),
        pytest.param(("mamba2", "backbone", "f32"), lambda a, other: {**a, "output": "logits"}, "invalid_argument",
                     id="backbone-logits"),
        pytest.param(("mamba2", "bare", "f32"), tokens([1, 2]), "invalid_argument", id="tokens-without-an-embedding"),
        pytest.param(("mamba", "lm", "f32"), tokens([1, VOCAB]), "invalid_argument", id="token-past-the-vocabulary"),
        pytest.param(("mamba", "lm", "f32"), tokens([-1, 2]), "invalid_argument", id="negative-token"),
        pytest.param(("mamba", "lm", "f32"), tokens([1]), "shape_mismatch", id="tokens-rows"),
        pytest.param(("mamba", "lm", "f32"), tokens([[1], [2]]), "shape_mismatch", id="tokens-2d"),
        pytest.param(("mamba", "lm", "f32"), tokens([1.0, 2.0], torch.float32), "invalid_argument", id="float-tokens"),
        pytest.param(("mamba", "lm", "f32"), lambda a, other: {**a, "tokens": torch.tensor([1, 2])}, "invalid_argument",
                     id="tokens-and-embeds"),
        pytest.param(("mamba", "backbone", "f32"), lambda a, other: {**a, "session": other}, "unknown_session",
                     id="another-connections-session"),
        pytest.param(("mamba", "backbone", "f32"), lambda a, other: {**a, "x": a["embeds"]}, "invalid_argument",
                     id="a-steps-argument"),
    ]


@pytest.mark.parametrize("model,change,code", model_declined_cases())
def test_what_the_native_path_does_not_take_of_model_steps_is_answered_as_before(inproc, model, change, code):
    seed = random_seed()
    gen = torch.Generator().manual_seed(seed)
    arch, kind, dtype = model
    config, weights = tiny_model(arch, kind == "lm", seed, embedding=kind != "bare")
    frame = torch.randn(2, D_MODEL, generator=gen)
    outcomes = []
    for native in (True, False):
        srv = inproc(native_step=native)
        served = Served(srv) if native else None
        conn, other = RecordingConnection(), RecordingConnection()
        session = open_model_session(srv, conn, config, weights, 2, dtype)
        others = open_model_session(srv, other, config, weights, 2, dtype)
        reply = submit(srv, conn, "model_step", **change({"session": session, "embeds": frame, "output": "hidden"},
                                                         others))
        outcomes.append((reply, model_state(srv, conn, session)))
        if native:
            assert served.taken == 0, f"seed={seed}: the native path took it"
    (native_reply, native_state), (general_reply, general_state) = outcomes
    assert native_reply.ok == general_reply.ok == (code is None), (native_reply.error, general_reply.error)
    if code is None:
        for name, a in native_reply.result.items():
            b = general_reply.result[name]
            if isinstance(a, dict):  # return_state: every layer's part
                a, b = a["layers.0.ssm"], b["layers.0.ssm"]
            assert (a.dtype, a.shape, bytes(a.data)) == (b.dtype, b.shape, bytes(b.data)), f"seed={seed}: {name}"
    else:
        assert native_reply.error["code"] == general_reply.error["code"] == code, native_reply.error
        assert native_reply.error["detail"].get("field") == general_reply.error["detail"].get("field")
    for name in native_state:
        assert np.array_equal(native_state[name], general_state[name]), f"seed={seed}: {name}"


def test_what_the_native_path_keeps_of_models_goes_with_them(inproc):
    """A model's prepared weights leave when the model is freed, a session's addresses when it
    closes; both when their connection goes."""
    seed = random_seed()
    config, weights = tiny_model("mamba2", False, seed)
    srv = inproc()
    native = srv.server.fast_path
    served = Served(srv)
    for ending in ("close-and-free", "connection-goes"):
        conn = RecordingConnection()
        session = open_model_session(srv, conn, config, weights, 2)
        assert submit(srv, conn, "model_step", session=session, embeds=torch.randn(2, D_MODEL)).ok
        assert (len(native._models), len(native._model_rows)) == (1, 1), ending
        if ending == "close-and-free":
            model = srv_model_of(srv, conn, session)
            submit(srv, conn, "session_close", session=session)
            assert native._model_rows == {}, ending
            submit(srv, conn, "model_free", model=model)
        else:
            conn.mark_closed()
        assert (native._models, native._model_rows) == ({}, {}), f"seed={seed}: {ending} left entries"
    assert served.taken == 2



def test_a_native_step_stands_for_the_device_in_the_health_check(inproc):
    """Its launch, like a batch's, tells the health op the device answered (bridge.health)."""
    seed, gen, srv, conn, session, consts = seeded_session(inproc, StepCase(1, 4, 2))
    assert not srv.server.probe.fresh()
    reply = submit(srv, conn, "step", session=session, **consts, **step_inputs(StepCase(1, 4, 2), gen))
    assert reply.ok and served_natively(reply), f"seed={seed}: {reply}"
    assert srv.server.probe.check(launch=False)["source"] == "work", f"seed={seed}"


# Run in a fresh process: a daemon thread has an in-process server serve plain steps natively on
# it, back to back (a state of 256 keeps it in the kernel most of the time), and the main thread
# exits once they have begun, so the interpreter finalizes with the thread inside a native step.
# The request is encoded once: the loop makes no torch call, for torch's own GIL releases end such
# a thread the same way.
NATIVE_STEPS_AT_EXIT = """
import threading
import torch
import protocol
from bridge.client import to_wire
from bridge.timing import now_ns
from bridge_fakes import InProcessServer, RecordingConnection, served_natively
srv, conn = InProcessServer(), RecordingConnection()
batch, dim, state = 8, 1024, 256
session = srv.call(conn, "session_open", batch=batch, dim=dim, state=state)["session"]
args = dict(session=session, x=torch.rand(batch, dim), dt=0.5 * torch.rand(batch, dim),
            A=-torch.rand(dim, state) - 0.1, B=torch.rand(batch, state), C=torch.rand(batch, state))
body = b"".join(protocol.encode_request(0, "step", {k: to_wire(v) for k, v in args.items()}))
running, declined = threading.Event(), []
def steps():
    while True:
        srv.dispatcher.on_frame(conn, bytearray(body), now_ns(), more_input=False)
        reply = conn.reply(0)
        if not served_natively(reply):
            declined.append(reply)
        running.set()
threading.Thread(target=steps, daemon=True).start()
if not running.wait(60):
    raise SystemExit("the thread's first step did not return")
if declined:
    raise SystemExit(f"not served natively: {declined[0]}")
"""


def test_a_thread_inside_a_native_step_at_exit_ends_quietly():
    """As the kernels' entry points (test_kernels_cpu.py): CPython ends a thread that takes the GIL
    back while the interpreter finalizes by unwinding its stack, which from inside pybind11's
    gil_scoped_release destructor, noexcept, was std::terminate and SIGABRT at exit."""
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-c", NATIVE_STEPS_AT_EXIT], cwd=root, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{root / 'tests'}"}, timeout=120)
    assert proc.returncode == 0 and "terminate" not in proc.stderr, (proc.returncode, proc.stderr)
