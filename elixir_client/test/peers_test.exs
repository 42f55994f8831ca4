defmodule ScanBridge.PeersTest do
  # The multi-node test support itself: peers on 127.0.0.1, each running its own server,
  # crashed, stopped, frozen and thawed, and nothing left running afterwards.
  use ExUnit.Case, async: false

  alias ScanBridge.TestSupport
  alias ScanBridge.TestSupport.Peers

  @moduletag :cluster

  setup_all do
    Peers.ensure_distributed!()
    :ok
  end

  test "servers on two peers answer across nodes, survive each other's crash and stop" do
    # idempotent
    assert Peers.ensure_distributed!() == :ok
    assert Node.alive?()

    [a, b] = Enum.map(["peer_a", "peer_b"], &Peers.start_peer!/1)
    assert a.node != b.node
    assert a.node in Node.list() and b.node in Node.list()
    assert Peers.os_alive?(a.os_pid) and Peers.os_alive?(b.os_pid)

    assert :erpc.call(a.node, System, :get_env, ["SCAN_BRIDGE_PYTHON"]) ==
             System.get_env("SCAN_BRIDGE_PYTHON")

    assert {:ok, _} = :erpc.call(a.node, Application, :ensure_all_started, [:scan_bridge])

    # two servers on one peer, one on the other, started at once
    [client_a, client_a2, client_b] = Peers.start_servers!([a, a, b])
    assert node(client_a) == a.node and node(client_a2) == a.node and node(client_b) == b.node
    assert ScanBridge.ping(client_a) == :ok
    assert ScanBridge.ping(client_a2) == :ok
    assert ScanBridge.ping(client_b) == :ok

    {:ok, os_a} = Peers.server_os_pid(client_a)
    {:ok, os_a2} = Peers.server_os_pid(client_a2)
    {:ok, os_b} = Peers.server_os_pid(client_b)
    assert Enum.sort(Peers.server_os_pids(a)) == Enum.sort([os_a, os_a2])
    assert Peers.server_os_pids(b) == [os_b]
    assert Enum.all?([os_a, os_a2, os_b], &Peers.os_alive?/1)

    # a server killed: its client exits, and calls to it fail; its neighbour on the same node
    # and the other node are untouched
    monitor = Process.monitor(client_a)
    Peers.kill_server!(client_a)
    refute Peers.os_alive?(os_a)
    assert_receive {:DOWN, ^monitor, :process, ^client_a, reason}, 5_000
    assert {:shutdown, {:server_exited, _}} = reason

    assert {:error, %ScanBridge.Error{reason: error_reason}} = ScanBridge.ping(client_a)
    assert error_reason in [:server_exited, :not_running]
    assert ScanBridge.ping(client_a2) == :ok
    assert ScanBridge.ping(client_b) == :ok

    # a whole node down: its server exits on its stdin's EOF; the other node still answers
    monitor = Process.monitor(client_a2)
    assert Peers.stop_peer(a) == :ok
    refute a.node in Node.list()
    assert_receive {:DOWN, ^monitor, :process, ^client_a2, :noconnection}, 5_000
    assert Peers.await_gone([os_a2], 5_000) == []
    assert {:error, %ScanBridge.Error{}} = ScanBridge.ping(client_a2)
    assert ScanBridge.ping(client_b) == :ok
    # stopping twice is harmless
    assert Peers.stop_peer(a) == :ok

    # everything the test started is gone once the last peer stops
    assert Peers.stop_peer(b) == :ok
    assert Peers.await_gone([os_a, os_a2, os_b, a.os_pid, b.os_pid], 5_000) == []
  end

  test "a frozen peer answers nothing until thawed, then answers the calls it was sent" do
    peer = Peers.start_peer!("peer_frozen")
    other = Peers.start_peer!("peer_other")
    [client, other_client] = Peers.start_servers!([peer, other])
    {:ok, os_pid} = Peers.server_os_pid(client)

    Peers.freeze_peer(peer)
    # the connection stays up, but neither the node nor its client answers
    assert peer.node in Node.list()
    assert catch_error(:erpc.call(peer.node, :erlang, :node, [], 200)) == {:erpc, :timeout}
    ping = Task.async(fn -> ScanBridge.ping(client, timeout: 10_000) end)
    assert Task.yield(ping, 300) == nil
    # the other node, and the frozen node's server (an OS process of its own), carry on
    assert ScanBridge.ping(other_client) == :ok
    assert Peers.os_alive?(os_pid)

    Peers.thaw_peer(peer)
    assert Task.await(ping, 5_000) == :ok
    assert ScanBridge.ping(client) == :ok
    assert :erpc.call(peer.node, :erlang, :node, [], 5_000) == peer.node
  end

  test "a peer left frozen at the test's end is thawed, stopped, and its server reaped" do
    # Checked after the peer's cleanup: ExUnit runs on_exit callbacks last-registered first,
    # so this one, registered before the peer starts, runs after the peer's.
    {:ok, left_behind} = Agent.start(fn -> [] end)

    ExUnit.Callbacks.on_exit(fn ->
      pids = Agent.get(left_behind, & &1)
      Agent.stop(left_behind)
      left = Enum.filter(pids, &Peers.os_alive?/1)
      unless left == [], do: raise("still running after the cleanup: #{inspect(left)}")
    end)

    peer = Peers.start_peer!("peer_left_frozen")
    client = Peers.start_server!(peer)
    {:ok, os_pid} = Peers.server_os_pid(client)
    Agent.update(left_behind, fn _ -> [peer.os_pid, os_pid] end)
    Peers.freeze_peer(peer)
    assert Peers.os_alive?(peer.os_pid)
  end

  # A client's way out (its server killed, its pipe broken) runs code a healthy client never
  # ran. Modules loaded on the spot there, under load, held the client's exit, and with it a
  # cluster's failover, up to tens of milliseconds; the application loads them when it starts.
  test "a client whose server dies exits without loading code" do
    peer = Peers.start_peer!("peer_failure_path")
    [killed, broken] = Peers.start_servers!([peer, peer])
    assert ScanBridge.ping(killed) == :ok and ScanBridge.ping(broken) == :ok
    remote = fn m, f, a -> :erpc.call(peer.node, m, f, a, 5_000) end
    port = remote.(:sys, :get_state, [broken]).port
    loaded = fn -> MapSet.new(remote.(:code, :all_loaded, []), &elem(&1, 0)) end
    before = loaded.()

    # its server killed: the port reports the exit status
    monitor = Process.monitor(killed)
    Peers.kill_server!(killed)
    assert_receive {:DOWN, ^monitor, :process, ^killed, {:shutdown, {:server_exited, 137}}}, 5_000
    # a call to the client that is gone, as a cluster session's next frame would make
    assert {:error, %ScanBridge.Error{reason: :not_running}} = remote.(ScanBridge, :ping, [killed])

    # a request written into a server that died: the port closes with the write's error and
    # reports no status. Which of the two a client sees first depends on the machine's timing,
    # so the error is queued (by hand) ahead of the exit while the client is suspended.
    monitor = Process.monitor(broken)
    {:ok, os_pid} = Peers.server_os_pid(broken)
    :ok = remote.(:sys, :suspend, [broken])
    send(broken, {:EXIT, port, :epipe})

    assert TestSupport.eventually(fn ->
             {:messages, queued} = remote.(Process, :info, [broken, :messages])
             {:EXIT, port, :epipe} in queued
           end)

    TestSupport.kill!(os_pid)
    assert Peers.await_gone([os_pid], 5_000) == []
    :ok = remote.(:sys, :resume, [broken])

    assert_receive {:DOWN, ^monitor, :process, ^broken, {:shutdown, {:server_exited, :epipe}}},
                   5_000

    assert MapSet.difference(loaded.(), before) |> Enum.sort() == []
  end
end
