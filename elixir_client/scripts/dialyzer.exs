# Dialyzer on the client's compiled modules (lib/ only), with OTP's own dialyzer (Debian package
# erlang-dialyzer): `mix dialyzer` (dialyxir) needs hex.pm, which is unreachable here.
#
#   mix run --no-start scripts/dialyzer.exs [--plt-dir DIR] [--ebin DIR]
#
# Exits 0 when dialyzer has nothing to say, 1 when it warns (each warning printed), 2 when it
# cannot run. Run it in the dev environment (the default): the test environment compiles
# test/support/ too, which is not the client. `--ebin` checks the beams of another directory
# instead of the client's (tests/test_elixir_dialyzer.py plants a faulty module there, to see
# that a warning fails the run).
#
# The PLT (what dialyzer knows of the code the client calls) holds only the modules the client
# refers to -- its remote calls, the remote types of its specs, its behaviours -- and, for the
# types to resolve, the modules their types and behaviours name in turn. Those modules' specs
# are what the client's calls are checked against, so this finds what a PLT of whole
# applications (erts, kernel, stdlib, elixir, logger) finds in the client, in seconds instead
# of minutes. It is cached under --plt-dir (default _build/dialyzer, git-ignored), named by the
# OTP and Elixir versions and the modules it holds: a client that calls a new module gets a new
# PLT, and an old one is removed then.
#
# Warnings beyond dialyzer's defaults: unknown functions and types, results left unmatched (a
# result that is dropped on purpose is bound to `_`), and specs that are wider or narrower than
# what the function returns.

