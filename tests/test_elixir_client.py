"""The Elixir client's ExUnit suite (elixir_client/), run against this checkout's server.

`mix test` needs Elixir (Debian's `elixir` package, installed by `make system-deps`). Where mix
is missing the suite is skipped with the reason — except in CI (CI=true), where that fails.
A server that outlives `mix` (a test left it frozen, say) fails the run by name (tests/process_runs.py).

`mix test` is mostly waiting (servers and peer nodes starting, timeouts running out), and its
modules run one after another (they share server names and the node's distribution). So it runs
as two child suites, two VMs side by side, each on a part of the test files: the cluster's files
and the rest. They start early, beside the rest of the session (tests/conftest.py says when),
each in a build path of its own outside the project (no two `mix` runs compile into the same
files, and test_elixir_dependency sees the project's tree unchanged).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import tempfile

import pytest

from bridge.client import server_env
from process_runs import BackgroundRun, ProcessRun, run_marked

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROJECT = os.path.join(ROOT, "elixir_client")
# Generous: a `mix` run beside the rest of the session, plus compiling on a cold _build.
TIMEOUT_S = 600
# The ExUnit suites run beside the whole session: a clean clone on a 2-core AMD EPYC VM ran the
# cluster's files past 600 s while the sanitizer pass and the SIMD builds held both cores. A
# guard against a hang, as long as the sanitizer pass's.
EXUNIT_TIMEOUT_S = 1200


def mix_env(build_path: str | None = None) -> dict:
    """`mix`'s environment; `build_path` (MIX_BUILD_PATH) compiles into a directory of its own."""
    # server_env: this checkout first on PYTHONPATH, for the server the suite spawns.
    env = server_env()
    build = os.path.join(PROJECT, "_build")
    if build_path is not None:
        env["MIX_BUILD_PATH"] = build_path
    env.update({
        "MIX_ENV": "test",
        # Mix's home must be writable, and hex.pm is unreachable: the project has no deps.
        "MIX_HOME": os.path.join(build, "mix_home"),
        "HEX_HOME": os.path.join(build, "hex_home"),
        "HEX_OFFLINE": "1",
        # The interpreter running this suite has the server's dependencies.
        "PYTHON": sys.executable,
    })
    env.setdefault("LANG", "C.UTF-8")  # the BEAM warns and mangles output under a latin1 locale
    return env


def find_mix() -> str:
    """mix's path; skips with the reason where Elixir is missing, except in CI (CI=true)."""
    mix = shutil.which("mix")
    if mix is None:
        reason = ("mix (Elixir) is not installed: run `make system-deps` (Debian package elixir) "
                  "to run the Elixir client's suite")
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI: {reason}")
        print(reason, file=sys.stderr)
        pytest.skip(reason)
    return mix


def run_mix(args: list[str]) -> ProcessRun:
    """`mix ARGS` in elixir_client/; a server left running after mix exits fails the run."""
    return run_marked([find_mix(), *args], timeout_s=TIMEOUT_S, cwd=PROJECT, env=mix_env())


# The test files (under elixir_client/test/) of the cluster's part; every other file is in the
# rest. One VM ran the whole suite past TIMEOUT_S in CI; these parts take about as long as each other.
# Every file that starts `:peer` nodes (and makes its VM distributed) is here, so the rest's VM
# stays a plain one.
CLUSTER_TEST_FILES = ("cluster_test.exs", "cluster_peers_test.exs", "peers_test.exs",
                      "remote_callers_test.exs", "cluster_balancer_test.exs", "cluster_partition_test.exs",
                      "cluster_chaos_test.exs")


def exunit_parts() -> dict[str, list[str]]:
    """The test files of each `mix test` run, as paths relative to elixir_client/."""
    files = sorted(f for f in os.listdir(os.path.join(PROJECT, "test")) if f.endswith("_test.exs"))
    missing = set(CLUSTER_TEST_FILES) - set(files)
    if missing:
        raise FileNotFoundError(f"CLUSTER_TEST_FILES names test files that are not in "
                                f"elixir_client/test/: {sorted(missing)}")
    cluster = [f"test/{f}" for f in files if f in CLUSTER_TEST_FILES]
    rest = [f"test/{f}" for f in files if f not in CLUSTER_TEST_FILES]
    return {"the cluster's files": cluster, "the other files": rest}


def exunit_build_path(part: str) -> str:
    slug = "".join(c if c.isalnum() else "-" for c in part)
    return os.path.join(tempfile.gettempdir(), f"scan-bridge-exunit-build-{os.getpid()}-{slug}")


