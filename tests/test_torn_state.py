"""A step or prefill that fails partway through writing its sessions' state (SPEC §6.1,
`state_lost`): its reply keeps the failure's own code and says the state is lost; every later
op that reads or advances the state is refused `state_lost` until a `session_restore`, after
which the session steps as a session holding the snapshot's state does; sessions the failing
call was not writing are untouched.

Failures are injected on in-process servers (tests/bridge_fakes.py): a model's mixer raising
at its second layer, once the first has written its conv window and ssm state (the composed
paths: the "torch" backend); a plain step's kernel raising once it has updated the rows; the
native step path's kernel reporting a failure once it has run; a prefill's write back raising;
a restore's copy raising partway. A prefill whose scan fails has written nothing, and its
session is not lost; nor is one whose native step failed before its kernel, which the general
path then serves; nor is one whose model step's copy into a snapshot (`snapshot_into`, made
before the frame) raised partway: that snapshot is refused by restores until a copy into it
completes. Inputs are fresh random values, the seed in every failure message.
"""

from __future__ import annotations

import logging

import pytest
import torch

import scan_kernels
import protocol
from bridge.client import result_from_wire
from bridge.models.runtime import Model
from bridge.sessions import Session
from bridge_fakes import served_natively, stepper_whose_kernels_fail_after_running
from kernel_cases import random_seed
from test_return_state import DIM, STATE, Case, Scene, assert_same_state, output_of

CASES = {
    "plain-mamba-step": Case("mamba", "step"),
    "plain-ssd-step": Case("ssd", "step"),
    "mamba-model-step": Case("mamba", "model_step"),
    "mamba2-model-step": Case("mamba2", "model_step"),
    "mamba-model-forward": Case("mamba", "model_forward"),
    "mamba2-model-forward": Case("mamba2", "model_forward"),
}


def fail_partway(patched: pytest.MonkeyPatch, case: Case) -> tuple[str, list[int]]:
    """Make `case.op` fail after it has written some of its sessions' state; returns the code
    its reply then has, and a list that gets the rows of each failing call. A model fails at
    its second layer (out of memory); a plain step once its kernel has updated the rows (a
    device error reported late)."""
    failed_rows = []
    if case.op.startswith("model_"):
        name = "_mixer_step" if case.op == "model_step" else "_mixer_seq"
        mixer = getattr(Model, name)

        def failing_at_the_second_layer(self, layer, h, *args):
            if layer is self.layers[1]:
                failed_rows.append(h.shape[0])
                raise MemoryError("no room for the second layer's activations")
            return mixer(self, layer, h, *args)

        patched.setattr(Model, name, failing_at_the_second_layer)
        return "limit_exceeded", failed_rows
    name = "ssd_state_update" if case.kind == "ssd" else "selective_state_update"
    update = getattr(scan_kernels, name)

    def failing_after_the_update(pool, x, *args, **kwargs):
        update(pool, x, *args, **kwargs)
        failed_rows.append(x.shape[0])
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    patched.setattr(scan_kernels, name, failing_after_the_update)
    return "internal_error", failed_rows


def expect_lost(error: dict, code: str, session: str, seed: int) -> None:
    """The failing request's error: its own code, the session named as lost."""
    assert error["code"] == code, f"seed={seed}: {error}"
    assert (error["detail"].get("state"), error["detail"].get("sessions")) == ("lost", [session]), \
        f"seed={seed}: {error}"


def expect_refused(scene: Scene, session: str, frame: dict) -> None:
    """Every op that reads or advances the session's state is refused state_lost."""
    for op, args in ((scene.case.op, frame), (scene.case.op, {**frame, "return_state": True}),
                     ("session_state", {}), ("session_snapshot", {}), ("session_fork", {})):
        reply = scene.srv.request(scene.conn, op, session=session, **args)
        assert not reply.ok and reply.error["code"] == "state_lost", f"seed={scene.seed}: {op} {reply.error}"
        assert reply.error["detail"] == {"field": "args.session", "session": session}, f"seed={scene.seed}"


