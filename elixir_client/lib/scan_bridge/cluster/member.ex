defmodule ScanBridge.Cluster.Member do
  @moduledoc false
  # A server's membership of a group: started (and linked) by a `ScanBridge.Server` started with
  # `group:`, it stops when that server stops, whatever the reason (it watches it: a link
  # passes on no :normal exit), and keeps the group's model catalogue for that server — the models
  # `ScanBridge.Cluster.load_model/4` loaded, by name, with where each came from — and puts the
  # server in the group once it holds them.
  #
  # No registry: each member keeps its own copy of the catalogue. A member joins the group's
  # catalogue keepers first, then copies every other keeper's catalogue, and the one its node
  # remembers of its keepers (NodeCatalogue: a member restarted with no other keeper left
  # copies its former self's), and loads what it lacks, and only then offers its server for
  # work; a keeper silent past the wait for it is asked again, and its catalogue merged once it
  # answers. `load_model/4` records a model on
  # every keeper it finds, then looks again until no new keeper has appeared, so that a member
  # that joined meanwhile either was found or copied a catalogue that already had the model.
  #
  # `load_model/4` first claims the name for its model on every keeper, one after another, in
  # one order for every caller: a claim holds the name against other models until that
  # caller's load reaches the keeper (which then records the model), its release, or its end.
  # So of two loads of different models under one name at once, the one the first keeper
  # claims for goes on, and the other is refused there and loads nothing anywhere.
  #
  # Every name carries a version, {counter, tag}: a load's is one past every version its claims
  # saw, a free's one past the freed entry's, and a freed name keeps its version. A keeper that
  # finds another's newer entry for a name takes it, whatever it held: when a node comes back
  # after a partition (`:nodeup`) each of its keepers compares catalogues with the keepers there,
  # so a name freed and given to another model while a member was cut off is not two models
  # once it is back. A joining member takes the newest entry of each name likewise. A model so
  # replaced is freed on the server; one that sessions still use is freed once they close.
  #
  # A model loads in a task, so that the keeper answers the others meanwhile (a load can take
  # seconds; a member joining would have waited out its call and joined without this keeper's
  # catalogue). Callers asking for a model already loading wait for that load; a free of it
  # waits for it to end.

  use GenServer
  require Logger

  alias ScanBridge.{Cluster, Unexpected}
  alias ScanBridge.Cluster.NodeCatalogue

  # catalogue: name => {source, opts, info or nil}; versions: name => version, of every name
  # recorded or freed here; loads: the models loading, by name: %{ref:, source:, opts:, waiters:}
  # (callers, `:sync`, `:reconcile` or `{:free, caller, opts, tag}`); claims: {name, caller} =>
  # {model, monitor of the caller}; sync_left: the loads the join waits for; retired: model id
  # => info, models replaced by a newer entry whose free is still to succeed; freeing: the task
  # freeing them now, or nil.
  defstruct [
    :server,
    :group,
    :syncing,
    :freeing,
    catalogue: %{},
    versions: %{},
    loads: %{},
    claims: %{},
    sync_left: 0,
    retired: %{}
  ]

  # The version of a name never recorded here: older than any load's.
  @unversioned {0, nil}
  # How often a replaced model still in use is freed again.
  @retire_retry_ms 2_000
  # How long keepers on a node that came up are looked for, and how often.
  @nodeup_wait_ms 5_000
  @nodeup_poll_ms 100
  # How long a joining keeper waits for the others' catalogues before it serves without them,
  # and how often a task still waiting for one checks that the keeper it asks for lives.
  @catalogue_wait_ms 5_000

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
    :ok = :net_kernel.monitor_nodes(true)
    :ok = :pg.join(Cluster.scope(), {:catalogue, state.group}, self())
    {:ok, state, {:continue, :sync}}
  end

  # The other keepers' catalogues are read by a task, so that this keeper answers theirs
  # meanwhile: two members starting together each asked the other from here, neither could
  # answer, and both waited out the call's timeout and joined without the other's catalogue.
  @impl true
  def handle_continue(:sync, state) do
    others = keepers(state.group) -- [self()]
    task = Task.async(fn -> catalogues_of(others) end)
    {:noreply, %{state | syncing: task.ref}}
  end

  # The keepers that did not answer in time are asked again rather than waited for: their nodes
  # stay connected, so no :nodeup would bring their catalogues here.
  @impl true
  def handle_info({ref, {catalogues, silent}}, %{syncing: ref} = state) do
    Process.demonitor(ref, [:flush])
    :ok = reconcile_with(silent, self())
    # and what this node's keepers held: with no other keeper left, a member restarted by its
    # supervisor takes its former self's catalogue
    catalogues = [NodeCatalogue.recall(state.group) | catalogues]

    {:noreply,
     %{state | syncing: nil} |> merge(catalogues, :sync) |> join_when_synced() |> remembered()}
  end

  # A node came up (again): its keepers' catalogues are compared with this one's, once they
  # show in the group (:pg learns of them after the connection).
  def handle_info({:nodeup, node}, state) do
    {keeper, group} = {self(), state.group}

    {:ok, _poller} = Task.start(fn -> reconcile_with(keepers_on(group, node, keeper), keeper) end)

    {:noreply, state}
  end

  def handle_info({:reconcile, catalogues}, state),
    do: {:noreply, state |> merge(catalogues, :reconcile) |> remembered()}

  def handle_info(:retry_retired, state), do: {:noreply, free_retired(state)}

  def handle_info({ref, freed}, %{freeing: ref} = state) do
    Process.demonitor(ref, [:flush])
    state = %{state | freeing: nil, retired: Map.drop(state.retired, freed)}
    _timer = if state.retired != %{}, do: retry_later()
    {:noreply, state}
  end

  def handle_info({ref, result}, state) when is_reference(ref) do
    case Enum.find(state.loads, fn {_name, load} -> load.ref == ref end) do
      nil ->
        {:noreply, state}

      {name, load} ->
        Process.demonitor(ref, [:flush])
        {fingerprint, result} = result
        load = Map.put(load, :fingerprint, fingerprint)
        state = loaded(%{state | loads: Map.delete(state.loads, name)}, name, load, result)
        {:noreply, remembered(state)}
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

  # What Cluster.catalogue/2 tells of this member.
  def handle_call(:describe, _from, state) do
    models =
      Map.new(state.catalogue, fn {name, {source, opts, info}} ->
        {counter, _tag} = version(state, name)
        {_source, dtype} = model(source, opts)

        {name,
         %{
           source: if(is_map(source), do: :sent, else: IO.chardata_to_string(source)),
           dtype: dtype,
           model: info && info["model"],
           version: counter
         }}
      end)

    {:reply, {:ok, %{node: node(), server: state.server, models: models}}, state}
  end

  # What another keeper merges (merge/3).
  def handle_call(:versioned_catalogue, _from, state), do: {:reply, versioned(state), state}

  # A load refuses a name another caller claimed for another model; it ends the caller's own
  # claim, as the catalogue records the model from here.
  def handle_call({:load, name, source, opts, version}, {caller, _tag} = from, state) do
    state = release(state, name, caller)

    cond do
      claimed_otherwise?(state, name, model(source, opts)) ->
        {:reply, {:error, taken(state, name, :claimed)}, state}

      # even where that model failed to load here: the members where it loaded hold it
      held(state, name) not in [nil, model(source, opts)] ->
        {:reply, {:error, taken(state, name, :held)}, state}

      true ->
        case adopt(newer(state, name, version), name, source, opts, from) do
          {:done, reply, state} -> {:reply, reply, remembered(state)}
          {:waiting, state} -> {:noreply, remembered(state)}
        end
    end
  end

  # Claims `name` for this model for the caller, if no other model is loaded, loading or
  # recorded under it here, nor claimed by another caller: {:ok, the name's version here}.
  def handle_call({:claim, name, source, opts}, {caller, _tag}, state) do
    model = model(source, opts)

    cond do
      held(state, name) not in [nil, model] ->
        {:reply, {:error, taken(state, name, :held)}, state}

      claimed_otherwise?(state, name, model) ->
        {:reply, {:error, taken(state, name, :claimed)}, state}

      is_map_key(state.claims, {name, caller}) ->
        {:reply, {:ok, version(state, name)}, state}

      true ->
        claim = {model, Process.monitor(caller)}
        {:reply, {:ok, version(state, name)}, put_in(state.claims[{name, caller}], claim)}
    end
  end

  def handle_call({:free, name, opts, tag}, from, state) do
    case state.loads do
      %{^name => load} ->
        {:noreply,
         put_in(state.loads[name], %{load | waiters: [{:free, from, opts, tag} | load.waiters]})}

      _idle ->
        {reply, state} = free(state, name, opts, tag)
        {:reply, reply, remembered(state)}
    end
  end

  def handle_call(request, _from, state), do: {:reply, Unexpected.call(__MODULE__, request), state}

  @impl true
  def handle_cast({:release, name, caller}, state), do: {:noreply, release(state, name, caller)}

  def handle_cast(request, state) do
    Unexpected.cast(__MODULE__, request)
    {:noreply, state}
  end

  # name => {{source, opts} or :freed, version}, of every name recorded or freed here.
  defp versioned(state) do
    Map.new(state.versions, fn {name, version} ->
      case state.catalogue do
        %{^name => {source, opts, _info}} -> {name, {{source, opts}, version}}
        _freed -> {name, {:freed, version}}
      end
    end)
  end

  # The catalogue as it is now, for a member this node starts later (NodeCatalogue).
  defp remembered(state) do
    NodeCatalogue.remember(state.group, versioned(state))
    state
  end

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

  # A free leaves the name's version one past the entry's, `tag` that of the free_model call.
  defp free(state, name, opts, tag) do
    case Map.pop(state.catalogue, name) do
      {nil, _} ->
        {:ok, state}

      {{_source, _opts, nil}, catalogue} ->
        {:ok, freed(%{state | catalogue: catalogue}, name, tag)}

      {{_source, _opts, info}, catalogue} ->
        case free_on_server(state.server, info, opts) do
          :ok ->
            ScanBridge.Server.name_model(state.server, name, nil)
            {:ok, freed(%{state | catalogue: catalogue}, name, tag)}

          error ->
            {error, state}
        end
    end
  end

  defp freed(state, name, tag) do
    {counter, _tag} = version(state, name)
    put_in(state.versions[name], {counter + 1, tag})
  end

  # :unknown_model: the server no longer holds it (freed there directly, or restarted), so it is
  # freed; kept in the catalogue, it would refuse the name to other models.
  defp free_on_server(server, info, opts) do
    case ScanBridge.free_model(server, info, opts) do
      {:error, %ScanBridge.Error{reason: reason}} = error when reason != :unknown_model -> error
      _freed -> :ok
    end
  end

  defp version(state, name), do: Map.get(state.versions, name, @unversioned)

  defp newer(state, name, version),
    do: put_in(state.versions[name], max(version, version(state, name)))

  # Takes, of each name in `catalogues` (versioned, from other keepers), the newest entry where
  # it is newer than this keeper's: replacing the model held under the name by another, or
  # freeing it. A name whose model is loading here is merged again once that load has ended.
  defp merge(state, catalogues, waiter) do
    catalogues
    |> Enum.flat_map(&Map.to_list/1)
    |> Enum.group_by(fn {name, _entry} -> name end, fn {_name, entry} -> entry end)
    |> Enum.reduce(state, fn {name, entries}, state ->
      {entry, version} = Enum.max_by(entries, fn {_entry, version} -> version end)

      cond do
        version <= version(state, name) ->
          state

        is_map_key(state.loads, name) ->
          Process.send_after(self(), {:reconcile, [%{name => {entry, version}}]}, @nodeup_poll_ms)
          state

        true ->
          take_entry(state, name, entry, version, waiter)
      end
    end)
  end

  defp take_entry(state, name, :freed, version, _waiter),
    do: put_in(replace(state, name, nil).versions[name], version)

  defp take_entry(state, name, {source, opts}, version, waiter) do
    state = put_in(replace(state, name, model(source, opts)).versions[name], version)

    case adopt(state, name, source, opts, waiter) do
      {:done, reply, state} -> answer(state, waiter, name, reply)
      {:waiting, state} when waiter == :sync -> %{state | sync_left: state.sync_left + 1}
      {:waiting, state} -> state
    end
  end

  # The name's entry here, when it is not `model`, is dropped, and the model it loaded freed
  # (retired, when sessions still use it); every node's balancer forgets its id here.
  defp replace(state, name, model) do
    case state.catalogue do
      %{^name => {source, opts, info}} ->
        if model(source, opts) == model,
          do: state,
          else: retire(%{state | catalogue: Map.delete(state.catalogue, name)}, name, info)

      _absent ->
        state
    end
  end

  defp retire(state, _name, nil), do: state

  defp retire(state, name, info) do
    Logger.warning(
      "scan-bridge: #{inspect(state.group)} member on #{node()} gives model name " <>
        "#{inspect(name)} up for a newer entry of another member (a free or load made while " <>
        "this node was apart); it frees model #{info["model"]} here"
    )

    # the server tells every node's balancer to forget its id (Balancer.forget_model/2)
    ScanBridge.Server.name_model(state.server, name, nil)

    free_retired(put_in(state.retired[info["model"]], info))
  end

  # Frees the retired models in a task, so that this keeper answers the others meanwhile (a
  # free waits out its timeout on a frozen server, and a member joining would copy nothing
  # from here). One task at a time; those their server still refuses (sessions of them open)
  # are tried again once it ends (retry_later/0), with any retired meanwhile.
  defp free_retired(%{freeing: nil, retired: retired} = state) when retired != %{} do
    server = state.server

    task =
      Task.async(fn ->
        for {id, info} <- retired, free_on_server(server, info, []) == :ok, do: id
      end)

    %{state | freeing: task.ref}
  end

  defp free_retired(state), do: state

  defp retry_later, do: Process.send_after(self(), :retry_retired, @retire_retry_ms)

  # The model `name` on this member's server (no other model recorded under it here): recorded
  # in the catalogue whether or not it loads here (members joining later copy it), loaded unless
  # it is already or is loading. {:done, reply, state}, or {:waiting, state} with `waiter`
  # answered when the load ends.
  defp adopt(state, name, source, opts, waiter) do
    case {state.catalogue, state.loads} do
      {_, %{^name => load}} ->
        {:waiting, put_in(state.loads[name], %{load | waiters: [waiter | load.waiters]})}

      {%{^name => {_source, _opts, info}}, _} when info != nil ->
        {:done, {:ok, info}, state}

      _absent_or_unloaded ->
        server = state.server

        task = Task.async(fn -> {fingerprint(source, opts), load(server, name, source, opts)} end)

        load = %{ref: task.ref, source: source, opts: opts, waiters: [waiter]}
        state = put_in(state.catalogue[name], {source, opts, nil})
        {:waiting, put_in(state.loads[name], load)}
    end
  end

  # A source that cannot be sent fails its load, not this keeper (the task is linked to it):
  # Cluster.load_model/4 refuses one in its caller, and what other keepers copy came from one.
  defp load(server, name, source, opts) do
    ScanBridge.load_model(server, source, Keyword.put(opts, :name, name))
  rescue
    exception in ArgumentError ->
      {:error, ScanBridge.Error.client(:invalid_argument, Exception.message(exception))}
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

  # The model (model/2) in 16 bytes, alike on every member: what a cluster session keeps of the
  # model it runs, so that it is never reopened under another given its name (a name's versions
  # change with every load, the same model's included). Hashed as it is walked, so that sent
  # weights are not copied, and alike whatever OTP release each member runs (term_to_binary's
  # encoding of atoms is not).
  defp fingerprint(source, opts),
    do: :erlang.md5_final(digest(:erlang.md5_init(), model(source, opts)))

  defp digest(hash, term) when is_binary(term),
    do: hash |> :erlang.md5_update(<<?b, byte_size(term)::64>>) |> :erlang.md5_update(term)

  defp digest(hash, term) when is_atom(term),
    do: digest(:erlang.md5_update(hash, "a"), Atom.to_string(term))

  defp digest(hash, term) when is_integer(term),
    do: digest(:erlang.md5_update(hash, "i"), Integer.to_string(term))

  defp digest(hash, term) when is_float(term), do: :erlang.md5_update(hash, <<?f, term::float-64>>)

  defp digest(hash, term) when is_list(term),
    do: Enum.reduce(term, :erlang.md5_update(hash, <<?l, length(term)::64>>), &digest(&2, &1))

  defp digest(hash, term) when is_tuple(term),
    do: digest(:erlang.md5_update(hash, "t"), Tuple.to_list(term))

  # entries in key order (keys are unique, so values are never compared)
  defp digest(hash, term) when is_map(term),
    do: digest(:erlang.md5_update(hash, "m"), Enum.sort(Map.to_list(term)))

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
          ScanBridge.Server.name_model(state.server, name, {info["model"], load.fingerprint})
          put_in(state.catalogue[name], {load.source, load.opts, info})

        {:error, _error} ->
          state
      end

    load.waiters
    |> Enum.reverse()
    |> Enum.reduce(state, fn
      {:free, from, opts, tag}, state ->
        {reply, state} = free(state, name, opts, tag)
        GenServer.reply(from, reply)
        state

      :sync, state ->
        state = answer(state, :sync, name, result)
        join_when_synced(%{state | sync_left: state.sync_left - 1})

      from, state ->
        answer(state, from, name, result)
    end)
  end

  defp answer(state, waiter, name, reply) when waiter in [:sync, :reconcile] do
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

  # The keepers' versioned catalogues, asked at once and waited for by one deadline, so that
  # keepers that do not answer (their nodes frozen or cut off) cost it once between them:
  # {the catalogues, the keepers still silent at the deadline}.
  defp catalogues_of(keepers) do
    deadline = System.monotonic_time(:millisecond) + @catalogue_wait_ms

    keepers
    |> Enum.map(&{&1, :gen_server.send_request(&1, :versioned_catalogue)})
    |> Enum.reduce({[], []}, fn {keeper, request}, {catalogues, silent} ->
      left = max(deadline - System.monotonic_time(:millisecond), 0)

      case :gen_server.receive_response(request, left) do
        {:reply, catalogue} -> {[catalogue | catalogues], silent}
        :timeout -> {catalogues, [keeper | silent]}
        {:error, _gone} -> {catalogues, silent}
      end
    end)
  end

  # The group's keepers on `node` but `keeper`, once any shows.
  defp keepers_on(group, node, keeper, waited \\ 0) do
    case Enum.filter(keepers(group) -- [keeper], &(node(&1) == node)) do
      [] when waited < @nodeup_wait_ms ->
        Process.sleep(@nodeup_poll_ms)
        keepers_on(group, node, keeper, waited + @nodeup_poll_ms)

      found ->
        found
    end
  end

  # Each of `others`' catalogues merged into `keeper`'s as it comes: one that does not answer
  # (its node frozen again) holds up none of the others, and is waited for until it does.
  defp reconcile_with(others, keeper) do
    for other <- others do
      {:ok, _asker} =
        Task.start(fn ->
          request = :gen_server.send_request(other, :versioned_catalogue)

          with %{} = catalogue <- answered_catalogue(request, keeper),
               do: send(keeper, {:reconcile, [catalogue]})
        end)
    end

    :ok
  end

  # The catalogue `request` asked for, once it comes; nil when the keeper asked goes first
  # (stopped, or its node disconnected: the :nodeup reconcile asks it again once it is back),
  # or `keeper` does.
  defp answered_catalogue(request, keeper) do
    # wait_response, unlike receive_response, keeps the request waiting past its timeout
    case :gen_server.wait_response(request, @catalogue_wait_ms) do
      {:reply, catalogue} -> catalogue
      :timeout -> if Process.alive?(keeper), do: answered_catalogue(request, keeper)
      {:error, _gone} -> nil
    end
  end
end
