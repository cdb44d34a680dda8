"""Benchmarks: each module writes CSV under reports/bench/; `python -m bench` runs them all."""
