defmodule ScanBridge.ModelsTest do
  # Whole models (SPEC §6.4) from Elixir: tiny random Mamba and Mamba-2 backbones built here
  # (test/support/models.ex) and sent with model_load {config, weights}, then windows, steps,
  # snapshots, restores, forks and saved states against the real server; the errors, and the
  # inputs refused before anything is sent.
  use ExUnit.Case, async: false

  alias ScanBridge.{Error, Tensor, TestSupport}
  alias ScanBridge.TestSupport.Models
  import ScanBridge.TestSupport.Models, only: [load_and_open: 3, close_and_free: 3, steps: 4]

  @moduletag timeout: 120_000
  if reason = TestSupport.skip_reason(:models), do: @moduletag(skip: reason)

  setup_all do
    %{server: start_supervised!({ScanBridge, TestSupport.server_opts()})}
  end

  describe "against the server" do
    for arch <- [:mamba, :mamba2] do
      @arch arch

      test "#{arch}: embeddings in, hidden states out; a backbone has no logits", %{
        server: server
      } do
        {info, session} = load_and_open(server, @arch, 2)
        config = Models.config(@arch)
        assert info["arch"] == config["arch"]
        assert info["layers"] == 2 and info["d_model"] == 8
        assert info["outputs"] == ["hidden"]
        refute Map.has_key?(info, "vocab_size")

        embeds = Models.embeds(2, 6, 8)
        assert {:ok, hidden} = ScanBridge.model_forward(server, session, {:embeds, embeds})
        assert %Tensor{dtype: :f32, shape: {2, 6, 8}} = hidden
        assert Enum.all?(Tensor.to_list(hidden), &is_float/1)

        # "hidden" named, and the map form of the input, give the same kind of answer
        assert {:ok, %Tensor{shape: {2, 1, 8}}} =
                 ScanBridge.model_forward(server, session, %{embeds: embeds},
                   output: :hidden,
                   last_only: true
                 )

        assert {:ok, %Tensor{shape: {2, 8}}} =
                 ScanBridge.model_step(server, session, {:embeds, Models.frame(embeds, 0)},
                   output: "hidden"
                 )

        for call <- [
              fn ->
                ScanBridge.model_forward(server, session, {:embeds, embeds}, output: :logits)
              end,
              fn ->
                ScanBridge.model_step(server, session, {:embeds, Models.frame(embeds, 0)},
                  output: "logits"
                )
              end
            ] do
          assert {:error, %Error{reason: :invalid_argument, code: "invalid_argument"} = error} =
                   call.()

          assert error.detail["field"] == "args.output"
        end

        # a backbone has no embedding: tokens are refused by name
        tokens = Tensor.from_list([1, 2], :i64, {2})

        assert {:error, %Error{code: "invalid_argument", detail: %{"field" => "args.tokens"}}} =
                 ScanBridge.model_step(server, session, {:tokens, tokens})

        close_and_free(server, info, [session])
      end

      test "#{arch}: with :lengths a row runs only its own first positions", %{server: server} do
        {info, whole} = load_and_open(server, @arch, 2)
        assert {:ok, ragged} = ScanBridge.open_session(server, model: info["model"], batch: 2)
        embeds = Models.embeds(2, 6, 8)
        assert {:ok, expected} = ScanBridge.model_forward(server, whole, {:embeds, embeds})

        assert {:ok, %Tensor{shape: {2, 6, 8}} = got} =
                 ScanBridge.model_forward(server, ragged, {:embeds, embeds}, lengths: [6, 3])

        # row 0 whole; row 1 its first 3 positions (a prefix's outputs are the whole's), then zeros
        {want, have} = {Tensor.to_list(expected), Tensor.to_list(got)}
        row = fn values, r, from, count -> Enum.slice(values, (r * 6 + from) * 8, count * 8) end

        for {a, e} <- [
              {row.(have, 0, 0, 6), row.(want, 0, 0, 6)},
              {row.(have, 1, 0, 3), row.(want, 1, 0, 3)}
            ],
            {x, y} <- Enum.zip(a, e),
            do: assert(abs(x - y) <= 1.0e-4 * max(1.0, abs(y)))

        assert Enum.all?(row.(have, 1, 3, 3), &(&1 == 0.0))

        for lengths <- [[6, -1], [6 | 3]] do
          assert_raise ArgumentError, ~r/:lengths/, fn ->
            ScanBridge.model_forward(server, ragged, {:embeds, embeds}, lengths: lengths)
          end
        end

        assert {:error, %Error{code: "invalid_argument", detail: %{"field" => "args.lengths"}}} =
                 ScanBridge.model_forward(server, ragged, {:embeds, embeds}, lengths: [7, 3])

        close_and_free(server, info, [whole, ragged])
      end

      test "#{arch}: a 6-frame window equals 3 frames then 3 steps", %{server: server} do
        {info, whole} = load_and_open(server, @arch, 2)
        assert {:ok, parts} = ScanBridge.open_session(server, model: info["model"], batch: 2)
        embeds = Models.embeds(2, 6, 8)

        assert {:ok, expected} = ScanBridge.model_forward(server, whole, {:embeds, embeds})

        assert {:ok, first} =
                 ScanBridge.model_forward(server, parts, {:embeds, Models.frames(embeds, 0, 3)})

        steps =
          for t <- 3..5 do
            assert {:ok, %Tensor{shape: {2, 8}} = y} =
                     ScanBridge.model_step(server, parts, {:embeds, Models.frame(embeds, t)})

            y
          end

        Models.assert_rel_close(first, Models.frames(expected, 0, 3), 1.0e-4, "the first 3 frames")

        Models.assert_rel_close(
          Models.stack_frames(steps),
          Models.frames(expected, 3, 3),
          1.0e-4,
          "3 steps after them"
        )

        close_and_free(server, info, [whole, parts])
      end

      test "#{arch}: a step of embeddings to hidden states takes the native path where there is one",
           %{server: server} do
        # The Elixir client's frames (its ids, its tensors' encoding) are read by the server's
        # C++ model step path: no tensors are made of the wire bytes, so h2d and d2h are 0.
        assert {:ok, %{"native_step" => native, "backend" => backend}} = ScanBridge.info(server)
        # The server builds its native path beside the cpu backend's kernels.
        assert native == (backend == "cpu")
        {info, session} = load_and_open(server, @arch, 2)
        frame = Models.frame(Models.embeds(2, 1, 8), 0)
        args = %{"session" => session, "embeds" => frame, "output" => "hidden"}

        assert {:ok, %{"hidden" => _}, timing} =
                 ScanBridge.Server.request(server, "model_step", args, 30_000)

        served_natively = timing["h2d_us"] == 0 and timing["d2h_us"] == 0
        assert served_natively == native, "native path #{native}, timing #{inspect(timing)}"

        close_and_free(server, info, [session])
      end

      test "#{arch}: return_state: true answers the state after the call, as session_state would",
           %{server: server} do
        {info, asking} = load_and_open(server, @arch, 2)
        assert {:ok, twin} = ScanBridge.open_session(server, model: info, batch: 2)
        embeds = Models.embeds(2, 5, 8)
        window = {:embeds, Models.frames(embeds, 0, 3)}

        assert {:ok, {hidden, state}} =
                 ScanBridge.model_forward(server, asking, window, return_state: true)

        assert {:ok, %Tensor{} = twin_hidden} =
                 ScanBridge.model_forward(server, twin, window, return_state: false)

        assert hidden.data == twin_hidden.data
        assert {:ok, ^state} = ScanBridge.session_state(server, asking)
        assert map_size(state) == 4

        for t <- 3..4 do
          frame = {:embeds, Models.frame(embeds, t)}

          assert {:ok, {hidden, state}} =
                   ScanBridge.model_step(server, asking, frame, return_state: true, output: :hidden)

          assert {:ok, %Tensor{} = twin_hidden} = ScanBridge.model_step(server, twin, frame)
          assert hidden.data == twin_hidden.data
          assert {:ok, ^state} = ScanBridge.session_state(server, asking)
          assert {:ok, ^state} = ScanBridge.session_state(server, twin)
        end

        refute state |> Map.values() |> Enum.flat_map(&Tensor.to_list/1) |> Enum.all?(&(&1 == 0.0))
        close_and_free(server, info, [asking, twin])
      end

      test "#{arch}: a restored snapshot replays 4 frames exactly", %{server: server} do
        {info, session} = load_and_open(server, @arch, 2)
        embeds = Models.embeds(2, 7, 8)

        assert {:ok, _} =
                 ScanBridge.model_forward(server, session, {:embeds, Models.frames(embeds, 0, 3)})

        assert {:ok, snapshot} = ScanBridge.snapshot(server, session)
        assert is_binary(snapshot)
        first = steps(server, session, embeds, 3..6)
        assert ScanBridge.restore(server, session, snapshot) == :ok
        again = steps(server, session, embeds, 3..6)
        assert Enum.map(again, & &1.data) == Enum.map(first, & &1.data)

        # the snapshot stays for restoring again; a window re-simulates the same frames
        assert ScanBridge.restore(server, session, snapshot) == :ok

        assert {:ok, window} =
                 ScanBridge.model_forward(server, session, {:embeds, Models.frames(embeds, 3, 4)})

        Models.assert_rel_close(window, Models.stack_frames(first), 1.0e-4, "the window re-run")

        assert ScanBridge.free_snapshot(server, snapshot) == :ok

        assert {:error, %Error{reason: :unknown_snapshot}} =
                 ScanBridge.restore(server, session, snapshot)

        close_and_free(server, info, [session])
      end

      test "#{arch}: a rollback re-simulates its frames in the restore's request",
           %{server: server} do
        {info, session} = load_and_open(server, @arch, 2)
        embeds = Models.embeds(2, 7, 8)

        assert {:ok, _} =
                 ScanBridge.model_forward(server, session, {:embeds, Models.frames(embeds, 0, 3)})

        assert {:ok, snapshot} = ScanBridge.snapshot(server, session)
        first = steps(server, session, embeds, 3..6)

        frames = [
          {:model_step, {:embeds, Models.frame(embeds, 3)}},
          {:model_forward, {:embeds, Models.frames(embeds, 4, 3)}, [return_state: true]}
        ]

        assert {:ok, [step, {window, state}]} =
                 ScanBridge.restore_with_frames(server, session, snapshot, frames)

        assert step.data == hd(first).data
        Models.assert_rel_close(window, Models.stack_frames(tl(first)), 1.0e-4, "the window")
        assert {:ok, ^state} = ScanBridge.session_state(server, session)

        # a frame that fails names itself, and leaves the snapshot's state
        bad = {:model_step, {:embeds, Models.frame(Models.embeds(3, 1, 8), 0)}}

        assert {:error, %Error{reason: :shape_mismatch, detail: detail}} =
                 ScanBridge.restore_with_frames(server, session, snapshot, [hd(frames), bad])

        assert detail["field"] == "args.frames[1].args.embeds" and detail["frame"] == 1

        # a re-simulated frame refreshes a ring's snapshot with the state before it; a failed
        # request leaves the snapshot it copied into undefined
        assert {:ok, ring} = ScanBridge.snapshot(server, session)
        input = elem(hd(frames), 1)

        assert {:ok, [_]} =
                 ScanBridge.restore_with_frames(server, session, snapshot, [
                   {:model_step, input, [snapshot_into: ring]}
                 ])

        assert {:ok, probe} = ScanBridge.fork(server, session)
        assert :ok = ScanBridge.restore(server, probe, snapshot)
        assert {:ok, before_frame} = ScanBridge.session_state(server, probe)
        assert :ok = ScanBridge.restore(server, probe, ring)
        assert {:ok, ^before_frame} = ScanBridge.session_state(server, probe)

        assert {:error, %Error{reason: :shape_mismatch}} =
                 ScanBridge.restore_with_frames(server, session, snapshot, [
                   {:model_step, input, [snapshot_into: ring]},
                   bad
                 ])

        assert {:error, %Error{reason: :state_lost}} = ScanBridge.restore(server, probe, ring)
        assert :ok = ScanBridge.close_session(server, probe)

        assert {:ok, twin} = ScanBridge.fork(server, session)
        assert ScanBridge.restore(server, twin, snapshot) == :ok
        assert {:ok, at_snapshot} = ScanBridge.session_state(server, twin)
        assert {:ok, ^at_snapshot} = ScanBridge.session_state(server, session)
        refute at_snapshot == state
        close_and_free(server, info, [session, twin])
      end

      test "#{arch}: a fork and its original go their own ways", %{server: server} do
        {info, original} = load_and_open(server, @arch, 2)
        embeds = Models.embeds(2, 3, 8)
        ours = Models.embeds(2, 3, 8)
        theirs = Models.embeds(2, 3, 8)
        assert {:ok, _} = ScanBridge.model_forward(server, original, {:embeds, embeds})
        assert {:ok, before} = ScanBridge.snapshot(server, original)
        assert {:ok, fork} = ScanBridge.fork(server, original)
        assert is_binary(fork) and fork != original

        # the fork moves on with other inputs first ...
        forked = steps(server, fork, theirs, 0..2)
        # ... and the original's next outputs are those of the state before the fork
        continued = steps(server, original, ours, 0..2)
        assert {:ok, third} = ScanBridge.open_session(server, model: info, batch: 2)
        assert ScanBridge.restore(server, third, before) == :ok

        assert Enum.map(steps(server, third, ours, 0..2), & &1.data) ==
                 Enum.map(continued, & &1.data)

        refute Enum.map(forked, & &1.data) == Enum.map(continued, & &1.data)

        # the fork's own state is its own: stepped with the original's inputs from the snapshot
        # it takes the original's course
        assert ScanBridge.restore(server, fork, before) == :ok

        assert Enum.map(steps(server, fork, ours, 0..2), & &1.data) ==
                 Enum.map(continued, & &1.data)

        assert ScanBridge.free_snapshot(server, before) == :ok
        close_and_free(server, info, [original, fork, third])
      end

      test "#{arch}: a session's state, saved and given back, goes on the same", %{
        server: server
      } do
        {info, session} = load_and_open(server, @arch, 2)
        config = Models.config(@arch)
        embeds = Models.embeds(2, 5, 8)

        assert {:ok, _} =
                 ScanBridge.model_forward(server, session, {:embeds, Models.frames(embeds, 0, 4)})

        assert {:ok, state} = ScanBridge.session_state(server, session)

        {conv, ssm} =
          case @arch do
            :mamba -> {{2, 16, config["d_conv"]}, {2, 16, 4}}
            :mamba2 -> {{2, 16 + 2 * 4, config["d_conv"]}, {2, 4, 4, 4}}
          end

        assert Map.new(state, fn {name, t} -> {name, {t.dtype, t.shape}} end) == %{
                 "layers.0.conv" => {:f32, conv},
                 "layers.0.ssm" => {:f32, ssm},
                 "layers.1.conv" => {:f32, conv},
                 "layers.1.ssm" => {:f32, ssm}
               }

        state_bytes = state |> Map.values() |> Enum.map(&byte_size(&1.data)) |> Enum.sum()
        assert state_bytes == 2 * info["state_bytes_per_row"]

        assert {:ok, copy} = ScanBridge.open_session(server, model: info, batch: 2, state: state)
        assert {:ok, ^state} = ScanBridge.session_state(server, copy)
        next = {:embeds, Models.frame(embeds, 4)}
        assert {:ok, a} = ScanBridge.model_step(server, session, next)
        assert {:ok, b} = ScanBridge.model_step(server, copy, next)
        assert a.data == b.data

        # a state of another batch, or missing a part, is refused
        assert {:error, %Error{reason: :shape_mismatch}} =
                 ScanBridge.open_session(server, model: info, batch: 3, state: state)

        assert {:error, %Error{reason: :missing_argument}} =
                 ScanBridge.open_session(server,
                   model: info,
                   batch: 2,
                   state: Map.delete(state, "layers.1.ssm")
                 )

        close_and_free(server, info, [session, copy])
      end
    end

    test "errors are values, and the server goes on serving", %{server: server} do
      {info, session} = load_and_open(server, :mamba2, 2)
      frame = {:embeds, Models.frame(Models.embeds(2, 1, 8), 0)}
      assert {:ok, _} = ScanBridge.model_step(server, session, frame)

      # embeds of another batch than the session's
      assert {:error, %Error{reason: :shape_mismatch, code: "shape_mismatch"} = e} =
               ScanBridge.model_forward(server, session, {:embeds, Models.embeds(3, 4, 8)})

      assert e.detail["field"] == "args.embeds"

      assert {:error, %Error{code: "shape_mismatch"}} =
               ScanBridge.model_step(
                 server,
                 session,
                 {:embeds, Models.frame(Models.embeds(1, 1, 8), 0)}
               )

      # a model this client never loaded
      assert {:error, %Error{reason: :unknown_model, code: "unknown_model"}} =
               ScanBridge.open_session(server, model: "no-such-model", batch: 1)

      assert {:error, %Error{reason: :unknown_model}} =
               ScanBridge.free_model(server, "no-such-model")

      # a path, on a server started without --model-dir
      assert {:error, %Error{reason: :path_not_allowed, code: "path_not_allowed"} = e} =
               ScanBridge.load_model(server, "exphil/agent-v3")

      assert e.detail["field"] == "args.path"

      # a weight missing, named
      backbone = Models.backbone(Models.config(:mamba2), 5)
      missing = Map.update!(backbone, :weights, &Map.delete(&1, "layers.1.mixer.D"))

      assert {:error, %Error{reason: :invalid_checkpoint, code: "invalid_checkpoint"} = e} =
               ScanBridge.load_model(server, missing)

      assert e.detail["field"] == "args.weights.layers.1.mixer.D"
      assert e.detail["tensor"] == "layers.1.mixer.D"

      # a weight of the wrong shape, and one not finite
      norm = Tensor.from_list([1.0, 1.0], :f32, {2})
      misshaped = put_in(backbone, [:weights, "norm_f.weight"], norm)

      assert {:error,
              %Error{
                reason: :invalid_checkpoint,
                detail: %{"field" => "args.weights.norm_f.weight"}
              }} = ScanBridge.load_model(server, misshaped)

      nan = Tensor.from_list([:nan | List.duplicate(1.0, 7)], :f32, {8})

      assert {:error, %Error{reason: :invalid_checkpoint}} =
               ScanBridge.load_model(server, put_in(backbone, [:weights, "norm_f.weight"], nan))

      # an unknown architecture
      assert {:error, %Error{reason: :invalid_checkpoint, detail: %{"field" => "args.config.arch"}}} =
               ScanBridge.load_model(server, %{
                 backbone
                 | config: %{backbone.config | "arch" => "rwkv"}
               })

      # a plain session is no model's; a model session takes no plain step
      assert {:ok, plain} = ScanBridge.open_session(server, batch: 2, dim: 3, state: 2)

      assert {:error, %Error{reason: :invalid_argument}} =
               ScanBridge.model_step(server, plain, frame)

      assert {:error, %Error{reason: :unknown_session}} =
               ScanBridge.model_step(server, "no-such-session", frame)

      assert {:error, %Error{reason: :unknown_snapshot}} =
               ScanBridge.restore(server, session, "no-such-snapshot")

      assert {:error, %Error{reason: :unknown_snapshot}} =
               ScanBridge.free_snapshot(server, "no-such-snapshot")

      # a model with a session open cannot be freed
      assert {:error, %Error{reason: :invalid_argument}} = ScanBridge.free_model(server, info)

      # still serving: the session steps on, and its model frees once it is closed
      assert ScanBridge.ping(server) == :ok
      assert {:ok, %Tensor{shape: {2, 8}}} = ScanBridge.model_step(server, session, frame)
      assert ScanBridge.close_session(server, plain) == :ok
      close_and_free(server, info, [session])

      assert {:error, %Error{reason: :unknown_model}} =
               ScanBridge.open_session(server, model: info, batch: 1)
    end

    test "free_model frees the snapshots of its sessions, and leaves nothing held", %{
      server: server
    } do
      held = fn ->
        {:ok, stats} = ScanBridge.stats(server)
        Map.take(stats["sessions"], ["sessions", "model_bytes", "snapshot_bytes"])
      end

      before = held.()
      {info, session} = load_and_open(server, :mamba, 1)
      assert {:ok, snapshot} = ScanBridge.snapshot(server, session)
      assert {:ok, fork} = ScanBridge.fork(server, session)
      during = held.()
      assert during["sessions"] == before["sessions"] + 2
      assert during["model_bytes"] == before["model_bytes"] + info["weight_bytes"]
      assert during["snapshot_bytes"] == before["snapshot_bytes"] + info["state_bytes_per_row"]
      close_and_free(server, info, [session, fork])

      assert {:error, %Error{reason: :unknown_snapshot}} =
               ScanBridge.free_snapshot(server, snapshot)

      assert held.() == before
    end

    test "weights may be handles put before", %{server: server} do
      backbone = Models.backbone(Models.config(:mamba), 3)

      handles =
        Map.new(backbone.weights, fn {name, tensor} ->
          {:ok, handle} = ScanBridge.put(server, tensor)
          {name, handle}
        end)

      assert {:ok, by_value} = ScanBridge.load_model(server, backbone)
      assert {:ok, by_handle} = ScanBridge.load_model(server, %{backbone | weights: handles})
      embeds = {:embeds, Models.embeds(1, 4, 8)}

      outputs =
        for info <- [by_value, by_handle] do
          {:ok, session} = ScanBridge.open_session(server, model: info, batch: 1)
          {:ok, hidden} = ScanBridge.model_forward(server, session, embeds)
          close_and_free(server, info, [session])
          hidden.data
        end

      assert [same, same] = outputs
      Enum.each(handles, fn {_name, handle} -> assert ScanBridge.free(server, handle) == :ok end)
    end

    test "bf16 weights follow f32 loosely", %{server: server} do
      backbone = Models.backbone(Models.config(:mamba2), 4)
      embeds = {:embeds, Models.embeds(1, 5, 8)}

      [f32, bf16] =
        for dtype <- [:f32, :bf16] do
          assert {:ok, info} = ScanBridge.load_model(server, backbone, dtype: dtype, name: "tiny")
          assert info["name"] == "tiny"
          assert info["dtype"] == Atom.to_string(dtype)
          {:ok, session} = ScanBridge.open_session(server, model: info, batch: 1)
          {:ok, hidden} = ScanBridge.model_forward(server, session, embeds)
          close_and_free(server, info, [session])
          hidden
        end

      Models.assert_rel_close(bf16, f32, 0.1, "bf16 against f32")
    end

    test "inputs that cannot be sent raise before anything is sent", %{server: server} do
      {info, session} = load_and_open(server, :mamba2, 1)
      embeds = Models.embeds(1, 2, 8)

      for {call, message} <- [
            {fn -> ScanBridge.model_forward(server, session, embeds) end,
             ~r/model_forward input: expected \{:tokens, tensor\} or \{:embeds, tensor\}/},
            {fn -> ScanBridge.model_forward(server, session, %{embeds: embeds, tokens: embeds}) end,
             ~r/model_forward input: expected/},
            {fn -> ScanBridge.model_forward(server, session, {:embeds, [1.0]}) end,
             ~r/model_forward embeds: expected a ScanBridge.Tensor/},
            {fn -> ScanBridge.model_forward(server, session, {:embeds, embeds}, output: :probs) end,
             ~r/model_forward :output: expected :logits or :hidden, got :probs/},
            {fn -> ScanBridge.model_forward(server, session, {:embeds, embeds}, last_only: 1) end,
             ~r/model_forward :last_only: expected a boolean, got 1/},
            {fn -> ScanBridge.model_step(server, session, {:embeds, embeds}, last_only: true) end,
             ~r/model_step options: expected only :output, :return_state, :snapshot_into, :timeout, got :last_only/},
            {fn -> ScanBridge.model_step(server, session, {:embeds, embeds}, return_state: 1) end,
             ~r/model_step :return_state: expected a boolean, got 1/},
            {fn ->
               ScanBridge.model_forward(server, session, {:embeds, embeds}, return_state: "yes")
             end, ~r/model_forward :return_state: expected a boolean, got "yes"/},
            {fn -> ScanBridge.model_step(server, nil, {:embeds, embeds}) end,
             ~r/model_step session: expected an id \(a non-empty string\), got nil/},
            {fn -> ScanBridge.load_model(server, %{config: %{}}) end,
             ~r/load_model source: expected a checkpoint path/},
            {fn -> ScanBridge.load_model(server, "") end, ~r/load_model source/},
            {fn -> ScanBridge.load_model(server, %{config: %{}, weights: %{"a" => 1.0}}) end,
             ~r/load_model weights.a: expected a ScanBridge.Tensor/},
            {fn -> ScanBridge.load_model(server, %{config: %{"f" => {1}}, weights: %{}}) end,
             ~r/load_model config.f: expected nil, a boolean/},
            # found in review: FunctionClauseError from Enum, as the frames' below
            {fn -> ScanBridge.load_model(server, %{config: %{"a" => [1 | 2]}, weights: %{}}) end,
             ~r/load_model config.a: expected a proper list/},
            {fn -> ScanBridge.open_session_with_frames(server, [batch: 1], [{:step, %{}} | :x]) end,
             ~r/open_session_with_frames frames: expected a list of frames, got an improper list/},
            {fn -> ScanBridge.restore_with_frames(server, session, "s", [{:step, %{}} | :x]) end,
             ~r/restore_with_frames frames: expected a list of frames, got an improper list/},
            {fn -> ScanBridge.load_model(server, %{config: %{"a" => 2, a: 1}, weights: %{}}) end,
             ~r/load_model config: expected each name once, got a both as an atom and as a string/},
            {fn -> ScanBridge.load_model(server, "m", dtype: :f64) end,
             ~r/load_model :dtype: expected :f32, :bf16 or :f16, got :f64/},
            {fn -> ScanBridge.open_session(server, model: 7, batch: 1) end,
             ~r/open_session model: expected a model id/},
            {fn -> ScanBridge.open_session(server, model: info, batch: 1, state: %{"x" => 1}) end,
             ~r/open_session input state.x: expected a ScanBridge.Tensor/},
            {fn -> ScanBridge.snapshot(server, :session) end, ~r/snapshot session: expected an id/},
            {fn -> ScanBridge.free_model(server, %{}) end,
             ~r/free_model model: expected a model id/}
          ] do
        assert_raise ArgumentError, message, call
      end

      # nothing was sent: the session is where it was, and the server answers
      assert {:ok, state} = ScanBridge.session_state(server, session)
      assert state |> Map.values() |> Enum.flat_map(&Tensor.to_list/1) |> Enum.all?(&(&1 == 0.0))
      close_and_free(server, info, [session])
    end
  end
