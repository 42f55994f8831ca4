defmodule ScanBridge.Unexpected do
  @moduledoc false
  # What the client's processes do with a call or cast they do not take (one sent to the wrong
  # process, say): log it and serve on. Raising would end the process, and with a client every
  # call in flight and the OS server it owns, or with a cluster session its checkpoint.

  require Logger

  alias ScanBridge.Error

  @doc "The reply to a call `module` does not take: `{:error, %Error{reason: :invalid_argument}}`."
  @spec call(module, term) :: {:error, Error.t()}
  def call(module, request) do
    message = "#{inspect(module)} takes no call #{inspect(request, limit: 5)}"
    Logger.warning("scan-bridge: #{message}; refused")
    {:error, Error.client(:invalid_argument, message, %{"call" => inspect(request, limit: 5)})}
  end

  @doc "Logs a cast `module` does not take."
  @spec cast(module, term) :: :ok
  def cast(module, request) do
    Logger.warning(
      "scan-bridge: #{inspect(module)} takes no cast #{inspect(request, limit: 5)}; dropped"
    )
  end
end