defmodule ScanBridge.Dialyzer do
  @warnings [:unknown, :unmatched_returns, :extra_return, :missing_return]

  def main(argv) do
    {opts, rest, invalid} = OptionParser.parse(argv, strict: [plt_dir: :string, ebin: :string])

    if rest != [] or invalid != [] do
      fail!(
        "usage: mix run --no-start scripts/dialyzer.exs [--plt-dir DIR] [--ebin DIR]; " <>
          "got #{inspect(argv)}"
      )
    end

    unless Code.ensure_loaded?(:dialyzer) do
      fail!("dialyzer is not installed: apt-get install erlang-dialyzer (or `make system-deps`)")
    end

    project = Mix.Project.config()
    ebin = Path.expand(opts[:ebin] || Mix.Project.compile_path(project))

    # beside the environments' build directories (_build/dev, _build/test)
    default_plt_dir = Path.join(Path.dirname(Mix.Project.build_path(project)), "dialyzer")
    plt_dir = Path.expand(opts[:plt_dir] || default_plt_dir)

    beams = Path.wildcard(Path.join(ebin, "*.beam"))
    if beams == [], do: fail!("no compiled modules in #{ebin}: compile the client first")
    own = Enum.map(beams, &module_of/1)

    {plt_us, plt_modules} = :timer.tc(fn -> plt_modules(beams, own) end)
    {plt, built} = ensure_plt(plt_dir, plt_modules)

    IO.puts(
      "dialyzer: PLT #{Path.relative_to_cwd(plt)}: #{length(plt_modules)} modules " <>
        "(found in #{ms(plt_us)} ms#{built})"
    )

    {check_us, warnings} =
      :timer.tc(fn ->
        run!(
          analysis_type: :succ_typings,
          plts: [to_charlist(plt)],
          files: Enum.map(beams, &to_charlist/1),
          warnings: @warnings
        )
      end)

    Enum.each(warnings, &IO.puts(:dialyzer.format_warning(&1, filename_opt: :basename)))

    IO.puts(
      "dialyzer: #{length(own)} modules checked in #{ms(check_us)} ms: " <>
        "#{length(warnings)} warning(s) (#{Enum.map_join(@warnings, ", ", &"-W#{&1}")})"
    )

    if warnings != [], do: System.halt(1)
  end

  # The beams of the modules the client refers to, and of those their types and behaviours
  # name (one level: a type that names a module further on is taken as any type). A module with
  # no beam (optional, as Nx) stays out: the client's calls to it are reported by -Wunknown.
  defp plt_modules(beams, own) do
    own = MapSet.new(own)
    referred = beams |> Enum.map(&references(&1, :all)) |> union() |> MapSet.difference(own)
    direct = for module <- referred, beam = beam_of(module), into: %{}, do: {module, beam}

    typed =
      direct
      |> Map.values()
      |> Enum.map(&references(&1, :types))
      |> union()
      |> MapSet.difference(own)

    for(module <- typed, not is_map_key(direct, module), beam = beam_of(module), do: beam)
    |> Enum.concat(Map.values(direct))
    |> Enum.sort()
  end

  defp union(sets), do: Enum.reduce(sets, MapSet.new(), &MapSet.union/2)

  defp beam_of(module) do
    case :code.which(module) do
      :preloaded -> preloaded_beam(module)
      path when is_list(path) -> List.to_string(path)
      _non_existing -> nil
    end
  end

  # erlang, erts_internal, ...: loaded with the emulator, their beams are in erts' ebin.
  defp preloaded_beam(module) do
    path = Path.join([List.to_string(:code.lib_dir(:erts)), "ebin", "#{module}.beam"])
    if File.exists?(path), do: path
  end

  defp module_of(beam), do: beam |> Path.basename(".beam") |> String.to_atom()

  # The modules a beam's abstract code names: with :all its remote calls and function
  # captures too, with :types only its remote types and behaviours. A beam without debug
  # info names none (dialyzer cannot use it either).
  defp references(beam, which) do
    with {:ok, {module, [debug_info: {:debug_info_v1, backend, data}]}} <-
           :beam_lib.chunks(to_charlist(beam), [:debug_info]),
         {:ok, forms} <- backend.debug_info(:erlang_v1, module, data, []) do
      collect(forms, which, MapSet.new())
    else
      _ -> MapSet.new()
    end
  end

  defp collect({:remote_type, _, [{:atom, _, module}, _name, args]}, which, acc),
    do: collect(args, which, MapSet.put(acc, module))

  defp collect({:attribute, _, kind, module}, _which, acc)
       when kind in [:behaviour, :behavior] and is_atom(module),
       do: MapSet.put(acc, module)

  defp collect({:remote, _, {:atom, _, module}, _name}, :all, acc), do: MapSet.put(acc, module)

  defp collect({:function, {:atom, _, module}, _name, _arity}, :all, acc),
    do: MapSet.put(acc, module)

  defp collect(tuple, which, acc) when is_tuple(tuple),
    do: collect(Tuple.to_list(tuple), which, acc)

  defp collect([head | tail], which, acc), do: collect(tail, which, collect(head, which, acc))
  defp collect(_leaf, _which, acc), do: acc

  # The PLT for these modules, built unless the cached one is there; dialyzer's analysis checks
  # it against the beams (and updates it) when they have changed since.
  defp ensure_plt(dir, modules) do
    key = :erlang.phash2({System.otp_release(), System.version(), modules})
    plt = Path.join(dir, "otp#{System.otp_release()}-elixir#{System.version()}-#{key}.plt")

    if File.exists?(plt) do
      {plt, ", cached"}
    else
      File.mkdir_p!(dir)
      partial = plt <> ".building"

      {build_us, _warnings} =
        :timer.tc(fn ->
          run!(
            analysis_type: :plt_build,
            files: Enum.map(modules, &to_charlist/1),
            output_plt: to_charlist(partial),
            warnings: []
          )
        end)

      # another version's (or module set's) PLT is stale once this one exists
      for old <- Path.wildcard(Path.join(dir, "*.plt")), do: File.rm(old)
      File.rename!(partial, plt)
      {plt, ", built in #{ms(build_us)} ms"}
    end
  end

  defp run!(options) do
    :dialyzer.run(options)
  catch
    {:dialyzer_error, message} -> fail!("dialyzer: #{message}")
  end

  defp ms(us), do: div(us, 1000)

  defp fail!(message) do
    IO.puts(:stderr, message)
    System.halt(2)
  end
end

ScanBridge.Dialyzer.main(System.argv())
