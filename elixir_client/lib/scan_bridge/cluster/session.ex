defmodule ScanBridge.Cluster.Session do
  @moduledoc """
  A cluster session (`ScanBridge.Cluster.open_session/3`): a process on the opener's node that
  keeps one session on one member of a group — its owner — and sends the session's calls there.

  With `checkpoint: n` it also keeps, on this node, the session's state as of its latest
  checkpoint and the frames answered since. A checkpoint is taken every n frames from the n-th
  frame's own reply, which is sent asking for the state after it (`return_state`), so it costs
  no round trip; where the reply carries none, the state is read with `session_state` after the
  frame's caller has had its answer. When the owner goes away (its server, its OS process or its
  node) the session is rebuilt on another member: opened there from the checkpoint, the kept
  frames run again, and the call in flight, if any, sent there. The owner going away is noticed
  by a monitor, so the rebuild starts at once, not at the next frame.

  A snapshot (for rollback) is the owner's own (`session_snapshot`, restored there in one round
  trip) and, with checkpoints, the checkpoint and kept frames of the moment it was taken: after
  a failover it is restored by opening the session afresh from them, as a rebuild does.

  A frame that fails partway on the owner leaves the session's state there undefined (SPEC
  §6.1, `state_lost`): with checkpoints the session is reopened there from them, as it was
  before that frame, as a rebuild does.

  The rebuilt session is exactly the one the caller has seen, or the session is given up
  (`:session_lost`): a frame that timed out may or may not have been done by the owner, so once a
  later frame has been answered by it, the kept frames no longer say what the state is, and until
  the next checkpoint a failover is refused. What is lost in each case is in docs/cluster.md.
  """

  use GenServer, restart: :temporary
  require Logger

  alias ScanBridge.{Cluster, Error, Unexpected}
  alias ScanBridge.Cluster.Balancer

  @enforce_keys [:pid]
  defstruct [:pid, :group]

  @type t :: %__MODULE__{pid: pid, group: term}

  # What a checkpoint may take: the owner answers it at once unless it is gone or frozen.
  @checkpoint_timeout_ms 2_000
  # A rebuild started by the monitor has no caller's deadline; it gets this long.
  @rebuild_timeout_ms 10_000
  # The most frames a server takes in one session_open (SPEC §3): more are opened, then replayed.
  @max_open_frames 4_096
  # How long past a call's deadline its caller waits for this process (which answers by it).
  @answer_grace_ms 100
  # The calls that advance the session's state, and so are kept for a rebuild.
  @advancing [:step, :model_step, :model_forward, :scan, :ssd_scan]
  # The errors of a placement that leave the session to be placed by the next call: no member
  # now, or none answered in time (that one is tried after the others next time).
  @unplaced [:no_members, :timeout, :overloaded, :deadline_exceeded]
  # The errors of a request refused before it ran (SPEC §7): it wrote nothing, snapshots neither.
  # (A frame's owner gone, Cluster.gone?/1, is rebuilt before failed/5 would look.)
  @refused_before_running [
    :frame_too_large,
    :decode_error,
    :invalid_request,
    :unsupported_version,
    :unknown_op,
    :missing_argument,
    :invalid_argument,
    :unknown_dtype,
    :tensor_size_mismatch,
    :shape_mismatch,
    :unknown_session,
    :unknown_handle,
    :unknown_model,
    :unknown_snapshot,
    :unsupported,
    :overloaded,
    :shutting_down,
    :deadline_exceeded,
    :cancelled
  ]
  # The calls whose return_state is an option rather than one of the inputs.
  @state_option [:model_step, :model_forward]
  # How an input map asks for the state (return_last_state and return_final_states are
  # mamba_ssm's names for it).
  @state_inputs [
    :return_state,
    "return_state",
    :return_last_state,
    "return_last_state",
    :return_final_states,
    "return_final_states"
  ]

  @doc false
  @spec open(Cluster.group(), map, Cluster.session_opts()) :: {:ok, t} | {:error, Error.t()}
  def open(group, dims, opts) do
    timeout = Keyword.get(opts, :timeout, 30_000)
    deadline = Cluster.deadline(timeout)

    args = %{
      group: group,
      dims: dims,
      every: Keyword.get(opts, :checkpoint),
      opener: self(),
      deadline: deadline,
      # a fork's: the state it starts from, as its first checkpoint, and its model's fingerprint
      from: Keyword.get(opts, :from),
      model_fingerprint: Keyword.get(opts, :model_fingerprint)
    }

    # the keeper starts at once and opens the session after (handle_continue): an open that
    # waits on a slow member holds up no other start in the node's supervisor
    case DynamicSupervisor.start_child(ScanBridge.Cluster.Sessions, {__MODULE__, args}) do
      {:ok, pid} ->
        opened(pid, group, deadline)

      {:error, reason} ->
        {:error,
         Error.client(
           :not_running,
           "the cluster session's keeper did not start: #{inspect(reason, limit: 5)}",
           %{}
         )}
    end
  end

  defp opened(pid, group, deadline) do
    case request(pid, :opened, wait(deadline)) do
      :ok ->
        {:ok, %__MODULE__{pid: pid, group: group}}

      {:error, %Error{reason: :timeout}} = timed_out ->
        # still opening past the deadline, for nobody: what it opened, its server closes when it
        # goes (a group's server watches openers), and its place in the balancer is given back
        Process.exit(pid, :kill)
        timed_out

      {:error, _} = error ->
        error
    end
  end

  @doc false
  @spec start_link(map) :: GenServer.on_start()
  def start_link(args), do: GenServer.start_link(__MODULE__, args)

  @doc false
  @spec call(t, atom, term, keyword) :: {:ok, term} | {:error, Error.t()}
  def call(%__MODULE__{pid: pid}, kind, input, opts) do
    :ok = call_opts!(opts, kind)
    deadline = Cluster.deadline(Keyword.get(opts, :timeout, 30_000))
    opts = Keyword.delete(opts, :timeout)

    case request(pid, {:call, kind, input, opts, deadline}, wait(deadline)) do
      {:raise, exception} -> raise exception
      outcome -> outcome
    end
  end

  # The options a model call takes, as its own function checks them.
  @model_call_opts %{
    model_step: [:output, :return_state, :snapshot_into, :timeout],
    model_forward: [:output, :last_only, :return_state, :lengths, :timeout]
  }

  # Checked here, in the caller: the keeper acts on some itself (a checkpoint's :return_state)
  # before the call's own function would check them, and a bad one would end it.
  defp call_opts!(opts, kind) do
    # a plain call takes :timeout alone, as its own function does
    _checked =
      ScanBridge.opts!(opts, Map.get(@model_call_opts, kind, [:timeout]), "Cluster.#{kind}")

    :ok
  end

  @doc false
  @spec close(t, ScanBridge.call_opts()) :: :ok | {:error, Error.t()}
  def close(%__MODULE__{pid: pid}, opts) do
    deadline = Cluster.deadline(timeout!(opts, "close_session"))

    case request(pid, {:close, deadline}, wait(deadline)) do
      {:error, %Error{reason: :not_running}} -> :ok
      outcome -> outcome
    end
  end

  @doc false
  @spec info(t) :: {:ok, Cluster.session_info()} | {:error, Error.t()}
  def info(%__MODULE__{pid: pid}), do: request(pid, :info, 5_000)

  @doc false
  @spec snapshot(t, ScanBridge.call_opts()) :: {:ok, reference} | {:error, Error.t()}
  def snapshot(%__MODULE__{pid: pid}, opts), do: timed(pid, opts, "snapshot", &{:snapshot, &1})

  @doc false
  @spec restore(t, reference, ScanBridge.call_opts()) :: :ok | {:error, Error.t()}
  def restore(%__MODULE__{pid: pid}, snapshot, opts),
    do: timed(pid, opts, "restore", &{:restore, snapshot, &1})

  @doc false
  @spec restore_with_frames(t, reference, [ScanBridge.frame()], ScanBridge.call_opts()) ::
          {:ok, [term]} | {:error, Error.t()}
  def restore_with_frames(%__MODULE__{pid: pid}, snapshot, frames, opts) do
    case timed(pid, opts, "restore_with_frames", &{:restore, snapshot, frames, &1}) do
      {:raise, exception} -> raise exception
      outcome -> outcome
    end
  end

  @doc false
  @spec fork(t, keyword) :: {:ok, t} | {:error, Error.t()}
  def fork(%__MODULE__{pid: pid, group: group}, opts) do
    deadline = Cluster.deadline(Keyword.get(opts, :timeout, 30_000))

    with {:ok, %{dims: dims, every: every, state: saved, model_fingerprint: fingerprint}} <-
           request(pid, {:fork, deadline}, wait(deadline)) do
      opts = Keyword.merge([checkpoint: every], opts)

      open(group, dims,
        checkpoint: opts[:checkpoint],
        timeout: Cluster.remaining(deadline),
        from: saved,
        model_fingerprint: fingerprint
      )
    end
  end

  @doc false
  @spec free_snapshot(t, reference, ScanBridge.call_opts()) :: :ok | {:error, Error.t()}
  def free_snapshot(%__MODULE__{pid: pid}, snapshot, opts),
    do: timed(pid, opts, "free_snapshot", &{:free_snapshot, snapshot, &1})

  defp timed(pid, opts, fun, message) do
    deadline = Cluster.deadline(timeout!(opts, fun))
    request(pid, message.(deadline), wait(deadline))
  end

  # The :timeout of a call that takes no other option: a misspelt one is refused, not run with
  # the default deadline.
  defp timeout!(opts, fun),
    do: opts |> ScanBridge.opts!([:timeout], "Cluster.#{fun}") |> Keyword.get(:timeout, 30_000)

  defp wait(:infinity), do: :infinity
  # capped at the longest receive timeout the BEAM takes, 2^32 - 1 ms
  defp wait(deadline), do: min(Cluster.remaining(deadline) + @answer_grace_ms, 0xFFFFFFFF)

  defp request(pid, message, wait) do
    GenServer.call(pid, message, wait)
  catch
    :exit, {:noproc, _} ->
      {:error, Error.client(:not_running, "the cluster session is closed", %{})}

    :exit, {:timeout, _} ->
      {:error, Error.client(:timeout, "no answer from the cluster session before the deadline")}

    :exit, {reason, _} ->
      {:error,
       Error.client(:session_lost, "the cluster session's process exited: #{inspect(reason)}", %{})}
  end

  ## Callbacks

  @impl true
  def init(args) do
    Process.flag(:trap_exit, true)

    state = %{
      group: args.group,
      dims: args.dims,
      every: args.every,
      opener: Process.monitor(args.opener),
      owner: nil,
      owner_monitor: nil,
      remote: nil,
      token: nil,
      # the state as of the latest checkpoint (nil: zero, as opened; a fork's: the state forked)
      checkpoint: args.from,
      # the frames answered since the checkpoint, newest first: {kind, input, opts}
      log: [],
      # whether checkpoints are asked of the owner on a frame's reply: false once it refused
      # return_state or answered without the state (a server from before it), until a new owner
      state_on_reply: true,
      # :ok; :unsure after a timeout (the owner may have done it); :tainted once a frame is
      # answered after that (a rebuild could not reproduce it); {:lost, error}
      status: :ok,
      failovers: 0,
      # members passed over by the placement under way: gone while keeping it (pg may list a
      # cut-off one for a while), or without its model; one may come back (its node reconnected)
      # or load the model since, so a later placement asks it again
      skipped: [],
      # members whose open did not answer in time: tried only when no other member is left
      slow: [],
      # why the session has no owner now, when a placement left it so (for the calls that
      # find none), or nil
      unplaced: nil,
      # why the first open failed, for its opener to be told (:opened), or nil
      open_failed: nil,
      # a group model's session: the fingerprint of the model it runs (Member), once opened (a
      # fork's, its source's), so that no rebuild reopens it under another model given its name
      # while a member was apart; nil before (and for sessions of no group model)
      model_fingerprint: args.model_fingerprint,
      # snapshot ref => %{owner: the member that holds its copy (always the session's owner,
      # or nil: no copy), remote: that copy's id there, replay: {checkpoint, log} of the moment
      # it was taken, or nil where those could not reproduce it (no checkpoints kept, or a frame
      # in doubt)}
      snapshots: %{}
    }

    {:ok, state, {:continue, {:open, args.deadline}}}
  end

  # The first open, answered to the opener when it asks (:opened, its next call).
  @impl true
  def handle_continue({:open, deadline}, state) do
    case place(state, deadline) do
      {:ok, state} -> {:noreply, state}
      {:error, error, state} -> {:noreply, %{state | open_failed: error}}
    end
  end

  # A restore's frames kept once its caller has its answer: a checkpoint they complete is read
  # after it, as a frame's is (advanced/5), and holds up no answer past its deadline.
  def handle_continue({:kept, frames}, state), do: {:noreply, kept(state, frames)}

  @impl true
  def handle_call(:opened, _from, %{open_failed: nil} = state), do: {:reply, :ok, state}

  def handle_call(:opened, _from, state),
    do: {:stop, :normal, {:error, state.open_failed}, release(state)}

  def handle_call({:call, kind, input, opts, deadline}, from, state) do
    cond do
      expired?(deadline) ->
        # doing it now would be doing it behind its caller's back; its caller still waits (the
        # grace past the deadline), so it is told at once that nothing was sent
        {:reply, {:error, deadline_passed(kind)}, state}

      match?({:lost, _}, state.status) ->
        {:reply, {:error, elem(state.status, 1)}, state}

      unknown_snapshot_into?(state, opts) ->
        {:reply, {:error, not_a_snapshot("model_step snapshot_into", opts[:snapshot_into])}, state}

      true ->
        serve(state, from, kind, input, opts, deadline)
    end
  end

  # The snapshots' copies are freed by the close's deadline too (and within what a checkpoint
  # may take), so that nothing here answers past it; what that leaves no time for, the owner's
  # server closes and frees when it sees this keeper go.
  def handle_call({:close, deadline}, _from, state) do
    outcome = if state.owner, do: state |> close_remote(deadline) |> closed(), else: :ok
    {:stop, :normal, outcome, release(state, earlier(deadline, checkpoint_deadline()))}
  end

  def handle_call({:snapshot, deadline}, from, state),
    do: on_owner(state, deadline, &take_snapshot(&1, from, deadline, :retry))

  def handle_call({:restore, id, deadline}, from, state),
    do: handle_call({:restore, id, [], deadline}, from, state)

  # A restore, with `frames` (a rollback's re-simulation) run on the session after it: in one
  # request on the owner that holds the snapshot's copy. A frame that fails there leaves the
  # snapshot's state, so the keeper's checkpoint and frames become the snapshot's all the same.
  def handle_call({:restore, id, frames, deadline}, _from, state) do
    case {expired?(deadline), Map.fetch(state.snapshots, id)} do
      {true, _snapshot} ->
        # as for a frame read late: its caller has been answered :timeout, so what it asked
        # is not done (a session moved now would be moved behind the caller's back)
        {:reply, {:error, deadline_passed(:restore)}, state}

      {false, :error} ->
        {:reply, {:error, not_a_snapshot("restore", id)}, state}

      {false, {:ok, snapshot}} ->
        case Enum.reject(frames_into(frames), &is_map_key(state.snapshots, &1)) do
          [] ->
            restore_snapshot(state, id, snapshot, frames, deadline)

          [unknown | _] ->
            {:reply, {:error, not_a_snapshot("restore_with_frames :snapshot_into", unknown)}, state}
        end
    end
  end

  # What a fork opens from: this session's dims, checkpoint interval and state now.
  def handle_call({:fork, deadline}, from, state),
    do: on_owner(state, deadline, &read_for_fork(&1, from, deadline, :retry))

  def handle_call({:free_snapshot, id, deadline}, _from, state) do
    case Map.pop(state.snapshots, id) do
      {nil, _} ->
        {:reply, {:error, not_a_snapshot("free_snapshot", id)}, state}

      {snapshot, snapshots} ->
        # read after its caller's deadline (this keeper busy meanwhile), the free is sent all the
        # same: the snapshot is forgotten here, and its copy would stay on its server
        _freed =
          if expired?(deadline),
            do: forget_copy(snapshot, :free),
            else: free_remote_snapshots(state, [snapshot], deadline)

        {:reply, :ok, %{state | snapshots: snapshots}}
    end
  end

  def handle_call(:info, _from, state) do
    info = %{
      member: state.owner,
      node: state.owner && node(state.owner),
      session: state.remote,
      failovers: state.failovers,
      frames_since_checkpoint: length(state.log),
      status: (match?({:lost, _}, state.status) && :lost) || state.status
    }

    {:reply, {:ok, info}, state}
  end

  def handle_call(request, _from, state), do: {:reply, Unexpected.call(__MODULE__, request), state}

  @impl true
  def handle_cast(request, state) do
    Unexpected.cast(__MODULE__, request)
    {:noreply, state}
  end

  @impl true
  def handle_info({:DOWN, ref, :process, _pid, _reason}, %{opener: ref} = state) do
    # nobody is left to tell if closing fails; a group's server also closes the sessions of an
    # opener (this keeper) that exits
    _closed = if state.owner, do: close_remote(state, checkpoint_deadline())
    {:stop, :normal, release(state)}
  end

  def handle_info({:DOWN, ref, :process, _pid, reason}, %{owner_monitor: ref} = state) do
    state = owner_gone(state, "its server went away: #{inspect(reason, limit: 5)}")
    {:noreply, rebuild(state, Cluster.deadline(@rebuild_timeout_ms))}
  end

  def handle_info(_stale, state), do: {:noreply, state}

  ## Calls

  defp serve(state, from, kind, input, opts, deadline) do
    state = if state.owner, do: state, else: rebuild(state, deadline)

    case state.status do
      {:lost, error} ->
        {:reply, {:error, error}, state}

      _ok_or_unsure when state.owner == nil ->
        {:reply, {:error, unplaced(state)}, state}

      _ok_or_unsure ->
        case run_frame(state, kind, input, opts, deadline) do
          {{:raise, _exception} = raised, _saved, state} ->
            {:reply, raised, state}

          {{:error, %Error{} = error} = outcome, _saved, state} ->
            if Cluster.gone?(error) do
              state = owner_gone(state, error.message)
              retry(state, from, kind, input, opts, deadline, outcome)
            else
              failed(state, from, kind, opts, outcome)
            end

          {{:ok, _} = outcome, saved, state} ->
            GenServer.reply(from, outcome)
            {:noreply, advanced(state, kind, input, opts, saved)}
        end
    end
  end

  # The call in flight when the owner went away, sent to the rebuilt session (once): a frame on
  # the rebuild's open, after the kept frames, where the new owner takes frames there; else, and
  # a state read (no frame an open takes), after it.
  defp retry(state, from, kind, input, opts, deadline, first_outcome) do
    # a new owner is asked for the state on a frame's reply (place/3)
    asking = asking(%{state | state_on_reply: true}, kind, input, opts)
    pending = if kind in @advancing, do: sent_frame(kind, input, opts, asking)
    {state, ran} = rebuild(state, deadline, pending)

    cond do
      match?({:lost, _}, state.status) ->
        {:reply, {:error, elem(state.status, 1)}, state}

      ran != :not_run ->
        {outcome, saved, state} = answered(state, kind, asking, ran)
        GenServer.reply(from, outcome)
        {:noreply, advanced(state, kind, input, opts, saved)}

      state.owner == nil or expired?(deadline) ->
        {:reply, first_outcome, state}

      true ->
        case run_frame(state, kind, input, opts, deadline) do
          {{:ok, _} = outcome, saved, state} ->
            GenServer.reply(from, outcome)
            {:noreply, advanced(state, kind, input, opts, saved)}

          {{:error, %Error{} = error} = outcome, _saved, state} ->
            if Cluster.gone?(error),
              do: {:reply, outcome, owner_gone(state, error.message)},
              else: failed(state, from, kind, opts, outcome)

          {raised, _saved, state} ->
            {:reply, raised, state}
        end
    end
  end

  # An error from the owner to a call of `kind` (nil: not a frame), answered; one that says its
  # copy of the state is lost (SPEC §6.1: this frame failed partway, or one before it did, a
  # frame that timed out say, and this call was refused) then has the session put back as the
  # checkpoint and kept frames say; a frame that timed out leaves the session in doubt.
  defp failed(state, from, kind, opts, {:error, error} = outcome) do
    cond do
      error.detail["state"] == "lost" ->
        # the server copied the state before the frame into snapshot_into's snapshot first
        GenServer.reply(from, outcome)
        {:noreply, state |> took_snapshot_into(opts) |> heal(Cluster.deadline(@rebuild_timeout_ms))}

      error.reason == :state_lost ->
        GenServer.reply(from, outcome)
        {:noreply, heal(state, Cluster.deadline(@rebuild_timeout_ms))}

      error.reason == :timeout and kind in @advancing ->
        state = doubt_snapshot_into(state, opts)
        {:reply, outcome, %{state | status: unsure(state.status)}}

      error.reason in @refused_before_running ->
        {:reply, outcome, state}

      true ->
        # its copy into snapshot_into's snapshot, where the frame carried one, may have failed,
        # leaving the snapshot undefined on the owner (SPEC §6.4), as no checkpoint and frames
        # of this keeper's describe
        {:reply, outcome, doubt_copy_into(state, opts)}
    end
  end

  # The session reopened on its owner from the checkpoint, the kept frames run again (a frame
  # that timed out is undone, as by a rebuild): its snapshots' copies there are the connection's,
  # not the session's, and stay good. Where the owner does not take it, it is rebuilt on another
  # member. Without checkpoints, or with kept frames that cannot reproduce the state, the session
  # stays lost on its owner, whose server refuses it (state_lost) until a restore.
  defp heal(%{every: nil} = state, _deadline), do: state
  defp heal(%{status: :tainted} = state, _deadline), do: state

  defp heal(state, deadline) do
    _closed = close_remote(state, deadline)

    case open_on(state, state.owner, deadline, nil) do
      {:ok, remote, :not_run, fingerprint} ->
        %{state | remote: remote, status: :ok, state_on_reply: true, model_fingerprint: fingerprint}

      _failed ->
        %{state | remote: nil, skipped: [state.owner | state.skipped]}
        |> leave_owner()
        |> rebuild(deadline)
    end
  end

  defp unsure(:ok), do: :unsure
  defp unsure(status), do: status

  # A frame answered: kept for a rebuild, and a checkpoint taken when one is due: `saved`, the
  # state after this frame that its reply carried, or else the state read now. Either is the
  # state after this very frame, so no kept frame precedes it.
  defp advanced(state, kind, input, opts, saved) when kind in @advancing do
    state = took_snapshot_into(state, opts)
    opts = without_snapshot_into(opts)
    status = if state.status == :unsure, do: :tainted, else: state.status

    cond do
      state.every == nil ->
        %{state | status: status}

      not checkpoint_due?(state) ->
        %{state | status: status, log: [{kind, input, opts} | state.log]}

      saved != nil ->
        %{state | checkpoint: saved, log: [], status: :ok}

      true ->
        checkpoint(%{state | status: status, log: [{kind, input, opts} | state.log]})
    end
  end

  defp advanced(state, _kind, _input, _opts, _saved), do: state

  # Whether the next frame answered completes a checkpoint.
  defp checkpoint_due?(state), do: state.every != nil and length(state.log) + 1 >= state.every

  defp checkpoint(state) do
    case ScanBridge.session_state(state.owner, state.remote, timeout: @checkpoint_timeout_ms) do
      {:ok, saved} ->
        %{state | checkpoint: saved, log: [], status: :ok}

      {:error, error} ->
        # kept frames stay; a gone owner is rebuilt by its monitor
        Logger.debug("scan-bridge: cluster session checkpoint failed: #{error.message}")
        state
    end
  end

  # A call sent to the owner: {its outcome for the caller, the state after it or nil, the
  # keeper's state}. A frame that completes a checkpoint asks for the state after it; its caller
  # gets the reply as it would have without that (with the state only when it asked for it
  # itself). An owner that refused or ignored the ask is not asked again.
  defp run_frame(state, kind, input, opts, deadline) do
    case asking(state, kind, input, opts) do
      :as_given ->
        {run(state, kind, input, opts, deadline), nil, state}

      {:ask, sent_input, sent_opts, caller_asked} = asking ->
        case run(state, kind, sent_input, sent_opts, deadline) do
          {:ok, reply} ->
            answered(state, kind, asking, reply)

          {:error, %Error{reason: :invalid_argument, detail: %{"field" => "args.return_state"}}}
          when not caller_asked ->
            # a server from before return_state refuses it, running nothing: sent as given, the
            # checkpoint is read after it
            {run(state, kind, input, opts, deadline), nil, %{state | state_on_reply: false}}

          outcome ->
            {outcome, nil, state}
        end
    end
  end

  # How the frame is sent: asking for the state after it when it completes a checkpoint.
  defp asking(state, kind, input, opts) do
    if kind in @advancing and state.state_on_reply and checkpoint_due?(state),
      do: asking_for_state(kind, input, opts),
      else: :as_given
  end

  # A frame as a rebuild sends it (the call in flight): never into a snapshot, whose copy was
  # the gone owner's.
  defp sent_frame(kind, input, opts, :as_given), do: {kind, input, without_snapshot_into(opts)}

  defp sent_frame(kind, _input, _opts, {:ask, input, opts, _caller_asked}),
    do: {kind, input, without_snapshot_into(opts)}

  # A sent frame's reply: {the caller's outcome, the state it carried or nil, the keeper's state}.
  defp answered(state, _kind, :as_given, reply), do: {{:ok, reply}, nil, state}

  defp answered(state, kind, {:ask, _input, _opts, caller_asked}, reply) do
    {answer, saved} = take_state(kind, reply, caller_asked)
    {{:ok, answer}, saved, %{state | state_on_reply: saved != nil}}
  end

  # The frame asking for the state after it: {:ask, input, opts, whether its caller asked
  # too}; or :as_given where the caller's own ask is not one to rewrite (not a boolean, or
  # given twice), so that it is sent, and answered or refused, as it is.
  defp asking_for_state(kind, input, opts) when kind in @state_option do
    given = Keyword.get_values(opts, :return_state)
    ask_unless_odd(given, input, Keyword.put(opts, :return_state, true))
  end

  defp asking_for_state(_kind, input, opts) when is_map(input) and not is_struct(input) do
    given = for key <- @state_inputs, is_map_key(input, key), do: Map.fetch!(input, key)
    ask_unless_odd(given, input |> Map.drop(@state_inputs) |> Map.put(:return_state, true), opts)
  end

  defp asking_for_state(_kind, _input, _opts), do: :as_given

  defp ask_unless_odd(given, input, opts) when given in [[], [false], [true]],
    do: {:ask, input, opts, given == [true]}

  defp ask_unless_odd(_given, _input, _opts), do: :as_given

  # The caller's answer from a reply that carries the state, and that state.
  defp take_state(kind, {output, saved}, caller_asked) when kind in @state_option,
    do: {if(caller_asked, do: {output, saved}, else: output), saved}

  defp take_state(_kind, %{state: saved} = result, caller_asked),
    do: {if(caller_asked, do: result, else: %{result | state: nil}), saved}

  defp run(state, kind, input, opts, deadline) do
    opts = opts |> snapshot_into_here(state) |> Keyword.put(:timeout, Cluster.remaining(deadline))
    send_to(state.owner, state.remote, kind, input, opts)
  rescue
    exception in ArgumentError -> {:raise, exception}
  end

  defp send_to(owner, remote, :step, input, opts), do: ScanBridge.step(owner, remote, input, opts)

  defp send_to(owner, remote, :model_step, input, opts),
    do: ScanBridge.model_step(owner, remote, input, opts)

  defp send_to(owner, remote, :model_forward, input, opts),
    do: ScanBridge.model_forward(owner, remote, input, opts)

  defp send_to(owner, remote, :scan, input, opts),
    do: ScanBridge.scan(owner, with_session!(input, remote, "scan"), opts)

  defp send_to(owner, remote, :ssd_scan, input, opts),
    do: ScanBridge.ssd_scan(owner, with_session!(input, remote, "ssd_scan"), opts)

  defp send_to(owner, remote, :session_state, nil, opts),
    do: ScanBridge.session_state(owner, remote, opts)

  defp with_session!(inputs, remote, op) when is_map(inputs) do
    if Map.has_key?(inputs, :session) or Map.has_key?(inputs, "session") do
      raise ArgumentError,
            "#{op} inputs: expected no :session (the cluster session is the first argument), got one"
    end

    Map.put(inputs, :session, remote)
  end

  defp with_session!(inputs, _remote, op), do: ScanBridge.Protocol.wire_args!(inputs, op)

  ## Placing and rebuilding

  defp place(state, deadline) do
    with {:ok, state, :not_run} <- place(state, deadline, nil), do: {:ok, state}
  end

  # Open the session on a member: from the checkpoint, with the kept frames run again, and then
  # `pending` ({kind, input, opts}, or nil), the call in flight when the owner went away, where
  # the member runs them all on the open itself: {:ok, state, its outcome}; else :not_run, and
  # the caller sends it.
  defp place(state, deadline, pending) do
    case checkout(state, Cluster.remaining(deadline)) do
      :no_members ->
        {:error, no_owner(state), state}

      :timeout ->
        {:error, Cluster.balancer_timeout("placing the session"), state}

      {:ok, member, token} ->
        case open_on(state, member, deadline, pending) do
          {:ok, remote, ran, fingerprint} ->
            {:ok,
             %{
               state
               | owner: member,
                 owner_monitor: Process.monitor(member),
                 remote: remote,
                 token: token,
                 state_on_reply: true,
                 skipped: [],
                 slow: [],
                 unplaced: nil,
                 model_fingerprint: fingerprint
             }, ran}

          {:error, %Error{reason: reason} = error} when reason in @unplaced ->
            # no answer in time (or no place there): the deadline is spent, and the next
            # placement tries the other members first
            Balancer.checkin(token)
            {:error, error, %{state | slow: [member | state.slow]}}

          {:next, _why} ->
            # this member lacks the model, or went away: try the others
            Balancer.checkin(token)

            if expired?(deadline),
              do: {:error, no_owner(state), state},
              else: place(%{state | skipped: [member | state.skipped]}, deadline, pending)

          {:error, error} ->
            Balancer.checkin(token)
            {:error, error, state}
        end
    end
  end

  # A member to open the session on: none passed over, and one whose open did not answer in time
  # only when no other is left.
  defp checkout(state, wait) do
    case Balancer.checkout(state.group, :session, state.skipped ++ state.slow, wait) do
      :no_members when state.slow != [] ->
        Balancer.checkout(state.group, :session, state.skipped, wait)

      checked_out ->
        checked_out
    end
  end

  # One request where there are frames to run, no more than a server takes in one: the open
  # with the kept frames and the pending one. A refusal is left to the open and replay one by
  # one, which a server from before frames needs (its refusal names args.frames, and is
  # remembered for the member), and which answers a frame's error as that frame's own call does
  # (the member closed the session it opened); a request that timed out or was never sent is
  # not sent again.
  defp open_on(state, member, deadline, pending) do
    frames =
      for {kind, input, opts} <- Enum.reverse(state.log) ++ List.wrap(pending),
          do: {kind, input, Keyword.delete(opts, :timeout)}

    case frames != [] and length(frames) <= @max_open_frames and Balancer.takes_frames?(member) and
           open_remote(state, member, deadline, frames) do
      {:ok, remote, results, fingerprint} ->
        {:ok, remote, if(pending, do: List.last(results), else: :not_run), fingerprint}

      {:next, _} = next ->
        next

      {:error, %Error{reason: reason} = error} when reason in [:timeout, :overloaded] ->
        {:error, error}

      {:error, %Error{reason: :invalid_argument, detail: %{"field" => "args.frames"}}} ->
        Balancer.learn_refuses_frames(member)
        open_then_replay(state, member, deadline)

      {:error, error} ->
        if Cluster.gone?(error), do: {:next, error}, else: open_then_replay(state, member, deadline)

      false ->
        open_then_replay(state, member, deadline)
    end
  end

  defp open_then_replay(state, member, deadline) do
    case open_remote(state, member, deadline, []) do
      {:ok, remote, [], fingerprint} ->
        case replay(member, remote, Enum.reverse(state.log), deadline) do
          :ok ->
            {:ok, remote, :not_run, fingerprint}

          {:error, error} ->
            # the replay's error is answered at once; the close goes apart, so a member frozen
            # meanwhile costs the caller nothing past its deadline
            close_apart(member, remote)
            if Cluster.gone?(error), do: {:next, error}, else: {:error, error}
        end

      {:error, error} ->
        if Cluster.gone?(error), do: {:next, error}, else: {:error, error}

      {:next, _} = next ->
        next
    end
  end

  # The session opened on `member` from the checkpoint, if any, and `frames` run on it:
  # {:ok, its id there, their results, its group model's fingerprint or nil}. A group model's
  # name becomes its id there: as this node learnt it (Balancer), else, or when that id was
  # freed since or is of another model than the session's, as the member tells it. A member
  # that holds another model under the name is passed over.
  defp open_remote(%{dims: %{model: name}} = state, member, deadline, frames) do
    case Balancer.model_entry(member, name) do
      {_id, fingerprint} = entry when state.model_fingerprint in [nil, fingerprint] ->
        case open_with_model(state, member, entry, deadline, frames) do
          {:error, %Error{reason: :unknown_model}} ->
            open_named(state, member, name, deadline, frames)

          result ->
            result
        end

      _unknown_or_other ->
        open_named(state, member, name, deadline, frames)
    end
  end

  defp open_remote(state, member, deadline, frames) do
    dims = if state.checkpoint, do: Map.put(state.dims, :h0, state.checkpoint), else: state.dims

    with {:ok, remote, results} <- request_open(member, dims, deadline, frames),
         do: {:ok, remote, results, nil}
  end

  defp open_named(state, member, name, deadline, frames) do
    # a frozen member (or node) answers nothing: the open's deadline bounds the wait
    case ScanBridge.Server.model_entry(member, name, Cluster.remaining(deadline)) do
      # the member's server has told this node's balancer the entry (Balancer.learn_model/4)
      {:ok, entry} ->
        case entry do
          nil ->
            {:next, :model_missing}

          {_id, fingerprint} when state.model_fingerprint in [nil, fingerprint] ->
            open_with_model(state, member, entry, deadline, frames)

          _another ->
            {:next, :model_replaced}
        end

      {:error, _} = error ->
        error
    end
  end

  defp open_with_model(state, member, {id, fingerprint}, deadline, frames) do
    dims = %{state.dims | model: id}
    dims = if state.checkpoint, do: Map.put(dims, :state, state.checkpoint), else: dims

    with {:ok, remote, results} <- request_open(member, dims, deadline, frames),
         do: {:ok, remote, results, fingerprint}
  end

  defp request_open(member, dims, deadline, []) do
    with {:ok, remote} <-
           ScanBridge.open_session(member, dims, timeout: Cluster.remaining(deadline)),
         do: {:ok, remote, []}
  rescue
    exception in ArgumentError -> {:error, client_error(exception)}
  end

  defp request_open(member, dims, deadline, frames) do
    ScanBridge.open_session_with_frames(member, dims, frames, timeout: Cluster.remaining(deadline))
  rescue
    exception in ArgumentError -> {:error, client_error(exception)}
  end

  defp client_error(exception),
    do: Error.client(:invalid_argument, Exception.message(exception), %{})

  defp replay(_member, _remote, [], _deadline), do: :ok

  defp replay(member, remote, [{kind, input, opts} | rest], deadline) do
    opts = Keyword.put(opts, :timeout, Cluster.remaining(deadline))

    case send_to(member, remote, kind, input, opts) do
      {:ok, _} -> replay(member, remote, rest, deadline)
      {:error, _} = error -> error
    end
  end

  defp owner_gone(state, why) do
    if state.owner_monitor, do: Process.demonitor(state.owner_monitor, [:flush])
    if state.token, do: Balancer.checkin(state.token)
    skipped = if state.owner, do: [state.owner | state.skipped], else: state.skipped
    # the snapshots' copies there went with it
    state = forget_copies(state, state.owner, :gone)
    state = %{state | owner: nil, owner_monitor: nil, remote: nil, token: nil, skipped: skipped}

    cond do
      state.every == nil ->
        lose(state, "the session's server went away (#{why}) and it keeps no checkpoint")

      state.status == :tainted ->
        lose(
          state,
          "the session's server went away (#{why}) after answering a frame that followed a " <>
            "timed-out one, which the kept frames cannot reproduce"
        )

      true ->
        state
    end
  end

  defp rebuild(state, deadline), do: state |> rebuild(deadline, nil) |> elem(0)

  # {the keeper's state, `pending`'s outcome where the rebuild ran it, else :not_run}
  defp rebuild(%{status: {:lost, _}} = state, _deadline, _pending), do: {state, :not_run}

  defp rebuild(state, deadline, pending) do
    case place(state, deadline, pending) do
      {:ok, state, ran} ->
        # a frame that timed out on the old owner is not in the rebuilt state: undone
        {%{state | failovers: state.failovers + 1, status: :ok}, ran}

      {:error, %Error{reason: reason} = error, state} when reason in @unplaced ->
        # no member now, or none answered in time: the checkpoint stays, and the next call
        # tries again
        {left_unplaced(state, error), :not_run}

      {:error, error, state} ->
        {lose(state, "it could not be rebuilt: #{error.message}"), :not_run}
    end
  end

  defp lose(state, why) do
    %{
      state
      | status: {:lost, Error.client(:session_lost, "the cluster session is lost: #{why}", %{})}
    }
  end

  defp unplaced(state), do: state.unplaced || no_owner(state)

  # A placement found no owner: the next call's asks every member again, those this one passed
  # over included.
  defp left_unplaced(state, error), do: %{state | unplaced: error, skipped: []}

  defp no_owner(state) do
    Error.client(
      :no_members,
      "no server of group #{inspect(state.group)} can keep the session now " <>
        "(#{length(state.skipped)} passed over: gone, without its model, or holding another " <>
        "model under its name, given it while the session's member was apart)",
      %{"skipped" => length(state.skipped)}
    )
  end

  defp close_remote(state, deadline) do
    ScanBridge.close_session(state.owner, state.remote, timeout: Cluster.remaining(deadline))
  end

  # An owner that went away before or while the close reached it took the session along, as it
  # does when its monitor is heard first: the session is closed.
  defp closed({:error, error} = outcome), do: if(Cluster.gone?(error), do: :ok, else: outcome)
  defp closed(:ok), do: :ok

  # What this keeper holds on its members, given back: the snapshots' copies on the owner (those
  # on a member gone since went with it), freed by `deadline`, then the owner's place in the
  # balancer.
  defp release(state, deadline \\ checkpoint_deadline()) do
    free_remote_snapshots(state, Map.values(state.snapshots), deadline)

    if state.token, do: Balancer.checkin(state.token)
    %{state | token: nil, snapshots: %{}}
  end

  ## Snapshots and forks

  # `call` run with the owner (a snapshot, a fork's read of the state): rebuilt first if it is
  # gone; refused if the session is lost or no member can keep it.
  defp on_owner(state, deadline, call) do
    state = if state.owner, do: state, else: rebuild(state, deadline)

    cond do
      match?({:lost, _}, state.status) -> {:reply, {:error, elem(state.status, 1)}, state}
      state.owner == nil -> {:reply, {:error, unplaced(state)}, state}
      true -> call.(state)
    end
  end

  # A snapshot of the session taken on its owner; `again`: :retry where the owner going away
  # meanwhile moves the call to the rebuilt session (failed_on_owner), :once there.
  defp take_snapshot(state, from, deadline, again) do
    case ScanBridge.snapshot(state.owner, state.remote, timeout: Cluster.remaining(deadline)) do
      {:ok, remote} ->
        replay = if state.every != nil and state.status == :ok, do: {state.checkpoint, state.log}

        id = make_ref()
        snapshot = %{owner: state.owner, remote: remote, replay: replay}
        {:reply, {:ok, id}, %{state | snapshots: Map.put(state.snapshots, id, snapshot)}}

      {:error, _} = outcome ->
        again_there = &take_snapshot(&1, from, deadline, &2)
        failed_on_owner(state, from, deadline, outcome, again, again_there)
    end
  end

  # The session's state read from its owner, and what a fork opens with it; `again` as above.
  defp read_for_fork(state, from, deadline, again) do
    case ScanBridge.session_state(state.owner, state.remote, timeout: Cluster.remaining(deadline)) do
      {:ok, saved} ->
        fork = %{
          dims: state.dims,
          every: state.every,
          state: saved,
          model_fingerprint: state.model_fingerprint
        }

        {:reply, {:ok, fork}, state}

      {:error, _} = outcome ->
        again_there = &read_for_fork(&1, from, deadline, &2)
        failed_on_owner(state, from, deadline, outcome, again, again_there)
    end
  end

  # A call other than a frame that failed on the owner (`call.(state, again)` makes it). Where the
  # owner went away with it in flight, the session is rebuilt on another member and the call made
  # there once (`again` :retry, then :once), as a frame's is (retry/7); where it cannot be placed
  # in time, the error that told of the owner's going.
  defp failed_on_owner(state, from, deadline, {:error, error} = outcome, again, call) do
    if again == :retry and Cluster.gone?(error) do
      state = state |> owner_gone(error.message) |> rebuild(deadline)

      cond do
        match?({:lost, _}, state.status) -> {:reply, {:error, elem(state.status, 1)}, state}
        state.owner == nil or expired?(deadline) -> {:reply, outcome, state}
        true -> call.(state, :once)
      end
    else
      failed(state, from, nil, [], outcome)
    end
  end

  # The snapshot put back, and the frames run after it: in place, else by reopening the session
  # from the snapshot's checkpoint and kept frames.
  defp restore_snapshot(state, id, snapshot, frames, deadline) do
    case {restore_in_place(state, snapshot, frames, deadline), snapshot.replay} do
      {{:ok, results}, _replay} ->
        {:reply, restore_answer(results), restored(state, snapshot), {:continue, {:kept, frames}}}

      {{:raise, _exception} = raised, _replay} ->
        {:reply, raised, state}

      {{:error, %Error{detail: %{"frame" => _}} = error} = outcome, _replay} ->
        {:reply, outcome, state |> restored(snapshot) |> doubt_frames_into(frames, error)}

      {{:error, %Error{reason: :timeout} = error} = outcome, _replay} ->
        # the owner may or may not have done it, as with a frame that timed out
        state = doubt_frames_into(state, frames, error)
        {:reply, outcome, %{state | status: unsure(state.status)}}

      {{:error, %Error{} = error} = outcome, replay} ->
        # reopened from the snapshot's checkpoint only when the owner went away with its
        # copy; any other error (:overloaded, :deadline_exceeded: not run) leaves the
        # session as it was, and the frames' snapshots in doubt where it may have run
        if replay != nil and Cluster.gone?(error),
          do: restore_by_replay(state, replay, frames, deadline),
          else: {:reply, outcome, doubt_frames_into(state, frames, error)}

      {:elsewhere, nil} ->
        {:reply, {:error, snapshot_gone(id)}, state}

      {:elsewhere, replay} ->
        restore_by_replay(state, replay, frames, deadline)
    end
  end

  # The snapshot's copy put back on the owner that took it, if it still owns the session, and
  # `frames` run there in the same request: {:ok, their results, nil for none}, an error, or
  # :elsewhere.
  defp restore_in_place(%{owner: owner} = state, %{owner: owner, remote: remote}, frames, deadline)
       when owner != nil do
    cond do
      match?({:lost, _}, state.status) ->
        :elsewhere

      frames == [] ->
        with :ok <-
               ScanBridge.restore(owner, state.remote, remote, timeout: Cluster.remaining(deadline)),
             do: {:ok, nil}

      true ->
        ScanBridge.restore_with_frames(owner, state.remote, remote, frames_here(frames, state),
          timeout: Cluster.remaining(deadline)
        )
    end
  rescue
    exception in ArgumentError -> {:raise, exception}
  end

  defp restore_in_place(_state, _snapshot, _frames, _deadline), do: :elsewhere

  defp restore_answer(nil), do: :ok
  defp restore_answer(results), do: {:ok, results}

  # The frames a restore ran, each kept for a rebuild after the snapshot's as a frame answered
  # is (advanced/5): the snapshot it stepped into, if any, recorded as the state before it, and
  # the frame kept without it. A checkpoint is taken when they complete one (read after the last
  # of them, so that none is kept twice).
  defp kept(state, []), do: state
  defp kept(%{every: nil} = state, _frames), do: state

  defp kept(state, frames) do
    state = Enum.reduce(frames, state, &keep_frame/2)
    if length(state.log) >= state.every, do: checkpoint(state), else: state
  end

  defp keep_frame({kind, input}, state), do: keep_frame({kind, input, []}, state)

  defp keep_frame({kind, input, opts}, state) do
    state = took_snapshot_into(state, opts)
    opts = opts |> without_snapshot_into() |> Keyword.delete(:timeout)
    %{state | log: [{kind, input, opts} | state.log]}
  end

  # After a restore the keeper's checkpoint and frames are the snapshot's, or, where it kept
  # none that reproduce it, a failover is refused until the next checkpoint.
  defp restored(state, %{replay: {checkpoint, log}}),
    do: %{state | checkpoint: checkpoint, log: log, status: :ok}

  defp restored(%{every: nil} = state, _snapshot), do: state
  defp restored(state, _snapshot), do: %{state | status: :tainted}

  # The session opened afresh from the snapshot's checkpoint with its frames run again, on the
  # least loaded member; the session as it was is closed. Where no member takes it now (none, or
  # none in time) it is left to the next call to place; one that fails otherwise is lost: it is
  # neither the snapshot's nor, with its remote gone, what it was.
  defp restore_by_replay(state, replay, [], deadline),
    do: restore_by_replay(state, replay, deadline)

  defp restore_by_replay(state, replay, frames, deadline, again \\ :retry) do
    case restore_by_replay(state, replay, deadline) do
      {:reply, :ok, state} -> frames_after_replay(state, frames, deadline, again)
      failed -> failed
    end
  end

  # The frames of a restore that went by replay, run on the session's new owner as a restore
  # with frames runs them: from a copy taken there first and freed after, so that a frame that
  # fails leaves the snapshot's state there too. The copy is freed apart whatever the frames did
  # (free_apart/2): the caller's deadline may be spent by then, and its answer is not held up.
  # Where that owner goes away meanwhile, the session is reopened from the snapshot's checkpoint
  # again and the frames run there, once (`again`), as a frame in flight is (retry/7).
  defp frames_after_replay(state, frames, deadline, again) do
    timeout = fn -> [timeout: Cluster.remaining(deadline)] end

    outcome =
      case ScanBridge.snapshot(state.owner, state.remote, timeout.()) do
        {:ok, copy} ->
          try do
            here = frames_here(frames, state)
            ScanBridge.restore_with_frames(state.owner, state.remote, copy, here, timeout.())
          after
            free_apart(state.owner, copy)
          end

        {:error, error} ->
          {:copy_failed, error}
      end

    case outcome do
      {:ok, results} ->
        {:reply, {:ok, results}, state, {:continue, {:kept, frames}}}

      {_failed, %Error{} = error} when again == :retry ->
        if Cluster.gone?(error) and not expired?(deadline),
          do: replay_again(owner_gone(state, error.message), frames, deadline, error),
          else: frames_failed(state, frames, outcome)

      _failed ->
        frames_failed(state, frames, outcome)
    end
  rescue
    exception in ArgumentError -> {:reply, {:raise, exception}, state}
  end

  # The snapshot's checkpoint and kept frames are the session's since the first reopening.
  defp replay_again(%{status: {:lost, lost}} = state, _frames, _deadline, _error),
    do: {:reply, {:error, lost}, state}

  defp replay_again(state, frames, deadline, error) do
    case restore_by_replay(state, {state.checkpoint, state.log}, frames, deadline, :once) do
      # no member took it now: the session is the snapshot's, placed by the next call
      {:reply, {:error, %Error{reason: reason}}, state} when reason in @unplaced ->
        {:reply, {:error, error}, state}

      replied ->
        replied
    end
  end

  # The restore stands (the session holds the snapshot's state); the frames were not done, or
  # may have been where they timed out.
  defp frames_failed(state, _frames, {:copy_failed, error}), do: {:reply, {:error, error}, state}

  defp frames_failed(state, frames, {:error, %Error{reason: :timeout} = error}),
    do: {:reply, {:error, error}, %{doubt_frames_into(state, frames, error) | status: :unsure}}

  defp frames_failed(state, frames, {:error, error}),
    do: {:reply, {:error, error}, doubt_frames_into(state, frames, error)}

  defp restore_by_replay(state, {checkpoint, log}, deadline) do
    fresh = %{
      leave_owner(state)
      | checkpoint: checkpoint,
        log: log,
        status: :ok,
        skipped: []
    }

    case place(fresh, deadline) do
      {:ok, state} ->
        {:reply, :ok, state}

      {:error, %Error{reason: reason} = error, state} when reason in @unplaced ->
        # the session is the snapshot's, kept by its checkpoint: the next call reopens it
        {:reply, {:error, error}, left_unplaced(state, error)}

      {:error, error, state} ->
        state = lose(state, "restoring a snapshot failed: #{error.message}")
        {:reply, {:error, error}, state}
    end
  end

  # The session taken off an owner that is still there, to be placed afresh: closed there
  # (unless `remote` is nil: closed already) apart from the caller's deadline, which goes to the
  # placement, its snapshots' copies there forgotten (the session may reopen elsewhere and come
  # back later: a copy kept would then be restored in place of the state its snapshot has since
  # been given, by snapshot_into) and freed, its place given back.
  defp leave_owner(%{owner: nil} = state), do: state

  defp leave_owner(state) do
    if state.remote, do: close_apart(state.owner, state.remote)
    Process.demonitor(state.owner_monitor, [:flush])
    Balancer.checkin(state.token)
    state = forget_copies(state, state.owner, :free)
    %{state | owner: nil, owner_monitor: nil, remote: nil, token: nil}
  end

  ## A model step into a snapshot (`snapshot_into:`, a snapshot reference of this keeper's)

  defp unknown_snapshot_into?(state, opts) do
    case Keyword.fetch(opts, :snapshot_into) do
      {:ok, id} -> not is_map_key(state.snapshots, id)
      :error -> false
    end
  end

  # Sent to the owner: the owner's copy of the snapshot named, where the owner holds it; else
  # (taken on a server that went away since) no copy is made there, and the snapshot is kept
  # by its checkpoint and frames alone (took_snapshot_into/2), restored as after a failover.
  defp snapshot_into_here(opts, state) do
    with {:ok, id} <- Keyword.fetch(opts, :snapshot_into),
         %{owner: owner, remote: remote} when owner == state.owner <- state.snapshots[id] do
      Keyword.put(opts, :snapshot_into, remote)
    else
      :error -> opts
      _elsewhere -> without_snapshot_into(opts)
    end
  end

  # The frame answered: the snapshot holds the state before it, which the checkpoint and the
  # frames kept until now reproduce (`state` is the keeper's before the frame is kept).
  defp took_snapshot_into(state, opts) do
    case Keyword.fetch(opts, :snapshot_into) do
      {:ok, id} when is_map_key(state.snapshots, id) ->
        replay = if state.every != nil and state.status == :ok, do: {state.checkpoint, state.log}
        snapshot = %{state.snapshots[id] | replay: replay}

        # a copy on another member (one the frame was not sent into) holds an older state
        snapshot =
          if snapshot.owner == state.owner,
            do: snapshot,
            else: forget_copy(snapshot, :free)

        %{state | snapshots: Map.put(state.snapshots, id, snapshot)}

      _none ->
        state
    end
  end

  # A frame that timed out may or may not have copied the state into the snapshot, as it may or
  # may not have been done: the owner's copy is the snapshot's alone from then on, as for a
  # snapshot taken while a frame is in doubt (its checkpoint and frames no longer say).
  defp doubt_snapshot_into(state, opts) do
    case Keyword.fetch(opts, :snapshot_into) do
      {:ok, id} when is_map_key(state.snapshots, id) ->
        %{state | snapshots: Map.update!(state.snapshots, id, &%{&1 | replay: nil})}

      _none ->
        state
    end
  end

  # doubt_snapshot_into/2 where the frame was sent into the owner's copy (snapshot_into_here/2):
  # a snapshot kept by its checkpoint and frames alone was not written by the frame.
  defp doubt_copy_into(state, opts) do
    with {:ok, id} <- Keyword.fetch(opts, :snapshot_into),
         %{owner: owner} when owner != nil and owner == state.owner <- state.snapshots[id] do
      doubt_snapshot_into(state, opts)
    else
      _not_sent_into -> state
    end
  end

  defp without_snapshot_into(opts), do: Keyword.delete(opts, :snapshot_into)

  ## A rollback's frames into snapshots (a restore's model_step frames with `snapshot_into:`)

  # The snapshots the frames step into, in order.
  defp frames_into(frames) do
    for {:model_step, _input, opts} when is_list(opts) <- frames,
        {:ok, id} <- [Keyword.fetch(opts, :snapshot_into)],
        do: id
  end

  # The frames as sent to the owner: each into the owner's copy of its snapshot, or into none
  # (snapshot_into_here/2), the snapshot then kept by its checkpoint and frames alone (kept/2).
  defp frames_here(frames, state) do
    Enum.map(frames, fn
      {:model_step, input, opts} when is_list(opts) ->
        {:model_step, input, snapshot_into_here(opts, state)}

      frame ->
        frame
    end)
  end

  # A rollback's request that failed: the server leaves undefined each snapshot whose copy a
  # frame began (SPEC §6.4), which the frames' error does not tell, so every snapshot a frame
  # up to the failing one (`detail["frame"]`; every frame where none is named) stepped into is
  # taken as a frame into it that failed in that way (failed/5); the frames after it never ran.
  # One the owner refused before running anything (state_lost from a restored snapshot a
  # failed copy left undefined among them), or that went with its server, is left as it was.
  defp doubt_frames_into(state, frames, %Error{reason: reason, detail: detail} = error) do
    cond do
      reason == :timeout ->
        Enum.reduce(frames_into(frames), state, &doubt_snapshot_into(&2, snapshot_into: &1))

      Cluster.gone?(error) or
          (reason in [:state_lost | @refused_before_running] and not is_map_key(detail, "frame")) ->
        state

      true ->
        ran =
          case detail do
            %{"frame" => i} when is_integer(i) -> Enum.take(frames, i + 1)
            _no_frame_named -> frames
          end

        Enum.reduce(frames_into(ran), state, &doubt_copy_into(&2, snapshot_into: &1))
    end
  end

  # The snapshots whose copies are on `owner`, kept by their checkpoint and frames alone from
  # now on (restored by reopening, or :unknown_snapshot without them); the copies are freed
  # (`:free`), unless their server is gone with them (`:gone`).
  defp forget_copies(state, nil, _copies), do: state

  defp forget_copies(state, owner, copies) do
    snapshots =
      Map.new(state.snapshots, fn
        {id, %{owner: ^owner} = snapshot} -> {id, forget_copy(snapshot, copies)}
        other -> other
      end)

    %{state | snapshots: snapshots}
  end

  defp forget_copy(%{owner: nil} = snapshot, _copies), do: snapshot

  defp forget_copy(snapshot, copies) do
    if copies == :free, do: free_apart(snapshot.owner, snapshot.remote)
    %{snapshot | owner: nil, remote: nil}
  end

  # A copy freed, or a session closed, by a process of its own: sent even where the caller's
  # deadline is spent (what is left would count against its server's pool until this keeper
  # exits), waited for by nobody, and with no deadline, so that a server frozen, or its client
  # full, for a while still gets it once it answers again. The server takes either from any
  # process; one that went away meanwhile took it along (and ended the wait).
  defp free_apart(owner, remote),
    do: apart(fn -> ScanBridge.free_snapshot(owner, remote, timeout: :infinity) end)

  defp close_apart(owner, remote),
    do: apart(fn -> ScanBridge.close_session(owner, remote, timeout: :infinity) end)

  defp apart(request) do
    {:ok, _sending} = Task.start(request)
    :ok
  end

  # None once `deadline` has passed: sent with no time left, a free would not be sent, and one to
  # a member cut off would still take its call's grace.
  defp free_remote_snapshots(state, snapshots, deadline) do
    for %{owner: owner, remote: remote} <- snapshots,
        owner != nil and owner == state.owner and not expired?(deadline) do
      _freed = ScanBridge.free_snapshot(owner, remote, timeout: Cluster.remaining(deadline))
    end

    :ok
  end

  defp not_a_snapshot(op, id) do
    Error.client(
      :unknown_snapshot,
      "#{op}: expected a snapshot of this session, got #{inspect(id)}",
      %{}
    )
  end

  defp snapshot_gone(id) do
    Error.client(
      :unknown_snapshot,
      "restore: snapshot #{inspect(id)} was kept by a server that went away, and no checkpoint " <>
        "of the session's says what it held (none kept, or a frame into it failed or timed out)",
      %{}
    )
  end

  defp deadline_passed(kind) do
    %Error{
      reason: :deadline_exceeded,
      message: "#{kind}: the deadline passed before the cluster session could send it; not sent",
      detail: %{}
    }
  end

  defp checkpoint_deadline, do: Cluster.deadline(@checkpoint_timeout_ms)

  defp earlier(:infinity, deadline), do: deadline
  defp earlier(deadline, other), do: min(deadline, other)

  defp expired?(:infinity), do: false
  defp expired?(deadline), do: Cluster.remaining(deadline) == 0
end
