"""What is particular to the "cpu" backend (scan_kernels/cpu/), beyond the generic suite in
test_kernels.py that runs the shared cases against every backend:

- its two code paths (sequence mode for seq > 1, step mode for seq == 1) at sizes that reach
  full SIMD blocks, partial blocks, the state-16 register path and the generic-state path,
  several time chunks, and the in-register transposes of the "bdl" layout and of h;
- every option in every dtype on those paths, against the float64 reference;
- thread counts: any split of the work gives bit-identical results; concurrent callers; a
  forked child;
- inputs at odd byte offsets (tensors decoded from a network frame);
- the state update in place, in fp32 and fp64 pools, with padding rows;
- the build: a second process reuses the library, and a failed build is one line of reason;
- every SIMD variant (AVX-512, AVX2, the baseline) built explicitly and run against the
  reference, named in the test ids; one the CPU cannot execute is skipped with the reason.

Inputs are fresh random draws each run; the seed is in every failure message.
"""

from __future__ import annotations

import json
import logging
import math
import os
import platform
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

import scan_kernels
from scan_kernels import _args
from kernel_cases import (
    DTYPES, GRAD_TOLERANCES, STATE_TOLERANCE, TOLERANCES, ScanCase, UpdateCase, assert_close,
    assert_scan_matches_reference, assert_scan_outputs_match_reference, assert_update_matches_reference,
    assert_update_outputs_match_reference,
    make_scan_inputs, make_update_inputs, random_seed, reference_scan, SsdCase, SsdUpdateCase, make_ssd_inputs,
    make_ssd_update_inputs, reference_ssd_scan, reference_ssd_update, assert_packed_matches_each_sequence,
    nan_gapped, ZERO_DECAY_REGIMES, assert_grads_close_where_reference_finite, with_zero_decays,
    INFINITE_INPUT_STATES, assert_infinities_as_the_reference, reference_with_an_infinite_x, with_an_infinite_x,
)
from process_runs import BackgroundRun
from waiting import poll_until

ROOT = Path(__file__).resolve().parents[1]

if "cpu" not in scan_kernels.available_backends():
    pytest.skip(f"cpu backend unavailable: {scan_kernels.unavailable_backends().get('cpu')}",
                allow_module_level=True)

ALL = dict(D=True, z=True, dt_bias=True, dt_softplus=True, clamp=True, h0=True)

# Blocks are 16 channels (fp32 math; 8 in fp64) per group; time is packed 32 steps at a time.
SCAN_CASES = [
    pytest.param(ScanCase(2, 65, 48, 16, layout="bdl", **ALL), id="bdl-full-blocks-3-chunks"),
    pytest.param(ScanCase(2, 33, 40, 16, groups=2, **ALL), id="bld-partial-blocks"),
    pytest.param(ScanCase(3, 31, 35, 24, D=True, z=True, h0=True), id="state-24-generic-path"),
    pytest.param(ScanCase(1, 40, 17, 64, layout="bdl", dt_bias=True, dt_softplus=True, h0=True),
                 id="bdl-state-64"),
    pytest.param(ScanCase(2, 64, 32, 32, bc_3d=True, clamp=True), id="bc3d-no-h0"),
    pytest.param(ScanCase(2, 1, 48, 16, **ALL), id="seq1-step-path-h0"),
    pytest.param(ScanCase(2, 1, 40, 5, groups=2, layout="bdl", D=True, z=True, dt_softplus=True),
                 id="seq1-step-path-state5-no-h0"),
    pytest.param(ScanCase(2, 37, 20, 16, return_state=False, D=True, z=True), id="no-state"),
]

UPDATE_CASES = [
    pytest.param(UpdateCase(9, 64, 16, groups=2, pool=13, padding_rows=3, D=True, z=True,
                            dt_bias=True, dt_softplus=True, clamp=True), id="in-place-full-blocks"),
    pytest.param(UpdateCase(7, 48, 24, pool=10, padding_rows=2, D=True, z=True), id="state-24-copied"),
    pytest.param(UpdateCase(5, 40, 16, groups=4, D=True, z=True, dt_bias=True, dt_softplus=True,
                            clamp=True), id="partial-blocks-no-slots"),
    pytest.param(UpdateCase(3, 33, 3, bc_2d=True, pool=4, padding_rows=1), id="state-3-bc2d"),
]


def _scan(inputs, **overrides):
    return scan_kernels.selective_scan(**{**inputs, **overrides}, backend="cpu")


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


# --- every option, both paths, every dtype ---------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", SCAN_CASES)
def test_scan_matches_reference(case, dtype):
    seed = random_seed()
    assert_scan_matches_reference("cpu", case, dtype, seed, f"cpu seed={seed}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", UPDATE_CASES)
def test_state_update_matches_reference(case, dtype):
    seed = random_seed()
    assert_update_matches_reference("cpu", case, dtype, seed, f"cpu seed={seed}")


def test_softplus_of_dt_across_its_range():
    """softplus(dt) as the kernel computes it, over dt from -30 to 25 (past torch's threshold
    of 20) in fp32, against float64: with A ~ 0, x = 1, B = C = the first unit vector and a zero
    state, y is the discretized dt itself. Random offsets keep the points fresh each run."""
    seed = random_seed()
    g = torch.Generator().manual_seed(seed)
    channels, state = 1 << 14, 16
    dt = torch.linspace(-30, 25, channels) + torch.rand(channels, generator=g) * (55 / channels)
    unit = torch.zeros(1, state)
    unit[0, 0] = 1
    y = scan_kernels.selective_state_update(torch.zeros(1, channels, state), torch.ones(1, channels), dt[None],
                                       torch.full((channels, state), -1e-30), unit, unit.clone(),
                                       dt_softplus=True, backend="cpu")
    expected = torch.nn.functional.softplus(dt.double())
    error = (y[0].double() - expected).abs() / expected
    # The kernel rounds exp2's argument |dt| log2e to fp32 (2^-24 |dt| of relative error in
    # exp(dt)) with log2e itself rounded (1.3e-8 |dt|), so the bound grows with -dt: 1e-6 at
    # dt = -8, 2.6e-6 at dt = -30 (see Math<float>::softplus).
    allowed = 4e-7 + 7.5e-8 * (-dt.double()).clamp(min=0)
    worst = (error / allowed).argmax()
    assert error[worst] < allowed[worst], (f"seed={seed}: softplus relative error {error[worst].item():.3g} "
                                           f"at dt={dt[worst].item():.4g}, allowed {allowed[worst].item():.3g}")


@pytest.mark.parametrize("case", UPDATE_CASES)
def test_state_update_in_a_float64_pool(case):
    """float64 inputs and pool: fp64 math and state, updated in place."""
    seed = random_seed()
    inputs = make_update_inputs(case, torch.float64, seed=seed)
    inputs["state"] = inputs["state"].to(torch.float64)
    before = inputs["state"].clone()
    y = scan_kernels.selective_state_update(**inputs, backend="cpu")
    assert_update_outputs_match_reference(case, torch.float64, inputs, before, y, f"cpu seed={seed}")


def test_mixed_input_dtypes():
    """Each tensor is read in its own dtype: bf16 x, fp16 B/C, fp64 A, fp32 rest."""
    case = ScanCase(2, 40, 36, 16, groups=2, **ALL)
    seed = random_seed()
    inputs = make_scan_inputs(case, torch.float32, seed=seed)
    mixed = {**inputs, "x": inputs["x"].bfloat16(), "B": inputs["B"].half(), "C": inputs["C"].half(),
             "A": inputs["A"].double()}
    y_ref, state_ref = reference_scan({**mixed, "x": mixed["x"].float(), "B": mixed["B"].float(),
                                       "C": mixed["C"].float(), "A": mixed["A"].float()})
    y, state = _scan(mixed)
    assert y.dtype == torch.bfloat16
    assert_close(y, y_ref, torch.bfloat16, f"cpu seed={seed} y")
    assert_close(state, state_ref, torch.float32, f"cpu seed={seed} state", STATE_TOLERANCE)


# --- threads ---------------------------------------------------------------------------------

# Both large enough (over 64k state updates per thread) to be split across threads.
@pytest.mark.parametrize("threads", [pytest.param(2, id="2-threads"), pytest.param(3, id="3-threads")])
@pytest.mark.parametrize("layout", ["bld", "bdl"])
def test_scan_threads_give_identical_results(restore_threads, threads, layout):
    case = ScanCase(5, 70, 88, 16, groups=2, layout=layout, **ALL)
    inputs = make_scan_inputs(case, torch.float32, seed=random_seed())
    torch.set_num_threads(1)
    y1, state1 = _scan(inputs)
    torch.set_num_threads(threads)
    yn, staten = _scan(inputs)
    assert torch.equal(y1, yn) and torch.equal(state1, staten)


@pytest.mark.parametrize("threads", [pytest.param(2, id="2-threads"), pytest.param(3, id="3-threads")])
def test_state_update_threads_give_identical_results(restore_threads, threads):
    case = UpdateCase(64, 512, 16, groups=2, pool=80, padding_rows=5, D=True, z=True,
                      dt_bias=True, dt_softplus=True)
    inputs = make_update_inputs(case, torch.float32, seed=random_seed())
    state = inputs["state"]
    results = []
    for n in (1, threads):
        torch.set_num_threads(n)
        pool = state.clone()
        y = scan_kernels.selective_state_update(**{**inputs, "state": pool}, backend="cpu")
        results.append((y, pool))
    (y1, pool1), (yn, pooln) = results
    assert torch.equal(y1, yn) and torch.equal(pool1, pooln)