def expect_restored(scene: Scene, session: str, snapshot: str, twin: str) -> None:
    """Restored from `snapshot`, the session steps as `twin` (a fork taken with the snapshot)."""
    scene.call("session_restore", session=session, snapshot=snapshot)
    for _ in range(2):
        frame = scene.frame()
        got, expected = (scene.call(scene.case.op, session=s, **frame) for s in (session, twin))
        assert torch.equal(output_of(got), output_of(expected)), f"seed={scene.seed}: restored output"
    assert_same_state(scene.state(session), scene.state(twin), f"seed={scene.seed}, restored state")


def stepped_with_a_twin(scene: Scene) -> tuple[str, str, str]:
    """(a session run a frame, a snapshot of it, a fork of it)."""
    session = scene.open()
    scene.call(scene.case.op, session=session, **scene.frame())
    snapshot = scene.call("session_snapshot", session=session)["snapshot"]
    return session, snapshot, scene.call("session_fork", session=session)["session"]


@pytest.mark.parametrize("case, members", [
    *(pytest.param(case, 1, id=f"{name}-alone") for name, case in CASES.items()),
    # the batched ops' steps of two sessions sharing one launch
    *(pytest.param(case, 2, id=f"{name}-sharing-a-launch")
      for name, case in CASES.items() if case.op != "model_forward"),
])
def test_a_frame_failing_partway_loses_the_state_until_a_restore(inproc, monkeypatch, case, members):
    """Every member of the failing launch loses its state, each reply naming its own session
    alone; a fork, of the same pool (and model) but in no launch, keeps its state."""
    seed = random_seed()
    scene = Scene(inproc(backend="torch", max_delay_us=0), case, seed)
    srv, conn = scene.srv, scene.conn
    first, snapshot, twin = stepped_with_a_twin(scene)
    sessions = [first, *(scene.open() for _ in range(members - 1))]
    twin_before = scene.state(twin)
    with monkeypatch.context() as patched:
        code, failed_rows = fail_partway(patched, case)
        srv.hold(conn)
        ids = [srv.submit(conn, case.op, session=s, **scene.frame()) for s in sessions]
        srv.go()
        replies = [conn.reply(i) for i in ids]
    assert failed_rows == [members * case.batch], f"seed={seed}: not one failing launch: {failed_rows}"
    for session, reply in zip(sessions, replies):
        assert not reply.ok, f"seed={seed}: the injected failure did not fail the request"
        expect_lost(reply.error, code, session, seed)
        expect_refused(scene, session, scene.frame())
    assert_same_state(scene.state(twin), twin_before, f"seed={seed}, the untouched session")
    expect_restored(scene, first, snapshot, twin)


def test_a_failure_that_lost_the_state_is_logged_with_its_own_traceback(inproc, monkeypatch, caplog):
    """The server's log of an internal error that left a session lost holds the traceback of
    the failure itself: where it happened is what its maintainer needs."""
    seed = random_seed()
    case = Case("mamba", "step")
    scene = Scene(inproc(backend="torch", max_delay_us=0), case, seed)
    session = scene.open()
    with monkeypatch.context() as patched, caplog.at_level(logging.ERROR, logger="bridge"):
        code, _ = fail_partway(patched, case)
        error = scene.srv.request(scene.conn, case.op, session=session, **scene.frame()).error
        # The worker logs the failure once it has replied; it has when it answers the next.
        refused = scene.srv.request(scene.conn, "session_state", session=session).error
    expect_lost(error, code, session, seed)
    assert refused["code"] == "state_lost", f"seed={seed}: {refused}"
    (record,) = [r for r in caplog.records if r.getMessage() == "op step failed"]
    logged = logging.Formatter().formatException(record.exc_info)
    assert "in failing_after_the_update" in logged, f"seed={seed}: {logged}"


NATIVE_CASES = [pytest.param(Case("mamba", "step"), id="plain-step"),
                pytest.param(Case("mamba2", "model_step"), id="model-step")]

