"""Runs harnesses, one child process each (fuzz.child), and reads what libFuzzer reports.

Each run reads three corpora: the golden vectors of protocol/vectors (`seeds()` of the harness,
written to a scratch directory), the committed corpus fuzz/corpus/<harness>/ (inputs the fuzzer
found that add coverage beyond the vectors), and the output corpus, where new inputs go (a
scratch directory unless one is given). A finding -- a crash, a sanitizer report, an uncaught
exception, a timeout, running out of memory -- ends that harness's run; its input is kept in
build/fuzz/findings/<harness>/ and the result names it.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from hashlib import sha1
from pathlib import Path

from . import HARNESSES
from .child import ARGV0_ENV, INFO_PREFIX, UNAVAILABLE_EXIT, UNAVAILABLE_PREFIX, module_name
from .tally import STATS_PREFIX

ROOT = Path(__file__).resolve().parents[1]
CORPUS_DIR = Path(__file__).resolve().parent / "corpus"
FINDINGS_DIR = ROOT / "build" / "fuzz" / "findings"
LOGS_DIR = ROOT / "build" / "fuzz" / "logs"
# libFuzzer's per-input limits: an input running longer is a finding (a hang), and so is a
# process growing past this (a leak, or an allocation the input sized).
TIMEOUT_PER_INPUT_S = 25
RSS_LIMIT_MB = 4096
# The committed corpus of a harness stays within this many bytes (the smallest inputs of the
# merged set kept first): it only saves a run the time to find again what they cover.
CORPUS_BUDGET_BYTES = 40_000
_ARTIFACT_KINDS = ("crash", "timeout", "oom", "leak")
# What a failing run prints, to name a finding whose artifact says little.
_SIGNATURES = (("AddressSanitizer", r"ERROR: AddressSanitizer: [^\n]*"),
               ("UndefinedBehaviorSanitizer", r"runtime error: [^\n]*"),
               # \w*: the harnesses' own Finding, which atheris prints bare ("Finding: ..."), too
               ("Python exception", r"=== Uncaught Python exception: ===\n(?:.*\n)*?(\w*(?:Error|Exception|Finding)[^\n]*)"),
               ("deadly signal", r"ERROR: libFuzzer: deadly signal"),
               ("timeout", r"ERROR: libFuzzer: timeout[^\n]*"),
               ("out of memory", r"ERROR: libFuzzer: out-of-memory[^\n]*"))


def harness_module(name: str):
    """A named harness's module (fuzz.<name>), or the module of that dotted name."""
    return importlib.import_module(module_name(name))


def native_plan(verbose: bool = False):
    """The native step harness's build (fuzz.native_build.plan), built now if need be."""
    from . import native_build

    return native_build.plan(verbose)


def _child_env(name: str, scratch: Path, say, extra_env: dict | None) -> tuple[dict, dict]:
    """(environment, what it runs with) for a harness's process."""
    env = {**os.environ, **(extra_env or {})}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(ROOT), env.get("PYTHONPATH"))))
    facts = {}
    if name == "native_step" or getattr(harness_module(name), "NATIVE_BUILD", False):
        from .native_build import PLAN_ENV

        plan = native_plan()
        facts["sanitized"] = plan.sanitized
        if plan.sanitized:
            env.update(plan.env)
        else:
            say(f"native_step: no sanitized build ({plan.reason}); fuzzing the server's gcc build instead, "
                "without ASan, UBSan or C++ coverage (reads past the frame still fault on guard pages)")
            env[PLAN_ENV] = "gcc:" + plan.reason
            facts["fallback_reason"] = plan.reason
    # libFuzzer runs its own command line again for -merge: a script that is that command.
    wrapper = scratch / "harness"
    wrapper.write_text(f"#!/bin/sh\nexec '{sys.executable}' -m fuzz.child {name} \"$@\"\n")
    wrapper.chmod(0o755)
    env[ARGV0_ENV] = str(wrapper)
    return env, facts


