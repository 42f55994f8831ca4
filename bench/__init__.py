"""Repo-only benchmarks, run from a checkout as `python -m bench.X`; not installed. Each measures
its baseline in the same run and writes JSON only where --json says (the recordings that README
and docs cite live in bench/results/). They build on bridge.bench (echo floors, lean client
lanes, machine and commit info); bridge never imports this package."""
