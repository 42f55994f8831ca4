# Round trips from Elixir through ScanBridge against a framing-only echo over the same lane,
# interleaved in one run:
#
#   * the ExPhil request (scan, 32×60×512×16 f32) and a 32×512×16 step (a session; A kept on
#     the server as a handle), through the public API (caller → client process → server);
#   * the same request bytes sent by this process to the C echo (bridge/bench/echo/pipe_echo.c), which
#     reads each frame and answers with a frame of the server's reply size: over a Port
#     ({:packet, 4}, as the client's) and, when the server has the unix lane, over a unix
#     socket (:gen_tcp {:local, path}, packet 4, with the client's socket options).
#   * the client's own parts of a call, each timed alone after the same pause, to split what a
#     call costs beyond the echo and the server's part: encoding the request in the caller,
#     decoding the reply (the server's reply body to that call, as the client process got it),
#     and the hop from the caller to a process like the client and back (a GenServer that
#     answers from handle_info, as the client does once the reply is in).
#
# The whole sequence runs `--rounds` times with the same clients; the goals are the medians of
# the rounds' ratios, and every round's rows are kept. Rounds show the spread within one run,
# not between runs: the step's Port echo has moved from one run to the next while staying put
# within each (docs/performance.md, "elixir roundtrip").
#
#   mix run bench/roundtrip.exs [--iterations 30] [--step-iterations 400] [--rounds 3] [--out PATH]
#
# Needs $PYTHON (default: the checkout's .venv) and cc. Writes JSON (with machine and commit
# info) to the git-ignored ../bench/out/elixir-roundtrip.json by default; to record the
# reference the docs cite, `--out ../bench/results/elixir-roundtrip.json`.

Code.require_file("support.exs", __DIR__)

# Stands in for ScanBridge.Server when timing the hop alone: takes a request like the client's
# handle_call (no reply yet) and answers it from handle_info with a decoded reply of the case,
# as the client answers once the server's reply is in.
defmodule HopStandIn do
  use GenServer

  @impl true
  def init(outcome), do: {:ok, outcome}

  @impl true
  def handle_call({:request, _op, _head, _size, _deadline, _closes}, from, state) do
    send(self(), {:answer, from})
    {:noreply, state}
  end

  @impl true
  def handle_info({:answer, from}, outcome) do
    GenServer.reply(from, outcome)
    {:noreply, outcome}
  end
end

