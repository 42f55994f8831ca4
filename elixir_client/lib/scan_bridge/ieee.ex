defmodule ScanBridge.IEEE do
  @moduledoc false
  # Erlang floats hold no NaN or infinity (a float pattern does not match those bit patterns),
  # so decoders name them with atoms instead.

  @mantissa_bits %{16 => 10, 32 => 23, 64 => 52}
  # The element bytes (little-endian) of the quiet NaN and the infinities in each float dtype.
  @element %{
    f32: %{
      nan: <<0x7FC00000::32-little>>,
      infinity: <<0x7F800000::32-little>>,
      neg_infinity: <<0xFF800000::32-little>>
    },
    f64: %{
      nan: <<0x7FF8000000000000::64-little>>,
      infinity: <<0x7FF0000000000000::64-little>>,
      neg_infinity: <<0xFFF0000000000000::64-little>>
    },
    f16: %{
      nan: <<0x7E00::16-little>>,
      infinity: <<0x7C00::16-little>>,
      neg_infinity: <<0xFC00::16-little>>
    },
    bf16: %{
      nan: <<0x7FC0::16-little>>,
      infinity: <<0x7F80::16-little>>,
      neg_infinity: <<0xFF80::16-little>>
    }
  }

  @doc "Whether `dtype` is a float dtype, whose elements can be non-finite."
  defguard float_dtype?(dtype) when is_map_key(@element, dtype)

  @type special :: :nan | :infinity | :neg_infinity

  @doc "The atom for a non-finite IEEE 754 value given as its unsigned bit pattern and width."
  @spec special(non_neg_integer, 16 | 32 | 64) :: special
  def special(bits, width) do
    mantissa = Bitwise.band(bits, Bitwise.bsl(1, @mantissa_bits[width]) - 1)

    cond do
      mantissa != 0 -> :nan
      Bitwise.bsr(bits, width - 1) == 1 -> :neg_infinity
      true -> :infinity
    end
  end

  @doc "The element bytes of a non-finite value in a float dtype, the inverse of `special/2`."
  @spec encode(special, :f32 | :f64 | :f16 | :bf16) :: binary
  def encode(value, dtype), do: @element[dtype][value]
end
