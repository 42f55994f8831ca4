defmodule ScanBridge.SsdTest do
  # Mamba-2 (SSD) over the Port: ssd_scan, an ssd session prefilled and stepped, and packed
  # sequences. The oracle is the scalar Mamba-1 reference run on the same problem written per
  # channel (dt repeated over headdim, A over state), which SPEC §6's math makes equal.
  use ExUnit.Case, async: false

  alias ScanBridge.{Tensor, TestSupport}
  alias ScanBridge.TestSupport.Reference

  setup_all do
    %{server: start_supervised!({ScanBridge, TestSupport.server_opts()})}
  end

  @sizes %{batch: 2, seq: 5, heads: 2, headdim: 3, state: 4}

  defp ssd_inputs(%{batch: b, seq: l, heads: h, headdim: p, state: n}) do
    %{
      x: TestSupport.random(:f32, {b, l, h, p}),
      dt: TestSupport.random(:f32, {b, l, h}, -1.0, 1.0),
      A: TestSupport.random(:f32, {h}, -2.0, -0.1),
      B: TestSupport.random(:f32, {b, l, 1, n}),
      C: TestSupport.random(:f32, {b, l, 1, n}),
      D: TestSupport.random(:f32, {h}),
      h0: TestSupport.random(:f32, {b, h, p, n}),
      dt_softplus: true
    }
  end

  # The same problem as a Mamba-1 scan over heads x headdim channels.
  defp per_channel(inputs, %{batch: b, seq: l, heads: h, headdim: p, state: n}) do
    repeat = fn values, times -> Enum.flat_map(values, &List.duplicate(&1, times)) end

    %{
      x: Tensor.from_list(Tensor.to_list(inputs.x), :f32, {b, l, h * p}),
      dt: Tensor.from_list(repeat.(Tensor.to_list(inputs.dt), p), :f32, {b, l, h * p}),
      A: Tensor.from_list(repeat.(Tensor.to_list(inputs."A"), p * n), :f32, {h * p, n}),
      B: Tensor.from_list(Tensor.to_list(inputs."B"), :f32, {b, l, n}),
      C: Tensor.from_list(Tensor.to_list(inputs."C"), :f32, {b, l, n}),
      D: Tensor.from_list(repeat.(Tensor.to_list(inputs."D"), p), :f32, {h * p}),
      h0: Tensor.from_list(Tensor.to_list(inputs.h0), :f32, {b, h * p, n}),
      dt_softplus: true
    }
  end

  test "ssd_scan matches the reference", %{server: server} do
    inputs = ssd_inputs(@sizes)
    {:ok, %{y: y, state: state}} = ScanBridge.ssd_scan(server, Map.put(inputs, :return_state, true))
    {y_ref, state_ref} = Reference.scan(per_channel(inputs, @sizes))
    assert y.shape == inputs.x.shape
    assert state.shape == {2, 2, 3, 4}
    TestSupport.assert_close(Tensor.to_list(y), y_ref, "y")
    TestSupport.assert_close(Tensor.to_list(state), state_ref, "state")
  end

  test "an ssd session prefilled by ssd_scan and stepped matches the reference", %{server: server} do
    %{batch: b, seq: l, heads: h, headdim: p, state: n} = @sizes
    inputs = Map.delete(ssd_inputs(@sizes), :h0)

    {y_ref, state_ref} =
      Reference.scan(per_channel(Map.put(inputs, :h0, zeros({b, h, p, n})), @sizes))

    {:ok, session} =
      ScanBridge.open_session(server, kind: :ssd, batch: b, heads: h, headdim: p, state: n)

    prefill = Map.merge(inputs, Map.new([:x, :dt, :B, :C], &{&1, first_steps(inputs[&1], l - 1)}))
    {:ok, _} = ScanBridge.ssd_scan(server, Map.put(prefill, :session, session))
    last = Map.new([:x, :dt, :B, :C], &{&1, last_step(inputs[&1], l)})

    {:ok, %{y: y}} =
      ScanBridge.step(server, session, Map.merge(Map.take(inputs, [:A, :D, :dt_softplus]), last))

    assert y.shape == {b, h, p}

    last_y =
      for bi <- 0..(b - 1), c <- 0..(h * p - 1), do: Enum.at(y_ref, (bi * l + l - 1) * h * p + c)

    TestSupport.assert_close(Tensor.to_list(y), last_y, "step y")
    {:ok, state} = ScanBridge.session_state(server, session)
    assert state.shape == {b, h, p, n}
    TestSupport.assert_close(Tensor.to_list(state), state_ref, "session state")
  end

  test "a scan of packed sequences equals separate scans", %{server: server} do
    inputs = TestSupport.scan_inputs(%{batch: 1, seq: 5, dim: 3, state: 2})
    cu = Tensor.from_list([0, 2, 5], :i32, {3})

    {:ok, %{y: y, state: state}} =
      ScanBridge.scan(server, Map.merge(inputs, %{cu_seqlens: cu, return_state: true}))

    assert state.shape == {2, 3, 2}

    {ys, states} =
      [{0, 2}, {2, 3}]
      |> Enum.map(fn {start, len} ->
        one = Map.new([:x, :dt, :B, :C], &{&1, window(inputs[&1], start, len)})
        Reference.scan(Map.merge(inputs, one))
      end)
      |> Enum.unzip()

    TestSupport.assert_close(Tensor.to_list(y), Enum.concat(ys), "y")
    TestSupport.assert_close(Tensor.to_list(state), Enum.concat(states), "state")
  end

  defp zeros(shape),
    do:
      Tensor.from_list(List.duplicate(0.0, shape |> Tuple.to_list() |> Enum.product()), :f32, shape)

  # Timesteps of a [batch, seq, ...] tensor: the first `count`, the last of `seq`, or a window of
  # a batch-1 one.
  defp first_steps(t, count), do: slice_time(t, 0, count)
  defp last_step(t, seq), do: drop_time(slice_time(t, seq - 1, 1))
  defp window(t, start, len), do: slice_time(t, start, len)

  defp slice_time(%Tensor{shape: shape} = t, start, len) do
    [b, l | rest] = Tuple.to_list(shape)
    per_step = Enum.product(rest)
    values = Tensor.to_list(t)

    sliced =
      for bi <- 0..(b - 1),
          ti <- start..(start + len - 1),
          k <- 0..(per_step - 1)//1,
          do: Enum.at(values, (bi * l + ti) * per_step + k)

    Tensor.from_list(sliced, t.dtype, List.to_tuple([b, len | rest]))
  end

  defp drop_time(%Tensor{shape: shape} = t) do
    [b, 1 | rest] = Tuple.to_list(shape)
    Tensor.from_list(Tensor.to_list(t), t.dtype, List.to_tuple([b | rest]))
  end
end
