defmodule ScanBridge.MixProject do
  use Mix.Project

  # No dependencies: hex.pm is unreachable where this is built and tested, and the client only
  # needs OTP. Nx support compiles in only when Nx is loaded while this compiles (undeclared, it
  # is left out from Elixir 1.15 on, which keeps undeclared applications off the compile path).
  def project do
    [
      app: :scan_bridge,
      version: "0.1.0",
      elixir: "~> 1.14",
      start_permanent: Mix.env() == :prod,
      elixirc_paths: elixirc_paths(Mix.env()),
      deps: []
    ]
  end

  def application do
    [extra_applications: [:logger], mod: {ScanBridge.Application, []}]
  end

  defp elixirc_paths(:test), do: ["lib", "test/support"]
  defp elixirc_paths(_), do: ["lib"]
end
