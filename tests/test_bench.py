"""`python -m bridge.bench`: the stage split adds up, the JSON schema holds still, `--quick`
runs end to end, and `--baseline` compares with another Port-style server. The repo-only
benches (`python -m bench.game_loop`, `bench.transports`, `bench.soak`) run end to end. The
package boundary holds: nothing installed imports the top-level `bench`, which is not installed."""

from __future__ import annotations

import ast
import collections
import importlib.util
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tomllib
from pathlib import Path

import msgpack
import numpy as np
import pytest

import scan_kernels
import protocol
from bridge.bench import plot as plot_mod
from bridge.bench.baseline import run_baseline
from bridge.bench.cases import Case, parse_sizes
from bridge.bench.lanes import TRANSPORTS, BenchError, SpawnedServer, choose_transports
from bridge.bench.measure import (STAGES, TimingMissing, fit_latency, make_row, measure_case,
                                  stage_split)
from bridge.client import Reply
from process_runs import children_of, describe_process, gone_or_zombie, run_marked
from kernel_cases import ON_CUDA

SERVER = [sys.executable, "-m", "bridge", "--device", "cpu"]

# The JSON schema, spelled out: changing a key breaks whoever reads bench/results, so it must
# be a deliberate change here too.
TOP_KEYS = {"benchmark", "schema_version", "machine_info", "commit_info", "servers", "config", "rows", "fits",
            "baseline_command", "baseline", "skipped", "failures", "elapsed_s"}
ROW_KEYS = [
    "transport", "backend", "device", "case", "op",
    "batch", "seq", "dim", "state", "iterations", "request_bytes", "reply_bytes",
    "round_trip_p50_us", "round_trip_p90_us", "round_trip_p99_us",
    "client_encode_p50_us", "client_encode_p90_us", "client_encode_p99_us",
    "server_decode_p50_us", "server_decode_p90_us", "server_decode_p99_us",
    "queue_p50_us", "queue_p90_us", "queue_p99_us",
    "h2d_p50_us", "h2d_p90_us", "h2d_p99_us",
    "kernel_p50_us", "kernel_p90_us", "kernel_p99_us",
    "d2h_p50_us", "d2h_p90_us", "d2h_p99_us",
    "server_encode_p50_us", "server_encode_p90_us", "server_encode_p99_us",
    "server_other_p50_us", "server_other_p90_us", "server_other_p99_us",
    "client_decode_p50_us", "client_decode_p90_us", "client_decode_p99_us",
    "transport_p50_us", "transport_p90_us", "transport_p99_us",
    "floor_p50_us", "floor_p90_us", "floor_p99_us",
    "ipc_over_floor_ratio", "overhead_over_floor_ratio", "fits_60fps",
]
FIT_KEYS = {"transport", "backend", "measure", "points", "intercept_us", "slope_us_per_mb",
            "bandwidth_gb_per_s", "max_error_ratio"}
BASELINE_KEYS = {"case", "seq", "request_bytes", "bridge_reply_bytes", "baseline_reply_bytes", "iterations",
                 "bridge_p50_us", "bridge_p90_us", "bridge_p99_us", "baseline_p50_us", "baseline_p90_us",
                 "baseline_p99_us", "baseline_over_bridge_ratio", "results_agree"}
UNIT_SUFFIXES = ("_us", "_bytes", "_ratio", "_gb_per_s", "_us_per_mb", "_s")
COUNTS = {"batch", "seq", "dim", "state", "iterations", "points", "schema_version"}


def check_units(mapping: dict, where: str) -> None:
    """Every number is named with its unit, or is a count."""
    for key, value in mapping.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            assert key in COUNTS or key.endswith(UNIT_SUFFIXES), f"{where}: {key!r} has no unit suffix"


@pytest.fixture(scope="module")
def server():
    specs, _ = choose_transports(None)
    with SpawnedServer(specs, ["--device", "cpu"]) as spawned:
        yield spawned


@pytest.mark.parametrize("transport", list(TRANSPORTS))
@pytest.mark.parametrize("case", [
    pytest.param(Case("step", 1, batch=3, dim=37, state=5), id="step-odd"),
    pytest.param(Case("scan", 7, batch=2, dim=33, state=3), id="scan-odd"),
    pytest.param(Case("scan", 60), id="scan-exphil-window"),
])
def test_stages_sum_to_the_round_trip(server, transport, case):
    if TRANSPORTS[transport].missing():
        pytest.skip(f"this checkout has no {transport} client: {TRANSPORTS[transport].missing()}")
    # A transport this checkout has a client for must be served, and answer.
    lane = next((lane for lane in server.lanes if lane.transport == transport), None)
    assert lane is not None, server.skipped
    samples = measure_case(case, [lane], iterations=4, warmup=1, max_seconds=30.0,
                           seed=np.random.SeedSequence().entropy % 2**32)[transport]
    assert len(samples.round_trip_us) == 4
    for i, round_trip in enumerate(samples.round_trip_us):
        stages = {stage: samples.stages_us[stage][i] for stage in STAGES}
        # Every stage, including the two the measured ones leave over, is a real share of the
        # round trip: the server's stages fit in server_us, and server_us in the round trip.
        negative = {stage: us for stage, us in stages.items() if us < 0}
        assert not negative, f"iteration {i}: stages below zero {negative}"
        assert sum(stages.values()) == pytest.approx(round_trip, rel=1e-9)
    assert samples.request_bytes > sum(4 * np.prod(s) for s in _shapes(case)) > 0
    if lane.make_floor is not None:
        assert len(samples.floor_us) == 4 and min(samples.floor_us) > 0
    row = make_row(case, transport, server.backend, server.device, samples)
    assert list(row) == ROW_KEYS
    assert row["round_trip_p50_us"] <= row["round_trip_p90_us"] <= row["round_trip_p99_us"]


def _shapes(case: Case) -> list[tuple[int, ...]]:
    lead = (case.batch,) if case.op == "step" else (case.batch, case.seq)
    return [(*lead, case.dim)] * 2 + [(case.dim, case.state)] + [(*lead, case.state)] * 2


def test_stage_split_names_missing_timing_keys():
    reply = Reply(1, True, {}, None, {"decode_us": 1.0, "server_us": 5.0}, round_trip_us=9.0)
    with pytest.raises(TimingMissing, match="kernel_us"):
        stage_split(reply)


def test_fit_recovers_a_line():
    rng = np.random.default_rng()
    intercept, slope = rng.uniform(5, 500), rng.uniform(1e-4, 1e-2)  # µs, µs per byte
    sizes = np.array([4097, 168_193, 2_062_339, 8_143_043, 67_076_101], dtype=np.float64)
    fit = fit_latency(sizes, intercept + slope * sizes)
    assert fit["intercept_us"] == pytest.approx(intercept, rel=1e-6)
    assert fit["slope_us_per_mb"] == pytest.approx(slope * 1e6, rel=1e-6)
    assert fit["bandwidth_gb_per_s"] == pytest.approx(1 / slope / 1000, rel=1e-6)
    assert fit["max_error_ratio"] < 1e-6
    assert fit_latency([4097, 4097], [10.0, 11.0]) is None


@pytest.mark.parametrize("text, expected", [
    pytest.param("step,15,60", [Case("step", 1), Case("scan", 15), Case("scan", 60)], id="mixed"),
    pytest.param(" 7 ", [Case("scan", 7)], id="spaces"),
])
def test_parse_sizes(text, expected):
    assert parse_sizes(text) == expected


@pytest.mark.parametrize("text, message", [
    pytest.param("step,0", "got '0'", id="zero"),
    pytest.param("60,big", "got 'big'", id="word"),
    pytest.param("15,15", "twice", id="repeat"),
    pytest.param("", "got ''", id="empty"),
])
def test_parse_sizes_rejects(text, message):
    with pytest.raises(ValueError, match=message):
        parse_sizes(text)


