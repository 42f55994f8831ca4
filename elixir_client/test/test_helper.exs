# The tests run against the real server (`python -m bridge` from this checkout). What it
# supports decides which feature tests run; the rest are skipped with the reason printed here, except
# in CI.
alias ScanBridge.TestSupport

# The library's default interpreter, for the doctests (which start servers with no :python).
System.put_env("SCAN_BRIDGE_PYTHON", TestSupport.python())
System.put_env("PYTHONPATH", System.get_env("PYTHONPATH") || TestSupport.repo_root())
System.put_env("SCAN_BRIDGE_LOG", System.get_env("SCAN_BRIDGE_LOG", "WARNING"))

probe = TestSupport.probe!()
IO.puts("scan-bridge server ops: #{Enum.join(probe.ops, ", ")}; unix lane: #{probe.unix_lane}")

skips =
  for feature <- TestSupport.features(), reason = TestSupport.skip_reason(feature) do
    "the #{feature} tests: #{reason}"
  end

# In CI (CI=true) every test must run: a server that lost an op would otherwise pass as skips.
if skips != [] and System.get_env("CI") == "true" do
  raise "CI: the server lacks what these tests need (each fails the run):\n" <>
          Enum.join(skips, "\n")
end

Enum.each(skips, &IO.puts("SKIPPING #{&1}"))

# assert_receive's default wait (100 ms) is for a quiet machine; a loaded CI box can take longer
# to deliver what a server or another process sends, and the wait only costs a failing test.
ExUnit.start(assert_receive_timeout: 2_000)
