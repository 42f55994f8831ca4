defmodule ScanBridge.Server do
  @moduledoc """
  The process that owns one scan-bridge server: its OS process (a Port running
  `python -m bridge`) and, with `transport: {:unix, path}`, a unix-socket connection to it.

  Many callers are served at once. A call is sent as soon as it arrives and the caller waits
  in `pending` (id → caller) while this process goes on; each reply is matched by its id and
  answered with `GenServer.reply/2`. Every call has a deadline kept here, counted from when
  its caller made it (a caller on another node: from when this process takes it): when it
  passes, the caller gets `{:error, %ScanBridge.Error{reason: :timeout}}` and the server's late
  reply is dropped (as is one that came in time but is taken here after its caller stopped
  waiting), but what a late `put`, `session_open`, `session_fork`, `session_snapshot` or
  `model_load` made (which no caller will ever learn of) is freed here at once, so that timeouts
  leave no handles, sessions, snapshots or models on the server. A call that waited in this
  process's mailbox past its deadline (the process busy, or still starting) is never sent: it
  is answered `:overloaded`, as a queued one is below.

  A caller on another node waits from when it made the call, on a clock this process cannot
  read: a call that took longer on the way than the caller's grace past its deadline (in
  transit, or in this busy process's mailbox) may be answered here after its caller stopped
  waiting. Such a caller says so when it stops, and its request is given up as at its deadline;
  and it says when it has taken an answer that made something, which is freed here instead if
  it gave up or exits first.

  A server that takes deadlines (its info lists the `cancel` op, which came with
  `deadline_us`, SPEC §4, §6) is told each request's budget: what is left of its deadline when
  it is sent, as `deadline_us`; it answers one that could not start within it
  `deadline_exceeded` without running it. And when a caller gives up on a request at the
  server (its deadline passed, or it exited), this process sends `cancel` for it, past
  `:max_in_flight`: a request that has not started is dropped (answered `cancelled`, an answer
  dropped here like any late one), so that the server's time goes to callers still waiting; one
  that has started runs to its end, and its late reply is dropped and released as above. An
  older server gets neither (it would refuse the envelope key as `invalid_request`). On the
  Port lane (stdio has no per-connection cap) the cancel goes at once. On the unix lane it
  keeps to the server's cap, which counts a cancel until it answers it and leaves frames past
  it unread, behind the very requests they name: a cancel goes at once while fewer than the
  cap are at the server, and otherwise waits here for replies to make room, going out before
  queued requests, oldest first, and dropped unsent if its request is answered meanwhile. So
  with a cap of 1 no cancel is sent: the request's `deadline_us` still bounds it there. The
  periodic health check (`:health_check`), which the server also answers as it reads it while
  its work keeps completing (SPEC §6), keeps to that cap the same way, after held cancels and
  before queued requests; held, its timeout still runs.

  At most `:max_in_flight` requests are at the server at once; more wait here, in order,
  under their own deadlines. A queued request whose deadline passes, or whose caller exits, is
  dropped, never sent (the first answered `:overloaded`, which unlike `:timeout` says that the
  server surely did not do it): while the server does not answer, the queue holds only the
  requests of callers still waiting, and the frees this process sends on its own (of what a
  late reply made, or an opener left), which have no deadline and wait their turn. A caller
  that exits while its request is at the server is treated as one whose deadline passed: it is
  cancelled, and what it made is freed when the reply comes.

  A frame the server had no memory to hold is read and dropped there, its id unread, and
  answered with an error whose id is nil and whose detail has the frame's body `length`
  (`limit_exceeded`, `limit: "memory"`: SPEC §2). That answer goes to the request at the server
  whose body has that length, and its in-flight place is freed, as any answered request's is.
  Where several that long are there, the server answered as it read the frame, while an older
  one may be running: the answer waits until the others have their own replies, and goes to
  the one left (each keeping its place meanwhile). A reply that names no request otherwise (an
  error with id nil and no length, for a frame whose id the server could not read, or one that
  cannot be decoded) goes the same way to one of those at the server when it came: the one
  left once the others have their own replies.

  Sending never suspends this process, even while the server reads nothing: the Port is opened
  with `busy_limits_port: :disabled` and the socket with the highest `high_watermark`, so the
  frames of the requests in flight wait in the lane's queue, and deadlines and replies are
  served meanwhile.

  Start-up waits for the server to answer a `ping` (and, on the unix lane, for the socket to
  accept and answer one too), so a started client is a ready one. It then reads the server's
  `limits` from `info`: a request bigger than the server's `max_frame_size` is refused here,
  not sent (the server would read it only to drop it, answering `frame_too_large`), and on
  the unix lane `:max_in_flight` is kept one below the server's `max_in_flight_per_peer` (past
  which the server leaves requests unread in the socket, where more would only wait in the
  lane's queue instead of this one's, out of reach of their deadlines; the place left is for
  cancels and health checks, which go past `:max_in_flight` but not past that cap: cancels must
  be read to drop what they name, and a health check is answered as it is read).

  When the server's OS process exits or its lane closes, every waiting caller gets
  `{:error, %ScanBridge.Error{reason: :server_exited}}` and this process stops, for its
  supervisor to start a fresh one (where the Port closed with no exit status, a broken pipe
  say, a process of its own sees the server gone, killing it after `:exit_grace` ms, so that
  this one's exit does not wait). When this process stops, the server's stdin closes and the
  server exits (within a second); if it is still there after `:exit_grace` ms it is killed. If
  this process is killed, the BEAM closes the Port and the server exits on its own.

  The server's stderr (its log) is inherited from the BEAM, never mixed into the frames.

  Started with `group:`, once its server answers this process links a
  `ScanBridge.Cluster.Member`, which loads the group's models and then puts this process in the
  group's `:pg` group; if either stops, so does the other. Stopping, this process leaves the
  group first, so that no call is routed to it while it waits for its server to exit. Such a
  server also closes the sessions a process opened (`session_open`, `session_fork`) and frees
  the snapshots it took (`session_snapshot`) when that process exits: a cluster session's
  keeper may sit on another node and go down with it, leaving nobody to close them (snapshots
  belong to the connection, not to a session, so closing its sessions would leave them).

  Use it through `ScanBridge`.
  """

  use GenServer
  require Logger

  alias ScanBridge.{Cluster, Error, Protocol, Unexpected}

  @defaults [
    python: nil,
    args: [],
    env: [],
    name: nil,
    transport: :port,
    max_in_flight: 256,
    max_frame_size: 256 * 1024 * 1024,
    startup_timeout: 60_000,
    exit_grace: 2_000,
    group: nil,
    health_check: nil
  ]
  # Socket and driver buffers of the unix lane: the size the server gives its side
  # (bridge/transports/unix.py), chosen from a sweep while developing that was not recorded.
  @socket_buffer 4 * 1024 * 1024
  # The most the inet driver takes for a socket's high watermark (a C int): below it a send
  # never suspends this process. What waits there is bounded by :max_in_flight frames.
  @socket_high_watermark 0x7FFFFFFF
  @connect_retry_ms 10
  # How long a server killed after :exit_grace may take to be gone (and reaped).
  @kill_wait_ms 1_000
  # What stopping takes beyond those waits (closing the port and the socket), with room to spare.
  @stop_margin_ms 2_000
  # The largest body a frame's 4-byte length prefix can say (SPEC §2, the lanes' packet 4):
  # a bigger one would wrap the prefix and desynchronise the stream.
  @max_frame_limit 0xFFFFFFFF
  # The longest timer (Process.send_after) and receive timeout the BEAM takes: 2^32 - 1 ms.
  @max_timeout_ms 0xFFFFFFFF
  # How long past a request's deadline its caller waits for this process's answer (which comes
  # at the deadline) before giving up on it: this process may sit on a node that has frozen or
  # been cut off, where nothing answers until the distribution notices, seconds later.
  @answer_grace_ms 50
  # What check!/4 says a timeout must be, built once at compile time (every request checks one).
  @timeout_expected ":infinity or an integer of milliseconds in 0..#{@max_timeout_ms}"

  @typedoc "Options for `start_link/1`; see `ScanBridge.start_link/1`."
  @type option ::
          {:python, String.t()}
          | {:args, [String.t()]}
          | {:env, [{String.t(), String.t() | nil}] | %{String.t() => String.t() | nil}}
          | {:name, GenServer.name()}
          | {:transport, :port | {:unix, Path.t()}}
          | {:max_in_flight, pos_integer}
          | {:max_frame_size, pos_integer}
          | {:startup_timeout, timeout}
          | {:exit_grace, non_neg_integer}
          | {:group, term}
          | {:health_check, nil | [interval: pos_integer, timeout: pos_integer]}

  defstruct [
    :port,
    :os_pid,
    :socket,
    :max_in_flight,
    :max_frame_size,
    :exit_grace,
    :group,
    # [interval: ms, timeout: ms] of the periodic health check, or nil
    :health_check,
    # the group's membership (ScanBridge.Cluster.Member), linked, when started with :group
    :member,
    # the id of the health check the server has yet to answer, or nil; one not in `outstanding`
    # waits for room under server_max_in_flight (send_health/1)
    health_pending: nil,
    # whether the server takes deadline_us and cancel (SPEC §4, §6: its info lists cancel); an
    # older one would refuse a request with deadline_us as invalid
    deadlines: false,
    # the server's cap on this connection's requests in flight, cancels included (info's
    # max_in_flight_per_peer), on the unix lane; nil on the Port lane, which has none, or from
    # a server whose info lacks it
    server_max_in_flight: nil,
    # ids of requests given up at the server whose cancels wait for room under
    # server_max_in_flight, oldest first; one whose request is answered meanwhile is dropped
    held_cancels: :queue.new(),
    next_id: 0,
    # the group's model names (ScanBridge.Cluster.load_model/4) => {this server's model id, the
    # model's fingerprint}
    models: %{},
    # with :group, the processes that opened sessions or took snapshots => {monitor, a set of
    # {:session, id} and {:snapshot, id}}, and each one's opener, to close or free what an
    # opener leaves when it exits
    openers: %{},
    opener_of: %{},
    # id => {from, deadline timer, monitor of the caller, deadline (monotonic µs) or nil}:
    # callers waiting for an answer
    pending: %{},
    # id => {op, its body's length} of the requests sent to the server and not yet answered by
    # it (including timed-out ones, whose late replies may name something to free); the length
    # says which one an answer with id nil (its frame dropped unread) is for
    outstanding: %{},
    # body length => {answers with id nil for a frame that long, oldest first, the ids at the
    # server that long when the latest came}, while those ids are more than the answers: each
    # id answered on its own is ruled out, and once as many are left as answers, they are theirs;
    # and the same under :unattributed for replies naming no request, of any length
    dropped_unread: %{},
    # id => {op, head, body length, deadline} not yet sent because :max_in_flight requests are
    # outstanding (a caller's, or a free without one; head: Protocol.request_head/2's; deadline:
    # its monotonic µs, or nil); ids grow with arrival, so the smallest is the oldest, and a
    # deadline or the caller's exit drops its request in O(log n)
    queue: :gb_trees.empty(),
    # monitor => id of a pending request, to find the request when its caller exits
    callers: %{},
    # callers on other nodes answered with something made (release/3 would free it), which
    # have yet to say they took it => {monitor, op, outcome}: freed if they gave up or exit
    unconfirmed: %{}
  ]

  @doc "Starts the server process and waits until the server answers; see `ScanBridge.start_link/1`."
  @spec start_link([option]) :: GenServer.on_start()
  def start_link(opts) do
    opts = validate!(opts)
    gen_opts = if opts[:name], do: [name: opts[:name]], else: []
    GenServer.start_link(__MODULE__, opts, gen_opts)
  end

  @doc """
  How long stopping a client started with `opts` may take, for a supervisor's `:shutdown`: its
  server's `:exit_grace`, the wait for a killed server to be gone, and #{@stop_margin_ms} ms
  for closing the port and the socket.
  """
  @spec stop_time_ms([option]) :: pos_integer
  def stop_time_ms(opts) do
    # checked here too: a supervisor reads the child spec (ScanBridge.child_spec/1) before
    # start_link/1 checks the options
    opts = ScanBridge.keyword!(opts, "child_spec")

    case Keyword.get(opts, :exit_grace, @defaults[:exit_grace]) do
      grace when is_integer(grace) and grace >= 0 ->
        grace + @kill_wait_ms + @stop_margin_ms

      other ->
        raise ArgumentError, ":exit_grace: expected a non-negative integer, got #{inspect(other)}"
    end
  end

  @doc """
  Sends one request (`op` with `args`, see `ScanBridge.Protocol.request_head/2`) and waits for
  its outcome: `{:ok, result, timing}` or `{:error, %ScanBridge.Error{}}`. The arguments are
  encoded, and `timeout` (ms up to 2^32 - 1, or `:infinity`) checked, in the calling process:
  either raises `ArgumentError` there when it is not valid.
  """
  @spec request(GenServer.server(), String.t(), map, timeout) ::
          {:ok, map, map} | {:error, Error.t()}
  def request(server, op, args, timeout) do
    check!(:timeout, timeout, @timeout_expected, &valid_timeout?/1)
    {head, size} = Protocol.request_head(op, args)

    # The deadline starts here, not where the client process takes the call: a call that waits
    # in its mailbox (a busy process, or one still starting) must not outlive its caller.
    {deadline, wait} =
      if timeout == :infinity,
        do: {:infinity, :infinity},
        else:
          {{timeout, System.monotonic_time(:microsecond) + timeout * 1000},
           min(timeout + @answer_grace_ms, @max_timeout_ms)}

    case call(server, {:request, op, head, size, deadline, closed(op, args)}, wait) do
      {:confirm, outcome} ->
        # what the reply made is ours now: freed by the client process had this caller given up
        GenServer.cast(server, {:taken, self()})
        outcome

      outcome ->
        outcome
    end
  end

  # The session a session_close names, or the snapshot a snapshot_free names, for a group's
  # server to stop watching its opener.
  defp closed("session_close", args), do: args[:session] || args["session"]
  defp closed("snapshot_free", args), do: args[:snapshot] || args["snapshot"]
  defp closed(_op, _args), do: nil

  @doc """
  The `:gen_tcp` options of the unix lane: binaries, packet 4, active, and a send that does
  not suspend the sender while the server reads nothing.
  """
  @spec socket_options() :: [:gen_tcp.connect_option()]
  def socket_options do
    [
      :binary,
      packet: 4,
      active: true,
      recbuf: @socket_buffer,
      sndbuf: @socket_buffer,
      buffer: @socket_buffer,
      high_watermark: @socket_high_watermark,
      low_watermark: @socket_high_watermark
    ]
  end

  @doc "The OS pid of the server process."
  @spec os_pid(GenServer.server()) :: {:ok, pos_integer} | {:error, Error.t()}
  def os_pid(server), do: call(server, :os_pid, :infinity)

  @doc """
  The id on this server of the group's model `name` (`ScanBridge.Cluster.load_model/4`), or
  nil when it has not loaded it. `timeout` (ms, or `:infinity`): past it, and a grace of
  #{@answer_grace_ms} ms, `:timeout` (this process, or its node, does not answer).
  """
  @spec model_named(GenServer.server(), String.t(), timeout) ::
          {:ok, String.t() | nil} | {:error, Error.t()}
  def model_named(server, name, timeout \\ :infinity) do
    with {:ok, entry} <- model_entry(server, name, timeout), do: {:ok, entry && elem(entry, 0)}
  end

  @doc false
  # {the id on this server, the model's fingerprint (ScanBridge.Cluster.Member)} of the group's
  # model `name`, or nil, waited for as `model_named/3` waits: what a cluster session checks
  # that it reopens under the model it ran.
  @spec model_entry(GenServer.server(), String.t(), timeout) ::
          {:ok, {String.t(), term} | nil} | {:error, Error.t()}
  def model_entry(server, name, timeout) do
    check!(:timeout, timeout, @timeout_expected, &valid_timeout?/1)

    wait =
      if timeout == :infinity, do: :infinity, else: min(timeout + @answer_grace_ms, @max_timeout_ms)

    call(server, {:model_entry, name}, wait)
  end

  @doc false
  # Told by the group's membership process when it has loaded ({id, fingerprint}) or freed
  # (nil) a group model.
  @spec name_model(GenServer.server(), String.t(), {String.t(), term} | nil) :: :ok
  def name_model(server, name, entry), do: GenServer.cast(server, {:name_model, name, entry})

  defp call(server, message, wait) do
    # The deadline is this process's (answered in handle_info); the caller waits a little past
    # it, for a process that cannot answer at all. If this process dies meanwhile, the call
    # exits, and that becomes an error naming what happened.
    GenServer.call(server, message, wait)
  catch
    :exit, {:noproc, _call} ->
      {:error,
       Error.client(:not_running, "no scan-bridge client process is running as #{inspect(server)}")}

    :exit, {{:nodedown, node}, _call} ->
      {:error,
       Error.client(:node_down, "the node #{node} of the scan-bridge client went down", %{
         "node" => Atom.to_string(node)
       })}

    :exit, {:timeout, _call} ->
      # Its answer, should it come, is dropped now (the call's alias is gone). A caller on another
      # node may stop waiting before its deadline there (counted from when the client took the
      # call): told, the client gives the request up and frees what its answer made. A caller on
      # the client's node shares its clock: the client finds such a request overdue itself, and a
      # client already late would only have more to read.
      tell_gave_up(server)

      {:error,
       Error.client(
         :timeout,
         "no answer from the scan-bridge client #{inspect(server)} before the deadline " <>
           "(#{@answer_grace_ms} ms past it): its node may be cut off or frozen",
         %{"node" => server_node(server)}
       )}

    :exit, {reason, _call} ->
      {:error,
       Error.client(:server_exited, "the scan-bridge client process exited: #{inspect(reason)}", %{
         "exit_reason" => inspect(reason)
       })}
  end

  defp tell_gave_up(server) do
    case GenServer.whereis(server) do
      pid when is_pid(pid) and node(pid) != node() -> GenServer.cast(pid, {:gave_up, self()})
      {_name, where} = remote when where != node() -> GenServer.cast(remote, {:gave_up, self()})
      _here_or_gone -> :ok
    end
  end

  defp server_node(server) when is_pid(server), do: Atom.to_string(node(server))
  defp server_node({_name, node}) when is_atom(node), do: Atom.to_string(node)
  defp server_node(_local), do: Atom.to_string(node())

  ## Callbacks

  # Requests that free what a connection holds (release/3 sends them too).
  @releases ["session_close", "free", "snapshot_free", "model_free"]

  @impl true
  def init(opts) do
    Process.flag(:trap_exit, true)
    deadline = deadline(opts[:startup_timeout])

    state = %__MODULE__{
      max_in_flight: opts[:max_in_flight],
      max_frame_size: opts[:max_frame_size],
      exit_grace: opts[:exit_grace],
      group: opts[:group],
      health_check: opts[:health_check]
    }

    with {:ok, state} <- open_port(state, opts),
         {:ok, state} <- handshake(state, :port, deadline),
         {:ok, state} <- connect_lane(state, opts[:transport], deadline),
         {:ok, state} <- adopt_limits(state, deadline) do
      if state.health_check, do: send(self(), :health_check)

      if state.group == nil, do: {:ok, state}, else: {:ok, state, {:continue, :join}}
    else
      {:error, %Error{} = error, state} ->
        _state = stop_server(state)
        {:stop, error}
    end
  end

  @impl true
  def handle_call({:request, op, head, size, deadline, closes}, {caller, _tag} = from, state) do
    left_us = time_left_us(deadline, caller)
    # the budget's entry is added when there is one to send
    size = if budget?(state, left_us), do: size + Protocol.deadline_entry_size(), else: size

    cond do
      size > state.max_frame_size ->
        limit = state.max_frame_size

        error =
          Error.client(
            :frame_too_large,
            "request of #{size} bytes exceeds the limit of #{limit} bytes",
            %{"length" => size, "limit" => limit}
          )

        {:reply, {:error, error}, state}

      left_us != :infinity and left_us <= 0 ->
        # Its caller has given up, or is about to: sent, it would run for nobody, and what it
        # made would never be freed. Like a request queued past its deadline, it was not done.
        error =
          Error.client(
            :overloaded,
            "the deadline passed before the scan-bridge client process took the request " <>
              "(it was busy, or starting): it was never sent"
          )

        {:reply, {:error, error}, state}

      true ->
        {:noreply, accept(state, op, {head, size}, left_us, closes, from, caller)}
    end
  end

  def handle_call(:os_pid, _from, state), do: {:reply, {:ok, state.os_pid}, state}

  def handle_call({:model_entry, name}, {caller, _tag}, state) do
    entry = Map.get(state.models, name)
    if state.group != nil, do: Cluster.Balancer.learn_model(node(caller), self(), name, entry)
    {:reply, {:ok, entry}, state}
  end

  def handle_call(request, _from, state), do: {:reply, Unexpected.call(__MODULE__, request), state}

  @impl true
  def handle_cast({:name_model, name, nil}, state) do
    Cluster.Balancer.forget_model(self(), name)
    {:noreply, %{state | models: Map.delete(state.models, name)}}
  end

  def handle_cast({:name_model, name, entry}, state),
    do: {:noreply, %{state | models: Map.put(state.models, name, entry)}}

  # A caller on another node took a reply that made something (answer_caller/4): it is theirs.
  def handle_cast({:taken, pid}, state) do
    case take_unconfirmed(state, pid) do
      {nil, state} -> {:noreply, state}
      {{op, outcome}, state} -> {:noreply, watch_opener(state, op, {pid, nil}, outcome)}
    end
  end

  # A caller on another node stopped waiting before this process answered it (call/3), or
  # before its answer reached it: treated as one whose deadline passed, and what an answer it
  # never took made is freed.
  def handle_cast({:gave_up, pid}, state) do
    ids = for {id, {{^pid, _tag}, _timer, _monitor, _deadline}} <- state.pending, do: id

    state =
      Enum.reduce(ids, state, fn id, state ->
        {_from, _where, state} = give_up(state, id)
        state
      end)

    {:noreply, state |> release_unconfirmed(pid) |> send_queued()}
  end

  def handle_cast(request, state) do
    Unexpected.cast(__MODULE__, request)
    {:noreply, state}
  end

  # Started once this server answers, so that the group never routes to one that does not.
  @impl true
  def handle_continue(:join, state) do
    {:ok, member} = ScanBridge.Cluster.Member.start_link(server: self(), group: state.group)
    {:noreply, %{state | member: member}}
  end

  @impl true
  def handle_info({port, {:data, body}}, %{port: port} = state),
    do: {:noreply, on_reply(body, state)}

  def handle_info({:tcp, socket, body}, %{socket: socket} = state),
    do: {:noreply, on_reply(body, state)}

  def handle_info({:deadline, id}, state) do
    case give_up(state, id) do
      {nil, _where, state} ->
        {:noreply, state}

      {from, :queued, state} ->
        GenServer.reply(from, {:error, never_sent(state, id)})
        {:noreply, state}

      {from, :sent, state} ->
        GenServer.reply(from, {:error, timed_out(state, id)})
        {:noreply, state}
    end
  end

  # Its timeout runs from here, whether it goes at once or waits for room (send_health/1).
  def handle_info(:health_check, state) do
    id = state.next_id
    Process.send_after(self(), {:health_deadline, id}, state.health_check[:timeout])
    {:noreply, send_health(%{state | next_id: id + 1, health_pending: id})}
  end

  def handle_info({:health_deadline, id}, %{health_pending: id} = state) when id != nil do
    held =
      if is_map_key(state.outstanding, id),
        do: "",
        else: " (never sent: the server's cap of #{state.server_max_in_flight} stayed full)"

    why =
      "the server did not answer its health check within #{state.health_check[:timeout]} ms" <>
        held

    handle_info({:unhealthy, why}, state)
  end

  # Stopped for the supervisor to start a fresh server: this one's OS process is killed at
  # once. Given :exit_grace, a server that stopped answering would not read its stdin's end
  # either, and its sessions' failover and the fresh server would wait out the grace.
  def handle_info({:unhealthy, why}, state) do
    Logger.error("scan-bridge: #{why}; killing it")
    state = fail_all(state, "the server was stopped as unhealthy: #{why}", %{})
    if state.os_pid, do: kill_os_process(state.os_pid)
    {:stop, {:shutdown, {:unhealthy, why}}, %{state | os_pid: nil}}
  end

  # A group's session opener is gone: its sessions are closed (watch_opener/4).
  def handle_info({:DOWN, monitor, :process, pid, _reason}, state)
      when is_map_key(state.openers, pid) and
             elem(:erlang.map_get(pid, state.openers), 0) == monitor do
    {{_monitor, held}, openers} = Map.pop(state.openers, pid)
    state = %{state | openers: openers, opener_of: Map.drop(state.opener_of, MapSet.to_list(held))}

    state =
      Enum.reduce(held, state, fn
        {:session, id}, state -> send_uncalled(state, "session_close", %{session: id})
        {:snapshot, id}, state -> send_uncalled(state, "snapshot_free", %{snapshot: id})
      end)

    {:noreply, send_queued(state)}
  end

  # A caller on another node exited before saying it took a reply that made something.
  def handle_info({:DOWN, monitor, :process, pid, _reason}, state)
      when is_map_key(state.unconfirmed, pid) and
             elem(:erlang.map_get(pid, state.unconfirmed), 0) == monitor,
      do: {:noreply, state |> release_unconfirmed(pid) |> send_queued()}

  # The caller is gone: nobody will take the answer. As with a passed deadline, a queued
  # request is dropped, one at the server cancelled, and a late reply's handle or session is
  # freed; but a release is carried out all the same (orphan/2).
  def handle_info({:DOWN, monitor, :process, _caller, _reason}, state)
      when is_map_key(state.callers, monitor) do
    id = state.callers[monitor]

    if release?(op_of(state, id)) do
      {:noreply, orphan(state, id)}
    else
      {_from, _where, state} = give_up(state, id)
      {:noreply, state}
    end
  end

  def handle_info({port, {:exit_status, status}}, %{port: port} = state) do
    message = "the server exited with status #{status}"
    # an exit status means the OS process is gone (reaped): there is nothing to wait for
    state = fail_all(%{state | port: nil, os_pid: nil}, message, %{"exit_status" => status})
    {:stop, {:shutdown, {:server_exited, status}}, state}
  end

  def handle_info({:EXIT, port, reason}, %{port: port} = state) do
    state = fail_all(%{state | port: nil}, "the server's port closed: #{inspect(reason)}", %{})
    # No exit status: typically a write found the server's stdin closed (:epipe), so it is
    # exiting or gone. A process of its own makes sure of that, so that this client's exit,
    # which its callers and a cluster's failover wait for, does not wait on the file system.
    # (its fields bound first: a closure over `state` would copy all of it into the watcher)
    %{os_pid: os_pid, exit_grace: grace} = state
    _watcher = if os_pid, do: spawn(fn -> await_os_exit(os_pid, grace) end)
    {:stop, {:shutdown, {:server_exited, reason}}, %{state | os_pid: nil}}
  end

  def handle_info({:tcp_closed, socket}, %{socket: socket} = state) do
    state = fail_all(%{state | socket: nil}, "the server closed the unix socket", %{})
    {:stop, {:shutdown, :lane_closed}, state}
  end

  # The group membership went down: a server out of its group is not what was started.
  def handle_info({:EXIT, member, reason}, %{member: member} = state) when member != nil do
    state = fail_all(state, "the server's group membership stopped: #{inspect(reason)}", %{})
    {:stop, {:shutdown, {:member_exited, reason}}, state}
  end

  def handle_info({:tcp_error, socket, reason}, %{socket: socket} = state) do
    :gen_tcp.close(socket)
    state = fail_all(%{state | socket: nil}, "unix socket error: #{inspect(reason)}", %{})
    {:stop, {:shutdown, {:lane_error, reason}}, state}
  end

  # Exit signals of other linked ports (the socket) and timers of answered calls.
  def handle_info(_message, state), do: {:noreply, state}

  @impl true
  def terminate(reason, state) do
    # Out of the group first: stopping waits for the OS process (up to :exit_grace and the
    # kill), and calls routed here meanwhile would wait with it, never served.
    if state.group != nil do
      :pg.leave(Cluster.scope(), Cluster.group_key(state.group), self())
      forget_group_if_stopped(reason, state)
    end

    state |> fail_all("the scan-bridge client stopped", %{}) |> stop_server()
  end

  # A group stopped on purpose, its last member here with it, is forgotten by this node: started
  # again under its name, it starts with no models, as a new group would. A server that failed
  # leaves the catalogue to the member restarted in its place (Cluster.NodeCatalogue).
  defp forget_group_if_stopped(reason, state) when reason in [:normal, :shutdown] do
    others_here =
      Enum.filter(Cluster.Member.keepers(state.group) -- [state.member], &(node(&1) == node()))

    if others_here == [], do: Cluster.NodeCatalogue.forget(state.group)
  end

  defp forget_group_if_stopped(_reason, _state), do: :ok

  ## Requests and replies

  # The answer of a caller whose request waited here past its deadline, never sent: the server
  # had :max_in_flight requests the whole time. Unlike a timeout, this one surely did nothing,
  # so it may be sent again as it is.
  defp never_sent(state, id) do
    Error.client(
      :overloaded,
      "no place at the server before the deadline: #{state.max_in_flight} requests " <>
        "were in flight the whole time, and this one was never sent",
      %{"id" => id, "max_in_flight" => state.max_in_flight}
    )
  end

  # The answer of a caller whose request was sent and not answered by its deadline.
  defp timed_out(state, id) do
    message =
      cond do
        not state.deadlines ->
          "no reply before the deadline"

        # no place for a cancel beside the request (send_cancels)
        state.server_max_in_flight == 1 ->
          "no reply before the deadline (the server drops it if not started within its deadline_us)"

        true ->
          "no reply before the deadline (the server is asked to drop it if not started)"
      end

    Error.client(:timeout, message, %{"id" => id})
  end

  # µs left of a call's deadline (:infinity for none). The caller's monotonic clock is this
  # node's only when the caller runs here; a remote caller's deadline starts here instead.
  defp time_left_us(:infinity, _caller), do: :infinity

  defp time_left_us({_timeout, deadline_us}, caller) when node(caller) == node(),
    do: deadline_us - System.monotonic_time(:microsecond)

  defp time_left_us({timeout, _deadline_us}, _caller), do: timeout * 1000

  # Send request `id`'s body, `length` bytes (without the lane's 4-byte prefix, as the server
  # counts a frame's length: SPEC §2).
  defp transmit(state, id, op, frame, length) do
    case send_frame(state, frame) do
      :ok ->
        %{state | outstanding: Map.put(state.outstanding, id, {op, length})}

      {:error, reason} ->
        # The lane is gone; its exit message follows and answers everyone else.
        case take_pending(state, id) do
          {nil, state} ->
            # a release (release/3) has no caller
            state

          {from, state} ->
            GenServer.reply(
              from,
              {:error, exited("the lane to the server is closed: #{inspect(reason)}", %{})}
            )

            state
        end
    end
  end

  # A request a caller has just made (its head, and its body's size as sent), `left_us` µs
  # before its deadline: numbered, under that deadline (a timer, and its caller watched), then
  # sent, or queued while :max_in_flight requests are at the server.
  defp accept(state, op, {head, size}, left_us, closes, from, caller) do
    id = state.next_id
    state = %{state | next_id: id + 1}
    op = if closes, do: {op, closes}, else: op

    {timer, deadline} =
      if left_us == :infinity,
        do: {nil, nil},
        else:
          {Process.send_after(self(), {:deadline, id}, div(left_us + 999, 1000)),
           System.monotonic_time(:microsecond) + left_us}

    monitor = Process.monitor(caller)

    state = %{
      state
      | pending: Map.put(state.pending, id, {from, timer, monitor, deadline}),
        callers: Map.put(state.callers, monitor, id)
    }

    send_or_queue(state, id, op, {head, size}, deadline)
  end

  # Send request `id` now, or queue it while :max_in_flight requests are at the server or an
  # older one waits.
  defp send_or_queue(state, id, op, {head, size}, deadline) do
    if map_size(state.outstanding) < state.max_in_flight and :gb_trees.is_empty(state.queue),
      do: transmit(state, id, op, request_body(state, head, id, deadline), size),
      else: %{state | queue: :gb_trees.insert(id, {op, head, size, deadline}, state.queue)}
  end

  defp budget?(state, left_us), do: state.deadlines and left_us != :infinity

  # The body of request `id` as it is sent now: with what is left of its deadline as its
  # budget on the server (deadline_us), which then drops it if it cannot start in time.
  defp request_body(%{deadlines: true}, head, id, deadline) when deadline != nil do
    left_us = max(deadline - System.monotonic_time(:microsecond), 0)
    Protocol.request_body(head, id, left_us)
  end

  defp request_body(_state, head, id, _deadline), do: Protocol.request_body(head, id, nil)

  # Give request `id` up (its deadline passed, or its caller exited): its caller is taken out
  # of `pending` (`{from, where, state}`, or `{nil, nil, state}` when answered already). A
  # request still queued here (`:queued`) is never sent, its data going with it. One at the
  # server (`:sent`) stays outstanding, for its late reply to be dropped (and what it made
  # released), and the server is asked to drop it if it has not started (`cancel`): it is then
  # answered `cancelled`, not run, instead of taking the server's time after its caller left.
  defp give_up(state, id) do
    queued? = :gb_trees.is_defined(id, state.queue)

    case take_pending(state, id) do
      {nil, state} -> {nil, nil, state}
      {from, state} when queued? -> {from, :queued, unqueue(state, id)}
      {from, state} -> {from, :sent, cancel_at_server(state, id)}
    end
  end

  # A close or free (a caller's terminate/2, say) whose caller exited: nobody else holds the id,
  # so dropped or cancelled what it frees would stay on the server for the connection's life.
  # It is sent (or, at the server, answered) as a release no caller asked for is (send_uncalled/3).
  defp orphan(state, id) do
    {_from, state} = take_pending(state, id)

    case :gb_trees.lookup(id, state.queue) do
      {:value, {op, head, size, _deadline}} ->
        %{state | queue: :gb_trees.update(id, {op, head, size, nil}, state.queue)}

      :none ->
        state
    end
  end

  # A close or free, as call/4 names it (with the id it frees where a group watches it).
  defp release?({op, _id}), do: op in @releases
  defp release?(op), do: op in @releases

  # The op of request `id`, queued here or at the server; nil once answered.
  defp op_of(state, id) do
    case {:gb_trees.lookup(id, state.queue), state.outstanding} do
      {{:value, {op, _head, _size, _deadline}}, _} -> op
      {:none, %{^id => {op, _length}}} -> op
      _answered -> nil
    end
  end

  # Past :max_in_flight (the server serves a cancel as it reads it, and the request it drops
  # leaves its place then), but behind other cancels and within the server's cap (send_cancels).
  defp cancel_at_server(%{deadlines: true} = state, id) when is_map_key(state.outstanding, id),
    do: send_cancels(%{state | held_cancels: :queue.in(id, state.held_cancels)})

  defp cancel_at_server(state, _id), do: state

  # Send the cancels that wait, oldest first, while the server's cap has room for one more
  # frame: past it the cancel would wait unread behind the request it names. One whose request
  # was answered meanwhile is dropped: there is nothing left to drop. With no caller, a cancel's
  # answer is dropped.
  defp send_cancels(state) do
    with true <- server_room?(state),
         {{:value, id}, held} <- :queue.out(state.held_cancels) do
      state = %{state | held_cancels: held}

      if is_map_key(state.outstanding, id) do
        {head, size} = Protocol.request_head("cancel", %{id: id})
        {cancel_id, frame, state} = numbered(state, head)
        state |> transmit(cancel_id, "cancel", frame, size) |> send_cancels()
      else
        send_cancels(state)
      end
    else
      _no_room_or_none -> state
    end
  end

  # The health check asked for and not yet sent, once the server's cap has room for it. The
  # server answers it as it reads it while its work keeps completing (SPEC §6), as it does a
  # cancel: so it takes the place requests leave, after held cancels and before queued requests;
  # past the cap it would only wait unread. While held, its timeout runs (handle_info/2).
  defp send_health(%{health_pending: id} = state)
       when id != nil and not is_map_key(state.outstanding, id) do
    if server_room?(state) do
      {head, size} = Protocol.request_head("health", %{})
      transmit(state, id, :health_check, Protocol.request_body(head, id, nil), size)
    else
      state
    end
  end

  defp send_health(state), do: state

  # Whether the server's cap has room for one more frame (a cancel's or a health check's).
  defp server_room?(%{server_max_in_flight: nil}), do: true
  defp server_room?(state), do: map_size(state.outstanding) < state.server_max_in_flight

  # Take request `id`'s caller out of `pending`, its deadline and monitor with it:
  # `{from, state}`, or `{nil, state}` when the caller was answered (or gone) already.
  defp take_pending(state, id) do
    case Map.pop(state.pending, id) do
      {nil, _} ->
        {nil, state}

      {{from, timer, monitor, _deadline}, pending} ->
        cancel(timer)
        Process.demonitor(monitor, [:flush])
        {from, %{state | pending: pending, callers: Map.delete(state.callers, monitor)}}
    end
  end

  defp send_frame(%{socket: nil, port: port}, frame) do
    Port.command(port, frame)
    :ok
  rescue
    ArgumentError -> {:error, :port_closed}
  end

  defp send_frame(%{socket: socket}, frame), do: :gen_tcp.send(socket, frame)

  defp on_reply(body, state) do
    case Protocol.decode_reply(body) do
      {:reply, nil, {:error, error} = outcome} ->
        # The server could not read a request's id. A frame it drained unread (no memory to
        # hold it; or over its max_frame_size, which this client does not send) is answered
        # with the body's length (SPEC §2), which names the requests it may be. Otherwise it
        # may be any of those at the server.
        case sent_with_length(state, error.detail["length"]) do
          [] ->
            Logger.warning("scan-bridge: error reply for id nil: #{error.message}")
            answer_unattributed(state, outcome)

          ids ->
            dropped_unread(state, error.detail["length"], ids, outcome)
        end

      {:reply, id, outcome} ->
        answer(state, id, outcome)

      {:error, error} ->
        Logger.error("scan-bridge: undecodable reply: #{error.message}")
        answer_unattributed(state, {:error, error})
    end
  end

  # Reply `id`'s outcome to its caller: any id, this client's (an integer it sent) or one no
  # request at the server had (none, one answered already, or one still queued here, which a
  # reply must not take from its caller while it waits to be sent), which is dropped.
  defp answer(state, id, outcome) do
    case Map.pop(state.outstanding, id) do
      {nil, _outstanding} ->
        Logger.warning("scan-bridge: reply for id #{inspect(id)}, which no request had, dropped")
        state

      {{op, body_length}, outstanding} ->
        %{state | outstanding: outstanding}
        |> answer_caller(id, op, outcome)
        |> ruled_out(id, body_length)
        |> send_queued()
    end
  end

  # Give the outcome of request `id`, answered by the server, to its caller if it still waits;
  # otherwise drop it, and free what it made.
  defp answer_caller(state, id, op, outcome) do
    overdue? = overdue?(state, id)
    exited? = caller_exited?(state, id)

    case take_pending(state, id) do
      {nil, state} ->
        # answered already (its deadline passed, or its caller exited): the late reply is
        # dropped, and what it made freed
        release(state, op, outcome)

      {_from, state} when exited? ->
        # its caller exited before this process took the reply (its :DOWN waits behind it):
        # nobody takes the answer, which is dropped, and what it made freed
        release(state, op, outcome)

      {from, state} when overdue? ->
        # came in time, but taken here after its caller stopped waiting (this process was
        # busy): a late reply all the same
        message = "the reply came in time but was taken after the deadline, and dropped"
        GenServer.reply(from, {:error, Error.client(:timeout, message, %{"id" => id})})
        release(state, op, outcome)

      {{pid, _tag} = from, state} when node(pid) != node() ->
        # The caller's wait started on its node, which this process cannot see: it may have
        # given up already, and the answer would then reach nobody. It says which (request/4).
        if frees(op, outcome) do
          GenServer.reply(from, {:confirm, outcome})
          entry = {Process.monitor(pid), op, outcome}
          %{state | unconfirmed: Map.put(state.unconfirmed, pid, entry)}
        else
          GenServer.reply(from, outcome)
          watch_opener(state, op, from, outcome)
        end

      {from, state} ->
        GenServer.reply(from, outcome)
        watch_opener(state, op, from, outcome)
    end
  end

  # Free what the answer to caller `pid` (on another node) made, which it did not take.
  defp release_unconfirmed(state, pid) do
    case take_unconfirmed(state, pid) do
      {nil, state} -> state
      {{op, outcome}, state} -> release(state, op, outcome)
    end
  end

  # The answer caller `pid` has yet to say it took ({op, outcome}, or nil), no longer watched.
  defp take_unconfirmed(state, pid) do
    case Map.pop(state.unconfirmed, pid) do
      {nil, _unconfirmed} ->
        {nil, state}

      {{monitor, op, outcome}, unconfirmed} ->
        Process.demonitor(monitor, [:flush])
        {{op, outcome}, %{state | unconfirmed: unconfirmed}}
    end
  end

  # Whether request `id`'s caller has exited, its :DOWN not yet handled here: then its monitor
  # is found gone. Either way the monitor is dropped (take_pending follows).
  defp caller_exited?(state, id) do
    case state.pending do
      %{^id => {_from, _timer, monitor, _deadline}} ->
        not Process.demonitor(monitor, [:flush, :info])

      _ ->
        false
    end
  end

  # Whether request `id`'s caller may have stopped waiting: its wait ends @answer_grace_ms
  # past the deadline.
  defp overdue?(state, id) do
    case state.pending do
      %{^id => {_from, _timer, _monitor, deadline}} when deadline != nil ->
        System.monotonic_time(:microsecond) >= deadline + @answer_grace_ms * 1000

      _ ->
        false
    end
  end

  # A group's server closes a session, and frees a snapshot, when the process that opened or
  # took it exits: a cluster session's keeper may live on another node, and die with it, where
  # nobody would close it.
  defp watch_opener(%{group: nil} = state, _op, _from, _outcome), do: state

  defp watch_opener(state, op, {pid, _tag}, {:ok, %{"session" => session}, _timing})
       when op in ["session_open", "session_fork"] and is_binary(session),
       do: watch(state, pid, {:session, session})

  defp watch_opener(state, "session_snapshot", {pid, _tag}, {:ok, %{"snapshot" => id}, _timing})
       when is_binary(id),
       do: watch(state, pid, {:snapshot, id})

  defp watch_opener(state, {"session_close", session}, _from, {:ok, _result, _timing}),
    do: unwatch(state, {:session, session})

  defp watch_opener(state, {"snapshot_free", snapshot}, _from, {:ok, _result, _timing}),
    do: unwatch(state, {:snapshot, snapshot})

  defp watch_opener(state, _op, _from, _outcome), do: state

  defp watch(state, pid, held) do
    {monitor, all} =
      case state.openers do
        %{^pid => watched} -> watched
        _ -> {Process.monitor(pid), MapSet.new()}
      end

    %{
      state
      | openers: Map.put(state.openers, pid, {monitor, MapSet.put(all, held)}),
        opener_of: Map.put(state.opener_of, held, pid)
    }
  end

  defp unwatch(state, held) do
    case Map.pop(state.opener_of, held) do
      {nil, _} ->
        state

      {pid, opener_of} ->
        {monitor, all} = state.openers[pid]
        all = MapSet.delete(all, held)

        openers =
          if MapSet.size(all) == 0 do
            Process.demonitor(monitor, [:flush])
            Map.delete(state.openers, pid)
          else
            Map.put(state.openers, pid, {monitor, all})
          end

        %{state | openers: openers, opener_of: opener_of}
    end
  end

  # The requests at the server whose bodies are `length` bytes long. Looked for only when an
  # answer's id is nil (rare).
  defp sent_with_length(state, length) when is_integer(length),
    do: for({id, {_op, ^length}} <- state.outstanding, do: id)

  defp sent_with_length(_state, _no_length), do: []

  # An answer with id nil for a frame of `body_length` bytes (:unattributed: of any), which one
  # of `ids` (at the server, that long) was: given once the others have their own replies
  # (ruled_out/3).
  defp dropped_unread(state, body_length, ids, outcome) do
    {outcomes, _ids} = Map.get(state.dropped_unread, body_length, {[], []})
    # the ids of the earlier answers are all still at the server, and so among these
    settle_dropped(state, body_length, outcomes ++ [outcome], MapSet.new(ids))
  end

  # Request `id`, `body_length` bytes long, answered (by its own reply, as a rule): no longer
  # one an answer with id nil for that length, or one naming no request, may be for.
  defp ruled_out(state, id, body_length) do
    Enum.reduce([body_length, :unattributed], state, fn key, state ->
      case state.dropped_unread do
        %{^key => {outcomes, ids}} -> settle_dropped(state, key, outcomes, MapSet.delete(ids, id))
        _other -> state
      end
    end)
  end

  # As many requests left as answers with id nil for their length: the answers are theirs,
  # oldest to oldest. Otherwise they wait for more to be ruled out.
  defp settle_dropped(state, body_length, outcomes, ids) do
    if MapSet.size(ids) <= length(outcomes) do
      state = %{state | dropped_unread: Map.delete(state.dropped_unread, body_length)}

      ids
      |> Enum.sort()
      |> Enum.zip(outcomes)
      |> Enum.reduce(state, fn {id, outcome}, state -> answer(state, id, outcome) end)
    else
      %{state | dropped_unread: Map.put(state.dropped_unread, body_length, {outcomes, ids})}
    end
  end

  # A reply that names no request (id nil without a length, or one that cannot be decoded) is
  # the answer of one of those at the server, whose own reply then never comes: dropped with
  # none there, and otherwise given, as an answer by length is, to the one left once the
  # others have their own replies (at once when it is the only one), freeing its place.
  defp answer_unattributed(state, outcome) do
    case Map.keys(state.outstanding) do
      [] -> state
      ids -> dropped_unread(state, :unattributed, ids, outcome)
    end
  end

  # A late reply's caller was told :timeout (or, on another node, gave up before its answer
  # came) and will never learn of the handle, session (opened or forked), snapshot or model the
  # server made for it: free it now, without a caller (its answer is dropped in turn), queued
  # for the place the late reply has just left, which send_queued/1 gives to what waits before it.
  defp release(state, op, {:ok, _result, _timing} = outcome) when is_binary(op) do
    case frees(op, outcome) do
      {free_op, args} -> send_uncalled(state, free_op, args)
      nil -> state
    end
  end

  # The periodic health check's answer (it has no caller): ready, the next one in :interval.
  defp release(state, :health_check, {:ok, %{"ready" => true}, _timing}) do
    Process.send_after(self(), :health_check, state.health_check[:interval])
    %{state | health_pending: nil}
  end

  defp release(state, :health_check, outcome) do
    send(
      self(),
      {:unhealthy, "the server answered its health check with #{inspect(outcome, limit: 6)}"}
    )

    %{state | health_pending: nil}
  end

  defp release(state, _op, _outcome), do: state

  # The request that frees what request `op`'s outcome made ({op, args}), or nil.
  defp frees("put", {:ok, %{"handle" => handle}, _timing}) when is_binary(handle),
    do: {"free", %{handle: handle}}

  defp frees(op, {:ok, %{"session" => session}, _timing})
       when op in ["session_open", "session_fork"] and is_binary(session),
       do: {"session_close", %{session: session}}

  defp frees("session_snapshot", {:ok, %{"snapshot" => snapshot}, _timing})
       when is_binary(snapshot),
       do: {"snapshot_free", %{snapshot: snapshot}}

  defp frees("model_load", {:ok, %{"model" => model}, _timing}) when is_binary(model),
    do: {"model_free", %{model: model}}

  defp frees(_op, _outcome), do: nil

  # A free no caller asked for (release/3, an opener's exit) is a request without a deadline:
  # queued, for send_queued/1 to send in its turn (after held cancels and a held health check,
  # within :max_in_flight, behind the requests queued before it), never dropped.
  defp send_uncalled(state, op, args) do
    id = state.next_id
    {head, size} = Protocol.request_head(op, args)
    %{state | next_id: id + 1, queue: :gb_trees.insert(id, {op, head, size, nil}, state.queue)}
  end

  # The next request id, and the body of the request `head` (without a budget) under it (the
  # id goes last, as a fixed-size uint64, so that the head's payload offsets stay as encoded).
  defp numbered(state, head) do
    id = state.next_id
    {id, Protocol.request_body(head, id, nil), %{state | next_id: id + 1}}
  end

  # What waits for a place at the server, after a reply freed one (or frees were queued): held
  # cancels first, then a held health check (up to the server's cap, of which requests leave one
  # place free), then queued requests and frees, oldest first; one whose deadline has passed is
  # answered :overloaded instead.
  defp send_queued(state), do: state |> send_cancels() |> send_health() |> send_requests()

  defp send_requests(state) do
    if map_size(state.outstanding) < state.max_in_flight and
         not :gb_trees.is_empty(state.queue) do
      {id, {op, head, size, deadline}, queue} = :gb_trees.take_smallest(state.queue)
      state = %{state | queue: queue}

      if deadline != nil and deadline <= System.monotonic_time(:microsecond) do
        # Its deadline timer fires later, and may wait behind the reply that made this room:
        # sent, it would run (or be refused) for a caller who has given up.
        {from, state} = take_pending(state, id)
        GenServer.reply(from, {:error, never_sent(state, id)})
        send_requests(state)
      else
        state
        |> transmit(id, op, request_body(state, head, id, deadline), size)
        |> send_requests()
      end
    else
      state
    end
  end

  # Drop request `id` from the queue, if it is there.
  defp unqueue(state, id) do
    case :gb_trees.take_any(id, state.queue) do
      {_request, queue} -> %{state | queue: queue}
      :error -> state
    end
  end

  defp fail_all(state, message, detail) do
    error = exited(message, detail)

    Enum.each(state.pending, fn {_id, {from, timer, monitor, _deadline}} ->
      cancel(timer)
      Process.demonitor(monitor, [:flush])
      GenServer.reply(from, {:error, error})
    end)

    %{
      state
      | pending: %{},
        queue: :gb_trees.empty(),
        callers: %{},
        outstanding: %{},
        dropped_unread: %{},
        held_cancels: :queue.new(),
        unconfirmed: %{}
    }
  end

  defp exited(message, detail), do: Error.client(:server_exited, message, detail)

  defp cancel(nil), do: :ok

  # A deadline that fired already is in the mailbox; handle_info finds its request answered.
  defp cancel(timer) do
    _left_ms = Process.cancel_timer(timer)
    :ok
  end

  ## Start-up

  defp open_port(state, opts) do
    python = opts[:python]
    argv = ["-m", "bridge" | opts[:args]] ++ transport_args(opts[:transport])

    env =
      Enum.map(opts[:env], fn {k, v} -> {to_charlist(k), if(v, do: to_charlist(v), else: false)} end)

    port =
      Port.open({:spawn_executable, python}, [
        :binary,
        {:packet, 4},
        :exit_status,
        :use_stdio,
        # never suspend this process in Port.command (see the moduledoc)
        {:busy_limits_port, :disabled},
        {:args, argv},
        {:env, env}
      ])

    {:os_pid, os_pid} = Port.info(port, :os_pid)
    {:ok, %{state | port: port, os_pid: os_pid}}
  rescue
    e in [ErlangError, ArgumentError] ->
      {:error,
       Error.client(
         :startup_failed,
         "cannot start #{inspect(opts[:python])}: #{Exception.message(e)}"
       ), state}
  end

  # --stdio keeps the Port lane served even when :args (or the transport) name a socket lane,
  # so the server still answers the start-up ping there and still exits when its stdin closes
  # (no orphan).
  defp transport_args(:port), do: ["--stdio"]
  defp transport_args({:unix, path}), do: ["--stdio", "--unix", path]

  # One ping, answered before the deadline, on the given lane.
  defp handshake(state, lane, deadline) do
    case startup_call(state, lane, "ping", deadline) do
      {:ok, %{"pong" => true}, state} ->
        {:ok, state}

      {:ok, result, state} ->
        {:error,
         Error.client(
           :startup_failed,
           "unexpected answer to the start-up ping: #{inspect(result, limit: 8)}"
         ), state}

      {:error, _error, _state} = failure ->
        failure
    end
  end

  # The server's limits (info's "limits") that bound what this client sends, each replacing
  # the client's option when smaller: max_frame_size, and on the unix lane the requests one
  # connection may have in flight (max_in_flight_per_peer), past which the server stops reading
  # the socket, so that more would only wait in the lane's queue, where a passed deadline
  # cannot drop them. One slot of that cap is left free for cancels and health checks, which go
  # past the client's own cap (a cancel past the server's would wait unread behind the very
  # request it is to drop, which would then run) but keep to the cap itself (send_cancels,
  # send_health). A limit the server's info lacks (a server older than it) leaves the option
  # as it is.
  defp adopt_limits(state, deadline) do
    lane = if state.socket, do: :socket, else: :port

    with {:ok, info, state} <- startup_call(state, lane, "info", deadline) do
      limits = if is_map(info["limits"]), do: info["limits"], else: %{}
      state = cap(state, :max_frame_size, limits["max_frame_size"])

      state =
        if lane == :socket,
          do: adopt_in_flight_cap(state, limits["max_in_flight_per_peer"]),
          else: state

      # info without a list of ops (an older server's, or a malformed one) takes no op for
      # granted, rather than raising in init
      ops =
        case info["protocol"] do
          %{"ops" => ops} when is_list(ops) -> ops
          _none -> []
        end

      state = %{state | deadlines: "cancel" in ops}

      if state.health_check && "health" not in ops,
        do:
          {:error,
           Error.client(
             :startup_failed,
             ":health_check needs a server with the health op; its info lists #{inspect(ops)}"
           ), state},
        else: {:ok, state}
    end
  end

  # Only ever lowers a limit: :max_frame_size stays within what a frame can say.
  defp cap(state, key, limit) when is_integer(limit) and limit > 0,
    do: Map.update!(state, key, &min(&1, limit))

  defp cap(state, _key, _absent), do: state

  defp adopt_in_flight_cap(state, limit) when is_integer(limit) and limit > 0 do
    cap(%{state | server_max_in_flight: limit}, :max_in_flight, max(limit - 1, 1))
  end

  defp adopt_in_flight_cap(state, _absent), do: state

  # One request without arguments, answered before the deadline, on the given lane.
  defp startup_call(state, lane, op, deadline) do
    {head, _size} = Protocol.request_head(op, %{})
    {id, frame, state} = numbered(state, head)

    case send_frame(state, frame) do
      :ok ->
        await_startup_reply(state, lane, op, id, deadline)

      {:error, reason} ->
        {:error,
         Error.client(:startup_failed, "cannot send the start-up #{op}: #{inspect(reason)}"), state}
    end
  end

  defp await_startup_reply(%{port: port, socket: socket} = state, lane, op, id, deadline) do
    receive do
      {^port, {:data, body}} when lane == :port ->
        startup_result(body, op, id, state)

      {:tcp, ^socket, body} when lane == :socket ->
        startup_result(body, op, id, state)

      {^port, {:exit_status, status}} ->
        startup_exit(state, status)

      {:tcp_closed, ^socket} ->
        {:error, Error.client(:startup_failed, "the server closed the unix socket during start-up"),
         state}

      {:tcp_error, ^socket, reason} ->
        {:error,
         Error.client(:startup_failed, "unix socket error during start-up: #{inspect(reason)}"),
         state}
    after
      remaining(deadline) ->
        {:error,
         Error.client(
           :startup_timeout,
           "the server did not answer the start-up #{op} on the #{lane} lane in time"
         ), state}
    end
  end

  defp startup_result(body, op, id, state) do
    case Protocol.decode_reply(body) do
      {:reply, ^id, {:ok, result, _timing}} ->
        {:ok, result, state}

      {:reply, ^id, {:error, %Error{} = refusal}} ->
        code = refusal.code || Atom.to_string(refusal.reason)

        {:error,
         Error.client(
           :startup_failed,
           "the server answered the start-up #{op} with #{code}: #{refusal.message}",
           %{"code" => code, "detail" => refusal.detail}
         ), state}

      other ->
        {:error,
         Error.client(
           :startup_failed,
           "unexpected answer to the start-up #{op}: #{inspect(other, limit: 8)}"
         ), state}
    end
  end

  defp startup_exit(state, status) do
    error =
      Error.client(
        :startup_failed,
        "the server exited with status #{status} during start-up (its log is on stderr)",
        %{
          "exit_status" => status
        }
      )

    {:error, error, %{state | port: nil}}
  end

  defp connect_lane(state, :port, _deadline), do: {:ok, state}

  defp connect_lane(state, {:unix, path}, deadline) do
    case connect_socket(state, path, deadline) do
      {:ok, socket} -> handshake(%{state | socket: socket}, :socket, deadline)
      {:error, _error, _state} = failure -> failure
    end
  end

  # The server binds the socket while it starts; connect until it accepts (or exits, or the
  # start-up deadline passes).
  defp connect_socket(%{port: port} = state, path, deadline) do
    case :gen_tcp.connect({:local, path}, 0, socket_options(), max(remaining(deadline), 1)) do
      {:ok, socket} ->
        {:ok, socket}

      {:error, reason} when reason in [:enoent, :econnrefused] ->
        receive do
          {^port, {:exit_status, status}} -> startup_exit(state, status)
        after
          min(@connect_retry_ms, remaining(deadline)) ->
            if remaining(deadline) > 0,
              do: connect_socket(state, path, deadline),
              else:
                {:error,
                 Error.client(
                   :startup_timeout,
                   "the server's unix socket #{path} did not accept in time"
                 ), state}
        end

      {:error, reason} ->
        {:error, Error.client(:startup_failed, "cannot connect to #{path}: #{inspect(reason)}"),
         state}
    end
  end

  ## Shutting the server down

  # Close what is open; the server exits on stdin EOF. Kill it if it has not after exit_grace.
  defp stop_server(state) do
    if state.socket, do: :gen_tcp.close(state.socket)

    if state.port do
      try do
        Port.close(state.port)
      rescue
        ArgumentError -> :already_closed
      end
    end

    if state.os_pid, do: await_os_exit(state.os_pid, state.exit_grace)
    %{state | port: nil, socket: nil}
  end

  defp await_os_exit(os_pid, grace) do
    # Without /proc (not Linux) there is nothing cheap to poll, and the pid's entry is never
    # there: rely on stdin EOF.
    unless gone_within?(os_pid, grace) do
      Logger.warning(
        "scan-bridge: server #{os_pid} still running after its stdin closed; killing it"
      )

      kill_os_process(os_pid)
    end

    :ok
  end

  defp kill_os_process(os_pid) do
    _output = :os.cmd(~c"kill -KILL #{os_pid}")
    # SIGKILL is not synchronous: wait (briefly) for it to land, so that a stopped client has
    # surely stopped its server.
    unless gone_within?(os_pid, @kill_wait_ms) do
      Logger.error("scan-bridge: server #{os_pid} still there #{@kill_wait_ms} ms after SIGKILL")
    end
  end

  defp gone_within?(os_pid, ms), do: poll_gone(os_pid, System.monotonic_time(:millisecond) + ms)

  defp poll_gone(os_pid, deadline) do
    cond do
      not File.exists?("/proc/#{os_pid}") ->
        true

      System.monotonic_time(:millisecond) >= deadline ->
        false

      true ->
        Process.sleep(10)
        poll_gone(os_pid, deadline)
    end
  end

  ## Options

  defp validate!(opts) do
    opts = opts |> ScanBridge.keyword!("start_link") |> Keyword.validate!(@defaults)

    python =
      opts[:python] || System.get_env("SCAN_BRIDGE_PYTHON") || System.find_executable("python3")

    unless is_binary(python) do
      raise ArgumentError,
            ":python: expected the path of a Python interpreter (or SCAN_BRIDGE_PYTHON, or python3 on PATH), got #{inspect(python)}"
    end

    # A bare command name is looked up on PATH, as a shell would: the Port's spawn_executable
    # takes a path only.
    python =
      if String.contains?(python, "/"), do: python, else: System.find_executable(python) || python

    check!(
      :args,
      opts[:args],
      "a list of strings",
      &(is_list(&1) and not List.improper?(&1) and Enum.all?(&1, fn a -> is_binary(a) end))
    )

    check!(:env, opts[:env], "a list or map of {name, value | nil} strings", &valid_env?/1)

    check!(:transport, opts[:transport], ":port or {:unix, path}", fn
      :port -> true
      {:unix, path} -> is_binary(path)
      _ -> false
    end)

    for key <- [:max_in_flight, :max_frame_size] do
      check!(key, opts[key], "a positive integer", &(is_integer(&1) and &1 > 0))
    end

    opts = Keyword.update!(opts, :max_frame_size, &min(&1, @max_frame_limit))

    check!(:startup_timeout, opts[:startup_timeout], @timeout_expected, &valid_timeout?/1)

    check!(:exit_grace, opts[:exit_grace], "a non-negative integer", &(is_integer(&1) and &1 >= 0))
    # a pid or reference would name nothing on another node
    check!(
      :group,
      opts[:group],
      "nil or a group name (atoms, strings, numbers, and tuples and lists of them)",
      &valid_group?/1
    )

    check!(
      :health_check,
      opts[:health_check],
      "nil or [interval: ms, timeout: ms] (positive integers)",
      &valid_health_check?/1
    )

    Keyword.put(opts, :python, python)
  end

  defp valid_health_check?(nil), do: true

  defp valid_health_check?(check) when is_list(check) do
    Keyword.keyword?(check) and Enum.sort(Keyword.keys(check)) == [:interval, :timeout] and
      Enum.all?(Keyword.values(check), &(is_integer(&1) and &1 > 0 and &1 <= @max_timeout_ms))
  end

  defp valid_health_check?(_other), do: false

  defp valid_timeout?(timeout),
    do: timeout == :infinity or (is_integer(timeout) and timeout in 0..@max_timeout_ms)

  defp valid_env?(env) when is_list(env) or is_map(env) do
    (is_map(env) or not List.improper?(env)) and
      Enum.all?(env, fn
        {k, v} -> is_binary(k) and (is_binary(v) or is_nil(v))
        _ -> false
      end)
  end

  defp valid_env?(_), do: false

  defp valid_group?(group) when is_atom(group) or is_binary(group) or is_number(group), do: true
  defp valid_group?(group) when is_tuple(group), do: valid_group?(Tuple.to_list(group))

  defp valid_group?(group) when is_list(group),
    do: not List.improper?(group) and Enum.all?(group, &valid_group?/1)

  defp valid_group?(_), do: false

  defp check!(key, value, expected, valid?) do
    unless valid?.(value),
      do: raise(ArgumentError, "#{inspect(key)}: expected #{expected}, got #{inspect(value)}")
  end

  defp deadline(:infinity), do: :infinity
  defp deadline(ms), do: System.monotonic_time(:millisecond) + ms

  defp remaining(:infinity), do: :infinity
  defp remaining(deadline), do: max(deadline - System.monotonic_time(:millisecond), 0)
end
