defmodule ScanBridge.ClusterBalancerTest do
  # This node's balancer when a member's node goes away and comes back: the member keeps its
  # pid, and what callers checked out before must not count against it afterwards.
  use ExUnit.Case, async: false

  alias ScanBridge.{Cluster, TestSupport}
  alias ScanBridge.Cluster.Balancer
  alias ScanBridge.TestSupport.Peers

  @moduletag :cluster

  # A peer node controlled over its stdio rather than the distribution, so that it lives on
  # while this node disconnects from it, with the cluster's :pg scope and one process in `g`
  # (no server: the balancer counts what it hands out, and calls nothing).
  defp start_member_node(g) do
    Peers.ensure_distributed!()
    args = ["-setcookie", Atom.to_string(Node.get_cookie())]

    {:ok, peer, node} =
      :peer.start(%{
        name: ~c"balancer_#{System.pid()}_#{System.unique_integer([:positive])}",
        host: ~c"127.0.0.1",
        longnames: true,
        connection: :standard_io,
        args: Enum.map(args, &String.to_charlist/1)
      })

    on_exit(fn -> :peer.stop(peer) end)
    true = Node.connect(node)
    {:ok, _scope} = :erpc.call(node, :pg, :start, [Cluster.scope()])
    member = :erpc.call(node, :erlang, :spawn, [:timer, :sleep, [:infinity]])
    :ok = :erpc.call(node, :pg, :join, [Cluster.scope(), Cluster.group_key(g), member])
    {node, member}
  end

  test "a check-in from before a member's node went away and came back leaves its new count" do
    g = {:balancer, System.unique_integer([:positive])}
    {node, member} = start_member_node(g)
    assert TestSupport.eventually(fn -> Cluster.members(g) == [member] end)
    {:ok, ^member, before} = Balancer.checkout(g, :call)

    # the member's node cut off, then back: the same pid, and none of the old counts
    true = Node.disconnect(node)
    assert TestSupport.eventually(fn -> Cluster.members(g) == [] end)
    true = Node.connect(node)
    assert TestSupport.eventually(fn -> Cluster.members(g) == [member] end)
    assert TestSupport.eventually(fn -> Balancer.loads(g)[member].calls == 0 end)

    {:ok, ^member, now} = Balancer.checkout(g, :call)
    Balancer.checkin(before)
    assert Balancer.loads(g) == %{member => %{calls: 1, sessions: 0}}
    Balancer.checkin(now)
    assert Balancer.loads(g) == %{member => %{calls: 0, sessions: 0}}
  end
end