def test_concurrent_calls_from_python_threads():
    """The GIL is released while a kernel runs: calls from several threads at once must not
    share any scratch."""
    cases = [ScanCase(3, 50, 40, 16, **ALL), ScanCase(2, 45, 24, 8, layout="bdl", D=True, h0=True)]
    inputs = [make_scan_inputs(c, torch.float32, seed=random_seed()) for c in cases]
    expected = [_scan(i) for i in inputs]
    errors, calls = [], []

    def worker(k):
        try:
            for _ in range(20):
                y, state = _scan(inputs[k])
                calls.append(k)
                if not (torch.equal(y, expected[k][0]) and torch.equal(state, expected[k][1])):
                    errors.append(f"case {k}: results differed")
        except Exception as exc:  # raised, it would end only this thread
            errors.append(f"case {k}: {exc!r}")

    threads = [threading.Thread(target=worker, args=(k,)) for k in (0, 1, 0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, f"under concurrency: {sorted(set(errors))}"
    assert len(calls) == 4 * 20


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
def test_forked_child_computes_without_the_parents_helpers(restore_threads):
    """A server may fork after using the kernels: the child has none of the parent's helper
    threads and must neither wait for them nor deadlock."""
    torch.set_num_threads(2)
    case = ScanCase(3, 50, 64, 16, **ALL)
    inputs = make_scan_inputs(case, torch.float32, seed=random_seed())
    expected = _scan(inputs)  # starts the helper pool in this process
    pid = os.fork()
    if pid == 0:  # the child: exit status 0 if it computes the same result
        try:
            y, state = _scan(inputs)
            os._exit(0 if torch.equal(y, expected[0]) and torch.equal(state, expected[1]) else 1)
        except BaseException:
            os._exit(2)
    statuses = []

    def child_exited() -> bool:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            statuses.append(status)
        return bool(done)

    if not poll_until(child_exited, 60, interval=0.01):
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        pytest.fail("the forked child hung")
    assert os.waitstatus_to_exitcode(statuses[0]) == 0


# Run in a fresh process: a daemon thread calls a kernel's binding back to back, and the main
# thread exits once the calls have begun, so the interpreter finalizes with the thread inside one.
# Mamba-2's scan, into an output made once: the loop makes no torch call, for torch's own GIL
# releases (in its ops, in a tensor's deallocation) end such a thread the same way.
KERNEL_CALLS_AT_EXIT = """
import threading
import torch
from scan_kernels.cpu import build
ext = build.load_extension()
x, dt, A = torch.randn(1, 512, 8, 64), torch.rand(1, 512, 8), -torch.rand(8)
B, C = torch.randn(1, 512, 1, 64), torch.randn(1, 512, 1, 64)
y = torch.empty_like(x)
running = threading.Event()
def calls():
    while True:
        ext.ssd_scan(x, dt, A, B, C, None, None, None, False, None, None, None, y, None)
        running.set()
threading.Thread(target=calls, daemon=True).start()
if not running.wait(60):
    raise SystemExit("the thread's first call did not return")
"""


def test_a_thread_inside_a_kernel_call_at_exit_ends_quietly():
    """CPython ends a thread that takes the GIL back while the interpreter finalizes (pthread_exit,
    which unwinds its stack). Taken back in pybind11's gil_scoped_release destructor, noexcept,
    that unwind was std::terminate: "terminate called without an active exception" and SIGABRT
    at the exit of a process whose daemon thread (the server's worker) was in a kernel. So was it
    where torch took the GIL back itself, in a noexcept function, to drop the Python object of y,
    which ssd_scan took by value and dropped before its GIL was back."""
    proc = subprocess.run([sys.executable, "-c", KERNEL_CALLS_AT_EXIT], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and "terminate" not in proc.stderr, (proc.returncode, proc.stderr)


# Run in a fresh process: how often the pool's helper threads (named scan-helper-N, started when
# the backend loads) have gone to sleep, before and after its kernel calls. A helper offered work
# runs it, polls for kSpin (1 ms) and sleeps again, a voluntary context switch; one never offered
# any sleeps throughout. The calls run back to back, nothing between them.
HELPER_PROBE = """
import json, os, sys, time
import torch
torch.set_num_threads(2)
import scan_kernels
from kernel_cases import UpdateCase, make_update_inputs
# {name: (state letter, voluntary context switches)} of the pool's helper threads.
def helpers():
    tasks = "/proc/self/task"
    found = {}
    for tid in os.listdir(tasks):
        with open(f"{tasks}/{tid}/comm") as f:
            name = f.read().strip()
        if name.startswith("scan-helper-"):
            with open(f"{tasks}/{tid}/status") as f:
                fields = dict(line.split(":", 1) for line in f)
            found[name] = (fields["State"].split()[0], int(fields["voluntary_ctxt_switches"]))
    return found
# Each helper's count of sleeps once all are asleep and stay so for 20 ms: a helper still on its
# way to sleep (the spin, then a yield loop) counts one more sleep when it gets there, which on a
# loaded machine can be long after the call that woke it, or after the pool started it.
def sleeps_once_asleep():
    end, last = time.monotonic() + 30, None
    while time.monotonic() < end:
        now = helpers()
        if now == last and all(state == "S" for state, _ in now.values()):
            return {name: count for name, (_, count) in now.items()}
        last = now
        time.sleep(0.02)
    raise SystemExit(f"the helpers were not all asleep for 20 ms within 30 s: {last}")
rows = [int(r) for r in sys.argv[1:]]
inputs = [make_update_inputs(UpdateCase(r, 512, 16), seed=k) for k, r in enumerate(rows)]
tiny = make_update_inputs(UpdateCase(1, 16, 16), seed=len(rows))  # below one thread's share
scan_kernels.selective_state_update(**tiny, backend="cpu")  # loads the backend; offers no work
before = sleeps_once_asleep()
time.sleep(0.05)  # past the pool's spin (kSpin), so the first call below comes long after the last
for args in inputs:
    scan_kernels.selective_state_update(**args, backend="cpu")
print(json.dumps([before, sleeps_once_asleep()]))
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads threads' names and sleeps in /proc/self/task (Linux)")
@pytest.mark.parametrize("rows, wakes", [
    pytest.param((32,), False, id="small-lone-call-wakes-none"),
    pytest.param((32, 32), True, id="small-call-right-after-another-wakes-helpers"),
    pytest.param((128,), True, id="call-worth-a-wake-up-wakes-helpers-alone"),
])
def test_helpers_are_woken_for_big_or_close_calls_only(rows, wakes):
    """A call below kMinWorkToWake (32x512x16: 2^18 state-element updates) long after the last
    runs on the calling thread alone; one right after another, or one of 2^20 (128x512x16),
    offers work to the helper."""
    proc = subprocess.run([sys.executable, "-c", HELPER_PROBE, *map(str, rows)], cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}"},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    before, after = json.loads(proc.stdout)
    assert list(before) == ["scan-helper-1"], f"helper threads after the backend loaded: {before}"
    assert (after != before) == wakes, f"helpers' sleeps before and after calls of rows {rows}: {before}, {after}"


# --- inputs at odd byte offsets ----------------------------------------------------------------

def _at_odd_offset(t: torch.Tensor, keep: list) -> torch.Tensor:
    """The same values in a tensor whose data starts 1 byte past an aligned address, as tensor
    bytes decoded from a network frame can."""
    t = t.contiguous()
    buf = bytearray(t.numel() * t.element_size() + 1)
    keep.append(buf)
    out = torch.frombuffer(buf, dtype=t.dtype, offset=1, count=t.numel()).view(t.shape)
    out.copy_(t)
    assert out.data_ptr() % 2 == 1
    return out


@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, id="f32"), pytest.param(torch.bfloat16, id="bf16")])
@pytest.mark.parametrize("layout", ["bld", "bdl"])
def test_scan_inputs_at_odd_byte_offsets(dtype, layout):
    case = ScanCase(2, 45, 40, 16, groups=2, layout=layout, **ALL)
    seed = random_seed()
    inputs = make_scan_inputs(case, dtype, seed=seed)
    keep = []
    odd = {k: _at_odd_offset(v, keep) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    y_aligned, state_aligned = _scan(inputs)
    y, state = _scan(odd)
    assert torch.equal(y, y_aligned) and torch.equal(state, state_aligned), f"seed={seed}"
    y_ref, _ = reference_scan(inputs)
    assert_close(y, y_ref, dtype, f"cpu seed={seed} y")


@pytest.mark.parametrize("state_size", [pytest.param(16, id="in-place-path"), pytest.param(12, id="copy-path")])
def test_state_update_pool_at_odd_byte_offset(state_size):
    case = UpdateCase(6, 48, state_size, pool=9, padding_rows=2, D=True, z=True, dt_bias=True)
    seed = random_seed()
    inputs = make_update_inputs(case, torch.float32, seed=seed)
    before = inputs["state"].clone()
    keep = []
    odd = {k: _at_odd_offset(v, keep) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    y = scan_kernels.selective_state_update(**odd, backend="cpu")
    assert_update_outputs_match_reference(case, torch.float32, odd, before, y, f"cpu seed={seed}")


def test_ssd_scan_inputs_at_odd_byte_offsets():
    case = SsdCase(2, 19, 4, 20, 16, groups=2, D=True, z=True, dt_bias=True, dt_softplus=True, clamp=True,
                   h0=True)
    seed = random_seed()
    inputs = make_ssd_inputs(case, torch.float32, seed=seed)
    keep = []
    odd = {k: _at_odd_offset(v, keep) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    y_aligned, state_aligned = scan_kernels.ssd_scan(**inputs, backend="cpu")
    y, state = scan_kernels.ssd_scan(**odd, backend="cpu")
    assert torch.equal(y, y_aligned) and torch.equal(state, state_aligned), f"seed={seed}"


# An aligned fp32 pool is updated in place, the kernel reading the int64 slots itself; one at an
# odd offset goes through a packed copy of its rows. A misaligned load fails this suite's
# sanitized run (tests/test_sanitizers.py).
@pytest.mark.parametrize("odd_pool", [pytest.param(False, id="in-place-path"), pytest.param(True, id="copy-path")])
def test_ssd_state_update_inputs_at_odd_byte_offsets(odd_pool):
    case = SsdUpdateCase(5, 3, 20, 16, pool=8, padding_rows=1, D=True, z=True, dt_bias=True, dt_softplus=True)
    seed = random_seed()
    inputs = make_ssd_update_inputs(case, torch.float32, seed=seed)
    before = inputs["state"].clone()
    keep = []
    odd = {k: _at_odd_offset(v, keep) if isinstance(v, torch.Tensor) and (odd_pool or k != "state") else v
           for k, v in inputs.items()}
    y = scan_kernels.ssd_state_update(**odd, backend="cpu")
    assert_update_outputs_match_reference(case, torch.float32, odd, before, y, f"cpu ssd seed={seed}",
                                          reference=reference_ssd_update)


# --- the build ---------------------------------------------------------------------------------

def test_second_process_reuses_the_built_library():
    """What `make` runs; with the library built, a fresh process only imports it."""
    from scan_kernels.cpu import build

    library = build.library_path()
    assert library.is_file(), "the backend loaded, so its library must exist"
    mtime = library.stat().st_mtime_ns
    proc = subprocess.run([sys.executable, "-m", "scan_kernels.cpu.build"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert str(library) in proc.stdout
    assert library.stat().st_mtime_ns == mtime, "the library was rebuilt"



_LOAD_PAST_A_STALE_LOCK = """
import shutil, subprocess, sys
from pathlib import Path
from scan_kernels.cpu import build
built = build.build_directory()
root = Path(sys.argv[1])
build.build_root = lambda: root
copy = build.build_directory()
shutil.copytree(built, copy)
(copy / "lock").write_text("")  # what torch's FileBaton leaves when its builder is killed
orphan = subprocess.Popen(["sleep", "1.5"], cwd=copy)  # as a killed build's compiler, working there
build.load_extension()
print("stale lock gone:", not (copy / "lock").exists())
print("orphan done first:", orphan.poll() is not None)
"""


def test_a_build_killed_midway_leaves_no_lock_later_starts_wait_on(tmp_path):
    """torch's build lock is removed only by a build that ends: a server killed mid-build (a
    client's start timeout) left it, and every later start waited on it for ever, deaf to
    SIGTERM (found in review). A build now holds an flock, which dies with its holder, and
    takes a lock file found under it for a killed build's: it waits for the compilers that
    build left working there (they outlive it, found in review too), then links the library
    again."""
    from scan_kernels.cpu import build

    assert build.library_path().is_file(), "the backend loaded, so its library must exist"
    proc = subprocess.run([sys.executable, "-c", _LOAD_PAST_A_STALE_LOCK, str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "stale lock gone: True" in proc.stdout and "orphan done first: True" in proc.stdout, proc.stdout


def test_digest_follows_sources(tmp_path, monkeypatch):
    """A library built from other sources (or flags, or for another CPU) is never loaded."""
    from scan_kernels.cpu import build

    for name in build.SOURCES + build.HEADERS:
        (tmp_path / name).write_bytes((build.SOURCE_DIR / name).read_bytes())
    monkeypatch.setattr(build, "SOURCE_DIR", tmp_path)
    first = build.build_digest()
    with open(tmp_path / build.HEADERS[0], "a") as f:
        f.write("\n// changed\n")
    assert build.build_digest() != first
    monkeypatch.setattr(build, "CFLAGS", build.CFLAGS + ("-DSOMETHING",))
    assert len({first, build.build_digest()}) == 2


def test_no_compiler_is_one_reason_and_torch_serves(monkeypatch, caplog):
    from scan_kernels import _registry
    from scan_kernels.cpu import build

    monkeypatch.setenv("CXX", "/nonexistent/c++")  # also a new digest: nothing built for it
    monkeypatch.setattr(_registry, "_loaded", {})
    monkeypatch.setattr(_registry, "_unavailable", {})
    assert not build.library_path().exists()
    with caplog.at_level(logging.INFO, logger="scan_kernels"):
        assert scan_kernels.select_backend("cpu") == "torch"
        assert scan_kernels.select_backend("cpu") == "torch"
    reason = _registry._unavailable["cpu"]
    assert "no C++ compiler" in reason and "/nonexistent/c++" in reason and "\n" not in reason
    assert [r.getMessage() for r in caplog.records if "'cpu'" in r.getMessage()] == [
        f"kernels backend 'cpu' unavailable: {reason}"]


def test_a_build_root_that_cannot_be_written_is_one_reason_and_torch_serves(tmp_path, monkeypatch):
    """A read-only cache (a container's root, a service user's missing home) raised OSError out
    of the build, which stopped the server's start and made `info` fail (found in review)."""
    from scan_kernels import _registry
    from scan_kernels.cpu import build

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setattr(build, "build_root", lambda: blocker / "kernels_cpu")
    monkeypatch.setattr(_registry, "_loaded", {})
    monkeypatch.setattr(_registry, "_unavailable", {})
    assert scan_kernels.select_backend("cpu") == "torch"
    reason = _registry._unavailable["cpu"]
    assert reason.startswith(f"cannot build in {blocker}/kernels_cpu/") and "\n" not in reason, reason


_LOAD_FROM_A_READ_ONLY_CHECKOUT = """
import os, sys
from pathlib import Path
from scan_kernels.cpu import build
from bridge import exit_guard, native
checkout = build.SOURCE_DIR.parents[1]
built = [build.library_path(), native.library_path(), exit_guard.library_path()]
writable = os.access
os.access = lambda path, mode, **kw: False if Path(path) == checkout else writable(path, mode, **kw)
print("kernels:", build.load_extension().__file__ == str(built[0]))
print("native:", native.library_path() == built[1])
print("guard:", exit_guard.library_path() == built[2])
print("library:", build.library_path() == built[0])
import contextlib, io
printed = io.StringIO()
with contextlib.redirect_stdout(printed):
    build.main(["--print-dir"])
print("print-dir:", printed.getvalue().strip() == str(built[0].parent))
print("cache untouched:", not any(Path(sys.argv[1]).iterdir()))
"""


def test_a_read_only_checkout_serves_the_libraries_built_in_it(tmp_path):
    """Deployed read-only, or run as another user, a checkout `make setup` built left its
    libraries unused: each start built them again in torch's cache, tens of seconds, past a
    client's start-up timeout (found in review)."""
    from bridge import exit_guard, native
    from scan_kernels.cpu import build

    native._module()  # each built as make setup builds them
    exit_guard.start()
    assert all(path.is_file() for path in (build.library_path(), native.library_path(), exit_guard.library_path()))
    cache = tmp_path / "cache"
    cache.mkdir()
    proc = subprocess.run([sys.executable, "-c", _LOAD_FROM_A_READ_ONLY_CHECKOUT, str(cache)], cwd=ROOT,
                          env={**os.environ, "XDG_CACHE_HOME": str(cache)}, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split("\n")[:6] == ["kernels: True", "native: True", "guard: True", "library: True",
                                          "print-dir: True", "cache untouched: True"], (proc.stdout, proc.stderr[-2000:])


def test_a_read_only_checkouts_build_that_a_killed_build_left_is_not_used(tmp_path, monkeypatch):
    """Its lock file says a build was killed midway: its library may be half written."""
    from scan_kernels.cpu import build

    prebuilt, cache = tmp_path / "checkout-build", tmp_path / "cache"
    library = Path("digest") / "lib.so"
    (prebuilt / library).parent.mkdir(parents=True)
    (prebuilt / library).write_bytes(b"")
    monkeypatch.setattr(build, "_read_only_checkout_root", lambda: prebuilt)
    monkeypatch.setattr(build, "build_root", lambda: cache)
    assert build.located(library) == prebuilt / library
    (prebuilt / library).with_name(build._LOCK_FILE).write_text("")
    assert build.located(library) == cache / library


def test_compile_error_is_one_line_with_the_log(tmp_path, monkeypatch):
    from scan_kernels.cpu import build

    (tmp_path / "broken.cpp").write_text("int f() { return undeclared_name; }\n")
    monkeypatch.setattr(build, "SOURCE_DIR", tmp_path)
    monkeypatch.setattr(build, "SOURCES", ("broken.cpp",))
    monkeypatch.setattr(build, "HEADERS", ())
    monkeypatch.setattr(build, "build_root", lambda: tmp_path / "out")
    with pytest.raises(scan_kernels.BackendUnavailable) as info:
        build.load_extension()
    reason = str(info.value)
    assert "undeclared_name" in reason and "\n" not in reason
    log = Path(reason.rsplit("full log: ", 1)[1].rstrip(")"))
    assert log.is_file() and "undeclared_name" in log.read_text()


# Every SIMD variant (scan_kernels.cpu.build.SIMD_VARIANTS: AVX-512, AVX2, the baseline) built
# explicitly and run against the reference, whichever one serves by default: a few cases per
# variant that reach its full and partial blocks (a block is one vector of channels: 16, 8 or 4
# in fp32), its unrolled state-16 step, the generic-state paths, several time chunks, the
# transposes of "bdl", half-precision conversion and fp64.
SIMD_SCAN_CASES = [
    pytest.param(ScanCase(2, 65, 48, 16, layout="bdl", **ALL), torch.float32, id="bdl-full-blocks-3-chunks-f32"),
    pytest.param(ScanCase(2, 33, 37, 24, groups=1, **ALL), torch.float16, id="partial-blocks-state-24-f16"),
    pytest.param(ScanCase(1, 19, 20, 5, groups=2, D=True, z=True, h0=True), torch.bfloat16, id="groups-state-5-bf16"),
    pytest.param(ScanCase(2, 23, 13, 16, D=True, z=True, dt_softplus=True, h0=True), torch.float64, id="f64"),
    pytest.param(ScanCase(3, 1, 40, 16, groups=2, **ALL), torch.float32, id="seq1-step-path-f32"),
]
SIMD_UPDATE_CASES = [
    pytest.param(UpdateCase(9, 64, 16, groups=2, pool=13, padding_rows=3, D=True, z=True, dt_bias=True,
                            dt_softplus=True, clamp=True), torch.float32, id="in-place-state-16-f32"),
    pytest.param(UpdateCase(5, 37, 24, pool=7, padding_rows=1, D=True, z=True), torch.float32,
                 id="partial-blocks-state-24-f32"),
    pytest.param(UpdateCase(4, 20, 8, pool=6, padding_rows=1, D=True, z=True, dt_softplus=True), torch.float64,
                 id="state-8-f64"),
]


# Every SIMD variant built at once, beside this file's first tests, rather than one after another
# when the variants' tests come to each (and before the other files' benches that load them all).
VARIANT_BUILDS = BackgroundRun(lambda: ([sys.executable, "-m", "scan_kernels.cpu.build", "--all"],
                                        {"timeout_s": 1200, "cwd": ROOT}))


def start_background_runs(selected: set[str]) -> None:
    if any("simd_variant" in name for name in selected):
        VARIANT_BUILDS.start()


def _simd_variant_names():
    from scan_kernels.cpu import build

    return [v.name for v in build.SIMD_VARIANTS]


@pytest.fixture(scope="module", params=_simd_variant_names())
def simd_backend(request):
    """The "cpu" backend built in one SIMD variant (its own module and digest, beside the
    default one). A variant this CPU cannot execute is skipped with the reason
    (build.unsupported_reason, which kernel_cases.expected_skip checks again in CI); one it
    executes must build."""
    from scan_kernels.cpu import backend_from, build

    variant = build.variant_named(request.param)
    reason = build.unsupported_reason(variant)
    if reason is not None:
        pytest.skip(reason)
    if VARIANT_BUILDS.started and (failure := VARIANT_BUILDS.result().failure("the variants' builds")):
        pytest.fail(failure)
    try:
        backend = backend_from(build.load_extension(variant=variant))
    except scan_kernels.BackendUnavailable as exc:
        pytest.fail(f"SIMD variant {variant.name}: this CPU executes it, but it did not build: {exc}")
    assert backend.details["simd"] == variant.name, backend.details
    print(f"\nSIMD variant {variant.name}: {backend.details['simd_description']} ({backend.details['library']})")
    return backend


@pytest.mark.parametrize("case, dtype", SIMD_SCAN_CASES)
def test_simd_variant_scan_matches_reference(simd_backend, case, dtype):
    seed = random_seed()
    inputs = make_scan_inputs(case, dtype, seed=seed)
    a = _args.check_scan(**inputs)
    y, state = simd_backend.scan(a.x, a.dt, a.A, a.B, a.C, **a.backend_kwargs())
    assert_scan_outputs_match_reference(case, dtype, inputs, y, state,
                                        f"{simd_backend.details['simd']} build {case} seed={seed}")


@pytest.mark.parametrize("case, dtype", SIMD_UPDATE_CASES)
def test_simd_variant_state_update_matches_reference(simd_backend, case, dtype):
    seed = random_seed()
    inputs = make_update_inputs(case, dtype, seed=seed)
    before = inputs["state"].clone()
    a = _args.check_state_update(**inputs)
    y = simd_backend.state_update(a.state, a.x, a.dt, a.A, a.B, a.C, **a.backend_kwargs())
    assert_update_outputs_match_reference(case, dtype, inputs, before, y,
                                          f"{simd_backend.details['simd']} build update {case} seed={seed}")


# A NaN or inf in one batch row's x or dt, per variant, through the state update and the scan's
# step mode (seq == 1) where h is stepped in a copy padded to whole vectors: a state no multiple of
# the vector (3, 5, 6 at every width; 8 with AVX-512's 16 fp32 lanes), alone or in a pool of
# another dtype or with a strided state axis. The copy's padding lanes took the bad row's NaN into
# the y of every row the thread stepped after it.
NONFINITE_ROW, NONFINITE_CHANNEL = 1, 3
NONFINITE_STEP_PATHS = [
    pytest.param("update", 3, "f32", id="update-state-3"),
    pytest.param("update", 8, "f32", id="update-state-8"),
    pytest.param("update", 5, "bf16-slots", id="update-bf16-pool-slots-state-5"),
    pytest.param("update", 6, "strided-slots", id="update-strided-pool-slots-state-6"),
    pytest.param("scan", 3, None, id="scan-seq1-state-3-no-h0"),
    pytest.param("scan", 5, "f32", id="scan-seq1-state-5-h0"),
    pytest.param("scan", 8, "f32", id="scan-seq1-state-8-h0"),
]
NONFINITE_VALUES = [
    pytest.param("x", float("nan"), id="x-nan"),
    pytest.param("x", float("inf"), id="x-inf"),
    pytest.param("dt", float("nan"), id="dt-nan"),
    pytest.param("dt", float("inf"), id="dt-inf"),
]


def _step_inputs_with_a_nonfinite_row(kind, state_size, pool, operand, value, seed):
    """Inputs of a state update (kind "update") or a seq == 1 scan whose row NONFINITE_ROW has
    `value` in `operand` at channel NONFINITE_CHANNEL; the pool or h0 as `pool` names it."""
    gen = torch.Generator().manual_seed(seed)
    batch, dim = 5, 20  # 20 channels: a full and a partial block at every vector width
    lead = (batch,) if kind == "update" else (batch, 1)
    inputs = dict(x=torch.randn(*lead, dim, generator=gen), dt=0.01 + 0.5 * torch.rand(*lead, dim, generator=gen),
                  A=-0.1 - torch.rand(dim, state_size, generator=gen), B=torch.randn(*lead, state_size, generator=gen),
                  C=torch.randn(*lead, state_size, generator=gen), D=torch.randn(dim, generator=gen))
    inputs[operand][(NONFINITE_ROW,) + (0,) * (len(lead) - 1) + (NONFINITE_CHANNEL,)] = value
    rows = batch + 3 if pool is not None and pool.endswith("slots") else batch
    state = None if pool is None else torch.randn(rows, dim, state_size, generator=gen)
    if kind == "scan":
        return {**inputs, "h0": state, "return_state": True}
    if pool.endswith("slots"):
        # Padding slot -1 at row 3; the bad row's slot is 0.
        inputs["slots"] = torch.tensor([5, 0, 6, -1, 2])
    if pool.startswith("bf16"):
        state = state.to(torch.bfloat16)
    elif pool.startswith("strided"):
        state = nan_gapped(state)
    return {**inputs, "state": state}


@pytest.mark.parametrize("operand, value", NONFINITE_VALUES)
@pytest.mark.parametrize("kind, state_size, pool", NONFINITE_STEP_PATHS)
def test_simd_variant_nonfinite_row_leaves_other_rows_y_as_the_reference(simd_backend, restore_threads, kind,
                                                                          state_size, pool, operand, value):
    # One thread steps every row after the bad one on the same scratch.
    torch.set_num_threads(1)
    seed = random_seed()
    inputs = _step_inputs_with_a_nonfinite_row(kind, state_size, pool, operand, value, seed)
    what = f"{simd_backend.details['simd']} build {kind} state {state_size} {pool} {operand}={value} seed={seed}"
    if kind == "update":
        before = inputs["state"].clone()
        a = _args.check_state_update(**inputs)
        y = simd_backend.state_update(a.state, a.x, a.dt, a.A, a.B, a.C, **a.backend_kwargs())
        state = inputs["state"]
        expected_state = before.clone()
        y_ref = scan_kernels.selective_state_update(**{**inputs, "state": expected_state}, backend="reference")
        slots = inputs.get("slots")
        bad_state_row = NONFINITE_ROW if slots is None else int(slots[NONFINITE_ROW])
    else:
        a = _args.check_scan(**inputs)
        y, state = simd_backend.scan(a.x, a.dt, a.A, a.B, a.C, **a.backend_kwargs())
        y_ref, expected_state = scan_kernels.selective_scan(**inputs, backend="reference")
        bad_state_row = NONFINITE_ROW
    bad_y = (NONFINITE_ROW,) + (0,) * (y.dim() - 2) + (NONFINITE_CHANNEL,)
    assert not torch.isfinite(y_ref[bad_y]) and not torch.isfinite(y[bad_y]), f"{what}: the bad channel's y is finite"
    good_y = torch.ones_like(y, dtype=torch.bool)
    good_y[bad_y] = False
    assert_close(y[good_y], y_ref[good_y], torch.float32, f"{what} y outside the bad row's bad channel")
    good_state = torch.ones_like(state, dtype=torch.bool)
    good_state[bad_state_row, NONFINITE_CHANNEL] = False
    tolerance = TOLERANCES[torch.bfloat16] if state.dtype == torch.bfloat16 else STATE_TOLERANCE
    assert_close(state[good_state], expected_state[good_state], state.dtype,
                 f"{what} state outside the bad row's bad channel", tolerance)


# The bad channel itself (kernel_cases.INFINITE_INPUT_STATES): the update's padding lanes past the
# state took 0 * inf, NaN, into y's sum where the reference's y is +inf.
@pytest.mark.parametrize("state_size", INFINITE_INPUT_STATES)
@pytest.mark.parametrize("kind", ["scan", "ssd_scan", "update", "ssd_update"])
def test_simd_variant_infinite_x_gives_the_references_infinity(simd_backend, kind, state_size):
    seed = random_seed()
    inputs = with_an_infinite_x(kind, state_size, seed)
    y_ref, state_ref = reference_with_an_infinite_x(kind, inputs)
    if kind == "scan":
        a = _args.check_scan(**inputs)
        y, state = simd_backend.scan(a.x, a.dt, a.A, a.B, a.C, **a.backend_kwargs())
    elif kind == "ssd_scan":
        a = _args.check_ssd_scan(**inputs)
        y, state = simd_backend.ssd_scan(a.x, a.dt, a.A, a.B, a.C, **a.backend_kwargs())
    elif kind == "update":
        a = _args.check_state_update(**inputs)
        y, state = simd_backend.state_update(a.state, a.x, a.dt, a.A, a.B, a.C, **a.backend_kwargs()), inputs["state"]
    else:
        a = _args.check_ssd_state_update(**inputs)
        y, state = simd_backend.ssd_state_update(a.state, a.x, a.dt, a.A, a.B, a.C, **a.backend_kwargs()), inputs["state"]
    what = f"{simd_backend.details['simd']} build {kind} state {state_size} seed={seed}"
    assert_infinities_as_the_reference(y, y_ref, f"{what} y")
    assert_infinities_as_the_reference(state, state_ref, f"{what} state")


# A decay past every float's range (exp(-1e4)) is 0, as exp's underflow is: a huge state decays
# to 0, an infinite one to NaN (0 * inf), as in the float64 reference. The AVX2 and baseline
# exp2 clamped its exponent at -126, so the decay was 2^-126: 5e37 left about 0.6 and inf stayed
# inf (found in review).
@pytest.mark.parametrize("held", [5e37, math.inf], ids=["huge", "inf"])
@pytest.mark.parametrize("kind", ["scan", "ssd_scan", "update", "ssd_update"])
def test_simd_variant_decay_that_underflows_is_zero_as_the_references(simd_backend, kind, held):
    dim, state = 3, 5  # partial vectors in every variant
    one = dict(dt=1e4, A=-1.0)
    if kind in ("scan", "ssd_scan"):
        x_shape, dt_shape = ((1, 1, dim), (1, 1, dim)) if kind == "scan" else ((1, 1, 1, dim), (1, 1, 1))
        A = torch.full((dim, state) if kind == "scan" else (1,), one["A"])
        h_shape = (1, dim, state) if kind == "scan" else (1, 1, dim, state)
        inputs = dict(x=torch.zeros(x_shape), dt=torch.full(dt_shape, one["dt"]), A=A, B=torch.ones(1, 1, 1, state),
                      C=torch.ones(1, 1, 1, state), h0=torch.full(h_shape, held), return_state=True)
        public = scan_kernels.selective_scan if kind == "scan" else scan_kernels.ssd_scan
        y_ref, state_ref = public(**{k: v.double() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()},
                                  backend="reference")
        check = _args.check_scan if kind == "scan" else _args.check_ssd_scan
        a = check(**inputs)
        run = simd_backend.scan if kind == "scan" else simd_backend.ssd_scan
        y, got = run(a.x, a.dt, a.A, a.B, a.C, **a.backend_kwargs())
    else:
        x_shape, dt_shape = ((1, dim), (1, dim)) if kind == "update" else ((1, 1, dim), (1, 1))
        A = torch.full((dim, state) if kind == "update" else (1,), one["A"])
        s_shape = (1, dim, state) if kind == "update" else (1, 1, dim, state)
        inputs = dict(x=torch.zeros(x_shape), dt=torch.full(dt_shape, one["dt"]), A=A,
                      B=torch.ones(1, 1, state) if kind == "ssd_update" else torch.ones(1, state),
                      C=torch.ones(1, 1, state) if kind == "ssd_update" else torch.ones(1, state))
        public = scan_kernels.selective_state_update if kind == "update" else scan_kernels.ssd_state_update
        state_ref = torch.full(s_shape, held, dtype=torch.float64)
        y_ref = public(state_ref, **{k: v.double() for k, v in inputs.items()}, backend="reference")
        got = torch.full(s_shape, held)
        check = _args.check_state_update if kind == "update" else _args.check_ssd_state_update
        a = check(got, **inputs)
        run = simd_backend.state_update if kind == "update" else simd_backend.ssd_state_update
        y = run(a.state, a.x, a.dt, a.A, a.B, a.C, **a.backend_kwargs())
    what = f"{simd_backend.details['simd']} build {kind} from {held}"
    for name, g, e in (("y", y, y_ref), ("state", got, state_ref)):
        expected = e.float()
        assert expected.isnan().all() if math.isinf(held) else (expected == 0).all(), f"{what}: the reference's {name}"
        assert torch.equal(g.float().isnan(), expected.isnan()), f"{what} {name}: {g.flatten().tolist()}"
        assert (g.float()[~expected.isnan()] == 0).all(), f"{what} {name}: {g.flatten().tolist()}"



@pytest.mark.parametrize("dt, dt_max", [(2.5e38, None), (math.inf, 2.5e38)], ids=["dt-past-max-over-log2e", "inf-clamped"])
def test_simd_variant_backward_of_a_dt_near_fp32s_largest_is_the_references(simd_backend, dt, dt_max):
    """The backward kept dt times log2(e), which rounds to inf for a dt past 2.4e38: with A = 0,
    inf * 0 made every gradient NaN where exp(dt A) is 1 and the reference's are finite (found
    in review). The forward still gives NaN there (docs/performance.md, "dt scale")."""
    from scan_kernels.reference import selective_scan_backward_ref

    dim, state = 3, 1  # partial vectors in every variant; dx, a sum over the state, within fp32
    t = dict(dy=torch.ones(1, 1, dim), x=torch.full((1, 1, dim), 1e-30), dt=torch.full((1, 1, dim), dt),
             A=torch.zeros(dim, state), B=torch.ones(1, 1, 1, state), C=torch.ones(1, 1, 1, state))
    t["A"][1] = -1.0  # a channel whose state decays to nothing beside ones that keep it
    kwargs = dict(D=None, z=None, dt_bias=None, dt_softplus=False, dt_min=None, dt_max=dt_max, h0=None,
                  dstate=None, layout="bld")
    expected = selective_scan_backward_ref(*(t[k].double() for k in ("dy", "x", "dt", "A", "B", "C")), **kwargs)
    got = simd_backend.scan_backward(t["dy"], t["x"], t["dt"], t["A"], t["B"], t["C"], **kwargs)
    for name, e in expected.items():
        what = f"{simd_backend.details['simd']} build d{name}, dt {dt}"
        assert torch.isfinite(e).all(), f"{what}: the reference's"
        torch.testing.assert_close(got[name].double(), e, rtol=1e-6, atol=1e-36, msg=lambda m: f"{what}: {m}")


# Mamba-2 per variant: headdim full and partial vectors and blocks (16, 8 or 4 fp32 lanes, two
# vectors a block), groups, every option, each dtype's conversion path.
SIMD_SSD_SCAN_CASES = [
    pytest.param(SsdCase(1, 21, 3, 40, 16, D=True, z=True, dt_bias=True, dt_softplus=True, h0=True), torch.float32,
                 id="blocks-full-and-partial-f32"),
    pytest.param(SsdCase(2, 9, 4, 5, 7, groups=2, D=True, D_per_channel=True, clamp=True, h0=True),
                 torch.bfloat16, id="groups-odd-bf16"),
    pytest.param(SsdCase(1, 11, 2, 17, 9, D=True, z=True, h0=True), torch.float64, id="f64"),
    # Blocks whose last one holds 2, 3 or 4 vectors in one variant or another (a block is 2
    # vectors with AVX-512, 4 with the narrower ones).
    pytest.param(SsdCase(2, 13, 3, 27, 16, z=True, dt_bias=True, dt_softplus=True, clamp=True), torch.float32,
                 id="headdim-27-f32"),
    pytest.param(SsdCase(1, 7, 2, 52, 8, D=True, return_state=True), torch.float32, id="headdim-52-f32"),
]
SIMD_SSD_UPDATE_CASES = [
    pytest.param(SsdUpdateCase(6, 4, 20, 19, groups=2, pool=9, padding_rows=2, D=True, z=True, dt_bias=True,
                               dt_softplus=True), torch.float32, id="pool-padding-odd-state-f32"),
    pytest.param(SsdUpdateCase(3, 2, 8, 16, D=True), torch.float16, id="f16"),
    # State 32: whole vectors in every variant, blocks of W rows of headdim and a tail past them.
    pytest.param(SsdUpdateCase(5, 3, 37, 32, groups=3, pool=8, padding_rows=1, D=True, D_per_channel=True, z=True,
                               dt_bias=True, dt_softplus=True, clamp=True), torch.float32,
                 id="vector-rows-and-tail-all-options-f32"),
    pytest.param(SsdUpdateCase(5, 3, 37, 32, groups=3, pool=8, padding_rows=1, D=True, D_per_channel=True, z=True,
                               dt_bias=True, dt_softplus=True, clamp=True), torch.float64,
                 id="vector-rows-and-tail-all-options-f64"),
]


@pytest.mark.parametrize("case, dtype", SIMD_SSD_SCAN_CASES)
def test_simd_variant_ssd_scan_matches_reference(simd_backend, case, dtype):
    seed = random_seed()
    inputs = make_ssd_inputs(case, dtype, seed=seed)
    a = _args.check_ssd_scan(**inputs)
    y, state = simd_backend.ssd_scan(a.x, a.dt, a.A, a.B, a.C, **a.backend_kwargs())
    assert_scan_outputs_match_reference(case, dtype, inputs, y, state,
                                        f"{simd_backend.details['simd']} build ssd {case} seed={seed}",
                                        reference=reference_ssd_scan)


@pytest.mark.parametrize("case, dtype", SIMD_SSD_UPDATE_CASES)
def test_simd_variant_ssd_state_update_matches_reference(simd_backend, case, dtype):
    seed = random_seed()
    inputs = make_ssd_update_inputs(case, dtype, seed=seed)
    before = inputs["state"].clone()
    a = _args.check_ssd_state_update(**inputs)
    y = simd_backend.ssd_state_update(a.state, a.x, a.dt, a.A, a.B, a.C, **a.backend_kwargs())
    assert_update_outputs_match_reference(case, dtype, inputs, before, y,
                                          f"{simd_backend.details['simd']} build ssd update {case} seed={seed}",
                                          reference=reference_ssd_update)


# Packed sequences per variant, taken by the kernels in one call: a sequence of one step, ones
# crossing the 32-step time chunk, partial channel blocks (headdim blocks for Mamba-2), each
# starting from its own row of h0 and leaving its own state.
SIMD_PACKED_BOUNDS = [0, 1, 34, 41, 105, 107]
SIMD_PACKED_CASES = [
    pytest.param("bld", ScanCase(1, 107, 38, 16, groups=2, **ALL), torch.float32, id="bld-partial-blocks-f32"),
    pytest.param("bdl", ScanCase(1, 107, 20, 5, layout="bdl", D=True, z=True, dt_softplus=True),
                 torch.float16, id="bdl-state-5-f16"),
    pytest.param("bld", ScanCase(1, 107, 13, 16, D=True, dt_softplus=True, clamp=True), torch.float64, id="f64"),
    pytest.param("ssd", SsdCase(1, 107, 3, 27, 16, groups=3, D=True, z=True, dt_bias=True, dt_softplus=True,
                                return_state=True), torch.float32, id="ssd-headdim-27-f32"),
    pytest.param("ssd", SsdCase(1, 107, 2, 8, 7, D=True, clamp=True, return_state=True), torch.bfloat16,
                 id="ssd-bf16"),
]


@pytest.mark.parametrize("kind, case, dtype", SIMD_PACKED_CASES)
def test_simd_variant_packed_sequences_match_each_sequence(simd_backend, kind, case, dtype):
    seed = random_seed()
    ssd = kind == "ssd"
    inputs = (make_ssd_inputs if ssd else make_scan_inputs)(case, dtype, seed=seed)
    state_shape = (case.heads, case.headdim, case.state) if ssd else (case.dim, case.state)
    h0 = torch.randn(len(SIMD_PACKED_BOUNDS) - 1, *state_shape, generator=torch.Generator().manual_seed(seed + 1))
    a = (_args.check_ssd_scan if ssd else _args.check_scan)(**inputs)
    scan = simd_backend.ssd_scan if ssd else simd_backend.scan
    y, state = scan(a.x, a.dt, a.A, a.B, a.C, **{**a.backend_kwargs(), "h0": h0,
                                                  "cu_seqlens": torch.tensor(SIMD_PACKED_BOUNDS)})
    assert_packed_matches_each_sequence(y, state if case.return_state else None, inputs, h0, SIMD_PACKED_BOUNDS, kind,
                                        dtype, f"{simd_backend.details['simd']} build packed {case} seed={seed}")


@pytest.mark.parametrize("cu_seqlens, batch, message", [
    pytest.param([0, 5, 3, 7], 1, "rising strictly from 0 to 7", id="falling"),
    pytest.param([0, 3, 6], 1, "rising strictly from 0 to 7", id="short-of-seq"),
    pytest.param([0, 3, 3, 7], 1, "rising strictly", id="empty-sequence"),
    pytest.param([0, 3, 7], 2, "batch 1, got 2", id="batch-2"),
    pytest.param(torch.tensor([0, 3, 7], dtype=torch.int32), 1, "int64", id="int32"),
])
@pytest.mark.parametrize("op", ["scan", "ssd_scan"])
def test_the_binding_refuses_malformed_packed_bounds(op, cu_seqlens, batch, message):
    """The kernels index with the boundaries unchecked, so the binding checks them itself: a
    caller that bypasses scan_kernels._args gets an error, not a read past the operands."""
    from scan_kernels.cpu import build

    ext = build.load_extension()
    bounds = cu_seqlens if isinstance(cu_seqlens, torch.Tensor) else torch.tensor(cu_seqlens)
    B = torch.randn(batch, 7, 1, 4)
    if op == "scan":
        args = (torch.randn(batch, 7, 8), torch.rand(batch, 7, 8), -torch.rand(8, 4), B, B, None, None, None, False,
                None, None, None, False, "bld", bounds)
    else:
        x = torch.randn(batch, 7, 2, 4)
        args = (x, torch.rand(batch, 7, 2), -torch.rand(2), B, B, None, None, None, False, None, None, None,
                torch.empty_like(x), None, bounds)
    with pytest.raises(ValueError, match=message):
        getattr(ext, op)(*args)


def test_the_backward_binding_refuses_shared_dt_columns_without_scalar_decay():
    """The Mamba-1 runner reads dt, dt_bias and A per channel: dt columns shared by several
    channels (a Mamba-2 head's) come with scalar_decay only, else it would read past dt."""
    from scan_kernels.cpu import build

    ext = build.load_extension()
    x = torch.randn(1, 5, 8)
    dt, B = torch.rand(1, 5, 2), torch.randn(1, 5, 1, 4)
    with pytest.raises(ValueError, match="channels_per_dt 1 without scalar_decay, got 4"):
        ext.scan_backward(x, dt, None, torch.randn_like(x), -torch.rand(2, 4), B, B, None, None, False, None, None,
                          None, None, False, 4, torch.empty_like(x), torch.empty_like(dt), None, None)


# The backward pass per variant: full and partial channel blocks, state 16 and odd states (the
# lane-sum tree's padding), groups, both layouts, fp64; a sequence walked back as one chunk and
# one past kWholeSequenceBytes at every vector width (checkpoints, then chunks of 16 steps, the
# last one partial); Mamba-2's chunked runner over one chunk and over several (of 16 or 32
# steps, the last one partial), with a headdim and a state that leave partial vectors (and
# partial W x W blocks to transpose) at every width.
SIMD_BACKWARD_CASES = [
    pytest.param("scan", ScanCase(2, 45, 37, 16, groups=1, **ALL), torch.float32, id="partial-blocks-one-chunk-f32"),
    pytest.param("scan", ScanCase(1, 333, 19, 16, groups=1, **ALL), torch.float32, id="checkpointed-333-steps-f32"),
    pytest.param("scan", ScanCase(1, 33, 40, 5, groups=2, layout="bdl", **ALL), torch.float32, id="bdl-state-5-f32"),
    pytest.param("scan", ScanCase(2, 9, 20, 16, D=True, z=True, h0=True), torch.float64, id="f64"),
    pytest.param("ssd", SsdCase(1, 40, 3, 20, 16, groups=3, D=True, z=True, dt_bias=True, dt_softplus=True, h0=True),
                 torch.float32, id="ssd-f32"),
    pytest.param("ssd", SsdCase(1, 200, 2, 40, 20, D=True, D_per_channel=True, z=True, dt_bias=True, dt_softplus=True,
                                clamp=True, h0=True), torch.float32, id="ssd-checkpointed-partial-block-state-20-f32"),
    pytest.param("ssd", SsdCase(2, 9, 2, 6, 5, D=True, z=True, h0=True), torch.float64, id="ssd-f64"),
]


@pytest.mark.parametrize("kind, case, dtype", SIMD_BACKWARD_CASES)
def test_simd_variant_backward_matches_reference(simd_backend, kind, case, dtype):
    from scan_kernels.reference import selective_scan_backward_ref, ssd_scan_backward_ref

    seed = random_seed()
    gen = torch.Generator().manual_seed(seed)
    if kind == "ssd":
        inputs = make_ssd_inputs(case, dtype, seed=seed)
        a = _args.check_ssd_scan(**inputs)
        state_shape = (case.batch, case.heads, case.headdim, case.state)
        backward, reference, extra = simd_backend.ssd_scan_backward, ssd_scan_backward_ref, dict(chunk_size=None)
    else:
        inputs = make_scan_inputs(case, dtype, seed=seed)
        a = _args.check_scan(**inputs)
        state_shape = (case.batch, case.dim, case.state)
        backward, reference, extra = simd_backend.scan_backward, selective_scan_backward_ref, dict(layout=a.layout)
    dy = torch.randn(a.x.shape, generator=gen).to(dtype)
    dstate = torch.randn(state_shape, generator=gen)
    kwargs = dict(D=a.D, z=a.z, dt_bias=a.dt_bias, dt_softplus=a.dt_softplus, dt_min=a.dt_min, dt_max=a.dt_max,
                  h0=a.h0, dstate=dstate, **extra)
    got = backward(dy, a.x, a.dt, a.A, a.B, a.C, **kwargs)
    expected = reference(dy, a.x, a.dt, a.A, a.B, a.C, **kwargs)
    rtol, atol = GRAD_TOLERANCES[dtype]
    for name, e in expected.items():
        assert_close(got[name], e, dtype, f"{simd_backend.details['simd']} build {kind} d{name} {case} seed={seed}",
                     tolerance=(rtol, atol * float(e.abs().max())))


# Decays of 0 (kernel_cases.ZERO_DECAY_REGIMES) through Mamba-2's chunked backward, per variant, over
# two chunks at every width: a step's log decay of -1e15 summed into a chunk's cs left the spans of
# the steps after it to its rounding (dx off by half its size).
@pytest.mark.parametrize("regime", ZERO_DECAY_REGIMES)
@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, id="f32"), pytest.param(torch.float64, id="f64")])
def test_simd_variant_ssd_backward_with_decays_of_zero(simd_backend, dtype, regime):
    from scan_kernels.reference import ssd_scan_backward_ref

    seed = random_seed()
    inputs = with_zero_decays(make_ssd_inputs(SsdCase(2, 40, 3, 20, 5, D=True, z=True, h0=True), dtype, seed=seed),
                              regime)
    a = _args.check_ssd_scan(**inputs)
    gen = torch.Generator().manual_seed(seed)
    dy = torch.randn(a.x.shape, generator=gen).to(dtype)
    kwargs = dict(D=a.D, z=a.z, dt_bias=None, dt_softplus=False, dt_min=None, dt_max=None, h0=a.h0,
                  dstate=torch.randn(a.h0.shape, generator=gen), chunk_size=None)
    assert_grads_close_where_reference_finite(
        simd_backend.ssd_scan_backward(dy, a.x, a.dt, a.A, a.B, a.C, **kwargs),
        ssd_scan_backward_ref(dy, a.x, a.dt, a.A, a.B, a.C, **kwargs), dtype,
        f"{simd_backend.details['simd']} build {regime} seed={seed}")


# A NaN or inf in one (sequence, head)'s x or dt through Mamba-2's chunked backward, per variant:
# every other (sequence, head)'s gradients as the reference's of its sequence alone. A NaN delta
# left NaN in dH's padding lanes past the state (3 and 5 leave some at every width), which the
# next items summed into their dt and A gradients; with packed sequences, the rows of u past a
# shorter sequence's steps kept the longer one's NaN, which the next item's E o R took where E is 0.
SSD_NONFINITE_PATHS = [
    pytest.param(None, 7, 3, id="rows-one-chunk-state-3"),
    pytest.param(None, 40, 5, id="rows-chunks-state-5"),
    pytest.param([0, 4, 13, 15, 40], 40, 5, id="packed-state-5"),
]


def _ssd_backward_inputs_with_a_nonfinite_item(bounds, seq, state_size, operand, value, bad_item, seed, *, z=False):
    """Inputs of ssd_scan_backward (rows of `seq` steps, or one row packed at `bounds`; with a
    gate z where `z`) whose (sequence, head) `bad_item` has `value` in `operand` (any of its
    tensors, dy included) at its step 3 (h0's and dstate's first element), and each sequence's
    (row, first step, steps)."""
    gen = torch.Generator().manual_seed(seed)
    heads, headdim = 3, 5
    rows = 4 if bounds is None else 1
    spans = ([(row, 0, seq) for row in range(rows)] if bounds is None
             else [(0, first, end - first) for first, end in zip(bounds, bounds[1:])])
    state_shape = (len(spans), heads, headdim, state_size)
    # A group per head, so that each head's B and C gradients are its own.
    t = dict(x=torch.randn(rows, seq, heads, headdim, generator=gen),
             dt=0.01 + 0.5 * torch.rand(rows, seq, heads, generator=gen), A=-0.1 - torch.rand(heads, generator=gen),
             B=torch.randn(rows, seq, heads, state_size, generator=gen),
             C=torch.randn(rows, seq, heads, state_size, generator=gen), D=torch.randn(heads, generator=gen),
             h0=torch.randn(state_shape, generator=gen), dstate=torch.randn(state_shape, generator=gen),
             dy=torch.randn(rows, seq, heads, headdim, generator=gen),
             z=torch.randn(rows, seq, heads, headdim, generator=gen) if z else None)
    (row, first, _), bad_head = spans[bad_item[0]], bad_item[1]
    at = ((bad_item[0], bad_head, 0, 0) if operand in ("h0", "dstate")
          else (row, first + 3, bad_head) + (() if operand == "dt" else (0,)))
    t[operand][at] = value
    a = _args.check_ssd_scan(t["x"], t["dt"], t["A"], t["B"], t["C"], D=t["D"], z=t["z"])
    options = dict(D=a.D, z=a.z, dt_bias=None, dt_softplus=False, dt_min=None, dt_max=None, chunk_size=None,
                   h0=t["h0"], dstate=t["dstate"])
    return (t["dy"], a.x, a.dt, a.A, a.B, a.C), options, spans


def _ssd_gradients_by_sequence(got, tensors, options, spans):
    """(name, sequence, head axis, got's part, the reference's) for each gradient: the reference run
    on each sequence alone, its A's and D's summed over the sequences (sequence None)."""
    from scan_kernels.reference import ssd_scan_backward_ref

    dy, x, dt, A, B, C = tensors
    sums = {}
    for sequence, (row, first, steps) in enumerate(spans):
        def cut(t):
            return t[row:row + 1, first:first + steps]

        one = {k: options[k][sequence:sequence + 1] for k in ("h0", "dstate")}
        if options["z"] is not None:
            one["z"] = cut(options["z"])
        expected = ssd_scan_backward_ref(cut(dy), cut(x), cut(dt), A, cut(B), cut(C), **{**options, **one})
        for name, e in expected.items():
            if name in ("A", "D"):
                sums[name] = sums.get(name, 0) + e
            elif name == "h0":
                yield name, sequence, 1, got[name][sequence:sequence + 1], e
            else:
                yield name, sequence, 2, cut(got[name]), e
    for name, e in sums.items():
        yield name, None, 0, got[name], e


@pytest.mark.parametrize("operand, value", NONFINITE_VALUES)
@pytest.mark.parametrize("bounds, seq, state_size", SSD_NONFINITE_PATHS)
def test_simd_variant_ssd_backward_nonfinite_item_leaves_other_items_as_the_reference(
        simd_backend, restore_threads, bounds, seq, state_size, operand, value):
    # One thread runs every item after the bad one on the same scratch; the bad one is its
    # sequence's last head, so the next item is the next (shorter, packed) sequence's first.
    torch.set_num_threads(1)
    seed = random_seed()
    bad_sequence, bad_head = 1, 2
    tensors, options, spans = _ssd_backward_inputs_with_a_nonfinite_item(
        bounds, seq, state_size, operand, value, (bad_sequence, bad_head), seed)
    got = simd_backend.ssd_scan_backward(*tensors, **options,
                                         cu_seqlens=None if bounds is None else torch.tensor(bounds))
    rtol, atol = GRAD_TOLERANCES[torch.float32]
    for name, sequence, head_axis, actual, expected in _ssd_gradients_by_sequence(got, tensors, options, spans):
        if sequence in (None, bad_sequence):
            keep = torch.tensor([h for h in range(expected.shape[head_axis]) if h != bad_head])
            actual, expected = actual.index_select(head_axis, keep), expected.index_select(head_axis, keep)
        assert_close(actual, expected, torch.float32,
                     f"{simd_backend.details['simd']} build d{name} of sequence {sequence} outside the bad item, "
                     f"{operand}={value} seed={seed}", tolerance=(rtol, atol * float(expected.abs().max())))


# A NaN x or dt through Mamba-2's chunked backward, per variant: NaN in the gradients exactly where
# the reference has it. With NaN x, dt's and C's were NaN at the steps before it too: E o R took R's
# NaN past the diagonal, where E is 0, and a's gradient, gathered as row sums less column sums of
# E o G o R and as the final state's share less each step's, took a NaN from any step of the chunk.
# With NaN dt, dx and dB were NaN at every later step of its chunk: their decays, exp(cs_t - cs_s),
# took cs's NaN from that step on, though a span of steps after it does not hold its decay.
@pytest.mark.parametrize("operand", ["x", "dt"])
@pytest.mark.parametrize("bounds, seq, state_size", SSD_NONFINITE_PATHS)
def test_simd_variant_ssd_backward_nan_spreads_as_in_the_reference(simd_backend, bounds, seq, state_size, operand):
    seed = random_seed()
    tensors, options, spans = _ssd_backward_inputs_with_a_nonfinite_item(bounds, seq, state_size, operand,
                                                                          float("nan"), (1, 2), seed)
    got = simd_backend.ssd_scan_backward(*tensors, **options,
                                         cu_seqlens=None if bounds is None else torch.tensor(bounds))
    rtol, atol = GRAD_TOLERANCES[torch.float32]
    for name, sequence, _, actual, expected in _ssd_gradients_by_sequence(got, tensors, options, spans):
        what = f"{simd_backend.details['simd']} build d{name} of sequence {sequence} {operand}=NaN seed={seed}"
        nan, got_nan = torch.isnan(expected), torch.isnan(actual)
        assert torch.equal(got_nan, nan), (f"{what}: NaN at {got_nan.nonzero().tolist()}, "
                                           f"the reference's at {nan.nonzero().tolist()}")
        assert_close(actual[~nan], expected[~nan], torch.float32, what,
                     tolerance=(rtol, atol * float(expected[~nan].abs().max())))


# The stand-in for an infinite input whose gradients tell how each infinity of the reference's
# came about: an infinity is a finite factor times the inf, and its sign is that factor's.
PROBE = 1e30
# A factor under this fraction of the largest is within fp32 rounding of zero (a sum of terms
# about 1 rounds by about 1e-7 of them): its sign, and the infinity's, is the order of operations'.
UNSETTLED_SIGN = 1e-4


def _unsettled_signs(expected, probed):
    """Where the reference's infinity has a sign fp32 cannot settle: its finite factor, read off
    the reference run with PROBE (of the inf's sign) for the inf, is within rounding of zero."""
    factor = (probed / PROBE).abs()
    inf = torch.isinf(expected)
    largest = float(factor[inf].max()) if inf.any() else 0.0
    return inf & (factor <= UNSETTLED_SIGN * largest)


def _assert_inf_gradient_as_the_reference(actual, expected, what, *, inf_may_be_nan, unsettled=None):
    """Every element the reference has finite, finite and as the reference's; every one it has
    ±inf, that infinity (or NaN where `inf_may_be_nan`: the chunked form's sums, docs/training.md
    "Limits"), or any infinity or NaN where `unsettled` (_unsettled_signs: a seed found the
    reference's +inf as -inf from an adjoint of -2e-7, a rounding off zero). Where the reference
    has NaN, anything: inf - inf or 0 * inf of its own order of operations."""
    finite, inf = torch.isfinite(expected), torch.isinf(expected)
    lost = finite & ~torch.isfinite(actual)
    assert not lost.any(), (f"{what}: non-finite at {lost.nonzero().tolist()} where the reference's is finite "
                            f"({actual[lost].tolist()})")
    loose = torch.isnan(actual) if inf_may_be_nan else torch.zeros_like(inf)
    if unsettled is not None:
        loose = loose | (unsettled & ~torch.isfinite(actual))
    other = inf & (actual != expected) & ~loose
    assert not other.any(), f"{what}: {actual[other].tolist()} where the reference has {expected[other].tolist()}"
    if finite.any():
        rtol, atol = GRAD_TOLERANCES[torch.float32]
        assert_close(actual[finite], expected[finite], torch.float32, what,
                     tolerance=(rtol, atol * float(expected[finite].abs().max())))


# ±inf in one input of one (batch row, channel), gated by z, through Mamba-1's reverse scan, per
# variant, over 20 channels (a full and a partial block at every width), the sequence one chunk or
# (333 steps of state 16, past kWholeSequenceBytes at every width) checkpointed: the reference's
# IEEE result wherever it has no NaN, its infinities included.
MAMBA1_INF_PATHS = [
    pytest.param(40, 5, id="one-chunk-state-5"),
    pytest.param(333, 16, id="checkpointed-state-16"),
]
INF_OPERANDS = ["x", "dt", "B", "C", "z", "dy", "h0", "dstate"]
INF_VALUES = [pytest.param(float("inf"), id="inf"), pytest.param(float("-inf"), id="minus-inf")]


@pytest.mark.parametrize("value", INF_VALUES)
@pytest.mark.parametrize("operand", INF_OPERANDS)
@pytest.mark.parametrize("seq, state", MAMBA1_INF_PATHS)
def test_simd_variant_backward_inf_gives_the_references_result(simd_backend, seq, state, operand, value):
    _check_mamba1_backward_inf(simd_backend, seq, state, operand, value, dim=20, positive=False)


# The same with every other input positive, so that the infinities the sums over channels take
# in share a sign and the reference's dB (from C) and dC (from B) are infinities, not NaN; over 21
# channels, a partial block at every width. The sums took in the partial block's padding lanes,
# where the inf times the padding's zero dy is NaN (found in review).
@pytest.mark.parametrize("value", INF_VALUES)
@pytest.mark.parametrize("operand", ["B", "C"])
@pytest.mark.parametrize("seq, state", MAMBA1_INF_PATHS)
def test_simd_variant_backward_inf_sums_over_channels_as_the_reference(simd_backend, seq, state, operand, value):
    _check_mamba1_backward_inf(simd_backend, seq, state, operand, value, dim=21, positive=True)


# Without D, for the inputs the D x term reads, every other input positive (so that the
# reference's sums over the state are infinities, not NaN): the kernel added the term with a zero
# D, and 0 times an infinite x or dy was NaN in dx and dz where the reference has infinities
# (found in review).
@pytest.mark.parametrize("value", INF_VALUES)
@pytest.mark.parametrize("operand", ["x", "dy", "z"])
@pytest.mark.parametrize("seq, state", MAMBA1_INF_PATHS)
def test_simd_variant_backward_inf_without_D_gives_the_references_result(simd_backend, seq, state, operand, value):
    _check_mamba1_backward_inf(simd_backend, seq, state, operand, value, dim=21, positive=True, with_D=False)


def _check_mamba1_backward_inf(simd_backend, seq, state, operand, value, *, dim, positive, with_D=True):
    from scan_kernels.reference import selective_scan_backward_ref

    seed = random_seed()
    gen = torch.Generator().manual_seed(seed)
    batch = 2
    t = dict(x=torch.randn(batch, seq, dim, generator=gen), dt=0.01 + 0.5 * torch.rand(batch, seq, dim, generator=gen),
             A=-0.1 - torch.rand(dim, state, generator=gen), B=torch.randn(batch, seq, 1, state, generator=gen),
             C=torch.randn(batch, seq, 1, state, generator=gen), D=torch.randn(dim, generator=gen),
             z=torch.randn(batch, seq, dim, generator=gen), h0=torch.randn(batch, dim, state, generator=gen),
             dstate=torch.randn(batch, dim, state, generator=gen), dy=torch.randn(batch, seq, dim, generator=gen))
    if positive:
        t.update({k: t[k].abs() + 0.1 for k in ("x", "B", "C", "D", "z", "h0", "dstate", "dy")})
    # Row 1, channel 3, step 3, state element 2.
    at = {"B": (1, 3, 0, 2), "C": (1, 3, 0, 2), "h0": (1, 3, 2), "dstate": (1, 3, 2)}.get(operand, (1, 3, 3))
    def reference(stand_in):
        u = {k: v.clone() for k, v in t.items()}
        u[operand][at] = stand_in
        kwargs = dict(D=u["D"] if with_D else None, z=u["z"], dt_bias=None, dt_softplus=False, dt_min=None, dt_max=None, h0=u["h0"],
                      dstate=u["dstate"], layout="bld")
        return u, kwargs, selective_scan_backward_ref(u["dy"], u["x"], u["dt"], u["A"], u["B"], u["C"], **kwargs)

    t, kwargs, expected = reference(value)
    if positive and operand in ("B", "C"):
        summed = "C" if operand == "B" else "B"  # the gradients are keyed by their inputs' names
        assert torch.isinf(expected[summed]).any(), f"the reference's {summed} has no infinity to compare"
    probed = reference(math.copysign(PROBE, value))[2]
    got = simd_backend.scan_backward(t["dy"], t["x"], t["dt"], t["A"], t["B"], t["C"], **kwargs)
    for name, e in expected.items():
        _assert_inf_gradient_as_the_reference(
            got[name], e, f"{simd_backend.details['simd']} build d{name} {operand}={value} seed={seed}",
            inf_may_be_nan=False, unsettled=_unsettled_signs(e, probed[name]))


# An infinite x at a step whose dt the clamp cuts off (every other input positive, so that the
# reference's other gradients are no NaN): torch.clamp selects a zero gradient there, where the
# kernels multiplied by the clamp's zero slope, inf * 0 = NaN in ddt and in Mamba-1's summed
# ddt_bias (found in review). A softplus slope that underflows to zero is no cut: it multiplies,
# as torch's does, and the infinite gradient does not vanish into a 0 (found in review of that fix).
@pytest.mark.parametrize("cut", ["clamp", "softplus-underflow"])
@pytest.mark.parametrize("kind", ["scan", "ssd"])
def test_simd_variant_backward_zeroes_ddt_only_where_the_clamp_cuts_dt(simd_backend, kind, cut):
    import scan_kernels

    gen = torch.Generator().manual_seed(random_seed())
    positive = lambda *shape: torch.rand(*shape, generator=gen) + 0.1
    if kind == "scan":
        x, dt, dy = positive(1, 6, 4), torch.full((1, 6, 4), 0.2), positive(1, 6, 4)
        operands = (x, dt, -positive(4, 3), positive(1, 6, 1, 3), positive(1, 6, 1, 3))
        options = dict(dt_bias=torch.zeros(4), layout="bld")
        x[0, 2, 1] = math.inf
        backward = scan_kernels.selective_scan_backward
    else:
        x, dt, dy = positive(1, 6, 2, 2), torch.full((1, 6, 2), 0.2), positive(1, 6, 2, 2)
        operands = (x, dt, -positive(2), positive(1, 6, 1, 3), positive(1, 6, 1, 3))
        options = dict(dt_bias=None, chunk_size=4)
        x[0, 2, 1, 0] = math.inf
        backward = scan_kernels.ssd_scan_backward
    if cut == "clamp":
        dt[0, 2, 1] = 0.9  # past dt_max
        options.update(dt_softplus=False, dt_max=0.5)
    else:
        dt[0, 2, 1] = -200.0  # softplus' slope is 0 in fp32
        options.update(dt_softplus=True, dt_max=None)
    options.update(D=None, z=None, dt_min=None, h0=None, dstate=None)
    expected = backward(dy, *operands, **options, backend="reference")
    got = getattr(simd_backend, "ssd_scan_backward" if kind == "ssd" else "scan_backward")(dy, *operands, **options)
    if cut == "clamp":
        assert expected["dt"][0, 2, 1] == 0 and got["dt"][0, 2, 1] == 0, got["dt"][0, :, 1]
        if kind == "scan":
            assert got["dt_bias"][1] == expected["dt_bias"][1] == -math.inf, got["dt_bias"]
    else:
        assert not math.isfinite(expected["dt"][0, 2, 1]) and not math.isfinite(got["dt"][0, 2, 1]), got["dt"][0, :, 1]


# ±inf in one input of one (sequence, head), gated by z, through Mamba-2's chunked backward, per
# variant: every gradient the reference has finite, as the reference's; its infinities, or NaN
# (docs/training.md "Limits"). The products with E (or E o R) multiplied E's zeros past the
# diagonal by the inf in another step's row of gy, u, B or C: NaN at the chunk's other steps where
# the reference is finite, in dx and ddt from dy or z, in dB from C, in dC from B, in dz from x or dt.
@pytest.mark.parametrize("value", INF_VALUES)
@pytest.mark.parametrize("operand", INF_OPERANDS)
@pytest.mark.parametrize("bounds, seq, state_size", SSD_NONFINITE_PATHS[1:])
def test_simd_variant_ssd_backward_inf_keeps_the_references_finite_gradients(simd_backend, bounds, seq, state_size,
                                                                             operand, value):
    seed = random_seed()
    tensors, options, spans = _ssd_backward_inputs_with_a_nonfinite_item(bounds, seq, state_size, operand, value,
                                                                          (1, 2), seed, z=True)
    got = simd_backend.ssd_scan_backward(*tensors, **options,
                                         cu_seqlens=None if bounds is None else torch.tensor(bounds))
    probe = _ssd_backward_inputs_with_a_nonfinite_item(bounds, seq, state_size, operand, math.copysign(PROBE, value),
                                                       (1, 2), seed, z=True)
    probed = {(name, sequence): e for name, sequence, _, _, e in _ssd_gradients_by_sequence(got, *probe[:2], spans)}
    for name, sequence, _, actual, expected in _ssd_gradients_by_sequence(got, tensors, options, spans):
        _assert_inf_gradient_as_the_reference(
            actual, expected, f"{simd_backend.details['simd']} build d{name} of sequence {sequence} "
                              f"{operand}={value} seed={seed}", inf_may_be_nan=True,
            unsettled=_unsettled_signs(expected, probed[name, sequence]))


# Packed sequences through the backward per variant: a sequence of one step, ones crossing the
# 16-step chunk, and (first case) a longest one of 333 steps, past the whole-sequence budget, so
# every sequence of that call takes the checkpointed path.
SIMD_PACKED_BACKWARD_CASES = [
    pytest.param("scan", [0, 1, 18, 351], ScanCase(1, 351, 37, 16, groups=1, **ALL), torch.float32,
                 id="checkpointed-longest-f32"),
    pytest.param("scan", [0, 9, 10, 45], ScanCase(1, 45, 20, 5, groups=2, layout="bdl", **ALL), torch.float32,
                 id="bdl-state-5-f32"),
    pytest.param("scan", [0, 3, 20], ScanCase(1, 20, 13, 16, D=True, z=True, h0=True), torch.float64, id="f64"),
    pytest.param("ssd", [0, 4, 40], SsdCase(1, 40, 3, 20, 16, groups=3, D=True, z=True, dt_bias=True,
                                             dt_softplus=True, h0=True), torch.float32, id="ssd-f32"),
]


@pytest.mark.parametrize("kind, bounds, case, dtype", SIMD_PACKED_BACKWARD_CASES)
def test_simd_variant_packed_backward_matches_each_sequence(simd_backend, kind, bounds, case, dtype):
    """The packed call's gradients against the reference's of each sequence alone, joined as
    the packed call joins them (the weights' summed over the sequences)."""
    from scan_kernels.reference import selective_scan_backward_ref, ssd_scan_backward_ref

    seed = random_seed()
    gen = torch.Generator().manual_seed(seed)
    ssd = kind == "ssd"
    inputs = (make_ssd_inputs if ssd else make_scan_inputs)(case, dtype, seed=seed)
    a = (_args.check_ssd_scan if ssd else _args.check_scan)(**inputs)
    state_shape = (case.heads, case.headdim, case.state) if ssd else (case.dim, case.state)
    h0 = torch.randn(len(bounds) - 1, *state_shape, generator=gen).to(a.x.dtype)
    dstate = torch.randn(len(bounds) - 1, *state_shape, generator=gen).to(a.x.dtype)
    dy = torch.randn(a.x.shape, generator=gen).to(dtype)
    if ssd:
        backward, reference, extra, seq_axis, bc_axis = (simd_backend.ssd_scan_backward, ssd_scan_backward_ref,
                                                         dict(chunk_size=None), 1, 1)
    else:
        bdl = a.layout == "bdl"
        backward, reference, extra, seq_axis, bc_axis = (simd_backend.scan_backward, selective_scan_backward_ref,
                                                         dict(layout=a.layout), 2 if bdl else 1, 3 if bdl else 1)
    options = dict(D=a.D, dt_bias=a.dt_bias, dt_softplus=a.dt_softplus, dt_min=a.dt_min, dt_max=a.dt_max, **extra)
    got = backward(dy, a.x, a.dt, a.A, a.B, a.C, z=a.z, h0=h0, dstate=dstate, **options,
                   cu_seqlens=torch.tensor(bounds))
    parts = []
    for i in range(len(bounds) - 1):
        def cut(t, axis):
            return None if t is None else t.narrow(axis, bounds[i], bounds[i + 1] - bounds[i])
        parts.append(reference(cut(dy, seq_axis), cut(a.x, seq_axis), cut(a.dt, seq_axis), a.A, cut(a.B, bc_axis),
                               cut(a.C, bc_axis), z=cut(a.z, seq_axis), h0=h0[i:i + 1], dstate=dstate[i:i + 1],
                               **options))
    rtol, atol = GRAD_TOLERANCES[dtype]
    for name, e in parts[0].items():
        pieces = [p[name] for p in parts]
        if e is None:
            continue
        axis = {"x": seq_axis, "dt": seq_axis, "z": seq_axis, "B": bc_axis, "C": bc_axis, "h0": 0}.get(name)
        expected = torch.cat(pieces, axis) if axis is not None else sum(pieces)
        assert_close(got[name], expected, dtype,
                     f"{simd_backend.details['simd']} build packed {kind} d{name} {bounds} seed={seed}",
                     tolerance=(rtol, atol * float(expected.abs().max())))


# The model step's matrix products (scan_kernels/cpu/linear_kernel.h): rows, in, features, bias, and
# the input's row stride past `in` (a column slice, as the Mamba-1 step's dt is).
LINEAR_CASES = [
    pytest.param(1, 256, 1152, True, 0, id="exphil-in-proj-one-row"),
    pytest.param(32, 512, 256, True, 0, id="exphil-out-proj-32-rows"),
    pytest.param(3, 37, 41, False, 0, id="odd-in-odd-features"),
    pytest.param(5, 16, 520, False, 48, id="strided-rows-features-past-blocks"),
    pytest.param(2, 7, 3, True, 0, id="smaller-than-a-vector"),
    pytest.param(4, 1, 17, True, 0, id="in-of-one"),
    pytest.param(7, 37, 41, True, 24, id="row-tiles-and-rows-past-them-odd-in-strided"),
    pytest.param(224, 256, 1032, True, 0, id="prefill-window-224-rows"),
]


def linear_operands(simd_backend, rows, width, features, bias, row_gap, weight_dtype):
    """The variant's extension, the seed, and random x (rows `row_gap` past `width` apart), w and
    bias (or None) of a LINEAR_CASES case."""
    from scan_kernels.cpu import build

    ext = build.load_extension(variant=build.variant_named(simd_backend.details["simd"]))
    seed = random_seed()
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, width + row_gap, generator=gen)[:, :width]
    w = torch.randn(features, width, generator=gen).to(weight_dtype)
    b = torch.randn(features, generator=gen) if bias else None
    return ext, seed, x, w, b


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16], ids=["f32-weights", "bf16-weights"])
@pytest.mark.parametrize("rows, width, features, bias, row_gap", LINEAR_CASES)
def test_simd_variant_linear_matches_reference(simd_backend, rows, width, features, bias, row_gap, weight_dtype):
    """bf16 weights (a model loaded in bf16) are widened exactly, so against the float64 product
    of the same bf16 values the tolerance is fp32's, as for fp32 weights."""
    ext, seed, x, w, b = linear_operands(simd_backend, rows, width, features, bias, row_gap, weight_dtype)
    got = ext.linear(x, w, b)
    expected = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())
    # fp32 sums of `width` products, in another order than the float64 reference's
    tolerance = 1e-5 * width ** 0.5 * float(expected.abs().max())
    assert got.shape == (rows, features) and got.dtype == torch.float32
    assert float((got.double() - expected).abs().max()) <= tolerance, \
        f"{simd_backend.details['simd']} linear {rows}x{width} -> {features} {weight_dtype} weights seed={seed}"


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16], ids=["f32-weights", "bf16-weights"])
@pytest.mark.parametrize("rows, width, features, bias, row_gap", [c for c in LINEAR_CASES if c.values[0] > 1] + [
    # whole blocks of features over an `in` short of, and past, a vector: a tiny model's widths
    pytest.param(5, 12, 48, False, 0, id="in-short-of-a-vector-whole-blocks"),
    pytest.param(5, 24, 48, True, 0, id="in-past-a-vector-whole-blocks"),
])
def test_simd_variant_linear_gives_a_row_what_it_gives_it_alone(simd_backend, rows, width, features, bias, row_gap,
                                                                weight_dtype):
    """Bit for bit, whatever rows a call holds beside it: the batcher shares a model step's pass
    between sessions, and a rollback re-simulates a frame alone. bf16 weights are widened once
    for a call of many rows and read as stored for one; the remainder past `in`'s last whole
    vector was summed differently in the two."""
    ext, seed, x, w, b = linear_operands(simd_backend, rows, width, features, bias, row_gap, weight_dtype)
    together = ext.linear(x, w, b)
    for row in range(rows):
        assert torch.equal(ext.linear(x[row:row + 1], w, b)[0], together[row]), \
            f"{simd_backend.details['simd']} linear {rows}x{width} -> {features} {weight_dtype}: row {row} seed={seed}"


