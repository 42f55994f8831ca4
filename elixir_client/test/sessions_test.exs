defmodule ScanBridge.SessionsTest do
  # Sessions over the Port: prefilled by a scan, stepped, read, closed.
  use ExUnit.Case, async: false

  alias ScanBridge.TestSupport

  if reason = TestSupport.skip_reason(:sessions), do: @moduletag(skip: reason)

  setup_all do
    %{server: start_supervised!({ScanBridge, TestSupport.server_opts()})}
  end

  setup do
    :rand.seed(:exsss, {5, 6, 7})
    :ok
  end

  # {id, sizes, optional tensors, options, prefill steps, steps}
  @cases [
    {"plain", %{batch: 2, dim: 5, state: 3}, [], %{}, 6, 3},
    {"every option, 3 groups", %{batch: 3, dim: 6, state: 4, groups: 3}, [:D, :z, :dt_bias],
     %{dt_softplus: true, dt_min: 0.02, dt_max: 0.6}, 5, 4},
    {"batch 1, one-step prefill", %{batch: 1, dim: 7, state: 2}, [:D], %{}, 1, 5}
  ]

  for {id, sizes, optional, options, prefill, steps} <- @cases do
    test "a session prefilled and stepped matches the reference: #{id}", %{server: server} do
      TestSupport.assert_session_scenario(
        server,
        unquote(Macro.escape(sizes)),
        unquote(optional),
        unquote(Macro.escape(options)),
        unquote(prefill),
        unquote(steps)
      )
    end
  end

  test "sessions are the client's: an unknown id is :unknown_session", %{server: server} do
    assert {:error, %ScanBridge.Error{reason: :unknown_session}} =
             ScanBridge.session_state(server, "no-such-session")

    assert {:error, %ScanBridge.Error{reason: :unknown_session}} =
             ScanBridge.close_session(server, "no-such-session")
  end
end