end

defmodule ScanBridge.ModelCheckpointTest do
  # Each test with a server of its own: a checkpoint directory written here (config.json,
  # model.safetensors), loaded by path from a server started with --model-dir; what late
  # replies made, freed; and the agent loop example (examples/elixir_agent), run with a few
  # frames.
  use ExUnit.Case, async: false

  alias ScanBridge.{Error, TestSupport}
  alias ScanBridge.TestSupport.Models
  import ScanBridge.TestSupport.Models, only: [close_and_free: 3]

  @moduletag timeout: 180_000
  if reason = TestSupport.skip_reason(:models), do: @moduletag(skip: reason)

  describe "a checkpoint directory" do
    test "loads by path under --model-dir as the same weights sent do" do
      dir = Models.tmp_dir!()
      backbone = Models.backbone(Models.config(:mamba2), 9)
      Models.write_checkpoint(Path.join(dir, "tiny"), backbone)
      File.mkdir_p!(Path.join(dir, "elsewhere"))

      server =
        start_supervised!(
          {ScanBridge, TestSupport.server_opts(args: ["--device", "cpu", "--model-dir", dir])}
        )

      assert {:ok, by_path} = ScanBridge.load_model(server, "tiny")
      assert by_path["arch"] == "mamba2"
      assert {:ok, sent} = ScanBridge.load_model(server, backbone)
      embeds = {:embeds, Models.embeds(2, 4, 8)}

      [a, b] =
        for info <- [by_path, sent] do
          {:ok, session} = ScanBridge.open_session(server, model: info, batch: 2)
          {:ok, hidden} = ScanBridge.model_forward(server, session, embeds)
          close_and_free(server, info, [session])
          hidden
        end

      assert a.data == b.data

      # outside the model directory, or no checkpoint there
      assert {:error, %Error{reason: :path_not_allowed}} = ScanBridge.load_model(server, "../..")
      assert {:error, %Error{reason: :path_not_allowed}} = ScanBridge.load_model(server, "/etc")

      assert {:error, %Error{reason: :invalid_checkpoint, detail: %{"field" => "args.path"}}} =
               ScanBridge.load_model(server, "elsewhere")
    end
  end

  describe "a call given up leaves nothing on the server" do
    test "a late load_model's model, fork's session and snapshot's snapshot are freed" do
      client = start_supervised!({ScanBridge, TestSupport.server_opts()})
      # left to run when given up, as by a server without cancel: their late replies are freed
      TestSupport.without_cancel(client)
      {:ok, os_pid} = ScanBridge.os_pid(client)
      backbone = Models.backbone(Models.config(:mamba2), 8)
      {info, session} = Models.load_and_open(client, :mamba2, 1)

      held = fn ->
        {:ok, stats} = ScanBridge.stats(client)
        Map.take(stats["sessions"], ["sessions", "model_bytes", "snapshot_bytes"])
      end

      before = held.()

      served = fn op ->
        get_in(ScanBridge.stats(client), [Access.elem(1), "ops", op, "success_count"])
      end

      # frozen, the server answers each only after its deadline
      TestSupport.freeze(os_pid)

      assert {:error, %Error{reason: :timeout}} =
               ScanBridge.load_model(client, backbone, timeout: 50)

      assert {:error, %Error{reason: :timeout}} = ScanBridge.fork(client, session, timeout: 50)
      assert {:error, %Error{reason: :timeout}} = ScanBridge.snapshot(client, session, timeout: 50)
      TestSupport.thaw(os_pid)

      # once they are done, only the client's frees can take what they made away
      assert TestSupport.eventually(fn ->
               served.("model_load") == 2 and served.("session_fork") == 1 and
                 served.("session_snapshot") == 1 and held.() == before
             end)

      close_and_free(client, info, [session])
    end
  end

  describe "the agent loop example" do
    @example Path.join(TestSupport.repo_root(), "examples/elixir_agent/agent_loop.exs")

    test "runs a few frames with its random backbone, rolling back" do
      {output, status} = run_example(~w(--frames 20 --rollback-every 9 --device cpu))
      assert status == 0, output
      assert output =~ ~r/step latency: p50 [\d.]+ ms, p99 [\d.]+ ms over 20 steps/
      assert output =~ ~r/rollbacks: 2 of 7 frames/
      assert_rollback_reproduces(output, 7)
    end

    test "runs a checkpoint given by path" do
      dir = Models.tmp_dir!()
      Models.write_checkpoint(Path.join(dir, "tiny"), Models.backbone(Models.config(:mamba), 2))

      {output, status} =
        run_example(
          ~w(--frames 12 --prefix 5 --rollback 3 --rollback-every 6 --device cpu) ++
            ["--model-dir", dir, "--path", "tiny"]
        )

      assert status == 0, output
      assert output =~ ~r/loaded tiny: mamba, 2 layers, d_model 8/
      assert output =~ ~r/rollbacks: 2 of 3 frames/
      assert_rollback_reproduces(output, 3)
    end

    # A restore that left the state as it was would re-simulate from `frames` frames later:
    # outputs far from the steps'.
    defp assert_rollback_reproduces(output, frames) do
      [worst] =
        Regex.run(~r/rollback check: #{frames} frames .*largest difference ([-+.e\d]+) of/, output,
          capture: :all_but_first
        ) || flunk("no rollback check in:\n" <> output)

      {worst, ""} = Float.parse(worst)
      assert worst < 1.0e-4, output
    end

    defp run_example(args) do
      System.cmd("mix", ["run", @example | args],
        cd: Path.join(TestSupport.repo_root(), "elixir_client"),
        # the test build, compiled already; the server of this checkout
        env: [{"MIX_ENV", "test"}, {"PYTHON", TestSupport.python()}],
        stderr_to_stdout: true
      )
    end
  end
