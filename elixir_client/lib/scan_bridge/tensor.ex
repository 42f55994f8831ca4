defmodule ScanBridge.Tensor do
  @moduledoc """
  A dense array as it travels on the wire (protocol SPEC §5): raw little-endian elements in C
  order (last index fastest), a dtype and a shape.

  `data` is a binary and is never copied by this client: a tensor built from a large binary
  is sent as that binary, and a tensor in a reply is a sub-binary of the received frame.

  When `Nx` is available at compile time, an `Nx.Tensor` is accepted wherever a tensor is
  (`from_nx/1` converts it) and `to_nx/1` converts back.
  """

  require ScanBridge.IEEE

  @enforce_keys [:data, :dtype, :shape]
  defstruct [:data, :dtype, :shape]

  @type dtype :: :f32 | :f16 | :bf16 | :f64 | :i32 | :i64 | :u8
  @type t :: %__MODULE__{data: binary, dtype: dtype, shape: tuple}

  @itemsize %{f32: 4, f16: 2, bf16: 2, f64: 8, i32: 4, i64: 8, u8: 1}
  @dtypes Map.keys(@itemsize)
  # Wire dtype codes are the atoms' names; this table maps a server's string back to an atom
  # without creating atoms from untrusted input.
  @dtype_of_code Map.new(@dtypes, fn dtype -> {Atom.to_string(dtype), dtype} end)
  @max_rank 8
  # The largest dim, and the most bytes a shape may span, on the wire (int64, SPEC §5).
  @max_dim 0x7FFFFFFFFFFFFFFF

  @doc """
  A tensor from its raw bytes. Raises `ArgumentError` when the dtype is unknown, the shape is
  not a tuple of non-negative integers (at most 8), or the data length is not the element
  count times the itemsize.

      iex> t = ScanBridge.Tensor.new(<<0, 0, 192, 63, 0, 0, 0, 192>>, :f32, {2})
      iex> ScanBridge.Tensor.to_list(t)
      [1.5, -2.0]

      iex> ScanBridge.Tensor.new(<<1, 2, 3>>, :f32, {1})
      ** (ArgumentError) tensor data: expected 4 bytes (f32 {1}), got 3 bytes
  """
  @spec new(binary, dtype, tuple) :: t
  def new(data, dtype, shape) when is_binary(data) do
    check_dtype!(dtype)
    check_shape!(shape, dtype)
    expected = elements(shape) * @itemsize[dtype]

    if byte_size(data) != expected do
      raise ArgumentError,
            "tensor data: expected #{expected} bytes (#{dtype} #{inspect(shape)}), " <>
              "got #{byte_size(data)} bytes"
    end

    %__MODULE__{data: data, dtype: dtype, shape: shape}
  end

  def new(data, _dtype, _shape) do
    raise ArgumentError, "tensor data: expected a binary, got #{inspect(data, limit: 5)}"
  end

  @doc """
  A tensor from a flat list of numbers in C order. Floats are rounded to the dtype, to nearest
  even (bf16: first to f32, then to bf16, as torch converts an f64 tensor, which can differ from
  the bf16 nearest the f64 by one unit); integers must fit the dtype. Float dtypes also take `:nan`,
  `:infinity` and `:neg_infinity`, the atoms `to_list/1` gives for them.

      iex> ScanBridge.Tensor.from_list([1, -2, 3], :i32, {3}).data
      <<1, 0, 0, 0, 254, 255, 255, 255, 3, 0, 0, 0>>

      iex> ScanBridge.Tensor.from_list([1.0, 2.0], :bf16, {2}) |> ScanBridge.Tensor.to_list()
      [1.0, 2.0]

      iex> ScanBridge.Tensor.from_list([:nan, -0.5, :neg_infinity], :f16, {3}) |> ScanBridge.Tensor.to_list()
      [:nan, -0.5, :neg_infinity]
  """
  @spec from_list([number | ScanBridge.IEEE.special()], dtype, tuple) :: t
  def from_list(values, dtype, shape) when is_list(values) do
    check_dtype!(dtype)
    check_shape!(shape, dtype)

    # an improper list first: length/1 would raise naming neither what was expected nor what came
    if List.improper?(values) do
      raise ArgumentError, "tensor values: expected a list of numbers, got an improper list"
    end

    if length(values) != elements(shape) do
      raise ArgumentError,
            "tensor values: expected #{elements(shape)} numbers for shape #{inspect(shape)}, " <>
              "got #{length(values)}"
    end

    new(IO.iodata_to_binary(Enum.map(values, &pack(&1, dtype))), dtype, shape)
  end

  def from_list(values, _dtype, _shape) do
    raise ArgumentError,
          "tensor values: expected a list of numbers, got #{inspect(values, limit: 5)}"
  end

  @doc """
  The elements as a flat list in C order (floats for float dtypes; `:nan`, `:infinity` and
  `:neg_infinity` for the IEEE values Erlang floats cannot hold). A struct whose data is not
  its shape's bytes in its dtype raises `ArgumentError`, as `new/3` does.

      iex> ScanBridge.Tensor.from_list([0.5, -1.25], :f16, {2}) |> ScanBridge.Tensor.to_list()
      [0.5, -1.25]
  """
  @spec to_list(t) :: [number | ScanBridge.IEEE.special()]
  def to_list(%__MODULE__{data: data, dtype: dtype, shape: shape}) do
    # a struct can be built without new/3: its bytes are held to its dtype and shape first
    _checked = new(data, dtype, shape)
    size = @itemsize[dtype]
    for <<element::binary-size(size) <- data>>, do: unpack(element, dtype)
  end

  @doc "Number of elements (the product of the shape; 1 for a scalar `{}`)."
  @spec size(t) :: non_neg_integer
  def size(%__MODULE__{shape: shape}), do: elements(shape)

  @doc "Bytes per element of `dtype`."
  @spec itemsize(dtype) :: pos_integer
  def itemsize(dtype) do
    check_dtype!(dtype)
    @itemsize[dtype]
  end

  @doc """
  A tensor from a value given to the public API: a `ScanBridge.Tensor`, checked like `new/3`
  (a struct can be built without it), or an `Nx.Tensor` converted (when Nx is compiled in).
  Raises `ArgumentError` for anything else; `what` names the value in the message.
  """
  @spec cast!(term, String.t()) :: t
  def cast!(%__MODULE__{data: data, dtype: dtype, shape: shape}, what) do
    new(data, dtype, shape)
  rescue
    e in ArgumentError -> reraise ArgumentError, "#{what}: #{Exception.message(e)}", __STACKTRACE__
  end

  if Code.ensure_loaded?(Nx) do
    def cast!(%Nx.Tensor{} = tensor, _what), do: from_nx(tensor)
  end

  def cast!(other, what) do
    raise ArgumentError,
          "#{what}: expected a ScanBridge.Tensor#{if Code.ensure_loaded?(Nx), do: " or an Nx.Tensor"}, " <>
            "got #{inspect(other, limit: 5)}"
  end

  @doc """
  A tensor from a decoded wire map `%{"dtype" => code, "shape" => [...], "data" => binary}`
  (exactly those keys), checked like `new/3` and as the protocol's reference decoder checks a
  reply's tensor: dims up to 2^63 - 1, and the shape's extent (a 0 dim counted as 1) at most
  2^63 - 1 bytes. The data stays a sub-binary of the received frame.
  """
  @spec from_wire(term) :: {:ok, t} | {:error, String.t()}
  def from_wire(%{"dtype" => code, "shape" => shape, "data" => data} = wire)
      when map_size(wire) == 3 and is_binary(code) and is_list(shape) and is_binary(data) do
    with {:ok, dtype} <- wire_dtype(code),
         :ok <- wire_shape(shape, dtype) do
      try do
        {:ok, new(data, dtype, List.to_tuple(shape))}
      rescue
        e in ArgumentError -> {:error, Exception.message(e)}
      end
    end
  end

  # a raw buffer (buf) belongs to a multipart message, which this client's lanes never carry
  def from_wire(other),
    do:
      {:error,
       "tensor: expected a map of exactly dtype, shape and data, got #{inspect(other, limit: 5)}"}

  defp wire_dtype(code) do
    case Map.fetch(@dtype_of_code, code) do
      {:ok, dtype} ->
        {:ok, dtype}

      :error ->
        {:error,
         "tensor dtype: expected one of #{Enum.join(Map.keys(@dtype_of_code), ", ")}, got #{inspect(code)}"}
    end
  end

  # Dims are int64 on the server; an empty tensor's shape could otherwise claim any extent.
  defp wire_shape(shape, dtype) do
    dims_ok? =
      length(shape) <= @max_rank and Enum.all?(shape, &(is_integer(&1) and &1 in 0..@max_dim))

    if dims_ok? and Enum.reduce(shape, @itemsize[dtype], &(max(&1, 1) * &2)) <= @max_dim,
      do: :ok,
      else:
        {:error,
         "tensor shape: expected at most #{@max_rank} dims in 0..2^63-1 spanning at most " <>
           "2^63-1 bytes, got #{inspect(shape, limit: 9)}"}
  end

  if Code.ensure_loaded?(Nx) do
    @nx_types %{
      f32: {:f, 32},
      f16: {:f, 16},
      bf16: {:bf, 16},
      f64: {:f, 64},
      i32: {:s, 32},
      i64: {:s, 64},
      u8: {:u, 8}
    }
    @dtype_of_nx Map.new(@nx_types, fn {dtype, nx} -> {nx, dtype} end)

    @doc "This tensor as an `Nx.Tensor` (Nx's binary backend; the data is not copied)."
    @spec to_nx(t) :: Nx.Tensor.t()
    def to_nx(%__MODULE__{data: data, dtype: dtype, shape: shape}) do
      data |> Nx.from_binary(@nx_types[dtype]) |> Nx.reshape(shape)
    end

    @doc """
    An `Nx.Tensor` as a wire tensor. Nx keeps elements in native byte order, which is the
    wire's little-endian on the hosts this runs on (x86-64, arm64).
    """
    @spec from_nx(Nx.Tensor.t()) :: t
    def from_nx(%Nx.Tensor{} = tensor) do
      type = Nx.type(tensor)

      dtype =
        Map.get(@dtype_of_nx, type) ||
          raise ArgumentError,
                "Nx tensor type: expected one of #{inspect(Map.keys(@dtype_of_nx))}, got #{inspect(type)}"

      new(Nx.to_binary(tensor), dtype, Nx.shape(tensor))
    end
  end

  defp check_dtype!(dtype) when is_map_key(@itemsize, dtype), do: :ok

  defp check_dtype!(dtype),
    do:
      raise(
        ArgumentError,
        "tensor dtype: expected one of #{inspect(@dtypes)}, got #{inspect(dtype)}"
      )

  # As the wire takes it (wire_shape: dims and extent within 2^63-1, SPEC §5): a shape past it
  # was built and sent, and refused by the server.
  defp check_shape!(shape, dtype) when is_tuple(shape) and tuple_size(shape) <= @max_rank do
    dims = Tuple.to_list(shape)

    unless Enum.all?(dims, &(is_integer(&1) and &1 >= 0)) do
      raise ArgumentError,
            "tensor shape: expected a tuple of non-negative integers, got #{inspect(shape)}"
    end

    with {:error, message} <- wire_shape(dims, dtype), do: raise(ArgumentError, message)
  end

  defp check_shape!(shape, _dtype) do
    raise ArgumentError,
          "tensor shape: expected a tuple of at most #{@max_rank} non-negative integers, got #{inspect(shape)}"
  end

  defp elements(shape), do: shape |> Tuple.to_list() |> Enum.reduce(1, &(&1 * &2))

  defp pack(v, :f32) when is_number(v), do: <<v::float-32-little>>
  defp pack(v, :f64) when is_number(v), do: <<v::float-64-little>>
  defp pack(v, :f16) when is_number(v), do: <<v::float-16-little>>

  defp pack(v, :bf16) when is_number(v) do
    # Round the float32 bits to their upper half, to nearest, ties to even.
    <<bits::32>> = <<v::float-32>>
    rounded = bits + 0x7FFF + Bitwise.band(Bitwise.bsr(bits, 16), 1)
    <<Bitwise.bsr(rounded, 16)::16-little>>
  end

  defp pack(v, :i32) when is_integer(v) and v in -0x80000000..0x7FFFFFFF,
    do: <<v::32-signed-little>>

  defp pack(v, :i64) when is_integer(v) and v in -0x8000000000000000..0x7FFFFFFFFFFFFFFF,
    do: <<v::64-signed-little>>

  defp pack(v, :u8) when is_integer(v) and v in 0..255, do: <<v>>

  defp pack(v, dtype)
       when v in [:nan, :infinity, :neg_infinity] and ScanBridge.IEEE.float_dtype?(dtype),
       do: ScanBridge.IEEE.encode(v, dtype)

  defp pack(v, dtype) do
    raise ArgumentError, "tensor value: expected a number that fits #{dtype}, got #{inspect(v)}"
  end

  defp unpack(<<v::float-32-little>>, :f32), do: v
  defp unpack(<<v::float-64-little>>, :f64), do: v
  defp unpack(<<v::float-16-little>>, :f16), do: v
  defp unpack(<<bits::16-little>>, :bf16), do: unpack(<<0::16, bits::16-little>>, :f32)
  defp unpack(<<v::32-signed-little>>, :i32), do: v
  defp unpack(<<v::64-signed-little>>, :i64), do: v
  defp unpack(<<v>>, :u8), do: v
  # A float pattern does not match NaN or infinity bit patterns.
  defp unpack(element, float_dtype) do
    ScanBridge.IEEE.special(:binary.decode_unsigned(element, :little), float_dtype)
  end
end