def test_plot_says_why_without_matplotlib(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib → ImportError
    reason = plot_mod.plot([], str(tmp_path / "x.png"), {}, "title")
    assert "matplotlib is not installed" in reason
    assert not (tmp_path / "x.png").exists()


@pytest.mark.parametrize("start, end, fraction", [
    pytest.param("cpu  500 0 100 390 0 0 0 10 0 0", "cpu  800 0 200 790 0 0 0 210 0 0", 0.2, id="a fifth stolen"),
    pytest.param("cpu  500 0 100 390 0 0 0 10 0 0", "cpu  900 0 200 890 0 0 0 10 0 0", 0.0, id="none stolen"),
    pytest.param("cpu  500 0 100 390 0 0 0 10", "cpu  500 0 100 390 0 0 0 10", None, id="no time between"),
    pytest.param("cpu0 1 2 3 4 5 6 7 8", "cpu  1 2 3 4 5 6 7 8", None, id="not the cpu line"),
    pytest.param("cpu  1 2 3", "cpu  1 2 3 4 5 6 7 8", None, id="no steal field"),
])
def test_results_say_how_much_cpu_time_the_hypervisor_took(tmp_path, start, end, fraction):
    """machine_info's cpu_time_stolen: the steal share of the machine's CPU time between two
    readings of /proc/stat (the module's import and the results' writing)."""
    from bridge.bench import machine

    readings = []
    for name, line in (("start", start), ("end", end)):
        (tmp_path / name).write_text(line + "\nintr 1 2 3\n")
        readings.append(machine.cpu_times(str(tmp_path / name)))
    assert machine.stolen_fraction(*readings) == fraction
    assert machine.cpu_times(str(tmp_path / "absent")) is None
    stolen = machine.machine_info()["cpu_time_stolen"]
    assert stolen is None or 0.0 <= stolen <= 1.0


def test_results_tell_machines_of_one_model_name_apart():
    """A VM's model name ("AMD EPYC") is the same on Zen 3 and Zen 5: the family and model
    numbers, the SIMD sets and the kernels' variant tell them apart (found in review)."""
    from bridge.bench import machine
    from scan_kernels.cpu.build import selected_variant

    info = machine.machine_info()
    assert set(info["cpu_simd_flags"]) <= set(machine.SIMD_FLAGS)
    assert info["cpu_kernels_simd"] == selected_variant().name
    with open("/proc/cpuinfo") as f:
        listed = f.read()
    if "cpu family" in listed:
        assert info["cpu_family"] is not None and info["cpu_model_number"] is not None


def test_commit_info_of_another_checkout_says_whether_it_was_edited(tmp_path):
    """The A/B benches record the baseline tree's commit and whether it was edited, not its
    HEAD alone (found in review: an edited baseline was recorded as its clean commit)."""
    from bridge.bench.machine import commit_info

    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    (tmp_path / "f").write_text("1")
    subprocess.run([*git, "add", "f"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "one"], check=True)
    head = subprocess.run([*git, "rev-parse", "HEAD"], check=True, capture_output=True, text=True).stdout.strip()
    clean = commit_info(str(tmp_path))
    assert (clean["commit"], clean["dirty"], clean["dirty_paths"], clean["diff_sha256"]) == (head, False, [], None)
    (tmp_path / "f").write_text("2")
    edited = commit_info(str(tmp_path))
    assert (edited["commit"], edited["dirty"], edited["dirty_paths"]) == (head, True, ["f"]), edited
    # which edit: another one digests otherwise
    (tmp_path / "f").write_text("3")
    assert commit_info(str(tmp_path))["diff_sha256"] not in (None, edited["diff_sha256"])
    # A directory inside the checkout (an installed package's site-packages in a project's venv)
    # is not that checkout: its commit and edits are some other code's (found in review).
    (tmp_path / "venv" / "site-packages").mkdir(parents=True)
    inside = commit_info(str(tmp_path / "venv" / "site-packages"))
    assert (inside["commit"], inside["dirty"], inside["dirty_paths"]) == ("", None, []), inside


@pytest.mark.parametrize("flag", ["--json", "--plot"])
@pytest.mark.parametrize("where, message", [
    pytest.param("directory", "expected a file to write, got the directory", id="a-directory"),
    pytest.param("under-a-file", "cannot create the directory of", id="under-a-file"),
])
def test_an_output_the_run_could_not_write_is_refused_before_it(flag, where, message, tmp_path, capsys):
    """The results went unwritten (the plot with a traceback) only after the whole run."""
    from bench import varlen
    from bridge.bench.__main__ import main

    (tmp_path / "file").write_text("")
    path = str(tmp_path) if where == "directory" else str(tmp_path / "file" / "out.json")
    for bench_main in (main, varlen.main) if flag == "--json" else (main,):
        with pytest.raises(SystemExit) as stopped:
            bench_main(["--sizes", "step", flag, path] if bench_main is main else [flag, path])
        assert stopped.value.code == 2
        assert message in capsys.readouterr().err


def test_a_transport_named_twice_is_refused():
    """Its samples and echo floor are kept by name: twice, the rows doubled their samples and
    the first floor was never stopped (found in review)."""
    with pytest.raises(BenchError, match="stdio more than once"):
        choose_transports("stdio,unix,stdio")


@pytest.mark.parametrize("argv, message", [
    pytest.param(["--iterations", "0"], "--iterations: expected 1 or more, got 0", id="no-iterations"),
    pytest.param(["--clients", "-1"], "--clients: expected 0 or more, got -1", id="negative-clients"),
    pytest.param(["--requests", "0"], "--requests: expected 1 or more, got 0", id="no-requests"),
])
def test_the_transports_bench_refuses_counts_it_cannot_run(argv, message, capsys):
    from bench import transports

    with pytest.raises(SystemExit):
        transports.main(argv)
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("frames", ["40", "-3"])
def test_server_ab_refuses_rollbacks_past_its_frames(frames, capsys):
    """A rollback re-simulates at most the 32 frames a case cycles through: 40 ran 32 under
    the label rollback40, and -3 ran 29 (found in review)."""
    from bench import server_ab

    with pytest.raises(SystemExit):
        server_ab.main(["--baseline", str(ROOT), "--model-steps", "2", "--rollback-frames", frames])
    assert f"--rollback-frames: expected 0 to 32, got {frames}" in capsys.readouterr().err



@pytest.mark.parametrize("bench_name", ["game_loop", "kernels", "model_graphs", "triton_host"])
def test_benches_refuse_cuda_without_a_gpu_before_any_work(bench_name, capsys, monkeypatch):
    """Each started and failed later with a traceback (found in review)."""
    import importlib

    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as refused:
        importlib.import_module(f"bench.{bench_name}").main(["--device", "cuda"])
    assert refused.value.code == 2 and "--device cuda: no CUDA device here" in capsys.readouterr().err


@pytest.mark.parametrize("bench_name, argv, message", [
    pytest.param("models", ["--frames", "20"], "--frames: expected more than the 20 warm-up frames, got 20",
                 id="models-frames-all-warm-up"),
    pytest.param("game_loop", ["--windows", "0"], "--windows: expected at least 1, got 0", id="game-loop-no-windows"),
    pytest.param("ssd_step", ["--steps", "0"], "--steps: expected at least 1, got 0", id="ssd-step-no-steps"),
    pytest.param("ssd_step", ["--rounds", "0"], "--rounds: expected at least 1, got 0", id="ssd-step-no-rounds"),
    pytest.param("model_graphs", ["--frames", "0"], "--frames: expected at least 1, got 0",
                 id="model-graphs-no-frames"),
    # each taken as given and parsed once the parts before had run (found in review)
    pytest.param("game_loop", ["--lanes", "stdio,pigeon"], "--lanes: expected comma-separated lanes",
                 id="game-loop-unknown-lane"),
    pytest.param("game_loop", ["--rows", "1,0"], "--rows: expected comma-separated batch sizes of 1 or more",
                 id="game-loop-no-rows"),
    pytest.param("game_loop", ["--delays", "100,x"], "--delays: expected comma-separated --max-delay-us",
                 id="game-loop-bad-delay"),
    pytest.param("game_loop", ["--seconds", "0"], "--seconds: expected a number of seconds > 0",
                 id="game-loop-no-seconds"),
    pytest.param("metrics_cost", ["--steps", "9"], "--steps: expected at least 10", id="metrics-cost-no-scrape"),
    pytest.param("kernels", ["--reference-reps", "0"], "--reference-reps: expected at least 1, got 0",
                 id="kernels-no-reference"),
    pytest.param("kernels", ["--threads", "-2"], "--threads: expected at least 1, got -2", id="kernels-no-threads"),
])
def test_benches_refuse_counts_that_leave_nothing_to_report(bench_name, argv, message, capsys):
    """Each measured first and then raised on an empty median, minutes in (found in review)."""
    import importlib

    with pytest.raises(SystemExit):
        importlib.import_module(f"bench.{bench_name}").main(argv)
    assert message in capsys.readouterr().err


def test_ssd_tune_on_the_cpu_times_every_candidate_under_the_interpreter(tmp_path):
    """`--device cpu` is the script's own check: it ran without the interpreter, every candidate
    failing as "the CPU interpreter is off", and exited 0 (found in review)."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    out = tmp_path / "tune.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = run_marked([sys.executable, "-m", "bench.ssd_tune", "--device", "cpu", "--runs", "ssd-exphil:float32",
                       "--seconds", "0.01", "--json", str(out)], timeout_s=300,
                      cwd=Path(__file__).resolve().parent.parent, env=env)
    assert proc.failure() is None, proc.failure()
    (run,) = json.loads(out.read_text())["results"]
    candidates = run["rows"][1:]
    assert candidates and all("call_us" in row and "error" not in row for row in candidates), candidates


def test_ssd_tune_refuses_cuda_without_a_gpu_and_fails_where_no_candidate_ran(monkeypatch, capsys):
    """Without a GPU, `--device cuda` is refused before anything is measured; a run in which no
    Triton candidate got a time exits 1, naming the case (found by mutating the fix: nothing
    failed)."""
    import torch

    from bench import ssd_tune

    if not torch.cuda.is_available():
        with pytest.raises(SystemExit):
            ssd_tune.main(["--device", "cuda"])
        assert "no CUDA device here" in capsys.readouterr().err
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # as the run re-executed for the interpreter
    monkeypatch.setattr(ssd_tune, "run_case", lambda *args: [
        {"candidate": "torch-chunked", "call_us": 1.0}, {"candidate": "tf32-32", "error": "BackendUnavailable: off"}])
    assert ssd_tune.main(["--device", "cpu", "--runs", "ssd-exphil:float32"]) == 1
    assert "no Triton candidate ran for" in capsys.readouterr().err


def test_bench_refuses_a_device_for_a_server_it_connects_to():
    """--connect drives a running server: a --device was ignored, and recorded as if applied."""
    from bridge.bench.__main__ import main

    assert main(["--connect", "unix:/nonexistent.sock", "--device", "cuda", "--sizes", "step"]) == 2


@pytest.mark.parametrize("transport", ["unix", "zmq-ipc"])
def test_an_echo_floor_goes_with_the_bench_that_started_it(tmp_path, transport):
    """A bench killed by SIGTERM (timeout, a CI cancel) runs no finally: its unix and ZeroMQ
    echoes were left running, re-parented (found in review); they now end with it."""
    from bridge.bench.floors import floor_missing
    from waiting import wait_until

    if reason := floor_missing(transport):
        pytest.skip(reason)
    script = tmp_path / "bench.py"
    script.write_text("from bridge.bench.floors import open_floor\n"
                      "import sys, time\n"
                      "floor = open_floor(sys.argv[1], [8])\n"
                      "print(flush=True)\n"
                      "time.sleep(120)\n")
    proc = subprocess.Popen([sys.executable, str(script), transport], stdout=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        proc.stdout.readline()  # its echo is up
        (echo,) = children_of(proc.pid)
        with open(f"/proc/{echo}/cmdline", "rb") as cmdline:
            where = cmdline.read().split(b"\0")[1].decode()  # the echo's socket, in the bench's scratch
    finally:
        proc.terminate()
        proc.wait(30)
    try:
        wait_until(lambda: gone_or_zombie(echo), f"{transport}: the echo outlived its bench", timeout=10)
    finally:  # the bench's scratch directory, which it had no chance to remove
        shutil.rmtree(os.path.dirname(where.removeprefix("ipc://")), ignore_errors=True)


@pytest.mark.parametrize("server", ["spawned-server", "bridge-process"])
def test_a_bench_server_stopped_while_it_starts_is_stopped(server, monkeypatch):
    """A stop signal's exit while a bench server waits for the `info` that says where it
    listens left that server running: no caller held it yet to stop it."""
    from bridge.bench.floors import BridgeProcess
    from bridge.client import PortClient

    started = []

    def stopped_while_starting(self, *args, **kwargs):
        started.append(self.proc.pid)
        raise SystemExit(128 + signal.SIGTERM)

    with pytest.raises(SystemExit):
        if server == "spawned-server":
            monkeypatch.setattr(PortClient, "info", stopped_while_starting)
            SpawnedServer([TRANSPORTS["unix"]], ["--device", "cpu"])
        else:
            monkeypatch.setattr(BridgeProcess, "call", stopped_while_starting)
            BridgeProcess([], lanes=("unix",))
    (pid,) = started
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


@pytest.mark.parametrize("bench", [
    pytest.param(["bridge.bench", "--quick", "--transports", "unix", "--sizes", "step", "--device", "cpu"],
                 id="main-job"),
    # the repo-only benches took the signal's default action too (found in review)
    pytest.param(["bench.transports", "--lanes", "unix", "--cases", "exphil", "--iterations", "200", "--clients", "0"],
                 id="repo-bench"),
])
def test_a_bench_stopped_by_sigterm_leaves_no_scratch_behind(tmp_path, bench):
    """A bench given SIGTERM mid-run (a CI cancel, `timeout`) stops as Ctrl-C does: its servers
    are stopped and their scratch directories removed (the signal's default action left the unix
    server's socket directory behind)."""
    from bridge.bench.floors import floor_missing
    from waiting import wait_until

    for lane in ("stdio", "unix"):  # built first: a stop mid-build is another test's
        if reason := floor_missing(lane):
            pytest.skip(reason)
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    proc = subprocess.Popen([sys.executable, "-m", *bench], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            cwd=ROOT, env={**os.environ, "TMPDIR": str(scratch)})
    try:
        wait_until(lambda: any(scratch.iterdir()) and children_of(proc.pid), "the bench started no server",
                   timeout=120)
        started = children_of(proc.pid)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 128 + signal.SIGTERM, proc.stderr.read().decode()[-3000:]
    finally:
        proc.kill()
        proc.wait()
        proc.stderr.close()
    assert list(scratch.iterdir()) == []
    for pid in started:
        wait_until(lambda: gone_or_zombie(pid), f"{describe_process(pid)} outlived the bench", timeout=10)


def test_quick_end_to_end(tmp_path):
    out_json, out_png = tmp_path / "bench.json", tmp_path / "bench.png"
    proc = run_marked([sys.executable, "-m", "bridge.bench", "--quick", "--device", "cpu",
                       "--sizes", "step,3", "--json", str(out_json), "--plot", str(out_png)], timeout_s=120)
    assert proc.failure() is None, proc.failure()
    assert "transport" in proc.stdout and "latency ≈ a + b·bytes" in proc.stdout
    assert "60 FPS frame" in proc.stdout
    document = json.loads(out_json.read_text())
    assert set(document) == TOP_KEYS
    assert document["benchmark"] == "bridge-bench" and document["schema_version"] == 1
    assert {"cpu_model", "cpu_count", "torch", "python"} <= set(document["machine_info"])
    assert {"commit", "dirty", "branch"} <= set(document["commit_info"])
    rows = document["rows"]
    served = [name for name, spec in TRANSPORTS.items() if not spec.missing()]
    assert [(r["transport"], r["case"]) for r in rows] == [(t, c) for c in ("step", "scan L=3") for t in served], \
        document["skipped"]
    for row in rows:
        assert list(row) == ROW_KEYS
        check_units(row, f"row {row['case']}")
        assert row["iterations"] >= 3
    for fit in document["fits"]:
        assert set(fit) == FIT_KEYS
        check_units(fit, "fit")
    check_units(document, "document")
    if importlib.util.find_spec("matplotlib") is None:
        assert "no plot: matplotlib is not installed" in proc.stdout
    else:
        assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("command, device", [
    pytest.param(SERVER, "cpu", id="our-own-server"),
    pytest.param([sys.executable, "-m", "bridge.bench.exphil_standin"], "cpu", id="exphil-standin"),
    pytest.param([sys.executable, "-m", "bridge.bench.exphil_standin", "--device", "cuda"], "cuda",
                 id="exphil-standin-cuda", marks=ON_CUDA),
])
def test_baseline_compares_exphil_requests(command, device):
    cases = [Case("scan", 1), Case("scan", 5, batch=3, dim=7, state=3)]
    rows = run_baseline(shlex.join(command), cases, ["--device", device], iterations=3,
                        warmup=1, max_seconds=30.0, seed=np.random.SeedSequence().entropy % 2**32)
    assert [r["case"] for r in rows] == ["scan L=1", "scan L=5"]
    for row in rows:
        assert set(row) == BASELINE_KEYS
        check_units(row, "baseline row")
        assert row["results_agree"], row
        assert row["iterations"] == 3
        assert row["baseline_over_bridge_ratio"] == pytest.approx(row["baseline_p50_us"] / row["bridge_p50_us"])


def test_baseline_alternates_which_server_goes_first(monkeypatch):
    """Each timed pair of round trips starts with the other server than the pair before, so
    neither side always meets what the other just warmed (found in review: the stand-in always
    went second)."""
    from bridge.bench import baseline

    order = []

    class RecordingPort:
        """Answers legacy pings and scans (zeros of the right shape) at once, noting who it is."""

        def __init__(self, command):
            self.command = command
            self.who = "bridge" if command[1:3] == ["-m", "bridge"] else "baseline"

        def exchange(self, parts, timeout=None):
            body = b"".join(bytes(p) for p in parts)[protocol.framing.HEADER_SIZE:]
            request = msgpack.unpackb(body, raw=True)  # tensors go as str, the way Msgpax packs them
            reply = {"status": "ok"}
            if request[b"op"] == b"scan":
                order.append(self.who)
                shape = [request[b"batch"], request[b"seq_len"], request[b"hidden"]]
                reply.update(result=bytes(4 * int(np.prod(shape))), shape=shape)
            return 1.0, msgpack.packb(reply, use_bin_type=True)

        def close(self):
            pass

    monkeypatch.setattr(baseline, "PortProcess", RecordingPort)
    (row,) = run_baseline("their-server", [Case("scan", 2)], ["--device", "cpu"], iterations=4, warmup=1,
                          max_seconds=30.0)
    assert row["results_agree"] and row["iterations"] == 4
    # The first exchange of each checks the answers; then five timed pairs, alternating.
    timed = order[2:]
    assert [timed[i] for i in range(0, len(timed), 2)] == ["bridge", "baseline", "bridge", "baseline", "bridge"]
    assert sorted(timed) == ["baseline"] * 5 + ["bridge"] * 5


def test_baseline_names_a_command_that_does_not_start():
    with pytest.raises(BenchError, match="no-such-server"):
        run_baseline("/nonexistent/no-such-server --flag", [Case("scan", 1)], ["--device", "cpu"],
                     iterations=1, warmup=0, max_seconds=1.0)


@pytest.mark.parametrize("argv, status, message", [
    pytest.param(["--sizes", "step,x"], 2, "expected 'step' or a positive sequence length", id="bad-size"),
    pytest.param(["--iterations", "0"], 2, "expected --iterations >= 1", id="no-iterations"),
    pytest.param(["--max-seconds", "nan"], 2, "a finite --max-seconds > 0, got 100, 2 and nan", id="nan-seconds"),
    pytest.param(["--max-seconds", "inf"], 2, "a finite --max-seconds > 0, got 100, 2 and inf", id="endless-seconds"),
    pytest.param(["--transports", "pigeon"], 2, "got pigeon", id="unknown-transport"),
    pytest.param(["--sizes", "step", "--backends", "nosuch"], 1, "got 'nosuch'", id="server-refuses-backend"),
])
def test_cli_says_what_it_expected(argv, status, message, capsys):
    from bridge.bench.__main__ import main

    assert main(["--device", "cpu", *argv]) == status
    assert message in capsys.readouterr().err


def test_a_sweep_cut_short_says_where_and_writes_nothing(tmp_path, capsys):
    """A request failing mid-sweep (here one over the server's frame limit, after the step was
    measured) stops the run with what failed, not a traceback, and no JSON that looks whole."""
    from bridge.bench.__main__ import main

    out_json = tmp_path / "bench.json"
    assert main(["--device", "cpu", "--sizes", "step,15", "--iterations", "3", "--transports", "stdio",
                 "--server-arg=--max-frame-size", "--server-arg", "1000000", "--json", str(out_json)]) == 1
    err = capsys.readouterr().err
    assert "scan 32×15×512×16 on backend cpu failed, so nothing is written: frame_too_large" in err, err
    assert not out_json.exists()


def test_connect_measures_a_running_server(tmp_path, capsys):
    from bridge.bench.__main__ import main

    if TRANSPORTS["unix"].missing():
        pytest.skip(TRANSPORTS["unix"].missing())
    path = str(tmp_path / "bridge.sock")
    server = subprocess.Popen([*SERVER, "--unix", path, "--threads", "1"], stdin=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        out_json = tmp_path / "connect.json"
        assert main(["--connect", f"unix:{path}", "--sizes", "step,2", "--iterations", "3",
                     "--json", str(out_json)]) == 0, capsys.readouterr().err
        document = json.loads(out_json.read_text())
        rows = document["rows"]
        assert [(r["transport"], r["case"]) for r in rows] == [("unix", "step"), ("unix", "scan L=2")]
        assert all(r["iterations"] == 3 for r in rows)
        # The server's own configuration, which nothing else in the results can say here.
        (info,) = document["servers"]
        assert (info["pid"], info["devices"][0]["threads"]) == (server.pid, 1)
    finally:
        server.terminate()
        assert server.wait(10) == 0


WRONG_SERVER = """
import struct, sys, msgpack
stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
while (header := stdin.read(4)):
    request = msgpack.unpackb(stdin.read(struct.unpack(">I", header)[0]), raw=True)
    reply = {"status": "ok"}
    if request[b"op"] == b"scan":  # the right shape, the wrong numbers
        shape = [request[b"batch"], request[b"seq_len"], request[b"hidden"]]
        reply.update(result=bytes(4 * shape[0] * shape[1] * shape[2]), shape=shape)
    body = msgpack.packb(reply)
    stdout.write(struct.pack(">I", len(body)) + body)
    stdout.flush()
"""


def test_baseline_flags_results_that_differ(tmp_path):
    script = tmp_path / "wrong_server.py"
    script.write_text(WRONG_SERVER)
    rows = run_baseline(shlex.join([sys.executable, str(script)]), [Case("scan", 3, batch=2, dim=9, state=4)],
                        ["--device", "cpu"], iterations=3, warmup=0, max_seconds=30.0,
                        seed=np.random.SeedSequence().entropy % 2**32)
    assert [(r["results_agree"], r["baseline_over_bridge_ratio"]) for r in rows] == [(False, None)]


def test_the_baseline_is_compared_with_each_backend_measured_and_never_beside_connect(tmp_path, capsys, monkeypatch):
    """--baseline spawned a default server whatever --backends measured, and beside --connect
    one of its own: its ratio described a server nobody chose (found in review). It takes the
    backends from the servers the sweep ran, which "all" leaves to the first server to name."""
    from bridge.bench.__main__ import main

    script = tmp_path / "wrong_server.py"
    script.write_text(WRONG_SERVER)
    out_json = tmp_path / "bench.json"
    main(["--device", "cpu", "--transports", "stdio", "--sizes", "3", "--iterations", "3", "--backends",
          "reference,cpu", "--baseline", shlex.join([sys.executable, str(script)]), "--json", str(out_json)])
    document = json.loads(out_json.read_text())
    assert [(r["backend"], r["case"]) for r in document["baseline"]] == [("reference", "scan L=3"), ("cpu", "scan L=3")]
    assert "bridge (reference) p50" in capsys.readouterr().out
    # each row's server ran that backend (the label alone proves nothing)
    from bridge.bench import __main__ as bench_main

    servers_run = []
    monkeypatch.setattr(bench_main.baseline_mod, "run_baseline",
                        lambda command, cases, bridge_args, **options: servers_run.append(bridge_args) or [])
    main(["--device", "cpu", "--transports", "stdio", "--sizes", "3", "--iterations", "3", "--backends",
          "reference,cpu", "--baseline", "their-server"])
    assert [args[args.index("--backend") + 1] for args in servers_run] == ["reference", "cpu"]
    assert main(["--connect", "unix:/nonexistent.sock", "--baseline", "their-server"]) == 2
    assert "--baseline: it compares a server it spawns; expected no --connect with it" in capsys.readouterr().err
    with pytest.raises(SystemExit) as refused:  # no port: libzmq's "Invalid argument", mid-run
        main(["--connect", "tcp://localhost"])
    assert refused.value.code == 2 and "expected unix:PATH, ipc://PATH or tcp://HOST:PORT" in capsys.readouterr().err


@pytest.mark.parametrize("baseline, complaint", [
    pytest.param("wrong", "its results differ from python -m bridge's on scan L=3", id="wrong-answers"),
    pytest.param("missing", "no-such-server", id="does-not-start"),
])
def test_a_failed_baseline_exits_1_after_reporting_the_sweep(tmp_path, capsys, baseline, complaint):
    from bridge.bench.__main__ import main

    script = tmp_path / "wrong_server.py"
    script.write_text(WRONG_SERVER)
    command = shlex.join([sys.executable, str(script)]) if baseline == "wrong" else "/nonexistent/no-such-server"
    out_json = tmp_path / "bench.json"
    assert main(["--device", "cpu", "--transports", "stdio", "--sizes", "3", "--iterations", "3",
                 "--baseline", command, "--json", str(out_json)]) == 1
    err = capsys.readouterr().err
    assert complaint in err
    document = json.loads(out_json.read_text())
    assert [r["case"] for r in document["rows"]] == ["scan L=3"] and document["rows"][0]["iterations"] == 3
    assert len(document["failures"]) == 1 and complaint in document["failures"][0]
    if baseline == "wrong":
        assert [(r["results_agree"], r["baseline_over_bridge_ratio"]) for r in document["baseline"]] == [(False, None)]


def test_game_loop_bench_runs_end_to_end(tmp_path):
    """`python -m bench.game_loop` (issue 5's benchmark), tiny: every part runs and its JSON
    carries what the README quotes, with numbers that belong to this run."""
    out = tmp_path / "game_loop.json"
    proc = run_marked([sys.executable, "-m", "bench.game_loop", "--steps", "30", "--windows", "2",
                       "--repeats", "2", "--rows", "1", "--callers", "3", "--seconds", "0.2",
                       "--rounds", "1", "--lanes", "stdio,unix,zmq", "--delays", "0", "--json", str(out)],
                      timeout_s=300, cwd=Path(__file__).resolve().parent.parent)
    assert proc.failure() is None, proc.failure()
    results = json.loads(out.read_text())["results"]
    loop = results["game_loop"]
    assert len(loop["runs"]) == 2 and loop["backend"] == "cpu"
    for run in loop["runs"]:
        assert (run["step_round_trip"]["n"] == run["step_round_trip_back_to_back"]["n"]
                == run["step_round_trip_python_client"]["n"] == 30)
        assert 0 < run["step_round_trip"]["min_us"] <= run["step_round_trip"]["p50_us"]
        # 32x512x16 f32: x and dt (64 KiB each) plus B and C in, y (64 KiB) out, per frame.
        assert 3 * 65536 < run["step_bytes_per_frame"] < 4 * 65536
        assert 50 < run["bytes_ratio"] < 70
        assert run["step_stages_p50_us"]["kernel_us"] > 0
        echo = run["step_echo_floor"]
        assert "skipped" in echo or echo["n"] == 30
        assert run["step_p50_over_echo"] == (
            None if "skipped" in echo else pytest.approx(run["step_round_trip"]["p50_us"] / echo["p50_us"]))
    assert [c["lane"] for c in results["concurrent"]] == ["stdio", "unix", "zmq"]
    for concurrent in results["concurrent"]:
        lane = concurrent["lane"]
        assert set(concurrent["runs"]) == {"batched", "unbatched", "batched_general", "unbatched_general"}
        for kind, runs in concurrent["runs"].items():
            (run,) = runs
            # Every caller stepped: on its own connection too (unix, zmq), where each put its A.
            assert len(run["per_caller_steps"]) == 3 and min(run["per_caller_steps"]) > 0, (lane, kind)
            # The throughput is the callers' own steps over the run, which lasted --seconds at least.
            assert sum(run["per_caller_steps"]) / run["steps_per_s"] >= 0.2, (lane, kind)
            if "--max-batch" in concurrent["servers"][kind]:
                # The baselines really are unbatched: every launch served one 1-row request.
                assert run["mean_batch_requests"] == 1.0 and run["mean_batch_rows"] == 1, (lane, kind)
        # One round: each server's median is its one run, and the speedups are theirs.
        steps_per_s = {kind: runs[0]["steps_per_s"] for kind, runs in concurrent["runs"].items()}
        assert concurrent["median_steps_per_s"] == steps_per_s
        assert concurrent["speedup"] == pytest.approx(steps_per_s["batched"] / steps_per_s["unbatched"])
        assert concurrent["general_path_speedup"] == pytest.approx(
            steps_per_s["batched_general"] / steps_per_s["unbatched_general"])
    (sweep,) = results["delay_sweep"]
    assert (sweep["max_delay_us"], sweep["callers"], sweep["rows"]) == (0, 3, 1) and sweep["median_steps_per_s"] > 0


def test_models_bench_runs_end_to_end(tmp_path):
    """`python -m bench.models` (issue 34's benchmark), tiny: every comparison runs in one run
    and the ratios are of its own numbers. (`--neighbour`'s spinning process: below.)"""
    pytest.importorskip("transformers", reason="transformers (a test dependency) is not installed")
    out = tmp_path / "models.json"
    proc = run_marked([sys.executable, "-m", "bench.models", "--frames", "25", "--batches", "1", "--archs", "mamba2",
                       "--json", str(out)], timeout_s=300, cwd=Path(__file__).resolve().parent.parent)
    assert proc.failure() is None, proc.failure()
    result = json.loads(out.read_text())
    assert result["neighbour"] is False
    (case,) = result["cases"]
    assert (case["arch"], case["batch"], case["model_step"]["n"]) == ("mamba2", 1, 25)
    for part in ("transformers_step", "old_way", "window_forward", "snapshot_restore_round_trips",
                 "rollback_two_requests", "rollback_one_request", "rollback_ring_requests",
                 "rollback_ring_one_request", "ring_frame_own_requests", "ring_frame_snapshot_into"):
        assert case[part]["p50_us"] > 0, part
    assert set(case["floors"]) == {"torch_op", "matrix_products", "stack_step_in_process", "matrices_from_memory"}
    assert case["floors"]["matrices_from_memory"]["bytes"] > 0
    assert case["ratios"]["step_over_transformers"] == pytest.approx(
        case["model_step"]["p50_us"] / case["transformers_step"]["p50_us"])
    assert case["ratios"]["old_way_over_step"] == pytest.approx(case["old_way"]["p50_us"] / case["model_step"]["p50_us"])
    assert case["ratios"]["rollback_ring_requests_over_one"] == pytest.approx(
        case["rollback_ring_requests"]["p50_us"] / case["rollback_ring_one_request"]["p50_us"])
    assert case["ratios"]["ring_own_requests_over_snapshot_into"] == pytest.approx(
        case["ring_frame_own_requests"]["p50_us"] / case["ring_frame_snapshot_into"]["p50_us"])
    assert "echo" in case or "echo_skipped" in case
    into = case["snapshot_into_restore"]
    assert into["snapshot_into_copy_us"] == pytest.approx(
        into["step_kernel_snapshot_into"]["p50_us"] - into["step_kernel_plain"]["p50_us"])
    assert into["snapshot_into_restore_server_us"] == pytest.approx(
        into["snapshot_into_copy_us"] + into["restore_server"]["p50_us"])
    if "echo" in case:
        assert case["echo_reading_matrices"]["p50_us"] > 0
        assert case["ratios"]["echo_reading_matrices_over_transformers"] == pytest.approx(
            case["echo_reading_matrices"]["p50_us"] / case["transformers_step"]["p50_us"])


def test_the_neighbour_spins_while_the_block_runs_and_is_gone_after():
    """`--neighbour` (bench.models, bench.model_step_ab): a process spinning on a core for the
    block, killed and reaped when it ends; none without the flag. The benches' smoke runs above
    go without it: a spinning process there would only take a core from the rest of the suite."""
    from bench.models import busy_neighbour

    with busy_neighbour(False) as neighbour:
        assert neighbour is None
    with busy_neighbour(True) as neighbour:
        with pytest.raises(subprocess.TimeoutExpired):
            neighbour.wait(timeout=0.2)
        with open(f"/proc/{neighbour.pid}/cmdline", "rb") as cmdline:
            assert b"while True: pass" in cmdline.read()
    assert neighbour.returncode is not None and gone_or_zombie(neighbour.pid)


def model_bench_case(tmp_path, module: str, arch: str) -> dict:
    """The one case of `python -m MODULE` (a bench.models.case_main bench) run tiny on `arch`:
    24 frames at batch 2."""
    pytest.importorskip("transformers", reason="transformers (a test dependency) is not installed")
    out = tmp_path / "cases.json"
    proc = run_marked([sys.executable, "-m", module, "--frames", "24", "--batches", "2", "--archs", arch,
                       "--json", str(out)], timeout_s=300, cwd=Path(__file__).resolve().parent.parent)
    assert proc.failure() is None, proc.failure()
    (case,) = json.loads(out.read_text())["cases"]
    assert (case["arch"], case["batch"]) == (arch, 2)
    return case


def test_model_dtype_ab_bench_runs_end_to_end(tmp_path):
    """`python -m bench.model_dtype_ab`, tiny: both dtypes' steps over the Port and the three
    in-process steps timed in one run, the ratios of its own numbers, and the bf16 model's outputs
    near the fp32 one's but not equal to them (two models were served, not one twice)."""
    case = model_bench_case(tmp_path, "bench.model_dtype_ab", "mamba2")
    port, local = case["over_the_port"], case["in_process"]
    for pacing in ("paced", "back_to_back"):
        assert port[pacing]["f32"]["n"] == port[pacing]["bf16"]["n"] == 4
        assert port[pacing]["ratio_p50"] == pytest.approx(port[pacing]["f32"]["p50_us"] / port[pacing]["bf16"]["p50_us"])
    assert 0 < port["bf16_max_relative_difference"] < 5e-2
    assert local["ratios_p50"]["bf16_composed_over_bf16_fused"] == pytest.approx(
        local["bf16_composed"]["p50_us"] / local["bf16_fused"]["p50_us"])


@pytest.mark.parametrize("arch, given, output", [
    pytest.param("mamba", "embeds", "hidden", id="backbone-embeds-to-hidden"),
    pytest.param("mamba2-lm", "tokens", "logits", id="lm-tokens-to-logits"),
])
def test_model_native_ab_bench_runs_end_to_end(tmp_path, arch, given, output):
    """`python -m bench.model_native_ab`, tiny: both servers' steps timed in one run (the bench
    itself fails when their outputs differ past fp32's error or a default server's step was not
    served natively), the ratios of its own numbers; a backbone and a causal LM."""
    case = model_bench_case(tmp_path, "bench.model_native_ab", arch)
    assert (case["input"], case["output"]) == (given, output)
    for pacing in ("paced", "back_to_back"):
        r = case[pacing]
        assert r["native"]["round_trip"]["n"] == r["general"]["round_trip"]["n"] == 4
        assert r["general_over_native_p50"] == pytest.approx(
            r["general"]["round_trip"]["p50_us"] / r["native"]["round_trip"]["p50_us"])
        assert r["native"]["server"]["p50_us"] >= r["native"]["kernel"]["p50_us"] > 0
    assert "echo" in case["paced"] or "echo_skipped" in case
    assert 0 <= case["max_relative_difference"] <= 1e-4


def test_model_step_ab_times_two_builds_of_one_revision(tmp_path):
    """`python -m bench.model_step_ab`, HEAD against HEAD, tiny: both builds' steps of the same
    model agree bit for bit, each pacing has both builds' times and the ratios are of its own
    numbers."""
    if "cpu" not in scan_kernels.available_backends():
        pytest.skip(f"the cpu backend is unavailable: {scan_kernels.unavailable_backends().get('cpu')}")
    from bench import model_step_ab

    out = tmp_path / "ab.json"
    assert model_step_ab.main(["--base", "HEAD", "--other", "HEAD", "--frames", "6", "--archs", "mamba,mamba2",
                               "--batches", "2", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["neighbour"] is False
    assert report["base"]["details"]["library"] != report["other"]["details"]["library"]
    assert [(c["arch"], c["batch"]) for c in report["cases"]] == [("mamba", 2), ("mamba2", 2)]
    for case in report["cases"]:
        assert case["max_relative_difference"] == 0.0
        for pacing in ("paced", "back_to_back"):
            timed = case[pacing]
            assert timed["base"]["n"] == timed["other"]["n"] == 6
            assert timed["ratio_p50"] == pytest.approx(timed["base"]["p50_us"] / timed["other"]["p50_us"])


@pytest.mark.parametrize("rollback, kind", [(0, "model_step"), (3, "rollback3")])
def test_server_ab_steps_both_servers_of_each_model_case_in_turns(tmp_path, rollback, kind):
    """`python -m bench.server_ab`, this checkout against itself, no blocks: each model-step case
    (each a rollback of 3 frames with --rollback-frames 3) has both servers' paced round trips, as
    many as asked, and ratios of its own medians."""
    pytest.importorskip("transformers")
    from bench import server_ab

    out = tmp_path / "ab.json"
    assert server_ab.main(["--baseline", str(ROOT), "--blocks", "0", "--model-steps", "4", "--rollback-frames",
                           str(rollback), "--model-step-cases", "mamba:1,mamba2:3", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert set(report["model_steps"]) == {f"{kind}_mamba_b1", f"{kind}_mamba2_b3"}
    for key, servers in report["model_steps"].items():
        assert servers["baseline"]["n"] == servers["this"]["n"] == 4
        assert report["this_over_baseline"][f"{key}_p50_us"] == pytest.approx(
            servers["this"]["p50_us"] / servers["baseline"]["p50_us"])
    assert "exphil_bridge_cost_p50_us" not in report["medians"]["this"]


@pytest.mark.parametrize("text", ["mamba3:1", "mamba:0", "mamba", "mamba:x"])
def test_server_ab_says_what_a_model_step_case_is(text, capsys):
    from bench import server_ab

    with pytest.raises(SystemExit):
        server_ab.main(["--baseline", str(ROOT), "--model-step-cases", text])
    assert "expected arch:batch" in capsys.readouterr().err


@pytest.mark.parametrize("bench_name", ["models", "model_native_ab", "model_dtype_ab", "model_graphs", "model_step_ab"])
@pytest.mark.parametrize("argv, message", [
    pytest.param(["--archs", "mamba,mamba1"],
                 ("argument --archs: expected comma-separated names from mamba, mamba2", "got 'mamba,mamba1'"),
                 id="arch"),
    pytest.param(["--batches", "1,0"],
                 ("argument --batches: expected comma-separated batch sizes of 1 or more, got '1,0'",), id="batch"),
])
def test_model_benches_refuse_an_arch_or_batch_they_cannot_build(bench_name, argv, message, capsys):
    """An arch name they do not know would be built as Mamba-2 and recorded under that name,
    a bad batch would fail after the cases before it ran: both refused before anything runs."""
    module = importlib.import_module(f"bench.{bench_name}")
    with pytest.raises(SystemExit) as exit_info:
        module.main([*argv, "--frames", "40"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert all(part in err for part in message), err


def test_model_native_ab_takes_its_causal_lm_archs(monkeypatch):
    """Its "-lm" archs (the backbones as causal LMs) are its own: the shared check refused them."""
    from bench import model_native_ab

    ran = []
    monkeypatch.setattr(model_native_ab, "run_case", lambda arch, batch, frames: ran.append(arch) or {})
    monkeypatch.setattr(model_native_ab, "report", lambda case: None)
    assert model_native_ab.main(["--archs", "mamba-lm,mamba2-lm", "--batches", "1", "--frames", "40"]) == 0
    assert ran == ["mamba-lm", "mamba2-lm"]


def test_backward_bench_runs_end_to_end(tmp_path):
    """`python -m bench.backward` (issue 35's benchmark) on its tiny case: every SIMD variant this
    CPU executes, torch autograd and the peak memory in one run, the ratios of its own numbers."""
    if "cpu" not in scan_kernels.available_backends():
        pytest.skip(f"the cpu backend is unavailable: {scan_kernels.unavailable_backends().get('cpu')}")
    out = tmp_path / "backward.json"
    proc = run_marked([sys.executable, "-m", "bench.backward", "--cases", "2x64x32x16", "--reps", "2",
                       "--torch-reps", "1", "--json", str(out)], timeout_s=300, cwd=Path(__file__).resolve().parent.parent)
    assert proc.failure() is None, proc.failure()
    (case,) = json.loads(out.read_text())["cases"]
    from scan_kernels.cpu import build

    assert set(case["variants"]) == {"cpu", *(f"cpu-{v.name}" for v in build.executable_variants())}
    cpu = case["variants"]["cpu"]
    assert cpu["backward_over_forward"] == pytest.approx(cpu["backward_ms"] / cpu["forward_ms"])
    assert case["ratios"]["torch_autograd_over_backward"] == pytest.approx(
        case["torch_autograd"]["backward_ms"] / cpu["backward_ms"])
    # The tiny case's C++ backward can rise no higher than its warm-up call did (its buffers come
    # back from the allocator), so only torch autograd's growth must show here.
    assert isinstance(case["cpu_peak_extra_bytes"], int) and case["cpu_peak_extra_bytes"] >= 0
    assert case["torch_autograd"]["peak_extra_bytes"] > 0


def test_backward_bench_times_the_triton_backward_as_on_a_gpu(tmp_path):
    """`python -m bench.backward --backends triton` (the path its `--device cuda` run takes) on
    Triton's interpreter, both kinds' smallest cases: the triton backward and forward timed,
    torch autograd beside them, the ratios of its own numbers, the run's device and backends
    recorded."""
    if "triton" not in scan_kernels.available_backends():
        pytest.skip(f"the triton backend is unavailable: {scan_kernels.unavailable_backends().get('triton')}")
    out = tmp_path / "backward.json"
    proc = run_marked([sys.executable, "-m", "bench.backward", "--backends", "triton", "--cases",
                       "1x8x16x4,ssd-1x16x2x8x4", "--reps", "1", "--torch-reps", "1", "--json", str(out)],
                      timeout_s=300, cwd=Path(__file__).resolve().parent.parent,
                      env={**os.environ, "TRITON_INTERPRET": "1"})
    assert proc.failure() is None, proc.failure()
    document = json.loads(out.read_text())
    assert (document["device"], document["backends"]) == ("cpu", ["triton"])
    assert [case["case"]["kind"] for case in document["cases"]] == ["scan", "ssd"]
    for case in document["cases"]:
        (name,) = case["variants"]
        row = case["variants"]["triton"]
        assert name == "triton" and row["forward_ms"] > 0 and row["backward_ms"] > 0
        assert case["ratios"]["torch_autograd_over_backward"] == pytest.approx(
            case["torch_autograd"]["backward_ms"] / row["backward_ms"])
        assert case["ratios"]["backward_over_forward"] == pytest.approx(row["backward_ms"] / row["forward_ms"])


def test_gpu_checks_script_parses_and_refuses_a_machine_without_a_gpu(tmp_path):
    """bench/gpu_checks.sh, the one run a lent GPU is given: bash reads all of it, and without a
    CUDA device it stops before any part, saying why (exit 2). With one, only the parse is
    checked here: the script's parts are the GPU run itself."""
    script = Path(__file__).resolve().parent.parent / "bench" / "gpu_checks.sh"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    import torch

    if torch.cuda.is_available():
        return
    done = subprocess.run(["bash", str(script), str(tmp_path / "out")], capture_output=True, text=True, timeout=120,
                          cwd=script.parent.parent, env={**os.environ, "PYTHON": sys.executable})
    assert done.returncode == 2 and "no torch that sees a CUDA device" in done.stderr, done.stderr
    assert list((tmp_path / "out").iterdir()) == []


def test_varlen_bench_times_packed_against_per_sequence_calls(tmp_path):
    """`python -m bench.varlen` on its tiny case, in this process: the packed call, the
    per-sequence calls and the padded batch timed, and both ways of the backward, their ratios
    of its own numbers, and the two ways' outputs and gradients within float32 rounding."""
    if "cpu" not in scan_kernels.available_backends():
        pytest.skip(f"the cpu backend is unavailable: {scan_kernels.unavailable_backends().get('cpu')}")
    from bench import varlen

    out = tmp_path / "varlen.json"
    assert varlen.main(["--cases", "tiny", "--reps", "2", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    (case,) = report["cases"]
    assert report["benchmark"] == "varlen" and report["simd"] == scan_kernels.backend_details()["cpu"]["simd"]
    assert case["steps"] == sum(case["lengths"]) and len(case["lengths"]) == case["case"]["sequences"]
    assert case["ratios"]["per_sequence_over_packed"] == pytest.approx(case["per_sequence_ms"] / case["packed_ms"])
    assert case["ratios"]["padded_over_packed"] == pytest.approx(case["padded_ms"] / case["packed_ms"])
    assert case["ratios"]["backward_per_sequence_over_packed"] == pytest.approx(
        case["backward_per_sequence_ms"] / case["backward_packed_ms"])
    assert 0 <= case["max_abs_difference"] < 1e-4 and 0 <= case["max_gradient_difference"] < 1e-4


@pytest.mark.parametrize("name", sorted(
    f"bench.{path.stem}" for path in (Path(__file__).resolve().parent.parent / "bench").glob("*.py")
    if path.stem != "__init__") + ["bridge.bench.__main__", "bridge.bench.exphil_standin"])
def test_each_bench_help_says_its_first_paragraph_whole(name, capsys):
    """`--help` opens with the module's first paragraph, every word of it (argparse may wrap it
    anew): a description cut at a line's end stops mid-sentence."""
    module = importlib.import_module(name)
    with pytest.raises(SystemExit) as exit_info:
        module.main(["--help"])
    assert exit_info.value.code == 0
    first_paragraph = " ".join(module.__doc__.split("\n\n")[0].split())
    assert first_paragraph in " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize("bench_name, argv, messages", [
    pytest.param("backward", ["--cases", "exphil,pigeon"], ("--cases: expected names from exphil, ", "got 'pigeon'"),
                 id="backward-case"),
    pytest.param("backward", ["--reps", "0"], ("--reps: expected at least 1, got 0",), id="backward-reps"),
    pytest.param("backward", ["--torch-reps", "0"], ("--torch-reps: expected at least 1, got 0",),
                 id="backward-torch-reps"),
    pytest.param("varlen", ["--cases", "tiny,pigeon"], ("--cases: expected names from exphil-agents, ", "got 'pigeon'"),
                 id="varlen-case"),
    pytest.param("varlen", ["--reps", "0"], ("--reps: expected at least 1, got 0",), id="varlen-reps"),
    pytest.param("exp_rate", ["--simd", "pigeon"], ("--simd: SIMD variant 'pigeon': expected one of",), id="exp-simd"),
    pytest.param("exp_rate", ["--simd", "avx2"], ("--simd: SIMD variant avx2: this CPU cannot execute it",),
                 id="exp-simd-not-here"),
    pytest.param("exp_rate", ["--seconds", "0"], ("--seconds: expected a finite duration above 0, got 0.0",),
                 id="exp-seconds"),
    pytest.param("exp_rate", ["--threads", "0"], ("--threads: expected at least 1, got 0",), id="exp-threads"),
    pytest.param("kernels", ["--backends", "torch,cpux", "--cases", "1x4x16x4", "--quick"],
                 ("--backends: expected names from reference, torch, cpu, triton, got 'cpux'",), id="kernels-backend"),
    pytest.param("kernels", ["--backends", "torch", "--simd", "avx2,pigeon", "--cases", "1x4x16x4", "--quick"],
                 ("--simd: expected 'all' or names from ", "got 'pigeon'"), id="kernels-simd"),
])
def test_kernel_benches_refuse_what_they_cannot_run(bench_name, argv, messages, capsys, monkeypatch):
    """A case name or SIMD variant they do not have (or this CPU does not execute: a CPU with
    only the baseline's instructions here), no repetitions, no time: refused before anything
    is built or timed, the message naming what was expected and what came."""
    from scan_kernels.cpu import build

    monkeypatch.setattr(build, "_cpu_flags", lambda: {"sse2"})
    module = importlib.import_module(f"bench.{bench_name}")
    with pytest.raises(SystemExit) as exit_info:
        module.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert all(message in err for message in messages), err


@pytest.mark.parametrize("bench_name, flag", [
    ("metrics_cost", "--records"), ("metrics_cost", "--rounds"), ("metrics_cost", "--steps"),
    ("exit_guard", "--rounds"), ("triton_host", "--rounds"), ("triton_host", "--calls"),
    ("game_loop", "--steps"), ("game_loop", "--repeats"), ("game_loop", "--callers"), ("game_loop", "--rounds"),
])
@pytest.mark.parametrize("value", ["0", "-3", "two"])
def test_benches_refuse_a_count_of_none(bench_name, flag, value, capsys):
    """Rounds, calls, steps or records of none left nothing to take a median of: the run went
    through (servers started, children built) and raised at its end (found in review)."""
    module = importlib.import_module(f"bench.{bench_name}")
    with pytest.raises(SystemExit) as exit_info:
        module.main([flag, value])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    expected = "expected a whole number of at least 1, got 'two'" if value == "two" else f"expected at least 1, got {value}"
    assert f"{flag}: " in err and expected in err, err


def test_ssd_step_bench_runs_end_to_end(tmp_path):
    """`python -m bench.ssd_step` (Mamba-2 steps, native path against --no-native-step), tiny:
    both servers in one run, each stepping the way its mode says, the ratios of its own numbers."""
    if "cpu" not in scan_kernels.available_backends():
        pytest.skip(f"the cpu backend is unavailable: {scan_kernels.unavailable_backends().get('cpu')}")
    out = tmp_path / "ssd_step.json"
    proc = run_marked([sys.executable, "-m", "bench.ssd_step", "--steps", "20", "--rounds", "1", "--json", str(out)],
                      timeout_s=300, cwd=Path(__file__).resolve().parent.parent)
    assert proc.failure() is None, proc.failure()
    results = json.loads(out.read_text())
    assert [r["served_natively"] for r in (results["runs"]["native"][0], results["runs"]["general"][0])] == [True, False]
    summary = results["summary"]
    assert results["runs"]["native"][0]["paced"]["n"] == results["runs"]["general"][0]["back_to_back"]["n"] == 20
    assert summary["general_over_native_paced_p50"] == pytest.approx(
        summary["general"]["paced_p50_us"] / summary["native"]["paced_p50_us"])


def test_triton_host_bench_times_both_trees_and_counts_launches(tmp_path):
    """`python -m bench.triton_host` with this checkout as its own baseline, tiny: each tree's
    child ran, every case has a host time of its own, and the launches are the ones ssd.py's
    plan makes (2 for one chunk, 3 with the final state, 4 for several chunks)."""
    pytest.importorskip("triton", reason="triton is not installed: the Triton backend's host time cannot be timed")
    root = Path(__file__).resolve().parent.parent
    out = tmp_path / "triton_host.json"
    proc = run_marked([sys.executable, "-m", "bench.triton_host", "--baseline", str(root), "--rounds", "1",
                       "--calls", "5", "--json", str(out)], timeout_s=300, cwd=root)
    assert proc.failure() is None, proc.failure()
    cases = {case["case"]: case for case in json.loads(out.read_text())["cases"]}
    launches = {name: case["this"]["launches"] for name, case in cases.items()}
    assert launches == {"scan exphil": 1, "state_update 32x512x16": 1, "ssd_scan exphil": 2,
                        "ssd_scan exphil, h0 and state": 3, "ssd_scan 130m": 4, "ssd_state_update 32x8x64x16": 1}
    for case in cases.values():
        assert case["baseline"]["launches"] == case["this"]["launches"]
        assert all(us > 0 for side in ("this", "baseline") for us in case[side]["rounds_us"])
        assert len(case["this"]["rounds_us"]) == len(case["baseline"]["rounds_us"]) == 1
        assert case["baseline_over_this"] == pytest.approx(case["baseline"]["host_us"] / case["this"]["host_us"])
        assert case["paired_ratio_median"] == pytest.approx(case["baseline"]["rounds_us"][0] / case["this"]["rounds_us"][0])


def test_triton_host_writes_its_figures_after_every_round(tmp_path, monkeypatch):
    """They came only once every round was done: a GPU run's part cut short by its limit kept
    nothing (found in review). A run stopped in its second round keeps its first."""
    from bench import triton_host

    children = []

    def child_run(tree, calls, device):
        children.append(tree)
        if len(children) > 1:
            raise RuntimeError("the part's limit ran out")
        return {"ssd_scan": {"call_us": 5.0, "launches": 2}}

    monkeypatch.setattr(triton_host, "child_run", child_run)
    out = tmp_path / "triton_host.json"
    with pytest.raises(RuntimeError):
        triton_host.main(["--rounds", "3", "--json", str(out)])
    document = json.loads(out.read_text())
    assert (document["rounds"], document["rounds_done"]) == (3, 1)
    assert document["cases"] == [{"case": "ssd_scan", "this": {"host_us": 5.0, "rounds_us": [5.0], "launches": 2}}]


def test_triton_host_times_a_tree_from_before_the_rename_by_its_own_package(tmp_path):
    """A baseline tree whose package is still `kernels` is timed by that package, not by this
    checkout's `scan_kernels`, which the editable install finds from any directory (found in
    review: the child imported `scan_kernels` whenever it could, so such a baseline timed this
    tree). The stand-in's every call makes 7 launches, which no real call makes."""
    from bench import triton_host

    common = tmp_path / "kernels" / "triton_kernels"
    common.mkdir(parents=True)
    (common / "__init__.py").write_text("")
    (common / "common.py").write_text("class Launch:\n    def __init__(self):\n        self.kernel = 'stand-in'\n\n"
                                      "    def run(self):\n        pass\n")
    (tmp_path / "kernels" / "__init__.py").write_text(
        "from .triton_kernels.common import Launch\n\n\n"
        "def _call(*args, **kwargs):\n    for _ in range(7):\n        Launch().run()\n\n\n"
        "selective_scan = selective_state_update = ssd_scan = ssd_state_update = _call\n")
    launches = {name: case["launches"] for name, case in triton_host.child_run(str(tmp_path), 1, "cpu").items()}
    assert set(launches.values()) == {7}, launches


def test_metrics_cost_bench_runs_end_to_end(tmp_path):
    """`python -m bench.metrics_cost` (issue 37's endpoint), tiny: both record timings, a served
    step and a scrape in one run, the ratio of its own numbers."""
    out = tmp_path / "metrics_cost.json"
    proc = run_marked([sys.executable, "-m", "bench.metrics_cost", "--records", "2000", "--rounds", "2", "--steps", "20",
                       "--json", str(out)], timeout_s=300, cwd=Path(__file__).resolve().parent.parent)
    assert proc.failure() is None, proc.failure()
    results = json.loads(out.read_text())["results"]
    assert len(results["record_ns"]["off"]) == len(results["record_ns"]["on"]) == 2
    assert results["extra_over_step_server_us_p50"] == pytest.approx(
        results["extra_per_request_us"] / results["step_server_us"]["p50_us"])
    assert results["step_server_us"]["n"] == 20 and results["scrape"]["n"] == 2


def test_transports_bench_runs_end_to_end(tmp_path):
    """`python -m bench.transports`, tiny: every lane's rows and the many-clients runs come back
    whole (nothing lost, duplicated or misrouted), with ratios and a throughput from this run's
    own numbers."""
    from bench.transports import ROWS
    from bridge.bench.floors import floor_missing

    missing = {lane: floor_missing(lane) for lane, _ in ROWS}
    if any(missing.values()):
        pytest.skip(f"bench.transports needs every lane's echo floor: {missing}")
    out = tmp_path / "transports.json"
    proc = run_marked([sys.executable, "-m", "bench.transports", "--iterations", "2", "--clients", "3",
                       "--requests", "30", "--server-arg=--threads=1", "--json", str(out)], timeout_s=300,
                      cwd=Path(__file__).resolve().parent.parent)
    assert proc.failure() is None, proc.failure()
    result = json.loads(out.read_text())["results"]
    # what the server ran with, which the machine info (the bench process's) does not say
    assert result["server_args"] == ["--threads=1"] and result["server_info"]["devices"][0]["threads"] == 1
    assert [(r["case"], r["lane"]) for r in result["rows"]] == [
        (case, lane) for case in ("exphil", "step") for lane, _ in ROWS]
    for row in result["rows"]:
        assert row["iterations"] == (2 if row["case"] == "exphil" else 10)
        assert row["ipc_over_echo"] == pytest.approx(row["ipc"]["p50_us"] / row["echo"]["p50_us"])
        assert row["bridge_cost_over_echo"] == pytest.approx(row["bridge_cost"]["p50_us"] / row["echo"]["p50_us"])
        assert 0 < row["ipc"]["p50_us"] < row["round_trip"]["p50_us"]
        # The Python client library is timed beside the lean client on the stdio ExPhil row only.
        if (row["case"], row["lane"]) == ("exphil", "stdio"):
            assert row["python_client_round_trip"]["n"] == 2 and row["python_client_round_trip"]["p50_us"] > 0
        else:
            assert "python_client_round_trip" not in row
    assert sorted(c["lane"] for c in result["concurrency"]) == ["unix", "zmq-ipc"]
    for run in result["concurrency"]:
        assert (run["lost"], run["duplicated"], run["misrouted"]) == (0, 0, 0), run
        assert run["requests_per_s"] == pytest.approx(30 / run["seconds"])
        assert run["latency"]["n"] == 30


def test_soak_bench_runs_end_to_end(tmp_path):
    """`python -m bench.soak`, tiny: it exits 0 (every round's checks held: every reply matched,
    every result checked, nothing left held) and its JSON carries what the docs quote: every
    lane served the whole mix, every malformed frame kind was answered with its code, clients
    were killed with requests in flight. The memory rule is left to the long runs (one round
    of warm-up here), and tested by itself below."""
    out = tmp_path / "soak.json"
    proc = run_marked([sys.executable, "-m", "bench.soak", "--rounds", "3", "--steps", "3", "--churn", "2",
                       "--kills", "1", "--rss-bound-kib", str(1 << 30), "--json", str(out)], timeout_s=300,
                      cwd=Path(__file__).resolve().parent.parent)
    assert proc.failure() is None, proc.failure()
    result = json.loads(out.read_text())["results"]
    assert [s["round"] for s in result["rounds"]] == [0, 1, 2] and result["rounds_run"] == 3
    counts = [s["requests"] for s in result["rounds"]]
    assert 0 < counts[0] < counts[1] < counts[2] == result["requests"]
    assert all(s["rss_kB"] > 0 and s["rss_peak_kB"] >= s["rss_kB"] and s["fds"] > 0 and s["threads"] > 0
               for s in result["rounds"])
    # The protocol's codes a client can provoke, each answered on every lane.
    provoked = {"decode_error", "invalid_request", "unsupported_version", "unknown_op", "missing_argument",
                "invalid_argument", "unknown_dtype", "tensor_size_mismatch", "shape_mismatch", "unknown_session",
                "unknown_handle", "unknown_model", "unknown_snapshot", "invalid_checkpoint", "path_not_allowed",
                "limit_exceeded", "frame_too_large", "legacy"}
    for lane, served in result["lanes"].items():
        assert served["requests_with_ids"] == served["replies_matched"] > 0, lane
        assert provoked <= set(served["malformed_by_code"]), (lane, served["malformed_by_code"])
        assert served["replies_without_id"] > 0, lane
    assert result["lanes"]["zmq"]["malformed_by_code"]["zmq_peer_dropped"] == 3
    for lane in ("unix", "zmq"):
        killed = result["killed_clients"][lane]
        assert killed["clients"] == 3 and killed["sent"] > 0 and killed["unanswered_when_killed"] >= 0, killed
    assert result["results_compared_bit_for_bit"] > 0
    first, last = result["rounds"][0], result["rounds"][-1]
    assert result["warmup_rounds"] == 1 and result["rss_kB_after_warmup"] == first["rss_kB"]
    assert result["rss_growth_kB"] == last["rss_kB"] - first["rss_kB"]
    assert result["fds"] == [first["fds"], first["fds"], last["fds"]]
    assert result["threads"] == [first["threads"], first["threads"], last["threads"]]


def test_transports_bench_measures_only_what_is_asked(tmp_path):
    """`--lanes stdio --cases exphil --clients 0`: one row, no many-clients run, no other lane
    opened (the stdio ExPhil measurement on its own)."""
    from bridge.bench.floors import floor_missing

    if floor_missing("stdio"):
        pytest.skip(floor_missing("stdio"))
    out = tmp_path / "transports.json"
    proc = run_marked([sys.executable, "-m", "bench.transports", "--lanes", "stdio", "--cases", "exphil",
                       "--iterations", "2", "--clients", "0", "--json", str(out)], timeout_s=300,
                      cwd=Path(__file__).resolve().parent.parent)
    assert proc.failure() is None, proc.failure()
    assert "goal: big request on stdio: bridge cost" in proc.stdout
    result = json.loads(out.read_text())["results"]
    assert [(r["case"], r["lane"]) for r in result["rows"]] == [("exphil", "stdio")]
    assert result["concurrency"] == []


@pytest.mark.parametrize("argv, message", [
    pytest.param(["--lanes", "pigeon"], "--lanes: expected names from stdio,unix,zmq-ipc,zmq-tcp", id="lane"),
    pytest.param(["--cases", ""], "--cases: expected names from exphil,step", id="no-case"),
])
def test_transports_bench_says_what_it_expected(argv, message, capsys):
    from bench.transports import main

    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


# --- the package boundary ----------------------------------------------------------------------

ROOT = Path(__file__).resolve().parent.parent
INSTALLED = ("bridge", "protocol", "scan_kernels")  # sorted, as the wheel lists them


def _imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in a file; a relative import counts as a
    module of the file's own package, never as the top-level `bench`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
    return found


def test_installed_packages_never_import_the_top_level_bench():
    offenders = [f"{path.relative_to(ROOT)}:{line}: {module}"
                 for package in INSTALLED for path in sorted((ROOT / package).rglob("*.py"))
                 for line, module in _imported_modules(path)
                 if module == "bench" or module.startswith("bench.")]
    assert not offenders, "bench/ is repo-only scripts, not installed: " + "; ".join(offenders)


def test_the_distribution_holds_bridge_scan_kernels_and_protocol_only():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]
    # What setuptools' packages.find takes from the checkout (namespace packages unless switched off).
    from setuptools import find_namespace_packages, find_packages

    find = dict(config["packages"]["find"])
    finder = find_namespace_packages if find.pop("namespaces", True) else find_packages
    find.pop("where", None)
    found = finder(str(ROOT), **find)
    assert sorted({name.split(".")[0] for name in found}) == list(INSTALLED)
    assert "bridge.bench" in found
    # The echo floors' C sources ship with bridge.bench, which builds them on demand.
    echo = sorted(p.relative_to(ROOT / "bridge").as_posix() for p in (ROOT / "bridge" / "bench" / "echo").iterdir())
    patterns = config["package-data"]["bridge"]
    assert echo and all(any(Path(name).match(pattern) for pattern in patterns) for name in echo), (echo, patterns)


def test_soak_release_check_names_what_is_still_held():
    from bench.soak import Broken, check_released

    nothing = dict.fromkeys(("sessions", "pool_bytes", "model_bytes", "snapshot_bytes", "handles", "handle_bytes",
                             "models", "snapshots"), 0)
    check_released(1, nothing)
    for gauge in nothing:
        with pytest.raises(Broken, match=f"round 2: still held .*'{gauge}': 1"):
            check_released(2, {**nothing, gauge: 1})


def test_soak_flat_rule_names_what_grew():
    """After warm-up: resident memory within the bound of the warm-up's end, descriptors and
    threads no more than then (this process stands in for the server)."""
    from bench.soak import Broken, flat_usage, open_fds, process_usage, thread_names

    pid = os.getpid()
    now = process_usage(pid)
    warm = {**now, "round": 4}
    threads = thread_names(pid)
    flat_usage(7, pid, {**warm, "rss_kB": now["rss_kB"] + 100}, open_fds(pid), threads, 1024, settle_s=0)
    with pytest.raises(Broken, match=r"round 7: resident memory .* above the end of warm-up \(round 4\); "
                                     r"the bound is 1024 kB"):
        flat_usage(7, pid, {**warm, "rss_kB": now["rss_kB"] - 4096}, open_fds(pid), threads, 1024, settle_s=0)
    before = open_fds(pid)
    with open(os.devnull):
        with pytest.raises(Broken, match=r"round 7: .* fds .*more than at the end of warm-up.*-> /dev/null"):
            flat_usage(7, pid, {**warm, "threads": 1 << 20}, before, threads, 1 << 20, settle_s=0)
    # One thread fewer at the end of warm-up: the message names the kind that grew.
    name = next(iter(threads))
    with pytest.raises(Broken, match=rf"threads.*threads by name: \{{'{name}': 1\}}"):
        flat_usage(7, pid, {**warm, "threads": now["threads"] - 1, "fds": 1 << 20}, {},
                   threads - collections.Counter([name]), 1 << 20, settle_s=0)


def test_soak_results_must_repeat_bit_for_bit():
    """The first result under a name is checked against the reference given (within fp32
    tolerance); every later one must have its very bits."""
    from bench.soak import Broken, References

    refs = References()
    first = np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4)
    with pytest.raises(Broken, match="lane a: y: differs from the reference"):
        refs.check("y", first + 0.01, "lane a: y", expected=first)
    refs.check("y", first, "lane a: y", expected=first.astype(np.float64) + 1e-6)
    refs.check("y", first.copy(), "lane b: y")
    drifted = first.copy()
    drifted[2, 3] = np.nextafter(drifted[2, 3], np.float32(2))
    with pytest.raises(Broken, match="lane c: y: differs from the first y"):
        refs.check("y", drifted, "lane c: y")
    with pytest.raises(Broken, match="lane d: y: differs from the first y"):
        refs.check("y", first.astype(np.float64), "lane d: y")
    assert refs.compared == 3


def test_exp_rate_probe_times_the_kernels_exp(tmp_path):
    """bench.exp_rate builds its probe from the kernels' own source, in the baseline variant
    (every x86-64 and aarch64 CPU executes it), and reports a positive rate naming that variant."""
    from bench import exp_rate
    from scan_kernels.cpu import build

    variant = build.variant_named("baseline")
    rate, description = exp_rate.measure(exp_rate.compile_probe(variant, tmp_path), 1, 0.05)
    assert rate > 1e6, rate
    assert description.startswith("baseline"), description


def test_exit_guard_bench_times_kills_of_each_variant(tmp_path):
    """`python -m bench.exit_guard` for one round: a server with the guard, one without and a bare
    torch process each started, made ready, killed, its stdout's end of file timed."""
    out = tmp_path / "exit_guard.json"
    proc = run_marked([sys.executable, "-m", "bench.exit_guard", "--rounds", "1", "--json", str(out)],
                      timeout_s=300, cwd=Path(__file__).resolve().parent.parent)
    assert proc.failure() is None, proc.failure()
    doc = json.loads(out.read_text())
    variants = doc["variants"]
    assert set(variants) == {"server with the exit guard", "server --no-exit-guard", "import torch (no guard)"}
    for name, times in variants.items():
        assert times["n"] == 1 and len(times["ms"]) == 1 and times["ms"][0] > 0, name
    assert doc["median_ratio_without_over_with"] == pytest.approx(
        variants["server --no-exit-guard"]["ms"][0] / variants["server with the exit guard"]["ms"][0])