def native_scene(inproc, case: Case, seed: int) -> Scene:
    scene = Scene(inproc(), case, seed)
    if scene.srv.server.fast_path is None:
        pytest.skip("no native step path: the C++ backend is not built here (make kernels)")
    return scene


def submit_native(scene: Scene, session: str, frame: dict):
    """A step as a client sends it, in one frame: the native path's to take."""
    return scene.conn.reply(scene.srv.submit(scene.conn, scene.case.op, more_input=False, session=session, **frame))


def same_output(got, expected) -> bool:
    return torch.equal(output_of(result_from_wire(got.result, as_torch=True)),
                       output_of(result_from_wire(expected.result, as_torch=True)))


@pytest.mark.parametrize("case", NATIVE_CASES)
def test_a_native_step_whose_kernel_fails_loses_the_state(inproc, monkeypatch, case):
    """The native path's kernel may have written the rows when it fails: the reply says the
    state is lost, the native path declines the session, which the general path refuses, and
    a restored session is stepped natively again."""
    seed = random_seed()
    scene = native_scene(inproc, case, seed)
    session, snapshot, twin = stepped_with_a_twin(scene)
    kept = []
    with monkeypatch.context() as patched:
        patched.setattr(scene.srv.server.fast_path, "_native", stepper_whose_kernels_fail_after_running(kept))
        reply = submit_native(scene, session, scene.frame())
    expect_lost(reply.error, "internal_error", session, seed)
    assert "device lost" in reply.error["message"], f"seed={seed}: {reply.error}"
    refused = submit_native(scene, session, scene.frame())
    assert refused.error["code"] == "state_lost", f"seed={seed}: {refused.error}"
    scene.call("session_restore", session=session, snapshot=snapshot)
    frame = scene.frame()
    stepped, expected = submit_native(scene, session, frame), submit_native(scene, twin, frame)
    assert served_natively(stepped), f"seed={seed}: the restored session went the general way"
    assert same_output(stepped, expected), f"seed={seed}"


class OutOfMemoryBeforeTheKernel:
    """A native path's Stepper failing before its kernel: in Python, before the call."""

    def __init__(self, stepper):
        self.stepper = stepper

    def fail(self, *args):
        raise MemoryError("no room for the reply")

    run = run_ssd = run_model = fail


class OutOfMemoryResolvingHandles(OutOfMemoryBeforeTheKernel):
    """The same in step.cpp: its lookup of a handle's tensor (a plain step's A) raising."""

    class NoRoom(dict):
        def get(self, *args):
            raise MemoryError("no room for the handle's lookup")

    def run(self, *args):
        *head, handle_tensors, state_out = args
        return self.stepper.run(*head, self.NoRoom(handle_tensors), state_out)


@pytest.mark.parametrize("case, failing", [
    *(pytest.param(case.values[0], OutOfMemoryBeforeTheKernel, id=f"{case.id}-before-the-call")
      for case in NATIVE_CASES),
    pytest.param(Case("mamba", "step"), OutOfMemoryResolvingHandles, id="plain-step-in-step.cpp"),
])
def test_a_native_step_failing_before_its_kernel_goes_the_general_way(inproc, monkeypatch, case, failing):
    """A failure before the native kernel ran touched no row: the session is not lost, and the
    general path serves the request, its reply and the state after it as a twin's."""
    seed = random_seed()
    scene = native_scene(inproc, case, seed)
    session, _, twin = stepped_with_a_twin(scene)
    frame = scene.frame()
    if failing is OutOfMemoryResolvingHandles:
        frame["A"] = protocol.HandleRef(scene.call("put", tensor=frame["A"])["handle"])
    native = scene.srv.server.fast_path
    with monkeypatch.context() as patched:
        patched.setattr(native, "_native", failing(native._native))
        stepped = submit_native(scene, session, frame)
    assert stepped.ok and not served_natively(stepped), f"seed={seed}: {stepped.error}"
    expected = submit_native(scene, twin, frame)
    assert same_output(stepped, expected), f"seed={seed}"
    assert_same_state(scene.state(session), scene.state(twin), f"seed={seed}, the general path's step")
    frame = scene.frame()
    stepped, expected = submit_native(scene, session, frame), submit_native(scene, twin, frame)
    assert served_natively(stepped) and same_output(stepped, expected), f"seed={seed}"


