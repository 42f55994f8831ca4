# Whole models on the server (SPEC §6.4), from Elixir over the Port: one `model_step` of an
# ExPhil-sized backbone (4 layers, d_model 256, expand 2, d_conv 4; Mamba-1 with state 16,
# dt_rank 16; Mamba-2 with headdim 64, state 64, 1 group: 8 heads), embeddings in
# (`embeds` [batch, 256] f32) and hidden states out, one per 60 FPS frame (16.7 ms apart),
# against a framing-only echo answering the same request bytes with a reply of the same size,
# in one run. The Elixir side of the repository's bench/models.py (its (d) and snapshots).
#
# For each arch × batch, on a fresh client (caller → ScanBridge client process → Port → server):
#
#   * a seeded random backbone built here and sent with `ScanBridge.load_model/3` (config and
#     weights, as ExPhil's live in Elixir), a session of it, a 60-frame prefill through
#     `model_forward/4`, 20 warm-up steps (and 20 warm-up echoes);
#   * then `--frames` frames, each paced from the run's start: at the frame's start one model
#     step round trip, half a frame later one round trip of the same request bytes (built once,
#     outside the timing) through the C pipe echo (bridge/bench/echo/pipe_echo.c, as
#     bench/roundtrip.exs starts it) answering with a frame of the server's reply size.
#     Even frames time the public `ScanBridge.model_step/4`; odd frames its body one level
#     down, `ScanBridge.Server.request(client, "model_step", ...)` and the output's decoding,
#     which also returns the server's `timing` (`kernel_us`, `server_us`) that `model_step/4`
#     drops. Same request bytes, same processes; the two are reported apart and together;
#   * 100 snapshot + restore pairs back to back through the public API (the first 10 dropped),
#     then 100 more one level down for the server's part of them;
#   * a netcode client's frames, the state before each kept in a ring of 7 snapshots: two more
#     sessions prefilled alike, paced a frame apart and half a frame from each other (which goes
#     first swapped each frame), one keeping its ring by requests of its own (`snapshot/3` before
#     the step, `free_snapshot/3` of the one 7 frames old after it), the other by the step's
#     `snapshot_into:` (one request); 20 warm-up frames, then up to 120, public API.
#
#   mix run bench/models.exs [--frames 300] [--batches 1,32] [--archs mamba,mamba2]
#                            [--device cpu] [--out PATH]
#
# Run the BEAM as docs/operations.md ("BEAM scheduler setting") says for a machine whose cores
# it shares with the server, ELIXIR_ERL_OPTIONS="+sbwt none +sbwtdcpu none +sbwtdio none", as
# the recorded elixir-roundtrip.json was; the script says so when they are not set. On 2 cores,
# while this was written, short runs with the default options (busy-waiting schedulers) had the
# server's step (kernel_us p50) at 10-30 ms instead of about 2 ms in 3 runs of 8, and in none
# of 7 with these options.
#
# Needs $PYTHON (default: the checkout's .venv) and cc. Writes JSON (with machine and commit
# info) to the git-ignored ../bench/out/elixir-models.json by default; to record a reference,
# `--out ../bench/results/elixir-models.json`.

Code.require_file("support.exs", __DIR__)

# compiled in already under MIX_ENV=test (elixirc_paths); its backbone/2 and stack_frames/1 need
# nothing else of the test support
unless Code.ensure_loaded?(ScanBridge.TestSupport.Models),
  do: Code.require_file("../test/support/models.ex", __DIR__)

