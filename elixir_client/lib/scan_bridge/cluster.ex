defmodule ScanBridge.Cluster do
  @moduledoc """
  Many scan-bridge servers across the nodes of a BEAM cluster, called as one: a group.

  A server joins a group when its client is started with `group:` (one server per device; the
  server takes `--device cuda:N`):

      children = [{ScanBridge, name: MyApp.Gpu0, group: :agents, args: ["--device", "cuda:0"]}]

  Membership is `:pg` (scope `#{inspect(__MODULE__)}`, started by the `:scan_bridge`
  application) over Erlang distribution: any node of the cluster that runs the application
  calls the group, with no broker and no registry. A server leaves the group when it or its
  node goes away.

    * Stateless calls (`scan/3`, `ssd_scan/3`, `scan_backward/3`, `ssd_scan_backward/3`) go to
      the member with the fewest calls in flight from this node (this node's members first on
      ties). With `retry: true` a call whose server went away is sent once more, to another
      member, within the same deadline.
    * `open_session/3` opens a session on the member with the fewest of this node's sessions
      and returns a handle to a process on this node that keeps it (`ScanBridge.Cluster.Session`):
      its calls go to that member directly, with no lookup per frame. With `checkpoint: n`, the
      session's state is copied here every n frames and the frames since are kept, so that when
      its server goes away the session is rebuilt on another member and the frames replayed:
      the caller gets the right answer or `{:error, %ScanBridge.Error{reason: :session_lost}}`,
      never a wrong one. `snapshot/2` and `restore/3` roll a session back, on its server or,
      with checkpoints, after a failover; `fork/2` copies one.
    * `load_model/4` loads a model, by a name of the group's, on every member, and on every
      member that joins later; `open_session(group, model: name, batch: b)` opens its sessions.
    * A member takes `:max_in_flight` requests at once (`ScanBridge.start_link/1`); past it
      calls wait, and a call whose deadline passes before it could be sent gets
      `{:error, %ScanBridge.Error{reason: :overloaded}}`.

  Every call is answered by its deadline (`:timeout`, default 30 000 ms) and a grace of at most
  100 ms, even when a member's node is cut off or frozen. What each failure loses is in
  docs/cluster.md.
  """

  alias ScanBridge.{Error, Protocol, Tensor}
  alias ScanBridge.Cluster.{Balancer, Member, Session}

  @default_timeout 30_000
  # The errors that mean the server that had the call is gone (or going): its process, its
  # OS process or its node; a call it had may be sent to another member.
  @gone [:server_exited, :not_running, :node_down, :shutting_down]

  @typedoc "A group's name: atoms, strings, numbers, and tuples and lists of them."
  @type group :: term
  @typedoc "A cluster session's handle (`open_session/3`)."
  @type session :: Session.t()
  @typedoc "The options of the stateless calls (`scan/3`, ...)."
  @type call_opts :: [timeout: timeout, retry: boolean]
  @typedoc "`open_session/3`'s options."
  @type session_opts :: [checkpoint: pos_integer, timeout: timeout]
  @typedoc "Where a cluster session is and how it fares (`session_info/1`)."
  @type session_info :: %{
          member: pid | nil,
          node: node | nil,
          session: String.t() | nil,
          failovers: non_neg_integer,
          frames_since_checkpoint: non_neg_integer,
          status: :ok | :unsure | :tainted | :lost
        }
  @typedoc "A deadline: a `System.monotonic_time(:millisecond)` instant, or `:infinity`."
  @type deadline :: integer | :infinity

  @doc false
  @spec scope() :: module
  def scope, do: __MODULE__

  @doc false
  @spec group_key(group) :: {:servers, group}
  def group_key(group), do: {:servers, group}

  @doc "The servers (client processes, `ScanBridge.Server`) serving `group`, on every node."
  @spec members(group) :: [pid]
  def members(group), do: :pg.get_members(scope(), group_key(group))

  @doc """
  Waits until `group` has at least `count` members, on any node, for at most `timeout` ms
  (default 5 000): `{:ok, members}`, or `{:error, %ScanBridge.Error{reason: :no_members}}`
  (its `detail["members"]`, how many there were). A client started with `group:` joins once
  its server answers and holds the group's models, after `ScanBridge.start_link/1` has
  returned: an application that starts its members and calls the group at once waits here
  first, or its first calls find `:no_members`.
  """
  @spec await_members(group, pos_integer, timeout) :: {:ok, [pid]} | ScanBridge.error()
  def await_members(group, count \\ 1, timeout \\ 5_000) do
    unless is_integer(count) and count > 0,
      do:
        raise(
          ArgumentError,
          "await_members count: expected a positive integer, got #{inspect(count)}"
        )

    await_count(group, count, deadline(timeout))
  end

  # Polled: a join is a :pg update on every node, which this node sees without a message to it.
  defp await_count(group, count, deadline) do
    members = members(group)

    cond do
      length(members) >= count ->
        {:ok, members}

      remaining(deadline) == 0 ->
        {:error,
         Error.client(
           :no_members,
           "group #{inspect(group)} has #{length(members)} of the #{count} members awaited",
           %{"members" => length(members)}
         )}

      true ->
        Process.sleep(min(10, remaining(deadline)))
        await_count(group, count, deadline)
    end
  end

  @doc """
  This node's load on each member of `group`: `%{member => %{calls: n, sessions: n}}`, the
  calls in flight and the sessions kept from this node.
  """
  @spec loads(group) :: %{pid => %{calls: non_neg_integer, sessions: non_neg_integer}}
  defdelegate loads(group), to: Balancer

  @doc false
  @spec gone?(Error.t()) :: boolean
  def gone?(%Error{reason: reason}), do: reason in @gone

  ## Stateless calls

  @doc """
  `ScanBridge.scan/3` on a member of `group`. Options: `:timeout`, `:retry` (`true`: when the
  member goes away with the call, send it once more to another member, within the deadline).
  Inputs must not name a `:session` or hold `{:handle, id}`s: those belong to one server (use
  a cluster session, or send the tensors).

  Given a cluster session (of a plain Mamba-1 session) instead of a group, the scan is a
  prefill of that session, as `ScanBridge.scan/3` with `:session`: sent to its owner and kept
  for a rebuild like a step. Options: `:timeout`.
  """
  @spec scan(group | session, ScanBridge.inputs(), call_opts) ::
          {:ok, ScanBridge.scan_result()} | ScanBridge.error()
  def scan(group_or_session, inputs, opts \\ [])
  def scan(%Session{} = session, inputs, opts), do: Session.call(session, :scan, inputs, opts)
  def scan(group, inputs, opts), do: stateless(group, :scan, inputs, opts)

  @doc """
  `ScanBridge.ssd_scan/3` on a member of `group`, or a prefill of a Mamba-2 cluster session;
  options as for `scan/3`.
  """
  @spec ssd_scan(group | session, ScanBridge.inputs(), call_opts) ::
          {:ok, ScanBridge.scan_result()} | ScanBridge.error()
  def ssd_scan(group_or_session, inputs, opts \\ [])

  def ssd_scan(%Session{} = session, inputs, opts),
    do: Session.call(session, :ssd_scan, inputs, opts)

  def ssd_scan(group, inputs, opts), do: stateless(group, :ssd_scan, inputs, opts)

  @doc "`ScanBridge.scan_backward/3` on a member of `group`; options as for `scan/3`."
  @spec scan_backward(group, ScanBridge.inputs(), call_opts) ::
          {:ok, ScanBridge.gradients()} | ScanBridge.error()
  def scan_backward(group, inputs, opts \\ []),
    do: stateless(group, :scan_backward, inputs, opts)

  @doc "`ScanBridge.ssd_scan_backward/3` on a member of `group`; options as for `scan/3`."
  @spec ssd_scan_backward(group, ScanBridge.inputs(), call_opts) ::
          {:ok, ScanBridge.gradients()} | ScanBridge.error()
  def ssd_scan_backward(group, inputs, opts \\ []),
    do: stateless(group, :ssd_scan_backward, inputs, opts)

  defp stateless(group, fun, inputs, opts) do
    opts = ScanBridge.opts!(opts, [:timeout, :retry], "#{fun}")
    stateless_inputs!(inputs, fun)
    deadline = deadline(Keyword.get(opts, :timeout, @default_timeout))
    retries = if Keyword.get(opts, :retry, false), do: 1, else: 0
    attempt(group, fun, inputs, deadline, retries, [])
  end

  defp attempt(group, fun, inputs, deadline, retries, tried) do
    case Balancer.checkout(group, :call, tried, remaining(deadline)) do
      :no_members ->
        {:error, no_members(group, tried)}

      :timeout ->
        {:error, balancer_timeout("#{fun}")}

      {:ok, member, token} ->
        outcome =
          try do
            apply(ScanBridge, fun, [member, inputs, [timeout: remaining(deadline)]])
          after
            Balancer.checkin(token)
          end

        case outcome do
          # a member that had gone before the call reached it (:pg had yet to drop it): the
          # call was never delivered, so it goes to another member, retry or not
          {:error, %Error{reason: :not_running}} ->
            attempt(group, fun, inputs, deadline, retries, [member | tried])

          {:error, %Error{} = error} when retries > 0 ->
            if gone?(error) and remaining(deadline) != 0,
              do: attempt(group, fun, inputs, deadline, retries - 1, [member | tried]),
              else: outcome

          outcome ->
            outcome
        end
    end
  end

  @doc false
  # The error of a call or placement whose deadline passed while this node's balancer was
  # choosing its member (a balancer behind a backlog): nothing was sent.
  def balancer_timeout(what) do
    %Error{
      reason: :deadline_exceeded,
      message: "#{what}: the deadline passed while this node's balancer chose a member; not sent",
      detail: %{}
    }
  end

  defp no_members(group, []),
    do: Error.client(:no_members, "no server serves group #{inspect(group)}", %{})

  defp no_members(group, tried) do
    Error.client(
      :no_members,
      "no other server serves group #{inspect(group)} to retry on (#{length(tried)} tried)",
      %{"tried" => length(tried)}
    )
  end

  defp stateless_inputs!(inputs, fun) when is_map(inputs) do
    Enum.each(inputs, fn
      {name, _} when name in [:session, "session"] ->
        raise ArgumentError,
              "#{fun} inputs: expected no :session in a group call (a session is one " <>
                "server's: use a cluster session), got one"

      entry ->
        no_handle!(entry, "#{fun} input", "a group call may go to any")
    end)
  end

  # ScanBridge's own check names what it expected.
  defp stateless_inputs!(_inputs, _fun), do: :ok

  # A handle is one server's: a group's calls and models go to other members too.
  defp no_handle!({name, {:handle, _}}, what, why) do
    raise ArgumentError,
          "#{what} #{name}: expected a tensor, got a {:handle, id} (a handle is one server's; #{why})"
  end

  defp no_handle!(_entry, _what, _why), do: :ok

  ## Models

  @doc """
  Loads a model on every member of `group` under `name` (a non-empty string of at most 256
  bytes), and on every
  member that joins the group later; `source` and `opts` (`:dtype`, `:timeout`) as for
  `ScanBridge.load_model/3`. A path must name a checkpoint on every member's host (under its
  `--model-dir`); a model sent as config and weights is kept by every member's node, for the
  members that join later.

  `{:ok, %{members: n, info: info}}` (one member's description), or the first error with
  `detail["member"]` naming the member's node. Loading the same again is a no-op (and loads it
  on the members where it failed). A name that any member still gives to a different model
  (loaded, loading, or recorded by a load that failed there, or kept by a free that failed
  there) is `:invalid_argument`, and nothing is loaded: `free_model/3` frees the name first.
  So is a name another `load_model/4` call is loading as a different model meanwhile: of two
  such calls at once, one loads its model on every member and the other loads nothing. A member
  cut off during the call takes the model when its node connects again (docs/cluster.md,
  "Partitions").
  """
  @spec load_model(group, String.t(), ScanBridge.model_source(),
          dtype: :f32 | :bf16 | :f16 | String.t(),
          timeout: timeout
        ) ::
          {:ok, %{members: pos_integer, info: map}} | ScanBridge.error()
  def load_model(group, name, source, opts \\ []) do
    name = name!(name, "load_model name")
    opts = ScanBridge.opts!(opts, [:dtype, :timeout], "load_model")
    # a bad source or option raises here, in the caller, not in every member (whose load would
    # stop it, and its server with it): built and encoded as each member's request will be
    {_head, _size} = Protocol.request_head("model_load", ScanBridge.model_load_args!(source, opts))
    sent_weights!(source)
    deadline = deadline(keeper_wait(opts))

    # The name is claimed for this model on every member first: loading on the members that
    # would take it while another still holds a different one, or while another caller loads
    # one, would leave two models under one name. One member after another, in the order every
    # caller takes, so that of two callers the first member's choice is every member's.
    keepers = Enum.sort(Member.keepers(group))

    case claim(keepers, {:claim, name, source, opts}, deadline, [], 0) do
      {:ok, counter} ->
        # newer than every version of the name the claims saw (ScanBridge.Cluster.Member)
        version = {counter + 1, {node(), System.unique_integer([:positive])}}
        load_everywhere(group, {:load, name, source, opts, version}, %{}, nil)

      {error, asked} ->
        Enum.each(asked, &GenServer.cast(&1, {:release, name, self()}))
        error
    end
  end

  # A group model's weights go to every member (a handle among them loaded it on its own server
  # alone, and the name stayed claimed on the others).
  defp sent_weights!(%{weights: weights}),
    do:
      Enum.each(
        weights,
        &no_handle!(&1, "load_model weights", "a group model is loaded on every member")
      )

  defp sent_weights!(_path), do: :ok

  # {:ok, the highest version counter of the name the keepers hold} once every keeper holds the
  # claim (or went away meanwhile), else the first failure and the keepers asked, whose claims
  # are to be released: the last one's may reach it late.
  defp claim([], _request, _deadline, _asked, counter), do: {:ok, counter}

  defp claim([keeper | keepers], request, deadline, asked, counter) do
    case ask_keepers([keeper], request, deadline) do
      [{_keeper, {:ok, {seen, _tag}}}] ->
        claim(keepers, request, deadline, [keeper | asked], max(counter, seen))

      results ->
        case first_failure(results) do
          nil -> claim(keepers, request, deadline, [keeper | asked], counter)
          error -> {error, [keeper | asked]}
        end
    end
  end

  # Load on every catalogue keeper not done yet, then look again until none is new (see
  # ScanBridge.Cluster.Member). `done`: keeper => whether it loaded the model (false: its server
  # went away, so it is no member any more).
  defp load_everywhere(group, {:load, _name, _source, opts, _version} = load, done, info) do
    case Member.keepers(group) |> Enum.reject(&is_map_key(done, &1)) do
      [] when info == nil ->
        {:error, Error.client(:no_members, "no server serves group #{inspect(group)}", %{})}

      [] ->
        {:ok, %{members: Enum.count(done, fn {_keeper, loaded} -> loaded end), info: info}}

      keepers ->
        # every member at once: each loads on its own device
        results = ask_keepers(keepers, load, deadline(keeper_wait(opts)))

        case first_failure(results) do
          {:error, _error} = failure ->
            failure

          nil ->
            info = Enum.find_value(results, info, fn {_, result} -> ok_info(result) end)
            done = Enum.reduce(results, done, fn {k, r}, done -> Map.put(done, k, ok?(r)) end)
            load_everywhere(group, load, done, info)
        end
    end
  end

  # The first keeper's error, its detail naming the keeper's node, passing over a keeper whose
  # server (or the keeper itself) went away meanwhile: it leaves the group with its server.
  defp first_failure(results) do
    case Enum.find(results, fn {_keeper, result} -> failed?(result) end) do
      {keeper, {:error, error}} ->
        {:error, %{error | detail: Map.put(error.detail, "member", "#{node(keeper)}")}}

      nil ->
        nil
    end
  end

  defp failed?({:error, %Error{} = error}), do: not gone?(error)
  defp failed?(_ok), do: false

  defp ok?({:ok, _info}), do: true
  defp ok?(_gone), do: false

  defp ok_info({:ok, info}), do: info
  defp ok_info(_gone), do: nil

  # Sends `request` to every keeper at once and takes their answers by one deadline, so that
  # keepers that do not answer (their nodes frozen or cut off) cost that deadline once between
  # them. [{keeper, answer}], in the keepers' order: a keeper that went away answers
  # {:error, :server_exited}, one past the deadline {:error, :timeout}.
  defp ask_keepers(keepers, request, deadline) do
    keepers
    |> Enum.map(&{&1, :gen_server.send_request(&1, request)})
    |> Enum.map(fn {keeper, request_id} ->
      case :gen_server.receive_response(request_id, remaining(deadline)) do
        {:reply, reply} -> {keeper, reply}
        :timeout -> {keeper, {:error, keeper_timeout(keeper)}}
        {:error, {reason, _keeper}} -> {keeper, {:error, keeper_gone(keeper, reason)}}
      end
    end)
  end

  defp keeper_gone(keeper, reason),
    do:
      Error.client(
        :server_exited,
        "the member on #{node(keeper)} went away: #{inspect(reason, limit: 5)}",
        %{}
      )

  defp keeper_timeout(keeper),
    do:
      Error.client(
        :timeout,
        "the member on #{node(keeper)} did not answer before the deadline",
        %{}
      )

  # How long a keeper's load or free is waited for: its server's call's :timeout and a second
  # (no longer than a receive takes, 2^32 - 1 ms; :infinity as it is). Raises ArgumentError for
  # a :timeout its server's call would refuse.
  defp keeper_wait(opts) do
    case Keyword.get(opts, :timeout, @default_timeout) do
      :infinity ->
        :infinity

      timeout when is_integer(timeout) and timeout in 0..0xFFFFFFFF ->
        min(timeout + 1_000, 0xFFFFFFFF)

      other ->
        raise ArgumentError,
              ":timeout: expected :infinity or an integer of milliseconds in 0..4294967295, " <>
                "got #{inspect(other)}"
    end
  end

  @doc """
  Frees the group's model `name` on every member (and takes it out of what later members
  load). Every member is asked at once, and the answer comes by one deadline, `:timeout` and a
  second. A member with sessions of it open refuses (`:invalid_argument`): close them first. A
  member that does not answer by the deadline (its node frozen or cut off) gives `:timeout`, as
  for `load_model/4`: it may still hold the model. The other members free it all the same; the
  name stays the model's (`load_model/4` refuses another under it) until a free succeeds on
  every member.
  """
  @spec free_model(group, String.t(), ScanBridge.call_opts()) :: :ok | ScanBridge.error()
  def free_model(group, name, opts \\ []) do
    name = name!(name, "free_model name")
    opts = ScanBridge.opts!(opts, [:timeout], "free_model")
    # a bad :timeout raises here, not in every member
    wait = keeper_wait(opts)

    # one tag for every member's record of the free (ScanBridge.Cluster.Member's versions)
    free = {:free, name, opts, {node(), System.unique_integer([:positive])}}

    # A member whose server went away has freed the model with its server; one that does not
    # answer in time (its node frozen or cut off) may still hold it, and name it to later members.
    case first_failure(ask_keepers(Member.keepers(group), free, deadline(wait))) do
      nil -> :ok
      error -> error
    end
  end

  @doc """
  The group's models as each member holds them, to check that the members agree (after a
  partition, say: docs/cluster.md, "Partitions"). Every member is asked at once; one that does
  not answer by the deadline (`:timeout`, as for `free_model/3`) is left out.

  `{:ok, members}`, each `%{node: node, server: pid, models: %{name => model}}` with `model`
  `%{source: path | :sent, dtype: String.t(), model: id | nil, version: non_neg_integer}`:
  `:sent` for a model sent as config and weights, `model` nil where it is recorded but not
  loaded there (its load failed, or is under way), `version` the name's version there (a
  newer one wins when members meet again).
  """
  @spec catalogue(group, ScanBridge.call_opts()) :: {:ok, [map]}
  def catalogue(group, opts \\ []) do
    opts = ScanBridge.opts!(opts, [:timeout], "catalogue")
    results = ask_keepers(Member.keepers(group), :describe, deadline(keeper_wait(opts)))
    {:ok, for({_keeper, {:ok, member}} <- results, do: member)}
  end

  ## Sessions

  @doc """
  Opens a session on a member of `group` (the one with the fewest sessions kept from this
  node) and returns its handle, for `step/3`, `model_step/3`, `model_forward/3`, `scan/3` and
  `ssd_scan/3` (given the session in place of the group), `session_state/2`, `snapshot/2`,
  `restore/3` and `close_session/2` of this module.

  `dims` as for `ScanBridge.open_session/3`, with `model:` a name given to `load_model/4`.
  Options:

    * `:checkpoint` - `n`, a positive integer: every n frames (calls that advance the state)
      the session's state is copied to this node, and the frames since are kept here. The
      copy rides on the n-th frame's reply (`return_state`), so it costs no round trip of its
      own; the caller gets the reply it asked for, without the state unless it asked too. When the session's server goes away, the session is
      rebuilt on another member from the copy and the kept frames are run again there; the
      call in flight is then answered from the new server. Without it (the default) a session
      whose server goes away is lost: its calls answer `:session_lost`.
    * `:timeout` - ms for opening.

  The session belongs to the calling process: it is closed when that process exits.
  """
  @spec open_session(group, map | keyword, session_opts) :: {:ok, session} | ScanBridge.error()
  def open_session(group, dims, opts \\ []) do
    opts = session_opts!(opts, "open_session")
    Session.open(group, session_dims!(dims), opts)
  end

  defp session_opts!(opts, op) do
    opts = ScanBridge.opts!(opts, [:checkpoint, :timeout], op)

    case Keyword.get(opts, :checkpoint) do
      nil ->
        opts

      n when is_integer(n) and n > 0 ->
        opts

      other ->
        raise ArgumentError, "#{op} :checkpoint: expected a positive integer, got #{inspect(other)}"
    end
  end

  defp session_dims!(dims) do
    dims = if is_list(dims) and Keyword.keyword?(dims), do: Map.new(dims), else: dims

    unless is_map(dims) and not is_struct(dims) do
      raise ArgumentError,
            "open_session dims: expected a map or keyword list, got #{inspect(dims, limit: 5)}"
    end

    # a group model's session, its model named by either key (a plain session's :state is a size)
    model? = is_map_key(dims, :model) or is_map_key(dims, "model")

    dims
    |> initial_state_as_h0()
    |> Map.new(fn
      {key, model} when key in [:model, "model"] ->
        {:model, name!(model, "open_session model")}

      {key, _value} when key in [:state, "state"] and model? ->
        raise ArgumentError,
              "open_session: expected no state: for a cluster session (its checkpoints are the " <>
                "client's), got one"

      entry ->
        entry
    end)
  end

  # The initial state under :h0 whichever name it came by (mamba_ssm's :initial_states, or a
  # string key): a rebuild and a fork give the session its checkpoint as :h0, beside which
  # another name for it was refused as given twice.
  defp initial_state_as_h0(dims) do
    case Enum.filter([:h0, "h0", :initial_states, "initial_states"], &is_map_key(dims, &1)) do
      [] ->
        dims

      [key] ->
        dims |> Map.delete(key) |> Map.put(:h0, Map.fetch!(dims, key))

      keys ->
        raise ArgumentError,
              "open_session: expected the initial state once, as h0 or initial_states, got " <>
                inspect(keys)
    end
  end

  @doc "`ScanBridge.step/4` on a cluster session. Options: `:timeout`."
  @spec step(session, ScanBridge.inputs(), ScanBridge.call_opts()) ::
          {:ok, ScanBridge.step_result()} | ScanBridge.error()
  def step(%Session{} = session, inputs, opts \\ []), do: Session.call(session, :step, inputs, opts)

  @doc """
  `ScanBridge.model_step/4` on a cluster session. Options: `:output`, `:return_state`,
  `:snapshot_into`, `:timeout`.

  `snapshot_into: snapshot` (a snapshot of this session from `snapshot/2`) makes it the state
  before this frame, in the frame's own request: the server's copy is taken there, and with
  `checkpoint:` the keeper keeps, as for `snapshot/2`, the checkpoint and frames that reproduce
  it. After a failover the snapshot is kept by those alone (no copy on the new server), and
  `restore/3` reopens the session from them as it does for any snapshot taken before one.
  """
  @spec model_step(session, ScanBridge.model_input(), keyword) ::
          {:ok, ScanBridge.model_result()} | ScanBridge.error()
  def model_step(%Session{} = session, input, opts \\ []) do
    _fetched =
      opts |> ScanBridge.keyword!("Cluster.model_step") |> snapshot_into!("Cluster.model_step")

    Session.call(session, :model_step, input, opts)
  end

  defp snapshot_into!(opts, what) do
    case Keyword.fetch(opts, :snapshot_into) do
      {:ok, snapshot} when not is_reference(snapshot) ->
        raise ArgumentError,
              "#{what} :snapshot_into: expected a snapshot of this session " <>
                "(Cluster.snapshot/2), got #{inspect(snapshot, limit: 5)}"

      fetched ->
        fetched
    end
  end

  @doc "`ScanBridge.model_forward/4` on a cluster session; options as there."
  @spec model_forward(session, ScanBridge.model_input(), ScanBridge.model_forward_opts()) ::
          {:ok, ScanBridge.model_result()} | ScanBridge.error()
  def model_forward(%Session{} = session, input, opts \\ []),
    do: Session.call(session, :model_forward, input, opts)

  @doc "The session's state, as `ScanBridge.session_state/3` gives it. Options: `:timeout`."
  @spec session_state(session, ScanBridge.call_opts()) ::
          {:ok, Tensor.t() | ScanBridge.model_state()} | ScanBridge.error()
  def session_state(%Session{} = session, opts \\ []),
    do: Session.call(session, :session_state, nil, opts)

  @doc """
  Closes the session on its server and stops its keeper, answering by `:timeout` (plus at most
  100 ms, as every call): a member that does not answer the close by then gives
  `{:error, %ScanBridge.Error{reason: :timeout}}`, and the keeper stops all the same (the
  member's server closes the session when it sees the keeper go). A member whose server went
  away before or during the close took the session along: `:ok`. The session's snapshots are
  freed by the same deadline (and within 2 s); what it leaves no time for, the member's server
  frees when it sees the keeper go.
  """
  @spec close_session(session, ScanBridge.call_opts()) :: :ok | ScanBridge.error()
  def close_session(%Session{} = session, opts \\ []), do: Session.close(session, opts)

  @doc """
  A snapshot of the session's whole state, for `restore/3` (rollback netcode): a reference that
  this session's keeper holds. The state is copied on its server (`ScanBridge.snapshot/3`), and,
  when the session keeps checkpoints, the keeper also keeps the checkpoint and the frames
  answered since, so the snapshot survives its server: after a failover it is restored by
  opening the session afresh from them. Without `:checkpoint` a snapshot goes with its server.
  Options: `:timeout`.
  """
  @spec snapshot(session, ScanBridge.call_opts()) :: {:ok, reference} | ScanBridge.error()
  def snapshot(%Session{} = session, opts \\ []), do: Session.snapshot(session, opts)

  @doc """
  Puts `snapshot` (of this session, `snapshot/2`) back: on the server that holds its copy in one
  round trip, else (after a failover) by reopening the session from its checkpoint and running
  its kept frames again. The snapshot stays, for restoring again. A snapshot this session does
  not hold, or one that went with its server, answers `:unknown_snapshot`. A restore on the
  session's server that times out leaves the session `:unsure`, as a frame that times out does.
  Where no member takes the reopened session in time, the error is answered and the next call
  reopens it; a session that cannot be reopened from the snapshot otherwise is lost
  (`:session_lost` from then on). Options: `:timeout`.
  """
  @spec restore(session, reference, ScanBridge.call_opts()) :: :ok | ScanBridge.error()
  def restore(%Session{} = session, snapshot, opts \\ []),
    do: Session.restore(session, snapshot, opts)

  @doc """
  Puts `snapshot` back as `restore/3` does and runs `frames` on the session
  (`ScanBridge.restore_with_frames/5`'s): a rollback and its re-simulation, in one round trip
  on the server that holds the snapshot's copy. After a failover the session is reopened from
  the snapshot's checkpoint and kept frames first, and `frames` run there after. They are kept
  for a rebuild as the session's own calls are. Returns each frame's result, in order. A frame
  that fails leaves the session holding the snapshot's state; one that cannot be sent raises
  `ArgumentError` in the caller, nothing done. Options: `:timeout`.

  A `:model_step` frame's `snapshot_into: other` (another snapshot of this session) refreshes a
  rollback ring as the frames run: `other` takes the state before that frame, as
  `model_step/3`'s `snapshot_into:` would give it. Into `snapshot` itself it is
  `:invalid_argument`, nothing done: a frame failing after it would restore it again. A call
  that fails or times out leaves every snapshot its frames step into as a `model_step/3` into
  it that failed or timed out does: its server's alone, and restoring one whose copy the frames
  left undefined (SPEC §6.4) is `:state_lost`, never another state.
  """
  @spec restore_with_frames(session, reference, [ScanBridge.frame()], ScanBridge.call_opts()) ::
          {:ok, [term]} | ScanBridge.error()
  def restore_with_frames(%Session{} = session, snapshot, frames, opts \\ []) do
    frames = ScanBridge.frames!(frames, "Cluster.restore_with_frames")

    into =
      for {{:model_step, _input, frame_opts}, i} when is_list(frame_opts) <-
            Enum.with_index(frames),
          {:ok, into} <- [snapshot_into!(frame_opts, "Cluster.restore_with_frames frame #{i}")],
          do: {i, into}

    # Checked and encoded here, as ScanBridge does before it sends anything: after a failover
    # the keeper reopens the session from the snapshot before it sends the frames.
    {sent, _calls} =
      frames
      |> Enum.map(&without_snapshot_into/1)
      |> ScanBridge.frames_arg!("Cluster.restore_with_frames")

    {_head, _size} = Protocol.request_head("session_restore", %{frames: sent})

    case List.keyfind(into, snapshot, 1) do
      nil -> Session.restore_with_frames(session, snapshot, frames, opts)
      {i, _restored} -> {:error, into_restored(i)}
    end
  end

  # A frame without its snapshot_into: (a reference here, the snapshot's id on its server there).
  defp without_snapshot_into({:model_step, input, opts}) when is_list(opts),
    do: {:model_step, input, Keyword.delete(opts, :snapshot_into)}

  defp without_snapshot_into(frame), do: frame

  defp into_restored(i) do
    Error.client(
      :invalid_argument,
      "Cluster.restore_with_frames frame #{i} :snapshot_into: expected a snapshot other than " <>
        "the one restored (a frame failing after it would restore that one again), got it",
      %{"field" => "args.frames[#{i}].args.snapshot_into"}
    )
  end

  @doc """
  A new cluster session holding a copy of `session`'s state, stepped independently (speculative
  simulation): the state is read from the session's server and the fork opened from it on the
  least loaded member, as its first checkpoint. It belongs to the calling process. Options:
  `:checkpoint` (default: the session's), `:timeout`.
  """
  @spec fork(session, session_opts) :: {:ok, session} | ScanBridge.error()
  def fork(%Session{} = session, opts \\ []), do: Session.fork(session, session_opts!(opts, "fork"))

  @doc "Frees a snapshot `snapshot/2` took (closing the session frees them all). Options: `:timeout`."
  @spec free_snapshot(session, reference, ScanBridge.call_opts()) :: :ok | ScanBridge.error()
  def free_snapshot(%Session{} = session, snapshot, opts \\ []),
    do: Session.free_snapshot(session, snapshot, opts)

  @doc """
  Where a session is and how it fares: `%{member: pid, node: node, session: id, failovers: n,
  frames_since_checkpoint: n, status: status}`: `member` the server that keeps it (nil between
  its server's end and its rebuild), `session` its id there, `status` `:ok`, `:unsure` (a frame
  timed out), `:tainted` (a frame was answered after that: no failover until the next
  checkpoint) or `:lost`.
  """
  @spec session_info(session) :: {:ok, session_info} | ScanBridge.error()
  defdelegate session_info(session), to: Session, as: :info

  ## Helpers

  # At most the 256 bytes a server takes as a model's name (SPEC §6.4): each member is given it,
  # and one longer was refused there naming `args.name`, which the caller never sent.
  defp name!(name, _what) when is_binary(name) and name != "" and byte_size(name) <= 256, do: name

  defp name!(other, what),
    do:
      raise(
        ArgumentError,
        "#{what}: expected a non-empty string of at most 256 bytes, got #{inspect(other, limit: 5)}"
      )

  @doc false
  @spec deadline(timeout) :: deadline
  def deadline(:infinity), do: :infinity

  # at most what ScanBridge's calls take (2^32 - 1 ms): a longer one raises here, in the caller,
  # not in a session's keeper, which it would stop
  def deadline(ms) when is_integer(ms) and ms in 0..0xFFFFFFFF,
    do: System.monotonic_time(:millisecond) + ms

  def deadline(other),
    do:
      raise(
        ArgumentError,
        ":timeout: expected :infinity or an integer of ms in 0..4294967295, got #{inspect(other)}"
      )

  @doc false
  @spec remaining(deadline) :: timeout
  def remaining(:infinity), do: :infinity

  def remaining(deadline) when is_integer(deadline),
    do: max(deadline - System.monotonic_time(:millisecond), 0)
end
