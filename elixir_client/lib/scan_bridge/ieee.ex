defmodule ScanBridge.IEEE do
  @moduledoc false
  # Erlang floats hold no NaN or infinity (a float pattern does not match those bit patterns),
  # so decoders name them with atoms instead.

  # {exponent bits, mantissa bits} of each float dtype, after its sign bit.
  @formats %{f16: {5, 10}, bf16: {8, 7}, f32: {8, 23}, f64: {11, 52}}
  # The element bytes (little-endian) of the quiet NaN and the infinities in each float dtype:
  # the exponent all ones, with the mantissa's top bit for NaN and the sign bit for -infinity.
  @element Map.new(@formats, fn {dtype, {exponent_bits, mantissa_bits}} ->
             width = 1 + exponent_bits + mantissa_bits
             exponent_ones = Bitwise.bsl(Bitwise.bsl(1, exponent_bits) - 1, mantissa_bits)
             quiet = Bitwise.bsl(1, mantissa_bits - 1)
             sign = Bitwise.bsl(1, width - 1)

             {dtype,
              %{
                nan: <<exponent_ones + quiet::size(width)-little>>,
                infinity: <<exponent_ones::size(width)-little>>,
                neg_infinity: <<sign + exponent_ones::size(width)-little>>
              }}
           end)

  @doc "Whether `dtype` is a float dtype, whose elements can be non-finite."
  defguard float_dtype?(dtype) when is_map_key(@element, dtype)

  @type special :: :nan | :infinity | :neg_infinity

  @doc "The atom for a non-finite value of a float dtype given as its unsigned bit pattern."
  @spec special(non_neg_integer, :f32 | :f64 | :f16 | :bf16) :: special
  def special(bits, dtype) do
    {exponent_bits, mantissa_bits} = @formats[dtype]

    cond do
      Bitwise.band(bits, Bitwise.bsl(1, mantissa_bits) - 1) != 0 -> :nan
      Bitwise.bsr(bits, exponent_bits + mantissa_bits) == 1 -> :neg_infinity
      true -> :infinity
    end
  end

  @doc "The element bytes of a non-finite value in a float dtype, the inverse of `special/2`."
  @spec encode(special, :f32 | :f64 | :f16 | :bf16) :: binary
  def encode(value, dtype), do: @element[dtype][value]
end