PREFILLS = [pytest.param(Case("mamba", "scan"), "selective_scan", id="scan"),
            pytest.param(Case("ssd", "ssd_scan"), "ssd_scan", id="ssd-scan")]


@pytest.mark.parametrize("case, kernel", PREFILLS)
def test_a_prefill_whose_scan_fails_keeps_the_state(inproc, monkeypatch, case, kernel):
    """The scan reads a copy of the session's state: failing, it has written nothing, and the
    session is neither lost nor changed."""
    seed = random_seed()
    scene = Scene(inproc(), case, seed)
    session = scene.open()
    scene.call(case.op, session=session, **scene.frame())
    before = scene.state(session)

    def out_of_memory(*args, **kwargs):
        raise MemoryError("no room for the window")

    with monkeypatch.context() as patched:
        patched.setattr(scan_kernels, kernel, out_of_memory)
        error = scene.srv.request(scene.conn, case.op, session=session, **scene.frame()).error
    assert error["code"] == "limit_exceeded" and "state" not in error["detail"], f"seed={seed}: {error}"
    assert_same_state(scene.state(session), before, f"seed={seed}")
    scene.call(case.op, session=session, **scene.frame())


@pytest.mark.parametrize("case, kernel", PREFILLS)
def test_a_prefill_failing_in_its_write_back_loses_the_state(inproc, monkeypatch, case, kernel):
    seed = random_seed()
    scene = Scene(inproc(), case, seed)
    session, snapshot, twin = stepped_with_a_twin(scene)
    write = Session.write

    def failing_after_the_write(self, state):
        write(self, state)
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    with monkeypatch.context() as patched:
        patched.setattr(Session, "write", failing_after_the_write)
        error = scene.srv.request(scene.conn, case.op, session=session, **scene.frame()).error
    expect_lost(error, "internal_error", session, seed)
    expect_refused(scene, session, scene.frame())
    expect_restored(scene, session, snapshot, twin)


def test_a_rollback_whose_frame_fails_partway_is_undone_and_not_lost(inproc, monkeypatch):
    """session_restore with frames: a frame failing partway is undone by the restore, so its
    error says nothing of a lost state, and the session holds the snapshot's."""
    seed = random_seed()
    case = Case("mamba2", "model_step")
    scene = Scene(inproc(backend="torch"), case, seed)
    session, snapshot, twin = stepped_with_a_twin(scene)
    scene.call(case.op, session=session, **scene.frame())
    frames = [{"op": case.op, "args": scene.frame()} for _ in range(2)]
    with monkeypatch.context() as patched:
        code, _ = fail_partway(patched, case)
        error = scene.srv.request(scene.conn, "session_restore", session=session, snapshot=snapshot,
                                  frames=frames).error
    assert (error["code"], error["detail"].get("frame")) == (code, 0), f"seed={seed}: {error}"
    assert "state" not in error["detail"] and "sessions" not in error["detail"], f"seed={seed}: {error}"
    assert_same_state(scene.state(session), scene.state(twin), f"seed={seed}, the snapshot's state")


def failing_partway_through_the_copy(patched: pytest.MonkeyPatch) -> None:
    """Make a whole-state copy into a session (a restore's) fail once it has written its first
    row: a device error reported late, the rest of the rows as they were."""
    write_rows = Session.write_rows

    def failing_after_the_first_row(self, rows):
        first = self.read_rows()
        first[:1] = rows[:1]
        write_rows(self, first)
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    patched.setattr(Session, "write_rows", failing_after_the_first_row)


@pytest.mark.parametrize("case", [pytest.param(Case("mamba", "step"), id="plain-step"),
                                  pytest.param(Case("mamba2", "model_step"), id="model-step")])
