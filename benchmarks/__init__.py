"""flashx benchmarks: `python -m benchmarks` (see benchmarks/README.md)."""
