"""Benchmarks, run from the repository root: ``python -m experiments.bench.NAME [--smoke]``."""
