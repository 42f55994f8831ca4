"""The Elixir client as another project uses it: a `path:` dependency of a fresh Mix project.

`mix new` makes the project in a temporary directory, its `deps` get
`{:scan_bridge, path: "<this checkout>/elixir_client"}`, it compiles (its own code with
--warnings-as-errors; the client, compiled as a dependency, must print no warning either), and a
module of it starts this checkout's server through the client and makes real calls. Everything
is built under the temporary directory (Mix's home included); that nothing is written into
elixir_client/ is checked. Where mix is missing the test is skipped with the reason, except in
CI (CI=true), where that fails (as for tests/test_elixir_client.py).
"""

from __future__ import annotations

import os
import re
import subprocess

import pytest

from process_runs import run_marked
from test_elixir_client import PROJECT, find_mix, mix_env

# Compiling the client (a dozen files) and the project, starting a CPU server, three calls:
# well under a minute here; the rest is room for a loaded machine.
TIMEOUT_S = 300

CONSUMER = '''defmodule Consumer do
  @moduledoc "Calls a scan-bridge server through the client, a dependency of this project."

  alias ScanBridge.Tensor

  def main do
    {:ok, server} =
      ScanBridge.start_link(
        python: System.fetch_env!("PYTHON"),
        args: ["--device", "cpu"],
        env: [{"PYTHONPATH", System.fetch_env!("PYTHONPATH")}]
      )

    started = List.keymember?(Application.started_applications(), :scan_bridge, 0)
    IO.puts("application: #{inspect(started)}")
    IO.puts("ping: #{inspect(ScanBridge.ping(server))}")
    {:ok, info} = ScanBridge.info(server)
    IO.puts("protocol: #{info["protocol"]["version"]}")

    f32 = fn values, shape -> Tensor.from_list(values, :f32, shape) end

    inputs = %{
      x: f32.([1.0, 2.0], {1, 2, 1}),
      dt: f32.([0.5, 0.5], {1, 2, 1}),
      A: f32.([-1.0], {1, 1}),
      B: f32.([1.0, 1.0], {1, 2, 1}),
      C: f32.([1.0, 1.0], {1, 2, 1}),
      return_state: true
    }

    {:ok, %{y: y, state: state}} = ScanBridge.scan(server, inputs)
    IO.puts("y: #{inspect(rounded(y))} #{inspect(y.shape)}")
    IO.puts("state: #{inspect(rounded(state))} #{inspect(state.shape)}")

    {:error, %ScanBridge.Error{reason: reason}} =
      ScanBridge.open_session(server, kind: :no_such_kind, batch: 1)

    IO.puts("bad session: #{inspect(reason)}")
    :ok = GenServer.stop(server)
  end

  defp rounded(tensor), do: tensor |> Tensor.to_list() |> Enum.map(&Float.round(&1, 4))
end
'''


def tree_state(root: str) -> dict[str, int]:
    """Every path under `root` with its mtime (ns): what a build into it would change."""
    state = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            state[os.path.relpath(path, root)] = os.lstat(path).st_mtime_ns
    return state


def add_dependency(mix_exs: str, dependency: str) -> str:
    """`mix new`'s mix.exs with `dependency` as its only dep (in place of its commented examples)."""
    deps, n = re.subn(r"defp deps do\n\s*\[\n.*?\n\s*\]\n\s*end",
                      f"defp deps do\n    [{dependency}]\n  end", mix_exs, flags=re.S)
    assert n == 1, f"mix new's mix.exs has no deps/0 of the expected form:\n{mix_exs}"
    return deps


def test_fresh_mix_project_uses_the_client_as_a_path_dependency(tmp_path):
    mix = find_mix()
    env = mix_env()
    env.update({
        "MIX_ENV": "dev",
        "MIX_HOME": str(tmp_path / "mix_home"),
        "HEX_HOME": str(tmp_path / "hex_home"),
    })
    before = tree_state(PROJECT)

    subprocess.run([mix, "new", "consumer"], cwd=tmp_path, env=env, check=True, capture_output=True,
                   timeout=60)
    project = tmp_path / "consumer"
    mix_exs = project / "mix.exs"
    client = os.path.realpath(PROJECT)
    mix_exs.write_text(add_dependency(mix_exs.read_text(), f'{{:scan_bridge, path: "{client}"}}'))
    (project / "lib" / "consumer.ex").write_text(CONSUMER)

    compiled = run_marked([mix, "compile", "--warnings-as-errors"], timeout_s=TIMEOUT_S,
                          cwd=project, env=env)
    if failure := compiled.failure("`mix compile --warnings-as-errors` of a project depending on the client"):
        pytest.fail(failure)
    assert "==> scan_bridge" in compiled.output, compiled.output  # compiled as a dependency
    # --warnings-as-errors covers the project's own code; the dependency's warnings are only printed
    assert "warning:" not in compiled.output, compiled.output

    run = run_marked([mix, "run", "-e", "Consumer.main()"], timeout_s=TIMEOUT_S, cwd=project, env=env)
    if failure := run.failure("the project's program calling the server through the client"):
        pytest.fail(failure)
    said = dict(line.split(": ", 1) for line in run.stdout.splitlines() if ": " in line)
    assert said.get("application") == "true", run.output  # the client's OTP application started
    assert said.get("ping") == ":ok", run.output
    assert said.get("protocol") == "1", run.output
    # h1 = 0.5·1 = 0.5; h2 = e^-0.5·0.5 + 0.5·2 = 1.3033 (A = -1, dt = 0.5, B = C = 1, x = 1, 2)
    assert said.get("y") == "[0.5, 1.3033] {1, 2, 1}", run.output
    assert said.get("state") == "[1.3033] {1, 1, 1}", run.output
    assert said.get("bad session") == ":invalid_argument", run.output

    assert (project / "_build" / "dev" / "lib" / "scan_bridge" / "ebin").is_dir()
    after = tree_state(PROJECT)
    changed = sorted(p for p in before.keys() | after.keys() if before.get(p) != after.get(p))
    assert changed == [], f"building the dependent project wrote into elixir_client/: {changed[:20]}"
