defmodule ScanBridgeTest do
  # The public API against the real server (one shared server for this module).
  use ExUnit.Case, async: false

  alias ScanBridge.{Error, Tensor, TestSupport}
  import TestSupport, only: [scan_inputs: 2, assert_scan_matches: 2, assert_close: 5]

  doctest ScanBridge

  setup_all do
    server = start_supervised!({ScanBridge, TestSupport.server_opts()})
    %{server: server}
  end

  test "ping, info and stats", %{server: server} do
    assert ScanBridge.ping(server) == :ok
    assert {:ok, info} = ScanBridge.info(server)
    assert info["protocol"]["version"] == 1
    assert ~w(info ping scan) -- info["protocol"]["ops"] == []
    assert info["backend"] in info["kernels"]["available"]
    assert "stdio" in info["transports"]
    assert {:ok, info["pid"]} == ScanBridge.os_pid(server)
    assert {:ok, %{} = stats} = ScanBridge.stats(server)
    assert map_size(stats) > 0
  end

  # {id, sizes, optional tensors, options}: odd sizes, every option alone and all together.
  @scan_cases [
    {"required only", %{batch: 2, seq: 7, dim: 5, state: 3}, [], %{}},
    {"D and z", %{batch: 3, seq: 5, dim: 7, state: 2}, [:D, :z], %{}},
    {"dt_bias with softplus", %{batch: 2, seq: 6, dim: 5, state: 3}, [:dt_bias],
     %{dt_softplus: true}},
    {"dt clamped", %{batch: 1, seq: 9, dim: 3, state: 5}, [], %{dt_min: 0.05, dt_max: 0.3}},
    {"h0 and return_state", %{batch: 2, seq: 5, dim: 5, state: 3}, [:h0], %{return_state: true}},
    {"return_state from zero", %{batch: 3, seq: 3, dim: 2, state: 7}, [], %{return_state: true}},
    {"3 groups", %{batch: 2, seq: 5, dim: 6, state: 3, groups: 3}, [], %{}},
    {"layout bdl", %{batch: 2, seq: 7, dim: 5, state: 3, layout: :bdl}, [:D],
     %{return_state: true}},
    {"layout bdl with 2 groups", %{batch: 1, seq: 5, dim: 6, state: 3, layout: :bdl, groups: 2},
     [:z], %{}},
    {"one step", %{batch: 1, seq: 1, dim: 3, state: 2}, [:D], %{}},
    {"every option", %{batch: 2, seq: 7, dim: 6, state: 3, groups: 3}, [:D, :z, :dt_bias, :h0],
     %{dt_softplus: true, dt_min: 0.02, dt_max: 0.4, return_state: true}}
  ]

  for {id, sizes, optional, options} <- @scan_cases do
    test "scan matches the scalar reference: #{id}", %{server: server} do
      inputs =
        Map.merge(
          scan_inputs(unquote(Macro.escape(sizes)), unquote(optional)),
          unquote(Macro.escape(options))
        )

      assert {:ok, result} = ScanBridge.scan(server, inputs)
      assert_scan_matches(result, inputs)
      assert %{"kernel_us" => kernel_us, "server_us" => server_us} = result.timing
      assert kernel_us >= 0 and server_us >= kernel_us
    end
  end

  test "the aliases u, delta, delta_bias are the same arguments", %{server: server} do
    inputs = scan_inputs(%{batch: 2, seq: 4, dim: 3, state: 2}, [:dt_bias])

    aliased = %{
      u: inputs.x,
      delta: inputs.dt,
      delta_bias: inputs.dt_bias,
      A: inputs."A",
      B: inputs."B",
      C: inputs."C"
    }

    assert {:ok, result} = ScanBridge.scan(server, aliased)
    assert_scan_matches(result, inputs)
  end

  test "f64 inputs give an f64 y", %{server: server} do
    # drawn at full f64 precision (not f32 values widened), so that inputs narrowed to f32 on
    # the way to the server would change the answer
    f64 = scan_inputs(%{batch: 2, seq: 5, dim: 3, state: 2, dtype: :f64}, [:D, :z])
    assert {:ok, %{y: y}} = ScanBridge.scan(server, f64)
    assert y.dtype == :f64
    assert y.shape == f64.x.shape
    {y_ref, _} = TestSupport.Reference.scan(f64)
    # f64 tolerances: the server's f64 scan met the float64 reference to about 1e-16 over 300
    # draws (cpu and torch backends), where inputs or a y narrowed through f32 were off by
    # 9e-9 to 3e-8, far past 1e-12 + 1e-10·|expected|
    assert_close(Tensor.to_list(y), y_ref, "y", 1.0e-12, 1.0e-10)
  end

  test "50 concurrent callers, each with its own inputs, each get their own answer", %{
    server: server
  } do
    # each caller draws its inputs from a seed of this test's random state (set by ExUnit from
    # the run's --seed): tasks do not inherit it
    results =
      Enum.map(1..50, &{&1, TestSupport.draw_seed()})
      |> Task.async_stream(
        fn {i, seed} ->
          :rand.seed(:exsss, seed)

          sizes = %{
            batch: 1 + rem(i, 3),
            seq: 2 + rem(i, 5),
            dim: 3 + rem(i, 4),
            state: 2 + rem(i, 3)
          }

          inputs = scan_inputs(sizes, [:D]) |> Map.put(:return_state, true)
          {inputs, ScanBridge.scan(server, inputs)}
        end,
        max_concurrency: 50,
        timeout: 60_000
      )
      |> Enum.map(fn {:ok, result} -> result end)

    assert length(results) == 50

    for {inputs, outcome} <- results do
      assert {:ok, result} = outcome
      assert_scan_matches(result, inputs)
    end
  end

  test "a call past its deadline gets :timeout and its late reply is dropped", %{server: server} do
    inputs = scan_inputs(%{batch: 2, seq: 3, dim: 4, state: 2}, [])
    {:ok, os_pid} = ScanBridge.os_pid(server)
    # frozen, the server cannot answer before the deadline; thawed, it answers late
    TestSupport.freeze(os_pid)
    started = System.monotonic_time(:millisecond)
    outcome = ScanBridge.scan(server, inputs, timeout: 50)
    elapsed = System.monotonic_time(:millisecond) - started
    TestSupport.thaw(os_pid)
    assert {:error, %Error{reason: :timeout}} = outcome
    assert elapsed >= 50 and elapsed < 1_000

    # the late reply is dropped: the next calls get their own answers
    other = scan_inputs(%{batch: 1, seq: 5, dim: 3, state: 2}, [:D])
    assert {:ok, result} = ScanBridge.scan(server, other)
    assert_scan_matches(result, other)
    assert ScanBridge.ping(server) == :ok
    assert :sys.get_state(server).outstanding == %{}
    refute_received _
  end

  test "a server error comes back typed, with the server's detail", %{server: server} do
    inputs = scan_inputs(%{batch: 2, seq: 5, dim: 3, state: 2}, [])
    bad = %{inputs | B: TestSupport.random(:f32, {2, 4, 2})}

    assert {:error, %Error{reason: :shape_mismatch, code: "shape_mismatch", detail: detail}} =
             ScanBridge.scan(server, bad)

    assert detail["field"] =~ "B"
    assert_raise Error, fn -> ScanBridge.scan!(server, bad) end

    assert {:error, %Error{reason: :missing_argument}} =
             ScanBridge.scan(server, Map.delete(inputs, :C))

    assert %{y: %Tensor{}} = ScanBridge.scan!(server, inputs)
  end

  test "inputs that cannot be sent are refused before sending", %{server: server} do
    assert_raise ArgumentError, ~r/scan input x: expected a tensor.*got \[1\.0\]/, fn ->
      ScanBridge.scan(server, %{x: [1.0]})
    end

    assert_raise ArgumentError, ~r/expected a ScanBridge.Tensor/, fn ->
      ScanBridge.scan(server, %{x: URI.parse("x:")})
    end

    assert_raise ArgumentError, ~r/expected a map of argument names/, fn ->
      ScanBridge.scan(server, x: 1)
    end

    # hand-built structs that new/3 would refuse: checked the same way, never encoded
    for {bad, pattern} <- [
          {%Tensor{data: <<>>, dtype: :f32, shape: Tuple.duplicate(0, 16)}, ~r/at most 8/},
          {%Tensor{data: <<0, 0>>, dtype: :a_dtype_name_of_thirty_two_chars, shape: {2}},
           ~r/tensor dtype: expected one of/},
          {%Tensor{data: <<0, 0>>, dtype: :f32, shape: {2}}, ~r/expected 8 bytes/}
        ] do
      assert_raise ArgumentError, ~r/^put tensor: /, fn -> ScanBridge.put(server, bad) end
      assert_raise ArgumentError, pattern, fn -> ScanBridge.put(server, bad) end
    end

    assert ScanBridge.ping(server) == :ok
    assert :sys.get_state(server).outstanding == %{}
  end

  test "ids, frames and options of the wrong kind raise ArgumentError in the caller", %{
    server: server
  } do
    # found in review: function clauses' guards raised FunctionClauseError for these
    x = Tensor.from_list([1.0], :f32, {1, 1})

    for {call, pattern} <- [
          {fn -> ScanBridge.step(server, :session, %{x: x}) end, ~r/^step session: expected an id/},
          {fn -> ScanBridge.step(server, "", %{x: x}) end, ~r/^step session: expected an id/},
          {fn -> ScanBridge.close_session(server, nil) end, ~r/^close_session session/},
          {fn -> ScanBridge.session_state(server, 123) end, ~r/^session_state session/},
          {fn -> ScanBridge.free(server, "id") end, ~r/^free handle/},
          {fn -> ScanBridge.free(server, {:handle, 7}) end, ~r/^free handle/},
          {fn -> ScanBridge.restore_with_frames(server, "s", "n", nil) end,
           ~r/frames: expected a list/},
          {fn ->
             ScanBridge.open_session_with_frames(server, [batch: 1, dim: 1, state: 1], :none)
           end, ~r/frames: expected a list/},
          {fn -> ScanBridge.ping(server, 5000) end, ~r/^ping options: expected a keyword list/},
          {fn -> ScanBridge.scan(server, %{x: x}, %{timeout: 10}) end, ~r/^scan options/}
        ] do
      assert_raise ArgumentError, pattern, call
    end

    assert ScanBridge.ping(server) == :ok
    assert :sys.get_state(server).outstanding == %{}
  end

  # found in review: a plain call ran a misspelt `timout:` with the default timeout
  test "a plain call's unknown option raises in the caller, naming it", %{server: server} do
    x = Tensor.from_list([1.0], :f32, {1, 1})

    for {call, pattern} <- [
          {fn -> ScanBridge.ping(server, timout: 10) end,
           ~r/^ping options: expected only :timeout, got :timout$/},
          {fn -> ScanBridge.scan(server, %{x: x}, return_state: true) end,
           ~r/^scan options: expected only :timeout, got :return_state$/},
          {fn -> ScanBridge.step(server, "s", %{x: x}, timeout: 10, output: :hidden) end,
           ~r/^step options: expected only :timeout, got :output$/},
          {fn -> ScanBridge.close_session(server, "s", retry: true) end, ~r/got :retry$/}
        ] do
      assert_raise ArgumentError, pattern, call
    end

    assert ScanBridge.ping(server, timeout: 5000) == :ok
    assert :sys.get_state(server).outstanding == %{}
  end

  test "a bad :timeout raises in the caller, and the client goes on", %{server: server} do
    for bad <- [-1, nil, 1.5, "100", 0x1_0000_0000] do
      assert_raise ArgumentError,
                   ~r/:timeout: expected :infinity or an integer of milliseconds in 0\.\.4294967295, got #{Regex.escape(inspect(bad))}$/,
                   fn -> ScanBridge.ping(server, timeout: bad) end
    end

    assert ScanBridge.ping(server, timeout: 0xFFFF_FFFF) == :ok
    assert ScanBridge.ping(server, timeout: :infinity) == :ok
  end

  test "a reply whose id no request had is logged and dropped; the client goes on", %{
    server: server
  } do
    %{port: port} = :sys.get_state(server)
    reply = %{"v" => 1, "id" => "not-ours", "ok" => true, "result" => %{}}

    log =
      ExUnit.CaptureLog.capture_log(fn ->
        send(server, {port, {:data, ScanBridge.Msgpack.encode(reply) |> IO.iodata_to_binary()}})
        assert ScanBridge.ping(server) == :ok
      end)

    assert log =~ ~s(reply for id "not-ours", which no request had, dropped)
  end

  test "replies that name no request, with none in flight, are logged and dropped", %{
    server: server
  } do
    %{port: port} = :sys.get_state(server)

    without_id = %{
      "v" => 1,
      "id" => nil,
      "ok" => false,
      "error" => %{"code" => "decode_error", "message" => "?"}
    }

    log =
      ExUnit.CaptureLog.capture_log(fn ->
        for reply <- [without_id, [1, 2]] do
          send(server, {port, {:data, ScanBridge.Msgpack.encode(reply) |> IO.iodata_to_binary()}})
        end

        send(server, {port, {:data, <<0xC1>>}})
        assert ScanBridge.ping(server) == :ok
      end)

    assert log =~ "error reply for id nil"
    assert log =~ "undecodable reply"
  end

  describe "handles" do
    if reason = TestSupport.skip_reason(:handles), do: @describetag(skip: reason)

    test "a put tensor stands in for its data until freed", %{server: server} do
      inputs = scan_inputs(%{batch: 2, seq: 5, dim: 3, state: 2}, [:D])
      assert {:ok, {:handle, _} = a} = ScanBridge.put(server, inputs."A")
      assert {:ok, result} = ScanBridge.scan(server, %{inputs | A: a})
      assert_scan_matches(result, inputs)
      assert ScanBridge.free(server, a) == :ok
      assert {:error, %Error{reason: :unknown_handle}} = ScanBridge.scan(server, %{inputs | A: a})
    end
  end
end
