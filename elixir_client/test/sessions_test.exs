defmodule ScanBridge.SessionsTest do
  # Sessions over the Port: prefilled by a scan, stepped, read, closed.
  use ExUnit.Case, async: false

  alias ScanBridge.TestSupport

  if reason = TestSupport.skip_reason(:sessions), do: @moduletag(skip: reason)

  setup_all do
    %{server: start_supervised!({ScanBridge, TestSupport.server_opts()})}
  end

  # {id, sizes, optional tensors, options, prefill steps, steps}
  @cases [
    {"plain", %{batch: 2, dim: 5, state: 3}, [], %{}, 6, 3},
    {"every option, 3 groups", %{batch: 3, dim: 6, state: 4, groups: 3}, [:D, :z, :dt_bias],
     %{dt_softplus: true, dt_min: 0.02, dt_max: 0.6}, 5, 4},
    {"batch 1, one-step prefill", %{batch: 1, dim: 7, state: 2}, [:D], %{}, 1, 5}
  ]

  for {id, sizes, optional, options, prefill, steps} <- @cases do
    test "a session prefilled and stepped matches the reference: #{id}", %{server: server} do
      TestSupport.assert_session_scenario(
        server,
        unquote(Macro.escape(sizes)),
        unquote(optional),
        unquote(Macro.escape(options)),
        unquote(prefill),
        unquote(steps)
      )
    end
  end

  test "step inputs naming the session, or an argument twice, raise before anything is sent", %{
    server: server
  } do
    assert {:ok, session} = ScanBridge.open_session(server, batch: 1, dim: 2, state: 2)
    f32 = fn shape -> TestSupport.random(:f32, shape) end
    inputs = %{x: f32.({1, 2}), dt: f32.({1, 2}), A: f32.({2, 2}), B: f32.({1, 2}), C: f32.({1, 2})}

    assert_raise ArgumentError,
                 ~r/step inputs: expected no session \(step\/4 takes it as its second argument\), got "#{session}"/,
                 fn ->
                   ScanBridge.step(server, session, Map.put(inputs, :session, session),
                     timeout: 5_000
                   )
                 end

    assert_raise ArgumentError,
                 ~r/step inputs: expected each argument once, got x both as an atom and as a string/,
                 fn ->
                   ScanBridge.step(server, session, Map.put(inputs, "x", inputs.x), timeout: 5_000)
                 end

    # nothing reached the session: its state is still the zeros it opened with
    assert {:ok, state} = ScanBridge.session_state(server, session)
    assert Enum.all?(ScanBridge.Tensor.to_list(state), &(&1 == 0.0))
    assert {:ok, %{y: _}} = ScanBridge.step(server, session, inputs)
    assert ScanBridge.close_session(server, session) == :ok
  end

  test "a step with return_state: true answers the state after it, as session_state would", %{
    server: server
  } do
    f32 = fn shape -> TestSupport.random(:f32, shape) end

    plain = fn ->
      %{x: f32.({2, 3}), dt: f32.({2, 3}), A: f32.({3, 2}), B: f32.({2, 2}), C: f32.({2, 2})}
    end

    ssd = fn ->
      %{
        x: f32.({2, 2, 3}),
        dt: TestSupport.random(:f32, {2, 2}, 0.05, 0.5),
        A: TestSupport.random(:f32, {2}, -2.0, -0.1),
        B: f32.({2, 1, 4}),
        C: f32.({2, 1, 4})
      }
    end

    for {dims, frame} <- [
          {[batch: 2, dim: 3, state: 2], plain},
          {[kind: :ssd, batch: 2, heads: 2, headdim: 3, state: 4], ssd}
        ] do
      assert {:ok, asking} = ScanBridge.open_session(server, dims)
      assert {:ok, twin} = ScanBridge.open_session(server, dims)

      for _ <- 1..3 do
        inputs = frame.()

        assert {:ok, %{y: y, state: %ScanBridge.Tensor{dtype: :f32} = state}} =
                 ScanBridge.step(server, asking, Map.put(inputs, :return_state, true))

        assert {:ok, %{y: twin_y, state: nil}} = ScanBridge.step(server, twin, inputs)
        assert y.data == twin_y.data
        assert {:ok, ^state} = ScanBridge.session_state(server, asking)
        assert {:ok, ^state} = ScanBridge.session_state(server, twin)
        refute Enum.all?(ScanBridge.Tensor.to_list(state), &(&1 == 0.0))
      end

      assert ScanBridge.close_session(server, asking) == :ok
      assert ScanBridge.close_session(server, twin) == :ok
    end
  end

  describe "open_session_with_frames" do
    defp plain_frame do
      f32 = fn shape -> TestSupport.random(:f32, shape) end
      %{x: f32.({2, 3}), dt: f32.({2, 3}), A: f32.({3, 2}), B: f32.({2, 2}), C: f32.({2, 2})}
    end

    test "runs the frames on the session it opens, as steps one by one would", %{server: server} do
      dims = [batch: 2, dim: 3, state: 2]
      {:ok, source} = ScanBridge.open_session(server, dims)
      for _ <- 1..2, do: {:ok, _} = ScanBridge.step(server, source, plain_frame())
      {:ok, saved} = ScanBridge.session_state(server, source)
      window = TestSupport.scan_inputs(%{batch: 2, seq: 4, dim: 3, state: 2})
      steps = [plain_frame(), Map.put(plain_frame(), :return_state, true)]
      frames = [{:scan, window} | Enum.map(steps, &{:step, &1})]
      dims = dims ++ [h0: saved]

      assert {:ok, session, [prefill, first, second]} =
               ScanBridge.open_session_with_frames(server, dims, frames)

      {:ok, twin} = ScanBridge.open_session(server, dims)
      assert prefill.y.data == ok!(ScanBridge.scan(server, Map.put(window, :session, twin))).y.data

      for {got, inputs} <- Enum.zip([first, second], steps) do
        assert got.y.data == ok!(ScanBridge.step(server, twin, inputs)).y.data
      end

      assert first.state == nil
      assert {:ok, state} = ScanBridge.session_state(server, session)
      assert second.state == state
      assert {:ok, ^state} = ScanBridge.session_state(server, twin)
    end

    test "a model session's frames answer as model_step and model_forward do", %{server: server} do
      alias ScanBridge.TestSupport.Models
      config = Models.config(:mamba2)
      {:ok, %{"model" => model}} = ScanBridge.load_model(server, Models.backbone(config, 3))
      embeds = Models.embeds(1, 5, config["d_model"])
      window = {:embeds, Models.frames(embeds, 0, 3)}
      {:ok, twin} = ScanBridge.open_session(server, model: model, batch: 1)

      assert {:ok, session, [prefill, {out, state}]} =
               ScanBridge.open_session_with_frames(server, [model: model, batch: 1], [
                 {:model_forward, window, last_only: true, lengths: [2]},
                 {:model_step, {:embeds, Models.frame(embeds, 3)}, return_state: true}
               ])

      assert prefill ==
               ok!(ScanBridge.model_forward(server, twin, window, last_only: true, lengths: [2]))

      assert out == ok!(ScanBridge.model_step(server, twin, {:embeds, Models.frame(embeds, 3)}))
      assert {:ok, ^state} = ScanBridge.session_state(server, session)
    end

    test "a failing frame is named and leaves no session open", %{server: server} do
      {:ok, %{"sessions" => %{"sessions" => open}}} = ScanBridge.stats(server)
      bad = %{plain_frame() | x: TestSupport.random(:f32, {3, 3})}

      assert {:error, %ScanBridge.Error{reason: :shape_mismatch, detail: detail}} =
               ScanBridge.open_session_with_frames(server, [batch: 2, dim: 3, state: 2], [
                 {:step, plain_frame()},
                 {:step, bad}
               ])

      assert %{"field" => "args.frames[1].args.x", "frame" => 1} = detail
      assert {:ok, %{"sessions" => %{"sessions" => ^open}}} = ScanBridge.stats(server)
    end

    test "a frame it cannot send raises before anything is sent", %{server: server} do
      dims = [batch: 2, dim: 3, state: 2]

      assert_raise ArgumentError,
                   ~r/step inputs: expected no session \(a frame's is the call's session\)/,
                   fn ->
                     ScanBridge.open_session_with_frames(server, dims, [
                       {:step, Map.put(plain_frame(), :session, "s")}
                     ])
                   end

      assert_raise ArgumentError, ~r/frame: expected/, fn ->
        ScanBridge.open_session_with_frames(server, dims, [{:session_state, %{}}])
      end

      assert_raise ArgumentError,
                   ~r/model_step options: expected only :output, :return_state/,
                   fn ->
                     ScanBridge.open_session_with_frames(server, [model: "m", batch: 1], [
                       {:model_step, {:embeds, TestSupport.random(:f32, {1, 8})}, timeout: 5}
                     ])
                   end
    end
  end

  defp ok!({:ok, value}), do: value

  test "sessions are the client's: an unknown id is :unknown_session", %{server: server} do
    assert {:error, %ScanBridge.Error{reason: :unknown_session}} =
             ScanBridge.session_state(server, "no-such-session")

    assert {:error, %ScanBridge.Error{reason: :unknown_session}} =
             ScanBridge.close_session(server, "no-such-session")
  end
end
