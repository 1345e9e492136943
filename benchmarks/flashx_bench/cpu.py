"""The NumPy backend against torch's CPU SDPA: forward, float32, same process and thread count.

``run()`` times ``flashx.attention(..., backend="numpy")`` (the public path, conversions
included) and ``torch.nn.functional.scaled_dot_product_attention`` on the same random
normal inputs, in pairs, one call of each, so that a change in machine load hits both alike:
the speed reported is the median of the pairs' ratios. It also measures the backend's peak
extra memory with tracemalloc (NumPy reports its buffers there) against the dense score
matrix it avoids. ``flashx bench --cpu`` runs it and writes the ``cpu`` record.
"""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import time
import tracemalloc

import numpy as np

from flashx_bench.progress import Progress

IMPLEMENTATIONS = {"flashx-numpy": "flashx numpy", "sdpa": "torch SDPA (CPU)"}


def run(batch=1, heads=8, seqlen=4096, head_dim=64, memory_seqlen=8192, repeats=5) -> dict:
    import torch

    import flashx

    threads = flashx.registry.get("numpy").threads
    torch.set_num_threads(threads)
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((batch, seqlen, heads, head_dim), dtype=np.float32) for _ in range(3))
    tq, tk, tv = (torch.from_numpy(x).transpose(1, 2) for x in (q, k, v))  # SDPA wants (B, H, N, D)

    def numpy_forward():
        return flashx.attention(q, k, v, backend="numpy")

    def torch_forward():
        return torch.nn.functional.scaled_dot_product_attention(tq, tk, tv)

    progress = Progress(1 + 2 * repeats + 1)
    difference = float(np.abs(numpy_forward() - torch_forward().transpose(1, 2).numpy()).max())  # also the warm-up
    progress.step(f"warm-up and check: largest difference {difference:.1e}")
    load_before = os.getloadavg()
    times = {"flashx-numpy": [], "sdpa": []}
    for _ in range(repeats):
        for name, forward in (("sdpa", torch_forward), ("flashx-numpy", numpy_forward)):
            start = time.perf_counter()
            forward()
            times[name].append(time.perf_counter() - start)
            progress.step(f"{IMPLEMENTATIONS[name]}: {times[name][-1] * 1e3:.0f} ms")
    load_after = os.getloadavg()
    flops = 4.0 * batch * heads * seqlen * seqlen * head_dim
    timing = {
        name: {"median_s": statistics.median(ts), "gflops": flops / statistics.median(ts) / 1e9, "times_s": ts}
        for name, ts in times.items()
    }
    memory = _peak_memory(flashx, batch, heads, memory_seqlen, head_dim)
    progress.step(f"peak memory at N={memory_seqlen}: {memory['peak_extra_bytes'] / 2**20:.1f} MiB")
    progress.close()
    machine = platform.processor() or platform.machine()
    return {
        "kind": "cpu",
        "device": f"{machine}, {os.cpu_count()} CPUs",
        "date": datetime.date.today().isoformat(),
        "shape": {"batch": batch, "heads": heads, "seqlen": seqlen, "head_dim": head_dim, "dtype": "float32", "causal": False},
        "threads": {"numpy_backend_workers": threads, "torch": torch.get_num_threads(), "cpus": os.cpu_count()},
        "forward": timing,
        # One pair is one call of each, back to back: their ratio sees the same machine load.
        "speed_vs_torch_sdpa": statistics.median(t / n for t, n in zip(times["sdpa"], times["flashx-numpy"])),
        "max_abs_difference_vs_torch": difference,
        "load_average_1min": {"before": load_before[0], "after": load_after[0]},
        "memory": memory,
        "versions": {"numpy": np.__version__, "torch": torch.__version__, "flashx": flashx.__version__,
                     "python": platform.python_version(), "machine": machine},
    }


def _peak_memory(flashx, batch, heads, seqlen, head_dim) -> dict:
    """Peak bytes NumPy allocates during one forward (its output included) vs the dense scores."""
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((batch, seqlen, heads, head_dim), dtype=np.float32) for _ in range(3))
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        baseline = tracemalloc.get_traced_memory()[0]
        start = time.perf_counter()
        flashx.attention(q, k, v, backend="numpy")
        seconds = time.perf_counter() - start
        peak = tracemalloc.get_traced_memory()[1] - baseline
    finally:
        tracemalloc.stop()
    dense = batch * heads * seqlen * seqlen * 4
    return {"seqlen": seqlen, "peak_extra_bytes": peak, "dense_scores_bytes": dense,
            "fraction_of_dense": peak / dense, "forward_s": seconds}
