defmodule ScanBridge.Cluster.Balancer do
  @moduledoc false
  # This node's view of the load it puts on each server of a group: the calls it has in flight
  # at each member and the cluster sessions it keeps there. One per node, started by the
  # application; callers check a member out and back in, and a caller that exits without
  # checking in (killed mid-call) is checked in by its monitor, so the counts never drift.
  #
  # The counts are this node's only: callers on other nodes are balanced by their own nodes'
  # balancers, each spreading its share (docs/cluster.md, "Routing").
  #
  # It also keeps what this node has learnt of members: the ids of group models on them, told
  # by each member's server as it answers a keeper and forgotten at its word, so that opening a
  # session (a failover's rebuild above all) asks the member for its model's id once per node,
  # not once per session; and which members refuse session_open's frames (servers from before
  # them), so that a rebuild there opens and replays at once rather than being refused first
  # each time. Read without a message (a protected table), written by this process only, a
  # member's entries dropped when it goes; an id stale because its model was freed since is
  # refused by the member (`:unknown_model`) and asked again.

  use GenServer

  alias ScanBridge.{Cluster, Unexpected}

  # members: the members seen, each with its monitor, which is also the member's generation
  # here: a member whose node went away and came back (the same pid) is monitored anew, and a
  # holder's check-in counts only against the generation it checked out (holders: token =>
  # {counts, member, monitor, the checkout's request ref})
  defstruct calls: %{}, sessions: %{}, holders: %{}, members: %{}

  @facts __MODULE__.MemberFacts

  @spec start_link(term) :: GenServer.on_start()
  def start_link(_opts), do: GenServer.start_link(__MODULE__, :ok, name: __MODULE__)

  @doc """
  A member of `group` for a call (`:call`, the fewest calls in flight) or a session
  (`:session`, the fewest sessions), leaving out `exclude`; ties go to this node's members, then
  to chance. `{:ok, member, token}`, the token for `checkin/1`, `:no_members`, or `:timeout`
  where the balancer did not answer within `wait` (ms or `:infinity`; the caller's deadline):
  what it then checks out for the caller it gives back at once.
  """
  @spec checkout(term, :call | :session, [pid], timeout) ::
          {:ok, pid, reference} | :no_members | :timeout
  def checkout(group, kind, exclude \\ [], wait \\ :infinity) do
    request = make_ref()

    try do
      GenServer.call(__MODULE__, {:checkout, group, kind, exclude, self(), request}, wait)
    catch
      :exit, {:timeout, _} ->
        # behind the checkout from this process, so the balancer has made it when this comes
        GenServer.cast(__MODULE__, {:abandon, request})
        :timeout
    end
  end

  @doc "Gives back what `checkout/4` took."
  @spec checkin(reference) :: :ok
  def checkin(token), do: GenServer.cast(__MODULE__, {:checkin, token})

  @doc "This node's counts for `group`'s members: `%{member => %{calls: n, sessions: n}}`."
  @spec loads(term) :: %{pid => %{calls: non_neg_integer, sessions: non_neg_integer}}
  def loads(group), do: GenServer.call(__MODULE__, {:loads, group})

  @doc """
  {the id on `member`, the model's fingerprint} of the group model `name` as this node learnt
  it, or nil.
  """
  @spec model_entry(pid, String.t()) :: {String.t(), term} | nil
  def model_entry(member, name) do
    case :ets.lookup(@facts, {member, name}) do
      [{_key, entry}] -> entry
      [] -> nil
    end
  rescue
    # no table: this node's balancer is restarting; the member is asked instead
    ArgumentError -> nil
  end

  @doc """
  Tells `node`'s balancer the entry on `member` (checked out there) of the group model `name`
  (`model_entry/2`). Sent by the member's server itself as it answers a keeper, and
  `forget_model/2` likewise: from one sender a balancer takes the two in the order the server
  answered and renamed, so an entry read before the name was given up can never land after
  its forgetting (a keeper passing its answer on could, and keep a given-up model's id).
  """
  @spec learn_model(node, pid, String.t(), {String.t(), term} | nil) :: :ok
  def learn_model(node, member, name, entry),
    do: GenServer.cast({__MODULE__, node}, {:learn_model, member, name, entry})

  @doc "Tells every connected node's balancer that `member` no longer holds the group model `name`."
  @spec forget_model(pid, String.t()) :: :ok
  def forget_model(member, name) do
    GenServer.abcast([node() | Node.list()], __MODULE__, {:learn_model, member, name, nil})
    :ok
  end

  @doc "Whether `member` takes session_open's frames, as far as this node has learnt."
  @spec takes_frames?(pid) :: boolean
  def takes_frames?(member) do
    :ets.lookup(@facts, {member, :refuses_frames}) == []
  rescue
    # no table: this node's balancer is restarting; the member is asked
    ArgumentError -> true
  end

  @doc "Records that `member` (checked out here) refused session_open's frames by name."
  @spec learn_refuses_frames(pid) :: :ok
  def learn_refuses_frames(member),
    do: GenServer.cast(__MODULE__, {:learn_refuses_frames, member})

  @impl true
  def init(:ok) do
    @facts = :ets.new(@facts, [:named_table, :protected, read_concurrency: true])
    {:ok, %__MODULE__{}}
  end

  @impl true
  def handle_call({:checkout, group, kind, exclude, holder, request}, _from, state) do
    case Cluster.members(group) -- exclude do
      [] ->
        {:reply, :no_members, state}

      members ->
        member = Enum.min_by(members, &rank(state, kind, &1))
        token = Process.monitor(holder)
        counts = counts(kind)
        state = watch(state, member)
        held = {counts, member, state.members[member], request}

        state =
          state
          |> Map.update!(counts, &Map.update(&1, member, 1, fn n -> n + 1 end))
          |> Map.update!(:holders, &Map.put(&1, token, held))

        {:reply, {:ok, member, token}, state}
    end
  end

  def handle_call({:loads, group}, _from, state) do
    loads =
      Map.new(Cluster.members(group), fn member ->
        {member,
         %{calls: Map.get(state.calls, member, 0), sessions: Map.get(state.sessions, member, 0)}}
      end)

    {:reply, loads, state}
  end

  def handle_call(request, _from, state), do: {:reply, Unexpected.call(__MODULE__, request), state}

  @impl true
  def handle_cast({:checkin, token}, state) do
    Process.demonitor(token, [:flush])
    {:noreply, release(state, token)}
  end

  # A checkout its caller stopped waiting for: found by its request (rare, so by a scan).
  def handle_cast({:abandon, request}, state) do
    abandoned =
      Enum.find_value(state.holders, fn
        {token, {_counts, _member, _monitor, ^request}} -> token
        _other -> nil
      end)

    if abandoned, do: handle_cast({:checkin, abandoned}, state), else: {:noreply, state}
  end

  def handle_cast({:learn_model, member, name, nil}, state) do
    :ets.delete(@facts, {member, name})
    {:noreply, state}
  end

  # A member not watched now is gone (its DOWN came first): nothing to learn of it.
  def handle_cast({:learn_model, member, name, entry}, state) do
    if is_map_key(state.members, member), do: :ets.insert(@facts, {{member, name}, entry})
    {:noreply, state}
  end

  def handle_cast({:learn_refuses_frames, member}, state) do
    if is_map_key(state.members, member), do: :ets.insert(@facts, {{member, :refuses_frames}, true})
    {:noreply, state}
  end

  def handle_cast(request, state) do
    Unexpected.cast(__MODULE__, request)
    {:noreply, state}
  end

  @impl true
  def handle_info({:DOWN, ref, :process, member, _reason}, state) do
    case state.members do
      %{^member => ^ref} ->
        # A member gone: its counts and what was learnt of it go with it (its holders'
        # check-ins then count against nothing, even once it is back).
        :ets.match_delete(@facts, {{member, :_}, :_})

        {:noreply,
         %{
           state
           | members: Map.delete(state.members, member),
             calls: Map.delete(state.calls, member),
             sessions: Map.delete(state.sessions, member)
         }}

      _holder ->
        {:noreply, release(state, ref)}
    end
  end

  # Anything else (a message sent to the wrong process) is not this process's to act on.
  def handle_info(_other, state), do: {:noreply, state}

  defp release(state, token) do
    case Map.pop(state.holders, token) do
      {nil, _} ->
        state

      {{counts, member, monitor, _request}, holders} ->
        state = %{state | holders: holders}

        case state.members do
          %{^member => ^monitor} -> Map.update!(state, counts, &count_down(&1, member))
          # checked out before the member went away: what it counted went with the member
          _gone_since -> state
        end
    end
  end

  defp count_down(by_member, member) do
    case by_member do
      %{^member => 1} -> Map.delete(by_member, member)
      %{^member => n} -> Map.put(by_member, member, n - 1)
    end
  end

  defp watch(state, member) do
    if is_map_key(state.members, member),
      do: state,
      else: %{state | members: Map.put(state.members, member, Process.monitor(member))}
  end

  defp counts(:call), do: :calls
  defp counts(:session), do: :sessions

  # Fewest of what is checked out, then fewest of the other kind, then this node's, then chance.
  defp rank(state, kind, member) do
    calls = Map.get(state.calls, member, 0)
    sessions = Map.get(state.sessions, member, 0)
    {first, second} = if kind == :call, do: {calls, sessions}, else: {sessions, calls}
    {first, second, if(node(member) == node(), do: 0, else: 1), :rand.uniform()}
  end
end
