defmodule ScanBridge.Cluster.Member do
  @moduledoc false
  # A server's membership of a group: started (and linked) by a `ScanBridge.Server` started with
  # `group:`, it stops when that server stops, whatever the reason (it watches it: a link
  # passes on no :normal exit), and keeps the group's model catalogue for that server — the models
  # `ScanBridge.Cluster.load_model/4` loaded, by name, with where each came from — and puts the
  # server in the group once it holds them.
  #
  # No registry: each member keeps its own copy of the catalogue. A member joins the group's
  # catalogue keepers first, then copies every other keeper's catalogue and loads what it
  # lacks, and only then offers its server for work. `load_model/4` records a model on every
  # keeper it finds, then looks again until no new keeper has appeared, so that a member that
  # joined meanwhile either was found or copied a catalogue that already had the model.
  #
  # `load_model/4` first claims the name for its model on every keeper, one after another, in
  # one order for every caller: a claim holds the name against other models until that
  # caller's load reaches the keeper (which then records the model), its release, or its end.
  # So of two loads of different models under one name at once, the one the first keeper
  # claims for goes on, and the other is refused there and loads nothing anywhere.
  #
  # A model loads in a task, so that the keeper answers the others meanwhile (a load can take
  # seconds; a member joining would have waited out its call and joined without this keeper's
  # catalogue). Callers asking for a model already loading wait for that load; a free of it
  # waits for it to end.

  use GenServer
  require Logger

  alias ScanBridge.Cluster

  # loads: the models loading, by name: %{ref:, source:, opts:, waiters:} (callers, `:sync`,
  # or `{:free, caller, opts}`); claims: {name, caller} => {model, monitor of the caller};
  # sync_left: the loads the join waits for.
  defstruct [:server, :group, :syncing, catalogue: %{}, loads: %{}, claims: %{}, sync_left: 0]

  @spec start_link(server: pid, group: term) :: GenServer.on_start()
  def start_link(opts), do: GenServer.start_link(__MODULE__, opts)

  @doc "The group's catalogue keepers (one per member)."
  @spec keepers(term) :: [pid]
  def keepers(group), do: :pg.get_members(Cluster.scope(), {:catalogue, group})

  @impl true
  def init(opts) do
    state = %__MODULE__{server: Keyword.fetch!(opts, :server), group: Keyword.fetch!(opts, :group)}
    # a keeper left behind would answer loads and frees for a server that is gone
    _monitor = Process.monitor(state.server)
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
        case adopt(state, name, source, opts, :sync) do
          {:done, reply, state} -> answer(state, :sync, name, reply)
          {:waiting, state} -> %{state | sync_left: state.sync_left + 1}
        end
      end)

    {:noreply, join_when_synced(state)}
  end

  def handle_info({ref, result}, state) when is_reference(ref) do
    case Enum.find(state.loads, fn {_name, load} -> load.ref == ref end) do
      nil ->
        {:noreply, state}

      {name, load} ->
        Process.demonitor(ref, [:flush])
        {:noreply, loaded(%{state | loads: Map.delete(state.loads, name)}, name, load, result)}
    end
  end

  # Its server stopped (GenServer.stop's :normal included): this keeper goes too, and a load in
  # progress with it.
  def handle_info({:DOWN, _monitor, :process, server, _reason}, %{server: server} = state),
    do: {:stop, :shutdown, state}

  # A caller that ended (or whose node was cut off) without loading or releasing its claim.
  def handle_info({:DOWN, monitor, :process, caller, _reason}, state) do
    case Enum.find(state.claims, fn {{_name, by}, {_model, m}} -> {by, m} == {caller, monitor} end) do
      {key, _claim} -> {:noreply, %{state | claims: Map.delete(state.claims, key)}}
      nil -> {:noreply, state}
    end
  end

  def handle_info(_stale, state), do: {:noreply, state}

  @impl true
  def handle_call(:catalogue, _from, state), do: {:reply, state.catalogue, state}

  # A load refuses a name another caller claimed for another model; it ends the caller's own
  # claim, as the catalogue records the model from here.
  def handle_call({:load, name, source, opts}, {caller, _tag} = from, state) do
    state = release(state, name, caller)

    if claimed_otherwise?(state, name, model(source, opts)) do
      {:reply, {:error, taken(state, name, :claimed)}, state}
    else
      case adopt(state, name, source, opts, from) do
        {:done, reply, state} -> {:reply, reply, state}
        {:waiting, state} -> {:noreply, state}
      end
    end
  end

  # Claims `name` for this model for the caller, if no other model is loaded, loading or
  # recorded under it here, nor claimed by another caller.
  def handle_call({:claim, name, source, opts}, {caller, _tag}, state) do
    model = model(source, opts)

    cond do
      held(state, name) not in [nil, model] ->
        {:reply, {:error, taken(state, name, :held)}, state}

      claimed_otherwise?(state, name, model) ->
        {:reply, {:error, taken(state, name, :claimed)}, state}

      is_map_key(state.claims, {name, caller}) ->
        {:reply, :ok, state}

      true ->
        claim = {model, Process.monitor(caller)}
        {:reply, :ok, put_in(state.claims[{name, caller}], claim)}
    end
  end

  def handle_call({:free, name, opts}, from, state) do
    case state.loads do
      %{^name => load} ->
        {:noreply,
         put_in(state.loads[name], %{load | waiters: [{:free, from, opts} | load.waiters]})}

      _idle ->
        {reply, state} = free(state, name, opts)
        {:reply, reply, state}
    end
  end

  @impl true
  def handle_cast({:release, name, caller}, state), do: {:noreply, release(state, name, caller)}

  defp release(state, name, caller) do
    case Map.pop(state.claims, {name, caller}) do
      {nil, _claims} ->
        state

      {{_model, monitor}, claims} ->
        Process.demonitor(monitor, [:flush])
        %{state | claims: claims}
    end
  end

  defp claimed_otherwise?(state, name, model) do
    Enum.any?(state.claims, fn {{claimed, _caller}, {other, _monitor}} ->
      claimed == name and other != model
    end)
  end

  defp free(state, name, opts) do
    case Map.pop(state.catalogue, name) do
      {nil, _} ->
        {:ok, state}

      {{_source, _opts, nil}, catalogue} ->
        {:ok, %{state | catalogue: catalogue}}

      {{_source, _opts, info}, catalogue} ->
        case ScanBridge.free_model(state.server, info, opts) do
          {:error, %ScanBridge.Error{reason: reason}} = error when reason != :unknown_model ->
            {error, state}

          # :unknown_model: the server no longer holds it (freed there directly, or restarted),
          # so it is freed; kept in the catalogue, it would refuse the name to other models
          _freed ->
            ScanBridge.Server.name_model(state.server, name, nil)
            {:ok, %{state | catalogue: catalogue}}
        end
    end
  end

  # The model `name` on this member's server: recorded in the catalogue whether or not it
  # loads here (members joining later copy it), loaded unless it is already or is loading.
  # {:done, reply, state}, or {:waiting, state} with `waiter` answered when the load ends. A
  # name recorded for another model is refused even where that model failed to load: the
  # members where it loaded hold it under the name.
  defp adopt(state, name, source, opts, waiter) do
    {held, model} = {held(state, name), model(source, opts)}

    case {state.catalogue, state.loads} do
      _taken when held not in [nil, model] ->
        {:done, {:error, taken(state, name, :held)}, state}

      {_, %{^name => load}} ->
        {:waiting, put_in(state.loads[name], %{load | waiters: [waiter | load.waiters]})}

      {%{^name => {_source, _opts, info}}, _} when info != nil ->
        {:done, {:ok, info}, state}

      _absent_or_unloaded ->
        server = state.server

        task =
          Task.async(fn -> ScanBridge.load_model(server, source, Keyword.put(opts, :name, name)) end)

        load = %{ref: task.ref, source: source, opts: opts, waiters: [waiter]}
        state = put_in(state.catalogue[name], {source, opts, nil})
        {:waiting, put_in(state.loads[name], load)}
    end
  end

  # The model (`model/2`) recorded under `name`, loaded, loading or not, or nil.
  defp held(state, name) do
    case state.catalogue do
      %{^name => {source, opts, _info}} -> model(source, opts)
      _absent -> nil
    end
  end

  # What makes a model the same as another: its source and its weights' dtype ("f32" unless
  # given, as an atom or a string), not the options of the call that loads it (:timeout).
  defp model(source, opts), do: {source, opts |> Keyword.get(:dtype, "f32") |> to_string()}

  defp taken(state, name, :held) do
    ScanBridge.Error.client(
      :invalid_argument,
      "model name #{inspect(name)} is taken by another model in group #{inspect(state.group)} " <>
        "(Cluster.free_model/3 frees it on every member)",
      %{"field" => "name"}
    )
  end

  defp taken(state, name, :claimed) do
    ScanBridge.Error.client(
      :invalid_argument,
      "model name #{inspect(name)} is being loaded as another model in group " <>
        "#{inspect(state.group)} by another load_model call",
      %{"field" => "name"}
    )
  end

  # A load ended: the catalogue holds what it loaded, its waiters are answered in the order
  # they came (a free after the loads it waited for).
  defp loaded(state, name, load, result) do
    state =
      case result do
        {:ok, info} ->
          ScanBridge.Server.name_model(state.server, name, info["model"])
          put_in(state.catalogue[name], {load.source, load.opts, info})

        {:error, _error} ->
          state
      end

    load.waiters
    |> Enum.reverse()
    |> Enum.reduce(state, fn
      {:free, from, opts}, state ->
        {reply, state} = free(state, name, opts)
        GenServer.reply(from, reply)
        state

      :sync, state ->
        state = answer(state, :sync, name, result)
        join_when_synced(%{state | sync_left: state.sync_left - 1})

      from, state ->
        answer(state, from, name, result)
    end)
  end

  defp answer(state, :sync, name, reply) do
    with {:error, error} <- reply do
      Logger.warning(
        "scan-bridge: #{inspect(state.group)} member on #{node()} cannot load model " <>
          "#{inspect(name)}: #{Exception.message(error)}"
      )
    end

    state
  end

  defp answer(state, from, _name, reply) do
    GenServer.reply(from, reply)
    state
  end

  # The server is offered to the group once the catalogues are copied and what they list loaded.
  defp join_when_synced(%{syncing: nil, sync_left: 0} = state) do
    :ok = :pg.join(Cluster.scope(), Cluster.group_key(state.group), state.server)
    %{state | sync_left: nil}
  end

  defp join_when_synced(state), do: state

  defp catalogue_of(keeper) do
    keeper
    |> GenServer.call(:catalogue)
    |> Enum.map(fn {name, {source, opts, _info}} -> {name, {source, opts}} end)
  catch
    :exit, _gone -> []
  end
end
