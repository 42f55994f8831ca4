defmodule ScanBridge.ClusterBalancerTest do
  # This node's balancer when a member's node goes away and comes back: the member keeps its
  # pid, and what callers checked out before must not count against it afterwards; and a
  # balancer slower than its callers' deadlines.
  use ExUnit.Case, async: false

  alias ScanBridge.{Cluster, Error, TestSupport}
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

  # A process in `g` on this node (no server: nothing is sent to it while the balancer is held).
  defp local_member(g) do
    member = spawn(fn -> Process.sleep(:infinity) end)
    on_exit(fn -> Process.exit(member, :kill) end)
    :ok = :pg.join(Cluster.scope(), Cluster.group_key(g), member)
    member
  end

  # The balancer held (as behind a backlog) while `fun` runs, then let go: the return of `fun`
  # and the milliseconds it took.
  defp with_balancer_held(fun) do
    :ok = :sys.suspend(Balancer)

    try do
      start = System.monotonic_time(:millisecond)
      outcome = fun.()
      {System.monotonic_time(:millisecond) - start, outcome}
    after
      :sys.resume(Balancer)
    end
  end

  describe "a balancer slower than the caller's deadline" do
    test "a checkout is :timeout at the wait, and what the balancer then checks out is given back" do
      g = {:balancer, System.unique_integer([:positive])}
      member = local_member(g)

      {ms, outcome} = with_balancer_held(fn -> Balancer.checkout(g, :call, [], 50) end)
      assert outcome == :timeout and ms < 2_000
      # the checkout was made once the balancer came to it, and given back behind it
      assert Balancer.loads(g) == %{member => %{calls: 0, sessions: 0}}
      {:ok, ^member, token} = Balancer.checkout(g, :call, [], 1_000)
      assert Balancer.loads(g) == %{member => %{calls: 1, sessions: 0}}
      Balancer.checkin(token)
    end

    test "a group call fails with deadline_exceeded at its deadline, sent nowhere, the caller alive" do
      g = {:balancer, System.unique_integer([:positive])}
      member = local_member(g)
      inputs = TestSupport.scan_inputs(%{batch: 1, seq: 2, dim: 4, state: 2})

      {ms, outcome} = with_balancer_held(fn -> Cluster.scan(g, inputs, timeout: 100) end)
      assert {:error, %Error{reason: :deadline_exceeded, message: message}} = outcome
      assert message =~ "scan: the deadline passed while this node's balancer chose a member"
      # the caller's own deadline, not GenServer.call's default five seconds
      assert ms < 2_000
      assert Balancer.loads(g) == %{member => %{calls: 0, sessions: 0}}
    end

    test "a session's placement fails with deadline_exceeded, not an exit, and counts nothing" do
      g = {:balancer, System.unique_integer([:positive])}
      member = local_member(g)

      {ms, outcome} =
        with_balancer_held(fn ->
          Cluster.open_session(g, [batch: 1, dim: 4, state: 2], timeout: 100)
        end)

      assert {:error, %Error{reason: :deadline_exceeded, message: message}} = outcome
      assert message =~ "placing the session: the deadline passed"
      assert ms < 2_000
      assert Balancer.loads(g) == %{member => %{calls: 0, sessions: 0}}
    end
  end
end
