defmodule ScanBridge.ClusterPartitionTest do
  # A group of two members, one on this node and one on a `:peer` node, cut apart and joined
  # again: what the group did to a model's name meanwhile is what both members hold after.
  use ExUnit.Case, async: false

  alias ScanBridge.{Cluster, TestSupport}
  alias ScanBridge.TestSupport.{Models, Peers}

  @moduletag :cluster

  setup_all do
    Peers.ensure_distributed!()
    :ok
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
    g = {:partition, System.unique_integer([:positive])}
    peer = Peers.start_peer!("apart", cut_off: true)
    here = start_supervised!({ScanBridge, TestSupport.server_opts(group: g)})
    [there] = Peers.start_servers!([peer], group: g)
    Peers.await_members(g, 2)
    config = Models.config(:mamba2)
    assert {:ok, %{members: 2}} = Cluster.load_model(g, "tiny", Models.backbone(config, 1))
    frame = Models.frame(Models.embeds(1, 1, config["d_model"]), 0)
    {old_id, _} = frame_through(there, frame)

    Peers.cut_off(peer)
    Peers.await_members(g, 1)
    assert :ok = Cluster.free_model(g, "tiny")
    assert {:ok, %{members: 1}} = Cluster.load_model(g, "tiny", Models.backbone(config, 2))
    Peers.reconnect(peer)
    Peers.await_members(g, 2)

    # the member that was apart gives its model up and loads the group's newer one
    assert TestSupport.eventually(
             fn ->
               ScanBridge.Server.model_named(there, "tiny") not in [{:ok, nil}, {:ok, old_id}]
             end,
             20_000
           )

    {_, want} = frame_through(here, frame)
    {_, got} = frame_through(there, frame)
    Models.assert_rel_close(got, want, 1.0e-6, "the frame through the member that was apart")

    assert {:error, %ScanBridge.Error{reason: :unknown_model}} =
             ScanBridge.free_model(there, old_id)
  end
end