def _write_units(directory: Path, units) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for unit in units:
        (directory / sha1(unit).hexdigest()).write_bytes(unit)


def _parse(output: str) -> dict:
    """What libFuzzer and the harness printed: executions, new units, peak memory, the
    harness's FUZZ-INFO and last FUZZ-STATS, and the findings' signatures."""
    found = {}
    for key, pattern in (("executions", r"stat::number_of_executed_units: (\d+)"),
                         ("new_units", r"stat::new_units_added: (\d+)"),
                         ("peak_rss_mb", r"stat::peak_rss_mb: (\d+)")):
        match = re.search(pattern, output)
        if match:
            found[key] = int(match.group(1))
    if "executions" not in found:
        # No final stats (the process died): the last progress line's count.
        counts = re.findall(r"^#(\d+)\s", output, re.M)
        found["executions"] = int(counts[-1]) if counts else 0
    unavailable = [line for line in output.splitlines() if line.startswith(UNAVAILABLE_PREFIX)]
    found["unavailable"] = unavailable[-1][len(UNAVAILABLE_PREFIX):] if unavailable else None
    info = [line for line in output.splitlines() if line.startswith(INFO_PREFIX)]
    found["info"] = json.loads(info[-1][len(INFO_PREFIX):]) if info else {}
    stats = [line for line in output.splitlines() if line.startswith(STATS_PREFIX)]
    found["stats"] = json.loads(stats[-1][len(STATS_PREFIX):]) if stats else {}
    found["signatures"] = []
    for what, pattern in _SIGNATURES:
        match = re.search(pattern, output)
        if match:
            found["signatures"].append(f"{what}: {match.group(match.lastindex or 0).strip()}")
    return found


