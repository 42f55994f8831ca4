defmodule ScanBridge.Cluster.Member do
  @moduledoc false
  # A server's membership of a group: started (and linked) by a `ScanBridge.Server` started with
  # `group:`, it keeps the group's model catalogue for that server — the models
  # `ScanBridge.Cluster.load_model/4` loaded, by name, with where each came from — and puts the
  # server in the group once it holds them.
  #
  # No registry: each member keeps its own copy of the catalogue. A member joins the group's
  # catalogue keepers first, then copies every other keeper's catalogue and loads what it
  # lacks, and only then offers its server for work. `load_model/4` records a model on every
  # keeper it finds, then looks again until no new keeper has appeared, so that a member that
  # joined meanwhile either was found or copied a catalogue that already had the model.

  use GenServer
  require Logger

  alias ScanBridge.Cluster

  defstruct [:server, :group, :syncing, catalogue: %{}]

  @spec start_link(server: pid, group: term) :: GenServer.on_start()
  def start_link(opts), do: GenServer.start_link(__MODULE__, opts)

  @doc "The group's catalogue keepers (one per member)."
  @spec keepers(term) :: [pid]
  def keepers(group), do: :pg.get_members(Cluster.scope(), {:catalogue, group})

  @impl true
  def init(opts) do
    state = %__MODULE__{server: Keyword.fetch!(opts, :server), group: Keyword.fetch!(opts, :group)}
    :ok = :pg.join(Cluster.scope(), {:catalogue, state.group}, self())
    {:ok, state, {:continue, :sync}}
  end

  # The other keepers' catalogues are read by a task, so that this keeper answers theirs
  # meanwhile: two members starting together each asked the other from here, neither could
  # answer, and both waited out the call's timeout and joined without the other's catalogue.
  @impl true
  def handle_continue(:sync, state) do
    others = keepers(state.group) -- [self()]
    task = Task.async(fn -> Enum.flat_map(others, &catalogue_of/1) end)
    {:noreply, %{state | syncing: task.ref}}
  end

  @impl true
  def handle_info({ref, catalogues}, %{syncing: ref} = state) do
    Process.demonitor(ref, [:flush])

    state =
      Enum.reduce(catalogues, %{state | syncing: nil}, fn {name, {source, opts}}, state ->
        case adopt(state, name, source, opts) do
          {:ok, _info, state} ->
            state

          {:error, error, state} ->
            Logger.warning(
              "scan-bridge: #{inspect(state.group)} member on #{node()} cannot load model " <>
                "#{inspect(name)}: #{Exception.message(error)}"
            )

            state
        end
      end)

    :ok = :pg.join(Cluster.scope(), Cluster.group_key(state.group), state.server)
    {:noreply, state}
  end

  def handle_info(_stale, state), do: {:noreply, state}

  @impl true
  def handle_call(:catalogue, _from, state), do: {:reply, state.catalogue, state}

  def handle_call({:load, name, source, opts}, _from, state) do
    case adopt(state, name, source, opts) do
      {:ok, info, state} -> {:reply, {:ok, info}, state}
      {:error, error, state} -> {:reply, {:error, error}, state}
    end
  end

  def handle_call({:free, name, opts}, _from, state) do
    case Map.pop(state.catalogue, name) do
      {nil, _} ->
        {:reply, :ok, state}

      {{_source, _opts, nil}, catalogue} ->
        {:reply, :ok, %{state | catalogue: catalogue}}

      {{_source, _opts, info}, catalogue} ->
        case ScanBridge.free_model(state.server, info, opts) do
          :ok ->
            ScanBridge.Server.name_model(state.server, name, nil)
            {:reply, :ok, %{state | catalogue: catalogue}}

          {:error, _} = error ->
            {:reply, error, state}
        end
    end
  end

  # The model `name` on this member's server: recorded in the catalogue whether or not it
  # loads here (members joining later copy it), loaded unless it is already.
  defp adopt(state, name, source, opts) do
    case state.catalogue do
      %{^name => {^source, ^opts, info}} when info != nil ->
        {:ok, info, state}

      %{^name => {_other, _opts, info}} when info != nil ->
        error =
          ScanBridge.Error.client(
            :invalid_argument,
            "model name #{inspect(name)} is taken by another model in group #{inspect(state.group)}",
            %{"field" => "name"}
          )

        {:error, error, state}

      _absent_or_unloaded ->
        state = put_in(state.catalogue[name], {source, opts, nil})

        case ScanBridge.load_model(state.server, source, Keyword.put(opts, :name, name)) do
          {:ok, info} ->
            ScanBridge.Server.name_model(state.server, name, info["model"])
            {:ok, info, put_in(state.catalogue[name], {source, opts, info})}

          {:error, error} ->
            {:error, error, state}
        end
    end
  end

  defp catalogue_of(keeper) do
    keeper
    |> GenServer.call(:catalogue)
    |> Enum.map(fn {name, {source, opts, _info}} -> {name, {source, opts}} end)
  catch
    :exit, _gone -> []
  end
end
