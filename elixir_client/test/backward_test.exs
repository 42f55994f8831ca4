defmodule ScanBridge.BackwardTest do
  # Gradients over the Port (SPEC §6.5): scan_backward and ssd_scan_backward's replies (keys,
  # shapes, dtypes), their values against central differences of the forward's loss
  # sum(y·w) (+ sum(state·v)), computed through scan/ssd_scan in f64; a refused request; and the
  # SGD example, run short.
  use ExUnit.Case, async: false

  alias ScanBridge.{Error, Tensor, TestSupport}

  setup_all do
    %{server: start_supervised!({ScanBridge, TestSupport.server_opts()})}
  end

  @optional [:D, :z, :dt_bias, :h0]
  # each tensor input's gradient in the reply
  @gradient_of %{
    x: :dx,
    dt: :ddt,
    A: :dA,
    B: :dB,
    C: :dC,
    D: :dD,
    z: :dz,
    dt_bias: :ddt_bias,
    h0: :dh0
  }

  # Random ssd_scan inputs of `dtype`: x/z [b, l, h, p], dt [b, l, h], A/D/dt_bias [h],
  # B/C [b, l, g, n], h0 [b, h, p, n]; the optional ones named in `with`.
  defp ssd_inputs(%{batch: b, seq: l, heads: h, headdim: p, state: n, groups: g}, with, dtype) do
    optional = %{
      D: fn -> TestSupport.random(dtype, {h}) end,
      z: fn -> TestSupport.random(dtype, {b, l, h, p}, -2.0, 2.0) end,
      dt_bias: fn -> TestSupport.random(dtype, {h}, -0.5, 0.5) end,
      h0: fn -> TestSupport.random(dtype, {b, h, p, n}) end
    }

    %{
      x: TestSupport.random(dtype, {b, l, h, p}),
      dt: TestSupport.random(dtype, {b, l, h}, -1.0, 1.0),
      A: TestSupport.random(dtype, {h}, -2.0, -0.1),
      B: TestSupport.random(dtype, {b, l, g, n}),
      C: TestSupport.random(dtype, {b, l, g, n})
    }
    |> Map.merge(Map.new(with, &{&1, Map.fetch!(optional, &1).()}))
  end

  # Each gradient has its input's shape; dA, dD, ddt_bias are f32 for f32 inputs, the others in
  # their inputs' dtypes; the optional ones are there exactly when their inputs were given.
  defp assert_gradients_shaped(grads, inputs) do
    assert %{"server_us" => _} = grads.timing

    assert Map.keys(grads) |> Enum.sort() ==
             Enum.sort([:timing | Map.values(@gradient_of)])

    for {input, gradient} <- @gradient_of do
      case inputs[input] do
        nil ->
          assert grads[gradient] == nil, "#{gradient} without #{input}"

        %Tensor{dtype: dtype, shape: shape} ->
          dtype = if input in [:A, :D, :dt_bias], do: :f32, else: dtype

          assert %Tensor{dtype: ^dtype, shape: ^shape} = grads[gradient],
                 "#{gradient}: expected #{dtype} #{inspect(shape)}, got #{inspect(grads[gradient], limit: 3)}"

          assert Enum.all?(Tensor.to_list(grads[gradient]), &is_float/1), "#{gradient} finite"
      end
    end
  end

  describe "the gradients' keys, shapes and dtypes" do
    test "scan_backward, with each optional input and with none", %{server: server} do
      sizes = %{batch: 2, seq: 5, dim: 3, state: 2}

      for with <- [@optional, []] do
        inputs = TestSupport.scan_inputs(sizes, with) |> Map.put(:dt_softplus, true)
        dy = TestSupport.random(:f32, inputs.x.shape)
        assert {:ok, grads} = ScanBridge.scan_backward(server, Map.put(inputs, :dy, dy))
        assert_gradients_shaped(grads, inputs)
      end
    end

    test "scan_backward in layout bdl, with groups, bf16 x and f32 h0", %{server: server} do
      inputs =
        %{batch: 1, seq: 5, dim: 4, state: 3, groups: 2, layout: :bdl, dtype: :bf16}
        |> TestSupport.scan_inputs([:D, :z])
        |> Map.put(:h0, TestSupport.random(:f32, {1, 4, 3}))

      assert inputs.x.shape == {1, 4, 5} and inputs."B".shape == {1, 2, 3, 5}
      dy = TestSupport.random(:bf16, inputs.x.shape)
      grads = ScanBridge.scan_backward!(server, Map.put(inputs, :dy, dy))
      assert_gradients_shaped(grads, inputs)
    end

    test "ssd_scan_backward, with each optional input and with none", %{server: server} do
      sizes = %{batch: 2, seq: 5, heads: 4, headdim: 2, state: 3, groups: 2}

      for with <- [@optional, []] do
        inputs = ssd_inputs(sizes, with, :f32) |> Map.merge(%{dt_softplus: true, chunk_size: 2})
        dy = TestSupport.random(:f32, inputs.x.shape)
        assert {:ok, grads} = ScanBridge.ssd_scan_backward(server, Map.put(inputs, :dy, dy))
        assert_gradients_shaped(grads, inputs)
      end

      # a per-channel D [heads, headdim] gets a dD of its shape
      inputs = ssd_inputs(sizes, [], :f32) |> Map.put(:D, TestSupport.random(:f32, {4, 2}))
      dy = TestSupport.random(:f32, inputs.x.shape)

      assert %{dD: %Tensor{shape: {4, 2}}} =
               ScanBridge.ssd_scan_backward!(server, Map.put(inputs, :dy, dy))
    end
  end

  ## Against central differences

  @eps 1.0e-5

  # The loss sum(y·w) (+ sum(state·v) when `v` is given) of the forward `op` at `inputs`.
  defp loss(server, op, inputs, w, v) do
    inputs = if v, do: Map.put(inputs, :return_state, true), else: inputs
    assert {:ok, %{y: y, state: state}} = apply(ScanBridge, op, [server, inputs])
    dot(y, w) + if(v, do: dot(state, v), else: 0.0)
  end

  defp dot(a, b) do
    Enum.zip_reduce(Tensor.to_list(a), Tensor.to_list(b), 0.0, fn x, y, acc -> acc + x * y end)
  end

  defp bump(%Tensor{} = t, k, delta) do
    Tensor.from_list(List.update_at(Tensor.to_list(t), k, &(&1 + delta)), t.dtype, t.shape)
  end

  # For each input in `entries` (every entry, or `count` random ones), the central difference
  # of the loss against that entry of the gradient `backward` returned with dy = w (and
  # dstate = v).
  defp assert_matches_differences(server, {op, backward}, inputs, entries, v \\ nil) do
    w = TestSupport.random(:f64, inputs.x.shape)
    args = inputs |> Map.put(:dy, w) |> then(&if(v, do: Map.put(&1, :dstate, v), else: &1))
    assert {:ok, grads} = apply(ScanBridge, backward, [server, args])

    for {input, which} <- entries do
      tensor = Map.fetch!(inputs, input)
      gradient = grads |> Map.fetch!(Map.fetch!(@gradient_of, input)) |> Tensor.to_list()
      assert length(gradient) == Tensor.size(tensor)

      indices =
        case which do
          :all -> Enum.to_list(0..(Tensor.size(tensor) - 1))
          count -> Enum.take_random(0..(Tensor.size(tensor) - 1), count)
        end

      for k <- indices do
        plus = loss(server, op, Map.put(inputs, input, bump(tensor, k, @eps)), w, v)
        minus = loss(server, op, Map.put(inputs, input, bump(tensor, k, -@eps)), w, v)
        difference = (plus - minus) / (2 * @eps)
        analytic = Enum.at(gradient, k)

        assert abs(analytic - difference) <= 1.0e-6 + 1.0e-5 * abs(difference),
               "#{backward} d#{input}[#{k}]: got #{analytic}, central difference #{difference}"
      end
    end
  end

  describe "the gradients against central differences of the loss (f64)" do
    test "scan_backward: A, D, dt_bias and x", %{server: server} do
      inputs =
        %{batch: 1, seq: 5, dim: 3, state: 2, dtype: :f64}
        |> TestSupport.scan_inputs([:D, :dt_bias])
        |> Map.merge(%{dt: TestSupport.random(:f64, {1, 5, 3}, -1.0, 1.0), dt_softplus: true})

      assert_matches_differences(
        server,
        {:scan, :scan_backward},
        inputs,
        A: :all,
        D: :all,
        dt_bias: :all,
        x: 4
      )
    end

    test "scan_backward: every input, with z, h0 and a loss on the final state too", %{
      server: server
    } do
      inputs =
        %{batch: 2, seq: 4, dim: 3, state: 2, dtype: :f64}
        |> TestSupport.scan_inputs(@optional)
        |> Map.merge(%{dt: TestSupport.random(:f64, {2, 4, 3}, -1.0, 1.0), dt_softplus: true})

      v = TestSupport.random(:f64, {2, 3, 2})
      entries = Enum.map([:x, :dt, :A, :B, :C] ++ @optional, &{&1, 2})
      assert_matches_differences(server, {:scan, :scan_backward}, inputs, entries, v)
    end

    test "ssd_scan_backward: A, D, dt_bias and x, over chunks of 2", %{server: server} do
      inputs =
        %{batch: 1, seq: 5, heads: 2, headdim: 2, state: 2, groups: 1}
        |> ssd_inputs([:D, :dt_bias, :h0], :f64)
        |> Map.merge(%{dt_softplus: true, chunk_size: 2})

      assert_matches_differences(
        server,
        {:ssd_scan, :ssd_scan_backward},
        inputs,
        A: :all,
        D: :all,
        dt_bias: :all,
        x: 4,
        h0: 2,
        B: 2
      )
    end
  end

  describe "a refused request" do
    test "a dy of the wrong shape is shape_mismatch, and the server goes on serving", %{
      server: server
    } do
      inputs = TestSupport.scan_inputs(%{batch: 1, seq: 5, dim: 3, state: 2}, [:D])
      bad_dy = TestSupport.random(:f32, {1, 4, 3})

      assert {:error, %Error{reason: :shape_mismatch, detail: %{"field" => "args.dy"}}} =
               ScanBridge.scan_backward(server, Map.put(inputs, :dy, bad_dy))

      assert_raise Error, ~r/args\.dy/, fn ->
        ScanBridge.scan_backward!(server, Map.put(inputs, :dy, bad_dy))
      end

      ssd = ssd_inputs(%{batch: 1, seq: 3, heads: 2, headdim: 2, state: 2, groups: 1}, [], :f32)

      assert {:error, %Error{reason: :shape_mismatch, detail: %{"field" => "args.dy"}}} =
               ScanBridge.ssd_scan_backward(
                 server,
                 Map.put(ssd, :dy, TestSupport.random(:f32, {1, 3, 2, 3}))
               )

      assert ScanBridge.ping(server) == :ok
      assert {:ok, result} = ScanBridge.scan(server, inputs)
      TestSupport.assert_scan_matches(result, inputs)
      dy = TestSupport.random(:f32, {1, 5, 3})

      assert {:ok, %{dx: %Tensor{shape: {1, 5, 3}}}} =
               ScanBridge.scan_backward(server, Map.put(inputs, :dy, dy))
    end
  end

  describe "the SGD example" do
    @example Path.join(TestSupport.repo_root(), "examples/elixir_sgd/train.exs")

    test "fits A, D and dt_bias in 30 steps: the loss goes down" do
      {output, status} =
        System.cmd("mix", ["run", @example, "--steps", "30", "--device", "cpu"],
          cd: Path.join(TestSupport.repo_root(), "elixir_client"),
          # the test build, compiled already; the server of this checkout
          env: [{"MIX_ENV", "test"}, {"PYTHON", TestSupport.python()}],
          stderr_to_stdout: true
        )

      assert status == 0, output
      assert output =~ ~r/^step 30: loss /m, output
      [_, initial] = Regex.run(~r/^initial loss: (\S+)$/m, output)
      [_, final] = Regex.run(~r/^final loss: (\S+)$/m, output)
      {initial, ""} = Float.parse(initial)
      {final, ""} = Float.parse(final)
      assert final < initial, output
    end

    test "exits 2 with its usage for an unknown option or an unreadable value" do
      for args <- [["--bogus", "1"], ["--steps", "abc"]] do
        {output, status} =
          System.cmd("mix", ["run", @example | args],
            cd: Path.join(TestSupport.repo_root(), "elixir_client"),
            env: [{"MIX_ENV", "test"}, {"PYTHON", TestSupport.python()}],
            stderr_to_stdout: true
          )

        assert status == 2, output
        assert output =~ "sgd: #{hd(args)}: ", output
        assert output =~ "usage: mix run", output
      end
    end
  end
end
