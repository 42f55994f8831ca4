"""Dialyzer on the Elixir client's compiled modules: no warning passes.

`mix dialyzer` (dialyxir) needs hex.pm, which is unreachable here, so elixir_client/scripts/dialyzer.exs
drives OTP's own dialyzer (Debian package erlang-dialyzer, installed by `make system-deps`)
with a PLT of the modules the client refers to, cached under elixir_client/_build/dialyzer
(git-ignored). Where mix or dialyzer is missing the tests are skipped with the reason, except
in CI (CI=true), where that fails.
"""

from __future__ import annotations

import os
import re
import shutil
import sys

import pytest

from process_runs import run_marked
from test_elixir_client import PROJECT, find_mix, mix_env

# A cold run compiles the client and builds the PLT before the check itself; here that takes
# well under a minute, the rest is room for a loaded machine.
TIMEOUT_S = 300

# A spec its function cannot meet, and an error result dropped (-Wunmatched_returns).
PLANTED = '''defmodule Planted do
  @spec twice(integer) :: atom
  def twice(x), do: x * 2

  def forget(path) do
    File.write(path, "")
    :ok
  end
end
'''


def find_dialyzer() -> None:
    """Skips with the reason where dialyzer is missing, except in CI (CI=true)."""
    if shutil.which("dialyzer") is None:
        reason = ("dialyzer is not installed: run `make system-deps` (Debian package "
                  "erlang-dialyzer) to check the Elixir client with it")
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI: {reason}")
        print(reason, file=sys.stderr)
        pytest.skip(reason)


def run_dialyzer(args: list[str]):
    """`mix run --no-start scripts/dialyzer.exs ARGS` in elixir_client/, the client compiled
    in the dev environment (lib/ only: the test environment adds test/support/)."""
    find_dialyzer()
    env = dict(mix_env(), MIX_ENV="dev")
    return run_marked([find_mix(), "run", "--no-start", "scripts/dialyzer.exs", *args],
                      timeout_s=TIMEOUT_S, cwd=PROJECT, env=env)


def test_dialyzer_finds_nothing_in_the_client():
    run = run_dialyzer([])
    print(run.output)
    if failure := run.failure("dialyzer on the Elixir client (elixir_client/scripts/dialyzer.exs)"):
        pytest.fail(failure)
    checked = re.search(r"dialyzer: (\d+) modules checked in \d+ ms: (\d+) warning", run.stdout)
    assert checked, run.output
    beams = [f for f in os.listdir(os.path.join(PROJECT, "_build", "dev", "lib", "scan_bridge", "ebin"))
             if f.endswith(".beam")]
    # every module of lib/ was analysed, not an empty or stale directory
    assert int(checked.group(1)) == len(beams) >= 12, (checked.group(0), beams)
    assert checked.group(2) == "0", run.output


def test_dialyzer_warning_fails_the_run(tmp_path):
    """The same script on a planted module with a false spec and a dropped error result: both are
    reported and the run fails, so that a pass above means dialyzer looked and found nothing."""
    find_dialyzer()
    elixirc = shutil.which("elixirc") or pytest.fail("elixirc is missing beside mix")
    source = tmp_path / "planted.ex"
    source.write_text(PLANTED)
    ebin = tmp_path / "ebin"
    ebin.mkdir()
    compiled = run_marked([elixirc, "-o", str(ebin), str(source)], timeout_s=TIMEOUT_S,
                          env=mix_env())
    if failure := compiled.failure("elixirc planted.ex"):
        pytest.fail(failure)

    run = run_dialyzer(["--ebin", str(ebin), "--plt-dir", str(tmp_path / "plt")])
    assert run.returncode == 1, run.output
    assert re.search(r"planted\.ex:2: .*twice/1", run.stdout), run.output
    assert re.search(r"planted\.ex:6: Expression produces a value of type", run.stdout), run.output
    assert "1 modules checked" in run.stdout and "2 warning(s)" in run.stdout, run.output
