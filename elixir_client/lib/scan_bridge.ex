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
  the same `step/4`. `scan_backward/3` and `ssd_scan_backward/3` give a scan's gradients (SPEC
  §6.5), for training on the client's side.

  Whole models (SPEC §6.4) run every layer of a Mamba or Mamba-2 stack on the server, each
  layer's state kept there, so that a frame is one round trip: `load_model/3` (a checkpoint
  path under the server's `--model-dir`, or a config and weights sent from here), sessions of
  it (`open_session(server, model: model, batch: b)`), `model_forward/4` over a window and
  `model_step/4` one frame at a time; `snapshot/3`, `restore/4` and `fork/3` roll a session
  back or branch it:

      {:ok, model} = ScanBridge.load_model(MyApp.Scan, "exphil/agent-v3", dtype: :bf16)
      {:ok, session} = ScanBridge.open_session(MyApp.Scan, model: model, batch: 1)
      {:ok, _logits} = ScanBridge.model_forward(MyApp.Scan, session, {:tokens, prefix})
      {:ok, snapshot} = ScanBridge.snapshot(MyApp.Scan, session)
      {:ok, logits} = ScanBridge.model_step(MyApp.Scan, session, {:tokens, frame})
      :ok = ScanBridge.restore(MyApp.Scan, session, snapshot)

  Many servers across the nodes of a BEAM cluster serve as one group: start each client with
  `group: name` and call the group from any node through `ScanBridge.Cluster` (least-loaded
  routing, sticky sessions that survive their server's death, models loaded on every member).

  Inputs are maps of the protocol's argument names (atoms; SPEC §6) to tensors
  (`ScanBridge.Tensor`, or `Nx.Tensor` when Nx is loaded), handles returned by `put/2`, and
  options (`dt_softplus: true`, `dt_min: 0.001`, `layout: :bdl`, ...). Every reply's `timing`
  is the server's time split in microseconds (`"kernel_us"`, `"server_us"`, ...).

  Failures are values: `{:error, %ScanBridge.Error{reason: reason}}` with a typed `reason`
  (`:timeout`, `:server_exited`, `:shape_mismatch`, ...). Each call has a deadline (`:timeout`
  option, default 30 000 ms) kept by the client process and, on a server that takes them
  (SPEC §4 `deadline_us`; its info lists the `cancel` op), by the server too: each request
  carries what is left of its deadline when it is sent, and the server answers one that could
  not start within it `:deadline_exceeded` without running it. Inputs that cannot be sent, a
  `:timeout` included (it must be `:infinity` or an integer of ms in 0..2^32 - 1), raise
  `ArgumentError` in the calling process; the client process goes on serving the others.

  A call that times out, or whose calling process exits before its answer, is cancelled: the
  client sends the server `cancel` (SPEC §6), which drops the request if it has not started
  (it is then answered `cancelled`, never run; on the unix lane cancels keep to the server's
  per-connection cap, so with a cap of 1 none is sent). One that has started runs to its end, so a
  timed-out call may still have been carried out: its late reply is dropped, a late `put/3`'s
  handle, `open_session/3`'s or `fork/3`'s session, `snapshot/3`'s snapshot or
  `load_model/3`'s model is freed by the client as soon as that reply comes, and a timed-out
  `step/4`, `model_step/4` or `model_forward/4` (or `scan/3` with `:session`) may still have
  advanced its session. Late replies never reach the caller.

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

  @typedoc "A client: its pid or name (`:name` of `start_link/1`), as `GenServer` takes them."
  @type server :: GenServer.server()
  @typedoc "A tensor kept by the server (`put/2`); valid on the client that made it."
  @type handle :: {:handle, String.t()}
  @typedoc "A tensor: a `ScanBridge.Tensor`, or an `Nx.Tensor` when Nx is compiled in."
  @type tensor :: Tensor.t() | struct
  @type tensor_input :: tensor | handle
  @typedoc """
  Argument names (SPEC §6) to tensors, handles, booleans, numbers, strings or atoms (sent as
  strings), `[low, high]` bounds (`:infinity`/`:neg_infinity` for an open side) or maps of
  names to tensors (a model session's saved `state:`).
  """
  @type inputs :: %{
          optional(atom | String.t()) =>
            tensor_input
            | boolean
            | number
            | atom
            | String.t()
            | nil
            | [number | :infinity | :neg_infinity]
            | %{optional(atom | String.t()) => tensor_input}
        }
  @typedoc "The options every call takes: its deadline in ms (default 30 000), or `:infinity`."
  @type call_opts :: [timeout: timeout]
  @typedoc "The server's time split of a request, in microseconds (`\"kernel_us\"`, ...)."
  @type timing :: %{optional(String.t()) => number}
  @type error :: {:error, Error.t()}
  @typedoc "What `scan/3` and `ssd_scan/3` return: `state` is nil without `return_state: true`."
  @type scan_result :: %{y: Tensor.t(), state: Tensor.t() | nil, timing: timing}
  @typedoc "What `step/4` returns: `state` is nil without `return_state: true`."
  @type step_result :: %{y: Tensor.t(), state: Tensor.t() | nil, timing: timing}
  @typedoc """
  A model session's state: every part by name (`"layers.<i>.conv"`, `"layers.<i>.ssm"`), as
  `session_state/3` returns it and `open_session/3` takes it back as `state:`.
  """
  @type model_state :: %{String.t() => Tensor.t()}
  @typedoc """
  What `model_forward/4` and `model_step/4` return: the output tensor; with `return_state: true`,
  `{output, state}`, the session's state after the call (nil from a server that sent none).
  """
  @type model_result :: Tensor.t() | {Tensor.t(), model_state | nil}

  @typedoc """
  The gradients `scan_backward/3` and `ssd_scan_backward/3` return: one per tensor input, named
  `d` + its name; `dD`, `dz`, `ddt_bias`, `dh0` are nil when D, z, dt_bias, h0 were not given.
  """
  @type gradients :: %{
          dx: Tensor.t(),
          ddt: Tensor.t(),
          dA: Tensor.t(),
          dB: Tensor.t(),
          dC: Tensor.t(),
          dD: Tensor.t() | nil,
          dz: Tensor.t() | nil,
          ddt_bias: Tensor.t() | nil,
          dh0: Tensor.t() | nil,
          timing: timing
        }

  # The `!` variants' unwrapping: a macro rather than a shared function, so that each `!`
  # function's result has its own type (dialyzer checks their specs against it).
  defmacrop ok!(call) do
    quote do
      case unquote(call) do
        {:ok, result} -> result
        {:error, error} -> raise error
      end
    end
  end

  @doc """
  Starts a client: spawns `python -m bridge` and returns once it answers a ping.

  Options:

    * `:python` - the interpreter, a path or a command name looked up on PATH (default:
      `$SCAN_BRIDGE_PYTHON`, else `python3` on PATH); the `bridge` package must be importable
      by it (see `:env`).
    * `:args` - extra server arguments, e.g. `["--device", "cuda"]`.
    * `:env` - environment for the server, `[{"PYTHONPATH", "/srv/scan-bridge"}]`; a `nil`
      value unsets a variable.
    * `:name` - register the client process under this name.
    * `:transport` - `:port` (default) or `{:unix, path}`; see "Lanes".
    * `:health_check` - `[interval: ms, timeout: ms]`: ask the server's `health` every
      `interval` ms once the last answer came; when an answer takes more than `timeout` ms, or
      says it is not ready, the client stops (`{:shutdown, {:unhealthy, why}}`, its callers
      answered `:server_exited`) and kills its server at once (no `:exit_grace`), for its
      supervisor to start a fresh one. A server whose work completed a launch within the last 5 s answers at once; one
      running a single longer request answers after it, so keep `timeout` above the longest
      request. Off by default.
    * `:group` - serve this group of a cluster (`ScanBridge.Cluster`): a name (atoms, strings,
      numbers, tuples and lists of them) callers on any node of the cluster reach it by. The
      server joins once it holds the group's models, after this returns
      (`ScanBridge.Cluster.await_members/3` waits for it).
    * `:max_in_flight` - requests at the server at once (default 256); more wait in order, and
      one whose deadline passes before it is sent is answered `:overloaded`. On
      the unix lane the server's own cap on one connection's requests in flight
      (`--max-in-flight-per-peer`, read from its `info`'s `limits` at start-up), less one,
      caps it: the server leaves requests past its cap unread in the socket, and the place
      left is for cancels and health checks, which keep to the cap itself (`ScanBridge.Server`).
    * `:max_frame_size` - largest request body sent (default 256 MiB, the server's default
      limit), capped at start-up by the server's own limit (its `info`'s `limits`) and by
      2^32 - 1 bytes, the most a frame's 4-byte length can say; a bigger one is answered
      `:frame_too_large` without being sent.
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
      id: opts |> keyword!("child_spec") |> Keyword.get(:name, __MODULE__),
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
  Whether the server can work (SPEC §6 `health`): `%{"live" => true, "ready" => bool,
  "device" => str, "checks" => %{"kernel" => %{"ok", "source", "age_ms", "latency_us"?},
  "accepting"}}`, ready when its device completed a launch within the last few seconds (its
  work's, `"source" => "work"`, or a tiny probe scan's, `"probe"`) and it is not stopping.
  """
  @spec health(server, call_opts) :: {:ok, map} | error
  def health(server, opts \\ []) do
    with {:ok, result, _timing} <- request(server, "health", %{}, opts), do: {:ok, result}
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

  Returns `y` (in x's dtype), `state` (`[batch, dim, state]` f32, f64 for f64 inputs without
  `:session`, with `return_state: true`, else nil; with `:cu_seqlens`, `[n, dim, state]`, one row per sequence) and the server's
  `timing`.
  """
  @spec scan(server, inputs, call_opts) :: {:ok, scan_result} | error
  def scan(server, inputs, opts \\ []) do
    with {:ok, result, timing} <-
           request(server, "scan", Protocol.wire_args!(inputs, "scan"), opts),
         do: scan_answer(result, timing)
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
  final state in). mamba_ssm's names are accepted: `:initial_states`, `:return_final_states`
  (and `:return_last_state`), `:delta_softplus`, `:delta_bias`, and its varlen arguments:
  `:seq_idx` (`[1, seq]`, each position's sequence index, never decreasing: the sequences it
  marks, beside or instead of `:cu_seqlens`) and `:return_varlen_states` (a state per packed
  sequence).

  Returns `y` (in x's dtype), `state` (`[batch, heads, headdim, state]` f32, f64 for f64 inputs
  without `:session`, with `return_state: true` or `return_varlen_states: true`, else nil; with `:cu_seqlens` or
  `:seq_idx`, one row per sequence) and the server's `timing`.
  """
  @spec ssd_scan(server, inputs, call_opts) :: {:ok, scan_result} | error
  def ssd_scan(server, inputs, opts \\ []) do
    with {:ok, result, timing} <-
           request(server, "ssd_scan", Protocol.wire_args!(inputs, "ssd_scan"), opts),
         do: scan_answer(result, timing)
  end

  # What scan/3, ssd_scan/3 and step/4 return, from the result of their op.
  defp scan_answer(result, timing) do
    with {:ok, y} <- result_tensor(result, "y"),
         {:ok, state} <- optional_result_tensor(result, "state") do
      {:ok, %{y: y, state: state, timing: timing}}
    end
  end

  @doc "Like `scan/3`, raising `ScanBridge.Error` on failure."
  @spec scan!(server, inputs, call_opts) :: scan_result
  def scan!(server, inputs, opts \\ []), do: ok!(scan(server, inputs, opts))

  @doc "Like `ssd_scan/3`, raising `ScanBridge.Error` on failure."
  @spec ssd_scan!(server, inputs, call_opts) :: scan_result
  def ssd_scan!(server, inputs, opts \\ []), do: ok!(ssd_scan(server, inputs, opts))

  @doc """
  The gradients of a `scan/3` (SPEC §6.5 `scan_backward`).

  `inputs`: `scan/3`'s (without `:session` and `:return_state`) plus `:dy`, the loss's gradient
  with respect to y (x's shape and layout), and optionally `:dstate`, its gradient with respect
  to the final state (`[batch, dim, state]`; with `:cu_seqlens`, `[n, dim, state]`).

  Returns `dx`, `ddt`, `dA`, `dB`, `dC`, and `dD`, `dz`, `ddt_bias`, `dh0` when D, z, dt_bias,
  h0 were given (else nil), each in its input's shape; `dA`, `dD`, `ddt_bias` are f32 (f64 for
  f64 x), the others in their inputs' dtypes. Where dt (after bias and softplus) lies outside
  `[dt_min, dt_max]`, `ddt` is 0.
  """
  @spec scan_backward(server, inputs, call_opts) :: {:ok, gradients} | error
  def scan_backward(server, inputs, opts \\ []) do
    with {:ok, result, timing} <-
           request(server, "scan_backward", Protocol.wire_args!(inputs, "scan_backward"), opts),
         do: gradients(result, timing)
  end

  @doc """
  The gradients of an `ssd_scan/3` (SPEC §6.5 `ssd_scan_backward`).

  `inputs`: `ssd_scan/3`'s (without `:session` and `:return_state`) plus `:dy` (x's shape,
  `[batch, seq, heads, headdim]`) and optionally `:dstate` (`[batch, heads, headdim, state]`).
  Returns the gradients as `scan_backward/3` does (a `[heads]` D gets a `[heads]` dD).
  """
  @spec ssd_scan_backward(server, inputs, call_opts) :: {:ok, gradients} | error
  def ssd_scan_backward(server, inputs, opts \\ []) do
    with {:ok, result, timing} <-
           request(
             server,
             "ssd_scan_backward",
             Protocol.wire_args!(inputs, "ssd_scan_backward"),
             opts
           ),
         do: gradients(result, timing)
  end

  @doc "Like `scan_backward/3`, raising `ScanBridge.Error` on failure."
  @spec scan_backward!(server, inputs, call_opts) :: gradients
  def scan_backward!(server, inputs, opts \\ []), do: ok!(scan_backward(server, inputs, opts))

  @doc "Like `ssd_scan_backward/3`, raising `ScanBridge.Error` on failure."
  @spec ssd_scan_backward!(server, inputs, call_opts) :: gradients
  def ssd_scan_backward!(server, inputs, opts \\ []),
    do: ok!(ssd_scan_backward(server, inputs, opts))

  # The reply's gradients: the required ones must be there, the optional ones nil when absent.
  @required_gradients [dx: "dx", ddt: "ddt", dA: "dA", dB: "dB", dC: "dC"]
  @optional_gradients [dD: "dD", dz: "dz", ddt_bias: "ddt_bias", dh0: "dh0"]

  defp gradients(result, timing) do
    required = for gradient <- @required_gradients, do: {gradient, &result_tensor/2}
    optional = for gradient <- @optional_gradients, do: {gradient, &optional_result_tensor/2}

    Enum.reduce_while(required ++ optional, {:ok, %{timing: timing}}, fn
      {{key, name}, read}, {:ok, acc} ->
        case read.(result, name) do
          {:ok, tensor} -> {:cont, {:ok, Map.put(acc, key, tensor)}}
          error -> {:halt, error}
        end
    end)
  end

  @doc """
  One timestep against a session's state, which is updated in place on the server
  (SPEC §6 `step`). `inputs`: `:x`, `:dt`, `:A`, `:B`, `:C`, optionally `:z`, `:D`,
  `:dt_bias`, `:dt_softplus`, `:dt_min`, `:dt_max`, `:dt_limit`. For a session of `dim`: x, dt,
  z are `[batch, dim]`, B and C `[batch, state]` or `[batch, groups, state]`; returns `y`
  `[batch, dim]`. For a `kind: :ssd` session: x, z `[batch, heads, headdim]`, dt
  `[batch, heads]`, A `[heads]`, B and C `[batch, groups, state]`, D and dt_bias as for
  `ssd_scan/3`; returns `y` `[batch, heads, headdim]`. The session is the second argument only:
  `inputs` that name one too raise `ArgumentError`.

  With `return_state: true` in `inputs` (as for `scan/3`), `state` is the session's state after
  this step, f32, exactly what `session_state/3` would return right after, without its round
  trip; else nil.

  A step that timed out (`{:error, %ScanBridge.Error{reason: :timeout}}`) may still have been
  done by the server, leaving the session one timestep further on; read it with
  `session_state/3` before going on when that matters.
  """
  @spec step(server, String.t(), inputs, call_opts) :: {:ok, step_result} | error
  def step(server, session, inputs, opts \\ []) do
    session = id!(session, "step session")

    args =
      inputs
      |> Protocol.wire_args!("step")
      |> no_session!("step", "step/4 takes it as its second argument")

    with {:ok, result, timing} <- request(server, "step", Map.put(args, "session", session), opts),
         do: scan_answer(result, timing)
  end

  defp no_session!(args, op, why) do
    if Map.has_key?(args, "session") do
      raise ArgumentError,
            "#{op} inputs: expected no session (#{why}), got #{inspect(args["session"], limit: 5)}"
    end

    args
  end

  @doc """
  Opens a session: a `[batch, dim, state]` f32 state kept on the server's device, zero at
  first. `dims` is a map or keyword list with `:batch`, `:dim`, `:state` (Mamba-1, prefilled by
  `scan/3` with `:session`); or `kind: :ssd` with `:batch`, `:heads`, `:headdim`, `:state`
  (Mamba-2: a `[batch, heads, headdim, state]` state, prefilled by `ssd_scan/3` with
  `:session`). Both are stepped by `step/4`. Returns its id.

  A model's session (SPEC §6.4): `model:` (the id `load_model/3` returned, its info's
  `"model"`, or that info map itself) and `:batch`, no sizes (the model's layers fix them):
  every layer's conv window and ssm state for each row, zero; or, with `state:`, the map
  `session_state/3` returned for a session of that model and batch (names to tensors).
  Stepped by `model_step/4`, prefilled by `model_forward/4`.

      {:ok, session} = ScanBridge.open_session(server, model: model, batch: 2)
      {:ok, copy} = ScanBridge.open_session(server, model: model, batch: 2, state: saved)

  The server checks `dims` (SPEC §6.1): a kind other than `:mamba` or `:ssd`, or a size of the
  other kind (`:dim` with `kind: :ssd`, any size with `:model`), is `{:error,
  %ScanBridge.Error{reason: :invalid_argument}}`, a missing size `:missing_argument`, a model
  this client did not load `:unknown_model`, and a saved state of another shape
  `:shape_mismatch`.
  """
  @spec open_session(server, map | keyword, call_opts) :: {:ok, String.t()} | error
  def open_session(server, dims, opts \\ []) do
    args = dims |> session_dims!() |> session_model!() |> Protocol.wire_args!("open_session")

    with {:ok, result, _timing} <- request(server, "session_open", args, opts),
         do: result_string(result, "session")
  end

  @doc """
  Opens a session as `open_session/3` does and runs `frames` on it in the same request (SPEC
  §6.1 `session_open`'s `frames`): what a client that reopens a session elsewhere from a saved
  state does with the frames answered since, and the one in flight, in one round trip.

  Each frame is `{call, input}` or `{call, input, opts}`: `call` one of `:step`, `:scan`,
  `:ssd_scan`, `:model_step`, `:model_forward`, and `input` and `opts` what that function takes
  after its session (`scan/3`'s and `ssd_scan/3`'s inputs without `:session`; `opts` only the
  model calls' `:output`, `:last_only`, `:lengths`, `:return_state`, and `model_step/4`'s
  `:snapshot_into`). Returns the session's id and each frame's result, in order, as that
  function returns it (their `timing`, the request's).

  A frame that fails fails the call with its own error, its field named
  `args.frames[i].args.<name>` and `detail["frame"]` i, and leaves no session open. A server
  from before frames refuses them (`:invalid_argument`, field `args.frames`) and opens nothing.
  """
  @spec open_session_with_frames(server, map | keyword, [frame], call_opts) ::
          {:ok, String.t(), [term]} | error
  def open_session_with_frames(server, dims, frames, opts \\ []) do
    args = dims |> session_dims!() |> session_model!() |> Protocol.wire_args!("open_session")
    {sent, calls} = frames_arg!(frames, "open_session_with_frames")
    args = Map.put(args, "frames", sent)

    with {:ok, result, timing} <- request(server, "session_open", args, opts),
         {:ok, session} <- result_string(result, "session"),
         {:ok, results} <- frame_results(Map.get(result, "frames"), calls, timing),
         do: {:ok, session, results}
  end

  @doc false
  # `frames` as a request carries them (session_open's and session_restore's "frames"), and each
  # one's call (frame!/1). Raises ArgumentError for frames that cannot be sent.
  @spec frames_arg!(term, String.t()) :: {[map], [{String.t(), map, function}]}
  def frames_arg!(frames, what) do
    calls = frames |> frames!(what) |> Enum.map(&frame!/1)
    {Enum.map(calls, fn {op, args, _answer} -> %{"op" => op, "args" => args} end), calls}
  end

  # A frame: its op, its arguments (no session: the frame's is the one being opened) and how
  # its result reads, as the call's own function reads it.
  defp frame!({call, input}), do: frame!({call, input, []})

  defp frame!({call, inputs, []}) when call in [:step, :scan, :ssd_scan] do
    op = Atom.to_string(call)
    args = inputs |> Protocol.wire_args!(op) |> no_session!(op, "a frame's is the call's session")
    {op, args, &scan_answer/2}
  end

  defp frame!({call, input, opts}) when call in [:model_step, :model_forward] do
    op = Atom.to_string(call)

    allowed =
      if call == :model_step,
        do: [:output, :return_state, :snapshot_into],
        else: [:output, :last_only, :lengths, :return_state]

    opts = opts!(opts, allowed, op)
    return_state = Keyword.get(opts, :return_state, false)

    {op, model_frame_args!(input, opts, op),
     fn result, _timing -> model_answer(result, return_state) end}
  end

  defp frame!(other) do
    raise ArgumentError,
          "frame: expected {call, input} or {call, input, opts} with call " <>
            ":step, :scan, :ssd_scan (no opts), :model_step or :model_forward, got #{inspect(other, limit: 5)}"
  end

  defp frame_results(results, calls, timing)
       when is_list(results) and length(results) == length(calls) do
    results
    |> Enum.zip(calls)
    |> Enum.reduce_while({:ok, []}, fn
      {%{} = result, {_op, _args, answer}}, {:ok, acc} ->
        case answer.(result, timing) do
          {:ok, value} -> {:cont, {:ok, [value | acc]}}
          error -> {:halt, error}
        end

      {other, {op, _args, _answer}}, _acc ->
        {:halt,
         {:error,
          Error.client(
            :decode_error,
            "result frames: expected #{op}'s result map, got #{inspect(other, limit: 5)}"
          )}}
    end)
    |> case do
      {:ok, values} -> {:ok, Enum.reverse(values)}
      error -> error
    end
  end

  defp frame_results(results, calls, _timing) do
    {:error,
     Error.client(
       :decode_error,
       "result frames: expected a list of #{length(calls)} results, got #{inspect(results, limit: 5)}"
     )}
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
                "kind: :ssd, batch:, heads:, headdim:, state:, or model:, batch:), got " <>
                inspect(dims, limit: 5)
    end
  end

  # A model given as load_model's info map is sent as its id.
  defp session_model!(dims) do
    Map.new(dims, fn
      {name, model} when name in [:model, "model"] and not is_nil(model) ->
        {name, model_id!(model, "open_session model")}

      entry ->
        entry
    end)
  end

  @doc "Closes a session and frees its state."
  @spec close_session(server, String.t(), call_opts) :: :ok | error
  def close_session(server, session, opts \\ []) do
    args = %{session: id!(session, "close_session session")}
    with {:ok, _result, _timing} <- request(server, "session_close", args, opts), do: :ok
  end

  @doc """
  A copy of a session's current state, f32: `[batch, dim, state]`, or `[batch, heads, headdim,
  state]` for a `kind: :ssd` session. For a model's session, a map of every part by name:
  `"layers.<i>.conv"` (`[batch, conv channels, d_conv]`, the last d_conv conv inputs, newest
  last) and `"layers.<i>.ssm"` (`[batch, d_inner, state]`, or `[batch, heads, headdim, state]`
  for Mamba-2), which `open_session/3` takes back as `state:`.
  """
  @spec session_state(server, String.t(), call_opts) :: {:ok, Tensor.t() | model_state} | error
  def session_state(server, session, opts \\ []) do
    args = %{session: id!(session, "session_state session")}

    with {:ok, result, _timing} <- request(server, "session_state", args, opts),
         do: result_state(result)
  end

  # A reply's state: a model session's parts by name, or a plain session's tensor.
  defp result_state(result) do
    case Map.get(result, "state") do
      # a tensor map has its dtype code there
      %{} = parts when not is_map_key(parts, "dtype") -> result_tensors(parts, "state")
      _tensor -> result_tensor(result, "state")
    end
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
  def free(server, handle, opts \\ []) do
    id =
      case handle do
        {:handle, id} ->
          id!(id, "free handle")

        other ->
          raise ArgumentError,
                "free handle: expected {:handle, id} as put/2 gives it, got #{inspect(other, limit: 5)}"
      end

    with {:ok, _result, _timing} <- request(server, "free", %{handle: id}, opts), do: :ok
  end

  ## Whole models (SPEC §6.4)

  @typedoc """
  Where `load_model/3` takes a model from: a checkpoint directory under one of the server's
  `--model-dir`s (a relative path is taken under the first), or a config and weights this
  client holds.
  """
  @type model_source ::
          Path.t() | %{config: map, weights: %{optional(atom | String.t()) => tensor_input}}
  @typedoc "A model's id (`load_model/3`'s info `\"model\"`), or that info map itself."
  @type model :: String.t() | %{String.t() => term}
  @typedoc """
  One of `open_session_with_frames/4`'s or `restore_with_frames/5`'s frames: a call that
  advances the session and what it takes after its session.
  """
  @type frame ::
          {:step | :scan | :ssd_scan, inputs}
          | {:model_step | :model_forward, model_input}
          | {:model_step | :model_forward, model_input, keyword}
  @typedoc "`load_model/3`'s options."
  @type load_opts :: [dtype: :f32 | :bf16 | :f16 | String.t(), name: String.t(), timeout: timeout]
  @typedoc "What a model op answers with: logits (the default with a head) or hidden states."
  @type model_output :: :logits | :hidden | String.t()
  @typedoc "`model_forward/4`'s options."
  @type model_forward_opts :: [
          output: model_output,
          last_only: boolean,
          return_state: boolean,
          lengths: [non_neg_integer] | tensor_input,
          timeout: timeout
        ]
  @typedoc "`model_step/4`'s options."
  @type model_step_opts :: [
          output: model_output,
          return_state: boolean,
          snapshot_into: String.t(),
          timeout: timeout
        ]
  @typedoc "A model's input: token ids (an integer tensor) or embeddings (a float tensor)."
  @type model_input ::
          {:tokens, tensor_input}
          | {:embeds, tensor_input}
          | %{required(:tokens) => tensor_input}
          | %{required(:embeds) => tensor_input}

  @doc """
  Loads a Mamba (`"mamba"`) or Mamba-2 (`"mamba2"`) stack on the server (SPEC §6.4
  `model_load`), so that a frame through every layer is one round trip and every layer's state
  stays there. It belongs to this client (its connection) until `free_model/3`.

  `source` is either

    * a path (a string): a checkpoint directory under one of the directories the server was
      started with (`args: ["--model-dir", dir]`; a relative path is taken under the first),
      holding `config.json` and `model.safetensors` (or an index and its shards, or
      `pytorch_model.bin`), saved by transformers or mamba_ssm. Without `--model-dir`, or for a
      path outside those directories: `:path_not_allowed`.
    * `%{config: config, weights: weights}`: a model this client holds. `config` is a map of
      transformers', mamba_ssm's or the server's own keys, e.g. a backbone
      `%{"arch" => "mamba2", "d_model" => 256, "n_layer" => 4, "d_state" => 64,
      "d_conv" => 4, "expand" => 2, "headdim" => 64, "ngroups" => 1}` (with `"vocab_size"`
      it has an embedding and a tied head; without, it takes embeddings in and gives hidden
      states out). `weights` maps each tensor's name (`"layers.0.mixer.in_proj.weight"`, ...,
      `"norm_f.weight"`, as either library names them, with or without `backbone.`) to a
      tensor or a `{:handle, id}` from `put/3`.

  Options: `:dtype` (`:f32`, the default, `:bf16` or `:f16`, or their strings: what the weights
  are kept in; the state is always f32), `:name` (a string the server reports back),
  `:timeout`.

  Returns the model's description: `"model"` (its id), `"arch"`, `"layers"`, `"d_model"`,
  `"vocab_size"` (with an embedding), `"outputs"`, `"state_bytes_per_row"`,
  `"weight_bytes"`, `"dtype"` (as `:dtype`'s strings: `"f32"`, `"bf16"` or `"f16"`), `"name"`.
  A config or weights the server cannot use (a tensor missing, mis-shaped, unexpected or not
  finite; an unknown architecture or setting) is `:invalid_checkpoint`, its `detail["field"]`
  naming the key or tensor (e.g. `"args.weights.norm_f.weight"`).
  """
  @spec load_model(server, model_source, load_opts) :: {:ok, map} | error
  def load_model(server, source, opts \\ []) do
    opts = opts!(opts, [:dtype, :name, :timeout], "load_model")
    args = model_load_args!(source, opts)

    with {:ok, result, _timing} <- checked_request(server, "model_load", args, opts),
         {:ok, _id} <- result_string(result, "model"),
         do: {:ok, result}
  end

  @doc "Like `load_model/3`, raising `ScanBridge.Error` on failure."
  @spec load_model!(server, model_source, load_opts) :: map
  def load_model!(server, source, opts \\ []), do: ok!(load_model(server, source, opts))

  @doc false
  # The model_load arguments of a source and options, raising ArgumentError for bad ones.
  @spec model_load_args!(model_source, load_opts) :: %{String.t() => term}
  def model_load_args!(source, opts), do: Map.merge(model_source!(source), load_options!(opts))

  defp model_source!(path) when is_binary(path) and path != "", do: %{"path" => path}

  defp model_source!(%{config: config, weights: weights} = source) when map_size(source) == 2 do
    %{
      "config" => Protocol.wire_config!(config, "load_model config"),
      "weights" => Protocol.wire_tensors!(weights, "load_model weights")
    }
  end

  defp model_source!(other) do
    raise ArgumentError,
          "load_model source: expected a checkpoint path (a non-empty string) or " <>
            "%{config: map, weights: %{name => tensor}}, got #{inspect(other, limit: 5)}"
  end

  @weights_dtypes ~w(f32 bf16 f16)

  defp load_options!(opts) do
    Enum.reduce(opts, %{}, fn
      {:dtype, dtype}, args when dtype in [:f32, :bf16, :f16] ->
        Map.put(args, "dtype", Atom.to_string(dtype))

      {:dtype, dtype}, args when dtype in @weights_dtypes ->
        Map.put(args, "dtype", dtype)

      {:dtype, other}, _args ->
        raise ArgumentError,
              "load_model :dtype: expected :f32, :bf16 or :f16, got #{inspect(other)}"

      {:name, name}, args when is_binary(name) and name != "" ->
        Map.put(args, "name", name)

      {:name, other}, _args ->
        raise ArgumentError, "load_model :name: expected a non-empty string, got #{inspect(other)}"

      {:timeout, _}, args ->
        args
    end)
  end

  @doc """
  Frees a model `load_model/3` loaded, and the snapshots of its sessions. A model with
  sessions still open is refused (`:invalid_argument`): close them first.
  """
  @spec free_model(server, model, call_opts) :: :ok | error
  def free_model(server, model, opts \\ []) do
    args = %{model: model_id!(model, "free_model model")}
    with {:ok, _result, _timing} <- request(server, "model_free", args, opts), do: :ok
  end

  @doc """
  Runs a window through a model's session (SPEC §6.4 `model_forward`): a prefill through every
  layer starting from the session's state and leaving it at the end, so it also re-simulates
  frames after a `restore/4`.

  `input`: `{:tokens, ids}` (an i64, i32 or u8 tensor `[batch, seq]` of ids below the model's
  vocabulary) or `{:embeds, x}` (a float tensor `[batch, seq, d_model]`), or a map with one of
  `:tokens` and `:embeds`; a `{:handle, id}` may stand for the tensor. `batch` is the
  session's (else `:shape_mismatch`).

  Options: `:output`, `:logits` (`[batch, seq, vocab]`, the default for a model with a head) or
  `:hidden` (`[batch, seq, d_model]`, after the final norm; the default and the only output of a
  backbone, which answers `:logits` with `:invalid_argument`), or their strings;
  `:last_only` (`true`: only the last position, `[batch, 1, ...]`); `:lengths` (one
  non-negative integer a row, at most `seq`, as a list or an integer tensor: row i runs only its
  first `lengths[i]` positions, its state left after them, its outputs past them zero; with
  `:last_only`, its own last position); `:return_state` (see below); `:timeout`.

  Returns the output tensor, f32. With `return_state: true`, `{output, state}`: `state` is the
  session's state after the window, every part by name as `session_state/3` returns it (and
  exactly what it would return right after), without that call's round trip.
  """
  @spec model_forward(server, String.t(), model_input, model_forward_opts) ::
          {:ok, model_result} | error
  def model_forward(server, session, input, opts \\ []) do
    opts = opts!(opts, [:output, :last_only, :return_state, :lengths, :timeout], "model_forward")
    args = model_args!(session, input, opts, "model_forward")

    with {:ok, result, _timing} <- checked_request(server, "model_forward", args, opts),
         do: model_answer(result, Keyword.get(opts, :return_state, false))
  end

  @doc "Like `model_forward/4`, raising `ScanBridge.Error` on failure."
  @spec model_forward!(server, String.t(), model_input, model_forward_opts) :: model_result
  def model_forward!(server, session, input, opts \\ []),
    do: ok!(model_forward(server, session, input, opts))

  @doc """
  One frame through a model's session (SPEC §6.4 `model_step`), its every layer's state
  updated in place on the server. `input` as for `model_forward/4` without the seq axis:
  `{:tokens, ids}` `[batch]` or `{:embeds, x}` `[batch, d_model]`. Options: `:output`,
  `:return_state`, `:snapshot_into`, `:timeout`. Returns `[batch, vocab]` logits or
  `[batch, d_model]` hidden states, f32; with `return_state: true`, `{output, state}` as for
  `model_forward/4`, the state after this frame (a checkpoint without a `session_state/3`
  round trip). With `snapshot_into: snapshot` (an id from `snapshot/2` of this session or one
  like it), that snapshot first takes the state as it is before this frame, in the same round
  trip: a ring of snapshots for rollback kept at one request a frame.

  Steps of sessions of one model (the same input kind and dtype, the same output) from any
  callers share one pass through the stack on the server. A step that timed out may still
  have been done, as for `step/4`.
  """
  @spec model_step(server, String.t(), model_input, model_step_opts) ::
          {:ok, model_result} | error
  def model_step(server, session, input, opts \\ []) do
    opts = opts!(opts, [:output, :return_state, :snapshot_into, :timeout], "model_step")
    args = model_args!(session, input, opts, "model_step")

    with {:ok, result, _timing} <- checked_request(server, "model_step", args, opts),
         do: model_answer(result, Keyword.get(opts, :return_state, false))
  end

  @doc "Like `model_step/4`, raising `ScanBridge.Error` on failure."
  @spec model_step!(server, String.t(), model_input, model_step_opts) :: model_result
  def model_step!(server, session, input, opts \\ []),
    do: ok!(model_step(server, session, input, opts))

  defp model_args!(session, input, opts, op),
    do: input |> model_frame_args!(opts, op) |> Map.put("session", id!(session, "#{op} session"))

  # A model op's arguments but its session.
  defp model_frame_args!(input, opts, op) do
    {name, value} = model_input!(input, op)
    args = %{name => tensor_arg!(value, "#{op} #{name}")}

    Enum.reduce(opts, args, fn
      {:output, output}, args when output in [:logits, :hidden] ->
        Map.put(args, "output", Atom.to_string(output))

      {:output, output}, args when output in ["logits", "hidden"] ->
        Map.put(args, "output", output)

      {:output, other}, _args ->
        raise ArgumentError, "#{op} :output: expected :logits or :hidden, got #{inspect(other)}"

      {:last_only, last_only}, args when is_boolean(last_only) ->
        Map.put(args, "last_only", last_only)

      {:last_only, other}, _args ->
        raise ArgumentError, "#{op} :last_only: expected a boolean, got #{inspect(other)}"

      {:return_state, return_state}, args when is_boolean(return_state) ->
        Map.put(args, "return_state", return_state)

      {:return_state, other}, _args ->
        raise ArgumentError, "#{op} :return_state: expected a boolean, got #{inspect(other)}"

      {:snapshot_into, snapshot}, args ->
        Map.put(args, "snapshot_into", id!(snapshot, "#{op} :snapshot_into"))

      {:lengths, lengths}, args ->
        Map.put(args, "lengths", lengths_arg!(lengths, op))

      {:timeout, _}, args ->
        args
    end)
  end

  # A list of non-negative integers becomes an i32 tensor; a tensor goes as it is.
  defp lengths_arg!(lengths, op) when is_list(lengths) do
    # An improper list first: Enum would raise FunctionClauseError on it (a cluster session's
    # keeper, which makes the call, lives through an ArgumentError only).
    if List.improper?(lengths) or not Enum.all?(lengths, &(is_integer(&1) and &1 >= 0)) do
      raise ArgumentError,
            "#{op} :lengths: expected non-negative integers, got #{inspect(lengths, limit: 5)}"
    end

    Tensor.from_list(lengths, :i32, {length(lengths)})
  end

  defp lengths_arg!(lengths, op), do: tensor_arg!(lengths, "#{op} :lengths")

  defp model_input!({name, value}, _op) when name in [:tokens, :embeds],
    do: {Atom.to_string(name), value}

  defp model_input!(%{} = input, op) when not is_struct(input) do
    case Map.to_list(input) do
      [{name, value}] when name in [:tokens, :embeds] -> model_input!({name, value}, op)
      _ -> model_input!(:not_one, op, input)
    end
  end

  defp model_input!(input, op), do: model_input!(:not_one, op, input)

  defp model_input!(:not_one, op, input) do
    raise ArgumentError,
          "#{op} input: expected {:tokens, tensor} or {:embeds, tensor} (or a map with one of " <>
            ":tokens and :embeds), got #{inspect(input, limit: 5)}"
  end

  defp tensor_arg!({:handle, id}, _what) when is_binary(id), do: %{handle: id}
  defp tensor_arg!(value, what), do: Tensor.cast!(value, what)

  # A model op's answer: its output, and with return_state the state beside it.
  defp model_answer(result, false), do: model_output(result)

  defp model_answer(result, true) do
    with {:ok, output} <- model_output(result),
         {:ok, state} <- optional_result_state(result),
         do: {:ok, {output, state}}
  end

  defp optional_result_state(result) do
    if Map.has_key?(result, "state"), do: result_state(result), else: {:ok, nil}
  end

  # The one output a model op answers with: "logits" or "hidden" (beside a state it asked for).
  defp model_output(result) do
    case result |> Map.delete("state") |> Map.keys() do
      [key] when key in ["logits", "hidden"] ->
        result_tensor(result, key)

      _ ->
        {:error,
         Error.client(
           :decode_error,
           "result: expected one of logits and hidden, got #{inspect(result, limit: 5)}"
         )}
    end
  end

  @doc """
  A copy of every part of a session's state, kept on the server's device (SPEC §6.4
  `session_snapshot`); its id, for `restore/4`, until `free_snapshot/3` (or `free_model/3`,
  or the client's end). Works on plain sessions too.
  """
  @spec snapshot(server, String.t(), call_opts) :: {:ok, String.t()} | error
  def snapshot(server, session, opts \\ []) do
    args = %{session: id!(session, "snapshot session")}

    with {:ok, result, _timing} <- request(server, "session_snapshot", args, opts),
         do: result_string(result, "snapshot")
  end

  @doc "Like `snapshot/3`, raising `ScanBridge.Error` on failure."
  @spec snapshot!(server, String.t(), call_opts) :: String.t()
  def snapshot!(server, session, opts \\ []), do: ok!(snapshot(server, session, opts))

  @doc """
  Puts a snapshot back (SPEC §6.4 `session_restore`): into the session it was taken of, or any
  session of the same model (or state shape) and batch, a fork say (else `:invalid_argument`).
  The snapshot stays, for restoring again.
  """
  @spec restore(server, String.t(), String.t(), call_opts) :: :ok | error
  def restore(server, session, snapshot, opts \\ []) do
    args = %{
      session: id!(session, "restore session"),
      snapshot: id!(snapshot, "restore snapshot")
    }

    with {:ok, _result, _timing} <- request(server, "session_restore", args, opts), do: :ok
  end

  @doc """
  Puts a snapshot back as `restore/4` does and runs `frames` on the session in the same request
  (SPEC §6.4 `session_restore`'s `frames`): a rollback and its re-simulation, restore frame N's
  state and run the frames since with their corrected inputs, in one round trip. Frames are
  `open_session_with_frames/4`'s; returns each one's result, in order, as that function does.

  A `:model_step` frame's `snapshot_into: id` refreshes a rollback ring as the re-simulation
  runs: that snapshot takes the corrected state before the frame (not the snapshot restored:
  `:invalid_argument`, nothing done).

  A frame that fails fails the call with its own error, its field named
  `args.frames[i].args.<name>` and `detail["frame"]` i, and leaves the session holding the
  snapshot's state, as `restore/4` would. The snapshot stays either way; one a frame copied
  into is left undefined (a restore from it is `:state_lost` until a step copies into it
  again). A server from before these frames refuses them (`:invalid_argument`, field
  `args.frames`) and restores nothing; one from before `:snapshot_into` in them refuses that
  (field `args.frames[i].args.snapshot_into`) and runs nothing.
  """
  @spec restore_with_frames(server, String.t(), String.t(), [frame], call_opts) ::
          {:ok, [term]} | error
  def restore_with_frames(server, session, snapshot, frames, opts \\ []) do
    {sent, calls} = frames_arg!(frames, "restore_with_frames")

    args = %{
      session: id!(session, "restore_with_frames session"),
      snapshot: id!(snapshot, "restore_with_frames snapshot"),
      frames: sent
    }

    with {:ok, result, timing} <- request(server, "session_restore", args, opts),
         do: frame_results(Map.get(result, "frames"), calls, timing)
  end

  @doc """
  A new session of the same model (or kind) and batch holding a copy of the session's state
  (SPEC §6.4 `session_fork`), stepped independently; its id. Close it with `close_session/3`.
  """
  @spec fork(server, String.t(), call_opts) :: {:ok, String.t()} | error
  def fork(server, session, opts \\ []) do
    args = %{session: id!(session, "fork session")}

    with {:ok, result, _timing} <- request(server, "session_fork", args, opts),
         do: result_string(result, "session")
  end

  @doc "Like `fork/3`, raising `ScanBridge.Error` on failure."
  @spec fork!(server, String.t(), call_opts) :: String.t()
  def fork!(server, session, opts \\ []), do: ok!(fork(server, session, opts))

  @doc "Frees a snapshot `snapshot/3` took."
  @spec free_snapshot(server, String.t(), call_opts) :: :ok | error
  def free_snapshot(server, snapshot, opts \\ []) do
    args = %{snapshot: id!(snapshot, "free_snapshot snapshot")}
    with {:ok, _result, _timing} <- request(server, "snapshot_free", args, opts), do: :ok
  end

  @doc "The OS pid of the server process this client runs."
  @spec os_pid(server) :: {:ok, pos_integer} | error
  defdelegate os_pid(server), to: Server

  ## Helpers

  # A plain call's request: its options are :timeout alone, and any other is refused (a
  # misspelt `timout:` would otherwise run with the default).
  defp request(server, op, args, opts) do
    checked_request(server, op, args, opts!(opts, [:timeout], op))
  end

  # The request of a call that checked its own options beside :timeout (opts!/3).
  defp checked_request(server, op, args, opts) do
    Server.request(server, op, args, Keyword.get(opts, :timeout, @default_timeout))
  end

  # An improper list first: Enum would raise FunctionClauseError on it.
  @doc false
  def frames!(frames, what) when is_list(frames) do
    if List.improper?(frames) do
      raise ArgumentError, "#{what} frames: expected a list of frames, got an improper list"
    end

    frames
  end

  def frames!(other, what),
    do:
      raise(
        ArgumentError,
        "#{what} frames: expected a list of frames, got #{inspect(other, limit: 5)}"
      )

  defp result_tensor(result, key) do
    case Tensor.from_wire(Map.get(result, key)) do
      {:ok, tensor} -> {:ok, tensor}
      {:error, message} -> {:error, Error.client(:decode_error, "result #{key}: #{message}")}
    end
  end

  defp result_tensors(%{} = tensors, key) do
    Enum.reduce_while(tensors, {:ok, %{}}, fn {name, wire}, {:ok, acc} ->
      case Tensor.from_wire(wire) do
        {:ok, tensor} ->
          {:cont, {:ok, Map.put(acc, name, tensor)}}

        {:error, message} ->
          {:halt, {:error, Error.client(:decode_error, "result #{key}.#{name}: #{message}")}}
      end
    end)
  end

  # A session, snapshot or model id given to the public API.
  defp id!(id, _what) when is_binary(id) and id != "", do: id

  defp id!(other, what),
    do:
      raise(
        ArgumentError,
        "#{what}: expected an id (a non-empty string), got #{inspect(other, limit: 5)}"
      )

  @doc false
  # A call's options, any keys: a keyword list, or ArgumentError naming `fun`.
  @spec keyword!(term, String.t()) :: keyword
  def keyword!(opts, fun) do
    unless is_list(opts) and Keyword.keyword?(opts) do
      raise ArgumentError, "#{fun} options: expected a keyword list, got #{inspect(opts, limit: 5)}"
    end

    opts
  end

  defp model_id!(%{"model" => id}, what), do: id!(id, what)
  defp model_id!(id, what) when is_binary(id) and id != "", do: id!(id, what)

  defp model_id!(other, what) do
    raise ArgumentError,
          "#{what}: expected a model id (a non-empty string) or load_model/3's info map, got " <>
            inspect(other, limit: 5)
  end

  @doc false
  # The options of a call that takes more than :timeout: a keyword list of `known` keys.
  @spec opts!(term, [atom], String.t()) :: keyword
  def opts!(opts, known, fun) do
    case Keyword.keys(keyword!(opts, fun)) -- known do
      [] ->
        opts

      unknown ->
        raise ArgumentError,
              "#{fun} options: expected only #{Enum.map_join(known, ", ", &inspect/1)}, got " <>
                Enum.map_join(unknown, ", ", &inspect/1)
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
