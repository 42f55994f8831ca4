defmodule ScanBridge.ClusterChaosTest do
  # A seeded random walk over a group of servers, on this node and (in most walks) one on a
  # `:peer` node: cluster sessions opened, stepped (into snapshots now and then), snapshotted,
  # restored (with a rollback's frames now and then, one of them malformed now and then, after
  # a good one, and some of them stepping into the session's other snapshots, as a rollback
  # ring is refreshed), forked and closed, while members are killed (some kills racing a
  # step), frozen, thawed and started, and the peer is cut off and joined again (its model's
  # name freed and given to another model meanwhile, on its side, now and then). Every keeper
  # is on this node. The oracle is a plain server: every frame answered must be what a session
  # there fed the same frames answers (of the model the session runs), and every snapshot
  # restored what it was given; after a call that timed out, either with or without it. An
  # error is only one docs/cluster.md allows for the faults of the moment: a session of the
  # member cut off is rebuilt here, or lost where it keeps no checkpoint (or a frame is in
  # doubt), its server's snapshots with it; a snapshot a failed rollback's frame copied into
  # answers `:state_lost` on its server, or, as its server's alone, `:unknown_snapshot` once
  # the session left it; a session whose model's name went to another model while apart runs
  # on, and once it leaves its member, no member takes it (`:no_members`), nor a fork of it.
  # Whenever no member is frozen, every member holds the sessions and snapshot copies the
  # keepers say it does (read from their state; a member cut off, over `:peer.call`: nothing,
  # its server closed what the keepers here opened), and the balancer counts them; at the end,
  # everything closed, thawed and joined, nothing is held anywhere and no keeper is left.
  #
  # CHAOS_SEED and CHAOS_STEPS run other walks (a fixed seed and a short walk by default; a
  # seed that is a multiple of 4 walks without a peer); a violation's report names the seed and
  # the walk's last operations.
  use ExUnit.Case, async: false

  alias ScanBridge.{Cluster, Error, Tensor, TestSupport}
  alias ScanBridge.Cluster.Balancer
  alias ScanBridge.TestSupport.{Models, Peers}

  @moduletag :cluster

  @default_seed 1
  @default_steps 60
  # on this node; the peer's node holds one at most
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
  # What a call is answered whose member went away with it (its server exited, its node cut off).
  @owner_gone [:server_exited, :node_down]
  # How a server refuses a malformed frame.
  @refused [:invalid_argument, :shape_mismatch, :tensor_size_mismatch]
  # The backbone of the group's model; the n-th model given its name while apart is seed + n's.
  @backbone_seed 11

  setup_all do
    Peers.ensure_distributed!()
    :ok
  end

  @tag timeout: :infinity
  test "a random walk of sessions and faults answers as plain sessions do, and leaves nothing" do
    seed = env_integer("CHAOS_SEED", @default_seed)
    steps = env_integer("CHAOS_STEPS", @default_steps)
    with_peer = rem(seed, 4) != 0
    IO.puts("cluster chaos: CHAOS_SEED=#{seed} CHAOS_STEPS=#{steps} peer: #{with_peer}")

    g = {:chaos, System.unique_integer([:positive])}
    backbone = backbone(0)
    reference = start_supervised!({ScanBridge, TestSupport.server_opts()})
    {:ok, %{"model" => model}} = ScanBridge.load_model(reference, backbone)
    peer = if with_peer, do: Peers.start_peer!("chaos", cut_off: true)
    on_peer = if peer, do: Task.async(fn -> Peers.start_server!(peer, group: g) end)
    members = start_members(g, 2)
    members = if on_peer, do: members ++ [joined!(g, Task.await(on_peer, 150_000))], else: members
    assert {:ok, %{members: n}} = Cluster.load_model(g, "tiny", backbone)
    assert n == length(members)

    world = %{
      group: g,
      rand: :rand.seed_s(:exsss, {seed, 3, 5}),
      reference: reference,
      # the reference's model of each generation of the name "tiny": the group's now (`gen`),
      # and the one it takes when the peer, cut off, gave the name to another (`retaken`)
      models: %{0 => model},
      gen: 0,
      retaken: nil,
      snapshot_bytes: snapshot_bytes(reference, model),
      members: Map.new(members, &{&1, member(&1)}),
      peer: peer,
      cut: false,
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

    # nothing of the group's may connect the nodes again while the walk keeps them apart
    if world.cut and world.peer.node in Node.list(),
      do: violation!(world, "#{world.peer.node}, cut off, is connected again")

    if any_frozen?(world), do: world, else: settled!(world)
  end

  # With every member answering, each holds the sessions and snapshot copies the keepers say it
  # does, once what they do apart settles (a rebuild on its owner's death, copies freed by
  # processes of their own, sessions closed by a server whose keeper went or was cut off):
  # nothing leaks, and no keeper counts on what is gone. The balancer counts the same sessions,
  # and no call.
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

    members =
      for {m, _} <- world.members,
          do: {m, on_side(world, m, :sys, :get_state, [m, 5_000]).opener_of}

    "\nkeepers #{inspect(keepers)}\nmembers' openers #{inspect(members)}"
  end

  defp held_by_members(world) do
    loads = Cluster.loads(world.group)

    Map.new(world.members, fn {member, _} ->
      {sessions, bytes} = held(world, member)
      balanced = Map.get(loads, member, %{calls: 0, sessions: 0})
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
    live = length(reachable(world))
    frozen = Enum.count(world.members, fn {_m, m} -> m.frozen end)
    snapshots = Enum.sum(for {_id, s} <- world.sessions, do: map_size(s.snapshots))
    here = length(on(world, :here))
    spent = Enum.count(world.sessions, fn {_id, s} -> s.lost == true or s.stranded end)
    # a heal and a model's name retaken on the peer's side wait until nothing is frozen
    joined = world.peer != nil and not world.cut
    apart = world.peer != nil and world.cut and frozen == 0

    [
      {:open, if(sessions < @max_sessions, do: 3, else: 0)},
      {:step, if(sessions > 0, do: 12, else: 0)},
      {:burst, if(sessions > 1, do: 2, else: 0)},
      {:snapshot, if(sessions > 0, do: 5, else: 0)},
      {:restore, if(snapshots > 0, do: 3, else: 0)},
      {:free_snapshot, if(snapshots > 0, do: 1, else: 0)},
      {:fork, if(sessions > 0 and sessions < @max_sessions, do: 1, else: 0)},
      # a session lost, or that no member takes, is closed sooner: it only answers so
      {:close, if(sessions > 0, do: 1 + spent, else: 0)},
      {:kill, if(live > 1, do: 1, else: 0)},
      {:freeze, if(frozen == 0 and live > 0, do: 1, else: 0)},
      {:thaw, if(frozen > 0, do: 3, else: 0)},
      {:start, if(start_sides(world) != [], do: 1, else: 0)},
      {:cut, if(joined and here > 0, do: 2, else: 0)},
      {:heal, if(apart, do: 3, else: 0)},
      {:retake, if(apart and on(world, :peer) != [], do: 2, else: 0)}
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
      {:ok, handle} -> add_session(world, handle, checkpoint, [[]], world.gen)
      {:error, error} -> allow!(world, error, @unplaced, "open")
    end
  end

  defp apply_op(:step, world) do
    {id, world} = pick_one(world, sorted_sessions(world))
    step(world, id)
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
        answered_unless_stranded!(world, s, "snapshot")
        # without checkpoints, or taken while a frame is in doubt, a snapshot is its server's
        fragile = s.checkpoint == nil or s.doubt != nil
        snapshot = %{paths: s.paths, fragile: fragile, undefined: false, copy_at: at(world, s)}
        put_session(world, id, %{s | snapshots: Map.put(s.snapshots, ref, snapshot), lost: false})

      {:error, error} ->
        session_error(world, id, error, @unplaced, "snapshot")
    end
  end

  defp apply_op(:restore, world) do
    {id, ref, world} = pick_snapshot(world)
    s = world.sessions[id]
    snapshot = s.snapshots[ref]
    # a rollback's re-simulation now and then: frames run after the restore, in its request;
    # now and then one of them, after a good one, of the wrong width (which the server refuses
    # as it comes to it, leaving the snapshot's state: what the frames before it did is undone)
    {count, world} = pick_one(world, [0, 1, 2, 3])
    {frames, world} = Enum.map_reduce(List.duplicate(nil, count), world, fn _, w -> frame(w) end)

    {bad, world} =
      if count > 1,
        do: pick_one(world, [nil, nil | Enum.to_list(1..(count - 1))]),
        else: {nil, world}

    {frames, world} = if bad, do: malformed_at(world, frames, bad), else: {frames, world}
    {ring, world} = pick_ring(world, s, ref, count)
    # a snapshot whose copy may be on a member the session left is restored by reopening it
    s = if snapshot.copy_at != at(world, s), do: %{s | moves: s.moves + 1}, else: s
    world = put_session(world, id, s)

    outcome =
      if frames == [],
        do: Cluster.restore(s.handle, ref, timeout(world)),
        else: Cluster.restore_with_frames(s.handle, ref, model_frames(frames, ring), timeout(world))

    kind =
      cond do
        bad != nil -> :restore_with_bad_frame
        frames != [] -> :restore_with_frames
        true -> :restore
      end

    kind = if Enum.any?(ring), do: {kind, :into_ring}, else: kind
    world = note(world, {kind, id, brief(outcome)})
    # what the frames leave done: all of them, or none where one fails
    done_frames = if bad, do: [], else: frames

    case outcome do
      {:error, %Error{reason: :unknown_snapshot} = error} ->
        unless snapshot.fragile and owner_moved?(world, s),
          do: violation!(world, "restore of a snapshot kept by checkpoints: #{error.message}")

        put_session(world, id, %{s | snapshots: Map.delete(s.snapshots, ref)})

      {:error, %Error{reason: reason} = error} when reason in @unplaced ->
        world = session_error(world, id, error, @unplaced, "restore")
        s = world.sessions[id]
        # done or not (a timeout on its server), not sent (:overloaded, :deadline_exceeded), or,
        # where it reopens the session and no member takes it in time, the snapshot's, reopened
        # by the next call
        done = Enum.map(snapshot.paths, &(&1 ++ done_frames))
        paths = Enum.uniq(s.paths ++ snapshot.paths ++ done)
        # a lost session may be the snapshot's now, reopened by the next call
        lost = if s.lost == true and not snapshot.fragile, do: :maybe, else: s.lost
        s = ring_in_doubt(s, ring, snapshot.paths, frames, bad)
        put_session(world, id, %{s | paths: paths, doubt: 0, lost: lost})

      {:error, %Error{reason: reason} = error} when bad != nil and reason in @refused ->
        # the frame refused is named, and the restore stands: the session is the snapshot's
        unless error.detail["frame"] == bad,
          do: violation!(world, "restore's frame #{bad} refused, named #{inspect(error.detail)}")

        s = ring_refused(world, s, ring, bad)
        restored!(world, id, s, ref, snapshot.paths)

      # a snapshot a failed rollback's frame copied into: refused, nothing restored or run, the
      # ring as it was
      {:error, %Error{reason: :state_lost}} when snapshot.undefined != false ->
        put_session(world, id, into(s, ref, %{snapshot | undefined: true}))

      {:error, error} ->
        session_error(world, id, error, [], "restore")

      {:ok, _results} when bad != nil ->
        violation!(world, "restore with a malformed frame (#{bad}) answered :ok")

      restored ->
        paths = resimulated(world, s, snapshot.paths, frames, restored, id)
        s = ring_refreshed(s, ring, snapshot, paths, frames)
        restored!(world, id, s, ref, paths)
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
      {:ok, _handle} when s.gen != world.gen ->
        violation!(world, "fork of a session whose model's name went to another answered :ok")

      {:ok, handle} ->
        if s.lost == true, do: violation!(world, "fork of a lost session answered :ok")
        answered_unless_stranded!(world, s, "fork")
        world = put_session(world, id, %{s | lost: false})
        add_session(world, handle, s.checkpoint, s.paths, s.gen)

      # no member holds its model under the name any more: refused, the session as it was
      {:error, %Error{reason: :no_members}} when s.gen != world.gen and not s.stranded ->
        world

      {:error, error} ->
        session_error(world, id, error, @unplaced, "fork")
    end
  end

  defp apply_op(:close, world) do
    {id, world} = pick_one(world, sorted_sessions(world))
    close(world, id)
  end

  defp apply_op(:kill, world) do
    {member, world} = pick_one(world, reachable(world))
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
    {member, world} = pick_one(world, reachable(world))
    TestSupport.freeze(world.members[member].os_pid)
    members = Map.update!(world.members, member, &%{&1 | frozen: true})
    note(%{world | members: members}, {:freeze, member})
  end

  defp apply_op(:thaw, world), do: thaw_all(world)

  defp apply_op(:start, world) do
    {side, world} = pick_one(world, start_sides(world))

    member =
      case side do
        :here -> hd(start_members(world.group, 1))
        :peer -> joined!(world.group, Peers.start_server!(world.peer, group: world.group))
      end

    note(
      %{world | members: Map.put(world.members, member, member(member))},
      {:start, {side, member}}
    )
  end

  # The peer cut off, now and then racing a step: the sessions its member keeps are rebuilt here
  # at once (nothing lost; the step in flight answered from there), or lost where they keep no
  # checkpoint, or may be where a frame is in doubt (docs/cluster.md, "Failover"); their
  # snapshots' copies there go with it. Its server closes what the keepers here opened, and
  # frees their copies, as it sees them go.
  defp apply_op(:cut, world) do
    {racing, world} = pick_one(world, [nil | sorted_sessions(world)])
    # (a session with no member now may be placed on the peer's by the step racing the cut)
    there =
      for id <- sorted_sessions(world),
          owner = owner_node(world, id),
          owner == world.peer.node or (id == racing and owner == nil),
          do: id

    world = %{world | sessions: Enum.reduce(there, world.sessions, &cut_off(&2, &1, racing))}
    world = note(world, {:cut, there})
    # apart as a network partition is: a connection either node tries meanwhile (a late reply
    # sent there, say) fails its handshake rather than joining them again
    true = :peer.call(world.peer.peer, :erlang, :set_cookie, [node(), :chaos_apart])
    cut = fn -> Peers.cut_off(world.peer) end
    world = if racing, do: step(world, racing, cut), else: tap(world, fn _ -> cut.() end)
    Peers.await_members(world.group, length(on(world, :here)))
    peers = length(on(world, :peer))
    assert :peer.call(world.peer.peer, Peers, :await_members, [world.group, peers], 30_000)

    # the step answered before the cut or after it: what the cut did, it has done by now
    sessions =
      if racing in there,
        do: Map.update!(world.sessions, racing, &%{&1 | lost: lost_when_cut(&1)}),
        else: world.sessions

    %{world | cut: true, sessions: sessions}
  end

  # Joined again: the group is whole on both sides; where the name was given to another model
  # on the peer's side meanwhile, its newer version wins on every member, and the walk waits
  # until every member (and this node's balancer) names that model.
  defp apply_op(:heal, world) do
    true = :peer.call(world.peer.peer, :erlang, :set_cookie, [node(), Node.get_cookie()])
    Peers.reconnect(world.peer)
    all = map_size(world.members)
    Peers.await_members(world.group, all)
    assert :peer.call(world.peer.peer, Peers, :await_members, [world.group, all], 30_000)
    world = %{world | cut: false}

    world =
      if world.retaken,
        do: %{await_retaken!(world) | gen: world.retaken, retaken: nil},
        else: world

    note(world, {:heal, world.gen})
  end

  # On the peer's side, cut off, the name "tiny" freed and given to a model of the same shapes
  # (its member holds no session: its server closed those of the keepers here).
  defp apply_op(:retake, world) do
    [there] = on(world, :peer)

    assert TestSupport.eventually(fn -> held(world, there) == {0, 0} end, 5_000),
           "the member cut off holds #{inspect(held(world, there))}" <> trail(world)

    assert :peer.call(world.peer.peer, Peers, :await_members, [world.group, 1], 30_000)
    gen = world.models |> Map.keys() |> Enum.max() |> Kernel.+(1)
    backbone = backbone(gen)
    assert :ok = :peer.call(world.peer.peer, Cluster, :free_model, [world.group, "tiny"], 60_000)

    assert {:ok, %{members: 1}} =
             :peer.call(
               world.peer.peer,
               Cluster,
               :load_model,
               [world.group, "tiny", backbone],
               60_000
             )

    {:ok, %{"model" => model}} = ScanBridge.load_model(world.reference, backbone)
    world = %{world | models: Map.put(world.models, gen, model), retaken: gen}
    note(world, {:retake, gen})
  end

  # Where a member may join: on this node, and on the peer's where it has none and is joined.
  defp start_sides(world) do
    here = if length(on(world, :here)) < @max_members, do: [:here], else: []
    peer = world.peer != nil and not world.cut and on(world, :peer) == []
    if peer, do: here ++ [:peer], else: here
  end

  # A session whose owner is cut off: lost as lost_when_cut/1 says, or, with a step racing the
  # cut (answered before it, or after it from where it was rebuilt), maybe not yet.
  defp cut_off(sessions, id, racing) do
    Map.update!(sessions, id, fn s ->
      lost = lost_when_cut(s)
      lost = if id == racing and lost == true and s.lost != true, do: :maybe, else: lost
      %{s | cut_off: s.cut_off + 1, lost: lost}
    end)
  end

  # A snapshot as the walk knows it: `paths`, the frame sequences its state may be the result
  # of; `fragile`, whether it may be its server's alone (`:unknown_snapshot` once the session may
  # have left that server); `undefined`, whether a failed rollback's frame copied into it there
  # (SPEC §6.4: restoring it answers `:state_lost`; `:maybe`: either), until a frame copies into
  # it whole; `copy_at`, where the session was when it was taken (at/2).
  defp pick_into(world, %{snapshots: snapshots}) when snapshots != %{} do
    {u, rand} = :rand.uniform_s(4, world.rand)
    world = %{world | rand: rand}
    if u == 1, do: pick_one(world, snapshots |> Map.keys() |> Enum.sort()), else: {nil, world}
  end

  defp pick_into(world, _s), do: {nil, world}

  # Snapshot `ref` of `s` given `fields` (a frame stepped into it, say: its copy where it was).
  defp into(s, nil, _fields), do: s

  defp into(s, ref, fields),
    do: %{s | snapshots: Map.update!(s.snapshots, ref, &Map.merge(&1, fields))}

  # A step into a snapshot that timed out may or may not have copied into it: its server's alone.
  defp into_in_doubt(s, nil), do: s

  defp into_in_doubt(s, ref) do
    old = s.snapshots[ref]
    undefined = if old.undefined == true, do: :maybe, else: old.undefined
    into(s, ref, %{paths: Enum.uniq(old.paths ++ s.paths), fragile: true, undefined: undefined})
  end

  # A session holding snapshots, and one of them.
  defp pick_snapshot(world) do
    {id, world} =
      pick_one(world, for({id, s} <- world.sessions, s.snapshots != %{}, do: id) |> Enum.sort())

    {ref, world} = pick_one(world, world.sessions[id].snapshots |> Map.keys() |> Enum.sort())
    {id, ref, world}
  end

  # A rollback's frames, each stepping into its snapshot of `ring` (nil: none).
  defp model_frames(frames, ring) do
    for {f, into} <- Enum.zip(frames, ring),
        do: {:model_step, {:embeds, f}, if(into, do: [snapshot_into: into], else: [])}
  end

  # The snapshots a rollback's frames step into, a frame's nil for none: now and then one of
  # the session's others than the one restored, each once, as a rollback ring is refreshed by
  # its re-simulation.
  defp pick_ring(world, s, restored, count) do
    others = s.snapshots |> Map.keys() |> Enum.sort() |> List.delete(restored)

    {ring, {world, _left}} =
      Enum.map_reduce(List.duplicate(nil, count), {world, others}, fn _, {world, left} ->
        {u, rand} = :rand.uniform_s(2, world.rand)

        {into, world} =
          if u == 1, do: pick_one(%{world | rand: rand}, left), else: {nil, %{world | rand: rand}}

        {into, {world, List.delete(left, into)}}
      end)

    {ring, world}
  end

  # `fun.(snapshot, i)` for each snapshot of the ring, frame i's.
  defp update_ring(s, ring, fun) do
    for {ref, i} <- Enum.with_index(ring), ref != nil, reduce: s do
      s -> %{s | snapshots: Map.update!(s.snapshots, ref, &fun.(&1, i))}
    end
  end

  # A rollback answered: each snapshot of the ring holds the state before its frame, `paths`
  # (the session's after the frames) less that frame and those after it.
  defp ring_refreshed(s, ring, restored, paths, frames) do
    origins = paths |> Enum.map(&Enum.drop(&1, -length(frames))) |> Enum.uniq()
    fragile = s.checkpoint == nil or restored.fragile

    update_ring(s, ring, fn old, i ->
      before = Enum.map(origins, &(&1 ++ Enum.take(frames, i)))
      %{old | paths: before, fragile: fragile, undefined: false}
    end)
  end

  # A rollback whose frame `bad` was refused, the frames before it run: the server leaves
  # undefined each snapshot they copied into (SPEC §6.4), and the keeper keeps none of those,
  # nor the refused frame's, by its checkpoint and frames; the snapshots of the frames after it,
  # which never ran, are as they were. A snapshot whose copy may be on a member the session
  # left may have been sent no copy, and hold what it held.
  defp ring_refused(world, s, ring, bad) do
    update_ring(s, ring, fn old, i ->
      cond do
        i > bad ->
          old

        i == bad ->
          %{old | fragile: true}

        true ->
          undefined =
            if old.copy_at == at(world, s) or old.undefined == true, do: true, else: :maybe

          %{old | fragile: true, undefined: undefined}
      end
    end)
  end

  # A rollback that timed out: done or not on its server (each snapshot of the ring holding
  # what it held, or the state before its frame, from the restored snapshot's `paths`), or,
  # with a frame refused (`bad`), undefined where a frame before it copied; its server's alone.
  defp ring_in_doubt(s, ring, paths, frames, bad) do
    update_ring(s, ring, fn old, i ->
      cond do
        bad != nil and i < bad ->
          %{old | fragile: true, undefined: if(old.undefined == true, do: true, else: :maybe)}

        bad != nil ->
          %{old | fragile: true}

        true ->
          copied = Enum.map(paths, &(&1 ++ Enum.take(frames, i)))
          undefined = if old.undefined == true, do: :maybe, else: old.undefined
          %{old | paths: Enum.uniq(old.paths ++ copied), fragile: true, undefined: undefined}
      end
    end)
  end

  # `frames` with the one at `at` replaced by one of the wrong width.
  defp malformed_at(world, frames, at) do
    {bad, world} = frame(world, 7)
    {List.replace_at(frames, at, bad), world}
  end

  # A restore of snapshot `ref` answered: the session is the snapshot's, `paths` after the
  # frames it ran, and the snapshot's copy holds a state.
  defp restored!(world, id, s, ref, paths) do
    snapshot = s.snapshots[ref]

    if snapshot.undefined == true,
      do: violation!(world, "restore of a snapshot a failed rollback's frame copied into answered")

    # a lost session is reopened from a snapshot its checkpoints keep, and is no more lost
    if s.lost == true and snapshot.fragile,
      do: violation!(world, "restore of a lost session from its server's snapshot answered")

    answered_unless_stranded!(world, s, "restore")
    doubt = if snapshot.fragile, do: 0
    s = into(s, ref, %{snapshot | undefined: false})
    put_session(world, id, %{s | paths: paths, doubt: doubt, lost: false})
  end

  # The paths a restore leaves: the snapshot's, and the frames it re-simulated after, each
  # answered as the paths that match say.
  defp resimulated(_world, _s, paths, [], :ok, _id), do: paths

  defp resimulated(world, s, paths, frames, {:ok, results}, id) do
    Enum.zip(frames, results)
    |> Enum.reduce(paths, fn {frame, y}, paths ->
      case Enum.filter(paths, &matches?(world, s, &1 ++ [frame], y)) do
        [] -> violation!(world, "session #{id}: a re-simulated frame matches no possible path")
        before -> Enum.map(before, &(&1 ++ [frame]))
      end
    end)
  end

  # A step of session `id`, with `during` run meanwhile (a fault racing it: timing decides
  # whether it reaches the call, and the outcome must be one of both).
  defp step(world, id, during \\ nil) do
    {step, world} = prepare_step(world, id)
    fault = Task.async(during || fn -> :ok end)
    outcome = send_step(step)
    Task.await(fault, 10_000)
    judge_step(world, %{step | raced: during != nil}, outcome)
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
       timeout: timeout(world),
       raced: false
     }, world}
  end

  defp send_step(%{handle: handle, frame: frame, into: into, timeout: timeout}) do
    opts = if into, do: [snapshot_into: into], else: []
    Cluster.model_step(handle, {:embeds, frame}, opts ++ timeout)
  end

  defp judge_step(world, %{id: id, frame: frame, malformed: malformed, into: into} = step, outcome) do
    s = world.sessions[id]
    world = note(world, {:step, id, brief(outcome)})

    case outcome do
      # its owner went (killed, cut off) with it in flight, and no member took the session in
      # time, or none holds its model: answered what befell the owner, the frame not done; the
      # next call places the session
      {:error, %Error{reason: reason} = error} when step.raced and reason in @owner_gone ->
        unless rebuild_may_fail?(world, s, step),
          do: violation!(world, "step raced by a fault: #{inspect(reason)}: #{error.message}")

        world

      {:ok, _y} when malformed ->
        violation!(world, "a malformed frame answered")

      {:error, %Error{reason: reason}} when malformed and reason in @refused ->
        world

      {:error, %Error{reason: :timeout} = error} when malformed ->
        world = allow!(world, error, [:timeout], "step")
        put_session(world, id, %{into_in_doubt(s, into) | doubt: 0})

      {:ok, y} ->
        if s.lost == true, do: violation!(world, "step of a lost session answered")
        answered_unless_stranded!(world, s, "step")
        before = Enum.filter(s.paths, &matches?(world, s, &1 ++ [frame], y))

        if before == [],
          do:
            violation!(
              world,
              "session #{id}: step answered #{inspect(y)}, matching none of " <>
                "#{length(s.paths)} possible paths"
            )

        fragile = s.checkpoint == nil or s.doubt != nil
        s = into(s, into, %{paths: before, fragile: fragile, undefined: false})
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

  # A session as the walk knows it: `gen`, the generation of the model it runs; `paths`, the
  # frame sequences its state may be the result of (more than one after a call that timed out:
  # done or not); `doubt`, nil or the frames answered since a call that timed out (or a restore
  # of a snapshot its checkpoints do not keep): until a checkpoint, its failover may be refused
  # and its snapshots are its server's; `lost`, whether it answers `:session_lost` (`:maybe`
  # after a restore that may have reopened it, or a cut with a frame in doubt: either);
  # `cut_off`, how many cuts took its owner; `stranded`, whether it answered `:no_members`, its
  # model's name given to another while apart (from then on no member takes it).
  defp add_session(world, handle, checkpoint, paths, gen) do
    id = world.next_session

    s = %{
      handle: handle,
      gen: gen,
      checkpoint: checkpoint,
      paths: paths,
      doubt: nil,
      lost: false,
      kills_at_open: world.kills,
      moves: 0,
      cut_off: 0,
      stranded: false,
      snapshots: %{}
    }

    %{world | sessions: Map.put(world.sessions, id, s), next_session: id + 1}
  end

  # A frame answered: `checkpoint` of them since the last doubt took a checkpoint, which ends it.
  defp answered(%{doubt: nil} = s), do: s
  defp answered(%{doubt: n, checkpoint: every} = s) when n + 1 >= every, do: %{s | doubt: nil}
  defp answered(%{doubt: n} = s), do: %{s | doubt: n + 1}

  defp put_session(world, id, s), do: %{world | sessions: Map.put(world.sessions, id, s)}

  # Whether the session's owner may have gone away since it opened: a member killed (any: the
  # walk does not follow which member each session is on), or a cut that took its owner.
  defp owner_moved?(world, s), do: world.kills > s.kills_at_open or s.cut_off > 0

  # Where the session is, as far as the walk tells places apart: it may have left its member
  # only by a kill, a cut that took its owner, or a restore of a snapshot taken before one of
  # them (reopened elsewhere from its checkpoint, `moves`). A snapshot's copy is on the member
  # it was taken on, so on the session's while this is what it was then.
  defp at(world, s), do: {world.kills, s.cut_off, s.moves}

  # What a session whose owner was cut off is: rebuilt here (not lost) from its checkpoint and
  # kept frames, unless it keeps none (lost) or a frame answered after one that timed out may
  # be among them (the walk's doubt, which outlasts the keeper's: either).
  defp lost_when_cut(%{lost: true}), do: true
  defp lost_when_cut(%{checkpoint: nil}), do: true
  defp lost_when_cut(%{doubt: nil, lost: lost}), do: lost
  defp lost_when_cut(_s), do: :maybe

  # The node of the member a session is on now (nil: none), once its keeper answers (a rebuild
  # on a frozen member holds it up to its rebuild's deadline).
  defp owner_node(world, id) do
    answered =
      Enum.find_value(1..4, fn _ ->
        case Cluster.session_info(world.sessions[id].handle) do
          {:ok, info} -> info
          {:error, _} -> nil
        end
      end)

    unless answered, do: violation!(world, "session #{id}'s keeper does not answer session_info")
    answered.node
  end

  # Whether a rebuild of the session, placing the call in flight, may find no member: one was
  # frozen when the call was sent (its deadline is short, and a placement there takes it all),
  # none answers now, or its model's name went to another model.
  defp rebuild_may_fail?(world, s, step) do
    step.timeout == [timeout: @frozen_call_timeout] or s.gen != world.gen or
      Enum.all?(reachable(world), &world.members[&1].frozen)
  end

  # A session that answered `:no_members` for want of its model is taken by no member again.
  defp answered_unless_stranded!(world, s, what) do
    if s.stranded,
      do: violation!(world, "#{what} of a session of a model given up answered after :no_members")
  end

  # An error from a session's call: `:session_lost` where its server went away and nothing
  # could rebuild it (no checkpoints, or a frame in doubt); `:no_members` where it left its
  # member and its model's name went to another model meanwhile, so that no member holds it;
  # else one of `allowed` now.
  defp session_error(world, id, %Error{reason: :session_lost} = error, _allowed, what) do
    s = world.sessions[id]

    unless s.lost != false or
             (owner_moved?(world, s) and (s.checkpoint == nil or s.doubt != nil)),
           do: violation!(world, "#{what} of session #{id}: #{error.message}")

    put_session(world, id, %{s | lost: true})
  end

  defp session_error(world, id, %Error{reason: :no_members} = error, allowed, what) do
    s = world.sessions[id]

    if s.gen != world.gen and owner_moved?(world, s),
      do: put_session(world, id, %{s | stranded: true}),
      else: allow!(world, error, allowed, what)
  end

  defp session_error(world, _id, error, allowed, what), do: allow!(world, error, allowed, what)

  # `:timeout`, `:deadline_exceeded` (a keeper still busy with a call that timed out) and
  # `:overloaded` (a client still busy with one: not sent) only while a member this node
  # reaches is frozen (one frozen and cut off takes no call); `:no_members` only while no member
  # answers.
  defp allow!(world, %Error{reason: reason} = error, allowed, what) do
    frozen = Enum.count(reachable(world), &world.members[&1].frozen)
    answering = length(reachable(world)) - frozen

    ok =
      reason in allowed and
        case reason do
          r when r in [:timeout, :deadline_exceeded, :overloaded] -> frozen > 0
          :no_members -> answering == 0
          _ -> true
        end

    unless ok, do: violation!(world, "#{what}: #{inspect(reason)}: #{error.message}")
    world
  end

  # Whether `y` is what a plain session of `s`'s model fed `path` answers to its last frame.
  defp matches?(world, s, path, %Tensor{} = y) do
    frames = for f <- path, do: {:model_step, {:embeds, f}, []}
    model = world.models[s.gen]

    {:ok, session, results} =
      ScanBridge.open_session_with_frames(world.reference, %{model: model, batch: 1}, frames)

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

  defp backbone(gen), do: Models.backbone(Models.config(:mamba2), @backbone_seed + gen)

  ## The end

  defp finish(world) do
    IO.puts("cluster chaos: #{inspect(tally(world.log))}")
    world = thaw_all(world)
    world = if world.cut, do: apply_op(:heal, world), else: world
    world = Enum.reduce(sorted_sessions(world), world, &close(&2, &1))
    g = world.group

    for {member, _} <- world.members do
      assert TestSupport.eventually(fn -> held(world, member) == {0, 0} end, 5_000),
             "member #{inspect(member)} holds {sessions, snapshot bytes} " <>
               "#{inspect(held(world, member))}" <> trail(world)
    end

    assert held(world, world.reference) == {0, 0}

    assert TestSupport.eventually(fn ->
             Enum.all?(Cluster.loads(g), fn {_, load} -> load == %{calls: 0, sessions: 0} end)
           end),
           "balancer loads #{inspect(Cluster.loads(g))}" <> trail(world)

    assert keepers(g) == [], "keepers left: #{inspect(keepers(g))}" <> trail(world)
  end

  # What `member` holds: {sessions, snapshot bytes}; a member cut off, asked on its side.
  defp held(world, member) do
    {:ok, stats} = on_side(world, member, ScanBridge, :stats, [member, [timeout: 5_000]])
    {stats["sessions"]["sessions"], stats["sessions"]["snapshot_bytes"]}
  end

  # `apply(module, fun, args)` about `member`: on the peer where the member is cut off there.
  defp on_side(world, member, module, fun, args) do
    if world.cut and world.members[member][:side] == :peer,
      do: :peer.call(world.peer.peer, module, fun, args, 10_000),
      else: apply(module, fun, args)
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
    {:ok, stats} = ScanBridge.stats(reference, timeout: 5_000)
    :ok = ScanBridge.free_snapshot(reference, snapshot)
    :ok = ScanBridge.close_session(reference, session)
    stats["sessions"]["snapshot_bytes"]
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
    Enum.map(members, &joined!(group, &1))
  end

  defp joined!(group, member) do
    assert TestSupport.eventually(fn -> member in Cluster.members(group) end, 20_000),
           "#{inspect(member)} never joined #{inspect(group)}"

    member
  end

  defp member(pid) do
    {:ok, os_pid} = ScanBridge.os_pid(pid)
    side = if node(pid) == node(), do: :here, else: :peer
    %{os_pid: os_pid, frozen: false, side: side}
  end

  # The members on one side, in a fixed order.
  defp on(world, side),
    do: for({m, %{side: ^side}} <- world.members, do: m) |> Enum.sort()

  # The members this node reaches: all but the peer's while it is cut off.
  defp reachable(world),
    do: if(world.cut, do: on(world, :here), else: world.members |> Map.keys() |> Enum.sort())

  # Once the peer's side, cut off, gave the name to another model and both sides joined again,
  # every member holds that model under the name, and this node's balancer names no other.
  defp await_retaken!(world) do
    [there] = on(world, :peer)
    {:ok, {_id, fingerprint}} = ScanBridge.Server.model_entry(there, "tiny", 5_000)

    renamed = fn member ->
      match?({:ok, {_, ^fingerprint}}, ScanBridge.Server.model_entry(member, "tiny", 5_000)) and
        learnt_as?(member, fingerprint)
    end

    unless TestSupport.eventually(fn -> Enum.all?(Map.keys(world.members), renamed) end, 30_000),
      do:
        violation!(
          world,
          "the name's newer model not taken: #{inspect(Cluster.catalogue(world.group))}"
        )

    world
  end

  # Whether this node's balancer knows `member`'s model under the name as that model, or not at all.
  defp learnt_as?(member, fingerprint) do
    case Balancer.model_entry(member, "tiny") do
      nil -> true
      {_id, learnt} -> learnt == fingerprint
    end
  end

  ## Reporting

  defp timeout(world),
    do: [timeout: if(any_frozen?(world), do: @frozen_call_timeout, else: @call_timeout)]

  defp any_frozen?(world), do: Enum.any?(world.members, fn {_m, m} -> m.frozen end)

  defp brief({:ok, %Tensor{}}), do: :ok
  defp brief({:ok, _}), do: :ok
  defp brief(:ok), do: :ok
  defp brief({:error, %Error{reason: reason}}), do: reason

  defp violation!(world, what), do: flunk(what <> group_now(world) <> trail(world))

  # The group as this node sees it, for a violation's report: its members, what each holds
  # under each name, and each session's place.
  defp group_now(world) do
    {:ok, catalogue} = Cluster.catalogue(world.group, timeout: 2_000)

    models =
      for member <- catalogue,
          {name, m} <- member.models,
          do: {member.server, name, m.model, m.version}

    sessions =
      for {id, s} <- world.sessions,
          do: {id, s.gen, s.checkpoint, Cluster.session_info(s.handle)}

    "\nmembers #{inspect(Cluster.members(world.group))}\nmodels #{inspect(models)}" <>
      "\nsessions #{inspect(sessions)}\nworld #{inspect(Map.take(world, [:gen, :retaken, :cut]))}"
  end

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
