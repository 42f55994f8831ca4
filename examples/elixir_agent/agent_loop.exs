# An Elixir agent loop on a whole model kept by a scan-bridge server (protocol/SPEC.md §6.4).
#
#   cd elixir_client && mix run ../examples/elixir_agent/agent_loop.exs [options]
#
# It starts the server as a Port (through the client library), loads a model -- by default a
# random Mamba-2 backbone built here and sent (d_model 256, 4 layers, ExPhil-sized), or a
# checkpoint under --model-dir -- warms up from a 60-frame prefix with one model_forward, then
# steps one frame at a time at 60 FPS, sleeping to each frame's deadline. It keeps a ring of 7
# snapshots, taken once: each frame's step copies the state before the frame into the ring's
# next one (`snapshot_into`), so a frame is one round trip. Every 60 frames it plays a
# misprediction: the last 7 frames' inputs were wrong, so it restores the snapshot taken before
# them and re-simulates them, corrected, a model_step each run in the restore's request (one
# round trip), each copying the corrected state before it into the ring, then goes on. At the
# end it prints the step latency (p50/p99) and the rollbacks' cost.
#
# Options (defaults in brackets):
#   --frames N          frames stepped after the warm-up [180]
#   --prefix N          frames of the warm-up window [60]
#   --rollback N        frames a misprediction rolls back [7]
#   --rollback-every N  frames between mispredictions [60]
#   --fps N             frame rate [60]
#   --model-dir DIR     a directory the server may read checkpoints under
#   --path NAME         the checkpoint to load, under --model-dir (else a random backbone)
#   --dtype f32|bf16|f16  what the server keeps the weights in [f32]
#   --device auto|cpu|cuda  the server's device [auto]
#   --seed N            seed of the random backbone and inputs [1]
#   --threads N         CPU threads one kernel call may use on the server (its --threads) [torch's]
#   --python PATH       the server's interpreter [$PYTHON, $SCAN_BRIDGE_PYTHON, the repository's
#                       .venv/bin/python, python3]

