defmodule ScanBridge.LifecycleTest do
  # Starting, supervising, losing and stopping the server's OS process. Each test has its own
  # server.
  use ExUnit.Case, async: false

  alias ScanBridge.{Error, Tensor, TestSupport}

  import TestSupport,
    only: [
      scan_inputs: 2,
      assert_scan_matches: 2,
      eventually: 1,
      eventually: 2,
      os_process_gone?: 1,
      freeze: 1,
      thaw: 1,
      held_after: 3
    ]

  test "the server killed mid-request: every waiter is answered and the supervisor restarts it" do
    name = :lifecycle_killed

    {:ok, supervisor} =
      Supervisor.start_link([{ScanBridge, TestSupport.server_opts(name: name)}],
        strategy: :one_for_one
      )

    client = Process.whereis(name)
    {:ok, os_pid} = ScanBridge.os_pid(name)

    # The server is frozen (SIGSTOP) so that all 8 requests are surely in flight when it dies;
    # all 8 (under 8 KB) fit an unenlarged 64 KiB pipe, so the Port never blocks its owner
    # (8 of the 2x16x32x4 requests this test once sent, 80 KB, fitted only the enlarged one).
    freeze(os_pid)
    inputs = scan_inputs(%{batch: 1, seq: 4, dim: 8, state: 2}, [:D])
    tasks = for _ <- 1..8, do: Task.async(fn -> ScanBridge.scan(name, inputs) end)
    assert eventually(fn -> map_size(:sys.get_state(client).pending) == 8 end)
    TestSupport.kill!(os_pid)

    for outcome <- Task.await_many(tasks, 10_000) do
      assert {:error, %Error{reason: :server_exited, detail: %{"exit_status" => status}}} = outcome
      assert status == 128 + 9
    end

    # the restarted client's server starts first: seconds on a loaded machine
    assert eventually(fn -> (pid = Process.whereis(name)) && pid != client end, 60_000)
    assert ScanBridge.ping(name) == :ok
    assert {:ok, new_os_pid} = ScanBridge.os_pid(name)
    assert new_os_pid != os_pid

    inputs = scan_inputs(%{batch: 2, seq: 3, dim: 4, state: 2}, [])
    assert {:ok, result} = ScanBridge.scan(name, inputs)
    assert_scan_matches(result, inputs)
    Supervisor.stop(supervisor)
    assert os_process_gone?(new_os_pid)
  end

  test "no orphan: the server's OS process is gone after the client process is killed" do
    {:ok, client} = ScanBridge.start_link(TestSupport.server_opts())
    Process.unlink(client)
    {:ok, os_pid} = ScanBridge.os_pid(client)
    refute os_process_gone?(os_pid)
    Process.exit(client, :kill)
    # the Port closes with its owner; the server exits on stdin EOF within a second
    assert eventually(fn -> os_process_gone?(os_pid) end)
  end

  test "a stopped client has stopped its server" do
    {:ok, client} = ScanBridge.start_link(TestSupport.server_opts())
    {:ok, os_pid} = ScanBridge.os_pid(client)
    assert GenServer.stop(client) == :ok
    assert os_process_gone?(os_pid)
    assert {:error, %Error{reason: :not_running}} = ScanBridge.ping(client)
  end

  test "a server that does not exit on stdin EOF is killed after :exit_grace" do
    {:ok, client} = ScanBridge.start_link(TestSupport.server_opts(exit_grace: 300))
    {:ok, os_pid} = ScanBridge.os_pid(client)
    # frozen, it cannot read the EOF
    freeze(os_pid)
    started = System.monotonic_time(:millisecond)

    {_, log} = ExUnit.CaptureLog.with_log(fn -> assert GenServer.stop(client) == :ok end)

    # killed after its 300 ms, not after the default 2 s
    elapsed = System.monotonic_time(:millisecond) - started
    assert elapsed >= 300 and elapsed < 2_000
    assert os_process_gone?(os_pid)
    assert log =~ "server #{os_pid} still running after its stdin closed; killing it"
  end

  test "at most max_in_flight requests are at the server; the rest wait their turn in order" do
    # start_supervised!: the client is stopped when the test ends, passed or failed, and
    # freeze/1 thaws its server then
    client = start_supervised!({ScanBridge, TestSupport.server_opts(max_in_flight: 2)})
    {:ok, os_pid} = ScanBridge.os_pid(client)
    watch_in_flight(client)
    freeze(os_pid)

    # Submitted one at a time, each accepted before the next is made, so that the submission
    # order is known: ids[k] is the id of the k-th request.
    {cases, ids} =
      Enum.map_reduce(1..12, [], fn i, ids ->
        inputs = scan_inputs(%{batch: 1 + rem(i, 2), seq: 3 + rem(i, 4), dim: 5, state: 2}, [:z])
        task = Task.async(fn -> ScanBridge.scan(client, inputs) end)
        assert eventually(fn -> map_size(:sys.get_state(client).pending) == i end)
        [id] = Map.keys(:sys.get_state(client).pending) -- ids
        {{inputs, task}, ids ++ [id]}
      end)

    # the frozen server holds the first two; the other ten wait in the client
    state = :sys.get_state(client)
    assert Enum.sort(Map.keys(state.outstanding)) == Enum.take(ids, 2)
    assert :gb_trees.keys(state.queue) == Enum.drop(ids, 2)
    thaw(os_pid)

    for {inputs, task} <- cases do
      assert {:ok, result} = Task.await(task, 30_000)
      assert_scan_matches(result, inputs)
    end

    state = :sys.get_state(client)

    assert state.pending == %{} and map_size(state.outstanding) == 0 and
             :gb_trees.is_empty(state.queue)

    # after every message the client handled: never more than two at the server, and each
    # request sent in its turn
    in_flight = in_flight_seen()

    assert Enum.all?(in_flight, &(length(&1) <= 2)),
           "more than 2 in flight: #{inspect(in_flight, charlists: :as_lists)}"

    assert sent_order(in_flight) == ids
  end

  test "a request bigger than the server accepts is refused without being sent" do
    {:ok, client} = ScanBridge.start_link(TestSupport.server_opts(max_frame_size: 4096))
    inputs = scan_inputs(%{batch: 2, seq: 64, dim: 16, state: 2}, [])

    assert {:error,
            %Error{reason: :frame_too_large, detail: %{"limit" => 4096, "length" => length}}} =
             ScanBridge.scan(client, inputs)

    assert length > 4096
    assert ScanBridge.ping(client) == :ok
    GenServer.stop(client)
  end

  test "a call the client does not take is refused, a cast dropped; it serves on" do
    {:ok, client} = ScanBridge.start_link(TestSupport.server_opts())
    {:ok, os_pid} = ScanBridge.os_pid(client)

    log =
      ExUnit.CaptureLog.capture_log(fn ->
        assert {:error, %Error{reason: :invalid_argument, message: message}} =
                 GenServer.call(client, {:no_such_call, 1})

        assert message =~ "takes no call {:no_such_call, 1}"
        GenServer.cast(client, {:no_such_cast, 1})
        assert :ok = ScanBridge.ping(client)
      end)

    assert log =~ "takes no cast {:no_such_cast, 1}"
    # the same OS server: nothing was restarted
    assert {:ok, ^os_pid} = ScanBridge.os_pid(client)
    GenServer.stop(client)
  end

  test "health: a serving server is live and ready" do
    {:ok, client} = ScanBridge.start_link(TestSupport.server_opts())

    assert {:ok, %{"live" => true, "ready" => true, "device" => "cpu", "checks" => checks}} =
             ScanBridge.health(client)

    assert %{"kernel" => %{"ok" => true}, "accepting" => true} = checks
    GenServer.stop(client)
  end

  test "health_check: a server that stops answering is killed, for its supervisor to restart" do
    name = :lifecycle_unhealthy
    # found in review: the client waited out the frozen server's :exit_grace before killing it
    opts =
      TestSupport.server_opts(
        name: name,
        health_check: [interval: 100, timeout: 1_500],
        exit_grace: 30_000
      )

    {:ok, supervisor} = Supervisor.start_link([{ScanBridge, opts}], strategy: :one_for_one)
    client = Process.whereis(name)
    {:ok, os_pid} = ScanBridge.os_pid(name)
    ref = Process.monitor(client)
    # answered checks keep it up
    Process.sleep(600)
    assert Process.alive?(client)
    freeze(os_pid)
    # the check's 1.5 s, then the kill: no :exit_grace for a server given up on
    assert_receive {:DOWN, ^ref, :process, ^client, {:shutdown, {:unhealthy, why}}}, 8_000
    assert why =~ "did not answer its health check within 1500 ms"
    # gone with its client; a fresh one serves
    assert os_process_gone?(os_pid)
    assert eventually(fn -> (pid = Process.whereis(name)) && pid != client end, 60_000)
    assert ScanBridge.ping(name, timeout: 60_000) == :ok
    Supervisor.stop(supervisor)
  end

  test "health_check options are checked" do
    for bad <- [[interval: 0, timeout: 10], [interval: 10], 5, [interval: 10, timeout: 10, x: 1]] do
      assert_raise ArgumentError,
                   ~r/:health_check: expected nil or \[interval: ms, timeout: ms\]/,
                   fn ->
                     ScanBridge.start_link(TestSupport.server_opts(health_check: bad))
                   end
    end
  end

  describe "behind a frozen server, one ping outstanding (max_in_flight: 1)" do
    # The server's OS process is stopped once the first ping is sent, so every later request
    # waits in the client's queue; thaw_and_count_pings/1 lets the server go on.
    setup do
      {:ok, client} = ScanBridge.start_link(TestSupport.server_opts(max_in_flight: 1))
      {:ok, os_pid} = ScanBridge.os_pid(client)
      {:ok, stats} = ScanBridge.stats(client)
      freeze(os_pid)
      first = Task.async(fn -> ScanBridge.ping(client) end)
      assert eventually(fn -> map_size(:sys.get_state(client).outstanding) == 1 end)
      %{client: client, os_pid: os_pid, first: first, pings_before: ping_count(stats)}
    end

    test "a queued request whose deadline passes is answered :overloaded and never sent", ctx do
      assert {:error, %Error{reason: :overloaded, detail: %{"max_in_flight" => 1}}} =
               ScanBridge.ping(ctx.client, timeout: 20)

      # one ping reached the server: the timed-out one never did
      assert thaw_and_count_pings(ctx) == 1
    end

    test "queued requests are dropped, data and all, when their deadlines pass", ctx do
      inputs = scan_inputs(%{batch: 2, seq: 16, dim: 8, state: 2}, [])

      queued =
        for _ <- 1..5, do: Task.async(fn -> ScanBridge.scan(ctx.client, inputs, timeout: 50) end)

      for outcome <- Task.await_many(queued) do
        assert {:error, %Error{reason: :overloaded}} = outcome
      end

      # with no reply to take them out, the timed-out requests are gone all the same
      state = :sys.get_state(ctx.client)
      assert :gb_trees.is_empty(state.queue)
      assert map_size(state.pending) == 1
      assert thaw_and_count_pings(ctx) == 1
    end

    test "a queued request whose caller exits is dropped, never sent", ctx do
      client = ctx.client
      caller = spawn(fn -> ScanBridge.ping(client, timeout: :infinity) end)
      assert eventually(fn -> map_size(:sys.get_state(client).pending) == 2 end)
      Process.exit(caller, :kill)
      assert eventually(fn -> :gb_trees.is_empty(:sys.get_state(client).queue) end)
      state = :sys.get_state(client)
      assert map_size(state.pending) == 1 and map_size(state.callers) == 1
      # only the first ping reached the server
      assert thaw_and_count_pings(ctx) == 1
    end

    test "an error reply without an id answers the only request in flight", ctx do
      reply = %{
        "v" => 1,
        "id" => nil,
        "ok" => false,
        "error" => %{"code" => "invalid_request", "message" => "no id"}
      }

      ExUnit.CaptureLog.capture_log(fn -> inject_reply(ctx.client, reply) end)

      assert {:error, %Error{reason: :invalid_request, message: "no id"}} = Task.await(ctx.first)

      # its in-flight place is free again: the server's own late reply finds no request
      assert :sys.get_state(ctx.client).outstanding == %{}

      # (the server answers in order: its late reply comes before the ping's)
      log =
        ExUnit.CaptureLog.capture_log(fn ->
          thaw(ctx.os_pid)
          assert ScanBridge.ping(ctx.client) == :ok
        end)

      assert log =~ "which no request had, dropped"
      GenServer.stop(ctx.client)
    end

    test "a reply that is not a v1 reply answers the request its id names", ctx do
      [id] = Map.keys(:sys.get_state(ctx.client).outstanding)

      ExUnit.CaptureLog.capture_log(fn ->
        inject_reply(ctx.client, %{"id" => id, "result" => "?"})
      end)

      assert {:error, %Error{reason: :decode_error, message: message}} = Task.await(ctx.first)
      assert message =~ "expected a v1 reply map"
      thaw(ctx.os_pid)
      assert ScanBridge.ping(ctx.client) == :ok
      GenServer.stop(ctx.client)
    end
  end

  test "an error reply without an id or a length, two in flight: it goes to the one left" do
    {:ok, client} = ScanBridge.start_link(TestSupport.server_opts())
    {:ok, os_pid} = ScanBridge.os_pid(client)
    freeze(os_pid)
    first = Task.async(fn -> ScanBridge.ping(client, timeout: :infinity) end)
    assert eventually(fn -> map_size(:sys.get_state(client).outstanding) == 1 end)
    second = Task.async(fn -> ScanBridge.ping(client, timeout: :infinity) end)
    assert eventually(fn -> map_size(:sys.get_state(client).outstanding) == 2 end)
    [first_id, _second_id] = :sys.get_state(client).outstanding |> Map.keys() |> Enum.sort()

    # as a server answers a frame whose id it cannot read (here the second's), which then has
    # no reply of its own, and answers the first by its id
    ExUnit.CaptureLog.capture_log(fn ->
      inject_reply(client, %{
        "v" => 1,
        "id" => nil,
        "ok" => false,
        "error" => %{"code" => "internal_error", "message" => "no id"}
      })

      inject_reply(client, %{
        "v" => 1,
        "id" => first_id,
        "ok" => true,
        "result" => %{"pong" => true}
      })
    end)

    assert Task.await(first) == :ok
    assert {:ok, {:error, %Error{reason: :internal_error}}} = Task.yield(second, 2_000)
    # its in-flight place is free again
    assert :sys.get_state(client).outstanding == %{}

    # the frozen server's own replies to both, when it goes on, find no request
    ExUnit.CaptureLog.capture_log(fn ->
      thaw(os_pid)
      assert ScanBridge.ping(client) == :ok
    end)

    GenServer.stop(client)
  end

  # Report to this test process the ids `client` has at the server (its `outstanding`) after
  # each message it handles, from the events of its sys debug hook, which carry its new state.
  defp watch_in_flight(client) do
    test = self()

    hook = fn nil, event, _name ->
      case event do
        {:noreply, state} -> send(test, {:in_flight, Map.keys(state.outstanding)})
        {:out, _reply, _to, state} -> send(test, {:in_flight, Map.keys(state.outstanding)})
        _ -> :ok
      end

      nil
    end

    :ok = :sys.install(client, {hook, nil})
  end

  # The reports so far (a sys call on the client returns only after the events of every message
  # it handled before are sent, and messages from one process arrive in order).
  defp in_flight_seen(acc \\ []) do
    receive do
      {:in_flight, ids} -> in_flight_seen([ids | acc])
    after
      0 -> Enum.reverse(acc)
    end
  end

  # The ids in the order they first went to the server: one at a time, for their order to be
  # seen (one reply frees one place).
  defp sent_order(in_flight) do
    Enum.reduce(in_flight, [], fn ids, sent ->
      new = ids -- sent
      assert length(new) <= 1, "#{inspect(new)} sent on one message"
      sent ++ new
    end)
  end

  # Hand the client a reply body as if its server had sent it.
  defp inject_reply(client, reply) do
    %{port: port} = :sys.get_state(client)
    send(client, {port, {:data, ScanBridge.Msgpack.encode(reply) |> IO.iodata_to_binary()}})
  end

  test "a request over the server's --max-frame-size is refused at once, and the client goes on" do
    opts = TestSupport.server_opts(args: ["--device", "cpu", "--max-frame-size", "1048576"])
    {:ok, client} = ScanBridge.start_link(opts)

    zeros = fn shape ->
      count = shape |> Tuple.to_list() |> Enum.product()
      Tensor.new(:binary.copy(<<0::32>>, count), :f32, shape)
    end

    # x and dt are 1 MiB each: the request is over 2 MiB
    inputs = %{
      x: zeros.({1, 1024, 256}),
      dt: zeros.({1, 1024, 256}),
      A: zeros.({256, 1}),
      B: zeros.({1, 1024, 1}),
      C: zeros.({1, 1024, 1})
    }

    started = System.monotonic_time(:millisecond)

    assert {:error,
            %Error{reason: :frame_too_large, detail: %{"limit" => 1_048_576, "length" => length}}} =
             ScanBridge.scan(client, inputs, timeout: 5_000)

    assert System.monotonic_time(:millisecond) - started < 1_000
    assert length > 2 * 1024 * 1024
    assert ScanBridge.ping(client) == :ok
    state = :sys.get_state(client)
    assert state.pending == %{} and map_size(state.outstanding) == 0
    GenServer.stop(client)
  end

  test "a :max_frame_size past what a 4-byte length says is held to 2^32 - 1 bytes" do
    eight_gib = 8 * 1024 * 1024 * 1024

    opts =
      TestSupport.server_opts(
        args: ["--device", "cpu", "--max-frame-size", "#{eight_gib}"],
        max_frame_size: eight_gib
      )

    {:ok, client} = ScanBridge.start_link(opts)
    assert :sys.get_state(client).max_frame_size == 0xFFFFFFFF

    # a request that says it is one byte over (standing in for a body of over 4 GiB) is
    # refused, not sent, and the client goes on
    {head, _size} = ScanBridge.Protocol.request_head("ping", %{})
    deadline = {5_000, System.monotonic_time(:microsecond) + 5_000_000}
    request = {:request, "ping", head, 0x1_0000_0000, deadline, nil}

    assert {:error, %Error{reason: :frame_too_large, detail: %{"limit" => 0xFFFFFFFF}}} =
             GenServer.call(client, request)

    assert :sys.get_state(client).outstanding == %{}
    assert ScanBridge.ping(client) == :ok
    GenServer.stop(client)
  end

  test "deadlines hold while the server reads nothing: sending never suspends the client" do
    {:ok, client} = ScanBridge.start_link(TestSupport.server_opts())
    # 16 MiB: many times what the pipe and the port's queue take before the port is busy
    TestSupport.assert_deadlines_hold_while_frozen(client, 16 * 1024 * 1024)
    GenServer.stop(client)
  end

  describe "a call given up leaves nothing on the server" do
    # What a late reply made is freed: these requests are left to run, as by a server without
    # cancel or when the cancel comes after the request started (test/deadlines_test.exs has
    # the client's cancels).
    setup do
      TestSupport.start_without_cancel!()
    end

    if reason = TestSupport.skip_reason(:handles), do: @tag(skip: reason)

    test "a late put's handle is freed", %{client: client, os_pid: os_pid} do
      # frozen, the server answers the put only after its deadline
      freeze(os_pid)
      tensor = TestSupport.random(:f32, {4, 2})
      assert {:error, %Error{reason: :timeout}} = ScanBridge.put(client, tensor, timeout: 50)
      thaw(os_pid)
      # once the put is done, only the client's free can take its handle away
      assert eventually(fn -> held_after(client, "put", "handles") == 0 end)
    end

    if reason = TestSupport.skip_reason(:sessions), do: @tag(skip: reason)

    test "a late open_session's session is closed", %{client: client, os_pid: os_pid} do
      freeze(os_pid)

      assert {:error, %Error{reason: :timeout}} =
               ScanBridge.open_session(client, [batch: 1, dim: 2, state: 2], timeout: 50)

      thaw(os_pid)
      assert eventually(fn -> held_after(client, "session_open", "sessions") == 0 end)
    end

    if reason = TestSupport.skip_reason(:handles), do: @tag(skip: reason)

    test "a put that waits in the busy client's mailbox past its deadline is never sent", ctx do
      # suspended, the client takes the put only after its caller has stopped waiting
      :sys.suspend(ctx.client)
      tensor = TestSupport.random(:f32, {4, 2})
      assert {:error, %Error{reason: :timeout}} = ScanBridge.put(ctx.client, tensor, timeout: 50)
      :sys.resume(ctx.client)
      # a put sent all the same would be outstanding until the server has done it
      assert eventually(fn -> :sys.get_state(ctx.client).outstanding == %{} end)
      {:ok, stats} = ScanBridge.stats(ctx.client)
      assert get_in(stats, ["ops", "put", "success_count"]) in [nil, 0]
      assert get_in(stats, ["handles", "handles"]) == 0
    end

    if reason = TestSupport.skip_reason(:handles), do: @tag(skip: reason)

    test "a put's reply taken after its caller stopped waiting: its handle is freed", ctx do
      %{client: client, os_pid: os_pid} = ctx
      %{port: port} = :sys.get_state(client)
      freeze(os_pid)
      tensor = TestSupport.random(:f32, {4, 2})
      put = Task.async(fn -> ScanBridge.put(client, tensor, timeout: 2_000) end)
      assert eventually(fn -> map_size(:sys.get_state(client).outstanding) == 1 end)
      # the reply comes well before the deadline, but waits in the suspended client's mailbox
      # until the caller has given up
      :sys.suspend(client)
      thaw(os_pid)
      assert eventually(fn -> match?({:messages, [_ | _]}, Process.info(client, :messages)) end)

      assert {:messages, [{^port, {:data, _reply}} | _]} = Process.info(client, :messages),
             "the deadline came before the put's reply"

      assert {:error, %Error{reason: :timeout}} = Task.await(put, 10_000)
      :sys.resume(client)
      assert eventually(fn -> held_after(client, "put", "handles") == 0 end)
    end

    if reason = TestSupport.skip_reason(:handles), do: @tag(skip: reason)

    test "a put whose caller exits while it is at the server: its handle is freed", ctx do
      tensor = TestSupport.random(:f32, {4, 2})
      exit_in_flight(ctx, fn -> ScanBridge.put(ctx.client, tensor, timeout: :infinity) end)
      assert eventually(fn -> held_after(ctx.client, "put", "handles") == 0 end)
    end

    if reason = TestSupport.skip_reason(:handles), do: @tag(skip: reason)

    # Found in review: the caller's :DOWN, behind the reply, was flushed when the reply was
    # taken, and the reply went to the dead caller: the handle stayed on the server.
    test "a put whose caller exits once its reply waits in the busy client: its handle is freed",
         ctx do
      %{client: client, os_pid: os_pid} = ctx
      %{port: port} = :sys.get_state(client)
      freeze(os_pid)
      tensor = TestSupport.random(:f32, {4, 2})
      caller = spawn(fn -> ScanBridge.put(client, tensor, timeout: :infinity) end)
      assert eventually(fn -> map_size(:sys.get_state(client).outstanding) == 1 end)
      :sys.suspend(client)
      thaw(os_pid)
      assert eventually(fn -> match?({:messages, [_ | _]}, Process.info(client, :messages)) end)
      assert {:messages, [{^port, {:data, _reply}}]} = Process.info(client, :messages)
      Process.exit(caller, :kill)

      assert eventually(fn ->
               {:messages, messages} = Process.info(client, :messages)
               Enum.any?(messages, &match?({:DOWN, _, :process, ^caller, :killed}, &1))
             end)

      :sys.resume(client)
      assert eventually(fn -> held_after(client, "put", "handles") == 0 end)
    end

    if reason = TestSupport.skip_reason(:sessions), do: @tag(skip: reason)

    test "an open_session whose caller exits while it is at the server: it is closed", ctx do
      exit_in_flight(ctx, fn ->
        ScanBridge.open_session(ctx.client, [batch: 1, dim: 2, state: 2], timeout: :infinity)
      end)

      assert eventually(fn -> held_after(ctx.client, "session_open", "sessions") == 0 end)
    end
  end

  # `call` runs in a process of its own, killed once its request is at the frozen server
  # (so that no deadline, only the caller's exit, can give it up); the server then goes on.
  defp exit_in_flight(%{client: client, os_pid: os_pid}, call) do
    freeze(os_pid)
    caller = spawn(call)
    assert eventually(fn -> map_size(:sys.get_state(client).outstanding) == 1 end)
    Process.exit(caller, :kill)
    # forgotten by the client before the reply comes, the request still outstanding
    assert eventually(fn -> :sys.get_state(client).pending == %{} end)
    assert map_size(:sys.get_state(client).outstanding) == 1
    thaw(os_pid)
  end

  describe "start-up failures are errors, not crashes" do
    setup do
      Process.flag(:trap_exit, true)
      :ok
    end

    test "no such interpreter" do
      assert {:error, %Error{reason: :startup_failed, message: message}} =
               ScanBridge.start_link(TestSupport.server_opts(python: "/nonexistent/python"))

      assert message =~ "/nonexistent/python"
    end

    # Found in review: the Port spawns a path only, so "python3" itself failed with :enoent.
    test "an interpreter named by its command is looked up on PATH" do
      dir = Path.join(System.tmp_dir!(), "scan_bridge_path_#{System.unique_integer([:positive])}")
      File.mkdir_p!(dir)
      # a script, not a link: a venv's interpreter finds its packages from where it lies
      command = Path.join(dir, "scan-bridge-python")
      File.write!(command, "#!/bin/sh\nexec #{TestSupport.server_opts()[:python]} \"$@\"\n")
      File.chmod!(command, 0o755)
      path = System.get_env("PATH")
      System.put_env("PATH", dir <> ":" <> path)

      try do
        assert {:ok, client} =
                 ScanBridge.start_link(TestSupport.server_opts(python: "scan-bridge-python"))

        assert :ok = ScanBridge.ping(client)
        GenServer.stop(client)
      after
        System.put_env("PATH", path)
        File.rm_rf!(dir)
      end
    end

    test "the server exits during start-up" do
      assert {:error, %Error{reason: :startup_failed, detail: %{"exit_status" => 2}}} =
               ScanBridge.start_link(TestSupport.server_opts(args: ["--no-such-option"]))
    end

    # found in review: start-up read info's ops with get_in/2 and `in`, which raise on a
    # "protocol" that is not a map or "ops" that is not a list: init crashed with an exception
    test "an info whose protocol or ops are malformed is read as an older server's" do
      dir = Path.join(System.tmp_dir!(), "scan_bridge_info_#{System.unique_integer([:positive])}")
      File.mkdir_p!(Path.join(dir, "bridge"))
      File.write!(Path.join(dir, "bridge/__init__.py"), "")

      # a server that answers ping, and info with whatever SCAN_BRIDGE_TEST_INFO holds (JSON)
      File.write!(Path.join(dir, "bridge/__main__.py"), """
      import json, os, struct, sys
      import msgspec
      info = json.loads(os.environ["SCAN_BRIDGE_TEST_INFO"])
      while len(head := sys.stdin.buffer.read(4)) == 4:
          request = msgspec.msgpack.decode(sys.stdin.buffer.read(struct.unpack(">I", head)[0]))
          result = {"pong": True} if request["op"] == "ping" else info
          body = msgspec.msgpack.encode({"v": 1, "id": request["id"], "ok": True, "result": result})
          sys.stdout.buffer.write(struct.pack(">I", len(body)) + body)
          sys.stdout.buffer.flush()
      """)

      try do
        for info <- [
              ~s({"protocol": "v1"}),
              ~s({"protocol": [1]}),
              ~s({"protocol": {"ops": "cancel"}})
            ] do
          opts = [env: [{"PYTHONPATH", dir}, {"SCAN_BRIDGE_TEST_INFO", info}]]
          assert {:ok, client} = ScanBridge.start_link(TestSupport.server_opts(opts)), info
          assert ScanBridge.ping(client) == :ok
          refute :sys.get_state(client).deadlines
          GenServer.stop(client)
        end
      after
        File.rm_rf!(dir)
      end
    end

    # found in review: a start-up info answered with an error was told as the decoded tuple
    test "a start-up info answered with an error names the server's code and message" do
      dir = Path.join(System.tmp_dir!(), "scan_bridge_info_#{System.unique_integer([:positive])}")
      File.mkdir_p!(Path.join(dir, "bridge"))
      File.write!(Path.join(dir, "bridge/__init__.py"), "")

      File.write!(Path.join(dir, "bridge/__main__.py"), """
      import struct, sys
      import msgspec
      refusal = {"code": "internal_error", "message": "info: cannot build the kernels", "detail": {"why": "ro"}}
      while len(head := sys.stdin.buffer.read(4)) == 4:
          request = msgspec.msgpack.decode(sys.stdin.buffer.read(struct.unpack(">I", head)[0]))
          outcome = {"ok": True, "result": {"pong": True}} if request["op"] == "ping" else {"ok": False, "error": refusal}
          body = msgspec.msgpack.encode({"v": 1, "id": request["id"], **outcome})
          sys.stdout.buffer.write(struct.pack(">I", len(body)) + body)
          sys.stdout.buffer.flush()
      """)

      try do
        opts = [env: [{"PYTHONPATH", dir}]]

        assert {:error, %Error{reason: :startup_failed, message: message, detail: detail}} =
                 ScanBridge.start_link(TestSupport.server_opts(opts))

        assert message ==
                 "the server answered the start-up info with internal_error: info: cannot build the kernels"

        assert detail == %{"code" => "internal_error", "detail" => %{"why" => "ro"}}
      after
        File.rm_rf!(dir)
      end
    end

    test "bad options name what was expected" do
      assert_raise ArgumentError,
                   ~r/:transport: expected :port or \{:unix, path\}, got :pipe/,
                   fn ->
                     ScanBridge.start_link(TestSupport.server_opts(transport: :pipe))
                   end

      assert_raise ArgumentError, ~r/unknown keys \[:colour\]/, fn ->
        ScanBridge.start_link(colour: :blue)
      end

      # found in review: options as a map raised FunctionClauseError from Keyword
      assert_raise ArgumentError, ~r/^start_link options: expected a keyword list, got %\{/, fn ->
        ScanBridge.start_link(%{python: TestSupport.python()})
      end

      assert_raise ArgumentError, ~r/^child_spec options: expected a keyword list, got %\{/, fn ->
        ScanBridge.child_spec(%{name: :some_scan})
      end

      # found in review: each raised FunctionClauseError from Enum
      for {key, value} <- [args: ["--device" | "cpu"], env: [{"A", "b"} | :x], group: [:a | :b]] do
        assert_raise ArgumentError, ~r/^:#{key}: expected/, fn ->
          ScanBridge.start_link(TestSupport.server_opts([{key, value}]))
        end
      end
    end
  end

  test "child_spec is a permanent worker named by :name" do
    spec = ScanBridge.child_spec(name: :some_scan)

    assert %{
             id: :some_scan,
             restart: :permanent,
             type: :worker,
             start: {ScanBridge, :start_link, [[name: :some_scan]]}
           } = spec

    assert ScanBridge.child_spec([]).id == ScanBridge
  end

  test "child_spec gives the client time to kill its server after :exit_grace" do
    # the grace, the wait for the killed server, and room to close the port
    assert ScanBridge.child_spec([]).shutdown == 5_000
    assert ScanBridge.child_spec(exit_grace: 10_000).shutdown == 13_000

    # checked here too: a supervisor reads the spec before start_link checks the options
    assert_raise ArgumentError, ~r/:exit_grace: expected a non-negative integer, got 1.5$/, fn ->
      ScanBridge.child_spec(exit_grace: 1.5)
    end
  end

  # Lets the frozen server of the "behind a frozen server" tests go on: the first ping is
  # answered, and the pings the server served since the setup are counted; the client stops.
  defp thaw_and_count_pings(%{client: client, os_pid: os_pid, first: first, pings_before: before}) do
    thaw(os_pid)
    assert Task.await(first) == :ok
    {:ok, stats} = ScanBridge.stats(client)
    GenServer.stop(client)
    ping_count(stats) - before
  end

  defp ping_count(stats),
    do:
      get_in(stats, ["ops", "ping", "success_count"]) || raise("no ping count in #{inspect(stats)}")
end