defmodule RoundtripBench do
  alias ScanBridge.{Protocol, Tensor}
  alias ScanBridge.TestSupport.JSON

  @root Path.expand("../..", __DIR__)
  @exphil %{batch: 32, seq: 60, dim: 512, state: 16}
  @step %{batch: 32, dim: 512, state: 16}
  @warmup 3
  @settle_ms 5

  def main(argv) do
    {opts, _, _} =
      OptionParser.parse(argv,
        strict: [iterations: :integer, step_iterations: :integer, rounds: :integer, out: :string]
      )

    iterations = Keyword.get(opts, :iterations, 30)
    step_iterations = Keyword.get(opts, :step_iterations, 400)
    rounds = Keyword.get(opts, :rounds, 3)
    out = Keyword.get(opts, :out, Path.join(@root, "bench/out/elixir-roundtrip.json"))
    python = System.get_env("PYTHON") || Path.join(@root, ".venv/bin/python")
    env = [{"PYTHONPATH", System.get_env("PYTHONPATH") || @root}, {"SCAN_BRIDGE_LOG", "WARNING"}]
    echo = BenchSupport.build_echo(python, env)
    :rand.seed(:exsss, {1, 2, 3})
    exphil = exphil_inputs()

    lanes =
      if unix_lane?(python, env) do
        [:port, :unix]
      else
        IO.puts("unix lane: skipped (the server's CLI has no --unix)")
        [:port]
      end

    # One client per lane, all alive at once: each case runs on every lane in turn, so that
    # lanes are compared over adjacent stretches of time on this shared machine.
    clients = Map.new(lanes, fn lane -> {lane, start_client(lane, python, env)} end)
    {:ok, info} = ScanBridge.info(clients[:port])

    exphil_calls =
      for lane <- lanes do
        {lane, clients[lane], {"scan", exphil}, fn -> ScanBridge.scan(clients[lane], exphil) end}
      end

    step_calls =
      if "step" in info["protocol"]["ops"] do
        step = step_inputs()
        for lane <- lanes, do: step_call(lane, clients[lane], step)
      else
        IO.puts("step: skipped (the server has no step op)")
        []
      end

    results =
      for round <- 1..rounds,
          row <-
            measure("exphil scan 32x60x512x16 f32", exphil_calls, iterations, echo, python) ++
              measure(
                "step 32x512x16 f32 (A as a handle)",
                step_calls,
                step_iterations,
                echo,
                python
              ) do
        Map.merge(row, %{"backend" => info["backend"], "round" => round})
      end

    Enum.each(clients, fn {_lane, client} -> GenServer.stop(client) end)
    summary = goals(results, rounds)
    report(results, summary)

    doc = %{
      "benchmark" => "elixir-roundtrip",
      "machine" => BenchSupport.machine(python, env),
      "commit" => BenchSupport.commit(),
      "results" => results,
      "goals" => summary
    }

    File.mkdir_p!(Path.dirname(out))
    File.write!(out, JSON.encode!(doc) <> "\n")
    IO.puts("wrote #{out}")
  end

  defp start_client(lane, python, env) do
    transport =
      case lane do
        :port -> :port
        :unix -> {:unix, Path.join(System.tmp_dir!(), "scan-bridge-bench-#{System.os_time()}.sock")}
      end

    {:ok, client} =
      ScanBridge.start_link(
        python: python,
        env: env,
        args: ["--device", "cpu"],
        transport: transport
      )

    client
  end

  ## Inputs

  defp exphil_inputs do
    %{batch: b, seq: l, dim: d, state: n} = @exphil

    %{
      x: random({b, l, d}, -1.0, 1.0),
      dt: random({b, l, d}, 0.001, 0.1),
      A: random({d, n}, -4.0, -0.5),
      B: random({b, l, n}, -1.0, 1.0),
      C: random({b, l, n}, -1.0, 1.0)
    }
  end

  defp step_inputs do
    %{batch: b, dim: d, state: n} = @step

    %{
      x: random({b, d}, -1.0, 1.0),
      dt: random({b, d}, 0.001, 0.1),
      A: random({d, n}, -4.0, -0.5),
      B: random({b, n}, -1.0, 1.0),
      C: random({b, n}, -1.0, 1.0)
    }
  end

  defp random(shape, lo, hi) do
    count = shape |> Tuple.to_list() |> Enum.product()

    data =
      for _ <- 1..count, into: <<>>, do: <<lo + (hi - lo) * :rand.uniform_real()::float-32-little>>

    Tensor.new(data, :f32, shape)
  end

  # A session and the A handle belong to the connection that made them: one each per lane.
  defp step_call(lane, client, step) do
    %{batch: b, dim: d, state: n} = @step
    {:ok, session} = ScanBridge.open_session(client, batch: b, dim: d, state: n)
    {:ok, a} = ScanBridge.put(client, step."A")
    inputs = %{step | A: a}

    {lane, client, {"step", Map.put(inputs, :session, session)},
     fn -> ScanBridge.step(client, session, inputs) end}
  end

  ## Measuring

  # Lane after lane, each round the echo of the request bytes, the API call, then the client's
  # parts alone; warm-up rounds dropped. One result row per lane. (Lanes are not interleaved
  # round by round: a server that has just run keeps its kernel helpers polling for a while,
  # which on 2 cores slows the other lane's server, a cost no single-server deployment has.)
  defp measure(name, calls, iterations, echo_path, python) do
    for {lane, client, {op, inputs}, call} <- calls do
      {{:ok, first}, reply_body} = with_reply_body(client, call)
      {head, size} = Protocol.request_head(op, Protocol.wire_args!(inputs, op))
      request = [head, Protocol.id_entry(1)]
      reply_bytes = BenchSupport.reply_size(%{"y" => first.y}, first.timing)
      echo = start_echo(lane, echo_path, python, reply_bytes)
      {:reply, _id, outcome} = Protocol.decode_reply(reply_body)
      {:ok, hop} = GenServer.start_link(HopStandIn, outcome)

      parts = [
        encode: fn -> Protocol.request_head(op, Protocol.wire_args!(inputs, op)) end,
        decode: fn ->
          {:reply, _id, {:ok, result, _timing}} = Protocol.decode_reply(reply_body)
          {:ok, _y} = Tensor.from_wire(result["y"])
        end,
        process_hop: fn ->
          {:ok, _, _} = GenServer.call(hop, {:request, op, head, size, :infinity, nil})
        end
      ]

      # warm-up: page faults, first-call allocations on both sides
      for _ <- 1..@warmup, do: {echo_round_trip(echo, request), {:ok, _} = call.()}

      # Each round trip, the echo's and the call's, and each client part, after the same
      # pause, as a 60 FPS frame comes long after the last: back to back, the cores stay warm
      # and the server's kernel helpers still poll one, which no such frame finds (the Python
      # benches pause alike, bench/transports.py SETTLE_SECONDS).
      samples =
        for _ <- 1..iterations do
          Process.sleep(@settle_ms)
          echo_us = echo_round_trip(echo, request)
          Process.sleep(@settle_ms)
          {{:ok, result}, round_trip} = BenchSupport.timed(call)

          client_parts =
            Map.new(parts, fn {part, f} ->
              Process.sleep(@settle_ms)
              {part, f |> BenchSupport.timed() |> elem(1)}
            end)

          {round_trip, echo_us, result.timing, client_parts}
        end

      # The client's parts again back to back, for how much of their time the pause makes.
      back_to_back =
        Map.new(parts, fn {part, f} ->
          {"#{part}_us",
           BenchSupport.median(for _ <- 1..iterations, do: f |> BenchSupport.timed() |> elem(1))}
        end)

      stop_echo(echo)
      GenServer.stop(hop)

      name
      |> row(%{lane: lane, size: size, reply_bytes: reply_bytes}, iterations, samples)
      |> Map.put("client_parts_back_to_back_p50_us", back_to_back)
    end
  end

  # A call's result and the reply body its client process received for it.
  defp with_reply_body(client, call) do
    :erlang.trace(client, true, [:receive])
    result = call.()
    :erlang.trace(client, false, [:receive])
    {result, traced_reply_body()}
  end

  defp traced_reply_body do
    receive do
      {:trace, _, :receive, {_port, {:data, body}}} -> body
      {:trace, _, :receive, {:tcp, _socket, body}} -> body
      {:trace, _, :receive, _other} -> traced_reply_body()
    after
      1000 -> raise "the client's reply body was not traced"
    end
  end

  defp row(name, lane, iterations, samples) do
    round_trips = for {rt, _, _, _} <- samples, do: rt
    echoes = for {_, e, _, _} <- samples, do: e
    timings = for {_, _, t, _} <- samples, do: t
    kernel = for t <- timings, do: t["kernel_us"] || 0
    server = for t <- timings, do: t["server_us"] || 0
    bridge_cost = for {rt, _, t, _} <- samples, do: rt - (t["kernel_us"] || 0)
    ipc = for {rt, _, t, _} <- samples, do: rt - (t["server_us"] || 0)
    stages = timings |> Enum.flat_map(&Map.keys/1) |> Enum.uniq()

    client =
      Map.new([:encode, :decode, :process_hop], fn part ->
        {"#{part}_us", BenchSupport.median(for {_, _, _, c} <- samples, do: c[part])}
      end)

    %{
      "case" => name,
      "lane" => Atom.to_string(lane.lane),
      "iterations" => iterations,
      "request_frame_bytes" => lane.size + 4,
      "reply_frame_bytes" => lane.reply_bytes + 4,
      "round_trip" => summarize(round_trips),
      "echo_floor" => summarize(echoes),
      "bridge_cost" => summarize(bridge_cost),
      "ipc" => summarize(ipc),
      "kernel_us_p50" => BenchSupport.median(kernel),
      "server_us_p50" => BenchSupport.median(server),
      "stages_p50_us" =>
        Map.new(stages, fn k -> {k, BenchSupport.median(for t <- timings, do: t[k] || 0)} end),
      "client_parts_p50_us" => client,
      # What the medians leave of the round trip once the echo, the server's part and the
      # client's parts are taken out: the lane's cost beyond the echo's (e.g. the server's
      # reading and writing outside server_us). Medians of separate samples: an estimate, and
      # no split at all where the transfer dwarfs the rest (the ExPhil request's came out
      # negative).
      "rest_p50_us" =>
        BenchSupport.median(round_trips) - BenchSupport.median(echoes) - BenchSupport.median(server) -
          (client |> Map.values() |> Enum.sum()),
      "round_trip_over_echo" => BenchSupport.median(round_trips) / BenchSupport.median(echoes),
      "bridge_cost_over_echo" => BenchSupport.median(bridge_cost) / BenchSupport.median(echoes)
    }
  end

  defp summarize(values) do
    sorted = Enum.sort(values)

    %{
      "p50_us" => BenchSupport.percentile(sorted, 50),
      "p20_us" => BenchSupport.percentile(sorted, 20),
      "p80_us" => BenchSupport.percentile(sorted, 80),
      "p90_us" => BenchSupport.percentile(sorted, 90),
      "min_us" => hd(sorted)
    }
  end

  ## The echo

  defp unix_lane?(python, env) do
    {help, 0} = System.cmd(python, ["-m", "bridge", "--help"], env: env, stderr_to_stdout: true)
    String.contains?(help, "--unix")
  end

  defp start_echo(:port, echo, _python, bytes) do
    {:port,
     Port.open({:spawn_executable, echo}, [
       :binary,
       {:packet, 4},
       :exit_status,
       args: [Integer.to_string(bytes)]
     ])}
  end

  defp start_echo(:unix, echo, python, bytes) do
    path = Path.join(System.tmp_dir!(), "scan-bridge-echo-#{System.os_time()}.sock")

    # Accept one connection and become the echo with the socket as its stdin and stdout. Its
    # end of the socket gets the buffers the server gives its own (bridge/transports/unix.py's
    # SOCKET_BUFFER_BYTES, the size the client side asks for too): the echo must not move the
    # bytes through smaller ones than the bridge does.
    launcher = """
    import os, socket, sys
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(sys.argv[1]); s.listen(1)
    c, _ = s.accept()
    os.unlink(sys.argv[1])
    c.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, int(sys.argv[4]))
    c.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, int(sys.argv[4]))
    os.dup2(c.fileno(), 0); os.dup2(c.fileno(), 1)
    os.execv(sys.argv[2], [sys.argv[2], sys.argv[3]])
    """

    buffer = Keyword.fetch!(ScanBridge.Server.socket_options(), :sndbuf)

    owner =
      Port.open({:spawn_executable, python}, [
        :binary,
        :exit_status,
        args: ["-c", launcher, path, echo, Integer.to_string(bytes), Integer.to_string(buffer)]
      ])

    socket = connect(path, 200)
    {:unix, socket, owner}
  end

  defp connect(path, tries) do
    case :gen_tcp.connect({:local, path}, 0, ScanBridge.Server.socket_options()) do
      {:ok, socket} ->
        socket

      {:error, _} when tries > 0 ->
        Process.sleep(10)
        connect(path, tries - 1)
    end
  end

  defp stop_echo({:port, port}), do: Port.close(port)
  defp stop_echo({:unix, socket, _launcher}), do: :gen_tcp.close(socket)

  defp echo_round_trip(echo, request) do
    {:ok, us} =
      BenchSupport.timed(fn ->
        case echo do
          {:port, port} ->
            Port.command(port, request)
            receive do: ({^port, {:data, _}} -> :ok)

          {:unix, socket, _launcher} ->
            :ok = :gen_tcp.send(socket, request)
            receive do: ({:tcp, ^socket, _} -> :ok)
        end
      end)

    us
  end

  ## Goals (issue 7) and the report

  # Each goal's ratio per round, and their median over the rounds.
  defp goals(results, rounds) do
    per_round =
      for round <- 1..rounds, do: round_ratios(Enum.filter(results, &(&1["round"] == round)))

    medians =
      for key <- per_round |> hd() |> Map.keys(), into: %{} do
        values = for r <- per_round, r[key] != nil, do: r[key]
        {key, if(values == [], do: nil, else: BenchSupport.median(values))}
      end

    Map.merge(medians, %{
      "per_round" => per_round,
      "port_exphil_goal" => "<= 1.15 (round trip minus kernel_us, over the Port echo)",
      "unix_speedup_goal" => ">= 3 (round trip minus kernel_us, Port over unix)",
      "port_step_goal" => "<= 1.5 (p50 round trip over the Port echo)"
    })
  end

  defp round_ratios(results) do
    find = fn case_prefix, lane ->
      Enum.find(results, &(String.starts_with?(&1["case"], case_prefix) and &1["lane"] == lane))
    end

    port_scan = find.("exphil", "port")
    unix_scan = find.("exphil", "unix")
    port_step = find.("step", "port")

    %{
      "port_exphil_bridge_cost_over_echo" => port_scan["bridge_cost_over_echo"],
      "unix_speedup_over_port_exphil" =>
        unix_scan && port_scan["bridge_cost"]["p50_us"] / unix_scan["bridge_cost"]["p50_us"],
      "port_step_round_trip_over_echo" => port_step && port_step["round_trip_over_echo"]
    }
  end

  defp report(results, summary) do
    for r <- results do
      IO.puts(
        "round #{r["round"]}: #{r["case"]} over #{r["lane"]} (backend #{r["backend"]}): request #{r["request_frame_bytes"]} B, reply #{r["reply_frame_bytes"]} B, #{r["iterations"]} iterations, p50 (p20–p80)"
      )

      for key <- ~w(round_trip echo_floor bridge_cost ipc) do
        s = r[key]

        IO.puts(
          "  #{String.pad_trailing(key, 12)} #{fmt(s["p50_us"])}  (#{fmt(s["p20_us"])} – #{fmt(s["p80_us"])})"
        )
      end

      c = r["client_parts_p50_us"]

      IO.puts(
        "  client parts p50: encode #{fmt(c["encode_us"])}, decode #{fmt(c["decode_us"])}, process hop #{fmt(c["process_hop_us"])}; rest #{fmt(r["rest_p50_us"])}"
      )

      b = r["client_parts_back_to_back_p50_us"]

      IO.puts(
        "  client parts back to back p50: encode #{fmt(b["encode_us"])}, decode #{fmt(b["decode_us"])}, process hop #{fmt(b["process_hop_us"])}"
      )

      IO.puts(
        "  kernel_us p50 #{fmt(r["kernel_us_p50"])}, server_us p50 #{fmt(r["server_us_p50"])}; round trip / echo #{Float.round(r["round_trip_over_echo"], 2)}, bridge cost / echo #{Float.round(r["bridge_cost_over_echo"], 2)}"
      )
    end

    IO.puts("goals: #{inspect(summary, pretty: true)}")
  end

  defp fmt(us) when us >= 1000, do: "#{Float.round(us / 1000, 2)} ms"
  defp fmt(us), do: "#{Float.round(us * 1.0, 1)} µs"
end

RoundtripBench.main(System.argv())
