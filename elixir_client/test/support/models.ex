defmodule ScanBridge.TestSupport.Models do
  @moduledoc false
  # Tiny random Mamba and Mamba-2 backbones built here and sent to the server (model_load
  # {config, weights}, SPEC §6.4), or written as a checkpoint directory (config.json and
  # model.safetensors) for model_load {path}; and the slicing and comparing the model tests do.

  import ExUnit.Assertions
  alias ScanBridge.{Tensor, TestSupport, TestSupport.JSON}

  @configs %{
    mamba: %{
      "arch" => "mamba",
      "d_model" => 8,
      "n_layer" => 2,
      "d_state" => 4,
      "d_conv" => 4,
      "expand" => 2
    },
    mamba2: %{
      "arch" => "mamba2",
      "d_model" => 8,
      "n_layer" => 2,
      "d_state" => 4,
      "d_conv" => 3,
      "expand" => 2,
      "headdim" => 4,
      "ngroups" => 1
    }
  }

  @doc "The tiny backbone config of `arch` (:mamba or :mamba2): d_model 8, 2 layers."
  def config(arch), do: Map.fetch!(@configs, arch)

  @doc """
  Every weight of a backbone of `config` (the server's own config keys, no vocabulary) by
  name, with its shape, in the order the server lists them.
  """
  def weight_shapes(config) do
    %{"d_model" => d_model, "n_layer" => n_layer, "d_state" => d_state, "d_conv" => d_conv} = config

    d_inner = config["expand"] * d_model

    layer = fn i ->
      m = "layers.#{i}.mixer."

      mixer =
        case config["arch"] do
          "mamba" ->
            dt_rank = Map.get(config, "dt_rank", div(d_model + 15, 16))

            [
              {m <> "in_proj.weight", {2 * d_inner, d_model}},
              {m <> "conv1d.weight", {d_inner, 1, d_conv}},
              {m <> "conv1d.bias", {d_inner}},
              {m <> "x_proj.weight", {dt_rank + 2 * d_state, d_inner}},
              {m <> "dt_proj.weight", {d_inner, dt_rank}},
              {m <> "dt_proj.bias", {d_inner}},
              {m <> "A_log", {d_inner, d_state}},
              {m <> "D", {d_inner}},
              {m <> "out_proj.weight", {d_model, d_inner}}
            ]

          "mamba2" ->
            ngroups = config["ngroups"]
            nheads = div(d_inner, config["headdim"])
            conv_dim = d_inner + 2 * ngroups * d_state

            [
              {m <> "in_proj.weight", {2 * d_inner + 2 * ngroups * d_state + nheads, d_model}},
              {m <> "conv1d.weight", {conv_dim, 1, d_conv}},
              {m <> "conv1d.bias", {conv_dim}},
              {m <> "dt_bias", {nheads}},
              {m <> "A_log", {nheads}},
              {m <> "D", {nheads}},
              {m <> "norm.weight", {d_inner}},
              {m <> "out_proj.weight", {d_model, d_inner}}
            ]
        end

      [{"layers.#{i}.norm.weight", {d_model}} | mixer]
    end

    Enum.flat_map(0..(n_layer - 1), layer) ++ [{"norm_f.weight", {d_model}}]
  end

  @doc """
  A random backbone of `config`, `%{config: config, weights: %{name => f32 tensor}}` as
  `ScanBridge.load_model/3` takes it, the same for the same `seed` (an integer): weights
  uniform in [-0.3, 0.3], norms in [0.9, 1.1], A_log in [0, 1], dt biases in [-2, 0].
  """
  def backbone(config, seed) do
    rand = :rand.seed_s(:exsss, {seed, 7, 11})

    {weights, _rand} =
      Enum.map_reduce(weight_shapes(config), rand, fn {name, shape}, rand ->
        {lo, hi} = range(name)
        {tensor, rand} = uniform(shape, lo, hi, rand)
        {{name, tensor}, rand}
      end)

    %{config: config, weights: Map.new(weights)}
  end

  defp range(name) do
    cond do
      String.ends_with?(name, "norm.weight") -> {0.9, 1.1}
      String.ends_with?(name, "A_log") -> {0.0, 1.0}
      String.ends_with?(name, ["dt_bias", "dt_proj.bias"]) -> {-2.0, 0.0}
      true -> {-0.3, 0.3}
    end
  end

  @doc "An f32 tensor of `shape`, uniform in [lo, hi), from the :rand state `rand`; and the next state."
  def uniform(shape, lo, hi, rand) do
    count = shape |> Tuple.to_list() |> Enum.product()

    {data, rand} =
      Enum.reduce(1..count//1, {[], rand}, fn _, {acc, rand} ->
        {u, rand} = :rand.uniform_real_s(rand)
        {[<<lo + (hi - lo) * u::float-32-little>> | acc], rand}
      end)

    {Tensor.new(IO.iodata_to_binary(Enum.reverse(data)), :f32, shape), rand}
  end

  @doc "Random f32 embeddings `[batch, seq, d_model]` in [-1, 1), from the process's :rand state."
  def embeds(batch, seq, d_model), do: TestSupport.random(:f32, {batch, seq, d_model})

  @doc "Frames [from, from + count) of a `[batch, seq, ...]` tensor: `[batch, count, ...]`."
  def frames(%Tensor{shape: shape} = t, from, count) do
    [batch, seq | rest] = Tuple.to_list(shape)
    row = Enum.product(rest) * Tensor.itemsize(t.dtype)

    data =
      for b <- 0..(batch - 1),
          into: <<>>,
          do: binary_part(t.data, (b * seq + from) * row, count * row)

    Tensor.new(data, t.dtype, List.to_tuple([batch, count | rest]))
  end

  @doc "Frame `at` of a `[batch, seq, ...]` tensor, without the seq axis: `[batch, ...]`."
  def frame(t, at) do
    %Tensor{shape: shape} = one = frames(t, at, 1)
    [batch, 1 | rest] = Tuple.to_list(shape)
    %{one | shape: List.to_tuple([batch | rest])}
  end

  @doc "`[batch, ...]` frames stacked along a new seq axis: `[batch, length(frames), ...]`."
  def stack_frames([%Tensor{shape: shape, dtype: dtype} | _] = frames) do
    [batch | rest] = Tuple.to_list(shape)
    row = Enum.product(rest) * Tensor.itemsize(dtype)

    data =
      for b <- 0..(batch - 1),
          %Tensor{data: data} <- frames,
          into: <<>>,
          do: binary_part(data, b * row, row)

    Tensor.new(data, dtype, List.to_tuple([batch, length(frames) | rest]))
  end

  @doc "Assert `actual` is within `rtol` of `expected`, relative to `expected`'s largest magnitude."
  def assert_rel_close(%Tensor{} = actual, %Tensor{} = expected, rtol, what) do
    assert actual.shape == expected.shape,
           "#{what}: shape #{inspect(actual.shape)}, expected #{inspect(expected.shape)}"

    a = Tensor.to_list(actual)
    e = Tensor.to_list(expected)
    scale = e |> Enum.map(&abs/1) |> Enum.max()
    err = Enum.zip(a, e) |> Enum.map(fn {x, y} -> abs(x - y) end) |> Enum.max()

    assert err <= rtol * scale,
           "#{what}: max error #{err} > #{rtol} x #{scale} (the largest expected magnitude)"
  end

  @doc """
  A fresh directory under the system's temporary directory, removed when the calling test
  ends (ExUnit's `:tmp_dir` would leave its files in the project's tmp/).
  """
  def tmp_dir! do
    dir =
      Path.join(
        System.tmp_dir!(),
        "scan-bridge-models-#{System.pid()}-#{System.unique_integer([:positive])}"
      )

    File.mkdir_p!(dir)
    ExUnit.Callbacks.on_exit(fn -> File.rm_rf(dir) end)
    dir
  end

  @doc """
  Write `backbone` as a checkpoint directory `dir`: config.json (the server's own layout) and
  model.safetensors (f32, little-endian, data in the header's order).
  """
  def write_checkpoint(dir, %{config: config, weights: weights}) do
    File.mkdir_p!(dir)
    File.write!(Path.join(dir, "config.json"), JSON.encode!(config))
    names = weights |> Map.keys() |> Enum.sort()

    {entries, _end} =
      Enum.map_reduce(names, 0, fn name, offset ->
        %Tensor{dtype: :f32, shape: shape, data: data} = weights[name]

        entry = %{
          "dtype" => "F32",
          "shape" => Tuple.to_list(shape),
          "data_offsets" => [offset, offset + byte_size(data)]
        }

        {{name, entry}, offset + byte_size(data)}
      end)

    header = JSON.encode!(Map.new(entries))
    # the data starts at a multiple of 8 (padded with spaces, as safetensors does)
    header = header <> String.duplicate(" ", rem(8 - rem(byte_size(header), 8), 8))
    data = Enum.map(names, &weights[&1].data)

    File.write!(Path.join(dir, "model.safetensors"), [
      <<byte_size(header)::64-little>>,
      header,
      data
    ])

    dir
  end

  ## Against a server

  @doc "A random backbone of `arch` loaded on `server`, and a session of it of `batch` rows."
  def load_and_open(server, arch, batch) do
    backbone = backbone(config(arch), :rand.uniform(1_000_000))
    assert {:ok, info} = ScanBridge.load_model(server, backbone)
    assert is_binary(info["model"])
    assert {:ok, session} = ScanBridge.open_session(server, model: info["model"], batch: batch)
    {info, session}
  end

  @doc "Close `sessions`, then free their model."
  def close_and_free(server, info, sessions) do
    Enum.each(sessions, &assert(ScanBridge.close_session(server, &1) == :ok))
    assert ScanBridge.free_model(server, info) == :ok
  end

  @doc "Step `session` with frames `range` of `embeds` `[batch, seq, d_model]`; the outputs."
  def steps(server, session, embeds, range) do
    for t <- range do
      assert {:ok, y} = ScanBridge.model_step(server, session, {:embeds, frame(embeds, t)})
      y
    end
  end
end