def exunit_command(part: str, files: list[str]):
    env = mix_env(exunit_build_path(part))
    return [shutil.which("mix"), "test", *files], {"timeout_s": EXUNIT_TIMEOUT_S, "cwd": PROJECT, "env": env}


# ExUnit's report of one failed test: "  1) test name (Module)", then lines indented under it.
EXUNIT_FAILURE_HEADER = re.compile(r"^\s+\d+\) (test|doctest) ")
EXUNIT_FAILURE_MAX_LINES = 80


def exunit_failure_reports(output: str) -> list[str]:
    """The failed tests' reports in a `mix test` output. ExUnit prints each as the test fails, in
    the middle of the run's logs, so a failure message showing the output's end can miss them."""
    lines = output.splitlines()
    reports = []
    for start, line in enumerate(lines):
        if not EXUNIT_FAILURE_HEADER.match(line):
            continue
        end = start + 1
        # the report ends where a line starts at column 0 again (a log line, the next dot)
        while end < len(lines) and end - start < EXUNIT_FAILURE_MAX_LINES and (
                not lines[end] or lines[end][0].isspace()):
            end += 1
        reports.append("\n".join(lines[start:end]).rstrip())
    return reports


EXUNIT_SUITES = {part: BackgroundRun(lambda part=part, files=files: exunit_command(part, files))
                 for part, files in exunit_parts().items()}
EXUNIT_SUITE_TEST = "test_exunit_suite_passes"


def start_background_runs(selected: set[str]) -> None:
    if EXUNIT_SUITE_TEST in selected and shutil.which("mix") is not None:
        for suite in EXUNIT_SUITES.values():
            suite.start()


def test_roundtrip_benchmark_runs(tmp_path):
    """`mix run bench/roundtrip.exs` end to end with a few iterations (its numbers are not
    judged here): it must keep working as the server and the echo floors change."""
    out = tmp_path / "elixir-roundtrip.json"
    run = run_mix(["run", "bench/roundtrip.exs", "--iterations", "2", "--step-iterations", "3",
                   "--rounds", "2", "--out", str(out)])
    if failure := run.failure("the Elixir round-trip benchmark"):
        pytest.fail(failure)
    doc = json.loads(out.read_text())
    results = doc["results"]
    assert {r["round"] for r in results} == {1, 2}
    assert len(doc["goals"]["per_round"]) == 2
    lanes = {(r["case"].split()[0], r["lane"]) for r in results}
    assert {("exphil", "port"), ("step", "port")} <= lanes, lanes
    for r in results:
        assert r["round_trip"]["p50_us"] > 0 and r["echo_floor"]["p50_us"] > 0, r["case"]
        for key in ("client_parts_p50_us", "client_parts_back_to_back_p50_us"):
            parts = r[key]
            assert set(parts) == {"encode_us", "decode_us", "process_hop_us"}, (key, parts)
            assert all(us > 0 for us in parts.values()), (r["case"], key, parts)


def test_models_benchmark_runs(tmp_path):
    """`mix run bench/models.exs` (a whole model's paced step from Elixir against the echo),
    tiny: it runs end to end and its ratios are of its own numbers."""
    out = tmp_path / "elixir-models.json"
    run = run_mix(["run", "bench/models.exs", "--frames", "25", "--batches", "1", "--archs", "mamba2",
                   "--out", str(out)])
    if failure := run.failure("the Elixir models benchmark"):
        pytest.fail(failure)
    (case,) = json.loads(out.read_text())["cases"]
    assert (case["arch"], case["batch"]) == ("mamba2", 1)
    for part in ("model_step", "echo", "snapshot_restore_round_trips", "ring_frame_own_requests",
                 "ring_frame_snapshot_into"):
        assert case[part]["p50_us"] > 0, part
    assert case["ratios"]["ring_own_requests_over_snapshot_into"] == pytest.approx(
        case["ring_frame_own_requests"]["p50_us"] / case["ring_frame_snapshot_into"]["p50_us"])


