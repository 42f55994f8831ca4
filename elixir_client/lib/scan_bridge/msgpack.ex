defmodule ScanBridge.Msgpack do
  @moduledoc """
  The msgpack the protocol uses (SPEC §3), without dependencies.

  ## Encoding (`encode/1`, `encode_at/2`) → iodata

  | Elixir | msgpack |
  |---|---|
  | `nil`, `true`, `false` | nil, true, false |
  | integer in −2^63 … 2^64 − 1 | the smallest int format |
  | float | float 64 |
  | `:infinity`, `:neg_infinity`, `:nan` | float 64 (what `decode/1` gives for them) |
  | binary | str (the protocol's strings; they are not checked for UTF-8) |
  | `{:bin, binary}` | bin |
  | other atom | str of its name |
  | list | array |
  | map | map (atom keys, `nil`, `true` and `false` included, become str) |
  | `%ScanBridge.Tensor{}` | the tensor map `{"dtype", "shape", "data"}` with data as bin |

  Binaries are placed in the iodata as they are: a tensor's data is never copied or
  concatenated (a test checks that the very binary comes out), so encoding does not grow with
  the tensor's size.

  **Alignment** (SPEC §5). A tensor's data lands at a multiple of 8 bytes from the start of the
  encoded body, so that the server computes on aligned memory without a copy. The encoder
  knows the offset of everything it writes and pads by choosing non-minimal encodings in front
  of the payload, each worth one bit of the padding: the dtype code as str 8 (+1 byte), the
  shape as array 16 (+2), the `"data"` key as str 32 (+4). `encode_at/2` starts at a given
  offset, for bodies assembled from parts.

  ## Decoding (`decode/1`)

  Every format of the specification except ext types (the protocol has none). Both str and
  bin become binaries, which are sub-binaries of the input (no copy); maps have string keys;
  a duplicate key, bytes after the value, a truncated value, the reserved byte 0xC1 and ext
  types are errors, and so is nesting more than 512 containers deep (SPEC §3: nesting deep
  enough to exhaust a decoder is a `decode_error`). Float NaN and infinities (which Erlang floats cannot hold) decode as
  `:nan`, `:infinity` and `:neg_infinity`. `decode/2` with `utf8: true` also refuses a str
  (value or key) that is not UTF-8, as the protocol's reference decoder does for a reply, but
  for the `"data"` of a map with a `"shape"` (a tensor's data may be a str of any bytes, SPEC §5);
  and a bin where that decoder wants a str: a map key, the top-level map's `"id"`, and the
  `"dtype"` of a map with a `"shape"` and `"data"` or `"buf"` (a tensor's).
  """

  alias ScanBridge.{Error, IEEE, Tensor}

  @type encodable ::
          nil
          | boolean
          | integer
          | float
          | binary
          | {:bin, binary}
          | atom
          | [encodable]
          | %{optional(atom | binary) => encodable}
          | Tensor.t()

  @doc """
  Encode `term` as iodata. Raises `ArgumentError` for a term msgpack cannot carry.

      iex> ScanBridge.Msgpack.encode(%{"pong" => true}) |> IO.iodata_to_binary()
      <<0x81, 0xA4, "pong", 0xC3>>

      iex> ScanBridge.Msgpack.encode({:bin, <<1, 2>>}) |> IO.iodata_to_binary()
      <<0xC4, 2, 1, 2>>
  """
  @spec encode(encodable) :: iodata
  def encode(term), do: term |> encode_at(0) |> elem(0)

  @doc """
  Encode `term` as if it started `offset` bytes into the body (tensor payloads are aligned
  relative to the body's first byte). Returns the iodata and the offset after it.
  """
  @spec encode_at(encodable, non_neg_integer) :: {iodata, non_neg_integer}
  def encode_at(term, offset) when is_integer(offset) and offset >= 0, do: enc(term, offset)

  @doc """
  Decode a binary holding exactly one msgpack value.

      iex> ScanBridge.Msgpack.decode(<<0x92, 0x01, 0xA2, "hi">>)
      {:ok, [1, "hi"]}

      iex> {:error, error} = ScanBridge.Msgpack.decode(<<0x92, 0x01>>)
      iex> {error.reason, error.detail}
      {:decode_error, %{"problem" => "truncated", "at" => 2}}
  """
  @max_depth 512

  @spec decode(binary, [{:utf8, boolean}]) :: {:ok, term} | {:error, Error.t()}
  def decode(binary, opts \\ []) when is_binary(binary) do
    utf8? = Keyword.get(opts, :utf8, false)

    case value(binary, utf8?, 0) do
      {term, <<>>} -> {:ok, term}
      {_term, rest} -> {:error, failure("trailing_bytes", byte_size(binary) - byte_size(rest))}
    end
  catch
    {:msgpack, problem, rest} -> {:error, failure(problem, byte_size(binary) - byte_size(rest))}
  end

  @doc "Like `decode/1`, raising `ScanBridge.Error` (reason `:decode_error`)."
  @spec decode!(binary) :: term
  def decode!(binary) do
    case decode(binary) do
      {:ok, term} -> term
      {:error, error} -> raise error
    end
  end

  ## Encoding

  defp enc(nil, pos), do: {<<0xC0>>, pos + 1}
  defp enc(false, pos), do: {<<0xC2>>, pos + 1}
  defp enc(true, pos), do: {<<0xC3>>, pos + 1}

  defp enc(n, pos) when is_integer(n) do
    bytes = int(n)
    {bytes, pos + byte_size(bytes)}
  end

  defp enc(f, pos) when is_float(f), do: {<<0xCB, f::float-64>>, pos + 9}

  # Erlang floats hold no infinity or NaN, so these atoms stand for them (as in decoding): a
  # mamba_ssm dt_limit of (0.0, inf) is [0.0, :infinity].
  defp enc(special, pos) when special in [:infinity, :neg_infinity, :nan] do
    bits = :binary.decode_unsigned(IEEE.encode(special, :f64), :little)
    {<<0xCB, bits::64>>, pos + 9}
  end

  defp enc(s, pos) when is_binary(s) do
    head = str_header(byte_size(s))
    {[head, s], pos + byte_size(head) + byte_size(s)}
  end

  defp enc({:bin, b}, pos) when is_binary(b) do
    head = bin_header(byte_size(b))
    {[head, b], pos + byte_size(head) + byte_size(b)}
  end

  defp enc(%Tensor{} = tensor, pos), do: enc_tensor(tensor, pos)

  defp enc(%{__struct__: module}, _pos) do
    raise ArgumentError, "msgpack: expected an encodable term, got a #{inspect(module)} struct"
  end

  defp enc(a, pos) when is_atom(a), do: enc(Atom.to_string(a), pos)

  defp enc(list, pos) when is_list(list) do
    head = array_header(length(list))
    {items, pos} = Enum.map_reduce(list, pos + byte_size(head), &enc/2)
    {[head | items], pos}
  end

  defp enc(map, pos) when is_map(map) do
    head = map_header(map_size(map))

    {entries, pos} =
      Enum.map_reduce(map, pos + byte_size(head), fn {key, value}, pos ->
        {key_io, pos} = enc_key(key, pos)
        {value_io, pos} = enc(value, pos)
        {[key_io | value_io], pos}
      end)

    {[head | entries], pos}
  end

  defp enc(other, _pos) do
    raise ArgumentError, "msgpack: expected an encodable term, got #{inspect(other, limit: 5)}"
  end

  # An atom key is its name, even nil, true, false and the float atoms (which as values
  # are msgpack nil, bool and float).
  defp enc_key(key, pos) when is_binary(key), do: enc(key, pos)
  defp enc_key(key, pos) when is_atom(key), do: enc(Atom.to_string(key), pos)

  defp enc_key(key, _pos),
    do: raise(ArgumentError, "msgpack: expected a str or atom map key, got #{inspect(key)}")

  # The tensor map with its payload at a multiple of 8 from the body start (see moduledoc).
  defp enc_tensor(%Tensor{dtype: dtype, shape: shape, data: data}, pos) do
    code = Atom.to_string(dtype)
    dims = shape |> Tuple.to_list() |> Enum.map(&int/1)
    data_header = bin_header(byte_size(data))

    # fixmap 3, "dtype" key, code as fixstr, "shape" key, fixarray, dims, "data" key, bin header
    minimal =
      1 + 6 + 1 + byte_size(code) + 6 + 1 + IO.iodata_length(dims) + 5 + byte_size(data_header)

    pad = rem(8 - rem(pos + minimal, 8), 8)

    code_io =
      if Bitwise.band(pad, 1) == 0,
        do: [<<0xA0 + byte_size(code)>>, code],
        else: [<<0xD9, byte_size(code)>>, code]

    array_head =
      if Bitwise.band(pad, 2) == 0,
        do: <<0x90 + length(dims)>>,
        else: <<0xDC, length(dims)::16>>

    data_key = if Bitwise.band(pad, 4) == 0, do: <<0xA4, "data">>, else: <<0xDB, 4::32, "data">>

    iodata = [
      <<0x83, 0xA5, "dtype">>,
      code_io,
      <<0xA5, "shape">>,
      array_head,
      dims,
      data_key,
      data_header,
      data
    ]

    {iodata, pos + minimal + pad + byte_size(data)}
  end

  defp int(n) when n in 0..0x7F, do: <<n>>
  defp int(n) when n in -32..-1, do: <<n::signed-8>>
  defp int(n) when n in 0x80..0xFF, do: <<0xCC, n>>
  defp int(n) when n in 0x100..0xFFFF, do: <<0xCD, n::16>>
  defp int(n) when n in 0x10000..0xFFFFFFFF, do: <<0xCE, n::32>>
  defp int(n) when n in 0x100000000..0xFFFFFFFFFFFFFFFF, do: <<0xCF, n::64>>
  defp int(n) when n in -128..-33, do: <<0xD0, n::signed-8>>
  defp int(n) when n in -32768..-129, do: <<0xD1, n::signed-16>>
  defp int(n) when n in -0x80000000..-32769, do: <<0xD2, n::signed-32>>
  defp int(n) when n in -0x8000000000000000..-0x80000001, do: <<0xD3, n::signed-64>>

  defp int(n) do
    raise ArgumentError, "msgpack: expected an integer in -2^63..2^64-1, got #{n}"
  end

  defp str_header(n) when n <= 31, do: <<0xA0 + n>>
  defp str_header(n) when n <= 0xFF, do: <<0xD9, n>>
  defp str_header(n) when n <= 0xFFFF, do: <<0xDA, n::16>>
  defp str_header(n) when n <= 0xFFFFFFFF, do: <<0xDB, n::32>>
  defp str_header(n), do: too_long("str", n)

  defp bin_header(n) when n <= 0xFF, do: <<0xC4, n>>
  defp bin_header(n) when n <= 0xFFFF, do: <<0xC5, n::16>>
  defp bin_header(n) when n <= 0xFFFFFFFF, do: <<0xC6, n::32>>
  defp bin_header(n), do: too_long("bin", n)

  defp array_header(n) when n <= 15, do: <<0x90 + n>>
  defp array_header(n) when n <= 0xFFFF, do: <<0xDC, n::16>>
  defp array_header(n) when n <= 0xFFFFFFFF, do: <<0xDD, n::32>>
  defp array_header(n), do: too_long("array", n)

  defp map_header(n) when n <= 15, do: <<0x80 + n>>
  defp map_header(n) when n <= 0xFFFF, do: <<0xDE, n::16>>
  defp map_header(n) when n <= 0xFFFFFFFF, do: <<0xDF, n::32>>
  defp map_header(n), do: too_long("map", n)

  defp too_long(kind, n) do
    raise ArgumentError, "msgpack: expected a #{kind} of at most 2^32-1 items/bytes, got #{n}"
  end

  ## Decoding: value(binary, utf8?, depth) -> {term, rest}; failures throw
  ## {:msgpack, problem, rest_at_failure}; utf8?: a str must be UTF-8; depth: the containers
  ## around the value

  defp value(<<0xC0, r::binary>>, _u, _d), do: {nil, r}
  defp value(<<0xC2, r::binary>>, _u, _d), do: {false, r}
  defp value(<<0xC3, r::binary>>, _u, _d), do: {true, r}
  defp value(<<n, r::binary>>, _u, _d) when n <= 0x7F, do: {n, r}
  defp value(<<n, r::binary>>, _u, _d) when n >= 0xE0, do: {n - 0x100, r}
  defp value(<<0xCC, n, r::binary>>, _u, _d), do: {n, r}
  defp value(<<0xCD, n::16, r::binary>>, _u, _d), do: {n, r}
  defp value(<<0xCE, n::32, r::binary>>, _u, _d), do: {n, r}
  defp value(<<0xCF, n::64, r::binary>>, _u, _d), do: {n, r}
  defp value(<<0xD0, n::signed-8, r::binary>>, _u, _d), do: {n, r}
  defp value(<<0xD1, n::signed-16, r::binary>>, _u, _d), do: {n, r}
  defp value(<<0xD2, n::signed-32, r::binary>>, _u, _d), do: {n, r}
  defp value(<<0xD3, n::signed-64, r::binary>>, _u, _d), do: {n, r}
  defp value(<<0xCA, f::float-32, r::binary>>, _u, _d), do: {f, r}
  defp value(<<0xCA, bits::32, r::binary>>, _u, _d), do: {IEEE.special(bits, :f32), r}
  defp value(<<0xCB, f::float-64, r::binary>>, _u, _d), do: {f, r}
  defp value(<<0xCB, bits::64, r::binary>>, _u, _d), do: {IEEE.special(bits, :f64), r}
  defp value(<<n, r::binary>> = at, u, _d) when n in 0xA0..0xBF, do: str(r, n - 0xA0, at, u)
  defp value(<<0xD9, len, r::binary>> = at, u, _d), do: str(r, len, at, u)
  defp value(<<0xDA, len::16, r::binary>> = at, u, _d), do: str(r, len, at, u)
  defp value(<<0xDB, len::32, r::binary>> = at, u, _d), do: str(r, len, at, u)
  defp value(<<0xC4, len, r::binary>> = at, _u, _d), do: bytes(r, len, at)
  defp value(<<0xC5, len::16, r::binary>> = at, _u, _d), do: bytes(r, len, at)
  defp value(<<0xC6, len::32, r::binary>> = at, _u, _d), do: bytes(r, len, at)

  defp value(<<n, r::binary>>, u, d) when n in 0x90..0x9F,
    do: array(r, n - 0x90, [], u, deeper(d, r))

  defp value(<<0xDC, count::16, r::binary>>, u, d), do: array(r, count, [], u, deeper(d, r))
  defp value(<<0xDD, count::32, r::binary>>, u, d), do: array(r, count, [], u, deeper(d, r))

  defp value(<<n, r::binary>> = at, u, d) when n in 0x80..0x8F,
    do: map(r, n - 0x80, [], n - 0x80, at, %{}, u, deeper(d, at))

  defp value(<<0xDE, count::16, r::binary>> = at, u, d),
    do: map(r, count, [], count, at, %{}, u, deeper(d, at))

  defp value(<<0xDF, count::32, r::binary>> = at, u, d),
    do: map(r, count, [], count, at, %{}, u, deeper(d, at))

  defp value(<<0xC1, _::binary>> = at, _u, _d), do: throw({:msgpack, "reserved_byte_0xc1", at})

  defp value(<<n, _::binary>> = at, _u, _d) when n in 0xC7..0xC9 or n in 0xD4..0xD8,
    do: throw({:msgpack, "ext_type", at})

  # Empty input, or a header whose fixed-size part is cut off.
  defp value(at, _u, _d), do: throw({:msgpack, "truncated", at})

  defp str(r, len, at, false), do: bytes(r, len, at)

  defp str(r, len, at, true) do
    {s, _rest} = read = bytes(r, len, at)
    if String.valid?(s), do: read, else: throw({:msgpack, "invalid_utf8", at})
  end

  defp bytes(r, len, at) do
    case r do
      <<s::binary-size(len), rest::binary>> -> {s, rest}
      _ -> throw({:msgpack, "truncated", at})
    end
  end

  defp array(r, 0, acc, _u, _d), do: {Enum.reverse(acc), r}

  defp array(r, count, acc, u, d) do
    {item, r} = value(r, u, d)
    array(r, count - 1, [item | acc], u, d)
  end

  # A container `d` deep holding another: past @max_depth a reply is refused, not recursed
  # into (a hostile one nested millions deep took the VM's memory).
  defp deeper(d, _at) when d < @max_depth, do: d + 1
  defp deeper(_d, at), do: throw({:msgpack, "too_deep", at})

  # `doubts`: where a "data" str that is not UTF-8 starts (`:data`), and where a "dtype" bin
  # does (`:dtype`), decided once the map is read: the data is refused unless the map has a
  # "shape", which makes it a tensor's data (SPEC §5); the dtype only in a tensor's map.
  defp map(r, 0, acc, count, at, doubts, _u, _d) do
    map = :maps.from_list(acc)
    if map_size(map) != count, do: throw({:msgpack, "duplicate_key", at})
    shape? = is_map_key(map, "shape")

    if is_map_key(doubts, :data) and not shape?,
      do: throw({:msgpack, "invalid_utf8", doubts.data})

    if is_map_key(doubts, :dtype) and shape? and
         (is_map_key(map, "data") or is_map_key(map, "buf")),
       do: throw({:msgpack, "bin_dtype", doubts.dtype})

    {map, r}
  end

  defp map(<<n, _::binary>> = r, _left, _acc, _count, _at, _doubts, true, _d) when n in 0xC4..0xC6,
    do: throw({:msgpack, "bin_key", r})

  defp map(r, left, acc, count, at, doubts, u, d) do
    {key, r} = value(r, u, d)

    case r do
      <<n, _::binary>> when u and key == "data" and (n in 0xA0..0xBF or n in 0xD9..0xDB) ->
        {s, rest} = value(r, false, d)
        doubts = if String.valid?(s), do: doubts, else: Map.put_new(doubts, :data, r)
        map(rest, left - 1, [{key, s} | acc], count, at, doubts, u, d)

      <<n, _::binary>> when u and key == "id" and d == 1 and n in 0xC4..0xC6 ->
        throw({:msgpack, "bin_id", r})

      <<n, _::binary>> when u and key == "dtype" and n in 0xC4..0xC6 ->
        {val, rest} = value(r, u, d)
        map(rest, left - 1, [{key, val} | acc], count, at, Map.put(doubts, :dtype, r), u, d)

      _ ->
        {val, rest} = value(r, u, d)
        map(rest, left - 1, [{key, val} | acc], count, at, doubts, u, d)
    end
  end

  defp failure(problem, at) do
    Error.client(:decode_error, "msgpack: #{String.replace(problem, "_", " ")} at byte #{at}", %{
      "problem" => problem,
      "at" => at
    })
  end
end
