defmodule ScanBridge.Error do
  @moduledoc """
  Why a request failed, as a value (`{:error, %ScanBridge.Error{}}`) or raised by the `!`
  functions.

  `reason` is an atom a program can match on:

    * the client's own: `:timeout` (the call's deadline passed first; the late reply is
      dropped, though the server may still have carried the request out: see `ScanBridge`),
      `:server_exited` (the server's OS process or its lane went away while the
      request was pending), `:not_running` (no client process under that name or pid),
      `:startup_failed`, `:startup_timeout`, `:decode_error` (a reply that is not valid
      protocol, or a frame the client could not decode), `:frame_too_large` (the request is
      bigger than the server accepts; it was not sent), `:overloaded` (the deadline passed
      while `:max_in_flight` requests were at the server, or before the busy or starting
      client process took the call: this one was never sent);
    * a cluster's (`ScanBridge.Cluster`): `:node_down` (the node of the server went down
      while the call was pending), `:no_members` (the group has no server), `:session_lost`
      (a cluster session's server went away with its state, which could not be rebuilt
      elsewhere);
    * the server's error codes (protocol SPEC §7), e.g. `:shape_mismatch`, `:unknown_session`,
      `:overloaded`; whole models add `:unknown_model`, `:unknown_snapshot`,
      `:invalid_checkpoint` (its `detail["field"]` names the key or tensor at fault) and
      `:path_not_allowed`; `:state_lost` (a step, prefill or restore of the session failed partway,
      its own error's `detail["state"]` being `"lost"`, and left its state undefined: restore
      a snapshot into it or close it; or, a restore's, with `detail["snapshot"]`, a model step's
      copy into that snapshot failed partway and left it undefined: step into it again or take
      a new one); `:deadline_exceeded` (the request's budget, its call's
      deadline, ran out on the server before it started: it was not run) and `:cancelled` (a
      `cancel` dropped it before it started: it was not run). A code this client does not
      know becomes `:internal_error`, as the specification requires; `code` keeps the string
      the server sent.

  `detail` is the server's `detail` map (string keys, e.g. `"field"`, `"expected"`, `"got"`)
  or, for client-side reasons, a map saying what happened (e.g. `%{"exit_status" => 137}`).
  """

  @server_codes ~w(frame_too_large decode_error invalid_request unsupported_version unknown_op
                   missing_argument invalid_argument unknown_dtype tensor_size_mismatch
                   shape_mismatch unknown_session unknown_handle unknown_model unknown_snapshot
                   state_lost invalid_checkpoint path_not_allowed limit_exceeded unsupported
                   overloaded shutting_down deadline_exceeded cancelled internal_error)
  @reason_of_code Map.new(@server_codes, fn code -> {code, String.to_atom(code)} end)

  @type server_reason ::
          :frame_too_large
          | :decode_error
          | :invalid_request
          | :unsupported_version
          | :unknown_op
          | :missing_argument
          | :invalid_argument
          | :unknown_dtype
          | :tensor_size_mismatch
          | :shape_mismatch
          | :unknown_session
          | :unknown_handle
          | :unknown_model
          | :unknown_snapshot
          | :state_lost
          | :invalid_checkpoint
          | :path_not_allowed
          | :limit_exceeded
          | :unsupported
          | :overloaded
          | :shutting_down
          | :deadline_exceeded
          | :cancelled
          | :internal_error
  @type client_reason ::
          :timeout
          | :server_exited
          | :not_running
          | :startup_failed
          | :startup_timeout
          | :overloaded
          | :node_down
          | :no_members
          | :session_lost
  @type reason :: server_reason | client_reason

  @type t :: %__MODULE__{
          reason: reason,
          code: String.t() | nil,
          message: String.t(),
          detail: map
        }

  defexception reason: :internal_error, code: nil, message: "", detail: %{}

  @doc """
  The error carried by a server's error reply (`{"code", "message", "detail"}`).

      iex> ScanBridge.Error.from_server(%{"code" => "unknown_session", "message" => "no session", "detail" => %{}})
      %ScanBridge.Error{reason: :unknown_session, code: "unknown_session", message: "no session", detail: %{}}

      iex> ScanBridge.Error.from_server(%{"code" => "from_the_future", "message" => "?"}).reason
      :internal_error

      iex> ScanBridge.Error.from_server(%{"code" => "internal_error", "message" => %{"a" => 1}}).message
      "server error \\"internal_error\\""
  """
  @spec from_server(map) :: t
  def from_server(%{} = error) do
    code = Map.get(error, "code")
    detail = Map.get(error, "detail")

    %__MODULE__{
      reason: Map.get(@reason_of_code, code, :internal_error),
      code: if(is_binary(code), do: code),
      message: message(Map.get(error, "message"), code),
      detail: if(is_map(detail), do: detail, else: %{})
    }
  end

  # A server that breaks the reply format must not crash the client: anything but a string
  # gives way to the code.
  defp message(message, _code) when is_binary(message), do: message
  defp message(_other, code), do: "server error #{inspect(code)}"

  @doc "An error found by the client itself (no server code)."
  @spec client(
          client_reason | :decode_error | :frame_too_large | :invalid_argument | :unknown_snapshot,
          String.t(),
          map
        ) ::
          t
  def client(reason, message, detail \\ %{}) do
    %__MODULE__{reason: reason, message: message, detail: detail}
  end
end
