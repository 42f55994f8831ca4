# Scaling out over a BEAM cluster (`ScanBridge.Cluster`): three `:peer` nodes on 127.0.0.1,
# each with one server of one group, called from this node, which runs none and keeps the
# sessions. The goals of the issue "scale out over a BEAM cluster": a session's failover takes
# at most 50 ms (p99) with at most 2 frames replayed, and checkpointing every 10 frames costs at
# most 5 % of the frame time.
#
#   1. Stateless throughput: `Cluster.scan/3` of fixed inputs by `--callers` concurrent callers
#      for `--seconds`, with the group at 1, then 2, then 3 members (the servers are started
#      one by one, each on its own peer); calls/s and the ratio to 1 member.
#   2. Failover: `--sessions` sessions of the tiny Mamba-2 model (batch 1, `checkpoint: 2`),
#      each stepped by its own process at 60 FPS (paced on absolute times, the sessions spread
#      evenly over the frame), `--warmup` frames, then one member's server killed (SIGKILL) and
#      `--after` frames more. For each session that was on it: the time from the kill to its
#      first frame answered by the new owner, the frames run again, and where the time went
#      (traced in the session's keeper); its outputs are then checked against an uninterrupted
#      run of the same inputs (a mismatch fails the bench). `--kills` rounds, a replacement
#      server started on the victim's peer after each. Then one round with the victim's whole
#      node stopped (`:peer.stop/1`) instead, reported apart.
#   3. Checkpoint cost: the sessions at 60 FPS for `--frames` frames with `checkpoint: nil`,
#      `10` and `2`, one after the other, then again in reverse order; the caller's frame
#      latency per setting. And, unpaced: a session's export round trip (`session_state`), its
#      opening from a saved state, and the keeper's hop (`Cluster.model_step/3` against
#      `ScanBridge.model_step/4` on the same member and session).
#
#   MIX_ENV=test mix run bench/cluster.exs [--quick] [--sessions 32] [--warmup 60] [--after 60]
#       [--kills 3] [--frames 300] [--hop-frames 300] [--seconds 3] [--callers 8] [--no-exit-guard]
#       [--neighbours 0] [--out PATH]
#
# MIX_ENV=test: the peers and models come from the test support (test/support). Run the BEAM
# as docs/operations.md ("BEAM scheduler setting") says, ELIXIR_ERL_OPTIONS="+sbwt none
# +sbwtdcpu none +sbwtdio none"; the peers are started with those flags whatever this node has.
# `--neighbours N`: N shell processes that each keep a core busy throughout, as another tenant of
# the box would. `--quick`: a smoke run of tiny sizes (well under a minute). Writes JSON (machine and commit
# info) to the git-ignored ../bench/out/cluster.json by default; to record a reference,
# `--out ../bench/results/cluster.json`. Every peer node and server it starts is stopped, and
# checked gone by OS pid, before it exits, whether it fails or not.

Code.require_file("support.exs", __DIR__)

unless Code.ensure_loaded?(ScanBridge.TestSupport.Peers),
  do: raise("bench/cluster.exs needs the test support compiled in: run it with MIX_ENV=test")

# Loaded onto each peer (the script's own modules exist only on this node): a client started
# by an :erpc call is linked to erpc's process there, and must be unlinked before that exits.
{:module, _, remote_binary, _} =
  defmodule ClusterBench.Remote do
    def start_server(opts) do
      case ScanBridge.start_link(opts) do
        {:ok, pid} ->
          Process.unlink(pid)
          {:ok, pid}

        other ->
          other
      end
    end

    # Tells `reply_to` when the client's Port reports its server's exit ({:exit_status, _}
    # received) and when the client process itself exits, both traced on this node, as OS time
    # (µs): comparable across the nodes of one host.
    def watch_exit(client, reply_to) do
      me = self()

      spawn(fn ->
        :erlang.trace_pattern(:receive, [{[:_, :_, {:_, {:exit_status, :_}}], [], []}], [])
        :erlang.trace(client, true, [:receive, :procs, :monotonic_timestamp, {:tracer, self()}])
        send(me, :watching)
        report_exit(client, reply_to, nil)
      end)

      receive(do: (:watching -> :ok))
    end

    # Until the client exits: the exit status it received, if any (a client whose write into
    # the dead server failed first gets none), then its exit.
    defp report_exit(client, reply_to, exit_status_at) do
      receive do
        {:trace_ts, ^client, :receive, {_port, {:exit_status, _}}, ts} ->
          report_exit(client, reply_to, os_time(ts))

        {:trace_ts, ^client, :exit, _reason, ts} ->
          send(reply_to, {:client_exited, client, exit_status_at, os_time(ts)})

        {:trace_ts, ^client, _event, _info, _ts} ->
          report_exit(client, reply_to, exit_status_at)
      after
        60_000 -> :ok
      end
    end

    defp os_time(monotonic) do
      lag = System.convert_time_unit(System.monotonic_time() - monotonic, :native, :microsecond)
      System.os_time(:microsecond) - lag
    end
  end

:persistent_term.put({ClusterBench, :remote_binary}, remote_binary)

