defmodule ScanBridge.Cluster.NodeCatalogue do
  @moduledoc false
  # The group catalogues this node's catalogue keepers (ScanBridge.Cluster.Member) held, the
  # newest entry of each name: a member that starts here with no other keeper of its group left
  # (the group's only member, restarted by its supervisor) takes the group's models from here,
  # as it would from another keeper; a group stopped on purpose is forgotten. A keeper lives and
  # dies with its server, this process with the node. One per node, started by the application; written by the keepers' casts, read
  # without a message.

  use GenServer

  alias ScanBridge.Unexpected

  @table __MODULE__

  @spec start_link(term) :: GenServer.on_start()
  def start_link(_opts), do: GenServer.start_link(__MODULE__, :ok, name: __MODULE__)

  @doc "Records a keeper's versioned catalogue of `group` (name => {entry, version})."
  @spec remember(term, map) :: :ok
  def remember(group, entries), do: GenServer.cast(__MODULE__, {:remember, group, entries})

  @doc "Forgets what this node's keepers of `group` held (the group was stopped on purpose)."
  @spec forget(term) :: :ok
  def forget(group), do: GenServer.cast(__MODULE__, {:forget, group})

  @doc "The newest entry of each name this node's keepers of `group` held."
  @spec recall(term) :: map
  def recall(group) do
    case :ets.lookup(@table, group) do
      [{_group, entries}] -> entries
      [] -> %{}
    end
  rescue
    # no table: this process is restarting, and remembers nothing
    ArgumentError -> %{}
  end

  @impl true
  def init(:ok) do
    @table = :ets.new(@table, [:named_table, :protected, read_concurrency: true])
    {:ok, nil}
  end

  @impl true
  def handle_cast({:remember, group, entries}, state) do
    newest =
      Map.merge(recall(group), entries, fn _name, {_, kept} = old, {_, version} = new ->
        if version > kept, do: new, else: old
      end)

    :ets.insert(@table, {group, newest})
    {:noreply, state}
  end

  def handle_cast({:forget, group}, state) do
    :ets.delete(@table, group)
    {:noreply, state}
  end

  def handle_cast(request, state) do
    Unexpected.cast(__MODULE__, request)
    {:noreply, state}
  end

  @impl true
  def handle_call(request, _from, state), do: {:reply, Unexpected.call(__MODULE__, request), state}
end