defmodule ModelsBench do
  alias ScanBridge.{Protocol, Server, Tensor}
  alias ScanBridge.TestSupport.{JSON, Models}

  @root Path.expand("../..", __DIR__)
  @frame_us 1.0e6 / 60
  @warmup 20
  @window 60
  @pairs 100
  @pairs_dropped 10
  @ring 7
  @ring_frames 120
  @d_model 256
  @configs %{
    "mamba" => %{
      "arch" => "mamba",
      "d_model" => @d_model,
      "n_layer" => 4,
      "d_state" => 16,
      "d_conv" => 4,
      "expand" => 2,
      "dt_rank" => 16
    },
    "mamba2" => %{
      "arch" => "mamba2",
      "d_model" => @d_model,
      "n_layer" => 4,
      "d_state" => 64,
      "d_conv" => 4,
      "expand" => 2,
      "headdim" => 64,
      "ngroups" => 1
    }
  }

  def main(argv) do
    {opts, rest, invalid} =
      OptionParser.parse(argv,
        strict: [frames: :integer, batches: :string, archs: :string, device: :string, out: :string]
      )

    if rest != [] or invalid != [],
      do: raise(ArgumentError, "unexpected arguments: #{inspect(rest ++ invalid)}")

    frames = Keyword.get(opts, :frames, 300)

    batches =
      opts |> Keyword.get(:batches, "1,32") |> String.split(",") |> Enum.map(&String.to_integer/1)

    archs = opts |> Keyword.get(:archs, "mamba,mamba2") |> String.split(",")
    device = Keyword.get(opts, :device, "cpu")
    out = Keyword.get(opts, :out, Path.join(@root, "bench/out/elixir-models.json"))

    for arch <- archs,
        not Map.has_key?(@configs, arch),
        do: raise(ArgumentError, "--archs: unknown #{inspect(arch)} (mamba, mamba2)")

    python = System.get_env("PYTHON") || Path.join(@root, ".venv/bin/python")
    env = [{"PYTHONPATH", System.get_env("PYTHONPATH") || @root}, {"SCAN_BRIDGE_LOG", "WARNING"}]
    echo = BenchSupport.build_echo(python, env)
    load_before = load_avg()
    erl_options = System.get_env("ELIXIR_ERL_OPTIONS") || ""

    unless String.contains?(erl_options, "+sbwt none"),
      do:
        IO.puts(
          "note: the BEAM's schedulers busy-wait (ELIXIR_ERL_OPTIONS has no \"+sbwt none\"): " <>
            "they take cores from the server; see docs/operations.md, BEAM scheduler setting"
        )

    cases =
      for arch <- archs, batch <- batches do
        result = run_case(arch, batch, frames, device, echo, python, env)
        report(result)
        result
      end

    doc = %{
      "benchmark" => "elixir-models",
      "machine" => BenchSupport.machine(python, env),
      "commit" => BenchSupport.commit(),
      "settings" => %{
        "frames" => frames,
        "frame_us" => @frame_us,
        "warmup_steps" => @warmup,
        "prefill_frames" => @window,
        "snapshot_restore_pairs" => @pairs,
        "snapshot_restore_dropped" => @pairs_dropped,
        "ring_snapshots" => @ring,
        "ring_frames" => @ring_frames,
        "device" => device,
        "lane" => "port",
        "configs" => Map.take(@configs, archs)
      },
      "notes" => %{
        "model_step" =>
          "every frame's model step round trip, caller → client process → server → back, " <>
            "output decoded: even frames ScanBridge.model_step/4 (model_step_api), odd frames " <>
            "ScanBridge.Server.request/4 + Tensor.from_wire, model_step/4's body, which keeps " <>
            "the server's timing that model_step/4 drops (model_step_request; kernel_us and " <>
            "server_us come from these frames only)",
        "echo" =>
          "half a frame after each step, the same request bytes (encoded before the loop) to " <>
            "the C pipe echo over a Port ({:packet, 4}), answered with a frame of the server's " <>
            "reply size",
        "step_over_echo" => "model_step_api p50 / echo p50",
        "snapshot_restore" =>
          "snapshot/3 + restore/4 back to back, public API; the server's part from as many " <>
            "pairs again through ScanBridge.Server.request/4 (the public calls drop timing)",
        "ring_frames" =>
          "two more sessions paced a frame apart, half a frame from each other, order swapped " <>
            "each frame: snapshot/3 + model_step/4 + free_snapshot/3 of the snapshot #{@ring} " <>
            "frames old (ring_frame_own_requests) against model_step/4 with snapshot_into: " <>
            "(ring_frame_snapshot_into), public API"
      },
      "load_before" => load_before,
      "load_after" => load_avg(),
      "cases" => cases
    }

    File.mkdir_p!(Path.dirname(out))
    File.write!(out, JSON.encode!(doc) <> "\n")
    IO.puts("wrote #{out}")
  end

  ## One arch × batch

  defp run_case(arch, batch, frames_n, device, echo_path, python, env) do
    config = Map.fetch!(@configs, arch)
    backbone = Models.backbone(config, batch)
    :rand.seed(:exsss, {7, batch, 13})
    frames = for _ <- 1..(frames_n + @window), do: random({batch, @d_model})
    {prefill, steps} = Enum.split(frames, @window)
    steps = Enum.take(steps, frames_n)

    {:ok, client} = ScanBridge.start_link(python: python, env: env, args: ["--device", device])

    try do
      {:ok, server_info} = ScanBridge.info(client)
      {:ok, model} = ScanBridge.load_model(client, backbone)
      {:ok, session} = ScanBridge.open_session(client, model: model, batch: batch)

      {:ok, _hidden} =
        ScanBridge.model_forward(client, session, {:embeds, Models.stack_frames(prefill)},
          output: :hidden
        )

      api = fn x -> ScanBridge.model_step(client, session, {:embeds, x}, output: :hidden) end
      args = fn x -> %{"session" => session, "embeds" => x, "output" => "hidden"} end

      request = fn x ->
        case Server.request(client, "model_step", args.(x), 30_000) do
          {:ok, %{"hidden" => wire}, timing} ->
            {:ok, hidden} = Tensor.from_wire(wire)
            {hidden, timing}
        end
      end

      # The echo's request: this frame's request body as the client sends it; its reply: the
      # server's reply body size to it (a first step's result and timing; timing values vary
      # by a few bytes).
      echo_request = fn x ->
        {head, _size} =
          Protocol.request_head("model_step", Protocol.wire_args!(args.(x), "model_step"))

        IO.iodata_to_binary([head, Protocol.id_entry(1)])
      end

      {:ok, first, first_timing} = Server.request(client, "model_step", args.(hd(steps)), 30_000)
      {:ok, first_hidden} = Tensor.from_wire(first["hidden"])
      reply_bytes = BenchSupport.reply_size(first, first_timing)
      echo_requests = Enum.map(steps, echo_request)
      echo = start_echo(echo_path, reply_bytes)

      # warm-up: page faults, first-call allocations, the server's step graphs
      for {x, req} <- Enum.zip(steps, echo_requests) |> Enum.take(@warmup) do
        {:ok, _} = api.(x)
        {_, _} = request.(x)
        echo_round_trip(echo, req)
      end

      start = System.monotonic_time(:microsecond)

      samples =
        for {{x, req}, i} <- Enum.with_index(Enum.zip(steps, echo_requests)) do
          wait_for_frame(start, i)

          step =
            if rem(i, 2) == 0 do
              {{:ok, _hidden}, us} = BenchSupport.timed(fn -> api.(x) end)
              {:api, us, nil}
            else
              {{_hidden, timing}, us} = BenchSupport.timed(fn -> request.(x) end)
              {:request, us, timing}
            end

          wait_for_frame(start, i + 0.5)
          {step, echo_round_trip(echo, req)}
        end

      stop_echo(echo)

      api_us = for {{:api, us, _}, _} <- samples, do: us
      request_us = for {{:request, us, _}, _} <- samples, do: us
      all_us = for {{_, us, _}, _} <- samples, do: us
      timings = for {{:request, _, t}, _} <- samples, do: t
      echo_us = for {_, e} <- samples, do: e

      pairs = snapshot_restore(client, session)
      pairs_server = snapshot_restore_server(client, session)
      {ring_own, ring_into} = ring_frames(client, model, batch, prefill, steps)

      :ok = ScanBridge.close_session(client, session)
      :ok = ScanBridge.free_model(client, model)

      {hidden_rows, @d_model} = first_hidden.shape
      true = hidden_rows == batch

      result = %{
        "arch" => arch,
        "batch" => batch,
        "layers" => config["n_layer"],
        "d_model" => @d_model,
        "frames" => frames_n,
        "backend" => server_info["backend"],
        "model" => Map.drop(model, ["model"]),
        "request_frame_bytes" => byte_size(hd(echo_requests)) + 4,
        "reply_frame_bytes" => reply_bytes + 4,
        "model_step" => summarize(all_us),
        "model_step_api" => summarize(api_us),
        "model_step_request" => summarize(request_us),
        "model_step_server" => summarize(for t <- timings, do: t["server_us"] || 0),
        "model_step_kernel" => summarize(for t <- timings, do: t["kernel_us"] || 0),
        "model_step_stages_p50_us" => stages_p50(timings),
        "echo" => summarize(echo_us),
        "snapshot_restore_round_trips" => summarize(pairs),
        "snapshot_restore_server" => summarize(pairs_server),
        "ring_frame_own_requests" => summarize(ring_own),
        "ring_frame_snapshot_into" => summarize(ring_into),
        "ratios" => %{
          "ring_own_requests_over_snapshot_into" =>
            BenchSupport.median(ring_own) / BenchSupport.median(ring_into),
          "step_over_echo" => BenchSupport.median(api_us) / BenchSupport.median(echo_us),
          "step_request_over_echo" =>
            BenchSupport.median(request_us) / BenchSupport.median(echo_us),
          "step_all_frames_over_echo" => BenchSupport.median(all_us) / BenchSupport.median(echo_us),
          # what the round trip spends beyond the server's own part, over the echo
          "step_minus_server_over_echo" =>
            (BenchSupport.median(request_us) -
               BenchSupport.median(for t <- timings, do: t["server_us"] || 0)) /
              BenchSupport.median(echo_us)
        }
      }

      result
    after
      GenServer.stop(client)
    end
  end

  defp snapshot_restore(client, session) do
    times =
      for _ <- 1..@pairs do
        {{:ok, snapshot}, us} =
          BenchSupport.timed(fn ->
            {:ok, snapshot} = ScanBridge.snapshot(client, session)
            :ok = ScanBridge.restore(client, session, snapshot)
            {:ok, snapshot}
          end)

        :ok = ScanBridge.free_snapshot(client, snapshot)
        us
      end

    Enum.drop(times, @pairs_dropped)
  end

  # {the frames keeping their ring by requests of their own, those keeping it by snapshot_into}:
  # each frame's round trips together (µs), the warm-up dropped.
  defp ring_frames(client, model, batch, prefill, steps) do
    [own, into] =
      for _ <- 1..2 do
        {:ok, session} = ScanBridge.open_session(client, model: model, batch: batch)
        window = {:embeds, Models.stack_frames(prefill)}

        {:ok, _} =
          ScanBridge.model_forward(client, session, window, output: :hidden, last_only: true)

        session
      end

    ring = List.to_tuple(for _ <- 1..@ring, do: ScanBridge.snapshot!(client, into))
    frames = Enum.take(steps, @warmup + @ring_frames)

    with_requests = fn x, kept ->
      BenchSupport.timed(fn ->
        {:ok, snapshot} = ScanBridge.snapshot(client, own)
        {:ok, _} = ScanBridge.model_step(client, own, {:embeds, x}, output: :hidden)
        kept = kept ++ [snapshot]

        if length(kept) > @ring do
          [oldest | rest] = kept
          :ok = ScanBridge.free_snapshot(client, oldest)
          rest
        else
          kept
        end
      end)
    end

    into_ring = fn x, i ->
      snapshot = elem(ring, rem(i, @ring))

      {{:ok, _}, us} =
        BenchSupport.timed(fn ->
          ScanBridge.model_step(client, into, {:embeds, x}, output: :hidden, snapshot_into: snapshot)
        end)

      us
    end

    start = System.monotonic_time(:microsecond)

    {samples, kept} =
      frames
      |> Enum.with_index()
      |> Enum.map_reduce([], fn {x, i}, kept ->
        order = if rem(i, 2) == 0, do: [:into, :own], else: [:own, :into]

        {times, kept} =
          order
          |> Enum.with_index()
          |> Enum.map_reduce(kept, fn {which, half}, kept ->
            wait_for_frame(start, i + 0.5 * half)

            case which do
              :own ->
                {kept, us} = with_requests.(x, kept)
                {{:own, us}, kept}

              :into ->
                {{:into, into_ring.(x, i)}, kept}
            end
          end)

        {{i, times}, kept}
      end)

    Enum.each(kept ++ Tuple.to_list(ring), &(:ok = ScanBridge.free_snapshot(client, &1)))
    :ok = ScanBridge.close_session(client, own)
    :ok = ScanBridge.close_session(client, into)
    measured = for {i, times} <- samples, i >= @warmup, time <- times, do: time
    {for({:own, us} <- measured, do: us), for({:into, us} <- measured, do: us)}
  end

  defp snapshot_restore_server(client, session) do
    times =
      for _ <- 1..@pairs do
        {:ok, %{"snapshot" => snapshot}, taken} =
          Server.request(client, "session_snapshot", %{"session" => session}, 30_000)

        {:ok, _, restored} =
          Server.request(
            client,
            "session_restore",
            %{"session" => session, "snapshot" => snapshot},
            30_000
          )

        :ok = ScanBridge.free_snapshot(client, snapshot)
        (taken["server_us"] || 0) + (restored["server_us"] || 0)
      end

    Enum.drop(times, @pairs_dropped)
  end

  defp stages_p50(timings) do
    timings
    |> Enum.flat_map(&Map.keys/1)
    |> Enum.uniq()
    |> Map.new(fn k -> {k, BenchSupport.median(for t <- timings, is_number(t[k]), do: t[k])} end)
  end

  ## Inputs

  defp random(shape) do
    count = shape |> Tuple.to_list() |> Enum.product()
    data = for _ <- 1..count, into: <<>>, do: <<2.0 * :rand.uniform_real() - 1.0::float-32-little>>
    Tensor.new(data, :f32, shape)
  end

  ## Pacing and timing

  # Sleep until frame `frame` (a float: 0.5 is half a frame in) of the run that began at
  # `start` (µs, monotonic); a frame already due is not waited for.
  defp wait_for_frame(start, frame) do
    delay = start + round(frame * @frame_us) - System.monotonic_time(:microsecond)
    if delay > 0, do: Process.sleep(div(delay + 999, 1000))
  end

  ## The echo (as bench/roundtrip.exs builds and runs it, on the Port lane)

  defp start_echo(echo, bytes) do
    Port.open({:spawn_executable, echo}, [
      :binary,
      {:packet, 4},
      :exit_status,
      args: [Integer.to_string(bytes)]
    ])
  end

  defp stop_echo(port), do: Port.close(port)

  defp echo_round_trip(port, request) do
    {:ok, us} =
      BenchSupport.timed(fn ->
        Port.command(port, request)
        receive do: ({^port, {:data, _}} -> :ok)
      end)

    us
  end

  ## Summaries

  defp summarize(values), do: BenchSupport.summary_us(values)

  defp report(r) do
    line = fn name, s ->
      "    #{String.pad_trailing(name, 36)} p50 #{fmt(s["p50_us"])}  p99 #{fmt(s["p99_us"])}  (n #{s["n"]})"
    end

    IO.puts(
      "#{r["arch"]} batch #{r["batch"]} (backend #{r["backend"]}): request #{r["request_frame_bytes"]} B, reply #{r["reply_frame_bytes"]} B, #{r["frames"]} frames at 60 FPS"
    )

    IO.puts(line.("model_step, every frame", r["model_step"]))
    IO.puts(line.("  ScanBridge.model_step/4 (even)", r["model_step_api"]))
    IO.puts(line.("  Server.request model_step (odd)", r["model_step_request"]))
    IO.puts(line.("  of which the server (server_us)", r["model_step_server"]))
    IO.puts(line.("  of which the stack (kernel_us)", r["model_step_kernel"]))
    IO.puts(line.("echo of the same bytes (Port)", r["echo"]))
    IO.puts(line.("snapshot + restore round trips", r["snapshot_restore_round_trips"]))
    IO.puts(line.("  of which the server", r["snapshot_restore_server"]))
    IO.puts(line.("ring of #{@ring}: own requests a frame", r["ring_frame_own_requests"]))
    IO.puts(line.("ring of #{@ring}: snapshot_into", r["ring_frame_snapshot_into"]))
    ratios = r["ratios"]

    IO.puts(
      "    step / echo #{Float.round(ratios["step_over_echo"], 2)}× (model_step/4 p50; Server.request #{Float.round(ratios["step_request_over_echo"], 2)}×, every frame #{Float.round(ratios["step_all_frames_over_echo"], 2)}×), step minus server_us / echo #{Float.round(ratios["step_minus_server_over_echo"], 2)}×"
    )
  end

  defp fmt(us),
    do: us |> Float.round(1) |> Float.to_string() |> String.pad_leading(9) |> Kernel.<>(" µs")

  ## Where and what was measured

  defp load_avg do
    case File.read("/proc/loadavg") do
      {:ok, text} ->
        text |> String.split() |> Enum.take(3) |> Enum.map(&String.to_float/1)

      _ ->
        nil
    end
  end
end

ModelsBench.main(System.argv())