defmodule ClusterBench do
  alias ScanBridge.{Cluster, Tensor, TestSupport}
  alias ScanBridge.Cluster.{Balancer, Session}
  alias ScanBridge.TestSupport.{JSON, Models, Peers}

  @root Path.expand("../..", __DIR__)
  @frame_us 1.0e6 / 60
  # a frame's deadline: long enough for a failover while three servers share 2 cores
  @frame_timeout 10_000
  # the other sessions' latencies: "before" the kill is this long before it, "during" this long
  # from it
  @window_before_us 1_000_000
  @window_during_us 200_000
  @rtol 1.0e-5
  @peer_erl_flags ~w(+sbwt none +sbwtdcpu none +sbwtdio none)
  @pids :cluster_bench_os_pids
  @model "tiny"
  @model_seed 5

  @defaults %{
    sessions: 32,
    warmup: 60,
    after: 60,
    kills: 3,
    frames: 300,
    hop_frames: 300,
    seconds: 3.0,
    callers: 8,
    light_sessions: 8,
    scan_size: %{batch: 1, seq: 128, dim: 256, state: 256}
  }
  @quick %{
    sessions: 6,
    warmup: 20,
    after: 20,
    kills: 1,
    frames: 30,
    hop_frames: 30,
    seconds: 0.5,
    callers: 4,
    light_sessions: 3,
    scan_size: %{batch: 1, seq: 32, dim: 16, state: 4}
  }

  def main(argv) do
    {opts, rest, invalid} =
      OptionParser.parse(argv,
        strict: [
          quick: :boolean,
          sessions: :integer,
          warmup: :integer,
          after: :integer,
          kills: :integer,
          frames: :integer,
          hop_frames: :integer,
          seconds: :float,
          callers: :integer,
          light_sessions: :integer,
          seed: :integer,
          exit_guard: :boolean,
          neighbours: :integer,
          out: :string
        ]
      )

    if rest != [] or invalid != [],
      do: raise(ArgumentError, "unexpected arguments: #{inspect(rest ++ invalid)}")

    quick = Keyword.get(opts, :quick, false)

    cfg =
      if(quick, do: @quick, else: @defaults)
      |> Map.merge(Map.new(Keyword.take(opts, Map.keys(@defaults))))
      |> Map.put(:quick, quick)
      |> Map.put(:seed, Keyword.get(opts, :seed, 1))
      |> Map.put(:exit_guard, Keyword.get(opts, :exit_guard, true))
      |> Map.put(:neighbours, Keyword.get(opts, :neighbours, 0))

    if cfg.neighbours < 0,
      do: raise(ArgumentError, "--neighbours: expected 0 or more, got #{cfg.neighbours}")

    for key <- [:sessions, :warmup, :after, :kills, :frames, :hop_frames, :callers, :light_sessions],
        cfg[key] < 1,
        do: raise(ArgumentError, "--#{key}: expected a positive integer, got #{cfg[key]}")

    out = Keyword.get(opts, :out, Path.join(@root, "bench/out/cluster.json"))
    python = TestSupport.python()
    env = [{"PYTHONPATH", System.get_env("PYTHONPATH") || @root}, {"SCAN_BRIDGE_LOG", "WARNING"}]
    erl_options = System.get_env("ELIXIR_ERL_OPTIONS") || ""

    unless String.contains?(erl_options, "+sbwt none"),
      do:
        IO.puts(
          "note: this node's schedulers busy-wait (ELIXIR_ERL_OPTIONS has no \"+sbwt none\"): " <>
            "they take cores from the servers; see docs/operations.md, BEAM scheduler setting"
        )

    # --no-exit-guard: servers without bridge.exit_guard, to time failover against the guard's
    :persistent_term.put(
      {__MODULE__, :server_args},
      if(cfg.exit_guard, do: [], else: ["--no-exit-guard"])
    )

    :rand.seed(:exsss, {cfg.seed, 17, 29})
    t_run = System.monotonic_time(:millisecond)
    load_before = load_avg()
    neighbours = start_neighbours(cfg.neighbours)

    results =
      try do
        with_cleanup(fn -> run(cfg) end)
      after
        Enum.each(neighbours, &System.cmd("kill", ["-9", Integer.to_string(&1)]))
      end

    run_s = (System.monotonic_time(:millisecond) - t_run) / 1000

    doc = %{
      "benchmark" => "elixir-cluster",
      "machine" => BenchSupport.machine(python, env),
      "commit" => BenchSupport.commit(),
      "settings" => settings(cfg),
      "note" =>
        "this machine has #{System.schedulers_online()} schedulers online and " <>
          "#{cpu_count()} CPUs: the three servers (and four BEAMs) share them, so adding " <>
          "members adds no cores and the throughput scaling is CPU-bound; the failover and " <>
          "checkpoint numbers are of servers competing for the same 2 cores",
      "method" => method(),
      "load_before" => load_before,
      "load_after" => load_avg(),
      "run_seconds" => run_s,
      "results" => results,
      "goals" => goals(results)
    }

    File.mkdir_p!(Path.dirname(out))
    File.write!(out, JSON.encode!(doc) <> "\n")
    report(doc)
    IO.puts("wrote #{out} (#{Float.round(run_s, 1)} s)")
  end

  # Processes that spin on a core each (OS pids), for --neighbours.
  defp start_neighbours(n) do
    Enum.map(List.duplicate(:busy, n), fn :busy ->
      port = Port.open({:spawn_executable, "/bin/sh"}, args: ["-c", "while :; do :; done"])
      {:os_pid, os_pid} = Port.info(port, :os_pid)
      os_pid
    end)
  end

  ## The run

  defp run(cfg) do
    group = {:cluster_bench, System.unique_integer([:positive])}
    Peers.ensure_distributed!()
    peers = start_peers(3)
    inputs = TestSupport.scan_inputs(cfg.scan_size)

    # 1. throughput, the group grown one member at a time
    {members, throughput} =
      Enum.map_reduce(peers, {[], []}, fn peer, {members, rows} ->
        member = start_server!(peer, group)
        members = members ++ [member]
        await_members!(group, length(members))
        row = throughput(group, members, inputs, cfg)

        row =
          if length(members) == 1,
            do: Map.put(row, "single_call", single_call(group, inputs)),
            else: row

        IO.puts(
          "  throughput with #{length(members)} member(s): #{round(row["calls_per_s"])} calls/s"
        )

        {member, {members, rows ++ [row]}}
      end)
      |> elem(1)

    throughput = throughput_result(throughput, inputs, cfg)

    backbone = Models.backbone(Models.config(:mamba2), @model_seed)
    {:ok, %{members: 3}} = Cluster.load_model(group, @model, backbone)
    shell = start_shell()
    :persistent_term.put({__MODULE__, :shell}, shell)
    floor = exit_floor(shell, if(cfg.quick, do: 2, else: 5))
    tracing = start_tracing()

    try do
      # 2. failover: a server killed, once with `light_sessions` sessions (the machine not
      # saturated), then `kills` times with `sessions`
      rounds = [cfg.light_sessions | List.duplicate(cfg.sessions, cfg.kills)]

      {kill_rounds, members} =
        Enum.map_reduce(Enum.with_index(rounds, 1), members, fn {sessions, round}, members ->
          victim = pick_victim(group, members, round)
          peer = Enum.find(peers, &(&1.node == node(victim)))

          IO.puts(
            "failover round #{round}, #{sessions} sessions: kill -9 the server on #{peer.node}"
          )

          result =
            failover_round(group, %{cfg | sessions: sessions}, victim, tracing, fn ->
              kill_server(shell, victim)
            end)

          replacement = start_server!(peer, group)
          members = Enum.map(members, &if(&1 == victim, do: replacement, else: &1))
          await_members!(group, 3)
          {result, members}
        end)

      # 3. checkpoint cost, with all three members
      checkpoint = checkpoint_cost(group, cfg)
      light = checkpoint_cost(group, %{cfg | sessions: cfg.light_sessions}, false)

      # 3b. rollback on a cluster session: snapshot, restore, fork
      rollback = rollback_costs(group, cfg)

      # 2b. failover: a whole node stopped (last: the group keeps two members after it)
      victim = pick_victim(group, members, cfg.kills + 2)
      peer = Enum.find(peers, &(&1.node == node(victim)))
      IO.puts("failover, node stopped: :peer.stop(#{peer.node})")
      node_round = failover_round(group, cfg, victim, tracing, fn -> stop_node(peer, victim) end)
      left = Peers.await_gone(servers_of(peer), 10_000)

      if left != [],
        do: raise("the servers #{inspect(left)} of the stopped node #{peer.node} did not exit")

      %{
        "throughput" => throughput,
        "failover_kill" => failover_summary(tl(kill_rounds)),
        "failover_kill_light" => failover_summary([hd(kill_rounds)]),
        "failover_node_stop" => failover_summary([node_round]),
        "checkpoint_cost" => checkpoint,
        "checkpoint_cost_light" => light,
        "rollback" => rollback,
        "exit_floor" => floor,
        "trace_patterns_matched" =>
          Map.new(tracing.matched, fn {{m, f, a}, n} -> {"#{inspect(m)}.#{f}/#{a}", n} end)
      }
    after
      stop_tracing(tracing)
    end
  end

  ## 1. Stateless throughput

  defp throughput(group, members, inputs, cfg) do
    warm_s = if cfg.quick, do: 0.2, else: 1.0
    _ = call_for(group, inputs, cfg.callers, warm_s)
    before = Enum.map(members, &served(&1, "scan"))
    {calls, elapsed_s} = call_for(group, inputs, cfg.callers, cfg.seconds)
    per_member = Enum.zip_with(Enum.map(members, &served(&1, "scan")), before, &(&1 - &2))

    %{
      "members" => length(members),
      "calls" => calls,
      "seconds" => elapsed_s,
      "calls_per_s" => calls / elapsed_s,
      "calls_per_member" => per_member
    }
  end

  # `callers` processes calling `Cluster.scan/3` back to back until `seconds` have passed;
  # the calls done, and the time from the start to the last one's answer.
  defp call_for(group, inputs, callers, seconds) do
    t0 = now_us()
    t_end = t0 + round(seconds * 1.0e6)

    loop = fn loop, n, last ->
      if now_us() >= t_end do
        {n, last}
      else
        {:ok, _} = Cluster.scan(group, inputs, timeout: 30_000)
        loop.(loop, n + 1, now_us())
      end
    end

    counts =
      1..callers
      |> Task.async_stream(fn _ -> loop.(loop, 0, t0) end, timeout: :infinity)
      |> Enum.map(fn {:ok, counted} -> counted end)

    calls = counts |> Enum.map(&elem(&1, 0)) |> Enum.sum()
    last = counts |> Enum.map(&elem(&1, 1)) |> Enum.max()
    {calls, (last - t0) / 1.0e6}
  end

  defp throughput_result(rows, inputs, cfg) do
    base = hd(rows)["calls_per_s"]
    rows = Enum.map(rows, &Map.put(&1, "ratio_vs_1", &1["calls_per_s"] / base))

    %{
      "inputs" =>
        cfg.scan_size
        |> Map.new(fn {k, v} -> {Atom.to_string(k), v} end)
        |> Map.put("dtype", "f32")
        |> Map.put(
          "request_bytes",
          inputs |> Map.values() |> Enum.map(&byte_size(&1.data)) |> Enum.sum()
        ),
      "callers" => cfg.callers,
      "seconds" => cfg.seconds,
      "single_call" => hd(rows)["single_call"],
      "by_members" => Enum.map(rows, &Map.delete(&1, "single_call"))
    }
  end

  # One caller, one call at a time: the round trip and the server's kernel time of the inputs.
  defp single_call(group, inputs) do
    for _ <- 1..3, do: {:ok, _} = Cluster.scan(group, inputs, timeout: 30_000)

    {round_trips, kernels} =
      Enum.unzip(
        for _ <- 1..20 do
          {{:ok, %{timing: timing}}, us} =
            BenchSupport.timed(fn -> Cluster.scan(group, inputs, timeout: 30_000) end)

          {us, timing["kernel_us"] || 0}
        end
      )

    %{
      "p50_us" => BenchSupport.median(round_trips),
      "kernel_p50_us" => BenchSupport.median(kernels),
      "n" => length(round_trips)
    }
  end

  defp served(member, op) do
    {:ok, stats} = ScanBridge.stats(member)
    get_in(stats, ["ops", op, "success_count"]) || 0
  end

  ## 2. Failover

  # Open the sessions, step them at 60 FPS, `crash` the victim after the warm-up, step on; the
  # victim's sessions timed and traced, their outputs checked.
  defp failover_round(group, cfg, victim, tracing, crash) do
    n = cfg.sessions
    total = cfg.warmup + cfg.after

    sessions =
      for _ <- 1..n, do: ok!(Cluster.open_session(group, [model: @model, batch: 1], checkpoint: 2))

    try do
      infos = Enum.map(sessions, &ok!(Cluster.session_info(&1)))
      on_victim = for {s, info} <- Enum.zip(sessions, infos), info.member == victim, do: s

      if on_victim == [],
        do:
          raise(
            "no session on the victim #{inspect(victim)}: #{inspect(Enum.map(infos, & &1.member))}"
          )

      inputs = Map.new(sessions, &{&1, frames_of(Models.embeds(1, total, 8), total)})
      kill_at = :atomics.new(1, signed: true)
      start = now_us() + 50_000
      me = self()

      drivers =
        for {s, i} <- Enum.with_index(sessions) do
          victim? = s in on_victim

          Task.async(fn ->
            drive(s, inputs[s], start, i / n, if(victim?, do: kill_at), me)
          end)
        end

      # the kill: at the warm-up's end, at a point of the frame that moves with each round
      wait_until(start + round((cfg.warmup + :rand.uniform()) * @frame_us))
      kept = Map.new(on_victim, &{&1, ok!(Cluster.session_info(&1)).frames_since_checkpoint})
      keepers = Enum.map(on_victim, & &1.pid)
      trace_on(tracing, keepers)
      # modules loaded on the spot (interactive mode) would hold the keepers' failover up
      loaded = MapSet.new(:code.all_loaded(), &elem(&1, 0))
      {t_kill, crash_info} = crash.()
      :atomics.put(kill_at, 1, t_kill)

      records =
        drivers
        |> Task.await_many(total * (@frame_timeout + 1_000))
        |> then(&Enum.zip(sessions, &1))
        |> Map.new()

      trace_off(keepers)
      loaded_here = MapSet.new(:code.all_loaded(), &elem(&1, 0)) |> MapSet.difference(loaded)
      events = trace_events(tracing)
      failovers = Map.new(sessions, &{&1, ok!(Cluster.session_info(&1)).failovers})

      for s <- sessions, failovers[s] != if(s in on_victim, do: 1, else: 0) do
        raise "session #{inspect(s.pid)} (on the victim: #{s in on_victim}) failed over " <>
                "#{failovers[s]} times"
      end

      errors = for {_s, rs} <- records, {_, _, _, {:error, e}, _} <- rs, do: e

      if errors != [],
        do: raise("#{length(errors)} frames failed, the first: #{inspect(hd(errors), limit: 8)}")

      max_error = check_outputs(group, on_victim, inputs, records)

      samples =
        for s <- on_victim do
          sample(records[s], t_kill, kept[s], Map.get(events, s.pid, []))
        end

      others = for s <- sessions, s not in on_victim, r <- records[s], do: r

      window = fn from, to ->
        latencies(for {_, t0, t1, _, _} <- others, t0 >= from and t0 < to, do: t1 - t0)
      end

      %{
        "victim_node" => "#{node(victim)}",
        "sessions" => n,
        "sessions_on_victim" => length(on_victim),
        "crash" => crash_info,
        "code_loaded_here" => loaded_here |> Enum.map(&inspect/1) |> Enum.sort(),
        "samples" => samples,
        "others_latency_before" => window.(t_kill - @window_before_us, t_kill),
        "others_latency_during" => window.(t_kill, t_kill + @window_during_us),
        "victims_max_rel_error" => max_error,
        "correct" => true
      }
    after
      Enum.each(sessions, &Cluster.close_session/1)
    end
  end

  # One session's game: a frame every 1/60 s from `start` (plus its `offset` of a frame). A
  # victim's driver (`kill_at` set) asks its session where it is after each frame from the
  # kill on until it has failed over: `{frame, t0, t1, outcome, failovers}`.
  defp drive(session, frames, start, offset, kill_at, _bench) do
    {records, _} =
      frames
      |> Enum.with_index()
      |> Enum.map_reduce(false, fn {x, i}, failed_over ->
        wait_until(start + round((i + offset) * @frame_us))
        t0 = now_us()
        outcome = Cluster.model_step(session, {:embeds, x}, timeout: @frame_timeout)
        t1 = now_us()

        failovers =
          if kill_at != nil and not failed_over and killed_before?(kill_at, t1),
            do: ok!(Cluster.session_info(session)).failovers

        {{i, t0, t1, outcome, failovers}, failed_over or (failovers || 0) > 0}
      end)

    records
  end

  defp killed_before?(kill_at, t) do
    t_kill = :atomics.get(kill_at, 1)
    t_kill != 0 and t > t_kill
  end

  defp frames_of(embeds, total), do: for(t <- 0..(total - 1), do: Models.frame(embeds, t))

  # Every output of the victim's sessions against a fresh session (no checkpoint) stepped
  # through the same inputs on the members left: the largest error relative to the expected
  # frame's largest magnitude. Raises past `@rtol`.
  defp check_outputs(group, on_victim, inputs, records) do
    on_victim
    |> Task.async_stream(
      fn s ->
        fresh = ok!(Cluster.open_session(group, model: @model, batch: 1))

        try do
          errors =
            for {x, {t, _, _, {:ok, got}, _}} <- Enum.zip(inputs[s], records[s]) do
              want = ok!(Cluster.model_step(fresh, {:embeds, x}, timeout: 30_000))
              err = rel_error(got, want)

              if err > @rtol,
                do:
                  raise(
                    "session #{inspect(s.pid)} frame #{t}: output off by #{err} (relative) " <>
                      "from an uninterrupted run"
                  )

              err
            end

          Enum.max(errors)
        after
          Cluster.close_session(fresh)
        end
      end,
      timeout: :infinity
    )
    |> Enum.map(fn {:ok, err} -> err end)
    |> Enum.max()
  end

  defp rel_error(%Tensor{} = got, %Tensor{} = want) do
    if got.shape != want.shape,
      do: raise("output shape #{inspect(got.shape)}, expected #{inspect(want.shape)}")

    g = Tensor.to_list(got)
    w = Tensor.to_list(want)
    scale = w |> Enum.map(&abs/1) |> Enum.max()
    err = Enum.zip(g, w) |> Enum.map(fn {a, b} -> abs(a - b) end) |> Enum.max()
    if scale == 0, do: err, else: err / scale
  end

  # One victim session's failover: the times (µs from the kill) of its keeper's steps, traced,
  # and of its first frame answered by the new owner.
  defp sample(records, t_kill, kept, events) do
    after_kill = Enum.filter(events, fn {t, _} -> t >= t_kill end)
    at = fn pred -> Enum.find_value(after_kill, fn {t, e} -> if pred.(e), do: t end) end

    detected =
      at.(fn
        {:receive, {:DOWN, _, _, _, _}} -> true
        {:return, {ScanBridge, :model_step, 4}, {:error, _}} -> true
        # a call sent before the trace began has no return traced, and a DOWN flushed by
        # demonitor is never received: the rebuild starts as soon as the keeper knows
        {:call, {Session, :place, _}} -> true
        _ -> false
      end)

    # place/3 where the rebuild may run the frame in flight on the open (place/2 before that)
    place_call = at.(&match?({:call, {Session, :place, _}}, &1))
    after_place = Enum.filter(after_kill, fn {t, _} -> place_call != nil and t >= place_call end)
    at_place = fn pred -> Enum.find_value(after_place, fn {t, e} -> if pred.(e), do: t end) end
    checked_out = at_place.(&match?({:return, {Balancer, :checkout, 3}, _}, &1))
    named = at_place.(&match?({:return, {ScanBridge.Server, :model_entry, 3}, _}, &1))

    open_call =
      at_place.(fn
        {:call, {ScanBridge, :open_session, [_, _, _]}} -> true
        {:call, {ScanBridge, :open_session_with_frames, [_, _, _, _]}} -> true
        _ -> false
      end)

    opened =
      at_place.(fn
        {:return, {ScanBridge, :open_session, 3}, {:ok, _}} -> true
        {:return, {ScanBridge, :open_session_with_frames, 4}, {:ok, _, _}} -> true
        _ -> false
      end)

    rebuilt =
      at_place.(fn
        {:return, {Session, :place, 2}, {:ok, _}} -> true
        {:return, {Session, :place, 3}, {:ok, _, _}} -> true
        _ -> false
      end)

    # a frame the keeper sent to the gone server (answered with an error, then sent again)
    retried =
      Enum.any?(after_kill, fn {t, e} ->
        match?({:return, {ScanBridge, :model_step, 4}, {:error, _}}, e) and
          (place_call == nil or t <= place_call)
      end)

    # the kept frames: replay/4's log, or the frames of the open that ran them, less the one in
    # flight where the rebuild followed its error (place/3 runs it last)
    replayed =
      Enum.find_value(after_place, fn
        {_, {:call, {Session, :replay, [_, _, log, _]}}} ->
          length(log)

        {_, {:call, {ScanBridge, :open_session_with_frames, [_, _, frames, _]}}} ->
          length(frames) - if(retried, do: 1, else: 0)

        _ ->
          nil
      end)

    # the first frame answered by the new owner: after the rebuild when traced, else the first
    # after the kill whose session then reported a failover
    answered =
      if rebuilt,
        do: Enum.find(records, fn {_, _, t1, _, _} -> t1 >= rebuilt end),
        else: Enum.find(records, fn {_, _, t1, _, f} -> t1 > t_kill and (f || 0) > 0 end)

    if answered == nil,
      do: raise("a victim session has no frame answered by its new owner: more --after frames?")

    {frame, t0, t1, _, _} = answered
    rel = fn t -> t && t - t_kill end

    %{
      "failover_us" => t1 - t_kill,
      "frame" => frame,
      "frame_started_us" => t0 - t_kill,
      "frame_latency_us" => t1 - t0,
      # sent before the kill (so to the old owner), or traced failing there
      "in_flight" => t0 < t_kill or retried,
      "kept_frames_before_kill" => kept,
      "replayed_frames" => replayed || kept,
      "replayed_from" => if(replayed, do: "trace", else: "session_info before the kill"),
      "detected_us" => rel.(detected),
      "rebuild_started_us" => rel.(place_call),
      "checked_out_us" => rel.(checked_out),
      "model_named_us" => rel.(named),
      "open_called_us" => rel.(open_call),
      "opened_us" => rel.(opened),
      "rebuilt_us" => rel.(rebuilt)
    }
  end

  defp failover_summary(rounds) do
    samples = Enum.flat_map(rounds, & &1["samples"])
    failover = Enum.map(samples, & &1["failover_us"])
    replayed = Enum.map(samples, & &1["replayed_frames"])
    rerun = Enum.map(samples, &(&1["replayed_frames"] + if(&1["in_flight"], do: 1, else: 0)))

    phase = fn key ->
      case for s <- samples, s[key] != nil, do: s[key] do
        [] -> nil
        values -> summarize(values)
      end
    end

    duration = fn from, to ->
      case for s <- samples, s[from] != nil and s[to] != nil, do: s[to] - s[from] do
        [] -> nil
        values -> summarize(values)
      end
    end

    crash = fn key ->
      case for r <- rounds, is_number(r["crash"][key]), do: r["crash"][key] do
        [] -> nil
        values -> summarize(values)
      end
    end

    pooled = fn key ->
      rounds
      |> Enum.flat_map(&(&1[key]["values_us"] || []))
      |> latencies()
      |> Map.delete("values_us")
    end

    %{
      "rounds" =>
        Enum.map(rounds, &Map.drop(&1, ["others_latency_before", "others_latency_during"])),
      "samples" => length(samples),
      "failover" => summarize(failover),
      "replayed_frames" => %{
        "max" => Enum.max(replayed),
        "mean" => Enum.sum(replayed) / length(replayed)
      },
      "in_flight_frames" => Enum.count(samples, & &1["in_flight"]),
      "crash_seen" => %{
        "exit_status_on_peer" => crash.("exit_status_on_peer_us"),
        "client_exit_on_peer" => crash.("client_exit_on_peer_us"),
        "client_down_here" => crash.("client_down_here_us")
      },
      "rerun_frames" => %{"max" => Enum.max(rerun), "mean" => Enum.sum(rerun) / length(rerun)},
      "since_kill" => %{
        "detected" => phase.("detected_us"),
        "rebuild_started" => phase.("rebuild_started_us"),
        "checked_out" => phase.("checked_out_us"),
        "model_named" => phase.("model_named_us"),
        "opened" => phase.("opened_us"),
        "rebuilt" => phase.("rebuilt_us"),
        "first_frame_started" => phase.("frame_started_us"),
        "answered" => summarize(failover)
      },
      "durations" => %{
        "detection_to_rebuild_start" => duration.("detected_us", "rebuild_started_us"),
        "balancer_checkout" => duration.("rebuild_started_us", "checked_out_us"),
        "model_named_call" => duration.("checked_out_us", "model_named_us"),
        "open_session_with_state" => duration.("open_called_us", "opened_us"),
        "replay" => duration.("opened_us", "rebuilt_us"),
        "rebuild" => duration.("rebuild_started_us", "rebuilt_us"),
        "rebuilt_to_answer" => duration.("rebuilt_us", "failover_us")
      },
      "first_frame_latency" => summarize(Enum.map(samples, & &1["frame_latency_us"])),
      "others_latency_before" => pooled.("others_latency_before"),
      "others_latency_during" => pooled.("others_latency_during"),
      "max_rel_error" => rounds |> Enum.map(& &1["victims_max_rel_error"]) |> Enum.max(),
      "correct" => Enum.all?(rounds, & &1["correct"])
    }
  end

  # the member with the most sessions would be the natural victim; they are placed evenly, so
  # take the members in turn
  defp pick_victim(group, members, round) do
    live = Cluster.members(group)
    members = Enum.filter(members, &(&1 in live))
    Enum.at(members, rem(round - 1, length(members)))
  end

  ## Crashes

  # SIGKILL from a shell started beforehand (its builtin kill: no process to start at the
  # kill); the time taken right before the command is written to it.
  defp kill_server(shell, member) do
    {:ok, os_pid} = ScanBridge.os_pid(member)
    :ok = :erpc.call(node(member), ClusterBench.Remote, :watch_exit, [member, self()], 10_000)
    watcher = watch_down(member)
    t_kill = now_us()
    t_kill_os = System.os_time(:microsecond)
    Port.command(shell, "kill -9 #{os_pid}; echo killed $?\n")

    receive do
      {^shell, {:data, {:eol, "killed 0"}}} -> :ok
      {^shell, {:data, line}} -> raise "kill -9 #{os_pid}: #{inspect(line)}"
    after
      5_000 -> raise "kill -9 #{os_pid}: the shell did not answer"
    end

    t_sent = now_us()

    if Peers.await_gone([os_pid], 5_000) != [],
      do: raise("server #{os_pid} still running after SIGKILL")

    {exit_seen, client_exited} =
      receive do
        {:client_exited, ^member, status_at, exit_at} ->
          {status_at && status_at - t_kill_os, exit_at - t_kill_os}
      after
        5_000 -> {nil, nil}
      end

    down_seen = down_seen(watcher, t_kill)

    {t_kill,
     %{
       "how" => "kill -9 of the server (Python) process",
       "kill_command_us" => t_sent - t_kill,
       "exit_status_on_peer_us" => exit_seen,
       "client_exit_on_peer_us" => client_exited,
       "client_down_here_us" => down_seen
     }}
  end

  defp stop_node(peer, member) do
    watcher = watch_down(member)
    t_kill = now_us()
    safe_peer_stop(peer)
    t_stopped = now_us()

    if Peers.await_gone([peer.os_pid], 5_000) != [],
      do: raise("peer BEAM #{peer.os_pid} still running after :peer.stop")

    {t_kill,
     %{
       "how" => ":peer.stop/1 of the victim's node",
       "peer_stop_us" => t_stopped - t_kill,
       "client_down_here_us" => down_seen(watcher, t_kill)
     }}
  end

  # A process of this node that monitors `member` and tells the caller when its DOWN came.
  defp watch_down(member) do
    me = self()

    watcher =
      spawn_link(fn ->
        ref = Process.monitor(member)
        send(me, {:monitoring, self()})
        receive(do: ({:DOWN, ^ref, _, _, _} -> send(me, {:member_down, self(), now_us()})))
      end)

    receive(do: ({:monitoring, ^watcher} -> :ok))
    watcher
  end

  defp down_seen(watcher, t_kill) do
    receive do
      {:member_down, ^watcher, t} -> t - t_kill
    after
      5_000 -> nil
    end
  end

  # How long a SIGKILLed Python process that has imported torch and run one op (its thread pool
  # started) takes to be reported exited to a Port of this node ({:exit_status, _}): the floor
  # under a killed server's detection, whatever the cluster code does.
  defp exit_floor(shell, n) do
    code =
      "import sys, torch; torch.ones(256, 256).matmul(torch.ones(256, 256)).sum(); " <>
        "print('ready', flush=True); sys.stdin.read()"

    ports =
      for _ <- 1..n do
        port =
          Port.open({:spawn_executable, TestSupport.python()}, [
            :binary,
            :exit_status,
            :use_stdio,
            {:line, 256},
            {:args, ["-c", code]}
          ])

        {:os_pid, os_pid} = Port.info(port, :os_pid)
        :ets.insert(@pids, {:server, node(), os_pid})
        {port, os_pid}
      end

    for {port, _} <- ports do
      receive do
        {^port, {:data, {:eol, "ready"}}} -> :ok
      after
        120_000 -> raise "the exit-floor python did not start"
      end
    end

    times =
      for {port, os_pid} <- ports do
        Process.sleep(200)
        t0 = now_us()
        Port.command(shell, "kill -9 #{os_pid}; echo killed $?\n")
        receive(do: ({^shell, {:data, {:eol, "killed 0"}}} -> :ok))

        receive do
          {^port, {:exit_status, _}} -> now_us() - t0
        after
          5_000 -> raise "the exit-floor python #{os_pid} was not reported exited"
        end
      end

    summarize(times)
  end

  defp start_shell do
    Port.open({:spawn_executable, "/bin/sh"}, [:binary, :use_stdio, :exit_status, {:line, 1024}])
  end

  ## 3. Checkpoint cost

  defp checkpoint_cost(group, cfg, direct? \\ true) do
    settings = [nil, 10, 2]
    orders = [settings, Enum.reverse(settings)]

    rounds =
      for {order, round} <- Enum.with_index(orders, 1), every <- order do
        latencies = paced(group, cfg, every)

        IO.puts(
          "  #{cfg.sessions} sessions, checkpoint #{inspect(every)} (round #{round}): " <>
            "mean #{round(mean(latencies))} µs"
        )

        %{"round" => round, "checkpoint" => every, "latency" => latencies(latencies)}
      end

    by_setting =
      Map.new(settings, fn every ->
        values = for r <- rounds, r["checkpoint"] == every, v <- r["latency"]["values_us"], do: v
        {key(every), values |> latencies() |> Map.delete("values_us")}
      end)

    base = by_setting["nil"]["mean_us"]

    cost =
      Map.new([10, 2], fn every ->
        m = by_setting[key(every)]["mean_us"]

        per_round =
          for round <- [1, 2] do
            mean_of = fn e ->
              Enum.find(rounds, &(&1["round"] == round and &1["checkpoint"] == e))["latency"][
                "mean_us"
              ]
            end

            mean_of.(every) / mean_of.(nil)
          end

        {key(every),
         %{
           "mean_ratio" => m / base,
           "mean_ratio_per_round" => per_round,
           "extra_mean_us" => m - base,
           "budget_fraction" => (m - base) / @frame_us
         }}
      end)

    base = %{
      "frames" => cfg.frames,
      "sessions" => cfg.sessions,
      "by_setting" => by_setting,
      "rounds" =>
        Enum.map(rounds, fn r -> update_in(r["latency"], &Map.delete(&1, "values_us")) end),
      "cost_vs_nil" => cost
    }

    if direct?, do: Map.merge(base, direct_results(group, cfg)), else: base
  end

  defp direct_results(group, cfg) do
    direct = direct_costs(group, cfg)

    %{
      "export_round_trip" => direct.export,
      "open_with_state" => direct.open,
      "export_per_frame_budget_fraction" => %{
        "10" => direct.export["p50_us"] / 10 / @frame_us,
        "2" => direct.export["p50_us"] / 2 / @frame_us
      },
      "keeper_hop" => direct.hop
    }
  end

  defp key(nil), do: "nil"
  defp key(n), do: Integer.to_string(n)

  # `sessions` sessions with `checkpoint: every` stepped at 60 FPS for `frames` frames; every
  # frame's latency as its caller sees it.
  defp paced(group, cfg, every) do
    n = cfg.sessions

    sessions =
      for _ <- 1..n,
          do: ok!(Cluster.open_session(group, [model: @model, batch: 1], checkpoint: every))

    total = cfg.warmup + cfg.frames

    try do
      start = now_us() + 50_000

      sessions
      |> Enum.with_index()
      |> Enum.map(fn {s, i} ->
        frames = frames_of(Models.embeds(1, total, 8), total)
        Task.async(fn -> drive(s, frames, start, i / n, nil, nil) end)
      end)
      |> Task.await_many(total * (@frame_timeout + 1_000))
      |> Enum.flat_map(fn records ->
        for {_, t0, t1, outcome, _} <- Enum.drop(records, cfg.warmup) do
          {:ok, _} = outcome
          t1 - t0
        end
      end)
    after
      Enum.each(sessions, &Cluster.close_session/1)
    end
  end

  # Unpaced, one session on one member: session_state round trips (a checkpoint's export),
  # opening a session from that state (a failover's upload), and Cluster.model_step against
  # ScanBridge.model_step on the same member and session, alternated.
  defp direct_costs(group, cfg) do
    n = cfg.hop_frames
    warm = max(div(n, 10), 5)
    s = ok!(Cluster.open_session(group, model: @model, batch: 1))

    try do
      %{member: member, session: remote} = ok!(Cluster.session_info(s))
      model = ok!(ScanBridge.Server.model_named(member, @model))
      frames = frames_of(Models.embeds(1, n + warm, 8), n + warm)

      for x <- Enum.take(frames, warm) do
        {:ok, _} = Cluster.model_step(s, {:embeds, x})
        {:ok, _} = ScanBridge.model_step(member, remote, {:embeds, x})
        {:ok, _} = ScanBridge.session_state(member, remote)
      end

      export =
        for _ <- 1..n do
          {{:ok, _}, us} = BenchSupport.timed(fn -> ScanBridge.session_state(member, remote) end)
          us
        end

      {:ok, state} = ScanBridge.session_state(member, remote)

      open =
        for _ <- 1..n do
          {{:ok, id}, us} =
            BenchSupport.timed(fn ->
              ScanBridge.open_session(member, %{model: model, batch: 1, state: state})
            end)

          :ok = ScanBridge.close_session(member, id)
          us
        end

      {cluster, direct} =
        frames
        |> Enum.drop(warm)
        |> Enum.map(fn x ->
          {{:ok, _}, c} = BenchSupport.timed(fn -> Cluster.model_step(s, {:embeds, x}) end)

          {{:ok, _}, d} =
            BenchSupport.timed(fn -> ScanBridge.model_step(member, remote, {:embeds, x}) end)

          {c, d}
        end)
        |> Enum.unzip()

      %{
        export: summarize(export),
        open: summarize(open),
        hop: %{
          "frames" => n,
          "cluster_model_step" => summarize(cluster),
          "direct_model_step" => summarize(direct),
          "overhead_p50_us" => BenchSupport.median(cluster) - BenchSupport.median(direct)
        }
      }
    after
      Cluster.close_session(s)
    end
  end

  ## Rollback

  # Unpaced, one session with `checkpoint: 10` (whose snapshots survive a failover): a frame,
  # Cluster.snapshot, a frame, Cluster.restore (then the snapshot freed), Cluster.fork (then
  # closed), each alternated with the same op straight to the member's client on the keeper's
  # remote session (ScanBridge.snapshot/restore/fork): what the keeper adds to each.
  defp rollback_costs(group, cfg) do
    n = cfg.hop_frames
    warm = max(div(n, 10), 5)
    s = ok!(Cluster.open_session(group, [model: @model, batch: 1], checkpoint: 10))

    try do
      %{member: member, session: remote} = ok!(Cluster.session_info(s))
      frames = frames_of(Models.embeds(1, n + warm, 8), n + warm)

      rounds =
        for x <- frames do
          {:ok, _} = Cluster.model_step(s, {:embeds, x})
          {{:ok, snap}, snapshot} = BenchSupport.timed(fn -> Cluster.snapshot(s) end)
          {:ok, _} = Cluster.model_step(s, {:embeds, x})
          {:ok, restore} = BenchSupport.timed(fn -> Cluster.restore(s, snap) end)
          :ok = Cluster.free_snapshot(s, snap)
          {{:ok, fork}, forked} = BenchSupport.timed(fn -> Cluster.fork(s) end)
          :ok = Cluster.close_session(fork)

          {{:ok, id}, direct_snapshot} =
            BenchSupport.timed(fn -> ScanBridge.snapshot(member, remote) end)

          {:ok, direct_restore} =
            BenchSupport.timed(fn -> ScanBridge.restore(member, remote, id) end)

          :ok = ScanBridge.free_snapshot(member, id)

          {{:ok, copy}, direct_fork} = BenchSupport.timed(fn -> ScanBridge.fork(member, remote) end)

          :ok = ScanBridge.close_session(member, copy)
          [snapshot, restore, forked, direct_snapshot, direct_restore, direct_fork]
        end

      columns =
        rounds
        |> Enum.drop(warm)
        |> Enum.zip_with(& &1)
        |> Enum.map(&summarize/1)

      Enum.zip(
        ~w(cluster_snapshot cluster_restore cluster_fork direct_snapshot direct_restore direct_fork),
        columns
      )
      |> Map.new()
      |> Map.merge(%{"frames" => n, "checkpoint" => 10})
    after
      Cluster.close_session(s)
    end
  end

  ## Tracing a victim's keeper

  # The keeper's steps in a rebuild, timestamped: the DOWN it receives, the calls place/2 or
  # place/3 makes (Balancer.checkout/3, Server.model_entry/3 where called,
  # ScanBridge.open_session/3 and replay/4, or open_session_with_frames/4) and its model steps. Only the victim's keepers are traced, from just before the
  # kill to the round's end; a pattern that matches no function (renamed) leaves its times out
  # (null).
  @traced [
    {Session, :place, 2},
    {Session, :place, 3},
    {Session, :replay, 4},
    {Balancer, :checkout, 3},
    {ScanBridge.Server, :model_entry, 3},
    {ScanBridge, :open_session, 3},
    {ScanBridge, :open_session_with_frames, 4},
    {ScanBridge, :model_step, 4}
  ]

  defp start_tracing do
    # a pattern set before its module is loaded matches nothing
    Enum.each(@traced, fn {m, _, _} -> Code.ensure_loaded!(m) end)
    tracer = spawn_link(fn -> tracer([]) end)
    return = [{:_, [], [{:return_trace}]}]
    matched = Map.new(@traced, fn mfa -> {mfa, :erlang.trace_pattern(mfa, return, [:local])} end)
    :erlang.trace_pattern(:receive, [{[:_, :_, {:DOWN, :_, :_, :_, :_}], [], []}], [])
    %{tracer: tracer, matched: matched}
  end

  defp stop_tracing(%{tracer: tracer}) do
    Enum.each(@traced, &:erlang.trace_pattern(&1, false, [:local]))
    :erlang.trace_pattern(:receive, true, [])
    Process.unlink(tracer)
    Process.exit(tracer, :kill)
  end

  defp trace_on(%{tracer: tracer}, pids) do
    for pid <- pids,
        do: :erlang.trace(pid, true, [:call, :receive, :monotonic_timestamp, {:tracer, tracer}])
  end

  defp trace_off(pids) do
    for pid <- pids do
      try do
        :erlang.trace(pid, false, [:all])
      rescue
        ArgumentError -> :gone
      end
    end
  end

  # %{keeper pid => [{t µs, event}]}, oldest first; the tracer starts over.
  defp trace_events(%{tracer: tracer}) do
    # trace messages still in flight reach the tracer before this one
    send(tracer, {:get, self()})
    receive(do: ({:trace_events, events} -> events))
  end

  defp tracer(acc) do
    receive do
      {:get, from} ->
        events =
          acc
          |> Enum.reverse()
          |> Enum.group_by(&elem(&1, 0), fn {_pid, t, e} -> {t, e} end)

        send(from, {:trace_events, events})
        tracer([])

      {:trace_ts, pid, :call, {m, f, args}, ts} ->
        tracer([{pid, us(ts), {:call, {m, f, args}}} | acc])

      {:trace_ts, pid, :return_from, mfa, value, ts} ->
        tracer([{pid, us(ts), {:return, mfa, value}} | acc])

      {:trace_ts, pid, :receive, msg, ts} ->
        tracer([{pid, us(ts), {:receive, msg}} | acc])

      _other ->
        tracer(acc)
    end
  end

  defp us(native), do: System.convert_time_unit(native, :native, :microsecond)

  ## Peers and servers (as ScanBridge.TestSupport.Peers starts them, without ExUnit's cleanup)

  defp start_peers(n) do
    :ets.new(@pids, [:named_table, :public, :bag])

    1..n
    |> Task.async_stream(&start_peer!("cluster_bench#{&1}"), timeout: 60_000)
    |> Enum.map(fn {:ok, peer} -> peer end)
  end

  defp start_peer!(prefix) do
    peer =
      Peers.launch!(prefix, [args: @peer_erl_flags], fn peer ->
        :ets.insert(@pids, {:peer, peer})
      end)

    binary = :persistent_term.get({__MODULE__, :remote_binary})

    {:module, _} =
      :erpc.call(peer.node, :code, :load_binary, [ClusterBench.Remote, ~c"cluster.exs", binary])

    peer
  end

  defp start_server!(peer, group) do
    extra = :persistent_term.get({__MODULE__, :server_args})
    opts = TestSupport.server_opts(group: group) |> Keyword.update!(:args, &(&1 ++ extra))

    result =
      try do
        :erpc.call(peer.node, ClusterBench.Remote, :start_server, [opts], 120_000)
      catch
        kind, reason -> {kind, reason}
      end

    case result do
      {:ok, client} ->
        {:ok, os_pid} = ScanBridge.os_pid(client)
        :ets.insert(@pids, {:server, peer.node, os_pid})
        client

      other ->
        raise "cannot start a scan-bridge client on #{peer.node}: #{inspect(other)}"
    end
  end

  defp servers_of(%{node: node}),
    do: for({:server, ^node, os_pid} <- :ets.lookup(@pids, :server), do: os_pid)

  defp await_members!(group, n) do
    unless TestSupport.eventually(fn -> length(Cluster.members(group)) == n end, 60_000),
      do: raise("#{inspect(group)} has #{length(Cluster.members(group))} members, expected #{n}")

    # a server's first call of a kind is slower (imports, first allocations): one scan each
    inputs = TestSupport.scan_inputs(%{batch: 1, seq: 4, dim: 2, state: 2})
    for m <- Cluster.members(group), do: {:ok, _} = ScanBridge.scan(m, inputs)
    :ok
  end

  defp safe_peer_stop(%{peer: pid}) do
    :peer.stop(pid)
  catch
    :exit, _ -> :ok
  end

  # Runs `fun`; then, whatever happened, stops every peer, closes the shell, and checks that
  # every peer BEAM and server is gone (SIGKILL to those left, and a failure naming them).
  defp with_cleanup(fun) do
    result =
      try do
        fun.()
      catch
        kind, reason ->
          stack = __STACKTRACE__
          cleanup()
          :erlang.raise(kind, reason, stack)
      end

    case cleanup() do
      [] -> result
      left -> raise "OS processes outlived the bench (killed now): #{inspect(left)}"
    end
  end

  defp cleanup do
    shell =
      case :persistent_term.get({__MODULE__, :shell}, nil) do
        nil ->
          []

        port ->
          os_pid = Port.info(port, :os_pid)

          try do
            Port.close(port)
          rescue
            ArgumentError -> :ok
          end

          case os_pid do
            {:os_pid, pid} -> [pid]
            _ -> []
          end
      end

    {peers, servers} =
      if :ets.whereis(@pids) == :undefined do
        {[], []}
      else
        {for({:peer, peer} <- :ets.lookup(@pids, :peer), do: peer),
         for({:server, _node, os_pid} <- :ets.lookup(@pids, :server), do: os_pid)}
      end

    Enum.each(peers, &safe_peer_stop/1)
    left = Peers.await_gone(Enum.map(peers, & &1.os_pid) ++ shell, 5_000)
    left = left ++ Peers.await_gone(servers, 10_000)
    Enum.each(left, &System.cmd("kill", ["-KILL", Integer.to_string(&1)], stderr_to_stdout: true))
    left
  end

  ## Goals, settings, method

  defp goals(results) do
    kill = results["failover_kill"]
    cost10 = results["checkpoint_cost"]["cost_vs_nil"]["10"]
    p99_ms = kill["failover"]["p99_us"] / 1000

    %{
      "failover_p99_ms" => %{
        "measured" => p99_ms,
        "target" => "<= 50 (kill -9 of a member's server, #{kill["samples"]} sessions)",
        "met" => p99_ms <= 50
      },
      "failover_rerun_frames_max" => %{
        "measured" => kill["rerun_frames"]["max"],
        "target" => "<= 2 (kept frames replayed + the frame in flight, if any)",
        "met" => kill["rerun_frames"]["max"] <= 2
      },
      "checkpoint_10_cost" => %{
        "measured" => cost10["mean_ratio"] - 1,
        "target" =>
          "<= 0.05 (mean frame latency with checkpoint: 10 over checkpoint: nil, minus 1)",
        "met" => cost10["mean_ratio"] - 1 <= 0.05
      },
      "checkpoint_10_cost_of_budget" => %{
        "measured" => cost10["budget_fraction"],
        "target" => "<= 0.05 (extra mean latency over the 16.67 ms frame budget)",
        "met" => cost10["budget_fraction"] <= 0.05
      },
      "light_checkpoint_10_cost" => %{
        "measured" => results["checkpoint_cost_light"]["cost_vs_nil"]["10"]["mean_ratio"] - 1,
        "target" =>
          "<= 0.05 (not a goal of the issue: as checkpoint_10_cost with light_sessions sessions)",
        "met" => results["checkpoint_cost_light"]["cost_vs_nil"]["10"]["mean_ratio"] - 1 <= 0.05
      },
      "light_failover_p99_ms" => %{
        "measured" => results["failover_kill_light"]["failover"]["p99_us"] / 1000,
        "target" =>
          "<= 50 (not a goal of the issue: kill -9 with light_sessions sessions, for comparison)",
        "met" => results["failover_kill_light"]["failover"]["p99_us"] / 1000 <= 50
      },
      "node_stop_failover_p99_ms" => %{
        "measured" => results["failover_node_stop"]["failover"]["p99_us"] / 1000,
        "target" => "<= 50 (not a goal of the issue: its node stopped, for comparison)",
        "met" => results["failover_node_stop"]["failover"]["p99_us"] / 1000 <= 50
      }
    }
  end

  defp settings(cfg) do
    %{
      "quick" => cfg.quick,
      "sessions" => cfg.sessions,
      "warmup_frames" => cfg.warmup,
      "light_sessions" => cfg.light_sessions,
      "after_kill_frames" => cfg.after,
      "kills" => cfg.kills,
      "checkpoint_frames" => cfg.frames,
      "hop_frames" => cfg.hop_frames,
      "throughput_seconds" => cfg.seconds,
      "throughput_callers" => cfg.callers,
      "seed" => cfg.seed,
      "exit_guard" => cfg.exit_guard,
      "neighbours" => cfg.neighbours,
      "frame_us" => @frame_us,
      "frame_timeout_ms" => @frame_timeout,
      "failover_checkpoint" => 2,
      "model" => Map.put(Models.config(:mamba2), "seed", @model_seed),
      "batch" => 1,
      "peers" => 3,
      "servers_per_peer" => 1,
      "server_args" => TestSupport.server_opts()[:args],
      "peer_erl_flags" => Enum.join(@peer_erl_flags, " "),
      "schedulers_online" => System.schedulers_online(),
      "cpu_count" => cpu_count(),
      "others_window_before_us" => @window_before_us,
      "others_window_during_us" => @window_during_us,
      "rtol" => @rtol
    }
  end

  defp method do
    %{
      "topology" =>
        "three :peer nodes on 127.0.0.1, one server (python -m bridge, CPU) on each, all in " <>
          "one group; this node runs no server, routes and keeps every session (the keeper " <>
          "process of ScanBridge.Cluster.Session)",
      "pacing" =>
        "each session stepped by its own process, one Cluster.model_step every 16.667 ms on " <>
          "absolute times from a common start, session i of n offset by i/n of a frame; " <>
          "latency = the caller's Cluster.model_step round trip",
      "failover" =>
        "sessions opened with checkpoint: 2; after the warm-up one member is crashed; t_kill " <>
          "is taken right before the crash: kill -9 written to a shell started beforehand " <>
          "(builtin kill), or :peer.stop/1 called. For each session that was on the victim " <>
          "(session_info before the kill): failover = (the answer time of its first frame " <>
          "answered by the new owner) - t_kill, where 'by the new owner' means answered after " <>
          "the keeper's rebuild (place/3, place/2 before frames on the open) returned, from a " <>
          "trace of the keeper; where the rebuild ran the frame in flight on its open, that " <>
          "frame's answer. It includes " <>
          "the wait for the session's next paced frame (up to one frame, 16.7 ms) when the " <>
          "rebuild is done before that frame is due: since_kill.first_frame_started and " <>
          "durations.rebuilt_to_answer show it",
      "since_kill" =>
        "µs from t_kill to each step of a victim keeper's rebuild, from :erlang.trace on the " <>
          "keeper (monotonic timestamps): detected = the keeper knew the server was gone: the " <>
          "first of a DOWN received (its monitor of the server, or the in-flight call's), its " <>
          "in-flight model_step's error return, or the rebuild's start (a call sent before " <>
          "the trace began has no return traced, and a DOWN that demonitor flushes is never " <>
          "received); " <>
          "rebuild_started = ScanBridge.Cluster.Session.place/3 (or /2) called; checked_out = " <>
          "Balancer.checkout/3 returned; model_named = ScanBridge.Server.model_entry/3 " <>
          "returned (a call to the new member, made only where this node had not learnt the " <>
          "model's id there: durations.model_named_call's n counts them); opened = " <>
          "ScanBridge.open_session/3 with the checkpoint's state returned, or " <>
          "open_session_with_frames/4 (the open with the kept frames and the frame in flight, " <>
          "one request; durations.open_session_with_state then holds them, and replay is " <>
          "nothing); rebuilt = place/3 (or /2) returned (kept frames replayed); " <>
          "answered = the failover time",
      "replayed_frames" =>
        "the length of the kept-frame log the rebuild replayed (the first replay/4 call's " <>
          "argument, or open_session_with_frames/4's frames less the one in flight, traced; " <>
          "else frames_since_checkpoint from session_info just before the " <>
          "kill); in_flight: the keeper had sent a frame to the gone server (its model_step " <>
          "returned an error after t_kill, traced; else: the frame was called before t_kill), " <>
          "which is sent again to the new owner; rerun_frames = replayed + in_flight",
      "neighbours" =>
        "settings.neighbours processes (sh, an empty loop) started before the run and killed " <>
          "after it, each keeping a core busy throughout, as another tenant of the box would",
      "correctness" =>
        "every output of every victim session (warm-up and after the kill) compared with a " <>
          "fresh session (no checkpoint) stepped through the same inputs afterwards: largest " <>
          "error relative to the expected frame's largest magnitude <= 1e-5, else the bench " <>
          "fails; every session must report failovers 1 (victims) or 0 (others), and no " <>
          "frame may fail",
      "others_latency" =>
        "paced frame latency of the sessions not on the victim, frames started in the second " <>
          "before t_kill (before) and in the 200 ms from it (during), all rounds pooled",
      "exit_floor" =>
        "a Python process that imported torch and ran one matmul, spawned as a Port of this " <>
          "node, killed (kill -9 from the same shell): µs until the Port reports its exit " <>
          "status; a killed server's client cannot know sooner (the process must be torn down " <>
          "by the kernel first)",
      "crash_seen" =>
        "kill -9: exit_status_on_peer = when the victim's client process (on its peer node) " <>
          "received its Port's {:exit_status, _}, traced there, as OS time against the OS " <>
          "time taken with t_kill (none when a request's write into the dead server closed " <>
          "the Port first, :epipe); client_exit_on_peer = when that client process exited, " <>
          "traced likewise; client_down_here = when a process of this node monitoring " <>
          "that client got its DOWN (node stop: the DOWN, noconnection). Each round's " <>
          "code_loaded_here: the modules this node (the keepers') loaded during the round, " <>
          "which in interactive mode hold the failover up while they load",
      "checkpoint_cost_light" =>
        "as checkpoint_cost with light_sessions sessions (the machine not saturated)",
      "failover_kill_light" =>
        "the same as failover_kill, one round, with light_sessions sessions: the machine " <>
          "not saturated, to tell the mechanism's own time from that of a loaded machine",
      "checkpoint_cost" =>
        "the sessions at 60 FPS for the given frames (after warmup_frames, dropped) with " <>
          "checkpoint: nil, 10 and 2, fresh sessions each, in that order and then reversed; mean_ratio = mean latency / mean " <>
          "latency with nil (both rounds pooled; per round too, for drift); budget_fraction = " <>
          "(mean - mean with nil) / 16.67 ms. A checkpoint runs in the keeper after the " <>
          "frame's answer, so the caller sees it only as load (and as a wait if the next " <>
          "frame came before it ended)",
      "export_round_trip" =>
        "ScanBridge.session_state of a tiny-model session on a member, from this node, back " <>
          "to back (what a checkpoint costs the keeper); export_per_frame_budget_fraction = " <>
          "its p50 / n / 16.67 ms",
      "open_with_state" =>
        "ScanBridge.open_session(member, model:, batch: 1, state: saved) from this node, back " <>
          "to back (each then closed, untimed): a rebuild's upload",
      "keeper_hop" =>
        "unpaced, alternating on one session (no checkpoint): Cluster.model_step (caller -> " <>
          "keeper -> client on the member's node -> server) and ScanBridge.model_step on the " <>
          "member's client with the keeper's remote session id (caller -> client -> server)",
      "rollback" =>
        "unpaced, one session with checkpoint: 10, `hop_frames` rounds after a tenth as " <>
          "warm-up: a frame, Cluster.snapshot, a frame, Cluster.restore of that snapshot " <>
          "(then freed, untimed), Cluster.fork (then closed, untimed); then the same on the " <>
          "member's client with the keeper's remote session id: ScanBridge.snapshot, restore, " <>
          "fork (a server-side copy each). cluster_fork reads the state from the server and " <>
          "opens the fork from it on the least loaded member (two round trips and a keeper)",
      "throughput" =>
        "Cluster.scan of one fixed input set from `callers` processes back to back for " <>
          "`seconds` (after a warm-up), the group at 1, 2, 3 members (servers started one at " <>
          "a time, each on its own peer); calls/s = calls / (last answer - start); " <>
          "calls_per_member from each server's stats; single_call: one caller, one member"
    }
  end

  ## Summaries

  defp latencies(values) do
    values
    |> summarize()
    |> Map.merge(%{"mean_us" => mean(values), "values_us" => values})
  end

  defp summarize([]), do: %{"n" => 0}

  defp summarize(values),
    do: values |> BenchSupport.summary_us() |> Map.put("mean_us", mean(values))

  defp mean([]), do: nil
  defp mean(values), do: Enum.sum(values) / length(values)

  defp report(doc) do
    r = doc["results"]
    ms = fn us -> if us, do: :erlang.float_to_binary(us / 1000, decimals: 2), else: "-" end
    pct = fn x -> :erlang.float_to_binary(x * 100, decimals: 1) <> " %" end

    line = fn name, s ->
      "    #{String.pad_trailing(name, 34)} p50 #{ms.(s["p50_us"])} ms  p99 #{ms.(s["p99_us"])} ms  max #{ms.(s["max_us"])} ms  (n #{s["n"]})"
    end

    IO.puts(
      "\ncluster: 3 peers × 1 server, #{doc["settings"]["sessions"]} sessions at 60 FPS, " <>
        "#{doc["settings"]["schedulers_online"]} schedulers, #{doc["settings"]["cpu_count"]} CPUs"
    )

    t = r["throughput"]
    single = t["single_call"]

    IO.puts(
      "throughput, Cluster.scan #{inspect(t["inputs"])}, #{t["callers"]} callers " <>
        "(one call alone: p50 #{ms.(single["p50_us"])} ms, kernel_us p50 #{ms.(single["kernel_p50_us"])} ms)"
    )

    for row <- t["by_members"] do
      IO.puts(
        "    #{row["members"]} member(s): #{round(row["calls_per_s"])} calls/s " <>
          "(#{Float.round(row["ratio_vs_1"], 2)}× 1 member; per member #{inspect(row["calls_per_member"])})"
      )
    end

    for {name, key} <- [
          {"failover, kill -9 of a server", "failover_kill"},
          {"failover, kill -9, light load", "failover_kill_light"},
          {"failover, node stopped", "failover_node_stop"}
        ] do
      f = r[key]

      IO.puts(
        "#{name}: #{f["samples"]} sessions in #{length(f["rounds"])} round(s), replayed max " <>
          "#{f["replayed_frames"]["max"]} mean #{Float.round(f["replayed_frames"]["mean"] * 1.0, 2)}, " <>
          "in flight #{f["in_flight_frames"]}, rerun max #{f["rerun_frames"]["max"]}, correct " <>
          "#{f["correct"]} (max rel error #{f["max_rel_error"]})"
      )

      IO.puts(line.("failover (kill -> answer)", f["failover"]))

      for {k, label} <- [
            {"exit_status_on_peer", "  server exit reported on its node"},
            {"client_exit_on_peer", "  its client exited there"},
            {"client_down_here", "  its client's DOWN on this node"}
          ],
          s = f["crash_seen"][k],
          s != nil,
          do: IO.puts(line.(label, s))

      for {phase, label} <- [
            {"detected", "  detected (DOWN)"},
            {"rebuild_started", "  rebuild started"},
            {"opened", "  opened from the checkpoint"},
            {"rebuilt", "  rebuilt (replayed)"},
            {"first_frame_started", "  its next frame started"}
          ],
          s = f["since_kill"][phase],
          s != nil,
          do: IO.puts(line.(label, s))

      for {d, label} <- [
            {"balancer_checkout", "  Balancer.checkout"},
            {"model_named_call", "  model_named call (new member)"},
            {"open_session_with_state", "  open_session with state"},
            {"replay", "  replay"},
            {"rebuilt_to_answer", "  rebuilt -> answered"}
          ],
          s = f["durations"][d],
          s != nil,
          do: IO.puts(line.(label, s))

      IO.puts(line.("others' frames, 1 s before", f["others_latency_before"]))
      IO.puts(line.("others' frames, 200 ms from kill", f["others_latency_during"]))
    end

    IO.puts(line.("exit floor: torch python killed", r["exit_floor"]))
    c = r["checkpoint_cost"]

    for c <- [c, r["checkpoint_cost_light"]] do
      IO.puts(
        "checkpoint cost, #{c["sessions"]} sessions × #{c["frames"]} frames at 60 FPS, 2 rounds (nil, 10, 2 then 2, 10, nil)"
      )

      checkpoint_lines(c, line, ms, pct)
    end

    IO.puts(line.("export round trip (session_state)", c["export_round_trip"]))
    IO.puts(line.("open_session from a state", c["open_with_state"]))
    IO.puts(line.("Cluster.model_step (keeper)", c["keeper_hop"]["cluster_model_step"]))
    IO.puts(line.("ScanBridge.model_step (direct)", c["keeper_hop"]["direct_model_step"]))
    IO.puts("    keeper hop overhead p50 #{ms.(c["keeper_hop"]["overhead_p50_us"])} ms")
    rb = r["rollback"]
    IO.puts("rollback, one session with checkpoint: #{rb["checkpoint"]}, #{rb["frames"]} rounds")

    for op <- ~w(snapshot restore fork) do
      IO.puts(line.("Cluster.#{op}", rb["cluster_" <> op]))
      IO.puts(line.("ScanBridge.#{op} (direct)", rb["direct_" <> op]))
    end

    IO.puts("goals:")

    for {name, g} <- Enum.sort(doc["goals"]) do
      IO.puts(
        "    #{String.pad_trailing(name, 30)} #{Float.round(g["measured"] * 1.0, 3)}  target #{g["target"]}  met: #{g["met"]}"
      )
    end
  end

  defp checkpoint_lines(c, line, ms, pct) do
    for k <- ["nil", "10", "2"] do
      s = c["by_setting"][k]
      extra = c["cost_vs_nil"][k]

      cost =
        if extra,
          do:
            "  mean #{Float.round(extra["mean_ratio"], 3)}× nil (per round #{inspect(Enum.map(extra["mean_ratio_per_round"], &Float.round(&1, 3)))}), #{pct.(extra["budget_fraction"])} of the frame budget",
          else: ""

      IO.puts(line.("checkpoint: #{k}", s) <> "  mean #{ms.(s["mean_us"])} ms" <> cost)
    end
  end

  ## Time and the machine

  defp now_us, do: System.monotonic_time(:microsecond)

  defp wait_until(t) do
    delay = t - now_us()
    if delay > 0, do: Process.sleep(div(delay + 999, 1000))
  end

  defp ok!({:ok, value}), do: value
  defp ok!(other), do: raise("expected {:ok, _}, got #{inspect(other, limit: 8)}")

  defp cpu_count do
    case File.read("/proc/cpuinfo") do
      {:ok, text} -> text |> String.split("\n") |> Enum.count(&String.starts_with?(&1, "processor"))
      _ -> System.schedulers()
    end
  end

  defp load_avg do
    case File.read("/proc/loadavg") do
      {:ok, text} -> text |> String.split() |> Enum.take(3) |> Enum.map(&String.to_float/1)
      _ -> nil
    end
  end
end

ClusterBench.main(System.argv())