end

defmodule ScanBridge.ModelRequestsTest do
  # The requests the model API sends, caught by a stand-in for the client process: the golden
  # vectors' (SPEC §11), every argument named as SPEC §6 names it. No server.
  use ExUnit.Case, async: true

  alias ScanBridge.{Msgpack, Protocol, Tensor, TestSupport, TestSupport.JSON}

  describe "the requests sent" do
    # The API's requests, caught by a stand-in for the client process, are the golden vectors'
    # (SPEC §11) and name every argument as SPEC §6 does.

    setup do
      %{fake: fake_client()}
    end

    test "model_load by path", %{fake: fake} do
      assert {:ok, %{"model" => "m-1"}} =
               ScanBridge.load_model(fake, "exphil/agent-v3", dtype: :bf16, name: "agent")

      assert_vector("model_load_path")
    end

    test "model_load of a config and weights", %{fake: fake} do
      %{"args" => args} = vector("model_load_weights")["message"]

      weights =
        Map.new(args["weights"], fn
          {name, %{"handle" => id}} ->
            {name, {:handle, id}}

          {name, wire} ->
            {:ok, tensor} = Tensor.from_wire(bytes(wire))
            {name, tensor}
        end)

      config = Map.new(args["config"], fn {k, v} -> {String.to_atom(k), v} end)
      assert {:ok, _} = ScanBridge.load_model(fake, %{config: config, weights: weights})
      assert_vector("model_load_weights")
    end

    test "session_open of a model", %{fake: fake} do
      assert {:ok, "s-3"} = ScanBridge.open_session(fake, %{model: %{"model" => "m-1"}, batch: 2})
      assert_vector("session_open_model")
    end

    test "model_forward of tokens, last only", %{fake: fake} do
      tokens = Tensor.from_list([5, 1, 4, 1, 5, 9], :i64, {2, 3})

      assert {:ok, %Tensor{shape: {2, 1, 4}}} =
               ScanBridge.model_forward(fake, "s-3", {:tokens, tokens}, last_only: true)

      assert_vector("model_forward_tokens")
    end

    test "model_step of embeddings, hidden out", %{fake: fake} do
      embeds = Tensor.from_list([4.0, -4.0, 2.0, -1.0], :f32, {2, 2})

      assert {:ok, %Tensor{shape: {2, 2}}} =
               ScanBridge.model_step(fake, "s-3", %{embeds: embeds}, output: :hidden)

      assert_vector("model_step_embeds")
    end

    test "session_restore", %{fake: fake} do
      assert ScanBridge.restore(fake, "s-3", "p-1") == :ok
      assert_vector("session_restore")
    end

    test "the other model ops", %{fake: fake} do
      state = %{"layers.0.ssm" => Tensor.from_list([0.5, 0.25], :f32, {1, 2})}

      for {call, op, args} <- [
            {fn -> ScanBridge.snapshot(fake, "s-3") end, "session_snapshot", %{"session" => "s-3"}},
            {fn -> ScanBridge.fork(fake, "s-3") end, "session_fork", %{"session" => "s-3"}},
            {fn -> ScanBridge.free_snapshot(fake, "p-1") end, "snapshot_free",
             %{"snapshot" => "p-1"}},
            {fn -> ScanBridge.free_model(fake, "m-1") end, "model_free", %{"model" => "m-1"}},
            {fn -> ScanBridge.session_state(fake, "s-3") end, "session_state",
             %{"session" => "s-3"}},
            {fn -> ScanBridge.open_session(fake, model: "m-1", batch: 1, state: state) end,
             "session_open",
             %{
               "model" => "m-1",
               "batch" => 1,
               "state" => %{
                 "layers.0.ssm" => %{
                   "dtype" => "f32",
                   "shape" => [1, 2],
                   "data" => state["layers.0.ssm"].data
                 }
               }
             }}
          ] do
        assert {:ok, _} = ok_or(call.())
        assert_receive {:sent, body}
        assert %{"op" => ^op, "args" => ^args} = Msgpack.decode!(body)
      end
    end

    test "a model session's state reads as tensors by name", %{fake: fake} do
      assert {:ok, %{"layers.0.conv" => %Tensor{shape: {1, 2}}, "layers.0.ssm" => %Tensor{}}} =
               ScanBridge.session_state(fake, "model-session")

      assert {:ok, %Tensor{shape: {1, 2}}} = ScanBridge.session_state(fake, "plain-session")
    end
  end

  defp ok_or(:ok), do: {:ok, :ok}
  defp ok_or(other), do: other

  # A process that takes ScanBridge.Server's requests: it sends the test each request's body
  # (numbered 0) and answers with a reply fit for the op.
  defp fake_client do
    test = self()

    spawn_link(fn -> fake_loop(test) end)
  end

  defp fake_loop(test) do
    receive do
      {:"$gen_call", from, {:request, op, head, size, _timeout, _closes}} ->
        body = IO.iodata_to_binary(head)
        assert byte_size(body) + 12 == size
        send(test, {:sent, IO.iodata_to_binary([head, Protocol.id_entry(0)])})

        GenServer.reply(
          from,
          {:ok, fake_result(op, Msgpack.decode!(body <> Protocol.id_entry(0))), %{}}
        )

        fake_loop(test)
    end
  end

  defp fake_result("model_load", _), do: %{"model" => "m-1", "arch" => "mamba2"}
  defp fake_result(op, _) when op in ["session_open", "session_fork"], do: %{"session" => "s-3"}
  defp fake_result("session_snapshot", _), do: %{"snapshot" => "p-1"}

  defp fake_result("model_forward", _),
    do: %{"logits" => wire_f32([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0], [2, 1, 4])}

  defp fake_result("model_step", _), do: %{"hidden" => wire_f32([1.0, 2.0, 3.0, 4.0], [2, 2])}

  defp fake_result("session_state", %{"args" => %{"session" => "plain-session"}}),
    do: %{"state" => wire_f32([1.0, 2.0], [1, 2])}

  defp fake_result("session_state", _),
    do: %{
      "state" => %{
        "layers.0.conv" => wire_f32([1.0, 2.0], [1, 2]),
        "layers.0.ssm" => wire_f32([3.0], [1, 1])
      }
    }

  defp fake_result(_op, _), do: %{"done" => true}

  defp wire_f32(values, shape) do
    %{
      "dtype" => "f32",
      "shape" => shape,
      "data" => Tensor.from_list(values, :f32, List.to_tuple(shape)).data
    }
  end

  @vectors Path.join(TestSupport.repo_root(), "protocol/vectors")

  defp vector(name), do: @vectors |> Path.join(name <> ".json") |> File.read!() |> JSON.decode!()

  # The request sent is the vector's message (its id aside), its payloads at multiples of 8.
  defp assert_vector(name) do
    assert_receive {:sent, body}
    message = bytes(vector(name)["message"])
    assert Msgpack.decode!(body) == Map.put(message, "id", 0)

    for payload <- payloads(message) do
      {offset, _} = :binary.match(body, payload)
      assert rem(offset, 8) == 0, "#{name}: a payload at #{offset}"
    end
  end

  defp payloads(%{"dtype" => _, "shape" => _, "data" => data}), do: [data]
  defp payloads(%{} = map), do: map |> Map.values() |> Enum.flat_map(&payloads/1)
  defp payloads(_), do: []

  # The JSON meaning as the decoder returns it: {"$bytes": ...} becomes the bytes themselves.
  defp bytes(%{"$bytes" => %{"dtype" => dtype, "values" => values}}),
    do: Tensor.from_list(values, String.to_existing_atom(dtype), {length(values)}).data

  defp bytes(%{} = map), do: Map.new(map, fn {k, v} -> {k, bytes(v)} end)
  defp bytes(list) when is_list(list), do: Enum.map(list, &bytes/1)
  defp bytes(value), do: value
end
