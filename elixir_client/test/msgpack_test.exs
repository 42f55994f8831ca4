defmodule ScanBridge.MsgpackTest do
  use ExUnit.Case, async: true

  alias ScanBridge.{Msgpack, Tensor}

  doctest ScanBridge.Msgpack

  defp pack(term), do: term |> Msgpack.encode() |> IO.iodata_to_binary()

  defp roundtrip(term) do
    {:ok, decoded} = term |> pack() |> Msgpack.decode()
    decoded
  end

  # One case per side of every format boundary: {name, value, expected leading bytes}.
  @int_cases [
    {"positive fixint max", 127, <<0x7F>>},
    {"uint 8 min", 128, <<0xCC, 128>>},
    {"uint 8 max", 255, <<0xCC, 255>>},
    {"uint 16 min", 256, <<0xCD, 1, 0>>},
    {"uint 16 max", 65_535, <<0xCD, 255, 255>>},
    {"uint 32 min", 65_536, <<0xCE, 0, 1, 0, 0>>},
    {"uint 32 max", 4_294_967_295, <<0xCE, 255, 255, 255, 255>>},
    {"uint 64 min", 4_294_967_296, <<0xCF, 0, 0, 0, 1, 0, 0, 0, 0>>},
    {"uint 64 max", 18_446_744_073_709_551_615, <<0xCF, -1::64>>},
    {"zero", 0, <<0x00>>},
    {"negative fixint max", -1, <<0xFF>>},
    {"negative fixint min", -32, <<0xE0>>},
    {"int 8 max", -33, <<0xD0, -33::8>>},
    {"int 8 min", -128, <<0xD0, 0x80>>},
    {"int 16 max", -129, <<0xD1, -129::16>>},
    {"int 16 min", -32_768, <<0xD1, 0x80, 0>>},
    {"int 32 max", -32_769, <<0xD2, -32_769::32>>},
    {"int 32 min", -2_147_483_648, <<0xD2, 0x80, 0, 0, 0>>},
    {"int 64 max", -2_147_483_649, <<0xD3, -2_147_483_649::64>>},
    {"int 64 min", -9_223_372_036_854_775_808, <<0xD3, 0x80, 0::56>>}
  ]

  for {name, value, bytes} <- @int_cases do
    test "int: #{name}" do
      assert pack(unquote(value)) == unquote(bytes)
      assert roundtrip(unquote(value)) === unquote(value)
    end
  end

  test "int: out of range on either side is refused" do
    assert_raise ArgumentError, ~r/expected an integer in -2\^63\.\.2\^64-1/, fn ->
      pack(18_446_744_073_709_551_616)
    end

    assert_raise ArgumentError, ~r/expected an integer/, fn -> pack(-9_223_372_036_854_775_809) end
  end

  # {name, length, header}
  @str_cases [
    {"fixstr max", 31, <<0xBF>>},
    {"str 8 min", 32, <<0xD9, 32>>},
    {"str 8 max", 255, <<0xD9, 255>>},
    {"str 16 min", 256, <<0xDA, 1, 0>>},
    {"str 16 max", 65_535, <<0xDA, 255, 255>>},
    {"str 32 min", 65_536, <<0xDB, 0, 1, 0, 0>>}
  ]

  for {name, len, header} <- @str_cases do
    test "str: #{name}" do
      text = String.duplicate("s", unquote(len))
      assert pack(text) == unquote(header) <> text
      assert roundtrip(text) == text
    end
  end

  @bin_cases [
    {"bin 8 max", 255, <<0xC4, 255>>},
    {"bin 16 min", 256, <<0xC5, 1, 0>>},
    {"bin 16 max", 65_535, <<0xC5, 255, 255>>},
    {"bin 32 min", 65_536, <<0xC6, 0, 1, 0, 0>>}
  ]

  for {name, len, header} <- @bin_cases do
    test "bin: #{name}" do
      bytes = :crypto.strong_rand_bytes(unquote(len))
      assert pack({:bin, bytes}) == unquote(header) <> bytes
      assert roundtrip({:bin, bytes}) == bytes
    end
  end

  test "bin: empty" do
    assert pack({:bin, ""}) == <<0xC4, 0>>
  end

  @array_cases [
    {"fixarray max", 15, <<0x9F>>},
    {"array 16 min", 16, <<0xDC, 0, 16>>},
    {"array 16 max", 65_535, <<0xDC, 255, 255>>},
    {"array 32 min", 65_536, <<0xDD, 0, 1, 0, 0>>}
  ]

  for {name, count, header} <- @array_cases do
    test "array: #{name}" do
      list = Enum.map(1..unquote(count), &rem(&1, 100))
      packed = pack(list)
      assert binary_part(packed, 0, byte_size(unquote(header))) == unquote(header)
      assert roundtrip(list) == list
    end
  end

  @map_cases [
    {"fixmap max", 15, <<0x8F>>},
    {"map 16 min", 16, <<0xDE, 0, 16>>},
    {"map 16 max", 65_535, <<0xDE, 255, 255>>},
    {"map 32 min", 65_536, <<0xDF, 0, 1, 0, 0>>}
  ]

  for {name, count, header} <- @map_cases do
    test "map: #{name}" do
      map = Map.new(1..unquote(count), &{"k#{&1}", &1})
      packed = pack(map)
      assert binary_part(packed, 0, byte_size(unquote(header))) == unquote(header)
      assert roundtrip(map) == map
    end
  end

  test "nil, booleans, floats, atoms and atom keys" do
    assert pack(nil) == <<0xC0>>
    assert pack(false) == <<0xC2>>
    assert pack(true) == <<0xC3>>
    assert pack(-1.5) == <<0xCB, -1.5::float-64>>
    assert pack(:bld) == <<0xA3, "bld">>

    assert roundtrip(%{dt_softplus: true, layout: :bdl}) == %{
             "dt_softplus" => true,
             "layout" => "bdl"
           }
  end

  test "atom keys are str, nil, true, false and the IEEE atoms too" do
    for key <- [nil, true, false, :infinity, :neg_infinity, :nan] do
      name = Atom.to_string(key)
      assert pack(%{key => 1}) == <<0x81, 0xA0 + byte_size(name)>> <> name <> <<1>>
    end
  end

  test "nesting past 512 containers is refused, not recursed into" do
    # A reply nested millions deep took the VM's memory (found in review).
    nested = fn depth, header -> :binary.copy(header, depth) <> <<0xC0>> end
    assert {:ok, _} = Msgpack.decode(nested.(512, <<0x91>>))

    for header <- [<<0x91>>, <<0x81, 0xA1, "k">>] do
      assert {:error, %ScanBridge.Error{reason: :decode_error, detail: %{"problem" => "too_deep"}}} =
               Msgpack.decode(nested.(513, header))
    end

    assert {:error, %ScanBridge.Error{detail: %{"problem" => "too_deep"}}} =
             Msgpack.decode(nested.(1_000_000, <<0x91>>))
  end

  test "utf8: true refuses a str, value or key, that is not UTF-8; a bin is bytes" do
    for body <- [<<0xA1, 0xFF>>, <<0x81, 0xA1, 0xFF, 1>>, <<0x91, 0xD9, 2, 0xC3, 0x28>>] do
      assert {:ok, _} = Msgpack.decode(body)

      assert {:error,
              %ScanBridge.Error{reason: :decode_error, detail: %{"problem" => "invalid_utf8"}}} =
               Msgpack.decode(body, utf8: true)
    end

    assert Msgpack.decode(<<0xC4, 1, 0xFF>>, utf8: true) == {:ok, <<0xFF>>}
    assert Msgpack.decode(<<0xA2, "é">>, utf8: true) == {:ok, "é"}
  end

  test "the atoms for the IEEE values Erlang floats cannot hold encode as those floats" do
    assert pack(:infinity) == <<0xCB, 0x7FF0000000000000::64>>
    assert pack(:neg_infinity) == <<0xCB, 0xFFF0000000000000::64>>
    assert pack(:nan) == <<0xCB, 0x7FF8000000000000::64>>
    assert roundtrip([0.0, :infinity, :neg_infinity, :nan]) == [0.0, :infinity, :neg_infinity, :nan]
  end

  test "unencodable terms are refused with what came" do
    assert_raise ArgumentError, ~r/got \{1, 2\}/, fn -> pack({1, 2}) end
    assert_raise ArgumentError, ~r/got a URI struct/, fn -> pack(URI.parse("http://x")) end
    assert_raise ArgumentError, ~r/map key, got 1/, fn -> pack(%{1 => 2}) end
  end

  describe "decoding" do
    test "float 32, and the IEEE values Erlang floats cannot hold" do
      assert Msgpack.decode(<<0xCA, 1.5::float-32>>) == {:ok, 1.5}
      assert Msgpack.decode(<<0xCA, 0x7FC00000::32>>) == {:ok, :nan}
      assert Msgpack.decode(<<0xCB, 0x7FF0000000000000::64>>) == {:ok, :infinity}
      assert Msgpack.decode(<<0xCA, 0xFF800000::32>>) == {:ok, :neg_infinity}
    end

    test "non-minimal encodings (what aligned encoders send)" do
      assert Msgpack.decode(<<0xCF, 7::64>>) == {:ok, 7}
      assert Msgpack.decode(<<0xDB, 2::32, "hi">>) == {:ok, "hi"}
      assert Msgpack.decode(<<0xC6, 1::32, 9>>) == {:ok, <<9>>}
      assert Msgpack.decode(<<0xDD, 1::32, 0xC0>>) == {:ok, [nil]}
      assert Msgpack.decode(<<0xDF, 1::32, 0xA1, "k", 0x01>>) == {:ok, %{"k" => 1}}
    end

    test "a bin is a sub-binary of the input, not a copy" do
      payload = :crypto.strong_rand_bytes(100_000)
      {:ok, decoded} = Msgpack.decode(pack({:bin, payload}))
      assert decoded == payload
      assert :binary.referenced_byte_size(decoded) > byte_size(payload)
    end

    @failures [
      {"empty input", <<>>, "truncated", 0},
      {"truncated header", <<0xCD, 1>>, "truncated", 0},
      {"truncated str", <<0xA5, "abc">>, "truncated", 0},
      {"truncated array item", <<0x92, 0x01>>, "truncated", 2},
      {"map value missing", <<0x81, 0xA1, "k">>, "truncated", 3},
      {"trailing bytes", <<0xC0, 0xC0>>, "trailing_bytes", 1},
      {"reserved byte", <<0x91, 0xC1>>, "reserved_byte_0xc1", 1},
      {"ext type", <<0xD4, 1, 2>>, "ext_type", 0},
      {"duplicate key", <<0x82, 0xA1, "k", 1, 0xA1, "k", 2>>, "duplicate_key", 0}
    ]

    for {name, bytes, problem, at} <- @failures do
      test "fails with a typed error: #{name}" do
        assert {:error, %ScanBridge.Error{reason: :decode_error, detail: detail}} =
                 Msgpack.decode(unquote(bytes))

        assert detail == %{"problem" => unquote(problem), "at" => unquote(at)}
      end
    end
  end

  describe "damaged replies" do
    # A reply as the server sends one, and an error reply; every byte of each replaced by each
    # of these msgpack type bytes (nil, bool, bin, ext, float, int and uint of every width, str,
    # array and map headers, fixint, fixstr, fixarray and fixmap edges, the reserved 0xc1), and
    # every truncation: the decoder answers each with {:ok, term} or a typed error, never raises.
    @type_bytes [0xC0, 0xC1, 0xC2, 0xC3, 0xC4, 0xC5, 0xC6, 0xC7, 0xC8, 0xC9, 0xCA, 0xCB, 0xCC] ++
                  [0xCD, 0xCE, 0xCF, 0xD0, 0xD1, 0xD2, 0xD3, 0xD4, 0xD8, 0xD9, 0xDA, 0xDB, 0xDC] ++
                  [0xDD, 0xDE, 0xDF, 0x7F, 0x80, 0x8F, 0x90, 0x9F, 0xA0, 0xBF, 0xE0, 0xFF]

    defp replies do
      tensor = %{
        "dtype" => "f32",
        "shape" => [2],
        "data" => {:bin, <<1.5::float-32-little, -2::32>>}
      }

      [
        %{
          "v" => 1,
          "id" => 7,
          "ok" => true,
          "result" => %{"y" => tensor},
          "timing" => %{"server_us" => 1.5}
        },
        %{
          "v" => 1,
          "id" => "a",
          "ok" => false,
          "error" => %{"code" => "x", "detail" => %{"at" => [1, nil, true]}}
        }
      ]
      |> Enum.map(&pack/1)
    end

    defp answered?(body) do
      match?({:ok, _}, Msgpack.decode(body)) or
        match?({:error, %ScanBridge.Error{reason: :decode_error}}, Msgpack.decode(body))
    end

    test "every byte replaced by each type byte" do
      for body <- replies(), at <- 0..(byte_size(body) - 1), type <- @type_bytes do
        <<before::binary-size(at), _, rest::binary>> = body
        damaged = before <> <<type>> <> rest
        assert answered?(damaged), "byte #{at} made #{type}: #{inspect(damaged)}"
      end
    end

    test "every truncation is a typed error" do
      for body <- replies(), size <- 0..(byte_size(body) - 1) do
        assert {:error, %ScanBridge.Error{reason: :decode_error}} =
                 Msgpack.decode(binary_part(body, 0, size))
      end
    end
  end

  describe "tensor payload alignment" do
    # Payload sizes on each side of the bin header boundaries, and shapes with dims that take
    # 1, 2 or 3 bytes, at every starting offset modulo 8.
    @payloads [
      {"f32 {3} (bin 8)", :f32, {3}},
      {"u8 {255} (bin 8 max)", :u8, {255}},
      {"u8 {256} (bin 16)", :u8, {256}},
      {"f16 {5, 300} (bin 16)", :f16, {5, 300}},
      {"f32 {7, 3001} (bin 32)", :f32, {7, 3001}},
      {"f64 {2, 3, 5, 7} (bin 32)", :f64, {2, 3, 5, 7}}
    ]

    for {name, dtype, shape} <- @payloads do
      test "lands at a multiple of 8: #{name}" do
        tensor = ScanBridge.TestSupport.random(unquote(dtype), unquote(Macro.escape(shape)))

        for prefix <- 0..15 do
          # the tensor inside a map after a key whose length moves it by `prefix` bytes
          body = pack(%{String.duplicate("k", prefix) => tensor})
          {offset, _} = :binary.match(body, tensor.data)
          assert rem(offset, 8) == 0, "payload at #{offset} with a #{prefix}-byte key"
          assert {:ok, %{} = decoded} = Msgpack.decode(body)
          wire = decoded[String.duplicate("k", prefix)]
          assert {:ok, ^tensor} = Tensor.from_wire(wire)
        end
      end
    end

    test "relative to the starting offset given to encode_at/2" do
      tensor = ScanBridge.TestSupport.random(:f32, {3, 5})

      for start <- 0..7 do
        {iodata, finish} = Msgpack.encode_at(tensor, start)
        body = IO.iodata_to_binary(iodata)
        {offset, _} = :binary.match(body, tensor.data)
        assert rem(start + offset, 8) == 0
        assert finish == start + byte_size(body)
      end
    end

    test "the payload is the caller's binary, not a copy" do
      tensor = ScanBridge.TestSupport.random(:f32, {64, 1024})
      iodata = Msgpack.encode(tensor)
      assert Enum.any?(List.flatten(iodata), &(is_binary(&1) and :erts_debug.same(&1, tensor.data)))
    end
  end
end