@pytest.mark.parametrize("with_frames", [pytest.param(False, id="restore"), pytest.param(True, id="rollback")])
def test_a_restore_failing_partway_through_its_copy_loses_the_state(inproc, monkeypatch, case, with_frames):
    """A restore that has begun copying the snapshot's rows and fails leaves the session part
    the snapshot's, part what it was: lost, as a failed step leaves it, until a restore."""
    seed = random_seed()
    scene = Scene(inproc(backend="torch"), case, seed)
    session, snapshot, twin = stepped_with_a_twin(scene)
    scene.call(case.op, session=session, **scene.frame())
    frames = {"frames": [{"op": case.op, "args": scene.frame()}]} if with_frames else {}
    with monkeypatch.context() as patched:
        failing_partway_through_the_copy(patched)
        error = scene.srv.request(scene.conn, "session_restore", session=session, snapshot=snapshot,
                                  **frames).error
    expect_lost(error, "internal_error", session, seed)
    expect_refused(scene, session, scene.frame())
    expect_restored(scene, session, snapshot, twin)


def test_a_restore_refused_before_its_copy_leaves_lost_as_it_was(inproc, monkeypatch):
    """A restore refused for its snapshot (unknown, or of a session unlike it) has copied
    nothing: a lost session stays lost, one that was not keeps its state."""
    seed = random_seed()
    case = Case("mamba", "step")
    scene = Scene(inproc(backend="torch"), case, seed)
    lost, _, kept = stepped_with_a_twin(scene)
    with monkeypatch.context() as patched:
        fail_partway(patched, case)
        expect_lost(scene.srv.request(scene.conn, case.op, session=lost, **scene.frame()).error,
                    "internal_error", lost, seed)
    unlike = scene.call("session_open", batch=case.batch + 1, dim=DIM, state=STATE)["session"]
    unlike_snapshot = scene.call("session_snapshot", session=unlike)["snapshot"]
    kept_before = scene.state(kept)
    with monkeypatch.context() as patched:
        failing_partway_through_the_copy(patched)
        for session in (lost, kept):
            for snapshot, code in (("no-such-snapshot", "unknown_snapshot"), (unlike_snapshot, "invalid_argument")):
                error = scene.srv.request(scene.conn, "session_restore", session=session, snapshot=snapshot).error
                assert (error["code"], error["detail"]["field"]) == (code, "args.snapshot"), f"seed={seed}: {error}"
                assert "state" not in error["detail"], f"seed={seed}: {error}"
    expect_refused(scene, lost, scene.frame())
    assert_same_state(scene.state(kept), kept_before, f"seed={seed}, the session refused a restore")


def failing_partway_through_a_snapshot_copy(patched: pytest.MonkeyPatch) -> None:
    """Make a whole-state copy into a snapshot (a model step's snapshot_into) fail once it has
    written its first row: the rest of the snapshot's rows the state it held before."""
    def failing_after_the_first_row(self, rows):
        rows[:1] = self.read_rows()[:1]
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    patched.setattr(Session, "read_rows_into", failing_after_the_first_row)


def expect_torn(scene: Scene, session: str, snapshot: str) -> None:
    """A restore from `snapshot`, with frames or without, is refused, naming it; `session`
    keeps its state."""
    before = scene.state(session)
    for frames in ({}, {"frames": [{"op": scene.case.op, "args": scene.frame()}]}):
        error = scene.srv.request(scene.conn, "session_restore", session=session, snapshot=snapshot,
                                  **frames).error
        assert error["code"] == "state_lost", f"seed={scene.seed}: {error}"
        assert error["detail"] == {"field": "args.snapshot", "snapshot": snapshot}, f"seed={scene.seed}: {error}"
        assert "snapshot_into" in error["message"], f"seed={scene.seed}: {error}"
    assert_same_state(scene.state(session), before, f"seed={scene.seed}, the session refused a restore")


