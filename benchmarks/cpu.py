"""The NumPy backend against torch's CPU SDPA: forward, float32, same process and thread count.

``run()`` times ``flashx.attention(..., backend="numpy")`` (the public path, conversions
included) and ``torch.nn.functional.scaled_dot_product_attention`` on the same random
normal inputs, alternating the two so that a change in machine load hits both alike, and
measures the backend's peak extra memory with tracemalloc (NumPy reports its buffers
there) against the dense score matrix it avoids. ``python -m benchmarks.cpu`` writes
benchmarks/results/cpu-<date>.{json,md}.
"""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import time
import tracemalloc
from pathlib import Path

import numpy as np


def run(batch=1, heads=8, seqlen=4096, head_dim=64, memory_seqlen=8192, repeats=5) -> dict:
    import torch

    import flashx
    from flashx_numpy.parallel import workers

    threads = workers.count
    torch.set_num_threads(threads)
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((batch, seqlen, heads, head_dim), dtype=np.float32) for _ in range(3))
    tq, tk, tv = (torch.from_numpy(x).transpose(1, 2) for x in (q, k, v))  # SDPA wants (B, H, N, D)

    def numpy_forward():
        return flashx.attention(q, k, v, backend="numpy")

    def torch_forward():
        return torch.nn.functional.scaled_dot_product_attention(tq, tk, tv)

    difference = float(np.abs(numpy_forward() - torch_forward().transpose(1, 2).numpy()).max())  # also the warm-up
    load_before = os.getloadavg()
    times = {"numpy": [], "torch": []}
    for _ in range(repeats):
        for name, forward in (("torch", torch_forward), ("numpy", numpy_forward)):
            start = time.perf_counter()
            forward()
            times[name].append(time.perf_counter() - start)
    load_after = os.getloadavg()
    flops = 4.0 * batch * heads * seqlen * seqlen * head_dim
    timing = {
        name: {"median_s": statistics.median(ts), "gflops": flops / statistics.median(ts) / 1e9, "times_s": ts}
        for name, ts in times.items()
    }
    return {
        "shape": {"batch": batch, "heads": heads, "seqlen": seqlen, "head_dim": head_dim, "dtype": "float32", "causal": False},
        "threads": {"numpy_backend_workers": threads, "torch": torch.get_num_threads(), "cpus": os.cpu_count()},
        "forward": timing,
        "speed_vs_torch_sdpa": timing["torch"]["median_s"] / timing["numpy"]["median_s"],
        "paired_speed_vs_torch_sdpa": statistics.median(t / n for t, n in zip(times["torch"], times["numpy"])),
        "max_abs_difference_vs_torch": difference,
        "load_average_1min": {"before": load_before[0], "after": load_after[0]},
        "memory": _peak_memory(flashx, batch, heads, memory_seqlen, head_dim),
        "versions": {"numpy": np.__version__, "torch": torch.__version__, "flashx": flashx.__version__,
                     "python": platform.python_version(), "machine": platform.processor() or platform.machine()},
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


def _main():
    from benchmarks import report

    results = run()
    path = Path(__file__).parent / "results" / f"cpu-{datetime.date.today().isoformat()}.json"
    report.save_json(results, path)
    text = report.cpu_markdown(results)
    path.with_suffix(".md").write_text(text)
    print(text, end="")
    print(f"wrote {path} and {path.with_suffix('.md').name}")


if __name__ == "__main__":
    _main()
