defmodule ScanBridge.GoldenVectorsTest do
  # protocol/vectors (SPEC §11): exact frames and what they mean, decoded by this client.
  use ExUnit.Case, async: true

  alias ScanBridge.{Msgpack, Protocol, Tensor, TestSupport, TestSupport.JSON}

  @dir Path.join(TestSupport.repo_root(), "protocol/vectors")
  @names @dir
         |> Path.join("*.json")
         |> Path.wildcard()
         |> Enum.map(&Path.basename(&1, ".json"))
         |> Enum.sort()

  test "the vectors are there" do
    assert length(@names) >= 30, "expected the golden vectors in #{@dir}, found #{inspect(@names)}"
  end

  for name <- @names do
    @external_resource Path.join(@dir, name <> ".json")
    @external_resource Path.join(@dir, name <> ".frame")

    test "decodes #{name}" do
      {meaning, frame} = load(unquote(name))

      case meaning["kind"] do
        "invalid_frame" ->
          assert frame == <<meaning["frame_length"]::32>>

        _ ->
          <<length::32, body::binary>> = frame
          assert length == byte_size(body)
          assert Msgpack.decode(body) == {:ok, expected(meaning["message"])}
      end
    end
  end

  # Request vectors with an int id (this client's ids are ints), encoded the way this client
  # encodes requests: the decoded body must be the vector's message, payloads aligned.
  @int_id_requests for name <- @names,
                       meaning =
                         @dir |> Path.join(name <> ".json") |> File.read!() |> JSON.decode!(),
                       meaning["kind"] == "request" and is_integer(meaning["message"]["id"]),
                       do: name

  test "there are request vectors to encode" do
    assert length(@int_id_requests) >= 10
  end

  for name <- @int_id_requests do
    test "encodes the request of #{name} equivalently" do
      {%{"message" => message}, _frame} = load(unquote(name))

      args =
        message |> Map.get("args", %{}) |> expected() |> Map.new(fn {k, v} -> {k, as_tensor(v)} end)

      {head, size} = Protocol.request_head(message["op"], args)
      body = IO.iodata_to_binary([head, Protocol.id_entry(message["id"])])
      assert byte_size(body) == size
      assert Msgpack.decode(body) == {:ok, Map.put_new(expected(message), "args", %{})}

      for %Tensor{data: data} <- Map.values(args) do
        {offset, _} = :binary.match(body, data)
        assert rem(offset, 8) == 0, "payload at #{offset}"
      end
    end
  end

  test "a request with a budget carries it as deadline_us, as ping_deadline does" do
    # its id is a str, which this client never sends: the rest is compared under an int id
    {%{"message" => %{"deadline_us" => budget} = message}, _frame} = load("ping_deadline")
    {head, size} = Protocol.request_head(message["op"], message["args"])
    body = IO.iodata_to_binary(Protocol.request_body(head, 42, budget))
    assert byte_size(body) == size + Protocol.deadline_entry_size()
    assert Msgpack.decode(body) == {:ok, %{message | "id" => 42}}
  end

  test "replies read as outcomes" do
    assert {:reply, 2, {:ok, %{"y" => y, "state" => state}, %{"server_us" => _}}} =
             reply("reply_scan")

    assert {:ok, %Tensor{shape: {2, 3, 4}}} = Tensor.from_wire(y)
    assert {:ok, %Tensor{shape: {2, 4, 2}}} = Tensor.from_wire(state)
    assert {:reply, 1, {:ok, %{"pong" => true}, %{"decode_us" => 3}}} = reply("reply_ping")

    assert {:reply, 2,
            {:error,
             %ScanBridge.Error{reason: :shape_mismatch, detail: %{"field" => "args.B.shape"}}}} =
             reply("reply_error")

    assert {:reply, nil, {:error, %ScanBridge.Error{reason: :frame_too_large}}} =
             reply("reply_error_no_id")

    assert {:reply, 7,
            {:error, %ScanBridge.Error{reason: :cancelled, detail: %{"cancelled_by" => 8}}}} =
             reply("reply_error_cancelled")
  end

  defp reply(name) do
    {_meaning, <<_length::32, body::binary>>} = load(name)
    Protocol.decode_reply(body)
  end

  defp load(name) do
    meaning = @dir |> Path.join(name <> ".json") |> File.read!() |> JSON.decode!()
    {meaning, File.read!(Path.join(@dir, name <> ".frame"))}
  end

  # The JSON meaning as the decoder returns it: {"$bytes": ...} becomes the bytes themselves.
  defp expected(%{"$bytes" => %{"dtype" => dtype, "values" => values}}) do
    Tensor.from_list(values, String.to_existing_atom(dtype), {length(values)}).data
  end

  defp expected(%{} = map), do: Map.new(map, fn {k, v} -> {k, expected(v)} end)
  defp expected(list) when is_list(list), do: Enum.map(list, &expected/1)
  defp expected(value), do: value

  defp as_tensor(%{"dtype" => _, "shape" => _, "data" => _} = wire) do
    {:ok, tensor} = Tensor.from_wire(wire)
    tensor
  end

  defp as_tensor(value), do: value
end