@pytest.mark.parametrize("weight", [
    # [3, 4, 2] passed as [features 3, in 4], its product wrong (found in review)
    pytest.param(lambda: torch.randn(3, 4, 2), id="3d-weight"),
    pytest.param(lambda: torch.randn(4), id="1d-weight"),  # an IndexError from w.size(1)
    pytest.param(lambda: torch.tensor(1.0), id="0d-weight"),
])
def test_linear_refuses_a_weight_that_is_not_2d(weight):
    from scan_kernels.cpu import build

    ext = build.load_extension()
    with pytest.raises(ValueError, match=r"weight: expected a 2-d tensor \[features, in\], got \d-d"):
        ext.linear(torch.randn(2, 4), weight(), None)


def test_linear_refuses_operands_that_do_not_fit():
    from scan_kernels.cpu import build

    ext = build.load_extension()
    with pytest.raises(ValueError, match=r"weight \[3, 5\]"):
        ext.linear(torch.randn(2, 4), torch.randn(3, 5), None)
    with pytest.raises(ValueError, match="weight: expected a contiguous CPU tensor of Float, got Double"):
        ext.linear(torch.randn(2, 4), torch.randn(3, 4, dtype=torch.float64), None)
    with pytest.raises(ValueError, match="input: expected a 2-d CPU tensor of Float, got 2-d Half"):
        ext.linear(torch.randn(2, 4, dtype=torch.float16), torch.randn(3, 4), None)
    with pytest.raises(ValueError, match="not contiguous"):
        ext.linear(torch.randn(2, 4), torch.randn(4, 3).t(), None)
    with pytest.raises(ValueError, match="weight: expected a contiguous CPU tensor of Float, got Half"):
        ext.linear(torch.randn(2, 4), torch.randn(3, 4, dtype=torch.float16), None)
    with pytest.raises(ValueError, match="bias: expected a contiguous CPU tensor of Float, got BFloat16"):
        ext.linear(torch.randn(2, 4), torch.randn(3, 4, dtype=torch.bfloat16), torch.randn(3, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="input: expected each row contiguous .* got stride 2"):
        ext.linear(torch.randn(2, 8)[:, ::2], torch.randn(3, 4), None)
    # A row of one input has no stride to keep: taken whatever torch gives it.
    one_input = torch.randn(6).as_strided((3, 1), (2, 5))
    torch.testing.assert_close(ext.linear(one_input, torch.ones(4, 1), None), one_input.expand(-1, 4))


def test_ssd_results_do_not_depend_on_the_thread_count():
    inputs = make_ssd_inputs(SsdCase(2, 17, 5, 40, 24, D=True, h0=True))
    outputs = []
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            outputs.append(scan_kernels.ssd_scan(**inputs, backend="cpu"))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(*outputs))


