defmodule ScanBridge.SsdTest do
  # Mamba-2 (SSD) over the Port: ssd_scan with its options and mamba_ssm's names, packed
  # sequences, ssd sessions prefilled and stepped; and scan's cu_seqlens. The oracle is the
  # scalar SSD recurrence of Reference.ssd_scan (SPEC §6 math, in float64).
  use ExUnit.Case, async: false

  alias ScanBridge.{Error, Tensor, TestSupport}
  alias ScanBridge.TestSupport.Reference

  if reason = TestSupport.skip_reason(:ssd), do: @moduletag(skip: reason)

  setup_all do
    %{server: start_supervised!({ScanBridge, TestSupport.server_opts()})}
  end

  # Random ssd_scan inputs: x [batch, seq, heads, headdim], dt [batch, seq, heads] in `dt_range`,
  # A [heads], B/C [batch, seq, groups, state], and each optional tensor in `with` (:D, :D_per_channel
  # for a [heads, headdim] D, :z, :dt_bias, :h0 of `h0_rows` rows).
  defp ssd_inputs(sizes, with, dt_range \\ {0.01, 0.5}) do
    %{batch: b, seq: l, heads: h, headdim: p, state: n, groups: g} = sizes
    {dt_lo, dt_hi} = dt_range

    optional = %{
      D: fn -> {:D, TestSupport.random(:f32, {h})} end,
      D_per_channel: fn -> {:D, TestSupport.random(:f32, {h, p})} end,
      z: fn -> {:z, TestSupport.random(:f32, {b, l, h, p}, -2.0, 2.0)} end,
      dt_bias: fn -> {:dt_bias, TestSupport.random(:f32, {h}, -0.5, 0.5)} end,
      h0: fn -> {:h0, TestSupport.random(:f32, {Map.get(sizes, :h0_rows, b), h, p, n})} end
    }

    %{
      x: TestSupport.random(:f32, {b, l, h, p}),
      dt: TestSupport.random(:f32, {b, l, h}, dt_lo, dt_hi),
      A: TestSupport.random(:f32, {h}, -2.0, -0.1),
      B: TestSupport.random(:f32, {b, l, g, n}),
      C: TestSupport.random(:f32, {b, l, g, n})
    }
    |> Map.merge(Map.new(with, &Map.fetch!(optional, &1).()))
  end

  defp assert_matches(%{y: y, state: state}, inputs, rows) do
    {y_ref, state_ref} = Reference.ssd_scan(inputs)
    {_, _, h, p} = inputs.x.shape
    {_, _, _, n} = inputs."B".shape
    assert {y.dtype, y.shape} == {:f32, inputs.x.shape}
    TestSupport.assert_close(Tensor.to_list(y), y_ref, "y")
    assert state.shape == {rows, h, p, n}
    TestSupport.assert_close(Tensor.to_list(state), state_ref, "state")
  end

  test "ssd_scan with every option, 2 groups of 2 heads, over 3 chunks", %{server: server} do
    sizes = %{batch: 2, seq: 7, heads: 4, headdim: 3, state: 2, groups: 2}

    inputs =
      ssd_inputs(sizes, [:D, :z, :dt_bias, :h0], {-1.0, 1.0})
      |> Map.merge(%{dt_softplus: true, dt_min: 0.2, dt_max: 0.9, return_state: true})

    assert {:ok, result} = ScanBridge.ssd_scan(server, Map.put(inputs, :chunk_size, 3))
    assert %{"server_us" => _} = result.timing
    assert_matches(result, inputs, 2)

    assert %{state: nil, y: y} = ScanBridge.ssd_scan!(server, Map.delete(inputs, :return_state))
    TestSupport.assert_close(Tensor.to_list(y), Tensor.to_list(result.y), "y of ssd_scan!")
  end

  # mamba_chunk_scan_combined's argument names, each case as its canonical form for the reference.
  @mamba_ssm_cases [
    {"a lower dt_limit, open above, after softplus", [0.3, :infinity], true},
    {"the default dt_limit [0, inf] clamps no negative dt", [0.0, :infinity], false},
    {"an upper dt_limit, open below", [:neg_infinity, 0.1], false}
  ]

  for {id, limit, softplus} <- @mamba_ssm_cases do
    test "mamba_ssm's names: #{id}", %{server: server} do
      sizes = %{batch: 1, seq: 5, heads: 2, headdim: 2, state: 3, groups: 1}
      canonical = ssd_inputs(sizes, [:D_per_channel, :h0], {-0.5, 0.5})

      named =
        canonical
        |> Map.drop([:h0])
        |> Map.merge(%{
          initial_states: canonical.h0,
          dt_limit: unquote(limit),
          delta_softplus: unquote(softplus),
          return_final_states: true
        })

      assert {:ok, result} = ScanBridge.ssd_scan(server, named)

      assert_matches(
        result,
        Map.merge(canonical, %{dt_limit: unquote(limit), dt_softplus: unquote(softplus)}),
        1
      )
    end
  end

  test "packed sequences (cu_seqlens i64) start from their own rows of h0", %{server: server} do
    sizes = %{batch: 1, seq: 6, heads: 2, headdim: 2, state: 2, groups: 1, h0_rows: 3}

    inputs =
      ssd_inputs(sizes, [:D, :h0])
      |> Map.merge(%{cu_seqlens: Tensor.from_list([0, 1, 4, 6], :i64, {4}), return_state: true})

    assert {:ok, result} = ScanBridge.ssd_scan(server, inputs)
    assert_matches(result, inputs, 3)
  end

  test "an ssd session prefilled by ssd_scan, then stepped, matches the reference", %{
    server: server
  } do
    {prefill, steps} = {3, 3}
    sizes = %{batch: 2, seq: prefill + steps, heads: 4, headdim: 2, state: 3, groups: 2}
    %{batch: b, heads: h, headdim: p, state: n} = sizes

    full =
      ssd_inputs(sizes, [:D, :z, :dt_bias], {-1.0, 1.0})
      |> Map.merge(%{dt_softplus: true, dt_limit: [0.05, 0.7]})

    {y_ref, state_ref} = Reference.ssd_scan(full)
    y_ref = List.to_tuple(y_ref)
    # y_ref is [batch, seq, heads, headdim]; a step's y is [batch, heads, headdim]
    ref_at = fn t ->
      for bi <- 0..(b - 1), k <- 0..(h * p - 1), do: elem(y_ref, (bi * sizes.seq + t) * h * p + k)
    end

    assert {:ok, session} =
             ScanBridge.open_session(server, kind: :ssd, batch: b, heads: h, headdim: p, state: n)

    prefill_inputs = full |> TestSupport.time_slice(0, prefill) |> Map.put(:session, session)
    assert {:ok, %{y: y, state: nil}} = ScanBridge.ssd_scan(server, prefill_inputs)

    prefill_ref =
      for bi <- 0..(b - 1),
          t <- 0..(prefill - 1),
          k <- 0..(h * p - 1),
          do: elem(y_ref, (bi * sizes.seq + t) * h * p + k)

    TestSupport.assert_close(Tensor.to_list(y), prefill_ref, "prefill y")

    for t <- prefill..(prefill + steps - 1) do
      step_inputs = full |> TestSupport.time_slice(t, 1) |> TestSupport.squeeze_time()
      assert {:ok, %{y: y}} = ScanBridge.step(server, session, step_inputs)
      assert y.shape == {b, h, p}
      TestSupport.assert_close(Tensor.to_list(y), ref_at.(t), "step #{t} y")
    end

    assert {:ok, state} = ScanBridge.session_state(server, session)
    assert state.shape == {b, h, p, n}
    TestSupport.assert_close(Tensor.to_list(state), state_ref, "session state")
    assert ScanBridge.close_session(server, session) == :ok
  end

  test "a session takes only its own generation's scan", %{server: server} do
    {:ok, ssd} =
      ScanBridge.open_session(server, %{kind: :ssd, batch: 1, heads: 2, headdim: 2, state: 2})

    {:ok, mamba} = ScanBridge.open_session(server, %{batch: 1, dim: 4, state: 2})
    mamba_inputs = TestSupport.scan_inputs(%{batch: 1, seq: 2, dim: 4, state: 2})
    ssd_inputs = ssd_inputs(%{batch: 1, seq: 2, heads: 2, headdim: 2, state: 2, groups: 1}, [])

    assert {:error, %Error{reason: :invalid_argument, detail: %{"field" => "args.session"}}} =
             ScanBridge.scan(server, Map.put(mamba_inputs, :session, ssd))

    assert {:error, %Error{reason: :invalid_argument, detail: %{"field" => "args.session"}}} =
             ScanBridge.ssd_scan(server, Map.put(ssd_inputs, :session, mamba))

    assert_raise Error, ~r/session/, fn ->
      ScanBridge.ssd_scan!(server, Map.put(ssd_inputs, :session, mamba))
    end

    # neither session moved
    for session <- [ssd, mamba] do
      assert {:ok, state} = ScanBridge.session_state(server, session)
      assert Enum.all?(Tensor.to_list(state), &(&1 == 0.0))
    end
  end

  test "open_session's dims: the server names a wrong kind or size, the client a wrong shape", %{
    server: server
  } do
    for {dims, reason, field} <- [
          {[kind: :mamba3, batch: 1, dim: 2, state: 2], :invalid_argument, "args.kind"},
          {[kind: :ssd, batch: 1, dim: 2, heads: 1, headdim: 2, state: 2], :invalid_argument,
           "args.dim"},
          {[batch: 1, dim: 2, heads: 1, state: 2], :invalid_argument, "args.heads"},
          {[kind: :ssd, batch: 1, heads: 1, state: 2], :missing_argument, "args.headdim"}
        ] do
      assert {:error, %Error{reason: ^reason, detail: %{"field" => ^field}}} =
               ScanBridge.open_session(server, dims),
             inspect(dims)
    end

    assert_raise ArgumentError,
                 ~r/open_session dims: expected a map or keyword list .*, got \[1, 2, 3\]/,
                 fn -> ScanBridge.open_session(server, [1, 2, 3]) end
  end

  test "a dt_limit that is no pair of bounds raises before anything is sent", %{server: server} do
    inputs = ssd_inputs(%{batch: 1, seq: 2, heads: 2, headdim: 2, state: 2, groups: 1}, [])

    for bad <- [[0.0, "inf"], [0.0], [0.1, :inf, 1.0]] do
      assert_raise ArgumentError,
                   ~r/ssd_scan input dt_limit: expected .*\[low, high\] pair of numbers, :neg_infinity or :infinity, got #{Regex.escape(inspect(bad))}/,
                   fn -> ScanBridge.ssd_scan(server, Map.put(inputs, :dt_limit, bad)) end
    end
  end

  # Found in review: a list of two numbers was sent as a dt_limit pair wherever it came, and
  # the server refused it; of any other length it raised here.
  test "a list where a tensor goes raises before anything is sent, whatever its length", %{
    server: server
  } do
    inputs = ssd_inputs(%{batch: 1, seq: 2, heads: 2, headdim: 2, state: 2, groups: 1}, [])

    for bad <- [[1.0], [1.0, 1.0], [1.0, 1.0, 1.0]] do
      assert_raise ArgumentError,
                   ~r/ssd_scan input D: expected a tensor, .* got #{Regex.escape(inspect(bad))}/,
                   fn -> ScanBridge.ssd_scan(server, Map.put(inputs, :D, bad)) end
    end
  end

  test "a scan of packed sequences (cu_seqlens i32) equals separate scans", %{server: server} do
    inputs = TestSupport.scan_inputs(%{batch: 1, seq: 5, dim: 3, state: 2})
    cu = Tensor.from_list([0, 2, 5], :i32, {3})

    {:ok, %{y: y, state: state}} =
      ScanBridge.scan(server, Map.merge(inputs, %{cu_seqlens: cu, return_state: true}))

    assert state.shape == {2, 3, 2}

    {ys, states} =
      [{0, 2}, {2, 3}]
      |> Enum.map(fn {start, len} -> Reference.scan(TestSupport.time_slice(inputs, start, len)) end)
      |> Enum.unzip()

    TestSupport.assert_close(Tensor.to_list(y), Enum.concat(ys), "y")
    TestSupport.assert_close(Tensor.to_list(state), Enum.concat(states), "state")
  end
end
