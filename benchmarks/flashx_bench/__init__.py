"""flashx's benchmarks: ``flashx bench`` or ``python -m flashx_bench`` (benchmarks/README.md says how).

The GPU sweep times every flashx backend available on the device beside PyTorch's attention
kernels; the CPU comparison times the NumPy backend against torch's CPU SDPA. Each run keeps one
current record per device and appends its numbers to a history table (``records``).
"""