def test_default_variant_is_the_best_the_cpu_executes(monkeypatch):
    from scan_kernels.cpu import build

    monkeypatch.delenv(build.SIMD_ENV, raising=False)
    assert build.selected_variant() == build.executable_variants()[0]
    assert build.executable_variants()[-1].name == "baseline"
    backend = scan_kernels.get_backend("cpu", "cpu")
    if os.environ.get(build.SIMD_ENV) is None:
        assert backend.details["simd"] == build.executable_variants()[0].name, backend.details
    assert scan_kernels.backend_details()["cpu"] == backend.details


def test_simd_env_forces_a_variant_and_refuses_what_the_cpu_cannot_execute(monkeypatch):
    from scan_kernels.cpu import build

    for variant in build.SIMD_VARIANTS:
        monkeypatch.setenv(build.SIMD_ENV, variant.name)
        reason = build.unsupported_reason(variant)
        if reason is None:
            assert build.selected_variant() == variant
            assert build.library_path().name == f"{build.MODULE_NAME}_{variant.name}.so"
        else:
            with pytest.raises(scan_kernels.BackendUnavailable, match=f"{build.SIMD_ENV}={variant.name}: .*cannot"):
                build.selected_variant()
    monkeypatch.setenv(build.SIMD_ENV, "avx1024")
    with pytest.raises(scan_kernels.BackendUnavailable, match="SIMD variant 'avx1024': expected one of .*baseline"):
        build.selected_variant()
    # A CPU without the variant's instruction sets: refused with the flags it lacks, not built.
    monkeypatch.setattr(build, "_cpu_flags", lambda: {"sse2"})
    monkeypatch.setenv(build.SIMD_ENV, build.SIMD_VARIANTS[0].name)
    if build.SIMD_VARIANTS[0].cpu_flags:
        with pytest.raises(scan_kernels.BackendUnavailable, match="cannot execute it .*lacks"):
            build.load_extension()
    assert [v.name for v in build.executable_variants()] == ["baseline"]