def test_cluster_benchmark_runs(tmp_path):
    """`mix run bench/cluster.exs --quick` (three peer nodes, one server each: throughput by
    member count, failover of a killed server and of a stopped node, checkpoint cost) end to end;
    its structure is checked here, not its numbers."""
    out = tmp_path / "cluster.json"
    run = run_mix(["run", "bench/cluster.exs", "--quick", "--out", str(out)])
    if failure := run.failure("the Elixir cluster benchmark"):
        pytest.fail(failure)
    doc = json.loads(out.read_text())
    assert {"machine", "commit", "settings", "method", "note", "results", "goals"} <= set(doc)
    assert doc["settings"]["quick"] is True and doc["settings"]["schedulers_online"] > 0
    results = doc["results"]
    rows = results["throughput"]["by_members"]
    assert [row["members"] for row in rows] == [1, 2, 3]
    assert all(row["calls_per_s"] > 0 and row["ratio_vs_1"] > 0 for row in rows), rows
    assert results["throughput"]["single_call"]["p50_us"] > 0
    for key in ("failover_kill", "failover_node_stop"):
        failover = results[key]
        assert failover["correct"] is True, key
        assert failover["samples"] > 0 and failover["failover"]["p99_us"] > 0, key
        assert failover["since_kill"]["detected"]["p50_us"] > 0, key
        assert failover["since_kill"]["rebuilt"]["p50_us"] > 0, key
        assert failover["replayed_frames"]["max"] >= 0 and failover["rerun_frames"]["max"] >= 0, key
        assert failover["others_latency_before"]["p50_us"] > 0, key
        for sample in (s for r in failover["rounds"] for s in r["samples"]):
            assert sample["failover_us"] > 0 and sample["replayed_from"] == "trace", (key, sample)
    assert results["exit_floor"]["p50_us"] > 0
    cost = results["checkpoint_cost"]
    for setting in ("nil", "10", "2"):
        assert cost["by_setting"][setting]["p50_us"] > 0 and cost["by_setting"][setting]["mean_us"] > 0
    for setting in ("10", "2"):
        assert cost["cost_vs_nil"][setting]["mean_ratio"] > 0, setting
    assert cost["export_round_trip"]["p50_us"] > 0 and cost["open_with_state"]["p50_us"] > 0
    hop = cost["keeper_hop"]
    assert hop["cluster_model_step"]["p50_us"] > 0 and hop["direct_model_step"]["p50_us"] > 0
    rollback = results["rollback"]
    for op in ("snapshot", "restore", "fork"):
        for way in ("cluster", "direct"):
            assert rollback[f"{way}_{op}"]["p50_us"] > 0, (way, op)
    assert all(n > 0 for n in results["trace_patterns_matched"].values()), results["trace_patterns_matched"]
    for name, goal in doc["goals"].items():
        assert {"measured", "target", "met"} <= set(goal) and isinstance(goal["met"], bool), name


def test_exunit_files_that_start_peer_nodes_are_in_the_clusters_part():
    # a file that starts :peer nodes makes its VM distributed: such files share the cluster part
    def starts_peers(path: str) -> bool:
        with open(os.path.join(PROJECT, path)) as source:
            text = source.read()
        return ":peer.start" in text or "Peers." in text

    starting_peers = [path for path in exunit_parts()["the other files"] if starts_peers(path)]
    assert starting_peers == [], f"start :peer nodes but are not in CLUSTER_TEST_FILES: {starting_peers}"


def test_exunit_failure_reports_are_found_among_the_logs():
    output = "\n".join([
        "..",
        "09:35:43.188 [warning] 'global' at node :a requested disconnect from node :b",
        "",
        "  1) test a frozen member's session moves (ScanBridge.ClusterTest)",
        "     test/cluster_test.exs:120",
        "     Assertion with == failed",
        "",
        "     left:  1",
        "     right: 2",
        "     stacktrace:",
        "       test/cluster_test.exs:131: (test)",
        "",
        "09:35:56.730 [warning] scan-bridge: a member gives model name \"tiny\" up",
        ".",
        "  2) doctest ScanBridge.open/2 (3) (ScanBridge.DocTest)",
        "     lib/scan_bridge.ex:40",
        "",
        "Finished in 1.0 seconds",
    ])
    reports = exunit_failure_reports(output)
    assert [report.splitlines()[0].strip() for report in reports] == [
        "1) test a frozen member's session moves (ScanBridge.ClusterTest)",
        "2) doctest ScanBridge.open/2 (3) (ScanBridge.DocTest)"]
    assert reports[0].endswith("test/cluster_test.exs:131: (test)")
    assert "right: 2" in reports[0] and "[warning]" not in reports[0]
    assert reports[1].endswith("lib/scan_bridge.ex:40")
    assert exunit_failure_reports("....\nFinished in 1.0 seconds\n84 tests, 0 failures") == []


# Last in the file: by then the child suites have had the others' time to run.
def test_exunit_suite_passes():
    find_mix()
    failures = []
    for part, suite in EXUNIT_SUITES.items():
        try:
            run = suite.result()
        finally:
            shutil.rmtree(exunit_build_path(part), ignore_errors=True)
        print(f"`mix test` on {part}:\n{run.output}")
        if failure := run.failure(f"`mix test` on {part} in elixir_client/",
                                  exunit_failure_reports(run.stdout)):
            failures.append(failure)
    if failures:
        pytest.fail("\n\n".join(failures))
