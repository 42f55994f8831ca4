defmodule ScanBridge.ClusterPartitionTest do
  # A group of two members, one on this node and one on a `:peer` node, cut apart and joined
  # again, or one's keeper silent (its node frozen) while the other meets it: what the group did
  # to a model's name meanwhile is what both members hold after.
  use ExUnit.Case, async: false

  alias ScanBridge.{Cluster, TestSupport}
  alias ScanBridge.Cluster.Member
  alias ScanBridge.TestSupport.{Models, Peers}

  @moduletag :cluster

  setup_all do
    Peers.ensure_distributed!()
    :ok
  end

  # A group of two members, one here and one on a peer that `Peers.cut_off/1` can cut off,
  # "tiny" loaded on both: {the group, the peer, the member here, the member there}.
  defp two_members_apart do
    g = {:partition, System.unique_integer([:positive])}
    peer = Peers.start_peer!("apart", cut_off: true)
    here = start_supervised!({ScanBridge, TestSupport.server_opts(group: g)})
    [there] = Peers.start_servers!([peer], group: g)
    Peers.await_members(g, 2)
    backbone = Models.backbone(Models.config(:mamba2), 1)
    assert {:ok, %{members: 2}} = Cluster.load_model(g, "tiny", backbone)
    {g, peer, here, there}
  end

  # Cuts the peer off, and returns once both sides see the group without the other's member (a
  # call to a member one side still listed would connect the nodes again).
  defp cut_apart(g, peer) do
    Peers.cut_off(peer)
    Peers.await_members(g, 1)
    assert :peer.call(peer.peer, Peers, :await_members, [g, 1], 30_000)
  end

  # Cuts the peer off; its side then frees "tiny" and gives the name to another model of the same
  # shapes.
  defp replace_apart(g, peer) do
    cut_apart(g, peer)
    assert :ok = :peer.call(peer.peer, Cluster, :free_model, [g, "tiny"], 60_000)
    backbone = Models.backbone(Models.config(:mamba2), 2)

    assert {:ok, %{members: 1}} =
             :peer.call(peer.peer, Cluster, :load_model, [g, "tiny", backbone], 60_000)
  end

  # Waits until `member` holds a model other than `old_id` under "tiny" (its catalogue keeper
  # took a newer entry).
  defp await_replaced(member, old_id) do
    assert TestSupport.eventually(
             fn ->
               case ScanBridge.Server.model_named(member, "tiny") do
                 {:ok, id} -> id not in [nil, old_id]
                 {:error, error} -> flunk("#{inspect(member)}: #{error.message}")
               end
             end,
             20_000
           )
  end

  # One frame through `member`'s model named "tiny": what distinguishes one model from another.
  defp frame_through(member, frame) do
    {:ok, id} = ScanBridge.Server.model_named(member, "tiny")
    {:ok, session} = ScanBridge.open_session(member, model: id, batch: 1)
    {:ok, out} = ScanBridge.model_step(member, session, {:embeds, frame})
    :ok = ScanBridge.close_session(member, session)
    {id, out}
  end

  test "a member cut off while its model's name went to another model takes that model when back" do
    {g, peer, here, there} = two_members_apart()
    config = Models.config(:mamba2)
    frame = Models.frame(Models.embeds(1, 1, config["d_model"]), 0)
    {old_id, _} = frame_through(there, frame)

    Peers.cut_off(peer)
    Peers.await_members(g, 1)
    assert :ok = Cluster.free_model(g, "tiny")
    assert {:ok, %{members: 1}} = Cluster.load_model(g, "tiny", Models.backbone(config, 2))
    Peers.reconnect(peer)
    Peers.await_members(g, 2)

    # the member that was apart gives its model up and loads the group's newer one
    await_replaced(there, old_id)

    {_, want} = frame_through(here, frame)
    {_, got} = frame_through(there, frame)
    Models.assert_rel_close(got, want, 1.0e-6, "the frame through the member that was apart")

    assert {:error, %ScanBridge.Error{reason: :unknown_model}} =
             ScanBridge.free_model(there, old_id)
  end

  # A cluster session of "tiny" opened on `member`, checkpointed every 2 frames.
  defp session_on(g, member) do
    {:ok, s} = Cluster.open_session(g, [model: "tiny", batch: 1], checkpoint: 2)

    case Cluster.session_info(s) do
      {:ok, %{member: ^member}} ->
        s

      _elsewhere ->
        on = session_on(g, member)
        :ok = Cluster.close_session(s)
        on
    end
  end

  test "a session of a model given up while apart is not rebuilt under the name's new model" do
    {g, peer, here, there} = two_members_apart()
    config = Models.config(:mamba2)
    embeds = Models.embeds(1, 3, config["d_model"])
    frames = for t <- 0..2, do: {:embeds, Models.frame(embeds, t)}
    {:ok, old_id} = ScanBridge.Server.model_named(here, "tiny")
    {:ok, reference} = ScanBridge.open_session(here, model: old_id, batch: 1)
    expected = for f <- frames, do: ok!(ScanBridge.model_step(here, reference, f))
    :ok = ScanBridge.close_session(here, reference)

    s = session_on(g, here)
    got = for f <- Enum.take(frames, 2), do: ok!(Cluster.model_step(s, f))

    replace_apart(g, peer)
    Peers.reconnect(peer)
    Peers.await_members(g, 2)

    # this node's member takes the newer model under the name; the session goes on with its own
    await_replaced(here, old_id)

    got = got ++ [ok!(Cluster.model_step(s, Enum.at(frames, 2)))]
    for {a, e} <- Enum.zip(got, expected), do: Models.assert_rel_close(a, e, 1.0e-6, "frame")

    # a fork would run its source's model too, which no member holds under the name any more
    assert {:error, %ScanBridge.Error{reason: :no_members}} = Cluster.fork(s)

    # its server gone, no member holds its model: refused, never run on the name's new model
    {:ok, os_pid} = ScanBridge.os_pid(here)
    TestSupport.kill!(os_pid)

    # (a call the keeper sends before it hears of the exit is answered the exit)
    assert {:error, %ScanBridge.Error{reason: first}} = Cluster.model_step(s, Enum.at(frames, 0))
    assert first in [:server_exited, :no_members]

    assert {:error, %ScanBridge.Error{reason: :no_members}} =
             Cluster.model_step(s, Enum.at(frames, 0))

    # refused though the other member holds a model under the name
    assert {:ok, id} = ScanBridge.Server.model_named(there, "tiny")
    assert is_binary(id)
  end

  test "a member retiring a model while its server is frozen still gives a joining member the catalogue" do
    {g, peer, here, _there} = two_members_apart()
    {:ok, old_id} = ScanBridge.Server.model_named(here, "tiny")
    # the session keeps the old model in use here, so that it is retired, not freed, below
    s = session_on(g, here)
    replace_apart(g, peer)
    Peers.reconnect(peer)
    Peers.await_members(g, 2)
    await_replaced(here, old_id)

    # apart again, with here's server frozen while its keeper tries to free the retired model
    Peers.cut_off(peer)
    Peers.await_members(g, 1)
    {:ok, os_pid} = ScanBridge.os_pid(here)
    TestSupport.freeze(os_pid)
    Process.sleep(2_500)

    # the one keeper to copy from answers, and the member joins holding the group's model
    joiner = start_supervised!({ScanBridge, TestSupport.server_opts(group: g)}, id: :joiner)
    Peers.await_members(g, 2)
    assert {:ok, id} = ScanBridge.Server.model_named(joiner, "tiny")
    assert is_binary(id)

    TestSupport.thaw(os_pid)
    assert :ok = Cluster.close_session(s)
  end

  describe "a catalogue keeper silent past the wait for it" do
    # longer than a keeper waits for another's catalogue before it goes on without it
    @silent_ms 6_000

    test "a member joining while it is frozen takes its models once it thaws, still connected" do
      g = {:partition, System.unique_integer([:positive])}
      peer = Peers.start_peer!("silent")
      [there] = Peers.start_servers!([peer], group: g)
      Peers.await_members(g, 1)
      backbone = Models.backbone(Models.config(:mamba2), 1)
      assert {:ok, %{members: 1}} = Cluster.load_model(g, "tiny", backbone)
      :ok = :net_kernel.monitor_nodes(true)

      Peers.freeze_peer(peer)
      joiner = start_supervised!({ScanBridge, TestSupport.server_opts(group: g)}, id: :joiner)
      # it serves without the silent keeper's catalogue rather than wait for it
      assert TestSupport.eventually(fn -> joiner in Cluster.members(g) end, 20_000)
      assert {:ok, nil} = model_named(joiner)
      Peers.thaw_peer(peer)

      assert TestSupport.eventually(
               fn -> match?({:ok, id} when is_binary(id), model_named(joiner)) end,
               20_000
             ),
             "the member that joined while the keeper was frozen never took its model"

      {:ok, members} = Cluster.catalogue(g)
      assert [%{"tiny" => a}, %{"tiny" => b}] = Enum.map(members, & &1.models)
      assert is_binary(a.model) and is_binary(b.model)
      assert Map.delete(a, :model) == Map.delete(b, :model)
      assert {:ok, id} = model_named(there)
      assert is_binary(id)
      # the nodes stayed connected: no :nodeup started a reconcile
      refute_received {:nodedown, _node}
    end

    test "a member meeting it again after a partition takes its newer entries once it answers" do
      {g, peer, here, _there} = two_members_apart()
      {:ok, old_id} = model_named(here)
      replace_apart(g, peer)

      # the peer's keeper answers nothing as the nodes connect again, and for a while after
      [keeper] = :peer.call(peer.peer, Member, :keepers, [g], 10_000)
      :ok = :peer.call(peer.peer, :sys, :suspend, [keeper], 10_000)
      Peers.reconnect(peer)
      Peers.await_members(g, 2)
      Process.sleep(@silent_ms)
      :ok = :peer.call(peer.peer, :sys, :resume, [keeper], 10_000)

      await_replaced(here, old_id)
    end

    test "its late answer gives a joining member no model under a name freed meanwhile" do
      {g, peer, here, there} = two_members_apart()
      cut_apart(g, peer)
      assert :ok = Cluster.free_model(g, "tiny")

      # the peer's keeper, still holding the name's older entry, is silent as the nodes connect
      # again and a member joins here
      [keeper] = :peer.call(peer.peer, Member, :keepers, [g], 10_000)
      :ok = :peer.call(peer.peer, :sys, :suspend, [keeper], 10_000)
      Peers.reconnect(peer)
      Peers.await_members(g, 2)
      joiner = start_supervised!({ScanBridge, TestSupport.server_opts(group: g)}, id: :joiner)
      Peers.await_members(g, 3)
      Process.sleep(@silent_ms)
      :ok = :peer.call(peer.peer, :sys, :resume, [keeper], 10_000)

      # it answered both members before it took the newer entry from them and freed the model
      assert TestSupport.eventually(fn -> model_named(there) == {:ok, nil} end, 20_000)
      # (each member's task that waited for the answer passes it on in a message of its own)
      Process.sleep(500)
      {:ok, members} = Cluster.catalogue(g)
      assert Enum.map(members, & &1.models) == [%{}, %{}, %{}]
      assert {:ok, nil} = model_named(here)
      assert {:ok, nil} = model_named(joiner)
    end
  end

  defp model_named(member), do: ScanBridge.Server.model_named(member, "tiny")

  defp ok!({:ok, value}), do: value
end
