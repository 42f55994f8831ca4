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

  # The server answers a frame it dropped unread as it reads it: an older request as long may be
  # running then, so which of those it was is known only once the others have their own replies.
  test "an answer with id nil goes to the request of its length the others as long leave" do
    # no limits, no cancel: only the requests below come
    {client, socket} =
      played_server(:dropped_unread, %{"protocol" => %{"ops" => ["ping", "info"]}, "limits" => %{}},
        max_in_flight: 3
      )

    echo = fn pad ->
      Task.async(fn ->
        Server.request(client, "echo", %{pad: String.duplicate("x", pad)}, 30_000)
      end)
    end

    # three at the peer, in this order, the second and third as long; a fourth queued behind
    a = echo.(8)
    {_a_id, a_length} = received!(socket)
    b = echo.(40)
    {b_id, length} = received!(socket)
    c = echo.(40)
    {_c_id, ^length} = received!(socket)
    d = echo.(1)
    assert eventually(fn -> :gb_trees.size(:sys.get_state(client).queue) == 1 end)

    # the server had no memory for c's frame (SPEC §2), while b runs: either may be the one, so
    # neither is answered yet, and both keep their places
    dropped!(socket, length)
    assert nothing_sent?(socket)
    assert Task.yield(b, 0) == nil and Task.yield(c, 0) == nil

    # b's own reply says it was not b: b has its result, c is told, and its place goes to d
    reply!(socket, b_id, %{"ok" => true, "result" => %{"echo" => b_id}})
    assert {:ok, %{"echo" => ^b_id}, _timing} = Task.await(b, 5_000)

    assert {:error, %Error{reason: :limit_exceeded, detail: %{"length" => ^length}}} =
             Task.await(c, 5_000)

    {d_id, _length} = received!(socket)

    # one as long as no other is told at once
    dropped!(socket, a_length)

    assert {:error, %Error{reason: :limit_exceeded, detail: %{"length" => ^a_length}}} =
             Task.await(a, 5_000)

    reply!(socket, d_id, %{"ok" => true, "result" => %{"echo" => d_id}})
    assert {:ok, %{"echo" => ^d_id}, _timing} = Task.await(d, 5_000)

    state = :sys.get_state(client)
    assert state.outstanding == %{} and state.pending == %{} and state.dropped_unread == %{}
  end

  # The server's cap counts a cancel until it answers it, and leaves frames past the cap unread:
  # a cancel past it would wait behind the very request it names. With the cap 4, requests keep
  # to 3, and the place left takes one cancel at a time.
  test "cancels keep to the server's cap: the others wait, go before queued requests, or drop" do
    {client, socket} = played_server(:held_cancels, capped_info(4), [])
    assert :sys.get_state(client).max_in_flight == 3

    given_up = for _ <- 1..3, do: echo(client, 500)
    sent = for _ <- given_up, do: request!(socket)["id"]
    queued = echo(client, 30_000)
    assert eventually(fn -> :gb_trees.size(:sys.get_state(client).queue) == 1 end)

    # their deadlines pass together: one cancel goes, the place left for it
    for task <- given_up, do: assert({:error, %Error{reason: :timeout}} = Task.await(task))
    %{"op" => "cancel", "id" => first_cancel, "args" => %{"id" => first}} = request!(socket)
    assert nothing_sent?(socket), "a second cancel went past the server's cap"

    # one of the others is answered (it had started): its cancel is dropped, the last one goes
    # in the place that answer left, and the queued request still waits
    [answered, last] = sent -- [first]
    reply!(socket, answered, %{"ok" => true, "result" => %{}})
    %{"op" => "cancel", "id" => last_cancel, "args" => %{"id" => ^last}} = request!(socket)
    assert nothing_sent?(socket)

    reply!(socket, first_cancel, %{"ok" => true, "result" => %{"cancelled" => true}})
    reply!(socket, last_cancel, %{"ok" => true, "result" => %{"cancelled" => true}})
    %{"op" => "echo", "id" => queued_id} = request!(socket)

    for id <- [first, last, queued_id], do: reply!(socket, id, %{"ok" => true, "result" => %{}})
    assert {:ok, %{}, _timing} = Task.await(queued)
    assert nothing_sent?(socket)
    assert eventually(fn -> :sys.get_state(client).outstanding == %{} end)
    assert :queue.is_empty(:sys.get_state(client).held_cancels)
  end

  test "with a server cap of 1 no cancel is sent: the request's own deadline bounds it there" do
    {client, socket} = played_server(:cap_of_one, capped_info(1), [])
    given_up = echo(client, 200)
    %{"id" => given_up_id, "deadline_us" => _budget} = request!(socket)
    queued = echo(client, 30_000)

    assert {:error, %Error{reason: :timeout, message: message}} = Task.await(given_up)
    assert nothing_sent?(socket), "a cancel went past a cap of 1"
    assert message =~ "deadline_us"

    reply!(socket, given_up_id, %{"ok" => true, "result" => %{}})
    %{"op" => "echo", "id" => queued_id} = request!(socket)
    reply!(socket, queued_id, %{"ok" => true, "result" => %{}})
    assert {:ok, %{}, _timing} = Task.await(queued)
    assert nothing_sent?(socket)
  end

  # The server answers a health check as it reads it while its work keeps completing (SPEC §6),
  # as it does a cancel: it goes in the place requests leave, ahead of queued requests, and like
  # a cancel waits here while the server has its cap in flight, where it would be left unread.
  test "a health check keeps to the server's cap, and goes before queued requests" do
    {client, socket, first} = capped_health_server(:capped_health)
    slow = echo(client, 30_000)
    reply!(socket, first, %{"ok" => true, "result" => %{"ready" => true}})
    %{"op" => "echo", "id" => slow_id} = request!(socket)
    queued = echo(client, 30_000)

    # the next check comes due while the echo holds the only place
    assert eventually(fn -> :sys.get_state(client).health_pending not in [nil, first] end)
    assert nothing_sent?(socket), "a health check went past the server's cap"

    reply!(socket, slow_id, %{"ok" => true, "result" => %{}})
    %{"op" => "health", "id" => second} = request!(socket)
    assert nothing_sent?(socket)
    reply!(socket, second, %{"ok" => true, "result" => %{"ready" => true}})
    %{"op" => "echo", "id" => queued_id} = request!(socket)
    reply!(socket, queued_id, %{"ok" => true, "result" => %{}})
    assert {:ok, %{}, _timing} = Task.await(slow)
    assert {:ok, %{}, _timing} = Task.await(queued)
  end

  test "a health check held at the server's cap still times out: the client stops" do
    {client, socket} =
      played_server(
        :held_health,
        capped_info(1, ["health"]),
        [health_check: [interval: 50, timeout: 500]],
        restart: :temporary
      )

    ref = Process.monitor(client)
    %{"op" => "health", "id" => first} = request!(socket)
    slow = echo(client, 30_000)
    reply!(socket, first, %{"ok" => true, "result" => %{"ready" => true}})
    %{"op" => "echo"} = request!(socket)

    assert_receive {:DOWN, ^ref, :process, ^client, {:shutdown, {:unhealthy, why}}}, 5_000
    assert why =~ "within 500 ms" and why =~ "never sent"
    assert {:error, %Error{reason: :server_exited}} = Task.await(slow)
  end

  # A free this client sends on its own (a late reply's, here) is a request like any other: it
  # keeps to :max_in_flight, out of the place left for cancels, and goes in its turn, behind
  # the requests queued before it, never dropped. The late reply comes before its cancel's
  # answer (no room is left then) or after it (the place it leaves is the queued echo's).
  for answered_first <- [:late_reply, :cancel] do
    test "a late reply's free keeps to :max_in_flight and goes in its turn (#{answered_first} first)" do
      {client, socket} = played_server({:late_free, unquote(answered_first)}, capped_info(2), [])
      put = Task.async(fn -> Server.request(client, "put", %{}, 300) end)
      %{"op" => "put", "id" => put_id} = request!(socket)
      assert {:error, %Error{reason: :timeout}} = Task.await(put)
      %{"op" => "cancel", "id" => cancel_id, "args" => %{"id" => ^put_id}} = request!(socket)
      queued = echo(client, 30_000)
      assert eventually(fn -> :gb_trees.size(:sys.get_state(client).queue) == 1 end)

      # it had started: its handle is freed, behind the echo queued before the reply came
      replies = [{put_id, %{"handle" => "h1"}}, {cancel_id, %{"cancelled" => false}}]

      [{first_id, first}, {second_id, second}] =
        if unquote(answered_first) == :cancel, do: Enum.reverse(replies), else: replies

      reply!(socket, first_id, %{"ok" => true, "result" => first})
      assert nothing_sent?(socket), "a request went past :max_in_flight"
      reply!(socket, second_id, %{"ok" => true, "result" => second})
      %{"op" => "echo", "id" => echo_id} = request!(socket)
      assert nothing_sent?(socket)
      reply!(socket, echo_id, %{"ok" => true, "result" => %{}})
      assert {:ok, %{}, _timing} = Task.await(queued)

      %{"op" => "free", "id" => free_id, "args" => %{"handle" => "h1"}} = request!(socket)
      reply!(socket, free_id, %{"ok" => true, "result" => %{}})
      assert eventually(fn -> :sys.get_state(client).outstanding == %{} end)
    end
  end

  # A deadline's timer fires after the deadline itself, and may wait in the mailbox behind the
  # reply that makes room: a queued request whose deadline has passed is still not sent then.
  test "a queued request whose deadline passed while a reply made room is never sent" do
    {client, socket, {slow, slow_id}, queued} =
      one_queued(:expired_in_queue, 1_000, &patient_echo/2)

    # the reply comes first; the queued request's deadline timer fires behind it
    :sys.suspend(client)
    reply!(socket, slow_id, %{"ok" => true, "result" => %{}})
    assert eventually(fn -> mailbox_has?(client, &match?({:tcp, _socket, _body}, &1)) end)
    assert eventually(fn -> mailbox_has?(client, &match?({:deadline, _id}, &1)) end)
    :sys.resume(client)

    assert {:ok, %{}, _timing} = Task.await(slow)
    assert {:error, %Error{reason: :overloaded}} = Task.await(queued)
    assert nothing_sent?(socket), "the request was sent past its deadline"
    state = :sys.get_state(client)
    assert state.outstanding == %{} and state.pending == %{}
  end

  # A reply can only be for a request at the server: one naming a request still queued here (a
  # server's mistake) neither answers its caller nor takes it out of the queue half-way.
  test "a reply naming a request still queued is dropped; the request goes in its turn" do
    {client, socket, {slow, slow_id}, queued} = one_queued(:queued_named, 30_000)
    {queued_id, _request} = :gb_trees.smallest(:sys.get_state(client).queue)

    log =
      ExUnit.CaptureLog.capture_log(fn ->
        reply!(socket, queued_id, %{"ok" => true, "result" => %{"stray" => true}})
        assert nothing_sent?(socket)
      end)

    assert Task.yield(queued, 0) == nil, "the queued request's caller took the reply"
    assert log =~ "reply for id #{queued_id}, which no request had, dropped"

    reply!(socket, slow_id, %{"ok" => true, "result" => %{}})
    %{"op" => "echo", "id" => ^queued_id} = request!(socket)
    reply!(socket, queued_id, %{"ok" => true, "result" => %{"echo" => queued_id}})
    assert {:ok, %{"echo" => ^queued_id}, _timing} = Task.await(queued)
    assert {:ok, %{}, _timing} = Task.await(slow)
  end

  # With a cap of 1 the place a late reply leaves is the held health check's, as when any
  # other reply leaves it: the free that reply calls for waits behind it.
  test "with a server cap of 1 a held health check goes before a late reply's free" do
    {client, socket, first} = capped_health_server(:health_before_free)
    # a deadline the put must not reach while queued (it would leave unsent), on a loaded box too
    put = Task.async(fn -> Server.request(client, "put", %{}, 1_500) end)
    assert eventually(fn -> :gb_trees.size(:sys.get_state(client).queue) == 1 end)
    reply!(socket, first, %{"ok" => true, "result" => %{"ready" => true}})
    %{"op" => "put", "id" => put_id} = request!(socket)
    # the next check comes due while the put holds the only place
    assert eventually(fn -> :sys.get_state(client).health_pending not in [nil, first] end)
    assert {:error, %Error{reason: :timeout}} = Task.await(put)
    assert nothing_sent?(socket)

    reply!(socket, put_id, %{"ok" => true, "result" => %{"handle" => "h1"}})
    %{"op" => "health", "id" => second} = request!(socket)
    assert nothing_sent?(socket), "the free went past the server's cap"
    reply!(socket, second, %{"ok" => true, "result" => %{"ready" => true}})
    %{"op" => "free", "id" => free_id, "args" => %{"handle" => "h1"}} = request!(socket)
    reply!(socket, free_id, %{"ok" => true, "result" => %{}})
    # the free's answer gives its place back: the next health check, held or not yet due, takes it
    %{"op" => "health"} = request!(socket)
  end

  # A group's server closes the sessions of an opener that exits: those closes wait for room
  # as requests do, instead of going past the server's cap, where it would leave them unread.
  test "an opener's sessions are closed within the server's cap when it exits" do
    group = {:capped_closes, System.unique_integer()}
    {client, socket} = played_server(:capped_closes, capped_info(2), group: group)

    opener =
      Task.async(fn ->
        for _ <- 1..2,
            do: {:ok, _result, _timing} = Server.request(client, "session_open", %{}, 30_000)

        receive do: (:exit -> :ok)
      end)

    sessions =
      for session <- ["s1", "s2"] do
        %{"op" => "session_open", "id" => id} = request!(socket)
        reply!(socket, id, %{"ok" => true, "result" => %{"session" => session}})
        session
      end

    assert eventually(fn -> map_size(:sys.get_state(client).opener_of) == 2 end)
    slow = echo(client, 30_000)
    %{"op" => "echo", "id" => slow_id} = request!(socket)
    send(opener.pid, :exit)
    Task.await(opener)

    assert nothing_sent?(socket), "session_close went past the server's cap"
    assert eventually(fn -> :gb_trees.size(:sys.get_state(client).queue) == 2 end)
    reply!(socket, slow_id, %{"ok" => true, "result" => %{}})
    assert {:ok, %{}, _timing} = Task.await(slow)

    closed =
      for _ <- sessions do
        %{"op" => "session_close", "id" => id, "args" => %{"session" => session}} = request!(socket)
        assert nothing_sent?(socket)
        reply!(socket, id, %{"ok" => true, "result" => %{}})
        session
      end

    assert Enum.sort(closed) == sessions
  end

  # A client whose unix lane ends at a peer the test plays (the server serves the Port), which
  # answers the start-up ping and then `info` with `info`: {the client, the peer's socket}.
  # `child`: overrides of its child spec.
  defp played_server(id, info, opts, child \\ []) do
    path = TestSupport.socket_path()

    {:ok, listener} =
      :gen_tcp.listen(0, [:binary, packet: 4, active: false, ifaddr: {:local, path}])

    test = self()

    peer =
      Task.async(fn ->
        {:ok, socket} = :gen_tcp.accept(listener, 60_000)
        answer!(socket, %{"pong" => true})
        answer!(socket, info)
        :ok = :gen_tcp.controlling_process(socket, test)
        socket
      end)

    opts = TestSupport.server_opts([python: wrapper(path), transport: {:unix, path}] ++ opts)
    client = start_supervised!({ScanBridge, opts}, [id: id] ++ child)
    {client, Task.await(peer, 60_000)}
  end

  # A played server with a cap of 2 (requests keep to 1) holding an echo, and an echo of
  # `timeout` ms queued in the client behind it: {the client, the peer's socket, the held echo's
  # task and id, the queued echo's task}.
  defp one_queued(id, timeout, queue_echo \\ &echo/2) do
    {client, socket} = played_server(id, capped_info(2), [])
    slow = echo(client, 30_000)
    %{"op" => "echo", "id" => slow_id} = request!(socket)
    queued = queue_echo.(client, timeout)
    assert eventually(fn -> :gb_trees.size(:sys.get_state(client).queue) == 1 end)
    {client, socket, {slow, slow_id}, queued}
  end

  # A played server with a cap of 1 whose client asks for its health every 50 ms: {the client,
  # the peer's socket, the id of the first health check, which the peer has received}.
  defp capped_health_server(id) do
    {client, socket} =
      played_server(id, capped_info(1, ["health"]), health_check: [interval: 50, timeout: 30_000])

    %{"op" => "health", "id" => first} = request!(socket)
    {client, socket, first}
  end

  # The info of a server that takes deadlines and cancels (and `ops`), `cap` requests in flight
  # per connection.
  defp capped_info(cap, ops \\ []) do
    %{
      "protocol" => %{"ops" => ["ping", "info", "echo", "cancel" | ops]},
      "limits" => %{"max_in_flight_per_peer" => cap}
    }
  end

  defp echo(client, timeout),
    do: Task.async(fn -> Server.request(client, "echo", %{}, timeout) end)

  # An echo whose caller waits long past its deadline (Server.request waits only a little past
  # it), so that a test holding the client up around the deadline still sees the client's answer.
  defp patient_echo(client, timeout) do
    Task.async(fn ->
      {head, size} = ScanBridge.Protocol.request_head("echo", %{})
      deadline = {timeout, System.monotonic_time(:microsecond) + timeout * 1000}
      GenServer.call(client, {:request, "echo", head, size, deadline, nil}, 30_000)
    end)
  end

  # Whether a message in `client`'s mailbox satisfies `match?`.
  defp mailbox_has?(client, match?) do
    {:messages, messages} = Process.info(client, :messages)
    Enum.any?(messages, match?)
  end

  # Whether the peer's `socket` receives nothing for a while.
  defp nothing_sent?(socket), do: :gen_tcp.recv(socket, 0, 300) == {:error, :timeout}

  # The next request the peer's `socket` receives: {its id, its body's length}.
  defp received!(socket) do
    body = body!(socket)
    {Msgpack.decode!(body)["id"], byte_size(body)}
  end

  # The next request the peer's `socket` receives, decoded.
  defp request!(socket), do: socket |> body!() |> Msgpack.decode!()

  defp body!(socket) do
    {:ok, body} = :gen_tcp.recv(socket, 0, 5_000)
    body
  end

  # Receive the next request on `socket` and answer it with `result`.
  defp answer!(socket, result) do
    {id, _length} = received!(socket)
    reply!(socket, id, %{"ok" => true, "result" => result})
  end

  # The server's answer to a frame of `length` bytes it had no memory to hold (SPEC §2).
  defp dropped!(socket, length) do
    reply!(socket, nil, %{
      "ok" => false,
      "error" => %{
        "code" => "limit_exceeded",
        "message" => "no memory to hold a frame of #{length} bytes; it was read and dropped",
        "detail" => %{"limit" => "memory", "length" => length}
      }
    })
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