def expect_taken_again(scene: Scene, session: str, snapshot: str, take) -> None:
    """`take(frame)` runs a model step into `snapshot`: restored from it then, the session holds
    its state before that step."""
    before = scene.state(session)
    take({**scene.frame(), "snapshot_into": snapshot})
    scene.call("session_restore", session=session, snapshot=snapshot)
    assert_same_state(scene.state(session), before, f"seed={scene.seed}, the snapshot taken again")


@pytest.mark.parametrize("members", [pytest.param(1, id="alone"), pytest.param(2, id="sharing-a-launch")])
def test_a_snapshot_copy_failing_partway_leaves_the_sessions_and_the_snapshot_undefined(
        inproc, monkeypatch, members):
    """model_step's copy into `snapshot_into` runs before the frame and writes no session: its
    failure fails the launch with its own error, no session lost (the launch's other member, not
    copying, neither), each stepping on as its twin does; the snapshot, part one state, part
    another, refuses restores until a model step copies into it whole again."""
    seed = random_seed()
    case = Case("mamba2", "model_step")
    scene = Scene(inproc(backend="torch", max_delay_us=0), case, seed)
    stepped = [stepped_with_a_twin(scene) for _ in range(members)]
    (session, snapshot, _), *others = stepped
    with monkeypatch.context() as patched:
        failing_partway_through_a_snapshot_copy(patched)
        scene.srv.hold(scene.conn)
        ids = [scene.srv.submit(scene.conn, case.op, session=session, snapshot_into=snapshot, **scene.frame()),
               *(scene.srv.submit(scene.conn, case.op, session=other, **scene.frame()) for other, _, _ in others)]
        scene.srv.go()
        errors = [scene.conn.reply(i).error for i in ids]
    for error in errors:
        assert error is not None and error["code"] == "internal_error", f"seed={seed}: {error}"
        assert "state" not in error["detail"] and "sessions" not in error["detail"], f"seed={seed}: {error}"
    for stepped_session, _, twin in stepped:
        assert_same_state(scene.state(stepped_session), scene.state(twin), f"seed={seed}, the failed step's session")
        frame = scene.frame()
        got, expected = (scene.call(case.op, session=s, **frame) for s in (stepped_session, twin))
        assert torch.equal(output_of(got), output_of(expected)), f"seed={seed}: stepped after the failure"
    expect_torn(scene, session, snapshot)
    expect_taken_again(scene, session, snapshot, lambda frame: scene.call(case.op, session=session, **frame))


@pytest.mark.parametrize("kernel_fails", [pytest.param(False, id="served"), pytest.param(True, id="kernel-failing")])
def test_a_native_model_step_into_an_undefined_snapshot_defines_it(inproc, monkeypatch, kernel_fails):
    """The native path copies into the snapshot before its kernel, a copy that cannot fail; a
    failure before it sends the step the general way, whose copy may. A snapshot that copy left
    undefined holds the state before the next native step into it, restorable, whether that
    step's kernel then succeeds or fails (its session lost)."""
    seed = random_seed()
    scene = native_scene(inproc, Case("mamba2", "model_step"), seed)
    session, snapshot, twin = stepped_with_a_twin(scene)
    native = scene.srv.server.fast_path
    with monkeypatch.context() as patched:
        patched.setattr(native, "_native", OutOfMemoryBeforeTheKernel(native._native))
        failing_partway_through_a_snapshot_copy(patched)
        error = submit_native(scene, session, {**scene.frame(), "snapshot_into": snapshot}).error
    assert error["code"] == "internal_error" and "state" not in error["detail"], f"seed={seed}: {error}"
    assert_same_state(scene.state(session), scene.state(twin), f"seed={seed}, the failed step's session")
    expect_torn(scene, session, snapshot)
    kept = []

    def take(frame):
        with monkeypatch.context() as patched:
            if kernel_fails:
                patched.setattr(native, "_native", stepper_whose_kernels_fail_after_running(kept))
            reply = submit_native(scene, session, frame)
        if kernel_fails:
            expect_lost(reply.error, "internal_error", session, seed)
        else:
            assert reply.ok and served_natively(reply), f"seed={seed}: {reply.error}"

    expect_taken_again(scene, session, snapshot, take)
