defmodule ScanBridge.ErrorTest do
  # Every code of the protocol's error table (SPEC §7) is one this client knows: its own atom,
  # not the :internal_error an unknown code becomes.
  use ExUnit.Case, async: true

  alias ScanBridge.{Error, TestSupport}

  @spec_path Path.join(TestSupport.repo_root(), "protocol/SPEC.md")
  @external_resource @spec_path
  @codes @spec_path
         |> File.read!()
         |> String.split("## 7. Errors\n")
         |> Enum.at(1)
         |> String.split("\n## ")
         |> hd()
         |> then(&Regex.scan(~r/^\| `(\w+)` \|/m, &1, capture: :all_but_first))
         |> List.flatten()

  test "the table is read" do
    assert "internal_error" in @codes and "state_lost" in @codes
  end

  for code <- @codes do
    test "#{code} is its own reason" do
      error = Error.from_server(%{"code" => unquote(code), "message" => "m", "detail" => %{}})
      assert error.reason == String.to_atom(unquote(code))
      assert error.code == unquote(code)
    end
  end
end
