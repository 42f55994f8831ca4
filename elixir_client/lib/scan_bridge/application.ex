defmodule ScanBridge.Application do
  @moduledoc false
  # What every node that runs scan-bridge clients or routes to them needs: the `:pg` scope the
  # servers of a group join (`ScanBridge.Cluster`), this node's balancer, and the supervisor of
  # the cluster sessions opened from this node.

  use Application

  @impl true
  def start(_type, _args) do
    children = [
      %{id: :pg, start: {:pg, :start_link, [ScanBridge.Cluster.scope()]}},
      ScanBridge.Cluster.Balancer,
      {DynamicSupervisor, name: ScanBridge.Cluster.Sessions, strategy: :one_for_one}
    ]

    Supervisor.start_link(children, strategy: :one_for_one, name: ScanBridge.Supervisor)
  end
end
