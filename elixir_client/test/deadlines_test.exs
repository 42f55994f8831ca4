defmodule ScanBridge.DeadlinesTest do
  # Deadlines on the server (SPEC §4 deadline_us) and cancels of what callers gave up (SPEC §6
  # cancel), against the real server. Each test has its own server.
  use ExUnit.Case, async: false

  alias ScanBridge.{Error, Msgpack, Protocol, Tensor, TestSupport}
  import TestSupport, only: [eventually: 1, freeze: 1, thaw: 1]

  if reason = TestSupport.skip_reason(:deadlines), do: @moduletag(skip: reason)

  test "each request carries what is left of its call's deadline as deadline_us" do
    client = start_supervised!({ScanBridge, TestSupport.server_opts(max_in_flight: 1)})
    trace_sent(client)

    {elapsed_us, :ok} = :timer.tc(fn -> ScanBridge.ping(client, timeout: 5_000) end)
    assert %{"op" => "ping", "deadline_us" => budget} = sent_request()
    assert budget <= 5_000_000 and budget >= 5_000_000 - elapsed_us

    assert ScanBridge.ping(client, timeout: :infinity) == :ok
    sent = sent_request()
    assert sent["op"] == "ping" and not Map.has_key?(sent, "deadline_us")

    # one queued here for 300 ms (behind a ping the frozen server holds) is sent with less
    {:ok, os_pid} = ScanBridge.os_pid(client)
    freeze(os_pid)
    first = Task.async(fn -> ScanBridge.ping(client, timeout: :infinity) end)
    assert eventually(fn -> map_size(:sys.get_state(client).outstanding) == 1 end)
    queued = Task.async(fn -> ScanBridge.ping(client, timeout: 5_000) end)
    assert eventually(fn -> :gb_trees.size(:sys.get_state(client).queue) == 1 end)
    Process.sleep(300)
    thaw(os_pid)
    assert Task.await(first) == :ok and Task.await(queued) == :ok
    assert %{"op" => "ping"} = sent = sent_request()
    refute Map.has_key?(sent, "deadline_us")
    assert %{"op" => "ping", "deadline_us" => budget} = sent_request()
    assert budget > 0 and budget <= 5_000_000 - 300_000
  end

  test "a call with no time left when the client takes it is never sent" do
    client = start_supervised!({ScanBridge, TestSupport.server_opts()})
    trace_sent(client)
    assert {:error, %Error{reason: reason}} = ScanBridge.ping(client, timeout: 0)
    assert reason in [:overloaded, :timeout]
    # the next ping is the first request sent
    assert ScanBridge.ping(client, timeout: 5_000) == :ok
    assert %{"op" => "ping", "deadline_us" => budget} = sent_request()
    assert budget > 0
  end

  test "a call that waited in the client's mailbox is sent with what is left of its deadline" do
    client = start_supervised!({ScanBridge, TestSupport.server_opts()})
    trace_sent(client)
    :sys.suspend(client)
    waited = Task.async(fn -> ScanBridge.ping(client, timeout: 5_000) end)
    caller = waited.pid

    assert eventually(fn ->
             {:messages, messages} = Process.info(client, :messages)
             Enum.any?(messages, &match?({:"$gen_call", {^caller, _tag}, _request}, &1))
           end)

    # its deadline runs while it waits
    Process.sleep(300)
    :sys.resume(client)
    assert Task.await(waited) == :ok
    assert %{"op" => "ping", "deadline_us" => budget} = sent_request()
    assert budget > 0 and budget <= 5_000_000 - 300_000
  end

  test "a request whose budget runs out before it starts is answered :deadline_exceeded" do
    # The client's own deadline passes before the server's budget (which it sends at the
    # deadline's last moment, counted from a later instant), so its callers get :timeout
    # first; the server's answer is read here on a connection of the test's own, with the
    # client's encoder and decoder.
    port = open_server()
    {head, _size} = Protocol.request_head("ping", %{})
    Port.command(port, Protocol.request_body(head, 1, 0))
    Port.command(port, Protocol.request_body(head, 2, 60_000_000))

    assert {:reply, 1,
            {:error,
             %Error{
               reason: :deadline_exceeded,
               code: "deadline_exceeded",
               detail: %{"deadline_us" => 0, "waited_us" => waited}
             }}} = reply(port)

    assert waited > 0
    assert {:reply, 2, {:ok, %{"pong" => true}, _timing}} = reply(port)
    Port.close(port)
  end

  describe "a request given up while it waits at the server behind a long one" do
    setup do
      client = start_supervised!({ScanBridge, TestSupport.server_opts()})
      {:ok, os_pid} = ScanBridge.os_pid(client)
      {:ok, before} = ScanBridge.stats(client)
      %{client: client, os_pid: os_pid, before: before}
    end

    test "by its deadline: it is cancelled there, never run, and its answer never reaches the caller",
         ctx do
      long = hold_server(ctx)
      started = System.monotonic_time(:millisecond)

      assert {:error, %Error{reason: :timeout, message: message}} =
               ScanBridge.ping(ctx.client, timeout: 100)

      assert System.monotonic_time(:millisecond) - started < 1_000
      assert message =~ "asked to drop it"
      # the cancel went out with the caller's answer, while the server read nothing
      assert map_size(:sys.get_state(ctx.client).outstanding) == 3
      stats = let_server_go(ctx, long)
      assert cancelled_pings(stats, ctx.before) == 1
      # the late `cancelled` answer was dropped by the client
      refute_received _
    end

    test "by its caller's exit: it is cancelled there, never run", ctx do
      long = hold_server(ctx)
      client = ctx.client
      caller = spawn(fn -> ScanBridge.ping(client, timeout: :infinity) end)
      assert eventually(fn -> map_size(:sys.get_state(client).outstanding) == 2 end)
      Process.exit(caller, :kill)
      assert eventually(fn -> map_size(:sys.get_state(client).outstanding) == 3 end)
      assert :sys.get_state(client).pending |> Map.keys() |> length() == 1
      assert cancelled_pings(let_server_go(ctx, long), ctx.before) == 1
    end

    # A GenServer closing its session in terminate/2, killed at its shutdown timeout: the
    # close was cancelled and the session stayed for the connection's life (found in review).
    test "but a close or free whose caller exits is carried out, sent or still queued", ctx do
      client = ctx.client
      {:ok, s} = ScanBridge.open_session(client, batch: 1, dim: 4, state: 2)
      {:ok, queued_s} = ScanBridge.open_session(client, batch: 1, dim: 4, state: 2)
      {:ok, snap} = ScanBridge.snapshot(client, s)
      {:ok, h} = ScanBridge.put(client, Tensor.from_list([1.0], :f32, {1}))
      long = hold_server(ctx)
      # the long scan and three releases at the server: the fourth waits in the client
      :sys.replace_state(client, &%{&1 | max_in_flight: 4})

      releases = [
        fn -> ScanBridge.free(client, h, timeout: :infinity) end,
        fn -> ScanBridge.free_snapshot(client, snap, timeout: :infinity) end,
        fn -> ScanBridge.close_session(client, s, timeout: :infinity) end,
        # a deadline that passes while it waits queued: its caller's exit took it off
        fn -> ScanBridge.close_session(client, queued_s, timeout: 1_000) end
      ]

      callers =
        for {release, i} <- Enum.with_index(releases, 1) do
          caller = spawn(release)
          assert eventually(fn -> map_size(:sys.get_state(client).pending) == 1 + i end)
          caller
        end

      assert :gb_trees.size(:sys.get_state(client).queue) == 1
      Enum.each(callers, &Process.exit(&1, :kill))
      assert eventually(fn -> map_size(:sys.get_state(client).pending) == 1 end)
      Process.sleep(1_500)
      let_server_go(ctx, long)
      assert eventually(fn -> :gb_trees.is_empty(:sys.get_state(client).queue) end)
      assert eventually(fn -> :sys.get_state(client).outstanding == %{} end)
      {:ok, stats} = ScanBridge.stats(client)

      held =
        {stats["sessions"]["sessions"], stats["sessions"]["snapshot_bytes"],
         stats["handles"]["handles"]}

      assert held == {0, 0, 0}
    end
  end

  describe "on the unix lane, the connection's cap at the server small" do
    setup do
      opts =
        TestSupport.server_opts(
          transport: {:unix, TestSupport.socket_path()},
          args: ["--device", "cpu", "--max-in-flight-per-peer", "3"]
        )

      client = start_supervised!({ScanBridge, opts})
      {:ok, os_pid} = ScanBridge.os_pid(client)
      {:ok, before} = ScanBridge.stats(client)
      %{client: client, os_pid: os_pid, before: before}
    end

    # At the server's cap it stops reading the socket: a cancel sent then would wait unread
    # behind the request it drops, which the worker would take first and run. The client
    # keeps a slot free, so a third request waits in the client, where giving up drops it.
    test "a slot of the cap is left for cancels, and a request given up is never run", ctx do
      client = ctx.client
      assert :sys.get_state(client).max_in_flight == 2
      long = hold_server(ctx)
      waiting = Task.async(fn -> ScanBridge.ping(client, timeout: 60_000) end)
      assert eventually(fn -> map_size(:sys.get_state(client).outstanding) == 2 end)
      assert {:error, %Error{reason: reason}} = ScanBridge.ping(client, timeout: 100)
      assert reason in [:overloaded, :timeout]
      stats = let_server_go(ctx, long)
      assert :ok = Task.await(waiting, 60_000)
      count = fn stats, path -> get_in(stats, path) || 0 end

      ran =
        count.(stats, ["ops", "ping", "success_count"]) -
          count.(ctx.before, ["ops", "ping", "success_count"])

      assert ran == 1, "#{ran} pings ran: the one given up ran too"
    end
  end

  # A scan that keeps the server's worker busy for a while (tens of ms of kernel even on a fast
  # CPU) sent to the frozen server, whose reader then has every later request and cancel in
  # hand long before the worker is free: a request behind the scan waits to run, where a
  # cancel drops it.
  defp hold_server(%{client: client, os_pid: os_pid}) do
    filled = fn value, shape ->
      count = shape |> Tuple.to_list() |> Enum.product()
      Tensor.new(:binary.copy(<<value::float-32-little>>, count), :f32, shape)
    end

    {b, l, d, n} = {4, 2048, 256, 16}

    inputs = %{
      x: filled.(0.1, {b, l, d}),
      dt: filled.(0.1, {b, l, d}),
      A: filled.(-1.0, {d, n}),
      B: filled.(0.1, {b, l, n}),
      C: filled.(0.1, {b, l, n})
    }

    freeze(os_pid)
    long = Task.async(fn -> ScanBridge.scan(client, inputs, timeout: 60_000) end)
    assert eventually(fn -> map_size(:sys.get_state(client).outstanding) == 1 end)
    long
  end

  # Thaws the server, waits for the long scan and for every answer to reach the client; its
  # stats then.
  defp let_server_go(%{client: client, os_pid: os_pid}, long) do
    thaw(os_pid)
    assert {:ok, _} = Task.await(long, 60_000)
    assert eventually(fn -> :sys.get_state(client).outstanding == %{} end)
    {:ok, stats} = ScanBridge.stats(client)
    stats
  end

  # Pings the server dropped on a cancel since `before`, checked to be all its pings that
  # failed and to have left the ones it ran as they were.
  defp cancelled_pings(stats, before) do
    count = fn stats, path -> get_in(stats, path) || 0 end
    cancelled = count.(stats, ["errors", "cancelled"]) - count.(before, ["errors", "cancelled"])
    failed = count.(stats, ["ops", "ping", "failure_count"])
    assert failed == count.(before, ["ops", "ping", "failure_count"]) + cancelled

    assert count.(stats, ["ops", "ping", "success_count"]) ==
             count.(before, ["ops", "ping", "success_count"])

    cancelled
  end

  # Report to this test process the request bodies `client` writes to its Port (call trace of
  # the port_command BIF in the client process).
  defp trace_sent(client) do
    :erlang.trace_pattern({:erlang, :port_command, :_}, true, [:global])
    :erlang.trace(client, true, [:call])

    on_exit(fn ->
      :erlang.trace_pattern({:erlang, :port_command, :_}, false, [:global])
    end)
  end

  defp sent_request do
    receive do
      {:trace, _client, :call, {:erlang, :port_command, [_port, body | _options]}} ->
        Msgpack.decode!(IO.iodata_to_binary(body))
    after
      5_000 -> flunk("the client sent no request")
    end
  end

  # A server on a Port of this test's own, framed as the client frames it.
  defp open_server do
    opts = TestSupport.server_opts()
    env = Enum.map(opts[:env], fn {k, v} -> {to_charlist(k), to_charlist(v)} end)

    port =
      Port.open({:spawn_executable, opts[:python]}, [
        :binary,
        {:packet, 4},
        :use_stdio,
        args: ["-m", "bridge", "--stdio" | opts[:args]],
        env: env
      ])

    on_exit(fn ->
      try do
        Port.close(port)
      rescue
        ArgumentError -> :closed_already
      end
    end)

    port
  end

  defp reply(port) do
    receive do
      {^port, {:data, body}} -> Protocol.decode_reply(body)
    after
      60_000 -> flunk("the server did not answer")
    end
  end
end
