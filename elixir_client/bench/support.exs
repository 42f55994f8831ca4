# What the Elixir benchmarks (roundtrip.exs, models.exs) share: where and what was measured,
# timing, percentiles, the C pipe echo's build, and a reply's encoded size.

unless Code.ensure_loaded?(ScanBridge.TestSupport.JSON),
  do: Code.require_file("../test/support/json.ex", __DIR__)

defmodule BenchSupport do
  alias ScanBridge.TestSupport.JSON

  @root Path.expand("../..", __DIR__)

  def root, do: @root

  @doc "{result, microseconds} of calling `fun`."
  def timed(fun) do
    t0 = System.monotonic_time(:nanosecond)
    result = fun.()
    {result, (System.monotonic_time(:nanosecond) - t0) / 1000}
  end

  def median(values), do: values |> Enum.sort() |> percentile(50)

  @doc "p50, p90, p99, min, max (µs, floats) and the count of timings in µs."
  def summary_us(values) do
    sorted = Enum.sort(values)

    %{
      "p50_us" => percentile(sorted, 50),
      "p90_us" => percentile(sorted, 90),
      "p99_us" => percentile(sorted, 99),
      "min_us" => hd(sorted) * 1.0,
      "max_us" => List.last(sorted) * 1.0,
      "n" => length(sorted)
    }
  end

  @doc "Linear interpolation between closest ranks (numpy's default) of a sorted list."
  def percentile(sorted, p) do
    pos = (length(sorted) - 1) * p / 100
    lo = floor(pos)
    hi = min(lo + 1, length(sorted) - 1)
    a = Enum.at(sorted, lo)
    (a + (Enum.at(sorted, hi) - a) * (pos - lo)) * 1.0
  end

  @doc "The bytes of a v1 reply body carrying `result` and `timing`."
  def reply_size(result, timing) do
    {_io, size} =
      ScanBridge.Msgpack.encode_at(
        %{"v" => 1, "id" => 1, "ok" => true, "result" => result, "timing" => timing},
        0
      )

    size
  end

  @doc "The path of the C pipe echo, built by the server's own bench helpers."
  def build_echo(python, env) do
    code = "from bridge.bench.floors import build_echo; print(build_echo('pipe_echo'))"
    {out, 0} = System.cmd(python, ["-c", code], env: env, cd: @root)
    String.trim(out)
  end

  def machine(python, env) do
    code =
      "import json; from bridge.bench.machine import machine_info; print(json.dumps(machine_info()))"

    {out, 0} = System.cmd(python, ["-c", code], env: env, cd: @root)

    out
    |> JSON.decode!()
    |> Map.merge(%{
      "otp_release" => to_string(:erlang.system_info(:otp_release)),
      "erts" => to_string(:erlang.system_info(:version)),
      "elixir" => System.version(),
      "schedulers" => :erlang.system_info(:schedulers_online),
      # e.g. "+sbwt none ...": scheduler busy-waiting competes with the server for the cores
      "elixir_erl_options" => System.get_env("ELIXIR_ERL_OPTIONS")
    })
  end

  # As bridge.bench.machine.commit_info: the commit, whether and where the tree was edited
  # (`git status --porcelain`'s paths, at most 100), a SHA-256 of `git diff HEAD`, the branch.
  def commit do
    git = fn args ->
      case System.cmd("git", args, cd: @root, stderr_to_stdout: true) do
        {out, 0} -> out
        _ -> ""
      end
    end

    # "XY PATH" a line: the status letters' leading space is part of the format
    changed =
      for line <- String.split(git.(["status", "--porcelain"]), "\n", trim: true),
          do: binary_part(line, 3, byte_size(line) - 3)

    diff_sha256 =
      if changed != [],
        do: Base.encode16(:crypto.hash(:sha256, git.(["diff", "HEAD"])), case: :lower)

    %{
      "commit" => String.trim(git.(["rev-parse", "HEAD"])),
      "dirty" => changed != [],
      "dirty_paths" => Enum.take(changed, 100),
      "diff_sha256" => diff_sha256,
      "branch" => String.trim(git.(["rev-parse", "--abbrev-ref", "HEAD"]))
    }
  end
end