def test_variants_build_apart():
    """Each variant has its own flags, module name and digest, so that all load side by side."""
    from scan_kernels.cpu import build

    variants = build.SIMD_VARIANTS
    assert len({build.variant_module_name(v) for v in variants}) == len(variants)
    assert len({build.build_digest(variant=v) for v in variants}) == len(variants)
    assert len({build.compile_flags(v) for v in variants}) == len(variants)


AARCH64_CXX = "aarch64-linux-gnu-g++"


@pytest.mark.skipif(platform.machine().lower() in ("aarch64", "arm64"),
                    reason="on aarch64 the baseline variant above is the native build")
def test_kernels_compile_for_aarch64(tmp_path):
    """The kernels (the torch-free scan_kernel.cpp, whose vector code is all that depends on the
    target) cross-compiled for aarch64 with the baseline's flags: NEON vectors, no x86
    intrinsics, no warnings. Compile only; the compiler is Debian's g++-aarch64-linux-gnu
    (.ci/system-deps.sh installs it)."""
    from scan_kernels.cpu import build

    compiler = shutil.which(AARCH64_CXX)
    if compiler is None:
        pytest.skip(f"no aarch64 cross compiler ({AARCH64_CXX}; Debian package g++-aarch64-linux-gnu)")
    flags = [f for f in build.CFLAGS if f != "-Wall"] + ["-Wall", "-Wextra", "-Werror", "-std=c++17"]
    obj = tmp_path / "scan_kernel.o"
    proc = subprocess.run([compiler, *flags, "-c", str(build.SOURCE_DIR / "scan_kernel.cpp"), "-o", str(obj)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    disassembly = subprocess.run([compiler.replace("g++", "objdump"), "-d", str(obj)], capture_output=True,
                                 text=True, timeout=60).stdout
    assert "fmla\tv" in disassembly, "no NEON multiply-adds in the aarch64 build"


def test_bench_runner_reports_every_backend(tmp_path):
    """`python -m bench.kernels` (issue 4's runner) on two small cases: one row per backend
    with its timing, bandwidth, floor ratio and speedups, plus machine and commit info."""
    import json

    from bench import kernels as bench_kernels

    out = tmp_path / "scan_kernels.json"
    # The CPU's backends, also where a GPU would make cuda the default device.
    assert bench_kernels.main(["--quick", "--device", "cpu", "--cases", "1x4x16x4,step-32x512x16",
                               "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["machine"]["cpu_model"] and report["commit"]["commit"]
    assert report["copy_bandwidth_GBps"] > 0
    rows = {(r["case"], r["backend"]): r for r in report["results"]}
    assert set(rows) == {(c, b) for c in ("1x4x16x4", "step-32x512x16") for b in ("reference", "torch", "cpu")}
    for (case, backend), r in rows.items():
        assert r["p20_us"] <= r["median_us"] <= r["p80_us"], (case, backend, r)
        assert r["GBps"] > 0 and r["over_floor"] > 0
        assert r["speedup_vs_reference"] > 0 and r["speedup_vs_torch"] > 0
    assert rows[("1x4x16x4", "reference")]["speedup_vs_reference"] == 1.0


def test_bench_runner_times_every_simd_variant_side_by_side(tmp_path):
    """`--simd all --rounds 2`: a row per variant this CPU executes (cpu-<variant>) beside the
    default cpu backend and the baselines, each the median of its alternated rounds, and the
    variant of each named in backend_details."""
    from bench import kernels as bench_kernels
    from scan_kernels.cpu import build

    out = tmp_path / "simd.json"
    assert bench_kernels.main(["--quick", "--device", "cpu", "--cases", "1x4x16x4", "--simd", "all",
                               "--rounds", "2", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    variants = [v.name for v in build.executable_variants()]
    rows = {r["backend"]: r for r in report["results"]}
    assert set(rows) == {"reference", "torch", "cpu", *(f"cpu-{v}" for v in variants)}
    for v in variants:
        assert report["backend_details"][f"cpu-{v}"]["simd"] == v
        assert len(rows[f"cpu-{v}"]["round_medians_us"]) == 2 and rows[f"cpu-{v}"]["speedup_vs_torch"] > 0
    assert report["backend_details"]["cpu"]["simd"] in variants
    assert "round_medians_us" not in rows["reference"], "the reference is measured once"


def test_bench_runner_summarises_repeated_runs():
    """`--runs`: per (case, backend), the median of the runs' medians and their range; a row a
    run skipped is left out; speedups are the median of each run's."""
    from bench.kernels import over_runs

    def row(backend, median, **extra):
        return {"case": "c", "backend": backend, "median_us": median, "p20_us": median - 1, **extra}

    runs = [[row("reference", 100.0), row("cpu", 30.0, speedup_vs_reference=100 / 30)],
            [{"case": "c", "backend": "reference", "skipped": "too big"}, row("cpu", 10.0, speedup_vs_reference=9.0)],
            [row("reference", 90.0), row("cpu", 20.0, speedup_vs_reference=4.5)]]
    reference, cpu = over_runs(runs)
    assert (reference["backend"], reference["runs"], reference["run_medians_us"]) == ("reference", 2, [100.0, 90.0])
    assert reference["median_of_medians_us"] == 95.0 and "median_speedup_vs_reference" not in reference
    assert cpu["run_medians_us"] == [30.0, 10.0, 20.0]
    assert (cpu["median_of_medians_us"], cpu["min_median_us"], cpu["max_median_us"]) == (20.0, 10.0, 30.0)
    assert cpu["median_of_p20_us"] == 19.0 and cpu["median_speedup_vs_reference"] == 4.5


def test_bench_runner_repeats_in_fresh_processes(tmp_path):
    import json

    from bench import kernels as bench_kernels

    out = tmp_path / "runs.json"
    assert bench_kernels.main(["--quick", "--device", "cpu", "--cases", "1x4x16x4", "--backends", "cpu",
                               "--runs", "2", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["runs"] == 2 and len(report["each_run"]) == 2
    # every other option reached the runs: only the named case, on the quick budget
    assert report["quick"] and {e["case"] for e in report["over_runs"]} == {"1x4x16x4"}
    summary = {e["backend"]: e for e in report["over_runs"]}
    assert set(summary) == {"reference", "torch", "cpu"}
    for e in summary.values():
        assert e["runs"] == 2 and e["min_median_us"] <= e["median_of_medians_us"] <= e["max_median_us"]
        assert sorted(e["run_medians_us"]) == [e["min_median_us"], e["max_median_us"]]


@pytest.mark.parametrize("argv, message", [
    pytest.param(["--runs", "0"], "--runs: expected at least 1, got 0", id="no-runs"),
    pytest.param(["--runs", "2", "--gap-seconds", "-1"], "--gap-seconds: expected 0 or more, got -1.0",
                 id="negative-gap"),
])
def test_bench_runner_refuses_impossible_repeats(argv, message, capsys):
    from bench import kernels as bench_kernels

    with pytest.raises(SystemExit) as exit_info:
        bench_kernels.main(argv)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


# --- bench.kernel_ab: two builds in one process ----------------------------------------------

def test_kernel_ab_times_two_builds_of_one_revision(tmp_path):
    """HEAD against HEAD: two libraries under two module names (a copy's and, where HEAD's
    kernels are the checkout's, the checkout's own), loaded side by side, whose outputs agree
    bit for bit; every (case, threads) row has both builds' blocks."""
    import json

    from bench import kernel_ab
    from scan_kernels.cpu import build

    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout.strip()
    out = tmp_path / "ab.json"
    assert kernel_ab.main(["--base", "HEAD", "--other", "HEAD", "--cases",
                           "1x4x16x4,step-32x512x16,backward-2x64x32x16", "--threads", "1,2", "--seconds", "0",
                           "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["base"]["commit"] == report["other"]["commit"] == head
    assert report["base"]["details"]["library"] != report["other"]["details"]["library"]
    kernel_ab.sources_at("HEAD", tmp_path / "head")
    if kernel_ab.are_the_checkouts_sources(tmp_path / "head"):
        # HEAD's kernels are the checkout's (always so in a clean clone): only the base compiled.
        assert report["other"]["details"]["library"] == str(build.library_path())
    assert [(r["case"], r["threads"]) for r in report["results"]] == [
        (case, threads) for case in ("1x4x16x4", "step-32x512x16", "backward-2x64x32x16") for threads in (1, 2)]
    for row in report["results"]:
        assert row["max_relative_difference"] == row["max_difference_of_largest"] == 0.0
        assert row["base"]["blocks"] == row["other"]["blocks"] >= 10
        assert row["ratio_median"] == pytest.approx(row["base"]["median_us"] / row["other"]["median_us"])
        assert 0 < row["ratio_paired_median"] < float("inf")


# A Python extension in the C API alone: no pybind11 or torch headers to compile for each copy.
DESCRIBE_CPP = r"""#include <Python.h>
#include "description.h"
#define SCAN_BRIDGE_CONCAT(a, b) a##b
#define SCAN_BRIDGE_INIT(name) SCAN_BRIDGE_CONCAT(PyInit_, name)
static PyObject* simd(PyObject*, PyObject*) { return PyUnicode_FromString(kDescription); }
static PyMethodDef methods[] = {{"simd", simd, METH_NOARGS, nullptr}, {nullptr, nullptr, 0, nullptr}};
static PyModuleDef definition = {PyModuleDef_HEAD_INIT, "copy", nullptr, -1, methods};
extern "C" __attribute__((visibility("default"))) PyObject* SCAN_BRIDGE_INIT(TORCH_EXTENSION_NAME)() {
  return PyModule_Create(&definition);
}
"""


def test_a_copy_without_sources_is_refused_by_name(tmp_path, capsys):
    """A directory holding none of the sources (a wrong --sources): a one-line refusal naming it,
    in the API and from the command, not the build tool's own error."""
    from scan_kernels.cpu import build

    with pytest.raises(scan_kernels.BackendUnavailable, match=f"{tmp_path}: expected the kernel sources"):
        build.load_sources(tmp_path, "scan_bridge_cpu_test")
    assert build.main(["--sources", str(tmp_path), "--module-prefix", "scan_bridge_cpu_test"]) == 1
    assert f"{tmp_path} not built: {tmp_path}: expected the kernel sources" in capsys.readouterr().err


def test_each_copy_of_the_sources_loads_as_a_module_of_its_own(tmp_path, monkeypatch):
    """build.load_sources: within one process the same sources loaded again give the same
    module, and other sources under the same prefix -- even MODULE_NAME's, beside the loaded
    default extension -- give a module running their own code (here: a marked `simd`
    description), never the one first loaded under a name. The copies are of a one-function
    extension standing in for the kernels' sources: the naming is under test, not the kernels,
    and each copy of those costs a whole build (kernel_ab's test builds them)."""
    from scan_kernels.cpu import build

    default = build.load_extension()
    monkeypatch.setattr(build, "SOURCES", ("describe.cpp",))
    monkeypatch.setattr(build, "HEADERS", ("description.h",))

    def copy_marked(directory, mark):
        directory.mkdir()
        (directory / "description.h").write_text(f'constexpr const char* kDescription = "a copy{mark}";\n')
        (directory / "describe.cpp").write_text(DESCRIBE_CPP)
        return directory

    first = build.load_sources(copy_marked(tmp_path / "plain", ""), "scan_bridge_cpu_test")
    assert first.simd() == "a copy"
    assert build.load_sources(copy_marked(tmp_path / "again", ""), "scan_bridge_cpu_test") is first
    marked = build.load_sources(copy_marked(tmp_path / "marked", ", marked"), "scan_bridge_cpu_test")
    assert (marked.simd(), first.simd()) == ("a copy, marked", "a copy")
    beside_default = build.load_sources(copy_marked(tmp_path / "beside", ", beside"), build.MODULE_NAME)
    assert beside_default.simd() == "a copy, beside"
    assert default.simd().startswith(build.selected_variant().name) and beside_default is not default


def test_kernel_ab_sleeps_past_the_helper_pools_spin():
    """kernel_ab's copy of helper_pool.h's kSpin, which its pauses between blocks must outlast."""
    import re

    from bench import kernel_ab

    spin = re.search(r"kSpin\{(\d+)\}", (ROOT / "scan_kernels/cpu/helper_pool.h").read_text())
    assert spin, "kSpin not found in helper_pool.h"
    assert kernel_ab.HELPER_SPIN_SECONDS == int(spin.group(1)) * 1e-6


def test_kernel_ab_reports_builds_that_compute_differently():
    """The outputs check sees a difference where there is one: the cpu backend against the
    torch backend (same math, other rounding) on every kind of case."""
    from bench import kernel_ab

    pair = (scan_kernels.get_backend("cpu", "cpu"), scan_kernels.get_backend("torch", "cpu"))
    for name in ("1x4x16x4", "step-32x512x16", "backward-2x64x32x16"):
        difference, of_largest = kernel_ab.output_differences(kernel_ab.case_named(name), pair)
        # Relative per element, so an output that cancels to near zero sets it, and the step's
        # varies with the CPU the kernels are built for; a kernel computing something else
        # differs by ~1. Against each output's largest magnitude: fp32 rounding.
        assert 0 < difference < 1e-2, (name, difference)
        assert 0 < of_largest < 1e-5, (name, of_largest)


def test_kernel_ab_copies_the_working_tree_sources(tmp_path):
    from bench import kernel_ab
    from scan_kernels.cpu import build

    assert kernel_ab.sources_at(kernel_ab.WORKING_TREE, tmp_path) == kernel_ab.WORKING_TREE
    for name in build.SOURCES + build.HEADERS:
        assert (tmp_path / name).read_bytes() == (build.SOURCE_DIR / name).read_bytes()
    # Such a copy is recognised, and the checkout's own build serves that side; one byte off or
    # one file short is a copy of other sources.
    assert kernel_ab.are_the_checkouts_sources(tmp_path)
    edited = tmp_path / build.SOURCES[0]
    edited.write_bytes(edited.read_bytes() + b"\n")
    assert not kernel_ab.are_the_checkouts_sources(tmp_path)
    edited.unlink()
    assert not kernel_ab.are_the_checkouts_sources(tmp_path)


@pytest.mark.parametrize("argv, status, message", [
    pytest.param(["--base", "no-such-revision"], 2, "revision 'no-such-revision':", id="unknown-revision"),
    pytest.param(["--cases", "nope"], 2, "--cases: unknown case 'nope'", id="unknown-case"),
    pytest.param(["--threads", "0"], 2, "--threads: expected counts of 1 or more, got '0'", id="no-threads"),
    pytest.param(["--threads", "two"], 2, "--threads: expected comma-separated integers, got 'two'",
                 id="threads-not-numbers"),
    pytest.param(["--seconds", "-1"], 2, "--seconds: expected a finite number of 0 or more, got -1.0",
                 id="negative-seconds"),
])
def test_kernel_ab_says_what_it_expected(argv, status, message, capsys):
    from bench import kernel_ab

    try:
        code = kernel_ab.main(argv)
    except SystemExit as exc:
        code = exc.code
    assert code == status and message in capsys.readouterr().err
