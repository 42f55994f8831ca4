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

  @doc """
  The Mamba-2 (SSD) scan, head by head: `inputs` as given to `ScanBridge.ssd_scan/3`, by their
  canonical names (x, dt, A, B, C; D, z, dt_bias, h0, dt_softplus, dt_min, dt_max, dt_limit,
  cu_seqlens). Returns `{y, state}` as flat float lists: y `[batch, seq, heads, headdim]`, state
  `[rows, heads, headdim, state]`, a row per batch row or, with cu_seqlens, per sequence.
  """
  def ssd_scan(inputs) do
    {batch, len, heads, p} = inputs.x.shape
    {_, _, groups, n} = inputs."B".shape
    [x, dt, a, b_mat, c_mat] = Enum.map([:x, :dt, :A, :B, :C], &values(inputs[&1]))
    [d, z, bias, h0] = Enum.map([:D, :z, :dt_bias, :h0], &optional(inputs, &1))
    # D is [heads] or [heads, headdim]
    d_at =
      if inputs[:D] && tuple_size(inputs[:D].shape) == 2,
        do: fn hi, pi -> hi * p + pi end,
        else: fn hi, _pi -> hi end

    results =
      for {{bi, from, to}, row} <- Enum.with_index(sequences(inputs, batch, len)),
          hi <- 0..(heads - 1) do
        g = div(hi, div(heads, groups))

        start =
          for pi <- 0..(p - 1),
              do: for(ni <- 0..(n - 1), do: h0_at(h0, ((row * heads + hi) * p + pi) * n + ni))

        Enum.map_reduce(from..(to - 1)//1, start, fn t, h ->
          at = (bi * len + t) * heads + hi
          delta = time_step(elem(dt, at), bias && elem(bias, hi), inputs)
          decay = :math.exp(delta * elem(a, hi))
          bs = for ni <- 0..(n - 1), do: elem(b_mat, ((bi * len + t) * groups + g) * n + ni)
          cs = for ni <- 0..(n - 1), do: elem(c_mat, ((bi * len + t) * groups + g) * n + ni)
          xs = for pi <- 0..(p - 1), do: elem(x, at * p + pi)

          h =
            for {h_p, xv} <- Enum.zip(h, xs),
                do: for({h_pn, bv} <- Enum.zip(h_p, bs), do: decay * h_pn + delta * xv * bv)

          ys =
            for {{h_p, xv}, pi} <- Enum.with_index(Enum.zip(h, xs)) do
              y = Enum.sum(for {h_pn, cv} <- Enum.zip(h_p, cs), do: h_pn * cv)
              y = if d, do: y + elem(d, d_at.(hi, pi)) * xv, else: y
              y = if z, do: gate(y, elem(z, at * p + pi)), else: y
              {at * p + pi, y}
            end

          {ys, h}
        end)
      end

    # ys are {index into y, value}; the final states come in [row, head] order already.
    y =
      results
      |> Enum.flat_map(&elem(&1, 0))
      |> List.flatten()
      |> Enum.sort()
      |> Enum.map(&elem(&1, 1))

    {y, results |> Enum.map(&elem(&1, 1)) |> List.flatten()}
  end

  # {batch row, first timestep, end} of each sequence: whole rows, or cu_seqlens' spans of row 0.
  defp sequences(inputs, batch, len) do
    case inputs[:cu_seqlens] do
      nil ->
        for bi <- 0..(batch - 1), do: {bi, 0, len}

      cu ->
        bounds = Tensor.to_list(cu)
        for [from, to] <- Enum.chunk_every(bounds, 2, 1, :discard), do: {0, from, to}
    end
  end

  defp h0_at(nil, _index), do: 0.0
  defp h0_at(h0, index), do: elem(h0, index)

  defp time_step(dt, bias, inputs) do
    dt = if bias, do: dt + bias, else: dt
    dt = if inputs[:dt_softplus], do: softplus(dt), else: dt
    {low, high} = dt_bounds(inputs)
    dt = if is_number(low), do: max(dt, low), else: dt
    if is_number(high), do: min(dt, high), else: dt
  end

  # dt_min/dt_max, or mamba_ssm's dt_limit: its default [0, inf] clamps nothing, and neither
  # does an infinite side (:neg_infinity, :infinity) of another pair.
  defp dt_bounds(inputs) do
    case inputs[:dt_limit] do
      nil -> {inputs[:dt_min], inputs[:dt_max]}
      [low, :infinity] when low == 0 -> {nil, nil}
      [low, high] -> {low, high}
    end
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
