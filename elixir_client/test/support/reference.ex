defmodule ScanBridge.TestSupport.Reference do
  @moduledoc false
  # The selective scan, one scalar at a time in float64 (protocol/SPEC.md §6 math), as the
  # oracle for the server's answers. Slow on purpose: small shapes only.

  alias ScanBridge.Tensor

  @doc """
  `inputs` as given to `ScanBridge.scan/3` (tensors and options). Returns `{y, state}` as flat
  float lists: y in x's layout, state `[batch, dim, state]`.
  """
  def scan(inputs) do
    layout = Map.get(inputs, :layout, :bld)
    x = values(inputs.x)
    {batch, len, dim} = dims_of_x(inputs.x.shape, layout)
    {_, n} = inputs."A".shape
    b_mat = bc_accessor(inputs."B", layout, len, n)
    c_mat = bc_accessor(inputs."C", layout, len, n)
    groups = groups(inputs."B".shape, layout)
    a = values(inputs."A")
    dt = values(inputs.dt)
    d = optional(inputs, :D)
    z = optional(inputs, :z)
    bias = optional(inputs, :dt_bias)
    h0 = optional(inputs, :h0)
    x_at = fn bi, t, di -> x_index(layout, {batch, len, dim}, bi, t, di) end

    results =
      for bi <- 0..(batch - 1), di <- 0..(dim - 1) do
        g = div(di, div(dim, groups))
        h = for ni <- 0..(n - 1), do: if(h0, do: elem(h0, (bi * dim + di) * n + ni), else: 0.0)

        {ys, h} =
          Enum.map_reduce(0..(len - 1), h, fn t, h ->
            xi = elem(x, x_at.(bi, t, di))
            delta = time_step(elem(dt, x_at.(bi, t, di)), bias && elem(bias, di), inputs)

            h =
              for {h_n, ni} <- Enum.with_index(h) do
                :math.exp(delta * elem(a, di * n + ni)) * h_n + delta * b_mat.(bi, t, g, ni) * xi
              end

            y = Enum.sum(for {h_n, ni} <- Enum.with_index(h), do: c_mat.(bi, t, g, ni) * h_n)
            y = if d, do: y + elem(d, di) * xi, else: y
            y = if z, do: gate(y, elem(z, x_at.(bi, t, di))), else: y
            {{x_at.(bi, t, di), y}, h}
          end)

        {ys, h}
      end

    # ys are {index into y, value}; the final states come in [batch, dim] order already.
    y = results |> Enum.flat_map(&elem(&1, 0)) |> Enum.sort() |> Enum.map(&elem(&1, 1))
    {y, Enum.flat_map(results, &elem(&1, 1))}
  end

  defp time_step(dt, bias, inputs) do
    dt = if bias, do: dt + bias, else: dt
    dt = if inputs[:dt_softplus], do: softplus(dt), else: dt
    dt = if inputs[:dt_min], do: max(dt, inputs[:dt_min]), else: dt
    if inputs[:dt_max], do: min(dt, inputs[:dt_max]), else: dt
  end

  # torch's softplus (threshold 20: linear above it)
  defp softplus(v) when v > 20, do: v
  defp softplus(v), do: :math.log(1 + :math.exp(v))

  defp gate(y, z), do: y * z / (1 + :math.exp(-z))

  defp values(%Tensor{} = t), do: t |> Tensor.to_list() |> List.to_tuple()

  defp optional(inputs, key) do
    case Map.get(inputs, key) do
      nil -> nil
      tensor -> values(tensor)
    end
  end

  defp dims_of_x({b, l, d}, :bld), do: {b, l, d}
  defp dims_of_x({b, d, l}, :bdl), do: {b, l, d}

  defp x_index(:bld, {_b, l, d}, bi, t, di), do: (bi * l + t) * d + di
  defp x_index(:bdl, {_b, l, d}, bi, t, di), do: (bi * d + di) * l + t

  # B/C: [batch, seq, groups, state] (bld) or [batch, groups, state, seq] (bdl); 3-D: 1 group.
  defp groups({_b, _l, g, _n}, :bld), do: g
  defp groups({_b, g, _n, _l}, :bdl), do: g
  defp groups(_shape, _layout), do: 1

  # B/C value at (batch, time, group, state) for either layout, with or without groups.
  defp bc_accessor(%Tensor{shape: shape} = t, layout, len, n) do
    v = values(t)

    case {layout, shape} do
      {:bld, {_b, _l, _n}} ->
        fn bi, ti, _g, ni -> elem(v, (bi * len + ti) * n + ni) end

      {:bld, {_b, _l, g, _n}} ->
        fn bi, ti, gi, ni -> elem(v, ((bi * len + ti) * g + gi) * n + ni) end

      {:bdl, {_b, _n, _l}} ->
        fn bi, ti, _g, ni -> elem(v, (bi * n + ni) * len + ti) end

      {:bdl, {_b, g, _n, _l}} ->
        fn bi, ti, gi, ni -> elem(v, ((bi * g + gi) * n + ni) * len + ti) end
    end
  end
end