def run_harness(name: str, *, runs: int | None = None, seconds: int | None = None, corpus: str | Path | None = None,
                seed: int | None = None, minimize: bool = False, verbose: bool = False, say=print,
                env: dict | None = None) -> dict:
    """One bounded run of harness `name` (or of the harness module of that dotted name, with
    `env` added to its process's environment): at most `runs` executions and `seconds` of
    fuzzing (either or both; neither is a run until a finding). Returns its result."""
    harness = harness_module(name)
    scratch = Path(tempfile.mkdtemp(prefix=f"fuzz-{name}-"))
    try:
        env, facts = _child_env(name, scratch, say, env)
        seeds = scratch / "seeds"
        _write_units(seeds, harness.seeds())
        output_corpus = Path(corpus) if corpus is not None else scratch / "corpus"
        output_corpus.mkdir(parents=True, exist_ok=True)
        committed = CORPUS_DIR / name if name in HARNESSES else scratch / "no committed corpus"
        artifacts = scratch / "artifacts"
        artifacts.mkdir()
        flags = [f"-max_len={harness.MAX_LEN}", f"-timeout={TIMEOUT_PER_INPUT_S}", f"-rss_limit_mb={RSS_LIMIT_MB}",
                 f"-artifact_prefix={artifacts}/", "-print_final_stats=1", "-print_pcs=0"]
        if runs is not None:
            flags.append(f"-runs={runs}")
        if seconds is not None:
            flags.append(f"-max_total_time={seconds}")
        if seed is not None:
            flags.append(f"-seed={seed}")
        dirs = [str(output_corpus), str(seeds)] + ([str(committed)] if committed.is_dir() else [])
        LOGS_DIR.mkdir(parents=True, exist_ok=True)
        log_path = LOGS_DIR / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"
        command = [env[ARGV0_ENV], *flags, *dirs]
        say(f"{name}: fuzzing ({', '.join(f for f in flags if f.startswith(('-runs', '-max_total', '-seed')))}"
            f" or until a finding); log {log_path.relative_to(ROOT)}")
        start = time.monotonic()
        with open(log_path, "w") as log:
            done = subprocess.run(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL)
        elapsed = time.monotonic() - start
        output = log_path.read_text(errors="replace")
        if verbose:
            sys.stdout.write(output)
        parsed = _parse(output)
        if done.returncode == UNAVAILABLE_EXIT and parsed["unavailable"]:
            say(f"{name}: cannot run here: {parsed['unavailable']}")
            return {"harness": name, "unavailable": parsed["unavailable"], "executions": 0, "seconds": 0.0,
                    "exec_per_s": None, "new_units": None, "peak_rss_mb": None, "findings": [], "returncode": 0,
                    "info": {}, "stats": {}, "log": str(log_path), **facts}
        findings = _findings(name, artifacts, parsed["signatures"], done.returncode, output)
        result = {"harness": name, "executions": parsed["executions"], "seconds": round(elapsed, 1),
                  "exec_per_s": round(parsed["executions"] / elapsed) if elapsed else None,
                  "new_units": parsed.get("new_units"), "peak_rss_mb": parsed.get("peak_rss_mb"),
                  "findings": findings, "returncode": done.returncode, "info": parsed["info"],
                  "stats": parsed["stats"], "log": str(log_path), **facts}
        if minimize and not findings:
            result["corpus_units"] = _minimize(name, env, seeds, [output_corpus, committed], scratch, say)
        return result
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def replay(name: str, inputs: list[str], say=print) -> int:
    """Run harness `name` once on each of `inputs` (files), in the process a fuzzing run would
    give it (the sanitized build and its runtime for native_step); its output goes to ours.
    Returns its exit status: 0 when no input fails."""
    scratch = Path(tempfile.mkdtemp(prefix=f"fuzz-{name}-replay-"))
    try:
        env, _ = _child_env(name, scratch, say, None)
        return subprocess.run([env[ARGV0_ENV], *map(str, inputs)], cwd=ROOT, env=env).returncode
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _findings(name: str, artifacts: Path, signatures: list[str], returncode: int, output: str) -> list[dict]:
    kept = []
    for path in sorted(artifacts.iterdir()):
        if not path.name.startswith(_ARTIFACT_KINDS):
            continue
        keep = FINDINGS_DIR / name.rsplit(".", 1)[-1] / path.name
        keep.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, keep)
        kept.append({"kind": path.name.split("-", 1)[0], "input": str(keep), "bytes": path.stat().st_size,
                     "signatures": signatures})
    if not kept and (returncode != 0 or signatures):
        kept.append({"kind": "failed run", "input": None, "returncode": returncode, "signatures": signatures,
                     "output_tail": output[-3000:]})
    return kept


def _minimize(name: str, env: dict, seeds: Path, corpora: list[Path], scratch: Path, say) -> int:
    """Replace fuzz/corpus/<name>/ with the smallest set of inputs that, beside the vectors,
    covers what the committed corpus and this run's found (libFuzzer's -merge)."""
    merged = scratch / "merged"
    shutil.copytree(seeds, merged)
    seed_names = {p.name for p in seeds.iterdir()}
    dirs = [str(d) for d in corpora if d.is_dir()]
    done = subprocess.run([env[ARGV0_ENV], "-merge=1", f"-max_len={harness_module(name).MAX_LEN}", str(merged), *dirs],
                          cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{name}: merge failed:\n{done.stderr[-3000:]}")
    target = CORPUS_DIR / name
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir(parents=True)
    found = sorted((p for p in merged.iterdir() if p.name not in seed_names), key=lambda p: (p.stat().st_size, p.name))
    kept, total = [], 0
    for path in found:
        if total + path.stat().st_size > CORPUS_BUDGET_BYTES:
            break
        total += path.stat().st_size
        kept.append(path)
        shutil.copyfile(path, target / path.name)
    say(f"{name}: corpus minimized to {len(kept)} inputs ({total} bytes) in {target.relative_to(ROOT)}"
        + (f"; {len(found) - len(kept)} larger ones left out (over {CORPUS_BUDGET_BYTES} bytes)" if len(kept) < len(found)
           else ""))
    return len(kept)