defmodule AgentLoop do
  alias ScanBridge.Tensor

  @repo_root Path.expand("../..", __DIR__)

  @switches [
    frames: :integer,
    prefix: :integer,
    rollback: :integer,
    rollback_every: :integer,
    fps: :integer,
    model_dir: :string,
    path: :string,
    dtype: :string,
    device: :string,
    seed: :integer,
    threads: :integer,
    python: :string
  ]
  @defaults [
    frames: 180,
    prefix: 60,
    rollback: 7,
    rollback_every: 60,
    fps: 60,
    dtype: "f32",
    device: "auto",
    seed: 1
  ]

  # The random backbone: ExPhil-sized Mamba-2 (the server's own config keys, no vocabulary:
  # embeddings in, hidden states out).
  @backbone %{
    "arch" => "mamba2",
    "d_model" => 256,
    "n_layer" => 4,
    "d_state" => 64,
    "d_conv" => 4,
    "expand" => 2,
    "headdim" => 64,
    "ngroups" => 1
  }

  def main(argv) do
    opts = options!(argv)
    :rand.seed(:exsss, {opts[:seed], 17, 29})
    {:ok, server} = ScanBridge.start_link(server_options(opts))

    try do
      run(server, opts)
    after
      GenServer.stop(server)
    end
  end

  defp run(server, opts) do
    {:ok, info} = ScanBridge.info(server)

    device = get_in(info, ["device", "device"]) || inspect(info["device"])
    IO.puts("server: pid #{info["pid"]}, device #{device}, kernels backend #{info["backend"]}")

    {model, label} = load(server, opts)

    IO.puts(
      "loaded #{label}: #{model["arch"]}, #{model["layers"]} layers, d_model #{model["d_model"]}, " <>
        "#{mb(model["weight_bytes"])} MB of weights (#{model["dtype"]}), " <>
        "#{mb(model["state_bytes_per_row"])} MB of state per row"
    )

    input = input_kind(model)
    session = ScanBridge.open_session(server, model: model, batch: 1) |> ok!()

    # Warm-up: the prefix in one window, the state left at its end.
    {prefix_us, _last} =
      :timer.tc(fn ->
        ScanBridge.model_forward!(server, session, window(input, opts[:prefix]), last_only: true)
      end)

    IO.puts("warm-up: a #{opts[:prefix]}-frame prefix in #{ms(prefix_us)} ms (one model_forward)")
    check_rollback(server, session, input, opts[:rollback])

    # The rollback ring: its snapshots are taken again frame by frame, never freed meanwhile.
    ring = for _ <- 1..opts[:rollback], do: ScanBridge.snapshot!(server, session)
    stats = loop(server, session, input, List.to_tuple(ring), opts)
    Enum.each(ring, &(:ok = ScanBridge.free_snapshot(server, &1)))

    :ok = ScanBridge.close_session(server, session)
    :ok = ScanBridge.free_model(server, model)
    report(stats, opts)
  end

  ## The loop

  # `ring`: the snapshots frame f's step takes the state before f into, at f mod its size;
  # `held`: the frames whose state before them the ring still holds, frame => snapshot.
  defp loop(server, session, input, ring, opts) do
    frame_us = 1_000_000 / opts[:fps]
    start = System.monotonic_time(:microsecond)
    initial = %{held: %{}, steps: [], rollbacks: [], missed: 0}

    Enum.reduce(1..opts[:frames]//1, initial, fn frame, stats ->
      deadline = start + round(frame * frame_us)

      # One request: the state before this frame into the ring, for a rollback to come back to,
      # then the frame.
      snapshot = elem(ring, rem(frame, tuple_size(ring)))

      {step_us, _out} =
        :timer.tc(fn ->
          ScanBridge.model_step!(server, session, frame_input(input), snapshot_into: snapshot)
        end)

      held =
        stats.held |> Map.reject(fn {_frame, s} -> s == snapshot end) |> Map.put(frame, snapshot)

      stats = %{stats | held: held, steps: [step_us | stats.steps]}

      stats =
        if rem(frame, opts[:rollback_every]) == 0,
          do: rollback(server, session, input, frame, stats),
          else: stats

      late = System.monotonic_time(:microsecond) - deadline
      if late < 0, do: Process.sleep(div(-late, 1000))
      if late > 0, do: %{stats | missed: stats.missed + 1}, else: stats
    end)
  end

  # A misprediction: the inputs of the frames since the oldest state the ring holds were wrong.
  # Back to the state before them, and the corrected frames re-simulated a step each, in the
  # same request; each step after the first copies the corrected state before it into the
  # frame's snapshot of the ring, so a later misprediction can still come back to any of them.
  defp rollback(server, session, input, last, stats) do
    first = stats.held |> Map.keys() |> Enum.min()
    snapshot = stats.held[first]

    resimulate =
      for frame <- first..last//1 do
        # frame `first`'s state before it is the snapshot being restored
        into = if frame == first, do: [], else: [snapshot_into: stats.held[frame]]
        {:model_step, frame_input(input), into}
      end

    {us, {:ok, outs}} =
      :timer.tc(fn -> ScanBridge.restore_with_frames(server, session, snapshot, resimulate) end)

    %{stats | rollbacks: [{length(outs), us} | stats.rollbacks]}
  end

  # What rollback netcode stands on: frames re-simulated from a snapshot with the same inputs
  # give the outputs the frames gave. `frames` steps from a snapshot, then the snapshot
  # restored and the same inputs run again as one window (a chunked scan, so the sums run in
  # another order: equal to rounding, not bit for bit). The session is left as after the steps.
  defp check_rollback(server, session, input, frames) do
    snapshot = ScanBridge.snapshot!(server, session)
    inputs = for _ <- 1..frames, do: frame_input(input)
    stepped = Enum.map(inputs, &ScanBridge.model_step!(server, session, &1))
    {kind, _} = hd(inputs)
    data = for {_kind, tensor} <- inputs, into: <<>>, do: tensor.data
    shape = inputs |> hd() |> elem(1) |> Map.fetch!(:shape) |> Tuple.insert_at(1, frames)
    window = {kind, Tensor.new(data, elem(hd(inputs), 1).dtype, shape)}

    {:ok, [replayed]} =
      ScanBridge.restore_with_frames(server, session, snapshot, [{:model_forward, window, []}])

    :ok = ScanBridge.free_snapshot(server, snapshot)
    expected = Enum.flat_map(stepped, &Tensor.to_list/1)
    scale = expected |> Enum.map(&abs/1) |> Enum.max()

    worst =
      Enum.zip(expected, Tensor.to_list(replayed))
      |> Enum.map(fn {a, b} -> abs(a - b) / scale end)
      |> Enum.max()

    IO.puts(
      "rollback check: #{frames} frames stepped, restored and re-simulated in one window: " <>
        "largest difference #{:erlang.float_to_binary(worst, [{:scientific, 1}])} of the largest output"
    )
  end

  ## Inputs: token ids for a model with an embedding, else embeddings

  defp input_kind(%{"vocab_size" => vocab}) when is_integer(vocab), do: {:tokens, vocab}
  defp input_kind(%{"d_model" => d_model}), do: {:embeds, d_model}

  # One frame's input, [1] or [1, d_model]: the agent's observation (random here).
  defp frame_input({:tokens, vocab}), do: {:tokens, Tensor.new(token(vocab), :i64, {1})}
  defp frame_input({:embeds, d}), do: {:embeds, Tensor.new(observation(d), :f32, {1, d})}

  # `frames` frames' inputs as one window, [1, frames] or [1, frames, d_model].
  defp window({:tokens, vocab}, frames) do
    data = for _ <- 1..frames, into: <<>>, do: token(vocab)
    {:tokens, Tensor.new(data, :i64, {1, frames})}
  end

  defp window({:embeds, d}, frames) do
    data = for _ <- 1..frames, into: <<>>, do: observation(d)
    {:embeds, Tensor.new(data, :f32, {1, frames, d})}
  end

  defp token(vocab), do: <<:rand.uniform(vocab) - 1::64-signed-little>>
  defp observation(d), do: uniform_data(d, -1.0, 1.0)

  ## The model

  defp load(server, opts) do
    case opts[:path] do
      nil ->
        {gen_us, weights} = :timer.tc(fn -> random_weights(@backbone) end)
        IO.puts("built a random Mamba-2 backbone in #{ms(gen_us)} ms: #{inspect(@backbone)}")

        {load_us, model} =
          :timer.tc(fn ->
            ScanBridge.load_model!(server, %{config: @backbone, weights: weights},
              dtype: opts[:dtype],
              timeout: 120_000
            )
          end)

        IO.puts("sent it in #{ms(load_us)} ms")
        {model, "a random backbone"}

      path ->
        {load_us, model} =
          :timer.tc(fn ->
            ScanBridge.load_model!(server, path, dtype: opts[:dtype], timeout: 300_000)
          end)

        IO.puts("read #{path} in #{ms(load_us)} ms")
        {model, path}
    end
  end

  # Every weight of a backbone of `config` by name (as transformers and mamba_ssm name them),
  # f32: projections uniform in ±1/sqrt(fan_in) (PyTorch's Linear init), norms near 1, A_log in
  # [0, 1] (A = -exp(A_log)), dt biases in [-4, -2] (dt = softplus(dt + bias) small).
  defp random_weights(config) do
    %{"d_model" => d, "n_layer" => layers, "d_state" => n, "d_conv" => k, "headdim" => p} = config
    groups = config["ngroups"]
    inner = config["expand"] * d
    heads = div(inner, p)
    conv = inner + 2 * groups * n

    layer = fn i ->
      m = "layers.#{i}.mixer."

      [
        {"layers.#{i}.norm.weight", {d}, {0.9, 1.1}},
        {m <> "in_proj.weight", {2 * inner + 2 * groups * n + heads, d}, fan_in(d)},
        {m <> "conv1d.weight", {conv, 1, k}, fan_in(k)},
        {m <> "conv1d.bias", {conv}, fan_in(k)},
        {m <> "dt_bias", {heads}, {-4.0, -2.0}},
        {m <> "A_log", {heads}, {0.0, 1.0}},
        {m <> "D", {heads}, {0.5, 1.5}},
        {m <> "norm.weight", {inner}, {0.9, 1.1}},
        {m <> "out_proj.weight", {d, inner}, fan_in(inner)}
      ]
    end

    (Enum.flat_map(0..(layers - 1), layer) ++ [{"norm_f.weight", {d}, {0.9, 1.1}}])
    |> Map.new(fn {name, shape, {lo, hi}} -> {name, uniform(shape, lo, hi)} end)
  end

  defp fan_in(n), do: {-1 / :math.sqrt(n), 1 / :math.sqrt(n)}

  # Floats from the process's (seeded) random bytes, each u32 scaled into [lo, hi): several
  # times faster than a :rand call per element for the backbone's 1.7 M weights.
  defp uniform(shape, lo, hi) do
    count = shape |> Tuple.to_list() |> Enum.product()
    Tensor.new(uniform_data(count, lo, hi), :f32, shape)
  end

  defp uniform_data(count, lo, hi) do
    scale = (hi - lo) / 4_294_967_296
    for <<u::32 <- :rand.bytes(4 * count)>>, into: <<>>, do: <<lo + scale * u::float-32-little>>
  end

  ## The report

  defp report(stats, opts) do
    steps = stats.steps

    IO.puts(
      "step latency: p50 #{ms(percentile(steps, 50))} ms, p99 #{ms(percentile(steps, 99))} ms " <>
        "over #{length(steps)} steps, each taking the state before it into the rollback ring " <>
        "(one request a frame)"
    )

    case stats.rollbacks do
      [] ->
        IO.puts(
          "rollbacks: none (every #{opts[:rollback_every]} frames, #{opts[:frames]} frames run)"
        )

      rollbacks ->
        frames = rollbacks |> Enum.map(&elem(&1, 0)) |> Enum.max()
        costs = Enum.map(rollbacks, &elem(&1, 1))

        IO.puts(
          "rollbacks: #{length(rollbacks)} of #{frames} frames, each a restore with its " <>
            "#{frames} model_step frames in its request, the ring refreshed: " <>
            "p50 #{ms(percentile(costs, 50))} ms, max #{ms(Enum.max(costs))} ms"
        )
    end

    IO.puts(
      "frames: #{opts[:frames]} at #{opts[:fps]} FPS, #{stats.missed} past their " <>
        "#{Float.round(1000 / opts[:fps], 1)} ms deadline"
    )
  end

  # Nearest rank.
  defp percentile(values, p) do
    sorted = Enum.sort(values)
    Enum.at(sorted, max(ceil(p / 100 * length(sorted)) - 1, 0))
  end

  defp ms(us), do: :erlang.float_to_binary(us / 1000, decimals: 3)
  defp mb(bytes), do: :erlang.float_to_binary(bytes / 1_000_000, decimals: 2)

  defp ok!({:ok, value}), do: value
  defp ok!({:error, error}), do: raise(error)

  ## Options and the server

  defp options!(argv) do
    {parsed, rest} = OptionParser.parse!(argv, strict: @switches)
    if rest != [], do: usage!("unexpected arguments #{inspect(rest)}")
    opts = Keyword.merge(@defaults, parsed)

    for key <- [:frames, :prefix, :rollback, :rollback_every, :fps, :threads],
        Keyword.has_key?(opts, key),
        not (is_integer(opts[key]) and opts[key] > 0),
        do:
          usage!(
            "--#{key |> Atom.to_string() |> String.replace("_", "-")}: expected a positive integer"
          )

    if opts[:path] && !opts[:model_dir],
      do: usage!("--path names a checkpoint under --model-dir: give both")

    if opts[:dtype] not in ~w(f32 bf16 f16), do: usage!("--dtype: expected f32, bf16 or f16")
    opts
  end

  defp usage!(message) do
    IO.puts(:stderr, "agent_loop: #{message}")

    IO.puts(
      :stderr,
      "usage: mix run ../examples/elixir_agent/agent_loop.exs [--frames N] [--prefix N] " <>
        "[--rollback N] [--rollback-every N] [--fps N] [--model-dir DIR --path NAME] " <>
        "[--dtype f32|bf16|f16] [--device auto|cpu|cuda] [--seed N] [--threads N] [--python PATH]"
    )

    System.halt(2)
  end

  defp server_options(opts) do
    model_dir = if opts[:model_dir], do: ["--model-dir", Path.expand(opts[:model_dir])], else: []
    threads = if opts[:threads], do: ["--threads", Integer.to_string(opts[:threads])], else: []
    # this checkout's server first (and no empty entry, which would add the working directory)
    python_path =
      Enum.join([@repo_root | String.split(System.get_env("PYTHONPATH", ""), ":", trim: true)], ":")

    [
      python: python(opts),
      args: ["--device", opts[:device]] ++ model_dir ++ threads,
      env: [
        {"PYTHONPATH", python_path},
        {"SCAN_BRIDGE_LOG", System.get_env("SCAN_BRIDGE_LOG", "WARNING")}
      ]
    ]
  end

  defp python(opts) do
    venv = Path.join(@repo_root, ".venv/bin/python")

    opts[:python] || System.get_env("PYTHON") || System.get_env("SCAN_BRIDGE_PYTHON") ||
      if(File.exists?(venv), do: venv, else: System.find_executable("python3"))
  end
end

AgentLoop.main(System.argv())
