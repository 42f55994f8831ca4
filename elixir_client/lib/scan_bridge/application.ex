defmodule ScanBridge.Application do
  @moduledoc false
  # What every node that runs scan-bridge clients or routes to them needs: the `:pg` scope the
  # servers of a group join (`ScanBridge.Cluster`), this node's balancer, what this node's
  # members held of their groups' catalogues, and the supervisor of the cluster sessions opened
  # from this node.

  use Application

  # Modules that only failure paths run: a client whose server died builds its error, and a
  # cluster session's call to that client's gone process names it. In interactive mode (mix,
  # iex) a module is loaded when first called: loaded then, on a busy machine, they held a dying
  # client's exit, and so a cluster session's failover, by tens of milliseconds
  # (docs/performance.md, "failure path preload"). A module this Elixir version lacks is one
  # its failure paths do not use.
  @failure_path_modules [
    Code.Identifier,
    File,
    IO,
    Inspect,
    Inspect.Algebra,
    Inspect.Atom,
    Inspect.BitString,
    Inspect.Integer,
    Inspect.List,
    Inspect.Opts,
    Inspect.PID,
    Inspect.Tuple,
    Macro,
    String.Chars,
    String.Chars.Atom,
    String.Chars.BitString,
    String.Chars.Integer,
    :elixir_utils
  ]

  @impl true
  def start(_type, _args) do
    # the client's own modules too: a healthy client never touches ScanBridge.Error, say
    _ =
      :code.ensure_modules_loaded(Application.spec(:scan_bridge, :modules) ++ @failure_path_modules)

    children = [
      %{id: :pg, start: {:pg, :start_link, [ScanBridge.Cluster.scope()]}},
      ScanBridge.Cluster.Balancer,
      ScanBridge.Cluster.NodeCatalogue,
      {DynamicSupervisor, name: ScanBridge.Cluster.Sessions, strategy: :one_for_one}
    ]

    Supervisor.start_link(children, strategy: :one_for_one, name: ScanBridge.Supervisor)
  end
end
