defmodule ScanBridge.Cluster.MemberTest do
  # A group member's catalogue keeper on its own, with no server behind it (its catalogue is
  # empty, so it loads nothing): it answers the other keepers while it copies their catalogues.
  use ExUnit.Case, async: true

  alias ScanBridge.Cluster
  alias ScanBridge.Cluster.Member

  # Generous: a keeper stalled for a second on a loaded machine is not what these tests test.
  defp catalogue(keeper), do: GenServer.call(keeper, :catalogue, 5_000)

  # A keeper that, asked for its catalogue, first asks the asker for its own (as a member that
  # started at the same moment does while it syncs), reports how that went, then answers.
  defp asking_back_keeper(group, test) do
    spawn_link(fn ->
      :ok = :pg.join(Cluster.scope(), {:catalogue, group}, self())
      send(test, :joined)

      receive do
        {:"$gen_call", from, :versioned_catalogue} ->
          [other] = Member.keepers(group) -- [self()]

          outcome =
            try do
              # under the member's own wait for this keeper, so a member that cannot answer
              # before that wait ends times this call out
              {:answered, GenServer.call(other, :versioned_catalogue, 3_000)}
            catch
              :exit, {:timeout, _} -> :timed_out
            end

          send(test, {:asked_back, outcome})
          GenServer.reply(from, %{})
      end

      Process.sleep(:infinity)
    end)
  end

  test "a keeper answers another keeper's call while it copies the catalogues" do
    group = {:member_test, System.unique_integer([:positive])}
    asking_back_keeper(group, self())
    assert_receive :joined
    server = spawn_link(fn -> Process.sleep(:infinity) end)
    {:ok, _member} = Member.start_link(server: server, group: group)
    assert_receive {:asked_back, {:answered, %{}}}, 5_000
    # and it then offers its server to the group
    assert eventually_member(group, server)
  end

  test "a load whose source cannot be sent fails; the keeper lives on" do
    group = {:member_test, System.unique_integer([:positive])}
    server = spawn_link(fn -> Process.sleep(:infinity) end)
    {:ok, member} = Member.start_link(server: server, group: group)
    source = %{config: %{"d_model" => Integer.pow(2, 70)}, weights: %{}}
    version = {1, {node(), System.unique_integer([:positive])}}

    assert {:error, %ScanBridge.Error{reason: :invalid_argument}} =
             GenServer.call(member, {:load, "bad", source, [], version}, 5_000)

    assert is_map(catalogue(member))
  end

  # A server whose model_load answers only when told: {:loading, self()} to the test, then
  # the model "m1" after :go. Counts nothing else.
  defp slow_loading_server(test) do
    receive do
      {:"$gen_call", from, {:request, "model_load", _head, _size, _timeout, _closes}} ->
        send(test, {:loading, self()})

        receive do
          :go -> GenServer.reply(from, {:ok, %{"model" => "m1"}, %{}})
        end

      {:"$gen_call", from, {:request, "model_free", _head, _size, _timeout, _closes}} ->
        send(test, :freed)
        GenServer.reply(from, {:ok, %{}, %{}})

      {:"$gen_cast", _naming} ->
        :ok
    end

    slow_loading_server(test)
  end

  test "a keeper answers while its server loads; callers of that load share it; a free waits for it" do
    group = {:member_test, System.unique_integer([:positive])}
    test = self()
    server = spawn_link(fn -> slow_loading_server(test) end)
    {:ok, member} = Member.start_link(server: server, group: group)
    assert eventually_member(group, server)

    first =
      Task.async(fn -> GenServer.call(member, {:load, "m", "/models/m", [], {1, :test}}, 5_000) end)

    assert_receive {:loading, ^server}, 5_000
    # the catalogue while the model loads: recorded, not yet loaded
    assert catalogue(member) == %{"m" => {"/models/m", [], nil}}

    second =
      Task.async(fn -> GenServer.call(member, {:load, "m", "/models/m", [], {1, :test}}, 5_000) end)

    other = GenServer.call(member, {:load, "m", "/models/other", [], {1, :test}}, 5_000)
    assert {:error, %ScanBridge.Error{reason: :invalid_argument}} = other
    free = Task.async(fn -> GenServer.call(member, {:free, "m", [], :test}, 5_000) end)
    Process.sleep(50)
    send(server, :go)

    assert {:ok, %{"model" => "m1"}} = Task.await(first)
    assert {:ok, %{"model" => "m1"}} = Task.await(second)
    assert :ok = Task.await(free)
    assert_receive :freed
    refute_received {:loading, _}
    assert catalogue(member) == %{}
  end

  test "a keeper stops when its server stops, GenServer.stop's :normal exit included" do
    group = {:member_test, System.unique_integer([:positive])}
    server = spawn(fn -> receive(do: (:stop -> :ok)) end)
    {:ok, member} = Member.start_link(server: server, group: group)
    # the test is no server: the keeper's exit is not to take it along
    Process.unlink(member)
    assert eventually_member(group, server)
    keeper = Process.monitor(member)
    send(server, :stop)
    assert_receive {:DOWN, ^keeper, :process, ^member, _reason}, 5_000
    assert eventually(fn -> Member.keepers(group) == [] end)
  end

  # A keeper left behind by a server that went away: it answers what such a keeper's server
  # calls answer.
  defp orphan_keeper(group) do
    spawn_link(fn ->
      :ok = :pg.join(Cluster.scope(), {:catalogue, group}, self())
      orphan_keeper_loop()
    end)
  end

  defp orphan_keeper_loop do
    receive do
      {:"$gen_call", from, _load_or_free} ->
        gone = ScanBridge.Error.client(:not_running, "no scan-bridge client process is running")
        GenServer.reply(from, {:error, gone})
    end

    orphan_keeper_loop()
  end

  # A keeper that answers nothing: its node frozen, or cut off from the caller's.
  defp silent_keeper(group) do
    spawn_link(fn ->
      :ok = :pg.join(Cluster.scope(), {:catalogue, group}, self())
      Process.sleep(:infinity)
    end)
  end

  test "a group's free that a keeper does not answer in time is a :timeout, as a load is" do
    {group, _member} = loading_member()
    assert {:ok, %{members: 1}} = Cluster.load_model(group, "m", "/models/m")
    silent_keeper(group)
    assert eventually(fn -> length(Member.keepers(group)) == 2 end)

    # that member may still hold the model: the free is not done
    assert {:error, %ScanBridge.Error{reason: :timeout}} =
             Cluster.free_model(group, "m", timeout: 100)

    assert {:error, %ScanBridge.Error{reason: :timeout}} =
             Cluster.load_model(group, "m", "/models/m", timeout: 100)
  end

  test "a group's free asks every member at once: silent ones cost one deadline between them" do
    {group, member} = loading_member()
    assert {:ok, %{members: 1}} = Cluster.load_model(group, "m", "/models/m")
    for _ <- 1..3, do: silent_keeper(group)
    assert eventually(fn -> length(Member.keepers(group)) == 4 end)

    # the deadline is :timeout and a second; one member after another took one each
    {us, outcome} = :timer.tc(fn -> Cluster.free_model(group, "m", timeout: 100) end)
    assert {:error, %ScanBridge.Error{reason: :timeout}} = outcome
    assert us < 2 * 1_100_000, "the free took #{div(us, 1000)} ms"
    assert catalogue(member) == %{}

    {us, outcome} = :timer.tc(fn -> Cluster.load_model(group, "m", "/models/m", timeout: 100) end)
    assert {:error, %ScanBridge.Error{reason: :timeout}} = outcome
    assert us < 2 * 1_100_000, "the load took #{div(us, 1000)} ms"
  end

  # A server that answers its model_loads and model_frees with `loads` and `frees` in turn (:ok,
  # or an error's reason; :ok once they run out), telling the test of each.
  defp scripted_server(test, loads, frees) do
    receive do
      {:"$gen_call", from, {:request, "model_load", _head, _size, _timeout, _closes}} ->
        send(test, {:model_load, self()})
        {reply, loads} = List.pop_at(loads, 0, :ok)
        GenServer.reply(from, scripted(reply, %{"model" => "m1"}))
        scripted_server(test, loads, frees)

      {:"$gen_call", from, {:request, "model_free", _head, _size, _timeout, _closes}} ->
        send(test, {:model_free, self()})
        {reply, frees} = List.pop_at(frees, 0, :ok)
        GenServer.reply(from, scripted(reply, %{}))
        scripted_server(test, loads, frees)

      {:"$gen_cast", _naming} ->
        scripted_server(test, loads, frees)
    end
  end

  defp scripted(:ok, result), do: {:ok, result, %{}}
  defp scripted(reason, _result), do: {:error, ScanBridge.Error.client(reason, "scripted")}

  # A group of two members, their servers scripted; returns the servers and their keepers.
  defp scripted_members(scripts) do
    group = {:member_test, System.unique_integer([:positive])}
    test = self()

    for {loads, frees} <- scripts do
      server = spawn_link(fn -> scripted_server(test, loads, frees) end)
      {:ok, member} = Member.start_link(server: server, group: group)
      assert eventually_member(group, server)
      {server, member}
    end
    |> then(&{group, &1})
  end

  test "a name one member still holds after a failed load is refused for another model" do
    {group, [{a, _}, {b, keeper_b}]} = scripted_members([{[], []}, {[:out_of_memory], []}])

    assert {:error, %ScanBridge.Error{reason: :out_of_memory}} =
             Cluster.load_model(group, "m", "/models/m")

    assert_received {:model_load, ^a}
    assert_received {:model_load, ^b}

    # a holds "/models/m" under the name: b is not to load another model under it
    assert {:error, %ScanBridge.Error{reason: :invalid_argument, detail: detail}} =
             Cluster.load_model(group, "m", "/models/other")

    assert detail["member"] == "#{node()}"
    refute_received {:model_load, _}
    assert %{"m" => {"/models/m", [], nil}} = catalogue(keeper_b)

    # the same model again loads it where it failed
    assert {:ok, %{members: 2}} = Cluster.load_model(group, "m", "/models/m")
    assert_received {:model_load, ^b}
    refute_received {:model_load, ^a}
  end

  test "a name one member still holds after a failed free is refused for another model" do
    {group, [{a, keeper_a}, {b, keeper_b}]} =
      scripted_members([{[], [:invalid_argument]}, {[], []}])

    assert {:ok, %{members: 2}} = Cluster.load_model(group, "m", "/models/m")
    assert_received {:model_load, ^a}
    assert_received {:model_load, ^b}
    # a has a session of it open: it refuses the free, b frees it
    assert {:error, %ScanBridge.Error{reason: :invalid_argument}} = Cluster.free_model(group, "m")
    assert_received {:model_free, ^a}
    assert_received {:model_free, ^b}
    assert catalogue(keeper_b) == %{}

    assert {:error, %ScanBridge.Error{reason: :invalid_argument}} =
             Cluster.load_model(group, "m", "/models/other")

    refute_received {:model_load, _}
    assert catalogue(keeper_b) == %{}
    assert %{"m" => {"/models/m", [], %{}}} = catalogue(keeper_a)

    # freed everywhere, the name takes another model
    assert :ok = Cluster.free_model(group, "m")
    assert {:ok, %{members: 2}} = Cluster.load_model(group, "m", "/models/other")
  end

  test "a free that a member's server answers :unknown_model frees the name there" do
    # a's server no longer holds the model: freed there directly, or restarted since
    {group, [{a, keeper_a}, {b, keeper_b}]} = scripted_members([{[], [:unknown_model]}, {[], []}])

    assert {:ok, %{members: 2}} = Cluster.load_model(group, "m", "/models/m")
    assert :ok = Cluster.free_model(group, "m")
    assert_received {:model_free, ^a}
    assert_received {:model_free, ^b}
    assert catalogue(keeper_a) == %{}
    assert catalogue(keeper_b) == %{}
    assert {:ok, %{members: 2}} = Cluster.load_model(group, "m", "/models/other")
  end

  # Stands in the group for `keeper` as a member reached over a slower link: it holds each call
  # until another comes (or 200 ms pass) and passes the two on in the other order, so that of
  # two callers the one the other members answer first reaches this member second.
  defp reordering_link(group, keeper) do
    link = spawn_link(fn -> reordering_link_loop(keeper) end)
    :ok = :pg.join(Cluster.scope(), {:catalogue, group}, link)
    :ok = :pg.leave(Cluster.scope(), {:catalogue, group}, keeper)
    link
  end

  defp reordering_link_loop(keeper) do
    receive do
      {:"$gen_call", _from, _request} = first ->
        receive do
          {:"$gen_call", _from, _request} = second -> send(keeper, second)
        after
          200 -> :ok
        end

        send(keeper, first)

      cast ->
        send(keeper, cast)
    end

    reordering_link_loop(keeper)
  end

  test "two loads of different models under one name at once: one wins on every member" do
    {group, [near, far]} = loading_members(2)
    reordering_link(group, far)
    assert eventually(fn -> length(Member.keepers(group)) == 2 end)

    outcomes =
      ["/models/a", "/models/b"]
      |> Enum.map(fn source -> Task.async(fn -> Cluster.load_model(group, "m", source) end) end)
      |> Enum.map(&Task.await/1)

    assert [{:ok, %{members: 2}}, {:error, %ScanBridge.Error{reason: :invalid_argument} = error}] =
             Enum.sort_by(outcomes, &elem(&1, 0), :desc)

    assert Exception.message(error) =~ ~s(model name "m")
    # every member holds the winner's model under the name, and nothing else
    catalogues = for keeper <- [near, far], do: catalogue(keeper)
    assert [%{"m" => {_source, [], %{}}} = catalogue] = Enum.uniq(catalogues)
    assert map_size(catalogue) == 1
  end

  test "a load refused a claim releases the claims it made; a claim ends with its caller" do
    {group, keepers} = loading_members(2)
    [first, second] = Enum.sort(keepers)
    test = self()

    claimer =
      spawn(fn ->
        send(test, {:claimed, GenServer.call(second, {:claim, "m", "/models/a", []})})
        Process.sleep(:infinity)
      end)

    assert_receive {:claimed, {:ok, _version}}
    # claimed on the first member, refused on the second: the first is not kept from others
    assert {:error, %ScanBridge.Error{reason: :invalid_argument} = error} =
             Cluster.load_model(group, "m", "/models/b")

    assert Exception.message(error) =~ "being loaded as another model"
    Process.exit(claimer, :kill)

    assert eventually(fn -> match?({:ok, _}, Cluster.load_model(group, "m", "/models/c")) end)
    assert %{"m" => {"/models/c", [], %{}}} = catalogue(first)
  end

  # A keeper's node cut off from the caller's: :pg drops its keeper, and what the caller asks of
  # the group reaches the others only.
  defp cut_off(group, keeper), do: :ok = :pg.leave(Cluster.scope(), {:catalogue, group}, keeper)

  # Its node connected again: :pg shows its keeper, and every keeper hears of the node that came
  # up (here the test's own, whose keepers are each other's).
  defp reconnect(group, keeper, keepers) do
    :ok = :pg.join(Cluster.scope(), {:catalogue, group}, keeper)
    for k <- keepers, do: send(k, {:nodeup, node()})
  end

  test "a member cut off during a free holds the model until it is back, then frees it" do
    {group, [_, far] = keepers} = loading_members(2)
    assert {:ok, %{members: 2}} = Cluster.load_model(group, "m", "/models/a")

    cut_off(group, far)
    assert :ok = Cluster.free_model(group, "m")
    # a free that reaches it (before its node is seen to be back) frees it there too
    :ok = :pg.join(Cluster.scope(), {:catalogue, group}, far)

    assert {:error, %ScanBridge.Error{reason: :invalid_argument}} =
             Cluster.load_model(group, "m", "/models/b")

    assert %{"m" => {"/models/a", [], %{}}} = catalogue(far)
    cut_off(group, far)
    reconnect(group, far, keepers)
    assert eventually(fn -> catalogue(far) == %{} end)
    assert {:ok, %{members: 2}} = Cluster.load_model(group, "m", "/models/b")
  end

  test "a member cut off while its model's name went to another takes that model when back" do
    {group, [{near_server, near}, {far_server, far}]} = scripted_members([{[], []}, {[], []}])
    assert {:ok, %{members: 2}} = Cluster.load_model(group, "m", "/models/a")
    assert_received {:model_load, ^near_server}
    assert_received {:model_load, ^far_server}

    cut_off(group, far)
    assert :ok = Cluster.free_model(group, "m")
    assert {:ok, %{members: 1}} = Cluster.load_model(group, "m", "/models/b")
    assert_received {:model_free, ^near_server}
    assert_received {:model_load, ^near_server}
    # back, it holds "/models/a" under the name, the other "/models/b", newer
    reconnect(group, far, [near, far])
    assert_receive {:model_free, ^far_server}, 5_000
    assert_receive {:model_load, ^far_server}, 5_000
    assert eventually(fn -> match?(%{"m" => {"/models/b", [], %{}}}, catalogue(far)) end)
    assert %{"m" => {"/models/b", [], %{}}} = catalogue(near)
    refute_received {_load_or_free, ^near_server}

    # one model under the name again: the old one is refused, the new one a no-op
    assert {:error, %ScanBridge.Error{reason: :invalid_argument}} =
             Cluster.load_model(group, "m", "/models/a")

    assert {:ok, %{members: 2}} = Cluster.load_model(group, "m", "/models/b")
  end

  # What Cluster.catalogue/2 says each member holds under "m": {source, loaded?, version}. The
  # timeout is what a silent keeper costs each call, and long enough for a loaded machine.
  defp models_of(group) do
    assert {:ok, members} = Cluster.catalogue(group, timeout: 1_000)

    for %{node: node} <- members, do: assert(node == node())

    members
    |> Enum.map(fn %{models: %{"m" => m}} -> {m.source, is_binary(m.model), m.version} end)
    |> Enum.sort()
  end

  test "the group's catalogue tells what each member holds; members apart disagree until back" do
    {group, [near, far]} = loading_members(2)
    assert {:ok, %{members: 2}} = Cluster.load_model(group, "m", "/models/a")
    assert models_of(group) == [{"/models/a", true, 1}, {"/models/a", true, 1}]

    cut_off(group, far)
    assert :ok = Cluster.free_model(group, "m")
    assert {:ok, %{members: 1}} = Cluster.load_model(group, "m", "/models/b")
    :ok = :pg.join(Cluster.scope(), {:catalogue, group}, far)
    # a member that does not answer is left out
    silent_keeper(group)
    assert models_of(group) == [{"/models/a", true, 1}, {"/models/b", true, 3}]

    # its node seen to be back (:pg shows its keeper already)
    for keeper <- [near, far], do: send(keeper, {:nodeup, node()})
    agreed = [{"/models/b", true, 3}, {"/models/b", true, 3}]
    assert eventually(fn -> models_of(group) == agreed end)
  end

  test "a model given up for a newer one while sessions use it is freed once they close" do
    # the far server refuses the first free (a session of the model open there)
    {group, [{_, near}, {far_server, far}]} =
      scripted_members([{[], []}, {[], [:invalid_argument]}])

    assert {:ok, %{members: 2}} = Cluster.load_model(group, "m", "/models/a")
    cut_off(group, far)
    assert :ok = Cluster.free_model(group, "m")
    assert {:ok, %{members: 1}} = Cluster.load_model(group, "m", "/models/b")
    reconnect(group, far, [near, far])

    assert_receive {:model_free, ^far_server}, 5_000
    # the newer model loads all the same, and the old one is freed again later
    assert_receive {:model_load, ^far_server}, 5_000
    assert_receive {:model_free, ^far_server}, 5_000
    assert %{"m" => {"/models/b", [], %{}}} = catalogue(far)
  end

  test "a member joining takes the newest model under each name of the others" do
    {group, [older, newer]} = loading_members(2)
    assert {:ok, %{members: 2}} = Cluster.load_model(group, "m", "/models/a")
    cut_off(group, older)
    assert :ok = Cluster.free_model(group, "m")
    assert {:ok, %{members: 1}} = Cluster.load_model(group, "m", "/models/b")
    # back in the group, not yet reconciled: the two disagree
    :ok = :pg.join(Cluster.scope(), {:catalogue, group}, older)

    for _ <- 1..2 do
      {_group, [joined]} = loading_members_of(group, 1)
      assert %{"m" => {"/models/b", [], %{}}} = catalogue(joined)
    end

    assert %{"m" => {"/models/a", [], %{}}} = catalogue(older)
    assert %{"m" => {"/models/b", [], %{}}} = catalogue(newer)
  end

  defp loading_server do
    receive do
      {:"$gen_call", from, {:request, "model_load", _head, _size, _timeout, _closes}} ->
        GenServer.reply(from, {:ok, %{"model" => "m1"}, %{}})

      {:"$gen_call", from, {:request, "model_free", _head, _size, _timeout, _closes}} ->
        GenServer.reply(from, {:ok, %{}, %{}})

      {:"$gen_cast", _naming} ->
        :ok
    end

    loading_server()
  end

  test "loading and freeing a group's model pass over a keeper whose server is gone" do
    {group, _member} = loading_member()
    orphan_keeper(group)
    assert eventually(fn -> length(Member.keepers(group)) == 2 end)

    assert {:ok, %{members: 1, info: %{"model" => "m1"}}} =
             Cluster.load_model(group, "m", "/models/m")

    assert :ok = Cluster.free_model(group, "m")
  end

  test "loading and freeing a group's model with timeout: :infinity waits, and answers" do
    {group, _member} = loading_member()

    assert {:ok, %{members: 1, info: %{"model" => "m1"}}} =
             Cluster.load_model(group, "m", "/models/m", timeout: :infinity)

    assert :ok = Cluster.free_model(group, "m", timeout: :infinity)
  end

  test "a bad :timeout of a group's load or free raises in the caller; no member stops" do
    {group, member} = loading_member()

    for timeout <- [-1, 0x100000000, "5s"] do
      assert_raise ArgumentError, ~r/:timeout/, fn ->
        Cluster.load_model(group, "m", "/models/m", timeout: timeout)
      end

      assert_raise ArgumentError, ~r/:timeout/, fn ->
        Cluster.free_model(group, "m", timeout: timeout)
      end
    end

    assert Process.alive?(member)
    assert catalogue(member) == %{}
  end

  test "loading a group's model again, with another :timeout or the dtype spelt otherwise, is a no-op" do
    {group, _member} = loading_member()

    assert {:ok, %{members: 1, info: %{"model" => "m1"}}} =
             Cluster.load_model(group, "m", "/models/m", timeout: 5_000)

    for opts <- [[timeout: 6_000], [], [dtype: :f32], [dtype: "f32", timeout: :infinity]] do
      assert {:ok, %{members: 1, info: %{"model" => "m1"}}} =
               Cluster.load_model(group, "m", "/models/m", opts),
             "load_model with #{inspect(opts)}"
    end

    # another model under the name is still refused
    assert {:error, %ScanBridge.Error{reason: :invalid_argument}} =
             Cluster.load_model(group, "m", "/models/m", dtype: :bf16)
  end

  # A group of one member whose server answers every load and free.
  defp loading_member do
    {group, [member]} = loading_members(1)
    {group, member}
  end

  # A group of `n` members whose servers answer every load and free; returns the group and
  # the keepers.
  defp loading_members(n),
    do: loading_members_of({:member_test, System.unique_integer([:positive])}, n)

  defp loading_members_of(group, n) do
    keepers =
      for _ <- 1..n do
        server = spawn_link(&loading_server/0)
        {:ok, member} = Member.start_link(server: server, group: group)
        assert eventually_member(group, server)
        member
      end

    {group, keepers}
  end

  defp eventually(fun), do: ScanBridge.TestSupport.eventually(fun)

  defp eventually_member(group, server, tries \\ 100) do
    cond do
      server in Cluster.members(group) -> true
      tries == 0 -> false
      true -> Process.sleep(10) && eventually_member(group, server, tries - 1)
    end
  end
end
