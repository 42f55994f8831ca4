defmodule ScanBridge.UnixLaneTest do
  # transport: {:unix, path}: the server spawned as a Port, every request over the socket.
  use ExUnit.Case, async: false

  alias ScanBridge.{Error, Msgpack, Server, TestSupport}

  import TestSupport,
    only: [
      scan_inputs: 2,
      assert_scan_matches: 2,
      assert_concurrent_scans: 2,
      eventually: 1,
      eventually: 2,
      os_process_gone?: 1
    ]

  if reason = TestSupport.skip_reason(:unix_lane), do: @moduletag(skip: reason)

  setup_all do
    path = TestSupport.socket_path()

    server = start_supervised!({ScanBridge, TestSupport.server_opts(transport: {:unix, path})})
    %{server: server, path: path}
  end

  test "the server serves the unix lane", %{server: server, path: path} do
    assert ScanBridge.ping(server) == :ok
    assert {:ok, info} = ScanBridge.info(server)

    assert Enum.any?(info["transports"], &String.starts_with?(&1, "unix")),
           inspect(info["transports"])

    assert File.exists?(path)
    assert :sys.get_state(server).socket != nil
  end

  test "scan over the socket matches the reference, every option", %{server: server} do
    inputs =
      scan_inputs(%{batch: 2, seq: 7, dim: 6, state: 3, groups: 3}, [:D, :z, :dt_bias, :h0])
      |> Map.merge(%{dt_softplus: true, dt_min: 0.02, dt_max: 0.4, return_state: true})

    assert {:ok, result} = ScanBridge.scan(server, inputs)
    assert_scan_matches(result, inputs)
  end

  test "a large request and reply cross the socket intact", %{server: server} do
    inputs = scan_inputs(%{batch: 2, seq: 64, dim: 512, state: 16}, [])
    assert {:ok, result} = ScanBridge.scan(server, inputs)
    assert_scan_matches(result, inputs)
  end

  test "concurrent callers over the socket", %{server: server} do
    assert_concurrent_scans(server, 20)
  end

  test "deadlines hold while the server reads nothing: sending never suspends the client" do
    opts = TestSupport.server_opts(transport: {:unix, TestSupport.socket_path()})
    {:ok, client} = ScanBridge.start_link(opts)
    # 64 MiB: many times what both sides' socket buffers (4 MiB each) take
    TestSupport.assert_deadlines_hold_while_frozen(client, 64 * 1024 * 1024)
    GenServer.stop(client)
  end

  test "a socket error during start-up fails the start at once, not at its timeout" do
    path = TestSupport.socket_path()
    # The client, sent to path, connects to this listener, which never answers its ping, like
    # a stuck server; the server itself listens on path.real (see wrapper/1).
    {:ok, listener} = :gen_tcp.listen(0, [:binary, packet: 4, ifaddr: {:local, path}])

    opts =
      TestSupport.server_opts(
        python: wrapper(path),
        transport: {:unix, path},
        name: :errs,
        startup_timeout: 20_000
      )

    starting =
      Task.async(fn ->
        Process.flag(:trap_exit, true)
        ScanBridge.start_link(opts)
      end)

    # the socket error comes while the client waits for its ping's answer; the client connects
    # once the server has started, which on a loaded machine takes longer than eventually/1's
    # default
    assert socket =
             eventually(fn -> (client = Process.whereis(:errs)) && socket_of(client) end, 20_000)

    send(Process.whereis(:errs), {:tcp_error, socket, :econnreset})

    assert {:error, %Error{reason: :startup_failed, message: message}} =
             Task.await(starting, 30_000)

    assert message =~ "unix socket error during start-up: :econnreset"
    :gen_tcp.close(listener)
  end

  test "transport :port is served over the Port even when :args open a unix socket too" do
    path = TestSupport.socket_path()

    opts =
      TestSupport.server_opts(args: ["--device", "cpu", "--unix", path], startup_timeout: 20_000)

    client = start_supervised!({ScanBridge, opts}, id: :port_beside_unix)
    assert ScanBridge.ping(client) == :ok
    assert :sys.get_state(client).socket == nil
    assert {:ok, info} = ScanBridge.info(client)
    assert "stdio" in info["transports"]
  end

  test "the client keeps within the server's per-connection in-flight cap; all are answered" do
    path = TestSupport.socket_path()

    opts =
      TestSupport.server_opts(
        transport: {:unix, path},
        args: ["--device", "cpu", "--max-in-flight-per-peer", "4"]
      )

    client = start_supervised!({ScanBridge, opts}, id: :capped)
    # one place below the cap: a cancel's (deadlines_test)
    assert :sys.get_state(client).max_in_flight == 3
    assert_concurrent_scans(client, 40)
  end

  if reason = TestSupport.skip_reason(:sessions), do: @tag(skip: reason)

  test "a session over the socket", %{server: server} do
    TestSupport.assert_session_scenario(
      server,
      %{batch: 2, dim: 5, state: 3},
      [:D, :z],
      %{dt_softplus: true},
      4,
      3
    )
  end

  test "the server killed: waiters answered, client stopped, no orphan" do
    path = TestSupport.socket_path()

    {:ok, client} = ScanBridge.start_link(TestSupport.server_opts(transport: {:unix, path}))
    Process.unlink(client)
    # unlinked, it would outlive a failed assertion: stop it then (nothing to do, :noproc, once
    # it has stopped itself, which it may be doing at that very moment)
    on_exit(fn ->
      try do
        GenServer.stop(client)
      catch
        :exit, _ -> :ok
      end
    end)

    ref = Process.monitor(client)
    {:ok, os_pid} = ScanBridge.os_pid(client)
    TestSupport.freeze(os_pid)
    tasks = for _ <- 1..4, do: Task.async(fn -> ScanBridge.ping(client) end)
    assert eventually(fn -> map_size(:sys.get_state(client).pending) == 4 end)
    TestSupport.kill!(os_pid)

    for outcome <- Task.await_many(tasks) do
      assert {:error, %Error{reason: :server_exited}} = outcome
    end

    assert_receive {:DOWN, ^ref, :process, ^client, {:shutdown, _}}, 5_000
    assert os_process_gone?(os_pid)
  end

  test "an answer with id nil goes to the oldest request of the length it names, at once" do
    path = TestSupport.socket_path()
    # the client's socket lane ends here, at a peer this test plays; the server serves the Port
    {:ok, listener} =
      :gen_tcp.listen(0, [:binary, packet: 4, active: false, ifaddr: {:local, path}])

    test = self()

    peer =
      Task.async(fn ->
        {:ok, socket} = :gen_tcp.accept(listener, 60_000)
        # start-up: a ping, then info (no limits, no cancel: only the requests below come)
        answer!(socket, %{"pong" => true})
        answer!(socket, %{"protocol" => %{"ops" => ["ping", "info"]}, "limits" => %{}})
        :ok = :gen_tcp.controlling_process(socket, test)
        socket
      end)

    opts =
      TestSupport.server_opts(python: wrapper(path), transport: {:unix, path}, max_in_flight: 3)

    client = start_supervised!({ScanBridge, opts}, id: :dropped_unread)
    socket = Task.await(peer, 60_000)

    echo = fn pad ->
      Task.async(fn ->
        Server.request(client, "echo", %{pad: String.duplicate("x", pad)}, 30_000)
      end)
    end

    # three at the peer, in this order, the second and third as long; a fourth queued behind
    a = echo.(8)
    {a_id, _length} = received!(socket)
    b = echo.(40)
    {_b_id, length} = received!(socket)
    c = echo.(40)
    {c_id, ^length} = received!(socket)
    d = echo.(1)
    assert eventually(fn -> :gb_trees.size(:sys.get_state(client).queue) == 1 end)

    # the server had no memory for b's frame (SPEC §2): its caller is told so now, not at its
    # deadline, and its place goes to d
    reply!(socket, nil, %{
      "ok" => false,
      "error" => %{
        "code" => "limit_exceeded",
        "message" => "no memory to hold a frame of #{length} bytes; it was read and dropped",
        "detail" => %{"limit" => "memory", "length" => length}
      }
    })

    assert {:ok, {:error, %Error{reason: :limit_exceeded, detail: %{"length" => ^length}}}} =
             Task.yield(b, 5_000)

    {d_id, _length} = received!(socket)

    for {task, id} <- [{a, a_id}, {c, c_id}, {d, d_id}] do
      reply!(socket, id, %{"ok" => true, "result" => %{"echo" => id}})
      assert {:ok, %{"echo" => ^id}, _timing} = Task.await(task, 5_000)
    end

    state = :sys.get_state(client)
    assert state.outstanding == %{} and state.pending == %{}
  end

  # The next request the peer's `socket` receives: {its id, its body's length}.
  defp received!(socket) do
    {:ok, body} = :gen_tcp.recv(socket, 0, 5_000)
    {Msgpack.decode!(body)["id"], byte_size(body)}
  end

  # Receive the next request on `socket` and answer it with `result`.
  defp answer!(socket, result) do
    {id, _length} = received!(socket)
    reply!(socket, id, %{"ok" => true, "result" => result})
  end

  defp reply!(socket, id, reply) do
    body = Msgpack.encode(Map.merge(%{"v" => 1, "id" => id, "timing" => %{}}, reply))
    :ok = :gen_tcp.send(socket, body)
  end

  # An interpreter that runs the server with its --unix PATH moved to PATH.real.
  defp wrapper(path) do
    script = path <> ".python"
    on_exit(fn -> File.rm(script) end)

    File.write!(script, """
    #!/bin/sh
    for arg; do
      shift
      if [ "$previous" = --unix ]; then set -- "$@" "$arg.real"; else set -- "$@" "$arg"; fi
      previous=$arg
    done
    exec #{TestSupport.python()} "$@"
    """)

    File.chmod!(script, 0o755)
    on_exit(fn -> File.rm(path <> ".real") end)
    script
  end

  # The unix-socket port the client process has opened, once it has.
  defp socket_of(client) do
    {:links, links} = Process.info(client, :links)
    Enum.find(links, &(is_port(&1) and Port.info(&1, :name) == {:name, ~c"tcp_inet"}))
  end
end
