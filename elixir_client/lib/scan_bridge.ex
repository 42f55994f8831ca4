defmodule ScanBridge do
  @moduledoc """
  Offload Mamba selective scans to a scan-bridge server (`python -m bridge`) from Elixir.

  Start one client under your supervisor; it spawns the server as a Port and keeps it for its
  lifetime:

      children = [
        {ScanBridge, name: MyApp.Scan, args: ["--device", "auto"]}
      ]

  Then, from any number of processes at once:

      {:ok, %{y: y, state: state, timing: timing}} =
        ScanBridge.scan(MyApp.Scan, %{x: x, dt: dt, A: a, B: b, C: c, D: d, return_state: true})

  Mamba-2 (SSD) has its own scan, `ssd_scan/3`, and sessions of its own
  (`open_session(server, kind: :ssd, batch: b, heads: h, headdim: p, state: n)`), stepped by
  the same `step/4`.

  Inputs are maps of the protocol's argument names (atoms; SPEC §6) to tensors
  (`ScanBridge.Tensor`, or `Nx.Tensor` when Nx is loaded), handles returned by `put/2`, and
  options (`dt_softplus: true`, `dt_min: 0.001`, `layout: :bdl`, ...). Every reply's `timing`
  is the server's time split in microseconds (`"kernel_us"`, `"server_us"`, ...).

  Failures are values: `{:error, %ScanBridge.Error{reason: reason}}` with a typed `reason`
  (`:timeout`, `:server_exited`, `:shape_mismatch`, ...). Each call has a deadline (`:timeout`
  option, default 30 000 ms) kept by the client process. Inputs that cannot be sent, a
  `:timeout` included (it must be `:infinity` or an integer of ms in 0..2^32 - 1), raise
  `ArgumentError` in the calling process; the client process goes on serving the others.

  A call that times out is not taken back from the server, which may still carry it out: its
  late reply is dropped, a late `put/3`'s handle or `open_session/3`'s session is freed by the
  client as soon as that reply comes, and a timed-out `step/4` (or `scan/3` with `:session`)
  may still have advanced its session.

  ## Lanes

    * `transport: :port` (default): requests and replies travel through the Port's pipes
      (`{:packet, 4}`), even when `:args` open other lanes (`--unix`, `--zmq`) for other
      clients (the server is started with `--stdio`).
    * `transport: {:unix, path}`: the server is still spawned (and watched) as a Port, and
      told to listen on `path`; every request then goes over one unix-socket connection
      (`:gen_tcp`, `{:local, path}`, packet 4), cheaper than the pipes for big tensors
      (measured by `bench/roundtrip.exs`; the results are in the project's
      docs/performance.md, "elixir roundtrip").
      Sessions and handles belong to the connection that made them, which is why all
      requests share the one lane.

  ## Example

      iex> {:ok, server} = ScanBridge.start_link(args: ["--device", "cpu"])
      iex> ScanBridge.ping(server)
      :ok
      iex> f32 = fn values, shape -> ScanBridge.Tensor.from_list(values, :f32, shape) end
      iex> inputs = %{x: f32.([1.0, 2.0], {1, 2, 1}), dt: f32.([0.5, 0.5], {1, 2, 1}),
      ...>            A: f32.([-1.0], {1, 1}), B: f32.([1.0, 1.0], {1, 2, 1}),
      ...>            C: f32.([1.0, 1.0], {1, 2, 1})}
      iex> {:ok, %{y: y, state: nil}} = ScanBridge.scan(server, inputs)
      iex> y |> ScanBridge.Tensor.to_list() |> Enum.map(&Float.round(&1, 4))
      [0.5, 1.3033]
      iex> GenServer.stop(server)
      :ok
  """

  alias ScanBridge.{Error, Protocol, Server, Tensor}

  @default_timeout 30_000

  @type server :: GenServer.server()
  @typedoc "A tensor kept by the server (`put/2`); valid on the client that made it."
  @type handle :: {:handle, String.t()}
  @typedoc "A tensor: a `ScanBridge.Tensor`, or an `Nx.Tensor` when Nx is compiled in."
  @type tensor :: Tensor.t() | struct
  @type tensor_input :: tensor | handle
  @typedoc "Argument names (SPEC §6) to tensors, handles, booleans, numbers or strings/atoms."
  @type inputs :: %{
          optional(atom | String.t()) => tensor_input | boolean | number | atom | String.t() | nil
        }
  @type call_opts :: [timeout: timeout]
  @type timing :: %{optional(String.t()) => number}
  @type error :: {:error, Error.t()}

  @doc """
  Starts a client: spawns `python -m bridge` and returns once it answers a ping.

  Options:

    * `:python` - the interpreter (default: `$SCAN_BRIDGE_PYTHON`, else `python3` on PATH);
      the `bridge` package must be importable by it (see `:env`).
    * `:args` - extra server arguments, e.g. `["--device", "cuda"]`.
    * `:env` - environment for the server, `[{"PYTHONPATH", "/srv/scan-bridge"}]`; a `nil`
      value unsets a variable.
    * `:name` - register the client process under this name.
    * `:transport` - `:port` (default) or `{:unix, path}`; see "Lanes".
    * `:max_in_flight` - requests at the server at once (default 256); more wait in order. On
      the unix lane the server's own cap on one connection's requests in flight
      (`--max-in-flight-per-peer`, read from its `info`'s `limits` at start-up) caps it: the
      server leaves requests past it unread in the socket.
    * `:max_frame_size` - largest request body sent (default 256 MiB, the server's default
      limit), capped at start-up by the server's own limit (its `info`'s `limits`); a bigger
      one is answered `:frame_too_large` without being sent.
    * `:startup_timeout` - ms to wait for the server to answer (default 60 000).
    * `:exit_grace` - ms the server gets to exit after its stdin closes before it is killed
      (default 2 000).

  Returns `{:error, %ScanBridge.Error{reason: :startup_failed | :startup_timeout}}` when the
  server cannot be started. The client process then exits with that error, as a `GenServer`
  whose `init` fails does, so a caller linked to it exits too unless it traps exits (a
  supervisor does).
  """
  @spec start_link([Server.option()]) :: GenServer.on_start()
  defdelegate start_link(opts), to: Server

  @doc """
  A child specification, so that `{ScanBridge, opts}` can go in a supervisor's children. The
  id is the `:name` when given. The client is a permanent worker; it gets
  `ScanBridge.Server.stop_time_ms/1` to stop, 5 s with the default `:exit_grace` (it closes
  the server's stdin, waits for it to exit, and kills it after `:exit_grace`).
  """
  @spec child_spec([Server.option()]) :: Supervisor.child_spec()
  def child_spec(opts) do
    %{
      id: Keyword.get(opts, :name, __MODULE__),
      start: {__MODULE__, :start_link, [opts]},
      type: :worker,
      restart: :permanent,
      shutdown: Server.stop_time_ms(opts)
    }
  end

  @doc "Round trip to the server. `:ok` when it answers."
  @spec ping(server, call_opts) :: :ok | error
  def ping(server, opts \\ []) do
    with {:ok, _result, _timing} <- request(server, "ping", %{}, opts), do: :ok
  end

  @doc """
  The server's description: versions, `"protocol"` (with its `"ops"`), `"backend"`,
  `"devices"`, `"kernels"`, `"transports"`, `"limits"`.
  """
  @spec info(server, call_opts) :: {:ok, map} | error
  def info(server, opts \\ []) do
    with {:ok, result, _timing} <- request(server, "info", %{}, opts), do: {:ok, result}
  end

  @doc "The server's cumulative per-op counters and stage times."
  @spec stats(server, call_opts) :: {:ok, map} | error
  def stats(server, opts \\ []) do
    with {:ok, result, _timing} <- request(server, "stats", %{}, opts), do: {:ok, result}
  end

  @doc """
  The selective scan over a window (SPEC §6 `scan`).

  `inputs`: `:x`, `:dt`, `:A`, `:B`, `:C` (required tensors); `:D`, `:z`, `:dt_bias`, `:h0`
  (tensors); `:dt_softplus`, `:return_state` (booleans); `:dt_min`, `:dt_max` (numbers);
  `:layout` (`:bld`, the default, or `:bdl`); `:session` (a session id: the scan continues
  from and leaves its final state in that session); `:cu_seqlens` (an i32 or i64 tensor
  `[n + 1]` of the boundaries of n sequences packed along seq of a batch-1 input, each started
  from its own row of h0 or from zeros; not with `:session`). mamba_ssm's names are accepted:
  `:u`, `:delta`, `:delta_bias`, `:delta_softplus`, `:return_last_state`, `:initial_states`.

  Returns `y` (in x's dtype), `state` (`[batch, dim, state]` f32 with `return_state: true`,
  else nil; with `:cu_seqlens`, `[n, dim, state]`, one row per sequence) and the server's
  `timing`.
  """
  @spec scan(server, inputs, call_opts) ::
          {:ok, %{y: Tensor.t(), state: Tensor.t() | nil, timing: timing}} | error
  def scan(server, inputs, opts \\ []) do
    with {:ok, result, timing} <-
           request(server, "scan", Protocol.wire_args!(inputs, "scan"), opts),
         {:ok, y} <- result_tensor(result, "y"),
         {:ok, state} <- optional_result_tensor(result, "state") do
      {:ok, %{y: y, state: state, timing: timing}}
    end
  end

  @doc """
  The Mamba-2 (SSD) scan over a window (SPEC §6 `ssd_scan`, mamba_ssm's
  `mamba_chunk_scan_combined`).

  `inputs`: `:x` `[batch, seq, heads, headdim]`, `:dt` `[batch, seq, heads]`, `:A` `[heads]`,
  `:B`, `:C` `[batch, seq, groups, state]` (required; group g serves heads
  `g·heads/groups ..< (g + 1)·heads/groups`); `:D` (`[heads]` or `[heads, headdim]`), `:z` (x's
  shape), `:dt_bias` (`[heads]`), `:h0` (`[batch, heads, headdim, state]`) (tensors);
  `:dt_softplus`, `:return_state` (booleans); `:dt_min`, `:dt_max` (numbers) or `:dt_limit`
  (mamba_ssm's `[low, high]`, `:infinity` for an open side: `[0.0, :infinity]` clamps nothing);
  `:cu_seqlens` (packed sequences, as for `scan/3`); `:chunk_size` (tunes the chunked backends
  only); `:session` (a session opened with `kind: :ssd`, which the scan continues and leaves its
  final state in). mamba_ssm's names are accepted: `:initial_states`, `:return_last_state`,
  `:delta_softplus`, `:delta_bias`.

  Returns `y` (in x's dtype), `state` (`[batch, heads, headdim, state]` f32 with
  `return_state: true`, else nil; with `:cu_seqlens`, one row per sequence) and the server's
  `timing`.
  """
  @spec ssd_scan(server, inputs, call_opts) ::
          {:ok, %{y: Tensor.t(), state: Tensor.t() | nil, timing: timing}} | error
  def ssd_scan(server, inputs, opts \\ []) do
    with {:ok, result, timing} <-
           request(server, "ssd_scan", Protocol.wire_args!(inputs, "ssd_scan"), opts),
         {:ok, y} <- result_tensor(result, "y"),
         {:ok, state} <- optional_result_tensor(result, "state") do
      {:ok, %{y: y, state: state, timing: timing}}
    end
  end

  @doc "Like `scan/3`, raising `ScanBridge.Error` on failure."
  @spec scan!(server, inputs, call_opts) :: %{
          y: Tensor.t(),
          state: Tensor.t() | nil,
          timing: timing
        }
  def scan!(server, inputs, opts \\ []), do: ok!(scan(server, inputs, opts))

  @doc "Like `ssd_scan/3`, raising `ScanBridge.Error` on failure."
  @spec ssd_scan!(server, inputs, call_opts) :: %{
          y: Tensor.t(),
          state: Tensor.t() | nil,
          timing: timing
        }
  def ssd_scan!(server, inputs, opts \\ []), do: ok!(ssd_scan(server, inputs, opts))

  defp ok!({:ok, result}), do: result
  defp ok!({:error, error}), do: raise(error)

  @doc """
  One timestep against a session's state, which is updated in place on the server
  (SPEC §6 `step`). `inputs`: `:x`, `:dt`, `:A`, `:B`, `:C`, optionally `:z`, `:D`,
  `:dt_bias`, `:dt_softplus`, `:dt_min`, `:dt_max`, `:dt_limit`. For a session of `dim`: x, dt,
  z are `[batch, dim]`, B and C `[batch, state]` or `[batch, groups, state]`; returns `y`
  `[batch, dim]`. For a `kind: :ssd` session: x, z `[batch, heads, headdim]`, dt
  `[batch, heads]`, A `[heads]`, B and C `[batch, groups, state]`, D and dt_bias as for
  `ssd_scan/3`; returns `y` `[batch, heads, headdim]`. The session is the second argument only:
  `inputs` that name one too raise `ArgumentError`.

  A step that timed out (`{:error, %ScanBridge.Error{reason: :timeout}}`) may still have been
  done by the server, leaving the session one timestep further on; read it with
  `session_state/3` before going on when that matters.
  """
  @spec step(server, String.t(), inputs, call_opts) ::
          {:ok, %{y: Tensor.t(), timing: timing}} | error
  def step(server, session, inputs, opts \\ []) when is_binary(session) do
    args = Protocol.wire_args!(inputs, "step")

    if Map.has_key?(args, "session") do
      raise ArgumentError,
            "step inputs: expected no session (step/4 takes it as its second argument), got #{inspect(args["session"], limit: 5)}"
    end

    args = Map.put(args, "session", session)

    with {:ok, result, timing} <- request(server, "step", args, opts),
         {:ok, y} <- result_tensor(result, "y") do
      {:ok, %{y: y, timing: timing}}
    end
  end

  @doc """
  Opens a session: a `[batch, dim, state]` f32 state kept on the server's device, zero at
  first. `dims` is a map or keyword list with `:batch`, `:dim`, `:state` (Mamba-1, prefilled by
  `scan/3` with `:session`); or `kind: :ssd` with `:batch`, `:heads`, `:headdim`, `:state`
  (Mamba-2: a `[batch, heads, headdim, state]` state, prefilled by `ssd_scan/3` with
  `:session`). Both are stepped by `step/4`. Returns its id.

  The server checks `dims` (SPEC §6.1): a kind other than `:mamba` or `:ssd`, or a size of the
  other kind (`:dim` with `kind: :ssd`), is `{:error, %ScanBridge.Error{reason:
  :invalid_argument}}`, a missing size `:missing_argument`.
  """
  @spec open_session(server, map | keyword, call_opts) :: {:ok, String.t()} | error
  def open_session(server, dims, opts \\ []) do
    args = Protocol.wire_args!(session_dims!(dims), "open_session")

    with {:ok, result, _timing} <- request(server, "session_open", args, opts),
         do: result_string(result, "session")
  end

  defp session_dims!(dims) do
    cond do
      is_map(dims) ->
        dims

      is_list(dims) and Keyword.keyword?(dims) ->
        Map.new(dims)

      true ->
        raise ArgumentError,
              "open_session dims: expected a map or keyword list (batch:, dim:, state:, or " <>
                "kind: :ssd, batch:, heads:, headdim:, state:), got #{inspect(dims, limit: 5)}"
    end
  end

  @doc "Closes a session and frees its state."
  @spec close_session(server, String.t(), call_opts) :: :ok | error
  def close_session(server, session, opts \\ []) when is_binary(session) do
    with {:ok, _result, _timing} <- request(server, "session_close", %{session: session}, opts),
         do: :ok
  end

  @doc """
  A copy of a session's current state, f32: `[batch, dim, state]`, or `[batch, heads, headdim,
  state]` for a `kind: :ssd` session.
  """
  @spec session_state(server, String.t(), call_opts) :: {:ok, Tensor.t()} | error
  def session_state(server, session, opts \\ []) when is_binary(session) do
    with {:ok, result, _timing} <- request(server, "session_state", %{session: session}, opts),
         do: result_tensor(result, "state")
  end

  @doc """
  Keeps a tensor on the server; the returned handle can stand for it in later requests (e.g.
  weights sent once: `scan(server, %{A: handle, ...})`) until `free/2`.
  """
  @spec put(server, tensor, call_opts) :: {:ok, handle} | error
  def put(server, tensor, opts \\ []) do
    args = %{tensor: Tensor.cast!(tensor, "put tensor")}

    with {:ok, result, _timing} <- request(server, "put", args, opts),
         {:ok, id} <- result_string(result, "handle"),
         do: {:ok, {:handle, id}}
  end

  @doc "Frees a tensor kept by `put/2`."
  @spec free(server, handle, call_opts) :: :ok | error
  def free(server, {:handle, id}, opts \\ []) when is_binary(id) do
    with {:ok, _result, _timing} <- request(server, "free", %{handle: id}, opts), do: :ok
  end

  @doc "The OS pid of the server process this client runs."
  @spec os_pid(server) :: {:ok, pos_integer} | error
  defdelegate os_pid(server), to: Server

  ## Helpers

  defp request(server, op, args, opts) do
    Server.request(server, op, args, Keyword.get(opts, :timeout, @default_timeout))
  end

  defp result_tensor(result, key) do
    case Tensor.from_wire(Map.get(result, key)) do
      {:ok, tensor} -> {:ok, tensor}
      {:error, message} -> {:error, Error.client(:decode_error, "result #{key}: #{message}")}
    end
  end

  defp optional_result_tensor(result, key) do
    if Map.has_key?(result, key), do: result_tensor(result, key), else: {:ok, nil}
  end

  defp result_string(result, key) do
    case Map.get(result, key) do
      value when is_binary(value) and value != "" ->
        {:ok, value}

      other ->
        {:error,
         Error.client(:decode_error, "result #{key}: expected a str, got #{inspect(other)}")}
    end
  end
end
