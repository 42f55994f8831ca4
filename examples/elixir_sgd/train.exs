# Fitting a selective SSM's A, D and dt_bias by SGD, with the scan and its gradients on a
# scan-bridge server (protocol/SPEC.md §6 `scan`, §6.5 `scan_backward`).
#
#   cd elixir_client && mix run ../examples/elixir_sgd/train.exs [options]
#
# It starts the server as a Port (through the client library) and draws fixed inputs x, dt, B, C
# (batch 1, seq 32, dim 4, state 4; dt through softplus after dt_bias). A teacher's A*, D*,
# dt_bias* give the target y* (one `scan`). A student starts from other values (A = -[1..4] on
# each row, D = 0, dt_bias = 0) and takes SGD steps on the loss mean((y - y*)^2): each step one
# `scan` for y and the loss, one `scan_backward` with dy = 2 (y - y*) / numel for dA, dD,
# ddt_bias, then the update. A is kept negative as Mamba keeps it: the student's parameter is
# A_log, A = -exp(A_log), so dA_log = dA * A. The arithmetic is plain Elixir lists (no Nx).
# At the end it prints the initial and final loss and exits 0 only when the loss went down (1
# when it did not, or diverged: a smaller --lr; 2 for bad options).
#
# Options (defaults in brackets):
#   --steps N           SGD steps [200]
#   --lr X              learning rate [4.0]
#   --seed N            seed of the inputs and the teacher [1]
#   --every N           print the loss every N steps (and at the first and last) [10]
#   --device auto|cpu|cuda  the server's device [auto]
#   --python PATH       the server's interpreter [$PYTHON, $SCAN_BRIDGE_PYTHON, the repository's
#                       .venv/bin/python, python3]

