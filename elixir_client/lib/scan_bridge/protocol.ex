defmodule ScanBridge.Protocol do
  @moduledoc """
  The v1 envelope (SPEC §4): request bodies and reply bodies.

  A request body is built in two parts so that callers can encode their (possibly large)
  arguments in their own process, before the connection owner has picked the request id:

      {"v": 1, "op": <op>, "args": {...}, "id": <uint 64>}
       └──────────── head: request_head/2 ──┘ └ id_entry/1 ┘

  The id comes last and always as a uint 64 (a non-minimal encoding the specification
  allows), so the head's bytes, and the alignment of the tensor payloads inside it, do not
  depend on the id. `request_body/3` completes a head with its id and, when the request has a
  budget, its `deadline_us` (SPEC §4), likewise a uint 64 after the id: the connection owner
  adds both when it sends the request, the budget being what is left of the call's deadline
  then.
  """

  alias ScanBridge.{Error, Msgpack, Tensor}

  @version 1
  # fixmap 4, "v": 1, "op"
  @head_prefix <<0x84, 0xA1, "v", @version, 0xA2, "op">>
  # the same with a fifth entry, deadline_us (one byte either way: the payloads stay aligned)
  @head_prefix_with_deadline <<0x85, 0xA1, "v", @version, 0xA2, "op">>
  @args_key <<0xA4, "args">>
  @id_entry_size 1 + 2 + 9
  @deadline_entry_size 1 + 11 + 9
  # the most a uint 64 holds: a budget past it (centuries) is sent as it
  @max_uint64 0xFFFFFFFFFFFFFFFF
  # The keys a reply may have (protocol/decode.py _REPLY_KEYS).
  @reply_keys ["v", "id", "ok", "result", "error", "timing"]

  @doc """
  The request body without its id entry, and the body's size once the id entry is added.
  Raises `ArgumentError` when `args` cannot be encoded.
  """
  @spec request_head(String.t(), map) :: {iodata, pos_integer}
  def request_head(op, args) when is_binary(op) and is_map(args) do
    {op_io, pos} = Msgpack.encode_at(op, byte_size(@head_prefix))
    {args_io, pos} = Msgpack.encode_at(args, pos + byte_size(@args_key))
    {[@head_prefix, op_io, @args_key | args_io], pos + @id_entry_size}
  end

  @doc """
  The arguments of a request as the public API takes them (names as atoms or strings; tensors,
  `Nx.Tensor`s, `{:handle, id}`, booleans, numbers, strings, atoms such as `:bdl`, `[low, high]`
  bounds with `:infinity`/`:neg_infinity` for an open side, maps of names to tensors as
  `wire_tensors!/2` takes them, nil for absent) → the terms `request_head/2` encodes, named by
  strings. Tensor data is not copied.
  Raises `ArgumentError` naming the argument for a value that cannot be sent, or for a name
  given twice (as an atom and as a string), which would be a duplicate key on the wire; `op`
  is for messages.
  """
  @spec wire_args!(map, String.t()) :: %{String.t() => term}
  def wire_args!(inputs, op) when is_map(inputs) do
    Enum.reduce(inputs, %{}, fn {name, value}, args ->
      key = wire_name!(name, op)

      if Map.has_key?(args, key) do
        raise ArgumentError,
              "#{op} inputs: expected each argument once, got #{key} both as an atom and as a string"
      end

      what = "#{op} input #{key}"

      Map.put(
        args,
        key,
        if(key == "dt_limit", do: wire_limits!(value, what), else: wire_value!(value, what))
      )
    end)
  end

  def wire_args!(inputs, op) do
    raise ArgumentError,
          "#{op} inputs: expected a map of argument names to values, got #{inspect(inputs, limit: 5)}"
  end

  defp wire_name!(name, _op) when is_binary(name), do: name
  defp wire_name!(name, _op) when is_atom(name), do: Atom.to_string(name)

  defp wire_name!(name, op) do
    raise ArgumentError,
          "#{op} inputs: expected argument names as atoms or strings, got #{inspect(name)}"
  end

  defguardp bound?(value) when is_number(value) or value in [:infinity, :neg_infinity]

  defp wire_value!(value, _what)
       when is_nil(value) or is_boolean(value) or is_number(value) or is_binary(value),
       do: value

  defp wire_value!(value, _what) when is_atom(value), do: Atom.to_string(value)
  defp wire_value!({:handle, id}, _what) when is_binary(id), do: %{handle: id}
  defp wire_value!(%_{} = tensor, what), do: Tensor.cast!(tensor, what)
  # A map of names to tensors (SPEC §6 *tensors*: a model session's saved state).
  defp wire_value!(%{} = tensors, what), do: wire_tensors!(tensors, what)

  defp wire_value!(value, what) do
    raise ArgumentError,
          "#{what}: expected a tensor, a {:handle, id}, a map of names to tensors, a boolean, " <>
            "a number or a string, got #{inspect(value, limit: 5)}"
  end

  # dt_limit alone is a pair of bounds, a side of which may be unbounded: Erlang floats hold no
  # infinity, so the atoms stand for it and Msgpack sends them as float infinities. A list
  # anywhere else is refused as any list is, whatever its length.
  defp wire_limits!([low, high] = pair, _what) when bound?(low) and bound?(high), do: pair
  defp wire_limits!(value, what) when not is_list(value), do: wire_value!(value, what)

  defp wire_limits!(value, what) do
    raise ArgumentError,
          "#{what}: expected a [low, high] pair of numbers, :neg_infinity or :infinity, " <>
            "got #{inspect(value, limit: 5)}"
  end

  @doc """
  A map of names (atoms or strings) to tensors or `{:handle, id}` (SPEC §6 *tensors*: a model's
  weights, a model session's saved state) → the terms `request_head/2` encodes. Raises
  `ArgumentError` naming the entry (`what.name`) that cannot be sent, or a name given twice.
  """
  @spec wire_tensors!(term, String.t()) :: %{String.t() => Tensor.t() | %{handle: String.t()}}
  def wire_tensors!(%{} = tensors, what) when not is_struct(tensors) do
    wire_map!(tensors, what, fn
      {:handle, id}, _what when is_binary(id) -> %{handle: id}
      value, what -> Tensor.cast!(value, what)
    end)
  end

  def wire_tensors!(other, what) do
    raise ArgumentError,
          "#{what}: expected a map of names to tensors or {:handle, id}, got #{inspect(other, limit: 5)}"
  end

  @doc """
  A plain map (SPEC §6 *map*: a model's config) → the terms `request_head/2` encodes: keys
  atoms or strings (sent as strings), values nil, booleans, numbers, strings, atoms (sent as
  strings, but `:infinity`, `:neg_infinity` and `:nan`, sent as floats), and lists and maps
  of them. Raises `ArgumentError` naming the entry that cannot be sent.
  """
  @spec wire_config!(term, String.t()) :: %{String.t() => term}
  def wire_config!(%{} = config, what) when not is_struct(config),
    do: wire_map!(config, what, &config_value!/2)

  def wire_config!(other, what) do
    raise ArgumentError,
          "#{what}: expected a map of names to values, got #{inspect(other, limit: 5)}"
  end

  defp config_value!(value, _what)
       when is_nil(value) or is_boolean(value) or is_number(value) or is_binary(value) or
              value in [:infinity, :neg_infinity, :nan],
       do: value

  defp config_value!(value, _what) when is_atom(value), do: Atom.to_string(value)

  defp config_value!(list, what) when is_list(list) do
    if List.improper?(list) do
      raise ArgumentError, "#{what}: expected a proper list, got #{inspect(list, limit: 5)}"
    end

    list
    |> Enum.with_index()
    |> Enum.map(fn {value, i} -> config_value!(value, "#{what}[#{i}]") end)
  end

  defp config_value!(%{} = map, what) when not is_struct(map),
    do: wire_map!(map, what, &config_value!/2)

  defp config_value!(value, what) do
    raise ArgumentError,
          "#{what}: expected nil, a boolean, a number, a string, an atom, or a list or map of " <>
            "them, got #{inspect(value, limit: 5)}"
  end

  # `map`'s keys as strings (each once), its values through `value!`.
  defp wire_map!(map, what, value!) do
    Enum.reduce(map, %{}, fn {name, value}, acc ->
      key =
        cond do
          is_binary(name) ->
            name

          is_atom(name) ->
            Atom.to_string(name)

          true ->
            raise ArgumentError, "#{what}: expected names as atoms or strings, got #{inspect(name)}"
        end

      if Map.has_key?(acc, key) do
        raise ArgumentError,
              "#{what}: expected each name once, got #{key} both as an atom and as a string"
      end

      Map.put(acc, key, value!.(value, "#{what}.#{key}"))
    end)
  end

  @doc "The `\"id\": <uint 64>` entry that completes a request head."
  @spec id_entry(non_neg_integer) :: binary
  def id_entry(id) when is_integer(id) and id >= 0, do: <<0xA2, "id", 0xCF, id::64>>

  @doc """
  The request body of a `request_head/2` head: the head and its id entry, and with a budget
  (`deadline_us`, microseconds from when the server has the frame; nil: none) a
  `"deadline_us": <uint 64>` entry after it. The body is `deadline_entry_size/0` bytes longer
  with a budget than `request_head/2`'s size.
  """
  @spec request_body(iodata, non_neg_integer, non_neg_integer | nil) :: iolist
  def request_body(head, id, nil), do: [head, id_entry(id)]

  def request_body([@head_prefix | rest], id, deadline_us)
      when is_integer(deadline_us) and deadline_us >= 0 do
    [
      @head_prefix_with_deadline,
      rest,
      id_entry(id),
      <<0xAB, "deadline_us", 0xCF, min(deadline_us, @max_uint64)::64>>
    ]
  end

  def request_body(head, _id, deadline_us) when is_integer(deadline_us) and deadline_us >= 0 do
    raise ArgumentError,
          "request head: expected one request_head/2 made, got #{inspect(head, limit: 5)}"
  end

  def request_body(_head, _id, other) do
    raise ArgumentError,
          "deadline_us: expected nil or a non-negative integer of microseconds, got #{inspect(other)}"
  end

  @doc "How many bytes a budget adds to a request body (`request_body/3`)."
  @spec deadline_entry_size() :: pos_integer
  def deadline_entry_size, do: @deadline_entry_size

  @doc """
  Read a reply body, checked as the protocol's reference decoder (`protocol/decode.py`
  `decode_reply`) checks one: only the keys v, id, ok, result, error and timing; v 1; id nil,
  a uint or a non-empty str; ok a bool, with a result (ok) or error map; timing, when there,
  a map; every str UTF-8 (but a tensor's data, SPEC §5), every map key a str; and every map
  meant as a tensor (shape, and data or buf) exactly dtype, shape and data
  (`ScanBridge.Tensor.from_wire/1`). `{:reply, id, outcome}` for such a
  reply (`id` is nil when the server could not read the request's id) and for a map with a
  uint id that is otherwise not one (its outcome a `:decode_error`), `{:error, error}` for any
  other body.
  """
  @spec decode_reply(binary) ::
          {:reply, term, {:ok, map, map} | {:error, Error.t()}} | {:error, Error.t()}
  def decode_reply(body) do
    with {:ok, reply} <- Msgpack.decode(body, utf8: true) do
      case reply_problem(reply) do
        nil ->
          {:reply, reply["id"], outcome(reply)}

        problem ->
          error =
            Error.client(
              :decode_error,
              "reply: expected a v1 reply map (#{problem}), got #{inspect(reply, limit: 8)}"
            )

          # a reply whose id can be read answers that request, even when the rest is amiss
          case reply do
            %{"id" => id} when is_integer(id) and id in 0..@max_uint64 ->
              {:reply, id, {:error, error}}

            _ ->
              {:error, error}
          end
      end
    end
  end

  defp outcome(%{"ok" => true, "result" => result} = reply),
    do: {:ok, result, Map.get(reply, "timing", %{})}

  defp outcome(%{"ok" => false, "error" => error}), do: {:error, Error.from_server(error)}

  # What is wrong with a decoded reply, or nil.
  defp reply_problem(reply) when not is_map(reply), do: "not a map"

  defp reply_problem(reply) do
    body_key = if reply["ok"] == false, do: "error", else: "result"

    cond do
      unknown = find_key(reply, &(&1 not in @reply_keys)) ->
        "unknown key #{inspect(elem(unknown, 0))}"

      missing = Enum.find(["v", "id", "ok"], &(not Map.has_key?(reply, &1))) ->
        "no #{missing}"

      reply["v"] !== @version ->
        "v is not #{@version}"

      not valid_id?(reply["id"]) ->
        "id is not nil, a uint or a non-empty str"

      not is_boolean(reply["ok"]) ->
        "ok is not a bool"

      not is_map(reply[body_key]) or tensor_map?(reply[body_key]) ->
        "#{body_key} is not a map"

      not is_map(Map.get(reply, "timing", %{})) or tensor_map?(reply["timing"]) ->
        "timing is not a map"

      problem = Enum.find_value(reply, fn {key, value} -> value_problem(value, key) end) ->
        problem

      true ->
        nil
    end
  end

  defp valid_id?(id), do: id == nil or id in 0..@max_uint64 or (is_binary(id) and id != "")

  # The first thing under `value` the reference decoder refuses, as a problem: a map meant as a
  # tensor that is not a valid one, or a map with a key that is not a str (SPEC §3: every map's
  # keys are strs, inside the result too).
  defp value_problem(%{} = map, field) do
    cond do
      tensor_map?(map) ->
        case Tensor.from_wire(map) do
          {:ok, _tensor} -> nil
          {:error, message} -> "#{field}: #{message}"
        end

      key = find_key(map, &(not is_binary(&1))) ->
        "#{field}: a non-str key #{inspect(elem(key, 0))}"

      true ->
        Enum.find_value(map, fn {key, item} -> value_problem(item, "#{field}.#{key}") end)
    end
  end

  defp value_problem(list, field) when is_list(list) do
    list
    |> Enum.with_index()
    |> Enum.find_value(fn {item, i} -> value_problem(item, "#{field}[#{i}]") end)
  end

  defp value_problem(_value, _field), do: nil

  # A map meant as a tensor (SPEC §5), which result, error and timing are not.
  defp tensor_map?(value),
    do:
      is_map(value) and Map.has_key?(value, "shape") and
        (Map.has_key?(value, "data") or Map.has_key?(value, "buf"))

  # The first key of `map` that `bad?` holds for, as {key}: a nil or false key is found too,
  # where Enum.find's answer would read as none found.
  defp find_key(map, bad?), do: Enum.find_value(Map.keys(map), &if(bad?.(&1), do: {&1}))
end
