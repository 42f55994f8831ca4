defmodule ScanBridge.IEEE do
  @moduledoc false
  # Erlang floats hold no NaN or infinity (a float pattern does not match those bit patterns),
  # so decoders name them with atoms instead.

  @mantissa_bits %{16 => 10, 32 => 23, 64 => 52}

  @doc "The atom for a non-finite IEEE 754 value given as its unsigned bit pattern and width."
  @spec special(non_neg_integer, 16 | 32 | 64) :: :nan | :infinity | :neg_infinity
  def special(bits, width) do
    mantissa = Bitwise.band(bits, Bitwise.bsl(1, @mantissa_bits[width]) - 1)

    cond do
      mantissa != 0 -> :nan
      Bitwise.bsr(bits, width - 1) == 1 -> :neg_infinity
      true -> :infinity
    end
  end
end
