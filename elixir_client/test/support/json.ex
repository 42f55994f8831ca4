defmodule ScanBridge.TestSupport.JSON do
  @moduledoc false
  # JSON for the golden vectors' .json files and the benchmark's results file (hex is
  # unreachable, so no Jason; Elixir 1.14 and OTP 25 have no JSON module).

  @doc "Decode a JSON text: objects → maps with string keys, null → nil."
  def decode!(text) when is_binary(text) do
    case value(skip_ws(text)) do
      {value, rest} ->
        if skip_ws(rest) != "",
          do:
            raise(
              ArgumentError,
              "JSON: trailing text #{inspect(binary_part(rest, 0, min(20, byte_size(rest))))}"
            )

        value
    end
  end

  @doc "Encode maps (atom or string keys), lists, strings, numbers, booleans and nil."
  def encode!(term), do: IO.iodata_to_binary(enc(term))

  defp value(<<"{", r::binary>>), do: object(skip_ws(r), [])
  defp value(<<"[", r::binary>>), do: array(skip_ws(r), [])
  defp value(<<"\"", r::binary>>), do: string(r, [])
  defp value(<<"true", r::binary>>), do: {true, r}
  defp value(<<"false", r::binary>>), do: {false, r}
  defp value(<<"null", r::binary>>), do: {nil, r}

  defp value(text) do
    case Regex.run(~r/\A-?\d+(\.\d+)?([eE][-+]?\d+)?/, text) do
      [number | parts] ->
        rest = binary_part(text, byte_size(number), byte_size(text) - byte_size(number))
        {if(parts == [], do: String.to_integer(number), else: to_float(number)), rest}

      nil ->
        raise ArgumentError,
              "JSON: unexpected #{inspect(binary_part(text, 0, min(20, byte_size(text))))}"
    end
  end

  # "1e5" has no fraction, which Elixir's float parser requires.
  defp to_float(number) do
    {float, ""} = Float.parse(number)
    float
  end

  defp object(<<"}", r::binary>>, []), do: {%{}, r}

  defp object(<<"\"", r::binary>>, acc) do
    {key, r} = string(r, [])
    <<":", r::binary>> = skip_ws(r)
    {val, r} = value(skip_ws(r))

    case skip_ws(r) do
      <<",", r::binary>> -> object(skip_ws(r), [{key, val} | acc])
      <<"}", r::binary>> -> {Map.new([{key, val} | acc]), r}
    end
  end

  defp array(<<"]", r::binary>>, []), do: {[], r}

  defp array(text, acc) do
    {val, r} = value(text)

    case skip_ws(r) do
      <<",", r::binary>> -> array(skip_ws(r), [val | acc])
      <<"]", r::binary>> -> {Enum.reverse([val | acc]), r}
    end
  end

  defp string(<<"\"", r::binary>>, acc), do: {IO.iodata_to_binary(Enum.reverse(acc)), r}

  defp string(<<"\\u", hex::binary-4, r::binary>>, acc) do
    code = String.to_integer(hex, 16)

    if code in 0xD800..0xDBFF do
      # a UTF-16 surrogate pair
      <<"\\u", low::binary-4, r::binary>> = r
      char = 0x10000 + (code - 0xD800) * 0x400 + (String.to_integer(low, 16) - 0xDC00)
      string(r, [<<char::utf8>> | acc])
    else
      string(r, [<<code::utf8>> | acc])
    end
  end

  defp string(<<"\\", c, r::binary>>, acc) do
    char = %{
      ?" => "\"",
      ?\\ => "\\",
      ?/ => "/",
      ?b => "\b",
      ?f => "\f",
      ?n => "\n",
      ?r => "\r",
      ?t => "\t"
    }

    string(r, [Map.fetch!(char, c) | acc])
  end

  defp string(<<c, r::binary>>, acc), do: string(r, [c | acc])

  defp skip_ws(<<c, r::binary>>) when c in ~c" \t\r\n", do: skip_ws(r)
  defp skip_ws(text), do: text

  defp enc(nil), do: "null"
  defp enc(true), do: "true"
  defp enc(false), do: "false"
  defp enc(n) when is_integer(n), do: Integer.to_string(n)
  defp enc(f) when is_float(f), do: Float.to_string(f)
  defp enc(a) when is_atom(a), do: enc(Atom.to_string(a))

  defp enc(s) when is_binary(s) do
    escaped =
      for <<c::utf8 <- s>>, into: "" do
        case c do
          ?" -> "\\\""
          ?\\ -> "\\\\"
          c when c < 0x20 -> "\\u" <> String.pad_leading(Integer.to_string(c, 16), 4, "0")
          c -> <<c::utf8>>
        end
      end

    [?", escaped, ?"]
  end

  defp enc(list) when is_list(list), do: [?[, Enum.intersperse(Enum.map(list, &enc/1), ?,), ?]]

  defp enc(map) when is_map(map) do
    entries = Enum.map(map, fn {k, v} -> [enc(to_string(k)), ?:, enc(v)] end)
    [?{, Enum.intersperse(entries, ?,), ?}]
  end
end
