# The tests run against the real server (`python -m bridge` from this checkout). What it
# supports decides which feature tests run; the rest are skipped with the reason printed here.
alias ScanBridge.TestSupport

# The library's default interpreter, for the doctests (which start servers with no :python).
System.put_env("SCAN_BRIDGE_PYTHON", TestSupport.python())
System.put_env("PYTHONPATH", System.get_env("PYTHONPATH") || TestSupport.repo_root())
System.put_env("SCAN_BRIDGE_LOG", System.get_env("SCAN_BRIDGE_LOG", "WARNING"))

probe = TestSupport.probe!()
IO.puts("scan-bridge server ops: #{Enum.join(probe.ops, ", ")}; unix lane: #{probe.unix_lane}")

for feature <- TestSupport.features(), reason = TestSupport.skip_reason(feature) do
  IO.puts("SKIPPING the #{feature} tests: #{reason}")
end

ExUnit.start()
