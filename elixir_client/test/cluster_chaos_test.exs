defmodule ScanBridge.ClusterChaosTest do
  # A seeded random walk over a group of servers on this node: cluster sessions opened, stepped
  # (into snapshots now and then), snapshotted, restored (with a rollback's frames now and then),
  # forked and closed, while members are killed (some kills racing a step), frozen, thawed and
  # started. The oracle is a plain server: every frame answered must be what a session there fed
  # the same frames answers; after a call that timed out, either with or without it. An error is
  # only one docs/cluster.md allows for the faults of the moment. Whenever no member is frozen,
  # every member holds the sessions and snapshot copies the keepers say it does (read from their
  # state), and the balancer counts them; at the end, everything closed and thawed, nothing is
  # held anywhere and no keeper is left.
  #
  # CHAOS_SEED and CHAOS_STEPS run other walks (a fixed seed and a short walk by default); a
  # violation's report names the seed and the walk's last operations.
  use ExUnit.Case, async: false

  alias ScanBridge.{Cluster, Error, Tensor, TestSupport}
  alias ScanBridge.TestSupport.Models

  @default_seed 1
  @default_steps 60
  @max_members 3
  @max_sessions 4
  # What each call of the walk waits while a member is frozen: the time a frozen member costs
  # it. With none frozen no call may time out, and a loaded machine (CI's) can stall a healthy
  # member for a second: those calls wait longer.
  @frozen_call_timeout 1_000
  @call_timeout 15_000
  @rtol 1.0e-5
  # The errors of a call that found no member to take it in time.
  @unplaced [:timeout, :deadline_exceeded, :overloaded, :no_members]
  # How a server refuses a malformed frame.
  @refused [:invalid_argument, :shape_mismatch, :tensor_size_mismatch]

  @tag timeout: :infinity
  test "a random walk of sessions and faults answers as plain sessions do, and leaves nothing" do
    seed = env_integer("CHAOS_SEED", @default_seed)
    steps = env_integer("CHAOS_STEPS", @default_steps)
    IO.puts("cluster chaos: CHAOS_SEED=#{seed} CHAOS_STEPS=#{steps}")

    g = {:chaos, System.unique_integer([:positive])}
    backbone = Models.backbone(Models.config(:mamba2), 11)
    reference = start_supervised!({ScanBridge, TestSupport.server_opts()})
    {:ok, %{"model" => model}} = ScanBridge.load_model(reference, backbone)
    members = start_members(g, 2)
    assert {:ok, %{members: 2}} = Cluster.load_model(g, "tiny", backbone)

    world = %{
      group: g,
      rand: :rand.seed_s(:exsss, {seed, 3, 5}),
      reference: reference,
      model: model,
      snapshot_bytes: snapshot_bytes(reference, model),
      members: Map.new(members, &{&1, member(&1)}),
      sessions: %{},
      next_session: 0,
      kills: 0,
      log: []
    }

    world = Enum.reduce(1..steps//1, world, fn _step, world -> walk(world) end)
    finish(world)
  end

  ## The walk

  defp walk(world) do
    {op, world} = pick(world, choices(world))
    world = apply_op(op, world)
    if any_frozen?(world), do: world, else: settled!(world)
  end

  # With every member answering, each holds the sessions and snapshot copies the keepers say it
  # does, once what they do apart settles (a rebuild on its owner's death, copies freed by
  # processes of their own, sessions closed by a server whose keeper went): nothing leaks, and
  # no keeper counts on what is gone. The balancer counts the same sessions, and no call.
  defp settled!(world) do
    settled =
      TestSupport.eventually(fn -> held_by_members(world) == kept_by_keepers(world) end, 5_000)

    unless settled,
      do:
        violation!(
          world,
          "members hold {sessions, snapshot copies} #{inspect(held_by_members(world))}, " <>
            "keepers keep #{inspect(kept_by_keepers(world))}" <> holdings(world)
        )

    world
  end

  # Who holds what, for a violation's report: each keeper's owner, session there, status and
  # the members holding its snapshots' copies; each member's sessions and copies by opener.
  defp holdings(world) do
    keepers =
      for pid <- keepers(world.group), state = keeper_state(pid) do
        copies = for {_id, %{owner: owner}} <- state.snapshots, do: owner
        {pid, state.owner, state.remote, state.status, copies}
      end

    members = for {m, _} <- world.members, do: {m, :sys.get_state(m, 5_000).opener_of}
    "\nkeepers #{inspect(keepers)}\nmembers' openers #{inspect(members)}"
  end

  defp held_by_members(world) do
    Map.new(world.members, fn {member, _} ->
      {sessions, bytes} = held(member)
      balanced = Map.get(Cluster.loads(world.group), member, %{calls: 0, sessions: 0})
      {member, %{sessions: sessions, copies: bytes, balanced: balanced}}
    end)
  end

  # What the keepers of the group say each member holds, snapshot copies counted in bytes (every
  # session's state is the same size), and what the balancer should count there.
  defp kept_by_keepers(world) do
    states = for pid <- keepers(world.group), state = keeper_state(pid), do: state

    Map.new(world.members, fn {member, _} ->
      owned = Enum.filter(states, &(&1.owner == member and &1.remote != nil))

      copies = Enum.sum(for state <- states, {_id, %{owner: ^member}} <- state.snapshots, do: 1)

      {member,
       %{
         sessions: length(owned),
         copies: copies * world.snapshot_bytes,
         balanced: %{calls: 0, sessions: Enum.count(states, &(&1.owner == member))}
       }}
    end)
  end

  # Each operation the world allows now, with its weight.
  defp choices(world) do
    sessions = map_size(world.sessions)
    live = map_size(world.members)
    frozen = Enum.count(world.members, fn {_m, m} -> m.frozen end)
    snapshots = Enum.sum(for {_id, s} <- world.sessions, do: map_size(s.snapshots))

    [
      {:open, if(sessions < @max_sessions, do: 3, else: 0)},
      {:step, if(sessions > 0, do: 12, else: 0)},
      {:burst, if(sessions > 1, do: 2, else: 0)},
      {:snapshot, if(sessions > 0, do: 3, else: 0)},
      {:restore, if(snapshots > 0, do: 3, else: 0)},
      {:free_snapshot, if(snapshots > 0, do: 1, else: 0)},
      {:fork, if(sessions > 0 and sessions < @max_sessions, do: 1, else: 0)},
      {:close, if(sessions > 0, do: 1, else: 0)},
      {:kill, if(live > 1, do: 1, else: 0)},
      {:freeze, if(frozen == 0 and live > 0, do: 1, else: 0)},
      {:thaw, if(frozen > 0, do: 3, else: 0)},
      {:start, if(live < @max_members, do: 1, else: 0)}
    ]
    |> Enum.filter(fn {_op, weight} -> weight > 0 end)
  end

  defp pick(world, weighted) do
    total = weighted |> Enum.map(&elem(&1, 1)) |> Enum.sum()
    {u, rand} = :rand.uniform_s(total, world.rand)

    {op, _} =
      Enum.reduce_while(weighted, u, fn {op, weight}, left ->
        if left <= weight, do: {:halt, {op, 0}}, else: {:cont, left - weight}
      end)

    {op, %{world | rand: rand}}
  end

  defp pick_one(world, []), do: {nil, world}

  defp pick_one(world, items) do
    {i, rand} = :rand.uniform_s(length(items), world.rand)
    {Enum.at(items, i - 1), %{world | rand: rand}}
  end

  # The walk so far, numbered, newest first: what a violation's report shows.
  defp note(world, what), do: %{world | log: [{length(world.log) + 1, what} | world.log]}

  defp sorted_sessions(world), do: world.sessions |> Map.keys() |> Enum.sort()

  defp apply_op(:open, world) do
    {checkpoint, world} = pick_one(world, [nil, 1, 2, 3, 3])
    opts = if checkpoint, do: [checkpoint: checkpoint], else: []
    outcome = Cluster.open_session(world.group, [model: "tiny", batch: 1], opts ++ timeout(world))
    world = note(world, {:open, checkpoint, brief(outcome)})

    case outcome do
      {:ok, handle} -> add_session(world, handle, checkpoint, [[]])
      {:error, error} -> allow!(world, error, @unplaced, "open")
    end
  end

  defp apply_op(:step, world) do
    {id, world} = pick_one(world, sorted_sessions(world))
    step(world, id, fn -> :ok end)
  end

  # Every session steps at once: their keepers' calls meet on the members.
  defp apply_op(:burst, world) do
    {steps, world} =
      Enum.map_reduce(sorted_sessions(world), note(world, :burst), &prepare_step(&2, &1))

    steps
    |> Task.async_stream(&send_step/1, timeout: :infinity, ordered: true)
    |> Enum.zip(steps)
    |> Enum.reduce(world, fn {{:ok, outcome}, step}, world -> judge_step(world, step, outcome) end)
  end

  defp apply_op(:snapshot, world) do
    {id, s, outcome, world} = on_session(world, :snapshot, &Cluster.snapshot(&1, timeout(world)))

    case outcome do
      {:ok, ref} ->
        # without checkpoints, or taken while a frame is in doubt, a snapshot is its server's
        fragile = s.checkpoint == nil or s.doubt != nil
        snapshot = %{paths: s.paths, fragile: fragile}
        put_session(world, id, %{s | snapshots: Map.put(s.snapshots, ref, snapshot), lost: false})

      {:error, error} ->
        session_error(world, id, error, @unplaced, "snapshot")
    end
  end

  defp apply_op(:restore, world) do
    {id, ref, world} = pick_snapshot(world)
    s = world.sessions[id]
    snapshot = s.snapshots[ref]
    # a rollback's re-simulation now and then: frames run after the restore, in its request
    {count, world} = pick_one(world, [0, 0, 1, 2])
    {frames, world} = Enum.map_reduce(List.duplicate(nil, count), world, fn _, w -> frame(w) end)

    outcome =
      if frames == [],
        do: Cluster.restore(s.handle, ref, timeout(world)),
        else: Cluster.restore_with_frames(s.handle, ref, model_frames(frames), timeout(world))

    world = note(world, {:restore, id, brief(outcome)})

    case outcome do
      {:error, %Error{reason: :unknown_snapshot} = error} ->
        unless snapshot.fragile and world.kills > s.kills_at_open,
          do: violation!(world, "restore of a snapshot kept by checkpoints: #{error.message}")

        put_session(world, id, %{s | snapshots: Map.delete(s.snapshots, ref)})

      {:error, %Error{reason: reason} = error} when reason in @unplaced ->
        world = allow!(world, error, @unplaced, "restore")
        # done or not (a timeout on its server), not sent (:overloaded, :deadline_exceeded), or,
        # where it reopens the session and no member takes it in time, the snapshot's, reopened
        # by the next call
        done = Enum.map(snapshot.paths, &(&1 ++ frames))
        paths = Enum.uniq(s.paths ++ snapshot.paths ++ done)
        # a lost session may be the snapshot's now, reopened by the next call
        lost = if s.lost == true and not snapshot.fragile, do: :maybe, else: s.lost
        put_session(world, id, %{s | paths: paths, doubt: 0, lost: lost})

      {:error, error} ->
        session_error(world, id, error, [], "restore")

      restored ->
        # a lost session is reopened from a snapshot its checkpoints keep, and is no more lost
        if s.lost == true and snapshot.fragile,
          do: violation!(world, "restore of a lost session from its server's snapshot answered :ok")

        paths = resimulated(world, snapshot.paths, frames, restored, id)
        doubt = if snapshot.fragile, do: 0
        put_session(world, id, %{s | paths: paths, doubt: doubt, lost: false})
    end
  end

  defp apply_op(:free_snapshot, world) do
    {id, ref, world} = pick_snapshot(world)
    s = world.sessions[id]
    outcome = Cluster.free_snapshot(s.handle, ref, timeout(world))
    world = note(world, {:free_snapshot, id, brief(outcome)})
    # freed or not, the walk uses it no more
    world = put_session(world, id, %{s | snapshots: Map.delete(s.snapshots, ref)})

    case outcome do
      :ok -> world
      {:error, error} -> allow!(world, error, [:timeout], "free_snapshot")
    end
  end

  defp apply_op(:fork, world) do
    {id, s, outcome, world} = on_session(world, :fork, &Cluster.fork(&1, timeout(world)))

    case outcome do
      {:ok, handle} ->
        if s.lost == true, do: violation!(world, "fork of a lost session answered :ok")
        world = put_session(world, id, %{s | lost: false})
        add_session(world, handle, s.checkpoint, s.paths)

      {:error, error} ->
        session_error(world, id, error, @unplaced, "fork")
    end
  end

  defp apply_op(:close, world) do
    {id, world} = pick_one(world, sorted_sessions(world))
    close(world, id)
  end

  defp apply_op(:kill, world) do
    {member, world} = pick_one(world, world.members |> Map.keys() |> Enum.sort())
    # now and then racing a step of a session (on the member killed, or on another)
    {racing, world} = pick_one(world, [nil | sorted_sessions(world)])
    os_pid = world.members[member].os_pid
    ref = Process.monitor(member)
    members = Map.delete(world.members, member)
    world = note(%{world | members: members, kills: world.kills + 1}, {:kill, member})
    kill = fn -> TestSupport.kill!(os_pid) end
    world = if racing, do: step(world, racing, kill), else: tap(world, fn _ -> kill.() end)
    assert_receive {:DOWN, ^ref, :process, _, _}, 5_000
    world
  end

  defp apply_op(:freeze, world) do
    {member, world} = pick_one(world, world.members |> Map.keys() |> Enum.sort())
    TestSupport.freeze(world.members[member].os_pid)
    members = Map.update!(world.members, member, &%{&1 | frozen: true})
    note(%{world | members: members}, {:freeze, member})
  end

  defp apply_op(:thaw, world), do: thaw_all(world)

  defp apply_op(:start, world) do
    [member] = start_members(world.group, 1)
    note(%{world | members: Map.put(world.members, member, member(member))}, {:start, member})
  end

  defp pick_into(world, %{snapshots: snapshots}) when snapshots != %{} do
    {u, rand} = :rand.uniform_s(4, world.rand)
    world = %{world | rand: rand}
    if u == 1, do: pick_one(world, snapshots |> Map.keys() |> Enum.sort()), else: {nil, world}
  end

  defp pick_into(world, _s), do: {nil, world}

  defp into(s, nil, _snapshot), do: s
  defp into(s, ref, snapshot), do: %{s | snapshots: Map.put(s.snapshots, ref, snapshot)}

  # A step into a snapshot that timed out may or may not have copied into it: its server's alone.
  defp into_in_doubt(s, nil), do: s

  defp into_in_doubt(s, ref) do
    old = s.snapshots[ref]
    into(s, ref, %{paths: Enum.uniq(old.paths ++ s.paths), fragile: true})
  end

  # A session holding snapshots, and one of them.
  defp pick_snapshot(world) do
    {id, world} =
      pick_one(world, for({id, s} <- world.sessions, s.snapshots != %{}, do: id) |> Enum.sort())

    {ref, world} = pick_one(world, world.sessions[id].snapshots |> Map.keys() |> Enum.sort())
    {id, ref, world}
  end

  defp model_frames(frames), do: for(f <- frames, do: {:model_step, {:embeds, f}})

  # The paths a restore leaves: the snapshot's, and the frames it re-simulated after, each
  # answered as the paths that match say.
  defp resimulated(_world, paths, [], :ok, _id), do: paths

  defp resimulated(world, paths, frames, {:ok, results}, id) do
    Enum.zip(frames, results)
    |> Enum.reduce(paths, fn {frame, y}, paths ->
      case Enum.filter(paths, &matches?(world, &1 ++ [frame], y)) do
        [] -> violation!(world, "session #{id}: a re-simulated frame matches no possible path")
        before -> Enum.map(before, &(&1 ++ [frame]))
      end
    end)
  end

  # A step of session `id`, with `during` run meanwhile (a fault racing it: timing decides
  # whether it reaches the call, and the outcome must be one of both).
  defp step(world, id, during) do
    {step, world} = prepare_step(world, id)
    fault = Task.async(during)
    outcome = send_step(step)
    Task.await(fault, 10_000)
    judge_step(world, step, outcome)
  end

  # A step of session `id` drawn: its frame, now and then one of the wrong width (which every
  # server refuses, running nothing), and now and then a snapshot to step into, as a rollback
  # ring does.
  defp prepare_step(world, id) do
    s = world.sessions[id]
    {malformed, world} = pick_one(world, [true | List.duplicate(false, 9)])
    {frame, world} = if malformed, do: frame(world, 7), else: frame(world)
    {into, world} = pick_into(world, s)

    {%{
       id: id,
       handle: s.handle,
       frame: frame,
       malformed: malformed,
       into: into,
       timeout: timeout(world)
     }, world}
  end

  defp send_step(%{handle: handle, frame: frame, into: into, timeout: timeout}) do
    opts = if into, do: [snapshot_into: into], else: []
    Cluster.model_step(handle, {:embeds, frame}, opts ++ timeout)
  end

  defp judge_step(world, %{id: id, frame: frame, malformed: malformed, into: into}, outcome) do
    s = world.sessions[id]
    world = note(world, {:step, id, brief(outcome)})

    case outcome do
      {:ok, _y} when malformed ->
        violation!(world, "a malformed frame answered")

      {:error, %Error{reason: reason}} when malformed and reason in @refused ->
        world

      {:error, %Error{reason: :timeout} = error} when malformed ->
        world = allow!(world, error, [:timeout], "step")
        put_session(world, id, %{into_in_doubt(s, into) | doubt: 0})

      {:ok, y} ->
        if s.lost == true, do: violation!(world, "step of a lost session answered")
        before = Enum.filter(s.paths, &matches?(world, &1 ++ [frame], y))

        if before == [],
          do:
            violation!(
              world,
              "session #{id}: step answered #{inspect(y)}, matching none of " <>
                "#{length(s.paths)} possible paths"
            )

        s = into(s, into, %{paths: before, fragile: s.checkpoint == nil or s.doubt != nil})
        s = %{s | paths: Enum.map(before, &(&1 ++ [frame])), lost: false}
        put_session(world, id, answered(s))

      {:error, %Error{reason: :timeout} = error} ->
        world = allow!(world, error, [:timeout], "step")
        grown = Enum.map(s.paths, &(&1 ++ [frame]))
        s = into_in_doubt(s, into)
        put_session(world, id, %{s | paths: Enum.uniq(s.paths ++ grown), doubt: 0})

      {:error, error} ->
        session_error(world, id, error, @unplaced, "step")
    end
  end

  # A session picked and `call` made on its handle, noted: {its id, the walk's record of it, the
  # outcome, the world}.
  defp on_session(world, op, call) do
    {id, world} = pick_one(world, sorted_sessions(world))
    s = world.sessions[id]
    outcome = call.(s.handle)
    {id, s, outcome, note(world, {op, id, brief(outcome)})}
  end

  defp thaw_all(world) do
    members =
      Map.new(world.members, fn
        {member, %{frozen: false} = m} ->
          {member, m}

        {member, %{frozen: true} = m} ->
          TestSupport.thaw(m.os_pid)
          {member, %{m | frozen: false}}
      end)

    note(%{world | members: members}, :thaw)
  end

  defp close(world, id) do
    s = world.sessions[id]
    outcome = Cluster.close_session(s.handle, timeout(world))
    world = note(%{world | sessions: Map.delete(world.sessions, id)}, {:close, id, brief(outcome)})

    case outcome do
      :ok -> world
      {:error, error} -> allow!(world, error, [:timeout], "close")
    end
  end

  ## Sessions and their paths

  # A session as the walk knows it: `paths`, the frame sequences its state may be the result of
  # (more than one after a call that timed out: done or not); `doubt`, nil or the frames
  # answered since a call that timed out (or a restore of a snapshot its checkpoints do not
  # keep): until a checkpoint, its failover may be refused and its snapshots are its server's;
  # `lost`, whether it answers `:session_lost` (`:maybe` after a restore that may have reopened
  # it: either).
  defp add_session(world, handle, checkpoint, paths) do
    id = world.next_session

    s = %{
      handle: handle,
      checkpoint: checkpoint,
      paths: paths,
      doubt: nil,
      lost: false,
      kills_at_open: world.kills,
      snapshots: %{}
    }

    %{world | sessions: Map.put(world.sessions, id, s), next_session: id + 1}
  end

  # A frame answered: `checkpoint` of them since the last doubt took a checkpoint, which ends it.
  defp answered(%{doubt: nil} = s), do: s
  defp answered(%{doubt: n, checkpoint: every} = s) when n + 1 >= every, do: %{s | doubt: nil}
  defp answered(%{doubt: n} = s), do: %{s | doubt: n + 1}

  defp put_session(world, id, s), do: %{world | sessions: Map.put(world.sessions, id, s)}

  # An error from a session's call: `:session_lost` where its server went away and nothing
  # could rebuild it (no checkpoints, or a frame in doubt), else one of `allowed` now.
  defp session_error(world, id, %Error{reason: :session_lost} = error, _allowed, what) do
    s = world.sessions[id]

    unless s.lost != false or
             (world.kills > s.kills_at_open and (s.checkpoint == nil or s.doubt != nil)),
           do: violation!(world, "#{what} of session #{id}: #{error.message}")

    put_session(world, id, %{s | lost: true})
  end

  defp session_error(world, _id, error, allowed, what), do: allow!(world, error, allowed, what)

  # `:timeout`, `:deadline_exceeded` (a keeper still busy with a call that timed out) and
  # `:overloaded` (a client still busy with one: not sent) only while a member is frozen;
  # `:no_members` only while no member answers.
  defp allow!(world, %Error{reason: reason} = error, allowed, what) do
    frozen = any_frozen?(world)
    answering = Enum.count(world.members, fn {_m, m} -> not m.frozen end)

    ok =
      reason in allowed and
        case reason do
          r when r in [:timeout, :deadline_exceeded, :overloaded] -> frozen
          :no_members -> answering == 0
          _ -> true
        end

    unless ok, do: violation!(world, "#{what}: #{inspect(reason)}: #{error.message}")
    world
  end

  # Whether `y` is what a plain session fed `path` answers to its last frame.
  defp matches?(world, path, %Tensor{} = y) do
    frames = for f <- path, do: {:model_step, {:embeds, f}, []}

    {:ok, session, results} =
      ScanBridge.open_session_with_frames(world.reference, %{model: world.model, batch: 1}, frames)

    :ok = ScanBridge.close_session(world.reference, session)
    close?(y, List.last(results))
  end

  defp close?(%Tensor{shape: shape} = a, %Tensor{shape: shape} = e) do
    a = Tensor.to_list(a)
    e = Tensor.to_list(e)
    scale = e |> Enum.map(&abs/1) |> Enum.max()
    Enum.zip(a, e) |> Enum.all?(fn {x, y} -> abs(x - y) <= @rtol * scale end)
  end

  defp close?(_a, _e), do: false

  defp frame(world, width \\ 8) do
    {t, rand} = Models.uniform({1, width}, -1.0, 1.0, world.rand)
    {t, %{world | rand: rand}}
  end

  ## The end

  defp finish(world) do
    IO.puts("cluster chaos: #{inspect(tally(world.log))}")
    world = thaw_all(world)
    world = Enum.reduce(sorted_sessions(world), world, &close(&2, &1))
    g = world.group

    for {member, _} <- world.members do
      assert TestSupport.eventually(fn -> held(member) == {0, 0} end, 5_000),
             "member #{inspect(member)} holds {sessions, snapshot bytes} #{inspect(held(member))}" <>
               trail(world)
    end

    assert held(world.reference) == {0, 0}

    assert TestSupport.eventually(fn ->
             Enum.all?(Cluster.loads(g), fn {_, load} -> load == %{calls: 0, sessions: 0} end)
           end),
           "balancer loads #{inspect(Cluster.loads(g))}" <> trail(world)

    assert keepers(g) == [], "keepers left: #{inspect(keepers(g))}" <> trail(world)
  end

  defp held(member) do
    {:ok, stats} = ScanBridge.stats(member, timeout: 5_000)
    {stats["sessions"]["sessions"], stats["sessions"]["snapshot_bytes"]}
  end

  defp keepers(g) do
    for {_, pid, _, _} <- DynamicSupervisor.which_children(ScanBridge.Cluster.Sessions),
        is_pid(pid),
        match?(%{group: ^g}, keeper_state(pid)),
        do: pid
  end

  # The bytes of one snapshot's copy of a session of the model.
  defp snapshot_bytes(reference, model) do
    {:ok, session} = ScanBridge.open_session(reference, model: model, batch: 1)
    {:ok, snapshot} = ScanBridge.snapshot(reference, session)
    {_sessions, bytes} = held(reference)
    :ok = ScanBridge.free_snapshot(reference, snapshot)
    :ok = ScanBridge.close_session(reference, session)
    assert held(reference) == {0, 0}
    bytes
  end

  defp keeper_state(pid) do
    :sys.get_state(pid, 5_000)
  catch
    :exit, _ -> nil
  end

  ## Members

  defp start_members(group, n) do
    opts = TestSupport.server_opts(group: group)

    members =
      Task.async_stream(1..n, fn _ -> TestSupport.start_unlinked(opts) end,
        timeout: 60_000,
        ordered: true
      )
      |> Enum.map(fn {:ok, pid} -> pid end)

    on_exit(fn -> Enum.each(members, &TestSupport.stop_quietly/1) end)

    for member <- members do
      assert TestSupport.eventually(fn -> member in Cluster.members(group) end, 20_000),
             "#{inspect(member)} never joined #{inspect(group)}"
    end

    members
  end

  defp member(pid) do
    {:ok, os_pid} = ScanBridge.os_pid(pid)
    %{os_pid: os_pid, frozen: false}
  end

  ## Reporting

  defp timeout(world),
    do: [timeout: if(any_frozen?(world), do: @frozen_call_timeout, else: @call_timeout)]

  defp any_frozen?(world), do: Enum.any?(world.members, fn {_m, m} -> m.frozen end)

  defp brief({:ok, %Tensor{}}), do: :ok
  defp brief({:ok, _}), do: :ok
  defp brief(:ok), do: :ok
  defp brief({:error, %Error{reason: reason}}), do: reason

  defp violation!(world, what), do: flunk(what <> trail(world))

  defp trail(world) do
    "\nCHAOS_SEED=#{env_integer("CHAOS_SEED", @default_seed)}; the walk, newest first:\n" <>
      (world.log |> Enum.take(40) |> Enum.map_join("\n", &inspect/1))
  end

  # How often each operation came out each way.
  defp tally(log) do
    log
    |> Enum.map(fn
      {_n, {op, _session, outcome}} -> {op, outcome}
      {_n, {op, _member}} -> op
      {_n, op} -> op
    end)
    |> Enum.frequencies()
  end

  defp env_integer(name, default) do
    case System.get_env(name) do
      nil -> default
      value -> String.to_integer(value)
    end
  end
end
