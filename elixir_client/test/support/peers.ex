defmodule ScanBridge.TestSupport.Peers do
  @moduledoc false
  # Multi-node tests: `:peer` nodes on 127.0.0.1, each running scan-bridge clients (and so
  # their own `python -m bridge` servers), which a test then crashes, stops, freezes and
  # thaws. Everything a test starts here is cleaned up when the test (or, from `setup_all`,
  # the module) ends: frozen peers are thawed, peers stopped, and the servers of a stopped
  # peer are checked, by OS pid, to have exited on their stdin's EOF (killed, and the test
  # failed, when they have not).
  #
  # A peer is `%{node: node, peer: controller_pid, os_pid: the peer BEAM's OS pid}`.
  #
  # On OS pids: a peer BEAM runs detached, so it and the servers it spawned are re-parented
  # to PID 1 when it exits, and PID 1 may not reap them (it does not in the sandboxes these
  # tests run in). An exited process can then stay a zombie ("Z") with a /proc entry; that
  # counts as gone here (`os_alive?/1`), unlike `ScanBridge.TestSupport.os_process_gone?/1`.

  import ExUnit.Assertions
  alias ScanBridge.TestSupport

  # The environment variable tests/process_runs.py marks the processes of a run with, to find
  # those that outlive it. epmd is a machine-wide daemon that outlives every run by design:
  # started here, it is started without the marker.
  @run_marker "SCAN_BRIDGE_TEST_RUN"
  @registry __MODULE__.Registry
  # How long a server gets to exit after its peer is gone (it exits on its stdin's EOF, in
  # well under a second; one still starting up does once it is ready).
  @server_exit_ms 10_000

  ## Distribution

  @doc """
  Makes this node distributed (longnames, on 127.0.0.1), starting epmd first if it is not
  running; a no-op when it already is. Raises when that cannot be done, or when this node
  runs with short names (`mix test --sname`), which cannot reach 127.0.0.1 peers.
  """
  def ensure_distributed! do
    if Node.alive?() do
      unless :net_kernel.longnames() == true do
        raise "this node (#{node()}) runs with short names; the multi-node tests need long " <>
                "names on 127.0.0.1: run `mix test` without --sname (or with --name x@127.0.0.1)"
      end
    else
      ensure_epmd!()
      name = :"scan_bridge_test_#{System.pid()}_#{System.unique_integer([:positive])}@127.0.0.1"

      case Node.start(name, :longnames) do
        {:ok, _pid} ->
          :ok

        {:error, {:already_started, _pid}} ->
          :ok

        {:error, reason} ->
          raise "cannot make this node distributed as #{name}: #{inspect(reason)} (epmd runs; " <>
                  "is ~/.erlang.cookie readable, or can it be created?)"
      end
    end

    :ok
  end

  defp ensure_epmd! do
    unless epmd_up?() do
      epmd =
        System.find_executable("epmd") ||
          Path.join([:code.root_dir(), "erts-#{:erlang.system_info(:version)}", "bin", "epmd"])

      case System.cmd(epmd, ["-daemon"], env: [{@run_marker, nil}], stderr_to_stdout: true) do
        {_, 0} -> :ok
        {out, status} -> raise "cannot start epmd (#{epmd} -daemon exited #{status}): #{out}"
      end

      unless TestSupport.eventually(&epmd_up?/0, 5_000) do
        raise "epmd (#{epmd} -daemon) started but does not answer on 127.0.0.1"
      end
    end
  end

  defp epmd_up?, do: match?({:ok, _}, :erl_epmd.names(~c"127.0.0.1"))

  ## Peers

  @doc """
  Starts a peer node named `<name_prefix>_<unique>@127.0.0.1` with this node's cookie, net
  tick time and code paths, the same server environment as the local tests
  (SCAN_BRIDGE_PYTHON, PYTHONPATH, SCAN_BRIDGE_LOG), and the :logger, :elixir and
  :scan_bridge applications started. Not linked to the caller: stopping it (`stop_peer/1`)
  or its going down does not touch the test. Stopped, with its servers checked gone, when
  the calling test (or module, from `setup_all`) ends.

  Options: `:args`, more `erl` arguments (strings); `:cut_off`, true for a peer controlled over
  its standard I/O rather than the distribution, so that `cut_off/1` can disconnect it and it
  lives on.
  """
  def start_peer!(name_prefix, opts \\ []) do
    launch!(name_prefix, opts, fn peer -> ExUnit.Callbacks.on_exit(fn -> cleanup!(peer) end) end)
  end

  @doc """
  `start_peer!/2` without ExUnit: `started.(peer)` is called as soon as the peer's OS pid is
  known, before anything that may fail, for the caller to register its own cleanup (a
  benchmark's, say).
  """
  def launch!(name_prefix, opts, started) do
    ensure_distributed!()
    ensure_registry()
    name = "#{name_prefix}_#{System.pid()}_#{System.unique_integer([:positive])}"
    env = server_env()

    args =
      ["-setcookie", Atom.to_string(Node.get_cookie())] ++
        ["-kernel", "net_ticktime", Integer.to_string(:net_kernel.get_net_ticktime())] ++
        Keyword.get(opts, :args, [])

    control = if Keyword.get(opts, :cut_off, false), do: %{connection: :standard_io}, else: %{}

    {:ok, pid, node} =
      :peer.start(
        Map.merge(control, %{
          name: String.to_charlist(name),
          host: ~c"127.0.0.1",
          longnames: true,
          args: Enum.map(args, &String.to_charlist/1),
          env: Enum.map(env, fn {k, v} -> {String.to_charlist(k), String.to_charlist(v)} end)
        })
      )

    os_pid = :erpc.call(node, :os, :getpid, [], 10_000) |> List.to_integer()
    peer = %{node: node, peer: pid, os_pid: os_pid}
    started.(peer)

    :ok = :erpc.call(node, :code, :add_pathsa, [Enum.reverse(:code.get_path())], 10_000)
    Enum.each(env, fn {k, v} -> :ok = :erpc.call(node, System, :put_env, [k, v], 10_000) end)

    for app <- [:logger, :elixir, :scan_bridge] do
      case :erpc.call(node, Application, :ensure_all_started, [app], 30_000) do
        {:ok, _} -> :ok
        {:error, reason} -> flunk("cannot start #{app} on #{node}: #{inspect(reason)}")
      end
    end

    peer
  end

  # What test_helper.exs sets for the local tests, from this node's environment.
  defp server_env do
    [
      {"SCAN_BRIDGE_PYTHON", System.get_env("SCAN_BRIDGE_PYTHON") || TestSupport.python()},
      {"PYTHONPATH", System.get_env("PYTHONPATH") || TestSupport.repo_root()},
      {"SCAN_BRIDGE_LOG", System.get_env("SCAN_BRIDGE_LOG", "WARNING")}
    ]
  end

  @doc """
  Stops the peer's node (`:peer.stop/1`: `erlang:halt/0` there) and returns once its BEAM is
  gone. Its servers then exit on their stdin's EOF: `await_gone/2` their OS pids
  (`server_os_pids/1`) to check. A no-op for a peer already stopped.
  """
  def stop_peer(%{peer: pid, os_pid: os_pid}) do
    try do
      :peer.stop(pid)
    catch
      # already stopped, or its node went down (the controller then stops by itself)
      :exit, _ -> :ok
    end

    assert await_gone([os_pid], 5_000) == [], "peer BEAM #{os_pid} still running after :peer.stop"
    :ok
  end

  @doc "Waits (20 s at most) until `group` has `n` members, and fails the test if it does not."
  def await_members(group, n) do
    assert TestSupport.eventually(fn -> length(ScanBridge.Cluster.members(group)) == n end, 20_000),
           "#{inspect(group)} has #{length(ScanBridge.Cluster.members(group))} members, expected #{n}"
  end

  @doc """
  Disconnects this node from a peer started with `cut_off: true`, a partition both nodes see at
  once (`:nodedown`), and returns once it is done; `reconnect/1` ends it.
  """
  def cut_off(%{node: node}) do
    true = Node.disconnect(node)
    assert TestSupport.eventually(fn -> node not in Node.list() end, 5_000)
    :ok
  end

  @doc "Connects this node to a peer `cut_off/1` disconnected."
  def reconnect(%{node: node}) do
    true = Node.connect(node)
    :ok
  end

  @doc """
  Freezes the peer's BEAM (SIGSTOP, all its threads), a partition: its connections stay up
  but nothing on it answers. Call it from the test process: the peer is thawed when the test
  ends, whatever happens. Calls to a frozen node wait: GenServer calls into a client there
  (whose own deadlines run on that node) until the distribution tick time notices
  (net_ticktime, 60 s by default), so give them a timeout of your own (a Task).
  """
  def freeze_peer(%{os_pid: os_pid}), do: TestSupport.freeze(os_pid)

  @doc "Thaws a peer frozen by `freeze_peer/1` (SIGCONT)."
  def thaw_peer(%{os_pid: os_pid}), do: TestSupport.thaw(os_pid)

  ## Callers on peers

  @doc """
  Starts a process on the peer that makes calls for the test (`call_from/4`) and lives on
  between them, as a caller on another node does after a call it gave up on (`:erpc`'s own
  process exits with its call, which a client it called sees).
  """
  def start_caller!(%{node: node}),
    do: :erpc.call(node, :erlang, :spawn, [__MODULE__, :caller_loop, []], 10_000)

  @doc "What `apply(module, fun, args)` returns in `caller` (`start_caller!/1`)."
  def call_from(caller, module, fun, args) do
    ref = make_ref()
    send(caller, {:apply, self(), ref, module, fun, args})

    receive do
      {^ref, result} -> result
    after
      30_000 -> flunk("#{inspect(caller)} did not return from #{inspect(module)}.#{fun}")
    end
  end

  @doc false
  def caller_loop do
    receive do
      {:apply, test, ref, module, fun, args} ->
        send(test, {ref, apply(module, fun, args)})
        caller_loop()
    end
  end

  ## Servers on peers

  @doc """
  Starts a `ScanBridge` client on the peer with `ScanBridge.TestSupport.server_opts(opts)`,
  which spawns its server there; returns the client's (remote) pid. The client is linked to
  nothing: it lives until its server dies, it is stopped, or its node goes.
  """
  def start_server!(%{node: node}, opts \\ []) do
    server_opts = TestSupport.server_opts(opts)

    start = fn ->
      case ScanBridge.start_link(server_opts) do
        {:ok, pid} ->
          Process.unlink(pid)
          {:ok, pid}

        other ->
          other
      end
    end

    # a client whose start fails exits, and the caller linked to it (erpc's process) with it
    result =
      try do
        :erpc.call(node, start, 120_000)
      catch
        kind, reason -> {kind, reason}
      end

    case result do
      {:ok, client} ->
        {:ok, os_pid} = ScanBridge.os_pid(client)
        Agent.update(@registry, &Map.update(&1, node, [os_pid], fn pids -> [os_pid | pids] end))
        client

      other ->
        flunk("cannot start a scan-bridge client on #{node}: #{inspect(other)}")
    end
  end

  @doc """
  `start_server!/2` on each peer of `peers` at once (a server takes seconds to start, mostly
  its imports); returns the clients in the order of `peers`, which may repeat a peer.
  """
  def start_servers!(peers, opts \\ []) do
    peers
    |> Task.async_stream(&start_server!(&1, opts), timeout: 150_000, ordered: true)
    |> Enum.map(fn {:ok, client} -> client end)
  end

  @doc "`ScanBridge.os_pid/1` of a client (local or remote)."
  def server_os_pid(client), do: ScanBridge.os_pid(client)

  @doc "The OS pids of every server `start_server!/2` started on the peer, newest first."
  def server_os_pids(%{node: node}), do: Agent.get(@registry, &Map.get(&1, node, []))

  @doc """
  Kills the client's server with SIGKILL, as a crash would, and returns once that OS process
  is gone. The client process then exits (`{:shutdown, {:server_exited, _}}`).
  """
  def kill_server!(client) do
    {:ok, os_pid} = ScanBridge.os_pid(client)
    TestSupport.kill!(os_pid)
    assert await_gone([os_pid], 5_000) == [], "server #{os_pid} still running after SIGKILL"
    :ok
  end

  ## OS processes

  @doc "Whether the OS process runs (Linux /proc): false once it exited, zombie or not."
  def os_alive?(os_pid) do
    case File.read("/proc/#{os_pid}/stat") do
      # the state follows the parenthesised command name, which may contain spaces
      {:ok, stat} ->
        not (stat |> String.split(") ") |> List.last() |> String.starts_with?(["Z", "X"]))

      {:error, _} ->
        false
    end
  end

  @doc "Waits up to `ms` for the OS processes to be gone; returns those still alive."
  def await_gone(os_pids, ms) do
    TestSupport.eventually(fn -> not Enum.any?(os_pids, &os_alive?/1) end, ms)
    Enum.filter(os_pids, &os_alive?/1)
  end

  ## Cleanup

  # Thaw (a frozen BEAM would never read its connection's close), stop, then check that the
  # peer's BEAM and every server it ran are gone: SIGKILL to those that are not, and a
  # failure naming them.
  defp cleanup!(%{node: node, os_pid: os_pid} = peer) do
    System.cmd("kill", ["-CONT", Integer.to_string(os_pid)], stderr_to_stdout: true)
    beam_left = safe_stop(peer)
    servers = Agent.get(@registry, &Map.get(&1, node, []))
    servers_left = await_gone(servers, @server_exit_ms)
    Agent.update(@registry, &Map.delete(&1, node))
    Enum.each(beam_left ++ servers_left, &System.cmd("kill", ["-KILL", Integer.to_string(&1)]))

    if beam_left != [] or servers_left != [] do
      raise "peer #{node} left OS processes running (killed now): BEAM #{inspect(beam_left)}, " <>
              "servers #{inspect(servers_left)}"
    end
  end

  defp safe_stop(%{peer: pid, os_pid: os_pid}) do
    try do
      :peer.stop(pid)
    catch
      :exit, _ -> :ok
    end

    if os_pid, do: await_gone([os_pid], 5_000), else: []
  end

  # OS pids of the servers started on each peer node, for the cleanup: kept by a process
  # that outlives the tests (the on_exit callbacks run after the test process is gone).
  defp ensure_registry do
    case Agent.start(fn -> %{} end, name: @registry) do
      {:ok, _} -> :ok
      {:error, {:already_started, _}} -> :ok
    end
  end
end