defmodule SgdExample do
  alias ScanBridge.Tensor

  @repo_root Path.expand("../..", __DIR__)

  @switches [
    steps: :integer,
    lr: :float,
    seed: :integer,
    every: :integer,
    device: :string,
    python: :string
  ]
  @defaults [steps: 200, lr: 4.0, seed: 1, every: 10, device: "auto"]

  @batch 1
  @seq 32
  @dim 4
  @state 4

  def main(argv) do
    opts = options!(argv)
    :rand.seed(:exsss, {opts[:seed], 41, 43})
    {:ok, server} = ScanBridge.start_link(server_options(opts))

    {initial, final} =
      try do
        run(server, opts)
      after
        GenServer.stop(server)
      end

    IO.puts("initial loss: #{num(initial)}")

    case final do
      {:diverged, step} ->
        IO.puts("final loss: nan (diverged at step #{step}; try a smaller --lr)")
        System.halt(1)

      final ->
        IO.puts("final loss: #{num(final)}")

        unless final < initial do
          IO.puts(:stderr, "sgd: the loss did not go down")
          System.halt(1)
        end
    end
  end

  defp run(server, opts) do
    per_dim = @batch * @seq * @dim
    per_state = @batch * @seq * @state

    fixed = %{
      x: f32(uniform(per_dim, -1.0, 1.0), {@batch, @seq, @dim}),
      dt: f32(uniform(per_dim, -1.0, 1.0), {@batch, @seq, @dim}),
      B: f32(uniform(per_state, -1.0, 1.0), {@batch, @seq, @state}),
      C: f32(uniform(per_state, -1.0, 1.0), {@batch, @seq, @state}),
      dt_softplus: true
    }

    # The teacher: A* = -exp(A_log*) with A_log* in [log 0.5, log 3], D* in [0.5, 1.5],
    # dt_bias* in [-1, 0.5].
    teacher = %{
      a_log: uniform(@dim * @state, :math.log(0.5), :math.log(3.0)),
      d: uniform(@dim, 0.5, 1.5),
      dt_bias: uniform(@dim, -1.0, 0.5)
    }

    target = forward(server, fixed, teacher)

    # The student: A = -[1, 2, .., state] on every row (S4D-real), D = 0, dt_bias = 0.
    student = %{
      a_log: for(_ <- 1..@dim, n <- 1..@state, do: :math.log(n)),
      d: List.duplicate(0.0, @dim),
      dt_bias: List.duplicate(0.0, @dim)
    }

    IO.puts(
      "fitting A [#{@dim}, #{@state}], D [#{@dim}], dt_bias [#{@dim}] of a selective scan " <>
        "(batch #{@batch}, seq #{@seq}, dim #{@dim}, state #{@state}, dt_softplus) by SGD: " <>
        "#{opts[:steps]} steps, lr #{opts[:lr]}, seed #{opts[:seed]}"
    )

    {initial, _} = loss(forward(server, fixed, student), target)

    outcome =
      Enum.reduce_while(1..opts[:steps]//1, student, fn step, params ->
        case step(server, fixed, target, params, opts[:lr]) do
          {:ok, loss, params} ->
            if step == 1 or step == opts[:steps] or rem(step, opts[:every]) == 0,
              do: IO.puts("step #{step}: loss #{num(loss)}")

            {:cont, params}

          :diverged ->
            IO.puts("step #{step}: loss diverged")
            {:halt, {:diverged, step}}
        end
      end)

    case outcome do
      {:diverged, _step} ->
        {initial, outcome}

      student ->
        {final, _} = loss(forward(server, fixed, student), target)

        IO.puts(
          "distance to the teacher: A #{num(distance(a_of(student.a_log), a_of(teacher.a_log)))}, " <>
            "D #{num(distance(student.d, teacher.d))}, " <>
            "dt_bias #{num(distance(student.dt_bias, teacher.dt_bias))} (max abs)"
        )

        {initial, final}
    end
  end

  # One SGD step: the loss at `params` and the parameters after it, or :diverged when y, a
  # gradient or A_log (past exp's range, and f32's) is no longer finite.
  defp step(server, fixed, target, params, lr) do
    with y = forward(server, fixed, params),
         true <- finite?(y),
         {loss, dy} = loss(y, target),
         inputs = fixed |> Map.merge(wire(params)) |> Map.put(:dy, f32(dy, {@batch, @seq, @dim})),
         %{dA: da, dD: dd, ddt_bias: dbias} = ScanBridge.scan_backward!(server, inputs),
         [da, dd, dbias] = Enum.map([da, dd, dbias], &Tensor.to_list/1),
         true <- Enum.all?([da, dd, dbias], &finite?/1),
         # A = -exp(A_log): dA_log = dA * dA/dA_log = dA * A
         da_log = zip(da, a_of(params.a_log), &(&1 * &2)),
         a_log = sgd(params.a_log, da_log, lr),
         true <- Enum.all?(a_log, &(&1 < 80.0)) do
      {:ok, loss,
       %{a_log: a_log, d: sgd(params.d, dd, lr), dt_bias: sgd(params.dt_bias, dbias, lr)}}
    else
      false -> :diverged
    end
  end

  # Every value a float: to_list/1 gives :nan, :infinity, :neg_infinity for the others.
  defp finite?(values), do: Enum.all?(values, &is_float/1)

  # y (a flat list) of the scan of the fixed inputs with `params`.
  defp forward(server, fixed, params) do
    %{y: y} = ScanBridge.scan!(server, Map.merge(fixed, wire(params)))
    Tensor.to_list(y)
  end

  defp wire(%{a_log: a_log, d: d, dt_bias: dt_bias}) do
    %{A: f32(a_of(a_log), {@dim, @state}), D: f32(d, {@dim}), dt_bias: f32(dt_bias, {@dim})}
  end

  # mean((y - y*)^2) and its gradient with respect to y, 2 (y - y*) / numel.
  defp loss(y, target) do
    n = length(y)
    residual = zip(y, target, &(&1 - &2))
    {Enum.reduce(residual, 0.0, &(&1 * &1 + &2)) / n, Enum.map(residual, &(2 * &1 / n))}
  end

  defp a_of(a_log), do: Enum.map(a_log, &(-:math.exp(&1)))
  defp sgd(params, grads, lr), do: zip(params, grads, &(&1 - lr * &2))
  defp zip(a, b, fun), do: Enum.zip_with(a, b, fun)
  defp distance(a, b), do: a |> zip(b, &abs(&1 - &2)) |> Enum.max()

  defp uniform(count, lo, hi), do: for(_ <- 1..count, do: lo + (hi - lo) * :rand.uniform_real())

  defp f32(values, shape), do: Tensor.from_list(values, :f32, shape)
  defp num(x), do: :erlang.float_to_binary(x, [{:scientific, 6}])

  ## Options and the server

  defp options!(argv) do
    {parsed, rest, invalid} = OptionParser.parse(argv, strict: @switches)

    case invalid do
      [] -> :ok
      [{name, nil} | _] -> usage!("#{name}: an unknown option, or one without its value")
      [{name, value} | _] -> usage!("#{name}: not a valid value: #{inspect(value)}")
    end

    if rest != [], do: usage!("unexpected arguments #{inspect(rest)}")
    opts = Keyword.merge(@defaults, parsed)

    for key <- [:steps, :every],
        not (is_integer(opts[key]) and opts[key] > 0),
        do: usage!("--#{key}: expected a positive integer")

    unless opts[:lr] > 0, do: usage!("--lr: expected a positive number")
    opts
  end

  defp usage!(message) do
    IO.puts(:stderr, "sgd: #{message}")

    IO.puts(
      :stderr,
      "usage: mix run ../examples/elixir_sgd/train.exs [--steps N] [--lr X] [--seed N] " <>
        "[--every N] [--device auto|cpu|cuda] [--python PATH]"
    )

    System.halt(2)
  end

  defp server_options(opts) do
    # this checkout's server first (and no empty entry, which would add the working directory)
    python_path =
      Enum.join([@repo_root | String.split(System.get_env("PYTHONPATH", ""), ":", trim: true)], ":")

    [
      python: python(opts),
      args: ["--device", opts[:device]],
      env: [
        {"PYTHONPATH", python_path},
        {"SCAN_BRIDGE_LOG", System.get_env("SCAN_BRIDGE_LOG", "WARNING")}
      ]
    ]
  end

  defp python(opts) do
    venv = Path.join(@repo_root, ".venv/bin/python")

    opts[:python] || System.get_env("PYTHON") || System.get_env("SCAN_BRIDGE_PYTHON") ||
      if(File.exists?(venv), do: venv, else: System.find_executable("python3"))
  end
end

SgdExample.main(System.argv())
