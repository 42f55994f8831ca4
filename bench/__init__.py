"""Benchmarks: each measures its baseline in the same run and records JSON under bench/results/."""
