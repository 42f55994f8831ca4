defmodule ScanBridge.TestSupport do
  @moduledoc false
  # What the tests share: how to start the real server, what it supports, random inputs, and
  # numeric comparison.

  import ExUnit.Assertions
  alias ScanBridge.{Tensor, TestSupport.Reference}

  @repo_root Path.expand("../../..", __DIR__)

  def repo_root, do: @repo_root

  @doc "The interpreter that runs the server: $PYTHON, else the repository's .venv."
  def python, do: System.get_env("PYTHON") || Path.join(@repo_root, ".venv/bin/python")

  @doc "Options for `ScanBridge.start_link/1` against the checkout's server, on the CPU."
  def server_opts(extra \\ []) do
    env = [
      {"PYTHONPATH", System.get_env("PYTHONPATH") || @repo_root},
      {"SCAN_BRIDGE_LOG", System.get_env("SCAN_BRIDGE_LOG", "WARNING")}
    ]

    Keyword.merge([python: python(), args: ["--device", "cpu"], env: env], extra)
  end

  ## What the server supports (probed once by test_helper.exs)

  @doc """
  Ask the server what it supports: its ops (from `info`) and whether its CLI has the unix
  lane (`--unix`). Stored for `skip_reason/1`.
  """
  def probe! do
    {:ok, server} = ScanBridge.start_link(server_opts())
    {:ok, info} = ScanBridge.info(server)
    GenServer.stop(server)
    # argparse writes the help to stdout, which the server points at stderr (stdio_guard)
    {help, 0} =
      System.cmd(python(), ["-m", "bridge", "--help"],
        env: server_opts()[:env],
        stderr_to_stdout: true
      )

    ops = info["protocol"]["ops"]
    :persistent_term.put({__MODULE__, :ops}, ops)
    :persistent_term.put({__MODULE__, :unix_lane}, String.contains?(help, "--unix"))
    %{ops: ops, unix_lane: String.contains?(help, "--unix")}
  end

  @features %{
    sessions: ~w(session_open session_close session_state step),
    ssd: ~w(ssd_scan session_open session_close session_state step),
    handles: ~w(put free),
    # deadline_us came with the cancel op (SPEC §4, §6)
    deadlines: ~w(cancel),
    models:
      ~w(model_load model_free model_forward model_step session_open session_close session_state
         session_snapshot session_restore session_fork snapshot_free)
  }

  @doc "nil when the server supports `feature`, else why the tests that need it are skipped."
  def skip_reason(:unix_lane) do
    unless :persistent_term.get({__MODULE__, :unix_lane}),
      do: "the server has no unix lane (`python -m bridge --help` lists no --unix)"
  end

  def skip_reason(feature) do
    ops = :persistent_term.get({__MODULE__, :ops})
    missing = @features[feature] -- ops

    if missing != [],
      do:
        "the server lacks the ops #{Enum.join(missing, ", ")} (its info lists #{Enum.join(ops, ", ")})"
  end

  def features, do: [:unix_lane | Map.keys(@features)]

  ## Inputs

  @doc """
  A seed for `:rand.seed(:exsss, seed)` in a spawned process, which does not inherit its
  caller's random state: drawn from the caller's, which ExUnit seeds for each test from the
  run's --seed, so that inputs are fresh each run, reproducible from the seed the run prints,
  and (all but surely) different for each process.
  """
  def draw_seed do
    {:rand.uniform(0xFFFFFFFF), :rand.uniform(0xFFFFFFFF), :rand.uniform(0xFFFFFFFF)}
  end

  @int_ranges %{
    u8: 0..255,
    i32: -0x80000000..0x7FFFFFFF,
    i64: -0x8000000000000000..0x7FFFFFFFFFFFFFFF
  }

  @doc """
  A tensor of uniform random values: floats in [lo, hi) (rounded to the dtype), integers over
  the integer dtype's whole range.
  """
  def random(dtype, shape, lo \\ -1.0, hi \\ 1.0) do
    count = shape |> Tuple.to_list() |> Enum.product()

    values =
      case @int_ranges[dtype] do
        nil -> for _ <- 1..count//1, do: lo + (hi - lo) * :rand.uniform_real()
        range -> for _ <- 1..count//1, do: Enum.random(range)
      end

    Tensor.from_list(values, dtype, shape)
  end

  @doc """
  Random scan inputs: x [batch, seq, dim] (or [batch, dim, seq] for :bdl), B/C with `groups`
  when given, and each optional tensor named in `with` (:D, :z, :dt_bias, :h0); every tensor
  of `sizes[:dtype]` (:f32 unless given; :f64 values are drawn at full f64 precision).
  """
  def scan_inputs(%{batch: b, seq: l, dim: d, state: n} = sizes, with \\ []) do
    layout = Map.get(sizes, :layout, :bld)
    dtype = Map.get(sizes, :dtype, :f32)
    groups = Map.get(sizes, :groups)
    x_shape = if layout == :bld, do: {b, l, d}, else: {b, d, l}

    bc_shape =
      case {layout, groups} do
        {:bld, nil} -> {b, l, n}
        {:bld, g} -> {b, l, g, n}
        {:bdl, nil} -> {b, n, l}
        {:bdl, g} -> {b, g, n, l}
      end

    required = %{
      x: random(dtype, x_shape),
      dt: random(dtype, x_shape, 0.01, 0.5),
      A: random(dtype, {d, n}, -2.0, -0.1),
      B: random(dtype, bc_shape),
      C: random(dtype, bc_shape)
    }

    optional = %{
      D: fn -> random(dtype, {d}) end,
      z: fn -> random(dtype, x_shape) end,
      dt_bias: fn -> random(dtype, {d}, -0.5, 0.5) end,
      h0: fn -> random(dtype, {b, d, n}) end
    }

    extra = Map.new(with, fn key -> {key, Map.fetch!(optional, key).()} end)
    layout_opt = if layout == :bld, do: %{}, else: %{layout: layout}
    required |> Map.merge(extra) |> Map.merge(layout_opt)
  end

  ## Comparison

  @doc "Assert two flat lists of numbers agree within atol + rtol·|expected|."
  def assert_close(actual, expected, what, atol \\ 1.0e-4, rtol \\ 1.0e-3) do
    assert length(actual) == length(expected),
           "#{what}: #{length(actual)} values, expected #{length(expected)}"

    worst =
      Enum.zip(actual, expected)
      |> Enum.with_index()
      |> Enum.map(fn {{a, e}, i} -> {abs(a - e) - (atol + rtol * abs(e)), i, a, e} end)
      |> Enum.max()

    {excess, i, a, e} = worst

    assert excess <= 0,
           "#{what}[#{i}]: got #{a}, expected #{e} (tolerance #{atol} + #{rtol}·|expected|)"
  end

  @doc "Check a scan result against the scalar reference."
  def assert_scan_matches(%{y: y, state: state}, inputs) do
    {y_ref, state_ref} = Reference.scan(inputs)
    assert y.dtype == :f32
    assert y.shape == inputs.x.shape
    assert_close(Tensor.to_list(y), y_ref, "y")

    if inputs[:return_state] do
      {b, _, _} = inputs.x.shape
      {d, n} = inputs."A".shape
      assert state.shape == {b, d, n}
      assert_close(Tensor.to_list(state), state_ref, "state")
    else
      assert state == nil
    end
  end

  @doc """
  `n` callers scanning at once through `server`, each its own small inputs (from a seed
  `draw_seed/0` gives it), each answer checked against the scalar reference.
  """
  def assert_concurrent_scans(server, n) do
    Enum.map(1..n, &{&1, draw_seed()})
    |> Task.async_stream(
      fn {i, seed} ->
        :rand.seed(:exsss, seed)
        inputs = scan_inputs(%{batch: 1 + rem(i, 3), seq: 3 + rem(i, 4), dim: 5, state: 2}, [:D])
        {inputs, ScanBridge.scan(server, inputs)}
      end,
      max_concurrency: n,
      timeout: 60_000
    )
    |> Enum.each(fn {:ok, {inputs, outcome}} ->
      assert {:ok, result} = outcome
      assert_scan_matches(result, inputs)
    end)
  end

  @doc """
  A session prefilled by a scan over `prefill` timesteps, then stepped `steps` times, each
  answer checked against the scalar reference over the whole sequence; then its state, and
  its close. `sizes`/`optional`/`options` as for `scan_inputs/2` (layout bld).
  """
  def assert_session_scenario(server, sizes, optional, options, prefill, steps) do
    %{batch: b, dim: d, state: n} = sizes
    full = sizes |> Map.put(:seq, prefill + steps) |> scan_inputs(optional) |> Map.merge(options)
    {y_ref, state_ref} = Reference.scan(full)
    y_ref = List.to_tuple(y_ref)

    ref_at = fn t ->
      for bi <- 0..(b - 1), di <- 0..(d - 1), do: elem(y_ref, (bi * (prefill + steps) + t) * d + di)
    end

    assert {:ok, session} = ScanBridge.open_session(server, batch: b, dim: d, state: n)
    assert is_binary(session)

    prefill_inputs = full |> time_slice(0, prefill) |> Map.put(:session, session)
    assert {:ok, %{y: y}} = ScanBridge.scan(server, prefill_inputs)

    assert_close(
      Tensor.to_list(y),
      Enum.flat_map(0..(prefill - 1), fn t -> ref_at.(t) end) |> reorder_bld(b, prefill, d),
      "prefill y"
    )

    for k <- 0..(steps - 1) do
      step_inputs = full |> time_slice(prefill + k, 1) |> squeeze_time()

      assert {:ok, %{y: y, timing: %{"server_us" => _}}} =
               ScanBridge.step(server, session, step_inputs)

      assert y.shape == {b, d}
      assert_close(Tensor.to_list(y), ref_at.(prefill + k), "step #{k} y")
    end

    assert {:ok, state} = ScanBridge.session_state(server, session)
    assert state.shape == {b, d, n}
    assert_close(Tensor.to_list(state), state_ref, "session state")

    assert ScanBridge.close_session(server, session) == :ok
    step_inputs = full |> time_slice(prefill, 1) |> squeeze_time()

    assert {:error, %ScanBridge.Error{reason: :unknown_session}} =
             ScanBridge.step(server, session, step_inputs)
  end

  # ref_at gives [batch, dim] per timestep; y of a bld scan is [batch, seq, dim].
  defp reorder_bld(per_time, b, l, d) do
    v = List.to_tuple(per_time)
    for bi <- 0..(b - 1), t <- 0..(l - 1), di <- 0..(d - 1), do: elem(v, (t * b + bi) * d + di)
  end

  @doc "Timesteps [from, from + count) of every per-timestep tensor ([batch, seq, ...], layout bld)."
  def time_slice(inputs, from, count) do
    seq = elem(inputs.x.shape, 1)

    Map.new(inputs, fn
      {key, %Tensor{shape: shape} = t} when key in [:x, :dt, :z, :B, :C] ->
        [batch, ^seq | rest] = Tuple.to_list(shape)
        row = Enum.product(rest) * Tensor.itemsize(t.dtype)

        data =
          for bi <- 0..(batch - 1),
              into: <<>>,
              do: binary_part(t.data, (bi * seq + from) * row, count * row)

        {key, Tensor.new(data, t.dtype, List.to_tuple([batch, count | rest]))}

      other ->
        other
    end)
  end

  @doc "The per-timestep tensors of a one-timestep slice without their seq axis, as a step takes them."
  def squeeze_time(inputs) do
    Map.new(inputs, fn
      {key, %Tensor{shape: shape} = t} when key in [:x, :dt, :z, :B, :C] ->
        [batch, 1 | rest] = Tuple.to_list(shape)
        {key, %{t | shape: List.to_tuple([batch | rest])}}

      other ->
        other
    end)
  end

  @doc """
  A fresh unix socket path for a server, removed when the calling test (or module, from
  `setup_all`) ends. The BEAM's OS pid is part of it: unique integers restart with every VM,
  so two suites running at once would otherwise pick the same paths.
  """
  def socket_path do
    path =
      Path.join(
        System.tmp_dir!(),
        "scan-bridge-test-#{System.pid()}-#{System.unique_integer([:positive])}.sock"
      )

    ExUnit.Callbacks.on_exit(fn -> File.rm(path) end)
    path
  end

  @doc """
  Freeze the OS process `os_pid` (SIGSTOP). Call it from a test: when the test ends, passed or
  failed, the process is thawed (SIGCONT), so one frozen by a failed assertion still reads its
  stdin's EOF and exits rather than outliving the suite.
  """
  def freeze(os_pid) do
    ExUnit.Callbacks.on_exit(fn -> send_signal(os_pid, "CONT") end)
    signal!(os_pid, "STOP")
    # kill(1) returns before every thread of the target has stopped
    assert eventually(fn -> stopped?(os_pid) end), "server #{os_pid} did not stop on SIGSTOP"
    :ok
  end

  @doc """
  Freeze `client`'s server and send it a put of `bytes` (more than its lane holds unread) and
  then a ping, each with a 100 ms deadline: both callers get `:timeout` in time, which a client
  process suspended in sending could not give. Thawed, the server answers again, and the late
  put leaves no handle: done late, its handle is freed; cancelled before it started (the
  client cancels what its callers gave up), it made none.
  """
  def assert_deadlines_hold_while_frozen(client, bytes) do
    {:ok, os_pid} = ScanBridge.os_pid(client)
    {:ok, before} = ScanBridge.stats(client)

    big =
      ScanBridge.Tensor.new(
        :binary.copy(<<1.0::float-32-little>>, div(bytes, 4)),
        :f32,
        {div(bytes, 4)}
      )

    freeze(os_pid)
    put = Task.async(fn -> ScanBridge.put(client, big, timeout: 1_000) end)
    # The put is in the lane (a client suspended in sending it would not answer this). It stays
    # outstanding past its deadline, the frozen server never answering, but the cancel sent
    # then is outstanding beside it: so the look is for the put, not for a count of one.
    assert eventually(fn -> put_outstanding?(client) end)
    ping = Task.async(fn -> ScanBridge.ping(client, timeout: 100) end)

    assert [{^put, {:ok, put_outcome}}, {^ping, {:ok, ping_outcome}}] =
             Task.yield_many([put, ping], 5_000)

    assert {:error, %ScanBridge.Error{reason: :timeout}} = put_outcome
    assert {:error, %ScanBridge.Error{reason: :timeout}} = ping_outcome
    thaw(os_pid)
    assert ScanBridge.ping(client, timeout: 10_000) == :ok

    # the put was answered late, and left no handle
    assert eventually(fn ->
             {:ok, stats} = ScanBridge.stats(client)

             answered(stats, "put") == answered(before, "put") + 1 and
               get_in(stats, ["handles", "handles"]) == 0
           end)
  end

  defp put_outstanding?(client) do
    Enum.any?(:sys.get_state(client).outstanding, &match?({_id, {"put", _length}}, &1))
  end

  @doc """
  Make `client` treat its server as one without `deadline_us` and `cancel` (an older one): a
  request its caller gives up is left to run, and what its late reply made is freed, which
  these tests need to be sure of without racing a cancel.
  """
  def without_cancel(client), do: :sys.replace_state(client, &%{&1 | deadlines: false})

  @doc """
  Starts a client under the calling test's supervisor, `without_cancel/1`: what a request its
  caller gave up made is freed by the client when the request is done. Returns
  `%{client: pid, os_pid: its server's OS pid}`, for a test's context.
  """
  def start_without_cancel! do
    client = ExUnit.Callbacks.start_supervised!({ScanBridge, server_opts()})
    without_cancel(client)
    {:ok, os_pid} = ScanBridge.os_pid(client)
    %{client: client, os_pid: os_pid}
  end

  @doc """
  How many handles or sessions (`gauge`) the server of `client` holds once it has done `op`
  once; nil before.
  """
  def held_after(client, op, gauge) do
    {:ok, stats} = ScanBridge.stats(client)

    if get_in(stats, ["ops", op, "success_count"]) == 1,
      do: get_in(stats, [gauge, gauge]) || raise("no #{gauge} count in #{inspect(stats)}")
  end

  @doc """
  How many `op` requests the server has answered (its `stats`): done, or failed, which
  includes those a cancel dropped before they started.
  """
  def answered(stats, op) do
    counts = get_in(stats, ["ops", op]) || %{}
    Map.get(counts, "success_count", 0) + Map.get(counts, "failure_count", 0)
  end

  @doc "Kill the OS process `os_pid` (SIGKILL)."
  def kill!(os_pid), do: signal!(os_pid, "KILL")

  # Every thread of the process is in the stopped state ("T" in /proc/PID/task/TID/stat).
  defp stopped?(os_pid) do
    case File.ls("/proc/#{os_pid}/task") do
      {:ok, tids} ->
        Enum.all?(tids, fn tid ->
          case File.read("/proc/#{os_pid}/task/#{tid}/stat") do
            # the state follows the parenthesised command name, which may contain spaces
            {:ok, stat} -> stat |> String.split(") ") |> List.last() |> String.starts_with?("T")
            {:error, _} -> true
          end
        end)

      {:error, _} ->
        false
    end
  end

  @doc "Thaw an OS process frozen by `freeze/1` (SIGCONT)."
  def thaw(os_pid), do: signal!(os_pid, "CONT")

  defp signal!(os_pid, name) do
    {_, 0} = send_signal(os_pid, name)
    :ok
  end

  # kill(1)'s status is not 0 for a process already gone: freeze's thaw at the test's end
  # ignores it, the others require 0.
  defp send_signal(os_pid, name),
    do: System.cmd("kill", ["-#{name}", Integer.to_string(os_pid)], stderr_to_stdout: true)

  @doc """
  Starts a client with `opts`, linked to nothing: a test that kills its server, or stops it,
  lives on. Stop it with `stop_quietly/1`.
  """
  def start_unlinked(opts) do
    {:ok, pid} = ScanBridge.start_link(opts)
    Process.unlink(pid)
    pid
  end

  @doc "Stops a client, as `GenServer.stop/1`, or nothing where it is gone already."
  def stop_quietly(pid) do
    GenServer.stop(pid)
  catch
    :exit, _already_gone -> :ok
  end

  @doc "Whether the OS process `os_pid` is gone (Linux: no /proc entry)."
  def os_process_gone?(os_pid), do: not File.exists?("/proc/#{os_pid}")

  @doc "Poll `fun` every 10 ms until it returns truthy or `ms` pass; returns its last value."
  def eventually(fun, ms \\ 5_000) do
    deadline = System.monotonic_time(:millisecond) + ms
    poll(fun, deadline)
  end

  defp poll(fun, deadline) do
    value = fun.()

    if value || System.monotonic_time(:millisecond) > deadline do
      value
    else
      Process.sleep(10)
      poll(fun, deadline)
    end
  end
end
