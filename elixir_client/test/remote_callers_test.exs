defmodule ScanBridge.RemoteCallersTest do
  # A client on this node called from a `:peer` node: a remote caller's deadline runs from when
  # the client takes its call, so a call that waited on the way (in transit, or in the busy
  # client's mailbox) may be answered after its caller stopped waiting. What such an answer
  # made must be freed, never left on the server for nobody.
  use ExUnit.Case, async: false

  import ScanBridge.TestSupport, only: [eventually: 1, freeze: 1, thaw: 1, held_after: 3]
  alias ScanBridge.{Error, Protocol, Tensor, TestSupport}
  alias ScanBridge.TestSupport.Peers

  @moduletag :cluster
  if reason = TestSupport.skip_reason(:handles), do: @moduletag(skip: reason)

  setup_all do
    Peers.ensure_distributed!()
    peer = Peers.start_peer!("callers")
    %{peer: peer, caller: Peers.start_caller!(peer)}
  end

  # the put runs to its end (no cancel): what it made must then be freed by the client
  setup do
    TestSupport.start_without_cancel!()
  end

  test "a put taken after its remote caller's whole wait: its handle is freed", ctx do
    # it waits in the suspended client's mailbox as in transit: taken, it has its whole timeout
    # ahead here, and is sent
    :sys.suspend(ctx.client)
    assert {:error, %Error{reason: :timeout}} = remote_put(ctx, timeout: 100)
    :sys.resume(ctx.client)
    assert eventually(fn -> held_after(ctx.client, "put", "handles") == 0 end)
  end

  test "a put answered after its remote caller gave up, before the deadline here: freed", ctx do
    %{client: client, os_pid: os_pid} = ctx
    %{port: port} = :sys.get_state(client)
    # the call waits 500 ms before the client takes it: the deadline here runs that far past
    # the end of its caller's wait
    :sys.suspend(client)
    freeze(os_pid)
    # (its timeout leaves the thawed server seconds to answer before the caller gives up)
    put = Task.async(fn -> remote_put(ctx, timeout: 3_000) end)
    assert eventually(fn -> match?({:messages, [_]}, Process.info(client, :messages)) end)
    Process.sleep(500)
    :sys.resume(client)
    assert eventually(fn -> map_size(:sys.get_state(client).outstanding) == 1 end)
    # the reply is taken once the caller has given up, 450 ms before the deadline here
    :sys.suspend(client)
    thaw(os_pid)

    assert eventually(fn ->
             match?({:messages, [{^port, {:data, _}} | _]}, Process.info(client, :messages))
           end)

    assert {:error, %Error{reason: :timeout}} = Task.await(put, 10_000)
    :sys.resume(client)
    assert eventually(fn -> held_after(client, "put", "handles") == 0 end)
  end

  test "a remote caller that gets its put's reply keeps the handle", ctx do
    assert {:ok, {:handle, _id} = handle} = remote_put(ctx, timeout: 5_000)
    assert eventually(fn -> :sys.get_state(ctx.client).unconfirmed == %{} end)
    assert held_after(ctx.client, "put", "handles") == 1
    assert ScanBridge.free(ctx.client, handle) == :ok
  end

  test "a remote caller that exits before it says it took the reply: its handle is freed",
       ctx do
    # a bare call, as a caller killed between the reply and saying so makes
    {head, size} = Protocol.request_head("put", %{tensor: Tensor.cast!(tensor(), "put tensor")})
    message = {:request, "put", head, size, :infinity, nil}

    assert {:confirm, {:ok, %{"handle" => _}, _timing}} =
             :erpc.call(ctx.peer.node, GenServer, :call, [ctx.client, message], 10_000)

    assert eventually(fn -> held_after(ctx.client, "put", "handles") == 0 end)
  end

  test "a caller on the client's node that times out leaves the client nothing more to read",
       ctx do
    # the client shares its clock and finds the request overdue itself: a give-up would only add
    # to the mailbox of a client already late
    :sys.suspend(ctx.client)
    assert {:error, %Error{reason: :timeout}} = ScanBridge.ping(ctx.client, timeout: 100)
    {:messages, messages} = Process.info(ctx.client, :messages)
    :sys.resume(ctx.client)
    refute Enum.any?(messages, &match?({:"$gen_cast", {:gave_up, _caller}}, &1))
  end

  # ScanBridge.put/3 called from a process on the peer node, which lives on.
  defp remote_put(ctx, opts),
    do: Peers.call_from(ctx.caller, ScanBridge, :put, [ctx.client, tensor(), opts])

  defp tensor, do: TestSupport.random(:f32, {4, 2})
end
